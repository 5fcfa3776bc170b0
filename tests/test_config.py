"""Where the URL and pipeline settings come from: argument, environment, config file, default."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpuremote.transports import REGISTRY, Address, get_transport

import gpuremote
from gpuremote.config import (
    DEFAULT_URL,
    PipelineConfig,
    load_config_file,
    pipeline_config,
    resolve_url,
)
from gpuremote.errors import ConfigError, TransportUnavailable


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("GPUREMOTE_URL", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)


def test_precedence_argument_env_file_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert resolve_url() == DEFAULT_URL
    user = tmp_path / "xdg" / "gpuremote"
    user.mkdir(parents=True)
    (user / "gpuremote.toml").write_text('url = "tcp://user-config:1"\n')
    assert resolve_url() == "tcp://user-config:1"
    (tmp_path / "gpuremote.toml").write_text('url = "tcp://cwd-config:2"\n')
    assert resolve_url() == "tcp://cwd-config:2"
    monkeypatch.setenv("GPUREMOTE_URL", "tcp://env:3")
    assert resolve_url() == "tcp://env:3"
    assert resolve_url("inproc://arg") == "inproc://arg"


async def test_transport_switched_by_url_env_and_config_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tcp_proxy, inproc_proxy = gpuremote.Proxy("numpy"), gpuremote.Proxy("numpy")
    tcp_url = await tcp_proxy.start("tcp://127.0.0.1:0")
    inproc_url = await inproc_proxy.start("inproc://config-test")
    try:

        async def served_by() -> str:
            async with gpuremote.connect() as gpu:  # application code: no URL in it
                np.testing.assert_array_equal(await gpu.asarray(np.ones(2)).get(), np.ones(2))
                return gpu.url

        (tmp_path / "gpuremote.toml").write_text(f'url = "{tcp_url}"\n')
        assert await served_by() == tcp_url
        monkeypatch.setenv("GPUREMOTE_URL", inproc_url)
        assert await served_by() == inproc_url
        async with gpuremote.connect(tcp_url) as gpu:
            assert gpu.url == tcp_url
        assert tcp_proxy.sessions_served == 2 and inproc_proxy.sessions_served == 1
    finally:
        await tcp_proxy.close()
        await inproc_proxy.close()


def test_pipeline_settings_from_file_and_overrides(tmp_path: Path) -> None:
    (tmp_path / "gpuremote.toml").write_text("[pipeline]\nbatching = false\nmax_batch_calls = 7\n")
    cfg = pipeline_config()
    assert cfg.batching is False and cfg.max_batch_calls == 7 and cfg.async_calls is True
    cfg = pipeline_config({"async_calls": False, "max_batch_calls": None})
    assert cfg.async_calls is False and cfg.max_batch_calls == 7
    with pytest.raises(ConfigError, match="unknown pipeline"):
        pipeline_config({"turbo": True})
    with pytest.raises(ConfigError):
        PipelineConfig(max_batch_calls=0)
    with pytest.raises(ConfigError):
        PipelineConfig(spin_us=-1)
    assert pipeline_config({"spin_us": 50}).spin_us == 50


def test_bad_config_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "gpuremote.toml").write_text("url = [unclosed")
    with pytest.raises(ConfigError, match=r"gpuremote\.toml"):
        load_config_file()


def test_unknown_scheme_and_bad_urls() -> None:
    with pytest.raises(TransportUnavailable, match="known: inproc://, tcp://"):
        get_transport("carrier-pigeon")
    with pytest.raises(ConfigError):
        Address.parse("localhost:5151")
    with pytest.raises(ConfigError):
        Address.parse("tcp://host:notaport")
    assert Address.parse("tcp://[::1]:7?x=1").url() == "tcp://[::1]:7"
    assert set(REGISTRY) >= {"tcp", "inproc"}


async def test_connecting_to_nothing_fails_fast() -> None:
    with pytest.raises(gpuremote.ConnectionClosed):
        await gpuremote.connect("tcp://127.0.0.1:1")
    with pytest.raises(gpuremote.ConnectionClosed, match="no in-process proxy"):
        await gpuremote.connect("inproc://nobody-here")
