"""Fair order among sessions on the proxy's event loop.

A batch runs at once when no other session competes (the common case of one busy client:
no extra loop iteration on the hot path). When several sessions have batches ready, they wait
here and run in fair-queueing order. Each batch gets a start tag (its session's last finish
tag, or the system's virtual time if that is later: an idle session saves up no credit) and a
finish tag (start plus the batch's estimated cost); the smallest finish tag runs first, and the
system's virtual time is the start tag of the batch that ran last. Ordering by finish tags puts
a small batch ahead of the big ones of the same round, and taking the virtual time from start
tags (not from finish tags, as self-clocked fair queueing does) keeps it ahead even when many
sessions send identical batches in step and so share one tag: a session doing one small
synchronous op waits for about the batch that is running, not for one batch of every other
session. The runner yields to the loop every ``slice_s`` so that new frames are read meanwhile.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable, Hashable

__all__ = ["FairScheduler"]

#: the most a batch counts for in virtual time (work sent to a worker costs the loop little)
_MAX_COST_NS = 10e6


class FairScheduler:
    """Runs ``fn`` of ``run(key, cost_ns, fn)`` in fair order among keys (sessions)."""

    def __init__(self, *, slice_s: float = 0.002, contention_s: float = 0.002) -> None:
        self._loop = asyncio.get_running_loop()
        self._slice_s = slice_s
        self._contention_s = contention_s
        self._heap: list[tuple[float, int, float, Hashable, Callable[[], None]]] = []
        self._vtime: dict[Hashable, float] = {}  # each session's last finish tag
        self._now_v = 0.0  # the system's virtual time: the start tag of the batch that ran last
        self._seq = itertools.count()
        self._last_key: Hashable | None = None
        self._last_t = 0.0
        self._scheduled = False

    def run(self, key: Hashable, cost_ns: float, fn: Callable[[], None]) -> bool:
        """Run ``fn`` now, or queue it behind fairer ones; True if it ran now."""
        start = max(self._vtime.get(key, 0.0), self._now_v)
        tag = self._vtime[key] = start + min(cost_ns, _MAX_COST_NS)
        now = time.perf_counter()
        if not self._heap and (
            self._last_key is None
            or self._last_key == key
            or now - self._last_t > self._contention_s
        ):
            self._now_v = start
            self._last_key, self._last_t = key, now
            fn()
            return True
        heapq.heappush(self._heap, (tag, next(self._seq), start, key, fn))
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._runner)
        return False

    def _runner(self) -> None:
        heap = self._heap
        deadline = time.perf_counter() + self._slice_s
        try:
            while heap:
                _, _, self._now_v, key, fn = heapq.heappop(heap)
                self._last_key = key
                try:
                    fn()
                finally:
                    self._last_t = time.perf_counter()
                if self._last_t > deadline:
                    break
        finally:
            if heap:
                self._loop.call_soon(self._runner)  # read the sockets, then go on
            else:
                self._scheduled = False

    def forget(self, key: Hashable) -> None:
        """A session ended: drop its virtual time (its queued batches were run or dropped)."""
        self._vtime.pop(key, None)
        if self._last_key == key:
            self._last_key = None

    @property
    def waiting(self) -> int:
        return len(self._heap)
