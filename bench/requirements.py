"""``gpuremote bench requirements``: what latency and bandwidth each workload needs.

For each workload: run it locally (in-process, same backend: the baseline) and record its
trace; then run it remotely over emulated links across a grid of RTTs and bandwidths, with the
optimisations on and off, and put the model's prediction beside each measurement. The model
is given the link's round trip as measured by ping in the same run (the emulated setting plus
the real path underneath) and the client's per-call cost measured once. The result names, per
workload, the largest RTT and the smallest bandwidth at which the slowdown stays within the
tolerance.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import gpuremote
from gpuremote.local import connect_local
from gpuremote.model import Costs, predict
from gpuremote.workloads import WORKLOADS

from .target import TargetOptions, open_target

__all__ = ["SIZES", "RequirementsConfig", "ping_rtt", "run_requirements"]

#: workload sizes for the sweep (smaller than the workloads' own defaults, to keep it minutes)
SIZES: dict[str, dict[str, Any]] = {
    "mlp": {"steps": 60, "batch": 128, "din": 64, "hidden": 256, "dout": 16},
    "transformer": {"steps": 30, "seq": 32, "d_model": 128, "heads": 4},
    "upload": {"steps": 20, "batch_mb": 4.0, "features": 256},
}
QUICK_SIZES: dict[str, dict[str, Any]] = {
    "mlp": {"steps": 8, "batch": 64, "din": 32, "hidden": 128, "dout": 8},
    "transformer": {"steps": 4, "seq": 16, "d_model": 64, "heads": 4},
    "upload": {"steps": 5, "batch_mb": 2.0, "features": 256},
}


@dataclass
class RequirementsConfig(TargetOptions):
    backend: str = "numpy"
    workloads: list[str] = field(default_factory=lambda: sorted(WORKLOADS))
    rtts_us: list[float] = field(default_factory=lambda: [10, 100, 1000])
    bws_gbit: list[float] = field(default_factory=lambda: [1, 10, 100])
    tolerance: float = 0.05
    quick: bool = False
    repeats: int = 3


async def _timed(fn: Callable[..., Any], gpu: gpuremote.GPU, sizes: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    await fn(gpu, **sizes)
    return time.perf_counter() - t0


async def ping_rtt(url: str, n: int = 200) -> float:
    """The mean round trip of a small ping over ``url``, without the slowest 1% of samples.

    The mean, not the median: a workload's time is the sum of its round trips, and on a busy
    machine their distribution has a long tail that the median leaves out (the model then
    comes out short for workloads of many round trips); the slowest 1% (scheduling hiccups of
    milliseconds) would make the mean of a few hundred samples noisy."""
    async with gpuremote.connect(url) as gpu:
        for _ in range(10):
            await gpu.ping(b"x")
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            await gpu.ping(b"12345678")
            samples.append(time.perf_counter() - t0)
    kept = np.sort(samples)[: max(1, int(n * 0.99))]
    return float(np.mean(kept))


async def _calibrate(url: str, backend: str, base_rtt: float, n: int = 2000) -> Costs:
    """The remoting path's own costs, measured on the bare path (not fitted to the sweep):
    what a remote ASYNC call costs the client and the proxy beyond the same call made
    locally (whose costs the trace holds already), and the real path's bandwidth."""
    local = connect_local(backend)
    y = local.zeros(16, "float32")
    for _ in range(n):
        local.axpy(1.0, y, y)
    trace = local._session.trace  # type: ignore[attr-defined]
    gap = float(np.median([t.gap_s for t in trace[-n:]]))
    device = float(np.median([t.device_s for t in trace[-n:]]))
    await local.aclose()
    async with gpuremote.connect(url) as gpu:
        x = gpu.zeros(16, "float32")
        await gpu.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            gpu.axpy(1.0, x, x)
        client = (time.perf_counter() - t0) / n
        await gpu.synchronize()
        total = (time.perf_counter() - t0 - base_rtt) / n  # pipelined: the slower side's cost
        size = 16 << 20
        big = gpu.empty(size, "uint8")
        data = np.ones(size, np.uint8)
        await big.write(data)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            await big.write(data)
            times.append(time.perf_counter() - t0)
        per = float(np.median(times)) - base_rtt
    return Costs(
        client_per_call=max(0.0, client - gap),
        proxy_per_call=max(0.0, total - device),
        base_bw=size / per if per > 0 else None,
    )


async def _fit_proxy_cost(
    url: str,
    fn: Callable[..., Any],
    sizes: dict[str, Any],
    trace: list[Any],
    link: tuple[float, float | None],
    costs: Costs,
    repeats: int,
) -> tuple[float, Costs]:
    """The per-call cost of the remote path for this workload's mix of ops (the proxy's
    decoding and dispatch, and the emulator's own): the one model parameter fitted, on the
    grid's fastest link with the optimisations on; every other point is a prediction."""
    async with gpuremote.connect(url) as gpu:
        runs = [await _timed(fn, gpu, sizes) for _ in range(repeats + 1)][1:]
    bare = float(np.median(runs))
    rtt, bw = link

    def predicted(cost: float) -> float:
        return predict(trace, rtt, bw, costs=replace(costs, proxy_per_call=cost)).seconds

    lo, hi = 0.0, 200e-6
    if predicted(hi) < bare:
        return bare, replace(costs, proxy_per_call=hi)
    for _ in range(30):  # the prediction grows with the cost: bisect
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < bare else (lo, mid)
    return bare, replace(costs, proxy_per_call=lo)


def _emu(url: str, rtt_us: float, bw_gbit: float) -> str:
    return f"emu+{url}?rtt={rtt_us}us&bw={bw_gbit}gbit"


def _requirement(points: list[dict[str, Any]], optimized: bool, tol: float) -> dict[str, Any]:
    ok = [p for p in points if p["optimized"] == optimized and p["slowdown"] <= tol]
    return {
        "rtt_us": max((p["rtt_us"] for p in ok), default=None),
        "bw_gbit": min((p["bw_gbit"] for p in ok), default=None),
    }


async def run_requirements(
    cfg: RequirementsConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    sizes = QUICK_SIZES if cfg.quick else SIZES
    out: list[dict[str, Any]] = []
    total = len(cfg.workloads) * len(cfg.rtts_us) * len(cfg.bws_gbit) * 2
    done = 0
    async with open_target(cfg.url, cfg.transport, cfg.backend) as target:
        base_rtt = await ping_rtt(target.url)
        costs = await _calibrate(target.url, cfg.backend, base_rtt)
        for name in cfg.workloads:
            fn = WORKLOADS[name]
            local_times, trace = [], []
            for i in range(cfg.repeats + 1):  # the first run warms caches up, uncounted
                gpu = connect_local(cfg.backend)
                t = await _timed(fn, gpu, sizes[name])
                if i:
                    local_times.append(t)
                trace = list(gpu._session.trace)  # type: ignore[attr-defined]
                await gpu.aclose()
            local_s = float(np.median(local_times))
            steps = int(sizes[name]["steps"])
            fit_url = _emu(target.url, min(cfg.rtts_us), max(cfg.bws_gbit))
            fit_link = (await ping_rtt(fit_url), max(cfg.bws_gbit) * 1e9)
            bare_s, wl_costs = await _fit_proxy_cost(
                fit_url, fn, sizes[name], trace, fit_link, costs, max(5, cfg.repeats)
            )
            points = []
            for rtt in cfg.rtts_us:
                for bw in cfg.bws_gbit:
                    url = _emu(target.url, rtt, bw)
                    link_rtt = await ping_rtt(url)
                    for optimized in (True, False):
                        runs = []
                        async with gpuremote.connect(
                            url, async_calls=optimized, batching=optimized, shadow=optimized
                        ) as gpu:
                            for i in range(cfg.repeats + 1):  # the first run: warm-up
                                t = await _timed(fn, gpu, sizes[name])
                                if i:
                                    runs.append(t)
                        measured = float(np.median(runs))
                        p = predict(trace, link_rtt, bw * 1e9, optimized=optimized, costs=wl_costs)
                        predicted = p.seconds
                        points.append(
                            {
                                "rtt_us": rtt,
                                "bw_gbit": bw,
                                "optimized": optimized,
                                "link_rtt_us": link_rtt * 1e6,
                                "measured_s": measured,
                                "predicted_s": predicted,
                                "slowdown": measured / local_s - 1,
                                "predicted_slowdown": predicted / local_s - 1,
                                "model_error": predicted / measured - 1,
                            }
                        )
                        done += 1
                        report({"workload": name, "done": done, "total": total, "last": points[-1]})
            remote_calls = sum(1 for t in trace if t.klass != "local" or t.shadow_bytes)
            out.append(
                {
                    "name": name,
                    "sizes": sizes[name],
                    "local_s": local_s,
                    "calibration_s": bare_s,
                    "calibration_point": {
                        "rtt_us": min(cfg.rtts_us),
                        "bw_gbit": max(cfg.bws_gbit),
                        "optimized": True,
                    },
                    "proxy_per_call_us": wl_costs.proxy_per_call * 1e6,
                    "calls": len(trace),
                    "points": points,
                    "min_requirement": {
                        "optimized": _requirement(points, True, cfg.tolerance),
                        "unoptimized": _requirement(points, False, cfg.tolerance),
                    },
                    "sync_round_trips_per_step": {
                        "optimized": sum(1 for t in trace if t.klass == "sync") / steps,
                        "unoptimized": remote_calls / steps,
                    },
                }
            )
    errors = [abs(p["model_error"]) for w in out for p in w["points"]]
    return {
        "bench": "requirements",
        "url": target.url,
        "tolerance": cfg.tolerance,
        "base_rtt_us": base_rtt * 1e6,
        "client_per_call_us": costs.client_per_call * 1e6,
        "proxy_per_call_us": costs.proxy_per_call * 1e6,
        "base_gbyte_s": None if costs.base_bw is None else costs.base_bw / 1e9,
        "max_model_error": max(errors, default=None),
        "workloads": out,
    }


def plot(result: dict[str, Any], path: str) -> bool:
    """Slowdown against RTT, one line per bandwidth, measured points and model lines (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = result["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads, strict=True):
        for optimized, style in ((True, "-"), (False, ":")):
            bws = sorted({p["bw_gbit"] for p in w["points"]})
            for bw in bws:
                pts = sorted(
                    (p for p in w["points"] if p["bw_gbit"] == bw and p["optimized"] == optimized),
                    key=lambda p: p["rtt_us"],
                )
                x = [p["rtt_us"] for p in pts]
                label = f"{bw:g} Gbit/s{'' if optimized else ', unoptimized'}"
                line = ax.plot(
                    x, [100 * p["predicted_slowdown"] for p in pts], style, label=f"model, {label}"
                )[0]
                ax.plot(x, [100 * p["slowdown"] for p in pts], "o", color=line.get_color())
        ax.axhline(100 * result["tolerance"], color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("symlog")
        ax.set_xlabel("emulated RTT (µs)")
        ax.set_ylabel("slowdown vs local (%)")
        ax.set_title(w["name"])
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
