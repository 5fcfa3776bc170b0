"""``gpuremote.xp.linalg``: the array API's linear algebra extension, run on the proxy."""

from __future__ import annotations

from typing import Any, NamedTuple

from ._array import Array
from ._functions import _axis, _dtype_param, matmul, matrix_transpose, tensordot, vecdot

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
    """What ``eigh`` returns."""

    eigenvalues: Array
    eigenvectors: Array


class QRResult(NamedTuple):
    """What ``qr`` returns."""

    Q: Array
    R: Array


class SlogdetResult(NamedTuple):
    """What ``slogdet`` returns."""

    sign: Array
    logabsdet: Array


class SVDResult(NamedTuple):
    """What ``svd`` returns."""

    U: Array
    S: Array
    Vh: Array


def _run(name: str, arrays: list[Array], **params: Any) -> list[Array]:
    return arrays[0]._core.launch(f"linalg.{name}", arrays, params)


def cholesky(x: Array, /, *, upper: bool = False) -> Array:
    """The Cholesky factor (lower, or upper with ``upper``)."""
    return _run("cholesky", [x], upper=upper)[0]


def cross(x1: Array, x2: Array, /, *, axis: int = -1) -> Array:
    """The cross product of 3-vectors along ``axis``."""
    return _run("cross", [x1, x2], axis=axis)[0]


def det(x: Array, /) -> Array:
    """The determinant."""
    return _run("det", [x])[0]


def diagonal(x: Array, /, *, offset: int = 0) -> Array:
    """The diagonal ``offset`` of the last two axes."""
    return _run("diagonal", [x], offset=offset)[0]


def eigh(x: Array, /) -> EighResult:
    """Eigenvalues and eigenvectors of a symmetric or Hermitian matrix."""
    return EighResult(*_run("eigh", [x]))


def eigvalsh(x: Array, /) -> Array:
    """Eigenvalues of a symmetric or Hermitian matrix."""
    return _run("eigvalsh", [x])[0]


def inv(x: Array, /) -> Array:
    """The inverse."""
    return _run("inv", [x])[0]


def matrix_norm(x: Array, /, *, keepdims: bool = False, ord: Any = "fro") -> Array:
    """The matrix norm (``ord``: ``'fro'``, ``'nuc'``, 1, 2, inf, ...)."""
    return _run("matrix_norm", [x], keepdims=keepdims, ord=ord)[0]


def matrix_power(x: Array, n: int, /) -> Array:
    """The ``n``-th power of a square matrix."""
    return _run("matrix_power", [x], n=n)[0]


def _with_rtol(x: Array, rtol: float | Array | None) -> tuple[list[Array], dict[str, Any]]:
    if rtol is None:
        return [x], {}
    if isinstance(rtol, Array):
        return [x, rtol], {}  # one per matrix of the stack
    return [x], {"rtol": float(rtol)}


def matrix_rank(x: Array, /, *, rtol: float | Array | None = None) -> Array:
    """The rank (singular values above ``rtol`` times the largest)."""
    arrays, params = _with_rtol(x, rtol)
    return _run("matrix_rank", arrays, **params)[0]


def outer(x1: Array, x2: Array, /) -> Array:
    """The outer product of two vectors."""
    return _run("outer", [x1, x2])[0]


def pinv(x: Array, /, *, rtol: float | Array | None = None) -> Array:
    """The Moore-Penrose pseudo-inverse."""
    arrays, params = _with_rtol(x, rtol)
    return _run("pinv", arrays, **params)[0]


def qr(x: Array, /, *, mode: str = "reduced") -> QRResult:
    """The QR decomposition."""
    return QRResult(*_run("qr", [x], mode=mode))


def slogdet(x: Array, /) -> SlogdetResult:
    """Sign and natural logarithm of the absolute value of the determinant."""
    return SlogdetResult(*_run("slogdet", [x]))


def solve(x1: Array, x2: Array, /) -> Array:
    """The solution ``x`` of ``x1 @ x = x2``."""
    return _run("solve", [x1, x2])[0]


def svd(x: Array, /, *, full_matrices: bool = True) -> SVDResult:
    """The singular value decomposition."""
    return SVDResult(*_run("svd", [x], full_matrices=full_matrices))


def svdvals(x: Array, /) -> Array:
    """The singular values."""
    return _run("svdvals", [x])[0]


def trace(x: Array, /, *, offset: int = 0, dtype: Any = None) -> Array:
    """The sum along diagonal ``offset``."""
    return _run("trace", [x], offset=offset, dtype=_dtype_param(dtype))[0]


def vector_norm(
    x: Array,
    /,
    *,
    axis: Any = None,
    keepdims: bool = False,
    ord: float = 2,
) -> Array:
    """The vector norm along ``axis`` (``ord``: 1, 2, inf, ...)."""
    return _run("vector_norm", [x], axis=_axis(axis), keepdims=keepdims, ord=ord)[0]
