"""A session that survives the loss of its proxy, on a local Ray pool of two (no GPU needed):
the demo's MLP trains while its proxy is killed, and ends with the weights of a run that lost
nothing.

    python examples/failover.py
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray

import gpuremote
import gpuremote.pool as gr
from gpuremote.tools.demo import mlp_data, mlp_step


async def train(pool: Any, kill_at: int | None, **options: Any) -> tuple[Any, dict[str, Any]]:
    data = mlp_data()
    async with gpuremote.connect("pool://example-failover", **options) as gpu:
        x, y = gpu.asarray(data["x"]), gpu.asarray(data["y"])
        w1, w2 = gpu.asarray(data["w1"]), gpu.asarray(data["w2"])
        for step in range(100):
            if step == kill_at:  # the proxy serving this session dies; Ray restarts it
                index = next(r["index"] for r in pool.status() if r["url"] == gpu.url)
                ray.kill(pool.actors[index], no_restart=False)
                print(f"step {step}: killed the proxy at {gpu.url}")
            loss = float(await mlp_step(gpu, x, y, w1, w2, 2 / y.size, 0.1).get())
        print(f"final loss {loss:.6f} on {gpu.url}")
        return await w1.get(), gpu.stats()


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    pool = gr.start_pool(2, name="example-failover", num_gpus=0, backend="numpy")
    try:
        reference, _ = gpuremote.run(train(pool, None))
        weights, stats = gpuremote.run(train(pool, 50, failover=True))
        print(
            f"failovers {stats['failovers']}, pause {stats['pause_s'][0] * 1e3:.0f} ms, "
            f"checkpoints {stats['checkpoints']} ({stats['checkpoint_bytes']:,} bytes); "
            f"weights equal to the uninterrupted run's: {np.array_equal(weights, reference)}"
        )
    finally:
        pool.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
