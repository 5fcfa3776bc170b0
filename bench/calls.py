"""Python calls per operation: a figure of the software's cost that does not move with the
machine's speed (``bench ops`` reports it beside the times; a test keeps it under a ceiling).

``count_calls(fn, n)`` runs ``fn`` ``n`` times under ``cProfile`` in the calling thread and
returns the calls per run (Python functions and C functions called from Python alike, as
``cProfile`` counts them), split into the proxy's side (its modules: ``gpuremote.proxy``,
``gpuremote.backends``; a C function by its caller's side) and the rest (the client, the
wire, the transports, asyncio), which is all there is when the proxy is another process.
"""

from __future__ import annotations

import cProfile
import inspect
import pstats
from collections.abc import Callable
from typing import Any

__all__ = ["count_calls", "count_calls_async"]

_PROXY = ("/gpuremote/proxy/", "/gpuremote/backends/")


def _side(filename: str) -> str:
    return "proxy" if any(p in filename for p in _PROXY) else "client"


def _split(profile: cProfile.Profile, n: int) -> dict[str, float]:
    stats: dict[Any, Any] = vars(pstats.Stats(profile))["stats"]  # (not in its stubs)
    sides = {"client": 0.0, "proxy": 0.0}
    for (filename, _, _), (_, calls, _, _, callers) in stats.items():
        if filename != "~":  # a Python function: its own module's side
            sides[_side(filename)] += calls
            continue
        if not callers:  # a C function called from outside any profiled frame
            sides["client"] += calls
            continue
        for (caller_file, _, _), caller in callers.items():
            sides[_side(caller_file)] += caller[1]  # its calls from that caller
    total = sides["client"] + sides["proxy"]
    return {
        "python_calls_per_op": total / n,
        "client_python_calls_per_op": sides["client"] / n,
        "proxy_python_calls_per_op": sides["proxy"] / n,
    }


def count_calls(fn: Callable[[], Any], n: int) -> dict[str, float]:
    """Python calls per run of plain function ``fn`` (see the module docstring)."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        for _ in range(n):
            fn()
    finally:
        profile.disable()
    return _split(profile, n)


async def count_calls_async(fn: Callable[[], Any], n: int) -> dict[str, float]:
    """``count_calls`` for a coroutine function (in the running loop's thread)."""
    if not inspect.iscoroutinefunction(fn):
        raise TypeError("count_calls_async takes a coroutine function")
    profile = cProfile.Profile()
    profile.enable()
    try:
        for _ in range(n):
            await fn()
    finally:
        profile.disable()
    return _split(profile, n)
