"""``gpuremote pool start|status|stop``: a pool of proxies on Ray, from a shell."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from ..errors import GpuRemoteError

__all__ = ["render_status", "run_pool_command"]


def _attach(args: argparse.Namespace, start_if_missing: bool) -> Any:
    from ..pool import PoolError, attach

    try:
        return attach(args.address)
    except PoolError:
        if not start_if_missing or args.address:
            raise
    # no cluster on this machine: start one that outlives this command, as `ray start` does
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--disable-usage-stats"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise GpuRemoteError(f"could not start a local Ray cluster: {proc.stderr.strip()}")
    print("started a local Ray cluster (stop it with `ray stop`)", file=sys.stderr)
    return attach("auto")


def render_status(name: str, rows: list[dict[str, Any]]) -> Table:
    """The pool's status as a table."""
    t = Table(title=f"pool://{name}", header_style="bold")
    for col in ("#", "url", "node", "alive", "sessions", "device MB", "calls/s", "restarts"):
        t.add_column(col, justify="left" if col in ("url", "node") else "right", no_wrap=True)
    for r in rows:
        t.add_row(
            str(r["index"]),
            r["url"] or "-",
            (r["node"] or "-")[:12],
            "yes" if r["alive"] else "[red]no[/red]",
            str(r["sessions"]),
            f"{r['device_bytes'] / 2**20:,.1f}",
            f"{r['calls_per_s']:,.0f}",
            str(r["restarts"]),
        )
    return t


def run_pool_command(args: argparse.Namespace) -> int:
    from ..pool import get_pool, start_pool

    console = Console() if sys.stdout.isatty() else Console(width=160)  # no wrapped URLs
    if args.pool_command == "start":
        _attach(args, start_if_missing=True)
        pool = start_pool(
            args.proxies,
            name=args.name,
            num_gpus=args.num_gpus,
            backend=args.backend,
            transport=args.transport,
        )
        console.print(render_status(args.name, pool.status()))
        print(
            f"pool://{args.name}: {args.proxies} proxies; connect from a process attached to "
            "this Ray cluster"
        )
        return 0
    _attach(args, start_if_missing=False)
    pool = get_pool(args.name)
    if args.pool_command == "stop":
        pool.stop()
        print(f"pool://{args.name}: stopped")
        return 0
    if args.json:
        print(json.dumps({"pool": args.name, "proxies": pool.status()}, indent=2))
        return 0
    if not args.watch:
        console.print(render_status(args.name, pool.status()))
        return 0
    with Live(render_status(args.name, pool.status()), auto_refresh=False) as live:
        try:
            while True:
                time.sleep(args.interval)
                live.update(render_status(args.name, pool.status()), refresh=True)
        except KeyboardInterrupt:
            pass
    return 0
