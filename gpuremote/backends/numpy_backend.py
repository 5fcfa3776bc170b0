"""The CPU backend: NumPy arrays as device memory; every call runs at once, in order."""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import Backend, BackendError, DeviceInfo

__all__ = ["NumpyBackend"]

_ndarray = np.ndarray


class _Stream:
    """On the CPU, work runs when issued: a stream is only an ordering token."""

    __slots__ = ()


class _Event:
    """An event on the CPU: complete once recorded (work runs when issued)."""

    __slots__ = ("recorded",)

    def __init__(self) -> None:
        self.recorded = False


class NumpyBackend(Backend):
    """Runs the same commands as the GPU backend, on NumPy."""

    name = "numpy"
    xp = np

    def __init__(self, fallback_reason: str = "") -> None:
        self.fallback_reason = fallback_reason

    def device_info(self) -> DeviceInfo:
        note = f"no GPU: {self.fallback_reason}" if self.fallback_reason else ""
        return DeviceInfo(
            backend=self.name,
            device=f"cpu ({platform.processor() or platform.machine()})",
            total_memory=0,
            compute_capability="",
            note=note,
        )

    def alloc(self, nbytes: int, stream: Any = None) -> Any:
        # zeroed: freed memory goes back to the C heap, and a new buffer may be made of
        # what another session freed (calloc gives fresh pages as they are, zero already)
        try:
            return np.zeros(nbytes, dtype=np.uint8)
        except MemoryError:
            raise BackendError(f"out of memory allocating {nbytes} bytes") from None

    def view(self, buf: Any, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        # one constructor call instead of a slice, a view and a reshape (the same array:
        # ``buf``'s memory, C-contiguous; the state checked the bounds)
        return _ndarray(shape, dtype, buf, offset)

    def adopt_host(self, host: np.ndarray[Any, Any]) -> Any | None:
        return host

    def from_host(self, dst: Any, src: np.ndarray[Any, Any], stream: Any) -> None:
        np.copyto(dst, src, casting="no")

    def to_host(self, src: Any, stream: Any) -> np.ndarray[Any, Any]:
        return np.ascontiguousarray(src)

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        np.copyto(dst, src, casting="no")

    def memset(self, buf: Any, offset: int, nbytes: int, value: int, stream: Any) -> None:
        buf[offset : offset + nbytes] = value

    def batch(self) -> contextlib.AbstractContextManager[Any]:
        return np.errstate(all="ignore")  # IEEE results (inf, nan), as on the GPU

    def run_op(
        self, op: Any, ins: Sequence[Any], outs: Sequence[Any], params: dict[str, Any], stream: Any
    ) -> None:
        op.run(np, ins, outs, params)

    def create_stream(self) -> Any:
        return _Stream()

    def synchronize(self, stream: Any) -> None:
        return None

    def create_event(self) -> Any:
        return _Event()

    def record_event(self, event: Any, stream: Any) -> None:
        event.recorded = True

    def wait_event(self, stream: Any, event: Any) -> None:
        return None

    def query_event(self, event: Any) -> bool:
        return True
