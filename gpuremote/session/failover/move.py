"""The move of a failover session to another proxy, when its own is lost.

The session moves to the standby, which holds the checkpoint already, else to another proxy
(the pool places one; else the next URL of the list), where the checkpoint is restored from
the client. Then the journal is re-issued: what the lost proxy had confirmed is re-run (and
its replies dropped) and what it had not is sent and answered as if nothing had happened.
A move that loses its new proxy too tries another while the checkpoint is whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any, Protocol

from ...config import PipelineConfig
from ...errors import (
    ConnectionClosed,
    FailoverError,
    GpuRemoteError,
    RemoteCallError,
    RemoteProtocolError,
)
from ...wire.calls import BUFFER, CALLS_BY_NAME
from ..pipeline import ClientSession
from .checkpoint import Checkpoints, quiet, u8
from .config import FailoverConfig, FailoverCounters, Targets
from .ledger import SIZED_BY_ANSWER, WRITES_FROM_ELSEWHERE, Answered, Ledger, unpack
from .standby import Standby

__all__ = ["Move", "Owner"]

log = logging.getLogger("gpuremote.failover")

_C = CALLS_BY_NAME
_ALLOC, _H2D, _D2D, _SYNC = _C["alloc"], _C["copy_h2d"], _C["copy_d2d"], _C["device_synchronize"]


class Owner(Protocol):
    """What a move needs of its failover session."""

    inner: ClientSession | None
    moving: ClientSession | None
    url: str
    epoch: int
    dead: set[str]
    error: BaseException | None
    recovery: asyncio.Task[None] | None
    moves: list[dict[str, Any]]
    config: PipelineConfig
    failover: FailoverConfig
    counters: FailoverCounters
    targets: Targets
    ledger: Ledger
    standby: Standby
    checkpoints: Checkpoints
    stash: deque[BaseException]

    async def open(self, url: str, extra: dict[str, Any]) -> tuple[ClientSession, Any]: ...
    def hook(self, session: ClientSession) -> None: ...
    def outer(self, entry: Answered) -> asyncio.Future[Any]: ...
    def chain(self, entry: Answered, fut: asyncio.Future[Any]) -> None: ...


class Move:
    """Moves ``owner`` to another proxy (see the module docstring). ``record`` is one dict
    per move: from, to, cause, detected (``time.perf_counter``), standby (whether the
    checkpoint's copies were there), and the seconds spent reconnecting, restoring and
    re-issuing the journal."""

    def __init__(self, owner: Owner, lost: ClientSession, cause: BaseException) -> None:
        self._owner = owner
        self._lost = lost
        self.record: dict[str, Any] = {
            "from": lost.url,
            "cause": str(cause),
            "detected": time.perf_counter(),
        }

    async def run(self) -> None:
        """Move the session: restore the checkpoint, re-issue the journal."""
        owner, lost = self._owner, self._lost
        owner.epoch += 1
        owner.dead.add(lost.url)
        lost.on_fail = None
        log.warning(
            "failover: lost the proxy at %s (%s); moving the session",
            lost.url,
            self.record["cause"],
        )
        if owner.checkpoints.task is not None:
            owner.checkpoints.task.cancel()
        try:
            await self._to_a_live_proxy()
        except asyncio.CancelledError:
            raise  # the session is being closed
        except BaseException as exc:
            self._failed(exc)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            owner.recovery = None
        move = self.record
        owner.counters.pause_s.append(move["pause_s"])
        owner.counters.journal_calls = len(owner.ledger.journal)
        log.warning(
            "failover: the session moved from %s to %s in %.3f s (reconnect %.3f, restore "
            "%.3f, re-issue %.3f; %d calls re-issued)",
            move["from"],
            move["to"],
            move["pause_s"],
            move["reconnect_s"],
            move["restore_s"],
            move["replay_s"],
            move["replayed_calls"],
        )
        owner.ledger.checkpoint_due = True  # keep the new proxy's state elsewhere at once
        owner.standby.soon()  # on a new standby, if one can be had
        owner.checkpoints.maybe()

    async def _to_a_live_proxy(self) -> None:
        owner = self._owner
        while True:
            session, on_standby = await self._reconnect()
            try:
                await self._move_to(session, on_standby)
                if session.closed:  # lost as soon as moved to (on_fail came meanwhile)
                    raise ConnectionClosed(f"{session.url} was lost as the session moved")
                return
            except (ConnectionClosed, RemoteProtocolError) as exc:
                # lost that one too before the move was done: another, if the checkpoint
                # is still whole
                log.warning("failover: lost %s while moving to it (%s)", session.url, exc)
                owner.dead.add(session.url)
                owner.inner = None
                session.on_fail = None
                owner.epoch += 1

    def _failed(self, exc: BaseException) -> None:
        """No proxy could take the session: every call waiting fails, naming why."""
        owner = self._owner
        err = (
            exc
            if isinstance(exc, FailoverError)
            else FailoverError(
                f"the session could not move after losing {self.record['from']}: "
                f"{type(exc).__name__}: {exc}"
            )
        )
        owner.error = err
        owner.inner = None
        log.error("failover: %s", err)
        for entry in owner.ledger.journal:
            if isinstance(entry, Answered) and not entry.done:
                outer = owner.outer(entry)
                if not outer.done():
                    outer.set_exception(FailoverError(str(err)))
                    outer.add_done_callback(quiet)

    async def _move_to(self, session: ClientSession, on_standby: bool) -> None:
        """Restore the checkpoint on ``session``, re-issue the journal, and use it."""
        owner, move = self._owner, self.record
        detected = move["detected"]
        t1 = time.perf_counter()
        move["reconnect_s"] = t1 - detected
        owner.hook(session)
        owner.moving = session
        move["standby"] = on_standby  # the checkpoint's copies were there already
        # the application's calls are journaled meanwhile: re-issued below
        with contextlib.suppress(RemoteCallError):  # a standby's own failed copy, if any
            await self._answer(session)
        move["restored_bytes"] = self._restore(session, on_standby)
        try:
            await self._answer(session)
        except RemoteCallError as exc:
            raise FailoverError(f"restoring the session on {session.url} failed: {exc}") from None
        for packed in owner.ledger.res_base.values():  # streams, events, kernels, steps
            session.submit(*unpack(packed), None)
        with contextlib.suppress(RemoteCallError):  # a creation that failed before (its error
            await self._answer(session)  # was raised then) fails again: not raised
        t2 = time.perf_counter()
        move["restore_s"] = t2 - t1
        move["replayed_calls"] = self._replay(session)
        probe = session.start_own_call(_SYNC, 0, [])  # an error of a re-issued call that
        # was not raised yet stays for the application's next synchronising call
        owner.inner, owner.moving = session, None  # from here on, calls go to it (after the
        # journal)
        owner.url = move["to"] = session.url
        if not any(m is move for m in owner.moves):  # moved (counted once, even if retried)
            owner.moves.append(move)
            owner.counters.failovers += 1
        await self._answer(session, probe)
        t3 = time.perf_counter()
        move["replay_s"] = t3 - t2
        move["pause_s"] = t3 - detected

    async def _answer(self, session: ClientSession, fut: asyncio.Future[Any] | None = None) -> None:
        """A synchronisation on the session being moved to (``fut``, else a new one), within
        ``call_timeout_s`` (else ``failover_timeout_s``): a proxy that stops answering during
        the move is lost too."""
        owner = self._owner
        limit = owner.config.call_timeout_s or owner.failover.failover_timeout_s
        if fut is None:
            fut = session.start_call(_SYNC, 0, [])
        try:
            await asyncio.wait_for(asyncio.shield(fut), limit)
        except TimeoutError:
            err = ConnectionClosed(f"no reply from {session.url} within {limit} s")
            session.fail(err)
            raise err from None

    async def _reconnect(self) -> tuple[ClientSession, bool]:
        """The session to move to, and whether it holds the checkpoint's copies already (the
        standby). Waits for a proxy up to ``failover_timeout_s``."""
        owner = self._owner
        gone = FailoverError(
            "the session's checkpoint was on a standby proxy that is gone too; "
            "its arrays cannot be restored"
        )
        if not owner.ledger.base_complete:
            raise gone
        standby = owner.standby.take()
        if standby is not None:
            return standby, True
        if owner.ledger.copies_on_standby():
            raise gone
        timeout = owner.failover.failover_timeout_s
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                for url, extra in await owner.targets.each(set(owner.dead)):
                    try:
                        session, _ = await owner.open(url, extra)
                        return session, False
                    except (GpuRemoteError, OSError) as exc:
                        last = exc
            except GpuRemoteError as exc:  # the pool has no live proxy (yet)
                last = exc
            await asyncio.sleep(0.1)
            if owner.targets.pool is None:  # a list: its proxies may come back
                owner.dead.clear()
        raise FailoverError(f"no proxy to move the session to within {timeout} s (last: {last})")

    def _restore(self, session: ClientSession, on_standby: bool) -> int:
        """Re-create the checkpoint's buffers on ``session``; the bytes sent from here."""
        owner = self._owner
        ledger = owner.ledger
        sent = 0
        if on_standby:
            for ck in owner.standby.pending:  # copies of a checkpoint that did not complete
                session.defer_free(ck)
            owner.standby.pending.clear()
        taken = False
        for h, (n, src) in ledger.base.items():
            session.submit(_ALLOC, 0, [h, n])
            if src[0] == "host":
                session.submit(_H2D, 0, [u8(h, n), BUFFER], src[1])
                sent += n
            elif on_standby:
                session.submit(_D2D, 0, [u8(h, n), u8(src[1], n)])
                session.defer_free(src[1])
                taken = True
        if taken:  # its copies are the session's buffers now: none is kept elsewhere
            ledger.copies_taken_over()
        return sent

    def _replay(self, session: ClientSession) -> int:
        """Re-issue the journal on ``session``; the number of calls sent."""
        owner = self._owner
        journal = owner.ledger.journal
        ordered: set[int] = set()  # answered writes after which a synchronisation is safe
        if owner.ledger.streams:  # (an ack is answered even with an error pending: a sync
            clean = False  # after it would take that error early, unless the next sync
            for e in reversed(journal):  # found none)
                if isinstance(e, Answered):
                    if not e.ack:
                        clean = e.done and not e.deferred
                    elif clean and e.done:
                        ordered.add(id(e))
        n = 0
        for e in journal:
            t = type(e)
            if t is int:
                session.defer_free(e)
            elif t is bytes:
                session.submit(*unpack(e), None)
                n += 1
            elif t is tuple:
                session.submit(*unpack(e[0]), e[1])
                n += 1
            elif self._replay_answered(session, e, id(e) in ordered):
                n += 1
        return n

    def _replay_answered(self, session: ClientSession, e: Answered, ordered: bool) -> bool:
        """Re-issue a call that is answered: sent as it was, if its answer was not had yet;
        else what keeps the session's state and order as they were. Whether it sent one."""
        owner = self._owner
        if not e.done:  # not answered: it is now
            owner.outer(e)
            start = session.start_ack if e.ack else session.start_call
            owner.chain(e, start(e.spec, e.stream, [*e.args], e.buffer))
        elif e.ack and not e.deferred:
            session.submit(e.spec, e.stream, [*e.args], e.buffer)
            if ordered:  # the client waited for it: later work on other streams came after
                session.start_call(_SYNC, 0, []).add_done_callback(quiet)
        elif e.deferred:  # it took a deferred error: a synchronisation there
            session.start_call(_SYNC, e.stream, []).add_done_callback(quiet)
        elif e.spec.name in SIZED_BY_ANSWER:
            session.start_call(e.spec, e.stream, [*e.args], None).add_done_callback(quiet)
        elif e.spec.name in WRITES_FROM_ELSEWHERE:
            if e.value is True and not e.stashed:  # once, for an import that wrote
                e.stashed = True
                owner.stash.append(
                    FailoverError(
                        f"an array copied from another proxy ({e.args[1]}) just before the "
                        "session moved could not be restored: copy it again"
                    )
                )
            return False
        elif owner.ledger.streams:  # answered: the client went on after the stream's work
            # was done, so work it then issued on another stream came after it; re-issued at
            # once, only a synchronisation keeps that order (one stream keeps it alone)
            session.start_call(_SYNC, 0, []).add_done_callback(quiet)
        else:
            return False
        return True
