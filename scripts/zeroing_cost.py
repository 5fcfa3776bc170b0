"""What zeroing every buffer a CPU proxy allocates costs a training step (issue #52).

The proxy zeroes each new buffer, so that no session reads what another wrote: NumPy's
``calloc`` (fresh pages from the kernel for a large buffer; a ``memset`` of one the C heap
reuses). This trains the project's PyTorch workloads on a NumPy proxy in this process, and
alternates, round by round, the backend's allocation as it is with one that hands out
uninitialised memory (``np.empty``, what it did before: patched here only, in this process;
the proxy has no such switch), so that both run in the same process, on the same warm state.

    python scripts/zeroing_cost.py [--workloads resnet18,bert,gpt2] [--size small|real]
                                   [--steps 5] [--rounds 20] [--json]

Prints, per workload, the median step of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np

import gpuremote.torch as gt
from gpuremote.backends import numpy_backend
from gpuremote.torch.models import train, workload

_ZEROED = numpy_backend.NumpyBackend.alloc
_MODE = {"zeroed": True}


def _alloc(self: Any, nbytes: int, stream: Any = None) -> Any:
    if _MODE["zeroed"]:
        return _ZEROED(self, nbytes, stream)
    return np.empty(nbytes, dtype=np.uint8)


def measure(name: str, size: str, steps: int, rounds: int) -> dict[str, Any]:
    w = workload(name, size)
    train(w, "gpuremote", 1)  # warm: meta kernels cached, memory touched
    times: dict[str, list[float]] = {"zeroed": [], "uninitialised": []}
    for r in range(rounds):
        order = ("zeroed", "uninitialised") if r % 2 == 0 else ("uninitialised", "zeroed")
        for mode in order:
            _MODE["zeroed"] = mode == "zeroed"
            t = time.perf_counter()
            train(w, "gpuremote", steps)
            times[mode].append((time.perf_counter() - t) / steps)
    _MODE["zeroed"] = True
    zeroed, raw = statistics.median(times["zeroed"]), statistics.median(times["uninitialised"])
    return {
        "workload": name,
        "size": size,
        "zeroed_step_ms": zeroed * 1e3,
        "uninitialised_step_ms": raw * 1e3,
        "ratio": zeroed / raw,
        "rounds": rounds,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="resnet18,bert,gpt2")
    parser.add_argument("--size", default="small", choices=("small", "real"))
    parser.add_argument("--steps", type=int, default=5, help="training steps per round")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    numpy_backend.NumpyBackend.alloc = _alloc  # type: ignore[method-assign]
    with gt.connect_local("numpy"):
        rows = [
            measure(name, args.size, args.steps, args.rounds) for name in args.workloads.split(",")
        ]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    for r in rows:
        print(
            f"{r['workload']} ({r['size']}): step median zeroed {r['zeroed_step_ms']:.1f} ms, "
            f"uninitialised {r['uninitialised_step_ms']:.1f} ms, ratio {r['ratio']:.3f} "
            f"({r['rounds']} alternating rounds of {r['steps']} steps)"
        )


if __name__ == "__main__":
    main()
