"""The floor of a remoted op in Python (issue #41): what the xp synchronous op
``float(xp.sum(x + 1.0))`` on 16 floats costs when a client and a proxy in one process do only
the work that cannot be left out, beside NumPy doing it locally and gpuremote doing it.

The skeleton sends the same frame gpuremote sends (``[REQUEST, arrays, commands, 0]``: the
array table, two ``launch_new``, the ``free_buffers`` of the last op's temporaries and the
``copy_d2h``, msgpack by msgspec), the proxy decodes it, allocates the new outputs, runs the
same NumPy calls on them, frees, and answers with the read's bytes out of band; the client
shadows shape and dtype, frees temporaries when they die and reads the float from the reply.
It checks nothing, has no streams, no deferred errors, no event loop, no transport and no
accounting: everything gpuremote does beyond it is the cost of those.

    python scripts/floor_xp_op.py [--rounds 7] [--number 2000] [--json]

Also the async API's ``await (a + a).get()`` (a ``Proxy("numpy")`` on ``inproc://`` in this
process) beside NumPy's ``a + a``: issue #41's two programs in one run; and the skeleton's
floor for that op (``skeleton_add``: one launch and the read of its 16 floats, no event loop).

Reports medians of ``--rounds`` batches of ``--number`` ops (microseconds per op) and the
Python calls per op from cProfile, for each, measured in the same run; and with
``--layers``, where gpuremote's time goes, by layer, timed directly (the layers' entry points
wrapped in clocks for that run: that needs the hot modules' Python source, an editable
install's). Where the install compiled the hot modules (a wheel: ``scripts/compiled.sh``), they
run compiled: ``build`` in the output says which ran (cProfile counts no calls inside compiled
code: compare calls in pure Python).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
from gpuremote.bench.calls import count_calls

import gpuremote.xp as gx
from gpuremote import _build

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode
REQUEST, REPLY = 1, 2
LAUNCH_NEW, FREE_BUFFERS, COPY_D2H = 24, 16, 13  # gpuremote's opcodes, for the same bytes


class Proxy:
    """Buffers by handle; one frame in, one reply (metadata, out-of-band buffers) out."""

    def __init__(self) -> None:
        self.buffers: dict[int, np.ndarray[Any, Any]] = {}

    def on_frame(self, meta: bytes) -> tuple[bytes, list[memoryview]]:
        _, table, commands, _ = _decode(meta)
        buffers = self.buffers
        replies: list[list[Any]] = []
        data: list[memoryview] = []
        for seq, opcode, _stream, args, _ack in commands:
            if opcode == LAUNCH_NEW:
                op, ins, outs, params = args
                for i in outs:
                    handle, _offset, shape, dtype = table[i]
                    buffers[handle] = np.empty(shape, dtype)
                a = [buffers[table[i][0]] for i in ins]
                o = [buffers[table[i][0]] for i in outs]
                if op == "add":
                    np.add(a[0], a[1] if len(a) > 1 else params["scalar"], out=o[0])
                else:
                    np.add.reduce(a[0], axis=None, out=o[0])
            elif opcode == FREE_BUFFERS:
                for handle in args[0]:
                    del buffers[handle]
            elif opcode == COPY_D2H:
                data.append(buffers[table[args[0]][0]].data.cast("B"))
                replies.append([seq, 0, len(data) - 1])
        return _encode([REPLY, replies]), data


class Array:
    """The client's shadow of a device array: its handle, shape and dtype."""

    __slots__ = ("client", "dtype", "handle", "shape")

    def __init__(self, client: Client, shape: tuple[int, ...], dtype: str) -> None:
        client.handles += 1
        self.client, self.handle, self.shape, self.dtype = client, client.handles, shape, dtype

    def __del__(self) -> None:
        self.client.frees.append(self.handle)


class Client:
    """Queues launches, sends them with the read that needs an answer."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.handles = self.seq = 0
        self.frees: list[int] = []
        self.commands: list[list[Any]] = []
        self.table: list[list[Any]] = []
        self.index: dict[int, int] = {}

    def _intern(self, a: Array) -> int:
        i = self.index.get(a.handle)
        if i is None:
            i = self.index[a.handle] = len(self.table)
            self.table.append([a.handle, 0, list(a.shape), a.dtype])
        return i

    def _launch(self, op: str, x: Array, out: Array, params: dict[str, Any], *more: Array) -> Array:
        self.seq += 1
        args = [op, [self._intern(a) for a in (x, *more)], [self._intern(out)], params]
        self.commands.append([self.seq, LAUNCH_NEW, 0, args, False])
        return out

    def add(self, x: Array, scalar: float) -> Array:
        return self._launch("add", x, Array(self, x.shape, x.dtype), {"scalar": scalar})

    def add_arrays(self, x: Array, y: Array) -> Array:
        return self._launch("add", x, Array(self, x.shape, x.dtype), {}, y)

    def sum(self, x: Array) -> Array:
        params = {"axis": None, "keepdims": False, "dtype": None}
        return self._launch("sum", x, Array(self, (), x.dtype), params)

    def read(self, x: Array) -> float:
        return float(np.frombuffer(self._read(x), x.dtype)[0])

    def read_array(self, x: Array) -> np.ndarray[Any, Any]:
        return np.frombuffer(self._read(x), x.dtype).reshape(x.shape)

    def _read(self, x: Array) -> memoryview:
        if self.frees:
            self.seq += 1
            self.commands.append([self.seq, FREE_BUFFERS, 0, [self.frees], False])
            self.frees = []
        self.seq += 1
        self.commands.append([self.seq, COPY_D2H, 0, [self._intern(x)], False])
        frame = _encode([REQUEST, self.table, self.commands, 0])
        self.commands, self.table, self.index = [], [], {}
        meta, data = self.proxy.on_frame(frame)
        (_seq, _status, i), *_ = _decode(meta)[1]
        return data[i]


def _per_op_us(fn: Callable[[], Any], rounds: int, number: int) -> float:
    for _ in range(number // 4):
        fn()
    return statistics.median(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e6


def _calls_per_op(fn: Callable[[], Any], n: int = 500) -> float:
    return count_calls(fn, n)["python_calls_per_op"]


def _layers(host: np.ndarray[Any, Any], n: int = 20_000) -> dict[str, float]:
    """Microseconds per op by layer, timed directly: the layers' entry points are wrapped,
    for the run only (on a device connected after, as the connection keeps bound methods),
    in clocks that count the outermost call of each; nested layers are taken out of their
    callers'. The clocks cost ~1 µs each: the total, as timed with them, is that much above
    the op's time measured without."""
    if _build.build() == "compiled":
        raise SystemExit("--layers times the hot modules' Python source: an editable install")
    from gpuremote.transports.inproc import InprocConnection

    from gpuremote.backends.numpy_backend import NumpyBackend
    from gpuremote.proxy import executor, session
    from gpuremote.session.pipeline import ClientSession

    entries = {
        "send": (InprocConnection, "send"),
        "proxy": (session.ProxySession, "on_frame"),
        "decode": (session, "decode_batch"),
        "execute": (executor.Executor, "execute"),
        "backend": (NumpyBackend, "run_op"),
        "reply": (session.ProxySession, "deliver"),
        "receive": (ClientSession, "_on_frame"),
    }
    spent = dict.fromkeys(entries, 0)
    depth = dict.fromkeys(entries, 0)
    clock = time.perf_counter_ns

    def timed(label: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            depth[label] += 1
            t = clock()
            try:
                return f(*args, **kwargs)
            finally:
                depth[label] -= 1
                if not depth[label]:
                    spent[label] += clock() - t

        return run

    saved = {label: vars(owner)[name] for label, (owner, name) in entries.items()}
    for label, (owner, name) in entries.items():
        setattr(owner, name, timed(label, saved[label]))
    try:
        device = gx.connect_local("numpy")
        try:
            x = gx.asarray(host, device=device)
            for _ in range(n // 10):  # caches warm
                float(gx.sum(x + 1.0))
            spent.update(dict.fromkeys(entries, 0))
            t = clock()
            for _ in range(n):
                float(gx.sum(x + 1.0))
            total = clock() - t
        finally:
            device.close()
    finally:
        for label, (owner, name) in entries.items():
            setattr(owner, name, saved[label])
    us = {k: v / n / 1000 for k, v in spent.items()}
    decode = us["decode"]
    return {
        "total, as timed (with the wrappers)": total / n / 1000,
        "client: front end, array core, pipeline, driver": total / n / 1000 - us["send"],
        "transport (inproc://), framing": us["send"] - us["proxy"] - us["receive"],
        "proxy: decode and check the request": decode,
        "proxy: run the commands (executor, state, handlers)": us["execute"] - us["backend"],
        "proxy: the backend's ops (NumPy)": us["backend"],
        "proxy: encode and send the reply": us["reply"],
        "proxy: session, scheduler, device queue": us["proxy"]
        - decode
        - us["execute"]
        - us["reply"],
        "client: receive and decode the reply": us["receive"],
    }


def _async_op(host: np.ndarray[Any, Any], rounds: int, number: int) -> dict[str, float]:
    """The async API's ``await (a + a).get()`` against a ``Proxy("numpy")`` served on
    ``inproc://`` in this process (asyncio's own loop, as the call-count test runs it): the
    median of ``rounds`` batches of ``number`` ops, and its Python calls per op."""
    import asyncio

    from gpuremote.bench.calls import count_calls_async

    import gpuremote
    from gpuremote.proxy import Proxy as RealProxy

    async def run() -> dict[str, float]:
        proxy = RealProxy("numpy")
        url = await proxy.start("inproc://floor-async")
        try:
            async with gpuremote.connect(url) as gpu:
                a = gpu.asarray(host)

                async def op() -> Any:
                    return await (a + a).get()

                assert np.array_equal(await op(), host + host), "the async op is wrong"
                times = []
                for _ in range(number // 4):
                    await op()
                for _ in range(rounds):
                    t = time.perf_counter()
                    for _ in range(number):
                        await op()
                    times.append((time.perf_counter() - t) / number * 1e6)
                counted = await count_calls_async(op, 500)
                return {
                    "us_per_op": statistics.median(times),
                    "python_calls_per_op": counted["python_calls_per_op"],
                }
        finally:
            await proxy.close()

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", action="store_true", help="gpuremote's time by layer")
    a = parser.parse_args()

    host = np.arange(16, dtype=np.float32)
    client = Client(Proxy())
    x = Array(client, (16,), "float32")
    client.proxy.buffers[x.handle] = host.copy()
    device = gx.connect_local("numpy")
    remote = gx.asarray(host, device=device)
    cases: dict[str, Callable[[], Any]] = {
        "numpy": lambda: float(np.sum(host + 1.0)),
        "skeleton": lambda: client.read(client.sum(client.add(x, 1.0))),
        "gpuremote_xp": lambda: float(gx.sum(remote + 1.0)),
    }
    assert len({f() for f in cases.values()}) == 1, "the three do not agree"
    layers: dict[str, float] = {}
    try:
        out: dict[str, dict[str, float]] = {}
        for name, fn in cases.items():
            out[name] = {
                "us_per_op": _per_op_us(fn, a.rounds, a.number),
                "python_calls_per_op": _calls_per_op(fn),
            }
    finally:
        device.close()
    # the async API's op, beside NumPy's same op (its reference, not the xp op's) and the
    # skeleton's floor for it (no event loop: a floor of that too)
    add_cases: dict[str, Callable[[], Any]] = {
        "numpy_add": lambda: host + host,
        "skeleton_add": lambda: client.read_array(client.add_arrays(x, x)),
    }
    assert np.array_equal(add_cases["skeleton_add"](), host + host), "the skeleton's add is wrong"
    for name, fn in add_cases.items():
        out[name] = {
            "us_per_op": _per_op_us(fn, a.rounds, a.number),
            "python_calls_per_op": _calls_per_op(fn),
        }
    out["gpuremote_async"] = _async_op(host, a.rounds, a.number)
    if a.layers:
        layers = _layers(host, 5 * a.number)
    for name, row in out.items():
        base = "numpy_add" if name in ("numpy_add", "skeleton_add", "gpuremote_async") else "numpy"
        row["x_numpy"] = row["us_per_op"] / out[base]["us_per_op"]
    build = _build.build()
    if a.json:
        doc: dict[str, Any] = {**out, "build": build}
        if a.layers:
            doc["layers_us"] = layers
        print(json.dumps(doc, indent=2))
        return
    print(f"gpuremote's hot modules: {build}")
    for name, row in out.items():
        print(
            f"{name:16} {row['us_per_op']:8.1f} µs/op {row['x_numpy']:6.1f}x NumPy "
            f"{row['python_calls_per_op']:6.0f} Python calls/op"
        )
    if a.layers:
        print("gpuremote's op by layer (µs per op):")
        for name, us in layers.items():
            print(f"  {us:6.1f}  {name}")


if __name__ == "__main__":
    main()
