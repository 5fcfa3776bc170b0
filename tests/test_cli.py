"""The ``gpuremote`` command as a user runs it: behaviour and JSON schemas on tiny runs (speed
is measured by the benches themselves, never asserted here)."""

from __future__ import annotations

import csv
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpuremote.tools.proxyprocess import LocalProxy

if TYPE_CHECKING:
    from conftest import Cli

STATS = {"min", "p50", "p90", "p99", "p999", "max", "mean"}


@pytest.mark.slow
def test_bench_ping_json_schema(tmp_path: Path, cli_json: Callable[..., Any]) -> None:
    samples = tmp_path / "ping.csv"
    out = cli_json(
        "bench",
        "ping",
        "--count",
        "60",
        "--warmup",
        "5",
        "--backend",
        "numpy",
        "--csv",
        str(samples),
    )
    assert out["bench"] == "ping" and out["transport"] == "tcp" and out["size"] == 8
    assert out["count"] == 60
    assert out["build"] in ("pure", "compiled")  # which build of the hot path ran
    assert set(out["rtt_us"]) >= STATS and set(out["baseline_rtt_us"]) >= STATS
    assert out["rtt_us"]["min"] <= out["rtt_us"]["p50"] <= out["rtt_us"]["max"]
    assert isinstance(out["ratio_p50"], float) and out["ratio_p50"] > 0
    assert set(out["baselines"]) == {"blocking", "asyncio"}
    rows = list(csv.DictReader(samples.open()))
    assert {r["path"] for r in rows} == {"gpuremote", "blocking", "asyncio"}
    assert len(rows) == 180 and all(int(r["ns"]) > 0 for r in rows)


@pytest.mark.slow
def test_bench_ping_spin_wait(cli_json: Callable[..., Any]) -> None:
    out = cli_json(
        "bench", "ping", "--count", "30", "--warmup", "2", "--backend", "numpy", "--spin-us", "100"
    )
    assert out["spin_us"] == 100 and out["count"] == 30
    assert set(out["baselines"]) == {"blocking", "asyncio"}


def test_bench_ping_inproc_and_size(cli_json: Callable[..., Any]) -> None:
    out = cli_json(
        "bench",
        "ping",
        "--transport",
        "inproc",
        "--count",
        "30",
        "--warmup",
        "2",
        "--size",
        "1000",
        "--no-baseline",
    )
    assert out["transport"] == "inproc" and out["size"] == 1000 and out["baseline_rtt_us"] is None


@pytest.mark.slow
def test_bench_throughput_json_schema(cli_json: Callable[..., Any]) -> None:
    out = cli_json(
        "bench",
        "throughput",
        "--sizes",
        "4k,64k",
        "--min-reps",
        "2",
        "--max-reps",
        "3",
        "--backend",
        "numpy",
    )
    assert out["bench"] == "throughput" and out["transport"] == "tcp"
    rows = out["results"]
    assert [(r["size"], r["direction"]) for r in rows] == [
        (4096, "h2d"),
        (4096, "d2h"),
        (65536, "h2d"),
        (65536, "d2h"),
    ]
    for r in rows:
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["ratio"] > 0
        assert r["gbit_s"] == pytest.approx(8 * r["gbps"])
    assert set(out["peak_rss_mb"]) >= {"client", "proxy"}
    assert out["peak_rss_mb"]["client"] > 0 and out["peak_rss_mb"]["proxy"] > 0


def test_bench_api_json_schema(cli_json: Callable[..., Any]) -> None:
    out = cli_json("bench", "api", "--calls", "300", "--rounds", "1", "--transport", "inproc")
    assert out["bench"] == "api" and out["transport"] == "inproc" and out["calls"] == 300
    assert out["sync_calls_per_s"] > 0 and out["pipelined_calls_per_s"] > 0
    assert out["ratio"] == pytest.approx(out["pipelined_calls_per_s"] / out["sync_calls_per_s"])
    trips = out["round_trips_per_call"]
    assert trips["sync"] >= 1.0 and trips["pipelined"] == pytest.approx(1 / 300)


@pytest.mark.slow
def test_bench_against_a_running_proxy_by_url(cli_json: Callable[..., Any]) -> None:
    with LocalProxy("tcp", "numpy") as proxy:  # no --bench-echo: no baselines, and says so
        out = cli_json("bench", "ping", "--url", proxy.url, "--count", "20", "--warmup", "2")
    assert out["url"] == proxy.url and out["ratio_p50"] is None
    assert "bench-echo" in out["baseline_note"]


@pytest.mark.slow
def test_bench_human_output_when_not_a_terminal(cli: Cli) -> None:
    proc = cli("bench", "ping", "--count", "40", "--warmup", "2")
    assert proc.returncode == 0, proc.stderr
    assert "p50" in proc.stdout and "gpuremote" in proc.stdout
    assert "\x1b[" not in proc.stdout  # no animation codes into a pipe


@pytest.mark.slow
def test_demo_runs_and_checks_its_result(cli: Cli) -> None:
    proc = cli("demo", "--steps", "3", "--batch", "32", "--hidden", "16", "--backend", "numpy")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "result: OK, remote equals local" in proc.stdout
    assert "remote, step by step: loss" in proc.stdout
    assert "remote, captured, replayed: loss" in proc.stdout


def test_serve_announces_and_stops_cleanly_on_sigterm() -> None:
    proxy = LocalProxy("tcp", "numpy")
    url = proxy.start()
    assert url.startswith("tcp://127.0.0.1:")
    assert proxy.proc is not None
    proc = proxy.proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    proxy.stop()


def test_serve_reports_a_bad_backend(cli: Cli) -> None:
    from gpuremote.backends import cupy_usable

    if cupy_usable()[0]:  # pragma: no cover - a machine with a GPU: serve runs, until told
        proxy = LocalProxy("tcp", "cupy")
        try:
            assert proxy.start().startswith("tcp://127.0.0.1:")
        finally:
            proxy.stop()
        return
    proc = cli("serve", "--backend", "cupy", "--listen", "tcp://127.0.0.1:0", timeout=60)
    assert proc.returncode == 2 and "cupy backend is not available" in proc.stderr


@pytest.mark.slow
def test_info_and_connection_errors(cli: Cli) -> None:
    with LocalProxy("tcp", "numpy") as proxy:
        proc = cli("info", "--url", proxy.url)
        assert proc.returncode == 0 and json.loads(proc.stdout)["backend"] == "numpy"
    proc = cli("info", "--url", "tcp://127.0.0.1:1")
    assert proc.returncode == 1 and "cannot connect" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "inproc"])
def test_bench_ops_json(cli_json: Callable[..., Any], transport: str) -> None:
    out = cli_json(
        "bench", "ops", "--transport", transport, "--backend", "numpy",
        "--iterations", "40", "--rounds", "2", "--chain", "200", "--steps", "2",
        "--warmup", "5",
    )  # fmt: skip
    assert out["bench"] == "ops" and out["transport"] == transport
    keys = {"name", "wall_p50_us", "wall_p99_us", "client_cpu_us", "proxy_cpu_us"}
    assert keys <= set(out["echo"]) and out["echo"]["wall_p50_us"] > 0
    cases = {c["name"]: c for c in out["cases"]}
    assert set(cases) == {
        "sync_op", "xp_sync_op", "async_chain", "xp_async_chain", "transformer_step",
        "mlp_step", "mlp_step_replay", "transformer_step_replay", "chain_replay_16",
        "chain_replay_160", "mlp_replay_unread",
    }  # fmt: skip
    unread = cases["mlp_replay_unread"]
    assert unread["steps_per_s"] > 0 and unread["local_steps_per_s"] > 0
    assert unread["of_local"] == pytest.approx(unread["steps_per_s"] / unread["local_steps_per_s"])
    for name in ("mlp_step", "mlp_step_replay", "chain_replay_16", "chain_replay_160"):
        c = cases[name]
        want = {"mlp_step": 16, "mlp_step_replay": 16}.get(name) or int(name.rsplit("_", 1)[1])
        assert c["ops_per_step"] == want, (name, c["ops_per_step"])
        assert c["remote_us"] > 0 and c["local_us"] > 0
        assert c["overhead_us"] == pytest.approx(c["remote_us"] - c["local_us"])
    # a replayed step is one message: one frame with the read, whatever its length
    assert cases["chain_replay_160"]["frames_per_step"] == 1.0
    assert cases["mlp_step"]["frames_per_step"] == 1.0  # the pipeline batches it too
    for c in cases.values():
        assert keys | {"ratio_wall_p50", "ratio_cpu"} <= set(c)
        assert c["wall_p50_us"] > 0 and c["client_cpu_us"] > 0 and c["ratio_wall_p50"] > 0
        # the proxy's CPU comes from the proxy process; in process it is the client's
        assert (c["proxy_cpu_us"] is None) == (transport == "inproc")
    assert cases["async_chain"]["ops"] == 2 * 200 and cases["async_chain"]["ops_per_s"] > 0
    assert cases["transformer_step"]["slowdown"] > 0


@pytest.mark.slow
def test_bench_ops_single_torch_ops_give_their_spread(
    cli_json: Callable[..., Any], cli: Any
) -> None:
    """``bench ops --workload ops``: per op, the local op's, the client's and the proxy's CPU,
    each median beside the quartiles of its rounds (the machine's noise), in the JSON and in
    the table."""
    pytest.importorskip("torch", reason="the workloads run PyTorch")
    out = cli_json("bench", "ops", "--workload", "ops", "--backend", "numpy", "--rounds", "3")
    assert [r["op"] for r in out["ops"]][:2] == ["a + a", "a.add_(1.0)"]
    for r in out["ops"]:
        assert r["rounds"] == 3
        for key in ("local_cpu_us", "client_cpu_us", "proxy_cpu_us"):
            low, high = r[f"{key}_quartiles"]
            assert 0 < low <= r[key] <= high, (r["op"], key)
        assert r["proxy_beyond_op_us"] == pytest.approx(r["proxy_cpu_us"] - r["local_cpu_us"])
    proc = cli("bench", "ops", "--workload", "ops", "--backend", "numpy", "--rounds", "2")
    assert proc.returncode == 0, proc.stderr
    assert "beyond" in proc.stdout and "a + a" in proc.stdout  # (the proxy's column)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to split")
def test_bench_ops_pins_the_two_processes(cli_json: Callable[..., Any], cli: Any) -> None:
    out = cli_json(
        "bench", "ops", "--backend", "numpy", "--pin", "split", "--cases", "sync_op",
        "--iterations", "20", "--rounds", "1", "--warmup", "2",
    )  # fmt: skip
    placement = out["placement"]
    assert placement["pin"] == "split" and placement["client_cpu"] != placement["proxy_cpu"]
    # in process there is no second process to place: a clear error, not a silent run
    proc = cli("bench", "ops", "--transport", "inproc", "--pin", "same", "--cases", "sync_op")
    assert proc.returncode != 0 and "--pin needs the proxy the bench starts" in proc.stderr


@pytest.mark.slow
def test_bench_peer_json(cli_json: Callable[..., Any]) -> None:
    result = cli_json("bench", "peer", "--mib", "4", "--rounds", "2")
    assert result["bench"] == "peer" and result["bytes"] == 4 << 20
    assert result["route"] == "proxy to proxy"
    assert result["direct"]["client_bytes"] < 64 * 1024
    assert result["through_client"]["client_bytes"] >= 2 * result["bytes"]
    for path in ("direct", "through_client"):
        assert result[path]["median_s"] > 0 and result[path]["gb_per_s"] > 0
    assert result["through_client_over_direct"] > 0
