"""Hostile peers on every network transport (tcp://, tls://, ucx://): limits before any
allocation, nothing but the hello before the handshake, a malformed message ends only its own
connection; and the proxy listens only where it says it does."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

import gpuremote
from gpuremote.config import transport_settings
from gpuremote.errors import RemoteCallError
from gpuremote.proxy.executor import SessionLimits
from gpuremote.proxy.heap import rss_bytes
from gpuremote.tools.proxyprocess import LocalProxy
from gpuremote.tools.top import fetch
from gpuremote.wire.auth import is_loopback, proof
from gpuremote.wire.calls import CALLS_BY_NAME
from gpuremote.wire.framing import HEADER, MAGIC, VERSION, Frame, frame_bytes, iter_frames
from gpuremote.wire.protocol import (
    PROTOCOL_VERSION,
    REPLY,
    decode_greeting,
    decode_message,
    encode_request,
)

if TYPE_CHECKING:
    from conftest import Cli


needs_ucx = pytest.mark.ucx  # skipped where ucxx is missing (conftest.py)
TOKEN = "hostile-admin-token"
GIB = 1 << 30


def _header(meta_len: int, lengths: list[int]) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, meta_len, len(lengths)) + struct.pack(
        f"<{len(lengths)}Q", *lengths
    )


#: what a peer may send before it said hello: each announces a gibibyte, or is no frame
ANNOUNCEMENTS = {
    "one buffer of 1 GiB": _header(16, [GIB]),
    "1 GiB of metadata": _header(GIB, []),
    "many buffers of 1 GiB": _header(16, [GIB] * 64),
    "wrong magic": b"XX" + _header(16, [GIB])[2:],
}


def _hello(secret: str, nonce: bytes) -> bytes:
    hello = CALLS_BY_NAME["hello"].opcode
    answer = proof(secret.encode(), nonce) if secret else ""
    return frame_bytes(encode_request([[1, hello, 0, [PROTOCOL_VERSION, answer], False]], []))


# -- a raw peer per transport: bytes (tcp) or messages (ucx) past gpuremote's own framing ------
class RawPeer:
    """One connection to the proxy that sends what it is told and reports when it is cut."""

    async def send(self, data: bytes) -> None:
        raise NotImplementedError

    async def recv(self) -> bytes:
        raise NotImplementedError

    async def cut_off(self, timeout: float = 5.0) -> bool:
        """Whether the proxy closed this connection within ``timeout``."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TcpPeer(RawPeer):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> TcpPeer:
        address = gpuremote.transports.Address.parse(url)
        context = None
        if address.scheme == "tls":  # the CA from the config file (``tls_files``)
            context = ssl.create_default_context(cafile=transport_settings("tls")["ca"])
        return cls(*await asyncio.open_connection(address.host, address.port, ssl=context))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self) -> bytes:
        head = await asyncio.wait_for(self.reader.readexactly(HEADER.size), 5)
        _, _, _, meta_len, nbufs = HEADER.unpack(head)
        rest = await self.reader.readexactly(8 * nbufs)
        lengths = struct.unpack(f"<{nbufs}Q", rest)
        return head + rest + await self.reader.readexactly(meta_len + sum(lengths))

    async def cut_off(self, timeout: float = 5.0) -> bool:
        try:
            async with asyncio.timeout(timeout):
                while await self.reader.read(1 << 16):
                    pass  # a FATAL first, then the end
        except TimeoutError:
            return False
        except (OSError, ssl.SSLError):
            return True
        return True

    def close(self) -> None:
        self.writer.close()


class UcxPeer(RawPeer):
    def __init__(self, raw: Any) -> None:
        self.raw = raw

    @classmethod
    async def open(cls, url: str) -> UcxPeer:
        from gpuremote.bench.ucx_channel import raw_connect

        address = gpuremote.transports.Address.parse(url)
        return cls(await raw_connect(address.host, address.port or 0))

    async def send(self, data: bytes) -> None:
        done: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        self.raw.send(memoryview(data), lambda exc: done.done() or done.set_result(exc))
        await asyncio.wait_for(done, 5)

    async def recv(self) -> bytes:
        got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.raw.next_message(lambda buf: got.done() or got.set_result(buf.tobytes()))
        return await asyncio.wait_for(got, 5)

    async def cut_off(self, timeout: float = 5.0) -> bool:
        for _ in range(int(timeout / 0.02)):
            if self.raw.closed:
                return True
            await asyncio.sleep(0.02)
        return False

    def close(self) -> None:
        self.raw.close()


async def open_peer(url: str) -> RawPeer:
    if url.startswith("ucx://"):
        return await UcxPeer.open(url)
    return await TcpPeer.open(url)


# -- a proxy process per transport -------------------------------------------------------------
NETWORK = ["tcp", "tls", pytest.param("ucx", marks=needs_ucx)]


@pytest.fixture(params=NETWORK)
def proxy_process(request: pytest.FixtureRequest) -> Iterator[LocalProxy]:
    """A proxy in its own process (its memory measured alone), with a shared secret."""
    scheme = str(request.param)
    if scheme == "tls":
        request.getfixturevalue("tls_files")
    saved = os.environ.get("GPUREMOTE_SECRET")
    os.environ["GPUREMOTE_SECRET"] = "hostile-test-secret"
    try:
        with LocalProxy(scheme, "numpy", extra_args=("--quiet", "--admin-token", TOKEN)) as p:
            yield p
    finally:
        if saved is None:
            os.environ.pop("GPUREMOTE_SECRET", None)
        else:
            os.environ["GPUREMOTE_SECRET"] = saved


async def _served(gpu: gpuremote.GPU, n: int) -> None:
    x = gpu.asarray(np.arange(n, dtype=np.float64))
    np.testing.assert_array_equal(await (x * 2.0).get(), 2 * np.arange(n, dtype=np.float64))


@pytest.mark.slow
async def test_a_peer_announcing_a_gibibyte_before_its_hello_is_cut_off_at_no_cost(
    proxy_process: LocalProxy,
) -> None:
    """Before the handshake only the hello's small frame is taken: a header announcing 1 GiB
    (or wrong magic) closes that connection before anything is allocated for it; the proxy's
    memory does not grow, `top` counts them, and another client is served throughout."""
    url, pid = proxy_process.url, proxy_process.pid
    async with gpuremote.connect(url) as good:
        await _served(good, 1000)
        for peer in [await open_peer(url) for _ in range(4)]:  # warm up the paths measured
            await peer.send(ANNOUNCEMENTS["one buffer of 1 GiB"])
            assert await peer.cut_off()
            peer.close()
        await asyncio.sleep(0.2)
        before = rss_bytes(pid)
        attacks = 0
        for _round in range(5):
            for name, data in ANNOUNCEMENTS.items():
                peer = await open_peer(url)
                await peer.send(data)
                assert await peer.cut_off(), f"{name}: still connected"
                peer.close()
                attacks += 1
            await _served(good, 100)
        await asyncio.sleep(0.2)
        grown = rss_bytes(pid) - before
        assert grown < 1 << 20, f"the proxy grew by {grown / 2**20:.2f} MiB"
        snapshot = await fetch(good.session, TOKEN)
        assert snapshot["connections"]["handshake_refused"] >= attacks
        await _served(good, 1000)


@needs_ucx
async def test_a_large_message_before_the_hello_is_dropped_unread_over_ucx() -> None:
    """ucx://: a real 64 MiB message before the hello is not received into memory of its
    size (UCX truncates it into one byte) and ends that connection."""
    proxy = gpuremote.Proxy("numpy")
    url = await proxy.start("ucx://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as good:
            big = np.zeros(64 << 20, np.uint8)
            peer = await UcxPeer.open(url)
            await peer.recv()  # the greeting
            received = rss_bytes()
            await peer.send(big.data.cast("B").tobytes()[: 64 << 20])
            assert await peer.cut_off()
            assert rss_bytes() - received < 32 << 20  # the sender's copy, not a receive
            assert proxy.handshake_refused == 1
            await _served(good, 100)
    finally:
        await proxy.close()


@pytest.mark.slow
async def test_a_short_or_malformed_message_closes_only_that_connection(
    proxy_process: LocalProxy,
) -> None:
    """After a valid hello, a message shorter than its header says (ucx: a message; tcp: a
    cut stream), garbage metadata or wrong magic end that one session; another client is
    served throughout."""
    url = proxy_process.url
    secret = os.environ["GPUREMOTE_SECRET"]
    ucx = url.startswith("ucx://")
    bad_meta = frame_bytes(Frame(b"\xc1 not msgpack"))
    short = _header(100, [])  # says 100 bytes of metadata follow; none do
    cases = {"short": short, "bad msgpack": bad_meta, "wrong magic": b"ZZ" + bad_meta[2:]}
    async with gpuremote.connect(url) as good:
        for name, data in cases.items():
            peer = await open_peer(url)
            (greeting,) = iter_frames(await peer.recv())
            await peer.send(_hello(secret, decode_greeting(greeting)["nonce"]))
            (reply,) = iter_frames(await peer.recv())
            assert decode_message(reply)[0] == REPLY, decode_message(reply)
            await peer.send(data)
            if name == "short" and not ucx:
                assert isinstance(peer, TcpPeer)
                if url.startswith("tls://"):  # TLS has no half-close: the stream just ends
                    peer.close()
                    await _served(good, 100)
                    continue
                peer.writer.write_eof()  # the stream ends inside the frame
            assert await peer.cut_off(), f"{name}: still connected"
            peer.close()
            await _served(good, 100)


# -- where the proxy listens -------------------------------------------------------------------
def _listening(pid: int) -> set[tuple[str, int]]:
    """The listening TCP sockets that process ``pid`` holds, from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            host_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(host_hex)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # per word
            found.add((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="needs Linux /proc")
def test_a_loopback_tcp_proxy_listens_on_loopback_only() -> None:
    with LocalProxy("tcp", "numpy", extra_args=("--quiet",)) as p:
        sockets = _listening(p.pid)
    port = int(p.url.rsplit(":", 1)[1])
    assert ("127.0.0.1", port) in sockets
    assert all(is_loopback(host) for host, _ in sockets), sockets


@pytest.mark.slow
@needs_ucx
@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="needs Linux /proc")
def test_a_loopback_ucx_proxy_needs_a_secret_and_keeps_ucx_on_loopback(cli: Cli) -> None:
    """ucxx binds a listener to every interface: without a secret the proxy refuses to start
    and says why; with one it says where it really listens, and UCX's own interfaces listen
    on loopback only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUREMOTE_", "UCX_"))}
    out = cli("serve", "--listen", "ucx://127.0.0.1:0", "--backend", "numpy", env=env)
    assert out.returncode == 2, out.stderr
    assert "without a shared secret" in out.stderr and "every interface" in out.stderr
    saved = os.environ.get("GPUREMOTE_SECRET")
    os.environ["GPUREMOTE_SECRET"] = "listener-test-secret"
    try:
        with LocalProxy("ucx", "numpy", extra_args=("--quiet",)) as p:
            sockets = _listening(p.pid)
            banner = p.banner
    finally:
        if saved is None:
            os.environ.pop("GPUREMOTE_SECRET", None)
        else:
            os.environ["GPUREMOTE_SECRET"] = saved
    port = int(p.url.rsplit(":", 1)[1])
    assert f"bound to ucx://0.0.0.0:{port}" in banner  # printed where it really listens
    exposed = {(h, q) for h, q in sockets if not is_loopback(h)}
    assert exposed == {("0.0.0.0", port)}, sockets  # ucxx's listener, and nothing of UCX's


# -- errors where they happen ------------------------------------------------------------------
async def test_a_failure_in_the_proxy_is_answered_as_a_proxy_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception while the proxy handles a frame fails that batch's calls with an error
    naming it (logged with its traceback); the session goes on."""
    from gpuremote.proxy.peers import PeerImports

    proxy = gpuremote.Proxy("numpy")
    url = await proxy.start("tcp://127.0.0.1:0")
    real = PeerImports.wanted  # asked of each batch as the proxy takes it
    broken = {"on": False}

    def wanted(self: PeerImports, commands: Any) -> bool:
        if broken["on"]:
            raise RuntimeError("peers broke")
        return real(self, commands)

    monkeypatch.setattr(PeerImports, "wanted", wanted)
    try:
        async with gpuremote.connect(url) as gpu:
            x = gpu.asarray(np.ones(4))
            await gpu.synchronize()
            broken["on"] = True
            with pytest.raises(RemoteCallError, match=r"proxy error.*RuntimeError: peers broke"):
                await gpu.ping(b"x")
            broken["on"] = False
            np.testing.assert_array_equal(await (x + 1.0).get(), np.full(4, 2.0))
        assert any(r.exc_info and "peers broke" in str(r.exc_info[1]) for r in caplog.records)
    finally:
        await proxy.close()


# -- --json over every transport ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["inproc", *NETWORK])
def test_json_is_one_object_on_stdout_on_every_transport(
    cli: Cli, transport: str, request: pytest.FixtureRequest
) -> None:
    """``--json``: stdout holds the one JSON object, whatever UCX or the proxy print."""
    if transport == "tls":
        request.getfixturevalue("tls_files")
    env = {k: v for k, v in os.environ.items() if k != "GPUREMOTE_URL"}
    for user_vars in ({}, {"UCX_TLS": "tcp,sm,self"}):  # the user's UCX_* make UCX warn
        out = cli(
            "bench",
            "throughput",
            "--transport",
            transport,
            "--backend",
            "numpy",
            "--sizes",
            "64k",
            "--max-reps",
            "3",
            "--json",
            env={**env, **user_vars},
            timeout=180,
        )
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["bench"] == "throughput" and result["transport"] == transport


@pytest.mark.parametrize("scheme", NETWORK)
async def test_received_memory_counts_against_the_session_quota(
    scheme: str, request: pytest.FixtureRequest
) -> None:
    """After the hello, a frame whose buffers would take the session past its memory quota
    ends that connection as soon as its header announces them, before any is allocated;
    within the quota, uploads go on as before."""
    if scheme == "tls":
        request.getfixturevalue("tls_files")
    quota = 1 << 20
    proxy = gpuremote.Proxy("numpy", session_limits=SessionLimits(max_device_bytes=quota))
    url = await proxy.start(f"{scheme}://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as good:
            await _served(good, 1000)  # 8 KB up: within its quota
            for announced in (GIB, 2 * quota):
                peer = await open_peer(url)
                (greeting,) = iter_frames(await peer.recv())
                await peer.send(_hello("", decode_greeting(greeting)["nonce"]))
                await peer.recv()
                await peer.send(_header(16, [announced]))
                assert await peer.cut_off(), f"{announced} bytes announced: still connected"
                peer.close()
            await _served(good, 1000)
    finally:
        await proxy.close()
