"""Recorded steps on the proxy: checked once when they arrive, then replayed by one command.

A step is a sequence of ASYNC calls that a client recorded (``GPU.capture``, ``xp.capture``)
and sent once (``step_record``); each later ``step_replay`` names the step, its argument
arrays and the handles for its results, and the proxy runs the calls again without decoding
or checking them again: only what changes is checked (the arguments' shapes and dtypes against
the recorded ones). The buffers a step names are of four kinds:

- **arguments**: the buffers of its argument slots; a replay rebinds each to the array it is
  given (same shape and dtype; an offset into its buffer moves the step's views with it);
- **results**: buffers the step creates and returns; a replay creates them under new handles;
- **intermediates**: buffers the step creates and does not return; kept between replays under
  private handles when the step runs on one stream (no allocation per replay), made and freed
  by each replay when it uses several (a later replay must not overwrite what another stream
  of an earlier one still reads);
- any other buffer is the session's own (weights the step reads or updates), used as it is.

This module knows nothing of the network: the executor keeps the steps and runs them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from ..wire.calls import Arg, CallSpec, Resource
from ..wire.protocol import ArrayDesc, StepProgram, TensorDesc

__all__ = ["Binds", "RecordedStep", "StepError"]

#: recorded handle -> (the handle it stands for in this replay, offset moved by)
Binds = dict[int, tuple[int, int]]

# how an argument position is rebound
_DESC, _DESCS, _BUFFER, _KERNEL_ARGS, _TENSORS = 0, 1, 2, 3, 4
#: (position, how, the position of an offset into that buffer or -1) of what a replay rebinds
Positions = tuple[tuple[int, int, int], ...]


class StepError(Exception):
    """A step cannot be kept or replayed (the message goes back to the client)."""


@dataclass(slots=True)
class StepCall:
    """One recorded call, ready to run: its arguments as recorded and what to rebind."""

    spec: CallSpec
    stream: int
    args: tuple[Any, ...]
    rebind: Positions  # the arrays and buffers to rebind
    op: Any = None  # a launch's op, checked when the step was recorded
    #: the buffers the replay allocates before the call (results: recorded handles); the
    #: buffers an ATen op makes are its handler's to make
    creates: tuple[int, ...] = ()

    @property
    def what(self) -> str:
        """The op of a launch, else the call's name."""
        return str(self.args[0]) if self.spec.names_op else self.spec.name


@dataclass(slots=True)
class RecordedStep:
    """A step kept by a session (see the module docstring)."""

    handle: int
    calls: list[StepCall]
    slots: tuple[ArrayDesc, ...]
    results: tuple[int, ...]
    intermediates: dict[int, int]  # recorded handle -> private handle (kept between replays)
    kept: bool  # intermediates live between replays (the step uses one stream)
    nbytes: dict[int, int] = field(default_factory=dict)  # made buffers' sizes (as in calls)
    replays: int = 0
    cost_ns: float | None = None  # the proxy's estimate of a replay, made at its first
    #: how it replays, decided at its first replay (``gpuremote.proxy.graphs``): None (not
    #: yet), False (call by call), else its ``StepGraph``
    graph: Any = None
    #: on a device that times ops without computing them: None (not decided), False (call
    #: by call), else its ``TimedStep`` (``gpuremote.proxy.timedsteps``)
    timed: Any = None
    #: the recorded handle of each argument, in order (``bind_buffers`` binds by them)
    slot_handles: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.slot_handles = tuple(d.handle for d in self.slots)

    @classmethod
    def from_program(
        cls,
        handle: int,
        program: StepProgram,
        check_launch: Callable[[str, Any, Any, dict[str, Any]], Any],
        private_handles: itertools.count[int],
        check_aten: Callable[[tuple[Any, ...], dict[int, int]], None] | None = None,
    ) -> RecordedStep:
        """Check ``program`` once: its launches against the ops, its ATen ops with
        ``check_aten(args, known)`` (``known``: the sizes of its arguments' buffers and of
        those it made before), its buffers' roles. The intermediates' private handles are
        put in the calls here, so that a replay rebinds only the arguments and the
        results."""
        created: dict[int, int] = {}  # recorded handle -> nbytes
        #: the buffers an ATen op may name besides the session's: the arguments' (as large
        #: as their slots say: a replay checks the buffers it binds) and those made before
        known = {d.handle: d.offset + d.nbytes for d in program.slots}
        ops: list[Any] = []
        makes: list[tuple[int, ...]] = []
        self_made = False  # an ATen op makes its outputs itself: a replay's own, then freed
        for i, cmd in enumerate(program.commands):
            spec, args = cmd.spec, cmd.args
            op = None
            try:
                if _runs_aten(spec):
                    if check_aten is None:
                        raise StepError("this proxy does not run ATen ops in steps")
                    check_aten(args, known)
                elif spec.names_op:
                    op = check_launch(*args)
                made = _made(spec, args)
            except Exception as exc:
                raise StepError(f"call {i} ({spec.name}): {exc}") from None
            if made.keys() & created.keys():
                raise StepError(f"call {i} ({spec.name}) makes a buffer the step made already")
            created.update(made)
            known.update(made)
            ops.append(op)
            if _runs_aten(spec):
                self_made = self_made or bool(made)
                makes.append(())
            else:
                makes.append(tuple(made))
        slot_handles = {d.handle for d in program.slots}
        if slot_handles & set(created):
            raise StepError("an argument of a step cannot be a buffer the step makes")
        missing = [h for h in program.results if h not in created]
        if missing or len(set(program.results)) != len(program.results):
            raise StepError(f"the step's results {missing or 'repeat'}: not buffers it makes")
        inter = {h: next(private_handles) for h in created if h not in program.results}
        fixed: Binds = {h: (p, 0) for h, p in inter.items()}
        changing = slot_handles | set(program.results)
        calls = []
        for cmd, op, handles in zip(program.commands, ops, makes, strict=True):
            positions = _positions(cmd.spec)
            args = _rebound(cmd.args, positions, fixed)
            per_replay = tuple(p for p in positions if _names(args[p[0]], p[1], changing))
            creates = tuple(fixed[h][0] if h in fixed else h for h in handles)
            calls.append(StepCall(cmd.spec, cmd.stream, args, per_replay, op, creates))
        nbytes = {fixed[h][0] if h in fixed else h: n for h, n in created.items()}
        # an alloc's stream does not count: the client allocates on its default stream
        streams = {cmd.stream for cmd in program.commands if cmd.spec.on_stream}
        return cls(
            handle,
            calls,
            program.slots,
            program.results,
            {h: p for h, (p, _) in fixed.items()},
            len(streams) == 1 and not self_made,
            nbytes,
        )

    def bind_buffers(self, buffers: Sequence[int], results: Sequence[int]) -> Binds:
        """``bind`` for a replay that gives each argument's buffer alone (``step_run``):
        each bound where its argument was recorded, its shape and dtype the recorded ones."""
        slots = self.slots
        if len(buffers) != len(slots):
            raise StepError(f"the step takes {len(slots)} buffers; the run gave {len(buffers)}")
        if len(results) != len(self.results):
            raise StepError(
                f"the step makes {len(self.results)} results; the run gave {len(results)}"
            )
        handles = self.slot_handles
        binds: Binds = dict(zip(handles, zip(buffers, repeat(0), strict=False), strict=True))
        if len(binds) != len(slots):  # one buffer the step viewed through several arguments
            seen: dict[int, int] = {}
            for k, (h, b) in enumerate(zip(handles, buffers, strict=True)):
                if seen.setdefault(h, b) != b:
                    raise StepError(f"argument {k} is not where the step's other views of it are")
        binds.update(zip(self.results, zip(results, repeat(0), strict=False), strict=True))
        return binds

    def bind(self, args: Sequence[ArrayDesc], results: Sequence[int]) -> Binds:
        """The handles of one replay (``StepError`` if its arrays are not the recorded
        shapes and dtypes)."""
        if len(args) != len(self.slots) or len(results) != len(self.results):
            raise StepError(
                f"the step takes {len(self.slots)} arrays and makes {len(self.results)} "
                f"results; the replay gave {len(args)} and {len(results)}"
            )
        binds: Binds = {}
        for k, (slot, a) in enumerate(zip(self.slots, args, strict=True)):
            if a.shape != slot.shape or a.dtype != slot.dtype:
                raise StepError(
                    f"argument {k} is {a.shape}/{a.dtype}; the step was recorded with "
                    f"{slot.shape}/{slot.dtype}"
                )
            bound = (a.handle, a.offset - slot.offset)
            if binds.setdefault(slot.handle, bound) != bound:
                raise StepError(f"argument {k} is not where the step's other views of it are")
        for recorded, new in zip(self.results, results, strict=True):
            binds[recorded] = (new, 0)
        return binds


def rebind(call: StepCall, binds: Binds) -> tuple[Any, ...]:
    """``call``'s arguments with one replay's arguments and results."""
    if not call.rebind:
        return call.args
    return _rebound(call.args, call.rebind, binds)


def _rebound(args: tuple[Any, ...], positions: Positions, binds: Binds) -> tuple[Any, ...]:
    out = list(args)
    for pos, how, offset in positions:
        a = out[pos]
        if how == _DESC:
            out[pos] = _desc(a, binds)
        elif how == _DESCS:
            out[pos] = tuple([_desc(d, binds) for d in a])
        elif how == _TENSORS:
            out[pos] = tuple([_tensor(t, binds) for t in a])
        elif how == _BUFFER:
            b = binds.get(a)
            if b is not None:
                out[pos] = b[0]
                if offset >= 0:  # an offset into it (memset's) moves with it
                    out[offset] += b[1]
        else:
            out[pos] = tuple([("a", _desc(k[1], binds)) if k[0] == "a" else k for k in a])
    return tuple(out)


def _names(a: Any, how: int, handles: set[int]) -> bool:
    """Whether argument ``a`` (rebound ``how``) names one of ``handles``."""
    if how == _DESC:
        return bool(a.handle in handles)
    if how in (_DESCS, _TENSORS):
        return any(d.handle in handles for d in a)
    if how == _BUFFER:
        return a in handles
    return any(k[0] == "a" and k[1].handle in handles for k in a)


def _moved(handle: int, offset: int, binds: Binds) -> tuple[int, int] | None:
    """Where a recorded view at ``offset`` into buffer ``handle`` lies in this replay (None:
    where it was recorded)."""
    b = binds.get(handle)
    if b is None:
        return None
    offset += b[1]
    if offset < 0:
        raise StepError("an argument's offset would move the step's views before its buffer")
    return b[0], offset


def _desc(d: ArrayDesc, binds: Binds) -> ArrayDesc:
    m = _moved(d.handle, d.offset, binds)
    return d if m is None else ArrayDesc(m[0], m[1], d.shape, d.dtype, d.nbytes)


def _tensor(t: TensorDesc, binds: Binds) -> TensorDesc:
    m = _moved(t.handle, t.offset, binds)
    return t if m is None else TensorDesc(m[0], m[1], t.sizes, t.strides, t.dtype)


def _runs_aten(spec: CallSpec) -> bool:
    """Whether ``spec`` runs an ATen op (its operands are strided tensors)."""
    return any(p.kind is Arg.TENSORS for p in spec.args)


def _positions(spec: CallSpec) -> Positions:
    """Where ``spec``'s arguments name buffers (the call table says), and how each is
    rebound."""
    how = {
        Arg.ARRAY: _DESC,
        Arg.ARRAYS: _DESCS,
        Arg.KERNEL_ARGS: _KERNEL_ARGS,
        Arg.TENSORS: _TENSORS,
    }
    out = []
    for i, p in enumerate(spec.args):
        if p.kind in how:
            out.append((i, how[p.kind], -1))
        elif p.kind is Arg.HANDLE and p.use and p.resource is Resource.BUFFER:
            offset = next((j for j, q in enumerate(spec.args) if q.offset_into == p.name), -1)
            out.append((i, _BUFFER, offset))
    return tuple(out)


def _made(spec: CallSpec, args: tuple[Any, ...]) -> dict[int, int]:
    """The buffers a call of a step makes (the call table says which arguments create
    them), by handle, and their sizes."""
    made: dict[int, int] = {}
    for i, resource in spec.creates:
        if resource is not Resource.BUFFER:
            continue
        if spec.args[i].kind is Arg.ARRAYS:  # a launch's new outputs
            descs = args[i]
            if any(d.offset for d in descs):
                raise StepError(f"{spec.name} outputs must start their buffer")
            made.update((d.handle, d.nbytes) for d in descs)
            if len(made) != len(descs):
                raise StepError(f"{spec.name} outputs must be different buffers")
        elif spec.args[i].kind is Arg.TENSORS:  # an ATen op's new outputs
            tensors = args[i]
            if any(t.offset for t in tensors):
                raise StepError(f"{spec.name} outputs must start their buffer")
            made.update((t.handle, t.extent) for t in tensors)
            if len(made) != len(tensors):
                raise StepError(f"{spec.name} outputs must be different buffers")
        else:  # an alloc: its size is another argument
            name = spec.args[i].name
            size = next(j for j, q in enumerate(spec.args) if q.size_of == name)
            made[args[i]] = args[size]
    return made
