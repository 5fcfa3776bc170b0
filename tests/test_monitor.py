"""Seeing the proxy: exact per-session figures, the admin call, Prometheus metrics, `top`."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

import gpuremote
from gpuremote.proxy.metrics import start_metrics_server
from gpuremote.tools.proxyprocess import LocalProxy
from gpuremote.tools.top import fetch, rates, render
from gpuremote.wire.calls import CALLS_BY_NAME

if TYPE_CHECKING:
    from conftest import Cli

TOKEN = "s3cret-admin"


@pytest.fixture
async def admin_proxy(scheme: str) -> AsyncIterator[tuple[gpuremote.Proxy, str]]:
    p = gpuremote.Proxy("numpy", admin_token=TOKEN)
    url = await p.start("inproc://monitor" if scheme == "inproc" else "tcp://127.0.0.1:0")
    try:
        yield p, url
    finally:
        await p.close()


async def scripted(gpu: gpuremote.GPU) -> gpuremote.RemoteArray:
    """A known mix of calls; returns its array (alive, so that no free is sent)."""
    x = gpu.asarray(np.ones(16, np.float32))  # 2 async (alloc, upload)
    for _ in range(10):
        gpu.axpy(1.0, x, x)  # 10 async
    _ = gpu.device, gpu.current_stream, x.reshape(4, 4)  # 3 local
    await gpu.synchronize()  # 1 sync
    await x.get()  # 1 sync (the device wrote x: a real transfer)
    return x


async def test_snapshot_matches_what_the_client_did(
    admin_proxy: tuple[gpuremote.Proxy, str],
) -> None:
    proxy, url = admin_proxy
    async with gpuremote.connect(url) as gpu:
        keep = await scripted(gpu)
        client = gpu.stats()
        (s,) = proxy.snapshot()["sessions"]
        del keep
    assert s["calls"] == {"local": 3, "async": 12, "sync": 3}  # + hello
    assert client["calls"] == s["calls"]
    assert s["frames_in"] == client["frames_sent"] and s["frames_out"] == client["frames_received"]
    assert s["bytes_in"] == client["bytes_sent"] and s["bytes_out"] == client["bytes_received"]
    assert s["device_bytes"] == 64 and s["buffers"] == 1
    assert s["sync_latency_us"]["count"] == 3 and s["sync_latency_us"]["p50"] > 0


async def test_admin_call_needs_the_token(admin_proxy: tuple[gpuremote.Proxy, str]) -> None:
    _, url = admin_proxy
    async with gpuremote.connect(url) as admin, gpuremote.connect(url) as other:
        snap = await fetch(admin.session, TOKEN)
        assert {s["session"] for s in snap["sessions"]} == {
            admin.device["session"],
            other.device["session"],
        }
        with pytest.raises(gpuremote.RemoteCallError, match="wrong admin token") as info:
            await fetch(other.session, "guess")
        assert info.value.kind == "PermissionError"
        assert (await other.ping(b"still fine")).tobytes() == b"still fine"


async def test_admin_calls_are_off_without_a_token(gpu: gpuremote.GPU) -> None:
    with pytest.raises(gpuremote.RemoteCallError, match="admin calls are disabled"):
        await gpu._session.call(CALLS_BY_NAME["admin_stats"], 0, [""])


async def test_metrics_endpoint_parses_with_prometheus_client(
    admin_proxy: tuple[gpuremote.Proxy, str],
) -> None:
    proxy, url = admin_proxy
    metrics_url = start_metrics_server(proxy, "127.0.0.1", 0)
    async with gpuremote.connect(url) as gpu:
        keep = await scripted(gpu)

        def scrape() -> str:
            with urllib.request.urlopen(metrics_url, timeout=10) as resp:
                return str(resp.read().decode())

        text = await asyncio.to_thread(scrape)  # the loop stays free to serve the collector
        sid = str(gpu.device["session"])
        del keep
    families = {f.name: f for f in text_string_to_metric_families(text)}
    calls = {
        s.labels["class"]: s.value
        for s in families["gpuremote_calls"].samples
        if s.labels["session"] == sid
    }
    assert calls == {"local": 3.0, "async": 12.0, "sync": 3.0}
    (mem,) = [
        s for s in families["gpuremote_device_memory_bytes"].samples if s.labels["session"] == sid
    ]
    assert mem.value == 64
    assert families["gpuremote_sessions"].samples[0].value == 1


async def test_top_view_renders_rates_and_totals(
    admin_proxy: tuple[gpuremote.Proxy, str],
) -> None:
    url = admin_proxy[1]
    async with gpuremote.connect(url) as gpu, gpuremote.connect(url) as viewer:
        first = await fetch(viewer.session, TOKEN)
        keep = await scripted(gpu)
        second = await fetch(viewer.session, TOKEN)
    view = rates(first, second, viewer.device["session"])
    del keep
    (row,) = view["rows"]
    assert row["session"] == gpu.device["session"] and row["rate"]["async"] > 0
    console = Console(width=200, record=True, color_system=None)
    console.print(render(view, url))
    text = console.export_text()
    assert "gpuremote top" in text and "numpy" in text and "total" in text
    assert row["peer"] in text and "sync p99" in text


@pytest.mark.slow
def test_top_once_json_from_the_command_line(cli: Cli) -> None:
    with LocalProxy("tcp", "numpy", extra_args=("--admin-token", TOKEN)) as proxy:
        env = {**os.environ, "GPUREMOTE_ADMIN_TOKEN": TOKEN}
        out = cli(
            "top", "--url", proxy.url, "--once", "--json", "--interval", "0.1", timeout=60, env=env
        )
        assert out.returncode == 0, out.stderr
        snap = json.loads(out.stdout)
        assert snap["backend"]["backend"] == "numpy" and len(snap["sessions"]) == 1
        bad = cli("top", "--url", proxy.url, "--once", "--token", "nope", timeout=60)
        assert bad.returncode == 1 and "wrong admin token" in bad.stderr
