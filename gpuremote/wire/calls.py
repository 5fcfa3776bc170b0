"""The one table of API calls: name, opcode, call class and argument schema.

Every call of the GPU API that gpuremote remotes is written here once. Its class says what the
client does with it:

- ``LOCAL``: answered on the client from shadow state; nothing is sent.
- ``ASYNC``: queued, batched and sent; the client does not wait for it.
- ``SYNC``: sent; the client waits for its reply (it brings data back, or waits on the device).

The argument schema is what the proxy checks before it runs anything.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = [
    "BUFFER",
    "CALLS",
    "CALLS_BY_NAME",
    "CALLS_BY_OPCODE",
    "Arg",
    "CallClass",
    "CallSpec",
]

#: the placeholder, among a call's arguments, for the out-of-band buffer it sends (the
#: session puts the buffer's index in its frame there)
BUFFER = object()


class CallClass(enum.Enum):
    """How the client treats a call (see the module docstring)."""

    LOCAL = "local"
    ASYNC = "async"
    SYNC = "sync"


class Arg(enum.Enum):
    """Argument kinds of the schema; the proxy validates each (``gpuremote.wire.protocol``)."""

    HANDLE = "handle"  # client-chosen id, 0 <= h < 2**63
    SIZE = "size"  # non-negative int
    INT = "int"  # any 64-bit int
    NUMBER = "number"  # int or float
    BOOL = "bool"
    NAME = "name"  # short identifier-like string
    TEXT = "text"  # source code
    ARRAY = "array"  # array descriptor [handle, offset, shape, dtype]
    ARRAYS = "arrays"  # list of array descriptors
    PARAMS = "params"  # small dict of scalars / int lists
    KERNEL_ARGS = "kernel_args"  # list of ["a", array] / ["s", dtype, number]
    DIMS = "dims"  # list of 1 to 3 positive ints (grid, block)
    BUFFER = "buffer"  # index of an out-of-band buffer of the frame
    HANDLES = "handles"  # list of handles
    STEP = "step"  # a recorded step: [arrays, commands, argument slots, result handles]


@dataclass(frozen=True, slots=True)
class CallSpec:
    """One API call: its wire opcode (0 for LOCAL calls), class and argument schema."""

    name: str
    opcode: int
    klass: CallClass
    args: tuple[tuple[str, Arg], ...] = ()
    doc: str = ""
    #: ``klass.value`` and ``klass is SYNC``, kept as plain fields for the executor's hot loop
    kind: str = field(init=False)
    sync: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", self.klass.value)
        object.__setattr__(self, "sync", self.klass is CallClass.SYNC)

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.args)


_A, _S, _L = CallClass.ASYNC, CallClass.SYNC, CallClass.LOCAL

#: the arguments of ``launch`` and ``launch_new``
_LAUNCH_ARGS = (
    ("op", Arg.NAME),
    ("inputs", Arg.ARRAYS),
    ("outputs", Arg.ARRAYS),
    ("params", Arg.PARAMS),
)

CALLS: tuple[CallSpec, ...] = (
    # -- answered on the client (shadow resources) ----------------------------------------
    CallSpec("device_info", 0, _L, doc="device properties, cached at connect"),
    CallSpec("array_meta", 0, _L, doc="shape, dtype, size, stream of an array"),
    CallSpec("current_stream", 0, _L, doc="the stream new calls go to"),
    CallSpec("view", 0, _L, doc="reshape or byte-range view of a buffer"),
    CallSpec("host_copy", 0, _L, doc="get() of a buffer whose uploaded host copy is valid"),
    # -- session ---------------------------------------------------------------------------
    CallSpec(
        "hello",
        1,
        _S,
        (("version", Arg.SIZE), ("proof", Arg.TEXT)),
        "handshake (with the authentication proof); returns device properties",
    ),
    CallSpec("ping", 2, _S, (("data", Arg.BUFFER),), "echo a buffer (latency benchmark)"),
    CallSpec("stats", 3, _S, (), "the proxy's figures for this session"),
    CallSpec("admin_stats", 4, _S, (("token", Arg.TEXT),), "every session's figures (admin only)"),
    # -- memory ----------------------------------------------------------------------------
    CallSpec("alloc", 10, _A, (("handle", Arg.HANDLE), ("nbytes", Arg.SIZE))),
    CallSpec("free", 11, _A, (("handle", Arg.HANDLE),)),
    CallSpec(
        "free_buffers",
        16,
        _A,
        (("handles", Arg.HANDLES),),
        "free several buffers (what was released since the last frame: one command)",
    ),
    CallSpec("copy_h2d", 12, _A, (("dst", Arg.ARRAY), ("data", Arg.BUFFER)), "host-to-device copy"),
    CallSpec("copy_d2h", 13, _S, (("src", Arg.ARRAY),), "device-to-host copy; returns a buffer"),
    CallSpec("copy_d2d", 14, _A, (("dst", Arg.ARRAY), ("src", Arg.ARRAY))),
    CallSpec(
        "memset",
        15,
        _A,
        (("handle", Arg.HANDLE), ("offset", Arg.SIZE), ("nbytes", Arg.SIZE), ("value", Arg.SIZE)),
    ),
    # -- execution -------------------------------------------------------------------------
    CallSpec(
        "launch",
        20,
        _A,
        _LAUNCH_ARGS,
        "run an allow-listed op",
    ),
    CallSpec(
        "launch_new",
        24,
        _A,
        _LAUNCH_ARGS,
        "allocate each output's buffer (the output at offset 0 fills it), then launch",
    ),
    CallSpec(
        "launch_dynamic",
        23,
        _S,
        (
            ("op", Arg.NAME),
            ("inputs", Arg.ARRAYS),
            ("outputs", Arg.HANDLES),
            ("params", Arg.PARAMS),
        ),
        "run an op whose output shapes depend on the data; its outputs become new buffers "
        "under the given handles; returns their shapes and dtypes",
    ),
    CallSpec(
        "kernel_create",
        21,
        _A,
        (
            ("handle", Arg.HANDLE),
            ("kind", Arg.NAME),
            ("name", Arg.NAME),
            ("source", Arg.TEXT),
            ("params", Arg.PARAMS),
        ),
        "compile a user kernel; the handle is its content hash",
    ),
    CallSpec(
        "kernel_launch",
        22,
        _A,
        (
            ("handle", Arg.HANDLE),
            ("args", Arg.KERNEL_ARGS),
            ("grid", Arg.DIMS),
            ("block", Arg.DIMS),
        ),
    ),
    # -- streams and events ----------------------------------------------------------------
    CallSpec("stream_create", 30, _A, (("handle", Arg.HANDLE),)),
    CallSpec("stream_destroy", 31, _A, (("handle", Arg.HANDLE),)),
    CallSpec("stream_synchronize", 32, _S, (), "wait for the call's stream"),
    CallSpec("device_synchronize", 33, _S, (), "wait for every stream of the session"),
    CallSpec("event_create", 40, _A, (("handle", Arg.HANDLE),)),
    CallSpec("event_destroy", 41, _A, (("handle", Arg.HANDLE),)),
    CallSpec("event_record", 42, _A, (("handle", Arg.HANDLE),), "record on the call's stream"),
    CallSpec("event_wait", 43, _A, (("handle", Arg.HANDLE),), "make the call's stream wait"),
    CallSpec("event_query", 44, _S, (("handle", Arg.HANDLE),), "has the event completed?"),
    # -- recorded steps (``gpuremote.core.capture``) -----------------------------------------------
    CallSpec(
        "step_record",
        60,
        _A,
        (("handle", Arg.HANDLE), ("program", Arg.STEP)),
        "keep a recorded step (ASYNC calls, checked once, here) under a handle",
    ),
    CallSpec(
        "step_replay",
        61,
        _A,
        (("handle", Arg.HANDLE), ("args", Arg.ARRAYS), ("results", Arg.HANDLES)),
        "run a recorded step on these argument arrays; its results become new buffers",
    ),
    CallSpec("step_free", 62, _A, (("handle", Arg.HANDLE),), "forget a recorded step"),
    # -- between proxies (``gpuremote.proxy.peers``) ----------------------------------------------
    CallSpec(
        "peer_export",
        50,
        _S,
        (("src", Arg.ARRAY),),
        "copy an array aside for one read by another proxy; returns the ticket",
    ),
    CallSpec(
        "peer_read",
        51,
        _S,
        (("ticket", Arg.TEXT),),
        "the data of an exported array (uses the ticket up); returns a buffer",
    ),
    CallSpec(
        "peer_import",
        52,
        _S,
        (("dst", Arg.ARRAY), ("url", Arg.TEXT), ("ticket", Arg.TEXT)),
        "read a ticket from the proxy at url into an array of this session",
    ),
)

CALLS_BY_NAME: dict[str, CallSpec] = {c.name: c for c in CALLS}
CALLS_BY_OPCODE: dict[int, CallSpec] = {c.opcode: c for c in CALLS if c.klass is not _L}
