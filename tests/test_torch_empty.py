"""Zero-element tensors on tt, against CPU torch: made, sliced to, concatenated onto, reduced
over, in eager ops and in compiled graphs (transformers' DynamicCache starts from one)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

from torch_support import only_on_device


@pytest.fixture
def fresh():
    ttt.close()
    ttt.open_device()
    with only_on_device():
        yield ttt.device()
    ttt.close()


def same(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Shape, dtype and every bit (NaN's sign included) as CPU torch."""
    assert got.device.type == "tt"
    got = got.cpu()
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got, expected)
    if expected.dtype.is_floating_point:
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (got, expected)
    else:
        assert torch.equal(got, expected), (got, expected)


X = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) / 7

CASES = {
    "a cat onto a 1-d empty tensor (DynamicCache's first step)": lambda x, to: torch.cat([to(torch.tensor([])), x], dim=-2),
    "a cat with an empty slice": lambda x, to: torch.cat([x[:, :0], x, x[:, 3:]], dim=1),
    "a slice to nothing": lambda x, to: x[:, 3:],
    "an op on an empty tensor": lambda x, to: x[:0] * 2 + 1,
    "zeros of no rows": lambda x, to: to(torch.zeros(0, 4)) + 1,
    "a stack of empties": lambda x, to: torch.stack([x[:0], x[:0]]),
    "sum over nothing": lambda x, to: x[:, :0].sum(dim=1),
    "sum of an empty tensor": lambda x, to: x[:0].sum(),
    "mean over nothing": lambda x, to: x[:, :0].mean(dim=1),
    "any over nothing": lambda x, to: (x[:, :0] > 0).any(dim=1),
    "all over nothing": lambda x, to: (x[:, :0] > 0).all(dim=1),
    "a matmul over an empty inner dimension": lambda x, to: x[0, :, :0] @ x[0, :0, :],
    "a batched matmul over an empty inner dimension": lambda x, to: x[:, :, :0] @ x[:, :0, :],
    "an amax that keeps an empty axis": lambda x, to: x[:, :, :0].amax(dim=1),
    "an int64 empty tensor": lambda x, to: to(torch.tensor([], dtype=torch.long)) + 3,
    "an empty identity": lambda x, to: torch.eye(0, 3, device=x.device),
    "not of nothing": lambda x, to: (x[:0] > 0).logical_not(),
    "a tile of nothing": lambda x, to: x[:, :0].tile(2, 1, 1),
    "a pad of nothing": lambda x, to: torch.nn.functional.pad(x[:0], (1, 1)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_eager_ops_on_empty_tensors_match_cpu(fresh, name: str) -> None:
    fn = CASES[name]
    expected = fn(X, lambda a: a)
    same(fn(X.to("tt"), lambda a: a.to("tt")), expected)


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_graphs_with_empty_tensors_match_cpu(fresh, name: str) -> None:
    fn = CASES[name]
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: fn(x, lambda a: a.to(x.device)), backend="tt")
    same(compiled(X.to("tt")), fn(X, lambda a: a))


def test_an_empty_input_of_a_compiled_graph_is_no_program_input(fresh) -> None:
    from ttflow.torch import _lower

    def step(cache, new):  # a cache layer: the first call's cache is empty
        cache = torch.cat([cache, new], dim=-2)
        return cache, cache.sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="tt")
    cache_cpu, cache_tt = torch.tensor([]), torch.tensor([]).to("tt")
    for i in range(3):
        new = torch.full((1, 2, 1, 4), float(i))
        cache_cpu, total_cpu = step(cache_cpu, new)
        cache_tt, total_tt = compiled(cache_tt, new.to("tt"))
        same(cache_tt, cache_cpu)
        same(total_tt, total_cpu)
    from torch.fx.experimental.proxy_tensor import make_fx

    examples = [torch.empty(0), torch.empty(1, 2, 1, 4)]
    lowered = _lower.lower(make_fx(step)(*examples), examples, "step")
    assert [spec.empty for spec in lowered.inputs] == [True, False]
    assert len(lowered.binary.programs[0].inputs) == 1


def test_nan_constants_keep_torch_bits(fresh) -> None:
    """float("nan") is the positive quiet NaN, a mean over nothing x86's 0/0 (sign set)."""
    x = torch.ones(2, 3)
    same(torch.full_like(x.to("tt"), math.nan), torch.full_like(x, math.nan))
    same(x.to("tt")[:, :0].mean(1), x[:, :0].mean(1))
