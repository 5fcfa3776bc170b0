"""Event-loop helpers: uvloop when it is installed, asyncio's own loop otherwise."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["loop_name", "run", "spin_until_done"]

T = TypeVar("T")


def _uvloop() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def run(coro: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """Run ``coro`` to completion on a new event loop (uvloop if available)."""
    uv = _uvloop() if use_uvloop else None
    if uv is not None:
        return uv.run(coro)
    return asyncio.run(coro)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's if available."""
    uv = _uvloop()
    loop: asyncio.AbstractEventLoop = uv.new_event_loop() if uv else asyncio.new_event_loop()
    return loop


def loop_name() -> str:
    """``uvloop`` or ``asyncio``: what the running loop is."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def spin_until_done(fut: asyncio.Future[Any], seconds: float) -> None:
    """Keep the running loop polling its sockets, instead of sleeping in the selector, until
    ``fut`` is done or ``seconds`` have passed: a reply is then handled as it lands, without
    the wake-up latency of an idle thread (which is tens of µs on a VM)."""
    loop = asyncio.get_running_loop()
    deadline = time.perf_counter() + seconds

    def step() -> None:
        if not fut.done() and time.perf_counter() < deadline:
            loop.call_soon(step)

    loop.call_soon(step)
