"""``sim:check``: the simulated device as a checker of stream semantics.

What a GPU would get wrong silently, this backend reports:

- **Memory.** Buffers come from a pool that hands freed memory to the next allocation of its
  size as soon as the proxy may give it out: once the work queued before the free on every
  stream of the session has run. Fresh and freed memory is filled with a poison pattern
  (``0xFF`` bytes: NaN for floats, -1 for integers), so a read of memory that is not the
  reader's gives detectably wrong results. Memory that the proxy drops without a
  stream-ordered ``free`` goes back to the pool at once (as a GPU memory pool would take it
  back), poisoned, and its old users' accesses stay on record for the next owner's.
- **Races.** Every access (an op's inputs and outputs, copies, memsets, reads) is checked when
  it is issued against the earlier accesses of the same memory, by vector clocks: an access on
  one stream conflicts with a write on another (or a write with a read) unless an event wait,
  a synchronize, or the completion of a free orders them. A conflict is a ``StreamRace`` naming
  both calls (sequence number, call, op, stream, session); the failing call does not run, and
  the executor raises it to the client at its next synchronising call as ``RemoteCallError``.
  A free that releases memory while an unordered access may still use it is reported as a use
  after free the same way.

The check is of the order the program states, not of the timing of one run: a race is
reported whether or not the two accesses happened to overlap.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .base import BackendError, DeviceInfo, OpRun
from .sim_backend import SimBackend, SimTorchRuntime, _Event, _Stream
from .torch_runtime import TorchRuntime

__all__ = ["HOST", "POISON", "Checker", "SimCheckBackend", "StreamRace"]

#: the byte freed and fresh memory is filled with (NaN as float16/32/64, -1 as an integer)
POISON = 0xFF
#: the host (the proxy's own thread of control) as a clock component
HOST = -1
#: accesses kept per block (the oldest are forgotten beyond it)
_HISTORY = 64
#: pooled free memory kept, beyond which the oldest free blocks are let go
_POOL_BYTES = 256 << 20


class StreamRace(BackendError):
    """Two calls touch the same device memory in no stated order (or memory is used after
    its free)."""


class _Access(NamedTuple):
    """One access to a block's bytes by a stream, at its epoch (the race detector's record)."""

    lo: int
    hi: int
    write: bool
    sid: int
    epoch: int
    label: str
    gen: int  # the block's allocation it was made in


class Clock:
    """One stream's (or the host's) vector clock: what it is known to come after."""

    __slots__ = ("seen", "sid", "vc")

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.vc: dict[int, int] = {}
        self.seen = -1  # the host generation last joined


def _join(into: dict[int, int], other: dict[int, int]) -> bool:
    changed = False
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v
            changed = True
    return changed


@dataclass(eq=False)
class _Ticket:
    """A free in flight: the streams that have not yet run up to it, and the clock that
    orders everything the memory's old owner queued before it."""

    pending: set[int]
    vc: dict[int, int]
    label: str
    blocks: list[_Block] = field(default_factory=list)


@dataclass(eq=False)
class _Block:
    """A block of the checked pool: its memory, the accesses since its allocation, its state."""

    storage: np.ndarray[Any, Any]
    base: int
    cap: int
    history: list[_Access] = field(default_factory=list)
    gen: int = 0  # bumped at every allocation
    allocated: bool = False
    ticket: _Ticket | None = None  # a stream-ordered free not complete yet
    #: released without a free: what the host knew had run then (the rest of the old
    #: accesses may still be queued on memory now someone else's)
    drop_vc: dict[int, int] | None = None
    label: str = ""  # the call that allocated it
    finalizer: Any = None


def _size_class(nbytes: int) -> int:
    cap = 256
    while cap < nbytes:
        cap <<= 1
    return cap


def _address(arr: Any) -> int:
    return int(arr.__array_interface__["data"][0])


class Checker:
    """Clocks, the shadow record of accesses, and the pool; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()
        self.host = Clock(HOST)
        self._host_gen = 0
        self._sids = 0
        self._bases: list[int] = []
        self._blocks: dict[int, _Block] = {}
        self._free: dict[int, list[_Block]] = {}  # size class -> blocks not allocated
        self._free_bytes = 0
        self.races = 0

    # -- labels ----------------------------------------------------------------------------
    def note_call(self, seq: int, call: str, op: str | None, session: int, stream: int) -> None:
        """The call the calling thread runs next (named in reports)."""
        what = f"{call} {op!r}" if op else call
        self._local.label = f"call #{seq} {what} (session {session}, stream {stream})"

    @property
    def label(self) -> str:
        return str(getattr(self._local, "label", "a proxy-side access"))

    # -- clocks ----------------------------------------------------------------------------
    def new_clock(self) -> Clock:
        with self._lock:
            self._sids += 1
            return Clock(self._sids)

    def _tick(self, clock: Clock) -> int:
        if clock.sid != HOST and clock.seen != self._host_gen:
            _join(clock.vc, self.host.vc)
            clock.seen = self._host_gen
        epoch = clock.vc.get(clock.sid, 0) + 1
        clock.vc[clock.sid] = epoch
        if clock.sid == HOST:  # what the host does comes before all it issues later
            self._host_gen += 1
        return epoch

    def _host_learns(self, vc: dict[int, int]) -> None:
        if _join(self.host.vc, vc):
            self._host_gen += 1

    def host_waited(self, clock: Clock) -> None:
        """The host has waited for everything issued on ``clock``'s stream so far."""
        with self._lock:
            self._host_learns(clock.vc)

    def host_saw(self, vc: dict[int, int]) -> None:
        """The host has seen an event complete whose clock is ``vc``."""
        with self._lock:
            self._host_learns(vc)

    def record(self, clock: Clock) -> dict[int, int]:
        """An event recorded on ``clock``'s stream now: the clock it carries."""
        with self._lock:
            self._tick(clock)
            return dict(clock.vc)

    def wait(self, clock: Clock, vc: dict[int, int]) -> None:
        """``clock``'s stream waits for an event carrying ``vc``."""
        with self._lock:
            _join(clock.vc, vc)

    # -- memory ----------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> np.ndarray[Any, Any]:
        """A buffer of ``nbytes`` from the pool (reused memory where some may be reused)."""
        cap = _size_class(max(nbytes, 1))
        with self._lock:
            block = self._reusable(cap)
            if block is None:
                try:
                    storage = np.full(cap, POISON, dtype=np.uint8)
                except MemoryError:
                    raise BackendError(f"out of memory allocating {nbytes} bytes") from None
                block = _Block(storage, _address(storage), cap)
                bisect.insort(self._bases, block.base)
                self._blocks[block.base] = block
            block.gen += 1
            block.allocated = True
            block.label = self.label
            buf = block.storage[:nbytes]
            block.finalizer = weakref.finalize(buf, self._dropped, block, block.gen)
            return buf

    def _reusable(self, cap: int) -> _Block | None:
        blocks = self._free.get(cap)
        if not blocks:
            return None
        for i, block in enumerate(blocks):
            ticket = block.ticket
            if ticket is not None and ticket.pending:
                continue  # the old owner's work before the free has not all run
            del blocks[i]
            self._free_bytes -= cap
            if ticket is not None:  # the host knows it has run: all that came before it
                self._host_learns(ticket.vc)
                block.history.clear()
                block.ticket = None
            # else dropped without a free: the old accesses stay, checked against drop_vc
            return block
        return None

    def free(self, bufs: Iterable[Any], streams: Sequence[Any]) -> tuple[_Ticket, str]:
        """Free ``bufs`` after the work queued so far on ``streams`` (objects with a
        ``clock``). Returns the ticket that each stream completes when it gets there, and a
        use-after-free report (empty when there is none); the buffers are released either
        way."""
        label = self.label
        report = ""
        with self._lock:
            vc: dict[int, int] = {}
            for s in streams:
                self._tick(s.clock)
                _join(vc, s.clock.vc)
            ticket = _Ticket({s.clock.sid for s in streams}, vc, label)
            for buf in bufs:
                block = self._find(_address(buf))
                if block is None or not block.allocated:
                    continue
                if block.finalizer is not None:
                    block.finalizer.detach()
                    block.finalizer = None
                if not report:
                    for a in block.history:
                        if vc.get(a.sid, 0) < a.epoch:
                            report = self._report(a, label, "use after free", "frees", block)
                            break
                block.allocated = False
                block.ticket = ticket
                ticket.blocks.append(block)
                self._pool(block)
        return ticket, report

    def complete(self, ticket: _Ticket, sid: int) -> None:
        """Stream ``sid`` has run up to the free of ``ticket``."""
        with self._lock:
            ticket.pending.discard(sid)
            if ticket.pending:
                return
            for block in ticket.blocks:
                block.storage.fill(POISON)  # still in the pool: reuse waits for this
            ticket.blocks.clear()

    def _dropped(self, block: _Block, gen: int) -> None:
        with self._lock:
            if block.gen != gen or not block.allocated:
                return
            block.allocated = False
            block.drop_vc = dict(self.host.vc)
            block.finalizer = None
            block.storage.fill(POISON)  # gone at once, whatever is still queued on it
            self._pool(block)

    def _pool(self, block: _Block) -> None:
        self._free.setdefault(block.cap, []).append(block)
        self._free_bytes += block.cap
        while self._free_bytes > _POOL_BYTES:
            victim = self._evictable()
            if victim is None:
                break
            self._free[victim.cap].remove(victim)
            self._free_bytes -= victim.cap
            i = bisect.bisect_left(self._bases, victim.base)
            del self._bases[i]
            del self._blocks[victim.base]

    def _evictable(self) -> _Block | None:
        for blocks in self._free.values():
            for block in blocks:
                if block.ticket is None or not block.ticket.pending:
                    return block
        return None

    def _find(self, addr: int) -> _Block | None:
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        block = self._blocks[self._bases[i]]
        return block if addr < block.base + block.cap else None

    # -- accesses --------------------------------------------------------------------------
    def access(self, clock: Clock, reads: Sequence[Any], writes: Sequence[Any]) -> None:
        """Check, then record, one call's accesses on ``clock``'s stream (host: ``self.host``);
        raises ``StreamRace`` (recording nothing) on a conflict."""
        label = self.label
        with self._lock:
            epoch = self._tick(clock)
            spans: list[tuple[_Block, int, int, bool]] = []
            for arrays, write in ((reads, False), (writes, True)):
                for arr in arrays:
                    nbytes = int(arr.nbytes)
                    if nbytes == 0:
                        continue
                    addr = _address(arr)
                    block = self._find(addr)
                    if block is None:
                        continue
                    lo = addr - block.base
                    spans.append((block, lo, lo + nbytes, write))
            for block, lo, hi, write in spans:
                for a in block.history:
                    if a.hi <= lo or a.lo >= hi or not (write or a.write) or a.sid == clock.sid:
                        continue
                    verb = "writes" if write else "reads"
                    if a.gen == block.gen:  # the same allocation: ordered by the streams?
                        if clock.vc.get(a.sid, 0) < a.epoch:
                            raise StreamRace(self._report(a, label, "race", verb, block))
                    elif block.drop_vc is not None and block.drop_vc.get(a.sid, 0) < a.epoch:
                        # the memory went back to the pool while that access was queued
                        raise StreamRace(
                            self._report(a, label, "use after free", verb, block)
                            + "; the memory was given back without a stream-ordered free "
                            "while that call was still queued"
                        )
            for block, lo, hi, write in spans:
                self._remember(
                    block, _Access(lo, hi, write, clock.sid, epoch, label, block.gen), clock
                )

    def _remember(self, block: _Block, new: _Access, clock: Clock) -> None:
        vc = clock.vc
        kept = [
            a
            for a in block.history
            if not (
                new.lo <= a.lo
                and a.hi <= new.hi
                and (new.write or (not a.write and a.sid == new.sid))
                and vc.get(a.sid, 0) >= a.epoch
            )
        ]
        kept.append(new)
        if len(kept) > _HISTORY:
            del kept[0]
        block.history = kept

    def _report(self, earlier: _Access, label: str, what: str, verb: str, block: _Block) -> str:
        self.races += 1
        done = "writes" if earlier.write else "reads"
        return (
            f"{what}: {label} {verb} device memory that {earlier.label} {done}, with no event "
            f"wait or synchronize ordering the two (bytes [{earlier.lo}, {earlier.hi}) of a "
            f"buffer allocated by {block.label})"
        )


class _CheckedStream(_Stream):
    """A stream of the checked device, with the vector clock its work is ordered by."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock


class _CheckedEvent(_Event):
    """An event of the checked device, carrying the clock of the stream it was recorded on."""

    __slots__ = ("vc",)

    def __init__(self) -> None:
        super().__init__()
        self.vc: dict[int, int] = {}  # never recorded: complete, waits for nothing


class SimCheckBackend(SimBackend):
    """``sim:check``: the simulated device, with the checks of the module docstring."""

    checks = True

    def __init__(self, op_us: float = 0.0) -> None:
        super().__init__(op_us)
        self.checker = Checker()

    def device_info(self) -> DeviceInfo:
        info = super().device_info()
        info["note"] = f"check: stream-ordered pool with poisoning, race detector; {info['note']}"
        return info

    def note_call(self, seq: int, call: str, op: str | None, session: int, stream: int) -> None:
        self.checker.note_call(seq, call, op, session, stream)

    # -- memory ----------------------------------------------------------------------------
    def alloc(self, nbytes: int, stream: Any = None) -> Any:
        return self.checker.alloc(nbytes)

    def adopt_host(self, host: np.ndarray[Any, Any]) -> Any | None:
        return None  # received memory is not device memory here: copied into the pool

    def as_buffer(self, array: Any) -> Any:
        flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        buf = self.checker.alloc(flat.nbytes)
        self.checker.access(self.checker.host, (), (buf,))
        buf[...] = flat
        return buf

    def free(self, bufs: Sequence[Any], streams: Sequence[Any]) -> None:
        ticket, report = self.checker.free(bufs, streams)
        complete = self.checker.complete
        for s in streams:
            sid = s.clock.sid
            if s.busy:
                s.put(lambda sid=sid: complete(ticket, sid))
            else:
                complete(ticket, sid)
        if report:
            raise StreamRace(report)

    # -- queued work -----------------------------------------------------------------------
    def from_host(self, dst: Any, src: np.ndarray[Any, Any], stream: Any) -> None:
        self.checker.access(stream.clock, (), (dst,))
        super().from_host(dst, src, stream)

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        self.checker.access(stream.clock, (src,), (dst,))
        super().copy(dst, src, stream)

    def memset(self, buf: Any, offset: int, nbytes: int, value: int, stream: Any) -> None:
        region = buf[offset : offset + nbytes]
        self.checker.access(stream.clock, (), (region,))

        def job() -> None:
            region[...] = value

        stream.put(job)

    def run_ops(self, runs: Sequence[OpRun], stream: Any) -> None:
        # each op checked as it is issued, as a launch of its own is
        for op, ins, outs, params in runs:
            self.run_op(op, ins, outs, params, stream)

    def run_op(
        self, op: Any, ins: Sequence[Any], outs: Sequence[Any], params: dict[str, Any], stream: Any
    ) -> None:
        self.checker.access(stream.clock, ins, outs)
        label = self.checker.label

        def job() -> None:
            try:
                op.run(np, ins, outs, params)
            except Exception as exc:  # raised at the next wait: name the call that failed
                raise BackendError(f"{label}: {type(exc).__name__}: {exc}") from None
            self._work()

        stream.put(job)

    def torch_runtime(self) -> TorchRuntime:
        return CheckedTorchRuntime(self)

    # -- waiting ---------------------------------------------------------------------------
    def to_host(self, src: Any, stream: Any) -> np.ndarray[Any, Any]:
        self.checker.access(stream.clock, (src,), ())
        out = super().to_host(src, stream)
        self.checker.host_waited(stream.clock)
        return out

    def run_dynamic(
        self, op: Any, ins: Sequence[Any], params: dict[str, Any], stream: Any, budget: int
    ) -> list[Any]:
        self.checker.access(stream.clock, ins, ())
        stream.wait()
        self.checker.host_waited(stream.clock)
        return super().run_dynamic(op, ins, params, stream, budget)

    def create_stream(self) -> Any:
        return _CheckedStream(self.checker.new_clock())

    def destroy_stream(self, stream: Any) -> None:
        super().destroy_stream(stream)  # waits for its work
        self.checker.host_waited(stream.clock)

    def synchronize(self, stream: Any) -> None:
        super().synchronize(stream)
        self.checker.host_waited(stream.clock)

    def create_event(self) -> Any:
        return _CheckedEvent()

    def record_event(self, event: Any, stream: Any) -> None:
        event.vc = self.checker.record(stream.clock)
        super().record_event(event, stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        self.checker.wait(stream.clock, event.vc)
        super().wait_event(stream, event)

    def query_event(self, event: Any) -> bool:
        done = super().query_event(event)
        if done:
            self.checker.host_saw(event.vc)
        return done


class CheckedTorchRuntime(SimTorchRuntime):
    """PyTorch on the checked device: each op's buffers are checked as a launch's are
    (whole), and every result is copied into the checked pool."""

    keeps_results = False  # every buffer comes from the checked pool

    def adopt(self, tensor: Any) -> Any:
        return self.backend.as_buffer(super().adopt(tensor))

    def run(
        self,
        job: Callable[[], Any],
        reads: Sequence[Any],
        writes: Sequence[Any],
        stream: Any,
        wait: bool = False,
    ) -> Any:
        checker = self.backend.checker
        checker.access(stream.clock, reads, writes)
        stream.wait()
        checker.host_waited(stream.clock)
        return job()
