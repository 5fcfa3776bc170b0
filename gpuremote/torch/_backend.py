"""The ``gpuremote`` device registered with PyTorch (its PrivateUse1 backend, from Python:
no C++), once per process."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from ..config import resolve_url, url_for_rank
from ..core.driver import SyncDriver
from ..wire.calls import CALLS_BY_NAME
from . import _autocast, _encoding, _guard, _tensors
from ._dispatch import Dispatcher
from ._kernels import install
from ._tensors import DEVICE, memory_stats, retarget

__all__ = ["DEVICE", "dispatcher", "open_driver", "register"]


def _connect_default() -> SyncDriver:
    """The session of a program that used the device without ``connect``: to the
    configured URL (``GPUREMOTE_URL``, the config file, the default; where it lists one
    proxy per rank of a distributed job, this process's: ``RANK``)."""
    return SyncDriver(url_for_rank(resolve_url(), int(os.environ.get("RANK", "0") or 0)))


dispatcher = Dispatcher(_connect_default)


def open_driver(url: str | None, serve: str | None, options: dict[str, Any]) -> SyncDriver:
    """A session for the device (``serve``: a proxy in this process), seeded as
    ``torch.manual_seed`` said, if it was called before."""
    driver = SyncDriver(url, serve=serve, **options)
    if dispatcher.seed is not None:
        driver.post(CALLS_BY_NAME["aten_seed"], 0, [dispatcher.seed])
    return driver


_registered = False
#: the autocast kernels' registration, kept for the life of the process
_AUTOCAST_LIBRARIES = (torch.library.Library("aten", "IMPL"), torch.library.Library("_", "IMPL"))
_lock = threading.Lock()


class _Stream:
    """A stream of the device as code written for ``torch.cuda`` asks for one (FSDP makes
    several to overlap its copies): the session runs every op in the order it was sent, on
    one stream, so each of these is that order, and waiting between them is already done."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device(DEVICE, _index(device))
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _Event:
        event = event or _Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _DeviceModule.synchronize(self.device)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream)

    def __hash__(self) -> int:
        return hash(_Stream)


class _Event:
    """An event of the device's one stream (see ``_Stream``)."""

    def __init__(self, enable_timing: bool = False, **kwargs: Any) -> None:
        self.device: torch.device | None = None

    def record(self, stream: Any = None) -> None:
        self.device = stream.device if stream is not None else torch.device(DEVICE, 0)

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self.device is not None:
            _DeviceModule.synchronize(self.device)


class _StreamContext:
    """``with torch.gpuremote.stream(s):`` (one stream: nothing changes)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        return self.stream

    def __exit__(self, *exc: object) -> None:
        return None


class _DeviceModule:
    """``torch.gpuremote``: what PyTorch, and training code written for ``torch.cuda``
    (Hugging Face ``Trainer`` and ``accelerate``, ``torch.utils.checkpoint``, AMP), ask of a
    device's module."""

    #: (``torch.utils.checkpoint`` saves a device's random state only once it is)
    _initialized = True
    Stream = _Stream
    Event = _Event

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
        """The calling thread's current device index."""
        return _guard.current_device()

    @staticmethod
    def set_device(device: Any) -> None:
        """Make ``device`` the calling thread's current device."""
        _guard.set_device(_index(device))

    class device:
        """``with torch.gpuremote.device(i):``: ``gpuremote:i`` is current inside."""

        def __init__(self, device: Any) -> None:
            self.index = _index(device)
            self._before = 0

        def __enter__(self) -> None:
            self._before = _guard.set_device(self.index)

        def __exit__(self, *exc: object) -> None:
            _guard.set_device(self._before)

    @staticmethod
    def device_count() -> int:
        return max(1, len(dispatcher.drivers))

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        """The proxy's device, as it names it (``NVIDIA H100 ...``, ``cpu (x86_64)``)."""
        info = dispatcher.driver(_index(device)).info
        return str(info.get("device") or info.get("backend") or DEVICE)

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        """The proxy device's name, total memory and compute capability."""
        import types

        info = dispatcher.driver(_index(device)).info
        major, _, minor = str(info.get("compute_capability") or "0.0").partition(".")
        return types.SimpleNamespace(
            name=str(info.get("device") or DEVICE),
            total_memory=int(info.get("total_memory") or 0),
            major=int(major or 0),
            minor=int(minor or 0),
        )

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        """The dtypes ``torch.autocast(device_type="gpuremote")`` casts to."""
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True

    # memory: what this process's tensors on the device hold (the client knows every buffer)
    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        """Bytes of the device's buffers that this process's tensors hold now."""
        return memory_stats(_index(device)).allocated

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        """The most bytes held at once since the start or ``reset_peak_memory_stats``."""
        return memory_stats(_index(device)).peak

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        """As ``memory_allocated``: the client caches no device memory."""
        return memory_stats(_index(device)).allocated

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        return memory_stats(_index(device)).peak

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        stats = memory_stats(_index(device))
        stats.peak = stats.allocated

    @staticmethod
    def empty_cache() -> None:
        """Nothing to give back: a buffer is freed on the proxy when its last tensor dies."""

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        dispatcher.manual_seed(seed)

    @staticmethod
    def manual_seed(seed: int) -> None:
        dispatcher.manual_seed(seed)

    @staticmethod
    def get_rng_state(device: Any = "gpuremote") -> torch.Tensor:
        """The state of the session's generator on the proxy (a CPU ``uint8`` tensor)."""
        from ..wire.calls import CALLS_BY_NAME

        state, _ = dispatcher.driver(_index(device)).call(CALLS_BY_NAME["aten_rng_get"], [])
        return torch.frombuffer(bytearray.fromhex(state), dtype=torch.uint8).clone()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "gpuremote") -> None:
        """Set the session's generator to a state ``get_rng_state`` gave."""
        from ..wire.calls import CALLS_BY_NAME

        state = bytes(new_state.to("cpu", torch.uint8).contiguous().numpy()).hex()
        dispatcher.driver(_index(device)).post(CALLS_BY_NAME["aten_rng_set"], 0, [state])

    @staticmethod
    def current_stream(device: Any = None) -> Any:
        return _Stream(device)

    @staticmethod
    def default_stream(device: Any = None) -> Any:
        return _Stream(device)

    @staticmethod
    def stream(stream: Any) -> Any:
        return _StreamContext(stream)

    @staticmethod
    def set_stream(stream: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        from ..wire.calls import CALLS_BY_NAME

        dispatcher.driver(_index(device)).call(CALLS_BY_NAME["device_synchronize"], [])


def _index(device: Any) -> int:
    """The index of ``device`` (an int, a ``torch.device`` or its name; None: the current)."""
    if device is None:
        return _guard.current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != DEVICE:
            raise ValueError(f"{device} is not a {DEVICE} device")
        device = _guard.current_device() if device.index is None else device.index
    index = int(device)
    if index < 0 or (index > 0 and index not in dispatcher.drivers):
        raise RuntimeError(f"{DEVICE}:{index} is not connected")
    return index


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """The device's PrivateUse1 hooks, as PyTorch asks them: available, built."""

    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    """The device's guard for PyTorch's Python backend API (one device index)."""

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


_ALLOC = CALLS_BY_NAME["alloc"]


def _patch_storage_copies() -> None:
    """Storage copies that would reach the missing allocator (``deepcopy`` of a remote
    tensor clones its storage; ``storage.to("gpuremote")``) make the storage as a tensor's;
    a resize that would reach the missing hooks (FSDP's) keeps the storage."""
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

    type.__setattr__(base, "clone", clone_storage)
    torch.storage._to = to_device
    resize = torch.UntypedStorage.resize_

    def resize_storage(self: Any, nbytes: int) -> Any:
        """``storage.resize_(n)`` of a remote storage (FSDP frees an unsharded parameter's
        memory by ``resize_(0)`` and gets it back by ``resize_(n)`` before its all-gather):
        its buffer is freed and a new one of ``n`` bytes made (its bytes are not kept, as
        FSDP does not need them), by the guard library (PyTorch asks a device's C++ hooks
        for this). Without the library, the storage keeps its buffer for ``resize_(0)``
        (and then needs no ``resize_(n)``); any other size is refused."""
        if self.device.type != DEVICE:
            return resize(self, nbytes)
        if nbytes == self.nbytes():
            return self
        if _guard.load() is not None:
            d = dispatcher.driver(self.device.index)
            handle = 0
            if nbytes:
                handle = d.session.new_handle()
                d.post(_ALLOC, 0, [handle, nbytes])
            retarget(self, handle, nbytes)
            return self
        if nbytes == 0:
            return self
        raise RuntimeError(
            f"gpuremote: a device storage cannot be resized ({self.nbytes()} to {nbytes} "
            f"bytes) without the device guard library ({_guard.why_not()})"
        )

    type.__setattr__(torch.UntypedStorage, "resize_", resize_storage)


def _patch_module_apply() -> None:
    """``model.to("gpuremote")`` keeps a parameter shared by two modules shared (a tied
    input embedding and output layer): PyTorch converts a parameter in place only between
    devices whose tensors it counts as compatible (CPU and CUDA), and makes a new
    ``Parameter`` per module otherwise, which would untie them (their gradients then go
    to two parameters, and training differs from the CPU's without an error)."""
    module = torch.nn.Module
    apply = module._apply
    depth = threading.local()

    def _apply(self: torch.nn.Module, fn: Any, recurse: bool = True) -> Any:
        if getattr(depth, "n", 0):  # a submodule of the call being made
            return apply(self, fn, recurse)
        shared: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        for m in self.modules() if recurse else (self,):
            for name, p in m._parameters.items():
                if p is not None:
                    shared.setdefault(id(p), []).append((m, name))
        depth.n = 1
        try:
            result = apply(self, fn, recurse)
        finally:
            depth.n = 0
        for places in shared.values():
            if len(places) > 1:
                first, name = places[0]
                tied = first._parameters[name]
                for m, n in places[1:]:
                    if m._parameters[n] is not tied:
                        m._parameters[n] = tied
        return result

    type.__setattr__(module, "_apply", _apply)


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
        # the guard library's views (C++: as the CPU makes them), template signatures and
        # new tensors (C) where it builds here; else the fallback's and Python's
        # (``_guard.why_not`` says why)
        if _guard.load() is not None:
            _guard.native_keys(*_encoding.SIGNATURE_KEYS)
            _encoding.use_native(_guard.native_quick())
            _tensors.use_native(_guard.native_new_tensor())
            dispatcher.use_native(_guard.native_call())
        _autocast.install(*_AUTOCAST_LIBRARIES)
        torch.serialization.register_package(5, _tag, _restore)
        _patch_storage_copies()
        _patch_module_apply()
        _registered = True
