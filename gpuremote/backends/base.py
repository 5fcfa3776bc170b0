"""What a backend implements, in two parts: ``Backend``, the device (memory, copies, ops,
streams and events, user kernels; what the executor runs calls on), and ``ReceivedMemory``,
where a transport's received buffers meet the device's memory (pinned host memory, device
memory a transport fills itself, buffers adopted with no copy), with defaults for a backend
that has no memory of its own (NumPy). A simulated device also reports its own time and the
calls it checks (``timing``, ``note_call``)."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import numpy as np

from .torch_runtime import TorchRuntime

__all__ = ["Backend", "BackendError", "DeviceInfo", "ReceivedMemory", "buffer_owner"]


def buffer_owner(obj: Any) -> Any:
    """The object that owns the memory behind ``obj``: follows ``ndarray.base`` and
    ``memoryview.obj`` links, however they alternate (NumPy 2's ``frombuffer`` keeps a
    ``memoryview`` as the base, so a received buffer is several such links from its owner)."""
    for _ in range(64):  # a chain is short; a cycle is not possible, but stay bounded
        if isinstance(obj, np.ndarray) and obj.base is not None:
            obj = obj.base
        elif isinstance(obj, memoryview) and obj.obj is not None:
            obj = obj.obj
        else:
            break
    return obj


#: one op of ``Backend.run_ops``: (op, input arrays, output arrays, params)
OpRun = tuple[Any, Sequence[Any], Sequence[Any], dict[str, Any]]


class BackendError(Exception):
    """A backend cannot do what was asked (unsupported feature, out of memory)."""


class DeviceInfo(TypedDict):
    """What a proxy says of its device at the hello."""

    backend: str
    device: str
    total_memory: int
    compute_capability: str
    note: str


class ReceivedMemory:
    """Where a transport's received buffers meet a backend's memory (the defaults: ordinary
    host memory, no device memory of its own)."""

    name: str

    def host_allocator(self) -> Callable[[int], memoryview] | None:
        """Where the transport should receive buffers (pinned host memory on a GPU, so
        that uploads go on to the device by DMA); None: ordinary memory."""
        return None

    def device_allocator(self) -> Callable[[int], Any] | None:
        """Where a transport that moves device memory itself (ucx://) may receive large
        buffers: a function giving a new flat ``uint8`` device array (None when out of
        memory); None: this backend has no device memory of its own (NumPy)."""
        return None

    def is_device(self, buf: Any) -> bool:
        """Whether ``buf`` (a received buffer) is in this backend's device memory."""
        return False

    def device_copy_out(self, src: Any, stream: Any) -> Any:
        """A flat ``uint8`` device copy of device array ``src``, complete (after earlier work
        on ``stream``) when this returns: a reply buffer that a transport moves itself."""
        raise BackendError(f"the {self.name} backend has no device memory")

    def adopt_host(self, host: np.ndarray[Any, Any]) -> Any | None:
        """Return ``host`` itself as a device buffer if this backend can, else ``None``."""
        return None


class Backend(ReceivedMemory, abc.ABC):
    """Device memory, copies, streams, events and op execution for one array library.

    Buffers are flat ``uint8`` arrays of ``xp``; arrays are views into them. Streams and events
    are opaque objects. Every call takes the stream it runs on; on the NumPy backend work is
    done at once, in order, so streams only order and events are complete when recorded.
    """

    name: str
    xp: Any
    #: launches only queue work on the device (a GPU): calls that wait for it are what take
    #: time; without it, every call computes at once on the calling thread (NumPy)
    queues_work: bool = False
    #: the backend checks stream semantics (``sim:check``) and wants ``note_call`` before
    #: each call, to name the calls in its reports
    checks: bool = False

    @abc.abstractmethod
    def device_info(self) -> DeviceInfo: ...

    def timing(self) -> tuple[float, float]:
        """(device seconds queued so far, seconds spent waiting for the device so far) on a
        simulated device that times itself (``sim:a100``); (0, 0) where not known."""
        return 0.0, 0.0

    def stream_time(self, stream: Any) -> float:
        """Device seconds queued on ``stream`` so far, on a device that times itself; 0
        where not known."""
        return 0.0

    def elapse(self, stream: Any, seconds: float) -> None:
        """Queue ``seconds`` of device time on ``stream`` (a device that times itself, e.g.
        ``sim:a100``; elsewhere nothing: real work takes its own time)."""

    def batch(self) -> contextlib.AbstractContextManager[Any]:
        """Context around running one batch (e.g. floating-point error settings)."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def alloc(self, nbytes: int, stream: Any = None) -> Any:
        """A new device buffer of ``nbytes``, allocated in order on ``stream`` (None: no
        stream), usable at once by work on any stream; raises ``BackendError`` when out of
        memory. Its bytes are zero (or, on a checking device, a poison pattern): never what
        another session wrote there before."""

    def free(self, bufs: Sequence[Any], streams: Sequence[Any]) -> None:
        """Give ``bufs`` back, in stream order: their memory is not reused before the work
        queued so far on every one of ``streams`` (the session's) has run. Returns at once.
        Dropping a buffer without this gives its memory back at once on a GPU, while queued
        work may still use it. (NumPy: the buffers are garbage when the last use lets go.)"""

    def note_call(self, seq: int, call: str, op: str | None, session: int, stream: int) -> None:
        """The call about to run, where ``checks`` is set: named in the backend's reports."""

    def view(self, buf: Any, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        """The C-contiguous array ``shape``/``dtype`` at ``offset`` bytes into ``buf``."""
        nbytes = dtype.itemsize
        for d in shape:
            nbytes *= d
        return buf[offset : offset + nbytes].view(dtype).reshape(shape)

    @abc.abstractmethod
    def from_host(self, dst: Any, src: np.ndarray[Any, Any], stream: Any) -> None:
        """Copy host array ``src`` (same shape/dtype) into device array ``dst``."""

    @abc.abstractmethod
    def to_host(self, src: Any, stream: Any) -> np.ndarray[Any, Any]:
        """A host copy of device array ``src``, after earlier work on ``stream``."""

    @abc.abstractmethod
    def copy(self, dst: Any, src: Any, stream: Any) -> None: ...

    @abc.abstractmethod
    def memset(self, buf: Any, offset: int, nbytes: int, value: int, stream: Any) -> None: ...

    @abc.abstractmethod
    def run_op(
        self, op: Any, ins: Sequence[Any], outs: Sequence[Any], params: dict[str, Any], stream: Any
    ) -> None:
        """Run allow-listed op ``op`` (an ``ops.Op``) on ``stream``."""

    def run_ops(self, runs: Sequence[OpRun], stream: Any) -> None:
        """Run ops ``(op, ins, outs, params)`` in order on ``stream``: a replayed step's
        launches, handed over together (one submission where the device takes one)."""
        for op, ins, outs, params in runs:
            self.run_op(op, ins, outs, params, stream)

    def run_dynamic(
        self, op: Any, ins: Sequence[Any], params: dict[str, Any], stream: Any, budget: int
    ) -> list[Any]:
        """Run op ``op`` whose output shapes depend on the data (making at most ``budget``
        bytes where the inputs do not bound them); returns its outputs."""
        return list(op.dynamic(self.xp, ins, params, budget))

    def as_buffer(self, array: Any) -> Any:
        """A buffer (flat ``uint8``) holding ``array``'s data in C order (a copy if needed)."""
        return self.xp.ascontiguousarray(array).reshape(-1).view(self.xp.uint8)

    # PyTorch (``gpuremote.proxy.aten``)
    def torch_runtime(self) -> TorchRuntime:
        """Where this backend's buffers meet PyTorch (the CPU's runtime, for NumPy
        buffers)."""
        return TorchRuntime(self)

    #: the simulated GPU whose time ops take (``sim:a100``), else None
    profile: Any = None

    # streams and events
    @abc.abstractmethod
    def create_stream(self) -> Any: ...

    def destroy_stream(self, stream: Any) -> None:
        """Release a stream (after its work is done)."""

    @abc.abstractmethod
    def synchronize(self, stream: Any) -> None: ...

    @abc.abstractmethod
    def create_event(self) -> Any: ...

    @abc.abstractmethod
    def record_event(self, event: Any, stream: Any) -> None: ...

    @abc.abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None: ...

    @abc.abstractmethod
    def query_event(self, event: Any) -> bool: ...

    # user kernels
    def compile_kernel(self, kind: str, name: str, source: str, params: dict[str, Any]) -> Any:
        raise BackendError(
            f"user kernels need the cupy backend; this proxy runs the {self.name} backend"
        )

    def launch_kernel(
        self,
        kernel: Any,
        args: Sequence[Any],
        grid: tuple[int, ...],
        block: tuple[int, ...],
        stream: Any,
    ) -> None:
        raise BackendError(
            f"user kernels need the cupy backend; this proxy runs the {self.name} backend"
        )
