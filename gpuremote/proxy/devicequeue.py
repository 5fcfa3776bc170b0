"""Where one session's batches run, so that the event loop never waits on the device.

A batch runs inline, in the transport's read callback, only when the session has nothing in
flight and the batch is cheap: on a backend that computes on the calling thread (NumPy), an
estimate of its work within ``inline_us`` (default 1 ms); on a backend that queues work on
the device (CuPy, ``sim``), no call in it that waits for the device. Every other batch goes to the
session's queue and runs on a worker thread of the proxy's pool, in order; its replies come
back to the loop as an event (``call_soon_threadsafe``), so that the loop goes on decoding,
launching and answering other sessions meanwhile, and one session's replies stay in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

from ..wire.protocol import ArrayDesc, BadCommandAt, Command, Reply

__all__ = ["DeviceQueue", "estimate_ns"]

Batch = tuple[Sequence[Command | BadCommandAt], Sequence[memoryview]]
Result = tuple[list[Reply], list[memoryview]]

#: what a command costs on the proxy before any device work (decode, checks, dispatch)
_PER_COMMAND_NS: Final = 3_000.0
#: calls that wait for the device's earlier work on a backend that queues it
_WAITS = frozenset(
    {"copy_d2h", "stream_synchronize", "device_synchronize", "launch_dynamic", "kernel_create"}
)
#: calls that always run on a worker: they wait for the device, or for other proxies
_WORKER_ONLY = frozenset(
    {"peer_export", "peer_read", "peer_import", "dist_host", "dist_join", "dist_run", "dist_leave"}
)
#: ops that cost much more than one pass over their data
_HEAVY = frozenset({"tensordot", "vecdot", "sort", "argsort", "searchsorted", "isin"})


def _elements(descs: Sequence[ArrayDesc]) -> int:
    n = 0
    for d in descs:
        n += math.prod(d.shape)
    return n


#: how ``estimate_ns`` counts a call, by name (a call not named: its per-command cost alone)
_LAUNCH: Final = 1
_DYNAMIC: Final = 2
_COPY: Final = 3
_MEMSET: Final = 4
_REPLAY: Final = 5
_RECORD: Final = 6
_WORKER: Final = 7
_UNBOUNDED: Final = 8
_KIND: dict[str, int] = {
    "launch": _LAUNCH,
    "launch_new": _LAUNCH,
    "launch_dynamic": _DYNAMIC,
    "copy_h2d": _COPY,
    "copy_d2h": _COPY,
    "copy_d2d": _COPY,
    "memset": _MEMSET,
    "step_replay": _REPLAY,
    "step_run": _REPLAY,
    "step_record": _RECORD,
    "kernel_create": _UNBOUNDED,
    **dict.fromkeys(_WORKER_ONLY, _WORKER),
}
#: a launched op's cost per element (0.0: a matmul, counted by its multiply-adds; inf: one of
#: the ops that cost much more than one pass over their data), by op name, as met
_PER_ELEMENT: dict[str, float] = {}


def _per_element(op: str) -> float:
    cost = _PER_ELEMENT.get(op)
    if cost is None:
        if op == "matmul":
            cost = 0.0
        elif op in _HEAVY or op.startswith(("linalg.", "fft.", "unique")):
            cost = math.inf
        else:
            cost = 0.3
        if len(_PER_ELEMENT) < 4096:
            _PER_ELEMENT[op] = cost
    return cost


def estimate_ns(
    commands: Sequence[Any],
    queues_work: bool,
    step_ns: Callable[[int], float] | None = None,
) -> float:
    """A rough upper estimate of how long ``commands`` keep the calling thread busy:
    infinite for a call that waits for a device that queues work (``queues_work``). A
    replayed step costs what its calls do (``step_ns(handle)``; unknown: infinite)."""
    total = 0.0
    kinds = _KIND
    for c in commands:
        total += _PER_COMMAND_NS
        if type(c) is BadCommandAt:
            continue
        name: str = c.spec.name
        kind = kinds.get(name, 0)
        if not kind:
            continue
        if kind == _WORKER:
            return math.inf
        if kind == _REPLAY:
            total += math.inf if step_ns is None else step_ns(c.args[0])
        elif kind == _RECORD:  # checked once, each call as a batch's is
            total += 2 * _PER_COMMAND_NS * len(c.args[1].commands)
        elif queues_work:
            if name in _WAITS:
                return math.inf
            if name == "copy_h2d":
                total += 0.1 * c.args[0].nbytes  # a staging copy at ~10 GB/s
        elif kind == _LAUNCH:
            # ~3x what NumPy takes on a small x86 VM (0.01-0.02 ns per multiply-add in BLAS,
            # 0.1 ns per element of an element-wise op), so that the estimate errs high
            args = c.args
            ins = args[1]
            per = _per_element(args[0])
            if per == 0.0:  # a matmul: its multiply-adds
                if ins and ins[0].shape:
                    total += 0.05 * _elements(args[2]) * ins[0].shape[-1]
                else:
                    total += 0.3 * (_elements(ins) + _elements(args[2]))
            elif per == math.inf:
                n = _elements(ins) + _elements(args[2])
                total += 20.0 * n + 0.5 * n * max(1, int(math.log2(n + 1)))
            else:
                total += per * (_elements(ins) + _elements(args[2]))
        elif kind == _COPY:
            total += 0.1 * c.args[0].nbytes
        elif kind == _DYNAMIC:
            total += 50.0 * _elements(c.args[1])
        elif kind == _MEMSET:
            total += 0.05 * c.args[2]
        elif kind == _UNBOUNDED:
            return math.inf
    return total


class DeviceQueue:
    """One session's batches: run inline when cheap and nothing is in flight, else in order
    on ``pool``; ``deliver(result)`` gets each batch's ``(replies, buffers)`` (or the
    exception it raised) on the loop, in order."""

    def __init__(
        self,
        run: Callable[[Sequence[Command | BadCommandAt], Sequence[memoryview]], Result],
        pool: concurrent.futures.Executor,
        deliver: Callable[[Result | BaseException], None],
        *,
        queues_work: bool = False,
        inline_us: float = 1000.0,
        step_ns: Callable[[int], float] | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._run = run
        self._pool = pool
        self._deliver = deliver
        self._queues_work = queues_work
        self._step_ns = step_ns  # a recorded step's estimate, by handle
        self._inline_ns = inline_us * 1e3
        self._lock = threading.Lock()
        self._waiting: deque[Batch] = deque()  # not yet started; the worker takes from it
        self._working = False  # a worker is draining _waiting
        #: batches handed to the worker whose result has not been delivered yet
        self.in_flight = 0
        self.ran_off_loop = 0  # batches that went to the worker
        self._idle: asyncio.Future[None] | None = None
        self._closed = False

    def estimate(self, commands: Sequence[Command | BadCommandAt]) -> float:
        """``estimate_ns`` of ``commands`` on this queue's backend."""
        return estimate_ns(commands, self._queues_work, self._step_ns)

    def submit(
        self,
        commands: Sequence[Command | BadCommandAt],
        buffers: Sequence[memoryview],
        cost_ns: float | None = None,
    ) -> None:
        """Run one batch (inline, or queued behind the batches in flight); ``cost_ns`` is its
        ``estimate`` if the caller has it already."""
        if self._closed:
            return
        if cost_ns is None:
            cost_ns = estimate_ns(commands, self._queues_work, self._step_ns)
        if self.in_flight == 0 and cost_ns <= self._inline_ns:
            self._deliver(self._run(commands, buffers))
            return
        self.in_flight += 1
        self.ran_off_loop += 1
        with self._lock:
            self._waiting.append((commands, buffers))
            start = not self._working
            self._working = True
        if start:
            self._pool.submit(self._work)

    def _work(self) -> None:
        """On a worker thread: run the waiting batches in order, handing each result back."""
        while True:
            with self._lock:
                if not self._waiting:
                    self._working = False
                    return
                commands, buffers = self._waiting.popleft()
            result: Result | BaseException
            try:
                result = self._run(commands, buffers)
            except BaseException as exc:  # delivered to the loop, which reports it
                result = exc
            try:
                self._loop.call_soon_threadsafe(self._done, result)
            except RuntimeError:  # the loop is closed: nobody is left to answer
                with self._lock:
                    self._waiting.clear()
                    self._working = False
                return

    def _done(self, result: Result | BaseException) -> None:
        self.in_flight -= 1
        try:
            if not self._closed:
                self._deliver(result)
        finally:
            if self.in_flight == 0 and self._idle is not None and not self._idle.done():
                self._idle.set_result(None)

    def cancel(self) -> int:
        """Drop the batches not yet started (their client is gone); returns how many. What
        runs now finishes; its result is not delivered."""
        self._closed = True
        with self._lock:
            dropped = len(self._waiting)
            self._waiting.clear()
        self.in_flight -= dropped
        if self.in_flight == 0 and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        return dropped

    async def idle(self) -> None:
        """Wait until no batch is in flight."""
        if self.in_flight == 0:
            return
        if self._idle is None or self._idle.done():
            self._idle = self._loop.create_future()
        await self._idle
