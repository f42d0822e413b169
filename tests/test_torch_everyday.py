"""Everyday PyTorch habits beyond the documented examples, each checked against CPU torch.

Each case is something a PyTorch user does without thinking (tied weights, an optimizer made
before `.to()`, autocast, an LSTM, `torch.randn(device=...)`, gradient clipping, a Conv1d), and
each must either match CPU torch or say why not; none may silently differ.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

import torch.nn.functional as F
from torch import nn


@pytest.fixture
def fresh():
    ttt.close()
    ttt.open_device()
    from ttflow.torch import _fallback

    _fallback.warned.clear()  # the CPU-fallback warnings below must be seen, not remembered
    yield ttt.device()
    ttt.close()


@pytest.fixture
def on_device_only():
    """Fails the test if any op ran on the CPU (the fallback warns once per op)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran on the CPU")
        warnings.filterwarnings("error", message=".*runs eagerly, op by op")
        yield


def _grads_close(cpu_module, tt_module, atol=1e-5, rtol=1e-4):
    for (name, p), q in zip(cpu_module.named_parameters(), tt_module.parameters(), strict=True):
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=atol, rtol=rtol, msg=name)


class _TiedLM(nn.Module):
    """An embedding whose weight is also the output projection's (GPT-2, T5, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.lin = nn.Linear(16, 16)
        self.out = nn.Linear(16, 20, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.lin(self.emb(ids)))).reshape(-1, 20)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_tied_weights_stay_tied_and_train_like_cpu(fresh, on_device_only, compiled):
    torch.manual_seed(0)
    cpu = _TiedLM()
    model = copy.deepcopy(cpu)
    weight = model.emb.weight
    model.to("tt")
    assert model.out.weight is model.emb.weight is weight  # the same Parameter, as for CUDA
    run = torch.compile(model, backend="tt") if compiled else model
    opt_cpu, opt_tt = torch.optim.Adam(cpu.parameters(), lr=0.01), torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(3):
        ids, target = torch.randint(0, 20, (4, 5)), torch.randint(0, 20, (20,))
        for m, opt, dev in ((cpu, opt_cpu, "cpu"), (run, opt_tt, "tt")):
            opt.zero_grad()
            nn.functional.cross_entropy(m(ids.to(dev)), target.to(dev)).backward()
            opt.step()
    torch.testing.assert_close(model.emb.weight.cpu(), cpu.emb.weight, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(model.lin.weight.cpu(), cpu.lin.weight, atol=1e-5, rtol=1e-4)


def test_an_optimizer_made_before_to_still_trains_the_model(fresh, on_device_only):
    torch.manual_seed(0)
    cpu = nn.Linear(8, 3)
    model = copy.deepcopy(cpu)
    opt_tt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # before the move
    model.to("tt")
    opt_cpu = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        x = torch.randn(4, 8)
        for m, opt, dev in ((cpu, opt_cpu, "cpu"), (model, opt_tt, "tt")):
            opt.zero_grad()
            m(x.to(dev)).square().sum().backward()
            opt.step()
    assert model.weight.device.type == "tt"
    torch.testing.assert_close(model.weight.cpu(), cpu.weight, atol=1e-6, rtol=1e-5)
    model.to("cpu")  # and back: still the same objects
    assert opt_tt.param_groups[0]["params"][0] is model.weight


def test_a_moved_parameter_keeps_its_gradient(fresh):
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    module = nn.Module()
    module.p = p
    module.to("tt")
    assert module.p is p and p.grad.device.type == "tt"
    assert torch.equal(p.grad.cpu(), torch.full((3,), 2.0))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_autocast_bfloat16_matches_cpu_autocast(fresh, on_device_only, compiled):
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    model = copy.deepcopy(cpu).to("tt")
    run = torch.compile(model, backend="tt") if compiled else model
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_cpu = cpu(x)
        loss_cpu = nn.functional.cross_entropy(out_cpu, y)
    with torch.autocast("tt", dtype=torch.bfloat16):
        out_tt = run(x.to("tt"))
        loss_tt = nn.functional.cross_entropy(out_tt, y.to("tt"))
    assert out_tt.dtype == out_cpu.dtype == torch.bfloat16  # matmuls in bfloat16
    assert loss_tt.dtype == torch.float32  # losses in float32, as autocast's policy says
    torch.testing.assert_close(out_tt.cpu(), out_cpu)
    torch.testing.assert_close(loss_tt.cpu(), loss_cpu, atol=1e-3, rtol=1e-3)
    loss_cpu.backward()
    loss_tt.backward()
    assert model[0].weight.grad.dtype == torch.float32
    _grads_close(cpu, model, atol=1e-2, rtol=2e-2)  # bfloat16 matmuls (eps 2**-8) on both sides


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_recurrent_layers_match_cpu(fresh, on_device_only, cell, compiled):
    torch.manual_seed(0)
    cpu = cell(8, 16, num_layers=2, batch_first=True)
    model = copy.deepcopy(cpu).to("tt")
    run = torch.compile(model, backend="tt") if compiled else model
    x = torch.randn(3, 5, 8, requires_grad=True)
    xt = x.detach().to("tt").requires_grad_()
    out_cpu, state_cpu = cpu(x)
    out_tt, state_tt = run(xt)
    h_cpu = state_cpu[0] if cell is nn.LSTM else state_cpu
    h_tt = state_tt[0] if cell is nn.LSTM else state_tt
    torch.testing.assert_close(out_tt.cpu(), out_cpu, atol=1e-6, rtol=1e-5)
    (out_cpu.square().sum() + h_cpu.sum()).backward()
    (out_tt.square().sum() + h_tt.sum()).backward()
    _grads_close(cpu, model)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, atol=1e-6, rtol=1e-5)


def test_random_fills_draw_the_cpu_generators_values(fresh, on_device_only):
    def draws(device):
        torch.manual_seed(7)
        return [torch.randn(4, 5, device=device), torch.rand(3, device=device),
                torch.empty(6, device=device).uniform_(2, 3), torch.randint(0, 9, (5,), device=device),
                torch.empty(8, device=device).bernoulli_(0.3), nn.Linear(4, 3, device=device).weight]
    for on_tt, on_cpu in zip(draws("tt"), draws("cpu"), strict=True):
        assert on_tt.device.type == "tt"
        assert torch.equal(on_tt.detach().cpu(), on_cpu.detach())
    x = torch.zeros(4, 4, device="tt")
    x[:, 1].normal_()  # a fill through a view writes only the view
    host = x.cpu()
    assert torch.count_nonzero(host[:, 1]) == 4 and torch.count_nonzero(host[:, [0, 2, 3]]) == 0


def test_a_tt_generator_draws_what_a_cpu_generator_seeded_alike_draws(fresh):
    """`torch.Generator(device="tt")` (diffusers' pipelines make one per device): its draws are a
    CPU generator's, each op advancing it once, and it pickles and re-seeds like one."""
    def draws(device, generator):
        probs = torch.tensor([[0.2, 0.3, 0.5]], device=device)
        return [torch.randn(4, 5, generator=generator, device=device),
                torch.rand(3, generator=generator, device=device),
                torch.randint(0, 9, (5,), generator=generator, device=device),
                torch.empty(6, device=device).normal_(2, 3, generator=generator),
                torch.randperm(9, generator=generator, device=device),
                torch.multinomial(probs, 6, replacement=True, generator=generator),
                torch.bernoulli(torch.full((8,), 0.5, device=device), generator=generator)]

    g = torch.Generator(device="tt").manual_seed(11)
    assert g.device == torch.device("tt", 0) and g.initial_seed() == 11
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # randperm and multinomial run on the host, and say so
        first = draws("tt", g)
        twin = copy.deepcopy(g)
        second, from_twin = draws("tt", g), draws("tt", twin)
        g.manual_seed(11)
        again = draws("tt", g)
    c = torch.Generator().manual_seed(11)
    expected = draws("cpu", c) + draws("cpu", c)
    for on_tt, on_cpu in zip(first + second, expected, strict=True):
        assert on_tt.device.type == "tt" and torch.equal(on_tt.cpu(), on_cpu)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    for a, b in zip(second, from_twin, strict=True):
        assert torch.equal(a.cpu(), b.cpu())


def test_gradient_clipping_runs_on_the_device(fresh, on_device_only):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 6)), nn.Parameter(torch.randn(7))]
    moved = [nn.Parameter(p.detach().to("tt")) for p in params]
    for p, q in zip(params, moved):
        p.grad = torch.randn(p.shape)
        q.grad = p.grad.to("tt")
    for norm_type in (2.0, 1.0, float("inf")):
        norm_cpu = nn.utils.clip_grad_norm_(params, 0.5, norm_type=norm_type)
        norm_tt = nn.utils.clip_grad_norm_(moved, 0.5, norm_type=norm_type)
        torch.testing.assert_close(norm_tt.cpu(), norm_cpu)
        for p, q in zip(params, moved):
            torch.testing.assert_close(q.grad.cpu(), p.grad)


def test_log1p_losses_match_cpu(fresh, on_device_only):
    x = torch.tensor([1e-9, -1e-5, 0.5, 3.0, -0.999, 1e30, 0.0, -1.0, float("inf")])
    torch.testing.assert_close(torch.log1p(x.to("tt")).cpu(), torch.log1p(x), rtol=4e-7, atol=0)
    logits, target = torch.randn(8, 4) * 30, torch.rand(8, 4)
    torch.testing.assert_close(
        nn.functional.binary_cross_entropy_with_logits(logits.to("tt"), target.to("tt")).cpu(),
        nn.functional.binary_cross_entropy_with_logits(logits, target))
    torch.testing.assert_close(nn.functional.softplus(logits.to("tt")).cpu(), nn.functional.softplus(logits))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_conv1d_and_group_norm_train_on_the_device(fresh, on_device_only, compiled):
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Conv1d(4, 8, 3, padding=1, stride=2), nn.GroupNorm(2, 8), nn.SiLU(),
                        nn.Conv1d(8, 8, 3, dilation=2), nn.Flatten(), nn.Linear(24, 2))
    model = copy.deepcopy(cpu).to("tt")
    run = torch.compile(model, backend="tt") if compiled else model
    x = torch.randn(2, 4, 13)
    out_cpu, out_tt = cpu(x), run(x.to("tt"))
    torch.testing.assert_close(out_tt.cpu(), out_cpu, atol=1e-5, rtol=1e-4)
    out_cpu.square().sum().backward()
    out_tt.square().sum().backward()
    _grads_close(cpu, model)


def test_eager_conv2d_backward_runs_on_the_device(fresh, on_device_only):
    torch.manual_seed(0)
    cpu = nn.Conv2d(3, 4, 3, padding=1)
    model = copy.deepcopy(cpu).to("tt")
    x = torch.randn(2, 3, 8, 8)
    cpu(x).square().sum().backward()
    model(x.to("tt")).square().sum().backward()
    _grads_close(cpu, model, atol=1e-4)


def test_a_graph_break_runs_tt_ops_without_dynamo_tracing_ttflow(fresh, on_device_only):
    """The op at a graph break runs eagerly inside compiled code and calls ttflow.torch's Python
    kernels; dynamo must leave those alone (it tried to compile them: recompiles, warnings about
    untraceable builtins, half-made objects)."""
    import torch._dynamo

    torch._dynamo.reset()

    def f(a, b):
        c = a @ b
        scale = c.sum().item()  # a graph break: `item` runs eagerly
        return torch.tanh(c) * scale

    compiled = torch.compile(f, backend="tt")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Dynamo does not know how to trace")
        warnings.filterwarnings("error", message=".*recompil")
        for _ in range(3):
            torch.testing.assert_close(compiled(a.to("tt"), b.to("tt")).cpu(), f(a, b), atol=1e-5, rtol=1e-4)


def test_printing_is_quiet_and_reads_like_cpu(fresh, on_device_only):
    torch.manual_seed(0)
    for value in (torch.randn(3, 4), torch.arange(5), torch.tensor([1e-8, 1e9]), torch.randn(200, 300),
                  torch.ones(2, dtype=torch.float64), torch.tensor([True, False])):
        on_tt = repr(value.to("tt"))
        assert on_tt.startswith(repr(value)[:-1].rsplit("]", 1)[0])
        assert "device='tt:0'" in on_tt


def test_empty_tensors_outlive_a_closed_device(fresh):
    """Every empty storage has address 0; none may keep a slot of a device closed since."""
    assert torch.empty(0, device="tt").cpu().shape == (0,)
    assert torch.zeros(3, device="tt")[torch.zeros(3, dtype=torch.bool, device="tt")].cpu().numel() == 0
    ttt.close()
    ttt.open_device()
    assert torch.empty(0, 4, device="tt").cpu().shape == (0, 4)
    assert "tensor([], device='tt:0')" == repr(torch.tensor([], device="tt"))


def test_pinned_batches_from_a_dataloader(fresh, on_device_only):
    data = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.arange(10))
    loader = torch.utils.data.DataLoader(data, batch_size=4, pin_memory=True)
    total = torch.zeros((), device="tt")
    for x, y in loader:
        assert x.is_pinned() and y.is_pinned()
        total += x.to("tt", non_blocking=True).sum()
    torch.testing.assert_close(total.cpu(), data.tensors[0].sum())
    host = torch.randn(3, 3)
    assert not host.is_pinned() and host.pin_memory().is_pinned()


def test_scalar_operands_of_ops_the_device_lacks(fresh):
    """`x % 3` reaches the CPU fallback with 3 as a number where the schema says Tensor."""
    ints = torch.tensor([-7, -1, 0, 5, 9])
    for f in (lambda a: a % 3, lambda a: a.float() % 2.5, lambda a: a.to(torch.int32) % 4,
              lambda a: torch.fmod(a, 4)):
        on_tt, on_cpu = f(ints.to("tt")).cpu(), f(ints)
        assert on_tt.dtype == on_cpu.dtype and torch.equal(on_tt, on_cpu)


def test_a_python_float_that_changes_stays_in_the_program(fresh, on_device_only):
    """After a float argument changes, dynamo passes it as a 0-d float64 tensor; the program takes
    it in float32 (as torch's `float32_tensor * python_float` computes) instead of running op by op."""
    import torch._dynamo

    torch._dynamo.reset()
    a = torch.randn(3)
    f = torch.compile(lambda x, s: x * (s * 2 + 1) + s, backend="tt")
    for s in (0.5, 1.5, 2.5, 1 / 3):
        torch.testing.assert_close(f(a.to("tt"), s).cpu(), a * (s * 2 + 1) + s)


def test_timestep_embeddings_and_rounding_run_on_the_device(fresh, on_device_only):
    """A diffusion model's sinusoidal timestep embedding is computed in every forward."""
    def embed(t, dim=8):
        freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, device=t.device) / (dim // 2))
        angles = t[:, None].float() * freqs[None]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    steps = torch.tensor([0, 3, 17, 999])
    torch.testing.assert_close(embed(steps.to("tt")).cpu(), embed(steps), atol=2e-6, rtol=1e-5)
    compiled = torch.compile(embed, backend="tt")
    torch.testing.assert_close(compiled(steps.to("tt")).cpu(), embed(steps), atol=2e-6, rtol=1e-5)
    x = torch.tensor([2.5, -2.5, 0.5, 1.5, -0.7, 3.2, 1e7 + 0.5])
    for op in (torch.floor, torch.ceil, torch.round, torch.trunc):
        assert torch.equal(op(x.to("tt")).cpu(), op(x))
    ints = torch.tensor([-3, 4])
    assert torch.equal(torch.floor(ints.to("tt")).cpu(), ints)


@pytest.mark.parametrize("options", [{"stride": 2}, {"stride": 2, "padding": 1, "output_padding": 1},
                                     {"padding": 1, "dilation": 2}, {"stride": 2, "groups": 2, "bias": False}],
                         ids=["stride", "output_padding", "dilation", "groups"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_transposed_convolution_trains_on_the_device(fresh, on_device_only, options, compiled):
    """ConvTranspose2d (DCGAN generators, U-Net decoders) as the adjoint of conv2d."""
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.ConvTranspose2d(4, 6, 3, **options), nn.ReLU())
    model = copy.deepcopy(cpu).to("tt")
    run = torch.compile(model, backend="tt") if compiled else model
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    xt = x.detach().to("tt").requires_grad_()
    out_cpu, out_tt = cpu(x), run(xt)
    torch.testing.assert_close(out_tt.cpu(), out_cpu, atol=1e-5, rtol=1e-4)
    out_cpu.square().sum().backward()
    out_tt.square().sum().backward()
    _grads_close(cpu, model)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("options", [{"scale_factor": 2}, {"size": (6, 9)}, {"scale_factor": (2, 3)}],
                         ids=["scale", "size", "two_scales"])
def test_eager_nearest_upsampling_by_whole_factors_runs_on_the_device(fresh, on_device_only, options):
    x = torch.randn(2, 3, 3, 3, requires_grad=True)
    xt = x.detach().to("tt").requires_grad_()
    out_cpu = nn.functional.interpolate(x, mode="nearest", **options)
    out_tt = nn.functional.interpolate(xt, mode="nearest", **options)
    assert torch.equal(out_tt.cpu(), out_cpu.detach())
    out_cpu.square().sum().backward()
    out_tt.square().sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad)


@pytest.mark.parametrize("optimizer, options", [
    ("SGD", {"lr": 0.05, "momentum": 0.9}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("Adam", {"lr": 1e-2}),
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
], ids=["sgd-momentum", "sgd-nesterov-decay", "adam", "adamw-amsgrad"])
def test_a_compiled_optimizer_step_is_one_program_and_matches_cpu(fresh, on_device_only, optimizer, options):
    """PyTorch's "compiling the optimizer" recipe: `torch.compile` of a function calling
    `opt.step()`. Its foreach ops lower (as loops of their single-tensor ops), so the step runs
    on the device as one program, with the values of the stock CPU step."""
    from ttflow.torch import _storage

    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    model = copy.deepcopy(cpu).to("tt")
    opt_cpu = getattr(torch.optim, optimizer)(cpu.parameters(), **options)
    opt_tt = getattr(torch.optim, optimizer)(model.parameters(), **options)

    @torch.compile(backend="tt")
    def step():
        opt_tt.step()

    submitted = []
    real_post = _storage.post_program
    for i in range(4):
        x, y = torch.randn(5, 8), torch.randn(5, 3)
        for m, dev in ((cpu, "cpu"), (model, "tt")):
            nn.functional.mse_loss(m(x.to(dev)), y.to(dev)).backward()
        opt_cpu.step()
        if i == 3:  # compiled by now: count the programs the step posts
            _storage.post_program = lambda device, binary, *a: submitted.append(binary) or real_post(device, binary, *a)
        try:
            step()
        finally:
            _storage.post_program = real_post
        opt_cpu.zero_grad()
        opt_tt.zero_grad()
    assert len(submitted) == 1, [b.programs[0].name for b in submitted]
    for (name, p), q in zip(cpu.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.cpu(), p, atol=1e-6, rtol=1e-5, msg=name)
    for state_cpu, state_tt in zip(opt_cpu.state.values(), opt_tt.state.values(), strict=True):
        for key, value in state_cpu.items():
            torch.testing.assert_close(state_tt[key].cpu(), value, atol=1e-6, rtol=1e-5, msg=key)


class _RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rope(x, pos):
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device).float() / d))
    angle = torch.outer(pos.float(), inv)
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


class _LlamaBlock(nn.Module):
    """What a decoder of the Llama family computes: RMSNorm, rotary embeddings at positions
    counted from the attention mask, grouped-query attention (repeat_interleave), a causal mask
    filled with finfo.min, SwiGLU."""

    def __init__(self, d=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(d, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.n1, self.n2 = _RMSNorm(d), _RMSNorm(d)
        self.up, self.gate, self.down = nn.Linear(d, 64, bias=False), nn.Linear(d, 64, bias=False), nn.Linear(64, d, bias=False)

    def forward(self, x, mask):
        b, t, d = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[0]
        q, k = _rope(q, pos), _rope(k, pos)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(self.hd)).masked_fill(~causal, torch.finfo(x.dtype).min)
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(y)
        return x + self.down(F.silu(self.gate(self.n2(x))) * self.up(self.n2(x)))


def test_a_llama_style_block_compiles_whole_and_trains_like_cpu(fresh, on_device_only):
    torch.manual_seed(0)
    cpu = _LlamaBlock()
    tt_block = copy.deepcopy(cpu).to("tt")
    compiled = torch.compile(tt_block, backend="tt")
    opt_cpu, opt_tt = torch.optim.AdamW(cpu.parameters(), 1e-3), torch.optim.AdamW(tt_block.parameters(), 1e-3)
    mask = torch.ones(2, 8, dtype=torch.long)
    for step in range(3):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step))
        want = cpu(x, mask).pow(2).mean()
        want.backward()
        opt_cpu.step()
        opt_cpu.zero_grad()
        got = compiled(x.to("tt"), mask.to("tt")).pow(2).mean()
        got.backward()
        opt_tt.step()
        opt_tt.zero_grad()
        torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(tt_block.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-4, atol=1e-6)
