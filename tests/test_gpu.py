"""The CuPy backend on a real GPU. Skipped, with the reason, where CuPy or a GPU is missing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

import gpuremote
from gpuremote.backends import cupy_usable
from gpuremote.demo import mlp_data, train_local, train_remote

usable, why = cupy_usable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not usable, reason=f"needs a GPU: {why}")]


@pytest.fixture
async def gpu(scheme: str) -> AsyncIterator[gpuremote.GPU]:
    proxy = gpuremote.Proxy("cupy")
    url = await proxy.start("inproc://gpu-test" if scheme == "inproc" else "tcp://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as g:
            yield g
    finally:
        await proxy.close()


async def test_backend_reports_the_device(gpu: gpuremote.GPU) -> None:
    info = gpu.device
    assert info["backend"] == "cupy" and info["total_memory"] > 0 and info["device"]


async def test_demo_on_the_gpu_matches_numpy(gpu: gpuremote.GPU) -> None:
    data = mlp_data(batch=64, din=16, hidden=32, dout=8)
    remote = await train_remote(gpu, data, steps=5)
    local = train_local(data, steps=5)
    np.testing.assert_allclose(remote.losses, local.losses, rtol=1e-4)
    for r, lo in zip(remote.weights, local.weights, strict=True):
        np.testing.assert_allclose(r, lo, rtol=1e-4, atol=1e-5)


async def test_raw_and_elementwise_kernels(gpu: gpuremote.GPU) -> None:
    n = 1000
    x = gpu.asarray(np.arange(n, dtype=np.float32))
    y = gpu.empty(n, "float32")
    raw = gpu.kernel(
        'extern "C" __global__ void twice(const float* x, float* y, int n) {'
        " int i = blockDim.x * blockIdx.x + threadIdx.x; if (i < n) y[i] = 2 * x[i]; }",
        "twice",
    )
    raw(x, y, np.int32(n), grid=((n + 127) // 128,), block=(128,))
    np.testing.assert_array_equal(await y.get(), 2 * np.arange(n, dtype=np.float32))
    sq = gpu.kernel(
        "z = x * x", "square", kind="elementwise", in_params="float32 x", out_params="float32 z"
    )
    z = gpu.empty(n, "float32")
    sq(x, z)
    sent = gpu.stats()["calls"]["async"]
    again = gpu.kernel(
        "z = x * x", "square", kind="elementwise", in_params="float32 x", out_params="float32 z"
    )
    assert again.handle == sq.handle and gpu.stats()["calls"]["async"] == sent  # not resent
    np.testing.assert_array_equal(await z.get(), np.arange(n, dtype=np.float32) ** 2)


async def test_streams_events_and_large_copies(gpu: gpuremote.GPU) -> None:
    data = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32)
    s = gpu.stream()
    with gpu.use_stream(s):
        x = gpu.empty(data.shape, "float32")
        await x.write(data, stream=s)
        y = gpu.exp(x)
    ev = gpu.event()
    ev.record(s)
    await s.synchronize()
    assert await ev.query()
    np.testing.assert_allclose(await y.get(stream=s), np.exp(data), rtol=1e-5)


def test_large_copies_go_through_pinned_memory() -> None:
    import cupy as cp

    from gpuremote.backends.cupy_backend import PINNED_MIN, CupyBackend

    backend = CupyBackend()
    stream = backend.create_stream()
    data = np.random.default_rng(1).standard_normal(PINNED_MIN).astype(np.float32)  # 256 KiB
    buf = backend.alloc(data.nbytes)
    view = backend.view(buf, 0, data.shape, data.dtype)
    backend.from_host(view, data, stream)
    data_copy = data.copy()
    data[:] = 0  # the upload was staged: the caller's memory is free at once
    out = backend.to_host(view, stream)
    np.testing.assert_array_equal(out, data_copy)
    base = out
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, cp.cuda.PinnedMemoryPointer)


def test_the_transport_receives_large_uploads_into_pinned_memory() -> None:
    from gpuremote.backends.cupy_backend import CupyBackend, _is_pinned

    allocate = CupyBackend().host_allocator()
    assert allocate is not None
    big, small = allocate(1 << 20), allocate(16)
    assert _is_pinned(np.frombuffer(big, np.uint8))
    assert not _is_pinned(np.frombuffer(small, np.uint8))
