"""What the benches show: their live views (rich renderables, pure functions of immutable
snapshots of a bench's state) and the summaries their commands print at the end (``*_summary``:
a result onto a console), all in one place."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from rich.console import Console, Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .stats import KEYS

__all__ = [
    "api_summary",
    "api_view",
    "emu_summary",
    "failover_summary",
    "flood_summary",
    "fuzz_summary",
    "histogram",
    "load_summary",
    "ops_summary",
    "ops_view",
    "peer_summary",
    "ping_summary",
    "ping_view",
    "requirements_summary",
    "result_table",
    "sparkline",
    "stats_table",
    "status_line",
    "tenants_summary",
    "tenants_view",
    "throughput_compare_summary",
    "throughput_summary",
    "throughput_view",
]

_BLOCKS = " ▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """Values as a row of block characters (the latest ``width`` values)."""
    vals = np.asarray(values[-width:], dtype=np.float64)
    if vals.size == 0:
        return ""
    lo, hi = float(vals.min()), float(vals.max())
    span = hi - lo or 1.0
    return "".join(_BLOCKS[1 + int((v - lo) / span * 7.999)] for v in vals)


def histogram(samples_us: np.ndarray, bins: int = 12, width: int = 40) -> Table:
    """A latency histogram (log-spaced bins) as a table of bars."""
    t = Table.grid(padding=(0, 1))
    t.add_column(justify="right", style="cyan")
    t.add_column()
    t.add_column(justify="right", style="dim")
    if samples_us.size == 0:
        return t
    lo, hi = max(float(samples_us.min()), 0.1), float(np.percentile(samples_us, 99.9))
    edges = np.geomspace(lo, max(hi, lo * 1.01), bins + 1)
    counts, _ = np.histogram(np.clip(samples_us, lo, edges[-1]), edges)
    top = max(int(counts.max()), 1)
    for left, n in zip(edges[:-1], counts, strict=True):
        t.add_row(f"{left:8.1f} µs", "█" * round(n / top * width), str(int(n)))
    return t


def stats_table(rows: Mapping[str, dict[str, float] | None], ratios: Mapping[str, Any]) -> Table:
    """Round-trip percentiles per path (µs), with each path's p50 ratio."""
    t = Table(title="round trip, µs", title_justify="left")
    t.add_column("path")
    for k in KEYS:
        t.add_column(k, justify="right")
    t.add_column("p50 ratio", justify="right")
    for name, st in rows.items():
        if st is None:
            continue
        r = ratios.get(name)
        t.add_row(name, *(f"{st[k]:.1f}" for k in KEYS), "" if r is None else f"{r:.2f}x")
    return t


def ping_view(state: dict[str, Any]) -> RenderableType:
    """The live ping view: progress, percentiles per path, sparkline, histogram."""
    done, total = state["done"], state["total"]
    parts: list[RenderableType] = [
        Text(
            f"gpuremote bench ping: {state['url']} ({state['transport']}), "
            f"{state['size']} B messages",
            style="bold",
        ),
        ProgressBar(total=max(total, 1), completed=done, width=60),
        Text(f"{done}/{total} round trips", style="dim"),
        stats_table(state["stats"], state.get("ratios", {})),
    ]
    recent = state.get("recent_us")
    if recent is not None and len(recent):
        parts.append(
            Text("recent gpuremote round trips: " + sparkline(list(recent)), style="green")
        )
        parts.append(histogram(np.asarray(recent)))
    return Group(*parts)


def throughput_view(state: dict[str, Any]) -> RenderableType:
    """The live throughput view: progress, a row and a bar per size and direction."""
    t = Table(
        title=f"gpuremote bench throughput: {state['url']} ({state['transport']})",
        title_justify="left",
    )
    for col in ("size", "dir", "GB/s", "Gbit/s", "baseline GB/s", "ratio", ""):
        t.add_column(col, justify="right" if col not in ("dir", "") else "left")
    peak = max(
        [r["gbps"] for r in state["results"]]
        + [r["baseline_gbps"] or 0 for r in state["results"]]
        + [1e-9]
    )
    for r in state["results"]:
        bar = "█" * max(1, round(r["gbps"] / peak * 30))
        base = r["baseline_gbps"]
        t.add_row(
            _size(r["size"]),
            r["direction"],
            f"{r['gbps']:.3f}",
            f"{r['gbps'] * 8:.2f}",
            "-" if base is None else f"{base:.3f}",
            "-" if r["ratio"] is None else f"{r['ratio']:.2f}x",
            Text(bar, style="green"),
        )
    return Group(
        ProgressBar(total=max(state["total"], 1), completed=state["done"], width=60),
        Text(state.get("current", ""), style="dim"),
        t,
    )


def result_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]]) -> Table:
    """A titled table of right-aligned columns: the plain summary of a bench."""
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, justify="right")
    for row in rows:
        t.add_row(*row)
    return t


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _or_dash(v: float | None, fmt: str = ",.1f") -> str:
    """``v`` formatted, or "-" where it is missing."""
    return "-" if v is None else format(v, fmt)


def _with_quartiles(v: float | None, quartiles: list[float] | None) -> str:
    """``v`` with its quartiles after it ("12.3 (11.8 to 13.0)"), or "-" where it is
    missing."""
    if v is None:
        return "-"
    if not quartiles:
        return f"{v:.1f}"
    return f"{v:.1f} ({quartiles[0]:.1f} to {quartiles[1]:.1f})"


def _shifted(quartiles: list[float] | None, by: float) -> list[float] | None:
    return None if quartiles is None else [q + by for q in quartiles]


def torch_ops_view(state: dict[str, Any]) -> RenderableType:
    """``bench ops --workload``: each PyTorch workload's step, remote beside local (and, for
    ``--workload ops``, the single ops' CPU: local, the client's, the proxy's beyond the op)."""
    steps = _torch_steps_table(state)
    ops = state.get("ops")
    if not ops:
        return steps
    table = result_table(
        "gpuremote bench ops: one PyTorch op on 16 floats, CPU per op "
        "(median of the rounds; their quartiles)",
        ("op", "local µs", "client µs", "proxy µs beyond the op"),
        [
            (
                o["op"],
                _with_quartiles(o["local_cpu_us"], o.get("local_cpu_us_quartiles")),
                _with_quartiles(o["client_cpu_us"], o.get("client_cpu_us_quartiles")),
                _with_quartiles(
                    o.get("proxy_beyond_op_us"),
                    _shifted(o.get("proxy_cpu_us_quartiles"), -o["local_cpu_us"]),
                ),
            )
            for o in ops
        ],
    )
    return Group(table, steps) if state["workloads"] else table


def _torch_steps_table(state: dict[str, Any]) -> RenderableType:
    return result_table(
        f"gpuremote bench ops: PyTorch training steps ({state['size']} sizes), "
        f"{state['url']} ({state['transport']})",
        (
            "workload",
            "local ms",
            "remote ms",
            "ratio",
            "client CPU ms",
            "proxy CPU ms",
            "calls",
            "CPU µs/call",
            "frames",
            "round trips",
        ),
        [
            (
                w["name"] if w.get("mode", "eager") == "eager" else f"{w['name']} (compiled)",
                _or_dash(w["local_step_ms"], ".1f"),
                _or_dash(w["remote_step_ms"], ".1f"),
                f"{_or_dash(w['remote_over_local'], '.2f')}x",
                _or_dash(w["client_cpu_ms"], ".1f"),
                _or_dash(w["proxy_cpu_ms"], ".1f"),
                f"{w['calls_per_step']:.0f}",
                _or_dash(w["client_cpu_per_call_us"], ".1f"),
                f"{w['frames_per_step']:.1f}",
                f"{w['round_trips_per_step']:.1f}",
            )
            for w in state["workloads"]
        ],
    )


def ops_view(state: dict[str, Any]) -> RenderableType:
    """``bench ops``: each case beside the bare echo (per operation), as the rounds come in."""
    if "workloads" in state:
        return torch_ops_view(state)
    rows = []
    echo = state.get("echo")
    if echo is not None:
        rows.append(("echo (floor)", echo, "", ""))
    for c in state["cases"]:
        extra = ""
        if "ops_per_s" in c:
            extra = f"{c['ops_per_s']:,.0f} ops/s"
        if c.get("ops_per_step") is not None:
            extra = (
                f"{c['ops_per_step']} ops, local {_or_dash(c['local_us'])} µs, overhead "
                f"{_or_dash(c['overhead_us'])} µs, {c['frames_per_step']:.2f} frames/step"
            )
        elif c.get("slowdown") is not None:
            extra = f"local {_or_dash(c['local_wall_p50_us'])} µs, slowdown {c['slowdown']:.2f}x"
        ratios = f"{_or_dash(c['ratio_wall_p50'], '.2f')}x / {_or_dash(c['ratio_cpu'], '.2f')}x"
        rows.append((c["name"], c, ratios, extra))
    pin = (state.get("placement") or {}).get("pin", "none")
    table = result_table(
        f"gpuremote bench ops: {state['url']} ({state['transport']}), "
        f"round {state['rounds']}/{state['of_rounds']}"
        + (f", pinned {pin}" if pin != "none" else ""),
        (
            "case",
            "wall p50 µs",
            "wall p99 µs",
            "client CPU µs",
            "proxy CPU µs",
            "vs echo: wall / CPU",
            "",
        ),
        (
            (
                name,
                _or_dash(r["wall_p50_us"]),
                _or_dash(r["wall_p99_us"]),
                _or_dash(r["client_cpu_us"]),
                _or_dash(r["proxy_cpu_us"]),
                ratios,
                extra,
            )
            for name, r, ratios, extra in rows
        ),
    )
    note = state.get("baseline_note")
    return Group(table, Text(note, style="yellow")) if note else table


def tenants_view(state: dict[str, Any]) -> RenderableType:
    """``bench tenants``: the light client alone and beside the heavy one."""
    alone, beside = state.get("light_alone") or {}, state.get("light_beside") or {}
    return result_table(
        f"gpuremote bench tenants: {state['url']} ({state['backend']}), "
        f"{state.get('phase', 'done')}",
        ("", "light p50 ms", "light p99 ms", "light max ms", "heavy loops/s"),
        [
            (
                label,
                *(_or_dash(light.get(key), ".2f") for key in ("p50_ms", "p99_ms", "max_ms")),
                _or_dash(state.get(f"heavy_{phase}_loops_per_s"), ".2f"),
            )
            for label, phase, light in (("alone", "alone", alone), ("together", "beside", beside))
        ],
    )


def status_line(prefix: str, keys: tuple[str, ...]) -> Callable[[dict[str, Any]], RenderableType]:
    """A one-line live view of a bench's progress: ``prefix``, then the state's ``keys``."""

    def view(state: dict[str, Any]) -> RenderableType:
        return Text(f"{prefix}: " + "  ".join(f"{k} {state[k]}" for k in keys if k in state))

    return view


def api_view(state: dict[str, Any]) -> RenderableType:
    """``bench api`` live: the round, and the calls per second of its last mode."""
    return Text(
        f"gpuremote bench api: {state['url']}  round {state['round']}/"
        f"{state['rounds']}  {state['mode']}: {state['rate']:,.0f} calls/s"
    )


# -- the summaries a bench command prints at the end (without --json) --------------------------


def ping_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench ping``: the percentiles per path (where no live view showed them), the ratios."""
    if not console.is_terminal:
        stats = {"gpuremote": result["rtt_us"], **result["baselines"]}
        ratios = {k: (stats["gpuremote"]["p50"] / s["p50"]) for k, s in stats.items()}
        console.print(
            f"gpuremote bench ping: {result['url']} ({result['transport']}), "
            f"{result['size']} B, {result['count']} round trips per path"
        )
        console.print(stats_table(stats, ratios))
    if result["ratio_p50"] is not None:
        console.print(
            f"gpuremote / asyncio echo p50: {result['ratio_p50']:.2f}x; "
            f"gpuremote / blocking-socket echo p50: {result['ratio_p50_blocking']:.2f}x"
        )


def throughput_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench throughput``: the sweep (where no live view showed it), the peak memory."""
    if not console.is_terminal:
        console.print(throughput_view({**result, "done": 1, "total": 1, "current": ""}))
    peak = result["peak_rss_mb"]
    proxy = "n/a" if peak["proxy"] is None else f"{peak['proxy']:.0f} MB"
    console.print(
        f"peak memory during a {peak['payload_mb']:.0f} MB upload and download: "
        f"client {peak['client']:.0f} MB, proxy {proxy}"
    )


def throughput_compare_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench throughput --compare``: each transport's rows, against its own bare baseline
    and against the first transport."""
    versus = {
        (v["transport"], v["size"], v["direction"]): v["ratio"] for v in result["versus_first"]
    }
    by = {(r["transport"], r["size"], r["direction"]): r for r in result["results"]}
    rows = [
        (
            t,
            direction,
            f"{size:,}",
            f"{r['gbps']:.2f}",
            _or_dash(r["ratio"], ".2f"),
            _or_dash(versus.get((t, size, direction)), ".2f"),
        )
        for (t, size, direction), r in by.items()
    ]
    cols = ("transport", "direction", "bytes", "GB/s", "x own bare", f"x {result['compare'][0]}")
    console.print(result_table("gpuremote bench throughput --compare", cols, rows))


def api_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench api``: calls per second and round trips per call of each mode, and their ratio."""
    rows = (
        (
            mode,
            f"{result[key + '_calls_per_s']:,.0f}",
            f"{result['round_trips_per_call'][key]:.4f}",
        )
        for mode, key in (("synchronous", "sync"), ("pipelined", "pipelined"))
    )
    title = f"gpuremote bench api: {result['calls']} launches over {result['url']}"
    console.print(result_table(title, ("mode", "calls/s", "round trips per call"), rows))
    console.print(f"pipelined / synchronous: {result['ratio']:.1f}x")


def ops_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench ops``: the cases (where no live view showed them)."""
    if not console.is_terminal:
        console.print(ops_view(result))


def tenants_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench tenants``: the light client alone and beside the heavy one."""
    console.print(tenants_view(result))


def flood_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench flood``: every figure of the result."""
    table = Table(title="gpuremote bench flood")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k, v in result.items():
        if k not in ("bench", "rounds"):
            table.add_row(k, f"{v:,.2f}" if isinstance(v, float) else str(v))
    console.print(table)


def fuzz_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench fuzz``: the result as it is."""
    console.print(result)


def peer_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench peer``: proxy to proxy against through the client."""
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
    console.print(result_table(title, cols, rows))
    console.print(
        f"through the client / proxy to proxy: {result['through_client_over_direct']:.2f}x"
    )


def allreduce_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench allreduce``: the proxies' all-reduce beside bare Gloo's, per group and size."""
    rows = [
        (
            str(r["ranks"]),
            _size_label(r["bytes"]),
            f"{r['remote']['median_s'] * 1e3:,.3f}",
            f"{r['bare']['median_s'] * 1e3:,.3f}",
            f"{r['remote']['busbw_gb_per_s']:,.3f}",
            f"{r['bare']['busbw_gb_per_s']:,.3f}",
            f"{r['remote_over_bare_bandwidth']:.2f}",
            f"{r['remote']['client_bytes_per_op']:,.0f}",
        )
        for r in result["rows"]
    ]
    title = (
        f"gpuremote bench allreduce: {result['iters']} all-reduces per timing, median of "
        f"{result['rounds']} ({result['proxies']})"
    )
    cols = (
        "ranks",
        "size",
        "proxies ms",
        "bare gloo ms",
        "proxies busbw GB/s",
        "bare busbw GB/s",
        "proxies / bare",
        "client bytes/op",
    )
    console.print(result_table(title, cols, rows))
    if result.get("ddp"):
        steps = [
            (
                d["workload"],
                str(d["ranks"]),
                f"{d['median_step_s'] * 1e3:,.1f}",
                f"{d['client_bytes_per_step']:,.0f}",
                f"{d['gradient_bytes']:,}",
            )
            for d in result["ddp"]
        ]
        heads = ("workload", "ranks", "step ms (median)", "client bytes/step", "gradient bytes")
        console.print(result_table("DDP training steps (each rank's client)", heads, steps))


def _size_label(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


#: ``bench failover``'s columns of a move: (heading, key) of its times, in ms
_MOVE_TIMES = (
    ("pause ms", "pause_s"),
    ("detect ms", "detection_s"),
    ("reconnect ms", "reconnect_s"),
    ("restore ms", "restore_s"),
    ("re-issue ms", "replay_s"),
)


def failover_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench failover``: each move and its pause, broken down; the cost of failover."""
    rows = [
        (
            str(i + 1),
            "standby" if m["from_standby"] else "client",
            *(f"{m[key] * 1e3:,.1f}" for _, key in _MOVE_TIMES),
            f"{m['replayed_calls']:,}",
        )
        for i, m in enumerate(result["moves"])
    ]
    title = (
        f"gpuremote bench failover: {result['steps']} MLP steps, proxy killed before steps "
        f"{result['kills_at']}: {result['failovers']} failovers, weights "
        f"{'equal (bitwise)' if result['equal'] else 'DIFFERENT'}"
    )
    cols = ("move", "restored from", *(heading for heading, _ in _MOVE_TIMES), "calls")
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


_LOAD_COLUMNS = (
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


def load_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench load``: the load's figures, each proxy's where a pool served it, the errors."""
    mem, light = result["proxy_rss_mb"], result["light_client"]
    row = (
        f"{result['calls_per_s']:,.0f}",
        f"{result['sync_latency_us']['p50']:,.0f}",
        f"{result['p99_us']:,.0f}",
        str(result["errors"]),
        f"{result['verified']}/{result['clients']}",
        _spread(result["per_client_calls_per_s"]),
        "-" if light["p99_us"] is None else f"{light['p50_us']:,.0f} / {light['p99_us']:,.0f}",
        _or_dash(result["proxy_cpu_s"], ".1f"),
        _or_dash(mem["before"], ".1f"),
        _or_dash(mem["after"], ".1f"),
    )
    title = (
        f"gpuremote bench load: {result['clients']} clients x {result['ops']} calls "
        f"in {result['procs']} process(es) over {result['url']}"
    )
    console.print(result_table(title, _LOAD_COLUMNS, [row]))
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
        console.print(result_table("per proxy of the pool", cols, rows))
    for msg in result["error_messages"]:
        console.print(f"error: {msg}", style="red")


def _spread(rates: dict[str, Any]) -> str:
    """min / median / max of per-client rates, or "-" where there are none."""
    if rates["min"] is None:
        return "-"
    return f"{rates['min']:,.0f} / {rates['median']:,.0f} / {rates['max']:,.0f}"


_REQUIREMENTS_COLUMNS = (
    "RTT µs",
    "Gbit/s",
    "mode",
    "measured ms",
    "model ms",
    "slowdown",
    "model error",
)
#: over emu+inproc, per point: the emulator's own error, the CPU other processes took, and the
#: model's slowdown
_EMULATED_COLUMNS = ("emu error", "CPU stolen", "model slowdown")


def _requirements_row(p: dict[str, Any], emulated: bool) -> tuple[str, ...]:
    """One point of ``bench requirements`` (``_REQUIREMENTS_COLUMNS``, and over emu+inproc
    ``_EMULATED_COLUMNS``)."""
    row = (
        f"{p['rtt_us']:g}",
        f"{p['bw_gbit']:g}",
        p.get("mode", "optimized" if p["optimized"] else "unoptimized"),
        f"{p['measured_s'] * 1e3:.2f}",
        f"{p['predicted_s'] * 1e3:.2f}",
        f"{100 * p['slowdown']:+.0f}%",
        f"{100 * p['model_error']:+.1f}%",
    )
    if not emulated:
        return row
    return (
        *row,
        f"{100 * p['emulator_error']:.1f}%",
        f"{100 * p['cpu_stolen']:.0f}%",
        f"{100 * p['predicted_slowdown']:+.0f}%",
    )


def requirements_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench requirements``: per workload, each point measured and modelled and what the
    workload needs; over emu+inproc, how far the model and the emulator can be trusted."""
    emulated = result.get("transport") == "emu+inproc"
    columns = (*_REQUIREMENTS_COLUMNS, *(_EMULATED_COLUMNS if emulated else ()))
    for w in result["workloads"]:
        rows = (_requirements_row(p, emulated) for p in w["points"])
        title = f"{w['name']}: local {w['local_s'] * 1e3:.1f} ms" + (
            f" ({w['local_baseline']}; "
            + ", ".join(
                f"{k} {v['local_s'] * 1e3:.1f} ms"
                for k, v in w["local_baselines"].items()
                if k != w["local_baseline"]
            )
            + ")"
            if w.get("local_baselines")
            else ""
        )
        console.print(result_table(title, columns, rows))
        within = "; ".join(f"{m} {r}" for m, r in w["min_requirement"].items())
        console.print(
            f"  within {100 * result['tolerance']:.0f}%: {within}; synchronous round trips "
            f"per step {w['sync_round_trips_per_step']}"
        )
    if emulated:
        console.print(
            f"device {result['device']}; worst model error {100 * result['max_model_error']:.1f}%;"
            f" every point within max(tolerance, the emulator's own error): "
            f"{result['all_within']}; modes not run: {result['modes_skipped'] or 'none'}; "
            f"{result['seconds']:.1f} s"
        )
    if result["plot"]:
        console.print(f"plot written to {result['plot']}")


#: a row's figures from one record of a result
_Figures = Callable[[dict[str, Any]], tuple[str, ...]]
#: ``bench emu``'s tables: (title, columns, the result's key of their records, a record's
#: figures beside its setting)
_EMU_TABLES: tuple[tuple[str, tuple[str, ...], str, _Figures], ...] = (
    (
        "emulated round trip (added to the bare path's)",
        ("setting", "added µs", "error µs", "error"),
        "rtt",
        lambda r: (
            f"{r['added_us']:.1f}",
            f"{r['error_us']:+.1f}",
            f"{100 * r['error_rel']:+.1f}%",
        ),
    ),
    (
        "emulated bandwidth (from the added transfer time)",
        ("setting", "Gbit/s", "error", "end to end Gbit/s"),
        "bandwidth",
        lambda r: (
            f"{r['emulated_gbit']:.3f}",
            f"{100 * r['error_rel']:+.1f}%",
            f"{r['end_to_end_gbit']:.3f}",
        ),
    ),
)


def emu_summary(console: Console, result: dict[str, Any]) -> None:
    """``bench emu``: how close the emulated round trips and bandwidths came to their
    settings."""
    for title, columns, key, figures in _EMU_TABLES:
        rows = ((r["setting"], *figures(r)) for r in result[key])
        console.print(result_table(title, columns, rows))
