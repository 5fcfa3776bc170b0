"""Backends run the proxy's commands on an array library: NumPy (CPU) or CuPy (GPU).

Both implement ``Backend``; ops are written once against ``backend.xp``. ``get_backend("auto")``
picks CuPy when a GPU is usable, else NumPy.
"""

from __future__ import annotations

from .base import Backend, BackendError, DeviceInfo
from .numpy_backend import NumpyBackend

__all__ = ["Backend", "BackendError", "DeviceInfo", "NumpyBackend", "cupy_usable", "get_backend"]


def cupy_usable() -> tuple[bool, str]:
    """Whether the CuPy backend can run here, and why not if it cannot."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return False, f"cupy is not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no usable CUDA device ({type(exc).__name__}: {exc})"
    if n < 1:
        return False, "no CUDA device"
    return True, f"{n} CUDA device(s)"


def get_backend(name: str = "auto") -> Backend:
    """The backend called ``name``: ``numpy``, ``cupy``, ``auto`` or ``sim`` (a simulated
    device, ``sim:op_us=50`` for 50 µs per op; ``sim:check`` checks stream order;
    ``sim:a100`` times ops as that GPU would, ``sim:a100,compute=0`` without computing them;
    options combine: ``sim:check,op_us=50``)."""
    if name == "numpy":
        return NumpyBackend()
    if name == "sim" or name.startswith("sim:"):
        from .sim_backend import SimBackend, SimOptions

        options = SimOptions.parse(name)
        if options.check:
            from .simcheck import SimCheckBackend

            return SimCheckBackend(options.op_us)
        return SimBackend(options.op_us, options.profile, options.compute)
    if name in ("cupy", "auto"):
        ok, why = cupy_usable()
        if ok:
            from .cupy_backend import CupyBackend

            return CupyBackend()
        if name == "cupy":
            raise BackendError(f"the cupy backend is not available: {why}")
        return NumpyBackend(fallback_reason=why)
    raise BackendError(f"unknown backend {name!r}; choose auto, cupy, numpy or sim")
