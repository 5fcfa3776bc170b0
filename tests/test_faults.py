"""Faults a careful reader found: each test failed (or was missing) before its fix."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpuremote.errors import ConnectionClosed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuremote", "serve", "--listen", f"tcp://127.0.0.1:{port}",
         "--backend", "numpy", "--announce", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert "tcp://" in proc.stdout.readline()  # listening
    return proc


@pytest.fixture
def proxy_port() -> Iterator[int]:
    port = _free_port()
    procs = [_serve(port)]
    yield port
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.slow
def test_the_default_device_reconnects_after_the_proxy_restarts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gpuremote.xp as xp

    port = _free_port()
    monkeypatch.setenv("GPUREMOTE_URL", f"tcp://127.0.0.1:{port}")
    first = _serve(port)
    second = None
    try:
        xp.set_default_device(None)
        x = xp.asarray(np.ones(4, np.float32))  # the default device, from GPUREMOTE_URL
        assert float(x[0]) == 1.0
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = _serve(port)  # the proxy is back, at the same address
        with pytest.raises(ConnectionClosed):  # the old session is gone: said once ...
            float(x[0])
        y = xp.asarray(np.full(4, 2.0, np.float32))  # ... and the default device reconnects
        assert float(y[1]) == 2.0
        assert xp.default_device() is y.device and y.device is not x.device
    finally:
        d = xp.default_device() if second is not None and second.poll() is None else None
        if d is not None:
            d.close()
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


_SCRIPT_ASYNC = """
import asyncio, sys
import numpy as np
import gpuremote

async def main():
    gpu = await gpuremote.connect(sys.argv[1])
    a = gpu.asarray(np.ones(16, np.float32))
    b = a + 1.0
    assert (await b.get())[0] == 2.0
    return a, b, gpu  # live arrays, no aclose()

kept = gpuremote.run(main())
"""

_SCRIPT_XP = """
import sys
import numpy as np
import gpuremote.xp as xp

xp.connect(sys.argv[1])
x = xp.asarray(np.ones(16, np.float32))
ys = [x + i for i in range(50)]  # live arrays, posted work, no close()
assert float(ys[3][0]) == 4.0
"""

_SCRIPT_INPROC = """
import asyncio
import numpy as np
import gpuremote
from gpuremote.proxy import Proxy

async def main():
    proxy = Proxy("numpy")
    gpu = await gpuremote.connect(await proxy.start("inproc://exit"))
    a = gpu.asarray(np.ones(16, np.float32))
    assert (await (a * 3.0).get())[0] == 3.0
    return a, gpu, proxy  # nothing closed

kept = asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("script", ["async", "xp", "inproc"])
def test_a_script_ending_with_live_arrays_exits_silently(
    script: str, proxy_port: int, tmp_path: Path
) -> None:
    source = {"async": _SCRIPT_ASYNC, "xp": _SCRIPT_XP, "inproc": _SCRIPT_INPROC}[script]
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if k != "GPUREMOTE_URL"}
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(path), f"tcp://127.0.0.1:{proxy_port}"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr  # no "Event loop is closed", no traceback
    assert time.monotonic() - t0 < 30


# -- untested before ------------------------------------------------------------------------
async def test_a_freed_array_refuses_every_use_and_a_double_free_is_harmless() -> None:
    import gpuremote
    from gpuremote.errors import LocalProtocolError
    from gpuremote.proxy import Proxy

    proxy = Proxy("numpy")
    url = await proxy.start("inproc://freed")
    try:
        async with gpuremote.connect(url) as gpu:
            a = gpu.asarray(np.ones(8, np.float32))
            a.free()
            a.free()  # again: nothing more is sent, nothing fails
            for use in (a.get(), a.write(np.ones(8, np.float32))):
                with pytest.raises(LocalProtocolError, match="used after free"):
                    await use
            with pytest.raises(LocalProtocolError, match="used after free"):
                a.set(np.ones(8, np.float32))
            with pytest.raises(LocalProtocolError, match="used after free"):
                a + 1.0
            await gpu.synchronize()  # no deferred error from the second free
            assert (await gpu.proxy_stats())["buffers"] == 0
    finally:
        await proxy.close()


async def test_the_client_refuses_an_unsupported_dtype() -> None:
    import gpuremote
    from gpuremote.proxy import Proxy

    proxy = Proxy("numpy")
    url = await proxy.start("inproc://dtypes")
    try:
        async with gpuremote.connect(url) as gpu:
            for bad in (np.array(["text"]), np.array([object()]), np.zeros(2, "datetime64[s]")):
                with pytest.raises(TypeError, match="not supported by gpuremote"):
                    gpu.asarray(bad)
            with pytest.raises(TypeError, match="not supported by gpuremote"):
                gpu.empty(4, "U3")
            assert gpu.stats()["calls"]["async"] == 0  # nothing was sent
    finally:
        await proxy.close()


def test_the_memory_quota_covers_launch_new_and_launch_dynamic() -> None:
    from gpuremote.backends import NumpyBackend
    from gpuremote.proxy.executor import Executor, SessionLimits
    from gpuremote.wire.calls import CALLS_BY_NAME
    from gpuremote.wire.framing import Frame
    from gpuremote.wire.protocol import decode_request, encode_request

    ex = Executor(NumpyBackend(), SessionLimits(max_device_bytes=100))
    op = {n: CALLS_BY_NAME[n].opcode for n in ("alloc", "memset", "launch_new", "launch_dynamic")}
    arrays = [[1, 0, [16], "float32"], [2, 0, [16], "float32"]]

    def run(*cmds: list[object]) -> list[object]:
        frame = encode_request([list(c) for c in cmds], [], arrays)
        return ex.execute(decode_request(Frame(frame.meta, frame.buffers)), [])[0]

    sync = CALLS_BY_NAME["device_synchronize"].opcode
    assert (
        run([1, op["alloc"], 0, [1, 64], False], [2, op["memset"], 0, [1, 0, 64, 1], False]) == []
    )
    (reply,) = run(
        [3, op["launch_new"], 0, ["add", [0, 0], [1], {}], False], [4, sync, 0, [], False]
    )
    assert not reply.ok and "its limit is 100" in reply.value.message  # 64 + 64 > 100
    (reply,) = run([5, op["launch_dynamic"], 0, ["nonzero", [0], [3], {}], False])
    assert not reply.ok and "its limit is 100" in reply.value.message  # 16 int64 indices
    assert ex.device_bytes == 64 and set(ex.buffers) == {1}


async def test_a_frame_cut_halfway_to_the_proxy_frees_what_it_received() -> None:
    import asyncio

    from gpuremote.transports import Address

    import gpuremote
    from gpuremote.proxy import Proxy
    from gpuremote.wire.framing import HEADER, MAGIC, VERSION

    proxy = Proxy("numpy")
    url = await proxy.start("tcp://127.0.0.1:0")
    try:
        a = Address.parse(url)
        reader, writer = await asyncio.open_connection(a.host, a.port)
        await reader.read(1)
        # a frame announcing 8 MiB of upload, cut after 1 MiB of it, then the connection ends
        meta = b"\x91\x01"
        head = HEADER.pack(MAGIC, VERSION, 0, len(meta), 1) + (8 << 20).to_bytes(8, "little")
        writer.write(head + meta + bytes(1 << 20))
        await writer.drain()
        writer.close()
        for _ in range(500):
            if not proxy.clients:
                break
            await asyncio.sleep(0.01)
        assert proxy.clients == {}  # the session (and the half-received buffer) is gone
        async with gpuremote.connect(url) as gpu:  # the proxy goes on serving
            assert (await (gpu.asarray(np.ones(4, np.float32)) + 1.0).get())[0] == 2.0
    finally:
        await proxy.close()


async def test_a_reply_cut_halfway_to_the_client_fails_its_call() -> None:
    import asyncio

    import gpuremote
    from gpuremote.wire.framing import HEADER, MAGIC, VERSION, encode_frame
    from gpuremote.wire.protocol import encode_greeting

    async def half_proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        greeting = encode_greeting(1, False, b"n" * 16)
        writer.write(b"".join(bytes(p) for p in encode_frame(greeting)))
        await reader.read(65536)  # the hello
        head = HEADER.pack(MAGIC, VERSION, 0, 10, 1) + (1 << 20).to_bytes(8, "little")
        writer.write(head + b"\x00" * 1000)  # a reply cut short, then the end
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(half_proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises((ConnectionClosed, gpuremote.ProtocolError)):
            await asyncio.wait_for(gpuremote.connect(f"tcp://127.0.0.1:{port}"), 10)
    finally:
        server.close()
