"""The PyTorch front-end, checked against the same computation done by CPU torch."""

from __future__ import annotations

import copy
import threading

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

from torch import nn

import ttflow as tt


class MNISTLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(784, 256)
        self.relu = nn.ReLU()
        self.l2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.relu(self.l1(x)))


class Mixed(nn.Module):
    """GELU, LayerNorm, softmax, sigmoid and elementwise arithmetic, to exercise every derivative."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(48, 64)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(64)
        self.l2 = nn.Linear(64, 40)
        self.scale = nn.Parameter(torch.rand(40) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.act(self.l1(x)))
        z = self.l2(h) * self.scale
        return torch.softmax(z, dim=-1) * 3.0 + torch.sigmoid(z) - 0.5 * z


@pytest.fixture
def fresh():
    """A newly opened default device (fresh counters); everything closed afterwards."""
    ttt.close()
    ttt.open_device()
    yield ttt.device()
    ttt.close()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def test_tensor_to_tt_and_back(fresh):
    host = torch.rand(1, 784)
    t = host.to("tt")
    assert t.device.type == "tt" and str(t.device) == "tt:0"
    assert t.shape == host.shape and t.dtype == torch.float32
    back = t.to("cpu")
    assert back.device.type == "cpu"
    assert torch.equal(back, host)
    text = repr(torch.tensor([[1.5, -2.0]]).to("tt"))
    assert "device='tt:0'" in text and "1.5000" in text and "-2.0000" in text


def test_module_to_tt_and_back(fresh):
    m = nn.Linear(3, 2)
    weight, bias = m.weight.detach().clone(), m.bias.detach().clone()
    m.to("tt")
    assert all(p.device.type == "tt" and isinstance(p, nn.Parameter) for p in m.parameters())
    m.to("cpu")
    assert torch.equal(m.weight.detach(), weight) and torch.equal(m.bias.detach(), bias)


def test_eager_elementwise_ops_match_cpu(fresh):
    a, b = torch.rand(4, 40) - 0.5, torch.rand(4, 40)
    ta, tb = a.to("tt"), b.to("tt")
    torch.testing.assert_close((ta + tb).to("cpu"), a + b)
    torch.testing.assert_close((ta - tb).to("cpu"), a - b)
    torch.testing.assert_close((ta * 2.5).to("cpu"), a * 2.5)
    torch.testing.assert_close(torch.relu(ta).to("cpu"), torch.relu(a))


def _loop(momentum: float = 0.0, weight_decay: float = 0.0, steps: int = 20, optimizer: str = "SGD"):
    torch.manual_seed(0)
    framework_model = MNISTLinear()
    reference = copy.deepcopy(framework_model)
    batches = [(torch.rand(32, 784), torch.rand(32, 10)) for _ in range(steps)]
    options = {"SGD": {"lr": 0.01, "momentum": momentum, "weight_decay": weight_decay},
               "Adam": {"lr": 1e-3, "weight_decay": weight_decay}, "AdamW": {"lr": 1e-3, "weight_decay": 0.01}}[optimizer]

    # The user's loop, with torch's own optimizer on the tt parameters.
    tt_model = torch.compile(framework_model, backend="tt")
    tt_model.to("tt")
    loss = torch.nn.L1Loss()
    tt_optimizer = getattr(torch.optim, optimizer)(tt_model.parameters(), **options)
    for x, y in batches:
        model_out = tt_model(x.to("tt"))
        assert model_out.device.type == "tt"
        loss_out = loss(model_out.to("cpu"), y)
        loss_out.backward()
        tt_optimizer.step()
        tt_optimizer.zero_grad()
    tt_model.to("cpu")

    cpu_optimizer = getattr(torch.optim, optimizer)(reference.parameters(), **options)
    for x, y in batches:
        torch.nn.L1Loss()(reference(x), y).backward()
        cpu_optimizer.step()
        cpu_optimizer.zero_grad()
    return framework_model, reference, batches


def test_training_loop_matches_cpu_sgd(fresh):
    trained, reference, batches = _loop()
    for (name, p), q in zip(trained.named_parameters(), reference.parameters()):
        assert p.device.type == "cpu"
        assert relative_error(p.detach(), q.detach()) < 1e-4, name
        assert not torch.equal(p.detach(), MNISTLinear().l1.weight.detach())  # it did train

    # Parameters pushed once; per step the batch and the output's gradient go in, the output
    # comes back; the trained parameters come back once at the end. Gradients, momentum and
    # the update never leave the device. The scalars SGD uses (lr, momentum, dampening) go in
    # once as small device vectors: under a kilobyte in all.
    ttt.synchronize()
    param_bytes = sum(p.numel() * 4 for p in reference.parameters())
    steps, x_bytes, out_bytes = len(batches), 32 * 784 * 4, 32 * 10 * 4
    stats = fresh.stats
    assert 0 <= stats.host_to_device_bytes - (param_bytes + steps * (x_bytes + out_bytes)) < 1024
    assert stats.device_to_host_bytes == steps * out_bytes + param_bytes
    assert stats.layout_conversions == 0


def test_momentum_and_weight_decay_match_cpu_sgd(fresh):
    trained, reference, _ = _loop(momentum=0.9, weight_decay=1e-3, steps=8)
    for (name, p), q in zip(trained.named_parameters(), reference.parameters()):
        assert relative_error(p.detach(), q.detach()) < 1e-4, name


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW"])
def test_stock_adam_and_adamw_match_cpu(fresh, optimizer):
    trained, reference, _ = _loop(steps=6, optimizer=optimizer)
    for (name, p), q in zip(trained.named_parameters(), reference.parameters()):
        assert relative_error(p.detach(), q.detach()) < 1e-4, name


def assert_gradients_match_cpu(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> None:
    """One MSE backward through the device and through CPU autograd: outputs and grads agree."""
    reference = copy.deepcopy(model)
    tt_model = ttt.compile(model).to("tt")
    out = tt_model(x.to("tt"))
    ((out.to("cpu") - target) ** 2).mean().backward()
    expected = reference(x)
    ((expected - target) ** 2).mean().backward()
    torch.testing.assert_close(out.to("cpu"), expected, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(tt_model.named_parameters(), reference.parameters()):
        assert p.grad is not None and p.grad.device.type == "tt", name
        assert relative_error(p.grad.to("cpu"), q.grad) < 1e-4, name


def test_three_chained_compiled_modules_train_like_cpu_with_input_gradients(fresh):
    torch.manual_seed(4)
    cpu = [nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 3)]
    on_tt = [copy.deepcopy(m).to("tt") for m in cpu]
    compiled = [torch.compile(m, backend="tt") for m in on_tt]
    cpu_opt = torch.optim.SGD([p for m in cpu for p in m.parameters()], lr=0.05, momentum=0.9)
    tt_opt = torch.optim.SGD([p for m in on_tt for p in m.parameters()], lr=0.05, momentum=0.9)
    for step in range(20):
        batch = 6 if step % 5 else 3  # a partial batch now and then: one more compile, same answers
        x, y = torch.randn(batch, 8), torch.randn(batch, 3)
        xc, xt = x.clone().requires_grad_(), x.to("tt").requires_grad_()
        ((cpu[2](cpu[1](cpu[0](xc))) - y) ** 2).mean().backward()
        ((compiled[2](compiled[1](compiled[0](xt))) - y.to("tt")) ** 2).mean().backward()
        torch.testing.assert_close(xt.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-6)
        cpu_opt.step(), tt_opt.step(), cpu_opt.zero_grad(), tt_opt.zero_grad()
    for m, n in zip(cpu, on_tt):
        for (name, p), q in zip(m.named_parameters(), n.parameters()):
            assert relative_error(q.detach().cpu(), p.detach()) < 1e-4, name


def test_every_derivative_matches_cpu_autograd(fresh):
    torch.manual_seed(1)
    assert_gradients_match_cpu(Mixed(), torch.randn(8, 48), torch.randn(8, 40))


def test_no_grad_and_train_eval_switching(fresh):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 4))
    x = torch.rand(4, 16)
    model.eval()
    expected = model(x)
    tt_model = ttt.compile(copy.deepcopy(model).to("tt"))
    with torch.no_grad():
        out = tt_model(x.to("tt"))
    assert out.grad_fn is None
    torch.testing.assert_close(out.to("cpu"), expected, rtol=1e-4, atol=1e-5)
    tt_model.train()  # dropout applies now: some of the 64 hidden values of a row are zeroed
    trained = tt_model(x.to("tt")).to("cpu")
    assert not torch.allclose(trained, expected)
    tt_model.eval()
    with torch.inference_mode():
        torch.testing.assert_close(tt_model(x.to("tt")).to("cpu"), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune", "default"])
def test_torch_compile_modes_are_accepted_and_options_refused_clearly(fresh, mode):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    torch._dynamo.reset()  # Linear's forward, compiled by other tests, would be reused
    out = torch.compile(copy.deepcopy(model).to("tt"), backend="tt", mode=mode)(x.to("tt"))
    torch.testing.assert_close(out.cpu(), model(x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown mode 'turbo'"):
        torch.compile(copy.deepcopy(model).to("tt"), backend="tt", mode="turbo")(x.to("tt"))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="takes no options"):
        torch.compile(copy.deepcopy(model).to("tt"), backend="tt", options={"triton.cudagraphs": True})(x.to("tt"))


def test_dynamic_shapes_with_batch_norm_train_like_cpu(fresh):
    """Under `dynamic=True` dynamo passes BatchNorm's momentum and eps as 0-d tensors read with
    `.item()`: they are fixed per compile, as dynamo fixes floats by default."""
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model = copy.deepcopy(cpu).to("tt")
    compiled = torch.compile(model, backend="tt", dynamic=True)
    opt_cpu = torch.optim.SGD(cpu.parameters(), lr=0.1, momentum=0.9)
    opt_tt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batch in (6, 7, 6, 5):
        x, y = torch.randn(batch, 8), torch.randint(0, 3, (batch,))
        nn.functional.cross_entropy(cpu(x), y).backward()
        nn.functional.cross_entropy(compiled(x.to("tt")), y.to("tt")).backward()
        for opt in (opt_cpu, opt_tt):
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.state_dict().items(), cpu.state_dict().values(), strict=True):
        torch.testing.assert_close(p.cpu(), q, atol=1e-6, rtol=1e-5, msg=name)


def test_compiled_module_with_cpu_parameters_runs_on_the_cpu():
    model = MNISTLinear()
    x = torch.rand(2, 784)
    torch.testing.assert_close(ttt.compile(model)(x), model(x))


def test_an_op_the_device_lacks_runs_on_the_cpu_naming_it(fresh):
    class UsesIgamma(nn.Module):  # igamma has no device lowering
        def forward(self, x):
            return torch.igamma(x + 1, x) * 2

    x = torch.rand(3, 5)
    with pytest.warns(UserWarning, match="igamma"):
        out = ttt.compile(UsesIgamma())(x.to("tt"))
    torch.testing.assert_close(out.to("cpu"), torch.igamma(x + 1, x) * 2)


def test_mixing_devices_is_an_error(fresh):
    second = ttt.open_device(tt.DeviceSpec.small())
    assert str(second) == "tt:1"
    with pytest.raises(RuntimeError, match="same device"):
        torch.rand(2, 8).to("tt") + torch.rand(2, 8)
    with pytest.raises(RuntimeError, match="same device"):
        torch.rand(2, 8).to("tt") + torch.rand(2, 8).to("tt:1")


def test_tensor_used_after_its_device_closed(fresh):
    t = torch.rand(2, 3).to("tt")
    ttt.close()
    with pytest.raises(tt.DeviceClosedError):
        t.to("cpu")
    fresh_t = torch.rand(2, 3).to("tt")  # a fresh device opens on demand
    with pytest.raises(tt.DeviceClosedError):
        fresh_t + t


def test_close_stops_the_event_loop_thread():
    ttt.close()
    before = {t.ident for t in threading.enumerate()}
    torch.rand(2, 2).to("tt").to("cpu")
    ttt.close()
    assert {t.ident for t in threading.enumerate()} == before


def test_missing_compiler_gives_a_clear_message(monkeypatch, tmp_path):
    from ttflow.torch import _guard

    monkeypatch.setattr(_guard, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler once"):
        _guard.build(tmp_path / "guard.so")
    assert not (tmp_path / "guard.so").exists()


def test_gradients_accumulate_over_two_backward_passes(fresh):
    torch.manual_seed(2)
    model = nn.Linear(16, 8)
    reference = copy.deepcopy(model)
    xs = [torch.rand(4, 16), torch.rand(4, 16)]
    tt_model = ttt.compile(model).to("tt")
    for x in xs:
        tt_model(x.to("tt")).to("cpu").sum().backward()
        reference(x).sum().backward()
    for p, q in zip(tt_model.parameters(), reference.parameters()):
        assert p.grad.device.type == "tt"
        assert relative_error(p.grad.to("cpu"), q.grad) < 1e-5


def test_mnist_like_example(fresh):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "torch_mnist_like.py"
    spec = importlib.util.spec_from_file_location("torch_mnist_like", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    r = module.main(steps=20, batch=32, verbose=False)
    assert r["last_loss"] < r["first_loss"]


def test_rank3_activations_train_through_a_reshape(fresh):
    # The bias gradient sums over two leading axes and drops one: the backward needs `reshape`.
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 5))
    assert_gradients_match_cpu(model, torch.randn(2, 3, 8), torch.randn(2, 3, 5))
