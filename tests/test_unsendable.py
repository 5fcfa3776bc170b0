"""A client session cannot be wedged: a call that cannot be sent fails alone, and frees from any
thread are never lost."""

from __future__ import annotations

import asyncio
import sys
import threading

import numpy as np
import pytest

import gpuremote
from gpuremote.errors import LocalProtocolError
from gpuremote.wire.calls import CALLS_BY_NAME


async def _verify_many(gpu: gpuremote.GPU, n: int = 1000) -> None:
    """``n`` calls after the failure: each runs, and the results are right."""
    x = gpu.asarray(np.arange(4, dtype=np.float32))
    for i in range(n - 1):
        x = x + 1.0
        if i % 250 == 0:
            np.testing.assert_array_equal(await x.get(), np.arange(4) + i + 1)
    np.testing.assert_array_equal(await x.get(), np.arange(4) + n - 1)


async def test_an_unsendable_integer_fails_its_call_alone(gpu: gpuremote.GPU) -> None:
    before = (await gpu.proxy_stats())["buffers"]
    with pytest.raises(OverflowError, match="cannot be sent"):
        gpu.full((3,), 2**70, dtype="int64")  # raised at the call: nothing was queued
    x = gpu.asarray(np.ones(4, np.float32))
    launch = CALLS_BY_NAME["launch"]
    with pytest.raises(TypeError, match="an argument of type object cannot be sent"):
        gpu._session.submit(launch, 0, ["add", [x._wire, x._wire], [x._wire], {"k": object()}])
    with pytest.raises(OverflowError, match="cannot be sent"):
        gpu._session.submit(launch, 0, ["add", [x._wire, x._wire], [x._wire], {"k": [-(2**64)]}])
    with pytest.raises(OverflowError, match="cannot be sent"):
        gpu._session.submit(launch, 0, ["add", [x._wire, x._wire], [x._wire], {"k": 2**64}])
    del x
    await _verify_many(gpu)
    assert (await gpu.proxy_stats())["buffers"] == before  # the failed calls left nothing
    await gpu.aclose()  # and the session closes cleanly


@pytest.mark.slow
async def test_a_call_the_checks_miss_fails_alone_at_the_next_sync(gpu: gpuremote.GPU) -> None:
    x = gpu.asarray(np.ones(4, np.float32))
    y = gpu.empty((4,), np.float32)
    launch = CALLS_BY_NAME["launch"]
    # an op name is not a caller's value, so it is not checked before queuing: the batch's
    # encoding fails, the call is taken out of it, and the calls around it are sent
    gpu._session.submit(launch, 0, [object(), [x._wire], [y._wire], {}])
    z = x * 3.0
    with pytest.raises(LocalProtocolError, match=r"launch was not sent: an argument cannot"):
        await z.get()
    np.testing.assert_array_equal(await z.get(), 3.0)  # raised once; the session goes on
    await _verify_many(gpu)


@pytest.mark.slow
async def test_frees_from_many_threads_are_never_lost(gpu: gpuremote.GPU) -> None:
    before = (await gpu.proxy_stats())["buffers"]
    arrays = [gpu.empty((4,), np.float32) for _ in range(10_000)]
    await gpu.synchronize()
    assert (await gpu.proxy_stats())["buffers"] == before + 10_000
    shares = [arrays[i::8] for i in range(8)]
    del arrays
    go = threading.Event()

    def drop(share: list[gpuremote.RemoteArray]) -> None:
        go.wait()
        while share:
            share.pop()  # the last reference: its buffer is released from this thread

    threads = [threading.Thread(target=drop, args=(s,)) for s in shares]
    del shares
    for t in threads:
        t.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes, nearly
    try:
        go.set()
        x = gpu.asarray(np.zeros(4, np.float32))
        while any(t.is_alive() for t in threads):  # the loop keeps submitting and flushing
            x = x + 1.0
            await asyncio.sleep(0)
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    await x.get()
    await gpu.synchronize()
    del x
    await gpu.synchronize()
    assert (await gpu.proxy_stats())["buffers"] == before


async def test_with_async_calls_off_a_call_that_cannot_be_sent_fails_alone(url: str) -> None:
    async with gpuremote.connect(url, async_calls=False) as gpu:
        x = gpu.asarray(np.ones(4, np.float32))
        y = gpu.empty((4,), np.float32)
        gpu._session.submit(CALLS_BY_NAME["launch"], 0, [object(), [x._wire], [y._wire], {}])
        with pytest.raises(LocalProtocolError, match="launch was not sent"):
            await gpu.synchronize()
        np.testing.assert_array_equal(await (x + 1.0).get(), 2.0)  # the session goes on
