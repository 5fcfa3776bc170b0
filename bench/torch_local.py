"""The local baseline of ``bench requirements``' PyTorch workloads: what the same program costs
on a local device, run by PyTorch alone (``--local pytorch``, the default).

- **On a simulated GPU** (``sim:a100,compute=0``): PyTorch's own host time, measured, with the
  simulated device's time overlapped as a GPU stream overlaps it. The host: the workload's
  tiny twin (``gpuremote.torch.models``, size ``"tiny"``: the real size's layers, so the same
  ATen ops in the same order, each tensor as small as they allow; ``--quick``'s small size
  stands for itself) trained with plain PyTorch
  on this machine's CPU, in the sweep's turns: the model's Python, autograd, the dispatcher,
  the allocator, with next to no compute; AdamW and the clipping on their multi-tensor
  (``foreach``) paths, PyTorch's default on a GPU; one thread and no oneDNN (whose
  convolutions take 90-240 µs an op to set up at tiny sizes here, against ~50 µs for the
  native ones). The device: the eager program's calls as its local trace recorded them, each
  with the kernel time the simulated device charged it (the time the proxy's device charges
  the same op), run on a stream that the host waits for only where the program reads a value
  (``gpuremote.tools.model.local_seconds``), the host's measured time spread over the calls
  as the trace's client time was. Meta tensors (no data, no kernels) would be the obvious
  stand-in for the host, but many of their shape functions are Python decompositions: 0.2-1.8
  ms an op here, ten times a small GPT-2's whole step on the CPU.
- **Anywhere else** (a CPU proxy): the program itself on the local CPU, plain PyTorch.

``--local inproc`` judges against the program through gpuremote's client in process on the
same device (``gpuremote.tools.direct.connect_torch``), the sweep's baseline before; every
sweep reports both.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

from gpuremote.tools.model import local_seconds

from .points import _Run, _run_queue_s
from .torch_ops import _step, _updater

__all__ = ["LocalBaseline", "local_baseline", "on_local_gpu_s"]

#: the size whose CPU run stands for PyTorch's host, by the size the sweep runs (the small
#: sizes are next to no compute already)
TWIN = {"real": "tiny", "small": "small"}


class LocalBaseline(Protocol):
    """A workload run locally, ``steps`` at a time (``host_runs_s``: the host's own time in
    each run, where the device's is simulated beside it; else empty)."""

    describe: str
    host_runs_s: list[float]

    def run(self, steps: int) -> _Run: ...


@contextlib.contextmanager
def _plain_cpu() -> Iterator[None]:
    """PyTorch on one thread of the CPU, oneDNN off, meanwhile (see the module docstring)."""
    import torch

    onednn: Any = torch.backends.mkldnn  # (its flags() context warns of Intel GPUs)
    threads, enabled = torch.get_num_threads(), onednn.enabled
    torch.set_num_threads(1)
    onednn.enabled = False
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        onednn.enabled = enabled


class _Trained:
    """A workload's model training on the local CPU with plain PyTorch (AdamW, clipped
    gradients, a read of the loss each step), warmed up."""

    def __init__(self, w: Any, model: Any, foreach: bool | None) -> None:
        import torch

        self.w, self.model = w, model
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=1e-4, weight_decay=0.01, foreach=foreach
        )
        self.update = _updater(model, self.opt)
        self.x, self.y = w.batch(torch.Generator().manual_seed(1))
        for _ in range(2):
            self.step()

    def step(self) -> None:
        _step(self.w, self.model, self.opt, self.x, self.y, self.update)

    def run(self, steps: int) -> tuple[float, float]:
        """(seconds, seconds this thread waited for a CPU) of ``steps`` steps."""
        stolen, start = _run_queue_s(), time.perf_counter()
        for _ in range(steps):
            self.step()
        return time.perf_counter() - start, _run_queue_s() - stolen


def on_local_gpu_s(trace: list[Any], host_s: float) -> float:
    """The time of ``trace`` (calls with their simulated kernels) on a local GPU whose host
    takes ``host_s`` in all: the host's time spread over the calls as the trace's client time
    was, the kernels on a stream in parallel, waited for at the reads."""
    client = sum(t.gap_s + t.device_s for t in trace)
    k = host_s / client if client > 0 else 0.0
    return local_seconds([replace(t, gap_s=t.gap_s * k, device_s=t.device_s * k) for t in trace])


class _SimulatedGpu:
    """PyTorch's host (the tiny twin, measured) beside the simulated device's kernels."""

    def __init__(self, name: str, size: str, trace: list[Any], steps: int) -> None:
        import torch

        from gpuremote.torch.models import workload

        self.trace, self.steps = trace, steps
        self.host_runs_s: list[float] = []  # PyTorch's own time, each run
        twin = workload(name, TWIN[size])
        torch.manual_seed(0)
        with _plain_cpu():
            self.twin = _Trained(twin, twin.make(), foreach=True)
        self.describe = (
            "PyTorch on a local GPU: its host time measured (the tiny twin on this CPU), "
            "the simulated device's kernels overlapped"
        )

    def run(self, steps: int) -> _Run:
        if steps != self.steps:
            raise ValueError(f"the trace holds {self.steps} steps, not {steps}")
        with _plain_cpu():
            host, stolen = self.twin.run(steps)
        self.host_runs_s.append(host)
        return _Run(on_local_gpu_s(self.trace, host), 0.0, 0.0, 0.0, 0.0, stolen)


class _LocalCpu:
    """The program itself on the local CPU, plain PyTorch."""

    describe = "PyTorch on the local CPU"

    def __init__(self, w: Any, cpu_model: Any) -> None:
        self.host_runs_s: list[float] = []
        self.program = _Trained(w, copy.deepcopy(cpu_model), foreach=None)

    def run(self, steps: int) -> _Run:
        wall, stolen = self.program.run(steps)
        return _Run(wall, 0.0, 0.0, 0.0, 0.0, stolen)


def local_baseline(
    w: Any, size: str, cpu_model: Any, device: Any, eager_trace: list[Any], steps: int
) -> LocalBaseline:
    """PyTorch's local run of workload ``w`` at ``size`` where the sweep's device is
    ``device`` (a backend): on a device that times itself by a profile, a local GPU of that
    profile; else the local CPU. ``eager_trace``: the eager program's calls over ``steps``
    steps."""
    if getattr(device, "profile", None) is not None:
        return _SimulatedGpu(w.name, size, eager_trace, steps)
    return _LocalCpu(w, cpu_model)
