"""The proxy's executor: one per client session, independent of any network.

It holds the session's handle tables (buffers, streams, events, kernels), runs each batch of
decoded commands in order on a backend, and answers the commands that need a reply. A failing
ASYNC command becomes a deferred error: later work on its stream is skipped, and the error is
the answer to the session's next SYNC command, after which the session goes on normally.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..backends import Backend
from ..errors import PeerUnreachable
from ..ops import OPS, infer
from ..wire.calls import CallClass
from ..wire.framing import DEVICE_DIRECT_MIN, byte_view
from ..wire.protocol import (
    PROTOCOL_VERSION,
    ArrayDesc,
    BadCommandAt,
    Command,
    ErrorInfo,
    Reply,
    StepProgram,
)
from .steps import RecordedStep, StepError, rebind

__all__ = ["PROTOCOL_VERSION", "Executor", "PeerReads", "SessionLimits", "TicketTable"]


class TicketTable(Protocol):
    """The proxy's table of exported arrays (``peers.Tickets``): ``peer_export`` adds to it,
    ``peer_read`` takes from it, a session's end drops what it left."""

    def add(self, session: int, buffer: Any, nbytes: int) -> str: ...
    def take(self, ticket: str) -> tuple[Any, int]: ...
    def held_bytes(self, session: int | None = None) -> int: ...
    def drop_session(self, session: int) -> None: ...


class PeerReads(Protocol):
    """A session's reads from other proxies (``peers.PeerImports``): the proxy's session
    ``fetch``es the data of a batch's ``peer_import`` commands (on the loop) when it
    ``wanted`` some, before the batch runs; the executor ``take``s it as the import runs."""

    def wanted(self, commands: Sequence[Command | BadCommandAt]) -> bool: ...
    async def fetch(self, commands: Sequence[Command | BadCommandAt]) -> None: ...
    def take(self, url: str, ticket: str) -> memoryview: ...
    def clear(self) -> None: ...


# calls that manage resources rather than queue work on a stream: never skipped
_MANAGEMENT = frozenset(
    {
        "admin_stats",
        "alloc",
        "free",
        "free_buffers",
        "stream_create",
        "stream_destroy",
        "event_create",
        "event_destroy",
        "kernel_create",
        "hello",
        "stats",
        "ping",
        "step_record",
        "step_free",
    }
)

#: calls whose first argument is an op name (named in their errors)
_LAUNCHES = frozenset({"launch", "launch_new", "launch_dynamic"})


class CallFailed(Exception):
    """A command cannot run; the message goes back to the client."""


class _ReplayFailed(Exception):
    """A call of a step's replay failed: ``cause``, in the op it names."""

    def __init__(self, op: str, cause: Exception) -> None:
        super().__init__(str(cause))
        self.op = op
        self.cause = cause


@dataclass(frozen=True, slots=True)
class SessionLimits:
    """Per-session quotas, checked before the allocation they would cause."""

    max_device_bytes: int = 1 << 62
    max_handles: int = 1 << 20
    max_steps: int = 256  # recorded steps kept at once
    max_step_calls: int = 1 << 16  # their calls, together


class Executor:
    """Runs one session's commands on ``backend``; see the module docstring."""

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
    ) -> None:
        self.backend = backend
        self._checks = backend.checks
        #: the session's connection moves device memory itself (ucx:// to a GPU backend):
        #: large uploads arrive in device memory and large downloads leave from it
        self.device_io = device_io and backend.device_allocator() is not None
        self._tickets = tickets
        #: this session's reads from other proxies, fetched before the batch that uses them
        self.peers = peers
        self.info = info or {}
        self._admin = admin
        self.limits = limits
        self.session_id = session_id
        self.buffers: dict[int, Any] = {}
        self.nbytes: dict[int, int] = {}
        #: the session's default stream: device memory is allocated in order on it
        self._stream0 = backend.create_stream()
        self.streams: dict[int, Any] = {0: self._stream0}
        self.events: dict[int, Any] = {}
        self.kernels: dict[int, Any] = {}
        self.steps: dict[int, RecordedStep] = {}
        self._step_calls = 0  # the kept steps' calls, together
        self._private = itertools.count(-1, -1)  # handles of steps' intermediates
        self.device_bytes = 0
        self._views: dict[int, dict[ArrayDesc, Any]] = {}
        self._checked: dict[Any, Any] = {}  # launch signature -> its op, once checked
        self._poisoned: set[int] = set()
        self._pending: list[ErrorInfo] = []
        self._skipped = 0
        self.counts = {k.value: 0 for k in CallClass}
        self.failed = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.started = time.time()
        self._dispatch = {
            name[5:]: getattr(self, name) for name in dir(self) if name.startswith("_cmd_")
        }

    # -- public ----------------------------------------------------------------------------
    def execute(
        self, commands: Sequence[Command | BadCommandAt], buffers: Sequence[memoryview]
    ) -> tuple[list[Reply], list[memoryview]]:
        """Run a batch in order; return the replies and the reply frame's buffers."""
        replies: list[Reply] = []
        out_bufs: list[memoryview] = []
        if buffers:
            self.bytes_in += sum(b.nbytes for b in buffers)
        last = len(commands) - 1
        ctx = _Ctx(buffers, out_bufs, set(), False, None, 0)
        try:
            self._run(commands, ctx, last, replies)
        finally:
            if ctx.batch is not None:
                ctx.batch.__exit__(None, None, None)
        if out_bufs:
            self.bytes_out += sum(b.nbytes for b in out_bufs)
        return replies, out_bufs

    def _run(
        self, commands: Sequence[Command | BadCommandAt], ctx: _Ctx, last: int, replies: list[Reply]
    ) -> None:
        counts, streams, dispatch = self.counts, self.streams, self._dispatch
        for i, cmd in enumerate(commands):
            if type(cmd) is BadCommandAt:
                self._fail_async_or_reply(
                    cmd.seq,
                    cmd.call,
                    None,
                    "BadCommand",
                    cmd.message,
                    sync=True,
                    replies=replies,
                    stream=None,
                )
                continue
            assert type(cmd) is Command
            spec = cmd.spec
            sync = spec.sync
            counts[spec.kind] += 1
            if sync and self._pending:
                replies.append(Reply(cmd.seq, False, self._take_deferred()))
                continue
            if cmd.stream in self._poisoned and spec.name not in _MANAGEMENT:
                self._skipped += 1
                if spec.name == "launch_new":  # skip the work, but make the buffers it names
                    with contextlib.suppress(CallFailed):
                        self._alloc_outputs(cmd.args[2])
                elif spec.name == "peer_import" and self.peers is not None:
                    with contextlib.suppress(Exception):  # its fetched data is let go
                        self.peers.take(cmd.args[1], cmd.args[2])
                elif spec.name == "step_replay":  # likewise for a step's results
                    with contextlib.suppress(CallFailed, StepError):
                        self._make_results(cmd.args[0], cmd.args[2])
                if cmd.ack:
                    replies.append(Reply(cmd.seq, True, None))
                continue
            try:
                stream = streams.get(cmd.stream)
                if stream is None:
                    raise CallFailed(f"unknown stream handle {cmd.stream}")
                ctx.is_last = i == last
                ctx.stream = stream
                ctx.stream_handle = cmd.stream
                if self._checks:  # sim:check names the calls in its reports
                    self.backend.note_call(
                        cmd.seq,
                        spec.name,
                        cmd.args[0] if spec.name in _LAUNCHES else None,
                        self.session_id,
                        cmd.stream,
                    )
                value = dispatch[spec.name](ctx, *cmd.args)
            except Exception as exc:
                op = cmd.args[0] if spec.name in _LAUNCHES else None
                if isinstance(exc, _ReplayFailed):
                    op, exc = exc.op, exc.cause
                kind = (
                    "CallFailed" if isinstance(exc, CallFailed | StepError) else type(exc).__name__
                )
                self._fail_async_or_reply(
                    cmd.seq,
                    spec.name,
                    op,
                    kind,
                    str(exc) or kind,
                    sync=sync,
                    replies=replies,
                    stream=cmd.stream,
                    ack=cmd.ack,
                )
                continue
            if sync or cmd.ack:
                replies.append(Reply(cmd.seq, True, value))

    def close(self) -> None:
        """Free everything this session holds (at disconnect), waiting for its device work
        first (off the event loop): its buffers' memory goes to other work only after the
        work queued on them has run; then its streams, the default stream last."""
        if self._tickets is not None:
            self._tickets.drop_session(self.session_id)
        if self.peers is not None:
            self.peers.clear()
        streams = list(self.streams.values())
        for s in streams:
            with contextlib.suppress(Exception):  # nobody to report a device error to now
                self.backend.synchronize(s)
        with contextlib.suppress(Exception):
            self.backend.free(list(self.buffers.values()), streams)
        self.buffers.clear()
        self.nbytes.clear()
        self._views.clear()
        self.device_bytes = 0
        for s in reversed(streams):
            self.backend.destroy_stream(s)
        self.streams.clear()
        self.events.clear()
        self.kernels.clear()
        self.steps.clear()
        self._step_calls = 0
        self._dispatch.clear()  # its bound methods hold the executor: no cycle left

    def stats(self) -> dict[str, Any]:
        return {
            "session": self.session_id,
            "buffers": len(self.buffers),
            "device_bytes": self.device_bytes,
            "streams": len(self.streams),
            "events": len(self.events),
            "kernels": len(self.kernels),
            "steps": len(self.steps),
            "calls": dict(self.counts),
            "failed": self.failed,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "uptime_s": time.time() - self.started,
        }

    # -- errors ----------------------------------------------------------------------------
    def _fail_async_or_reply(
        self,
        seq: int,
        call: str,
        op: str | None,
        kind: str,
        message: str,
        *,
        sync: bool,
        replies: list[Reply],
        stream: int | None,
        ack: bool = False,
    ) -> None:
        self.failed += 1
        if sync:
            replies.append(Reply(seq, False, ErrorInfo(seq, call, op, kind, message, False, 0)))
            return
        self._pending.append(ErrorInfo(seq, call, op, kind, message, True, 0))
        if stream is not None:
            self._poisoned.add(stream)
        if ack:
            replies.append(Reply(seq, True, None))

    def _take_deferred(self) -> ErrorInfo:
        first = self._pending[0]._replace(skipped=self._skipped)
        if len(self._pending) > 1:
            first = first._replace(
                message=f"{first.message} (and {len(self._pending) - 1} more failed call(s))"
            )
        self._pending.clear()
        self._poisoned.clear()
        self._skipped = 0
        return first

    # -- resolution ------------------------------------------------------------------------
    def _resolve(self, desc: ArrayDesc) -> Any:
        views = self._views.get(desc.handle)
        if views is not None:
            v = views.get(desc)
            if v is not None:
                return v
        buf = self.buffers.get(desc.handle)
        if buf is None:
            raise CallFailed(f"unknown buffer handle {desc.handle}")
        end = desc.offset + desc.nbytes
        if end > self.nbytes[desc.handle]:
            raise CallFailed(
                f"array of {desc.nbytes} bytes at offset {desc.offset} lies outside buffer "
                f"{desc.handle} of {self.nbytes[desc.handle]} bytes"
            )
        v = self.backend.view(buf, desc.offset, desc.shape, desc.dtype)
        if views is None:
            views = self._views[desc.handle] = {}
        if len(views) < 64:
            views[desc] = v
        return v

    def _new_handle(self, table: dict[int, Any], handle: int, what: str) -> None:
        if handle in table:
            raise CallFailed(f"{what} handle {handle} is already in use")
        total = len(self.buffers) + len(self.streams) + len(self.events) + len(self.kernels)
        if total >= self.limits.max_handles:
            raise CallFailed(
                f"session holds {total} handles; the limit is {self.limits.max_handles}"
            )

    # -- commands (name after "_cmd_" is the call name) -------------------------------------
    def _cmd_hello(self, ctx: _Ctx, version: int, proof: str) -> Any:
        if version != PROTOCOL_VERSION:
            raise CallFailed(f"client speaks protocol {version}; proxy speaks {PROTOCOL_VERSION}")
        info: dict[str, Any] = dict(self.backend.device_info())
        info.update(self.info)
        info.update(
            protocol=PROTOCOL_VERSION,
            session=self.session_id,
            max_device_bytes=self.limits.max_device_bytes,
            max_handles=self.limits.max_handles,
            ops=sorted(OPS),
        )
        return info

    def _cmd_ping(self, ctx: _Ctx, index: int) -> Any:
        data = ctx.buffers[index]
        if self.device_io and self.backend.is_device(data):  # received into device memory
            return ctx.reply_buffer(self.backend.device_copy_out(data, ctx.stream), owned=True)
        return ctx.reply_buffer(data)

    def _cmd_stats(self, ctx: _Ctx) -> Any:
        from .heap import peak_rss_bytes, rss_bytes

        return {
            **self.stats(),
            "rss_bytes": rss_bytes(),
            "peak_rss_bytes": peak_rss_bytes(),
            "process_cpu_s": time.process_time(),  # the proxy's own CPU, all its threads
        }

    def _cmd_admin_stats(self, ctx: _Ctx, token: str) -> Any:
        if self._admin is None:
            raise CallFailed("this proxy serves no admin calls")
        return self._admin(token)

    def _cmd_alloc(self, ctx: _Ctx, handle: int, nbytes: int) -> None:
        self._alloc(handle, nbytes)

    def _alloc(self, handle: int, nbytes: int) -> None:
        self._new_handle(self.buffers, handle, "buffer")
        if self.device_bytes + nbytes > self.limits.max_device_bytes:
            raise CallFailed(
                f"allocating {nbytes} bytes would make this session hold "
                f"{self.device_bytes + nbytes} bytes; its limit is {self.limits.max_device_bytes}"
            )
        self.buffers[handle] = self.backend.alloc(nbytes, self._stream0)
        self.nbytes[handle] = nbytes
        self.device_bytes += nbytes

    def _release(self, bufs: list[Any]) -> None:
        """Free ``bufs`` in stream order: after the work queued so far on every stream of
        the session (a free comes from any view or from the garbage collector, so it cannot
        know which streams used the buffer)."""
        self.backend.free(bufs, list(self.streams.values()))

    def _cmd_free(self, ctx: _Ctx, handle: int) -> None:
        buf = self.buffers.pop(handle, None)
        if buf is None:
            raise CallFailed(f"unknown buffer handle {handle}")
        self.device_bytes -= self.nbytes.pop(handle)
        self._views.pop(handle, None)
        self._release([buf])

    def _cmd_free_buffers(self, ctx: _Ctx, handles: tuple[int, ...]) -> None:
        unknown = []
        freed = []
        buffers, nbytes, views = self.buffers, self.nbytes, self._views
        for handle in handles:
            buf = buffers.pop(handle, None)
            if buf is None:
                unknown.append(handle)
                continue
            freed.append(buf)
            self.device_bytes -= nbytes.pop(handle)
            views.pop(handle, None)
        if freed:
            self._release(freed)
        if unknown:
            raise CallFailed(f"unknown buffer handle(s) {unknown}")

    def _cmd_copy_h2d(self, ctx: _Ctx, dst: ArrayDesc, index: int) -> None:
        data = ctx.buffers[index]
        if data.nbytes != dst.nbytes:
            raise CallFailed(f"copy_h2d of {data.nbytes} bytes into an array of {dst.nbytes}")
        view = self._resolve(dst)
        if self.device_io and self.backend.is_device(data):
            self._device_upload(ctx, dst, index, view, data)
            return
        host = np.frombuffer(data, dtype=np.uint8)
        if (
            dst.offset == 0
            and dst.nbytes == self.nbytes[dst.handle]
            and index not in ctx.used_buffers
            and host.flags.writeable
        ):
            adopted = self.backend.adopt_host(host)
            if adopted is not None:  # the received memory becomes the buffer: no copy
                ctx.used_buffers.add(index)
                self._release([self.buffers[dst.handle]])
                self.buffers[dst.handle] = adopted
                self._views.pop(dst.handle, None)
                return
        ctx.used_buffers.add(index)
        self.backend.from_host(view, host.view(dst.dtype).reshape(dst.shape), ctx.stream)

    def _device_upload(self, ctx: _Ctx, dst: ArrayDesc, index: int, view: Any, data: Any) -> None:
        """``copy_h2d`` of a buffer the transport received into device memory: it becomes
        the destination buffer where it covers it whole, else it is copied on the device."""
        if (
            dst.offset == 0
            and dst.nbytes == self.nbytes[dst.handle]
            and index not in ctx.used_buffers
        ):
            ctx.used_buffers.add(index)
            self._release([self.buffers[dst.handle]])
            self.buffers[dst.handle] = data
            self._views.pop(dst.handle, None)
            return
        ctx.used_buffers.add(index)
        self.backend.copy(view, data.view(dst.dtype).reshape(dst.shape), ctx.stream)

    def _cmd_copy_d2h(self, ctx: _Ctx, src: ArrayDesc) -> Any:
        if self.device_io and src.nbytes >= DEVICE_DIRECT_MIN:  # the transport moves it
            snapshot = self.backend.device_copy_out(self._resolve(src), ctx.stream)
            return ctx.reply_buffer(snapshot, owned=True)
        host = self.backend.to_host(self._resolve(src), ctx.stream)
        return ctx.reply_buffer(byte_view(host))

    def _cmd_copy_d2d(self, ctx: _Ctx, dst: ArrayDesc, src: ArrayDesc) -> None:
        if dst.nbytes != src.nbytes:
            raise CallFailed(f"copy_d2d of {src.nbytes} bytes into {dst.nbytes} bytes")
        d = self._resolve(ArrayDesc(dst.handle, dst.offset, (dst.nbytes,), np.dtype(np.uint8)))
        s = self._resolve(ArrayDesc(src.handle, src.offset, (src.nbytes,), np.dtype(np.uint8)))
        self.backend.copy(d, s, ctx.stream)

    def _cmd_memset(self, ctx: _Ctx, handle: int, offset: int, nbytes: int, value: int) -> None:
        buf = self.buffers.get(handle)
        if buf is None:
            raise CallFailed(f"unknown buffer handle {handle}")
        if offset + nbytes > self.nbytes[handle]:
            raise CallFailed(
                f"memset of [{offset}, {offset + nbytes}) outside buffer {handle} "
                f"of {self.nbytes[handle]} bytes"
            )
        if value > 255:
            raise CallFailed(f"memset value {value} is not a byte")
        self.backend.memset(buf, offset, nbytes, value, ctx.stream)

    def _cmd_launch(
        self,
        ctx: _Ctx,
        op_name: str,
        inputs: tuple[ArrayDesc, ...],
        outputs: tuple[ArrayDesc, ...],
        params: dict[str, Any],
    ) -> None:
        # the op's checks depend on shapes, dtypes and params only: run them once per
        # signature (per session, bounded), then only resolve the handles
        try:
            key: Any = (
                op_name,
                *[d[2:] for d in inputs],
                None,
                *[d[2:] for d in outputs],
                *[(k, type(v), v) for k, v in params.items()],  # exact types: 1 is not True
            )
            op = self._checked.get(key)
        except TypeError:  # list-valued params are not hashable: check every time
            key, op = None, None
        if op is None:
            op = self._check_launch(op_name, inputs, outputs, params)
            if key is not None:
                if len(self._checked) >= 4096:
                    self._checked.clear()
                self._checked[key] = op
        resolve = self._resolve
        ins = [resolve(d) for d in inputs]
        outs = [resolve(d) for d in outputs]
        if ctx.batch is None:  # entered once per batch, and only for batches that compute
            ctx.batch = self.backend.batch()
            ctx.batch.__enter__()
        self.backend.run_op(op, ins, outs, params, ctx.stream)

    def _check_launch(
        self,
        op_name: str,
        inputs: tuple[ArrayDesc, ...],
        outputs: tuple[ArrayDesc, ...],
        params: dict[str, Any],
    ) -> Any:
        """The op of a launch whose outputs are what the op writes for these inputs."""
        op = OPS.get(op_name)
        if op is None:
            raise CallFailed(f"unknown op {op_name!r}; the proxy allows {len(OPS)} ops")
        metas = infer(op_name, [(d.shape, d.dtype) for d in inputs], params)
        if len(metas) != len(outputs) or any(
            m != (o.shape, o.dtype) for m, o in zip(metas, outputs, strict=False)
        ):
            got = [(o.shape, str(o.dtype)) for o in outputs]
            want = [(s, str(d)) for s, d in metas]
            raise CallFailed(f"{op_name} writes outputs {want}, the call gave {got}")
        return op

    def _cmd_launch_new(
        self,
        ctx: _Ctx,
        op_name: str,
        inputs: tuple[ArrayDesc, ...],
        outputs: tuple[ArrayDesc, ...],
        params: dict[str, Any],
    ) -> None:
        self._alloc_outputs(outputs)
        self._cmd_launch(ctx, op_name, inputs, outputs, params)

    def _alloc_outputs(self, outputs: tuple[ArrayDesc, ...]) -> None:
        for d in outputs:
            if d.offset != 0:
                raise CallFailed("launch_new outputs must start their buffer (offset 0)")
            self._alloc(d.handle, d.nbytes)

    def _cmd_launch_dynamic(
        self,
        ctx: _Ctx,
        op_name: str,
        inputs: tuple[ArrayDesc, ...],
        outputs: tuple[int, ...],
        params: dict[str, Any],
    ) -> Any:
        op = OPS.get(op_name)
        if op is None or op.dynamic is None:
            raise CallFailed(f"{op_name!r} is not an op with data-dependent outputs")
        infer(op_name, [(d.shape, d.dtype) for d in inputs], params)  # checks the inputs
        for h in outputs:
            self._new_handle(self.buffers, h, "buffer")
        if len(set(outputs)) != len(outputs):
            raise CallFailed("launch_dynamic output handles must differ")
        ins = [self._resolve(d) for d in inputs]
        budget = self.limits.max_device_bytes - self.device_bytes
        results = self.backend.run_dynamic(op, ins, params, ctx.stream, budget)
        if len(results) != len(outputs):
            raise CallFailed(
                f"{op_name} gives {len(results)} outputs, the call named {len(outputs)}"
            )
        total = sum(int(r.nbytes) for r in results)
        if self.device_bytes + total > self.limits.max_device_bytes:
            raise CallFailed(
                f"{op_name}'s outputs of {total} bytes would make this session hold "
                f"{self.device_bytes + total} bytes; its limit is {self.limits.max_device_bytes}"
            )
        metas: list[list[Any]] = []
        for h, r in zip(outputs, results, strict=True):
            flat = self.backend.as_buffer(r)
            self.buffers[h] = flat
            self.nbytes[h] = int(flat.nbytes)
            self.device_bytes += int(flat.nbytes)
            metas.append([list(r.shape), r.dtype.name])
        return metas

    def _cmd_kernel_create(
        self, ctx: _Ctx, handle: int, kind: str, name: str, source: str, params: dict[str, Any]
    ) -> None:
        if handle in self.kernels:
            return  # content-addressed: the same kernel again
        self._new_handle(self.kernels, handle, "kernel")
        self.kernels[handle] = self.backend.compile_kernel(kind, name, source, params)

    def _cmd_kernel_launch(
        self,
        ctx: _Ctx,
        handle: int,
        args: tuple[Any, ...],
        grid: tuple[int, ...],
        block: tuple[int, ...],
    ) -> None:
        kernel = self.kernels.get(handle)
        if kernel is None:
            raise CallFailed(f"unknown kernel handle {handle:#x}")
        values = [self._resolve(a[1]) if a[0] == "a" else a[1].type(a[2]) for a in args]
        if ctx.batch is None:
            ctx.batch = self.backend.batch()
            ctx.batch.__enter__()
        self.backend.launch_kernel(kernel, values, grid, block, ctx.stream)

    def _cmd_stream_create(self, ctx: _Ctx, handle: int) -> None:
        self._new_handle(self.streams, handle, "stream")
        self.streams[handle] = self.backend.create_stream()

    def _cmd_stream_destroy(self, ctx: _Ctx, handle: int) -> None:
        if handle == 0:
            raise CallFailed("the default stream cannot be destroyed")
        stream = self.streams.pop(handle, None)
        if stream is None:
            raise CallFailed(f"unknown stream handle {handle}")
        self.backend.destroy_stream(stream)

    def _cmd_stream_synchronize(self, ctx: _Ctx) -> None:
        self.backend.synchronize(ctx.stream)

    def _cmd_device_synchronize(self, ctx: _Ctx) -> None:
        for s in self.streams.values():
            self.backend.synchronize(s)

    def _cmd_event_create(self, ctx: _Ctx, handle: int) -> None:
        self._new_handle(self.events, handle, "event")
        self.events[handle] = self.backend.create_event()

    def _event(self, handle: int) -> Any:
        ev = self.events.get(handle)
        if ev is None:
            raise CallFailed(f"unknown event handle {handle}")
        return ev

    def _cmd_event_destroy(self, ctx: _Ctx, handle: int) -> None:
        self._event(handle)
        del self.events[handle]

    def _cmd_event_record(self, ctx: _Ctx, handle: int) -> None:
        self.backend.record_event(self._event(handle), ctx.stream)

    def _cmd_event_wait(self, ctx: _Ctx, handle: int) -> None:
        self.backend.wait_event(ctx.stream, self._event(handle))

    def _cmd_peer_export(self, ctx: _Ctx, src: ArrayDesc) -> str:
        if self._tickets is None:
            raise CallFailed("this proxy does not export arrays to other proxies")
        nbytes = src.nbytes
        held = self._tickets.held_bytes(self.session_id)
        if self.device_bytes + held + nbytes > self.limits.max_device_bytes:
            raise CallFailed(
                f"exporting {nbytes} bytes would exceed this session's limit of "
                f"{self.limits.max_device_bytes} device bytes"
            )
        u8 = np.dtype(np.uint8)
        s = self._resolve(ArrayDesc(src.handle, src.offset, (nbytes,), u8))
        copy = self.backend.alloc(nbytes, self._stream0)
        self.backend.copy(self.backend.view(copy, 0, (nbytes,), u8), s, ctx.stream)
        self.backend.synchronize(ctx.stream)  # the reader uses a stream of its own
        try:
            return self._tickets.add(self.session_id, copy, nbytes)
        except ValueError as exc:
            raise CallFailed(str(exc)) from None

    def _cmd_peer_read(self, ctx: _Ctx, ticket: str) -> Any:
        if self._tickets is None:
            raise CallFailed("this proxy does not export arrays to other proxies")
        try:
            buf, nbytes = self._tickets.take(ticket)
        except KeyError as exc:
            raise CallFailed(exc.args[0]) from None
        u8 = np.dtype(np.uint8)
        host = self.backend.to_host(self.backend.view(buf, 0, (nbytes,), u8), ctx.stream)
        return ctx.reply_buffer(byte_view(host))

    def _cmd_peer_import(self, ctx: _Ctx, dst: ArrayDesc, url: str, ticket: str) -> int:
        if self.peers is None:
            raise PeerUnreachable("this proxy makes no connections to other proxies")
        data = self.peers.take(url, ticket)  # fetched already (taken first: never left)
        view = self._resolve(dst)
        if data.nbytes != dst.nbytes:
            raise CallFailed(f"the ticket holds {data.nbytes} bytes; the array has {dst.nbytes}")
        host = np.frombuffer(data, dtype=np.uint8).view(dst.dtype).reshape(dst.shape)
        self.backend.from_host(view, host, ctx.stream)
        self.bytes_in += data.nbytes
        return data.nbytes

    # -- recorded steps (gpuremote.proxy.steps) ----------------------------------------------------
    def _cmd_step_record(self, ctx: _Ctx, handle: int, program: StepProgram) -> None:
        if handle in self.steps:
            raise CallFailed(f"step handle {handle} is already in use")
        limits = self.limits
        if len(self.steps) >= limits.max_steps:
            raise CallFailed(
                f"session keeps {len(self.steps)} steps; the limit is {limits.max_steps}"
            )
        n = len(program.commands)
        if self._step_calls + n > limits.max_step_calls:
            raise CallFailed(
                f"a step of {n} calls would make this session's steps hold "
                f"{self._step_calls + n} calls; the limit is {limits.max_step_calls}"
            )
        step = RecordedStep.from_program(handle, program, self._check_launch, self._private)
        self.steps[handle] = step
        self._step_calls += n

    def _step(self, handle: int) -> RecordedStep:
        step = self.steps.get(handle)
        if step is None:
            raise CallFailed(f"unknown step handle {handle}")
        return step

    def _cmd_step_free(self, ctx: _Ctx, handle: int) -> None:
        step = self._step(handle)
        del self.steps[handle]
        self._step_calls -= len(step.calls)
        for private in step.intermediates.values():
            if private in self.buffers:
                self._cmd_free(ctx, private)

    def _make_results(self, handle: int, results: tuple[int, ...]) -> None:
        """Make a step's result buffers without running it (its stream was poisoned)."""
        step = self._step(handle)
        for recorded, new in zip(step.results, results, strict=False):
            if new not in self.buffers:
                self._alloc(new, step.nbytes[recorded])

    def _cmd_step_replay(
        self, ctx: _Ctx, handle: int, args: tuple[ArrayDesc, ...], results: tuple[int, ...]
    ) -> None:
        step = self._step(handle)
        try:
            binds = step.bind(args, results)
        except StepError:
            with contextlib.suppress(CallFailed):  # its results exist, as after a skip
                self._make_results(handle, results)
            raise
        buffers, streams, resolve, backend = self.buffers, self.streams, self._resolve, self.backend
        dispatch = self._dispatch
        # a device that queues work takes consecutive launches on a stream in one submission
        queued: list[Any] | None = [] if backend.queues_work else None
        on: Any = None  # the stream of the queued launches

        def submit() -> None:
            if queued:
                runs = queued.copy()
                queued.clear()  # taken: never run twice
                backend.run_ops(runs, on)

        try:
            for i, call in enumerate(step.calls):
                try:
                    stream = streams.get(call.stream)
                    if stream is None:
                        raise CallFailed(f"unknown stream handle {call.stream}")
                    for h in call.creates:
                        b = binds.get(h)
                        if b is not None:  # a result: made under this replay's handle
                            self._alloc(b[0], step.nbytes[h])
                        elif h not in buffers:  # an intermediate: kept, or made by each replay
                            self._alloc(h, step.nbytes[h])
                    cargs = rebind(call, binds) if call.rebind else call.args
                    if call.op is None:
                        submit()  # in order with what came before
                        if not call.creates:  # an alloc is done: it made its buffer above
                            ctx.stream = stream
                            dispatch[call.spec.name](ctx, *cargs)
                        continue
                    ins = [resolve(d) for d in cargs[1]]
                    outs = [resolve(d) for d in cargs[2]]
                    if queued is None:
                        if ctx.batch is None:
                            ctx.batch = backend.batch()
                            ctx.batch.__enter__()
                        backend.run_op(call.op, ins, outs, cargs[3], stream)
                        continue
                    if stream is not on:
                        submit()
                        on = stream
                    queued.append((call.op, ins, outs, cargs[3]))
                except Exception as exc:
                    with contextlib.suppress(Exception):
                        submit()  # what came before it runs
                    with contextlib.suppress(CallFailed):  # its results exist, as after a skip
                        self._make_results(handle, results)
                    raise _ReplayFailed(
                        call.what,
                        CallFailed(
                            f"step {handle}, call {i} of {len(step.calls)} "
                            f"({call.spec.name}): {exc}"
                        ),
                    ) from None
            submit()
        finally:
            if not step.kept:  # intermediates of a step on several streams: this replay's own
                for private in step.intermediates.values():
                    if private in buffers:
                        self._cmd_free(ctx, private)
        step.replays += 1

    def _cmd_event_query(self, ctx: _Ctx, handle: int) -> bool:
        return self.backend.query_event(self._event(handle))


class _Ctx:
    """What one command sees of its batch."""

    __slots__ = (
        "batch",
        "buffers",
        "is_last",
        "out_bufs",
        "stream",
        "stream_handle",
        "used_buffers",
    )

    def __init__(
        self,
        buffers: Sequence[memoryview],
        out_bufs: list[memoryview],
        used_buffers: set[int],
        is_last: bool,
        stream: Any,
        stream_handle: int,
    ) -> None:
        self.buffers = buffers
        self.out_bufs = out_bufs
        self.used_buffers = used_buffers
        self.is_last = is_last
        self.stream = stream
        self.stream_handle = stream_handle
        self.batch: contextlib.AbstractContextManager[Any] | None = None

    def reply_buffer(self, data: memoryview, owned: bool = False) -> int:
        """Attach ``data`` to the reply; copied if later commands of the batch could change
        it (unless it is ``owned``: a copy already, which nothing else refers to)."""
        if not self.is_last and not owned:
            data = memoryview(bytes(data))
        self.out_bufs.append(data)
        return len(self.out_bufs) - 1
