"""Many deadlines of one length on one timer: the proxy's handshake deadlines.

A timer per connection costs a timer handle each (uvloop keeps up to 250 freed ones on a
free list, which then pins the memory a flood of connections used). All deadlines here have
the same length, so their order is the order they were added: one timer, armed for the
earliest, expires everything due when it fires and re-arms for the next. Deadlines expire
spread out as they were added (coarser firings would expire a burst's hundreds at once, whose
replies and wake-ups, all live together, then stay on free lists of their own).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["Deadlines"]

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    """``expire(key)`` is called ``delay_s`` after ``add(key)`` unless ``discard(key)`` came
    first. Adding, discarding and expiring cost O(1) each; at most one timer is armed."""

    def __init__(
        self,
        delay_s: float,
        expire: Callable[[K], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        if delay_s < 0:
            raise ValueError(f"a deadline's delay must be >= 0, not {delay_s}")
        self.delay_s = delay_s
        self._expire = expire
        self._loop = loop
        self._due: dict[K, float] = {}  # key -> its loop time; insertion order = deadline order
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, key: object) -> bool:
        return key in self._due

    def add(self, key: K) -> None:
        """Start ``key``'s deadline (again from now, if it was running)."""
        self._due.pop(key, None)
        self._due[key] = self._loop.time() + self.delay_s
        if self._timer is None:
            self._arm()

    def discard(self, key: K) -> None:
        """Stop ``key``'s deadline (nothing if it has none)."""
        due = self._due
        due.pop(key, None)
        if not due:
            self._due = {}  # a flood's big table goes back
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def close(self) -> None:
        """Stop every deadline."""
        self._due = {}
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        when = next(iter(self._due.values()))
        self._timer = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = self._loop.time()
        while self._due:
            key, when = next(iter(self._due.items()))
            if when > now:
                break
            del self._due[key]
            self._expire(key)  # may add or discard others: the head is read again
        if not self._due:
            self._due = {}  # a flood's big table goes back
        elif self._timer is None:
            self._arm()
