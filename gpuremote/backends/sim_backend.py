"""A simulated GPU for machines without one: NumPy memory, but a device queue per stream.

Launches, copies and memsets return at once; each stream's work runs later, in order, on a
thread of its own (the stream's "device"), optionally taking ``op_us`` more per op (a kernel's
duration). ``synchronize`` and ``to_host`` wait for the stream's earlier work, events complete
when the work before them has, and ``wait_event`` makes a stream wait for another's event: the
timing behaviour of a CUDA device, so that whatever would block the proxy on a GPU blocks it
here too. ``--backend sim`` or ``sim:op_us=50``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .base import BackendError, DeviceInfo, OpRun
from .numpy_backend import NumpyBackend

__all__ = ["SimBackend", "parse_sim"]

_STOP = object()


class _Stream:
    """One stream's device: a thread running queued work in order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._queued = 0  # jobs put and not yet finished
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
    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = threading.Event()
        self.done.set()  # never recorded: complete, as cudaEventQuery says


class SimBackend(NumpyBackend):
    """A device with a queue per stream (see the module docstring)."""

    name = "sim"
    queues_work = True

    def __init__(self, op_us: float = 0.0) -> None:
        super().__init__()
        if op_us < 0:
            raise BackendError(f"sim: op_us must be >= 0, not {op_us}")
        self.op_s = op_us / 1e6

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(
            backend=self.name,
            device="simulated device (NumPy memory, a queue per stream)",
            total_memory=0,
            compute_capability="",
            note=f"op_us={self.op_s * 1e6:g}",
        )

    def _work(self) -> None:
        if self.op_s:
            time.sleep(self.op_s)

    # -- queued work -----------------------------------------------------------------------
    def from_host(self, dst: Any, src: np.ndarray[Any, Any], stream: Any) -> None:
        stream.put(lambda: np.copyto(dst, src, casting="no"))

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        stream.put(lambda: np.copyto(dst, src, casting="no"))

    def memset(self, buf: Any, offset: int, nbytes: int, value: int, stream: Any) -> None:
        def job() -> None:
            buf[offset : offset + nbytes] = value

        stream.put(job)

    def run_op(
        self, op: Any, ins: Sequence[Any], outs: Sequence[Any], params: dict[str, Any], stream: Any
    ) -> None:
        def job() -> None:
            op.run(np, ins, outs, params)
            self._work()

        stream.put(job)

    def run_ops(self, runs: Sequence[OpRun], stream: Any) -> None:
        batch = tuple(runs)  # one job: the stream's device runs them in order

        def job() -> None:
            for op, ins, outs, params in batch:
                op.run(np, ins, outs, params)
                self._work()

        stream.put(job)

    # -- waiting ---------------------------------------------------------------------------
    def to_host(self, src: Any, stream: Any) -> np.ndarray[Any, Any]:
        stream.wait()
        return np.array(src, copy=True)

    def run_dynamic(
        self, op: Any, ins: Sequence[Any], params: dict[str, Any], stream: Any, budget: int
    ) -> list[Any]:
        stream.wait()
        self._work()
        return super().run_dynamic(op, ins, params, stream, budget)

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
        stream.wait()

    def create_event(self) -> Any:
        return _Event()

    def record_event(self, event: Any, stream: Any) -> None:
        event.done.clear()
        stream.put(event.done.set)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.put(event.done.wait)

    def query_event(self, event: Any) -> bool:
        return bool(event.done.is_set())


def parse_sim(spec: str) -> SimBackend:
    """``sim`` or ``sim:op_us=50``."""
    _, _, rest = spec.partition(":")
    op_us = 0.0
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key != "op_us":
            raise BackendError(f"sim takes op_us=<microseconds>, not {item!r}")
        try:
            op_us = float(value)
        except ValueError:
            raise BackendError(f"sim: op_us={value!r} is not a number") from None
    return SimBackend(op_us)
