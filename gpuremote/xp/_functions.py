"""The functions of the ``gpuremote.xp`` namespace (array API standard 2024.12).

Every function that returns arrays posts one ASYNC launch (plus an ASYNC alloc per output)
and returns at once with arrays whose shape and dtype were computed locally. Functions whose
output shape depends on the data (``nonzero``, ``unique_*``) make one SYNC call.
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core.arrays import fill_param, scalar_param
from ..ops import promote, scalar_dtype
from ..ops.elementwise import BINARY as _BINARY
from ..ops.elementwise import UNARY as _UNARY
from ..wire.protocol import DTYPES
from ._array import Array
from ._device import Device, default_device
from ._dtypes import DType, wrap

_PY_SCALARS = (builtins.bool, int, float, complex)


# -- helpers ----------------------------------------------------------------------------------
def _dt(dtype: Any) -> np.dtype[Any]:
    if isinstance(dtype, DType):
        return dtype.dtype
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise TypeError(f"dtype {dt} is not supported by gpuremote.xp")
    return dt


def _dtype_param(dtype: Any) -> str | None:
    return None if dtype is None else _dt(dtype).name


def _dev(device: Any, *arrays: Any) -> Device:
    if device is not None:
        if not isinstance(device, Device):
            raise ValueError(f"{device!r} is not a gpuremote.xp device")
        return device
    for a in arrays:
        if isinstance(a, Array):
            return a._device
    return default_device()


def _axis(axis: Any) -> Any:
    if axis is None or isinstance(axis, int):
        return None if axis is None else operator.index(axis)
    return [operator.index(a) for a in axis]


def _array_like(x: Any, like: Array) -> Array:
    """``x`` as an array on ``like``'s device (a scalar takes the dtype the standard gives
    it; host data is uploaded)."""
    if isinstance(x, Array):
        return x
    arrays: list[Array] = like._core.operands("asarray", [like, x], {}, host=False)
    return arrays[1]


def _unary(name: str, x: Any, into: Array | None = None) -> Array:
    if not isinstance(x, Array):
        raise TypeError(f"{name} takes an array, got {type(x).__name__}")
    return x._core.launch(name, [x], {}, None if into is None else [into])[0]


def _binary(name: str, x1: Any, x2: Any, into: Array | None = None) -> Array:
    """``name(x1, x2)``: two arrays, or an array and a Python scalar (the array core's rule:
    the scalar takes the array's dtype, as the standard says)."""
    like = x1 if isinstance(x1, Array) else x2
    if not isinstance(like, Array):
        raise TypeError(f"{name} needs at least one array argument")
    out: Array = like._core.apply(name, (x1, x2), {}, into, host=False)
    return out


def _one(name: str, x: Array, **params: Any) -> Array:
    if not isinstance(x, Array):
        raise TypeError(f"{name} takes an array, got {type(x).__name__}")
    return x._core.launch(name, [x], params)[0]


def _make_unary(name: str) -> Any:
    def fn(x: Array, /) -> Array:
        return _unary(name, x)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"Element-wise ``{name}`` (array API)."
    return fn


def _make_binary(name: str) -> Any:
    def fn(x1: Any, x2: Any, /) -> Array:
        return _binary(name, x1, x2)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"Element-wise ``{name}`` (array API); either argument may be a Python scalar."
    return fn


ELEMENTWISE: dict[str, Any] = {n: _make_unary(n) for n in _UNARY}
ELEMENTWISE.update({n: _make_binary(n) for n in _BINARY})


def clip(x: Array, /, min: Any = None, max: Any = None) -> Array:
    """Clamp ``x`` to ``[min, max]``; bounds are scalars or arrays."""
    arrays = [x]
    params: dict[str, Any] = {}
    for key, bound in (("min", min), ("max", max)):
        if isinstance(bound, Array):
            arrays.append(bound)
            params[f"n_{key}"] = 1
        elif bound is not None:
            params[key] = fill_param(x._dtype, bound)
    return x._core.launch("clip", arrays, params)[0]


# -- creation ---------------------------------------------------------------------------------
def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, int):
        return (operator.index(shape),)
    return tuple(operator.index(d) for d in shape)


def _default_dtype(value: Any) -> np.dtype[Any]:
    if isinstance(value, builtins.bool | np.bool_):
        return np.dtype(np.bool_)
    if isinstance(value, int):
        return np.dtype(np.int64)
    if isinstance(value, complex):
        return np.dtype(np.complex128)
    if isinstance(value, np.generic):
        return value.dtype
    return np.dtype(np.float64)


def asarray(
    obj: Any, /, *, dtype: Any = None, device: Any = None, copy: builtins.bool | None = None
) -> Array:
    """An array from ``obj`` (an array, a scalar, a nested sequence, or any host array or
    buffer); host data is copied at once and uploaded ASYNC."""
    if isinstance(obj, Array):
        out = obj
        if device is not None and device is not obj._device:
            if copy is False:
                raise ValueError("asarray(copy=False) cannot move an array to another device")
            out = obj.to_device(device)
        if dtype is not None and _dt(dtype) != out._dtype:
            if copy is False:
                raise ValueError("asarray(copy=False) cannot change the dtype")
            return astype(out, dtype)
        return astype(out, out._dtype, copy=True) if copy and out is obj else out
    if copy is False:
        raise ValueError("asarray(copy=False) of host data would need a copy to the device")
    dev = _dev(device)
    if dtype is None and isinstance(obj, _PY_SCALARS):
        dtype = _default_dtype(obj)
    host = np.asarray(obj, dtype=None if dtype is None else _dt(dtype))
    if host.dtype == np.float16 and dtype is None:
        host = host.astype(np.float32)
    return dev.upload(host)


def empty(shape: Any, *, dtype: Any = None, device: Any = None) -> Array:
    """An uninitialised array (one ASYNC alloc)."""
    return _dev(device).empty(_shape(shape), _dt(dtype or np.float64))


def full(shape: Any, fill_value: Any, *, dtype: Any = None, device: Any = None) -> Array:
    """An array of ``fill_value``."""
    dt = _dt(dtype) if dtype is not None else _default_dtype(fill_value)
    v = fill_param(dt, fill_value)
    params: dict[str, Any] = {"shape": list(_shape(shape)), "dtype": dt.name}
    if isinstance(v, complex):
        params.update(value=v.real, imag=v.imag)
    else:
        params["value"] = v
    return _dev(device).core.launch("full", [], params)[0]


def zeros(shape: Any, *, dtype: Any = None, device: Any = None) -> Array:
    """An array of zeros."""
    return full(shape, 0, dtype=dtype or np.float64, device=device)


def ones(shape: Any, *, dtype: Any = None, device: Any = None) -> Array:
    """An array of ones."""
    return full(shape, 1, dtype=dtype or np.float64, device=device)


def empty_like(x: Array, /, *, dtype: Any = None, device: Any = None) -> Array:
    """An uninitialised array of ``x``'s shape (and dtype, unless given)."""
    return empty(x.shape, dtype=dtype or x._dtype, device=_dev(device, x))


def zeros_like(x: Array, /, *, dtype: Any = None, device: Any = None) -> Array:
    """Zeros of ``x``'s shape (and dtype, unless given)."""
    return full(x.shape, 0, dtype=dtype or x._dtype, device=_dev(device, x))


def ones_like(x: Array, /, *, dtype: Any = None, device: Any = None) -> Array:
    """Ones of ``x``'s shape (and dtype, unless given)."""
    return full(x.shape, 1, dtype=dtype or x._dtype, device=_dev(device, x))


def full_like(x: Array, /, fill_value: Any, *, dtype: Any = None, device: Any = None) -> Array:
    """``fill_value`` in ``x``'s shape (and dtype, unless given)."""
    return full(x.shape, fill_value, dtype=dtype or x._dtype, device=_dev(device, x))


def arange(
    start: Any, /, stop: Any = None, step: Any = 1, *, dtype: Any = None, device: Any = None
) -> Array:
    """Evenly spaced values in ``[start, stop)``."""
    if stop is None:
        start, stop = 0, start
    params = {"start": start, "stop": stop, "step": step, "dtype": _dtype_param(dtype)}
    return _dev(device).core.launch("arange", [], params)[0]


def eye(
    n_rows: int,
    n_cols: int | None = None,
    /,
    *,
    k: int = 0,
    dtype: Any = None,
    device: Any = None,
) -> Array:
    """A 2-D array with ones on diagonal ``k``."""
    params = {
        "n_rows": n_rows,
        "n_cols": n_rows if n_cols is None else n_cols,
        "k": k,
        "dtype": _dtype_param(dtype),
    }
    return _dev(device).core.launch("eye", [], params)[0]


def linspace(
    start: Any,
    stop: Any,
    /,
    num: int,
    *,
    dtype: Any = None,
    device: Any = None,
    endpoint: builtins.bool = True,
) -> Array:
    """``num`` evenly spaced values from ``start`` to ``stop``."""
    if isinstance(start, complex) or isinstance(stop, complex):
        raise TypeError("gpuremote.xp.linspace supports real start and stop only")
    params = {
        "start": start,
        "stop": stop,
        "num": num,
        "endpoint": endpoint,
        "dtype": _dtype_param(dtype),
    }
    return _dev(device).core.launch("linspace", [], params)[0]


def meshgrid(*arrays: Array, indexing: str = "xy") -> list[Array]:
    """Coordinate grids from 1-D arrays (``indexing`` ``'xy'`` or ``'ij'``)."""
    if not arrays:
        return []
    return arrays[0]._core.launch("meshgrid", list(arrays), {"indexing": indexing})


def tril(x: Array, /, *, k: int = 0) -> Array:
    """The lower triangle (diagonal ``k`` and below) of the last two axes."""
    return _one("tril", x, k=k)


def triu(x: Array, /, *, k: int = 0) -> Array:
    """The upper triangle (diagonal ``k`` and above) of the last two axes."""
    return _one("triu", x, k=k)


def from_dlpack(x: Any, /, *, device: Any = None, copy: builtins.bool | None = None) -> Array:
    """An array from a DLPack producer (host memory), or a gpuremote array itself."""
    if isinstance(x, Array):
        return asarray(x, device=device, copy=copy)
    return _dev(device).upload(np.from_dlpack(x))


# -- data types (all local) -------------------------------------------------------------------
def astype(x: Array, dtype: Any, /, *, copy: builtins.bool = True, device: Any = None) -> Array:
    """``x`` cast to ``dtype`` (``x`` itself when the dtype matches and ``copy`` is false)."""
    dt = _dt(dtype)
    if device is not None and device is not x._device:
        x = x.to_device(device)
    if dt == x._dtype and not copy:
        return x
    return x._core.launch("astype", [x], {"dtype": dt.name})[0]


_GROUP = {"b": 0, "i": 1, "u": 1, "f": 2, "c": 3}


def _as_dtype(x: Any) -> np.dtype[Any]:
    return x._dtype if isinstance(x, Array) else _dt(x)


def can_cast(from_: Any, to: Any, /) -> builtins.bool:
    """Whether the standard's promotion rules allow casting ``from_`` to ``to`` (within a
    kind, or real floating to complex)."""
    a, b = _as_dtype(from_), _dt(to)
    if a == b:
        return True
    ga, gb = _GROUP[a.kind], _GROUP[b.kind]
    if ga != gb and not (ga == 2 and gb == 3):
        return False
    return builtins.bool(np.result_type(a, b) == b)


class finfo_object(NamedTuple):
    """Machine limits of a floating-point dtype, as Python numbers."""

    bits: int
    eps: float
    max: float
    min: float
    smallest_normal: float
    dtype: DType


class iinfo_object(NamedTuple):
    """Machine limits of an integer dtype, as Python ints."""

    bits: int
    max: int
    min: int
    dtype: DType


def finfo(type: Any, /) -> finfo_object:
    """Machine limits of a floating-point dtype (local)."""
    fi = np.finfo(_as_dtype(type))
    return finfo_object(
        int(fi.bits),
        float(fi.eps),
        float(fi.max),
        float(fi.min),
        float(fi.smallest_normal),
        wrap(np.dtype(fi.dtype)),
    )


def iinfo(type: Any, /) -> iinfo_object:
    """Machine limits of an integer dtype (local)."""
    dt = _as_dtype(type)
    ii = np.iinfo(dt)
    return iinfo_object(int(ii.bits), int(ii.max), int(ii.min), wrap(dt))


_KINDS = {
    "bool": "b",
    "signed integer": "i",
    "unsigned integer": "u",
    "integral": "iu",
    "real floating": "f",
    "complex floating": "c",
    "numeric": "iufc",
}


def isdtype(dtype: Any, kind: Any) -> builtins.bool:
    """Whether ``dtype`` is of ``kind`` (a dtype, a kind name, or a tuple of them)."""
    dt = _dt(dtype)
    if isinstance(kind, tuple):
        return builtins.any(isdtype(dt, k) for k in kind)
    if isinstance(kind, str):
        if kind not in _KINDS:
            raise ValueError(f"unknown dtype kind {kind!r}")
        return dt.kind in _KINDS[kind]
    return dt == _dt(kind)


def result_type(*arrays_and_dtypes: Any) -> DType:
    """The standard's promotion of arrays, dtypes and (at least one array or dtype besides)
    Python scalars."""
    dtypes = [_as_dtype(a) for a in arrays_and_dtypes if not isinstance(a, _PY_SCALARS)]
    if not dtypes:
        raise ValueError("result_type needs at least one array or dtype")
    out = promote(*dtypes)
    for s in arrays_and_dtypes:
        if isinstance(s, _PY_SCALARS):
            out = scalar_dtype(out, s)
    return wrap(out)


# -- manipulation -----------------------------------------------------------------------------
def broadcast_to(x: Array, /, shape: Any) -> Array:
    """``x`` broadcast to ``shape``."""
    return _one("broadcast_to", x, shape=list(_shape(shape)))


def broadcast_arrays(*arrays: Array) -> list[Array]:
    """The arrays broadcast to their common shape."""
    shape = tuple(np.broadcast_shapes(*(a.shape for a in arrays)))
    return [a if a.shape == shape else broadcast_to(a, shape) for a in arrays]


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """The shape that ``shapes`` broadcast to (local)."""
    return tuple(np.broadcast_shapes(*shapes))


def concat(arrays: Sequence[Array], /, *, axis: int | None = 0) -> Array:
    """The arrays joined along ``axis`` (flattened first when ``axis`` is None)."""
    return arrays[0]._core.launch("concat", list(arrays), {"axis": axis})[0]


def stack(arrays: Sequence[Array], /, *, axis: int = 0) -> Array:
    """The arrays joined along a new ``axis``."""
    return arrays[0]._core.launch("stack", list(arrays), {"axis": axis})[0]


def expand_dims(x: Array, /, axis: int = 0) -> Array:
    """``x`` with a new axis of length one at ``axis``."""
    if type(axis) is int and not -x.ndim - 1 <= axis <= x.ndim:
        raise IndexError(f"expand_dims: axis {axis} is out of range for {x.ndim} dimensions")
    return _one("expand_dims", x, axis=axis)


def flip(x: Array, /, *, axis: Any = None) -> Array:
    """``x`` reversed along ``axis`` (all axes when None)."""
    return _one("flip", x, axis=_axis(axis))


def roll(x: Array, /, shift: Any, *, axis: Any = None) -> Array:
    """``x`` rolled by ``shift`` along ``axis`` (flattened when None)."""
    return _one("roll", x, shift=_axis(shift), axis=_axis(axis))


def moveaxis(x: Array, source: Any, destination: Any, /) -> Array:
    """``x`` with axes ``source`` moved to ``destination``."""
    return _one("moveaxis", x, source=_axis(source), destination=_axis(destination))


def permute_dims(x: Array, /, axes: Sequence[int]) -> Array:
    """``x`` with its axes in the order ``axes``."""
    return _one("permute_dims", x, axes=_axis(axes))


def squeeze(x: Array, /, axis: Any) -> Array:
    """``x`` without the axes ``axis`` (each of length one)."""
    return _one("squeeze", x, axis=_axis(axis))


def tile(x: Array, repetitions: Sequence[int], /) -> Array:
    """``x`` repeated ``repetitions`` times along each axis."""
    return _one("tile", x, repetitions=list(_shape(repetitions)))


def repeat(x: Array, repeats: Any, /, *, axis: int | None = None) -> Array:
    """Repeat elements; ``repeats`` as an array makes the output shape data-dependent (SYNC)."""
    if isinstance(repeats, Array):
        return x._device.launch_dynamic("repeat_array", [x, repeats], {"axis": axis}, 1)[0]
    return _one("repeat", x, repeats=operator.index(repeats), axis=axis)


def unstack(x: Array, /, *, axis: int = 0) -> tuple[Array, ...]:
    """The slices of ``x`` along ``axis``, as a tuple."""
    return tuple(x._core.launch("unstack", [x], {"axis": axis}))


def reshape(x: Array, /, shape: Any, *, copy: builtins.bool | None = None) -> Array:
    """Another shape of the same data: a view (local; no call is sent), or a copy with
    ``copy=True``."""
    view: Array = x._core.reshape(x, _shape(shape))
    return astype(view, x._dtype, copy=True) if copy else view


# -- linear algebra ---------------------------------------------------------------------------
def matmul(x1: Array, x2: Array, /) -> Array:
    """The matrix product (``@``)."""
    return _binary("matmul", x1, x2)


def matrix_transpose(x: Array, /) -> Array:
    """``x`` with its last two axes swapped."""
    return _one("matrix_transpose", x)


def tensordot(x1: Array, x2: Array, /, *, axes: Any = 2) -> Array:
    """The tensor contraction of ``x1`` and ``x2`` over ``axes``."""
    if isinstance(axes, int):
        params: dict[str, Any] = {"axes": axes}
    else:
        params = {"axes1": _axis(axes[0]), "axes2": _axis(axes[1])}
    return x1._core.launch("tensordot", [x1, x2], params)[0]


def vecdot(x1: Array, x2: Array, /, *, axis: int = -1) -> Array:
    """The dot product of vectors along ``axis`` (``x1`` conjugated)."""
    return x1._core.launch("vecdot", [x1, x2], {"axis": axis})[0]


# -- searching, sorting, sets -----------------------------------------------------------------
def argmax(x: Array, /, *, axis: int | None = None, keepdims: builtins.bool = False) -> Array:
    """The indices of the maxima along ``axis`` (of the flattened array when None)."""
    return _one("argmax", x, axis=axis, keepdims=keepdims)


def argmin(x: Array, /, *, axis: int | None = None, keepdims: builtins.bool = False) -> Array:
    """The indices of the minima along ``axis`` (of the flattened array when None)."""
    return _one("argmin", x, axis=axis, keepdims=keepdims)


def count_nonzero(x: Array, /, *, axis: Any = None, keepdims: builtins.bool = False) -> Array:
    """The number of non-zero elements along ``axis``."""
    return _one("count_nonzero", x, axis=_axis(axis), keepdims=keepdims)


def nonzero(x: Array, /) -> tuple[Array, ...]:
    """Indices of the non-zero elements (SYNC: the output shape depends on the data)."""
    return tuple(x._device.launch_dynamic("nonzero", [x], {}, x.ndim))


def searchsorted(
    x1: Array, x2: Array, /, *, side: str = "left", sorter: Array | None = None
) -> Array:
    """Where ``x2``'s values would go in the sorted 1-D ``x1``."""
    arrays = [x1, x2] if sorter is None else [x1, x2, sorter]
    return x1._core.launch("searchsorted", arrays, {"side": side})[0]


def where(condition: Array, x1: Any, x2: Any, /) -> Array:
    """Elements of ``x1`` where ``condition`` holds, else of ``x2`` (either may be a scalar)."""
    dev = condition._device
    if isinstance(x1, Array) and isinstance(x2, Array):
        return dev.core.launch("where", [condition, x1, x2], {})[0]
    if isinstance(x1, Array) or isinstance(x2, Array):
        arr, s, reverse = (x1, x2, False) if isinstance(x1, Array) else (x2, x1, True)
        s = s.item() if isinstance(s, np.generic) else s
        if type(s) in (builtins.bool, int, float):
            params: dict[str, Any] = {"scalar": scalar_param(arr._dtype, s)}
            if reverse:
                params["reverse"] = True
            return dev.core.launch("where", [condition, arr], params)[0]
        other = _array_like(s, arr)
        pair = [other, arr] if reverse else [arr, other]
        return dev.core.launch("where", [condition, *pair], {})[0]
    raise TypeError("where needs at least one of x1 and x2 to be an array")


class UniqueAllResult(NamedTuple):
    """What ``unique_all`` returns."""

    values: Array
    indices: Array
    inverse_indices: Array
    counts: Array


class UniqueCountsResult(NamedTuple):
    """What ``unique_counts`` returns."""

    values: Array
    counts: Array


class UniqueInverseResult(NamedTuple):
    """What ``unique_inverse`` returns."""

    values: Array
    inverse_indices: Array


def unique_all(x: Array, /) -> UniqueAllResult:
    """Unique values, first indices, inverse indices and counts (SYNC)."""
    return UniqueAllResult(*x._device.launch_dynamic("unique_all", [x], {}, 4))


def unique_counts(x: Array, /) -> UniqueCountsResult:
    """Unique values and their counts (SYNC)."""
    return UniqueCountsResult(*x._device.launch_dynamic("unique_counts", [x], {}, 2))


def unique_inverse(x: Array, /) -> UniqueInverseResult:
    """Unique values and the indices that rebuild ``x`` from them (SYNC)."""
    return UniqueInverseResult(*x._device.launch_dynamic("unique_inverse", [x], {}, 2))


def unique_values(x: Array, /) -> Array:
    """The unique values of ``x`` (SYNC)."""
    return x._device.launch_dynamic("unique_values", [x], {}, 1)[0]


def isin(x1: Array, x2: Array, /, *, invert: builtins.bool = False) -> Array:
    """Whether each element of ``x1`` is in ``x2`` (negated with ``invert``)."""
    return x1._core.launch("isin", [x1, x2], {"invert": invert})[0]


def sort(
    x: Array, /, *, axis: int = -1, descending: builtins.bool = False, stable: builtins.bool = True
) -> Array:
    """``x`` sorted along ``axis``."""
    return _one("sort", x, axis=axis, descending=descending, stable=stable)


def argsort(
    x: Array, /, *, axis: int = -1, descending: builtins.bool = False, stable: builtins.bool = True
) -> Array:
    """The indices that sort ``x`` along ``axis``."""
    return _one("argsort", x, axis=axis, descending=descending, stable=stable)


# -- statistics and utilities -----------------------------------------------------------------
def _reduce(name: str, x: Array, axis: Any, keepdims: builtins.bool, **params: Any) -> Array:
    return _one(name, x, axis=_axis(axis), keepdims=keepdims, **params)


def sum(
    x: Array, /, *, axis: Any = None, dtype: Any = None, keepdims: builtins.bool = False
) -> Array:
    """The sum along ``axis``."""
    return _reduce("sum", x, axis, keepdims, dtype=_dtype_param(dtype))


def prod(
    x: Array, /, *, axis: Any = None, dtype: Any = None, keepdims: builtins.bool = False
) -> Array:
    """The product along ``axis``."""
    return _reduce("prod", x, axis, keepdims, dtype=_dtype_param(dtype))


def max(x: Array, /, *, axis: Any = None, keepdims: builtins.bool = False) -> Array:
    """The maximum along ``axis``."""
    return _reduce("max", x, axis, keepdims)


def min(x: Array, /, *, axis: Any = None, keepdims: builtins.bool = False) -> Array:
    """The minimum along ``axis``."""
    return _reduce("min", x, axis, keepdims)


def mean(x: Array, /, *, axis: Any = None, keepdims: builtins.bool = False) -> Array:
    """The mean along ``axis``."""
    return _reduce("mean", x, axis, keepdims)


def std(
    x: Array, /, *, axis: Any = None, correction: float = 0.0, keepdims: builtins.bool = False
) -> Array:
    """The standard deviation along ``axis`` (``correction``: degrees of freedom)."""
    return _reduce("std", x, axis, keepdims, correction=correction)


def var(
    x: Array, /, *, axis: Any = None, correction: float = 0.0, keepdims: builtins.bool = False
) -> Array:
    """The variance along ``axis`` (``correction``: degrees of freedom)."""
    return _reduce("var", x, axis, keepdims, correction=correction)


def all(x: Array, /, *, axis: Any = None, keepdims: builtins.bool = False) -> Array:
    """Whether every element along ``axis`` is true."""
    return _reduce("all", x, axis, keepdims)


def any(x: Array, /, *, axis: Any = None, keepdims: builtins.bool = False) -> Array:
    """Whether any element along ``axis`` is true."""
    return _reduce("any", x, axis, keepdims)


def _cumulative(
    name: str, x: Array, axis: int | None, dtype: Any, include_initial: builtins.bool
) -> Array:
    return _one(name, x, axis=axis, dtype=_dtype_param(dtype), include_initial=include_initial)


def cumulative_sum(
    x: Array,
    /,
    *,
    axis: int | None = None,
    dtype: Any = None,
    include_initial: builtins.bool = False,
) -> Array:
    """Running sums along ``axis`` (with a leading zero if ``include_initial``)."""
    return _cumulative("cumulative_sum", x, axis, dtype, include_initial)


def cumulative_prod(
    x: Array,
    /,
    *,
    axis: int | None = None,
    dtype: Any = None,
    include_initial: builtins.bool = False,
) -> Array:
    """Running products along ``axis`` (with a leading one if ``include_initial``)."""
    return _cumulative("cumulative_prod", x, axis, dtype, include_initial)


def diff(
    x: Array,
    /,
    *,
    axis: int = -1,
    n: int = 1,
    prepend: Array | None = None,
    append: Array | None = None,
) -> Array:
    """The ``n``-th differences along ``axis``, after ``prepend`` and before ``append``."""
    arrays = [x]
    params: dict[str, Any] = {"axis": axis, "n": n}
    for key, extra in (("has_prepend", prepend), ("has_append", append)):
        if extra is not None:
            arrays.append(_array_like(extra, x))
            params[key] = True
    return x._core.launch("diff", arrays, params)[0]


def take(x: Array, indices: Array, /, *, axis: int | None = None) -> Array:
    """The elements of ``x`` at ``indices`` along ``axis``."""
    return x._core.launch("take", [x, indices], {"axis": axis})[0]


def take_along_axis(x: Array, indices: Array, /, *, axis: int = -1) -> Array:
    """The elements of ``x`` at ``indices`` matched along ``axis``."""
    return x._core.launch("take_along_axis", [x, indices], {"axis": axis})[0]


globals().update(ELEMENTWISE)

__all__ = sorted(
    n
    for n, v in list(globals().items())
    if not n.startswith("_") and getattr(v, "__module__", None) == __name__
)
