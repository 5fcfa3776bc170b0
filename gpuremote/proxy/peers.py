"""Copies between two proxies, without the data passing through the client.

The client asks proxy A to export an array (``peer_export``): A copies it into a buffer of its
own and answers a ticket, a random token good for one read within ``TICKET_TTL_S``. The client
then asks proxy B to import the ticket into an array of B (``peer_import``): B connects to A as
a client of its own (with its own shared secret, which the proxies of a pool have in common),
reads the ticket (``peer_read``) and writes the data into the array. The ticket is the
authority to read: whoever holds it, and can reach A, gets the data once.

A proxy reads only from its peers: the URLs it was given (``serve --peer URL``, or the members
of its pool, which the pool's manager tells it). Any other URL is refused before a connection
is attempted, so no client can make a proxy dial where it likes.

``Tickets`` is the exporting side's table. ``PeerLinks`` holds the importing side's connections
to its peers (opened on first use, at most one per peer, closed when idle) and runs on the
proxy's event loop. ``PeerImports`` is one session's reads: the proxy fetches the data of a
batch's ``peer_import`` commands on the loop, with a deadline, before the batch runs, so no
device worker ever waits on the network; the executor then takes the data (or the error) by
ticket. None of them touches a device.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, PeerNotAllowed, PeerUnreachable
from ..session.connection import open_session
from ..transports import Address
from ..wire.calls import CALLS_BY_NAME
from ..wire.limits import MAX_TICKETS_PER_SESSION
from ..wire.protocol import Command

if TYPE_CHECKING:
    from ..session.pipeline import ClientSession
    from ..wire.protocol import BadCommandAt

__all__ = [
    "PEER_TIMEOUT_S",
    "TICKET_TTL_S",
    "PeerImports",
    "PeerLinks",
    "PeerUnreachable",
    "Tickets",
    "peer_key",
]

#: how long an exported array waits to be read before its copy is dropped
TICKET_TTL_S = 60.0
#: how long one read from a peer may take, connecting included, before it fails
PEER_TIMEOUT_S = 30.0
#: a link to a peer unused this long is closed
LINK_IDLE_S = 60.0


def peer_key(url: str) -> str:
    """``url`` reduced to what names a proxy (``scheme://host:port``), to compare peers."""
    try:
        addr = Address.parse(url)
    except ConfigError as exc:
        raise PeerUnreachable(str(exc)) from None
    return Address(addr.scheme.lower(), addr.host.lower(), addr.port).url()


@dataclass(slots=True)
class _Ticket:
    """An array exported for one read by another proxy, until it expires."""

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

    def held_bytes(self, session: int | None = None) -> int:
        """Bytes held for unread tickets: of ``session``, else of every session."""
        with self._lock:
            self._expire(time.monotonic())
            return sum(
                t.nbytes for t in self._table.values() if session is None or t.session == session
            )

    def __len__(self) -> int:
        return len(self._table)

    def _expire(self, now: float) -> None:
        for k in [k for k, t in self._table.items() if t.expires <= now]:
            del self._table[k]


_PEER_READ = CALLS_BY_NAME["peer_read"]
_PEER_IMPORT = CALLS_BY_NAME["peer_import"]


class PeerLinks:
    """This proxy's client connections to its peers, opened on first use and closed when idle.

    ``allowed`` are the peers' URLs (``allow`` replaces them); a read from any other URL is
    refused before any connection is attempted. ``connect`` opens a link (by default
    ``gpuremote.session.connection.open_session`` with the proxy's secret). Runs on ``loop``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        secret: bytes | None,
        connect: Callable[[str], Awaitable[Any]] | None = None,
        timeout_s: float = PEER_TIMEOUT_S,
        allowed: Iterable[str] = (),
        idle_s: float = LINK_IDLE_S,
    ) -> None:
        self._loop = loop
        self._secret = secret
        self._connect = connect
        self.timeout_s = timeout_s
        self.idle_s = idle_s
        self._urls: dict[str, str] = {peer_key(u): u for u in allowed}  # as given: options too
        self._allowed: frozenset[str] = frozenset(self._urls)
        self._links: dict[str, ClientSession] = {}
        self._used: dict[str, float] = {}  # link -> when it was last used
        self._busy: dict[str, int] = {}  # link -> reads under way
        self._opening: dict[str, asyncio.Future[ClientSession]] = {}
        self._reaper: asyncio.TimerHandle | None = None
        self.bytes_in = 0  # bytes read from other proxies
        self.refused = 0  # reads refused: not a peer

    @property
    def allowed(self) -> frozenset[str]:
        """The peers this proxy may read from (``scheme://host:port``)."""
        return self._allowed

    def allow(self, urls: Iterable[str]) -> None:
        """Make ``urls`` this proxy's peers (replacing the previous ones); links to proxies
        no longer among them are closed."""
        self._urls = {peer_key(u): u for u in urls}
        self._allowed = frozenset(self._urls)
        for key in [k for k in self._links if k not in self._allowed]:
            self._drop(key)

    def __len__(self) -> int:
        return len(self._links)

    def check(self, url: str) -> str:
        """The peer key of ``url``; ``PeerNotAllowed`` if it is not one of the peers."""
        key = peer_key(url)
        if key not in self._allowed:
            self.refused += 1
            raise PeerNotAllowed(
                f"{key} is not a peer of this proxy (its peers: "
                f"{', '.join(sorted(self._allowed)) or 'none'}; serve --peer URL adds one, "
                "and a pool's proxies are each other's peers)"
            )
        return key

    async def read(self, url: str, ticket: str) -> memoryview:
        """The data of ``ticket`` from the peer at ``url``, within ``timeout_s``."""
        key = self.check(url)
        self._busy[key] = self._busy.get(key, 0) + 1  # not reaped while a read is under way
        try:
            async with asyncio.timeout(self.timeout_s):
                link = await self._link(key)
                value, bufs = await link.call(_PEER_READ, 0, [ticket])
        except TimeoutError:
            self._drop(key)
            raise PeerUnreachable(
                f"no answer from the proxy at {key} within {self.timeout_s:g} s"
            ) from None
        finally:
            self._used[key] = self._loop.time()
            if self._busy[key] == 1:
                del self._busy[key]
            else:
                self._busy[key] -= 1
        data: memoryview = bufs[value]
        self.bytes_in += data.nbytes
        return data

    async def _link(self, key: str) -> ClientSession:
        link = self._links.get(key)
        if link is not None and not link.closed:
            return link
        opening = self._opening.get(key)
        if opening is not None:
            return await asyncio.shield(opening)
        fut: asyncio.Future[ClientSession] = self._loop.create_future()
        self._opening[key] = fut
        try:
            link = await self._open(self._urls.get(key, key))
        except Exception as exc:
            err = PeerUnreachable(f"cannot reach the proxy at {key}: {exc}")
            fut.set_exception(err)
            fut.exception()  # retrieved: waiters get it through shield
            raise err from None
        except BaseException:  # cancelled: the sessions waiting for this link are told
            fut.set_exception(PeerUnreachable(f"opening the link to {key} was cancelled"))
            fut.exception()
            raise
        finally:
            self._opening.pop(key, None)
        fut.set_result(link)
        if key not in self._allowed:  # no longer a peer while it was being opened
            self._loop.create_task(link.aclose())
            raise PeerUnreachable(f"{key} stopped being a peer of this proxy")
        self._links[key] = link
        self._used[key] = self._loop.time()
        if self._reaper is None:
            self._reaper = self._loop.call_later(self.idle_s, self._reap)
        return link

    async def _open(self, url: str) -> ClientSession:
        if self._connect is not None:
            link: ClientSession = await self._connect(url)
            return link
        session, _ = await open_session(url, secret=self._secret, connect_timeout=5.0)
        return session

    def _reap(self) -> None:
        """Close the links unused for ``idle_s``."""
        self._reaper = None
        now = self._loop.time()
        for key in [
            k for k, t in self._used.items() if now - t >= self.idle_s and k not in self._busy
        ]:
            self._drop(key)
        if self._links and self._reaper is None:
            self._reaper = self._loop.call_later(self.idle_s, self._reap)

    def _drop(self, key: str) -> None:
        self._used.pop(key, None)
        link = self._links.pop(key, None)
        if link is not None:
            self._loop.create_task(link.aclose())
        if not self._links and self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        links, self._links = self._links, {}
        self._used.clear()
        for link in links.values():
            with contextlib.suppress(Exception):  # a link that may be gone already
                await link.aclose()


class PeerImports:
    """One session's reads from peers: ``fetch`` (on the loop) reads the data of a batch's
    ``peer_import`` commands before the batch runs; ``take`` (the executor, later, on any
    thread) hands each over by ticket, or raises the error its read met."""

    def __init__(self, links: PeerLinks) -> None:
        self._links = links
        self._ready: dict[str, memoryview | BaseException] = {}

    def wanted(self, commands: Sequence[Command | BadCommandAt]) -> bool:
        """Whether the batch has a ``peer_import`` whose data must be fetched first (never,
        on a proxy without peers: its imports are refused as they run)."""
        return bool(self._links.allowed) and any(
            type(c) is Command and c.spec is _PEER_IMPORT for c in commands
        )

    async def fetch(self, commands: Sequence[Command | BadCommandAt]) -> None:
        """Read the data of every ``peer_import`` of ``commands`` (errors kept for ``take``)."""
        reads = [c.args for c in commands if type(c) is Command and c.spec is _PEER_IMPORT]
        results = await asyncio.gather(
            *(self._links.read(url, ticket) for _, url, ticket in reads), return_exceptions=True
        )
        for (dst, _, ticket), result in zip(reads, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, memoryview) and result.nbytes != dst.nbytes:
                result = PeerUnreachable(  # not kept: nothing of the wrong size waits here
                    f"the ticket holds {result.nbytes} bytes; the array has {dst.nbytes}"
                )
            self._ready[ticket] = result

    def take(self, url: str, ticket: str) -> memoryview:
        """The data fetched for ``ticket`` from ``url`` (raises what its read raised)."""
        result = self._ready.pop(ticket, None)
        if result is None:
            self._links.check(url)  # not a peer: that is why nothing was fetched
            raise PeerUnreachable("the data of this import was not fetched")
        if isinstance(result, BaseException):
            raise result
        return result

    def clear(self) -> None:
        """Drop what was fetched and not taken (the session ended)."""
        self._ready.clear()
