"""Statistics of raw timing samples, in one place."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["KEYS", "gbps", "ratio", "summarize"]

KEYS = ("min", "p50", "p90", "p99", "p999", "max", "mean")


def summarize(samples_ns: Sequence[int] | np.ndarray) -> dict[str, float]:
    """min, p50, p90, p99, p99.9, max and mean of ``samples_ns``, in microseconds."""
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    if a.size == 0:
        return dict.fromkeys(KEYS, float("nan"))
    p50, p90, p99, p999 = np.percentile(a, [50, 90, 99, 99.9])
    return {
        "min": float(a.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "p999": float(p999),
        "max": float(a.max()),
        "mean": float(a.mean()),
    }


def gbps(nbytes: int, samples_ns: Sequence[int] | np.ndarray) -> float:
    """Bandwidth in GB/s (10^9 bytes/s) from the median of per-transfer times."""
    if len(samples_ns) == 0:
        return float("nan")
    return nbytes / float(np.median(np.asarray(samples_ns, dtype=np.float64)))


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing or ``b`` is zero."""
    if a is None or b is None or b == 0 or a != a or b != b:
        return None
    return a / b
