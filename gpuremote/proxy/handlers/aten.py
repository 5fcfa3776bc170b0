"""The handlers of the PyTorch calls (``gpuremote.proxy.aten`` runs the ops)."""

from __future__ import annotations

from typing import Any

from ...wire.protocol import TensorDesc
from ..aten import AllowedOp, aten_session, resolve_op
from ..state import BatchContext, Handler, SessionState

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
    keep = s.backend.keeps_torch_results
    if keep:  # each output becomes the tensor the op made, where its layout is the client's
        a = aten_session(s)
        a.check_outputs(outputs)
        try:
            allowed = resolve_op(op)
            _, _, made = a.call(op, tensors, args)
        except BaseException:
            for d in outputs:  # the client holds these handles whatever happened
                s.alloc(d.handle, d.extent)
            raise
        a.keep_outputs(op, made, outputs)
        return
    for d in outputs:  # first: the client holds these handles whatever happens next
        s.alloc(d.handle, d.extent)
    a = aten_session(s)
    allowed = resolve_op(op)
    buffers = s.buffers
    reads = [buffers[d.handle] for d in tensors if d.handle in buffers]
    writes = [buffers[h] for h in _written(allowed, tensors, args) if h in buffers]
    writes += [buffers[d.handle] for d in outputs]

    def run() -> None:
        _, _, made = a.call(op, tensors, args)
        a.fill_outputs(op, made, outputs)

    s.backend.run_torch(run, reads, writes, ctx.stream)


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
        _, result, made = a.call(op, tensors, args)
        return a.encode_result(allowed, result, a.adopt_results(op, made, outputs))

    return s.backend.run_torch(run, reads, writes, ctx.stream, wait=True)


def aten_seed(s: SessionState, ctx: BatchContext, seed: int) -> None:
    aten_session(s).seed(seed)


def aten_rng_get(s: SessionState, ctx: BatchContext) -> str:
    return aten_session(s).rng_state()


def aten_rng_set(s: SessionState, ctx: BatchContext, state: str) -> None:
    aten_session(s).set_rng_state(state)


HANDLERS: dict[str, Handler] = {
    "aten": aten,
    "aten_dynamic": aten_dynamic,
    "aten_seed": aten_seed,
    "aten_rng_get": aten_rng_get,
    "aten_rng_set": aten_rng_set,
}
