"""A pool of two proxies on a local Ray instance (no GPU needed): 8 clients through
``pool://``, then an array moved from one proxy to the other without passing through here.

    python examples/pool.py
"""

from __future__ import annotations

import asyncio

import numpy as np
import ray

import gpuremote
import gpuremote.pool as gr
import gpuremote.xp as xp


async def client(i: int) -> str:
    async with gpuremote.connect("pool://example") as gpu:
        a = gpu.asarray(np.full(1024, i, dtype=np.float32))
        assert float((await (a * 2.0).get())[0]) == 2.0 * i
        await asyncio.sleep(0.2)  # stay connected while the others are placed
        return gpu.url


async def clients() -> list[str]:
    return list(await asyncio.gather(*(client(i) for i in range(8))))


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = gr.start_pool(2, name="example", num_gpus=0, backend="numpy")
    try:
        urls = gpuremote.run(clients())
        for url in sorted(set(urls)):
            print(f"{urls.count(url)} clients on {url}")
        d1, d2 = xp.connect("pool://example", devices=2)
        x = xp.arange(16 << 20, dtype=xp.float32, device=d1)  # 64 MiB
        y = x.to_device(d2)
        print(f"x.to_device(d2): {d2.last_copy}; sum {float(xp.sum(y)):.6g}")
        for row in pool.status():
            print({k: row[k] for k in ("url", "alive", "sessions", "restarts")})
        d1.close()
        d2.close()
    finally:
        pool.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
