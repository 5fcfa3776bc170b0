"""The array core under both front ends: buffer lifetime and the metadata cache."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuremote
import gpuremote.xp as xp
from gpuremote.client import Kernel
from gpuremote.core import arrays as arraycore
from gpuremote.ops import OpError


@pytest.fixture
def xp_device() -> Iterator[xp.Device]:
    with xp.connect_local() as device:
        yield device


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


def test_xp_frees_go_out_once_the_device_is_idle() -> None:
    """A buffer released while nothing else is sent is freed on the proxy soon after the
    device goes idle, not held until the program's next call."""
    with xp.connect_local("numpy") as device:
        x = xp.asarray(np.ones(1000, np.float32), device=device)
        y = x + 1.0
        assert float(xp.sum(y)) == 2000.0
        frames = device.session.counters.frames_sent
        del y  # its buffer is released (the last reference)
        for _ in range(200):  # up to 2 s
            if device.session.counters.frames_sent > frames:
                break
            threading.Event().wait(0.01)
        assert device.session.counters.frames_sent == frames + 1
        assert not device._freed and not device.session._released.handles


def test_xp_from_a_thread_that_runs_an_event_loop() -> None:
    """asyncio code (Jupyter) cannot run a second loop: its calls go through the helper."""
    with xp.connect_local("numpy") as device:
        x = xp.asarray(np.arange(4, dtype=np.float64), device=device)

        async def inside() -> float:
            return float(xp.sum(x * 2.0))

        assert asyncio.run(inside()) == 12.0
        assert float(xp.sum(x)) == 6.0  # and the plain path still works after


# -- one rule each, on both front ends ------------------------------------------------------------
@st.composite
def _shapes_and_targets(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    target = draw(st.lists(st.integers(-1, 6), max_size=4))  # NumPy takes -2 as -1 too
    return shape, tuple(target)


@settings(max_examples=300, deadline=None)
@given(_shapes_and_targets())
def test_reshape_follows_numpy(case: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    shape, target = case
    try:
        want: tuple[int, ...] | None = np.empty(shape).reshape(target).shape
    except ValueError:
        want = None
    if want is None:
        with pytest.raises(ValueError):
            arraycore.reshape_dims(shape, target)
    else:
        assert arraycore.reshape_dims(shape, target) == want


@pytest.mark.parametrize("target", [(0, -1), (-1, 0, -1), (-2, 0), (-1, -1)])
async def test_reshape_refusals_on_the_async_front_end(
    gpu: gpuremote.GPU, target: tuple[int, ...]
) -> None:
    x = gpu.empty((0, 4))
    with pytest.raises(ValueError):
        x.reshape(target)
    assert x.reshape(4, -1).shape == (4, 0)


@pytest.mark.parametrize("target", [(0, -1), (-1, 0, -1), (-2, 0), (-1, -1)])
def test_reshape_refusals_on_xp(xp_device: xp.Device, target: tuple[int, ...]) -> None:
    x = xp.empty((0, 4))
    with pytest.raises(ValueError):
        xp.reshape(x, target)
    with pytest.raises(ValueError):
        x.reshape(target)


def _queued(session: object) -> int:
    counters = session.counters  # type: ignore[attr-defined]
    return int(counters.calls["async"] + counters.calls["sync"])


async def test_python_scalars_on_the_async_front_end(gpu: gpuremote.GPU) -> None:
    i = gpu.asarray(np.arange(8, dtype=np.int32))
    f = gpu.asarray(np.arange(8, dtype=np.float32))
    calls = _queued(gpu._session)
    with pytest.raises(OverflowError):
        i + 2**40  # does not fit int32: refused at the call, nothing queued
    with pytest.raises(OverflowError):
        2**70 * i
    assert _queued(gpu._session) == calls
    big = f + 2**70  # the standard: the scalar takes the array's dtype
    np.testing.assert_array_equal(
        await big.get(), np.arange(8, dtype=np.float32) + np.float32(2**70)
    )
    with pytest.raises(OverflowError):  # a kernel argument that does not fit either
        Kernel(gpu, 1, "raw", "k")(i, 2**70)
    acc = i
    for n in range(1, 1001):  # the session goes on: the next 1,000 calls succeed and verify
        acc = acc + 1
        if n % 250 == 0:
            np.testing.assert_array_equal(await acc.get(), np.arange(8, dtype=np.int32) + n)


def test_python_scalars_on_xp(xp_device: xp.Device) -> None:
    i = xp.asarray(np.arange(8, dtype=np.int32))
    f = xp.asarray(np.arange(8, dtype=np.float32))
    calls = _queued(xp_device.session) + len(xp_device._posted)
    with pytest.raises(OverflowError):
        i + 2**40
    with pytest.raises(OverflowError):
        i += 2**40
    assert _queued(xp_device.session) + len(xp_device._posted) == calls
    big = f + 2**70
    assert big.dtype == xp.float32
    np.testing.assert_array_equal(
        np.asarray(big), np.arange(8, dtype=np.float32) + np.float32(2**70)
    )
    u = xp.asarray(np.zeros(2, dtype=np.uint64))
    np.testing.assert_array_equal(np.asarray(u + (2**64 - 1)), np.full(2, 2**64 - 1, np.uint64))
    acc = i
    for n in range(1, 1001):
        acc = acc + 1
        if n % 250 == 0:
            np.testing.assert_array_equal(np.asarray(acc), np.arange(8, dtype=np.int32) + n)


async def test_host_copies_are_bounded_on_the_async_front_end(url: str) -> None:
    async with gpuremote.connect(url, shadow_max_bytes=1024) as gpu:
        small = gpu.asarray(np.ones(16, np.float32))  # 64 bytes: kept
        large = gpu.asarray(np.ones(1024, np.float32))  # 4 KiB: not kept
        assert small.host_valid and not large.host_valid
        trips = gpu.stats()["round_trips"]
        await small.get()
        assert gpu.stats()["round_trips"] == trips
        y = small + 1.0  # computed on the device: the first read is kept, the next is local
        await y.get()
        await y.get()
        await large.get()
        assert gpu.stats()["round_trips"] == trips + 2


def test_host_copies_are_bounded_on_xp() -> None:
    with xp.Device(serve="numpy", shadow_max_bytes=1024) as dev:
        small = xp.asarray(np.ones(16, np.float32), device=dev)
        large = xp.asarray(np.ones(1024, np.float32), device=dev)
        assert small._buf.host is not None and large._buf.host is None
        trips = dev.stats()["round_trips"]
        np.asarray(small)
        np.asarray(large)
        np.asarray(large)  # larger than the bound: never kept, read each time
        assert dev.stats()["round_trips"] == trips + 2


def test_client_side_imports_nothing_of_the_proxy_side() -> None:
    code = (
        "import sys, gpuremote, gpuremote.xp\n"
        "proxy_side = ('proxy', 'proxysession', 'executor', 'devicequeue', 'scheduler',"
        " 'backends', 'peers', 'pool.actors', 'ray')\n"
        "print([m for m in sys.modules if m.startswith('gpuremote.') and"
        " m.split('.', 1)[1].startswith(proxy_side)])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


async def test_a_read_overtaken_by_a_write_is_not_kept(gpu: gpuremote.GPU) -> None:
    x = gpu.asarray(np.ones(4, np.float32)) + 0.0  # computed on the device: no host copy
    read = asyncio.ensure_future(x.get())
    await asyncio.sleep(0)  # the read is on its way
    gpu.launch("add", [x, x], [x])  # then a write, queued before the read's reply is in
    np.testing.assert_array_equal(await read, np.ones(4))
    np.testing.assert_array_equal(await x.get(), np.full(4, 2.0))  # not the stale read
