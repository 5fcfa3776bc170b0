"""``gpuremote bench failover``: a session that loses its proxy, on a local pool of two.

On a Ray pool of two proxies (NumPy backend; a local Ray instance unless ``--address``):

- **overhead**: the demo's MLP (``gpuremote.tools.demo``), ``timed_steps`` steps per run, runs
  with ``failover=True`` and without, interleaved A B B A (``rounds`` each): steps/s of each, their
  medians, and ``overhead_pct`` (how much slower with failover: the median over the rounds of
  one run's steps/s over its neighbour's), at the checkpoint interval
  given (the default's unless ``--checkpoint-interval``); the bytes checkpoints copied per
  second.
- **failover**: ``steps`` steps with ``failover=True``, the session's proxy killed
  (``ray.kill``; Ray restarts it) before each step of ``kills``: the run must finish with the
  weights of an uninterrupted run, bitwise (``equal``); each move's pause (from the kill to
  the session going on), broken down into detection, reconnect, restore and re-issue.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = ["FailoverBenchConfig", "run_failover"]


@dataclass
class FailoverBenchConfig:
    """``bench failover`` (see the module docstring)."""

    address: str | None = None  # a Ray cluster's; None: a local instance started here
    steps: int = 400
    kills: tuple[int, ...] = (200, 300)
    timed_steps: int = 2000
    rounds: int = 9
    checkpoint_interval_s: float | None = None  # None: the default


_cpu: list[float] = []  # the client's CPU seconds per step of each run, in order


async def _train(
    url: str,
    data: dict[str, np.ndarray[Any, Any]],
    steps: int,
    options: dict[str, Any],
    before_step: Callable[[int, Any], None] | None = None,
) -> tuple[list[float], list[np.ndarray[Any, Any]], float, dict[str, Any], list[dict[str, Any]]]:
    """The demo's MLP for ``steps`` steps (one read of the loss each): losses, weights, the
    steps' seconds, the session's counters and its moves."""
    import gpuremote
    from gpuremote.tools.demo import mlp_step

    async with gpuremote.connect(url, **options) as gpu:
        x, y = gpu.asarray(data["x"]), gpu.asarray(data["y"])
        w1, w2 = gpu.asarray(data["w1"]), gpu.asarray(data["w2"])
        scale = 2.0 / data["y"].size
        await gpu.synchronize()
        losses = []
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(steps):
            if before_step is not None:
                before_step(i, gpu)
            losses.append(float(await mlp_step(gpu, x, y, w1, w2, scale, 0.1).get()))
        seconds = time.perf_counter() - t0
        _cpu.append((time.process_time() - c0) / steps)
        weights = [await w1.get(), await w2.get()]
        moves = list(getattr(gpu.session, "moves", []))
        return losses, weights, seconds, gpu.stats(), moves


async def run_failover(
    cfg: FailoverBenchConfig, report: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Run the bench (see the module docstring); returns its figures."""
    import ray

    import gpuremote.pool as gr
    from gpuremote.tools.demo import mlp_data

    started_ray = False
    if not ray.is_initialized():
        if cfg.address:
            gr.attach(cfg.address)
        else:
            gr.start_local()
            started_ray = True
    name = f"bench-failover-{time.monotonic_ns():x}"
    pool = gr.start_pool(2, name=name, num_gpus=0, backend="numpy")
    on: dict[str, Any] = {"failover": True}
    if cfg.checkpoint_interval_s is not None:
        on["checkpoint_interval_s"] = cfg.checkpoint_interval_s
    training = _Training(pool.url, mlp_data(), on)
    try:
        overhead = await _overhead(cfg, training, report)
        failovers = await _failovers(cfg, pool, training, report)
        return _result(cfg, on, overhead, failovers)
    finally:
        pool.stop()
        if started_ray:
            ray.shutdown()


@dataclass(frozen=True)
class _Training:
    """What every run of the bench trains: the demo's MLP on ``data`` over the pool at
    ``url``, with failover (the session options ``failover``) or without."""

    url: str
    data: dict[str, np.ndarray[Any, Any]]
    failover: dict[str, Any]

    async def run(
        self, steps: int, failover: bool, before_step: Callable[[int, Any], None] | None = None
    ) -> tuple[list[float], list[np.ndarray[Any, Any]], float, dict[str, Any], list[Any]]:
        """``_train`` for ``steps`` steps, with failover or without."""
        options = self.failover if failover else {}
        return await _train(self.url, self.data, steps, options, before_step)


class _Overhead(NamedTuple):
    """The runs without failover and with it (``"off"``, ``"on"``): each run's steps/s and
    client CPU seconds per step; the runs with it: checkpoint bytes and checkpoints per s."""

    rates: dict[str, list[float]]
    cpu: dict[str, list[float]]
    checkpoint_rates: list[float]
    checkpoint_counts: list[float]


async def _overhead(
    cfg: FailoverBenchConfig, training: _Training, report: Callable[[dict[str, Any]], None]
) -> _Overhead:
    """The overhead: interleaved runs with and without failover, no proxy lost."""
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    ckpt_rates, ckpt_counts = [], []
    for r in range(cfg.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):  # A B B A: drift cancels
            report({"phase": "overhead", "round": r + 1, "mode": mode})
            *_, seconds, stats, _ = await training.run(cfg.timed_steps, mode == "on")
            rates[mode].append(cfg.timed_steps / seconds)
            cpu[mode].append(_cpu[-1])
            if mode == "on":
                ckpt_rates.append(stats["checkpoint_bytes"] / seconds)
                ckpt_counts.append(stats["checkpoints"] / seconds)
    return _Overhead(rates, cpu, ckpt_rates, ckpt_counts)


class _Failovers(NamedTuple):
    """The run whose proxy was killed: whether it ended as the uninterrupted one did, each
    move broken down, and its session's counters."""

    equal: bool
    moves: list[dict[str, Any]]
    stats: dict[str, Any]


async def _failovers(
    cfg: FailoverBenchConfig,
    pool: Any,
    training: _Training,
    report: Callable[[dict[str, Any]], None],
) -> _Failovers:
    """The failovers: the reference first (uninterrupted), then the run with kills."""
    import ray

    report({"phase": "reference"})
    ref_losses, ref_weights, *_ = await training.run(cfg.steps, failover=False)
    kills: list[tuple[float, str]] = []

    def kill(i: int, gpu: Any) -> None:
        if i not in cfg.kills:
            return
        rows = pool.status()
        index = next(r["index"] for r in rows if r["url"] == gpu.url)
        report({"phase": "failover", "step": i, "killed": gpu.url})
        t = time.perf_counter()
        ray.kill(pool.actors[index], no_restart=False)
        kills.append((t, gpu.url))

    report({"phase": "failover"})
    losses, weights, _, stats, moves = await training.run(
        cfg.steps, failover=True, before_step=kill
    )
    equal = losses == ref_losses and all(
        np.array_equal(a, b) for a, b in zip(weights, ref_weights, strict=True)
    )
    return _Failovers(equal, [_breakdown(move, kills) for move in moves], stats)


def _breakdown(move: dict[str, Any], kills: list[tuple[float, str]]) -> dict[str, Any]:
    """One move's pause, from the kill of its proxy to the session going on, in its parts."""
    killed = max((t for t, u in kills if u == move["from"]), default=move["detected"])
    detection = max(0.0, move["detected"] - killed)
    return {
        "from": move["from"],
        "to": move["to"],
        "from_standby": move["standby"],
        "pause_s": detection + move["pause_s"],
        "detection_s": detection,
        "reconnect_s": move["reconnect_s"],
        "restore_s": move["restore_s"],
        "replay_s": move["replay_s"],
        "replayed_calls": move["replayed_calls"],
        "restored_bytes_from_client": move["restored_bytes"],
        "cause": move["cause"],
    }


def _result(
    cfg: FailoverBenchConfig, on: dict[str, Any], overhead: _Overhead, failovers: _Failovers
) -> dict[str, Any]:
    """The bench's figures, from its two phases."""
    from gpuremote.session.failover import FailoverConfig

    rates, cpu, stats = overhead.rates, overhead.cpu, failovers.stats
    off, on_rate = statistics.median(rates["off"]), statistics.median(rates["on"])
    # each round's two runs ran side by side (A B B A): their ratio cancels the drift
    paired = statistics.median(b / a for a, b in zip(rates["off"], rates["on"], strict=True))
    return {
        "steps": cfg.steps,
        "kills_at": list(cfg.kills),
        "failovers": stats["failovers"],
        "pause_s": [b["pause_s"] for b in failovers.moves],
        "equal": failovers.equal,
        "overhead_pct": 100.0 * (1.0 - paired),
        "moves": failovers.moves,
        "steps_per_s": {
            "off": off,
            "on": on_rate,
            "runs_off": rates["off"],
            "runs_on": rates["on"],
            "timed_steps": cfg.timed_steps,
            "overhead_pct_of_medians": 100.0 * (1.0 - on_rate / off),
            "client_cpu_us_per_step": {m: 1e6 * statistics.median(v) for m, v in cpu.items()},
        },
        "checkpoint": {
            "interval_s": on.get("checkpoint_interval_s", FailoverConfig().checkpoint_interval_s),
            "bytes_per_s": statistics.median(overhead.checkpoint_rates),
            "checkpoints_per_s": statistics.median(overhead.checkpoint_counts),
            "failover_run_checkpoints": stats["checkpoints"],
            "failover_run_bytes": stats["checkpoint_bytes"],
            "failover_run_bytes_to_client": stats["checkpoint_bytes_to_client"],
        },
        "pool": {"proxies": 2, "backend": "numpy", "transport": "tcp"},
    }
