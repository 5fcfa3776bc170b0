"""The allow-listed ops that ``launch`` may run, each written once against an array namespace.

An op has a ``meta`` function, run on the client to infer the shapes and dtypes of its outputs
(NumPy's own promotion rules, no round trip) and on the proxy to check what a client sent, and a
``run`` function, called on the proxy with ``xp`` (numpy or cupy), the input arrays, the output
arrays it writes into, and the params. A name that is not in ``OPS`` is an error; no op is ever
looked up by a name that came from the network.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["OPS", "Meta", "Op", "OpError", "infer"]

Shape = tuple[int, ...]
Meta = tuple[Shape, np.dtype[Any]]
Params = dict[str, Any]


class OpError(ValueError):
    """Inputs or params that an op does not accept."""


@dataclass(frozen=True, slots=True)
class Op:
    """One allow-listed op."""

    name: str
    nin: tuple[int, int]  # min and max number of array inputs
    meta: Callable[[Sequence[Meta], Params], list[Meta]]
    run: Callable[[Any, Sequence[Any], Sequence[Any], Params], None]
    params: tuple[str, ...] = ()
    doc: str = ""
    #: for ops whose output shapes depend on the data: computes and returns the outputs,
    #: refusing (``OpError``) to make more than the given number of bytes
    dynamic: Callable[[Any, Sequence[Any], Params, int], list[Any]] | None = None


OPS: dict[str, Op] = {}


def _register(op: Op) -> Op:
    OPS[op.name] = op
    return op


def infer(name: str, inputs: Sequence[Meta], params: Params) -> list[Meta]:
    """Output shapes and dtypes of op ``name``; raises ``OpError`` for what it cannot take."""
    op = OPS.get(name)
    if op is None:
        raise OpError(f"unknown op {name!r}")
    lo, hi = op.nin
    if not lo <= len(inputs) <= hi:
        raise OpError(f"{name} takes {lo}..{hi} array inputs, got {len(inputs)}")
    extra = set(params) - set(op.params)
    if extra:
        raise OpError(f"{name} takes no parameter(s) {sorted(extra)}")
    return op.meta(inputs, params)


# -- helpers ----------------------------------------------------------------------------------
def _scalar(params: Params, key: str = "scalar") -> float | int | bool:
    v = params.get(key)
    if type(v) not in (int, float, bool):
        raise OpError(f"parameter {key!r} must be a number")
    return v  # type: ignore[return-value]


def _axis(params: Params, ndim: int, default: int | None = None) -> int | None:
    axis = params.get("axis", default)
    if axis is None:
        return None
    if type(axis) is not int or not -ndim <= axis < max(ndim, 1):
        raise OpError(f"axis {axis!r} is out of range for {ndim} dimensions")
    return axis % ndim if ndim else 0


def _broadcast(shapes: Sequence[Shape]) -> Shape:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise OpError(f"shapes {', '.join(map(str, shapes))} do not broadcast") from None


@functools.lru_cache(maxsize=4096)
def _ufunc_dtype(ufunc: str, dtypes: tuple[Any, ...]) -> np.dtype[Any]:
    try:
        resolved = getattr(np, ufunc).resolve_dtypes((*dtypes, None))
    except Exception as exc:
        raise OpError(f"{ufunc} does not support dtypes {dtypes}: {exc}") from None
    return resolved[-1]


# -- element-wise -----------------------------------------------------------------------------
def _unary(name: str) -> Op:
    fname = name

    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        return [(shape, _ufunc_dtype(fname, (dt,)))]

    def run(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
        getattr(xp, fname)(ins[0], out=outs[0])

    return _register(Op(name, (1, 1), meta, run, doc=f"element-wise {fname}"))


def _binary(name: str, ufunc: str | None = None) -> Op:
    """A binary ufunc; with one input, the second operand is the ``scalar`` param."""
    fname = ufunc or name

    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        if len(ins) == 2:
            shape = _broadcast([ins[0][0], ins[1][0]])
            return [(shape, _ufunc_dtype(fname, (ins[0][1], ins[1][1])))]
        s = _scalar(params)
        return [(ins[0][0], _ufunc_dtype(fname, (ins[0][1], type(s))))]

    def run(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
        f = getattr(xp, fname)
        if len(ins) == 2:
            f(ins[0], ins[1], out=outs[0])
        elif params.get("reverse"):
            f(params["scalar"], ins[0], out=outs[0])
        else:
            f(ins[0], params["scalar"], out=outs[0])

    return _register(Op(name, (1, 2), meta, run, ("scalar", "reverse"), f"element-wise {fname}"))


for _n in ("negative", "exp", "log", "tanh", "sqrt", "square", "abs", "sin", "cos", "log1p"):
    _unary(_n)
for _n in (
    "add",
    "subtract",
    "multiply",
    "divide",
    "maximum",
    "minimum",
    "power",
    "greater",
    "less",
    "equal",
):
    _binary(_n)


def _float_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    if dt.kind not in "fc":
        raise OpError(f"needs a floating-point input, got {dt}")
    return [(shape, dt)]


def _run_relu(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    xp.maximum(ins[0], 0, out=outs[0])


def _relu_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    return [(shape, dt)]


_register(Op("relu", (1, 1), _relu_meta, _run_relu, doc="max(x, 0)"))


def _run_sigmoid(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    out = outs[0]
    xp.negative(ins[0], out=out)
    xp.exp(out, out=out)
    xp.add(out, 1, out=out)
    xp.reciprocal(out, out=out)


_register(Op("sigmoid", (1, 1), _float_meta, _run_sigmoid, doc="1 / (1 + exp(-x))"))


def _run_gelu(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    x, out = ins[0], outs[0]
    c = math.sqrt(2.0 / math.pi)
    inner = c * (x + 0.044715 * x * x * x)
    out[...] = 0.5 * x * (1.0 + xp.tanh(inner))


_register(Op("gelu", (1, 1), _float_meta, _run_gelu, doc="GELU, tanh approximation"))


def _relu_grad_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (gs, gd), (xs, _) = ins
    if gs != xs:
        raise OpError(f"relu_grad needs equal shapes, got {gs} and {xs}")
    return [(gs, gd)]


def _run_relu_grad(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    grad, x = ins
    xp.multiply(grad, x > 0, out=outs[0])


_register(Op("relu_grad", (2, 2), _relu_grad_meta, _run_relu_grad, doc="grad * (x > 0)"))


def _where_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (cs, cd), (as_, ad), (bs, bd) = ins
    if cd != np.bool_:
        raise OpError(f"where needs a bool condition, got {cd}")
    return [(_broadcast([cs, as_, bs]), np.result_type(ad, bd))]


def _run_where(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    outs[0][...] = xp.where(*ins)


_register(Op("where", (3, 3), _where_meta, _run_where, doc="cond ? a : b"))


def _axpy_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (xs, xd), (ys, yd) = ins
    _scalar(params, "alpha")
    if xs != ys or xd != yd:
        raise OpError(f"axpy needs x and y of one shape and dtype, got {xs}/{xd} and {ys}/{yd}")
    return [(ys, yd)]


def _run_axpy(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    x, y = ins
    # one temporary; correct whether or not the output is y's memory
    xp.add(y, xp.multiply(x, params["alpha"]), out=outs[0])


_register(Op("axpy", (2, 2), _axpy_meta, _run_axpy, ("alpha",), "alpha * x + y, fused"))


def _astype_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, _),) = ins
    from .protocol import DTYPES

    name = params.get("dtype")
    if name is None:
        return [ins[0]]
    if name not in DTYPES:
        raise OpError(f"unsupported dtype {name!r}")
    return [(shape, DTYPES[name])]


def _run_copy(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    outs[0][...] = ins[0]


_register(Op("copy", (1, 1), _astype_meta, _run_copy, ("dtype",), "copy, optionally casting"))


def _fill_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    from .protocol import DTYPES

    _scalar(params, "value")
    shape, dtype = params.get("shape"), params.get("dtype")
    if type(shape) is not list or dtype not in DTYPES:
        raise OpError("fill needs params shape (list of ints) and dtype")
    return [(tuple(shape), DTYPES[dtype])]


def _run_fill(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    outs[0].fill(params["value"])


_register(Op("fill", (0, 0), _fill_meta, _run_fill, ("value", "shape", "dtype"), "fill"))


# -- linear algebra ---------------------------------------------------------------------------
def matmul_shape(a: Shape, b: Shape) -> Shape:
    """The shape of ``a @ b`` (NumPy's and the array API's rules); ``OpError`` if none."""
    if not a or not b:
        raise OpError("matmul does not take 0-d arrays")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise OpError(f"matmul: shapes {a} and {b} are not aligned ({a2[-1]} != {b2[-2]})")
    shape = (*_broadcast([a2[:-2], b2[:-2]]), a2[-2], b2[-1])
    if len(a) == 1:
        shape = shape[:-2] + shape[-1:]
    if len(b) == 1:
        shape = shape[:-1]
    return shape


def _matmul_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (a, ad), (b, bd) = ins
    return [(matmul_shape(a, b), _ufunc_dtype("matmul", (ad, bd)))]


def _run_matmul(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    out = outs[0]
    if out.ndim == 0:
        out[...] = xp.matmul(ins[0], ins[1])
    else:
        xp.matmul(ins[0], ins[1], out=out)


_register(Op("matmul", (2, 2), _matmul_meta, _run_matmul, doc="matrix product"))


def _transpose_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    axes = params.get("axes")
    if axes is None:
        return [(shape[::-1], dt)]
    if sorted(axes) != list(range(len(shape))):
        raise OpError(f"axes {axes} are not a permutation of {len(shape)} dimensions")
    return [(tuple(shape[i] for i in axes), dt)]


def _run_transpose(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    outs[0][...] = xp.transpose(ins[0], params.get("axes"))


_register(Op("transpose", (1, 1), _transpose_meta, _run_transpose, ("axes",), "permute axes"))


# -- reductions -------------------------------------------------------------------------------
def _reduce(name: str, *, float_result: bool = False) -> Op:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        axis = _axis(params, len(shape))
        keep = bool(params.get("keepdims", False))
        if name == "max" and math.prod(shape) == 0:
            raise OpError("max of an empty array")
        if axis is None:
            out_shape: Shape = (1,) * len(shape) if keep else ()
        elif keep:
            out_shape = (*shape[:axis], 1, *shape[axis + 1 :])
        else:
            out_shape = shape[:axis] + shape[axis + 1 :]
        if float_result:
            odt = np.result_type(dt, np.float64) if dt.kind in "biu" else dt
        elif name == "sum":
            odt = np.sum(np.zeros(1, dt)).dtype
        else:
            odt = dt
        return [(out_shape, np.dtype(odt))]

    def run(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
        axis = _axis(params, ins[0].ndim)
        keep = bool(params.get("keepdims", False))
        getattr(xp, name)(ins[0], axis=axis, keepdims=keep, out=outs[0])

    return _register(Op(name, (1, 1), meta, run, ("axis", "keepdims"), f"{name} along an axis"))


_reduce("sum")
_reduce("mean", float_result=True)
_reduce("max")


def _softmax_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    if dt.kind not in "f":
        raise OpError(f"softmax needs a floating-point input, got {dt}")
    if not shape:
        raise OpError("softmax needs at least one dimension")
    _axis(params, len(shape), -1)
    return [(shape, dt)]


def _run_softmax(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    x, out = ins[0], outs[0]
    axis = _axis(params, x.ndim, -1)
    m = x.max(axis=axis, keepdims=True)
    xp.subtract(x, m, out=out)
    xp.exp(out, out=out)
    xp.divide(out, out.sum(axis=axis, keepdims=True), out=out)


_register(Op("softmax", (1, 1), _softmax_meta, _run_softmax, ("axis",), "softmax along an axis"))


def _layer_norm_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), *affine = ins
    if dt.kind != "f" or not shape:
        raise OpError("layer_norm needs a floating-point input of at least one dimension")
    for s, d in affine:
        if s != shape[-1:] or d != dt:
            raise OpError(f"layer_norm weight and bias must have shape {shape[-1:]} and dtype {dt}")
    if "eps" in params:
        _scalar(params, "eps")
    return [(shape, dt)]


def _run_layer_norm(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    x, out = ins[0], outs[0]
    eps = params.get("eps", 1e-5)
    mu = x.mean(axis=-1, keepdims=True)
    xp.subtract(x, mu, out=out)
    var = (out * out).mean(axis=-1, keepdims=True)
    out /= xp.sqrt(var + eps)
    if len(ins) >= 2:
        out *= ins[1]
    if len(ins) == 3:
        out += ins[2]


_register(
    Op("layer_norm", (1, 3), _layer_norm_meta, _run_layer_norm, ("eps",), "layer norm, last axis")
)


# the array API standard's functions ("xp.<name>"), registered into OPS
from . import apiops as _apiops  # noqa: E402, F401
