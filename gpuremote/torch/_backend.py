"""The ``gpuremote`` device registered with PyTorch (its PrivateUse1 backend, from Python:
no C++), once per process."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from ..core.driver import SyncDriver
from ._dispatch import Dispatcher
from ._kernels import install
from ._tensors import DEVICE

__all__ = ["DEVICE", "dispatcher", "register"]


def _connect_default() -> SyncDriver:
    """The session of a program that used the device without ``connect``: to the
    configured URL (``GPUREMOTE_URL``, the config file, the default)."""
    return SyncDriver()


dispatcher = Dispatcher(_connect_default)
_registered = False
_lock = threading.Lock()


class _DeviceModule:
    """``torch.gpuremote``: what PyTorch asks a device's module."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return max(1, len(dispatcher.drivers))

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        dispatcher.manual_seed(seed)

    @staticmethod
    def manual_seed(seed: int) -> None:
        dispatcher.manual_seed(seed)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        from ..wire.calls import CALLS_BY_NAME

        index = device.index if isinstance(device, torch.device) else device
        dispatcher.driver(index).call(CALLS_BY_NAME["device_synchronize"], [])


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self) -> Any:
        return torch._C._autograd.DeviceType.PrivateUse1


def _tag(storage: Any) -> str | None:
    """``torch.save``'s location tag of a remote storage (its data is saved from the host)."""
    device = getattr(storage, "device", None)
    if isinstance(device, torch.device) and device.type == DEVICE:
        return f"{DEVICE}:{device.index or 0}"
    return None


def _restore(storage: Any, location: str) -> Any:
    """``torch.load``'s storage for location ``gpuremote[:i]``: the host data uploaded."""
    if not location.startswith(DEVICE):
        return None
    remote = torch.empty(storage.nbytes(), dtype=torch.uint8, device=location)
    if storage.nbytes():
        remote.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    return remote.untyped_storage()


def _new_storage(nbytes: int, device: torch.device) -> Any:
    """A remote storage of ``nbytes`` (PyTorch makes storages through the device's C++
    allocator, which a Python backend has not: ``torch.UntypedStorage(n, device=...)``)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()


def _patch_storage_copies() -> None:
    """Storage copies that would reach the missing allocator (``deepcopy`` of a remote
    tensor clones its storage; ``storage.to("gpuremote")``) make the storage as a tensor's."""
    base = torch.storage._StorageBase
    clone = base.clone
    to = torch.storage._to

    def clone_storage(self: Any) -> Any:
        if self.device.type == DEVICE:
            return _new_storage(self.nbytes(), self.device).copy_(self)
        return clone(self)

    def to_device(self: Any, device: Any, non_blocking: bool = False) -> Any:
        device = torch.device(device)
        if device.type == DEVICE and self.device != device:
            return _new_storage(self.nbytes(), device).copy_(self)
        return to(self, device, non_blocking)

    base.clone = clone_storage  # type: ignore[method-assign]
    torch.storage._to = to_device


def register() -> None:
    """Make ``gpuremote`` a torch device (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        _setup_privateuseone_for_python_backend(
            DEVICE, backend_module=_DeviceModule(), hook=_Hooks(), device_guard=_Guard()
        )
        install(dispatcher)
        torch.serialization.register_package(5, _tag, _restore)
        _patch_storage_copies()
        _registered = True
