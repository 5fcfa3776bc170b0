"""The standard's searching functions (``where``, ``searchsorted``, ``nonzero``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._base import (
    INT64,
    Meta,
    OpError,
    OpList,
    OpTypeError,
    Params,
    broadcast,
    check,
    promote,
    scalar_dtype,
)
from .elementwise import binary_inputs

__all__ = ["OPS"]

OPS = OpList()


def _where_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (cs, cd), *rest = ins
    if cd.kind != "b":
        raise OpTypeError(f"where needs a bool condition, got {cd}")
    if len(rest) == 2:
        (s1, d1), (s2, d2) = rest
        return [(broadcast([cs, s1, s2]), promote(d1, d2))]
    if len(rest) != 1 or "scalar" not in params:
        raise OpError("where takes a condition and two arrays, or one array and the scalar param")
    ((s1, d1),) = rest
    return [(broadcast([cs, s1]), scalar_dtype(d1, params["scalar"]))]


def _where_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    cond, *rest = ins
    if len(rest) == 2:
        dt = promote(rest[0].dtype, rest[1].dtype)
        return ns.where(cond, ns.astype(rest[0], dt), ns.astype(rest[1], dt))
    a, b = binary_inputs(ns, rest, params, rest[0].dtype)
    return ns.where(cond, a, b)


OPS.add("where", (2, 3), _where_meta, _where_call, ("scalar", "reverse"))


def _searchsorted_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2), *sorter = ins
    check("searchsorted", d1, "real numeric")
    check("searchsorted", d2, "real numeric")
    if len(s1) != 1:
        raise OpError("searchsorted needs a 1-D sorted array")
    if params.get("side", "left") not in ("left", "right"):
        raise OpError("searchsorted: side must be 'left' or 'right'")
    if sorter and (sorter[0][0] != s1 or sorter[0][1].kind not in "iu"):
        raise OpError("searchsorted: sorter must be integer indices of x1's shape")
    promote(d1, d2)
    return [(s2, INT64)]


def _searchsorted_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    x1, x2, *sorter = ins
    dt = promote(x1.dtype, x2.dtype)
    return ns.searchsorted(
        ns.astype(x1, dt),
        ns.astype(x2, dt),
        side=params.get("side", "left"),
        sorter=sorter[0] if sorter else None,
    )


OPS.add("searchsorted", (2, 3), _searchsorted_meta, _searchsorted_call, ("side",))


def _nonzero_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, _),) = ins
    if not shape:
        raise OpError("nonzero does not take 0-d arrays")
    return []


OPS.add(
    "nonzero", (1, 1), _nonzero_meta, lambda ns, ins, p: tuple(ns.nonzero(ins[0])), dynamic=True
)
