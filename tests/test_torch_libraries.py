"""PyTorch programs as people write them, from libraries nobody here wrote: Hugging Face
``transformers`` and ``diffusers`` (and ``timm`` / ``torchvision`` where their wheels load
beside the CPU build of torch), models built from small configs with random weights (no
downloads), run as plain user code on the ``gpuremote`` device and on the CPU: the results
must be the CPU's, bitwise.

The programs run without dropout (a device draws its random numbers from its own generator,
as CUDA does: the same seed gives the same numbers only where the same ops draw them)."""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import gpuremote.torch as gt  # noqa: E402

pytestmark = pytest.mark.slow
DEV = "gpuremote"
V = 100  # the vocabularies' size
#: imported by the first test that needs it (not at collection: its thousands of modules
#: would make every full garbage collection of the rest of the suite slower)
transformers: Any = None


@pytest.fixture(scope="module", autouse=True)
def device() -> Any:
    global transformers
    transformers = pytest.importorskip("transformers")
    with contextlib.suppress(ImportError):
        import diffusers  # noqa: F401
    gc.collect()
    gc.freeze()  # the libraries' modules live as long as the process: out of the GC's way
    with gt.connect_local("numpy") as conn:
        yield conn


def _state(m: Any) -> dict[str, Any]:
    return {k: v.detach().cpu() for k, v in m.state_dict().items()}


def _assert_same(a: Any, b: Any, what: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _assert_same(a[k], b[k], f"{what}: {k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what
    else:
        assert a == b, what


def _on_both(program: Callable[[str], Any]) -> None:
    _assert_same(program("cpu"), program(DEV), program.__name__)


_DECODERS: dict[str, Callable[[], Any]] = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2,
            n_head=2,
            n_embd=32,
            vocab_size=V,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    ),
    "llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=V,
            max_position_embeddings=64,
        )
    ),
}


@pytest.mark.parametrize("name", sorted(_DECODERS))
def test_decoders_train_and_generate_with_their_cache_as_on_the_cpu(name: str) -> None:
    """Three AdamW steps with clipping (GPT-2's input embedding and LM head are one tied
    parameter, its gradient from both), then a 16-token greedy ``generate()`` with the
    default KV cache (which starts empty): the same losses, weights and tokens."""

    def program(dev: str) -> Any:
        torch.manual_seed(0)
        model = _DECODERS[name]().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            ids = torch.randint(0, V, (2, 12), generator=g).to(dev)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        model.eval()
        prompt = torch.randint(0, V, (1, 5), generator=g).to(dev)
        with torch.no_grad():
            tokens = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
        return losses, tokens.cpu(), _state(model)

    _on_both(program)


def test_bert_with_a_padding_mask_trains_as_on_the_cpu() -> None:
    """Masked attention: the padding mask reaches ``scaled_dot_product_attention``."""

    def program(dev: str) -> Any:
        torch.manual_seed(0)
        config = transformers.BertConfig(
            num_hidden_layers=2,
            num_attention_heads=2,
            hidden_size=32,
            intermediate_size=64,
            vocab_size=V,
            max_position_embeddings=64,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = transformers.BertForSequenceClassification(config).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(2):
            ids = torch.randint(1, V, (3, 10), generator=g)
            mask = torch.ones(3, 10, dtype=torch.long)
            mask[1, 6:] = 0
            mask[2, 3:] = 0
            labels = torch.randint(0, 3, (3,), generator=g)
            out = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), labels=labels.to(dev))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
        return losses, _state(model)

    _on_both(program)


def test_a_diffusers_unet_trains_and_denoises_as_on_the_cpu() -> None:
    """A ``UNet2DConditionModel`` training step (cross-attention, group norm, timestep
    embeddings), then three DDPM denoising steps."""
    diffusers = pytest.importorskip("diffusers")

    def program(dev: str) -> Any:
        torch.manual_seed(0)
        unet = diffusers.UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(16, 32),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=16,
            attention_head_dim=4,
            norm_num_groups=8,
        ).to(dev)
        scheduler = diffusers.DDPMScheduler(num_train_timesteps=50)
        opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1)
        x0, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
        t = torch.randint(0, 50, (2,), generator=g)
        context = torch.randn(2, 5, 16, generator=g)
        noisy = scheduler.add_noise(x0, noise, t)
        pred = unet(noisy.to(dev), t.to(dev), encoder_hidden_states=context.to(dev)).sample
        loss = torch.nn.functional.mse_loss(pred, noise.to(dev))
        loss.backward()
        opt.step()
        scheduler.set_timesteps(3)
        sample = torch.randn(1, 4, 8, 8, generator=g).to(dev)
        draws = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for step in scheduler.timesteps:
                eps = unet(sample, step, encoder_hidden_states=context[:1].to(dev)).sample
                sample = scheduler.step(eps, step, sample, generator=draws).prev_sample
        return loss.item(), sample.cpu(), _state(unet)

    _on_both(program)


def _loads(module: str) -> str | None:
    """Why ``module`` cannot be used here (None: it can)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # not installed, or its compiled ops do not load beside torch
        return f"{module} does not load beside torch {torch.__version__}: {exc}"
    return None


@pytest.mark.parametrize("name", ["resnet18", "mobilenetv3_small_050", "vit_tiny_patch16_224"])
def test_timm_networks_train_as_on_the_cpu(name: str) -> None:
    """timm imports torchvision, whose wheels on the registry are CUDA builds for torch
    2.13 (its C ops do not load beside the CPU build): this runs where they load
    (``scripts/test_torch_release.sh 2.14.1``)."""
    why = _loads("timm")
    if why is not None:
        pytest.skip(why)
    import timm

    def program(dev: str) -> Any:
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=5, drop_rate=0.0)
        model = model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        size = 224 if "vit" in name else 64
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 3, size, size, generator=g).to(dev)
        y = torch.randint(0, 5, (2,), generator=g).to(dev)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item(), _state(model)

    _on_both(program)


def test_a_torchvision_network_trains_as_on_the_cpu() -> None:
    """torchvision's ResNet-18 (see the timm test for where its wheel loads)."""
    why = _loads("torchvision")
    if why is not None:
        pytest.skip(why)
    import torchvision

    def program(dev: str) -> Any:
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=5).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 3, 64, 64, generator=g).to(dev)
        y = torch.randint(0, 5, (2,), generator=g).to(dev)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.item(), _state(model)

    _on_both(program)
