"""The session's one batching policy (``gpuremote.session.batching``): its decisions, from the
knobs of ``PipelineConfig`` alone, and what the synchronous front ends' helper does with them
(a lone post goes within ``post_delay_max_us``; a synchronous op wakes no thread:
``tests/test_inproc.py``)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import gpuremote.xp as gx
from gpuremote.config import PipelineConfig
from gpuremote.session.batching import BatchPolicy


def test_every_batching_knob_is_a_pipeline_setting() -> None:
    names = {f.name for f in dataclasses.fields(PipelineConfig)}
    knobs = {
        "max_batch_calls",
        "max_batch_bytes",
        "flush_delay_us",
        "post_delay_us",
        "post_delay_max_us",
        "post_batch_calls",
        "idle_after_us",
        "replays_at_once",
    }
    assert knobs <= names


def test_frames_go_when_full_or_due() -> None:
    policy = BatchPolicy(PipelineConfig(max_batch_calls=4, max_batch_bytes=100))
    assert not policy.frame_full(3, 99, 10.0)  # no delay set: at the loop's next turn
    assert policy.frame_full(4, 0, 0.0) and policy.frame_full(1, 100, 0.0)
    delayed = BatchPolicy(PipelineConfig(flush_delay_us=500))
    assert not delayed.frame_full(1, 1, 0.0004) and delayed.frame_full(1, 1, 0.0005)


def test_posts_wait_longer_while_posting_goes_on_and_reset_at_a_waiting_call() -> None:
    policy = BatchPolicy(
        PipelineConfig(post_delay_us=100, post_delay_max_us=1000, post_batch_calls=8)
    )
    assert policy.post_wait_s(1, 0.0) == 100e-6 and not policy.post_due(1, 50e-6)
    assert policy.post_due(1, 100e-6) and policy.post_due(8, 0.0)  # due, or a full batch
    assert policy.post_wait_s(8, 0.0) == 0.0
    policy.sent_posts(1)
    assert policy.delay_s == 400e-6
    policy.sent_posts(1)
    policy.sent_posts(1)
    assert policy.delay_s == 1000e-6  # capped
    policy.sent_posts(8)  # a full batch does not lengthen the wait
    assert policy.delay_s == 1000e-6
    policy.taken()
    assert policy.delay_s == 100e-6
    assert BatchPolicy(PipelineConfig(post_batch_calls=0)).post_wait_s(10**6, 0.0) > 0
    assert not policy.idle(0.049) and policy.idle(0.05)


def test_a_lone_post_goes_within_the_policys_longest_delay() -> None:
    """A post that no waiting call takes is sent by the helper within ``post_delay_max_us``
    (and at ``post_delay_us`` when posting has just begun)."""
    device = gx.Device(serve="numpy", post_delay_us=2000, post_delay_max_us=2000)
    try:
        x = gx.asarray(np.arange(16, dtype=np.float32), device=device)
        float(gx.sum(x))  # a waiting call: what came before went with it
        counters = device.session.counters
        sent = counters.frames_sent
        t0 = time.perf_counter()
        y = x + 1.0  # posted; nothing waits for it
        while counters.frames_sent == sent and time.perf_counter() - t0 < 2.0:
            time.sleep(0.0002)
        took = time.perf_counter() - t0
        assert counters.frames_sent > sent
        assert 0.0015 <= took < 0.2, took  # the delay, then the helper's send
        assert float(gx.sum(y)) == 136.0
    finally:
        device.close()


def test_posts_due_go_from_the_thread_that_posts() -> None:
    """A post that finds the oldest due (or a full batch) sends them itself: the helper
    would get the interpreter only at Python's switch interval while this thread runs."""
    device = gx.Device(serve="numpy", post_delay_us=1e9, post_delay_max_us=1e9, post_batch_calls=3)
    try:
        x = gx.asarray(np.arange(16, dtype=np.float32), device=device)
        float(gx.sum(x))
        counters = device.session.counters
        sent = counters.frames_sent
        y = x + 1.0
        z = y * 2.0
        assert counters.frames_sent == sent  # two posts: not due for a long while
        w = z - 1.0  # the third: a full batch, sent before the post returns
        assert counters.frames_sent == sent + 1 and not device._posted
        assert float(gx.sum(w)) == float(np.sum((np.arange(16) + 1.0) * 2.0 - 1.0))
    finally:
        device.close()


def test_a_replay_goes_at_once_unless_the_policy_says_otherwise() -> None:
    """``send_replay`` (a compiled graph's replay just posted) sends what is posted from
    this thread; with ``replays_at_once`` off it waits, as any post, for a waiting call."""
    for at_once in (True, False):
        device = gx.Device(
            serve="numpy",
            post_delay_us=1e9,
            post_delay_max_us=1e9,
            post_batch_calls=0,
            replays_at_once=at_once,
        )
        try:
            x = gx.asarray(np.arange(16, dtype=np.float32), device=device)
            float(gx.sum(x))
            counters = device.session.counters
            sent = counters.frames_sent
            y = x + 1.0  # (posted: stands for the replay)
            device.send_replay()
            assert counters.frames_sent == sent + at_once
            assert float(gx.sum(y)) == 136.0
        finally:
            device.close()


def test_a_captured_steps_replay_goes_at_once() -> None:
    """``xp.capture``'s replays go as they are made too (the policy's ``replays_at_once``)."""
    device = gx.Device(serve="numpy", post_delay_us=1e9, post_delay_max_us=1e9, post_batch_calls=0)
    try:
        step = gx.capture(lambda v: v * 2.0 + 1.0)
        x = gx.asarray(np.arange(4, dtype=np.float32), device=device)
        float(gx.sum(step(x)))  # recorded
        float(gx.sum(step(x)))  # replayed once
        counters = device.session.counters
        sent = counters.frames_sent
        y = step(x)
        assert counters.frames_sent == sent + 1
        assert float(gx.sum(y)) == 16.0
    finally:
        device.close()
