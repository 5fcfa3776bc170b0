"""The one array core under both front ends: the async API (``GPU``, ``RemoteArray``) and
``gpuremote.xp`` (``Device``, ``Array``).

A ``Core`` belongs to one client session. It builds calls and never waits: calls that return
nothing are handed to ``post`` (the front end's way of queueing an ASYNC call), and what needs
a reply is described to the front end, which waits in its own way (``await`` or driving the
loop in the calling thread) and hands the reply back. Everything an array needs is here, once:

- handles and buffers (``Buffer``: freed by one ASYNC ``free`` when the last array on it goes,
  or at once with ``free``); the array reference (``ArrayRef``: buffer, shape, dtype, offset,
  wire form, the freed check);
- the host-copy policy (``HostCopies``): a host copy of a whole buffer, known from an upload or
  a read, answers the next read with no round trip; copies larger than ``shadow_max_bytes``
  are never kept (reads: larger than 1 MiB), nor any when ``shadow`` is off;
- upload, download, free, ``reshape`` (the standard's rule, ``reshape_dims``), launches with
  new outputs or ``into`` existing ones, dynamic-shape launches, and ``to_device`` between two
  sessions (proxy to proxy, else through the client);
- the one rule for Python scalars (``scalar_param``): the standard's checks, then the value
  in a form the wire can carry (an ``int`` too large for the protocol becomes a float next to
  a floating-point array, which is what the standard's conversion to that dtype gives);
- ``infer``: the output shapes and dtypes of an op, remembered per signature.

Every ASYNC call of both front ends goes through ``Core.post``, and every call that waits is a
``Call`` that the front end hands to its session: what records the calls of a step and
replays them (capture), or keeps a journal to replay on another proxy (failover), wraps those
two points here, once, and neither front end changes.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from typing import Any, NoReturn

import numpy as np
from mypy_extensions import mypyc_attr

from .. import ops
from ..errors import LocalProtocolError, PeerUnreachable, RemoteCallError
from ..ops import OpError, OpTypeError
from ..session.contract import Reply, Session
from ..wire.calls import BUFFER, CALLS_BY_NAME, CallSpec
from ..wire.framing import byte_view
from ..wire.limits import WIRE_INT_MAX, WIRE_INT_MIN
from ..wire.protocol import DTYPES
from .recording import Recording

__all__ = [
    "BINARY_OPERATORS",
    "BUFFER",
    "COMPARISONS",
    "UNARY_OPERATORS",
    "ArrayMetadata",
    "ArrayRef",
    "Buffer",
    "Call",
    "Core",
    "HostCopies",
    "drive",
    "drive_now",
    "dtype_name",
    "fill_param",
    "infer",
    "kernel_arg",
    "reshape_dims",
    "scalar_param",
    "signature",
    "supported_dtype",
]

_C = CALLS_BY_NAME
_ALLOC, _FREE, _LAUNCH, _LAUNCH_NEW = _C["alloc"], _C["free"], _C["launch"], _C["launch_new"]
_H2D, _D2H, _DYNAMIC = _C["copy_h2d"], _C["copy_d2h"], _C["launch_dynamic"]
_EXPORT, _IMPORT, _PEER_READ = _C["peer_export"], _C["peer_import"], _C["peer_read"]

_NAMES = {dt: name for name, dt in DTYPES.items()}


def supported_dtype(dtype: Any) -> np.dtype[Any]:
    """``dtype`` as a NumPy dtype; ``TypeError`` if gpuremote does not support it."""
    dt = np.dtype(dtype)
    if dt not in _NAMES:
        raise TypeError(f"dtype {dt} is not supported by gpuremote")
    return dt


def dtype_name(dt: np.dtype[Any]) -> str:
    """The wire name of a supported dtype."""
    return _NAMES.get(dt) or _NAMES[supported_dtype(dt)]


# -- buffers and array references --------------------------------------------------------------
class Buffer:
    """A block of device memory on the proxy; ``host`` is a valid host copy of its bytes
    (uint8), if one is known, so that reading it costs no round trip."""

    __slots__ = ("__weakref__", "freed", "handle", "host", "nbytes", "release", "writes")

    def __init__(self, release: Callable[[int, int], None], handle: int, nbytes: int) -> None:
        self.release = release  # called with (handle, nbytes) once, when the buffer goes
        self.handle = handle
        self.nbytes = nbytes
        self.host: Any = None
        self.freed = False
        self.writes = 0  # writes queued so far: a read's bytes are kept only if none came since

    def invalidate(self) -> None:
        """The buffer is written (by the device, or by an upload): the host copy is stale."""
        self.host = None
        self.writes += 1

    def detach(self) -> bool:
        """Mark the buffer freed by its owner (no release when it goes); False if it was."""
        if self.freed:
            return False
        self.freed = True
        self.host = None
        return True

    def __del__(self) -> None:  # cheaper than weakref.finalize, and as prompt
        if not self.freed:  # at interpreter exit, or with the session gone, nothing to free
            try:  # noqa: SIM105 (contextlib.suppress: three calls more at every array's end)
                self.release(self.handle, self.nbytes)
            except Exception:
                pass


@mypyc_attr(allow_interpreted_subclasses=True)  # subclassed by the front ends
class ArrayMetadata:
    """``ndim``, ``size`` and ``nbytes`` from ``shape`` and ``_dtype``: answered locally."""

    __slots__ = ()
    shape: tuple[int, ...]
    _dtype: np.dtype[Any]

    @property
    def ndim(self) -> int:
        """The number of axes."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """The size in bytes."""
        return self.size * self._dtype.itemsize


@mypyc_attr(allow_interpreted_subclasses=True)  # subclassed by the front ends
class ArrayRef(ArrayMetadata):
    """A C-contiguous array in a buffer of one session: what both front ends' arrays are."""

    __slots__ = ("__weakref__", "_buf", "_core", "_dtype", "_meta", "_wire", "offset", "shape")

    def __init__(
        self,
        core: Core,
        buf: Buffer,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        offset: int = 0,
    ) -> None:
        self._core = core
        self._buf = buf
        self.shape = shape
        self._dtype = dtype
        self.offset = offset
        self._meta = (shape, dtype)
        self._wire = [buf.handle, offset, list(shape), _NAMES.get(dtype) or dtype_name(dtype)]

    @property
    def handle(self) -> int:
        """The handle of the array's buffer."""
        return self._buf.handle

    def _desc(self) -> list[Any]:
        """The wire form; raises if the buffer was freed."""
        if self._buf.freed:
            raise LocalProtocolError(f"array on buffer {self._buf.handle} used after free")
        return self._wire


def reshape_dims(shape: tuple[int, ...], new: Sequence[int]) -> tuple[int, ...]:
    """The standard's (and NumPy's) reshape rule: at most one ``-1``, inferred from the size;
    every other dimension non-negative; the same number of elements. ``ValueError`` else."""
    dims = tuple(operator.index(d) for d in new)
    size = math.prod(shape)
    if dims.count(-1) > 1:
        raise ValueError("reshape takes at most one -1")
    if any(d < -1 for d in dims):
        raise ValueError(f"cannot reshape {shape} into {dims}: negative dimension")
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        if known == 0 or size % known:
            raise ValueError(f"cannot reshape {shape} into {dims}")
        dims = tuple(size // known if d == -1 else d for d in dims)
    if math.prod(dims) != size:
        raise ValueError(f"cannot reshape {shape} into {dims}")
    return dims


def scalar_param(dt: np.dtype[Any], value: Any) -> Any:
    """Python scalar ``value`` next to an array of ``dt``, as the value of a ``scalar``-like
    param: the standard's checks (``TypeError``; ``OverflowError`` for an int outside an
    integer dtype's range, raised here, before anything is queued), then what the wire
    carries: a NumPy scalar as its Python value, an ``int`` beyond the wire's range (only
    possible next to floating-point arrays) as a ``float``. ``None`` for a ``complex``, which
    the wire cannot carry as a param (send it as an array of ``scalar_dtype``)."""
    t = type(value)
    if t is float and dt.kind in "fc":  # the common cases first, without a call
        return value
    if t is int and dt.kind in "fc" and WIRE_INT_MIN <= value <= WIRE_INT_MAX:
        return value
    if isinstance(value, np.generic):
        value = value.item()
        t = type(value)
    ops.scalar_dtype(dt, value)
    if t is int and not WIRE_INT_MIN <= value <= WIRE_INT_MAX:
        return float(value)  # OverflowError beyond float's range, as NumPy raises
    if t is complex:
        return None
    return value


def fill_param(dt: np.dtype[Any], value: Any) -> Any:
    """A creation function's fill value for an array of ``dt``, as the wire carries it (an
    ``int`` beyond the wire's range: ``OverflowError`` for an integer dtype, a ``float``
    for the others)."""
    if isinstance(value, np.generic):
        value = value.item()
    if type(value) is int and not WIRE_INT_MIN <= value <= WIRE_INT_MAX:
        if dt.kind in "iub":
            raise OverflowError(f"Python int {value} is out of the range of {dt}: cannot be sent")
        return float(value)
    return value


def kernel_arg(value: Any) -> list[Any]:
    """A scalar argument of a user kernel as the wire carries it (``["s", dtype, value]``):
    a NumPy scalar in its dtype, a Python ``int`` as an int64 (``OverflowError`` if it does
    not fit), a ``float`` as a float64, a ``bool`` as a bool."""
    if isinstance(value, np.generic):
        return ["s", value.dtype.name, value.item()]
    t = type(value)
    if t is int:
        if not -(2**63) <= value < 2**63:
            raise OverflowError(f"kernel argument {value} does not fit an int64")
        return ["s", "int64", value]
    if t is float or t is bool:
        return ["s", np.dtype(t).name, value]
    raise TypeError(f"kernel argument of type {t.__name__} is not supported")


def _is_scalar(x: Any) -> bool:
    return type(x) in (bool, int, float, complex) or isinstance(x, np.generic)


class HostCopies:
    """The one host-copy policy: which host copies of a buffer the client keeps. Only with
    ``shadow`` on, only of a whole buffer, at most ``max_bytes`` each; an upload's copy (made
    anyway, so that the caller may change its data at once) up to ``max_bytes``, a read's up
    to ``read_max_bytes`` as well (keeping a read costs a copy of the data, which a large read
    that is not repeated would pay for nothing)."""

    __slots__ = ("enabled", "max_bytes", "read_max_bytes")

    def __init__(self, enabled: bool, max_bytes: int, read_max_bytes: int = 1 << 20) -> None:
        self.enabled = enabled
        self.max_bytes = max_bytes
        self.read_max_bytes = min(read_max_bytes, max_bytes)

    def keep(self, buf: Buffer, host: np.ndarray[Any, Any]) -> None:
        """Remember ``host`` (uint8, the whole buffer, the client's own copy) as ``buf``'s
        host copy, if allowed."""
        buf.host = host if self.enabled and host.nbytes <= self.max_bytes else None

    def keep_read(self, buf: Buffer, data: np.ndarray[Any, Any]) -> bool:
        """Remember a copy of ``data`` (uint8, the whole buffer, as read) as ``buf``'s host
        copy, if allowed; whether it did."""
        if self.enabled and data.nbytes <= self.read_max_bytes and not buf.freed:
            buf.host = data.view(np.uint8).copy()
            return True
        return False

    def read(self, ref: ArrayRef) -> np.ndarray[Any, Any] | None:
        """``ref``'s data from its buffer's host copy (a copy of it), if one is kept."""
        host = ref._buf.host
        if host is None or not self.enabled:
            return None
        part = host[ref.offset : ref.offset + ref.nbytes]
        return part.view(ref._dtype).reshape(ref.shape).copy()


#: how a front end queues an ASYNC call: (call, stream, args, buffer)
Send = Callable[[CallSpec, int, list[Any], "memoryview | None"], None]
#: a call that needs its reply: (core of the session it goes to, call, stream, args, buffer)
Call = tuple["Core", CallSpec, int, list[Any], "memoryview | None"]
#: a procedure over several sessions: yields the calls it waits for, is sent their replies
#: (or thrown their errors) by the front end (``drive``), returns its result
Steps = Generator[Call, Reply, Any]


async def drive(steps: Steps, call: Callable[[Call], Awaitable[Reply]]) -> Any:
    """Run a procedure of the core to its end: ``call`` makes each call it yields and gives
    back the reply (or raises the call's error, which the procedure may catch)."""
    try:
        request = next(steps)
        while True:
            try:
                reply = await call(request)
            except Exception as exc:
                request = steps.throw(exc)
            else:
                request = steps.send(reply)
    except StopIteration as stop:
        return stop.value


def drive_now(steps: Steps, call: Callable[[Call], Reply]) -> Any:
    """``drive`` for a front end that waits in the calling thread: ``call`` returns each
    reply itself, so the driver never suspends and runs to its end here."""

    async def answered(request: Call) -> Reply:
        return call(request)

    driver = drive(steps, answered)
    try:
        driver.send(None)
    except StopIteration as stop:
        return stop.value
    driver.close()
    raise RuntimeError("drive_now: a call did not answer at once")


def _raise_local(exc: OpError) -> NoReturn:
    """The standard's exception type for what an op's checks refused."""
    if isinstance(exc, OpTypeError):
        raise TypeError(str(exc)) from None
    raise ValueError(str(exc)) from None


class Core:
    """The array core of one session: builds calls, never waits (see the module doc).

    ``send(spec, stream, args, buffer)`` is how the front end queues an ASYNC call (every
    one goes through ``post``); ``release(handle, nbytes)`` frees a buffer later, from any
    thread (a garbage array's); ``make(core, buf, shape, dtype, offset)`` makes the front
    end's array type; ``owner`` is the front end object. ``recorder`` is the step being
    captured, if any (``recording``). ``replayed()``, where given, is called after a captured
    step's replay is queued (a synchronous front end's: it sends the replay at once)."""

    __slots__ = (
        "_lock",
        "_send",
        "copies",
        "make",
        "new_handle",
        "owner",
        "recorder",
        "release",
        "replayed",
        "session",
    )

    def __init__(
        self,
        owner: Any,
        session: Session,
        send: Send,
        release: Callable[[int, int], None],
        make: Callable[..., Any],
        copies: HostCopies,
        replayed: Callable[[], None] | None = None,
    ) -> None:
        self.owner = owner
        self.session = session
        self.new_handle = session.new_handle
        self._send = send
        self.release = release
        self.make = make
        self.copies = copies
        self.replayed = replayed
        self.recorder: Recording | None = None
        self._lock = threading.RLock()  # one recording at a time on this core

    # -- what every call goes through ------------------------------------------------------
    def post(self, spec: CallSpec, stream: int, args: list[Any], buffer: memoryview | None) -> None:
        """Queue an ASYNC call (recorded too, while a step is captured)."""
        recorder = self.recorder
        if recorder is not None:
            recorder.add(spec, stream, args, buffer)
        self._send(spec, stream, args, buffer)

    def written(self, buf: Buffer) -> None:
        """``buf`` is written (by the device, or by an upload): its host copy is stale (after
        every replay too, while a step is captured)."""
        buf.invalidate()
        if self.recorder is not None:
            self.recorder.wrote(buf)

    @contextlib.contextmanager
    def recording(self, recorder: Recording) -> Iterator[Recording]:
        """Give the core and its session ``recorder`` (inside a recording already: the new
        one records into it too), one thread at a time."""
        with self._lock:
            outer, session = self.recorder, self.session
            recorder.outer = outer
            self.recorder = session.recorder = recorder
            try:
                yield recorder
            finally:
                self.recorder = session.recorder = outer

    # -- allocation ------------------------------------------------------------------------
    def new(self, shape: tuple[int, ...], dt: np.dtype[Any]) -> Any:
        """An array on a new buffer handle, allocated by whoever uses it first."""
        nbytes = dt.itemsize
        for d in shape:
            nbytes *= d
        buf = Buffer(self.release, self.new_handle(), nbytes)
        return self.make(self, buf, shape, dt)

    def empty(self, shape: tuple[int, ...], dt: np.dtype[Any]) -> Any:
        """A new, uninitialised array (one ASYNC alloc)."""
        out = self.new(shape, dt)
        self.post(_ALLOC, 0, [out._buf.handle, out._buf.nbytes], None)
        return out

    # -- upload ----------------------------------------------------------------------------
    @staticmethod
    def snapshot(
        host: Any, dtype: np.dtype[Any] | None = None, shape: tuple[int, ...] | None = None
    ) -> np.ndarray[Any, Any]:
        """A C-contiguous copy of host data (broadcast to ``shape``, if given)."""
        arr = np.array(host, dtype=dtype, order="C", copy=True)
        supported_dtype(arr.dtype)
        if shape is not None and arr.shape != shape:
            arr = np.ascontiguousarray(np.broadcast_to(arr, shape))
        return arr

    def upload(self, host: Any, dtype: Any = None, stream: int = 0) -> Any:
        """A remote copy of host data (ASYNC alloc and upload of a copy made at once)."""
        snap = self.snapshot(host, None if dtype is None else supported_dtype(dtype))
        out = self.empty(snap.shape, snap.dtype)
        self.write(out, snap, stream)
        return out

    def write(self, dst: ArrayRef, snap: np.ndarray[Any, Any], stream: int = 0) -> None:
        """Upload ``snap`` (the caller's own copy, of ``dst``'s shape and dtype) into ``dst``
        (ASYNC); it becomes the buffer's host copy where the policy allows."""
        buf = dst._buf
        self.written(buf)
        if dst.offset == 0 and dst.nbytes == buf.nbytes:
            self.copies.keep(buf, snap.reshape(-1).view(np.uint8))
        self.post(_H2D, stream, [dst._desc(), BUFFER], byte_view(snap))

    def borrow(self, dst: ArrayRef, host: Any) -> tuple[list[Any], memoryview]:
        """The args and buffer of an upload of ``host`` into ``dst`` that borrows the
        caller's memory (the front end waits until the proxy has it)."""
        arr = np.ascontiguousarray(host, dtype=dst._dtype)
        if arr.shape != dst.shape:
            raise ValueError(f"cannot write shape {arr.shape} into an array of {dst.shape}")
        self.written(dst._buf)
        return [dst._desc(), BUFFER], byte_view(arr)

    # -- download --------------------------------------------------------------------------
    def cached(self, ref: ArrayRef) -> np.ndarray[Any, Any] | None:
        """``ref``'s data if a kept host copy answers it (counted as a local call)."""
        if ref._buf.host is None:  # the common case, in one test
            return None
        ref._desc()
        if self.recorder is not None:  # a step's data is the device's, at each replay
            self.recorder.refuse("reading an array's data")
        out = self.copies.read(ref)
        if out is not None:
            self.session.count_local(shadow_bytes=ref.nbytes)
        return out

    def download(self, ref: ArrayRef, stream: int = 0) -> tuple[Call, int]:
        """The call that reads ``ref``, and what ``downloaded`` needs with its reply."""
        return (self, _D2H, stream, [ref._desc()], None), ref._buf.writes

    def downloaded(self, ref: ArrayRef, reply: Reply, writes: int) -> np.ndarray[Any, Any]:
        """``ref``'s data from the reply of ``download``; a whole buffer's bytes become its
        host copy where the policy allows, unless a write was queued since the read was."""
        value, bufs = reply
        data = np.frombuffer(bufs[value], dtype=ref._dtype)
        buf = ref._buf
        if data.nbytes == buf.nbytes and buf.writes == writes:  # the whole buffer, as it is
            self.copies.keep_read(buf, data)  # its own copy: the caller may change theirs
        out = data.reshape(ref.shape)
        return out if data.flags.writeable else out.copy()

    # -- free and views --------------------------------------------------------------------
    def free(self, ref: ArrayRef) -> None:
        """Free ``ref``'s buffer now (every view of it becomes unusable)."""
        buf = ref._buf
        if buf.detach():
            self.post(_FREE, 0, [buf.handle], None)

    def reshape(self, ref: ArrayRef, shape: Sequence[int]) -> Any:
        """A view of ``ref`` with another shape (local: no call is sent)."""
        dims = reshape_dims(ref.shape, shape)
        ref._desc()
        self.session.count_local()
        return self.make(self, ref._buf, dims, ref._dtype, ref.offset)

    # -- launches --------------------------------------------------------------------------
    def meta(self, name: str, arrays: Sequence[ArrayRef], params: dict[str, Any]) -> list[Any]:
        """Output shapes and dtypes of op ``name`` (raising the standard's errors)."""
        try:
            return infer(name, [a._meta for a in arrays], params)
        except OpError as exc:
            _raise_local(exc)

    def operands(
        self, name: str, inputs: Sequence[Any], params: dict[str, Any], host: bool = True
    ) -> list[Any]:
        """The arrays of a call with ``inputs`` (arrays, Python scalars, host data): a
        scalar beside an array becomes the op's ``scalar`` param where it takes one (by
        ``scalar_param``; ``reverse`` when it comes first), else an array of the dtype the
        standard gives it; host data (NumPy arrays; anything array-like with ``host``) is
        uploaded, anything else is a ``TypeError``."""
        like = None
        for x in inputs:
            if isinstance(x, ArrayRef):
                like = x
                break
        spec = ops.OPS.get(name)
        takes_scalar = spec is not None and "scalar" in spec.params
        arrays: list[Any] = []
        for i, x in enumerate(inputs):
            if isinstance(x, ArrayRef):
                arrays.append(x)
            elif like is not None and _is_scalar(x):
                v = scalar_param(like._dtype, x)
                if v is not None and takes_scalar and "scalar" not in params:
                    params["scalar"] = v
                    if i == 0 and len(inputs) == 2:
                        params["reverse"] = True
                    continue
                v = x.item() if isinstance(x, np.generic) else x
                dt = ops.scalar_dtype(like._dtype, v)
                arrays.append(self.upload(np.asarray(v, dtype=dt)))
            elif isinstance(x, np.ndarray) or (host and not _is_scalar(x)):
                arrays.append(self.upload(x))
            elif _is_scalar(x):
                raise TypeError(f"{name} needs at least one array argument")
            else:
                raise TypeError(f"expected an array or a Python scalar, got {type(x).__name__}")
        return arrays

    def launch(
        self,
        name: str,
        arrays: Sequence[ArrayRef],
        params: dict[str, Any],
        into: Sequence[ArrayRef] | None = None,
        stream: int = 0,
    ) -> list[Any]:
        """Run op ``name`` (ASYNC): its outputs are new arrays (the proxy allocates their
        buffers with the launch), or ``into`` existing ones of the right shapes and dtypes."""
        metas = []
        wires = []
        for a in arrays:
            if a._core is not self:
                here, there = getattr(a._core.owner, "url", ""), getattr(self.owner, "url", "")
                raise ValueError(f"arrays on two devices ({here} and {there}) cannot be combined")
            if a._buf.freed:  # before anything exists
                a._desc()
            metas.append(a._meta)
            wires.append(a._wire)
        try:
            outs_meta = infer(name, metas, params)
        except OpError as exc:
            _raise_local(exc)
        if into is None:
            outs = []
            out_wires = []
            new_handle, release, make = self.new_handle, self.release, self.make
            for shape, dt in outs_meta:
                nbytes = dt.itemsize
                for d in shape:
                    nbytes *= d
                out = make(self, Buffer(release, new_handle(), nbytes), shape, dt)
                outs.append(out)
                out_wires.append(out._wire)
            try:
                self.post(_LAUNCH_NEW, stream, [name, wires, out_wires, params], None)
            except BaseException:
                for o in outs:
                    o._buf.detach()  # never made on the proxy: nothing to free
                raise
            return outs
        if len(outs_meta) != len(into) or any(m != o._meta for m, o in zip(outs_meta, into)):  # noqa: B905
            got = [(o.shape, o._dtype) for o in into]
            raise ValueError(f"{name} writes {outs_meta}; the outputs given are {got}")
        for o in into:
            self.written(o._buf)
        self.post(_LAUNCH, stream, [name, wires, [o._desc() for o in into], params], None)
        return list(into)

    def apply(
        self,
        name: str,
        inputs: Sequence[Any],
        params: dict[str, Any],
        into: ArrayRef | None = None,
        stream: int = 0,
        host: bool = True,
    ) -> Any:
        """``operands`` then ``launch`` of an op with one output: the path of every
        operator and function of both front ends."""
        arrays: Sequence[Any] = inputs
        if len(inputs) == 2:  # the operators' case first: an array and an array or a number
            x1, x2 = inputs
            if isinstance(x1, ArrayRef):
                if not isinstance(x2, ArrayRef):
                    t = type(x2)
                    if (
                        (t is float or t is int)
                        and name in _TAKES_SCALAR
                        and "scalar" not in params
                    ):
                        params["scalar"] = scalar_param(x1._dtype, x2)
                        arrays = (x1,)
                    else:
                        arrays = self.operands(name, inputs, params, host)
            else:
                arrays = self.operands(name, inputs, params, host)
        else:
            for x in inputs:
                if not isinstance(x, ArrayRef):
                    arrays = self.operands(name, inputs, params, host)
                    break
        outs = self.launch(name, arrays, params, None if into is None else (into,), stream)
        if len(outs) != 1:
            raise ValueError(f"{name} writes {len(outs)} outputs; use launch()")
        return outs[0]

    def dynamic(
        self, name: str, arrays: Sequence[ArrayRef], params: dict[str, Any], n_out: int
    ) -> Steps:
        """Run op ``name``, whose output shapes depend on the data (one SYNC call)."""
        self.meta(name, arrays, params)
        handles = [self.new_handle() for _ in range(n_out)]
        value, _ = yield (
            self,
            _DYNAMIC,
            0,
            [name, [a._desc() for a in arrays], handles, params],
            None,
        )
        outs = []
        for h, (shape, dtype) in zip(handles, value, strict=True):
            dt = DTYPES[dtype]
            buf = Buffer(self.release, h, math.prod(shape) * dt.itemsize)
            outs.append(self.make(self, buf, tuple(shape), dt))
        return outs

    def to_device(self, ref: ArrayRef, target: Core) -> Steps:
        """A copy of ``ref`` (of this session) in ``target``'s session: proxy to proxy where
        the target's proxy can reach this one's (the data never comes to the client), else
        through the client. Returns the copy and how it went."""
        ticket, _ = yield (self, _EXPORT, 0, [ref._desc()], None)
        out = target.empty(ref.shape, ref._dtype)
        url = getattr(self.owner, "url", "")
        try:
            yield (target, _IMPORT, 0, [out._wire, url, ticket], None)
            how = "proxy to proxy"
        except RemoteCallError as exc:
            if not exc.is_a(PeerUnreachable):
                raise
            value, bufs = yield (self, _PEER_READ, 0, [ticket], None)
            target.post(_H2D, 0, [out._wire, BUFFER], bufs[value])
            how = f"through the client ({exc.message})"
        return out, how


#: the ops that take a Python scalar as their ``scalar`` param
_TAKES_SCALAR = frozenset(name for name, op in ops.OPS.items() if "scalar" in op.params)


# -- operators ----------------------------------------------------------------------------------
#: Python's operators (the name between the dunders) and the ops they launch, for both front
#: ends' arrays: binary ones (``__x__``, reflected ``__rx__``, in place ``__ix__``), then
#: comparisons and unary ones
BINARY_OPERATORS = {
    "add": "add",
    "sub": "subtract",
    "mul": "multiply",
    "truediv": "divide",
    "floordiv": "floor_divide",
    "mod": "remainder",
    "pow": "pow",
    "matmul": "matmul",
    "and": "bitwise_and",
    "or": "bitwise_or",
    "xor": "bitwise_xor",
    "lshift": "bitwise_left_shift",
    "rshift": "bitwise_right_shift",
}
COMPARISONS = {
    "eq": "equal",
    "ne": "not_equal",
    "lt": "less",
    "le": "less_equal",
    "gt": "greater",
    "ge": "greater_equal",
}
UNARY_OPERATORS = {"neg": "negative", "pos": "positive", "abs": "abs", "invert": "bitwise_invert"}


# -- output metadata, remembered ----------------------------------------------------------------
_CACHE: dict[Any, list[ops.Meta]] = {}
_CACHE_MAX = 1 << 15


def signature(name: str, metas: tuple[ops.Meta, ...], params: dict[str, Any]) -> Any:
    """What an op's output metadata depends on, as a hashable key; ``None`` if a param is not
    hashable (a list). A Python ``float``/``bool``/``complex`` scalar counts by its type only
    (the ops' rules look at nothing else); an ``int`` by its value too (range checks)."""
    if not params:
        return (name, metas)
    items = []
    for k, v in params.items():
        if k == "scalar" and type(v) is not int:
            v = type(v)
        items.append((k, v))
    key = (name, metas, *items)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def infer(name: str, metas: Sequence[ops.Meta], params: dict[str, Any]) -> list[ops.Meta]:
    """``ops.infer``, remembered per signature (errors are not remembered: they raise again)."""
    metas = tuple(metas)
    key = signature(name, metas, params)
    if key is not None:
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
    out = ops.infer(name, metas, params)
    if key is not None:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = out
    return out
