"""``gpuremote bench requirements --workloads resnet18,bert,gpt2``: the paper's PyTorch
programs on the paper's grid (``--transport emu+inproc --backend sim:a100``).

Each workload (``gpuremote.torch.models``: ResNet-18, a BERT-style encoder, a GPT-2-style
decoder; AdamW, clipped gradients, a read of the loss each step) runs in each mode:
``optimized`` (eager: every ATen op an ASYNC call in the session's batches), ``compiled`` (the
model and the update after the backward pass under ``torch.compile(backend="gpuremote")``:
each graph replayed by one message) and ``unoptimized`` (every call waits). The program is set up:

- **locally**, by PyTorch alone (``bench.torch_local``): as written (eager), the baseline of
  every mode (``--local pytorch``): on the simulated GPU, PyTorch's own host time (the
  workload's tiny twin on this CPU, measured) beside the device's kernels;
- **in process**: ``gpuremote.tools.direct.connect_torch`` on the device (no proxy, no protocol,
  no wire): as written, the baseline before (``--local inproc``, reported either way); and
  each mode's trace of calls, which the model replays (a compiled program's, of its replays);
- per mode, **behind one emulated link**: over ``emu+inproc``, a proxy in this process,
  batches run inline; over ``emu+tcp``, a proxy in a process of its own
  (``bench.linked_proxy``: on its own CPU, the link emulated on its side). Its round trip and
  bandwidth change from point to point (``EmulatedConnection.set_link``), so that the model
  and the optimizer are set up (and compiled) once.

The device is the simulated GPU timing only (``sim:a100,compute=0``: each op takes its
roofline time on a virtual clock, nothing is computed), so the paper's sizes run on any
machine. In process, the client sends what it queued when it next waits (as the async
workloads' sweep does: its helper does not nudge); over ``emu+tcp`` it sends as its batching
policy says (a compiled graph's replay at once, eager ops in batches), and the model follows
that policy (``Mode.posts``). Per point, its turns alternate a
local run (PyTorch's, then the in-process one), a run over the bare link (no RTT, no limit:
the software's own costs) and the point's run, and the model is given the point's measured
costs, as for the async workloads (``gpuremote.bench.requirements``, whose functions judge
the points). What was set up (two copies of a model of up to 124 M parameters, the compiled
graphs) is frozen out of the garbage collector's way (``gc.freeze``): full collections over
that heap took 0.3-0.6 s of a run at random before, and made eager runs swing by 2x.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, cast

from .linked_proxy import LinkedProxy
from .ops import _pin_process
from .points import (
    Mode,
    _lost_s,
    _Point,
    _Progress,
    _Run,
    judge_workload,
)
from .torch_local import local_baseline
from .torch_ops import _step, _updater

__all__ = [
    "TORCH_MODES",
    "TORCH_WORKLOADS",
    "linked_proxy",
    "torch_modes",
    "torch_workload",
    "torch_workload_linked",
]

#: the PyTorch workloads (``gpuremote.torch.models``)
TORCH_WORKLOADS = ("resnet18", "bert", "gpt2")
_EAGER = {"async_calls": True, "batching": True, "shadow": True}
#: the modes of the PyTorch workloads
TORCH_MODES: dict[str, Mode] = {
    "unoptimized": Mode(
        "unoptimized", {"async_calls": False, "batching": False, "shadow": False}, False
    ),
    "optimized": Mode("optimized", _EAGER, True),
    "compiled": Mode("compiled", _EAGER, True, run=(("compile", True),)),
}
#: the sweep's mode names -> the PyTorch workloads' (a captured step is a compiled graph)
_AS = {"unoptimized": "unoptimized", "optimized": "optimized", "replay": "compiled"}
#: training steps per run, by size
STEPS = {"small": 3, "real": 2}


def torch_modes(names: list[str]) -> list[Mode]:
    """The PyTorch workloads' modes for the sweep's ``--modes``."""
    out = []
    for n in names:
        m = TORCH_MODES[_AS.get(n, n)]
        if m not in out:
            out.append(m)
    return out


@contextlib.contextmanager
def _on(driver: Any) -> Iterator[None]:
    """The ``gpuremote`` device served by ``driver`` meanwhile."""
    from gpuremote.torch._backend import dispatcher

    before = dispatcher.drivers.get(0)
    dispatcher.drivers[0] = driver
    try:
        yield
    finally:
        if before is not None:
            dispatcher.drivers[0] = before


class _Program:
    """One workload in one mode on one session, set up once (the model uploaded, compiled,
    warmed up: its recordings made), then run ``steps`` at a time."""

    def __init__(self, w: Any, cpu_model: Any, compiled: bool, driver: Any) -> None:
        import torch

        self.w, self.driver = w, driver
        with _on(driver):
            model = copy.deepcopy(cpu_model).to("gpuremote")
            self.opt = torch.optim.AdamW(
                model.parameters(), lr=1e-4, weight_decay=0.01, capturable=compiled
            )
            update = _updater(model, self.opt)
            self.model = torch.compile(model, backend="gpuremote") if compiled else model
            self.update = torch.compile(update, backend="gpuremote") if compiled else update
            x, y = w.batch(torch.Generator().manual_seed(1))
            self.x, self.y = x.to("gpuremote"), y.to("gpuremote")
            for _ in range(2):  # the metadata caches, the recordings
                self.step()

    def step(self) -> None:
        _step(self.w, self.model, self.opt, self.x, self.y, self.update)

    def run(self, steps: int, snapshot: Callable[[bool], tuple[float, ...]]) -> _Run:
        """``steps`` steps, measured by ``snapshot(end)``: (clock, client's waits, proxy's
        busy time, device waits in it, emulator's lateness, then each process's time lost to
        other processes, each a lower bound: ``_lost_s``)."""
        with _on(self.driver):
            start = snapshot(False)
            for _ in range(steps):
                self.step()
            end = snapshot(True)
        d = [e - s for e, s in zip(end, start, strict=True)]
        return _Run(d[0], d[1], d[2], d[3], d[4], sum(max(0.0, lost) for lost in d[5:]))


def _local_snapshot(end: bool = False) -> tuple[float, ...]:
    """A local run's ``snapshot`` (what is read besides the clock, outside the run)."""
    if end:
        now = time.perf_counter()
        return (now, 0.0, 0.0, 0.0, 0.0, _lost_s())
    lost = _lost_s()
    return (time.perf_counter(), 0.0, 0.0, 0.0, 0.0, lost)


class _Link:
    """A session over an emulated link to a proxy of its own in this process (the same
    device), instrumented as the async sweep's links are."""

    def __init__(self, backend: str, mode: Mode) -> None:
        from gpuremote.transports.inproc import listener

        from gpuremote.core.driver import SyncDriver

        self.name = f"torch-requirements-{os.getpid()}-{time.monotonic_ns()}"
        self.driver = SyncDriver(
            f"emu+inproc://{self.name}?copy=0",
            serve=backend,
            proxy_options={"inline_us": math.inf, "contention_s": 0.0},
            post_delay_us=1e12,  # sent when the client next waits, however many
            post_delay_max_us=1e12,
            post_batch_calls=0,
            replays_at_once=False,  # (a proxy on this thread would run them only then anyway)
            **mode.connect,
        )
        self.mode = mode  # (for the model: it sends at its waits, as this client does)
        self.conn = cast(Any, self.driver.session).conn  # the pipeline's (not the contract's)
        lst = listener(self.name)
        assert lst is not None and lst.accepted, "no inproc connection to measure"
        self.proxy_end = lst.accepted[-1]
        self.backend = self.driver._proxy.backend

    def set(self, rtt_us: float, bw_gbit: float | None) -> None:
        self.conn.set_link(rtt_us * 1e-6, None if bw_gbit is None else bw_gbit * 1e9)

    def snapshot(self, end: bool = False) -> tuple[float, ...]:
        """See ``_Program.run`` (the client's lost time read outside the run)."""
        if end:
            now = time.perf_counter()
            lost = _lost_s()
        else:
            lost = _lost_s()
            now = time.perf_counter()
        return (
            now,
            self.driver.call_s,  # the client in synchronous calls (sending, waiting)
            self.proxy_end.busy_s,
            self.backend.timing()[1],
            self.conn.late_own_s,
            lost,
        )

    def close(self) -> None:
        self.driver.close()


class _ProcessLink:
    """A session to the proxy process (``bench.linked_proxy``: the link emulated on its side),
    the client sending by its batching policy (``mode.posts``), instrumented as ``_Link``."""

    def __init__(self, proxy: LinkedProxy, mode: Mode) -> None:
        from gpuremote.core.driver import SyncDriver

        self.proxy = proxy
        self.driver = SyncDriver(proxy.url, **mode.connect)
        #: ``mode`` for the model: sending as this session's batching policy does
        self.mode = replace(mode, posts=self.driver.session.config)

    def set(self, rtt_us: float, bw_gbit: float | None) -> None:
        self.proxy.set_link(rtt_us * 1e-6, None if bw_gbit is None else bw_gbit * 1e9)

    def snapshot(self, end: bool = False) -> tuple[float, ...]:
        # what is read here besides the clock is read outside the run (before its start,
        # after its end): the proxy's counters, a round trip over the pipe
        if end:
            now, awaited = time.perf_counter(), self.driver.call_s
            lost, there = _lost_s(), self.proxy.snapshot()
        else:
            there, lost = self.proxy.snapshot(), _lost_s()
            now, awaited = time.perf_counter(), self.driver.call_s
        return (
            now,
            awaited,
            there["busy_s"],
            there["device_waited_s"],
            there["late_own_s"],
            lost,
            there["lost_s"],
        )

    def close(self) -> None:
        self.driver.close()


@contextlib.contextmanager
def linked_proxy(backend: str) -> Iterator[LinkedProxy]:
    """The proxy process of ``--transport emu+tcp`` on ``backend``, on a CPU of its own, and
    every thread of this process on the others where there are two or more (threads made
    meanwhile inherit it; all of them given back the CPUs they had after)."""
    proxy = LinkedProxy(backend)
    before = os.sched_getaffinity(0)
    try:
        if len(before) > 1:
            _pin_process(os.getpid(), before - proxy.cpus)
        yield proxy
    finally:
        _pin_process(os.getpid(), before)
        proxy.close()


def torch_workload(
    cfg: Any,
    backend: str,
    modes: list[Mode],
    wname: str,
    progress: _Progress,
    linked: LinkedProxy | None = None,
) -> dict[str, Any]:
    """One PyTorch workload over the grid in every mode (see the module docstring), as the
    async sweep reports a workload; ``linked``: its remote runs on that proxy process."""
    import torch

    judged: list[Mode] = []  # the modes as the model is to send their calls

    from gpuremote.tools.direct import connect_torch
    from gpuremote.torch.models import workload

    size = "small" if cfg.quick else "real"
    w = workload(wname, size)
    steps = STEPS[size]
    torch.manual_seed(0)
    cpu_model = w.make()
    traces: dict[str, list[Any]] = {}
    measured: dict[str, list[_Point]] = {}
    local_runs: dict[str, list[_Run]] = {"pytorch": [], "inproc": []}
    torch._dynamo.reset()
    with connect_torch(backend) as here:
        direct = here.drivers[0]
        session: Any = direct.session  # a DirectSession: its trace
        # the program as written (eager) through gpuremote's client in process: its trace
        inproc = _Program(w, cpu_model, False, direct)
        _settled()
        eager = _median_trace(inproc, session, steps, cfg.repeats)
        for mode in modes:  # each mode's calls, as the local run makes them
            if dict(mode.run).get("compile", False):
                traces[mode.name] = _median_trace(
                    _Program(w, cpu_model, True, direct), session, steps, cfg.repeats
                )
            else:
                traces[mode.name] = eager
        session.trace = None  # the baseline's runs: not recorded
        # the baseline of every mode: the program as written (eager), run by PyTorch alone
        pytorch = local_baseline(w, size, cpu_model, session.executor.backend, eager, steps)
        _settled()
        for mode in modes:
            link: _Link | _ProcessLink = (
                _Link(backend, mode) if linked is None else _ProcessLink(linked, mode)
            )
            judged.append(link.mode)
            try:
                remote = _Program(w, cpu_model, dict(mode.run).get("compile", False), link.driver)
                _settled()
                measured[mode.name] = []
                for rtt in cfg.rtts_us:
                    for bw in cfg.bws_gbit:
                        runs, bare = [], []
                        turns: dict[str, list[_Run]] = {"pytorch": [], "inproc": []}
                        for _ in range(cfg.repeats):  # local (both), bare, point; again
                            turns["pytorch"].append(pytorch.run(steps))
                            turns["inproc"].append(inproc.run(steps, _local_snapshot))
                            link.set(0.0, None)
                            bare.append(remote.run(steps, link.snapshot))
                            link.set(rtt, bw)
                            runs.append(remote.run(steps, link.snapshot))
                        judging = turns[cfg.local_baseline]
                        measured[mode.name].append(_Point(rtt, bw, runs, bare, judging))
                        for name, got in turns.items():
                            local_runs[name] += got
                        progress.point_done(wname, mode=mode.name)
            finally:
                link.close()
    gc.unfreeze()
    torch._dynamo.reset()
    figures = judge_workload(
        cfg, judged, traces, measured, local_runs[cfg.local_baseline], steps, baselines=local_runs
    )
    return {
        "name": wname,
        "framework": "torch",
        "model": w.describe,
        "sizes": {"size": size, "steps": steps},
        "local_baseline": cfg.local_baseline,
        # PyTorch's own host time in its local runs (on a simulated GPU; else none)
        "pytorch_host_runs_s": pytorch.host_runs_s,
        "local_baselines_describe": {
            "pytorch": pytorch.describe,
            "inproc": "the program through gpuremote's client in process on the same device",
        },
        **figures,
    }


def torch_workload_linked(
    cfg: Any, backend: str, modes: list[Mode], wname: str, progress: _Progress
) -> dict[str, Any]:
    """``torch_workload`` with its remote runs on a proxy process of its own
    (``--transport emu+tcp``), started for it and ended after."""
    with linked_proxy(backend) as proxy:
        return torch_workload(cfg, backend, modes, wname, progress, linked=proxy)


def _settled() -> None:
    """What was set up (the models, their copies, the compiled graphs: a large heap) out of
    the garbage collector's way: a full collection over it took 0.3-0.6 s of a run here, at
    random, which is neither the software's cost nor the link's."""
    gc.collect()
    gc.freeze()


def _median_trace(program: _Program, session: Any, steps: int, repeats: int) -> list[Any]:
    """The calls of the median run of ``repeats`` recorded local runs of ``steps`` steps
    (each run's client time counted from its start: the first one's first call would else
    hold the set-up before it, ~70 ms for GPT-2, which the local baseline spreads as host
    time over the device's idle start)."""
    runs: list[tuple[_Run, list[Any]]] = []
    for _ in range(max(1, repeats)):
        mark = len(session.trace)
        session.restart_clock()
        run = program.run(steps, _local_snapshot)
        runs.append((run, list(session.trace[mark:])))
    del session.trace[:]
    order = sorted(runs, key=lambda r: r[0].wall)
    return order[len(order) // 2][1]
