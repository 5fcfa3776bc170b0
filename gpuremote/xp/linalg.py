"""``gpuremote.xp.linalg``: the array API's linear algebra extension, run on the proxy."""

from __future__ import annotations

from typing import Any, NamedTuple

from ._array import Array
from ._functions import matmul, matrix_transpose, tensordot, vecdot

__all__ = [
    "cholesky",
    "cross",
    "det",
    "diagonal",
    "eigh",
    "eigvalsh",
    "inv",
    "matmul",
    "matrix_norm",
    "matrix_power",
    "matrix_rank",
    "matrix_transpose",
    "outer",
    "pinv",
    "qr",
    "slogdet",
    "solve",
    "svd",
    "svdvals",
    "tensordot",
    "trace",
    "vecdot",
    "vector_norm",
]


class EighResult(NamedTuple):
    eigenvalues: Array
    eigenvectors: Array


class QRResult(NamedTuple):
    Q: Array
    R: Array


class SlogdetResult(NamedTuple):
    sign: Array
    logabsdet: Array


class SVDResult(NamedTuple):
    U: Array
    S: Array
    Vh: Array


def _run(name: str, arrays: list[Array], **params: Any) -> list[Array]:
    return arrays[0]._device.launch(f"linalg.{name}", arrays, params)


def cholesky(x: Array, /, *, upper: bool = False) -> Array:
    return _run("cholesky", [x], upper=upper)[0]


def cross(x1: Array, x2: Array, /, *, axis: int = -1) -> Array:
    return _run("cross", [x1, x2], axis=axis)[0]


def det(x: Array, /) -> Array:
    return _run("det", [x])[0]


def diagonal(x: Array, /, *, offset: int = 0) -> Array:
    return _run("diagonal", [x], offset=offset)[0]


def eigh(x: Array, /) -> EighResult:
    return EighResult(*_run("eigh", [x]))


def eigvalsh(x: Array, /) -> Array:
    return _run("eigvalsh", [x])[0]


def inv(x: Array, /) -> Array:
    return _run("inv", [x])[0]


def matrix_norm(x: Array, /, *, keepdims: bool = False, ord: Any = "fro") -> Array:
    return _run("matrix_norm", [x], keepdims=keepdims, ord=ord)[0]


def matrix_power(x: Array, n: int, /) -> Array:
    return _run("matrix_power", [x], n=n)[0]


def matrix_rank(x: Array, /, *, rtol: float | None = None) -> Array:
    params = {} if rtol is None else {"rtol": float(rtol)}
    return _run("matrix_rank", [x], **params)[0]


def outer(x1: Array, x2: Array, /) -> Array:
    return _run("outer", [x1, x2])[0]


def pinv(x: Array, /, *, rtol: float | None = None) -> Array:
    params = {} if rtol is None else {"rtol": float(rtol)}
    return _run("pinv", [x], **params)[0]


def qr(x: Array, /, *, mode: str = "reduced") -> QRResult:
    return QRResult(*_run("qr", [x], mode=mode))


def slogdet(x: Array, /) -> SlogdetResult:
    return SlogdetResult(*_run("slogdet", [x]))


def solve(x1: Array, x2: Array, /) -> Array:
    return _run("solve", [x1, x2])[0]


def svd(x: Array, /, *, full_matrices: bool = True) -> SVDResult:
    return SVDResult(*_run("svd", [x], full_matrices=full_matrices))


def svdvals(x: Array, /) -> Array:
    return _run("svdvals", [x])[0]


def trace(x: Array, /, *, offset: int = 0, dtype: Any = None) -> Array:
    from ._functions import _dtype_param

    return _run("trace", [x], offset=offset, dtype=_dtype_param(dtype))[0]


def vector_norm(
    x: Array,
    /,
    *,
    axis: Any = None,
    keepdims: bool = False,
    ord: float = 2,
) -> Array:
    from ._functions import _axis

    return _run("vector_norm", [x], axis=_axis(axis), keepdims=keepdims, ord=ord)[0]
