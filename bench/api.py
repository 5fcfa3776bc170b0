"""``gpuremote bench api``: N small launches with every call synchronous versus pipelined
(asynchronous, batched), over one transport; calls per second and round trips per call."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import gpuremote

from .target import TargetOptions, open_target

__all__ = ["ApiConfig", "run_api"]


@dataclass
class ApiConfig(TargetOptions):
    """``bench api``: ``calls`` launches on ``elements`` floats per round and mode, ``rounds``
    rounds (A B A B)."""

    calls: int = 10_000
    rounds: int = 3
    elements: int = 16


async def _one(gpu: gpuremote.GPU, n: int, elements: int) -> tuple[float, int]:
    """Seconds for ``n`` launches and the synchronize after them; round trips made."""
    x = gpu.asarray(np.ones(elements, np.float32))
    y = gpu.zeros(elements, "float32")
    await gpu.synchronize()
    before = gpu.stats()["round_trips"]
    t0 = time.perf_counter()
    for _ in range(n):
        gpu.launch("axpy", [x, y], [y], alpha=1.0)
    await gpu.synchronize()
    dt = time.perf_counter() - t0
    trips = gpu.stats()["round_trips"] - before
    got = await y.get()
    if not np.allclose(got, n):
        raise gpuremote.GpuRemoteError(f"api bench computed {got[0]}, expected {n}")
    return dt, trips


async def run_api(
    cfg: ApiConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    async with (
        open_target(cfg.url, cfg.transport, cfg.backend) as target,
        gpuremote.connect(target.url) as fast,
        gpuremote.connect(target.url, async_calls=False) as slow,
    ):
        await _one(fast, 100, cfg.elements)  # warm-up
        await _one(slow, 100, cfg.elements)
        times: dict[str, list[float]] = {"sync": [], "pipelined": []}
        trips: dict[str, int] = {}
        for r in range(cfg.rounds):  # A B A B
            for name, gpu in (("sync", slow), ("pipelined", fast)):
                dt, t = await _one(gpu, cfg.calls, cfg.elements)
                times[name].append(dt)
                trips[name] = t
                report(
                    {
                        "round": r + 1,
                        "rounds": cfg.rounds,
                        "mode": name,
                        "rate": cfg.calls / dt,
                        "url": target.url,
                    }
                )
    sync_rate = cfg.calls / float(np.median(times["sync"]))
    pipe_rate = cfg.calls / float(np.median(times["pipelined"]))
    return {
        "bench": "api",
        "transport": target.transport,
        "url": target.url,
        "calls": cfg.calls,
        "rounds": cfg.rounds,
        "sync_calls_per_s": sync_rate,
        "pipelined_calls_per_s": pipe_rate,
        "ratio": pipe_rate / sync_rate,
        "round_trips_per_call": {
            "sync": trips["sync"] / cfg.calls,
            "pipelined": trips["pipelined"] / cfg.calls,
        },
    }
