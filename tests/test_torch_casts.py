"""Casts and tensors made from data, as transformers' models make them, against CPU torch.

- `torch.tensor(data, device="tt")` under a fake mode (dynamo's, tracing a cache layer) makes a
  fake tt tensor, as it does for CUDA; it had hit an internal assert in torch's dispatcher.
- A cast between tt tensors runs on the device (it had gone to the CPU without a warning).
- A float-to-integer cast saturates, as silicon's typecast does, where CPU torch's x86
  conversion gives the integer-indefinite value; a finite float past INT32 cast to int64 is an
  error naming the op, never a wrong value.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

from torch_support import only_on_device

import ttflow as tt

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@pytest.fixture
def fresh():
    ttt.close()
    ttt.open_device()
    with only_on_device():
        yield ttt.device()
    ttt.close()


@pytest.mark.parametrize("make", [
    lambda: torch.tensor([1.0, 2.0], device="tt"),
    lambda: torch.tensor(3, device="tt"),
    lambda: torch.as_tensor([True, False], device="tt"),
    lambda: torch.tensor([[1, 2]], dtype=torch.long, device="tt"),
], ids=["float", "scalar int", "bool", "int64 matrix"])
def test_a_tensor_from_data_under_a_fake_mode_is_a_fake_tt_tensor(fresh, make) -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    real = make()
    with FakeTensorMode():
        fake = make()
    assert isinstance(fake, FakeTensor) and fake.device == real.device
    assert fake.shape == real.shape and fake.dtype == real.dtype


def test_a_compiled_function_may_make_tensors_from_data(fresh) -> None:
    def f(x):
        return x + torch.tensor([1.0, 2.0, 3.0], device=x.device)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="tt")
    x = torch.arange(6.0).reshape(2, 3)
    torch.testing.assert_close(compiled(x.to("tt")).cpu(), f(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bfloat16, torch.bool])
def test_a_cast_between_tt_tensors_runs_on_the_device(fresh, dtype) -> None:
    x = torch.tensor([[1.7, -2.5, 0.0, 3.0]])
    dst = torch.empty(1, 4, dtype=dtype, device="tt")
    dst.copy_(x.to("tt"))  # the CPU fallback would warn, and the fixture turns that into an error
    assert torch.equal(dst.cpu(), x.to(dtype))


FLOATS = torch.tensor([1.7, -2.5, -0.9, 2.0**31 - 128, -(2.0**31)])
EDGES = torch.tensor([-math.inf, math.inf, math.nan])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_float_to_integer_casts_agree_in_range_and_saturate_outside(fresh, dtype) -> None:
    assert torch.equal(FLOATS.to("tt").to(dtype).cpu(), FLOATS.to(dtype))
    # Silicon's typecast: the ends of INT32 for the infinities, 0 for NaN.
    assert EDGES.to("tt").to(dtype).cpu().tolist() == [INT32_MIN, INT32_MAX, 0]


def test_compiled_float_to_integer_casts_saturate_too(fresh) -> None:
    def buckets(x):  # T5's relative-position buckets: log(0) = -inf, cast, then discarded
        large = torch.log(x).to(torch.long)
        return torch.where(x > 0, large, torch.zeros_like(large))

    torch._dynamo.reset()
    compiled = torch.compile(buckets, backend="tt")
    x = torch.tensor([[0.0, 1.0, 10.0, 1000.0]])
    assert torch.equal(compiled(x.to("tt")).cpu(), buckets(x))
    assert torch.equal(compiled(EDGES.reshape(1, 3).exp().log().to("tt")).cpu(),
                       torch.tensor([[0, INT32_MAX, 0]]))


def test_a_finite_float_past_int32_cast_to_int64_is_an_error(fresh) -> None:
    with pytest.raises(tt.ProgramError, match=r"casts a float to int64.*10000000000"):
        torch.tensor([1e10]).to("tt").long().cpu()
