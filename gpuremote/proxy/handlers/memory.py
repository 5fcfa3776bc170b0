"""The handlers of the memory calls: allocation, frees, copies between the host and the
device and on the device, memset."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import UnknownHandle
from ...wire.framing import DEVICE_DIRECT_MIN, byte_view
from ...wire.protocol import ArrayDesc
from ..state import BatchContext, CallFailed, Handler, SessionState

__all__ = ["HANDLERS"]

_U8 = np.dtype(np.uint8)


def alloc(s: SessionState, ctx: BatchContext, handle: int, nbytes: int) -> None:
    s.alloc(handle, nbytes)


def free(s: SessionState, ctx: BatchContext, handle: int) -> None:
    if s.free((handle,)):
        raise UnknownHandle(f"unknown buffer handle {handle}")


def free_buffers(s: SessionState, ctx: BatchContext, handles: tuple[int, ...]) -> None:
    unknown = s.free(handles)
    if unknown:
        raise UnknownHandle(f"unknown buffer handle(s) {unknown}")


def copy_h2d(s: SessionState, ctx: BatchContext, dst: ArrayDesc, index: int) -> None:
    data = ctx.buffers[index]
    if data.nbytes != dst.nbytes:
        raise CallFailed(f"copy_h2d of {data.nbytes} bytes into an array of {dst.nbytes}")
    view = s.resolve(dst)
    whole = dst.offset == 0 and dst.nbytes == s.nbytes[dst.handle]
    if s.device_io and s.backend.is_device(data):  # received into device memory
        if whole and index not in ctx.used_buffers:  # it becomes the buffer
            ctx.used_buffers.add(index)
            s.replace(dst.handle, data)
            return
        ctx.used_buffers.add(index)
        device: Any = data  # a device array, as the transport received it
        s.backend.copy(view, device.view(dst.dtype).reshape(dst.shape), ctx.stream)
        return
    host = np.frombuffer(data, dtype=np.uint8)
    if whole and index not in ctx.used_buffers and host.flags.writeable:
        adopted = s.backend.adopt_host(host)
        if adopted is not None:  # the received memory becomes the buffer: no copy
            ctx.used_buffers.add(index)
            s.replace(dst.handle, adopted)
            return
    ctx.used_buffers.add(index)
    s.backend.from_host(view, host.view(dst.dtype).reshape(dst.shape), ctx.stream)


def copy_d2h(s: SessionState, ctx: BatchContext, src: ArrayDesc) -> Any:
    if s.device_io and src.nbytes >= DEVICE_DIRECT_MIN:  # the transport moves it
        snapshot = s.backend.device_copy_out(s.resolve(src), ctx.stream)
        return ctx.reply_buffer(snapshot, owned=True)
    host = s.backend.to_host(s.resolve(src), ctx.stream)
    return ctx.reply_buffer(byte_view(host))


def copy_d2d(s: SessionState, ctx: BatchContext, dst: ArrayDesc, src: ArrayDesc) -> None:
    if dst.nbytes != src.nbytes:
        raise CallFailed(f"copy_d2d of {src.nbytes} bytes into {dst.nbytes} bytes")
    d = s.resolve(ArrayDesc(dst.handle, dst.offset, (dst.nbytes,), _U8, dst.nbytes))
    r = s.resolve(ArrayDesc(src.handle, src.offset, (src.nbytes,), _U8, src.nbytes))
    s.backend.copy(d, r, ctx.stream)


def memset(
    s: SessionState, ctx: BatchContext, handle: int, offset: int, nbytes: int, value: int
) -> None:
    buf = s.buffer(handle)
    if offset + nbytes > s.nbytes[handle]:
        raise CallFailed(
            f"memset of [{offset}, {offset + nbytes}) outside buffer {handle} "
            f"of {s.nbytes[handle]} bytes"
        )
    if value > 255:
        raise CallFailed(f"memset value {value} is not a byte")
    s.backend.memset(buf, offset, nbytes, value, ctx.stream)


HANDLERS: dict[str, Handler] = {
    "alloc": alloc,
    "free": free,
    "free_buffers": free_buffers,
    "copy_h2d": copy_h2d,
    "copy_d2h": copy_d2h,
    "copy_d2d": copy_d2d,
    "memset": memset,
}
