"""The standard's statistical functions and the reductions of its searching and utility
functions (``argmax``, ``argmin``, ``count_nonzero``, ``all``, ``any``), which follow one rule;
``diff`` too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._base import (
    BOOL,
    INT64,
    Meta,
    OpError,
    OpList,
    OpTypeError,
    Params,
    Shape,
    check,
    dtype_param,
    namespace,
    norm_axes,
    one_axis,
    write,
)

__all__ = ["OPS", "REDUCTIONS", "reduced_shape", "sum_dtype"]

OPS = OpList()


def reduced_shape(name: str, shape: Shape, params: Params) -> Shape:
    axes = norm_axes(name, params.get("axis"), len(shape))
    if params.get("keepdims"):
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def sum_dtype(dt: np.dtype[Any], params: Params) -> np.dtype[Any]:
    explicit = dtype_param(params)
    if explicit is not None:
        return explicit
    if dt.kind == "b" or dt.kind == "i":
        return INT64
    if dt.kind == "u":
        return np.dtype(np.uint64)
    return dt


REDUCTIONS: dict[str, tuple[str, str]] = {
    # name: (category, result) with result "same", "sum", "bool" or "index"
    "max": ("real numeric", "same"),
    "min": ("real numeric", "same"),
    "mean": ("floating-point", "same"),
    "prod": ("numeric", "sum"),
    "sum": ("numeric", "sum"),
    "std": ("real floating-point", "same"),
    "var": ("real floating-point", "same"),
    "all": ("all", "bool"),
    "any": ("all", "bool"),
    "argmax": ("real numeric", "index"),
    "argmin": ("real numeric", "index"),
    "count_nonzero": ("all", "index"),
}


#: reductions that NumPy and CuPy compute with the standard's meaning straight into an output
#: of the result's dtype (no temporary, no copy)
_DIRECT = frozenset({"sum", "prod", "max", "min", "mean"})
#: NumPy's ufuncs behind those of them that are one ufunc's reduce (``np.sum`` is
#: ``np.add.reduce`` behind a Python wrapper of a few microseconds)
_UFUNC_OF: dict[str, np.ufunc] = {
    "sum": np.add,
    "prod": np.multiply,
    "max": np.maximum,
    "min": np.minimum,
}


def _make_reduction(name: str, category: str, result: str) -> None:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        check(name, dt, category)
        if name in ("argmax", "argmin") and params.get("axis") is not None:
            one_axis(name, params["axis"], len(shape))
        out_shape = reduced_shape(name, shape, params)
        if name in ("max", "min", "argmax", "argmin"):
            axes = norm_axes(name, params.get("axis"), len(shape))
            if any(shape[a] == 0 for a in axes) or (not axes and math.prod(shape) == 0):
                raise OpError(f"{name} of an empty array")
        if "correction" in params and type(params["correction"]) not in (int, float):
            raise OpError(f"{name}: correction must be a number")
        odt = {
            "same": dt,
            "sum": sum_dtype(dt, params),
            "bool": BOOL,
            "index": INT64,
        }[result]
        return [(out_shape, odt)]

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        kw: dict[str, Any] = {"keepdims": bool(params.get("keepdims", False))}
        axis = params.get("axis")
        kw["axis"] = tuple(axis) if type(axis) is list else axis
        if result == "sum":
            kw["dtype"] = sum_dtype(ins[0].dtype, params)
        if "correction" in params:
            kw["correction"] = params["correction"]
        return getattr(ns, name)(ins[0], **kw)

    run = None
    if name in _DIRECT:
        ufunc = _UFUNC_OF.get(name)

        def run(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
            x, out = ins[0], outs[0]
            if name in ("max", "min", "mean") and x.dtype != out.dtype:
                write(outs, call(namespace(xp), ins, params))
                return
            axis = params.get("axis")
            if type(axis) is list:
                axis = tuple(axis)
            keepdims = bool(params.get("keepdims", False))
            if ufunc is not None and xp is np:  # the reduce that np.sum etc. wrap, called as is
                ufunc.reduce(x, axis, out.dtype, out, keepdims=keepdims)
                return
            kw: dict[str, Any] = {"axis": axis, "keepdims": keepdims, "out": out}
            if result == "sum":
                kw["dtype"] = out.dtype
            getattr(xp, name)(x, **kw)

    OPS.add(name, (1, 1), meta, call, ("axis", "keepdims", "dtype", "correction"), run=run)


for _name, (_cat, _res) in REDUCTIONS.items():
    _make_reduction(_name, _cat, _res)


def _make_cumulative(name: str) -> None:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        check(name, dt, "numeric")
        axis = params.get("axis")
        if axis is None:
            if len(shape) > 1:
                raise OpError(f"{name} needs an axis for arrays of more than one dimension")
            axis = 0
        if not shape:
            raise OpError(f"{name} needs at least one dimension")
        ax = one_axis(name, axis, len(shape))
        extra = 1 if params.get("include_initial") else 0
        out = tuple(d + extra if i == ax else d for i, d in enumerate(shape))
        return [(out, sum_dtype(dt, params))]

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        x = ins[0]
        axis = params.get("axis")
        axis = 0 if axis is None else axis
        dt = sum_dtype(x.dtype, params)
        return getattr(ns, name)(
            x, axis=axis, dtype=dt, include_initial=bool(params.get("include_initial", False))
        )

    OPS.add(name, (1, 1), meta, call, ("axis", "dtype", "include_initial"))


_make_cumulative("cumulative_sum")
_make_cumulative("cumulative_prod")


def _diff_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), *extra = ins
    check("diff", dt, "numeric")
    if not shape:
        raise OpError("diff needs at least one dimension")
    ax = one_axis("diff", params.get("axis", -1), len(shape))
    n = params.get("n", 1)
    if type(n) is not int or n < 0:
        raise OpError("diff: n must be a non-negative int")
    length = shape[ax]
    for s, d in extra:
        if len(s) != len(shape) or any(
            a != b for i, (a, b) in enumerate(zip(s, shape, strict=True)) if i != ax
        ):
            raise OpError(f"diff: prepend/append of shape {s} does not fit {shape}")
        if d != dt:
            raise OpTypeError(f"diff: prepend/append must have dtype {dt}, got {d}")
        length += s[ax]
    if len(extra) != int(bool(params.get("has_prepend"))) + int(bool(params.get("has_append"))):
        raise OpError("diff: has_prepend/has_append must count the extra arrays")
    out = tuple(max(length - n, 0) if i == ax else d for i, d in enumerate(shape))
    return [(out, dt)]


def _diff_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    x, *extra = ins
    kw: dict[str, Any] = {"axis": params.get("axis", -1), "n": params.get("n", 1)}
    if params.get("has_prepend"):
        kw["prepend"] = extra.pop(0)
    if params.get("has_append"):
        kw["append"] = extra.pop(0)
    return ns.diff(x, **kw)


OPS.add("diff", (1, 3), _diff_meta, _diff_call, ("axis", "n", "has_prepend", "has_append"))
