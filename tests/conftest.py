"""Shared fixtures: an in-process proxy, reached over inproc://, tcp:// and ucx://, on each
backend of ``GPUREMOTE_TEST_BACKENDS``.

``GPUREMOTE_TEST_BACKENDS`` (default ``numpy,sim:check``; ``cupy`` where CuPy and a GPU are
present) chooses the backends that the end-to-end tests run on. NumPy and CuPy run over every
transport; ``sim:check`` (the simulated device as a checker of stream semantics) over inproc://
only, since what it checks does not depend on the transport and the suite must stay fast.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np
import pytest

import gpuremote
from gpuremote.backends.numpy_backend import NumpyBackend
from gpuremote.proxy import Proxy

_names = itertools.count()

# PyTorch's autograd engine sizes its device threads at its first backward pass: the
# ``gpuremote`` device must exist by then, whichever test runs a backward pass first
with contextlib.suppress(ImportError):  # without the [torch] extra, its tests skip
    import gpuremote.torch


def _ucx_missing() -> str | None:
    try:
        import ucxx  # noqa: F401
    except Exception as exc:  # not installed, or its libraries cannot load
        return f"ucx:// needs the [ucx] extra: {type(exc).__name__}: {exc}"
    return None


_NO_UCX = _ucx_missing()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests (or parameters) marked ``ucx`` skip, with the reason, where ucxx is missing."""
    if _NO_UCX is None:
        return
    for item in items:
        if item.get_closest_marker("ucx") is not None:
            item.add_marker(pytest.mark.skip(reason=_NO_UCX))


SCHEMES = [
    "inproc",
    "tcp",
    pytest.param("ucx", marks=pytest.mark.skipif(_NO_UCX is not None, reason=str(_NO_UCX))),
]


@pytest.fixture(params=SCHEMES)
def scheme(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def wanted_backends() -> list[str]:
    """The backends of ``GPUREMOTE_TEST_BACKENDS`` (default ``numpy,sim:check``)."""
    names = [
        n.strip()
        for n in os.environ.get("GPUREMOTE_TEST_BACKENDS", "numpy,sim:check").split(",")
        if n.strip()
    ]
    for n in names:
        if n not in ("numpy", "cupy") and not n.startswith("sim"):
            raise pytest.UsageError(f"GPUREMOTE_TEST_BACKENDS: unknown backend {n!r}")
    return names


_NO_CUPY: str | None = None
if "cupy" in wanted_backends():
    from gpuremote.backends import cupy_usable

    _ok, _why = cupy_usable()
    _NO_CUPY = None if _ok else f"the cupy backend needs a GPU: {_why}"


def backend_params() -> list[Any]:
    """``(scheme, backend)`` parameters: each test backend over the schemes it runs on
    (``sim...`` over inproc:// only; ``cupy`` skipped, with the reason, without a GPU)."""
    params: list[Any] = []
    for backend in wanted_backends():
        for name in ("inproc", "tcp", "ucx"):
            if backend.startswith("sim") and name != "inproc":
                continue
            marks = []
            if name == "ucx" and _NO_UCX is not None:
                marks.append(pytest.mark.skip(reason=_NO_UCX))
            if backend == "cupy" and _NO_CUPY is not None:
                marks.append(pytest.mark.skip(reason=_NO_CUPY))
            params.append(pytest.param((name, backend), id=f"{name}-{backend}", marks=marks))
    return params


@pytest.fixture(params=backend_params())
def backend_scheme(request: pytest.FixtureRequest) -> tuple[str, str]:
    """``(scheme, backend)`` of an end-to-end test."""
    name, backend = request.param
    return str(name), str(backend)


@pytest.fixture(scope="module", params=backend_params())
def module_backend_scheme(request: pytest.FixtureRequest) -> tuple[str, str]:
    """``(scheme, backend)`` of a module's end-to-end tests that share one proxy."""
    name, backend = request.param
    return str(name), str(backend)


@pytest.fixture(
    params=[
        pytest.param(
            b, id=b, marks=[pytest.mark.skip(reason=_NO_CUPY)] if b == "cupy" and _NO_CUPY else []
        )
        for b in wanted_backends()
    ]
)
def each_backend(request: pytest.FixtureRequest) -> str:
    """Each test backend (for end-to-end tests whose transport is fixed, e.g. tcp://)."""
    return str(request.param)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            b, id=b, marks=[pytest.mark.skip(reason=_NO_CUPY)] if b == "cupy" and _NO_CUPY else []
        )
        for b in wanted_backends()
    ],
)
def module_each_backend(request: pytest.FixtureRequest) -> str:
    """Each test backend, for a module's tests that share one proxy in this process."""
    return str(request.param)


@pytest.fixture
def backend_name(backend_scheme: tuple[str, str]) -> str:
    """The backend an end-to-end test's proxy runs (``numpy``, ``sim:check``, ``cupy``)."""
    return backend_scheme[1]


@pytest.fixture
async def proxy(backend_scheme: tuple[str, str]) -> AsyncIterator[tuple[Proxy, str]]:
    scheme, backend = backend_scheme
    p = Proxy(backend)
    url = f"inproc://test-{next(_names)}" if scheme == "inproc" else f"{scheme}://127.0.0.1:0"
    bound = await p.start(url)
    try:
        yield p, bound
    finally:
        await p.close()


@pytest.fixture
async def url(proxy: tuple[Proxy, str]) -> str:
    return proxy[1]


@pytest.fixture
async def gpu(url: str) -> AsyncIterator[gpuremote.GPU]:
    async with gpuremote.connect(url) as g:
        yield g


@pytest.fixture
def tls_files(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A throwaway CA and a certificate for 127.0.0.1, written to files and named in a
    config file's ``[tls]`` table (``XDG_CONFIG_HOME``): proxies and clients started from
    here, in this process or another, use them for tls://."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = {k: str(tmp_path / f"{k}.pem") for k in ("cert", "key", "ca")}
    cert.cert_chain_pems[0].write_to_path(files["cert"])
    cert.private_key_pem.write_to_path(files["key"])
    ca.cert_pem.write_to_path(files["ca"])
    home = tmp_path / "config"
    (home / "gpuremote").mkdir(parents=True)
    table = "".join(f'{k} = "{v}"\n' for k, v in files.items())
    (home / "gpuremote" / "gpuremote.toml").write_text(f"[tls]\n{table}")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    monkeypatch.chdir(tmp_path)  # no gpuremote.toml of the checkout's in the way
    return files


PythonJson = Callable[..., dict[str, Any]]


@pytest.fixture
def python_json() -> PythonJson:
    """``run(program, **env)``: ``program`` (dedented) run by a fresh interpreter with ``env``
    added to the environment; what it printed last, a JSON object."""
    import textwrap

    def run(program: str, **env: str) -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(program)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        out: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
        return out

    return run


class Cli(Protocol):
    def __call__(
        self, *args: str, timeout: float = ..., env: Mapping[str, str] | None = ...
    ) -> subprocess.CompletedProcess[str]: ...


def _run_cli(
    *args: str, timeout: float = 120, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m gpuremote ARGS`` as a user runs it (without a GPUREMOTE_URL of ours)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "GPUREMOTE_URL"}
    return subprocess.run(
        [sys.executable, "-m", "gpuremote", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env),
    )


@pytest.fixture
def cli() -> Cli:
    """Runs the ``gpuremote`` command."""
    return _run_cli


@pytest.fixture
def cli_json(cli: Cli) -> Callable[..., Any]:
    """Runs ``gpuremote ARGS --json``; checks it succeeded and returns the one JSON object
    that stdout holds (and nothing else)."""

    def run(*args: str) -> Any:
        proc = cli(*args, "--json")
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    return run


# -- a backend with device memory of its own, on a machine with no GPU -------------------------
class OnDevice(np.ndarray):  # type: ignore[type-arg]
    """NumPy memory that ``DeviceBackend`` calls its device memory."""


class DeviceBackend(NumpyBackend):
    """NumPy, with large received buffers in "device" memory (``OnDevice``)."""

    def device_allocator(self) -> Any:
        return lambda n: np.empty(n, np.uint8).view(OnDevice)

    def is_device(self, buf: Any) -> bool:
        return isinstance(buf, OnDevice)

    def device_copy_out(self, src: Any, stream: Any) -> Any:
        return np.array(src).reshape(-1).view(np.uint8).view(OnDevice)

    def received(self, data: np.ndarray) -> Any:
        """``data`` as a transport would have received it into this device memory."""
        return np.frombuffer(data.tobytes(), np.uint8).copy().view(OnDevice)


@pytest.fixture
def device_backend() -> DeviceBackend:
    """A backend with "device" memory of its own on a machine with no GPU: NumPy memory
    that the backend calls device memory, standing in for CuPy where a test checks what a
    transport that moves device memory itself (ucx://) does with it."""
    return DeviceBackend()


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """One local Ray instance for the whole test session (the pool's tests, DDP on a pool)."""
    ray = pytest.importorskip("ray", reason="the pool needs Ray: pip install 'gpuremote[ray]'")
    import gpuremote.pool as gr

    gr.start_local()
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
