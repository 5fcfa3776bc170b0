"""Where settings come from: a function argument, else ``GPUREMOTE_URL``, else a config file
(``gpuremote.toml`` in the working directory, then in the user's config directory), else the
default. Application code never changes to switch transport or pipeline settings.

A config file looks like::

    url = "tcp://10.0.0.5:5151"

    [pipeline]
    async_calls = true        # ASYNC calls do not wait for a reply
    batching = true           # queued calls go out together in one frame
    shadow = true             # keep host copies of uploads; answer get() from them
    max_batch_calls = 1024
    max_batch_bytes = 4194304
    flush_delay_us = 0        # 0: flush when control returns to the event loop
    post_delay_us = 200       # gpuremote.xp / torch: a post no waiting call takes goes then
    post_delay_max_us = 8000  # ... the longest, while posting goes on
    post_batch_calls = 16     # ... this many go at once (0: by the delay alone)
    replays_at_once = true    # ... a compiled graph's replay goes at once
    idle_after_us = 50000     # ... no post this long: idle (frees go at once)
    call_timeout_s = 30       # fail a call (and the session) after this long without reply

The batching knobs are ``PipelineConfig``'s; ``gpuremote.session.batching`` says how they
work together.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = [
    "DEFAULT_URL",
    "ENV_URL",
    "PipelineConfig",
    "config_paths",
    "load_config_file",
    "pipeline_config",
    "resolve_url",
]

DEFAULT_URL = "tcp://127.0.0.1:5151"
ENV_URL = "GPUREMOTE_URL"
CONFIG_NAME = "gpuremote.toml"


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Switches and bounds of the client's command pipeline, its batching policy's knobs
    among them (``gpuremote.session.batching``: when queued calls go)."""

    async_calls: bool = True
    batching: bool = True
    shadow: bool = True
    #: a frame that holds this many calls, or bytes, goes at once
    max_batch_calls: int = 1024
    max_batch_bytes: int = 4 << 20
    #: a frame goes this long after its first call (0: when control returns to the loop)
    flush_delay_us: float = 0.0
    #: calls posted by a synchronous front end (``gpuremote.xp``, ``gpuremote.torch``) that
    #: no waiting call takes go this long after the oldest of them ...
    post_delay_us: float = 200.0
    #: ... and, while posting goes on, at most this long (each frame sent lets the next wait
    #: four times longer, back to ``post_delay_us`` at the next waiting call)
    post_delay_max_us: float = 8000.0
    #: ... and at once once this many wait (0: by the delay alone): few, so that a device
    #: that has run what it had gets the next ops soon (on a simulated A100 across two
    #: processes, eager ResNet-18 +10% over PyTorch alone with 16, +30% with 64; the cost,
    #: more frames: a chain of tiny xp ops 8-18% fewer a second)
    post_batch_calls: int = 16
    #: ... and a compiled graph's replay goes at once, from the thread that posts it (the
    #: proxy runs the graph while the client goes on)
    replays_at_once: bool = True
    #: no post for this long: the device is idle (released buffers are freed at once)
    idle_after_us: float = 50_000.0
    shadow_max_bytes: int = 64 << 20  # host copies larger than this are not kept
    call_timeout_s: float | None = None  # a SYNC call with no reply by then: proxy gone
    #: while a SYNC call waits, keep the event loop polling (not sleeping) for up to this
    #: long: the reply is read as it lands instead of after a wake-up (CUDA's spin-wait);
    #: costs CPU for the time spun, so off by default
    spin_us: float = 0.0

    def __post_init__(self) -> None:
        if (
            self.max_batch_calls < 1
            or self.max_batch_bytes < 1
            or self.flush_delay_us < 0
            or self.spin_us < 0
            or self.post_delay_us < 0
            or self.post_delay_max_us < 0
            or self.post_batch_calls < 0
            or self.idle_after_us < 0
        ):
            raise ConfigError("pipeline bounds must be positive")


def config_paths() -> list[Path]:
    """Config files looked at, in order of precedence."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return [Path.cwd() / CONFIG_NAME, Path(base) / "gpuremote" / CONFIG_NAME]


def load_config_file(path: Path | None = None) -> dict[str, Any]:
    """The first config file found (or ``path``), parsed; ``{}`` if there is none."""
    candidates = [path] if path is not None else config_paths()
    for p in candidates:
        if p.is_file():
            try:
                with p.open("rb") as fh:
                    data = tomllib.load(fh)
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"cannot read config file {p}: {exc}") from None
            data.setdefault("_path", str(p))
            return data
    return {}


def resolve_url(url: str | None = None, *, config: dict[str, Any] | None = None) -> str:
    """The proxy URL: argument, else environment, else config file, else the default."""
    if url:
        return url
    env = os.environ.get(ENV_URL)
    if env:
        return env
    cfg = load_config_file() if config is None else config
    value = cfg.get("url")
    if value is not None:
        if not isinstance(value, str):
            raise ConfigError(f"'url' in {cfg.get('_path', 'config')} must be a string")
        return value
    return DEFAULT_URL


def url_for_rank(url: str, rank: int) -> str:
    """The URL of ``rank`` (a distributed job's process) where ``url`` lists one proxy per
    rank, comma-separated: the ``rank``-th, modulo their number; else ``url``."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    return urls[rank % len(urls)] if urls else url


def transport_settings(scheme: str, *, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config file's defaults for transport ``scheme`` (``[tls]`` for ``tls://``), which
    the client and the proxy pass to the transport."""
    cfg = load_config_file() if config is None else config
    base = scheme.removeprefix("emu+")
    table = cfg.get(base, {}) if base in ("tls", "ucx") else {}
    if not isinstance(table, dict):
        raise ConfigError(f"[{base}] in {cfg.get('_path', 'config')} must be a table")
    return dict(table)


def pipeline_config(
    overrides: dict[str, Any] | None = None, *, config: dict[str, Any] | None = None
) -> PipelineConfig:
    """Pipeline settings from the config file's ``[pipeline]`` table, then ``overrides``."""
    cfg = load_config_file() if config is None else config
    table = dict(cfg.get("pipeline", {}))
    table.update({k: v for k, v in (overrides or {}).items() if v is not None})
    known = {f.name for f in fields(PipelineConfig)}
    unknown = set(table) - known
    if unknown:
        raise ConfigError(f"unknown pipeline setting(s): {', '.join(sorted(unknown))}")
    try:
        return replace(PipelineConfig(), **table)
    except TypeError as exc:
        raise ConfigError(f"bad pipeline settings: {exc}") from None
