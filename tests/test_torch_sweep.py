"""The paper's PyTorch programs on the paper's grid: the local baseline (``connect_torch``),
a device that times ops without computing them (real sizes anywhere), and ``bench
requirements`` over ``emu+inproc`` for ResNet-18, BERT and GPT-2, eager and compiled."""

from __future__ import annotations

import asyncio
import math

import pytest

torch = pytest.importorskip("torch", reason="gpuremote.torch needs the [torch] extra")

from gpuremote.bench.requirements import RequirementsConfig, run_requirements  # noqa: E402

from gpuremote.tools.direct import connect_torch  # noqa: E402
from gpuremote.torch.models import train, workload  # noqa: E402


def test_the_local_baseline_runs_the_ops_at_once_and_traces_them() -> None:
    w = workload("gpt2", "small")
    expected = train(w, "cpu", 2)
    with connect_torch("numpy") as conn:
        got = train(w, "gpuremote", 2)
        trace = conn.drivers[0].session.trace
    assert got[0] == expected[0]
    assert {e.call for e in trace} >= {"aten", "alloc", "copy_h2d", "copy_d2h"}
    assert all(e.gap_s >= 0 and e.device_s >= 0 for e in trace)


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
    convs = sum(e.kernel_s for e in trace if e.call in ("aten", "step_replay"))
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
