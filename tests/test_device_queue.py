"""The device off the event loop: one session's device work never holds up another's.

Asserted on counts and order (whose reply came first), with wide margins, not on tight
timings: the simulated device (``sim:op_us=...``) makes the device time long and known.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gpuremote
from gpuremote.backends import BackendError, NumpyBackend, get_backend
from gpuremote.backends.sim_backend import SimBackend
from gpuremote.errors import ConfigError, ConnectionClosed
from gpuremote.proxy import Proxy
from gpuremote.proxy.devicequeue import estimate_ns
from gpuremote.proxy.executor import Executor
from gpuremote.proxy.session import ProxySession
from gpuremote.wire.calls import CALLS_BY_NAME
from gpuremote.wire.framing import Frame, FrameLimits
from gpuremote.wire.protocol import (
    FATAL,
    PROTOCOL_VERSION,
    Command,
    decode_message,
    decode_replies,
    decode_request,
    encode_request,
)


@pytest.fixture
async def sim_proxy(request: pytest.FixtureRequest) -> Any:
    op_us = getattr(request, "param", 50_000)
    proxy = Proxy(f"sim:op_us={op_us}")
    url = await proxy.start("tcp://127.0.0.1:0")
    try:
        yield proxy, url
    finally:
        await proxy.close()


# -- the simulated device -------------------------------------------------------------------
def test_sim_launches_return_at_once_and_waits_wait() -> None:
    sim = SimBackend(op_us=40_000)
    stream = sim.create_stream()
    a = np.ones(4, np.float32)
    out = np.empty(4, np.float32)
    from gpuremote.ops import OPS

    t0 = time.perf_counter()
    for _ in range(5):  # 200 ms of device work
        sim.run_op(OPS["add"], [a, a], [out], {}, stream)
    queued = time.perf_counter() - t0
    ev = sim.create_event()
    assert sim.query_event(ev)  # never recorded: complete
    sim.record_event(ev, stream)
    assert not sim.query_event(ev)  # behind 200 ms of work
    host = sim.to_host(out, stream)  # waits for the stream
    waited = time.perf_counter() - t0
    assert sim.query_event(ev)
    np.testing.assert_array_equal(host, [2, 2, 2, 2])
    assert queued < waited / 4  # launching took a small part of the device time
    assert waited >= 0.15
    sim.destroy_stream(stream)


def test_sim_spec_is_parsed_and_checked() -> None:
    assert isinstance(get_backend("sim"), SimBackend)
    assert get_backend("sim:op_us=25").op_s == pytest.approx(25e-6)  # type: ignore[attr-defined]
    for bad in ("sim:op_us=x", "sim:speed=3", "sim:op_us=-1"):
        with pytest.raises(BackendError):
            get_backend(bad)


# -- what runs inline -----------------------------------------------------------------------
def _decoded(
    *cmds: list[Any], arrays: list[list[Any]] | None = None, buffers: list[bytes] | None = None
) -> Any:
    frame = encode_request(
        [list(c) for c in cmds], [memoryview(b) for b in buffers or []], arrays or []
    )
    return decode_request(Frame(frame.meta, frame.buffers))


def test_cheap_batches_are_estimated_cheap_and_heavy_ones_not() -> None:
    launch = CALLS_BY_NAME["launch_new"].opcode
    d2h = CALLS_BY_NAME["copy_d2h"].opcode
    small = [[1, 0, [16], "float32"], [2, 0, [16], "float32"]]
    big = [[1, 0, [1500, 1500], "float32"], [2, 0, [1500, 1500], "float32"]]
    add = _decoded([1, launch, 0, ["add", [0, 0], [1], {}], False], arrays=small)
    matmul = _decoded([1, launch, 0, ["matmul", [0, 0], [1], {}], False], arrays=big)
    read = _decoded([1, d2h, 0, [0], False], arrays=small)
    assert estimate_ns(add, queues_work=False) < 50_000
    assert estimate_ns(matmul, queues_work=False) > 100e6  # ~1.7 GFLOP
    assert estimate_ns(matmul, queues_work=True) < 50_000  # a GPU only queues it ...
    assert estimate_ns(read, queues_work=True) == float("inf")  # ... and a read waits


def test_each_kind_of_call_is_estimated_by_its_own_rule() -> None:
    """The estimate of one command of each kind, as the rules give it (3 µs per command,
    plus its work): element-wise ops 0.3 ns an element, a matmul 0.05 ns a multiply-add, the
    heavy ops by n log n, copies 0.1 ns a byte, memsets 0.05; waits, worker-only calls and
    kernel builds are unbounded; a backend that queues work counts only its staging copies."""
    op = {name: spec.opcode for name, spec in CALLS_BY_NAME.items()}
    arrays = [[1, 0, [4, 8], "float32"], [2, 0, [8, 2], "float32"], [3, 0, [4, 2], "float32"]]

    def one(call: str, args: list[Any], queues_work: bool = False) -> float:
        decoded = _decoded([1, op[call], 0, args, False], arrays=arrays, buffers=[bytes(128)])
        assert [type(c) for c in decoded] == [Command], decoded  # each one valid
        return estimate_ns(decoded, queues_work)

    per = 3_000.0
    assert one("launch_new", ["add", [0, 0], [0], {}]) == per + 0.3 * 96
    assert one("launch_new", ["matmul", [0, 1], [2], {}]) == per + 0.05 * 8 * 8
    n = 32 + 32
    assert one("launch", ["sort", [0], [0], {}]) == per + 20.0 * n + 0.5 * n * 6
    assert one("launch", ["linalg.inv", [0], [0], {}]) == per + 20.0 * n + 0.5 * n * 6
    assert one("launch_dynamic", ["nonzero", [0], [9], {}]) == per + 50.0 * 32
    assert one("copy_d2h", [0]) == per + 0.1 * 128
    assert one("memset", [1, 0, 64, 0]) == per + 0.05 * 64
    assert one("free_buffers", [[1, 2]]) == per
    assert one("kernel_create", [5, "raw", "k", "src", {}]) == float("inf")
    assert one("copy_d2h", [0], queues_work=True) == float("inf")
    assert one("copy_h2d", [0, 0], queues_work=True) == per + 0.1 * 128
    assert one("launch_new", ["add", [0, 0], [0], {}], queues_work=True) == per


# -- sessions beside each other -------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("sim_proxy", [50_000], indirect=True)
async def test_a_session_waiting_on_the_device_does_not_delay_another(
    sim_proxy: tuple[Proxy, str],
) -> None:
    _, url = sim_proxy
    async with gpuremote.connect(url) as busy, gpuremote.connect(url) as other:
        await other.ping(b"warm")
        y = busy.asarray(np.zeros(16, np.float32))
        for _ in range(10):  # 10 ops of 50 ms: 500 ms of device work, then a read
            y = y + 1.0
        order: list[str] = []
        pings: list[float] = []

        async def read() -> None:
            got = await y.get()
            order.append("read")
            assert got[0] == 10.0

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.02)  # the read is on the proxy, waiting for the device
        for _ in range(20):
            t0 = time.perf_counter()
            await other.ping(b"x")
            pings.append(time.perf_counter() - t0)
        order.append("pings")
        await reader
    # every ping was answered while the other session waited on its 500 ms of device work
    assert order == ["pings", "read"]
    assert max(pings) < 0.2


async def test_a_heavy_numpy_batch_runs_beside_the_loop() -> None:
    proxy = Proxy("numpy")
    url = await proxy.start("tcp://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as heavy, gpuremote.connect(url) as light:
            rng = np.random.default_rng(0)
            a = heavy.asarray(rng.standard_normal((1000, 1000)).astype(np.float32) / 30)
            await heavy.synchronize()
            c = a
            for _ in range(6):  # ~12 GFLOP in one batch
                c = c @ a
            done: list[int] = []
            answered = 0

            async def read() -> None:
                await c.get()
                done.append(answered)

            reader = asyncio.create_task(read())
            x = light.asarray(np.ones(16, np.float32))
            while not reader.done():
                assert (await (x + x).get())[0] == 2.0
                answered += 1
            await reader
        assert done[0] >= 3  # the light session was served while the matmuls ran
        assert proxy.clients == {} or all(s.queue.in_flight == 0 for s in proxy.clients.values())
    finally:
        await proxy.close()


@pytest.mark.slow
@pytest.mark.parametrize("sim_proxy", [100_000], indirect=True)
async def test_a_client_gone_with_work_in_flight_leaks_nothing(
    sim_proxy: tuple[Proxy, str],
) -> None:
    proxy, url = sim_proxy
    gpu = await gpuremote.connect(url)
    y = gpu.asarray(np.zeros(1024, np.float32))
    for _ in range(5):  # 500 ms of device work
        y = y + 1.0
    reading = asyncio.ensure_future(y.get())
    await asyncio.sleep(0.05)
    (session,) = proxy.clients.values()
    assert session.queue.in_flight == 1  # the read waits on the device
    t0 = time.perf_counter()
    gpu._session.conn.close()  # the client vanishes
    with pytest.raises(ConnectionClosed):
        await reading
    while proxy.clients:
        await asyncio.sleep(0.01)
        assert time.perf_counter() - t0 < 10
    # freed only once the device work it had in flight was done
    assert time.perf_counter() - t0 >= 0.2
    assert session.executor.buffers == {} and session.executor.device_bytes == 0
    assert session.queue.in_flight == 0
    async with gpuremote.connect(url) as again:  # the proxy keeps serving
        assert (await (again.asarray(np.ones(4, np.float32)) * 3.0).get())[0] == 3.0
    assert proxy.stats()["buffers"] == 0


@pytest.mark.parametrize("sim_proxy", [100_000], indirect=True)
async def test_shutdown_drain_waits_for_device_work_in_flight(
    sim_proxy: tuple[Proxy, str],
) -> None:
    proxy, url = sim_proxy
    gpu = await gpuremote.connect(url)
    y = gpu.asarray(np.zeros(8, np.float32))
    for _ in range(3):
        y = y + 2.0
    reading = asyncio.ensure_future(y.get())
    await asyncio.sleep(0.05)
    await proxy.close(grace=5.0)  # as on SIGTERM: the batch already received is answered
    np.testing.assert_array_equal(await reading, np.full(8, 6.0, np.float32))
    await gpu.aclose()


# -- the session object on its own ----------------------------------------------------------
class FakeConnection:
    """A connection that records what is sent and feeds frames by hand."""

    peer = "fake"

    def __init__(self) -> None:
        self.sent: list[Frame] = []
        self.closed = False
        self.paused = False
        self.pending_bytes = 0
        self.on_frame: Any = None
        self.on_lost: Any = None
        self.admitted = False

    def send(self, frame: Frame) -> None:
        if self.closed:
            raise ConnectionClosed("closed")
        self.sent.append(frame)

    def set_receiver(self, on_frame: Any, on_lost: Any) -> None:
        self.on_frame, self.on_lost = on_frame, on_lost

    def admit(self, reserve: Any = None) -> None:
        self.admitted = True

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True


async def test_proxy_session_with_a_fake_connection() -> None:
    conn = FakeConnection()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    session = ProxySession(conn, Executor(NumpyBackend()), pool)  # type: ignore[arg-type]
    task = asyncio.create_task(session.run())
    await asyncio.sleep(0)
    assert len(conn.sent) == 1  # the greeting
    hello = encode_request(
        [[0, CALLS_BY_NAME["hello"].opcode, 0, [PROTOCOL_VERSION, ""], False]], []
    )
    conn.on_frame(hello)
    assert conn.admitted  # the handshake is done: frames of any size from now on
    ping = CALLS_BY_NAME["ping"].opcode
    req = encode_request([[1, ping, 0, [0], False]], [memoryview(b"abc")], [])
    conn.on_frame(Frame(req.meta, req.buffers))
    (reply,) = decode_replies(conn.sent[-1])
    assert reply.ok and bytes(conn.sent[-1].buffers[reply.value]) == b"abc"
    conn.on_frame(Frame(b"\xc1 not msgpack", []))  # a broken frame: FATAL, then nothing more
    assert decode_message(conn.sent[-1])[0] == FATAL and conn.paused
    conn.on_frame(Frame(req.meta, req.buffers))
    assert decode_message(conn.sent[-1])[0] == FATAL
    conn.on_lost(ConnectionClosed("gone"))
    assert await asyncio.wait_for(task, 5) == "client closed the connection"
    assert session.executor.buffers == {}
    pool.shutdown()


# -- what the proxy and the transports no longer do -----------------------------------------
def test_the_proxy_imports_no_bench_code() -> None:
    code = (
        "import sys, gpuremote.proxy, gpuremote.proxy.session\n"
        "print([m for m in sys.modules if m.startswith('gpuremote.bench')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tls_settings_come_from_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuremote.transports import Address, get_transport

    (tmp_path / "gpuremote.toml").write_text('[tls]\ncert = "/from/the/config/file.pem"\n')
    monkeypatch.chdir(tmp_path)
    address = Address.parse("tls://127.0.0.1:0")
    # the transport reads no config file of its own ...
    with pytest.raises(ConfigError, match="needs a certificate"):
        get_transport("tls", FrameLimits())._server_ssl(address)  # type: ignore[attr-defined]
    # ... the caller passes the settings (the proxy passes [tls] from the file)
    passed = get_transport("tls", FrameLimits(), {"cert": str(tmp_path / "given.pem")})
    with pytest.raises(ConfigError, match=r"given\.pem"):
        passed._server_ssl(address)  # type: ignore[attr-defined]
    from gpuremote.config import transport_settings

    assert transport_settings("tls") == {"cert": "/from/the/config/file.pem"}


# -- fair order among sessions --------------------------------------------------------------
async def test_competing_sessions_run_in_fair_order() -> None:
    from gpuremote.proxy.scheduler import FairScheduler

    sched = FairScheduler(slice_s=1.0)
    ran: list[str] = []
    assert sched.run("heavy", 1e6, lambda: ran.append("heavy-0"))  # alone: at once
    assert not sched.run("other", 1e6, lambda: ran.append("other"))  # competition: queued
    for i in range(1, 6):  # heavy goes on sending 1 ms batches ...
        assert not sched.run("heavy", 1e6, lambda i=i: ran.append(f"heavy-{i}"))
    assert not sched.run("light", 1e4, lambda: ran.append("light"))  # ... then a small op
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    # the light op, queued last, runs first (first come, first served would run it last),
    # "other" gets its turn before heavy's second batch; each session's batches stay in order
    assert ran == ["heavy-0", "light", "other", *(f"heavy-{i}" for i in range(1, 6))]
    assert sched.waiting == 0


async def test_a_small_batch_overtakes_a_round_of_equal_big_ones() -> None:
    """Sessions that send identical batches in step share one tag; a small batch that arrives
    while that round runs goes next, not behind the rest of the round."""
    from gpuremote.proxy.scheduler import FairScheduler

    sched = FairScheduler(slice_s=1.0)
    ran: list[str] = []
    n = 16

    def first_of_round() -> None:
        ran.append("s1")
        sched.run("light", 1e4, lambda: ran.append("light"))  # arrives mid-round
        # the busy ones' next batches, sent as their answers went out
        sched.run("s0", 1e6, lambda: ran.append("s0-next"))

    assert sched.run("s0", 1e6, lambda: ran.append("s0"))
    sched.run("s1", 1e6, first_of_round)
    for i in range(2, n):  # one 1 ms batch of each of the others
        sched.run(f"s{i}", 1e6, lambda i=i: ran.append(f"s{i}"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert ran[: ran.index("light")] == ["s0", "s1"]  # the round's other 14 wait for it
    assert ran.index("s0-next") == len(ran) - 1  # and the busy session gets no second turn
    assert sorted(ran) == sorted(["light", "s0-next", *(f"s{i}" for i in range(n))])


async def test_sessions_taking_turns_run_at_once_without_a_contention_window() -> None:
    """``contention_s=0`` (``Proxy(contention_s=0)``, as the requirements bench's): a batch of
    another session than the last waits only behind batches already waiting, so it runs in
    the transport's callback that brought it (where the bench times the proxy)."""
    from gpuremote.proxy.scheduler import FairScheduler

    ran: list[str] = []
    windowed = FairScheduler()
    assert windowed.run("a", 1e3, lambda: ran.append("a"))
    assert not windowed.run("b", 1e3, lambda: ran.append("b"))  # within 2 ms of a's: queued
    await asyncio.sleep(0)
    taking_turns = FairScheduler(contention_s=0.0)
    assert taking_turns.run("a", 1e3, lambda: ran.append("a"))
    assert taking_turns.run("b", 1e3, lambda: ran.append("b"))  # at once
    assert taking_turns.run("a", 1e3, lambda: ran.append("a"))
    assert ran == ["a", "b", "a", "b", "a"]


@pytest.mark.slow
def test_bench_load_spreads_clients_over_processes(cli_json: Any) -> None:
    out = cli_json(
        "bench", "load", "--backend", "numpy", "--clients", "6", "--procs", "2",
        "--ops", "300", "--sync-every", "50",
    )  # fmt: skip
    assert out["errors"] == 0 and out["verified"] == 6 and out["procs"] == 2
    rates = out["per_client_calls_per_s"]
    assert 0 < rates["min"] <= rates["median"] <= rates["max"]
    assert out["light_client"]["ops"] > 0 and out["light_client"]["p99_us"] > 0
    assert out["proxy_cpu_s"] > 0


async def test_a_cheap_batch_waits_for_the_heavy_one_before_it() -> None:
    """Order within a session holds across the inline and worker paths: a cheap batch that
    follows one sent to the worker runs after it, never inline before it."""
    proxy = Proxy("numpy")
    url = await proxy.start("tcp://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as gpu:
            rng = np.random.default_rng(3)
            host = rng.standard_normal((600, 600)).astype(np.float32)
            a = gpu.asarray(host)
            await gpu.synchronize()
            c = a @ a  # ~0.2 GFLOP: estimated well over the inline budget, so on a worker
            await gpu.flush()  # its own frame
            d = c + 1.0  # a cheap frame right behind it, reading c
            got = await d.get()
            np.testing.assert_allclose(got, host @ host + 1.0, rtol=1e-4, atol=1e-3)
            (session,) = proxy.clients.values()
            assert session.queue.ran_off_loop >= 1
    finally:
        await proxy.close()


@pytest.mark.slow
def test_serve_takes_the_simulated_backend(cli: Any) -> None:
    import json as _json

    out = cli("bench", "tenants", "--backend", "sim:op_us=100", "--seconds", "0.5",
              "--n", "64", "--matmuls", "2", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = _json.loads(out.stdout)
    assert result["backend"] == "sim" and result["light_alone"]["p50_ms"] > 0


async def test_uploads_are_received_into_the_backends_host_memory() -> None:
    """The proxy hands the transport its backend's allocator (pinned memory on a GPU), so
    that a large upload lands there straight from the socket and is adopted as the buffer."""
    from gpuremote.wire.framing import byte_view

    made: list[int] = []

    class Counting(NumpyBackend):
        def host_allocator(self) -> Any:
            def allocate(nbytes: int) -> memoryview:
                made.append(nbytes)
                return byte_view(np.empty(nbytes, dtype=np.uint8))

            return allocate

    proxy = Proxy(Counting())
    url = await proxy.start("tcp://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as gpu:
            data = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
            x = gpu.empty(data.shape, "float64")
            await x.write(data)
            np.testing.assert_array_equal(await (x + 0.0).get(), data)
        assert data.nbytes in made
    finally:
        await proxy.close()
