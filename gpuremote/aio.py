"""Event-loop helpers: uvloop when it is installed, asyncio's own loop otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["loop_name", "run"]

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


def loop_name() -> str:
    """``uvloop`` or ``asyncio``: what the running loop is."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
