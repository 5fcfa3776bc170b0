"""An ATen op's arguments on the wire (``gpuremote.proxy.aten`` decodes them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._tensors import DEVICE, DTYPE_NAMES, SHIFT

__all__ = ["SIGNATURE_KEYS", "Encoder", "quick_signature", "use_native"]

#: a float NaN, and the booleans, in an op's signature (each equals only itself there)
_NAN, _TRUE, _FALSE = ("float", "nan"), ("bool", True), ("bool", False)
#: those three, for the guard library's ``quick`` (``_guard.native_keys``)
SIGNATURE_KEYS = (_NAN, _TRUE, _FALSE)
#: this device (``gpuremote``, ``gpuremote:0``, by torch's type): an operand on it needs no
#: other look (a ``torch.device``'s ``type`` makes a string each time it is read)
_REMOTE = frozenset({torch.device("privateuseone"), torch.device("privateuseone", 0)})


class Encoder:
    """An op's arguments to their wire form (call it on each): remote tensors as
    ``{"t": i}`` into ``tensors`` (CPU scalars, which ATen takes beside device tensors, are
    ``upload``-ed first), dtypes, devices, layouts and memory formats by name; and the op's
    signature for the metadata cache, built on the way (``signature()``)."""

    __slots__ = (
        "cpu_indices",
        "device_index",
        "floats",
        "floats_matter",
        "places",
        "sig",
        "tensors",
        "upload",
    )

    def __init__(
        self,
        tensors: list[torch.Tensor],
        upload: Callable[[torch.Tensor], torch.Tensor],
        floats_matter: bool = True,
        cpu_indices: bool = False,
        device_index: int | None = None,
    ) -> None:
        self.tensors = tensors
        #: the op's device, where the process has several: every operand must be on it
        self.device_index = device_index
        self.upload = upload
        #: CPU tensors of any shape are uploaded (an indexing op's indices), not only scalars
        self.cpu_indices = cpu_indices
        #: False: the signature has a float argument's type, not its value (an in-place op's
        #: metadata does not depend on it: an optimizer's step sizes change at every step)
        self.floats_matter = floats_matter
        self.sig: list[Any] = []
        #: where each tensor is: its buffer's handle and its offset in bytes, flat
        self.places: list[int] = []
        #: the float arguments' values, in order (a template's call sends them)
        self.floats: list[float] = []

    @property
    def descs(self) -> list[list[Any]]:
        """Each tensor's wire form [handle, offset, sizes, strides, dtype], as encoded."""
        p = self.places
        return [
            [p[2 * i], p[2 * i + 1], list(t.shape), list(t.stride()), DTYPE_NAMES[t.dtype]]
            for i, t in enumerate(self.tensors)
        ]

    def __call__(self, a: Any) -> Any:
        t = type(a)
        if a is None or t is int or t is str:
            self.sig.append(a)
            return a
        if t is float:
            # its type in the signature (2.0 == 2, and their ops' results differ); its value
            # where it matters (NaN as one value: it equals nothing, itself included)
            self.floats.append(a)
            self.sig.append(float)
            if self.floats_matter:
                self.sig.append(a if a == a else _NAN)
            return a
        if t is bool:
            self.sig.append(_TRUE if a else _FALSE)  # (True == 1)
            return a
        if isinstance(a, torch.Tensor):
            device = a.device
            if device not in _REMOTE and (a.is_cpu or device.type != DEVICE):  # (is_remote)
                if not a.is_cpu or (a.dim() != 0 and not self.cpu_indices):
                    raise RuntimeError(
                        f"Expected all tensors to be on the same device, but found a {a.device} "
                        f"tensor of shape {list(a.shape)} beside {DEVICE} tensors"
                    )
                a = self.upload(a)
            elif self.device_index is not None and (device.index or 0) != self.device_index:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two "
                    f"devices, {DEVICE}:{self.device_index} and {a.device}!"
                )
            if a.is_conj() or a.is_neg():  # lazy bits: the proxy's views are the bytes
                a = a.resolve_conj().resolve_neg()
            self.tensors.append(a)
            self.places += (
                a.untyped_storage().data_ptr() >> SHIFT,
                a.storage_offset() * a.element_size(),
            )
            self.sig.append((tuple(a.shape), a.stride(), a.dtype))
            return {"t": len(self.tensors) - 1}
        if isinstance(a, (list, tuple)):
            self.sig.append("[")
            out = [self(x) for x in a]
            self.sig.append("]")
            return out
        if isinstance(a, torch.dtype):
            self.sig.append(a)
            return {"dtype": DTYPE_NAMES[a]}
        if isinstance(a, torch.device):
            self.sig.append(a)
            return {"device": 0}
        if isinstance(a, torch.layout):
            self.sig.append(a)
            return {"layout": str(a).removeprefix("torch.")}
        if isinstance(a, torch.memory_format):
            self.sig.append(a)
            return {"mf": str(a).removeprefix("torch.")}
        if isinstance(a, complex):
            self.sig.append(a)
            return {"c": [a.real, a.imag]}
        if isinstance(a, torch.Generator):
            raise RuntimeError(
                "gpuremote: ops take the session's generator on the proxy (seed it with "
                "torch.manual_seed); a torch.Generator cannot be passed"
            )
        if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            raise RuntimeError("gpuremote: symbolic sizes cannot be sent")
        raise TypeError(f"gpuremote: an argument of type {type(a).__name__} cannot be sent")

    def keywords(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments, each encoded, their names in the signature (PyTorch passes a
        keyword only where it differs from its default: ``bucketize(x, b, right=True)``
        and ``bucketize(x, b, out_int32=True)`` encode the same values)."""
        out = {}
        for k, v in kwargs.items():
            self.sig.append(k)
            out[k] = self(v)
        return out

    def signature(self) -> tuple[Any, ...]:
        return tuple(self.sig)

    def signature_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        self.sig = []
        tensors, places, floats = self.tensors, self.places, self.floats
        self.tensors, self.places, self.floats = [], [], []
        for a in args:
            self(a)
        for k, v in kwargs.items():
            self.sig.append(k)
            self(v)
        self.tensors, self.places, self.floats = tensors, places, floats
        return tuple(self.sig)


def quick_signature(
    args: tuple[Any, ...], kwargs: dict[str, Any], floats_matter: bool
) -> tuple[list[Any], list[Any], list[float]] | None:
    """``Encoder``'s signature, places and floats of ``args`` and ``kwargs`` (as
    ``Encoder.keywords`` has them), without their wire form (an op kept by template sends
    only those), where each argument is a number, None, a string, a dtype, a memory format,
    a layout, a tensor on this device (no lazy conj or neg bits) or a list of those; None for
    anything else (``Encoder`` then: it uploads CPU scalars, says what is wrong)."""
    sig: list[Any] = []
    places: list[Any] = []  # (ints)
    floats: list[float] = []
    quick = _quick_way
    if not quick(args, sig, places, floats, floats_matter):
        return None
    for k, v in kwargs.items():  # (an optimizer's ``alpha=``, ``value=``)
        sig.append(k)
        if not quick((v,), sig, places, floats, floats_matter):
            return None
    return sig, places, floats


def use_native(quick: Callable[..., bool] | None) -> None:
    """``quick_signature`` by ``quick`` (the guard library's ``_quick`` in C: the same
    appends), or by ``_quick`` with None."""
    global _quick_way
    _quick_way = quick or _quick


def _quick(
    values: Any, sig: list[Any], places: list[Any], floats: list[float], matter: bool
) -> bool:
    """``values``' signature appended to ``sig``, their tensors' places to ``places``, their
    floats to ``floats``; False at an argument it does not take."""
    append = sig.append
    for a in values:
        t = type(a)
        if a is None or t is int or t is str:
            append(a)
        elif t is float:  # (as ``Encoder`` has it)
            floats.append(a)
            append(float)
            if matter:
                append(a if a == a else _NAN)
        elif t is bool:
            append(_TRUE if a else _FALSE)
        elif isinstance(a, torch.Tensor):
            if a.device not in _REMOTE or a.is_conj() or a.is_neg():
                return False
            places += (
                a.untyped_storage().data_ptr() >> SHIFT,
                a.storage_offset() * a.element_size(),
            )
            append((a.shape, a.stride(), a.dtype))  # (a ``torch.Size`` hashes as its tuple)
        elif t is list or t is tuple:
            append("[")
            if not _quick(a, sig, places, floats, matter):
                return False
            append("]")
        elif t is torch.dtype or t is torch.memory_format or t is torch.layout:
            append(a)
        else:
            return False
    return True


#: ``quick_signature``'s way (``use_native``)
_quick_way: Callable[..., bool] = _quick
