"""The handlers of the calls between proxies: an array exported for one read by another
proxy (a ticket), read by that proxy, imported into an array of this session."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import PeerUnreachable
from ...wire.framing import byte_view
from ...wire.protocol import ArrayDesc
from ..state import BatchContext, CallFailed, Handler, SessionState

__all__ = ["HANDLERS"]

_U8 = np.dtype(np.uint8)
_NO_EXPORTS = "this proxy does not export arrays to other proxies"


def peer_export(s: SessionState, ctx: BatchContext, src: ArrayDesc) -> str:
    if s.tickets is None:
        raise CallFailed(_NO_EXPORTS)
    nbytes = src.nbytes
    held = s.tickets.held_bytes(s.session_id)
    if s.device_bytes + held + nbytes > s.limits.max_device_bytes:
        raise CallFailed(
            f"exporting {nbytes} bytes would exceed this session's limit of "
            f"{s.limits.max_device_bytes} device bytes"
        )
    data = s.resolve(ArrayDesc(src.handle, src.offset, (nbytes,), _U8, nbytes))
    copy = s.backend.alloc(nbytes, s.stream0)
    s.backend.copy(s.backend.view(copy, 0, (nbytes,), _U8), data, ctx.stream)
    s.backend.synchronize(ctx.stream)  # the reader uses a stream of its own
    try:
        return s.tickets.add(s.session_id, copy, nbytes)
    except ValueError as exc:
        raise CallFailed(str(exc)) from None


def peer_read(s: SessionState, ctx: BatchContext, ticket: str) -> Any:
    if s.tickets is None:
        raise CallFailed(_NO_EXPORTS)
    try:
        buf, nbytes = s.tickets.take(ticket)
    except KeyError as exc:
        raise CallFailed(exc.args[0]) from None
    host = s.backend.to_host(s.backend.view(buf, 0, (nbytes,), _U8), ctx.stream)
    return ctx.reply_buffer(byte_view(host))


def peer_import(s: SessionState, ctx: BatchContext, dst: ArrayDesc, url: str, ticket: str) -> int:
    if s.peers is None:
        raise PeerUnreachable("this proxy makes no connections to other proxies")
    data = s.peers.take(url, ticket)  # fetched already (taken first: never left)
    view = s.resolve(dst)
    if data.nbytes != dst.nbytes:
        raise CallFailed(f"the ticket holds {data.nbytes} bytes; the array has {dst.nbytes}")
    host = np.frombuffer(data, dtype=np.uint8).view(dst.dtype).reshape(dst.shape)
    s.backend.from_host(view, host, ctx.stream)
    s.bytes_in += data.nbytes
    return data.nbytes


HANDLERS: dict[str, Handler] = {
    "peer_export": peer_export,
    "peer_read": peer_read,
    "peer_import": peer_import,
}
