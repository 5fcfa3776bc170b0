"""The executor on its own: no transport, no client; commands in, replies out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpuremote.backends import get_backend
from gpuremote.backends.base import buffer_owner
from gpuremote.proxy.executor import Executor, SessionLimits
from gpuremote.wire.calls import CALLS_BY_NAME
from gpuremote.wire.framing import DEVICE_DIRECT_MIN, Frame, byte_view
from gpuremote.wire.protocol import Reply, decode_request, encode_request


class Driver:
    """Builds request frames the way the client does, and runs them through an executor
    (on the backend the ``backend`` fixture chose)."""

    backend = "numpy"

    def __init__(self, **limits: Any) -> None:
        self.ex = Executor(get_backend(self.backend), SessionLimits(**limits))
        self.seq = 0

    def run(
        self,
        *calls: tuple[str, list[Any]] | tuple[str, list[Any], dict[str, Any]],
        buffers: list[bytes] = (),
        received: list[Any] | None = None,
    ) -> tuple[list[Reply], list[memoryview]]:
        """Run ``calls`` as one frame carrying ``buffers`` (as the executor sees them:
        ``received``, where the transport put them somewhere else, such as device memory)."""
        arrays: list[list[Any]] = []
        cmds = []
        for call in calls:
            name, args = call[0], list(call[1])
            opts: dict[str, Any] = call[2] if len(call) > 2 else {}  # type: ignore[misc]
            for i, a in enumerate(args):
                if isinstance(a, Arr):
                    arrays.append(a.wire)
                    args[i] = len(arrays) - 1
                elif isinstance(a, list) and a and isinstance(a[0], Arr):
                    idx = []
                    for x in a:
                        arrays.append(x.wire)
                        idx.append(len(arrays) - 1)
                    args[i] = idx
            self.seq += 1
            cmds.append(
                [
                    self.seq,
                    CALLS_BY_NAME[name].opcode,
                    opts.get("stream", 0),
                    args,
                    opts.get("ack", False),
                ]
            )
        frame = encode_request(cmds, [memoryview(b) for b in buffers], arrays)
        decoded = decode_request(Frame(frame.meta, frame.buffers))
        return self.ex.execute(decoded, frame.buffers if received is None else received)


class Arr:
    def __init__(
        self, handle: int, shape: tuple[int, ...], dtype: str = "float32", offset: int = 0
    ) -> None:
        self.wire = [handle, offset, list(shape), dtype]


@pytest.fixture(autouse=True, params=["numpy", "sim"])
def backend(request: pytest.FixtureRequest) -> Any:
    """Every test runs on NumPy (work done at once) and on the simulated device (work
    queued per stream, done later): what holds on one must hold on the other."""
    Driver.backend = request.param
    yield request.param
    Driver.backend = "numpy"


def f32(*shape: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def test_alloc_upload_launch_download() -> None:
    d = Driver()
    a, b = f32(3, 4), f32(4, 2)
    replies, bufs = d.run(
        ("alloc", [1, a.nbytes]),
        ("alloc", [2, b.nbytes]),
        ("alloc", [3, 24]),
        ("copy_h2d", [Arr(1, (3, 4)), 0]),
        ("copy_h2d", [Arr(2, (4, 2)), 1]),
        ("launch", ["matmul", [Arr(1, (3, 4)), Arr(2, (4, 2))], [Arr(3, (3, 2))], {}]),
        ("copy_d2h", [Arr(3, (3, 2))]),
        buffers=[a.tobytes(), b.tobytes()],
    )
    assert len(replies) == 1 and replies[0].ok
    out = np.frombuffer(bufs[replies[0].value], np.float32).reshape(3, 2)
    np.testing.assert_array_equal(out, a @ b)
    assert d.ex.stats()["device_bytes"] == a.nbytes + b.nbytes + 24


def test_failed_async_call_is_deferred_skips_its_stream_and_clears() -> None:
    d = Driver()
    replies, _ = d.run(
        ("alloc", [1, 16]),
        ("alloc", [2, 16]),
        ("launch", ["matmul", [Arr(1, (2, 2)), Arr(2, (3, 1))], [Arr(1, (2, 2))], {}]),
        ("memset", [1, 0, 16, 7]),  # same stream: skipped
        ("device_synchronize", []),
    )
    (r,) = replies
    assert not r.ok
    err = r.value
    assert err.call == "launch" and err.op == "matmul" and err.deferred and err.skipped == 1
    assert err.seq == 3 and "not aligned" in err.message
    replies, bufs = d.run(("memset", [1, 0, 16, 7]), ("copy_d2h", [Arr(1, (16,), "uint8")]))
    assert replies[0].ok and bytes(bufs[0]) == b"\x07" * 16  # the session goes on


def test_other_streams_keep_running_after_a_failure() -> None:
    d = Driver()
    replies, _ = d.run(
        ("stream_create", [5]),
        ("alloc", [1, 4]),
        ("free", [99]),  # fails on stream 0
        ("memset", [1, 0, 4, 9], {"stream": 5}),
    )
    assert replies == []
    replies, bufs = d.run(
        ("copy_d2h", [Arr(1, (4,), "uint8")]),
        ("copy_d2h", [Arr(1, (4,), "uint8")], {"stream": 5}),  # after stream 5's memset
    )
    assert not replies[0].ok and replies[0].value.call == "free"
    assert replies[1].ok and bytes(bufs[0]) == b"\t" * 4


@pytest.mark.parametrize(
    ("calls", "match"),
    [
        ([("copy_d2h", [Arr(42, (2,))])], "unknown buffer handle 42"),
        ([("alloc", [1, 8]), ("copy_d2h", [Arr(1, (4,))])], "outside buffer"),
        ([("alloc", [1, 8]), ("copy_d2h", [Arr(1, (1,), offset=8)])], "outside buffer"),
        ([("alloc", [1, 8]), ("alloc", [1, 8]), ("device_synchronize", [])], "already in use"),
        ([("event_query", [3])], "unknown event"),
        ([("stream_synchronize", [], {"stream": 77})], "unknown stream"),
        (
            [
                ("alloc", [1, 8]),
                ("launch", ["no_such_op", [], [Arr(1, (2,))], {}]),
                ("device_synchronize", []),
            ],
            "unknown op",
        ),
        (
            [
                ("alloc", [1, 8]),
                ("launch", ["add", [Arr(1, (2,)), Arr(1, (2,))], [Arr(1, (2,), "int32")], {}]),
                ("device_synchronize", []),
            ],
            "writes outputs",
        ),
        ([("alloc", [1, 8]), ("memset", [1, 4, 8, 0]), ("device_synchronize", [])], "outside"),
        (
            [
                ("kernel_create", [1, "raw", "k", "__global__ void k(){}", {}]),
                ("device_synchronize", []),
            ],
            "cupy backend",
        ),
    ],
)
def test_bad_commands_get_clear_errors(calls: list[Any], match: str) -> None:
    replies, _ = Driver().run(*calls)
    assert replies and not replies[-1].ok
    assert match in replies[-1].value.message


def test_quota_on_device_memory_and_handles() -> None:
    d = Driver(max_device_bytes=100, max_handles=3)
    replies, _ = d.run(("alloc", [1, 60]), ("alloc", [2, 60]), ("device_synchronize", []))
    assert "limit is 100" in replies[0].value.message
    assert d.ex.stats()["device_bytes"] == 60
    replies, _ = d.run(("alloc", [3, 1]), ("alloc", [4, 1]), ("device_synchronize", []))
    assert "handles" in replies[0].value.message


def test_full_upload_adopts_the_received_buffer() -> None:
    d = Driver()
    data = np.arange(1024, dtype=np.uint8)
    d.run(
        ("alloc", [1, 1024]), ("copy_h2d", [Arr(1, (1024,), "uint8"), 0]), buffers=[data.tobytes()]
    )
    _, bufs = d.run(("copy_d2h", [Arr(1, (1024,), "uint8")]))
    assert bytes(bufs[0]) == data.tobytes()


def test_reply_buffers_are_copied_when_later_commands_could_change_them() -> None:
    d = Driver()
    d.run(("alloc", [1, 4]), ("memset", [1, 0, 4, 1]))
    _, bufs = d.run(("copy_d2h", [Arr(1, (4,), "uint8")]), ("memset", [1, 0, 4, 2]))
    assert bytes(bufs[0]) == b"\x01" * 4


def test_close_frees_everything() -> None:
    d = Driver()
    d.run(("alloc", [1, 1000]), ("stream_create", [2]), ("event_create", [3]))
    d.ex.close()
    stats = d.ex.stats()
    assert stats["buffers"] == 0 and stats["device_bytes"] == 0 and stats["events"] == 0


def test_ack_replies_to_async_calls() -> None:
    d = Driver()
    replies, _ = d.run(("alloc", [1, 4], {"ack": True}), ("free", [1], {"ack": True}))
    assert [r.ok for r in replies] == [True, True]


def test_events_and_streams() -> None:
    d = Driver()
    replies, _ = d.run(
        ("stream_create", [2]),
        ("event_create", [3]),
        ("event_record", [3], {"stream": 2}),
        ("event_wait", [3]),
        ("stream_synchronize", [], {"stream": 2}),
        ("event_query", [3]),  # complete: the work before it is done
    )
    assert [r.value for r in replies] == [None, True]


def test_command_kinds_are_counted() -> None:
    d = Driver()
    d.run(("alloc", [1, 4]), ("memset", [1, 0, 4, 0]), ("copy_d2h", [Arr(1, (4,), "uint8")]))
    assert d.ex.stats()["calls"] == {"local": 0, "async": 2, "sync": 1}
    assert isinstance(d.ex.stats()["uptime_s"], float)


# -- device memory a transport moves itself (ucx:// to a GPU proxy) ------------------------
@pytest.mark.parametrize("device_io", [True, False])
def test_large_buffers_stay_in_device_memory_where_the_connection_moves_them(
    device_io: bool, device_backend: Any
) -> None:
    dev = device_backend
    d = Driver()
    d.ex = Executor(dev, device_io=device_io)
    n = DEVICE_DIRECT_MIN // 4  # float32: 1 MiB
    host = np.arange(n, dtype=np.float32)
    received = [dev.received(host) if device_io else memoryview(host.tobytes())]
    replies, out = d.run(
        ("alloc", [1, host.nbytes]),
        ("copy_h2d", [Arr(1, (n,)), 0]),
        ("copy_d2h", [Arr(1, (n,))]),
        ("copy_d2h", [Arr(1, (16,))]),  # small: through host memory on any connection
        buffers=[host.tobytes()],
        received=received,
    )
    assert all(r.ok for r in replies), replies
    big, small = out[replies[0].value], out[replies[1].value]
    assert (d.ex.buffers[1] is received[0]) is device_io  # the upload became the buffer
    assert dev.is_device(big) is device_io  # the reply leaves from device memory
    np.testing.assert_array_equal(np.frombuffer(big, np.float32), host)
    assert isinstance(small, memoryview)
    np.testing.assert_array_equal(np.frombuffer(small, np.float32), host[:16])


def test_a_device_upload_into_part_of_a_buffer_is_copied_on_the_device(
    device_backend: Any,
) -> None:
    dev = device_backend
    d = Driver()
    d.ex = Executor(dev, device_io=True)
    n = DEVICE_DIRECT_MIN // 4
    host = np.arange(n, dtype=np.float32)
    received = dev.received(host)
    replies, out = d.run(
        ("alloc", [1, 2 * host.nbytes]),
        ("memset", [1, 0, 2 * host.nbytes, 0]),
        ("copy_h2d", [Arr(1, (n,), offset=host.nbytes), 0]),
        ("copy_d2h", [Arr(1, (2 * n,))]),
        buffers=[host.tobytes()],
        received=[received],
    )
    assert all(r.ok for r in replies), replies
    assert d.ex.buffers[1] is not received
    got = np.frombuffer(out[replies[0].value], np.float32)
    np.testing.assert_array_equal(got, np.concatenate([np.zeros(n, np.float32), host]))


def test_device_io_needs_a_backend_with_device_memory() -> None:
    assert not Executor(get_backend("numpy"), device_io=True).device_io


def test_a_ping_of_device_memory_answers_from_device_memory(device_backend: Any) -> None:
    dev = device_backend
    d = Driver()
    d.ex = Executor(dev, device_io=True)
    payload = np.arange(DEVICE_DIRECT_MIN, dtype=np.uint32).view(np.uint8)[:DEVICE_DIRECT_MIN]
    received = dev.received(payload)
    replies, out = d.run(
        ("ping", [0]), ("device_synchronize", []), buffers=[payload.tobytes()], received=[received]
    )
    echo = out[replies[0].value]
    assert dev.is_device(echo) and echo is not received  # a copy: not the live buffer
    np.testing.assert_array_equal(echo, payload)


class _PinnedStandIn(bytearray):
    """Memory with an owner of its own type, as CuPy's ``PinnedMemoryPointer`` is."""


def test_a_received_buffers_owner_is_found_through_every_memoryview() -> None:
    # as the CuPy backend's host allocator makes a buffer, and the executor then sees it:
    # frombuffer(owner) -> byte_view -> frombuffer -> view(dtype) -> reshape
    owner = _PinnedStandIn(1 << 12)
    received = byte_view(np.frombuffer(owner, np.uint8, len(owner)))
    host = np.frombuffer(received, dtype=np.uint8).view(np.float32).reshape(32, 32)
    assert buffer_owner(host) is owner
    # NumPy 2 keeps a memoryview as frombuffer's base: more than one such link to follow
    links, obj = 0, host
    while isinstance(obj, np.ndarray | memoryview):
        links += isinstance(obj, memoryview)
        obj = obj.base if isinstance(obj, np.ndarray) else obj.obj
    assert links >= 2 and obj is owner
    assert buffer_owner(np.zeros(4)) is not owner
