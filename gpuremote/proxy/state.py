"""One client session's state on the proxy, independent of any network: its handle tables
(buffers, streams, events, kernels, recorded steps), its device memory against its limits,
its figures, and what one command sees of the batch it is in.

The executor (``gpuremote.proxy.executor``) runs each batch's calls on it; the handlers of the
calls (``gpuremote.proxy.handlers``) change it. A handle the client names that its session
does not hold is an ``UnknownHandle`` (the kind the client sees); any other reason a call
cannot run is a ``CallFailed``.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..backends import Backend
from ..backends.torch_runtime import Unadopted
from ..errors import UnknownHandle
from ..wire.calls import CallClass
from ..wire.protocol import ArrayDesc, BadCommandAt, Command, ErrorInfo
from .steps import RecordedStep

__all__ = [
    "CALL_FAILURES",
    "BatchContext",
    "CallFailed",
    "CollectiveTable",
    "Handler",
    "PeerReads",
    "ReplayFailed",
    "SessionLimits",
    "SessionState",
    "TicketTable",
    "UnknownHandle",
]


#: what runs one call: ``handler(state, ctx, *args)`` (``gpuremote.proxy.handlers``)
Handler = Callable[..., Any]


class CallFailed(Exception):
    """A command cannot run; the message goes back to the client."""


#: what a handler raises when its call cannot run (the message goes back to the client)
CALL_FAILURES = (CallFailed, UnknownHandle)


class ReplayFailed(Exception):
    """A call of a step's replay failed: ``cause``, in the op it names."""

    def __init__(self, op: str, cause: Exception) -> None:
        super().__init__(str(cause))
        self.op = op
        self.cause = cause


class TicketTable(Protocol):
    """The proxy's table of exported arrays (``peers.Tickets``): ``peer_export`` adds to it,
    ``peer_read`` takes from it, a session's end drops what it left."""

    def add(self, session: int, buffer: Any, nbytes: int) -> str: ...
    def take(self, ticket: str) -> tuple[Any, int]: ...
    def held_bytes(self, session: int | None = None) -> int: ...
    def drop_session(self, session: int) -> None: ...


class CollectiveTable(Protocol):
    """The proxy's process groups (``collectives.Collectives``): the ``dist_*`` calls use
    them; a session's end drops its groups and the job stores it hosts."""

    def host(self, session: int, size: int, timeout_s: float) -> list[Any]: ...
    def join(
        self,
        session: int,
        group_id: int,
        host: str,
        port: int,
        key: str,
        rank: int,
        size: int,
        timeout_s: float,
        device: Any,
    ) -> Any: ...
    def group(self, session: int, group_id: int) -> Any: ...
    def run(self, group: Any, op: str, tensors: Sequence[Any], params: dict[str, Any]) -> None: ...
    def leave(self, session: int, group_id: int) -> None: ...
    def drop_session(self, session: int) -> None: ...
    def stats(self, session: int) -> list[dict[str, Any]]: ...


class PeerReads(Protocol):
    """A session's reads from other proxies (``peers.PeerImports``): the proxy's session
    ``fetch``es the data of a batch's ``peer_import`` commands (on the loop) when it
    ``wanted`` some, before the batch runs; the handler ``take``s it as the import runs."""

    def wanted(self, commands: Sequence[Command | BadCommandAt]) -> bool: ...
    async def fetch(self, commands: Sequence[Command | BadCommandAt]) -> None: ...
    def take(self, url: str, ticket: str) -> memoryview: ...
    def clear(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """Per-session quotas, checked before the allocation they would cause, and how the
    session's recorded ATen steps run."""

    max_device_bytes: int = 1 << 62
    max_handles: int = 1 << 20
    max_steps: int = 256  # recorded steps kept at once
    max_step_calls: int = 1 << 16  # their calls, together
    #: how recorded ATen steps run (``gpuremote.proxy.graphs``): "fx" (each one graph),
    #: "inductor" (compiled by the proxy's torch.compile), "ops" (call by call)
    graphs: str = "fx"
    max_compile_s: float = 600.0  # compile time a session's graphs may take, together
    #: ATen op signatures kept at once (``aten_template``: ``gpuremote.torch``'s eager ops),
    #: and their tensors' layouts, together (what they hold of the proxy's memory)
    max_templates: int = 1 << 16
    max_template_tensors: int = 1 << 19


class BatchContext:
    """What one command sees of its batch: the frame's buffers, the reply's buffers, the
    stream it runs on, whether it is the batch's last command, and the backend's batch
    (entered once, by the first command that computes)."""

    __slots__ = (
        "batch",
        "buffers",
        "is_last",
        "out_bufs",
        "stream",
        "stream_handle",
        "used_buffers",
    )

    def __init__(self, buffers: Sequence[memoryview], out_bufs: list[memoryview]) -> None:
        self.buffers = buffers
        self.out_bufs = out_bufs
        self.used_buffers: set[int] = set()
        self.is_last = False
        self.stream: Any = None
        self.stream_handle = 0
        self.batch: contextlib.AbstractContextManager[Any] | None = None

    def reply_buffer(self, data: memoryview, owned: bool = False) -> int:
        """Attach ``data`` to the reply; copied if later commands of the batch could change
        it (unless it is ``owned``: a copy already, which nothing else refers to)."""
        if not self.is_last and not owned:
            data = memoryview(bytes(data))
        self.out_bufs.append(data)
        return len(self.out_bufs) - 1

    def computing(self, backend: Backend) -> None:
        """Enter the backend's batch, once per batch, and only for batches that compute."""
        if self.batch is None:
            self.batch = backend.batch()
            self.batch.__enter__()


class SessionState:
    """The resources of one session (see the module docstring) on ``backend``.

    ``admin`` answers ``admin_stats``; ``tickets`` is the proxy's table of exported arrays;
    ``peers`` this session's reads from other proxies; ``collectives`` the proxy's process
    groups; ``device_io``: the session's
    connection moves device memory itself (ucx:// to a GPU backend), so large uploads
    arrive in device memory and large downloads leave from it."""

    def __init__(
        self,
        backend: Backend,
        limits: SessionLimits = SessionLimits(),
        session_id: int = 0,
        info: dict[str, Any] | None = None,
        admin: Callable[[str], dict[str, Any]] | None = None,
        tickets: TicketTable | None = None,
        peers: PeerReads | None = None,
        device_io: bool = False,
        collectives: CollectiveTable | None = None,
    ) -> None:
        self.backend = backend
        self.device_io = device_io and backend.device_allocator() is not None
        self.tickets = tickets
        #: this session's reads from other proxies, fetched before the batch that uses them
        self.peers = peers
        #: the proxy's process groups, for the collectives between proxies (``dist_*``)
        self.collectives = collectives
        self.info = info or {}
        self.admin = admin
        self.limits = limits
        self.session_id = session_id
        self.buffers: dict[int, Any] = {}
        self.nbytes: dict[int, int] = {}
        self.device_bytes = 0
        #: views of buffers already resolved, per buffer (a few each): by descriptor, and
        #: as a flat torch tensor of a dtype by ("torch", dtype)
        self.views: dict[int, dict[Any, Any]] = {}
        #: what else keeps views of a buffer (the inputs a recorded step's graph keeps between
        #: replays, ``proxy.graphs``): buffer handle -> those, each told ``forget(handle)``
        #: when the buffer is freed or replaced
        self.view_users: dict[int, set[Any]] = {}
        #: the session's default stream: device memory is allocated in order on it
        self.stream0 = backend.create_stream()
        self.streams: dict[int, Any] = {0: self.stream0}
        self.events: dict[int, Any] = {}
        self.kernels: dict[int, Any] = {}
        self.steps: dict[int, RecordedStep] = {}
        self.step_calls = 0  # the kept steps' calls, together
        self.compile_s = 0.0  # spent compiling its steps' graphs (``limits.max_compile_s``)
        self.private_handles = itertools.count(-1, -1)  # handles of steps' intermediates
        self.checked_launches: dict[Any, Any] = {}  # launch signature -> its op, once checked
        #: the session's PyTorch state (``gpuremote.proxy.aten.AtenSession``: its generator,
        #: its torch runtime), made on its first ATen op; opaque here
        self.aten: object = None
        #: the backend checks stream semantics (``sim:check``): it is told each call first
        self.checks = backend.checks
        #: deferred errors, for the next SYNC command; the streams whose work is skipped
        #: until then, and how many calls were
        self.pending: list[ErrorInfo] = []
        self.poisoned: set[int] = set()
        self.skipped = 0
        self.counts = {k.value: 0 for k in CallClass}
        self.failed = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.started = time.time()

    # -- handles ---------------------------------------------------------------------------
    def resolve(self, desc: ArrayDesc) -> Any:
        """The backend's view of array ``desc`` (checked to lie within its buffer)."""
        views = self.views.get(desc.handle)
        if views is not None:
            v = views.get(desc)
            if v is not None:
                return v
        buf = self.buffers.get(desc.handle)
        if buf is None or type(buf) is Unadopted:
            buf = self.buffer(desc.handle)  # (raises for an unknown handle)
        end = desc.offset + desc.nbytes
        if end > self.nbytes[desc.handle]:
            raise CallFailed(
                f"array of {desc.nbytes} bytes at offset {desc.offset} lies outside buffer "
                f"{desc.handle} of {self.nbytes[desc.handle]} bytes"
            )
        v = self.backend.view(buf, desc.offset, desc.shape, desc.dtype)
        if views is None:
            views = self.views[desc.handle] = {}
        if len(views) < 64:
            views[desc] = v
        return v

    def buffer(self, handle: int) -> Any:
        """Buffer ``handle`` of the backend's (made now where it was ``Unadopted``)."""
        buf = self.buffers.get(handle)
        if buf is None:
            raise UnknownHandle(f"unknown buffer handle {handle}")
        if type(buf) is Unadopted:
            buf = self.buffers[handle] = buf.adopt()
        return buf

    def check_new(self, table: dict[int, Any], handle: int, what: str) -> None:
        """``handle`` may name a new ``what`` in ``table`` (unused, within the limit)."""
        if handle in table:
            raise CallFailed(f"{what} handle {handle} is already in use")
        self.check_room(1)

    def check_room(self, more: int) -> None:
        """The session may hold ``more`` handles besides its own (within the limit)."""
        total = len(self.buffers) + len(self.streams) + len(self.events) + len(self.kernels)
        if total + more > self.limits.max_handles:
            raise CallFailed(
                f"session holds {total} handles; the limit is {self.limits.max_handles}"
            )

    def stream(self, handle: int) -> Any:
        stream = self.streams.get(handle)
        if stream is None:
            raise UnknownHandle(f"unknown stream handle {handle}")
        return stream

    def event(self, handle: int) -> Any:
        ev = self.events.get(handle)
        if ev is None:
            raise UnknownHandle(f"unknown event handle {handle}")
        return ev

    def step(self, handle: int) -> RecordedStep:
        step = self.steps.get(handle)
        if step is None:
            raise UnknownHandle(f"unknown step handle {handle}")
        return step

    # -- device memory ---------------------------------------------------------------------
    def alloc(self, handle: int, nbytes: int) -> None:
        """A new buffer of ``nbytes`` under ``handle``, within the session's memory limit."""
        self.check_new(self.buffers, handle, "buffer")
        if self.device_bytes + nbytes > self.limits.max_device_bytes:
            raise CallFailed(
                f"allocating {nbytes} bytes would make this session hold "
                f"{self.device_bytes + nbytes} bytes; its limit is {self.limits.max_device_bytes}"
            )
        self.buffers[handle] = self.backend.alloc(nbytes, self.stream0)
        self.nbytes[handle] = nbytes
        self.device_bytes += nbytes

    def alloc_outputs(self, outputs: tuple[ArrayDesc, ...]) -> list[Any]:
        """The buffers of a ``launch_new``'s outputs (each fills its buffer); returns their
        views (as ``resolve`` would)."""
        views = []
        for d in outputs:
            if d.offset != 0:
                raise CallFailed("launch_new outputs must start their buffer (offset 0)")
            handle = d.handle
            self.alloc(handle, d.nbytes)
            v = self.backend.view(self.buffers[handle], 0, d.shape, d.dtype)
            self.views[handle] = {d: v}
            views.append(v)
        return views

    def adopt(self, handle: int, buf: Any, nbytes: int) -> None:
        """``buf`` (made by the backend, ``nbytes``) is buffer ``handle`` now."""
        self.buffers[handle] = buf
        self.nbytes[handle] = nbytes
        self.device_bytes += nbytes

    def replace(self, handle: int, buf: Any) -> None:
        """``buf`` (of the same size) replaces buffer ``handle``'s memory, which is freed."""
        self.release([self.buffers[handle]])
        self.buffers[handle] = buf
        self.views.pop(handle, None)
        if self.view_users:
            self._forget(handle)

    def free(self, handles: Sequence[int]) -> list[int]:
        """Free the buffers ``handles`` names; returns the handles it does not know."""
        unknown = []
        freed = []
        buffers, nbytes, views, users = self.buffers, self.nbytes, self.views, self.view_users
        for handle in handles:
            buf = buffers.pop(handle, None)
            if buf is None:
                unknown.append(handle)
                continue
            freed.append(buf)
            self.device_bytes -= nbytes.pop(handle)
            views.pop(handle, None)
            if users:
                self._forget(handle)
        if freed:
            self.release(freed)
        return unknown

    def _forget(self, handle: int) -> None:
        """Tell what keeps views of buffer ``handle`` that it is gone."""
        kept = self.view_users.pop(handle, None)
        if kept:
            for user in kept:
                user.forget(handle)

    def release(self, bufs: list[Any]) -> None:
        """Free ``bufs`` in stream order: after the work queued so far on every stream of
        the session (a free comes from any view or from the garbage collector, so it cannot
        know which streams used the buffer)."""
        self.backend.free(bufs, list(self.streams.values()))

    # -- figures and the end ---------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What the session holds and has done."""
        return {
            "session": self.session_id,
            "buffers": len(self.buffers),
            "device_bytes": self.device_bytes,
            "streams": len(self.streams),
            "events": len(self.events),
            "kernels": len(self.kernels),
            "steps": len(self.steps),
            "graphs": self._graph_stats(),
            "groups": [] if self.collectives is None else self.collectives.stats(self.session_id),
            "calls": dict(self.counts),
            "failed": self.failed,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "uptime_s": time.time() - self.started,
        }

    def _graph_stats(self) -> dict[str, int]:
        """The steps replayed as one graph (``gpuremote.proxy.graphs``): how many, their
        replays (after the first, which traces), the ops those ran, the nanoseconds in the
        graphs' callables (wall; the replaying thread's CPU) and in the whole replays (the
        thread's CPU), the seconds spent compiling and the graphs compiled."""
        graphs = [st.graph for st in self.steps.values() if st.graph]
        return {
            "steps": len(graphs),
            "replays": sum(g.replays for g in graphs),
            "ops": sum(g.ops * g.replays for g in graphs),
            "run_ns": sum(g.run_ns for g in graphs),
            "run_thread_ns": sum(g.run_thread_ns for g in graphs),
            "replay_thread_ns": sum(g.replay_thread_ns for g in graphs),
            "compile_s": self.compile_s,
            "compiled": sum(1 for g in graphs if g.compiled is not None),  # (inductor's)
            # on a device that times ops without computing them (``proxy.timedsteps``)
            "timed_steps": sum(1 for st in self.steps.values() if st.timed),
            "timed_replays": sum(st.timed.replays for st in self.steps.values() if st.timed),
        }

    def close(self) -> None:
        """Free everything this session holds (at disconnect), waiting for its device work
        first (off the event loop): its buffers' memory goes to other work only after the
        work queued on them has run; then its streams, the default stream last."""
        if self.tickets is not None:
            self.tickets.drop_session(self.session_id)
        if self.peers is not None:
            self.peers.clear()
        if self.collectives is not None:
            self.collectives.drop_session(self.session_id)
        streams = list(self.streams.values())
        for s in streams:
            with contextlib.suppress(Exception):  # nobody to report a device error to now
                self.backend.synchronize(s)
        with contextlib.suppress(Exception):
            self.backend.free(list(self.buffers.values()), streams)
        self.buffers.clear()
        self.nbytes.clear()
        self.views.clear()
        self.view_users.clear()
        self.device_bytes = 0
        for s in streams[::-1]:  # (mypyc 2.4 cannot compile reversed() of this list)
            self.backend.destroy_stream(s)
        self.streams.clear()
        self.events.clear()
        self.kernels.clear()
        self.steps.clear()
        self.step_calls = 0
