"""Recorded steps on the proxy (``gpuremote.steps``): kept once, replayed by one command."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import gpuremote
from gpuremote.arraycore import Buffer
from gpuremote.calls import CALLS_BY_NAME
from gpuremote.client import RemoteArray
from gpuremote.errors import CaptureError
from gpuremote.recording import Recording

_RECORD, _REPLAY, _FREE = (CALLS_BY_NAME[n] for n in ("step_record", "step_replay", "step_free"))


def _record(gpu: gpuremote.GPU, fn: Any, *args: RemoteArray) -> tuple[int, list[RemoteArray]]:
    """Record ``fn(*args)`` (which also runs), keep it on the proxy; its handle and results."""
    session = gpu._session
    session.recording = rec = Recording()
    try:
        out = fn(*args)
    finally:
        session.recording = None
    results = out if isinstance(out, list) else [out]
    handle = session.new_handle()
    program = rec.program([a._wire for a in args], [r.handle for r in results])
    session.submit(_RECORD, 0, [handle, program])
    return handle, results


def _replay(gpu: gpuremote.GPU, handle: int, like: list[RemoteArray], *args: RemoteArray) -> Any:
    session = gpu._session
    outs = [
        RemoteArray(gpu, Buffer(session.release, session.new_handle(), r.nbytes), r.shape, r.dtype)
        for r in like
    ]
    session.submit(_REPLAY, 0, [handle, [a._wire for a in args], [o.handle for o in outs]])
    for a in args:
        a._buf.invalidate()
    return outs


async def test_a_replay_equals_the_recorded_run(gpu: gpuremote.GPU) -> None:
    w = gpu.asarray(np.full(4, 0.5, np.float32))  # the session's own: used as it is

    def step(x: RemoteArray) -> RemoteArray:
        t = gpu.tanh(x * 2.0 + w)  # two intermediates
        return gpu.exp(t - 1.0)

    x0 = gpu.asarray(np.arange(4, dtype=np.float32))
    handle, (r0,) = _record(gpu, step, x0)
    for k in range(1, 4):
        host = np.arange(4, dtype=np.float32) * k
        (r,) = _replay(gpu, handle, [r0], gpu.asarray(host))
        want = np.exp(np.tanh(host * 2 + 0.5) - 1).astype(np.float32)
        np.testing.assert_allclose(await r.get(), want, rtol=1e-6)
    np.testing.assert_allclose(
        await r0.get(), np.exp(np.tanh(np.arange(4) * 2 + 0.5) - 1), rtol=1e-6
    )
    stats = await gpu.proxy_stats()
    assert stats["steps"] == 1
    gpu._session.submit(_FREE, 0, [handle])
    await gpu.synchronize()
    assert (await gpu.proxy_stats())["steps"] == 0


async def test_in_place_updates_of_arguments(gpu: gpuremote.GPU) -> None:
    # the SGD update: weights -= lr * grad, into the weights
    def sgd(wts: RemoteArray, grad: RemoteArray) -> list[RemoteArray]:
        gpu.launch("axpy", [grad, wts], [wts], alpha=-0.1)
        return []

    wts = gpu.asarray(np.ones(8, np.float32))
    grad = gpu.asarray(np.full(8, 2.0, np.float32))
    handle, _ = _record(gpu, sgd, wts, grad)
    for _ in range(5):
        _replay(gpu, handle, [], wts, grad)
    np.testing.assert_allclose(await wts.get(), 1 - 6 * 0.2, rtol=1e-6)


async def test_a_failing_replay_names_the_step_the_call_and_its_index(gpu: gpuremote.GPU) -> None:
    w = gpu.asarray(np.ones(4, np.float32))

    def step(x: RemoteArray) -> RemoteArray:
        return gpu.op("sqrt", gpu.exp(x) + w)

    x = gpu.asarray(np.ones(4, np.float32))
    handle, (r0,) = _record(gpu, step, x)
    with pytest.raises(gpuremote.RemoteCallError, match="recorded with"):
        _replay(gpu, handle, [r0], gpu.asarray(np.ones(5, np.float32)))
        await gpu.synchronize()
    w.free()  # the step's own array, gone: its second call fails
    _replay(gpu, handle, [r0], gpu.asarray(np.zeros(4, np.float32)))
    with pytest.raises(gpuremote.RemoteCallError) as err:
        await gpu.synchronize()
    e = err.value
    assert e.call == "step_replay" and e.op == "add" and e.deferred
    assert f"step {handle}, call 1 of 3 (launch_new)" in e.message
    assert "unknown buffer handle" in e.message
    np.testing.assert_allclose(await (x + 1.0).get(), 2.0)  # the session goes on


async def test_what_a_step_cannot_hold_is_refused_while_recording(gpu: gpuremote.GPU) -> None:
    x = gpu.asarray(np.ones(4, np.float32))
    session = gpu._session
    session.recording = Recording()
    try:
        with pytest.raises(CaptureError, match="waits for the device"):
            await (x + 1.0).get()
        with pytest.raises(CaptureError, match="cannot be part of a captured step"):
            gpu.stream()
    finally:
        session.recording = None
    np.testing.assert_array_equal(await (x + 1.0).get(), 2.0)
