"""``gpuremote.xp``: a Python array API namespace (standard 2024.12) whose arrays live on a
gpuremote proxy.

Code written against the array API standard runs on a remote GPU unchanged::

    import gpuremote.xp as xp

    xp.connect("tcp://gpu-box:5151")         # or GPUREMOTE_URL / gpuremote.toml, on first use
    a = xp.asarray(numpy_data)               # ASYNC upload; the host copy is kept
    b = xp.tanh(a @ a.T) + 1                 # ASYNC launches; shapes and dtypes known locally
    if float(xp.max(b)) > 2: ...             # SYNC: brings one number back

Synchronous like the standard, asynchronous underneath: every function that returns arrays
is queued through the session's pipeline; only conversions to host values (``bool()``,
``float()``, ``int()``, ``__index__``, ``np.asarray``, ``__dlpack__``, ``to_device("cpu")``)
and functions whose output shape depends on the data (``nonzero``, ``unique_*``, boolean
masks, ``repeat`` by an array) wait for the proxy. The session runs on an event loop in a
background thread, so plain scripts need no asyncio.
"""

from __future__ import annotations

import builtins as _builtins
import math as _math
from collections.abc import Callable as _Callable
from typing import Any as _Any
from typing import overload as _overload

from ..core.capture import Step as _Step
from ..session.opener import devices_now as _devices_now
from . import _standard, fft, linalg
from ._array import Array as Array
from ._device import Device, default_device, open_devices, set_default_device
from ._dtypes import NAMED as _NAMED
from ._dtypes import DType as DType
from ._functions import *  # noqa: F403
from ._functions import _KINDS, isdtype

__array_api_version__ = "2024.12"

# dtypes: objects of the namespace's own that equal NumPy's (``x.dtype == np.float32``)
bool = _NAMED["bool"]
int8 = _NAMED["int8"]
int16 = _NAMED["int16"]
int32 = _NAMED["int32"]
int64 = _NAMED["int64"]
uint8 = _NAMED["uint8"]
uint16 = _NAMED["uint16"]
uint32 = _NAMED["uint32"]
uint64 = _NAMED["uint64"]
float32 = _NAMED["float32"]
float64 = _NAMED["float64"]
complex64 = _NAMED["complex64"]
complex128 = _NAMED["complex128"]

e = _math.e
inf = _math.inf
nan = _math.nan
pi = _math.pi
newaxis = None

_DTYPES = {
    d.name: d
    for d in (
        bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64,
        float32, float64, complex64, complex128,
    )
}  # fmt: skip


@_overload
def connect(url: str | None = None, *, devices: None = None, **options: _Any) -> Device: ...


@_overload
def connect(url: str | None = None, *, devices: int, **options: _Any) -> list[Device]: ...


def connect(
    url: str | None = None, *, devices: int | None = None, **options: _Any
) -> Device | list[Device]:
    """Connect to the proxy at ``url`` (else ``GPUREMOTE_URL``, the config file, the default)
    and make it the default device. Options are those of ``gpuremote.connect`` (``secret=``,
    pipeline settings). Use as ``with xp.connect(url):`` to close it at the end.

    ``pool://NAME`` places the session on a pool's least-loaded proxy (``gpuremote.pool``);
    ``devices=k`` opens ``k`` sessions on ``k`` different proxies of the pool and returns the
    list of devices (the first becomes the default)."""
    k = devices
    if k is None:
        device = Device(url, **options)
        set_default_device(device)
        return device
    urls, options = _devices_now(url, int(k), options)
    opened: list[Device] = []
    try:
        for u in urls:
            opened.append(Device(u, **options))
    except BaseException:
        for d in opened:
            d.close()
        raise
    set_default_device(opened[0])
    return opened


def connect_local(backend: str = "numpy", url: str | None = None) -> Device:
    """Serve a proxy inside this process (``backend`` numpy, cupy or auto; over ``url``,
    default ``inproc://``) and connect to it as the default device: the whole gpuremote
    path, for tests and for trying code without a proxy machine."""
    device = Device(url, serve=backend)
    set_default_device(device)
    return device


class _Captured:
    """What ``capture`` returns: ``fn`` captured on the device of the arrays it is given."""

    def __init__(self, fn: _Callable[..., _Any], fallback: _builtins.bool) -> None:
        self._fn = fn
        self._fallback = fallback
        self._steps: dict[_Any, _Step] = {}

    def __call__(self, *args: _Any, **static: _Any) -> _Any:
        device = next((a.device for a in args if isinstance(a, Array)), None)
        core = (device or default_device()).core
        step = self._steps.get(core)
        if step is None:
            step = self._steps[core] = _Step(core, self._fn, fallback=self._fallback)
        return step(*args, **static)

    def stats(self) -> dict[str, _Any]:
        """Per device: signatures recorded, replays (``gpuremote.core.capture.Step.stats``)."""
        return {core.owner.url: s.stats() for core, s in self._steps.items()}

    def free(self) -> None:
        """Forget the recordings, on every device."""
        for s in self._steps.values():
            s.free()
        self._steps.clear()


def capture(fn: _Callable[..., _Any], *, fallback: _builtins.bool = False) -> _Captured:
    """``fn`` (array API code: arrays in, arrays out) recorded once per signature and
    replayed by one message, as ``jax.jit`` compiles once: its non-array arguments are
    static; what needs data while recording (``bool()``, ``float()``, a data-dependent
    shape) raises ``CaptureError`` naming the call and the line, or, with ``fallback``,
    runs uncaptured. See ``gpuremote.core.capture``."""
    return _Captured(fn, fallback)


class _Info:
    """What ``__array_namespace_info__()`` returns."""

    def capabilities(self) -> dict[str, _Any]:
        """What this namespace supports."""
        return {"boolean indexing": True, "data-dependent shapes": True, "max dimensions": 32}

    def default_device(self) -> Device:
        """The default device."""
        return default_device()

    def devices(self) -> list[Device]:
        """The devices open in this process (the default one first)."""
        return open_devices()

    def default_dtypes(self, *, device: _Any = None) -> dict[str, _Any]:
        """The default dtype of each kind."""
        return {
            "real floating": float64,
            "complex floating": complex128,
            "integral": int64,
            "indexing": int64,
        }

    def dtypes(self, *, device: _Any = None, kind: _Any = None) -> dict[str, _Any]:
        """The supported dtypes (of ``kind``, if given), by name."""
        if kind is None:
            return dict(_DTYPES)
        return {n: d for n, d in _DTYPES.items() if isdtype(d, kind)}


def __array_namespace_info__() -> _Info:
    """The namespace's inspection object (the standard's ``__array_namespace_info__``):
    its capabilities, default device and dtypes, and the devices open."""
    return _Info()


def implemented() -> dict[str, list[str]]:
    """The standard's functions (``linalg.`` and ``fft.`` for the extensions) that this
    namespace implements, and those it does not."""
    ns = globals()
    names = [n for n in _standard.FUNCTIONS if callable(ns.get(n))]
    names += [f"linalg.{n}" for n in _standard.LINALG if callable(getattr(linalg, n, None))]
    names += [f"fft.{n}" for n in _standard.FFT if callable(getattr(fft, n, None))]
    every = [
        *_standard.FUNCTIONS,
        *(f"linalg.{n}" for n in _standard.LINALG),
        *(f"fft.{n}" for n in _standard.FFT),
    ]
    return {"implemented": names, "missing": [n for n in every if n not in names]}


__all__ = sorted(
    {
        *(n for n in _standard.FUNCTIONS if n in globals()),
        *_DTYPES,
        "Array",
        "Device",
        "__array_api_version__",
        "capture",
        "connect",
        "connect_local",
        "default_device",
        "e",
        "fft",
        "implemented",
        "inf",
        "linalg",
        "nan",
        "newaxis",
        "pi",
        "set_default_device",
    }
)

del _KINDS
