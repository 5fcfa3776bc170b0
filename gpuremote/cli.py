"""The ``gpuremote`` command: ``serve``, ``demo``, ``info`` and ``bench ...``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    from . import aio
    from .backends import BackendError
    from .errors import GpuRemoteError
    from .proxy.executor import SessionLimits
    from .proxy.server import Proxy, Service, serve
    from .tools.proxyprocess import READY
    from .transports import Address
    from .wire.auth import is_loopback, load_secret
    from .wire.framing import FrameLimits

    services: list[Service] = []
    if args.bench_echo:  # the bench's baseline servers, beside the proxy, when asked for
        from .bench.baseline import echo_service

        services.append(echo_service)

    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    limits = SessionLimits(
        **{
            k: v
            for k, v in (
                ("max_device_bytes", args.max_device_bytes),
                ("max_handles", args.max_handles),
                ("max_steps", args.max_steps),
            )
            if v is not None
        }
    )

    def ready(proxy: Proxy, urls: list[str]) -> None:
        info = proxy.backend.device_info()
        note = f" ({info['note']})" if info["note"] else ""
        print(
            f"gpuremote proxy: backend {info['backend']} on {info['device']}{note}",
            file=sys.stderr,
            flush=True,
        )
        for url, listener in zip(urls, proxy.listeners, strict=False):
            line = f"{READY}{url}" if args.announce else f"listening on {url}"
            if listener.bound and listener.bound != (url,):  # where it really listens
                line += f" (bound to {', '.join(listener.bound)})"
            print(line, flush=True, file=sys.stdout if args.announce else sys.stderr)
        if proxy.metrics_url:
            print(f"Prometheus metrics at {proxy.metrics_url}", file=sys.stderr, flush=True)
        if proxy.admin_token is None:
            print("admin calls (gpuremote top) are off: no --admin-token", file=sys.stderr)

    try:
        metrics = None if args.metrics_port is None else (args.metrics_host, args.metrics_port)
        secret = load_secret(secret_file=args.secret_file)
        urls = args.listen or ["tcp://127.0.0.1:5151"]
        exposed = [
            u
            for u in urls
            if not is_loopback(Address.parse(u).host) and Address.parse(u).scheme != "inproc"
        ]
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
                ready=ready,
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


def _demo(args: argparse.Namespace) -> int:
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
    from .tools.pool_cli import run_pool_command

    return run_pool_command(args)


def _trace(args: argparse.Namespace) -> int:
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
    import json

    from . import aio
    from .client import connect

    async def run() -> dict[str, Any]:
        async with connect(args.url) as gpu:
            return gpu.device

    print(json.dumps(aio.run(run()), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuremote", description="GPU API remoting")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run a proxy that owns the GPU")
    s.add_argument(
        "--listen",
        action="append",
        metavar="URL",
        help="address to listen on (repeatable; default tcp://127.0.0.1:5151)",
    )
    s.add_argument(
        "--backend",
        default="auto",
        help="auto, cupy, numpy, or sim (a simulated device; sim:op_us=50 for 50 µs per op; "
        "sim:check checks stream order: races, use after free; sim:check,op_us=50)",
    )
    s.add_argument(
        "--max-clients",
        type=int,
        default=None,
        help="connections beyond this many are refused (the client is told the limit)",
    )
    s.add_argument(
        "--handshake-timeout",
        type=float,
        default=5.0,
        help="seconds a new connection has to complete the handshake (0: no limit)",
    )
    s.add_argument(
        "--inline-us",
        type=float,
        default=1000.0,
        help="a batch estimated to take less runs on the event loop when its session has "
        "nothing in flight; everything else runs on a worker thread (default 1000)",
    )
    s.add_argument(
        "--max-device-bytes", type=int, default=None, help="per-session device memory limit"
    )
    s.add_argument("--max-handles", type=int, default=None, help="per-session handle limit")
    s.add_argument(
        "--max-steps", type=int, default=None, help="recorded steps a session may keep (256)"
    )
    s.add_argument(
        "--max-frame-bytes",
        type=int,
        default=None,
        help="largest frame a client may send (bounds what a session can have in flight: "
        "the proxy stops reading a client whose replies are not yet out)",
    )
    s.add_argument(
        "--announce",
        action="store_true",
        help="print the bound URL on stdout once listening (for scripts)",
    )
    s.add_argument("--quiet", action="store_true", help="log warnings only")
    s.add_argument(
        "--secret-file",
        default=None,
        help="file holding the shared secret clients must prove they know (default: "
        "GPUREMOTE_SECRET, GPUREMOTE_SECRET_FILE, [auth] in gpuremote.toml; none: no auth)",
    )
    s.add_argument(
        "--drain-seconds",
        type=float,
        default=2.0,
        help="on SIGTERM, how long clients get to finish before they are disconnected",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening on a non-loopback address without a shared secret",
    )
    s.add_argument(
        "--admin-token",
        default=None,
        help="secret that admin clients (gpuremote top) must present "
        "(default: GPUREMOTE_ADMIN_TOKEN; none: admin calls refused)",
    )
    s.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="URL",
        help="another proxy this one may copy arrays from (x.to_device(...)); repeatable. "
        "Without one, proxy-to-proxy copies are refused and go through the client",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (needs the [metrics] extra)",
    )
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics server")
    s.add_argument(
        "--bench-echo",
        action="store_true",
        help="also serve bare echo baselines for `gpuremote bench` (loopback use)",
    )
    s.set_defaults(func=_serve)

    d = sub.add_parser("demo", help="train a small MLP through a proxy and check the result")
    d.add_argument("--url", default=None, help="proxy to use (default: start a local one)")
    d.add_argument("--backend", default="auto", help="backend of the local proxy")
    d.add_argument("--steps", type=int, default=20)
    d.add_argument("--batch", type=int, default=256)
    d.add_argument("--hidden", type=int, default=128)
    d.set_defaults(func=_demo)

    t = sub.add_parser("top", help="live view of a proxy's clients (an admin call)")
    t.add_argument("--url", default=None)
    t.add_argument("--token", default=None, help="admin token (default: GPUREMOTE_ADMIN_TOKEN)")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    t.add_argument("--once", action="store_true", help="print one snapshot and exit")
    t.add_argument("--json", action="store_true", help="with --once: as JSON")
    t.add_argument("--address", default=None, help="with pool://: the Ray cluster's address")
    t.set_defaults(func=_top)

    pl = sub.add_parser("pool", help="a pool of proxies on Ray (the [ray] extra)")
    psub = pl.add_subparsers(dest="pool_command", required=True)
    for name, text in (
        ("start", "start a pool's proxies as Ray actors"),
        ("status", "each proxy of a pool: url, node, sessions, memory, calls/s, restarts"),
        ("stop", "stop a pool's proxies"),
    ):
        c = psub.add_parser(name, help=text)
        c.add_argument("--name", default="gpuremote", help="the pool's name (pool://NAME)")
        fallback = ", else one started here with `ray start --head`" if name == "start" else ""
        c.add_argument(
            "--address",
            default=None,
            help=f"the Ray cluster (default: RAY_ADDRESS, else the one on this machine{fallback})",
        )
        if name == "start":
            c.add_argument("--proxies", type=int, default=1, help="how many proxies")
            c.add_argument("--num-gpus", type=float, default=1, help="GPUs per proxy (0: none)")
            c.add_argument(
                "--backend", default="auto", help="auto, cupy, numpy or sim (auto: CuPy if usable)"
            )
            c.add_argument("--transport", default="tcp", choices=["tcp", "ucx"])
        if name == "status":
            c.add_argument("--json", action="store_true", help="one JSON object")
            c.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
            c.add_argument("--interval", type=float, default=1.0)
    pl.set_defaults(func=_pool)

    tr = sub.add_parser("trace", help="record a workload's call trace from a local run")
    tr.add_argument("workload", choices=["mlp", "transformer", "upload"])
    tr.add_argument("-o", "--output", default="trace.json")
    tr.add_argument("--backend", default="numpy")
    tr.set_defaults(func=_trace)

    pr = sub.add_parser("predict", help="predict a traced workload's time over a network")
    pr.add_argument("trace", help="a file from `gpuremote trace`")
    pr.add_argument("--rtt", default="10us", help="round-trip time, e.g. 10us")
    pr.add_argument("--bw", default=None, help="bandwidth, e.g. 100gbit (default: unlimited)")
    pr.add_argument("--client-overhead", default="0", help="client cost per remote call")
    pr.add_argument("--proxy-overhead", default="0", help="proxy cost per call")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=_predict)

    i = sub.add_parser("info", help="print the proxy's device properties")
    i.add_argument("--url", default=None)
    i.set_defaults(func=_info)

    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
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
