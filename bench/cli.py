"""``gpuremote bench <command>``: the bench subcommands, as one table (``COMMANDS``), and the one
path that runs any of them (``run_command``).

The subcommands:

- ``ping``: round-trip latency through the whole gpuremote path (``--csv``: the raw samples);
- ``throughput``: host-to-device and device-to-host bandwidth over a sweep of sizes (``--csv``:
  the raw samples; ``--compare T1,T2``: the sweep over each transport, side by side);
- ``load``: many concurrent clients, each verifying its result;
- ``fuzz``: a long hostile-input run against a live proxy;
- ``requirements``: the latency and bandwidth each workload needs (and a plot of it);
- ``emu``: the accuracy of the emulated link (``emu+`` URLs);
- ``ops``: what users do (an op and a read, chains, a model step), beside the floor;
- ``tenants``: a light client's latency beside a heavy one;
- ``flood``: connections that never complete the handshake;
- ``peer``: ``x.to_device(other)``, proxy to proxy against through the client;
- ``failover``: a session losing its proxy, on a local pool of two;
- ``api``: calls per second, synchronous against pipelined.

Each entry of the table gives the subcommand's options and how it runs (``BenchRun``): how its
configuration is made from the parsed arguments, what runs it, its live view, and what it
prints; the views and the summaries are in ``render``. Every bench prints the same way: a live
rich view on a terminal, its summary at the end (a plain one when stdout is not a terminal),
or one JSON object and nothing else with ``--json``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import importlib
import json
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console, RenderableType
from rich.live import Live

from . import render

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["COMMANDS", "BenchCommand", "BenchRun", "add_bench_parser", "run_command"]

Report = Callable[[dict[str, Any]], None]
View = Callable[[dict[str, Any]], RenderableType]
Option = tuple[tuple[str, ...], dict[str, Any]]


def _option(*flags: str, **settings: Any) -> Option:
    """One option of a subcommand: the arguments of its ``add_argument`` call."""
    return flags, settings


def _result_itself(args: argparse.Namespace, outcome: Any) -> dict[str, Any]:
    """What most benches' ``run`` returns is their result."""
    return outcome


def _success(result: dict[str, Any]) -> int:
    """Most benches' exit code: 0 once they have run."""
    return 0


@dataclass(frozen=True)
class BenchRun:
    """How a bench runs: ``config`` makes its configuration from the parsed arguments, ``run``
    runs it (a coroutine function of that configuration and of a callback that reports its
    progress, between timed sections), ``view`` shows that progress live on a terminal, and
    ``summary`` prints its result without ``--json``. ``outputs`` turns what ``run`` returned
    into the result (the JSON object), writing what the bench writes beside it (``--csv``, a
    plot); ``exit_code`` is the command's, from the result."""

    config: Callable[[argparse.Namespace], Any]
    run: Callable[[Any, Report], Coroutine[Any, Any, Any]]
    view: View
    summary: Callable[[Console, dict[str, Any]], None]
    outputs: Callable[[argparse.Namespace, Any], dict[str, Any]] = _result_itself
    exit_code: Callable[[dict[str, Any]], int] = _success


@dataclass(frozen=True)
class BenchCommand:
    """A ``gpuremote bench`` subcommand: its name, its help, its options (in ``--help``'s
    order), the defaults it sets beyond its options' own, and how it runs; ``instead``: (an
    option, how the bench runs when that option is given)."""

    name: str
    help: str
    options: tuple[Option, ...]
    runs: BenchRun
    defaults: dict[str, Any] = field(default_factory=dict)
    instead: tuple[str, BenchRun] | None = None

    def run_for(self, args: argparse.Namespace) -> BenchRun:
        """How the bench runs with ``args``."""
        if self.instead is not None and getattr(args, self.instead[0]):
            return self.instead[1]
        return self.runs


def run_command(command: BenchCommand, args: argparse.Namespace) -> int:
    """Run a bench subcommand: its configuration from ``args``, the bench (with its live view
    on a terminal), then its result as one JSON object (``--json``) or its summary."""
    runs = command.run_for(args)
    config = runs.config(args)
    outcome = _run_live(args, runs.view, lambda report: runs.run(config, report))
    result = runs.outputs(args, outcome)
    from gpuremote import _build

    if isinstance(result, dict):  # which build of the hot path ran the client (and its proxy)
        result.setdefault("build", _build.build())
    if args.json:
        _print_json(result)
    else:
        console = Console()
        runs.summary(console, result)
        console.print(f"gpuremote's hot path: {_build.build()}", style="dim")
    return runs.exit_code(result)


def _run_live(
    args: argparse.Namespace,
    view: View,
    make: Callable[[Report], Coroutine[Any, Any, Any]],
) -> Any:
    """Run the bench coroutine with a live view when stdout is a terminal (and not --json)."""
    from gpuremote import aio

    console = Console()
    live_ok = console.is_terminal and not args.json
    if not live_ok:
        return aio.run(make(lambda state: None))
    with Live(console=console, auto_refresh=False, transient=False) as live:

        def report(state: dict[str, Any]) -> None:
            live.update(view(state), refresh=True)  # between timed sections, never inside

        return aio.run(make(report))


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, allow_nan=False, default=_jsonable) + "\n")


def _jsonable(x: Any) -> Any:
    import numpy as np

    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x).__name__)


def add_bench_parser(sub: Any) -> None:
    """``gpuremote bench`` and its subcommands (``COMMANDS``), on the ``gpuremote`` parser's
    subparsers ``sub``."""
    bench = sub.add_parser("bench", help="benchmarks, with bare baselines in the same run")
    benches = bench.add_subparsers(dest="bench", required=True)
    for command in COMMANDS:
        p = benches.add_parser(command.name, help=command.help)
        for flags, settings in command.options:
            p.add_argument(*flags, **settings)
        p.set_defaults(**command.defaults, func=functools.partial(run_command, command))


# -- how each bench's configuration is made, and what runs it ----------------------------------

_Config = TypeVar("_Config", bound="DataclassInstance")


def _from_args(cls: type[_Config], args: argparse.Namespace, **parsed: Any) -> _Config:
    """``cls`` (a bench's configuration) with each field that has an option of its name taken
    from ``args``, but those given in ``parsed`` (the options that need more than a copy)."""
    copied = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name in args}
    return cls(**{**copied, **parsed})


def _imported(module: str, name: str) -> Any:
    """``gpuremote.bench.<module>.<name>``. The table names every bench's code, imported only
    when that bench runs: building the parser imports none of it."""
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def _bench(module: str, name: str) -> Callable[..., Any]:
    """The function ``gpuremote.bench.<module>.<name>``, imported when called."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return _imported(module, name)(*args, **kwargs)

    return call


def _config_of(
    module: str, cls: str, **parse: Callable[[argparse.Namespace], Any]
) -> Callable[[argparse.Namespace], Any]:
    """The configuration ``gpuremote.bench.<module>.<cls>`` from the parsed arguments: each
    field from the option of its name (``_from_args``), but those in ``parse`` (field: how to
    make it from the arguments)."""

    def config(args: argparse.Namespace) -> Any:
        parsed = {name: make(args) for name, make in parse.items()}
        return _from_args(_imported(module, cls), args, **parsed)

    return config


def _throughput_config(args: argparse.Namespace) -> Any:
    """``bench throughput``'s configuration (``--sizes``, else the default sweep)."""
    from .throughput import DEFAULT_SIZES, ThroughputConfig

    return _from_args(ThroughputConfig, args, sizes=args.sizes or list(DEFAULT_SIZES))


def _compare_config(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """``throughput --compare T1,T2``: the sweep's configuration, and the transports."""
    return _throughput_config(args), [t.strip() for t in args.compare.split(",") if t.strip()]


async def _run_compare(config: tuple[Any, list[str]], report: Report) -> dict[str, Any]:
    """``throughput --compare``: the sweep over each transport."""
    from .throughput import run_compare

    cfg, transports = config
    return await run_compare(cfg, transports, report)


def _ops_config(args: argparse.Namespace) -> Any:
    """``bench ops``'s configuration; with ``--pin``, the command restarts here, pinned (before
    anything is printed)."""
    from .ops import ALL_CASES, OpsConfig, reexec_pinned

    cases = tuple(args.cases.split(",")) if args.cases else ALL_CASES
    cfg = _from_args(OpsConfig, args, cases=cases)
    reexec_pinned(cfg.pin, cfg)  # returns at once unless the command must restart pinned
    return cfg


def _floats(text: str | None, default: list[float]) -> list[float]:
    return default if not text else [float(x) for x in text.split(",")]


def _requirements_config(args: argparse.Namespace) -> Any:
    """``bench requirements``: over ``emu+inproc``, the paper's grid on a simulated A100 (with
    the numpy default) in the modes asked for; else a smaller grid over a real transport."""
    from .requirements import MODE_ALIASES, MODES, PAPER_BWS_GBIT, PAPER_RTTS_US, RequirementsConfig

    quick = args.quick
    common = {
        "url": args.url,
        "transport": args.transport,
        "workloads": args.workloads.split(","),
        "tolerance": args.tolerance,
        "quick": quick,
    }
    if args.transport not in ("emu+inproc", "emu+tcp"):
        return RequirementsConfig(
            **common,
            backend=args.backend,
            rtts_us=_floats(args.rtts, [10, 1000] if quick else [10, 100, 1000]),
            bws_gbit=_floats(args.bws, [10] if quick else [1, 10, 100]),
            repeats=1 if quick else args.repeats or 3,
        )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES and m not in MODE_ALIASES]
    if bad:
        known = ", ".join([*MODES, *MODE_ALIASES])
        raise SystemExit(f"unknown mode(s) {bad}; choose from {known}")
    return RequirementsConfig(
        **common,
        backend="sim:a100" if args.backend == "numpy" else args.backend,
        rtts_us=_floats(args.rtts, [2, 20, 100] if quick else PAPER_RTTS_US),
        bws_gbit=_floats(args.bws, [10, 200] if quick else PAPER_BWS_GBIT),
        repeats=args.repeats or (3 if quick else 5),
        modes=modes,
        local_baseline=args.local_baseline,
    )


# -- what a bench writes beside its result, and its exit code ----------------------------------


def _ping_outputs(args: argparse.Namespace, outcome: Any) -> dict[str, Any]:
    """``bench ping``'s result; with ``--csv``, its raw samples written there."""
    result, samples = outcome
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["path", "size", "iteration", "ns"])
            for path, arr in samples.items():
                for i, ns in enumerate(arr.tolist()):
                    w.writerow([path, args.size, i, ns])
    return result


def _throughput_outputs(args: argparse.Namespace, outcome: Any) -> dict[str, Any]:
    """``bench throughput``'s result; with ``--csv``, its raw samples written there."""
    result, raw = outcome
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, ["path", "size", "direction", "iteration", "ns"])
            w.writeheader()
            w.writerows(raw)
    return result


def _requirements_outputs(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """``bench requirements``'s result, with where its plot went (None: no plot)."""
    from .requirements import plot

    result["plot"] = args.plot if args.plot and plot(result, args.plot) else None
    return result


def _exit_code(key: str, ok: Callable[[Any], bool]) -> Callable[[dict[str, Any]], int]:
    """0 where ``ok(result[key])``, else 1."""
    return lambda result: 0 if ok(result[key]) else 1


# -- the options ----------------------------------------------------------------------------

_JSON = _option("--json", action="store_true", help="print one JSON object and nothing else")
#: where the bench's proxy is, --json, and the baselines: the options most benches share
_COMMON = (
    _option(
        "--url",
        default=None,
        help="talk to a running proxy (default: GPUREMOTE_URL, the config file, "
        "else start a local proxy)",
    ),
    _option(
        "--transport",
        default="tcp",
        help="transport of the local proxy the bench starts (tcp, inproc, ucx)",
    ),
    _option("--backend", default="auto", help="backend of the local proxy"),
    _JSON,
    _option("--no-baseline", dest="baseline", action="store_false", help="skip the bare baselines"),
    _option(
        "--baseline",
        dest="baseline",
        action="store_true",
        default=True,
        help="run the bare baselines in the same run (default)",
    ),
)
_CSV = _option("--csv", default=None, metavar="FILE", help="write the raw samples here")
_NUMPY = {"backend": "numpy"}  # the benches whose local proxy computes on the host by default


def _sizes(text: str) -> list[int]:
    """``--sizes``: a comma-separated list of byte counts (``4k,1m,64m``)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    out = []
    for part in text.split(","):
        p = part.strip().lower().rstrip("ib").rstrip("b") if part.strip() else ""
        if not p:
            continue
        mult = units.get(p[-1], 1)
        num = p[:-1] if p[-1] in units else p
        out.append(int(float(num) * mult))
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"bad size list {text!r} (e.g. 4k,1m,64m)")
    return out


_PING_OPTIONS = (
    *_COMMON,
    _option("--size", type=int, default=8, help="message size in bytes (default 8)"),
    _option("--count", type=int, default=20_000, help="round trips per path"),
    _option("--duration", type=float, default=None, help="seconds instead of --count"),
    _option("--warmup", type=int, default=1_000, help="uncounted round trips per path"),
    _CSV,
    _option(
        "--spin-us",
        type=float,
        default=0.0,
        help="spin-wait this long for each reply, in gpuremote and the asyncio echo (default 0)",
    ),
)
_THROUGHPUT_OPTIONS = (
    *_COMMON,
    _option(
        "--sizes",
        type=_sizes,
        default=None,
        help="comma-separated sizes (default 4k..256m, powers of 4)",
    ),
    _option("--min-reps", type=int, default=5),
    _option("--max-reps", type=int, default=200),
    _CSV,
    _option(
        "--compare",
        default=None,
        metavar="T1,T2",
        help="run the sweep over each transport (e.g. tcp,ucx) and put them side by side",
    ),
)
_LOAD_OPTIONS = (
    *_COMMON,
    _option("--clients", type=int, default=8),
    _option("--ops", type=int, default=1000, help="calls per client"),
    _option(
        "--sync-every", type=int, default=100, help="a verifying read-back every this many calls"
    ),
    _option("--procs", type=int, default=1, help="processes the clients are spread over"),
    _option(
        "--light-period-ms",
        type=float,
        default=10.0,
        help="a light client's synchronous op every this often, beside the others (0: none)",
    ),
)
_FUZZ_OPTIONS = (
    *_COMMON,
    _option("--seconds", type=float, default=30.0),
    _option("--seed", type=int, default=0),
    _option(
        "--connections",
        type=int,
        default=0,
        help="stop after this many hostile connections (0: run --seconds)",
    ),
)
_REQUIREMENTS_OPTIONS = (
    *_COMMON,
    _option(
        "--workloads",
        "--workload",
        default="mlp,transformer,upload",
        help="comma-separated: mlp, transformer, upload (the async API's), resnet18, bert, "
        "gpt2 (PyTorch: the paper's sizes over emu+inproc, the small ones with --quick; "
        "modes optimized (eager), compiled, unoptimized; needs the [torch] extra; "
        "--transport emu+tcp runs them with the proxy in a process of its own behind the "
        "emulated link, sending as the client's batching policy says)",
    ),
    _option(
        "--rtts",
        default=None,
        help="emulated RTTs in µs (default 10,100,1000; over emu+inproc the paper's "
        "1,2,5,10,20,40,100)",
    ),
    _option(
        "--bws",
        default=None,
        help="bandwidths in Gbit/s (default 1,10,100; over emu+inproc 10,25,100,200)",
    ),
    _option(
        "--modes",
        default="unoptimized,optimized,replay",
        help="over emu+inproc: unoptimized, optimized, replay (each step captured once and "
        "replayed by one message; for the PyTorch workloads: compiled, each graph so)",
    ),
    _option(
        "--local",
        dest="local_baseline",
        choices=("pytorch", "inproc"),
        default="pytorch",
        help="what the PyTorch workloads' slowdowns are against: pytorch (the program run by "
        "PyTorch alone on a local device: on sim:, its host time measured beside the "
        "simulated kernels) or inproc (through gpuremote's client in process); both reported",
    ),
    _option("--tolerance", type=float, default=0.05),
    _option(
        "--repeats",
        type=int,
        default=None,
        help="turns per point (default 3; over emu+inproc 5, of which the least disturbed "
        "is reported; 3 with --quick)",
    ),
    _option("--quick", action="store_true", help="a reduced grid and smaller workloads"),
    _option(
        "--plot",
        default="requirements.png",
        metavar="PNG",
        help="where to write the plot (needs matplotlib: the [plot] extra)",
    ),
)
_EMU_OPTIONS = (
    *_COMMON,
    _option("--rtts", default="100us,300us,1ms,3ms,10ms"),
    _option("--bws", default="100mbit,1gbit,10gbit"),
    _option("--pings", type=int, default=100),
)
_OPS_OPTIONS = (
    *_COMMON,
    _option("--iterations", type=int, default=3_000, help="per synchronous case"),
    _option("--rounds", type=int, default=5, help="interleaved rounds (A B A B)"),
    _option("--chain", type=int, default=10_000, help="ops per asynchronous chain"),
    _option("--steps", type=int, default=20, help="transformer steps per round"),
    _option("--warmup", type=int, default=300, help="uncounted iterations per case"),
    _option("--cases", default=None, help="comma-separated subset (default: every case)"),
    _option(
        "--workload",
        default="",
        help="PyTorch workloads instead of the cases: resnet18, bert, gpt2 (comma-separated); "
        "each trained eager, remote beside local (needs the [torch] extra)",
    ),
    _option(
        "--size",
        choices=("small", "real"),
        default="small",
        help="the workloads' sizes: small configurations, or the paper's (ResNet-18 on "
        "224x224, BERT-base, GPT-2-small shapes)",
    ),
    _option("--workload-steps", type=int, default=5, help="training steps per round"),
    _option(
        "--compile",
        action="store_true",
        help="each workload also under torch.compile(backend='gpuremote'), beside eager and "
        "beside local torch.compile (inductor)",
    ),
    _option(
        "--graphs",
        choices=("fx", "inductor", "cudagraphs", "ops"),
        default="fx",
        help="how the proxy the bench starts replays compiled graphs (serve --graphs): one FX "
        "graph each (default), compiled by its inductor, or op by op",
    ),
    _option(
        "--pin",
        choices=("none", "same", "split"),
        default="none",
        help="CPU placement of the bench and the proxy it starts: one CPU for both, one each, "
        "or the scheduler's choice (default); the floor depends on it",
    ),
)
_TENANTS_OPTIONS = (
    *_COMMON,
    _option("--seconds", type=float, default=3.0, help="per phase"),
    _option("--period-ms", type=float, default=10.0, help="between the light ops"),
    _option("--n", type=int, default=1500, help="the heavy client's matrix size"),
    _option("--matmuls", type=int, default=4, help="chained matmuls per heavy loop"),
)
_FLOOD_OPTIONS = (
    _option("--connections", type=int, default=1000),
    _option("--handshake-timeout", type=float, default=3.0),
    _option("--backend", default="numpy"),
    _option("--rounds", type=int, default=2, help="floods one after the other"),
    _JSON,
)
_PEER_OPTIONS = (
    _option("--url", default=None, help="pool://NAME (default: two local proxies)"),
    _option("--backend", default="numpy", help="of the local proxies"),
    _option("--mib", type=int, default=64, help="array size"),
    _option("--rounds", type=int, default=5, help="per path, interleaved"),
    _JSON,
)
_ALLREDUCE_OPTIONS = (
    _option("--url", default=None, help="pool://NAME (default: local proxies, one per rank)"),
    _option("--backend", default="numpy", help="of the local proxies"),
    _option("--ranks", default="2,4", help="group sizes"),
    _option(
        "--sizes",
        type=_sizes,
        default="4k,64k,1m,16m,64m,256m",
        help="tensor sizes in bytes (4k,1m,64m)",
    ),
    _option("--iters", type=int, default=5, help="all-reduces per timing"),
    _option("--rounds", type=int, default=5, help="timings per size (the median is kept)"),
    _option("--ddp", default="", help="workloads whose DDP step is timed too (resnet18,gpt2)"),
    _option("--ddp-ranks", default="1,2,4", help="devices of the DDP steps"),
    _option("--ddp-size", default="small", choices=("small", "real")),
    _option("--ddp-steps", type=int, default=5, help="timed steps per run"),
    _JSON,
)
_FAILOVER_OPTIONS = (
    _option("--address", default=None, help="a Ray cluster (default: a local one)"),
    _option("--steps", type=int, default=400),
    _option("--kills", default="200,300", help="steps before which the session's proxy is killed"),
    _option("--timed-steps", type=int, default=2000, help="per run, for the overhead"),
    _option("--rounds", type=int, default=9, help="runs with and without failover"),
    _option("--checkpoint-interval", type=float, default=None, help="seconds"),
    _JSON,
)
_API_OPTIONS = (
    *_COMMON,
    _option("--calls", type=int, default=10_000),
    _option("--rounds", type=int, default=3),
)

# -- the table --------------------------------------------------------------------------------

#: every ``gpuremote bench`` subcommand, in ``--help``'s order
COMMANDS: tuple[BenchCommand, ...] = (
    BenchCommand(
        "ping",
        "round-trip latency through the whole gpuremote path",
        _PING_OPTIONS,
        BenchRun(
            config=_config_of("ping", "PingConfig"),
            run=_bench("ping", "run_ping"),
            view=render.ping_view,
            summary=render.ping_summary,
            outputs=_ping_outputs,
        ),
    ),
    BenchCommand(
        "throughput",
        "host-to-device and device-to-host bandwidth",
        _THROUGHPUT_OPTIONS,
        BenchRun(
            config=_throughput_config,
            run=_bench("throughput", "run_throughput"),
            view=render.throughput_view,
            summary=render.throughput_summary,
            outputs=_throughput_outputs,
        ),
        instead=(
            "compare",
            BenchRun(
                config=_compare_config,
                run=_run_compare,
                view=render.status_line(
                    "gpuremote bench throughput --compare", ("transport", "current")
                ),
                summary=render.throughput_compare_summary,
            ),
        ),
    ),
    BenchCommand(
        "load",
        "many concurrent clients, each verifying its result",
        _LOAD_OPTIONS,
        BenchRun(
            config=_config_of("load", "LoadConfig"),
            run=_bench("load", "run_load"),
            view=render.status_line("gpuremote bench load", ("finished", "clients")),
            summary=render.load_summary,
            exit_code=_exit_code("errors", lambda errors: errors == 0),
        ),
    ),
    BenchCommand(
        "fuzz",
        "a long hostile-input run against a live proxy",
        _FUZZ_OPTIONS,
        BenchRun(
            config=_config_of("fuzz", "FuzzConfig"),
            run=_bench("fuzz", "run_fuzz"),
            view=render.status_line(
                "gpuremote bench fuzz",
                ("connections", "frames", "control_checks", "control_failures"),
            ),
            summary=render.fuzz_summary,
            exit_code=_exit_code("control_failures", lambda failures: failures == 0),
        ),
    ),
    BenchCommand(
        "requirements",
        "latency and bandwidth each workload needs",
        _REQUIREMENTS_OPTIONS,
        BenchRun(
            config=_requirements_config,
            run=_bench("requirements", "run_requirements"),
            view=render.status_line("gpuremote bench requirements", ("workload", "done", "total")),
            summary=render.requirements_summary,
            outputs=_requirements_outputs,
        ),
        defaults=_NUMPY,
    ),
    BenchCommand(
        "emu",
        "accuracy of the emulated link (emu+ URLs)",
        _EMU_OPTIONS,
        BenchRun(
            config=_config_of(
                "emu",
                "EmuConfig",
                rtts=lambda args: args.rtts.split(","),
                bws=lambda args: args.bws.split(","),
            ),
            run=_bench("emu", "run_emu"),
            view=render.status_line(
                "gpuremote bench emu", ("setting", "added_us", "emulated_gbit")
            ),
            summary=render.emu_summary,
        ),
        defaults=_NUMPY,
    ),
    BenchCommand(
        "ops",
        "what users do (an op and a read, chains, a model step)",
        _OPS_OPTIONS,
        BenchRun(
            config=_ops_config,
            run=_bench("ops", "run_ops"),
            view=render.ops_view,
            summary=render.ops_summary,
        ),
    ),
    BenchCommand(
        "tenants",
        "a light client's latency beside a heavy one",
        _TENANTS_OPTIONS,
        BenchRun(
            config=_config_of("tenants", "TenantsConfig"),
            run=_bench("tenants", "run_tenants"),
            view=render.tenants_view,
            summary=render.tenants_summary,
        ),
        defaults=_NUMPY,
    ),
    BenchCommand(
        "flood",
        "connections that never complete the handshake",
        _FLOOD_OPTIONS,
        BenchRun(
            config=_config_of(
                "flood", "FloodConfig", handshake_timeout_s=lambda args: args.handshake_timeout
            ),
            run=_bench("flood", "run_flood"),
            view=render.status_line("flood", ("phase", "connections")),
            summary=render.flood_summary,
        ),
    ),
    BenchCommand(
        "peer",
        "x.to_device(other): proxy to proxy vs through the client",
        _PEER_OPTIONS,
        BenchRun(
            config=_config_of("peer", "PeerConfig"),
            run=_bench("peer", "run_peer"),
            view=render.status_line("gpuremote bench peer", ("round", "rounds")),
            summary=render.peer_summary,
        ),
    ),
    BenchCommand(
        "allreduce",
        "torch.distributed all-reduce between proxies vs bare Gloo",
        _ALLREDUCE_OPTIONS,
        BenchRun(
            config=_config_of(
                "allreduce",
                "AllreduceConfig",
                ranks=lambda args: tuple(int(k) for k in args.ranks.split(",") if k),
                sizes=lambda args: tuple(args.sizes),
                ddp=lambda args: tuple(n for n in args.ddp.split(",") if n),
                ddp_ranks=lambda args: tuple(int(k) for k in args.ddp_ranks.split(",") if k),
            ),
            run=_bench("allreduce", "run_allreduce"),
            view=render.status_line("gpuremote bench allreduce", ("ranks", "side")),
            summary=render.allreduce_summary,
        ),
    ),
    BenchCommand(
        "failover",
        "a session losing its proxy on a local pool of two",
        _FAILOVER_OPTIONS,
        BenchRun(
            config=_config_of(
                "failover",
                "FailoverBenchConfig",
                kills=lambda args: tuple(int(k) for k in args.kills.split(",") if k),
                checkpoint_interval_s=lambda args: args.checkpoint_interval,
            ),
            run=_bench("failover", "run_failover"),
            view=render.status_line(
                "gpuremote bench failover", ("phase", "round", "mode", "step", "killed")
            ),
            summary=render.failover_summary,
            exit_code=_exit_code("equal", bool),
        ),
    ),
    BenchCommand(
        "api",
        "calls per second: synchronous versus pipelined",
        _API_OPTIONS,
        BenchRun(
            config=_config_of("api", "ApiConfig"),
            run=_bench("api", "run_api"),
            view=render.api_view,
            summary=render.api_summary,
        ),
    ),
)
