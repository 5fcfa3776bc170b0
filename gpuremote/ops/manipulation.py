"""The standard's manipulation functions."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ._base import (
    Meta,
    OpError,
    OpList,
    OpTypeError,
    Params,
    axis_arg,
    broadcast,
    norm_axes,
    one_axis,
    promote,
    shape_param,
)

__all__ = ["OPS"]

OPS = OpList()


def _broadcast_to_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    target = shape_param(params)
    if broadcast([shape, target]) != target:
        raise OpError(f"cannot broadcast shape {shape} to {target}")
    return [(target, dt)]


OPS.add(
    "broadcast_to",
    (1, 1),
    _broadcast_to_meta,
    lambda ns, ins, p: ns.broadcast_to(ins[0], tuple(p["shape"])),
    ("shape",),
)


def _concat_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    dt = promote(*(d for _, d in ins))
    axis = params.get("axis", 0)
    if axis is None:
        return [((sum(math.prod(s) for s, _ in ins),), dt)]
    first = ins[0][0]
    if not first:
        raise OpError("concat does not take 0-d arrays")
    ax = one_axis("concat", axis, len(first))
    total = 0
    for s, _ in ins:
        if len(s) != len(first) or any(
            a != b for i, (a, b) in enumerate(zip(s, first, strict=True)) if i != ax
        ):
            raise OpError(f"concat: shapes {first} and {s} differ off axis {axis}")
        total += s[ax]
    return [(tuple(total if i == ax else d for i, d in enumerate(first)), dt)]


def _concat_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    dt = promote(*(x.dtype for x in ins))
    return ns.concat([ns.astype(x, dt) for x in ins], axis=params.get("axis", 0))


OPS.add("concat", (1, 64), _concat_meta, _concat_call, ("axis",))


def _stack_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    dt = promote(*(d for _, d in ins))
    first = ins[0][0]
    if any(s != first for s, _ in ins):
        raise OpError("stack needs arrays of one shape")
    ax = one_axis("stack", params.get("axis", 0), len(first) + 1)
    return [((*first[:ax], len(ins), *first[ax:]), dt)]


def _stack_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    dt = promote(*(x.dtype for x in ins))
    return ns.stack([ns.astype(x, dt) for x in ins], axis=params.get("axis", 0))


OPS.add("stack", (1, 64), _stack_meta, _stack_call, ("axis",))


def _expand_dims_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    ax = one_axis("expand_dims", params.get("axis", 0), len(shape) + 1)
    return [((*shape[:ax], 1, *shape[ax:]), dt)]


OPS.add(
    "expand_dims",
    (1, 1),
    _expand_dims_meta,
    lambda ns, ins, p: ns.expand_dims(ins[0], axis=p.get("axis", 0)),
    ("axis",),
)


def _same_meta_axes(name: str) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        norm_axes(name, params.get("axis"), len(shape))
        return [(shape, dt)]

    return meta


OPS.add(
    "flip",
    (1, 1),
    _same_meta_axes("flip"),
    lambda ns, ins, p: ns.flip(ins[0], axis=axis_arg(p)),
    ("axis",),
)


def _roll_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    shift, axis = params.get("shift"), params.get("axis")
    if axis is None:
        if type(shift) is not int:
            raise OpError("roll: shift must be an int when axis is None")
    else:
        axes = norm_axes("roll", axis, len(shape), unique=False)
        shifts = [shift] if type(shift) is int else shift
        if type(shifts) is not list or len(shifts) not in (1, len(axes)):
            raise OpError("roll: shift and axis must have one length")
    return [(shape, dt)]


def _roll_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    shift = params["shift"]
    return ns.roll(ins[0], tuple(shift) if type(shift) is list else shift, axis=axis_arg(params))


OPS.add("roll", (1, 1), _roll_meta, _roll_call, ("shift", "axis"))


def _moveaxis_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    src = norm_axes("moveaxis", params.get("source"), len(shape), allow_none=False)
    dst = norm_axes("moveaxis", params.get("destination"), len(shape), allow_none=False)
    if len(src) != len(dst):
        raise OpError("moveaxis: source and destination must have one length")
    order = [i for i in range(len(shape)) if i not in src]
    for d, s in sorted(zip(dst, src, strict=True)):
        order.insert(d, s)
    return [(tuple(shape[i] for i in order), dt)]


OPS.add(
    "moveaxis",
    (1, 1),
    _moveaxis_meta,
    lambda ns, ins, p: ns.moveaxis(ins[0], axis_arg(p, "source"), axis_arg(p, "destination")),
    ("source", "destination"),
)


def _permute_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    axes = params.get("axes")
    if type(axes) is not list or sorted(a % max(len(shape), 1) for a in axes) != list(
        range(len(shape))
    ):
        raise OpError(f"permute_dims: axes {axes} are not a permutation of {len(shape)} dimensions")
    return [(tuple(shape[a] for a in axes), dt)]


OPS.add(
    "permute_dims",
    (1, 1),
    _permute_meta,
    lambda ns, ins, p: ns.permute_dims(ins[0], tuple(p["axes"])),
    ("axes",),
)


def _squeeze_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    axes = norm_axes("squeeze", params.get("axis"), len(shape), allow_none=False)
    for a in axes:
        if shape[a] != 1:
            raise OpError(f"squeeze: dimension {a} of {shape} is not 1")
    return [(tuple(d for i, d in enumerate(shape) if i not in axes), dt)]


OPS.add(
    "squeeze",
    (1, 1),
    _squeeze_meta,
    lambda ns, ins, p: ns.squeeze(ins[0], axis=axis_arg(p)),
    ("axis",),
)


def _tile_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    reps = shape_param(params, "repetitions")
    n = max(len(shape), len(reps))
    s = (1,) * (n - len(shape)) + shape
    r = (1,) * (n - len(reps)) + reps
    return [(tuple(a * b for a, b in zip(s, r, strict=True)), dt)]


OPS.add(
    "tile",
    (1, 1),
    _tile_meta,
    lambda ns, ins, p: ns.tile(ins[0], tuple(p["repetitions"])),
    ("repetitions",),
)


def _repeat_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    reps, axis = params.get("repeats"), params.get("axis")
    if type(reps) is not int or reps < 0:
        raise OpError("repeat: repeats must be a non-negative int (arrays go to repeat_array)")
    if axis is None:
        return [((math.prod(shape) * reps,), dt)]
    ax = one_axis("repeat", axis, len(shape))
    return [(tuple(d * reps if i == ax else d for i, d in enumerate(shape)), dt)]


OPS.add(
    "repeat",
    (1, 1),
    _repeat_meta,
    lambda ns, ins, p: ns.repeat(ins[0], p["repeats"], axis=p.get("axis")),
    ("repeats", "axis"),
)


def _unstack_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    if not shape:
        raise OpError("unstack needs at least one dimension")
    ax = one_axis("unstack", params.get("axis", 0), len(shape))
    if shape[ax] > 64:
        raise OpError("unstack of more than 64 arrays; slice instead")
    return [(shape[:ax] + shape[ax + 1 :], dt)] * shape[ax]


OPS.add(
    "unstack",
    (1, 1),
    _unstack_meta,
    lambda ns, ins, p: tuple(ns.unstack(ins[0], axis=p.get("axis", 0))),
    ("axis",),
)


def _repeat_array_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, _), (rshape, rdt) = ins
    if rdt.kind not in "iu" or len(rshape) != 1:
        raise OpTypeError("repeat: repeats must be a 1-D integer array")
    if params.get("axis") is not None:
        one_axis("repeat", params["axis"], len(shape))
    return []


OPS.add(
    "repeat_array",
    (2, 2),
    _repeat_array_meta,
    lambda ns, ins, p: ns.repeat(ins[0], ins[1], axis=p.get("axis")),
    ("axis",),
    dynamic=True,
)
