"""ucx:// specifics (the end-to-end tests run over ucx:// too, through the ``scheme``
fixture). Skipped, with the reason, where ucxx is not installed."""

from __future__ import annotations

import asyncio
import importlib.util
import time

import numpy as np
import pytest

import gpuremote
from gpuremote.proxy import Proxy

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ucxx") is None, reason="ucx:// needs the [ucx] extra (ucxx)"
)


async def test_an_idle_connection_costs_no_cpu() -> None:
    """The progress driver waits on the worker's descriptor, armed: with a session open and
    receives posted on both ends, nothing spins (ucxx's own asyncio progress would)."""
    proxy = Proxy("numpy")
    url = await proxy.start("ucx://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as gpu:
            assert (await (gpu.asarray(np.ones(8, np.float32)) + 1.0).get())[0] == 2.0
            t0, c0 = time.perf_counter(), time.process_time()
            await asyncio.sleep(2.0)
            cpu = time.process_time() - c0
            assert cpu < 0.1 * (time.perf_counter() - t0), f"{cpu:.3f} s of CPU while idle"
    finally:
        await proxy.close()


async def test_large_arrays_cross_intact() -> None:
    proxy = Proxy("numpy")
    url = await proxy.start("ucx://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as gpu:
            data = np.random.default_rng(0).standard_normal(1 << 21)  # 16 MiB
            x = gpu.empty(data.shape, "float64")
            await x.write(data)
            np.testing.assert_array_equal(await (x * 2.0).get(), data * 2.0)
    finally:
        await proxy.close()
