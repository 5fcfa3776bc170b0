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
from typing import Any

from ..wire.calls import CALLS_BY_NAME, Arg, CallSpec
from ..wire.protocol import ArrayDesc, StepProgram

__all__ = ["Binds", "RecordedStep", "StepError"]

#: recorded handle -> (the handle it stands for in this replay, offset moved by)
Binds = dict[int, tuple[int, int]]

_ALLOC, _LAUNCH_NEW = CALLS_BY_NAME["alloc"], CALLS_BY_NAME["launch_new"]
_LAUNCHES = (CALLS_BY_NAME["launch"], _LAUNCH_NEW)

# how an argument position is rebound
_DESC, _DESCS, _BUFFER, _KERNEL_ARGS, _BUFFER_AT = 0, 1, 2, 3, 4  # AT: an offset follows


class StepError(Exception):
    """A step cannot be kept or replayed (the message goes back to the client)."""


@dataclass(slots=True)
class StepCall:
    """One recorded call, ready to run: its arguments as recorded and what to rebind."""

    spec: CallSpec
    stream: int
    args: tuple[Any, ...]
    rebind: tuple[tuple[int, int], ...]  # (position, how) of arrays and buffers to rebind
    op: Any = None  # a launch's op, checked when the step was recorded
    creates: tuple[int, ...] = ()  # the buffers it allocates (results: recorded handles)

    @property
    def what(self) -> str:
        """The op of a launch, else the call's name."""
        return str(self.args[0]) if self.spec in _LAUNCHES else self.spec.name


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

    @classmethod
    def from_program(
        cls,
        handle: int,
        program: StepProgram,
        check_launch: Callable[[str, Any, Any, dict[str, Any]], Any],
        private_handles: itertools.count[int],
    ) -> RecordedStep:
        """Check ``program`` once: its launches against the ops, its buffers' roles. The
        intermediates' private handles are put in the calls here, so that a replay rebinds
        only the arguments and the results."""
        created: dict[int, int] = {}  # recorded handle -> nbytes
        ops: list[Any] = []
        makes: list[tuple[int, ...]] = []
        for i, cmd in enumerate(program.commands):
            spec, args = cmd.spec, cmd.args
            op, made = None, {}
            try:
                if spec in _LAUNCHES:
                    op = check_launch(*args)
                    if spec is _LAUNCH_NEW:
                        if any(d.offset for d in args[2]):
                            raise StepError("launch_new outputs must start their buffer")
                        made = {d.handle: d.nbytes for d in args[2]}
                        if len(made) != len(args[2]):
                            raise StepError("launch_new outputs must be different buffers")
                elif spec is _ALLOC:
                    made = {args[0]: args[1]}
            except Exception as exc:
                raise StepError(f"call {i} ({spec.name}): {exc}") from None
            if made.keys() & created.keys():
                raise StepError(f"call {i} ({spec.name}) makes a buffer the step made already")
            created.update(made)
            ops.append(op)
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
        streams = {cmd.stream for cmd in program.commands if cmd.spec is not _ALLOC}
        return cls(
            handle,
            calls,
            program.slots,
            program.results,
            {h: p for h, (p, _) in fixed.items()},
            len(streams) == 1,
            nbytes,
        )

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


def _rebound(
    args: tuple[Any, ...], positions: tuple[tuple[int, int], ...], binds: Binds
) -> tuple[Any, ...]:
    out = list(args)
    for pos, how in positions:
        a = out[pos]
        if how == _DESC:
            out[pos] = _desc(a, binds)
        elif how == _DESCS:
            out[pos] = tuple([_desc(d, binds) for d in a])
        elif how in (_BUFFER, _BUFFER_AT):
            b = binds.get(a)
            if b is not None:
                out[pos] = b[0]
                if how == _BUFFER_AT:  # memset's offset moves with its buffer
                    out[pos + 1] += b[1]
        else:
            out[pos] = tuple([("a", _desc(k[1], binds)) if k[0] == "a" else k for k in a])
    return tuple(out)


def _names(a: Any, how: int, handles: set[int]) -> bool:
    """Whether argument ``a`` (rebound ``how``) names one of ``handles``."""
    if how == _DESC:
        return bool(a.handle in handles)
    if how == _DESCS:
        return any(d.handle in handles for d in a)
    if how in (_BUFFER, _BUFFER_AT):
        return a in handles
    return any(k[0] == "a" and k[1].handle in handles for k in a)


def _desc(d: ArrayDesc, binds: Binds) -> ArrayDesc:
    b = binds.get(d.handle)
    if b is None:
        return d
    offset = d.offset + b[1]
    if offset < 0:
        raise StepError("an argument's offset would move the step's views before its buffer")
    return ArrayDesc(b[0], offset, d.shape, d.dtype)


def _positions(spec: CallSpec) -> tuple[tuple[int, int], ...]:
    """Where ``spec``'s arguments name buffers, and how each is rebound."""
    out = []
    for i, (_, kind) in enumerate(spec.args):
        if kind is Arg.ARRAY:
            out.append((i, _DESC))
        elif kind is Arg.ARRAYS:
            out.append((i, _DESCS))
        elif kind is Arg.KERNEL_ARGS:
            out.append((i, _KERNEL_ARGS))
        elif kind is Arg.HANDLE and spec.name == "alloc":
            out.append((i, _BUFFER))
        elif kind is Arg.HANDLE and spec.name == "memset":
            out.append((i, _BUFFER_AT))
    return tuple(out)
