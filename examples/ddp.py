"""Data-parallel training on remote GPUs, the PyTorch tutorial's way, one process per rank:

    GPUREMOTE_URL=tcp://gpu-a:7766,tcp://gpu-b:7766 \\
        torchrun --nproc-per-node 2 examples/ddp.py --steps 4 --out weights.pt

Each rank drives one proxy's device (rank r uses the r-th URL; ``pool://NAME`` places the ranks
on a pool's proxies); the gradients' all-reduce runs between the proxies, not through this
machine. ``--out``: rank 0 saves the trained weights (CPU tensors). ``--model mlp|transformer``;
``--shard``: FSDP2's ``fully_shard`` (each layer, then the model) instead of DDP.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpuremote.torch  # noqa: F401  (the "gpuremote" device and process-group backend)


def make_model(kind: str) -> nn.Module:
    """The model every rank (and a one-process reference) starts from."""
    torch.manual_seed(0)
    if kind == "transformer":
        return nn.Sequential(
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
            nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
            nn.Flatten(),
            nn.Linear(16 * 4, 4),
        )
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def make_data(kind: str, n: int = 64) -> TensorDataset:
    """The same synthetic data on every rank."""
    g = torch.Generator().manual_seed(1)
    x = (
        torch.randn(n, 4, 16, generator=g)
        if kind == "transformer"
        else torch.randn(n, 16, generator=g)
    )
    return TensorDataset(x, torch.randn(n, 4, generator=g))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="per rank")
    p.add_argument("--model", default="mlp", choices=("mlp", "transformer"))
    p.add_argument("--out", default="")
    p.add_argument("--shard", action="store_true", help="FSDP2 fully_shard instead of DDP")
    args = p.parse_args(argv)

    dist.init_process_group("gpuremote")
    rank = dist.get_rank()
    model = make_model(args.model).to("gpuremote")
    if args.shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("gpuremote", (dist.get_world_size(),))
        for layer in model:
            if any(p.requires_grad for p in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        ddp = DDP(model)
    data = make_data(args.model)
    loader = DataLoader(
        data, batch_size=args.batch, sampler=DistributedSampler(data, shuffle=False)
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        x, y = x.to("gpuremote"), y.to("gpuremote")
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
    state = model.state_dict()
    if args.shard:  # each rank holds a shard: gathered (every rank takes part)
        state = {k: v.full_tensor() for k, v in state.items()}
    if rank == 0 and args.out:
        torch.save({k: v.cpu() for k, v in state.items()}, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
