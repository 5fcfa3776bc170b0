"""``gpuremote bench ping | throughput | api``: argument parsing and output (live rich view on a
terminal, a plain summary otherwise, one JSON object with ``--json``, raw samples with
``--csv``)."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live

from .render import result_table

__all__ = ["add_bench_parser"]


def _sizes(text: str) -> list[int]:
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


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=None,
        help="talk to a running proxy (default: GPUREMOTE_URL, the config file, "
        "else start a local proxy)",
    )
    p.add_argument(
        "--transport",
        default="tcp",
        help="transport of the local proxy the bench starts (tcp, inproc, ucx)",
    )
    p.add_argument("--backend", default="auto", help="backend of the local proxy")
    p.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    p.add_argument(
        "--no-baseline", dest="baseline", action="store_false", help="skip the bare baselines"
    )
    p.add_argument(
        "--baseline",
        dest="baseline",
        action="store_true",
        default=True,
        help="run the bare baselines in the same run (default)",
    )


def add_bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks, with bare baselines in the same run")
    bs = b.add_subparsers(dest="bench", required=True)

    p = bs.add_parser("ping", help="round-trip latency through the whole gpuremote path")
    _common(p)
    p.add_argument("--size", type=int, default=8, help="message size in bytes (default 8)")
    p.add_argument("--count", type=int, default=20_000, help="round trips per path")
    p.add_argument("--duration", type=float, default=None, help="seconds instead of --count")
    p.add_argument("--warmup", type=int, default=1_000, help="uncounted round trips per path")
    p.add_argument("--csv", default=None, metavar="FILE", help="write the raw samples here")
    p.add_argument(
        "--spin-us",
        type=float,
        default=0.0,
        help="spin-wait this long for each reply, in gpuremote and the asyncio echo (default 0)",
    )
    p.set_defaults(func=_ping)

    t = bs.add_parser("throughput", help="host-to-device and device-to-host bandwidth")
    _common(t)
    t.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help="comma-separated sizes (default 4k..256m, powers of 4)",
    )
    t.add_argument("--min-reps", type=int, default=5)
    t.add_argument("--max-reps", type=int, default=200)
    t.add_argument("--csv", default=None, metavar="FILE", help="write the raw samples here")
    t.add_argument(
        "--compare",
        default=None,
        metavar="T1,T2",
        help="run the sweep over each transport (e.g. tcp,ucx) and put them side by side",
    )
    t.set_defaults(func=_throughput)

    lo = bs.add_parser("load", help="many concurrent clients, each verifying its result")
    _common(lo)
    lo.add_argument("--clients", type=int, default=8)
    lo.add_argument("--ops", type=int, default=1000, help="calls per client")
    lo.add_argument(
        "--sync-every", type=int, default=100, help="a verifying read-back every this many calls"
    )
    lo.add_argument("--procs", type=int, default=1, help="processes the clients are spread over")
    lo.add_argument(
        "--light-period-ms",
        type=float,
        default=10.0,
        help="a light client's synchronous op every this often, beside the others (0: none)",
    )
    lo.set_defaults(func=_load)

    fz = bs.add_parser("fuzz", help="a long hostile-input run against a live proxy")
    _common(fz)
    fz.add_argument("--seconds", type=float, default=30.0)
    fz.add_argument("--seed", type=int, default=0)
    fz.add_argument(
        "--connections",
        type=int,
        default=0,
        help="stop after this many hostile connections (0: run --seconds)",
    )
    fz.set_defaults(func=_fuzz)

    rq = bs.add_parser("requirements", help="latency and bandwidth each workload needs")
    _common(rq)
    rq.set_defaults(backend="numpy")
    rq.add_argument("--workloads", default="mlp,transformer,upload")
    rq.add_argument(
        "--rtts",
        default=None,
        help="emulated RTTs in µs (default 10,100,1000; over emu+inproc the paper's "
        "1,2,5,10,20,40,100)",
    )
    rq.add_argument(
        "--bws",
        default=None,
        help="bandwidths in Gbit/s (default 1,10,100; over emu+inproc 10,25,100,200)",
    )
    rq.add_argument(
        "--modes",
        default="unoptimized,optimized,replay",
        help="over emu+inproc: unoptimized, optimized, replay (each step captured once and "
        "replayed by one message)",
    )
    rq.add_argument("--tolerance", type=float, default=0.05)
    rq.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="turns per point (default 3; over emu+inproc 5, of which the least disturbed "
        "is reported; 3 with --quick)",
    )
    rq.add_argument("--quick", action="store_true", help="a reduced grid and smaller workloads")
    rq.add_argument(
        "--plot",
        default="requirements.png",
        metavar="PNG",
        help="where to write the plot (needs matplotlib: the [plot] extra)",
    )
    rq.set_defaults(func=_requirements)

    em = bs.add_parser("emu", help="accuracy of the emulated link (emu+ URLs)")
    _common(em)
    em.set_defaults(backend="numpy")
    em.add_argument("--rtts", default="100us,300us,1ms,3ms,10ms")
    em.add_argument("--bws", default="100mbit,1gbit,10gbit")
    em.add_argument("--pings", type=int, default=100)
    em.set_defaults(func=_emu)

    op = bs.add_parser("ops", help="what users do (an op and a read, chains, a model step)")
    _common(op)
    op.add_argument("--iterations", type=int, default=3_000, help="per synchronous case")
    op.add_argument("--rounds", type=int, default=5, help="interleaved rounds (A B A B)")
    op.add_argument("--chain", type=int, default=10_000, help="ops per asynchronous chain")
    op.add_argument("--steps", type=int, default=20, help="transformer steps per round")
    op.add_argument("--warmup", type=int, default=300, help="uncounted iterations per case")
    op.add_argument("--cases", default=None, help="comma-separated subset (default: every case)")
    op.add_argument(
        "--pin",
        choices=("none", "same", "split"),
        default="none",
        help="CPU placement of the bench and the proxy it starts: one CPU for both, one each, "
        "or the scheduler's choice (default); the floor depends on it",
    )
    op.set_defaults(func=_ops)

    t = bs.add_parser("tenants", help="a light client's latency beside a heavy one")
    _common(t)
    t.set_defaults(backend="numpy")
    t.add_argument("--seconds", type=float, default=3.0, help="per phase")
    t.add_argument("--period-ms", type=float, default=10.0, help="between the light ops")
    t.add_argument("--n", type=int, default=1500, help="the heavy client's matrix size")
    t.add_argument("--matmuls", type=int, default=4, help="chained matmuls per heavy loop")
    t.set_defaults(func=_tenants)

    fl = bs.add_parser("flood", help="connections that never complete the handshake")
    fl.add_argument("--connections", type=int, default=1000)
    fl.add_argument("--handshake-timeout", type=float, default=3.0)
    fl.add_argument("--backend", default="numpy")
    fl.add_argument("--rounds", type=int, default=2, help="floods one after the other")
    fl.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    fl.set_defaults(func=_flood)

    pe = bs.add_parser("peer", help="x.to_device(other): proxy to proxy vs through the client")
    pe.add_argument("--url", default=None, help="pool://NAME (default: two local proxies)")
    pe.add_argument("--backend", default="numpy", help="of the local proxies")
    pe.add_argument("--mib", type=int, default=64, help="array size")
    pe.add_argument("--rounds", type=int, default=5, help="per path, interleaved")
    pe.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    pe.set_defaults(func=_peer)

    fo = bs.add_parser("failover", help="a session losing its proxy on a local pool of two")
    fo.add_argument("--address", default=None, help="a Ray cluster (default: a local one)")
    fo.add_argument("--steps", type=int, default=400)
    fo.add_argument(
        "--kills", default="200,300", help="steps before which the session's proxy is killed"
    )
    fo.add_argument("--timed-steps", type=int, default=2000, help="per run, for the overhead")
    fo.add_argument("--rounds", type=int, default=9, help="runs with and without failover")
    fo.add_argument("--checkpoint-interval", type=float, default=None, help="seconds")
    fo.add_argument("--json", action="store_true", help="print one JSON object and nothing else")
    fo.set_defaults(func=_failover)

    a = bs.add_parser("api", help="calls per second: synchronous versus pipelined")
    _common(a)
    a.add_argument("--calls", type=int, default=10_000)
    a.add_argument("--rounds", type=int, default=3)
    a.set_defaults(func=_api)


def _target(args: argparse.Namespace) -> dict[str, Any]:
    """Where the bench's proxy is (the options every bench shares)."""
    return {"url": args.url, "transport": args.transport, "backend": args.backend}


def _status(prefix: str, keys: tuple[str, ...]) -> Callable[[dict[str, Any]], RenderableType]:
    """A one-line live view of a bench's progress."""

    def view(state: dict[str, Any]) -> RenderableType:
        from rich.text import Text

        return Text(f"{prefix}: " + "  ".join(f"{k} {state[k]}" for k in keys if k in state))

    return view


def _drive(
    args: argparse.Namespace,
    view: Callable[[dict[str, Any]], RenderableType],
    make: Callable[[Callable[[dict[str, Any]], None]], Coroutine[Any, Any, Any]],
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


def _ping(args: argparse.Namespace) -> int:
    from .ping import PingConfig, run_ping
    from .render import ping_view

    cfg = PingConfig(
        **_target(args),
        size=args.size,
        count=args.count,
        duration=args.duration,
        warmup=args.warmup,
        baseline=args.baseline,
        spin_us=args.spin_us,
    )
    result, samples = _drive(args, ping_view, lambda report: run_ping(cfg, report))
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["path", "size", "iteration", "ns"])
            for path, arr in samples.items():
                for i, ns in enumerate(arr.tolist()):
                    w.writerow([path, args.size, i, ns])
    if args.json:
        _print_json(result)
        return 0
    console = Console()
    if not console.is_terminal:
        from .render import stats_table
        from .stats import summarize

        stats = {k: summarize(v) for k, v in samples.items()}
        ratios = {k: (stats["gpuremote"]["p50"] / s["p50"]) for k, s in stats.items()}
        console.print(
            f"gpuremote bench ping: {result['url']} ({result['transport']}), "
            f"{args.size} B, {result['count']} round trips per path"
        )
        console.print(stats_table(stats, ratios))
    if result["ratio_p50"] is not None:
        console.print(
            f"gpuremote / asyncio echo p50: {result['ratio_p50']:.2f}x; "
            f"gpuremote / blocking-socket echo p50: {result['ratio_p50_blocking']:.2f}x"
        )
    return 0


def _throughput(args: argparse.Namespace) -> int:
    from .render import throughput_view
    from .throughput import DEFAULT_SIZES, ThroughputConfig, run_throughput

    cfg = ThroughputConfig(
        **_target(args),
        sizes=args.sizes or list(DEFAULT_SIZES),
        baseline=args.baseline,
        min_reps=args.min_reps,
        max_reps=args.max_reps,
    )
    if args.compare:
        return _throughput_compare(args, cfg)
    result, raw = _drive(args, throughput_view, lambda report: run_throughput(cfg, report))
    if args.csv:
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, ["path", "size", "direction", "iteration", "ns"])
            w.writeheader()
            w.writerows(raw)
    if args.json:
        _print_json(result)
        return 0
    console = Console()
    if not console.is_terminal:
        console.print(throughput_view({**result, "done": 1, "total": 1, "current": ""}))
    peak = result["peak_rss_mb"]
    proxy = "n/a" if peak["proxy"] is None else f"{peak['proxy']:.0f} MB"
    console.print(
        f"peak memory during a {peak['payload_mb']:.0f} MB upload and download: "
        f"client {peak['client']:.0f} MB, proxy {proxy}"
    )
    return 0


def _throughput_compare(args: argparse.Namespace, cfg: Any) -> int:
    from .throughput import run_compare

    transports = [t.strip() for t in args.compare.split(",") if t.strip()]
    view = _status("gpuremote bench throughput --compare", ("transport", "current"))
    result = _drive(args, view, lambda report: run_compare(cfg, transports, report))
    if args.json:
        _print_json(result)
        return 0
    by = {(r["transport"], r["size"], r["direction"]): r for r in result["results"]}
    versus = {
        (v["transport"], v["size"], v["direction"]): v["ratio"] for v in result["versus_first"]
    }
    rows = []
    for (t, size, direction), r in by.items():
        vs = versus.get((t, size, direction))
        rows.append(
            (
                t,
                direction,
                f"{size:,}",
                f"{r['gbps']:.2f}",
                "-" if r["ratio"] is None else f"{r['ratio']:.2f}",
                "-" if vs is None else f"{vs:.2f}",
            )
        )
    cols = ("transport", "direction", "bytes", "GB/s", "x own bare", f"x {transports[0]}")
    Console().print(result_table("gpuremote bench throughput --compare", cols, rows))
    return 0


def _api(args: argparse.Namespace) -> int:
    from .api import ApiConfig, run_api

    cfg = ApiConfig(
        **_target(args),
        calls=args.calls,
        rounds=args.rounds,
    )

    def view(state: dict[str, Any]) -> RenderableType:
        from rich.text import Text

        return Text(
            f"gpuremote bench api: {state['url']}  round {state['round']}/"
            f"{state['rounds']}  {state['mode']}: {state['rate']:,.0f} calls/s"
        )

    result = _drive(args, view, lambda report: run_api(cfg, report))
    if args.json:
        _print_json(result)
        return 0
    t = result_table(
        f"gpuremote bench api: {result['calls']} launches over {result['url']}",
        ("mode", "calls/s", "round trips per call"),
        (
            (
                mode,
                f"{result[key + '_calls_per_s']:,.0f}",
                f"{result['round_trips_per_call'][key]:.4f}",
            )
            for mode, key in (("synchronous", "sync"), ("pipelined", "pipelined"))
        ),
    )
    console = Console()
    console.print(t)
    console.print(f"pipelined / synchronous: {result['ratio']:.1f}x")
    return 0


def _ops(args: argparse.Namespace) -> int:
    from .ops import ALL_CASES, OpsConfig, reexec_pinned, run_ops
    from .render import ops_view

    cfg = OpsConfig(
        **_target(args),
        iterations=args.iterations,
        rounds=args.rounds,
        chain=args.chain,
        steps=args.steps,
        warmup=args.warmup,
        cases=tuple(args.cases.split(",")) if args.cases else ALL_CASES,
        pin=args.pin,
    )
    reexec_pinned(cfg.pin, cfg)  # returns at once unless the command must restart pinned
    result = _drive(args, ops_view, lambda report: run_ops(cfg, report))
    if args.json:
        _print_json(result)
        return 0
    console = Console()
    if not console.is_terminal:
        console.print(ops_view(result))
    return 0


def _flood(args: argparse.Namespace) -> int:
    from .flood import FloodConfig, run_flood

    cfg = FloodConfig(args.connections, args.handshake_timeout, args.backend, args.rounds)
    result = _drive(args, _status("flood", ("phase", "connections")), lambda r: run_flood(cfg, r))
    if args.json:
        _print_json(result)
        return 0
    from rich.table import Table

    table = Table(title="gpuremote bench flood")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k, v in result.items():
        if k not in ("bench", "rounds"):
            table.add_row(k, f"{v:,.2f}" if isinstance(v, float) else str(v))
    Console().print(table)
    return 0


def _tenants(args: argparse.Namespace) -> int:
    from .render import tenants_view
    from .tenants import TenantsConfig, run_tenants

    cfg = TenantsConfig(
        **_target(args),
        seconds=args.seconds,
        period_ms=args.period_ms,
        n=args.n,
        matmuls=args.matmuls,
    )
    result = _drive(args, tenants_view, lambda report: run_tenants(cfg, report))
    if args.json:
        _print_json(result)
        return 0
    Console().print(tenants_view(result))
    return 0


def _peer(args: argparse.Namespace) -> int:
    from .peer import PeerConfig, run_peer

    cfg = PeerConfig(url=args.url, backend=args.backend, mib=args.mib, rounds=args.rounds)
    view = _status("gpuremote bench peer", ("round", "rounds"))
    result = _drive(args, view, lambda report: run_peer(cfg, report))
    if args.json:
        _print_json(result)
        return 0
    rows = [
        (
            label,
            f"{result[key]['median_s'] * 1e3:,.1f}",
            f"{result[key]['min_s'] * 1e3:,.1f}",
            f"{result[key]['gb_per_s']:,.2f}",
            f"{result[key]['client_bytes']:,}",
        )
        for key, label in (("direct", "proxy to proxy"), ("through_client", "through the client"))
    ]
    title = (
        f"gpuremote bench peer: x.to_device(other) of {result['bytes'] / 2**20:,.0f} MiB, "
        f"{result['rounds']} rounds each, A B A B (the direct path went {result['route']})"
    )
    cols = ("path", "median ms", "min ms", "GB/s", "client bytes")
    Console().print(result_table(title, cols, rows))
    Console().print(
        f"through the client / proxy to proxy: {result['through_client_over_direct']:.2f}x"
    )
    return 0


def _failover(args: argparse.Namespace) -> int:
    from .failover import FailoverBenchConfig, run_failover

    cfg = FailoverBenchConfig(
        address=args.address,
        steps=args.steps,
        kills=tuple(int(k) for k in args.kills.split(",") if k),
        timed_steps=args.timed_steps,
        rounds=args.rounds,
        checkpoint_interval_s=args.checkpoint_interval,
    )
    view = _status("gpuremote bench failover", ("phase", "round", "mode", "step", "killed"))
    result = _drive(args, view, lambda report: run_failover(cfg, report))
    if args.json:
        _print_json(result)
        return 0 if result["equal"] else 1
    console = Console()
    rows = [
        (
            str(i + 1),
            "standby" if m["from_standby"] else "client",
            f"{m['pause_s'] * 1e3:,.1f}",
            f"{m['detection_s'] * 1e3:,.1f}",
            f"{m['reconnect_s'] * 1e3:,.1f}",
            f"{m['restore_s'] * 1e3:,.1f}",
            f"{m['replay_s'] * 1e3:,.1f}",
            f"{m['replayed_calls']:,}",
        )
        for i, m in enumerate(result["moves"])
    ]
    title = (
        f"gpuremote bench failover: {result['steps']} MLP steps, proxy killed before steps "
        f"{result['kills_at']}: {result['failovers']} failovers, weights "
        f"{'equal (bitwise)' if result['equal'] else 'DIFFERENT'}"
    )
    cols = ("move", "restored from", "pause ms", "detect ms", "reconnect ms", "restore ms",
            "re-issue ms", "calls")  # fmt: skip
    console.print(result_table(title, cols, rows))
    for i, m in enumerate(result["moves"]):
        console.print(f"move {i + 1}: {m['from']} -> {m['to']} ({m['cause']})")
    sps, ck = result["steps_per_s"], result["checkpoint"]
    console.print(
        f"steps/s without failover {sps['off']:,.0f}, with {sps['on']:,.0f} (medians of "
        f"{len(sps['runs_on'])} runs of {sps['timed_steps']:,} steps each); overhead "
        f"{result['overhead_pct']:+.1f}% (median of the rounds' paired ratios); client CPU "
        f"per step {sps['client_cpu_us_per_step']['off']:,.0f} -> "
        f"{sps['client_cpu_us_per_step']['on']:,.0f} µs; checkpoints every "
        f"{ck['interval_s']:g} s copy {ck['bytes_per_s'] / 1e3:,.1f} kB/s"
    )
    return 0 if result["equal"] else 1


def _load(args: argparse.Namespace) -> int:
    from .load import LoadConfig, run_load

    cfg = LoadConfig(
        **_target(args),
        clients=args.clients,
        ops=args.ops,
        sync_every=args.sync_every,
        procs=args.procs,
        light_period_ms=args.light_period_ms,
    )

    view = _status("gpuremote bench load", ("finished", "clients"))
    result = _drive(args, view, lambda report: run_load(cfg, report))
    if args.json:
        _print_json(result)
        return 0 if result["errors"] == 0 else 1
    mem, light = result["proxy_rss_mb"], result["light_client"]
    row = (
        f"{result['calls_per_s']:,.0f}",
        f"{result['sync_latency_us']['p50']:,.0f}",
        f"{result['p99_us']:,.0f}",
        str(result["errors"]),
        f"{result['verified']}/{result['clients']}",
        _spread(result["per_client_calls_per_s"]),
        "-" if light["p99_us"] is None else f"{light['p50_us']:,.0f} / {light['p99_us']:,.0f}",
        "-" if result["proxy_cpu_s"] is None else f"{result['proxy_cpu_s']:.1f}",
        "-" if mem["before"] is None else f"{mem['before']:.1f}",
        "-" if mem["after"] is None else f"{mem['after']:.1f}",
    )
    columns = (
        "calls/s",
        "sync p50 µs",
        "sync p99 µs",
        "errors",
        "verified",
        "per client calls/s min/med/max",
        "light p50/p99 µs",
        "proxy CPU s",
        "proxy MB before",
        "proxy MB after",
    )
    title = (
        f"gpuremote bench load: {result['clients']} clients x {result['ops']} calls "
        f"in {result['procs']} process(es) over {result['url']}"
    )
    Console().print(result_table(title, columns, [row]))
    if result["pool"] is not None:
        status = {r["url"]: r for r in result["pool"]}
        rows = [
            (
                p["url"],
                str(p["sessions"]),
                f"{p['calls_per_s']:,.0f}",
                "yes" if status.get(p["url"], {}).get("alive") else "no",
                str(status.get(p["url"], {}).get("restarts", "-")),
            )
            for p in result["per_proxy"]
        ]
        cols = ("proxy", "sessions", "calls/s", "alive", "restarts")
        Console().print(result_table("per proxy of the pool", cols, rows))
    for msg in result["error_messages"]:
        Console().print(f"error: {msg}", style="red")
    return 0 if result["errors"] == 0 else 1


def _spread(rates: dict[str, Any]) -> str:
    if rates["min"] is None:
        return "-"
    return f"{rates['min']:,.0f} / {rates['median']:,.0f} / {rates['max']:,.0f}"


def _fuzz(args: argparse.Namespace) -> int:
    from .fuzz import FuzzConfig, run_fuzz

    cfg = FuzzConfig(
        **_target(args),
        seconds=args.seconds,
        seed=args.seed,
        connections=args.connections,
    )

    view = _status(
        "gpuremote bench fuzz", ("connections", "frames", "control_checks", "control_failures")
    )
    result = _drive(args, view, lambda report: run_fuzz(cfg, report))
    ok = result["control_failures"] == 0
    if args.json:
        _print_json(result)
    else:
        Console().print(result)
    return 0 if ok else 1


def _requirements(args: argparse.Namespace) -> int:
    from .requirements import RequirementsConfig, plot, run_requirements

    def floats(text: str | None, default: list[float]) -> list[float]:
        return default if not text else [float(x) for x in text.split(",")]

    quick = args.quick
    if args.transport == "emu+inproc":
        from .requirements import MODES, PAPER_BWS_GBIT, PAPER_RTTS_US

        if args.backend == "numpy":
            args.backend = "sim:a100"
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad:
            raise SystemExit(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
        cfg = RequirementsConfig(
            **_target(args),
            workloads=args.workloads.split(","),
            rtts_us=floats(args.rtts, [2, 20, 100] if quick else PAPER_RTTS_US),
            bws_gbit=floats(args.bws, [10, 200] if quick else PAPER_BWS_GBIT),
            tolerance=args.tolerance,
            quick=quick,
            repeats=args.repeats or (3 if quick else 5),
            modes=modes,
        )
    else:
        cfg = RequirementsConfig(
            **_target(args),
            workloads=args.workloads.split(","),
            rtts_us=floats(args.rtts, [10, 1000] if quick else [10, 100, 1000]),
            bws_gbit=floats(args.bws, [10] if quick else [1, 10, 100]),
            tolerance=args.tolerance,
            quick=quick,
            repeats=1 if quick else args.repeats or 3,
        )
    view = _status("gpuremote bench requirements", ("workload", "done", "total"))
    result = _drive(args, view, lambda report: run_requirements(cfg, report))
    result["plot"] = args.plot if args.plot and plot(result, args.plot) else None
    if args.json:
        _print_json(result)
        return 0
    console = Console()
    columns: tuple[str, ...] = (
        "RTT µs",
        "Gbit/s",
        "mode",
        "measured ms",
        "model ms",
        "slowdown",
        "model error",
    )
    emulated = result.get("transport") == "emu+inproc"
    if emulated:  # the emulator's own error and the CPU other processes took, per point
        columns = (*columns, "emu error", "CPU stolen", "model slowdown")

    def extra(p: dict[str, Any]) -> tuple[str, ...]:
        if not emulated:
            return ()
        return (
            f"{100 * p['emulator_error']:.1f}%",
            f"{100 * p['cpu_stolen']:.0f}%",
            f"{100 * p['predicted_slowdown']:+.0f}%",
        )

    for w in result["workloads"]:
        rows = (
            (
                f"{p['rtt_us']:g}",
                f"{p['bw_gbit']:g}",
                p.get("mode", "optimized" if p["optimized"] else "unoptimized"),
                f"{p['measured_s'] * 1e3:.2f}",
                f"{p['predicted_s'] * 1e3:.2f}",
                f"{100 * p['slowdown']:+.0f}%",
                f"{100 * p['model_error']:+.1f}%",
                *extra(p),
            )
            for p in w["points"]
        )
        console.print(
            result_table(f"{w['name']}: local {w['local_s'] * 1e3:.1f} ms", columns, rows)
        )
        req = w["min_requirement"]
        within = "; ".join(f"{m} {r}" for m, r in req.items())
        console.print(
            f"  within {100 * result['tolerance']:.0f}%: {within}; synchronous round trips "
            f"per step {w['sync_round_trips_per_step']}"
        )
    if result.get("transport") == "emu+inproc":
        console.print(
            f"device {result['device']}; worst model error {100 * result['max_model_error']:.1f}%;"
            f" every point within max(tolerance, the emulator's own error): "
            f"{result['all_within']}; modes not run: {result['modes_skipped'] or 'none'}; "
            f"{result['seconds']:.1f} s"
        )
    if result["plot"]:
        console.print(f"plot written to {result['plot']}")
    return 0


def _emu(args: argparse.Namespace) -> int:
    from .emu import EmuConfig, run_emu

    cfg = EmuConfig(
        **_target(args), rtts=args.rtts.split(","), bws=args.bws.split(","), pings=args.pings
    )
    view = _status("gpuremote bench emu", ("setting", "added_us", "emulated_gbit"))
    result = _drive(args, view, lambda report: run_emu(cfg, report))
    if args.json:
        _print_json(result)
        return 0
    console = Console()
    console.print(
        result_table(
            "emulated round trip (added to the bare path's)",
            ("setting", "added µs", "error µs", "error"),
            (
                (
                    r["setting"],
                    f"{r['added_us']:.1f}",
                    f"{r['error_us']:+.1f}",
                    f"{100 * r['error_rel']:+.1f}%",
                )
                for r in result["rtt"]
            ),
        )
    )
    console.print(
        result_table(
            "emulated bandwidth (from the added transfer time)",
            ("setting", "Gbit/s", "error", "end to end Gbit/s"),
            (
                (
                    r["setting"],
                    f"{r['emulated_gbit']:.3f}",
                    f"{100 * r['error_rel']:+.1f}%",
                    f"{r['end_to_end_gbit']:.3f}",
                )
                for r in result["bandwidth"]
            ),
        )
    )
    return 0
