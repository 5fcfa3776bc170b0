"""Pluggable transports, chosen by URL scheme from a registry (``REGISTRY``).

``tcp://host:port`` (asyncio, uvloop when installed), ``tls://host:port`` (the same inside
TLS), ``ucx://host:port`` (UCX: shared memory, RDMA, device memory; the ``[ucx]`` extra),
``inproc://name`` (same process, no sockets), and ``emu+SCHEME://...`` (an emulated link of
chosen latency and bandwidth around any of them). All implement the small interface of
``base``. Modules are imported only when their scheme is used, so that a transport whose
optional library is missing fails with a clear message naming the extra that installs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from gpuremote.errors import TransportUnavailable
from gpuremote.wire.framing import FrameLimits

from .base import Address, Connection, ConnectionHandler, Listener, Transport

__all__ = [
    "REGISTRY",
    "Address",
    "Connection",
    "ConnectionHandler",
    "Listener",
    "Transport",
    "connect",
    "get_transport",
    "listen",
]

#: scheme -> (module, class, the extra that installs what it needs)
REGISTRY: dict[str, tuple[str, str, str | None]] = {
    "tcp": ("gpuremote.transports.tcp", "TcpTransport", None),
    "tls": ("gpuremote.transports.tcp", "TlsTransport", None),
    "inproc": ("gpuremote.transports.inproc", "InprocTransport", None),
    "ucx": ("gpuremote.transports.ucx", "UcxTransport", "ucx"),
}


def get_transport(
    scheme: str,
    limits: FrameLimits = FrameLimits(),
    settings: Mapping[str, Any] | None = None,
    allocate: Callable[[int], memoryview] | None = None,
) -> Transport:
    """The transport for ``scheme``; raises ``TransportUnavailable`` if unknown or not installed.

    ``settings`` are the transport's defaults for what a URL may also say (``tls://``: ``cert``,
    ``key``, ``ca``): the caller passes them (``gpuremote.config.transport_settings``).
    ``emu+SCHEME`` wraps SCHEME's transport in an emulated link (``transports.emulated``)."""
    if scheme.startswith("emu+"):
        from .emulated import EmulatedTransport

        return EmulatedTransport(limits, get_transport(scheme[4:], limits, settings, allocate))
    entry = REGISTRY.get(scheme)
    if entry is None:
        known = ", ".join(f"{s}://" for s in sorted(REGISTRY))
        raise TransportUnavailable(f"unknown transport {scheme!r}; known: {known}")
    module, cls, extra = entry
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        hint = f" (pip install 'gpuremote[{extra}]')" if extra else ""
        raise TransportUnavailable(
            f"the {scheme}:// transport needs a library that is not installed: {exc}{hint}"
        ) from exc
    transport: Transport = getattr(mod, cls)(limits, settings, allocate)
    return transport


async def connect(
    url: str, limits: FrameLimits = FrameLimits(), settings: Mapping[str, Any] | None = None
) -> Connection:
    """Open a connection to ``url``."""
    address = Address.parse(url)
    return await get_transport(address.scheme, limits, settings).connect(address)


async def listen(
    url: str,
    handler: ConnectionHandler,
    limits: FrameLimits = FrameLimits(),
    settings: Mapping[str, Any] | None = None,
    allocate: Callable[[int], memoryview] | None = None,
    device_allocate: Callable[[int], Any] | None = None,
    handshake_limits: FrameLimits | None = None,
) -> Listener:
    """Listen at ``url``, running ``handler(conn)`` for each connection (received buffers
    in memory from ``allocate``, where the transport can; large ones in device memory from
    ``device_allocate``, where the transport moves device memory itself). With
    ``handshake_limits``, each connection takes only frames within those, into fresh host
    memory, until ``conn.admit()``."""
    address = Address.parse(url)
    transport = get_transport(address.scheme, limits, settings, allocate)
    transport.device_allocate = device_allocate
    transport.handshake_limits = handshake_limits
    return await transport.listen(address, handler)
