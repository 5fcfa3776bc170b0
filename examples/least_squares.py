"""Array API code that knows nothing of gpuremote: gradient descent on a least-squares problem.

Run it on NumPy, then on a gpuremote proxy, with the same function::

    python examples/least_squares.py                       # a proxy inside this process
    python examples/least_squares.py tcp://gpu-box:5151    # a proxy elsewhere
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np


def least_squares(xp: Any, a: Any, b: Any, steps: int = 100, check_every: int = 10) -> Any:
    """Minimise |a x - b|^2 by gradient descent; stop early once the loss is tiny."""
    n = a.shape[1]
    x = xp.zeros((n,), dtype=a.dtype)
    lr = 1.0 / float(xp.linalg.matrix_norm(a, ord=2)) ** 2  # one data-dependent point
    for step in range(1, steps + 1):
        r = a @ x - b
        x = x - lr * (a.T @ r)
        if step % check_every == 0 and float(xp.vecdot(r, r)) < 1e-12:  # one each check
            break
    return x


def main() -> None:
    rng = np.random.default_rng(0)
    a_host = rng.standard_normal((200, 20))
    b_host = a_host @ rng.standard_normal(20)

    t = time.perf_counter()
    ref = least_squares(np, a_host, b_host)
    print(f"numpy:     {(time.perf_counter() - t) * 1e3:7.1f} ms")

    import gpuremote.xp as xp

    device = xp.connect(sys.argv[1]) if len(sys.argv) > 1 else xp.connect_local()
    with device:
        a, b = xp.asarray(a_host), xp.asarray(b_host)
        before = device.stats()["round_trips"]
        t = time.perf_counter()
        x = least_squares(xp, a, b)
        result = np.asarray(x)
        elapsed = time.perf_counter() - t
        trips = device.stats()["round_trips"] - before
        print(f"gpuremote: {elapsed * 1e3:7.1f} ms, {trips} round trips ({device.url})")
    print("result:", "OK, equal to NumPy's" if np.allclose(result, ref) else "DIFFERENT")


if __name__ == "__main__":
    main()
