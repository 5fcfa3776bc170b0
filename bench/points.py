"""What a sweep's runs measured and how each point is judged (``bench requirements``): a
run's figures (``_Run``), a point's turns (``_Point``), the modes (``Mode``), the model's fit
of the software's measured costs to a run (``_fitted``) and the requirement a grid shows
(``_min_requirement``). Shared by the async workloads' sweep (``requirements``) and the
PyTorch workloads' (``torch_requirements``)."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from gpuremote.config import PipelineConfig
from gpuremote.tools.model import Costs, predict
from gpuremote.tools.model import local_seconds as local_seconds_of

__all__ = ["Mode", "judge_workload"]


@dataclass(frozen=True)
class Mode:
    """How the client remotes a workload in one column of the sweep."""

    name: str
    connect: dict[str, Any]  # keyword arguments of gpuremote.connect
    optimized: bool  # the model's switch
    unavailable: str | None = None  # why this mode cannot run yet (None: it can)
    run: tuple[tuple[str, Any], ...] = ()  # keyword arguments of the workload
    #: how the client sends what it queues, for the model: None, when it next waits (the
    #: in-process sweep's); a configuration, by a synchronous driver's batching policy
    posts: PipelineConfig | None = None

    def workload(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as this mode runs it (its local baseline stays plain ``fn``)."""
        return functools.partial(fn, **dict(self.run)) if self.run else fn


class _Progress:
    """The sweep's points done, of ``total``, reported after each."""

    def __init__(self, total: int, report: Callable[[dict[str, Any]], None]) -> None:
        self.total, self.done, self._report = total, 0, report

    def point_done(self, workload: str, **more: Any) -> None:
        self.done += 1
        self._report({"workload": workload, "done": self.done, "total": self.total, **more})


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


def _lost_s() -> float:
    """Seconds this thread has waited for a CPU beyond what this process's other threads
    ran (Linux's schedstat; 0 where unknown): they share its CPUs, and their time is the
    program's own (PyTorch's autograd thread of a device, where a backward pass runs; a
    driver's helper thread sending), not other processes'. A lower bound of what other
    processes took from it (its siblings' time may fall where it did not wait: a backward
    pass runs while the thread that asked for it waits for it), negative where they ran
    more than it waited."""
    me = threading.get_native_id()
    others = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tasks:
        if int(tid) == me:
            continue
        with (
            contextlib.suppress(OSError, IndexError, ValueError),  # (one that ended)
            open(f"/proc/self/task/{tid}/schedstat") as fh,
        ):
            others += int(fh.read().split()[0])
    return _run_queue_s() - others / 1e9


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
    p = predict(
        scaled,
        rtt_us * 1e-6,
        bw,
        optimized=mode.optimized,
        costs=costs,
        batched=True,
        posts=mode.posts,
    )
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


def _against(
    points: list[dict[str, Any]], modes: list[Mode], tol: float, runs: list[_Run]
) -> dict[str, Any]:
    """The points judged against another local baseline (its runs): its time, and what the
    grid needs against it, measured and by the model."""
    local_s = _median_run(runs).wall
    judged = [
        {
            **p,
            "slowdown": p["measured_s"] / local_s - 1,
            "predicted_slowdown": p["predicted_s"] / local_s - 1,
        }
        for p in points
    ]
    return {
        "local_s": local_s,
        "local_runs_s": [r.wall for r in runs],
        "min_requirement": {m.name: _min_requirement(judged, m.name, tol) for m in modes},
        "min_requirement_model": _requirements(judged, modes, tol, "predicted_slowdown"),
    }


class _Point(NamedTuple):
    """One point of the grid in one mode, as measured: its turns' runs over the point's link,
    over the bare link, and in process (``runs[i]``, ``bare[i]``, ``local[i]``: one turn)."""

    rtt: float
    bw: float
    runs: list[_Run]
    bare: list[_Run]
    local: list[_Run]


def _mode_points(
    cfg: Any,  # the sweep's configuration (its ``tolerance``)
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
    cfg: Any,  # the sweep's configuration (its ``tolerance``)
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
    ideal = predict(
        trace, rtt * 1e-6, bw * 1e9, optimized=mode.optimized, batched=True, posts=mode.posts
    ).seconds
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


def judge_workload(
    cfg: Any,
    modes: list[Mode],
    traces: dict[str, list[Any]],
    measured: dict[str, list[_Point]],
    local_runs: list[_Run],
    steps: int,
    plain: list[Any] | None = None,
    baselines: dict[str, list[_Run]] | None = None,
) -> dict[str, Any]:
    """A workload's figures in a sweep's result: its points in every mode beside the
    model's predictions (each mode's trace, ``traces``), the costs the model was given, and
    what the grid shows it needs (measured, by the model, and the network's share), against
    ``local_runs``; ``plain``: the trace of the workload as written, for its figures where no
    mode ran; ``baselines``: every local baseline's runs by name, each point's slowdown and
    the requirements against each reported too."""
    local_s = _median_run(local_runs).wall
    points: list[dict[str, Any]] = []
    costs: dict[str, dict[str, Any]] = {}
    for mode in modes:
        mode_points, costs[mode.name] = _mode_points(
            cfg, mode, traces[mode.name], measured[mode.name], local_s
        )
        points += mode_points
    # the optimized mode's trace; without that mode, the last mode's (without modes, the
    # workload's as written)
    trace = traces.get("optimized", traces[modes[-1].name] if modes else (plain or []))
    _, trips, _, _ = _remote_calls(trace, True)
    tol = cfg.tolerance
    against = {name: _against(points, modes, tol, runs) for name, runs in (baselines or {}).items()}
    for p in points:
        p["slowdowns"] = {name: p["measured_s"] / a["local_s"] - 1 for name, a in against.items()}
    return {
        "local_baselines": against,
        "local_s": local_s,
        "local_runs_s": [r.wall for r in local_runs],
        "local_model_s": local_seconds_of(trace),
        "device_s": sum(t.kernel_s for t in trace),
        "calls": len(trace),
        # calls the device is sent per step, by mode (a replayed step: one)
        "calls_per_step": {m.name: len(traces[m.name]) / steps for m in modes},
        "costs": costs,
        "points": points,
        "min_requirement": {m.name: _min_requirement(points, m.name, tol) for m in modes},
        # the model's answer with the software's costs as measured at each point
        # (steadier than the measured one where other jobs disturb runs)
        "min_requirement_model": _requirements(points, modes, tol, "predicted_slowdown"),
        # the model's answer were the client's and proxy's software free: the
        # network's share of the requirement (the local run's gaps and host time)
        "min_requirement_network_only": _requirements(points, modes, tol, "network_only_slowdown"),
        "sync_round_trips_per_step": {
            "optimized": trips / steps,
            "unoptimized": _remote_calls(trace, False)[1] / steps,
        },
    }
