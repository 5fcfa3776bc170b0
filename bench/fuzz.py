"""``gpuremote bench fuzz``: a long hostile-input run against a live proxy.

For a chosen time (or number of connections), connections send random frames: random bytes,
valid frames with some bytes flipped or cut short (straight onto the stream on tcp:// and
tls://, as raw messages on ucx://), and well-formed batches, before or after a valid hello,
whose commands carry hostile values (unknown handles and ops, negative or huge sizes, wrong
types, shape and dtype mismatches, out-of-bounds copies, huge ndim). Between rounds a control
client checks that the proxy still answers correctly. The proxy must never crash, answer each
bad command with an error or close that one connection, and end where it started in memory:
the proxy's memory is sampled every thousand connections, at rest (the attack pauses
``rest_s`` first), and ``rss_growth_per_connection_b`` is its growth from the first
thousand to the last, per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gpuremote.transports import Address
from gpuremote.transports import connect as transport_connect

import gpuremote
from gpuremote.config import transport_settings
from gpuremote.proxy.heap import rss_bytes
from gpuremote.wire.auth import load_secret, proof
from gpuremote.wire.calls import CALLS, CALLS_BY_NAME, CallClass
from gpuremote.wire.framing import Frame, frame_bytes
from gpuremote.wire.protocol import (
    PROTOCOL_VERSION,
    REPLY,
    decode_greeting,
    decode_message,
    encode_request,
)

from .target import TargetOptions, open_target

__all__ = ["FuzzConfig", "run_fuzz"]

_WIRE = [c for c in CALLS if c.klass is not CallClass.LOCAL]
_NAMES = ["add", "matmul", "exp", "full", "permute_dims", "softmax", "sum", "os.system", ""]
_DTYPES = ["float32", "int8", "bool", "complex128", "object", "|V8", 3]
_HELLO = CALLS_BY_NAME["hello"].opcode


@dataclass
class FuzzConfig(TargetOptions):
    """``bench fuzz``: hostile connections for ``seconds`` (or ``connections`` of them), from
    ``seed``."""

    seconds: float = 30.0
    seed: int = 0
    connections: int = 0  # stop after this many (0: after ``seconds``)
    #: before each memory sample, the attack pauses this long, so that the sample is of the
    #: proxy at rest: what the last connections held is gone (ucx:// drops messages to a
    #: closed connection's tag for 5 s) and only what stays is counted
    rest_s: float = 6.0


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
    """Bytes straight onto a TCP (or TLS) stream, past gpuremote's own framing."""
    context = None
    if address.scheme == "tls":
        ca = address.options.get("ca") or transport_settings("tls").get("ca")
        context = ssl.create_default_context(cafile=ca)
    try:
        reader, writer = await asyncio.open_connection(address.host, address.port, ssl=context)
    except (OSError, ssl.SSLError):
        return
    try:
        writer.write(_raw(rng))
        await writer.drain()
        counts["frames"] += 1
        with contextlib.suppress(TimeoutError):
            data = await asyncio.wait_for(reader.read(1 << 16), 0.2)
            if data:
                counts["replies"] += 1
    except (OSError, ssl.SSLError):
        counts["closed_by_proxy"] += 1
    finally:
        writer.close()


async def _raw_ucx_attack(address: Address, rng: random.Random, counts: dict[str, int]) -> None:
    """Raw messages on a ucx:// connection's tagged path, past gpuremote's own framing."""
    from .ucx_channel import raw_connect

    try:
        raw = await raw_connect(address.host or "127.0.0.1", address.port or 0)
    except gpuremote.GpuRemoteError:
        return
    try:
        for _ in range(rng.randrange(1, 4)):
            if raw.closed:
                counts["closed_by_proxy"] += 1
                return
            raw.send(memoryview(_raw(rng)), lambda exc: None)
            counts["frames"] += 1
        await asyncio.sleep(0.2)
        if raw.closed:
            counts["closed_by_proxy"] += 1
    finally:
        raw.close()


async def _hello(conn: Any, greeting: Frame) -> bool:
    """Say a valid hello (with the proof, where the proxy asks for one and a secret is
    set); whether the proxy took it."""
    info = decode_greeting(greeting)
    secret = load_secret()
    if info["auth"] and secret is None:
        return False
    answer = proof(secret, info["nonce"]) if info["auth"] and secret is not None else ""
    conn.send(encode_request([[0, _HELLO, 0, [PROTOCOL_VERSION, answer], False]], []))
    return decode_message(await asyncio.wait_for(conn.recv(), 5))[0] == REPLY


async def _attack(url: str, rng: random.Random, counts: dict[str, int]) -> None:
    address = Address.parse(url)
    if address.scheme in ("tcp", "tls") and rng.random() < 0.3:
        await _raw_attack(address, rng, counts)
        return
    if address.scheme == "ucx" and rng.random() < 0.3:
        await _raw_ucx_attack(address, rng, counts)
        return
    try:
        conn = await transport_connect(url, settings=transport_settings(address.scheme))
    except gpuremote.ConnectionClosed:
        return
    try:
        greeting = await asyncio.wait_for(conn.recv(), 5)
        if rng.random() < 0.7 and await _hello(conn, greeting):  # hostile after the handshake
            counts["after_hello"] += 1
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
    except TimeoutError:
        counts["timeouts"] += 1
    finally:
        conn.close()


async def run_fuzz(
    cfg: FuzzConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    counts = {
        "connections": 0,
        "after_hello": 0,
        "frames": 0,
        "replies": 0,
        "closed_by_proxy": 0,
        "timeouts": 0,
        "control_checks": 0,
        "control_failures": 0,
    }
    samples: list[tuple[int, float]] = []  # (connections, proxy RSS in MiB) every thousand
    async with open_target(cfg.url, cfg.transport, cfg.backend) as target:
        pid = target.proxy_pid if target.proxy_pid != os.getpid() else None
        async with gpuremote.connect(target.url) as control:
            x = control.asarray(np.arange(16, dtype=np.float64))
            await control.synchronize()
            before = rss_bytes(pid) / 2**20 if pid else None
            end = time.monotonic() + cfg.seconds
            while (
                time.monotonic() < end
                if not cfg.connections
                else (counts["connections"] < cfg.connections)
            ):
                await asyncio.gather(*(_attack(target.url, rng, counts) for _ in range(8)))
                counts["connections"] += 8
                try:
                    got = await asyncio.wait_for(control.multiply(x, 2.0).get(), 30)
                    ok = np.array_equal(got, 2 * np.arange(16, dtype=np.float64))
                except (gpuremote.GpuRemoteError, TimeoutError):
                    ok = False
                counts["control_checks"] += 1
                if not ok:
                    counts["control_failures"] += 1
                if pid and counts["connections"] % 1000 < 8:
                    await asyncio.sleep(cfg.rest_s)
                    samples.append((counts["connections"], rss_bytes(pid) / 2**20))
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
        "proxy_rss_mb_by_connections": [[n, mb] for n, mb in samples],
        "rss_growth_per_connection_b": _growth(samples),
    }


def _growth(samples: list[tuple[int, float]]) -> float | None:
    """The proxy's memory growth per connection from the first sample (the first thousand:
    what is made once is made by then) to the last; None with fewer than two."""
    if len(samples) < 2 or samples[-1][0] == samples[0][0]:
        return None
    (n0, mb0), (n1, mb1) = samples[0], samples[-1]
    return (mb1 - mb0) * 2**20 / (n1 - n0)
