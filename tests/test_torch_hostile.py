"""A hostile client of the proxy's PyTorch calls: ops off the allow-list, tensors past their
buffers, another session's buffers, malformed arguments. Each gets a clear error; its session
and every other session go on; nothing of another session is read or written."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the proxy runs ATen ops with the [torch] extra")

from gpuremote.core.driver import SyncDriver  # noqa: E402
from gpuremote.errors import RemoteCallError  # noqa: E402
from gpuremote.proxy.aten import load_torch  # noqa: E402
from gpuremote.proxy.state import CallFailed  # noqa: E402
from gpuremote.tools.proxyprocess import LocalProxy  # noqa: E402
from gpuremote.wire.calls import BUFFER, CALLS_BY_NAME  # noqa: E402

C = CALLS_BY_NAME


@pytest.fixture(scope="module")
def proxy_url() -> Iterator[str]:
    with LocalProxy("tcp", "numpy") as p:
        yield p.url


@pytest.fixture
def sessions(proxy_url: str) -> Iterator[tuple[SyncDriver, SyncDriver]]:
    a, b = SyncDriver(proxy_url), SyncDriver(proxy_url)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _upload(d: SyncDriver, values: list[float], h: int | None = None) -> int:
    """A buffer of float32 ``values`` in ``d``'s session (under ``h``); its handle."""
    data = np.asarray(values, dtype=np.float32)
    h = d.session.new_handle() if h is None else h
    d.post(C["alloc"], 0, [h, data.nbytes])
    d.post(
        C["copy_h2d"], 0, [[h, 0, [data.nbytes], "uint8"], BUFFER], memoryview(data.view(np.uint8))
    )
    return h


def _read(d: SyncDriver, h: int, n: int) -> list[float]:
    _, bufs = d.call(C["copy_d2h"], [[h, 0, [4 * n], "uint8"]])
    return np.frombuffer(bufs[0], dtype=np.float32).tolist()


def _t(h: int, n: int, offset: int = 0, stride: int = 1) -> list[Any]:
    return [h, offset, [n], [stride], "float32"]


def _fails(d: SyncDriver, op: str, tensors: list[Any], args: list[Any], outputs: list[Any]) -> str:
    """Run ``aten`` op and the next sync; the error it raises."""
    d.post(C["aten"], 0, [op, tensors, args, outputs])
    with pytest.raises(RemoteCallError) as info:
        d.call(C["device_synchronize"], [])
    assert info.value.call == "aten" and info.value.op in (op, None)  # None: not decoded
    return info.value.message


def _goes_on(d: SyncDriver, h: int, expected: list[float]) -> None:
    """A valid op runs after the error, and ``h`` holds ``expected``."""
    out = d.session.new_handle()
    d.post(
        C["aten"], 0, ["add.Tensor", [_t(h, 4), _t(h, 4)], [[{"t": 0}, {"t": 1}], {}], [_t(out, 4)]]
    )
    assert _read(d, out, 4) == [2 * v for v in expected]
    assert _read(d, h, 4) == expected


@pytest.mark.parametrize(
    "op, why",
    [
        ("from_file.default", "not on this proxy's allow-list"),
        ("set_.source_Storage", "not on this proxy's allow-list"),
        ("as_strided.default", "not on this proxy's allow-list"),
        ("_pin_memory.default", "not on this proxy's allow-list"),
        ("empty.memory_format", "not on this proxy's allow-list"),
        ("view.default", "not on this proxy's allow-list"),
        ("no_such_op.default", "not on this proxy's allow-list"),
        ("__import__.os", "not on this proxy's allow-list"),
        ("add.Tensor; import os", "not on this proxy's allow-list"),
    ],
)
def test_an_op_off_the_allow_list_is_refused(
    sessions: tuple[SyncDriver, SyncDriver], op: str, why: str
) -> None:
    a, _ = sessions
    h = _upload(a, [1, 2, 3, 4])
    message = _fails(a, op, [_t(h, 4)], [[{"t": 0}], {}], [])
    assert why in message
    _goes_on(a, h, [1, 2, 3, 4])


@pytest.mark.parametrize(
    "tensor",
    [
        _t(0, 5),  # one element too many
        _t(0, 2, offset=12),  # starts inside, ends past the end
        _t(0, 4, stride=2),  # strided past the end
        [0, 1 << 40, [1], [1], "float32"],  # far away
        [0, 0, [2, 2], [1 << 30, 1], "float32"],  # a huge stride
    ],
)
def test_a_tensor_past_its_buffer_is_refused(
    sessions: tuple[SyncDriver, SyncDriver], tensor: list[Any]
) -> None:
    a, b = sessions
    secret = _upload(b, [7, 7, 7, 7], h=1 << 40)  # another session's buffer, beside
    h = _upload(a, [1, 2, 3, 4])
    tensor = [h, *tensor[1:]]
    out = a.session.new_handle()
    message = _fails(a, "clone.default", [tensor], [[{"t": 0}], {}], [_t(out, 1)])
    assert f"of buffer {h}" in message and "which has 16" in message
    _goes_on(a, h, [1, 2, 3, 4])
    assert _read(b, secret, 4) == [7, 7, 7, 7]


def test_another_sessions_buffer_is_unknown_here(sessions: tuple[SyncDriver, SyncDriver]) -> None:
    a, b = sessions
    theirs = _upload(b, [5, 6, 7, 8], h=1 << 40)  # a handle no client of a gets
    assert _read(b, theirs, 4) == [5, 6, 7, 8]
    ours = _upload(a, [1, 2, 3, 4])
    # read it, and write it: neither happens
    message = _fails(a, "add_.Tensor", [_t(theirs, 4), _t(ours, 4)], [[{"t": 0}, {"t": 1}], {}], [])
    assert "unknown buffer handle" in message
    a.post(
        C["aten"],
        0,
        ["copy_.default", [_t(ours, 4), _t(theirs, 4)], [[{"t": 0}, {"t": 1}], {}], []],
    )
    with pytest.raises(RemoteCallError, match="unknown buffer handle"):
        a.call(C["device_synchronize"], [])
    _goes_on(a, ours, [1, 2, 3, 4])
    assert _read(b, theirs, 4) == [5, 6, 7, 8]


@pytest.mark.parametrize(
    "args, why",
    [
        ([[{"t": 3}], {}], "tensor 3 of 1"),
        ([[{"dtype": "object"}], {}], "unsupported dtype"),
        ([[{"t": 0}, "x" * 200], {}], "string of 200"),
        ([[{"t": 0}], {"generator": {"t": 0}}], ""),  # a tensor where a generator goes
        ([[{"t": 0}, {"t": 0}, {"t": 0}, {"t": 0}], {}], ""),  # the wrong number of arguments
    ],
)
def test_malformed_arguments_fail_alone(
    sessions: tuple[SyncDriver, SyncDriver], args: list[Any], why: str
) -> None:
    a, _ = sessions
    h = _upload(a, [1, 2, 3, 4])
    out = a.session.new_handle()
    message = _fails(a, "neg.default", [_t(h, 4)], args, [_t(out, 4)])
    assert why in message
    _goes_on(a, h, [1, 2, 3, 4])


def test_a_bad_tensor_descriptor_is_refused_before_anything_runs(
    sessions: tuple[SyncDriver, SyncDriver],
) -> None:
    a, _ = sessions
    h = _upload(a, [1, 2, 3, 4])
    for bad in (
        [h, 0, [4], [1], "object"],  # no such dtype
        [h, 2, [1], [1], "float32"],  # not a whole number of items in
        [h, 0, [4], [-1], "float32"],  # a negative stride
        [h, 0, [4, 1], [1], "float32"],  # sizes and strides disagree
        [h, 0, [4], [1]],  # too short
    ):
        message = _fails(a, "neg_.default", [bad], [[{"t": 0}], {}], [])
        assert "tensor" in message or "argument" in message
    _goes_on(a, h, [1, 2, 3, 4])


def test_a_proxy_without_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(CallFailed, match=r"gpuremote\[torch\]"):
        load_torch()


def test_the_allow_list_is_the_checked_in_table_of_this_release() -> None:
    """The table (``gpuremote/ops/aten/torch-X.Y.tsv``) is what the rules make of this
    torch release's ops, line for line: a new release's additions and drops show in the
    diff (``python -m gpuremote.ops.aten`` prints them; ``--write`` writes the table)."""
    from gpuremote.ops import aten

    version = aten.release(torch)
    made = {row.name: row for row in aten.generate(torch)}
    assert aten.allowed(version) == made, "python -m gpuremote.ops.aten shows the difference"
    assert "add.Tensor" in made and "empty.memory_format" not in made


def test_an_op_is_run_only_as_its_table_line_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """An op missing from the table, or listed with another schema than this build's, is
    refused (the rules are the generator's; the proxy reads the table)."""
    from gpuremote.ops import aten
    from gpuremote.proxy.aten import resolve_op
    from gpuremote.proxy.state import CallFailed

    version = aten.release(torch)
    table = dict(aten.allowed(version))
    assert resolve_op("add.Tensor").op is torch.ops.aten.add.Tensor
    del table["add.Tensor"]
    table["mul.Tensor"] = table["mul.Tensor"]._replace(schema="aten::mul.Tensor(Tensor a)")
    monkeypatch.setattr(aten, "allowed", lambda v: table)
    resolve_op.cache_clear()
    try:
        with pytest.raises(CallFailed, match="not on this proxy's allow-list"):
            resolve_op("add.Tensor")
        with pytest.raises(CallFailed, match="not the one its allow-list reviewed"):
            resolve_op("mul.Tensor")
    finally:
        resolve_op.cache_clear()
