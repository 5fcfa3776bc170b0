"""``gpuremote bench ping``: round trips of small messages through the whole gpuremote path,
interleaved with bare echoes over blocking sockets and over asyncio (A B A B)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import gpuremote
from gpuremote.aio import spin_until_done
from gpuremote.wire.framing import byte_view

from .baseline import Baselines
from .stats import ratio, summarize
from .target import TargetOptions, open_target

__all__ = ["PingConfig", "run_ping"]


@dataclass
class PingConfig(TargetOptions):
    """``bench ping``: ``count`` round trips of ``size`` bytes per path (or ``duration``
    seconds), in ``rounds`` interleaved chunks, after ``warmup`` uncounted ones."""

    size: int = 8
    count: int = 20_000
    duration: float | None = None  # seconds; overrides count
    warmup: int = 1_000
    baseline: bool = True
    rounds: int = 20
    spin_us: float = 0.0  # client-side spin-wait, for gpuremote and the asyncio echo alike


async def run_ping(
    cfg: PingConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Run the bench; returns the JSON result and the raw samples (ns) per path."""
    async with (
        open_target(cfg.url, cfg.transport, cfg.backend) as target,
        gpuremote.connect(target.url, spin_us=cfg.spin_us) as gpu,
    ):
        base = await Baselines.open(gpu.device, target.host, cfg.baseline)
        try:
            return await _measure(cfg, gpu, target.url, target.transport, base, report)
        finally:
            base.close()


async def _waited(request: Awaitable[Any], spin_us: float) -> None:
    """Await a baseline's ``request`` with the same spin-wait as gpuremote's (``spin_us``), so
    that each ratio compares like with like."""
    if spin_us:
        fut = asyncio.ensure_future(request)
        spin_until_done(fut, spin_us / 1e6)
        await fut
    else:
        await request


async def _measure(
    cfg: PingConfig,
    gpu: gpuremote.GPU,
    url: str,
    transport: str,
    base: Baselines,
    report: Callable[[dict[str, Any]], None],
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    payload = byte_view(np.random.default_rng(0).integers(0, 256, cfg.size, dtype=np.uint8))
    clock = time.perf_counter_ns

    async def gr() -> None:
        await gpu.ping(payload)

    paths: dict[str, Callable[[], Any]] = {"gpuremote": gr}
    if base.blocking is not None and base.asyncio is not None:
        b, a = base.blocking, base.asyncio

        async def run_blocking() -> None:
            b.request(payload, cfg.size)

        async def run_asyncio() -> None:
            await _waited(a.request(payload, cfg.size), cfg.spin_us)

        paths["blocking"] = run_blocking
        paths["asyncio"] = run_asyncio
    if base.ucxx is not None:
        u = base.ucxx

        async def run_ucxx() -> None:
            await _waited(u.request(payload, cfg.size), cfg.spin_us)

        paths["ucxx"] = run_ucxx
    echo = await gpu.ping(payload)
    if bytes(echo) != bytes(payload):
        raise gpuremote.GpuRemoteError("ping echo does not match what was sent")
    for fn in paths.values():  # warm-up, not counted
        for _ in range(cfg.warmup):
            await fn()
    samples: dict[str, list[int]] = {name: [] for name in paths}
    total = cfg.count if cfg.duration is None else 0
    chunk = max(1, cfg.count // cfg.rounds) if cfg.duration is None else 500
    deadline = time.monotonic() + (cfg.duration or 0)
    done = 0
    while (done < total) if cfg.duration is None else (time.monotonic() < deadline):
        n = min(chunk, total - done) if cfg.duration is None else chunk
        for name, fn in paths.items():  # A B C A B C: drift hits every path alike
            out = samples[name]
            for _ in range(n):
                t0 = clock()
                await fn()
                out.append(clock() - t0)
        done += n
        report(_state(cfg, url, transport, samples, done, total or done))
    arrays = {k: np.asarray(v, dtype=np.int64) for k, v in samples.items()}
    result = _result(cfg, transport, url, arrays)
    result["baseline_note"] = base.why_not
    return result, arrays


def _state(
    cfg: PingConfig, url: str, transport: str, samples: dict[str, list[int]], done: int, total: int
) -> dict[str, Any]:
    stats = {k: summarize(v) if v else None for k, v in samples.items()}
    g = stats["gpuremote"]
    ratios = {k: ratio(g["p50"], s["p50"]) if g and s else None for k, s in stats.items()}
    recent = np.asarray(samples["gpuremote"][-2000:], dtype=np.float64) / 1e3
    return {
        "url": url,
        "transport": transport,
        "size": cfg.size,
        "done": done,
        "total": total,
        "stats": stats,
        "ratios": ratios,
        "recent_us": recent,
    }


def _result(
    cfg: PingConfig, transport: str, url: str, arrays: dict[str, np.ndarray]
) -> dict[str, Any]:
    rtt = summarize(arrays["gpuremote"])
    base = {k: summarize(v) for k, v in arrays.items() if k != "gpuremote"}
    ref = base.get("asyncio")
    return {
        "bench": "ping",
        "transport": transport,
        "url": url,
        "size": cfg.size,
        "spin_us": cfg.spin_us,
        "count": int(arrays["gpuremote"].size),
        "warmup": cfg.warmup,
        "rtt_us": rtt,
        "baseline_rtt_us": ref,
        "baseline": "asyncio streams echo on the proxy's event loop" if ref else None,
        "baselines": base,
        "ratio_p50": ratio(rtt["p50"], ref["p50"]) if ref else None,
        "ratio_p50_blocking": ratio(rtt["p50"], base["blocking"]["p50"]) if base else None,
        # ucx://: against bare ucxx tagged messages on the same endpoints and driver
        "ratio_p50_ucxx": ratio(rtt["p50"], base["ucxx"]["p50"]) if "ucxx" in base else None,
    }
