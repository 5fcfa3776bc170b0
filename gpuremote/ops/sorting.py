"""The standard's sorting functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ._base import INT64, Meta, OpError, OpList, Params, check, method, one_axis

__all__ = ["OPS"]

OPS = OpList()


def _sort_meta(name: str) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        ((shape, dt),) = ins
        check(name, dt, "real numeric")
        if not shape:
            raise OpError(f"{name} needs at least one dimension")
        one_axis(name, params.get("axis", -1), len(shape))
        return [(shape, INT64 if name == "argsort" else dt)]

    return meta


for _name in ("sort", "argsort"):
    OPS.add(
        _name,
        (1, 1),
        _sort_meta(_name),
        method(_name, "axis", "descending", "stable"),
        ("axis", "descending", "stable"),
    )
