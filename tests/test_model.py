"""Local runs, call traces, the overhead model and the workloads."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

import gpuremote
from gpuremote.tools.direct import TraceEntry, connect_direct
from gpuremote.tools.model import Costs, load_trace, predict, save_trace
from gpuremote.tools.workloads import WORKLOADS

if TYPE_CHECKING:
    from conftest import Cli

SMALL = {
    "mlp": {"steps": 3, "batch": 16, "din": 8, "hidden": 16, "dout": 4},
    "transformer": {"steps": 2, "seq": 8, "d_model": 16, "heads": 2},
    "upload": {"steps": 3, "batch_mb": 0.25, "features": 32},
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
async def test_workloads_give_the_same_result_locally_and_remotely(name: str, url: str) -> None:
    local = connect_direct("numpy")
    expected = await WORKLOADS[name](local, **SMALL[name])
    await local.aclose()
    async with gpuremote.connect(url) as gpu:
        got = await WORKLOADS[name](gpu, **SMALL[name])
    np.testing.assert_allclose(got, expected, rtol=1e-5)


async def test_trace_records_classes_bytes_and_times() -> None:
    gpu = connect_direct("numpy")
    x = gpu.asarray(np.ones(1000, np.float32))  # alloc + copy_h2d: 4000 bytes out
    y = gpu.exp(x)
    await y.get()  # sync: 4000 bytes in
    await x.get()  # shadow: local
    trace = gpu._session.trace  # type: ignore[attr-defined]
    assert [(t.call, t.klass) for t in trace] == [
        ("alloc", "async"),
        ("copy_h2d", "async"),
        ("launch_new", "async"),  # one command: the output's buffer is allocated with it
        ("copy_d2h", "sync"),
        ("local", "local"),
    ]
    assert trace[1].bytes_out == 4000 and trace[3].bytes_in == 4000
    assert trace[4].shadow_bytes == 4000
    assert all(t.gap_s >= 0 and t.device_s >= 0 for t in trace)
    await gpu.aclose()


async def test_a_recorded_run_counts_its_client_time_from_its_start() -> None:
    """A pause before a recorded run (setting up, a collection) is not its first call's
    client time once the clock is restarted (``bench requirements``' local baseline spreads
    that time as PyTorch's host time)."""
    gpu = connect_direct("numpy")
    session = gpu._session  # type: ignore[attr-defined]
    x = gpu.asarray(np.ones(4, np.float32))
    time.sleep(0.05)
    y = gpu.exp(x)
    time.sleep(0.05)
    session.restart_clock()
    z = gpu.exp(x)
    paused, restarted = (t.gap_s for t in session.trace if t.call == "launch_new")
    del y, z
    assert paused >= 0.05 > 0.01 > restarted
    await gpu.aclose()


async def test_mlp_training_step_makes_one_synchronous_round_trip() -> None:
    gpu = connect_direct("numpy")
    await WORKLOADS["mlp"](gpu, **SMALL["mlp"])
    trace = gpu._session.trace  # type: ignore[attr-defined]
    steps = SMALL["mlp"]["steps"]
    syncs = sum(1 for t in trace if t.klass == "sync")
    assert syncs == steps + 2  # the loss each step, and the two weights at the end
    opt, unopt = predict(trace, 1e-5, None), predict(trace, 1e-5, None, optimized=False)
    assert opt.round_trips == syncs and unopt.round_trips == len(trace)
    await gpu.aclose()


def _calls(*specs: tuple[str, int, int, float, float]) -> list[TraceEntry]:
    return [
        TraceEntry("c", k, o, i, g, d)
        for k, o, i, g, d in [(s[0], s[1], s[2], s[3], s[4]) for s in specs]
    ]  # type: ignore[misc]


def test_model_on_hand_made_traces() -> None:
    rtt, bw = 100e-6, 8e9  # 1 GB/s
    asyncs = [("async", 0, 0, 0.0, 0.0)] * 100
    p = predict(_calls(*asyncs, ("sync", 0, 8, 0.0, 0.0)), rtt, None)
    assert p.seconds == pytest.approx(rtt) and p.round_trips == 1  # latency is pipelined
    p = predict(_calls(*asyncs, ("sync", 0, 8, 0.0, 0.0)), rtt, None, optimized=False)
    assert p.seconds == pytest.approx(101 * rtt) and p.round_trips == 101
    p = predict(_calls(("sync", 0, 1_000_000, 0.0, 0.0)), rtt, bw)
    assert p.seconds == pytest.approx(rtt + 1e-3)  # the reply's wire time
    p = predict(_calls(("async", 2_000_000, 0, 0.0, 0.0), ("sync", 0, 0, 0.0, 0.0)), rtt, bw)
    assert p.seconds == pytest.approx(2e-3 + rtt)  # upload, then the sync behind it
    # the device runs in parallel with the client: 10 launches of 1 ms each, 1 ms apart
    launches = [("async", 0, 0, 1e-3, 1e-3)] * 10
    p = predict(_calls(*launches, ("sync", 0, 0, 0.0, 0.0)), 0.0, None)
    assert p.local_seconds == pytest.approx(20e-3)
    assert p.seconds == pytest.approx(11e-3)
    costs = Costs(client_per_call=1e-6, proxy_per_call=2e-6, base_rtt=50e-6)
    p = predict(_calls(("sync", 0, 0, 0.0, 0.0)), rtt, None, costs=costs)
    assert p.seconds == pytest.approx(1e-6 + 2e-6 + rtt + 50e-6)
    shadow = [TraceEntry("local", "local", 0, 0, 0.0, 0.0, 1_000_000)]
    assert predict(shadow, rtt, bw).seconds == 0.0
    assert predict(shadow, rtt, bw, optimized=False).seconds == pytest.approx(rtt + 1e-3)


@pytest.mark.slow
def test_trace_and_predict_commands(tmp_path: Path, cli: Cli) -> None:
    path = tmp_path / "t.json"
    out = cli("trace", "transformer", "-o", str(path), timeout=120)
    assert out.returncode == 0, out.stderr
    trace, meta = load_trace(path)
    assert meta["workload"] == "transformer" and meta["local_s"] > 0 and len(trace) > 100
    out = cli("predict", str(path), "--rtt", "20us", "--bw", "100gbit", "--json", timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["rtt_us"] == pytest.approx(20) and result["bw_gbit"] == pytest.approx(100)
    remote_calls = sum(1 for t in trace if t.klass != "local" or t.shadow_bytes)
    assert result["unoptimized"]["round_trips"] == remote_calls  # views stay local
    assert result["optimized"]["predicted_s"] <= result["unoptimized"]["predicted_s"]
    save_trace(tmp_path / "again.json", trace, workload="x")
    assert load_trace(tmp_path / "again.json")[0] == trace


@pytest.mark.slow
def test_bench_requirements_json_schema(tmp_path: Path, cli: Cli) -> None:
    out = cli(
        "bench",
        "requirements",
        "--quick",
        "--workloads",
        "transformer",
        "--rtts",
        "50",
        "--bws",
        "10",
        "--json",
        "--plot",
        str(tmp_path / "r.png"),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["bench"] == "requirements" and result["tolerance"] == 0.05
    (w,) = result["workloads"]
    assert w["name"] == "transformer" and w["local_s"] > 0
    assert {(p["rtt_us"], p["bw_gbit"], p["optimized"]) for p in w["points"]} == {
        (50, 10, True),
        (50, 10, False),
    }
    for p in w["points"]:
        assert p["measured_s"] > 0 and p["predicted_s"] > 0
        assert p["slowdown"] == pytest.approx(p["measured_s"] / w["local_s"] - 1)
    assert set(w["min_requirement"]) == {"optimized", "unoptimized"}
    assert set(w["min_requirement"]["optimized"]) == {"rtt_us", "bw_gbit"}
    trips = w["sync_round_trips_per_step"]
    assert trips["optimized"] == 1.0 and trips["unoptimized"] > trips["optimized"]


def test_the_model_sends_posts_as_the_driver_policy_does() -> None:
    """``posts``: a synchronous driver's batching policy (``gpuremote.session.batching``)."""
    from gpuremote.config import PipelineConfig

    ms = 1e-3
    # a compiled graph's replay (10 ms on the device), then 9 ms of the client's own work
    replay = TraceEntry("step_run", "async", 0, 0, 0.0, 0.0, kernel_s=10 * ms)
    frees = [TraceEntry("free", "async", 0, 0, ms, 0.0)] * 9
    step = [replay, *frees, TraceEntry("aten", "sync", 0, 8, 0.0, 0.0)]
    at_once = PipelineConfig(post_delay_us=1e9, post_delay_max_us=1e9, post_batch_calls=0)
    # sent at once, the replay runs beside the client; sent at its wait, after it
    assert predict(step, 0.0, None, posts=at_once).seconds == pytest.approx(10 * ms)
    waits = PipelineConfig(
        post_delay_us=1e9, post_delay_max_us=1e9, post_batch_calls=0, replays_at_once=False
    )
    assert predict(step, 0.0, None, posts=waits).seconds == pytest.approx(19 * ms)
    assert predict(step, 0.0, None, batched=True).seconds == pytest.approx(19 * ms)
    # four 1 ms launches, 1 ms apart: sent two at a time, they start at 2 and 4 ms
    launches = [TraceEntry("aten", "async", 0, 0, ms, 0.0, kernel_s=ms)] * 4
    sync = TraceEntry("aten", "sync", 0, 8, 0.0, 0.0)
    pairs = PipelineConfig(post_delay_us=1e9, post_delay_max_us=1e9, post_batch_calls=2)
    assert predict([*launches, sync], 0.0, None, posts=pairs).seconds == pytest.approx(6 * ms)
    # by the delay alone: the oldest falls due at 2.5 ms, and goes with the third post, from
    # the posting thread (at 3 ms); the next may wait 6 ms: the last goes with the waiting call
    delayed = PipelineConfig(post_delay_us=1500, post_batch_calls=0)
    assert predict([*launches, sync], 0.0, None, posts=delayed).seconds == pytest.approx(7 * ms)
    # no post follows: the helper thread sends it when it next comes by (every 8 ms), not
    # at its delay (it is not woken for a post that is not due)
    lone = [TraceEntry("aten", "async", 0, 0, ms, 0.0, kernel_s=15 * ms)]
    late = TraceEntry("aten", "sync", 0, 8, 20 * ms, 0.0)
    helper = PipelineConfig(post_delay_us=200, post_delay_max_us=8000)
    assert predict([*lone, late], 0.0, None, posts=helper).seconds == pytest.approx(23 * ms)
    # frees are released, not posted: they go with the next frame, and do not count
    frees63 = [TraceEntry("free", "async", 0, 0, 0.0, 0.0)] * 63
    launch = TraceEntry("aten", "async", 0, 0, ms, 0.0, kernel_s=10 * ms)
    wait = TraceEntry("aten", "sync", 0, 8, 5 * ms, 0.0)
    batch64 = PipelineConfig(post_delay_us=1e9, post_delay_max_us=1e9, post_batch_calls=64)
    got = predict([*frees63, launch, wait], 0.0, None, posts=batch64).seconds
    assert got == pytest.approx(16 * ms)  # the launch went with the wait, at 6 ms
    # a waiting call takes the posts held: the next post starts a batch of its own (it is
    # not sent at once as though the one taken were still held): three launches, a wait
    # (which takes the third), two more (a pair, sent at 7 ms), a wait: 9 ms, not 8
    twice = [*launches[:3], sync, *launches[:2], sync]
    assert predict(twice, 0.0, None, posts=pairs).seconds == pytest.approx(9 * ms)
    # the optimisations off: every call a round trip, whatever the policy
    off = predict([*launches, sync], 0.0, None, optimized=False, posts=pairs)
    assert off.round_trips == 5
