"""Advanced indexing on tt against CPU torch: integer index tensors on any dims (broadcast
together, adjacent or not, negative), their gradients (index_put with accumulate), `x[mask] =
value` with a tt or a CPU mask, and an index out of range as an error, never a clamped value."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

from torch_support import only_on_device

import ttflow as tt


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


@st.composite
def indexings(draw):
    """A tensor and an index: a tensor per indexed dim (None for `:`), broadcastable together."""
    rank = draw(st.integers(1, 4))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    dims = draw(st.lists(st.booleans(), min_size=rank, max_size=rank).filter(any))
    common = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    indices = []
    for d, indexed in enumerate(dims):
        if not indexed:
            indices.append(None)
            continue
        # Each index's shape broadcasts to `common`: a suffix of it, with some dims 1.
        suffix = common[len(common) - draw(st.integers(0, len(common))):]
        own = tuple(1 if draw(st.booleans()) else n for n in suffix)
        values = draw(st.lists(st.integers(-shape[d], shape[d] - 1), min_size=max(1, _prod(own)),
                               max_size=max(1, _prod(own))))
        indices.append(torch.tensor(values, dtype=torch.long).reshape(own))
    while indices and indices[-1] is None:  # x[i, :] is x[i]
        indices.pop()
    return torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))), indices


def _prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _on_tt(indices):
    return [slice(None) if i is None else i.to("tt") for i in indices]


def _key(indices):
    """As Python indexing spells it: `:` where a dim is not indexed (None would add a dim)."""
    return tuple(slice(None) if i is None else i for i in indices)


@settings(max_examples=40, deadline=None)
@given(case=indexings())
def test_indexing_and_its_gradient_match_cpu(device, case) -> None:
    with only_on_device():
        _check_indexing(*case)


def _check_indexing(x, indices) -> None:
    expected = x[_key(indices)]
    assert torch.equal(x.to("tt")[tuple(_on_tt(indices))].cpu(), expected)
    # The gradient: index_put(zeros, indices, grad, accumulate=True), duplicates summed.
    weights = torch.arange(expected.numel(), dtype=torch.float32).reshape(expected.shape)
    a = x.clone().requires_grad_()
    (a[_key(indices)] * weights).sum().backward()
    b = x.to("tt").requires_grad_()
    (b[tuple(_on_tt(indices))] * weights.to("tt")).sum().backward()
    assert torch.equal(b.grad.cpu(), a.grad)


@pytest.mark.parametrize("pattern", ["x[:, i, j]", "x[i, :, j]", "x[..., j]"])
def test_compiled_indexing_matches_cpu(on_device_only, pattern) -> None:
    i, j = torch.tensor([1, 0, -1]), torch.tensor([[2], [3]])
    fn = {"x[:, i, j]": lambda x, i, j: x[:, i, j], "x[i, :, j]": lambda x, i, j: x[i, :, j],
          "x[..., j]": lambda x, i, j: x[..., j]}[pattern]
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tt")
    assert torch.equal(compiled(x.to("tt"), i.to("tt"), j.to("tt")).cpu(), fn(x, i, j))


@pytest.mark.parametrize("mask_on", ["tt", "cpu"])
def test_a_masked_assignment_matches_cpu(on_device_only, mask_on) -> None:
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1))
    for mask in (x > 0.3, x[:, :, 0] < 0):
        expected = x.clone()
        expected[mask] = -7.0
        got = x.to("tt")
        got[mask.to("tt") if mask_on == "tt" else mask] = -7.0
        assert torch.equal(got.cpu(), expected)


def test_an_index_out_of_range_is_an_error_naming_the_op(device) -> None:
    x = torch.zeros(2, 3, 4).to("tt")
    with pytest.raises(tt.ProgramError, match=r"aten.index.Tensor indexes.*index 3 is out of range"):
        x[:, torch.tensor([0, 3]).to("tt")].cpu()
    # A part out of range whose flat row would still be in range is caught too.
    with pytest.raises(tt.ProgramError, match="out of range"):
        x[torch.tensor([0]).to("tt"), torch.tensor([5]).to("tt")].cpu()
