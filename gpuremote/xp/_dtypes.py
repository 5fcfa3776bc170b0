"""The data types of ``gpuremote.xp``: objects of its own, one per supported dtype.

Each wraps a NumPy dtype (``.dtype``), so NumPy accepts it wherever it takes a dtype
(``np.zeros(3, dtype=xp.float32)``) and it compares equal to the NumPy dtype and scalar type
of the same name (``x.dtype == np.float32``). Unlike a NumPy dtype it equals nothing else:
``np.dtype(None)`` is float64, so ``None == np.float64`` holds, while ``None == xp.float64``
does not, as the standard's tests expect of a namespace's dtypes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..wire.protocol import DTYPES

__all__ = ["NAMED", "DType", "wrap"]


class DType:
    """One of the standard's data types (``name``, ``kind``, ``itemsize`` as NumPy's)."""

    __slots__ = ("dtype", "itemsize", "kind", "name")

    def __init__(self, dtype: np.dtype[Any]) -> None:
        self.dtype = dtype  # what NumPy reads in np.dtype(x)
        self.name = dtype.name
        self.kind = dtype.kind
        self.itemsize = dtype.itemsize

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return other.dtype is self.dtype or other.dtype == self.dtype
        if isinstance(other, np.dtype):
            return bool(other == self.dtype)
        if isinstance(other, type) and issubclass(other, np.generic):
            return bool(np.dtype(other) == self.dtype)
        return False

    def __hash__(self) -> int:
        return hash(self.dtype)

    def __repr__(self) -> str:
        return f"gpuremote.xp.{self.name}"

    def __str__(self) -> str:
        return self.name

    def __reduce__(self) -> tuple[Any, ...]:
        return (wrap, (self.dtype,))


NAMED: dict[str, DType] = {name: DType(np.dtype(name)) for name in DTYPES}
_BY_NUMPY: dict[np.dtype[Any], DType] = {d.dtype: d for d in NAMED.values()}


def wrap(dtype: np.dtype[Any]) -> DType:
    """The namespace's dtype for a (supported) NumPy dtype."""
    return _BY_NUMPY[dtype]
