"""Bare baselines: the same message pattern without gpuremote, in the same run.

A request is ``<QQ`` (request bytes, reply bytes) followed by the request bytes; the server
answers with the reply bytes (an echo when both are equal). This covers a ping (size, size),
a one-way upload with an 8-byte ack (size, 8) and a download (0, size). ``python -m
gpuremote serve --bench-echo`` serves it beside the proxy, in the proxy's own process: with
blocking sockets (a thread per connection: the fastest Python gets) and with asyncio streams on
the proxy's event loop. Both paths then run between the same two processes as gpuremote's
own, so that the scheduler's placement of those processes (which moves loopback round trips
between ~20 and ~130 µs on a 2-vCPU machine) hits all of them alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from gpuremote.transports import Address

from gpuremote.wire.auth import is_loopback
from gpuremote.wire.framing import byte_view

__all__ = [
    "AsyncioClient",
    "Baselines",
    "BlockingClient",
    "EchoServers",
    "ProtocolEchoClient",
    "UcxxClient",
    "echo_service",
]

REQ = struct.Struct("<QQ")
_MAX = 1 << 31


def _recv_into(sock: socket.socket, view: memoryview) -> bool:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


def _blocking_conn(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = memoryview(bytearray(REQ.size))
    buf = bytearray(1 << 20)
    try:
        while _recv_into(sock, head):
            nreq, nrep = REQ.unpack(head)
            if nreq > _MAX or nrep > _MAX:
                return
            if len(buf) < max(nreq, nrep):
                buf = bytearray(max(nreq, nrep))
            view = memoryview(buf)
            if not _recv_into(sock, view[:nreq]):
                return
            sock.sendall(view[:nrep])
    except OSError:
        pass
    finally:
        sock.close()


def _serve_blocking(lsock: socket.socket) -> None:
    while True:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        threading.Thread(target=_blocking_conn, args=(conn,), daemon=True).start()


async def _asyncio_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = bytes(1 << 20)
    try:
        while True:
            head = await reader.readexactly(REQ.size)
            nreq, nrep = REQ.unpack(head)
            if nreq > _MAX or nrep > _MAX:
                break
            data = await reader.readexactly(nreq) if nreq else b""
            if nrep == nreq:
                writer.write(data)
            else:
                if len(payload) < nrep:
                    payload = bytes(nrep)
                writer.write(memoryview(payload)[:nrep])
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


class _EchoProtocol(asyncio.Protocol):
    """The floor for an asyncio design: whatever arrives goes straight back (one write and one
    wake-up per message); the client sends fixed-size messages and waits for all of each."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


class EchoServers:
    """The bare echo servers, beside a proxy: blocking sockets (a thread per connection),
    asyncio streams and a bare asyncio ``Protocol`` on the running event loop. ``ports`` is
    what clients need."""

    def __init__(self, lsock: socket.socket, server: asyncio.Server, proto: asyncio.Server) -> None:
        self.ucx_listener: Any = None  # the bare ucxx echo's, beside a ucx:// proxy
        self._lsock = lsock
        self._servers = (server, proto)
        self.ports = {
            "blocking": lsock.getsockname()[1],
            "asyncio": server.sockets[0].getsockname()[1],
            "protocol": proto.sockets[0].getsockname()[1],
        }

    @classmethod
    async def start(cls, host: str = "127.0.0.1") -> EchoServers:
        lsock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lsock.bind((host, 0))
        lsock.listen(64)
        threading.Thread(
            target=_serve_blocking, args=(lsock,), daemon=True, name="gpuremote-bench-echo"
        ).start()
        server = await asyncio.start_server(_asyncio_conn, host, 0)
        proto = await asyncio.get_running_loop().create_server(_EchoProtocol, host, 0)
        return cls(lsock, server, proto)

    async def close(self) -> None:
        with contextlib.suppress(OSError):
            self._lsock.shutdown(socket.SHUT_RDWR)
        self._lsock.close()
        for server in self._servers:
            server.close()
        self.ucx_listener = None


async def echo_service(proxy: Any, url: str) -> EchoServers:
    """A proxy service (``Proxy(services=[echo_service])``, ``serve --bench-echo``): the echo
    servers beside the proxy, their ports told to clients as ``bench_echo``; beside a ucx://
    proxy, a bare ucxx echo too (tagged messages on worker-address endpoints, on the same
    progress driver as the proxy's own)."""
    address = Address.parse(url)
    host = address.host
    echo = await EchoServers.start(host if host[:1].isdigit() or ":" in host else "127.0.0.1")
    if address.scheme == "ucx":
        local = is_loopback(host)  # on the proxy's own driver: UCX on the host only
        echo.ucx_listener, echo.ports["ucxx"] = await _ucx_echo_server(local)
    proxy.info["bench_echo"] = echo.ports
    return echo


async def _ucx_echo_server(local_only: bool) -> tuple[Any, int]:
    from .ucx_channel import RawUcx, raw_listen

    def serve(ch: RawUcx) -> None:
        out = [np.zeros(1 << 20, np.uint8)]

        def reply(nrep: int) -> None:
            if nrep:
                if out[0].size < nrep:
                    out[0] = np.zeros(nrep, np.uint8)
                ch.send(byte_view(out[0][:nrep]), lambda exc: None)
            ch.next_message(on_message)

        def on_message(msg: Any) -> None:
            nreq, nrep = REQ.unpack(msg[: REQ.size].tobytes())
            if nreq > _MAX or nrep > _MAX:
                ch.close()
                return
            if msg.size - REQ.size >= nreq:  # the payload came in the same message
                reply(nrep)
                return
            # into fresh memory, as the proxy receives an upload (its buffer becomes the array)
            ch.recv(np.empty(nreq, np.uint8), lambda exc: None if exc else reply(nrep))

        ch.next_message(on_message)

    return await raw_listen(serve, local_only)


class UcxxClient:
    """A bare ucxx client of the same protocol (``_ucx_echo_server``): one message per
    request (header and payload joined up to 16 KiB, else two), one receive for the reply.
    Replies over 1 MiB land in fresh memory, and the server receives uploads into fresh
    memory, as gpuremote must (each ``get()`` is a new array; an upload becomes the array)."""

    def __init__(self, channel: Any) -> None:
        self._ch = channel
        self._rbuf = np.empty(1 << 20, np.uint8)

    @classmethod
    async def connect(cls, port: int, host: str = "127.0.0.1") -> UcxxClient:
        from .ucx_channel import raw_connect

        return cls(await raw_connect(host, port))

    async def request(self, payload: memoryview, nreply: int) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def done(exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(ConnectionError(f"the ucxx baseline failed: {exc}"))
            else:
                fut.set_result(None)

        if nreply:
            # large replies into fresh memory, as gpuremote's get() returns a new array
            buf = self._rbuf[:nreply] if nreply <= self._rbuf.size else np.empty(nreply, np.uint8)
            self._ch.recv(buf, done)

        def failed(exc: BaseException | None) -> None:
            if exc is not None:
                done(exc)

        sent = failed if nreply else done  # without a reply, the send is the end
        head = REQ.pack(payload.nbytes, nreply)
        if payload.nbytes <= 16 << 10:
            self._ch.send(memoryview(head + bytes(payload)), sent)
        else:
            self._ch.send(memoryview(head), failed)
            self._ch.send(payload, sent)
        await fut

    def close(self) -> None:
        self._ch.close()


class BlockingClient:
    """A blocking-socket client of the baseline protocol."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._rbuf = memoryview(bytearray(1 << 20))

    def request(self, payload: memoryview, nreply: int) -> None:
        """Send ``payload`` and receive ``nreply`` bytes."""
        self.sock.sendmsg([REQ.pack(payload.nbytes, nreply), payload])
        if self._rbuf.nbytes < nreply:
            self._rbuf = memoryview(bytearray(nreply))
        if not _recv_into(self.sock, self._rbuf[:nreply]):
            raise ConnectionError("baseline server went away")

    def close(self) -> None:
        self.sock.close()


class AsyncioClient:
    """The same over asyncio streams, on the caller's event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int, host: str = "127.0.0.1") -> AsyncioClient:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def request(self, payload: memoryview, nreply: int) -> Any:
        self.writer.write(REQ.pack(payload.nbytes, nreply))
        if payload.nbytes:
            self.writer.write(payload)
        await self.writer.drain()
        return await self.reader.readexactly(nreply)

    def close(self) -> None:
        self.writer.close()


class ProtocolEchoClient(asyncio.Protocol):
    """A bare asyncio ``Protocol`` client of ``_EchoProtocol``: one write and one future per
    message (``loop.create_future()``), resolved when the whole echo is back."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._want = 0
        self._fut: asyncio.Future[None] | None = None
        self.transport: asyncio.Transport | None = None

    @classmethod
    async def connect(cls, port: int, host: str = "127.0.0.1") -> ProtocolEchoClient:
        loop = asyncio.get_running_loop()
        _, proto = await loop.create_connection(cls, host, port)
        return proto

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._want -= len(data)
        if self._want <= 0 and self._fut is not None and not self._fut.done():
            self._fut.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._fut is not None and not self._fut.done():
            self._fut.set_exception(ConnectionError("baseline server went away"))

    async def request(self, payload: bytes) -> None:
        """Send ``payload`` and wait until as many bytes have come back."""
        assert self.transport is not None
        self._want = len(payload)
        self._fut = self._loop.create_future()
        self.transport.write(payload)
        await self._fut

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@dataclass
class Baselines:
    """Clients of the echo servers that the proxy advertises (``serve --bench-echo``), or why
    there are none (``why_not``)."""

    blocking: BlockingClient | None
    asyncio: AsyncioClient | None
    why_not: str | None
    #: the bare ucxx echo, where the proxy is a ucx:// one
    ucxx: UcxxClient | None = None

    @classmethod
    async def open(cls, device: dict[str, Any], host: str, wanted: bool = True) -> Baselines:
        """Clients of the echoes that the proxy's ``device`` info advertises, on ``host``
        (none where not ``wanted``)."""
        if not wanted:
            return cls(None, None, "baselines turned off (--no-baseline)")
        ports = device.get("bench_echo")
        if not isinstance(ports, dict):
            return cls(
                None,
                None,
                "the proxy serves no echo baselines (start it with `gpuremote serve --bench-echo`)",
            )
        blocking = BlockingClient(int(ports["blocking"]), host)
        ucxx = await UcxxClient.connect(int(ports["ucxx"]), host) if "ucxx" in ports else None
        aio = await AsyncioClient.connect(int(ports["asyncio"]), host)
        return cls(blocking, aio, None, ucxx)

    def close(self) -> None:
        """Close every client there is."""
        for client in (self.blocking, self.asyncio, self.ucxx):
            if client is not None:
                client.close()
