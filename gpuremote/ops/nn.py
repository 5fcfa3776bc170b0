"""gpuremote's own ops beyond the standard: the activations and fused layers that neural
network code runs, each one launch where composing standard functions would take several.

Their inputs follow the standard's rules (floating-point inputs where the maths needs them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ._base import Meta, Op, OpError, OpList, Params, check, number, one_axis

__all__ = ["OPS"]

OPS = OpList()


def _same_float(name: str) -> Any:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        check(name, dt, "real floating-point")
        return [(shape, dt)]

    return meta


def _run_relu(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    xp.maximum(ins[0], ins[0].dtype.type(0), out=outs[0])


def _relu_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    check("relu", dt, "real numeric")
    return [(shape, dt)]


def _run_sigmoid(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    out = outs[0]
    xp.negative(ins[0], out=out)
    xp.exp(out, out=out)
    xp.add(out, out.dtype.type(1), out=out)
    xp.reciprocal(out, out=out)


def _run_gelu(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    x, out = ins[0], outs[0]
    t = x.dtype.type
    inner = t(math.sqrt(2.0 / math.pi)) * (x + t(0.044715) * x * x * x)
    out[...] = t(0.5) * x * (t(1.0) + xp.tanh(inner))


def _relu_grad_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (gs, gd), (xs, xd) = ins
    check("relu_grad", gd, "real floating-point")
    check("relu_grad", xd, "real numeric")
    if gs != xs:
        raise OpError(f"relu_grad needs equal shapes, got {gs} and {xs}")
    return [(gs, gd)]


def _run_relu_grad(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    grad, x = ins
    xp.multiply(grad, x > 0, out=outs[0])


def _axpy_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (xs, xd), (ys, yd) = ins
    check("axpy", xd, "floating-point")
    number(params, "alpha")
    if xs != ys or xd != yd:
        raise OpError(f"axpy needs x and y of one shape and dtype, got {xs}/{xd} and {ys}/{yd}")
    return [(ys, yd)]


def _run_axpy(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    x, y = ins
    # one temporary; correct whether or not the output is y's memory
    xp.add(y, xp.multiply(x, x.dtype.type(params["alpha"])), out=outs[0])


def _softmax_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    check("softmax", dt, "real floating-point")
    if not shape:
        raise OpError("softmax needs at least one dimension")
    one_axis("softmax", params.get("axis", -1), len(shape))
    return [(shape, dt)]


def _run_softmax(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    x, out = ins[0], outs[0]
    axis = params.get("axis", -1)
    m = x.max(axis=axis, keepdims=True)
    xp.subtract(x, m, out=out)
    xp.exp(out, out=out)
    xp.divide(out, out.sum(axis=axis, keepdims=True), out=out)


def _layer_norm_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (shape, dt), *affine = ins
    check("layer_norm", dt, "real floating-point")
    if not shape:
        raise OpError("layer_norm needs at least one dimension")
    for s, d in affine:
        if s != shape[-1:] or d != dt:
            raise OpError(f"layer_norm weight and bias must have shape {shape[-1:]} and dtype {dt}")
    if "eps" in params:
        number(params, "eps")
    return [(shape, dt)]


def _run_layer_norm(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    x, out = ins[0], outs[0]
    eps = x.dtype.type(params.get("eps", 1e-5))
    mu = x.mean(axis=-1, keepdims=True)
    xp.subtract(x, mu, out=out)
    var = (out * out).mean(axis=-1, keepdims=True)
    out /= xp.sqrt(var + eps)
    if len(ins) >= 2:
        out *= ins[1]
    if len(ins) == 3:
        out += ins[2]


OPS.extend(
    [
        Op("relu", (1, 1), _relu_meta, _run_relu, doc="max(x, 0)"),
        Op("sigmoid", (1, 1), _same_float("sigmoid"), _run_sigmoid, doc="1 / (1 + exp(-x))"),
        Op("gelu", (1, 1), _same_float("gelu"), _run_gelu, doc="GELU, tanh approximation"),
        Op("relu_grad", (2, 2), _relu_grad_meta, _run_relu_grad, doc="grad * (x > 0)"),
        Op("axpy", (2, 2), _axpy_meta, _run_axpy, ("alpha",), "alpha * x + y, fused"),
        Op("softmax", (1, 1), _softmax_meta, _run_softmax, ("axis",), "softmax along an axis"),
        Op(
            "layer_norm",
            (1, 3),
            _layer_norm_meta,
            _run_layer_norm,
            ("eps",),
            "layer norm over the last axis",
        ),
    ]
)
