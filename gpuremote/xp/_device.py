"""A proxy connection driven from synchronous code, with arrays: the array API's device.

The session and the event loop it lives on are driven by ``gpuremote.core.driver.SyncDriver``
(calls posted without waiting, a waiting call runs the loop in the calling thread); a
``Device`` adds the array core on top.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.arrays import Call, Core, HostCopies, drive_now
from ..core.driver import SyncDriver
from ..session.contract import Reply
from ..wire.calls import CALLS_BY_NAME
from ._array import Array

__all__ = ["Device", "default_device", "set_default_device"]

_C = CALLS_BY_NAME

_OPEN: weakref.WeakSet[Device] = weakref.WeakSet()
_opened = itertools.count()  # the order devices were opened in


class Device(SyncDriver):
    """A connection to a gpuremote proxy, usable from plain synchronous code.

    ``gpuremote.xp.connect(url)`` makes one (and makes it the default device); arrays carry
    theirs as ``x.device``. ``close()`` (or a ``with`` block) ends the session.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        serve: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(url, serve=serve, **options)
        cfg = self.session.config
        #: the array core of this device's session (``gpuremote.core.arrays``)
        self.core = Core(
            self,
            self.session,
            self.post,
            self._release,
            Array,
            HostCopies(cfg.shadow, cfg.shadow_max_bytes),
            self.send_replay,
        )
        self._order = next(_opened)
        _OPEN.add(self)

    # -- arrays (the array core's; this front end only waits) -------------------------------
    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
        """A new, uninitialised array (one ASYNC alloc)."""
        out: Array = self.core.empty(shape, dtype)
        return out

    def upload(self, host: np.ndarray[Any, Any]) -> Array:
        """A remote copy of ``host`` (ASYNC alloc and upload; the host copy is kept within
        the session's ``shadow_max_bytes``)."""
        out: Array = self.core.upload(host)
        return out

    def copy_from(self, array: Array) -> Array:
        """A copy on this device of ``array``, which is on another one: proxy to proxy where
        this device's proxy can reach the other's (the data never comes to this process),
        else through this process. ``last_copy`` says which way the last one went."""
        out, self.last_copy = drive_now(array._core.to_device(array, self.core), _call)
        return out

    def launch(
        self,
        name: str,
        arrays: Sequence[Array],
        params: dict[str, Any],
        into: Array | None = None,
    ) -> list[Array]:
        """Run op ``xp.name`` (ASYNC): new output arrays, or in place into ``into``."""
        return self.core.launch(name, arrays, params, None if into is None else [into])

    def launch_dynamic(
        self, name: str, arrays: Sequence[Array], params: dict[str, Any], n_out: int
    ) -> list[Array]:
        """Run op ``xp.name``, whose output shapes depend on the data (SYNC)."""
        outs: list[Array] = drive_now(self.core.dynamic(name, arrays, params, n_out), _call)
        return outs

    def fetch(self, array: Array) -> np.ndarray[Any, Any]:
        """The array's data on the host: its kept host copy, else a device-to-host copy
        (SYNC), kept where the host-copy policy allows."""
        core = self.core
        host = core.cached(array)
        if host is not None:
            return host
        (_, spec, _, args, buf), writes = core.download(array)
        return core.downloaded(array, self.call(spec, args, buf), writes)

    def synchronize(self) -> None:
        """Wait until everything posted has run; raises the first deferred error."""
        self.call(_C["device_synchronize"], [])

    def close(self) -> None:
        """Send what is posted and close the session (idempotent)."""
        super().close()
        global _DEFAULT
        if _DEFAULT is self:
            _DEFAULT = None

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.backend
        return f"<gpuremote.xp.Device {self.url} ({state})>"


def _call(request: Call) -> Reply:
    """A call of an array core procedure, made on its device (``drive_now``)."""
    core, spec, _, args, buf = request
    device: Device = core.owner
    return device.call(spec, args, buf)


_DEFAULT: Device | None = None


def set_default_device(device: Device | None) -> None:
    """Make ``device`` the one creation functions use when given no ``device=``."""
    global _DEFAULT
    _DEFAULT = device


def default_device() -> Device:
    """The default device; connects to the configured proxy URL on first use, and again
    after the connection was lost (the call that found it lost raised ``ConnectionClosed``)."""
    global _DEFAULT
    if _DEFAULT is not None and _DEFAULT.lost and not _DEFAULT.closed:
        with contextlib.suppress(Exception):
            _DEFAULT.close()
        _DEFAULT = None
    if _DEFAULT is None or _DEFAULT.closed:
        _DEFAULT = Device()
    return _DEFAULT


def open_devices() -> list[Device]:
    """The devices open in this process, the default one first, then in the order they were
    opened; with none open, the default device (which connects)."""
    opened = sorted((d for d in _OPEN if not d.closed), key=lambda d: d._order)
    if _DEFAULT is not None and _DEFAULT in opened:
        opened.remove(_DEFAULT)
        opened.insert(0, _DEFAULT)
    return opened or [default_device()]


@atexit.register
def _close_all() -> None:
    for device in list(_OPEN):
        device.close()
