"""``torch.compile(model, backend="gpuremote")``: each graph runs on the proxy by one message.

(The name reaches torch through the package's ``torch_dynamo_backends`` entry point.)

TorchDynamo captures the model's Python into FX graphs (guards and recompiles as torch does
them; graph breaks run eagerly between graphs); AOTAutograd splits each into a forward and a
backward graph of ATen ops. Each of those graphs becomes a **recorded step**
(``gpuremote.core.recording``, ``gpuremote.proxy.steps``):

- its first call with a *signature* (every tensor argument's sizes, strides, storage offset,
  dtype and storage size, which arguments share a buffer, the other arguments' values) runs
  the graph op by op, as eager code would, while the ``aten`` calls it makes are recorded;
  the recording (a node list: op names, tensor layouts, constants; no Python, no pickle) is
  sent once (``step_record``), in the same frame as those calls, and checked once on the
  proxy (ops on the allow-list, every operand within its buffer);
- every later call with that signature sends one ``step_run`` naming the recording, the
  buffers of its tensor arguments and handles for what it makes: the outputs come back as new
  tensors at once (their layouts are known), and nothing waits.

A graph that needs the data while it runs (an op whose output shape depends on it, a read)
runs eagerly for that signature, every time, as does a graph whose tensors are on the host.
``failover=`` sessions keep the recordings in their journal: a new proxy gets them again.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.capture import user_line
from ..core.driver import SyncDriver
from ..core.recording import Recording
from ..errors import ConnectionClosed
from ..wire.calls import CALLS_BY_NAME
from ._rewrites import constants_to_device, copies_as_one, lerps_restored, updates_in_place
from ._tensors import SHIFT, handle_of, is_remote, new_storage, tensor_on

__all__ = ["MODES", "backend", "counts"]

_RECORD, _RUN, _FREE_STEP = (
    CALLS_BY_NAME["step_record"],
    CALLS_BY_NAME["step_run"],
    CALLS_BY_NAME["step_free"],
)
#: the ``mode``s of ``torch.compile`` the backend takes (each graph becomes a recorded
#: step in all of them: what CUDA graphs are to ``reduce-overhead``)
MODES = (None, "default", "reduce-overhead")
#: signatures a graph keeps recorded; the oldest goes (on the proxy too) past this
MAX_SIGNATURES = 16


def counts(d: SyncDriver) -> dict[str, int]:
    """Session ``d``'s compiled graphs: ``graphs_recorded`` (signatures recorded and sent),
    ``graph_replays`` (runs by one ``step_run``), ``graphs_eager`` (runs op by op: a
    signature that cannot be recorded, and each recording's first run); and its eager ops'
    ``templates`` (signatures kept on the proxy) and their ``template_tensors``."""
    c = d.counters
    if "graphs_recorded" not in c:
        c.update(graphs_recorded=0, graph_replays=0, graphs_eager=0)
    if "templates" not in c:
        c.update(templates=0, template_tensors=0)
    return c


@dataclass(slots=True)
class _Recorded:
    """One signature's recording, as the proxy keeps it."""

    handle: int
    driver: SyncDriver
    buffers: list[int]  # the bytes of each buffer the graph makes and returns
    #: how to build each output: ("r", buffer index, storage offset, sizes, strides, dtype),
    #: ("a", argument index), ("v", argument index, offset, sizes, strides, dtype), ("k",
    #: the object itself: a tensor the graph did not make, a number)
    outputs: list[tuple[Any, ...]]


class _Graph:
    """One FX graph of ATen ops (AOTAutograd's forward or backward) as the backend runs it:
    called with the list of its arguments (AOTAutograd's boxed convention) or with them.
    ``functional``: the graph as AOTAutograd wrote it, where ``gm`` updates the inputs at
    ``written`` in place (``_rewrites``), for a call that passes one of those in a buffer
    another argument shares."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        resolve: Callable[[int], SyncDriver],
        functional: torch.fx.GraphModule | None = None,
        written: Sequence[int] = (),
    ) -> None:
        #: boxed: an instance attribute, which the wrappers torch puts around it copy
        self._boxed_call = True
        self._gm = gm
        self._functional = functional
        self._written = tuple(written)
        self._tensor_args = sum(
            isinstance(n.meta.get("val"), torch.Tensor)
            for n in gm.graph.nodes
            if n.op == "placeholder"
        )
        self._resolve = resolve
        self._recorded: dict[Any, _Recorded | None] = {}  # None: runs eagerly
        #: signatures known by their quick part (``_signature``'s): quick key -> [(guards of the
        #: tensors' sizes, strides, dtype, device, key)]
        self._known: dict[Any, list[tuple[Any, Any]]] = {}
        weakref.finalize(self, _free_all, self._recorded)

    def __call__(self, *given: Any) -> Any:
        # boxed (one list of the arguments, which the caller may clear), or not (where a
        # wrapper hides ``_boxed_call``): a graph's arguments are never lists themselves
        args = list(given[0]) if len(given) == 1 and type(given[0]) is list else list(given)
        first = next((a for a in args if is_remote(a)), None)
        if first is None:
            return self._module(args)(*args)
        d = self._resolve(first.device.index or 0)
        quick, tensors, slots, buffers = _signature(d, args, quick=True)
        known = self._known.get(quick) if quick is not None else None
        key = next((k for g, k in known if g.check(*tensors)), None) if known else None
        if key is None:
            key, tensors, slots, buffers = _signature(d, args)
            if key is not None and quick is not None:
                self._know(quick, tensors, key)
        recorded = self._recorded.get(key, _MISSING) if key is not None else None
        if recorded is _MISSING:
            return self._record(d, key, args, slots, buffers)
        if recorded is None:
            counts(d)["graphs_eager"] += 1
            return self._module(args, len(slots))(*args)
        assert isinstance(recorded, _Recorded)
        return self._replay(recorded, args, slots, buffers)

    def _know(self, quick: Any, tensors: list[Any], key: Any) -> None:
        """Signature ``key``'s tensors are ``tensors`` (quick part ``quick``): found by it
        and their guards from now on."""
        if len(self._known) >= 4 * MAX_SIGNATURES:
            self._known.clear()
        known = self._known.setdefault(quick, [])
        if len(known) >= MAX_SIGNATURES:
            del known[0]
        known.append(
            (_TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None), key)
        )

    def _module(self, args: list[Any], buffers: int = -1) -> torch.fx.GraphModule:
        """The graph to run on ``args`` (which name ``buffers`` distinct buffers, if known): the
        functional one where an input it updates in place shares its buffer with another
        argument (a signature's recording is made, and replayed, by the same graph)."""
        if self._functional is None or buffers >= self._tensor_args:
            return self._gm
        storage_of: dict[int, int] = {}
        for a in args:
            if isinstance(a, torch.Tensor):
                ptr = a.untyped_storage().data_ptr()
                storage_of[ptr] = storage_of.get(ptr, 0) + 1
        for i in self._written:
            if storage_of.get(args[i].untyped_storage().data_ptr(), 0) > 1:
                return self._functional
        return self._gm

    # -- recording -------------------------------------------------------------------------
    def _record(
        self, d: SyncDriver, key: Any, args: list[Any], slots: list[int], buffers: list[int]
    ) -> Any:
        c = counts(d)
        c["graphs_eager"] += 1
        if d.recording is not None:  # another thread records on this session: eagerly now
            return self._module(args, len(slots))(*args)
        rec = Recording(True, user_line, threading.get_ident())
        module = self._module(args, len(slots))
        with d.held():
            d.recording = rec
            try:
                out = module(*args)
            finally:
                d.recording = None
            recorded = None
            if not rec.abandoned and rec.commands:
                recorded = self._keep(d, rec, args, slots, buffers, out)
        if len(self._recorded) >= MAX_SIGNATURES:
            _free(self._recorded.pop(next(iter(self._recorded))))
        self._recorded[key] = recorded
        if recorded is not None:
            c["graphs_recorded"] += 1
        return out

    def _keep(
        self,
        d: SyncDriver,
        rec: Recording,
        args: list[Any],
        slots: list[int],
        slot_buffers: list[int],
        out: Any,
    ) -> _Recorded | None:
        """Send the recording of a run that returned ``out``; None where it cannot be
        replayed (it returns a host tensor it made). ``slot_buffers``: the arguments'
        buffers' handles (``_signature``), each a step's argument whole (a flat byte
        array)."""
        storages = {handle_of(args[i]): i for i in slots}
        outputs: list[tuple[Any, ...]] = []
        buffers: list[int] = []
        results: list[int] = []
        index: dict[int, int] = {}
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if not isinstance(o, torch.Tensor):
                outputs.append(("k", o))
                continue
            if not is_remote(o):
                if any(o is a for a in args):
                    outputs.append(("k", o))
                    continue
                return None  # a host tensor the graph made: its value may change
            h = handle_of(o)
            layout = (o.storage_offset(), list(o.shape), list(o.stride()), o.dtype)
            if h in rec.created:
                if h not in index:
                    index[h] = len(buffers)
                    buffers.append(o.untyped_storage().nbytes())
                    results.append(h)
                outputs.append(("r", index[h], *layout))
            elif h in storages:
                k = next((i for i, a in enumerate(args) if a is o), None)
                outputs.append(("a", k) if k is not None else ("v", storages[h], *layout))
            else:  # the session's own tensor (a constant of the graph)
                outputs.append(("k", o))
        handle = d.session.new_handle()
        slot_descs = [
            [h, 0, [args[i].untyped_storage().nbytes()], "uint8"]
            for h, i in zip(slot_buffers, slots, strict=True)
        ]
        program = rec.program(slot_descs, results)
        d.post(_RECORD, 0, [handle, program])
        return _Recorded(handle, d, buffers, outputs)

    # -- replaying -------------------------------------------------------------------------
    def _replay(
        self, recorded: _Recorded, args: list[Any], slots: list[int], slot_buffers: list[int]
    ) -> Any:
        d = recorded.driver
        new_handle = d.session.new_handle
        results = [new_handle() for _ in recorded.buffers]
        d.post(_RUN, 0, [recorded.handle, slot_buffers, results])
        d.send_replay()
        counts(d)["graph_replays"] += 1
        index = args[slots[0]].device.index or 0
        storages = [
            new_storage(h, n, index, d._release)
            for h, n in zip(results, recorded.buffers, strict=True)
        ]
        out = []
        for o in recorded.outputs:
            kind = o[0]
            if kind == "r":
                _, i, offset, sizes, strides, dtype = o
                out.append(tensor_on(storages[i], offset, sizes, strides, dtype, index))
            elif kind == "a":
                out.append(args[o[1]])
            elif kind == "v":
                _, k, offset, sizes, strides, dtype = o
                storage = args[k].untyped_storage()
                out.append(tensor_on(storage, offset, sizes, strides, dtype, index))
            else:
                out.append(o[1])
        return out


_MISSING: Any = object()

#: torch's C++ tensor checks, as TorchDynamo's guards made them (None: the whole key each call)
_TensorGuards: Any = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
_TensorGuards = getattr(_TensorGuards, "TensorGuards", None)


def _signature(
    d: SyncDriver, args: Sequence[Any], quick: bool = False
) -> tuple[Any, list[Any], list[int], list[int]]:
    """The key of a call's recording (None: it cannot be recorded), its tensor arguments, the
    positions of the arguments whose buffers a replay passes (one per buffer, in order), and
    those buffers' handles, in one pass over the arguments. (Where a tensor lies is read from
    its flags, ``is_cpu`` and the like: ``device.type`` takes six times as long.)

    ``quick``: the key's quick part only (None where it cannot tell, or torch has no
    ``TensorGuards``): all but the tensors' sizes, strides, dtype and device. A call whose
    quick part is a known signature's, and whose tensors pass that signature's guards
    (torch's ``TensorGuards``: those, in C++), has that signature: half the per-tensor
    reads, the rest in one C++ call."""
    parts: list[Any] = [id(d)]
    seen: dict[int, int] = {}
    tensors: list[Any] = []
    slots: list[int] = []
    buffers: list[int] = []
    if quick and _TensorGuards is None:
        return None, tensors, slots, buffers
    tensor, plain = torch.Tensor, (int, float, bool, type(None))
    append = parts.append
    try:
        for i, a in enumerate(args):
            if isinstance(a, tensor):
                if not quick and (a.is_cpu or a.is_meta or a.is_cuda):
                    return None, tensors, slots, buffers  # not the device's: refused
                storage = a.untyped_storage()
                h = storage.data_ptr() >> SHIFT
                first = seen.get(h)
                if first is None:
                    seen[h] = i
                    slots.append(i)
                    buffers.append(h)
                tensors.append(a)
                if quick:
                    append((a.storage_offset(), storage.nbytes(), first))
                else:
                    layout = (a.shape, a.stride(), a.storage_offset(), a.dtype)
                    append((*layout, storage.nbytes(), first))
            elif isinstance(a, plain):
                append((type(a), a))
            elif isinstance(a, torch.SymInt):
                append((torch.SymInt, int(a)))
            else:
                return None, tensors, slots, buffers
    except (RuntimeError, NotImplementedError):  # (a tensor without storage: not ours)
        if not quick:
            raise
        return None, tensors, slots, buffers
    return tuple(parts), tensors, slots, buffers


def _free(recorded: _Recorded | None) -> None:
    """Forget a recording on the proxy (from any thread; not after the session ended)."""
    if recorded is not None and not recorded.driver.closed:
        with contextlib.suppress(ConnectionClosed):
            recorded.driver.post(_FREE_STEP, 0, [recorded.handle])


def _free_all(recordings: dict[Any, _Recorded | None]) -> None:
    for r in recordings.values():
        _free(r)


def _compiler(
    resolve: Callable[[int], SyncDriver],
) -> Callable[[torch.fx.GraphModule, Sequence[Any]], _Graph]:
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> _Graph:
        constants_to_device(gm)
        lerps_restored(gm)
        functional = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        written = updates_in_place(gm)
        copies_as_one(gm)
        if not written:
            return _Graph(gm, resolve)
        copies_as_one(functional)
        return _Graph(gm, resolve, functional, written)

    return compile_graph


_UNTRACED: list[bool] = []
#: gpuremote's own machinery, which dynamo runs as it is and never traces: the device's
#: kernels (Python: a compiled function's eager part, after a graph break, reaches them),
#: the session under them, the proxy where it serves in this process (its models, in
#: ``gpuremote.torch.models``, are traced as any module is)
_NOT_TRACED = (
    "gpuremote.torch._kernels",
    "gpuremote.torch._dispatch",
    "gpuremote.torch._encoding",
    "gpuremote.torch._tensors",
    "gpuremote.torch._transfers",
    "gpuremote.torch._guard",
    "gpuremote.core",
    "gpuremote.session",
    "gpuremote.wire",
    "gpuremote.proxy",
    "gpuremote.backends",
    "gpuremote.transports",
)


def untraced() -> None:
    """Tell dynamo to leave ``_NOT_TRACED`` alone (once; it is loaded by then)."""
    if not _UNTRACED:
        import torch._dynamo.trace_rules as rules

        for name in _NOT_TRACED:
            rules.add(name)
        _UNTRACED.append(True)


def backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Any:
    """The ``gpuremote`` backend of ``torch.compile`` (see the module docstring)."""
    from torch._dynamo.backends.common import aot_autograd

    if mode not in MODES:
        raise ValueError(
            f"torch.compile(backend='gpuremote') takes mode in {MODES[1:]}; not {mode!r}"
        )
    if options:
        raise ValueError(
            f"torch.compile(backend='gpuremote') takes no options; got {sorted(options)}"
        )
    from ._backend import dispatcher

    untraced()
    compile_graph = _compiler(dispatcher.driver)
    # in-place updates of the inputs (an optimizer's step, batch norm's statistics) stay in
    # the graph (as ``copy_`` into them), not one call each after every replay
    return aot_autograd(
        fw_compiler=compile_graph,
        bw_compiler=compile_graph,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)
