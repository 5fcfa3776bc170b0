"""Checkpoints of a failover session: every buffer written since the last one, copied where it
costs least, at one point of the session's command order.

A checkpoint is taken in the background (``Checkpoints.maybe``): every
``checkpoint_interval_s``, when the journal reaches its bound, and at once after a move. It
fixes its point in the journal (the ledger's ``snapshot``, after a ``device_synchronize``)
and copies each buffer written since the last one: to the standby (``peer_export`` on the
session's proxy, ``peer_import`` on the standby's: proxy to proxy), else, with no standby
reachable, read into the client. A buffer the client uploaded and that has not changed since
needs no copy at all. More buffers than a proxy exports at once are first copied aside on
the session's own proxy, then exported in waves. The checkpoint counts only once every copy
is confirmed and every call before its point answered (the ledger's ``commit``); until then
the last one stands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from ...errors import (
    GpuRemoteError,
    PeerNotAllowed,
    PeerUnreachable,
    RemoteCallError,
    UnknownHandle,
)
from ...wire.calls import CALLS_BY_NAME
from ...wire.limits import MAX_TICKETS_PER_SESSION
from ..pipeline import ClientSession
from .config import FailoverConfig, FailoverCounters
from .ledger import RNG, Ledger, Snapshot, Source, pack
from .standby import RETRY_S, Standby

__all__ = ["Checkpoints", "Owner", "quiet", "u8"]

log = logging.getLogger("gpuremote.failover")

_C = CALLS_BY_NAME
_ALLOC, _D2H, _D2D, _SYNC = _C["alloc"], _C["copy_d2h"], _C["copy_d2d"], _C["device_synchronize"]
_EXPORT, _IMPORT = _C["peer_export"], _C["peer_import"]
_RNG_GET, _RNG_SET = _C["aten_rng_get"], _C["aten_rng_set"]


def u8(handle: int, nbytes: int) -> list[Any]:
    """The whole of buffer ``handle`` as bytes (an array descriptor)."""
    return [handle, 0, [nbytes], "uint8"]


def quiet(fut: asyncio.Future[Any]) -> None:
    """Retrieve a future's error (nobody else will)."""
    if not fut.cancelled():
        fut.exception()


class Owner(Protocol):
    """What the checkpoints need of their failover session."""

    inner: ClientSession | None
    moving: ClientSession | None
    closing: bool
    recovery: asyncio.Task[None] | None
    epoch: int
    failover: FailoverConfig
    counters: FailoverCounters
    ledger: Ledger
    standby: Standby

    def copy_handle(self) -> int: ...
    def flush_released(self, scheduled: bool = False) -> None: ...


class Checkpoints:
    """The checkpoints of ``owner`` (see the module docstring): at most one under way."""

    def __init__(self, owner: Owner) -> None:
        self._owner = owner
        self.task: asyncio.Task[None] | None = None
        self.last = time.monotonic()  # when the last one ended
        self.snapshotting = False  # one is fixing its point in the journal
        self._client_until = 0.0  # checkpoints read through the client until then

    def maybe(self) -> None:
        """Start a checkpoint if one is due (and none is under way, nor a move)."""
        owner = self._owner
        if (
            self.task is not None
            or owner.inner is None
            or owner.closing
            or owner.recovery is not None
        ):
            return
        ledger = owner.ledger
        if not ledger.journal and not ledger.checkpoint_due:
            return
        if (
            ledger.checkpoint_due
            or time.monotonic() - self.last >= owner.failover.checkpoint_interval_s
        ):
            self.task = asyncio.get_running_loop().create_task(self._take())

    def through_client(self) -> None:
        """Checkpoints onto the standby fail (its memory, the copies aside, a buffer the
        proxy lacks): they go through the client for a while."""
        self._client_until = time.monotonic() + RETRY_S * 60

    async def _take(self) -> None:
        owner = self._owner
        epoch = owner.epoch
        try:
            standby = await owner.standby.get(wait=owner.ledger.base_complete)
            inner = owner.inner
            if (
                epoch != owner.epoch
                or inner is None
                or owner.closing
                or owner.ledger.dynamic
                or owner.recovery is not None
            ):
                return
            if time.monotonic() < self._client_until:
                standby = None
            await _Checkpoint(self, owner, epoch, inner, standby).run()
        finally:
            self.task = None
            self.last = time.monotonic()


class _Checkpoint:
    """One checkpoint, from its point in the journal to its commit (or to its end without
    one: the last checkpoint stands, and what this one copied is let go)."""

    def __init__(
        self,
        checkpoints: Checkpoints,
        owner: Owner,
        epoch: int,
        inner: ClientSession,
        standby: ClientSession | None,
    ) -> None:
        self._checkpoints = checkpoints
        self._owner = owner
        self._epoch = epoch
        self._inner = inner
        self._standby = standby
        self._snap: Snapshot | None = None
        self._made: list[int] = []  # copies on the standby, not committed
        self._aside: list[int] = []  # copies on the session's own proxy (many buffers)
        self._unread: dict[str, int] = {}  # tickets exported and not imported (bytes)
        self._sources: dict[int, Source] = {}
        self._rng: asyncio.Future[Any] | None = None  # the generator's state, where used

    async def run(self) -> None:
        try:
            await self._copy()
        finally:
            self._clean_up()

    async def _copy(self) -> None:
        owner = self._owner
        started = self._start()
        if started is None:
            return
        snap, move, sync, calls = started
        for f in calls:
            f.add_done_callback(quiet)
        try:
            pending, _ = await sync
        except GpuRemoteError:
            return
        if pending:  # an error of the application's is pending (its next synchronising call
            return  # takes it, and what it skipped stays skipped): the next checkpoint
        replies = await asyncio.gather(*calls, return_exceptions=True)
        if self._epoch != owner.epoch:
            return
        if self._aside:
            if not await self._aside_done(move, replies):
                return
        elif not await self._copied(move, replies):
            return
        if (
            self._epoch != owner.epoch
            or owner.inner is not self._inner
            or (self._standby is not None and self._standby is not owner.standby.session)
        ):
            return
        if any(not e.done for e in snap.waiting):
            return  # an earlier call is not answered yet: the next checkpoint
        if self._rng is not None:  # the generator's state at this point, restored by a move
            try:
                state, _ = await self._rng
            except GpuRemoteError:
                return
            snap.res[RNG] = pack(_RNG_SET, 0, [state])
        self._commit(snap)

    def _start(
        self,
    ) -> tuple[Snapshot, list[int], asyncio.Future[Any], list[asyncio.Future[Any]]] | None:
        """Fix the checkpoint's point and send, at that point of the session's order, a
        synchronisation, then the reads (to the client) or the exports (to the standby), or
        copies aside and a synchronisation of their own: the client's own calls, which
        leave an error the application has pending to its next synchronising call."""
        owner, inner, standby = self._owner, self._inner, self._standby
        checkpoints = self._checkpoints
        checkpoints.snapshotting = True  # a finalizer's free now goes after this point
        try:
            owner.flush_released()
            snap = self._snap = owner.ledger.snapshot()
            move = owner.ledger.to_copy(snap)
            live = snap.live
            sync = inner.start_own_call(_SYNC, 0, [])
            if owner.ledger.random:
                self._rng = inner.start_own_call(_RNG_GET, 0, [])
                self._rng.add_done_callback(quiet)
            if standby is None:
                calls = [inner.start_own_call(_D2H, 0, [u8(h, live[h])]) for h in move]
            elif len(move) <= MAX_TICKETS_PER_SESSION:
                calls = [inner.start_own_call(_EXPORT, 0, [u8(h, live[h])]) for h in move]
            else:  # the copies aside, each answered (a failure is the checkpoint's alone)
                calls = []
                for h in move:
                    a, n = owner.copy_handle(), live[h]
                    calls.append(inner.start_own_call(_ALLOC, 0, [a, n], now=False))
                    calls.append(inner.start_own_call(_D2D, 0, [u8(a, n), u8(h, n)], now=False))
                    self._aside.append(a)
                calls.append(inner.start_own_call(_SYNC, 0, []))  # all in this frame
        except GpuRemoteError:
            return None
        finally:
            checkpoints.snapshotting = False
        return snap, move, sync, calls

    async def _copied(self, move: list[int], replies: Sequence[Any]) -> bool:
        """The reads or exports of ``move`` are answered: where each copy is now (to the
        standby, the exports imported). False if the checkpoint cannot count."""
        assert self._snap is not None
        snap, standby, ledger = self._snap, self._standby, self._owner.ledger
        if standby is not None:
            for h, r in zip(move, replies, strict=True):
                if not isinstance(r, BaseException):
                    self._unread[r[0]] = snap.live[h]
        done = []
        for h, r in zip(move, replies, strict=True):
            if not isinstance(r, BaseException):
                done.append((h, r))
            elif isinstance(r, RemoteCallError) and not r.deferred and r.is_a(UnknownHandle):
                ledger.never_made(snap, h)  # its making call failed: no such buffer anywhere
            else:
                log.info("failover: a checkpoint did not complete (%s)", r)
                if standby is not None:
                    self._checkpoints.through_client()
                return False
        if standby is None:
            for h, (value, bufs) in done:
                self._sources[h] = ("host", bufs[value])
            return True
        return await self._to_standby(standby, done)

    async def _aside_done(self, move: list[int], replies: Sequence[Any]) -> bool:
        """The copies set aside are made: export and import them in waves."""
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed:
            # a copy aside failed (the session's memory limit, or a buffer the proxy lacks):
            # the next checkpoint reads through the client, which finds out
            log.info("failover: a checkpoint's copies aside failed (%s)", failed[0])
            self._checkpoints.through_client()
            aside, self._aside = self._aside, []
            await self._free_aside(aside)
            return False
        return await self._in_waves(move)

    async def _in_waves(self, move: list[int]) -> bool:
        """Export the copies set aside and import them on the standby,
        ``MAX_TICKETS_PER_SESSION`` at a time; False if not all went."""
        assert self._snap is not None and self._standby is not None
        owner, inner, live = self._owner, self._inner, self._snap.live
        wave_size = MAX_TICKETS_PER_SESSION
        for i in range(0, len(move), wave_size):
            wave = list(zip(move[i : i + wave_size], self._aside[i : i + wave_size], strict=True))
            try:
                futs = [inner.start_own_call(_EXPORT, 0, [u8(a, live[h])]) for h, a in wave]
            except GpuRemoteError:
                return False
            replies = await asyncio.gather(*futs, return_exceptions=True)
            if self._epoch != owner.epoch:
                return False
            failed = [r for r in replies if isinstance(r, BaseException)]
            for (h, _), r in zip(wave, replies, strict=True):
                if not isinstance(r, BaseException):
                    self._unread[r[0]] = live[h]
            if failed:
                log.info("failover: a checkpoint did not complete (%s)", failed[0])
                return False
            done = [(h, r) for (h, _), r in zip(wave, replies, strict=True)]
            if not await self._to_standby(self._standby, done):
                return False
        return True

    async def _to_standby(self, standby: ClientSession, done: list[tuple[int, Any]]) -> bool:
        """Copy the exported buffers onto the standby (proxy to proxy); False if not all
        could be."""
        assert self._snap is not None
        owner, live, url = self._owner, self._snap.live, self._inner.url
        if standby.closed or standby is not owner.standby.session:
            return False
        futs = []
        try:
            for h, (ticket, _) in done:
                ck = owner.standby.new_copy()
                self._made.append(ck)
                n = live[h]
                standby.submit(_ALLOC, 0, [ck, n])
                futs.append(standby.start_call(_IMPORT, 0, [u8(ck, n), url, ticket]))
                self._unread.pop(ticket, None)
                self._sources[h] = ("ck", ck)
        except GpuRemoteError:
            return False
        results = await asyncio.gather(*futs, return_exceptions=True)
        bad = [r for r in results if isinstance(r, BaseException)]
        if not bad:
            return True
        calls = [r for r in bad if isinstance(r, RemoteCallError)]
        refused = [r for r in calls if r.is_a(PeerNotAllowed)]
        if refused:  # it may not read from this proxy: not tried again for a while
            log.warning(
                "failover: the standby at %s may not read from %s (%s); checkpoints go "
                "through the client",
                owner.standby.url,
                url,
                refused[0],
            )
            owner.standby.drop(retry_s=60.0)
        elif not any(r.is_a(PeerUnreachable) for r in calls):
            # not a link (which may be this proxy going: the standby stays): its memory?
            log.info("failover: a checkpoint did not complete on the standby (%s)", bad[0])
            self._checkpoints.through_client()  # the next one through the client
        owner.ledger.checkpoint_due = True
        return False

    def _commit(self, snap: Snapshot) -> None:
        """Every copy is confirmed: the checkpoint counts."""
        owner, standby = self._owner, self._standby
        kept, dropped = owner.ledger.commit(snap, self._sources)
        owner.standby.release(dropped)
        owner.standby.pending -= kept
        owner.counters.journal_calls = len(owner.ledger.journal)
        self._made, self._snap = [], None
        moved = sum(snap.live[h] for h in self._sources)
        counters = owner.counters
        counters.checkpoints += 1
        counters.checkpoint_bytes += moved
        if standby is None:
            counters.checkpoint_bytes_to_client += moved

    def _clean_up(self) -> None:
        """Let go of what a checkpoint that did not count made: copies aside and on the
        standby, tickets not read; what its snapshot held is still to keep."""
        owner, inner, standby = self._owner, self._inner, self._standby
        self._checkpoints.snapshotting = False
        if self._aside and inner is owner.inner:
            for a in self._aside:  # exported (the tickets hold copies) or abandoned
                inner.defer_free(a)
            inner.flush_soon()
        ours = standby is not None and standby is owner.standby.session and not standby.closed
        if self._unread and ours:  # tickets left: read, so they go
            assert standby is not None
            asyncio.get_running_loop().create_task(
                self._drain(standby, inner.url, list(self._unread.items()))
            )
        for ck in self._made:  # an abandoned checkpoint's copies on the standby (a move onto
            if ours:  # it frees them with the others pending)
                assert standby is not None
                standby.release(ck)
            if standby is not owner.moving:
                owner.standby.pending.discard(ck)
        if self._snap is not None:  # not taken
            owner.ledger.abandon(self._snap)

    async def _free_aside(self, aside: list[int]) -> None:
        """Free the copies set aside that were made (a zero-byte read of each tells)."""
        inner = self._inner
        try:
            probes = [inner.start_own_call(_D2H, 0, [[a, 0, [0], "uint8"]]) for a in aside]
        except GpuRemoteError:
            return
        replies = await asyncio.gather(*probes, return_exceptions=True)
        for a, r in zip(aside, replies, strict=True):
            if not isinstance(r, BaseException):
                inner.defer_free(a)
        if not inner.closed:
            inner.flush_soon()

    async def _drain(
        self, standby: ClientSession, url: str, tickets: list[tuple[str, int]]
    ) -> None:
        """Read exported tickets that a checkpoint left (onto the standby, then freed), so
        that they do not hold the exporting proxy's tickets until they expire."""
        owner = self._owner
        for ticket, n in tickets:
            if standby is not owner.standby.session or standby.closed:
                return
            ck = owner.standby.new_copy()
            with contextlib.suppress(GpuRemoteError):
                standby.submit(_ALLOC, 0, [ck, n])
                await standby.call(_IMPORT, 0, [u8(ck, n), url, ticket])
            if standby is owner.standby.session and not standby.closed:
                standby.release(ck)
            if standby is not owner.moving:  # (a move onto it frees what is pending)
                owner.standby.pending.discard(ck)
