"""Unmodified PyTorch on the ``gpuremote`` device: programs give the local CPU's results
(bitwise: the proxy runs the same torch build), training steps cost one round trip, errors
are the local ones, and the session goes on after them."""

from __future__ import annotations

import copy
import io
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="gpuremote.torch needs the [torch] extra")

import gpuremote.torch as gt  # noqa: E402
from gpuremote.tools.proxyprocess import LocalProxy  # noqa: E402
from gpuremote.torch.models import train, workload  # noqa: E402

nn = torch.nn
F = torch.nn.functional


#: how close remote results must be to the local CPU's: bitwise where the proxy runs the CPU's
#: kernels (NumPy and the simulated devices), within 1e-4 on a GPU
_EXACT = {"exact": True}


@pytest.fixture(scope="module")
def device(module_each_backend: str) -> Iterator[str]:
    """The ``gpuremote`` device, served in this process over inproc:// (on each test
    backend: NumPy and ``sim:check`` by default, CuPy on a GPU machine)."""
    _EXACT["exact"] = module_each_backend != "cupy"
    with gt.connect_local(module_each_backend):
        yield "gpuremote"


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if _EXACT["exact"] or not (a.is_floating_point() or a.is_complex()):
            return torch.equal(a, b)
        low = a.dtype in (torch.float16, torch.bfloat16)  # a GPU's half-precision kernels
        return torch.allclose(a, b, rtol=1e-2 if low else 1e-4, atol=1e-2 if low else 1e-5)
    if isinstance(a, float) and not _EXACT["exact"]:
        return abs(a - b) <= 1e-4 * max(1.0, abs(a))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw", "adam_fused"])
def test_an_mlp_trains_as_on_the_cpu_with_one_round_trip_a_step(
    device: str, optimizer: str
) -> None:
    def run(dev: str) -> tuple[list[float], list[Any]]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(dev)
        opt = {
            "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
            "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
        }[optimizer](m.parameters())
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(4):
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(m(x.to(dev)), y.to(dev))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in m.parameters()]

    local = run("cpu")
    before = gt.stats()
    remote = run(device)
    after = gt.stats()
    assert _same(local, remote)
    # a round trip per step (loss.item()) and one per parameter read back at the end
    assert after["round_trips"] - before["round_trips"] == 4 + 4


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_an_optimizer_step_is_a_few_calls_whatever_the_parameters(device: str, name: str) -> None:
    """The ``_foreach_`` ops go whole (not one op per parameter), and their step sizes,
    which change at every step, do not miss the metadata cache."""
    m = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)]).to(device)  # 24 parameters
    kinds = {
        "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    }
    opt = kinds[name](m.parameters())
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the state is made
    before = gt.stats()["calls"]["async"]
    opt.step()
    calls = gt.stats()["calls"]["async"] - before
    assert calls <= 12, calls


class _Net(nn.Module):
    """Conv2d, BatchNorm, pooling, SiLU; Embedding, LayerNorm, GELU, a causal transformer
    encoder layer; Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.emb = nn.Embedding(20, 16)
        self.ln = nn.LayerNorm(16)
        self.enc = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8 * 4 * 4 + 16, 5)

    def forward(self, img: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        a = self.pool(F.silu(self.bn(self.conv(img)))).flatten(1)
        mask = nn.Transformer.generate_square_subsequent_mask(tok.shape[1], device=tok.device)
        h = self.enc(F.gelu(self.ln(self.emb(tok))), src_mask=mask, is_causal=True)
        return self.head(torch.cat([a, h.mean(1)], 1))


def _program(dev: str) -> dict[str, Any]:
    """A plain PyTorch program, written without gpuremote in mind."""
    out: dict[str, Any] = {}
    torch.manual_seed(0)
    m = _Net().to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        img = torch.randn(4, 3, 8, 8, generator=g).to(dev)
        tok = torch.randint(0, 20, (4, 6), generator=g).to(dev)
        y = torch.randint(0, 5, (4,), generator=g).to(dev)
        loss = F.cross_entropy(m(img, tok), y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(m.parameters(), 0.5)
        opt.step()
        out[f"loss{step}"] = loss.item()
    m.eval()
    with torch.no_grad():
        out["eval"] = m(img, tok).cpu()
    x = torch.arange(12.0).to(dev).view(3, 4)
    v = x[1:, ::2]  # in-place ops on a view write the base
    v.mul_(10)
    v += 1
    out["views"] = x.cpu()
    out["mask"] = x[x > 20].cpu()
    out["nonzero"] = torch.nonzero(x > 50).cpu()
    out["topk"] = [t.cpu() for t in torch.topk(x.flatten(), 3)]
    h = torch.randn(8, 8, generator=g).half().to(dev)
    out["float16 matmul"] = (h @ h).cpu()
    out["int64 cumsum"] = torch.arange(10).to(dev).cumsum(0).cpu()
    out["tolist"] = x.tolist()
    out["item"] = x[2, 3].item()
    out["repr"] = repr(x).replace(", device='gpuremote:0'", "")
    saved = io.BytesIO()
    torch.save(m.state_dict(), saved)
    saved.seek(0)
    loaded = torch.load(saved, map_location=dev)
    out["load"] = {k: t.cpu() for k, t in loaded.items()}
    out["load device"] = {t.device.type for t in loaded.values()}
    twin = copy.deepcopy(m)
    with torch.no_grad():
        twin.head.weight.zero_()  # the copy's buffers are its own
        out["deepcopy"] = (twin(img, tok).cpu(), m(img, tok).cpu())
    return out


@pytest.mark.slow
def test_a_plain_pytorch_program_gives_the_cpus_results(device: str) -> None:
    local = _program("cpu")
    local["load device"] = {"gpuremote"}
    remote = _program(device)
    for key in local:
        if key == "repr" and not _EXACT["exact"]:
            continue  # a GPU's last digits differ, and printing shows them
        assert _same(local[key], remote[key]), key


def _ops(dev: str) -> dict[str, Any]:
    """Ops a program may use, each a function of the device (same inputs on each)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 5, generator=g).to(dev), torch.randn(4, 5, generator=g).to(dev)
    img = torch.randn(2, 3, 8, 8, generator=g).to(dev)
    i, m = torch.tensor([0, 2, 3]).to(dev), (a > 0)

    def seeded(make: Any, *args: Any, **kwargs: Any) -> Any:
        torch.manual_seed(6)
        return make(*args, **kwargs).to(dev)

    def setitem(t: torch.Tensor, key: Any, v: Any) -> torch.Tensor:
        t[key] = v
        return t

    return {
        "tensor": lambda: torch.tensor([1.5, 2.5], device=dev),
        "factories": lambda: (
            torch.full((2, 3), 7.0, device=dev),
            torch.eye(3, device=dev),
            torch.linspace(0, 1, 5, device=dev),
            torch.arange(0, 1, 0.25, device=dev),
        ),
        "indexing": lambda: (a[i], a[:, 1:4:2], a[m], a[i, 1]),
        "setitem": lambda: (
            setitem(a.clone(), (slice(None), 1), 5.0),
            setitem(a.clone(), a > 0, 0.0),
            a.clone().index_put_((i,), torch.ones(3, 5, device=dev)),
        ),
        "gather/scatter": lambda: (
            a.gather(1, torch.zeros(4, 2, dtype=torch.long, device=dev)),
            torch.zeros(4, 5, device=dev).scatter_(
                1, torch.ones(4, 1, dtype=torch.long, device=dev), 1.0
            ),
        ),
        "reductions": lambda: (
            a.argmax(1),
            tuple(a.max(dim=1)),
            tuple(a.sort(1)),
            a.std(),
            a.var(1),
            a.norm(),
            a.cumprod(1),
            tuple(a.topk(2, dim=1)),
        ),
        "data-dependent": lambda: (
            torch.unique(torch.tensor([3, 1, 3, 2]).to(dev)),
            torch.where(m),
            torch.bincount(i),
            torch.equal(a, b),
            torch.allclose(a, a),
            bool(m.any()),
        ),
        "elementwise": lambda: (
            torch.where(m, a, b),
            a.masked_fill(m, -1.0),
            a.clamp(-0.5, 0.5).pow(2).exp().log1p(),
            torch.tensor([7, -7]).to(dev) // 2,
            torch.nan_to_num(torch.tensor([float("nan"), 1.0]).to(dev)),
        ),
        "linear algebra": lambda: (
            torch.einsum("ij,kj->ik", a, b),
            torch.cdist(a, b),
            torch.bmm(a[None], b.t()[None]),
        ),
        "casts": lambda: (a.half(), a.double(), a.to(torch.int32), a.bool(), a.bfloat16()),
        "shapes": lambda: (
            torch.stack([a, b]),
            a.repeat(2, 1),
            a.flip(0),
            a.roll(1, 1),
            a.tril(),
            torch.cat(a.chunk(2, 1), 1),
            torch.view_as_real(torch.complex(a, b)),
        ),
        "losses": lambda: (
            F.mse_loss(a, b),
            F.binary_cross_entropy_with_logits(a, (b > 0).float()),
            F.kl_div(F.log_softmax(a, 1), F.softmax(b, 1), reduction="batchmean"),
        ),
        "vision": lambda: (
            F.interpolate(img, scale_factor=2, mode="bilinear"),
            F.interpolate(img, size=(5, 5)),
            F.adaptive_avg_pool2d(img, 3),
            F.pad(img, (1, 1, 2, 0), mode="reflect"),
            F.unfold(img, 2),
            seeded(nn.ConvTranspose2d, 3, 2, 3, stride=2)(img),
            seeded(nn.GroupNorm, 1, 3)(img),
            seeded(nn.InstanceNorm2d, 3)(img),
        ),
        "embedding_bag": lambda: F.embedding_bag(
            i,
            torch.randn(10, 3, generator=torch.Generator().manual_seed(2)).to(dev),
            torch.tensor([0, 2]).to(dev),
        ),
    }


def _host(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (tuple, list)):
        return [_host(y) for y in x]
    return x


def test_the_ops_a_program_uses_give_the_cpus_results(device: str) -> None:
    local = {k: _host(f()) for k, f in _ops("cpu").items()}
    for name, f in _ops(device).items():
        assert _same(local[name], _host(f())), name


def test_recurrent_layers_run_and_train(device: str) -> None:
    """ATen's LSTM and GRU take fused cells on any device but the CPU: here they run as the
    cells' arithmetic (equal to the CPU's within rounding)."""
    for layer in (nn.LSTM, nn.GRU):
        results = []
        for dev in ("cpu", device):
            torch.manual_seed(5)
            rnn = layer(4, 6, batch_first=True).to(dev)
            x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(3)).to(dev)
            out = rnn(x)[0]
            out.sum().backward()
            results.append([out.detach().cpu(), *(p.grad.cpu() for p in rnn.parameters())])
        for a, b in zip(*results, strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "bert", "gpt2"])
def test_the_papers_models_train_as_on_the_cpu(device: str, name: str) -> None:
    w = workload(name, "small")
    local = train(w, "cpu", 3)
    before = gt.stats()
    remote = train(w, device, 3)
    after = gt.stats()
    assert _same(local, remote)
    reads = len(local[1])  # the final weights, read back one by one
    assert after["round_trips"] - before["round_trips"] - reads <= 3 * 3  # <= 3 a step


def test_a_language_model_step_takes_at_most_three_round_trips(device: str) -> None:
    w = workload("gpt2", "small")
    torch.manual_seed(0)
    model = w.make().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    x, y = w.batch(g)
    x, y = x.to(device), y.to(device)
    for _ in range(2):  # the first step fills the metadata cache
        before = gt.stats()
        loss = w.loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
        after = gt.stats()
    assert after["round_trips"] - before["round_trips"] <= 3  # (frames: as the helper nudges)


def test_a_shape_error_is_the_local_runtime_error_and_the_session_goes_on(device: str) -> None:
    a = torch.ones(3, 4, device=device)
    b = torch.ones(5, 6, device=device)
    with pytest.raises(RuntimeError, match=r"3, 4\] X \[5, 6|3x4 and 5x6"):
        a @ b
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(3, 4)  # a CPU tensor beside a device one
    assert (a @ b.new_ones(4, 2)).sum().item() == 24.0


def test_data_dependent_ops_wait_and_others_do_not(device: str) -> None:
    x = torch.arange(10.0, device=device)
    before = gt.stats()
    y = (x * 2 + 1).relu_()[::2]
    z = torch.cat([y, y]).sum(0, keepdim=True)
    assert gt.stats()["round_trips"] == before["round_trips"]  # nothing waited
    mask = y > 5
    picked = y[mask]
    assert gt.stats()["round_trips"] == before["round_trips"] + 1  # the mask's result size
    assert picked.tolist() == [9.0, 13.0, 17.0]
    assert z.item() == 90.0


def test_the_devices_generator_is_seeded_by_torch_manual_seed(device: str) -> None:
    torch.manual_seed(123)
    local = torch.randn(5), torch.rand(3)
    torch.manual_seed(123)
    remote = torch.randn(5, device=device), torch.rand(3, device=device)
    again = torch.randn(5, device=device)
    torch.manual_seed(123)
    assert torch.equal(torch.randn(5, device=device).cpu(), remote[0].cpu())  # reseeded
    assert not torch.equal(again.cpu(), remote[0].cpu())
    if _EXACT["exact"]:  # a CPU proxy's generator is the CPU's (a GPU's draws otherwise)
        assert _same(local, tuple(t.cpu() for t in remote))
    drop = F.dropout(torch.ones(1000, device=device), 0.5)
    assert 300 < int((drop == 0).sum().item()) < 700


@pytest.mark.slow
def test_torch_compile_runs_its_graphs_op_by_op_on_the_device(device: str) -> None:
    """``backend="aot_eager"``: the forward and backward graphs' ATen ops run on the device
    as eager ones do (a backend that ships graphs whole is another issue's)."""
    results = []
    for dev in ("cpu", device):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2)).to(dev)
        f = torch.compile(m, backend="aot_eager")
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to(dev)
        y = f(x)
        y.square().sum().backward()
        results.append([y.detach().cpu(), *(p.grad.cpu() for p in m.parameters())])
    assert _same(results[0], results[1])


def test_a_simulated_gpu_times_aten_ops_by_their_work() -> None:
    """``sim:a100``: each ATen op takes the roofline time of its FLOPs (torch's formulas:
    matrix products, convolutions, attention) and bytes, at least the kernel floor."""
    from gpuremote.backends.profiles import PROFILES

    a100 = PROFILES["a100"]
    with gt.connect_local("sim:a100") as conn:
        backend = conn.drivers[0]._proxy.backend
        a = torch.randn(512, 512).to("gpuremote")
        conn.synchronize()

        def timed(fn: Any) -> float:
            before = backend.timing()[0]
            fn()
            conn.synchronize()
            return float(backend.timing()[0] - before)

        flops, nbytes = 2 * 512**3, 3 * 512 * 512 * 4
        mm = max(flops / a100.matmul_flops["float32"], nbytes / a100.mem_bw)
        assert timed(lambda: a @ a) == pytest.approx(mm, rel=1e-6)
        assert timed(lambda: a + a) == pytest.approx(a100.kernel_floor_s, rel=1e-6)
        assert (a @ a).sum().item() == pytest.approx(float((a.cpu() @ a.cpu()).sum()), rel=1e-4)


def test_stats_have_the_keys_of_the_async_api(device: str) -> None:
    stats = gt.stats()
    for key in ("frames_sent", "round_trips", "bytes_sent", "calls"):
        assert key in stats


@pytest.mark.slow
def test_a_proxy_process_over_tcp_serves_pytorch() -> None:
    """The program above, against a ``gpuremote serve --backend numpy`` process."""
    local = _program("cpu")
    local["load device"] = {"gpuremote"}
    with LocalProxy("tcp", "numpy") as p, gt.connect(p.url) as conn:
        assert conn.devices == [torch.device("gpuremote", 0)]
        remote = _program("gpuremote")
        w = workload("gpt2", "small")
        assert _same(train(w, "cpu", 2), train(w, "gpuremote", 2))
    for key in local:
        assert _same(local[key], remote[key]), key


def test_devices_k_on_a_pool_opens_a_session_on_each_placed_proxy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``connect("pool://NAME", devices=2)``: the pool places 2 proxies (the opener's
    ``devices_now``, as ``gpuremote.xp`` asks it), each becomes a device, with the pool's
    options (its secret); the guard library is asked for (here: refused, so the reason)."""
    import gpuremote.session.opener as opener
    import gpuremote.torch as gtorch
    from gpuremote.torch import _guard

    asked: list[Any] = []
    monkeypatch.setattr(
        opener,
        "devices_now",
        lambda url, k, options: asked.append((url, k)) or (["tcp://a:1", "tcp://b:2"], {"s": 1}),
    )
    monkeypatch.setattr(_guard, "_why", "turned off for this test")
    monkeypatch.setattr(_guard, "_ops", None)
    with pytest.raises(NotImplementedError, match="turned off for this test"):
        gtorch.connect("pool://team", devices=2)
    assert asked == [("pool://team", 2)]


def test_devices_k_needs_a_pool_or_k_urls() -> None:
    """``devices=2`` places on a pool; one proxy's URL names one device."""
    from gpuremote.errors import ConfigError

    with pytest.raises(ConfigError, match="pool://"):
        gt.connect("tcp://127.0.0.1:1", devices=2)
    with pytest.raises(ValueError, match="devices=3 but 2 URLs"):
        gt.connect("tcp://127.0.0.1:1,tcp://127.0.0.1:2", devices=3)


@pytest.mark.slow
def test_a_torch_session_survives_a_proxy_killed_mid_training(tmp_path: Any) -> None:
    """``failover=``: the session moves to the other proxy (buffers, the generator's state,
    the ops' templates, the calls since the checkpoint) and training goes on as if nothing
    happened, bitwise, dropout included."""
    import os
    import signal

    secret = tmp_path / "secret"
    secret.write_text("s" * 32)
    extra = ("--secret-file", str(secret), "--quiet")
    w = workload("gpt2", "small")

    def run(url: str, kill: int, **options: Any) -> tuple[list[float], dict[str, Any]]:
        with gt.connect(url, secret="s" * 32, **options) as conn:
            torch.manual_seed(0)
            model = w.make()
            for m in model.modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.1  # random ops on the device: its generator is part of the state
            model = model.to("gpuremote")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
            g = torch.Generator().manual_seed(1)
            losses = []
            for step in range(6):
                if step == kill - 2:  # a checkpoint after random ops, random ops after it
                    _wait_for_a_checkpoint()
                if step == kill:
                    os.kill(proxy_a.pid, signal.SIGKILL)
                x, y = w.batch(g)
                loss = w.loss(model, x.to("gpuremote"), y.to("gpuremote"))
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            state = {k: v.cpu() for k, v in model.state_dict().items()}
            if options:
                assert gt.stats()["failovers"] == 1
            # the steps after the first ran their ops by template, kept before the kill
            # (checkpointed) and after it (journaled): the new proxy has them all
            assert len(conn.drivers[0].templates) > 50
            return losses, state

    with (
        LocalProxy("tcp", "numpy", extra_args=extra) as proxy_a,
        LocalProxy("tcp", "numpy", extra_args=(*extra, "--peer", proxy_a.url)) as proxy_b,
    ):
        ref = run(proxy_b.url, 99)
        got = run(proxy_a.url, 4, failover=[proxy_a.url, proxy_b.url], checkpoint_interval_s=0.005)
    assert _same(ref, got)


def _wait_for_a_checkpoint() -> None:
    """Until the failover session has taken a checkpoint from here on."""
    import time

    before = gt.stats()["checkpoints"]
    deadline = time.monotonic() + 30
    while gt.stats()["checkpoints"] == before:
        assert time.monotonic() < deadline, "no checkpoint was taken"
        torch.gpuremote.synchronize()  # a waiting call: checkpoints start and go on there
        time.sleep(0.01)
