"""The handlers of the PyTorch calls (``gpuremote.proxy.aten`` runs the ops)."""

from __future__ import annotations

import contextlib
from typing import Any

from ...wire.protocol import TensorDesc
from ..aten import AllowedOp, AtenSession, aten_session, resolve_op
from ..state import CALL_FAILURES, BatchContext, Handler, SessionState

__all__ = ["HANDLERS"]


def _written(
    allowed: AllowedOp, tensors: tuple[TensorDesc, ...], args: tuple[list[Any], dict[str, Any]]
) -> list[int]:
    """The buffers of the operands the op writes (its mutable arguments)."""
    positional, keywords = args
    handles = []
    for i, name in allowed.writes:
        value = positional[i] if i < len(positional) else keywords.get(name)
        for v in value if type(value) is list else [value]:
            if type(v) is dict and "t" in v and v["t"] < len(tensors):
                handles.append(tensors[v["t"]].handle)
    return handles


def aten(
    s: SessionState,
    ctx: BatchContext,
    op: str,
    tensors: tuple[TensorDesc, ...],
    args: tuple[list[Any], dict[str, Any]],
    outputs: tuple[TensorDesc, ...],
) -> None:
    a = aten_session(s)
    # each output becomes the tensor the op made, where its layout is the client's and the
    # backend keeps such memory; else a buffer allocated first, which the op's results fill
    keep = a.runtime.keeps_results
    if keep:
        a.check_outputs(outputs)
    else:
        for d in outputs:  # first: the client holds these handles whatever happens next
            s.alloc(d.handle, d.extent)
    try:
        allowed = resolve_op(op)
        buffers = s.buffers
        reads = [buffers[d.handle] for d in tensors if d.handle in buffers]
        writes = [buffers[h] for h in _written(allowed, tensors, args) if h in buffers]
        writes += [buffers[d.handle] for d in outputs if d.handle in buffers]

        def run() -> None:
            with a.isolated():
                _, _, made = a.call(op, tensors, args)
                (a.keep_outputs if keep else a.fill_outputs)(op, made, outputs)

        a.runtime.run(run, reads, writes, ctx.stream)  # in order on the stream
    except BaseException:
        for d in outputs:  # the client holds these handles whatever happened
            if d.handle not in s.buffers:
                with contextlib.suppress(*CALL_FAILURES):
                    s.alloc(d.handle, d.extent)
        raise
    _timed(s, ctx, a)


def _timed(s: SessionState, ctx: BatchContext, a: AtenSession) -> None:
    """A simulated GPU takes the op's time (``SessionState.backend.profile``)."""
    if a.work is not None:
        a.runtime.work(ctx.stream, *a.work)
        a.work = None


def aten_dynamic(
    s: SessionState,
    ctx: BatchContext,
    op: str,
    tensors: tuple[TensorDesc, ...],
    args: tuple[list[Any], dict[str, Any]],
    outputs: tuple[int, ...],
) -> Any:
    a = aten_session(s)
    allowed = resolve_op(op)
    buffers = s.buffers
    reads = [buffers[d.handle] for d in tensors if d.handle in buffers]
    writes = [buffers[h] for h in _written(allowed, tensors, args) if h in buffers]

    def run() -> Any:
        with a.isolated():
            _, result, made = a.call(op, tensors, args)
            return a.encode_result(allowed, result, a.adopt_results(op, made, outputs))

    answer = a.runtime.run(run, reads, writes, ctx.stream, wait=True)
    _timed(s, ctx, a)
    return answer


def aten_shapes(
    s: SessionState,
    ctx: BatchContext,
    op: str,
    tensors: tuple[TensorDesc, ...],
    args: tuple[list[Any], dict[str, Any]],
) -> Any:
    a = aten_session(s)
    buffers = s.buffers
    reads = [buffers[d.handle] for d in tensors if d.handle in buffers]

    def run() -> Any:
        with a.isolated():
            return a.shapes(op, tensors, args)

    return a.runtime.run(run, reads, [], ctx.stream, wait=True)


def aten_seed(s: SessionState, ctx: BatchContext, seed: int) -> None:
    aten_session(s).rng.seed(seed)


def aten_rng_get(s: SessionState, ctx: BatchContext) -> str:
    return aten_session(s).rng.state()


def aten_rng_set(s: SessionState, ctx: BatchContext, state: str) -> None:
    aten_session(s).rng.set_state(state)


HANDLERS: dict[str, Handler] = {
    "aten": aten,
    "aten_dynamic": aten_dynamic,
    "aten_shapes": aten_shapes,
    "aten_seed": aten_seed,
    "aten_rng_get": aten_rng_get,
    "aten_rng_set": aten_rng_set,
}
