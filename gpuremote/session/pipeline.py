"""A client's session with a proxy (``ClientSession``, made by
``gpuremote.session.connection``): the command pipeline of one connection, the handles it
chooses, its pending replies, deferred errors and counters. The proxy's side of the same
session is ``gpuremote.proxy.session``.

ASYNC calls are appended to a queue and sent together as one frame, when the session's
batching policy says (``gpuremote.session.batching``): when a SYNC call needs the wire, when
the batch is full, when control returns to the event loop (or ``flush_delay_us`` after the
first queued call), or on ``flush()``.
SYNC calls are matched to their replies by sequence number. A failed ASYNC call is reported by
the proxy in the reply to the next SYNC call and raised there as ``RemoteCallError``.

With ``async_calls`` off, every call makes its own round trip before the next is sent (the
Python code is not blocked, but nothing overlaps on the wire); with ``batching`` off, every
call is sent in a frame of its own at once. Replys are the same either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..aio import spin_until_done
from ..config import PipelineConfig
from ..errors import (
    ConnectionClosed,
    GpuRemoteError,
    LocalProtocolError,
    RemoteProtocolError,
)
from ..transports import Connection
from ..wire.calls import BUFFER, CALLS_BY_NAME, CALLS_BY_OPCODE, Arg, CallSpec
from ..wire.framing import Frame
from ..wire.limits import MAX_LIST, WIRE_INT_MAX, WIRE_INT_MIN
from ..wire.protocol import (
    FATAL,
    NOTICE,
    OWN,
    REPLY,
    check_encodable,
    decode_message,
    decode_replies,
    fatal_error,
)
from ..wire.protocol import encode_request as _encode_request
from .batching import BatchPolicy
from .contract import Counters, Recorder, Reply

__all__ = ["ClientSession"]

_FREE, _FREE_BUFFERS = CALLS_BY_NAME["free"], CALLS_BY_NAME["free_buffers"]
_FREES_PER_COMMAND = MAX_LIST  # the protocol's longest list of handles
_FREE_BYTES = 64 << 20  # device memory that may wait for the end of a batch to be freed


def _check_sendable(value: Any, spec: CallSpec, depth: int = 0) -> None:
    """Raise ``OverflowError`` / ``TypeError`` (naming the call) for a value that the wire
    cannot carry, so that the call fails alone, before anything is queued."""
    t = type(value)
    if t is float or t is bool or t is str or value is None:
        return
    if t is int:
        if not WIRE_INT_MIN <= value <= WIRE_INT_MAX:
            raise OverflowError(
                f"{spec.name}: the integer {value} cannot be sent (a 64-bit integer is the most "
                "a call can carry)"
            )
        return
    if depth < 4:
        if t is list or t is tuple:
            for v in value:
                _check_sendable(v, spec, depth + 1)
            return
        if t is dict:
            for k, v in value.items():
                if type(k) is not str:
                    raise TypeError(f"{spec.name}: a parameter name must be a str, not {k!r}")
                _check_sendable(v, spec, depth + 1)
            return
    raise TypeError(
        f"{spec.name}: an argument of type {t.__name__} cannot be sent (ints, floats, bools, "
        "strings and lists or dicts of them can)"
    )


def _check_values(spec: CallSpec, args: list[Any]) -> None:
    """Raise, naming the call, for a value of the caller's that the wire cannot carry."""
    for i in spec.value_args:
        a = args[i]
        t = type(a)
        if t is dict:  # a launch's params: mostly floats and small ints, checked inline
            for v in a.values():
                tv = type(v)
                if not (
                    tv is float
                    or tv is str
                    or tv is bool
                    or v is None
                    or (tv is int and WIRE_INT_MIN <= v <= WIRE_INT_MAX)
                ):
                    _check_sendable(a, spec)
                    break
        elif t is not int or not WIRE_INT_MIN <= a <= WIRE_INT_MAX:
            if spec.args[i].kind is Arg.KERNEL_ARGS:  # ["a", array] entries: not values
                a = [k[2:] for k in a if k[:1] != ["a"]]
            _check_sendable(a, spec)


class _Released:
    """Buffers released and not yet freed: their handles, appended from any thread (by
    finalizers) and taken on the loop (deque appends and pops are atomic: none is lost), and
    about the bytes they hold (a reason to free them before the next frame)."""

    __slots__ = ("handles", "nbytes")

    def __init__(self) -> None:
        self.handles: deque[int] = deque()
        self.nbytes = 0

    def add(self, handle: int, nbytes: int) -> None:
        self.handles.append(handle)
        self.nbytes += nbytes

    def due(self) -> bool:
        """Enough waits to be freed now, without waiting for the next frame."""
        return len(self.handles) >= _FREES_PER_COMMAND or self.nbytes >= _FREE_BYTES

    def take(self) -> list[int]:
        self.nbytes = 0
        handles, taken = self.handles, []
        while handles:
            taken.append(handles.popleft())
        return taken


class _Batch:
    """The next frame being built: its commands ``[seq, opcode, stream, args, ack]``, its
    out-of-band buffers (and their bytes), its table of array descriptors (each sent and
    checked once per frame), and when its first command came."""

    __slots__ = ("arrays", "buffers", "commands", "index", "nbytes", "started")

    def __init__(self) -> None:
        self.commands: list[list[Any]] = []
        self.buffers: list[memoryview] = []
        self.nbytes = 0
        self.arrays: list[list[Any]] = []
        self.index: dict[int, int] = {}  # id(array descriptor) -> its index in arrays
        self.started = 0.0

    def intern(self, wire: list[Any]) -> int:
        """The index of array descriptor ``wire`` in the frame's table."""
        key = id(wire)
        index = self.index.get(key)
        if index is None:
            index = self.index[key] = len(self.arrays)
            self.arrays.append(wire)  # kept alive until sent, so its id stays unique
        return index

    def encode(self, local_calls: int) -> Frame:
        """The request frame (``local_calls``: the client's count of LOCAL calls)."""
        return _encode_request(self.commands, self.buffers, self.arrays, local_calls)


class ClientSession:
    """Queues, batches and sends calls over ``conn``; matches replies; tracks errors."""

    def __init__(self, conn: Connection, config: PipelineConfig = PipelineConfig()) -> None:
        self.conn = conn
        self.config = config
        #: when queued calls go (``gpuremote.session.batching``: the knobs are ``config``'s)
        self.policy = BatchPolicy(config)
        self.counters = Counters()
        #: seconds spent in ``call`` (sending a call, then waiting for its reply)
        self.call_s = 0.0
        self._loop = asyncio.get_running_loop()
        self._seq = 0
        self._handles = itertools.count(1)
        self._batch = _Batch()  # the next frame
        self._flush_scheduled: asyncio.Handle | asyncio.TimerHandle | None = None
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._released = _Released()  # freed with the next frame
        self._one_by_one = _OneByOne(self)  # with async_calls off
        self._error: BaseException | None = None
        self._unsent = _Unsent()  # ASYNC calls that could not be sent
        self._closing = False
        #: the step being captured (``gpuremote.core.capture``): calls that wait are refused
        self.recorder: Recorder | None = None
        self.notices: deque[Any] = deque(maxlen=64)  # the proxy's latest notices
        self.shutting_down = False
        #: the URL this session was opened to (``gpuremote.session.connection.open_session``)
        self.url = ""
        #: called once with the error when the session fails (connection lost, no reply in
        #: time, a bad reply): how a failover session learns that its proxy is gone
        self.on_fail: Callable[[BaseException], None] | None = None
        conn.set_receiver(self._on_frame, self._on_lost)

    # -- handles ---------------------------------------------------------------------------
    def new_handle(self) -> int:
        """A fresh client-chosen handle (no round trip; safe from any thread)."""
        return next(self._handles)

    def count_local(self, n: int = 1, shadow_bytes: int = 0) -> None:
        """Count a call answered on the client (``shadow_bytes``: what it saved moving)."""
        self.counters.calls["local"] += n

    @property
    def closed(self) -> bool:
        return self._closing or self._error is not None

    def check_open(self) -> None:
        if self._error is not None:
            if isinstance(self._error, GpuRemoteError):
                raise type(self._error)(str(self._error))
            raise ConnectionClosed(str(self._error))
        if self._closing:
            raise ConnectionClosed("the session is closed")
        if self.shutting_down:
            raise ConnectionClosed("the proxy is shutting down")

    # -- submitting ------------------------------------------------------------------------
    def _command(
        self,
        spec: CallSpec,
        stream: int,
        args: list[Any],
        buffer: memoryview | None,
        ack: bool | int,
    ) -> list[Any]:
        """The wire form of a call; ``ack`` is its last item as it is sent: ``True``, ``False``
        or ``OWN`` (the proxy tells ``True`` from ``1``, so a bool stays a bool)."""
        if spec.value_args:
            _check_values(spec, args)
        self._seq += 1
        seq = self._seq
        batch = self._batch
        if buffer is not None:
            args = [len(batch.buffers) if a is BUFFER else a for a in args]
            batch.buffers.append(buffer)
            batch.nbytes += buffer.nbytes
        positions = spec.array_args
        if positions:
            intern = batch.intern
            for i, kind in positions:
                a = args[i]
                if kind is Arg.ARRAY:
                    args[i] = intern(a)
                elif kind is Arg.ARRAYS:
                    args[i] = [intern(w) for w in a]
                else:
                    args[i] = [["a", intern(k[1])] if k[0] == "a" else k for k in a]
        return [seq, spec.opcode, stream, args, ack]

    def submit(
        self,
        spec: CallSpec,
        stream: int,
        args: list[Any],
        buffer: memoryview | None = None,
        *,
        then_call: bool = False,
    ) -> None:
        """Queue an ASYNC call; returns at once. It is sent with the frame of the next call
        that waits, or once the batch is full, or at the loop's next turn (not arranged with
        ``then_call``: a call that waits comes right after)."""
        self.check_open()
        self.counters.calls["async"] += 1
        if self._released.handles and (self._released.due() or not self.config.async_calls):
            self._queue_frees()
        if not self.config.async_calls:
            cmd = self._command(spec, stream, args, buffer, ack=True)
            self._batch.commands.append(cmd)
            self._one_by_one.send()
            return
        batch = self._batch
        if not batch.commands:
            batch.started = time.perf_counter()
        batch.commands.append(self._command(spec, stream, args, buffer, ack=False))
        policy = self.policy
        if not self.config.batching or policy.frame_full(
            len(batch.commands), batch.nbytes, time.perf_counter() - batch.started
        ):
            self._flush_now()
        elif self._flush_scheduled is None and not then_call:
            if policy.flush_delay_s:
                self._flush_scheduled = self._loop.call_later(
                    policy.flush_delay_s, self._flush_callback
                )
            else:
                self._flush_scheduled = self._loop.call_soon(self._flush_callback)

    async def call(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> Reply:
        """Send a SYNC call (after everything queued) and wait for its reply."""
        t0 = time.perf_counter()
        try:
            return await self.wait(self.start_call(spec, stream, args, buffer), spec.name)
        finally:
            self.call_s += time.perf_counter() - t0

    def start_call(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> asyncio.Future[Reply]:
        """Send a SYNC call (after everything queued); returns the future of its reply, which
        ``wait`` waits for (on the session's loop)."""
        self.check_open()
        if self.recorder is not None:
            self.recorder.refuse(f"{spec.name} (it waits for the device's answer)")
        if self._unsent.errors:  # an earlier ASYNC call could not be sent: raised here, once
            self._flush_now()
            raise self._unsent.errors.popleft()
        self.counters.calls["sync"] += 1
        if self._released.handles:
            self._queue_frees()
        return self._send_awaited(self._command(spec, stream, args, buffer, ack=False))

    def _send_awaited(self, cmd: list[Any]) -> asyncio.Future[Reply]:
        """Send ``cmd`` (after everything queued) now; the future of its reply."""
        fut: asyncio.Future[Reply] = self._loop.create_future()
        self._pending[cmd[0]] = fut
        self._batch.commands.append(cmd)
        if self.config.async_calls:
            self._flush_now()
            self.counters.round_trips += 1
        else:
            self._one_by_one.send()
        return fut

    def plain_wait(self) -> bool:
        """Whether ``wait`` only awaits the future (no spinning, no timeout): then a caller
        driving the loop may wait for the future itself."""
        return not self.config.spin_us and self.config.call_timeout_s is None

    async def wait(self, fut: asyncio.Future[Reply], what: str) -> Reply:
        """The reply of a started call (``what`` names it in a timeout's error)."""
        if self.config.spin_us:
            spin_until_done(fut, self.config.spin_us / 1e6)
        timeout = self.config.call_timeout_s
        if timeout is None:
            return await fut
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            exc = ConnectionClosed(f"no reply to {what} within {timeout} s: the proxy is gone")
            self.fail(exc)
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: it is raised here instead
            raise exc from None

    async def ack(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> None:
        """Send an ASYNC call now and wait until the proxy has run it (used to borrow a
        caller's buffer without copying it); its error, if any, is deferred as usual."""
        self.check_open()
        if self.recorder is not None:
            self.recorder.refuse(f"{spec.name} (host data sent to the device)")
        await self.wait(self.start_ack(spec, stream, args, buffer), spec.name)

    def start_own_call(
        self, spec: CallSpec, stream: int, args: list[Any], *, now: bool = True
    ) -> asyncio.Future[Reply]:
        """A call of the client's own (a failover checkpoint's copy, read or
        synchronisation), sent now; the future of its answer (an ASYNC call's is ``None``
        once it has run). It runs even on a stream whose work is skipped, its failure is its
        answer, and an error of the application's stays pending for the application's next
        synchronising call (and so does what that error skips). ``now=False``: sent with the
        next frame."""
        self.check_open()
        self.counters.calls[spec.kind] += 1
        if self._released.handles:
            self._queue_frees()
        cmd = self._command(spec, stream, args, None, ack=OWN)
        if now or not self.config.async_calls:
            return self._send_awaited(cmd)
        fut: asyncio.Future[Reply] = self._loop.create_future()
        self._pending[cmd[0]] = fut
        self._batch.commands.append(cmd)
        self.flush_soon()
        return fut

    def start_ack(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> asyncio.Future[Reply]:
        """``ack``'s call sent now; returns the future of its acknowledgement."""
        self.counters.calls["async"] += 1
        return self._send_awaited(self._command(spec, stream, args, buffer, ack=True))

    async def flush(self, wait: bool = False) -> None:
        """Send everything queued; with ``wait``, also wait for it to run and raise any
        deferred error (one round trip)."""
        if wait:
            await self.call(CALLS_BY_NAME["device_synchronize"], 0, [])
            return
        self.check_open()
        if self._released.handles:  # what was released goes too (alone, if nothing else is queued)
            self._queue_frees()
        if self._batch.commands:
            if self.config.async_calls:
                self._flush_now()
            else:
                self._one_by_one.send()
        await self.conn.drain()

    def send_queued(self) -> None:
        """Send what is queued (frees too) now, in one frame, without waiting for the
        transport's buffer to drain (with ``async_calls`` off: left to ``flush``)."""
        self.check_open()
        if self.config.async_calls:
            self._flush_now()

    def release(self, handle: int, nbytes: int = 0) -> None:
        """Free buffer ``handle`` of ``nbytes`` later (safe from finalizers, in any thread):
        with the frame being built, in one command, or sooner once many bytes wait."""
        if self.closed:
            return
        self._released.add(handle, nbytes)
        if asyncio._get_running_loop() is self._loop:
            if self._flush_scheduled is None and self.config.async_calls:
                self._flush_scheduled = self._loop.call_soon(self._flush_callback)
        else:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(self._flush_callback)

    def defer_free(self, handle: int, nbytes: int = 0) -> None:
        """``release`` for a caller about to send (a call or a flush follows at once): the
        handle joins the next frame's frees and nothing is scheduled."""
        if not self.closed:
            self._released.add(handle, nbytes)

    def flush_soon(self) -> None:
        """Send what is queued (frees too) at the loop's next turn (call on the loop)."""
        if self._flush_scheduled is None and self.config.async_calls and not self.closed:
            self._flush_scheduled = self._loop.call_soon(self._flush_callback)

    def _queue_frees(self) -> None:
        frees = self._released.take()
        if not self.config.async_calls:  # one round trip per call, as for every other call
            self._one_by_one.frees(frees)
            return
        commands, command = self._batch.commands, self._command
        for i in range(0, len(frees), _FREES_PER_COMMAND):
            self.counters.calls["async"] += 1
            chunk = frees[i : i + _FREES_PER_COMMAND]
            if len(chunk) == 1:
                commands.append(command(_FREE, 0, chunk, None, ack=False))
            else:
                commands.append(command(_FREE_BUFFERS, 0, [chunk], None, ack=False))

    # -- flushing --------------------------------------------------------------------------
    def _flush_callback(self) -> None:
        self._flush_scheduled = None
        if self.closed:
            return
        if self._released.handles:
            self._queue_frees()
        if self._batch.commands and self.config.async_calls:
            self._flush_now()

    def _flush_now(self) -> None:
        # a flush due at the loop's next turn stays due: it finds this frame gone and sends
        # what is queued by then, if anything (what a new one would do), and a release or a
        # submit before that turn schedules nothing (a call_soon and a cancel less an op);
        # a batching window (``flush_delay_us``) starts again with the next submit
        if self._flush_scheduled is not None and self.policy.flush_delay_s:
            self._flush_scheduled.cancel()
            self._flush_scheduled = None
        if self._released.handles and self.config.async_calls:
            self._queue_frees()
        batch = self._batch
        if not batch.commands:
            return
        try:
            frame = batch.encode(self.counters.calls["local"])
        except (OverflowError, TypeError, ValueError):
            batch.commands = self._unsent.drop(batch.commands, self._pending)  # a call the
            # checks let through: it fails alone
            if not batch.commands:
                self._batch = _Batch()
                return
            frame = batch.encode(self.counters.calls["local"])
        self._batch = _Batch()
        self._send(frame)

    def _send(self, frame: Frame) -> None:
        try:
            self.conn.send(frame)
        except GpuRemoteError as exc:
            self.fail(exc)
            raise
        self.counters.frames_sent += 1
        self.counters.bytes_sent += frame.nbytes

    # -- receiving -------------------------------------------------------------------------
    def _on_lost(self, exc: BaseException) -> None:
        if not isinstance(exc, GpuRemoteError):
            exc = RemoteProtocolError(f"bad reply: {type(exc).__name__}: {exc}")
        self.fail(exc)

    def _on_frame(self, frame: Frame) -> None:
        self.counters.frames_received += 1
        self.counters.bytes_received += frame.nbytes
        msg = decode_message(frame)
        kind = msg[0]
        if kind == REPLY:
            for reply in decode_replies(frame, msg):
                fut = self._pending.pop(reply.seq, None)
                if self.shutting_down and not self._pending:
                    self._loop.call_soon(self.fail, ConnectionClosed("the proxy shut down"))
                if fut is None or fut.done():
                    continue
                if reply.ok:
                    fut.set_result((reply.value, frame.buffers))
                else:
                    fut.set_exception(reply.value.to_exception())
        elif kind == FATAL:
            raise fatal_error(msg)
        elif kind == NOTICE:
            self.notices.append(msg[1:])
            if msg[1:2] == ["shutdown"]:
                self.shutting_down = True  # replies in flight still come; new calls fail
                if not self._pending:
                    self.fail(ConnectionClosed("the proxy is shutting down"))
        else:
            raise RemoteProtocolError(f"unexpected message type {kind}")

    def fail(self, exc: BaseException) -> None:
        """The session is lost (``exc`` says how): every call waiting fails with it, the
        connection is closed, and ``on_fail`` is told (once)."""
        first = self._error is None
        if first:
            self._error = exc
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(
                    type(exc)(str(exc))
                    if isinstance(exc, GpuRemoteError)
                    else ConnectionClosed(str(exc))
                )
        self.conn.close()
        if first and self.on_fail is not None and not self._closing:
            self.on_fail(exc)

    # -- closing ---------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Send what is queued, then close the connection."""
        if self._closing:
            return
        if self._error is None:
            with contextlib.suppress(GpuRemoteError):
                if self._released.handles:
                    self._queue_frees()
                if self._batch.commands and self.config.async_calls:
                    self._flush_now()
                await self._one_by_one.sent()
                await asyncio.wait_for(self.conn.drain(), 10)
        self._closing = True
        if self._flush_scheduled is not None:
            self._flush_scheduled.cancel()
        self.conn.close()
        if self._pending:
            self.fail(ConnectionClosed("the session was closed"))


class _Unsent:
    """Calls that could not be encoded (the checks let them through): each fails alone, a
    SYNC call at once, an ASYNC one at the next synchronising call (as a deferred error
    would)."""

    def __init__(self) -> None:
        self.errors: deque[LocalProtocolError] = deque()  # for the next synchronising calls

    def fail(self, cmd: list[Any], exc: Exception, awaited: asyncio.Future[Reply] | None) -> None:
        """``cmd`` cannot be encoded (``exc``): at once if its caller waits for it
        (``awaited``), else at the next synchronising call."""
        err = LocalProtocolError(
            f"call #{cmd[0]} {CALLS_BY_OPCODE[cmd[1]].name} was not sent: an argument cannot "
            f"be encoded ({type(exc).__name__}: {exc})"
        )
        if awaited is not None:
            awaited.set_exception(err)
        else:
            self.errors.append(err)

    def drop(
        self, commands: list[list[Any]], pending: dict[int, asyncio.Future[Reply]]
    ) -> list[list[Any]]:
        """``commands`` without those that cannot be encoded (each fails), and without the
        next synchronising call, where one failed before it (it raises that error)."""
        keep = []
        for cmd in commands:
            try:
                check_encodable(cmd)
            except (OverflowError, TypeError, ValueError) as exc:
                self.fail(cmd, exc, pending.pop(cmd[0], None))
                continue
            if CALLS_BY_OPCODE[cmd[1]].sync and self.errors:  # the next sync point: it
                fut = pending.pop(cmd[0], None)  # raises instead of running
                if fut is not None:
                    fut.set_exception(self.errors.popleft())
                    continue
            keep.append(cmd)
        return keep


class _OneByOne:
    """With ``async_calls`` off: each call in a frame of its own, sent once the one before it
    is answered (one round trip per call, strictly in order)."""

    def __init__(self, session: ClientSession) -> None:
        self._session = session
        self._frames: deque[tuple[Frame, asyncio.Future[Reply]]] = deque()
        self._task: asyncio.Task[None] | None = None

    def send(self) -> None:
        """Send the call just queued (the queue holds that one command, and the buffers, if
        any, are its), after those before it."""
        s = self._session
        batch, s._batch = s._batch, _Batch()
        for cmd in batch.commands:
            fut = s._pending.get(cmd[0])
            awaited = fut is not None  # a SYNC call or an ack: its caller waits for it
            if fut is None:
                fut = s._pending[cmd[0]] = s._loop.create_future()
            one = len(batch.commands) == 1
            bufs, arrays = (batch.buffers, batch.arrays) if one else ([], [])
            try:
                frame = _encode_request([cmd], bufs, arrays, s.counters.calls["local"])
            except (OverflowError, TypeError, ValueError) as exc:  # this call fails alone
                del s._pending[cmd[0]]
                s._unsent.fail(cmd, exc, fut if awaited else None)
                continue
            self._frames.append((frame, fut))
        if self._task is None or self._task.done():
            self._task = s._loop.create_task(self._sender())

    async def _sender(self) -> None:
        s = self._session
        while self._frames:
            frame, fut = self._frames.popleft()
            try:
                s._send(frame)
            except GpuRemoteError:
                return
            s.counters.round_trips += 1
            with contextlib.suppress(BaseException):
                await asyncio.shield(fut)

    def frees(self, handles: list[int]) -> None:
        """Free ``handles``, one call each."""
        s = self._session
        for h in handles:
            s.counters.calls["async"] += 1
            s._batch.commands.append(s._command(_FREE, 0, [h], None, ack=True))
            self.send()

    async def sent(self) -> None:
        """Wait until every call handed to it is sent (and answered)."""
        if self._task is not None:
            await self._task
