"""The device guard for ``gpuremote:0..k-1``: a small C++ library (``_guard.cpp``) built with
torch's own ``cpp_extension`` at first use (the device's registration) and cached per torch
build, Python version and source, under ``~/.cache/gpuremote/torch`` (``GPUREMOTE_CACHE``).
It also registers the CPU's view kernels (``as_strided``, ``view``, ``_reshape_alias``,
``unfold``, ``view_as_real``, ``view_as_complex``) for the device, so that a view (metadata
only) never reaches the Python fallback, and gives ``native_quick``: an op's arguments to its
template signature in C (``_encoding._quick``).

PyTorch's Python backend API serves one device index: its guard says index 0 whatever is set,
and its empty-tensor factory makes index 0. The library's guard replaces that one when it
loads (a thread-local current index, a device count set here) and gives a factory that takes
the index; it also resizes a remote storage (FSDP's ``resize_``), which PyTorch asks of a
device's C++ hooks. Where it cannot be built (no C++ compiler or ninja,
``GPUREMOTE_TORCH_NATIVE=0``), ``load`` returns None and says why (``why_not``): one device,
its views through the Python fallback, its template signatures and new tensors in Python.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "current_device",
    "device_count",
    "empty_on",
    "load",
    "loaded",
    "native_keys",
    "native_new_tensor",
    "native_quick",
    "set_device",
    "set_device_count",
    "set_storage",
    "why_not",
]

_SOURCE = Path(__file__).with_name("_guard.cpp")
_lock = threading.Lock()
_ops: Any = None
_module: Any = None  # (the library as a Python module: ``native_quick``)
_why = ""


#: the library's compiler flags (``cpp_extension.load`` adds no optimisation flag: -O0, every
#: inline helper of Python's and torch's headers a call of its own)
_CFLAGS = ["-O2"]


def _build_dir() -> Path:
    root = Path(os.environ.get("GPUREMOTE_CACHE") or Path.home() / ".cache" / "gpuremote")
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_CFLAGS).encode()).hexdigest()[:12]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    py = f"{sys.version_info[0]}{sys.version_info[1]}"
    return root / "torch" / f"guard-{torch.__version__}-abi{abi}-py{py}-{digest}"


def load() -> Any:
    """The library's ops (``torch.ops.gpuremote_guard``), built and loaded once; None where
    it cannot be (``why_not()`` says why)."""
    global _ops, _why
    with _lock:
        if _ops is not None or _why:
            return _ops
        if os.environ.get("GPUREMOTE_TORCH_NATIVE") == "0":
            _why = "GPUREMOTE_TORCH_NATIVE=0"
            return None
        from torch.utils import cpp_extension

        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        path = os.environ.get("PATH", "")
        scripts = sysconfig.get_path("scripts")  # a venv's ninja
        os.environ["PATH"] = f"{scripts}{os.pathsep}{path}" if scripts else path
        try:
            module = cpp_extension.load(
                name="gpuremote_guard",
                sources=[str(_SOURCE)],
                build_directory=str(build),
                is_python_module=True,
                extra_cflags=_CFLAGS,
                verbose=False,
            )
        except Exception as exc:  # (no compiler, no ninja, torch's headers missing)
            _why = f"the device guard library did not build: {str(exc).strip()[:500]}"
            return None
        finally:
            os.environ["PATH"] = path
        global _module
        _module = module
        _ops = torch.ops.gpuremote_guard
        return _ops


def native_quick() -> Any:
    """The library's ``quick(values, sig, places, floats, matter)`` (``_encoding._quick`` in
    C), or None where the library is not loaded."""
    return _module.quick if _module is not None else None


def native_new_tensor() -> Any:
    """The library's ``new_tensor(address, nbytes, sizes, strides, dtype, index)`` ->
    (tensor, storage), or None where the library is not loaded."""
    return _module.new_tensor if _module is not None else None


def native_call() -> Any:
    """The library's ``call(ctx, op, args, kwargs)`` (``Dispatcher.use_native``: an eager
    op's call by template, whole, in C), or None where the library is not loaded."""
    return _module.call if _module is not None else None


def native_keys(nan: Any, true: Any, false: Any) -> None:
    """The signature's keys for a NaN and the booleans, for ``native_quick`` (loaded)."""
    _module.keys(nan, true, false)


def loaded() -> bool:
    """Whether the library is loaded (more than one device index is possible)."""
    return _ops is not None


def why_not() -> str:
    """Why the library is not loaded ("" where it is, or was not asked for)."""
    return _why


def empty_on(index: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of no elements on ``gpuremote:index`` (the library is loaded)."""
    t: torch.Tensor = _ops.empty_on(index, dtype)
    return t


def current_device() -> int:
    """The calling thread's current device index (0 where the library is not loaded)."""
    return int(_ops.current_device()) if _ops is not None else 0


def set_device(index: int) -> int:
    """Make ``index`` the calling thread's current device; returns the one before."""
    if _ops is None:
        if index:
            raise RuntimeError(f"gpuremote:{index} is not connected")
        return 0
    return int(_ops.set_device(index))


def set_storage(storage: Any, address: int, nbytes: int, index: int) -> None:
    """Point remote ``storage`` at the buffer of fake address ``address``, of ``nbytes``
    (the library is loaded)."""
    _ops.set_storage(storage._cdata, address, nbytes, index)


def set_device_count(n: int) -> None:
    """The number of device indices the guard says there are (the library is loaded)."""
    _ops.set_device_count(n)


def device_count() -> int:
    """The number of device indices the guard says there are (1 without the library)."""
    return int(_ops.device_count()) if _ops is not None else 1
