"""Shared-secret authentication by challenge and response; the secret never crosses the wire.

On each new connection the proxy sends a greeting with a fresh random nonce and whether it
requires authentication. The client answers in its ``hello`` call with
``HMAC-SHA256(secret, "gpuremote-auth-v1" + nonce)``; the proxy checks it with a constant-time
comparison before it runs anything, and closes the connection on a wrong or missing proof.
The secret comes from an argument, ``GPUREMOTE_SECRET``, ``GPUREMOTE_SECRET_FILE``, or the
config file's ``[auth]`` table (``secret`` or ``secret_file``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from pathlib import Path
from typing import Any

from ..config import load_config_file
from ..errors import ConfigError

__all__ = [
    "NONCE_BYTES",
    "is_loopback",
    "load_secret",
    "new_nonce",
    "proof",
    "verify",
]

NONCE_BYTES = 32
_CONTEXT = b"gpuremote-auth-v1"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(secret: bytes, nonce: bytes) -> str:
    """What a client that knows ``secret`` answers to ``nonce``."""
    return hmac.new(secret, _CONTEXT + nonce, hashlib.sha256).hexdigest()


def verify(secret: bytes, nonce: bytes, answer: str) -> bool:
    """Constant-time check of a client's answer."""
    return hmac.compare_digest(proof(secret, nonce).encode(), answer.encode())


def load_secret(
    secret: str | bytes | None = None,
    *,
    secret_file: str | None = None,
    config: dict[str, Any] | None = None,
) -> bytes | None:
    """The shared secret: argument, file argument, environment, config file; else ``None``."""
    if secret:
        return secret.encode() if isinstance(secret, str) else secret
    path = secret_file or os.environ.get("GPUREMOTE_SECRET_FILE")
    env = os.environ.get("GPUREMOTE_SECRET")
    if not path and env:
        return env.encode()
    if not path:
        table = (load_config_file() if config is None else config).get("auth", {})
        if table.get("secret"):
            return str(table["secret"]).encode()
        path = table.get("secret_file")
    if not path:
        return None
    try:
        data = Path(path).expanduser().read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the secret file {path}: {exc}") from None
    if len(data) < 16:
        raise ConfigError(f"the secret in {path} is too short (16 bytes at least)")
    return data


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine."""
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
