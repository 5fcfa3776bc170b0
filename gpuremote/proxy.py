"""The proxy: accepts connections on any transport and gives each its own session.

Each connection gets an ``Executor`` (its own handle table and streams). Frames are decoded
and run in the order they arrive; replies go back as one frame per batch. A frame that breaks
the protocol closes that one connection (after a ``FATAL`` message saying why); the other
sessions carry on. Everything a session holds is freed when its connection ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
from dataclasses import dataclass, field
from typing import Any

from .backends import Backend, get_backend
from .errors import ConnectionClosed, GpuRemoteError, ProtocolError
from .executor import Executor, SessionLimits
from .framing import Frame, FrameLimits
from .protocol import decode_request, encode_fatal, encode_notice, encode_replies
from .transports import Address, Connection, Listener, listen

__all__ = ["Proxy", "serve"]

log = logging.getLogger("gpuremote.proxy")


@dataclass
class _Client:
    conn: Connection
    executor: Executor
    task: asyncio.Task[Any] | None = None
    frames: int = field(default=0)
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
    ) -> None:
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
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
        executor = Executor(self.backend, self.session_limits, sid, self.info)
        client = _Client(conn, executor, asyncio.current_task())
        self.clients[sid] = client
        self.sessions_served += 1
        log.info("session %d: client %s connected", sid, conn.peer)
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[str] = loop.create_future()

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

        def on_frame(frame: Frame) -> None:
            # runs in the transport's read callback: no task hop on the hot path
            client.frames += 1
            try:
                commands = decode_request(frame, self.limits)
            except ProtocolError as exc:
                with contextlib.suppress(GpuRemoteError):
                    conn.send(encode_fatal(str(exc)))
                loop.call_later(0.5, end, f"protocol error: {exc}")  # let the FATAL out
                conn.pause_reading()
                return
            replies, buffers = executor.execute(commands, frame.buffers)
            if replies:
                conn.send(encode_replies(replies, buffers))
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
            conn.set_receiver(on_frame, on_lost)
            reason = await ended
        finally:
            stats = executor.stats()
            executor.close()
            conn.close()
            self.clients.pop(sid, None)
            log.info(
                "session %d: %s; %s; calls sync=%d async=%d failed=%d, %d frames, "
                "%d bytes in, %d bytes out, %d buffers (%d bytes) freed",
                sid,
                conn.peer,
                reason,
                stats["calls"]["sync"],
                stats["calls"]["async"],
                stats["failed"],
                client.frames,
                stats["bytes_in"],
                stats["bytes_out"],
                stats["buffers"],
                stats["device_bytes"],
            )

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

    async def close(self) -> None:
        """Stop listening, tell clients, and end every session."""
        for listener in self.listeners:
            await listener.close()
        self.listeners.clear()
        if self._echo is not None:
            await self._echo.close()
            self._echo = None
        tasks = [c.task for c in self.clients.values() if c.task is not None]
        for client in list(self.clients.values()):
            with contextlib.suppress(GpuRemoteError):
                client.conn.send(encode_notice("shutdown"))
            client.conn.close()
        if tasks:
            await asyncio.wait(tasks, timeout=5)


async def serve(
    urls: list[str],
    backend: str = "auto",
    *,
    ready: Any = None,
    session_limits: SessionLimits = SessionLimits(),
    bench_echo: bool = False,
) -> None:
    """Run a proxy until SIGINT or SIGTERM. ``ready(proxy, bound_urls)`` is called once
    it listens."""
    proxy = Proxy(backend, session_limits=session_limits, bench_echo=bench_echo)
    bound = [await proxy.start(u) for u in urls]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready(proxy, bound)
    try:
        await stop.wait()
    finally:
        await proxy.close()
