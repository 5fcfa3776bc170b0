"""What PyTorch's dispatcher hands the ``gpuremote`` device, and what is sent for it.

- **Factories** (``empty``, ``empty_strided``): a new remote buffer (one ASYNC ``alloc``).
- **Views** (ops whose schema returns an alias of an input: ``view``, ``t``, ``select``,
  ``as_strided``, ``detach``...): metadata only, run by the CPU kernels on the same storage;
  nothing is sent.
- **Transfers** (``_copy_from``): host to device (``copy_h2d``, ASYNC), device to host
  (``copy_d2h``, SYNC), device to device (the ATen ``copy_`` on the proxy).
- **Every other op**, through one fallback: its outputs' metadata from the meta kernels (run
  once per signature, then cached), new output tensors made here, and one ASYNC ``aten`` call
  queued in the session's batches; nothing waits. Ops whose results depend on the data
  (``nonzero``, masks, ``.item()``) or whose meta kernel cannot tell are one SYNC
  ``aten_dynamic`` call. A shape or dtype error is raised here, by the meta kernel, as the
  same ``RuntimeError`` the local op would raise; the session goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..core.driver import SyncDriver
from ..errors import RemoteCallError
from ..wire.calls import BUFFER, CALLS_BY_NAME
from ._encoding import Encoder
from ._tensors import (
    DEVICE,
    DTYPE_NAMES,
    byte_desc,
    describe,
    extent,
    is_remote,
    new_tensor,
)

__all__ = ["Dispatcher", "contiguous_strides", "restride"]

_C = CALLS_BY_NAME
_ATEN, _ATEN_DYNAMIC, _ALLOC = _C["aten"], _C["aten_dynamic"], _C["alloc"]
_H2D, _D2H, _SEED = _C["copy_h2d"], _C["copy_d2h"], _C["aten_seed"]
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
#: ops whose non-tensor answer depends on the signature alone: asked once, then kept
_ASK_ONCE = frozenset({"_fused_sdp_choice"})
#: ops that are metadata only though their schema does not say so (``set_`` points a tensor
#: at a storage: the storage's identity is the remote buffer's)
_METADATA_ONLY = frozenset({"_unsafe_view", "_reshape_alias", "lift_fresh", "alias", "set_"})


class _Plan:
    """How to run one op (per op, from its schema): is it a view, does it depend on the
    data, and where each of its returns comes from."""

    __slots__ = ("dynamic", "in_place", "name", "one_new", "returns", "view")

    def __init__(self, op: torch._ops.OpOverload) -> None:
        schema = op._schema
        packet = schema.name.split("::", 1)[1]
        self.name = f"{packet}.{schema.overload_name or 'default'}"
        self.view = packet in _METADATA_ONLY or any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
        # an op returning a number waits for it; one whose shapes depend on the data waits
        # where its meta kernel cannot tell them (``index`` with a mask, not with indices)
        self.dynamic = any(str(r.type) not in ("Tensor", "List[Tensor]") for r in schema.returns)
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
        #: every return is an operand it writes in place (none is new, none an out=, which
        #: may be resized): the outputs' metadata does not depend on float arguments
        self.in_place = all(
            source is not None and not schema.arguments[source[0]].is_out for source in self.returns
        ) and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


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
        #: (op, signature) -> the metadata of its new outputs, or the proxy's answer
        self._metas: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self.seed: int | None = None
        #: device index -> what uploads a CPU scalar operand to it
        self._uploads = _Uploads(self)

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
        index = (device.index if device is not None else None) or 0
        d = self.driver(index)
        handle = d.session.new_handle()
        nbytes = extent(sizes, strides, _itemsize(dtype))
        d.post(_ALLOC, 0, [handle, nbytes])
        return new_tensor(handle, nbytes, sizes, strides, dtype, index, d._release)

    def upload_scalar(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """What uploads a CPU scalar tensor (an op's operand beside device tensors)."""

        def upload(t: torch.Tensor) -> torch.Tensor:
            remote = self.empty([], [], t.dtype, torch.device(DEVICE, index))
            self.copy_from(t, remote)
            return remote

        return upload

    # -- the fallback ----------------------------------------------------------------------
    def plan(self, op: torch._ops.OpOverload) -> _Plan:
        plan = self._plans.get(id(op))  # (ops live as long as the process: ids are theirs)
        if plan is None:
            plan = self._plans[id(op)] = _Plan(op)
        return plan

    def run(self, op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``op`` (see the module docstring). The path of every op: lookups inlined."""
        plan = self._plans.get(id(op)) or self.plan(op)
        if plan.view:
            return op.redispatch(_CPU_KEYS, *args, **kwargs)
        tensors: list[torch.Tensor] = []
        index = self._index_of(args, kwargs) if len(self.drivers) > 1 else 0
        encode = Encoder(tensors, self._uploads[index], not plan.in_place)
        wire_args = [
            [encode(a) for a in args],
            {k: encode(v) for k, v in kwargs.items()} if kwargs else {},
        ]
        d = self.drivers.get(index)
        if d is None or d.closed:
            d = self.driver(index)
        if plan.dynamic:
            return self._dynamic(d, index, op, plan, tensors, wire_args, args, kwargs)
        key = (plan, tuple(encode.sig))  # (encode.signature())
        metas = self._metas.get(key)
        if metas is None:
            metas = self._infer(op, args, kwargs)
            if metas is None:  # no meta kernel, or the shapes depend on the data
                return self._dynamic(d, index, op, plan, tensors, wire_args, args, kwargs)
            if len(self._metas) > 65536:
                self._metas.clear()
            self._metas[key] = metas
        outputs: list[torch.Tensor | None] = []
        descs: list[list[Any]] = []
        news, resized, counts = metas
        new_handle, release = d.session.new_handle, d._release
        for meta in news:
            if meta is None:  # an undefined tensor (a gradient not asked for)
                outputs.append(None)
                continue
            sizes, strides, dtype, nbytes, name = meta
            handle = new_handle()
            outputs.append(new_tensor(handle, nbytes, sizes, strides, dtype, index, release))
            descs.append([handle, 0, sizes, strides, name])
        operands = encode.descs
        if resized:  # an out= tensor the op resizes (then described again)
            for source, sizes, strides in resized:
                restride(_argument(args, kwargs, source), sizes, strides)
            operands = [describe(t) for t in tensors]
        d.post(_ATEN, 0, [plan.name, operands, wire_args, descs])
        if plan.one_new and counts == _ONE:  # the common case: one new tensor
            return outputs[0]
        return self._result(plan, args, kwargs, iter(outputs), counts)

    def _index_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        for a in (*args, *kwargs.values()):
            if is_remote(a):
                return a.device.index or 0
            if isinstance(a, (list, tuple)):
                for x in a:
                    if is_remote(x):
                        return x.device.index or 0
        device = kwargs.get("device")
        return (device.index or 0) if isinstance(device, torch.device) else 0

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
        except NotImplementedError:  # no meta kernel, or the shapes depend on the data
            return None
        except RuntimeError as exc:
            if "meta" in str(exc).lower():  # the same: "cannot be called on meta tensors"
                return None
            raise  # the arguments' error, as the local op raises it
        plan = self.plan(op)
        results = _returns(result, len(plan.returns))
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
        ask_once = plan.name.split(".")[0] in _ASK_ONCE
        key = None
        if ask_once:
            key = (plan, Encoder(list(tensors), self._uploads[index]).signature_of(args, kwargs))
            answer = self._metas.get(key)
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
            self._metas[key] = answer
        return answer

    # -- transfers -------------------------------------------------------------------------
    def copy_from(self, src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> Any:
        """``dst.copy_(src)`` where one of them is remote."""
        if is_remote(dst) and is_remote(src) and dst.device == src.device:
            d = self.driver(dst.device.index)
            d.post(
                _ATEN,
                0,
                [
                    "copy_.default",
                    [describe(dst), describe(src)],
                    [[{"t": 0}, {"t": 1}], {}],
                    [],
                ],
            )
            return dst
        if is_remote(dst):  # from the host (or another remote device, through the host)
            host = src.to("cpu") if is_remote(src) else src
            host = host.to(dst.dtype).expand(dst.shape).contiguous()
            if host.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
                host = host.clone()  # the caller may change (or resize) src before it is sent
            d = self.driver(dst.device.index)
            target = (
                dst
                if dst.is_contiguous()
                else self.empty(
                    list(dst.shape), contiguous_strides(dst.shape), dst.dtype, dst.device
                )
            )
            data = host.reshape(-1).view(torch.uint8).numpy()
            if data.nbytes:
                d.post(_H2D, 0, [byte_desc(target), BUFFER], data.data)
            if target is not dst:
                self.copy_from(target, dst)
            return dst
        # to the host
        d = self.driver(src.device.index)
        if not src.is_contiguous():
            src = src.contiguous()  # on the proxy
        if src.numel() == 0:
            return dst
        _, buffers = d.call(_D2H, [byte_desc(src)])
        got = buffers[0]
        host = torch.frombuffer(bytearray(got) if got.readonly else got, dtype=torch.uint8)
        dst.copy_(host.view(src.dtype).reshape(src.shape))
        return dst


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


def _returns(result: Any, n: int) -> tuple[Any, ...]:
    """An op's result as one value per return of its schema."""
    if n == 1:
        return (result,)
    return () if n == 0 else tuple(result)


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


def contiguous_strides(sizes: Sequence[int]) -> list[int]:
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(int(sizes[i + 1]), 1)
    return strides
