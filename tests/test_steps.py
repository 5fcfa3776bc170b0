"""Steps captured once and replayed by one message (``gpu.capture``, ``xp.capture``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuremote
import gpuremote.xp as xp
from gpuremote.errors import CaptureError
from gpuremote.xp import Device

_EXAMPLES = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _mlp_step(gpu: gpuremote.GPU, w1: Any, w2: Any, lr: float = 0.05) -> Any:
    """A training step of a 2-layer MLP (forward, backward, SGD into the weights)."""

    def step(x: Any, y: Any) -> Any:
        h = gpu.relu(gpu.matmul(x, w1))
        out = gpu.matmul(h, w2)
        d = out - y
        loss = gpu.mean(d * d)
        g2 = gpu.matmul(h.T, d)
        dh = gpu.op("relu_grad", gpu.matmul(d, w2.T), h)
        g1 = gpu.matmul(x.T, dh)
        gpu.launch("axpy", [g2, w2], [w2], alpha=-lr)
        gpu.launch("axpy", [g1, w1], [w1], alpha=-lr)
        return loss

    return step


def _data(seed: int) -> tuple[np.ndarray[Any, Any], ...]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((16, 8)).astype(np.float32),
        rng.standard_normal((16, 4)).astype(np.float32),
        (rng.standard_normal((8, 12)) * 0.3).astype(np.float32),
        (rng.standard_normal((12, 4)) * 0.3).astype(np.float32),
    )


async def test_replayed_training_equals_step_by_step(gpu: gpuremote.GPU) -> None:
    x, y, w1h, w2h = _data(0)
    results = []
    for captured in (False, True):
        w1, w2 = gpu.asarray(w1h), gpu.asarray(w2h)
        step = _mlp_step(gpu, w1, w2)
        run = gpu.capture(step) if captured else step
        xs, ys = gpu.asarray(x), gpu.asarray(y)
        losses = [await run(xs, ys).get() for _ in range(6)]
        results.append((losses, await w1.get(), await w2.get()))
        if captured:
            assert run.stats()["signatures"] == 1 and run.stats()["replays"] == 5
    (l0, a1, a2), (l1, b1, b2) = results
    np.testing.assert_array_equal(np.array(l0), np.array(l1))  # bitwise, on NumPy
    np.testing.assert_array_equal(a1, b1)
    np.testing.assert_array_equal(a2, b2)


async def test_a_replay_is_one_call_whatever_the_step(gpu: gpuremote.GPU) -> None:
    def chain(x: Any) -> Any:
        for _ in range(40):
            x = gpu.tanh(x * 1.01 + 0.5)
        return x

    step = gpu.capture(chain)
    a = gpu.asarray(np.linspace(0, 1, 16, dtype=np.float32))
    first = await step(a).get()
    before = gpu.stats()
    r = step(a)
    after = gpu.stats()
    assert after["calls"]["async"] - before["calls"]["async"] == 1
    np.testing.assert_array_equal(await r.get(), first)
    np.testing.assert_array_equal(first, await chain(a).get())


async def test_signatures_record_apart_and_static_values_count(gpu: gpuremote.GPU) -> None:
    step = gpu.capture(lambda x, k: x * float(k))
    small, big = gpu.asarray(np.ones(4, np.float32)), gpu.asarray(np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(await step(small, 2).get(), 2.0)
    np.testing.assert_array_equal(await step(big, 2).get(), 2.0)
    np.testing.assert_array_equal(await step(small, 3).get(), 3.0)
    np.testing.assert_array_equal(await step(small, 3).get(), 3.0)
    assert step.stats()["signatures"] == 3 and step.stats()["replays"] == 1
    step.free()
    np.testing.assert_array_equal(await step(small, 3).get(), 3.0)  # records again
    assert (await gpu.proxy_stats())["steps"] == 1


async def test_outputs_keep_their_form(gpu: gpuremote.GPU) -> None:
    step = gpu.capture(lambda x: (x + 1.0, (x * 2.0).reshape(2, 2), x))
    a = gpu.asarray(np.arange(4, dtype=np.float32))
    for _ in range(2):
        p, q, same = step(a)
        assert same is a and q.shape == (2, 2)
        np.testing.assert_array_equal(await p.get(), np.arange(4) + 1)
        np.testing.assert_array_equal(await q.get(), (np.arange(4) * 2).reshape(2, 2))
    assert gpu.capture(lambda x: None)(a) is None


async def test_a_failing_replay_names_the_step_the_op_and_its_index(gpu: gpuremote.GPU) -> None:
    w = gpu.asarray(np.ones(4, np.float32))
    step = gpu.capture(lambda x: gpu.op("sqrt", gpu.exp(x) + w))
    x = gpu.asarray(np.ones(4, np.float32))
    step(x)
    w.free()  # the step's own array, gone: its second call fails at the replay
    step(x)
    with pytest.raises(gpuremote.RemoteCallError) as err:
        await gpu.synchronize()
    e = err.value
    assert e.call == "step_replay" and e.op == "add" and e.deferred
    assert ", call 1 of 3 (launch_new): unknown buffer handle" in e.message
    np.testing.assert_allclose(await (x + 1.0).get(), 2.0)  # the session goes on


async def test_what_a_step_cannot_hold_is_refused_naming_the_line(gpu: gpuremote.GPU) -> None:
    x = gpu.asarray(np.ones(4, np.float32))

    async def reads(a: Any) -> Any:
        return await a.get()

    def needs_data(a: Any) -> Any:
        return gpu.stream()  # a new stream: not part of a step

    with pytest.raises(CaptureError, match=r"stream_create .*test_steps\.py:\d+"):
        gpu.capture(needs_data)(x)
    with pytest.raises(CaptureError, match=r"copy_h2d \(host data"):
        gpu.capture(lambda a: a + gpu.asarray(np.ones(4, np.float32)))(x)  # an upload
    np.testing.assert_array_equal(await reads(x + 1.0), 2.0)  # the session goes on


async def test_what_a_replay_writes_is_not_read_from_a_stale_host_copy(
    gpu: gpuremote.GPU,
) -> None:
    w = gpu.asarray(np.ones(4, np.float32))  # its upload's host copy is kept
    step = gpu.capture(lambda g: gpu.axpy(-1.0, g, w))  # writes w, which it closes over
    g = gpu.asarray(np.full(4, 0.25, np.float32))
    for k in range(1, 4):
        step(g)
        np.testing.assert_array_equal(await w.get(), 1 - 0.25 * k)


async def test_a_returned_view_of_an_argument_is_the_replays_own(gpu: gpuremote.GPU) -> None:
    def f(x: Any) -> Any:
        gpu.launch("add", [x, x], [x])  # in place
        return x.reshape(2, 2)

    step = gpu.capture(f)
    for host in (np.arange(4, dtype=np.float32), np.ones(4, np.float32)):
        x = gpu.asarray(host)
        v = step(x)
        assert v._buf is x._buf and v.shape == (2, 2)
        np.testing.assert_array_equal(await v.get(), (2 * host).reshape(2, 2))


async def test_static_types_and_aliasing_are_part_of_the_signature(gpu: gpuremote.GPU) -> None:
    step = gpu.capture(lambda a, b, k: gpu.add(a, b) * k)
    x = gpu.asarray(np.ones(4, np.float32))
    y = gpu.asarray(np.full(4, 2.0, np.float32))
    np.testing.assert_array_equal(await step(x, x, k=2).get(), 4.0)  # one buffer twice
    np.testing.assert_array_equal(await step(x, y, k=2).get(), 6.0)  # two: recorded apart
    np.testing.assert_array_equal(await step(x, y, k=2.0).get(), 6.0)  # a float: apart
    assert step.stats()["signatures"] == 3 and step.stats()["replays"] == 0


async def test_a_step_recorded_after_a_failed_call_is_kept(gpu: gpuremote.GPU) -> None:
    singular = gpu.asarray(np.zeros((2, 2), np.float32))
    a = gpu.asarray(np.ones(4, np.float32))
    gpu.op("linalg.inv", singular)  # fails on the proxy: its stream's later work is skipped
    step = gpu.capture(lambda a: a + 1.0)
    step(a)  # recorded in the same batch, behind the failure
    with pytest.raises(gpuremote.RemoteCallError, match=r"linalg\.inv"):
        await gpu.synchronize()
    np.testing.assert_array_equal(await step(a).get(), 2.0)  # replayed: the step was kept
    assert step.stats()["replays"] == 1


# -- gpuremote.xp ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["inproc", "tcp"])
def dev(request: pytest.FixtureRequest) -> Iterator[Device]:
    url = None if request.param == "inproc" else f"{request.param}://127.0.0.1:0"
    with Device(url, serve="numpy") as device:
        xp.set_default_device(device)
        yield device
    xp.set_default_device(None)


def _least_squares(ns: Any, a: Any, b: Any, body: Any, steps: int = 60) -> Any:
    x = ns.zeros((a.shape[1],), dtype=a.dtype)
    lr = 1.0 / float(ns.linalg.matrix_norm(a, ord=2)) ** 2
    for step in range(1, steps + 1):
        x, r = body(a, b, x, lr)
        if step % 10 == 0 and float(ns.vecdot(r, r)) < 1e-12:
            break
    return x


def _body(a: Any, b: Any, x: Any, lr: float) -> tuple[Any, Any]:
    r = a @ x - b
    return x - lr * (a.T @ r), r


def test_xp_least_squares_one_frame_per_iteration(dev: Device) -> None:
    rng = np.random.default_rng(0)
    ah, bh = rng.standard_normal((64, 8)), rng.standard_normal(64)
    want = _least_squares(xp, xp.asarray(ah), xp.asarray(bh), _body)
    a, b = xp.asarray(ah), xp.asarray(bh)
    body = xp.capture(_body)
    body(a, b, xp.zeros((8,), dtype=a.dtype), 0.1)  # recorded (lr is static: its own)
    dev.synchronize()
    before = dev.stats()
    got = _least_squares(xp, a, b, body)
    after = dev.stats()
    iterations = 60
    checks = iterations // 10 + 1  # and matrix_norm's float()
    assert after["round_trips"] - before["round_trips"] == checks
    assert after["frames_sent"] - before["frames_sent"] <= iterations + checks
    assert body.stats()[dev.url]["replays"] >= iterations - 1
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # equal results


def test_xp_data_while_recording_raises_or_falls_back(dev: Device) -> None:
    def branchy(x: Any) -> Any:
        if float(xp.sum(x)) > 0:  # needs data
            return x + 1
        return x - 1

    x = xp.ones(4)
    with pytest.raises(
        CaptureError, match=r"(reading an array.s data|copy_d2h).*, at .*test_steps\.py:\d+"
    ):
        xp.capture(branchy)(x)
    f = xp.capture(branchy, fallback=True)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(x)), 2.0)
    assert f.stats()[dev.url]["uncaptured"] == 1
    np.testing.assert_array_equal(np.asarray(xp.capture(branchy, fallback=True)(-x)), -2.0)


_UNARY = ["negative", "abs", "exp", "tanh", "sin", "sqrt", "square", "log1p"]
_BINARY = ["add", "subtract", "multiply", "maximum", "minimum", "hypot"]


@st.composite
def _programs(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    """A step: ops on the values so far (two arguments to start with)."""
    n = draw(st.integers(1, 12))
    prog = []
    for i in range(n):
        values = 2 + i
        if draw(st.booleans()):
            prog.append((draw(st.sampled_from(_UNARY)), draw(st.integers(0, values - 1)), -1))
        else:
            a, b = draw(st.integers(0, values - 1)), draw(st.integers(0, values - 1))
            prog.append((draw(st.sampled_from(_BINARY)), a, b))
    return prog


def _run(prog: list[tuple[str, int, int]], a: Any, b: Any) -> Any:
    values = [a, b]
    for name, i, j in prog:
        f = getattr(xp, name)
        values.append(f(values[i]) if j < 0 else f(values[i], values[j]))
    return values[-1], values[-2]


@_EXAMPLES
@given(prog=_programs(), seed=st.integers(0, 2**16))
def test_replay_equals_step_by_step_bitwise(dev: Device, prog: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    hosts = [rng.uniform(0.1, 2.0, (3, 5)).astype(np.float32) for _ in range(6)]
    step = xp.capture(lambda a, b: _run(prog, a, b))
    step(xp.asarray(hosts[0]), xp.asarray(hosts[1]))  # recorded
    for k in (2, 4):
        a, b = xp.asarray(hosts[k]), xp.asarray(hosts[k + 1])
        got = step(a, b)
        want = _run(prog, a, b)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert sum(s["replays"] for s in step.stats().values()) == 2
