"""`torch.compile(model)` without `backend="tt"` on tt tensors: torch's default backend,
Inductor, has no code generator for the device. It fails with an error that names the tt
backend (it died in Inductor with `KeyError: 'tt'`), and the tt backend still compiles the same
model, whose results are compared with CPU torch's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cpu to test it")
ttt = pytest.importorskip("ttflow.torch")

from torch import nn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_inductor_on_tt_tensors_names_the_tt_backend(device: object, training: bool) -> None:
    torch._dynamo.reset()
    model = _model().to("tt")
    x = torch.randn(2, 4).to("tt").requires_grad_(training)
    with pytest.raises(Exception, match=r'backend="tt"') as caught:
        out = torch.compile(model)(x)
        if training:
            out.sum().backward()
    assert "KeyError" not in str(caught.value)
    assert "Inductor" in str(caught.value)
    torch._dynamo.reset()
    # The tt backend compiles the same model; the CPU gives the reference.
    cpu_model, x_cpu = _model(), x.detach().cpu()
    got = torch.compile(model, backend="tt")(x.detach())
    torch.testing.assert_close(got.cpu(), cpu_model(x_cpu), rtol=1e-5, atol=1e-5)


def test_inductor_still_compiles_cpu_tensors() -> None:
    torch._dynamo.reset()
    model, x = _model(), torch.randn(2, 4)
    torch.testing.assert_close(torch.compile(model)(x), model(x), rtol=1e-5, atol=1e-5)
