"""The actors of a pool of proxies on Ray (the ``[ray]`` extra): the proxies and the manager.

Ray places each proxy on a node with the GPUs it asks for and restarts it when it dies (see
``gpuremote.pool`` for the use); this module runs proxies, so a client never imports it.

A pool is a detached manager actor named ``NAME`` (namespace ``gpuremote``) and ``n`` detached
proxy actors. The manager holds the pool's secret and its admin token, both made when the pool
starts: they reach the proxies as a Ray call's result, never on a command line or in a log.
Clients get the secret only (admin calls, ``gpuremote top``, need the token, which the pool's
driver side fetches with ``Pool.credentials``). It places each new session on the least-loaded
live proxy (sessions, then device memory), counting the sessions it placed that have not
connected yet, and tells every proxy the pool's members: its peers, the only proxies it copies
arrays from.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import secrets
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ..aio import new_event_loop
from .placement import NAMESPACE, Pool, PoolError, attach, await_ref

if TYPE_CHECKING:
    from ..proxy.server import Proxy

__all__ = ["PoolManager", "ProxyActor", "start_pool"]

#: how long a placed session counts against its proxy before it connects
_RESERVATION_S = 10.0
#: how long the manager waits for a proxy's status before it counts the proxy as dead
_PROBE_S = 1.0


# -- the actors ------------------------------------------------------------------------------
class ProxyActor:
    """One proxy of a pool: a ``gpuremote.Proxy`` on an event loop of its own thread."""

    def __init__(
        self,
        pool: str,
        index: int,
        backend: str,
        transport: str,
        serve_options: dict[str, Any],
    ) -> None:
        import ray

        from ..proxy.server import Proxy, raise_open_files_limit

        manager = ray.get_actor(pool, namespace=NAMESPACE)
        secret, admin_token = ray.get(manager.credentials.remote())
        self.index = index
        self.node = ray.get_runtime_context().get_node_id()
        host = ray.util.get_node_ip_address()
        raise_open_files_limit()
        self._loop = new_event_loop()
        self._proxy = Proxy(backend, secret=secret, admin_token=admin_token, **serve_options)
        started: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=self._serve, args=(f"{transport}://{host}:0", started), daemon=True
        )
        self._thread.start()
        self.url = started.result(60)
        self._rate_mark = (time.monotonic(), 0)
        manager.register.remote(index, self.url, self.node, os.getpid())

    def _serve(self, url: str, started: concurrent.futures.Future[str]) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            try:
                started.set_result(await self._proxy.start(url))
            except BaseException as exc:
                started.set_exception(exc)
                raise
            await self._stop.wait()
            await self._proxy.close(grace=1.0)

        self._loop.run_until_complete(main())

    def set_peers(self, urls: list[str]) -> bool:
        """The pool's proxies, from which this one may copy arrays (``x.to_device``)."""
        self._loop.call_soon_threadsafe(self._proxy.set_peers, urls)
        return True

    def status(self) -> dict[str, Any]:
        """This proxy's figures: url, node, pid, sessions, device_bytes, calls_per_s."""
        fut = asyncio.run_coroutine_threadsafe(_figures(self._proxy), self._loop)
        figures = fut.result(5)
        figures.update(index=self.index, url=self.url, node=self.node)
        now = time.monotonic()
        then, calls = self._rate_mark
        self._rate_mark = (now, figures["calls"])
        rate = max(0.0, (figures["calls"] - calls) / (now - then)) if calls else 0.0
        figures["calls_per_s"] = rate
        return figures

    def shutdown(self) -> bool:
        """Stop serving: clients are told, work in flight finishes (about a second)."""
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        return True


async def _figures(proxy: Proxy) -> dict[str, Any]:
    """A proxy's load, read on its loop (a function, not a method: a Ray actor with a
    coroutine method would be an async actor, and ``ProxyActor`` blocks in its calls)."""
    live = [c for c in proxy.clients.values() if c.started]
    return {
        "pid": os.getpid(),
        "backend": proxy.backend.name,
        "sessions": len(proxy.clients),  # those still in their handshake too
        "sessions_served": proxy.sessions_served,
        "device_bytes": sum(c.executor.device_bytes for c in live) + proxy.tickets.held_bytes(),
        "calls": proxy.calls_ended
        + sum(c.executor.counts["sync"] + c.executor.counts["async"] for c in live),
    }


class PoolManager:
    """The pool's manager actor: its proxies, its secret, placement."""

    def __init__(
        self,
        name: str,
        n: int,
        secret: bytes,
        admin_token: str,
        proxy_options: dict[str, Any],
        backend: str,
        transport: str,
        serve_options: dict[str, Any],
    ) -> None:
        import ray

        self.name = name
        self._secret = secret
        # the proxies' admin token (`gpuremote top --url pool://NAME`): the manager's own,
        # made apart from the secret that every client of the pool is given
        self._admin_token = admin_token
        remote = ray.remote(ProxyActor)
        self.proxies = [
            remote.options(
                name=f"{name}.proxy{i}",
                namespace=NAMESPACE,
                lifetime="detached",
                get_if_exists=True,  # the manager restarted: its proxies live on
                **proxy_options,
            ).remote(name, i, backend, transport, serve_options)
            for i in range(n)
        ]
        self.urls: list[str | None] = [None] * n
        self.starts = [0] * n
        self._served = [0] * n  # sessions_served at the last look
        self._reserved: list[deque[float]] = [deque() for _ in range(n)]
        self._lock = asyncio.Lock()

    async def credentials(self) -> tuple[bytes, str]:
        return self._secret, self._admin_token

    async def register(self, index: int, url: str, node: str, pid: int) -> None:
        """A proxy (re)started and listens at ``url``: every proxy learns its peers anew."""
        self.starts[index] += 1
        self.urls[index] = url
        self._served[index] = 0
        self._reserved[index].clear()
        urls = [u for u in self.urls if u is not None]
        for proxy in self.proxies:
            proxy.set_peers.remote(urls)  # fire and forget: a dead one learns at its restart

    async def actors(self) -> list[Any]:
        return list(self.proxies)

    async def status(self, skip: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
        """One dict per proxy: url, node, alive, sessions, device_bytes, calls_per_s,
        restarts (and pid, backend, pending: sessions placed, not yet connected). Proxies
        whose URL is in ``skip`` are not asked (counted as not alive)."""

        async def none() -> None:
            return None

        figures = await asyncio.gather(
            *(
                none() if self.urls[i] in skip else self._probe(p)
                for i, p in enumerate(self.proxies)
            )
        )
        now = time.monotonic()
        out = []
        for i, fig in enumerate(figures):
            reserved = self._reserved[i]
            while reserved and reserved[0] < now - _RESERVATION_S:
                reserved.popleft()
            row: dict[str, Any] = {
                "index": i,
                "url": self.urls[i],
                "alive": fig is not None,
                "restarts": max(0, self.starts[i] - 1),
                "pending": len(reserved),
            }
            if fig is None:
                row.update(node=None, sessions=0, device_bytes=0, calls_per_s=0.0)
            else:
                connected = fig["sessions_served"] - self._served[i]
                if connected < 0:  # a new process: its count starts again
                    connected, reserved = 0, deque()
                    self._reserved[i] = reserved
                for _ in range(min(connected, len(reserved))):
                    reserved.popleft()
                self._served[i] = fig["sessions_served"]
                row["pending"] = len(reserved)
                row.update(
                    url=fig["url"],
                    node=fig["node"],
                    pid=fig["pid"],
                    backend=fig["backend"],
                    sessions=fig["sessions"],
                    device_bytes=fig["device_bytes"],
                    calls_per_s=fig["calls_per_s"],
                )
            out.append(row)
        return out

    async def place(self, k: int = 1, exclude: list[str] | None = None) -> tuple[list[str], bytes]:
        """URLs of ``k`` different live proxies (none of ``exclude``), the least loaded first,
        and the secret."""
        avoid = frozenset(exclude or ())
        async with self._lock:  # the excluded are not asked: a dead one takes _PROBE_S
            rows = [r for r in await self.status(avoid) if r["alive"] and r["url"] not in avoid]
            if len(rows) < k:
                besides = " besides those excluded" if avoid else ""
                raise PoolError(
                    f"pool {self.name!r} has {len(rows)} live proxies{besides}; {k} were asked for"
                )
            rows.sort(key=lambda r: (r["sessions"] + r["pending"], r["device_bytes"], r["index"]))
            chosen = rows[:k]
            now = time.monotonic()
            for r in chosen:
                self._reserved[r["index"]].append(now)
            return [r["url"] for r in chosen], self._secret

    async def stop(self) -> None:
        """Stop every proxy (gracefully, then for good)."""
        import ray

        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                asyncio.gather(*(await_ref(p.shutdown.remote()) for p in self.proxies)), 15
            )
        for p in self.proxies:
            with contextlib.suppress(Exception):
                ray.kill(p, no_restart=True)

    async def _probe(self, proxy: Any) -> dict[str, Any] | None:
        try:
            fig: dict[str, Any] = await asyncio.wait_for(await_ref(proxy.status.remote()), _PROBE_S)
        except Exception:  # dead, restarting, or too slow to count as live
            return None
        return fig


# -- the driver's side -------------------------------------------------------------------------
def start_pool(
    n: int,
    *,
    name: str = "gpuremote",
    num_gpus: float = 1,
    num_cpus: float = 0,
    backend: str = "auto",
    transport: str = "tcp",
    max_restarts: int = -1,
    address: str | None = None,
    wait: bool = True,
    **serve_options: Any,
) -> Pool:
    """Start ``n`` proxies as detached, named Ray actors, each with ``num_gpus`` GPUs
    (``num_gpus=0`` and ``backend="numpy"`` on machines without GPUs), spread over the
    cluster's nodes and restarted by Ray when they die (``max_restarts``, -1: always).
    ``serve_options`` go to ``gpuremote.Proxy`` (``session_limits=``, ``max_clients=``, ...).
    Returns once every proxy listens (``wait``)."""
    if n < 1:
        raise ValueError("a pool needs at least one proxy")
    if transport not in ("tcp", "ucx", "tls"):
        raise ValueError(f"a pool's proxies serve tcp, tls or ucx, not {transport!r}")
    ray = attach(address)
    with contextlib.suppress(ValueError):
        ray.get_actor(name, namespace=NAMESPACE)
        raise PoolError(f"a pool named {name!r} is running; stop it first")
    proxy_options = {
        "num_gpus": num_gpus,
        "num_cpus": num_cpus,
        "max_restarts": max_restarts,
        "max_task_retries": 0,
        "scheduling_strategy": "SPREAD",
    }
    manager = (
        ray.remote(PoolManager)
        .options(
            name=name,
            namespace=NAMESPACE,
            lifetime="detached",
            num_cpus=0,
            max_restarts=-1,
            max_concurrency=64,
        )
        .remote(
            name,
            n,
            secrets.token_bytes(32),
            secrets.token_hex(16),
            proxy_options,
            backend,
            transport,
            serve_options,
        )
    )
    pool = Pool(name, manager)
    if wait:
        try:
            pool.wait_ready()
        except BaseException:
            pool.stop()
            raise
    return pool
