"""The array core under both front ends: buffer lifetime and the metadata cache."""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
import pytest

import gpuremote
import gpuremote.xp as xp
from gpuremote import arraycore
from gpuremote.ops import OpError


def test_a_buffer_is_released_once_when_it_goes_and_never_after_detach() -> None:
    released: list[tuple[int, int]] = []
    b = arraycore.Buffer(lambda h, n: released.append((h, n)), 7, 64)
    del b
    gc.collect()
    assert released == [(7, 64)]
    b = arraycore.Buffer(lambda h, n: released.append((h, n)), 8, 64)
    assert b.detach() and not b.detach()
    del b
    gc.collect()
    assert released == [(7, 64)]


def test_release_errors_at_exit_are_silent() -> None:
    def gone(h: int, n: int) -> None:
        raise RuntimeError("Event loop is closed")

    b = arraycore.Buffer(gone, 1, 4)
    del b  # nothing raised, nothing printed
    gc.collect()


def test_infer_is_remembered_per_signature_and_errors_are_not() -> None:
    f4 = np.dtype("float32")
    first = arraycore.infer("add", [((3,), f4), ((3,), f4)], {})
    assert first == [((3,), f4)]
    assert arraycore.infer("add", [((3,), f4), ((3,), f4)], {}) is first
    # a float scalar counts by its type, so 1.0 and 2.0 share an entry ...
    one = arraycore.infer("add", [((3,), f4)], {"scalar": 1.0})
    assert arraycore.infer("add", [((3,), f4)], {"scalar": 2.0}) is one
    # ... and a list-valued param is not hashable: computed every time, still right
    assert arraycore.signature("permute_dims", (((2, 3), f4),), {"axes": [1, 0]}) is None
    assert arraycore.infer("permute_dims", [((2, 3), f4)], {"axes": [1, 0]}) == [((3, 2), f4)]
    for _ in range(2):
        with pytest.raises(OpError):
            arraycore.infer("add", [((3,), f4), ((4,), f4)], {})


async def test_client_ops_are_one_command_each_and_free_in_one(
    gpu: gpuremote.GPU,
) -> None:
    a = gpu.asarray(np.ones(16, np.float32))
    await gpu.synchronize()
    before = gpu.stats()["calls"]["async"]
    y = a
    for _ in range(100):
        y = y + 1.0
    np.testing.assert_array_equal(await y.get(), np.full(16, 101, np.float32))
    # 100 launch_new, and the 99 intermediate buffers freed in two free_buffers commands
    assert gpu.stats()["calls"]["async"] - before == 100 + 2
    await gpu.synchronize()
    assert (await gpu.proxy_stats())["buffers"] == 2


def test_xp_posts_go_out_without_a_waiting_call() -> None:
    """The helper thread sends posted work that no synchronising call takes."""
    with xp.connect_local("numpy") as device:
        x = xp.asarray(np.ones(4, np.float32), device=device)
        frames = device.stats()["frames_sent"]
        y = x + 1.0
        for _ in range(200):  # up to 2 s
            if device.session.counters.frames_sent > frames:
                break
            threading.Event().wait(0.01)
        assert device.session.counters.frames_sent > frames
        assert float(y[0]) == 2.0


def test_xp_from_a_thread_that_runs_an_event_loop() -> None:
    """asyncio code (Jupyter) cannot run a second loop: its calls go through the helper."""
    with xp.connect_local("numpy") as device:
        x = xp.asarray(np.arange(4, dtype=np.float64), device=device)

        async def inside() -> float:
            return float(xp.sum(x * 2.0))

        assert asyncio.run(inside()) == 12.0
        assert float(xp.sum(x)) == 6.0  # and the plain path still works after
