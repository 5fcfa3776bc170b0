"""The proxy side: what serves clients on the machine that owns the GPU.

``server`` (the ``Proxy``: listeners, admission, peers) gives each connection a ``session``
(its executor, device queue and replies); ``executor`` runs a session's calls on a backend,
``steps`` keeps and replays its recorded steps; ``devicequeue`` and ``scheduler`` decide when
batches run; ``peers`` copies between proxies; ``deadlines``, ``heap``, ``monitor`` and
``metrics`` keep the process healthy and observable. Nothing here is imported by the client
side.
"""

from .server import Proxy, Service, raise_open_files_limit, serve

__all__ = ["Proxy", "Service", "raise_open_files_limit", "serve"]
