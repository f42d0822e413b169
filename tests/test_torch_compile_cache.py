"""The compile cache: a graph equal to one lowered before (the same ops and literal arguments,
input shapes, strides and dtypes, and constant tensor values) reuses its program, so the second
model of an architecture is not lowered again; anything that changes the program lowers anew.
Every result is compared with the CPU model it was copied from."""

from __future__ import annotations

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

from ttflow.torch import _compile


class Scaled(torch.nn.Module):
    """A linear layer times a constant made inside forward (a get_attr constant of the graph)."""

    def __init__(self, scale: list[float], width: int = 8) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, 4)
        self.scale = scale

    def forward(self, x):
        return torch.relu(self.linear(x)) * torch.tensor(self.scale, device=x.device)


def _compiled_run(cpu: torch.nn.Module, x: torch.Tensor, train: bool = False) -> int:
    """Compiles a tt copy of `cpu`, checks its output (and gradients) against the CPU's, and
    returns how many graphs it lowered. dynamo starts afresh each time (as in a new process),
    so each model's graphs are traced alike: a recompile would unspecialize the constant."""
    torch._dynamo.reset()
    tt_model = Scaled(cpu.scale, cpu.linear.in_features).to("tt")
    tt_model.load_state_dict(cpu.state_dict())
    before = _compile.lowerings
    compiled = torch.compile(tt_model, backend="tt")
    got = compiled(x.to("tt"))
    torch.testing.assert_close(got.cpu(), cpu(x).detach(), rtol=1e-5, atol=1e-6)
    if train:
        got.sum().backward()
        cpu(x).sum().backward()
        torch.testing.assert_close(tt_model.linear.weight.grad.cpu(), cpu.linear.weight.grad, rtol=1e-5, atol=1e-6)
    return _compile.lowerings - before


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_the_second_model_of_an_architecture_is_not_lowered_again(train) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    scale = [1.0, 2.0, 3.0, 4.0] if train else [1.0, -2.0, 3.0, 0.5]
    first = _compiled_run(Scaled(scale), x, train)
    assert first >= 1  # the forward (and the backward)
    assert _compiled_run(Scaled(scale), x, train) == 0  # new weights, the same program


def test_a_change_to_the_program_lowers_again() -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 8)
    _compiled_run(Scaled([1.0, 1.0, 1.0, 1.0]), x)
    assert _compiled_run(Scaled([5.0, 6.0, 7.0, 8.0]), x) == 1  # another constant
    assert _compiled_run(Scaled([1.0, 1.0, 1.0, 1.0], width=16), torch.randn(3, 16)) == 1  # shapes
    assert _compiled_run(Scaled([1.0, 1.0, 1.0, 1.0]), torch.randn(5, 8)) == 1  # input shape
