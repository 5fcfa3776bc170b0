"""A demo workload: a few training steps of a small MLP, run through a proxy and in NumPy.

``gpuremote demo`` starts a local proxy (unless ``--url`` is given), trains the same model
remotely and locally from the same synthetic data, and prints the losses, the largest
difference between the two results and how long each took.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..client import GPU

__all__ = ["DemoResult", "mlp_data", "mlp_step", "train_local", "train_remote"]


@dataclass
class DemoResult:
    """What the demo's training run gave: its losses, weights and time."""

    losses: list[float]
    weights: list[np.ndarray[Any, Any]]
    seconds: float


def mlp_data(
    batch: int = 256, din: int = 64, hidden: int = 128, dout: int = 16, seed: int = 0
) -> dict[str, np.ndarray[Any, Any]]:
    """Synthetic regression data and initial weights (float32)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, din), dtype=np.float32)
    w_true = rng.standard_normal((din, dout), dtype=np.float32) / np.sqrt(din)
    y = np.tanh(x @ w_true).astype(np.float32)
    w1 = (rng.standard_normal((din, hidden), dtype=np.float32) / np.sqrt(din)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, dout), dtype=np.float32) / np.sqrt(hidden)).astype(
        np.float32
    )
    return {"x": x, "y": y, "w1": w1, "w2": w2}


def train_local(data: dict[str, np.ndarray[Any, Any]], steps: int, lr: float = 0.1) -> DemoResult:
    """The reference: the same training steps in NumPy, op for op."""
    t0 = time.perf_counter()
    x, y = data["x"], data["y"]
    w1, w2 = data["w1"].copy(), data["w2"].copy()
    scale = np.float32(2.0 / y.size)
    losses = []
    for _ in range(steps):
        pre = x @ w1
        h = np.maximum(pre, 0)
        diff = h @ w2 - y
        losses.append(float(np.mean(np.square(diff))))
        dy = diff * scale
        dw2 = h.T @ dy
        dh = (dy @ w2.T) * (pre > 0)
        dw1 = x.T @ dh
        w1 = w1 + dw1 * np.float32(-lr)
        w2 = w2 + dw2 * np.float32(-lr)
    return DemoResult(losses, [w1, w2], time.perf_counter() - t0)


def mlp_step(gpu: GPU, x: Any, y: Any, w1: Any, w2: Any, scale: float, lr: float) -> Any:
    """One training step of the MLP (forward, backward, SGD into ``w1`` and ``w2``): 16
    ASYNC calls; returns the loss (an array: reading it is the caller's choice)."""
    pre = gpu.matmul(x, w1)
    h = gpu.relu(pre)
    diff = gpu.subtract(gpu.matmul(h, w2), y)
    loss = gpu.mean(gpu.op("square", diff))
    dy = gpu.multiply(diff, scale)
    dw2 = gpu.matmul(gpu.transpose(h), dy)
    dh = gpu.op("relu_grad", gpu.matmul(dy, gpu.transpose(w2)), pre)
    dw1 = gpu.matmul(gpu.transpose(x), dh)
    gpu.axpy(-lr, dw1, w1)
    gpu.axpy(-lr, dw2, w2)
    return loss


async def train_remote(
    gpu: GPU,
    data: dict[str, np.ndarray[Any, Any]],
    steps: int,
    lr: float = 0.1,
    ready: Callable[[], None] | None = None,
    capture: bool = False,
) -> DemoResult:
    """The same steps through gpuremote: one synchronous round trip per step (the loss).
    ``ready``: called once the data is on the device (after a synchronize), before the
    steps (a bench times the steps from there). ``capture``: the step is recorded once and
    replayed by one message (``gpu.capture``)."""
    t0 = time.perf_counter()
    x, y = gpu.asarray(data["x"]), gpu.asarray(data["y"])
    w1, w2 = gpu.asarray(data["w1"]), gpu.asarray(data["w2"])
    if ready is not None:
        await gpu.synchronize()
        ready()
    scale = 2.0 / data["y"].size

    def step(x: Any, y: Any, w1: Any, w2: Any) -> Any:
        return mlp_step(gpu, x, y, w1, w2, scale, lr)

    run = gpu.capture(step) if capture else step
    losses = []
    for _ in range(steps):
        losses.append(float(await run(x, y, w1, w2).get()))
    weights = [await w1.get(), await w2.get()]
    return DemoResult(losses, weights, time.perf_counter() - t0)
