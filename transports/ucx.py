"""``ucx://host:port``: frames over UCX (the ``[ucx]`` extra, ``ucxx``), on the event loop.

Built on ucxx's low-level API, not its asyncio layer (whose progress spins while idle, see
the project's notes): one UCX worker per event loop in blocking progress mode, its epoll
descriptor watched by the loop. When it is readable the driver progresses the worker until
nothing is left, completes the requests that finished, and arms the worker again (if arming
reports more events, it progresses again), so an idle process with receives posted uses no
CPU. Each connection is a UCX endpoint carrying a byte stream of frames (the stream API): a
frame's header, buffer lengths and metadata, then each buffer received straight into memory
of its exact size. A peer that goes away closes the connection (the endpoint's close
callback), failing what waits on it.

UCX listens on every interface whatever the host in the URL says: give such a proxy a shared
secret. ``UCX_TLS`` / ``UCX_NET_DEVICES`` choose the transports UCX uses (tcp, shared memory,
rc/dc on RDMA hardware); ``UCX_PROTO_INFO=y`` shows what it picked.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array as UcxArray

from gpuremote.errors import ConnectionClosed, LimitExceeded, ProtocolError, RemoteProtocolError
from gpuremote.framing import HEADER, MAGIC, VERSION, Frame, FrameLimits, byte_view, encode_frame

from .base import Address, Connection, ConnectionHandler, FrameInbox, Listener, Transport

__all__ = ["UcxConnection", "UcxListener", "UcxTransport"]

Done = Callable[[BaseException | None], None]


class _Driver:
    """The UCX worker of one event loop and its progress (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        features = (ucx_api.Feature.TAG, ucx_api.Feature.STREAM, ucx_api.Feature.WAKEUP)
        self.context = ucx_api.UCXContext(feature_flags=features)
        self.worker = ucx_api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._pending: list[tuple[Any, Done, object]] = []
        self._scheduled = False
        self.in_progress = False  # inside the worker's progress (its callbacks run there)
        loop.add_reader(self.worker.epoll_file_descriptor, self.progress)

    def track(self, request: Any, done: Done, owner: object = None) -> None:
        """Call ``done(None)`` (or ``done(exc)``) once ``request`` completes."""
        if request.completed:
            self._finish(request, done)
            return
        self._pending.append((request, done, owner))
        self.soon()

    def forget(self, owner: object) -> list[Any]:
        """Stop watching ``owner``'s requests (its endpoint is about to close, which ends
        them); returns them, to be kept alive until then."""
        mine = [r for r, _, o in self._pending if o is owner]
        self._pending = [p for p in self._pending if p[2] is not owner]
        return mine

    def soon(self) -> None:
        """Progress from the loop soon (after something was posted)."""
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.progress)

    def progress(self) -> None:
        """Progress until nothing is left and the worker is armed; if it will not arm (events
        keep coming), come back from the loop rather than spin here."""
        self._scheduled = False
        worker = self.worker
        self.in_progress = True
        try:
            self._progress(worker)
        finally:
            self.in_progress = False

    def _progress(self, worker: Any) -> None:
        for _ in range(16):
            for _ in range(256):
                if not worker.progress_once():
                    break
            if self._pending:
                self._complete()
            if worker.arm():
                return
        self.soon()

    def _complete(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            if item[0].completed:
                self._finish(item[0], item[1])
            else:
                self._pending.append(item)

    @staticmethod
    def _finish(request: Any, done: Done) -> None:
        try:
            request.check_error()
        except Exception as exc:
            done(exc)
        else:
            done(None)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.worker.epoll_file_descriptor)


_DRIVERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Driver] = (
    weakref.WeakKeyDictionary()
)


def _driver() -> _Driver:
    loop = asyncio.get_running_loop()
    driver = _DRIVERS.get(loop)
    if driver is None:
        driver = _DRIVERS[loop] = _Driver(loop)
    return driver


class UcxConnection(Connection):
    """A UCX endpoint carrying frames."""

    def __init__(self, driver: _Driver, endpoint: Any, limits: FrameLimits, peer: str) -> None:
        self._driver = driver
        self._ep = endpoint
        self._limits = limits
        self.peer = peer
        self._inbox = FrameInbox()
        self._receiver: Callable[[Frame], None] | None = None
        self._on_lost: Callable[[BaseException], None] | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._paused = False
        self._resume: Callable[[], None] | None = None  # the read to post when resumed
        self._sending = 0  # bytes handed to UCX and not yet sent
        self._drainers: list[asyncio.Future[None]] = []
        self._keep: dict[int, Any] = {}  # buffers of sends in flight
        endpoint.set_close_callback(self._peer_closed)
        self._read_header()

    # -- receiving -------------------------------------------------------------------------
    def _read(self, nbytes: int, then: Callable[[np.ndarray[Any, Any]], None]) -> None:
        buf = np.empty(nbytes, dtype=np.uint8)
        if nbytes == 0:
            then(buf)
            return

        def done(exc: BaseException | None) -> None:
            if exc is not None:
                self._fail(ConnectionClosed(f"{self.peer}: {exc}"))
            elif not self._closed:
                then(buf)

        if self._closed:
            return
        self._driver.track(self._ep.stream_recv(UcxArray(buf)), done, self)

    def _read_header(self) -> None:
        if self._paused:
            self._resume = self._read_header
            return
        self._read(HEADER.size, self._got_header)

    def _got_header(self, head: np.ndarray[Any, Any]) -> None:
        magic, version, _flags, meta_len, nbufs = HEADER.unpack(head.tobytes())
        lim = self._limits
        try:
            if magic != MAGIC or version != VERSION:
                raise RemoteProtocolError(f"bad frame magic {magic!r}: not gpuremote")
            if nbufs > lim.max_buffers or meta_len > lim.max_meta_bytes:
                raise LimitExceeded(f"a frame of {nbufs} buffers and {meta_len} metadata bytes")
        except ProtocolError as exc:
            self._fail(exc)
            return
        if nbufs:
            self._read(8 * nbufs, lambda raw: self._got_lengths(meta_len, raw))
        else:
            self._got_lengths(meta_len, np.empty(0, np.uint8))

    def _got_lengths(self, meta_len: int, raw: np.ndarray[Any, Any]) -> None:
        lengths = list(struct.unpack(f"<{len(raw) // 8}Q", raw.tobytes()))
        if meta_len + sum(lengths) > self._limits.max_frame_bytes:
            self._fail(LimitExceeded(f"frame of {meta_len + sum(lengths)} bytes"))
            return
        self._read(meta_len, lambda meta: self._next_buffer(meta.tobytes(), lengths, []))

    def _next_buffer(self, meta: bytes, lengths: list[int], got: list[memoryview]) -> None:
        if len(got) == len(lengths):
            self._deliver(Frame(meta, got))
            self._read_header()
            return
        n = lengths[len(got)]
        self._read(n, lambda buf: self._next_buffer(meta, lengths, [*got, byte_view(buf)]))

    def _deliver(self, frame: Frame) -> None:
        receiver = self._receiver
        if receiver is None:
            self._inbox.put(frame)
            return
        try:
            receiver(frame)
        except Exception as exc:
            self._fail(exc)

    def set_receiver(
        self, on_frame: Callable[[Frame], None], on_lost: Callable[[BaseException], None]
    ) -> None:
        self._receiver, self._on_lost = on_frame, on_lost
        self._inbox.drain_to(on_frame)
        if self._closed:
            self._finish()

    async def recv(self) -> Frame:
        return await self._inbox.get(lambda: self._why_exc() if self._closed else None)

    def pause_reading(self) -> None:
        self._paused = True

    def resume_reading(self) -> None:
        self._paused = False
        resume, self._resume = self._resume, None
        if resume is not None:
            resume()

    # -- sending ---------------------------------------------------------------------------
    def send(self, frame: Frame) -> None:
        if self._closed:
            raise self._why_exc()
        pieces = encode_frame(frame, self._limits)
        for piece in pieces:
            view = piece if isinstance(piece, memoryview) else memoryview(piece)
            n = view.nbytes
            if not n:
                continue
            self._sending += n
            key = id(view)
            self._keep[key] = view

            def done(exc: BaseException | None, n: int = n, key: int = key) -> None:
                self._sending -= n
                self._keep.pop(key, None)
                if exc is not None:
                    self._fail(ConnectionClosed(f"{self.peer}: {exc}"))
                elif not self._sending:
                    self._wake_drainers()

            self._driver.track(self._ep.stream_send(UcxArray(view)), done, self)

    async def drain(self) -> None:
        while self._sending and not self._closed:
            fut = self._driver.loop.create_future()
            self._drainers.append(fut)
            await fut
        if self._closed:
            raise self._why_exc()

    def _wake_drainers(self) -> None:
        drainers, self._drainers = self._drainers, []
        for fut in drainers:
            if not fut.done():
                fut.set_result(None)

    @property
    def pending_bytes(self) -> int:
        return self._sending

    # -- ending ----------------------------------------------------------------------------
    def _peer_closed(self, *args: Any) -> None:  # from inside progress: go through the loop
        lost = ConnectionClosed(f"connection closed by {self.peer}")
        self._driver.loop.call_soon(self._fail, lost)

    def _why_exc(self) -> ConnectionClosed:
        return ConnectionClosed(f"{self.peer}: {self._error or 'connection closed'}")

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # never from inside the worker's progress (where a failed request is reported, and
        # where closing the endpoint would crash UCX): then from the loop, just after
        if self._driver.in_progress:
            self._driver.loop.call_soon(self._teardown)
        else:
            self._teardown()
        self._wake_drainers()
        self._inbox.wake()
        self._finish()

    def _teardown(self) -> None:
        ep, self._ep = self._ep, None
        if ep is None:
            return
        # nothing reads this endpoint's requests once it closes (closing ends them)
        self._orphans = self._driver.forget(self)
        with contextlib.suppress(Exception):
            ep.remove_close_callback()
        self._driver.progress()  # learn first whether the peer already went
        if self._error is None and ep.alive:  # live: close it, so that the peer sees it go
            with contextlib.suppress(Exception):
                ep.close()
        self._dead_ep = ep  # UCX's objects go only with the connection

    def _finish(self) -> None:
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            error = self._error
            on_lost(error if isinstance(error, ProtocolError) else self._why_exc())

    @property
    def closed(self) -> bool:
        return self._closed


class UcxListener(Listener):
    def __init__(self, listener: Any, url: str, tasks: set[asyncio.Future[None]]) -> None:
        self._listener = listener
        self.url = url
        self._tasks = tasks

    async def close(self) -> None:
        self._listener = None
        for task in list(self._tasks):
            task.cancel()


class UcxTransport(Transport):
    """``ucx://host:port`` (see the module docstring)."""

    scheme = "ucx"

    async def connect(self, address: Address) -> Connection:
        driver = _driver()
        host = address.host or "127.0.0.1"
        try:
            ep = ucx_api.UCXEndpoint.create(driver.worker, host, address.port or 0, True)
        except Exception as exc:
            raise ConnectionClosed(f"cannot connect to {address.url()}: {exc}") from None
        driver.soon()
        return UcxConnection(driver, ep, self.limits, f"{host}:{address.port}")

    async def listen(self, address: Address, handler: ConnectionHandler) -> Listener:
        driver = _driver()
        tasks: set[asyncio.Future[None]] = set()
        holder: list[Any] = []

        def accept(conn_request: Any) -> None:
            ep = holder[0].create_endpoint_from_conn_request(conn_request, True)
            conn = UcxConnection(driver, ep, self.limits, "ucx-peer")
            task: asyncio.Future[None] = asyncio.ensure_future(handler(conn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        def on_request(conn_request: Any, *args: Any) -> None:  # inside progress
            driver.loop.call_soon(accept, conn_request)

        try:
            listener = ucx_api.UCXListener.create(driver.worker, address.port or 0, on_request)
        except Exception as exc:
            raise ConnectionClosed(f"cannot listen on {address.url()}: {exc}") from None
        holder.append(listener)
        host = address.host or "127.0.0.1"
        return UcxListener(listener, Address(self.scheme, host, listener.port).url(), tasks)
