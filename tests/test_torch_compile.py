"""``torch.compile(backend="gpuremote")``: each graph AOTAutograd makes is recorded once and
replayed by one message; results are eager's (bitwise where the proxy runs the CPU's
kernels); graphs that cannot be recorded run eagerly; hostile recordings are refused whole;
a compiled session survives a failover kill."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="gpuremote.torch needs the [torch] extra")

import gpuremote.torch as gt  # noqa: E402
from gpuremote.core.driver import SyncDriver  # noqa: E402
from gpuremote.errors import RemoteCallError  # noqa: E402
from gpuremote.tools.proxyprocess import LocalProxy  # noqa: E402
from gpuremote.torch.models import train, workload  # noqa: E402
from gpuremote.wire.calls import BUFFER, CALLS_BY_NAME  # noqa: E402

nn = torch.nn
F = torch.nn.functional
C = CALLS_BY_NAME
_EXACT = {"exact": True}


@pytest.fixture(scope="module")
def device(module_each_backend: str) -> Iterator[str]:
    _EXACT["exact"] = module_each_backend != "cupy"
    torch._dynamo.reset()
    with gt.connect_local(module_each_backend):
        yield "gpuremote"
    torch._dynamo.reset()


def _close(a: Any, b: Any, rtol: float = 1e-4) -> bool:
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if _EXACT["exact"] or not a.is_floating_point():
            return torch.equal(a, b)
        return torch.allclose(a, b, rtol=rtol, atol=1e-5)
    if isinstance(a, float):
        return a == b if _EXACT["exact"] else abs(a - b) <= rtol * max(1.0, abs(a))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], rtol) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, rtol) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    keys = ("frames_sent", "round_trips", "graphs_recorded", "graph_replays", "graphs_eager")
    return {k: after[k] - before[k] for k in keys}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "bert", "gpt2"])
def test_compiled_models_train_as_eager_on_the_cpu(device: str, name: str) -> None:
    """3 training steps (AdamW, clipping) of each small model: the forward and the backward
    graphs recorded once each, then replayed; the results are the local CPU's."""
    torch._dynamo.reset()
    w = workload(name, "small")
    expected = train(w, "cpu", 3)
    before = gt.stats()
    got = train(w, device, 3, compile="gpuremote")
    d = _delta(before, gt.stats())
    assert _close(expected, got)
    assert d["graphs_recorded"] == 2 and d["graph_replays"] == 4 and d["graphs_eager"] == 2, d
    # a step: the inputs' uploads, two replays, the loss and the optimizer's few calls,
    # one read; the first compiles (dynamo, AOTAutograd), records and reads the weights
    assert d["round_trips"] <= 3 + len(got[1]) + 2


@pytest.mark.slow
def test_a_plain_pytorch_cnn_compiled_against_a_proxy_process() -> None:
    """A CNN with batch norm, layer norm, GELU and pooling, AdamW with clipping, 6 steps
    under ``torch.compile(backend="gpuremote")`` against a ``gpuremote serve --backend
    numpy`` process: within 1e-4 of eager on the local CPU, a few frames a step of several
    calls each (each replay goes at once, the eager update's posts as they fall due; the
    compilation's included), not one a call."""

    class CNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
            self.bn = nn.BatchNorm2d(16)
            self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
            self.norm = nn.LayerNorm(32)
            self.fc = nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.max_pool2d(F.gelu(self.bn(self.conv1(x))), 2)
            x = F.adaptive_avg_pool2d(F.gelu(self.conv2(x)), 1).flatten(1)
            return self.fc(self.norm(x))

    def run(device: str, compile: bool) -> tuple[list[float], dict[str, Any], int, int]:
        torch.manual_seed(0)
        model = CNN().to(device)
        step: Any = torch.compile(model, backend="gpuremote") if compile else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        frames = gt.stats()["frames_sent"] if compile else 0
        calls = sum(gt.stats()["calls"].values()) if compile else 0
        losses = []
        for _ in range(6):
            x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
            loss = F.cross_entropy(step(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
        if compile:
            frames = gt.stats()["frames_sent"] - frames
            calls = sum(gt.stats()["calls"].values()) - calls
        return losses, {k: v.cpu() for k, v in model.state_dict().items()}, frames, calls

    torch._dynamo.reset()
    expected = run("cpu", False)
    with LocalProxy("tcp", "numpy") as p, gt.connect(p.url):
        got = run("gpuremote", True)
        stats = gt.stats()
    torch._dynamo.reset()
    assert np.allclose(expected[0], got[0], rtol=1e-4)
    for k, v in expected[1].items():
        assert torch.allclose(v.double(), got[1][k].double(), rtol=1e-4, atol=1e-6), k
    assert stats["graph_replays"] == 10
    # (how many depends on the machine's load: a post falls due after a while; ~50 calls a
    # step go in 6-9 frames here)
    assert got[2] * 3 <= got[3], f"{got[2]} frames for {got[3]} calls in 6 steps"


def test_inference_under_no_grad_is_one_graph(device: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    expected = model(x)
    remote = model.to(device)
    f = torch.compile(remote, backend="gpuremote")
    before = gt.stats()
    with torch.no_grad():
        outs = [f(x.to(device)).cpu() for _ in range(3)]
    d = _delta(before, gt.stats())
    for out in outs:
        assert _close(expected.detach(), out)
    assert (d["graphs_recorded"], d["graph_replays"]) == (1, 2)
    # a replay goes as it is made, not at the next wait: the proxy runs the graph meanwhile
    with torch.no_grad():
        xr = x.to(device)
        float(xr.sum())
        sent = gt.stats()["frames_sent"]
        out = f(xr)
        assert gt.stats()["frames_sent"] == sent + 1
    assert _close(expected.detach(), out.cpu())


@pytest.mark.slow
def test_new_shapes_record_again_and_graph_breaks_run_eagerly(device: str) -> None:
    """Another batch size: dynamo's guards recompile (or a new signature is recorded); a
    graph break (a Python-side read of a value) splits the function, each part recorded."""
    torch._dynamo.reset()

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        c = torch.relu(a @ b) + 1
        if c.sum().item() > 0:  # a graph break: the value goes to Python
            c = c * 2
        return c.softmax(-1)

    f = torch.compile(fn, backend="gpuremote")
    for n in (3, 3, 5, 5, 7):
        a, b = torch.randn(n, 4), torch.randn(4, 6)
        assert _close(fn(a, b), f(a.to(device), b.to(device)).cpu())
    assert gt.stats()["graph_replays"] > 0


def test_a_layout_only_the_guards_tell_apart_is_a_signature_of_its_own(device: str) -> None:
    """A graph called on tensors alike in all a signature's quick part reads (storage
    offsets, storage sizes, shared buffers) but laid out otherwise (transposed, viewed as
    another shape or dtype of the same bytes) records each layout once and replays each
    with its own results."""
    from gpuremote.torch._backend import dispatcher
    from gpuremote.torch._compile import _compiler

    def fn(a: torch.Tensor) -> tuple[torch.Tensor]:
        return ((a * 2 + a[0]).cumsum(-1),)  # (AOTAutograd's graphs return tuples)

    graph = _compiler(dispatcher.driver)(torch.fx.symbolic_trace(fn), [])
    base = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    remote = base.to(device)
    layouts = [
        (base, remote),
        (base.t(), remote.t()),
        (base.view(2, 8), remote.view(2, 8)),
        (base.view(torch.int32), remote.view(torch.int32)),
    ]
    before = gt.stats()
    for _ in range(3):
        for here, there in layouts:
            (got,) = graph(there)
            assert _close(fn(here)[0], got.cpu())
    d = _delta(before, gt.stats())
    assert (d["graphs_recorded"], d["graph_replays"]) == (4, 8), d


def test_a_graph_that_needs_data_or_host_tensors_runs_eagerly(device: str) -> None:
    torch._dynamo.reset()

    def fn(a: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (a * scale).exp()

    f = torch.compile(fn, backend="gpuremote")
    a, s = torch.randn(4, 4), torch.tensor(3.0)
    before = gt.stats()
    for _ in range(3):  # a host tensor among the graph's arguments: uploaded, eagerly
        assert _close(fn(a, s), f(a.to(device), s).cpu())
    d = _delta(before, gt.stats())
    assert d["graphs_eager"] == 3 and d["graph_replays"] == 0


def test_an_unknown_mode_is_refused_clearly(device: str) -> None:
    torch._dynamo.reset()
    f = torch.compile(lambda a: a + 1, backend="gpuremote", mode="max-autotune")
    with pytest.raises(Exception, match="mode"):
        f(torch.ones(2, device=device))
    torch._dynamo.reset()


# -- hostile recordings ---------------------------------------------------------------------
@pytest.fixture
def sessions() -> Iterator[tuple[SyncDriver, SyncDriver]]:
    with LocalProxy("tcp", "numpy") as p:
        a, b = SyncDriver(p.url), SyncDriver(p.url)
        try:
            yield a, b
        finally:
            a.close()
            b.close()


def _upload(d: SyncDriver, values: list[float], h: int | None = None) -> int:
    data = np.asarray(values, dtype=np.float32)
    h = d.session.new_handle() if h is None else h
    d.post(C["alloc"], 0, [h, data.nbytes])
    d.post(
        C["copy_h2d"], 0, [[h, 0, [data.nbytes], "uint8"], BUFFER], memoryview(data.view(np.uint8))
    )
    return h


def _read(d: SyncDriver, h: int, n: int) -> list[float]:
    _, bufs = d.call(C["copy_d2h"], [[h, 0, [4 * n], "uint8"]])
    return np.frombuffer(bufs[0], dtype=np.float32).tolist()


def _t(h: int, n: int, offset: int = 0) -> list[Any]:
    return [h, offset, [n], [1], "float32"]


def _aten(op: str, operands: list[Any], outputs: list[Any], inplace: bool = False) -> list[Any]:
    args = [[{"t": i} for i in range(len(operands))], {}]
    return [C["aten"].opcode, 0, [op, operands, args, outputs]]


@pytest.mark.parametrize(
    "what, expected",
    [
        ("off the allow-list", "not on this proxy's allow-list"),
        ("past its buffer", "reaches byte"),
        ("another session's buffer", "unknown buffer handle"),
    ],
)
def test_a_hostile_recording_is_refused_and_nothing_runs(
    sessions: tuple[SyncDriver, SyncDriver], what: str, expected: str
) -> None:
    a, b = sessions
    mine = _upload(a, [1.0, 2.0, 3.0, 4.0])
    theirs = _upload(b, [5.0, 6.0, 7.0, 8.0], h=1 << 40)  # a handle that a does not use
    _read(b, theirs, 4)  # (b's buffer exists before a's step arrives)
    tmp, out = a.session.new_handle(), a.session.new_handle()
    good = _aten("add.Tensor", [_t(mine, 4), _t(mine, 4)], [_t(tmp, 4)])
    bad = {
        "off the allow-list": _aten("set_.source_Storage", [_t(mine, 4)], []),
        "past its buffer": _aten("neg.default", [_t(tmp, 4, offset=8)], [_t(out, 4)]),
        "another session's buffer": _aten("neg.default", [_t(theirs, 4)], [_t(out, 4)]),
    }[what]
    write = _aten("copy_.default", [_t(mine, 4), _t(tmp, 4)], [])  # would change ``mine``
    step = a.session.new_handle()
    program = [[[mine, 0, [16], "uint8"]], [good, bad, write], [0], []]
    a.post(C["step_record"], 0, [step, program])
    with pytest.raises(RemoteCallError, match=expected) as info:
        a.call(C["device_synchronize"], [])
    assert info.value.call == "step_record"
    a.post(C["step_replay"], 0, [step, [[mine, 0, [16], "uint8"]], []])
    with pytest.raises(RemoteCallError, match="step"):
        a.call(C["device_synchronize"], [])
    assert _read(a, mine, 4) == [1.0, 2.0, 3.0, 4.0]  # nothing of it ran
    assert _read(b, theirs, 4) == [5.0, 6.0, 7.0, 8.0]


@pytest.mark.slow
def test_a_recording_replays_on_new_arguments(sessions: tuple[SyncDriver, SyncDriver]) -> None:
    """The wire form the backend sends, by hand: a step of two ATen ops, replayed on another
    buffer, makes its result under the replay's handle."""
    a, _ = sessions
    x, y = _upload(a, [1.0, 2.0, 3.0, 4.0]), _upload(a, [0.5, -1.0, 2.0, 0.0])
    tmp, res = a.session.new_handle(), a.session.new_handle()
    program = [
        [[x, 0, [16], "uint8"]],
        [
            _aten("mul.Tensor", [_t(x, 4), _t(x, 4)], [_t(tmp, 4)]),
            _aten("neg.default", [_t(tmp, 4)], [_t(res, 4)]),
        ],
        [0],
        [res],
    ]
    step, new = a.session.new_handle(), a.session.new_handle()
    a.post(C["step_record"], 0, [step, program])
    a.post(C["step_replay"], 0, [step, [[y, 0, [16], "uint8"]], [new]])
    assert _read(a, new, 4) == [-0.25, -1.0, -4.0, -0.0]


# -- failover -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_compiled_session_survives_a_proxy_killed_mid_training(tmp_path: Any) -> None:
    """The recordings are in the failover journal: the new proxy gets them again, and the
    replays after the kill give what they would have given."""
    import os
    import signal
    import time

    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    extra = ("--secret-file", str(secret), "--quiet")
    w = workload("gpt2", "small")

    def run(url: str, kill: int, **options: Any) -> tuple[list[float], dict[str, Any]]:
        torch._dynamo.reset()
        with gt.connect(url, secret="s" * 32, **options):
            torch.manual_seed(0)
            model = w.make().to("gpuremote")
            step: Any = torch.compile(model, backend="gpuremote")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
            g = torch.Generator().manual_seed(1)
            losses = []
            for i in range(6):
                if i == kill - 1:  # a checkpoint after the recordings, replays after it
                    before = gt.stats()["checkpoints"]
                    deadline = time.monotonic() + 30
                    while gt.stats()["checkpoints"] == before:
                        assert time.monotonic() < deadline, "no checkpoint was taken"
                        torch.gpuremote.synchronize()
                        time.sleep(0.01)
                if i == kill:
                    os.kill(proxy_a.pid, signal.SIGKILL)
                x, y = w.batch(g)
                loss = w.loss(step, x.to("gpuremote"), y.to("gpuremote"))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            state = {k: v.cpu() for k, v in model.state_dict().items()}
            stats = gt.stats()
            assert stats["graph_replays"] == 10
            if options:
                assert stats["failovers"] == 1
        torch._dynamo.reset()
        return losses, state

    with (
        LocalProxy("tcp", "numpy", extra_args=extra) as proxy_a,
        LocalProxy("tcp", "numpy", extra_args=(*extra, "--peer", proxy_a.url)) as proxy_b,
    ):
        expected = run(proxy_b.url, 99)
        got = run(proxy_a.url, 3, failover=[proxy_a.url, proxy_b.url], checkpoint_interval_s=0.005)
    assert _close(expected, got)
