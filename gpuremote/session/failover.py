"""Sessions that survive the loss of their proxy: ``connect(url, failover=...)``.

A ``FailoverSession`` stands where a ``ClientSession`` stands under both front ends (the same
methods: ``submit``, ``start_call``, ``wait``, ``release``, ...), over the session it currently
uses. It keeps what it needs to rebuild the session's state on another proxy:

- **a checkpoint** of every live buffer, taken in the background every
  ``checkpoint_interval_s`` (and when the journal reaches its bound): each buffer written since
  the last one is copied where it costs least: to a *standby* session on another proxy
  (``peer_export`` here, ``peer_import`` there: the data never passes through the client),
  else, with no standby reachable, read into the client; a buffer the client uploaded and
  that has not changed since needs no copy at all (the upload's own bytes are the checkpoint).
  A checkpoint is one point in the session's command order (taken after a
  ``device_synchronize``), and counts only once every copy is confirmed: until then the last
  one stands.
- **the journal**: every call issued since that checkpoint, in order, with its host data
  (``step_replay`` of a captured step is one entry), and the creations of the streams,
  events, kernels and recorded steps still alive.

When the proxy is lost (the connection closes, or no reply comes within ``call_timeout_s``),
the session moves: to the standby, which holds the checkpoint already, else to another proxy
(the pool places one; else the next URL of the list), where the checkpoint is restored from
the client. Then the journal is re-issued: what the lost proxy had confirmed is re-run (and
its replies dropped) and what it had not is sent and answered as if nothing had happened. The
application sees a pause, a log line (logger ``gpuremote.failover``) and ``failovers`` in
``stats()``; its arrays, streams and recorded steps are where they were.

Exactly once: the restored buffers plus the re-run journal give the state an uninterrupted
run would have (the backends compute deterministically); a synchronising call whose answer
carried a deferred error is re-run as a plain synchronisation, its answer dropped, so that the
error is raised once; an error still deferred is raised at the next synchronising call, as
usual. What cannot be restored (see ``docs/failover.md``) raises ``FailoverError`` (a
``ConnectionClosed``) at the next synchronising call, naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..config import PipelineConfig
from ..errors import (
    ConfigError,
    ConnectionClosed,
    FailoverError,
    GpuRemoteError,
    LocalProtocolError,
    PeerNotAllowed,
    PeerUnreachable,
    RemoteCallError,
    RemoteProtocolError,
    UnknownHandle,
)
from ..wire.calls import BUFFER, CALLS_BY_NAME, CALLS_BY_OPCODE, CallSpec
from ..wire.framing import FrameLimits
from ..wire.limits import MAX_TICKETS_PER_SESSION
from ..wire.protocol import DTYPES
from .connection import open_session, place, placed
from .contract import Counters, Recorder
from .pipeline import ClientSession

__all__ = [
    "FailoverConfig",
    "FailoverCounters",
    "FailoverError",
    "FailoverSession",
    "failover_config",
    "open_failover_session",
]

log = logging.getLogger("gpuremote.failover")

_C = CALLS_BY_NAME
_ALLOC, _FREE, _FREE_BUFFERS = _C["alloc"], _C["free"], _C["free_buffers"]
_H2D, _D2H, _D2D, _MEMSET = _C["copy_h2d"], _C["copy_d2h"], _C["copy_d2d"], _C["memset"]
_LAUNCH, _LAUNCH_NEW, _DYNAMIC = _C["launch"], _C["launch_new"], _C["launch_dynamic"]
_KERNEL_LAUNCH, _REPLAY = _C["kernel_launch"], _C["step_replay"]
_SYNC = _C["device_synchronize"]
_EXPORT, _IMPORT = _C["peer_export"], _C["peer_import"]

#: creations of resources (kept from one checkpoint to the next) and what ends them
_CREATES = {
    _C["stream_create"].opcode: "stream",
    _C["event_create"].opcode: "event",
    _C["kernel_create"].opcode: "kernel",
    _C["step_record"].opcode: "step",
}
_ENDS = {
    _C["stream_destroy"].opcode: "stream",
    _C["event_destroy"].opcode: "event",
    _C["step_free"].opcode: "step",
}
#: the handles of a standby's copies of buffers (apart from the client's own handles)
_CK_BASE = 1 << 62
#: how long a standby is not looked for again after none could be had
_STANDBY_RETRY_S = 1.0
#: exports a proxy holds for one session at a time (``peers.MAX_TICKETS_PER_SESSION``): a
#: checkpoint of more buffers copies them aside first, then exports them in waves of this many
_TICKETS = MAX_TICKETS_PER_SESSION


# -- configuration ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FailoverConfig:
    """How a failover session keeps its state: ``urls``, the proxies to move to outside a
    pool (empty: the pool's); a checkpoint at least every ``checkpoint_interval_s``, and as
    soon as the journal holds ``journal_max_calls`` calls or ``journal_max_bytes`` of host
    data; a move gives up after ``failover_timeout_s`` without a proxy."""

    urls: tuple[str, ...] = ()
    checkpoint_interval_s: float = 1.0
    journal_max_bytes: int = 64 << 20
    journal_max_calls: int = 1 << 16
    failover_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if (
            self.checkpoint_interval_s <= 0
            or self.journal_max_bytes < 1
            or self.journal_max_calls < 1
            or self.failover_timeout_s <= 0
        ):
            raise ConfigError("failover settings must be positive")


_TUNING = ("checkpoint_interval_s", "journal_max_bytes", "journal_max_calls", "failover_timeout_s")


def failover_config(url: str, options: dict[str, Any]) -> FailoverConfig | None:
    """The failover settings in ``options`` (taken out of it): ``failover=True`` (a pool://
    URL) or a list of URLs, and the tuning of ``FailoverConfig``; ``None``: no failover."""
    value = options.pop("failover", None)
    tuning = {k: options.pop(k) for k in _TUNING if k in options}
    if value is None or value is False:
        if tuning:
            raise ConfigError(f"{', '.join(sorted(tuning))} need failover=")
        return None
    if value is True:
        if placed(url) is None:
            raise ConfigError(
                f"failover=True needs a pool:// URL, not {url!r}; outside a pool, give the "
                "proxies to move to: failover=['tcp://a:5151', 'tcp://b:5151']"
            )
        return FailoverConfig((), **tuning)
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ConfigError("failover= takes True (a pool) or a list of proxy URLs")
    urls = [str(u) for u in value]
    if any(placed(u) is not None for u in urls) or placed(url) is not None:
        raise ConfigError("failover=[...] lists single proxies; for a pool, pass failover=True")
    return FailoverConfig(tuple(dict.fromkeys([url, *urls])), **tuning)


@dataclass(slots=True)
class FailoverCounters(Counters):
    """``Counters`` plus what failover did: moves, their pauses, checkpoints and the bytes
    they copied (to a standby proxy, or into the client)."""

    failovers: int = 0
    pause_s: list[float] = field(default_factory=list)
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    checkpoint_bytes_to_client: int = 0
    journal_calls: int = 0  # calls in the journal now


# -- the journal --------------------------------------------------------------------------------
class _Waited:
    """A journaled call that is answered (SYNC, or ASYNC with ``ack``): its outer future is
    the one the front end waits for, whichever proxy answers."""

    __slots__ = (
        "ack",
        "args",
        "buffer",
        "deferred",
        "done",
        "outer",
        "spec",
        "stashed",
        "stream",
        "value",
    )

    def __init__(
        self,
        spec: CallSpec,
        stream: int,
        args: list[Any],
        buffer: memoryview | None,
        ack: bool,
        outer: asyncio.Future[Any] | None,
    ) -> None:
        self.spec = spec
        self.stream = stream
        self.args = args
        self.buffer = buffer
        self.ack = ack
        self.outer = outer
        self.done = False  # answered by a proxy
        self.deferred = False  # answered with a deferred error (it did not run)
        self.value: Any = None
        self.stashed = False  # its loss was reported (a peer import that cannot be re-run)

    def future(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
        """The future that the answer after a move goes to (made on first use)."""
        if self.outer is None:
            self.outer = loop.create_future()
        return self.outer


def _nbytes(wire: list[Any]) -> int:
    return math.prod(wire[2]) * DTYPES[wire[3]].itemsize


def _u8(handle: int, nbytes: int) -> list[Any]:
    return [handle, 0, [nbytes], "uint8"]


def _is_loss(exc: BaseException) -> bool:
    return isinstance(exc, ConnectionClosed | RemoteProtocolError)


def _quiet(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


# -- where to go --------------------------------------------------------------------------------
class _Targets:
    """The proxies a session may move to: the pool's (placed), or a list's."""

    def __init__(self, url: str, cfg: FailoverConfig) -> None:
        self.pool = url if not cfg.urls else None
        self.urls = cfg.urls

    async def take(self, exclude: set[str]) -> tuple[str, dict[str, Any]]:
        """A proxy to open a session on (none of ``exclude``); raises when there is none now."""
        if self.pool is not None:
            (url,), extra = await place(self.pool, 1, sorted(exclude))
            return url, extra
        for url in self.urls:
            if url not in exclude:
                return url, {}
        raise FailoverError("no proxy of the failover list is left")

    async def each(self, exclude: set[str]) -> list[tuple[str, dict[str, Any]]]:
        """The candidates, in order (a pool places one)."""
        if self.pool is not None:
            return [await self.take(exclude)]
        return [(u, {}) for u in self.urls if u not in exclude]


# -- the session ----------------------------------------------------------------------------------
class FailoverSession:
    """A client session that moves to another proxy when its own is lost (see the module
    docstring). Made by ``open_failover_session``."""

    def __init__(
        self,
        inner: ClientSession,
        cfg: FailoverConfig,
        targets: _Targets,
        options: dict[str, Any],
        limits: FrameLimits,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.failover = cfg
        self.config: PipelineConfig = inner.config
        self.counters = FailoverCounters()
        self._targets = targets
        self._options = options
        self._limits = limits
        #: a fresh client-chosen handle, the same on whichever proxy serves the session
        self.new_handle: Callable[[], int] = itertools.count(1).__next__
        self._ck_handles = itertools.count(_CK_BASE)
        self._hook(inner)
        self._inner: ClientSession | None = inner
        self.url = inner.url
        #: the calls since the checkpoint, in order: an ``int`` frees that buffer; ``bytes``
        #: is an ASYNC call packed (``_pack``), with its host data in a ``(bytes, data)``
        #: pair; a ``_Waited`` is a call that was answered or is awaited. Nothing in it is a
        #: container the garbage collector keeps looking at, but the few ``_Waited``.
        self._journal: list[Any] = []
        self._jbytes = 0
        self._released: deque[tuple[int, int]] = deque()  # frees from any thread
        self._release_scheduled = False
        self._stash: deque[BaseException] = deque()  # errors for the next synchronising call
        #: the futures of calls in flight, each to its journal entry (to re-issue if lost)
        self._awaited: dict[asyncio.Future[Any], _Waited] = {}
        self._unanswered: set[_Waited] = set()  # journaled calls not answered yet
        # the checkpoint: the state at the journal's start
        self._base: dict[int, tuple[int, tuple[str, Any]]] = {}  # handle -> nbytes, source
        self._base_complete = True  # False: part of it was lost, until the next checkpoint
        self._res_base: dict[tuple[str, int], bytes] = {}
        # the state after the whole journal, kept as calls are journaled
        self._live: dict[int, int] = {}  # buffer -> bytes
        self._dirty: set[int] = set()  # written since the checkpoint being taken (or the last)
        self._host: dict[int, memoryview] = {}  # buffers whose last write was an upload
        self._res: dict[tuple[str, int], bytes] = {}  # streams, events, kernels, steps
        self._step_results: dict[int, list[int]] = {}  # recorded step -> its results' bytes
        self._step_writes: dict[int, list[int]] = {}  # recorded step -> session buffers it writes
        self._dynamic = 0  # launch_dynamic calls not answered yet (their outputs unknown)
        self._streams = False  # streams besides the default one were made
        self._snapshotting = False  # a checkpoint is fixing its point in the journal
        # the standby: a session on another proxy holding the checkpoint's copies
        self._standby: ClientSession | None = None
        self._standby_url = ""
        self._standby_next = 0.0  # when to look for one again
        self._standby_search: asyncio.Task[None] | None = None
        self._ck_pending: set[int] = set()  # copies on the standby not yet committed
        self._ckpt_task: asyncio.Task[None] | None = None
        self._ckpt_last = time.monotonic()
        self._ckpt_due = True  # the first checkpoint as soon as there is something to keep
        self._client_until = 0.0  # checkpoints read through the client until then
        self._recovery: asyncio.Task[None] | None = None
        self._moving: ClientSession | None = None  # the session a move is restoring
        self._epoch = 0
        self._dead: set[str] = set()
        self._error: BaseException | None = None
        self._closing = False
        #: the step being captured (``gpuremote.core.capture``): calls that wait are refused
        self.recorder: Recorder | None = None
        #: one dict per move: from, to, cause, detected (``time.perf_counter``), standby
        #: (whether the checkpoint's copies were there), and the seconds spent reconnecting,
        #: restoring and re-issuing the journal
        self.moves: list[dict[str, Any]] = []

    def _hook(self, session: ClientSession) -> None:
        session.counters = self.counters
        session.on_fail = lambda exc, s=session: self._on_lost(s, exc)

    # -- what the front ends use ---------------------------------------------------------------

    def count_local(self, n: int = 1, shadow_bytes: int = 0) -> None:
        self.counters.calls["local"] += n

    @property
    def closed(self) -> bool:
        return self._closing or self._error is not None

    @property
    def notices(self) -> deque[Any]:
        return self._inner.notices if self._inner is not None else deque()

    def check_open(self) -> None:
        if self._error is not None:
            raise FailoverError(str(self._error))
        if self._closing:
            raise ConnectionClosed("the session is closed")

    def plain_wait(self) -> bool:
        return False  # a wait may outlive the session it started on

    def submit(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> None:
        """Queue an ASYNC call (journaled; sent at once unless the session is moving)."""
        if self._error is not None or self._closing:
            self.check_open()
        inner = self._inner
        try:
            packed = _PACK((spec.opcode, stream, args if spec is not _H2D else [args[0], None]))
        except (TypeError, ValueError, OverflowError) as exc:
            if inner is not None:
                inner.submit(spec, stream, args, buffer)  # raises, naming what cannot be sent
            raise LocalProtocolError(f"{spec.name}: an argument cannot be sent ({exc})") from None
        # tracked before the session takes ``args`` (it interns the arrays in it); a call it
        # then refuses leaves at most a buffer marked written, or one the proxy lacks (which
        # a checkpoint finds out)
        if spec is _LAUNCH_NEW:  # the common case, inline: its outputs are new buffers
            live, dirty = self._live, self._dirty
            for w in args[2]:
                h = w[0]
                if w[1] == 0 and h not in live:
                    n = DTYPES[w[3]].itemsize
                    for d in w[2]:
                        n *= d
                    live[h] = n
                dirty.add(h)
        else:
            self._track(spec, args, buffer, packed)
        if inner is not None:
            try:
                inner.submit(spec, stream, args, buffer)
            except GpuRemoteError as exc:
                if not _is_loss(exc):
                    raise
        if buffer is None:
            self._journal.append(packed)
        else:
            self._journal.append((packed, buffer))
            self._jbytes += buffer.nbytes
        if len(self._journal) >= self.failover.journal_max_calls or (
            self._jbytes >= self.failover.journal_max_bytes
        ):
            self._ckpt_due = True
            self._maybe_checkpoint()

    def start_call(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> asyncio.Future[Any]:
        """Send a SYNC call (after everything queued); the future of its reply, whichever
        proxy gives it."""
        if self._error is not None or self._closing:
            self.check_open()
        if self.recorder is not None:
            self.recorder.refuse(f"{spec.name} (it waits for the device's answer)")
        if self._stash:
            raise self._stash.popleft()
        if self._released:
            self._flush_released()
        if self._ckpt_task is None and (
            self._ckpt_due
            or time.monotonic() - self._ckpt_last >= self.failover.checkpoint_interval_s
        ):
            self._maybe_checkpoint()
        return self._start(spec, stream, args, buffer, False)

    def _start(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None, ack: bool
    ) -> asyncio.Future[Any]:
        entry = _Waited(spec, stream, args, buffer, ack, None)
        inner = self._inner
        fut = None
        if inner is not None:
            try:
                fut = (inner.start_ack if ack else inner.start_call)(spec, stream, [*args], buffer)
            except GpuRemoteError as exc:
                if not _is_loss(exc):
                    raise  # not sent (an earlier call that could not be): not journaled
            else:
                self._chain(entry, fut)
        if fut is None:  # journaled only: what the move re-issues must be sendable
            try:
                _PACK((spec.opcode, stream, [None if a is BUFFER else a for a in args]))
            except (TypeError, ValueError, OverflowError) as exc:
                raise LocalProtocolError(f"{spec.name}: cannot be sent ({exc})") from None
        self._unanswered.add(entry)
        if spec is _DYNAMIC:
            self._dynamic += 1
        elif spec is _IMPORT:
            self._write(args[0][0])
        elif ack:
            self._track(spec, args, buffer, b"")
        self._journal.append(entry)
        if buffer is not None:
            self._jbytes += buffer.nbytes
        if fut is None:  # the session is moving: answered once it has moved
            entry.outer = self._loop.create_future()
            return entry.outer
        self._awaited[fut] = entry  # waited for as it is (no hop), re-issued if lost
        return fut

    async def wait(self, fut: asyncio.Future[Any], what: str) -> Any:
        """The reply of a started call; a loss on the way moves the session and the call
        is answered by the next proxy."""
        timeout = self.config.call_timeout_s
        while True:
            inner = self._inner
            try:
                if timeout is None:
                    return await fut
                return await asyncio.wait_for(asyncio.shield(fut), timeout)
            except TimeoutError:
                if inner is not None and inner is self._inner:
                    inner.fail(
                        ConnectionClosed(f"no reply to {what} within {timeout} s: proxy gone")
                    )
            except (ConnectionClosed, RemoteProtocolError):
                entry = self._awaited.pop(fut, None)
                if entry is None or self._error is not None or self._closing:
                    raise
                fut = entry.future(self._loop)  # answered after the move

    async def call(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> Any:
        """Send a SYNC call and wait for its reply."""
        return await self.wait(self.start_call(spec, stream, args, buffer), spec.name)

    async def ack(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> None:
        """Send an ASYNC call now and wait until a proxy has run it; the caller's buffer is
        copied into the journal first (the caller may change it once this returns)."""
        self.check_open()
        if self.recorder is not None:
            self.recorder.refuse(f"{spec.name} (host data sent to the device)")
        if self._released:
            self._flush_released()
        own = memoryview(bytearray(buffer)) if buffer is not None else None
        await self.wait(self._start(spec, stream, args, own, True), spec.name)

    async def flush(self, wait: bool = False) -> None:
        """Send everything queued; with ``wait``, also wait for it to run."""
        if wait:
            await self.call(_SYNC, 0, [])
            return
        self.check_open()
        if self._released:
            self._flush_released()
        inner = self._inner
        if inner is not None:
            with contextlib.suppress(ConnectionClosed, RemoteProtocolError):
                await inner.flush()

    def release(self, handle: int, nbytes: int = 0) -> None:
        """Free buffer ``handle`` later (safe from finalizers, in any thread)."""
        if self._closing or self._error is not None:
            return
        inner = self._inner
        if (
            inner is not None
            and not self._snapshotting  # (a checkpoint fixing its point: journaled after it)
            and asyncio._get_running_loop() is self._loop
        ):  # on the loop:
            self._journal.append(handle)  # journaled now (as _freed, inline)
            self._live.pop(handle, None)
            self._dirty.discard(handle)
            if self._host:
                self._host.pop(handle, None)
            inner.release(handle, nbytes)
            return
        self._released.append((handle, nbytes))
        if not self._release_scheduled:
            self._release_scheduled = True
            if asyncio._get_running_loop() is self._loop:
                self._loop.call_soon(self._flush_released, True)
            else:
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    self._loop.call_soon_threadsafe(self._flush_released, True)

    def defer_free(self, handle: int, nbytes: int = 0) -> None:
        """``release`` from the loop, for a caller about to send."""
        if self._closing or self._error is not None:
            return
        self._freed(handle)
        if self._inner is not None:
            self._inner.defer_free(handle, nbytes)

    def _flush_released(self, scheduled: bool = False) -> None:
        """Journal the frees released since the last time; ``scheduled``: called back by
        the loop (then they are sent soon; else the caller is about to send)."""
        self._release_scheduled = False
        released, inner = self._released, self._inner
        journal, live, dirty, host = self._journal, self._live, self._dirty, self._host
        defer = None if inner is None or inner.closed else inner.defer_free
        if not released:
            return
        while released:
            handle, nbytes = released.popleft()
            if self._closing:
                continue
            journal.append(handle)  # as _freed, inline
            live.pop(handle, None)
            dirty.discard(handle)
            if host:
                host.pop(handle, None)
            if defer is not None:
                defer(handle, nbytes)
        if inner is not None and scheduled:
            inner.flush_soon()  # as the session's own ``release`` would

    async def aclose(self) -> None:
        """Send what is queued, then close (the standby too)."""
        if self._closing:
            return
        if self._released and self._error is None:
            self._flush_released()
        self._closing = True
        for task in (self._ckpt_task, self._recovery, self._standby_search):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        for s in {self._inner, self._standby, self._moving} - {None}:
            if s is not None:
                s.on_fail = None
                with contextlib.suppress(Exception):
                    await s.aclose()
        for entry in self._journal:
            if isinstance(entry, _Waited) and not entry.done:
                outer = entry.future(self._loop)
                if not outer.done():
                    outer.set_exception(ConnectionClosed("the session was closed"))
                    outer.add_done_callback(_quiet)
        self._journal.clear()

    # -- what the journal changes -----------------------------------------------------------------
    def _freed(self, h: int) -> None:
        self._journal.append(h)
        self._live.pop(h, None)
        self._dirty.discard(h)
        if self._host:
            self._host.pop(h, None)

    def _write(self, h: int) -> None:
        self._dirty.add(h)
        if self._host:
            self._host.pop(h, None)

    def _track(
        self, spec: CallSpec, args: list[Any], buffer: memoryview | None, packed: bytes
    ) -> None:
        """What an ASYNC call makes, writes, frees or creates (the state a checkpoint keeps)."""
        if spec is _LAUNCH_NEW:
            live, dirty = self._live, self._dirty
            for w in args[2]:
                h = w[0]
                if w[1] == 0 and h not in live:
                    live[h] = _nbytes(w)
                dirty.add(h)
            return
        if spec is _LAUNCH:
            for w in args[2]:
                self._write(w[0])
            return
        if spec is _FREE or spec is _FREE_BUFFERS:
            live, dirty, host = self._live, self._dirty, self._host
            for h in args if spec is _FREE else args[0]:
                live.pop(h, None)
                dirty.discard(h)
                host.pop(h, None)
            return
        if spec is _ALLOC:
            self._live[args[0]] = args[1]
            self._write(args[0])
            return
        if spec is _H2D:
            w = args[0]
            h = w[0]
            self._dirty.add(h)
            if buffer is not None and w[1] == 0 and _nbytes(w) == self._live.get(h, -1):
                self._host[h] = buffer  # the client's own copy of the whole buffer
            else:
                self._host.pop(h, None)
            return
        if spec is _D2D:
            self._write(args[0][0])
        elif spec is _MEMSET:
            self._write(args[0])
        elif spec is _KERNEL_LAUNCH:
            for k in args[1]:
                if k[0] == "a":
                    self._write(k[1][0])
        elif spec is _REPLAY:
            for w in args[1]:  # a step may write its arguments
                self._write(w[0])
            for h in self._step_writes.get(args[0], ()):  # and arrays it closes over
                self._write(h)
            sizes = self._step_results.get(args[0], [])
            for h, n in zip(args[2], sizes, strict=False):
                self._live[h] = n
                self._dirty.add(h)
        elif spec.opcode in _CREATES:
            kind = _CREATES[spec.opcode]
            self._res[(kind, args[0])] = packed
            if kind == "stream":
                self._streams = True
            elif kind == "step":
                self._step_results[args[0]] = _step_sizes(args[1])
                self._step_writes[args[0]] = _step_writes(args[1])
        elif spec.opcode in _ENDS:
            kind = _ENDS[spec.opcode]
            self._res.pop((kind, args[0]), None)
            if kind == "step":
                self._step_results.pop(args[0], None)
                self._step_writes.pop(args[0], None)

    # -- replies ------------------------------------------------------------------------------
    def _chain(self, entry: _Waited, fut: asyncio.Future[Any]) -> None:
        """Answer ``entry`` (its outer future) with ``fut``'s reply, unless the session is
        lost first: then the call is re-issued by the move."""

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled():  # its waiter gave up: the proxy ran it, the answer is unknown
                self._awaited.pop(f, None)
                self._unanswered.discard(entry)
                if not entry.done and entry.spec is _DYNAMIC:
                    self._dynamic -= 1
                elif not entry.ack and entry.spec is not _DYNAMIC:
                    entry.deferred = True  # re-issued as a synchronisation: it may have
                    # taken an error that nobody saw, as it would again
                entry.done = True
                return
            exc = f.exception()
            if exc is not None and _is_loss(exc):
                return
            self._awaited.pop(f, None)
            self._unanswered.discard(entry)
            first = not entry.done
            entry.done = True
            if not entry.ack:
                entry.buffer = None  # a SYNC call's data is not needed again
                if entry.spec is not _DYNAMIC and entry.spec is not _IMPORT:
                    entry.args = []  # nor a read's arguments (kept alive, they cost the GC)
            if exc is None:
                value = f.result()[0]
                if entry.spec is _DYNAMIC and first:
                    entry.value = value
                    for h, (shape, dtype) in zip(entry.args[2], value, strict=True):
                        self._live[h] = math.prod(shape) * DTYPES[dtype].itemsize
                        self._dirty.add(h)
                elif entry.spec is _IMPORT:
                    entry.value = True  # it wrote the array
                    self._ckpt_due = True  # another proxy's data: kept by a checkpoint soon
            else:
                entry.deferred = isinstance(exc, RemoteCallError) and exc.deferred
            if entry.spec is _DYNAMIC and first:
                self._dynamic -= 1
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
        if self._closing:
            return
        if session is self._standby:
            log.warning("failover: the standby at %s is gone (%s)", self._standby_url, exc)
            self._standby = None
            self._forget_standby_copies()
            return
        if session is not self._inner or self._recovery is not None:
            return
        self._inner = None
        self._recovery = self._loop.create_task(self._recover(session, exc, time.perf_counter()))

    # -- checkpoints ---------------------------------------------------------------------------
    def _maybe_checkpoint(self) -> None:
        if (
            self._ckpt_task is not None
            or self._inner is None
            or self._closing
            or self._recovery is not None
        ):
            return
        if not self._journal and not self._ckpt_due:
            return
        since = time.monotonic() - self._ckpt_last
        if self._ckpt_due or since >= self.failover.checkpoint_interval_s:
            self._ckpt_task = self._loop.create_task(self._checkpoint())

    async def _ensure_standby(self, wait: bool) -> ClientSession | None:
        """The standby session, if there is one; else one is looked for (opened on another
        proxy where one can be had), and, with ``wait``, waited for. A checkpoint that
        must be taken at once (after a move, or with the standby lost) does not wait: the
        pool may take a second to place one while a proxy restarts."""
        standby = self._standby
        if standby is not None and not standby.closed:
            return standby
        if (
            self._standby_search is None
            and self._inner is not None
            and time.monotonic() >= self._standby_next
        ):
            self._standby_next = time.monotonic() + _STANDBY_RETRY_S
            self._standby_search = self._loop.create_task(self._find_standby(self._inner.url))
        if wait and self._standby_search is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._standby_search)
            standby = self._standby
            return standby if standby is not None and not standby.closed else None
        return None

    async def _find_standby(self, primary: str) -> None:
        """Open a standby session on a proxy other than ``primary`` (and the lost ones)."""
        try:
            for url, extra in await self._targets.each({primary, *self._dead}):
                try:
                    session, _ = await self._open(url, extra)
                except (GpuRemoteError, OSError) as exc:
                    log.info("failover: no standby at %s (%s)", url, exc)
                    continue
                inner = self._inner
                if (
                    self._closing
                    or self._standby is not None
                    or inner is None
                    or (
                        url == inner.url  # the session moved there meanwhile
                    )
                ):
                    await session.aclose()
                    return
                self._hook(session)
                self._standby, self._standby_url = session, url
                return
        except GpuRemoteError as exc:
            log.info("failover: no standby (%s)", exc)
        finally:
            self._standby_search = None

    async def _open(self, url: str, extra: dict[str, Any]) -> tuple[ClientSession, dict[str, Any]]:
        return await open_session(
            url, pipeline=self.config, limits=self._limits, **{**self._options, **extra}
        )

    async def _checkpoint(self) -> None:
        """Copy every buffer written since the last checkpoint (see the module docstring)."""
        epoch = self._epoch
        snapshot: tuple[dict[int, int], set[int], dict[int, memoryview]] | None = None
        made: list[int] = []  # this checkpoint's copies on the standby, not committed
        aside: list[int] = []  # its copies on the session's own proxy (many buffers)
        unread: dict[str, int] = {}  # tickets exported and not imported (bytes)
        inner = standby = None
        try:
            standby = await self._ensure_standby(wait=self._base_complete)
            inner = self._inner
            if (
                epoch != self._epoch
                or inner is None
                or self._closing
                or self._dynamic
                or self._recovery is not None
            ):
                return
            if time.monotonic() < self._client_until:
                standby = None
            self._snapshotting = True  # a finalizer's free now goes after this point
            if self._released:
                self._flush_released()
            # the state at this point of the journal; what comes after is tracked apart
            upto = len(self._journal)
            waiting = list(self._unanswered)  # calls before this point not answered yet
            live, dirty, host = dict(self._live), self._dirty, self._host
            res = dict(self._res)
            snapshot = (live, dirty, host)
            self._dirty, self._host = set(), {}
            base = self._base
            # written since the last checkpoint, or whose copy was lost (with a standby, or
            # taken over by a move), and not known to the client from its upload
            move = sorted(h for h in live if h not in host and (h in dirty or h not in base))
            # all sent now, at this point of the session's order: a synchronisation (which
            # takes an error the application has pending), then the reads (to the client) or
            # the exports (to the standby), or copies aside and a synchronisation of their own
            calls: list[asyncio.Future[Any]] = []
            try:
                sync = inner.start_call(_SYNC, 0, [])
                if standby is None:
                    calls = [inner.start_call(_D2H, 0, [_u8(h, live[h])]) for h in move]
                elif len(move) <= _TICKETS:
                    calls = [inner.start_call(_EXPORT, 0, [_u8(h, live[h])]) for h in move]
                else:
                    for h in move:
                        a = next(self._ck_handles)
                        inner.submit(_ALLOC, 0, [a, live[h]])
                        inner.submit(_D2D, 0, [_u8(a, live[h]), _u8(h, live[h])])
                        aside.append(a)
                    calls = [inner.start_call(_SYNC, 0, [])]
            except LocalProtocolError as exc:  # the application's unsent call: its error
                self._stash.append(exc)
                return
            except GpuRemoteError:
                return
            finally:
                self._snapshotting = False
            for f in calls:
                f.add_done_callback(_quiet)
            try:
                await sync
            except RemoteCallError as exc:
                if not exc.deferred:
                    return
                self._mark_taken(upto)  # the application's error: raised at its next sync,
                self._stash.append(exc)  # once; the copies came after it and went on
            except GpuRemoteError:
                return
            replies = await asyncio.gather(*calls, return_exceptions=True)
            if epoch != self._epoch:
                return
            sources: dict[int, tuple[str, Any]] = {}
            if aside:
                assert standby is not None
                if isinstance(replies[0], BaseException):
                    # a copy aside failed (the session's memory limit, or a buffer the proxy
                    # lacks): the next checkpoint reads through the client, which finds out
                    log.info("failover: a checkpoint's copies aside failed (%s)", replies[0])
                    self._through_client()
                    await self._free_aside(inner, aside)
                    aside = []
                    return
                if not await self._in_waves(
                    inner, standby, move, aside, live, sources, made, unread
                ):
                    return
            else:
                if standby is not None:
                    for h, r in zip(move, replies, strict=True):
                        if not isinstance(r, BaseException):
                            unread[r[0]] = live[h]
                done = []
                for h, r in zip(move, replies, strict=True):
                    if not isinstance(r, BaseException):
                        done.append((h, r))
                    elif _never_made(r):  # its making call failed: the proxy has no such
                        live.pop(h)  # buffer, nor will any other
                        self._live.pop(h, None)
                    else:
                        log.info("failover: a checkpoint did not complete (%s)", r)
                        if standby is not None:
                            self._through_client()
                        return
                if standby is None:
                    for h, (value, bufs) in done:
                        sources[h] = ("host", bufs[value])
                elif not await self._to_standby(
                    standby, done, sources, inner.url, live, made, unread
                ):
                    return
            if (
                epoch != self._epoch
                or self._inner is not inner
                or (standby is not None and standby is not self._standby)
            ):
                return
            if any(not e.done for e in waiting):
                return  # an earlier call is not answered yet: the next checkpoint
            self._commit(upto, live, host, res, sources)
            made, snapshot = [], None
            moved = sum(live[h] for h in sources)
            self.counters.checkpoints += 1
            self.counters.checkpoint_bytes += moved
            if standby is None:
                self.counters.checkpoint_bytes_to_client += moved
        finally:
            self._snapshotting = False
            if aside and inner is not None and inner is self._inner:
                for a in aside:  # exported (the tickets hold copies) or abandoned
                    inner.defer_free(a)
                inner.flush_soon()
            ours = standby is not None and standby is self._standby and not standby.closed
            if unread and ours and inner is not None:  # tickets left: read, so they go
                assert standby is not None
                self._loop.create_task(self._drain(standby, inner.url, list(unread.items())))
            for ck in made:  # an abandoned checkpoint's copies on the standby (a move onto
                if ours:  # it frees them with the others in _ck_pending)
                    assert standby is not None
                    standby.release(ck)
                if standby is not self._moving:
                    self._ck_pending.discard(ck)
            if snapshot is not None:  # not taken: what it held is still to keep
                live, dirty, host = snapshot
                now = self._dirty
                for h, data in host.items():
                    if h in self._live and h not in now:
                        self._host[h] = data
                now.update(h for h in dirty if h in self._live)
            self._ckpt_task = None
            self._ckpt_last = time.monotonic()

    async def _free_aside(self, inner: ClientSession, aside: list[int]) -> None:
        """Free the copies set aside that were made (a zero-byte read of each tells)."""
        at = len(self._journal)
        try:
            probes = [inner.start_call(_D2H, 0, [[a, 0, [0], "uint8"]]) for a in aside]
        except GpuRemoteError:
            return
        replies = await asyncio.gather(*probes, return_exceptions=True)
        for a, r in zip(aside, replies, strict=True):
            if not isinstance(r, BaseException):
                inner.defer_free(a)
            elif isinstance(r, RemoteCallError) and r.deferred:  # the application's error:
                self._mark_taken(at)  # raised at its next sync (that copy, if made, stays)
                self._stash.append(r)
        if not inner.closed:
            inner.flush_soon()

    async def _drain(
        self, standby: ClientSession, url: str, tickets: list[tuple[str, int]]
    ) -> None:
        """Read exported tickets that a checkpoint left (onto the standby, then freed), so
        that they do not hold the exporting proxy's tickets until they expire."""
        for ticket, n in tickets:
            if standby is not self._standby or standby.closed:
                return
            ck = next(self._ck_handles)
            self._ck_pending.add(ck)
            with contextlib.suppress(GpuRemoteError):
                standby.submit(_ALLOC, 0, [ck, n])
                await standby.call(_IMPORT, 0, [_u8(ck, n), url, ticket])
            if standby is self._standby and not standby.closed:
                standby.release(ck)
            if standby is not self._moving:  # (a move onto it frees what is pending)
                self._ck_pending.discard(ck)

    async def _in_waves(
        self,
        inner: ClientSession,
        standby: ClientSession,
        move: list[int],
        aside: list[int],
        live: dict[int, int],
        sources: dict[int, tuple[str, Any]],
        made: list[int],
        unread: dict[str, int],
    ) -> bool:
        """Export the copies set aside and import them on the standby, ``_TICKETS`` at a
        time; False if not all went."""
        epoch = self._epoch
        for i in range(0, len(move), _TICKETS):
            at = len(self._journal)
            wave = list(zip(move[i : i + _TICKETS], aside[i : i + _TICKETS], strict=True))
            try:
                futs = [inner.start_call(_EXPORT, 0, [_u8(a, live[h])]) for h, a in wave]
            except GpuRemoteError:
                return False
            replies = await asyncio.gather(*futs, return_exceptions=True)
            if epoch != self._epoch:
                return False
            ok = True
            for (h, _), r in zip(wave, replies, strict=True):
                if not isinstance(r, BaseException):
                    unread[r[0]] = live[h]
                    continue
                ok = False
                if isinstance(r, RemoteCallError) and r.deferred:  # the application's error,
                    self._mark_taken(at)  # taken here (this export did not run): raised at
                    self._stash.append(r)  # its next sync
                else:
                    log.info("failover: a checkpoint did not complete (%s)", r)
            if not ok:
                return False
            done = [(h, r) for (h, _), r in zip(wave, replies, strict=True)]
            if not await self._to_standby(standby, done, sources, inner.url, live, made, unread):
                return False
        return True

    async def _to_standby(
        self,
        standby: ClientSession,
        done: list[tuple[int, Any]],
        sources: dict[int, tuple[str, Any]],
        url: str,
        live: dict[int, int],
        made: list[int],
        unread: dict[str, int],
    ) -> bool:
        """Copy the exported buffers onto the standby (proxy to proxy); False if not all
        could be."""
        futs = []
        if standby.closed or standby is not self._standby:
            return False
        try:
            for h, (ticket, _) in done:
                ck = next(self._ck_handles)
                self._ck_pending.add(ck)
                made.append(ck)
                n = live[h]
                standby.submit(_ALLOC, 0, [ck, n])
                futs.append(standby.start_call(_IMPORT, 0, [_u8(ck, n), url, ticket]))
                unread.pop(ticket, None)
                sources[h] = ("ck", ck)
        except GpuRemoteError:
            return False
        results = await asyncio.gather(*futs, return_exceptions=True)
        bad = [r for r in results if isinstance(r, BaseException)]
        if not bad:
            return True
        refused = [r for r in bad if isinstance(r, RemoteCallError) and r.is_a(PeerNotAllowed)]
        if refused:  # it may not read from this proxy: not tried again for a while
            log.warning(
                "failover: the standby at %s may not read from %s (%s); checkpoints go "
                "through the client",
                self._standby_url,
                url,
                refused[0],
            )
            self._drop_standby(retry_s=60.0)
        elif not any(isinstance(r, RemoteCallError) and r.is_a(PeerUnreachable) for r in bad):
            # not a link (which may be this proxy going: the standby stays): its memory?
            log.info("failover: a checkpoint did not complete on the standby (%s)", bad[0])
            self._through_client()  # the next one through the client
        self._ckpt_due = True
        return False

    def _through_client(self) -> None:
        """Checkpoints onto the standby fail (its memory, the copies aside, a buffer the
        proxy lacks): they go through the client for a while."""
        self._client_until = time.monotonic() + _STANDBY_RETRY_S * 60

    def _forget_standby_copies(self) -> None:
        """The standby's copies are gone: the checkpoint lacks them until the next one, which
        is taken at once."""
        self._ck_pending.clear()
        kept = {h: v for h, v in self._base.items() if v[1][0] != "ck"}
        if len(kept) != len(self._base):
            self._base = kept
            self._base_complete = False
            self._ckpt_due = True

    def _drop_standby(self, retry_s: float = _STANDBY_RETRY_S) -> None:
        standby, self._standby = self._standby, None
        self._standby_next = time.monotonic() + retry_s
        self._forget_standby_copies()
        if standby is not None:
            standby.on_fail = None
            self._loop.create_task(standby.aclose())

    def _mark_taken(self, at: int) -> None:
        """A synchronisation of this session's own took a deferred error at journal position
        ``at``: journal it there, so that a re-issue clears the error at the same point."""
        marker = _Waited(_SYNC, 0, [], None, False, None)
        marker.done = marker.deferred = True
        self._journal.insert(at, marker)

    def _commit(
        self,
        upto: int,
        live: dict[int, int],
        host: dict[int, memoryview],
        res: dict[tuple[str, int], bytes],
        sources: dict[int, tuple[str, Any]],
    ) -> None:
        """The state at journal position ``upto`` is the checkpoint now."""
        base: dict[int, tuple[int, tuple[str, Any]]] = {}
        for h, n in live.items():
            src = sources.get(h)
            if src is None:
                src = ("host", host[h]) if h in host else self._base[h][1]
            base[h] = (n, src)
        kept = {src[1] for _, src in base.values() if src[0] == "ck"}
        standby = self._standby
        for ck in [src[1] for _, src in self._base.values() if src[0] == "ck"]:
            if ck not in kept and standby is not None:
                standby.release(ck)
        self._ck_pending -= kept
        self._base = base
        self._base_complete = True
        self._res_base = res
        del self._journal[:upto]
        self._jbytes = sum(_entry_bytes(e) for e in self._journal)
        self._ckpt_due = False
        self.counters.journal_calls = len(self._journal)

    # -- moving ------------------------------------------------------------------------------
    async def _recover(self, lost: ClientSession, cause: BaseException, detected: float) -> None:
        """Move the session to another proxy: restore the checkpoint, re-issue the journal."""
        self._epoch += 1
        old_url = lost.url
        self._dead.add(old_url)
        lost.on_fail = None
        log.warning("failover: lost the proxy at %s (%s); moving the session", old_url, cause)
        move: dict[str, Any] = {"from": old_url, "cause": str(cause), "detected": detected}
        if self._ckpt_task is not None:
            self._ckpt_task.cancel()
        try:
            while True:
                session, on_standby = await self._reconnect()
                try:
                    await self._move_to(session, on_standby, move)
                    if session.closed:  # lost as soon as moved to (on_fail came meanwhile)
                        raise ConnectionClosed(f"{session.url} was lost as the session moved")
                    break
                except (ConnectionClosed, RemoteProtocolError) as exc:
                    # lost that one too before the move was done: another, if the
                    # checkpoint is still whole
                    log.warning("failover: lost %s while moving to it (%s)", session.url, exc)
                    self._dead.add(session.url)
                    self._inner = None
                    session.on_fail = None
                    self._epoch += 1
        except asyncio.CancelledError:
            raise  # the session is being closed
        except BaseException as exc:
            err = (
                exc
                if isinstance(exc, FailoverError)
                else FailoverError(
                    f"the session could not move after losing {old_url}: "
                    f"{type(exc).__name__}: {exc}"
                )
            )
            self._error = err
            self._inner = None
            log.error("failover: %s", err)
            for entry in self._journal:
                if isinstance(entry, _Waited) and not entry.done:
                    outer = entry.future(self._loop)
                    if not outer.done():
                        outer.set_exception(FailoverError(str(err)))
                        outer.add_done_callback(_quiet)
            if not isinstance(exc, Exception):
                raise
            return
        finally:
            self._recovery = None
        self.counters.pause_s.append(move["pause_s"])
        self.counters.journal_calls = len(self._journal)
        log.warning(
            "failover: the session moved from %s to %s in %.3f s (reconnect %.3f, restore "
            "%.3f, re-issue %.3f; %d calls re-issued)",
            old_url,
            move["to"],
            move["pause_s"],
            move["reconnect_s"],
            move["restore_s"],
            move["replay_s"],
            move["replayed_calls"],
        )
        self._ckpt_due = True  # keep the new proxy's state elsewhere at once
        self._standby_next = 0.0  # on a new standby, if one can be had
        self._maybe_checkpoint()

    async def _move_to(
        self, session: ClientSession, on_standby: bool, move: dict[str, Any]
    ) -> None:
        """Restore the checkpoint on ``session``, re-issue the journal, and use it."""
        detected = move["detected"]
        t1 = time.perf_counter()
        move["reconnect_s"] = t1 - detected
        self._hook(session)
        self._moving = session
        move["standby"] = on_standby  # the checkpoint's copies were there already
        # the application's calls are journaled meanwhile: re-issued below
        with contextlib.suppress(RemoteCallError):  # a standby's own failed copy, if any
            await self._answer(session)
        move["restored_bytes"] = self._restore(session, on_standby)
        try:
            await self._answer(session)
        except RemoteCallError as exc:
            raise FailoverError(f"restoring the session on {session.url} failed: {exc}") from None
        for packed in self._res_base.values():  # streams, events, kernels, recorded steps
            session.submit(*_unpack(packed), None)
        with contextlib.suppress(RemoteCallError):  # a creation that failed before (its error
            await self._answer(session)  # was raised then) fails again: not raised
        t2 = time.perf_counter()
        move["restore_s"] = t2 - t1
        move["replayed_calls"] = self._replay(session)
        at = len(self._journal)
        probe = session.start_call(_SYNC, 0, [])
        self._inner, self._moving = session, None  # from here on, calls go to it (after the
        # journal)
        self.url = move["to"] = session.url
        if not any(m is move for m in self.moves):  # moved (counted once, even if retried)
            self.moves.append(move)
            self.counters.failovers += 1
        try:
            await self._answer(session, probe)
        except RemoteCallError as exc:
            if exc.deferred:  # an error of a re-issued call, not yet raised: raised next
                self._mark_taken(at)
                self._stash.append(exc)
        t3 = time.perf_counter()
        move["replay_s"] = t3 - t2
        move["pause_s"] = t3 - detected

    async def _answer(self, session: ClientSession, fut: asyncio.Future[Any] | None = None) -> None:
        """A synchronisation on the session being moved to (``fut``, else a new one), within
        ``call_timeout_s`` (else ``failover_timeout_s``): a proxy that stops answering during
        the move is lost too."""
        limit = self.config.call_timeout_s or self.failover.failover_timeout_s
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
        standby = self._standby
        if not self._base_complete:
            raise FailoverError(
                "the session's checkpoint was on a standby proxy that is gone too; "
                "its arrays cannot be restored"
            )
        if standby is not None and not standby.closed:
            self._standby = None
            return standby, True
        if any(src[0] == "ck" for _, src in self._base.values()):
            raise FailoverError(
                "the session's checkpoint was on a standby proxy that is gone too; "
                "its arrays cannot be restored"
            )
        deadline = time.monotonic() + self.failover.failover_timeout_s
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                for url, extra in await self._targets.each(set(self._dead)):
                    try:
                        session, _ = await self._open(url, extra)
                        return session, False
                    except (GpuRemoteError, OSError) as exc:
                        last = exc
            except GpuRemoteError as exc:  # the pool has no live proxy (yet)
                last = exc
            await asyncio.sleep(0.1)
            if self._targets.pool is None:  # a list: its proxies may come back
                self._dead.clear()
        raise FailoverError(
            f"no proxy to move the session to within {self.failover.failover_timeout_s} s "
            f"(last: {last})"
        )

    def _restore(self, session: ClientSession, on_standby: bool) -> int:
        """Re-create the checkpoint's buffers on ``session``; the bytes sent from here."""
        sent = 0
        if on_standby:
            for ck in self._ck_pending:  # copies of a checkpoint that did not complete
                session.defer_free(ck)
            self._ck_pending.clear()
        lost = False
        for h, (n, src) in self._base.items():
            session.submit(_ALLOC, 0, [h, n])
            if src[0] == "host":
                session.submit(_H2D, 0, [_u8(h, n), BUFFER], src[1])
                sent += n
            elif on_standby:
                session.submit(_D2D, 0, [_u8(h, n), _u8(src[1], n)])
                session.defer_free(src[1])
                lost = True
        if lost:  # its copies are the session's buffers now: none is kept elsewhere
            self._base = {h: v for h, v in self._base.items() if v[1][0] == "host"}
            self._base_complete = False
        return sent

    def _replay(self, session: ClientSession) -> int:
        """Re-issue the journal on ``session``; the number of calls sent."""
        n = 0
        ordered: set[int] = set()  # answered writes after which a synchronisation is safe
        if self._streams:  # (an ack is answered even with an error pending: a sync after it
            clean = False  # would take that error early, unless the next sync found none)
            for e in reversed(self._journal):
                if isinstance(e, _Waited):
                    if not e.ack:
                        clean = e.done and not e.deferred
                    elif clean and e.done:
                        ordered.add(id(e))
        for e in self._journal:
            t = type(e)
            if t is int:
                session.defer_free(e)
                continue
            if t is bytes:
                session.submit(*_unpack(e), None)
                n += 1
                continue
            if t is tuple:
                session.submit(*_unpack(e[0]), e[1])
                n += 1
                continue
            if not e.done:  # not answered: it is now
                e.future(self._loop)
                start = session.start_ack if e.ack else session.start_call
                self._chain(e, start(e.spec, e.stream, [*e.args], e.buffer))
            elif e.ack and not e.deferred:
                session.submit(e.spec, e.stream, [*e.args], e.buffer)
                if id(e) in ordered:  # the client waited for it: later work on other streams
                    session.start_call(_SYNC, 0, []).add_done_callback(_quiet)  # came after
            elif e.deferred:  # it took a deferred error: a synchronisation there
                session.start_call(_SYNC, e.stream, []).add_done_callback(_quiet)
            elif e.spec is _DYNAMIC:
                session.start_call(e.spec, e.stream, [*e.args], None).add_done_callback(_quiet)
            elif e.spec is _IMPORT:
                if e.value is True and not e.stashed:  # once, for an import that wrote
                    e.stashed = True
                    self._stash.append(
                        FailoverError(
                            f"an array copied from another proxy ({e.args[1]}) just before "
                            "the session moved could not be restored: copy it again"
                        )
                    )
                continue
            elif self._streams:  # answered: the client went on after the stream's work
                # was done, so work it then issued on another stream came after it; re-issued
                # at once, only a synchronisation keeps that order (one stream keeps it alone)
                session.start_call(_SYNC, 0, []).add_done_callback(_quiet)
            else:
                continue
            n += 1
        return n


_PACKER = msgpack.Packer()
_PACK = _PACKER.pack


def _unpack(packed: bytes) -> tuple[CallSpec, int, list[Any]]:
    """A journaled call's spec, stream and args (``BUFFER`` where its host data goes)."""
    opcode, stream, args = msgpack.unpackb(packed)
    spec = CALLS_BY_OPCODE[opcode]
    if spec is _H2D:
        args[1] = BUFFER
    return spec, stream, args


def _step_sizes(program: list[Any]) -> list[int]:
    """The bytes of each result buffer of a recorded step (its wire form)."""
    arrays, commands, _, results = program
    sizes: dict[int, int] = {}
    for opcode, _, args in commands:
        if opcode == _ALLOC.opcode:
            sizes[args[0]] = args[1]
        elif opcode == _LAUNCH_NEW.opcode:
            for i in args[2]:
                w = arrays[i]
                if w[1] == 0:
                    sizes.setdefault(w[0], _nbytes(w))
    return [sizes.get(h, 0) for h in results]


def _step_writes(program: list[Any]) -> list[int]:
    """The buffers a recorded step writes that are neither its arguments nor its own (the
    session's arrays it closes over): written at each replay."""
    arrays, commands, slots, _ = program
    created: set[int] = set()
    written: set[int] = set()
    for opcode, _, args in commands:
        spec = CALLS_BY_OPCODE.get(opcode)
        if spec is _ALLOC:
            created.add(args[0])
        elif spec is _LAUNCH_NEW:
            created.update(arrays[i][0] for i in args[2])
        elif spec is _LAUNCH:
            written.update(arrays[i][0] for i in args[2])
        elif spec is _D2D:
            written.add(arrays[args[0]][0])
        elif spec is _MEMSET:
            written.add(args[0])
        elif spec is _KERNEL_LAUNCH:
            written.update(arrays[k[1]][0] for k in args[1] if k[0] == "a")
    return sorted(written - created - {arrays[i][0] for i in slots})


def _never_made(exc: BaseException) -> bool:
    """Whether a checkpoint's read of a buffer failed because the proxy has no such buffer
    (the call that was to make it failed, and its error was the application's)."""
    return isinstance(exc, RemoteCallError) and not exc.deferred and exc.is_a(UnknownHandle)


def _entry_bytes(e: Any) -> int:
    if type(e) is tuple:
        return int(e[1].nbytes)
    if isinstance(e, _Waited) and e.buffer is not None:
        return e.buffer.nbytes
    return 0


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
    targets = _Targets(url, cfg)
    first, extra = await targets.take(set())
    inner, info = await open_session(
        first, pipeline=pipeline, limits=limits, **{**options, **extra}
    )
    session = FailoverSession(inner, cfg, targets, {**options, **extra}, limits)
    return session, info
