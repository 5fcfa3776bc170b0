"""The overhead model: replay a recorded call trace over a network of given RTT and bandwidth.

As in the paper's model (see ``shared/notes/paper.md``), call by call: the client issues call
``i`` after its own time since the previous call (``gap``); an ASYNC call costs the client only
its send and travels to the device, which runs calls in order, in parallel with the client; a
SYNC call also waits for the device queue to reach it and for its reply to come back. A
message takes ``rtt / 2`` plus ``bytes * 8 / bw`` on the wire. Unlike the paper's code, latency
is pipelined (consecutive messages do not wait for each other's arrival), as on a real link;
bandwidth is serialised per direction. With the optimisations off, every call is a round
trip, and ``get()``s answered from host copies move their bytes.

``Costs`` holds what the real software adds per call (client send, proxy handling) and the
round trip of the real path underneath an emulated link, for comparing with measurements.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import PipelineConfig
from ..session.batching import BatchPolicy
from .direct import TraceEntry

__all__ = ["Costs", "Prediction", "load_trace", "local_seconds", "predict", "save_trace"]


@dataclass(frozen=True, slots=True)
class Costs:
    """Software costs of the remoting path itself (all in seconds)."""

    client_per_call: float = 0.0  # the client's own cost of making a remote call
    proxy_per_call: float = 0.0  # the proxy's cost of decoding and dispatching one call
    base_rtt: float = 0.0  # round trip of the real path under the emulated link
    base_bw: float | None = None  # bytes/s of the real path (its time adds to the link's)
    client_per_trip: float = 0.0  # the client's cost of one round trip beyond its calls'


@dataclass(frozen=True, slots=True)
class Prediction:
    """The model's prediction of a workload's step: its time remote and local, its round trips."""

    seconds: float
    local_seconds: float
    round_trips: int

    @property
    def slowdown(self) -> float:
        return self.seconds / self.local_seconds - 1 if self.local_seconds else 0.0


def local_seconds(trace: Sequence[TraceEntry]) -> float:
    """The time of ``trace`` run locally: the client's gaps and each call's host time, with
    the device's own time (``kernel_s``, a simulated device that times itself) running in
    parallel with the client, waited for at the synchronous calls."""
    client = device = 0.0
    for c in trace:
        client += c.gap_s + c.device_s
        if c.kernel_s:
            device = max(client, device) + c.kernel_s
        if c.klass == "sync":
            client = max(client, device)
    return client


def predict(
    trace: Sequence[TraceEntry],
    rtt_s: float,
    bw_bps: float | None,
    *,
    optimized: bool = True,
    costs: Costs = Costs(),
    batched: bool = False,
    max_batch_calls: int = 1024,
    max_batch_bytes: int = 4 << 20,
    posts: PipelineConfig | None = None,
) -> Prediction:
    """Predicted time of ``trace`` remoted over (``rtt_s``, ``bw_bps``).

    The proxy handles calls in order (``proxy_per_call`` plus the call's host time
    ``device_s``); a call's device time ``kernel_s`` runs on the device's own queue, in
    parallel with the proxy, which waits for it only at a synchronous call. ``batched``:
    asynchronous calls go out together with the next synchronous one, as gpuremote's
    pipeline sends them when the client next waits, or at once when they reach
    ``max_batch_calls`` or ``max_batch_bytes`` (else each goes out when issued). ``posts``:
    asynchronous calls go as a synchronous front end's driver sends what it posts under that
    configuration's policy (``gpuremote.session.batching``): with the next synchronous call,
    when ``post_batch_calls`` are held, at the first post after the oldest one's delay, a
    compiled graph's replay (``step_run``) at once with ``replays_at_once``, or by the helper
    thread, which comes by every ``post_delay_max_us`` (from the trace's start) while
    nothing is held and waits for the oldest post to fall due; frees (released, not posted)
    go with the next frame."""
    half = (rtt_s + costs.base_rtt) / 2

    def wire(nbytes: int) -> float:
        t = 0.0 if not bw_bps else nbytes * 8 / bw_bps
        return t + (nbytes / costs.base_bw if costs.base_bw else 0.0)

    client = 0.0  # when the client is free to issue its next call
    up = down = 0.0  # when each direction of the link is free
    proxy = 0.0  # when the proxy has handled everything sent to it
    device = 0.0  # when the device has run everything sent to it
    trips = 0
    held: list[TraceEntry] = []  # batched: calls waiting for the next send
    held_bytes = 0

    def handle(c: TraceEntry, arrival: float) -> None:
        nonlocal proxy, device
        proxy = max(arrival, proxy) + costs.proxy_per_call + c.device_s
        if c.kernel_s:
            device = max(proxy, device) + c.kernel_s

    policy = BatchPolicy(posts) if posts is not None and optimized else None
    first = 0.0  # when the oldest held post was issued (``posts``)
    n_posts = 0  # the held calls that count as posts (a free does not: it joins a frame)
    helper = 0.0  # when the driver's helper thread next comes by

    def send_held(at: float) -> None:
        nonlocal up, held, held_bytes, n_posts
        up = max(at, up) + wire(held_bytes)
        for x in held:
            handle(x, up + half)
        held, held_bytes, n_posts = [], 0, 0

    def helper_until(t: float) -> None:
        """The helper's rounds up to ``t``: it sends posts that are due when it comes by,
        waits for the oldest to fall due, else comes by again ``post_delay_max`` later."""
        nonlocal helper
        assert policy is not None
        rounds = max(policy.post_delay_max_s, 20e-6)  # (its shortest wait)
        while helper <= t:
            if not n_posts or first > helper:  # nothing posted when it came by
                helper += rounds
                continue
            due = first + policy.delay_s
            if due > helper:
                helper = due
                continue
            n = n_posts
            send_held(helper)
            policy.sent_posts(n)
            helper += rounds

    for c in trace:
        client += c.gap_s
        if policy is not None:
            helper_until(client)
        kind = c.klass
        nin = c.bytes_in
        if kind == "local":
            if optimized or not c.shadow_bytes:
                continue
            kind, nin = "sync", c.shadow_bytes  # without shadowing, a real transfer
        if not optimized:
            kind = "sync"
        client += costs.client_per_call
        if policy is not None and kind != "sync":
            held.append(c)
            held_bytes += c.bytes_out
            if c.call == "free":  # released, not posted: goes with the next frame
                continue
            if not n_posts:
                first = client
            n_posts += 1
            if policy.post_due(n_posts, client - first):
                n = n_posts
                send_held(client)
                policy.sent_posts(n)
            elif c.call == "step_run" and policy.replays_at_once:
                send_held(client)
                policy.taken()
            continue
        if batched and kind != "sync":
            held.append(c)
            held_bytes += c.bytes_out
            if len(held) < max_batch_calls and held_bytes < max_batch_bytes:
                continue
        if policy is not None:
            policy.taken()  # a waiting call takes what is held
        sent = held if batched and kind != "sync" else [*held, c]
        up = max(client, up) + wire(held_bytes + (0 if sent is held else c.bytes_out))
        held, held_bytes, n_posts = [], 0, 0  # (the next post starts a batch of its own)
        for x in sent:
            handle(x, up + half)
        if kind == "sync":
            if c.klass != "async":  # a read or a synchronize waits for the device; an
                proxy = max(proxy, device)  # acknowledged launch does not
            down = max(proxy, down) + wire(nin)
            client = down + half + costs.client_per_trip
            trips += 1
    if held:  # sent when the client finishes; nothing waits for them
        up = max(client, up) + wire(sum(x.bytes_out for x in held))
    return Prediction(max(client, 0.0), local_seconds(trace), trips)


def save_trace(path: str | Path, trace: Iterable[TraceEntry], **meta: Any) -> None:
    """Write a trace as JSON: ``{"meta": {...}, "calls": [...]}``."""
    Path(path).write_text(json.dumps({"meta": meta, "calls": [t.as_dict() for t in trace]}))


def load_trace(path: str | Path) -> tuple[list[TraceEntry], dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    return [TraceEntry(**c) for c in data["calls"]], dict(data.get("meta", {}))
