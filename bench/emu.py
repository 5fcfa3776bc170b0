"""``gpuremote bench emu``: how accurate the emulated link is.

Two connections to the same proxy, one bare and one through ``emu+``, used alternately (A B A
B, so that drift and process placement hit both): the emulator's error is the difference of
their medians against the setting — the added round trip for each RTT, and the bandwidth
implied by the added transfer time for each bandwidth.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gpuremote.transports import Address
from gpuremote.transports.emulated import parse_bandwidth, parse_duration

import gpuremote

from .target import TargetOptions, open_target

__all__ = ["EmuConfig", "run_emu"]


@dataclass
class EmuConfig(TargetOptions):
    """``bench emu``: the emulated round trips and bandwidths to check; per round trip up to
    ``pings`` pings (fewer where they would take over half a second), per bandwidth about
    ``transfer_s`` of bytes."""

    backend: str = "numpy"
    rtts: list[str] = field(default_factory=lambda: ["100us", "300us", "1ms", "3ms", "10ms"])
    bws: list[str] = field(default_factory=lambda: ["100mbit", "1gbit", "10gbit"])
    pings: int = 100
    transfer_s: float = 0.05  # bytes per bandwidth point: about this long on the wire


def _emu(url: str, options: str) -> str:
    a = Address.parse(url)
    return f"emu+{a.url()}?{options}"


async def run_emu(
    cfg: EmuConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    rtts, bws = [], []
    async with open_target(cfg.url, cfg.transport, cfg.backend) as target:
        for setting in cfg.rtts:
            rtt = parse_duration(setting)
            n = max(10, min(cfg.pings, int(0.5 / max(rtt, 1e-6))))
            async with (
                gpuremote.connect(target.url) as a,
                gpuremote.connect(_emu(target.url, f"rtt={setting}")) as b,
            ):
                for _ in range(5):
                    await a.ping(b"x")
                    await b.ping(b"x")
                bare: list[float] = []
                emulated: list[float] = []
                for _ in range(n):
                    for gpu, out in ((a, bare), (b, emulated)):
                        t0 = time.perf_counter()
                        await gpu.ping(b"12345678")
                        out.append(time.perf_counter() - t0)
            added = float(np.median(emulated) - np.median(bare))
            err = added - rtt
            rtts.append(
                {
                    "setting": setting,
                    "rtt_us": rtt * 1e6,
                    "added_us": added * 1e6,
                    "error_us": err * 1e6,
                    "error_rel": err / rtt,
                    "bare_p50_us": float(np.median(bare)) * 1e6,
                    "samples": n,
                }
            )
            report(rtts[-1])
        for setting in cfg.bws:
            bw = parse_bandwidth(setting)
            nbytes = max(1 << 16, int(bw / 8 * cfg.transfer_s))
            data = np.ones(nbytes, np.uint8)
            async with (
                gpuremote.connect(target.url) as a,
                gpuremote.connect(_emu(target.url, f"bw={setting}")) as b,
            ):
                xa, xb = a.empty(nbytes, "uint8"), b.empty(nbytes, "uint8")
                await xa.write(data)
                await xb.write(data)
                bare, emulated = [], []  # seconds per transfer
                for _ in range(5):
                    for x, out in ((xa, bare), (xb, emulated)):
                        t0 = time.perf_counter()
                        await x.write(data)
                        out.append(time.perf_counter() - t0)
            added = float(np.median(emulated) - np.median(bare))
            got = nbytes * 8 / added if added > 0 else float("inf")
            bws.append(
                {
                    "setting": setting,
                    "bw_gbit": bw / 1e9,
                    "bytes": nbytes,
                    "emulated_gbit": got / 1e9,
                    "error_rel": got / bw - 1,
                    "end_to_end_gbit": nbytes * 8 / float(np.median(emulated)) / 1e9,
                }
            )
            report(bws[-1])
    return {"bench": "emu", "url": target.url, "rtt": rtts, "bandwidth": bws}
