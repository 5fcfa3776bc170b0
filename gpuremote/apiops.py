"""The Python array API standard's functions as allow-listed ops, named ``xp.<function>``.

Each op's ``meta`` applies the standard's rules (dtype categories, type promotion,
broadcasting, output shapes) to shapes and dtypes only, so the client knows every result's
metadata without a round trip and raises the standard's ``TypeError``/``ValueError`` at once;
the proxy runs the same ``meta`` to check what a client sent. ``run`` calls the backend's
array API namespace (``array_api_compat.numpy`` or ``array_api_compat.cupy``) and writes the
result into the preallocated output, cast to the dtype ``meta`` gave, so that where a backend
differs from the standard the result's dtype still follows the standard.

Ops whose output shape depends on the data (``nonzero``, the ``unique_*`` family, boolean-mask
indexing, ``repeat`` by an array) have a ``dynamic`` function instead: the proxy computes the
result and keeps it under handles the client chose (the SYNC call ``launch_dynamic``).

Python scalars mixed with arrays travel as the ``scalar`` param (with ``reverse`` when the
scalar is the first operand) and take the array's dtype, as the standard says.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .ops import Meta, Op, OpError, Params, Shape, _broadcast, _register, matmul_shape

__all__ = [
    "CATEGORIES",
    "OpTypeError",
    "decode_index",
    "index_shape",
    "promote",
    "scalar_dtype",
]

PREFIX = "xp."


class OpTypeError(OpError, TypeError):
    """An input dtype that the function does not take (the standard's ``TypeError``)."""


#: the standard's dtype categories, as NumPy dtype kinds
CATEGORIES: dict[str, str] = {
    "all": "biufc",
    "numeric": "iufc",
    "real numeric": "iuf",
    "integer": "iu",
    "integer or boolean": "biu",
    "boolean": "b",
    "floating-point": "fc",
    "real floating-point": "f",
    "complex floating-point": "c",
}

_INT64 = np.dtype(np.int64)
_BOOL = np.dtype(np.bool_)


def _check(name: str, dt: np.dtype[Any], category: str) -> None:
    if dt.kind not in CATEGORIES[category]:
        raise OpTypeError(f"{name} takes {category} dtypes, got {dt}")


def promote(*dtypes: np.dtype[Any]) -> np.dtype[Any]:
    """The standard's type promotion of ``dtypes`` (NumPy's choice where the standard has
    none, such as int64 with uint64)."""
    out = dtypes[0]
    for d in dtypes[1:]:
        if d != out:
            if (out.kind == "b") != (d.kind == "b"):
                raise OpTypeError(f"{out} and {d} cannot be promoted together")
            out = np.result_type(out, d)
    return out


def scalar_dtype(dt: np.dtype[Any], value: Any) -> np.dtype[Any]:
    """The dtype that Python scalar ``value`` takes next to an array of ``dt`` (the standard's
    rules: ``bool`` only with bool arrays, ``int`` within the integer range or with floats,
    ``float`` and ``complex`` only with floating-point arrays)."""
    t = type(value)
    if t is bool:
        if dt.kind != "b":
            raise OpTypeError(f"a Python bool cannot be combined with an array of {dt}")
        return dt
    if t is int:
        if dt.kind == "b":
            raise OpTypeError(f"a Python int cannot be combined with an array of {dt}")
        if dt.kind in "iu":
            info = np.iinfo(dt)
            if not info.min <= value <= info.max:
                raise OverflowError(f"Python int {value} is out of the range of {dt}")
        return dt
    if t is float:
        if dt.kind not in "fc":
            raise OpTypeError(
                f"a Python float can only be combined with floating-point arrays, not {dt}"
            )
        return dt
    if t is complex:
        if dt.kind not in "fc":
            raise OpTypeError(
                f"a Python complex can only be combined with floating-point arrays, not {dt}"
            )
        return np.result_type(dt, np.complex64)
    raise OpTypeError(f"expected an array or a Python scalar, got {t.__name__}")


def _axes(
    name: str, axis: Any, ndim: int, *, allow_none: bool = True, unique: bool = True
) -> tuple[int, ...]:
    """Normalised axes of ``axis`` (int, list of ints, or None for all)."""
    if axis is None:
        if not allow_none:
            raise OpError(f"{name} needs an axis")
        return tuple(range(ndim))
    items = [axis] if type(axis) is int else axis
    if type(items) is not list or any(type(a) is not int for a in items):
        raise OpError(f"{name}: axis must be an int, a tuple of ints or None")
    out = []
    for a in items:
        if not -ndim <= a < ndim:
            raise OpError(f"{name}: axis {a} is out of range for {ndim} dimensions")
        out.append(a % ndim)
    if unique and len(set(out)) != len(out):
        raise OpError(f"{name}: repeated axis in {axis}")
    return tuple(out)


def _one_axis(name: str, axis: Any, ndim: int) -> int:
    if type(axis) is not int:
        raise OpError(f"{name}: axis must be an int")
    return _axes(name, axis, ndim)[0]


def _dtype_param(params: Params, key: str = "dtype") -> np.dtype[Any] | None:
    from .protocol import DTYPES

    name = params.get(key)
    if name is None:
        return None
    if name not in DTYPES:
        raise OpError(f"unsupported dtype {name!r}")
    return DTYPES[name]


@functools.cache
def namespace(xp: Any) -> Any:
    """The array API namespace for backend module ``xp`` (numpy or cupy)."""
    return importlib.import_module(f"array_api_compat.{xp.__name__}")


def _as_scalar_array(xp: Any, value: Any, dt: np.dtype[Any]) -> Any:
    return xp.asarray(value, dtype=dt)


def _write(outs: Sequence[Any], result: Any) -> None:
    if isinstance(result, tuple | list):  # the ops with several outputs return a tuple
        for o, r in zip(outs, result, strict=True):
            o[...] = r
    else:
        outs[0][...] = result


def _method(name: str, *keys: str) -> Callable[[Any, Sequence[Any], Params], Any]:
    """A call of ``ns.name(x, **params)``, passing on the params in ``keys`` that are set."""

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        return getattr(ns, name)(*ins, **{k: params[k] for k in keys if k in params})

    return call


def _op(
    name: str,
    nin: tuple[int, int],
    meta: Callable[[Sequence[Meta], Params], list[Meta]],
    call: Callable[[Any, Sequence[Any], Params], Any],
    params: tuple[str, ...] = (),
    *,
    dynamic: bool = False,
) -> Op:
    """Register ``xp.name``; ``call(ns, ins, params)`` computes the result with the backend's
    array API namespace ``ns``."""

    if dynamic:

        def run_dynamic(xp: Any, ins: Sequence[Any], params: Params, budget: int) -> list[Any]:
            if name == "repeat_array":  # the one whose output is not bounded by its inputs
                x, reps = ins
                n = int(xp.sum(reps)) if reps.size else 0
                per = x.dtype.itemsize * (
                    1 if params.get("axis") is None else x.size // max(x.shape[params["axis"]], 1)
                )
                if n * per > budget or bool(xp.any(reps < 0)):
                    raise OpError(f"repeat would make {n * per} bytes; {budget} are left")
            result = call(namespace(xp), ins, params)
            return list(result) if isinstance(result, tuple) else [result]

        def run(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
            raise OpError(f"{name} has a data-dependent output shape: use launch_dynamic")

        return _register(
            Op(PREFIX + name, nin, meta, run, params, f"array API {name}", dynamic=run_dynamic)
        )

    def run_static(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
        _write(outs, call(namespace(xp), ins, params))

    return _register(Op(PREFIX + name, nin, meta, run_static, params, f"array API {name}"))


# -- element-wise -----------------------------------------------------------------------------
_UNARY: dict[str, tuple[str, str]] = {
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

_BINARY: dict[str, tuple[str, str]] = {
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


def _real_of(dt: np.dtype[Any]) -> np.dtype[Any]:
    return (
        np.dtype(np.float32)
        if dt == np.complex64
        else np.dtype(np.float64)
        if dt.kind == "c"
        else dt
    )


def _make_unary(name: str, category: str, result: str) -> None:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        _check(name, dt, category)
        odt = _BOOL if result == "bool" else _real_of(dt) if result == "real" else dt
        return [(shape, odt)]

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        x = ins[0]
        if name in ("ceil", "floor", "trunc", "round") and x.dtype.kind in "iu":
            return x
        return getattr(ns, name)(x)

    _op(name, (1, 1), meta, call)


def _binary_operands(
    name: str, ins: Sequence[Meta], params: Params, category: str
) -> tuple[Shape, np.dtype[Any]]:
    if len(ins) == 2:
        (s1, d1), (s2, d2) = ins
        _check(name, d1, category)
        _check(name, d2, category)
        return _broadcast([s1, s2]), promote(d1, d2)
    if len(ins) != 1 or "scalar" not in params:
        raise OpError(f"{name} takes two arrays, or an array and the scalar param")
    ((shape, dt),) = ins
    _check(name, dt, category)
    return shape, scalar_dtype(dt, params["scalar"])


def _binary_inputs(xp: Any, ins: Sequence[Any], params: Params, dt: np.dtype[Any]) -> list[Any]:
    if len(ins) == 2:
        return list(ins)
    s = _as_scalar_array(xp, params["scalar"], dt)
    return [s, ins[0]] if params.get("reverse") else [ins[0], s]


def _make_binary(name: str, category: str, result: str) -> None:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        shape, dt = _binary_operands(name, ins, params, category)
        return [(shape, _BOOL if result == "bool" else dt)]

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        if len(ins) == 2:
            return getattr(ns, name)(ins[0], ins[1])
        dt = scalar_dtype(ins[0].dtype, params["scalar"])
        a, b = _binary_inputs(ns, ins, params, dt)
        if dt != ins[0].dtype:
            a, b = ns.astype(a, dt), ns.astype(b, dt)
        return getattr(ns, name)(a, b)

    _op(name, (1, 2), meta, call, ("scalar", "reverse"))


for _name, (_cat, _res) in _UNARY.items():
    _make_unary(_name, _cat, _res)
for _name, (_cat, _res) in _BINARY.items():
    _make_binary(_name, _cat, _res)


def _clip_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), *bounds = ins
    _check("clip", dt, "real numeric")
    for s, d in bounds:
        _check("clip", d, "real numeric")
        if _broadcast([shape, s]) != shape:
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


_op("clip", (1, 3), _clip_meta, _clip_call, ("min", "max", "n_min", "n_max"))


# -- creation ---------------------------------------------------------------------------------
def _shape_param(params: Params, key: str = "shape") -> Shape:
    shape = params.get(key)
    if type(shape) is not list or any(type(d) is not int or d < 0 for d in shape):
        raise OpError(f"{key} must be a list of non-negative ints")
    return tuple(shape)


def _full_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    dt = _dtype_param(params)
    if dt is None:
        raise OpError("full needs a dtype")
    if type(params.get("value")) not in (int, float, bool):
        raise OpError("full needs a numeric value")
    return [(_shape_param(params), dt)]


def _full_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    value = params["value"]
    if params.get("imag"):
        value = complex(value, params["imag"])
    return value  # broadcast into the output by _write


_op("full", (0, 0), _full_meta, _full_call, ("shape", "dtype", "value", "imag"))


def _arange_length(start: float, stop: float, step: float) -> int:
    if step == 0:
        raise OpError("arange: step must not be 0")
    return max(0, math.ceil((stop - start) / step))


def _arange_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    vals = [params.get(k) for k in ("start", "stop", "step")]
    if any(type(v) not in (int, float) for v in vals):
        raise OpError("arange needs numbers start, stop and step")
    dt = _dtype_param(params)
    if dt is None:
        dt = _INT64 if all(type(v) is int for v in vals) else np.dtype(np.float64)
    return [((_arange_length(*vals),), dt)]  # type: ignore[arg-type]


def _arange_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    dt = _dtype_param(params)
    return ns.arange(params["start"], params["stop"], params["step"], dtype=dt)


_op("arange", (0, 0), _arange_meta, _arange_call, ("start", "stop", "step", "dtype"))


def _eye_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    n, m, k = params.get("n_rows"), params.get("n_cols"), params.get("k", 0)
    if type(n) is not int or type(m) is not int or type(k) is not int or n < 0 or m < 0:
        raise OpError("eye needs non-negative ints n_rows and n_cols and an int k")
    dt = _dtype_param(params)
    return [((n, m), dt if dt is not None else np.dtype(np.float64))]


def _eye_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    return ns.eye(params["n_rows"], params["n_cols"], k=params.get("k", 0))


_op("eye", (0, 0), _eye_meta, _eye_call, ("n_rows", "n_cols", "k", "dtype"))


def _linspace_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    num = params.get("num")
    if type(num) is not int or num < 0:
        raise OpError("linspace needs a non-negative int num")
    for k in ("start", "stop"):
        if type(params.get(k)) not in (int, float):
            raise OpError(f"linspace needs a real number {k}")
    dt = _dtype_param(params)
    return [((num,), dt if dt is not None else np.dtype(np.float64))]


def _linspace_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    return ns.linspace(
        params["start"],
        params["stop"],
        params["num"],
        endpoint=bool(params.get("endpoint", True)),
        dtype=np.dtype(np.float64),
    )


_op(
    "linspace",
    (0, 0),
    _linspace_meta,
    _linspace_call,
    ("start", "stop", "num", "endpoint", "dtype"),
)


def _tri_meta(name: str) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        if len(shape) < 2:
            raise OpError(f"{name} needs at least two dimensions")
        if type(params.get("k", 0)) is not int:
            raise OpError(f"{name}: k must be an int")
        return [(shape, dt)]

    return meta


for _name in ("tril", "triu"):
    _op(
        _name,
        (1, 1),
        _tri_meta(_name),
        _method(_name, "k"),
        ("k",),
    )


def _meshgrid_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    indexing = params.get("indexing", "xy")
    if indexing not in ("xy", "ij"):
        raise OpError("meshgrid: indexing must be 'xy' or 'ij'")
    for s, _ in ins:
        if len(s) != 1:
            raise OpError("meshgrid takes 1-D arrays")
    dts = [d for _, d in ins]
    dt = promote(*dts) if dts else np.dtype(np.float64)
    sizes = [s[0] for s, _ in ins]
    if indexing == "xy" and len(sizes) >= 2:
        sizes[0], sizes[1] = sizes[1], sizes[0]
    return [(tuple(sizes), dt) for _ in ins]


_op(
    "meshgrid",
    (1, 64),
    _meshgrid_meta,
    lambda ns, ins, p: tuple(ns.meshgrid(*ins, indexing=p.get("indexing", "xy"))),
    ("indexing",),
)


def _astype_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, _),) = ins
    dt = _dtype_param(params)
    if dt is None:
        raise OpError("astype needs a dtype")
    return [(shape, dt)]


_op("astype", (1, 1), _astype_meta, lambda ns, ins, p: ins[0], ("dtype",))


# -- reductions and statistics ----------------------------------------------------------------
def _reduced_shape(name: str, shape: Shape, params: Params) -> Shape:
    axes = _axes(name, params.get("axis"), len(shape))
    if params.get("keepdims"):
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _sum_dtype(dt: np.dtype[Any], params: Params) -> np.dtype[Any]:
    explicit = _dtype_param(params)
    if explicit is not None:
        return explicit
    if dt.kind == "b" or dt.kind == "i":
        return _INT64
    if dt.kind == "u":
        return np.dtype(np.uint64)
    return dt


_REDUCTIONS: dict[str, tuple[str, str]] = {
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


def _make_reduction(name: str, category: str, result: str) -> None:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        _check(name, dt, category)
        if name in ("argmax", "argmin") and params.get("axis") is not None:
            _one_axis(name, params["axis"], len(shape))
        out_shape = _reduced_shape(name, shape, params)
        if name in ("max", "min", "argmax", "argmin"):
            axes = _axes(name, params.get("axis"), len(shape))
            if any(shape[a] == 0 for a in axes) or (not axes and math.prod(shape) == 0):
                raise OpError(f"{name} of an empty array")
        if "correction" in params and type(params["correction"]) not in (int, float):
            raise OpError(f"{name}: correction must be a number")
        odt = {
            "same": dt,
            "sum": _sum_dtype(dt, params),
            "bool": _BOOL,
            "index": _INT64,
        }[result]
        return [(out_shape, odt)]

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        kw: dict[str, Any] = {"keepdims": bool(params.get("keepdims", False))}
        axis = params.get("axis")
        kw["axis"] = tuple(axis) if type(axis) is list else axis
        if result == "sum":
            kw["dtype"] = _sum_dtype(ins[0].dtype, params)
        if "correction" in params:
            kw["correction"] = params["correction"]
        return getattr(ns, name)(ins[0], **kw)

    _op(name, (1, 1), meta, call, ("axis", "keepdims", "dtype", "correction"))


for _name, (_cat, _res) in _REDUCTIONS.items():
    _make_reduction(_name, _cat, _res)


def _make_cumulative(name: str) -> None:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        _check(name, dt, "numeric")
        axis = params.get("axis")
        if axis is None:
            if len(shape) > 1:
                raise OpError(f"{name} needs an axis for arrays of more than one dimension")
            axis = 0
        if not shape:
            raise OpError(f"{name} needs at least one dimension")
        ax = _one_axis(name, axis, len(shape))
        extra = 1 if params.get("include_initial") else 0
        out = tuple(d + extra if i == ax else d for i, d in enumerate(shape))
        return [(out, _sum_dtype(dt, params))]

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        x = ins[0]
        axis = params.get("axis")
        axis = 0 if axis is None else axis
        dt = _sum_dtype(x.dtype, params)
        return getattr(ns, name)(
            x, axis=axis, dtype=dt, include_initial=bool(params.get("include_initial", False))
        )

    _op(name, (1, 1), meta, call, ("axis", "dtype", "include_initial"))


_make_cumulative("cumulative_sum")
_make_cumulative("cumulative_prod")


def _diff_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), *extra = ins
    _check("diff", dt, "numeric")
    if not shape:
        raise OpError("diff needs at least one dimension")
    ax = _one_axis("diff", params.get("axis", -1), len(shape))
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


_op("diff", (1, 3), _diff_meta, _diff_call, ("axis", "n", "has_prepend", "has_append"))


# -- linear algebra ---------------------------------------------------------------------------
def _matmul_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (a, ad), (b, bd) = ins
    _check("matmul", ad, "numeric")
    _check("matmul", bd, "numeric")
    return [(matmul_shape(a, b), promote(ad, bd))]


_op("matmul", (2, 2), _matmul_meta, lambda ns, ins, p: ns.matmul(ins[0], ins[1]))


def _matrix_transpose_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    if len(shape) < 2:
        raise OpError("matrix_transpose needs at least two dimensions")
    return [((*shape[:-2], shape[-1], shape[-2]), dt)]


_op(
    "matrix_transpose",
    (1, 1),
    _matrix_transpose_meta,
    lambda ns, ins, p: ns.matrix_transpose(ins[0]),
)


def _tensordot_axes(params: Params, n1: int, n2: int) -> tuple[list[int], list[int]]:
    if "axes1" in params:
        a1, a2 = params["axes1"], params.get("axes2")
        if type(a1) is not list or type(a2) is not list or len(a1) != len(a2):
            raise OpError("tensordot: axes must be two sequences of one length")
        return [a % n1 if -n1 <= a < n1 else -1 for a in a1], [
            a % n2 if -n2 <= a < n2 else -1 for a in a2
        ]
    k = params.get("axes", 2)
    if type(k) is not int or k < 0 or k > min(n1, n2):
        raise OpError(f"tensordot: axes={k!r} is out of range")
    return list(range(n1 - k, n1)), list(range(k))


def _tensordot_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2) = ins
    _check("tensordot", d1, "numeric")
    _check("tensordot", d2, "numeric")
    ax1, ax2 = _tensordot_axes(params, len(s1), len(s2))
    if -1 in ax1 or -1 in ax2 or len(set(ax1)) != len(ax1) or len(set(ax2)) != len(ax2):
        raise OpError("tensordot: axes out of range or repeated")
    for i, j in zip(ax1, ax2, strict=True):
        if s1[i] != s2[j]:
            raise OpError(f"tensordot: contracted dimensions {s1[i]} and {s2[j]} differ")
    shape = tuple(d for i, d in enumerate(s1) if i not in ax1) + tuple(
        d for i, d in enumerate(s2) if i not in ax2
    )
    return [(shape, promote(d1, d2))]


def _tensordot_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    axes: Any = params.get("axes", 2)
    if "axes1" in params:
        axes = (tuple(params["axes1"]), tuple(params["axes2"]))
    return ns.tensordot(ins[0], ins[1], axes=axes)


_op("tensordot", (2, 2), _tensordot_meta, _tensordot_call, ("axes", "axes1", "axes2"))


def _vecdot_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2) = ins
    _check("vecdot", d1, "numeric")
    _check("vecdot", d2, "numeric")
    axis = params.get("axis", -1)
    if type(axis) is not int or not s1 or not s2:
        raise OpError("vecdot needs arrays of at least one dimension and an int axis")
    n = min(len(s1), len(s2))
    if not -n <= axis < 0 and not 0 <= axis < n:
        raise OpError(f"vecdot: axis {axis} is out of range")
    a1 = axis % len(s1)
    a2 = axis % len(s2)
    if s1[a1] != s2[a2]:
        raise OpError(f"vecdot: dimensions {s1[a1]} and {s2[a2]} along axis {axis} differ")
    shape = _broadcast([s1, s2])
    ax = axis % len(shape)
    return [(shape[:ax] + shape[ax + 1 :], promote(d1, d2))]


_op(
    "vecdot",
    (2, 2),
    _vecdot_meta,
    lambda ns, ins, p: ns.vecdot(ins[0], ins[1], axis=p.get("axis", -1)),
    ("axis",),
)


def _square_stack(name: str, shape: Shape) -> None:
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise OpError(f"{name} needs a stack of square matrices, got shape {shape}")


def _linalg_meta(name: str) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    """Output metadata of the ``linalg`` functions of one input."""

    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        (shape, dt), *_ = ins
        real = _real_of(dt)
        if name in ("cholesky", "det", "eigh", "eigvalsh", "inv", "slogdet"):
            _check(name, dt, "floating-point")
            _square_stack(name, shape)
        batch, n = shape[:-2], shape[-1] if shape else 0
        if name in ("cholesky", "inv"):
            return [(shape, dt)]
        if name == "det":
            return [(batch, dt)]
        if name == "slogdet":
            return [(batch, dt), (batch, real)]
        if name == "eigh":
            return [((*batch, n), real), (shape, dt)]
        if name == "eigvalsh":
            return [((*batch, n), real)]
        _check(name, dt, "floating-point")
        if len(shape) < 2:
            raise OpError(f"{name} needs at least two dimensions")
        m, n = shape[-2], shape[-1]
        k = min(m, n)
        if name == "qr":
            mode = params.get("mode", "reduced")
            if mode not in ("reduced", "complete"):
                raise OpError("qr: mode must be 'reduced' or 'complete'")
            q = m if mode == "complete" else k
            return [((*batch, m, q), dt), ((*batch, q, n), dt)]
        if name == "svd":
            full = params.get("full_matrices", True)
            u, v = (m, n) if full else (k, k)
            return [((*batch, m, u), dt), ((*batch, k), real), ((*batch, v, n), dt)]
        if name == "svdvals":
            return [((*batch, k), real)]
        if name == "pinv":
            return [((*batch, n, m), dt)]
        if name == "matrix_rank":
            return [(batch, _INT64)]
        if name == "matrix_norm":
            keep = params.get("keepdims", False)
            return [((*batch, 1, 1) if keep else batch, real)]
        raise OpError(f"no linalg function {name}")

    return meta


def _linalg_call(name: str) -> Callable[[Any, Sequence[Any], Params], Any]:
    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        fn = getattr(ns.linalg, name)
        kw: dict[str, Any] = {}
        if name == "cholesky":
            kw["upper"] = bool(params.get("upper", False))
        elif name == "qr":
            kw["mode"] = params.get("mode", "reduced")
        elif name == "svd":
            kw["full_matrices"] = bool(params.get("full_matrices", True))
        elif name in ("pinv", "matrix_rank") and "rtol" in params:
            kw["rtol"] = params["rtol"]
        elif name == "matrix_norm":
            kw["keepdims"] = bool(params.get("keepdims", False))
            kw["ord"] = params.get("ord", "fro")
        result = fn(ins[0], **kw)
        return tuple(result) if isinstance(result, tuple) else result

    return call


for _name in (
    "cholesky",
    "det",
    "eigh",
    "eigvalsh",
    "inv",
    "matrix_norm",
    "matrix_rank",
    "pinv",
    "qr",
    "slogdet",
    "svd",
    "svdvals",
):
    _op(
        f"linalg.{_name}",
        (1, 1),
        _linalg_meta(_name),
        _linalg_call(_name),
        ("upper", "mode", "full_matrices", "rtol", "keepdims", "ord"),
    )


def _solve_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2) = ins
    _check("solve", d1, "floating-point")
    _check("solve", d2, "floating-point")
    _square_stack("solve", s1)
    n = s1[-1]
    if len(s2) == 1:
        if s2[0] != n:
            raise OpError(f"solve: {s2} does not fit matrices of {s1}")
        return [((*s1[:-2], n), promote(d1, d2))]
    if len(s2) < 2 or s2[-2] != n:
        raise OpError(f"solve: {s2} does not fit matrices of {s1}")
    return [((*_broadcast([s1[:-2], s2[:-2]]), n, s2[-1]), promote(d1, d2))]


_op("linalg.solve", (2, 2), _solve_meta, lambda ns, ins, p: ns.linalg.solve(ins[0], ins[1]))


def _matrix_power_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    _check("matrix_power", dt, "numeric")
    _square_stack("matrix_power", shape)
    n = params.get("n")
    if type(n) is not int or (n < 0 and dt.kind not in "fc"):
        raise OpError("matrix_power: n must be an int (negative only for floating point)")
    return [(shape, dt)]


_op(
    "linalg.matrix_power",
    (1, 1),
    _matrix_power_meta,
    lambda ns, ins, p: ns.linalg.matrix_power(ins[0], p["n"]),
    ("n",),
)


def _cross_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2) = ins
    _check("cross", d1, "numeric")
    _check("cross", d2, "numeric")
    axis = params.get("axis", -1)
    if type(axis) is not int or len(s1) != len(s2):
        raise OpError("cross needs arrays of one rank and an int axis")
    ax = _one_axis("cross", axis, len(s1))
    if s1[ax] != 3 or s2[ax] != 3:
        raise OpError("cross needs dimension 3 along axis")
    return [(_broadcast([s1, s2]), promote(d1, d2))]


_op(
    "linalg.cross",
    (2, 2),
    _cross_meta,
    lambda ns, ins, p: ns.linalg.cross(ins[0], ins[1], axis=p.get("axis", -1)),
    ("axis",),
)


def _outer_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2) = ins
    _check("outer", d1, "numeric")
    _check("outer", d2, "numeric")
    if len(s1) != 1 or len(s2) != 1:
        raise OpError("outer takes 1-D arrays")
    return [((s1[0], s2[0]), promote(d1, d2))]


_op("linalg.outer", (2, 2), _outer_meta, lambda ns, ins, p: ns.linalg.outer(ins[0], ins[1]))


def _diagonal_len(shape: Shape, k: int) -> int:
    m, n = shape[-2], shape[-1]
    return max(0, min(m, n - k) if k >= 0 else min(m + k, n))


def _diagonal_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    if len(shape) < 2 or type(params.get("offset", 0)) is not int:
        raise OpError("diagonal needs at least two dimensions and an int offset")
    return [((*shape[:-2], _diagonal_len(shape, params.get("offset", 0))), dt)]


_op(
    "linalg.diagonal",
    (1, 1),
    _diagonal_meta,
    lambda ns, ins, p: ns.linalg.diagonal(ins[0], offset=p.get("offset", 0)),
    ("offset",),
)


def _trace_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    _check("trace", dt, "numeric")
    if len(shape) < 2 or type(params.get("offset", 0)) is not int:
        raise OpError("trace needs at least two dimensions and an int offset")
    return [(shape[:-2], _sum_dtype(dt, params))]


_op(
    "linalg.trace",
    (1, 1),
    _trace_meta,
    lambda ns, ins, p: ns.linalg.trace(
        ins[0], offset=p.get("offset", 0), dtype=_sum_dtype(ins[0].dtype, p)
    ),
    ("offset", "dtype"),
)


def _vector_norm_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    _check("vector_norm", dt, "floating-point")
    if type(params.get("ord", 2)) not in (int, float):
        raise OpError("vector_norm: ord must be a number")
    return [(_reduced_shape("vector_norm", shape, params), _real_of(dt))]


def _vector_norm_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    axis = params.get("axis")
    return ns.linalg.vector_norm(
        ins[0],
        axis=tuple(axis) if type(axis) is list else axis,
        keepdims=bool(params.get("keepdims", False)),
        ord=params.get("ord", 2),
    )


_op(
    "linalg.vector_norm",
    (1, 1),
    _vector_norm_meta,
    _vector_norm_call,
    ("axis", "keepdims", "ord"),
)


# -- manipulation -----------------------------------------------------------------------------
def _broadcast_to_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    target = _shape_param(params)
    if _broadcast([shape, target]) != target:
        raise OpError(f"cannot broadcast shape {shape} to {target}")
    return [(target, dt)]


_op(
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
    ax = _one_axis("concat", axis, len(first))
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


_op("concat", (1, 64), _concat_meta, _concat_call, ("axis",))


def _stack_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    dt = promote(*(d for _, d in ins))
    first = ins[0][0]
    if any(s != first for s, _ in ins):
        raise OpError("stack needs arrays of one shape")
    ax = _one_axis("stack", params.get("axis", 0), len(first) + 1)
    return [((*first[:ax], len(ins), *first[ax:]), dt)]


def _stack_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    dt = promote(*(x.dtype for x in ins))
    return ns.stack([ns.astype(x, dt) for x in ins], axis=params.get("axis", 0))


_op("stack", (1, 64), _stack_meta, _stack_call, ("axis",))


def _expand_dims_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    ax = _one_axis("expand_dims", params.get("axis", 0), len(shape) + 1)
    return [((*shape[:ax], 1, *shape[ax:]), dt)]


_op(
    "expand_dims",
    (1, 1),
    _expand_dims_meta,
    lambda ns, ins, p: ns.expand_dims(ins[0], axis=p.get("axis", 0)),
    ("axis",),
)


def _same_meta_axes(name: str) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        _axes(name, params.get("axis"), len(shape))
        return [(shape, dt)]

    return meta


def _axis_arg(params: Params, key: str = "axis") -> Any:
    axis = params.get(key)
    return tuple(axis) if type(axis) is list else axis


_op(
    "flip",
    (1, 1),
    _same_meta_axes("flip"),
    lambda ns, ins, p: ns.flip(ins[0], axis=_axis_arg(p)),
    ("axis",),
)


def _roll_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    shift, axis = params.get("shift"), params.get("axis")
    if axis is None:
        if type(shift) is not int:
            raise OpError("roll: shift must be an int when axis is None")
    else:
        axes = _axes("roll", axis, len(shape), unique=False)
        shifts = [shift] if type(shift) is int else shift
        if type(shifts) is not list or len(shifts) not in (1, len(axes)):
            raise OpError("roll: shift and axis must have one length")
    return [(shape, dt)]


def _roll_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    shift = params["shift"]
    return ns.roll(ins[0], tuple(shift) if type(shift) is list else shift, axis=_axis_arg(params))


_op("roll", (1, 1), _roll_meta, _roll_call, ("shift", "axis"))


def _moveaxis_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    src = _axes("moveaxis", params.get("source"), len(shape), allow_none=False)
    dst = _axes("moveaxis", params.get("destination"), len(shape), allow_none=False)
    if len(src) != len(dst):
        raise OpError("moveaxis: source and destination must have one length")
    order = [i for i in range(len(shape)) if i not in src]
    for d, s in sorted(zip(dst, src, strict=True)):
        order.insert(d, s)
    return [(tuple(shape[i] for i in order), dt)]


_op(
    "moveaxis",
    (1, 1),
    _moveaxis_meta,
    lambda ns, ins, p: ns.moveaxis(ins[0], _axis_arg(p, "source"), _axis_arg(p, "destination")),
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


_op(
    "permute_dims",
    (1, 1),
    _permute_meta,
    lambda ns, ins, p: ns.permute_dims(ins[0], tuple(p["axes"])),
    ("axes",),
)


def _squeeze_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    axes = _axes("squeeze", params.get("axis"), len(shape), allow_none=False)
    for a in axes:
        if shape[a] != 1:
            raise OpError(f"squeeze: dimension {a} of {shape} is not 1")
    return [(tuple(d for i, d in enumerate(shape) if i not in axes), dt)]


_op(
    "squeeze",
    (1, 1),
    _squeeze_meta,
    lambda ns, ins, p: ns.squeeze(ins[0], axis=_axis_arg(p)),
    ("axis",),
)


def _tile_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    reps = _shape_param(params, "repetitions")
    n = max(len(shape), len(reps))
    s = (1,) * (n - len(shape)) + shape
    r = (1,) * (n - len(reps)) + reps
    return [(tuple(a * b for a, b in zip(s, r, strict=True)), dt)]


_op(
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
    ax = _one_axis("repeat", axis, len(shape))
    return [(tuple(d * reps if i == ax else d for i, d in enumerate(shape)), dt)]


_op(
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
    ax = _one_axis("unstack", params.get("axis", 0), len(shape))
    if shape[ax] > 64:
        raise OpError("unstack of more than 64 arrays; slice instead")
    return [(shape[:ax] + shape[ax + 1 :], dt)] * shape[ax]


_op(
    "unstack",
    (1, 1),
    _unstack_meta,
    lambda ns, ins, p: tuple(ns.unstack(ins[0], axis=p.get("axis", 0))),
    ("axis",),
)


# -- searching, sorting, sets -----------------------------------------------------------------
def _where_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (cs, cd), *rest = ins
    if cd.kind != "b":
        raise OpTypeError(f"where needs a bool condition, got {cd}")
    if len(rest) == 2:
        (s1, d1), (s2, d2) = rest
        return [(_broadcast([cs, s1, s2]), promote(d1, d2))]
    if len(rest) != 1 or "scalar" not in params:
        raise OpError("where takes a condition and two arrays, or one array and the scalar param")
    ((s1, d1),) = rest
    return [(_broadcast([cs, s1]), scalar_dtype(d1, params["scalar"]))]


def _where_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    cond, *rest = ins
    if len(rest) == 2:
        dt = promote(rest[0].dtype, rest[1].dtype)
        return ns.where(cond, ns.astype(rest[0], dt), ns.astype(rest[1], dt))
    a, b = _binary_inputs(ns, rest, params, rest[0].dtype)
    return ns.where(cond, a, b)


_op("where", (2, 3), _where_meta, _where_call, ("scalar", "reverse"))


def _sort_meta(name: str) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        _check(name, dt, "real numeric")
        if not shape:
            raise OpError(f"{name} needs at least one dimension")
        _one_axis(name, params.get("axis", -1), len(shape))
        return [(shape, _INT64 if name == "argsort" else dt)]

    return meta


for _name in ("sort", "argsort"):
    _op(
        _name,
        (1, 1),
        _sort_meta(_name),
        _method(_name, "axis", "descending", "stable"),
        ("axis", "descending", "stable"),
    )


def _searchsorted_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2), *sorter = ins
    _check("searchsorted", d1, "real numeric")
    _check("searchsorted", d2, "real numeric")
    if len(s1) != 1:
        raise OpError("searchsorted needs a 1-D sorted array")
    if params.get("side", "left") not in ("left", "right"):
        raise OpError("searchsorted: side must be 'left' or 'right'")
    if sorter and (sorter[0][0] != s1 or sorter[0][1].kind not in "iu"):
        raise OpError("searchsorted: sorter must be integer indices of x1's shape")
    promote(d1, d2)
    return [(s2, _INT64)]


def _searchsorted_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    x1, x2, *sorter = ins
    dt = promote(x1.dtype, x2.dtype)
    return ns.searchsorted(
        ns.astype(x1, dt),
        ns.astype(x2, dt),
        side=params.get("side", "left"),
        sorter=sorter[0] if sorter else None,
    )


_op("searchsorted", (2, 3), _searchsorted_meta, _searchsorted_call, ("side",))


def _isin_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (_, d2) = ins
    _check("isin", d1, "integer")
    _check("isin", d2, "integer")
    return [(s1, _BOOL)]


def _isin_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    xp = ns
    return xp.isin(ins[0], ins[1], invert=bool(params.get("invert", False)))


_op("isin", (2, 2), _isin_meta, _isin_call, ("invert",))


def _take_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), (ishape, idt) = ins
    if idt.kind not in "iu" or len(ishape) != 1:
        raise OpTypeError("take needs 1-D integer indices")
    axis = params.get("axis")
    if axis is None:
        if len(shape) != 1:
            raise OpError("take needs an axis for arrays of more than one dimension")
        axis = 0
    ax = _one_axis("take", axis, len(shape))
    return [(tuple(ishape[0] if i == ax else d for i, d in enumerate(shape)), dt)]


_op(
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
    ax = _one_axis("take_along_axis", params.get("axis", -1), len(shape))
    other = _broadcast(
        [
            tuple(1 if i == ax else d for i, d in enumerate(shape)),
            tuple(1 if i == ax else d for i, d in enumerate(ishape)),
        ]
    )
    return [(tuple(ishape[ax] if i == ax else d for i, d in enumerate(other)), dt)]


_op(
    "take_along_axis",
    (2, 2),
    _take_along_meta,
    lambda ns, ins, p: ns.take_along_axis(ins[0], ins[1], axis=p.get("axis", -1)),
    ("axis",),
)


# -- fft extension ----------------------------------------------------------------------------
_COMPLEX_OF: dict[np.dtype[Any], np.dtype[Any]] = {
    np.dtype(np.float32): np.dtype(np.complex64),
    np.dtype(np.float64): np.dtype(np.complex128),
}
_FFT: dict[str, tuple[str, str, str]] = {
    # name: (input category, output "complex" / "real", length rule)
    "fft": ("complex floating-point", "complex", "n"),
    "ifft": ("complex floating-point", "complex", "n"),
    "rfft": ("real floating-point", "complex", "half"),
    "irfft": ("complex floating-point", "real", "full"),
    "hfft": ("complex floating-point", "real", "full"),
    "ihfft": ("real floating-point", "complex", "half"),
    "fftn": ("complex floating-point", "complex", "n"),
    "ifftn": ("complex floating-point", "complex", "n"),
    "rfftn": ("real floating-point", "complex", "half"),
    "irfftn": ("complex floating-point", "real", "full"),
}


def _fft_axes(name: str, shape: Shape, params: Params) -> tuple[list[int], list[int | None]]:
    """The transformed axes and the requested length along each (None: the input's)."""
    if not name.endswith("n"):
        if not shape:
            raise OpError(f"{name} needs at least one dimension")
        n = params.get("n")
        if n is not None and (type(n) is not int or n < 1):
            raise OpError(f"{name}: n must be a positive int")
        return [_one_axis(name, params.get("axis", -1), len(shape))], [n]
    s, axes = params.get("s"), params.get("axes")
    if axes is None:
        axes = (
            list(range(len(shape))) if s is None else list(range(len(shape) - len(s), len(shape)))
        )
    ax = list(_axes(name, axes, len(shape), allow_none=False))
    if s is not None and (len(s) != len(ax) or any(type(v) is not int or v < 1 for v in s)):
        raise OpError(f"{name}: s must give a positive length for each axis")
    return ax, list(s) if s is not None else [None] * len(ax)


def _make_fft(name: str, category: str, result: str, rule: str) -> None:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        _check(name, dt, category)
        if params.get("norm", "backward") not in ("backward", "ortho", "forward"):
            raise OpError(f"{name}: norm must be 'backward', 'ortho' or 'forward'")
        axes, lengths = _fft_axes(name, shape, params)
        out = list(shape)
        for i, (a, n) in enumerate(zip(axes, lengths, strict=True)):
            last = i == len(axes) - 1
            m = shape[a] if n is None else n
            if rule == "half" and last:
                m = m // 2 + 1
            elif rule == "full" and last and n is None:
                m = 2 * (shape[a] - 1)
            if m < 1:
                raise OpError(f"{name}: invalid number of points {m}")
            out[a] = m
        odt = _real_of(dt) if result == "real" else _COMPLEX_OF.get(dt, dt)
        return [(tuple(out), odt)]

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        kw: dict[str, Any] = {"norm": params.get("norm", "backward")}
        if name.endswith("n"):
            kw["s"] = None if params.get("s") is None else tuple(params["s"])
            kw["axes"] = None if params.get("axes") is None else tuple(params["axes"])
        else:
            kw["n"], kw["axis"] = params.get("n"), params.get("axis", -1)
        return getattr(ns.fft, name)(ins[0], **kw)

    _op(f"fft.{name}", (1, 1), meta, call, ("n", "axis", "s", "axes", "norm"))


for _name, (_cat, _res, _rule) in _FFT.items():
    _make_fft(_name, _cat, _res, _rule)


def _freq_meta(name: str) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        n, d = params.get("n"), params.get("d", 1.0)
        if type(n) is not int or n < 1 or type(d) not in (int, float):
            raise OpError(f"{name} needs a positive int n and a number d")
        dt = _dtype_param(params) or np.dtype(np.float64)
        if dt.kind != "f":
            raise OpError(f"{name}: dtype must be a real floating-point dtype")
        return [((n if name == "fftfreq" else n // 2 + 1,), dt)]

    return meta


def _fft_call(name: str) -> Callable[[Any, Sequence[Any], Params], Any]:
    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        fn = getattr(ns.fft, name)
        if name.endswith("freq"):
            return fn(params["n"], d=params.get("d", 1.0))
        return fn(ins[0], axes=_axis_arg(params, "axes"))

    return call


for _name in ("fftfreq", "rfftfreq"):
    _op(f"fft.{_name}", (0, 0), _freq_meta(_name), _fft_call(_name), ("n", "d", "dtype"))


def _shift_meta(name: str) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        _check(name, dt, "floating-point")
        _axes(name, params.get("axes"), len(shape))
        return [(shape, dt)]

    return meta


for _name in ("fftshift", "ifftshift"):
    _op(f"fft.{_name}", (1, 1), _shift_meta(_name), _fft_call(_name), ("axes",))


# -- data-dependent output shapes (launch_dynamic) ---------------------------------------------
def _no_meta(category: str, nin: int = 1) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        for _, dtype in ins[:nin]:
            _check("this function", dtype, category)
        return []

    return meta


def _nonzero_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, _),) = ins
    if not shape:
        raise OpError("nonzero does not take 0-d arrays")
    return []


_op("nonzero", (1, 1), _nonzero_meta, lambda ns, ins, p: tuple(ns.nonzero(ins[0])), dynamic=True)
for _name in ("unique_all", "unique_counts", "unique_inverse", "unique_values"):
    _op(
        _name,
        (1, 1),
        _no_meta("all"),
        _method(_name),
        dynamic=True,
    )


def _mask_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, _), (mshape, mdt) = ins
    if mdt.kind != "b" or shape[: len(mshape)] != mshape:
        raise OpError(f"a boolean index of shape {mshape} does not fit an array of {shape}")
    return []


_op(
    "getitem_mask",
    (2, 2),
    _mask_meta,
    lambda ns, ins, p: ins[0][ins[1]],
    dynamic=True,
)


def _repeat_array_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, _), (rshape, rdt) = ins
    if rdt.kind not in "iu" or len(rshape) != 1:
        raise OpTypeError("repeat: repeats must be a 1-D integer array")
    if params.get("axis") is not None:
        _one_axis("repeat", params["axis"], len(shape))
    return []


_op(
    "repeat_array",
    (2, 2),
    _repeat_array_meta,
    lambda ns, ins, p: ns.repeat(ins[0], ins[1], axis=p.get("axis")),
    ("axis",),
    dynamic=True,
)


# -- indexing ---------------------------------------------------------------------------------
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


_op(
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


_op("getitem_int", (2, 2), _getitem_int_meta, lambda ns, ins, p: ins[0][ins[1]])


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
        if selected is not None and _broadcast([vshape, selected]) != selected:
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


_register(
    Op(
        PREFIX + "setitem",
        (1, 3),
        _setitem_meta,
        _setitem_run,
        ("index", "mask", "scalar"),
        "array API __setitem__ (in place)",
    )
)


del _name, _cat, _res, _rule
