"""What every op module shares: the ``Op`` record, its errors, and the standard's rules on
dtypes (categories, type promotion, Python scalars), axes and broadcasting.

Nothing here registers anything: each category module lists its ops in ``OPS`` and the
package's root builds the table from those lists.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..wire.protocol import DTYPES

__all__ = [
    "CATEGORIES",
    "Meta",
    "Op",
    "OpError",
    "OpTypeError",
    "Params",
    "Shape",
    "broadcast",
    "check",
    "make_op",
    "promote",
    "scalar_dtype",
]

Shape = tuple[int, ...]
Meta = tuple[Shape, np.dtype[Any]]
Params = dict[str, Any]
#: ``run(xp, inputs, outputs, params)``: compute into preallocated outputs with backend ``xp``
Run = Callable[[Any, Sequence[Any], Sequence[Any], Params], None]
#: ``call(ns, inputs, params)``: the result, computed with the backend's array API namespace
Call = Callable[[Any, Sequence[Any], Params], Any]


class OpError(ValueError):
    """Inputs or params that an op does not accept."""


class OpTypeError(OpError, TypeError):
    """An input dtype that the function does not take (the standard's ``TypeError``)."""


@dataclass(frozen=True, slots=True)
class Op:
    """One allow-listed op.

    ``meta`` runs on the client to infer the shapes and dtypes of the outputs (no round trip)
    and on the proxy to check what a client declared; ``run`` computes into the outputs.
    """

    name: str
    nin: tuple[int, int]  # min and max number of array inputs
    meta: Callable[[Sequence[Meta], Params], list[Meta]]
    run: Run
    params: tuple[str, ...] = ()
    doc: str = ""
    #: for ops whose output shapes depend on the data: computes and returns the outputs,
    #: refusing (``OpError``) to make more than the given number of bytes
    dynamic: Callable[[Any, Sequence[Any], Params, int], list[Any]] | None = None


#: the standard's dtype categories, as NumPy dtype kinds
CATEGORIES: dict[str, str] = {
    "all": "biufc",
    "numeric": "iufc",
    "real numeric": "iuf",
    "integer": "iu",
    "integer or boolean": "biu",
    "boolean": "b",
    "floating-point": "fc",
    "real floating-point": "f",
    "complex floating-point": "c",
}

INT64 = np.dtype(np.int64)
BOOL = np.dtype(np.bool_)
FLOAT64 = np.dtype(np.float64)


def check(name: str, dt: np.dtype[Any], category: str) -> None:
    """Raise ``OpTypeError`` unless ``dt`` is in the standard's dtype ``category``."""
    if dt.kind not in CATEGORIES[category]:
        raise OpTypeError(f"{name} takes {category} dtypes, got {dt}")


def promote(*dtypes: np.dtype[Any]) -> np.dtype[Any]:
    """The standard's type promotion of ``dtypes`` (NumPy's choice where the standard has
    none, such as int64 with uint64)."""
    out = dtypes[0]
    for d in dtypes[1:]:
        if d != out:
            if (out.kind == "b") != (d.kind == "b"):
                raise OpTypeError(f"{out} and {d} cannot be promoted together")
            out = np.result_type(out, d)
    return out


def scalar_dtype(dt: np.dtype[Any], value: Any) -> np.dtype[Any]:
    """The dtype that Python scalar ``value`` takes next to an array of ``dt`` (the standard's
    rules: ``bool`` only with bool arrays, ``int`` within the integer range or with floats,
    ``float`` and ``complex`` only with floating-point arrays)."""
    t = type(value)
    if t is bool:
        if dt.kind != "b":
            raise OpTypeError(f"a Python bool cannot be combined with an array of {dt}")
        return dt
    if t is int:
        if dt.kind == "b":
            raise OpTypeError(f"a Python int cannot be combined with an array of {dt}")
        if dt.kind in "iu":
            info = np.iinfo(dt)
            if not info.min <= value <= info.max:
                raise OverflowError(f"Python int {value} is out of the range of {dt}")
        return dt
    if t is float:
        if dt.kind not in "fc":
            raise OpTypeError(
                f"a Python float can only be combined with floating-point arrays, not {dt}"
            )
        return dt
    if t is complex:
        if dt.kind not in "fc":
            raise OpTypeError(
                f"a Python complex can only be combined with floating-point arrays, not {dt}"
            )
        return np.result_type(dt, np.complex64)
    raise OpTypeError(f"expected an array or a Python scalar, got {t.__name__}")


def number(params: Params, key: str) -> float | int | bool:
    """Param ``key``, which must be a Python number."""
    v: Any = params.get(key)
    if type(v) not in (int, float, bool):
        raise OpError(f"parameter {key!r} must be a number")
    return v


def broadcast(shapes: Sequence[Shape]) -> Shape:
    """The broadcast of ``shapes``; ``OpError`` if they do not broadcast."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise OpError(f"shapes {', '.join(map(str, shapes))} do not broadcast") from None


def norm_axes(
    name: str, axis: Any, ndim: int, *, allow_none: bool = True, unique: bool = True
) -> tuple[int, ...]:
    """Normalised axes of ``axis`` (int, list of ints, or None for all)."""
    if axis is None:
        if not allow_none:
            raise OpError(f"{name} needs an axis")
        return tuple(range(ndim))
    items = [axis] if type(axis) is int else axis
    if type(items) is not list or any(type(a) is not int for a in items):
        raise OpError(f"{name}: axis must be an int, a tuple of ints or None")
    out = []
    for a in items:
        if not -ndim <= a < ndim:
            raise OpError(f"{name}: axis {a} is out of range for {ndim} dimensions")
        out.append(a % ndim)
    if unique and len(set(out)) != len(out):
        raise OpError(f"{name}: repeated axis in {axis}")
    return tuple(out)


def one_axis(name: str, axis: Any, ndim: int) -> int:
    """One normalised axis (an int param)."""
    if type(axis) is not int:
        raise OpError(f"{name}: axis must be an int")
    return norm_axes(name, axis, ndim)[0]


def axis_arg(params: Params, key: str = "axis") -> Any:
    """Param ``key`` as the backend takes an axis (a list becomes a tuple)."""
    axis = params.get(key)
    return tuple(axis) if type(axis) is list else axis


def dtype_param(params: Params, key: str = "dtype") -> np.dtype[Any] | None:
    """The dtype named by param ``key`` (None if absent); ``OpError`` for an unknown name."""
    name = params.get(key)
    if name is None:
        return None
    if name not in DTYPES:
        raise OpError(f"unsupported dtype {name!r}")
    return DTYPES[name]


def shape_param(params: Params, key: str = "shape") -> Shape:
    """Param ``key``: a list of non-negative ints."""
    shape = params.get(key)
    if type(shape) is not list or any(type(d) is not int or d < 0 for d in shape):
        raise OpError(f"{key} must be a list of non-negative ints")
    return tuple(shape)


def real_of(dt: np.dtype[Any]) -> np.dtype[Any]:
    """The real dtype of the same precision as ``dt``."""
    if dt == np.complex64:
        return np.dtype(np.float32)
    return FLOAT64 if dt.kind == "c" else dt


@functools.cache
def namespace(xp: Any) -> Any:
    """The array API namespace for backend module ``xp`` (numpy or cupy)."""
    return importlib.import_module(f"array_api_compat.{xp.__name__}")


def write(outs: Sequence[Any], result: Any) -> None:
    """Store ``result`` (one array, or a tuple for the ops with several outputs) in ``outs``."""
    if isinstance(result, tuple | list):
        for o, r in zip(outs, result, strict=True):
            o[...] = r
    else:
        outs[0][...] = result


def method(name: str, *keys: str) -> Call:
    """A call of ``ns.name(x, **params)``, passing on the params in ``keys`` that are set."""

    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        return getattr(ns, name)(*ins, **{k: params[k] for k in keys if k in params})

    return call


def make_op(
    name: str,
    nin: tuple[int, int],
    meta: Callable[[Sequence[Meta], Params], list[Meta]],
    call: Call,
    params: tuple[str, ...] = (),
    *,
    dynamic: bool = False,
    run: Run | None = None,
    doc: str = "",
) -> Op:
    """The op ``name`` whose ``call(ns, ins, params)`` computes the result with the backend's
    array API namespace (the result is then written into the preallocated outputs, cast to
    the dtypes ``meta`` gave); ``run``, if given, computes into the outputs directly instead."""
    doc = doc or f"array API {name}"
    if dynamic:

        def run_dynamic(xp: Any, ins: Sequence[Any], params: Params, budget: int) -> list[Any]:
            if name == "repeat_array":  # the one whose output is not bounded by its inputs
                x, reps = ins
                n = int(xp.sum(reps)) if reps.size else 0
                per = x.dtype.itemsize * (
                    1 if params.get("axis") is None else x.size // max(x.shape[params["axis"]], 1)
                )
                if n * per > budget or bool(xp.any(reps < 0)):
                    raise OpError(f"repeat would make {n * per} bytes; {budget} are left")
            result = call(namespace(xp), ins, params)
            return list(result) if isinstance(result, tuple) else [result]

        def run_refused(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
            raise OpError(f"{name} has a data-dependent output shape: use launch_dynamic")

        return Op(name, nin, meta, run_refused, params, doc, dynamic=run_dynamic)

    if run is None:

        def run_call(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
            write(outs, call(namespace(xp), ins, params))

        run = run_call
    return Op(name, nin, meta, run, params, doc)


class OpList(list[Op]):
    """A category module's ops, in the order they are defined."""

    def add(
        self,
        name: str,
        nin: tuple[int, int],
        meta: Callable[[Sequence[Meta], Params], list[Meta]],
        call: Call,
        params: tuple[str, ...] = (),
        **kw: Any,
    ) -> Op:
        """Make op ``name`` (``make_op``'s arguments) and append it."""
        op = make_op(name, nin, meta, call, params, **kw)
        self.append(op)
        return op
