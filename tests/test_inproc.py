"""The in-process path: inproc:// hands frames on at once (no loop turn per hop), never
re-entering a receiver (``?hop=1``, what emulated links are built on, at the loop's next
turn); the synchronous driver waits for a reply without turning a loop where it came in as
the call was sent, and wakes no helper thread for a synchronous op."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

if TYPE_CHECKING:
    from conftest import PythonJson
from gpuremote.transports.inproc import InprocConnection

import gpuremote.xp as gx
from gpuremote import _build
from gpuremote.wire.calls import CALLS_BY_NAME
from gpuremote.wire.framing import Frame


def _ends(hop: bool = False) -> tuple[InprocConnection, InprocConnection, list[Any]]:
    """A pair whose far end answers each frame with one of its own (sent from inside its
    receiver), and a log of what each receiver saw, with whether it was re-entered."""
    near, far = InprocConnection.pair("test", hop=hop)
    log: list[Any] = []
    busy = {"near": False, "far": False}

    def receiver(name: str, end: InprocConnection, answer: bool) -> Any:
        def on_frame(frame: Frame) -> None:
            log.append((name, frame.meta, busy["near"] or busy["far"]))
            busy[name] = True
            try:
                if answer:
                    end.send(Frame(b"re:" + frame.meta))
            finally:
                busy[name] = False

        return on_frame

    near.set_receiver(receiver("near", near, False), lambda exc: None)
    far.set_receiver(receiver("far", far, True), lambda exc: None)
    return near, far, log


async def test_frames_are_handed_on_at_once_and_no_receiver_is_reentered() -> None:
    near, far, log = _ends()
    near.send(Frame(b"1"))
    near.send(Frame(b"2"))
    # both requests and both answers are in when the sends return, in order, and the
    # answer sent from inside the far end's receiver waited until that receiver was done
    assert log == [
        ("far", b"1", False),
        ("near", b"re:1", False),
        ("far", b"2", False),
        ("near", b"re:2", False),
    ]
    assert far.frames_in == 2 and near.frames_in == 2


async def test_with_hop_a_frame_arrives_at_the_loops_next_turn() -> None:
    near, _far, log = _ends(hop=True)
    near.send(Frame(b"1"))
    assert log == []
    await asyncio.sleep(0)
    assert log == [("far", b"1", False)]
    await asyncio.sleep(0)
    assert log == [("far", b"1", False), ("near", b"re:1", False)]


def test_a_synchronous_xp_op_in_one_process_turns_no_event_loop() -> None:
    device = gx.connect_local("numpy")
    try:
        x = gx.asarray(np.arange(16, dtype=np.float32), device=device)
        assert float(gx.sum(x + 1.0)) == 136.0  # warm
        turns = 0  # in this thread (the helper thread may send posts on its own turns)
        loop: Any = device._loop
        run_once = loop._run_once
        me = threading.get_ident()

        def counted() -> None:
            nonlocal turns
            turns += threading.get_ident() == me
            run_once()

        loop._run_once = counted
        try:
            for _ in range(20):
                assert float(gx.sum(x + 1.0)) == 136.0
        finally:
            del loop._run_once
        assert turns == 0
    finally:
        device.close()


@pytest.mark.skipif(
    _build.build() == "compiled", reason="patches the Python source (editable install)"
)
def test_a_synchronous_xp_op_wakes_no_helper_thread(python_json: PythonJson) -> None:
    """Its posts are taken by its own waiting call at once: the helper, which comes by on
    its own while the device is in use, is not woken for them (a wake-up and a GIL hand-off
    per op cost the xp op a third of its client CPU over tcp://). Counted on the Python
    source (an editable install's, in a fresh interpreter): compiled code calls the
    wake-up's ``set`` directly, past any patch."""
    program = """
        import json
        import numpy as np
        import gpuremote.xp as gx
        from gpuremote import _build
        from gpuremote.core import driver

        assert _build.build() == "pure"
        import gpuremote.core.driver as d, gpuremote.session.pipeline as s
        assert d.__file__.endswith(".py") and s.__file__.endswith(".py")  # not an extension
        wakes = 0
        real_set = driver._Signal.set

        def counted(self):
            global wakes
            wakes += self is device._wake  # (other devices' finalizers may wake theirs)
            real_set(self)

        device = gx.connect_local("numpy")
        try:
            x = gx.asarray(np.arange(16, dtype=np.float32), device=device)
            for _ in range(20):
                float(gx.sum(x + 1.0))
            driver._Signal.set = counted
            for _ in range(100):
                assert float(gx.sum(x + 1.0)) == 136.0
            driver._Signal.set = real_set
        finally:
            device.close()
        print(json.dumps({"wakes": wakes}))
        """
    wakes = python_json(program)["wakes"]
    assert wakes <= 10  # (one per op before; a stall past post_delay_us between a post and its
    # waiting call may still wake it)


def test_a_synchronous_xp_op_arranges_no_send_of_its_own(monkeypatch: Any) -> None:
    """Its posts go in the frame of its waiting call, which comes right after them: no loop
    callback is arranged to send them (one was made, and cancelled, per op)."""
    device = gx.connect_local("numpy")
    calls = 0
    try:
        x = gx.asarray(np.arange(16, dtype=np.float32), device=device)
        for _ in range(20):
            float(gx.sum(x + 1.0))
        loop_type = type(device._loop)
        real = loop_type.call_soon

        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            return real(self, *args, **kwargs)

        monkeypatch.setattr(loop_type, "call_soon", counted)
        for _ in range(50):
            assert float(gx.sum(x + 1.0)) == 136.0
        monkeypatch.undo()
    finally:
        device.close()
    assert calls == 0


def test_posts_taken_by_a_call_that_then_fails_are_still_sent() -> None:
    """A waiting call takes the posts before it, then fails before sending its frame (a
    value the wire cannot carry): what it took goes at the loop's next turn, as a post
    would have."""
    device = gx.connect_local("numpy")
    try:
        x = gx.asarray(np.arange(16, dtype=np.float32), device=device)
        float(gx.sum(x))
        session = device.session
        y = x + 1.0  # posted
        sent = session.counters.frames_sent
        with pytest.raises(OverflowError, match="cannot be sent"):  # takes the posts, then fails
            device.call(CALLS_BY_NAME["launch_dynamic"], ["nonzero", [], [99], {"n": 1 << 80}])
        assert session.counters.frames_sent == sent  # nothing sent yet
        device._run(device._noop())  # a loop turn, and no call
        assert session.counters.frames_sent == sent + 1
        assert float(gx.sum(y)) == 136.0
    finally:
        device.close()


def test_the_sync_driver_under_an_event_loop_policy_without_run_once() -> None:
    """A program that installed uvloop's policy gets uvloop's loop for the device: the
    driver waits for replies with ``run_until_complete`` there (its own loop turning needs
    asyncio's ``_run_once``)."""
    uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed")
    old = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        device = gx.connect_local("numpy", "tcp://127.0.0.1:0")  # a reply takes loop turns
    finally:
        asyncio.set_event_loop_policy(old)
    try:
        assert not hasattr(device._loop, "_run_once")
        x = gx.asarray(np.arange(16, dtype=np.float32), device=device)
        for _ in range(5):
            assert float(gx.sum(x + 1.0)) == 136.0
    finally:
        device.close()
