"""How a failover session is set up: its settings (``FailoverConfig``, from ``failover=`` and
its tuning), the proxies it may move to (``Targets``), and what it counts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError, FailoverError
from ..connection import place, placed
from ..contract import Counters

__all__ = ["FailoverConfig", "FailoverCounters", "Targets", "failover_config"]


@dataclass(frozen=True, slots=True)
class FailoverConfig:
    """How a failover session keeps its state: ``urls``, the proxies to move to outside a
    pool (empty: the pool's); a checkpoint at least every ``checkpoint_interval_s``, and as
    soon as the journal holds ``journal_max_calls`` calls or ``journal_max_bytes`` of host
    data; a move gives up after ``failover_timeout_s`` without a proxy."""

    urls: tuple[str, ...] = ()
    checkpoint_interval_s: float = 1.0
    journal_max_bytes: int = 64 << 20
    journal_max_calls: int = 1 << 16
    failover_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if (
            self.checkpoint_interval_s <= 0
            or self.journal_max_bytes < 1
            or self.journal_max_calls < 1
            or self.failover_timeout_s <= 0
        ):
            raise ConfigError("failover settings must be positive")


_TUNING = ("checkpoint_interval_s", "journal_max_bytes", "journal_max_calls", "failover_timeout_s")


def failover_config(url: str, options: dict[str, Any]) -> FailoverConfig | None:
    """The failover settings in ``options`` (taken out of it): ``failover=True`` (a pool://
    URL) or a list of URLs, and the tuning of ``FailoverConfig``; ``None``: no failover."""
    value = options.pop("failover", None)
    tuning = {k: options.pop(k) for k in _TUNING if k in options}
    if value is None or value is False:
        if tuning:
            raise ConfigError(f"{', '.join(sorted(tuning))} need failover=")
        return None
    if value is True:
        if placed(url) is None:
            raise ConfigError(
                f"failover=True needs a pool:// URL, not {url!r}; outside a pool, give the "
                "proxies to move to: failover=['tcp://a:5151', 'tcp://b:5151']"
            )
        return FailoverConfig((), **tuning)
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ConfigError("failover= takes True (a pool) or a list of proxy URLs")
    urls = [str(u) for u in value]
    if any(placed(u) is not None for u in urls) or placed(url) is not None:
        raise ConfigError("failover=[...] lists single proxies; for a pool, pass failover=True")
    return FailoverConfig(tuple(dict.fromkeys([url, *urls])), **tuning)


@dataclass(slots=True)
class FailoverCounters(Counters):
    """``Counters`` plus what failover did: moves, their pauses, checkpoints and the bytes
    they copied (to a standby proxy, or into the client)."""

    failovers: int = 0
    pause_s: list[float] = field(default_factory=list)
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    checkpoint_bytes_to_client: int = 0
    journal_calls: int = 0  # calls in the journal now


class Targets:
    """The proxies a session may move to: the pool's (placed), or a list's."""

    def __init__(self, url: str, cfg: FailoverConfig) -> None:
        self.pool = url if not cfg.urls else None
        self.urls = cfg.urls

    async def take(self, exclude: set[str]) -> tuple[str, dict[str, Any]]:
        """A proxy to open a session on (none of ``exclude``); raises when there is none now."""
        if self.pool is not None:
            (url,), extra = await place(self.pool, 1, sorted(exclude))
            return url, extra
        for url in self.urls:
            if url not in exclude:
                return url, {}
        raise FailoverError("no proxy of the failover list is left")

    async def each(self, exclude: set[str]) -> list[tuple[str, dict[str, Any]]]:
        """The candidates, in order (a pool places one)."""
        if self.pool is not None:
            return [await self.take(exclude)]
        return [(u, {}) for u in self.urls if u not in exclude]
