"""No tenant reads another's memory: what one session wrote is never handed to another,
whatever the front end (the async API, ``gpuremote.xp``, PyTorch) and the path of the
allocation (``empty``, ``resize_``, a compiled graph's buffers), on every backend.

A GPU's caching allocator, like the C heap a CPU proxy's buffers come from, hands a new
buffer memory that another session freed: the proxy zeroes every buffer it allocates (a
memset on the session's stream on a GPU; ``sim:check`` fills freed memory with a poison
pattern instead), and refuses the ATen factories of uninitialised memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from gpuremote.tools.proxyprocess import LocalProxy

#: what the first session writes everywhere (as float32): never to be read by the second
MARK = 4242.25
#: buffer sizes (float32 elements): small ones from the heap's bins, large ones from mmap
SIZES = [16, 1000, 40_000, 300_000, 1_000_000]

_WRITER = textwrap.dedent(
    f"""
    import asyncio, sys
    import numpy as np
    import gpuremote, gpuremote.xp as xp

    url, sizes = sys.argv[1], {SIZES!r}
    for _ in range(3):  # allocated and freed again: the heap keeps some of it for reuse
        with xp.connect(url):
            arrays = [xp.full(n, {MARK!r}, dtype=xp.float32) for n in sizes]
            assert float(xp.sum(arrays[0])) == 16 * {MARK!r}
            del arrays

        async def main():
            async with gpuremote.connect(url) as gpu:
                arrays = [gpu.asarray(np.full(n, {MARK!r}, np.float32)) for n in sizes]
                assert (await arrays[1].get())[0] == {MARK!r}

        asyncio.run(main())
        try:
            import torch
            import gpuremote.torch as gt
        except ImportError:
            continue
        with gt.connect(url):
            tensors = [torch.full((n,), {MARK!r}, device="gpuremote") for n in sizes]
            assert tensors[2].sum().item() == 40_000 * {MARK!r}
            del tensors
    print("written")
    """
)

_READER = textwrap.dedent(
    f"""
    import asyncio, json, sys
    import numpy as np
    import gpuremote, gpuremote.xp as xp

    url, sizes = sys.argv[1], {SIZES!r}
    seen = {{}}

    def look(where, values):
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        seen[where] = [int((values == {MARK!r}).sum()), int((values == 0).sum()), values.size]

    with xp.connect(url):
        for n in sizes:
            look(f"xp.empty {{n}}", np.asarray(xp.empty(n, dtype=xp.float32)))
            look(f"xp.empty_like {{n}}", np.asarray(xp.empty_like(xp.ones(n, dtype=xp.float32))))

    async def main():
        async with gpuremote.connect(url) as gpu:
            for n in sizes:
                look(f"gpu.empty {{n}}", await gpu.empty(n).get())

    asyncio.run(main())
    try:
        import torch
        import gpuremote.torch as gt
    except ImportError:
        torch = None
    if torch is not None:
        with gt.connect(url):
            for n in sizes:
                look(f"torch.empty {{n}}", torch.empty(n, device="gpuremote").cpu().numpy())
                grown = torch.zeros(2, device="gpuremote").resize_(n)
                look(f"torch resize_ {{n}}", grown.cpu().numpy())
            graph = torch.compile(lambda x: torch.empty_like(x) * 1, backend="gpuremote")
            x = torch.ones(300_000, device="gpuremote")
            for k in range(3):  # recorded, then replayed
                look(f"compiled graph {{k}}", graph(x).cpu().numpy())
    print(json.dumps(seen))
    """
)


def _run(program: str, url: str) -> str:
    run = subprocess.run(
        [sys.executable, "-c", program, url], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.fixture(params=["numpy", "sim:check"])
def proxy_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    with LocalProxy("tcp", backend=request.param) as proxy:
        yield request.param, proxy.url


@pytest.mark.slow
def test_a_session_never_reads_what_another_wrote(proxy_url: tuple[str, str]) -> None:
    """One process writes a mark into buffers of many sizes through every front end and
    exits; a second process allocates buffers of those sizes every way there is and reads
    them back: no mark; zeros (or, on ``sim:check``, its poison pattern)."""
    backend, url = proxy_url
    assert "written" in _run(_WRITER, url)
    seen = json.loads(_run(_READER, url).strip().splitlines()[-1])
    assert len(seen) >= 4 * len(SIZES)
    leaked = {where: counts for where, counts in seen.items() if counts[0]}
    assert not leaked, leaked
    if backend == "numpy":
        assert all(zeros == size for _, zeros, size in seen.values()), seen


@pytest.mark.gpu
def test_a_session_never_reads_what_another_wrote_on_a_gpu() -> None:
    """The same on CuPy's memory pool (a memset on the session's stream)."""
    pytest.importorskip("cupy", reason="needs a GPU: cupy is not importable")
    with LocalProxy("tcp", backend="cupy") as proxy:
        assert "written" in _run(_WRITER, proxy.url)
        seen = json.loads(_run(_READER, proxy.url).strip().splitlines()[-1])
    assert not {where: counts for where, counts in seen.items() if counts[0]}


def test_the_proxy_refuses_factories_of_uninitialised_memory() -> None:
    """``empty`` on the proxy would hand out what its allocator last freed: the client
    makes empty tensors by ``alloc`` (zeroed); the op itself is not on the allow-list."""
    from gpuremote.proxy.aten import resolve_op
    from gpuremote.proxy.state import CallFailed

    pytest.importorskip("torch")
    for name in ("empty.memory_format", "empty_strided.default", "new_empty.default"):
        with pytest.raises(CallFailed, match="allow-list"):
            resolve_op(name)
