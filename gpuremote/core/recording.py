"""The recorder of a step being captured (client side): what ``step_record`` sends.

While a step is captured (``gpuremote.core.capture``), the array core and the session are given
a ``Recording`` (``Core.recording``): each ASYNC call the core posts is also added here, in
the wire form of a step (``gpuremote.wire.protocol``'s ``Arg.STEP``): ``[opcode, stream,
args]`` with the arrays it names listed once in a table of the step's own; each buffer the
core marks written is noted (its host copy is stale after every replay); and what a step
cannot hold (a call that waits for the device, host data, a new stream) is refused. The calls
still run as usual: the first call of a captured step records and runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..errors import CaptureError
from ..wire.calls import Arg, CallSpec, Resource

__all__ = ["Recording"]


class Recording:
    """Calls recorded for one step (see the module docstring). ``fallback``: what a step
    cannot hold ends the recording (``abandoned``) instead of raising ``CaptureError``;
    ``where()`` names the user's line in an error; ``thread``: the recording thread (other
    threads' calls are not the step's); ``outer``: the recording of a step that this one is
    captured inside, which records what this one does too."""

    def __init__(
        self,
        fallback: bool = False,
        where: Callable[[], str] = lambda: "?",
        thread: int = 0,
        outer: Recording | None = None,
    ) -> None:
        self.commands: list[list[Any]] = []
        self.created: set[int] = set()  # handles of the buffers the step makes
        #: the buffers the step writes (the core's ``Buffer`` objects), made or not
        self.written: set[Any] = set()
        self.fallback = fallback
        self.abandoned = False
        self.thread = thread
        self.outer = outer
        self._where = where
        self._arrays: list[list[Any]] = []
        self._index: dict[int, int] = {}  # id(array descriptor) -> index in the table

    def _ours(self) -> bool:
        return not self.thread or threading.get_ident() == self.thread

    def refuse(self, what: str) -> None:
        """``what`` cannot be part of a step: ``CaptureError`` naming it and the user's line,
        or, with ``fallback``, the recording ends and the call goes ahead."""
        if self.abandoned or not self._ours():
            return
        if self.fallback:
            self.abandoned = True
            return
        raise CaptureError(f"{what}, at {self._where()}, cannot be part of a captured step")

    def add(self, spec: CallSpec, stream: int, args: list[Any], buffer: Any = None) -> None:
        """Record an ASYNC call (``refuse`` what a step cannot hold). Frees of buffers are not
        part of a step (an array the step drops), nor are other threads' calls."""
        self._add(spec, stream, args, buffer)
        if self.outer is not None:
            self.outer.add(spec, stream, args, buffer)

    def _add(self, spec: CallSpec, stream: int, args: list[Any], buffer: Any) -> None:
        if self.abandoned or not self._ours():
            return
        if any(resource is Resource.BUFFER for _, resource in spec.frees):
            return
        if buffer is not None:
            self.refuse(f"{spec.name} (host data sent to the device; pass it as an argument)")
            return
        if not spec.recordable:
            self.refuse(f"{spec.name} (a step uses the session's streams, events and kernels)")
            return
        out = list(args)
        for i, kind in spec.array_args:
            a = out[i]
            if kind is Arg.ARRAY:
                out[i] = self.intern(a)
            elif kind is Arg.ARRAYS:
                out[i] = [self.intern(w) for w in a]
            else:
                out[i] = [["a", self.intern(k[1])] if k[0] == "a" else k for k in a]
        for i, resource in spec.creates:  # the buffers it makes (by handle, or descriptor)
            if resource is Resource.BUFFER:
                a = args[i]
                many = spec.args[i].kind in (Arg.ARRAYS, Arg.TENSORS)
                self.created.update([w[0] for w in a] if many else [a])
        self.commands.append([spec.opcode, stream, out])

    def wrote(self, buffer: Any) -> None:
        """The core marked ``buffer`` written (an upload, a launch into it, a copy)."""
        if self._ours():
            self.written.add(buffer)
        if self.outer is not None:
            self.outer.wrote(buffer)

    def intern(self, wire: list[Any]) -> int:
        """The index of array descriptor ``wire`` in the step's table."""
        index = self._index.get(id(wire))
        if index is None:
            index = self._index[id(wire)] = len(self._arrays)
            self._arrays.append(wire)  # kept alive with the recording: its id stays unique
        return index

    def program(self, slots: list[list[Any]], results: list[int]) -> list[Any]:
        """The step on the wire: the arguments' descriptors ``slots`` and the buffer handles
        of its ``results``."""
        indices = [self.intern(w) for w in slots]
        return [[list(w) for w in self._arrays], self.commands, indices, results]
