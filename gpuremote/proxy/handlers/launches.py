"""The handlers of the calls that run work: launches of allow-listed ops (into existing
outputs, into new ones, with data-dependent outputs) and user kernels."""

from __future__ import annotations

from typing import Any

from ...errors import UnknownHandle
from ...ops import OPS, infer
from ...wire.protocol import ArrayDesc
from ..state import BatchContext, CallFailed, Handler, SessionState

__all__ = ["HANDLERS", "check_launch"]


def check_launch(
    op_name: str,
    inputs: tuple[ArrayDesc, ...],
    outputs: tuple[ArrayDesc, ...],
    params: dict[str, Any],
) -> Any:
    """The op of a launch whose outputs are what the op writes for these inputs."""
    op = OPS.get(op_name)
    if op is None:
        raise CallFailed(f"unknown op {op_name!r}; the proxy allows {len(OPS)} ops")
    metas = infer(op_name, [(d.shape, d.dtype) for d in inputs], params)
    if len(metas) != len(outputs) or any(
        m != (o.shape, o.dtype) for m, o in zip(metas, outputs, strict=False)
    ):
        got = [(o.shape, str(o.dtype)) for o in outputs]
        want = [(s, str(d)) for s, d in metas]
        raise CallFailed(f"{op_name} writes outputs {want}, the call gave {got}")
    return op


def _checked_op(
    s: SessionState,
    op_name: str,
    inputs: tuple[ArrayDesc, ...],
    outputs: tuple[ArrayDesc, ...],
    params: dict[str, Any],
) -> Any:
    """``check_launch``, once per signature (per session, bounded): the op's checks depend
    on shapes, dtypes and params only."""
    checked = s.checked_launches
    try:
        # (op, shape, dtype of each input, None, of each output, then each param's name,
        # value and exact type: 1 is not True), built in place: cheaper than unpacking
        parts: list[Any] = [op_name]
        for d in inputs:
            parts += (d[2], d[3])
        parts += (None,)
        for d in outputs:
            parts += (d[2], d[3])
        for k, v in params.items():
            parts += (k, v, type(v))
        key: Any = tuple(parts)
        op = checked.get(key)
    except TypeError:  # list-valued params are not hashable: check every time
        key, op = None, None
    if op is None:
        op = check_launch(op_name, inputs, outputs, params)
        if key is not None:
            if len(checked) >= 4096:
                checked.clear()
            checked[key] = op
    return op


def launch(
    s: SessionState,
    ctx: BatchContext,
    op_name: str,
    inputs: tuple[ArrayDesc, ...],
    outputs: tuple[ArrayDesc, ...],
    params: dict[str, Any],
) -> None:
    op = _checked_op(s, op_name, inputs, outputs, params)
    _run(s, ctx, op, inputs, [s.resolve(d) for d in outputs], params)


def launch_new(
    s: SessionState,
    ctx: BatchContext,
    op_name: str,
    inputs: tuple[ArrayDesc, ...],
    outputs: tuple[ArrayDesc, ...],
    params: dict[str, Any],
) -> None:
    outs = s.alloc_outputs(outputs)  # (made even if the launch then fails: the client frees)
    _run(s, ctx, _checked_op(s, op_name, inputs, outputs, params), inputs, outs, params)


def _run(
    s: SessionState,
    ctx: BatchContext,
    op: Any,
    inputs: tuple[ArrayDesc, ...],
    outs: list[Any],
    params: dict[str, Any],
) -> None:
    """Run checked ``op`` on ``inputs`` into the views ``outs``."""
    resolve = s.resolve
    ins = [resolve(d) for d in inputs]
    if ctx.batch is None:
        ctx.computing(s.backend)
    s.backend.run_op(op, ins, outs, params, ctx.stream)


def launch_dynamic(
    s: SessionState,
    ctx: BatchContext,
    op_name: str,
    inputs: tuple[ArrayDesc, ...],
    outputs: tuple[int, ...],
    params: dict[str, Any],
) -> Any:
    op = OPS.get(op_name)
    if op is None or op.dynamic is None:
        raise CallFailed(f"{op_name!r} is not an op with data-dependent outputs")
    infer(op_name, [(d.shape, d.dtype) for d in inputs], params)  # checks the inputs
    for h in outputs:
        s.check_new(s.buffers, h, "buffer")
    if len(set(outputs)) != len(outputs):
        raise CallFailed("launch_dynamic output handles must differ")
    ins = [s.resolve(d) for d in inputs]
    budget = s.limits.max_device_bytes - s.device_bytes
    results = s.backend.run_dynamic(op, ins, params, ctx.stream, budget)
    if len(results) != len(outputs):
        raise CallFailed(f"{op_name} gives {len(results)} outputs, the call named {len(outputs)}")
    total = sum(int(r.nbytes) for r in results)
    if s.device_bytes + total > s.limits.max_device_bytes:
        raise CallFailed(
            f"{op_name}'s outputs of {total} bytes would make this session hold "
            f"{s.device_bytes + total} bytes; its limit is {s.limits.max_device_bytes}"
        )
    metas: list[list[Any]] = []
    for h, r in zip(outputs, results, strict=True):
        flat = s.backend.as_buffer(r)
        s.adopt(h, flat, int(flat.nbytes))
        metas.append([list(r.shape), r.dtype.name])
    return metas


def kernel_create(
    s: SessionState,
    ctx: BatchContext,
    handle: int,
    kind: str,
    name: str,
    source: str,
    params: dict[str, Any],
) -> None:
    if handle in s.kernels:
        return  # content-addressed: the same kernel again
    s.check_new(s.kernels, handle, "kernel")
    s.kernels[handle] = s.backend.compile_kernel(kind, name, source, params)


def kernel_launch(
    s: SessionState,
    ctx: BatchContext,
    handle: int,
    args: tuple[Any, ...],
    grid: tuple[int, ...],
    block: tuple[int, ...],
) -> None:
    kernel = s.kernels.get(handle)
    if kernel is None:
        raise UnknownHandle(f"unknown kernel handle {handle:#x}")
    values = [s.resolve(a[1]) if a[0] == "a" else a[1].type(a[2]) for a in args]
    ctx.computing(s.backend)
    s.backend.launch_kernel(kernel, values, grid, block, ctx.stream)


HANDLERS: dict[str, Handler] = {
    "launch": launch,
    "launch_new": launch_new,
    "launch_dynamic": launch_dynamic,
    "kernel_create": kernel_create,
    "kernel_launch": kernel_launch,
}
