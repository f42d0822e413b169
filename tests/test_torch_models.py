"""The models people use, on tt against CPU torch from the same state dict: Hugging Face's GPT-2,
Llama (grouped-query attention), BERT, T5 and ViT, torchvision's resnet18 and
mobilenet_v3_small. Tiny configs with random weights: nothing is downloaded.

Each model runs with its default arguments (transformers' DynamicCache included): forward eager
and compiled, three AdamW steps, greedy and seeded sampling `generate()` token for token, and a
`save_pretrained` round trip.

Tolerances (float32, measured on torch 2.13 CPU): transformer outputs differ from CPU torch by at
most ~1e-6 (1 to 3 ulps of the largest value); after three AdamW steps (lr 1e-3) losses by at
most 1e-6 relative, gradients by 1e-4 relative (or 1e-6 of the largest gradient, for those
that are rounding noise: a key bias's, which softmax ignores). Parameters are only checked
within 3 lr: Adam divides by a running RMS, so a noise-sized gradient moves its weight by up to
lr a step whatever its last ulp. CNNs in train mode renormalize every
layer over a batch of 4 at 1x1 spatial size, which amplifies an ulp ~30-fold over mobilenet's 13
blocks (measured layer by layer: 1e-6 -> 4e-5 of the activations' scale), so their losses are
compared within 1e-4.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")


from ttflow._bench.torch_models import torchvision_module

TORCHVISION_MODULE = torchvision_module()  # first: transformers imports torchvision when it is there
transformers = pytest.importorskip(
    "transformers", reason="the model test bed needs transformers: pip install 'transformers>=5,<6'"
)


@pytest.fixture(scope="module", autouse=True)
def device():
    ttt.close()
    ttt.open_device()
    yield ttt.device()
    ttt.close()


@pytest.fixture
def fallbacks():
    """Every CPU fallback or eager graph seen by the test (each must name the op)."""
    from ttflow.torch import _fallback

    _fallback.warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def _fell_back(caught) -> list[str]:
    return [str(w.message) for w in caught if "ran on the CPU" in str(w.message)
            or "runs eagerly" in str(w.message)]


# -- Hugging Face ------------------------------------------------------------------------------------


def _gpt2():
    config = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=95, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _llama():
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, bos_token_id=0, eos_token_id=95)
    return transformers.LlamaForCausalLM(config)


def _bert():
    config = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertModel(config)


def _t5():
    config = transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(config)


def _vit():
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
    return transformers.ViTModel(config)


def _ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 95, shape, generator=torch.Generator().manual_seed(seed))


HF = {
    "gpt2": (_gpt2, lambda: {"input_ids": _ids(2, 8)}),
    "llama": (_llama, lambda: {"input_ids": _ids(2, 8)}),
    "bert": (_bert, lambda: {"input_ids": _ids(2, 8), "attention_mask": torch.tensor([[1] * 8, [1] * 5 + [0] * 3])}),
    "t5": (_t5, lambda: {"input_ids": _ids(2, 8), "decoder_input_ids": _ids(2, 4, seed=1)}),
    "vit": (_vit, lambda: {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}),
}


def _pair(make):
    """A CPU model and a tt copy from the same state dict."""
    torch.manual_seed(0)
    cpu = make().eval()
    return cpu, copy.deepcopy(cpu).to("tt")


def _on_tt(inputs: dict) -> dict:
    return {k: v.to("tt") for k, v in inputs.items()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", list(HF))
def test_hugging_face_forward_matches_cpu(name, compiled, fallbacks) -> None:
    make, inputs = HF[name]
    cpu, tt_model = _pair(make)
    x = inputs()
    torch._dynamo.reset()
    run = torch.compile(tt_model, backend="tt") if compiled else tt_model
    with torch.no_grad():
        expected = cpu(**x)[0]
        got = run(**_on_tt(x))[0]
    assert got.device.type == "tt"
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert not _fell_back(fallbacks)


def _loss(name: str, out, x) -> torch.Tensor:
    if name in ("gpt2", "llama", "t5"):
        return out.loss
    # BERT, ViT: the encoders' outputs against fixed random weights (a mean square of a
    # LayerNorm's output is ~1 whatever the parameters: its gradients would be rounding noise).
    hidden = out[0]
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3))
    return (hidden * weights.to(hidden.device)).sum()


@pytest.mark.parametrize("name", list(HF))
def test_hugging_face_trains_like_cpu(name, fallbacks) -> None:
    make, inputs = HF[name]
    cpu, tt_model = _pair(make)
    cpu.train(), tt_model.train()
    x = inputs()
    if name in ("gpt2", "llama"):
        x["labels"] = x["input_ids"]
    elif name == "t5":
        x["labels"] = _ids(2, 4, seed=2)
        del x["decoder_input_ids"]
    torch._dynamo.reset()
    compiled = torch.compile(tt_model, backend="tt")
    # The reference is compiled too (torch's own aot_eager, on the CPU): a compiled module gives
    # parameters that only an unused output reads (BERT's pooler) a zero gradient, not None,
    # and AdamW then decays them; eager CPU torch would leave them alone.
    reference = torch.compile(cpu, backend="aot_eager")
    cpu_opt = torch.optim.AdamW(cpu.parameters(), lr=1e-3)
    tt_opt = torch.optim.AdamW(tt_model.parameters(), lr=1e-3)
    xt = _on_tt(x)
    for step in range(3):
        expected = _loss(name, reference(**x), x)
        expected.backward()
        got = _loss(name, compiled(**xt), xt)
        got.backward()
        assert abs(got.item() - expected.item()) <= 1e-5 * abs(expected.item()), (step, got.item(), expected.item())
        if step == 0:  # the gradients, before Adam's division turns a noise-sized one into lr
            scale = max(p.grad.abs().max().item() for p in cpu.parameters())
            for (label, p), q in zip(cpu.named_parameters(), tt_model.parameters(), strict=True):
                assert q.grad.device.type == "tt"
                torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-4, atol=1e-6 * scale, msg=label)
        cpu_opt.step(), cpu_opt.zero_grad()
        tt_opt.step(), tt_opt.zero_grad()
    for (label, p), q in zip(cpu.named_parameters(), tt_model.parameters(), strict=True):
        # Adam moves each weight by about lr a step: a weight whose gradient is rounding noise
        # (a key bias: softmax ignores it) may end up to 3 lr away, the others agree closely.
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=0, atol=3e-3, msg=label)
    assert not [m for m in _fell_back(fallbacks) if "ran on the CPU" in m]


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_generate_is_token_exact(name, sample, fallbacks) -> None:
    make, inputs = HF[name]
    cpu, tt_model = _pair(make)
    ids = inputs()["input_ids"][:1]
    options = {"max_new_tokens": 6, "do_sample": sample, "top_k": 0} if sample else {"max_new_tokens": 6}
    torch.manual_seed(5)
    expected = cpu.generate(ids, **options)
    torch.manual_seed(5)
    got = tt_model.generate(ids.to("tt"), **options)
    assert torch.equal(got.cpu(), expected)
    for message in _fell_back(fallbacks):  # a fallback names the op and the line that ran it
        assert message.startswith("aten."), message


def test_save_pretrained_round_trip(tmp_path: Path) -> None:
    cpu, tt_model = _pair(_gpt2)
    tt_model.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    for (label, p), q in zip(cpu.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(p, q), label
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, device_map=None).to("tt").eval()
    x = _ids(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(back(x.to("tt")).logits.cpu(), cpu(x).logits, rtol=1e-5, atol=1e-5)


# -- torchvision -------------------------------------------------------------------------------------

TORCHVISION = ["resnet18", "mobilenet_v3_small"]


def _vision(name: str):
    torchvision = TORCHVISION_MODULE
    if torchvision is None:
        pytest.skip("the CNN test bed needs torchvision: pip install torchvision==0.28.0 --index-url "
                    "https://download.pytorch.org/whl/cpu")
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(num_classes=10)
    for module in model.modules():  # dropout draws differ between devices: none here
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


IMAGES = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_inference_matches_cpu(name, compiled, fallbacks) -> None:
    cpu = _vision(name).eval()
    tt_model = copy.deepcopy(cpu).to("tt")
    torch._dynamo.reset()
    run = torch.compile(tt_model, backend="tt") if compiled else tt_model
    with torch.no_grad():
        torch.testing.assert_close(run(IMAGES.to("tt")).cpu(), cpu(IMAGES), rtol=1e-5, atol=1e-5)
    # Eager max-pool: torch asks the device for the indices too, which it does not make: that
    # one op runs on the CPU, said by its warning (compiled, the indices are never asked for).
    left = [m for m in _fell_back(fallbacks) if not (not compiled and "max-pool indices" in m)]
    assert not left


@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_trains_like_cpu_within_memory(name, device, fallbacks) -> None:
    import ttflow as tt

    cpu = _vision(name).train()
    tt_model = copy.deepcopy(cpu).to("tt")
    labels = torch.arange(4) % 10
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=1e-3, momentum=0.9)
    tt_opt = torch.optim.SGD(tt_model.parameters(), lr=1e-3, momentum=0.9)
    for step in range(2):
        expected = torch.nn.functional.cross_entropy(cpu(IMAGES), labels)
        expected.backward()
        cpu_opt.step(), cpu_opt.zero_grad()
        got = torch.nn.functional.cross_entropy(tt_model(IMAGES.to("tt")), labels.to("tt"))
        got.backward()
        tt_opt.step(), tt_opt.zero_grad()
        assert abs(got.item() - expected.item()) <= 1e-4 * abs(expected.item()), (step, got.item(), expected.item())
    # The weights with their momentum, in at most 4x their bytes (a tile per 3x3 kernel took 113x).
    weights = sum(p.numel() * 4 for p in cpu.parameters())
    assert device.memory_used(tt.MemorySpace.DRAM) <= 4 * 2 * weights + (64 << 20)
