"""The PyTorch examples: trained on tt and on CPU torch from the same weights over the same
batches, the two loss curves agree step by step, the models learn, and nothing leaves the device.

Tolerance of the per-step loss curves (float32, no dropout): measured, the tt and CPU losses
differ by at most ~3e-7 of the loss (1 to 3 float32 ulps) over the first 40 steps of either
example. CPU torch against itself, with every initial weight moved by one ulp, differs by as
much (<= 9e-7 over the first 47 steps of the CNN), and later grows to 1e-3 and beyond as a
ReLU or an Adam denominator near zero tips one way or the other (the CNN jumps at step 48,
the transformer at step 55, on tt and in that CPU-against-CPU run alike). So the tests run
fewer steps than that (30) and allow 1e-5: ten times the rounding spread, while a learning
rate 0.1% off on tt only already shows as 3e-5 to 5e-5 at step 1 (1% off: 3e-4 to 5e-4), and
fails.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from types import ModuleType

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

from ttflow.torch import _fallback

RELATIVE_TOLERANCE = 1e-5


@pytest.fixture
def fresh():
    """A newly opened default device; everything closed afterwards. CPU torch on one thread:
    on a small shared machine its second thread mostly spins, and the CPU run is 30x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ttt.close()
    ttt.open_device()
    yield ttt.device()
    ttt.close()
    torch.set_num_threads(threads)


def load(name: str) -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_on_the_device_only(module: ModuleType, **options) -> dict:
    """`module.main(**options)`, failing if any op ran on the CPU or any graph ran op by op."""
    _fallback.warned.clear()  # the front-end warns once per op per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = module.main(verbose=False, **options)
    left = [str(w.message) for w in caught
            if "ran on the CPU" in str(w.message) or "runs eagerly" in str(w.message)]
    assert not left, left
    return result


def assert_curves_match(result: dict) -> None:
    tt_losses, cpu_losses = result["tt_losses"], result["cpu_losses"]
    assert len(tt_losses) == len(cpu_losses)
    for step, (a, b) in enumerate(zip(tt_losses, cpu_losses)):
        difference = abs(a - b) / abs(b)
        assert difference <= RELATIVE_TOLERANCE, (
            f"step {step}: tt loss {a!r}, CPU loss {b!r}, relative difference {difference:.1e} "
            f"(allowed {RELATIVE_TOLERANCE:.0e})")


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_cnn_digits_example_trains_on_tt_like_cpu(fresh):
    # 30 steps of batches of 32 from 300 images: three epochs, each ending with a batch of 12.
    result = run_on_the_device_only(load("torch_cnn_digits"), steps=30)
    assert_curves_match(result)
    losses = result["tt_losses"]
    assert mean(losses[-5:]) < mean(losses[:5]) - 0.1  # measured: 2.37 -> 2.11
    # Ten classes, chance is 0.1; measured 0.36 after 30 steps (0.865 after the default 100).
    assert result["tt_accuracy"] >= 0.2
    assert abs(result["tt_accuracy"] - result["cpu_accuracy"]) <= 0.02


def test_tiny_transformer_example_trains_on_tt_like_cpu(fresh):
    result = run_on_the_device_only(load("torch_tiny_transformer"), steps=30)
    assert_curves_match(result)
    losses = result["tt_losses"]
    assert mean(losses[-5:]) < mean(losses[:5]) - 0.5
    # Sixteen tokens, chance is 1/16.
    assert result["tt_accuracy"] >= 0.5
    assert abs(result["tt_accuracy"] - result["cpu_accuracy"]) <= 0.02
