"""The proxy's executor: one per client session, independent of any network.

It runs each batch of decoded commands in order on the session's state (its handle tables,
``gpuremote.proxy.state``), each by its call's handler (``gpuremote.proxy.handlers``), and
answers the commands that need a reply. A failing ASYNC command becomes a deferred error:
later work on its stream is skipped, and the error is the answer to the session's next SYNC
command, after which the session goes on normally. A command marked ``OWN`` is the client's
own (a failover checkpoint's): it runs even on a stream whose work is skipped, its failure is
its answer (never deferred), and it leaves a deferred error of the application's, and what
that error skips, to the application's next synchronising call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from ..wire.calls import CALLS_BY_NAME, Arg, Resource
from ..wire.protocol import BadCommandAt, Command, ErrorInfo, Reply
from .handlers import HANDLERS
from .handlers.aten import template_outputs
from .handlers.steps import make_results
from .state import (
    CALL_FAILURES,
    BatchContext,
    PeerReads,
    ReplayFailed,
    SessionLimits,
    SessionState,
    TicketTable,
    UnknownHandle,
)
from .steps import StepError

__all__ = ["Executor", "PeerReads", "SessionLimits", "TicketTable"]


class Executor(SessionState):
    """Runs one session's commands on its state (see the module docstring); made with the
    arguments of ``SessionState``."""

    def execute(
        self, commands: Sequence[Command | BadCommandAt], buffers: Sequence[memoryview]
    ) -> tuple[list[Reply], list[memoryview]]:
        """Run a batch in order; return the replies and the reply frame's buffers."""
        replies: list[Reply] = []
        out_bufs: list[memoryview] = []
        if buffers:
            self.bytes_in += sum(b.nbytes for b in buffers)
        ctx = BatchContext(buffers, out_bufs)
        try:
            self._run(commands, ctx, replies)
        finally:
            if ctx.batch is not None:
                ctx.batch.__exit__(None, None, None)
        if out_bufs:
            self.bytes_out += sum(b.nbytes for b in out_bufs)
        return replies, out_bufs

    def _run(
        self,
        commands: Sequence[Command | BadCommandAt],
        ctx: BatchContext,
        replies: list[Reply],
    ) -> None:
        counts, streams, handlers = self.counts, self.streams, HANDLERS
        last = len(commands) - 1
        for i, cmd in enumerate(commands):
            if type(cmd) is BadCommandAt:
                # answered now if the call waits (or is not a call at all), else at the
                # next call that waits, as any failed ASYNC call is
                spec = CALLS_BY_NAME.get(cmd.call)
                sync = spec is None or spec.sync
                self._fail(cmd.seq, cmd.call, None, "BadCommand", cmd.message, sync, replies)
                continue
            assert type(cmd) is Command
            spec = cmd.spec
            sync = spec.sync
            counts[spec.kind] += 1
            own = cmd.own  # the client's own call: the application's error stays
            if sync and self.pending and not own:
                replies.append(Reply(cmd.seq, False, self._take_deferred()))
                continue
            if cmd.stream in self.poisoned and spec.on_stream and not own:
                self._skip(cmd, replies)
                continue
            try:
                stream = streams.get(cmd.stream)
                if stream is None:
                    raise UnknownHandle(f"unknown stream handle {cmd.stream}")
                ctx.is_last = i == last
                ctx.stream = stream
                ctx.stream_handle = cmd.stream
                if self.checks:
                    op = cmd.args[0] if spec.names_op else None
                    self.backend.note_call(cmd.seq, spec.name, op, self.session_id, cmd.stream)
                value = handlers[spec.name](self, ctx, *cmd.args)
            except Exception as exc:
                op = cmd.args[0] if spec.names_op else None
                if isinstance(exc, ReplayFailed):
                    op, exc = exc.op, exc.cause
                kind = "CallFailed" if isinstance(exc, StepError) else type(exc).__name__
                message = str(exc) or kind
                self._fail(cmd.seq, spec.name, op, kind, message, sync or own, replies, cmd)
                continue
            if sync or cmd.ack:
                replies.append(Reply(cmd.seq, True, value))

    def _skip(self, cmd: Command, replies: list[Reply]) -> None:
        """``cmd`` is not run: an earlier call on its stream failed. What it would have made
        is made (empty), so that later calls naming it do not fail for that."""
        self.skipped += 1
        spec, args = cmd.spec, cmd.args
        name = spec.name
        for i, resource in spec.creates:  # new outputs named by descriptor: made, empty
            kind = spec.args[i].kind
            if resource is not Resource.BUFFER or kind not in (Arg.ARRAYS, Arg.TENSORS):
                continue
            for d in args[i]:
                with contextlib.suppress(*CALL_FAILURES):
                    if kind is Arg.ARRAYS:
                        self.alloc_outputs((d,))
                    else:
                        self.alloc(d.handle, d.extent)
        if name == "peer_import" and self.peers is not None:
            with contextlib.suppress(Exception):  # its fetched data is let go
                self.peers.take(args[1], args[2])
        elif name == "step_replay" or name == "step_run":
            with contextlib.suppress(StepError, *CALL_FAILURES):
                make_results(self, args[0], args[2])
        elif name == "aten_call":
            template_outputs(self, args[0], args[2])
        if cmd.ack:
            replies.append(Reply(cmd.seq, True, None))

    # -- errors ----------------------------------------------------------------------------
    def _fail(
        self,
        seq: int,
        call: str,
        op: str | None,
        kind: str,
        message: str,
        sync: bool,
        replies: list[Reply],
        cmd: Command | None = None,
    ) -> None:
        """A command failed: its error is the reply (SYNC), or deferred to the next SYNC
        command (ASYNC: its stream's later work is skipped until then)."""
        self.failed += 1
        if sync:
            replies.append(Reply(seq, False, ErrorInfo(seq, call, op, kind, message, False, 0)))
            return
        self.pending.append(ErrorInfo(seq, call, op, kind, message, True, 0))
        if cmd is not None:
            self.poisoned.add(cmd.stream)
            if cmd.ack:
                replies.append(Reply(seq, True, None))

    def _take_deferred(self) -> ErrorInfo:
        first = self.pending[0]._replace(skipped=self.skipped)
        if len(self.pending) > 1:
            first = first._replace(
                message=f"{first.message} (and {len(self.pending) - 1} more failed call(s))"
            )
        self.pending.clear()
        self.poisoned.clear()
        self.skipped = 0
        return first
