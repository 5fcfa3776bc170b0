"""Copies between two proxies, without the data passing through the client.

The client asks proxy A to export an array (``peer_export``): A copies it into a buffer of its
own and answers a ticket, a random token good for one read within ``TICKET_TTL_S``. The client
then asks proxy B to import the ticket into an array of B (``peer_import``): B connects to A as
a client of its own (with its own shared secret, which the proxies of a pool have in common),
reads the ticket (``peer_read``) and writes the data into the array. The ticket is the
authority to read: whoever holds it, and can reach A, gets the data once.

``Tickets`` is the exporting side's table; ``PeerLinks`` the importing side's connections to
other proxies, kept open and run on the proxy's event loop. Neither touches a device: the
executor does that, and calls ``PeerLinks.fetch`` from a worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .calls import CALLS_BY_NAME

if TYPE_CHECKING:
    from .client import GPU

__all__ = ["TICKET_TTL_S", "PeerLinks", "PeerUnreachable", "Tickets"]

#: how long an exported array waits to be read before its copy is dropped
TICKET_TTL_S = 60.0
#: the most tickets one session may have outstanding (each holds a copy of its array)
MAX_TICKETS_PER_SESSION = 16


class PeerUnreachable(Exception):
    """The importing proxy could not reach the exporting one (the client then copies the
    data through itself)."""


@dataclass(slots=True)
class _Ticket:
    buffer: Any  # the backend's copy of the exported bytes
    nbytes: int
    session: int
    expires: float


class Tickets:
    """Exported arrays of every session of one proxy, by ticket (thread-safe)."""

    def __init__(self, ttl_s: float = TICKET_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._table: dict[str, _Ticket] = {}
        self._lock = threading.Lock()

    def add(self, session: int, buffer: Any, nbytes: int) -> str:
        """Hold ``buffer`` for one read; returns its ticket."""
        now = time.monotonic()
        ticket = secrets.token_hex(16)
        with self._lock:
            self._expire(now)
            held = sum(1 for t in self._table.values() if t.session == session)
            if held >= MAX_TICKETS_PER_SESSION:
                raise ValueError(
                    f"session holds {held} exported arrays not yet read; the limit is "
                    f"{MAX_TICKETS_PER_SESSION}"
                )
            self._table[ticket] = _Ticket(buffer, nbytes, session, now + self.ttl_s)
        return ticket

    def take(self, ticket: str) -> tuple[Any, int]:
        """The buffer and size of ``ticket``, which is used up; KeyError if unknown."""
        with self._lock:
            self._expire(time.monotonic())
            t = self._table.pop(ticket, None)
        if t is None:
            raise KeyError("unknown or expired ticket (a ticket is good for one read)")
        return t.buffer, t.nbytes

    def drop_session(self, session: int) -> None:
        """Forget what ``session`` exported (it ended)."""
        with self._lock:
            for k in [k for k, t in self._table.items() if t.session == session]:
                del self._table[k]

    def held_bytes(self) -> int:
        with self._lock:
            return sum(t.nbytes for t in self._table.values())

    def __len__(self) -> int:
        return len(self._table)

    def _expire(self, now: float) -> None:
        for k in [k for k, t in self._table.items() if t.expires <= now]:
            del self._table[k]


_PEER_READ = CALLS_BY_NAME["peer_read"]


class PeerLinks:
    """This proxy's client connections to other proxies, made on first use and kept.

    ``connect`` opens one (``gpuremote.client.connect`` with the proxy's secret by default);
    ``fetch`` is called from a worker thread and runs the read on ``loop``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        secret: bytes | None,
        connect: Callable[[str], Any] | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        self._loop = loop
        self._secret = secret
        self._connect = connect
        self.timeout_s = timeout_s
        self._links: dict[str, GPU] = {}
        self._opening: dict[str, asyncio.Future[GPU]] = {}
        self.bytes_in = 0  # bytes read from other proxies

    def fetch(self, url: str, ticket: str) -> memoryview:
        """Read ``ticket`` from the proxy at ``url`` (blocks; never call it on the loop)."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError("PeerLinks.fetch blocks: call it from a worker thread")
        fut = asyncio.run_coroutine_threadsafe(self._fetch(url, ticket), self._loop)
        return fut.result(self.timeout_s)

    async def _fetch(self, url: str, ticket: str) -> memoryview:
        gpu = await self._link(url)
        value, bufs = await gpu._session.call(_PEER_READ, 0, [ticket])
        data = bufs[value]
        self.bytes_in += data.nbytes
        return data

    async def _link(self, url: str) -> GPU:
        gpu = self._links.get(url)
        if gpu is not None and not gpu._session.closed:
            return gpu
        opening = self._opening.get(url)
        if opening is not None:
            return await asyncio.shield(opening)
        fut: asyncio.Future[GPU] = self._loop.create_future()
        self._opening[url] = fut
        try:
            gpu = await self._open(url)
        except Exception as exc:
            fut.set_exception(PeerUnreachable(f"cannot reach the proxy at {url}: {exc}"))
            fut.exception()  # retrieved: waiters get it through shield
            raise PeerUnreachable(f"cannot reach the proxy at {url}: {exc}") from None
        finally:
            self._opening.pop(url, None)
        fut.set_result(gpu)
        self._links[url] = gpu
        return gpu

    async def _open(self, url: str) -> GPU:
        if self._connect is not None:
            gpu: GPU = await self._connect(url)
            return gpu
        from .client import connect

        return await connect(url, secret=self._secret, connect_timeout=5.0)

    async def close(self) -> None:
        links, self._links = self._links, {}
        for gpu in links.values():
            with contextlib.suppress(Exception):  # a link that may be gone already
                await gpu.aclose()
