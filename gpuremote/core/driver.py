"""A session opened to a proxy, driven from synchronous code (the front ends ``gpuremote.xp``
and ``gpuremote.torch`` build on it).

The session lives on an event loop of its own that no thread runs all the time. Calls are
posted without waiting (a lock-free deque, from any thread); a call that waits for the proxy
runs the loop *in the calling thread* until its reply is in, sending everything posted before
it in the same frame: no thread hand-off on the synchronous path. A helper thread sends what
was posted and not taken by a waiting call when the session's batching policy says it is due
(``gpuremote.session.batching``: its knobs are the session's ``PipelineConfig``), and runs the
calls of threads that already run an event loop of their own (asyncio code, Jupyter), which
cannot run a second one. The driver keeps no timing of its own: it asks the policy.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
import time
from collections import deque
from collections.abc import Coroutine, Iterator
from typing import Any, Self, TypeVar

from mypy_extensions import mypyc_attr

from ..config import PipelineConfig
from ..errors import ConnectionClosed
from ..session import opener
from ..session.batching import BatchPolicy
from ..session.contract import Session
from ..wire.calls import CALLS_BY_NAME, CallSpec
from .recording import Recording

__all__ = ["SyncDriver"]

T = TypeVar("T")
_FREE = CALLS_BY_NAME["free"]


#: the drivers not closed yet: closed when the interpreter exits (``_close_open``)
_OPEN: set[SyncDriver] = set()


def _close_open() -> None:
    """At exit, before Python stops its daemon threads: send what each open session has
    queued and stop its helper thread. (A helper stopped by the interpreter's end inside
    torch's C++ code, as an in-process proxy's may be, aborts the process.)"""
    for driver in list(_OPEN):
        with contextlib.suppress(Exception):
            driver.close()


atexit.register(_close_open)


class _Signal:
    """A wake-up for the one helper thread: ``set`` from any thread (a lock's release: one
    call, where ``threading.Event.set`` makes six), ``wait`` takes it (no ``clear``); a
    ``set`` while none is waited for is kept for the next ``wait``."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()  # held: not set

    def set(self) -> None:
        try:  # noqa: SIM105 (the hot path of every first post: no contextlib)
            self._lock.release()
        except RuntimeError:  # set already
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until set (at most ``timeout`` seconds); True if it was (and is no more)."""
        return self._lock.acquire(timeout=-1 if timeout is None else timeout)


@mypyc_attr(allow_interpreted_subclasses=True)  # subclassed by the front ends
class SyncDriver:
    """A session opened to ``url`` (see the module docstring), driven from synchronous code:
    ``post`` queues an ASYNC call, ``call`` makes a SYNC one; ``serve``: serve a proxy of
    that backend in this process first (``proxy_options``: the ``Proxy``'s settings; with a
    ``url`` of ``emu+inproc://NAME?...``, behind that emulated link); ``session``: a session
    made already (``gpuremote.tools.direct``'s: each call runs where it is made); the
    pipeline settings among ``options`` set when what is posted goes
    (``gpuremote.session.batching``). Front ends (``gpuremote.xp``, ``gpuremote.torch``)
    build on it."""

    def __init__(
        self,
        url: str | None = None,
        *,
        serve: str | None = None,
        session: Session | None = None,
        proxy_options: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        # asyncio's own loop, not uvloop: the loop is run once per waiting call, and uvloop
        # sets up (and tears down) a signal socketpair each time it runs in the main thread
        self._loop = asyncio.new_event_loop()
        self._owner = threading.Lock()  # held by whichever thread runs the loop
        self._driver: int | None = None  # that thread's id
        self._posted: deque[tuple[CallSpec, int, list[Any], memoryview | None]] = deque()
        #: buffers released (from any thread, by finalizers): freed with the next frame,
        #: after everything posted before it (nothing posted later can name them)
        self._freed: deque[tuple[int, int]] = deque()
        self._jobs: deque[tuple[Coroutine[Any, Any, Any], concurrent.futures.Future[Any]]] = deque()
        self._wake = _Signal()  # something is posted, or a job waits
        #: when what is posted goes: the session's policy (made once the session is open)
        self._policy = BatchPolicy(PipelineConfig())
        self._first_post = 0.0  # when the oldest post not yet sent was made
        #: the helper sleeps until woken (the device is idle): a post wakes it
        self._dozing = False
        self._woken = False  # a post woke the helper, which has not looked yet
        self._error: BaseException | None = None
        self.closed = False
        #: the connection to the proxy was lost (a call raised ``ConnectionClosed``): the
        #: default device then connects anew at its next use
        self.lost = False
        self._proxy: Any = None
        #: a step being recorded from this session's calls (``gpuremote.torch``'s compiled
        #: graphs): each posted call is added to it, and a waiting call ends it
        self.recording: Recording | None = None
        #: what is posted is held for the next waiting call (or ``release``), not sent
        #: by the helper: a recording's calls then go in one frame with the recording
        self.holding = False
        #: how the last ``copy_from`` went: "proxy to proxy" or "through the client (why)"
        self.last_copy = ""
        #: seconds spent in ``call`` (sending a call, then waiting for its reply)
        self.call_s = 0.0
        #: counters the front ends keep per session (``gpuremote.torch``'s compiled graphs)
        self.counters: dict[str, int] = {}
        #: the ATen op signatures this session keeps on its proxy, by the front end's key
        #: (``gpuremote.torch``: ``aten_template``), each to its handle there and what the
        #: front end needs to make a call of it
        self.templates: dict[Any, tuple[int, Any]] = {}
        #: what the front end knows of its ops' outputs, by op signature, for this session
        #: (``gpuremote.torch``: meta kernels' answers and its proxy's own)
        self.metas: dict[Any, Any] = {}
        #: what a front end's native code needs of this session, cached by the front end
        #: (``gpuremote.torch``: its templates and the bound methods its C calls make)
        self.native_calls: Any = None
        self._helper = threading.Thread(target=self._help, name="gpuremote-xp", daemon=True)
        self._helper.start()
        _OPEN.add(self)

        #: calls run at once where they are made (a session that runs them in this
        #: process, with no wire: ``gpuremote.tools.direct``), not queued for a frame
        self.direct = session is not None

        async def open_() -> tuple[str, Session, dict[str, Any]]:
            if session is not None:
                # (what a proxy's handshake would announce: a direct session's limits)
                return session.url, session, {"backend": "local", **getattr(session, "info", {})}
            target = url
            if serve is not None:  # a proxy of our own, on this loop (loads the proxy side)
                from ..proxy import Proxy

                self._proxy = Proxy(serve, **(proxy_options or {}))
                listen = url or f"inproc://sync-{id(self):x}"
                if listen.startswith("emu+"):  # the proxy listens behind the emulated link
                    listen = listen.removeprefix("emu+").partition("?")[0]
                bound = await self._proxy.start(listen)
                target = url if url and url.startswith("emu+") else bound
            opened, info = await opener.open(target, **options)
            return opened.url, opened, info

        try:
            self._url, self.session, self.info = self._run(open_())
        except BaseException:
            self._stop_loop()
            raise
        self._policy = BatchPolicy(self.session.config)

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
        """The helper thread: sends what was posted when the batching policy says it is due
        (``gpuremote.session.batching``), and runs the jobs of threads that cannot drive the
        loop. While the device is in use it comes by every ``post_delay_max_us`` on its own,
        so that a post that a waiting call takes at once (a synchronous op) need not wake it;
        idle, it sleeps until a post wakes it. It waits only as long as the oldest post may
        wait."""
        wake, posted, jobs, freed = self._wake, self._posted, self._jobs, self._freed
        while not self.closed:
            while jobs:
                coro, job = jobs.popleft()
                with self._owner:
                    try:
                        job.set_result(self._drive(coro))
                    except BaseException as exc:
                        job.set_exception(exc)
            if self.closed:
                break
            policy = self._policy
            if posted:
                n = len(posted)
                wait_s = policy.post_wait_s(n, time.perf_counter() - self._first_post)
                if self.holding or wait_s > 0:
                    # until the oldest post is due (a job, a full batch, or a post after a
                    # waiting call took the queue, wakes it sooner)
                    self._woken = False
                    wake.wait(max(policy.post_delay_s if self.holding else wait_s, 20e-6))
                    continue
                with self._owner:
                    if not self._loop.is_closed():
                        self._drive(self._send_posted())
                policy.sent_posts(n)
                continue
            self._woken = False
            if not policy.idle(time.perf_counter() - self._first_post):
                wake.wait(policy.post_delay_max_s)  # in use: by again unwoken (frees released
                continue  # meanwhile go with the next frame)
            # idle: what was released goes now, not at the device's next use (unless the
            # helper is to send nothing of its own: a post delay past the idle time)
            frees_now = policy.frees_alone and not self.holding
            if freed and frees_now:
                with self._owner:
                    if not self._loop.is_closed():
                        self._drive(self._send_posted())
            policy.taken()  # the next post goes at the first delay
            self._dozing = True  # (set before the check: a post made after it wakes us)
            if not posted and not jobs and not (freed and frees_now) and not self.closed:
                wake.wait()
            self._dozing = False

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
        if self.direct:  # run now: the trace sees the client's time between calls
            if self.recording is not None:
                self.recording.add(spec, stream, args, buffer)
            if spec is _FREE:
                self.session.defer_free(*args)
            else:
                self.session.submit(spec, stream, args, buffer)
            return
        posted = self._posted
        now = time.perf_counter()
        if not posted:
            self._first_post = now
        if self.recording is not None:
            self.recording.add(spec, stream, args, buffer)
        posted.append((spec, stream, args, buffer))
        # due (a full batch, or the oldest post's delay past: a stream of posts that no
        # waiting call takes): sent from here; else the helper is woken only where it would
        # not come by in time on its own (it sleeps: the device was idle)
        n = len(posted)
        due = self._policy.post_due(n, now - self._first_post)
        if due and self._send_here():
            self._policy.sent_posts(n)
        elif (due or self._dozing) and not self._woken:
            self._woken = True
            self._wake.set()

    def _posted_more(self, n: int, due: bool) -> None:
        """``post``'s end, for a caller that appended its post itself (``gpuremote.torch``'s
        native call): ``n`` posts held, ``due`` by the batching policy (as ``post``, which
        keeps its own lines: the hot path of every post)."""
        if due and self._send_here():
            self._policy.sent_posts(n)
        elif (due or self._dozing) and not self._woken:
            self._woken = True
            self._wake.set()

    def send_replay(self) -> None:
        """What is posted, a compiled graph's replay last, goes now from this thread where
        the policy says so (``replays_at_once``): the proxy runs the graph while this
        thread goes on."""
        if self._policy.replays_at_once and self._posted and self._send_here():
            self._policy.taken()  # (the posts that follow go at the first delay)

    def _send_here(self) -> bool:
        """Send what is posted from this thread (it holds the interpreter, which the helper
        would get only up to Python's switch interval later); False, sending nothing, where
        another thread runs the loop, a recording holds the posts, or calls run where they
        are made."""
        if (
            self.direct
            or self.holding
            or self.closed
            or self._driver is not None
            or asyncio._get_running_loop() is not None
            or not self._owner.acquire(blocking=False)
        ):
            return False
        try:
            self._driver = threading.get_ident()
            asyncio.events._set_running_loop(self._loop)  # (as a waiting call sends it)
            try:
                self._drain()
                with contextlib.suppress(Exception):  # errors surface at the next waiting call
                    self.session.send_queued()
            finally:
                asyncio.events._set_running_loop(None)
        finally:
            self._driver = None
            self._owner.release()
        return True

    def _drain(self, then_call: bool = False) -> None:
        """On the loop: hand everything posted to the session, in order (``then_call``: a
        call that waits is started right after, and sends it all)."""
        session = self.session
        posted, submit, release = self._posted, session.submit, session.defer_free
        freed = self._freed
        # the frees released before this drain began: every call naming their buffers was
        # posted before them, so goes in the loop below, before them (a free released
        # meanwhile, in another thread, may follow a call still to be posted: next time)
        n_freed = len(freed)
        while posted:
            item = posted.popleft()
            try:
                if item[0] is _FREE:  # goes with the session's next frees, before what follows
                    release(*item[2])
                else:
                    submit(*item, then_call=then_call)
            except Exception as exc:
                if self._error is None:
                    self._error = exc
        for _ in range(n_freed):
            release(*freed.popleft())

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Within it, what is posted waits for a waiting call (or the end of the block)
        instead of being sent by the helper: many calls then go in one frame."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
            if self._posted:
                self._wake.set()

    def _release(self, handle: int, nbytes: int = 0) -> None:
        """Free buffer ``handle`` (from any thread: finalizers): with the next frame, after
        what is posted (no call posted later can name a buffer whose last reference died)."""
        if self.closed or self._error is not None:
            return
        if self.direct:
            self.session.defer_free(handle, nbytes)
            return
        self._freed.append((handle, nbytes))
        if self._dozing and self._policy.frees_alone and not self._woken:  # the device idle:
            self._woken = True  # nothing else would send it
            self._wake.set()

    def _start(
        self, spec: CallSpec, args: list[Any], buffer: memoryview | None
    ) -> asyncio.Future[tuple[Any, list[memoryview]]]:
        """Hand the posts to the session, raise a deferred error, send the call."""
        self._policy.taken()
        self._drain(then_call=True)
        try:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            return self.session.start_call(spec, 0, args, buffer)
        except BaseException:  # the call did not send what was drained: the next turn does
            self._loop.create_task(self._send_posted())
            raise

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
        if self.recording is not None:
            self.recording.refuse(f"{spec.name} (it waits for the device)")
        t0 = time.perf_counter()
        try:
            return self._call_now(spec, args, buffer)
        except ConnectionClosed:
            self.lost = True  # the default device is replaced at its next use
            raise
        finally:
            self.call_s += time.perf_counter() - t0

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
            loop = self._loop
            try:
                self._driver = threading.get_ident()
                # as if on the loop: transports may look it up while the call is sent
                asyncio.events._set_running_loop(loop)
                try:
                    fut = self._start(spec, args, buffer)
                    # answered as it was sent (a proxy in this thread): no loop turn at all
                    if not fut.done():
                        self._turn_until(fut)
                finally:
                    asyncio.events._set_running_loop(None)
                return fut.result()
            finally:
                self._driver = None
                self._owner.release()
        return self._run(self._call(spec, args, buffer))

    def _turn_until(self, fut: asyncio.Future[Any]) -> None:
        """Turn the loop (this thread's own, marked running) until ``fut`` is done: what
        ``run_until_complete`` does, less its set-up and the extra turn for its stop
        callback, which cost as much again as the turn that brings a reply in."""
        loop: Any = self._loop
        run_once = getattr(loop, "_run_once", None)
        if run_once is None:  # not asyncio's own loop (an event loop policy's, uvloop's)
            asyncio.events._set_running_loop(None)
            loop.run_until_complete(fut)
            return
        loop._thread_id = threading.get_ident()  # (what run_forever marks a running loop by)
        try:
            while not fut.done():
                run_once()
        finally:
            loop._thread_id = None

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

    async def _close(self) -> None:
        self._drain()
        await self.session.aclose()
        if self._proxy is not None:
            await self._proxy.close()

    def _stop_loop(self) -> None:
        self.closed = True
        _OPEN.discard(self)
        self._wake.set()
        if self._helper is not threading.current_thread():
            self._helper.join(5)
        with self._owner:
            if not self._loop.is_closed():
                self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
