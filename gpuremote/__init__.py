"""gpuremote: GPU API remoting over the network.

An application with no GPU sends GPU work (allocations, copies, kernel launches,
synchronisation) to a proxy process that owns the GPU::

    import gpuremote

    async with gpuremote.connect("tcp://gpu-box:5151") as gpu:
        y = gpu.tanh(gpu.matmul(gpu.asarray(x), gpu.asarray(w)))
        out = await y.get()

The proxy: ``gpuremote serve --listen tcp://0.0.0.0:5151``.
"""

from __future__ import annotations

from typing import Any

from . import _build
from .aio import run
from .client import GPU, Event, Kernel, RemoteArray, Stream, connect
from .config import PipelineConfig
from .errors import (
    CaptureError,
    ConfigError,
    ConnectionClosed,
    FailoverError,
    GpuRemoteError,
    LimitExceeded,
    LocalProtocolError,
    ProtocolError,
    RemoteCallError,
    RemoteProtocolError,
    TransportUnavailable,
)
from .wire.calls import CALLS, CallClass

__version__ = "0.1.0"

_build.check()  # a compiled module older than its source (an editable build in place) warns


def __getattr__(name: str) -> Any:
    """``gpuremote.Proxy``, imported on first use: a client never loads the proxy side."""
    if name == "Proxy":
        from .proxy import Proxy

        return Proxy
    raise AttributeError(f"module 'gpuremote' has no attribute {name!r}")


__all__ = [
    "CALLS",
    "GPU",
    "CallClass",
    "CaptureError",
    "ConfigError",
    "ConnectionClosed",
    "Event",
    "FailoverError",
    "GpuRemoteError",
    "Kernel",
    "LimitExceeded",
    "LocalProtocolError",
    "PipelineConfig",
    "ProtocolError",
    "Proxy",
    "RemoteArray",
    "RemoteCallError",
    "RemoteProtocolError",
    "Stream",
    "TransportUnavailable",
    "__version__",
    "connect",
    "run",
]
