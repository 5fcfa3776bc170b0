"""``gpuremote bench allreduce``: the proxies' all-reduce beside a bare Gloo all-reduce.

For each group size ``k`` (``--ranks 2,4``): ``k`` proxy processes (NumPy backend, or a pool's
with ``--url pool://NAME``) and ``k`` rank processes, each driving one proxy's device through
``torch.distributed``'s ``gpuremote`` backend; then, in the same run, ``k`` plain processes
all-reducing CPU tensors with Gloo (the engine the proxies use among themselves). Per size:
``iters`` all-reduces back to back and one wait for the last (the remote side's client waits
with ``torch.gpuremote.synchronize()``; Gloo's call returns when done), ``rounds`` times, the
median per all-reduce kept; bandwidths as NCCL's tests report them (algorithm bandwidth =
bytes / time; bus bandwidth = that x 2(k-1)/k), and the bytes the remote ranks' clients sent
and received per all-reduce (commands, never the tensor).

``--ddp resnet18,gpt2``: then a DDP training step of each workload (``gpuremote.torch.
models``, ``--ddp-size small|real``) on ``--ddp-ranks`` devices (1, 2, 4), timed step by step
(each ends reading its loss), with the bytes each rank's client moved per step beside the
gradients' bytes.

Each rank is ``python -m gpuremote.bench.allreduce rank MODE`` with the usual
``torch.distributed`` variables; rank 0 prints its rows as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["AllreduceConfig", "run_allreduce"]

#: the default sizes, in bytes: 4 KiB to 256 MiB
SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20)


@dataclass
class AllreduceConfig:
    """``bench allreduce``: group sizes ``ranks``, tensor ``sizes`` (bytes, float32), ``iters``
    all-reduces per timing, ``rounds`` timings per size."""

    ranks: tuple[int, ...] = (2, 4)
    sizes: tuple[int, ...] = SIZES
    iters: int = 5
    rounds: int = 5
    url: str | None = None  # pool://NAME, else local proxies
    backend: str = "numpy"
    timeout_s: float = 600.0
    ddp: tuple[str, ...] = ()  # workloads whose DDP step is timed
    ddp_ranks: tuple[int, ...] = (1, 2, 4)
    ddp_size: str = "small"
    ddp_steps: int = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _proxies(cfg: AllreduceConfig, k: int) -> Iterator[str]:
    """``GPUREMOTE_URL`` for ``k`` ranks: a pool's, else ``k`` local proxies'."""
    if cfg.url:
        yield cfg.url
        return
    from gpuremote.tools.proxyprocess import LocalProxy

    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(LocalProxy("tcp", cfg.backend, extra_args=("--quiet",))).url
            for _ in range(k)
        ]
        yield ",".join(urls)


def _run_ranks(
    cfg: AllreduceConfig, k: int, mode: str, url: str, workload: str = ""
) -> dict[str, Any]:
    """``k`` rank processes of ``mode`` (remote | bare | ddp of ``workload``); rank 0's
    result."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(k),
        "GPUREMOTE_URL": url,
        "GPUREMOTE_BENCH_ALLREDUCE": json.dumps(
            {
                "sizes": cfg.sizes,
                "iters": cfg.iters,
                "rounds": cfg.rounds,
                "workload": workload,
                "size": cfg.ddp_size,
                "steps": cfg.ddp_steps,
            }
        ),
    }
    cmd = [sys.executable, "-m", "gpuremote.bench.allreduce", "rank", mode]
    procs = [
        subprocess.Popen(
            cmd,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(k)
    ]
    outs = []
    deadline = time.monotonic() + cfg.timeout_s
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(
                f"bench allreduce: the {mode} ranks ran past {cfg.timeout_s}s"
            ) from None
        if p.returncode:
            for q in procs:
                q.kill()
            raise RuntimeError(f"bench allreduce: a {mode} rank failed:\n{err[-3000:]}")
        outs.append(out)
    return dict(json.loads(outs[0].strip().splitlines()[-1]))


def _measure(cfg: AllreduceConfig, report: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    rows = []
    for k in cfg.ranks:
        report({"ranks": k, "side": "remote"})
        with _proxies(cfg, k) as url:
            remote = _run_ranks(cfg, k, "remote", url)
        report({"ranks": k, "side": "bare gloo"})
        bare = _run_ranks(cfg, k, "bare", "")
        for size in cfg.sizes:
            r, b = remote[str(size)], bare[str(size)]
            row = {"ranks": k, "bytes": size, "remote": r, "bare": b}
            for side in (r, b):
                side["algbw_gb_per_s"] = size / side["median_s"] / 1e9
                side["busbw_gb_per_s"] = side["algbw_gb_per_s"] * 2 * (k - 1) / k
            row["remote_over_bare_bandwidth"] = b["median_s"] / r["median_s"]
            rows.append(row)
    ddp = []
    for name in cfg.ddp:
        for k in cfg.ddp_ranks:
            report({"ranks": k, "side": f"ddp {name}"})
            with _proxies(cfg, k) as url:
                ddp.append({"workload": name, "ranks": k, **_run_ranks(cfg, k, "ddp", url, name)})
    return {
        "bench": "allreduce",
        "iters": cfg.iters,
        "rounds": cfg.rounds,
        "proxies": cfg.url or f"{cfg.backend} proxies started here",
        "rows": rows,
        "ddp": ddp,
    }


async def run_allreduce(
    cfg: AllreduceConfig, report: Callable[[dict[str, Any]], None] = lambda s: None
) -> dict[str, Any]:
    """Run the bench (its processes driven from a thread of its own)."""
    return await asyncio.to_thread(_measure, cfg, report)


# -- one rank (a process of its own) ---------------------------------------------------------
def _rank(mode: str) -> None:
    import torch
    import torch.distributed as dist

    spec = json.loads(os.environ["GPUREMOTE_BENCH_ALLREDUCE"])
    if mode in ("remote", "ddp"):
        import gpuremote.torch as gt

        dist.init_process_group("gpuremote")
        device = "gpuremote"

        module = torch.get_device_module(device)

        def wait() -> None:
            module.synchronize()

        def moved() -> float:
            s = gt.stats()
            return float(s["bytes_sent"] + s["bytes_received"])
    else:
        dist.init_process_group("gloo")
        device = "cpu"

        def wait() -> None:
            return None

        def moved() -> float:
            return 0.0

    if mode == "ddp":
        _ddp_steps(spec, wait, moved)
        return
    out: dict[str, Any] = {}
    for size in spec["sizes"]:
        x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
        for _ in range(2):  # warm: buffers, connections
            dist.all_reduce(x)
        wait()
        times = []
        before = moved()
        for _ in range(spec["rounds"]):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(spec["iters"]):
                dist.all_reduce(x)
            wait()
            times.append((time.perf_counter() - t0) / spec["iters"])
        per_op = (moved() - before) / (spec["rounds"] * spec["iters"])
        out[str(size)] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "client_bytes_per_op": per_op,
        }
        del x
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def _ddp_steps(spec: dict[str, Any], wait: Callable[[], None], moved: Callable[[], float]) -> None:
    """Time DDP training steps of ``spec``'s workload on this rank's device."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gpuremote.torch.models import workload

    w = workload(spec["workload"], spec["size"])
    torch.manual_seed(0)
    model = w.make().to("gpuremote")
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x, y = w.batch(g)
    x, y = x.to("gpuremote"), y.to("gpuremote")

    def step() -> None:
        loss = w.loss(ddp, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()

    step()  # DDP's buckets, the metadata caches
    times = []
    before = moved()
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    per_step = (moved() - before) / spec["steps"]
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    if dist.get_rank() == 0:
        row = {
            "median_step_s": statistics.median(times),
            "min_step_s": min(times),
            "client_bytes_per_step": per_step,
            "gradient_bytes": grads,
            "what": w.describe,
        }
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":  # python -m gpuremote.bench.allreduce rank MODE
    if sys.argv[1:2] == ["rank"]:
        _rank(sys.argv[2])
