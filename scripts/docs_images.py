"""Make the documentation's terminal pictures (SVG, exported by rich) from real runs on this
machine: ``gpuremote top`` watching a proxy with two clients at work, ``bench ping``'s table,
``bench ops --workload``'s table. Run from the project's root (``.venv/bin/python
scripts/docs_images.py``); the pictures go to ``docs/images/`` and are committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any

import numpy as np
from gpuremote.bench import render
from gpuremote.bench.ping import PingConfig, run_ping
from gpuremote.bench.torch_ops import run_torch_ops
from rich.console import Console

import gpuremote
from gpuremote.proxy import Proxy
from gpuremote.session.connection import open_session
from gpuremote.tools.top import fetch, rates
from gpuremote.tools.top import render as top_view

OUT = Path(__file__).resolve().parent.parent / "docs" / "images"
TOKEN = "docs-images"


def _save(name: str, renderable: Any, title: str, width: int = 110) -> None:
    console = Console(record=True, width=width, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    (OUT / f"{name}.svg").write_text(console.export_svg(title=title))
    print(f"docs/images/{name}.svg")


async def _top() -> None:
    """Two clients at work on one proxy, as ``gpuremote top`` shows them."""
    proxy = Proxy("numpy", admin_token=TOKEN)
    url = await proxy.start("tcp://127.0.0.1:0")
    stop = asyncio.Event()

    async def client(n: int) -> None:
        async with gpuremote.connect(url) as gpu:
            x = gpu.asarray(np.ones((n, n), dtype=np.float32))
            while not stop.is_set():
                await (x @ x).get()

    workers = [asyncio.create_task(client(n)) for n in (64, 256)]
    session, info = await open_session(url)
    try:
        await asyncio.sleep(0.5)
        first = await fetch(session, TOKEN)
        await asyncio.sleep(1.0)
        view = rates(first, await fetch(session, TOKEN), info.get("session"))
        _save("top", top_view(view, url), "gpuremote top", 160)
    finally:
        stop.set()
        for w in workers:
            with contextlib.suppress(Exception):
                await w
        await session.aclose()
        await proxy.close()


async def _ping() -> None:
    states: list[dict[str, Any]] = []  # the live view's, as the rounds came in
    await run_ping(PingConfig(count=3000, warmup=300, backend="numpy"), states.append)
    _save("bench-ping", render.ping_view(states[-1]), "gpuremote bench ping")


async def _torch_ops() -> None:
    result = await run_torch_ops(
        ["resnet18", "bert", "gpt2"],
        size="small",
        steps=3,
        rounds=2,
        url=None,
        transport="tcp",
        backend="numpy",
    )
    _save("bench-ops-torch", render.ops_view(result), "gpuremote bench ops --workload", 130)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    asyncio.run(_top())
    asyncio.run(_ping())
    asyncio.run(_torch_ops())
    assert threading.active_count() >= 1


if __name__ == "__main__":
    main()
