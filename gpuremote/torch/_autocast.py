"""``torch.autocast(device_type="gpuremote")``: mixed precision as CUDA's autocast does it.

ATen keeps its autocast op lists in C++, registered per device; a device written in Python
registers its own for the ``AutocastPrivateUse1`` key. These are CUDA's lists (the device
stands for a GPU), each op with CUDA's cast policy:

- ``lower_precision_fp``: floating operands cast to the autocast dtype (matrix products,
  convolutions, attention);
- ``fp32``: floating operands cast to float32 (reductions and losses that lose precision);
- ``fp32_set_opt_dtype``: float32 by the op's own ``dtype`` argument, where it has none;
- ``fp32_append_dtype``: the overload taking a dtype, with float32;
- ``promote``: every floating operand to the widest floating dtype among them.

As in ATen, the casts of float32 leaf tensors that require grad (a model's weights) to the
autocast dtype are cached until the outermost autocast region exits, so a weight used
twice is cast once and its gradient accumulates once; ``binary_cross_entropy`` is refused
(use ``binary_cross_entropy_with_logits``). ``tests/test_torch_correctness.py`` checks the table
against the ops torch registers for CUDA's autocast.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ._tensors import DEVICE

__all__ = ["POLICIES", "install"]

_LOW = "lower_precision_fp"
_FP32 = "fp32"
_SET_DTYPE = "fp32_set_opt_dtype"
_APPEND_DTYPE = "fp32_append_dtype"
_PROMOTE = "promote"
_BANNED = "banned"

#: op (``packet`` or ``packet.overload``) -> CUDA's cast policy (torch 2.13 and 2.14: an op
#: that the running release does not put on CUDA's lists is not registered)
POLICIES: dict[str, str] = {
    **dict.fromkeys(
        (
            "_convolution",
            "_convolution.deprecated",
            "_cudnn_rnn",
            "_scaled_dot_product_flash_attention",
            "_thnn_fused_gru_cell",
            "_thnn_fused_lstm_cell",
            "addbmm",
            "addmm",
            "addmv",
            "addr",
            "baddbmm",
            "bmm",
            "chain_matmul",
            "conv1d",
            "conv2d",
            "conv3d",
            "conv_tbc",
            "conv_transpose1d",
            "conv_transpose2d.input",
            "conv_transpose3d.input",
            "convolution",
            "cudnn_convolution",
            "cudnn_convolution_transpose",
            "einsum",
            "gru_cell",
            "linalg_multi_dot",
            "linalg_vecdot",
            "linear",
            "lstm_cell",
            "matmul",
            "mm",
            "mv",
            "prelu",
            "rnn_relu_cell",
            "rnn_tanh_cell",
            "scaled_dot_product_attention",
        ),
        _LOW,
    ),
    **dict.fromkeys(
        (
            "_upsample_bicubic2d_aa",
            "_upsample_bilinear2d_aa",
            "_upsample_nearest_exact1d",
            "_upsample_nearest_exact2d",
            "_upsample_nearest_exact3d",
            "acos",
            "asin",
            "binary_cross_entropy_with_logits",
            "cdist",
            "cosh",
            "cosine_embedding_loss",
            "cosine_similarity",
            "dist",
            "erfinv",
            "exp",
            "expm1",
            "frobenius_norm.dim",
            "group_norm",
            "hinge_embedding_loss",
            "huber_loss",
            "kl_div",
            "l1_loss",
            "layer_norm",
            "linalg_matrix_sqrth",
            "log",
            "log10",
            "log1p",
            "log2",
            "logsumexp",
            "margin_ranking_loss",
            "mse_loss",
            "multi_margin_loss",
            "multilabel_margin_loss",
            "native_layer_norm",
            "nll_loss",
            "nll_loss2d",
            "nuclear_norm",
            "nuclear_norm.dim",
            "pdist",
            "poisson_nll_loss",
            "pow.Scalar",
            "pow.Tensor_Scalar",
            "pow.Tensor_Tensor",
            "reciprocal",
            "renorm",
            "rms_norm",
            "rsqrt",
            "sinh",
            "smooth_l1_loss",
            "soft_margin_loss",
            "softplus",
            "tan",
            "triplet_margin_loss",
            "upsample_bicubic2d",
            "upsample_bilinear2d",
            "upsample_linear1d",
            "upsample_nearest1d",
            "upsample_nearest2d",
            "upsample_nearest3d",
            "upsample_trilinear3d",
        ),
        _FP32,
    ),
    **dict.fromkeys(
        (
            "cumprod",
            "cumsum",
            "linalg_matrix_norm",
            "linalg_matrix_norm.str_ord",
            "linalg_vector_norm",
            "log_softmax.int",
            "prod",
            "prod.dim_int",
            "softmax.int",
            "sum",
            "sum.dim_IntList",
        ),
        _SET_DTYPE,
    ),
    "norm.Scalar": _APPEND_DTYPE,
    "norm.ScalarOpt_dim": _APPEND_DTYPE,
    **dict.fromkeys(
        (
            "addcdiv",
            "addcmul",
            "atan2",
            "bilinear",
            "cross",
            "dot",
            "grid_sampler",
            "index_put",
            "scatter_add",
            "tensordot",
            "vdot",
        ),
        _PROMOTE,
    ),
    "binary_cross_entropy": _BANNED,
}

#: the overload a ``fp32_append_dtype`` op is redispatched to
_APPENDED = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype"}
_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.__members__["AutocastPrivateUse1"])


class _CastCache:
    """The casts of float32 weights (leaves that require grad) to the autocast dtype, kept
    until the outermost autocast region exits (ATen's ``cached_cast``)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _entries(self) -> dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]]:
        entries = getattr(self._local, "entries", None)
        if entries is None:
            entries = self._local.entries = {}
        return entries

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        cacheable = (
            t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return t.to(dtype)
        entries = self._entries()
        found = entries.get(id(t))
        if found is not None and found[0]() is t and found[1].dtype == dtype:
            return found[1]
        cast = t.to(dtype)
        entries[id(t)] = (weakref.ref(t), cast)
        return cast

    def clear(self) -> None:
        self._entries().clear()


_cache = _CastCache()


def _eligible(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == DEVICE
        and t.is_floating_point()
        and t.dtype != torch.float64
    )


def _cast_all(value: Any, dtype: torch.dtype, low: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        if not _eligible(value) or value.dtype == dtype:
            return value
        return _cache.cast(value, dtype) if dtype == low else value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_all(v, dtype, low) for v in value)
    return value


def _widest(values: Any, low: torch.dtype) -> torch.dtype:
    """``promote``'s dtype: float32 if any eligible operand is float32, else the low one."""
    found = low
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(v)
        elif _eligible(v) and v.dtype == torch.float32:
            found = torch.float32
    return found


def _kernel(name: str, op: torch._ops.OpOverload, policy: str) -> Callable[..., Any]:
    dtype_at = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)
    appended = None
    if policy == _APPEND_DTYPE:
        appended = getattr(op.overloadpacket, _APPENDED[name])

    def kernel(*args: Any, **kwargs: Any) -> Any:
        low = torch.get_autocast_dtype(DEVICE)
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST):
            if policy == _LOW:
                return op(*_cast_all(args, low, low), **_cast_all(kwargs, low, low))
            if policy == _FP32:
                f32 = torch.float32
                return op(*_cast_all(args, f32, low), **_cast_all(kwargs, f32, low))
            if policy == _PROMOTE:
                to = _widest([*args, *kwargs.values()], low)
                return op(*_cast_all(args, to, low), **_cast_all(kwargs, to, low))
            if policy == _SET_DTYPE:
                if args and _eligible(args[0]):
                    given = (
                        args[dtype_at]
                        if dtype_at is not None and dtype_at < len(args)
                        else kwargs.get("dtype")
                    )
                    if given is None:
                        if dtype_at is not None and dtype_at < len(args):
                            args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
                        else:
                            kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if policy == _APPEND_DTYPE:
                assert appended is not None
                out = torch.float32 if args and _eligible(args[0]) else args[0].dtype
                return appended(*args, dtype=out, **kwargs)
            raise RuntimeError(
                "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
                "autocast: use binary_cross_entropy_with_logits (or BCEWithLogitsLoss), which "
                "is safe to autocast"
            )

    return kernel


def install(lib: Any, fallbacks: Any) -> None:
    """Register the autocast kernels of ``POLICIES`` with ``lib`` (an ``aten`` IMPL
    library) and every other op's passing through with ``fallbacks`` (a ``_`` IMPL
    library), and drop the cached casts where torch drops its own."""
    fallbacks.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    cuda = {
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::")
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA")
    }
    for name, policy in POLICIES.items():
        if name not in cuda:  # not on this torch release's lists
            continue
        packet_name, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet_name), overload or "default")
        lib.impl(name, _kernel(name, op, policy), "AutocastPrivateUse1")
    clear = torch.clear_autocast_cache

    def clear_autocast_cache() -> None:
        clear()
        _cache.clear()

    torch.clear_autocast_cache = clear_autocast_cache
