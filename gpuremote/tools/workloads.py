"""AI workloads on the client API, with synthetic data: the same code runs locally
(``gpuremote.tools.direct.connect_direct``, the baseline) and through a proxy.

- ``mlp``: MLP training steps (forward, backward, SGD update), the loss read back each step.
- ``transformer``: inference of a transformer block at batch 1 (layer norm, attention with
  softmax, GEMMs, GELU): many small kernels, one read-back per step; latency-bound.
- ``upload``: a large input batch uploaded every step and reduced; bandwidth-bound.

Each returns a small array to compare runs with; sizes are keyword arguments, with defaults
that take on the order of a second locally on a 2-core CPU. ``capture=True`` records each
workload's step once and replays it by one message (``GPU.capture``). ``ready``, if given, is called
once the workload's data and weights are on the device (after a synchronize), before its
steps: a bench times the steps from there, leaving the setup out.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import numpy as np

from ..client import GPU, RemoteArray
from .demo import mlp_data, train_remote

__all__ = ["WORKLOADS", "mlp", "transformer", "transformer_block", "upload"]


Ready = Callable[[], None] | None


async def mlp(
    gpu: GPU,
    steps: int = 40,
    batch: int = 256,
    din: int = 64,
    hidden: int = 256,
    dout: int = 16,
    ready: Ready = None,
    capture: bool = False,
) -> np.ndarray:
    data = mlp_data(batch=batch, din=din, hidden=hidden, dout=dout)
    result = await train_remote(gpu, data, steps, ready=ready, capture=capture)
    return np.asarray(result.losses)


def transformer_block(
    gpu: GPU, seq: int = 32, d_model: int = 128, heads: int = 4, capture: bool = False
) -> Callable[[], Awaitable[float]]:
    """A transformer block's weights on ``gpu``; returns ``step()``: one inference step at
    batch 1 (layer norm, attention with softmax, GEMMs, GELU) ending in one read-back.
    ``capture``: the step's calls are recorded once and replayed by one message."""
    rng = np.random.default_rng(0)
    dh = d_model // heads

    def weight(*shape: int) -> RemoteArray:
        return gpu.asarray((rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32))

    wq, wk, wv, wo = (weight(d_model, d_model) for _ in range(4))
    w1, w2 = weight(d_model, 4 * d_model), weight(4 * d_model, d_model)
    g1 = gpu.asarray(np.ones(d_model, np.float32))
    b1 = gpu.asarray(np.zeros(d_model, np.float32))
    state = [gpu.asarray(rng.standard_normal((seq, d_model)).astype(np.float32))]

    def split(t: RemoteArray) -> RemoteArray:  # (seq, d) -> (heads, seq, dh)
        return gpu.transpose(t.reshape(seq, heads, dh), axes=(1, 0, 2))

    def compute(x: RemoteArray) -> tuple[RemoteArray, RemoteArray]:
        h = gpu.op("layer_norm", x, g1, b1)
        q, k, v = split(gpu.matmul(h, wq)), split(gpu.matmul(h, wk)), split(gpu.matmul(h, wv))
        scores = gpu.multiply(gpu.matmul(q, gpu.transpose(k, axes=(0, 2, 1))), 1 / math.sqrt(dh))
        attn = gpu.matmul(gpu.softmax(scores), v)  # (heads, seq, dh)
        merged = gpu.transpose(attn, axes=(1, 0, 2)).reshape(seq, d_model)
        x = gpu.add(x, gpu.matmul(merged, wo))
        h2 = gpu.op("layer_norm", x, g1, b1)
        x = gpu.add(x, gpu.matmul(gpu.op("gelu", gpu.matmul(h2, w1)), w2))
        return x, gpu.sum(x, axis=1)

    run = gpu.capture(compute) if capture else compute

    async def step() -> float:
        state[0], sums = run(state[0])
        last = await sums.get()  # the step's one synchronous read-back
        return float(last[-1])

    return step


async def transformer(
    gpu: GPU,
    steps: int = 30,
    seq: int = 32,
    d_model: int = 128,
    heads: int = 4,
    ready: Ready = None,
    capture: bool = False,
) -> np.ndarray:
    step = transformer_block(gpu, seq, d_model, heads, capture=capture)
    if ready is not None:
        await gpu.synchronize()
        ready()
    return np.asarray([await step() for _ in range(steps)])


async def upload(
    gpu: GPU,
    steps: int = 20,
    batch_mb: float = 8.0,
    features: int = 256,
    ready: Ready = None,
    capture: bool = False,
) -> np.ndarray:
    rng = np.random.default_rng(0)
    rows = max(1, int(batch_mb * 2**20 / (4 * features)))
    w = gpu.asarray((rng.standard_normal((features, 1)) / features).astype(np.float32))

    def reduce(xb: RemoteArray) -> RemoteArray:
        return gpu.mean(gpu.matmul(xb, w))

    run = gpu.capture(reduce) if capture else reduce  # the upload itself is host data
    if ready is not None:
        await gpu.synchronize()
        ready()
    outs = []
    for i in range(steps):
        host = np.full((rows, features), 1.0 + i / steps, np.float32)  # a new batch each step
        xb = gpu.asarray(host)
        outs.append(float(await run(xb).get()))
    return np.asarray(outs)


WORKLOADS: dict[str, Callable[..., Awaitable[np.ndarray]]] = {
    "mlp": mlp,
    "transformer": transformer,
    "upload": upload,
}
