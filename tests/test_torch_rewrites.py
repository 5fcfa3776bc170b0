"""What the ``gpuremote`` backend of ``torch.compile`` rewrites in AOTAutograd's functional
graphs (``gpuremote.torch._rewrites``): updates done in place only where no one reads the
old value, results bitwise the functional graph's, on random programs and on a compiled
AdamW step against a proxy."""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="gpuremote.torch needs the [torch] extra")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.func import functionalize  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

import gpuremote.torch as gt  # noqa: E402
from gpuremote.torch import _compile  # noqa: E402
from gpuremote.torch._rewrites import (  # noqa: E402
    copies_as_one,
    lerps_restored,
    updates_in_place,
)

aten = torch.ops.aten


def _functional(f: Callable[..., Any], *args: Any, views: bool = True) -> Any:
    """``f`` as AOTAutograd hands it over: functional ATen ops, the inputs' updates
    ``copy_``'d back at the end (with views kept, as AOTAutograd keeps them, or not)."""
    remove = "mutations" if views else "mutations_and_views"
    return make_fx(functionalize(f, remove=remove), tracing_mode="fake")(*args)


def _ops(gm: Any) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _same_run(f: Callable[..., Any], gm: Any, *args: torch.Tensor) -> None:
    """``gm`` (rewritten) does to ``args`` and returns what ``f`` (the graph as it was) does,
    bitwise."""
    want_args = [a.clone() for a in args]
    got_args = [a.clone() for a in args]
    want = f(*want_args)
    got = gm(*got_args)
    for w, g in zip([*want_args, *want], [*got_args, *got], strict=True):
        assert torch.equal(w, g)


def test_an_optimizers_functional_update_runs_in_place() -> None:
    def update(*tensors: torch.Tensor) -> tuple[()]:
        params, grads = list(tensors[:2]), list(tensors[2:])
        torch._foreach_mul_(params, 0.5)
        torch._foreach_add_(params, grads, alpha=-0.1)
        return ()

    params = [torch.randn(3), torch.randn(2, 4)]
    grads = [torch.randn(3), torch.randn(2, 4)]
    gm = _functional(update, *params, *grads)
    functional = copy.deepcopy(gm)
    assert aten.copy_.default in _ops(gm)
    assert updates_in_place(gm) == [0, 1]  # the placeholders it writes
    copies_as_one(gm)
    assert _ops(gm) == [aten._foreach_mul_.Scalar, aten._foreach_add_.List]
    _same_run(functional, gm, *params, *grads)
    _same_run(update, gm, *params, *grads)


def _lerp_as_dynamo_writes_it(weight: float, keep: bool = False) -> Callable[..., Any]:
    """``_foreach_lerp_(starts, ends, weight)`` as ``torch._dynamo.polyfills`` writes it
    for ``|weight| < 0.5`` (``keep``: the weights' tensors returned too)."""

    def program(*t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        starts, ends = list(t[:2]), list(t[2:])
        diffs = torch._foreach_sub(ends, starts)
        weights = [torch.full_like(d, weight) for d in diffs]
        torch._foreach_addcmul_(starts, weights, diffs)
        return tuple(w * 1 for w in weights) if keep else ()

    return program


def test_dynamos_lerp_goes_back_to_the_lerp_kernel() -> None:
    args = [torch.randn(1000), torch.randn(7, 13), torch.randn(1000), torch.randn(7, 13)]
    program = _lerp_as_dynamo_writes_it(0.1)
    gm = _functional(program, *args)
    functional = copy.deepcopy(gm)
    assert lerps_restored(gm) == 1
    assert updates_in_place(gm) == [0, 1]
    assert _ops(gm) == [aten._foreach_lerp_.Scalar]
    _same_run(functional, gm, *args)
    lerped = [a.clone() for a in args]
    torch._foreach_lerp_(lerped[:2], lerped[2:], 0.1)  # what eager code runs
    got = [a.clone() for a in args]
    gm(*got)
    assert all(torch.equal(a, b) for a, b in zip(lerped, got, strict=True))
    # not where the weights are read elsewhere, nor for the other formula's weights
    for weight, keep in ((0.1, True), (0.7, False)):
        gm = _functional(_lerp_as_dynamo_writes_it(weight, keep), *args)
        assert lerps_restored(gm) == 0


@pytest.mark.parametrize(
    ("name", "program", "in_place"),
    [
        # x is read after the op that would overwrite it: that op stays out of place
        ("read later", lambda x: (x * 2 + x.neg(),), []),
        # x is never written back: an input the caller still holds
        ("an input not updated", lambda x: (x.exp(),), []),
        # the update would be returned: an output would alias an input
        ("an update returned", lambda x: (x.mul_(2),), []),
        # an operand read twice by the op
        ("twice", lambda x: (x * x,), []),
        # a view of the intermediate is read after the op
        ("a view read later", lambda x: ((x + 1) * 1, (x + 1).t()), []),
        # a wider result than the operand (broadcast), another dtype
        ("broadcast", lambda x: ((x[0:1] * 1) + x,), []),
        ("dtype", lambda x: (x.to(torch.int32) * 1.5,), []),
    ],
)
def test_what_is_read_afterwards_is_never_overwritten(
    name: str, program: Callable[..., Any], in_place: list[int]
) -> None:
    x = torch.randn(3, 3)
    gm = _functional(program, x)
    functional = copy.deepcopy(gm)
    assert updates_in_place(gm) == in_place, name
    _same_run(functional, gm, x)


def test_a_view_taken_before_keeps_its_base_out_of_place() -> None:
    def program(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x * 2
        v = y.view(-1)
        return (y + 1, v)

    gm = _functional(program, torch.randn(2, 3))
    functional = copy.deepcopy(gm)
    updates_in_place(gm)
    assert aten.add.Tensor in _ops(gm)  # y's view is returned: y is not overwritten
    _same_run(functional, gm, torch.randn(2, 3))


# -- random programs ----------------------------------------------------------------------
_BINARY = [operator.add, operator.mul, operator.sub]


def _program(steps: list[tuple[Any, ...]], outs: list[int]) -> Callable[..., Any]:
    """A program over three [4, 4] inputs: each step makes a value (an op of two, a view, a
    multi-tensor op) or updates one in place (an input, a value, a view). (Its functional
    graph is the reference: functionalization's order of a multi-tensor update of two
    aliases is not eager's.)"""

    def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vals = list(inputs)
        for kind, a, b, k in steps:
            x, y = vals[a % len(vals)], vals[b % len(vals)]
            if kind == "op":
                vals.append(_BINARY[k % 3](x, y))
            elif kind == "view":
                flat = k % 2 == 0 and x.is_contiguous()
                vals.append(x.view(16).view(4, 4) if flat else x.t())
            elif kind == "update":
                (x.add_ if k % 2 else x.mul_)(y if x is not y else 0.5)
            elif kind == "foreach":
                if x is not y:
                    torch._foreach_add_([x, y], 0.25 * (k % 4))
                vals.append(torch._foreach_mul([x, y], 1.5)[k % 2])
        return tuple(vals[o % len(vals)] * 1 for o in outs)

    return run


_STEP = st.tuples(
    st.sampled_from(["op", "view", "update", "foreach"]),
    st.integers(0, 20),
    st.integers(0, 20),
    st.integers(0, 7),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_STEP, min_size=1, max_size=10), st.lists(st.integers(0, 20), max_size=3))
def test_random_programs_run_in_place_as_written(
    steps: list[tuple[Any, ...]], outs: list[int]
) -> None:
    program = _program(steps, outs)
    gen = torch.Generator().manual_seed(len(steps))
    inputs = [torch.randn(4, 4, generator=gen) for _ in range(3)]
    gm = _functional(program, *inputs)
    functional = copy.deepcopy(gm)
    updates_in_place(gm)
    copies_as_one(gm)
    _same_run(functional, gm, *inputs)


# -- through the backend --------------------------------------------------------------------
def test_a_call_whose_updated_input_shares_a_buffer_runs_the_functional_graph() -> None:
    def program(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x.mul_(2)
        return (y + 1,)

    x = torch.randn(4)
    gm = _functional(program, x, torch.randn(4))
    compiled = _compile._compiler(lambda index: None)(gm, [x, x])  # type: ignore[arg-type,return-value]
    assert compiled._written == (0,)
    a = torch.randn(4)
    want = program(a.clone(), a.clone())  # as two buffers: y keeps its value
    shared = a.clone()
    (got,) = compiled(shared, shared)  # one buffer: the functional graph reads y first
    assert torch.equal(got, want[0]) and torch.equal(shared, a * 2)


def _train_adamw(
    backend: str, in_place: bool, monkeypatch: pytest.MonkeyPatch, width: int
) -> tuple[list[torch.Tensor], float]:
    """Four steps of a two-layer MLP with AdamW (clipped) compiled on ``backend``, the
    updates rewritten in place or not: the parameters, the last update's device time."""
    from torch import nn

    if not in_place:
        monkeypatch.setattr(_compile, "updates_in_place", lambda gm: [])
    torch._dynamo.reset()
    torch.manual_seed(0)
    try:
        with gt.connect_local(backend) as conn:
            model = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 8))
            model = model.to("gpuremote")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)

            @torch.compile(backend="gpuremote")
            def update() -> None:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()

            x = torch.randn(4, width, generator=torch.Generator().manual_seed(1)).to("gpuremote")
            for i in range(4):
                loss = model(x).square().mean()
                opt.zero_grad()
                loss.backward()
                if i == 3:
                    start = _device_s(conn)
                update()
            spent = _device_s(conn) - start
            return [p.detach().cpu() for p in model.parameters()], spent
    finally:
        monkeypatch.undo()
        torch._dynamo.reset()


def test_a_compiled_adamw_step_in_place_is_the_functional_one(
    each_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AdamW with clipping under ``torch.compile(backend="gpuremote")``: the parameters
    after four steps bitwise those of the functional graphs (on a GPU proxy too: the same
    kernels, in place)."""
    in_place, _ = _train_adamw(each_backend, True, monkeypatch, 64)
    functional, _ = _train_adamw(each_backend, False, monkeypatch, 64)
    assert all(torch.equal(a, b) for a, b in zip(in_place, functional, strict=True))


def test_a_compiled_adamw_step_in_place_takes_less_device_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the timing-only A100 (16 MB a tensor list): no second buffer per parameter and
    state, no pass to copy them back."""
    _, spent = _train_adamw("sim:a100,compute=0", True, monkeypatch, 2048)
    _, spent_functional = _train_adamw("sim:a100,compute=0", False, monkeypatch, 2048)
    assert 0 < spent < 0.85 * spent_functional, (spent, spent_functional)


def _device_s(conn: Any) -> float:
    """The device time queued so far (the timing-only device's clock; 0 on others), after a
    wait for what the session sent."""
    torch.ones(1, device="gpuremote").cpu()
    return float(conn.drivers[0]._proxy.backend.timing()[0])
