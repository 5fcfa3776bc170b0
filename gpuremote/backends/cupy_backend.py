"""The GPU backend: CuPy device memory, CuPy streams and events, CuPy user kernels.

Memory is allocated and freed in stream order. A session's buffers are allocated on its
default stream (CuPy's pool keeps an arena per stream, reused in that stream's order); a free
records an event on every stream of the session and keeps the buffers until those events have
completed, so their memory goes back to the pool (where another stream or session may get it)
only after the work queued before the free has run. A destroyed stream is synchronized first,
and the free blocks of its arena are given back to the device.

Host-device copies go through pinned host memory (CuPy's pinned memory pool), so that they
are asynchronous on the session's stream: an upload is copied into a pinned staging buffer
and handed to the GPU's copy engine, the buffer held until the stream has passed the copy
(an upload the transport received straight into pinned memory is not copied again); a
download lands in pinned memory, which is then the reply's buffer.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import cupy as cp
import numpy as np

from ..wire.framing import byte_view
from .base import Backend, BackendError, DeviceInfo, buffer_owner
from .torch_runtime import TorchRuntime

__all__ = ["CupyBackend"]

#: copies of this many bytes or more go through pinned memory; smaller ones the driver
#: stages itself at once, and above the upper bound pinned memory would be hoarded
PINNED_MIN, PINNED_MAX = 64 << 10, 256 << 20


def pinned_empty(nbytes: int) -> np.ndarray[Any, Any]:
    """A host ``uint8`` array of ``nbytes`` in page-locked memory (from CuPy's pool)."""
    mem = cp.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, np.uint8, nbytes)


def _is_pinned(host: np.ndarray[Any, Any]) -> bool:
    """Whether ``host`` lies in memory from CuPy's pinned pool (as the transport receives
    uploads of ``PINNED_MIN`` to ``PINNED_MAX`` bytes): the owner at the end of its chain of
    ``ndarray.base`` / ``memoryview.obj`` links is a ``PinnedMemoryPointer``."""
    return isinstance(buffer_owner(host), cp.cuda.PinnedMemoryPointer)


class CupyBackend(Backend):
    """Runs commands on the current CUDA device, each on the CuPy stream it names."""

    name = "cupy"
    queues_work = True
    xp = cp

    def __init__(self) -> None:
        self._device = cp.cuda.Device()
        self._kernels: dict[tuple[str, str, str, str], Any] = {}  # shared across sessions
        self._lock = threading.Lock()
        #: staging buffers of uploads in flight, each with the event after its copy
        self._staged: deque[tuple[Any, np.ndarray[Any, Any]]] = deque()
        #: freed buffers held until the events after the work queued before their free
        #: (one per stream of the session) have completed, oldest first
        self._freed: deque[tuple[list[Any], list[Any]]] = deque()
        self._pool = cp.get_default_memory_pool()

    def torch_runtime(self) -> TorchRuntime:
        return CupyTorchRuntime(self)

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

    def alloc(self, nbytes: int, stream: Any = None) -> Any:
        """A buffer from the pool's arena of ``stream`` (the session's default stream), so
        that CuPy reuses its memory in that stream's order; buffers whose free has completed
        are given back first."""
        self._reap()
        try:  # zeroed on the stream (a memset): the pool hands out memory others freed
            if stream is None:
                return cp.zeros(nbytes, dtype=cp.uint8)
            with stream:
                return cp.zeros(nbytes, dtype=cp.uint8)
        except cp.cuda.memory.OutOfMemoryError:
            raise BackendError(f"out of device memory allocating {nbytes} bytes") from None

    def free(self, bufs: Sequence[Any], streams: Sequence[Any]) -> None:
        """Hold ``bufs`` until an event recorded now on each of ``streams`` has completed,
        then drop them (CuPy's pool takes their memory back): without it, the pool would
        hand the memory to another allocation while queued kernels still use it. Returns
        at once; what has completed is given back at every free and allocation."""
        if not bufs:
            return
        events = []
        for s in streams:
            event = cp.cuda.Event(disable_timing=True)
            event.record(s)
            events.append(event)
        with self._lock:
            self._freed.append((events, list(bufs)))
        self._reap()

    def _reap(self) -> None:
        """Drop the freed buffers whose events have completed (in the order of their frees)."""
        freed = self._freed
        if not freed:
            return
        done: list[list[Any]] = []
        with self._lock:
            while freed and all(e.done for e in freed[0][0]):
                done.append(freed.popleft()[1])
        done.clear()  # outside the lock: the pool takes the memory back here

    def host_allocator(self) -> Callable[[int], memoryview] | None:
        def allocate(nbytes: int) -> memoryview:
            if PINNED_MIN <= nbytes <= PINNED_MAX:
                return byte_view(pinned_empty(nbytes))  # received straight into pinned memory
            return byte_view(np.empty(nbytes, dtype=np.uint8))

        return allocate

    def device_allocator(self) -> Callable[[int], Any] | None:
        def allocate(nbytes: int) -> Any:
            try:
                return cp.empty(nbytes, dtype=cp.uint8)
            except cp.cuda.memory.OutOfMemoryError:
                return None  # the transport receives into host memory instead

        return allocate

    def is_device(self, buf: Any) -> bool:
        return isinstance(buf, cp.ndarray)

    def device_copy_out(self, src: Any, stream: Any) -> Any:
        with stream:
            out = cp.ascontiguousarray(src).reshape(-1).view(cp.uint8).copy()
        stream.synchronize()  # the transport reads it on a stream of its own
        return out

    def from_host(self, dst: Any, src: np.ndarray[Any, Any], stream: Any) -> None:
        if not PINNED_MIN <= src.nbytes <= PINNED_MAX:
            dst.set(src, stream=stream)
            return
        if _is_pinned(src):  # the transport received it into pinned memory: no staging copy
            staging = src
        else:
            staging = pinned_empty(src.nbytes).view(src.dtype).reshape(src.shape)
            np.copyto(staging, src)
        dst.set(staging, stream=stream)  # from pinned memory: asynchronous on the stream
        event = stream.record()
        with self._lock:  # held until the stream is past the copy
            staged = self._staged
            staged.append((event, staging))
            while staged and staged[0][0].done:
                staged.popleft()

    def to_host(self, src: Any, stream: Any) -> np.ndarray[Any, Any]:
        with stream:
            src = cp.ascontiguousarray(src)
        if not PINNED_MIN <= src.nbytes <= PINNED_MAX:
            out: np.ndarray[Any, Any] = src.get(stream=stream)  # waits for the stream
            return out
        host = pinned_empty(src.nbytes).view(src.dtype).reshape(src.shape)
        src.get(stream=stream, out=host)  # waits for the stream, then copies by DMA
        return host

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
        with stream:  # contiguous here, so that as_buffer makes no copy off the stream
            return [cp.ascontiguousarray(r) for r in op.dynamic(cp, ins, params, budget)]

    def create_stream(self) -> Any:
        return cp.cuda.Stream(non_blocking=True)

    def destroy_stream(self, stream: Any) -> None:
        """Wait for the stream's work, give back what its completed frees held and the free
        blocks of its pool arena; CuPy destroys the stream (``cudaStreamDestroy``) when the
        caller drops its last reference, which the executor does on return."""
        stream.synchronize()
        self._reap()
        self._pool.free_all_blocks(stream=stream)

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


class CupyTorchRuntime(TorchRuntime):
    """PyTorch on CuPy's buffers: tensors as DLPack views of them, ops run on the session's
    CUDA stream."""

    #: torch's caching allocator frees in its own stream order, not the session's: copied
    keeps_results = False
    adopts_later = False

    def device(self) -> Any:
        import torch

        return torch.device("cuda", self.backend._device.id)

    def buffer(self, buf: Any) -> Any:
        import torch

        return torch.from_dlpack(buf)

    def adopt(self, tensor: Any) -> Any:
        import torch

        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        return cp.from_dlpack(flat.set_(tensor.untyped_storage()))

    def run(
        self,
        job: Callable[[], Any],
        reads: Sequence[Any],
        writes: Sequence[Any],
        stream: Any,
        wait: bool = False,
    ) -> Any:
        import torch

        with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr, device=self.device())):
            result = job()
        if wait:
            stream.synchronize()
        return result
