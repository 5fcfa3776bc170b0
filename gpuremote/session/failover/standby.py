"""The standby of a failover session: a session on another proxy that holds the checkpoint's
copies of the buffers (made proxy to proxy: the data never passes through the client), so
that a move onto it restores them with no transfer at all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Protocol

from ...errors import GpuRemoteError
from ..pipeline import ClientSession
from .config import Targets
from .ledger import Ledger

__all__ = ["Owner", "Standby"]

log = logging.getLogger("gpuremote.failover")

#: the handles of a standby's copies of buffers (apart from the client's own handles)
COPY_HANDLES = 1 << 62
#: how long a standby is not looked for again after none could be had
RETRY_S = 1.0


class Owner(Protocol):
    """What the standby needs of its failover session."""

    inner: ClientSession | None
    closing: bool
    dead: set[str]
    targets: Targets
    ledger: Ledger

    async def open(self, url: str, extra: dict[str, Any]) -> tuple[ClientSession, Any]: ...
    def hook(self, session: ClientSession) -> None: ...
    def copy_handle(self) -> int: ...


class Standby:
    """The standby session of ``owner``, when one can be had (see the module docstring):
    looked for on a proxy other than the session's own and the lost ones, let go when it is
    lost or cannot do its job, and taken over by a move."""

    def __init__(self, owner: Owner) -> None:
        self._owner = owner
        self.session: ClientSession | None = None
        self.url = ""
        self._next = 0.0  # when to look for one again
        self._search: asyncio.Task[None] | None = None
        #: copies made on it and not committed by a checkpoint yet
        self.pending: set[int] = set()

    def new_copy(self) -> int:
        """A handle for a copy on the standby (made by whoever uses it), pending until a
        checkpoint commits it."""
        ck = self._owner.copy_handle()
        self.pending.add(ck)
        return ck

    def usable(self) -> ClientSession | None:
        """The standby session, if there is one and it is open."""
        session = self.session
        return session if session is not None and not session.closed else None

    async def get(self, wait: bool) -> ClientSession | None:
        """The standby session, if there is one; else one is looked for (opened on another
        proxy where one can be had), and, with ``wait``, waited for. A checkpoint that must be
        taken at once (after a move, or with the standby lost) does not wait: the pool may
        take a second to place one while a proxy restarts."""
        standby = self.usable()
        if standby is not None:
            return standby
        inner = self._owner.inner
        if self._search is None and inner is not None and time.monotonic() >= self._next:
            self._next = time.monotonic() + RETRY_S
            self._search = asyncio.get_running_loop().create_task(self._find(inner.url))
        if wait and self._search is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._search)
            return self.usable()
        return None

    async def _find(self, primary: str) -> None:
        """Open a standby session on a proxy other than ``primary`` (and the lost ones)."""
        owner = self._owner
        try:
            for url, extra in await owner.targets.each({primary, *owner.dead}):
                try:
                    session, _ = await owner.open(url, extra)
                except (GpuRemoteError, OSError) as exc:
                    log.info("failover: no standby at %s (%s)", url, exc)
                    continue
                inner = owner.inner
                if owner.closing or self.session is not None or inner is None or url == inner.url:
                    await session.aclose()  # not needed (the session moved there meanwhile)
                    return
                owner.hook(session)
                self.session, self.url = session, url
                return
        except GpuRemoteError as exc:
            log.info("failover: no standby (%s)", exc)
        finally:
            self._search = None

    def take(self) -> ClientSession | None:
        """The standby, for a move onto it (it is no longer the standby), if it is open."""
        standby = self.usable()
        if standby is not None:
            self.session = None
        return standby

    def lost(self, exc: BaseException) -> None:
        """The standby session failed: its copies are gone."""
        log.warning("failover: the standby at %s is gone (%s)", self.url, exc)
        self.session = None
        self.copies_lost()

    def copies_lost(self) -> None:
        """The standby's copies are gone: the checkpoint lacks them until the next one."""
        self.pending.clear()
        self._owner.ledger.copies_lost()

    def drop(self, retry_s: float = RETRY_S) -> None:
        """Let the standby go (it cannot do its job): not looked for for ``retry_s``."""
        standby, self.session = self.session, None
        self._next = time.monotonic() + retry_s
        self.copies_lost()
        if standby is not None:
            standby.on_fail = None
            asyncio.get_running_loop().create_task(standby.aclose())

    def soon(self) -> None:
        """Look for a standby at the next checkpoint (after a move)."""
        self._next = 0.0

    def release(self, copies: list[int]) -> None:
        """Free copies on the standby (no longer part of any checkpoint)."""
        if self.session is not None:
            for ck in copies:
                self.session.release(ck)

    async def stop_looking(self) -> None:
        """Stop a search for a standby under way (the session is closing)."""
        if self._search is not None:
            self._search.cancel()
            with contextlib.suppress(BaseException):
                await self._search
