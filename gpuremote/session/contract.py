"""The one session contract: what the front ends and the array core use of a session, and what
a session needs of a step being captured.

Three sessions implement ``Session``: the pipeline of one connection
(``gpuremote.session.pipeline.ClientSession``), a session that survives the loss of its proxy
(``gpuremote.session.failover.FailoverSession``), and the same calls run in this process with
no remoting (``gpuremote.tools.direct.DirectSession``). The front ends and the core depend on
this module alone; ``gpuremote.session.opener`` decides which one a URL and its options get.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from ..config import PipelineConfig
from ..wire.calls import CallClass, CallSpec

__all__ = ["Counters", "Recorder", "Reply", "Session"]

#: a call's answer: its value, and the buffers of the frame it came in (a value that is an
#: int may index them: a read's data)
Reply = tuple[Any, list[memoryview]]


@dataclass(slots=True)
class Counters:
    """What a session did: the inputs of the overhead model."""

    calls: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in CallClass})
    frames_sent: int = 0
    frames_received: int = 0
    round_trips: int = 0  # times the client waited for a reply
    bytes_sent: int = 0
    bytes_received: int = 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["calls"] = dict(self.calls)
        return d


class Recorder(Protocol):
    """A step being captured (``gpuremote.core.recording``), as a session sees it: a call
    that waits for the device, or sends host data, cannot be part of it."""

    def refuse(self, what: str) -> None:
        """``what`` cannot be part of the step: raise ``CaptureError``, or end the recording
        (a step made with ``fallback``) and let the call go ahead."""
        ...


class Session(Protocol):
    """A session with a proxy, as the front ends and the array core use it.

    ASYNC calls are ``submit``-ted and return at once; a call that needs its answer is
    started (``start_call``) and waited for (``wait``), or both at once (``call``); ``ack``
    sends an ASYNC call and waits until it has run (to lend the caller's buffer). Handles are
    chosen here (``new_handle``), so creating a resource costs no round trip; a buffer is
    freed by ``release`` (from any thread: finalizers) or ``defer_free`` (on the loop, about
    to send). A failed ASYNC call's error is raised at the next call that waits."""

    #: the step being captured: calls that wait, or that send host data, are refused
    recorder: Recorder | None

    @property
    def config(self) -> PipelineConfig: ...
    @property
    def counters(self) -> Counters: ...
    @property
    def url(self) -> str:
        """The URL of the proxy serving the session now."""
        ...

    @property
    def closed(self) -> bool: ...
    def new_handle(self) -> int: ...
    def count_local(self, n: int = 1, shadow_bytes: int = 0) -> None: ...
    def submit(
        self,
        spec: CallSpec,
        stream: int,
        args: list[Any],
        buffer: memoryview | None = None,
        *,
        then_call: bool = False,
    ) -> None:
        """Queue an ASYNC call. ``then_call``: the caller starts a call that waits right
        after (``start_call`` sends all that is queued), so no later send need be arranged."""
        ...

    def start_call(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> asyncio.Future[Reply]: ...
    async def wait(self, fut: asyncio.Future[Reply], what: str) -> Reply: ...
    async def call(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> Reply: ...
    async def ack(
        self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None = None
    ) -> None: ...
    async def flush(self, wait: bool = False) -> None: ...
    def send_queued(self) -> None:
        """Send what is queued now, without waiting on the transport (call on the loop,
        or as its driver)."""
        ...

    def release(self, handle: int, nbytes: int = 0) -> None: ...
    def defer_free(self, handle: int, nbytes: int = 0) -> None: ...
    def plain_wait(self) -> bool:
        """Whether ``wait`` only awaits the future (no spinning, no timeout): then a caller
        driving the loop may wait for the future itself."""
        ...

    async def aclose(self) -> None: ...
