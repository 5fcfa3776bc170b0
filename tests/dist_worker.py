"""One rank of the torch.distributed tests (``tests/test_distributed.py`` runs it under
torchrun, one proxy per rank), in modes run one after the other, each in a process group of
its own: ``ddp`` and ``fsdp`` run ``examples/ddp.py`` as it is (an MLP under DDP, a 2-layer
transformer under FSDP2, 4 steps; rank 0 saves the weights in ``GPUREMOTE_TEST_OUT``);
``collectives`` checks each collective's result against what it must be; ``bytes`` trains
DDP steps and prints the bytes its session moved per step beside the gradients' bytes;
``memory`` trains FSDP2 and prints what its tensors hold beside the whole model's bytes;
``kill`` trains until rank 1 kills its own proxy at step 2; ``again`` makes a process group,
ends it and makes one again at once, rank 0 slow to end the first."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gpuremote.torch as gt

DEV = "gpuremote"


def collectives(rank: int, world: int) -> None:
    def t(*values: float) -> torch.Tensor:
        return torch.tensor(values, device=DEV)

    x = t(rank + 1.0, 10.0 * (rank + 1))
    dist.all_reduce(x)
    assert x.tolist() == [3.0, 30.0], x
    x = t(rank + 1.0)
    dist.all_reduce(x, op=dist.ReduceOp.AVG)
    assert x.tolist() == [1.5], x
    x = t(rank + 1.0)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    assert x.tolist() == [2.0], x
    x = t(rank + 2.0)
    dist.all_reduce(x, op=dist.ReduceOp.PRODUCT)
    assert x.tolist() == [6.0], x
    x = t(float(rank), float(rank))
    dist.broadcast(x, src=1)
    assert x.tolist() == [1.0, 1.0], x
    outs = [torch.zeros(2, device=DEV) for _ in range(world)]
    dist.all_gather(outs, t(float(rank), rank + 0.5))
    assert [o.tolist() for o in outs] == [[0, 0.5], [1, 1.5]], outs
    out = torch.zeros(2 * world, device=DEV)
    dist.all_gather_into_tensor(out, t(float(rank), float(rank)))
    assert out.tolist() == [0, 0, 1, 1], out
    out = torch.zeros(2, device=DEV)
    dist.reduce_scatter_tensor(out, torch.arange(4.0, device=DEV) + rank)
    assert out.tolist() == [1.0, 3.0] if rank == 0 else [5.0, 7.0], out
    out = torch.zeros(1, device=DEV)
    dist.reduce_scatter(out, [t(rank + 1.0), t(10.0 * (rank + 1))])
    assert out.tolist() == ([3.0] if rank == 0 else [30.0]), out
    out = torch.zeros(2, device=DEV)
    dist.all_to_all_single(out, t(10.0 * rank, 10.0 * rank + 1))
    assert out.tolist() == ([0.0, 10.0] if rank == 0 else [1.0, 11.0]), out
    x = t(rank + 1.0)
    dist.reduce(x, dst=0)
    if rank == 0:
        assert x.tolist() == [3.0], x
    host = torch.tensor([rank + 1.0])  # a CPU tensor: to the device and back
    dist.all_reduce(host)
    assert host.tolist() == [3.0], host
    strided = torch.arange(6.0, device=DEV).reshape(2, 3).t()  # not contiguous
    dist.all_reduce(strided)
    assert strided.tolist() == [[0.0, 6.0], [2.0, 8.0], [4.0, 10.0]], strided
    out = [torch.zeros(2, device=DEV) for _ in range(world)] if rank == 0 else None
    dist.gather(t(float(rank), 7.0), out, dst=0)
    if rank == 0:
        assert [o.tolist() for o in out] == [[0.0, 7.0], [1.0, 7.0]], out
    x = torch.zeros(2, device=DEV)
    parts = [t(1.0, 2.0), t(3.0, 4.0)] if rank == 1 else None
    dist.scatter(x, parts, src=1)
    assert x.tolist() == ([1.0, 2.0] if rank == 0 else [3.0, 4.0]), x
    if rank == 0:  # point to point: a pipeline's hand-over (and back, on the host)
        dist.send(t(5.0, 6.0), dst=1, tag=3)
        back = torch.zeros(2)
        dist.recv(back, src=1, tag=4)
        assert back.tolist() == [50.0, 60.0], back
    else:
        got = torch.zeros(2, device=DEV)
        dist.recv(got, src=0, tag=3)
        assert got.tolist() == [5.0, 6.0], got
        dist.send(got.cpu() * 10, dst=0, tag=4)
    dist.barrier()
    pair = dist.new_group([0, 1])
    x = t(rank + 1.0)
    dist.all_reduce(x, group=pair)
    assert x.tolist() == [3.0], x
    print(f"rank {rank} collectives ok", flush=True)


def train_bytes(rank: int, steps: int = 4) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(DEV)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(8, 256, device=DEV)
    y = torch.randn(8, 10, device=DEV)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def step() -> float:
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    step()  # the first step builds DDP's buckets
    before = gt.stats()
    for _ in range(steps):
        step()
    after = gt.stats()
    moved = {k: (after[k] - before[k]) / steps for k in ("bytes_sent", "bytes_received")}
    print(json.dumps({"rank": rank, "grad_bytes": grad_bytes, **moved}), flush=True)


def memory(rank: int) -> None:
    """FSDP2 frees what it reshards: after training, a rank's tensors hold its shards of the
    parameters and gradients, not the whole of either (the storages' resize_)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(DEV, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).to(DEV)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 256, device=DEV)
    for _ in range(2):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
    held = torch.get_device_module(DEV).memory_allocated()
    print(json.dumps({"rank": rank, "memory_whole": whole, "memory_held": held}), flush=True)


def kill(rank: int, steps: int = 6) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).to(DEV)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(8, 16, device=DEV)
    y = torch.randn(8, 4, device=DEV)
    start = time.monotonic()
    try:
        for i in range(steps):
            if rank == 1 and i == 2:
                os.kill(
                    int(os.environ["GPUREMOTE_TEST_PROXY_PIDS"].split(",")[rank]), signal.SIGKILL
                )
            loss = F.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"rank {rank} step {i} loss {loss.item():.4f}", flush=True)
    except Exception as exc:
        print(f"rank {rank} error after {time.monotonic() - start:.1f}s: {exc}", flush=True)
        os._exit(3)
    print(f"rank {rank} finished without an error", flush=True)


def again(timeout: float) -> None:
    """A process group made, ended and made again at once, rank 0 slow to end the first
    (the job's address taken off its store 1 s late): the second group is a job of its own,
    never the first one's (whose ranks have joined already)."""
    import datetime

    from gpuremote.torch import distributed as gd

    shutdown = gd.ProcessGroupGpuremote.shutdown

    def late_shutdown(self: gd.ProcessGroupGpuremote) -> None:
        if self._rank == 0:
            store = self._store

            class Late:
                def delete_key(self, key: str) -> bool:
                    time.sleep(1.0)
                    return bool(store.delete_key(key))

            self._store = Late()
        shutdown(self)

    gd.ProcessGroupGpuremote.shutdown = late_shutdown  # type: ignore[method-assign]
    try:
        for n in (1, 2):
            dist.init_process_group("gpuremote", timeout=datetime.timedelta(seconds=timeout))
            rank = dist.get_rank()
            t = torch.full((2,), float(rank + n), device=DEV)
            dist.all_reduce(t)
            assert t.tolist() == [2.0 * n + 1] * 2, t
            dist.destroy_process_group()
    finally:
        gd.ProcessGroupGpuremote.shutdown = shutdown  # type: ignore[method-assign]
    print(f"rank {rank} again ok", flush=True)


def example(*args: str) -> None:
    """``examples/ddp.py`` with ``args`` (it makes and ends its own process group)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    try:
        import ddp
    finally:
        del sys.path[0]
    ddp.main(list(args))


def main() -> int:
    modes = sys.argv[1:]
    out = os.environ.get("GPUREMOTE_TEST_OUT", ".")
    for model, flags in (
        ("ddp", ("--model", "mlp")),
        ("fsdp", ("--model", "transformer", "--shard")),
    ):
        if model in modes:
            example("--steps", "4", *flags, "--out", f"{out}/{model}.pt")
    modes = [m for m in modes if m not in ("ddp", "fsdp")]
    timeout = float(os.environ.get("GPUREMOTE_TEST_DIST_TIMEOUT", "60"))
    if "again" in modes:
        again(timeout)
        modes.remove("again")
    if not modes:
        return 0
    import datetime

    dist.init_process_group("gpuremote", timeout=datetime.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    for mode in modes:
        {
            "collectives": lambda: collectives(rank, world),
            "bytes": lambda: train_bytes(rank),
            "memory": lambda: memory(rank),
            "kill": lambda: kill(rank),
        }[mode]()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
