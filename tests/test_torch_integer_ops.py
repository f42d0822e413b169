"""Integer bit logic, shifts and products on tt against CPU torch, eager and compiled: the ops
transformers' generate() (`unfinished & ~stopped`) and everyday masks use."""

from __future__ import annotations

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

from torch_support import only_on_device


@pytest.fixture(scope="module")
def device():
    ttt.close()
    ttt.open_device()
    yield ttt.device()
    ttt.close()


@pytest.fixture
def on_device_only(device):
    with only_on_device():
        yield


A = torch.tensor([[5, -3, 12, 7, 0, -2**31 + 9]])
B = torch.tensor([[3, 6, 10, -1, 31, 4]])

OPS = {
    "and": lambda x, y: x & y,
    "or": lambda x, y: x | y,
    "xor": lambda x, y: x ^ y,
    "and a number": lambda x, y: x & 6,
    "not, and": lambda x, y: x & ~y,
    "shift left by a number": lambda x, y: (x % 1000) << 3,
    "shift right": lambda x, y: x >> (y.abs() % 8),
    "a number shifted": lambda x, y: 1 << (y.abs() % 8),
    "product over a dim": lambda x, y: (y % 5 + 1).prod(1),
    "product of all": lambda x, y: (y % 3 + 1).prod(),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("name", list(OPS))
def test_integer_ops_match_cpu(on_device_only, name, dtype, compiled) -> None:
    fn = OPS[name]
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend="tt")
    got = fn(A.to(dtype).to("tt"), B.to(dtype).to("tt"))
    expected = OPS[name](A.to(dtype), B.to(dtype))
    assert got.dtype == expected.dtype and torch.equal(got.cpu(), expected)


def test_a_float_product_is_within_a_few_ulps(on_device_only) -> None:
    x = torch.rand(3, 40, generator=torch.Generator().manual_seed(0)) + 0.5
    torch.testing.assert_close(x.to("tt").prod(1).cpu(), x.prod(1), rtol=40 * 2**-24, atol=0)
    y = x[:, :20]  # under 32 along the dim: torch multiplies in order, as the device does
    assert torch.equal(y.to("tt").prod(1).cpu(), y.prod(1))
