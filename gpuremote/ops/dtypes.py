"""The standard's data type functions that run on the device."""

from __future__ import annotations

from collections.abc import Sequence

from ._base import Meta, OpError, OpList, Params, dtype_param

__all__ = ["OPS"]

OPS = OpList()


def _astype_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, _),) = ins
    dt = dtype_param(params)
    if dt is None:
        raise OpError("astype needs a dtype")
    return [(shape, dt)]


OPS.add("astype", (1, 1), _astype_meta, lambda ns, ins, p: ins[0], ("dtype",))
