"""The handlers of the stream and event calls: streams made, destroyed and waited for; events
made, recorded, waited on and asked about."""

from __future__ import annotations

from ..state import BatchContext, CallFailed, Handler, SessionState

__all__ = ["HANDLERS"]


def stream_create(s: SessionState, ctx: BatchContext, handle: int) -> None:
    s.check_new(s.streams, handle, "stream")
    s.streams[handle] = s.backend.create_stream()


def stream_destroy(s: SessionState, ctx: BatchContext, handle: int) -> None:
    if handle == 0:
        raise CallFailed("the default stream cannot be destroyed")
    stream = s.stream(handle)
    del s.streams[handle]
    s.backend.destroy_stream(stream)


def stream_synchronize(s: SessionState, ctx: BatchContext) -> None:
    s.backend.synchronize(ctx.stream)


def device_synchronize(s: SessionState, ctx: BatchContext) -> bool:
    """Wait for every stream; answers whether an error of the application's is pending (only
    the client's own synchronisation finds one: the application's takes it instead)."""
    for stream in s.streams.values():
        s.backend.synchronize(stream)
    return bool(s.pending)


def event_create(s: SessionState, ctx: BatchContext, handle: int) -> None:
    s.check_new(s.events, handle, "event")
    s.events[handle] = s.backend.create_event()


def event_destroy(s: SessionState, ctx: BatchContext, handle: int) -> None:
    s.event(handle)
    del s.events[handle]


def event_record(s: SessionState, ctx: BatchContext, handle: int) -> None:
    s.backend.record_event(s.event(handle), ctx.stream)


def event_wait(s: SessionState, ctx: BatchContext, handle: int) -> None:
    s.backend.wait_event(ctx.stream, s.event(handle))


def event_query(s: SessionState, ctx: BatchContext, handle: int) -> bool:
    return s.backend.query_event(s.event(handle))


HANDLERS: dict[str, Handler] = {
    "stream_create": stream_create,
    "stream_destroy": stream_destroy,
    "stream_synchronize": stream_synchronize,
    "device_synchronize": device_synchronize,
    "event_create": event_create,
    "event_destroy": event_destroy,
    "event_record": event_record,
    "event_wait": event_wait,
    "event_query": event_query,
}
