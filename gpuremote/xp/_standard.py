"""The function names of the array API standard (2024.12), to count what is implemented."""

from __future__ import annotations

__all__ = ["FFT", "FUNCTIONS", "LINALG"]

FUNCTIONS: tuple[str, ...] = (
    "__array_namespace_info__", "abs", "acos", "acosh", "add", "all", "any", "arange", "argmax",
    "argmin", "argsort", "asarray", "asin", "asinh", "astype", "atan", "atan2", "atanh",
    "bitwise_and", "bitwise_invert", "bitwise_left_shift", "bitwise_or", "bitwise_right_shift",
    "bitwise_xor", "broadcast_arrays", "broadcast_shapes", "broadcast_to", "can_cast", "ceil",
    "clip", "concat", "conj", "copysign", "cos", "cosh", "count_nonzero", "cumulative_prod",
    "cumulative_sum", "diff", "divide", "empty", "empty_like", "equal", "exp", "expand_dims",
    "expm1", "eye", "finfo", "flip", "floor", "floor_divide", "from_dlpack", "full", "full_like",
    "greater", "greater_equal", "hypot", "iinfo", "imag", "isdtype", "isfinite", "isin", "isinf",
    "isnan", "less", "less_equal", "linspace", "log", "log10", "log1p", "log2", "logaddexp",
    "logical_and", "logical_not", "logical_or", "logical_xor", "matmul", "matrix_transpose",
    "max", "maximum", "mean", "meshgrid", "min", "minimum", "moveaxis", "multiply", "negative",
    "nextafter", "nonzero", "not_equal", "ones", "ones_like", "permute_dims", "positive", "pow",
    "prod", "real", "reciprocal", "remainder", "repeat", "reshape", "result_type", "roll",
    "round", "searchsorted", "sign", "signbit", "sin", "sinh", "sort", "sqrt", "square",
    "squeeze", "stack", "std", "subtract", "sum", "take", "take_along_axis", "tan", "tanh",
    "tensordot", "tile", "tril", "triu", "trunc", "unique_all", "unique_counts", "unique_inverse",
    "unique_values", "unstack", "var", "vecdot", "where", "zeros", "zeros_like",
)  # fmt: skip

LINALG: tuple[str, ...] = (
    "cholesky", "cross", "det", "diagonal", "eigh", "eigvalsh", "inv", "matmul", "matrix_norm",
    "matrix_power", "matrix_rank", "matrix_transpose", "outer", "pinv", "qr", "slogdet", "solve",
    "svd", "svdvals", "tensordot", "trace", "vecdot", "vector_norm",
)  # fmt: skip

FFT: tuple[str, ...] = (
    "fft", "ifft", "fftn", "ifftn", "rfft", "irfft", "rfftn", "irfftn", "hfft", "ihfft",
    "fftfreq", "rfftfreq", "fftshift", "ifftshift",
)  # fmt: skip
