"""The one place that decides what session a URL and its options get, for both front ends.

``open`` gives one session: on the proxy the URL names (argument, ``GPUREMOTE_URL``, the
config file, the default), on a pool's least-loaded proxy (``pool://NAME``), or one that
moves to another proxy when its own is lost (``failover=``). ``devices(url, k)`` (and its
synchronous twin) gives the URLs of ``k`` different proxies of a pool, for ``k`` sessions; the
front ends open one session on each (the async front end on its loop, ``gpuremote.xp`` on
each device's own). Neither front end imports the sessions it does not name.
"""

from __future__ import annotations

from typing import Any

from ..config import PipelineConfig, resolve_url
from ..errors import ConfigError
from ..wire.framing import FrameLimits
from .connection import open_session, place, place_now, placed
from .contract import Session
from .failover import failover_config, open_failover_session

__all__ = ["devices", "devices_now", "group", "names_group", "open"]


async def open(
    url: str | None = None,
    *,
    pipeline: PipelineConfig | None = None,
    limits: FrameLimits = FrameLimits(),
    **options: Any,
) -> tuple[Session, dict[str, Any]]:
    """A session to what ``url`` names (see the module docstring), and the proxy's
    description of its device. ``options``: ``secret=``, ``connect_timeout=``, pipeline
    settings (``gpuremote.config.PipelineConfig``), ``failover=`` and its tuning
    (``gpuremote.session.failover.FailoverConfig``)."""
    target = resolve_url(url)
    options = dict(options)
    failover = failover_config(target, options)
    if failover is not None:
        return await open_failover_session(
            target, failover, pipeline=pipeline, limits=limits, **options
        )
    (first,), extra = await place(target, 1)
    return await open_session(first, pipeline=pipeline, limits=limits, **{**options, **extra})


def names_group(url: str | None) -> bool:
    """Whether ``url`` (resolved) names a group of proxies (``pool://NAME``)."""
    return placed(resolve_url(url)) is not None


def group(url: str | None, k: int, options: dict[str, Any]) -> str:
    """The pool URL that ``devices=k`` places on: checked at once, one way for both front
    ends (``ConfigError``)."""
    if options.get("failover"):
        raise ConfigError("failover= takes one session at a time; connect each device alone")
    target = resolve_url(url)
    if placed(target) is None:
        raise ConfigError(f"devices= needs a pool:// URL, not {target!r}")
    if k < 1:
        raise ConfigError("devices must be at least 1")
    return target


async def devices(
    url: str | None, k: int, options: dict[str, Any]
) -> tuple[list[str], dict[str, Any]]:
    """The URLs of ``k`` different proxies of the pool ``url`` names, and ``options`` with
    what connecting to them takes (the pool's secret)."""
    urls, extra = await place(group(url, k, options), k)
    return urls, {**options, **extra}


def devices_now(
    url: str | None, k: int, options: dict[str, Any]
) -> tuple[list[str], dict[str, Any]]:
    """``devices`` for synchronous code."""
    urls, extra = place_now(group(url, k, options), k)
    return urls, {**options, **extra}
