"""What PyTorch's dispatcher hands the ``gpuremote`` device, and what is sent for it.

- **Factories** (``empty``, ``empty_strided``): a new remote buffer (one ASYNC ``alloc``).
- **Views** (ops whose schema returns an alias of an input: ``view``, ``t``, ``select``,
  ``as_strided``, ``detach``...): metadata only, run by the CPU kernels on the same storage;
  nothing is sent.
- **Transfers** (``_copy_from``): host to device (``copy_h2d``, ASYNC), device to host
  (``copy_d2h``, SYNC), device to device (the ATen ``copy_`` on the proxy).
- **Every other op**, through one fallback: its outputs' metadata from the meta kernels (run
  once per signature, then cached), new output tensors made here, and one ASYNC ``aten`` call
  queued in the session's batches; nothing waits. After the first call of a signature,
  which the session keeps on its proxy by template, a call of positional arguments sends
  only where its operands are (``aten_call``), made from their signature alone. Ops whose
  results depend on the data (``nonzero``, masks, ``.item()``) or whose meta kernel cannot
  tell are one SYNC ``aten_dynamic`` call. A shape or dtype error is raised here, by the
  meta kernel, as the same ``RuntimeError`` the local op would raise; the session goes on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.driver import SyncDriver
from ..errors import RemoteCallError
from ..ops.aten import returns
from ..wire.calls import CALLS_BY_NAME
from ._encoding import Encoder, quick_signature
from ._guard import current_device
from ._templates import keep
from ._tensors import (
    DEVICE,
    DTYPE_NAMES,
    contiguous_strides,
    describe,
    extent,
    is_remote,
    new_tensor,
)
from ._transfers import Transfers

__all__ = ["Dispatcher", "NeedsData", "contiguous_strides", "restride"]

_C = CALLS_BY_NAME
_ATEN, _ATEN_DYNAMIC, _ALLOC = _C["aten"], _C["aten_dynamic"], _C["alloc"]
_ATEN_SHAPES = _C["aten_shapes"]
_ATEN_CALL = _C["aten_call"]
_SEED = _C["aten_seed"]
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
#: the tags of the ops whose results depend on the data (``nonzero``, ``.item()``)
_NEEDS_DATA_TAGS = frozenset({torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output})


class NeedsData(RuntimeError):
    """A meta kernel met an op that needs the data (``.item()`` inside a composite op):
    the op's results come from the proxy (``_local_scalar_dense``'s meta kernel, which
    ``install`` registers, raises it with torch's own message)."""


#: ops whose non-tensor answer depends on the signature alone: asked once, then kept
_ASK_ONCE = frozenset({"_fused_sdp_choice"})
#: the ops whose meta kernels lay out some of their outputs otherwise than the CPU's (and
#: the GPU's) kernels do, and when: their outputs' metadata then comes from the proxy's
#: kernel, asked once per signature (``aten_shapes``). Found by running models and PyTorch's
#: OpInfos with ``GPUREMOTE_TORCH_CHECK_LAYOUTS=1``; a layout the client takes from a meta
#: kernel that the proxy's kernel does not make costs a copy on the proxy and can change
#: the order of a later reduction (results differing in their last bits), and another
#: shape or dtype is refused by the proxy.
_SHAPES_FROM_DEVICE: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], bool]] = {}


def _from_device_when(
    *packets: str,
) -> Callable[[Callable[[tuple[Any, ...], dict[str, Any]], bool]], Any]:
    def register(rule: Callable[[tuple[Any, ...], dict[str, Any]], bool]) -> Any:
        for p in packets:
            _SHAPES_FROM_DEVICE[p] = rule
        return rule

    return register


@_from_device_when(
    "_embedding_bag", "_embedding_bag_forward_only", "_fft_r2c", "_linalg_svd", "linalg_eig"
)
def _always(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``_embedding_bag``'s ``offset2bag`` and ``max_indices``, the layouts of an FFT's and
    an SVD's results."""
    return True


@_from_device_when("native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update")
def _batch_norm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The saved statistics: empty in eval mode, and of the input's dtype in half
    precision on the CPU (float32 by the meta kernels)."""
    training = args[5] if len(args) > 5 else kwargs.get("training", True)
    return args[0].dtype in _HALF or (type(training) is bool and not training)


@_from_device_when("native_layer_norm")
def _half_or_strided(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``native_layer_norm``'s saved statistics in half precision; any op's results where
    an operand is not contiguous (the CPU's kernels then lay out their results their own
    way)."""
    return args[0].dtype in _HALF or _strided(args, kwargs)


@_from_device_when("convolution", "convolution_backward", "native_layer_norm_backward")
def _strided(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A tensor operand that is not contiguous (a channels-last image)."""
    return any(
        isinstance(a, torch.Tensor) and not a.is_contiguous() for a in (*args, *kwargs.values())
    )


_HALF = (torch.float16, torch.bfloat16)
#: ops whose index tensors may be on the CPU while the indexed tensor is on the device
_CPU_INDEX_OPS = frozenset(
    {
        "index",
        "index_put",
        "index_put_",
        "_index_put_impl_",
        "_unsafe_index",
        "_unsafe_index_put",
    }
)
#: ops that are metadata only though their schema does not say so (``set_`` points a tensor
#: at a storage: the storage's identity is the remote buffer's)
_METADATA_ONLY = frozenset({"_unsafe_view", "_reshape_alias", "lift_fresh", "alias", "set_"})


class _Plan:
    """How to run one op (per op, from its schema): is it a view, does it depend on the
    data, and where each of its returns comes from."""

    __slots__ = (
        "cpu_indices",
        "dynamic",
        "in_place",
        "name",
        "one_new",
        "out_args",
        "returns",
        "scalar_ops",
        "shapes_from_device",
        "tensor_slots",
        "view",
    )

    def __init__(self, op: torch._ops.OpOverload) -> None:
        schema = op._schema
        packet = schema.name.split("::", 1)[1]
        self.name = f"{packet}.{schema.overload_name or 'default'}"
        self.view = packet in _METADATA_ONLY or any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
        # an op returning a number waits for it; one whose shapes depend on the data waits
        # where its meta kernel cannot tell them (``index`` with a mask, not with indices)
        self.dynamic = any(
            str(r.type) not in ("Tensor", "List[Tensor]") for r in schema.returns
        ) or any(t in _NEEDS_DATA_TAGS for t in op.tags)
        #: per return: (position, name) of the argument it is (in-place, out=), else None
        self.returns: list[tuple[int, str] | None] = []
        for r in schema.returns:
            source = None
            if r.alias_info is not None:
                for i, a in enumerate(schema.arguments):
                    if a.alias_info is not None and a.alias_info.before_set == (
                        r.alias_info.before_set
                    ):
                        source = (i, a.name)
                        break
            self.returns.append(source)
        #: it returns one value, made by the op (not an operand)
        self.one_new = self.returns == [None]
        #: whether its outputs' metadata comes from the proxy (``_SHAPES_FROM_DEVICE``)
        self.shapes_from_device = _SHAPES_FROM_DEVICE.get(packet)
        #: it takes index tensors on the CPU as well (uploaded first), as ATen does
        self.cpu_indices = packet in _CPU_INDEX_OPS
        #: (position, name) of its out= arguments
        self.out_args = [(i, a.name) for i, a in enumerate(schema.arguments) if a.is_out]
        #: (position, name) of each argument that takes one tensor
        self.tensor_slots = [
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if str(a.type) in ("Tensor", "Optional[Tensor]")
        ]
        #: the arguments given as numbers -> the overload taking them as numbers (or None)
        self.scalar_ops: dict[tuple[int, ...], torch._ops.OpOverload | None] = {}
        #: every return is an operand it writes in place (none is new, none an out=, which
        #: may be resized): the outputs' metadata does not depend on float arguments
        self.in_place = all(
            source is not None and not schema.arguments[source[0]].is_out for source in self.returns
        ) and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)

    def native_entry(self) -> tuple[Any, ...]:
        """What the guard library's ``call`` needs of this plan: (the plan, how the op
        returns: 0 one new tensor, 1 one argument, 2 nothing, 3 otherwise; whether its
        floats matter to its signature; that argument's position and name)."""
        if self.one_new:
            return (self, 0, not self.in_place, -1, "")
        if len(self.returns) == 1 and self.returns[0] is not None:
            pos, name = self.returns[0]
            return (self, 1, not self.in_place, pos, name)
        return (self, 2 if not self.returns else 3, not self.in_place, -1, "")


#: the tensor counts of an op that makes one tensor (``_infer``'s ``counts``)
_ONE = [-1]


class _Uploads(dict[int, Callable[[torch.Tensor], torch.Tensor]]):
    """Device index -> its uploader of CPU scalars, made on first use."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        super().__init__()
        self._dispatcher = dispatcher

    def __missing__(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        upload = self[index] = self._dispatcher.upload_scalar(index)
        return upload


#: ``Dispatcher._by_template``'s answer where the call is not one of a kept template
_MISS = object()


def _outputs(
    d: SyncDriver, news: Sequence[Any], index: int
) -> tuple[list[torch.Tensor | None], list[int]]:
    """The new tensors of an op's outputs (metadata ``news``, None: an undefined tensor,
    a gradient not asked for) on session ``d``, device ``index``; their buffers' handles."""
    outputs: list[torch.Tensor | None] = []
    handles: list[int] = []
    new_handle, release = d.session.new_handle, d._release
    for meta in news:
        if meta is None:
            outputs.append(None)
            continue
        handle = new_handle()
        outputs.append(new_tensor(handle, meta[3], meta[0], meta[1], meta[2], index, release))
        handles.append(handle)
    return outputs, handles


def _argument(args: Sequence[Any], kwargs: dict[str, Any], where: tuple[int, str]) -> Any:
    i, name = where
    return args[i] if i < len(args) else kwargs[name]


class Dispatcher:
    """The device's kernels, over the sessions of ``gpuremote:0..k-1`` (``drivers``)."""

    def __init__(self, connect_default: Callable[[], SyncDriver]) -> None:
        #: device index -> the session serving it
        self.drivers: dict[int, SyncDriver] = {}
        self._connect_default = connect_default
        self._plans: dict[int, _Plan] = {}
        #: (op, signature) -> the metadata of its new outputs as its meta kernel gives them
        #: (for every session; a proxy's own answers are its session's: ``SyncDriver.metas``)
        self._metas: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self.seed: int | None = None
        #: device index -> what uploads a CPU scalar operand to it
        self._uploads = _Uploads(self)
        #: copies between the host and the device (``_copy_from``)
        self.transfers = Transfers(self)
        #: every op's output layouts (sizes, strides, dtype) are asked of the proxy's kernel
        #: once per signature and checked against the meta kernel's (a round trip each: a
        #: diagnostic, ``GPUREMOTE_TORCH_CHECK_LAYOUTS=1``); the differences found
        self.check_layouts = os.environ.get("GPUREMOTE_TORCH_CHECK_LAYOUTS") == "1"
        self.layout_mismatches: list[tuple[str, Any, Any]] = []
        #: (call, its context, its miss) where the guard library makes an eager op's call by
        #: template whole, in C (``use_native``); the ops it may make so, each to its plan
        self.native: tuple[Callable[..., Any], list[Any], object] | None = None
        self._native_plans: dict[torch._ops.OpOverload, tuple[Any, ...]] = {}

    def use_native(self, call: Callable[..., Any] | None) -> None:
        """``run``'s first step (``_by_template``) by the guard library's ``call`` in C:
        ``call(ctx, op, args, kwargs)`` makes the call as ``_by_template`` does, or answers
        ``ctx[0]`` where it does not (then ``run``); None: by ``run`` alone."""
        from . import _tensors

        if call is None:
            self.native = None
            return
        ctx = [
            _MISS,
            self._native_plans,
            self.drivers,
            _ATEN_CALL,
            _tensors._LIVE,
            _tensors._died,
            _tensors._STATS,
            0,
            self._result,
        ]
        self.native = (call, ctx, _MISS)

    # -- sessions --------------------------------------------------------------------------
    def driver(self, index: int | None) -> SyncDriver:
        index = index or 0
        d = self.drivers.get(index)
        if d is None or d.closed:
            with self._lock:
                d = self.drivers.get(index)
                if d is None or d.closed:
                    if index != 0:
                        raise RuntimeError(
                            f"gpuremote:{index} is not connected (gpuremote.torch.connect("
                            "devices=k) connects gpuremote:0..k-1)"
                        )
                    d = self.drivers[0] = self._connect_default()
        return d

    def manual_seed(self, seed: int) -> None:
        """``torch.manual_seed``: every connected session's generator, and those to come."""
        self.seed = seed & ((1 << 62) - 1)
        for d in list(self.drivers.values()):
            if not d.closed:
                d.post(_SEED, 0, [self.seed])

    # -- tensors ---------------------------------------------------------------------------
    def empty(
        self, sizes: Any, strides: Any, dtype: torch.dtype | None, device: torch.device | None
    ) -> torch.Tensor:
        """A new, uninitialised tensor (one ASYNC ``alloc``)."""
        dtype = dtype or torch.get_default_dtype()
        index = device.index if device is not None else None
        if index is None:  # the current device (gpuremote:0 but where the guard library is)
            index = current_device()
        d = self.driver(index)
        handle = d.session.new_handle()
        nbytes = extent(sizes, strides, _itemsize(dtype))
        d.post(_ALLOC, 0, [handle, nbytes])
        return new_tensor(handle, nbytes, sizes, strides, dtype, index, d._release)

    def upload_scalar(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """What uploads a CPU operand: a scalar beside device tensors, or an index tensor
        (``x[cpu_indices]``, which ATen takes on any device)."""

        def upload(t: torch.Tensor) -> torch.Tensor:
            sizes = list(t.shape)
            remote = self.empty(
                sizes, contiguous_strides(sizes), t.dtype, torch.device(DEVICE, index)
            )
            self.transfers.copy_from(t, remote)
            return remote

        return upload

    # -- the fallback ----------------------------------------------------------------------
    def plan(self, op: torch._ops.OpOverload) -> _Plan:
        plan = self._plans.get(id(op))  # (ops live as long as the process: ids are theirs)
        if plan is None:
            plan = self._plans[id(op)] = _Plan(op)
            if not plan.view and not plan.dynamic:
                self._native_plans[op] = plan.native_entry()
        return plan

    def run(self, op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``op`` (see the module docstring). The path of every op: lookups inlined."""
        plan = self._plans.get(id(op)) or self.plan(op)
        if plan.view:
            return op.redispatch(_CPU_KEYS, *args, **kwargs)
        if not plan.dynamic:
            result = self._by_template(plan, args, kwargs)
            if result is not _MISS:
                return result
        numbers = self._numbers_as_scalars(op, plan, args, kwargs)
        if numbers is not None:  # (before encoding: such a call's signature is never kept)
            result = self.run(*numbers)
            if numbers[0] is not op and not plan.dynamic:
                self._by_template_too(plan, numbers[0], args, kwargs)
            return result
        tensors: list[torch.Tensor] = []
        if len(self.drivers) > 1:  # (each operand checked to be on the op's device)
            index = _index_of(args, kwargs)
            encode = Encoder(
                tensors, self._uploads[index], not plan.in_place, plan.cpu_indices, index
            )
        else:
            index = 0
            encode = Encoder(tensors, self._uploads[0], not plan.in_place, plan.cpu_indices)
        wire_args = [
            [encode(a) for a in args],
            encode.keywords(kwargs) if kwargs else {},
        ]
        d = self.drivers.get(index)
        if d is None or d.closed:
            d = self.driver(index)
        if plan.dynamic:
            return self._dynamic(d, index, op, plan, tensors, wire_args, args, kwargs)
        key = (plan, tuple(encode.sig))  # (encode.signature())
        metas = d.metas.get(key)
        if metas is None:
            # a meta kernel's answer holds for every session; the proxy's, for its own
            metas = self._metas.get(key)
            if metas is None:
                if plan.shapes_from_device is not None and plan.shapes_from_device(args, kwargs):
                    metas = self._ask_shapes(d, plan, wire_args, encode.descs)
                else:
                    metas = self._infer(op, args, kwargs)
                    if metas is not None and self.check_layouts and not metas[1]:
                        metas = self._checked(d, plan, wire_args, encode.descs, metas)
                    elif metas is not None:
                        _bounded(self._metas)[key] = metas
                if metas is None:  # no meta kernel, or the shapes depend on the data
                    return self._dynamic(d, index, op, plan, tensors, wire_args, args, kwargs)
            _bounded(d.metas)[key] = metas
        news, resized, counts = metas
        outputs, handles = _outputs(d, news, index)
        template = None
        if not resized and d.recording is None:  # (a recorded step keeps whole calls)
            kept = d.templates.get(key)
            template = kept[0] if kept else keep(d, key, plan.name, encode, wire_args, metas)
        if template:  # the op's signature is kept on the proxy: the places, the floats
            d.post(_ATEN_CALL, 0, [template, encode.places, handles, encode.floats])
        else:
            operands = encode.descs
            if resized:  # an out= tensor the op resizes (then described again)
                for source, sizes, strides in resized:
                    restride(_argument(args, kwargs, source), sizes, strides)
                operands = [describe(t) for t in tensors]
            made = [m for m in news if m is not None]
            descs = [[h, 0, m[0], m[1], m[4]] for h, m in zip(handles, made, strict=True)]
            d.post(_ATEN, 0, [plan.name, operands, wire_args, descs])
        if plan.one_new and counts == _ONE:  # the common case: one new tensor
            return outputs[0]
        return self._result(plan, args, kwargs, iter(outputs), counts)

    def _by_template(self, plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call of an op whose signature the session keeps by template, made from its
        arguments' signature alone (``quick_signature``): no wire form built; ``_MISS``
        where it is not such a call (``run`` then goes the whole way)."""
        d = self.drivers.get(0)
        if d is None or d.closed or d.recording is not None or len(self.drivers) > 1:
            return _MISS
        if d.native_calls is None:  # (what the guard library's ``call`` makes calls with)
            d.native_calls = (
                d.templates,
                d.session.new_handle,
                d._release,
                d._posted,
                d._policy,
                d._posted_more,
            )
        quick = quick_signature(args, kwargs, not plan.in_place)
        if quick is None:
            return _MISS
        sig, places, floats = quick
        kept = d.templates.get((plan, tuple(sig)))
        if kept is None:
            return _MISS
        template, (news, _, counts) = kept  # (kept: no out= tensor the op resizes)
        outputs, handles = _outputs(d, news, 0)
        d.post(_ATEN_CALL, 0, [template, places, handles, floats])
        if plan.one_new and counts == _ONE:
            return outputs[0]
        return self._result(plan, args, kwargs, iter(outputs), counts)

    def _by_template_too(
        self,
        plan: _Plan,
        scalar_op: torch._ops.OpOverload,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """``plan``'s call ``args``, which passed numbers for tensors, is the template of
        ``scalar_op`` with the same arguments (where the session keeps that one): its next
        calls find it at once (``x * 0.5``, ``x.add_(1)``: else each call looked itself up,
        missed, and looked up the scalar overload's call again)."""
        d = self.drivers.get(0)
        scalar_plan = self._plans.get(id(scalar_op))
        if (
            d is None
            or d.recording is not None
            or len(self.drivers) > 1
            or scalar_plan is None
            or scalar_plan.returns != plan.returns
            or scalar_plan.in_place != plan.in_place
        ):
            return
        quick = quick_signature(args, kwargs, not plan.in_place)
        if quick is not None:
            sig = tuple(quick[0])
            kept = d.templates.get((scalar_plan, sig))
            if kept is not None:  # (not one more template: the proxy's is the same)
                d.templates[(plan, sig)] = kept

    def _numbers_as_scalars(
        self, op: torch._ops.OpOverload, plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[torch._ops.OpOverload, tuple[Any, ...], dict[str, Any]] | None:
        """The same call, where a C++ composite passed Python numbers for tensors (PyTorch
        hands a Python kernel its wrapped numbers as numbers: ``x % 3`` reaches the device
        as ``remainder.Tensor(x, 3)``): the overload taking them as numbers, whose own
        kernel wraps them as ATen does (None: no number in a tensor's place)."""
        at = tuple(
            i
            for i, (pos, name) in enumerate(plan.tensor_slots)
            if type(args[pos] if pos < len(args) else kwargs.get(name)) in _NUMBERS
        )
        if not at:
            return None
        if at not in plan.scalar_ops:
            plan.scalar_ops[at] = _scalar_overload(op, {plan.tensor_slots[i][0] for i in at})
        scalar_op = plan.scalar_ops[at]
        if scalar_op is not None:
            return scalar_op, args, kwargs
        # no such overload: each number as a 0-dim CPU tensor (ATen's scalar_to_tensor)
        positional, keywords = list(args), dict(kwargs)
        for i in at:
            pos, name = plan.tensor_slots[i]
            if pos < len(positional):
                value = positional[pos]
                positional[pos] = torch.scalar_tensor(value, dtype=_number_dtype(value))
            else:
                value = keywords[name]
                keywords[name] = torch.scalar_tensor(value, dtype=_number_dtype(value))
        return op, tuple(positional), keywords

    def _checked(
        self, d: SyncDriver, plan: _Plan, wire_args: list[Any], descs: list[list[Any]], metas: Any
    ) -> Any:
        """``check_layouts``: the meta kernel's layouts against the proxy kernel's (one
        ``aten_shapes`` per signature); where they differ, the proxy's, and a record."""
        device = self._ask_shapes(d, plan, wire_args, descs)
        mine = [_layout(m) for m in metas[0]]
        theirs = [_layout(m) for m in device[0]]
        if mine != theirs:
            self.layout_mismatches.append((plan.name, mine, theirs))
            return device
        return metas

    def _ask_shapes(
        self, d: SyncDriver, plan: _Plan, wire_args: list[Any], descs: list[list[Any]]
    ) -> Any:
        """``_infer``'s answer from the proxy's kernel (``_SHAPES_FROM_DEVICE``): one SYNC
        ``aten_shapes``, no part of a step being recorded (it asks about the signature)."""
        recording = d.recording
        d.recording = None
        try:
            reply, _ = d.call(_ATEN_SHAPES, [plan.name, descs, wire_args])
        except RemoteCallError as exc:
            if exc.deferred or exc.call != "aten_shapes":  # an earlier call's error
                raise
            raise RuntimeError(f"{plan.name} failed on the proxy: {exc.message}") from exc
        finally:
            d.recording = recording
        news: list[tuple[list[int], list[int], torch.dtype, int, str] | None] = []
        counts: list[int] = []
        for source, value in zip(plan.returns, reply, strict=True):
            if source is not None:
                continue
            many = type(value) is list
            for t in value if many else [value]:
                if t is None:
                    news.append(None)
                    continue
                sizes, strides, name = t["t"]
                dtype = getattr(torch, name)
                nbytes = extent(sizes, strides, _itemsize(dtype))
                news.append((sizes, strides, dtype, nbytes, name))
            counts.append(len(value) if many else -1)
        return news, [], counts

    def _out_by_functional(
        self, op: torch._ops.OpOverload, plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """An out= op whose outputs' shapes only the proxy knows (no meta kernel): its
        functional overload, whose results are then copied into the out= tensors (resized,
        as the out= kernel would)."""
        functional = _functional_overload(op)
        if functional is None:
            raise NotImplementedError(
                f"gpuremote: {plan.name} has out= arguments whose shapes depend on the data, "
                "and no functional overload to run instead"
            )
        outs = []
        rest_args, rest_kwargs = list(args), dict(kwargs)
        for pos, name in reversed(plan.out_args):
            if name in rest_kwargs:
                outs.append(rest_kwargs.pop(name))
            else:
                outs.append(rest_args.pop(pos))
        outs.reverse()
        results = self.run(functional, tuple(rest_args), rest_kwargs)
        results = results if isinstance(results, (list, tuple)) else (results,)
        for out, result in zip(outs, results, strict=True):
            if out.shape != result.shape:
                out.resize_(result.shape)
            out.copy_(result)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _infer(
        self, op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The metadata of the tensors ``op`` makes, and of the out= tensors it resizes,
        from its meta kernel (None: it has none, or its results' shapes depend on the
        data). Errors of the arguments (shapes, dtypes) are raised as the local op raises
        them."""

        def to_meta(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                if x.device.type == "cpu" and x.dim() == 0:  # uploaded by the encoder
                    return torch.empty((), dtype=x.dtype, device="meta")
                if is_remote(x):
                    return torch.empty_strided(
                        x.shape, x.stride(), dtype=x.dtype, device="meta"
                    ).requires_grad_(False)
                return x
            if isinstance(x, torch.device) and x.type == DEVICE:
                return torch.device("meta")
            if isinstance(x, (list, tuple)):
                return type(x)(to_meta(v) for v in x)
            return x

        margs = [to_meta(a) for a in args]
        mkwargs = {k: to_meta(v) for k, v in kwargs.items()}
        try:
            result = op(*margs, **mkwargs)
        except (NotImplementedError, NeedsData):  # no meta kernel; an op in it reads data
            return None
        # any other error is the arguments', raised as the local op raises it
        plan = self.plan(op)
        results = returns(result, len(plan.returns))
        news: list[tuple[list[int], list[int], torch.dtype, int, str] | None] = []
        resized: list[tuple[tuple[int, str], list[int], list[int]]] = []
        counts: list[int] = []  # per return made: its number of tensors (-1: one, not a list)
        for source, r in zip(plan.returns, results, strict=True):
            if source is not None:
                if isinstance(r, torch.Tensor):
                    arg = _argument(args, kwargs, source)
                    if arg.shape != r.shape or arg.stride() != r.stride():
                        resized.append((source, list(r.shape), list(r.stride())))
                continue
            many = isinstance(r, (list, tuple))
            for t in r if many else (r,):
                if t is None:
                    news.append(None)
                    continue
                sizes, strides = list(t.shape), list(t.stride())
                nbytes = extent(sizes, strides, _itemsize(t.dtype))
                news.append((sizes, strides, t.dtype, nbytes, DTYPE_NAMES[t.dtype]))
            counts.append(len(r) if many else -1)
        return news, resized, counts

    def _result(
        self,
        plan: _Plan,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        made: Any,
        counts: Sequence[int],
    ) -> Any:
        """The op's result: its operands where it returns them, else the tensors made."""
        out: list[Any] = []
        count = iter(counts)
        for source in plan.returns:
            if source is not None:
                out.append(_argument(args, kwargs, source))
                continue
            n = next(count)
            out.append(next(made) if n < 0 else [next(made) for _ in range(n)])
        return _unreturn(out)

    def _dynamic(
        self,
        d: SyncDriver,
        index: int,
        op: torch._ops.OpOverload,
        plan: _Plan,
        tensors: list[torch.Tensor],
        wire_args: list[Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run ``op`` on the proxy and wait: its results' shapes (or values) come back."""
        if plan.out_args:  # out= tensors the op may resize, to shapes only it knows
            return self._out_by_functional(op, plan, args, kwargs)
        ask_once = plan.name.split(".")[0] in _ASK_ONCE
        key = None
        if ask_once:
            key = (plan, Encoder(list(tensors), self._uploads[index]).signature_of(args, kwargs))
            answer = d.metas.get(key)  # (the proxy's answer: its session's alone)
            if answer is not None:
                return answer
        n_new = sum(
            1
            for source, r in zip(plan.returns, op._schema.returns, strict=True)
            if source is None and str(r.type) == "Tensor"
        )
        if any(str(r.type) == "List[Tensor]" for r in op._schema.returns):
            raise NotImplementedError(
                f"gpuremote: {plan.name} returns a list of tensors of data-dependent shapes"
            )
        handles = [d.session.new_handle() for _ in range(n_new)]
        # a question about the signature alone is no part of a step being recorded
        recording = d.recording
        if ask_once:
            d.recording = None
        try:
            reply, _ = d.call(
                _ATEN_DYNAMIC, [plan.name, [describe(t) for t in tensors], wire_args, handles]
            )
        except RemoteCallError as exc:
            if exc.deferred or exc.call != "aten_dynamic":  # an earlier call's error
                raise
            raise RuntimeError(f"{plan.name} failed on the proxy: {exc.message}") from exc
        finally:
            d.recording = recording
        new = iter(handles)
        out: list[Any] = []
        for source, value in zip(plan.returns, reply, strict=True):
            if source is not None:
                out.append(_argument(args, kwargs, source))
            elif type(value) is dict and "t" in value:
                sizes, dtype_name = value["t"]
                dtype = getattr(torch, dtype_name)
                strides = contiguous_strides(sizes)
                handle = next(new)
                nbytes = extent(sizes, strides, _itemsize(dtype))
                out.append(new_tensor(handle, nbytes, sizes, strides, dtype, index, d._release))
            elif type(value) is dict and "c" in value:
                out.append(complex(*value["c"]))
            else:
                out.append(value)
        answer = _unreturn(out)
        if key is not None:
            _bounded(d.metas)[key] = answer
        return answer


_NUMBERS = (bool, int, float, complex)


def _bounded(cache: dict[Any, Any]) -> dict[Any, Any]:
    """``cache``, emptied where it holds 65,536 answers (a program of endless signatures)."""
    if len(cache) > 65536:
        cache.clear()
    return cache


def _index_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The device index of an op's call: its first remote operand's, else its ``device=``'s,
    else the current device."""
    for a in (*args, *kwargs.values()):
        if is_remote(a):
            return a.device.index or 0
        if isinstance(a, (list, tuple)):
            for x in a:
                if is_remote(x):
                    return x.device.index or 0
    device = kwargs.get("device")
    if isinstance(device, torch.device) and device.index is not None:
        return device.index
    return current_device()


def _layout(meta: Any) -> Any:
    """A new tensor's metadata as its memory is laid out: sizes, dtype, and the strides of
    the dimensions longer than one (the others' strides say nothing)."""
    if meta is None:
        return None
    sizes, strides, dtype = meta[:3]
    if 0 in sizes:
        return sizes, dtype
    return sizes, [st for n, st in zip(sizes, strides, strict=True) if n > 1], dtype


def _number_dtype(value: Any) -> torch.dtype:
    """The dtype ATen gives a wrapped Python number."""
    if type(value) is bool:
        return torch.bool
    if type(value) is int:
        return torch.int64
    if type(value) is complex:
        return torch.complex128 if torch.get_default_dtype() == torch.float64 else torch.complex64
    return torch.get_default_dtype()


def _scalar_overload(op: torch._ops.OpOverload, positions: set[int]) -> Any:
    """The overload of ``op``'s packet that takes the arguments at ``positions`` as numbers
    (``Scalar``) and is otherwise the same; None where there is none."""
    schema = op._schema
    packet = getattr(torch.ops.aten, schema.name.split("::", 1)[1], None)
    if packet is None:
        return None
    want = ["number" if i in positions else str(a.type) for i, a in enumerate(schema.arguments)]
    returns = [str(r.type) for r in schema.returns]
    for overload in packet.overloads():
        other = getattr(packet, overload)._schema
        if [
            str(a.type).replace("Optional[number]", "number") for a in other.arguments
        ] == want and [str(r.type) for r in other.returns] == returns:
            return getattr(packet, overload)
    return None


def _functional_overload(op: torch._ops.OpOverload) -> Any:
    """The overload of out= op ``op`` that returns new tensors (``x.out`` -> ``x.default``,
    ``x.y_out`` -> ``x.y``), taking the same other arguments; None where there is none."""
    schema = op._schema
    name = schema.overload_name
    base = "default" if name == "out" else name.removesuffix("_out")
    packet = getattr(torch.ops.aten, schema.name.split("::", 1)[1])
    if base == name or base not in packet.overloads():
        return None
    functional = getattr(packet, base)
    want = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
    have = [(a.name, str(a.type)) for a in functional._schema.arguments]
    return functional if want == have else None


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


def _unreturn(values: list[Any]) -> Any:
    """An op's result from one value per return (``None`` for none)."""
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def restride(t: torch.Tensor, sizes: list[int], strides: list[int]) -> None:
    """Give remote tensor ``t`` these sizes and strides (a larger buffer where it needs one,
    as ``resize_`` does)."""
    need = extent(sizes, strides, t.element_size()) + t.storage_offset() * t.element_size()
    storage = t.untyped_storage()
    offset = t.storage_offset()
    if need > storage.nbytes():
        fresh = torch.empty_strided(sizes, strides, dtype=t.dtype, device=t.device)
        storage, offset = fresh.untyped_storage(), 0
    _set_storage.redispatch(_CPU_KEYS, t, storage, offset, sizes, strides)


_set_storage = torch.ops.aten.set_.source_Storage_storage_offset
