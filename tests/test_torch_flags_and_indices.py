"""Values the device cannot make exactly are made on the CPU, with a warning, never wrongly:
max-pool indices returned to the caller (the device's backward needs none, its forward makes a
stand-in), views that reinterpret bytes (`view_as_complex`), conjugated and negated views (a flag
on the tensor, no copy), and complex results such as the FFT's (kept on the host)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

import torch.nn.functional as F


@pytest.fixture(scope="module", autouse=True)
def device():
    ttt.close()
    ttt.open_device()
    yield ttt.device()
    ttt.close()


@pytest.fixture(autouse=True)
def quiet():
    from ttflow.torch import _fallback

    _fallback.warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


X = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0))


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
    assert any("max-pool indices" in str(w.message) for w in quiet)  # said, not silent


def test_training_through_max_pool_stays_on_the_device(quiet) -> None:
    """Inside a compiled step the indices only reach the backward: no fallback there."""
    torch._dynamo.reset()
    step = torch.compile(lambda x: F.max_pool2d(x, 2).square().sum(), backend="tt")
    x_tt, x_cpu = X.to("tt").requires_grad_(), X.clone().requires_grad_()
    step(x_tt).backward()
    F.max_pool2d(x_cpu, 2).square().sum().backward()
    assert torch.equal(x_tt.grad.cpu(), x_cpu.grad)
    assert not [w for w in quiet if "CPU" in str(w.message) or "eagerly" in str(w.message)]


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
