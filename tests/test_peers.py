"""Copies between two proxies (``x.to_device(other)``): proxy to proxy, else through the client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import gpuremote
import gpuremote.xp as xp
from gpuremote.proxy import Proxy
from gpuremote.proxy.peers import Tickets
from gpuremote.wire.calls import CALLS_BY_NAME
from gpuremote.wire.limits import MAX_TICKETS_PER_SESSION


class _Proxies:
    """Proxies served on an event loop of a thread of their own (as separate machines are)."""

    def __init__(self, backend: str = "numpy") -> None:
        self.backend = backend
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.proxies: list[Proxy] = []

    def start(self, secret: bytes | None = None, **options: Any) -> tuple[Proxy, str]:
        proxy = Proxy(self.backend, secret=secret, **options)
        fut = asyncio.run_coroutine_threadsafe(proxy.start("tcp://127.0.0.1:0"), self.loop)
        self.proxies.append(proxy)
        return proxy, fut.result(10)

    def run(self, fn: Any) -> Any:
        """``fn()`` on the proxies' loop."""
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def call() -> None:
            out.set_result(fn())

        self.loop.call_soon_threadsafe(call)
        return out.result(10)

    def close(self) -> None:
        for p in self.proxies:
            asyncio.run_coroutine_threadsafe(p.close(), self.loop).result(20)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def proxies(each_backend: str) -> Iterator[_Proxies]:
    p = _Proxies(each_backend)
    yield p
    p.close()


def _moved(d: xp.Device) -> int:
    s = d.stats()
    return int(s["bytes_sent"] + s["bytes_received"])


def test_to_device_goes_proxy_to_proxy(proxies: _Proxies) -> None:
    pa, ua = proxies.start()
    pb, ub = proxies.start(peers=[ua])
    host = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB
    with xp.Device(ua) as a, xp.Device(ub) as b:
        x = xp.asarray(host, device=a) * 2.0
        a.synchronize()
        before = _moved(a) + _moved(b)
        y = x.to_device(b)
        assert y.device is b and y.shape == x.shape and y.dtype == x.dtype
        assert b.last_copy == "proxy to proxy"
        z = y + 1.0  # usable on its new device
        b.synchronize()
        assert _moved(a) + _moved(b) - before < 16 * 1024  # only the calls, never the data
        np.testing.assert_array_equal(np.asarray(z), host * 2.0 + 1.0)
        assert len(pa.tickets) == 0  # the ticket was used up
        assert pb.peers is not None and pb.peers.bytes_in == host.nbytes


def test_unreachable_peer_falls_back_through_the_client(proxies: _Proxies) -> None:
    # B's secret is not A's: B cannot open a link to A, so the client carries the data
    _, ua = proxies.start(b"secret-a")
    _, ub = proxies.start(b"secret-b", peers=[ua])
    host = np.arange(10_000, dtype=np.int32)
    with xp.Device(ua, secret=b"secret-a") as a, xp.Device(ub, secret=b"secret-b") as b:
        x = xp.asarray(host, device=a)
        y = x.to_device(b)
        assert b.last_copy.startswith("through the client (cannot reach the proxy at")
        np.testing.assert_array_equal(np.asarray(y), host)


def test_arrays_on_two_devices_do_not_mix(proxies: _Proxies) -> None:
    (_, ua), (_, ub) = proxies.start(), proxies.start()
    with xp.Device(ua) as a, xp.Device(ub) as b:
        x, y = xp.ones(3, device=a), xp.ones(3, device=b)
        with pytest.raises(ValueError, match="two devices"):
            x + y
        info = xp.__array_namespace_info__()
        assert a in info.devices() and b in info.devices()
        np.testing.assert_array_equal(np.asarray(x + y.to_device(a)), 2.0)


async def test_a_ticket_is_good_for_one_read(proxies: _Proxies) -> None:
    (pa, ua), _ = proxies.start(), None
    spec = CALLS_BY_NAME
    async with gpuremote.connect(ua) as gpu:
        x = gpu.asarray(np.arange(8, dtype=np.float32))
        ticket, _ = await gpu._session.call(spec["peer_export"], 0, [x._wire])
        value, bufs = await gpu._session.call(spec["peer_read"], 0, [ticket])
        np.testing.assert_array_equal(np.frombuffer(bufs[value], np.float32), np.arange(8))
        with pytest.raises(gpuremote.RemoteCallError, match="unknown or expired ticket"):
            await gpu._session.call(spec["peer_read"], 0, [ticket])
        with pytest.raises(gpuremote.RemoteCallError, match="unknown or expired ticket"):
            await gpu._session.call(spec["peer_read"], 0, ["not-a-ticket"])
        for _ in range(MAX_TICKETS_PER_SESSION):
            await gpu._session.call(spec["peer_export"], 0, [x._wire])
        with pytest.raises(gpuremote.RemoteCallError, match="exported arrays not yet read"):
            await gpu._session.call(spec["peer_export"], 0, [x._wire])
        assert proxies.run(lambda: len(pa.tickets)) == MAX_TICKETS_PER_SESSION
    for _ in range(100):  # the session's tickets go with it
        if proxies.run(lambda: len(pa.tickets)) == 0:
            break
        await asyncio.sleep(0.02)
    assert len(pa.tickets) == 0


async def test_import_of_a_bad_ticket_names_the_cause(proxies: _Proxies) -> None:
    _, ua = proxies.start()
    _, ub = proxies.start(peers=[ua, "tcp://127.0.0.1:1"])
    async with gpuremote.connect(ub) as gpu:
        y = gpu.empty((4,), np.float32)
        with pytest.raises(gpuremote.RemoteCallError, match="unknown or expired ticket"):
            await gpu._session.call(CALLS_BY_NAME["peer_import"], 0, [y._wire, ua, "nope"])
        with pytest.raises(gpuremote.RemoteCallError, match="cannot reach the proxy"):
            await gpu._session.call(
                CALLS_BY_NAME["peer_import"], 0, [y._wire, "tcp://127.0.0.1:1", "nope"]
            )
        np.testing.assert_array_equal(await (gpu.full((2,), 3.0) + 1).get(), 4.0)  # goes on


class _Listener:
    """A TCP server on the proxies' loop that counts connections and never answers."""

    def __init__(self, proxies: _Proxies) -> None:
        self.accepted = 0
        self._writers: list[asyncio.StreamWriter] = []

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.accepted += 1
            self._writers.append(writer)  # held open, silent

        async def start() -> asyncio.Server:
            return await asyncio.start_server(on_client, "127.0.0.1", 0)

        self.server = asyncio.run_coroutine_threadsafe(start(), proxies.loop).result(10)
        self.url = f"tcp://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        self._loop = proxies.loop

    def close(self) -> None:
        async def stop() -> None:
            for w in self._writers:
                w.close()
            self.server.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)


async def test_import_from_a_proxy_that_is_no_peer_is_refused_unopened(
    proxies: _Proxies,
) -> None:
    target = _Listener(proxies)
    try:
        _, ub = proxies.start(peers=["tcp://127.0.0.1:1"])
        async with gpuremote.connect(ub) as gpu:
            y = gpu.empty((4,), np.float32)
            imp = CALLS_BY_NAME["peer_import"]
            with pytest.raises(gpuremote.RemoteCallError, match="is not a peer of this proxy"):
                await gpu._session.call(imp, 0, [y._wire, target.url, "ticket"])
            with pytest.raises(gpuremote.RemoteCallError, match="is not a peer of this proxy"):
                await gpu._session.call(imp, 0, [y._wire, "tcp://10.1.2.3:5151", "ticket"])
            np.testing.assert_array_equal(await (gpu.full((2,), 3.0) + 1).get(), 4.0)
        assert target.accepted == 0  # refused before any connection was attempted
    finally:
        target.close()


def test_proxies_that_are_no_peers_copy_through_the_client(proxies: _Proxies) -> None:
    (_, ua), (pb, ub) = proxies.start(), proxies.start()  # no --peer: nobody's peer
    host = np.arange(1000, dtype=np.float32)
    with xp.Device(ua) as a, xp.Device(ub) as b:
        y = xp.asarray(host, device=a).to_device(b)
        assert b.last_copy.startswith("through the client (")
        assert "is not a peer" in b.last_copy
        np.testing.assert_array_equal(np.asarray(y), host)
    assert pb.peers is not None and len(pb.peers) == 0 and pb.peers.refused == 1


@pytest.mark.slow
async def test_a_silent_peer_holds_no_device_worker(proxies: _Proxies) -> None:
    # one device worker, and a peer that accepts but never answers: the import fails at its
    # deadline, and meanwhile the proxy's other sessions are served, off-loop work included
    silent = _Listener(proxies)
    try:
        _, ub = proxies.start(peers=[silent.url], peer_timeout_s=1.0, workers=1, inline_us=0)
        async with gpuremote.connect(ub) as gpu, gpuremote.connect(ub) as other:
            y = gpu.empty((4,), np.float32)
            t0 = time.monotonic()
            importing = asyncio.ensure_future(
                gpu._session.call(CALLS_BY_NAME["peer_import"], 0, [y._wire, silent.url, "t"])
            )
            await asyncio.sleep(0.2)
            for i in range(20):  # served while the import waits (each batch on the worker)
                np.testing.assert_array_equal(await (other.full((3,), float(i)) * 2).get(), 2 * i)
            assert not importing.done()
            with pytest.raises(gpuremote.RemoteCallError, match="no answer from the proxy at"):
                await importing
            assert 0.9 < time.monotonic() - t0 < 5
            np.testing.assert_array_equal(await (gpu.full((2,), 1.0) + 1).get(), 2.0)  # goes on
        assert silent.accepted == 1
    finally:
        silent.close()


async def test_export_quota_is_per_session(proxies: _Proxies) -> None:
    from gpuremote.proxy.executor import SessionLimits

    _, ua = proxies.start(session_limits=SessionLimits(max_device_bytes=3000))
    async with gpuremote.connect(ua) as g1, gpuremote.connect(ua) as g2:
        x1 = g1.asarray(np.zeros(250, np.float32))  # 1000 bytes
        x2 = g2.asarray(np.zeros(250, np.float32))
        export = CALLS_BY_NAME["peer_export"]
        await g1._session.call(export, 0, [x1._wire])  # session 1 now holds 2000 bytes
        await g2._session.call(export, 0, [x2._wire])  # not counted against session 1's
        await g2._session.call(export, 0, [x2._wire])  # 3000: session 2's limit, reached
        with pytest.raises(gpuremote.RemoteCallError, match="exceed this session's limit"):
            await g2._session.call(export, 0, [x2._wire])


def test_links_are_closed_when_idle_or_no_longer_peers(proxies: _Proxies) -> None:
    _, ua = proxies.start()
    pb, ub = proxies.start(peers=[ua])
    with xp.Device(ua) as a, xp.Device(ub) as b:
        xp.asarray(np.ones(8, np.float32), device=a).to_device(b)
        assert b.last_copy == "proxy to proxy"
        links = pb.peers
        assert links is not None and len(links) == 1
        proxies.run(lambda: pb.set_peers([]))
        assert len(links) == 0 and links.allowed == frozenset()
        proxies.run(lambda: pb.set_peers([ua]))
        links.idle_s = 0.05
        xp.asarray(np.ones(8, np.float32), device=a).to_device(b)
        assert b.last_copy == "proxy to proxy" and len(links) == 1
        deadline = time.monotonic() + 5
        while len(links) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(links) == 0


def test_tickets_expire() -> None:
    t = Tickets(ttl_s=0.0)
    ticket = t.add(1, b"data", 4)
    with pytest.raises(KeyError):
        t.take(ticket)
    t = Tickets()
    t.add(1, b"a", 1)
    t.add(2, b"b", 1)
    t.drop_session(1)
    assert len(t) == 1 and t.held_bytes() == 1


async def test_async_to_device_goes_proxy_to_proxy(proxies: _Proxies) -> None:
    _, ua = proxies.start()
    pb, ub = proxies.start(peers=[ua])
    host = np.random.default_rng(2).standard_normal((256, 256)).astype(np.float32)
    async with gpuremote.connect(ua) as a, gpuremote.connect(ub) as b:
        x = a.asarray(host) * 2.0
        assert await x.to_device(a) is x
        y = await x.to_device(b)
        assert b.last_copy == "proxy to proxy"
        assert y.shape == x.shape and y.dtype == x.dtype
        np.testing.assert_array_equal(await (y + 1.0).get(), host * 2.0 + 1.0)
        assert pb.peers is not None and pb.peers.bytes_in == host.nbytes
        with pytest.raises(ValueError, match="two devices"):
            x + y
