"""``gpuremote bench flood``: many connections that never complete the handshake.

Starts a proxy process with ``--handshake-timeout``, opens ``connections`` TCP connections
that read the greeting and then say nothing, and reports the proxy's RSS before, with them
open, and after the deadline closed them (per connection: the growth divided by their
number); how many the proxy closed by the deadline; and the latency of a real client's
synchronous op made while the flood is open.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gpuremote.transports import Address

import gpuremote
from gpuremote.proxy import raise_open_files_limit
from gpuremote.proxy.heap import rss_bytes
from gpuremote.tools.proxyprocess import LocalProxy

__all__ = ["FloodConfig", "run_flood"]


@dataclass
class FloodConfig:
    """``bench flood``: ``rounds`` floods of ``connections`` that never complete the handshake."""

    connections: int = 1000
    handshake_timeout_s: float = 3.0
    backend: str = "numpy"
    rounds: int = 2  # floods one after the other: a leak grows with each, a high-water mark not


async def _idle_connection(
    host: str, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    await reader.read(1)  # the greeting has started: the proxy holds a session for it
    return reader, writer


async def _wait_closed(reader: asyncio.StreamReader, timeout: float) -> bool:
    """Whether the proxy closed the connection (EOF) within ``timeout``."""
    try:
        while await asyncio.wait_for(reader.read(65536), timeout):
            pass
        return True
    except (TimeoutError, ConnectionError):
        return False


async def run_flood(
    cfg: FloodConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    """Run the flood; returns the JSON result."""
    raise_open_files_limit(cfg.connections + 256)
    local = LocalProxy(
        "tcp",
        cfg.backend,
        extra_args=("--quiet", "--handshake-timeout", str(cfg.handshake_timeout_s)),
    )
    url = await asyncio.to_thread(local.start)
    address = Address.parse(url)
    pid = local.pid
    try:
        async with gpuremote.connect(url) as gpu:  # a real client, there from the start
            x = gpu.asarray(np.ones(16, np.float32))
            await (x + x).get()
            await asyncio.sleep(0.2)
            rss_before = rss_bytes(pid)
            rounds = []
            for _ in range(cfg.rounds):
                rounds.append(await _one_flood(cfg, address, pid, x, url))
            rss_after = rss_bytes(pid)
            await (x + x).get()  # the real client is still served
    finally:
        await asyncio.to_thread(local.stop)
    first = rounds[0]
    n = max(cfg.connections, 1)
    return {
        "bench": "flood",
        "connections": cfg.connections,
        "handshake_timeout_s": cfg.handshake_timeout_s,
        "opened_s": first["opened_s"],
        "closed_by_proxy": first["closed"],
        "rss_before_bytes": rss_before,
        "rss_open_bytes": first["rss_open"],
        "rss_after_bytes": first["rss_after"],
        "rss_per_connection_bytes": (first["rss_open"] - rss_before) / n,
        "rss_after_ratio": first["rss_after"] / rss_before if rss_before else None,
        "client_op_p50_ms": first["op_p50_ms"],
        "client_op_max_ms": first["op_max_ms"],
        "late_client_first_op_ms": first["late_ms"],
        "rounds": rounds,
        "rss_end_ratio": rss_after / rss_before if rss_before else None,
    }


async def _one_flood(
    cfg: FloodConfig, address: Address, pid: int, x: Any, url: str
) -> dict[str, Any]:
    """One flood: open the silent connections, use the proxy meanwhile, wait for the
    deadline to close them all."""
    t0 = time.perf_counter()
    conns = []
    for _ in range(cfg.connections):
        conns.append(await _idle_connection(address.host, address.port or 0))
    opened_s = time.perf_counter() - t0
    await asyncio.sleep(0.2)
    rss_open = rss_bytes(pid)
    lat = []
    for _ in range(20):  # a real client's op while the flood is open
        t1 = time.perf_counter()
        await (x + x).get()
        lat.append(time.perf_counter() - t1)
    async with gpuremote.connect(url) as late:  # and one that connects in the middle
        t1 = time.perf_counter()
        await (late.asarray(np.ones(4, np.float32)) * 2.0).get()
        late_s = time.perf_counter() - t1
    wait = cfg.handshake_timeout_s + 5.0 - (time.perf_counter() - t0)
    closed = await asyncio.gather(*(_wait_closed(r, max(wait, 1.0)) for r, _ in conns))
    for _, w in conns:
        w.close()
        with contextlib.suppress(Exception):
            await w.wait_closed()
    await asyncio.sleep(0.5)
    return {
        "opened_s": opened_s,
        "closed": int(sum(closed)),
        "rss_open": rss_open,
        "rss_after": rss_bytes(pid),
        "op_p50_ms": float(np.percentile(lat, 50)) * 1e3,
        "op_max_ms": max(lat) * 1e3,
        "late_ms": late_s * 1e3,
    }
