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

import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

import gpuremote
from gpuremote.tools.direct import connect_direct, trace_of
from gpuremote.tools.model import Costs, predict
from gpuremote.tools.model import local_seconds as local_seconds_of
from gpuremote.tools.workloads import WORKLOADS

from .target import TargetOptions, open_target

__all__ = [
    "EMU_SIZES",
    "MODES",
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


@dataclass(frozen=True)
class Mode:
    """How the client remotes a workload in one column of the sweep."""

    name: str
    connect: dict[str, Any]  # keyword arguments of gpuremote.connect
    optimized: bool  # the model's switch
    unavailable: str | None = None  # why this mode cannot run yet (None: it can)
    run: tuple[tuple[str, Any], ...] = ()  # keyword arguments of the workload

    def workload(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as this mode runs it (its local baseline stays plain ``fn``)."""
        return functools.partial(fn, **dict(self.run)) if self.run else fn


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
    if cfg.transport == "emu+inproc" and cfg.url is None:
        return await _run_emulated(cfg, report)
    return await _run_real(cfg, report)


class _Progress:
    """The sweep's points done, of ``total``, reported after each."""

    def __init__(self, total: int, report: Callable[[dict[str, Any]], None]) -> None:
        self.total, self.done, self._report = total, 0, report

    def point_done(self, workload: str, **more: Any) -> None:
        self.done += 1
        self._report({"workload": workload, "done": self.done, "total": self.total, **more})


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


@dataclass(frozen=True)
class _Run:
    """What one run of a workload's steps over one link measured (seconds)."""

    wall: float
    awaited: float  # the client waiting in synchronous calls
    proxy_busy: float  # the proxy handling frames (its device waits included)
    device_waited: float  # the simulated device's waits, in the proxy
    late: float  # frames released after they could have been (the emulator's own error)
    stolen: float  # this thread ready to run but not running (other processes had the CPUs)


def _run_queue_s() -> float:
    """Seconds this thread has waited for a CPU (Linux's schedstat; 0 where unknown)."""
    try:
        with open("/proc/thread-self/schedstat") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


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
        self.awaited = 0.0

    async def __aenter__(self) -> _Link:
        from gpuremote.transports.inproc import listener

        self._cm = gpuremote.connect(self.url, **self.mode.connect)
        self.gpu = await self._cm.__aenter__()
        session: Any = self.gpu._session
        self.conn = session.conn
        lst = listener(self.listener_name)
        assert lst is not None and lst.accepted, "no inproc connection to measure"
        self.proxy_end = lst.accepted[-1]  # connections are made one at a time: ours
        call = session.call

        async def timed_call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await call(*args, **kwargs)
            finally:
                self.awaited += time.perf_counter() - t0

        session.call = timed_call  # on this instance: the time the client spends waiting
        await self.fn(self.gpu, **self.sizes)  # warm-up, uncounted
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._cm.__aexit__(*exc)

    def _snapshot(self) -> tuple[float, ...]:
        return (
            time.perf_counter(),
            self.awaited,
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


def _remote_calls(trace: list[Any], optimized: bool) -> tuple[int, int, float, float]:
    """(remote calls, round trips, the calls' local gaps, their host time on the proxy)."""
    calls = trips = 0
    gaps = host = 0.0
    for t in trace:
        gaps += t.gap_s
        if t.klass == "local" and (optimized or not t.shadow_bytes):
            continue
        calls += 1
        host += t.device_s
        trips += 1 if (t.klass == "sync" or not optimized or t.klass == "local") else 0
    return calls, trips, gaps, host


def _fitted(trace: list[Any], mode: Mode, run: _Run, per_trip: float) -> tuple[Costs, list[Any]]:
    """The trace and costs the model is given for ``run``, from what it measured: the
    client's own time (outside its synchronous waits: the workload's code and making the
    calls) spread over the calls as the local run's gaps are; the proxy's busy time beyond
    the device's waits, over the remote calls as the local executor's time for each call
    (its host time, ``device_s``) plus an equal share of what the proxy spent beyond that
    (decoding, dispatch; where the proxy spent less, the host times scaled down), so that a
    call doing much work (a recorded step's replay) costs the proxy that much more;
    ``per_trip``: the rest of a round trip (loop hops, replies), from the bare link
    (``_per_trip``). The link and the device are the model's."""
    calls, _, gaps, host = _remote_calls(trace, mode.optimized)
    client = run.wall - run.awaited
    scale = client / gaps if gaps > 0 else 1.0
    proxy = max(0.0, run.proxy_busy - run.device_waited)
    fixed = max(0.0, proxy - host) / max(1, calls)
    share = (proxy - fixed * calls) / host if host > 0 else 0.0
    scaled = [replace(t, gap_s=t.gap_s * scale, device_s=t.device_s * share) for t in trace]
    return Costs(proxy_per_call=fixed, client_per_trip=per_trip), scaled


def _proxy_per_call(scaled: list[Any], mode: Mode, costs: Costs) -> float:
    """What the proxy spent per remote call, as ``_fitted`` gave it to the model."""
    calls, _, _, host = _remote_calls(scaled, mode.optimized)
    return costs.proxy_per_call + host / max(1, calls)


def _predicted(
    trace: list[Any], mode: Mode, run: _Run, per_trip: float, rtt_us: float, bw_gbit: float | None
) -> tuple[float, Costs, list[Any]]:
    costs, scaled = _fitted(trace, mode, run, per_trip)
    bw = None if bw_gbit is None else bw_gbit * 1e9
    p = predict(scaled, rtt_us * 1e-6, bw, optimized=mode.optimized, costs=costs, batched=True)
    return p.seconds, costs, scaled


def _quiet(runs: list[_Run], share: float = 0.02) -> list[_Run]:
    """The runs that lost at most ``share`` of their time to other processes, else the
    third that lost least: other engineers' jobs on a shared machine take this process's CPU
    at random, which is nobody's cost (``stolen``)."""
    quiet = [r for r in runs if r.stolen <= share * r.wall]
    if quiet:
        return quiet
    return sorted(runs, key=lambda r: r.stolen / r.wall)[: max(1, len(runs) // 3)]


def _proxy_s(run: _Run) -> float:
    """The proxy's own time in ``run`` (not waiting for the device)."""
    return run.proxy_busy - run.device_waited


def _per_trip(trace: list[Any], mode: Mode, bare: list[_Run], like: _Run | None = None) -> float:
    """What a round trip costs beyond the client's and proxy's measured time: what remains
    of the bare link's time (no RTT, no bandwidth limit) per round trip (the median over the
    quiet runs). With ``like``, that rest in proportion to the proxy's time, as ``like``
    measured it: it is the same kind of work (loop turns, futures, the emulator's pump:
    Python on small objects), and a shared machine's speed drifts by 10-20% between runs a
    few ms apart (not the client's time: uploads make it memory-bound, which drifts apart)."""
    _, trips, _, _ = _remote_calls(trace, mode.optimized)
    rests = []
    for r in _quiet(bare):
        rest = (r.wall - _predicted(trace, mode, r, 0.0, 0.0, None)[0]) / max(1, trips)
        rests.append(rest if like is None else rest * _proxy_s(like) / _proxy_s(r))
    return float(np.median(rests))


def _quietest(*series: list[_Run], share: float = 0.02) -> int:
    """The index ``i`` of the runs to report, where ``series`` are runs made in turn
    (``a[i]``, ``b[i]``, ... one after the other): among the turns that lost at most
    ``share`` of their time to other processes (else the least-disturbed third), the one
    whose last run took the median time."""
    runs = series[-1]
    lost = [
        sum(s[i].stolen for s in series) / sum(s[i].wall for s in series) for i in range(len(runs))
    ]
    order = sorted(range(len(runs)), key=lambda i: lost[i])
    keep = [i for i in order if lost[i] <= share] or order[: max(1, len(order) // 3)]
    keep.sort(key=lambda i: runs[i].wall)
    return keep[(len(keep) - 1) // 2]  # the lower median


def _median_run(runs: list[_Run]) -> _Run:
    """The run of the median time among the quiet ones (``_quiet``)."""
    quiet = sorted(_quiet(runs), key=lambda r: r.wall)
    return quiet[len(quiet) // 2]


def _emu_url(base: str, rtt_us: float | None, bw_gbit: float | None) -> str:
    opts = ["copy=0"]
    if rtt_us is not None:
        opts.append(f"rtt={rtt_us:g}us")
    if bw_gbit is not None:
        opts.append(f"bw={bw_gbit:g}gbit")
    return f"emu+{base}?{'&'.join(opts)}"


def _requirements(
    points: list[dict[str, Any]], modes: list[Mode], tol: float, slowdown: str
) -> dict[str, dict[str, Any]]:
    """``_min_requirement`` per mode, judged by the points' ``slowdown`` figure."""
    judged = [{**p, "slowdown": p[slowdown]} for p in points]
    return {m.name: _min_requirement(judged, m.name, tol) for m in modes}


def _min_requirement(points: list[dict[str, Any]], mode: str, tol: float) -> dict[str, Any]:
    """The largest RTT up to which every RTT of the grid keeps the slowdown within ``tol``
    at the grid's best bandwidth, and the smallest bandwidth from which every bandwidth does
    at the grid's best RTT (None: not even the best one does)."""
    pts = [p for p in points if p["mode"] == mode]
    if not pts:
        return {"rtt_us": None, "bw_gbit": None}
    best_bw = max(p["bw_gbit"] for p in pts)
    best_rtt = min(p["rtt_us"] for p in pts)
    rtt_ok: float | None = None
    for p in sorted((p for p in pts if p["bw_gbit"] == best_bw), key=lambda p: p["rtt_us"]):
        if p["slowdown"] > tol:
            break
        rtt_ok = p["rtt_us"]
    bw_ok: float | None = None
    for p in sorted((p for p in pts if p["rtt_us"] == best_rtt), key=lambda p: -p["bw_gbit"]):
        if p["slowdown"] > tol:
            break
        bw_ok = p["bw_gbit"]
    return {"rtt_us": rtt_ok, "bw_gbit": bw_ok}


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


class _Point(NamedTuple):
    """One point of the grid in one mode, as measured: its turns' runs over the point's link,
    over the bare link, and in process (``runs[i]``, ``bare[i]``, ``local[i]``: one turn)."""

    rtt: float
    bw: float
    runs: list[_Run]
    bare: list[_Run]
    local: list[_Run]


async def _run_emulated(
    cfg: RequirementsConfig, report: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """The sweep over ``emu+inproc`` on the simulated device (see the module docstring)."""
    from gpuremote.proxy import Proxy

    backend = timing_backend(cfg.backend)
    sizes = EMU_QUICK_SIZES if cfg.quick else EMU_SIZES
    modes = [MODES[m] for m in cfg.modes]
    skipped = {m.name: m.unavailable for m in modes if m.unavailable}
    modes = [m for m in modes if not m.unavailable]
    name = f"requirements-{os.getpid()}-{time.monotonic_ns()}"
    # one thread: every batch inline; the sessions take turns (a local run, the bare link's,
    # the point's), so no batch waits its fair turn behind another's: a turn taken would run
    # it a loop hop later, outside the connection's receiver, and hide it from ``busy_s``
    proxy = Proxy(backend, inline_us=math.inf, contention_s=0.0)
    base = await proxy.start(f"inproc://{name}")
    out: list[dict[str, Any]] = []
    total = len(cfg.workloads) * len(modes) * len(cfg.rtts_us) * len(cfg.bws_gbit)
    sweep = _Sweep(cfg, modes, backend, proxy, base, name, _Progress(total, report))
    t_start = time.perf_counter()
    try:
        for wname in cfg.workloads:
            out.append(await _emulated_workload(sweep, wname, sizes[wname]))
    finally:
        await proxy.close()
    errors = [abs(p["model_error"]) for w in out for p in w["points"]]
    return {
        "bench": "requirements",
        "device": backend,
        "device_info": dict(proxy.backend.device_info()),
        "transport": "emu+inproc",
        "url": base,
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
    local_s = _median_run(local_runs).wall
    points: list[dict[str, Any]] = []
    costs_by_mode: dict[str, dict[str, Any]] = {}
    for mode in modes:
        mode_points, costs_by_mode[mode.name] = _mode_points(
            cfg, mode, mode_traces[mode.name], measured[mode.name], local_s
        )
        points += mode_points
    steps = int(wsizes["steps"])
    # the optimized mode's trace; without that mode, the last mode's (without modes, the
    # recorded one)
    trace = mode_traces.get("optimized", mode_traces[modes[-1].name] if modes else trace)
    _, trips, _, _ = _remote_calls(trace, True)
    return {
        "name": wname,
        "sizes": wsizes,
        "local_s": local_s,
        "local_runs_s": [r.wall for r in local_runs],
        "local_model_s": local_model_s,
        "device_s": sum(t.kernel_s for t in trace),
        "calls": len(trace),
        # calls the device is sent per step, by mode (a replayed step: one)
        "calls_per_step": {m.name: len(mode_traces[m.name]) / steps for m in modes},
        "costs": costs_by_mode,
        "points": points,
        "min_requirement": {m.name: _min_requirement(points, m.name, cfg.tolerance) for m in modes},
        # the model's answer with the software's costs as measured at each point
        # (steadier than the measured one where other jobs disturb runs)
        "min_requirement_model": _requirements(points, modes, cfg.tolerance, "predicted_slowdown"),
        # the model's answer were the client's and proxy's software free: the
        # network's share of the requirement (the local run's gaps and host time)
        "min_requirement_network_only": _requirements(
            points, modes, cfg.tolerance, "network_only_slowdown"
        ),
        "sync_round_trips_per_step": {
            "optimized": trips / steps,
            "unoptimized": _remote_calls(trace, False)[1] / steps,
        },
    }


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


def _mode_points(
    cfg: RequirementsConfig,
    mode: Mode,
    trace: list[Any],
    measured: list[_Point],
    local_s: float,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One mode's points, each beside the model's prediction, and the mode's costs as the
    bare link's runs measured them."""
    every = [r for p in measured for r in p.bare]
    per_trip_all = _per_trip(trace, mode, every)
    mid = _median_run(every)
    _, bare_costs, scaled = _predicted(trace, mode, mid, per_trip_all, 0.0, None)
    ncalls = max(1, _remote_calls(trace, mode.optimized)[0])
    costs = {
        "client_per_call_us": sum(t.gap_s for t in scaled) / ncalls * 1e6,
        "proxy_per_call_us": _proxy_per_call(scaled, mode, bare_costs) * 1e6,
        "per_trip_us": per_trip_all * 1e6,
        "bare_link_s": mid.wall,
        "bare_runs": len(every),
    }
    network_local_s = local_seconds_of(trace)
    points = [
        _emulated_point(cfg, mode, trace, p, local_s, network_local_s, ncalls) for p in measured
    ]
    return points, costs


def _emulated_point(
    cfg: RequirementsConfig,
    mode: Mode,
    trace: list[Any],
    point: _Point,
    local_s: float,
    network_local_s: float,
    ncalls: int,
) -> dict[str, Any]:
    """One point: its least disturbed turn, measured and predicted (``local_s``: the local
    runs' median; ``network_local_s``: the local time of the mode's trace, the network-only
    prediction's baseline)."""
    rtt, bw, runs, bare, local = point
    # the triple (a local run, a bare run, the point's run, one after the other) that other
    # processes disturbed least; among equals, the one of the median time; the slowdown is
    # against the local runs' median (their turns spread over the whole sweep)
    i = _quietest(local, bare, runs)
    r = runs[i]
    # the rest of a round trip: from the point's bare runs (their median: one run can be held
    # up by what no CPU figure shows), in proportion to the proxy's own time in the point's run
    per_trip = _per_trip(trace, mode, bare, like=r)
    predicted, costs, scaled = _predicted(trace, mode, r, per_trip, rtt, bw)
    ideal = predict(trace, rtt * 1e-6, bw * 1e9, optimized=mode.optimized, batched=True).seconds
    err = predicted / r.wall - 1
    emu_error = r.late / r.wall
    stolen = (r.stolen + bare[i].stolen) / r.wall
    return {
        "rtt_us": rtt,
        "bw_gbit": bw,
        "mode": mode.name,
        "optimized": mode.optimized,
        "measured_s": r.wall,
        "predicted_s": predicted,
        "model_error": err,
        "emulator_error": emu_error,
        "cpu_stolen": stolen,
        "within": abs(err) <= max(cfg.tolerance, emu_error + stolen),
        "slowdown": r.wall / local_s - 1,
        "predicted_slowdown": predicted / local_s - 1,
        "network_only_slowdown": ideal / network_local_s - 1,
        "client_per_call_us": sum(t.gap_s for t in scaled) / ncalls * 1e6,
        "proxy_per_call_us": _proxy_per_call(scaled, mode, costs) * 1e6,
        "runs_s": [x.wall for x in runs],
        "bare_runs_s": [x.wall for x in bare],
        "per_trip_us": per_trip * 1e6,
    }


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
