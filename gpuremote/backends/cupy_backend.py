"""The GPU backend: CuPy device memory, CuPy streams and events, CuPy user kernels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cupy as cp
import numpy as np

from .base import Backend, BackendError, DeviceInfo

__all__ = ["CupyBackend"]


class CupyBackend(Backend):
    """Runs commands on the current CUDA device, each on the CuPy stream it names."""

    name = "cupy"
    queues_work = True
    xp = cp

    def __init__(self) -> None:
        self._device = cp.cuda.Device()
        self._kernels: dict[tuple[str, str, str, str], Any] = {}  # shared across sessions

    def device_info(self) -> DeviceInfo:
        props = cp.cuda.runtime.getDeviceProperties(self._device.id)
        name = props["name"]
        return DeviceInfo(
            backend=self.name,
            device=name.decode() if isinstance(name, bytes) else str(name),
            total_memory=int(props["totalGlobalMem"]),
            compute_capability=f"{props['major']}.{props['minor']}",
            note="",
        )

    def alloc(self, nbytes: int) -> Any:
        try:
            return cp.empty(nbytes, dtype=cp.uint8)
        except cp.cuda.memory.OutOfMemoryError:
            raise BackendError(f"out of device memory allocating {nbytes} bytes") from None

    def from_host(self, dst: Any, src: np.ndarray[Any, Any], stream: Any) -> None:
        dst.set(src, stream=stream)

    def to_host(self, src: Any, stream: Any) -> np.ndarray[Any, Any]:
        with stream:
            out: np.ndarray[Any, Any] = cp.ascontiguousarray(src).get(stream=stream)  # waits
        return out

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        with stream:
            cp.copyto(dst, src, casting="no")

    def memset(self, buf: Any, offset: int, nbytes: int, value: int, stream: Any) -> None:
        with stream:
            buf[offset : offset + nbytes].fill(value)

    def run_op(
        self, op: Any, ins: Sequence[Any], outs: Sequence[Any], params: dict[str, Any], stream: Any
    ) -> None:
        with stream:
            op.run(cp, ins, outs, params)

    def run_dynamic(
        self, op: Any, ins: Sequence[Any], params: dict[str, Any], stream: Any, budget: int
    ) -> list[Any]:
        with stream:
            return list(op.dynamic(cp, ins, params, budget))

    def create_stream(self) -> Any:
        return cp.cuda.Stream(non_blocking=True)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def create_event(self) -> Any:
        return cp.cuda.Event()

    def record_event(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query_event(self, event: Any) -> bool:
        return bool(event.done)

    def compile_kernel(self, kind: str, name: str, source: str, params: dict[str, Any]) -> Any:
        key = (kind, name, source, repr(sorted(params.items())))
        kernel = self._kernels.get(key)
        if kernel is not None:
            return kernel
        try:
            if kind == "raw":
                kernel = cp.RawKernel(source, name)
                kernel.compile()
            elif kind == "elementwise":
                kernel = cp.ElementwiseKernel(
                    str(params.get("in_params", "")),
                    str(params.get("out_params", "")),
                    source,
                    name,
                )
            else:
                raise BackendError(f"unknown kernel kind {kind!r}; use raw or elementwise")
        except BackendError:
            raise
        except Exception as exc:
            raise BackendError(f"kernel {name!r} does not compile: {exc}") from None
        self._kernels[key] = kernel
        return kernel

    def launch_kernel(
        self,
        kernel: Any,
        args: Sequence[Any],
        grid: tuple[int, ...],
        block: tuple[int, ...],
        stream: Any,
    ) -> None:
        with stream:
            if isinstance(kernel, cp.RawKernel):
                kernel(grid, block, tuple(args))
            else:
                kernel(*args)
