"""``gpuremote bench peer``: ``x.to_device(other)`` proxy to proxy, beside through the client.

Two proxies (two of a pool with ``--url pool://NAME``, else two started here, sharing a
secret); an array of ``mib`` MiB on the first. A B A B, ``rounds`` times each: ``x.to_device(d2)``
(the proxies copy it between themselves) and the path through the client
(``xp.asarray(np.asarray(x), device=d2)``: download, then upload). Each round starts from a new
array on the first proxy (no host copy to reuse) and ends when the second has the data.
Reported per path: median and min seconds, GB/s, and the bytes the client sent and received.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["PeerConfig", "run_peer"]


@dataclass
class PeerConfig:
    """``bench peer``: an array of ``mib`` MiB copied proxy to proxy and through the client,
    ``rounds`` times each."""

    url: str | None = None  # pool://NAME, else two local proxies
    backend: str = "numpy"
    mib: int = 64
    rounds: int = 5


@contextlib.contextmanager
def _two_devices(cfg: PeerConfig) -> Iterator[tuple[Any, Any]]:
    import gpuremote.xp as xp
    from gpuremote.tools.proxyprocess import LocalProxy

    if cfg.url:
        d1, d2 = xp.connect(cfg.url, devices=2)
        try:
            yield d1, d2
        finally:
            d1.close()
            d2.close()
        return
    secret = os.urandom(16).hex()
    with tempfile.NamedTemporaryFile("w", suffix=".secret") as f:
        f.write(secret)
        f.flush()
        extra = ("--secret-file", f.name, "--quiet")
        with LocalProxy("tcp", cfg.backend, extra_args=extra) as p1:
            peer = ("--peer", p1.url)  # the second proxy may read from the first
            with (
                LocalProxy("tcp", cfg.backend, extra_args=extra + peer) as p2,
                xp.Device(p1.url, secret=secret) as d1,
                xp.Device(p2.url, secret=secret) as d2,
            ):
                yield d1, d2


def _moved(*devices: Any) -> int:
    return sum(int(s["bytes_sent"] + s["bytes_received"]) for s in (d.stats() for d in devices))


def _measure(cfg: PeerConfig, report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    from gpuremote.xp._functions import asarray

    n = cfg.mib << 18  # float32 elements
    host = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    paths: dict[str, Callable[[Any, Any], Any]] = {
        "direct": lambda x, d2: x.to_device(d2),
        "through_client": lambda x, d2: asarray(np.asarray(x), device=d2),
    }
    times: dict[str, list[float]] = {k: [] for k in paths}
    moved: dict[str, list[int]] = {k: [] for k in paths}
    with _two_devices(cfg) as (d1, d2):
        base = asarray(host, device=d1)
        route = ""
        for r in range(cfg.rounds):
            for name, path in paths.items():
                x = base * 1.0  # a new array: no host copy of it anywhere
                d1.synchronize()
                before = _moved(d1, d2)
                t0 = time.perf_counter()
                y = path(x, d2)
                d2.synchronize()
                times[name].append(time.perf_counter() - t0)
                moved[name].append(_moved(d1, d2) - before)
                if name == "direct":
                    route = d2.last_copy
                if r == 0:  # checked once per path, outside the timing
                    np.testing.assert_array_equal(np.asarray(y[-1024:]), host[-1024:])
                del x, y
            report({"round": r + 1, "rounds": cfg.rounds})
        urls = [d1.url, d2.url]
    out: dict[str, Any] = {
        "bench": "peer",
        "bytes": host.nbytes,
        "rounds": cfg.rounds,
        "proxies": urls,
        "route": route,
    }
    for name in paths:
        med = statistics.median(times[name])
        out[name] = {
            "median_s": med,
            "min_s": min(times[name]),
            "gb_per_s": host.nbytes / med / 1e9,
            "client_bytes": max(moved[name]),
        }
    direct, through = out["direct"]["median_s"], out["through_client"]["median_s"]
    out["through_client_over_direct"] = through / direct
    return out


async def run_peer(
    cfg: PeerConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    """Run the bench (its synchronous ``gpuremote.xp`` code on a thread of its own)."""
    if cfg.url and cfg.url.startswith("pool://"):
        from gpuremote.pool import attach

        attach()  # from the main thread, where Ray can set its signal handlers
    return await asyncio.to_thread(_measure, cfg, report)
