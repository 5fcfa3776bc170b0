"""The sans-I/O framing layer: round trips, any split of the byte stream, and bad input."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuremote.errors import LimitExceeded, LocalProtocolError, ProtocolError, RemoteProtocolError
from gpuremote.wire.framing import (
    HEADER,
    MAGIC,
    VERSION,
    Frame,
    FrameDecoder,
    FrameLimits,
    encode_frame,
    frame_bytes,
    is_device_buffer,
    iter_frames,
)

frames = st.builds(
    Frame,
    st.binary(max_size=300),
    st.lists(st.binary(max_size=70_000).map(memoryview), max_size=4),
)


def _same(a: Frame, b: Frame) -> bool:
    return a.meta == b.meta and [bytes(x) for x in a.buffers] == [bytes(x) for x in b.buffers]


@given(st.lists(frames, min_size=1, max_size=4), st.lists(st.integers(1, 90_000), max_size=8))
@settings(max_examples=150, deadline=None)
def test_round_trip_under_any_split(fs: list[Frame], cuts: list[int]) -> None:
    data = b"".join(frame_bytes(f) for f in fs)
    dec = FrameDecoder(direct_threshold=1024, scratch_size=4096)
    pos = 0
    for cut in [*cuts, len(data)]:
        end = min(len(data), pos + cut)
        dec.receive_data(data[pos:end])
        pos = end
    dec.eof()
    out = []
    while (f := dec.next_frame()) is not None:
        out.append(f)
    assert len(out) == len(fs)
    assert all(_same(a, b) for a, b in zip(out, fs, strict=True))


def test_large_buffer_is_read_straight_into_its_destination() -> None:
    payload = np.arange(1 << 20, dtype=np.uint8)
    data = frame_bytes(Frame(b"meta", [memoryview(payload)]))
    dec = FrameDecoder(scratch_size=4096, direct_threshold=4096)
    fed = 0
    direct = 0
    while fed < len(data):
        buf = dec.get_buffer()
        n = min(buf.nbytes, len(data) - fed, 65536)
        buf[:n] = data[fed : fed + n]
        if buf.nbytes > 4096:
            direct += n
        dec.buffer_updated(n)
        fed += n
    frame = dec.next_frame()
    assert frame is not None and bytes(frame.buffers[0]) == payload.tobytes()
    assert direct > len(payload) // 2  # most of it skipped the scratch buffer


def test_encode_does_not_copy_large_buffers() -> None:
    payload = np.zeros(1 << 20, dtype=np.uint8)
    pieces = encode_frame(Frame(b"m", [memoryview(payload)]))
    assert isinstance(pieces[1], memoryview)
    assert np.shares_memory(np.frombuffer(pieces[1], dtype=np.uint8), payload)


class _DeviceArray:
    """What a frame buffer in device memory looks like to the framing layer."""

    __cuda_array_interface__ = {"shape": (1 << 20,), "typestr": "|u1", "version": 3}
    nbytes = 1 << 20


def test_device_buffers_pass_through_encode_untouched() -> None:
    """For a transport that moves device memory itself (ucx://): the buffer object goes to
    it as it is, its length in the header."""
    device = _DeviceArray()
    assert is_device_buffer(device) and not is_device_buffer(memoryview(b"x"))
    pieces = encode_frame(Frame(b"m", [device]))  # type: ignore[list-item]
    assert pieces[1] is device
    head = bytes(pieces[0])
    assert struct.unpack_from("<Q", head, HEADER.size)[0] == device.nbytes


def test_truncated_frame_is_an_error_at_eof() -> None:
    data = frame_bytes(Frame(b"hello", [memoryview(b"x" * 100)]))
    for cut in (1, HEADER.size, HEADER.size + 8, len(data) - 1):
        dec = FrameDecoder()
        dec.receive_data(data[:cut])
        assert dec.next_frame() is None
        with pytest.raises(RemoteProtocolError, match="middle of a frame"):
            dec.eof()


def test_garbage_is_rejected_and_the_decoder_stays_failed() -> None:
    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError, match="magic"):
        dec.receive_data(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(RemoteProtocolError):
        dec.receive_data(frame_bytes(Frame(b"ok")))


def test_wrong_version_is_rejected() -> None:
    bad = HEADER.pack(MAGIC, VERSION + 1, 0, 0, 0)
    with pytest.raises(RemoteProtocolError, match="version"):
        FrameDecoder().receive_data(bad)


@pytest.mark.parametrize(
    ("limits", "frame", "match"),
    [
        (FrameLimits(max_meta_bytes=10), Frame(b"x" * 11), "metadata"),
        (FrameLimits(max_buffers=2), Frame(b"", [memoryview(b"a")] * 3), "buffers"),
        (FrameLimits(max_frame_bytes=100), Frame(b"", [memoryview(b"a" * 101)]), "limit"),
    ],
)
def test_limits_are_checked_on_both_sides(limits: FrameLimits, frame: Frame, match: str) -> None:
    with pytest.raises(LimitExceeded, match=match):
        encode_frame(frame, limits)
    dec = FrameDecoder(limits)
    with pytest.raises(LimitExceeded, match=match):
        dec.receive_data(frame_bytes(frame))


def test_oversized_length_is_refused_before_allocating() -> None:
    allocated: list[int] = []

    def allocate(n: int) -> memoryview:
        allocated.append(n)
        return memoryview(bytearray(n))

    header = HEADER.pack(MAGIC, VERSION, 0, 0, 1) + struct.pack("<Q", 1 << 60)
    dec = FrameDecoder(allocate=allocate)
    with pytest.raises(LimitExceeded):
        dec.receive_data(header)
    assert allocated == []


def test_non_contiguous_buffers_are_refused() -> None:
    a = np.zeros((4, 4), dtype=np.float32)[:, ::2]
    with pytest.raises(LocalProtocolError):
        encode_frame(Frame(b"", [memoryview(a)]))


@given(st.binary(max_size=2000))
@settings(max_examples=500, deadline=None)
def test_random_bytes_never_crash_the_decoder(data: bytes) -> None:
    dec = FrameDecoder(FrameLimits(max_frame_bytes=1 << 20, max_buffers=64))
    try:
        dec.receive_data(data)
        dec.eof()
    except ProtocolError:
        return
    while dec.next_frame() is not None:
        pass


def test_iter_frames_helper() -> None:
    fs = [Frame(b"a"), Frame(b"b", [memoryview(b"123")])]
    out = iter_frames(b"".join(frame_bytes(f) for f in fs))
    assert [f.meta for f in out] == [b"a", b"b"]
