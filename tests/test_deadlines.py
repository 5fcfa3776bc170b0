"""Deadlines on one timer, and the proxy's heap keeper after a flood of sessions."""

from __future__ import annotations

import asyncio

import pytest

from gpuremote.proxy.deadlines import Deadlines
from gpuremote.proxy.heap import HeapKeeper


async def test_deadlines_expire_in_order_after_their_delay() -> None:
    loop = asyncio.get_running_loop()
    expired: list[tuple[str, float]] = []
    d: Deadlines[str] = Deadlines(0.05, lambda k: expired.append((k, loop.time())), loop)
    t0 = loop.time()
    d.add("a")
    await asyncio.sleep(0.02)
    d.add("b")
    d.add("c")
    d.discard("c")  # stopped before it was due
    assert len(d) == 2 and "a" in d and "c" not in d
    await asyncio.sleep(0.15)
    assert [k for k, _ in expired] == ["a", "b"]
    assert expired[0][1] - t0 >= 0.05 - 1e-3
    assert expired[1][1] - t0 >= 0.07 - 1e-3
    assert len(d) == 0 and d._timer is None  # nothing left armed


async def test_adding_again_restarts_a_deadline() -> None:
    loop = asyncio.get_running_loop()
    expired: list[str] = []
    d: Deadlines[str] = Deadlines(0.05, expired.append, loop)
    d.add("a")
    d.add("b")
    await asyncio.sleep(0.03)
    d.add("a")  # again: now behind b
    await asyncio.sleep(0.035)
    assert expired == ["b"]
    await asyncio.sleep(0.05)
    assert expired == ["b", "a"]


async def test_an_expiry_may_add_and_discard_others() -> None:
    loop = asyncio.get_running_loop()
    expired: list[str] = []
    d: Deadlines[str] = Deadlines(0.02, lambda k: None, loop)

    def expire(key: str) -> None:
        expired.append(key)
        if key == "a":
            d.discard("b")  # due at the same firing, stopped by the one before it
            d.add("c")  # started by an expiry: its timer is armed again
        elif key == "c":
            d.close()

    d._expire = expire
    d.add("a")
    d.add("b")
    await asyncio.sleep(0.1)
    assert expired == ["a", "c"]
    assert len(d) == 0 and d._timer is None


async def test_one_timer_for_a_thousand_deadlines() -> None:
    loop = asyncio.get_running_loop()
    expired: list[int] = []
    d: Deadlines[int] = Deadlines(0.05, expired.append, loop)
    for i in range(1000):
        d.add(i)
    for i in range(0, 1000, 2):
        d.discard(i)
    await asyncio.sleep(0.2)
    assert expired == list(range(1, 1000, 2))


def test_a_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError, match="delay"):
        Deadlines(-1.0, lambda k: None, asyncio.new_event_loop())


@pytest.mark.slow
async def test_the_heap_keeper_collects_once_a_flood_has_drained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gpuremote.proxy.heap as heap

    collected: list[int] = []
    monkeypatch.setattr(heap.gc, "collect", lambda *a: collected.append(1) or 0)
    loop = asyncio.get_running_loop()
    keeper = HeapKeeper(loop, many=8, quiet_s=0.05, collect_every=1000)
    for live in range(1, 101):  # a client that stays, and a flood of 99 more
        keeper.started(live)
    for live in range(99, 0, -1):  # the flood drains
        keeper.ended(live)
    # at half the peak and at each halving after it, many had gone: collected then
    assert len(collected) == 3  # at 50, 25 and 12 left (6, 3, 1: too few went)
    assert keeper.collections == 0 and keeper._timer is not None
    keeper._last_end = loop.time() + 1.0  # as if one more just ended: the timer waits
    await asyncio.sleep(0.1)
    assert keeper.collections == 0 and keeper._timer is not None
    await asyncio.sleep(1.5)
    assert keeper.collections == 1 and len(collected) == 4  # the drain's end
    keeper.started(2)  # an ordinary client comes and goes: nothing more
    keeper.ended(1)
    await asyncio.sleep(0.2)
    assert keeper.collections == 1 and keeper._timer is None
    keeper.close()


async def test_the_heap_keeper_collects_as_sessions_come_and_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A steady coming and going (never a flood's drain): every ``collect_every`` sessions
    ended, the cycles they ended in are collected."""
    import gpuremote.proxy.heap as heap

    collected: list[int] = []
    monkeypatch.setattr(heap.gc, "collect", lambda *a: collected.append(1) or 0)
    keeper = HeapKeeper(asyncio.get_running_loop(), many=64, collect_every=10)
    keeper.started(1)  # a client that stays
    for _ in range(45):  # and 45 that come and go, one at a time
        keeper.started(2)
        keeper.ended(1)
    assert len(collected) == 4
    keeper.close()
