"""The handlers of the collective calls (``gpuremote.proxy.collectives`` forms the groups and
runs the collectives)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ...wire.protocol import TensorDesc
from ..aten import aten_session
from ..collectives import CollectiveFailed
from ..state import BatchContext, CallFailed, Handler, SessionState

__all__ = ["HANDLERS"]

_NONE = "this proxy runs no collectives"


def _table(s: SessionState) -> Any:
    if s.collectives is None:
        raise CallFailed(_NONE)
    return s.collectives


#: a job's timeout, in ms: at least 0.1 s, at most a week
_TIMEOUT_MS = (100, 7 * 24 * 3600 * 1000)


def _timeout_s(timeout_ms: int) -> float:
    least, most = _TIMEOUT_MS
    if not least <= timeout_ms <= most:
        raise CallFailed(f"a job's timeout is {least} ms to {most} ms, not {timeout_ms}")
    return timeout_ms / 1e3


@contextlib.contextmanager
def _said() -> Iterator[None]:
    """A collective's failure, as the call's (its message to the client)."""
    try:
        yield
    except CollectiveFailed as exc:
        raise CallFailed(str(exc)) from None


def dist_host(s: SessionState, ctx: BatchContext, size: int, timeout_ms: int) -> list[Any]:
    timeout_s = _timeout_s(timeout_ms)
    with _said():
        return list(_table(s).host(s.session_id, size, timeout_s))


def dist_join(
    s: SessionState,
    ctx: BatchContext,
    group: int,
    host: str,
    port: int,
    key: str,
    rank: int,
    size: int,
    timeout_ms: int,
) -> None:
    timeout_s = _timeout_s(timeout_ms)
    device = aten_session(s).device
    with _said():
        _table(s).join(s.session_id, group, host, port, key, rank, size, timeout_s, device)


def dist_run(
    s: SessionState,
    ctx: BatchContext,
    op: str,
    group: int,
    tensors: tuple[TensorDesc, ...],
    params: dict[str, Any],
) -> None:
    table = _table(s)
    a = aten_session(s)
    with _said():
        g = table.group(s.session_id, group)
        views = [a.tensor(d) for d in tensors]  # the session's own buffers, bounds-checked
        buffers = [s.buffers[d.handle] for d in tensors]
        a.runtime.run(lambda: table.run(g, op, views, params), buffers, buffers, ctx.stream, True)


def dist_leave(s: SessionState, ctx: BatchContext, group: int) -> None:
    _table(s).leave(s.session_id, group)


HANDLERS: dict[str, Handler] = {
    "dist_host": dist_host,
    "dist_join": dist_join,
    "dist_run": dist_run,
    "dist_leave": dist_leave,
}
