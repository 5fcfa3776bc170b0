"""Where a bench's proxy is: a running one (``--url``), or a local one it starts and stops."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gpuremote.transports import Address

from gpuremote.config import load_config_file
from gpuremote.proxy import Proxy
from gpuremote.tools.proxyprocess import LocalProxy

from .baseline import echo_service

__all__ = ["Target", "TargetOptions", "open_target"]


@dataclass
class TargetOptions:
    """Where a bench's proxy is: a running one at ``url``, or one it starts (transport,
    backend). Every bench's configuration starts with these."""

    url: str | None = None
    transport: str = "tcp"
    backend: str = "auto"


@dataclass
class Target:
    """The proxy a bench measures: its URL and transport, its process where local."""

    url: str
    transport: str
    proxy_pid: int | None  # for memory figures, when the proxy is a local process

    @property
    def host(self) -> str:
        host = Address.parse(self.url).host
        return host if host and self.transport != "inproc" else "127.0.0.1"


@contextlib.asynccontextmanager
async def open_target(
    url: str | None,
    transport: str = "tcp",
    backend: str = "auto",
    *,
    proxy_cpus: set[int] | None = None,
    proxy_args: tuple[str, ...] = (),
) -> AsyncIterator[Target]:
    """Use the proxy at ``url`` (else ``GPUREMOTE_URL`` or the config file's), or start one
    (with ``serve --bench-echo``, so that the baselines run beside it; on ``proxy_cpus`` from
    its start, if given; with ``proxy_args``, more of ``serve``'s options)."""
    url = url or os.environ.get("GPUREMOTE_URL") or load_config_file().get("url")
    if url:
        yield Target(url, Address.parse(url).scheme, None)
        return
    if transport == "inproc":
        proxy = Proxy(backend, services=[echo_service])
        bound = await proxy.start("inproc://bench")
        try:
            yield Target(bound, "inproc", os.getpid())
        finally:
            await proxy.close()
        return
    extra = ("--bench-echo", "--quiet", *proxy_args)
    local = LocalProxy(transport, backend, extra_args=extra, cpus=proxy_cpus)
    try:
        bound = local.start()
        yield Target(bound, transport, local.pid)
    finally:
        local.stop()
