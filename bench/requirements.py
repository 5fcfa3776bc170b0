"""``gpuremote bench requirements``: what latency and bandwidth each workload needs.

For each workload: run it locally (in-process, same backend: the baseline) and record its
trace; then run it remotely over emulated links across a grid of RTTs and bandwidths, with the
optimisations on and off, and put the model's prediction beside each measurement. The model
is given the link's round trip as measured by ping in the same run (the emulated setting plus
the real path underneath) and the client's per-call cost measured once. The result names, per
workload, the largest RTT and the smallest bandwidth at which the slowdown stays within the
tolerance.

``--transport emu+inproc`` (with ``--backend sim:a100``) asks the paper's question at the paper's
scale on any machine: the proxy runs in this process and event loop, over ``inproc://`` with
no copies, behind an emulated link of µs precision, on a simulated A100 whose device time is a
virtual clock (``sim:a100,compute=0``: nothing computed, nothing slept). Everything happens on
one thread, so no wake-up (~90 µs here) and no GIL hand-off (5 ms) enters a figure; the client
and the proxy still each cost what they cost (the client waits while the proxy works, as it
does across two machines: gpuremote's pipeline sends when the client next waits). The costs
the model is given (client per call, proxy per call, the rest of a round trip) are measured
per workload and mode on the bare link (no RTT, no bandwidth limit), which is not a grid
point: every grid point is a prediction. The modes are a table (``MODES``): the optimisations
off, on, and ``replay`` (each step captured once and replayed by one message; its model is
given the trace of a captured local run, one ``step_replay`` per step).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import gpuremote
from gpuremote.errors import ConfigError
from gpuremote.tools.direct import connect_direct, trace_of
from gpuremote.tools.model import Costs, predict
from gpuremote.tools.model import local_seconds as local_seconds_of
from gpuremote.tools.workloads import WORKLOADS

from .points import (
    Mode,
    _median_run,
    _Point,
    _Progress,
    _Run,
    _run_queue_s,
    judge_workload,
)
from .target import TargetOptions, open_target

__all__ = [
    "EMU_SIZES",
    "MODES",
    "MODE_ALIASES",
    "PAPER_BWS_GBIT",
    "PAPER_RTTS_US",
    "SIZES",
    "Mode",
    "RequirementsConfig",
    "ping_rtt",
    "run_requirements",
]

#: the paper's grid (shared/notes/paper.md): RTTs in µs and bandwidths in Gbit/s
PAPER_RTTS_US: list[float] = [1, 2, 5, 10, 20, 40, 100]
PAPER_BWS_GBIT: list[float] = [10, 25, 100, 200]


#: the sweep's modes: the optimisations off, on, and on with each step captured once and
#: replayed by one message (``GPU.capture``)
MODES: dict[str, Mode] = {
    "unoptimized": Mode(
        "unoptimized", {"async_calls": False, "batching": False, "shadow": False}, False
    ),
    "optimized": Mode("optimized", {"async_calls": True, "batching": True, "shadow": True}, True),
    "replay": Mode(
        "replay",
        {"async_calls": True, "batching": True, "shadow": True},
        True,
        run=(("capture", True),),
    ),
}

#: other names of the modes: a PyTorch workload's compiled graphs are its captured steps
MODE_ALIASES = {"compiled": "replay"}

#: workload sizes for the sweep (smaller than the workloads' own defaults, to keep it minutes)
SIZES: dict[str, dict[str, Any]] = {
    "mlp": {"steps": 60, "batch": 128, "din": 64, "hidden": 256, "dout": 16},
    "transformer": {"steps": 30, "seq": 32, "d_model": 128, "heads": 4},
    "upload": {"steps": 20, "batch_mb": 4.0, "features": 256},
}
#: sizes on the simulated GPU over emu+inproc (device time is a clock: the sizes set the calls'
#: device time and bytes; steps keep a run at tens of ms)
EMU_SIZES: dict[str, dict[str, Any]] = {
    "mlp": {"steps": 30, "batch": 256, "din": 256, "hidden": 1024, "dout": 64},
    "transformer": {"steps": 15, "seq": 128, "d_model": 512, "heads": 8},
    "upload": {"steps": 10, "batch_mb": 4.0, "features": 256},
}
#: the same with fewer steps (and a smaller upload), for ``--quick``
EMU_QUICK_SIZES: dict[str, dict[str, Any]] = {
    name: {**EMU_SIZES[name], **quick}
    for name, quick in (
        ("mlp", {"steps": 8}),
        ("transformer", {"steps": 4}),
        ("upload", {"steps": 4, "batch_mb": 1.0}),
    )
}
#: the sweep's sizes for ``--quick`` over a real transport
QUICK_SIZES: dict[str, dict[str, Any]] = {
    "mlp": {"steps": 8, "batch": 64, "din": 32, "hidden": 128, "dout": 8},
    "transformer": {"steps": 4, "seq": 16, "d_model": 64, "heads": 4},
    "upload": {"steps": 5, "batch_mb": 2.0, "features": 256},
}


@dataclass
class RequirementsConfig(TargetOptions):
    """``bench requirements``: the grid (``rtts_us`` x ``bws_gbit``), the workloads and modes,
    the tolerance on the slowdown, and the turns per point."""

    backend: str = "numpy"
    workloads: list[str] = field(default_factory=lambda: sorted(WORKLOADS))
    rtts_us: list[float] = field(default_factory=lambda: [10, 100, 1000])
    bws_gbit: list[float] = field(default_factory=lambda: [1, 10, 100])
    tolerance: float = 0.05
    quick: bool = False
    repeats: int = 3
    modes: list[str] = field(default_factory=lambda: ["unoptimized", "optimized", "replay"])
    #: the PyTorch workloads' local baseline (``bench.torch_local``): ``pytorch`` (PyTorch
    #: alone on a local device) or ``inproc`` (through gpuremote's client in process)
    local_baseline: str = "pytorch"


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
    local = connect_direct(backend)
    y = local.zeros(16, "float32")
    for _ in range(n):
        local.axpy(1.0, y, y)
    trace = trace_of(local)
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


#: the transports of the sweep on the simulated device: its proxy in this process, or (the
#: PyTorch workloads) in a process of its own behind the emulated link
EMULATED = ("emu+inproc", "emu+tcp")


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
    """The sweep (see the module docstring): over ``emu+inproc`` on the simulated device, or
    over emulated links on top of a real transport."""
    if cfg.transport in EMULATED and cfg.url is None:
        return await _run_emulated(cfg, report)
    if cfg.transport == "emu+tcp":
        raise ConfigError("--transport emu+tcp starts its own proxy process: not with --url")
    return await _run_real(cfg, report)


async def _run_real(
    cfg: RequirementsConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    """The sweep over emulated links on top of a real transport (``cfg.transport``)."""
    sizes = QUICK_SIZES if cfg.quick else SIZES
    out: list[dict[str, Any]] = []
    progress = _Progress(len(cfg.workloads) * len(cfg.rtts_us) * len(cfg.bws_gbit) * 2, report)
    async with open_target(cfg.url, cfg.transport, cfg.backend) as target:
        base_rtt = await ping_rtt(target.url)
        costs = await _calibrate(target.url, cfg.backend, base_rtt)
        for name in cfg.workloads:
            out.append(await _real_workload(cfg, target.url, name, sizes[name], costs, progress))
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


async def _real_workload(
    cfg: RequirementsConfig,
    base_url: str,
    name: str,
    sizes: dict[str, Any],
    costs: Costs,
    progress: _Progress,
) -> dict[str, Any]:
    """One workload over real links: in process (the baseline, and its trace), then at each
    point of the grid with the optimisations on and off, the model's prediction beside."""
    fn = WORKLOADS[name]
    local_s, trace = await _local_baseline(fn, sizes, cfg.backend, cfg.repeats)
    fit_url = _emu(base_url, min(cfg.rtts_us), max(cfg.bws_gbit))
    fit_link = (await ping_rtt(fit_url), max(cfg.bws_gbit) * 1e9)
    bare_s, wl_costs = await _fit_proxy_cost(
        fit_url, fn, sizes, trace, fit_link, costs, max(5, cfg.repeats)
    )
    points = []
    for rtt in cfg.rtts_us:
        for bw in cfg.bws_gbit:
            url = _emu(base_url, rtt, bw)
            link_rtt = await ping_rtt(url)
            for optimized in (True, False):
                measured = await _remote_median(url, fn, sizes, optimized, cfg.repeats)
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
                progress.point_done(name, last=points[-1])
    steps = int(sizes["steps"])
    remote_calls = sum(1 for t in trace if t.klass != "local" or t.shadow_bytes)
    return {
        "name": name,
        "sizes": sizes,
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


async def _local_baseline(
    fn: Callable[..., Any], sizes: dict[str, Any], backend: str, repeats: int
) -> tuple[float, list[Any]]:
    """``fn`` in process, ``repeats`` times after a warm-up run: the median time, and the last
    run's trace."""
    local_times, trace = [], []
    for i in range(repeats + 1):  # the first run warms caches up, uncounted
        gpu = connect_direct(backend)
        t = await _timed(fn, gpu, sizes)
        if i:
            local_times.append(t)
        trace = list(trace_of(gpu))
        await gpu.aclose()
    return float(np.median(local_times)), trace


async def _remote_median(
    url: str, fn: Callable[..., Any], sizes: dict[str, Any], optimized: bool, repeats: int
) -> float:
    """The median time of ``repeats`` runs of ``fn`` over ``url`` after a warm-up run, with
    the optimisations on or off."""
    runs = []
    async with gpuremote.connect(
        url, async_calls=optimized, batching=optimized, shadow=optimized
    ) as gpu:
        for i in range(repeats + 1):  # the first run: warm-up
            t = await _timed(fn, gpu, sizes)
            if i:
                runs.append(t)
    return float(np.median(runs))


def timing_backend(spec: str) -> str:
    """``sim:a100`` -> ``sim:a100,compute=0``: the sweep times the device, it computes
    nothing (said so in its result); any other spec is kept as it is."""
    head, _, rest = spec.partition(":")
    if head == "sim" and rest and "compute=" not in rest:
        return f"{spec},compute=0"
    return spec


class _Link:
    """One client session over one URL, instrumented: ``await link.run()`` runs the workload
    once and returns what its steps took (from its ``ready`` call to its end) and what the
    client, the proxy, the device and the emulator did meanwhile."""

    def __init__(
        self,
        url: str,
        mode: Mode,
        fn: Callable[..., Any],
        sizes: dict[str, Any],
        proxy: Any,
        listener_name: str,
    ) -> None:
        self.url, self.mode, self.fn, self.sizes = url, mode, fn, sizes
        self.proxy, self.listener_name = proxy, listener_name
        self._cm: Any = None
        self.gpu: Any = None

    async def __aenter__(self) -> _Link:
        from gpuremote.transports.inproc import listener

        self._cm = gpuremote.connect(self.url, **self.mode.connect)
        self.gpu = await self._cm.__aenter__()
        session: Any = self.gpu._session
        self.session, self.conn = session, session.conn
        lst = listener(self.listener_name)
        assert lst is not None and lst.accepted, "no inproc connection to measure"
        self.proxy_end = lst.accepted[-1]  # connections are made one at a time: ours
        await self.fn(self.gpu, **self.sizes)  # warm-up, uncounted
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._cm.__aexit__(*exc)

    def _snapshot(self) -> tuple[float, ...]:
        return (
            time.perf_counter(),
            self.session.call_s,  # the client in synchronous calls (sending, waiting)
            self.proxy_end.busy_s,
            self.proxy.backend.timing()[1],
            self.conn.late_own_s,
            _run_queue_s(),
        )

    async def run(self) -> _Run:
        marks: list[tuple[float, ...]] = []
        await self.fn(self.gpu, **self.sizes, ready=lambda: marks.append(self._snapshot()))
        end, start = self._snapshot(), marks[-1]
        return _Run(*(e - s for e, s in zip(end, start, strict=True)))


async def _local(
    fn: Callable[..., Any], sizes: dict[str, Any], backend: str, record: bool = True
) -> tuple[_Run, list[Any]]:
    """One local run of ``fn``'s steps: (its time, its trace from the steps' start; without
    ``record``, none: the baseline's time without the cost of recording it)."""
    from gpuremote.backends import get_backend

    gpu = connect_direct(get_backend(backend), record=record)
    trace: list[Any] = trace_of(gpu)
    mark: list[tuple[float, int, float]] = []
    await fn(
        gpu,
        **sizes,
        ready=lambda: mark.append((time.perf_counter(), len(trace), _run_queue_s())),
    )
    seconds = time.perf_counter() - mark[0][0]
    stolen = _run_queue_s() - mark[0][2]
    steps = list(trace[mark[0][1] :])
    await gpu.aclose()
    return _Run(seconds, 0.0, 0.0, 0.0, 0.0, stolen), steps


def _emu_url(base: str, rtt_us: float | None, bw_gbit: float | None) -> str:
    opts = ["copy=0"]
    if rtt_us is not None:
        opts.append(f"rtt={rtt_us:g}us")
    if bw_gbit is not None:
        opts.append(f"bw={bw_gbit:g}gbit")
    return f"emu+{base}?{'&'.join(opts)}"


@dataclass(frozen=True)
class _Sweep:
    """What every workload of the emulated sweep shares: its configuration, the modes that
    run, the device, the proxy (in this process) and its base URL and listener's name."""

    cfg: RequirementsConfig
    modes: list[Mode]
    backend: str
    proxy: Any
    base: str
    listener_name: str
    progress: _Progress


async def _run_emulated(
    cfg: RequirementsConfig, report: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """The sweep over ``emu+inproc`` on the simulated device (see the module docstring)."""
    from gpuremote.proxy import Proxy

    backend = timing_backend(cfg.backend)
    sizes = EMU_QUICK_SIZES if cfg.quick else EMU_SIZES
    modes = list(
        {
            MODES[MODE_ALIASES.get(m, m)].name: MODES[MODE_ALIASES.get(m, m)] for m in cfg.modes
        }.values()
    )
    skipped = {m.name: m.unavailable for m in modes if m.unavailable}
    modes = [m for m in modes if not m.unavailable]
    name = f"requirements-{os.getpid()}-{time.monotonic_ns()}"
    # one thread: every batch inline; the sessions take turns (a local run, the bare link's,
    # the point's), so no batch waits its fair turn behind another's: a turn taken would run
    # it a loop hop later, outside the connection's receiver, and hide it from ``busy_s``
    proxy = Proxy(backend, inline_us=math.inf, contention_s=0.0)
    base = await proxy.start(f"inproc://{name}")
    out: list[dict[str, Any]] = []
    from .torch_requirements import (
        TORCH_WORKLOADS,
        torch_modes,
        torch_workload,
        torch_workload_linked,
    )

    torch_names = [w for w in cfg.workloads if w in TORCH_WORKLOADS]
    linked = cfg.transport == "emu+tcp"  # the PyTorch workloads' proxy in a process of its own
    if linked and len(torch_names) < len(cfg.workloads):
        await proxy.close()
        others = sorted(set(cfg.workloads) - set(torch_names))
        raise ConfigError(
            f"--transport emu+tcp runs the PyTorch workloads ({', '.join(TORCH_WORKLOADS)}), "
            f"not {', '.join(others)}: those over emu+inproc, or tcp for a real proxy"
        )
    modes_torch = torch_modes(cfg.modes) if torch_names else []
    grid = len(cfg.rtts_us) * len(cfg.bws_gbit)
    total = (len(cfg.workloads) - len(torch_names)) * len(modes) * grid
    total += len(torch_names) * len(modes_torch) * grid
    sweep = _Sweep(cfg, modes, backend, proxy, base, name, _Progress(total, report))
    t_start = time.perf_counter()
    try:
        for wname in cfg.workloads:
            if wname in TORCH_WORKLOADS:  # synchronous PyTorch: in a thread of its own
                run = torch_workload_linked if linked else torch_workload
                out.append(
                    await asyncio.to_thread(run, cfg, backend, modes_torch, wname, sweep.progress)
                )
            else:
                out.append(await _emulated_workload(sweep, wname, sizes[wname]))
    finally:
        await proxy.close()
    errors = [abs(p["model_error"]) for w in out for p in w["points"]]
    return {
        "bench": "requirements",
        "device": backend,
        "device_info": dict(proxy.backend.device_info()),
        "transport": cfg.transport,
        # where the proxy ran: this process's event loop, or a process of its own
        "proxy": "process" if linked else "in process",
        "url": None if linked else base,  # (each workload's proxy process its own)
        "tolerance": cfg.tolerance,
        "modes": [m.name for m in modes],
        "modes_skipped": skipped,
        "max_model_error": max(errors, default=None),
        "all_within": all(p["within"] for w in out for p in w["points"]),
        "seconds": time.perf_counter() - t_start,
        "workloads": out,
    }


async def _emulated_workload(sweep: _Sweep, wname: str, wsizes: dict[str, Any]) -> dict[str, Any]:
    """One workload: its traces in process, the grid measured in every mode, and each point
    beside the model's prediction."""
    cfg, modes = sweep.cfg, sweep.modes
    fn = WORKLOADS[wname]
    # the trace of the median quiet run: the model's calls, gaps and device times
    trace = await _median_trace(fn, wsizes, sweep.backend, cfg.repeats)
    local_model_s = local_seconds_of(trace)
    # a mode that runs the workload otherwise (captured steps) has a trace of its own
    mode_traces: dict[str, list[Any]] = {}
    for mode in modes:
        if not mode.run:
            mode_traces[mode.name] = trace
            continue
        mode_traces[mode.name] = await _median_trace(
            mode.workload(fn), wsizes, sweep.backend, cfg.repeats
        )
    measured, local_runs = await _measure_grid(sweep, wname, fn, wsizes)
    steps = int(wsizes["steps"])
    judged = judge_workload(cfg, modes, mode_traces, measured, local_runs, steps, trace)
    return {"name": wname, "sizes": wsizes, **judged, "local_model_s": local_model_s}


async def _median_trace(
    fn: Callable[..., Any], sizes: dict[str, Any], backend: str, repeats: int
) -> list[Any]:
    """The trace of the median quiet run of ``repeats`` local runs of ``fn`` (after one that
    warms caches up, uncounted)."""
    recorded: list[_Run] = []
    traces: dict[int, list[Any]] = {}
    for i in range(repeats + 1):
        lr, tr = await _local(fn, sizes, backend)
        if i:
            recorded.append(lr)
            traces[id(lr)] = tr
    return traces[id(_median_run(recorded))]


async def _measure_grid(
    sweep: _Sweep, wname: str, fn: Callable[..., Any], wsizes: dict[str, Any]
) -> tuple[dict[str, list[_Point]], list[_Run]]:
    """Every point of the grid in every mode (per mode, its points), and every local run.
    Per point, its runs alternate with runs over the bare link and in process (A B C A B
    C), whose rest of a round trip the point's prediction uses: drift (other jobs on shared
    CPUs) then hits them alike."""
    cfg = sweep.cfg
    local_runs: list[_Run] = []  # the baseline's runs, not recorded
    bare_url = _emu_url(sweep.base, None, None)
    measured: dict[str, list[_Point]] = {m.name: [] for m in sweep.modes}
    for rtt in cfg.rtts_us:
        for mode in sweep.modes:
            for bw in cfg.bws_gbit:
                url = _emu_url(sweep.base, rtt, bw)
                runs, bare, local = [], [], []
                mfn = mode.workload(fn)
                async with (  # entered in turn: each finds its own proxy end
                    _Link(bare_url, mode, mfn, wsizes, sweep.proxy, sweep.listener_name) as a,
                    _Link(url, mode, mfn, wsizes, sweep.proxy, sweep.listener_name) as b,
                ):
                    for _ in range(cfg.repeats):  # local, bare, point; again
                        lr, _ = await _local(fn, wsizes, sweep.backend, record=False)
                        local.append(lr)
                        bare.append(await a.run())
                        runs.append(await b.run())
                measured[mode.name].append(_Point(rtt, bw, runs, bare, local))
                local_runs += local
                sweep.progress.point_done(wname)
    return measured, local_runs


def _mode(point: dict[str, Any]) -> str:
    return str(point.get("mode", "optimized" if point["optimized"] else "unoptimized"))


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
    styles = {"optimized": "-", "unoptimized": ":", "replay": "--"}
    for ax, w in zip(axes[0], workloads, strict=True):
        for mode, style in styles.items():
            bws = sorted({p["bw_gbit"] for p in w["points"]})
            for bw in bws:
                pts = sorted(
                    (p for p in w["points"] if p["bw_gbit"] == bw and _mode(p) == mode),
                    key=lambda p: p["rtt_us"],
                )
                if not pts:
                    continue
                x = [p["rtt_us"] for p in pts]
                label = f"{bw:g} Gbit/s, {mode}"
                line = ax.plot(
                    x, [100 * p["predicted_slowdown"] for p in pts], style, label=f"model, {label}"
                )[0]
                ax.plot(x, [100 * p["slowdown"] for p in pts], "o", color=line.get_color())
        ax.axhline(100 * result["tolerance"], color="grey", lw=0.8, label="tolerance")
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
