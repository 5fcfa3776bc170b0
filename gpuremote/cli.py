"""The ``gpuremote`` command: ``serve``, ``demo``, ``top``, ``pool``, ``trace``, ``predict``,
``info`` (one table of them, ``COMMANDS``) and ``bench ...`` (``gpuremote.bench.cli``)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .proxy.executor import SessionLimits
    from .proxy.server import Proxy, Service

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    """``gpuremote serve``: run a proxy until it is stopped (2: it could not start)."""
    from . import aio
    from .backends import BackendError
    from .errors import GpuRemoteError
    from .proxy.server import serve
    from .wire.auth import load_secret
    from .wire.framing import FrameLimits

    services = _bench_services(args.bench_echo)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    limits = _session_limits(args)
    try:
        metrics = None if args.metrics_port is None else (args.metrics_host, args.metrics_port)
        secret = load_secret(secret_file=args.secret_file)
        urls = args.listen or ["tcp://127.0.0.1:5151"]
        exposed = _off_loopback(urls)
        if exposed and secret is None and not args.insecure:
            print(
                f"gpuremote serve: refusing to listen on {', '.join(exposed)} without a shared "
                "secret (--secret-file, GPUREMOTE_SECRET, [auth] in gpuremote.toml); "
                "--insecure overrides",
                file=sys.stderr,
            )
            return 2
        aio.run(
            serve(
                urls,
                args.backend,
                ready=functools.partial(_print_ready, args.announce),
                session_limits=limits,
                services=services,
                inline_us=args.inline_us,
                max_clients=args.max_clients,
                handshake_timeout_s=args.handshake_timeout or None,
                secret_off_loopback=not args.insecure,
                admin_token=args.admin_token or os.environ.get("GPUREMOTE_ADMIN_TOKEN"),
                metrics=metrics,
                secret=secret,
                drain_s=args.drain_seconds,
                peers=args.peer,
                limits=FrameLimits(max_frame_bytes=args.max_frame_bytes)
                if args.max_frame_bytes
                else FrameLimits(),
            )
        )
    except (GpuRemoteError, BackendError) as exc:
        print(f"gpuremote serve: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def _bench_services(bench_echo: bool) -> list[Service]:
    """The services served beside the proxy: the bench's baseline servers, when asked for."""
    if not bench_echo:
        return []
    from .bench.baseline import echo_service

    return [echo_service]


def _session_limits(args: argparse.Namespace) -> SessionLimits:
    """``serve``'s per-session limits: the defaults, but those given as options."""
    from .proxy.executor import SessionLimits

    given = (
        ("max_device_bytes", args.max_device_bytes),
        ("max_handles", args.max_handles),
        ("max_steps", args.max_steps),
        ("max_templates", args.max_templates),
        ("graphs", args.graphs),
        ("max_compile_s", args.max_compile_s),
    )
    return SessionLimits(**{k: v for k, v in given if v is not None})


def _off_loopback(urls: list[str]) -> list[str]:
    """Those of ``urls`` that other machines could reach (neither loopback nor in process)."""
    from .transports import Address
    from .wire.auth import is_loopback

    return [
        u
        for u in urls
        if not is_loopback(Address.parse(u).host) and Address.parse(u).scheme != "inproc"
    ]


def _print_ready(announce: bool, proxy: Proxy, urls: list[str]) -> None:
    """``serve``'s lines once the proxy listens: its device, where it listens (on stdout, for
    scripts, with ``--announce``), its metrics, whether admin calls are on."""
    from .tools.proxyprocess import READY

    info = proxy.backend.device_info()
    note = f" ({info['note']})" if info["note"] else ""
    print(
        f"gpuremote proxy: backend {info['backend']} on {info['device']}{note}",
        file=sys.stderr,
        flush=True,
    )
    for url, listener in zip(urls, proxy.listeners, strict=False):
        line = f"{READY}{url}" if announce else f"listening on {url}"
        if listener.bound and listener.bound != (url,):  # where it really listens
            line += f" (bound to {', '.join(listener.bound)})"
        print(line, flush=True, file=sys.stdout if announce else sys.stderr)
    if proxy.metrics_url:
        print(f"Prometheus metrics at {proxy.metrics_url}", file=sys.stderr, flush=True)
    if proxy.admin_token is None:
        print("admin calls (gpuremote top) are off: no --admin-token", file=sys.stderr)


def _demo(args: argparse.Namespace) -> int:
    """``gpuremote demo``: the MLP locally and through a proxy (1: the results differ)."""
    import time

    import numpy as np

    from . import aio
    from .client import connect
    from .tools.demo import mlp_data, train_local, train_remote
    from .tools.proxyprocess import LocalProxy

    data = mlp_data(batch=args.batch, hidden=args.hidden)
    local = train_local(data, args.steps)
    proxy = None
    url = args.url
    if url is None:
        proxy = LocalProxy("tcp", args.backend)
        t0 = time.perf_counter()
        url = proxy.start()
        print(f"started a local proxy at {url} in {time.perf_counter() - t0:.2f} s")

    async def run() -> Any:
        out = []
        for capture in (False, True):  # step by step, then recorded once and replayed
            async with connect(url) as gpu:
                result = await train_remote(gpu, data, args.steps, capture=capture)
                out.append((gpu.device, gpu.stats(), result))
        return out

    try:
        runs = aio.run(run())
    finally:
        if proxy is not None:
            proxy.stop()
    device = runs[0][0]
    print(f"proxy backend: {device['backend']} ({device['device']})")
    print(f"MLP training, batch {args.batch}, hidden {args.hidden}, {args.steps} steps")
    print(f"  local NumPy: loss {local.losses[0]:.5f} -> {local.losses[-1]:.5f}, "
          f"{local.seconds * 1e3:.1f} ms")  # fmt: skip
    ok = True
    for (_, stats, remote), how in zip(runs, ("step by step", "captured, replayed"), strict=True):
        diff = max(
            float(np.max(np.abs(a - b))) for a, b in zip(remote.weights, local.weights, strict=True)
        )
        calls = stats["calls"]
        print(
            f"  remote, {how}: loss {remote.losses[0]:.5f} -> {remote.losses[-1]:.5f}, "
            f"{remote.seconds * 1e3:.1f} ms; largest weight difference to local {diff:.3g}; "
            f"{calls['async']} async, {calls['sync']} sync calls, "
            f"{stats['frames_sent']} frames sent, {stats['round_trips']} round trips"
        )
        ok = ok and diff <= 1e-4 and np.allclose(remote.losses, local.losses, rtol=1e-4, atol=1e-6)
    print("result: OK, remote equals local" if ok else "result: MISMATCH")
    return 0 if ok else 1


def _top(args: argparse.Namespace) -> int:
    """``gpuremote top``: a proxy's clients, or a pool's proxies (``pool://``)."""
    from . import aio
    from .session.connection import placed
    from .tools.top import run_top, run_top_pool

    pool = placed(args.url) if args.url else None
    if pool is not None:
        return aio.run(
            run_top_pool(
                pool[1],
                address=args.address,
                interval=args.interval,
                once=args.once,
                as_json=args.json,
            )
        )
    token = args.token or os.environ.get("GPUREMOTE_ADMIN_TOKEN", "")
    return aio.run(
        run_top(args.url, token, interval=args.interval, once=args.once, as_json=args.json)
    )


def _pool(args: argparse.Namespace) -> int:
    """``gpuremote pool start | status | stop``."""
    from .tools.pool_cli import run_pool_command

    return run_pool_command(args)


def _trace(args: argparse.Namespace) -> int:
    """``gpuremote trace``: a workload run in process, its call trace written to a file."""
    import time

    from . import aio
    from .tools.direct import connect_direct, trace_of
    from .tools.model import save_trace
    from .tools.workloads import WORKLOADS

    async def run() -> tuple[float, list[Any]]:
        gpu = connect_direct(args.backend)
        t0 = time.perf_counter()
        await WORKLOADS[args.workload](gpu)
        seconds = time.perf_counter() - t0
        trace = list(trace_of(gpu))
        await gpu.aclose()
        return seconds, trace

    seconds, trace = aio.run(run())
    save_trace(args.output, trace, workload=args.workload, backend=args.backend, local_s=seconds)
    kinds = {k: sum(1 for t in trace if t.klass == k) for k in ("local", "async", "sync")}
    print(
        f"{args.workload}: {len(trace)} calls ({kinds}), {seconds:.3f} s locally; "
        f"trace written to {args.output}"
    )
    return 0


def _predict(args: argparse.Namespace) -> int:
    """``gpuremote predict``: a trace's time over a link, with the optimisations and without."""
    import json

    from .tools.model import Costs, load_trace, predict
    from .transports.emulated import parse_bandwidth, parse_duration

    trace, meta = load_trace(args.trace)
    rtt = parse_duration(args.rtt)
    bw = parse_bandwidth(args.bw) if args.bw else None
    costs = Costs(
        client_per_call=parse_duration(args.client_overhead),
        proxy_per_call=parse_duration(args.proxy_overhead),
    )
    out = {}
    for optimized in (True, False):
        p = predict(trace, rtt, bw, optimized=optimized, costs=costs)
        out["optimized" if optimized else "unoptimized"] = {
            "predicted_s": p.seconds,
            "local_s": p.local_seconds,
            "slowdown": p.slowdown,
            "round_trips": p.round_trips,
        }
    result = {
        "trace": args.trace,
        "workload": meta.get("workload"),
        "rtt_us": rtt * 1e6,
        "bw_gbit": None if bw is None else bw / 1e9,
        **out,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['workload']} over RTT {rtt * 1e6:g} µs, "
        f"{'unlimited' if bw is None else f'{bw / 1e9:g} Gbit/s'}:"
    )
    for key in ("optimized", "unoptimized"):
        r = out[key]
        print(
            f"  {key:11s}: {r['predicted_s']:.4f} s (local {r['local_s']:.4f} s), "
            f"slowdown {100 * r['slowdown']:+.1f}%, {r['round_trips']} round trips"
        )
    return 0


def _info(args: argparse.Namespace) -> int:
    """``gpuremote info``: the proxy's device properties, as JSON."""
    import json

    from . import aio
    from .client import connect

    async def run() -> dict[str, Any]:
        async with connect(args.url) as gpu:
            return gpu.device

    print(json.dumps(aio.run(run()), indent=2))
    return 0


# -- the options of each subcommand, in --help's order -----------------------------------------

Option = tuple[tuple[str, ...], dict[str, Any]]


def _option(*flags: str, **settings: Any) -> Option:
    """One option of a subcommand: the arguments of its ``add_argument`` call."""
    return flags, settings


_SERVE_OPTIONS = (
    _option(
        "--listen",
        action="append",
        metavar="URL",
        help="address to listen on (repeatable; default tcp://127.0.0.1:5151)",
    ),
    _option(
        "--backend",
        default="auto",
        help="auto, cupy, numpy, or sim (a simulated device; sim:op_us=50 for 50 µs per op; "
        "sim:check checks stream order: races, use after free; sim:check,op_us=50)",
    ),
    _option(
        "--max-clients",
        type=int,
        default=None,
        help="connections beyond this many are refused (the client is told the limit)",
    ),
    _option(
        "--handshake-timeout",
        type=float,
        default=5.0,
        help="seconds a new connection has to complete the handshake (0: no limit)",
    ),
    _option(
        "--inline-us",
        type=float,
        default=1000.0,
        help="a batch estimated to take less runs on the event loop when its session has "
        "nothing in flight; everything else runs on a worker thread (default 1000)",
    ),
    _option("--max-device-bytes", type=int, default=None, help="per-session device memory limit"),
    _option("--max-handles", type=int, default=None, help="per-session handle limit"),
    _option("--max-steps", type=int, default=None, help="recorded steps a session may keep (256)"),
    _option(
        "--max-templates",
        type=int,
        default=None,
        help="PyTorch op signatures a session may keep (65536; gpuremote.torch keeps its eager "
        "ops' there, and sends later calls of each as places and floats)",
    ),
    _option(
        "--graphs",
        choices=("fx", "inductor", "cudagraphs", "ops"),
        default=None,
        help="how recorded PyTorch graphs (torch.compile(backend='gpuremote')) replay: each "
        "as one FX graph (fx, default), compiled by this proxy's torch.compile (inductor), "
        "so and replayed as CUDA graphs on a GPU (cudagraphs), or op by op (ops)",
    ),
    _option(
        "--max-compile-s",
        type=float,
        default=None,
        help="seconds a session's graphs may spend compiling under --graphs inductor (600)",
    ),
    _option(
        "--max-frame-bytes",
        type=int,
        default=None,
        help="largest frame a client may send (bounds what a session can have in flight: "
        "the proxy stops reading a client whose replies are not yet out)",
    ),
    _option(
        "--announce",
        action="store_true",
        help="print the bound URL on stdout once listening (for scripts)",
    ),
    _option("--quiet", action="store_true", help="log warnings only"),
    _option(
        "--secret-file",
        default=None,
        help="file holding the shared secret clients must prove they know (default: "
        "GPUREMOTE_SECRET, GPUREMOTE_SECRET_FILE, [auth] in gpuremote.toml; none: no auth)",
    ),
    _option(
        "--drain-seconds",
        type=float,
        default=2.0,
        help="on SIGTERM, how long clients get to finish before they are disconnected",
    ),
    _option(
        "--insecure",
        action="store_true",
        help="allow listening on a non-loopback address without a shared secret",
    ),
    _option(
        "--admin-token",
        default=None,
        help="secret that admin clients (gpuremote top) must present "
        "(default: GPUREMOTE_ADMIN_TOKEN; none: admin calls refused)",
    ),
    _option(
        "--peer",
        action="append",
        default=[],
        metavar="URL",
        help="another proxy this one may copy arrays from (x.to_device(...)); repeatable. "
        "Without one, proxy-to-proxy copies are refused and go through the client",
    ),
    _option(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (needs the [metrics] extra)",
    ),
    _option("--metrics-host", default="127.0.0.1", help="address of the metrics server"),
    _option(
        "--bench-echo",
        action="store_true",
        help="also serve bare echo baselines for `gpuremote bench` (loopback use)",
    ),
)
_DEMO_OPTIONS = (
    _option("--url", default=None, help="proxy to use (default: start a local one)"),
    _option("--backend", default="auto", help="backend of the local proxy"),
    _option("--steps", type=int, default=20),
    _option("--batch", type=int, default=256),
    _option("--hidden", type=int, default=128),
)
_TOP_OPTIONS = (
    _option("--url", default=None),
    _option("--token", default=None, help="admin token (default: GPUREMOTE_ADMIN_TOKEN)"),
    _option("--interval", type=float, default=1.0, help="seconds between refreshes"),
    _option("--once", action="store_true", help="print one snapshot and exit"),
    _option("--json", action="store_true", help="with --once: as JSON"),
    _option("--address", default=None, help="with pool://: the Ray cluster's address"),
)


def _which_pool_options(ray_fallback: str = "") -> tuple[Option, ...]:
    """The options every ``pool`` subcommand has: which pool, on which Ray cluster (where
    none is found, ``ray_fallback`` says what happens)."""
    return (
        _option("--name", default="gpuremote", help="the pool's name (pool://NAME)"),
        _option(
            "--address",
            default=None,
            help="the Ray cluster (default: RAY_ADDRESS, else the one on this machine"
            f"{ray_fallback})",
        ),
    )


_POOL_START_OPTIONS = (
    *_which_pool_options(", else one started here with `ray start --head`"),
    _option("--proxies", type=int, default=1, help="how many proxies"),
    _option("--num-gpus", type=float, default=1, help="GPUs per proxy (0: none)"),
    _option("--backend", default="auto", help="auto, cupy, numpy or sim (auto: CuPy if usable)"),
    _option("--transport", default="tcp", choices=["tcp", "ucx"]),
)
_POOL_STATUS_OPTIONS = (
    *_which_pool_options(),
    _option("--json", action="store_true", help="one JSON object"),
    _option("--watch", action="store_true", help="refresh until Ctrl-C"),
    _option("--interval", type=float, default=1.0),
)
_TRACE_OPTIONS = (
    _option("workload", choices=["mlp", "transformer", "upload"]),
    _option("-o", "--output", default="trace.json"),
    _option("--backend", default="numpy"),
)
_PREDICT_OPTIONS = (
    _option("trace", help="a file from `gpuremote trace`"),
    _option("--rtt", default="10us", help="round-trip time, e.g. 10us"),
    _option("--bw", default=None, help="bandwidth, e.g. 100gbit (default: unlimited)"),
    _option("--client-overhead", default="0", help="client cost per remote call"),
    _option("--proxy-overhead", default="0", help="proxy cost per call"),
    _option("--json", action="store_true"),
)
_INFO_OPTIONS = (_option("--url", default=None),)


# -- the table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """A ``gpuremote`` subcommand: its name, help and options, and what runs it (its exit
    code); ``subcommands``: (name, help, options) of its own subcommands, which ``run`` runs
    too (their name in ``args.<name>_command``)."""

    name: str
    help: str
    options: tuple[Option, ...]
    run: Callable[[argparse.Namespace], int]
    subcommands: tuple[tuple[str, str, tuple[Option, ...]], ...] = ()


#: every ``gpuremote`` subcommand but ``bench`` (``gpuremote.bench.cli``), in --help's order
COMMANDS: tuple[Command, ...] = (
    Command("serve", "run a proxy that owns the GPU", _SERVE_OPTIONS, _serve),
    Command("demo", "train a small MLP through a proxy and check the result", _DEMO_OPTIONS, _demo),
    Command("top", "live view of a proxy's clients (an admin call)", _TOP_OPTIONS, _top),
    Command(
        "pool",
        "a pool of proxies on Ray (the [ray] extra)",
        (),
        _pool,
        subcommands=(
            ("start", "start a pool's proxies as Ray actors", _POOL_START_OPTIONS),
            (
                "status",
                "each proxy of a pool: url, node, sessions, memory, calls/s, restarts",
                _POOL_STATUS_OPTIONS,
            ),
            ("stop", "stop a pool's proxies", _which_pool_options()),
        ),
    ),
    Command("trace", "record a workload's call trace from a local run", _TRACE_OPTIONS, _trace),
    Command(
        "predict", "predict a traced workload's time over a network", _PREDICT_OPTIONS, _predict
    ),
    Command("info", "print the proxy's device properties", _INFO_OPTIONS, _info),
)


def _add_options(parser: argparse.ArgumentParser, options: tuple[Option, ...]) -> None:
    """``options``' ``add_argument`` calls on ``parser``, in order."""
    for flags, settings in options:
        parser.add_argument(*flags, **settings)


def build_parser() -> argparse.ArgumentParser:
    """The ``gpuremote`` command's parser: ``COMMANDS``, then ``bench``."""
    p = argparse.ArgumentParser(prog="gpuremote", description="GPU API remoting")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        c = sub.add_parser(command.name, help=command.help)
        _add_options(c, command.options)
        if command.subcommands:
            below = c.add_subparsers(dest=f"{command.name}_command", required=True)
            for name, text, options in command.subcommands:
                _add_options(below.add_parser(name, help=text), options)
        c.set_defaults(func=command.run)

    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    return p


def _version() -> str:
    """The version, and which build of the hot modules runs (compiled by mypyc, or Python)."""
    from . import __version__, _build

    return f"gpuremote {__version__} (hot path: {_build.build()})"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gpuremote`` command (``argv``: its arguments, else ``sys.argv``); its exit
    code."""
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "json", False):
            from .tools.stdio import json_stdout

            with json_stdout():
                return int(args.func(args))
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except asyncio.CancelledError:
        return 1
    except Exception as exc:
        from .errors import GpuRemoteError

        if isinstance(exc, GpuRemoteError):
            print(f"gpuremote: {exc}", file=sys.stderr)
            return 1
        raise
