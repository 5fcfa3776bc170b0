"""The connection layer: from a URL to an authenticated client session.

``open_session`` connects (the transport the URL's scheme names), reads the proxy's greeting,
answers its challenge when it asks for a secret, and says hello; it returns the session (the
pipeline that queues, batches and sends calls) and the proxy's description of its device.
Every client of a proxy opens its sessions here: the async front end (``gpuremote.connect``),
``gpuremote.xp``'s devices, a proxy's links to other proxies, and ``gpuremote top``.

URLs that name a group of proxies rather than one (``pool://NAME``) are resolved first, by the
placer registered for their scheme (``PLACERS``, like the transports' registry): it answers
the URLs of the proxies to use and the options to connect with (the pool's secret).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Sequence
from typing import Any

from ..config import PipelineConfig, pipeline_config, transport_settings
from ..errors import AuthenticationError, ConfigError
from ..transports import Address
from ..transports import connect as transport_connect
from ..wire.auth import load_secret, proof
from ..wire.calls import CALLS_BY_NAME
from ..wire.framing import FrameLimits
from ..wire.protocol import PROTOCOL_VERSION, decode_greeting
from .pipeline import ClientSession

__all__ = ["PLACERS", "open_session", "place", "place_now", "placed"]

_HELLO = CALLS_BY_NAME["hello"]

#: scheme -> the module whose ``place(name, k, exclude)`` (async) and ``place_now(name, k)``
#: answer ``(urls, secret)`` for ``SCHEME://NAME``; imported on first use
PLACERS: dict[str, str] = {"pool": "gpuremote.pool.placement"}


def placed(url: str) -> tuple[str, str] | None:
    """``(scheme, name)`` if ``url`` names a group of proxies (a registered placer's
    scheme), else ``None``."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in PLACERS:
        return None
    name = rest.strip("/")
    if not name or "/" in name or "?" in name:
        raise ConfigError(f"{url!r}: a {scheme} URL is {scheme}://NAME")
    return scheme, name


def _placer(scheme: str) -> Any:
    return importlib.import_module(PLACERS[scheme])


async def place(
    url: str, k: int = 1, exclude: Sequence[str] = ()
) -> tuple[list[str], dict[str, Any]]:
    """The URLs of ``k`` proxies for ``url`` (none of ``exclude``), and the options to connect
    to them with (``url`` itself where it names one proxy, then ``k`` must be 1)."""
    group = placed(url)
    if group is None:
        if k != 1:
            raise ConfigError(f"devices= needs a URL that names a group of proxies, not {url!r}")
        return [url], {}
    urls, secret = await _placer(group[0]).place(group[1], k, list(exclude))
    return list(urls), {"secret": secret}


def place_now(url: str, k: int = 1) -> tuple[list[str], dict[str, Any]]:
    """``place`` for synchronous code."""
    group = placed(url)
    if group is None:
        if k != 1:
            raise ConfigError(f"devices= needs a URL that names a group of proxies, not {url!r}")
        return [url], {}
    urls, secret = _placer(group[0]).place_now(group[1], k)
    return list(urls), {"secret": secret}


async def open_session(
    url: str,
    *,
    pipeline: PipelineConfig | None = None,
    limits: FrameLimits = FrameLimits(),
    **options: Any,
) -> tuple[ClientSession, dict[str, Any]]:
    """Connect to the proxy at ``url``, authenticate and say hello: the session and the
    proxy's device description. ``options``: ``secret=``, ``connect_timeout=`` (seconds,
    default 10) and pipeline settings (``gpuremote.config.PipelineConfig``)."""
    secret = load_secret(options.pop("secret", None))
    timeout = options.pop("connect_timeout", 10.0)
    cfg = pipeline or pipeline_config(options)
    settings = transport_settings(Address.parse(url).scheme)
    conn = await transport_connect(url, limits, settings)
    try:
        greeting = decode_greeting(await asyncio.wait_for(conn.recv(), timeout))
    except BaseException:
        conn.close()
        raise
    answer = ""
    if greeting["auth"]:
        if secret is None:
            conn.close()
            raise AuthenticationError(
                f"the proxy at {url} requires a shared secret: pass secret=..., or set "
                "GPUREMOTE_SECRET, GPUREMOTE_SECRET_FILE or [auth] in gpuremote.toml"
            )
        answer = proof(secret, greeting["nonce"])
    session = ClientSession(conn, cfg)
    session.url = url
    try:
        info, _ = await asyncio.wait_for(
            session.call(_HELLO, 0, [PROTOCOL_VERSION, answer]), timeout
        )
    except AuthenticationError:
        await session.aclose()
        raise AuthenticationError(f"the proxy at {url} refused the secret") from None
    except BaseException:
        await session.aclose()
        raise
    return session, dict(info)
