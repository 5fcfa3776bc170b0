"""Sans-I/O framing: a frame (metadata bytes plus out-of-band buffers) to and from a byte stream.

Wire layout of one frame, little-endian::

    magic "GR" | version u8 | flags u8 | meta_len u32 | nbufs u32
    | nbufs x u64 buffer lengths | meta | buffers

Bulk buffers never pass through the metadata encoding: ``encode_frame`` returns a list of
buffers for a vectored write (no copy of the payloads), and ``FrameDecoder`` hands out the
memory to read into next (``get_buffer``/``buffer_updated``, the shape of asyncio's
``BufferedProtocol``), so that large payloads land straight in freshly allocated arrays.
Nothing here does I/O.

A transport that moves device memory itself (ucx://, by cuda_copy, cuda_ipc or GPUDirect RDMA)
may carry device arrays (objects with ``__cuda_array_interface__``) as a frame's buffers:
``encode_frame`` passes them through untouched. Only buffers of ``DEVICE_DIRECT_MIN`` bytes or
more go that way (below it, staging through host memory costs less than a device transfer).
"""

from __future__ import annotations

import functools
import struct
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import LimitExceeded, LocalProtocolError, RemoteProtocolError

__all__ = [
    "DEVICE_DIRECT_MIN",
    "HEADER",
    "MAGIC",
    "VERSION",
    "Frame",
    "FrameDecoder",
    "FrameLimits",
    "as_bytes_view",
    "byte_view",
    "check_frame",
    "check_header",
    "check_lengths",
    "encode_frame",
    "is_device_buffer",
]

MAGIC = b"GR"
VERSION = 1
HEADER = struct.Struct("<2sBBII")
_JOIN_BELOW = 16 << 10
#: buffers this large or larger go as device memory on connections that carry it
DEVICE_DIRECT_MIN = 1 << 20


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """Hard limits checked before anything they would cause is allocated."""

    max_frame_bytes: int = 1 << 31  # metadata plus buffers
    max_meta_bytes: int = 64 << 20
    max_buffers: int = 4096
    max_commands: int = 100_000
    max_ndim: int = 32


@dataclass(slots=True)
class Frame:
    """One message: metadata bytes (msgpack) and out-of-band buffers."""

    meta: bytes
    buffers: list[memoryview] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes this frame takes on a byte stream, header included."""
        n = HEADER.size + len(self.meta)
        for b in self.buffers:
            n += 8 + b.nbytes
        return n


@functools.lru_cache(maxsize=64)
def _lengths(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}Q")


def as_bytes_view(buf: Any) -> memoryview:
    """``buf`` (anything with the buffer protocol, C-contiguous) as a flat view of bytes."""
    view = buf if type(buf) is memoryview else memoryview(buf)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if not view.c_contiguous:
        raise LocalProtocolError("frame buffers must be C-contiguous")
    return view.cast("B") if (view.format != "B" or view.ndim != 1) else view


def is_device_buffer(buf: object) -> bool:
    """Whether ``buf`` is device memory (it has ``__cuda_array_interface__``)."""
    return type(buf) is not memoryview and hasattr(buf, "__cuda_array_interface__")


def _piece(buf: object) -> Any:
    """A frame buffer as it goes on the wire: a flat byte view, or a device array untouched
    (for a transport that carries device memory)."""
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1 and buf.c_contiguous:
        return buf
    if is_device_buffer(buf):
        return buf
    return as_bytes_view(buf)


def _check_limits(nbufs: int, meta: int, total: int, limits: FrameLimits) -> None:
    if nbufs > limits.max_buffers:
        raise LimitExceeded(f"{nbufs} buffers in one frame; the limit is {limits.max_buffers}")
    if meta > limits.max_meta_bytes:
        raise LimitExceeded(f"frame metadata of {meta} bytes; the limit is {limits.max_meta_bytes}")
    if total > limits.max_frame_bytes:
        raise LimitExceeded(f"frame of {total} bytes; the limit is {limits.max_frame_bytes}")


def check_frame(frame: Frame, limits: FrameLimits) -> None:
    """Raise ``LimitExceeded`` where ``encode_frame`` would (a transport that hands frames
    over without encoding them checks the same limits)."""
    total = len(frame.meta)
    for b in frame.buffers:
        total += b.nbytes
    _check_limits(len(frame.buffers), len(frame.meta), total, limits)


def encode_frame(frame: Frame, limits: FrameLimits = FrameLimits()) -> list[memoryview | bytes]:
    """Return the pieces of ``frame`` on the wire, for a vectored write; payloads are not copied."""
    bufs = [_piece(b) for b in frame.buffers]
    lengths = [b.nbytes for b in bufs]
    total = len(frame.meta) + sum(lengths)
    _check_limits(len(bufs), len(frame.meta), total, limits)
    header = HEADER.pack(MAGIC, VERSION, 0, len(frame.meta), len(bufs))
    if lengths:
        header += _lengths(len(lengths)).pack(*lengths)
    if total <= _JOIN_BELOW:  # one small piece: cheaper than a vectored write
        return [b"".join([header, frame.meta, *bufs])]
    return [header + frame.meta, *bufs]


def byte_view(array: Any) -> memoryview:
    """A flat byte view of a C-contiguous NumPy array (or any buffer), without a copy."""
    if isinstance(array, np.ndarray):
        array = array.reshape(-1).view(np.uint8)
    return memoryview(array)


def default_allocate(nbytes: int) -> memoryview:
    """Fresh, uninitialised, exclusively owned memory for one incoming buffer."""
    return byte_view(np.empty(nbytes, dtype=np.uint8))


# decoder states
_HEADER, _LENGTHS, _META, _BUFFER, _ERROR = range(5)


def check_header(data: Any, offset: int, limits: FrameLimits) -> tuple[int, int]:
    """The metadata length and number of buffers of the frame header at ``offset`` in
    ``data``: ``RemoteProtocolError`` if it is not a frame of this version,
    ``LimitExceeded`` past ``limits``."""
    magic, version, _flags, meta_len, nbufs = HEADER.unpack_from(data, offset)
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad frame magic {bytes(magic)!r}: not gpuremote")
    if version != VERSION:
        raise RemoteProtocolError(f"frame version {version}; this side speaks version {VERSION}")
    if meta_len > limits.max_meta_bytes:
        raise LimitExceeded(
            f"incoming frame metadata of {meta_len} bytes exceeds the limit {limits.max_meta_bytes}"
        )
    if nbufs > limits.max_buffers:
        raise LimitExceeded(
            f"incoming frame with {nbufs} buffers exceeds the limit {limits.max_buffers}"
        )
    return meta_len, nbufs


def check_lengths(meta_len: int, lengths: Sequence[int], limits: FrameLimits) -> int:
    """The bytes of a frame whose metadata and buffers have these lengths: ``LimitExceeded``
    past ``limits``."""
    total = meta_len + sum(lengths)
    if total > limits.max_frame_bytes:
        raise LimitExceeded(
            f"incoming frame of {total} bytes exceeds the limit {limits.max_frame_bytes}"
        )
    return total


class FrameDecoder:
    """Turns a byte stream into frames, with no I/O.

    Feed it with ``receive_data(data)``, or, to read without a copy, write into the view that
    ``get_buffer()`` returns and report the count with ``buffer_updated(n)``. Then take the
    finished frames from ``next_frame()`` until it returns ``None``. A malformed header or a
    limit exceeded raises ``RemoteProtocolError`` (or ``LimitExceeded``) and every later call
    fails the same way. ``eof()`` says whether the stream ended between frames.
    """

    def __init__(
        self,
        limits: FrameLimits = FrameLimits(),
        *,
        allocate: Callable[[int], memoryview] = default_allocate,
        scratch_size: int = 256 << 10,
        direct_threshold: int = 64 << 10,
        initial_scratch: int = 4 << 10,
    ) -> None:
        self._limits = limits
        self._allocate = allocate
        # small to start with (an idle connection holds little), doubled up to scratch_size
        # whenever a read fills all the room it was given
        self._max_scratch = max(scratch_size, initial_scratch)
        self._scratch = bytearray(min(initial_scratch, self._max_scratch))
        self._view = memoryview(self._scratch)
        self._offered = 0  # the size of the last scratch view handed out
        self._start = 0  # unconsumed bytes of scratch are [_start, _end)
        self._end = 0
        self._direct_threshold = direct_threshold
        self._direct = False  # last get_buffer() handed out the destination itself
        self._frames: deque[Frame] = deque()
        self._state = _HEADER
        self._error: Exception | None = None
        self._meta_len = 0
        self._lengths: list[int] = []
        self._nbufs = 0
        self._dest: memoryview | None = None  # current field being filled (meta or a buffer)
        self._dest_pos = 0
        self._meta: bytes = b""
        self._buffers: list[memoryview] = []
        self._reserve: Callable[[int], None] | None = None

    # -- feeding ---------------------------------------------------------------------------
    def get_buffer(self) -> memoryview:
        """Writable memory for the next incoming bytes (at least one byte)."""
        self._check_error()
        dest = self._dest
        if (
            dest is not None
            and self._start == self._end
            and dest.nbytes - self._dest_pos >= self._direct_threshold
        ):
            self._direct = True
            return dest[self._dest_pos :]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._scratch):
            remaining = self._end - self._start
            if self._start == 0 and len(self._scratch) < self._max_scratch:
                self._grow()  # full of one unfinished piece
            else:
                self._view[:remaining] = self._view[self._start : self._end]
                self._start, self._end = 0, remaining
        view = self._view[self._end :]
        self._offered = view.nbytes
        return view

    def _grow(self) -> None:
        """Double the scratch buffer (up to its maximum), keeping the unconsumed bytes."""
        remaining = self._end - self._start
        bigger = bytearray(min(2 * len(self._scratch), self._max_scratch))
        bigger[:remaining] = self._view[self._start : self._end]
        self._scratch, self._view = bigger, memoryview(bigger)
        self._start, self._end = 0, remaining

    def buffer_updated(self, nbytes: int) -> None:
        """Account for ``nbytes`` written into the view from the last ``get_buffer()``."""
        self._check_error()
        if self._direct:
            self._direct = False
            self._dest_pos += nbytes
            if self._dest is not None and self._dest_pos == self._dest.nbytes:
                self._field_done()
        else:
            self._end += nbytes
            if nbytes == self._offered and len(self._scratch) < self._max_scratch:
                self._grow()  # the stream had more than the room it was given: more next time
            if self._state == _HEADER:
                try:
                    while self._whole_frame():  # the common case: whole small frames
                        pass
                except Exception as exc:
                    self._state = _ERROR
                    self._error = exc
                    raise
                if self._start == self._end:
                    return
        try:
            self._process()
        except Exception as exc:
            self._state = _ERROR
            self._error = exc
            raise

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes (copied into the decoder's buffers)."""
        src = memoryview(data).cast("B")
        while src.nbytes:
            buf = self.get_buffer()
            n = min(buf.nbytes, src.nbytes)
            buf[:n] = src[:n]
            src = src[n:]
            self.buffer_updated(n)

    def set_limits(
        self,
        limits: FrameLimits,
        allocate: Callable[[int], memoryview] = default_allocate,
        reserve: Callable[[int], None] | None = None,
    ) -> None:
        """From the next frame on, check ``limits`` and receive buffers into ``allocate``'s
        memory (a proxy widens both once its client has authenticated); ``reserve(nbytes)``
        is called with each frame's buffer bytes before they are allocated, and may raise
        (``LimitExceeded``) to refuse them."""
        self._limits = limits
        self._allocate = allocate
        self._reserve = reserve

    def release(self) -> None:
        """Drop the decoder's buffers (the stream is over); later use fails."""
        self._scratch = bytearray()
        self._view = memoryview(self._scratch)
        self._dest = None
        self._reserve = None
        self._frames.clear()
        if self._error is None:
            self._error = RemoteProtocolError("decoder released")
        self._start = self._end = 0

    def next_frame(self) -> Frame | None:
        """The next complete frame, or ``None`` if more data is needed."""
        return self._frames.popleft() if self._frames else None

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame has been received but not all of it."""
        return self._state not in (_HEADER, _ERROR) or self._end > self._start

    def eof(self) -> None:
        """Tell the decoder that the stream ended; raises if it ended inside a frame."""
        self._check_error()
        if self.mid_frame:
            self._state = _ERROR
            self._error = RemoteProtocolError("connection closed in the middle of a frame")
            raise self._error

    # -- internals -------------------------------------------------------------------------
    def _check_error(self) -> None:
        if self._error is not None:
            raise RemoteProtocolError(f"decoder failed earlier: {self._error}") from self._error

    def _whole_frame(self) -> bool:
        """Fast path: take one complete frame lying wholly in scratch (small messages), or
        return False and leave the work to the state machine (which also reports errors)."""
        view, start = self._view, self._start
        avail = self._end - start
        if avail < HEADER.size:
            return False
        magic, version, _flags, meta_len, nbufs = HEADER.unpack_from(view, start)
        lim = self._limits
        if magic != MAGIC or version != VERSION or nbufs > lim.max_buffers:
            return False
        head = HEADER.size + 8 * nbufs
        if avail < head + meta_len:
            return False
        lengths = _lengths(nbufs).unpack_from(view, start + HEADER.size) if nbufs else ()
        body = meta_len + sum(lengths)
        if head + body > avail or body > lim.max_frame_bytes or meta_len > lim.max_meta_bytes:
            return False
        if self._reserve is not None and lengths:
            self._reserve(body - meta_len)
        p = start + head
        meta = bytes(view[p : p + meta_len])
        p += meta_len
        buffers = []
        for n in lengths:
            buffers.append(memoryview(bytearray(view[p : p + n])))
            p += n
        self._frames.append(Frame(meta, buffers))
        self._start = p
        return True

    def _process(self) -> None:
        view = self._view
        while True:
            avail = self._end - self._start
            state = self._state
            if state == _HEADER:
                if self._whole_frame():
                    continue
                if avail < HEADER.size:
                    return
                meta_len, nbufs = check_header(view, self._start, self._limits)
                self._start += HEADER.size
                self._meta_len, self._nbufs = meta_len, nbufs
                self._lengths = []
                self._buffers = []
                self._state = _LENGTHS
            elif state == _LENGTHS:
                need = 8 * self._nbufs
                if avail < need:
                    return
                lengths = list(_lengths(self._nbufs).unpack_from(view, self._start))
                self._start += need
                total = check_lengths(self._meta_len, lengths, self._limits)
                if self._reserve is not None and lengths:
                    self._reserve(total - self._meta_len)
                self._lengths = lengths
                self._begin_field(self._meta_len, meta=True)
                self._state = _META
            elif state in (_META, _BUFFER):
                dest = self._dest
                assert dest is not None
                need = dest.nbytes - self._dest_pos
                n = min(need, avail)
                if n:
                    dest[self._dest_pos : self._dest_pos + n] = view[self._start : self._start + n]
                    self._dest_pos += n
                    self._start += n
                if self._dest_pos < dest.nbytes:
                    return
                self._field_done()
            else:  # pragma: no cover - _ERROR is caught by _check_error
                return

    def _begin_field(self, nbytes: int, *, meta: bool) -> None:
        if meta:
            self._dest = memoryview(bytearray(nbytes))
        else:
            self._dest = self._allocate(nbytes) if nbytes else memoryview(b"")
        self._dest_pos = 0

    def _field_done(self) -> None:
        """The current field (meta or a buffer) is complete: move on."""
        assert self._dest is not None
        if self._state == _META:
            self._meta = bytes(self._dest)
        else:
            self._buffers.append(self._dest)
        self._dest = None
        index = len(self._buffers)
        if index < self._nbufs:
            self._begin_field(self._lengths[index], meta=False)
            self._state = _BUFFER
        else:
            self._frames.append(Frame(self._meta, self._buffers))
            self._meta, self._buffers = b"", []
            self._state = _HEADER


def frame_bytes(frame: Frame, limits: FrameLimits = FrameLimits()) -> bytes:
    """The whole frame as one bytes object (for tests and small messages)."""
    return b"".join(bytes(p) for p in encode_frame(frame, limits))


def iter_frames(data: bytes, limits: FrameLimits = FrameLimits()) -> Sequence[Frame]:
    """Decode every frame in ``data``; raises if it ends inside a frame."""
    dec = FrameDecoder(limits)
    dec.receive_data(data)
    dec.eof()
    out = []
    while (f := dec.next_frame()) is not None:
        out.append(f)
    return out
