"""Reliability and security: authentication, TLS, isolation and quotas, hostile input, faults."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import trustme
from gpuremote.transports import connect as transport_connect
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuremote
from gpuremote.backends import NumpyBackend
from gpuremote.config import transport_settings
from gpuremote.errors import AuthenticationError, ConnectionClosed, RemoteCallError
from gpuremote.proxy.executor import Executor, SessionLimits
from gpuremote.tools.proxyprocess import LocalProxy
from gpuremote.wire.calls import CALLS, CALLS_BY_NAME, CallClass
from gpuremote.wire.framing import Frame
from gpuremote.wire.protocol import (
    PROTOCOL_VERSION,
    REPLY,
    STATUS_ERROR,
    BadCommandAt,
    decode_message,
    decode_request,
    encode_request,
)

if TYPE_CHECKING:
    from conftest import Cli


SECRET = b"correct horse battery staple"


needs_ucx = pytest.mark.ucx  # skipped where ucxx is missing (conftest.py)
#: the transports that cross a network: every hostile-input test runs over each
NETWORK = ["tcp", "tls", pytest.param("ucx", marks=needs_ucx)]


@pytest.fixture(params=["inproc", *NETWORK])
def any_scheme(request: pytest.FixtureRequest) -> str:
    if request.param == "tls":
        request.getfixturevalue("tls_files")  # its certificate, in the config file
    return str(request.param)


@pytest.fixture(params=NETWORK)
def network_scheme(request: pytest.FixtureRequest) -> str:
    if request.param == "tls":
        request.getfixturevalue("tls_files")
    return str(request.param)


async def _raw_connect(url: str) -> Any:
    """A bare connection (past the client: it sends what a test says), on tls:// with the
    config file's CA."""
    settings = transport_settings(url.split(":", 1)[0])
    return await transport_connect(url, settings=settings)


@pytest.fixture
async def secured(any_scheme: str) -> AsyncIterator[str]:
    p = gpuremote.Proxy("numpy", secret=SECRET)
    scheme = any_scheme
    url = await p.start("inproc://secured" if scheme == "inproc" else f"{scheme}://127.0.0.1:0")
    try:
        yield url
    finally:
        await p.close()


# -- authentication ----------------------------------------------------------------------------
async def test_auth_accepted_with_the_secret(secured: str) -> None:
    async with gpuremote.connect(secured, secret=SECRET) as gpu:
        assert (await gpu.asarray(np.ones(3)).get()).tolist() == [1, 1, 1]


async def test_auth_refused_with_a_wrong_or_missing_secret(secured: str) -> None:
    with pytest.raises(AuthenticationError, match="refused"):
        await gpuremote.connect(secured, secret=b"wrong secret")
    with pytest.raises(AuthenticationError, match="requires a shared secret"):
        await gpuremote.connect(secured)


@pytest.mark.slow
async def test_nothing_runs_before_authentication(secured: str) -> None:
    """A client that skips hello and sends work is cut off before anything runs."""
    conn = await _raw_connect(secured)
    await asyncio.wait_for(conn.recv(), 2)  # the greeting
    alloc = next(c for c in CALLS if c.name == "alloc")
    conn.send(encode_request([[1, alloc.opcode, 0, [1, 1 << 20], False]], []))
    fatal = await asyncio.wait_for(conn.recv(), 2)
    assert b"authentication failed" in fatal.meta
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(conn.recv(), 2)


async def test_secret_from_environment_and_file(
    secured: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUREMOTE_SECRET", SECRET.decode())
    async with gpuremote.connect(secured) as gpu:
        await gpu.synchronize()
    monkeypatch.delenv("GPUREMOTE_SECRET")
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    monkeypatch.setenv("GPUREMOTE_SECRET_FILE", str(path))
    async with gpuremote.connect(secured) as gpu:
        await gpu.synchronize()


@pytest.mark.slow
def test_serve_refuses_an_exposed_address_without_a_secret(cli: Cli) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUREMOTE_SECRET")}
    out = cli("serve", "--listen", "tcp://0.0.0.0:0", timeout=30, env=env)
    assert out.returncode == 2 and "without a shared secret" in out.stderr
    with LocalProxy("tcp", "numpy", extra_args=("--insecure",)) as proxy:
        assert proxy.url.startswith("tcp://")


# -- TLS ---------------------------------------------------------------------------------------
async def test_tls_round_trip_with_a_throwaway_certificate(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert_file, key_file, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    ca.cert_pem.write_to_path(str(ca_file))
    proxy = gpuremote.Proxy("numpy")
    url = await proxy.start(f"tls://127.0.0.1:0?cert={cert_file}&key={key_file}")
    try:
        assert url.startswith("tls://")
        async with gpuremote.connect(f"{url}?ca={ca_file}") as gpu:
            data = np.random.default_rng(0).standard_normal(1 << 18)
            x = gpu.empty(data.shape, "float64")
            await x.write(data)
            np.testing.assert_array_equal(await gpu.exp(x).get(), np.exp(data))
        with pytest.raises(ConnectionClosed, match=r"CERTIFICATE_VERIFY_FAILED|certificate"):
            await gpuremote.connect(url)  # the system trust store does not know this CA
    finally:
        await proxy.close()


# -- isolation and quotas ----------------------------------------------------------------------
async def test_quota_errors_and_one_client_at_its_limit_does_not_hurt_another() -> None:
    proxy = gpuremote.Proxy(
        "numpy", session_limits=SessionLimits(max_device_bytes=1 << 20, max_handles=50)
    )
    url = await proxy.start("tcp://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as greedy, gpuremote.connect(url) as polite:
            keep = [greedy.empty(1 << 19, "uint8") for _ in range(2)]
            greedy.empty(1, "uint8")  # over the memory quota
            with pytest.raises(RemoteCallError, match="its limit is 1048576"):
                await greedy.synchronize()
            for a in keep:
                a.free()
            many = [greedy.empty(1, "uint8") for _ in range(60)]
            with pytest.raises(RemoteCallError, match="handles; the limit is 50"):
                await greedy.synchronize()
            x = polite.asarray(np.arange(1000, dtype=np.float64))
            np.testing.assert_array_equal(
                await polite.multiply(x, 2.0).get(), 2 * np.arange(1000, dtype=np.float64)
            )
            assert (await polite.proxy_stats())["device_bytes"] == 8000  # x; the product is freed
            del many
    finally:
        await proxy.close()


async def test_oversized_frame_closes_only_that_connection(network_scheme: str) -> None:
    limits = gpuremote.wire.framing.FrameLimits(max_frame_bytes=1 << 20)
    proxy = gpuremote.Proxy("numpy", limits=limits)
    url = await proxy.start(f"{network_scheme}://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as good:
            bad = await gpuremote.connect(url)
            big = bad.empty(2 << 20, "uint8")
            with pytest.raises((ConnectionClosed, gpuremote.ProtocolError)):
                await big.write(np.zeros(2 << 20, np.uint8))  # 2 MiB frame: over the limit
            np.testing.assert_array_equal(await good.asarray(np.ones(2)).get(), np.ones(2))
            await bad.aclose()
    finally:
        await proxy.close()


async def test_another_sessions_handles_are_out_of_reach(network_scheme: str) -> None:
    """Handles are scoped to their session: one client naming the handles another uses
    reaches only its own (none), and the other's data stays as it was."""
    proxy = gpuremote.Proxy("numpy")
    url = await proxy.start(f"{network_scheme}://127.0.0.1:0")
    try:
        async with gpuremote.connect(url) as owner:
            secret = owner.asarray(np.arange(64, dtype=np.float64))
            await owner.synchronize()
            conn = await _raw_connect(url)  # a hostile peer: it names handles itself
            by_name = {c.name: c for c in CALLS}
            await asyncio.wait_for(conn.recv(), 5)  # the greeting
            hello = [1, by_name["hello"].opcode, 0, [PROTOCOL_VERSION, ""], False]
            conn.send(encode_request([hello], []))
            await asyncio.wait_for(conn.recv(), 5)
            desc = [[secret.handle, 0, [64], "float64"]]
            read = [2, by_name["copy_d2h"].opcode, 0, [0], False]
            free = [3, by_name["free"].opcode, 0, [secret.handle], False]
            sync = [4, by_name["device_synchronize"].opcode, 0, [], False]
            conn.send(encode_request([read, free, sync], [], desc))
            msg = decode_message(await asyncio.wait_for(conn.recv(), 5))
            assert msg[0] == REPLY and all(status == STATUS_ERROR for _, status, _ in msg[1])
            assert "handle" in str(msg[1][0][2]), msg
            conn.close()
            np.testing.assert_array_equal(await secret.get(), np.arange(64, dtype=np.float64))
    finally:
        await proxy.close()


# -- hostile input -----------------------------------------------------------------------------
WIRE = [c for c in CALLS if c.klass is not CallClass.LOCAL]
hostile_values = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.booleans(),
    st.none(),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.lists(st.integers(-5, 1 << 40), max_size=40),
    st.sampled_from(
        [
            "add",
            "matmul",
            "exp",
            "fill",
            "transpose",
            "softmax",
            "os.system",
            "getitem",
            "setitem",
            "full",
            "nonzero",
            "unique_all",
            "repeat_array",
            "linalg.svd",
            "concat",
        ]
    ),
)
descriptors = st.one_of(
    st.tuples(
        st.integers(0, 6),
        st.integers(-2, 1 << 20),
        st.lists(st.integers(-1, 1 << 31), max_size=40),
        st.sampled_from(["float32", "int8", "bool", "object", "complex128", 7]),
    ).map(list),
    hostile_values,
)


@st.composite
def hostile_batches(draw: Any) -> tuple[list[Any], list[Any], list[memoryview]]:
    arrays = draw(st.lists(descriptors, max_size=4))
    cmds = []
    for seq in range(draw(st.integers(1, 8))):
        spec = draw(st.sampled_from(WIRE))
        args: list[Any] = []
        for kind in (p.kind for p in spec.args):
            if kind.value == "array":
                args.append(draw(st.one_of(st.integers(-1, 5), hostile_values)))
            elif kind.value == "arrays":
                args.append(draw(st.lists(st.integers(-1, 5), max_size=4)))
            elif kind.value == "params":
                args.append(draw(st.dictionaries(st.text(max_size=6), hostile_values, max_size=4)))
            else:
                args.append(draw(hostile_values))
        if draw(st.booleans()):
            args = args[: draw(st.integers(0, len(args)))]  # wrong arity too
        cmds.append([seq, spec.opcode, draw(st.integers(0, 3)), args, draw(st.booleans())])
    bufs = [memoryview(draw(st.binary(max_size=64))) for _ in range(draw(st.integers(0, 2)))]
    return arrays, cmds, bufs


@given(st.lists(hostile_batches(), min_size=1, max_size=4))
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_fuzz_the_session_with_hostile_but_well_formed_frames(batches: list[Any]) -> None:
    limit = 8 << 20
    ex = Executor(NumpyBackend(), SessionLimits(max_device_bytes=limit, max_handles=64))
    for arrays, cmds, bufs in batches:
        frame = encode_request(cmds, bufs, arrays)
        try:
            decoded = decode_request(Frame(frame.meta, list(frame.buffers)))
        except gpuremote.ProtocolError:
            continue  # the proxy would close this one connection
        failed = ex.failed
        replies, _ = ex.execute(decoded, frame.buffers)  # never raises
        assert ex.device_bytes <= limit
        assert len(ex.buffers) + len(ex.streams) + len(ex.events) + len(ex.kernels) <= 65
        bad = [c for c in decoded if isinstance(c, BadCommandAt)]
        assert ex.failed >= failed + len(bad)
        # a bad call that waits is answered at once; a bad ASYNC one as any failed ASYNC
        # call is, at the next call that waits (or it is still pending)
        waits = {c.seq for c in bad if c.call not in CALLS_BY_NAME or CALLS_BY_NAME[c.call].sync}
        assert waits <= {r.seq for r in replies}
        if len(waits) < len(bad):
            deferred = [r for r in replies if not r.ok and r.value.deferred]
            assert ex.pending or deferred
    ex.close()
    assert ex.device_bytes == 0


# -- faults ------------------------------------------------------------------------------------
CLIENT = textwrap.dedent("""
    import asyncio, sys, numpy as np, gpuremote
    async def main():
        gpu = await gpuremote.connect(sys.argv[1])
        arrays = [gpu.asarray(np.ones(1 << 18)) for _ in range(4)]
        await gpu.synchronize()
        for a in arrays:
            for _ in range(50):
                gpu.exp(a)       # a batch in flight when we are killed
        print("ready", flush=True)
        await asyncio.sleep(60)
    asyncio.run(main())
""")


@pytest.mark.slow
async def test_killed_client_leaves_nothing_behind() -> None:
    proxy = gpuremote.Proxy("numpy")
    url = await proxy.start("tcp://127.0.0.1:0")
    try:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CLIENT, url, stdout=asyncio.subprocess.PIPE
        )
        assert child.stdout is not None
        assert (await asyncio.wait_for(child.stdout.readline(), 30)).strip() == b"ready"
        assert proxy.stats()["device_bytes"] >= 4 * 8 * (1 << 18)
        child.kill()
        await child.wait()
        for _ in range(200):
            if proxy.stats()["sessions"] == 0:
                break
            await asyncio.sleep(0.02)
        stats = proxy.stats()
        assert (stats["sessions"], stats["buffers"], stats["device_bytes"]) == (0, 0, 0)
    finally:
        await proxy.close()


@pytest.mark.slow
async def test_killed_proxy_fails_pending_calls_within_the_timeout() -> None:
    local = LocalProxy("tcp", "numpy")
    url = local.start()
    gpu = await gpuremote.connect(url, call_timeout_s=2.0)
    await gpu.synchronize()
    assert local.proc is not None
    local.proc.send_signal(signal.SIGSTOP)  # gone without closing its sockets
    try:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ConnectionClosed, match=r"within 2\.0 s"):
            await gpu.synchronize()
        assert asyncio.get_running_loop().time() - t0 < 4
        with pytest.raises(ConnectionClosed):
            await gpu.synchronize()  # the session is over, at once
    finally:
        local.proc.send_signal(signal.SIGCONT)
        local.proc.kill()
        local.stop()
        await gpu.aclose()
    gpu2 = await gpuremote.connect((local2 := LocalProxy("tcp", "numpy")).start())
    try:
        pending = asyncio.ensure_future(gpu2.ping(b"x" * 10))
        assert local2.proc is not None
        local2.proc.kill()  # killed outright: its sockets are reset
        with pytest.raises(ConnectionClosed):
            for _ in range(100):
                await asyncio.wait_for(gpu2.ping(b"y"), 2)
        pending.cancel()
    finally:
        local2.stop()
        await gpu2.aclose()


@pytest.mark.slow
async def test_a_client_that_stops_reading_gets_backpressure() -> None:
    proxy = gpuremote.Proxy("numpy")
    url = await proxy.start("tcp://127.0.0.1:0")
    try:
        conn = await transport_connect(url)
        await asyncio.wait_for(conn.recv(), 2)  # greeting
        by_name = {c.name: c for c in CALLS}
        conn.send(
            encode_request([[0, by_name["hello"].opcode, 0, [PROTOCOL_VERSION, ""], False]], [])
        )
        await asyncio.wait_for(conn.recv(), 2)  # the hello's reply
        conn.pause_reading()  # and never read again
        size = 4 << 20
        conn.send(encode_request([[0, by_name["alloc"].opcode, 0, [1, size], False]], []))
        d2h = by_name["copy_d2h"].opcode
        for seq in range(1, 101):  # 100 downloads of 4 MiB = 400 MiB requested
            conn.send(encode_request([[seq, d2h, 0, [0], False]], [], [[1, 0, [size], "uint8"]]))
        await asyncio.sleep(1.0)
        (client,) = proxy.clients.values()
        assert client.figures.frames_in < 20  # it stopped taking commands...
        assert client.conn.pending_bytes <= 2 * size  # ...instead of buffering 400 MiB
        conn.close()
    finally:
        await proxy.close()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", pytest.param("ucx", marks=needs_ucx)])
def test_sigterm_finishes_in_flight_work_tells_clients_and_exits_0(transport: str) -> None:
    script = textwrap.dedent("""
        import asyncio, json, sys, numpy as np, gpuremote
        async def main():
            async with gpuremote.connect(sys.argv[1]) as gpu:
                x = gpu.asarray(np.ones(1 << 20))
                for _ in range(30):
                    x = gpu.tanh(gpu.multiply(x, 0.5))
                pending = asyncio.ensure_future(x.get())
                await asyncio.sleep(0)           # the batch is on its way...
                print("sent", flush=True)
                sys.stdin.readline()             # ...when the proxy gets SIGTERM
                value = await pending
                await asyncio.sleep(0.3)
                notices = list(gpu._session.notices)
                try:
                    await gpu.synchronize()
                    after = "ok"
                except gpuremote.ConnectionClosed as exc:
                    after = str(exc)
                print(json.dumps({"value": float(value[0]), "notices": notices,
                                  "after": after}), flush=True)
        asyncio.run(main())
    """)
    with LocalProxy(transport, "numpy") as proxy:
        child = subprocess.Popen(
            [sys.executable, "-c", script, proxy.url],
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "sent"
        assert proxy.proc is not None
        proxy.proc.send_signal(signal.SIGTERM)
        child.stdin.write("\n")
        child.stdin.flush()
        out = json.loads(child.stdout.readline())
        assert proxy.proc.wait(15) == 0
        child.wait(15)
    expected = 1.0
    for _ in range(30):
        expected = float(np.tanh(np.float64(expected) * 0.5))
    assert out["value"] == pytest.approx(expected)
    assert ["shutdown", None] in out["notices"]
    assert "shutting down" in out["after"] or "shut down" in out["after"]


@pytest.mark.slow
def test_bench_load_json_schema(cli: Cli) -> None:
    out = cli(
        "bench",
        "load",
        "--clients",
        "4",
        "--ops",
        "200",
        "--backend",
        "numpy",
        "--json",
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["bench"] == "load" and result["clients"] == 4 and result["ops"] == 200
    assert result["errors"] == 0 and result["verified"] == 4
    assert result["calls_per_s"] > 0 and result["p99_us"] > 0
    assert set(result["proxy_rss_mb"]) == {"before", "after"}
    assert result["proxy_rss_mb"]["before"] > 0


@pytest.mark.slow
def test_bench_fuzz_short_run_keeps_the_proxy_serving(cli: Cli, network_scheme: str) -> None:
    out = cli(
        "bench", "fuzz", "--seconds", "1", "--backend", "numpy", "--transport", network_scheme,
        "--json", timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["bench"] == "fuzz" and result["frames"] > 0 and result["after_hello"] > 0
    assert result["control_checks"] > 0 and result["control_failures"] == 0
    assert result["url"].startswith(f"{network_scheme}://") and result["proxy_alive"]


@pytest.mark.slow
async def test_serve_max_frame_bytes_bounds_what_a_client_can_send() -> None:
    with LocalProxy("tcp", "numpy", extra_args=("--max-frame-bytes", str(1 << 20))) as proxy:
        async with gpuremote.connect(proxy.url) as good:
            bad = await gpuremote.connect(proxy.url)
            x = bad.empty(2 << 20, "uint8")
            with pytest.raises((ConnectionClosed, gpuremote.ProtocolError)):
                await x.write(np.zeros(2 << 20, np.uint8))
            await bad.aclose()
            np.testing.assert_array_equal(await good.asarray(np.ones(3)).get(), np.ones(3))
