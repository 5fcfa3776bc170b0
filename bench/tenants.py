"""``gpuremote bench tenants``: does one tenant's device work hold up another's?

A light client does ``b = x + x; await b.get()`` on 16 floats every ``period_ms``; a heavy
client runs ``matmuls`` chained matmuls of ``n`` x ``n`` and reads the result, in a loop. Three
phases on one proxy, each ``seconds`` long: the light client alone, the heavy one alone, then
both at once. Reported: the light client's latency percentiles alone and beside the heavy one
(and their ratio), and the heavy client's loops per second alone and beside the light one.
Each client has its own connection (its own session on the proxy).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import gpuremote

from .stats import ratio
from .target import TargetOptions, open_target

__all__ = ["TenantsConfig", "run_tenants"]


@dataclass
class TenantsConfig(TargetOptions):
    """``bench tenants``: each phase ``seconds`` long; a light op every ``period_ms``, beside
    a heavy client's ``matmuls`` chained matmuls of ``n`` x ``n``."""

    seconds: float = 3.0  # per phase
    period_ms: float = 10.0  # between the light client's ops
    n: int = 1500  # the heavy client's matrix size
    matmuls: int = 4  # chained per loop


def _percentiles(samples_s: list[float]) -> dict[str, float | None]:
    if not samples_s:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    a = np.asarray(samples_s) * 1e3
    p50, p99 = np.percentile(a, [50, 99])
    return {"p50_ms": float(p50), "p99_ms": float(p99), "max_ms": float(a.max())}


async def _light(gpu: gpuremote.GPU, until: float, period_s: float) -> list[float]:
    x = gpu.asarray(np.ones(16, np.float32))
    out = []
    while time.perf_counter() < until:
        t0 = time.perf_counter()
        b = x + x
        got = await b.get()
        out.append(time.perf_counter() - t0)
        if got[0] != 2.0:
            raise gpuremote.GpuRemoteError(f"the light client read {got[0]}")
        await asyncio.sleep(max(0.0, period_s - (time.perf_counter() - t0)))
    return out


async def _heavy(gpu: gpuremote.GPU, until: float, n: int, matmuls: int) -> int:
    rng = np.random.default_rng(0)
    a = gpu.asarray((rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32))
    await gpu.synchronize()
    loops = 0
    while time.perf_counter() < until:
        c = a
        for _ in range(matmuls):
            c = c @ a
        await c.get()
        loops += 1
    return loops


async def run_tenants(
    cfg: TenantsConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    """Run the three phases; returns the JSON result."""
    period = cfg.period_ms / 1e3
    async with (
        open_target(cfg.url, cfg.transport, cfg.backend) as target,
        gpuremote.connect(target.url) as light,
        gpuremote.connect(target.url) as heavy,
    ):
        result: dict[str, Any] = {
            "bench": "tenants",
            "url": target.url,
            "transport": target.transport,
            "backend": light.backend,
            "seconds": cfg.seconds,
            "period_ms": cfg.period_ms,
            "n": cfg.n,
            "matmuls": cfg.matmuls,
        }
        await _light(light, time.perf_counter() + 0.3, period)  # warm-up
        alone = await _light(light, time.perf_counter() + cfg.seconds, period)
        result["light_alone"] = _percentiles(alone)
        report({**result, "phase": "heavy alone"})
        t0 = time.perf_counter()
        loops = await _heavy(heavy, t0 + cfg.seconds, cfg.n, cfg.matmuls)
        result["heavy_alone_loops_per_s"] = loops / (time.perf_counter() - t0)
        report({**result, "phase": "both"})
        t0 = time.perf_counter()
        until = t0 + cfg.seconds
        beside, loops = await asyncio.gather(
            _light(light, until, period), _heavy(heavy, until, cfg.n, cfg.matmuls)
        )
        result["heavy_beside_loops_per_s"] = loops / (time.perf_counter() - t0)
        result["light_beside"] = _percentiles(beside)
        result["light_p50_ratio"] = ratio(
            result["light_beside"]["p50_ms"], result["light_alone"]["p50_ms"]
        )
        result["heavy_ratio"] = ratio(
            result["heavy_beside_loops_per_s"], result["heavy_alone_loops_per_s"]
        )
        result["light_samples"] = {"alone": len(alone), "beside": len(beside)}
        report({**result, "phase": "done"})
        return result
