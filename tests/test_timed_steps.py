"""Recorded steps on a device that times ops without computing them
(``gpuremote.proxy.timedsteps``): a replay after the first takes the device time the first
took, in one piece; its bindings are checked as the call-by-call replay checks them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="gpuremote.torch needs the [torch] extra")

import gpuremote.torch as gt  # noqa: E402
from gpuremote.core.driver import SyncDriver  # noqa: E402
from gpuremote.errors import RemoteCallError  # noqa: E402
from gpuremote.proxy.state import SessionLimits  # noqa: E402
from gpuremote.torch.models import train, workload  # noqa: E402
from gpuremote.wire.calls import BUFFER, CALLS_BY_NAME  # noqa: E402

C = CALLS_BY_NAME
TIMING = "sim:a100,compute=0"


def _figures(conn: Any) -> dict[str, Any]:
    stats, _ = conn.drivers[0].call(C["stats"], [])
    return dict(stats["graphs"])


def _device_time(graphs: str, steps: int) -> tuple[float, dict[str, Any]]:
    """The simulated A100's time for ``steps`` compiled GPT-2 training steps, the proxy's
    steps run by ``graphs`` (``ops``: call by call), and its figures."""
    torch._dynamo.reset()
    with gt.connect_local(TIMING, session_limits=SessionLimits(graphs=graphs)) as conn:
        train(workload("gpt2", "small"), "gpuremote", steps, compile="gpuremote")
        conn.synchronize()
        queued, _ = conn.drivers[0]._proxy.backend.timing()
        figures = _figures(conn)
    torch._dynamo.reset()
    return float(queued), figures


@pytest.mark.slow
def test_compiled_steps_on_a_timing_device_take_the_time_of_call_by_call() -> None:
    """GPT-2 trained 4 steps under ``torch.compile(backend="gpuremote")``: its graphs'
    replays after the first are timed whole, and the device's time is the same as when
    every replay runs call by call."""
    _device_time("ops", 1)  # (a process's first run reads one value more: not a replay's)
    by_call, none = _device_time("ops", 4)
    whole, figures = _device_time("fx", 4)
    assert none["timed_steps"] == 0 and none["timed_replays"] == 0, none
    assert figures["timed_steps"] >= 2 and figures["timed_replays"] >= 4, figures
    assert by_call > 0 and whole == pytest.approx(by_call, rel=1e-9)


# -- by hand: the wire form ---------------------------------------------------------------
@pytest.fixture
def driver() -> Iterator[SyncDriver]:
    d = SyncDriver(None, serve=TIMING, proxy_options={"session_limits": SessionLimits()})
    try:
        yield d
    finally:
        d.close()


def _upload(d: SyncDriver, nbytes: int) -> int:
    h = d.session.new_handle()
    d.post(C["alloc"], 0, [h, nbytes])
    raw = memoryview(np.zeros(nbytes, np.uint8))
    d.post(C["copy_h2d"], 0, [[h, 0, [nbytes], "uint8"], BUFFER], raw)
    return h


def _t(h: int, n: int) -> list[Any]:
    return [h, 0, [n], [1], "float32"]


def _aten(op: str, operands: list[Any], outputs: list[Any]) -> Any:
    encoded = [[{"t": i} for i in range(len(operands))], {}]
    return [C["aten"].opcode, 0, [op, operands, encoded, outputs]]


def _step(d: SyncDriver, x: int, w: int) -> int:
    """``out = (x * w) @ w`` on 64 x 64 floats, ``x`` its argument, ``w`` the session's."""
    tmp, out = d.session.new_handle(), d.session.new_handle()
    square = [64, 64], [64, 1], "float32"
    program = [
        [[x, 0, [64 * 64 * 4], "uint8"]],
        [
            _aten("mul.Tensor", [[x, 0, *square], [w, 0, *square]], [[tmp, 0, *square]]),
            _aten("mm.default", [[tmp, 0, *square], [w, 0, *square]], [[out, 0, *square]]),
        ],
        [0],
        [out],
    ]
    step = d.session.new_handle()
    d.post(C["step_record"], 0, [step, program])
    return step


def _replay(d: SyncDriver, step: int, x: int, nbytes: int = 64 * 64 * 4) -> int:
    new = d.session.new_handle()
    d.post(C["step_replay"], 0, [step, [[x, 0, [nbytes], "uint8"]], [new]])
    return new


def _clock(d: SyncDriver) -> float:
    d.call(C["device_synchronize"], [])
    return float(d._proxy.backend.timing()[0])


def test_a_timed_replay_takes_the_first_replays_time_and_makes_its_result(
    driver: SyncDriver,
) -> None:
    d = driver
    x, w = _upload(d, 64 * 64 * 4), _upload(d, 64 * 64 * 4)
    step = _step(d, x, w)
    took = []
    for _ in range(4):  # call by call, then timed
        before = _clock(d)
        out = _replay(d, step, x)
        took.append(_clock(d) - before)
        _, bufs = d.call(C["copy_d2h"], [[out, 0, [64 * 64 * 4], "uint8"]])
        assert len(bufs[0]) == 64 * 64 * 4  # (made, zeroed: nothing is computed)
    assert took[0] > 0 and took[1:] == pytest.approx([took[0]] * 3, rel=1e-9)
    stats, _ = d.call(C["stats"], [])
    assert stats["graphs"]["timed_steps"] == 1 and stats["graphs"]["timed_replays"] == 3


def test_a_timed_replay_checks_its_bindings_and_the_session_goes_on(driver: SyncDriver) -> None:
    d = driver
    x, w = _upload(d, 64 * 64 * 4), _upload(d, 64 * 64 * 4)
    small = _upload(d, 64 * 4)
    step = _step(d, x, w)
    _replay(d, step, x)
    _replay(d, step, x)  # timed from here
    _clock(d)
    lost = _replay(d, step, small)  # the replay's argument: too small for what the step reads
    with pytest.raises(RemoteCallError, match=r"reaches byte 16384 of buffer") as info:
        d.call(C["device_synchronize"], [])
    assert info.value.call == "step_replay"
    _, bufs = d.call(C["copy_d2h"], [[lost, 0, [16], "uint8"]])  # its result exists
    assert bytes(bufs[0]) == bytes(16)
    d.post(C["free"], 0, [w])  # a buffer of the session's that the step reads: gone
    _clock(d)
    _replay(d, step, x)
    with pytest.raises(RemoteCallError, match=f"unknown buffer handle {w}"):
        d.call(C["device_synchronize"], [])
    w2 = _upload(d, 64 * 64 * 4)
    again = _replay(d, _step(d, x, w2), x)  # the session goes on
    _, bufs = d.call(C["copy_d2h"], [[again, 0, [16], "uint8"]])
    assert len(bufs[0]) == 16


def test_a_timed_replay_starts_the_device_before_it_makes_its_results(
    driver: SyncDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a GPU proxy's graph starts with its launch: the device time is queued first, the
    results (the proxy's own work, an allocation each) made while the device runs."""
    from gpuremote.proxy.state import SessionState

    d = driver
    x, w = _upload(d, 64 * 64 * 4), _upload(d, 64 * 64 * 4)
    step = _step(d, x, w)
    _replay(d, step, x)  # the first: call by call
    before = _clock(d)
    backend = d._proxy.backend
    queued_at_alloc: list[float] = []
    alloc = SessionState.alloc

    def noting(self: SessionState, handle: int, nbytes: int, *args: Any) -> Any:
        queued_at_alloc.append(backend.timing()[0])
        return alloc(self, handle, nbytes, *args)

    monkeypatch.setattr(SessionState, "alloc", noting)
    _replay(d, step, x)  # timed: one result
    took = _clock(d) - before
    assert took > 0 and queued_at_alloc == [pytest.approx(before + took, rel=1e-9)]
