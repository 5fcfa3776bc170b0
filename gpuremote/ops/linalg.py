"""The standard's linear algebra functions (``matmul``, ``tensordot``, ``vecdot``,
``matrix_transpose``) and its ``linalg`` extension (``linalg.<name>``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ._base import (
    INT64,
    Meta,
    OpError,
    OpList,
    Params,
    Shape,
    broadcast,
    check,
    namespace,
    promote,
    real_of,
    write,
)
from .statistical import reduced_shape, sum_dtype

__all__ = ["OPS", "matmul_shape"]

OPS = OpList()


def matmul_shape(a: Shape, b: Shape) -> Shape:
    """The shape of ``a @ b`` (NumPy's and the array API's rules); ``OpError`` if none."""
    if not a or not b:
        raise OpError("matmul does not take 0-d arrays")
    a2 = (1, *a) if len(a) == 1 else a
    b2 = (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise OpError(f"matmul: shapes {a} and {b} are not aligned ({a2[-1]} != {b2[-2]})")
    shape = (*broadcast([a2[:-2], b2[:-2]]), a2[-2], b2[-1])
    if len(a) == 1:
        shape = shape[:-2] + shape[-1:]
    if len(b) == 1:
        shape = shape[:-1]
    return shape


def _run_matmul(xp: Any, ins: Sequence[Any], outs: Sequence[Any], params: Params) -> None:
    out = outs[0]
    if out.ndim and ins[0].dtype == ins[1].dtype == out.dtype:
        xp.matmul(ins[0], ins[1], out=out)  # straight into the output
    else:
        write(outs, namespace(xp).matmul(ins[0], ins[1]))


def _matmul_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (a, ad), (b, bd) = ins
    check("matmul", ad, "numeric")
    check("matmul", bd, "numeric")
    return [(matmul_shape(a, b), promote(ad, bd))]


OPS.add(
    "matmul", (2, 2), _matmul_meta, lambda ns, ins, p: ns.matmul(ins[0], ins[1]), run=_run_matmul
)


def _matrix_transpose_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    if len(shape) < 2:
        raise OpError("matrix_transpose needs at least two dimensions")
    return [((*shape[:-2], shape[-1], shape[-2]), dt)]


OPS.add(
    "matrix_transpose",
    (1, 1),
    _matrix_transpose_meta,
    lambda ns, ins, p: ns.matrix_transpose(ins[0]),
)


def _tensordot_axes(params: Params, n1: int, n2: int) -> tuple[list[int], list[int]]:
    if "axes1" in params:
        a1, a2 = params["axes1"], params.get("axes2")
        if type(a1) is not list or type(a2) is not list or len(a1) != len(a2):
            raise OpError("tensordot: axes must be two sequences of one length")
        return [a % n1 if -n1 <= a < n1 else -1 for a in a1], [
            a % n2 if -n2 <= a < n2 else -1 for a in a2
        ]
    k = params.get("axes", 2)
    if type(k) is not int or k < 0 or k > min(n1, n2):
        raise OpError(f"tensordot: axes={k!r} is out of range")
    return list(range(n1 - k, n1)), list(range(k))


def _tensordot_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2) = ins
    check("tensordot", d1, "numeric")
    check("tensordot", d2, "numeric")
    ax1, ax2 = _tensordot_axes(params, len(s1), len(s2))
    if -1 in ax1 or -1 in ax2 or len(set(ax1)) != len(ax1) or len(set(ax2)) != len(ax2):
        raise OpError("tensordot: axes out of range or repeated")
    for i, j in zip(ax1, ax2, strict=True):
        if s1[i] != s2[j]:
            raise OpError(f"tensordot: contracted dimensions {s1[i]} and {s2[j]} differ")
    shape = tuple(d for i, d in enumerate(s1) if i not in ax1) + tuple(
        d for i, d in enumerate(s2) if i not in ax2
    )
    return [(shape, promote(d1, d2))]


def _tensordot_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    axes: Any = params.get("axes", 2)
    if "axes1" in params:
        axes = (tuple(params["axes1"]), tuple(params["axes2"]))
    return ns.tensordot(ins[0], ins[1], axes=axes)


OPS.add("tensordot", (2, 2), _tensordot_meta, _tensordot_call, ("axes", "axes1", "axes2"))


def _vecdot_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2) = ins
    check("vecdot", d1, "numeric")
    check("vecdot", d2, "numeric")
    axis = params.get("axis", -1)
    if type(axis) is not int or not s1 or not s2:
        raise OpError("vecdot needs arrays of at least one dimension and an int axis")
    n = min(len(s1), len(s2))
    if not -n <= axis < 0 and not 0 <= axis < n:
        raise OpError(f"vecdot: axis {axis} is out of range")
    a1 = axis % len(s1)
    a2 = axis % len(s2)
    if s1[a1] != s2[a2]:
        raise OpError(f"vecdot: dimensions {s1[a1]} and {s2[a2]} along axis {axis} differ")
    shape = broadcast([s1, s2])
    ax = axis % len(shape)
    return [(shape[:ax] + shape[ax + 1 :], promote(d1, d2))]


OPS.add(
    "vecdot",
    (2, 2),
    _vecdot_meta,
    lambda ns, ins, p: ns.vecdot(ins[0], ins[1], axis=p.get("axis", -1)),
    ("axis",),
)


def _square_stack(name: str, shape: Shape) -> None:
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise OpError(f"{name} needs a stack of square matrices, got shape {shape}")


def _linalg_meta(name: str) -> Callable[[Sequence[Meta], Params], list[Meta]]:
    """Output metadata of the ``linalg`` functions of one input."""

    def meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
        (shape, dt), *rtol = ins
        real = real_of(dt)
        for rs, rd in rtol:  # pinv, matrix_rank: an array rtol, one per matrix of the stack
            check(name, rd, "real floating-point")
            if len(shape) < 2 or broadcast([rs, shape[:-2]]) != shape[:-2]:
                raise OpError(f"{name}: rtol of shape {rs} does not fit a stack of {shape}")
        if name in ("cholesky", "det", "eigh", "eigvalsh", "inv", "slogdet"):
            check(name, dt, "floating-point")
            _square_stack(name, shape)
        batch, n = shape[:-2], shape[-1] if shape else 0
        if name in ("cholesky", "inv"):
            return [(shape, dt)]
        if name == "det":
            return [(batch, dt)]
        if name == "slogdet":
            return [(batch, dt), (batch, real)]
        if name == "eigh":
            return [((*batch, n), real), (shape, dt)]
        if name == "eigvalsh":
            return [((*batch, n), real)]
        check(name, dt, "floating-point")
        if len(shape) < 2:
            raise OpError(f"{name} needs at least two dimensions")
        m, n = shape[-2], shape[-1]
        k = min(m, n)
        if name == "qr":
            mode = params.get("mode", "reduced")
            if mode not in ("reduced", "complete"):
                raise OpError("qr: mode must be 'reduced' or 'complete'")
            q = m if mode == "complete" else k
            return [((*batch, m, q), dt), ((*batch, q, n), dt)]
        if name == "svd":
            full = params.get("full_matrices", True)
            u, v = (m, n) if full else (k, k)
            return [((*batch, m, u), dt), ((*batch, k), real), ((*batch, v, n), dt)]
        if name == "svdvals":
            return [((*batch, k), real)]
        if name == "pinv":
            return [((*batch, n, m), dt)]
        if name == "matrix_rank":
            return [(batch, INT64)]
        if name == "matrix_norm":
            keep = params.get("keepdims", False)
            return [((*batch, 1, 1) if keep else batch, real)]
        raise OpError(f"no linalg function {name}")

    return meta


def _linalg_call(name: str) -> Callable[[Any, Sequence[Any], Params], Any]:
    def call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
        fn = getattr(ns.linalg, name)
        kw: dict[str, Any] = {}
        if name == "cholesky":
            kw["upper"] = bool(params.get("upper", False))
        elif name == "qr":
            kw["mode"] = params.get("mode", "reduced")
        elif name == "svd":
            kw["full_matrices"] = bool(params.get("full_matrices", True))
        elif name in ("pinv", "matrix_rank") and len(ins) == 2:
            kw["rtol"] = ins[1]
        elif name in ("pinv", "matrix_rank") and "rtol" in params:
            kw["rtol"] = params["rtol"]
        elif name == "matrix_norm":
            kw["keepdims"] = bool(params.get("keepdims", False))
            kw["ord"] = params.get("ord", "fro")
        result = fn(ins[0], **kw)
        return tuple(result) if isinstance(result, tuple) else result

    return call


for _name in (
    "cholesky",
    "det",
    "eigh",
    "eigvalsh",
    "inv",
    "matrix_norm",
    "matrix_rank",
    "pinv",
    "qr",
    "slogdet",
    "svd",
    "svdvals",
):
    OPS.add(
        f"linalg.{_name}",
        (1, 2) if _name in ("pinv", "matrix_rank") else (1, 1),  # rtol may be an array
        _linalg_meta(_name),
        _linalg_call(_name),
        ("upper", "mode", "full_matrices", "rtol", "keepdims", "ord"),
    )


def _solve_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2) = ins
    check("solve", d1, "floating-point")
    check("solve", d2, "floating-point")
    _square_stack("solve", s1)
    n = s1[-1]
    if len(s2) == 1:
        if s2[0] != n:
            raise OpError(f"solve: {s2} does not fit matrices of {s1}")
        return [((*s1[:-2], n), promote(d1, d2))]
    if len(s2) < 2 or s2[-2] != n:
        raise OpError(f"solve: {s2} does not fit matrices of {s1}")
    return [((*broadcast([s1[:-2], s2[:-2]]), n, s2[-1]), promote(d1, d2))]


OPS.add("linalg.solve", (2, 2), _solve_meta, lambda ns, ins, p: ns.linalg.solve(ins[0], ins[1]))


def _matrix_power_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    check("matrix_power", dt, "numeric")
    _square_stack("matrix_power", shape)
    n = params.get("n")
    if type(n) is not int or (n < 0 and dt.kind not in "fc"):
        raise OpError("matrix_power: n must be an int (negative only for floating point)")
    return [(shape, dt)]


OPS.add(
    "linalg.matrix_power",
    (1, 1),
    _matrix_power_meta,
    lambda ns, ins, p: ns.linalg.matrix_power(ins[0], p["n"]),
    ("n",),
)


def _cross_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2) = ins
    check("cross", d1, "numeric")
    check("cross", d2, "numeric")
    axis = params.get("axis", -1)
    n = min(len(s1), len(s2))
    if type(axis) is not int or not n or not -n <= axis < (n if len(s1) == len(s2) else 0):
        raise OpError(f"cross: axis {axis!r} is out of range for shapes {s1} and {s2}")
    ax = axis if axis < 0 else axis - len(s1)  # counted from the end, where they broadcast
    if s1[ax] != 3 or s2[ax] != 3:
        raise OpError("cross needs dimension 3 along axis")
    return [(broadcast([s1, s2]), promote(d1, d2))]


OPS.add(
    "linalg.cross",
    (2, 2),
    _cross_meta,
    lambda ns, ins, p: ns.linalg.cross(ins[0], ins[1], axis=p.get("axis", -1)),
    ("axis",),
)


def _outer_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    (s1, d1), (s2, d2) = ins
    check("outer", d1, "numeric")
    check("outer", d2, "numeric")
    if len(s1) != 1 or len(s2) != 1:
        raise OpError("outer takes 1-D arrays")
    return [((s1[0], s2[0]), promote(d1, d2))]


OPS.add("linalg.outer", (2, 2), _outer_meta, lambda ns, ins, p: ns.linalg.outer(ins[0], ins[1]))


def _diagonal_len(shape: Shape, k: int) -> int:
    m, n = shape[-2], shape[-1]
    return max(0, min(m, n - k) if k >= 0 else min(m + k, n))


def _diagonal_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    if len(shape) < 2 or type(params.get("offset", 0)) is not int:
        raise OpError("diagonal needs at least two dimensions and an int offset")
    return [((*shape[:-2], _diagonal_len(shape, params.get("offset", 0))), dt)]


OPS.add(
    "linalg.diagonal",
    (1, 1),
    _diagonal_meta,
    lambda ns, ins, p: ns.linalg.diagonal(ins[0], offset=p.get("offset", 0)),
    ("offset",),
)


def _trace_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    check("trace", dt, "numeric")
    if len(shape) < 2 or type(params.get("offset", 0)) is not int:
        raise OpError("trace needs at least two dimensions and an int offset")
    return [(shape[:-2], sum_dtype(dt, params))]


OPS.add(
    "linalg.trace",
    (1, 1),
    _trace_meta,
    lambda ns, ins, p: ns.linalg.trace(
        ins[0], offset=p.get("offset", 0), dtype=sum_dtype(ins[0].dtype, p)
    ),
    ("offset", "dtype"),
)


def _vector_norm_meta(ins: Sequence[Meta], params: Params) -> list[Meta]:
    ((shape, dt),) = ins
    check("vector_norm", dt, "floating-point")
    if type(params.get("ord", 2)) not in (int, float):
        raise OpError("vector_norm: ord must be a number")
    return [(reduced_shape("vector_norm", shape, params), real_of(dt))]


def _vector_norm_call(ns: Any, ins: Sequence[Any], params: Params) -> Any:
    axis = params.get("axis")
    return ns.linalg.vector_norm(
        ins[0],
        axis=tuple(axis) if type(axis) is list else axis,
        keepdims=bool(params.get("keepdims", False)),
        ord=params.get("ord", 2),
    )


OPS.add(
    "linalg.vector_norm",
    (1, 1),
    _vector_norm_meta,
    _vector_norm_call,
    ("axis", "keepdims", "ord"),
)
