"""A pool of proxies run as Ray actors (the ``[ray]`` extra).

Ray places each proxy on a node with the GPUs it asks for (``num_gpus``; Ray sets
``CUDA_VISIBLE_DEVICES``) and restarts it when it dies; gpuremote keeps its own data path
(tcp://, ucx://) between clients and proxies, so bulk data never goes through Ray::

    import ray, gpuremote.pool as gr
    ray.init()                                   # or ray.init(address="auto")
    pool = gr.start_pool(2, name="team")         # 2 proxies, 1 GPU each
    async with gpuremote.connect("pool://team") as gpu: ...
    pool.stop()

Two parts: ``placement`` (what a client needs: ``pool://NAME`` resolved, the ``Pool`` handle;
it imports nothing of the proxy) and ``actors`` (the proxies and the manager, which run on the
cluster; ``start_pool``). ``start_pool``, ``ProxyActor`` and ``PoolManager`` are imported from
``actors`` on first use.
"""

from __future__ import annotations

from typing import Any

from .placement import (
    NAMESPACE,
    Pool,
    PoolError,
    attach,
    get_pool,
    place,
    place_now,
    start_local,
)

__all__ = [
    "NAMESPACE",
    "Pool",
    "PoolError",
    "PoolManager",
    "ProxyActor",
    "attach",
    "get_pool",
    "place",
    "place_now",
    "start_local",
    "start_pool",
]

_ACTORS = ("PoolManager", "ProxyActor", "start_pool")


def __getattr__(name: str) -> Any:
    """The actors' names, imported when first asked for (they run proxies)."""
    if name in _ACTORS:
        from . import actors

        return getattr(actors, name)
    raise AttributeError(f"module 'gpuremote.pool' has no attribute {name!r}")
