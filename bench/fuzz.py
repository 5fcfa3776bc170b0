"""``gpuremote bench fuzz``: a long hostile-input run against a live proxy.

For a chosen time, connections send random frames: random bytes, valid frames with some bytes
flipped or cut short, and well-formed batches whose commands carry hostile values (unknown
handles and ops, negative or huge sizes, wrong types, shape and dtype mismatches,
out-of-bounds copies, huge ndim). Between rounds a control client checks that the proxy still
answers correctly. The proxy must never crash, answer each bad command with an error or close
that one connection, and end where it started in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gpuremote.transports import Address
from gpuremote.transports import connect as transport_connect

import gpuremote
from gpuremote.calls import CALLS, CallClass
from gpuremote.framing import Frame, frame_bytes
from gpuremote.protocol import encode_request
from gpuremote.proxyprocess import rss_bytes

from .target import TargetOptions, open_target

__all__ = ["FuzzConfig", "run_fuzz"]

_WIRE = [c for c in CALLS if c.klass is not CallClass.LOCAL]
_NAMES = ["add", "matmul", "exp", "full", "permute_dims", "softmax", "sum", "os.system", ""]
_DTYPES = ["float32", "int8", "bool", "complex128", "object", "|V8", 3]


@dataclass
class FuzzConfig(TargetOptions):
    seconds: float = 30.0
    seed: int = 0


def _value(rng: random.Random) -> Any:
    pick = rng.randrange(10)
    if pick == 0:
        return rng.choice([-1, 0, 1, 2**31, 2**62, 2**63 - 1, -(2**63)])
    if pick == 1:
        return rng.random() * 10 ** rng.randrange(-5, 30)
    if pick == 2:
        return rng.choice(_NAMES)
    if pick == 3:
        return [rng.randrange(-3, 1 << 40) for _ in range(rng.randrange(0, 40))]
    if pick == 4:
        return {rng.choice(["axis", "alpha", "scalar", "shape", "dtype", "x"]): _value(rng)}
    if pick == 5:
        return None
    if pick == 6:
        return rng.randbytes(rng.randrange(0, 16))
    return rng.randrange(0, 8)


def _desc(rng: random.Random) -> Any:
    if rng.random() < 0.1:
        return _value(rng)
    ndim = rng.choice([0, 1, 2, 3, 40])
    return [
        rng.randrange(0, 8),
        rng.choice([0, 0, 8, 1 << 40, -1]),
        [rng.choice([1, 2, 3, 1 << 31, -1, 0]) for _ in range(ndim)],
        rng.choice(_DTYPES),
    ]


def _batch(rng: random.Random) -> Frame:
    arrays = [_desc(rng) for _ in range(rng.randrange(0, 5))]
    cmds = []
    for seq in range(rng.randrange(1, 12)):
        spec = rng.choice(_WIRE)
        args = [_value(rng) for _ in spec.args]
        if rng.random() < 0.1:
            args = args[: rng.randrange(0, len(args) + 1)]
        cmds.append([seq, spec.opcode, rng.randrange(0, 3), args, rng.random() < 0.2])
    bufs = [memoryview(rng.randbytes(rng.randrange(0, 256))) for _ in range(rng.randrange(0, 3))]
    return encode_request(cmds, bufs, arrays)


def _raw(rng: random.Random) -> bytes:
    """Bytes for the stream: garbage, a mangled frame, or a cut one."""
    data = frame_bytes(_batch(rng))
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 2000))
    if kind == 1:
        b = bytearray(data)
        for _ in range(rng.randrange(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if kind == 2:
        return data[: rng.randrange(1, len(data))]
    return data


async def _raw_attack(address: Address, rng: random.Random, counts: dict[str, int]) -> None:
    """Bytes straight onto a TCP stream, past gpuremote's own framing."""
    try:
        reader, writer = await asyncio.open_connection(address.host, address.port)
    except OSError:
        return
    try:
        writer.write(_raw(rng))
        await writer.drain()
        counts["frames"] += 1
        with contextlib.suppress(TimeoutError):
            data = await asyncio.wait_for(reader.read(1 << 16), 0.2)
            if data:
                counts["replies"] += 1
    except OSError:
        counts["closed_by_proxy"] += 1
    finally:
        writer.close()


async def _attack(url: str, rng: random.Random, counts: dict[str, int]) -> None:
    address = Address.parse(url)
    if address.scheme == "tcp" and rng.random() < 0.3:
        await _raw_attack(address, rng, counts)
        return
    conn = await transport_connect(url)
    try:
        await asyncio.wait_for(conn.recv(), 5)  # greeting
        for _ in range(rng.randrange(1, 20)):  # well-formed frames, hostile contents
            conn.send(_batch(rng))
            counts["frames"] += 1
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(conn.recv(), 0.05)
                counts["replies"] += 1
            except TimeoutError:
                continue
    except gpuremote.ConnectionClosed:
        counts["closed_by_proxy"] += 1
    except gpuremote.ProtocolError:
        counts["closed_by_proxy"] += 1
    finally:
        conn.close()


async def run_fuzz(
    cfg: FuzzConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    counts = {
        "connections": 0,
        "frames": 0,
        "replies": 0,
        "closed_by_proxy": 0,
        "control_checks": 0,
        "control_failures": 0,
    }
    async with open_target(cfg.url, cfg.transport, cfg.backend) as target:
        pid = target.proxy_pid if target.proxy_pid != os.getpid() else None
        async with gpuremote.connect(target.url) as control:
            x = control.asarray(np.arange(16, dtype=np.float64))
            await control.synchronize()
            before = rss_bytes(pid) / 2**20 if pid else None
            end = time.monotonic() + cfg.seconds
            while time.monotonic() < end:
                await asyncio.gather(*(_attack(target.url, rng, counts) for _ in range(8)))
                counts["connections"] += 8
                got = await control.multiply(x, 2.0).get()
                counts["control_checks"] += 1
                if not np.array_equal(got, 2 * np.arange(16, dtype=np.float64)):
                    counts["control_failures"] += 1
                report(dict(counts))
            stats = await control.proxy_stats()
            await asyncio.sleep(0.3)
            after = rss_bytes(pid) / 2**20 if pid else None
    return {
        "bench": "fuzz",
        "url": target.url,
        "seconds": cfg.seconds,
        "seed": cfg.seed,
        **counts,
        "proxy_alive": True,
        "control_session_buffers": stats["buffers"],
        "proxy_rss_mb": {"before": before, "after": after},
    }
