"""Sessions that survive the loss of their proxy (``connect(..., failover=[...])``), without
Ray: proxies in this process (closed to lose them) and proxy processes (killed with SIGKILL).
The pool's case (``failover=True``, ``ray.kill``) is in ``test_pool.py``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

import gpuremote
import gpuremote.xp as xp
from gpuremote.proxy import Proxy
from gpuremote.proxy.executor import SessionLimits
from gpuremote.session.failover import FailoverError, FailoverSession
from gpuremote.tools.demo import mlp_data, mlp_step
from gpuremote.tools.proxyprocess import LocalProxy
from gpuremote.wire.calls import CALLS_BY_NAME

_C = CALLS_BY_NAME


class _Local:
    """Proxies in this process, on the test's loop; ``lose(url)`` closes one (its clients'
    connections drop)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.proxies: dict[str, Proxy] = {}

    async def start(self, n: int, peers: bool = True, **options: Any) -> list[str]:
        urls = []
        for _ in range(n):
            p = Proxy(self.backend, **options)
            urls.append(await p.start("tcp://127.0.0.1:0"))
            self.proxies[urls[-1]] = p
        if peers:
            for p in self.proxies.values():
                p.set_peers(urls)
        return urls

    async def lose(self, url: str) -> None:
        await self.proxies.pop(url).close()

    async def close(self) -> None:
        for p in self.proxies.values():
            await p.close()


@pytest.fixture
async def local(each_backend: str) -> AsyncIterator[_Local]:
    """Each test backend: ``sim:check`` checks the order of what a checkpoint and a move do
    on the device (stream-ordered frees, races between streams)."""
    proxies = _Local(each_backend)
    yield proxies
    await proxies.close()


async def _steps_checkpointed(gpu: gpuremote.GPU, x: Any, steps: int) -> None:
    """``steps`` in-place steps on ``x``, each waited for, a pause after each: at least one
    checkpoint is taken meanwhile."""
    before = gpu.stats()["checkpoints"]
    for _ in range(steps):
        gpu.axpy(1.0, x, x)
        await gpu.synchronize()
        await asyncio.sleep(0.005)
    assert gpu.stats()["checkpoints"] > before


async def _train(
    gpu: gpuremote.GPU, steps: int, before: Callable[[int], Any] | None = None
) -> tuple[list[float], list[np.ndarray[Any, Any]]]:
    data = mlp_data(batch=32, din=16, hidden=32, dout=8)
    x, y = gpu.asarray(data["x"]), gpu.asarray(data["y"])
    w1, w2 = gpu.asarray(data["w1"]), gpu.asarray(data["w2"])
    losses = []
    for i in range(steps):
        if before is not None:
            await before(i)
        losses.append(float(await mlp_step(gpu, x, y, w1, w2, 2.0 / y.size, 0.1).get()))
    return losses, [await w1.get(), await w2.get()]


async def test_training_goes_on_after_its_proxy_is_lost_with_the_same_weights(
    local: _Local, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, c = await local.start(3)
    async with gpuremote.connect(a) as gpu:
        ref = await _train(gpu, 60)

    async def lose(i: int) -> None:
        if i in (20, 40):
            await local.lose(gpu.url)

    caplog.set_level(logging.WARNING, "gpuremote.failover")
    async with gpuremote.connect(a, failover=[a, b, c], checkpoint_interval_s=0.005) as gpu:
        got = await _train(gpu, 60, lose)
        # the checkpoint due after the last move runs in the background: it may still be in
        # flight when a fast run ends (a sync point starts a due one and lets one in flight end)
        deadline = time.monotonic() + 10
        while gpu.stats()["checkpoints"] < 2 and time.monotonic() < deadline:
            await gpu.synchronize()
            await asyncio.sleep(0.01)
        stats = gpu.stats()
        moves = gpu.session.moves  # type: ignore[union-attr]
    assert got[0] == ref[0]
    for w, r in zip(got[1], ref[1], strict=True):
        np.testing.assert_array_equal(w, r)  # bitwise
    assert stats["failovers"] == 2 and len(stats["pause_s"]) == 2
    assert [m["from"] for m in moves] == [a, b] and moves[1]["to"] == c
    assert all(m["standby"] for m in moves)  # restored from copies made proxy to proxy
    assert stats["checkpoints"] >= 2 and stats["checkpoint_bytes"] > 0
    assert "moved from" in caplog.text


@pytest.mark.slow
def test_a_proxy_process_killed_with_sigkill(tmp_path: Any) -> None:
    """A real loss (the process dies; its connections reset), through xp."""
    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    extra = ("--secret-file", str(secret), "--quiet")
    with (
        LocalProxy("tcp", "numpy", extra_args=extra) as pa,
        LocalProxy("tcp", "numpy", extra_args=(*extra, "--peer", pa.url)) as pb,
    ):

        def run(kill_at: int | None, **options: Any) -> tuple[list[float], np.ndarray]:
            rng = np.random.default_rng(1)
            dev = xp.connect(pa.url, secret="s" * 32, **options)
            try:
                w = xp.asarray(rng.standard_normal((16, 4)).astype(np.float32))
                x = xp.asarray(rng.standard_normal((32, 16)).astype(np.float32))
                sums = []
                for i in range(30):
                    if i == kill_at:
                        os.kill(pa.pid, signal.SIGKILL)
                    y = xp.tanh(x @ w)
                    w = w - 0.1 * (xp.permute_dims(x, (1, 0)) @ y) / 32.0
                    sums.append(float(xp.sum(y * y)))
                return sums, np.asarray(w)
            finally:
                stats = dev.stats()
                dev.close()
                if kill_at is not None:
                    assert stats["failovers"] == 1
                    assert dev.session.moves[0]["standby"]  # type: ignore[union-attr]

        ref = run(None)
        got = run(15, failover=[pa.url, pb.url], checkpoint_interval_s=0.005)
    assert got[0] == ref[0]
    np.testing.assert_array_equal(got[1], ref[1])


async def test_a_deferred_error_is_raised_once_across_a_move(local: _Local) -> None:
    a, b = await local.start(2)
    async with gpuremote.connect(a, failover=[a, b]) as gpu:
        x = gpu.asarray(np.arange(8, dtype=np.float32))
        await gpu.synchronize()
        gpu.session.submit(_C["free"], 0, [987654])  # fails on the proxy: deferred
        await local.lose(a)  # lost before any sync: the error is raised after the move
        with pytest.raises(gpuremote.RemoteCallError, match="unknown buffer handle"):
            await gpu.synchronize()
        await gpu.synchronize()  # once
        np.testing.assert_array_equal(await (x + 1.0).get(), np.arange(8) + 1.0)
    assert gpu.stats()["failovers"] == 1


async def test_an_error_raised_before_the_move_is_not_raised_again(local: _Local) -> None:
    a, b = await local.start(2)
    async with gpuremote.connect(a, failover=[a, b], checkpoint_interval_s=3600) as gpu:
        x = gpu.asarray(np.arange(8, dtype=np.float32))
        await gpu.synchronize()  # the first checkpoint (always taken at once)
        for _ in range(3):
            await asyncio.sleep(0)
        gpu.session.submit(_C["free"], 0, [987654])
        with pytest.raises(gpuremote.RemoteCallError):
            await gpu.synchronize()
        y = x * 2.0
        await local.lose(a)
        await gpu.synchronize()  # the journal re-ran the failing free: not raised again
        np.testing.assert_array_equal(await y.get(), np.arange(8) * 2.0)
        assert gpu.stats()["failovers"] == 1


async def test_a_read_in_flight_is_answered_by_the_next_proxy(local: _Local) -> None:
    a, b = await local.start(2)
    async with gpuremote.connect(a, failover=[a, b]) as gpu:
        x = gpu.asarray(np.arange(1 << 16, dtype=np.float32))
        ys = [x * float(i) for i in range(8)]
        reads = [asyncio.ensure_future(y.get()) for y in ys]
        await asyncio.sleep(0)
        await local.lose(a)
        for i, r in enumerate(reads):
            np.testing.assert_array_equal(await r, np.arange(1 << 16) * float(i))
        assert gpu.stats()["failovers"] == 1


async def test_streams_events_and_captured_steps_are_recreated(local: _Local) -> None:
    a, b = await local.start(2)
    async with gpuremote.connect(a, failover=[a, b], checkpoint_interval_s=0.001) as gpu:
        s, ev = gpu.stream(), gpu.event()
        w = gpu.asarray(np.ones(16, dtype=np.float32))
        await gpu.synchronize()  # uploaded on stream 0, used on s

        def step(w: Any) -> Any:
            gpu.axpy(0.5, gpu.multiply(w, 2.0), w)
            return gpu.sum(w)

        run = gpu.capture(step)
        with gpu.use_stream(s):
            for _ in range(3):
                run(w)
        ev.record(s)
        await s.synchronize()
        for _ in range(5):  # checkpoints are taken meanwhile
            await gpu.synchronize()
        await local.lose(a)
        with gpu.use_stream(s):
            total = run(w)  # the recorded step, the stream: both on the new proxy
        gpu.stream().wait_event(ev)
        await s.synchronize()
        assert float(await total.get()) == 16 * 2.0**4
        assert run.stats()["replays"] == 3 and gpu.stats()["failovers"] == 1


async def test_checkpoints_go_through_the_client_without_a_peer_and_skip_uploads(
    local: _Local,
) -> None:
    a, b = await local.start(2, peers=False)
    async with gpuremote.connect(a, failover=[a, b], checkpoint_interval_s=0.001) as gpu:
        big = gpu.asarray(np.ones(1 << 18, dtype=np.float32))  # 1 MiB, never written again
        w = gpu.asarray(np.zeros(1024, dtype=np.float32))
        for i in range(400):  # until two checkpoints were taken (at 1 ms: a loaded machine's)
            gpu.axpy(1.0, gpu.asarray(np.ones(1024, dtype=np.float32)), w)
            await gpu.synchronize()
            if i >= 19 and gpu.stats()["checkpoints"] >= 2:
                break
        stats = gpu.stats()
        assert stats["checkpoints"] >= 2
        assert stats["checkpoint_bytes_to_client"] == stats["checkpoint_bytes"] > 0
        assert stats["checkpoint_bytes"] < stats["checkpoints"] * 3 * 4096  # never the 1 MiB
        await local.lose(a)
        np.testing.assert_array_equal(await w.get(), float(i + 1))
        assert float(await gpu.sum(big).get()) == 1 << 18
        move = gpu.session.moves[0]  # type: ignore[union-attr]
        assert not move["standby"] and move["restored_bytes"] >= (1 << 20)


@pytest.mark.slow
async def test_the_journal_bound_takes_a_checkpoint(local: _Local) -> None:
    a, b = await local.start(2)
    options = {"checkpoint_interval_s": 3600, "journal_max_calls": 200}
    async with gpuremote.connect(a, failover=[a, b], **options) as gpu:
        w = gpu.asarray(np.zeros(64, dtype=np.float32))
        session = gpu.session
        assert isinstance(session, FailoverSession)
        longest = 0
        for i in range(60):
            for _ in range(50):
                gpu.axpy(1.0, w, w) if i % 2 else gpu.launch("negative", [w], [w])
            await gpu.synchronize()
            await asyncio.sleep(0.002)  # a checkpoint's copies go on meanwhile
            longest = max(longest, len(session.ledger.journal))
        assert gpu.stats()["checkpoints"] >= 3  # the interval (an hour) did not take them
        assert longest < 600  # 3,000 calls went by: checkpoints cut the journal


@pytest.mark.slow
async def test_with_no_proxy_left_the_session_fails_naming_why(local: _Local) -> None:
    a, b = await local.start(2)
    gpu = await gpuremote.connect(a, failover=[a, b], failover_timeout_s=0.5)
    x = gpu.asarray(np.ones(4, dtype=np.float32))
    await gpu.synchronize()
    await local.lose(b)  # the standby first, then the session's own
    await local.lose(a)
    with pytest.raises(FailoverError, match=r"no proxy|standby"):
        await (x * 2.0).get()
    with pytest.raises(gpuremote.ConnectionClosed):  # FailoverError is one
        await gpu.synchronize()
    await gpu.aclose()


async def test_failover_options_are_checked(local: _Local) -> None:
    (a,) = await local.start(1)
    with pytest.raises(gpuremote.ConfigError, match="pool://"):
        await gpuremote.connect(a, failover=True)
    with pytest.raises(gpuremote.ConfigError, match="need failover"):
        await gpuremote.connect(a, checkpoint_interval_s=1.0)
    with pytest.raises(gpuremote.ConfigError, match="positive"):
        await gpuremote.connect(a, failover=[a], checkpoint_interval_s=0)
    async with gpuremote.connect(a) as gpu:  # without failover: today's session
        assert not isinstance(gpu.session, FailoverSession)
        assert "failovers" not in gpu.stats()


@pytest.mark.slow
def test_a_proxy_that_stops_answering_is_left_after_call_timeout_s(tmp_path: Any) -> None:
    """No reply within ``call_timeout_s`` (the process is stopped, its connections open)."""
    secret = "t" * 32
    (tmp_path / "secret").write_text(secret)
    extra = ("--secret-file", str(tmp_path / "secret"), "--quiet")
    with (
        LocalProxy("tcp", "numpy", extra_args=extra) as pa,
        LocalProxy("tcp", "numpy", extra_args=(*extra, "--peer", pa.url)) as pb,
    ):

        async def scenario() -> None:
            # one checkpoint, done before the proxy hangs (a checkpoint in flight would hold
            # the standby until the proxies' peer deadline: docs/reference/failover.md)
            options = {"secret": secret, "call_timeout_s": 0.5, "checkpoint_interval_s": 3600}
            async with gpuremote.connect(pa.url, failover=[pa.url, pb.url], **options) as gpu:
                w = gpu.asarray(np.zeros(256, dtype=np.float32))
                for _ in range(5):
                    gpu.axpy(1.0, gpu.full((256,), 1.0), w)
                    await gpu.synchronize()
                session = gpu.session
                assert isinstance(session, FailoverSession)
                while session.checkpoints.task is not None or not gpu.stats()["checkpoints"]:
                    await asyncio.sleep(0.01)
                os.kill(pa.pid, signal.SIGSTOP)
                try:
                    gpu.axpy(1.0, gpu.full((256,), 1.0), w)
                    np.testing.assert_array_equal(await w.get(), 6.0)
                finally:
                    os.kill(pa.pid, signal.SIGCONT)
                assert gpu.url == pb.url and gpu.stats()["failovers"] == 1
                assert "no reply" in gpu.session.moves[0]["cause"]  # type: ignore[union-attr]

        gpuremote.run(scenario())


async def test_more_buffers_than_a_proxy_exports_at_once(local: _Local) -> None:
    """A proxy holds 16 exports per session: a checkpoint of more goes in waves, from copies
    set aside at one point of the session's order."""
    a, b = await local.start(2)
    async with gpuremote.connect(a, failover=[a, b], checkpoint_interval_s=0.001) as gpu:
        xs = [gpu.full((64,), float(i)) for i in range(40)]
        for _ in range(3):
            for x in xs:
                gpu.axpy(1.0, x, x)
            await gpu.synchronize()
            await asyncio.sleep(0.01)
        while gpu.stats()["checkpoints"] < 3:
            await gpu.synchronize()
            await asyncio.sleep(0.01)
        assert gpu.stats()["checkpoint_bytes_to_client"] == 0  # all to the standby
        await local.lose(a)
        for i, x in enumerate(xs):
            np.testing.assert_array_equal(await x.get(), 8.0 * i)
        assert gpu.session.moves[0]["standby"]  # type: ignore[union-attr]


async def test_a_step_that_writes_an_array_it_closes_over(local: _Local) -> None:
    a, b = await local.start(2)
    async with gpuremote.connect(a, failover=[a, b], checkpoint_interval_s=0.001) as gpu:
        w = gpu.asarray(np.ones(32, dtype=np.float32))  # an upload: its bytes are the client's

        def step(x: Any) -> None:
            gpu.axpy(1.0, x, w)  # w is not an argument

        run = gpu.capture(step)
        x = gpu.asarray(np.ones(32, dtype=np.float32))
        for _ in range(5):
            run(x)
            await gpu.synchronize()
            await asyncio.sleep(0.005)  # checkpoints after the replays
        await local.lose(a)
        np.testing.assert_array_equal(await w.get(), 6.0)


async def test_a_cancelled_wait_does_not_stop_checkpoints(local: _Local) -> None:
    a, b = await local.start(2)
    async with gpuremote.connect(a, failover=[a, b], checkpoint_interval_s=0.001) as gpu:
        x = gpu.asarray(np.arange(1 << 20, dtype=np.float32))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for((x * 2.0).get(), 1e-6)
        await _steps_checkpointed(gpu, x, 20)
        await local.lose(a)
        np.testing.assert_array_equal(await x.get(), np.arange(1 << 20) * 2.0**20)


async def test_a_buffer_whose_making_failed_does_not_block_checkpoints(local: _Local) -> None:
    a, b = await local.start(2, peers=False)
    async with gpuremote.connect(a, failover=[a, b], checkpoint_interval_s=0.001) as gpu:
        w = gpu.full((16,), 1.0)
        gpu.session.submit(_C["alloc"], 0, [gpu.session.new_handle(), 1 << 60])  # refused
        with pytest.raises(gpuremote.RemoteCallError, match="alloc failed"):
            await gpu.synchronize()
        await _steps_checkpointed(gpu, w, 10)
        await local.lose(a)
        np.testing.assert_array_equal(await w.get(), 2.0**10)


async def test_copies_aside_past_the_memory_limit_go_through_the_client(local: _Local) -> None:
    """40 buffers (past the 16 exports a proxy holds) in a session whose limit leaves no room
    to copy them aside: the checkpoint goes through the client instead, and the move works."""
    limits = SessionLimits(max_device_bytes=16 << 10)
    a, b = await local.start(2, session_limits=limits)
    async with gpuremote.connect(a, failover=[a, b], checkpoint_interval_s=0.001) as gpu:
        xs = [gpu.full((64,), float(i)) for i in range(40)]  # 10 KiB; twice: past the limit
        for _ in range(10):
            for x in xs:
                gpu.axpy(1.0, x, x)
            await gpu.synchronize()  # never an error of the checkpoint's own
            await asyncio.sleep(0.005)
        assert gpu.stats()["checkpoint_bytes_to_client"] > 0
        await local.lose(a)
        for i, x in enumerate(xs):
            np.testing.assert_array_equal(await x.get(), 1024.0 * i)


async def test_a_write_answered_with_an_error_pending_keeps_it_pending(local: _Local) -> None:
    """A write that waits (``x.write``) is answered even while an error is pending (the
    proxy skips it): re-issued, nothing may take that error early."""
    a, b = await local.start(2)

    async def scenario(lose: bool, **options: Any) -> tuple[Any, ...]:
        async with gpuremote.connect(a, **options) as gpu:
            gpu.stream()  # more than one stream: answered calls keep their order on re-issue
            x = gpu.asarray(np.zeros(8, dtype=np.float32))
            y = gpu.asarray(np.ones(8, dtype=np.float32))
            await gpu.synchronize()
            gpu.session.submit(_C["free"], 0, [987654])  # fails: stream 0 is skipped until
            await x.write(np.full(8, 5.0, dtype=np.float32))  # the next sync (answered)
            gpu.axpy(1.0, y, y)
            if lose:
                await local.lose(a)
            with pytest.raises(gpuremote.RemoteCallError, match="unknown buffer handle"):
                await gpu.synchronize()
            await gpu.synchronize()  # raised once
            return (await x.get()).tolist(), (await y.get()).tolist()

    ref = await scenario(False)
    got = await scenario(True, failover=[a, b], checkpoint_interval_s=3600)
    assert got == ref


async def test_a_checkpoint_leaves_the_applications_error_and_what_it_skips(
    local: _Local,
) -> None:
    """A checkpoint taken while an error of the application's is pending neither takes that
    error nor lets the work it skips run: as without failover."""
    a, b = await local.start(2)
    async with gpuremote.connect(a, failover=[a, b], checkpoint_interval_s=0.001) as gpu:
        session = gpu.session
        assert isinstance(session, FailoverSession)
        y = gpu.asarray(np.ones(8, dtype=np.float32))
        await gpu.synchronize()
        while session.checkpoints.task is not None:  # the first checkpoint, done
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)  # the interval gone by: the next one is due
        session.submit(_C["free"], 0, [987654])  # fails: stream 0 skips until the next sync
        session.checkpoints.maybe()  # a checkpoint at this point of the order
        assert session.checkpoints.task is not None
        while session.checkpoints.task is not None:
            await asyncio.sleep(0.001)
        gpu.axpy(1.0, y, y)  # skipped, as the error's stream's work is until the next sync
        with pytest.raises(gpuremote.RemoteCallError, match="unknown buffer handle"):
            await gpu.synchronize()
        np.testing.assert_array_equal(await y.get(), 1.0)
