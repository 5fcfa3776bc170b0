"""``gpuremote bench throughput``: host-to-device and device-to-host copies through gpuremote
for a sweep of sizes, interleaved transfer by transfer with the same pattern over bare
blocking sockets and asyncio streams (an 8-byte ack or request the other way)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import gpuremote
from gpuremote.proxy.heap import peak_rss_bytes, reset_peak_rss, rss_bytes
from gpuremote.wire.framing import byte_view

from .baseline import Baselines
from .stats import gbps, ratio
from .target import Target, TargetOptions, open_target

__all__ = ["DEFAULT_SIZES", "ThroughputConfig", "run_compare", "run_throughput"]

DEFAULT_SIZES = [4096 * 4**i for i in range(9)]  # 4 KiB .. 256 MiB
_EMPTY = memoryview(b"")


@dataclass
class ThroughputConfig(TargetOptions):
    """``bench throughput``: the sizes swept; per size, about ``bytes_per_point`` bytes of
    transfers, within [``min_reps``, ``max_reps``]."""

    sizes: list[int] = field(default_factory=lambda: list(DEFAULT_SIZES))
    baseline: bool = True
    bytes_per_point: int = 1 << 30  # transfers per size: this many bytes, within [min, max]
    min_reps: int = 5
    max_reps: int = 200


def _reps(cfg: ThroughputConfig, size: int) -> int:
    return max(cfg.min_reps, min(cfg.max_reps, cfg.bytes_per_point // max(size, 1)))


async def run_throughput(
    cfg: ThroughputConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the sweep; returns the JSON result and the raw samples (one row per transfer)."""
    async with (
        open_target(cfg.url, cfg.transport, cfg.backend) as target,
        gpuremote.connect(target.url) as gpu,
    ):
        memory = await _memory_phase(gpu, target, max(cfg.sizes))
        base = await Baselines.open(gpu.device, target.host, cfg.baseline)
        try:
            return await _sweep(cfg, gpu, target, base, memory, report)
        finally:
            base.close()


async def _memory_phase(gpu: gpuremote.GPU, target: Target, size: int) -> dict[str, Any]:
    """One upload and one download of ``size`` bytes, with the peak memory of both sides."""
    host = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    arr = gpu.empty(size, "uint8")
    await gpu.synchronize()
    pid = target.proxy_pid if target.proxy_pid != os.getpid() else None
    start = {"client": rss_bytes(), "proxy": rss_bytes(pid) if pid else None}
    reset_peak_rss()
    if pid:
        reset_peak_rss(pid)
    await arr.write(host)
    back = await arr.get()
    client_peak = peak_rss_bytes()  # before the check below, which makes temporaries
    ok = bool(np.array_equal(back, host))
    del back
    if pid:
        proxy_peak: float | None = peak_rss_bytes(pid)
    else:
        stats = await gpu.proxy_stats()
        proxy_peak = stats.get("peak_rss_bytes") if target.proxy_pid is None else None
    arr.free()
    mb = 1 << 20
    return {
        "payload_mb": size / mb,
        "verified": ok,
        "client": client_peak / mb,
        "proxy": None if proxy_peak is None else proxy_peak / mb,
        "start_mb": {k: None if v is None else v / mb for k, v in start.items()},
    }


def _paths(
    direction: str, arr: gpuremote.RemoteArray, host: np.ndarray, base: Baselines
) -> dict[str, Callable[[], Any]]:
    """One transfer of ``host``'s size in ``direction`` over each path."""
    view, size = byte_view(host), host.nbytes
    b, a = base.blocking, base.asyncio
    if direction == "h2d":

        async def gpuremote_path() -> None:
            await arr.write(host)

        async def blocking_path() -> None:
            assert b is not None
            b.request(view, 8)

        async def asyncio_path() -> None:
            assert a is not None
            await a.request(view, 8)

        async def ucxx_path() -> None:
            assert base.ucxx is not None
            await base.ucxx.request(view, 8)
    else:

        async def gpuremote_path() -> None:
            await arr.get()

        async def blocking_path() -> None:
            assert b is not None
            b.request(_EMPTY, size)

        async def asyncio_path() -> None:
            assert a is not None
            await a.request(_EMPTY, size)

        async def ucxx_path() -> None:
            assert base.ucxx is not None
            await base.ucxx.request(_EMPTY, size)

    paths: dict[str, Callable[[], Any]] = {"gpuremote": gpuremote_path}
    if b is not None and a is not None:
        paths.update(blocking=blocking_path, asyncio=asyncio_path)
    if base.ucxx is not None:
        paths["ucxx"] = ucxx_path
    return paths


async def _sweep(
    cfg: ThroughputConfig,
    gpu: gpuremote.GPU,
    target: Target,
    base: Baselines,
    memory: dict[str, Any],
    report: Callable[[dict[str, Any]], None],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each size up and down over every path; the JSON result and one raw row per transfer."""
    results: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    state = {
        "url": target.url,
        "transport": target.transport,
        "results": results,
        "done": 0,
        "total": 2 * len(cfg.sizes),
        "current": "",
    }
    for size in cfg.sizes:
        host = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
        arr = gpu.empty(size, "uint8")
        await arr.write(host)
        if not np.array_equal(await arr.get(), host):
            raise gpuremote.GpuRemoteError(f"data of {size} bytes came back changed")
        reps = _reps(cfg, size)
        for direction in ("h2d", "d2h"):
            state["current"] = f"{direction} {size} bytes x {reps}"
            report(dict(state))
            paths = _paths(direction, arr, host, base)
            times = await _transfers(paths, reps, size, direction, raw)
            results.append(_row(size, direction, reps, times, target.transport))
            state["done"] = len(results)
            report(dict(state))
        arr.free()
    result = {
        "bench": "throughput",
        "transport": target.transport,
        "url": target.url,
        "baseline": "blocking sockets, two processes" if base.blocking else None,
        "baseline_note": base.why_not,
        "results": results,
        "peak_rss_mb": {
            "client": memory["client"],
            "proxy": memory["proxy"],
            "payload_mb": memory["payload_mb"],
            "start": memory["start_mb"],
        },
    }
    return result, raw


async def _transfers(
    paths: dict[str, Callable[[], Any]],
    reps: int,
    size: int,
    direction: str,
    raw: list[dict[str, Any]],
) -> dict[str, list[int]]:
    """``reps`` transfers over each path, interleaved transfer by transfer (A B C A B C) after
    one warm-up transfer each: ns per transfer and path (each also a row of ``raw``)."""
    clock = time.perf_counter_ns
    times: dict[str, list[int]] = {k: [] for k in paths}
    for fn in paths.values():  # one warm-up transfer each
        await fn()
    for i in range(reps):
        for name, fn in paths.items():
            t0 = clock()
            await fn()
            dt = clock() - t0
            times[name].append(dt)
            raw.append(
                {
                    "path": name,
                    "size": size,
                    "direction": direction,
                    "iteration": i,
                    "ns": dt,
                }
            )
    return times


def _row(
    size: int, direction: str, reps: int, times: dict[str, list[int]], transport: str
) -> dict[str, Any]:
    """One size and direction: each path's bandwidth (medians) and gpuremote's ratio to the
    transport's own bare baseline."""
    g = gbps(size, times["gpuremote"])
    base_gbps = gbps(size, times["blocking"]) if "blocking" in times else None
    aio = gbps(size, times["asyncio"]) if "asyncio" in times else None
    ucxx = gbps(size, times["ucxx"]) if "ucxx" in times else None
    return {
        "size": size,
        "direction": direction,
        "reps": reps,
        "gbps": g,
        "gbit_s": g * 8,
        "baseline_gbps": base_gbps,
        "asyncio_gbps": aio,
        "ucxx_gbps": ucxx,
        # to this transport's own bare baseline: ucxx for ucx://, sockets else
        "ratio": ratio(g, ucxx if ucxx is not None else base_gbps),
        "transport": transport,
    }


async def run_compare(
    cfg: ThroughputConfig,
    transports: list[str],
    report: Callable[[dict[str, Any]], None] = lambda s: None,
) -> dict[str, Any]:
    """The sweep over each of ``transports`` (one proxy each, one after the other), every row
    with its ratio to that transport's own bare baseline (interleaved with it), and per size
    and direction each transport's bandwidth over the first's."""
    from dataclasses import replace

    runs = []
    for t in transports:
        result, _ = await run_throughput(replace(cfg, transport=t, url=None), report)
        runs.append(result)
    rows = [row for r in runs for row in r["results"]]
    first = {(r["size"], r["direction"]): r["gbps"] for r in runs[0]["results"]}
    versus = []
    for run in runs[1:]:
        for r in run["results"]:
            versus.append(
                {
                    "transport": run["transport"],
                    "versus": runs[0]["transport"],
                    "size": r["size"],
                    "direction": r["direction"],
                    "ratio": ratio(r["gbps"], first.get((r["size"], r["direction"]))),
                }
            )
    return {
        "bench": "throughput",
        "compare": transports,
        "results": rows,
        "versus_first": versus,
        "runs": [{k: v for k, v in r.items() if k != "results"} for r in runs],
    }
