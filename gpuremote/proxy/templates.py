"""ATen ops by template: how ``gpuremote.torch``'s eager ops run after the first of each kind.

The first call of an op signature (the op, its operands' layouts, its other arguments, what
it makes) is kept on the session (``aten_template``): checked once here, as an ``aten`` call
is (the allow-list, the operands' layouts, the arguments' values), and turned into a plan of
what to do per call. Each later call of that signature (``aten_call``) names the template,
where its operands are (a ``[handle, offset]`` pair each), the handles of what it makes and
the values of its float arguments (an optimizer's step size changes at every step): a few
ints and floats, decoded by the typed lane of the protocol. Per call, each operand is still
bounds-checked against its buffer before a view is made of it (the layout's reach is known,
so the check is one comparison), the outputs' handles are checked to be new, and the op runs
with the session's generator, in order on the call's stream, as an ``aten`` call would.

Where a template's calls take the common way (the op torch's own callable: no generator
lent, no rules of the CPU's own), the template gets a function of its own, made once from its
plan (``_fast_run``): each operand's view, each check, the op's call and the keeping of its
one output (where the device keeps what ops make as its buffers) written out, with no loop
over operands or arguments and no list built per call beyond the runtime's. It does what the
general way (``AtenTemplate._run``) does, check for check, error for error; the tests hold the
two equal on good and bad calls. Its code holds only this proxy's own numbers; the op, the
constants and the keywords' names are its globals.

A device that does not compute, or times its ops (``sim:``), runs a template's call as the
``aten`` call it stands for (``plain``): the same results, without this path's savings.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

from ..backends.torch_runtime import Unadopted
from ..wire.protocol import TENSOR_DTYPES, TensorDesc, extent
from .aten import CPU_GAPS, OP_ERRORS, AtenSession, first_line, kept_as_is, resolve_op
from .state import CALL_FAILURES, BatchContext, CallFailed, SessionState, UnknownHandle

__all__ = ["AtenTemplate", "Refused"]

#: how a template's argument is made per call: an operand, a float, a constant (decoded
#: once), or a value holding operands or floats (decoded per call)
_TENSOR, _FLOAT, _CONSTANT, _DECODED = range(4)
#: views kept per buffer, at most (as ``gpuremote.proxy.graphs`` keeps its inputs')
_MAX_VIEWS = 1024


class AtenTemplate:
    """One kept ATen op call (see the module docstring)."""

    __slots__ = (
        "allowed",
        "direct",
        "encoded",
        "fast",
        "kept",
        "kwplan",
        "layouts",
        "n_floats",
        "n_places",
        "name",
        "one_new",
        "out_bytes",
        "outputs",
        "plan",
        "work",
        "written",
    )

    def __init__(
        self,
        a: AtenSession,
        name: str,
        operands: Sequence[TensorDesc],
        encoded: tuple[list[Any], dict[str, Any]],
        outputs: Sequence[TensorDesc],
    ) -> None:
        self.allowed = allowed = resolve_op(name)  # CallFailed: not on the allow-list
        self.name = name
        #: per operand: sizes, strides, dtype, itemsize, the bytes it reaches from its place,
        #: the key of its buffer's flat view of that dtype (``AtenSession.strided``)
        self.layouts = tuple(
            (
                d.sizes,
                d.strides,
                d.dtype,
                TENSOR_DTYPES[d.dtype],
                _reach(d),
                ("torch", d.dtype),  # the buffer's own memory as a flat tensor
                ("kept", d.dtype),  # the tensor kept as the buffer (read-only views only)
                a.layout_ids.setdefault((d.sizes, d.strides, d.dtype), len(a.layout_ids)),
            )
            for d in operands
        )
        self.n_places = 2 * len(operands)
        #: per output: sizes, strides, dtype, the bytes of its buffer, torch's dtype
        self.outputs = tuple(
            (d.sizes, d.strides, d.dtype, _reach(d), a.dtypes[d.dtype]) for d in outputs
        )
        #: the op as torch's C++ callable (what ``op(...)`` calls), where nothing is added to
        #: its arguments (a generator) or done instead (``AtenSession.run_op``)
        plain = not (allowed.generators or allowed.random_without_generator or name in CPU_GAPS)
        self.direct = allowed.op._op if plain else None
        #: the op makes one tensor (its one return, not an operand)
        self.one_new = allowed.returns == [(False, False)] and len(outputs) == 1
        self.out_bytes = sum(o[3] for o in self.outputs)
        self.encoded = encoded
        n = len(operands)
        floats: list[int] = []
        for v in (*encoded[0], *encoded[1].values()):
            _indices(v, n, floats)
        #: the floats each call gives (its float arguments' values)
        self.n_floats = max(floats) + 1 if floats else 0
        # checked once: the named values (dtypes, layouts), on stand-ins for the operands
        a.decode(list(encoded[0]), [None] * n, [0.0] * self.n_floats)
        a.decode(list(encoded[1].values()), [None] * n, [0.0] * self.n_floats)
        self.plan = [_step(a, v) for v in encoded[0]]
        self.kwplan = [(k, *_step(a, v)) for k, v in encoded[1].items()]
        #: the operands the op writes (by their schema): the stream orders them as writes
        written: set[int] = set()
        args, kwargs = encoded
        for i, arg_name in allowed.writes:
            value = args[i] if i < len(args) else kwargs.get(arg_name)
            written.update(_indices(value, n, []))
        self.written = sorted(written)
        #: per operand: its view may be kept with its buffer's, and taken of the tensor kept
        #: as the buffer (``keep_as_is``): the op reads it, or writes its elements only (it
        #: cannot change the view's sizes or its storage's, as an out= op resizing its
        #: output or a ``resize_`` would)
        relaid: set[int] = set()
        for i, arg_name in allowed.relays:
            value = args[i] if i < len(args) else kwargs.get(arg_name)
            relaid.update(_indices(value, n, []))
        self.kept = tuple(k not in relaid for k in range(n))
        #: on a device that times ops on their shapes alone: the op's work (FLOPs, bytes,
        #: dtype), as its first call found it (the same at every call: the shapes are)
        self.work: tuple[float, float, Any] | None = None
        #: this template's calls as one function made for it (``_fast_run``), where it
        #: takes the common way (None: ``_run``'s loops)
        self.fast = _fast_run(self, a)

    def __repr__(self) -> str:
        return f"AtenTemplate({self.name}, {len(self.layouts)} operands)"

    # -- a call ----------------------------------------------------------------------------
    def check(self, places: Sequence[int], outputs: Sequence[int], floats: Sequence[float]) -> None:
        """The call gives what this template takes (else ``CallFailed``)."""
        if (
            len(places) != 2 * len(self.layouts)
            or len(outputs) != len(self.outputs)
            or len(floats) != self.n_floats
        ):
            raise CallFailed(
                f"{self.name}'s template takes {len(self.layouts)} operands, "
                f"{len(self.outputs)} outputs and {self.n_floats} floats; the call gave "
                f"{len(places) // 2}, {len(outputs)} and {len(floats)}"
            )

    def plain(
        self, places: Sequence[int], outputs: Sequence[int], floats: Sequence[float]
    ) -> tuple[tuple[TensorDesc, ...], tuple[list[Any], dict[str, Any]], tuple[TensorDesc, ...]]:
        """The ``aten`` call's arguments this call stands for: operands, [args, kwargs]
        (the floats in place), outputs."""
        self.check(places, outputs, floats)
        descs = []
        for k, (sizes, strides, dtype, itemsize, *_) in enumerate(self.layouts):
            offset = places[2 * k + 1]
            if offset % itemsize:
                raise CallFailed(f"operand {k} at offset {offset}: not a multiple of {itemsize}")
            descs.append(TensorDesc(places[2 * k], offset, sizes, strides, dtype))
        args, kwargs = self.encoded
        encoded = (
            [_filled(v, floats) for v in args],
            {k: _filled(v, floats) for k, v in kwargs.items()},
        )
        return tuple(descs), encoded, tuple(self._descs(outputs))

    def run(
        self,
        a: AtenSession,
        s: SessionState,
        ctx: BatchContext,
        places: Sequence[int],
        outputs: Sequence[int],
        floats: Sequence[float],
    ) -> None:
        """Run one call of this template (a device that computes: ``a.by_template``)."""
        try:
            if self.fast is not None:
                self.fast(a, s, ctx, places, outputs, floats)
            else:
                self._run(a, s, ctx, places, outputs, floats)
        except BaseException:
            self.alloc_missing(s, outputs)  # the client holds these handles whatever happened
            raise

    def view_of(self, a: AtenSession, s: SessionState, k: int, handle: int, offset: int) -> Any:
        """Operand ``k``'s view at ``[handle, offset]`` where none is kept yet: made of the
        buffer's flat tensor (bounds-checked), kept with the buffer's views where it may be."""
        sizes, strides, dtype, itemsize, reach, key, kept_key, lid = self.layouts[k]
        views = s.views
        own = views.get(handle)
        end = offset + reach if reach else 0  # (0: no elements, no byte reached)
        typed = None if own is None else own.get(key)  # the buffer as a flat tensor
        kept = self.kept[k]
        whole = None  # the tensor an op made, kept as the buffer (``keep_as_is``)
        if typed is None and own is not None and kept:
            typed = whole = own.get(kept_key)
        if typed is None or offset % itemsize or end > s.nbytes[handle]:
            if offset % itemsize:
                raise CallFailed(f"operand {k} at offset {offset}: not a multiple of {itemsize}")
            t = a.strided(handle, offset, sizes, strides, dtype, end, kept)  # (checks)
        elif (
            whole is not None
            and not offset
            and whole.stride() == strides
            and whole.shape == sizes
            and not whole.storage_offset()
        ):
            t = whole  # (the operand is that tensor, as laid out: no view to make)
        else:
            t = typed.as_strided(sizes, strides, offset // itemsize if end else 0)
        if kept:
            own = views.setdefault(handle, {})
            if len(own) >= _MAX_VIEWS:  # (layouts after layouts: start over)
                own.clear()
            own[("t", lid, offset)] = t
        return t

    def _run(
        self,
        a: AtenSession,
        s: SessionState,
        ctx: BatchContext,
        places: Sequence[int],
        outputs: Sequence[int],
        floats: Sequence[float],
    ) -> None:
        if (
            len(places) != self.n_places
            or len(outputs) != len(self.outputs)
            or len(floats) != self.n_floats
        ):
            self.check(places, outputs, floats)  # raises, saying what the call gave
        buffers, views, kept = s.buffers, s.views, self.kept
        tensors: list[Any] = []
        reads: list[Any] = []
        for k, layout in enumerate(self.layouts):
            handle, offset = places[2 * k], places[2 * k + 1]
            own = views.get(handle)  # (a view kept there was checked when it was made)
            t = own.get(("t", layout[7], offset)) if own is not None and kept[k] else None
            if t is None:
                t = self.view_of(a, s, k, handle, offset)
            tensors.append(t)
            reads.append(buffers[handle])
        keep = a.runtime.keeps_results
        if keep:
            for h in outputs:
                if h in buffers:
                    s.check_new(buffers, h, "buffer")  # raises
            if len(outputs) > 1 and len(set(outputs)) != len(outputs):
                raise CallFailed("an op's outputs must each have a handle of their own")
            if s.device_bytes + self.out_bytes > s.limits.max_device_bytes:
                a._room("outputs", self.out_bytes)  # raises
            held = len(buffers) + len(s.streams) + len(s.events) + len(s.kernels)
            if outputs and held >= s.limits.max_handles:
                s.check_new(buffers, outputs[0], "buffer")  # raises: the session's limit
        else:
            for h, o in zip(outputs, self.outputs, strict=True):
                s.alloc(h, o[3])
        writes = [reads[k] for k in self.written]
        if not keep:
            writes += [buffers[h] for h in outputs]
        args = [
            tensors[x]
            if how == _TENSOR
            else floats[x]
            if how == _FLOAT
            else x
            if how == _CONSTANT
            else a.decode(x, tensors, floats)
            for how, x in self.plan
        ]
        kwargs = {
            k: tensors[x]
            if how == _TENSOR
            else floats[x]
            if how == _FLOAT
            else x
            if how == _CONSTANT
            else a.decode(x, tensors, floats)
            for k, how, x in self.kwplan
        }
        allowed, direct = self.allowed, self.direct

        def job() -> None:
            with a.isolated():
                # the memory of the operands: a tensor the op made there is not its own
                a.operand_memory = memory = {t.untyped_storage().data_ptr() for t in tensors}
                if direct is None:
                    result = a.run_op(allowed, self.name, args, kwargs)
                else:
                    try:
                        result = direct(*args, **kwargs)
                    except OP_ERRORS as exc:
                        raise CallFailed(f"{type(exc).__name__}: {first_line(exc)}") from None
                if self.one_new:
                    made = [result] if result is not None else []
                else:
                    made = a.new_tensors(allowed, result)
                if keep:
                    self._keep(a, s, made, outputs, memory)
                else:
                    a.fill_outputs(self.name, made, self._descs(outputs))

        a.runtime.run(job, reads, writes, ctx.stream)  # in order on the stream

    def _descs(self, outputs: Sequence[int]) -> list[TensorDesc]:
        return [
            TensorDesc(h, 0, o[0], o[1], o[2]) for h, o in zip(outputs, self.outputs, strict=True)
        ]

    def _keep(
        self,
        a: AtenSession,
        s: SessionState,
        made: list[Any],
        outputs: Sequence[int],
        memory: set[int],
    ) -> None:
        """Each output's buffer: the tensor the op made, as it is, where it is laid out as
        the template says (``AtenSession.keep_outputs``, with the layouts' facts known)."""
        if len(made) != len(outputs):
            a.keep_outputs(self.name, made, self._descs(outputs))  # raises, allocating them
            return
        device = a.device
        kept: list[tuple[int, Any, int, str, Any]] = []
        copy: list[tuple[Any, TensorDesc]] = []
        for r, h, (sizes, strides, dtype, nbytes, torch_dtype) in zip(
            made, outputs, self.outputs, strict=True
        ):
            if kept_as_is(r, sizes, strides, torch_dtype, nbytes, memory, device):
                kept.append((h, r, nbytes, dtype, None))
            else:
                s.alloc(h, nbytes)
                copy.append((r, TensorDesc(h, 0, sizes, strides, dtype)))
        if kept:
            a.keep_as_is(kept)
        if copy:
            a.fill_outputs(self.name, [r for r, _ in copy], [d for _, d in copy])

    def run_timed(
        self,
        a: AtenSession,
        s: SessionState,
        ctx: BatchContext,
        places: Sequence[int],
        outputs: Sequence[int],
        floats: Sequence[float],
    ) -> None:
        """One call on a device that times ops on their shapes alone (``sim:...,compute=0``),
        its work known (``work``): the operands' bounds checked, the outputs' buffers made,
        the device's time for the work taken on the call's stream."""
        assert self.work is not None
        try:
            self.check(places, outputs, floats)
            nbytes = s.nbytes
            for k, (_, _, _, itemsize, reach, *_) in enumerate(self.layouts):
                handle, offset = places[2 * k], places[2 * k + 1]
                n = nbytes.get(handle)
                if n is None:
                    raise UnknownHandle(f"unknown buffer handle {handle}")
                if offset % itemsize or (reach and offset + reach > n):
                    raise CallFailed(
                        f"operand {k} at offset {offset} ({reach} bytes) lies outside buffer "
                        f"{handle} of {n} bytes, or between its elements"
                    )
            for h, o in zip(outputs, self.outputs, strict=True):
                s.alloc(h, o[3])
        except BaseException:
            self.alloc_missing(s, outputs)
            raise
        a.runtime.work(ctx.stream, *self.work)

    def alloc_missing(self, s: SessionState, outputs: Sequence[int]) -> None:
        """Each output the call did not make, made (empty): later calls name them."""
        _alloc_missing(s, outputs, self.outputs)


class Refused:
    """A template this proxy did not keep (its op is not allowed here, an argument it does
    not take): each of its calls fails with that error, as each ``aten`` call of it would,
    and makes its outputs (empty: the client holds their handles)."""

    __slots__ = ("error", "name", "outputs")
    work = None  # (never known: no call of it runs)

    def __init__(self, name: str, error: Exception, outputs: Sequence[TensorDesc]) -> None:
        self.name = name
        self.error = (
            str(error) if isinstance(error, CallFailed) else f"{type(error).__name__}: {error}"
        )
        #: per output, as ``AtenTemplate.outputs``: its buffer's bytes last
        self.outputs = tuple((d.sizes, d.strides, d.dtype, _reach(d)) for d in outputs)

    def plain(self, places: Sequence[int], outputs: Sequence[int], floats: Sequence[float]) -> Any:
        raise CallFailed(self.error)

    def run(self, a: AtenSession, s: SessionState, ctx: BatchContext, *call: Any) -> None:
        raise CallFailed(self.error)

    def alloc_missing(self, s: SessionState, outputs: Sequence[int]) -> None:
        _alloc_missing(s, outputs, self.outputs)


def _fast_run(template: AtenTemplate, a: AtenSession) -> Any:
    """``template._run`` as one function made for this template, where its call takes the
    common way (the op is torch's own callable): no loop over the operands or the arguments
    (lists of operands, a ``_foreach_`` op's, written out too), each read where it is, in
    the order and with the checks of ``_run`` (bounds, new handles, room; on a device that
    copies results into buffers, a GPU's, the outputs allocated and filled as there), which
    the tests hold equal to it. None where the call does not take that way. The code is made
    from this proxy's numbers alone (counts, indices, layout ids); the op, the constants and
    the keywords' names are the function's globals, never text in its code."""
    if template.direct is None:
        return None
    keep = bool(a.runtime.keeps_results)  # (else each output is a buffer, filled: a GPU's)
    n, n_out = len(template.layouts), len(template.outputs)
    env: dict[str, Any] = {
        "CallFailed": CallFailed,
        "OP_ERRORS": OP_ERRORS,
        "first_line": first_line,
        "check": template.check,
        "view_of": template.view_of,
        "keep": template._keep,
        "op": template.direct,
        "allowed": template.allowed,
        "TWICE": "an op's outputs must each have a handle of their own",
        "NAME": template.name,
        "descs": template._descs,
    }
    lines = [
        "def run(a, s, ctx, places, outputs, floats):",
        f"    if len(places) != {2 * n} or len(outputs) != {n_out} or len(floats) != "
        f"{int(template.n_floats)}:",
        "        check(places, outputs, floats)",
        "    buffers = s.buffers",
        "    views = s.views",
    ]
    for k in range(n):
        lines += [f"    h{k} = places[{2 * k}]", f"    o{k} = places[{2 * k + 1}]"]
        if template.kept[k]:
            lid = int(template.layouts[k][7])  # (this proxy's number: ``a.layout_ids``)
            lines += [
                f"    own = views.get(h{k})",
                f"    t{k} = None if own is None else own.get(('t', {lid}, o{k}))",
                f"    if t{k} is None:",
                f"        t{k} = view_of(a, s, {k}, h{k}, o{k})",
            ]
        else:
            lines.append(f"    t{k} = view_of(a, s, {k}, h{k}, o{k})")
        lines.append(f"    r{k} = buffers[h{k}]")
    if keep:
        lines += _output_checks(template)
    else:  # (each output allocated now, filled by the op's job)
        lines += [f"    s.alloc(outputs[{j}], {int(o[3])})" for j, o in enumerate(template.outputs)]

    def value(how: int, x: Any, name: str) -> str:
        if how == _TENSOR:
            return f"t{_index(x)}"
        if how == _FLOAT:
            return f"floats[{_index(x)}]"
        if how == _DECODED:  # (a list holding operands or floats: written out)
            return held(x, name)
        env[name] = x  # (a constant: the function's global, never its text)
        return name

    def held(v: Any, name: str) -> str:
        """The code of wire value ``v`` as ``AtenSession.decode`` makes it per call."""
        if type(v) is list and _holds(v):
            return f"[{', '.join(held(e, f'{name}_{i}') for i, e in enumerate(v))}]"
        if type(v) is dict and "t" in v:
            return f"t{_index(v['t'])}"  # (< the operands' count: ``_indices`` checked it)
        if type(v) is dict and "f" in v:
            return f"floats[{_index(v['f'])}]"  # (< ``n_floats``, the call's count)
        env[name] = a.decode(v, ())  # a constant, decoded once
        return name

    args = [value(how, x, f"C{i}") for i, (how, x) in enumerate(template.plan)]
    keywords = []
    for i, (key, how, x) in enumerate(template.kwplan):
        env[f"K{i}"] = key
        keywords.append(f"K{i}: {value(how, x, f'KC{i}')}")
    if keywords:
        args.append(f"**{{{', '.join(keywords)}}}")
    call = f"op({', '.join(args)})"
    returns = template.allowed.returns
    if template.one_new:
        made = "[result] if result is not None else []"
    elif all(aliases for _, aliases in returns):
        made = "[]"  # (the op makes nothing: each return is an operand it wrote)
    else:
        made = "a.new_tensors(allowed, result)"
    memory = ", ".join(f"t{k}.untyped_storage().data_ptr()" for k in range(n))
    body = [
        # the memory of the operands: a tensor the op made there is not its own
        f"    a.operand_memory = memory = {{{memory}}}"
        if n
        else "    a.operand_memory = memory = set()",
        "    try:",
        f"        result = {call}",
        "    except OP_ERRORS as exc:",
        "        raise CallFailed(f'{type(exc).__name__}: {first_line(exc)}') from None",
        *(
            _kept_lines(template, a, made, env)
            if keep
            else [f"    a.fill_outputs(NAME, {made}, descs(outputs))"]
        ),
    ]
    env["dispatch_modes"] = a.torch._C._len_torch_dispatch_stack
    # (``a.isolated()`` only where the thread has modes to set aside: a proxy in the
    # client's process, tracing; the same lines either way)
    lines += [
        "    def job():",
        "        if dispatch_modes():",
        "            with a.isolated():",
        *(f"            {line}" for line in body),
        "        else:",
        *(f"        {line}" for line in body),
    ]
    writes = [f"r{k}" for k in template.written]
    if not keep:
        writes += [f"buffers[outputs[{j}]]" for j in range(n_out)]
    reads = [f"r{k}" for k in range(n)]
    lines.append(f"    a.runtime.run(job, [{', '.join(reads)}], [{', '.join(writes)}], ctx.stream)")
    exec(_compiled("\n".join(lines), template.name), env)  # (no text of the client's in it)
    return env["run"]


def _compiled(text: str, name: str) -> Any:
    """``text`` compiled, once for every session of this proxy (a session of the same
    program makes the same text: compiling was most of a new template's cost)."""
    key = (text, name)
    code = _CODE.get(key)
    if code is None:
        if len(_CODE) >= _MOST_CODE:  # (programs after programs: start over)
            _CODE.clear()
        code = _CODE[key] = compile(text, f"<template {name}>", "exec")
    return code


#: ``_fast_run``'s code by its text and op name, for every session (``_compiled``)
_CODE: dict[tuple[str, str], Any] = {}
_MOST_CODE = 4096


def _index(x: Any) -> int:
    """An operand's or a float's index, as the code of ``_fast_run`` writes it: an int, 0 or
    more (the wire checked it so; the code is made of nothing else)."""
    if type(x) is not int or x < 0:
        raise CallFailed(f"an argument's index {x!r} is not one")
    return x


def _output_checks(template: AtenTemplate) -> list[str]:
    """``_fast_run``'s lines that check, where ops' results are kept as buffers, that the
    outputs' handles are new and distinct and that the session has room for them."""
    n_out = len(template.outputs)
    lines = []
    for j in range(n_out):
        lines += [
            f"    if outputs[{j}] in buffers:",
            f"        s.check_new(buffers, outputs[{j}], 'buffer')",
        ]
    if n_out > 1:
        lines += [f"    if len(set(outputs)) != {n_out}:", "        raise CallFailed(TWICE)"]
    out_bytes = int(template.out_bytes)
    lines += [
        f"    if s.device_bytes + {out_bytes} > s.limits.max_device_bytes:",
        f"        a._room('outputs', {out_bytes})",
    ]
    if n_out:
        lines += [
            "    if len(buffers) + len(s.streams) + len(s.events) + len(s.kernels) >= "
            "s.limits.max_handles:",
            "        s.check_new(buffers, outputs[0], 'buffer')",
        ]
    return lines


def _kept_lines(
    template: AtenTemplate, a: AtenSession, made: str, env: dict[str, Any]
) -> list[str]:
    """``_fast_run``'s lines that make what the op made (``made``: its code) the outputs'
    buffers: for one output, ``kept_as_is``'s checks written out (the facts of the
    template's layout known), the tensor kept as it is; else, or where it is not so laid out,
    ``_keep``."""
    if len(template.outputs) != 1:
        if made == "[]" and not template.outputs:
            return []  # (nothing made, nothing expected)
        return [f"    keep(a, s, {made}, outputs, memory)"]
    sizes, strides, dtype, nbytes, torch_dtype = template.outputs[0]
    nbytes = int(nbytes)
    if math.prod(sizes) * TENSOR_DTYPES[dtype] != nbytes:  # (not dense: copied, always)
        return [f"    keep(a, s, {made}, outputs, memory)"]
    runtime = a.runtime
    env.update(SIZES=sizes, STRIDES=strides, DTYPE=torch_dtype, KEPT=("kept", dtype))
    env.update(device=a.device, runtime=runtime, Unadopted=Unadopted)
    # (as ``AtenSession.keep_as_is`` keeps one)
    buffer = "Unadopted(runtime, m)" if runtime.adopts_later else "runtime.adopt(m)"
    return [
        f"    made = {made}",
        "    if len(made) != 1:",
        "        keep(a, s, made, outputs, memory)  # (raises)",
        "        return",
        "    m = made[0]",
        "    st = m.untyped_storage()",
        "    if (",
        "        m.dtype == DTYPE",
        "        and m.stride() == STRIDES",
        "        and m.shape == SIZES",
        "        and m.storage_offset() == 0",
        f"        and st.nbytes() == {nbytes}",
        "        and st.data_ptr() not in memory",
        "        and m.device == device",
        "        and m._base is None",
        "    ):",
        f"        s.adopt(outputs[0], {buffer}, {nbytes})",
        "        views[outputs[0]] = {KEPT: m}",
        "    else:",
        "        keep(a, s, made, outputs, memory)  # (copied)",
    ]


def _alloc_missing(s: SessionState, outputs: Sequence[int], layouts: Sequence[Any]) -> None:
    for h, o in zip(outputs, layouts, strict=False):
        if h not in s.buffers:
            with contextlib.suppress(*CALL_FAILURES):
                s.alloc(h, o[3])


def _indices(value: Any, n: int, floats: list[int]) -> list[int]:
    """The operands ``value`` (a wire argument) names (each checked to be one of ``n``);
    the indices of the floats it takes are added to ``floats``."""
    t = type(value)
    if t is list:
        out: list[int] = []
        for v in value:
            out += _indices(v, n, floats)
        return out
    if t is dict:
        ((tag, x),) = value.items()
        if tag == "t":
            if x >= n:
                raise CallFailed(f"tensor {x} of {n}")
            return [x]
        if tag == "f":
            floats.append(x)
    return []


def _holds(value: Any) -> bool:
    """Whether a wire argument holds an operand or a float (else it is a constant)."""
    if type(value) is list:
        return any(_holds(v) for v in value)
    return type(value) is dict and ("t" in value or "f" in value)


def _step(a: AtenSession, value: Any) -> tuple[int, Any]:
    """How argument ``value`` is made per call (see ``_TENSOR``...)."""
    if type(value) is dict and "t" in value:
        return _TENSOR, value["t"]
    if type(value) is dict and "f" in value:
        return _FLOAT, value["f"]
    if not _holds(value):
        return _CONSTANT, a.decode(value, ())
    return _DECODED, value


def _filled(value: Any, floats: Sequence[float]) -> Any:
    """A wire argument with its floats in place."""
    if type(value) is list:
        return [_filled(v, floats) for v in value]
    if type(value) is dict and "f" in value:
        return floats[value["f"]]
    return value


def _reach(d: TensorDesc) -> int:
    """The bytes a layout reaches from its first element (0: it has none)."""
    return extent(d.sizes, d.strides, TENSOR_DTYPES[d.dtype])
