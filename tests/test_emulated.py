"""The emulated link: its model, its options, and delays that land near the setting."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import pytest
from gpuremote.bench.requirements import ping_rtt
from gpuremote.transports.emulated import LinkModel, parse_bandwidth, parse_duration

import gpuremote
from gpuremote.errors import ConfigError

if TYPE_CHECKING:
    from conftest import Cli


def test_units() -> None:
    assert parse_duration("50us") == pytest.approx(50e-6)
    assert parse_duration("1.5ms") == pytest.approx(1.5e-3)
    assert parse_duration("2") == 2.0
    assert parse_bandwidth("10gbit") == 1e10
    assert parse_bandwidth("100mbit") == 1e8
    assert parse_bandwidth("1GB/s") == 8e9
    for bad in ("fast", "10 parsecs"):
        with pytest.raises(ConfigError):
            parse_duration(bad)
    with pytest.raises(ConfigError):
        parse_bandwidth("-1gbit")


def test_pipelined_link_overlaps_latency_and_serialises_bandwidth() -> None:
    link = LinkModel(rtt_s=100e-6, bw_bps=8e9)  # 1 GB/s, 50 µs one way
    arrivals = [link.arrival(0.0, 1_000_000) for _ in range(3)]  # 1 ms of wire each
    assert arrivals == pytest.approx([1.05e-3, 2.05e-3, 3.05e-3])
    small = LinkModel(rtt_s=100e-6, bw_bps=None)
    assert [small.arrival(0.0, 10) for _ in range(3)] == pytest.approx([50e-6] * 3)


def test_serialized_mode_is_the_papers_emulator() -> None:
    link = LinkModel(rtt_s=100e-6, bw_bps=None, mode="serialized")
    assert [link.arrival(0.0, 10) for _ in range(3)] == pytest.approx([50e-6, 100e-6, 150e-6])


def test_jitter_keeps_order() -> None:
    link = LinkModel(rtt_s=1e-3, bw_bps=None, jitter_s=1e-3, seed=1)
    times = [link.arrival(i * 1e-6, 10) for i in range(100)]
    assert times == sorted(times) and max(times) < 1e-3 + 1e-4 + 1e-3


async def test_results_are_unchanged_and_delays_land_near_the_setting() -> None:
    proxy = gpuremote.Proxy("numpy")
    url = await proxy.start("tcp://127.0.0.1:0")
    host = url.removeprefix("tcp://")
    try:
        async with gpuremote.connect(f"emu+tcp://{host}?rtt=200us&bw=1gbit") as gpu:
            x = gpu.asarray(np.arange(1000, dtype=np.float64))
            np.testing.assert_array_equal(
                await gpu.multiply(x, 3.0).get(), 3 * np.arange(1000, dtype=np.float64)
            )
        for setting in (2e-3, 10e-3):
            # bare and emulated alternately (A B A B), as `gpuremote bench emu` measures.
            # The emulator only ever adds time, so the lower bound is firm; the upper one
            # only catches a delay applied twice or per byte: a shared 2-core machine's own
            # loopback round trip moves between ~0.1 and several ms (the bench reports the
            # real error)
            async with (
                gpuremote.connect(url) as a,
                gpuremote.connect(f"emu+tcp://{host}?rtt={setting}s") as b,
            ):
                bare, emulated = [], []
                for _ in range(15):
                    for gpu, out in ((a, bare), (b, emulated)):
                        t0 = time.perf_counter()
                        await gpu.ping(b"12345678")
                        out.append(time.perf_counter() - t0)
            added = float(np.median(emulated) - np.median(bare))
            assert 0.7 * setting < added < 2.5 * setting + 10e-3, (setting, added)
        start = time.perf_counter()
        async with gpuremote.connect(f"emu+tcp://{host}?bw=100mbit") as gpu:
            t0 = time.perf_counter()
            await gpu.empty(1 << 20, "uint8").write(np.zeros(1 << 20, np.uint8))
            took = time.perf_counter() - t0
        assert took > (1 << 20) * 8 / 1e8 * 0.9  # 1 MiB cannot beat 100 Mbit/s
        assert time.perf_counter() - start < 30
    finally:
        await proxy.close()


async def test_bad_emulator_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="unknown emulator option"):
        await gpuremote.connect("emu+tcp://127.0.0.1:1?latency=5us")
    with pytest.raises(gpuremote.TransportUnavailable):
        await gpuremote.connect("emu+carrier://x:1?rtt=1ms")


@pytest.mark.slow
def test_bench_emu_reports_the_emulators_error(cli: Cli) -> None:
    import json

    out = cli(
        "bench", "emu", "--rtts", "2ms", "--bws", "1gbit", "--pings", "15", "--json", timeout=120
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    (rtt,) = result["rtt"]
    (bw,) = result["bandwidth"]
    # the schema and the order of magnitude (the error itself is the bench's figure: on a
    # shared 2-core machine a short run's own noise is larger than the emulator's error)
    assert rtt["rtt_us"] == 2000 and rtt["added_us"] == pytest.approx(
        rtt["rtt_us"] + rtt["error_us"]
    )
    assert 500 < rtt["added_us"] < 10_000
    assert bw["bw_gbit"] == 1 and 0.2 < bw["emulated_gbit"] < 5
    assert bw["end_to_end_gbit"] <= bw["emulated_gbit"] * 1.5


async def test_emulation_on_the_proxy_side() -> None:
    proxy = gpuremote.Proxy("numpy")
    url = await proxy.start("emu+tcp://127.0.0.1:0?rtt=3ms")
    try:
        assert url.startswith("tcp://")  # clients connect to the real address
        rtt = await ping_rtt(url, 10)
        assert 0.9 * 3e-3 < rtt < 2 * 3e-3 + 20e-3  # firm below, loose above (see above)
    finally:
        await proxy.close()
