"""``inproc://name``: client and proxy in one process and event loop, no sockets.

Frames are handed over directly; each buffer is copied once on the way (the in-process
"wire"), so neither side ever sees the other's memory change under it. Used by the tests and
to measure what gpuremote's own layers cost without a network.

``inproc://name?copy=0`` hands buffers over as read-only views instead, with no copy: for an
emulated link (``emu+inproc://name?copy=0&bw=100gbit``), whose bandwidth is then the
emulator's alone rather than this machine's memcpy (4 MB take ~1.5 ms to copy here, against
0.17 ms on a 200 Gbit/s wire). The receiver can then neither write into a buffer nor adopt
it as device memory (the executor adopts only writable ones); the sender must not change a
buffer it has sent (gpuremote's client sends snapshots it owns).

A frame is handed to the receiver at once, in the sending thread, with no hop through the
event loop (a synchronous call in one process makes no loop iteration at all: its reply is in
when the send returns). Deliveries never nest: a frame sent while another is being handled
in the same thread (the proxy's reply, sent while it handles the request) is handed on once
that one is done, in the order sent, so that no receiver is re-entered.
``inproc://name?hop=1`` hands each frame on at the event loop's next turn instead, as a
network does (its receiver wakes up for it): what an emulated link (``emu+inproc://``) is
built on, so that it adds its delays to the real path's costs, loop turns included.

Each end counts the time its receiver spent handling what arrived (``busy_s``): in one event
loop, that is the proxy's whole cost of its frames, measured apart from the client's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any

from gpuremote.errors import ConnectionClosed
from gpuremote.wire.framing import Frame, as_bytes_view, check_frame

from .base import Address, Connection, ConnectionHandler, FramedConnection, Listener, Transport

__all__ = ["InprocConnection", "InprocListener", "InprocTransport", "listener"]

_LISTENERS: dict[str, InprocListener] = {}


class _Handing(threading.local):
    """The frames waiting to be handed on in this thread, while one is being handled
    (``None``: none is)."""

    queue: deque[tuple[InprocConnection, Frame]] | None = None


_HANDING = _Handing()


class InprocConnection(FramedConnection):
    """One end of an in-process connection: frames handed to the other end at once."""

    def __init__(self, peer_name: str) -> None:
        super().__init__()
        self.peer = peer_name
        self._peer: InprocConnection | None = None
        self.limits: Any = None
        self.copy = True  # copy buffers on the way (else: read-only views)
        self.hop = False  # frames to this end arrive at the loop's next turn (else: at once)
        self.busy_s = 0.0  # time spent in the receiver, handling frames that arrived
        self.frames_in = 0

    @staticmethod
    def pair(
        name: str, copy: bool = True, hop: bool = False
    ) -> tuple[InprocConnection, InprocConnection]:
        a, b = (
            InprocConnection(f"inproc://{name}#proxy"),
            InprocConnection(f"inproc://{name}#client"),
        )
        a._peer, b._peer = b, a
        a.copy = b.copy = copy
        a.hop = b.hop = hop
        return a, b

    def send(self, frame: Frame) -> None:
        if self._closed or self._peer is None or self._peer._closed:
            raise ConnectionClosed(f"{self.peer}: connection is closed")
        if self.limits is not None:
            check_frame(frame, self.limits)  # the same limit checks as on a byte stream
        if not frame.buffers:
            self._peer._deliver(frame)
            return
        if self.copy:  # a copy of its own, writable, as a socket's reader would have
            buffers = [memoryview(bytearray(as_bytes_view(b))) for b in frame.buffers]
        else:
            buffers = [as_bytes_view(x).toreadonly() for x in frame.buffers]
        self._peer._deliver(Frame(frame.meta, buffers))

    def _receive(self, frame: Frame) -> None:
        if self._receiver is None:
            return
        t0 = time.perf_counter()
        if not self._hand_on(frame):
            self._tell_lost()  # at once: the peer's end learns it at its next turn
        self.busy_s += time.perf_counter() - t0
        self.frames_in += 1

    def _closed_error(self) -> ConnectionClosed:
        return ConnectionClosed(f"{self.peer}: connection closed")

    def _deliver(self, frame: Frame) -> None:
        if self._receiver is None:
            self._inbox.put(frame)
            return
        if self.hop:  # as over a wire: the receiver's own loop turn
            asyncio.get_running_loop().call_soon(self._receive, frame)
            return
        handing = _HANDING
        queue = handing.queue
        if queue is not None:  # a receiver of this thread is busy: after it, in order
            queue.append((self, frame))
            return
        handing.queue = queue = deque()
        try:
            self._receive(frame)
            while queue:
                end, frame = queue.popleft()
                end._receive(frame)
        finally:
            handing.queue = None

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionClosed(f"{self.peer}: connection is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for end in (self, self._peer):
            if end is not None:
                end._closed = True
                end._inbox.wake()
                if end._on_lost is not None:
                    asyncio.get_running_loop().call_soon(end._tell_lost)


class InprocListener(Listener):
    """A proxy listening in this process under an ``inproc://`` name."""

    def __init__(self, name: str, handler: ConnectionHandler, transport: InprocTransport) -> None:
        self.name = name
        self.url = f"inproc://{name}"
        self._handler = handler
        self._transport = transport
        self.handlers: set[asyncio.Task[Any]] = set()
        self.accepted: list[InprocConnection] = []  # the proxy's ends, newest last (bounded)

    def accept(self, conn: InprocConnection) -> None:
        self.accepted = [*self.accepted[-15:], conn]
        task: asyncio.Task[Any] = asyncio.ensure_future(self._handler(conn))
        self.handlers.add(task)
        task.add_done_callback(self.handlers.discard)

    async def close(self) -> None:
        if _LISTENERS.get(self.name) is self:
            del _LISTENERS[self.name]


def listener(name: str) -> InprocListener | None:
    """The listener at ``inproc://name`` in this process, if any."""
    return _LISTENERS.get(name)


class InprocTransport(Transport):
    """``inproc://`` URLs: a client and a proxy in one process."""

    scheme = "inproc"

    async def connect(self, address: Address) -> Connection:
        name = address.host
        listener = _LISTENERS.get(name)
        if listener is None:
            raise ConnectionClosed(f"no in-process proxy listens at inproc://{name}")
        copy = address.options.get("copy", "1") != "0"
        hop = address.options.get("hop", "0") != "0"
        server_end, client_end = InprocConnection.pair(name, copy, hop)
        server_end.limits = listener._transport.limits
        client_end.limits = self.limits
        listener.accept(server_end)
        return client_end

    async def listen(self, address: Address, handler: ConnectionHandler) -> Listener:
        name = address.host
        if not name:
            raise ConnectionClosed("an inproc:// URL needs a name, e.g. inproc://proxy")
        if name in _LISTENERS:
            raise ConnectionClosed(f"inproc://{name} is already in use")
        listener = InprocListener(name, handler, self)
        _LISTENERS[name] = listener
        return listener
