"""What the proxy knows about its clients, kept cheaply and served as snapshots.

The hot path only adds to integers and writes one slot of a ring of recent synchronous
latencies (no lock, no system call); percentiles and totals are computed when a snapshot is
asked for: by an admin client (``gpuremote top``) or a Prometheus scrape.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["LATENCY_RING", "SessionFigures", "totals"]

LATENCY_RING = 1024  # recent SYNC latencies kept per session


class SessionFigures:
    """Counters of one session that the executor does not keep itself."""

    __slots__ = (
        "_lat",
        "_lat_n",
        "bytes_in",
        "bytes_out",
        "frames_in",
        "frames_out",
        "local_calls",
        "peer",
        "session",
        "started",
    )

    def __init__(self, session: int, peer: str) -> None:
        self.session = session
        self.peer = peer
        self.started = time.time()
        self.frames_in = 0
        self.frames_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.local_calls = 0  # as last reported by the client
        self._lat: list[int] = []  # a ring, filled to LATENCY_RING, then overwritten
        self._lat_n = 0

    def sync_latency(self, ns: int) -> None:
        """Record how long the proxy took to answer a frame with SYNC calls in it."""
        n = self._lat_n
        if n < LATENCY_RING:
            self._lat.append(ns)
        else:
            self._lat[n % LATENCY_RING] = ns
        self._lat_n = n + 1

    def latency_us(self) -> dict[str, float | int | None]:
        if not self._lat:
            return {"p50": None, "p99": None, "count": 0}
        p50, p99 = np.percentile(np.array(self._lat, dtype=np.int64), [50, 99]) / 1e3
        return {"p50": float(p50), "p99": float(p99), "count": self._lat_n}


def totals(sessions: list[dict[str, Any]]) -> dict[str, Any]:
    """Sums over session snapshots."""
    keys = (
        "frames_in",
        "frames_out",
        "bytes_in",
        "bytes_out",
        "device_bytes",
        "buffers",
        "queued_calls",
        "pending_bytes_out",
    )
    out: dict[str, Any] = {k: sum(s[k] for s in sessions) for k in keys}
    out["calls"] = {c: sum(s["calls"][c] for s in sessions) for c in ("local", "async", "sync")}
    out["sessions"] = len(sessions)
    return out
