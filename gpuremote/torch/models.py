"""The paper's kinds of PyTorch programs, written in the project (random weights, synthetic
data, nothing downloaded): ResNet-18 as torchvision defines it (torchvision does not install
beside the CPU build of torch used here), a BERT-style encoder and a GPT-2-style decoder.

``workload(name, size)`` gives a model, a batch maker and a loss, in a small configuration
(``"small"``: for tests), at the paper's sizes (``"real"``: ResNet-18 on 224x224 images,
BERT-base and GPT-2-small shapes) or as the real size's tiny twin (``"tiny"``: the same
layers, so the same ATen ops in the same order, each tensor as small as they allow: what
PyTorch itself costs a step, with next to no compute). Plain PyTorch: the same code runs
on ``"cpu"`` and on ``"gpuremote"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPT2", "SIZES", "WORKLOADS", "BertEncoder", "ResNet18", "Workload", "workload"]


# -- ResNet-18 ------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """torchvision's ``BasicBlock``: two 3x3 convolutions with batch norm, and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet18(nn.Module):
    """torchvision's ``resnet18`` (``width``: channels of the first stage, 64 there)."""

    def __init__(self, num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        w = width
        self.conv1 = nn.Conv2d(3, w, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages = []
        cin = w
        for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
            stride = 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8 * w, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# -- BERT -----------------------------------------------------------------------------------------
class BertEncoder(nn.Module):
    """A BERT-style encoder (token, position and segment embeddings, post-norm transformer
    layers with GELU, a masked-LM head tied to the embeddings)."""

    def __init__(
        self, vocab: int, d_model: int, heads: int, layers: int, max_len: int, dropout: float
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(max_len, d_model)
        self.segments = nn.Embedding(2, d_model)
        self.norm = nn.LayerNorm(d_model, eps=1e-12)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, d_model)
        self.head_norm = nn.LayerNorm(d_model, eps=1e-12)
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, ids: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device)
        x = self.tokens(ids) + self.positions(pos) + self.segments(torch.zeros_like(ids))
        x = self.encoder(self.drop(self.norm(x)), src_key_padding_mask=padding)
        x = self.head_norm(F.gelu(self.head(x)))
        return x @ self.tokens.weight.t() + self.bias


# -- GPT-2 ----------------------------------------------------------------------------------------
class _CausalSelfAttention(nn.Module):
    """GPT-2's masked multi-head self-attention."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class _Block(nn.Module):
    """A GPT-2 decoder block: attention and MLP, each after a layer norm."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """A GPT-2-style decoder: token and position embeddings, pre-norm causal blocks, the
    output projection tied to the token embedding."""

    def __init__(
        self, vocab: int, d_model: int, heads: int, layers: int, max_len: int, dropout: float
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(d_model, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tokens(ids) + self.positions(pos))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.t()


# -- workloads ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """A model with what training it takes: ``batch(generator)`` -> (inputs, targets) on the
    CPU; ``loss(model, inputs, targets)``; ``describe``: its size, in words."""

    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    describe: str


def _classify(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def _next_token(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _resnet(size: str) -> Workload:
    # tiny: two images (batch norm wants two values a channel at the last layer's 1x1)
    batch, image, width, classes = {
        "small": (4, 32, 8, 10),
        "real": (8, 224, 64, 1000),
        "tiny": (2, 32, 1, 2),
    }[size]

    def make_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch, 3, image, image, generator=g)
        return x, torch.randint(0, classes, (batch,), generator=g)

    return Workload(
        "resnet18",
        lambda: ResNet18(classes, width),
        make_batch,
        _classify,
        f"ResNet-18 (width {width}), batch {batch} of {image}x{image} images, {classes} classes",
    )


def _tokens(vocab: int, batch: int, seq: int) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def make_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return make_batch


#: dropout of the real sizes (the small ones have none: their results are compared with the
#: local CPU's, and the device draws from its own generator, as a GPU does)
_DROPOUT = 0.1


def _language_model(name: str, size: str) -> Workload:
    """BERT-style or GPT-2-style: small, or BERT-base / GPT-2-small shapes."""
    bert = name == "bert"
    small = size == "small"
    vocab, d, heads, layers, batch, seq = {
        "small": (100, 32, 4, 2, 4, 16),
        "real": (30522, 768, 12, 12, 8, 128) if bert else (50257, 768, 12, 12, 4, 128),
        # the real layers and heads, two features a head; no size of 1 (a dimension of 1
        # lets PyTorch take other paths: a view for a copy, addmm for mm and add)
        "tiny": (8, 24, 12, 12, 2, 3),
    }[size]
    p = 0.0 if small else _DROPOUT
    kind, model = ("BERT-style encoder", BertEncoder) if bert else ("GPT-2-style decoder", GPT2)
    max_len = 16 if size == "tiny" else (512 if bert else 1024)
    return Workload(
        name,
        lambda: model(vocab, d, heads, layers, max_len, dropout=p),
        _tokens(vocab, batch, seq),
        _next_token,
        f"{kind}: {layers} layers, d={d}, {heads} heads, vocab {vocab}, "
        f"batch {batch} x {seq} tokens",
    )


#: workload name -> its maker, by size ("small", "real" or "tiny")
WORKLOADS: dict[str, Callable[[str], Workload]] = {
    "resnet18": _resnet,
    "bert": lambda size: _language_model("bert", size),
    "gpt2": lambda size: _language_model("gpt2", size),
}


#: the workloads' sizes
SIZES = ("small", "real", "tiny")


def workload(name: str, size: str = "small") -> Workload:
    """The workload ``name`` (``resnet18``, ``bert``, ``gpt2``) at ``size``."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(WORKLOADS)}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(map(repr, SIZES))}, not {size!r}")
    return WORKLOADS[name](size)


def train(
    w: Workload,
    device: str,
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    compile: str | None = None,
) -> tuple[list[float], dict[str, Any]]:
    """``steps`` training steps of ``w`` on ``device`` (AdamW with weight decay, gradients
    clipped), the model under ``torch.compile(backend=compile)`` where given; returns the
    losses and the final weights on the CPU."""
    torch.manual_seed(seed)
    model = w.make().to(device)
    run: Any = torch.compile(model, backend=compile) if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        x, y = w.batch(g)
        loss = w.loss(run, x.to(device), y.to(device))
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}
