"""The handlers of the PyTorch calls (``gpuremote.proxy.aten`` runs the ops)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from ...wire.protocol import TensorDesc
from ..aten import AllowedOp, AtenSession, aten_session, resolve_op
from ..state import (
    CALL_FAILURES,
    BatchContext,
    CallFailed,
    Handler,
    ReplayFailed,
    SessionState,
    UnknownHandle,
)
from ..templates import AtenTemplate, Refused

__all__ = ["HANDLERS", "template_outputs"]


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
        a.last_work, a.work = a.work, None


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


def aten_template(
    s: SessionState,
    ctx: BatchContext,
    handle: int,
    op: str,
    operands: tuple[TensorDesc, ...],
    args: tuple[list[Any], dict[str, Any]],
    outputs: tuple[TensorDesc, ...],
) -> None:
    a = aten_session(s)
    templates = a.templates
    try:
        if handle in templates:
            raise CallFailed(f"template handle {handle} is already in use")
        if len(templates) >= s.limits.max_templates:
            raise CallFailed(
                f"this session keeps {len(templates)} ATen templates; the limit is "
                f"{s.limits.max_templates}"
            )
        tensors = a.template_tensors + len(operands) + len(outputs)
        if tensors > s.limits.max_template_tensors:
            raise CallFailed(
                f"this session's ATen templates would hold {tensors} tensors; the limit is "
                f"{s.limits.max_template_tensors}"
            )
    except Exception as exc:
        raise ReplayFailed(op, exc) from None  # (its error names the op)
    a.template_tensors = tensors
    try:
        templates[handle] = AtenTemplate(a, op, operands, args, outputs)
    except Exception as exc:
        # each call of it fails as this did (as each ``aten`` call of it would)
        templates[handle] = Refused(op, exc, outputs)
        raise ReplayFailed(op, exc) from None


def aten_call(
    s: SessionState,
    ctx: BatchContext,
    handle: int,
    places: tuple[int, ...],
    outputs: tuple[int, ...],
    floats: tuple[float, ...],
) -> None:
    a = s.aten  # (made by the template's ``aten_template`` call, where there was one)
    if type(a) is not AtenSession:
        a = aten_session(s)
    template = _template(a, handle)
    try:
        if a.by_template:
            template.run(a, s, ctx, places, outputs, floats)
        elif template.work is not None:  # (timed on shapes alone, its work known)
            template.run_timed(a, s, ctx, places, outputs, floats)
        else:  # a device that times its ops or does not compute: the call it stands for
            try:
                operands, encoded, made = template.plain(places, outputs, floats)
            except BaseException:
                template.alloc_missing(s, outputs)
                raise
            a.last_work = None
            aten(s, ctx, template.name, operands, encoded, made)
            if a.shapes_only and isinstance(template, AtenTemplate):
                template.work = a.last_work  # (its shapes, so its work, are the same each call)
    except Exception as exc:
        raise ReplayFailed(template.name, exc) from None


def _template(a: AtenSession, handle: int) -> AtenTemplate | Refused:
    template: AtenTemplate | Refused | None = a.templates.get(handle)
    if template is None:
        raise UnknownHandle(f"unknown ATen template handle {handle}")
    return template


def template_outputs(s: SessionState, handle: int, outputs: Sequence[int]) -> None:
    """What a skipped ``aten_call`` would have made, made (empty)."""
    if isinstance(s.aten, AtenSession) and handle in s.aten.templates:
        s.aten.templates[handle].alloc_missing(s, outputs)


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
    "aten_template": aten_template,
    "aten_call": aten_call,
    "aten_seed": aten_seed,
    "aten_rng_get": aten_rng_get,
    "aten_rng_set": aten_rng_set,
}
