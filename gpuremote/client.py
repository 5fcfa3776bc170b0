"""The client API: a connection to a proxy (``GPU``), and remote arrays, streams, events and
kernels on top of the GPU API calls.

Calls that bring back no data (creating arrays, uploading, launching, freeing) are plain
methods that return at once with a handle-backed object; only what brings data back or waits
is awaited::

    async with gpuremote.connect("tcp://gpu-box:5151") as gpu:
        a, b = gpu.asarray(x), gpu.asarray(w)
        y = gpu.tanh(gpu.matmul(a, b))
        out = await y.get()

Shapes and dtypes of results are inferred locally (``gpuremote.ops``), handles are chosen by
the client, and the host copy of an upload answers ``get()`` until the device writes the
buffer: none of that costs a round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import weakref
from collections.abc import Generator, Sequence
from typing import Any, overload

import numpy as np

from . import arraycore
from .arraycore import Buffer
from .auth import load_secret, proof
from .calls import CALLS_BY_NAME
from .config import PipelineConfig, pipeline_config, resolve_url, transport_settings
from .errors import (
    AuthenticationError,
    ConfigError,
    LocalProtocolError,
    RemoteProtocolError,
)
from .executor import PROTOCOL_VERSION
from .framing import FrameLimits, byte_view
from .ops import OPS
from .protocol import DTYPES, decode_greeting
from .session import BUFFER, Session
from .transports import Address
from .transports import connect as transport_connect

__all__ = ["GPU", "DeviceBuffer", "Event", "Kernel", "RemoteArray", "Stream", "connect"]

#: the device buffer under a RemoteArray (the array core's, shared with ``gpuremote.xp``)
DeviceBuffer = Buffer

_C = CALLS_BY_NAME
_LAUNCH, _LAUNCH_NEW = _C["launch"], _C["launch_new"]
Scalar = int | float | bool


_NAMES = {dt: name for name, dt in DTYPES.items()}


def _dtype(dtype: Any) -> np.dtype[Any]:
    dt = np.dtype(dtype)
    if dt not in _NAMES:
        raise TypeError(f"dtype {dt} is not supported by gpuremote")
    return dt


def _dtype_name(dt: np.dtype[Any]) -> str:
    return _NAMES.get(dt) or _NAMES[_dtype(dt)]


_CHECKED: set[Any] = set()  # launches whose output metadata was checked already


def _host_bytes(host: np.ndarray[Any, Any]) -> memoryview:
    return byte_view(host)


class Stream:
    """A stream of the session: work on one stream runs in the order it was issued."""

    __slots__ = ("__weakref__", "_gpu", "handle")

    def __init__(self, gpu: GPU, handle: int) -> None:
        self._gpu = gpu
        self.handle = handle

    async def synchronize(self) -> None:
        """Wait until every call issued on this stream has run."""
        await self._gpu._session.call(_C["stream_synchronize"], self.handle, [])

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``."""
        self._gpu._session.submit(_C["event_wait"], self.handle, [event.handle])

    def __repr__(self) -> str:
        return f"<Stream {self.handle}>"


class Event:
    """A marker in a stream's work."""

    __slots__ = ("__weakref__", "_gpu", "handle")

    def __init__(self, gpu: GPU, handle: int) -> None:
        self._gpu = gpu
        self.handle = handle

    def record(self, stream: Stream | None = None) -> None:
        s = self._gpu._stream(stream)
        self._gpu._session.submit(_C["event_record"], s, [self.handle])

    async def query(self) -> bool:
        """Whether the work before the last ``record`` has completed."""
        value, _ = await self._gpu._session.call(_C["event_query"], 0, [self.handle])
        return bool(value)


class Kernel:
    """A user kernel (CuPy ``RawKernel`` or ``ElementwiseKernel`` source), by content hash."""

    def __init__(self, gpu: GPU, handle: int, kind: str, name: str) -> None:
        self._gpu = gpu
        self.handle = handle
        self.kind = kind
        self.name = name

    def __call__(
        self,
        *args: Any,
        grid: Sequence[int] = (1,),
        block: Sequence[int] = (1,),
        stream: Stream | None = None,
    ) -> None:
        """Launch with ``args`` (remote arrays or scalars); raw kernels take ``grid``/``block``."""
        wire: list[Any] = []
        for a in args:
            if isinstance(a, RemoteArray):
                a._buf.invalidate()  # a kernel may write any array it is given
                wire.append(["a", a._desc()])
            elif isinstance(a, np.generic):
                wire.append(["s", a.dtype.name, a.item()])
            elif isinstance(a, bool | int | float):
                wire.append(["s", "int64" if type(a) is int else np.dtype(type(a)).name, a])
            else:
                raise TypeError(f"kernel argument of type {type(a).__name__} is not supported")
        self._gpu._session.submit(
            _C["kernel_launch"],
            self._gpu._stream(stream),
            [self.handle, wire, list(grid), list(block)],
        )


class ArrayMetadata:
    """``ndim``, ``size`` and ``nbytes`` from ``shape`` and ``dtype``: answered locally."""

    __slots__ = ()
    shape: tuple[int, ...]
    dtype: np.dtype[Any]

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
        return self.size * self.dtype.itemsize


class RemoteArray(ArrayMetadata):
    """A C-contiguous array in a device buffer on the proxy.

    ``shape``, ``dtype``, ``size`` and friends are answered locally; ``await get()`` brings
    the data back (or returns the shadow host copy, with no transfer, while it is valid).
    """

    __slots__ = ("__weakref__", "_buf", "_gpu", "_meta", "_wire", "dtype", "offset", "shape")

    def __init__(
        self,
        gpu: GPU,
        buf: DeviceBuffer,
        shape: tuple[int, ...],
        dtype: np.dtype[Any],
        offset: int = 0,
    ) -> None:
        self._gpu = gpu
        self._buf = buf
        self.shape = shape
        self.dtype = dtype
        self.offset = offset
        self._meta = (shape, dtype)
        self._wire = [buf.handle, offset, list(shape), _dtype_name(dtype)]

    # -- metadata (LOCAL) ------------------------------------------------------------------
    @property
    def handle(self) -> int:
        return self._buf.handle

    @property
    def host_valid(self) -> bool:
        """Whether ``get()`` would be answered from the shadow host copy."""
        return self._buf.host is not None and self._gpu.config.shadow

    def _desc(self) -> list[Any]:
        if self._buf.freed:
            raise LocalProtocolError(f"array on buffer {self._buf.handle} used after free")
        return self._wire

    def __repr__(self) -> str:
        return f"<RemoteArray shape={self.shape} dtype={self.dtype} buffer={self._buf.handle}>"

    # -- data ------------------------------------------------------------------------------
    async def get(self, stream: Stream | None = None) -> np.ndarray[Any, Any]:
        """The array's data on the host (a device-to-host copy, unless shadowed)."""
        self._desc()
        session = self._gpu._session
        host = self._buf.host
        if host is not None and self._gpu.config.shadow:
            session.count_local(shadow_bytes=self.nbytes)
            part = host[self.offset : self.offset + self.nbytes]
            return part.view(self.dtype).reshape(self.shape).copy()
        value, bufs = await session.call(_C["copy_d2h"], self._gpu._stream(stream), [self._desc()])
        data = bufs[value]
        return np.frombuffer(data, dtype=self.dtype).reshape(self.shape)

    def set(self, host: Any, stream: Stream | None = None) -> None:
        """Upload ``host`` into this array (ASYNC; ``host`` is copied first, so the caller may
        change it at once)."""
        snap = self._gpu._snapshot(host, self.shape, self.dtype)
        self._gpu._upload(self, snap, stream)

    async def write(self, host: Any, stream: Stream | None = None) -> None:
        """Upload ``host`` without copying it, waiting until the proxy has it (like a blocking
        ``cudaMemcpy``): the way to move large data at full speed."""
        arr = np.ascontiguousarray(host, dtype=self.dtype)
        if arr.shape != self.shape:
            raise ValueError(f"cannot write shape {arr.shape} into an array of {self.shape}")
        self._buf.invalidate()
        await self._gpu._session.ack(
            _C["copy_h2d"], self._gpu._stream(stream), [self._desc(), BUFFER], _host_bytes(arr)
        )

    def reshape(self, *shape: int | Sequence[int]) -> RemoteArray:
        """A view with another shape (LOCAL: no call is sent)."""
        first = shape[0] if len(shape) == 1 else None
        dims = tuple(first) if isinstance(first, Sequence) else tuple(int(d) for d in shape)  # type: ignore[arg-type]
        if -1 in dims:
            known = math.prod(d for d in dims if d != -1)
            dims = tuple(self.size // known if d == -1 else d for d in dims)
        if math.prod(dims) != self.size:
            raise ValueError(f"cannot reshape {self.shape} into {dims}")
        self._gpu._session.count_local()
        return RemoteArray(self._gpu, self._buf, dims, self.dtype, self.offset)

    def free(self) -> None:
        """Free the device buffer now (every view of it becomes unusable)."""
        buf = self._buf
        if buf.detach():
            self._gpu._session.submit(_C["free"], 0, [buf.handle])

    # -- operators -------------------------------------------------------------------------
    @property
    def T(self) -> RemoteArray:
        return self._gpu.transpose(self)

    def __add__(self, other: Any) -> RemoteArray:
        return self._gpu._apply("add", (self, other), {})

    def __radd__(self, other: Any) -> RemoteArray:
        return self._gpu._apply("add", (other, self), {})

    def __sub__(self, other: Any) -> RemoteArray:
        return self._gpu._apply("subtract", (self, other), {})

    def __rsub__(self, other: Any) -> RemoteArray:
        return self._gpu._apply("subtract", (other, self), {})

    def __mul__(self, other: Any) -> RemoteArray:
        return self._gpu._apply("multiply", (self, other), {})

    def __rmul__(self, other: Any) -> RemoteArray:
        return self._gpu._apply("multiply", (other, self), {})

    def __truediv__(self, other: Any) -> RemoteArray:
        return self._gpu._apply("divide", (self, other), {})

    def __rtruediv__(self, other: Any) -> RemoteArray:
        return self._gpu._apply("divide", (other, self), {})

    def __matmul__(self, other: RemoteArray) -> RemoteArray:
        return self._gpu._apply("matmul", (self, other), {})

    def __neg__(self) -> RemoteArray:
        return self._gpu._apply("negative", (self,), {})


ArrayOrScalar = RemoteArray | Scalar


class GPU:
    """A connection to a proxy: the GPU API and an array layer over it.

    Create with ``await gpuremote.connect(url)`` or ``async with gpuremote.connect(url) as gpu``.
    """

    def __init__(self, session: Session, url: str, device: dict[str, Any]) -> None:
        self._session = session
        self.url = url
        self._device = device
        self._current = 0
        self._kernels_sent: set[int] = set()

    # -- LOCAL queries ---------------------------------------------------------------------
    @property
    def config(self) -> PipelineConfig:
        return self._session.config

    @property
    def device(self) -> dict[str, Any]:
        """Device properties, cached at connect (LOCAL)."""
        self._session.count_local()
        return dict(self._device)

    @property
    def backend(self) -> str:
        return str(self._device.get("backend", "?"))

    @property
    def current_stream(self) -> int:
        """The handle of the stream new calls go to (LOCAL)."""
        self._session.count_local()
        return self._current

    def stats(self) -> dict[str, Any]:
        """This session's counters: calls per class, frames, round trips, bytes each way."""
        return self._session.counters.as_dict()

    # -- helpers ---------------------------------------------------------------------------
    def _stream(self, stream: Stream | None) -> int:
        return self._current if stream is None else stream.handle

    def _new_buffer(self, nbytes: int) -> Buffer:
        session = self._session
        buf = Buffer(session.release, session.new_handle(), nbytes)
        session.submit(_C["alloc"], 0, [buf.handle, nbytes])
        return buf

    def _snapshot(
        self, host: Any, shape: tuple[int, ...] | None, dtype: np.dtype[Any] | None
    ) -> np.ndarray[Any, Any]:
        arr = np.array(host, dtype=dtype, order="C", copy=True)
        _dtype(arr.dtype)
        if shape is not None and arr.shape != shape:
            arr = np.ascontiguousarray(np.broadcast_to(arr, shape))
        return arr

    def _upload(self, dst: RemoteArray, snap: np.ndarray[Any, Any], stream: Stream | None) -> None:
        buf = dst._buf
        whole = dst.offset == 0 and dst.nbytes == buf.nbytes
        keep = whole and self.config.shadow and snap.nbytes <= self.config.shadow_max_bytes
        buf.host = snap.reshape(-1).view(np.uint8) if keep else None
        self._session.submit(
            _C["copy_h2d"], self._stream(stream), [dst._desc(), BUFFER], _host_bytes(snap)
        )

    # -- memory and arrays -----------------------------------------------------------------
    def empty(self, shape: int | Sequence[int], dtype: Any = "float32") -> RemoteArray:
        """An uninitialised array (one ASYNC alloc)."""
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        dt = _dtype(dtype)
        return RemoteArray(self, self._new_buffer(math.prod(dims) * dt.itemsize), dims, dt)

    def zeros(self, shape: int | Sequence[int], dtype: Any = "float32") -> RemoteArray:
        out = self.empty(shape, dtype)
        self._session.submit(_C["memset"], self._current, [out.handle, 0, out.nbytes, 0])
        return out

    def full(
        self, shape: int | Sequence[int], value: Scalar, dtype: Any = "float32"
    ) -> RemoteArray:
        dims = [shape] if isinstance(shape, int) else list(shape)
        return self.op("full", value=value, shape=dims, dtype=_dtype(dtype).name)

    def asarray(self, host: Any, dtype: Any = None, stream: Stream | None = None) -> RemoteArray:
        """A remote copy of host data (ASYNC alloc + upload; the data is copied at once, and
        the copy is kept as the shadow host copy)."""
        if isinstance(host, RemoteArray):
            return (
                host
                if dtype is None or np.dtype(dtype) == host.dtype
                else self.op("astype", host, dtype=np.dtype(dtype).name)
            )
        snap = self._snapshot(host, None, None if dtype is None else _dtype(dtype))
        out = RemoteArray(self, self._new_buffer(snap.nbytes), snap.shape, snap.dtype)
        self._upload(out, snap, stream)
        return out

    def copy(self, dst: RemoteArray, src: RemoteArray, stream: Stream | None = None) -> None:
        """Device-to-device copy of ``src`` into ``dst`` (same number of bytes)."""
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
        dst._buf.invalidate()
        self._session.submit(_C["copy_d2d"], self._stream(stream), [dst._desc(), src._desc()])

    def free(self, *arrays: RemoteArray) -> None:
        for a in arrays:
            a.free()

    # -- ops -------------------------------------------------------------------------------
    def launch(
        self,
        op: str,
        inputs: Sequence[RemoteArray],
        outputs: Sequence[RemoteArray],
        stream: Stream | None = None,
        **params: Any,
    ) -> None:
        """Run op ``op`` writing into existing ``outputs`` (the raw GPU-API form)."""
        try:  # launches checked already: the same op, metadata and params again
            key: Any = (op, *[a._meta for a in inputs], None, *[o._meta for o in outputs])
            key += tuple(params.items())
            checked = key in _CHECKED
        except TypeError:  # a list-valued param: not hashable, check every time
            key, checked = None, False
        if not checked:
            metas = arraycore.infer(op, [a._meta for a in inputs], params)
            if len(metas) != len(outputs):
                raise ValueError(f"{op} writes {len(metas)} outputs, {len(outputs)} given")
            for (shape, dt), o in zip(metas, outputs, strict=True):
                if (shape, dt) != o._meta:
                    raise ValueError(f"{op} writes {shape}/{dt}, the output is {o.shape}/{o.dtype}")
            if key is not None:
                if len(_CHECKED) >= 1 << 15:
                    _CHECKED.clear()
                _CHECKED.add(key)
        for o in outputs:
            o._buf.host = None
        self._session.submit(
            _LAUNCH,
            self._current if stream is None else stream.handle,
            [op, [a._desc() for a in inputs], [o._desc() for o in outputs], params],
        )

    def op(
        self,
        name: str,
        *inputs: ArrayOrScalar,
        out: RemoteArray | None = None,
        stream: Stream | None = None,
        **params: Any,
    ) -> RemoteArray:
        """Run allow-listed op ``name`` on ``inputs``; returns its (new, or ``out``) result."""
        return self._apply(name, inputs, params, out, stream)

    def _apply(
        self,
        name: str,
        inputs: Sequence[ArrayOrScalar],
        params: dict[str, Any],
        out: RemoteArray | None = None,
        stream: Stream | None = None,
    ) -> RemoteArray:
        """``op`` without the argument packing: the path every operator takes."""
        spec = OPS.get(name)
        if spec is None:
            raise ValueError(f"unknown op {name!r}; see gpuremote.ops.OPS")
        arrays: list[RemoteArray] = []
        for i, x in enumerate(inputs):
            if type(x) is RemoteArray:
                arrays.append(x)
            elif isinstance(x, bool | int | float | np.generic) and "scalar" in spec.params:
                if i == 0 and len(inputs) == 2:
                    params["reverse"] = True
                params["scalar"] = x.item() if isinstance(x, np.generic) else x
            elif isinstance(x, RemoteArray):
                arrays.append(x)
            else:
                arrays.append(self.asarray(x))
        if out is not None:
            self.launch(name, arrays, [out], stream, **params)
            return out
        metas = arraycore.infer(name, [a._meta for a in arrays], params)
        if len(metas) != 1:
            raise ValueError(f"{name} writes {len(metas)} outputs; use launch()")
        ((shape, dt),) = metas
        wires = [a._desc() for a in arrays]  # raises for a freed input, before anything exists
        session = self._session
        nbytes = dt.itemsize
        for d in shape:
            nbytes *= d
        result = RemoteArray(self, Buffer(session.release, session.new_handle(), nbytes), shape, dt)
        # one command: the proxy allocates the output's buffer and launches
        try:
            session.submit(
                _LAUNCH_NEW,
                self._current if stream is None else stream.handle,
                [name, wires, [result._wire], params],
            )
        except BaseException:
            result._buf.detach()  # never made on the proxy: nothing to free
            raise
        return result

    def matmul(self, a: RemoteArray, b: RemoteArray, **kw: Any) -> RemoteArray:
        return self.op("matmul", a, b, **kw)

    def add(self, a: ArrayOrScalar, b: ArrayOrScalar, **kw: Any) -> RemoteArray:
        return self.op("add", a, b, **kw)

    def subtract(self, a: ArrayOrScalar, b: ArrayOrScalar, **kw: Any) -> RemoteArray:
        return self.op("subtract", a, b, **kw)

    def multiply(self, a: ArrayOrScalar, b: ArrayOrScalar, **kw: Any) -> RemoteArray:
        return self.op("multiply", a, b, **kw)

    def divide(self, a: ArrayOrScalar, b: ArrayOrScalar, **kw: Any) -> RemoteArray:
        return self.op("divide", a, b, **kw)

    def maximum(self, a: ArrayOrScalar, b: ArrayOrScalar, **kw: Any) -> RemoteArray:
        return self.op("maximum", a, b, **kw)

    def exp(self, x: RemoteArray, **kw: Any) -> RemoteArray:
        return self.op("exp", x, **kw)

    def log(self, x: RemoteArray, **kw: Any) -> RemoteArray:
        return self.op("log", x, **kw)

    def tanh(self, x: RemoteArray, **kw: Any) -> RemoteArray:
        return self.op("tanh", x, **kw)

    def relu(self, x: RemoteArray, **kw: Any) -> RemoteArray:
        return self.op("relu", x, **kw)

    def sum(
        self, x: RemoteArray, axis: int | None = None, keepdims: bool = False, **kw: Any
    ) -> RemoteArray:
        return self.op("sum", x, axis=axis, keepdims=keepdims, **kw)

    def mean(
        self, x: RemoteArray, axis: int | None = None, keepdims: bool = False, **kw: Any
    ) -> RemoteArray:
        return self.op("mean", x, axis=axis, keepdims=keepdims, **kw)

    def transpose(
        self, x: RemoteArray, axes: Sequence[int] | None = None, **kw: Any
    ) -> RemoteArray:
        order = list(range(x.ndim))[::-1] if axes is None else list(axes)
        return self.op("permute_dims", x, axes=order, **kw)

    def reshape(self, x: RemoteArray, shape: Sequence[int]) -> RemoteArray:
        return x.reshape(tuple(shape))

    def softmax(self, x: RemoteArray, axis: int = -1, **kw: Any) -> RemoteArray:
        return self.op("softmax", x, axis=axis, **kw)

    def axpy(
        self, alpha: float, x: RemoteArray, y: RemoteArray, stream: Stream | None = None
    ) -> RemoteArray:
        """``y = alpha * x + y`` in place, as one fused launch; returns ``y``."""
        self.launch("axpy", [x, y], [y], stream, alpha=alpha)
        return y

    # -- streams, events, kernels ----------------------------------------------------------
    def stream(self) -> Stream:
        """A new stream (ASYNC, client-chosen handle)."""
        s = Stream(self, self._session.new_handle())
        self._session.submit(_C["stream_create"], 0, [s.handle])
        weakref.finalize(s, self._destroy, "stream_destroy", s.handle)
        return s

    @contextlib.contextmanager
    def use_stream(self, stream: Stream) -> Generator[Stream, None, None]:
        """Make ``stream`` the current stream inside a ``with`` block."""
        previous, self._current = self._current, stream.handle
        try:
            yield stream
        finally:
            self._current = previous

    def event(self) -> Event:
        ev = Event(self, self._session.new_handle())
        self._session.submit(_C["event_create"], 0, [ev.handle])
        weakref.finalize(ev, self._destroy, "event_destroy", ev.handle)
        return ev

    def _destroy(self, call: str, handle: int) -> None:
        if not self._session.closed:
            with contextlib.suppress(Exception):
                self._session.submit(_C[call], 0, [handle])

    def kernel(
        self,
        source: str,
        name: str,
        *,
        kind: str = "raw",
        in_params: str = "",
        out_params: str = "",
    ) -> Kernel:
        """A user kernel: CuPy ``RawKernel`` source (``kind="raw"``) or ``ElementwiseKernel``
        operation (``kind="elementwise"``). Sent once; later uses refer to its content hash.
        Needs the cupy backend."""
        if self.backend != "cupy":
            raise LocalProtocolError(
                f"user kernels need the cupy backend; the proxy at {self.url} runs {self.backend}"
            )
        params = {"in_params": in_params, "out_params": out_params} if kind == "elementwise" else {}
        digest = hashlib.sha256(repr((kind, name, source, sorted(params.items()))).encode())
        handle = int.from_bytes(digest.digest()[:8], "little") >> 1
        if handle in self._kernels_sent and self.config.shadow:
            self._session.count_local()
        else:
            self._session.submit(_C["kernel_create"], 0, [handle, kind, name, source, params])
            self._kernels_sent.add(handle)
        return Kernel(self, handle, kind, name)

    # -- SYNC ------------------------------------------------------------------------------
    async def synchronize(self) -> None:
        """Wait until every call of this session has run; raises deferred errors."""
        await self._session.call(_C["device_synchronize"], 0, [])

    async def flush(self, wait: bool = False) -> None:
        """Send the queued calls now; with ``wait``, also wait for them (and their errors)."""
        await self._session.flush(wait=wait)

    async def ping(self, payload: bytes | memoryview | np.ndarray[Any, Any] = b"") -> memoryview:
        """Round trip ``payload`` through the proxy (the full path); returns the echo."""
        data = payload if isinstance(payload, memoryview) else memoryview(payload)  # type: ignore[arg-type]
        value, bufs = await self._session.call(_C["ping"], 0, [BUFFER], data.cast("B"))
        return bufs[value]

    async def proxy_stats(self) -> dict[str, Any]:
        """The proxy's figures for this session (buffers, bytes held, calls, bytes each way)."""
        value, _ = await self._session.call(_C["stats"], 0, [])
        return dict(value)

    async def aclose(self) -> None:
        """Send what is queued and close the connection."""
        await self._session.aclose()

    async def __aenter__(self) -> GPU:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Connector:
    """``await connect(...)`` or ``async with connect(...) as gpu``."""

    def __init__(
        self,
        url: str | None,
        pipeline: PipelineConfig | None,
        options: dict[str, Any],
        limits: FrameLimits,
    ) -> None:
        self._url = url
        self._pipeline = pipeline
        self._options = options
        self._limits = limits
        self._gpu: GPU | None = None

    async def _open(self) -> GPU:
        url = resolve_url(self._url)
        options = dict(self._options)
        if url.startswith(POOL_SCHEME):  # a pool on Ray: its least-loaded proxy
            from .ray import place

            (url,), options["secret"] = await place(pool_name(url), 1)
        return await _open_session(url, options, self._pipeline, self._limits)

    def __await__(self) -> Generator[Any, None, GPU]:
        return self._open().__await__()

    async def __aenter__(self) -> GPU:
        self._gpu = await self._open()
        return self._gpu

    async def __aexit__(self, *exc: object) -> None:
        if self._gpu is not None:
            await self._gpu.aclose()


class _ManyConnector:
    """``await connect("pool://NAME", devices=k)``: sessions on ``k`` different proxies."""

    def __init__(
        self,
        url: str,
        k: int,
        pipeline: PipelineConfig | None,
        options: dict[str, Any],
        limits: FrameLimits,
    ) -> None:
        self._url, self._k = url, k
        self._pipeline, self._options, self._limits = pipeline, options, limits
        self._gpus: list[GPU] = []

    async def _open(self) -> list[GPU]:
        from .ray import place

        urls, secret = await place(pool_name(self._url), self._k)
        options = {**self._options, "secret": secret}
        gpus: list[GPU] = []
        try:
            for u in urls:
                gpus.append(await _open_session(u, options, self._pipeline, self._limits))
        except BaseException:
            for g in gpus:
                await g.aclose()
            raise
        return gpus

    def __await__(self) -> Generator[Any, None, list[GPU]]:
        return self._open().__await__()

    async def __aenter__(self) -> list[GPU]:
        self._gpus = await self._open()
        return self._gpus

    async def __aexit__(self, *exc: object) -> None:
        for g in self._gpus:
            await g.aclose()


#: ``pool://NAME``: a pool of proxies on Ray (``gpuremote.ray``)
POOL_SCHEME = "pool://"


def pool_name(url: str) -> str:
    """The pool's name in ``pool://NAME``."""
    name = url[len(POOL_SCHEME) :].strip("/")
    if not name or "/" in name or "?" in name:
        raise ConfigError(f"{url!r}: a pool URL is pool://NAME")
    return name


async def _open_session(
    url: str, options: dict[str, Any], pipeline: PipelineConfig | None, limits: FrameLimits
) -> GPU:
    """Connect, authenticate and say hello at ``url``."""
    options = dict(options)
    secret = load_secret(options.pop("secret", None))
    timeout = options.pop("connect_timeout", 10.0)
    cfg = pipeline or pipeline_config(options)
    settings = transport_settings(Address.parse(url).scheme)
    conn = await transport_connect(url, limits, settings)
    try:
        greeting = decode_greeting(await asyncio.wait_for(conn.recv(), timeout))
    except BaseException:
        conn.close()
        raise
    answer = ""
    if greeting["auth"]:
        if secret is None:
            conn.close()
            raise AuthenticationError(
                f"the proxy at {url} requires a shared secret: pass secret=..., or set "
                "GPUREMOTE_SECRET, GPUREMOTE_SECRET_FILE or [auth] in gpuremote.toml"
            )
        answer = proof(secret, greeting["nonce"])
    session = Session(conn, cfg)
    try:
        info, _ = await asyncio.wait_for(
            session.call(_C["hello"], 0, [PROTOCOL_VERSION, answer]), timeout
        )
    except RemoteProtocolError as exc:
        await session.aclose()
        if "authentication failed" in str(exc):
            raise AuthenticationError(f"the proxy at {url} refused the secret") from None
        raise
    except BaseException:
        await session.aclose()
        raise
    return GPU(session, url, dict(info))


@overload
def connect(
    url: str | None = None,
    *,
    devices: None = None,
    pipeline: PipelineConfig | None = None,
    limits: FrameLimits = FrameLimits(),
    **options: Any,
) -> _Connector: ...


@overload
def connect(
    url: str | None = None,
    *,
    devices: int,
    pipeline: PipelineConfig | None = None,
    limits: FrameLimits = FrameLimits(),
    **options: Any,
) -> _ManyConnector: ...


def connect(
    url: str | None = None,
    *,
    devices: int | None = None,
    pipeline: PipelineConfig | None = None,
    limits: FrameLimits = FrameLimits(),
    **options: Any,
) -> _Connector | _ManyConnector:
    """Connect to the proxy at ``url`` (else ``GPUREMOTE_URL``, else the config file, else
    the default). ``options`` override pipeline settings (``async_calls``, ``batching``,
    ``shadow``, ``max_batch_calls``, ``max_batch_bytes``, ``flush_delay_us``, ``spin_us``,
    ``call_timeout_s``), and take
    ``secret=`` (the shared secret, when the proxy requires one) and ``connect_timeout=``.

    ``pool://NAME`` is a pool of proxies on Ray (``gpuremote.ray``; this process must be
    attached to the cluster): the session goes to its least-loaded live proxy, and with
    ``devices=k`` there are ``k`` sessions on ``k`` different proxies (a list of ``GPU``)."""
    if devices is None:
        return _Connector(url, pipeline, options, limits)
    target = resolve_url(url)
    if not target.startswith(POOL_SCHEME):
        raise ConfigError(f"devices= needs a pool:// URL, not {target!r}")
    if devices < 1:
        raise ValueError("devices must be at least 1")
    return _ManyConnector(target, devices, pipeline, options, limits)
