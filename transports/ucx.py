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
import functools
import logging
import os
import struct
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from ucxx._lib import libucxx as ucx_api
from ucxx._lib.arr import Array as UcxArray

from gpuremote.errors import ConnectionClosed, LimitExceeded, ProtocolError, RemoteProtocolError
from gpuremote.wire.auth import is_loopback
from gpuremote.wire.framing import (
    DEVICE_DIRECT_MIN,
    HEADER,
    Frame,
    FrameLimits,
    byte_view,
    check_header,
    check_lengths,
    encode_frame,
    is_device_buffer,
)

from .base import Address, Connection, ConnectionHandler, FramedConnection, Listener, Transport

__all__ = ["Driver", "Prober", "UcxConnection", "UcxListener", "UcxTransport", "get_driver"]

Done = Callable[[BaseException | None], None]

log = logging.getLogger("gpuremote.transports.ucx")

#: how long a closed connection's unfinished requests are kept (UCX ends them at the first
#: progress after their endpoint closes)
REMAINS_S = 1.0
#: how long messages still sent to a closed connection's tag are dropped, and how often
DEAD_TAG_S = 5.0
SWEEP_S = 0.1
#: completions run inside one another at most this deep (each one's callback may take the
#: next message, which has arrived already); deeper ones wait for the next progress
MAX_NESTED = 16


class Prober(Protocol):
    """What waits for a message on its tag: probed again after each progress of the worker."""

    def probe(self) -> None: ...


class Driver:
    """The UCX worker of one event loop and its progress (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_only: bool = False) -> None:
        # weakly: ``_DRIVERS`` is keyed by the loop, and a driver that held its loop would
        # keep both alive (with UCX's context and worker) after the loop is gone
        self._loop = weakref.ref(loop)
        features = (ucx_api.Feature.TAG, ucx_api.Feature.STREAM, ucx_api.Feature.WAKEUP)
        self.local_only = local_only
        self.context = ucx_api.UCXContext(ucx_config(local_only), feature_flags=features)
        self.worker = ucx_api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self._pending: list[tuple[Any, Done, object]] = []
        self._nested = 0  # completions running inside one another now (``track``)
        #: connections waiting for a message on their tag (to be probed after progress)
        self.probers: set[Prober] = set()
        self._scheduled = False
        self.in_progress = False  # inside the worker's progress (its callbacks run there)
        #: the tags of closed connections, and until when messages still sent to them are
        #: received into one byte and dropped (else UCX keeps each as unexpected, forever)
        self._dead_tags: list[tuple[Any, float]] = []
        #: what closed connections leave behind (their unfinished requests and buffers), and
        #: until when: held here, not by the connection, so that no cycle keeps it alive
        self._remains: list[tuple[Any, float]] = []
        self._sweeping: asyncio.TimerHandle | None = None
        loop.add_reader(self.worker.epoll_file_descriptor, self.progress)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this driver runs on."""
        loop = self._loop()
        if loop is None:
            raise ConnectionClosed("ucx://: the event loop of this connection is gone")
        return loop

    def track(self, request: Any, done: Done, owner: object = None) -> None:
        """Call ``done(None)`` (or ``done(exc)``) once ``request`` completes: at once if it
        has, unless completions are nested that deep already (a flood of messages that had
        all arrived: each one's callback takes the next), then from the next progress."""
        if request.completed and self._nested < MAX_NESTED:
            self._nested += 1
            try:
                self._finish(request, done, owner)
            finally:
                self._nested -= 1
            return
        self._pending.append((request, done, owner))
        self.soon()

    def forget(self, owner: object) -> list[Any]:
        """Stop watching ``owner``'s requests (its endpoint is about to close, which ends
        them); returns them with their callbacks (which hold the buffers UCX may still write
        into), to be kept alive until then."""
        mine = [p for p in self._pending if p[2] is owner]
        self._pending = [p for p in self._pending if p[2] is not owner]
        return mine

    def take_message(
        self,
        tag: Any,
        prober: Prober,
        owner: object,
        done: Callable[[BaseException | None, np.ndarray[Any, Any]], None],
        max_length: int | None = None,
    ) -> bool:
        """Receive the next message on ``tag`` into a new buffer of its size, then
        ``done(exc or None, buffer)``; where none came yet, ``prober`` is asked again after
        the next progress. A message longer than ``max_length`` is dropped unread (received
        into one byte: UCX truncates it) and ``done`` gets ``LimitExceeded``: nothing of its
        size is allocated. Returns whether a message was taken."""
        probe = self.worker.tag_probe(tag, remove=True)
        if not probe.matched:
            self.probers.add(prober)
            return False
        self.probers.discard(prober)
        length = probe.length
        if max_length is not None and length > max_length:
            sink = np.empty(1, dtype=np.uint8)
            refused = LimitExceeded(f"a message of {length} bytes; the limit is {max_length}")
            self.track(
                self.worker.tag_recv_with_handle(UcxArray(sink), probe),
                lambda exc: done(refused, sink),
                owner,
            )
            return True
        buf = np.empty(length, dtype=np.uint8)
        self.track(
            self.worker.tag_recv_with_handle(UcxArray(buf), probe),
            lambda exc: done(exc, buf),
            owner,
        )
        return True

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
            if self.probers:
                for conn in list(self.probers):
                    conn.probe()
            if worker.arm():
                return
        self.soon()

    def _complete(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            if item[0].completed:
                self._finish(*item)
            else:
                self._pending.append(item)

    def _finish(self, request: Any, done: Done, owner: object = None) -> None:
        error: BaseException | None = None
        try:
            request.check_error()
        except Exception as exc:  # kept as a value, without this frame (no cycle through it)
            error = exc.with_traceback(None)
        try:
            done(error)
        except Exception as exc:  # a bug in a callback: that one connection fails, alone
            log.error("ucx://: a completion failed", exc_info=exc)
            fail = getattr(owner, "_fail", None)
            if fail is not None:
                self.loop.call_soon(fail, exc)

    def bury(self, tag: Any) -> None:
        """A connection that received on ``tag`` closed: drop what still comes on it (for
        ``DEAD_TAG_S``), swept from the loop every ``SWEEP_S``."""
        self._dead_tags.append((tag, time.monotonic() + DEAD_TAG_S))
        if self._sweeping is None:
            self._sweep()

    def hold(self, remains: Any) -> None:
        """Keep ``remains`` (a closed connection's requests, with the buffers UCX may still
        write into until it ends them) for ``REMAINS_S``."""
        self._remains.append((remains, time.monotonic() + REMAINS_S))
        if self._sweeping is None:
            self._sweep()

    def _sweep(self) -> None:
        self._sweeping = None
        worker, now = self.worker, time.monotonic()
        for tag, _ in self._dead_tags:
            while True:
                probe = worker.tag_probe(tag, remove=True)
                if not probe.matched:
                    break
                sink = np.empty(1, dtype=np.uint8)  # UCX truncates the message into it
                request = worker.tag_recv_with_handle(UcxArray(sink), probe)
                self.track(request, functools.partial(_dropped, sink))
        self._dead_tags = [(tag, until) for tag, until in self._dead_tags if until > now]
        self._remains = [(held, until) for held, until in self._remains if until > now]
        if self._dead_tags or self._remains:
            with contextlib.suppress(ConnectionClosed, RuntimeError):
                self._sweeping = self.loop.call_later(SWEEP_S, self._sweep)

    def close(self) -> None:
        """Stop watching the worker and let UCX's worker and context go."""
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.worker.epoll_file_descriptor)
        self._pending.clear()
        self.probers.clear()
        self._dead_tags.clear()
        self._remains.clear()
        if self._sweeping is not None:
            self._sweeping.cancel()


def _dropped(sink: np.ndarray[Any, Any], exc: BaseException | None) -> None:
    """A message to a closed connection was dropped (``sink`` lived until then)."""


#: the environment variables that ucxx sets itself when imported, with the values it sets
_UCXX_OWN = {
    "UCX_MEMTYPE_CACHE": "n",
    "UCX_RNDV_THRESH": "8192",
    "UCX_RNDV_FRAG_MEM_TYPE": "cuda",
    "UCX_MAX_RNDV_RAILS": "1",
    "UCX_CUDA_COPY_MAX_REG_RATIO": "1.0",
}


def user_ucx_variables() -> dict[str, str]:
    """The ``UCX_*`` environment variables that the user set (not ucxx's own defaults)."""
    return {k: v for k, v in os.environ.items() if k.startswith("UCX_") and _UCXX_OWN.get(k) != v}


def ucx_config(local_only: bool) -> dict[str, str]:
    """The UCX options of a worker's context. ``local_only`` (a listener on a loopback
    address): UCX's network transports use the loopback device only (``NET_DEVICES=lo``;
    shared memory, CMA and self stay), so nothing of UCX's own listens on another address.
    UCX's warnings about environment variables (those ucxx sets itself) are off unless the
    user set ``UCX_*`` variables."""
    config: dict[str, str] = {}
    if local_only:
        config["NET_DEVICES"] = "lo"
    if not user_ucx_variables():
        config["WARN_UNUSED_ENV_VARS"] = "n"
    return config


#: per event loop, its drivers: one for connections out and listeners on any address, one
#: (``local_only``) for listeners on a loopback address
_DRIVERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[bool, Driver]] = (
    weakref.WeakKeyDictionary()
)


def get_driver(local_only: bool = False) -> Driver:
    """The driver of the running loop's UCX worker (``local_only``: the one whose UCX
    transports stay on this host, for listeners on a loopback address), made on first use."""
    loop = asyncio.get_running_loop()
    drivers = _DRIVERS.get(loop)
    if drivers is None:
        for old in [other for other in _DRIVERS if other.is_closed()]:
            for gone in _DRIVERS.pop(old).values():  # the drivers of loops that ended
                gone.close()
        drivers = _DRIVERS[loop] = {}
    driver = drivers.get(local_only)
    if driver is None:
        driver = drivers[local_only] = Driver(loop, local_only)
    return driver


#: the transport's own hello, over the listener's endpoint: magic, flags, tag, address length
_HELLO = struct.Struct("<4sIQI")
_HELLO_MAGIC = b"GRUX"
_FAST = 1  # flag: this side wants worker-address endpoints


async def exchange_hellos(conn: UcxConnection, fast: bool, timeout: float) -> None:
    """The transport's own hello, on the listener's endpoint's stream: each side sends its
    flags, the tag it receives on and (``fast``) its worker's address; where both want it,
    the frames then go as tagged messages on an endpoint made from the peer's worker address
    (what UCX reaches fastest: shared memory or CMA on one host, RDMA where there is some)."""
    worker = conn.driver.worker
    address = worker.address.tobytes() if fast else b""
    tag = int.from_bytes(os.urandom(8), "little")
    conn._stream_send(_HELLO.pack(_HELLO_MAGIC, _FAST if fast else 0, tag, len(address)))
    if address:
        conn._stream_send(address)
    try:
        raw = await asyncio.wait_for(conn._stream_recv(_HELLO.size), timeout)
        magic, flags, peer_tag, n = _HELLO.unpack(raw.tobytes())
        if magic != _HELLO_MAGIC or n > 1 << 16:
            raise RemoteProtocolError("not a gpuremote ucx:// peer (bad hello)")
        peer_address = (await asyncio.wait_for(conn._stream_recv(n), timeout)).tobytes()
    except TimeoutError:
        conn.close()
        raise ConnectionClosed(f"{conn.peer}: no hello within {timeout} s") from None
    except ProtocolError:
        conn.close()
        raise
    if fast and flags & _FAST and peer_address:
        try:
            endpoint = ucx_api.UCXEndpoint.create_from_worker_address(
                worker, ucx_api.UCXAddress.create_from_buffer(peer_address), False
            )
        except Exception as exc:
            conn.close()
            raise ConnectionClosed(f"{conn.peer}: cannot reach its worker: {exc}") from None
        conn.use_worker_address(endpoint, tag, peer_tag)


def _peer_closed(conn: weakref.ref[UcxConnection], *args: Any) -> None:
    """An endpoint's close callback: its connection, if still there, learns that the peer
    went."""
    alive = conn()
    if alive is not None:
        alive._peer_closed()


class UcxConnection(FramedConnection):
    """A UCX endpoint carrying frames.

    Made on the endpoint of UCX's listener (its tcp transport on most hosts), which stays open
    to tell when the peer goes. After the hello, the frames go over an endpoint made from the
    peer's worker address (what UCX reaches fastest: shared memory or CMA on one host, RDMA
    where there is some) as tagged messages, unless either side said no (``?shm=0``)."""

    def __init__(
        self,
        driver: Driver,
        endpoint: Any,
        limits: FrameLimits,
        peer: str,
        allocate: Callable[[int], memoryview] | None = None,
        device_allocate: Callable[[int], Any] | None = None,
        handshake: FrameLimits | None = None,
    ) -> None:
        super().__init__()
        self._driver = driver
        self._device_allocate = device_allocate
        self._ep = endpoint
        self._full_limits = limits
        #: until ``admit()``: the handshake's limits, and fresh host memory only
        self._limits = handshake or limits
        self._admitted = handshake is None
        self._allocate = allocate
        self._reserve: Callable[[int], None] | None = None
        self.peer = peer
        self._paused = False
        self._resume: Callable[[], None] | None = None  # the read to post when resumed
        self._sending = 0  # bytes handed to UCX and not yet sent
        self._keep: dict[int, Any] = {}  # buffers of sends in flight
        self._fast_ep: Any = None  # the worker-address endpoint, once the hello chose it
        self._my_tag: Any = None
        self._peer_tag: Any = None
        #: "worker address" (tagged messages) or "listener" (the stream of the first endpoint)
        self.path = "listener"
        self._hello_wait: asyncio.Future[np.ndarray[Any, Any]] | None = None
        # weakly: the endpoint outlives its close (in ``_dead_eps``), and a bound method would
        # make a cycle that only a full garbage collection frees
        endpoint.set_close_callback(functools.partial(_peer_closed, weakref.ref(self)))

    # -- the hello and the tagged path -----------------------------------------------------
    async def hello(self, fast: bool, timeout: float = 10.0, start: bool = True) -> None:
        """Exchange hellos with the peer (``exchange_hellos``); then frames flow (over the
        path both chose), from ``start`` on."""
        await exchange_hellos(self, fast, timeout)
        if start:
            self._read_header()

    def use_worker_address(self, endpoint: Any, tag: int, peer_tag: int) -> None:
        """Carry frames as tagged messages on ``endpoint`` (made from the peer's worker
        address): received on ``tag``, sent to ``peer_tag``."""
        self._fast_ep = endpoint
        self._my_tag, self._peer_tag = ucx_api.UCXXTag(tag), ucx_api.UCXXTag(peer_tag)
        self.path = "worker address"

    @property
    def driver(self) -> Driver:
        """The progress driver of this connection's worker."""
        return self._driver

    @property
    def tagged(self) -> tuple[Any, Any, Any] | None:
        """The worker-address endpoint, the tag this side receives on and the peer's, once
        the hello chose that path (a bench's bare baseline uses the same)."""
        if self._fast_ep is None:
            return None
        return self._fast_ep, self._my_tag, self._peer_tag

    def _stream_send(self, data: bytes) -> None:
        view = memoryview(data)
        self._keep[id(view)] = view

        def done(exc: BaseException | None, key: int = id(view)) -> None:
            self._keep.pop(key, None)
            if exc is not None:
                self._fail(ConnectionClosed(f"{self.peer}: {exc}"))

        self._driver.track(self._ep.stream_send(UcxArray(view)), done, self)

    async def _stream_recv(self, nbytes: int) -> np.ndarray[Any, Any]:
        fut: asyncio.Future[np.ndarray[Any, Any]] = self._driver.loop.create_future()

        def got(buf: np.ndarray[Any, Any]) -> None:
            if not fut.done():
                fut.set_result(buf)

        self._read(nbytes, got)
        if self._closed:
            raise self._closed_error()
        self._hello_wait = fut
        try:
            return await fut
        finally:
            self._hello_wait = None

    # -- receiving -------------------------------------------------------------------------
    def admit(self, reserve: Callable[[int], None] | None = None) -> None:
        self._limits = self._full_limits
        self._admitted = True
        self._reserve = reserve

    def _max_message(self) -> int:
        """The longest first message of a frame that the limits allow."""
        lim = self._limits
        return HEADER.size + 8 * lim.max_buffers + lim.max_meta_bytes + lim.max_frame_bytes

    def _buffer(self, nbytes: int) -> np.ndarray[Any, Any]:
        if self._allocate is None or nbytes == 0 or not self._admitted:
            return np.empty(nbytes, dtype=np.uint8)
        return np.frombuffer(self._allocate(nbytes), dtype=np.uint8)

    def _read(self, nbytes: int, then: Callable[[np.ndarray[Any, Any]], None]) -> None:
        """The next ``nbytes`` of the listener endpoint's stream."""
        buf = self._buffer(nbytes)
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
        if self._fast_ep is not None:
            self.probe()
        else:
            self._read(HEADER.size, self._got_header)

    def probe(self) -> None:
        """Take the next message on this connection's tag, if one came (else the driver
        probes again after its next progress)."""
        driver = self._driver
        if self._closed or self._paused:
            driver.probers.discard(self)
            if self._paused and not self._closed:
                self._resume = self._read_header
            return

        def done(exc: BaseException | None, buf: np.ndarray[Any, Any]) -> None:
            if isinstance(exc, ProtocolError):
                self._fail(exc)
            elif exc is not None:
                self._fail(ConnectionClosed(f"{self.peer}: {exc}"))
            elif not self._closed:
                self._got_message(buf)

        driver.take_message(self._my_tag, self, self, done, self._max_message())

    def _check_header(self, head: bytes) -> tuple[int, int] | None:
        """The frame's metadata length and buffer count (framing's checks), or ``None``: the
        connection ends."""
        try:
            return check_header(head, 0, self._limits)
        except ProtocolError as exc:
            self._fail(exc)
            return None

    def _check_lengths(self, meta_len: int, lengths: list[int]) -> bool:
        """Whether a frame of these lengths may come (the limits, the session's memory);
        else the connection ends."""
        try:
            total = check_lengths(meta_len, lengths, self._limits) - meta_len
            if self._reserve is not None and total:
                self._reserve(total)
        except LimitExceeded as exc:
            self._fail(exc)
            return False
        return True

    def _got_message(self, raw: np.ndarray[Any, Any]) -> None:
        """A frame's first message on the tagged path: header, lengths, metadata, and the
        buffers too when the sender joined a small frame into one piece."""
        if raw.size < HEADER.size:
            self._fail(RemoteProtocolError(f"a message of {raw.size} bytes: not a frame"))
            return
        checked = self._check_header(raw[: HEADER.size].tobytes())
        if checked is None:
            return
        meta_len, nbufs = checked
        at = HEADER.size + 8 * nbufs
        if raw.size < at + meta_len:
            self._fail(
                RemoteProtocolError(
                    f"a message of {raw.size} bytes is shorter than its header says"
                )
            )
            return
        lengths = list(struct.unpack(f"<{nbufs}Q", raw[HEADER.size : at].tobytes()))
        if not self._check_lengths(meta_len, lengths):
            return
        meta = raw[at : at + meta_len].tobytes()
        at += meta_len
        if raw.size == at + sum(lengths):  # everything in this one message
            bufs = []
            for n in lengths:
                bufs.append(byte_view(raw[at : at + n]))
                at += n
            self._deliver(Frame(meta, bufs))
            self._read_header()
        elif raw.size == at:  # each buffer follows as a message of its own
            self._recv_buffers(meta, lengths)
        else:
            self._fail(
                RemoteProtocolError(f"a message of {raw.size} bytes does not match its frame")
            )

    def _recv_buffers(self, meta: bytes, lengths: list[int]) -> None:
        got: list[memoryview | None] = [None] * len(lengths)
        left = sum(1 for n in lengths if n)

        on_device: set[int] = set()  # buffers received into device memory: handed on as such

        def arrived(i: int, buf: Any, exc: BaseException | None) -> None:
            nonlocal left
            if exc is not None:
                self._fail(ConnectionClosed(f"{self.peer}: {exc}"))
                return
            got[i] = buf if i in on_device else byte_view(buf)
            left -= 1
            if not left and not self._closed:
                self._deliver(Frame(meta, [g for g in got if g is not None]))
                self._read_header()

        device = self._device_allocate if self.device_memory and self._admitted else None
        for i, n in enumerate(lengths):
            buf: Any = None
            if device is not None and n >= DEVICE_DIRECT_MIN:
                buf = device(n)  # UCX receives it straight into device memory
                if buf is not None:
                    on_device.add(i)
            if buf is None:
                buf = self._buffer(n)
            if not n:
                got[i] = byte_view(buf)
                continue
            request = self._fast_ep.tag_recv(UcxArray(buf), self._my_tag)
            self._driver.track(request, functools.partial(arrived, i, buf), self)
        if not left:
            self._deliver(Frame(meta, [g for g in got if g is not None]))
            self._read_header()

    def _got_header(self, head: np.ndarray[Any, Any]) -> None:
        checked = self._check_header(head.tobytes())
        if checked is None:
            return
        meta_len, nbufs = checked
        if nbufs:
            self._read(8 * nbufs, lambda raw: self._got_lengths(meta_len, raw))
        else:
            self._got_lengths(meta_len, np.empty(0, np.uint8))

    def _got_lengths(self, meta_len: int, raw: np.ndarray[Any, Any]) -> None:
        lengths = list(struct.unpack(f"<{len(raw) // 8}Q", raw.tobytes()))
        if not self._check_lengths(meta_len, lengths):
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
        self._hand_on(frame)

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
            raise self._closed_error()
        pieces = encode_frame(frame, self._limits)
        for piece in pieces:
            view: Any = piece
            if not isinstance(piece, memoryview) and not is_device_buffer(piece):
                view = memoryview(piece)
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

            fast = self._fast_ep
            if fast is not None:
                request = fast.tag_send(UcxArray(view), self._peer_tag)
            else:
                request = self._ep.stream_send(UcxArray(view))
            self._driver.track(request, done, self)

    async def drain(self) -> None:
        while self._sending and not self._closed:
            fut = self._driver.loop.create_future()
            self._drainers.append(fut)
            await fut
        if self._closed:
            raise self._closed_error()

    @property
    def pending_bytes(self) -> int:
        return self._sending

    @property
    def device_memory(self) -> bool:
        """Large buffers go as device memory (UCX moves them: cuda_copy, cuda_ipc, GPUDirect
        RDMA) on the worker-address path, where the listener gave a device allocator."""
        return self._device_allocate is not None and self._fast_ep is not None

    # -- ending ----------------------------------------------------------------------------
    def _peer_closed(self) -> None:  # from inside progress: go through the loop
        lost = ConnectionClosed(f"connection closed by {self.peer}")
        self._driver.loop.call_soon(self._fail, lost)

    def _closed_error(self) -> ConnectionClosed:
        return ConnectionClosed(f"{self.peer}: {self._error or 'connection closed'}")

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
        self._driver.probers.discard(self)
        waiting = self._hello_wait
        if waiting is not None and not waiting.done():
            waiting.set_exception(self._closed_error())
        self._wake_drainers()
        self._inbox.wake()
        self._finish()

    def _teardown(self) -> None:
        ep, self._ep = self._ep, None
        if ep is None:
            return
        # nothing reads this endpoint's requests once it closes (closing ends them)
        self._driver.hold(self._driver.forget(self))
        with contextlib.suppress(Exception):
            ep.remove_close_callback()
        self._driver.progress()  # learn first whether the peer already went
        fast, self._fast_ep = self._fast_ep, None
        if self._my_tag is not None:  # what the peer still sends to it is dropped, not kept
            self._driver.bury(self._my_tag)
        if fast is not None:  # its receives posted end with it
            with contextlib.suppress(Exception):
                fast.close()
        if ep.alive:  # live: close it, so that the peer sees it go (closing one that UCX
            # already failed, the peer gone, crashes UCX)
            with contextlib.suppress(Exception):
                ep.close()
        self._dead_eps = (ep, fast)  # UCX's objects go only with the connection

    def _finish(self) -> None:
        self._reserve = None  # no cycle through the receiver's owner
        self._tell_lost()


class UcxListener(Listener):
    """ucxx binds a listener to every interface (it takes a port, not an address): ``bound``
    says so. The connections it accepted live on after ``close`` (their owner ends them: a
    proxy drains its sessions first)."""

    def __init__(self, listener: Any, url: str, holder: list[Any]) -> None:
        self._listener = listener
        self._holder = holder
        self.url = url
        self.bound = (Address("ucx", listener.ip or "0.0.0.0", listener.port).url(),)

    async def close(self) -> None:
        self._listener = None
        self._holder.clear()  # UCX's listener goes with the last reference


class UcxTransport(Transport):
    """``ucx://host:port`` (see the module docstring); ``?shm=0`` keeps the frames on the
    listener's endpoint instead of an endpoint made from the peer's worker address. A proxy on
    a GPU backend receives and sends large buffers as device memory on the worker-address
    path (UCX moves them by cuda_copy, cuda_ipc or GPUDirect RDMA); ``?device=0`` on its
    listen URL stages them through host memory instead."""

    scheme = "ucx"

    def _fast(self, address: Address) -> bool:
        return self._on(address, "shm")

    def _on(self, address: Address, option: str) -> bool:
        value = address.options.get(option, self.settings.get(option, "1"))
        return str(value).lower() not in ("0", "false", "no", "off")

    async def connect(self, address: Address) -> Connection:
        driver = get_driver()
        host = address.host or "127.0.0.1"
        try:
            ep = ucx_api.UCXEndpoint.create(driver.worker, host, address.port or 0, True)
        except Exception as exc:
            raise ConnectionClosed(f"cannot connect to {address.url()}: {exc}") from None
        driver.soon()
        conn = UcxConnection(driver, ep, self.limits, f"{host}:{address.port}", self.allocate)
        await conn.hello(self._fast(address))
        return conn

    async def listen(self, address: Address, handler: ConnectionHandler) -> Listener:
        host = address.host or "127.0.0.1"
        driver = get_driver(local_only=is_loopback(host))
        tasks: set[asyncio.Future[None]] = set()
        holder: list[Any] = []
        fast = self._fast(address)
        device = self.device_allocate if self._on(address, "device") else None
        handshake = self.handshake_limits

        async def serve(conn: UcxConnection) -> None:
            try:
                await conn.hello(fast)
            except (ConnectionClosed, ProtocolError):
                return
            await handler(conn)

        def accept(conn_request: Any) -> None:
            if not holder:  # closed meanwhile
                return
            ep = holder[0].create_endpoint_from_conn_request(conn_request, True)
            conn = UcxConnection(
                driver, ep, self.limits, "ucx-peer", self.allocate, device, handshake
            )
            task: asyncio.Future[None] = asyncio.ensure_future(serve(conn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        def on_request(conn_request: Any, *args: Any) -> None:  # inside progress
            driver.loop.call_soon(accept, conn_request)

        try:
            listener = ucx_api.UCXListener.create(driver.worker, address.port or 0, on_request)
        except Exception as exc:
            raise ConnectionClosed(f"cannot listen on {address.url()}: {exc}") from None
        holder.append(listener)
        return UcxListener(listener, Address(self.scheme, host, listener.port).url(), holder)
