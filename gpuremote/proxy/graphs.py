"""Recorded ATen steps run whole: one ``torch.fx`` graph per recording, called by each replay.

A step of ATen calls (a graph of ``torch.compile(backend="gpuremote")``) replayed call by
call pays, per op, what an eager op pays on the proxy: its descriptors rebound, its operands
viewed and bounds-checked, its arguments decoded, its outputs made buffers. Here the step's
**first replay** runs its calls once more, checked as the op-by-op path checks them, and
traces what they do into a ``torch.fx.GraphModule``:

- its inputs are the views of the buffers the step did not make (the session's weights, the
  replay's arguments), made and bounds-checked per replay (a session buffer's view is kept
  while the buffer is the same), and the session's random generator;
- a buffer the step makes is the tensor its op made (no buffer, no handle): laid out as the
  client's metadata says, or copied into such a layout where the kernel chose another (as the
  op-by-op path copies it), its views taken by ``as_strided``;
- its outputs are the step's results, which become the replay's new buffers (each the tensor
  itself, ``AtenSession.keep_as_is``: on a CPU proxy the NumPy array of its bytes is made only
  where something reads the buffer as one, ``backends.torch_runtime.Unadopted``); a later
  graph's input of a result's layout is that tensor, of another layout a view of it.

Every later replay calls the graph's generated Python (``GraphModule.forward``: the ops one
after another, nothing else), or, where the proxy is set to (``graphs="inductor"``), the
graph compiled by the proxy's own inductor (``torch._inductor.compile``: C++/OpenMP kernels
on a CPU proxy, Triton on a GPU proxy; no TorchDynamo frame, whose guards would check every
input on every call; ``graphs="cudagraphs"`` on a GPU: ``torch.compile``'s
``reduce-overhead``), compiled once per content and shared by every session with the same
graph, within a per-session budget of compile time. Only the checked ATen nodes of the
allow-list and plain values become code; nothing a client wrote is run as code.

A graph keeps its inputs' views between replays while their bindings and buffers stay (the
session's weights, its optimizer's state): a replay makes only those of the buffers it binds
anew, and a buffer freed or replaced drops the views of it (``SessionState.view_users``). An
input the graph only reads, or whose elements alone it writes (``AllowedOp.relays``), may be
a view of the tensor kept as its buffer (a graph's result: ``AtenSession.keep_as_is``); one an
op may lay out again (an ``out=`` tensor, a ``resize_``) is a view of the buffer's own
memory, which cannot grow. A compiled graph is specialised to how its inputs shared buffers when it
was compiled, where it writes one: a replay that binds them otherwise runs the graph's code.

A step that cannot be one graph (an op of its own rules: randomness lent to ops without a
generator, the CPU's gaps; a buffer it makes viewed as another dtype) replays call by call,
as before; so does every step on a device that times or checks its ops (``sim:``).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import operator
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..wire.protocol import TENSOR_DTYPES, TensorDesc
from .aten import CPU_GAPS, AllowedOp, AtenSession, resolve_op
from .state import CallFailed, SessionState
from .steps import Binds, RecordedStep, StepError

__all__ = ["GRAPH_MODES", "GraphCallError", "StepGraph", "graph_for", "replay_graph"]

#: how a proxy runs its sessions' recorded ATen steps: call by call (``ops``), each as one
#: interpreted FX graph (``fx``, the default), compiled by inductor (``inductor``), or so and
#: replayed as a CUDA graph on a GPU proxy (``cudagraphs``: inductor's ``reduce-overhead``;
#: on a CPU proxy, as ``inductor``)
GRAPH_MODES = ("ops", "fx", "inductor", "cudagraphs")

_log = logging.getLogger(__name__)

#: graphs compiled by inductor, shared by sessions: content hash -> compiled callable
_COMPILED: OrderedDict[str, Any] = OrderedDict()
_COMPILED_MAX = 64
_COMPILE_LOCK = threading.Lock()
_COMPILING = ("inductor", "cudagraphs")
#: views kept per buffer, at most (they are remade when needed)
_MAX_VIEWS = 1024
#: the graphs' inputs' keys among their buffers' views: never one reused
_INPUT_KEYS = itertools.count()
#: an input's binding when its view is to be made (equal to no binding)
_STALE = object()


class _NotGraphable(Exception):
    """The step replays call by call (the reason is the message)."""


class StepGraph:
    """One recorded ATen step as a ``torch.fx`` graph: its inputs (the views of the buffers
    it did not make), its code, and the compiled callable where inductor compiles it."""

    def __init__(self, step: RecordedStep) -> None:
        self.step = step
        #: per input: (its slot, or -1 for a buffer of the session's; its recorded
        #: descriptor; the key of its views among its buffer's in ``SessionState.views``;
        #: the bytes it reaches from its offset; the key under which a graph's result is
        #: kept as the whole of its buffer, where the input is that)
        self.inputs: list[tuple[int, TensorDesc, int, int, Any]] = []
        #: the inputs an op of the graph writes (how they share buffers matters to a
        #: compiled graph), and those an op may lay out again (``AllowedOp.relays``): their
        #: views are of the buffer's own memory, never of a tensor kept as the buffer (whose
        #: storage an ``out=`` op or a ``resize_`` could grow)
        self.written: set[int] = set()
        self.relaid: set[int] = set()
        self.gm: Any = None
        self.forward: Callable[..., Any] | None = None
        self.compiled: Any = None
        #: lines of the graph's code -> the step's call they run (an error names it)
        self._line_call: dict[int, int] = {}
        self.ops = 0
        self.replays = 0
        self.run_ns = 0  # in the graph's callable, over the replays
        #: this thread's CPU in the callable and in the whole replays (the inputs' views,
        #: the results' buffers): what the second adds is this module's cost
        self.run_thread_ns = 0
        self.replay_thread_ns = 0
        self.made_bytes = 0  # what the step's buffers hold, for the session's memory limit
        #: ops of the step that take the session's generator as an argument (never
        #: compiled: inductor takes no generator), and random ops lent it (compiled with
        #: inductor's ``fallback_random``: ATen's own kernels, drawing as eager ops do)
        self.takes_generator = False
        self.lends_rng = False
        #: the step's results as they are made (recorded handles), and their sizes in bytes
        self.results: list[TensorDesc] = []
        self.extents: list[int] = []
        self.wholes: list[Any] = []  # their keys among their buffers' views (``_whole``)
        #: the step's allocations, each as the flat tensor its views take: handle -> that
        self.allocs: dict[int, TensorDesc] = {}
        #: the last replay's inputs, kept while their buffers are (``SessionState.view_users``
        #: tells ``forget`` when one goes): the generator and its lender, then the views;
        #: per view, the binding it was made for (None: a buffer of the session's; ``_STALE``:
        #: to be made); per input, the recorded handle a replay binds (its key in ``Binds``);
        #: per buffer handle, the inputs viewing it
        self._args: list[Any] = []
        self._made_for: list[Any] = []
        self._bind_keys: list[int] = []
        self._viewing: dict[int, set[int]] = {}
        #: per input, the binding of the last replay (``_STALE``: none since its buffer
        #: went); the inputs whose binding changed between the last two replays (their views
        #: are this replay's alone: not kept, so that they keep no freed buffer's memory)
        self._last: list[Any] = []
        self._passing: list[int] = []
        #: the last replay's bindings (``inputs_of``), and how its inputs share buffers
        #: (``_aliasing``; None: not worked out since they changed), beside how those the
        #: compiled callable was compiled for did: a compiled graph is specialised to it
        self._now: list[Any] = []
        self._aliasing: tuple[int, ...] | None = None
        self._compiled_aliasing: tuple[int, ...] | None = None
        #: per result: the recorded handle a replay binds
        self._result_keys: list[int] = []
        #: per input: the key under which a graph's result of its layout is kept (``_whole``;
        #: None where it is not one, or an op may lay it out again): a replay binding it to
        #: another graph's result (activations, gradients) takes that result itself
        self._results_of: list[Any] = []
        #: per input: how it is viewed from a tensor kept as its buffer (the key of that
        #: tensor, the view's sizes, strides and element offset, the byte past its reach;
        #: None where it reaches no byte, or an op may lay it out again)
        self._of_kept: list[Any] = []
        self._plan()

    # -- building ----------------------------------------------------------------------------
    def _plan(self) -> None:
        """``_NotGraphable`` unless every call of the step is an ATen op this module runs or
        an allocation, and every view of a buffer the step makes has one dtype (an
        allocation's: its first view's) and that dtype's alignment."""
        step = self.step
        made: dict[int, str] = {}
        allocs: dict[int, int] = {}  # allocated, its dtype not yet known: handle -> nbytes
        streams = set()
        for call in step.calls:
            if call.spec.name == "alloc":
                allocs[call.args[0]] = call.args[1]
                continue
            if call.spec.name != "aten":
                raise _NotGraphable(f"a {call.spec.name} call")
            streams.add(call.stream)
            name, tensors, _, outputs = call.args
            resolve_op(name)  # (allowed: CallFailed if not)
            if name in CPU_GAPS:
                raise _NotGraphable(f"{name} runs by rules of its own on this device")
            for d in tensors:
                nbytes = allocs.pop(d.handle, None)
                if nbytes is not None:  # an allocation's first view: its dtype
                    self._alloc_as(d.handle, nbytes, d.dtype)
                    made[d.handle] = d.dtype
                dtype = made.get(d.handle)
                if dtype is not None and (dtype != d.dtype or d.offset % TENSOR_DTYPES[d.dtype]):
                    raise _NotGraphable("a buffer the step makes viewed as another dtype")
            for d in outputs:
                made[d.handle] = d.dtype
        for handle, nbytes in allocs.items():  # never viewed: bytes
            self._alloc_as(handle, nbytes, "uint8")
        if len(streams) > 1:
            raise _NotGraphable("calls on several streams")

    def _alloc_as(self, handle: int, nbytes: int, dtype: str) -> None:
        """An allocation of the step, as a flat tensor of ``dtype``."""
        itemsize = TENSOR_DTYPES[dtype]
        if nbytes % itemsize:
            raise _NotGraphable(f"an allocation of {nbytes} bytes viewed as {dtype}")
        self.allocs[handle] = TensorDesc(handle, 0, (nbytes // itemsize,), (1,), dtype)

    def trace(self, s: SessionState, a: AtenSession, binds: Binds) -> list[Any]:
        """Run the step's calls once (this replay), checked as the op-by-op path checks
        them, and build the graph of what they did; returns the results' tensors."""
        import torch

        tracer = _Tracer(self, a, binds)
        for i, call in enumerate(self.step.calls):
            if call.spec.name == "alloc":
                tracer.alloc(self.allocs[call.args[0]])
            else:
                tracer.aten(i, call.args)
                self.ops += 1
        made = tracer.made
        results = [made[h] for h in self.step.results]
        self.results = [r[2] for r in results]
        self.extents = [d.extent for d in self.results]
        self.wholes = [_whole(d) for d in self.results]
        self.made_bytes = sum(m[2].extent for m in made.values())
        g = tracer.g
        g.output(tuple(r[0] for r in results))  # (no dead code removed: a random op's
        # unused result still draws from the generator, as the op-by-op path's does)
        self.gm = torch.fx.GraphModule(torch.nn.Module(), g)
        self.forward = self.gm.forward
        self._args = [None] * (2 + len(self.inputs))
        self._made_for = [_STALE] * len(self.inputs)
        self._last = [_STALE] * len(self.inputs)
        self._bind_keys = [d.handle for _, d, _, _, _ in self.inputs]
        self._results_of = [
            whole if whole is not None and i not in self.relaid else None
            for i, (_, _, _, _, whole) in enumerate(self.inputs)
        ]
        self._of_kept = [
            (
                ("kept", d.dtype),
                d.sizes,
                d.strides,
                d.offset // TENSOR_DTYPES[d.dtype],
                d.offset + reach,
            )
            if reach and i not in self.relaid
            else None
            for i, (_, d, _, reach, _) in enumerate(self.inputs)
        ]
        self._result_keys = [d.handle for d in self.results]
        self.takes_generator, self.lends_rng = tracer.takes_generator, tracer.lends_rng
        for lineno, line in enumerate(self.gm.code.splitlines(), start=1):
            target = line.strip().split(" = ", 1)[0]
            if target in tracer.node_call:
                self._line_call[lineno] = tracer.node_call[target]
        return [r[1] for r in results]

    # -- replaying ---------------------------------------------------------------------------
    def inputs_of(self, s: SessionState, a: AtenSession, binds: Binds) -> list[Any]:
        """The graph's inputs for one replay: the last replay's where their bindings are the
        same and their buffers have not gone since; else each view made (bounds-checked), or
        found among the session buffer's other views (dropped when it is freed or replaced)."""
        args, made_for = self._args, self._made_for
        now = list(map(binds.get, self._bind_keys))  # (None: a buffer of the session's)
        if now != self._now:
            self._now, self._aliasing = now, None
        if now != made_for:
            last, passing, results_of = self._last, self._passing, self._results_of
            views, nbytes, of_kept = s.views, s.nbytes, self._of_kept
            for i in itertools.compress(range(len(now)), map(operator.ne, now, made_for)):
                bound = now[i]
                before = last[i]
                last[i] = bound
                if before is _STALE or before == bound:  # kept while its buffer is
                    args[i + 2] = self._view(s, a, i, bound, keep=True)
                    made_for[i] = bound
                    continue
                # bound elsewhere each replay: this one's alone (most often another graph's
                # result, as that graph made it: found here, as ``_view`` would find it)
                t = None
                if bound is not None and not bound[1]:
                    kept = views.get(bound[0])
                    if kept is not None:
                        whole = results_of[i]
                        if whole is not None:
                            t = kept.get(whole)
                        if t is None and (of := of_kept[i]) is not None:
                            # another layout of a graph's result, viewed from it at once
                            # (bounds: the byte past its reach, against the buffer's size)
                            r = kept.get(of[0])
                            if r is not None and of[4] <= nbytes[bound[0]]:
                                t = r.as_strided(of[1], of[2], of[3])
                args[i + 2] = t if t is not None else self._view(s, a, i, bound, keep=False)
                made_for[i] = _STALE
                passing.append(i)
        rng = a.rng
        args[0], args[1] = rng.generator, rng
        return args

    def aliasing(self) -> tuple[int, ...]:
        """How the last replay's inputs share buffers: () where none does, or where the
        graph writes none of them (reads of a buffer through several inputs are the same
        compiled or not), else each input's buffer numbered in order of first use (distinct
        buffers never overlap)."""
        if not self.written:
            return ()
        if self._aliasing is None:
            handles = [
                b[0] if b is not None else h
                for b, h in zip(self._now, self._bind_keys, strict=True)
            ]
            if len(set(handles)) == len(handles):
                self._aliasing = ()
            else:
                ids: dict[int, int] = {}
                self._aliasing = tuple(ids.setdefault(h, len(ids)) for h in handles)
        return self._aliasing

    def let_go(self) -> None:
        """The replay is done: the views that were its alone go."""
        args = self._args
        for i in self._passing:
            args[i + 2] = None
        self._passing.clear()

    def _view(self, s: SessionState, a: AtenSession, i: int, bound: Any, keep: bool) -> Any:
        """Input ``i``'s view for binding ``bound`` (None: its recorded buffer), kept with
        its buffer's other views; ``keep``: kept by the graph too, until the buffer goes."""
        _, d, kid, reach, whole = self.inputs[i]
        handle, shift = bound if bound is not None else (d.handle, 0)
        key = (kid, shift)  # (the view: this input's layout, moved by shift)
        views = s.views
        kept = views.get(handle)
        t = None
        stays_laid_out = i not in self.relaid
        if kept is not None:
            if whole is not None and not shift and stays_laid_out:
                t = kept.get(whole)  # a graph's result, as it made it
            if t is None:
                t = kept.get(key)
        if t is None:  # (an unknown handle, a view past the buffer: refused)
            offset = d.offset + shift
            if offset < 0:
                raise StepError(
                    "an argument's offset would move the step's views before its buffer"
                )
            end = offset + reach if reach else 0
            t = a.strided(handle, offset, d.sizes, d.strides, d.dtype, end, stays_laid_out)
            kept = views.setdefault(handle, {})
            if len(kept) >= _MAX_VIEWS:  # (graphs recorded again and again: start over)
                kept.clear()
            kept[key] = t
        if not keep:
            return t
        viewing = self._viewing.get(handle)
        if viewing is None:
            viewing = self._viewing[handle] = set()
            s.view_users.setdefault(handle, set()).add(self)
        viewing.add(i)
        return t

    def release(self, s: SessionState) -> None:
        """The step is freed: its kept inputs go (and its place among the buffers' users)."""
        users = s.view_users
        for handle in self._viewing:
            kept = users.get(handle)
            if kept is not None:
                kept.discard(self)
                if not kept:
                    del users[handle]
        self._viewing.clear()
        self._args = [None] * len(self._args)
        self._made_for = [_STALE] * len(self._made_for)
        self._last = [_STALE] * len(self._last)

    def forget(self, handle: int) -> None:
        """Buffer ``handle`` is freed or replaced: the inputs that viewed it are made again."""
        made_for, args = self._made_for, self._args
        for i in self._viewing.pop(handle, ()):  # (its binding stays the last replay's)
            made_for[i] = _STALE
            args[i + 2] = None

    def run(self, inputs: list[Any], mode: str, budget: Callable[[float], None]) -> Any:
        """Call the graph (compiled first where ``mode`` is ``inductor``: once per content,
        ``budget`` charged with the compile time); a failure names the step's call."""
        t0, h0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            if mode in _COMPILING and not self.takes_generator and self.compiled is None:
                self._compiled_aliasing = self.aliasing()
                self.compiled, out = _compiled(self, inputs, budget, mode)
            else:
                fn = self.compiled
                # (inputs sharing buffers otherwise than compiled for: the graph's own code,
                # which takes any)
                if fn is None or self.aliasing() != self._compiled_aliasing:
                    fn = self.forward
                assert fn is not None
                out = fn(*inputs)
        except CallFailed:
            raise
        except Exception as exc:
            message = f"{type(exc).__name__}: {_first_line(exc)}"
            raise GraphCallError(self._failed_call(exc), "", message) from None
        self.run_thread_ns += time.thread_time_ns() - h0
        self.run_ns += time.perf_counter_ns() - t0
        self.replays += 1
        return out

    def _failed_call(self, exc: BaseException) -> int:
        """The step's call whose line of the graph's code raised ``exc`` (-1: unknown)."""
        filename = self.forward.__code__.co_filename if self.forward is not None else None
        tb = exc.__traceback__
        found = -1
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == filename:
                found = self._line_call.get(tb.tb_lineno, found)
            tb = tb.tb_next
        return found


class _Tracer:
    """Builds a ``StepGraph``'s FX graph while running its step's calls once (its first
    replay): each call run as the op-by-op path runs it, and added to the graph."""

    def __init__(self, graph: StepGraph, a: AtenSession, binds: Binds) -> None:
        import torch.fx as fx

        self.graph, self.a, self.binds = graph, a, binds
        self.g = fx.Graph()
        self.rng_node = self.g.placeholder("rng")
        self.lender_node = self.g.placeholder("lender")
        #: a buffer the step made: recorded handle -> (its node, its tensor, its descriptor)
        self.made: dict[int, tuple[Any, Any, TensorDesc]] = {}
        self.seen: dict[Any, tuple[Any, Any]] = {}  # a view taken: key -> (node, tensor)
        self.slot_of = {d.handle: k for k, d in enumerate(graph.step.slots)}
        self.takes_generator = False  # (the generator passed to an op)
        self.lends_rng = False  # (lent to an op that takes none)
        self.node_call: dict[str, int] = {}  # an op's node -> the step's call it is
        self.input_of: dict[Any, int] = {}  # an input's node -> its index among the inputs

    def alloc(self, d: TensorDesc) -> None:
        """An allocation of the step: a zeroed tensor, as the op-by-op path's buffer."""
        import torch

        kwargs = {"dtype": self.a.dtypes[d.dtype], "device": self.a.device}
        zeros = torch.ops.aten.zeros.default
        node = self.g.call_function(zeros, (list(d.sizes),), kwargs)
        self.made[d.handle] = (node, zeros(list(d.sizes), **kwargs), d)

    def operand(self, d: TensorDesc) -> tuple[Any, Any]:
        """The node and the tensor of operand ``d``: an input of the graph (a buffer the
        step did not make), a tensor the step made, or a view of one."""
        import torch

        graph, seen = self.graph, self.seen
        base = self.made.get(d.handle)
        if base is None:  # a buffer the step did not make: an input of the graph
            key: Any = ("in", d)
            if key not in seen:
                t = self.a.tensor(_bound(d, self.binds))
                node = self.g.placeholder(f"in{len(graph.inputs)}")
                slot = self.slot_of.get(d.handle, -1)
                reach = d.extent - d.offset if d.extent else 0
                whole = _whole(d) if not d.offset else None
                graph.inputs.append((slot, d, next(_INPUT_KEYS), reach, whole))
                self.input_of[node] = len(graph.inputs) - 1
                seen[key] = (node, t)
            return seen[key]
        node, t, out = base
        if d.sizes == out.sizes and d.strides == out.strides and not d.offset:
            return node, t
        key = ("view", d)
        if key not in seen:
            offset = d.offset // TENSOR_DTYPES[d.dtype]
            view = self.g.call_function(
                torch.ops.aten.as_strided.default, (node, d.sizes, d.strides, offset)
            )
            seen[key] = (view, t.as_strided(d.sizes, d.strides, offset))
        return seen[key]

    def aten(self, i: int, call_args: tuple[Any, ...]) -> None:
        """Call ``i`` of the step, an ATen op: run, checked, and added to the graph."""
        a = self.a
        name, tensors, encoded, outputs = call_args
        allowed = resolve_op(name)
        pairs = [self.operand(d) for d in tensors]
        nodes = [p[0] for p in pairs]
        for writes, inputs in (  # (``StepGraph.written``, ``StepGraph.relaid``)
            (allowed.writes, self.graph.written),
            (allowed.relays, self.graph.relaid),
        ):
            for j, arg_name in writes:
                value = encoded[0][j] if j < len(encoded[0]) else encoded[1].get(arg_name)
                for v in value if type(value) is list else [value]:
                    if type(v) is dict and "t" in v and v["t"] < len(nodes):
                        index = self.input_of.get(nodes[v["t"]])
                        if index is not None:
                            inputs.add(index)
        values = [p[1] for p in pairs]
        args_n = [_symbolic(a, v, nodes) for v in encoded[0]]
        kwargs_n = {k: _symbolic(a, v, nodes) for k, v in encoded[1].items()}
        args_v = [a.decode(v, values) for v in encoded[0]]
        kwargs_v = {k: a.decode(v, values) for k, v in encoded[1].items()}
        for j, arg_name in allowed.generators:  # the session's generator, always
            self.takes_generator = True
            if j < len(args_v):
                args_v[j], args_n[j] = a.rng.generator, self.rng_node
            else:
                kwargs_v[arg_name], kwargs_n[arg_name] = a.rng.generator, self.rng_node
        lent = allowed.random_without_generator
        self.lends_rng = self.lends_rng or lent
        try:
            if lent:
                result = a.rng.lent(allowed.op, args_v, kwargs_v)
            else:
                result = allowed.op(*args_v, **kwargs_v)
        except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError) as exc:
            raise GraphCallError(i, name, f"{type(exc).__name__}: {_first_line(exc)}") from None
        if lent:
            node = self.g.call_function(
                _with_session_rng, (self.lender_node, allowed.op, *args_n), kwargs_n
            )
        else:
            node = self.g.call_function(allowed.op, tuple(args_n), kwargs_n)
        self.node_call[node.name] = i
        self._keep(i, name, _made(allowed, result, node), outputs, values)

    def _keep(
        self,
        i: int,
        name: str,
        outs: list[tuple[Any, Any]],
        outputs: tuple[TensorDesc, ...],
        operands: list[Any],
    ) -> None:
        """What call ``i`` made (``outs``: tensor, node), checked against the client's
        ``outputs`` and laid out as they say (copied into that layout where the kernel chose
        another)."""
        import torch

        a = self.a
        if len(outs) != len(outputs):
            raise GraphCallError(
                i, name, f"{name} made {len(outs)} tensors; the client expected {len(outputs)}"
            )
        memory = {v.untyped_storage().data_ptr() for v in operands if isinstance(v, torch.Tensor)}
        for (r, r_node), d in zip(outs, outputs, strict=True):
            if tuple(r.shape) != d.sizes or a.dtypes[d.dtype] != r.dtype:
                raise GraphCallError(
                    i,
                    name,
                    f"{name} made a tensor of {r.dtype} {list(r.shape)}; the client expected "
                    f"{d.dtype} {list(d.sizes)} (its meta kernel disagrees with this device's)",
                )
            if not _laid_out(r, d, memory, a.device):
                n = d.extent // TENSOR_DTYPES[d.dtype]
                r_node = self.g.call_function(_materialized, (r_node, d.sizes, d.strides, n))
                r = _materialized(r, d.sizes, d.strides, n)
            self.made[d.handle] = (r_node, r, d)


class GraphCallError(Exception):
    """Call ``index`` of a step run as one graph failed (-1: which one is not known)."""

    def __init__(self, index: int, name: str, message: str) -> None:
        super().__init__(message)
        self.index = index
        self.name = name


def graph_for(s: SessionState, a: AtenSession, step: RecordedStep) -> StepGraph | None:
    """``step``'s graph, to be traced by its next replay (a new ``StepGraph``), or None where
    it replays call by call (recorded on the step, so that it is decided once)."""
    if step.graph is not None:
        return step.graph if isinstance(step.graph, StepGraph) else None
    runtime = a.runtime
    if s.limits.graphs == "ops" or runtime.profile is not None or not runtime.computes:
        step.graph = False
        return None
    try:
        return StepGraph(step)
    except _NotGraphable as exc:
        _log.debug("step %d replays call by call: %s", step.handle, exc)
        step.graph = False
        return None
    except CallFailed:  # an op no longer allowed: the call-by-call path says so
        step.graph = False
        return None


def replay_graph(
    s: SessionState, a: AtenSession, graph: StepGraph, binds: Binds, stream: Any
) -> None:
    """Replay ``graph``'s step with ``binds`` (traced on its first replay): its results
    become the replay's buffers. ``StepError`` for an argument out of bounds; ``GraphCallError``
    names the call that failed."""
    h0 = time.thread_time_ns()
    step = graph.step
    traced = graph.gm is not None
    room = s.device_bytes + graph.made_bytes
    if graph.gm is not None and room > s.limits.max_device_bytes:
        raise CallFailed(
            f"step {step.handle} makes {graph.made_bytes} bytes; this session holds "
            f"{s.device_bytes} and its limit is {s.limits.max_device_bytes}"
        )
    keep = a.runtime.keeps_results

    def job() -> list[Any]:
        with a.isolated():
            if graph.gm is None:
                step.graph = graph  # (a failed trace leaves step.graph None: traced again)
                try:
                    return graph.trace(s, a, binds)
                except BaseException:
                    step.graph = None
                    raise
            try:
                inputs = graph.inputs_of(s, a, binds)
                return list(graph.run(inputs, s.limits.graphs, _budget(s)))
            finally:
                graph.let_go()

    results = a.runtime.run(job, [], [], stream)
    buffers = s.buffers
    s.check_room(len(results))
    handles = [binds[h][0] for h in graph._result_keys]
    if not buffers.keys().isdisjoint(handles) or len(set(handles)) < len(handles):
        in_use = next(h for k, h in enumerate(handles) if h in buffers or h in handles[:k])
        raise CallFailed(f"buffer handle {in_use} is already in use")
    made: set[int] = set()  # the results' memory: two of them never one buffer's
    kept: list[tuple[int, Any, int, str, Any]] = []
    for r, d, handle, extent, whole in zip(
        results, graph.results, handles, graph.extents, graph.wholes, strict=True
    ):
        # the trace made each result the client's layout, from byte 0 of its own memory
        storage = r.untyped_storage()
        address = storage.data_ptr()
        if (
            keep
            and r.storage_offset() == 0
            and storage.nbytes() == extent
            and (address not in made or not extent)
        ):
            made.add(address)
            # (the view a graph's input of its layout reads: r itself)
            kept.append((handle, r, extent, d.dtype, whole))
        elif keep:  # (copied into a buffer of its own)
            a.operand_memory = made | {address}
            a.keep_outputs(f"step {step.handle}", [r], [d._replace(handle=handle)])
        else:
            s.alloc(handle, extent)
            a.fill_outputs(f"step {step.handle}", [r], [d._replace(handle=handle)])
    a.keep_as_is(kept)
    if traced:
        graph.replay_thread_ns += time.thread_time_ns() - h0


def _budget(s: SessionState) -> Callable[[float], None]:
    """Charges the session's compile time; ``CallFailed`` before a compile past its budget."""

    def charge(seconds: float) -> None:
        if seconds < 0:  # asked before compiling: is anything left?
            if s.compile_s >= s.limits.max_compile_s:
                raise CallFailed(
                    f"this session has spent {s.compile_s:.1f} s compiling graphs; its budget "
                    f"is {s.limits.max_compile_s:g} s (the proxy's --max-compile-s)"
                )
            return
        s.compile_s += seconds

    return charge


def _compiled(
    graph: StepGraph, inputs: list[Any], budget: Callable[[float], None], mode: str
) -> tuple[Any, Any]:
    """``graph`` compiled by inductor (found in the cache, else compiled within the
    session's budget; one compile at a time: inductor's and TorchDynamo's state is the
    process's) and its outputs for ``inputs``."""
    import torch

    cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs[2:])
    # (random ops lent the session's generator: inductor's kernels, never a CUDA graph,
    # whose replays would draw the numbers of its capture)
    graphed = mode == "cudagraphs" and cuda and not graph.lends_rng
    compile_mode = "reduce-overhead" if graphed else None
    key = _content_key(graph, inputs, f"{compile_mode} {graph.lends_rng}")
    with _COMPILE_LOCK:
        fn = _COMPILED.get(key)
        if fn is not None:
            _COMPILED.move_to_end(key)
            found = True
        else:
            found = False
            budget(-1.0)
            t0 = time.perf_counter()
            try:
                if compile_mode is None:
                    fn = _inductor(graph.gm, inputs)
                else:  # (CUDA graphs: inductor's own, behind a TorchDynamo frame)
                    fn = torch.compile(
                        graph.gm.forward,
                        backend="inductor",
                        fullgraph=True,
                        dynamic=False,
                        mode=compile_mode,
                    )
                out = fn(*inputs)  # (compiles first, behind TorchDynamo)
            finally:
                budget(time.perf_counter() - t0)
            _COMPILED[key] = fn
            while len(_COMPILED) > _COMPILED_MAX:
                _COMPILED.popitem(last=False)
    if found:
        out = fn(*inputs)
    return fn, out


def _inductor(gm: Any, inputs: list[Any]) -> Callable[..., Any]:
    """Graph ``gm`` compiled by inductor as it is (``torch._inductor.compile``): no
    TorchDynamo frame in front, whose guards would check every input on every call (they hold
    by construction: each input is a view of its recorded layout, the graph's code and the
    inputs' aliasing are the cache's key). A graph whose random ops take no generator
    (``_with_session_rng``'s) is compiled with inductor's ``fallback_random``: each such op
    runs ATen's kernel on the device's default generator, as eager ops draw, bit for bit
    (inductor keeps the inputs' strides for them), and each call lends the calling
    session's generator to the default one for the whole graph (the first of its inputs
    after the generator itself: ``SessionGenerator.lent``)."""
    import torch
    import torch._inductor
    import torch._inductor.config

    g = torch.fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    draws = False
    for node in g.nodes:
        if node.op == "call_function" and node.target is _with_session_rng:
            node.target, node.args = node.args[1], node.args[2:]
            draws = True
    for node in [n for n in g.nodes if n.op == "placeholder"][:2]:  # (rng, lender: unused)
        g.erase_node(node)
    module = torch.fx.GraphModule(torch.nn.Module(), g)
    with torch._inductor.config.patch(fallback_random=draws):
        core = torch._inductor.compile(module, inputs[2:])

    if not draws:

        def run(*args: Any) -> Any:
            return core(*args[2:])

        return run

    def run_lent(*args: Any) -> Any:
        return args[1].lent(core, list(args[2:]), {})

    return run_lent


def _content_key(graph: StepGraph, inputs: list[Any], options: str) -> str:
    """What a compiled graph depends on: its code, its inputs' layouts and aliasing, how it
    is compiled."""
    h = hashlib.sha256(graph.gm.code.encode())
    h.update(options.encode())
    groups: dict[int, int] = {}
    for t in inputs[2:]:
        ptr = t.untyped_storage().data_ptr()
        group = groups.setdefault(ptr, len(groups))
        h.update(repr((group, tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)).encode())
    return h.hexdigest()


def _whole(d: TensorDesc) -> str:
    """The key, among a buffer's views, of tensor ``d`` laid out from the buffer's byte 0
    (a graph's result is kept under it: a later graph's input of that layout is it). A
    string, which keeps its hash: each replay looks such keys up by the hundred (the other
    keys there are tuples and array descriptors, never strings)."""
    return f"whole {d.dtype} {d.sizes} {d.strides}"


def _bound(d: TensorDesc, binds: Binds) -> TensorDesc:
    b = binds.get(d.handle)
    if b is None:
        return d
    offset = d.offset + b[1]
    if offset < 0:
        raise StepError("an argument's offset would move the step's views before its buffer")
    return TensorDesc(b[0], offset, d.sizes, d.strides, d.dtype)


def _symbolic(a: AtenSession, value: Any, nodes: list[Any]) -> Any:
    """An encoded argument as the graph takes it: tensors as their nodes."""
    t = type(value)
    if t is list:
        return [_symbolic(a, v, nodes) for v in value]
    if t is dict and "t" in value:
        return nodes[value["t"]]
    return a.decode(value, ())


def _made(allowed: AllowedOp, result: Any, node: Any) -> list[tuple[Any, Any]]:
    """The tensors op ``allowed`` made (not those it wrote), each with its graph node."""
    import torch

    out: list[tuple[Any, Any]] = []
    graph = node.graph
    single = allowed.n_returns == 1
    values = (result,) if single else tuple(result) if allowed.n_returns else ()
    for i, ((is_list, aliases), r) in enumerate(zip(allowed.returns, values, strict=True)):
        if aliases:
            continue
        r_node = node if single else graph.call_function(operator.getitem, (node, i))
        if is_list:
            for j, x in enumerate(r):
                out.append((x, graph.call_function(operator.getitem, (r_node, j))))
        elif isinstance(r, torch.Tensor):
            out.append((r, r_node))
    return out


def _laid_out(r: Any, d: TensorDesc, operand_memory: set[int], device: Any) -> bool:
    """Whether tensor ``r`` is buffer ``d`` as the client laid it out (its own memory, dense,
    from byte 0), so that the views the client takes of it are views of ``r``."""
    return bool(
        r.untyped_storage().data_ptr() not in operand_memory
        and tuple(r.stride()) == d.strides
        and r.storage_offset() == 0
        and r.untyped_storage().nbytes() == d.extent
        and r.device == device
        and r._base is None
        and r.numel() * r.element_size() == d.extent
    )


def _with_session_rng(lender: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Random op ``op``, which takes no generator, run on the session's (``lender``: its
    ``SessionGenerator``)."""
    return lender.lent(op, list(args), kwargs)


def _materialized(r: Any, sizes: Any, strides: Any, n: int) -> Any:
    """``r`` copied into a zeroed tensor of ``n`` elements laid out as ``sizes``/``strides``
    (a layout the client chose that the kernel did not)."""
    out = r.new_zeros(n).as_strided(sizes, strides, 0)
    out.copy_(r)
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:400] if text else type(exc).__name__
