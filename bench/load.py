"""``gpuremote bench load``: many concurrent clients, each computing a result it verifies.

Each client keeps its own arrays on the proxy and runs ``ops`` calls: launches that add a known
amount to an accumulator, with a synchronous read-back every ``sync_every`` calls that checks
the running value. The bench reports total calls per second, the latency of the synchronous
calls under load (p50/p99) and of all calls, errors, how many clients verified their result,
and the proxy's memory before the clients connect and after they are gone.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import gpuremote
from gpuremote.localproxy import rss_bytes

from .stats import summarize
from .target import Target, TargetOptions, open_target

__all__ = ["LoadConfig", "run_load"]


@dataclass
class LoadConfig(TargetOptions):
    clients: int = 8
    ops: int = 1000
    sync_every: int = 100
    elements: int = 64


async def _proxy_rss_mb(target: Target, gpu: gpuremote.GPU | None = None) -> float | None:
    if target.proxy_pid is not None and target.proxy_pid != os.getpid():
        return rss_bytes(target.proxy_pid) / 2**20
    if gpu is not None:
        return float((await gpu.proxy_stats())["rss_bytes"]) / 2**20
    return None


async def _client(
    url: str, cfg: LoadConfig, index: int, sync_lat: list[int], all_lat: list[int]
) -> tuple[int, bool]:
    """One client's work: ``cfg.ops`` calls; returns (calls made, verified)."""
    clock = time.perf_counter_ns
    rng = np.random.default_rng(index)
    step = rng.integers(1, 5, cfg.elements).astype(np.float64)
    calls = 0
    async with gpuremote.connect(url) as gpu:
        x = gpu.asarray(step)
        acc = gpu.zeros(cfg.elements, "float64")
        calls += 2
        done = launched = 0
        ok = True
        while done < cfg.ops:
            for _ in range(min(cfg.sync_every - 1, cfg.ops - done - 1)):
                t0 = clock()
                gpu.axpy(1.0, x, acc)
                all_lat.append(clock() - t0)
                launched += 1
                done += 1
            t0 = clock()
            got = await acc.get()  # a synchronous round trip, behind everything queued
            dt = clock() - t0
            sync_lat.append(dt)
            all_lat.append(dt)
            done += 1
            ok = ok and bool(np.array_equal(got, step * launched))
        calls += done
    return calls, ok


async def run_load(
    cfg: LoadConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    async with open_target(cfg.url, cfg.transport, cfg.backend) as target:
        async with gpuremote.connect(target.url) as probe:
            await probe.synchronize()
            before = await _proxy_rss_mb(target, probe)
        sync_lat: list[int] = []
        all_lat: list[int] = []
        t0 = time.perf_counter()
        finished = 0

        async def client(i: int) -> tuple[int, bool]:
            nonlocal finished
            try:
                return await _client(target.url, cfg, i, sync_lat, all_lat)
            finally:
                finished += 1
                report({"finished": finished, "clients": cfg.clients})

        results = await asyncio.gather(
            *(client(i) for i in range(cfg.clients)), return_exceptions=True
        )
        elapsed = time.perf_counter() - t0
        errors = [r for r in results if isinstance(r, BaseException)]
        good = [r for r in results if not isinstance(r, BaseException)]
        calls = sum(c for c, _ in good)
        await asyncio.sleep(0.2)  # let the proxy see every disconnect
        async with gpuremote.connect(target.url) as probe:
            await probe.synchronize()
            after = await _proxy_rss_mb(target, probe)
    sync = summarize(sync_lat)
    return {
        "bench": "load",
        "transport": target.transport,
        "url": target.url,
        "clients": cfg.clients,
        "ops": cfg.ops,
        "errors": len(errors),
        "error_messages": sorted({f"{type(e).__name__}: {e}" for e in errors})[:5],
        "verified": sum(1 for _, ok in good if ok),
        "calls": calls,
        "seconds": elapsed,
        "calls_per_s": calls / elapsed if elapsed else 0.0,
        "p99_us": sync["p99"],
        "sync_latency_us": sync,
        "all_call_latency_us": summarize(all_lat),
        "proxy_rss_mb": {"before": before, "after": after},
    }
