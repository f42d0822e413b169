"""`torch.multinomial` on tt: seeded samples equal CPU torch's (the same exponential draws, the
same argmax / top-k), on the device; its errors are the CPU's; sampling several with replacement
runs on the CPU, with the fallback's warning, and still gives the CPU's samples."""

from __future__ import annotations

import contextlib
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

from torch_support import only_on_device


@settings(deadline=None, max_examples=25)
@given(rows=st.sampled_from([(), (1,), (3,)]), categories=st.integers(1, 40), data=st.data(),
       seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_seeded_samples_equal_the_cpus(rows, categories, data, seed, dtype) -> None:
    replacement = data.draw(st.booleans(), "replacement")
    n = 1 if replacement else data.draw(st.integers(1, categories), "num_samples")
    logits = torch.randn(*rows, categories, generator=torch.Generator().manual_seed(seed))
    probs = torch.softmax(logits, -1).to(dtype)
    if data.draw(st.booleans(), "some zeros") and categories > n:
        probs[..., : categories - n] = 0  # zero probabilities are never drawn
    torch.manual_seed(seed)
    expected = torch.multinomial(probs, n, replacement)
    torch.manual_seed(seed)
    on_device = only_on_device() if n == 1 or dtype == torch.float32 else contextlib.nullcontext()
    with on_device:  # several from bfloat16 run on the CPU (top-k's order of ties)
        got = torch.multinomial(probs.to("tt"), n, replacement)
    assert got.device.type == "tt" and got.dtype == torch.int64
    assert torch.equal(got.cpu(), expected)


def test_a_tt_generator_draws_the_cpu_generators_samples() -> None:
    probs = torch.softmax(torch.randn(4, 30, generator=torch.Generator().manual_seed(1)), -1)
    cpu_gen = torch.Generator().manual_seed(11)
    tt_gen = torch.Generator(device="tt")
    tt_gen.manual_seed(11)
    with only_on_device():
        for _ in range(3):  # the generator advances alike
            got = torch.multinomial(probs.to("tt"), 2, generator=tt_gen)
            assert torch.equal(got.cpu(), torch.multinomial(probs, 2, generator=cpu_gen))


@pytest.mark.parametrize(("probs", "n", "message"), [
    ([0.5, float("nan")], 1, "inf`, `nan` or element < 0"),
    ([0.5, float("inf")], 1, "inf`, `nan` or element < 0"),
    ([0.5, -0.1], 1, "inf`, `nan` or element < 0"),
    ([[0.5, 0.5], [0.0, 0.0]], 1, "sum of probabilities"),
    ([0.5, 0.5], 3, "without replacement"),
    ([0.5, 0.5], 0, "n_sample <= 0"),
])
def test_bad_distributions_raise_as_on_the_cpu(probs, n, message) -> None:
    with pytest.raises(RuntimeError, match="."):
        torch.multinomial(torch.tensor(probs), n)  # the CPU raises too
    with pytest.raises(RuntimeError, match=message):
        torch.multinomial(torch.tensor(probs).to("tt"), n)


def test_several_samples_with_replacement_run_on_the_cpu_with_a_warning() -> None:
    from ttflow.torch import _fallback

    _fallback.warned.clear()
    probs = torch.softmax(torch.randn(2, 10, generator=torch.Generator().manual_seed(2)), -1)
    torch.manual_seed(4)
    expected = torch.multinomial(probs, 5, True)
    torch.manual_seed(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.multinomial(probs.to("tt"), 5, True)
    assert torch.equal(got.cpu(), expected)
    assert any("aten.multinomial" in str(w.message) and "ran on the CPU" in str(w.message) for w in caught)
