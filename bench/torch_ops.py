"""``gpuremote bench ops --workload resnet18,bert,gpt2``: the paper's PyTorch programs, eager,
remote beside local.

Each workload (``gpuremote.torch.models``) trains with AdamW, clipped gradients and a read of
its loss each step, on the local CPU and on the ``gpuremote`` device (a proxy the bench starts,
over tcp:// by default, or ``--url``), in interleaved rounds (local, remote, local, ...) so
that the machine's drift hits both alike. Per step: wall time (p50, p90) on each side and
their ratio; the client's CPU (this process, every thread) and the proxy's (its own process
CPU, from its ``stats``); the calls the step made (ATen ops, transfers, replays, frees) and
the client's CPU per call; frames sent and round trips. ``--size small`` (default) or
``real`` (the paper's sizes; each model says what it is). ``--compile``: each workload also compiled
(``torch.compile(model, backend="gpuremote")``, and the update after the backward pass, the
clipping and AdamW's step, with the optimizer's state on the device: ``capturable``), its
graphs recorded in the warm-up and replayed by one message each: a row of its own beside
eager, with its client CPU per step over eager's. The workload ``ops``
measures single ops instead (``OP_CASES`` on 16 floats): the client's CPU per op, remote
beside local, gpuremote's own cost per ATen call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .target import open_target

__all__ = ["run_torch_ops"]


@dataclass
class _Side:
    """One side's figures: wall seconds per step, CPU seconds, counters over the steps."""

    wall_s: list[float] = field(default_factory=list)
    client_cpu_s: float = 0.0
    proxy_cpu_s: float | None = 0.0
    steps: int = 0
    calls: int = 0
    frames: int = 0
    round_trips: int = 0
    replays: int = 0  # compiled graphs replayed by one message
    eager_graphs: int = 0  # compiled graphs run op by op (recorded, or not recordable)
    #: the proxy's graphs (``gpuremote.proxy.graphs``): ops replayed in them, the replaying
    #: thread's CPU in their callables and in their whole replays
    graph_ops: int = 0
    graph_run_s: float = 0.0  # wall time in their callables
    graph_run_cpu_s: float = 0.0
    graph_replay_cpu_s: float = 0.0
    #: the session's graphs the proxy runs compiled (``--graphs inductor``), after the round
    graphs_compiled: int = 0


#: a pause before each side's steps: OpenMP's workers spin for a while after a parallel
#: region (a local compiled step's kernels, a proxy's matrix products); their CPU is not the
#: next side's (with ``--pin``, this process's workers share its one CPU)
_QUIET_S = 0.2


def _p(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _quartiles(seconds: list[float]) -> list[float]:
    """The 25th and 75th percentiles of per-op ``seconds``, in microseconds."""
    return [1e6 * float(np.percentile(seconds, q)) for q in (25, 75)]


def _row(
    name: str, describe: str, local: _Side, remote: _Side, mode: str = "eager"
) -> dict[str, Any]:
    lp50, rp50 = _p(local.wall_s, 50), _p(remote.wall_s, 50)
    n = max(remote.steps, 1)
    client_cpu = remote.client_cpu_s / n
    return {
        "name": name,
        "mode": mode,
        "model": describe,
        "steps": remote.steps,
        "local_step_ms": None if lp50 is None else 1e3 * lp50,
        "local_step_p90_ms": None if (v := _p(local.wall_s, 90)) is None else 1e3 * v,
        "remote_step_ms": None if rp50 is None else 1e3 * rp50,
        "remote_step_p90_ms": None if (v := _p(remote.wall_s, 90)) is None else 1e3 * v,
        "remote_over_local": None if not lp50 or rp50 is None else rp50 / lp50,
        "local_cpu_ms": 1e3 * local.client_cpu_s / max(local.steps, 1),
        "client_cpu_ms": 1e3 * client_cpu,
        "proxy_cpu_ms": None if remote.proxy_cpu_s is None else 1e3 * remote.proxy_cpu_s / n,
        "calls_per_step": remote.calls / n,
        "client_cpu_per_call_us": 1e6 * client_cpu / (remote.calls / n) if remote.calls else None,
        "frames_per_step": remote.frames / n,
        "round_trips_per_step": remote.round_trips / n,
        "graph_replays_per_step": remote.replays / n,
        "eager_graphs_per_step": remote.eager_graphs / n,
        "proxy_graph_ops_per_step": remote.graph_ops / n,
        "proxy_graph_run_ms": 1e3 * remote.graph_run_s / n,  # the graphs' callables, wall
        "proxy_graphs_compiled": remote.graphs_compiled,  # (of the session's, by inductor)
        # the proxy's CPU per op of its graphs beyond the ops' own (the callable's): the
        # inputs' views, the results' buffers, the replay's bookkeeping
        "proxy_cpu_per_graph_op_us": (
            1e6 * (remote.graph_replay_cpu_s - remote.graph_run_cpu_s) / remote.graph_ops
            if remote.graph_ops
            else None
        ),
    }


def _step(w: Any, model: Any, opt: Any, x: Any, y: Any, update: Any = None) -> float:
    """One training step, ending in the read of its loss: ``update()`` (else the clipping
    and the optimizer's step) after the backward pass."""
    loss = w.loss(model, x, y)
    opt.zero_grad()
    loss.backward()
    (update or _updater(model, opt))()
    return float(loss.item())


def _updater(model: Any, opt: Any) -> Callable[[], None]:
    """What follows the backward pass: the gradients clipped, the optimizer's step."""
    from torch import nn

    def update() -> None:
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return update


@contextlib.contextmanager
def _connected(url: str | None, backend: str) -> Iterator[Any]:
    import gpuremote.torch as gt

    conn = gt.connect(url) if url else gt.connect_local(backend)
    try:
        yield conn
    finally:
        conn.close()


def _proxy_stats(conn: Any) -> dict[str, Any]:
    """The session's figures on the proxy (its ``stats`` call)."""
    from gpuremote.wire.calls import CALLS_BY_NAME

    stats, _ = conn.drivers[0].call(CALLS_BY_NAME["stats"], [])
    return dict(stats)


def _proxy_cpu(stats: dict[str, Any], in_process: bool) -> float | None:
    """The proxy's process CPU (None in process: it is this process's)."""
    cpu = stats.get("process_cpu_s")
    return float(cpu) if isinstance(cpu, int | float) and not in_process else None


#: single ops, for ``--workload ops``: what gpuremote's client spends on one ATen call
#: (``a``: 16 floats, ``w``: 4x4)
OP_CASES: dict[str, Callable[[Any, Any], Any]] = {
    "a + a": lambda a, w: a + a,
    "a.add_(1.0)": lambda a, w: a.add_(1.0),
    "w @ w": lambda a, w: w @ w,
    "a.relu()": lambda a, w: a.relu(),
    "w.view(-1)": lambda a, w: w.view(-1),
}


def _op_cases(
    conn: Any,
    rounds: int,
    report: Callable[[dict[str, Any]], None],
    base: dict[str, Any],
    in_process: bool,
) -> list[dict[str, Any]]:
    """Client CPU per op for ``OP_CASES`` on 16-float tensors (medians of ``rounds`` rounds
    of 2,000, and the rounds' 25th and 75th percentiles: the machine's noise), remote beside
    local (the same op on the CPU); and the proxy's process CPU per op (None for a proxy in
    this process), beside the local op's."""
    import torch

    rows = []
    for code, op in OP_CASES.items():
        per_dev: dict[str, float] = {}
        spread: dict[str, list[float]] = {}
        proxy: list[float] = []
        for dev in ("cpu", "gpuremote"):
            a, w = torch.ones(16, device=dev), torch.ones(4, 4, device=dev)

            def fn(op: Callable[[Any, Any], Any] = op, a: Any = a, w: Any = w) -> Any:
                return op(a, w)

            for _ in range(300):
                fn()
            samples = []
            for _ in range(rounds):
                remote = dev == "gpuremote"
                p0 = _proxy_cpu(_proxy_stats(conn), in_process) if remote else None
                c0 = time.process_time()
                for _ in range(2000):
                    fn()
                samples.append((time.process_time() - c0) / 2000)
                if remote:
                    conn.synchronize()
                    p1 = _proxy_cpu(_proxy_stats(conn), in_process)
                    if p0 is not None and p1 is not None:
                        proxy.append((p1 - p0) / 2000)
            per_dev[dev] = float(np.median(samples))
            spread[dev] = _quartiles(samples)
        proxy_us = 1e6 * float(np.median(proxy)) if proxy else None
        local_us = 1e6 * per_dev["cpu"]
        rows.append(
            {
                "op": code,
                "rounds": rounds,
                "local_cpu_us": local_us,
                "local_cpu_us_quartiles": spread["cpu"],
                "client_cpu_us": 1e6 * per_dev["gpuremote"],
                "client_cpu_us_quartiles": spread["gpuremote"],
                # the proxy's whole process (its loop, decoding, the op), where it is one
                "proxy_cpu_us": proxy_us,
                "proxy_cpu_us_quartiles": _quartiles(proxy) if proxy else None,
                "proxy_beyond_op_us": None if proxy_us is None else proxy_us - local_us,
            }
        )
        report({**base, "workloads": [], "ops": rows})
    return rows


def _measure(
    names: list[str],
    size: str,
    steps: int,
    rounds: int,
    url: str | None,
    backend: str,
    report: Callable[[dict[str, Any]], None],
    base: dict[str, Any],
    compile: bool = False,
) -> dict[str, Any]:
    """The rounds (in a thread of its own: the device is driven from synchronous code)."""
    import torch

    from gpuremote.torch.models import workload

    rows: list[dict[str, Any]] = []
    in_process = url is None
    with _connected(url, backend) as conn:
        ops = _op_cases(conn, rounds, report, base, in_process) if "ops" in names else None
        if ops is not None:
            base = {**base, "ops": ops}
        for name in names:
            if name == "ops":
                continue
            w = workload(name, size)
            torch.manual_seed(0)
            models = {dev: w.make().to(dev) for dev in ("cpu", "gpuremote")}
            opts = {
                dev: torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01)
                for dev, m in models.items()
            }
            g = torch.Generator().manual_seed(1)
            x, y = w.batch(g)
            data = {dev: (x.to(dev), y.to(dev)) for dev in models}
            # what each side runs: (the model, its device, its optimizer, the update)
            runs: dict[str, tuple[Any, str, Any, Any]] = {
                dev: (m, dev, opts[dev], _updater(m, opts[dev])) for dev, m in models.items()
            }
            if compile:
                runs.update(_compiled_runs(models))
            for side_name, run in runs.items():  # warm-up: the metadata cache, the allocator,
                # lazy imports; a compiled side's recordings, the proxy's tracing and compiling
                for _ in range(3 if side_name in ("compiled", "cpu_compiled") else 1):
                    _step(w, run[0], run[2], *data[run[1]], run[3])
            sides = {k: _Side() for k in runs}
            for _ in range(rounds):
                for side_name, (model, dev, opt, update) in runs.items():
                    time.sleep(_QUIET_S)  # (the last side's worker threads: see there)
                    side = sides[side_name]
                    remote = dev == "gpuremote"
                    # (the stats calls: outside the timed steps)
                    p0 = _proxy_stats(conn) if remote else None
                    s0 = conn.stats() if remote else None
                    c0 = time.process_time()
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        _step(w, model, opt, *data[dev], update)
                        side.wall_s.append(time.perf_counter() - t0)
                    side.client_cpu_s += time.process_time() - c0
                    side.steps += steps
                    if p0 is not None and s0 is not None:
                        _add(side, s0, conn.stats(), p0, _proxy_stats(conn), in_process)
                done = _rows(name, w.describe, sides)
                report({**base, "workloads": [*rows, *done]})
            rows.extend(done)
            del models, opts, data, runs
    return {**base, "workloads": rows}


def _compiled_runs(models: dict[str, Any]) -> dict[str, tuple[Any, str, Any, Any]]:
    """The compiled sides: the remote weights' model and update under
    ``torch.compile(backend="gpuremote")`` (the optimizer's steps on the device:
    ``capturable``, so that a graph holds them), the local ones under inductor."""
    import torch

    torch._dynamo.reset()
    m = models["gpuremote"]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01, capturable=True)
    update = torch.compile(_updater(m, opt), backend="gpuremote")
    mc = models["cpu"]
    opt_c = torch.optim.AdamW(mc.parameters(), lr=1e-4, weight_decay=0.01)
    update_c = torch.compile(_updater(mc, opt_c), backend="inductor")
    return {
        "compiled": (torch.compile(m, backend="gpuremote"), "gpuremote", opt, update),
        "cpu_compiled": (torch.compile(mc, backend="inductor"), "cpu", opt_c, update_c),
    }


def _add(
    side: _Side,
    s0: dict[str, Any],
    s1: dict[str, Any],
    p0: dict[str, Any],
    p1: dict[str, Any],
    in_process: bool,
) -> None:
    """Add one round's counters to ``side``: the client's (``s0``, ``s1``: before and
    after) and the proxy's (``p0``, ``p1``)."""
    side.calls += sum(s1["calls"].values()) - sum(s0["calls"].values())
    side.frames += s1["frames_sent"] - s0["frames_sent"]
    side.round_trips += s1["round_trips"] - s0["round_trips"]
    side.replays += s1["graph_replays"] - s0["graph_replays"]
    side.eager_graphs += s1["graphs_eager"] - s0["graphs_eager"]
    g0, g1 = p0.get("graphs") or {}, p1.get("graphs") or {}
    side.graph_ops += g1.get("ops", 0) - g0.get("ops", 0)
    side.graph_run_s += 1e-9 * (g1.get("run_ns", 0) - g0.get("run_ns", 0))
    side.graph_run_cpu_s += 1e-9 * (g1.get("run_thread_ns", 0) - g0.get("run_thread_ns", 0))
    side.graph_replay_cpu_s += 1e-9 * (
        g1.get("replay_thread_ns", 0) - g0.get("replay_thread_ns", 0)
    )
    side.graphs_compiled = g1.get("compiled", 0)
    c0, c1 = _proxy_cpu(p0, in_process), _proxy_cpu(p1, in_process)
    if c0 is None or c1 is None or side.proxy_cpu_s is None:
        side.proxy_cpu_s = None
    else:
        side.proxy_cpu_s += c1 - c0


def _rows(name: str, describe: str, sides: dict[str, _Side]) -> list[dict[str, Any]]:
    """A workload's rows: eager, and compiled (with its client CPU over eager's) if run."""
    eager = _row(name, describe, sides["cpu"], sides["gpuremote"])
    if "compiled" not in sides:
        return [eager]
    compiled = _row(name, describe, sides["cpu"], sides["compiled"], "compiled")
    compiled["client_cpu_vs_eager"] = (
        compiled["client_cpu_ms"] / eager["client_cpu_ms"] if eager["client_cpu_ms"] else None
    )
    local_c = _p(sides["cpu_compiled"].wall_s, 50) if "cpu_compiled" in sides else None
    compiled["local_compiled_step_ms"] = None if local_c is None else 1e3 * local_c
    remote_c, remote_e = compiled["remote_step_ms"], eager["remote_step_ms"]
    compiled["remote_over_local_compiled"] = (
        remote_c / (1e3 * local_c) if local_c and remote_c is not None else None
    )
    compiled["remote_compiled_over_eager"] = (
        remote_c / remote_e if remote_e and remote_c is not None else None
    )
    return [eager, compiled]


async def run_torch_ops(
    workloads: list[str],
    *,
    size: str,
    steps: int,
    rounds: int,
    url: str | None,
    transport: str,
    backend: str,
    report: Callable[[dict[str, Any]], None] = lambda s: None,
    compile: bool = False,
    graphs: str = "fx",
    proxy_cpus: set[int] | None = None,
) -> dict[str, Any]:
    """Run the bench (see the module docstring); returns the JSON result. ``graphs``: how
    the proxy the bench starts replays compiled graphs (``serve --graphs``; a proxy in this
    process replays them as FX graphs); ``proxy_cpus``: the CPUs of the proxy it starts
    (``--pin``: this process is on its own already)."""
    backend = "numpy" if backend == "auto" else backend
    if transport == "inproc" and url is None:
        base: dict[str, Any] = {
            "bench": "ops",
            "url": "inproc:// (in this process)",
            "transport": "inproc",
        }
        base.update(size=size, backend=backend)
        return await asyncio.to_thread(
            _measure, workloads, size, steps, rounds, None, backend, report, base, compile
        )
    async with open_target(
        url, transport, backend, proxy_cpus=proxy_cpus, proxy_args=("--graphs", graphs)
    ) as target:
        placement = {
            "client_cpus": sorted(os.sched_getaffinity(0)),
            "proxy_cpus": None if proxy_cpus is None else sorted(proxy_cpus),
        }
        base = {"bench": "ops", "url": target.url, "transport": target.transport}
        base.update(size=size, backend=backend, graphs=graphs, placement=placement)
        return await asyncio.to_thread(
            _measure, workloads, size, steps, rounds, target.url, backend, report, base, compile
        )
