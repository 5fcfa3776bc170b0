"""Recorded ATen steps replayed whole on the proxy (``gpuremote.proxy.graphs``): the graphs
of ``torch.compile(backend="gpuremote")`` run as one FX graph each (bitwise the call-by-call
replay's and the CPU's), or compiled by the proxy's inductor (within 1e-5, cached across
sessions, within a compile budget); a failing call is named; bad replays are refused."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="gpuremote.torch needs the [torch] extra")

import gpuremote.torch as gt  # noqa: E402
from gpuremote.core.driver import SyncDriver  # noqa: E402
from gpuremote.errors import RemoteCallError  # noqa: E402
from gpuremote.proxy.state import SessionLimits  # noqa: E402
from gpuremote.proxy.steps import RecordedStep, StepError  # noqa: E402
from gpuremote.tools.proxyprocess import LocalProxy  # noqa: E402
from gpuremote.torch.models import train, workload  # noqa: E402
from gpuremote.wire.calls import BUFFER, CALLS_BY_NAME  # noqa: E402
from gpuremote.wire.protocol import ArrayDesc  # noqa: E402

C = CALLS_BY_NAME
nn = torch.nn
#: the backends whose graphs these tests run (a simulated device replays call by call):
#: ``GPUREMOTE_TEST_BACKENDS``' numpy and cupy (``scripts/gpu_check.sh`` runs cupy)
BACKENDS = [
    b
    for b in os.environ.get("GPUREMOTE_TEST_BACKENDS", "numpy").split(",")
    if b.strip() in ("numpy", "cupy")
] or ["numpy"]


def _graphs(conn: Any) -> dict[str, Any]:
    """The proxy's figures of this session's graphs (its ``stats`` call)."""
    stats, _ = conn.drivers[0].call(C["stats"], [])
    return dict(stats["graphs"])


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _max_diff(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor):
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict):
        return max(_max_diff(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return max(_max_diff(x, y) for x, y in zip(a, b, strict=True))
    return abs(a - b)


def _same(a: Any, b: Any, backend: str) -> bool:
    """Bitwise on the CPU's kernels; within 1e-5 on a GPU's (atomics sum in any order)."""
    return _equal(a, b) if backend == "numpy" else _max_diff(a, b) <= 1e-5


def _train(graphs: str, name: str, backend: str, steps: int = 4) -> tuple[Any, dict[str, Any]]:
    torch._dynamo.reset()
    limits = SessionLimits(graphs=graphs)
    with gt.connect_local(backend, session_limits=limits) as conn:
        got = train(workload(name, "small"), "gpuremote", steps, compile="gpuremote")
        figures = _graphs(conn)
    torch._dynamo.reset()
    return got, figures


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["resnet18", "bert", "gpt2"])
def test_compiled_models_replay_as_one_graph_bitwise_as_call_by_call(
    name: str, backend: str
) -> None:
    """4 training steps: the forward and backward graphs replay as one FX graph each (the
    first replay traces it), with the losses and weights of the call-by-call replay and (on
    NumPy) of the CPU, bit for bit."""
    by_call, none = _train("ops", name, backend)
    whole, figures = _train("fx", name, backend)
    assert none["steps"] == 0
    assert figures["steps"] == 2 and figures["replays"] == 4 and figures["ops"] > 20, figures
    assert _same(by_call, whole, backend)
    if backend == "numpy":
        assert _equal(train(workload(name, "small"), "cpu", 4), whole)


class _Dropped(nn.Module):
    """Dropout between two linear layers (the session generator's draws, in a graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(8, 16), nn.Linear(16, 2), nn.Dropout(0.5)

    def forward(self, x: Any) -> Any:
        return self.b(self.drop(torch.relu(self.a(x))))


def _sgd_steps(
    make: Any, graphs: str, backend: str, lr: float, batch: int
) -> tuple[list[float], dict[str, Any], dict[str, Any]]:
    """5 SGD steps of ``make()`` compiled, its graphs run by ``graphs``: the losses, the
    final weights and the proxy's graph figures."""
    torch._dynamo.reset()
    with gt.connect_local(backend, session_limits=SessionLimits(graphs=graphs)) as conn:
        torch.manual_seed(0)
        model = make().to("gpuremote")
        step = torch.compile(model, backend="gpuremote")
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(1)).to("gpuremote")
        losses = []
        for _ in range(5):
            loss = step(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        weights = {k: v.cpu() for k, v in model.state_dict().items()}
        figures = _graphs(conn)
    torch._dynamo.reset()
    return losses, weights, figures


@pytest.mark.parametrize(
    "backend, graphs",
    [(b, "fx") for b in BACKENDS]
    + [pytest.param(b, "inductor", marks=pytest.mark.slow) for b in BACKENDS]
    + [pytest.param(b, "cudagraphs", marks=pytest.mark.slow) for b in BACKENDS if b == "cupy"],
)
def test_random_ops_in_a_graph_draw_from_the_session_generator_as_call_by_call(
    backend: str, graphs: str
) -> None:
    """Dropout in a compiled graph draws the call-by-call replay's masks: in the FX graph,
    and compiled by inductor (``fallback_random``: ATen's kernel on the session's generator,
    lent for the call), both graphs of the step compiled (on a GPU under ``cudagraphs``
    too: the one that draws is compiled, never captured)."""
    by_call, w_calls, _ = _sgd_steps(_Dropped, "ops", backend, 0.1, 32)
    whole, w_whole, figures = _sgd_steps(_Dropped, graphs, backend, 0.1, 32)
    assert figures["steps"] >= 1 and figures["replays"] >= 1, figures
    assert _same(by_call, whole, backend) and _same(w_calls, w_whole, backend)
    assert len(set(whole)) == len(whole)  # (each step drew its own mask)
    if graphs != "fx":
        assert figures["compiled"] == figures["steps"] == 2, figures


# -- by hand: the wire form -------------------------------------------------------------
@pytest.fixture
def driver() -> Iterator[SyncDriver]:
    d = SyncDriver(None, serve="numpy", proxy_options={"session_limits": SessionLimits()})
    try:
        yield d
    finally:
        d.close()


def _upload(d: SyncDriver, data: np.ndarray) -> int:
    h = d.session.new_handle()
    d.post(C["alloc"], 0, [h, data.nbytes])
    raw = memoryview(np.ascontiguousarray(data).view(np.uint8))
    d.post(C["copy_h2d"], 0, [[h, 0, [data.nbytes], "uint8"], BUFFER], raw)
    return h


def _read(d: SyncDriver, h: int, n: int, dtype: Any = np.float32) -> list[Any]:
    size = n * np.dtype(dtype).itemsize
    _, bufs = d.call(C["copy_d2h"], [[h, 0, [size], "uint8"]])
    return np.frombuffer(bufs[0], dtype=dtype).tolist()


def _t(h: int, n: int, dtype: str = "float32", offset: int = 0) -> list[Any]:
    return [h, offset, [n], [1], dtype]


def _aten(op: str, operands: list[Any], outputs: list[Any], args: list[Any] | None = None) -> Any:
    encoded = [args if args is not None else [{"t": i} for i in range(len(operands))], {}]
    return [C["aten"].opcode, 0, [op, operands, encoded, outputs]]


def _gather_step(d: SyncDriver, x: int, idx: int) -> tuple[int, int]:
    """A step of three calls: ``tmp = x * x``; a zeroed allocation ``z``; ``out =
    index_select(tmp, 0, idx) + z`` (``x``, ``idx`` its arguments)."""
    tmp, z, sel, out = (d.session.new_handle() for _ in range(4))
    program = [
        [[x, 0, [16], "uint8"], [idx, 0, [16], "uint8"]],
        [
            _aten("mul.Tensor", [_t(x, 4), _t(x, 4)], [_t(tmp, 4)]),
            [C["alloc"].opcode, 0, [z, 8]],
            _aten(
                "index_select.default",
                [_t(tmp, 4), _t(idx, 2, "int64")],
                [_t(sel, 2)],
                [{"t": 0}, 0, {"t": 1}],
            ),
            _aten("add.Tensor", [_t(sel, 2), _t(z, 2)], [_t(out, 2)]),
        ],
        [0, 1],
        [out],
    ]
    step = d.session.new_handle()
    d.post(C["step_record"], 0, [step, program])
    return step, out


def test_a_replay_failing_in_the_graph_names_its_call(driver: SyncDriver) -> None:
    d = driver
    x = _upload(d, np.array([1, 2, 3, 4], np.float32))
    good = _upload(d, np.array([3, 0], np.int64))
    bad = _upload(d, np.array([3, 9], np.int64))  # out of range: index_select fails
    step, _ = _gather_step(d, x, good)
    results = []
    for _ in range(3):  # traced, then run as the graph
        new = d.session.new_handle()
        d.post(
            C["step_replay"], 0, [step, [[x, 0, [16], "uint8"], [good, 0, [16], "uint8"]], [new]]
        )
        results.append(_read(d, new, 2))
    assert results == [[16.0, 1.0]] * 3
    stats, _ = d.call(C["stats"], [])
    assert stats["graphs"]["steps"] == 1 and stats["graphs"]["replays"] == 2
    lost = d.session.new_handle()
    d.post(C["step_replay"], 0, [step, [[x, 0, [16], "uint8"], [bad, 0, [16], "uint8"]], [lost]])
    with pytest.raises(RemoteCallError, match=r"call 2 of 4 \(index_select.default\)") as info:
        d.call(C["device_synchronize"], [])
    assert info.value.call == "step_replay"
    assert _read(d, lost, 2) == [0.0, 0.0]  # its result exists, as after a skip
    again = d.session.new_handle()  # the session goes on
    d.post(C["step_replay"], 0, [step, [[x, 0, [16], "uint8"], [good, 0, [16], "uint8"]], [again]])
    assert _read(d, again, 2) == [16.0, 1.0]


def test_a_graph_replay_checks_its_arguments_bounds(driver: SyncDriver) -> None:
    d = driver
    x = _upload(d, np.array([1, 2, 3, 4], np.float32))
    idx = _upload(d, np.array([1, 2], np.int64))
    small = _upload(d, np.array([1, 2], np.float32))  # 8 bytes: the step reads 16
    step, _ = _gather_step(d, x, idx)
    for _ in range(2):
        new = d.session.new_handle()
        d.post(C["step_replay"], 0, [step, [[x, 0, [16], "uint8"], [idx, 0, [16], "uint8"]], [new]])
        assert _read(d, new, 2) == [4.0, 9.0]
    new = d.session.new_handle()
    d.post(C["step_replay"], 0, [step, [[small, 0, [16], "uint8"], [idx, 0, [16], "uint8"]], [new]])
    with pytest.raises(RemoteCallError, match="reaches byte 16 of buffer"):
        d.call(C["device_synchronize"], [])


def test_a_run_by_buffers_binds_each_where_its_argument_was_recorded(driver: SyncDriver) -> None:
    """``step_run`` (what ``torch.compile``'s replays send): each argument by its buffer's
    handle alone, at its recorded place; a wrong count, or a buffer too small, refused with
    the replay's results made and the session going on."""
    d = driver
    x = _upload(d, np.array([1, 2, 3, 4], np.float32))
    idx = _upload(d, np.array([3, 0], np.int64))
    small = _upload(d, np.array([1, 2], np.float32))
    step, _ = _gather_step(d, x, idx)
    for _ in range(3):  # traced, then run as the graph
        new = d.session.new_handle()
        d.post(C["step_run"], 0, [step, [x, idx], [new]])
        assert _read(d, new, 2) == [16.0, 1.0]
    lost = d.session.new_handle()
    d.post(C["step_run"], 0, [step, [x], [lost]])
    with pytest.raises(RemoteCallError, match="takes 2 buffers; the run gave 1") as info:
        d.call(C["device_synchronize"], [])
    assert info.value.call == "step_run"
    assert _read(d, lost, 2) == [0.0, 0.0]  # its result exists, as after a skip
    d.post(C["step_run"], 0, [step, [small, idx], [d.session.new_handle()]])
    with pytest.raises(RemoteCallError, match="reaches byte 16 of buffer"):
        d.call(C["device_synchronize"], [])
    again = d.session.new_handle()
    d.post(C["step_run"], 0, [step, [x, idx], [again]])
    assert _read(d, again, 2) == [16.0, 1.0]


def _scale_step(d: SyncDriver, x: int, w: int, writes: bool = False) -> tuple[int, int]:
    """A step of one call, ``out = x * w``: ``x`` its argument, ``w`` a buffer of the
    session's (a weight: an input of the graph that no replay binds); ``writes``: then
    ``x *= 1`` (in place: the graph writes an input)."""
    out, step = d.session.new_handle(), d.session.new_handle()
    calls = [_aten("mul.Tensor", [_t(x, 4), _t(w, 4)], [_t(out, 4)])]
    if writes:
        calls.append(_aten("mul_.Scalar", [_t(x, 4)], [], [{"t": 0}, 1.0]))
    program = [[[x, 0, [16], "uint8"]], calls, [0], [out]]
    d.post(C["step_record"], 0, [step, program])
    return step, out


def test_a_graph_keeps_its_inputs_views_only_while_their_buffers_are(
    driver: SyncDriver,
) -> None:
    """A graph keeps its inputs' views between replays (made once while their bindings
    stay); a weight freed and made again under its handle is read anew, a buffer bound by one
    replay alone is not held after it, and a freed step leaves nothing behind."""
    d = driver
    w = _upload(d, np.array([1, 2, 3, 4], np.float32))
    xs = [_upload(d, np.array([k, k, k, k], np.float32)) for k in (1, 2, 3)]
    step, _ = _scale_step(d, xs[0], w)

    def run(x: int) -> list[Any]:
        new = d.session.new_handle()
        d.post(C["step_run"], 0, [step, [x], [new]])
        return _read(d, new, 4)

    for _ in range(3):  # traced, then the graph, then its kept inputs
        assert run(xs[0]) == [1.0, 2.0, 3.0, 4.0]
    (session,) = d._proxy.clients.values()
    state = session.executor
    graph = state.steps[step].graph
    assert graph.replays == 2
    # the weight freed, and made again under its handle with other values
    d.post(C["free"], 0, [w])
    d.call(C["device_synchronize"], [])
    _upload(d, np.array([7, 7, 7, 7], np.float32))  # (where the weight's memory may go)
    d.post(C["alloc"], 0, [w, 16])
    for half in (0, 8):  # (written in place: a whole buffer's copy may replace its memory)
        raw = memoryview(np.array([10, 20, 30, 40], np.float32).view(np.uint8)[half : half + 8])
        d.post(C["copy_h2d"], 0, [[w, half, [8], "uint8"], BUFFER], raw)
    assert run(xs[0]) == [10.0, 20.0, 30.0, 40.0]
    # arguments bound elsewhere by each replay: their views are that replay's alone
    assert run(xs[1]) == [20.0, 40.0, 60.0, 80.0]
    assert run(xs[2]) == [30.0, 60.0, 90.0, 120.0]
    d.post(C["free_buffers"], 0, [xs[1:]])
    d.call(C["device_synchronize"], [])
    held = {id(t) for t in graph._args[2:] if t is not None}
    assert all(h in state.buffers for h in state.view_users)
    assert all(
        state.views.get(x) is None or not held & {id(v) for v in state.views[x].values()}
        for x in xs[1:]
    )
    assert run(xs[0]) == [10.0, 20.0, 30.0, 40.0]
    d.post(C["step_free"], 0, [step])
    d.call(C["device_synchronize"], [])
    assert not any(graph in users for users in state.view_users.values())


def test_a_compiled_graph_runs_as_its_code_where_its_inputs_share_buffers_otherwise() -> None:
    """A graph compiled by inductor is specialised to how its inputs shared buffers when it
    was compiled (where it writes one of them): a replay binding them otherwise runs the
    graph's own code (correct for any sharing), the compiled one again once they share as
    before."""
    limits = SessionLimits(graphs="inductor")
    d = SyncDriver(None, serve="numpy", proxy_options={"session_limits": limits})
    try:
        w = _upload(d, np.array([1, 2, 3, 4], np.float32))
        x = _upload(d, np.array([2, 2, 2, 2], np.float32))
        step, _ = _scale_step(d, x, w, writes=True)

        def run(arg: int) -> list[Any]:
            new = d.session.new_handle()
            d.post(C["step_run"], 0, [step, [arg], [new]])
            return _read(d, new, 4)

        for _ in range(3):  # traced, compiled, the compiled callable
            assert run(x) == [2.0, 4.0, 6.0, 8.0]
        (session,) = d._proxy.clients.values()
        graph = session.executor.steps[step].graph
        assert graph.compiled is not None and graph.aliasing() == ()
        calls = []
        compiled = graph.compiled
        graph.compiled = lambda *args: calls.append(1) or compiled(*args)
        assert run(w) == [1.0, 4.0, 9.0, 16.0]  # the argument is the weight's buffer
        assert graph.aliasing() == (0, 0) and calls == []
        assert run(x) == [2.0, 4.0, 6.0, 8.0]
        assert calls == [1]
    finally:
        d.close()


def test_binding_by_buffers_is_binding_by_the_recorded_descriptors() -> None:
    """``RecordedStep.bind_buffers`` (``step_run``'s) binds what ``bind`` binds for the
    descriptors the step was recorded with, and refuses, as it does, one buffer viewed
    through two arguments given as two."""
    slots = (ArrayDesc(5, 0, (4,), "float32", 16), ArrayDesc(5, 16, (4,), "float32", 16))
    step = RecordedStep(1, [], slots, (9,), {}, True)
    args = [ArrayDesc(7, d.offset, d.shape, d.dtype, d.nbytes) for d in slots]
    assert step.bind_buffers([7, 7], [11]) == step.bind(args, [11]) == {5: (7, 0), 9: (11, 0)}
    with pytest.raises(StepError, match="argument 1 is not where"):
        step.bind_buffers([7, 8], [11])
    with pytest.raises(StepError, match="makes 1 results; the run gave 2"):
        step.bind_buffers([7, 7], [11, 12])


def test_the_compile_budget_spent_is_a_clear_error_and_the_proxy_serves_others() -> None:
    with LocalProxy(
        "tcp", "numpy", extra_args=("--graphs", "inductor", "--max-compile-s", "0")
    ) as p:
        a, b = SyncDriver(p.url), SyncDriver(p.url)
        try:
            x = _upload(a, np.array([1, 2, 3, 4], np.float32))
            idx = _upload(a, np.array([1, 2], np.int64))
            step, _ = _gather_step(a, x, idx)
            args = [[x, 0, [16], "uint8"], [idx, 0, [16], "uint8"]]
            first = a.session.new_handle()
            a.post(C["step_replay"], 0, [step, args, [first]])  # traced (no compiling)
            assert _read(a, first, 2) == [4.0, 9.0]
            second = a.session.new_handle()
            a.post(C["step_replay"], 0, [step, args, [second]])  # would compile
            with pytest.raises(RemoteCallError, match=r"budget is 0 s .*--max-compile-s"):
                a.call(C["device_synchronize"], [])
            y = _upload(b, np.array([5, 6], np.float32))
            assert _read(b, y, 2) == [5.0, 6.0]
        finally:
            a.close()
            b.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend, mode",
    [(b, "inductor") for b in BACKENDS] + [(b, "cudagraphs") for b in BACKENDS if b == "cupy"],
)
def test_inductor_graphs_train_within_1e_5_and_are_shared_by_sessions(
    backend: str, mode: str
) -> None:
    """A small MLP trained 5 steps with the proxy compiling its graphs by inductor (on a GPU
    also replayed as CUDA graphs): within 1e-5 of the call-by-call replay; a second session
    with the same graphs compiles nothing (the compiled graphs are found by their
    content)."""

    def run(graphs: str) -> tuple[Any, dict[str, Any]]:
        def make() -> Any:
            return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))

        losses, weights, figures = _sgd_steps(make, graphs, backend, 0.05, 64)
        return (losses, weights), figures

    expected, _ = run("ops")
    got, first = run(mode)
    again, second = run(mode)
    assert first["steps"] == 2 and first["compile_s"] > 0, first
    assert second["compile_s"] == 0, second
    assert _max_diff(expected, got) <= 1e-5
    assert _equal(got, again)


@pytest.mark.slow
def test_the_ops_bench_compares_compiled_graphs_with_local_inductor() -> None:
    """``bench ops --workload gpt2 --compile``: the compiled row beside local
    ``torch.compile`` (inductor), the proxy's graphs counted, no graph run op by op."""
    import asyncio

    from gpuremote.bench.torch_ops import run_torch_ops

    torch._dynamo.reset()
    try:
        result = asyncio.run(
            run_torch_ops(
                ["gpt2"],
                size="small",
                steps=1,
                rounds=1,
                url=None,
                transport="tcp",
                backend="numpy",
                compile=True,
                graphs="fx",
            )
        )
    finally:
        torch._dynamo.reset()
    assert result["graphs"] == "fx"
    eager, compiled = result["workloads"]
    assert (eager["mode"], compiled["mode"]) == ("eager", "compiled")
    assert compiled["local_compiled_step_ms"] > 0
    assert compiled["remote_over_local_compiled"] > 0
    assert compiled["remote_compiled_over_eager"] > 0
    assert compiled["graph_replays_per_step"] == 4 and compiled["eager_graphs_per_step"] == 0
    assert compiled["proxy_graph_ops_per_step"] > 50
    assert compiled["proxy_graph_run_ms"] > 0 and compiled["proxy_cpu_per_graph_op_us"] > 0
    assert compiled["proxy_graphs_compiled"] == 0  # (FX graphs: none compiled)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12, dtype=torch.float32).reshape(3, 4),
        lambda: torch.arange(12, dtype=torch.float32).reshape(4, 3).t(),  # dense, permuted
        lambda: torch.arange(6, dtype=torch.bfloat16),  # (a dtype NumPy has not)
        lambda: torch.empty(0),
    ],
)
def test_a_kept_result_is_its_storages_bytes_and_keeps_them_alive(make: Any) -> None:
    """A tensor an op made becomes a CPU proxy's buffer as it is: the bytes of its storage,
    writable, alive while the buffer is."""
    import gc

    from gpuremote.backends.torch_runtime import TorchRuntime

    t = make()
    expected = bytes(t.untyped_storage())
    buf = TorchRuntime(None).adopt(t)
    del t
    gc.collect()
    assert buf.dtype == np.uint8 and buf.ndim == 1 and buf.tobytes() == expected
    if buf.size:
        buf[0] ^= 0xFF  # (its own memory: writable)


def test_a_kept_result_is_made_a_numpy_buffer_only_where_it_is_read_as_one() -> None:
    """A tensor kept as a CPU proxy's buffer (a graph's result, an op's output) stays a
    tensor while ops view it; the NumPy buffer of its bytes is made where something reads
    the buffer as one (a copy to the host, an xp op, a memset, a view an op lays out
    again), and is the tensor's memory; freeing it before that frees it whole."""
    from gpuremote.backends import get_backend
    from gpuremote.backends.torch_runtime import Unadopted
    from gpuremote.errors import UnknownHandle
    from gpuremote.proxy.aten import aten_session
    from gpuremote.proxy.executor import Executor

    ex = Executor(get_backend("numpy"), SessionLimits())
    a = aten_session(ex)
    made = {h: torch.arange(6, dtype=torch.float32) for h in (1, 2, 3, 4)}
    a.keep_as_is([(h, t, 24, "float32", None) for h, t in made.items()])
    assert all(type(ex.buffers[h]) is Unadopted for h in made) and ex.device_bytes == 96

    seen = a.strided(1, 4, (2,), (1,), "float32", 12, stays_laid_out=True)  # an op's view
    assert seen.tolist() == [1.0, 2.0] and type(ex.buffers[1]) is Unadopted

    host = ex.resolve(ArrayDesc(2, 8, (4,), np.dtype(np.float32), 16))  # (a copy's source)
    assert host.tolist() == [2.0, 3.0, 4.0, 5.0] and type(ex.buffers[2]) is np.ndarray
    host[0] = 42.0
    assert made[2][2] == 42.0  # (the tensor's own memory, no copy)

    relaid = a.strided(3, 0, (6,), (1,), "float32", 24, stays_laid_out=False)
    assert type(ex.buffers[3]) is np.ndarray and relaid.tolist() == made[3].tolist()
    relaid[5] = -1.0
    assert made[3][5] == -1.0

    raw = ex.buffer(4)  # (a memset's buffer)
    assert type(raw) is np.ndarray and raw.nbytes == 24 and ex.buffer(4) is raw
    with pytest.raises(UnknownHandle):
        ex.buffer(99)

    assert ex.free([1, 2, 3, 4]) == [] and ex.device_bytes == 0 and not ex.buffers
