"""``gpuremote top``: a live view of a proxy's clients, refreshed about once a second.

The collector polls the proxy's admin snapshot on the event loop; ``rates`` turns two
snapshots into per-second figures; ``render`` is a pure function of the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..config import resolve_url
from ..session.connection import open_session
from ..session.pipeline import ClientSession
from ..wire.calls import CALLS_BY_NAME

__all__ = ["fetch", "rates", "render", "run_top"]

_MB = 1e6


async def fetch(session: ClientSession, token: str) -> dict[str, Any]:
    """The proxy's snapshot (an admin call on ``session``: one round trip)."""
    value, _ = await session.call(CALLS_BY_NAME["admin_stats"], 0, [token])
    return dict(value)


def rates(prev: dict[str, Any] | None, cur: dict[str, Any], own: int | None) -> dict[str, Any]:
    """Per-session rates between two snapshots (``own``: the viewer's session, left out)."""
    before = {s["session"]: s for s in prev["sessions"]} if prev else {}
    dt = max(cur["time"] - prev["time"], 1e-6) if prev else None
    rows = []
    for s in cur["sessions"]:
        if s["session"] == own:
            continue
        p = before.get(s["session"])

        def rate(get: Any, s: dict[str, Any] = s, p: dict[str, Any] | None = p) -> float | None:
            return None if p is None or dt is None else (get(s) - get(p)) / dt

        rows.append(
            {
                **s,
                "rate": {
                    "local": rate(lambda x: x["calls"]["local"]),
                    "async": rate(lambda x: x["calls"]["async"]),
                    "sync": rate(lambda x: x["calls"]["sync"]),
                    "frames": rate(lambda x: x["frames_in"] + x["frames_out"]),
                    "mb_in": rate(lambda x: x["bytes_in"] / _MB),
                    "mb_out": rate(lambda x: x["bytes_out"] / _MB),
                },
            }
        )
    return {
        "backend": cur["backend"],
        "uptime_s": cur["uptime_s"],
        "rows": rows,
        "served": cur["sessions_served"],
        "connections": cur.get("connections", {}),
    }


def _f(v: float | None, fmt: str = "{:,.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def _uptime(s: float) -> str:
    h, rem = divmod(int(s), 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}"


def _connections(c: dict[str, Any]) -> str:
    """Connections in the handshake, refused and timed out, where there are any."""
    parts = [
        f"{c[k]} {label}"
        for k, label in (
            ("in_handshake", "connecting"),
            ("refused", "refused"),
            ("handshake_timeouts", "timed out"),
            ("handshake_refused", "cut off in the handshake"),
        )
        if c.get(k)
    ]
    return f"   ({', '.join(parts)})" if parts else ""


def render(view: dict[str, Any], url: str) -> RenderableType:
    """The whole screen: backend header, one row per client, totals."""
    b = view["backend"]
    mem = f", {b['total_memory'] / 2**30:.0f} GiB" if b.get("total_memory") else ""
    head = Text.assemble(
        ("gpuremote top ", "bold"),
        (url, "cyan"),
        f"   backend {b['backend']} on {b['device']}{mem}   up {_uptime(view['uptime_s'])}",
        f"   clients {len(view['rows'])} (served {view['served']})",
        _connections(view.get("connections", {})),
        "   q quits",
    )
    t = Table(expand=True, header_style="bold")
    cols = [
        "session",
        "client",
        "uptime",
        "local/s",
        "async/s",
        "sync/s",
        "frames/s",
        "MB/s in",
        "MB/s out",
        "device MB",
        "queued",
        "sync p50 µs",
        "sync p99 µs",
    ]
    for c in cols:
        t.add_column(c, justify="left" if c == "client" else "right")
    tot: dict[str, float] = {}
    for r in view["rows"]:
        rt, lat = r["rate"], r["sync_latency_us"]
        for k, v in rt.items():
            tot[k] = tot.get(k, 0.0) + (v or 0.0)
        tot["device"] = tot.get("device", 0.0) + r["device_bytes"] / _MB
        tot["queued"] = tot.get("queued", 0.0) + r["queued_calls"]
        t.add_row(
            str(r["session"]),
            r["peer"],
            _uptime(r["uptime_s"]),
            _f(rt["local"]),
            _f(rt["async"]),
            _f(rt["sync"]),
            _f(rt["frames"]),
            _f(rt["mb_in"], "{:,.2f}"),
            _f(rt["mb_out"], "{:,.2f}"),
            f"{r['device_bytes'] / _MB:,.1f}",
            str(r["queued_calls"]),
            _f(lat["p50"], "{:,.1f}"),
            _f(lat["p99"], "{:,.1f}"),
        )
    t.add_section()
    t.add_row(
        "",
        "total",
        "",
        *(_f(tot.get(k)) for k in ("local", "async", "sync", "frames")),
        _f(tot.get("mb_in"), "{:,.2f}"),
        _f(tot.get("mb_out"), "{:,.2f}"),
        _f(tot.get("device"), "{:,.1f}"),
        _f(tot.get("queued")),
        "",
        "",
        style="bold",
    )
    return Group(head, t)


@contextlib.contextmanager
def _keys(pressed: threading.Event) -> Iterator[None]:
    """Watch the terminal for 'q' (cbreak mode, restored on exit)."""
    if not sys.stdin.isatty():
        yield
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def watch() -> None:
        while not pressed.is_set():
            ch = os.read(fd, 1)
            if ch in (b"q", b"Q", b"\x03", b""):
                pressed.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def run_top(
    url: str | None, token: str, *, interval: float = 1.0, once: bool = False, as_json: bool = False
) -> int:
    """Show the live view until 'q' (or print one snapshot with ``once``)."""
    import json

    from rich.console import Console
    from rich.live import Live

    target = resolve_url(url)
    session, info = await open_session(target)
    try:
        own = info.get("session")
        if once:
            first = await fetch(session, token)
            await asyncio.sleep(min(interval, 1.0))
            snap = await fetch(session, token)
            view = rates(first, snap, own)
            if as_json:
                print(
                    json.dumps(
                        {**snap, "rates": {r["session"]: r["rate"] for r in view["rows"]}}, indent=2
                    )
                )
            else:
                Console().print(render(view, target))
            return 0
        quit_ = threading.Event()
        prev = None
        with _keys(quit_), Live(auto_refresh=False, screen=False) as live:
            while not quit_.is_set():
                snap = await fetch(session, token)
                live.update(render(rates(prev, snap, own), target), refresh=True)
                prev = snap
                for _ in range(max(1, int(interval / 0.05))):
                    if quit_.is_set():
                        break
                    await asyncio.sleep(0.05)
    finally:
        await session.aclose()
    return 0


async def run_top_pool(
    name: str,
    *,
    address: str | None = None,
    interval: float = 1.0,
    once: bool = False,
    as_json: bool = False,
) -> int:
    """``gpuremote top --url pool://NAME``: every proxy of a pool, one view each (the pool's
    secret and admin token come through Ray)."""
    import json

    from rich.console import Console
    from rich.live import Live

    from ..pool import get_pool

    pool = get_pool(name, address=address)
    secret, token = pool.credentials()
    urls = pool.urls()
    opened = [await open_session(u, secret=secret) for u in urls]
    sessions = [session for session, _ in opened]
    try:
        owns = [info.get("session") for _, info in opened]

        async def snaps() -> list[dict[str, Any]]:
            return list(await asyncio.gather(*(fetch(g, token) for g in sessions)))

        def screen(prev: list[dict[str, Any]] | None, cur: list[dict[str, Any]]) -> Group:
            views = [
                render(rates(prev[i] if prev else None, s, owns[i]), urls[i])
                for i, s in enumerate(cur)
            ]
            return Group(Text(f"pool://{name}: {len(urls)} proxies", style="bold"), *views)

        if once:
            first = await snaps()
            await asyncio.sleep(min(interval, 1.0))
            cur = await snaps()
            if as_json:
                proxies = []
                for i, s in enumerate(cur):
                    view = rates(first[i], s, owns[i])
                    rate = {r["session"]: r["rate"] for r in view["rows"]}
                    proxies.append({"url": urls[i], **s, "rates": rate})
                print(json.dumps({"pool": name, "proxies": proxies}, indent=2))
            else:
                Console().print(screen(first, cur))
            return 0
        quit_ = threading.Event()
        prev = None
        with _keys(quit_), Live(auto_refresh=False, screen=False) as live:
            while not quit_.is_set():
                cur = await snaps()
                live.update(screen(prev, cur), refresh=True)
                prev = cur
                for _ in range(max(1, int(interval / 0.05))):
                    if quit_.is_set():
                        break
                    await asyncio.sleep(0.05)
        return 0
    finally:
        for g in sessions:
            await g.aclose()
