"""Where a bench's proxy is: a running one (``--url``), or a local one it starts and stops."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gpuremote.transports import Address

from gpuremote.config import load_config_file
from gpuremote.localproxy import LocalProxy
from gpuremote.proxy import Proxy

__all__ = ["Target", "open_target"]

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", ""}


@dataclass
class Target:
    url: str
    transport: str
    started: bool  # the bench started this proxy
    proxy_pid: int | None  # for memory figures, when the proxy is a local process
    local_host: bool

    @property
    def host(self) -> str:
        host = Address.parse(self.url).host
        return host if host and self.transport != "inproc" else "127.0.0.1"


@contextlib.asynccontextmanager
async def open_target(
    url: str | None, transport: str = "tcp", backend: str = "auto"
) -> AsyncIterator[Target]:
    """Use the proxy at ``url`` (else ``GPUREMOTE_URL`` or the config file's), or start one."""
    import os

    url = url or os.environ.get("GPUREMOTE_URL") or load_config_file().get("url")
    if url:
        addr = Address.parse(url)
        yield Target(
            url,
            addr.scheme.split("+")[-1],
            False,
            None,
            addr.host in _LOCAL_HOSTS or addr.host.startswith("127.") or addr.scheme == "inproc",
        )
        return
    if transport == "inproc":
        proxy = Proxy(backend, bench_echo=True)
        bound = await proxy.start("inproc://bench")
        try:
            yield Target(bound, "inproc", True, os.getpid(), True)
        finally:
            await proxy.close()
        return
    local = LocalProxy(transport, backend, extra_args=("--bench-echo", "--quiet"))
    try:
        bound = local.start()
        yield Target(bound, transport, True, local.pid, True)
    finally:
        local.stop()
