"""A simulated GPU for machines without one: NumPy memory, but a device queue per stream.

Launches, copies and memsets return at once; each stream's work runs later, in order, on a
thread of its own (the stream's "device"), optionally taking ``op_us`` more per op (a kernel's
duration). ``synchronize`` and ``to_host`` wait for the stream's earlier work, events complete
when the work before them has, and ``wait_event`` makes a stream wait for another's event: the
timing behaviour of a CUDA device, so that whatever would block the proxy on a GPU blocks it
here too. ``--backend sim`` or ``sim:op_us=50``; ``sim:check`` adds the checker of
``simcheck`` (options combine: ``sim:check,op_us=50``).

``sim:a100`` (``v100``, ``h100``; ``gpuremote.backends.profiles``) times the device as that GPU
would: each op, copy and memset is stamped, when it is queued, with its completion time on a
virtual clock per stream (``max(now, the stream's previous completion) + its roofline time``),
and only the calls that wait for the device (``synchronize``, ``to_host``, events) wait, until
that time, polling the clock in the thread that waits anyway. Nothing sleeps per op, and no
thread spins while another of its process needs the GIL unless it is itself waiting.
``compute=0`` (``sim:a100,compute=0``) is timing only: ops and copies take their simulated
time and nothing else, results are not computed (array contents are undefined), so that the
host's own arithmetic does not add to the device's time.
"""

from __future__ import annotations

import mmap
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import BackendError, DeviceInfo, OpRun
from .numpy_backend import NumpyBackend
from .profiles import PROFILES, DeviceProfile, copy_time, op_time, work_time
from .torch_runtime import TorchRuntime

__all__ = ["SimBackend", "SimOptions"]

_STOP = object()
#: a wait longer than this sleeps first, to this much before its deadline (a sleep overshoots
#: by ~90 µs here, see shared/notes/timing.md), then polls the clock
_SLEEP_MARGIN_S = 300e-6


def wait_until(deadline: float) -> float:
    """Return at ``deadline`` (``time.perf_counter()`` seconds), to a fraction of a µs;
    returns how long it waited."""
    t0 = now = time.perf_counter()
    if deadline - now > 2 * _SLEEP_MARGIN_S:
        time.sleep(deadline - now - _SLEEP_MARGIN_S)
    while now < deadline:
        now = time.perf_counter()
    return max(0.0, now - t0)


class _Stream:
    """One stream's device: a thread running queued work in order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._queued = 0  # jobs put and not yet finished
        self.ready_at = 0.0  # with a profile: when the device finishes what was queued
        self.queued_s = 0.0  # with a profile: device time queued on it so far
        self.error: BaseException | None = None  # the first failure, raised at the next wait
        self._thread = threading.Thread(target=self._device, name="gpuremote-sim", daemon=True)
        self._thread.start()

    def put(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._queued += 1
        self._jobs.put(job)

    def _device(self) -> None:
        np.seterr(all="ignore")  # IEEE results (inf, nan), as on a GPU; this thread only
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            try:
                job()
            except BaseException as exc:  # an asynchronous device error: sticky
                if self.error is None:
                    self.error = exc
            with self._cond:
                self._queued -= 1
                if self._queued == 0:
                    self._cond.notify_all()

    def wait(self) -> None:
        """Until every job put so far has run; raises the stream's first error."""
        with self._cond:
            while self._queued:
                self._cond.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise BackendError(f"device error on a stream: {type(error).__name__}: {error}")

    @property
    def busy(self) -> bool:
        return self._queued > 0

    def stop(self) -> None:
        self._jobs.put(_STOP)


class _Event:
    """An event on the simulated device: done once the work before it ran, at its device time."""

    __slots__ = ("at", "done")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.done.set()  # never recorded: complete, as cudaEventQuery says
        self.at = 0.0  # with a profile: when the work before it completes


class SimBackend(NumpyBackend):
    """A device with a queue per stream (see the module docstring)."""

    name = "sim"
    queues_work = True

    def __init__(
        self, op_us: float = 0.0, profile: DeviceProfile | None = None, compute: bool = True
    ) -> None:
        super().__init__()
        if op_us < 0:
            raise BackendError(f"sim: op_us must be >= 0, not {op_us}")
        self.op_s = op_us / 1e6
        self.profile = profile
        self.compute = compute
        self.queued_s = 0.0  # simulated device time queued so far (with a profile)
        self.waited_s = 0.0  # time spent waiting for the simulated device so far

    def device_info(self) -> DeviceInfo:
        p = self.profile
        note = f"op_us={self.op_s * 1e6:g}" if p is None else f"profile={p.name}"
        if not self.compute:
            note += ", timing only (results not computed)"
        return DeviceInfo(
            backend=self.name if p is None else f"{self.name}:{p.name}",
            device="simulated device (NumPy memory, a queue per stream)"
            if p is None
            else p.description,
            total_memory=0 if p is None else p.memory,
            compute_capability="",
            note=note,
        )

    def timing(self) -> tuple[float, float]:
        return self.queued_s, self.waited_s

    def alloc(self, nbytes: int, stream: Any = None) -> Any:
        """Zeroed memory, the buffer's own; timing only, a large one mapped from the kernel
        (its pages zero, none touched: nothing is computed there). ``np.zeros`` would take
        them from the C heap, where freed buffers go back, and clear them: at real sizes
        that cost more than the ops (17% of a ResNet-18 step's samples)."""
        if self.compute or self.profile is None or nbytes < _MAPPED:
            return super().alloc(nbytes, stream)
        try:
            return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
        except (OSError, ValueError, OverflowError):
            raise BackendError(f"out of memory allocating {nbytes} bytes") from None

    # -- the virtual clock (with a profile) -------------------------------------------------
    def stream_time(self, stream: Any) -> float:
        return float(stream.queued_s)

    def elapse(self, stream: Any, seconds: float) -> None:
        if self.profile is not None:
            self._stamp(stream, seconds)

    def _stamp(self, stream: Any, seconds: float) -> None:
        """Queue ``seconds`` of device time on ``stream``'s clock."""
        stream.ready_at = max(time.perf_counter(), stream.ready_at) + seconds
        stream.queued_s += seconds
        self.queued_s += seconds

    def _put(self, stream: Any, job: Callable[[], None], seconds: float) -> None:
        if self.profile is not None:
            self._stamp(stream, seconds)
            if not self.compute:
                return
        stream.put(job)

    def _wait(self, stream: Any) -> None:
        """Until ``stream``'s queued work has run, and (with a profile) its clock says so."""
        stream.wait()
        if self.profile is not None:
            self.waited_s += wait_until(stream.ready_at)

    def adopt_host(self, host: np.ndarray[Any, Any]) -> Any | None:
        # with a profile every upload is a timed copy: never adopted
        return None if self.profile is not None else super().adopt_host(host)

    def _work(self) -> None:
        if self.op_s:
            time.sleep(self.op_s)

    # -- queued work -----------------------------------------------------------------------
    def _copy_s(self, nbytes: int, kind: str) -> float:
        return 0.0 if self.profile is None else copy_time(self.profile, nbytes, kind)

    def from_host(self, dst: Any, src: np.ndarray[Any, Any], stream: Any) -> None:
        self._put(
            stream, lambda: np.copyto(dst, src, casting="no"), self._copy_s(src.nbytes, "h2d")
        )

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        self._put(
            stream, lambda: np.copyto(dst, src, casting="no"), self._copy_s(src.nbytes, "d2d")
        )

    def memset(self, buf: Any, offset: int, nbytes: int, value: int, stream: Any) -> None:
        def job() -> None:
            buf[offset : offset + nbytes] = value

        self._put(stream, job, self._copy_s(nbytes, "memset"))

    def run_op(
        self, op: Any, ins: Sequence[Any], outs: Sequence[Any], params: dict[str, Any], stream: Any
    ) -> None:
        def job() -> None:
            op.run(np, ins, outs, params)
            self._work()

        self._put(stream, job, self._op_s(op, ins, outs, params))

    def run_ops(self, runs: Sequence[OpRun], stream: Any) -> None:
        batch = tuple(runs)  # one job: the stream's device runs them in order

        def job() -> None:
            for op, ins, outs, params in batch:
                op.run(np, ins, outs, params)
                self._work()

        self._put(stream, job, sum(self._op_s(*run) for run in batch))

    def torch_runtime(self) -> TorchRuntime:
        return SimTorchRuntime(self)

    def _op_s(self, op: Any, ins: Sequence[Any], outs: Sequence[Any], params: Any) -> float:
        """An op's device time under the profile (0 without one)."""
        if self.profile is None:
            return 0.0
        return op_time(
            self.profile,
            op.name,
            [(x.shape, x.dtype) for x in ins],
            [(x.shape, x.dtype) for x in outs],
            params,
        )

    # -- waiting ---------------------------------------------------------------------------
    def to_host(self, src: Any, stream: Any) -> np.ndarray[Any, Any]:
        if self.profile is not None:
            self._stamp(stream, self._copy_s(src.nbytes, "d2h"))
        self._wait(stream)
        return np.array(src, copy=True)

    def run_dynamic(
        self, op: Any, ins: Sequence[Any], params: dict[str, Any], stream: Any, budget: int
    ) -> list[Any]:
        self._wait(stream)
        self._work()
        outs = super().run_dynamic(op, ins, params, stream, budget)
        if self.profile is not None:  # the op itself, then its results' sizes come back
            self._stamp(
                stream,
                op_time(
                    self.profile,
                    op.name,
                    [(x.shape, x.dtype) for x in ins],
                    [(x.shape, x.dtype) for x in outs],
                    params,
                ),
            )
            self._wait(stream)
        return outs

    def create_stream(self) -> Any:
        return _Stream()

    def destroy_stream(self, stream: Any) -> None:
        try:
            stream.wait()  # its work finishes first, as cudaStreamDestroy lets it
        except BackendError:
            pass
        finally:
            stream.stop()

    def synchronize(self, stream: Any) -> None:
        self._wait(stream)

    def create_event(self) -> Any:
        return _Event()

    def record_event(self, event: Any, stream: Any) -> None:
        event.at = max(time.perf_counter(), stream.ready_at)
        if self.profile is not None and not self.compute:
            return
        event.done.clear()
        stream.put(event.done.set)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.ready_at = max(stream.ready_at, event.at)
        if self.profile is not None and not self.compute:
            return
        stream.put(event.done.wait)

    def query_event(self, event: Any) -> bool:
        if self.profile is not None and time.perf_counter() < event.at:
            return False
        return bool(event.done.is_set())


#: timing only: buffers of this many bytes or more are mapped from the kernel
_MAPPED = 1 << 16


@dataclass(frozen=True)
class SimOptions:
    """The options of a ``sim`` backend spec: ``sim``, ``sim:op_us=50``, ``sim:check``,
    ``sim:check,op_us=50``, ``sim:a100``, ``sim:a100,compute=0`` (in any order)."""

    #: each op takes this many microseconds more on its stream (a kernel's duration)
    op_us: float = 0.0
    #: the checker (``gpuremote.backends.simcheck``): pool with poisoning, race detector
    check: bool = False
    #: a device profile (``gpuremote.backends.profiles``): device time by roofline
    profile: DeviceProfile | None = None
    #: with a profile, ``False``: timing only, results not computed
    compute: bool = True

    @classmethod
    def parse(cls, spec: str) -> SimOptions:
        """The options of ``spec`` (``sim`` or ``sim:OPTION,...``); raises ``BackendError``."""
        name, _, rest = spec.partition(":")
        if name != "sim":
            raise BackendError(f"not a sim backend spec: {spec!r}")
        values: dict[str, Any] = {}
        for item in filter(None, (i.strip() for i in rest.split(","))):
            key, eq, value = item.partition("=")
            field = "profile" if key in PROFILES and not eq else key
            if field in values:
                raise BackendError(f"sim: {field} is given twice in {spec!r}")
            if key == "check" and not eq:
                values["check"] = True
            elif field == "profile":
                values["profile"] = PROFILES[key]
            elif key == "compute" and value in ("0", "1"):
                values["compute"] = value == "1"
            elif key == "op_us" and eq:
                try:
                    values["op_us"] = float(value)
                except ValueError:
                    raise BackendError(f"sim: op_us={value!r} is not a number") from None
            else:
                raise BackendError(
                    f"sim takes check, op_us=<microseconds>, a device profile "
                    f"({', '.join(PROFILES)}) and compute=0|1 (sim:check,op_us=50; "
                    f"sim:a100,compute=0), not {item!r}"
                )
        options = cls(**values)
        if not options.compute and options.profile is None:
            raise BackendError("sim: compute=0 needs a device profile (e.g. sim:a100,compute=0)")
        if options.check and options.profile is not None:
            raise BackendError("sim: check and a device profile do not combine (yet)")
        return options


class SimTorchRuntime(TorchRuntime):
    """PyTorch on the simulated device: ops run on its stream's worker, in order with the
    rest, and take the time its profile gives their work (FLOPs, bytes moved)."""

    adopts_later = False  # (each made at once: the device's workers copy and time them)

    def run(
        self,
        job: Callable[[], Any],
        reads: Sequence[Any],
        writes: Sequence[Any],
        stream: Any,
        wait: bool = False,
    ) -> Any:
        stream.wait()  # the work queued before has run (its data), not the simulated clock
        result = job()
        if wait:  # the answer goes to the host: when the simulated device has got there
            self.backend._wait(stream)
        return result

    def work(self, stream: Any, flops: float, nbytes: float, dtype: Any) -> None:
        profile = self.backend.profile
        if profile is not None:  # element-wise work: an op per element moved, at most
            work = flops if flops else nbytes / max(1, getattr(dtype, "itemsize", 4))
            self.backend._stamp(stream, work_time(profile, work, nbytes, dtype, bool(flops)))
