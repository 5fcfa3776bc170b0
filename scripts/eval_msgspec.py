"""Issue #41's evaluation of msgspec for the wire protocol: decode-and-check of a request
frame (the proxy's side) and encoding of one (the client's), today's msgpack + hand checks
against msgspec's msgpack decoder with typed, constrained ``Struct``s (decoding and validating
in C), on the frames of the xp synchronous op ``float(xp.sum(x + 1.0))``.

Run: ``python scripts/eval_msgspec.py`` (msgspec comes with gpuremote: the wire's encoding is
its msgpack encoder). Prints medians of several batches (µs per frame) and
the Python calls per frame (cProfile), side by side.

msgspec cannot tag a command by a field other than its first (``array_like`` structs are
tagged by their first item), so the typed schema here puts the opcode first
(``[opcode, seq, stream, *args, ack]``): adopting it would change the wire protocol's
command layout, and the checks that span fields (an array index within the frame's table,
an array's bytes within ``MAX_SIZE``) would still be Python's. What the proxy adopted
(``decode_batch``) keeps the layout: the frame typed in one pass with each command's
arguments raw, then one typed decoding per command by its opcode; a frame it does not take
goes to the hand checks.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from gpuremote.bench.calls import count_calls
from gpuremote.transports.inproc import InprocConnection

import gpuremote.xp as gx
from gpuremote.wire.framing import Frame, FrameLimits
from gpuremote.wire.limits import MAX_HANDLE, MAX_LIST, MAX_NAME, MAX_PARAMS, MAX_SIZE
from gpuremote.wire.protocol import DTYPES, REQUEST, decode_batch, decode_message, decode_request

Handle = Annotated[int, msgspec.Meta(ge=0, le=MAX_HANDLE)]
Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_SIZE)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
Index = Annotated[int, msgspec.Meta(ge=0)]
Scalar = int | float | bool | str | None
DType = Literal[tuple(DTYPES)]  # type: ignore[valid-type]


class ArrayWire(msgspec.Struct, array_like=True, frozen=True):
    handle: Handle
    offset: Size
    shape: Annotated[list[Size], msgspec.Meta(max_length=32)]
    dtype: DType


class LaunchNew(msgspec.Struct, array_like=True, tag=24, tag_field="opcode"):
    seq: int
    stream: Handle
    op: Name
    inputs: Annotated[list[Index], msgspec.Meta(max_length=MAX_LIST)]
    outputs: Annotated[list[Index], msgspec.Meta(max_length=MAX_LIST)]
    params: Annotated[dict[Name, Scalar | list[int]], msgspec.Meta(max_length=MAX_PARAMS)]
    ack: int | bool


class CopyD2H(msgspec.Struct, array_like=True, tag=13, tag_field="opcode"):
    seq: int
    stream: Handle
    src: Index
    ack: int | bool


class Free(msgspec.Struct, array_like=True, tag=11, tag_field="opcode"):
    seq: int
    stream: Handle
    handle: Handle
    ack: int | bool


class FreeBuffers(msgspec.Struct, array_like=True, tag=16, tag_field="opcode"):
    seq: int
    stream: Handle
    handles: Annotated[list[Handle], msgspec.Meta(max_length=MAX_LIST)]
    ack: int | bool


class Request(msgspec.Struct, array_like=True):
    kind: Literal[1]
    arrays: list[ArrayWire]
    commands: list[LaunchNew | CopyD2H | Free | FreeBuffers]
    local_calls: int = 0


def _typed_form(msg: list[Any]) -> list[Any]:
    """The same request with each command as [opcode, seq, stream, *args, ack]."""
    out = [msg[0], msg[1], [[c[1], c[0], c[2], *c[3], c[4]] for c in msg[2]]]
    return out + msg[3:]


def _typed_check(req: Request) -> None:
    """The checks msgspec's schema cannot express (Python's, as today's are)."""
    n = len(req.arrays)
    for a in req.arrays:
        size = 1
        for d in a.shape:
            size *= d
        if size * DTYPES[a.dtype].itemsize > MAX_SIZE:
            raise ValueError("too large")
    for c in req.commands:
        if type(c) is LaunchNew:
            for i in c.inputs:
                if i >= n:
                    raise ValueError("bad index")
            for i in c.outputs:
                if i >= n:
                    raise ValueError("bad index")
        elif type(c) is CopyD2H and c.src >= n:
            raise ValueError("bad index")


def _frames() -> list[bytes]:
    """The request frames of one xp synchronous op, as its client sends them."""
    seen: list[bytes] = []
    send = InprocConnection.send

    def spy(self: InprocConnection, frame: Frame) -> None:
        if decode_message(frame)[0] == REQUEST:
            seen.append(frame.meta)
        send(self, frame)

    device = gx.connect_local("numpy")
    try:
        x = gx.asarray(np.arange(16, dtype=np.float32), device=device)
        for _ in range(5):
            float(gx.sum(x + 1.0))
        InprocConnection.send = spy  # type: ignore[method-assign]
        try:
            float(gx.sum(x + 1.0))
        finally:
            InprocConnection.send = send  # type: ignore[method-assign]
    finally:
        device.close()
    return seen


def _median_us(fn: Any, n: int = 20_000, rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def _calls(fn: Any, n: int = 1000) -> float:
    return count_calls(fn, n)["python_calls_per_op"]


def main() -> None:
    metas = _frames()
    meta = metas[-1]
    msg = msgspec.msgpack.decode(meta)
    print(f"request frame: {len(meta)} bytes, {len(msg[2])} commands, {len(msg[1])} arrays")
    limits = FrameLimits()
    frame = Frame(meta, [])

    def today_decode() -> None:
        decode_request(frame, limits, decode_message(frame))

    typed = msgspec.msgpack.Encoder().encode(_typed_form(msg))
    decoder = msgspec.msgpack.Decoder(Request)

    def msgspec_decode() -> None:
        _typed_check(decoder.decode(typed))

    untyped = msgspec.msgpack.Decoder()

    def msgspec_untyped() -> None:
        decode_request(frame, limits, untyped.decode(meta))

    import msgpack

    packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    encoder = msgspec.msgpack.Encoder()

    rows = [
        ("decode+check: msgpack + hand checks (the fallback)", today_decode),
        ("decode+check: the typed lane (decode_batch, the proxy's)", lambda: decode_batch(frame)),
        ("decode+check: msgspec untyped + hand checks", msgspec_untyped),
        ("decode+check: msgspec typed Structs (+ cross-field checks)", msgspec_decode),
        ("encode: msgpack.Packer.pack (before)", lambda: packer.pack(msg)),
        ("encode: msgspec.msgpack.Encoder.encode (the wire's)", lambda: encoder.encode(msg)),
    ]
    for name, fn in rows:
        fn()
        print(f"{name:62s} {_median_us(fn):6.2f} µs  {_calls(fn):5.1f} calls")
    # the typed decoder refuses what the hand checks refuse
    bad = _typed_form(msg)
    bad[1][0][0] = -1
    try:
        decoder.decode(msgspec.msgpack.encode(bad))
    except msgspec.ValidationError as exc:
        print(f"a negative handle, typed: ValidationError: {exc}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
