"""A proxy in a process of its own behind an emulated link that the bench sets from point to
point (``bench requirements --transport emu+tcp``).

The sweep over ``emu+inproc`` runs the proxy on the client's thread, so the client's work and
the proxy's never overlap; here they run as across two machines: the proxy on a CPU of its own
(the last one the bench may use, where it has two or more), the client sending as its batching
policy says (posts in batches, a compiled graph's replay at once), the simulated device's
clock running while the client goes on. The link is emulated on the proxy's side (its event
loop polls the clock for the µs deadlines; the client's loop runs only while it waits), on top
of the real loopback TCP path, whose own round trip the bare link's runs measure.

The parent talks to it over its standard input and output, one JSON object a line:
``{"link": [rtt_s, bw_bps or null]}`` sets every open session's link (both directions, for
what is sent from then on); ``{"snapshot": 1}`` answers the proxy's counters over the
sessions open at this or an earlier request (``busy_s``: handling
frames, device waits included; ``device_waited_s``; ``late_own_s``: the emulator's own error;
``lost_s``: its thread waiting while other processes had its CPU). Its first line is
``{"url": ...}``, where clients connect; end of input stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import select
import subprocess
import sys
from typing import IO, Any, cast

__all__ = ["LinkedProxy"]

#: how long the process may take to start listening, and to answer a request (seconds)
_START_S = 120.0
_ANSWER_S = 30.0


class LinkedProxy:
    """The parent's end: starts the proxy process on ``backend``, and asks it."""

    def __init__(self, backend: str) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        self.cpus = {cpus[-1]} if len(cpus) > 1 else set(cpus)
        # on its CPU before anything is imported (NumPy's BLAS starts its threads then)
        boot = (
            f"import os, runpy; os.sched_setaffinity(0, {sorted(self.cpus)!r}); "
            "runpy.run_module('gpuremote.bench.linked_proxy', run_name='__main__')"
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-c", boot, backend],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            self.url: str = self._read(_START_S)["url"]
        except BaseException:
            self.close()
            raise

    def _read(self, timeout_s: float = _ANSWER_S) -> dict[str, Any]:
        """Its next line (it writes one per request, so none waits in the buffer)."""
        out = cast(IO[str], self._proc.stdout)
        if not select.select([out], [], [], timeout_s)[0]:
            self._proc.kill()
            raise RuntimeError(f"the linked proxy did not answer within {timeout_s:g} s")
        line = out.readline()
        if not line:
            raise RuntimeError(f"the linked proxy ended (exit status {self._proc.poll()})")
        return cast(dict[str, Any], json.loads(line))

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        stdin = cast(IO[str], self._proc.stdin)
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        return self._read()

    def set_link(self, rtt_s: float, bw_bps: float | None) -> None:
        """Every session's link from now on: ``rtt_s`` round trip, ``bw_bps`` (None: no limit)."""
        self._ask({"link": [rtt_s, bw_bps]})

    def snapshot(self) -> dict[str, float]:
        """The proxy's counters now (see the module docstring)."""
        return {k: float(v) for k, v in self._ask({"snapshot": 1}).items()}

    def close(self) -> None:
        """End the process (its sessions close with it)."""
        with contextlib.suppress(OSError, ValueError):
            cast(IO[str], self._proc.stdin).close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        with contextlib.suppress(OSError, ValueError):
            cast(IO[str], self._proc.stdout).close()


async def _serve(backend: str) -> None:
    from gpuremote.transports.emulated import EmulatedConnection

    from gpuremote.proxy import Proxy

    from .points import _lost_s

    # every batch inline, in the receiver (as the in-process sweep's proxy: ``busy_s``)
    proxy = Proxy(backend, inline_us=math.inf, contention_s=0.0)
    bound = await proxy.start("emu+tcp://127.0.0.1:0")
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    #: every session's link seen at a request, kept after it closes (its counters count)
    seen: dict[int, EmulatedConnection] = {}

    def links() -> list[EmulatedConnection]:
        """The sessions' links open now (each also kept in ``seen``)."""
        conns = (getattr(c, "conn", None) for c in proxy.clients.values())
        now = [c for c in conns if isinstance(c, EmulatedConnection)]
        seen.update((id(c), c) for c in now)
        return now

    def answer(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    # clients connect to the real address: the link is emulated once, on this side
    answer({"url": bound.removeprefix("emu+").partition("?")[0]})
    try:
        while line := await reader.readline():
            request = json.loads(line)
            if "link" in request:
                rtt_s, bw_bps = request["link"]
                for conn in links():
                    conn.set_link(float(rtt_s), None if bw_bps is None else float(bw_bps))
                answer({})
            else:
                links()
                conns = list(seen.values())
                answer(
                    {
                        "busy_s": sum(c.busy_s for c in conns),
                        "device_waited_s": proxy.backend.timing()[1],
                        "late_own_s": sum(c.late_own_s for c in conns),
                        "lost_s": _lost_s(),
                    }
                )
    finally:
        await proxy.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m gpuremote.bench.linked_proxy BACKEND`` (started by ``LinkedProxy``)."""
    args = sys.argv[1:] if argv is None else argv
    asyncio.run(_serve(args[0] if args else "sim:a100,compute=0"))


if __name__ == "__main__":
    main()
