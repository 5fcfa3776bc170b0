"""ucx:// specifics (the end-to-end tests run over ucx:// too, through the ``scheme``
fixture). Skipped, with the reason, where ucxx is not installed."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from typing import Any

import numpy as np
import pytest

import gpuremote
from gpuremote.proxy import Proxy

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucx:// needs the [ucx] extra (ucxx)"
)


@pytest.mark.slow
async def test_an_idle_connection_costs_no_cpu() -> None:
    """The progress driver waits on the worker's descriptor, armed: with a session open and
    receives posted on both ends, nothing spins (ucxx's own asyncio progress would)."""
    proxy = Proxy("numpy")
    url = await proxy.start("ucx://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as gpu:
            assert (await (gpu.asarray(np.ones(8, np.float32)) + 1.0).get())[0] == 2.0
            t0, c0 = time.perf_counter(), time.process_time()
            await asyncio.sleep(2.0)
            cpu = time.process_time() - c0
            assert cpu < 0.1 * (time.perf_counter() - t0), f"{cpu:.3f} s of CPU while idle"
    finally:
        await proxy.close()


async def test_large_arrays_cross_intact() -> None:
    proxy = Proxy("numpy")
    url = await proxy.start("ucx://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as gpu:
            data = np.random.default_rng(0).standard_normal(1 << 21)  # 16 MiB
            x = gpu.empty(data.shape, "float64")
            await x.write(data)
            np.testing.assert_array_equal(await (x * 2.0).get(), data * 2.0)
    finally:
        await proxy.close()


def _cpu_s(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    import os
    from pathlib import Path

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
async def test_idle_processes_cost_no_cpu() -> None:
    """Two processes, as deployed: an idle connected client and its proxy stay asleep."""
    from gpuremote.tools.proxyprocess import LocalProxy

    with LocalProxy("ucx", "numpy", extra_args=("--quiet",)) as p:
        async with gpuremote.connect(p.url) as gpu:
            assert gpu._session.conn.path == "worker address"
            assert (await (gpu.asarray(np.ones(8, np.float32)) + 1.0).get())[0] == 2.0
            await asyncio.sleep(0.2)
            p0, c0, t0 = _cpu_s(p.pid), time.process_time(), time.perf_counter()
            await asyncio.sleep(3.0)
            wall = time.perf_counter() - t0
            proxy, client = _cpu_s(p.pid) - p0, time.process_time() - c0
        assert proxy < 0.05 * wall, f"idle proxy: {proxy:.3f} s of CPU in {wall:.1f} s"
        assert client < 0.05 * wall, f"idle client: {client:.3f} s of CPU in {wall:.1f} s"
        await asyncio.sleep(0.3)
        p0, t0 = _cpu_s(p.pid), time.perf_counter()
        await asyncio.sleep(2.0)
        after = _cpu_s(p.pid) - p0
        assert after < 0.05 * (time.perf_counter() - t0), f"proxy after the client: {after:.3f}"


@pytest.mark.slow
async def test_a_killed_proxy_fails_the_client_at_once() -> None:
    from gpuremote.tools.proxyprocess import LocalProxy

    with LocalProxy("ucx", "numpy", extra_args=("--quiet",)) as p:
        gpu = await gpuremote.connect(p.url, call_timeout_s=30)
        x = gpu.asarray(np.ones(1 << 16, np.float32))
        await gpu.synchronize()
        assert p.proc is not None
        p.proc.kill()
        start = time.monotonic()
        with pytest.raises(gpuremote.ConnectionClosed):
            while time.monotonic() - start < 20:
                await (x + 1.0).get()
        assert time.monotonic() - start < 10.0
        await gpu.aclose()


@pytest.mark.slow
async def test_a_killed_client_frees_its_session() -> None:
    import subprocess
    import sys

    proxy = Proxy("numpy")
    url = await proxy.start("ucx://127.0.0.1:0")
    script = (
        "import sys, time, numpy as np, gpuremote\n"
        "async def main():\n"
        "    gpu = await gpuremote.connect(sys.argv[1])\n"
        "    x = gpu.asarray(np.ones(1 << 20, np.float32))\n"
        "    await gpu.synchronize()\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n"
        "gpuremote.run(main())\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script, url], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 30)
        assert line.strip() == "ready"
        assert proxy.stats()["device_bytes"] == 4 << 20
        child.kill()
        for _ in range(200):
            if not proxy.clients:
                break
            await asyncio.sleep(0.05)
        assert not proxy.clients and proxy.stats()["device_bytes"] == 0
    finally:
        child.kill()
        child.wait()
        await proxy.close()


@pytest.mark.slow
async def test_sixteen_clients_verify_their_results() -> None:
    from gpuremote.bench.load import LoadConfig, run_load

    cfg = LoadConfig(transport="ucx", backend="numpy", clients=16, ops=1000, light_period_ms=0)
    result = await run_load(cfg)
    assert result["errors"] == 0, result["error_messages"]
    assert result["verified"] == 16


async def test_shm_0_keeps_the_listener_endpoint() -> None:
    proxy = Proxy("numpy")
    url = await proxy.start("ucx://127.0.0.1:0")
    try:
        async with gpuremote.connect(url + "?shm=0") as gpu:
            assert gpu._session.conn.path == "listener"
            np.testing.assert_array_equal(await (gpu.full((3,), 2.0) * 2.0).get(), 4.0)
    finally:
        await proxy.close()


@pytest.mark.slow
async def test_the_bare_ucxx_baselines_run_beside_the_proxy() -> None:
    """``bench throughput``/``ping`` over ucx:// interleave a bare ucxx echo in the proxy's
    process; uploads land there in fresh memory (which must live until UCX is done)."""
    from gpuremote.bench.ping import PingConfig, run_ping
    from gpuremote.bench.throughput import ThroughputConfig, run_throughput

    cfg = ThroughputConfig(transport="ucx", backend="numpy", sizes=[4096, 1 << 20], max_reps=8)
    result, _ = await run_throughput(cfg)
    assert {r["direction"] for r in result["results"]} == {"h2d", "d2h"}
    for row in result["results"]:
        assert row["ucxx_gbps"] > 0 and row["ratio"] > 0, row
    ping, _ = await run_ping(PingConfig(transport="ucx", backend="numpy", count=300, warmup=20))
    assert ping["baselines"]["ucxx"]["p50"] > 0
    assert ping["ratio_p50_ucxx"] > 0


@pytest.mark.parametrize("listen", ["ucx://127.0.0.1:0", "ucx://127.0.0.1:0?device=0"])
async def test_large_buffers_go_to_and_from_device_memory(listen: str, device_backend: Any) -> None:
    """On a backend with device memory, UCX receives a large upload straight into it (the
    upload becomes the array's buffer) and sends a large download from it; ``?device=0``
    stages both through host memory. The backend here calls NumPy memory device memory, so
    this runs with no GPU; ``test_device_buffers_cross_on_the_gpu`` is the real thing."""
    direct = "device=0" not in listen
    proxy = Proxy(device_backend)
    url = await proxy.start(listen)
    try:
        async with gpuremote.connect(url.split("?")[0]) as gpu:
            data = np.random.default_rng(1).standard_normal(1 << 18)  # 2 MiB
            x = gpu.empty(data.shape, "float64")
            await x.write(data)
            np.testing.assert_array_equal(await x.get(), data)
            np.testing.assert_array_equal(await (x + 1.0).get(), data + 1.0)
            (session,) = proxy.clients.values()
            assert session.executor.device_io is direct
            held = session.executor.buffers[x.handle]
            assert device_backend.is_device(held) is direct
    finally:
        await proxy.close()


@pytest.mark.gpu
async def test_device_buffers_cross_on_the_gpu() -> None:
    """ucx:// to a CuPy proxy: a large upload lands in device memory and a large download
    leaves from it, moved by UCX (cuda_copy here; GPUDirect RDMA where the NIC has it)."""
    from gpuremote.backends import cupy_usable

    usable, why = cupy_usable()
    if not usable:
        pytest.skip(f"needs a GPU: {why}")
    import cupy as cp

    proxy = Proxy("cupy")
    url = await proxy.start("ucx://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as gpu:
            data = np.random.default_rng(2).standard_normal(1 << 21)  # 16 MiB
            x = gpu.empty(data.shape, "float64")
            await x.write(data)
            np.testing.assert_array_equal(await (x * 2.0).get(), data * 2.0)
            (session,) = proxy.clients.values()
            assert session.executor.device_io
            assert isinstance(session.executor.buffers[x.handle], cp.ndarray)
    finally:
        await proxy.close()


async def test_completions_that_take_the_next_message_do_not_nest_without_bound() -> None:
    """A flood of messages that have all arrived: each one's completion takes the next,
    which has completed too. They run inside one another only so deep, the rest from the
    next progress: before, they nested until Python's recursion limit broke a connection."""
    from gpuremote.transports.ucx import MAX_NESTED, get_driver

    driver = get_driver()

    class Arrived:  # a receive that has completed
        completed = True

        def check_error(self) -> None:
            return None

    seen: list[BaseException | None] = []
    depth = [0, 0]  # now, deepest

    def take(exc: BaseException | None) -> None:
        seen.append(exc)
        depth[0] += 1
        depth[1] = max(depth)
        if len(seen) < 5000:
            driver.track(Arrived(), take)
        depth[0] -= 1

    driver.track(Arrived(), take)
    for _ in range(2000):
        if len(seen) >= 5000:
            break
        await asyncio.sleep(0)
    assert len(seen) == 5000 and all(e is None for e in seen)
    assert depth[1] <= MAX_NESTED + 1
