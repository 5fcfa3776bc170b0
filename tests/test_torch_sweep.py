"""The paper's PyTorch programs on the paper's grid: the local baseline (``connect_torch``),
a device that times ops without computing them (real sizes anywhere), and ``bench
requirements`` over ``emu+inproc`` for ResNet-18, BERT and GPT-2, eager and compiled."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="gpuremote.torch needs the [torch] extra")

from gpuremote.bench.requirements import RequirementsConfig, run_requirements  # noqa: E402
from gpuremote.bench.torch_local import _plain_cpu, on_local_gpu_s  # noqa: E402

from gpuremote.tools.direct import TraceEntry, connect_torch  # noqa: E402
from gpuremote.torch.models import train, workload  # noqa: E402


def test_the_local_baseline_runs_the_ops_at_once_and_traces_them() -> None:
    w = workload("gpt2", "small")
    expected = train(w, "cpu", 2)
    with connect_torch("numpy") as conn:
        got = train(w, "gpuremote", 2)
        trace = conn.drivers[0].session.trace
    assert got[0] == expected[0]
    # (each op a whole call: a direct session keeps no templates)
    assert {e.call for e in trace} >= {"aten", "alloc", "copy_h2d", "copy_d2h"}
    assert all(e.gap_s >= 0 and e.device_s >= 0 for e in trace)


def _aten_ops(w: Any, device: str) -> list[str]:
    """The ATen ops of one training step of ``w`` on ``device`` (AdamW and the clipping on
    their multi-tensor paths, as on a GPU), after a warm-up step."""
    from gpuremote.bench.torch_ops import _step, _updater
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    with torch.device(device):
        model = w.make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    x, y = (t.to(device) for t in w.batch(torch.Generator().manual_seed(1)))
    update = _updater(model, opt)
    _step(w, model, opt, x, y, update)
    with Ops() as ops:
        _step(w, model, opt, x, y, update)
    return ops.names


@pytest.mark.parametrize("name", ["resnet18", "bert", "gpt2"])
def test_the_tiny_twin_runs_the_real_sizes_ops(name: str, monkeypatch: Any) -> None:
    """What ``bench requirements``' PyTorch baseline rests on: the tiny twin, trained on the
    CPU, makes the ATen ops of the real size (shapes alone: meta tensors), in the same
    order."""
    import torch.utils._foreach_utils as foreach

    gpu_like = foreach._get_foreach_kernels_supported_devices()
    # the real size on meta: its clipping on the multi-tensor path, as the CPU's and a GPU's
    monkeypatch.setattr(
        foreach, "_get_foreach_kernels_supported_devices", lambda: [*gpu_like, "meta"]
    )
    items = torch.library.Library("aten", "IMPL")  # a meta tensor's .item(): zero
    items.impl("_local_scalar_dense", lambda t: 0.0, "Meta")
    try:
        real = _aten_ops(workload(name, "real"), "meta")
    finally:
        items._destroy()
    with _plain_cpu():
        tiny = _aten_ops(workload(name, "tiny"), "cpu")
    assert len(real) > 400 and tiny == real


def test_a_local_gpu_runs_its_kernels_beside_the_host() -> None:
    """The baseline's device: kernels on a stream in parallel with the host's (measured)
    time, waited for at the read."""

    def call(klass: str, gap_ms: float, kernel_ms: float) -> TraceEntry:
        return TraceEntry("aten", klass, 0, 0, gap_ms / 1e3, 0.0, kernel_s=kernel_ms / 1e3)

    trace = [call("async", 1, 2), call("async", 1, 2), call("async", 1, 2), call("sync", 0, 0)]
    # the host spends 1 ms a call: the device, 2 ms a kernel, sets the pace
    assert on_local_gpu_s(trace, 3e-3) == pytest.approx(7e-3)
    # the host spends 10 ms a call: each kernel runs while the host makes the next call
    assert on_local_gpu_s(trace, 30e-3) == pytest.approx(32e-3)


def test_the_local_baseline_is_a_simulated_gpu_where_the_device_has_a_profile() -> None:
    """A profile's device: PyTorch's host (the twin, measured) beside the trace's kernels;
    any other: the program itself on the local CPU."""
    from gpuremote.bench.torch_local import local_baseline

    from gpuremote.backends import get_backend

    w = workload("gpt2", "small")
    torch.manual_seed(0)
    model = w.make()
    one_s_kernel = [TraceEntry("aten", "async", 0, 0, 1e-3, 0.0, kernel_s=1.0)]
    read = [TraceEntry("copy_d2h", "sync", 0, 4, 0.0, 0.0)]
    gpu = local_baseline(
        w, "small", model, get_backend("sim:a100,compute=0"), one_s_kernel + read, 2
    )
    run = gpu.run(2)
    assert run.wall >= 1.0 and len(gpu.host_runs_s) == 1 and 0 < gpu.host_runs_s[0] < 1.0
    with pytest.raises(ValueError, match="2 steps"):
        gpu.run(3)
    cpu = local_baseline(w, "small", model, get_backend("numpy"), [], 2)
    assert cpu.describe == "PyTorch on the local CPU"
    assert 0 < cpu.run(2).wall < 1.0 and cpu.host_runs_s == []


@pytest.mark.slow
@pytest.mark.parametrize("compile", [None, "gpuremote"])
def test_a_timing_only_device_runs_pytorch_and_times_it(compile: str | None) -> None:
    """``sim:a100,compute=0``: ops run on shapes alone, each takes its roofline time on the
    device's clock; what is read back is zeros."""
    torch._dynamo.reset()
    w = workload("resnet18", "small")
    with connect_torch("sim:a100,compute=0") as conn:
        losses, _ = train(w, "gpuremote", 2, compile=compile)
        trace = conn.drivers[0].session.trace
    torch._dynamo.reset()
    assert losses == [0.0, 0.0]
    convs = sum(e.kernel_s for e in trace if e.call in ("aten", "step_run"))
    assert convs > 0  # the convolutions' FLOPs, at an A100's rate


@pytest.mark.slow
def test_the_requirements_sweep_takes_the_pytorch_workloads() -> None:
    """A reduced grid: each point measured, the model's prediction beside it, the
    requirement per mode (eager-optimized and compiled)."""
    cfg = RequirementsConfig(
        transport="emu+inproc",
        backend="sim:a100",
        workloads=["gpt2"],
        rtts_us=[1, 100],
        bws_gbit=[200],
        quick=True,
        repeats=1,
        modes=["optimized", "compiled"],
    )
    result = asyncio.run(run_requirements(cfg))
    (w,) = result["workloads"]
    assert w["name"] == "gpt2" and w["framework"] == "torch"
    assert {p["mode"] for p in w["points"]} == {"optimized", "compiled"}
    assert len(w["points"]) == 4
    for p in w["points"]:
        assert p["measured_s"] > 0 and math.isfinite(p["model_error"])
    # the compiled mode sends far fewer calls a step
    assert w["calls_per_step"]["compiled"] < w["calls_per_step"]["optimized"] / 2
    assert set(w["min_requirement_network_only"]) == {"optimized", "compiled"}
    # judged against PyTorch alone on a local (simulated) A100; the in-process run beside
    assert w["local_baseline"] == "pytorch"
    both = w["local_baselines"]
    assert set(both) == {"pytorch", "inproc"}
    assert w["local_s"] == both["pytorch"]["local_s"]
    # each step reads its loss: the local run waits for every kernel of the eager program
    assert both["pytorch"]["local_s"] >= w["device_s"] > 0
    for p in w["points"]:
        assert p["slowdowns"]["pytorch"] == pytest.approx(p["slowdown"])
        assert set(p["slowdowns"]) == {"pytorch", "inproc"}


@pytest.mark.slow
def test_the_sweep_with_its_proxy_in_a_process_of_its_own() -> None:
    """``--transport emu+tcp``: the PyTorch workloads' remote runs on a proxy process behind
    the link it emulates, the client sending by its batching policy, which the model follows
    (a compiled replay at once: the device runs it while the client goes on)."""
    cfg = RequirementsConfig(
        transport="emu+tcp",
        backend="sim:a100",
        workloads=["gpt2"],
        rtts_us=[5],
        bws_gbit=[100],
        quick=True,
        repeats=2,
        modes=["optimized", "compiled"],
    )
    result = asyncio.run(run_requirements(cfg))
    assert result["transport"] == "emu+tcp" and result["proxy"] == "process"
    (w,) = result["workloads"]
    assert {p["mode"] for p in w["points"]} == {"optimized", "compiled"}
    for p in w["points"]:
        assert p["measured_s"] > 0 and math.isfinite(p["model_error"])
        assert p["proxy_per_call_us"] > 0  # the proxy process's own time, counted
        assert p["cpu_stolen"] < 0.5  # (the client's own threads are not other processes)


def test_the_emu_tcp_sweep_takes_only_the_pytorch_workloads() -> None:
    from gpuremote.errors import ConfigError

    cfg = RequirementsConfig(transport="emu+tcp", workloads=["mlp", "gpt2"], quick=True)
    with pytest.raises(ConfigError, match=r"PyTorch workloads.*not mlp"):
        asyncio.run(run_requirements(cfg))
