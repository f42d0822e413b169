"""The PyTorch front-end, checked against the same computation done by CPU torch."""

from __future__ import annotations

import copy
import threading

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 (CPU wheel) to test it"
)
ttt = pytest.importorskip("ttflow.torch")

import ttflow as tt  # noqa: E402
from torch import nn  # noqa: E402


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


def _loop(momentum: float = 0.0, weight_decay: float = 0.0, steps: int = 20):
    torch.manual_seed(0)
    framework_model = MNISTLinear()
    reference = copy.deepcopy(framework_model)
    batches = [(torch.rand(32, 784), torch.rand(32, 10)) for _ in range(steps)]

    # The user's loop, as written in the issue.
    tt_model = ttt.compile(framework_model)
    tt_model.to("tt")
    loss = torch.nn.L1Loss()
    optimizer = ttt.optim.SGD(tt_model.parameters(), lr=0.01, momentum=momentum, weight_decay=weight_decay)
    for x, y in batches:
        model_out = tt_model(x.to("tt"))
        assert model_out.device.type == "tt"
        loss_out = loss(model_out.to("cpu"), y)
        loss_out.backward()
        optimizer.step()
        optimizer.zero_grad()
    tt_model.to("cpu")

    cpu_optimizer = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=momentum, weight_decay=weight_decay)
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

    # Parameters pushed once; per step only the batch and the output's gradient go in, and
    # only the output comes back; the trained parameters come back once at the end.
    param_bytes = sum(p.numel() * 4 for p in reference.parameters())
    steps, x_bytes, out_bytes = len(batches), 32 * 784 * 4, 32 * 10 * 4
    stats = fresh.stats
    assert stats.host_to_device_bytes == param_bytes + steps * (x_bytes + out_bytes)
    assert stats.device_to_host_bytes == steps * out_bytes + param_bytes
    assert stats.programs_run == 3 * steps  # forward, backward, SGD step
    assert stats.layout_conversions == 0


def test_momentum_and_weight_decay_match_cpu_sgd(fresh):
    trained, reference, _ = _loop(momentum=0.9, weight_decay=1e-3, steps=8)
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


def test_every_derivative_matches_cpu_autograd(fresh):
    torch.manual_seed(1)
    assert_gradients_match_cpu(Mixed(), torch.randn(8, 48), torch.randn(8, 40))


def test_no_grad_runs_the_inference_program(fresh):
    model = MNISTLinear()
    x = torch.rand(4, 784)
    expected = model(x)
    tt_model = ttt.compile(model).to("tt")
    with torch.no_grad():
        out = tt_model(x.to("tt"))
    assert out.grad_fn is None
    torch.testing.assert_close(out.to("cpu"), expected, rtol=1e-4, atol=1e-5)
    assert fresh.stats.programs_run == 1


def test_compiled_module_with_cpu_parameters_runs_on_the_cpu():
    model = MNISTLinear()
    x = torch.rand(2, 784)
    torch.testing.assert_close(ttt.compile(model)(x), model(x))


def test_unsupported_module_fails_at_compile_time_naming_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with pytest.raises(ttt.UnsupportedOpError, match="Tanh"):
        ttt.compile(model)

    class UsesSin(nn.Module):
        def forward(self, x):
            return torch.sin(x)

    with pytest.raises(tt.ProgramError, match="sin"):
        ttt.compile(UsesSin())


def test_unsupported_eager_op_names_the_op(fresh):
    t = torch.rand(2, 3).to("tt")
    with pytest.raises(NotImplementedError, match=r"aten\.sin"):
        torch.sin(t)


def test_shape_the_program_was_not_built_for(fresh):
    tt_model = ttt.compile(MNISTLinear()).to("tt")
    tt_model(torch.rand(8, 784).to("tt"))
    with pytest.raises(tt.ShapeError, match=r"compiled for input shapes \[\(8, 784\)\], got \[\(4, 784\)\]"):
        tt_model(torch.rand(4, 784).to("tt"))


def test_mixing_devices_is_an_error(fresh):
    second = ttt.open_device(tt.DeviceSpec.small())
    assert str(second) == "tt:1"
    tt_model = ttt.compile(nn.Linear(8, 4)).to("tt")
    with pytest.raises(RuntimeError, match="tt:0, tt:1"):
        tt_model(torch.rand(2, 8).to(second))
    with pytest.raises(RuntimeError, match="cpu, tt:0"):
        tt_model(torch.rand(2, 8))
    with pytest.raises(RuntimeError, match="tt:0, tt:1"):
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


def test_mnist_like_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "torch_mnist_like.py"
    spec = importlib.util.spec_from_file_location("torch_mnist_like", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    r = module.main(steps=20, batch=32, verbose=False)
    assert r["last_loss"] < r["first_loss"]
    assert r["programs"] == 3 * 20
    assert r["d2h"] == 20 * 32 * 10 * 4 + r["param_bytes"]  # outputs, then the parameters once


def test_rank3_activations_train_through_a_reshape(fresh):
    # The bias gradient sums over two leading axes and drops one: the backward needs `reshape`.
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 5))
    assert_gradients_match_cpu(model, torch.randn(2, 3, 8), torch.randn(2, 3, 5))
