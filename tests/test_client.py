"""End to end through a proxy, over inproc:// and tcp:// (the ``gpu`` fixture runs both)."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest
from gpuremote.transports import connect as transport_connect
from gpuremote.transports import listen

import gpuremote
from gpuremote.errors import ConnectionClosed, LocalProtocolError, RemoteCallError
from gpuremote.proxy import Proxy
from gpuremote.session.pipeline import ClientSession
from gpuremote.tools.demo import mlp_data, train_local, train_remote
from gpuremote.wire.calls import CALLS_BY_NAME
from gpuremote.wire.framing import Frame
from gpuremote.wire.protocol import FATAL, decode_greeting, decode_message


async def test_demo_workload_equals_numpy(gpu: gpuremote.GPU) -> None:
    data = mlp_data(batch=32, din=8, hidden=16, dout=4)
    remote = await train_remote(gpu, data, steps=5)
    local = train_local(data, steps=5)
    # same ops in the same order; only BLAS's summation order may differ (transposed operands
    # are contiguous copies on the proxy), hence a float32 tolerance
    np.testing.assert_allclose(remote.losses, local.losses, rtol=1e-5)
    for r, lo in zip(remote.weights, local.weights, strict=True):
        np.testing.assert_allclose(r, lo, rtol=1e-5, atol=1e-6)
    assert remote.losses[-1] < remote.losses[0]


async def test_matmul_tanh_get_idiom(gpu: gpuremote.GPU) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    b = np.ones((4, 2), np.float32)
    y = gpu.tanh(gpu.matmul(gpu.asarray(a), gpu.asarray(b)))
    assert y.shape == (3, 2) and y.dtype == np.float32  # known locally, before any reply
    np.testing.assert_allclose(await y.get(), np.tanh(a @ b), rtol=1e-6)


async def test_op_set_and_operators(gpu: gpuremote.GPU) -> None:
    x = np.linspace(0.5, 2, 12, dtype=np.float32).reshape(3, 4)
    r = gpu.asarray(x)
    checks = {
        "add": (gpu.add(r, r), x + x),
        "sub": (r - 1.0, x - 1),
        "rsub": (1.0 - r, 1 - x),
        "mul": (2 * r, 2 * x),
        "div": (r / r, x / x),
        "exp": (gpu.exp(r), np.exp(x)),
        "log": (gpu.log(r), np.log(x)),
        "max": (gpu.maximum(r, 1.0), np.maximum(x, 1)),
        "relu": (gpu.relu(r - 1.0), np.maximum(x - 1, 0)),
        "sum": (gpu.sum(r, axis=0), x.sum(0)),
        "mean": (gpu.mean(r, axis=1), x.mean(1)),
        "T": (r.T, x.T),
        "reshape": (r.reshape(2, 6), x.reshape(2, 6)),
        "softmax": (gpu.softmax(r), np.exp(x) / np.exp(x).sum(-1, keepdims=True)),
        "matmul": (r @ r.T, x @ x.T),
        "neg": (-r, -x),
        "full": (gpu.full((2, 2), 7.0), np.full((2, 2), 7.0, np.float32)),
        "zeros": (gpu.zeros((3,), "int32"), np.zeros(3, np.int32)),
    }
    for name, (remote, expected) in checks.items():
        got = await remote.get()
        np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=name)
        assert got.dtype == expected.dtype, name
    y = gpu.asarray(np.ones(4, np.float32))
    gpu.axpy(2.0, gpu.asarray(np.arange(4, dtype=np.float32)), y)
    np.testing.assert_array_equal(await y.get(), 1 + 2 * np.arange(4, dtype=np.float32))


async def test_two_clients_are_isolated(url: str) -> None:
    async with gpuremote.connect(url) as a, gpuremote.connect(url) as b:
        xa = a.asarray(np.full(4, 1.0, np.float32))
        xb = b.asarray(np.full(4, 2.0, np.float32))
        assert xa.handle == xb.handle  # each client picks its own handles
        ya, yb = a.multiply(xa, 10.0), b.multiply(xb, 10.0)
        np.testing.assert_array_equal(await ya.get(), np.full(4, 10.0, np.float32))
        np.testing.assert_array_equal(await yb.get(), np.full(4, 20.0, np.float32))
        for _ in range(5):
            a.empty(16)
        await a.synchronize()
        # b asks for a handle that only a holds: unknown, never a's data
        with pytest.raises(RemoteCallError, match="unknown buffer handle"):
            await b._session.call(CALLS_BY_NAME["copy_d2h"], 0, [[6, 0, [4], "float32"]])
        assert (await b.proxy_stats())["buffers"] == 2


async def test_client_that_disconnects_mid_stream_leaves_no_memory(
    proxy: tuple[Proxy, str],
) -> None:
    p, url = proxy
    gpu = await gpuremote.connect(url)
    arrays = [gpu.asarray(np.ones(1 << 16, np.float32)) for _ in range(8)]
    await gpu.synchronize()
    assert p.stats()["device_bytes"] == 8 * (1 << 18)
    for a in arrays:
        gpu.exp(a)  # queued, some maybe sent
    gpu._session.conn.close()  # vanish without a goodbye
    for _ in range(100):
        if p.stats()["sessions"] == 0:
            break
        await asyncio.sleep(0.01)
    assert p.stats() | {"sessions_served": 0} == {
        "backend": p.backend.name,
        "sessions": 0,
        "sessions_served": 0,
        "buffers": 0,
        "device_bytes": 0,
    }


async def test_failing_call_names_call_op_and_message_and_session_survives(
    gpu: gpuremote.GPU,
) -> None:
    a = gpu.asarray(np.ones((2, 3), np.float32))
    bad = gpu.empty((2, 2))
    ok1 = gpu.exp(a)
    gpu._session.submit(
        CALLS_BY_NAME["launch"], 0, ["matmul", [a._desc(), a._desc()], [bad._desc()], {}]
    )
    seq = gpu._session._seq
    gpu.exp(a)  # after the failure on the same stream: not run
    with pytest.raises(RemoteCallError) as info:
        await gpu.synchronize()
    err = info.value
    assert (err.call, err.op, err.seq, err.deferred) == ("launch", "matmul", seq, True)
    assert "not aligned" in err.message and err.skipped == 1
    assert "launch(op='matmul')" in str(err)
    np.testing.assert_array_equal(await ok1.get(), np.exp(np.ones((2, 3), np.float32)))
    np.testing.assert_array_equal(await gpu.exp(a).get(), np.exp(np.ones((2, 3), np.float32)))


async def test_failed_alloc_surfaces_at_the_next_sync(gpu: gpuremote.GPU) -> None:
    gpu.empty(1 << 58, "uint8")  # returns at once: the handle is the client's
    with pytest.raises(RemoteCallError) as info:
        await gpu.synchronize()
    assert info.value.call == "alloc" and "memory" in info.value.message
    await gpu.synchronize()  # usable again


async def test_sync_errors_are_immediate_and_not_deferred(gpu: gpuremote.GPU) -> None:
    with pytest.raises(RemoteCallError) as info:
        await gpu._session.call(CALLS_BY_NAME["event_query"], 0, [12345])
    assert not info.value.deferred and info.value.call == "event_query"


async def test_async_calls_then_one_sync_make_exactly_one_frame(gpu: gpuremote.GPU) -> None:
    x = gpu.asarray(np.ones(8, np.float32))
    y = gpu.zeros(8, "float32")
    await gpu.synchronize()
    before = gpu.stats()
    for _ in range(200):
        gpu.axpy(1.0, x, y)
    out = await y.get()
    after = gpu.stats()
    assert after["frames_sent"] - before["frames_sent"] == 1
    assert after["round_trips"] - before["round_trips"] == 1
    assert after["calls"]["async"] - before["calls"]["async"] == 200
    np.testing.assert_array_equal(out, np.full(8, 200, np.float32))


async def test_batch_bounds_split_frames(url: str) -> None:
    async with gpuremote.connect(url, max_batch_calls=50) as gpu:
        x = gpu.zeros(4, "float32")
        await gpu.synchronize()
        before = gpu.stats()["frames_sent"]
        for _ in range(120):
            gpu.axpy(1.0, x, x)
        await gpu.synchronize()
        assert gpu.stats()["frames_sent"] - before == 3  # 50 + 50 + (20 + the sync)


async def test_shadow_get_makes_no_transfer_until_the_device_writes(gpu: gpuremote.GPU) -> None:
    host = np.arange(1000, dtype=np.float64)
    x = gpu.asarray(host)
    host[:] = -1  # the upload took a copy
    await gpu.synchronize()
    before = gpu.stats()
    got = await x.get()
    after = gpu.stats()
    np.testing.assert_array_equal(got, np.arange(1000, dtype=np.float64))
    assert after["frames_sent"] == before["frames_sent"]
    assert after["bytes_received"] == before["bytes_received"]
    assert after["calls"]["local"] == before["calls"]["local"] + 1
    gpu.axpy(1.0, x, x)  # the device writes x
    assert not x.host_valid
    got = await x.get()
    assert gpu.stats()["bytes_received"] - after["bytes_received"] >= 8000
    np.testing.assert_array_equal(got, 2 * np.arange(1000, dtype=np.float64))


@pytest.mark.slow
@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"async_calls": False},
        {"batching": False},
        {"shadow": False},
        {"async_calls": False, "batching": False, "shadow": False},
    ],
    ids=["all-on", "no-async", "no-batching", "no-shadow", "all-off"],
)
async def test_results_identical_with_each_optimisation_off(url: str, switches: dict) -> None:
    data = mlp_data(batch=16, din=8, hidden=8, dout=2)
    async with gpuremote.connect(url, **switches) as gpu:
        remote = await train_remote(gpu, data, steps=3)
        stats = gpu.stats()
    async with gpuremote.connect(url) as gpu:  # everything on: the reference, bit for bit
        reference = await train_remote(gpu, data, steps=3)
    assert remote.losses == reference.losses
    for r, ref in zip(remote.weights, reference.weights, strict=True):
        np.testing.assert_array_equal(r, ref)
    local = train_local(data, steps=3)
    np.testing.assert_allclose(remote.losses, local.losses, rtol=1e-5)
    calls = stats["calls"]["async"] + stats["calls"]["sync"]
    if switches.get("async_calls") is False:
        assert stats["round_trips"] >= calls  # every call waited for its own reply
    elif not switches:
        assert stats["round_trips"] == stats["calls"]["sync"]


async def test_deferred_error_in_no_async_mode_still_names_the_call(url: str) -> None:
    async with gpuremote.connect(url, async_calls=False) as gpu:
        gpu.empty(1 << 58, "uint8")
        with pytest.raises(RemoteCallError, match="alloc"):
            await gpu.synchronize()


@pytest.mark.slow
async def test_freeing_explicitly_and_by_garbage_collection(gpu: gpuremote.GPU) -> None:
    x = gpu.asarray(np.ones(100, np.float32))
    y = gpu.exp(x)
    await gpu.synchronize()
    assert (await gpu.proxy_stats())["buffers"] == 2
    x.free()
    with pytest.raises(LocalProtocolError, match="after free"):
        gpu.exp(x)
    del y
    gc.collect()
    await gpu.synchronize()
    assert (await gpu.proxy_stats())["buffers"] == 0


async def test_streams_and_events(gpu: gpuremote.GPU) -> None:
    s = gpu.stream()
    with gpu.use_stream(s):
        assert gpu.current_stream == s.handle
        x = gpu.asarray(np.ones(4, np.float32))
        y = gpu.exp(x)
    ev = gpu.event()
    ev.record(s)
    gpu.stream().wait_event(ev)
    await s.synchronize()
    assert await ev.query() is True
    np.testing.assert_allclose(await y.get(stream=s), np.exp(np.ones(4, np.float32)))


async def test_user_kernels_need_the_cupy_backend(gpu: gpuremote.GPU) -> None:
    if gpu.device["backend"] == "cupy":
        pytest.skip("the cupy backend has user kernels (tests/test_gpu.py)")
    with pytest.raises(LocalProtocolError, match="cupy backend"):
        gpu.kernel('extern "C" __global__ void k() {}', "k")


async def test_unknown_op_is_refused_locally(gpu: gpuremote.GPU) -> None:
    with pytest.raises(ValueError, match="unknown op"):
        gpu.op("os.system", gpu.zeros(1))


async def test_ping_echoes_small_and_large_payloads(gpu: gpuremote.GPU) -> None:
    assert bytes(await gpu.ping(b"hello")) == b"hello"
    big = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)
    assert np.array_equal(np.frombuffer(await gpu.ping(memoryview(big)), np.uint8), big)


async def test_large_write_and_get_round_trip(gpu: gpuremote.GPU) -> None:
    data = np.random.default_rng(2).standard_normal(1 << 20)
    x = gpu.empty(data.shape, "float64")
    await x.write(data)
    assert not x.host_valid
    np.testing.assert_array_equal(await x.get(), data)


async def test_device_info_is_cached_at_connect(gpu: gpuremote.GPU, backend_name: str) -> None:
    before = gpu.stats()
    info = gpu.device
    assert info["backend"] == backend_name.partition(":")[0] and "matmul" in info["ops"]
    assert gpu.stats()["frames_sent"] == before["frames_sent"]


async def test_lost_connection_fails_pending_calls_at_once() -> None:
    conns = []

    async def black_hole(conn: object) -> None:  # accepts, never answers
        conns.append(conn)
        await asyncio.sleep(3600)

    listener = await listen("tcp://127.0.0.1:0", black_hole)  # type: ignore[arg-type]
    try:
        session = ClientSession(await transport_connect(listener.url))
        pending = asyncio.ensure_future(session.call(CALLS_BY_NAME["device_synchronize"], 0, []))
        await asyncio.sleep(0.05)
        assert not pending.done()
        conns[0].close()
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(pending, 2)
        with pytest.raises(ConnectionClosed):
            session.submit(CALLS_BY_NAME["free"], 0, [1])
    finally:
        await listener.close()


async def test_proxy_going_away_fails_the_client(url: str, proxy: tuple[Proxy, str]) -> None:
    gpu = await gpuremote.connect(url)
    await proxy[0].close()
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(gpu.synchronize(), 2)
    await gpu.aclose()


@pytest.mark.slow
async def test_protocol_garbage_closes_only_that_connection(proxy: tuple[Proxy, str]) -> None:
    url = proxy[1]
    good = await gpuremote.connect(url)
    conn = await transport_connect(url)
    greeting = decode_greeting(await asyncio.wait_for(conn.recv(), 2))
    assert greeting["auth"] is False and len(greeting["nonce"]) == 32
    conn.send(Frame(b"\xc1 not msgpack"))
    fatal = decode_message(await asyncio.wait_for(conn.recv(), 2))
    assert fatal[0] == FATAL and "not valid msgpack" in fatal[1]
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(conn.recv(), 2)
    x = good.asarray(np.ones(3, np.float32))
    np.testing.assert_array_equal(await good.exp(x).get(), np.exp(np.ones(3, np.float32)))
    await good.aclose()


async def test_spin_wait_gives_the_same_results(url: str) -> None:
    """``spin_us`` changes how a SYNC call waits, not what it returns."""
    async with gpuremote.connect(url, spin_us=200) as gpu:
        assert gpu.config.spin_us == 200
        a = gpu.asarray(np.arange(6, dtype=np.float32))
        assert bytes(await gpu.ping(b"spin")) == b"spin"
        np.testing.assert_array_equal(await (a + a).get(), np.arange(6, dtype=np.float32) * 2)
        await gpu.synchronize()


async def test_dynamic_shape_launches_on_the_async_front_end(gpu: gpuremote.GPU) -> None:
    x = gpu.asarray(np.array([0, 3, 0, 5, 7], dtype=np.int32))
    (idx,) = await gpu.launch_dynamic("nonzero", x)
    assert idx.shape == (3,)
    np.testing.assert_array_equal(await idx.get(), [1, 3, 4])
    values, counts = await gpu.launch_dynamic("unique_counts", x, n_out=2)
    np.testing.assert_array_equal(await values.get(), [0, 3, 5, 7])
    np.testing.assert_array_equal(await counts.get(), [2, 1, 1, 1])
