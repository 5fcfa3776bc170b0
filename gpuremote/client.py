"""The async front end: a connection to a proxy (``GPU``), and remote arrays, streams, events
and kernels on top of the GPU API calls.

Calls that bring back no data (creating arrays, uploading, launching, freeing) are plain
methods that return at once with a handle-backed object; only what brings data back or waits
is awaited::

    async with gpuremote.connect("tcp://gpu-box:5151") as gpu:
        a, b = gpu.asarray(x), gpu.asarray(w)
        y = gpu.tanh(gpu.matmul(a, b))
        out = await y.get()

The arrays are the array core's (``gpuremote.core.arrays``, shared with ``gpuremote.xp``): this
module only says how to wait (``await``). Sessions are opened by ``gpuremote.session.opener``
and used through their contract (``gpuremote.session.contract.Session``).
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any, overload

import numpy as np

from .config import PipelineConfig
from .core.arrays import (
    BINARY_OPERATORS,
    UNARY_OPERATORS,
    ArrayRef,
    Buffer,
    Call,
    Core,
    HostCopies,
    drive,
    fill_param,
    kernel_arg,
    supported_dtype,
)
from .core.capture import Step
from .errors import LocalProtocolError
from .ops import OPS
from .session import opener
from .session.contract import Reply, Session
from .wire.calls import BUFFER, CALLS_BY_NAME
from .wire.framing import FrameLimits, as_bytes_view

__all__ = ["GPU", "DeviceBuffer", "Event", "Kernel", "RemoteArray", "Stream", "connect"]

#: the device buffer under a RemoteArray (the array core's, shared with ``gpuremote.xp``)
DeviceBuffer = Buffer

_C = CALLS_BY_NAME
Scalar = int | float | bool


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
        self._gpu._core.post(_C["event_wait"], self.handle, [event.handle], None)

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
        self._gpu._core.post(_C["event_record"], s, [self.handle], None)

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
                self._gpu._core.written(a._buf)  # a kernel may write any array it is given
                wire.append(["a", a._desc()])
            else:
                wire.append(kernel_arg(a))
        self._gpu._core.post(
            _C["kernel_launch"],
            self._gpu._stream(stream),
            [self.handle, wire, list(grid), list(block)],
            None,
        )


def _binary(name: str, reflected: bool = False) -> Callable[[RemoteArray, Any], RemoteArray]:
    """The method of binary operator ``__name__`` (``__rname__`` if ``reflected``): the op
    the core's table gives it, on the GPU's current stream."""
    op = BINARY_OPERATORS[name]

    def method(self: RemoteArray, other: Any) -> RemoteArray:
        core = self._core
        inputs = (other, self) if reflected else (self, other)
        return core.apply(op, inputs, {}, None, core.owner._current)

    method.__name__ = f"__{'r' if reflected else ''}{name}__"
    return method


def _unary(name: str) -> Callable[[RemoteArray], RemoteArray]:
    """The method of unary operator ``__name__``, on the GPU's current stream."""
    op = UNARY_OPERATORS[name]

    def method(self: RemoteArray) -> RemoteArray:
        return self._core.apply(op, (self,), {}, None, self._core.owner._current)

    method.__name__ = f"__{name}__"
    return method


class RemoteArray(ArrayRef):
    """A C-contiguous array in a device buffer on the proxy (the async front end's array).

    ``shape``, ``dtype``, ``size`` and friends are answered locally; ``await get()`` brings
    the data back (or returns the kept host copy, with no transfer, while it is valid).
    """

    __slots__ = ()

    @property
    def dtype(self) -> np.dtype[Any]:
        """The array's NumPy dtype."""
        return self._dtype

    @property
    def _gpu(self) -> GPU:
        gpu: GPU = self._core.owner
        return gpu

    @property
    def host_valid(self) -> bool:
        """Whether ``get()`` would be answered from the kept host copy."""
        return self._buf.host is not None and self._core.copies.enabled

    def __repr__(self) -> str:
        return f"<RemoteArray shape={self.shape} dtype={self.dtype} buffer={self._buf.handle}>"

    # -- data ------------------------------------------------------------------------------
    async def get(self, stream: Stream | None = None) -> np.ndarray[Any, Any]:
        """The array's data on the host (a device-to-host copy, unless a host copy is kept)."""
        core = self._core
        host = core.cached(self)
        if host is not None:
            return host
        gpu: GPU = core.owner
        (_, spec, s, args, buf), writes = core.download(self, gpu._stream(stream))
        return core.downloaded(self, await gpu._session.call(spec, s, args, buf), writes)

    def set(self, host: Any, stream: Stream | None = None) -> None:
        """Upload ``host`` into this array (ASYNC; ``host`` is copied first, so the caller may
        change it at once)."""
        core = self._core
        core.write(self, core.snapshot(host, self._dtype, self.shape), self._gpu._stream(stream))

    async def write(self, host: Any, stream: Stream | None = None) -> None:
        """Upload ``host`` without copying it, waiting until the proxy has it (like a blocking
        ``cudaMemcpy``): the way to move large data at full speed."""
        args, data = self._core.borrow(self, host)
        gpu = self._gpu
        await gpu._session.ack(_C["copy_h2d"], gpu._stream(stream), args, data)

    def reshape(self, *shape: int | Sequence[int]) -> RemoteArray:
        """A view with another shape (LOCAL: no call is sent)."""
        dims: Sequence[Any] = shape
        if len(shape) == 1 and isinstance(shape[0], Sequence):
            dims = shape[0]
        out: RemoteArray = self._core.reshape(self, dims)
        return out

    async def to_device(self, gpu: GPU) -> RemoteArray:
        """A copy of this array on ``gpu``'s proxy: proxy to proxy where that proxy can reach
        this one's, else through the client (``gpu.last_copy`` says which)."""
        if gpu is self._gpu:
            return self
        out, gpu.last_copy = await drive(self._core.to_device(self, gpu._core), _call)
        return out

    def free(self) -> None:
        """Free the device buffer now (every view of it becomes unusable)."""
        self._core.free(self)

    # -- operators (generated from the core's tables: ``_binary``, ``_unary``) ---------------
    @property
    def T(self) -> RemoteArray:
        return self._gpu.transpose(self)

    __add__, __radd__ = _binary("add"), _binary("add", reflected=True)
    __sub__, __rsub__ = _binary("sub"), _binary("sub", reflected=True)
    __mul__, __rmul__ = _binary("mul"), _binary("mul", reflected=True)
    __truediv__, __rtruediv__ = _binary("truediv"), _binary("truediv", reflected=True)
    __matmul__ = _binary("matmul")
    __neg__ = _unary("neg")


ArrayOrScalar = RemoteArray | Scalar


async def _call(request: Call) -> Reply:
    """A call of an array core procedure, made on its GPU's session (``drive``)."""
    core, spec, stream, args, buf = request
    gpu: GPU = core.owner
    return await gpu._session.call(spec, stream, args, buf)


class GPU:
    """A connection to a proxy: the GPU API and an array layer over it.

    Create with ``await gpuremote.connect(url)`` or ``async with gpuremote.connect(url) as gpu``.
    """

    def __init__(self, session: Session, url: str, device: dict[str, Any]) -> None:
        self._session = session
        self._url = url
        self._device = device
        self._current = 0
        self._kernels_sent: set[int] = set()
        cfg = session.config
        self._core = Core(
            self,
            session,
            session.submit,
            session.release,
            RemoteArray,
            HostCopies(cfg.shadow, cfg.shadow_max_bytes),
        )
        #: how the last ``to_device`` onto this GPU went: "proxy to proxy" or "through the
        #: client (why)"
        self.last_copy = ""

    # -- LOCAL queries ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The URL of the proxy serving this session (with failover: the current one)."""
        return self._session.url or self._url

    @property
    def session(self) -> Session:
        """The session under this GPU (``gpuremote.session.contract.Session``; with
        ``failover``, a ``gpuremote.session.failover.FailoverSession``)."""
        return self._session

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
        """This session's counters: calls per class, frames, round trips, bytes each way
        (with failover: ``failovers``, ``pause_s``, ``checkpoints``, ``checkpoint_bytes``)."""
        return self._session.counters.as_dict()

    # -- helpers ---------------------------------------------------------------------------
    def _stream(self, stream: Stream | None) -> int:
        return self._current if stream is None else stream.handle

    # -- memory and arrays -----------------------------------------------------------------
    def empty(self, shape: int | Sequence[int], dtype: Any = "float32") -> RemoteArray:
        """An uninitialised array (one ASYNC alloc)."""
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        return self._core.empty(dims, supported_dtype(dtype))

    def zeros(self, shape: int | Sequence[int], dtype: Any = "float32") -> RemoteArray:
        out = self.empty(shape, dtype)
        self._core.post(_C["memset"], self._current, [out.handle, 0, out.nbytes, 0], None)
        return out

    def full(
        self, shape: int | Sequence[int], value: Scalar, dtype: Any = "float32"
    ) -> RemoteArray:
        dims = [shape] if isinstance(shape, int) else list(shape)
        dt = supported_dtype(dtype)
        return self.op("full", value=fill_param(dt, value), shape=dims, dtype=dt.name)

    def asarray(self, host: Any, dtype: Any = None, stream: Stream | None = None) -> RemoteArray:
        """A remote copy of host data (ASYNC alloc + upload; the data is copied at once, and
        the copy is kept as the host copy, within ``shadow_max_bytes``)."""
        if isinstance(host, RemoteArray):
            return (
                host
                if dtype is None or np.dtype(dtype) == host.dtype
                else self.op("astype", host, dtype=np.dtype(dtype).name)
            )
        return self._core.upload(host, dtype, self._stream(stream))

    def copy(self, dst: RemoteArray, src: RemoteArray, stream: Stream | None = None) -> None:
        """Device-to-device copy of ``src`` into ``dst`` (same number of bytes)."""
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
        self._core.written(dst._buf)
        self._core.post(_C["copy_d2d"], self._stream(stream), [dst._desc(), src._desc()], None)

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
        self._core.launch(op, inputs, params, outputs, self._stream(stream))

    def op(
        self,
        name: str,
        *inputs: ArrayOrScalar,
        out: RemoteArray | None = None,
        stream: Stream | None = None,
        **params: Any,
    ) -> RemoteArray:
        """Run allow-listed op ``name`` on ``inputs``; returns its (new, or ``out``) result."""
        if name not in OPS:
            raise ValueError(f"unknown op {name!r}; see gpuremote.ops.OPS")
        return self._core.apply(name, inputs, params, out, self._stream(stream))

    async def launch_dynamic(
        self, name: str, *inputs: RemoteArray, n_out: int = 1, **params: Any
    ) -> list[RemoteArray]:
        """Run op ``name`` whose output shapes depend on the data (``nonzero``, ``unique_*``,
        ``getitem_mask``, ...): one SYNC call; returns its ``n_out`` new arrays."""
        outs: list[RemoteArray] = await drive(
            self._core.dynamic(name, inputs, params, n_out), _call
        )
        return outs

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
        self._core.post(_C["stream_create"], 0, [s.handle], None)
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
        self._core.post(_C["event_create"], 0, [ev.handle], None)
        weakref.finalize(ev, self._destroy, "event_destroy", ev.handle)
        return ev

    def _destroy(self, call: str, handle: int) -> None:
        if not self._session.closed:
            with contextlib.suppress(Exception):
                self._session.submit(_C[call], 0, [handle])

    def capture(self, fn: Callable[..., Any]) -> Step:
        """``fn`` (which issues this GPU's calls and returns arrays, or nothing) captured:
        the first call for each signature (shapes, dtypes, static values, the current
        stream) records and runs; later ones replay it on the proxy with one message
        (see ``gpuremote.core.capture``)."""
        return Step(self._core, fn, stream=lambda: self._current)

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
            self._core.post(_C["kernel_create"], 0, [handle, kind, name, source, params], None)
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
        data = as_bytes_view(payload)  # one flat view of its bytes, however it is shaped
        value, bufs = await self._session.call(_C["ping"], 0, [BUFFER], data)
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


async def _open_gpu(
    url: str | None,
    options: dict[str, Any],
    pipeline: PipelineConfig | None,
    limits: FrameLimits,
) -> GPU:
    session, info = await opener.open(url, pipeline=pipeline, limits=limits, **options)
    return GPU(session, session.url, info)


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

    def __await__(self) -> Generator[Any, None, GPU]:
        return _open_gpu(self._url, self._options, self._pipeline, self._limits).__await__()

    async def __aenter__(self) -> GPU:
        self._gpu = await self
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
        urls, options = await opener.devices(self._url, self._k, self._options)
        gpus: list[GPU] = []
        try:
            for u in urls:
                gpus.append(await _open_gpu(u, options, self._pipeline, self._limits))
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
    ``shadow``, ``shadow_max_bytes``, ``max_batch_calls``, ``max_batch_bytes``,
    ``flush_delay_us``, ``spin_us``, ``call_timeout_s``), and take
    ``secret=`` (the shared secret, when the proxy requires one) and ``connect_timeout=``.

    ``pool://NAME`` is a pool of proxies on Ray (``gpuremote.pool``; this process must be
    attached to the cluster): the session goes to its least-loaded live proxy, and with
    ``devices=k`` there are ``k`` sessions on ``k`` different proxies (a list of ``GPU``).

    ``failover=True`` (a pool) or ``failover=[url, ...]`` (other proxies): the session
    survives the loss of its proxy: it moves to another, with its arrays (see
    ``gpuremote.session.failover``; tuning: ``checkpoint_interval_s``, ``journal_max_bytes``,
    ``journal_max_calls``, ``failover_timeout_s``)."""
    if devices is None:
        return _Connector(url, pipeline, options, limits)
    return _ManyConnector(opener.group(url, devices, options), devices, pipeline, options, limits)
