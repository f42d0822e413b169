"""Values that need care: max-pool indices, which the device computes as CPU torch does where
anything reads them (the user, max_unpool) and leaves a stand-in where only the device's
backward would (it reads the pooled input); and, made on the CPU with a warning, never wrongly:
views that reinterpret bytes (`view_as_complex`), conjugated and negated views (a flag
on the tensor, no copy), and complex results such as the FFT's (kept on the host)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.usefixtures("device")  # a fresh device for the module (conftest.py)


@pytest.fixture(autouse=True)
def quiet():
    from ttflow.torch import _fallback

    _fallback.warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


X = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0))


def _on_device_only(caught) -> None:
    assert not [w for w in caught if "CPU" in str(w.message) or "eagerly" in str(w.message)]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_max_pool_indices_returned_to_the_caller_equal_cpu(compiled, quiet) -> None:
    def pool(x):
        return F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True)

    torch._dynamo.reset()
    run = torch.compile(pool, backend="tt") if compiled else pool
    values, indices = run(X.to("tt"))
    expected_values, expected_indices = pool(X)
    assert torch.equal(values.cpu(), expected_values)
    assert torch.equal(indices.cpu(), expected_indices)
    _on_device_only(quiet)


@settings(deadline=None, max_examples=30)
@given(data=st.data(), kh=st.integers(1, 3), kw=st.integers(1, 3), ceil_mode=st.booleans(),
       special=st.sampled_from(["none", "nan", "-inf", "ties"]))
def test_max_pool_indices_are_cpu_torchs_for_any_window(data, kh, kw, ceil_mode, special) -> None:
    """Ties take the first maximum, a NaN the last NaN, an all -inf window its first in-bounds
    tap, as CPU torch's loop does; max_unpool2d then reads them on the device too."""
    sh, sw = data.draw(st.integers(1, 3), "sh"), data.draw(st.integers(1, 3), "sw")
    ph, pw = data.draw(st.integers(0, kh // 2), "ph"), data.draw(st.integers(0, kw // 2), "pw")
    h, w = data.draw(st.integers(kh, 9), "h"), data.draw(st.integers(kw, 9), "w")
    x = torch.randn(2, 2, h, w, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99), "seed")))
    if special == "ties":
        x = x.round()
    elif special != "none":
        mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < 0.4
        x[mask] = float(special)
    args = ((kh, kw), (sh, sw), (ph, pw))
    values, indices = F.max_pool2d(x, *args, ceil_mode=ceil_mode, return_indices=True)
    from ttflow.torch import _fallback

    _fallback.warned.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran on the CPU")
        got_values, got_indices = F.max_pool2d(x.to("tt"), *args, ceil_mode=ceil_mode, return_indices=True)
        assert torch.equal(got_indices.cpu(), indices)
        torch.testing.assert_close(got_values.cpu(), values, equal_nan=True, rtol=0, atol=0)
        if special != "nan":  # unpooling NaNs: CPU torch's scatter order decides which lands
            unpooled = F.max_unpool2d(got_values, got_indices, *args, output_size=(h, w))
            expected = F.max_unpool2d(values, indices, *args, output_size=(h, w))
            torch.testing.assert_close(unpooled.cpu(), expected, rtol=0, atol=0)


def test_compiled_unpooling_reads_real_indices(quiet) -> None:
    """Indices consumed inside the graph (max_unpool) are computed, not a stand-in."""
    torch._dynamo.reset()

    def round_trip(x):
        values, indices = F.max_pool2d(x, 2, return_indices=True)
        return F.max_unpool2d(values, indices, 2)

    got = torch.compile(round_trip, backend="tt")(X.to("tt"))
    assert torch.equal(got.cpu(), round_trip(X))
    _on_device_only(quiet)


def test_training_through_max_pool_stays_on_the_device(quiet) -> None:
    """Inside a compiled step the indices only reach the backward: no fallback there."""
    torch._dynamo.reset()
    step = torch.compile(lambda x: F.max_pool2d(x, 2).square().sum(), backend="tt")
    x_tt, x_cpu = X.to("tt").requires_grad_(), X.clone().requires_grad_()
    step(x_tt).backward()
    F.max_pool2d(x_cpu, 2).square().sum().backward()
    assert torch.equal(x_tt.grad.cpu(), x_cpu.grad)
    _on_device_only(quiet)


def test_a_view_that_reinterprets_bytes_equals_cpu() -> None:
    y = torch.randn(3, 2, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.view_as_complex(y.to("tt")).cpu(), torch.view_as_complex(y))


@pytest.mark.parametrize("fft", ["fft", "ifft", "rfft", "irfft", "hfft", "ihfft"])
def test_ffts_equal_cpu(fft) -> None:
    x = torch.randn(8, generator=torch.Generator().manual_seed(2))
    fn = getattr(torch.fft, fft)
    torch.testing.assert_close(fn(x.to("tt")).cpu(), fn(x))


def test_conjugated_and_negated_views_read_as_their_values() -> None:
    c = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    t = c.to("tt")
    assert t.conj().is_conj()
    assert torch.equal(t.conj().cpu(), c.conj())
    assert torch.equal(t.conj().imag.cpu(), c.conj().imag)
    assert torch.equal((t.conj() * 2).cpu(), c.conj() * 2)
    assert torch.equal(torch._neg_view(t).cpu(), -c)
