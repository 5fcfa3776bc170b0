"""``tcp://host:port``: frames over a TCP byte stream on the asyncio event loop (uvloop if set).

Reads use asyncio's ``BufferedProtocol``: the loop receives straight into the memory that the
sans-I/O ``FrameDecoder`` hands out, so a large payload goes from the kernel into a freshly
allocated array with no intermediate copy. Writes hand the frame's own buffers to the
transport (``writelines``); uvloop keeps references to them rather than copying (asyncio's own
loop may copy what the socket does not take at once). ``TCP_NODELAY`` is set, and a small
frame is written as one piece, one system call.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Callable
from typing import Any

from gpuremote.errors import ConnectionClosed, ProtocolError
from gpuremote.framing import Frame, FrameDecoder, FrameLimits, encode_frame

from .base import Address, Connection, ConnectionHandler, Listener, Transport

__all__ = ["TcpConnection", "TcpListener", "TcpTransport"]


class _Protocol(asyncio.BufferedProtocol):
    """Feeds the connection's decoder; maps asyncio's callbacks onto ``TcpConnection``."""

    def __init__(self, limits: FrameLimits) -> None:
        self.conn = TcpConnection(limits)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn._made(transport)  # type: ignore[arg-type]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.conn._decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self.conn._received(nbytes)

    def eof_received(self) -> bool:
        self.conn._eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn._lost_connection(exc)

    def pause_writing(self) -> None:
        self.conn._write_paused = True

    def resume_writing(self) -> None:
        self.conn._write_paused = False
        self.conn._wake_drainers(None)


class TcpConnection(Connection):
    """A connected TCP stream carrying frames."""

    def __init__(self, limits: FrameLimits, *, max_queued_frames: int = 64) -> None:
        self._loop = asyncio.get_running_loop()
        self._limits = limits
        self._decoder = FrameDecoder(limits)
        self._transport: asyncio.Transport | None = None
        self._frames: deque[Frame] = deque()
        self._max_queued = max_queued_frames
        self._waiter: asyncio.Future[None] | None = None
        self._drainers: list[asyncio.Future[None]] = []
        self._write_paused = False
        self._error: BaseException | None = None
        self._closed = False
        self._paused = False  # by the user (pause_reading)
        self._throttled = False  # by a full recv queue
        self._receiver: Callable[[Frame], None] | None = None
        self._on_lost: Callable[[BaseException], None] | None = None

    # -- asyncio callbacks -----------------------------------------------------------------
    def _made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        # pause_writing as soon as anything is buffered, resume when all is out: drain()
        # then means "every byte handed to the kernel"
        transport.set_write_buffer_limits(high=0)

    def _received(self, nbytes: int) -> None:
        dec = self._decoder
        try:
            dec.buffer_updated(nbytes)
        except ProtocolError as exc:
            self._fail(exc)
            return
        receiver = self._receiver
        if receiver is not None:
            while (f := dec.next_frame()) is not None:
                try:
                    receiver(f)
                except Exception as exc:
                    self._fail(exc)
                    return
            return
        frames = self._frames
        while (f := dec.next_frame()) is not None:
            frames.append(f)
        if frames:
            w = self._waiter
            if w is not None and not w.done():
                w.set_result(None)
            if len(frames) >= self._max_queued and not self._throttled:
                self._throttled = True  # the consumer is behind: stop reading
                self._update_reading()

    def _eof(self) -> None:
        try:
            self._decoder.eof()
        except ProtocolError as exc:
            self._fail(exc)
            return
        self._fail(ConnectionClosed(f"connection closed by {self.peer}"))

    def _lost_connection(self, exc: Exception | None) -> None:
        if exc is not None and self._error is None:
            self._error = exc
        self._closed = True
        self._finish()

    # -- sending ---------------------------------------------------------------------------
    def send(self, frame: Frame) -> None:
        transport = self._transport
        if self._closed or transport is None or transport.is_closing():
            raise ConnectionClosed(self._why())
        pieces = encode_frame(frame, self._limits)
        if len(pieces) == 1:
            transport.write(pieces[0])
        else:
            transport.writelines(pieces)

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionClosed(self._why())
        if not self._write_paused:
            return
        fut = self._loop.create_future()
        self._drainers.append(fut)
        await fut

    def _wake_drainers(self, exc: BaseException | None) -> None:
        drainers, self._drainers = self._drainers, []
        for fut in drainers:
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

    @property
    def pending_bytes(self) -> int:
        t = self._transport
        return t.get_write_buffer_size() if t is not None and not self._closed else 0

    # -- receiving -------------------------------------------------------------------------
    def set_receiver(
        self, on_frame: Callable[[Frame], None], on_lost: Callable[[BaseException], None]
    ) -> None:
        self._receiver, self._on_lost = on_frame, on_lost
        while self._frames:  # anything that arrived before
            on_frame(self._frames.popleft())
        if self._throttled:
            self._throttled = False
            self._update_reading()
        if self._closed:
            self._finish()

    def pause_reading(self) -> None:
        self._paused = True
        self._update_reading()

    def resume_reading(self) -> None:
        self._paused = False
        self._update_reading()

    def _update_reading(self) -> None:
        t = self._transport
        if t is None or self._closed or t.is_closing():
            return
        if self._paused or self._throttled:
            if t.is_reading():
                t.pause_reading()
        elif not t.is_reading():
            t.resume_reading()

    async def recv(self) -> Frame:
        while True:
            if self._frames:
                frame = self._frames.popleft()
                if self._throttled and len(self._frames) < self._max_queued // 2:
                    self._throttled = False
                    self._update_reading()
                return frame
            if self._closed:
                raise self._closed_error()
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    # -- closing ---------------------------------------------------------------------------
    def _why(self) -> str:
        if isinstance(self._error, ConnectionClosed):
            return str(self._error)
        if self._error is not None:
            return f"connection to {self.peer} lost: {self._error}"
        return f"connection to {self.peer} is closed"

    def _closed_error(self) -> BaseException:
        if isinstance(self._error, ProtocolError):
            return self._error
        return ConnectionClosed(self._why())

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._transport is not None:
            self._transport.abort() if self._error is not None else self._transport.close()
        self._finish()

    def _finish(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        self._wake_drainers(ConnectionClosed(self._why()))
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            on_lost(self._closed_error())

    @property
    def closed(self) -> bool:
        return self._closed


class TcpListener(Listener):
    def __init__(self, server: asyncio.Server, url: str) -> None:
        self._server = server
        self.url = url

    async def close(self) -> None:
        self._server.close()


class TcpTransport(Transport):
    scheme = "tcp"

    async def connect(self, address: Address) -> Connection:
        loop = asyncio.get_running_loop()
        host, port = address.host or "127.0.0.1", address.port
        if port is None:
            raise ConnectionClosed(f"{address.url()}: a tcp:// URL needs a port")
        try:
            _, protocol = await loop.create_connection(lambda: _Protocol(self.limits), host, port)
        except OSError as exc:
            raise ConnectionClosed(f"cannot connect to {address.url()}: {exc}") from None
        return protocol.conn

    async def listen(self, address: Address, handler: ConnectionHandler) -> Listener:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[Any]] = set()

        def factory() -> _Protocol:
            protocol = _Protocol(self.limits)
            task = loop.create_task(_run_handler(handler, protocol.conn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return protocol

        host = address.host or "127.0.0.1"
        try:
            server = await loop.create_server(
                factory, host, address.port or 0, backlog=512, reuse_address=True
            )
        except OSError as exc:
            raise ConnectionClosed(f"cannot listen on {address.url()}: {exc}") from None
        bound = server.sockets[0].getsockname()
        return TcpListener(server, Address("tcp", host, bound[1]).url())


async def _run_handler(handler: ConnectionHandler, conn: TcpConnection) -> None:
    await asyncio.sleep(0)  # let connection_made run first
    await handler(conn)
