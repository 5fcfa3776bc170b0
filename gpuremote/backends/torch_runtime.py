"""Where a backend's buffers meet PyTorch on the proxy (``gpuremote.proxy.aten`` runs
ATen ops on them): one ``TorchRuntime`` per backend, made by ``Backend.torch_runtime()``.

This one is the CPU's, for buffers that are NumPy arrays (the NumPy backend's): tensors are
zero-copy views of them, a tensor an op made becomes a buffer as it is, and ops run at once
in the calling thread. The CuPy backend's runs ops on the session's CUDA stream
(``cupy_backend``), the simulated device's takes their time (``sim_backend``), the checker's
checks their accesses (``simcheck``). torch is imported by the caller before any of these
is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["TorchRuntime", "Unadopted"]


class TorchRuntime:
    """How one backend's buffers become tensors, and its ATen ops run, on the proxy (the
    CPU's: see the module docstring)."""

    #: a tensor an ATen op made may become a buffer as it is (``adopt`` keeps its memory),
    #: instead of being copied into one the session allocated
    keeps_results = True
    #: such a tensor is a buffer before its bytes are a buffer of the backend's
    #: (``Unadopted``: made one where something reads the buffer as one)
    adopts_later = True

    def __init__(self, backend: Any) -> None:
        #: the ``Backend`` whose buffers these are
        self.backend = backend

    def device(self) -> Any:
        """The torch device the backend's buffers live on."""
        import torch

        return torch.device("cpu")

    def buffer(self, buf: Any) -> Any:
        """Buffer ``buf`` as a flat ``torch.uint8`` tensor sharing its memory."""
        import torch

        return torch.from_numpy(buf)

    def adopt(self, tensor: Any) -> Any:
        """A buffer of the bytes of ``tensor``'s storage, which the tensor fills (its memory
        where the backend can keep it)."""
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if not nbytes:
            return np.empty(0, np.uint8)
        # NumPy's view of the storage's bytes, whatever the dtype and layout (it keeps the
        # storage alive): fewer objects made than ``tensor.numpy()`` and its reshapes
        return np.asarray(_StorageBytes(storage, storage.data_ptr(), nbytes))

    def run(
        self,
        job: Callable[[], Any],
        reads: Sequence[Any],
        writes: Sequence[Any],
        stream: Any,
        wait: bool = False,
    ) -> Any:
        """Run ``job`` (torch ops on views of buffers ``reads`` and ``writes``) in order on
        ``stream``; returns its result (``wait``: the caller needs it on the host now)."""
        self.backend.synchronize(stream)
        return job()

    #: the simulated GPU whose time ops take (``sim:a100``): ATen ops count their work then
    @property
    def profile(self) -> Any:
        return getattr(self.backend, "profile", None)

    #: ops run on shapes alone (a simulated device that times without computing)
    @property
    def computes(self) -> bool:
        return bool(getattr(self.backend, "compute", True))

    def work(self, stream: Any, flops: float, nbytes: float, dtype: Any) -> None:
        """An ATen op of ``flops`` (matrix products, convolutions, attention: 0 for the
        rest) and ``nbytes`` moved ran on ``stream``: a simulated GPU takes its time."""


class Unadopted:
    """A tensor an op made, kept as a buffer (``AtenSession.keep_as_is``) before its bytes
    are made a buffer of the backend's: most such buffers (a graph's activations and
    gradients) are only read as tensors again, by later ops that view that tensor; the
    backend's buffer is made where something reads the buffer as one
    (``SessionState.buffer``)."""

    __slots__ = ("runtime", "tensor")

    def __init__(self, runtime: TorchRuntime, tensor: Any) -> None:
        self.runtime = runtime
        self.tensor = tensor

    def adopt(self) -> Any:
        """The backend's buffer of the tensor's bytes (``TorchRuntime.adopt``)."""
        return self.runtime.adopt(self.tensor)


class _StorageBytes:
    """A torch storage's bytes as NumPy's array interface describes them (``adopt``)."""

    __slots__ = ("__array_interface__", "storage")

    def __init__(self, storage: Any, address: int, nbytes: int) -> None:
        self.storage = storage  # (kept alive by the arrays made of it)
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }
