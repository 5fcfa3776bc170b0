"""``gpuremote bench load``: many concurrent clients, each computing a result it verifies.

Each client keeps its own arrays on the proxy and runs ``ops`` calls: launches that add a known
amount to an accumulator, with a synchronous read-back every ``sync_every`` calls that checks
the running value. The clients are spread over ``procs`` processes (so that the load generator
is not one event loop), and a light client beside them does one synchronous op on 16 floats
every 10 ms. The bench reports total calls per second and each client's own (min, median,
max), the latency of the synchronous calls under load (p50/p99) and of all calls, the light
client's latency, errors, how many clients verified their result, the proxy's CPU, and its
memory before the clients connect and after they are gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

import gpuremote
from gpuremote.proxy.heap import rss_bytes

from .stats import summarize
from .target import Target, TargetOptions, open_target

__all__ = ["LoadConfig", "run_load"]


@dataclass
class LoadConfig(TargetOptions):
    """``bench load`` (see the module docstring)."""

    clients: int = 8
    ops: int = 1000
    sync_every: int = 100
    elements: int = 64
    procs: int = 1  # processes the clients are spread over
    light_period_ms: float = 10.0  # the light client's op every this often; 0: none


async def _proxy_rss_mb(target: Target, gpu: gpuremote.GPU | None = None) -> float | None:
    if target.proxy_pid is not None and target.proxy_pid != os.getpid():
        return rss_bytes(target.proxy_pid) / 2**20
    if gpu is not None:
        return float((await gpu.proxy_stats())["rss_bytes"]) / 2**20
    return None


async def _client(
    url: str, cfg: LoadConfig, index: int, sync_lat: list[int], all_lat: list[int]
) -> tuple[int, bool, float, str]:
    """One client's work: ``cfg.ops`` calls; returns (calls made, verified, seconds, the URL
    of the proxy it used)."""
    clock = time.perf_counter_ns
    started = time.perf_counter()
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
        used = gpu.url
    return calls, ok, time.perf_counter() - started, used


Outcome = tuple[int, bool, float, str] | str  # (calls, verified, seconds, proxy), or the error


async def _clients(
    url: str, cfg: LoadConfig, indices: list[int], report: Callable[[int], None]
) -> tuple[list[Outcome], list[int], list[int]]:
    """Clients ``indices`` on this process's loop; their outcomes and latency samples."""
    sync_lat: list[int] = []
    all_lat: list[int] = []

    async def one(i: int) -> Outcome:
        try:
            return await _client(url, cfg, i, sync_lat, all_lat)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            report(1)

    outcomes = await asyncio.gather(*(one(i) for i in indices))
    return list(outcomes), sync_lat, all_lat


def _process(
    url: str, cfg_fields: dict[str, Any], indices: list[int]
) -> tuple[list[Outcome], list[int], list[int]]:
    """In a worker process: run clients ``indices`` to the end."""
    from gpuremote import aio

    cfg = LoadConfig(**cfg_fields)
    return aio.run(_clients(url, cfg, indices, lambda n: None))


async def _light(url: str, period_s: float, stop: asyncio.Event) -> list[int]:
    """One synchronous op on 16 floats every ``period_s`` until ``stop``; ns each."""
    out: list[int] = []
    async with gpuremote.connect(url) as gpu:
        x = gpu.asarray(np.ones(16, np.float32))
        await (x + x).get()
        while not stop.is_set():
            t0 = time.perf_counter_ns()
            got = await (x + x).get()
            out.append(time.perf_counter_ns() - t0)
            if got[0] != 2.0:
                raise gpuremote.GpuRemoteError(f"the light client read {got[0]}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)
    return out


class _Clients(NamedTuple):
    """What the clients did: their outcomes, the latencies (ns) of their synchronous calls,
    of all their calls and of the light client's ops, and the seconds they took."""

    outcomes: list[Outcome]
    sync_lat: list[int]
    all_lat: list[int]
    light_lat: list[int]
    elapsed: float


async def run_load(
    cfg: LoadConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    """Run the bench (see the module docstring); returns the JSON result."""
    async with open_target(cfg.url, cfg.transport, cfg.backend) as target:
        if cfg.procs > 1 and target.transport == "inproc":
            raise gpuremote.ConfigError("--procs needs a proxy other processes can reach (tcp)")
        pool = _pool(target.url)
        before = cpu0 = None
        if pool is None:  # one proxy: its memory and CPU (a pool's proxies report their own)
            async with gpuremote.connect(target.url) as probe:
                await probe.synchronize()
                before = await _proxy_rss_mb(target, probe)
                cpu0 = (await probe.proxy_stats()).get("process_cpu_s")
        clients = await _run_clients(cfg, target.url, report)
        after = cpu1 = None
        pool_status = None
        if pool is None:
            async with gpuremote.connect(target.url) as probe:
                cpu1 = (await probe.proxy_stats()).get("process_cpu_s")
            await asyncio.sleep(0.2)  # let the proxy see every disconnect
            async with gpuremote.connect(target.url) as probe:
                await probe.synchronize()
                after = await _proxy_rss_mb(target, probe)
        else:
            pool_status = await asyncio.to_thread(pool.status)
    return {
        **_result(cfg, target, clients),
        "proxy_cpu_s": (
            cpu1 - cpu0 if isinstance(cpu0, int | float) and isinstance(cpu1, int | float) else None
        ),
        "proxy_rss_mb": {"before": before, "after": after},
        "per_proxy": _per_proxy(clients),
        "pool": pool_status,  # each proxy's status at the end, for pool:// URLs
    }


async def _run_clients(
    cfg: LoadConfig, url: str, report: Callable[[dict[str, Any]], None]
) -> _Clients:
    """The clients to the end (in this process, or spread over ``cfg.procs``), and the light
    client beside them until they are done."""
    finished = 0

    def done(n: int) -> None:
        nonlocal finished
        finished += n
        report({"finished": finished, "clients": cfg.clients})

    stop = asyncio.Event()
    light = (
        asyncio.ensure_future(_light(url, cfg.light_period_ms / 1e3, stop))
        if cfg.light_period_ms > 0
        else None
    )
    t0 = time.perf_counter()
    indices = list(range(cfg.clients))
    if cfg.procs <= 1:
        outcomes, sync_lat, all_lat = await _clients(url, cfg, indices, done)
    else:
        outcomes, sync_lat, all_lat = await _in_processes(url, cfg, indices, done)
    elapsed = time.perf_counter() - t0
    stop.set()
    light_lat = await light if light is not None else []
    return _Clients(outcomes, sync_lat, all_lat, light_lat, elapsed)


def _result(cfg: LoadConfig, target: Target, clients: _Clients) -> dict[str, Any]:
    """The clients' figures: calls, rates, latencies, errors."""
    errors = [o for o in clients.outcomes if isinstance(o, str)]
    good = [o for o in clients.outcomes if not isinstance(o, str)]
    calls = sum(c for c, _, _, _ in good)
    rates = sorted(c / s for c, _, s, _ in good if s > 0)
    elapsed, light_lat = clients.elapsed, clients.light_lat
    sync = summarize(clients.sync_lat)
    light_us = summarize(light_lat) if light_lat else dict.fromkeys(("p50", "p99", "max"))
    return {
        "bench": "load",
        "transport": target.transport,
        "url": target.url,
        "clients": cfg.clients,
        "procs": max(1, cfg.procs),
        "ops": cfg.ops,
        "errors": len(errors),
        "error_messages": sorted(set(errors))[:5],
        "verified": sum(1 for _, ok, _, _ in good if ok),
        "calls": calls,
        "seconds": elapsed,
        "calls_per_s": calls / elapsed if elapsed else 0.0,
        "per_client_calls_per_s": {
            "min": rates[0] if rates else None,
            "median": float(np.median(rates)) if rates else None,
            "max": rates[-1] if rates else None,
            "max_over_min": rates[-1] / rates[0] if rates and rates[0] else None,
        },
        "p99_us": sync["p99"],
        "sync_latency_us": sync,
        "all_call_latency_us": summarize(clients.all_lat),
        "light_client": {
            "period_ms": cfg.light_period_ms,
            "ops": len(light_lat),
            "p50_us": light_us["p50"],
            "p99_us": light_us["p99"],
            "max_us": light_us["max"],
        },
    }


def _per_proxy(clients: _Clients) -> list[dict[str, Any]]:
    """Per proxy the clients used (one, or a pool's): sessions, calls, calls per second."""
    per_proxy: dict[str, dict[str, Any]] = {}
    for c, _, _, used in (o for o in clients.outcomes if not isinstance(o, str)):
        row = per_proxy.setdefault(used, {"url": used, "sessions": 0, "calls": 0})
        row["sessions"] += 1
        row["calls"] += c
    for row in per_proxy.values():
        row["calls_per_s"] = row["calls"] / clients.elapsed if clients.elapsed else 0.0
    return sorted(per_proxy.values(), key=lambda r: r["url"])


def _pool(url: str) -> Any:
    """The pool behind a ``pool://`` URL (and ``RAY_ADDRESS`` set, so that the client
    processes of ``--procs`` attach to the same cluster), else None."""
    from gpuremote.session.connection import placed

    pool = placed(url)
    if pool is None:
        return None
    from gpuremote.pool import attach, get_pool

    ray = attach()
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    return get_pool(pool[1])


async def _in_processes(
    url: str, cfg: LoadConfig, indices: list[int], done: Callable[[int], None]
) -> tuple[list[Outcome], list[int], list[int]]:
    """Clients ``indices`` spread over ``cfg.procs`` fresh processes (spawned, not forked)."""
    shares = [indices[i :: cfg.procs] for i in range(cfg.procs)]
    fields = asdict(cfg)
    loop = asyncio.get_running_loop()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(cfg.procs, mp_context=context) as pool:
        futures = [
            loop.run_in_executor(pool, _process, url, fields, share) for share in shares if share
        ]
        outcomes: list[Outcome] = []
        sync_lat: list[int] = []
        all_lat: list[int] = []
        for fut in asyncio.as_completed(futures):
            o, s, a = await fut
            outcomes += o
            sync_lat += s
            all_lat += a
            done(len(o))
    return outcomes, sync_lat, all_lat
