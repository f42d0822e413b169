"""Every module the op set allows, through `torch.compile(backend="tt")` on tt tensors, forward
and backward, against the same module on CPU torch; and none of it may leave the device."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from ttflow.torch import _fallback  # noqa: E402


@pytest.fixture(scope="module")
def device():
    ttt.close()
    ttt.open_device()
    yield ttt.device()
    ttt.close()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each case compiles afresh: dynamo keeps a few compiled versions per code object (every
    nn.Sequential shares one) and runs eagerly beyond them, which would hide what this file tests."""
    torch._dynamo.reset()
    yield


class Encoder(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1]) if self.causal else None
        return self.layer(x, src_mask=mask, is_causal=self.causal)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


class SDPA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)


class TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 16)
        self.out = nn.Linear(16, 11)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(ids)))


class WithLoss(nn.Module):
    """A classifier whose cross-entropy is computed inside the compiled function."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 16), nn.SiLU(), nn.Linear(16, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())


def floats(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(*shape)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "linear_relu": (lambda: nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4)), floats(6, 12)),
    "gelu_erf_layernorm": (lambda: nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.LayerNorm(16)), floats(6, 12)),
    "gelu_tanh_rmsnorm": (lambda: nn.Sequential(nn.Linear(12, 16), nn.GELU("tanh"), nn.RMSNorm(16)),
                          floats(6, 12)),
    "tanh_sigmoid_silu": (lambda: nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Sigmoid(),
                                                nn.Linear(16, 8), nn.SiLU()), floats(6, 12)),
    "softmax_logsoftmax": (lambda: nn.Sequential(nn.Linear(12, 8), nn.Softmax(-1), nn.Linear(8, 8),
                                                 nn.LogSoftmax(-1)), floats(6, 12)),
    "conv_batchnorm": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                             nn.Flatten(), nn.Linear(4 * 6 * 6, 3)), floats(4, 3, 6, 6)),
    "conv_pool": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                        nn.Conv2d(4, 4, 3, stride=2), nn.AvgPool2d(1), nn.Flatten(),
                                        nn.Linear(4, 3)), floats(2, 3, 8, 8)),
    "embedding_int64_ids": (TokenModel, lambda: torch.randint(0, 11, (3, 5))),
    "multihead_attention": (Attention, floats(2, 5, 16)),
    "sdpa_causal": (SDPA, floats(2, 5, 16)),
    "transformer_encoder": (lambda: Encoder(causal=False), floats(2, 5, 16)),
    "transformer_encoder_causal": (lambda: Encoder(causal=True), floats(2, 5, 16)),
    "cross_entropy_inside": (WithLoss, floats(8, 12)),
}


def _run(model: nn.Module, x: torch.Tensor, on_tt: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    if on_tt:
        model = model.to("tt")
        x = x.to("tt")
        model = torch.compile(model, backend="tt")
    if x.is_floating_point():
        x.requires_grad_()
    out = model(x)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * (weights.to("tt") if on_tt else weights)).sum().backward()
    grads = [p.grad.detach().cpu() for p in (model.parameters())]
    return out.detach().cpu(), grads, (x.grad.detach().cpu() if x.is_floating_point() else None)


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = max(float(expected.abs().max()), 1e-6)
    return float((actual.float() - expected.float()).abs().max()) / scale


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float) -> None:
    error = _error(actual, expected)
    assert error <= rel, f"{what}: error {error:.2e} of the largest magnitude (allowed {rel:.1e})"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_trains_on_the_device_like_cpu(device, name, dtype):
    make, inputs = CASES[name]
    torch.manual_seed(0)
    model = make().to(dtype)
    x = inputs()
    if x.is_floating_point():
        x = x.to(dtype)
    _fallback.warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, grads, x_grad = _run(copy.deepcopy(model), x.clone(), on_tt=True)
    left = [str(w.message) for w in caught if "ran on the CPU" in str(w.message) or "runs eagerly" in str(w.message)]
    assert not left, left
    expected_model = copy.deepcopy(model).float() if dtype == torch.bfloat16 else model
    expected_x = x.float() if x.is_floating_point() else x
    expected = _run(copy.deepcopy(expected_model), expected_x.clone(), on_tt=False)
    got = (out, *grads, x_grad)
    want = (expected[0], *expected[1], expected[2])
    names = ("output", *(f"parameter {i} gradient" for i in range(len(grads))), "input gradient")
    if dtype == torch.float32:
        allowed = [1e-4] * len(got)
    else:
        # bfloat16, against the float32 result: one bfloat16 step is 2**-8 of a value and a few
        # pile up through a layer (4e-2); where CPU torch's own bfloat16 run is further off
        # (batch norm's gradients cancel), the device may be off by twice as much.
        cpu = _run(copy.deepcopy(model), x.clone(), on_tt=False)
        cpu_got = (cpu[0], *cpu[1], cpu[2])
        allowed = [4e-2 if g is None else max(4e-2, 2 * _error(c, w)) for g, c, w in zip(got, cpu_got, want)]
    assert out.dtype == dtype or not x.is_floating_point() or name == "cross_entropy_inside"
    for g, w, what, rel in zip(got, want, names, allowed):
        if g is not None:
            _close(g, w, what, rel)


def test_dropout_in_training_is_seeded_and_reproducible(device):
    model = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.5)).to("tt")
    compiled = torch.compile(model, backend="tt")
    x = torch.randn(16, 32).to("tt")
    torch.manual_seed(7)
    first = compiled(x).cpu()
    torch.manual_seed(7)
    again = compiled(x).cpu()
    different = compiled(x).cpu()
    assert torch.equal(first, again)  # torch.manual_seed reproduces the device's masks
    assert not torch.equal(first, different)
    kept = (first != 0).float().mean()
    assert 0.4 < float(kept) < 0.6
    with torch.no_grad():
        dense = model[0](x).cpu()
    torch.testing.assert_close(first[first != 0], (dense * 2)[first != 0], rtol=1e-5, atol=1e-6)
    model.eval()
    torch.testing.assert_close(compiled(x).cpu(), dense, rtol=1e-5, atol=1e-6)


def test_dataloader_loop_with_a_partial_last_batch(device):
    torch.manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(50, 12), torch.randint(0, 5, (50,)))
    loader = torch.utils.data.DataLoader(data, batch_size=16)  # 16, 16, 16, 2
    cpu = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 5))
    on_tt = copy.deepcopy(cpu).to("tt")
    compiled = torch.compile(on_tt, backend="tt")
    cpu_opt = torch.optim.Adam(cpu.parameters(), lr=1e-2)
    tt_opt = torch.optim.Adam(on_tt.parameters(), lr=1e-2)
    for _epoch in range(2):
        for x, y in loader:
            F.cross_entropy(cpu(x), y).backward()
            F.cross_entropy(compiled(x.to("tt")), y.to("tt")).backward()
            for opt in (cpu_opt, tt_opt):
                opt.step()
                opt.zero_grad()
    for p, q in zip(cpu.parameters(), on_tt.parameters()):
        _close(q.detach().cpu(), p.detach(), "parameter", 1e-4)


@pytest.mark.parametrize("norm_first", [False, True])
def test_fused_inference_fast_paths_run_on_the_device(device, norm_first):
    """In eval under no_grad torch calls its fused attention kernels on tt; they must run there."""
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=norm_first).eval()
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    masks = [{}, {"src_mask": nn.Transformer.generate_square_subsequent_mask(5)},
             {"src_key_padding_mask": torch.tensor([[False] * 5, [False] * 3 + [True] * 2])}]
    on_tt, mha_tt = copy.deepcopy(layer).to("tt"), copy.deepcopy(mha).to("tt")
    compiled = torch.compile(on_tt, backend="tt")
    _fallback.warned.clear()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for kw in masks:
            expected = layer(x, **kw)
            on_device = {k: v.to("tt") for k, v in kw.items()}
            _close(on_tt(x.to("tt"), **on_device).cpu(), expected, f"eager {list(kw)}", 1e-5)
            _close(compiled(x.to("tt"), **on_device).cpu(), expected, f"compiled {list(kw)}", 1e-5)
        out, weights = mha(x, x, x)
        out_tt, weights_tt = mha_tt(x.to("tt"), x.to("tt"), x.to("tt"))
        _close(out_tt.cpu(), out, "attention output", 1e-5)
        _close(weights_tt.cpu(), weights, "attention weights", 1e-5)
    left = [str(w.message) for w in caught if "ran on the CPU" in str(w.message) or "runs eagerly" in str(w.message)]
    assert not left, left
