"""Local execution: the same client API on the same backend, in-process, with no remoting.

``connect_direct()`` returns a ``GPU`` whose calls run at once on an ``Executor`` in this
process: no protocol, no transport, no pipeline. It is the baseline that remote runs are
compared with, and it records the call trace that the overhead model replays
(``gpuremote.tools.model``): for each call its class, bytes each way, the client's time since the
previous call returned, and the time the call ran on the device.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..backends import Backend, get_backend
from ..client import GPU
from ..config import PipelineConfig
from ..errors import ConnectionClosed
from ..proxy.executor import Executor
from ..session.contract import Counters, Recorder, Reply
from ..wire.calls import BUFFER, CALLS_BY_NAME, Arg, CallSpec
from ..wire.framing import byte_view
from ..wire.protocol import DTYPES, ArrayDesc, Command, TensorDesc, array_desc, decode_step

__all__ = ["DirectSession", "TraceEntry", "connect_direct", "connect_torch", "trace_of"]

_FREE = CALLS_BY_NAME["free"]


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One call of a recorded run."""

    call: str
    klass: str  # local | async | sync, as made with the optimisations on
    bytes_out: int  # client to device
    bytes_in: int  # device to client
    gap_s: float  # client time since the previous call returned
    device_s: float  # time the call ran on the host (on the NumPy backend: its compute)
    shadow_bytes: int = 0  # a get() answered from the host copy: bytes it would move
    #: device time the call queued on a simulated device that times itself (``sim:a100``),
    #: which runs asynchronously; ``device_s`` then excludes any wait for the device
    kernel_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _desc(wire: list[Any]) -> ArrayDesc:
    handle, offset, shape, dtype = wire
    return array_desc(handle, offset, tuple(shape), DTYPES[dtype])


def _direct_args(spec: CallSpec, args: list[Any]) -> tuple[Any, ...]:
    """``args`` as the executor takes them, decoded as the protocol would (nothing crossed a
    wire: the client's own values, not checked again)."""
    out: list[Any] = []
    for param, a in zip(spec.args, args, strict=True):
        kind = param.kind
        if kind is Arg.ARRAY:
            out.append(_desc(a))
        elif kind is Arg.ARRAYS:
            out.append(tuple(_desc(w) for w in a))
        elif kind is Arg.KERNEL_ARGS:
            out.append(
                tuple(("a", _desc(k[1])) if k[0] == "a" else ("s", DTYPES[k[1]], k[2]) for k in a)
            )
        elif kind is Arg.BUFFER:
            out.append(0)
        elif kind is Arg.DIMS:
            out.append(tuple(a))
        elif kind is Arg.STEP:
            out.append(decode_step(a))
        elif kind is Arg.TENSORS:
            out.append(tuple(TensorDesc(h, o, tuple(z), tuple(st), d) for h, o, z, st, d in a))
        else:
            out.append(a)
    return tuple(out)


class DirectSession:
    """The session contract (``gpuremote.session.contract.Session``) run directly on an
    executor in this process (see the module docstring)."""

    url = "local://"

    def __init__(
        self, backend: Backend, config: PipelineConfig = PipelineConfig(), record: bool = True
    ) -> None:
        self.executor = Executor(backend)
        self.config = config
        self.counters = Counters()
        self.trace: list[TraceEntry] | None = [] if record else None
        self._seq = 0
        self._handle = 0
        self._closed = False
        self.recorder: Recorder | None = None  # a step being captured: waits refused
        self._last = time.perf_counter()
        self._to_free: deque[int] = deque()  # appended from any thread (finalizers)
        self.notices: list[Any] = []
        #: what a proxy announces at the handshake that the front ends read: no templates
        #: (a local baseline's trace holds each op as one whole call, and spreads PyTorch's
        #: measured host time over them as their client time was)
        self.info: dict[str, Any] = {}

    def _timing(self) -> tuple[float, float]:
        return self.executor.backend.timing()

    # -- what GPU uses ---------------------------------------------------------------------
    def new_handle(self) -> int:
        self._handle += 1
        return self._handle

    @property
    def closed(self) -> bool:
        return self._closed

    def restart_clock(self) -> None:
        """Count the next call's client time (``gap_s``) from now: a recorded run that
        starts after a pause (setting up, a garbage collection) begins with its own first
        call, not with the pause."""
        self._last = time.perf_counter()

    def count_local(self, n: int = 1, shadow_bytes: int = 0) -> None:
        self.counters.calls["local"] += n
        now = time.perf_counter()
        if self.trace is not None:
            self.trace.append(
                TraceEntry("local", "local", 0, 0, now - self._last, 0.0, shadow_bytes)
            )
        self._last = time.perf_counter()

    def _run(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None
    ) -> Reply:
        if self._closed:
            raise ConnectionClosed("the local session is closed")
        start = time.perf_counter()
        if self._to_free:
            self._free_released()
        self._seq += 1
        bufs = [buffer.toreadonly()] if buffer is not None else []  # never adopted: copied
        cmd = Command(self._seq, spec, stream, _direct_args(spec, args), False)
        queued0, waited0 = self._timing()
        t0 = time.perf_counter()
        replies, out = self.executor.execute([cmd], bufs)
        device = time.perf_counter() - t0
        queued, waited = self._timing()
        klass = spec.klass.value
        self.counters.calls[klass] += 1
        if self.trace is not None:
            nin = sum(b.nbytes for b in out)
            nout = buffer.nbytes if buffer is not None else 0
            self.trace.append(
                TraceEntry(
                    spec.name,
                    klass,
                    nout,
                    nin,
                    start - self._last,
                    max(0.0, device - (waited - waited0)),
                    kernel_s=queued - queued0,
                )
            )
        result: Reply = (None, [])
        if replies:
            reply = replies[0]
            if not reply.ok:
                self._last = time.perf_counter()
                raise reply.value.to_exception()
            # a device-to-host copy: the client gets its own memory
            result = (reply.value, [byte_view(np.array(b, copy=True)) for b in out])
        self._last = time.perf_counter()
        return result

    def submit(
        self,
        spec: CallSpec,
        stream: int,
        args: list[Any],
        buffer: memoryview | None = None,
        *,
        then_call: bool = False,
    ) -> None:
        self._run(spec, stream, [a if a is not BUFFER else 0 for a in args], buffer)

    async def call(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> Reply:
        if self.recorder is not None:
            self.recorder.refuse(f"{spec.name} (it waits for the device's answer)")
        return self._run(spec, stream, [a if a is not BUFFER else 0 for a in args], buffer)

    def start_call(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> asyncio.Future[Reply]:
        """``call``, run now: the future is done when this returns."""
        if self.recorder is not None:
            self.recorder.refuse(f"{spec.name} (it waits for the device's answer)")
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(
                self._run(spec, stream, [a if a is not BUFFER else 0 for a in args], buffer)
            )
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    async def wait(self, fut: asyncio.Future[Reply], what: str) -> Reply:
        return await fut

    def plain_wait(self) -> bool:
        return True

    async def ack(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> None:
        self._run(spec, stream, [a if a is not BUFFER else 0 for a in args], buffer)

    async def flush(self, wait: bool = False) -> None:
        return None

    def send_queued(self) -> None:
        return None  # (each call ran where it was made)

    def release(self, handle: int, nbytes: int = 0) -> None:
        """Free ``handle`` before the next call (finalizers may run in the middle of one)."""
        if not self._closed:
            self._to_free.append(handle)

    def defer_free(self, handle: int, nbytes: int = 0) -> None:
        self.release(handle, nbytes)

    def _free_released(self) -> None:
        while self._to_free:
            handle = self._to_free.popleft()  # traced too: remotely, each is a call
            queued0, _ = self._timing()
            t0 = time.perf_counter()
            self.executor.execute([Command(0, _FREE, 0, (handle,), False)], [])
            if self.trace is not None:
                kernel = self._timing()[0] - queued0
                self.trace.append(
                    TraceEntry("free", "async", 0, 0, 0.0, time.perf_counter() - t0, 0, kernel)
                )

    async def aclose(self) -> None:
        self._closed = True
        self.executor.close()


def connect_direct(backend: str | Backend = "numpy", *, record: bool = True) -> GPU:
    """A ``GPU`` that runs every call at once, in this process, on ``backend``."""
    be = get_backend(backend) if isinstance(backend, str) else backend
    session = DirectSession(be, record=record)
    info: dict[str, Any] = dict(be.device_info())
    info.update(protocol=0, session=0, local=True)
    return GPU(session, "local://", info)


def connect_torch(backend: str | Backend = "numpy", *, record: bool = True) -> Any:
    """The ``gpuremote`` PyTorch device (``gpuremote.torch``) served by a session that runs
    every op at once in this process on ``backend``: the local baseline of a PyTorch program;
    with ``record``, its trace is ``conn.drivers[0].session.trace``. Returns the
    ``gpuremote.torch.Connection`` (a context manager)."""
    import gpuremote.torch as gt

    be = get_backend(backend) if isinstance(backend, str) else backend
    return gt.connect(session=DirectSession(be, record=record))


def trace_of(gpu: GPU) -> list[TraceEntry]:
    """The calls that ``gpu`` (made by ``connect_direct``) has run so far, as the live list
    its session appends to; empty where it does not record them."""
    session = gpu.session
    if not isinstance(session, DirectSession):
        raise TypeError(f"trace_of needs a GPU made by connect_direct, not one on {gpu.url}")
    return session.trace if session.trace is not None else []
