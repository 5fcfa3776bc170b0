"""The ledger of a failover session: the journal and the state of every buffer, kept as calls
are made, with no I/O and no event loop (tested alone, as h11's state machine is).

- **The journal**: every call since the last checkpoint, in order. An ``int`` frees that
  buffer; ``bytes`` is an ASYNC call packed (``pack``); a ``(bytes, data)`` pair one with its
  host data; an ``Answered`` a call that was (or is to be) answered: SYNC, or ASYNC with an
  acknowledgement. Nothing in it is a container the garbage collector keeps looking at, but
  the few ``Answered``.
- **The state after the whole journal**: the live buffers and their sizes, those written
  since the checkpoint (``dirty``), those whose last write was an upload of the client's own
  bytes (``host``: no copy is needed to keep them), the streams, events, kernels and recorded
  steps alive (their creating calls, packed).
- **The checkpoint**: the state at the journal's start (``base``: each buffer's size and where
  its copy is: the client's bytes, or a copy on a standby proxy), which a checkpoint replaces
  (``snapshot``, then ``commit``) and a move restores.

What each call makes, writes and frees comes from the call table's columns
(``gpuremote.wire.calls``), read once per call into a short list of steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from ...wire.calls import BUFFER, CALLS, CALLS_BY_OPCODE, Arg, CallSpec, Resource
from ...wire.protocol import DTYPES, TENSOR_DTYPES, extent

__all__ = [
    "RNG",
    "Answered",
    "Ledger",
    "Snapshot",
    "Source",
    "pack",
    "step_sizes",
    "step_writes",
    "unpack",
]

#: SYNC calls that make buffers whose sizes their answer gives (``launch_dynamic``)
SIZED_BY_ANSWER = frozenset(
    c.name for c in CALLS if c.sync and any(r is Resource.BUFFER for _, r in c.creates)
)
#: SYNC calls that write data that comes from elsewhere, which a re-issue cannot fetch again
#: (``peer_import``: its ticket is used up); not those that compute (``aten_dynamic``)
WRITES_FROM_ELSEWHERE = frozenset(
    c.name for c in CALLS if c.sync and any(c.args[i].kind is Arg.ARRAY for i, _ in c.writes)
)

#: the key, among a checkpoint's resources, of the call that restores the session's random
#: generator to its state at the checkpoint (``aten_rng_set``)
RNG = ("rng", 0)

#: where a checkpointed buffer's copy is: ``("host", its bytes)`` or ``("ck", the handle of
#: its copy on the standby proxy)``
Source = tuple[str, Any]

_PACK = msgpack.Packer().pack
#: opcode -> the position of the argument that carries host data, for the calls that have one
_HOST_DATA = {c.opcode: i for c in CALLS for i, p in enumerate(c.args) if p.kind is Arg.BUFFER}


def pack(spec: CallSpec, stream: int, args: list[Any]) -> bytes:
    """An ASYNC call as the journal keeps it (its host data apart); raises what the wire
    would (``TypeError``, ``ValueError``, ``OverflowError``) for what cannot be sent."""
    at = _HOST_DATA.get(spec.opcode)
    if at is not None:
        args = [*args]
        args[at] = None
    return _PACK((spec.opcode, stream, args))


def unpack(packed: bytes) -> tuple[CallSpec, int, list[Any]]:
    """A journaled call's spec, stream and args (``BUFFER`` where its host data goes)."""
    opcode, stream, args = msgpack.unpackb(packed)
    at = _HOST_DATA.get(opcode)
    if at is not None:
        args[at] = BUFFER
    return CALLS_BY_OPCODE[opcode], stream, args


def nbytes(wire: list[Any]) -> int:
    """The bytes of an array descriptor ``[handle, offset, shape, dtype]``."""
    return math.prod(wire[2]) * DTYPES[wire[3]].itemsize


def answer_sizes(spec: CallSpec, value: Any) -> list[int]:
    """The bytes of each buffer a call sized by its answer made, from its answer:
    ``launch_dynamic``'s ``[[shape, dtype], ...]``; ``aten_dynamic``'s result, where each
    tensor it made is ``{"t": [sizes, dtype]}`` (in a list for a list of tensors)."""
    if spec.name == "launch_dynamic":
        return [math.prod(shape) * DTYPES[dtype].itemsize for shape, dtype in value]
    sizes: list[int] = []
    for v in value:
        for t in v if type(v) is list else [v]:
            if type(t) is dict and "t" in t:
                shape, dtype = t["t"]
                sizes.append(math.prod(shape) * TENSOR_DTYPES[dtype])
    return sizes


class Answered:
    """A journaled call that is answered (SYNC, or ASYNC with ``ack``). ``outer`` is what
    the session gives the answer to, whichever proxy gives it (the ledger does not look at
    it); ``done``: a proxy answered it; ``deferred``: with a deferred error (it did not run);
    ``value``: what a re-issue needs of its answer; ``stashed``: its loss was reported."""

    __slots__ = (
        "ack",
        "args",
        "buffer",
        "deferred",
        "done",
        "outer",
        "spec",
        "stashed",
        "stream",
        "value",
    )

    def __init__(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None, ack: bool
    ) -> None:
        self.spec = spec
        self.stream = stream
        self.args = args
        self.buffer = buffer
        self.ack = ack
        self.outer: Any = None
        self.done = False
        self.deferred = False
        self.value: Any = None
        self.stashed = False


@dataclass(slots=True)
class Snapshot:
    """The state at one point of the journal (``upto``), as a checkpoint copies it: the
    calls before it not answered yet (``waiting``), the live buffers, those written since the
    last checkpoint, those the client holds the bytes of, the resources alive."""

    upto: int
    waiting: list[Answered]
    live: dict[int, int]
    dirty: set[int]
    host: dict[int, memoryview]
    res: dict[tuple[str, int], bytes]


class Ledger:
    """The journal and the buffers' states (see the module docstring)."""

    def __init__(self) -> None:
        self.journal: list[Any] = []
        self.journal_bytes = 0  # host data in the journal
        self.unanswered: set[Answered] = set()  # journaled calls not answered yet
        # the checkpoint: the state at the journal's start
        self.base: dict[int, tuple[int, Source]] = {}  # handle -> nbytes, where its copy is
        self.base_complete = True  # False: part of it was lost, until the next checkpoint
        self.res_base: dict[tuple[str, int], bytes] = {}
        # the state after the whole journal
        self.live: dict[int, int] = {}  # buffer -> bytes
        self.dirty: set[int] = set()  # written since the checkpoint being taken (or the last)
        self.host: dict[int, memoryview] = {}  # buffers whose last write was an upload
        self.res: dict[tuple[str, int], bytes] = {}  # streams, events, kernels, steps
        self.step_results: dict[int, list[int]] = {}  # recorded step -> its results' bytes
        self.step_writes: dict[int, list[int]] = {}  # recorded step -> session buffers it writes
        #: ATen template -> the bytes of each buffer its calls make
        self.template_outputs: dict[int, list[int]] = {}
        self.dynamic = 0  # calls sized by their answer, not answered yet (sizes unknown)
        self.streams = False  # streams besides the default one were made
        #: the session's random generator on the proxy was used (its state is checkpointed)
        self.random = False
        self.checkpoint_due = True  # the first checkpoint as soon as there is something

    # -- what calls change -------------------------------------------------------------------
    def track(
        self, spec: CallSpec, args: list[Any], buffer: memoryview | None, packed: bytes
    ) -> None:
        """What an ASYNC call makes, writes, frees or creates (the state a checkpoint keeps);
        ``packed``: the call as journaled (kept for what it creates)."""
        if spec.random:
            self.random = True
        for step, i in _TRACKS[spec.opcode]:
            step(self, spec, args, i, buffer, packed)

    def journal_call(self, packed: bytes, buffer: memoryview | None) -> None:
        """Journal an ASYNC call (``track``-ed already) and its host data."""
        if buffer is None:
            self.journal.append(packed)
        else:
            self.journal.append((packed, buffer))
            self.journal_bytes += buffer.nbytes

    def freed(self, handle: int) -> None:
        """Journal the free of buffer ``handle``."""
        self.journal.append(handle)
        self.live.pop(handle, None)
        self.dirty.discard(handle)
        if self.host:
            self.host.pop(handle, None)

    def write(self, handle: int) -> None:
        """Buffer ``handle`` is written (by the device)."""
        self.dirty.add(handle)
        if self.host:
            self.host.pop(handle, None)

    def begin(self, entry: Answered) -> None:
        """Journal a call that is answered: it is waited for from now on."""
        self.unanswered.add(entry)
        spec = entry.spec
        if spec.random:
            self.random = True
        if spec.name in SIZED_BY_ANSWER:
            self.dynamic += 1
        if spec.sync:
            for i, resource in spec.writes:  # data written: a checkpoint copies it
                if resource is Resource.BUFFER:
                    for h in _handles(spec, i, entry.args[i]):
                        self.write(h)
        elif entry.ack:
            self.track(spec, entry.args, entry.buffer, b"")
        self.journal.append(entry)
        if entry.buffer is not None:
            self.journal_bytes += entry.buffer.nbytes

    def answered(self, entry: Answered, value: Any, error: BaseException | None) -> None:
        """A proxy answered ``entry`` with ``value``, or failed it with ``error`` (a
        ``RemoteCallError``; ``deferred``: an earlier call's error)."""
        self.unanswered.discard(entry)
        first = not entry.done
        entry.done = True
        name = entry.spec.name
        if not entry.ack:
            entry.buffer = None  # a SYNC call's data is not needed again
            if name not in SIZED_BY_ANSWER and name not in WRITES_FROM_ELSEWHERE:
                entry.args = []  # nor a read's arguments (kept alive, they cost the GC)
        if error is None:
            if name in SIZED_BY_ANSWER and first:
                entry.value = value
                made = next(i for i, r in entry.spec.creates if r is Resource.BUFFER)
                sizes = answer_sizes(entry.spec, value)
                for h, n in zip(entry.args[made], sizes, strict=True):
                    self.live[h] = n
                    self.dirty.add(h)
            elif name in WRITES_FROM_ELSEWHERE:
                entry.value = True  # it wrote the array
                self.checkpoint_due = True  # another proxy's data: kept by a checkpoint soon
        else:
            entry.deferred = bool(getattr(error, "deferred", False))
        if name in SIZED_BY_ANSWER and first:
            self.dynamic -= 1

    def gave_up(self, entry: Answered) -> None:
        """The caller stopped waiting for ``entry`` (cancelled): the proxy ran it, the answer
        is unknown."""
        self.unanswered.discard(entry)
        sized = entry.spec.name in SIZED_BY_ANSWER
        if not entry.done and sized:
            self.dynamic -= 1
        elif not entry.ack and not sized:
            entry.deferred = True  # re-issued as a synchronisation: it may have taken an
            # error that nobody saw, as it would again
        entry.done = True

    def full(self, max_calls: int, max_bytes: int) -> bool:
        """Whether the journal holds ``max_calls`` calls or ``max_bytes`` of host data."""
        return len(self.journal) >= max_calls or self.journal_bytes >= max_bytes

    # -- checkpoints -------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The state at the journal's end, for a checkpoint; what is written from here on is
        tracked apart (``abandon`` puts it back if the checkpoint is not taken)."""
        snap = Snapshot(
            len(self.journal),
            list(self.unanswered),
            dict(self.live),
            self.dirty,
            self.host,
            dict(self.res),
        )
        self.dirty, self.host = set(), {}
        return snap

    def to_copy(self, snap: Snapshot) -> list[int]:
        """The buffers a checkpoint of ``snap`` copies: written since the last one, or whose
        copy was lost (with a standby, or taken over by a move), and not the client's own
        bytes (an upload)."""
        base = self.base
        return sorted(
            h for h in snap.live if h not in snap.host and (h in snap.dirty or h not in base)
        )

    def never_made(self, snap: Snapshot, handle: int) -> None:
        """The proxy has no buffer ``handle`` (the call that was to make it failed, and its
        error was the application's): nothing to keep of it, here or anywhere."""
        snap.live.pop(handle)
        self.live.pop(handle, None)

    def abandon(self, snap: Snapshot) -> None:
        """The checkpoint of ``snap`` was not taken: what it held is still to keep."""
        now = self.dirty
        for h, data in snap.host.items():
            if h in self.live and h not in now:
                self.host[h] = data
        now.update(h for h in snap.dirty if h in self.live)

    def commit(self, snap: Snapshot, sources: dict[int, Source]) -> tuple[set[int], list[int]]:
        """The state of ``snap`` is the checkpoint now, with the copies made (``sources``);
        returns the standby copies it keeps, and those of the previous one it no longer
        needs."""
        base: dict[int, tuple[int, Source]] = {}
        for h, n in snap.live.items():
            src = sources.get(h)
            if src is None:
                src = ("host", snap.host[h]) if h in snap.host else self.base[h][1]
            base[h] = (n, src)
        kept = {src[1] for _, src in base.values() if src[0] == "ck"}
        dropped = [s[1] for _, s in self.base.values() if s[0] == "ck" and s[1] not in kept]
        self.base = base
        self.base_complete = True
        self.res_base = snap.res
        del self.journal[: snap.upto]
        self.journal_bytes = sum(_entry_bytes(e) for e in self.journal)
        self.checkpoint_due = False
        return kept, dropped

    def copies_lost(self) -> bool:
        """The standby's copies are gone: the checkpoint lacks them until the next one, which
        is due at once. Whether any of its buffers were there."""
        kept = {h: v for h, v in self.base.items() if v[1][0] != "ck"}
        if len(kept) == len(self.base):
            return False
        self.base = kept
        self.base_complete = False
        self.checkpoint_due = True
        return True

    def copies_taken_over(self) -> None:
        """A move restored the checkpoint onto the standby: its copies became the session's
        buffers, and none is kept elsewhere until the next checkpoint."""
        self.base = {h: v for h, v in self.base.items() if v[1][0] == "host"}
        self.base_complete = False

    def copies_on_standby(self) -> bool:
        """Whether the checkpoint keeps buffers on a standby proxy."""
        return any(src[0] == "ck" for _, src in self.base.values())


def _entry_bytes(e: Any) -> int:
    if type(e) is tuple:
        return int(e[1].nbytes)
    if isinstance(e, Answered) and e.buffer is not None:
        return e.buffer.nbytes
    return 0


# -- what one call does, read from the call table ------------------------------------------------
Track = Callable[[Ledger, CallSpec, list[Any], int, "memoryview | None", bytes], None]


def _handles(spec: CallSpec, i: int, arg: Any) -> list[int]:
    """The buffers argument ``i`` (its client form) names."""
    kind = spec.args[i].kind
    if kind is Arg.ARRAY:
        return [arg[0]]
    if kind is Arg.ARRAYS:
        return [w[0] for w in arg]
    if kind is Arg.KERNEL_ARGS:
        return [k[1][0] for k in arg if k[0] == "a"]
    if kind is Arg.HANDLES:
        return list(arg)
    if kind is Arg.TENSORS:
        return [t[0] for t in arg]
    if kind is Arg.PLACES:  # [handle, offset] pairs, flat
        return list(arg[0::2])
    return [arg]


def _frees(ledger: Ledger, spec: CallSpec, args: list[Any], i: int, *_: Any) -> None:
    live, dirty, host = ledger.live, ledger.dirty, ledger.host
    for h in _handles(spec, i, args[i]):
        live.pop(h, None)
        dirty.discard(h)
        host.pop(h, None)


def _creates_outputs(ledger: Ledger, spec: CallSpec, args: list[Any], i: int, *_: Any) -> None:
    live, dirty = ledger.live, ledger.dirty
    for w in args[i]:  # new outputs: each at the start of its new buffer
        h = w[0]
        if w[1] == 0 and h not in live:  # (``nbytes``, inline: the common call's path)
            n = DTYPES[w[3]].itemsize
            for d in w[2]:
                n *= d
            live[h] = n
        dirty.add(h)


def _creates_tensors(ledger: Ledger, spec: CallSpec, args: list[Any], i: int, *_: Any) -> None:
    live, dirty = ledger.live, ledger.dirty
    for t in args[i]:  # new tensors, each filling a new buffer from its start
        h = t[0]
        if h not in live:
            live[h] = t[1] + extent(t[2], t[3], TENSOR_DTYPES[t[4]])
        dirty.add(h)


def _creates_sized(ledger: Ledger, spec: CallSpec, args: list[Any], i: int, *_: Any) -> None:
    size = next(j for j, p in enumerate(spec.args) if p.size_of == spec.args[i].name)
    ledger.live[args[i]] = args[size]
    ledger.write(args[i])


def _creates_step_results(ledger: Ledger, spec: CallSpec, args: list[Any], i: int, *_: Any) -> None:
    step = next(j for j, r in spec.reads if r is Resource.STEP)
    for h, n in zip(args[i], ledger.step_results.get(args[step], []), strict=False):
        ledger.live[h] = n
        ledger.dirty.add(h)


def _creates_template_outputs(
    ledger: Ledger, spec: CallSpec, args: list[Any], i: int, *_: Any
) -> None:
    template = next(j for j, r in spec.reads if r is Resource.TEMPLATE)
    for h, n in zip(args[i], ledger.template_outputs.get(args[template], ()), strict=False):
        ledger.live[h] = n
        ledger.dirty.add(h)


def _writes(ledger: Ledger, spec: CallSpec, args: list[Any], i: int, *_: Any) -> None:
    for h in _handles(spec, i, args[i]):
        ledger.write(h)


def _uploads(
    ledger: Ledger, spec: CallSpec, args: list[Any], i: int, buffer: memoryview | None, _: bytes
) -> None:
    w = args[i]
    h = w[0]
    ledger.dirty.add(h)
    if buffer is not None and w[1] == 0 and nbytes(w) == ledger.live.get(h, -1):
        ledger.host[h] = buffer  # the client's own copy of the whole buffer
    else:
        ledger.host.pop(h, None)


def _step_writes_too(ledger: Ledger, spec: CallSpec, args: list[Any], i: int, *_: Any) -> None:
    for h in ledger.step_writes.get(args[i], ()):  # the arrays a step closes over
        ledger.write(h)


def _creates_resource(
    ledger: Ledger, spec: CallSpec, args: list[Any], i: int, _: Any, packed: bytes
) -> None:
    kind = spec.args[i].resource.value
    ledger.res[(kind, args[i])] = packed
    if kind == "stream":
        ledger.streams = True
    elif kind == "step":
        program = args[spec.position("program")]
        ledger.step_results[args[i]] = step_sizes(program)
        ledger.step_writes[args[i]] = step_writes(program)
    elif kind == "template":  # the bytes of each buffer its calls make
        ledger.template_outputs[args[i]] = [
            extent(t[2], t[3], TENSOR_DTYPES[t[4]]) for t in args[spec.position("outputs")]
        ]


def _ends_resource(ledger: Ledger, spec: CallSpec, args: list[Any], i: int, *_: Any) -> None:
    kind = spec.args[i].resource.value
    ledger.res.pop((kind, args[i]), None)
    if kind == "step":
        ledger.step_results.pop(args[i], None)
        ledger.step_writes.pop(args[i], None)


def _tracks(spec: CallSpec) -> list[tuple[Track, int]]:
    """What tracking a call of ``spec`` does: a step per argument that names a resource."""
    out: list[tuple[Track, int]] = []
    for i, resource in spec.frees:
        out.append((_frees if resource is Resource.BUFFER else _ends_resource, i))
    for i, resource in spec.creates:
        kind = spec.args[i].kind
        if resource is not Resource.BUFFER:
            out.append((_creates_resource, i))
        elif kind is Arg.ARRAYS:
            out.append((_creates_outputs, i))
        elif kind is Arg.TENSORS:
            out.append((_creates_tensors, i))
        elif kind is Arg.HANDLE:
            out.append((_creates_sized, i))
        elif any(r is Resource.STEP for _, r in spec.reads):
            out.append((_creates_step_results, i))
        elif any(r is Resource.TEMPLATE for _, r in spec.reads):
            out.append((_creates_template_outputs, i))
    host_data = any(p.kind is Arg.BUFFER for p in spec.args)
    for i, resource in spec.writes:
        if resource is Resource.BUFFER:
            upload = host_data and spec.args[i].kind is Arg.ARRAY
            out.append((_uploads if upload else _writes, i))
    for i, resource in spec.reads:
        if resource is Resource.STEP:
            out.append((_step_writes_too, i))
    return out


_TRACKS: dict[int, list[tuple[Track, int]]] = {s.opcode: _tracks(s) for s in CALLS if s.opcode}


# -- recorded steps ---------------------------------------------------------------------------
def step_sizes(program: list[Any]) -> list[int]:
    """The bytes of each result buffer of a recorded step (its wire form)."""
    arrays, commands, _, results = program
    sizes: dict[int, int] = {}
    for opcode, _, args in commands:
        spec = CALLS_BY_OPCODE[opcode]
        for i, resource in spec.creates:
            if resource is not Resource.BUFFER:
                continue
            if spec.args[i].kind is Arg.ARRAYS:  # indexes of the step's array table
                for w in (arrays[k] for k in args[i]):
                    if w[1] == 0:
                        sizes.setdefault(w[0], nbytes(w))
            elif spec.args[i].kind is Arg.TENSORS:  # an ATen op's outputs, inline
                for t in args[i]:
                    sizes.setdefault(t[0], extent(t[2], t[3], TENSOR_DTYPES[t[4]]))
            else:
                size = next(j for j, p in enumerate(spec.args) if p.size_of == spec.args[i].name)
                sizes[args[i]] = args[size]
    return [sizes.get(h, 0) for h in results]


def step_writes(program: list[Any]) -> list[int]:
    """The buffers a recorded step writes that are neither its arguments nor its own (the
    session's arrays it closes over): written at each replay."""
    arrays, commands, slots, _ = program
    created: set[int] = set()
    written: set[int] = set()
    for opcode, _, args in commands:
        spec = CALLS_BY_OPCODE.get(opcode)
        if spec is None:
            continue
        for into, uses in ((created, spec.creates), (written, spec.writes)):
            for i, resource in uses:
                if resource is Resource.BUFFER:
                    into.update(_step_handles(spec, i, args[i], arrays))
    return sorted(written - created - {arrays[i][0] for i in slots})


def _step_handles(spec: CallSpec, i: int, arg: Any, arrays: list[list[Any]]) -> list[int]:
    """The buffers argument ``i`` of a step's call names (arrays by index in its table)."""
    kind = spec.args[i].kind
    if kind is Arg.ARRAY:
        return [arrays[arg][0]]
    if kind is Arg.ARRAYS:
        return [arrays[k][0] for k in arg]
    if kind is Arg.KERNEL_ARGS:
        return [arrays[k[1]][0] for k in arg if k[0] == "a"]
    if kind is Arg.TENSORS:  # inline, not in the table
        return [t[0] for t in arg]
    return [arg]
