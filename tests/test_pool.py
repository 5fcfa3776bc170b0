"""A pool of proxies on a local Ray instance (NumPy backend, ``num_gpus=0``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import gpuremote
import gpuremote.xp as xp
from gpuremote.wire.calls import CALLS_BY_NAME

ray = pytest.importorskip("ray", reason="the pool needs Ray: pip install 'gpuremote[ray]'")
gr = pytest.importorskip("gpuremote.pool")


@pytest.fixture(scope="module")
def pool(ray_address: str) -> Iterator[Any]:
    p = gr.start_pool(2, name="test-pool", num_gpus=0, backend="numpy")
    yield p
    p.stop()


async def _verified_client(i: int) -> tuple[gpuremote.GPU, gpuremote.RemoteArray]:
    gpu = await gpuremote.connect("pool://test-pool")
    a = gpu.asarray(np.arange(64, dtype=np.float32) * i)
    np.testing.assert_array_equal(await (a * 2.0 + 1.0).get(), np.arange(64) * i * 2.0 + 1.0)
    return gpu, a  # the array stays on the proxy


@pytest.mark.slow
def test_status_of_a_new_pool(pool: Any) -> None:
    rows = pool.status()
    assert len(rows) == 2 and len(pool.actors) == 2
    for r in rows:
        assert r["alive"] and r["restarts"] == 0 and r["url"].startswith("tcp://")
        assert {"url", "node", "alive", "sessions", "device_bytes", "calls_per_s"} <= set(r)
    assert pool.urls() == [r["url"] for r in rows]
    assert gr.get_pool("test-pool").urls() == pool.urls()


async def test_eight_clients_are_placed_evenly(pool: Any) -> None:
    clients = await asyncio.gather(*(_verified_client(i) for i in range(8)))
    gpus = [g for g, _ in clients]
    try:
        per_proxy = Counter(g.url for g in gpus)
        assert set(per_proxy) == set(pool.urls())
        rows = pool.status()
        sessions = [r["sessions"] for r in rows]
        assert sum(sessions) == 8 and max(sessions) - min(sessions) <= 1
        assert all(r["device_bytes"] > 0 for r in rows)
    finally:
        for g in gpus:
            await g.aclose()


def test_the_secret_travels_through_ray_only(pool: Any) -> None:
    url = pool.urls()[0]
    with pytest.raises(gpuremote.GpuRemoteError, match="requires a shared secret"):
        gpuremote.run(gpuremote.connect(url))


async def test_a_pool_client_makes_no_admin_calls(pool: Any) -> None:
    from gpuremote.tools.top import fetch

    secret = gr.place_now("test-pool")[1]  # what every client of the pool is given
    _, token = pool.credentials()  # the driver's side: the pool manager's own token
    assert token not in secret.hex()
    async with gpuremote.connect("pool://test-pool") as gpu:
        for guess in (secret.hex()[:32], secret.hex(), ""):  # the token was once derived
            with pytest.raises(gpuremote.RemoteCallError, match="wrong admin token"):
                await fetch(gpu.session, guess)
        assert (await fetch(gpu.session, token))["sessions"]  # the admin's token works


async def test_pool_proxies_import_from_members_only(pool: Any) -> None:
    members = set(pool.urls())
    async with gpuremote.connect("pool://test-pool") as gpu:
        y = gpu.empty((4,), np.float32)
        outsider = "tcp://127.0.0.1:1"
        assert outsider not in members
        with pytest.raises(gpuremote.RemoteCallError, match="is not a peer of this proxy"):
            await gpu._session.call(CALLS_BY_NAME["peer_import"], 0, [y._wire, outsider, "t"])


async def test_devices_k_gives_k_different_proxies(pool: Any) -> None:
    async with gpuremote.connect("pool://test-pool", devices=2) as (g1, g2):
        assert g1.url != g2.url
    with pytest.raises(gr.PoolError, match="2 live proxies; 3 were asked for"):
        await gpuremote.connect("pool://test-pool", devices=3)


async def test_unknown_pool_is_a_clear_error(ray_address: str) -> None:
    with pytest.raises(gr.PoolError, match="no pool named 'nope'"):
        await gpuremote.connect("pool://nope")


@pytest.mark.slow
def test_to_device_between_two_proxies_of_the_pool(pool: Any) -> None:
    host = np.random.default_rng(0).standard_normal(16 << 20).astype(np.float32)  # 64 MiB
    d1, d2 = xp.connect("pool://test-pool", devices=2)
    try:
        assert d1.url != d2.url and xp.__array_namespace_info__().devices()[:2] == [d1, d2]
        x = xp.asarray(host, device=d1)
        d1.synchronize()

        def moved() -> int:
            return sum(s["bytes_sent"] + s["bytes_received"] for s in (d1.stats(), d2.stats()))

        before = moved()
        y = x.to_device(d2)
        assert d2.last_copy == "proxy to proxy"
        assert float(xp.sum(y[:1000])) == pytest.approx(float(host[:1000].sum(dtype=np.float64)))
        assert moved() - before < 1 << 20
        np.testing.assert_array_equal(np.asarray(y), host)
    finally:
        d1.close()
        d2.close()


@pytest.mark.slow
def test_a_killed_proxy_is_restarted(ray_address: str) -> None:
    pool = gr.start_pool(2, name="test-kill", num_gpus=0, backend="numpy")
    try:

        async def scenario() -> None:
            gpus = [await gpuremote.connect("pool://test-kill") for _ in range(4)]
            rows = pool.status()
            victim_url = rows[0]["url"]
            victims = [g for g in gpus if g.url == victim_url]
            others = [g for g in gpus if g.url != victim_url]
            assert len(victims) == 2 and len(others) == 2
            ray.kill(pool.actors[0], no_restart=False)
            start = time.monotonic()
            for g in victims:  # a call in flight or the next one fails at once, not later
                with pytest.raises(gpuremote.ConnectionClosed):
                    while time.monotonic() - start < 5:
                        await g.synchronize()
                        await asyncio.sleep(0.005)
            assert time.monotonic() - start < 2.0
            for g in others:
                np.testing.assert_array_equal(await (g.full((4,), 1.0) + 1.0).get(), 2.0)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                rows = pool.status()
                if rows[0]["alive"] and rows[0]["restarts"] == 1:
                    break
                await asyncio.sleep(0.2)
            assert rows[0]["alive"] and rows[0]["restarts"] == 1, rows
            assert rows[1]["restarts"] == 0
            fresh = await gpuremote.connect("pool://test-kill")  # the emptier proxy: the new one
            assert fresh.url == rows[0]["url"]
            np.testing.assert_array_equal(await (fresh.full((2,), 2.0) * 2.0).get(), 4.0)
            for g in [*others, fresh]:
                await g.aclose()

        gpuremote.run(scenario())
    finally:
        pool.stop()


@pytest.mark.slow
def test_pool_cli(ray_address: str, cli: Any) -> None:
    name = "test-cli"
    start = cli(
        "pool", "start", "--name", name, "--proxies", "1", "--num-gpus", "0",
        "--backend", "numpy", "--address", ray_address,
    )  # fmt: skip
    assert start.returncode == 0, start.stderr
    assert f"pool://{name}" in start.stdout
    try:
        status = cli("pool", "status", "--name", name, "--address", ray_address, "--json")
        assert status.returncode == 0, status.stderr
        rows = json.loads(status.stdout)["proxies"]
        assert len(rows) == 1 and rows[0]["alive"]
        table = cli("pool", "status", "--name", name, "--address", ray_address)
        assert rows[0]["url"] in table.stdout
        top = cli("top", "--url", f"pool://{name}", "--once", "--json", "--address", ray_address)
        assert top.returncode == 0, top.stderr
        assert json.loads(top.stdout)["proxies"][0]["url"] == rows[0]["url"]
    finally:
        stop = cli("pool", "stop", "--name", name, "--address", ray_address)
        assert stop.returncode == 0, stop.stderr
    gone = cli("pool", "status", "--name", name, "--address", ray_address)
    assert gone.returncode != 0 and f"no pool named '{name}'" in gone.stderr


async def test_bench_load_spreads_over_the_pool(pool: Any) -> None:
    from gpuremote.bench.load import LoadConfig, run_load

    result = await run_load(
        LoadConfig(url="pool://test-pool", clients=6, ops=200, light_period_ms=0)
    )
    assert result["errors"] == 0 and result["verified"] == 6
    per_proxy = result["per_proxy"]
    # both proxies serve (short clients that end early free their proxy for later ones)
    assert sum(p["sessions"] for p in per_proxy) == 6
    assert {p["url"] for p in per_proxy} == set(pool.urls())
    assert all(p["calls_per_s"] > 0 for p in per_proxy)
    assert [r["alive"] for r in result["pool"]] == [True, True]


def _kill_proxy_of(pool: Any, url: str) -> None:
    """Kill the pool's proxy at ``url`` (Ray restarts it, at another port)."""
    index = next(r["index"] for r in pool.status() if r["url"] == url)
    ray.kill(pool.actors[index], no_restart=False)


@pytest.fixture(scope="module")
def failover_pool(ray_address: str) -> Iterator[Any]:
    p = gr.start_pool(2, name="test-failover", num_gpus=0, backend="numpy")
    yield p
    p.stop()


@pytest.mark.slow
def test_a_session_survives_its_proxy_killed_twice(failover_pool: Any) -> None:
    """The demo's MLP, 400 steps on a pool of two; the session's proxy killed before step
    200 and again before step 300: the run ends with the uninterrupted run's weights."""
    from gpuremote.tools.demo import mlp_data, mlp_step

    data = mlp_data()

    async def train(kills: tuple[int, ...], **options: Any) -> tuple[Any, ...]:
        async with gpuremote.connect("pool://test-failover", **options) as gpu:
            x, y = gpu.asarray(data["x"]), gpu.asarray(data["y"])
            w1, w2 = gpu.asarray(data["w1"]), gpu.asarray(data["w2"])
            losses = []
            for i in range(400):
                if i in kills:
                    _kill_proxy_of(failover_pool, gpu.url)
                losses.append(float(await mlp_step(gpu, x, y, w1, w2, 2 / y.size, 0.1).get()))
            return losses, await w1.get(), await w2.get(), gpu.stats()

    ref = gpuremote.run(train(()))
    got = gpuremote.run(train((200, 300), failover=True))
    assert got[0] == ref[0]
    np.testing.assert_array_equal(got[1], ref[1])  # bitwise (NumPy backend)
    np.testing.assert_array_equal(got[2], ref[2])
    stats = got[3]
    assert stats["failovers"] == 2 and len(stats["pause_s"]) == 2
    assert "failovers" not in ref[3]


@pytest.mark.slow
def test_an_xp_loop_survives_its_proxy_killed(failover_pool: Any) -> None:
    failover_pool.wait_ready()

    def run(kill_at: int | None, **options: Any) -> tuple[list[float], np.ndarray]:
        rng = np.random.default_rng(3)
        dev = xp.connect("pool://test-failover", **options)
        try:
            w = xp.asarray(rng.standard_normal((32, 8)).astype(np.float32))
            x = xp.asarray(rng.standard_normal((64, 32)).astype(np.float32))
            norms = []
            for i in range(40):
                if i == kill_at:
                    _kill_proxy_of(failover_pool, dev.url)
                h = xp.maximum(x @ w, 0.0)
                w = w - 0.01 * xp.matmul(xp.permute_dims(x, (1, 0)), h) / 64
                norms.append(float(xp.linalg.vector_norm(w)))
            if kill_at is not None:
                assert dev.stats()["failovers"] == 1
            return norms, np.asarray(w)
        finally:
            dev.close()

    ref = run(None)
    got = run(20, failover=True)
    assert got[0] == ref[0]
    np.testing.assert_array_equal(got[1], ref[1])


@pytest.mark.slow
async def test_bench_failover_reports_each_move(ray_address: str) -> None:
    from gpuremote.bench.failover import FailoverBenchConfig, run_failover

    cfg = FailoverBenchConfig(steps=40, kills=(15, 30), timed_steps=50, rounds=1)
    result = await run_failover(cfg, lambda state: None)
    assert result["equal"] and result["failovers"] == 2 and result["steps"] == 40
    assert len(result["pause_s"]) == 2 and all(p > 0 for p in result["pause_s"])
    for move in result["moves"]:
        parts = ("detection_s", "reconnect_s", "restore_s", "replay_s")
        assert move["pause_s"] == pytest.approx(sum(move[k] for k in parts))
    assert isinstance(result["overhead_pct"], float)
    assert result["checkpoint"]["bytes_per_s"] >= 0
