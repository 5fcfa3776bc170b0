"""Where a client's sessions go in a pool of proxies on Ray: ``pool://NAME`` resolved (the
connection layer's placer for the ``pool`` scheme), and the driver's handle on a pool
(``Pool``: status, URLs, credentials, stop). It talks to the pool's manager actor through Ray
and imports nothing of the proxy side (the actors, which run proxies, are
``gpuremote.pool.actors``).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from ..errors import ConfigError, GpuRemoteError

__all__ = [
    "NAMESPACE",
    "Pool",
    "PoolError",
    "attach",
    "await_ref",
    "get_pool",
    "place",
    "place_now",
    "start_local",
]

#: the Ray namespace of every pool's actors
NAMESPACE = "gpuremote"


class PoolError(GpuRemoteError):
    """No such pool, or it cannot place a session."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("pools of proxies need Ray: pip install 'gpuremote[ray]'") from exc
    return ray


def attach(address: str | None = None) -> Any:
    """``ray`` attached to a cluster: the one this process is in, else ``address`` (else
    ``RAY_ADDRESS``, else a cluster started on this machine with ``ray start``)."""
    ray = _ray()
    if not ray.is_initialized():
        try:
            ray.init(
                address=address or os.environ.get("RAY_ADDRESS") or "auto",
                namespace=NAMESPACE,
                log_to_driver=False,
                configure_logging=False,
            )
        except ConnectionError as exc:
            raise PoolError(
                f"no Ray cluster to attach to ({exc}); start one with `ray start --head`, "
                "or give its address"
            ) from None
    return ray


def start_local(num_cpus: int = 2) -> Any:
    """``ray`` started in this process, a cluster of this machine alone (a bench's or a
    test's local pool)."""
    ray = _ray()
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        namespace=NAMESPACE,
        log_to_driver=False,
        configure_logging=False,
    )
    return ray


async def await_ref(ref: Any) -> Any:
    """A Ray object ref, awaited."""
    return await ref


class Pool:
    """A pool of proxies (``start_pool`` or ``get_pool``)."""

    def __init__(self, name: str, manager: Any) -> None:
        self.name = name
        self._manager = manager

    @property
    def url(self) -> str:
        """What clients connect to: ``pool://NAME``."""
        return f"pool://{self.name}"

    @property
    def actors(self) -> list[Any]:
        """The proxies' Ray actor handles, in the order of ``status()``."""
        ray = _ray()
        actors: list[Any] = ray.get(self._manager.actors.remote())
        return actors

    def status(self) -> list[dict[str, Any]]:
        """One dict per proxy: ``url``, ``node``, ``alive``, ``sessions``, ``device_bytes``,
        ``calls_per_s``, ``restarts``."""
        ray = _ray()
        rows: list[dict[str, Any]] = ray.get(self._manager.status.remote())
        return rows

    def urls(self) -> list[str]:
        """The live proxies' URLs."""
        return [r["url"] for r in self.status() if r["alive"]]

    def wait_ready(self, timeout: float = 120.0) -> list[dict[str, Any]]:
        """Wait until every proxy is alive; returns ``status()``."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.status()
            if all(r["alive"] for r in rows):
                return rows
            if time.monotonic() > deadline:
                down = [r["index"] for r in rows if not r["alive"]]
                raise PoolError(f"pool {self.name!r}: proxies {down} did not start in {timeout}s")
            time.sleep(0.2)

    def credentials(self) -> tuple[bytes, str]:
        """The pool's secret and its proxies' admin token (for ``gpuremote top``), fetched
        through Ray."""
        ray = _ray()
        secret, token = ray.get(self._manager.credentials.remote())
        return secret, token

    def stop(self) -> None:
        """Stop the proxies and the manager."""
        ray = _ray()
        with contextlib.suppress(Exception):
            ray.get(self._manager.stop.remote(), timeout=30)
        with contextlib.suppress(Exception):
            ray.kill(self._manager, no_restart=True)

    def __repr__(self) -> str:
        return f"<gpuremote.pool.Pool {self.name!r}>"


def get_pool(name: str = "gpuremote", *, address: str | None = None) -> Pool:
    """The running pool ``name``; ``PoolError`` if there is none."""
    ray = attach(address)
    try:
        manager = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise PoolError(f"no pool named {name!r} in this Ray cluster") from None
    return Pool(name, manager)


async def place(name: str, k: int = 1, exclude: list[str] | None = None) -> tuple[list[str], bytes]:
    """For ``connect("pool://NAME")``: the URLs of ``k`` proxies of the pool (none of
    ``exclude``) and its secret."""
    pool = get_pool(name)
    try:
        urls, secret = await await_ref(pool._manager.place.remote(k, exclude or []))
    except Exception as exc:
        cause = getattr(exc, "cause", None) or exc
        raise PoolError(str(cause)) from None
    return urls, secret


def place_now(name: str, k: int = 1) -> tuple[list[str], bytes]:
    """``place`` for synchronous code (``gpuremote.xp``)."""
    ray = _ray()
    pool = get_pool(name)
    try:
        urls, secret = ray.get(pool._manager.place.remote(k))
    except Exception as exc:
        cause = getattr(exc, "cause", None) or exc
        raise PoolError(str(cause)) from None
    return urls, secret
