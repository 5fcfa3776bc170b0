"""Rich renderables of the benches' state: pure functions of immutable snapshots."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .stats import KEYS

__all__ = [
    "histogram",
    "ops_view",
    "ping_view",
    "result_table",
    "sparkline",
    "stats_table",
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


def _us(v: float | None, fmt: str = ",.1f") -> str:
    return "-" if v is None else format(v, fmt)


def ops_view(state: dict[str, Any]) -> RenderableType:
    """``bench ops``: each case beside the bare echo (per operation), as the rounds come in."""
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
                f"{c['ops_per_step']} ops, local {_us(c['local_us'])} µs, overhead "
                f"{_us(c['overhead_us'])} µs, {c['frames_per_step']:.2f} frames/step"
            )
        elif c.get("slowdown") is not None:
            extra = f"local {_us(c['local_wall_p50_us'])} µs, slowdown {c['slowdown']:.2f}x"
        ratios = f"{_us(c['ratio_wall_p50'], '.2f')}x / {_us(c['ratio_cpu'], '.2f')}x"
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
                _us(r["wall_p50_us"]),
                _us(r["wall_p99_us"]),
                _us(r["client_cpu_us"]),
                _us(r["proxy_cpu_us"]),
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

    def ms(row: dict[str, Any], key: str) -> str:
        v = row.get(key)
        return "-" if v is None else f"{v:.2f}"

    def rate(key: str) -> str:
        v = state.get(key)
        return "-" if v is None else f"{v:.2f}"

    return result_table(
        f"gpuremote bench tenants: {state['url']} ({state['backend']}), "
        f"{state.get('phase', 'done')}",
        ("", "light p50 ms", "light p99 ms", "light max ms", "heavy loops/s"),
        [
            (
                "alone",
                ms(alone, "p50_ms"),
                ms(alone, "p99_ms"),
                ms(alone, "max_ms"),
                rate("heavy_alone_loops_per_s"),
            ),
            (
                "together",
                ms(beside, "p50_ms"),
                ms(beside, "p99_ms"),
                ms(beside, "max_ms"),
                rate("heavy_beside_loops_per_s"),
            ),
        ],
    )
