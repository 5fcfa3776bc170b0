"""Shared fixtures: an in-process proxy on the NumPy backend, reached over inproc:// and tcp://."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import pytest

import gpuremote
from gpuremote.proxy import Proxy

_names = itertools.count()


@pytest.fixture(params=["inproc", "tcp"])
def scheme(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def proxy(scheme: str) -> AsyncIterator[tuple[Proxy, str]]:
    p = Proxy("numpy")
    url = f"inproc://test-{next(_names)}" if scheme == "inproc" else "tcp://127.0.0.1:0"
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
