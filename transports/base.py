"""The one small interface that every transport implements.

A transport moves *frames* (``gpuremote.wire.framing.Frame``: metadata bytes plus out-of-band
buffers) between a client and a proxy. ``send`` never blocks and never copies a payload: it
keeps references to the frame's buffers until they are handed to the network, so the caller
must not change them until ``drain()`` returns. Received buffers belong to the receiver.
Errors of the underlying library are mapped to ``gpuremote.errors`` at this edge.
"""

from __future__ import annotations

import abc
import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from gpuremote.errors import ConfigError, ConnectionClosed, ProtocolError
from gpuremote.wire.framing import Frame, FrameLimits

__all__ = [
    "Address",
    "Connection",
    "ConnectionHandler",
    "FrameInbox",
    "FramedConnection",
    "Listener",
    "Transport",
]


@dataclass(frozen=True)
class Address:
    """A parsed transport URL: ``scheme://host:port?opt=value`` (``inproc://name``)."""

    scheme: str
    host: str
    port: int | None
    options: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, url: str) -> Address:
        parts = urlsplit(url)
        if not parts.scheme or "://" not in url:
            raise ConfigError(f"not a transport URL: {url!r} (expected scheme://host:port)")
        try:
            port = parts.port
        except ValueError:
            raise ConfigError(f"bad port in {url!r}") from None
        host = parts.hostname or parts.netloc
        return cls(parts.scheme, host, port, dict(parse_qsl(parts.query)))

    def url(self) -> str:
        """The URL back (options dropped)."""
        hostpart = f"[{self.host}]" if ":" in self.host else self.host
        port = f":{self.port}" if self.port is not None else ""
        return f"{self.scheme}://{hostpart}{port}"


class Connection(abc.ABC):
    """One end of an established connection."""

    peer: str = "?"

    @abc.abstractmethod
    def send(self, frame: Frame) -> None:
        """Queue ``frame`` for sending; returns at once. Raises ``ConnectionClosed`` if closed."""

    @abc.abstractmethod
    async def drain(self) -> None:
        """Wait until every queued frame has been handed to the network."""

    @abc.abstractmethod
    async def recv(self) -> Frame:
        """The next frame; raises ``ConnectionClosed`` when the peer is gone."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close now; pending ``recv`` calls fail with ``ConnectionClosed``."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @property
    def pending_bytes(self) -> int:
        """Bytes queued by ``send`` and not yet handed to the network."""
        return 0

    @property
    def device_memory(self) -> bool:
        """Whether this connection moves device memory itself: ``send`` takes device arrays
        as buffers, and large received buffers may land in device memory (from the
        transport's ``device_allocate``). False unless a transport says so (ucx://)."""
        return False

    def set_receiver(
        self, on_frame: Callable[[Frame], None], on_lost: Callable[[BaseException], None]
    ) -> None:
        """Push mode, instead of ``recv()``: call ``on_frame(frame)`` for each frame as it
        arrives, and ``on_lost(exc)`` once when the connection ends. An exception raised by
        ``on_frame`` closes the connection. Transports override this to skip the task hop."""

        async def pump() -> None:
            try:
                while True:
                    on_frame(await self.recv())
            except asyncio.CancelledError:
                on_lost(ConnectionClosed("connection closed"))
                raise
            except BaseException as exc:
                self.close()
                on_lost(exc)

        self._pump_task = asyncio.get_running_loop().create_task(pump())

    def admit(self, reserve: Callable[[int], None] | None = None) -> None:  # noqa: B027
        """The peer is in (its handshake is done): from now on take frames up to the
        transport's full limits, into the memory the listener was given (a backend's pinned
        or device memory). Until then a connection accepted with ``handshake_limits`` takes
        only frames within those, into fresh host memory of their exact size.

        ``reserve(nbytes)``, where given, is called with each frame's buffer bytes as soon
        as its header gives them, before any of that memory is allocated: it raises
        ``LimitExceeded`` to refuse (the connection then ends with that error)."""

    def pause_reading(self) -> None:  # noqa: B027 - optional
        """Stop taking frames from the network until ``resume_reading()`` (backpressure)."""

    def resume_reading(self) -> None:  # noqa: B027 - optional
        """Undo ``pause_reading()``."""


ConnectionHandler = Callable[[Connection], Awaitable[None]]


class FrameInbox:
    """Frames received and not yet taken by ``recv()``, and the one task waiting for them:
    the pull side that every connection shares."""

    def __init__(self) -> None:
        self.frames: deque[Frame] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self.frames)

    def put(self, frame: Frame) -> None:
        self.frames.append(frame)
        self.wake()

    def wake(self) -> None:
        """Wake the waiting ``get()`` (a frame came, or the connection ended)."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def drain_to(self, on_frame: Callable[[Frame], None]) -> None:
        """Hand every queued frame to ``on_frame`` (when switching to push mode)."""
        while self.frames:
            on_frame(self.frames.popleft())

    async def get(self, ended: Callable[[], BaseException | None]) -> Frame:
        """The next frame; once none is left and ``ended()`` gives an error, raise it."""
        while True:
            if self.frames:
                return self.frames.popleft()
            exc = ended()
            if exc is not None:
                raise exc
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class FramedConnection(Connection):
    """What the transports' connections share: the frames received and not taken yet
    (``recv``), the receiver they go to instead (``set_receiver``), and the one way a
    connection ends: the first error is kept (``_fail``), the connection closes, and the
    receiver's ``on_lost`` is told once (``_tell_lost``) with the error it ended by: a
    protocol error, or the receiver's own, as it is; anything else as ``ConnectionClosed``
    (``_closed_error``, in the transport's words)."""

    def __init__(self) -> None:
        self._inbox = FrameInbox()
        self._receiver: Callable[[Frame], None] | None = None
        self._on_lost: Callable[[BaseException], None] | None = None
        self._receiver_error: BaseException | None = None  # the receiver's own fault
        self._error: BaseException | None = None  # what ended the connection first
        self._closed = False
        self._drainers: list[asyncio.Future[None]] = []  # drain() calls waiting

    @abc.abstractmethod
    def _closed_error(self) -> ConnectionClosed:
        """The connection is closed (as this transport says why)."""

    def _end_error(self) -> BaseException:
        """What the connection ended by, as its receiver is told and ``recv`` raises."""
        error = self._error
        if isinstance(error, ProtocolError) or (
            error is not None and error is self._receiver_error
        ):
            return error
        return self._closed_error()

    def _fail(self, exc: BaseException) -> None:
        """End the connection because of ``exc`` (the first error is the one kept)."""
        if self._error is None:
            self._error = exc
        self.close()

    def _hand_on(self, frame: Frame) -> bool:
        """Give ``frame`` to the receiver; False if the receiver raised (the connection
        then ends with that error)."""
        receiver = self._receiver
        if receiver is None:
            self._inbox.put(frame)
            return True
        try:
            receiver(frame)
        except Exception as exc:
            self._receiver_error = exc
            self._fail(exc)
            return False
        return True

    def _wake_drainers(self) -> None:
        """Wake every ``drain()``; each re-checks the connection (and raises if it is
        closed)."""
        drainers, self._drainers = self._drainers, []
        for fut in drainers:
            if not fut.done():
                fut.set_result(None)

    def _tell_lost(self) -> None:
        """Tell the receiver, once, that the connection ended (and drop it: no cycle through
        its owner)."""
        self._receiver = None
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            on_lost(self._end_error())

    def set_receiver(
        self, on_frame: Callable[[Frame], None], on_lost: Callable[[BaseException], None]
    ) -> None:
        self._receiver, self._on_lost = on_frame, on_lost
        self._inbox.drain_to(on_frame)  # anything that arrived before
        if self._closed:
            self._tell_lost()

    async def recv(self) -> Frame:
        return await self._inbox.get(lambda: self._end_error() if self._closed else None)

    @property
    def closed(self) -> bool:
        return self._closed


class Listener(abc.ABC):
    """A listening endpoint; ``url`` is the address clients connect to, ``bound`` the
    addresses it really listens on (as URLs; none for a listener off the network)."""

    url: str
    bound: tuple[str, ...] = ()

    @abc.abstractmethod
    async def close(self) -> None: ...


class Transport(abc.ABC):
    """Connects and listens for one URL scheme."""

    scheme: str

    def __init__(
        self,
        limits: FrameLimits = FrameLimits(),
        settings: Mapping[str, Any] | None = None,
        allocate: Callable[[int], memoryview] | None = None,
    ) -> None:
        self.limits = limits
        #: where received buffers go (a backend's pinned host memory, say); None: fresh
        #: NumPy memory. Transports that receive into memory they choose use it
        self.allocate = allocate
        #: where a transport that moves device memory itself may receive large buffers (a
        #: backend's ``device_allocator``), set by ``listen``; None: host memory only
        self.device_allocate: Callable[[int], Any] | None = None
        #: the limits of what an accepted connection takes before ``Connection.admit()`` (its
        #: handshake: nothing large, nothing into ``allocate``'s or ``device_allocate``'s
        #: memory), set by ``listen``; None: the full ``limits`` from the start
        self.handshake_limits: FrameLimits | None = None
        #: defaults for the options a URL may carry (``?key=value`` wins), from the caller:
        #: a transport reads no configuration of its own
        self.settings: Mapping[str, Any] = settings or {}

    @abc.abstractmethod
    async def connect(self, address: Address) -> Connection: ...

    @abc.abstractmethod
    async def listen(self, address: Address, handler: ConnectionHandler) -> Listener:
        """Accept connections at ``address``; run ``handler(conn)`` as a task for each."""
