"""ATen ops run by torch on the proxy, for ``gpuremote.torch`` clients.

A client sends an op by name (``add.out``: packet and overload of ``torch.ops.aten``), its
tensor operands as strided descriptors into the session's buffers (``TensorDesc``) and its
other arguments as plain values (``[args, kwargs]``, a tensor as ``{"t": index}``). Here:

- the op must be on the **allow-list** of this torch release, with the schema it has here:
  the checked-in table of ``gpuremote.ops.aten`` (compute ops on tensors and plain values:
  no storage, stream, file name or host pointer, no view, nothing that reaches outside a
  tensor's memory or hands out memory nobody wrote);
- every operand is **bounds-checked** against its buffer before a tensor is made of it: a
  tensor is a zero-copy strided view of one of this session's buffers, so no op can read or
  write memory the session does not hold;
- each tensor the op returns that is not one of its operands becomes the new buffer the
  client named for it (its memory, where it covers every byte and is laid out as the
  client's metadata says; else copied into a zeroed buffer of that layout); a result of
  another shape or dtype than the client's metadata says is refused (the client asks this
  kernel, ``aten_shapes``, where its meta kernels are known to differ);
- ops with randomness draw from the **session's own generator** (seeded by the client's
  ``torch.manual_seed``), never from the process's, so sessions stay apart and reproducible.

torch is imported when a session first runs an ATen op; a proxy without it answers with an
error naming the ``[torch]`` extra.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..backends.torch_runtime import Unadopted
from ..ops import aten as aten_ops
from ..wire.protocol import TENSOR_DTYPES, TensorDesc
from .state import CallFailed, SessionState

__all__ = [
    "AtenSession",
    "SessionGenerator",
    "aten_session",
    "check_recorded",
    "kept_as_is",
    "load_torch",
    "op_work",
    "resolve_op",
]

#: the seed of a session's generator before the client seeds it (torch's own default)
DEFAULT_SEED = 67280421310721


def load_torch() -> Any:
    """torch, or a ``CallFailed`` naming the extra that installs it."""
    # a proxy receives and decodes the next calls while an op computes: OpenMP's threads
    # sleep when they wait, instead of spinning on the CPUs the proxy's loop needs (set
    # before torch loads OpenMP; an operator's own setting stands). ResNet-18 training on a
    # 2-CPU proxy: 1.26x local with spinning threads, 1.17x without
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        import torch
    except ImportError:
        raise CallFailed(
            "this proxy cannot run PyTorch ops: torch is not installed where it runs "
            "(pip install 'gpuremote[torch]')"
        ) from None
    return torch


class AllowedOp:
    """An op of the allow-list, with what running it needs from its schema."""

    __slots__ = (
        "generators",
        "n_returns",
        "op",
        "random_without_generator",
        "relays",
        "returns",
        "writes",
    )

    def __init__(self, op: Any, torch: Any) -> None:
        schema = op._schema
        self.op = op
        #: per return: (is a list of tensors, is one of the operands)
        self.returns = [
            (str(r.type) == "List[Tensor]", r.alias_info is not None) for r in schema.returns
        ]
        self.n_returns = len(schema.returns)
        #: positions and names of the arguments the op writes
        self.writes = [
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        #: those of them whose sizes, strides or storage the op may change: its out=
        #: tensors (resized to fit the result), every one of an op that lays tensors out
        #: again in place (``squeeze_``, ``as_strided_``, ``resize_``, ``set_``) or resizes
        #: them; the others only have their elements written
        relays = torch.Tag.inplace_view in op.tags or "resize" in schema.name
        self.relays = [
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write and (relays or a.is_out)
        ]
        #: positions and names of its generator arguments (the session's is passed there)
        self.generators = [
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if str(a.type) == "Optional[Generator]"
        ]
        seeded = torch.Tag.nondeterministic_seeded in op.tags
        self.random_without_generator = seeded and not self.generators


@functools.lru_cache(maxsize=4096)
def resolve_op(name: str) -> AllowedOp:
    """The ATen op ``packet.overload`` of this torch release's allow-list (``gpuremote.ops.
    aten``: its table, checked in, lists the op with the schema it has here); ``CallFailed``
    for any other name."""
    torch = load_torch()
    version = aten_ops.release(torch)
    table = aten_ops.allowed(version)
    if not table:
        raise CallFailed(
            f"this proxy has no allow-list of ATen ops for torch {version} "
            f"(python -m gpuremote.ops.aten --write makes one to review)"
        )
    row = table.get(name)
    if row is None:
        raise CallFailed(f"ATen op {name!r} is not on this proxy's allow-list (torch {version})")
    packet_name, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, packet_name, None)
    op = getattr(packet, overload, None) if packet is not None else None
    if not isinstance(op, torch._ops.OpOverload) or str(op._schema) != row.schema:
        raise CallFailed(
            f"ATen op {name!r} of this torch build is not the one its allow-list reviewed "
            f"({row.schema})"
        )
    return AllowedOp(op, torch)


class SessionGenerator:
    """A session's own random generator on the proxy: seeded by the client's
    ``torch.manual_seed``, lent to the random ops that take no generator, its state
    checkpointed (failover), so that sessions stay apart and reproducible."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch = torch
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(DEFAULT_SEED)

    def seed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def lent(self, op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Run random op ``op``, which takes no generator, on this one (its state lent to
        the device's default generator)."""
        torch = self.torch
        default = (
            torch.default_generator
            if self.device.type == "cpu"
            else torch.cuda.default_generators[self.device.index or 0]
        )
        saved = default.get_state()
        default.set_state(self.generator.get_state())
        try:
            return op(*args, **kwargs)
        finally:
            self.generator.set_state(default.get_state())
            default.set_state(saved)

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Within it, what draws from the generator is undone at the end."""
        state = self.generator.get_state()
        try:
            yield
        finally:
            self.generator.set_state(state)

    def state(self) -> str:
        """The generator's state, as hex (a failover checkpoint keeps it)."""
        return bytes(self.generator.get_state().numpy()).hex()

    def set_state(self, state: str) -> None:
        """Set the generator to a state ``state()`` gave."""
        torch = self.torch
        try:
            data = bytes.fromhex(state)
            self.generator.set_state(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        except (ValueError, RuntimeError) as exc:
            raise CallFailed(f"not a state of this proxy's generator: {first_line(exc)}") from None


class AtenSession:
    """A session's PyTorch state on the proxy: runs its ATen ops on views of its buffers
    (the operands checked, the results kept as buffers), with its generator and its
    backend's torch runtime."""

    def __init__(self, state: SessionState) -> None:
        torch = self.torch = load_torch()
        self.state = state
        #: where the backend's buffers meet torch (its device, views, stream order)
        self.runtime = state.backend.torch_runtime()
        self.device = self.runtime.device()
        if self.device.type == "cuda":  # float32 as float32 (no TF32), reproducible kernels
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cudnn.deterministic = True
        #: the session's own random generator
        self.rng = SessionGenerator(torch, self.device)
        #: a simulated GPU times each op by its work (FLOPs as torch counts them, bytes)
        self.timed = self.runtime.profile is not None
        #: the last op's (FLOPs, bytes moved, dtype), where ``timed``; the last taken
        self.work: tuple[float, float, Any] | None = None
        self.last_work: tuple[float, float, Any] | None = None
        #: a device that times ops without computing them (``sim:a100,compute=0``): ops run
        #: on shapes alone (torch's meta tensors), what they make is left undefined
        self.shapes_only = not self.runtime.computes
        #: there: (op, layouts, arguments) -> (its result, what it made, its work)
        self._shapes_seen: dict[Any, tuple[Any, list[Any], Any]] = {}
        self.dtypes = {name: getattr(torch, name) for name in TENSOR_DTYPES}
        self.operand_memory: set[int] = set()
        self.layouts = {"strided": torch.strided}
        self.formats = {
            name: getattr(torch, name)
            for name in (
                "contiguous_format",
                "channels_last",
                "channels_last_3d",
                "preserve_format",
            )
        }
        #: the tagged values named by a string: tag -> (name -> value, what it is)
        #: the session's ATen templates by handle (``gpuremote.proxy.templates``)
        self.templates: dict[int, Any] = {}
        self.template_tensors = 0  # their operands and outputs, together
        #: their operands' layouts (sizes, strides, dtype), each numbered once: the key of
        #: a view of that layout among its buffer's views is ("t", its number, offset)
        self.layout_ids: dict[tuple[Any, ...], int] = {}
        #: ops run here by template, on views made here: a device that computes and is not
        #: timed (else a template's call runs as the ``aten`` call it stands for)
        self.by_template = self.runtime.computes and not self.timed
        self.named: dict[str, tuple[dict[str, Any], str]] = {
            "dtype": (self.dtypes, "dtype"),
            "layout": (self.layouts, "layout"),
            "mf": (self.formats, "memory format"),
        }

    def isolated(self) -> contextlib.AbstractContextManager[Any]:
        """Ops run as plain torch, whatever the thread was doing: a proxy served in the
        client's process runs in the client's thread, which may be tracing (the fake
        tensors and functional modes of ``torch.compile``) or recording autograd."""
        if not self.torch._C._len_torch_dispatch_stack():
            return _PLAIN  # (a proxy's own thread: nothing to set aside)
        return self._set_aside()

    @contextlib.contextmanager
    def _set_aside(self) -> Iterator[None]:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), self.torch.no_grad():
            yield

    # -- operands --------------------------------------------------------------------------
    def tensor(self, desc: TensorDesc) -> Any:
        """The strided view ``desc`` of one of the session's buffers (bounds-checked)."""
        return self.strided(
            desc.handle, desc.offset, desc.sizes, desc.strides, desc.dtype, desc.extent
        )

    def strided(
        self,
        handle: int,
        offset: int,
        sizes: tuple[int, ...],
        strides: tuple[int, ...],
        dtype_name: str,
        end: int,
        stays_laid_out: bool = False,
    ) -> Any:
        """``tensor`` of a descriptor given by its parts and its extent ``end`` (the byte
        past the last it reaches; 0: none). ``stays_laid_out``: no op lays it out again
        (``AllowedOp.relays``), so that it may be a view of the tensor kept as the buffer
        (``keep_as_is``), whose storage could grow."""
        s = self.state
        buf = s.buffers.get(handle)
        if buf is None:
            from ..errors import UnknownHandle

            raise UnknownHandle(f"unknown buffer handle {handle}")
        nbytes = s.nbytes[handle]
        if end > nbytes:
            raise CallFailed(
                f"tensor of sizes {list(sizes)}, strides {list(strides)} at offset {offset} "
                f"reaches byte {end} of buffer {handle}, which has {nbytes}"
            )
        itemsize = TENSOR_DTYPES[dtype_name]
        # the buffer as a flat tensor of the dtype, made once (kept with the buffer's other
        # views: dropped when it is freed or replaced)
        views = s.views.get(handle)
        key = ("torch", dtype_name)
        typed = views.get(key) if views is not None else None
        if typed is None and stays_laid_out and views is not None:
            typed = views.get(("kept", dtype_name))
        if typed is None:
            dtype = self.dtypes[dtype_name]
            if nbytes < itemsize:  # no element fits (a 0-byte view of bytes has stride 0)
                typed = self.torch.empty(0, dtype=dtype, device=self.device)
                return typed.as_strided(sizes, strides, 0)
            base = self.runtime.buffer(s.buffer(handle))  # (made now where ``Unadopted``)
            if nbytes % itemsize:  # (the whole elements; a slice costs more than the view)
                base = base.narrow(0, 0, nbytes - nbytes % itemsize)
            typed = base.view(dtype)
            if views is None:
                views = s.views[handle] = {}
            views[key] = typed
        if not end:  # no elements: reaches no byte, wherever its offset points
            return typed.as_strided(sizes, strides, 0)
        return typed.as_strided(sizes, strides, offset // itemsize)

    def decode(self, value: Any, tensors: Sequence[Any], floats: Sequence[float] = ()) -> Any:
        """An argument as the op takes it (tensors by index into ``tensors``; a template's
        float arguments by index into ``floats``)."""
        t = type(value)
        if t is list:
            return [self.decode(v, tensors, floats) for v in value]
        if t is not dict:
            return value
        ((tag, x),) = value.items()
        if tag == "t":
            if x >= len(tensors):
                raise CallFailed(f"tensor {x} of {len(tensors)}")
            return tensors[x]
        if tag == "f":
            if x >= len(floats):
                raise CallFailed(f"float argument {x} of {len(floats)} (only a template has any)")
            return floats[x]
        if tag == "device":
            return self.device
        if tag == "c":
            return complex(x[0], x[1])
        table, what = self.named[tag]  # dtype, layout, memory format: by name
        found = table.get(x)
        if found is None:
            raise CallFailed(f"unsupported {what} {x!r}")
        return found

    # -- running ---------------------------------------------------------------------------
    def shapes(
        self, name: str, descs: Sequence[TensorDesc], encoded: tuple[list[Any], dict[str, Any]]
    ) -> list[Any]:
        """What op ``name`` makes of these operands, by this device's kernel: per return,
        ``{"t": [sizes, strides, dtype]}`` for a tensor it makes (a list of them for a
        list), None for an operand it returns. The operands it writes are copies, and the
        session's generator is put back: nothing of the session changes. (Every operand
        is a copy: some schemas do not say what their ops write, ``native_batch_norm``'s
        running statistics.)"""
        allowed = resolve_op(name)
        with self.rng.kept():
            _, result, made = self.call(name, descs, encoded, copies=True)
        metas = [
            [list(r.shape), list(r.stride()), str(r.dtype).removeprefix("torch.")] for r in made
        ]
        return self.encode_result(allowed, result, metas)

    def call(
        self,
        name: str,
        descs: Sequence[TensorDesc],
        encoded: tuple[list[Any], dict[str, Any]],
        copies: bool = False,
    ) -> tuple[AllowedOp, Any, list[Any]]:
        """Run op ``name``; returns it, its result and the tensors it returned that are not
        its operands (in order); on copies of the operands, with ``copies``."""
        allowed = resolve_op(name)
        if self.shapes_only:
            # the same op on the same layouts and values: what it made, and its work, known
            key = (name, tuple((d.sizes, d.strides, d.dtype) for d in descs), _frozen(encoded))
            known = self._shapes_seen.get(key)
            for d in descs:  # (bounds-checked all the same)
                self.shape_of(d, meta=False)
            if known is not None:
                result, made, self.work = known
                return allowed, result, made
            tensors = [self.shape_of(d) for d in descs]
            self.operand_memory = set()
        else:
            tensors = [self.tensor(d) for d in descs]
            if copies:
                tensors = [_copy_with_layout(t) for t in tensors]
            #: the memory of the operands: a tensor the op made there is not its own
            self.operand_memory = {t.untyped_storage().data_ptr() for t in tensors}
        args = [self.decode(a, tensors) for a in encoded[0]]
        kwargs = {k: self.decode(v, tensors) for k, v in encoded[1].items()}
        op = allowed.op
        if self.shapes_only:
            for i, arg_name in allowed.generators:  # (no generator: nothing is drawn)
                if i < len(args):
                    args[i] = None
                else:
                    kwargs[arg_name] = None
            try:
                result = self._on_shapes(name, op, args, kwargs)
            except OP_ERRORS as exc:
                raise CallFailed(f"{type(exc).__name__}: {first_line(exc)}") from None
        else:
            result = self.run_op(allowed, name, args, kwargs)
        made = self.new_tensors(allowed, result)
        if self.timed:
            self.work = op_work(op, args, kwargs, result, tensors, made)
        if self.shapes_only:
            if len(self._shapes_seen) > 65536:
                self._shapes_seen.clear()
            self._shapes_seen[key] = (result, made, self.work)
        return allowed, result, made

    def run_op(self, allowed: AllowedOp, name: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Run ``allowed`` (op ``name``) on a computing device, on arguments built already:
        the session's generator where the op takes one (or lent); an error of the op's
        arguments as ``CallFailed``."""
        for i, arg_name in allowed.generators:  # the session's generator, always
            if i < len(args):
                args[i] = self.rng.generator
            else:
                kwargs[arg_name] = self.rng.generator
        op = allowed.op
        try:
            if allowed.random_without_generator:
                return self.rng.lent(op, args, kwargs)
            if self.device.type == "cpu" and name in CPU_GAPS:
                return CPU_GAPS[name](op, args, kwargs)
            return op(*args, **kwargs)
        except OP_ERRORS as exc:
            raise CallFailed(f"{type(exc).__name__}: {first_line(exc)}") from None

    def shape_of(self, desc: TensorDesc, meta: bool = True) -> Any:
        """``tensor(desc)`` for a device that does not compute: a meta tensor of its layout
        (bounds-checked all the same; without ``meta``, only checked)."""
        s = self.state
        if desc.handle not in s.buffers:
            from ..errors import UnknownHandle

            raise UnknownHandle(f"unknown buffer handle {desc.handle}")
        if desc.extent > s.nbytes[desc.handle]:
            raise CallFailed(f"tensor at offset {desc.offset} reaches past buffer {desc.handle}")
        if not meta:
            return None
        torch = self.torch
        return torch.empty_strided(
            desc.sizes, desc.strides, dtype=self.dtypes[desc.dtype], device="meta"
        )

    def _on_shapes(self, name: str, op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """Run ``op`` on meta tensors; a value read back is a zero of its type (the device
        computes nothing)."""
        torch = self.torch
        meta = torch.device("meta")
        args = [meta if isinstance(a, torch.device) else a for a in args]
        kwargs = {k: meta if isinstance(v, torch.device) else v for k, v in kwargs.items()}
        if name.startswith("_local_scalar_dense"):
            t = args[0]
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        if name == "_fused_sdp_choice.default":
            return _fused_choice(torch, op, args, kwargs)
        return op(*args, **kwargs)

    def new_tensors(self, allowed: AllowedOp, result: Any) -> list[Any]:
        """The tensors of ``result`` that the op made (not those it wrote into operands)."""
        out: list[Any] = []
        for (is_list, aliases), r in zip(
            allowed.returns, aten_ops.returns(result, allowed.n_returns), strict=True
        ):
            if aliases:
                continue
            if is_list:
                out.extend(r)
            elif isinstance(r, self.torch.Tensor):
                out.append(r)
        return out

    def fill_outputs(self, name: str, made: Sequence[Any], outputs: Sequence[TensorDesc]) -> None:
        """Copy what the op made into the client's output buffers (allocated already)."""
        if self.shapes_only:
            return
        if len(made) != len(outputs):
            raise CallFailed(f"{name} made {len(made)} tensors; the client expected {len(outputs)}")
        for r, d in zip(made, outputs, strict=True):
            if tuple(r.shape) != d.sizes or self.dtypes[d.dtype] != r.dtype:
                # the client's meta kernel and this kernel disagree: never a wrong answer
                raise CallFailed(
                    f"{name} made a tensor of {r.dtype} {list(r.shape)}; the client expected "
                    f"{d.dtype} {list(d.sizes)} (its meta kernel disagrees with this device's)"
                )
        for r, d in zip(made, outputs, strict=True):
            if r.numel():
                self.tensor(d).copy_(r)

    def check_outputs(self, outputs: Sequence[TensorDesc]) -> None:
        """The client's output handles are new and their buffers fit the session's limits
        (before anything runs)."""
        s = self.state
        for d in outputs:
            s.check_new(s.buffers, d.handle, "buffer")
        if len({d.handle for d in outputs}) != len(outputs):
            raise CallFailed("an op's outputs must each have a handle of their own")
        self._room("outputs", sum(d.extent for d in outputs))

    def _room(self, what: str, nbytes: int) -> None:
        """``nbytes`` more keep the session within its memory limit (else ``CallFailed``)."""
        s = self.state
        if s.device_bytes + nbytes > s.limits.max_device_bytes:
            raise CallFailed(
                f"{what} of {nbytes} bytes would make this session hold "
                f"{s.device_bytes + nbytes} bytes; its limit is {s.limits.max_device_bytes}"
            )

    def keep_outputs(self, name: str, made: Sequence[Any], outputs: Sequence[TensorDesc]) -> None:
        """Each output's buffer: the tensor the op made, as it is, where it is laid out as
        the client's metadata says (its memory, no copy); else a new buffer it is copied to."""
        s = self.state
        if len(made) != len(outputs) or self.shapes_only:
            for d in outputs:
                s.alloc(d.handle, d.extent)
            if self.shapes_only:
                return
            raise CallFailed(f"{name} made {len(made)} tensors; the client expected {len(outputs)}")
        copy: list[tuple[Any, TensorDesc]] = []
        kept: list[tuple[int, Any, int, str, Any]] = []
        for r, d in zip(made, outputs, strict=True):
            extent = d.extent
            if d.offset == 0 and kept_as_is(
                r,
                d.sizes,
                d.strides,
                self.dtypes[d.dtype],
                extent,
                self.operand_memory,
                self.device,
            ):
                kept.append((d.handle, r, extent, d.dtype, None))
            else:
                s.alloc(d.handle, d.extent)
                copy.append((r, d))
        if kept:
            self.keep_as_is(kept)
        if copy:
            self.fill_outputs(name, [r for r, _ in copy], [d for _, d in copy])

    def keep_as_is(self, kept: Sequence[tuple[int, Any, int, str, Any]]) -> None:
        """Each tensor ``r`` of ``kept`` (``(handle, r, nbytes, dtype, whole)``;
        ``kept_as_is``: its storage its own, all of it) is buffer ``handle`` now (the
        backend's buffer of its bytes made when something reads it as one, where the runtime
        ``adopts_later``); the views of it an op only reads, or whose elements alone it
        writes, are taken of ``r`` (``("kept", dtype)``: ``strided``'s ``stays_laid_out``), so
        that such an op makes no flat tensor of the buffer first. Never one the op may lay out
        again (``AllowedOp.relays``): ``r``'s storage is torch's, which an ``out=`` op or a
        ``resize_`` may grow, moving it from under the buffer; such a view is taken of the
        buffer's own memory (``("torch", dtype)``), which cannot grow. ``whole`` (or None):
        ``r``'s key among the buffer's views too (a graph's result: ``graphs._whole``)."""
        s, runtime = self.state, self.runtime
        adopt, views, later = s.adopt, s.views, runtime.adopts_later
        for handle, r, nbytes, dtype_name, whole in kept:
            adopt(handle, Unadopted(runtime, r) if later else runtime.adopt(r), nbytes)
            views[handle] = (
                {("kept", dtype_name): r} if whole is None else {("kept", dtype_name): r, whole: r}
            )

    def adopt_results(self, name: str, made: Sequence[Any], handles: Sequence[int]) -> list[Any]:
        """Keep what a data-dependent op made, each as a new buffer under the client's
        handle; returns each one's [sizes, dtype]."""
        if len(made) != len(handles):
            raise CallFailed(f"{name} made {len(made)} tensors; the client named {len(handles)}")
        s = self.state
        self._room(f"{name}'s results", sum(int(r.numel()) * r.element_size() for r in made))
        metas = []
        for h, r in zip(handles, made, strict=True):
            s.check_new(s.buffers, h, "buffer")
            nbytes = int(r.numel()) * r.element_size()
            if self.shapes_only:  # (a meta tensor: its bytes are undefined)
                s.alloc(h, nbytes)
                metas.append([list(r.shape), str(r.dtype).removeprefix("torch.")])
                continue
            if (
                not r.is_contiguous()
                or r.storage_offset()
                or r.untyped_storage().nbytes() != nbytes
                or r.untyped_storage().data_ptr() in self.operand_memory
            ):
                r = r.clone(memory_format=self.torch.contiguous_format)  # its own, compact
            flat = self.runtime.adopt(r)
            s.adopt(h, flat, int(r.numel()) * r.element_size())
            metas.append([list(r.shape), str(r.dtype).removeprefix("torch.")])
        return metas

    def encode_result(self, allowed: AllowedOp, result: Any, metas: list[Any]) -> Any:
        """The reply of a data-dependent op: each return as a value, made tensors as
        ``{"t": [sizes, dtype]}`` in order, tensors it wrote as ``None``."""
        torch = self.torch
        results = aten_ops.returns(result, allowed.n_returns)
        made = iter(metas)
        out: list[Any] = []
        for (is_list, aliases), r in zip(allowed.returns, results, strict=True):
            if aliases:
                out.append(None)
            elif is_list:
                out.append([{"t": next(made)} for _ in r])
            elif isinstance(r, torch.Tensor):
                out.append({"t": next(made)})
            elif isinstance(r, complex):
                out.append({"c": [r.real, r.imag]})
            else:
                out.append(r)
        return out


def kept_as_is(
    r: Any,
    sizes: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: Any,
    nbytes: int,
    operand_memory: set[int],
    device: Any,
) -> bool:
    """Whether tensor ``r``, which an op made, may become a buffer of ``nbytes`` as it is:
    laid out as the client's metadata says, from the first byte of memory of its own (no
    operand's, not a view), every byte of which it covers (written by the op: nothing
    another session left there can be read back)."""
    storage = r.untyped_storage()
    return bool(
        r.dtype == dtype
        and r.stride() == strides
        and tuple(r.shape) == sizes
        and r.storage_offset() == 0
        and storage.nbytes() == nbytes
        and r.numel() * r.element_size() == nbytes  # dense: no byte unwritten
        and storage.data_ptr() not in operand_memory
        and r.device == device
        and r._base is None
    )


#: the attention ops whose FLOPs are their GPU siblings' (torch's counter has no formula for
#: the CPU's fused kernels; the shapes mean the same)
_FLOPS_AS = {
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        "_scaled_dot_product_flash_attention_backward"
    ),
}
#: the most bytes of host memory a timing-only device lays out to ask the CPU's kernels which
#: attention they would run (beyond: the math decomposition, as meta tensors choose)
_CHOICE_MAX_BYTES = 64 << 20


def _fused_choice(torch: Any, op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``_fused_sdp_choice`` on a device that times ops without computing them: the CPU's
    kernels' choice for operands of these layouts (a fused attention kernel where they have
    one, as a GPU's PyTorch runs attention), not the meta tensors' (always the math
    decomposition: a dozen ops where a GPU runs one or two)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    reach = sum(t.untyped_storage().nbytes() for t in tensors)
    if reach > _CHOICE_MAX_BYTES:
        return op(*args, **kwargs)

    def on_host(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype)  # (never read)

    return op(*[on_host(a) for a in args], **{k: on_host(v) for k, v in kwargs.items()})


def op_work(
    op: Any,
    args: list[Any],
    kwargs: dict[str, Any],
    result: Any,
    tensors: Sequence[Any],
    made: Sequence[Any],
) -> tuple[float, float, Any]:
    """What op ``op`` did: its FLOPs (by torch's formulas, for the ops that have one: matrix
    products, convolutions, attention; 0 for the rest), the bytes of its operands and what it
    made, and the dtype that sets the peak (a simulated GPU times the op by them)."""
    from torch.utils.flop_counter import flop_registry

    packet = op.overloadpacket
    formula = flop_registry.get(packet)
    if formula is None and packet.__name__ in _FLOPS_AS:
        import torch

        formula = flop_registry.get(getattr(torch.ops.aten, _FLOPS_AS[packet.__name__]))
    flops = 0.0
    if formula is not None:
        try:
            flops = float(formula(*args, **kwargs, out_val=result))
        except Exception:  # a formula that does not take these arguments: untimed FLOPs
            flops = 0.0
    nbytes = float(sum(t.numel() * t.element_size() for t in (*tensors, *made)))
    ref = made[0] if made else (tensors[0] if tensors else None)
    dtype = _NUMPY_OF.get(str(ref.dtype), np.float32) if ref is not None else np.float32
    return flops, nbytes, np.dtype(dtype)


def check_recorded(state: SessionState, args: tuple[Any, ...], made: dict[int, int]) -> None:
    """Check an ``aten`` call of a recorded step once, when the step arrives: the op is
    allowed, and each operand lies within a buffer of the step (``made``: handle -> bytes:
    its arguments', those it made before) or one the session holds; ``CallFailed`` says
    what is wrong. (A replay checks each operand against its buffer again: a replay binds
    its own arguments.)"""
    name, tensors, encoded, _ = args
    resolve_op(name)
    for k, d in enumerate(tensors):
        nbytes = made.get(d.handle)
        if nbytes is None:
            nbytes = state.nbytes.get(d.handle) if d.handle in state.buffers else None
        if nbytes is None:
            raise CallFailed(f"operand {k}: unknown buffer handle {d.handle}")
        if d.extent > nbytes:
            raise CallFailed(
                f"operand {k}, of sizes {list(d.sizes)}, strides {list(d.strides)} at offset "
                f"{d.offset}, reaches byte {d.extent} of buffer {d.handle}, which has {nbytes}"
            )
    _check_indices(encoded, len(tensors))


def _check_indices(value: Any, n: int) -> None:
    """Every tensor an op's encoded arguments name is one of its ``n`` operands."""
    t = type(value)
    if t is list or t is tuple:
        for v in value:
            _check_indices(v, n)
    elif t is dict:
        if "t" in value:
            if not 0 <= value["t"] < n:
                raise CallFailed(f"argument names tensor {value['t']} of {n}")
        else:
            for v in value.values():
                _check_indices(v, n)


def aten_session(state: SessionState) -> AtenSession:
    """The session's PyTorch state, made on its first ATen op."""
    aten = state.aten
    if isinstance(aten, AtenSession):
        return aten
    made = state.aten = AtenSession(state)
    return made


_PLAIN = contextlib.nullcontext()

#: the NumPy dtype whose peak rate a torch dtype runs at (``DeviceProfile.peak``)
_NUMPY_OF: dict[str, Any] = {
    "torch.float16": np.float16,
    "torch.bfloat16": np.float16,
    "torch.float32": np.float32,
    "torch.float64": np.float64,
    "torch.complex64": np.complex64,
    "torch.complex128": np.complex128,
}


def _copy_with_layout(t: Any) -> Any:
    """A copy of tensor ``t`` laid out as it is (its strides, zero or overlapping ones
    included: a kernel chooses its outputs' layouts from its operands'): the span of memory
    it reaches, copied, viewed as ``t`` views its own."""
    if not t.numel():
        return t.clone()
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    flat = t.as_strided((span,), (1,), t.storage_offset()).clone()
    return flat.as_strided(t.shape, t.stride(), 0)


def _histc_of_integers(op: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """``histc`` of integers, which CUDA counts and the CPU's kernel refuses: counted in
    float64 (each integer, and each bin's bounds, exact there), in the input's dtype."""
    x = args[0]
    if x.is_floating_point():
        return op(*args, **kwargs)
    return op(x.double(), *args[1:], **kwargs).to(x.dtype)


#: ops a GPU's kernels take and the CPU's do not (for some dtypes): how a CPU proxy runs them
CPU_GAPS = {"histc.default": _histc_of_integers}
#: what an op raises for arguments it does not take (its error goes to the client)
OP_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError)


def _frozen(value: Any) -> Any:
    """An op's encoded arguments as a key (lists as tuples, dicts as sorted pairs)."""
    t = type(value)
    if t is list or t is tuple:
        return tuple([_frozen(v) for v in value])
    if t is dict:
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:400] if text else type(exc).__name__
