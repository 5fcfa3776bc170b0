"""One client's session on the proxy: its connection, authentication, executor, device
queue and the replies in flight.

``on_frame`` runs in the transport's read callback: it decodes and validates the frame,
checks the client's proof before anything runs, and hands the batch to the session's
``DeviceQueue`` (inline when cheap, else on a worker); ``deliver`` sends each batch's replies
in order. ``on_lost`` ends the session; ``run()`` serves it until then and frees everything
it holds once its device work in flight has finished.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import time
import types
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

from ..errors import (
    AuthenticationError,
    ConnectionClosed,
    GpuRemoteError,
    LimitExceeded,
    ProtocolError,
)
from ..transports import Connection
from ..wire.auth import new_nonce, verify
from ..wire.framing import Frame, FrameLimits
from ..wire.protocol import (
    PROTOCOL_VERSION,
    BadCommandAt,
    Command,
    ErrorInfo,
    Reply,
    decode_batch,
    encode_fatal,
    encode_greeting,
    encode_replies,
)
from .deadlines import Deadlines
from .devicequeue import DeviceQueue, Result, estimate_ns
from .executor import Executor
from .monitor import SessionFigures
from .scheduler import FairScheduler

__all__ = ["HANDSHAKE_LIMITS", "MAX_BATCHES_IN_FLIGHT", "ProxySession"]

log = logging.getLogger("gpuremote.proxy")

#: batches of one session queued for its worker before the proxy stops reading from it
MAX_BATCHES_IN_FLIGHT = 8

#: what a connection may send before its handshake is done: one small frame with no
#: buffers (the hello); the transport refuses anything larger before allocating for it
HANDSHAKE_LIMITS = FrameLimits(
    max_frame_bytes=16 << 10, max_meta_bytes=16 << 10, max_buffers=0, max_commands=1
)


@types.coroutine
def _outcome(future: asyncio.Future[str]) -> Generator[Any, None, str]:
    """``await future``, without the C future's iterator: asyncio keeps 255 freed ones on
    a free list, and a flood's would pin the memory it used (as ``Future.__await__``)."""
    if not future.done():
        future._asyncio_future_blocking = True
        yield future
    return future.result()


def _ended_deliver(result: Any) -> None:
    """What a session's device queue delivers to once the session has ended: nothing."""


class ProxySession:
    """See the module docstring. ``executor`` holds the session's resources; ``pool`` runs
    its batches off the loop."""

    def __init__(
        self,
        conn: Connection,
        executor: Executor | Callable[[], Executor],
        pool: concurrent.futures.Executor,
        *,
        sid: int = 0,
        limits: FrameLimits = FrameLimits(),
        secret: bytes | None = None,
        inline_us: float = 1000.0,
        handshake_timeout_s: float | None = None,
        on_handshake_timeout: Callable[[ProxySession], None] | None = None,
        scheduler: FairScheduler | None = None,
        deadlines: Deadlines[ProxySession] | None = None,
    ) -> None:
        self.conn = conn
        self.sid = sid
        # the executor (handle tables, streams) is made once the client is in: a connection
        # that never completes the handshake holds only its socket and a small buffer
        self._make_executor = executor if callable(executor) else lambda: executor
        self._executor: Executor | None = None if callable(executor) else executor
        self._pool = pool
        self._inline_us = inline_us
        self._queue: DeviceQueue | None = None
        self._scheduler = scheduler  # fair order among sessions (None: run as they come)
        self._waiting = 0  # batches waiting in the scheduler for their turn
        self.figures = SessionFigures(self.sid, conn.peer)
        self.limits = limits
        self.task: asyncio.Task[Any] | None = None
        self._loop = asyncio.get_running_loop()
        self._secret = secret
        self._nonce = new_nonce()
        self.authenticated = secret is None
        self._ended: asyncio.Future[str] = self._loop.create_future()
        self._drainer: asyncio.Task[None] | None = None
        self._refused = False
        self._reading_paused = False
        #: perf_counter_ns at each batch's arrival, and the bytes of its buffers
        self._frame_started: deque[tuple[int, int]] = deque()
        #: buffer bytes received for this session and not yet consumed by its batches: they
        #: count against its memory quota from the moment their frame's header announces them
        self.received_bytes = 0
        #: batches held back while the data of a peer_import is fetched (and those after it)
        self._held: deque[tuple[list[Command | BadCommandAt], list[memoryview]]] = deque()
        self._fetcher: asyncio.Task[None] | None = None
        self.ready = False  # the handshake is done: the first frame was accepted
        self.refused_in_handshake = False  # ended for what it sent before its handshake
        self.final_stats: dict[str, Any] | None = None  # the executor's, at the end
        self._on_handshake_timeout = on_handshake_timeout
        if deadlines is None and handshake_timeout_s is not None:
            deadlines = Deadlines(handshake_timeout_s, ProxySession._handshake_expired, self._loop)
        # the handshake deadline: the proxy's one timer for all its sessions' (see deadlines.py)
        self._deadlines = deadlines

    @property
    def executor(self) -> Executor:
        """The session's executor (made at the first use)."""
        if self._executor is None:
            self._executor = self._make_executor()
        return self._executor

    @property
    def started(self) -> bool:
        """Whether the session has an executor yet (its client completed the handshake)."""
        return self._executor is not None

    @property
    def queue(self) -> DeviceQueue:
        """The session's device queue (made at the first use)."""
        if self._queue is None:
            executor = self.executor
            self._queue = DeviceQueue(
                executor.execute,
                self._pool,
                self.deliver,
                queues_work=executor.backend.queues_work,
                inline_us=self._inline_us,
                step_ns=self._step_ns,
            )
        return self._queue

    def _step_ns(self, handle: int) -> float:
        """A recorded step's estimated cost, once per step (unknown yet: infinite)."""
        step = self.executor.steps.get(handle)
        if step is None:
            return math.inf
        if step.cost_ns is None:
            step.cost_ns = estimate_ns(step.calls, self.executor.backend.queues_work)
        return step.cost_ns

    # -- serving ---------------------------------------------------------------------------
    async def run(self) -> str:
        """Greet the client and serve it until the connection ends; returns why it ended."""
        self.task = asyncio.current_task()
        reason = "proxy shutting down"
        try:
            with contextlib.suppress(ConnectionClosed):  # gone already: on_lost says why
                self.conn.send(
                    encode_greeting(PROTOCOL_VERSION, self._secret is not None, self._nonce)
                )
            self.conn.set_receiver(self.on_frame, self.on_lost)
            if self._deadlines is not None and not self.ready:
                self._deadlines.add(self)
            reason = await _outcome(self._ended)
        finally:
            await self._close()
        return reason

    def end(self, reason: str) -> None:
        """End the session (the connection is closed; work in flight finishes first)."""
        if not self._ended.done():
            self._ended.set_result(reason)
        self.conn.close()

    async def _close(self) -> None:
        self.conn.close()
        if self._scheduler is not None:
            self._scheduler.forget(self.sid)
        if self._deadlines is not None:
            self._deadlines.discard(self)
        if self._drainer is not None:
            self._drainer.cancel()
        if self._fetcher is not None:
            self._fetcher.cancel()
        self._held.clear()
        if self._queue is not None:
            dropped = self._queue.cancel()
            if dropped:
                log.info(
                    "session %d: %d queued batch(es) dropped with the client", self.sid, dropped
                )
            with contextlib.suppress(asyncio.CancelledError):
                await self._queue.idle()  # what runs on the device now finishes before the free
        if self._queue is not None:  # no cycle (session -> queue -> session.deliver) left
            self._queue._deliver = _ended_deliver
        executor = self._executor
        if executor is None:
            return
        self.final_stats = executor.stats()  # what it held, before it is freed
        if executor.backend.queues_work:
            # freeing waits for the streams' work: off the loop
            await self._loop.run_in_executor(None, executor.close)
        else:
            executor.close()

    def _handshake_expired(self) -> None:
        if self.ready or self._ended.done() or self._deadlines is None:
            return
        timeout = self._deadlines.delay_s
        log.warning(
            "session %d: %s did not complete the handshake within %g s",
            self.sid,
            self.conn.peer,
            timeout,
        )
        if self._on_handshake_timeout is not None:
            self._on_handshake_timeout(self)
        with contextlib.suppress(GpuRemoteError):
            self.conn.send(encode_fatal(f"no handshake within {timeout:g} s"))
        self._refused = True
        self.end("handshake timeout")

    # -- receiving -------------------------------------------------------------------------
    def on_frame(self, frame: Frame) -> None:
        """A frame from the client (in the transport's read callback)."""
        if self._refused:
            return
        t0 = time.perf_counter_ns()
        fig = self.figures
        fig.frames_in += 1
        fig.bytes_in += frame.nbytes
        try:
            commands, local_calls = decode_batch(frame, self.limits)
        except ProtocolError as exc:
            self.refuse(f"protocol error: {exc}")
            return
        if not self.ready and not self._handshake(commands):
            return
        started = len(self._frame_started)
        try:
            self._accept(frame, local_calls, commands, t0)
        except Exception as exc:  # the proxy's own fault: this batch fails, the session goes on
            while len(self._frame_started) > started:
                self.received_bytes -= self._frame_started.pop()[1]
            self._batch_failed(commands, exc)

    def _handshake(self, commands: list[Command | BadCommandAt]) -> bool:
        """The first frame: the hello alone (with the proof, where the proxy has a secret),
        or the connection is refused. Then the connection takes frames of any size."""
        first = commands[0] if len(commands) == 1 else None
        if type(first) is not Command or first.spec.name != "hello":
            log.warning("session %d: %s sent something else than a hello", self.sid, self.conn.peer)
            if self._secret:
                self.refuse("authentication failed", AuthenticationError.__name__)
            else:
                self.refuse("expected a hello first")
            return False
        if not self.authenticated:  # nothing runs before the proof is checked
            if self._secret is None or not verify(self._secret, self._nonce, first.args[1]):
                log.warning("session %d: %s failed authentication", self.sid, self.conn.peer)
                self.refuse("authentication failed", AuthenticationError.__name__)
                return False
            self.authenticated = True
        self.ready = True
        if self._deadlines is not None:
            self._deadlines.discard(self)
        self.conn.admit(self._reserve)
        return True

    def _reserve(self, nbytes: int) -> None:
        """A frame announces ``nbytes`` of buffers (nothing allocated yet): they count
        against the session's memory quota, with what it holds on the device, until its
        batch has run; past the quota the connection ends (``LimitExceeded``)."""
        limit = self.executor.limits.max_device_bytes
        held = self.executor.device_bytes + self.received_bytes
        if held + nbytes > limit:
            raise LimitExceeded(
                f"a frame of {nbytes} bytes of buffers would take the session past its memory "
                f"quota ({held} bytes held or in flight; the limit is {limit})"
            )
        self.received_bytes += nbytes

    def _batch_failed(self, commands: list[Command | BadCommandAt], exc: Exception) -> None:
        """Handling a batch raised: log it with its traceback, and answer each of its
        commands with a proxy error that names what failed."""
        log.error("session %d: a batch failed in the proxy", self.sid, exc_info=exc)
        what = f"proxy error while handling this batch: {type(exc).__name__}: {exc}"
        replies = []
        for cmd in commands:
            call = cmd.spec.name if isinstance(cmd, Command) else cmd.call
            info = ErrorInfo(cmd.seq, call, None, "ProxyError", what, False, 0)
            replies.append(Reply(cmd.seq, False, info))
        with contextlib.suppress(GpuRemoteError):
            self.conn.send(encode_replies(replies, []))

    def _accept(
        self,
        frame: Frame,
        local_calls: int | None,
        commands: list[Command | BadCommandAt],
        t0: int,
    ) -> None:
        if local_calls is not None:
            self.figures.local_calls = local_calls
        nbytes = 0
        for b in frame.buffers:
            nbytes += b.nbytes
        self._frame_started.append((t0, nbytes))
        peers = self.executor.peers
        if self._held or (peers is not None and peers.wanted(commands)):
            # data from other proxies first, on the loop; later batches keep their order
            self._held.append((commands, frame.buffers))
            if self._fetcher is None:
                self._fetcher = self._loop.create_task(self._fetch_held())
        else:
            self._dispatch(commands, frame.buffers)
        if self.queue.in_flight + self._waiting + len(self._held) >= MAX_BATCHES_IN_FLIGHT:
            self._pause()  # the device is behind: take no more until it catches up

    def _dispatch(self, commands: list[Command | BadCommandAt], buffers: list[memoryview]) -> None:
        """Hand a batch to the device queue (through the scheduler, where there is one)."""
        queue = self.queue
        if self._scheduler is None:
            queue.submit(commands, buffers)
        else:
            cost = queue.estimate(commands)
            self._waiting += 1
            self._scheduler.run(self.sid, cost, lambda: self._run_batch(commands, buffers, cost))

    async def _fetch_held(self) -> None:
        """Fetch the peer data of the held batches, then dispatch them, in order."""
        peers = self.executor.peers
        assert peers is not None
        try:
            while self._held and not self._ended.done():
                commands, buffers = self._held[0]
                if peers.wanted(commands):
                    await peers.fetch(commands)
                self._held.popleft()
                if not self._ended.done():
                    self._dispatch(commands, buffers)
        except Exception as exc:
            self._internal_error(exc)
        finally:
            self._fetcher = None
        self._maybe_resume()

    def _run_batch(
        self, commands: list[Command | BadCommandAt], buffers: list[memoryview], cost: float
    ) -> None:
        """The scheduler's turn for one batch."""
        self._waiting -= 1
        if self._ended.done():
            return
        try:
            self.queue.submit(commands, buffers, cost)
        except Exception as exc:
            if self._frame_started:
                self.received_bytes -= self._frame_started.pop()[1]
            self._batch_failed(commands, exc)
            return
        if self._reading_paused:
            self._maybe_resume()

    def deliver(self, result: Result | BaseException) -> None:
        """A batch's result (on the loop, in order): send its replies."""
        t0, nbytes = self._frame_started.popleft() if self._frame_started else (0, 0)
        self.received_bytes -= nbytes
        if not t0:
            t0 = time.perf_counter_ns()
        if isinstance(result, BaseException):
            self._internal_error(result)
            return
        replies, buffers = result
        if replies and not self.conn.closed:
            reply = encode_replies(replies, buffers)
            try:
                self.conn.send(reply)
            except GpuRemoteError:
                return  # the connection is gone: on_lost ends the session
            fig = self.figures
            fig.frames_out += 1
            fig.bytes_out += reply.nbytes
            fig.sync_latency(time.perf_counter_ns() - t0)
            if self.conn.pending_bytes and self._drainer is None:
                # reply buffers may be device memory, and the client is slow to read:
                # take no more commands until they are out (backpressure)
                self._pause()
                self._drainer = self._loop.create_task(self._wait_drained())
        if self._reading_paused:
            self._maybe_resume()

    def on_lost(self, exc: BaseException) -> None:
        """The connection ended (``exc`` says how)."""
        if isinstance(exc, ConnectionClosed):
            self.end("client closed the connection")
        elif isinstance(exc, ProtocolError):
            if not self.ready:
                self.refused_in_handshake = True
            self.end(f"protocol error: {exc}")
        else:
            self._internal_error(exc)

    # -- flow control and errors -----------------------------------------------------------
    def _pause(self) -> None:
        if not self._reading_paused:
            self._reading_paused = True
            self.conn.pause_reading()

    def _maybe_resume(self) -> None:
        if (
            self._reading_paused
            and self._drainer is None
            and self.queue.in_flight + self._waiting + len(self._held) < MAX_BATCHES_IN_FLIGHT
            and not self._refused
            and not self.conn.closed
        ):
            self._reading_paused = False
            self.conn.resume_reading()

    async def _wait_drained(self) -> None:
        try:
            await self.conn.drain()
        except GpuRemoteError:
            return
        finally:
            self._drainer = None
        self._maybe_resume()

    def refuse(self, why: str, kind: str = "ProtocolError") -> None:
        """Tell the client why (FATAL, and the ``kind`` of error it raises for it), read
        nothing more, and close soon after."""
        if not self.ready:
            self.refused_in_handshake = True
        self._refused = True
        with contextlib.suppress(GpuRemoteError):
            self.conn.send(encode_fatal(why, kind))
        self._pause()
        self._loop.call_later(0.5, self.end, why)  # let the FATAL out first

    def _internal_error(self, exc: BaseException) -> None:
        log.error("session %d: internal error", self.sid, exc_info=exc)
        with contextlib.suppress(GpuRemoteError):
            self.conn.send(encode_fatal(f"internal error: {type(exc).__name__}"))
        self.end(f"internal error: {type(exc).__name__}: {exc}")
