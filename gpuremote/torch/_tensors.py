"""Remote tensors: plain ``torch.Tensor`` objects on the ``gpuremote`` device whose identity
lives on their storage.

A remote buffer is a storage with a fake data pointer, ``handle << 32`` (never dereferenced:
no kernel of this process runs on the device), so that every view of it, and every tensor
autograd saves, names the same buffer. When the storage's last view dies a finalizer frees
the buffer on the proxy (in order with the calls around it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..wire.protocol import extent

__all__ = [
    "DEVICE",
    "byte_desc",
    "contiguous_strides",
    "describe",
    "extent",
    "handle_of",
    "is_remote",
    "memory_stats",
    "new_storage",
    "new_tensor",
    "retarget",
    "tensor_on",
]

#: the name of the device (PyTorch's PrivateUse1 backend, renamed)
DEVICE = "gpuremote"
#: a remote buffer's fake data pointer is its handle shifted by this
SHIFT = 32
_SHIFT = SHIFT
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_set_storage = torch.ops.aten.set_.source_Storage_storage_offset
#: torch dtype -> its name on the wire
DTYPE_NAMES: dict[torch.dtype, str] = {
    getattr(torch, n): n
    for n in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "complex32",
    )
}


def new_tensor(
    handle: int,
    nbytes: int,
    sizes: Any,
    strides: Any,
    dtype: torch.dtype,
    index: int,
    release: Callable[[int, int], None],
) -> torch.Tensor:
    """A tensor over remote buffer ``handle`` of ``nbytes`` on device ``gpuremote:index``;
    ``release(handle, nbytes)`` frees the buffer when the storage's last view dies."""
    native = _native_new
    if native is None:
        storage = new_storage(handle, nbytes, index, release)
        return tensor_on(storage, 0, sizes, strides, dtype, index)
    t, storage = native(handle << _SHIFT, nbytes, sizes, strides, dtype, index)
    _adopt(storage, handle, nbytes, index, release)
    return t


def use_native(new: Callable[..., tuple[torch.Tensor, Any]] | None) -> None:
    """``new_tensor`` by the guard library's ``new_tensor`` (its storage and tensor in one
    call), or by PyTorch's Python API with None."""
    global _native_new
    _native_new = new


#: ``new_tensor``'s way where the guard library is loaded (``use_native``)
_native_new: Callable[..., tuple[torch.Tensor, Any]] | None = None


def new_storage(handle: int, nbytes: int, index: int, release: Callable[[int, int], None]) -> Any:
    """The storage of remote buffer ``handle`` (see ``new_tensor``)."""
    device = _DEVICES.get(index)
    if device is None:
        device = _DEVICES[index] = torch.device(DEVICE, index)
    storage = torch._C._construct_storage_from_data_pointer(handle << _SHIFT, device, nbytes)
    _adopt(storage, handle, nbytes, index, release)
    return storage


def _adopt(
    storage: Any, handle: int, nbytes: int, index: int, release: Callable[[int, int], None]
) -> None:
    """``storage`` frees remote buffer ``handle`` by ``release`` when it dies; counted."""
    _LIVE[weakref.ref(storage, _died)] = (release, handle, nbytes, index)
    stats = _STATS.get(index) or memory_stats(index)
    stats.allocated += nbytes
    if stats.allocated > stats.peak:
        stats.peak = stats.allocated
    return storage


class MemoryStats:
    """The bytes this process's tensors hold on one device, now and at most."""

    __slots__ = ("allocated", "peak")

    def __init__(self) -> None:
        self.allocated = 0
        self.peak = 0


def memory_stats(index: int) -> MemoryStats:
    """Device ``gpuremote:index``'s ``MemoryStats``."""
    stats = _STATS.get(index)
    if stats is None:
        stats = _STATS[index] = MemoryStats()
    return stats


_STATS: dict[int, MemoryStats] = {}


def tensor_on(
    storage: Any, offset: int, sizes: Any, strides: Any, dtype: torch.dtype, index: int = -1
) -> torch.Tensor:
    """A tensor viewing remote ``storage`` (``offset`` in elements of ``dtype``) on device
    ``index`` (-1: the storage's)."""
    if index < 0:
        index = storage.device.index or 0
    if index:  # (PyTorch's Python factory makes index 0 only: the guard library's does)
        from ._guard import empty_on

        t = empty_on(index, dtype)
    else:
        t = torch._C._acc.create_empty_tensor((0,), dtype)
    _set_storage._handle.redispatch_boxed(_CPU_KEYS, t, storage, offset, sizes, strides)
    return t


_DEVICES: dict[int, torch.device] = {}
#: the storages alive (weakly) -> how to free their buffers when they die
_LIVE: dict[weakref.ref[Any], tuple[Callable[[int, int], None], int, int, int]] = {}


def _died(ref: weakref.ref[Any]) -> None:
    """A storage's last view died: its buffer is freed (from any thread)."""
    entry = _LIVE.pop(ref, None)
    if entry is not None:
        release, handle, nbytes, index = entry
        _STATS[index].allocated -= nbytes
        if handle:  # (0: resized to nothing)
            release(handle, nbytes)


def retarget(storage: Any, handle: int, nbytes: int) -> None:
    """Remote ``storage`` (resized) holds buffer ``handle`` of ``nbytes`` now (0: none): the
    buffer it held is freed, in order with the calls around it."""
    from ._guard import set_storage

    ref = weakref.ref(storage)
    release, old, old_nbytes, index = _LIVE[ref]
    set_storage(storage, handle << _SHIFT, nbytes, index)
    _LIVE[ref] = (release, handle, nbytes, index)
    stats = _STATS[index]
    stats.allocated += nbytes - old_nbytes
    if stats.allocated > stats.peak:
        stats.peak = stats.allocated
    if old:
        release(old, old_nbytes)


def is_remote(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == DEVICE


def handle_of(t: torch.Tensor) -> int:
    """The remote buffer tensor ``t`` is a view of."""
    return int(t.untyped_storage().data_ptr()) >> _SHIFT


def describe(t: torch.Tensor) -> list[Any]:
    """``t`` as a strided tensor on the wire: [handle, offset, sizes, strides, dtype]."""
    return [
        int(t.untyped_storage().data_ptr()) >> _SHIFT,
        t.storage_offset() * t.element_size(),
        list(t.shape),
        list(t.stride()),
        DTYPE_NAMES[t.dtype],
    ]


def byte_desc(t: torch.Tensor) -> list[Any]:
    """The bytes of contiguous tensor ``t`` as an array on the wire (a flat uint8 array)."""
    size = t.element_size()
    return [handle_of(t), t.storage_offset() * size, [t.numel() * size], "uint8"]


def contiguous_strides(sizes: Sequence[int]) -> list[int]:
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(int(sizes[i + 1]), 1)
    return strides
