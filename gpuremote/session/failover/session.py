"""``FailoverSession``: the session contract over a session that it moves to another proxy
when its own is lost; its parts are the ledger (``ledger``), the checkpoints
(``checkpoint``), the standby (``standby``) and the move (``move``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ...config import PipelineConfig
from ...errors import (
    ConnectionClosed,
    FailoverError,
    GpuRemoteError,
    LocalProtocolError,
    RemoteProtocolError,
)
from ...wire.calls import CALLS_BY_NAME, CallSpec
from ...wire.framing import FrameLimits
from ..connection import open_session
from ..contract import Recorder, Reply
from ..pipeline import ClientSession
from .checkpoint import Checkpoints, quiet
from .config import FailoverConfig, FailoverCounters, Targets
from .ledger import Answered, Ledger, pack
from .move import Move
from .standby import COPY_HANDLES, Standby

__all__ = ["FailoverSession", "open_failover_session"]

_SYNC = CALLS_BY_NAME["device_synchronize"]


def _is_loss(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionClosed | RemoteProtocolError)


class FailoverSession:
    """A client session that moves to another proxy when its own is lost (see
    ``gpuremote.session.failover``). Made by ``open_failover_session``."""

    def __init__(
        self,
        inner: ClientSession,
        cfg: FailoverConfig,
        targets: Targets,
        options: dict[str, Any],
        limits: FrameLimits,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.failover = cfg
        self.config: PipelineConfig = inner.config
        self.counters = FailoverCounters()
        #: seconds spent in ``call`` (sending a call, then waiting for its reply)
        self.call_s = 0.0
        self.targets = targets
        self._options = options
        self._limits = limits
        #: a fresh client-chosen handle, the same on whichever proxy serves the session
        self.new_handle: Callable[[], int] = itertools.count(1).__next__
        self.copy_handle: Callable[[], int] = itertools.count(COPY_HANDLES).__next__
        self.ledger = Ledger()
        self.checkpoints = Checkpoints(self)
        self.standby = Standby(self)
        self.hook(inner)
        #: the session calls go to now (None while moving)
        self.inner: ClientSession | None = inner
        self.url = inner.url
        self._released: deque[tuple[int, int]] = deque()  # frees from any thread
        self._release_scheduled = False
        #: errors for the next synchronising call
        self.stash: deque[BaseException] = deque()
        #: the futures of calls in flight, each to its journal entry (to re-issue if lost)
        self._awaited: dict[asyncio.Future[Any], Answered] = {}
        self.recovery: asyncio.Task[None] | None = None
        self.moving: ClientSession | None = None  # the session a move is restoring
        self.epoch = 0  # moves so far (a checkpoint of an earlier epoch does not count)
        self.dead: set[str] = set()  # the proxies lost
        self.error: BaseException | None = None  # why the session could not move
        self.closing = False
        #: the step being captured (``gpuremote.core.capture``): calls that wait are refused
        self.recorder: Recorder | None = None
        #: the moves so far (``gpuremote.session.failover.move.Move.record``)
        self.moves: list[dict[str, Any]] = []

    # -- the parts' shared services ---------------------------------------------------------
    def hook(self, session: ClientSession) -> None:
        """Make ``session`` one of this session's: its counters are these, and its loss is
        told here."""
        session.counters = self.counters
        session.on_fail = lambda exc, s=session: self._on_lost(s, exc)

    async def open(self, url: str, extra: dict[str, Any]) -> tuple[ClientSession, dict[str, Any]]:
        """A session on the proxy at ``url``, opened as the first one was."""
        return await open_session(
            url, pipeline=self.config, limits=self._limits, **{**self._options, **extra}
        )

    def outer(self, entry: Answered) -> asyncio.Future[Any]:
        """The future that ``entry``'s answer after a move goes to (made on first use)."""
        if entry.outer is None:
            entry.outer = self._loop.create_future()
        outer: asyncio.Future[Any] = entry.outer
        return outer

    # -- what the front ends use --------------------------------------------------------------
    def count_local(self, n: int = 1, shadow_bytes: int = 0) -> None:
        self.counters.calls["local"] += n

    @property
    def closed(self) -> bool:
        return self.closing or self.error is not None

    @property
    def notices(self) -> deque[Any]:
        return self.inner.notices if self.inner is not None else deque()

    def check_open(self) -> None:
        if self.error is not None:
            raise FailoverError(str(self.error))
        if self.closing:
            raise ConnectionClosed("the session is closed")

    def plain_wait(self) -> bool:
        return False  # a wait may outlive the session it started on

    def submit(
        self,
        spec: CallSpec,
        stream: int,
        args: list[Any],
        buffer: memoryview | None = None,
        *,
        then_call: bool = False,
    ) -> None:
        """Queue an ASYNC call (journaled; sent at once unless the session is moving).
        ``then_call`` is not passed on: the inner session may change before the call."""
        if self.error is not None or self.closing:
            self.check_open()
        inner = self.inner
        try:
            packed = pack(spec, stream, args)
        except (TypeError, ValueError, OverflowError) as exc:
            if inner is not None:
                inner.submit(spec, stream, args, buffer)  # raises, naming what cannot be sent
            raise LocalProtocolError(f"{spec.name}: an argument cannot be sent ({exc})") from None
        # tracked before the session takes ``args`` (it interns the arrays in it); a call it
        # then refuses leaves at most a buffer marked written, or one the proxy lacks (which
        # a checkpoint finds out)
        ledger = self.ledger
        ledger.track(spec, args, buffer, packed)
        if inner is not None:
            try:
                inner.submit(spec, stream, args, buffer)
            except GpuRemoteError as exc:
                if not _is_loss(exc):
                    raise
        ledger.journal_call(packed, buffer)
        cfg = self.failover
        if ledger.full(cfg.journal_max_calls, cfg.journal_max_bytes):
            ledger.checkpoint_due = True
            self.checkpoints.maybe()

    def start_call(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> asyncio.Future[Reply]:
        """Send a SYNC call (after everything queued); the future of its reply, whichever
        proxy gives it."""
        if self.error is not None or self.closing:
            self.check_open()
        if self.recorder is not None:
            self.recorder.refuse(f"{spec.name} (it waits for the device's answer)")
        if self.stash:
            raise self.stash.popleft()
        if self._released:
            self.flush_released()
        checkpoints = self.checkpoints
        if checkpoints.task is None and (
            self.ledger.checkpoint_due
            or time.monotonic() - checkpoints.last >= self.failover.checkpoint_interval_s
        ):
            checkpoints.maybe()
        return self._start(spec, stream, args, buffer, False)

    def _start(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None, ack: bool
    ) -> asyncio.Future[Reply]:
        entry = Answered(spec, stream, args, buffer, ack)
        inner = self.inner
        fut = None
        if inner is not None:
            try:
                fut = (inner.start_ack if ack else inner.start_call)(spec, stream, [*args], buffer)
            except GpuRemoteError as exc:
                if not _is_loss(exc):
                    raise  # not sent (an earlier call that could not be): not journaled
            else:
                self.chain(entry, fut)
        if fut is None:  # journaled only: what the move re-issues must be sendable
            try:
                pack(spec, stream, args)
            except (TypeError, ValueError, OverflowError) as exc:
                raise LocalProtocolError(f"{spec.name}: cannot be sent ({exc})") from None
        self.ledger.begin(entry)
        if fut is None:  # the session is moving: answered once it has moved
            return self.outer(entry)
        self._awaited[fut] = entry  # waited for as it is (no hop), re-issued if lost
        return fut

    async def wait(self, fut: asyncio.Future[Reply], what: str) -> Reply:
        """The reply of a started call; a loss on the way moves the session and the call
        is answered by the next proxy."""
        timeout = self.config.call_timeout_s
        while True:
            inner = self.inner
            try:
                if timeout is None:
                    return await fut
                return await asyncio.wait_for(asyncio.shield(fut), timeout)
            except TimeoutError:
                if inner is not None and inner is self.inner:
                    why = f"no reply to {what} within {timeout} s: proxy gone"
                    inner.fail(ConnectionClosed(why))
            except (ConnectionClosed, RemoteProtocolError):
                entry = self._awaited.pop(fut, None)
                if entry is None or self.error is not None or self.closing:
                    raise
                fut = self.outer(entry)  # answered after the move

    async def call(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> Reply:
        """Send a SYNC call and wait for its reply."""
        t0 = time.perf_counter()
        try:
            return await self.wait(self.start_call(spec, stream, args, buffer), spec.name)
        finally:
            self.call_s += time.perf_counter() - t0

    async def ack(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> None:
        """Send an ASYNC call now and wait until a proxy has run it; the caller's buffer is
        copied into the journal first (the caller may change it once this returns)."""
        self.check_open()
        if self.recorder is not None:
            self.recorder.refuse(f"{spec.name} (host data sent to the device)")
        if self._released:
            self.flush_released()
        own = memoryview(bytearray(buffer)) if buffer is not None else None
        await self.wait(self._start(spec, stream, args, own, True), spec.name)

    async def flush(self, wait: bool = False) -> None:
        """Send everything queued; with ``wait``, also wait for it to run."""
        if wait:
            await self.call(_SYNC, 0, [])
            return
        self.check_open()
        if self._released:
            self.flush_released()
        inner = self.inner
        if inner is not None:
            with contextlib.suppress(ConnectionClosed, RemoteProtocolError):
                await inner.flush()

    def send_queued(self) -> None:
        """Send what is queued now (see ``flush``), without waiting on the transport."""
        self.check_open()
        if self._released:
            self.flush_released()
        inner = self.inner
        if inner is not None and not inner.closed:
            with contextlib.suppress(ConnectionClosed, RemoteProtocolError):
                inner.send_queued()

    def release(self, handle: int, nbytes: int = 0) -> None:
        """Free buffer ``handle`` later (safe from finalizers, in any thread)."""
        if self.closing or self.error is not None:
            return
        inner = self.inner
        on_loop = asyncio._get_running_loop() is self._loop
        # (a checkpoint fixing its point: journaled after it)
        if inner is not None and not self.checkpoints.snapshotting and on_loop:
            self.ledger.freed(handle)  # journaled now
            inner.release(handle, nbytes)
            return
        self._released.append((handle, nbytes))
        if not self._release_scheduled:
            self._release_scheduled = True
            if on_loop:
                self._loop.call_soon(self.flush_released, True)
            else:
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    self._loop.call_soon_threadsafe(self.flush_released, True)

    def defer_free(self, handle: int, nbytes: int = 0) -> None:
        """``release`` from the loop, for a caller about to send."""
        if self.closing or self.error is not None:
            return
        self.ledger.freed(handle)
        if self.inner is not None:
            self.inner.defer_free(handle, nbytes)

    def flush_released(self, scheduled: bool = False) -> None:
        """Journal the frees released since the last time; ``scheduled``: called back by
        the loop (then they are sent soon; else the caller is about to send)."""
        self._release_scheduled = False
        released, inner, freed = self._released, self.inner, self.ledger.freed
        defer = None if inner is None or inner.closed else inner.defer_free
        if not released:
            return
        while released:
            handle, nbytes = released.popleft()
            if self.closing:
                continue
            freed(handle)
            if defer is not None:
                defer(handle, nbytes)
        if inner is not None and scheduled:
            inner.flush_soon()  # as the session's own ``release`` would

    async def aclose(self) -> None:
        """Send what is queued, then close (the standby too)."""
        if self.closing:
            return
        if self._released and self.error is None:
            self.flush_released()
        self.closing = True
        for task in (self.checkpoints.task, self.recovery):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await self.standby.stop_looking()
        for s in {self.inner, self.standby.session, self.moving} - {None}:
            if s is not None:
                s.on_fail = None
                with contextlib.suppress(Exception):
                    await s.aclose()
        for entry in self.ledger.journal:
            if isinstance(entry, Answered) and not entry.done:
                outer = self.outer(entry)
                if not outer.done():
                    outer.set_exception(ConnectionClosed("the session was closed"))
                    outer.add_done_callback(quiet)
        self.ledger.journal.clear()

    # -- replies and losses -------------------------------------------------------------------
    def chain(self, entry: Answered, fut: asyncio.Future[Any]) -> None:
        """Answer ``entry`` (its outer future) with ``fut``'s reply, unless the session is
        lost first: then the call is re-issued by the move."""

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():  # its waiter gave up: the proxy ran it, the answer is unknown
                self._awaited.pop(f, None)
                self.ledger.gave_up(entry)
                return
            exc = f.exception()
            if exc is not None and _is_loss(exc):
                return
            self._awaited.pop(f, None)
            self.ledger.answered(entry, f.result()[0] if exc is None else None, exc)
            outer = entry.outer
            if outer is not None and not outer.done():
                if exc is None:
                    outer.set_result(f.result())
                else:
                    outer.set_exception(exc)

        fut.add_done_callback(done)

    def _on_lost(self, session: ClientSession, exc: BaseException) -> None:
        """A session failed (called by it): the standby is let go; the current one, moved
        (a session being moved to raises in the move instead)."""
        if self.closing:
            return
        if session is self.standby.session:
            self.standby.lost(exc)
            return
        if session is not self.inner or self.recovery is not None:
            return
        self.inner = None
        self.recovery = self._loop.create_task(Move(self, session, exc).run())


async def open_failover_session(
    url: str,
    cfg: FailoverConfig,
    *,
    pipeline: PipelineConfig | None = None,
    limits: FrameLimits = FrameLimits(),
    **options: Any,
) -> tuple[FailoverSession, dict[str, Any]]:
    """A failover session: the first proxy of ``url`` (placed, for a pool) and the settings
    of ``cfg``; returns it and the proxy's device description."""
    targets = Targets(url, cfg)
    first, extra = await targets.take(set())
    options = {**options, **extra}
    inner, info = await open_session(first, pipeline=pipeline, limits=limits, **options)
    return FailoverSession(inner, cfg, targets, options, limits), info
