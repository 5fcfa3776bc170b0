"""The failover ledger alone: no proxy, no event loop. Calls are fed in their client form, as
the failover session feeds them, and the journal and the buffers' states are read back."""

from __future__ import annotations

from typing import Any

import pytest

from gpuremote.errors import RemoteCallError
from gpuremote.session.failover.ledger import (
    Answered,
    Ledger,
    pack,
    step_sizes,
    step_writes,
    unpack,
)
from gpuremote.wire.calls import BUFFER, CALLS_BY_NAME

_C = CALLS_BY_NAME


def _desc(handle: int, n: int = 4, offset: int = 0) -> list[Any]:
    return [handle, offset, [n], "float32"]


def _async(ledger: Ledger, name: str, args: list[Any], buffer: memoryview | None = None) -> None:
    """An ASYNC call, as ``FailoverSession.submit`` journals it."""
    packed = pack(_C[name], 0, args)
    ledger.track(_C[name], args, buffer, packed)
    ledger.journal_call(packed, buffer)


def test_buffers_made_written_uploaded_and_freed() -> None:
    ledger = Ledger()
    data = memoryview(bytes(16))
    _async(ledger, "alloc", [1, 16])
    _async(ledger, "copy_h2d", [_desc(1), BUFFER], data)  # the whole buffer: the client's
    _async(ledger, "launch_new", ["add", [_desc(1), _desc(1)], [_desc(2)], {}])
    _async(ledger, "alloc", [3, 32])
    _async(ledger, "copy_h2d", [_desc(3, 4, 16), BUFFER], data)  # half of it: not the client's
    assert ledger.live == {1: 16, 2: 16, 3: 32}
    assert ledger.host == {1: data} and ledger.dirty == {1, 2, 3}
    _async(ledger, "launch", ["negative", [_desc(2)], [_desc(1)], {}])  # overwrites 1
    assert ledger.host == {}  # buffer 1 is no longer the client's own upload
    _async(ledger, "free_buffers", [[2, 3]])
    ledger.freed(1)
    assert ledger.live == {} and ledger.dirty == set() and ledger.host == {}
    assert len(ledger.journal) == 8 and ledger.journal[-1] == 1
    assert ledger.journal_bytes == 32  # the two uploads' data, kept for a re-issue


def test_a_packed_call_comes_back_with_its_host_data_placeholder() -> None:
    spec, stream, args = unpack(pack(_C["copy_h2d"], 3, [_desc(5), BUFFER]))
    assert spec is _C["copy_h2d"] and stream == 3 and args == [_desc(5), BUFFER]
    with pytest.raises((TypeError, ValueError, OverflowError)):
        pack(_C["alloc"], 0, [1, object()])


def test_a_checkpoint_copies_what_changed_and_commits_its_point() -> None:
    ledger = Ledger()
    data = memoryview(bytes(16))
    _async(ledger, "alloc", [1, 16])
    _async(ledger, "copy_h2d", [_desc(1), BUFFER], data)
    _async(ledger, "launch_new", ["add", [_desc(1), _desc(1)], [_desc(2)], {}])
    snap = ledger.snapshot()
    assert ledger.to_copy(snap) == [2]  # 1 is the client's own upload: no copy
    _async(ledger, "launch", ["negative", [_desc(1)], [_desc(2)], {}])  # after the point
    kept, dropped = ledger.commit(snap, {2: ("ck", 1 << 62)})
    assert kept == {1 << 62} and dropped == []
    assert ledger.base == {1: (16, ("host", data)), 2: (16, ("ck", 1 << 62))}
    assert len(ledger.journal) == 1 and not ledger.checkpoint_due  # what came after it
    assert ledger.dirty == {2}  # written since the point: copied by the next checkpoint
    assert ledger.copies_on_standby()
    assert ledger.copies_lost() and not ledger.base_complete and ledger.checkpoint_due
    assert ledger.base == {1: (16, ("host", data))}


def test_a_checkpoint_not_taken_leaves_its_writes_to_the_next() -> None:
    ledger = Ledger()
    _async(ledger, "alloc", [1, 16])
    snap = ledger.snapshot()
    assert ledger.dirty == set()
    ledger.abandon(snap)
    assert ledger.dirty == {1} and ledger.to_copy(ledger.snapshot()) == [1]


def test_a_recorded_step_sizes_its_results_and_writes_what_it_closes_over() -> None:
    # a step over argument 10: w (handle 7) += x; its result is a new buffer (handle 20)
    arrays = [_desc(10), _desc(7), _desc(20, 8)]
    axpy = [_C["launch"].opcode, 0, ["axpy", [0, 1], [1], {"alpha": 1.0}]]
    new = [_C["launch_new"].opcode, 0, ["add", [0, 0], [2], {}]]
    program = [arrays, [axpy, new], [0], [20]]
    assert step_sizes(program) == [32] and step_writes(program) == [7]
    ledger = Ledger()
    _async(ledger, "step_record", [100, program])
    ledger.snapshot()  # nothing written from here on
    _async(ledger, "step_replay", [100, [_desc(11)], [21]])
    assert ledger.live[21] == 32 and ledger.dirty == {7, 11, 21}
    assert ledger.res.keys() == {("step", 100)}
    ledger.snapshot()
    _async(ledger, "step_run", [100, [12], [22]])  # (the argument by its buffer alone)
    assert ledger.live[22] == 32 and ledger.dirty == {7, 12, 22}
    _async(ledger, "step_free", [100])
    assert ledger.res == {} and ledger.step_writes == {}


def test_streams_events_and_kernels_alive_are_kept() -> None:
    ledger = Ledger()
    _async(ledger, "stream_create", [5])
    _async(ledger, "event_create", [6])
    _async(ledger, "event_destroy", [6])
    assert ledger.streams and set(ledger.res) == {("stream", 5)}


def test_answered_calls_data_dependent_outputs_and_imports() -> None:
    ledger = Ledger()
    dyn = Answered(_C["launch_dynamic"], 0, ["nonzero", [_desc(1)], [30], {}], None, False)
    ledger.begin(dyn)
    assert ledger.dynamic == 1 and dyn in ledger.unanswered
    ledger.answered(dyn, [[[3], "int64"]], None)
    assert ledger.dynamic == 0 and ledger.live == {30: 24} and 30 in ledger.dirty
    imp = Answered(_C["peer_import"], 0, [_desc(4), "tcp://b:1", "t"], None, False)
    ledger.begin(imp)
    ledger.checkpoint_due = False
    ledger.answered(imp, 16, None)
    assert imp.value is True and ledger.checkpoint_due and 4 in ledger.dirty
    read = Answered(_C["copy_d2h"], 0, [_desc(4)], None, False)
    ledger.begin(read)
    err = RemoteCallError("boom", call="free", seq=3, deferred=True)
    ledger.answered(read, None, err)
    assert read.done and read.deferred and read.args == []  # a read's args are let go
    waited = Answered(_C["copy_d2h"], 0, [_desc(4)], None, False)
    ledger.begin(waited)
    ledger.gave_up(waited)
    assert waited.done and waited.deferred and not ledger.unanswered


def test_the_journal_bound() -> None:
    ledger = Ledger()
    for h in range(3):
        _async(ledger, "alloc", [h + 1, 4])
    assert ledger.full(max_calls=3, max_bytes=1 << 20)
    assert not ledger.full(max_calls=4, max_bytes=1 << 20)
