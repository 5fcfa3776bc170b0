"""Sans-I/O messages: batches of commands and their replies, to and from frames.

A request frame carries a batch of commands; its metadata is msgpack of
``[REQUEST, [array, ...], [[seq, opcode, stream, args, ack], ...]]``: arrays that the commands
use are listed once per frame (``[handle, offset, shape, dtype]``) and referred to by index,
and bulk data travels as the frame's out-of-band buffers, also referred to by index. A reply
frame carries ``[REPLY, [[seq, status, value], ...]]``. A ``FATAL`` frame tells the peer that
the connection is being closed because of what it sent. Nothing here touches a socket or the
executor, and nothing is ever unpickled or evaluated: msgpack gives plain ints, floats,
strings, lists and dicts, and every argument is checked against the call table before the
proxy uses it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, NamedTuple

import msgpack
import msgspec
import numpy as np

from ..errors import (
    AuthenticationError,
    GpuRemoteError,
    LimitExceeded,
    RemoteCallError,
    RemoteProtocolError,
)
from .calls import CALLS_BY_OPCODE, Arg, CallSpec, Param
from .framing import Frame, FrameLimits
from .limits import (
    MAX_ATEN_DEPTH,
    MAX_HANDLE,
    MAX_LIST,
    MAX_NAME,
    MAX_PARAM_LIST,
    MAX_PARAMS,
    MAX_SIZE,
    MAX_STEP_ARRAYS,
    MAX_TENSORS,
    MAX_TEXT,
    WIRE_INT_MAX,
    WIRE_INT_MIN,
)

__all__ = [
    "DTYPES",
    "FATAL",
    "GREETING",
    "NOTICE",
    "OWN",
    "PROTOCOL_VERSION",
    "REPLY",
    "REQUEST",
    "STATUS_ERROR",
    "STATUS_OK",
    "TENSOR_DTYPES",
    "ArrayDesc",
    "BadCommand",
    "Command",
    "ErrorInfo",
    "Reply",
    "StepProgram",
    "TensorDesc",
    "array_desc",
    "check_encodable",
    "decode_batch",
    "decode_greeting",
    "decode_message",
    "decode_replies",
    "decode_request",
    "decode_step",
    "encode_fatal",
    "encode_greeting",
    "encode_notice",
    "encode_replies",
    "encode_request",
    "extent",
    "fatal_error",
    "request_local_calls",
]

#: the version of the wire protocol; a client and a proxy must speak the same
PROTOCOL_VERSION = 1

REQUEST, REPLY, FATAL, NOTICE, GREETING = 1, 2, 3, 4, 5
STATUS_OK, STATUS_ERROR = 0, 1
#: a command's last item, besides ``True`` (answer this ASYNC call once it has run): a call
#: of the client's own, answered as it is (``Command.own``)
OWN = 2


#: dtypes that may cross the wire, by name
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}


class ArrayDesc(NamedTuple):
    """A C-contiguous array in a device buffer: ``offset`` bytes into buffer ``handle``;
    ``nbytes``, its size, is derived from ``shape`` and ``dtype`` (``array_desc`` makes one
    from the four; a decoded descriptor has it from its check)."""

    handle: int
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    nbytes: int

    def encode(self) -> list[Any]:
        return [self.handle, self.offset, list(self.shape), self.dtype.name]


def array_desc(handle: int, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any]) -> ArrayDesc:
    """The ``ArrayDesc`` of ``shape``/``dtype`` at ``offset`` bytes into buffer ``handle``."""
    return ArrayDesc(handle, offset, shape, dtype, math.prod(shape) * dtype.itemsize)


#: the dtypes a strided tensor (``TensorDesc``) may have, by torch's name: their item sizes
TENSOR_DTYPES: dict[str, int] = {
    "bool": 1,
    "complex32": 4,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def extent(sizes: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """The bytes a strided tensor reaches from its first element (0 if it has none)."""
    last = 0
    for n, st in zip(sizes, strides, strict=True):
        if n == 0:
            return 0
        last += (n - 1) * st
    return (last + 1) * itemsize


class TensorDesc(NamedTuple):
    """A strided tensor in a device buffer (PyTorch's view of memory): element ``(i, j, ...)``
    lies at ``offset + (i * strides[0] + j * strides[1] + ...) * itemsize`` bytes into buffer
    ``handle``; ``dtype`` is torch's name of its type."""

    handle: int
    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str

    @property
    def extent(self) -> int:
        """The end, in bytes into the buffer, of the last byte the tensor reaches (0 when
        it has no elements: it reaches none, wherever its offset points)."""
        reach = extent(self.sizes, self.strides, TENSOR_DTYPES[self.dtype])
        return self.offset + reach if reach else 0

    def encode(self) -> list[Any]:
        return [self.handle, self.offset, list(self.sizes), list(self.strides), self.dtype]


class Command(NamedTuple):
    """One decoded, validated command of a batch."""

    seq: int
    spec: CallSpec
    stream: int
    args: tuple[Any, ...]
    ack: bool  # reply even though the call is ASYNC (once it has run)
    #: a call of the client's own (a failover checkpoint's, sent with ``OWN``): answered as
    #: it is (never skipped, never deferred), leaving the application's deferred error to
    #: the application's next SYNC call
    own: bool = False


class ErrorInfo(NamedTuple):
    """What the proxy says about a failed call."""

    seq: int
    call: str
    op: str | None
    kind: str
    message: str
    deferred: bool
    skipped: int

    def to_exception(self) -> RemoteCallError:
        """The exception the client raises for it."""
        return RemoteCallError(
            self.message,
            call=self.call,
            op=self.op,
            seq=self.seq,
            kind=self.kind,
            deferred=self.deferred,
            skipped=self.skipped,
        )


class Reply(NamedTuple):
    """The proxy's answer to one command: its sequence number, and its value or error."""

    seq: int
    ok: bool
    value: Any  # result, or ErrorInfo when not ok


class StepProgram(NamedTuple):
    """A recorded step, checked once: its commands (``seq`` is the index in the step), the
    descriptors its arguments had when it was recorded, and the handles of its results."""

    commands: tuple[Command, ...]
    slots: tuple[ArrayDesc, ...]
    results: tuple[int, ...]


class BadCommand(Exception):
    """A command of a well-formed batch has a bad argument; it fails alone."""


class DecodeContext(NamedTuple):
    """What argument checks see of their frame."""

    nbufs: int
    limits: FrameLimits
    arrays: list[ArrayDesc | BadCommand]  # the frame's array table, checked once


# -- encoding ---------------------------------------------------------------------------------
#: msgspec's msgpack encoder: the same bytes as msgpack's ``Packer(use_bin_type=True)`` for
#: what gpuremote sends (ints, floats, strings, bytes, lists, dicts), in a quarter of the time
#: (``scripts/eval_msgspec.py``); decoding stays msgpack's (``strict_map_key``), with the
#: hand checks below
_pack = msgspec.msgpack.Encoder().encode


def check_encodable(value: Any) -> None:
    """Raise what encoding ``value`` into a message would (``OverflowError``, ``TypeError``,
    ``ValueError``); nothing if it can be sent."""
    _pack(value)


def encode_request(
    commands: list[list[Any]],
    buffers: list[memoryview],
    arrays: list[list[Any]] | None = None,
    local_calls: int | None = None,
) -> Frame:
    """A request frame from already-built command lists ``[seq, opcode, stream, args, ack]``.

    Array arguments are indexes into ``arrays``, the frame's table of array descriptors
    ``[handle, offset, shape, dtype]``: each array is sent and checked once per frame.
    ``local_calls``, the client's count of calls it answered itself, is reported to the
    proxy's monitoring."""
    if local_calls is None:
        return Frame(_pack([REQUEST, arrays or [], commands]), buffers)
    return Frame(_pack([REQUEST, arrays or [], commands, local_calls]), buffers)


def request_local_calls(msg: list[Any]) -> int | None:
    """The client's LOCAL-call count that a request message carries, if any."""
    if len(msg) == 4 and type(msg[3]) is int and msg[3] >= 0:
        return msg[3]
    return None


def encode_replies(replies: list[Reply], buffers: list[memoryview]) -> Frame:
    items = []
    for r in replies:
        if r.ok:
            items.append([r.seq, STATUS_OK, r.value])
        else:
            e: ErrorInfo = r.value
            items.append(
                [
                    r.seq,
                    STATUS_ERROR,
                    [e.seq, e.call, e.op, e.kind, e.message, e.deferred, e.skipped],
                ]
            )
    return Frame(_pack([REPLY, items]), buffers)


def encode_fatal(message: str, kind: str = "ProtocolError") -> Frame:
    """The last frame of a connection that the proxy ends: why (``message``) and the kind
    of error the client raises for it (``AuthenticationError``: its secret was refused)."""
    return Frame(_pack([FATAL, message[:4096], kind]))


def fatal_error(msg: list[Any]) -> GpuRemoteError:
    """The error that a ``FATAL`` message (decoded) stands for, on the client."""
    why = f"the proxy closed the connection: {msg[1] if len(msg) > 1 else '?'}"
    if msg[2:3] == [AuthenticationError.__name__]:
        return AuthenticationError(why)
    return RemoteProtocolError(why)


def encode_notice(kind: str, detail: Any = None) -> Frame:
    return Frame(_pack([NOTICE, kind, detail]))


def encode_greeting(version: int, auth: bool, nonce: bytes) -> Frame:
    """The proxy's first frame on a connection."""
    return Frame(_pack([GREETING, {"version": version, "auth": auth, "nonce": nonce}]))


def decode_greeting(frame: Frame) -> dict[str, Any]:
    msg = decode_message(frame)
    if msg[0] != GREETING or len(msg) != 2 or type(msg[1]) is not dict:
        if msg[0] == FATAL and len(msg) > 1:
            raise RemoteProtocolError(f"the proxy refused the connection: {msg[1]}")
        raise RemoteProtocolError("expected the proxy's greeting: is this a gpuremote proxy?")
    greeting: dict[str, Any] = msg[1]
    if type(greeting.get("nonce")) is not bytes or type(greeting.get("auth")) is not bool:
        raise RemoteProtocolError("malformed greeting")
    return greeting


# -- decoding ---------------------------------------------------------------------------------
def decode_message(frame: Frame) -> list[Any]:
    """The frame's metadata as a list whose first item is the message type."""
    try:
        msg = msgpack.unpackb(frame.meta, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise RemoteProtocolError(f"frame metadata is not valid msgpack: {exc}") from None
    if type(msg) is not list or not msg or type(msg[0]) is not int:
        raise RemoteProtocolError("frame metadata is not a gpuremote message")
    return msg


def decode_request(
    frame: Frame, limits: FrameLimits = FrameLimits(), msg: list[Any] | None = None
) -> list[Command | BadCommandAt]:
    """Decode and check a request frame.

    Returns one ``Command`` per valid command, and a ``BadCommandAt`` for each command whose
    arguments are wrong (it fails alone). Raises ``RemoteProtocolError`` if the frame as a whole
    is not a request batch, and ``LimitExceeded`` past the command limit. ``msg`` is the
    frame's metadata if it was decoded already (``decode_message``).
    """
    if msg is None:
        msg = decode_message(frame)
    if (
        msg[0] != REQUEST
        or len(msg) not in (3, 4)
        or type(msg[1]) is not list
        or type(msg[2]) is not list
    ):
        raise RemoteProtocolError("expected a request batch [REQUEST, arrays, commands]")
    table, items = msg[1], msg[2]
    if len(items) > limits.max_commands or len(table) > limits.max_commands:
        raise LimitExceeded(
            f"{len(items)} commands and {len(table)} arrays in one frame; the "
            f"limit is {limits.max_commands}"
        )
    arrays: list[ArrayDesc | BadCommand] = []
    for i, a in enumerate(table):
        try:
            arrays.append(check_array(a, f"arrays[{i}]", limits))
        except BadCommand as exc:  # kept as a value: without the frames (no cycle through them)
            arrays.append(exc.with_traceback(None))
    ctx = DecodeContext(len(frame.buffers), limits, arrays)
    out: list[Command | BadCommandAt] = []
    for item in items:
        if type(item) is not list or len(item) != 5 or type(item[0]) is not int:
            raise RemoteProtocolError("a command must be [seq, opcode, stream, args, ack]")
        seq, opcode, stream, args, ack = item
        entry = _SCHEMA.get(opcode) if type(opcode) is int else None
        spec = entry[0] if entry is not None else None
        try:
            if entry is None or spec is None:
                raise BadCommand(f"unknown opcode {opcode!r}")
            if type(stream) is not int or not 0 <= stream <= MAX_HANDLE:
                raise BadCommand(f"bad stream handle {stream!r}")
            nargs = entry[1]
            if type(args) is not list or len(args) != nargs:
                raise BadCommand(f"{spec.name} takes {nargs} arguments")
            own = ack == OWN and type(ack) is int
            out.append(Command(seq, spec, stream, entry[2](args, ctx), ack is True or own, own))
        except BadCommand as exc:
            out.append(BadCommandAt(seq, spec.name if spec else f"opcode {opcode!r}", str(exc)))
    return out


class BadCommandAt(NamedTuple):
    """A command that failed validation: its seq, call name and the reason."""

    seq: int
    call: str
    message: str


def decode_replies(frame: Frame, msg: list[Any] | None = None) -> list[Reply]:
    """Decode a reply frame (client side); ``msg`` if its metadata is decoded already."""
    if msg is None:
        msg = decode_message(frame)
    if msg[0] != REPLY or len(msg) != 2 or type(msg[1]) is not list:
        raise RemoteProtocolError("expected a reply batch")
    out = []
    for item in msg[1]:
        if type(item) is not list or len(item) != 3 or type(item[0]) is not int:
            raise RemoteProtocolError("a reply must be [seq, status, value]")
        seq, status, value = item
        if status == STATUS_OK:
            out.append(Reply(seq, True, value))
        elif status == STATUS_ERROR and type(value) is list and len(value) == 7:
            out.append(Reply(seq, False, ErrorInfo(*value)))
        else:
            raise RemoteProtocolError(f"malformed reply for seq {seq}")
    return out


# -- argument checks --------------------------------------------------------------------------
def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise BadCommand(f"argument {name!r} must be an int in [{lo}, {hi}], got {v!r:.60}")
    return v


def _check_handle(v: Any, name: str, ctx: DecodeContext) -> int:
    return _int(v, name, 0, MAX_HANDLE)


def _check_handles(v: Any, name: str, ctx: DecodeContext, most: int = MAX_LIST) -> tuple[int, ...]:
    if type(v) is not list or len(v) > most:
        raise BadCommand(f"argument {name!r} must be a list of at most {most} handles")
    return tuple([_int(h, name, 0, MAX_HANDLE) for h in v])


def _check_places(v: Any, name: str, ctx: DecodeContext) -> tuple[int, ...]:
    """A template's operands: ``[handle, offset]`` pairs, flat (bounds: the template's
    layouts, on the proxy)."""
    if type(v) is not list or len(v) > 2 * MAX_TENSORS or len(v) % 2:
        raise BadCommand(
            f"argument {name!r} must be a flat list of at most {MAX_TENSORS} [handle, offset]"
        )
    return tuple([_int(h, name, 0, MAX_HANDLE) for h in v])


def _check_floats(v: Any, name: str, ctx: DecodeContext) -> tuple[float, ...]:
    if type(v) is not list or len(v) > MAX_TENSORS or any(type(x) not in (float, int) for x in v):
        raise BadCommand(f"argument {name!r} must be a list of at most {MAX_TENSORS} floats")
    return tuple([float(x) for x in v])  # (an integral float may arrive as an int)


def _check_size(v: Any, name: str, ctx: DecodeContext) -> int:
    return _int(v, name, 0, MAX_SIZE)


def _check_name(v: Any, name: str, ctx: DecodeContext) -> str:
    if type(v) is not str or not 0 < len(v) <= MAX_NAME:
        raise BadCommand(f"argument {name!r} must be a name of 1 to {MAX_NAME} characters")
    return v


def _check_text(v: Any, name: str, ctx: DecodeContext) -> str:
    if type(v) is not str or len(v) > MAX_TEXT:
        raise BadCommand(f"argument {name!r} must be a string of at most {MAX_TEXT} characters")
    return v


def check_array(v: Any, name: str, lim: FrameLimits) -> ArrayDesc:
    """Check an array descriptor ``[handle, offset, shape, dtype]`` (every field, every time:
    exact types first, so that ``1.0`` or ``False`` never passes for ``1``)."""
    if type(v) is not list or len(v) != 4:
        raise BadCommand(
            f"argument {name!r} must be an array descriptor [handle, offset, shape, dtype]"
        )
    handle, offset, shape, dtype = v
    if type(handle) is not int or not 0 <= handle <= MAX_HANDLE:
        _int(handle, f"{name}.handle", 0, MAX_HANDLE)
    if type(offset) is not int or not 0 <= offset <= MAX_SIZE:
        _int(offset, f"{name}.offset", 0, MAX_SIZE)
    if type(shape) is not list:
        raise BadCommand(f"argument {name!r}: shape must be a list")
    if len(shape) > lim.max_ndim:
        raise BadCommand(
            f"argument {name!r} has {len(shape)} dimensions; the limit is {lim.max_ndim}"
        )
    size = 1
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_SIZE:
            _int(d, f"{name}.shape", 0, MAX_SIZE)
        size *= d
    dt = DTYPES.get(dtype) if type(dtype) is str else None
    if dt is None:
        raise BadCommand(f"argument {name!r}: unsupported dtype {dtype!r:.40}")
    nbytes = size * dt.itemsize
    if nbytes > MAX_SIZE:
        raise BadCommand(f"argument {name!r} is too large")
    return ArrayDesc(handle, offset, tuple(shape), dt, nbytes)


def _check_array(v: Any, name: str, ctx: DecodeContext) -> ArrayDesc:
    if type(v) is not int or not 0 <= v < len(ctx.arrays):
        raise BadCommand(
            f"argument {name!r} refers to array {v!r:.20}; the frame has {len(ctx.arrays)}"
        )
    desc: Any = ctx.arrays[v]
    if type(desc) is BadCommand:
        raise BadCommand(str(desc))  # a fresh one: the table's keeps no frames
    return desc


def _check_arrays(
    v: Any, name: str, ctx: DecodeContext, most: int = MAX_LIST
) -> tuple[ArrayDesc, ...]:
    if type(v) is not list or len(v) > most:
        raise BadCommand(f"argument {name!r} must be a list of at most {most} arrays")
    table, n = ctx.arrays, len(ctx.arrays)
    out: list[Any] = []
    for a in v:  # _check_array, inlined: this is the hot path of every launch
        if type(a) is not int or not 0 <= a < n:
            raise BadCommand(f"argument {name!r} refers to array {a!r:.20}; the frame has {n}")
        desc = table[a]
        if type(desc) is BadCommand:
            raise BadCommand(str(desc))  # a fresh one: the table's keeps no frames
        out.append(desc)
    return tuple(out)


def _check_params(v: Any, name: str, ctx: DecodeContext) -> dict[str, Any]:
    if type(v) is not dict or len(v) > MAX_PARAMS:
        raise BadCommand(f"argument {name!r} must be a dict of at most {MAX_PARAMS} entries")
    for key, val in v.items():
        if type(key) is not str or len(key) > MAX_NAME:
            raise BadCommand(f"argument {name!r}: keys must be short strings")
        t = type(val)
        if t in (int, float, bool, str) or val is None:
            if t is str and len(val) > MAX_NAME:
                raise BadCommand(f"argument {name!r}: {key!r} is too long")
            continue
        if t is list and len(val) <= MAX_PARAM_LIST and all(type(x) is int for x in val):
            continue
        raise BadCommand(f"argument {name!r}: value of {key!r} must be a scalar or a list of ints")
    return v


def check_tensor(v: Any, name: str, lim: FrameLimits) -> TensorDesc:
    """Check a strided tensor ``[handle, offset, sizes, strides, dtype]``: exact types, sizes
    and strides non-negative, the offset a whole number of items (every field, every time)."""
    if type(v) is not list or len(v) != 5:
        raise BadCommand(
            f"argument {name!r} must be a tensor [handle, offset, sizes, strides, dtype]"
        )
    handle, offset, sizes, strides, dtype = v
    _int(handle, f"{name}.handle", 0, MAX_HANDLE)
    _int(offset, f"{name}.offset", 0, MAX_SIZE)
    itemsize = TENSOR_DTYPES.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise BadCommand(f"argument {name!r}: unsupported dtype {dtype!r:.40}")
    if offset % itemsize:
        raise BadCommand(f"argument {name!r}: offset {offset} is not a multiple of {itemsize}")
    if type(sizes) is not list or type(strides) is not list or len(sizes) != len(strides):
        raise BadCommand(f"argument {name!r}: sizes and strides must be lists of one length")
    if len(sizes) > lim.max_ndim:
        raise BadCommand(
            f"argument {name!r} has {len(sizes)} dimensions; the limit is {lim.max_ndim}"
        )
    for d in sizes:
        _int(d, f"{name}.sizes", 0, MAX_SIZE)
    for d in strides:
        _int(d, f"{name}.strides", 0, MAX_SIZE)
    desc = TensorDesc(handle, offset, tuple(sizes), tuple(strides), dtype)
    if desc.extent > MAX_SIZE:
        raise BadCommand(f"argument {name!r} is too large")
    return desc


def _check_tensors(v: Any, name: str, ctx: DecodeContext) -> tuple[TensorDesc, ...]:
    if type(v) is not list or len(v) > MAX_TENSORS:
        raise BadCommand(f"argument {name!r} must be a list of at most {MAX_TENSORS} tensors")
    return tuple([check_tensor(t, f"{name}[{i}]", ctx.limits) for i, t in enumerate(v)])


#: the tagged values of an ATen op's arguments: {tag: value} (``f``: a template's float
#: argument, by index into the floats of each call)
_ATEN_TAGS = frozenset({"t", "dtype", "device", "layout", "mf", "c", "f"})


def _check_aten_value(v: Any, name: str, depth: int) -> None:
    t = type(v)
    if t is int:
        if not WIRE_INT_MIN <= v <= WIRE_INT_MAX:
            raise BadCommand(f"argument {name!r}: integer out of range")
    elif t is float or t is bool or v is None:
        return
    elif t is str:
        if len(v) > MAX_NAME:
            raise BadCommand(f"argument {name!r}: a string of {len(v)} characters")
    elif t is list:
        if depth >= MAX_ATEN_DEPTH or len(v) > MAX_TENSORS:
            raise BadCommand(f"argument {name!r}: lists too long or too deep")
        for x in v:
            _check_aten_value(x, name, depth + 1)
    elif t is dict and len(v) == 1:
        ((tag, x),) = v.items()
        if tag not in _ATEN_TAGS:
            raise BadCommand(f"argument {name!r}: unknown tag {tag!r:.20}")
        if tag == "c":
            if type(x) is not list or len(x) != 2 or any(type(p) is not float for p in x):
                raise BadCommand(f"argument {name!r}: a complex is two floats")
        elif tag in ("t", "device", "f"):
            _int(x, name, 0, MAX_TENSORS)
        elif type(x) is not str or len(x) > MAX_NAME:
            raise BadCommand(f"argument {name!r}: {tag} must be a short string")
    else:
        raise BadCommand(f"argument {name!r}: a value of type {t.__name__} is not an argument")


def _check_aten_args(v: Any, name: str, ctx: DecodeContext) -> tuple[list[Any], dict[str, Any]]:
    """An ATen op's ``[args, kwargs]``: scalars, short strings, lists of them, and tagged
    values (a tensor operand by index, a dtype, a device, a layout, a memory format, a
    complex); only their form is checked here, the op's schema on the proxy."""
    if type(v) is not list or len(v) != 2 or type(v[0]) is not list or type(v[1]) is not dict:
        raise BadCommand(f"argument {name!r} must be [args, kwargs]")
    args, kwargs = v
    if len(args) > MAX_PARAMS or len(kwargs) > MAX_PARAMS:
        raise BadCommand(f"argument {name!r}: more than {MAX_PARAMS} arguments")
    for a in args:
        _check_aten_value(a, name, 1)
    for k, a in kwargs.items():
        if type(k) is not str or len(k) > MAX_NAME:
            raise BadCommand(f"argument {name!r}: keyword names must be short strings")
        _check_aten_value(a, name, 1)
    return args, kwargs


def _check_kernel_args(v: Any, name: str, ctx: DecodeContext) -> tuple[Any, ...]:
    if type(v) is not list or len(v) > MAX_LIST:
        raise BadCommand(f"argument {name!r} must be a list of at most {MAX_LIST} kernel arguments")
    out: list[Any] = []
    for a in v:
        if type(a) is list and len(a) == 2 and a[0] == "a":
            out.append(("a", _check_array(a[1], name, ctx)))
        elif type(a) is list and len(a) == 3 and a[0] == "s":
            dt = DTYPES.get(a[1]) if type(a[1]) is str else None
            if dt is None or type(a[2]) not in (int, float, bool):
                raise BadCommand(f"argument {name!r}: bad scalar {a!r:.60}")
            out.append(("s", dt, a[2]))
        else:
            raise BadCommand(
                f"argument {name!r}: each item must be ['a', array] or ['s', dtype, x]"
            )
    return tuple(out)


def _check_dims(v: Any, name: str, ctx: DecodeContext) -> tuple[int, ...]:
    if type(v) is not list or not 1 <= len(v) <= 3:
        raise BadCommand(f"argument {name!r} must be a list of 1 to 3 ints")
    return tuple(_int(x, name, 1, 1 << 31) for x in v)


def _check_buffer(v: Any, name: str, ctx: DecodeContext) -> int:
    if type(v) is not int or not 0 <= v < ctx.nbufs:
        raise BadCommand(f"argument {name!r} refers to buffer {v!r:.20}; the frame has {ctx.nbufs}")
    return v


def _check_step(v: Any, name: str, ctx: DecodeContext) -> StepProgram:
    """A recorded step ``[arrays, commands, slots, results]``: each command ``[opcode, stream,
    args]`` is checked as the same command of a batch is, against the step's own array table;
    ``slots`` index that table (the arguments), ``results`` are buffer handles."""
    if type(v) is not list or len(v) != 4 or not all(type(x) is list for x in v):
        raise BadCommand(f"argument {name!r} must be a step [arrays, commands, slots, results]")
    table, items, slots, results = v
    lim = ctx.limits
    if not items or len(items) > lim.max_commands or len(table) > lim.max_commands:
        raise BadCommand(f"a step records 1 to {lim.max_commands} calls and arrays")
    arrays: list[ArrayDesc | BadCommand] = []
    for i, a in enumerate(table):
        try:
            arrays.append(check_array(a, f"{name}.arrays[{i}]", lim))
        except BadCommand as exc:
            arrays.append(exc.with_traceback(None))
    sub = DecodeContext(0, lim, arrays)  # no host data: a step has no buffers
    commands = []
    for i, item in enumerate(items):
        if type(item) is not list or len(item) != 3:
            raise BadCommand(f"{name}: call {i} must be [opcode, stream, args]")
        opcode, stream, args = item
        entry = _SCHEMA.get(opcode) if type(opcode) is int else None
        if entry is None or not entry[0].recordable:
            what = entry[0].name if entry is not None else f"opcode {opcode!r:.20}"
            raise BadCommand(f"{name}: call {i} ({what}) cannot be recorded in a step")
        spec, nargs, check = entry
        try:
            if type(stream) is not int or not 0 <= stream <= MAX_HANDLE:
                raise BadCommand(f"bad stream handle {stream!r:.20}")
            if type(args) is not list or len(args) != nargs:
                raise BadCommand(f"{spec.name} takes {nargs} arguments")
            commands.append(Command(i, spec, stream, check(args, sub), False))
        except BadCommand as exc:
            raise BadCommand(f"{name}: call {i} ({spec.name}): {exc}") from None
    descs = _check_arrays(slots, f"{name}.slots", sub, MAX_STEP_ARRAYS)
    made = _check_handles(results, f"{name}.results", ctx, MAX_STEP_ARRAYS)
    return StepProgram(tuple(commands), descs, made)


def decode_step(v: Any, limits: FrameLimits = FrameLimits()) -> StepProgram:
    """A recorded step's wire form, checked (``BadCommand`` if it is not a valid step): for
    sessions that run calls without a wire (``gpuremote.tools.direct``)."""
    return _check_step(v, "program", DecodeContext(0, limits, []))


_CHECKS = {
    Arg.HANDLE: _check_handle,
    Arg.SIZE: _check_size,
    Arg.NAME: _check_name,
    Arg.TEXT: _check_text,
    Arg.ARRAY: _check_array,
    Arg.ARRAYS: _check_arrays,
    Arg.PARAMS: _check_params,
    Arg.KERNEL_ARGS: _check_kernel_args,
    Arg.DIMS: _check_dims,
    Arg.BUFFER: _check_buffer,
    Arg.HANDLES: _check_handles,
    Arg.STEP: _check_step,
    Arg.TENSORS: _check_tensors,
    Arg.ATEN_ARGS: _check_aten_args,
    Arg.PLACES: _check_places,
    Arg.FLOATS: _check_floats,
}


ArgsCheck = Callable[[list[Any], DecodeContext], tuple[Any, ...]]


def _descs(v: Any, name: str, ctx: DecodeContext) -> tuple[ArrayDesc, ...]:
    """``_check_arrays``, for the launches' hot path (the same checks, inlined)."""
    table = ctx.arrays
    n = len(table)
    if type(v) is not list or len(v) > MAX_LIST:
        return _check_arrays(v, name, ctx)  # raises
    out: list[Any] = []
    for a in v:
        if type(a) is not int or not 0 <= a < n:
            return _check_arrays(v, name, ctx)  # raises, naming the bad index
        desc = table[a]
        if type(desc) is BadCommand:
            raise BadCommand(str(desc))  # a fresh one: the table's keeps no frames
        out.append(desc)
    return tuple(out)


def _check_launch_args(a: list[Any], ctx: DecodeContext) -> tuple[Any, ...]:
    """The arguments of ``launch`` and ``launch_new`` (op, inputs, outputs, params)."""
    op, ins, outs, params = a
    if type(op) is not str or not 0 < len(op) <= MAX_NAME:
        _check_name(op, "op", ctx)
    if type(params) is not dict or params:  # {} passes as it is
        params = _check_params(params, "params", ctx)
    return (op, _descs(ins, "inputs", ctx), _descs(outs, "outputs", ctx), params)


def _check_of(p: Param) -> Callable[[Any, str, DecodeContext], Any]:
    """The check of argument ``p`` (a list kind with its own longest length: that length)."""
    check = _CHECKS[p.kind]
    if not p.most:
        return check
    most = p.most
    lists: Any = check  # _check_arrays or _check_handles: they take the length
    return lambda v, name, ctx: lists(v, name, ctx, most)


def _args_check(spec: CallSpec) -> ArgsCheck:
    """One function checking all of ``spec``'s arguments (their number checked already)."""
    if tuple(p.kind for p in spec.args) == (Arg.NAME, Arg.ARRAYS, Arg.ARRAYS, Arg.PARAMS):
        return _check_launch_args  # launch and launch_new: the hot path
    checks = [(p.name, _check_of(p)) for p in spec.args]
    if len(checks) == 4:  # launch and its kind: unrolled, the hot path
        (n0, c0), (n1, c1), (n2, c2), (n3, c3) = checks
        return lambda a, ctx: (
            c0(a[0], n0, ctx),
            c1(a[1], n1, ctx),
            c2(a[2], n2, ctx),
            c3(a[3], n3, ctx),
        )
    if len(checks) == 2:
        (n0, c0), (n1, c1) = checks
        return lambda a, ctx: (c0(a[0], n0, ctx), c1(a[1], n1, ctx))
    if len(checks) == 1:
        ((n0, c0),) = checks
        return lambda a, ctx: (c0(a[0], n0, ctx),)
    return lambda a, ctx: tuple([c(v, n, ctx) for (n, c), v in zip(checks, a, strict=True)])


#: opcode -> (call, number of arguments, their check), resolved once
_SCHEMA: dict[int, tuple[CallSpec, int, ArgsCheck]] = {
    op: (spec, len(spec.args), _args_check(spec)) for op, spec in CALLS_BY_OPCODE.items()
}


# -- decoding, the typed lane -----------------------------------------------------------------
# A request whose every part has the common, valid form is decoded and checked in one pass by
# msgspec, in C, against types made from the call table; a frame it does not take as it is (a
# call with an argument kind it has no type for, a value out of range, a bad descriptor, a
# frame past a limit, anything malformed) is decoded again by ``decode_request``, one check at
# a time, which says what is wrong. For a frame the typed lane takes, both give the same
# commands (a tested property), so what a client sees never depends on the lane.
_Handle = Annotated[int, msgspec.Meta(ge=0, le=MAX_HANDLE)]
_Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_SIZE)]
_Index = Annotated[int, msgspec.Meta(ge=0)]
_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
_IntList = Annotated[list[int], msgspec.Meta(max_length=MAX_PARAM_LIST)]
_ParamValue = int | float | bool | _Name | None | _IntList


#: ``[REQUEST, arrays, commands(, local_calls)]``, each command's arguments kept raw (the
#: opcode, which says their types, comes second). Made by ``defstruct``, not a class statement:
#: compiled by mypyc, a class statement would lose msgspec's class options (``array_like``).
_TypedRequest: Any = msgspec.defstruct(
    "_TypedRequest",
    [
        ("kind", Literal[1]),
        ("arrays", list[tuple[_Handle, _Size, list[_Size], str]]),
        ("commands", list[tuple[int, int, _Handle, msgspec.Raw, bool | int]]),
        ("local_calls", Annotated[int, msgspec.Meta(ge=0)] | None, None),
    ],
    array_like=True,
    gc=False,
)


def _tuple_of(item: Any, most: int, least: int = 0) -> Any:
    """A list on the wire, decoded as the tuple a command holds (no copy after)."""
    return Annotated[tuple[item, ...], msgspec.Meta(min_length=least, max_length=most)]


def _typed_arg(p: Param) -> Any:
    """The msgspec type of argument ``p``, checked as ``_CHECKS`` would; None for a kind the
    typed lane leaves to them."""
    most = p.most or MAX_LIST
    return {
        Arg.HANDLE: _Handle,
        Arg.SIZE: _Size,
        Arg.NAME: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)],
        Arg.TEXT: Annotated[str, msgspec.Meta(max_length=MAX_TEXT)],
        Arg.ARRAY: _Index,
        Arg.ARRAYS: _tuple_of(_Index, most),
        Arg.HANDLES: _tuple_of(_Handle, most),
        Arg.BUFFER: _Index,
        Arg.PARAMS: Annotated[dict[_Name, _ParamValue], msgspec.Meta(max_length=MAX_PARAMS)],
        Arg.DIMS: _tuple_of(Annotated[int, msgspec.Meta(ge=1, le=1 << 31)], 3, 1),
        Arg.PLACES: _tuple_of(_Handle, 2 * MAX_TENSORS),
        Arg.FLOATS: _tuple_of(float, MAX_TENSORS),
    }.get(p.kind)


class _NotTyped(Exception):
    """The typed lane does not take this frame as it is: ``decode_request`` decodes it."""


def _typed_args(
    spec: CallSpec,
) -> tuple[Callable[[Any], Any], tuple[tuple[int, Arg], ...]] | None:
    """The typed decoding of ``spec``'s arguments and those to convert or check after it
    (descriptors by their index in the frame's table, buffers' indices, places in pairs);
    None where an argument's kind has no type here."""
    types = [_typed_arg(p) for p in spec.args]
    if None in types:
        return None
    convert = tuple(
        (i, p.kind)
        for i, p in enumerate(spec.args)
        if p.kind in (Arg.ARRAY, Arg.ARRAYS, Arg.BUFFER, Arg.PLACES)
    )
    return msgspec.msgpack.Decoder(tuple[tuple(types)]).decode, convert  # type: ignore[misc]


#: opcode -> (call, the decoding of its arguments, the arguments to convert after it)
_TYPED = {
    op: (spec, *typed)
    for op, spec in CALLS_BY_OPCODE.items()
    if (typed := _typed_args(spec)) is not None
}
_decode_typed_request = msgspec.msgpack.Decoder(_TypedRequest).decode
#: the calls whose arguments are a launch's (op, inputs, outputs, params): the hot path
_LAUNCH_OPCODES = frozenset(
    op
    for op, (spec, _, _) in _TYPED.items()
    if tuple(p.kind for p in spec.args) == (Arg.NAME, Arg.ARRAYS, Arg.ARRAYS, Arg.PARAMS)
)


def _decode_typed(
    frame: Frame, limits: FrameLimits
) -> tuple[list[Command | BadCommandAt], int | None]:
    """The typed lane (see above); raises ``_NotTyped`` (or a msgspec error, an
    ``IndexError``) for a frame it does not take."""
    req = _decode_typed_request(frame.meta)
    table, items = req.arrays, req.commands
    if len(items) > limits.max_commands or len(table) > limits.max_commands:
        raise _NotTyped("past a limit")
    max_ndim, dtypes, new = limits.max_ndim, DTYPES, tuple.__new__
    arrays: list[ArrayDesc] = []
    for handle, offset, shape, name in table:
        dt = dtypes.get(name)
        if dt is None or len(shape) > max_ndim:
            raise _NotTyped("a bad descriptor")
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes > MAX_SIZE:
            raise _NotTyped("a bad descriptor")
        arrays.append(new(ArrayDesc, (handle, offset, tuple(shape), dt, nbytes)))
    nbufs = len(frame.buffers)
    out: list[Command | BadCommandAt] = []
    typed, launches = _TYPED, _LAUNCH_OPCODES
    ctx: DecodeContext | None = None
    for seq, opcode, stream, raw, ack in items:
        if opcode in typed:
            spec, decode, convert = typed[opcode]
            args = decode(raw)
        else:  # a call of no msgspec type: its arguments checked one at a time
            if ctx is None:
                ctx = DecodeContext(nbufs, limits, list(arrays))
            spec, args = _untyped_args(opcode, raw, ctx)
            convert = ()
        if opcode in launches:
            op, ins, outs, params = args
            args = (op, tuple([arrays[i] for i in ins]), tuple([arrays[i] for i in outs]), params)
        elif convert:
            values = None
            for i, kind in convert:
                v = args[i]
                if kind is Arg.PLACES:
                    if len(v) % 2:
                        raise _NotTyped("a place without its offset")
                elif kind is Arg.BUFFER:
                    if v >= nbufs:
                        raise _NotTyped("a buffer index past the frame's")
                else:  # descriptors: by their index in the frame's table
                    if values is None:
                        values = list(args)
                    values[i] = arrays[v] if kind is Arg.ARRAY else tuple([arrays[a] for a in v])
            if values is not None:
                args = tuple(values)
        if ack is False or ack is True:
            out.append(new(Command, (seq, spec, stream, args, ack, False)))
        else:  # an int: OWN, or nothing
            own = ack == OWN
            out.append(new(Command, (seq, spec, stream, args, own, own)))
    return out, req.local_calls


def _untyped_args(opcode: int, raw: Any, ctx: DecodeContext) -> tuple[CallSpec, Any]:
    """In the typed lane, a call whose arguments have no msgspec type (an ATen op sent
    whole, a template, a recorded step): decoded as ``decode_message`` decodes a frame and
    checked as ``decode_request`` checks it, so that one such call does not send the whole
    frame to the slow lane; ``_NotTyped`` where that lane must say what is wrong."""
    entry = _SCHEMA.get(opcode)
    if entry is None:
        raise _NotTyped("an unknown call")
    spec, nargs, check = entry
    try:
        args = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception:
        raise _NotTyped("arguments that are not msgpack") from None
    if type(args) is not list or len(args) != nargs:
        raise _NotTyped("a wrong number of arguments")
    try:
        return spec, check(args, ctx)
    except BadCommand:
        raise _NotTyped("a bad argument") from None


#: what the typed lane raises for a frame it does not take
_NOT_TYPED = (msgspec.DecodeError, _NotTyped, KeyError, IndexError)


def decode_batch(
    frame: Frame, limits: FrameLimits = FrameLimits()
) -> tuple[list[Command | BadCommandAt], int | None]:
    """A request frame's commands (as ``decode_request`` gives them) and the client's count
    of LOCAL calls that it carries (``request_local_calls``): by the typed lane where it takes
    the frame, else one check at a time. Raises as ``decode_request`` does."""
    try:
        return _decode_typed(frame, limits)
    except _NOT_TYPED:
        pass
    msg = decode_message(frame)
    return decode_request(frame, limits, msg), request_local_calls(msg)
