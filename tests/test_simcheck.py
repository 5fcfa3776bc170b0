"""``sim:check``: the simulated device as a checker of stream semantics.

The checker alone (races by vector clocks against a reference happens-before graph, the pool,
poisoning), then end to end: the programs it must flag and pass, and the proxy defects it
exists to catch (a free that does not wait for its stream's work, a stream that does not wait
for an event, a session's memory handed on while its work is queued).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gpuremote
from gpuremote.backends import BackendError, get_backend
from gpuremote.backends.sim_backend import SimBackend, SimOptions
from gpuremote.backends.simcheck import POISON, Checker, SimCheckBackend, StreamRace
from gpuremote.errors import RemoteCallError
from gpuremote.proxy import Proxy


# -- options ---------------------------------------------------------------------------------
@given(
    op_us=st.one_of(st.none(), st.integers(0, 10**6)),
    check=st.booleans(),
    check_first=st.booleans(),
)
def test_sim_options_combine_in_any_order(
    op_us: int | None, check: bool, check_first: bool
) -> None:
    items = (["check"] if check else []) + ([] if op_us is None else [f"op_us={op_us}"])
    if check_first is False:
        items.reverse()
    spec = "sim" + (":" + ",".join(items) if items else "")
    options = SimOptions.parse(spec)
    assert options == SimOptions(op_us=float(op_us or 0), check=check)
    backend = get_backend(spec)
    assert isinstance(backend, SimBackend)
    assert isinstance(backend, SimCheckBackend) == check
    assert backend.op_s == pytest.approx((op_us or 0) / 1e6)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("sim:bogus", "not 'bogus'"),
        ("sim:op_us=fast", "not a number"),
        ("sim:check,check", "twice"),
        ("sim:check=1", "not 'check=1'"),
        ("sim:op_us=-1", ">= 0"),
    ],
)
def test_bad_sim_specs_name_the_problem(spec: str, match: str) -> None:
    with pytest.raises(BackendError, match=match):
        get_backend(spec)


# -- the checker against a reference happens-before graph ----------------------------------
# a step: ("w"|"r", stream, buffer) an access; ("rec", stream, event); ("wait", stream, event);
# ("sync", stream) the host waits for the stream
_STREAM = st.sampled_from([0, 0, 1, 1, 2])
_STEP = st.one_of(
    st.tuples(st.sampled_from(["w", "r"]), _STREAM, st.integers(0, 1)),
    st.tuples(st.sampled_from(["rec", "wait"]), _STREAM, st.integers(0, 1)),
    st.tuples(st.sampled_from(["rec", "wait"]), _STREAM, st.integers(0, 1)),
    st.tuples(st.just("sync"), _STREAM),
)


def _reference_races(steps: list[tuple[Any, ...]]) -> list[bool]:
    """For each step, whether it races with an earlier recorded access: by reachability in
    the happens-before graph (program order per stream, record -> wait, stream -> host ->
    everything issued after), the definition the checker's vector clocks implement."""
    preds: list[set[int]] = []  # the nodes each node comes directly after
    last: dict[Any, int] = {}  # the last node of each stream, and of the host ("h")
    recorded: dict[int, int] = {}  # event -> its record node
    accesses: list[tuple[int, str, int, int]] = []  # (node, kind, stream, buffer)
    out: list[bool] = []

    def reaches(a: int, b: int) -> bool:
        seen, todo = set(), [b]
        while todo:
            n = todo.pop()
            if n == a:
                return True
            if n not in seen:
                seen.add(n)
                todo.extend(preds[n])
        return False

    for step in steps:
        kind, s = step[0], step[1]
        node = len(preds)
        preds.append({p for p in (last.get(s), last.get("h")) if p is not None})
        if kind == "wait" and step[2] in recorded:
            preds[node].add(recorded[step[2]])
        last[s] = node
        race = False
        if kind in ("w", "r"):
            buf = step[2]
            race = any(
                b == buf and t != s and "w" in (k, kind) and not reaches(n, node)
                for n, k, t, b in accesses
            )
            if not race:
                accesses.append((node, kind, s, buf))
        elif kind == "rec":
            recorded[step[2]] = node
        elif kind == "sync":
            host = len(preds)
            preds.append({node} | ({last["h"]} if "h" in last else set()))
            last["h"] = host
        out.append(race)
    return out


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(_STEP, min_size=4, max_size=20))
@example([("w", 0, 0), ("rec", 0, 0), ("wait", 1, 0), ("r", 1, 0)])  # the event orders them
@example([("w", 0, 0), ("rec", 0, 0), ("w", 0, 0), ("wait", 1, 0), ("r", 1, 0)])  # not this
@example([("w", 0, 1), ("rec", 0, 0), ("wait", 1, 0), ("rec", 1, 1), ("wait", 2, 1), ("w", 2, 1)])
@example([("r", 0, 0), ("sync", 0), ("w", 1, 0), ("w", 2, 0)])  # the host orders; not 1 -> 2
@example([("w", 0, 0), ("rec", 0, 0), ("rec", 1, 0), ("wait", 2, 0), ("r", 2, 0)])  # re-recorded
def test_races_are_reported_exactly_when_nothing_orders_the_two_accesses(
    steps: list[tuple[Any, ...]],
) -> None:
    checker = Checker()
    clocks = [checker.new_clock() for _ in range(3)]
    bufs = [checker.alloc(64) for _ in range(2)]
    events: dict[int, dict[int, int]] = {}
    got = []
    for step in steps:
        kind, clock = step[0], clocks[step[1]]
        race = False
        if kind in ("w", "r"):
            buf = bufs[step[2]]
            try:
                checker.access(clock, (buf,) if kind == "r" else (), (buf,) if kind == "w" else ())
            except StreamRace:
                race = True
        elif kind == "rec":
            events[step[2]] = checker.record(clock)
        elif kind == "wait":
            checker.wait(clock, events.get(step[2], {}))
        else:
            checker.host_waited(clock)
        got.append(race)
    assert got == _reference_races(steps)


def test_a_race_names_both_calls() -> None:
    checker = Checker()
    s1, s2 = checker.new_clock(), checker.new_clock()
    buf = checker.alloc(16)
    checker.note_call(7, "launch", "exp", 1, 1)
    checker.access(s1, (), (buf,))
    checker.note_call(9, "copy_d2h", None, 1, 2)
    with pytest.raises(StreamRace) as err:
        checker.access(s2, (buf[4:8],), ())
    message = str(err.value)
    assert "call #9 copy_d2h (session 1, stream 2) reads" in message
    assert "call #7 launch 'exp' (session 1, stream 1) writes" in message
    assert checker.races == 1


def test_disjoint_parts_of_a_buffer_do_not_race() -> None:
    checker = Checker()
    s1, s2 = checker.new_clock(), checker.new_clock()
    buf = checker.alloc(64)
    checker.access(s1, (), (buf[:32],))
    checker.access(s2, (), (buf[32:],))
    with pytest.raises(StreamRace):
        checker.access(s2, (buf[28:36],), ())


# -- the pool ------------------------------------------------------------------------------
class _FakeStream:
    def __init__(self, checker: Checker) -> None:
        self.clock = checker.new_clock()


def test_freed_memory_is_poisoned_and_reused_once_the_free_has_run() -> None:
    checker = Checker()
    s0, s1 = _FakeStream(checker), _FakeStream(checker)
    buf = checker.alloc(1000)
    assert (buf == POISON).all()  # fresh memory is poison too: uninitialised reads show
    buf[:] = 7
    checker.access(s1.clock, (buf,), ())
    ticket, report = checker.free([buf], [s0, s1])
    assert report == ""
    address = buf.__array_interface__["data"][0]
    other = checker.alloc(1000)  # s1 has not run up to the free: not this memory
    assert other.__array_interface__["data"][0] != address
    checker.complete(ticket, s0.clock.sid)
    assert (buf == 7).all()  # not poisoned before every stream has passed the free
    checker.complete(ticket, s1.clock.sid)
    assert (buf == POISON).all()
    again = checker.alloc(900)  # the same size class: the same memory, at once
    assert again.__array_interface__["data"][0] == address
    assert np.isnan(again.view(np.float32)).all()
    checker.access(s0.clock, (), (again,))  # ordered after the free: no race


def test_a_free_that_an_unordered_access_may_outlive_is_a_use_after_free() -> None:
    checker = Checker()
    s0, s1 = _FakeStream(checker), _FakeStream(checker)
    buf = checker.alloc(64)
    checker.note_call(3, "launch", "exp", 1, 1)
    checker.access(s1.clock, (buf,), ())
    checker.note_call(4, "free", None, 1, 0)
    _, report = checker.free([buf], [s0])  # stream 1's read is not before it
    assert report.startswith("use after free: call #4 free")
    assert "call #3 launch 'exp'" in report


def test_memory_dropped_without_a_free_is_reported_at_its_next_owner() -> None:
    checker = Checker()
    s0, s1 = checker.new_clock(), checker.new_clock()
    buf = checker.alloc(64)
    checker.note_call(5, "launch", "exp", 1, 1)
    checker.access(s1, (buf,), ())
    del buf  # a GPU pool takes it back at once: stream 1's read may still be queued
    new = checker.alloc(64)
    assert (new == POISON).all()
    checker.note_call(8, "copy_h2d", None, 2, 0)
    with pytest.raises(StreamRace, match=r"use after free: call #8 copy_h2d .* call #5"):
        checker.access(s0, (), (new,))


# -- end to end ----------------------------------------------------------------------------
@pytest.fixture
async def checked() -> AsyncIterator[tuple[Proxy, str]]:
    """A proxy on ``sim:check`` whose ops take 20 ms each (so work is still queued)."""
    p = Proxy("sim:check,op_us=20000")
    url = await p.start("inproc://simcheck-test")
    try:
        yield p, url
    finally:
        await p.close()


DATA = np.linspace(0, 1, 256, dtype=np.float32)


async def test_a_read_on_another_stream_without_an_event_is_a_race_naming_both_calls(
    checked: tuple[Proxy, str],
) -> None:
    async with gpuremote.connect(checked[1]) as gpu:
        s1, s2 = gpu.stream(), gpu.stream()
        with gpu.use_stream(s1):
            x = gpu.asarray(DATA)  # uploaded on stream 1
            y = gpu.exp(x)
        with gpu.use_stream(s2):
            z = gpu.tanh(y)
        with pytest.raises(RemoteCallError) as err:
            await gpu.synchronize()
        e = err.value
        assert e.deferred and e.kind == "StreamRace" and e.op == "tanh"
        assert f"call #{e.seq} launch_new 'tanh'" in e.message  # the reading call
        assert "launch_new 'exp'" in e.message and "stream 1) writes" in e.message
        del z
        # the session goes on; with the event, the same program passes and is right
        ev = gpu.event()
        with gpu.use_stream(s1):
            y = gpu.exp(x)
        ev.record(s1)
        s2.wait_event(ev)
        with gpu.use_stream(s2):
            z = gpu.tanh(y)
        np.testing.assert_allclose(await z.get(stream=s2), np.tanh(np.exp(DATA)), rtol=1e-6)


async def test_a_free_while_another_stream_reads_waits_for_that_work(
    checked: tuple[Proxy, str],
) -> None:
    async with gpuremote.connect(checked[1]) as gpu:
        s1 = gpu.stream()
        x = gpu.asarray(DATA)
        await gpu.synchronize()
        with gpu.use_stream(s1):
            y = gpu.exp(x)  # queued: 20 ms on stream 1
        x.free()  # its memory must not go to anyone before stream 1 has read it
        other = np.full(DATA.shape, 3, np.float32)
        z = gpu.asarray(other)  # the same size: the pool's first candidate is x's memory
        w = gpu.op("negative", z)
        np.testing.assert_array_equal(await w.get(), -other)
        np.testing.assert_allclose(await y.get(stream=s1), np.exp(DATA), rtol=1e-6)


async def test_a_session_ending_with_work_queued_keeps_its_memory_until_the_work_ran(
    checked: tuple[Proxy, str],
) -> None:
    p, url = checked
    a = await gpuremote.connect(url)
    xs = [a.asarray(DATA)]
    for _ in range(10):
        xs.append(a.exp(xs[-1]))  # 200 ms queued on its stream; every array alive to the end
    await a.flush()
    await a.aclose()  # leaves with the work queued
    for _ in range(500):
        if p.stats()["sessions"] == 0:
            break
        await asyncio.sleep(0.01)
    async with gpuremote.connect(url) as b:  # the same sizes: a's memory first in line
        u = b.asarray(DATA)
        v = b.add(u, b.asarray(DATA))
        np.testing.assert_array_equal(await v.get(), 2 * DATA)


def test_serve_backend_sim_check_reports_a_race_to_the_user(tmp_path: Any) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuremote", "serve", "--listen", "tcp://127.0.0.1:0",
         "--backend", "sim:check", "--announce", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip().rpartition(" ")[2]
        url = url[url.index("tcp://") :]

        async def main() -> str:
            async with gpuremote.connect(url) as gpu:
                assert gpu.device["backend"] == "sim" and "check" in gpu.device["note"]
                s1, s2 = gpu.stream(), gpu.stream()
                with gpu.use_stream(s1):
                    y = gpu.asarray(DATA) * 2
                with gpu.use_stream(s2):
                    gpu.exp(y)
                with pytest.raises(RemoteCallError, match="race") as err:
                    await gpu.synchronize()
                return str(err.value)

        message = gpuremote.run(main())
        assert "launch_new 'exp'" in message and "launch_new 'multiply'" in message
    finally:
        proc.terminate()
        proc.wait(10)


def test_what_the_host_writes_comes_before_what_any_stream_does_next() -> None:
    checker = Checker()
    s1 = checker.new_clock()
    checker.access(s1, (), ())  # stream 1 has joined the host's clock once already
    buf = checker.alloc(64)
    checker.access(checker.host, (), (buf,))  # e.g. a data-dependent op's result, made here
    checker.access(s1, (buf,), (buf,))
