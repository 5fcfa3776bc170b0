"""The proxy: accepts connections on any transport and gives each its own session.

Each connection gets an ``Executor`` (its own handle table and streams). Frames are decoded
and run in the order they arrive; replies go back as one frame per batch. A frame that breaks
the protocol closes that one connection (after a ``FATAL`` message saying why); the other
sessions carry on. Everything a session holds is freed when its connection ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import itertools
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

from .auth import new_nonce, verify
from .backends import Backend, get_backend
from .errors import ConnectionClosed, GpuRemoteError, ProtocolError
from .executor import PROTOCOL_VERSION, Executor, SessionLimits
from .framing import Frame, FrameLimits
from .monitor import SessionFigures, totals
from .protocol import (
    Command,
    decode_message,
    decode_request,
    encode_fatal,
    encode_greeting,
    encode_notice,
    encode_replies,
    request_local_calls,
)
from .transports import Address, Connection, Listener, listen

__all__ = ["Proxy", "serve"]

log = logging.getLogger("gpuremote.proxy")


@dataclass
class _Client:
    conn: Connection
    executor: Executor
    figures: SessionFigures
    task: asyncio.Task[Any] | None = None
    drainer: asyncio.Task[None] | None = None


class Proxy:
    """Serves clients on ``backend``; ``await start(url)`` for each address to listen on."""

    def __init__(
        self,
        backend: Backend | str = "auto",
        *,
        limits: FrameLimits = FrameLimits(),
        session_limits: SessionLimits = SessionLimits(),
        bench_echo: bool = False,
        admin_token: str | None = None,
        secret: bytes | None = None,
    ) -> None:
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.admin_token = admin_token or None
        self.secret = secret or None
        self.started = time.time()
        self.metrics_url: str | None = None
        self.limits = limits
        self.session_limits = session_limits
        self.listeners: list[Listener] = []
        self.clients: dict[int, _Client] = {}
        self._ids = itertools.count(1)
        self.sessions_served = 0
        self._bench_echo = bench_echo
        self._echo: Any = None
        self.info: dict[str, Any] = {}  # extra device info sent to clients at hello

    async def start(self, url: str) -> str:
        """Listen at ``url``; returns the URL clients connect to (the real port if it was 0)."""
        listener = await listen(url, self._serve_connection, self.limits)
        self.listeners.append(listener)
        if self._bench_echo and self._echo is None:
            from .bench.baseline import EchoServers

            host = Address.parse(listener.url).host
            self._echo = await EchoServers.start(
                host if host[:1].isdigit() or ":" in host else "127.0.0.1"
            )
            self.info["bench_echo"] = self._echo.ports
        return listener.url

    async def _serve_connection(self, conn: Connection) -> None:
        sid = next(self._ids)
        executor = Executor(self.backend, self.session_limits, sid, self.info, self._admin)
        figures = SessionFigures(sid, conn.peer)
        client = _Client(conn, executor, figures, asyncio.current_task())
        self.clients[sid] = client
        self.sessions_served += 1
        log.info("session %d: client %s connected", sid, conn.peer)
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[str] = loop.create_future()
        nonce = new_nonce()
        authenticated = self.secret is None

        def end(reason: str) -> None:
            if not ended.done():
                ended.set_result(reason)
            conn.close()

        async def wait_drained() -> None:
            try:
                await conn.drain()
            except GpuRemoteError:
                return
            conn.resume_reading()

        def refuse(why: str) -> None:
            with contextlib.suppress(GpuRemoteError):
                conn.send(encode_fatal(why))
            conn.pause_reading()
            loop.call_later(0.5, end, why)  # let the FATAL out first

        def on_frame(frame: Frame) -> None:
            # runs in the transport's read callback: no task hop on the hot path
            nonlocal authenticated
            t0 = time.perf_counter_ns()
            figures.frames_in += 1
            figures.bytes_in += frame.nbytes
            try:
                msg = decode_message(frame)
                commands = decode_request(frame, self.limits, msg)
            except ProtocolError as exc:
                refuse(f"protocol error: {exc}")
                return
            if not authenticated:  # nothing runs before the proof is checked
                first = commands[0] if commands else None
                if (
                    type(first) is not Command
                    or first.spec.name != "hello"
                    or self.secret is None
                    or not verify(self.secret, nonce, first.args[1])
                ):
                    log.warning("session %d: %s failed authentication", sid, conn.peer)
                    refuse("authentication failed")
                    return
                authenticated = True
            local = request_local_calls(msg)
            if local is not None:
                figures.local_calls = local
            replies, buffers = executor.execute(commands, frame.buffers)
            if replies:
                reply = encode_replies(replies, buffers)
                conn.send(reply)
                figures.frames_out += 1
                figures.bytes_out += reply.nbytes
                figures.sync_latency(time.perf_counter_ns() - t0)
                if conn.pending_bytes:
                    # reply buffers may be device memory, and the client is slow to read:
                    # take no more commands until they are out (backpressure)
                    conn.pause_reading()
                    client.drainer = loop.create_task(wait_drained())

        def on_lost(exc: BaseException) -> None:
            if isinstance(exc, ConnectionClosed):
                end("client closed the connection")
            elif isinstance(exc, ProtocolError):
                end(f"protocol error: {exc}")
            else:
                log.error("session %d: internal error", sid, exc_info=exc)
                with contextlib.suppress(GpuRemoteError):
                    conn.send(encode_fatal(f"internal error: {type(exc).__name__}"))
                end(f"internal error: {type(exc).__name__}: {exc}")

        reason = "proxy shutting down"
        try:
            conn.send(encode_greeting(PROTOCOL_VERSION, self.secret is not None, nonce))
            conn.set_receiver(on_frame, on_lost)
            reason = await ended
        finally:
            stats = executor.stats()
            executor.close()
            conn.close()
            self.clients.pop(sid, None)
            if not self.clients:
                _release_free_memory()  # idle: hand freed heap back to the OS
            log.info(
                "session %d: %s; %s; calls local=%d sync=%d async=%d failed=%d, %d frames, "
                "%d bytes in, %d bytes out, %d buffers (%d bytes) freed",
                sid,
                conn.peer,
                reason,
                figures.local_calls,
                stats["calls"]["sync"],
                stats["calls"]["async"],
                stats["failed"],
                figures.frames_in,
                figures.bytes_in,
                figures.bytes_out,
                stats["buffers"],
                stats["device_bytes"],
            )

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
                    "queued_calls": 0,  # commands run as their frame arrives
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
        }

    def stats(self) -> dict[str, Any]:
        """Totals over the live sessions."""
        sessions = [c.executor.stats() for c in self.clients.values()]
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
        if self._echo is not None:
            await self._echo.close()
            self._echo = None
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


def _release_free_memory() -> None:
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


_malloc_trim: Any = None


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
    bench_echo: bool = False,
    admin_token: str | None = None,
    metrics: tuple[str, int] | None = None,
    secret: bytes | None = None,
    drain_s: float = 2.0,
    limits: FrameLimits = FrameLimits(),
) -> None:
    """Run a proxy until SIGINT or SIGTERM. ``ready(proxy, bound_urls)`` is called once
    it listens; ``metrics=(host, port)`` also serves Prometheus metrics there."""
    proxy = Proxy(
        backend,
        limits=limits,
        session_limits=session_limits,
        bench_echo=bench_echo,
        admin_token=admin_token,
        secret=secret,
    )
    bound = [await proxy.start(u) for u in urls]
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
