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
import ssl
from collections.abc import Callable
from typing import cast

from gpuremote.errors import ConfigError, ConnectionClosed, ProtocolError
from gpuremote.wire.framing import Frame, FrameDecoder, FrameLimits, default_allocate, encode_frame

from .base import Address, Connection, ConnectionHandler, FramedConnection, Listener, Transport

__all__ = ["TcpConnection", "TcpListener", "TcpTransport", "TlsTransport"]


class _Protocol(asyncio.BufferedProtocol):
    """Feeds the connection's decoder; maps asyncio's callbacks onto ``TcpConnection``."""

    def __init__(
        self,
        limits: FrameLimits,
        on_made: Callable[[TcpConnection], None] | None = None,
        allocate: Callable[[int], memoryview] | None = None,
        handshake: FrameLimits | None = None,
    ) -> None:
        self.conn = TcpConnection(limits, allocate=allocate, handshake=handshake)
        self._on_made = on_made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.conn._made(transport)
        if self._on_made is not None:  # after the TLS handshake, on tls://
            self._on_made(self.conn)
            self._on_made = None

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
        self.conn._wake_drainers()


class TcpConnection(FramedConnection):
    """A connected TCP stream carrying frames."""

    def __init__(
        self,
        limits: FrameLimits,
        *,
        max_queued_frames: int = 64,
        allocate: Callable[[int], memoryview] | None = None,
        handshake: FrameLimits | None = None,
    ) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._limits = limits
        self._allocate = allocate or default_allocate
        #: until ``admit()``: the handshake's limits, into fresh host memory
        self._decoder = (
            FrameDecoder(handshake)
            if handshake is not None
            else FrameDecoder(limits, allocate=self._allocate)
        )
        self._transport: asyncio.Transport | None = None
        self._max_queued = max_queued_frames
        self._write_paused = False
        self._paused = False  # by the user (pause_reading)
        self._throttled = False  # by a full recv queue

    # -- asyncio callbacks -----------------------------------------------------------------
    def _made(self, base: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, base)  # a stream's: it reads and writes
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
        if self._receiver is not None:
            self._deliver()
            return
        inbox = self._inbox
        while (f := dec.next_frame()) is not None:
            inbox.put(f)
        if len(inbox) >= self._max_queued and not self._throttled:
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
        # break the transport <-> protocol <-> connection cycle and drop the buffers now,
        # rather than at the next full garbage collection
        self._transport = None
        self._decoder.release()

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
        while True:
            if self._closed:
                raise ConnectionClosed(self._why())
            if not self._write_paused:
                return
            t = self._transport
            if t is None or t.get_write_buffer_size() == 0:
                # all out (asyncio's TLS transport may not call resume_writing for this)
                self._write_paused = False
                return
            fut = self._loop.create_future()
            self._drainers.append(fut)
            await asyncio.wait([fut], timeout=0.05)
            if not fut.done():
                self._drainers.remove(fut)

    @property
    def pending_bytes(self) -> int:
        t = self._transport
        return t.get_write_buffer_size() if t is not None and not self._closed else 0

    # -- receiving -------------------------------------------------------------------------
    def _deliver(self) -> None:
        """Hand decoded frames to the receiver, stopping as soon as reading is paused."""
        dec, receiver = self._decoder, self._receiver
        while receiver is not None and not self._paused:
            f = dec.next_frame()
            if f is None or not self._hand_on(f):
                return

    def set_receiver(
        self, on_frame: Callable[[Frame], None], on_lost: Callable[[BaseException], None]
    ) -> None:
        super().set_receiver(on_frame, on_lost)
        if self._throttled:
            self._throttled = False
            self._update_reading()

    def admit(self, reserve: Callable[[int], None] | None = None) -> None:
        self._decoder.set_limits(self._limits, self._allocate, reserve)

    def pause_reading(self) -> None:
        self._paused = True
        self._update_reading()

    def resume_reading(self) -> None:
        self._paused = False
        self._deliver()  # frames that arrived before the pause took effect
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
        frame = await super().recv()
        if self._throttled and len(self._inbox) < self._max_queued // 2:
            self._throttled = False
            self._update_reading()
        return frame

    # -- closing ---------------------------------------------------------------------------
    def _why(self) -> str:
        if isinstance(self._error, ConnectionClosed):
            return str(self._error)
        if self._error is not None:
            return f"connection to {self.peer} lost: {self._error}"
        return f"connection to {self.peer} is closed"

    def _closed_error(self) -> ConnectionClosed:
        return ConnectionClosed(self._why())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._transport is not None:
            self._transport.abort() if self._error is not None else self._transport.close()
        self._finish()

    def _finish(self) -> None:
        self._inbox.wake()
        self._wake_drainers()
        self._tell_lost()


class TcpListener(Listener):
    """A listening TCP (or TLS) server of the proxy."""

    def __init__(self, server: asyncio.Server, url: str) -> None:
        self._server = server
        self.url = url

    async def close(self) -> None:
        self._server.close()


class TcpTransport(Transport):
    """``tcp://`` URLs: connections and listeners over asyncio's TCP streams."""

    scheme = "tcp"

    def _client_ssl(self, address: Address) -> ssl.SSLContext | None:
        return None

    def _server_ssl(self, address: Address) -> ssl.SSLContext | None:
        return None

    async def connect(self, address: Address) -> Connection:
        loop = asyncio.get_running_loop()
        host, port = address.host or "127.0.0.1", address.port
        if port is None:
            raise ConnectionClosed(f"{address.url()}: a {self.scheme}:// URL needs a port")
        context = self._client_ssl(address)
        try:
            _, protocol = await loop.create_connection(
                lambda: _Protocol(self.limits, allocate=self.allocate),
                host,
                port,
                ssl=context,
                server_hostname=host if context is not None else None,
            )
        except (OSError, ssl.SSLError) as exc:
            raise ConnectionClosed(f"cannot connect to {address.url()}: {exc}") from None
        return protocol.conn

    async def listen(self, address: Address, handler: ConnectionHandler) -> Listener:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Future[None]] = set()

        def start(conn: TcpConnection) -> None:
            task: asyncio.Future[None] = asyncio.ensure_future(handler(conn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        def factory() -> _Protocol:
            return _Protocol(self.limits, start, self.allocate, self.handshake_limits)

        host = address.host or "127.0.0.1"
        try:
            server = await loop.create_server(
                factory,
                host,
                address.port or 0,
                backlog=512,
                reuse_address=True,
                ssl=self._server_ssl(address),
            )
        except OSError as exc:
            raise ConnectionClosed(f"cannot listen on {address.url()}: {exc}") from None
        bound = server.sockets[0].getsockname()
        listener = TcpListener(server, Address(self.scheme, host, bound[1]).url())
        listener.bound = tuple(
            Address(self.scheme, s.getsockname()[0], s.getsockname()[1]).url()
            for s in server.sockets
        )
        return listener


class TlsTransport(TcpTransport):
    """``tls://host:port``: the same, inside TLS (the standard library's ``ssl``).

    The proxy's certificate and key, and the CA a client trusts, come from the URL
    (``?cert=...&key=...``, ``?ca=...``) or the transport's settings (``cert``, ``key``, ``ca``:
    the client and the proxy pass the config file's ``[tls]`` table); without a CA the client
    uses the system's trust store.
    """

    scheme = "tls"

    def _setting(self, address: Address, key: str) -> str | None:
        if address.options.get(key):
            return address.options[key]
        value = self.settings.get(key)
        return str(value) if value else None

    def _client_ssl(self, address: Address) -> ssl.SSLContext | None:
        ca = self._setting(address, "ca")
        try:
            return ssl.create_default_context(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load the CA file {ca}: {exc}") from None

    def _server_ssl(self, address: Address) -> ssl.SSLContext | None:
        cert, key = self._setting(address, "cert"), self._setting(address, "key")
        if not cert:
            raise ConfigError(
                "a tls:// proxy needs a certificate: ?cert=...&key=... in the URL "
                "or [tls] cert and key in gpuremote.toml"
            )
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load the certificate {cert}: {exc}") from None
        return context
