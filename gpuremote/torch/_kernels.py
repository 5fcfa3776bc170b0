"""The ``gpuremote`` device's kernels, registered with PyTorch's dispatcher for the
PrivateUse1 key: factories, transfers and ``resize_`` of its own; convolution and attention,
which ATen routes by device type; and every other op through the ``Dispatcher``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._dispatch import Dispatcher, NeedsData, contiguous_strides, restride
from ._tensors import DEVICE

__all__ = ["install"]

#: ``_fused_sdp_choice``'s answers for the math and the flash attention kernels
_SDP_MATH, _SDP_FLASH = 0, 1


def install(dispatcher: Dispatcher) -> None:
    """Register ``dispatcher``'s kernels for the PrivateUse1 key (once per process)."""
    lib = torch.library.Library("aten", "IMPL")
    _LIBRARIES.append(lib)

    def empty_memory_format(
        size: Any,
        dtype: torch.dtype | None = None,
        layout: Any = None,
        device: torch.device | None = None,
        pin_memory: bool | None = None,
        memory_format: torch.memory_format | None = None,
    ) -> torch.Tensor:
        sizes = list(size)
        if memory_format is None or memory_format is torch.contiguous_format:
            strides = contiguous_strides(sizes)  # (as the meta tensor below has them: 3 µs)
        else:
            strides = list(torch.empty(size, device="meta", memory_format=memory_format).stride())
        return dispatcher.empty(sizes, strides, dtype, device)

    def empty_strided(
        size: Any,
        stride: Any,
        dtype: torch.dtype | None = None,
        layout: Any = None,
        device: torch.device | None = None,
        pin_memory: bool | None = None,
    ) -> torch.Tensor:
        return dispatcher.empty(list(size), list(stride), dtype, device)

    def copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> Any:
        return dispatcher.transfers.copy_from(self, dst, non_blocking)

    def copy_from_and_resize(self: torch.Tensor, dst: torch.Tensor) -> Any:
        if dst.numel() == 0:
            dst.resize_(self.shape)
        return dispatcher.transfers.copy_from(self, dst)

    def resize_(
        self: torch.Tensor, size: Any, memory_format: torch.memory_format | None = None
    ) -> torch.Tensor:
        fmt = memory_format or torch.contiguous_format
        strides = torch.empty(size, device="meta", memory_format=fmt).stride()
        restride(self, list(size), list(strides))
        return self

    aten = torch.ops.aten

    def convolution(*args: Any) -> Any:  # ATen's entry for devices it does not know
        return _call(dispatcher, aten.convolution.default, args, {})

    def convolution_backward(
        grad_output: torch.Tensor,
        input: torch.Tensor,
        weight: torch.Tensor,
        *rest: Any,
    ) -> Any:
        *conv, output_mask = rest  # stride, padding, dilation, transposed, out padding, groups
        # the bias has one value per output channel: a transposed weight is (in, out / groups)
        bias_sizes = [weight.shape[1] * conv[5] if conv[3] else weight.shape[0]]
        return _call(
            dispatcher,
            aten.convolution_backward.default,
            (grad_output, input, weight, bias_sizes, *conv, output_mask),
            {},
        )

    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Any:
        # ATen picks an attention kernel from a table keyed by device type, where this device
        # has none (it would take the math path, which rounds differently): the proxy's
        # choice for these inputs, asked once per signature, and that kernel
        args = (query, key, value, attn_mask, dropout_p, is_causal)
        options = {"scale": scale, "enable_gqa": enable_gqa}
        choice = dispatcher.run(aten._fused_sdp_choice.default, _real(args), options)
        if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
            choice = _SDP_MATH  # as the CPU chooses: the flash kernel has no mask gradient
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # as ATen does before either kernel: a boolean mask as an additive one (0 where
            # True, -inf where False) in the query's dtype
            additive = torch.zeros_like(attn_mask, dtype=query.dtype)
            attn_mask = additive.masked_fill_(attn_mask.logical_not(), float("-inf"))
        cpu = dispatcher.driver(query.device.index).info.get("backend") != "cupy"
        if choice == _SDP_FLASH and cpu:
            # the kernel takes (batch, heads, tokens, features): unbatched inputs (which
            # torch 2.14 sends this way) as a batch of one
            unbatched = query.dim() == 3
            if unbatched:
                query, key, value = query[None], key[None], value[None]
                if attn_mask is not None and attn_mask.dim() == 3:
                    attn_mask = attn_mask[None]
            out = aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]
            return out[0] if unbatched else out
        return aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, **options
        )[0]

    def _real(args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The arguments, where ``torch.compile`` traces with fake tensors: real tensors of
        their layouts (uninitialised: the choice depends on the layouts alone)."""
        from torch.utils._python_dispatch import _disable_current_modes

        if all(
            not isinstance(a, torch.Tensor)
            or (
                type(a) in (torch.Tensor, torch.nn.Parameter) and not torch._is_functional_tensor(a)
            )
            for a in args
        ):
            return args
        functional = torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
        with _disable_current_modes(), torch._C._ExcludeDispatchKeyGuard(functional):
            return tuple(
                torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                if isinstance(a, torch.Tensor)
                else a
                for a in args
            )

    for key in ("PrivateUse1", "AutogradPrivateUse1"):
        lib.impl("scaled_dot_product_attention", attention, key)
        # ATen's recurrent layers take fused cells on every device but the CPU, kernels that
        # only CUDA has: the cells' arithmetic here, in ops any proxy runs (autograd
        # differentiates them; results as the CPU's within rounding, not bitwise)
        lib.impl("_thnn_fused_lstm_cell", _lstm_cell, key)
        lib.impl("_thnn_fused_gru_cell", _gru_cell, key)
    lib.impl("convolution_overrideable", convolution, "PrivateUse1")
    lib.impl("convolution_backward_overrideable", convolution_backward, "PrivateUse1")

    def zero_tensor(
        size: Any,
        dtype: torch.dtype | None = None,
        layout: Any = None,
        device: torch.device | None = None,
        pin_memory: bool | None = None,
    ) -> torch.Tensor:
        # autograd's zero gradients: a new buffer is zero already (the proxy zeroes memory)
        return dispatcher.empty(list(size), contiguous_strides(size), dtype, device)

    lib.impl("_efficientzerotensor", zero_tensor, "PrivateUse1")

    def item_of_meta(self: torch.Tensor) -> Any:
        # torch's own message, as a type the metadata step tells apart from an argument error
        raise NeedsData("Tensor.item() cannot be called on meta tensors")

    lib.impl("_local_scalar_dense", item_of_meta, "Meta")

    def pin_memory(self: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        # host memory for this device (a DataLoader's ``pin_memory=True`` asks for it): the
        # device's copies go by the network, from any host memory; a copy, as pinning is
        if device is not None and device.type != DEVICE:
            raise RuntimeError(f"pinned memory for {device} is not available in this build")
        return self.clone(memory_format=torch.contiguous_format)

    # a CPU tensor's kernel (every other device's pinned memory comes from its C++ hooks)
    lib.impl("_pin_memory", pin_memory, "CPU")
    lib.impl("empty.memory_format", empty_memory_format, "PrivateUse1")
    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    # the lazy conjugate and negative bits: the copy makes the values physical itself
    # (ATen's fallback for these bits would clone, which copies, which reaches it again)
    for key in ("PrivateUse1", "Conjugate", "Negative"):
        lib.impl("_copy_from", copy_from, key)
        lib.impl("_copy_from_and_resize", copy_from_and_resize, key)
    lib.impl("resize_", resize_, "PrivateUse1")

    def fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
        native = dispatcher.native  # (the call by template in C, where it is made so)
        if native is not None:
            made = native[0](native[1], op, args, kwargs)
            if made is not native[2]:
                return made
        return dispatcher.run(op, args, kwargs)

    for name in _with_cpu_kernels():
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet), overload or "default")
        lib.impl(name, _kernel(dispatcher, op), "PrivateUse1")

    # ``clone`` (composite: an empty tensor, made by Python, and a copy into it; every
    # ``contiguous()`` of a non-contiguous view, 84 a GPT-2 training step) as one call
    whole_clone = _kernel(dispatcher, aten.clone.default)

    def clone(self: torch.Tensor, *, memory_format: torch.memory_format | None = None) -> Any:
        if self.is_conj() or self.is_neg():  # (the copy resolves the bits: ATen's composite)
            fmt = memory_format or torch.preserve_format
            return torch.empty_like(self, memory_format=fmt).copy_(self)
        if memory_format is None:
            return whole_clone(self)
        return whole_clone(self, memory_format=memory_format)

    lib.impl("clone", clone, "PrivateUse1")

    fb = torch.library.Library("_", "IMPL")
    _LIBRARIES.append(fb)
    fb.fallback(fallback, dispatch_key="PrivateUse1", with_keyset=False)


def _lstm_cell(
    input_gates: torch.Tensor,
    hidden_gates: torch.Tensor,
    cx: torch.Tensor,
    input_bias: torch.Tensor | None = None,
    hidden_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gates = input_gates + hidden_gates
    if input_bias is not None and hidden_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = gates.chunk(4, 1)
    cy = f.sigmoid() * cx + i.sigmoid() * g.tanh()
    hy = o.sigmoid() * cy.tanh()
    return hy, cy, gates  # (the workspace: what a fused backward would read)


def _gru_cell(
    input_gates: torch.Tensor,
    hidden_gates: torch.Tensor,
    hx: torch.Tensor,
    input_bias: torch.Tensor | None = None,
    hidden_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if input_bias is not None and hidden_bias is not None:
        input_gates = input_gates + input_bias
        hidden_gates = hidden_gates + hidden_bias
    ir, ii, in_ = input_gates.chunk(3, 1)
    hr, hi, hn = hidden_gates.chunk(3, 1)
    reset = (ir + hr).sigmoid()
    update = (ii + hi).sigmoid()
    new = (in_ + reset * hn).tanh()
    return (hx - new) * update + new, torch.cat([input_gates, hidden_gates], 1)


#: ops this module gives kernels of its own, or that must stay composite here
_HANDLED = frozenset(
    {
        "empty",
        "empty_strided",
        "_copy_from",
        "_copy_from_and_resize",
        "resize_",
        "copy_",
        "_efficientzerotensor",
    }
)


def _with_cpu_kernels() -> list[str]:
    """The ATen ops (``packet.overload``) that have a CPU kernel of their own besides a
    composite one: registered for the device, so that they reach the proxy whole and run
    the CPU's (or GPU's) kernel there, not a decomposition (which rounds differently:
    ``native_layer_norm`` decomposes to ``native_batch_norm`` and ``addcmul``)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    out = []
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::") or not has(full, "CPU"):
            continue
        if not (
            has(full, "CompositeExplicitAutograd")
            or has(full, "CompositeExplicitAutogradNonFunctional")
            # a decomposition for other devices beside the CPU's kernel (``mish_backward``):
            # the CPU's autograd uses the kernel too, so the device's may
            or has(full, "CompositeImplicitAutograd")
        ):
            continue
        name = full.removeprefix("aten::")
        if name.partition(".")[0] in _HANDLED or name.startswith("set_"):
            continue
        out.append(name)
    return out + _foreach_ops()


def _foreach_ops() -> list[str]:
    """The ``_foreach_`` ops whose kernel for the CPU (and so for this device) is a
    composite loop of one op per tensor: registered for the device, so that each is one
    call (an optimizer's step over every parameter in a few calls), run by the proxy's
    kernel (a GPU's fused one)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return [
        full.removeprefix("aten::")
        for full in torch._C._dispatch_get_all_op_names()
        if full.startswith("aten::_foreach_")
        and has(full, "CompositeExplicitAutograd")
        and not has(full, "CPU")
    ]


def _call(
    dispatcher: Dispatcher, op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``op``'s call: by template in C where the guard library makes it so, else ``run``."""
    native = dispatcher.native
    if native is not None:
        made = native[0](native[1], op, args, kwargs)
        if made is not native[2]:
            return made
    return dispatcher.run(op, args, kwargs)


def _kernel(dispatcher: Dispatcher, op: torch._ops.OpOverload) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        native = dispatcher.native  # (as ``fallback``)
        if native is not None:
            made = native[0](native[1], op, args, kwargs)
            if made is not native[2]:
                return made
        return dispatcher.run(op, args, kwargs)

    return kernel


#: the registrations, kept for the life of the process
_LIBRARIES: list[Any] = []
