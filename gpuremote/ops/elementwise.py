"""The standard's element-wise functions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._base import (
    BOOL,
    Meta,
    OpError,
    OpList,
    Params,
    Shape,
    broadcast,
    check,
    namespace,
    promote,
    real_of,
    scalar_dtype,
    write,
)

__all__ = ["BINARY", "FAST", "OPS", "UNARY", "binary_inputs"]

OPS = OpList()

UNARY: dict[str, tuple[str, str]] = {
    # name: (category, result) with result "same", "bool" or "real"
    "abs": ("numeric", "real"),
    "acos": ("floating-point", "same"),
    "acosh": ("floating-point", "same"),
    "asin": ("floating-point", "same"),
    "asinh": ("floating-point", "same"),
    "atan": ("floating-point", "same"),
    "atanh": ("floating-point", "same"),
    "bitwise_invert": ("integer or boolean", "same"),
    "ceil": ("real numeric", "same"),
    "conj": ("numeric", "same"),
    "cos": ("floating-point", "same"),
    "cosh": ("floating-point", "same"),
    "exp": ("floating-point", "same"),
    "expm1": ("floating-point", "same"),
    "floor": ("real numeric", "same"),
    "imag": ("complex floating-point", "real"),
    "isfinite": ("numeric", "bool"),
    "isinf": ("numeric", "bool"),
    "isnan": ("numeric", "bool"),
    "log": ("floating-point", "same"),
    "log1p": ("floating-point", "same"),
    "log2": ("floating-point", "same"),
    "log10": ("floating-point", "same"),
    "logical_not": ("boolean", "same"),
    "negative": ("numeric", "same"),
    "positive": ("numeric", "same"),
    "real": ("numeric", "real"),
    "reciprocal": ("floating-point", "same"),
    "round": ("numeric", "same"),
    "sign": ("numeric", "same"),
    "signbit": ("real floating-point", "bool"),
    "sin": ("floating-point", "same"),
    "sinh": ("floating-point", "same"),
    "square": ("numeric", "same"),
    "sqrt": ("floating-point", "same"),
    "tan": ("floating-point", "same"),
    "tanh": ("floating-point", "same"),
    "trunc": ("real numeric", "same"),
}

BINARY: dict[str, tuple[str, str]] = {
    "add": ("numeric", "same"),
    "atan2": ("real floating-point", "same"),
    "bitwise_and": ("integer or boolean", "same"),
    "bitwise_left_shift": ("integer", "same"),
    "bitwise_or": ("integer or boolean", "same"),
    "bitwise_right_shift": ("integer", "same"),
    "bitwise_xor": ("integer or boolean", "same"),
    "copysign": ("real floating-point", "same"),
    "divide": ("floating-point", "same"),
    "equal": ("all", "bool"),
    "floor_divide": ("real numeric", "same"),
    "greater": ("real numeric", "bool"),
    "greater_equal": ("real numeric", "bool"),
    "hypot": ("real floating-point", "same"),
    "less": ("real numeric", "bool"),
    "less_equal": ("real numeric", "bool"),
    "logaddexp": ("real floating-point", "same"),
    "logical_and": ("boolean", "same"),
    "logical_or": ("boolean", "same"),
    "logical_xor": ("boolean", "same"),
    "maximum": ("real numeric", "same"),
    "minimum": ("real numeric", "same"),
    "multiply": ("numeric", "same"),
    "nextafter": ("real floating-point", "same"),
    "not_equal": ("all", "bool"),
    "pow": ("numeric", "same"),
    "remainder": ("real numeric", "same"),
    "subtract": ("numeric", "same"),
}


#: the functions that NumPy and CuPy have as ufuncs of the same name and meaning: computed
#: straight into the output (no temporary, no copy) when the operands already have its dtype
FAST = frozenset(
    {
        "abs",
        "add",
        "cos",
        "cosh",
        "divide",
        "equal",
        "exp",
        "expm1",
        "greater",
        "greater_equal",
        "less",
        "less_equal",
        "log",
        "log1p",
        "log2",
        "log10",
        "logical_and",
        "logical_not",
        "logical_or",
        "logical_xor",
        "maximum",
        "minimum",
        "multiply",
        "negative",
        "not_equal",
        "positive",
        "sin",
        "sinh",
        "sqrt",
        "square",
        "subtract",
        "tan",
        "tanh",
    }
)


def _make_unary(name: str, category: str, result: str) -> None:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        check(name, dt, category)
        odt = BOOL if result == "bool" else real_of(dt) if result == "real" else dt
        return [(shape, odt)]

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        x = ins[0]
        if name in ("ceil", "floor", "trunc", "round") and x.dtype.kind in "iu":
            return x
        return getattr(ns, name)(x)

    run = None
    if name in FAST:

        def run(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
            x, out = ins[0], outs[0]
            if x.dtype == out.dtype or result == "bool":
                getattr(xp, name)(x, out=out)
            else:
                write(outs, call(namespace(xp), ins, params))

    OPS.add(name, (1, 1), meta, call, run=run)


def _binary_operands(
    name: str, ins: Sequence[Meta], params: Params, category: str
) -> tuple[Shape, np.dtype[Any]]:
    if len(ins) == 2:
        (s1, d1), (s2, d2) = ins
        check(name, d1, category)
        check(name, d2, category)
        return broadcast([s1, s2]), promote(d1, d2)
    if len(ins) != 1 or "scalar" not in params:
        raise OpError(f"{name} takes two arrays, or an array and the scalar param")
    ((shape, dt),) = ins
    check(name, dt, category)
    return shape, scalar_dtype(dt, params["scalar"])


def binary_inputs(xp: Any, ins: Sequence[Any], params: Params, dt: np.dtype[Any]) -> list[Any]:
    """The two operands of a binary function: two arrays, or an array and the ``scalar``
    param as a 0-d array of ``dt`` (first, with ``reverse``)."""
    if len(ins) == 2:
        return list(ins)
    s = xp.asarray(params["scalar"], dtype=dt)
    return [s, ins[0]] if params.get("reverse") else [ins[0], s]


def _make_binary(name: str, category: str, result: str) -> None:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        shape, dt = _binary_operands(name, ins, params, category)
        return [(shape, BOOL if result == "bool" else dt)]

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        if len(ins) == 2:
            return getattr(ns, name)(ins[0], ins[1])
        dt = scalar_dtype(ins[0].dtype, params["scalar"])
        a, b = binary_inputs(ns, ins, params, dt)
        if dt != ins[0].dtype:
            a, b = ns.astype(a, dt), ns.astype(b, dt)
        return getattr(ns, name)(a, b)

    run = None
    if name in FAST:

        def run(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
            out = outs[0]
            dt = ins[0].dtype
            if len(ins) == 2:
                if dt == ins[1].dtype and (result == "bool" or dt == out.dtype):
                    getattr(xp, name)(ins[0], ins[1], out=out)
                    return
            elif result == "bool" or dt == out.dtype:
                # the scalar as a NumPy scalar of the array's dtype: the backend computes in
                # that dtype (the standard's rule), whatever its own scalar promotion
                s = dt.type(params["scalar"])
                if params.get("reverse"):
                    getattr(xp, name)(s, ins[0], out=out)
                else:
                    getattr(xp, name)(ins[0], s, out=out)
                return
            write(outs, call(namespace(xp), ins, params))

    OPS.add(name, (1, 2), meta, call, ("scalar", "reverse"), run=run)


for _name, (_cat, _res) in UNARY.items():
    _make_unary(_name, _cat, _res)
for _name, (_cat, _res) in BINARY.items():
    _make_binary(_name, _cat, _res)


def _clip_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), *bounds = ins
    check("clip", dt, "real numeric")
    for s, d in bounds:
        check("clip", d, "real numeric")
        if broadcast([shape, s]) != shape:
            raise OpError(f"clip: bounds of shape {s} do not broadcast to {shape}")
    for key in ("min", "max"):
        if params.get(key) is not None:
            scalar_dtype(dt, params[key])
    if len(bounds) != int(params.get("n_min", 0)) + int(params.get("n_max", 0)):
        raise OpError("clip: n_min and n_max must count the array bounds")
    return [(shape, dt)]


def _clip_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    x, *bounds = ins
    lo = bounds.pop(0) if params.get("n_min") else params.get("min")
    hi = bounds.pop(0) if params.get("n_max") else params.get("max")
    return ns.clip(x, lo, hi)


OPS.add("clip", (1, 3), _clip_meta, _clip_call, ("min", "max", "n_min", "n_max"))
