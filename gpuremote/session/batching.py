"""When queued calls go to the proxy: a session's one batching policy (``BatchPolicy``), made
from its ``PipelineConfig``, for both ways calls are queued.

- **On the session's event loop** (``ClientSession.submit``: the async API, and whatever a
  synchronous front end hands over): a frame goes when a call waits (it carries everything
  queued before it), when it holds ``max_batch_calls`` calls or ``max_batch_bytes`` bytes, at
  the loop's next turn, or ``flush_delay_us`` after its first call where that is set.
- **Posted from the application's threads** (``gpuremote.core.driver``: ``gpuremote.xp`` and
  ``gpuremote.torch``, whose threads drive the loop only while a call waits): a posted call is
  taken by the next call that waits, with no thread hand-off; one that no waiting call takes is
  sent by the driver's helper thread ``post_delay_us`` after the oldest post (the first work of
  a step reaches the proxy at once). While posting goes on without a waiting call, each frame
  the helper sends makes the next wait four times longer, up to ``post_delay_max_us`` (a long
  stretch of posts goes in a few frames, not one per ``post_delay_us``, while the proxy works on
  the earlier ones), back to ``post_delay_us`` at the next waiting call; ``post_batch_calls``
  posts go at once whatever the delay (0: by the delay alone). Posts that are due when a thread
  posts another go from that thread (it holds the interpreter: the helper would get it only up
  to Python's switch interval later), as does a compiled graph's replay with ``replays_at_once``
  (the proxy runs the graph while the client goes on); the helper sends what is due while the
  posting threads are elsewhere. No post for ``idle_after_us``: the device is idle, the helper
  sleeps until a post wakes it, and buffers released meanwhile are freed at once. While the
  device is in use the helper comes by every ``post_delay_max_us`` unwoken, so a synchronous op
  (whose posts its own waiting call takes) wakes no thread; a lone post that no waiting call
  takes goes within ``post_delay_max_us``.

The policy decides; the session and the driver only act on its answers.
"""

from __future__ import annotations

from ..config import PipelineConfig

__all__ = ["BatchPolicy"]


class BatchPolicy:
    """When a session's queued calls go (see the module docstring)."""

    __slots__ = (
        "delay_s",
        "flush_delay_s",
        "idle_s",
        "max_bytes",
        "max_calls",
        "post_batch",
        "post_delay_max_s",
        "post_delay_s",
        "replays_at_once",
    )

    def __init__(self, config: PipelineConfig) -> None:
        self.max_calls = config.max_batch_calls
        self.max_bytes = config.max_batch_bytes
        #: a frame goes this long after its first call (0: at the loop's next turn)
        self.flush_delay_s = config.flush_delay_us / 1e6
        self.post_delay_s = config.post_delay_us / 1e6
        #: the longest a post waits while posting goes on, and the helper's round when busy
        self.post_delay_max_s = max(config.post_delay_max_us / 1e6, self.post_delay_s)
        self.post_batch = config.post_batch_calls or 1 << 62
        self.idle_s = config.idle_after_us / 1e6
        self.replays_at_once = config.replays_at_once
        #: how long the oldest post may wait now (grows with each frame of posts sent)
        self.delay_s = self.post_delay_s

    # -- frames on the loop ---------------------------------------------------------------------
    def frame_full(self, calls: int, nbytes: int, age_s: float) -> bool:
        """Whether a frame of ``calls`` calls and ``nbytes`` bytes, whose first call was
        queued ``age_s`` ago, goes now."""
        return (
            calls >= self.max_calls
            or nbytes >= self.max_bytes
            or (self.flush_delay_s > 0 and age_s >= self.flush_delay_s)
        )

    # -- calls posted from other threads ------------------------------------------------------
    def post_due(self, posts: int, age_s: float) -> bool:
        """Whether ``posts`` posts, the oldest ``age_s`` old, are to be sent now."""
        return posts >= self.post_batch or age_s >= self.delay_s

    def post_wait_s(self, posts: int, age_s: float) -> float:
        """How much longer posts may wait for a waiting call (0: send them now)."""
        if posts >= self.post_batch:
            return 0.0
        return max(self.delay_s - age_s, 0.0)

    def sent_posts(self, posts: int) -> None:
        """The helper sent ``posts`` posts: while posting goes on, the next may wait longer
        (not after a full batch: a stream of many small posts goes on at the first delay)."""
        if posts < self.post_batch:
            self.delay_s = min(self.delay_s * 4, self.post_delay_max_s)

    def taken(self) -> None:
        """A waiting call took the posts: the next goes at the first delay again."""
        self.delay_s = self.post_delay_s

    def idle(self, since_post_s: float) -> bool:
        """Whether the device is idle: no post for ``since_post_s``."""
        return since_post_s >= self.idle_s

    @property
    def frees_alone(self) -> bool:
        """Whether the helper sends released buffers' frees by themselves once the device is
        idle (it sends posts at all before the device would count as idle)."""
        return self.post_delay_s < self.idle_s
