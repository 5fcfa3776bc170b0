"""A process's memory (``rss_bytes``), and giving a flood's memory back: the proxy's heap
after many sessions have ended.

CPython keeps freed small objects' memory in arenas, and its free lists (floats, tuples,
contexts, ...) keep some freed objects whole; a few survivors keep a whole arena from going
back to the OS. After a flood of sessions (1,000 connections closed by the handshake
deadline, say) the proxy collects garbage, which also empties those free lists, and trims
the C heap, so its RSS returns to about where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from pathlib import Path
from typing import Any

__all__ = ["HeapKeeper", "peak_rss_bytes", "release_free_memory", "reset_peak_rss", "rss_bytes"]

_malloc_trim: Any = None


def release_free_memory() -> None:
    """glibc's malloc_trim: return free heap pages to the OS (a no-op elsewhere)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


class HeapKeeper:
    """Told of each session's start and end, hands memory back when a flood drains.

    - Each time the live sessions fall to half the most since the last time, the C heap is
      trimmed (and garbage collected first if ``many`` or more sessions went).
    - Every ``collect_every`` sessions ended, garbage is collected: a session ends in cycles
      (an exception's frames, callbacks), and a proxy collects its young objects rarely
      (``tune_gc``), so a steady coming and going would otherwise pile them up between
      collections, and the heap they leave behind, fragmented, does not shrink again.
    - Once the sessions have fallen by ``many`` or more from their high, and none has ended
      for ``quiet_s``, garbage is collected and the heap trimmed: the end of a flood's drain.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        many: int = 64,
        quiet_s: float = 0.1,
        collect_every: int = 64,
    ):
        self.many = many
        self.collect_every = collect_every
        self.quiet_s = quiet_s
        self._loop = loop
        self._live = 0
        self._peak = 0  # the most sessions at once since the heap was last trimmed
        self._high = 0  # the most sessions at once since garbage was last collected
        self._last_end = 0.0
        self._ended = 0  # sessions ended since garbage was last collected
        self._timer: asyncio.TimerHandle | None = None
        self.collections = 0  # how many times a flood's end collected garbage

    def started(self, live: int) -> None:
        """A session started; ``live`` sessions now (it included)."""
        self._live = live
        self._peak = max(self._peak, live)
        self._high = max(self._high, live)

    def ended(self, live: int) -> None:
        """A session ended; ``live`` sessions are left."""
        self._live = live
        self._last_end = self._loop.time()
        self._ended += 1
        if self._ended >= self.collect_every:
            gc.collect()
            self._ended = 0
        if live <= self._peak // 2:
            if self._peak - live >= self.many:
                self._collect(live)
            self._peak = live
            release_free_memory()
        if self._high - live >= self.many and self._timer is None:
            self._timer = self._loop.call_later(self.quiet_s, self._when_quiet)

    def close(self) -> None:
        """Stop the timer (the proxy is closing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _collect(self, live: int) -> None:
        gc.collect()  # sessions end in reference cycles; this also empties the free lists
        self._high = live
        self._ended = 0

    def _when_quiet(self) -> None:
        self._timer = None
        wait = self._last_end + self.quiet_s - self._loop.time()
        if wait > 0:  # sessions are still ending: look again once they have stopped
            self._timer = self._loop.call_later(wait, self._when_quiet)
            return
        self._collect(self._live)
        self._peak = self._live
        self.collections += 1
        release_free_memory()


# -- a process's memory, as Linux reports it ----------------------------------------------------
def _status_kb(pid: int | str, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes(pid: int | str = "self") -> int:
    """Peak resident memory of a process (Linux ``VmHWM``); 0 where unknown."""
    return _status_kb(pid, "VmHWM")


def rss_bytes(pid: int | str = "self") -> int:
    """Current resident memory of a process (Linux ``VmRSS``); 0 where unknown."""
    return _status_kb(pid, "VmRSS")


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Reset a process's peak-memory mark (Linux ``clear_refs``); False where not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True
