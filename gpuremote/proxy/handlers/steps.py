"""The handlers of the recorded-step calls: a step kept (checked once, ``RecordedStep``),
replayed by one command, forgotten."""

from __future__ import annotations

import contextlib
from typing import Any

from ...wire.calls import CALLS_BY_NAME
from ...wire.protocol import ArrayDesc, StepProgram
from ..aten import aten_session, check_recorded
from ..graphs import GraphCallError, StepGraph, graph_for, replay_graph
from ..state import CALL_FAILURES, BatchContext, CallFailed, Handler, ReplayFailed, SessionState
from ..steps import RecordedStep, StepError, rebind
from ..timedsteps import TimedStep, timed_step
from . import aten, launches, memory, streams

__all__ = ["HANDLERS", "make_results"]

#: the handlers of the calls a step may hold that are not launches of ops
_WORK = {
    name: handler
    for module in (memory, launches, streams, aten)
    for name, handler in module.HANDLERS.items()
    if CALLS_BY_NAME[name].recordable
}


def step_record(s: SessionState, ctx: BatchContext, handle: int, program: StepProgram) -> None:
    if handle in s.steps:
        raise CallFailed(f"step handle {handle} is already in use")
    limits = s.limits
    if len(s.steps) >= limits.max_steps:
        raise CallFailed(f"session keeps {len(s.steps)} steps; the limit is {limits.max_steps}")
    n = len(program.commands)
    if s.step_calls + n > limits.max_step_calls:
        raise CallFailed(
            f"a step of {n} calls would make this session's steps hold "
            f"{s.step_calls + n} calls; the limit is {limits.max_step_calls}"
        )
    step = RecordedStep.from_program(
        handle,
        program,
        launches.check_launch,
        s.private_handles,
        lambda args, made: check_recorded(s, args, made),
    )
    s.steps[handle] = step
    s.step_calls += n


def step_free(s: SessionState, ctx: BatchContext, handle: int) -> None:
    step = s.step(handle)
    del s.steps[handle]
    s.step_calls -= len(step.calls)
    if isinstance(step.graph, StepGraph):
        step.graph.release(s)
    s.free([p for p in step.intermediates.values() if p in s.buffers])


def make_results(s: SessionState, handle: int, results: tuple[int, ...]) -> None:
    """Make a step's result buffers without running it (its stream was poisoned)."""
    step = s.step(handle)
    for recorded, new in zip(step.results, results, strict=False):
        if new not in s.buffers:
            s.alloc(new, step.nbytes[recorded])


def step_replay(
    s: SessionState,
    ctx: BatchContext,
    handle: int,
    args: tuple[ArrayDesc, ...],
    results: tuple[int, ...],
) -> None:
    step = s.step(handle)
    try:
        binds = step.bind(args, results)
    except StepError:
        with contextlib.suppress(*CALL_FAILURES):  # its results exist, as after a skip
            make_results(s, handle, results)
        raise
    _replay(s, ctx, step, binds, results)


def _replay(
    s: SessionState, ctx: BatchContext, step: RecordedStep, binds: Any, results: tuple[int, ...]
) -> None:
    """Replay ``step`` with ``binds``: as timed, as one graph, or call by call."""
    try:
        timed = timed_step(s, step)
        if timed is not None:
            _run_timed(s, ctx, timed, step, binds)
        elif (graph := _graph(s, step)) is None:
            _run(s, ctx, step, binds)
        else:
            _run_graph(s, ctx, graph, binds)
    except ReplayFailed:
        with contextlib.suppress(*CALL_FAILURES):  # its results exist, as after a skip
            make_results(s, step.handle, results)
        raise
    finally:
        if not step.kept:  # intermediates of a step on several streams: this replay's own
            s.free([p for p in step.intermediates.values() if p in s.buffers])
    step.replays += 1


def _graph(s: SessionState, step: RecordedStep) -> StepGraph | None:
    """The graph ``step`` replays as, where it runs as one (``gpuremote.proxy.graphs``;
    decided at its first replay: a step of no ATen op never is one)."""
    graph = step.graph
    if graph is None:
        if not any(c.spec.name == "aten" for c in step.calls):
            step.graph = False
            return None
        return graph_for(s, aten_session(s), step)
    return graph if graph is not False else None


def step_run(
    s: SessionState,
    ctx: BatchContext,
    handle: int,
    buffers: tuple[int, ...],
    results: tuple[int, ...],
) -> None:
    """``step_replay`` with each argument given by its buffer alone: bound where the step's
    argument was recorded (its offset, shape and dtype), as the replay of that array."""
    step = s.step(handle)
    try:
        binds = step.bind_buffers(buffers, results)
    except StepError:
        with contextlib.suppress(*CALL_FAILURES):  # its results exist, as after a skip
            make_results(s, handle, results)
        raise
    _replay(s, ctx, step, binds, results)


def _run_timed(
    s: SessionState, ctx: BatchContext, timed: TimedStep, step: RecordedStep, binds: Any
) -> None:
    """Replay ``step`` on a device that times ops without computing them: its first replay
    call by call, noting the device time it queued; later ones by that time alone."""
    if timed.seconds is None:
        stream, backend = s.stream(timed.stream), s.backend
        queued = backend.stream_time(stream)
        _run(s, ctx, step, binds)
        timed.seconds = backend.stream_time(stream) - queued
        return
    try:
        timed.replay(s, step, binds)
    except Exception as exc:
        what = f"step {step.handle}"
        raise ReplayFailed(what, CallFailed(f"{what}: {exc}")) from None


def _run_graph(s: SessionState, ctx: BatchContext, graph: StepGraph, binds: Any) -> None:
    """Replay ``graph``'s step as one graph (``ReplayFailed`` names the call that failed)."""
    step = graph.step
    n = len(step.calls)
    try:
        stream = s.stream(next(c.stream for c in step.calls if c.spec.name == "aten"))
        replay_graph(s, aten_session(s), graph, binds, stream)
    except GraphCallError as exc:
        what = step.calls[exc.index].what if exc.index >= 0 else f"step {step.handle}"
        where = f"call {exc.index} of {n}" if exc.index >= 0 else "run as one graph"
        name = f" ({step.calls[exc.index].args[0]})" if exc.index >= 0 else ""
        raise ReplayFailed(what, CallFailed(f"step {step.handle}, {where}{name}: {exc}")) from None
    except Exception as exc:
        raise ReplayFailed(
            f"step {step.handle}", CallFailed(f"step {step.handle} (as one graph): {exc}")
        ) from None


def _run(s: SessionState, ctx: BatchContext, step: RecordedStep, binds: Any) -> None:
    """Run ``step``'s calls with one replay's ``binds`` (``ReplayFailed`` names the call
    that failed; what came before it ran)."""
    buffers, streams, resolve, backend = s.buffers, s.streams, s.resolve, s.backend
    # a device that queues work takes consecutive launches on a stream in one submission
    queued: list[Any] | None = [] if backend.queues_work else None
    on: Any = None  # the stream of the queued launches

    def submit() -> None:
        if queued:
            runs = queued.copy()
            queued.clear()  # taken: never run twice
            backend.run_ops(runs, on)

    for i, call in enumerate(step.calls):
        try:
            stream = streams.get(call.stream)
            if stream is None:
                raise CallFailed(f"unknown stream handle {call.stream}")
            for h in call.creates:
                b = binds.get(h)
                if b is not None:  # a result: made under this replay's handle
                    s.alloc(b[0], step.nbytes[h])
                elif h not in buffers:  # an intermediate: kept, or made by each replay
                    s.alloc(h, step.nbytes[h])
            cargs = rebind(call, binds) if call.rebind else call.args
            if call.op is None:
                submit()  # in order with what came before
                if not call.creates:  # an alloc is done: it made its buffer above
                    ctx.stream = stream
                    _WORK[call.spec.name](s, ctx, *cargs)
                continue
            ins = [resolve(d) for d in cargs[1]]
            outs = [resolve(d) for d in cargs[2]]
            if queued is None:
                ctx.computing(backend)
                backend.run_op(call.op, ins, outs, cargs[3], stream)
                continue
            if stream is not on:
                submit()
                on = stream
            queued.append((call.op, ins, outs, cargs[3]))
        except Exception as exc:
            with contextlib.suppress(Exception):
                submit()  # what came before it runs
            raise ReplayFailed(
                call.what,
                CallFailed(
                    f"step {step.handle}, call {i} of {len(step.calls)} ({call.spec.name}): {exc}"
                ),
            ) from None
    submit()


HANDLERS: dict[str, Handler] = {
    "step_record": step_record,
    "step_replay": step_replay,
    "step_run": step_run,
    "step_free": step_free,
}
