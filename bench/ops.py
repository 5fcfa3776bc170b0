"""``gpuremote bench ops``: what users actually do, beside the floor.

Each case is timed per operation (wall time) with the CPU it costs on each side: the client's
from ``time.process_time()`` (every thread of this process), the proxy's from the proxy itself
(its ``stats`` call reports its process CPU, so this works against ``--url`` too). The floor is
a bare asyncio ``Protocol`` echo of 16 bytes served from inside the proxy process
(``serve --bench-echo``), measured with the same three figures; rounds interleave the echo and
every case (A B C A B C), so that the machine's drift hits all of them alike.

Cases:

- ``sync_op``: ``b = a + a; await b.get()`` on 16 float32, through the client API;
- ``xp_sync_op``: ``float(xp.sum(x + 1.0))`` through ``gpuremote.xp``;
- ``async_chain`` / ``xp_async_chain``: ``x = x + 1.0`` ``chain`` times, each a new array, then
  one read; per-op figures and ops/s end to end;
- ``transformer_step``: one inference step of a transformer block at batch 1, remote and in
  process (``gpuremote.tools.direct``), and the slowdown between them.

The single ops and the chains also report the Python calls per op (``python_calls_per_op``,
split into ``client_python_calls_per_op`` and ``proxy_python_calls_per_op``: the proxy's
where it runs in this process, ``--transport inproc``), counted by ``cProfile`` after the
rounds: a figure that does not move with the machine's speed.

Steps (each row is per step, beside the same step in process: ``ops_per_step``,
``remote_us``, ``local_us``, ``overhead_us`` = remote - local at p50, ``frames_per_step``,
``client_cpu_us``, ``proxy_cpu_us``):

- ``mlp_step``: the demo's MLP training step (16 ops) and a read of its loss, call by call;
- ``mlp_step_replay``: the same step captured once and replayed by one message
  (``gpu.capture``);
- ``transformer_step_replay``: ``transformer_step``, captured;
- ``chain_replay_16`` / ``chain_replay_160``: a captured step of 16 / 160 element-wise ops on
  16 floats, and one read;
- ``mlp_replay_unread``: the MLP step replayed ``UNREAD`` times, then one read (training
  without a read each step): ``steps_per_s`` beside the same steps in process, and their ratio.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import gpuremote
from gpuremote import _build
from gpuremote.errors import ConfigError
from gpuremote.tools.direct import connect_direct
from gpuremote.tools.stdio import restore_stdout
from gpuremote.tools.workloads import transformer_block

from .baseline import ProtocolEchoClient
from .calls import count_calls, count_calls_async
from .stats import ratio
from .target import Target, TargetOptions, open_target

__all__ = ["ALL_CASES", "CASES", "PINS", "STEP_CASES", "OpsConfig", "run_ops"]

CASES = ("sync_op", "xp_sync_op", "async_chain", "xp_async_chain", "transformer_step")
#: cases timed per step, beside the same step in process
STEP_CASES = (
    "mlp_step",
    "mlp_step_replay",
    "transformer_step_replay",
    "chain_replay_16",
    "chain_replay_160",
)
ALL_CASES = (*CASES, *STEP_CASES, "mlp_replay_unread")
UNREAD = 20  # steps between reads in mlp_replay_unread
#: the cases whose Python calls per op are counted (``gpuremote.bench.calls``; the client's,
#: and the proxy's where it runs in this process), over this many ops each
_COUNTED = ("sync_op", "xp_sync_op", "async_chain", "xp_async_chain")
_COUNTED_RUNS = 200
_ECHO = b"gpuremote-echo16"  # 16 bytes
#: a pause after the paths that leave threads busy for a while: gpuremote.xp's helper polls
#: for 50 ms after the last post, and BLAS worker threads spin for a while after a matmul
#: (the transformer's, in both processes); their CPU is not the next path's
_QUIET_S = 0.2


@dataclass
class OpsConfig(TargetOptions):
    """``bench ops`` (see the module docstring)."""

    iterations: int = 3_000  # per synchronous case (and the echo)
    rounds: int = 5
    chain: int = 10_000  # ops per chain
    steps: int = 20  # transformer steps per round
    warmup: int = 300
    cases: tuple[str, ...] = CASES
    #: PyTorch workloads (``resnet18,bert,gpt2``): run those instead of the cases
    #: (``gpuremote.bench.torch_ops``), ``workload_steps`` steps per round, at ``size``
    workload: str = ""
    size: str = "small"
    workload_steps: int = 5
    compile: bool = False  # the workloads under torch.compile(backend="gpuremote") too
    graphs: str = "fx"  # how the proxy the bench starts replays them (``serve --graphs``)
    #: where the two processes run: "none" (the scheduler decides), "same" (one CPU for
    #: both: a round trip is two context switches) or "split" (a CPU each: a round trip is
    #: two cross-CPU wake-ups). The floor differs by ~3x between the two on a small VM.
    pin: str = "none"


PINS = ("none", "same", "split")
_PIN_ENV = "GPUREMOTE_PIN_CPUS"  # the CPUs the bench could use before it pinned itself


def plan_pin(how: str, cfg: TargetOptions | None = None) -> tuple[int, int] | None:
    """The (client, proxy) CPUs that ``how`` asks for (None for "none"); ``ConfigError`` where
    it cannot be had (no second CPU, or no proxy process of the bench's own)."""
    if how not in PINS:
        raise ConfigError(f"pin must be one of {', '.join(PINS)}, not {how!r}")
    if how == "none":
        return None
    if cfg is not None and (cfg.url or cfg.transport == "inproc"):
        raise ConfigError("--pin needs the proxy the bench starts, over tcp:// (not --url)")
    env = os.environ.get(_PIN_ENV)
    cpus = [int(c) for c in env.split(",")] if env else sorted(os.sched_getaffinity(0))
    if how == "split" and len(cpus) < 2:
        raise ConfigError(f"--pin split needs two CPUs; this process may use {cpus}")
    return cpus[0], cpus[1] if how == "split" else cpus[0]


def reexec_pinned(how: str, cfg: TargetOptions) -> None:
    """Run this command again on the client's CPU alone (for the CLI): threads that size
    themselves at start (BLAS's pool) then see one CPU, as in the proxy it starts."""
    plan = plan_pin(how, cfg)
    if plan is None or os.sched_getaffinity(0) == {plan[0]}:
        return
    os.environ[_PIN_ENV] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    os.sched_setaffinity(0, {plan[0]})
    restore_stdout()  # --json: the new program prints its object on the real stdout
    os.execv(sys.executable, [sys.executable, "-m", "gpuremote", *sys.argv[1:]])


def _pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads made later inherit it)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


@dataclass
class _Figures:
    """Raw figures of one path: wall samples (ns per op), CPU seconds and ops counted."""

    wall_ns: list[float] = field(default_factory=list)
    client_cpu_s: float = 0.0
    proxy_cpu_s: float | None = 0.0
    ops: int = 0
    blocks_s: list[float] = field(default_factory=list)  # chains: seconds per whole chain
    frames: int = 0  # frames the client sent
    ops_per_step: int | None = None  # steps: the calls one makes (counted in process)
    #: Python calls per op (``gpuremote.bench.calls``), counted after the rounds
    calls: dict[str, float] = field(default_factory=dict)

    def summary(self, name: str) -> dict[str, Any]:
        a = np.asarray(self.wall_ns, dtype=np.float64) / 1e3
        p50, p99 = (float(x) for x in np.percentile(a, [50, 99])) if a.size else (None, None)
        out: dict[str, Any] = {
            "name": name,
            "ops": self.ops,
            "wall_p50_us": p50,
            "wall_p99_us": p99,
            "client_cpu_us": 1e6 * self.client_cpu_s / self.ops if self.ops else None,
            "proxy_cpu_us": (
                1e6 * self.proxy_cpu_s / self.ops
                if self.ops and self.proxy_cpu_s is not None
                else None
            ),
        }
        if self.blocks_s:
            out["ops_per_s"] = self.ops / sum(self.blocks_s)
        out.update(self.calls)
        return out


class _ProxyClock:
    """The proxy's process CPU, read through a session's ``stats`` call; ``None`` in process
    (inproc://, where the proxy's CPU is the client's)."""

    def __init__(self, gpu: gpuremote.GPU, in_process: bool) -> None:
        self._gpu = gpu
        self._in_process = in_process

    async def read(self) -> float | None:
        if self._in_process:
            return None
        stats = await self._gpu.proxy_stats()
        cpu = stats.get("process_cpu_s")
        return float(cpu) if isinstance(cpu, int | float) else None


@contextlib.contextmanager
def _xp_device(target: Target, backend: str) -> Iterator[Any]:
    import gpuremote.xp as xp

    # in process (inproc://), a proxy on the device's own loop
    inproc = target.transport == "inproc"
    device = xp.connect_local(backend) if inproc else xp.connect(target.url)
    try:
        yield xp, device
    finally:
        device.close()


async def run_ops(
    cfg: OpsConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    """Run the bench; returns the JSON result."""
    if cfg.workload:
        from .torch_ops import run_torch_ops

        plan = plan_pin(cfg.pin, cfg)
        return await run_torch_ops(
            cfg.workload.split(","),
            proxy_cpus=None if plan is None else {plan[1]},
            size=cfg.size,
            steps=cfg.workload_steps,
            rounds=cfg.rounds,
            compile=cfg.compile,
            graphs=cfg.graphs,
            url=cfg.url,
            transport=cfg.transport,
            backend=cfg.backend,
            report=report,
        )
    unknown = set(cfg.cases) - set(ALL_CASES)
    if unknown:
        raise ValueError(f"unknown case(s) {sorted(unknown)}; known: {', '.join(ALL_CASES)}")
    plan = plan_pin(cfg.pin, cfg)
    affinity = os.sched_getaffinity(0)
    async with (
        open_target(
            cfg.url, cfg.transport, cfg.backend, proxy_cpus=None if plan is None else {plan[1]}
        ) as target,
        gpuremote.connect(target.url) as gpu,
    ):
        placement: dict[str, Any] = {"pin": cfg.pin}
        if plan is not None:
            _pin_process(os.getpid(), {plan[0]})  # a no-op where the CLI pinned it at start
            placement.update(client_cpu=plan[0], proxy_cpu=plan[1])
        ports = gpu.device.get("bench_echo")
        echo: ProtocolEchoClient | None = None
        why_not = None
        if isinstance(ports, dict) and "protocol" in ports:
            echo = await ProtocolEchoClient.connect(int(ports["protocol"]), target.host)
        else:
            why_not = "the proxy serves no echo baseline (start it with `serve --bench-echo`)"
        in_process = target.transport == "inproc"
        clock = _ProxyClock(gpu, in_process)
        with _xp_device(target, cfg.backend) as (xp, device):
            try:
                result = await _measure(cfg, gpu, xp, device, echo, clock, target, why_not, report)
                result["placement"] = placement
                return result
            finally:
                _pin_process(os.getpid(), affinity)
                if echo is not None:
                    echo.close()


async def _measure(
    cfg: OpsConfig,
    gpu: gpuremote.GPU,
    xp: Any,
    device: Any,
    echo: ProtocolEchoClient | None,
    clock: _ProxyClock,
    target: Target,
    why_not: str | None,
    report: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """The rounds: every path (the echo, the cases, their twins in process) in turn, after a
    warm-up; the result, also reported after each round."""
    local = connect_direct(cfg.backend if cfg.backend != "auto" else "numpy", record=False)
    cases = _plain_cases(cfg, gpu, xp, device, echo, local)
    steps = _steps(gpu, local)
    paths = _paths(cfg, cases, steps, _unread(gpu, local))
    figures = {name: _Figures() for name in paths}
    for name in cfg.cases:
        if name in steps:  # the calls one step makes, counted in process
            before = local.stats()["calls"]["async"]
            await steps[name][1]()
            figures[name].ops_per_step = local.stats()["calls"]["async"] - before
    for fn, per, _ in paths.values():  # warm-up, not counted
        await _timed(fn, max(1, cfg.warmup // per) if per == 1 else 1)
    previous_busy = True  # the warm-up ran every path
    for r in range(cfg.rounds):
        for name, (fn, per, reps) in paths.items():
            if previous_busy:  # before the clocks start
                await asyncio.sleep(_QUIET_S)
            previous_busy = name.startswith(("xp_", "transformer_", "mlp_"))
            in_process = name == "transformer_local" or name.endswith(":local")
            await _measure_path(figures[name], fn, per, reps, gpu, None if in_process else clock)
        report(_result(cfg, target, figures, why_not, r + 1))
    for name in cfg.cases:  # the Python calls per op: not timed, counted
        if name in _COUNTED:
            fn, per, _ = paths[name]
            runs = max(1, _COUNTED_RUNS // per)
            if inspect.iscoroutinefunction(fn):
                counted = await count_calls_async(fn, runs)
            else:
                counted = await asyncio.to_thread(count_calls, fn, runs)
            figures[name].calls = {k: v / per for k, v in counted.items()}
    await local.aclose()
    return _result(cfg, target, figures, why_not, cfg.rounds)


async def _measure_path(
    fig: _Figures,
    fn: Callable[[], Any],
    per: int,
    reps: int,
    gpu: gpuremote.GPU,
    clock: _ProxyClock | None,
) -> None:
    """One round of one path: ``reps`` calls of ``fn`` (``per`` ops each) into ``fig``, with
    the frames sent, the client's CPU and the proxy's (``clock``; None: in process, no proxy
    of its own)."""
    p0 = await clock.read() if clock is not None else None
    f0 = gpu.stats()["frames_sent"]
    c0 = time.process_time()
    for dt in await _timed(fn, reps):
        if per == 1:
            fig.wall_ns.append(dt)
        else:
            fig.wall_ns.append(dt / per)
            fig.blocks_s.append(dt / 1e9)
    fig.client_cpu_s += time.process_time() - c0
    fig.frames += gpu.stats()["frames_sent"] - f0
    p1 = await clock.read() if clock is not None else None
    if p0 is None or p1 is None or fig.proxy_cpu_s is None:
        fig.proxy_cpu_s = None
    else:
        fig.proxy_cpu_s += p1 - p0
    fig.ops += per * reps


def _plain_cases(
    cfg: OpsConfig,
    gpu: gpuremote.GPU,
    xp: Any,
    device: Any,
    echo: ProtocolEchoClient | None,
    local: Any,
) -> dict[str, Callable[[], Any]]:
    """The cases that are no step (``CASES``), the echo and ``transformer_local``: name -> one
    call. Plain functions are gpuremote.xp's (synchronous code)."""
    ones = np.ones(16, np.float32)
    a = gpu.asarray(ones)
    x = xp.asarray(ones, device=device)
    remote_step = transformer_block(gpu)
    local_step = transformer_block(local)

    async def echo_op() -> None:
        assert echo is not None
        await echo.request(_ECHO)

    async def sync_op() -> None:
        b = a + a
        await b.get()

    def xp_sync_op() -> None:
        float(xp.sum(x + 1.0))

    async def async_chain() -> None:
        y = a
        for _ in range(cfg.chain):
            y = y + 1.0
        got = await y.get()
        if got[0] != 1.0 + cfg.chain:
            raise gpuremote.GpuRemoteError(f"async_chain computed {got[0]}")

    def xp_async_chain() -> None:
        y = x
        for _ in range(cfg.chain):
            y = y + 1.0
        got = float(y[0])
        if got != 1.0 + cfg.chain:
            raise gpuremote.GpuRemoteError(f"xp_async_chain computed {got}")

    async def transformer_step() -> None:
        await remote_step()

    async def transformer_local() -> None:
        await local_step()

    cases: dict[str, Callable[[], Any]] = {
        "sync_op": sync_op,
        "xp_sync_op": xp_sync_op,
        "async_chain": async_chain,
        "xp_async_chain": xp_async_chain,
        "transformer_step": transformer_step,
        "transformer_local": transformer_local,
    }
    if echo is not None:
        cases["echo"] = echo_op
    return cases


def _paths(
    cfg: OpsConfig,
    cases: dict[str, Callable[[], Any]],
    steps: dict[str, tuple[Any, Any]],
    unread: tuple[Any, Any],
) -> dict[str, tuple[Callable[[], Any], int, int]]:
    """What the rounds time, in order: name -> (one op, ops it counts, repeats per round); the
    echo first (where there is one), then each case of ``cfg.cases`` with its twin in process.
    Plain functions run in a thread of their own, as a script's main thread would."""
    chunk = max(1, cfg.iterations // cfg.rounds)
    paths: dict[str, tuple[Callable[[], Any], int, int]] = {}
    if "echo" in cases:
        paths["echo"] = (cases["echo"], 1, chunk)
    table = {
        "sync_op": (cases["sync_op"], 1, chunk),
        "xp_sync_op": (cases["xp_sync_op"], 1, chunk),
        "async_chain": (cases["async_chain"], cfg.chain, 1),
        "xp_async_chain": (cases["xp_async_chain"], cfg.chain, 1),
        "transformer_step": (cases["transformer_step"], 1, cfg.steps),
    }
    for name, (remote, local_fn) in steps.items():
        reps = chunk if name.startswith("chain") else max(cfg.steps, chunk // 10)
        table[name] = (remote, 1, reps)
        table[f"{name}:local"] = (local_fn, 1, reps)
    remote_unread, local_unread = unread
    table["mlp_replay_unread"] = (remote_unread, UNREAD, max(1, cfg.steps // 4))
    table["mlp_replay_unread:local"] = (local_unread, UNREAD, max(1, cfg.steps // 4))
    for name in cfg.cases:
        paths[name] = table[name]
        if name == "mlp_replay_unread":
            paths[f"{name}:local"] = table[f"{name}:local"]
        if name == "transformer_step":
            paths["transformer_local"] = (cases["transformer_local"], 1, cfg.steps)
        if name in steps:
            paths[f"{name}:local"] = table[f"{name}:local"]
    return paths


async def _timed(fn: Callable[[], Any], reps: int) -> list[int]:
    """Nanoseconds of each of ``reps`` calls of ``fn`` (a coroutine function, or a plain one
    timed in a worker thread, the loop inside it)."""
    clock = time.perf_counter_ns
    if inspect.iscoroutinefunction(fn):
        out = []
        for _ in range(reps):
            t0 = clock()
            await fn()
            out.append(clock() - t0)
        return out

    def run() -> list[int]:
        out = []
        for _ in range(reps):
            t0 = clock()
            fn()
            out.append(clock() - t0)
        return out

    return await asyncio.to_thread(run)


def _result(
    cfg: OpsConfig,
    target: Target,
    figures: dict[str, _Figures],
    why_not: str | None,
    done: int,
) -> dict[str, Any]:
    echo = figures["echo"].summary("echo") if "echo" in figures else None
    echo_cpu = _cpu(echo)
    cases = []
    for name in cfg.cases:
        row = figures[name].summary(name)
        row["ratio_wall_p50"] = ratio(row["wall_p50_us"], echo["wall_p50_us"]) if echo else None
        row["ratio_cpu"] = ratio(_cpu(row), echo_cpu)
        if name == "transformer_step":
            loc = figures["transformer_local"].summary("transformer_local")
            row["local_wall_p50_us"] = loc["wall_p50_us"]
            row["slowdown"] = ratio(row["wall_p50_us"], loc["wall_p50_us"])
        if name == "mlp_replay_unread":
            loc = figures[f"{name}:local"].summary(name)
            row.update(
                steps_per_s=row.get("ops_per_s"),
                local_steps_per_s=loc.get("ops_per_s"),
                of_local=ratio(row.get("ops_per_s"), loc.get("ops_per_s")),
            )
        if name in STEP_CASES:
            loc = figures[f"{name}:local"].summary(name)
            fig = figures[name]
            row.update(
                ops_per_step=fig.ops_per_step,
                remote_us=row["wall_p50_us"],
                local_us=loc["wall_p50_us"],
                overhead_us=(
                    None
                    if row["wall_p50_us"] is None or loc["wall_p50_us"] is None
                    else row["wall_p50_us"] - loc["wall_p50_us"]
                ),
                frames_per_step=fig.frames / fig.ops if fig.ops else None,
                slowdown=ratio(row["wall_p50_us"], loc["wall_p50_us"]),
            )
        cases.append(row)
    return {
        "bench": "ops",
        "transport": target.transport,
        "url": target.url,
        "rounds": done,
        "of_rounds": cfg.rounds,
        "chain": cfg.chain,
        # the hot modules in this process (and the proxies it starts): "compiled" (mypyc) or
        # "pure" Python; cProfile counts no calls inside compiled code
        "build": _build.build(),
        "echo": echo,
        "baseline": "bare asyncio Protocol echo, 16 B, in the proxy's process" if echo else None,
        "baseline_note": why_not,
        "cases": cases,
    }


def _cpu(row: dict[str, Any] | None) -> float | None:
    """Client plus proxy CPU per op (the client's alone where the proxy shares its process)."""
    if row is None or row["client_cpu_us"] is None:
        return None
    return row["client_cpu_us"] + (row["proxy_cpu_us"] or 0.0)


def _mlp(g: Any, capture: bool) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The demo's MLP training step on ``g`` (captured, or call by call) and its arrays."""
    from gpuremote.tools.demo import mlp_data, mlp_step

    data = mlp_data()
    scale = 2.0 / data["y"].size
    arrays = tuple(g.asarray(data[k]) for k in ("x", "y", "w1", "w2"))

    def step(x: Any, y: Any, w1: Any, w2: Any) -> Any:
        return mlp_step(g, x, y, w1, w2, scale, 1e-3)

    return (g.capture(step) if capture else step), arrays


def _steps(gpu: gpuremote.GPU, local: Any) -> dict[str, tuple[Any, Any]]:
    """Step cases: name -> (remote step, the same step in process)."""

    def mlp(g: Any, capture: bool) -> Callable[[], Any]:
        run, arrays = _mlp(g, capture)

        async def one() -> None:
            await run(*arrays).get()

        return one

    def chain(g: Any, k: int, capture: bool) -> Callable[[], Any]:
        a = g.asarray(np.ones(16, np.float32))

        def step(x: Any) -> Any:
            for _ in range(k // 2):  # two ops each
                x = x * 0.5 + 0.5
            return x

        run = g.capture(step) if capture else step

        async def one() -> None:
            got = await run(a).get()
            if got[0] != 1.0:
                raise gpuremote.GpuRemoteError(f"chain step computed {got[0]}")

        return one

    def transformer(g: Any, capture: bool) -> Callable[[], Any]:
        return transformer_block(g, capture=capture)

    return {
        "mlp_step": (mlp(gpu, False), mlp(local, False)),
        "mlp_step_replay": (mlp(gpu, True), mlp(local, False)),
        "transformer_step_replay": (transformer(gpu, True), transformer(local, False)),
        "chain_replay_16": (chain(gpu, 16, True), chain(local, 16, False)),
        "chain_replay_160": (chain(gpu, 160, True), chain(local, 160, False)),
    }


def _unread(gpu: gpuremote.GPU, local: Any) -> tuple[Any, Any]:
    """``UNREAD`` MLP steps and one read: replayed remotely, plain in process."""

    def make(g: Any, capture: bool) -> Callable[[], Any]:
        run, arrays = _mlp(g, capture)

        async def block() -> None:
            for _ in range(UNREAD - 1):
                run(*arrays)
            await run(*arrays).get()

        return block

    return make(gpu, True), make(local, False)
