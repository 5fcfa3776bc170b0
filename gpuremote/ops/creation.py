"""The standard's creation functions (on the device: no host data travels)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._base import INT64, Meta, OpError, OpList, Params, dtype_param, method, promote, shape_param

__all__ = ["OPS"]

OPS = OpList()


def _full_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    dt = dtype_param(params)
    if dt is None:
        raise OpError("full needs a dtype")
    if type(params.get("value")) not in (int, float, bool):
        raise OpError("full needs a numeric value")
    return [(shape_param(params), dt)]


def _full_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    value = params["value"]
    if params.get("imag"):
        value = complex(value, params["imag"])
    return value  # broadcast into the output by _write


OPS.add("full", (0, 0), _full_meta, _full_call, ("shape", "dtype", "value", "imag"))


def _arange_length(start: float, stop: float, step: float) -> int:
    if step == 0:
        raise OpError("arange: step must not be 0")
    return max(0, math.ceil((stop - start) / step))


def _arange_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    vals: list[Any] = [params.get(k) for k in ("start", "stop", "step")]
    if any(type(v) not in (int, float) for v in vals):
        raise OpError("arange needs numbers start, stop and step")
    dt = dtype_param(params)
    if dt is None:
        dt = INT64 if all(type(v) is int for v in vals) else np.dtype(np.float64)
    return [((_arange_length(*vals),), dt)]


def _arange_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    dt = dtype_param(params)
    return ns.arange(params["start"], params["stop"], params["step"], dtype=dt)


OPS.add("arange", (0, 0), _arange_meta, _arange_call, ("start", "stop", "step", "dtype"))


def _eye_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    n, m, k = params.get("n_rows"), params.get("n_cols"), params.get("k", 0)
    if type(n) is not int or type(m) is not int or type(k) is not int or n < 0 or m < 0:
        raise OpError("eye needs non-negative ints n_rows and n_cols and an int k")
    dt = dtype_param(params)
    return [((n, m), dt if dt is not None else np.dtype(np.float64))]


def _eye_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    return ns.eye(params["n_rows"], params["n_cols"], k=params.get("k", 0))


OPS.add("eye", (0, 0), _eye_meta, _eye_call, ("n_rows", "n_cols", "k", "dtype"))


def _linspace_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    num = params.get("num")
    if type(num) is not int or num < 0:
        raise OpError("linspace needs a non-negative int num")
    for k in ("start", "stop"):
        if type(params.get(k)) not in (int, float):
            raise OpError(f"linspace needs a real number {k}")
    dt = dtype_param(params)
    return [((num,), dt if dt is not None else np.dtype(np.float64))]


def _linspace_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    return ns.linspace(
        params["start"],
        params["stop"],
        params["num"],
        endpoint=bool(params.get("endpoint", True)),
        dtype=np.dtype(np.float64),
    )


OPS.add(
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
    OPS.add(
        _name,
        (1, 1),
        _tri_meta(_name),
        method(_name, "k"),
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


OPS.add(
    "meshgrid",
    (1, 64),
    _meshgrid_meta,
    lambda ns, ins, p: tuple(ns.meshgrid(*ins, indexing=p.get("indexing", "xy"))),
    ("indexing",),
)
