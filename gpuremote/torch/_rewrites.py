"""What the ``gpuremote`` backend of ``torch.compile`` changes in AOTAutograd's graphs before
it runs and records them (``gpuremote.torch._compile``).

AOTAutograd hands over *functional* graphs: an optimizer's ``_foreach_mul_(params, ...)``
arrives as ``new = _foreach_mul(params, ...)`` and, at the end, a ``copy_`` of each new value
back into its parameter. Run as written on a device that would be a second buffer per
parameter, state and gradient, and a pass over all of them to copy them back (a GPT-2's
AdamW step: 12-23% more device time than the eager step's). Torch's own compilers write the
updates in place (inductor: into the mutated inputs' buffers); so do these rewrites, on the
ATen graph itself, before the first run records it:

- ``updates_in_place``: an op whose first operand (or each of a ``_foreach`` op's first
  list) the graph never reads again and which has an in-place variant becomes that variant:
  a value the graph made, or an input that the graph ends by overwriting (``copy_`` into it);
  its result is then that operand, and the closing ``copy_`` of an input into itself goes;
- ``lerps_restored``: dynamo's decomposition of ``_foreach_lerp_`` (a subtraction, a tensor
  of the weight per tensor, a multiply-add: eight passes over the memory where ``lerp``
  makes three; written so for inductor's fused kernels) back into ``_foreach_lerp``;
- ``copies_as_one``: the ``copy_`` of each updated value into its input as one
  ``_foreach_copy_``;
- ``constants_to_device``: the graph's host scalar constants that meet device tensors, on
  the device once.

The in-place graph runs the same kernels on the same values, so its results are bitwise the
functional graph's; a call whose updated inputs share a buffer with another argument runs the
functional graph (``_Graph`` keeps both).
"""

from __future__ import annotations

import operator
from typing import Any, cast

import torch
from torch.fx import GraphModule, Node

from ._tensors import DEVICE

__all__ = ["constants_to_device", "copies_as_one", "lerps_restored", "updates_in_place"]

_COPY = torch.ops.aten.copy_.default
_ADDCMUL = torch.ops.aten._foreach_addcmul.Scalar
_SUB = torch.ops.aten._foreach_sub.List
_FULL_LIKE = torch.ops.aten.full_like.default
_LERP = torch.ops.aten._foreach_lerp.Scalar


def lerps_restored(gm: GraphModule) -> int:
    """``_foreach_lerp(starts, ends, w)`` where dynamo wrote it (``torch._dynamo.polyfills.
    foreach_lerp_inplace``, ``|w| < 0.5``) as ``diffs = _foreach_sub(ends, starts)``, then
    ``_foreach_addcmul(starts, [full_like(d, w) for d in diffs], diffs)``: the formula of the
    lerp kernels themselves (``start + w * (end - start)``); returns how many it restored."""
    restored = 0
    for node in list(gm.graph.nodes):
        if node.target is not _ADDCMUL or len(node.args) != 3 or node.kwargs.get("value", 1) != 1:
            continue
        starts, weights, diffs = cast(tuple[Any, Any, Any], node.args)
        if not all(isinstance(x, (list, tuple)) and x for x in (starts, weights, diffs)) or not (
            len(starts) == len(weights) == len(diffs)
        ):
            continue
        sub: Any = diffs[0].args[0] if isinstance(diffs[0], Node) and diffs[0].args else None
        if (
            not isinstance(sub, Node)
            or sub.target is not _SUB
            or sub.kwargs
            or len(sub.args) != 2
            or list(cast(Any, sub.args[1])) != list(starts)
            or len(sub.users) != len(diffs)
            or any(
                not isinstance(d, Node)
                or d.target is not operator.getitem
                or d.args != (sub, i)
                or len(d.users) != 2
                for i, d in enumerate(diffs)
            )
        ):
            continue
        w = _full_like_value(weights, diffs)
        if w is None:
            continue
        with gm.graph.inserting_before(node):
            lerp = gm.graph.call_function(_LERP, (list(starts), list(cast(Any, sub.args[0])), w))
        lerp.meta = dict(node.meta)
        node.replace_all_uses_with(lerp)
        for dead in (node, *weights, *diffs, sub):
            gm.graph.erase_node(dead)
        restored += 1
    if restored:
        gm.recompile()
    return restored


def _full_like_value(weights: Any, diffs: list[Node]) -> float | None:
    """The one number that each ``weights[i]``, ``full_like(diffs[i], w)`` read only here,
    holds; None where they are not that."""
    values = set()
    for t, d in zip(weights, diffs, strict=True):
        if (
            not isinstance(t, Node)
            or t.target is not _FULL_LIKE
            or t.args[0] is not d
            or len(t.users) != 1
            or set(t.kwargs) - {"pin_memory"}
            or not isinstance(t.args[1], float)
            or len(t.args) != 2
        ):
            return None
        values.add(t.args[1])
    return values.pop() if len(values) == 1 and abs(next(iter(values))) < 0.5 else None


def updates_in_place(gm: GraphModule) -> list[int]:
    """Rewrite ``gm``'s functional updates in place (see the module docstring); returns the
    positions of the placeholders it now writes before the graph's end (empty: none)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    #: each input the graph overwrites at its end: the ``copy_`` that does it
    closing = {n.args[0]: n for n in nodes if _writes_back(n) and n.args[1] is not n.args[0]}
    written: set[Node] = set()
    changed = False
    for node in nodes:
        inplace = _inplace_variant(node)
        if inplace is None:
            continue
        first = node.args[0]
        selves = list(first) if isinstance(first, (list, tuple)) else [first]
        results = _results(node, len(selves)) if isinstance(first, (list, tuple)) else [node]
        if results is None or not selves or len(set(selves)) != len(selves):
            continue
        if not all(
            _free_to_write(s, node, order, closing) and _same_layout(s, r, k, node)
            for k, (s, r) in enumerate(zip(selves, results, strict=True))
        ):
            continue
        if any(
            s.op == "placeholder" and _reaches_output(r)
            for s, r in zip(selves, results, strict=True)
        ):
            continue  # an output would alias an input
        node.target = inplace
        for s, r in zip(selves, results, strict=True):
            if r is not None:
                r.replace_all_uses_with(s)
                if r is not node:
                    gm.graph.erase_node(r)
            if s.op == "placeholder":
                written.add(s)
        changed = True
    for s, copy in closing.items():
        if copy.args[1] is s:  # the update is the input itself now
            gm.graph.erase_node(copy)
    if changed:
        gm.recompile()
    return [i for i, p in enumerate(placeholders) if p in written]


def _inplace_variant(node: Node) -> Any | None:
    """The in-place overload of a functional ATen op whose first operand is a tensor or a
    list of them (``aten.mul.Tensor`` → ``aten.mul_.Tensor``); None where there is none."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    if (
        not schema.arguments
        or schema.is_mutable
        or any(r.alias_info is not None for r in schema.returns)
        or not isinstance(node.args[0] if node.args else None, (Node, list, tuple))
    ):
        return None
    name = schema.name.split("::")[-1]
    packet = getattr(torch.ops.aten, name + "_", None)
    inplace = getattr(packet, target._overloadname, None) if packet is not None else None
    if inplace is None:
        return None
    args = inplace._schema.arguments
    mutable = args[0].alias_info
    if (
        mutable is None
        or not mutable.is_write
        or any(a.alias_info is not None and a.alias_info.is_write for a in args[1:])
        or [a.name for a in args] != [a.name for a in schema.arguments]
    ):
        return None
    return inplace


def _results(node: Node, n: int) -> list[Node | None] | None:
    """The ``getitem`` of each of a list-returning op's ``n`` results (None: unused); None
    where the list is used otherwise."""
    out: list[Node | None] = [None] * n
    for u in node.users:
        if u.target is not operator.getitem or not isinstance(u.args[1], int):
            return None
        if out[u.args[1]] is not None:
            return None
        out[u.args[1]] = u
    return out


def _free_to_write(
    value: Any, node: Node, order: dict[Node, int], closing: dict[Node, Node]
) -> bool:
    """Whether ``node`` may overwrite ``value``: a tensor no view of which exists, that
    nothing reads after ``node`` and that ``node`` reads once; made by the graph (not a view)
    or an input the graph ends by overwriting."""
    if not isinstance(value, Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        return False
    if value.op == "placeholder":
        if value not in closing:
            return False
    elif not _fresh(value):
        return False
    if sum(_mentions(a, value) for a in (*node.args, *node.kwargs.values())) != 1:
        return False
    for u in value.users:
        if u is node:
            continue
        if u is closing.get(value) and u.args[0] is value and not _mentions(u.args[1], value):
            continue
        if order[u] > order[node] or _aliasing(u):
            return False
    return True


def _fresh(value: Node) -> bool:
    """Whether ``value`` is a tensor the graph made in a buffer of its own."""
    maker = value
    if value.target is operator.getitem and isinstance(value.args[0], Node):
        maker = value.args[0]
    target = maker.target
    return (
        maker.op == "call_function"
        and isinstance(target, torch._ops.OpOverload)
        and not target._schema.is_mutable
        and all(r.alias_info is None for r in target._schema.returns)
    )


def _aliasing(user: Node) -> bool:
    """Whether ``user``'s result, read by the graph, may share a buffer with its operands (a
    view, an in-place op, anything not known to be an ATen op)."""
    if not user.users:  # what it returns, alias or not, goes unread
        return False
    target = user.target
    if user.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return True
    return any(r.alias_info is not None for r in target._schema.returns)


def _mentions(arg: Any, value: Node) -> int:
    if arg is value:
        return 1
    if isinstance(arg, (list, tuple)):
        return sum(_mentions(a, value) for a in arg)
    return 0


def _same_layout(value: Node, result: Node | None, k: int, node: Node) -> bool:
    """Whether the op's ``k``-th result has ``value``'s sizes, strides and dtype (what the
    in-place op writes into ``value``)."""
    made = node.meta.get("val")
    out = made[k] if isinstance(made, (list, tuple)) else made
    if result is not None and result is not node:
        out = result.meta.get("val", out)
    have = value.meta["val"]
    return (
        isinstance(out, torch.Tensor)
        and out.dtype == have.dtype
        and tuple(out.shape) == tuple(have.shape)
        and tuple(out.stride()) == tuple(have.stride())
        and torch._debug_has_internal_overlap(have) != 1
    )


def _reaches_output(result: Node | None) -> bool:
    return result is not None and any(u.op == "output" for u in result.users)


def _writes_back(node: Node) -> bool:
    """Whether ``node`` is a plain ``copy_(input, value)`` of a value into one of the
    graph's inputs, its result unread (how AOTAutograd writes an input's update back)."""
    return (
        node.target is _COPY
        and not node.users
        and not node.kwargs
        and len(node.args) == 2
        and isinstance(node.args[0], Node)
        and node.args[0].op == "placeholder"
    )


def copies_as_one(gm: GraphModule) -> None:
    """The ``copy_`` of each updated value into its input (how AOTAutograd writes an
    optimizer's step, or clipped gradients, back) as one ``_foreach_copy_`` where the
    graph does no more with those inputs: one op on the proxy, not one per tensor."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    copies = [
        n
        for n in gm.graph.nodes
        if _writes_back(n) and all(order[u] < order[n] for u in n.args[0].users if u is not n)
    ]
    if len(copies) < 2 or len({c.args[0] for c in copies}) != len(copies):
        return
    with gm.graph.inserting_after(copies[-1]):
        gm.graph.call_function(
            torch.ops.aten._foreach_copy_.default,
            ([c.args[0] for c in copies], [c.args[1] for c in copies]),
        )
    for c in copies:
        gm.graph.erase_node(c)
    gm.recompile()


def constants_to_device(gm: GraphModule) -> None:
    """The graph's host tensor constants that meet device tensors, moved to the device
    once (else each run would upload them, and a step cannot hold an upload)."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() == 0:
            users_on_device = any(
                isinstance(u.meta.get("val"), torch.Tensor) and u.meta["val"].device.type == DEVICE
                for u in node.users
            )
            if users_on_device:
                setattr(gm, node.target, value.to(DEVICE))
