"""A proxy connection driven from synchronous code.

The session lives on an event loop of its own that no thread runs all the time. Array
operations are posted without waiting (a lock-free deque); a call that waits for the proxy runs
the loop *in the calling thread* until its reply is in, sending everything posted before it in
the same frame: no thread hand-off on the synchronous path. A helper thread sends what was
posted and not taken by a waiting call within ``nudge_us`` (so work starts on the proxy without
a synchronising call), and runs the calls of threads that already run an event loop of their
own (asyncio code, Jupyter), which cannot run a second one.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from ..core.arrays import Call, Core, HostCopies, drive_now
from ..errors import ConnectionClosed
from ..session import opener
from ..session.contract import Reply, Session
from ..wire.calls import CALLS_BY_NAME, CallSpec
from ._array import Array

__all__ = ["Device", "default_device", "set_default_device"]

T = TypeVar("T")
_C = CALLS_BY_NAME
_FREE = _C["free"]

_OPEN: weakref.WeakSet[Device] = weakref.WeakSet()
_opened = itertools.count()  # the order devices were opened in
_IDLE_S = 0.05  # how long the helper polls after the last post before it sleeps


class Device:
    """A connection to a gpuremote proxy, usable from plain synchronous code.

    ``gpuremote.xp.connect(url)`` makes one (and makes it the default device); arrays carry
    theirs as ``x.device``. ``close()`` (or a ``with`` block) ends the session.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        serve: str | None = None,
        nudge_us: float = 200.0,
        **options: Any,
    ) -> None:
        # asyncio's own loop, not uvloop: the loop is run once per waiting call, and uvloop
        # sets up (and tears down) a signal socketpair each time it runs in the main thread
        self._loop = asyncio.new_event_loop()
        self._owner = threading.Lock()  # held by whichever thread runs the loop
        self._driver: int | None = None  # that thread's id
        self._posted: deque[tuple[CallSpec, int, list[Any], memoryview | None]] = deque()
        self._jobs: deque[tuple[Coroutine[Any, Any, Any], concurrent.futures.Future[Any]]] = deque()
        self._wake = threading.Event()  # something is posted, or a job waits
        self._nudge_s = nudge_us / 1e6
        self._polling = False  # the helper looks at the posts every nudge_s
        self._first_post = 0.0  # when the oldest post not yet sent was made
        self._error: BaseException | None = None
        self.closed = False
        #: the connection to the proxy was lost (a call raised ``ConnectionClosed``): the
        #: default device then connects anew at its next use
        self.lost = False
        self._proxy: Any = None
        #: how the last ``copy_from`` went: "proxy to proxy" or "through the client (why)"
        self.last_copy = ""
        self._helper = threading.Thread(target=self._help, name="gpuremote-xp", daemon=True)
        self._helper.start()

        async def open_() -> tuple[str, Session, dict[str, Any]]:
            target = url
            if serve is not None:  # a proxy of our own, on this loop (loads the proxy side)
                from ..proxy import Proxy

                self._proxy = Proxy(serve)
                target = await self._proxy.start(url or f"inproc://xp-{id(self):x}")
            session, info = await opener.open(target, **options)
            return session.url, session, info

        try:
            self._url, self.session, self.info = self._run(open_())
        except BaseException:
            self._stop_loop()
            raise
        cfg = self.session.config
        #: the array core of this device's session (``gpuremote.core.arrays``)
        self.core = Core(
            self,
            self.session,
            self.post,
            self._release,
            Array,
            HostCopies(cfg.shadow, cfg.shadow_max_bytes),
        )
        self._order = next(_opened)
        _OPEN.add(self)

    @property
    def url(self) -> str:
        """The URL of the proxy serving this device's session (with failover: the current
        one)."""
        return self.session.url or self._url

    @property
    def backend(self) -> str:
        """The proxy's backend (``numpy``, ``cupy``, ``sim``)."""
        return str(self.info.get("backend", "?"))

    # -- driving the loop ------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the device's loop: in this thread, or, where this thread runs a
        loop of its own, on the helper thread."""
        if self._driver == threading.get_ident():
            coro.close()
            raise RuntimeError("gpuremote.xp cannot be called from its own event loop")
        if asyncio._get_running_loop() is not None:
            job: concurrent.futures.Future[T] = concurrent.futures.Future()
            self._jobs.append((coro, job))
            self._wake.set()
            return job.result()
        with self._owner:
            return self._drive(coro)

    def _drive(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run the loop until ``coro`` is done (the caller holds ``_owner``)."""
        self._driver = threading.get_ident()
        try:
            return self._loop.run_until_complete(coro)
        finally:
            self._driver = None

    def _help(self) -> None:
        """The helper thread: sends what was posted and not sent within ``nudge_s``, runs the
        jobs of threads that cannot drive the loop. While posts keep coming it polls every
        ``nudge_s`` (posting then signals nothing); after ``_IDLE_S`` without any it sleeps
        until the next post."""
        wake, posted, jobs = self._wake, self._posted, self._jobs
        while not self.closed:
            wake.wait()
            self._polling = True
            quiet = 0.0
            while quiet < _IDLE_S or posted or jobs:
                wake.wait(self._nudge_s)  # a job wakes it at once; a waiting call may
                wake.clear()  # take the posts meanwhile
                while jobs:
                    coro, job = jobs.popleft()
                    with self._owner:
                        try:
                            job.set_result(self._drive(coro))
                        except BaseException as exc:
                            job.set_exception(exc)
                if self.closed:
                    return
                if posted:
                    quiet = 0.0
                    if time.perf_counter() - self._first_post < self._nudge_s:
                        continue  # posted just now: a waiting call is likely to take it
                    with self._owner:
                        if not self._loop.is_closed():
                            self._drive(self._send_posted())
                else:
                    quiet += self._nudge_s
                if quiet >= _IDLE_S:
                    self._polling = False  # posts signal again from here on; then look once
                    # more, for one that came before they did
            self._polling = False

    async def _send_posted(self) -> None:
        self._drain()
        with contextlib.suppress(Exception):  # errors surface at the next waiting call
            await self.session.flush()

    def post(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> None:
        """Queue an ASYNC call (returns at once; it is sent with the next batch)."""
        if self.closed:
            raise ConnectionClosed(f"the device {self.url} is closed")
        posted = self._posted
        if not posted:
            self._first_post = time.perf_counter()
        posted.append((spec, stream, args, buffer))
        if not self._polling:  # the helper sleeps: it will send this if no call does
            self._wake.set()

    def _drain(self) -> None:
        """On the loop: hand everything posted to the session, in order."""
        session = self.session
        posted, submit, release = self._posted, session.submit, session.defer_free
        while posted:
            item = posted.popleft()
            try:
                if item[0] is _FREE:  # goes with the session's next frees, before what follows
                    release(*item[2])
                else:
                    submit(*item)
            except Exception as exc:
                if self._error is None:
                    self._error = exc

    def _release(self, handle: int, nbytes: int = 0) -> None:
        if not self.closed and self._error is None:
            with contextlib.suppress(ConnectionClosed):
                self.post(_FREE, 0, [handle, nbytes])  # in order with the calls around it

    def _start(
        self, spec: CallSpec, args: list[Any], buffer: memoryview | None
    ) -> asyncio.Future[tuple[Any, list[memoryview]]]:
        """Hand the posts to the session, raise a deferred error, send the call."""
        self._drain()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.session.start_call(spec, 0, args, buffer)

    async def _call(
        self, spec: CallSpec, args: list[Any], buffer: memoryview | None = None
    ) -> tuple[Any, list[memoryview]]:
        return await self.session.wait(self._start(spec, args, buffer), spec.name)

    def call(
        self, spec: CallSpec, args: list[Any], buffer: memoryview | None = None
    ) -> tuple[Any, list[memoryview]]:
        """A SYNC call: sends everything posted before it, then waits for its reply."""
        if self.closed:
            raise ConnectionClosed(f"the device {self.url} is closed")
        try:
            return self._call_now(spec, args, buffer)
        except ConnectionClosed:
            self.lost = True  # the default device is replaced at its next use
            raise

    def _call_now(
        self, spec: CallSpec, args: list[Any], buffer: memoryview | None
    ) -> tuple[Any, list[memoryview]]:
        if (
            self._driver is None
            and self.session.plain_wait()
            and asyncio._get_running_loop() is None
            and self._owner.acquire(blocking=False)
        ):
            # the common case: this thread drives the loop, and runs it only until the reply
            # (no task, no coroutine: the loop waits on the call's future itself)
            try:
                self._driver = threading.get_ident()
                # as if on the loop: transports may look it up while the call is sent
                asyncio.events._set_running_loop(self._loop)
                try:
                    fut = self._start(spec, args, buffer)
                finally:
                    asyncio.events._set_running_loop(None)
                return self._loop.run_until_complete(fut)
            finally:
                self._driver = None
                self._owner.release()
        return self._run(self._call(spec, args, buffer))

    # -- arrays (the array core's; this front end only waits) -------------------------------
    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
        """A new, uninitialised array (one ASYNC alloc)."""
        out: Array = self.core.empty(shape, dtype)
        return out

    def upload(self, host: np.ndarray[Any, Any]) -> Array:
        """A remote copy of ``host`` (ASYNC alloc and upload; the host copy is kept within
        the session's ``shadow_max_bytes``)."""
        out: Array = self.core.upload(host)
        return out

    def copy_from(self, array: Array) -> Array:
        """A copy on this device of ``array``, which is on another one: proxy to proxy where
        this device's proxy can reach the other's (the data never comes to this process),
        else through this process. ``last_copy`` says which way the last one went."""
        out, self.last_copy = drive_now(array._core.to_device(array, self.core), _call)
        return out

    def launch(
        self,
        name: str,
        arrays: Sequence[Array],
        params: dict[str, Any],
        into: Array | None = None,
    ) -> list[Array]:
        """Run op ``xp.name`` (ASYNC): new output arrays, or in place into ``into``."""
        return self.core.launch(name, arrays, params, None if into is None else [into])

    def launch_dynamic(
        self, name: str, arrays: Sequence[Array], params: dict[str, Any], n_out: int
    ) -> list[Array]:
        """Run op ``xp.name``, whose output shapes depend on the data (SYNC)."""
        outs: list[Array] = drive_now(self.core.dynamic(name, arrays, params, n_out), _call)
        return outs

    def fetch(self, array: Array) -> np.ndarray[Any, Any]:
        """The array's data on the host: its kept host copy, else a device-to-host copy
        (SYNC), kept where the host-copy policy allows."""
        core = self.core
        host = core.cached(array)
        if host is not None:
            return host
        (_, spec, _, args, buf), writes = core.download(array)
        return core.downloaded(array, self.call(spec, args, buf), writes)

    def synchronize(self) -> None:
        """Wait until everything posted has run; raises the first deferred error."""
        self.call(_C["device_synchronize"], [])

    def stats(self) -> dict[str, Any]:
        """The session's counters (calls per class, frames, round trips, bytes)."""
        self._run(self._noop())
        return self.session.counters.as_dict()

    async def _noop(self) -> None:
        self._drain()

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Send what is posted and close the session (idempotent)."""
        if self.closed:
            return
        with contextlib.suppress(Exception):
            self._run(self._close())
        self.closed = True
        self._stop_loop()
        global _DEFAULT
        if _DEFAULT is self:
            _DEFAULT = None

    async def _close(self) -> None:
        self._drain()
        await self.session.aclose()
        if self._proxy is not None:
            await self._proxy.close()

    def _stop_loop(self) -> None:
        self.closed = True
        self._wake.set()
        if self._helper is not threading.current_thread():
            self._helper.join(5)
        with self._owner:
            if not self._loop.is_closed():
                self._loop.close()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.backend
        return f"<gpuremote.xp.Device {self.url} ({state})>"


def _call(request: Call) -> Reply:
    """A call of an array core procedure, made on its device (``drive_now``)."""
    core, spec, _, args, buf = request
    device: Device = core.owner
    return device.call(spec, args, buf)


_DEFAULT: Device | None = None


def set_default_device(device: Device | None) -> None:
    """Make ``device`` the one creation functions use when given no ``device=``."""
    global _DEFAULT
    _DEFAULT = device


def default_device() -> Device:
    """The default device; connects to the configured proxy URL on first use, and again
    after the connection was lost (the call that found it lost raised ``ConnectionClosed``)."""
    global _DEFAULT
    if _DEFAULT is not None and _DEFAULT.lost and not _DEFAULT.closed:
        with contextlib.suppress(Exception):
            _DEFAULT.close()
        _DEFAULT = None
    if _DEFAULT is None or _DEFAULT.closed:
        _DEFAULT = Device()
    return _DEFAULT


def open_devices() -> list[Device]:
    """The devices open in this process, the default one first, then in the order they were
    opened; with none open, the default device (which connects)."""
    opened = sorted((d for d in _OPEN if not d.closed), key=lambda d: d._order)
    if _DEFAULT is not None and _DEFAULT in opened:
        opened.remove(_DEFAULT)
        opened.insert(0, _DEFAULT)
    return opened or [default_device()]


@atexit.register
def _close_all() -> None:
    for device in list(_OPEN):
        device.close()
