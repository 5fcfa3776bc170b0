"""``emu+SCHEME://...?rtt=50us&bw=10gbit``: an emulated network link around any transport.

Used on either side (on one side only: on both, the delays add up), it delays both
directions: each frame waits a one-way latency of
``rtt / 2`` (plus up to ``jitter``), and occupies the link for ``bytes * 8 / bw``, frames
queueing behind each other. With ``mode=pipelined`` (the default, as a real link) latency
overlaps and only bandwidth serialises; ``mode=serialized`` reproduces the emulator of the
paper's code, where each message waits for the previous one's arrival, latency included.

Delays of tens of microseconds cannot come from event-loop timers (millisecond grain): a
frame due within 2 ms is released by polling the clock on every turn of the event loop (so
the loop keeps serving I/O meanwhile); longer waits sleep on a timer until 1 ms before the
deadline. The emulated delays add to what the real transport underneath costs; measure the
bare path in the same run and compare (``gpuremote bench emu``). Where the kernel's netem is
available (``tc qdisc add dev lo root netem delay 25us rate 10gbit``), it emulates the kernel's
path instead; it needs root and a Linux network namespace, which is why this one is built in.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gpuremote.errors import ConfigError, ConnectionClosed
from gpuremote.wire.framing import Frame, FrameLimits

from .base import Address, Connection, ConnectionHandler, FrameInbox, Listener, Transport

__all__ = [
    "EmulatedConnection",
    "EmulatedTransport",
    "LinkModel",
    "parse_bandwidth",
    "parse_duration",
]

_UNITS_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_UNITS_BPS = {
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 1.0,
    "kbps": 1e3,
    "mbps": 1e6,
    "gbps": 1e9,
    "b": 8.0,
    "kb": 8e3,
    "mb": 8e6,
    "gb": 8e9,
}
#: options of the wrapped transports that an emu+ URL passes on to them
_INNER_OPTIONS = frozenset({"copy", "hop", "cert", "key", "ca", "shm", "device"})
_SPIN_BELOW = 0.002  # closer deadlines: poll the clock on every turn of the event loop
_BUSY_BELOW = 50e-6  # closer still: busy-wait without yielding


def parse_duration(text: str) -> float:
    """``"50us"`` -> 5e-05 seconds (units ns, us, ms, s; bare numbers are seconds)."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zµ]*)\s*", text)
    if not m or (m.group(2) and m.group(2) not in _UNITS_S):
        raise ConfigError(f"bad duration {text!r} (e.g. 50us, 1.5ms)")
    return float(m.group(1)) * _UNITS_S.get(m.group(2) or "s", 1.0)


def parse_bandwidth(text: str) -> float:
    """``"10gbit"`` -> 1e10 bits/s (bit, kbit, mbit, gbit, tbit; b, kb, mb, gb are bytes/s)."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z/]*)\s*", text)
    unit = (m.group(2).lower().replace("/s", "") if m else "") or "bit"
    if not m or unit not in _UNITS_BPS:
        raise ConfigError(f"bad bandwidth {text!r} (e.g. 10gbit, 100mbit)")
    value = float(m.group(1)) * _UNITS_BPS[unit]
    if value <= 0:
        raise ConfigError(f"bandwidth must be positive: {text!r}")
    return value


class LinkModel:
    """When a message of ``nbytes`` put on one direction of the link arrives."""

    def __init__(
        self,
        rtt_s: float,
        bw_bps: float | None,
        jitter_s: float = 0.0,
        mode: str = "pipelined",
        seed: int | None = None,
    ) -> None:
        if mode not in ("pipelined", "serialized"):
            raise ConfigError(f"mode must be pipelined or serialized, not {mode!r}")
        self.one_way = rtt_s / 2
        self.bw = bw_bps
        self.jitter = jitter_s
        self.mode = mode
        self._rng = random.Random(seed)
        self._free = 0.0  # when the link finishes sending what it has
        self._last = 0.0  # the last arrival (FIFO)

    def wire_time(self, nbytes: int) -> float:
        return 0.0 if self.bw is None else nbytes * 8 / self.bw

    def arrival(self, now: float, nbytes: int) -> float:
        wire = self.wire_time(nbytes)
        jitter = self._rng.uniform(0, self.jitter) if self.jitter else 0.0
        if self.mode == "serialized":
            t = max(now, self._last) + self.one_way + wire + jitter
        else:
            self._free = max(now, self._free) + wire
            t = max(self._free + self.one_way + jitter, self._last)
        self._last = t
        return t


class _Pump:
    """Releases queued actions at their deadlines, precisely (see the module docstring)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        # per direction: [deadline, action, latency] in deadline order
        self._queues: list[deque[list[Any]]] = [deque(), deque()]
        self._fresh = [0, 0]  # items at each queue's end that no run has seen yet
        self._handle: asyncio.Handle | None = None
        self.late_total_s = 0.0  # lateness of every frame released, added up
        #: lateness counted from when the pump could first run after the deadline: the
        #: emulator's own (its polling, the process losing its CPU), not other callbacks'
        self.late_own_s = 0.0
        self.released = 0
        self._runnable_at = 0.0  # when the pump's next run was due

    def at(
        self, queue: int, deadline: float, action: Callable[[], None], latency: float = 0.0
    ) -> None:
        """Run ``action`` at ``deadline``, and no sooner than ``latency`` (the frame's own
        one-way time: latency and wire time) after the pump first runs after this call: the
        turn of the event loop that brings the pump here is the real path's own cost, as a
        receiver's wake-up is, so the link's time does not hide it (else an emulated link
        would add less than it says to the bare path)."""
        self._queues[queue].append([deadline, action, latency])
        self._fresh[queue] += 1
        if self._handle is None:
            self._runnable_at = time.perf_counter()
            self._handle = self._loop.call_soon(self._run)

    def empty(self, queue: int) -> bool:
        return not self._queues[queue]

    def _run(self) -> None:
        self._handle = None
        now = time.perf_counter()
        for i, q in enumerate(self._queues):
            n = len(q)
            for k in range(n - self._fresh[i], n):
                item = q[k]
                item[0] = max(item[0], now + item[2])
            self._fresh[i] = 0
        while True:
            now = time.perf_counter()
            for i, q in enumerate(self._queues):
                while q and q[0][0] <= now:
                    deadline, action, _ = q.popleft()
                    if self._fresh[i] > len(q):  # queued by an action of this run, and due
                        self._fresh[i] = len(q)
                    self.late_total_s += now - deadline
                    self.late_own_s += now - max(deadline, self._runnable_at)
                    self.released += 1
                    action()
            heads = [q[0][0] for q in self._queues if q]
            if not heads:
                return
            wait = min(heads) - time.perf_counter()
            if wait > _BUSY_BELOW:
                break
            while time.perf_counter() < min(heads):  # the last few µs: spin right here
                pass
        if wait > _SPIN_BELOW:
            self._runnable_at = time.perf_counter() + wait - 0.001
            self._handle = self._loop.call_later(wait - 0.001, self._run)
        else:
            self._runnable_at = time.perf_counter()
            self._handle = self._loop.call_soon(self._run)  # poll the clock each loop turn

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        for q in self._queues:
            q.clear()
        self._fresh = [0, 0]


_OUT, _IN = 0, 1


class EmulatedConnection(Connection):
    """A connection whose frames cross an emulated link in both directions."""

    def __init__(self, inner: Connection, out_link: LinkModel, in_link: LinkModel) -> None:
        self._inner = inner
        self._out, self._in = out_link, in_link
        self._scheduler = _Pump()
        self.peer = inner.peer
        self._inbox = FrameInbox()
        self._receiver: Callable[[Frame], None] | None = None
        self._on_lost: Callable[[BaseException], None] | None = None
        self._lost_exc: BaseException | None = None
        self._drained: asyncio.Event = asyncio.Event()
        self._drained.set()
        #: time spent in the receiver, handling the frames the link delivered (a proxy
        #: running its batches there: its own time, not the emulator's polling)
        self.busy_s = 0.0
        inner.set_receiver(self._arrived, self._inner_lost)

    # outgoing: held until the emulated link would have delivered it
    def send(self, frame: Frame) -> None:
        if self._inner.closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed")
        deadline = self._out.arrival(time.perf_counter(), frame.nbytes)
        self._drained.clear()
        after = self._out.one_way + self._out.wire_time(frame.nbytes)
        self._scheduler.at(_OUT, deadline, lambda: self._forward(frame), after)

    def _forward(self, frame: Frame) -> None:
        with contextlib.suppress(ConnectionClosed):  # the loss is reported on the receive side
            self._inner.send(frame)
        if self._scheduler.empty(_OUT):
            self._drained.set()

    async def drain(self) -> None:
        await self._drained.wait()
        await self._inner.drain()

    @property
    def pending_bytes(self) -> int:
        return self._inner.pending_bytes

    # incoming
    def _arrived(self, frame: Frame) -> None:
        deadline = self._in.arrival(time.perf_counter(), frame.nbytes)
        after = self._in.one_way + self._in.wire_time(frame.nbytes)
        self._scheduler.at(_IN, deadline, lambda: self._deliver(frame), after)

    def _deliver(self, frame: Frame) -> None:
        if self._receiver is not None:
            t0 = time.perf_counter()
            try:
                self._receiver(frame)
            finally:
                self.busy_s += time.perf_counter() - t0
            return
        self._inbox.put(frame)

    def _inner_lost(self, exc: BaseException) -> None:
        # the loss arrives after the frames that were on the link
        self._scheduler.at(_IN, self._in.arrival(time.perf_counter(), 0), lambda: self._lost(exc))

    def _lost(self, exc: BaseException) -> None:
        self._lost_exc = exc
        self._inbox.wake()
        on_lost, self._on_lost = self._on_lost, None
        if on_lost is not None:
            on_lost(exc)

    def set_receiver(
        self, on_frame: Callable[[Frame], None], on_lost: Callable[[BaseException], None]
    ) -> None:
        self._receiver, self._on_lost = on_frame, on_lost
        self._inbox.drain_to(on_frame)
        if self._lost_exc is not None:
            self._lost(self._lost_exc)

    async def recv(self) -> Frame:
        return await self._inbox.get(
            lambda: None if self._lost_exc is None else ConnectionClosed(str(self._lost_exc))
        )

    def admit(self, reserve: Callable[[int], None] | None = None) -> None:
        self._inner.admit(reserve)

    def pause_reading(self) -> None:
        self._inner.pause_reading()

    def resume_reading(self) -> None:
        self._inner.resume_reading()

    def close(self) -> None:
        self._scheduler.cancel()
        self._drained.set()
        self._inner.close()
        if self._lost_exc is None:  # what was still on the link is dropped with it
            self._lost(ConnectionClosed(f"connection to {self.peer} is closed"))

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def set_link(self, rtt_s: float, bw_bps: float | None) -> None:
        """Change the link's round trip and bandwidth (both directions) for what is sent
        from now on (a sweep over one session)."""
        for link in (self._out, self._in):
            link.one_way = rtt_s / 2
            link.bw = bw_bps

    @property
    def late_total_s(self) -> float:
        """How late the frames were released after their deadlines, added up: at most this
        much of a run's time is the emulator's own (or the other side's, in one event loop)."""
        return self._scheduler.late_total_s

    @property
    def late_own_s(self) -> float:
        """Like ``late_total_s``, but each frame's lateness counted from when the emulator
        could first release it (its deadline, or when the event loop next ran it if other
        work held the loop): the emulator's own error, added up."""
        return self._scheduler.late_own_s


class EmulatedTransport(Transport):
    """Wraps the transport of the scheme after ``emu+``."""

    def __init__(self, limits: FrameLimits = FrameLimits(), inner: Transport | None = None) -> None:
        super().__init__(limits, None, inner.allocate if inner is not None else None)
        if inner is None:
            raise ConfigError("emu+ needs a transport to wrap, e.g. emu+tcp://host:port")
        self.inner = inner
        self.scheme = f"emu+{inner.scheme}"

    @staticmethod
    def links(address: Address) -> tuple[LinkModel, LinkModel]:
        opts = address.options
        unknown = set(opts) - {"rtt", "bw", "jitter", "mode", "seed"} - _INNER_OPTIONS
        if unknown:
            raise ConfigError(f"unknown emulator option(s): {', '.join(sorted(unknown))}")
        rtt = parse_duration(opts.get("rtt", "0"))
        bw = parse_bandwidth(opts["bw"]) if "bw" in opts else None
        jitter = parse_duration(opts.get("jitter", "0"))
        mode = opts.get("mode", "pipelined")
        seed = int(opts["seed"]) if "seed" in opts else None
        return (
            LinkModel(rtt, bw, jitter, mode, seed),
            LinkModel(rtt, bw, jitter, mode, None if seed is None else seed + 1),
        )

    def _inner_address(self, address: Address) -> Address:
        keep = {
            k: v
            for k, v in address.options.items()
            if k not in ("rtt", "bw", "jitter", "mode", "seed")
        }
        if self.inner.scheme == "inproc":  # a frame arrives at a turn of the receiver's
            keep.setdefault("hop", "1")  # loop, as over a network (its wake-up is real cost)
        return Address(self.inner.scheme, address.host, address.port, keep)

    async def connect(self, address: Address) -> Connection:
        out_link, in_link = self.links(address)
        inner = await self.inner.connect(self._inner_address(address))
        return EmulatedConnection(inner, out_link, in_link)

    async def listen(self, address: Address, handler: ConnectionHandler) -> Listener:
        self.links(address)  # check the options now

        async def wrapped(conn: Connection) -> None:
            out_link, in_link = self.links(address)
            await handler(EmulatedConnection(conn, out_link, in_link))

        self.inner.handshake_limits = self.handshake_limits
        # clients connect to the real address: the link is emulated once, on this side
        return await self.inner.listen(self._inner_address(address), wrapped)
