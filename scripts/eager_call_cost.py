"""What an eager PyTorch op kept by template costs the client: the call made from its
arguments' signature alone (``Dispatcher._by_template``, as gpuremote runs it) beside the
same call through the whole encoder (the wire form of every argument built, then dropped for
the template's call: what every call did before), alternated in one process, on the same
warm session, so that the machine's noise hits both alike.

A proxy process on NumPy over tcp:// (pinned to the last CPU this process may use, the
client to the others where there are two or more); each op on 16 floats (``w``: 4x4).

    python scripts/eager_call_cost.py [--rounds 5] [--number 4000] [--json]

Prints, per op, the least of ``--rounds`` rounds (each the least of three runs of
``--number`` calls) for each path, in microseconds of the client's wall time per call (its
helper thread, which sends, included), and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import timeit
from collections.abc import Callable
from typing import Any

import torch

import gpuremote.torch as gt
from gpuremote.tools.proxyprocess import LocalProxy
from gpuremote.torch import _dispatch

#: the ops, as ``bench ops --workload ops`` has them (the view, which sends nothing, left out)
CASES: dict[str, Callable[[Any, Any], Any]] = {
    "a + a": lambda a, w: a + a,
    "a.add_(1.0)": lambda a, w: a.add_(1.0),
    "w @ w": lambda a, w: w @ w,
    "a.relu()": lambda a, w: a.relu(),
}


def _whole(self: Any, plan: Any, args: Any, kwargs: Any) -> Any:
    return _dispatch._MISS  # (``run`` then encodes every argument, as it did for every call)


def measure(rounds: int, number: int) -> dict[str, Any]:
    cpus = sorted(os.sched_getaffinity(0))
    proxy_cpus = {cpus[-1]} if len(cpus) > 1 else None
    quick = _dispatch.Dispatcher._by_template
    out: dict[str, Any] = {}
    with LocalProxy("tcp", "numpy", cpus=proxy_cpus) as proxy:
        if proxy_cpus is not None:
            os.sched_setaffinity(0, cpus[:-1])
        conn = gt.connect(proxy.url)
        try:
            a = torch.ones(16, device="gpuremote")
            w = torch.ones(4, 4, device="gpuremote")
            for name, op in CASES.items():

                def call(op: Callable[[Any, Any], Any] = op) -> Any:
                    return op(a, w)

                for _ in range(2000):  # the signature kept, its metadata cached
                    call()
                best = {"whole": float("inf"), "signature": float("inf")}
                for _ in range(rounds):
                    for path, impl in (("whole", _whole), ("signature", quick)):
                        _dispatch.Dispatcher._by_template = impl  # type: ignore[method-assign]
                        conn.synchronize()
                        t = min(timeit.repeat(call, number=number, repeat=3)) / number
                        best[path] = min(best[path], 1e6 * t)
                _dispatch.Dispatcher._by_template = quick  # type: ignore[method-assign]
                out[name] = {
                    "whole_us": best["whole"],
                    "signature_us": best["signature"],
                    "ratio": best["signature"] / best["whole"],
                }
            conn.synchronize()
        finally:
            _dispatch.Dispatcher._by_template = quick  # type: ignore[method-assign]
            conn.close()
            if proxy_cpus is not None:
                os.sched_setaffinity(0, cpus)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--number", type=int, default=4000)
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    out = measure(args.rounds, args.number)
    if args.json:
        print(json.dumps(out))
        return
    for name, row in out.items():
        print(
            f"{name:12s} whole {row['whole_us']:6.1f} µs  signature {row['signature_us']:6.1f} "
            f"µs  ({row['ratio']:.2f}x)"
        )


if __name__ == "__main__":
    main()
