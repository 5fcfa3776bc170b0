"""Recorded ATen steps on a device that times its ops without computing them
(``sim:a100,compute=0``): each later replay takes, at once, the device time its first took.

On such a device an op computes nothing: the proxy runs it on shapes alone (meta tensors)
for what it makes and its work (FLOPs, bytes moved), and the device's clock takes the op's
roofline time. A replay binds arrays of the recorded shapes and dtypes, so every replay of a
step makes the same tensors and does the same work. Its **first replay** runs call by call
(each call checked and timed as the op-by-op path runs it) and notes the device time the
step queued; **each later replay** checks its bindings (every buffer the step names and did
not make exists, and holds what the step reaches into it), queues that time on the step's
stream in one piece and makes the step's results (zeroed, as every allocation is): as a GPU
proxy runs a recorded graph whole (``serve --graphs cudagraphs``), with no host Python
between its kernels, the device starting with the graph's launch while the proxy registers
its outputs. Without it, a simulated device's compiled rows measured the op-by-op
path's Python (~140-180 µs a call here), which a computing proxy's graphs do not pay.

Only a step of ATen calls (and allocations) on one stream replays so (a ``torch.compile``
graph's); any other replays call by call, as before; so does every step of a proxy set to
``serve --graphs ops``.
"""

from __future__ import annotations

import logging

from ..errors import UnknownHandle
from .state import CallFailed, SessionState
from .steps import Binds, RecordedStep, StepError

__all__ = ["TimedStep", "timed_step"]

_log = logging.getLogger(__name__)
#: the calls a timed replay stands for: ATen ops (on shapes alone) and allocations
_TIMED = frozenset({"aten", "alloc"})


class TimedStep:
    """A recorded step's replay on a timing-only device (see the module docstring): the
    buffers it reaches into and did not make, the bytes it makes, and (after its first
    replay) the device seconds it queues."""

    __slots__ = ("made_bytes", "reaches", "replays", "seconds", "stream")

    def __init__(self, step: RecordedStep) -> None:
        # (an allocation's stream does not count: the client allocates on its default one)
        streams = {c.stream for c in step.calls if c.spec.on_stream}
        if len(streams) != 1 or any(c.spec.name not in _TIMED for c in step.calls):
            raise ValueError("not one stream's ATen calls and allocations")
        #: the step's stream (its handle)
        self.stream = streams.pop()
        made: set[int] = set(step.nbytes)
        kept = set(step.intermediates.values())
        reach: dict[int, tuple[int, int]] = {}  # handle -> (lowest offset, furthest byte)
        for call in step.calls:
            if call.spec.name != "aten":
                continue
            for d in call.args[1]:  # the op's operands (its outputs are buffers it makes)
                if d.handle in made:
                    continue
                low, high = reach.get(d.handle, (d.offset, 0))
                reach[d.handle] = (min(low, d.offset), max(high, d.extent))
        #: (recorded handle, lowest offset, the byte past the furthest one the step reaches)
        self.reaches = tuple((h, low, high) for h, (low, high) in reach.items())
        #: the bytes a replay makes (its results, and its intermediates where it does not
        #: keep them between replays), at most, at once
        self.made_bytes = sum(n for h, n in step.nbytes.items() if not step.kept or h not in kept)
        #: the device seconds a replay queues (None until the first replay has run)
        self.seconds: float | None = None
        self.replays = 0

    def replay(self, s: SessionState, step: RecordedStep, binds: Binds) -> None:
        """One replay after the first: bindings checked (``StepError``, ``UnknownHandle``,
        ``CallFailed``), the results made, the device time queued on the step's stream."""
        assert self.seconds is not None
        nbytes = s.nbytes
        for handle, low, high in self.reaches:
            bound = binds.get(handle)
            h, shift = (handle, 0) if bound is None else bound
            n = nbytes.get(h)
            if n is None:
                raise UnknownHandle(f"unknown buffer handle {h}")
            if low + shift < 0:
                raise StepError("an argument's offset would move the step's views before it")
            if high and high + shift > n:
                raise CallFailed(
                    f"step {step.handle} reaches byte {high + shift} of buffer {h}, which has {n}"
                )
        if s.device_bytes + self.made_bytes > s.limits.max_device_bytes:
            raise CallFailed(
                f"step {step.handle} makes {self.made_bytes} bytes; this session holds "
                f"{s.device_bytes} and its limit is {s.limits.max_device_bytes}"
            )
        # the device starts at once, its results made while it runs: as a GPU proxy's graph
        # starts with its launch, its outputs registered as buffers after
        s.backend.elapse(s.stream(self.stream), self.seconds)
        for recorded in step.results:
            s.alloc(binds[recorded][0], step.nbytes[recorded])
        self.replays += 1


def timed_step(s: SessionState, step: RecordedStep) -> TimedStep | None:
    """``step``'s timed replay where its session's device times ops without computing them
    and the step is one stream's ATen calls, else None (decided once, at its first replay)."""
    if step.timed is None:
        backend = s.backend
        if (
            s.limits.graphs == "ops"
            or getattr(backend, "profile", None) is None
            or getattr(backend, "compute", True)
        ):
            step.timed = False
        else:
            try:
                step.timed = TimedStep(step)
            except ValueError as exc:
                _log.debug("step %d replays call by call: %s", step.handle, exc)
                step.timed = False
    return step.timed or None
