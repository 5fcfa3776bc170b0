"""Unmodified PyTorch on a remote GPU: the ``gpuremote`` device.

.. code-block:: python

    import torch
    import gpuremote.torch as gt

    with gt.connect("tcp://gpu-host:7766"):
        model = MyModel().to("gpuremote")
        x = torch.randn(8, 32, device="gpuremote")
        loss = model(x).sum()
        loss.backward()
        print(loss.item(), gt.stats()["round_trips"])

``gt.connect(url, **options)`` opens a session (any URL the project takes, ``pool://NAME``);
after it, plain PyTorch code runs on the device
``gpuremote``: every ATen op is an ASYNC call queued in the session's batches (its outputs'
shapes come from PyTorch's meta kernels, cached per signature); views stay on the client; only
reads (``.item()``, ``.cpu()``, printing) and ops whose results depend on the data
(``nonzero``, boolean masks) wait for the proxy. The proxy runs the ops with torch on views
of the session's buffers (CuPy's on a GPU, NumPy's on a CPU proxy). Needs torch on both
sides (``pip install 'gpuremote[torch]'``); tested with torch 2.13.
"""

from __future__ import annotations

from typing import Any

try:
    import torch as _torch
except ImportError as _exc:  # pragma: no cover - the extra is missing
    raise ImportError("gpuremote.torch needs PyTorch: pip install 'gpuremote[torch]'") from _exc

from ..core.driver import SyncDriver
from ._backend import DEVICE, dispatcher, open_driver, register
from .distributed import register_backend as _register_distributed

__all__ = ["DEVICE", "Connection", "connect", "connect_local", "stats"]

# the device exists from the import on: PyTorch's autograd engine sizes its device threads at
# its first backward pass, which must come after this (import gpuremote.torch early)
register()
# and so does the torch.distributed backend: dist.init_process_group("gpuremote")
_register_distributed()


class Connection:
    """The session serving the device (``connect`` returns one): ``close()`` (or the end of
    a ``with`` block) ends it, and the device goes back to the connection it had before, if
    that one is still open; ``stats()`` gives its figures."""

    def __init__(self, drivers: list[SyncDriver], previous: dict[int, SyncDriver]) -> None:
        self.drivers = drivers
        self._previous = previous

    @property
    def devices(self) -> list[_torch.device]:
        """The torch devices this connection serves."""
        return [_torch.device(DEVICE, i) for i in range(len(self.drivers))]

    def stats(self, index: int = 0) -> dict[str, Any]:
        """The session's counters of device ``index`` (as ``GPU.stats()``: calls per
        class, ``frames_sent``, ``round_trips``, ``bytes_sent``, ...; and its compiled
        graphs: ``graphs_recorded``, ``graph_replays``, ``graphs_eager``)."""
        return _stats(self.drivers[index])

    def synchronize(self) -> None:
        """Wait until every op queued so far has run; raises the first deferred error."""
        from ..wire.calls import CALLS_BY_NAME

        for d in self.drivers:
            d.call(CALLS_BY_NAME["device_synchronize"], [])

    def close(self) -> None:
        """Send what is queued and close the sessions (idempotent)."""
        for i, d in enumerate(self.drivers):
            d.close()
            if dispatcher.drivers.get(i) is d:
                before = self._previous.get(i)
                if before is not None and not before.closed:
                    dispatcher.drivers[i] = before
                else:
                    del dispatcher.drivers[i]

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        urls = ", ".join(d.url for d in self.drivers)
        return f"<gpuremote.torch.Connection {urls}>"


def _install(drivers: list[SyncDriver]) -> Connection:
    """Serve the device by ``drivers`` from now on (the connection before is kept, for when
    this one is closed)."""
    register()
    previous = dict(dispatcher.drivers)
    dispatcher.drivers.update(enumerate(drivers))
    return Connection(drivers, previous)


def connect(url: str | list[str] | None = None, **options: Any) -> Connection:
    """Connect the ``gpuremote`` device to the proxy at ``url`` (else ``GPUREMOTE_URL``, the
    config file, the default; ``pool://NAME``: a pool's least-loaded proxy). Options are
    those of ``gpuremote.connect`` (``secret=``, pipeline settings). Without a ``connect``,
    the first use of the device connects to the configured URL. ``failover=``: the session
    moves to another proxy when its own is lost (``gpuremote.connect``'s option).

    Several devices, ``gpuremote:0..k-1``, one session each: ``devices=k`` on a pool
    (``pool://NAME``: k different proxies), or a list of URLs (or one string of them,
    comma-separated). Tensors move between them proxy to proxy (``x.to("gpuremote:1")``).
    More than one device needs the device guard library (``gpuremote.torch._guard``: C++,
    built with torch's ``cpp_extension`` at first use); connect them before the first
    backward pass (PyTorch's autograd sizes its device threads then)."""
    k = options.pop("devices", None)
    register()
    if isinstance(url, str) and "," in url:
        url = [u.strip() for u in url.split(",") if u.strip()]
    if isinstance(url, list):
        if k not in (None, len(url)):
            raise ValueError(f"devices={k} but {len(url)} URLs")
        urls = url
    elif k not in (None, 1):
        from ..session.opener import devices_now

        urls, options = devices_now(url, int(k), options)
    else:
        return _install([open_driver(url, None, options)])
    if len(urls) > 1:
        _many_devices(len(urls))
    return _install([open_driver(u, None, options) for u in urls])


def _many_devices(k: int) -> None:
    """Make ``gpuremote:0..k-1`` possible: the guard library, loaded (or the reason not)."""
    from . import _guard

    if _guard.load() is None:
        raise NotImplementedError(
            f"gpuremote.torch serves {k} devices with its device guard library, which is not "
            f"available here ({_guard.why_not()}); one device works without it"
        )
    _guard.set_device_count(max(k, _guard.device_count()))


def connect_local(
    backend: str = "numpy", url: str | None = None, **proxy_options: Any
) -> Connection:
    """Serve a proxy inside this process (``backend`` numpy, cupy, sim:check, ...; over
    ``url``, default ``inproc://``) and connect the ``gpuremote`` device to it: the whole
    path, for tests and for trying code without a proxy machine. ``proxy_options``: the
    ``Proxy``'s (``session_limits=SessionLimits(graphs="inductor")``, ...)."""
    register()
    options = {"proxy_options": proxy_options} if proxy_options else {}
    return _install([open_driver(url, backend, options)])


def stats(index: int = 0) -> dict[str, Any]:
    """The counters of the session serving ``gpuremote:index`` (``Connection.stats``)."""
    return _stats(dispatcher.driver(index))


def _stats(d: SyncDriver) -> dict[str, Any]:
    from ._compile import counts

    return {**d.stats(), **counts(d)}
