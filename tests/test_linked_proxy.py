"""``bench requirements --transport emu+tcp``'s proxy process: behind the link its parent sets,
its counters read over its pipe, ended with its input."""

from __future__ import annotations

import asyncio
import os
import statistics
import time

from gpuremote.bench.linked_proxy import LinkedProxy

import gpuremote


async def _ping_s(url: str, proxy: LinkedProxy, rtts_s: list[float]) -> list[float]:
    """The median ping at each round trip of ``rtts_s``, set on one session's link."""
    out = []
    async with gpuremote.connect(url) as gpu:
        await gpu.ping(b"x")
        for rtt in rtts_s:
            proxy.set_link(rtt, None)
            samples = []
            for _ in range(7):
                t0 = time.perf_counter()
                await gpu.ping(b"x")
                samples.append(time.perf_counter() - t0)
            out.append(statistics.median(samples))
    return out


def test_a_linked_proxy_serves_behind_the_link_its_parent_sets() -> None:
    proxy = LinkedProxy("numpy")
    try:
        assert proxy.url.startswith("tcp://127.0.0.1:")  # the real address: emulated there
        assert os.sched_getaffinity(proxy._proc.pid) == proxy.cpus  # a CPU of its own
        before = proxy.snapshot()
        bare, slow, again = asyncio.run(_ping_s(proxy.url, proxy, [0.0, 20e-3, 0.0]))
        assert slow >= 20e-3 > bare and again < 20e-3
        after = proxy.snapshot()
        assert set(after) == {"busy_s", "device_waited_s", "late_own_s", "lost_s"}
        assert after["busy_s"] > before["busy_s"]  # its receiver handled the pings
    finally:
        proxy.close()
    assert proxy._proc.poll() == 0  # its input closed: it ends, and cleanly
