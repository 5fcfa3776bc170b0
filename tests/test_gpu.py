"""The CuPy backend on a real GPU. Skipped, with the reason, where CuPy or a GPU is missing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

import gpuremote
from gpuremote.backends import cupy_usable
from gpuremote.backends.base import buffer_owner
from gpuremote.tools.demo import mlp_data, train_local, train_remote

usable, why = cupy_usable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not usable, reason=f"needs a GPU: {why}")]


@pytest.fixture
async def gpu(scheme: str) -> AsyncIterator[gpuremote.GPU]:
    proxy = gpuremote.Proxy("cupy")
    url = await proxy.start(
        "inproc://gpu-test" if scheme == "inproc" else f"{scheme}://127.0.0.1:0"
    )
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
    assert isinstance(buffer_owner(out), cp.cuda.PinnedMemoryPointer)


def test_the_transport_receives_large_uploads_into_pinned_memory() -> None:
    from gpuremote.backends.cupy_backend import CupyBackend, _is_pinned

    backend = CupyBackend()
    allocate = backend.host_allocator()
    assert allocate is not None
    big, small = allocate(1 << 20), allocate(16)
    # as the executor sees a received buffer: frombuffer of the memoryview, viewed, reshaped
    host = np.frombuffer(big, np.uint8).view(np.float32).reshape(-1, 4)
    assert _is_pinned(host)
    assert not _is_pinned(np.frombuffer(small, np.uint8))
    host[...] = 1.5
    stream = backend.create_stream()
    dst = backend.view(backend.alloc(host.nbytes, stream), 0, host.shape, host.dtype)
    backend.from_host(dst, host, stream)
    assert backend._staged[-1][1] is host  # no staging copy: the received memory is DMA'd
    np.testing.assert_array_equal(backend.to_host(dst, stream), host)


def _busy(stream: object, n: int = 4096, times: int = 20) -> object:
    """Queue ~tens of ms of matmuls on ``stream``; returns their input."""
    import cupy as cp

    with stream:  # type: ignore[attr-defined]
        a = cp.ones((n, n), cp.float32)
        for _ in range(times):
            a = a @ a / n
    return a


def test_a_free_holds_the_memory_until_the_streams_work_has_run() -> None:
    from gpuremote.backends.cupy_backend import CupyBackend

    backend = CupyBackend()
    s0, s1 = backend.create_stream(), backend.create_stream()
    buf = backend.alloc(64 << 20, s0)
    ptr = buf.data.ptr
    _busy(s1)  # stream 1 is busy for a while: the free must wait for it
    backend.free([buf], [s0, s1])
    del buf
    assert backend._freed and backend._freed[-1][1][0].data.ptr == ptr  # still held
    s1.synchronize()
    backend.alloc(16, s0)  # gives back what has completed
    assert not backend._freed


def test_a_destroyed_stream_has_run_its_work() -> None:
    from gpuremote.backends.cupy_backend import CupyBackend

    backend = CupyBackend()
    s = backend.create_stream()
    _busy(s)
    backend.destroy_stream(s)
    assert s.done
