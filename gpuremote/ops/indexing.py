"""The standard's indexing functions (``take``, ``take_along_axis``) and the array object's
indexing (``getitem`` of basic, integer-array and boolean-mask indices; ``setitem``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._base import (
    Meta,
    Op,
    OpError,
    OpList,
    OpTypeError,
    Params,
    Shape,
    broadcast,
    one_axis,
    scalar_dtype,
)

__all__ = ["OPS", "decode_index", "index_shape"]

OPS = OpList()


def _take_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), (ishape, idt) = ins
    if idt.kind not in "iu" or len(ishape) != 1:
        raise OpTypeError("take needs 1-D integer indices")
    axis = params.get("axis")
    if axis is None:
        if len(shape) != 1:
            raise OpError("take needs an axis for arrays of more than one dimension")
        axis = 0
    ax = one_axis("take", axis, len(shape))
    return [(tuple(ishape[0] if i == ax else d for i, d in enumerate(shape)), dt)]


OPS.add(
    "take",
    (2, 2),
    _take_meta,
    lambda ns, ins, p: ns.take(ins[0], ins[1], axis=0 if p.get("axis") is None else p["axis"]),
    ("axis",),
)


def _take_along_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), (ishape, idt) = ins
    if idt.kind not in "iu" or len(ishape) != len(shape) or not shape:
        raise OpTypeError("take_along_axis needs integer indices of the array's rank")
    ax = one_axis("take_along_axis", params.get("axis", -1), len(shape))
    other = broadcast(
        [
            tuple(1 if i == ax else d for i, d in enumerate(shape)),
            tuple(1 if i == ax else d for i, d in enumerate(ishape)),
        ]
    )
    return [(tuple(ishape[ax] if i == ax else d for i, d in enumerate(other)), dt)]


OPS.add(
    "take_along_axis",
    (2, 2),
    _take_along_meta,
    lambda ns, ins, p: ns.take_along_axis(ins[0], ins[1], axis=p.get("axis", -1)),
    ("axis",),
)


def _mask_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, _), (mshape, mdt) = ins
    if mdt.kind != "b" or shape[: len(mshape)] != mshape:
        raise OpError(f"a boolean index of shape {mshape} does not fit an array of {shape}")
    return []


OPS.add(
    "getitem_mask",
    (2, 2),
    _mask_meta,
    lambda ns, ins, p: ins[0][ins[1]],
    dynamic=True,
)


_INT, _SLICE, _NEWAXIS = 0, 1, 2


def decode_index(flat: Sequence[int]) -> tuple[Any, ...]:
    """The index tuple of ``flat`` (groups of four ints: kind, then int / slice start, count
    and step, as ``index_shape`` checked)."""
    key: list[Any] = []
    for i in range(0, len(flat), 4):
        kind, a, b, c = flat[i : i + 4]
        if kind == _INT:
            key.append(a)
        elif kind == _SLICE:
            stop = a + b * c
            key.append(slice(a, None if stop < 0 else stop, c))
        else:
            key.append(None)
    return tuple(key)


def index_shape(shape: Shape, flat: Any) -> Shape:
    """The shape that basic index ``flat`` selects from ``shape`` (checked)."""
    if type(flat) is not list or len(flat) % 4:
        raise OpError("index must be a list of groups of four ints")
    out: list[int] = []
    dim = 0
    for i in range(0, len(flat), 4):
        kind, a, b, c = flat[i : i + 4]
        if kind == _NEWAXIS:
            out.append(1)
            continue
        if dim >= len(shape):
            raise OpError(f"too many indices for an array of {len(shape)} dimensions")
        n = shape[dim]
        if kind == _INT:
            if not 0 <= a < n:
                raise OpError(f"index {a} is out of bounds for a dimension of {n}")
        elif kind == _SLICE:
            if c == 0 or b < 0 or (b and not (0 <= a < n and 0 <= a + (b - 1) * c < n)):
                raise OpError("slice out of bounds")
            out.append(b)
        else:
            raise OpError(f"unknown index kind {kind}")
        dim += 1
    return (*out, *shape[dim:])


def _getitem_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    return [(index_shape(shape, params.get("index")), dt)]


OPS.add(
    "getitem",
    (1, 1),
    _getitem_meta,
    lambda ns, ins, p: ins[0][decode_index(p["index"])],
    ("index",),
)


def _getitem_int_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), (ishape, idt) = ins
    if idt.kind not in "iu" or not shape:
        raise OpTypeError("an integer array index needs integer indices into a non-0-d array")
    return [((*ishape, *shape[1:]), dt)]


OPS.add("getitem_int", (2, 2), _getitem_int_meta, lambda ns, ins, p: ins[0][ins[1]])


def _arrays_key(params: Params, nidx: int, shape: Shape) -> tuple[list[int], list[int]]:
    """The ``ints`` (one per indexed axis) and ``arrays_at`` (the axes indexed by an array)
    params of ``getitem_arrays``, checked."""
    ints, at = params.get("ints"), params.get("arrays_at")
    if type(ints) is not list or type(at) is not list or not ints or len(ints) > len(shape):
        raise OpError("getitem_arrays needs ints (one per indexed axis) and arrays_at")
    if sorted(set(at)) != at or len(at) != nidx or any(not 0 <= a < len(ints) for a in at):
        raise OpError("getitem_arrays: arrays_at must be the sorted axes of the index arrays")
    for axis, i in enumerate(ints):
        if axis not in at and not -shape[axis] <= i < shape[axis]:
            raise OpError(f"index {i} is out of bounds for a dimension of {shape[axis]}")
    return ints, at


def _getitem_arrays_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), *idx = ins
    ints, _ = _arrays_key(params, len(idx), shape)
    for _, d in idx:
        if d.kind not in "iu":
            raise OpTypeError(f"an integer array index needs integer indices, got {d}")
    return [((*broadcast([s for s, _ in idx]), *shape[len(ints) :]), dt)]


def _getitem_arrays_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    x, *idx = ins
    ints, at = params["ints"], params["arrays_at"]
    arrays = iter(idx)
    key = tuple(next(arrays) if axis in at else i for axis, i in enumerate(ints))
    return x[key]


# integers and integer arrays, one per leading axis (the standard's integer array indexing):
# the ints act as 0-d arrays, broadcast with the arrays
OPS.add(
    "getitem_arrays",
    (2, 33),
    _getitem_arrays_meta,
    _getitem_arrays_call,
    ("ints", "arrays_at"),
)


def _setitem_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), *rest = ins
    if params.get("mask"):
        if not rest:
            raise OpError("setitem with a mask needs the mask")
        (mshape, mdt), *rest = rest
        if mdt.kind != "b" or shape[: len(mshape)] != mshape:
            raise OpError(f"a boolean index of shape {mshape} does not fit an array of {shape}")
        selected: Shape | None = None
    else:
        selected = index_shape(shape, params.get("index"))
    if rest:
        ((vshape, vdt),) = rest
        if (vdt.kind == "c" and dt.kind != "c") or (vdt.kind == "f" and dt.kind in "biu"):
            raise OpTypeError(f"cannot assign {vdt} values into an array of {dt}")
        if selected is not None and broadcast([vshape, selected]) != selected:
            raise OpError(f"cannot assign shape {vshape} into a selection of {selected}")
    elif "scalar" in params:
        scalar_dtype(dt, params["scalar"])
    else:
        raise OpError("setitem needs a value")
    return [(shape, dt)]


def _setitem_run(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    out = outs[0]
    rest = list(ins[1:])
    key: Any = rest.pop(0) if params.get("mask") else decode_index(params["index"])
    value = rest[0] if rest else params["scalar"]
    out[key] = value


OPS.append(
    Op(
        "setitem",
        (1, 3),
        _setitem_meta,
        _setitem_run,
        ("index", "mask", "scalar"),
        "array API __setitem__ (in place)",
    )
)
