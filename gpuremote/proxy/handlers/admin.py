"""The handlers of the session's admin calls (the call table's ``admin``): the handshake, the
echo, and the figures. They answer about the session; they do no device work."""

from __future__ import annotations

import time
from typing import Any

from ...ops import OPS
from ...wire.protocol import PROTOCOL_VERSION
from ..heap import peak_rss_bytes, rss_bytes
from ..state import BatchContext, CallFailed, Handler, SessionState

__all__ = ["HANDLERS"]


def hello(s: SessionState, ctx: BatchContext, version: int, proof: str) -> Any:
    if version != PROTOCOL_VERSION:
        raise CallFailed(f"client speaks protocol {version}; proxy speaks {PROTOCOL_VERSION}")
    info: dict[str, Any] = dict(s.backend.device_info())
    info.update(s.info)
    info.update(
        protocol=PROTOCOL_VERSION,
        session=s.session_id,
        max_device_bytes=s.limits.max_device_bytes,
        max_handles=s.limits.max_handles,
        max_templates=s.limits.max_templates,
        max_template_tensors=s.limits.max_template_tensors,
        ops=sorted(OPS),
    )
    return info


def ping(s: SessionState, ctx: BatchContext, index: int) -> Any:
    data = ctx.buffers[index]
    if s.device_io and s.backend.is_device(data):  # received into device memory
        return ctx.reply_buffer(s.backend.device_copy_out(data, ctx.stream), owned=True)
    return ctx.reply_buffer(data)


def stats(s: SessionState, ctx: BatchContext) -> Any:
    return {
        **s.stats(),
        "rss_bytes": rss_bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
        "process_cpu_s": time.process_time(),  # the proxy's own CPU, all its threads
    }


def admin_stats(s: SessionState, ctx: BatchContext, token: str) -> Any:
    if s.admin is None:
        raise CallFailed("this proxy serves no admin calls")
    return s.admin(token)


HANDLERS: dict[str, Handler] = {
    "hello": hello,
    "ping": ping,
    "stats": stats,
    "admin_stats": admin_stats,
}
