"""Device profiles for the simulated device: how long a GPU would take for each op and copy.

``sim:a100`` (``v100``, ``h100``) gives every op a device time from a roofline of that GPU:
the op's floating-point work and the bytes it moves (from its shapes and dtypes), against the
GPU's peak FLOP/s for the dtype and its memory bandwidth, and never less than a per-kernel
floor (launch and tail). Host-device copies take the copy floor plus their bytes at the GPU's
PCIe figure. The figures, with their public sources, are in
``docs/reference/device-profiles.md``; the floors are estimates (no datasheet gives them),
said so there.

Pure functions of shapes and dtypes: nothing here computes, waits or allocates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PROFILES",
    "DeviceProfile",
    "Operand",
    "copy_time",
    "op_time",
    "op_work",
    "work_time",
]

#: (shape, dtype) of one operand; the dtype is anything with ``.itemsize`` and ``.kind``
#: (a NumPy dtype)
Operand = tuple[tuple[int, ...], Any]

TERA, GIGA = 1e12, 1e9


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """One GPU's figures (rates in FLOP/s and bytes/s, times in seconds)."""

    name: str
    description: str
    #: peak FLOP/s of the CUDA cores per dtype ("float64", "float32", "float16"); element-wise
    #: ops, reductions and the rest
    flops: Mapping[str, float]
    #: peak FLOP/s of dense matrix products per dtype (tensor cores where cuBLAS uses them)
    matmul_flops: Mapping[str, float]
    mem_bw: float  # device memory bandwidth
    pcie_bw: float  # host <-> device, each direction
    kernel_floor_s: float  # the shortest a kernel takes on the timeline: launch and tail
    copy_floor_s: float  # the fixed part of a host <-> device copy
    memory: int  # bytes of device memory

    def peak(self, dtype: Any, matmul: bool = False) -> float:
        """Peak FLOP/s for ``dtype`` (integers and bools: the float32 rate)."""
        table = self.matmul_flops if matmul else self.flops
        kind, size = getattr(dtype, "kind", "f"), getattr(dtype, "itemsize", 4)
        if kind in "fc":
            key = {2: "float16", 4: "float32"}.get(size if kind == "f" else size // 2, "float64")
            return table[key]
        return table["float32"]


# Sources (see docs/reference/device-profiles.md for the table and links):
#  V100: NVIDIA Tesla V100 datasheet (SXM2 32 GB): FP64 7.8, FP32 15.7, tensor 125 TFLOPS;
#        HBM2 900 GB/s; PCIe Gen3 x16 32 GB/s bidirectional.
#  A100: NVIDIA A100 datasheet (SXM4 80 GB): FP64 9.7 (tensor 19.5), FP32 19.5, TF32 156,
#        FP16 tensor 312 TFLOPS; HBM2e 2,039 GB/s; PCIe Gen4 64 GB/s bidirectional.
#  H100: NVIDIA H100 datasheet (SXM5 80 GB): FP64 34 (tensor 67), FP32 67, FP16 tensor 989
#        (dense; 1,979 with sparsity) TFLOPS; HBM3 3.35 TB/s; PCIe Gen5 128 GB/s bidirectional.
# float32 matrix products at the FP32 rate: CuPy and cuBLAS use TF32 only when asked to.
PROFILES: dict[str, DeviceProfile] = {
    "v100": DeviceProfile(
        name="v100",
        description="NVIDIA V100 SXM2 32 GB (simulated)",
        flops={"float64": 7.8 * TERA, "float32": 15.7 * TERA, "float16": 31.4 * TERA},
        matmul_flops={"float64": 7.8 * TERA, "float32": 15.7 * TERA, "float16": 125 * TERA},
        mem_bw=900 * GIGA,
        pcie_bw=16 * GIGA,
        kernel_floor_s=3.0e-6,
        copy_floor_s=4.0e-6,
        memory=32 << 30,
    ),
    "a100": DeviceProfile(
        name="a100",
        description="NVIDIA A100 SXM4 80 GB (simulated)",
        flops={"float64": 9.7 * TERA, "float32": 19.5 * TERA, "float16": 78 * TERA},
        matmul_flops={"float64": 19.5 * TERA, "float32": 19.5 * TERA, "float16": 312 * TERA},
        mem_bw=2039 * GIGA,
        pcie_bw=32 * GIGA,
        kernel_floor_s=2.5e-6,
        copy_floor_s=3.0e-6,
        memory=80 << 30,
    ),
    "h100": DeviceProfile(
        name="h100",
        description="NVIDIA H100 SXM5 80 GB (simulated)",
        flops={"float64": 34 * TERA, "float32": 67 * TERA, "float16": 134 * TERA},
        matmul_flops={"float64": 67 * TERA, "float32": 67 * TERA, "float16": 989 * TERA},
        mem_bw=3350 * GIGA,
        pcie_bw=64 * GIGA,
        kernel_floor_s=2.0e-6,
        copy_floor_s=2.5e-6,
        memory=80 << 30,
    ),
}

#: FLOPs per output element of element-wise ops that cost more than one (transcendentals:
#: a handful of FMAs each in CUDA's math library; rough, and nearly always memory-bound)
_PER_ELEMENT: dict[str, float] = {
    **dict.fromkeys(
        [
            "exp",
            "expm1",
            "log",
            "log1p",
            "log2",
            "log10",
            "sin",
            "cos",
            "tan",
            "sinh",
            "cosh",
            "tanh",
            "asin",
            "acos",
            "atan",
            "asinh",
            "acosh",
            "atanh",
            "atan2",
            "pow",
            "sqrt",
            "hypot",
            "logaddexp",
            "sigmoid",
        ],
        8.0,
    ),
    "gelu": 15.0,
    "softmax": 5.0,
    "layer_norm": 8.0,
    "std": 3.0,
    "var": 3.0,
    "axpy": 2.0,
}
_MATMUL = frozenset({"matmul", "tensordot", "vecdot", "linalg.outer", "linalg.matrix_power"})
#: O(n^3) dense linear algebra: FLOPs ~ this times n^3 per matrix
_CUBIC: dict[str, float] = {
    "linalg.inv": 2.0,
    "linalg.solve": 2.0,
    "linalg.det": 0.67,
    "linalg.slogdet": 0.67,
    "linalg.cholesky": 0.33,
    "linalg.qr": 1.33,
    "linalg.eigh": 9.0,
    "linalg.eigvalsh": 4.0,
    "linalg.svd": 12.0,
    "linalg.svdvals": 4.0,
    "linalg.pinv": 14.0,
    "linalg.matrix_rank": 4.0,
}


def _n(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _nbytes(x: Operand) -> int:
    return _n(x[0]) * int(x[1].itemsize)


def op_work(
    name: str, ins: Sequence[Operand], outs: Sequence[Operand], params: Mapping[str, Any] = {}
) -> tuple[float, float]:
    """(FLOPs, bytes moved) of op ``name`` on operands ``ins`` writing ``outs``: each operand
    read or written once; the FLOPs by the op's kind (see the tables above)."""
    nbytes = float(sum(_nbytes(x) for x in ins) + sum(_nbytes(x) for x in outs))
    n_out = sum(_n(s) for s, _ in outs)
    n_in = sum(_n(s) for s, _ in ins)
    if name in _MATMUL and ins and ins[0][0]:
        k = ins[0][0][-1]
        if name == "tensordot":
            axes = params.get("axes", 2)
            if isinstance(axes, int):
                k = _n(ins[0][0][-axes:]) if axes > 0 else 1  # axes=0: an outer product
            else:
                k = max(1, _n(ins[0][0]) * _n(ins[1][0]) // max(1, n_out)) ** 0.5
        return 2.0 * max(1, n_out) * k, nbytes
    if name in _CUBIC and ins and len(ins[0][0]) >= 2:
        shape = ins[0][0]
        m = max(shape[-1], shape[-2])
        return _CUBIC[name] * m**3 * _n(shape[:-2]), nbytes
    if name.startswith("fft."):
        n = max(n_in, n_out, 2)
        return 5.0 * n * math.log2(n), nbytes
    if name in ("sort", "argsort", "searchsorted", "isin") or name.startswith("unique"):
        n = max(n_in, 2)
        return n * math.log2(n), nbytes
    return _PER_ELEMENT.get(name, 1.0) * max(n_in, n_out), nbytes


def op_time(
    profile: DeviceProfile,
    name: str,
    ins: Sequence[Operand],
    outs: Sequence[Operand],
    params: Mapping[str, Any] = {},
) -> float:
    """Seconds op ``name`` takes on ``profile``'s GPU: the roofline (the slower of its FLOPs
    at the dtype's peak and its bytes at the memory bandwidth), at least the kernel floor."""
    flops, nbytes = op_work(name, ins, outs, params)
    ref = outs[0][1] if outs else (ins[0][1] if ins else None)
    peak = profile.peak(ref, matmul=name in _MATMUL or name in _CUBIC)
    return max(profile.kernel_floor_s, flops / peak, nbytes / profile.mem_bw)


def work_time(
    profile: DeviceProfile, flops: float, nbytes: float, dtype: Any, matmul: bool
) -> float:
    """Seconds an op of ``flops`` and ``nbytes`` moved takes on ``profile``'s GPU (the
    roofline at ``dtype``'s peak, tensor cores for ``matmul``), at least the kernel floor:
    the time of a PyTorch op, whose FLOPs torch counts (``gpuremote.proxy.aten``)."""
    peak = profile.peak(dtype, matmul=matmul)
    return max(profile.kernel_floor_s, flops / peak, nbytes / profile.mem_bw)


def copy_time(profile: DeviceProfile, nbytes: int, kind: str) -> float:
    """Seconds a copy of ``nbytes`` takes: ``"h2d"`` / ``"d2h"`` over PCIe (the copy floor
    plus the bytes at the PCIe rate); ``"d2d"`` a kernel reading and writing them; ``"memset"``
    a kernel writing them."""
    if kind in ("h2d", "d2h"):
        return profile.copy_floor_s + nbytes / profile.pcie_bw
    if kind == "d2d":
        return max(profile.kernel_floor_s, 2 * nbytes / profile.mem_bw)
    if kind == "memset":
        return max(profile.kernel_floor_s, nbytes / profile.mem_bw)
    raise ValueError(f"unknown copy kind {kind!r}")
