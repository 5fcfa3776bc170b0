"""The classes of failure that PyTorch programs built from libraries met on the ``gpuremote``
device, each pinned by a test that failed before its fix: results are the CPU's (bitwise: the
proxy runs the same torch build), and an op the device cannot run is a clear error, never a
wrong answer or a dead process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="gpuremote.torch needs the [torch] extra")

import gpuremote.torch as gt  # noqa: E402

nn = torch.nn
F = torch.nn.functional
DEV = "gpuremote"


@pytest.fixture(scope="module", autouse=True)
def device(module_each_backend: str) -> Iterator[str]:
    with gt.connect_local(module_each_backend):
        yield DEV


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        b = b.cpu()
        a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _on_both(program: Callable[[str], Any]) -> Any:
    expected, got = program("cpu"), program(DEV)
    assert _same(expected, got), (expected, got)
    return got


# -- tensors without elements ------------------------------------------------------------
def test_ops_on_tensors_without_elements() -> None:
    """A 0-byte buffer (a KV cache that starts empty) is an operand like any other."""

    def program(dev: str) -> Any:
        x = torch.arange(4.0).to(dev)
        empty = torch.empty(0).to(dev)
        cache = torch.zeros(1, 2, 0, 4).to(dev)
        step = torch.ones(1, 2, 1, 4).to(dev)
        return [
            torch.cat([empty, x]),
            empty.sum(),
            torch.cat([cache, step], dim=2),
            x[4:].exp(),  # a view with no elements past its buffer's end
            torch.zeros(0, 3).to(dev) @ torch.ones(3, 2).to(dev),
        ]

    _on_both(program)


# -- Python numbers where an op's schema takes tensors -------------------------------------
def test_python_numbers_as_operands() -> None:
    """``x % 3`` reaches the device as ``remainder.Tensor(x, 3)``: a C++ composite's
    wrapped number, which PyTorch hands a Python kernel as a number."""

    def program(dev: str) -> Any:
        x = torch.arange(-4.0, 5.0).to(dev)
        i = torch.arange(-4, 5).to(dev)
        return [x % 3, torch.remainder(x, 2.5), i % 3, torch.fmod(x, 3), 7 % i.clamp(min=1)]

    _on_both(program)


def test_keyword_arguments_are_part_of_an_ops_signature() -> None:
    """``bucketize(x, b, right=True)`` and ``bucketize(x, b, out_int32=True)`` pass one
    keyword each, of the same value: two signatures, two output dtypes."""

    def program(dev: str) -> Any:
        b, x = torch.tensor([1.0, 2, 3, 4, 5]).to(dev), torch.tensor(2.5).to(dev)
        return [
            torch.bucketize(x, b, **kwargs)
            for kwargs in (
                {},
                {"right": True},
                {"out_int32": True},
                {"out_int32": True, "right": True},
            )
        ]

    got = _on_both(program)
    assert [t.dtype for t in got] == [torch.int64, torch.int64, torch.int32, torch.int32]


# -- attention -----------------------------------------------------------------------------
@pytest.mark.parametrize("mask", ["bool", "float", "float, learned"])
def test_attention_with_a_mask(mask: str) -> None:
    def program(dev: str) -> Any:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2, 2, 6, 8, generator=g).to(dev).requires_grad_()
        keep = torch.rand(2, 1, 6, 6, generator=g) > 0.3
        m = keep if mask == "bool" else torch.randn(2, 1, 6, 6, generator=g)
        m = m.to(dev).requires_grad_(mask == "float, learned")
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=m)
        out.sum().backward()
        grads = [q.grad] + ([m.grad] if m.requires_grad else [])
        return [out.detach(), *grads]

    _on_both(program)


# -- a parameter used in two places ------------------------------------------------------------
def test_a_tied_parameter_stays_tied_and_gets_both_gradients() -> None:
    """An input embedding and an output layer sharing one weight (GPT-2, T5, BERT's MLM
    head): ``.to(device)`` keeps one parameter, whose gradient sums both uses."""

    def program(dev: str) -> Any:
        torch.manual_seed(0)
        emb = nn.Embedding(10, 4)
        head = nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        model = nn.ModuleDict({"emb": emb, "head": head}).to(dev)
        assert model["emb"].weight is model["head"].weight
        ids = torch.tensor([[1, 2, 3, 1]]).to(dev)
        loss = model["head"](model["emb"](ids)).logsumexp(-1).sum()
        loss.backward()
        return [loss.detach(), model["emb"].weight.grad]

    _on_both(program)


# -- lazy conjugate and negative bits ------------------------------------------------------
def test_conjugate_and_negative_views_give_values_not_crashes() -> None:
    def program(dev: str) -> Any:
        g = torch.Generator().manual_seed(0)
        z = torch.randn(8, dtype=torch.complex64, generator=g).to(dev)
        r = torch.randn(8, generator=g).to(dev)
        into = torch.zeros(8, dtype=torch.complex64).to(dev)
        into.conj().copy_(z)  # the bytes of a conjugate view hold the conjugate
        return [
            z.conj() + 1,
            z.conj().cpu(),
            torch._neg_view(z) * 2,
            z.reshape(2, 4).conj() @ z.reshape(4, 2),
            torch.fft.hfft(z),
            torch.fft.ihfft(r),
            torch.fft.hfft2(z.reshape(2, 4)),
            into,
        ]

    _on_both(program)


# -- mixed precision and checkpointing ---------------------------------------------------------
def _transformer_steps(dev: str, dtype: Any) -> tuple[list[float], list[Any]]:
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 12, 32, generator=torch.Generator().manual_seed(1)).to(dev)
    losses = []
    for _ in range(3):
        with torch.autocast(device_type=dev, dtype=dtype):
            y = model(x)
            loss = y.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_autocast_trains_a_transformer_as_the_cpus_autocast(dtype: str) -> None:
    """CUDA's autocast lists on the device against the CPU's own: within half precision."""
    low = getattr(torch, dtype)
    (expected, weights), (got, remote) = (
        _transformer_steps("cpu", low),
        _transformer_steps(DEV, low),
    )
    assert got == pytest.approx(expected, rel=1e-2)
    for a, b in zip(weights, remote, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)


def test_autocast_casts_by_cudas_lists() -> None:
    x = torch.ones(4, 4).to(DEV)
    with torch.autocast(device_type=DEV, dtype=torch.float16):
        assert (x @ x).dtype == torch.float16  # lower precision
        assert x.half().exp().dtype == torch.float32  # float32
        assert x.half().softmax(-1).dtype == torch.float32  # float32 by its dtype argument
        assert torch.addcmul(x, x.half(), x.half()).dtype == torch.float32  # the widest
        assert x.sum(dtype=torch.float16).dtype == torch.float16  # a dtype given stays
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(x.sigmoid(), x)
    assert (x @ x).dtype == torch.float32


def test_a_grad_scaler_steps_as_on_the_cpu() -> None:
    def program(dev: str) -> Any:
        torch.manual_seed(0)
        model = nn.Linear(4, 3).to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(dev)
        losses = []
        for _ in range(3):
            with torch.autocast(device_type=dev, dtype=torch.float16):
                loss = model(torch.ones(2, 4).to(dev)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.item())
        return [losses, model.weight.detach(), scaler.get_scale()]

    _on_both(program)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_gives_what_no_checkpointing_gives(reentrant: bool) -> None:
    """The recomputation in backward draws the same dropout masks: the device's random
    state is saved and restored (``torch.gpuremote.get_rng_state``)."""

    def run(checkpoint: bool) -> list[Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.GELU(), nn.Linear(8, 8))
        model = model.to(DEV)
        x = torch.randn(4, 8).to(DEV).requires_grad_()
        torch.manual_seed(1)
        if checkpoint:
            y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=reentrant)
        else:
            y = model(x)
        y.sum().backward()
        return [y.detach().cpu(), x.grad.cpu(), model[0].weight.grad.cpu()]

    assert _same(run(False), run(True))


# -- what training code asks of a device's module ----------------------------------------------
def test_the_device_module_answers_what_training_code_asks() -> None:
    mod = torch.gpuremote
    assert mod.is_available() and mod.device_count() >= 1 and mod.current_device() == 0
    assert isinstance(mod.get_device_name(), str) and mod.get_device_name(0)
    assert mod.get_amp_supported_dtype() == [torch.float16, torch.bfloat16]
    mod.synchronize()
    mod.empty_cache()
    mod.reset_peak_memory_stats()
    before = mod.memory_allocated()
    x = torch.empty(1 << 16, device=DEV)
    assert mod.memory_allocated() == before + x.nbytes
    assert mod.max_memory_allocated() >= before + x.nbytes
    del x
    assert mod.memory_allocated() == before
    state = mod.get_rng_state()
    a = torch.rand(4, device=DEV).cpu()
    mod.set_rng_state(state)
    assert torch.equal(torch.rand(4, device=DEV).cpu(), a)
    with mod.device(0):
        pass
    with pytest.raises(RuntimeError, match="not connected"):
        mod.set_device(3)


# -- where a meta kernel and the device's disagree -----------------------------------------------
def test_ops_whose_meta_kernels_differ_from_the_devices() -> None:
    """``_embedding_bag``'s ``offset2bag``, eval-mode and half-precision batch norm's saved
    statistics, a channels-last convolution's layout: the device's kernel says (asked once
    per signature), so results, and the layouts later reductions run over, are the CPU's."""

    def program(dev: str) -> Any:
        torch.manual_seed(0)
        bag = nn.EmbeddingBag(10, 3, mode="sum").to(dev)
        idx, offsets = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 4])
        pooled = bag(idx.to(dev), offsets.to(dev))
        pooled.sum().backward()
        bn = nn.BatchNorm2d(3).to(dev)
        img = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1)).to(dev)
        trained = bn(img)
        bn.eval()
        evaluated = bn(img)
        half = F.batch_norm(img.half(), None, None, training=True)
        conv = nn.Conv2d(3, 4, 3, groups=1).to(dev)
        out = conv(img.to(memory_format=torch.channels_last))
        return [
            pooled.detach(),
            bag.weight.grad,
            trained.detach(),
            evaluated.detach(),
            half,
            bn.running_mean,
            out.detach(),
            list(out.stride()),
            out.detach().sum(dim=(0, 2)),
        ]

    _on_both(program)


def test_integer_histograms_count_as_on_a_gpu() -> None:
    """``histc`` of integers (what Hugging Face's mixture-of-experts layers count their
    experts' tokens with off the CPU): CUDA takes it; a CPU proxy counts them exactly."""
    experts = torch.tensor([0, 3, 3, 1, 2, 3, 0], dtype=torch.int32)
    got = torch.histc(experts.to(DEV), bins=4, min=0, max=3).cpu()
    assert got.dtype == torch.int32 and got.tolist() == [2, 1, 1, 3]


# -- the end of a program -----------------------------------------------------------------------
@pytest.mark.slow
def test_a_program_that_ends_without_closing_exits_cleanly() -> None:
    """Its session is closed at exit, before Python stops the helper threads (one stopped
    inside torch's C++ code aborted the process: ``terminate called without an active
    exception``)."""
    program = textwrap.dedent(
        """
        import torch
        import gpuremote.torch as gt
        gt.connect_local("numpy")
        x = torch.randn(64, 64, device="gpuremote", requires_grad=True)
        for _ in range(20):
            (x @ x).sum().backward()
        print("done")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and "done" in run.stdout, run.stderr[-2000:]
    assert "terminate called" not in run.stderr


def test_the_autocast_table_is_cudas() -> None:
    """Every op this torch registers for CUDA's autocast has CUDA's policy on the device
    (the table may hold ops of another release, which are not registered)."""
    from gpuremote.torch._autocast import POLICIES

    has = torch._C._dispatch_has_kernel_for_dispatch_key
    cuda = {
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::") and has(name, "AutocastCUDA")
    }
    assert cuda <= set(POLICIES), sorted(cuda - set(POLICIES))
    ops = {name.removeprefix("aten::") for name in torch._C._dispatch_get_all_op_names()}
    registered = {n for n in POLICIES if n in ops and has(f"aten::{n}", "AutocastPrivateUse1")}
    assert registered == cuda, sorted(registered ^ cuda)


def test_a_dataloader_that_pins_memory_feeds_the_device() -> None:
    """``pin_memory=True`` (the default of many training scripts, and of Hugging Face's
    ``Trainer``): plain host memory for this device, whose copies go by the network."""
    data = torch.utils.data.TensorDataset(torch.arange(16.0).view(8, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True)
    sums = [batch.to(DEV, non_blocking=True).sum().item() for (batch,) in loader]
    assert sums == [28.0, 92.0]
