"""The calls of a step being captured (client side): what ``step_record`` sends.

While a session records (``Session.recording``), each ASYNC call it queues is also added here,
in the wire form of a step (``gpuremote.protocol``'s ``Arg.STEP``): ``[opcode, stream, args]``
with the arrays it names listed once in a table of the step's own. The calls still run as
usual: the first call of a captured step records and runs.
"""

from __future__ import annotations

from typing import Any

from .calls import Arg, CallSpec
from .errors import CaptureError
from .protocol import STEP_CALLS

__all__ = ["Recording"]


class Recording:
    """Calls recorded for one step (see the module docstring)."""

    def __init__(self) -> None:
        self.commands: list[list[Any]] = []
        self._arrays: list[list[Any]] = []
        self._index: dict[int, int] = {}  # id(array descriptor) -> index in the table

    def add(self, spec: CallSpec, stream: int, args: list[Any]) -> None:
        """Record an ASYNC call (``CaptureError`` if a step cannot hold it)."""
        if spec.name not in STEP_CALLS:
            raise CaptureError(
                f"{spec.name} cannot be part of a captured step (a step runs calls on the "
                "session's existing streams, events, kernels and arrays, and no host data)"
            )
        out = list(args)
        for i, (_, kind) in enumerate(spec.args):
            a = out[i]
            if kind is Arg.ARRAY:
                out[i] = self.intern(a)
            elif kind is Arg.ARRAYS:
                out[i] = [self.intern(w) for w in a]
            elif kind is Arg.KERNEL_ARGS:
                out[i] = [["a", self.intern(k[1])] if k[0] == "a" else k for k in a]
        self.commands.append([spec.opcode, stream, out])

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
