"""The one table of API calls: name, opcode, call class, argument schema, and what each call
does to the resources its arguments name.

Every call of the GPU API that gpuremote remotes is written here once. Its class says what the
client does with it:

- ``LOCAL``: answered on the client from shadow state; nothing is sent.
- ``ASYNC``: queued, batched and sent; the client does not wait for it.
- ``SYNC``: sent; the client waits for its reply (it brings data back, or waits on the device).

Each argument (``Param``) has a kind, which the proxy checks before it runs anything
(``gpuremote.wire.protocol``), and, where it names a resource (a buffer, stream, event,
kernel or recorded step), what the call does to it: ``creates``, ``writes``, ``reads`` or
``frees`` it. Every pass over calls reads these columns instead of switching on call names:
the client's checks and array tables (``gpuremote.session.pipeline``), the recording of a
step (``gpuremote.core.recording``) and its replay on the proxy (``gpuremote.proxy.steps``),
the failover journal (``gpuremote.session.failover.ledger``), and the executor's handler table
and its rule for what a failure on a stream skips (``gpuremote.proxy.executor``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from .limits import MAX_STEP_ARRAYS, MAX_TENSORS

__all__ = [
    "BUFFER",
    "CALLS",
    "CALLS_BY_NAME",
    "CALLS_BY_OPCODE",
    "Arg",
    "CallClass",
    "CallSpec",
    "Param",
    "Resource",
    "Use",
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
    TENSORS = "tensors"  # list of strided tensors [handle, offset, sizes, strides, dtype]
    ATEN_ARGS = "aten_args"  # an ATen op's [args, kwargs]; tensors as {"t": index}
    PLACES = "places"  # flat list of [handle, offset] pairs: where a template's operands are
    FLOATS = "floats"  # list of floats: the values of a template's float arguments


class Resource(enum.Enum):
    """What a handle names."""

    BUFFER = "buffer"
    STREAM = "stream"
    EVENT = "event"
    KERNEL = "kernel"
    STEP = "step"
    TEMPLATE = "template"


class Use(enum.Flag):
    """What a call does to the resources an argument names."""

    CREATES = enum.auto()  # made by the call, under the client's handle (then written)
    WRITES = enum.auto()
    READS = enum.auto()
    FREES = enum.auto()


_NONE = Use(0)
#: the kinds that carry array descriptors (sent once per frame, referred to by index)
ARRAY_KINDS = frozenset({Arg.ARRAY, Arg.ARRAYS, Arg.KERNEL_ARGS})
#: the kinds whose values the caller chose (checked on the client before anything is queued)
VALUE_KINDS = frozenset({Arg.SIZE, Arg.PARAMS, Arg.KERNEL_ARGS, Arg.DIMS})


class Param(NamedTuple):
    """One argument: its name, kind, and what the call does to what it names (a buffer for
        array kinds). ``size_of``: this argument is the size in bytes of the buffer that the
        argument of that name creates; ``offset_into``: an offset into the buffer that the
        argument of that name names (it moves with it when a step is rebound); ``most``: the longest
    list it may be, where not ``MAX_LIST``."""

    name: str
    kind: Arg
    use: Use = _NONE
    resource: Resource = Resource.BUFFER
    size_of: str = ""
    offset_into: str = ""
    #: the longest list an argument of a list kind may be (``MAX_LIST`` where 0)
    most: int = 0


@dataclass(frozen=True, slots=True)
class CallSpec:
    """One API call: its wire opcode (0 for LOCAL calls), class, arguments, and how it runs:
    ``on_stream`` (work queued on the call's stream: skipped after an earlier failure on that
    stream), ``admin`` (about the session, not the device), ``recordable`` (may be part of a
    captured step), ``random`` (uses the session's random generator). The other fields are
    derived from the arguments once, for the passes that read them."""

    name: str
    opcode: int
    klass: CallClass
    args: tuple[Param, ...] = ()
    doc: str = ""
    on_stream: bool = True
    admin: bool = False
    recordable: bool = False
    #: draws from (or sets) the session's random generator on the proxy, whose state a
    #: failover checkpoint then keeps (``aten_rng_get`` / ``aten_rng_set``)
    random: bool = False
    #: ``klass.value`` and ``klass is SYNC``, kept as plain fields for the hot loops
    kind: str = field(init=False)
    sync: bool = field(init=False)
    #: the first argument is an op name (a launch): errors name the op
    names_op: bool = field(init=False)
    #: positions of the arguments that carry array descriptors, and their kinds
    array_args: tuple[tuple[int, Arg], ...] = field(init=False)
    #: positions of the arguments whose values the caller chose
    value_args: tuple[int, ...] = field(init=False)
    #: (position, resource) of the arguments by what the call does to what they name
    creates: tuple[tuple[int, Resource], ...] = field(init=False)
    writes: tuple[tuple[int, Resource], ...] = field(init=False)
    reads: tuple[tuple[int, Resource], ...] = field(init=False)
    frees: tuple[tuple[int, Resource], ...] = field(init=False)

    def __post_init__(self) -> None:
        def having(use: Use) -> tuple[tuple[int, Resource], ...]:
            return tuple((i, p.resource) for i, p in enumerate(self.args) if use in p.use)

        args = self.args
        fields = {
            "kind": self.klass.value,
            "sync": self.klass is CallClass.SYNC,
            "names_op": bool(args) and args[0].name == "op",
            "array_args": tuple((i, p.kind) for i, p in enumerate(args) if p.kind in ARRAY_KINDS),
            "value_args": tuple(i for i, p in enumerate(args) if p.kind in VALUE_KINDS),
            "creates": having(Use.CREATES),
            "writes": having(Use.WRITES),
            "reads": having(Use.READS),
            "frees": having(Use.FREES),
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def position(self, name: str) -> int:
        """The position of argument ``name``."""
        return next(i for i, p in enumerate(self.args) if p.name == name)


_A, _S, _L = CallClass.ASYNC, CallClass.SYNC, CallClass.LOCAL
_C, _W, _R, _F = Use.CREATES, Use.WRITES, Use.READS, Use.FREES
_STREAM, _EVENT, _KERNEL, _STEP = Resource.STREAM, Resource.EVENT, Resource.KERNEL, Resource.STEP
_TEMPLATE = Resource.TEMPLATE


def _handle(use: Use, resource: Resource = Resource.BUFFER) -> tuple[Param, ...]:
    return (Param("handle", Arg.HANDLE, use, resource),)


def _launch(outputs: Use) -> tuple[Param, ...]:
    """The arguments of ``launch`` and ``launch_new``."""
    return (
        Param("op", Arg.NAME),
        Param("inputs", Arg.ARRAYS, _R),
        Param("outputs", Arg.ARRAYS, outputs),
        Param("params", Arg.PARAMS),
    )


def _aten(outputs: Param) -> tuple[Param, ...]:
    """The arguments of ``aten`` and ``aten_dynamic``: the op, its tensor operands (in-place
    and out= ops write them), its other arguments, and what it makes."""
    return (
        Param("op", Arg.NAME),
        Param("tensors", Arg.TENSORS, _R | _W),
        Param("args", Arg.ATEN_ARGS),
        outputs,
    )


def _admin(name: str, opcode: int, args: tuple[Param, ...], doc: str) -> CallSpec:
    """A SYNC call about the session itself (the handshake, figures), not device work."""
    return CallSpec(name, opcode, _S, args, doc, on_stream=False, admin=True)


CALLS: tuple[CallSpec, ...] = (
    # -- answered on the client (shadow resources) ----------------------------------------
    CallSpec("device_info", 0, _L, doc="device properties, cached at connect"),
    CallSpec("array_meta", 0, _L, doc="shape, dtype, size, stream of an array"),
    CallSpec("current_stream", 0, _L, doc="the stream new calls go to"),
    # -- the session (admin: not device work) ----------------------------------------------
    _admin(
        "hello",
        1,
        (Param("version", Arg.SIZE), Param("proof", Arg.TEXT)),
        "handshake (with the authentication proof); returns device properties",
    ),
    _admin("ping", 2, (Param("data", Arg.BUFFER),), "echo a buffer (latency benchmark)"),
    _admin("stats", 3, (), "the proxy's figures for this session"),
    _admin("admin_stats", 4, (Param("token", Arg.TEXT),), "every session's figures (admin only)"),
    # -- memory ----------------------------------------------------------------------------
    CallSpec(
        "alloc",
        10,
        _A,
        (*_handle(_C), Param("nbytes", Arg.SIZE, size_of="handle")),
        on_stream=False,
        recordable=True,
    ),
    CallSpec("free", 11, _A, _handle(_F), on_stream=False),
    CallSpec(
        "free_buffers",
        16,
        _A,
        (Param("handles", Arg.HANDLES, _F),),
        "free several buffers (what was released since the last frame: one command)",
        on_stream=False,
    ),
    CallSpec(
        "copy_h2d",
        12,
        _A,
        (Param("dst", Arg.ARRAY, _W), Param("data", Arg.BUFFER)),
        "host-to-device copy",
    ),
    CallSpec(
        "copy_d2h",
        13,
        _S,
        (Param("src", Arg.ARRAY, _R),),
        "device-to-host copy; returns a buffer",
    ),
    CallSpec(
        "copy_d2d",
        14,
        _A,
        (Param("dst", Arg.ARRAY, _W), Param("src", Arg.ARRAY, _R)),
        recordable=True,
    ),
    CallSpec(
        "memset",
        15,
        _A,
        (
            *_handle(_W),
            Param("offset", Arg.SIZE, offset_into="handle"),
            Param("nbytes", Arg.SIZE),
            Param("value", Arg.SIZE),
        ),
        recordable=True,
    ),
    # -- execution -------------------------------------------------------------------------
    CallSpec("launch", 20, _A, _launch(_W), "run an allow-listed op", recordable=True),
    CallSpec(
        "launch_new",
        24,
        _A,
        _launch(_C),
        "allocate each output's buffer (the output at offset 0 fills it), then launch",
        recordable=True,
    ),
    CallSpec(
        "launch_dynamic",
        23,
        _S,
        (
            Param("op", Arg.NAME),
            Param("inputs", Arg.ARRAYS, _R),
            Param("outputs", Arg.HANDLES, _C),
            Param("params", Arg.PARAMS),
        ),
        "run an op whose output shapes depend on the data; its outputs become new buffers "
        "under the given handles; returns their shapes and dtypes",
    ),
    CallSpec(
        "kernel_create",
        21,
        _A,
        (
            *_handle(_C, _KERNEL),
            Param("kind", Arg.NAME),
            Param("name", Arg.NAME),
            Param("source", Arg.TEXT),
            Param("params", Arg.PARAMS),
        ),
        "compile a user kernel; the handle is its content hash",
        on_stream=False,
    ),
    CallSpec(
        "kernel_launch",
        22,
        _A,
        (
            *_handle(_R, _KERNEL),
            Param("args", Arg.KERNEL_ARGS, _R | _W),  # a kernel may write any array it is given
            Param("grid", Arg.DIMS),
            Param("block", Arg.DIMS),
        ),
        recordable=True,
    ),
    # -- streams and events ----------------------------------------------------------------
    CallSpec("stream_create", 30, _A, _handle(_C, _STREAM), on_stream=False),
    CallSpec("stream_destroy", 31, _A, _handle(_F, _STREAM), on_stream=False),
    CallSpec("stream_synchronize", 32, _S, (), "wait for the call's stream"),
    CallSpec("device_synchronize", 33, _S, (), "wait for every stream of the session"),
    CallSpec("event_create", 40, _A, _handle(_C, _EVENT), on_stream=False),
    CallSpec("event_destroy", 41, _A, _handle(_F, _EVENT), on_stream=False),
    CallSpec(
        "event_record",
        42,
        _A,
        _handle(_W, _EVENT),
        "record on the call's stream",
        recordable=True,
    ),
    CallSpec(
        "event_wait",
        43,
        _A,
        _handle(_R, _EVENT),
        "make the call's stream wait",
        recordable=True,
    ),
    CallSpec("event_query", 44, _S, _handle(_R, _EVENT), "has the event completed?"),
    # -- recorded steps (``gpuremote.core.capture``) -------------------------------------------
    CallSpec(
        "step_record",
        60,
        _A,
        (*_handle(_C, _STEP), Param("program", Arg.STEP)),
        "keep a recorded step (ASYNC calls, checked once, here) under a handle",
        on_stream=False,
    ),
    CallSpec(
        "step_replay",
        61,
        _A,
        (
            *_handle(_R, _STEP),
            # a step may write its arguments
            Param("args", Arg.ARRAYS, _R | _W, most=MAX_STEP_ARRAYS),
            Param("results", Arg.HANDLES, _C, most=MAX_STEP_ARRAYS),
        ),
        "run a recorded step on these argument arrays; its results become new buffers",
    ),
    CallSpec(
        "step_run",
        63,
        _A,
        (
            *_handle(_R, _STEP),
            # each bound whole, as the step's argument recorded there is laid out
            Param("buffers", Arg.HANDLES, _R | _W, most=MAX_STEP_ARRAYS),
            Param("results", Arg.HANDLES, _C, most=MAX_STEP_ARRAYS),
        ),
        "run a recorded step on these buffers (one per argument, at its recorded place); "
        "its results become new buffers",
    ),
    CallSpec("step_free", 62, _A, _handle(_F, _STEP), "forget a recorded step", on_stream=False),
    # -- PyTorch (``gpuremote.torch``; the proxy runs ATen with torch) ----------------------
    CallSpec(
        "aten",
        70,
        _A,
        _aten(Param("outputs", Arg.TENSORS, _C)),
        "run an allow-listed ATen op on strided views of the session's buffers; each tensor "
        "it returns that is not an operand fills a new buffer, as the client's metadata says",
        recordable=True,
        random=True,
    ),
    CallSpec(
        "aten_dynamic",
        71,
        _S,
        _aten(Param("outputs", Arg.HANDLES, _C)),
        "run an ATen op whose results depend on the data (shapes, scalars): each tensor it "
        "returns becomes a new buffer under the given handles; returns the results' metadata",
        random=True,
    ),
    CallSpec(
        "aten_shapes",
        75,
        _S,
        (Param("op", Arg.NAME), Param("tensors", Arg.TENSORS, _R), Param("args", Arg.ATEN_ARGS)),
        "the layouts of the tensors an ATen op makes of these operands, by this device's "
        "kernel (run on copies of the operands it writes; nothing of the session changes)",
    ),
    CallSpec(
        "aten_template",
        76,
        _A,
        (
            *_handle(_C, _TEMPLATE),
            Param("op", Arg.NAME),
            Param("operands", Arg.TENSORS),  # their layouts (handle and offset 0)
            Param("args", Arg.ATEN_ARGS),  # a float argument as {"f": index}: given per call
            Param("outputs", Arg.TENSORS),  # the layouts of the tensors it makes
        ),
        "keep an ATen op's call with these operand layouts, arguments and results under a "
        "handle (checked once, here): ``aten_call`` runs it on operands named by place",
        on_stream=False,
    ),
    CallSpec(
        "aten_call",
        77,
        _A,
        (
            *_handle(_R, _TEMPLATE),
            Param("operands", Arg.PLACES, _R | _W),
            Param("outputs", Arg.HANDLES, _C, most=MAX_TENSORS),
            Param("floats", Arg.FLOATS),
        ),
        "run an ATen op kept by ``aten_template`` on operands at these [handle, offset] "
        "places, with these float arguments; each tensor it makes fills a new buffer",
        random=True,
    ),
    CallSpec(
        "aten_seed",
        72,
        _A,
        (Param("seed", Arg.SIZE),),
        "seed the session's random generator (``torch.manual_seed`` on the client)",
        random=True,
    ),
    CallSpec(
        "aten_rng_get",
        73,
        _S,
        (),
        "the state of the session's random generator (for a failover checkpoint)",
        on_stream=False,
    ),
    CallSpec(
        "aten_rng_set",
        74,
        _A,
        (Param("state", Arg.TEXT),),
        "set the session's random generator to a state ``aten_rng_get`` gave (hex)",
        on_stream=False,
        random=True,
    ),
    # -- collectives between proxies (``gpuremote.proxy.collectives``) -------------------------
    CallSpec(
        "dist_host",
        80,
        _S,
        (Param("size", Arg.SIZE), Param("timeout_ms", Arg.SIZE)),
        "start the rendezvous store of a distributed job of ``size`` ranks on this proxy; "
        "returns [host, port, key] (the key names the job: whoever holds it may join)",
        on_stream=False,
    ),
    CallSpec(
        "dist_join",
        81,
        _S,
        (
            Param("group", Arg.SIZE),
            Param("host", Arg.NAME),
            Param("port", Arg.SIZE),
            Param("key", Arg.NAME),
            Param("rank", Arg.SIZE),
            Param("size", Arg.SIZE),
            Param("timeout_ms", Arg.SIZE),
        ),
        "join this session, as ``rank``, to the process group of the job ``key`` names "
        "(its store at host:port: this proxy or a peer); the group is the session's ``group``",
        on_stream=False,
    ),
    CallSpec(
        "dist_run",
        82,
        _A,
        (
            Param("op", Arg.NAME),
            Param("group", Arg.SIZE),
            Param("tensors", Arg.TENSORS, _R | _W),
            Param("params", Arg.PARAMS),
        ),
        "run one collective of the session's group on strided views of its buffers, in order "
        "on the call's stream (the other ranks' proxies run theirs)",
    ),
    CallSpec(
        "dist_leave",
        83,
        _A,
        (Param("group", Arg.SIZE),),
        "leave the session's process group ``group`` (it is torn down)",
        on_stream=False,
    ),
    # -- between proxies (``gpuremote.proxy.peers``) ------------------------------------------
    CallSpec(
        "peer_export",
        50,
        _S,
        (Param("src", Arg.ARRAY, _R),),
        "copy an array aside for one read by another proxy; returns the ticket",
    ),
    CallSpec(
        "peer_read",
        51,
        _S,
        (Param("ticket", Arg.TEXT),),
        "the data of an exported array (uses the ticket up); returns a buffer",
    ),
    CallSpec(
        "peer_import",
        52,
        _S,
        (Param("dst", Arg.ARRAY, _W), Param("url", Arg.TEXT), Param("ticket", Arg.TEXT)),
        "read a ticket from the proxy at url into an array of this session",
    ),
)

CALLS_BY_NAME: dict[str, CallSpec] = {c.name: c for c in CALLS}
CALLS_BY_OPCODE: dict[int, CallSpec] = {c.opcode: c for c in CALLS if c.klass is not _L}
