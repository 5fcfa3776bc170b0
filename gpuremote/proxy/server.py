"""The proxy: accepts connections on any transport and gives each its own session.

Each connection gets a ``ProxySession`` with its own ``Executor`` (handle tables, streams).
Frames are decoded as they arrive and run in order, inline when cheap and otherwise on a
worker thread, so that one session's device work never holds up the others; replies go back
as one frame per batch. A frame that breaks the protocol closes that one connection (after a
``FATAL`` message saying why); the other sessions carry on. Everything a session holds is
freed when its connection ends, once its device work in flight has finished.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import hmac
import itertools
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from ..backends import Backend, get_backend
from ..config import transport_settings
from ..errors import ConfigError, GpuRemoteError
from ..transports import Address, Connection, Listener, listen
from ..wire.auth import is_loopback
from ..wire.framing import FrameLimits
from ..wire.protocol import encode_fatal, encode_notice
from .collectives import Collectives
from .deadlines import Deadlines
from .executor import Executor, SessionLimits
from .heap import HeapKeeper, release_free_memory
from .monitor import totals
from .peers import PEER_TIMEOUT_S, PeerImports, PeerLinks, Tickets
from .scheduler import FairScheduler
from .session import HANDSHAKE_LIMITS, ProxySession

__all__ = ["Proxy", "Service", "raise_open_files_limit", "serve"]

log = logging.getLogger("gpuremote.proxy")


#: a service started beside the proxy when it first listens (``serve --bench-echo`` adds
#: the bench's echo servers): called with the proxy and its first bound URL, it returns what
#: ``Proxy.close`` closes
Service = Callable[["Proxy", str], Awaitable[Any]]


class Proxy:
    """Serves clients on ``backend``; ``await start(url)`` for each address to listen on.

    Each session's batches run on its ``DeviceQueue``: inline when cheap, else on one of
    ``workers`` threads, so that no session's device work holds up the event loop. Among
    sessions, a batch waits its fair turn (``FairScheduler``) when another session's batch
    ran within the last ``contention_s``; 0 lets it wait only behind batches already waiting
    (for a proxy whose sessions take turns, as a bench's do)."""

    def __init__(
        self,
        backend: Backend | str = "auto",
        *,
        limits: FrameLimits = FrameLimits(),
        session_limits: SessionLimits = SessionLimits(),
        services: Sequence[Service] = (),
        admin_token: str | None = None,
        secret: bytes | None = None,
        workers: int = 16,
        inline_us: float = 1000.0,
        max_clients: int | None = None,
        handshake_timeout_s: float | None = 5.0,
        peers: Iterable[str] = (),
        peer_timeout_s: float = PEER_TIMEOUT_S,
        contention_s: float = 0.002,
    ) -> None:
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.admin_token = admin_token or None
        self.secret = secret or None
        self.started = time.time()
        self.metrics_url: str | None = None
        self.limits = limits
        self.session_limits = session_limits
        self.inline_us = inline_us
        self.max_clients = max_clients
        self.handshake_timeout_s = handshake_timeout_s
        self.contention_s = contention_s
        self._scheduler: FairScheduler | None = None  # made on the loop, at the first client
        # the handshake deadlines of every session, on one timer (made with the scheduler)
        self._deadlines: Deadlines[ProxySession] | None = None
        self._heap_keeper: HeapKeeper | None = None  # made on the loop, at the first client
        self.refused_connections = 0  # turned away: max_clients reached
        self.handshake_timeouts = 0  # closed: no handshake within handshake_timeout_s
        self.handshake_refused = 0  # closed: sent something else than a (valid) hello first
        self.listeners: list[Listener] = []
        #: the addresses the listeners really listen on (a ucx:// listener: every interface)
        self.bound: list[str] = []
        self.clients: dict[int, ProxySession] = {}
        self._ids = itertools.count(1)
        self.sessions_served = 0
        self.calls_ended = 0  # sync and async calls of the sessions that have ended
        self._services = list(services)
        self._running: list[Any] = []  # the services started
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="gpuremote-device"
        )
        self.info: dict[str, Any] = {}  # extra device info sent to clients at hello
        self.tickets = Tickets()  # arrays exported to other proxies
        #: the process groups of distributed jobs' sessions (collectives between proxies)
        self.collectives = Collectives(self._own_hosts, self._peer_hosts)
        #: connections to other proxies, made on the loop; only ``peers`` may be read from
        self.peers: PeerLinks | None = None
        self._peer_urls = list(peers)
        self._peer_timeout_s = peer_timeout_s

    def set_peers(self, urls: Iterable[str]) -> None:
        """Make ``urls`` the proxies this one may read arrays from (``peer_import``),
        replacing the previous ones (call it on the proxy's loop once it has started)."""
        self._peer_urls = list(urls)
        if self.peers is not None:
            self.peers.allow(self._peer_urls)

    async def start(self, url: str) -> str:
        """Listen at ``url``; returns the URL clients connect to (the real port if it was 0)."""
        if self.peers is None:
            self.peers = PeerLinks(
                asyncio.get_running_loop(),
                self.secret,
                allowed=self._peer_urls,
                timeout_s=self._peer_timeout_s,
            )
        settings = transport_settings(Address.parse(url).scheme)
        listener = await listen(
            url,
            self._serve_connection,
            self.limits,
            settings,
            self.backend.host_allocator(),
            self.backend.device_allocator(),
            handshake_limits=HANDSHAKE_LIMITS,
        )
        self.listeners.append(listener)
        self.bound.extend(listener.bound)
        services, self._services = self._services, []
        for service in services:
            self._running.append(await service(self, listener.url))
        # resolve malloc_trim now: done first in a flood's drain, its ctypes objects would
        # outlive the flood inside its memory and keep that from going back to the OS
        release_free_memory()
        return listener.url

    async def _serve_connection(self, conn: Connection) -> None:
        if self.max_clients is not None and len(self.clients) >= self.max_clients:
            self.refused_connections += 1
            log.warning("refused %s: %d clients, the limit", conn.peer, len(self.clients))
            with contextlib.suppress(GpuRemoteError):
                conn.send(
                    encode_fatal(
                        f"the proxy serves at most {self.max_clients} clients at once "
                        "(--max-clients); try again later"
                    )
                )
                await asyncio.wait_for(conn.drain(), 1.0)
            conn.close()
            return
        sid = next(self._ids)

        def make_executor() -> Executor:
            return Executor(
                self.backend,
                self.session_limits,
                sid,
                self.info,
                self._admin,
                tickets=self.tickets,
                peers=None if self.peers is None else PeerImports(self.peers),
                device_io=conn.device_memory,
                collectives=self.collectives,
            )

        def timed_out(session: ProxySession) -> None:
            self.handshake_timeouts += 1

        if self._scheduler is None:
            self._scheduler = FairScheduler(contention_s=self.contention_s)
        if self._heap_keeper is None:
            self._heap_keeper = HeapKeeper(asyncio.get_running_loop())
        heap = self._heap_keeper
        if self._deadlines is None and self.handshake_timeout_s is not None:
            self._deadlines = Deadlines(
                self.handshake_timeout_s,
                ProxySession._handshake_expired,
                asyncio.get_running_loop(),
            )
        session = ProxySession(
            conn,
            make_executor,
            self._pool,
            scheduler=self._scheduler,
            sid=sid,
            limits=self.limits,
            secret=self.secret,
            inline_us=self.inline_us,
            handshake_timeout_s=self.handshake_timeout_s,
            on_handshake_timeout=timed_out,
            deadlines=self._deadlines,
        )
        self.clients[sid] = session
        heap.started(len(self.clients))
        self.sessions_served += 1
        log.info("session %d: client %s connected", sid, conn.peer)
        reason = "proxy shutting down"
        try:
            reason = await session.run()
        finally:
            if session.refused_in_handshake:
                self.handshake_refused += 1
            self.clients.pop(sid, None)
            if session.final_stats is not None:
                calls = session.final_stats["calls"]
                self.calls_ended += calls["sync"] + calls["async"]
            heap.ended(len(self.clients))
            _log_end(session, reason)

    def _own_hosts(self) -> list[str]:
        """The hosts this proxy listens on over a network (a job's store here is reached at
        the first; a proxy served in-process only: the loopback)."""
        hosts = [
            a.host for a in map(Address.parse, self.bound) if a.scheme in ("tcp", "tls", "ucx")
        ]
        return hosts or ["127.0.0.1"]

    def _peer_hosts(self) -> list[str]:
        """The hosts of the proxies this one may reach."""
        hosts = []
        for u in self._peer_urls:
            with contextlib.suppress(ConfigError):
                hosts.append(Address.parse(u).host)
        return hosts

    @property
    def exposed(self) -> list[str]:
        """The addresses listened on that are reachable from other machines."""
        return [u for u in self.bound if not is_loopback(Address.parse(u).host)]

    def _admin(self, token: str) -> dict[str, Any]:
        """The admin call: every session's figures, for the right token only."""
        if self.admin_token is None:
            raise PermissionError(
                "admin calls are disabled on this proxy (start it with --admin-token or "
                "GPUREMOTE_ADMIN_TOKEN)"
            )
        if not hmac.compare_digest(token.encode(), self.admin_token.encode()):
            raise PermissionError("refused: wrong admin token")
        return self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        """Every live session's figures, totals and the backend: what `gpuremote top` shows."""
        now = time.time()
        sessions = []
        for sid, c in list(self.clients.items()):
            if not c.started:  # still in the handshake
                continue
            ex, fig = c.executor, c.figures
            sessions.append(
                {
                    "session": sid,
                    "peer": fig.peer,
                    "uptime_s": now - fig.started,
                    "calls": {
                        "local": fig.local_calls,
                        **{k: v for k, v in ex.counts.items() if k != "local"},
                    },
                    "failed": ex.failed,
                    "frames_in": fig.frames_in,
                    "frames_out": fig.frames_out,
                    "bytes_in": fig.bytes_in,
                    "bytes_out": fig.bytes_out,
                    "device_bytes": ex.device_bytes,
                    "buffers": len(ex.buffers),
                    "queued_calls": c.queue.in_flight,  # batches waiting for the device
                    "pending_bytes_out": c.conn.pending_bytes,
                    "sync_latency_us": fig.latency_us(),
                }
            )
        return {
            "time": now,
            "uptime_s": now - self.started,
            "backend": dict(self.backend.device_info()),
            "sessions": sessions,
            "totals": totals(sessions),
            "sessions_served": self.sessions_served,
            "connections": {
                "open": len(self.clients),
                "in_handshake": sum(1 for c in self.clients.values() if not c.started),
                "refused": self.refused_connections,
                "handshake_timeouts": self.handshake_timeouts,
                "handshake_refused": self.handshake_refused,
            },
        }

    def stats(self) -> dict[str, Any]:
        """Totals over the live sessions."""
        sessions = [c.executor.stats() for c in self.clients.values() if c.started]
        return {
            "backend": self.backend.name,
            "sessions": len(sessions),
            "sessions_served": self.sessions_served,
            "buffers": sum(s["buffers"] for s in sessions),
            "device_bytes": sum(s["device_bytes"] for s in sessions),
        }

    async def close(self, grace: float = 0.0) -> None:
        """Stop listening, tell clients, and end every session.

        With ``grace``, sessions get that long to finish: batches already received run and
        their replies go out, and clients that hang up on the notice end sooner."""
        for listener in self.listeners:
            await listener.close()
        self.listeners.clear()
        running, self._running = self._running, []
        for service in running:
            with contextlib.suppress(Exception):
                await service.close()
        clients = list(self.clients.values())
        for client in clients:
            with contextlib.suppress(GpuRemoteError):
                client.conn.send(encode_notice("shutdown"))
        tasks = [c.task for c in clients if c.task is not None]
        if grace and tasks:
            await asyncio.wait(tasks, timeout=grace)
        for client in clients:
            with contextlib.suppress(GpuRemoteError, TimeoutError):
                await asyncio.wait_for(client.conn.drain(), 1.0)
            client.conn.close()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self._deadlines is not None:
            self._deadlines.close()
        if self._heap_keeper is not None:
            self._heap_keeper.close()
        if self.peers is not None:
            await self.peers.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _why_exposed(urls: list[str], exposed: list[str]) -> str:
    """Why a listener is reachable where its URL did not say so (ucx://)."""
    asked = [u for u in urls if is_loopback(Address.parse(u).host)]
    ucx = [u for u in exposed if Address.parse(u).scheme == "ucx"]
    if asked and ucx:
        return (
            f": {', '.join(ucx)} is where the ucx:// listener of "
            f"{', '.join(u for u in asked if Address.parse(u).scheme == 'ucx')} really "
            "listens (ucxx binds a listener to every interface, whatever the URL's host)"
        )
    return ""


def _log_end(session: ProxySession, reason: str) -> None:
    stats, fig = session.final_stats, session.figures
    if stats is None:
        log.info("session %d: %s; %s (before the handshake)", session.sid, fig.peer, reason)
        return
    log.info(
        "session %d: %s; %s; calls local=%d sync=%d async=%d failed=%d, %d frames, "
        "%d bytes in, %d bytes out, %d buffers (%d bytes) freed",
        session.sid,
        fig.peer,
        reason,
        fig.local_calls,
        stats["calls"]["sync"],
        stats["calls"]["async"],
        stats["failed"],
        fig.frames_in,
        fig.bytes_in,
        fig.bytes_out,
        stats["buffers"],
        stats["device_bytes"],
    )


def raise_open_files_limit(needed: int | None = None) -> None:
    """Raise this process's soft limit on open files to ``needed`` (default: the hard limit):
    a proxy holds a descriptor per client."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if needed is None else needed
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def tune_gc(young: int = 20_000) -> None:
    """For a proxy process: each frame makes thousands of short-lived objects and hardly any
    that live long, so collect the young generation less often (``young`` allocations instead
    of 700) and keep the objects that exist at start out of every later collection."""
    gc.collect()
    gc.freeze()
    _, mid, old = gc.get_threshold()
    gc.set_threshold(young, mid, old)


async def serve(
    urls: list[str],
    backend: str = "auto",
    *,
    ready: Any = None,
    session_limits: SessionLimits = SessionLimits(),
    services: Sequence[Service] = (),
    admin_token: str | None = None,
    metrics: tuple[str, int] | None = None,
    secret: bytes | None = None,
    drain_s: float = 2.0,
    limits: FrameLimits = FrameLimits(),
    inline_us: float = 1000.0,
    max_clients: int | None = None,
    handshake_timeout_s: float | None = 5.0,
    peers: Sequence[str] = (),
    secret_off_loopback: bool = False,
) -> None:
    """Run a proxy until SIGINT or SIGTERM. ``ready(proxy, bound_urls)`` is called once
    it listens; ``metrics=(host, port)`` also serves Prometheus metrics there. With
    ``secret_off_loopback`` and no ``secret``, it refuses (``ConfigError``) to stay up where
    a listener really listens on more than loopback (a ucx:// one always does)."""
    proxy = Proxy(
        backend,
        limits=limits,
        session_limits=session_limits,
        services=services,
        admin_token=admin_token,
        secret=secret,
        inline_us=inline_us,
        max_clients=max_clients,
        handshake_timeout_s=handshake_timeout_s,
        peers=peers,
    )
    raise_open_files_limit()
    try:
        bound = [await proxy.start(u) for u in urls]
    except BaseException:
        await proxy.close()
        raise
    if secret_off_loopback and secret is None and proxy.exposed:
        await proxy.close()
        raise ConfigError(
            f"refusing to listen on {', '.join(proxy.exposed)} without a shared secret"
            f"{_why_exposed(urls, proxy.exposed)} (--secret-file, GPUREMOTE_SECRET, [auth] "
            "in gpuremote.toml); --insecure overrides"
        )
    tune_gc()
    if metrics is not None:
        from .metrics import start_metrics_server

        proxy.metrics_url = start_metrics_server(proxy, *metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready(proxy, bound)
    try:
        await stop.wait()
        log.info("stopping: telling %d client(s), finishing in-flight work", len(proxy.clients))
    finally:
        await proxy.close(grace=drain_s)
