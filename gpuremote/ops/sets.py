"""The standard's set functions (``unique_*`` have data-dependent shapes: ``launch_dynamic``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._base import BOOL, Meta, OpList, Params, check, method

__all__ = ["OPS"]

OPS = OpList()


def _isin_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (_, d2) = ins
    check("isin", d1, "integer")
    check("isin", d2, "integer")
    return [(s1, BOOL)]


def _isin_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    xp = ns
    return xp.isin(ins[0], ins[1], invert=bool(params.get("invert", False)))


OPS.add("isin", (2, 2), _isin_meta, _isin_call, ("invert",))


def _no_meta(category: str, nin: int = 1) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        for _, dtype in ins[:nin]:
            check("this function", dtype, category)
        return []

    return meta


for _name in ("unique_all", "unique_counts", "unique_inverse", "unique_values"):
    OPS.add(
        _name,
        (1, 1),
        _no_meta("all"),
        method(_name),
        dynamic=True,
    )
