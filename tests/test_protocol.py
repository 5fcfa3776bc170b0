"""Commands and replies to and from frames: every call of the table, and hostile values."""

from __future__ import annotations

import copy
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuremote.errors import LimitExceeded, RemoteProtocolError
from gpuremote.wire.calls import CALLS, CALLS_BY_NAME, Arg, CallClass
from gpuremote.wire.framing import Frame, FrameLimits, frame_bytes, iter_frames
from gpuremote.wire.protocol import (
    DTYPES,
    REQUEST,
    TENSOR_DTYPES,
    ArrayDesc,
    BadCommand,
    BadCommandAt,
    Command,
    ErrorInfo,
    Reply,
    array_desc,
    check_array,
    decode_batch,
    decode_message,
    decode_replies,
    decode_request,
    encode_fatal,
    encode_replies,
    encode_request,
    request_local_calls,
)

WIRE = [c for c in CALLS if c.klass is not CallClass.LOCAL]

handles = st.integers(0, (1 << 63) - 1)
descs = st.builds(
    lambda h, o, shape, dt: [h, o, shape, dt],
    handles,
    st.integers(0, 1 << 40),
    st.lists(st.integers(0, 64), max_size=4),
    st.sampled_from(sorted(DTYPES)),
)
tensors = st.lists(st.integers(0, 64), max_size=4).flatmap(
    lambda sizes: st.builds(
        lambda h, o, strides, dt: [h, o * TENSOR_DTYPES[dt], sizes, strides, dt],
        handles,
        st.integers(0, 1 << 30),
        st.lists(st.integers(0, 1 << 20), min_size=len(sizes), max_size=len(sizes)),
        st.sampled_from(sorted(TENSOR_DTYPES)),
    )
)
aten_leaves = st.one_of(
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.text(max_size=10),
    st.builds(lambda i: {"t": i}, st.integers(0, 3)),
    st.sampled_from([{"dtype": "float32"}, {"device": 0}, {"mf": "channels_last"}]),
)
aten_values = st.one_of(aten_leaves, st.lists(aten_leaves, max_size=3))
scalars = st.one_of(
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.text(max_size=10),
)


def _value(kind: Arg, draw: Any, arrays: list[list[Any]]) -> Any:
    def intern(d: list[Any]) -> int:
        arrays.append(d)
        return len(arrays) - 1

    if kind in (Arg.HANDLE, Arg.SIZE):
        return draw(st.integers(0, 1 << 62))
    if kind is Arg.HANDLES:
        return draw(st.lists(st.integers(0, 1 << 62), max_size=4))
    if kind is Arg.NAME:
        return draw(st.text(min_size=1, max_size=20))
    if kind is Arg.TEXT:
        return draw(st.text(max_size=200))
    if kind is Arg.ARRAY:
        return intern(draw(descs))
    if kind is Arg.ARRAYS:
        return [intern(d) for d in draw(st.lists(descs, max_size=3))]
    if kind is Arg.PARAMS:
        return draw(st.dictionaries(st.text(max_size=8), scalars, max_size=4))
    if kind is Arg.KERNEL_ARGS:
        n = draw(st.integers(0, 3))
        return [["a", intern(draw(descs))] if i % 2 else ["s", "float32", 1.5] for i in range(n)]
    if kind is Arg.DIMS:
        return draw(st.lists(st.integers(1, 1024), min_size=1, max_size=3))
    if kind is Arg.BUFFER:
        return 0
    if kind is Arg.TENSORS:
        return draw(st.lists(tensors, max_size=3))
    if kind is Arg.ATEN_ARGS:
        args = draw(st.lists(aten_values, max_size=4))
        return [args, draw(st.dictionaries(st.text(max_size=8), aten_values, max_size=3))]
    if kind is Arg.PLACES:
        return draw(st.lists(st.integers(0, 1 << 62), max_size=3).map(lambda v: v + v))
    if kind is Arg.FLOATS:
        return draw(st.lists(st.floats(allow_nan=False), max_size=3))
    if kind is Arg.STEP:  # a step of n launches of x -> a new buffer each, on its own table
        n = draw(st.integers(1, 3))
        table = [[1, 0, [4], "float32"], *([h, 0, [4], "float32"] for h in range(2, n + 2))]
        calls = [[24, 0, ["exp", [i], [i + 1], {}]] for i in range(n)]
        return [table, calls, [0], [n + 1]]
    raise AssertionError(kind)


@st.composite
def commands(draw: Any) -> tuple[list[list[Any]], list[list[Any]], list[memoryview]]:
    arrays: list[list[Any]] = []
    cmds = []
    for seq, spec in enumerate(draw(st.lists(st.sampled_from(WIRE), min_size=1, max_size=8))):
        args = [_value(p.kind, draw, arrays) for p in spec.args]
        cmds.append([seq, spec.opcode, draw(st.integers(0, 5)), args, draw(st.booleans())])
    return cmds, arrays, [memoryview(b"payload")]


@pytest.mark.slow
@given(commands())
@settings(max_examples=300, deadline=None)
def test_every_command_kind_round_trips(batch: Any) -> None:
    cmds, arrays, bufs = batch
    frame = iter_frames(frame_bytes(encode_request(cmds, bufs, arrays)))[0]
    decoded = decode_request(frame)
    assert len(decoded) == len(cmds)
    for raw, cmd in zip(cmds, decoded, strict=True):
        assert isinstance(cmd, Command), cmd
        assert cmd.seq == raw[0] and cmd.spec.opcode == raw[1] and cmd.stream == raw[2]
        assert cmd.ack is raw[4]
        for (_, kind, *_), sent, got in zip(cmd.spec.args, raw[3], cmd.args, strict=True):
            if kind is Arg.ARRAY:
                assert got.encode() == arrays[sent]
            elif kind is Arg.ARRAYS:
                assert [d.encode() for d in got] == [arrays[i] for i in sent]
            elif kind is Arg.KERNEL_ARGS:
                assert len(got) == len(sent)
            elif kind in (Arg.DIMS, Arg.HANDLES, Arg.PLACES, Arg.FLOATS):
                assert list(got) == sent
            elif kind is Arg.TENSORS:
                assert [d.encode() for d in got] == sent
            elif kind is Arg.ATEN_ARGS:
                assert list(got) == sent
            elif kind is Arg.STEP:
                assert [d.encode() for d in got.slots] == [sent[0][0]]
                assert [c.spec.opcode for c in got.commands] == [c[0] for c in sent[1]]
                assert list(got.results) == sent[3]
            else:
                assert got == sent


def test_the_call_table_covers_every_class_and_has_unique_opcodes() -> None:
    opcodes = [c.opcode for c in WIRE]
    assert len(opcodes) == len(set(opcodes))
    assert {c.klass for c in CALLS} == set(CallClass)
    assert CALLS_BY_NAME["copy_d2h"].klass is CallClass.SYNC
    assert CALLS_BY_NAME["launch"].klass is CallClass.ASYNC
    assert CALLS_BY_NAME["device_info"].klass is CallClass.LOCAL


def _frame(msg: Any, bufs: int = 0) -> Frame:
    return Frame(msgpack.packb(msg), [memoryview(b"x")] * bufs)


@pytest.mark.parametrize(
    "arg",
    [
        -1,  # negative handle
        1 << 63,  # huge
        "7",  # wrong type
        1.5,
    ],
)
def test_bad_scalar_arguments_fail_that_command_alone(arg: Any) -> None:
    alloc = CALLS_BY_NAME["alloc"].opcode
    frame = _frame([REQUEST, [], [[1, alloc, 0, [arg, 8], False], [2, alloc, 0, [5, 8], False]]])
    bad, good = decode_request(frame)
    assert isinstance(bad, BadCommandAt) and bad.seq == 1 and bad.call == "alloc"
    assert isinstance(good, Command) and good.args == (5, 8)


@pytest.mark.parametrize(
    ("desc", "match"),
    [
        ([1, 0, [2] * 40, "float32"], "dimensions"),
        ([1, 0, [2, -3], "float32"], "shape"),
        ([1, 0, [2], "object"], "dtype"),
        ([1, 0, [2], "|O"], "dtype"),
        ([1, -5, [2], "float32"], "offset"),
        ([1, 0, [1 << 40, 1 << 40], "float64"], "too large"),
        ([1, 0, "shape", "float32"], "shape"),
        ("not a list", "descriptor"),
    ],
)
def test_hostile_array_descriptors_are_refused(desc: Any, match: str) -> None:
    launch = CALLS_BY_NAME["launch"].opcode
    frame = _frame([REQUEST, [desc], [[1, launch, 0, ["add", [0], [0], {}], False]]])
    (bad,) = decode_request(frame)
    assert isinstance(bad, BadCommandAt) and match in bad.message


def test_a_hostile_array_descriptor_leaves_no_reference_cycle() -> None:
    """A bad descriptor is kept as a value while the frame decodes, and each command that
    uses it fails with an error of its own: no exception keeps the decoder's frames (and so
    itself) alive, which a proxy that collects rarely would pile up under hostile input."""
    import gc

    launch = CALLS_BY_NAME["launch"].opcode
    bad_desc = [1, 0, [2] * 40, "float32"]
    cmds = [[i, launch, 0, ["add", [0], [0], {}], False] for i in range(3)]
    gc.collect()
    gc.disable()
    try:
        out = decode_request(_frame([REQUEST, [bad_desc], cmds]))
        assert all(isinstance(b, BadCommandAt) and "dimensions" in b.message for b in out)
        del out
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_out_of_range_array_and_buffer_indexes() -> None:
    launch = CALLS_BY_NAME["launch"].opcode
    h2d = CALLS_BY_NAME["copy_h2d"].opcode
    frame = _frame(
        [
            REQUEST,
            [[1, 0, [2], "float32"]],
            [
                [1, launch, 0, ["add", [3], [0], {}], False],
                [2, h2d, 0, [0, 1], False],
            ],
        ],
        bufs=1,
    )
    a, b = decode_request(frame)
    assert isinstance(a, BadCommandAt) and "array 3" in a.message
    assert isinstance(b, BadCommandAt) and "buffer 1" in b.message


def test_unknown_opcode_fails_alone() -> None:
    (bad,) = decode_request(_frame([REQUEST, [], [[9, 999, 0, [], False]]]))
    assert isinstance(bad, BadCommandAt) and "unknown opcode" in bad.message


@pytest.mark.parametrize(
    "meta",
    [
        b"\xc1",
        msgpack.packb("hello"),
        msgpack.packb([REQUEST, "x", []]),
        msgpack.packb([REQUEST, [], [["seq", 1, 0, [], False]]]),
        msgpack.packb([]),
    ],
)
def test_malformed_batches_are_protocol_errors(meta: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_request(Frame(meta))


def test_command_count_limit() -> None:
    alloc = CALLS_BY_NAME["free"].opcode
    frame = _frame([REQUEST, [], [[i, alloc, 0, [i], False] for i in range(11)]])
    with pytest.raises(LimitExceeded):
        decode_request(frame, FrameLimits(max_commands=10))


def test_replies_round_trip() -> None:
    err = ErrorInfo(3, "launch", "matmul", "OpError", "not aligned", True, 2)
    frame = encode_replies(
        [Reply(1, True, {"a": 1}), Reply(2, True, 0), Reply(4, False, err)], [memoryview(b"data")]
    )
    got = decode_replies(iter_frames(frame_bytes(frame))[0])
    assert got[0] == Reply(1, True, {"a": 1})
    assert got[2].value == err


def test_fatal_message_is_not_a_reply() -> None:
    with pytest.raises(RemoteProtocolError):
        decode_replies(encode_fatal("go away"))


def test_array_desc_nbytes() -> None:
    d = array_desc(1, 0, (3, 4), np.dtype("float64"))
    assert d.nbytes == 96 and d == ArrayDesc(1, 0, (3, 4), np.dtype("float64"), 96)
    assert check_array([1, 0, [3, 4], "float64"], "a", FrameLimits()) == d


def test_array_descriptors_are_checked_with_exact_types_every_time() -> None:
    """A descriptor that equals (and hashes like) a valid one must not pass for it."""
    ok = check_array([1, 0, [4], "float32"], "x", FrameLimits())
    assert ok.shape == (4,) and ok.handle == 1
    for bad in ([1.0, 0, [4], "float32"], [1, False, [4], "float32"], [1, 0, [4.0], "float32"]):
        with pytest.raises(BadCommand):
            check_array(bad, "x", FrameLimits())


# -- the typed lane ---------------------------------------------------------------------------
#: values put in place of a part of a frame: the wrong type, each limit and one past it
junk = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.binary(max_size=3),
    st.lists(st.integers(-2, 3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(0, 2), max_size=2),
    st.sampled_from(
        [-1, 0, 1, 2, 3, 1 << 62, (1 << 62) + 1, (1 << 63) - 1, 1 << 63, 1 << 31, (1 << 31) + 1]
    ),
    st.sampled_from(["", "x" * 128, "x" * 129, "float64", "float65", [0] * 64, [0] * 65]),
    st.sampled_from([[1] * 256, [1] * 257, [True], [1.0], {"k" * 129: 1}, {1: 1}, [[1]]]),
)


def _slots(x: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) of a message, nested ones too."""
    items = enumerate(x) if type(x) is list else x.items() if type(x) is dict else ()
    for k, v in list(items):
        out.append((x, k))
        _slots(v, out)
    return out


@st.composite
def request_frames(draw: Any) -> tuple[Frame, FrameLimits]:
    """Request frames of any calls, as the client sends them or with parts replaced by junk
    (a few of them), under the default limits or tight ones."""
    cmds, arrays, _ = draw(commands())
    msg: list[Any] = copy.deepcopy([REQUEST, arrays, cmds])  # (the strategies share values)
    if draw(st.booleans()):
        msg.append(copy.deepcopy(draw(st.one_of(st.integers(0, 5), junk))))
    for _ in range(draw(st.integers(0, 3))):
        slots = _slots(msg, [])
        container, key = slots[draw(st.integers(0, len(slots) - 1))]
        container[key] = copy.deepcopy(draw(junk))  # (sampled values are shared)
    limits = draw(
        st.sampled_from([FrameLimits(), FrameLimits(max_commands=3), FrameLimits(max_ndim=2)])
    )
    meta = msgpack.packb(msg, use_bin_type=True)
    return Frame(meta, [memoryview(b"x")] * draw(st.integers(0, 2))), limits


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (``1``, ``1.0`` and ``True`` differ)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _one_at_a_time(frame: Frame, limits: FrameLimits) -> Any:
    try:
        msg = decode_message(frame)
        return decode_request(frame, limits, msg), request_local_calls(msg)
    except (RemoteProtocolError, LimitExceeded) as exc:
        return exc


def _lanes_agree(frame: Frame, limits: FrameLimits) -> None:
    """What the typed lane gives, where it takes ``frame``, and what ``decode_batch`` gives
    (or raises), are what the checks one at a time give (or raise)."""
    from gpuremote.wire import protocol

    expected = _one_at_a_time(frame, limits)
    try:
        typed = protocol._decode_typed(frame, limits)
    except Exception as exc:
        assert isinstance(exc, protocol._NOT_TYPED), exc
    else:
        assert not isinstance(expected, Exception), expected
        assert _same(typed, expected)
    if isinstance(expected, Exception):
        with pytest.raises(type(expected)):
            decode_batch(frame, limits)
    else:
        assert _same(decode_batch(frame, limits), expected)


@pytest.mark.slow
@given(request_frames())
@settings(max_examples=1500, deadline=None)
def test_the_typed_lane_decodes_as_the_checks_one_at_a_time_do(case: Any) -> None:
    """A frame the typed lane takes gives what ``decode_request`` gives, to the types; any
    other goes to ``decode_request``, which says what is wrong with it."""
    _lanes_agree(*case)


def test_the_typed_lane_takes_the_frames_of_the_hot_path() -> None:
    """An xp op's frame (two launches, the frees, a read) and a copy to the device are
    decoded by the typed lane, not by the checks one at a time."""
    from gpuremote.wire import protocol

    op = {c.name: c.opcode for c in WIRE}
    arrays = [[1, 0, [16], "float32"], [7, 0, [16], "float32"], [8, 0, [], "float32"]]
    cmds = [
        [1, op["launch_new"], 0, ["add", [0], [1], {"scalar": 1.0}], False],
        [2, op["launch_new"], 0, ["sum", [1], [2], {"axis": None, "keepdims": False}], False],
        [3, op["free_buffers"], 0, [[5, 6]], False],
        [4, op["copy_h2d"], 0, [0, 0], True],
        [5, op["copy_d2h"], 0, [2], False],
    ]
    frame = encode_request(cmds, [memoryview(b"x" * 64)], arrays, 3)
    typed, local = protocol._decode_typed(frame, FrameLimits())
    assert local == 3 and _same(typed, decode_request(frame))
    assert [c.ack for c in typed] == [False, False, False, True, False]  # type: ignore[union-attr]


def test_the_typed_lane_takes_a_frame_with_calls_it_has_no_type_for() -> None:
    """A PyTorch frame: ops by template (``aten_call``, typed) beside an op sent whole and a
    template (``aten``, ``aten_template``: no msgspec type) is still the typed lane's, those
    two checked one at a time, as ``decode_request`` checks them; a bad one of them sends the
    frame to ``decode_request``, which fails that command alone."""
    from gpuremote.wire import protocol

    op = {c.name: c.opcode for c in WIRE}
    two = [[1, 0, [4], [1], "float32"], [2, 0, [4], [1], "float32"]]
    add = [[{"t": 0}, {"t": 1}], {}]
    cmds = [
        [1, op["aten_call"], 0, [3, [1, 0, 2, 0], [9], []], False],
        [2, op["aten"], 0, ["copy_.default", two, add, []], False],
        [
            3,
            op["aten_template"],
            0,
            [4, "add.Tensor", two, add, [[9, 0, [4], [1], "float32"]]],
            False,
        ],
        [4, op["free_buffers"], 0, [[5, 6]], False],
    ]
    frame = encode_request(cmds, [], [], 0)
    typed, _ = protocol._decode_typed(frame, FrameLimits())
    assert _same(typed, decode_request(frame)), typed
    assert [c.spec.name for c in typed] == ["aten_call", "aten", "aten_template", "free_buffers"]  # type: ignore[union-attr]
    cmds[1][3] = ["copy_.default", [[1, 0, [4], [1], "float65"]], add, []]  # a bad dtype
    frame = encode_request(cmds, [], [], 0)
    with pytest.raises(protocol._NOT_TYPED):
        protocol._decode_typed(frame, FrameLimits())
    commands, _ = decode_batch(frame, FrameLimits())
    assert isinstance(commands[1], BadCommandAt) and commands[1].call == "aten"
    assert not any(isinstance(c, BadCommandAt) for i, c in enumerate(commands) if i != 1)


_OP = {c.name: c.opcode for c in WIRE}
_MAX = (1 << 63) - 1, 1 << 62  # MAX_HANDLE, MAX_SIZE


def _hot_frame() -> list[Any]:
    return [
        REQUEST,
        [[1, 0, [16], "float32"], [7, 0, [16], "float32"], [8, 0, [], "float32"]],
        [
            [1, _OP["launch_new"], 0, ["add", [0], [1], {"scalar": 1.0}], False],
            [2, _OP["launch"], 0, ["sum", [1], [2], {"axis": None, "keepdims": False}], False],
            [3, _OP["free_buffers"], 0, [[5, 6]], False],
            [4, _OP["copy_h2d"], 0, [0, 0], True],
            [5, _OP["memset"], 0, [7, 0, 64, 0], False],
            [6, _OP["peer_read"], 0, ["ticket"], False],
            [7, _OP["copy_d2h"], 0, [2], False],
        ],
        0,
    ]


def _at(path: tuple[Any, ...], value: Any) -> list[Any]:
    msg = _hot_frame()
    *inner, last = path
    target: Any = msg
    for k in inner:
        target = target[k]
    target[last] = value
    return msg


_C = 2  # the commands, in a message
#: (where in the hot frame, what there): each limit, one past it, and the wrong types
_EDGES = [
    *[((_C, 0, 3, 0), v) for v in ("", "x" * 128, "x" * 129, 5, b"add")],  # an op's name
    *[((_C, 0, 3, 3), {k: 1}) for k in ("", "k" * 128, "k" * 129)],  # a param's key
    *[
        ((_C, 0, 3, 3), {"scalar": v})
        for v in (
            "v" * 128,
            "v" * 129,
            [1] * 256,
            [1] * 257,
            [True],
            [1.0],
            [],
            {"a": 1},
            (1 << 64) - 1,
            -(1 << 63),
            -1,
            1.5,
            None,
            True,
            b"x",
            [[1]],
        )
    ],
    ((_C, 0, 3, 3), {str(i): i for i in range(32)}),
    ((_C, 0, 3, 3), {str(i): i for i in range(33)}),
    ((_C, 0, 3, 3), {1: 1}),
    ((_C, 0, 3, 3), []),
    *[((_C, 0, 3, 1), v) for v in ([0] * 64, [0] * 65, [-1], [3], [True], [1.0], 0, [])],
    *[((_C, 2, 3, 0), v) for v in ([0] * 64, [0] * 65, [-1], [_MAX[0]], [_MAX[0] + 1], [True])],
    *[((_C, 1, 2), v) for v in (-1, _MAX[0], _MAX[0] + 1, True, 1.0)],  # a stream
    *[((_C, 1, 0), v) for v in (True, 1.5, "1", -1, (1 << 64) - 1)],  # a seq
    *[((_C, 1, 4), v) for v in (2, 1, 3, 0, None, "x", 1.0)],  # the last item: ack, OWN
    *[((_C, 1, 3), v) for v in ([], ["sum", [1], [2]], {"a": 1}, None)],  # the arguments
    *[((_C, 3, 3, 1), v) for v in (0, 1, -1, True)],  # a buffer index (one buffer)
    *[((_C, 4, 3, 2), v) for v in (_MAX[1], _MAX[1] + 1, -1, 1.0)],  # a size
    *[((_C, 5, 3, 0), v) for v in ("t" * (1 << 20), "t" * ((1 << 20) + 1), "", 1)],  # a text
    *[((_C, 6, 3, 0), v) for v in (2, 3, -1, None)],  # an array index
    *[((_C, 6), v) for v in ([7, 13, 0, [2]], [7, 13, 0, [2], False, 1], 7, [])],
    *[((3,), v) for v in (-1, None, "x", 5, True, 1.5, [1])],  # the LOCAL calls count
    *[((1, 0, 0), v) for v in (-1, _MAX[0], _MAX[0] + 1, True)],  # a descriptor's handle
    *[((1, 0, 1), v) for v in (_MAX[1], _MAX[1] + 1, -1)],  # its offset
    *[((1, 0, 2), v) for v in ([_MAX[1]], [_MAX[1] + 1], [1] * 32, [1] * 33, [1 << 62, 2])],
    *[((1, 0, 3), v) for v in ("float65", 5, "", "bfloat16")],  # its dtype
    *[((1, 2), v) for v in (None, [8, 0, []], [8, 0, [], "float32", 1], 5)],  # a descriptor
    ((1,), [[i, 0, [1], "uint8"] for i in range(65)]),
    ((0,), 2),
]


@pytest.mark.parametrize(("where", "value"), _EDGES)
@pytest.mark.parametrize("limits", [FrameLimits(), FrameLimits(max_commands=7, max_ndim=1)])
def test_the_typed_lane_keeps_every_limit(where: Any, value: Any, limits: FrameLimits) -> None:
    """Each limit, one past it, and the wrong types, in every part of a frame the typed lane
    takes: what it gives is what the checks one at a time give."""
    frame = Frame(msgpack.packb(_at(where, value), use_bin_type=True), [memoryview(b"x")])
    _lanes_agree(frame, limits)
