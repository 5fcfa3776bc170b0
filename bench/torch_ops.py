"""``gpuremote bench ops --workload resnet18,bert,gpt2``: the paper's PyTorch programs, eager,
remote beside local.

Each workload (``gpuremote.torch.models``) trains with AdamW, clipped gradients and a read of
its loss each step, on the local CPU and on the ``gpuremote`` device (a proxy the bench starts,
over tcp:// by default, or ``--url``), in interleaved rounds (local, remote, local, ...) so
that the machine's drift hits both alike. Per step: wall time (p50, p90) on each side and
their ratio; the client's CPU (this process, every thread) and the proxy's (its own process
CPU, from its ``stats``); the ATen calls the step made and the client's CPU per call; frames
sent and round trips. ``--size small`` (default) or ``real`` (the paper's sizes; each model
says what it is). The workload ``ops`` measures single ops instead (``OP_CASES`` on 16
floats): the client's CPU per op, remote beside local, gpuremote's own cost per ATen call.
"""

from __future__ import annotations

import asyncio
import contextlib
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


def _p(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _row(name: str, describe: str, local: _Side, remote: _Side) -> dict[str, Any]:
    lp50, rp50 = _p(local.wall_s, 50), _p(remote.wall_s, 50)
    n = max(remote.steps, 1)
    client_cpu = remote.client_cpu_s / n
    return {
        "name": name,
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
        "aten_calls_per_step": remote.calls / n,
        "client_cpu_per_call_us": 1e6 * client_cpu / (remote.calls / n) if remote.calls else None,
        "frames_per_step": remote.frames / n,
        "round_trips_per_step": remote.round_trips / n,
    }


def _step(w: Any, model: Any, opt: Any, x: Any, y: Any) -> float:
    """One training step, ending in the read of its loss."""
    from torch import nn

    loss = w.loss(model, x, y)
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(loss.item())


@contextlib.contextmanager
def _connected(url: str | None, backend: str) -> Iterator[Any]:
    import gpuremote.torch as gt

    conn = gt.connect(url) if url else gt.connect_local(backend)
    try:
        yield conn
    finally:
        conn.close()


def _proxy_cpu(conn: Any, in_process: bool) -> float | None:
    """The proxy's process CPU (None in process: it is this process's)."""
    if in_process:
        return None
    from gpuremote.wire.calls import CALLS_BY_NAME

    stats, _ = conn.drivers[0].call(CALLS_BY_NAME["stats"], [])
    cpu = stats.get("process_cpu_s")
    return float(cpu) if isinstance(cpu, int | float) else None


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
    conn: Any, rounds: int, report: Callable[[dict[str, Any]], None], base: dict[str, Any]
) -> list[dict[str, Any]]:
    """Client CPU per op for ``OP_CASES`` on 16-float tensors (medians of ``rounds`` rounds
    of 2,000), remote beside local (the same op on the CPU)."""
    import torch

    rows = []
    for code, op in OP_CASES.items():
        per_dev = {}
        for dev in ("cpu", "gpuremote"):
            a, w = torch.ones(16, device=dev), torch.ones(4, 4, device=dev)

            def fn(op: Callable[[Any, Any], Any] = op, a: Any = a, w: Any = w) -> Any:
                return op(a, w)

            for _ in range(300):
                fn()
            samples = []
            for _ in range(rounds):
                c0 = time.process_time()
                for _ in range(2000):
                    fn()
                samples.append((time.process_time() - c0) / 2000)
                if dev == "gpuremote":
                    conn.synchronize()
            per_dev[dev] = float(np.median(samples))
        rows.append(
            {
                "op": code,
                "local_cpu_us": 1e6 * per_dev["cpu"],
                "client_cpu_us": 1e6 * per_dev["gpuremote"],
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
) -> dict[str, Any]:
    """The rounds (in a thread of its own: the device is driven from synchronous code)."""
    import torch

    from gpuremote.torch.models import workload

    rows: list[dict[str, Any]] = []
    in_process = url is None
    with _connected(url, backend) as conn:
        ops = _op_cases(conn, rounds, report, base) if "ops" in names else None
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
            for dev in models:  # warm-up: the metadata cache, the allocator, lazy imports
                _step(w, models[dev], opts[dev], *data[dev])
            sides = {"cpu": _Side(), "gpuremote": _Side()}
            for _ in range(rounds):
                for dev in ("cpu", "gpuremote"):
                    side = sides[dev]
                    remote = dev == "gpuremote"
                    p0 = _proxy_cpu(conn, in_process) if remote else None
                    s0 = conn.stats() if remote else None  # (the stats calls: outside)
                    c0 = time.process_time()
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        _step(w, models[dev], opts[dev], *data[dev])
                        side.wall_s.append(time.perf_counter() - t0)
                    side.client_cpu_s += time.process_time() - c0
                    side.steps += steps
                    if remote and s0 is not None:
                        s1 = conn.stats()
                        p1 = _proxy_cpu(conn, in_process)
                        side.calls += sum(s1["calls"].values()) - sum(s0["calls"].values())
                        side.frames += s1["frames_sent"] - s0["frames_sent"]
                        side.round_trips += s1["round_trips"] - s0["round_trips"]
                        if p0 is None or p1 is None or side.proxy_cpu_s is None:
                            side.proxy_cpu_s = None
                        else:
                            side.proxy_cpu_s += p1 - p0
                row = _row(name, w.describe, sides["cpu"], sides["gpuremote"])
                report({**base, "workloads": [*rows, row]})
            rows.append(row)
            del models, opts, data
    return {**base, "workloads": rows}


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
) -> dict[str, Any]:
    """Run the bench (see the module docstring); returns the JSON result."""
    backend = "numpy" if backend == "auto" else backend
    if transport == "inproc" and url is None:
        base = {"bench": "ops", "url": "inproc:// (in this process)", "transport": "inproc"}
        base.update(size=size, backend=backend)
        return await asyncio.to_thread(
            _measure, workloads, size, steps, rounds, None, backend, report, base
        )
    async with open_target(url, transport, backend) as target:
        base = {"bench": "ops", "url": target.url, "transport": target.transport}
        base.update(size=size, backend=backend)
        return await asyncio.to_thread(
            _measure, workloads, size, steps, rounds, target.url, backend, report, base
        )
