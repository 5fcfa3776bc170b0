"""The array object of ``gpuremote.xp``: a C-contiguous array in a proxy buffer.

Its metadata (``shape``, ``dtype``, ``device``, ...) is local; operators post ASYNC calls and
return new arrays at once; only conversions to host values (``bool()``, ``float()``,
``np.asarray``, ``__dlpack__``, ``to_device("cpu")``) wait for data.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..core.arrays import BINARY_OPERATORS, COMPARISONS, UNARY_OPERATORS, ArrayRef, fill_param
from ._dtypes import DType, wrap

__all__ = ["Array", "encode_index"]


def encode_index(key: Any, shape: tuple[int, ...]) -> tuple[list[int], tuple[int, ...]]:
    """A basic index (ints, slices, ``None``, ``...``) as the flat int list of the ``getitem``
    op, and the shape it selects; raises ``IndexError`` for what the standard does not allow."""
    items = key if isinstance(key, tuple) else (key,)
    if sum(1 for it in items if it is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
    if consumed > len(shape):
        raise IndexError(f"too many indices ({consumed}) for an array of {len(shape)} dimensions")
    flat: list[int] = []
    out: list[int] = []
    dim = 0
    for it in items:
        if it is Ellipsis:
            for _ in range(len(shape) - consumed):
                flat += [1, 0, shape[dim], 1]
                out.append(shape[dim])
                dim += 1
        elif it is None:
            flat += [2, 0, 0, 0]
            out.append(1)
        elif isinstance(it, slice):
            n = shape[dim]
            start, stop, step = it.indices(n)
            count = len(range(start, stop, step))
            flat += [1, start if count else 0, count, step]
            out.append(count)
            dim += 1
        elif isinstance(it, bool | np.bool_) or not hasattr(it, "__index__"):
            raise IndexError(f"unsupported index {it!r}: use ints, slices, None, ... or an array")
        else:
            n, i = shape[dim], operator.index(it)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for a dimension of {n}")
            flat += [0, i % n, 0, 0]
            dim += 1
    return flat, (*out, *shape[dim:])


def _binary(name: str, how: str = "") -> Callable[[Array, Any], Array]:
    """The method of binary operator ``__name__`` (``how``: ``"r"`` reflected, ``"i"`` in
    place): the op the core's tables give it, on the default stream, with no host data."""
    op = BINARY_OPERATORS.get(name) or COMPARISONS[name]
    if how == "r":

        def method(self: Array, other: Any) -> Array:
            return self._core.apply(op, (other, self), {}, None, 0, False)

    elif how == "i":

        def method(self: Array, other: Any) -> Array:
            return self._core.apply(op, (self, other), {}, self, 0, False)

    else:

        def method(self: Array, other: Any) -> Array:
            return self._core.apply(op, (self, other), {}, None, 0, False)

    method.__name__ = f"__{how}{name}__"
    return method


def _unary(name: str) -> Callable[[Array], Array]:
    """The method of unary operator ``__name__``."""
    op = UNARY_OPERATORS[name]

    def method(self: Array) -> Array:
        return self._core.apply(op, (self,), {}, None, 0, False)

    method.__name__ = f"__{name}__"
    return method


class Array(ArrayRef):
    """An array on a gpuremote device (the array core's, ``gpuremote.core.arrays``); see the
    module docstring."""

    __slots__ = ()
    __array_ufunc__ = None  # NumPy operators defer to ours (no silent download)
    __hash__ = None  # type: ignore[assignment]

    @property
    def _device(self) -> Any:  # the Device (``_device`` imports this module)
        return self._core.owner

    @property
    def dtype(self) -> DType:
        """The data type (one of the namespace's, such as ``xp.float32``)."""
        return wrap(self._dtype)

    # -- metadata (local; ndim, size and nbytes come from ArrayMetadata) ---------------------
    @property
    def device(self) -> Any:
        """The device the array lives on."""
        return self._device

    @property
    def T(self) -> Array:
        """The transpose of a 2-D array."""
        if self.ndim != 2:
            raise ValueError(f".T needs a 2-D array, got {self.ndim} dimensions (use .mT)")
        return self.mT

    @property
    def mT(self) -> Array:
        """The last two axes swapped."""
        out: Array = self._core.launch("matrix_transpose", [self], {})[0]
        return out

    def __array_namespace__(self, api_version: str | None = None) -> Any:
        if api_version not in (None, "2023.12", "2024.12"):
            raise ValueError(f"gpuremote.xp implements the array API 2024.12, not {api_version}")
        return sys.modules["gpuremote.xp"]

    def __repr__(self) -> str:
        return f"Array(shape={self.shape}, dtype={self.dtype}, device={self._device.url})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __iter__(self) -> Iterator[Array]:
        for i in range(len(self)):
            yield self[i]

    # -- data (these wait for the device) --------------------------------------------------
    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        host = self._device.fetch(self)
        return host if dtype is None else host.astype(dtype)

    def to_device(self, device: Any, /, *, stream: Any = None) -> Any:
        """``"cpu"``: a NumPy array of the data; another device: a copy on it."""
        if device == "cpu":
            return self._device.fetch(self)
        if device is self._device:
            return self
        copy_from = getattr(device, "copy_from", None)
        if copy_from is None:
            raise ValueError(f"{device!r} is not a gpuremote.xp device")
        return copy_from(self)

    def __dlpack__(
        self,
        /,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """Export to the host: the data is downloaded once, and DLPack consumers get that host
        memory (``copy`` applies to it: ``False`` shares it, ``True`` copies it again)."""
        host = self._device.fetch(self)
        kwargs = {"stream": stream, "max_version": max_version, "dl_device": dl_device}
        if copy is not None:
            kwargs["copy"] = copy
        return host.__dlpack__(**{k: v for k, v in kwargs.items() if v is not None})

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU: __dlpack__ hands out a host copy

    def _scalar(self, what: str) -> Any:
        if self.size != 1:
            raise TypeError(f"only arrays of one element can be converted to {what}")
        return self._device.fetch(self).reshape(()).item()

    def __bool__(self) -> bool:
        return bool(self._scalar("bool"))

    def __int__(self) -> int:
        if self._dtype.kind == "c":
            raise TypeError("int() of a complex array")
        return int(self._scalar("int"))

    def __float__(self) -> float:
        if self._dtype.kind == "c":
            raise TypeError("float() of a complex array")
        return float(self._scalar("float"))

    def __complex__(self) -> complex:
        return complex(self._scalar("complex"))

    def __index__(self) -> int:
        if self._dtype.kind not in "iu":
            raise TypeError(f"only integer arrays can be used as an index, not {self.dtype}")
        return int(self._scalar("an index"))

    # -- indexing --------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> Array:
        if isinstance(key, Array):
            if key._dtype.kind == "b":
                return self._getitem_mask(key)
            return self._device.launch("getitem_int", [self, key], {})[0]
        if isinstance(key, tuple) and any(isinstance(k, Array) for k in key):
            return self._getitem_arrays(key)
        flat, _ = encode_index(key, self.shape)
        return self._device.launch("getitem", [self], {"index": flat})[0]

    def _getitem_mask(self, key: Array) -> Array:
        """``x[mask]``: the elements where a boolean array is true (a data-dependent shape)."""
        if key.ndim > self.ndim or not all(
            k in (s, 0) for s, k in zip(self.shape, key.shape, strict=False)
        ):
            raise IndexError(
                f"a boolean index of shape {key.shape} does not fit an array of {self.shape}"
            )
        if 0 in key.shape:  # selects nothing: no round trip
            return self._device.empty((0, *self.shape[key.ndim :]), self._dtype)
        return self._device.launch_dynamic("getitem_mask", [self, key], {}, 1)[0]

    def _getitem_arrays(self, key: tuple[Any, ...]) -> Array:
        """``x[i, idx, ...]``: integers and integer arrays, one per leading axis."""
        if len(key) > self.ndim:
            raise IndexError(f"too many indices ({len(key)}) for an array of {self.ndim} dims")
        ints: list[int] = []
        at: list[int] = []
        arrays: list[Array] = []
        for axis, k in enumerate(key):
            if isinstance(k, Array):
                at.append(axis)
                arrays.append(k)
                ints.append(0)
            elif isinstance(k, bool | np.bool_) or not hasattr(k, "__index__"):
                raise IndexError(
                    f"unsupported index {k!r} beside an integer array: use ints and arrays"
                )
            else:
                ints.append(operator.index(k))
        return self._device.launch(
            "getitem_arrays", [self, *arrays], {"ints": ints, "arrays_at": at}
        )[0]

    def __setitem__(self, key: Any, value: Any) -> None:
        dev = self._device
        arrays = [self]
        params: dict[str, Any] = {}
        if isinstance(key, Array):
            if key._dtype.kind != "b":
                raise IndexError("only boolean arrays can index an assignment")
            arrays.append(key)
            params["mask"] = True
        else:
            params["index"] = encode_index(key, self.shape)[0]
        if isinstance(value, Array):
            arrays.append(value)
        elif type(value) in (bool, int, float) or isinstance(value, np.generic):
            v = value.item() if isinstance(value, np.generic) else value
            if type(v) is complex:
                arrays.append(dev.upload(np.asarray(v, dtype=self._dtype)))
            else:
                params["scalar"] = fill_param(self._dtype, v)
        else:
            arrays.append(dev.upload(np.asarray(value, dtype=self._dtype)))
        dev.launch("setitem", arrays, params, into=self)

    # -- operators (generated from the core's tables: ``_binary``, ``_unary``) ---------------
    __add__, __radd__, __iadd__ = _binary("add"), _binary("add", "r"), _binary("add", "i")
    __sub__, __rsub__, __isub__ = _binary("sub"), _binary("sub", "r"), _binary("sub", "i")
    __mul__, __rmul__, __imul__ = _binary("mul"), _binary("mul", "r"), _binary("mul", "i")
    __truediv__ = _binary("truediv")
    __rtruediv__, __itruediv__ = _binary("truediv", "r"), _binary("truediv", "i")
    __floordiv__ = _binary("floordiv")
    __rfloordiv__, __ifloordiv__ = _binary("floordiv", "r"), _binary("floordiv", "i")
    __mod__, __rmod__, __imod__ = _binary("mod"), _binary("mod", "r"), _binary("mod", "i")
    __pow__, __rpow__, __ipow__ = _binary("pow"), _binary("pow", "r"), _binary("pow", "i")
    __matmul__ = _binary("matmul")
    __rmatmul__, __imatmul__ = _binary("matmul", "r"), _binary("matmul", "i")
    __and__, __rand__, __iand__ = _binary("and"), _binary("and", "r"), _binary("and", "i")
    __or__, __ror__, __ior__ = _binary("or"), _binary("or", "r"), _binary("or", "i")
    __xor__, __rxor__, __ixor__ = _binary("xor"), _binary("xor", "r"), _binary("xor", "i")
    __lshift__ = _binary("lshift")
    __rlshift__, __ilshift__ = _binary("lshift", "r"), _binary("lshift", "i")
    __rshift__ = _binary("rshift")
    __rrshift__, __irshift__ = _binary("rshift", "r"), _binary("rshift", "i")
    __eq__ = _binary("eq")  # type: ignore[assignment]  # elementwise, as the standard says
    __ne__ = _binary("ne")  # type: ignore[assignment]
    __lt__, __le__ = _binary("lt"), _binary("le")
    __gt__, __ge__ = _binary("gt"), _binary("ge")
    __neg__, __pos__ = _unary("neg"), _unary("pos")
    __abs__, __invert__ = _unary("abs"), _unary("invert")

    def reshape(self, *shape: Any) -> Array:
        """A view with another shape (local: our arrays are contiguous)."""
        dims = shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape
        out: Array = self._core.reshape(self, dims)
        return out
