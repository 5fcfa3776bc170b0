"""Steps captured once and replayed by one message (CUDA-graph style), for both front ends.

``Step(core, fn)`` is what ``GPU.capture(fn)`` and ``xp.capture(fn)`` return. Calling it with
arrays (and static values) runs ``fn``; the first call for a *signature* (the arrays' shapes
and dtypes, the static values, the stream) records the ASYNC calls ``fn`` makes while they run
as usual, and sends the recording once (``step_record``); every later call with that signature
sends one ``step_replay`` naming the recording, the argument arrays and handles for the results:
the proxy runs the recorded calls without decoding or checking them again
(``gpuremote.proxy.steps``). Like ``jax.jit``:

- ``fn``'s array arguments are its inputs; anything else it is given is static (part of the
  signature); arrays it reads from elsewhere (a closure, a global) are used by reference, so
  an update written into them by the step (an SGD ``axpy`` into the weights) happens at every
  replay, and they must stay alive as long as the step;
- ``fn`` returns an array, a tuple or list of arrays, or ``None``; returned arrays that ``fn``
  made are new arrays at each replay (shapes known at once); an argument returned is returned
  as the replay's argument;
- what needs data while recording (a read, ``bool()``/``float()`` of an array, an op whose
  output shape depends on the data) cannot be recorded: ``CaptureError`` names the call and the
  line, unless the step was made with ``fallback=True``: then that call runs, and ``fn`` runs
  uncaptured from there on, for that signature, every time.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..wire.calls import CALLS_BY_NAME
from ..wire.limits import MAX_LIST
from .arrays import ArrayRef, Buffer, Core
from .recording import Recording

__all__ = ["Step"]

_RECORD, _REPLAY, _FREE_STEP = (
    CALLS_BY_NAME["step_record"],
    CALLS_BY_NAME["step_replay"],
    CALLS_BY_NAME["step_free"],
)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # gpuremote/
#: not the user's code either: the standard library (asyncio's loop, when the calling thread
#: drives the session's loop, runs between the user's line and the call)
_NOT_USER = (_PACKAGE, os.path.dirname(os.path.abspath(os.__file__)))
#: signatures a step keeps recorded; the oldest goes (on the proxy too) past this
MAX_SIGNATURES = 64


@dataclass(slots=True)
class _Recorded:
    """One signature's recording, as kept on the proxy."""

    handle: int
    buffers: list[tuple[int, int]]  # the results' buffers: (recorded handle, nbytes)
    #: how to build the outputs: ("r", buffer index, shape, dtype, offset), ("a", argument
    #: index), ("k", the array itself); ``single``: fn returned one array; ``kind``: the type
    outputs: list[tuple[Any, ...]]
    kind: type | None
    #: buffers the step writes that it does not make (arguments, arrays it closes over):
    #: their host copies are stale after each replay; held, so that they stay alive
    written: list[Buffer]


def user_line() -> str:
    """``file:line`` of the innermost frame outside gpuremote and the standard library (the
    user's code)."""
    for frame in reversed(traceback.extract_stack()):
        if not os.path.abspath(frame.filename).startswith(_NOT_USER):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


class Step:
    """``fn`` captured (see the module docstring); call it as you would call ``fn``."""

    def __init__(
        self,
        core: Core,
        fn: Callable[..., Any],
        *,
        stream: Callable[[], int] = lambda: 0,
        fallback: bool = False,
    ) -> None:
        self._core = core
        self._fn = fn
        self._stream = stream
        self.fallback = fallback
        self._recorded: dict[Any, _Recorded | None] = {}  # None: runs uncaptured
        self.replays = 0
        self.calls = 0

    def stats(self) -> dict[str, Any]:
        """Signatures recorded, replays, and how replays run (``op by op`` on the proxy)."""
        kept = [r for r in self._recorded.values() if r is not None]
        return {
            "signatures": len(kept),
            "uncaptured": len(self._recorded) - len(kept),
            "calls": self.calls,
            "replays": self.replays,
            "replayed_as": "op by op",
        }

    def free(self) -> None:
        """Forget the recordings (on the proxy too); the next call records again."""
        recorded, self._recorded = self._recorded, {}
        for r in recorded.values():
            if r is not None:
                self._core.post(_FREE_STEP, 0, [r.handle], None)

    def __call__(self, *args: Any, **static: Any) -> Any:
        self.calls += 1
        stream = self._stream()
        key = self._signature(args, static, stream)
        if key not in self._recorded:
            return self._record(key, args, static, stream)
        recorded = self._recorded[key]
        if recorded is None:  # needs data: runs uncaptured
            return self._fn(*args, **static)
        return self._replay(recorded, args, stream)

    # -- signature -------------------------------------------------------------------------
    def _signature(self, args: tuple[Any, ...], static: dict[str, Any], stream: int) -> Any:
        parts: list[Any] = [stream]
        seen: dict[int, int] = {}  # buffer -> its first argument's index: aliasing counts
        for i, a in enumerate(args):
            if isinstance(a, ArrayRef):
                if a._core is not self._core:
                    raise ValueError("a captured step's arrays must be on its device")
                k = seen.setdefault(id(a._buf), i)
                alias = None if k == i else (k, a.offset - args[k].offset)
                parts.append((a.shape, a._dtype, alias))
            else:
                parts.append(("static", type(a), a))
        parts.extend((k, type(v), v) for k, v in sorted(static.items()))
        key = tuple(parts)
        try:
            hash(key)
        except TypeError:
            raise TypeError(
                "a captured step's non-array arguments are static: they must be hashable"
            ) from None
        return key

    # -- recording -------------------------------------------------------------------------
    def _record(self, key: Any, args: tuple[Any, ...], static: dict[str, Any], stream: int) -> Any:
        core = self._core
        with core.recording(Recording(self.fallback, user_line, threading.get_ident())) as rec:
            out = self._fn(*args, **static)
        if rec.abandoned or not rec.commands:  # needed data, or did nothing: uncaptured
            self._recorded[key] = None
            return out
        arrays = [a for a in args if isinstance(a, ArrayRef)]
        outputs, buffers = self._outputs(out, arrays, rec)
        if len(arrays) > MAX_LIST or len(buffers) > MAX_LIST:
            raise ValueError(
                f"a captured step takes and makes at most {MAX_LIST} arrays; this one takes "
                f"{len(arrays)} and makes {len(buffers)}"
            )
        if len(self._recorded) >= MAX_SIGNATURES:  # the oldest signature's recording goes
            old = self._recorded.pop(next(iter(self._recorded)))
            if old is not None:
                core.post(_FREE_STEP, 0, [old.handle], None)
        handle = core.new_handle()
        program = rec.program([a._desc() for a in arrays], [h for h, _ in buffers])
        core.post(_RECORD, stream, [handle, program], None)
        mine = [b for b in rec.written if b.handle not in rec.created]
        self._recorded[key] = _Recorded(handle, buffers, outputs, type(out), mine)
        return out

    @staticmethod
    def _outputs(
        out: Any, arrays: list[ArrayRef], rec: Recording
    ) -> tuple[list[tuple[Any, ...]], list[tuple[int, int]]]:
        if out is None:
            items: list[Any] = []
        elif isinstance(out, ArrayRef):
            items = [out]
        elif isinstance(out, tuple | list) and all(isinstance(o, ArrayRef) for o in out):
            items = list(out)
        else:
            raise TypeError(
                "a captured step returns an array, a tuple or list of arrays, or None; "
                f"not {type(out).__name__}"
            )
        outputs: list[tuple[Any, ...]] = []
        buffers: list[tuple[int, int]] = []
        index: dict[int, int] = {}
        for o in items:
            h = o._buf.handle
            if h in rec.created:
                if h not in index:
                    index[h] = len(buffers)
                    buffers.append((h, o._buf.nbytes))
                outputs.append(("r", index[h], o.shape, o._dtype, o.offset))
                continue
            k = next((i for i, a in enumerate(arrays) if a._buf is o._buf), None)
            if k is None:  # the session's own array: the same one each time
                outputs.append(("k", o))
            elif arrays[k] is o:
                outputs.append(("a", k))
            else:  # a view of an argument: the same view of the replay's argument
                outputs.append(("v", k, o.shape, o._dtype, o.offset - arrays[k].offset))
        return outputs, buffers

    # -- replaying -------------------------------------------------------------------------
    def _replay(self, recorded: _Recorded, args: tuple[Any, ...], stream: int) -> Any:
        core = self._core
        arrays = [a for a in args if isinstance(a, ArrayRef)]
        wires = [a._desc() for a in arrays]
        bufs = [Buffer(core.release, core.new_handle(), n) for _, n in recorded.buffers]
        try:
            core.post(_REPLAY, stream, [recorded.handle, wires, [b.handle for b in bufs]], None)
        except BaseException:
            for b in bufs:
                b.detach()  # never made on the proxy
            raise
        if core.replayed is not None:
            core.replayed()
        for a in arrays:  # the step may write its arguments (in-place updates)
            core.written(a._buf)
        for b in recorded.written:  # and arrays it closes over
            core.written(b)
        self.replays += 1
        outs = []
        for o in recorded.outputs:
            if o[0] == "r":
                _, i, shape, dt, offset = o
                outs.append(core.make(core, bufs[i], shape, dt, offset))
            elif o[0] == "a":
                outs.append(arrays[o[1]])
            elif o[0] == "v":
                _, k, shape, dt, delta = o
                a = arrays[k]
                outs.append(core.make(core, a._buf, shape, dt, a.offset + delta))
            else:
                outs.append(o[1])
        if recorded.kind is None or recorded.kind is type(None):
            return None
        if issubclass(recorded.kind, ArrayRef):
            return outs[0]
        return tuple(outs) if issubclass(recorded.kind, tuple) else outs
