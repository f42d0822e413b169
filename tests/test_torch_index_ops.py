"""Indexing, scatter, sorting and the reductions built on them on tt against CPU torch, eager and
compiled, forward and backward, under the on-device guard (a CPU fallback fails the test)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

import torch.nn.functional as F
from torch_support import assert_matches_cpu as _close
from torch_support import only_on_device


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return [value]


def check(fn: Callable[..., Any], *inputs: Any, compiled: bool = False, grad: bool = True) -> None:
    """`fn` of `inputs` on tt (eager, or compiled with backend="tt") equals `fn` on the CPU (each
    output, if a tuple), and so do the gradients of its float inputs through its float outputs
    (one fixed random upstream gradient each)."""
    run = fn
    if compiled:
        torch._dynamo.reset()
        run = torch.compile(fn, backend="tt", dynamic=False)
    floats = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.dtype.is_floating_point]
    grad = grad and bool(floats)
    cpu = [x.clone().requires_grad_(grad and i in floats) if isinstance(x, torch.Tensor) else x
           for i, x in enumerate(inputs)]
    tt_in = [x.detach().to("tt").requires_grad_(grad and i in floats) if isinstance(x, torch.Tensor) else x
             for i, x in enumerate(inputs)]
    expected, got = _flat(fn(*cpu)), _flat(run(*tt_in))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        _close(g, e.detach())
    if grad:
        pairs = [(e, g) for e, g in zip(expected, got) if e.dtype.is_floating_point and e.requires_grad]
        if not pairs:
            return
        ups = [torch.randn(e.shape, generator=torch.Generator().manual_seed(7 + k)) for k, (e, _) in enumerate(pairs)]
        want = torch.autograd.grad([e for e, _ in pairs], [cpu[i] for i in floats], ups, allow_unused=True)
        have = torch.autograd.grad([g for _, g in pairs], [tt_in[i] for i in floats], [u.to("tt") for u in ups],
                                   allow_unused=True)
        for h, w in zip(have, want):
            if w is None:
                continue
            _close(h, w)


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32, low: int = -9, high: int = 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(low, high, shape, generator=g, dtype=dtype)


def index(high: int, *shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


MODES = pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int32, torch.bool],
                                 ids=["f32", "i64", "i32", "bool"])
REDUCES = ["sum", "prod", "mean", "amax", "amin"]


# -- scatter ------------------------------------------------------------------------------------------


@MODES
@DTYPES
def test_scatter_with_an_index_smaller_than_the_input(on_device_only, compiled, dtype):
    x, src, idx = rand(10, 5, dtype=dtype), rand(6, 7, seed=2, dtype=dtype), index(10, 5, 3)
    # (torch's own backward fails for a src larger than the index: only the forward here)
    check(lambda x, s, i: x.scatter(0, i, s), x, src, idx, compiled=compiled, grad=False)
    check(lambda x, s, i: x.scatter_add(0, i, s), x, src, idx, compiled=compiled, grad=False)
    check(lambda x, s, i: x.scatter_add(0, i, s), x, src[:5, :3], idx, compiled=compiled)
    check(lambda x, i: x.scatter(1, i, 3), x, index(5, 4, 2), compiled=compiled)


@MODES
@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int32], ids=["f32", "i64", "i32"])
def test_scatter_reduce(on_device_only, compiled, reduce, include_self, dtype):
    x, src, idx = rand(6, 5, dtype=dtype), rand(5, 4, seed=2, dtype=dtype), index(6, 5, 4)
    check(lambda x, s, i: x.scatter_reduce(0, i, s, reduce, include_self=include_self), x, src, idx, compiled=compiled,
          grad=reduce != "prod" or include_self)


@MODES
def test_scatter_legacy_reduce(on_device_only, compiled):
    x, src, idx = rand(6, 5), rand(6, 5, seed=2), index(6, 4, 5)
    check(lambda x, s, i: x.scatter(0, i, s, reduce="multiply"), x, src, idx, compiled=compiled, grad=False)
    check(lambda x, i: x.scatter(1, i, 1.5, reduce="add"), x, idx[:, :3] % 5, compiled=compiled, grad=False)


def test_scatter_nan_propagates_through_amax_and_amin(on_device_only):
    x = torch.tensor([1.0, float("nan"), 3.0, 0.0])
    src = torch.tensor([float("nan"), 2.0, 5.0, -1.0])
    idx = torch.tensor([0, 1, 2, 2])
    for reduce in ("amax", "amin"):
        for include_self in (True, False):
            check(lambda x, s, i, r=reduce, inc=include_self: x.scatter_reduce(0, i, s, r, include_self=inc),
                  x, src, idx, grad=False)


@MODES
def test_scatter_of_a_long_dim_goes_by_flat_ids(on_device_only, compiled):
    """Sort's backward scatters a permutation of 8000; scatter_add of 300 into 100 adds exactly."""
    perm = torch.randperm(8000, generator=torch.Generator().manual_seed(3))
    check(lambda x, s, i: x.scatter(0, i, s), rand(8000), rand(8000, seed=1), perm, compiled=compiled)
    idx = index(100, 300)
    check(lambda x, s, i: x.scatter_add(0, i, s), rand(100), rand(300, seed=2), idx, compiled=compiled)
    check(lambda x, s, i: x.scatter(0, i, s), rand(100), rand(300, seed=2), idx, compiled=compiled)
    big = {"low": -2**30, "high": 2**30}
    check(lambda x, s, i: x.scatter_add(0, i, s), rand(100, dtype=torch.int32, **big),
          rand(300, seed=2, dtype=torch.int32, **big), idx)
    check(lambda x, s, i: x.scatter_reduce(0, i, s, "mean", include_self=False), rand(100, dtype=torch.int64),
          rand(300, seed=2, dtype=torch.int64), idx)


def test_scatter_into_a_zero_d_tensor_and_by_an_empty_index(on_device_only):
    check(lambda x, s, i: x.scatter(0, i, s), rand(), rand(seed=1), torch.tensor(0))
    check(lambda x, i: x.gather(0, i), rand(4), torch.zeros(0, dtype=torch.long))
    check(lambda x: x.max(0), rand(5, 3))
    check(lambda x: x.min(-1), rand(4))


def test_sort_of_a_long_dim(on_device_only):
    check(lambda x: torch.sort(x, 0), rand(8000))
    check(lambda x: torch.msort(x), rand(300, 2))


@settings(deadline=None)
@given(n=st.integers(1, 6), m=st.integers(1, 12), k=st.integers(1, 6), seed=st.integers(0, 2**16),
       reduce=st.sampled_from([None, *REDUCES]), include_self=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.int32]))
def test_scatter_matches_cpu(device, n, m, k, seed, reduce, include_self, dtype):
    x, src = rand(n, 3, seed=seed, dtype=dtype), rand(k, 3, seed=seed + 1, dtype=dtype)
    idx = index(n, k, 2, seed=seed + 2)
    with only_on_device():
        if reduce is None:
            check(lambda x, s, i: x.scatter(0, i, s), x, src, idx, grad=False)
        else:
            check(lambda x, s, i: x.scatter_reduce(0, i, s, reduce, include_self=include_self), x, src, idx,
                  grad=False)
    del m


# -- index_put and what decomposes into it ------------------------------------------------------------


@MODES
@DTYPES
def test_index_put_writes_and_accumulates(on_device_only, compiled, dtype):
    x, v = rand(6, 4, dtype=dtype), rand(5, 4, seed=2, dtype=dtype)
    idx = torch.tensor([0, 3, 3, 5, 1])
    check(lambda x, v, i: x.index_put((i,), v), x, v, idx, compiled=compiled)
    check(lambda x, v, i: x.index_put((i,), v, accumulate=True), x, v, idx, compiled=compiled)
    check(lambda x, v, i: x.index_copy(0, i, v[:3]), x, v, torch.tensor([4, 0, 2]), compiled=compiled)
    check(lambda x, i: x.index_fill(1, i, 1), x, torch.tensor([1, 3]), compiled=compiled)
    if dtype != torch.bool:
        check(lambda x, v, i: x.index_add(0, i, v, alpha=2), x, v, idx, compiled=compiled)


def test_index_add_of_large_integers_is_exact(on_device_only):
    big = {"low": -2**30, "high": 2**30}
    idx = index(7, 40)
    check(lambda x, v, i: x.index_add(0, i, v), rand(7, 3, dtype=torch.int32, **big),
          rand(40, 3, seed=2, dtype=torch.int32, **big), idx)


@MODES
def test_max_unpool(on_device_only, compiled):
    x = rand(1, 2, 8, 8)
    out, ind = F.max_pool2d(x, 2, return_indices=True)
    check(lambda o, i: F.max_unpool2d(o, i, 2), out.detach(), ind, compiled=compiled)
    out1, ind1 = F.max_pool1d(rand(2, 3, 8), 2, return_indices=True)
    check(lambda o, i: F.max_unpool1d(o, i, 2), out1.detach(), ind1, compiled=compiled)


@settings(deadline=None)
@given(rows=st.integers(1, 8), n=st.integers(1, 10), seed=st.integers(0, 2**16), accumulate=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.int64, torch.bool]))
def test_index_put_matches_cpu(device, rows, n, seed, accumulate, dtype):
    x, v = rand(rows, 2, seed=seed, dtype=dtype), rand(n, 2, seed=seed + 1, dtype=dtype)
    idx = index(rows, n, seed=seed + 2)
    with only_on_device():
        check(lambda x, v, i: x.index_put((i,), v, accumulate=accumulate), x, v, idx, grad=False)


# -- reductions built on sorting and searching --------------------------------------------------------

NAN = float("nan")


def with_nans(*shape: int, seed: int = 0) -> torch.Tensor:
    x = rand(*shape, seed=seed)
    x.view(-1)[:: 5] = NAN
    return x


@MODES
def test_median_kthvalue_mode(on_device_only, compiled):
    x = rand(5, 7)
    check(lambda x: torch.median(x, 1), x, compiled=compiled)
    check(lambda x: torch.median(x), x, compiled=compiled)
    check(lambda x: torch.nanmedian(x, 0), x, compiled=compiled)
    check(lambda x: torch.kthvalue(x, 3, 1, keepdim=True), x, compiled=compiled)
    check(lambda x: torch.mode(x, 1)[0], rand(5, 9, dtype=torch.int64, low=0, high=4), compiled=compiled)
    check(lambda x: torch.mode(x, 0), rand(6, 3), compiled=compiled)


def test_median_of_rows_with_nan(on_device_only):
    x = with_nans(4, 6)
    x[3] = NAN
    x[3, 2] = 0.5
    check(lambda x: torch.median(x, 1)[0], x, grad=False)
    check(lambda x: torch.nanmedian(x, 1), x, grad=False)
    check(lambda x: (torch.median(x), torch.nanmedian(x)), x, grad=False)


@MODES
def test_cumprod(on_device_only, compiled):
    x = rand(4, 6)
    x[1, 2] = 0.0
    check(lambda x: torch.cumprod(x, 1), x, compiled=compiled)
    check(lambda x: torch.cumprod(x, 0), rand(6, 4, dtype=torch.int64, low=-4, high=5), compiled=compiled)
    check(lambda x: torch.cumprod(x, 0), rand(9, dtype=torch.int32, low=-20, high=20), compiled=compiled)
    check(lambda x: torch.linalg.vander(x, N=4), rand(5), compiled=compiled)


@MODES
@pytest.mark.parametrize("right", [False, True])
def test_searchsorted_and_bucketize(on_device_only, compiled, right):
    seq = torch.sort(rand(10)).values
    v = rand(3, 4, seed=1)
    v[0, 0], v[1, 1] = NAN, seq[3]
    nan_tail = seq.clone()
    nan_tail[-2:] = NAN
    check(lambda s, v: torch.searchsorted(s, v, right=right), seq, v, compiled=compiled, grad=False)
    check(lambda s, v: torch.searchsorted(s, v, right=right), nan_tail, v, compiled=compiled, grad=False)
    check(lambda s, v: torch.bucketize(v, s, right=right, out_int32=True), seq, v, compiled=compiled, grad=False)
    rows = torch.sort(rand(3, 10, seed=2), 1).values
    check(lambda s, v: torch.searchsorted(s, v, side="right" if right else "left"), rows, v, compiled=compiled,
          grad=False)
    check(lambda s, v, p: torch.searchsorted(s, v, sorter=p, right=right), rand(10, seed=3), v,
          torch.randperm(10, generator=torch.Generator().manual_seed(0)), compiled=compiled, grad=False)
    check(lambda e, t: torch.isin(e, t), rand(20, dtype=torch.int64, low=0, high=9),
          rand(12, seed=4, dtype=torch.int64, low=0, high=9), compiled=compiled)


def test_variance_of_nothing_is_nan(on_device_only):
    check(lambda x: (torch.var(x, 0), torch.std_mean(x, 0), torch.var_mean(x)), torch.zeros(0, 3), grad=False)


@settings(deadline=None)
@given(n=st.integers(1, 9), rows=st.integers(1, 3), seed=st.integers(0, 2**16), nans=st.booleans(),
       op=st.sampled_from(["median", "nanmedian", "kthvalue", "cumprod", "searchsorted"]))
def test_order_statistics_match_cpu(device, n, rows, seed, nans, op):
    x = with_nans(rows, n, seed=seed) if nans else rand(rows, n, seed=seed)
    fns = {
        "median": lambda x: torch.median(x, 1)[0],
        "nanmedian": lambda x: torch.nanmedian(x, 1)[0],
        "kthvalue": lambda x: torch.kthvalue(x, (seed % n) + 1, 1)[0],
        "cumprod": lambda x: torch.cumprod(x, 1),
        "searchsorted": lambda x: torch.searchsorted(torch.sort(x, 1).values, x[:, :2].flip(1)),
    }
    with only_on_device():
        check(fns[op], x, grad=False)


# -- index_reduce, put, unfold -------------------------------------------------------------------------


@MODES
@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_index_reduce(on_device_only, compiled, reduce, include_self):
    idx = torch.tensor([0, 3, 3, 4])
    check(lambda x, s, i: x.index_reduce(1, i, s, reduce, include_self=include_self), rand(4, 5, 3),
          rand(4, 4, 3, seed=1), idx, compiled=compiled, grad=reduce != "prod")
    check(lambda x, s, i: x.index_reduce(0, i, s, reduce, include_self=include_self), rand(5, 2, dtype=torch.int64),
          rand(4, 2, seed=1, dtype=torch.int64), idx, compiled=compiled)


@MODES
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool], ids=["f32", "i64", "bool"])
def test_put(on_device_only, compiled, accumulate, dtype):
    idx = torch.tensor([[0, -1], [5, 5]])
    check(lambda x, s, i: x.put(i, s, accumulate=accumulate), rand(3, 4, dtype=dtype), rand(2, 2, seed=1, dtype=dtype),
          idx, compiled=compiled)


@MODES
def test_unfold(on_device_only, compiled):
    x = rand(4, 9, 3)
    check(lambda x: x.unfold(1, 3, 2), x, compiled=compiled)
    check(lambda x: x.unfold(0, 2, 1), x, compiled=compiled)
    check(lambda x: x.unfold(-1, 3, 3), x, compiled=compiled)
    check(lambda x: x.unfold(0, 1, 1), rand(), compiled=compiled)


# -- take, cummax/cummin, logcumsumexp ------------------------------------------------------------------

INF = float("inf")


@MODES
@DTYPES
def test_take(on_device_only, compiled, dtype):
    x = rand(3, 4, dtype=dtype)
    check(lambda x, i: torch.take(x, i), x, torch.tensor([[0, -1], [5, 11], [4, 4]]), compiled=compiled)
    check(lambda x, i: torch.take(x, i), x, torch.tensor(-3), compiled=compiled)
    check(lambda x, i: torch.take(x, i), rand(dtype=dtype), torch.tensor([0, -1, 0]), compiled=compiled)


@pytest.mark.parametrize("bad", [12, -13])
def test_take_out_of_range_fails_the_run(device, bad):
    with pytest.raises(Exception, match="out of range"):
        torch.take(rand(3, 4).to("tt"), torch.tensor([0, bad]).to("tt")).cpu()


@settings(deadline=None)
@given(n=st.integers(1, 20), k=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_take_matches_cpu(device, n, k, seed):
    idx = torch.randint(-n, n, (k,), generator=torch.Generator().manual_seed(seed))
    with only_on_device():
        check(lambda x, i: torch.take(x, i), rand(n, seed=seed), idx)


def same_signed_values(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal, NaN where NaN, and zeros of the same sign (torch's cummax keeps x's -0.0)."""
    _close(got, expected)
    if expected.dtype.is_floating_point:
        assert torch.equal(got.cpu().signbit(), expected.signbit())


@MODES
@pytest.mark.parametrize("op", ["cummax", "cummin"])
@DTYPES
def test_cummax_cummin(on_device_only, compiled, op, dtype):
    fn = getattr(torch, op)
    x = rand(5, 9, dtype=dtype, low=-3, high=3)  # many ties: the later index wins
    for dim in (0, 1, -1):
        check(lambda x, d=dim: fn(x, d), x, compiled=compiled)
    check(lambda x: fn(x, 0), rand(dtype=dtype), compiled=compiled)
    check(lambda x: fn(x, 0), rand(37, dtype=dtype), compiled=compiled)


@pytest.mark.parametrize("op", ["cummax", "cummin"])
def test_cummax_cummin_nan_and_signed_zeros(on_device_only, op):
    fn = getattr(torch, op)
    x = torch.tensor([[1.0, 3, 3, 2, NAN, 5, NAN, 7, -INF],
                      [0.0, -0.0, 0.0, -1, -1, 4, 4, -9, -0.0],
                      [-0.0, 0.0, INF, INF, NAN, NAN, 1, -INF, -INF]])
    for dim in (0, 1):
        want, got = fn(x, dim), fn(x.to("tt"), dim)
        same_signed_values(got.values, want.values)
        _close(got.indices, want.indices)


@settings(deadline=None)
@given(rows=st.integers(1, 3), n=st.integers(1, 40), seed=st.integers(0, 2**16), nans=st.booleans(),
       op=st.sampled_from(["cummax", "cummin"]), dtype=st.sampled_from([torch.float32, torch.int64, torch.bool]))
def test_cummax_cummin_match_cpu(device, rows, n, seed, nans, op, dtype):
    x = rand(rows, n, seed=seed, dtype=dtype, low=-4, high=4)
    if nans and dtype.is_floating_point:
        x.view(-1)[seed % 3:: 4] = NAN
    with only_on_device():
        want, got = getattr(torch, op)(x, 1), getattr(torch, op)(x.to("tt"), 1)
        same_signed_values(got.values, want.values)
        _close(got.indices, want.indices)


@MODES
def test_logcumsumexp(on_device_only, compiled):
    check(lambda x: torch.logcumsumexp(x, 1), rand(4, 37) * 10, compiled=compiled)
    check(lambda x: torch.logcumsumexp(x, 0), rand(6, 3), compiled=compiled)
    check(lambda x: torch.logcumsumexp(x, 0), rand(), compiled=compiled)
    big = rand(3, 20) + 1e4  # the gradient exponentiates differences of results near 1e4
    big[0, 3] = 1e4
    check(lambda x: torch.logcumsumexp(x, 1), big, compiled=compiled)


def test_logcumsumexp_edges(on_device_only):
    x = torch.tensor([[-200.0, 0, -INF, -INF, INF, 3, INF, NAN, 1],
                      [-INF, -INF, 2, -INF, 1e30, -1e30, 88, 89, 0],
                      [3.0, 3, 3, -INF, 3, -1e-3, 1e-3, -100, 100]])
    for dim in (0, 1):
        check(lambda x, d=dim: torch.logcumsumexp(x, d), x, grad=False)
    check(lambda x: torch.logcumsumexp(x, 0), torch.tensor([-INF, -INF]), grad=False)
    check(lambda x: torch.logcumsumexp(x, 0), torch.tensor([INF, INF, -INF]), grad=False)


@settings(deadline=None)
@given(n=st.integers(1, 70), seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 30.0, 1e3]))
def test_logcumsumexp_matches_cpu(device, n, seed, scale):
    """The forward at every scale; the gradient (torch's formula, a difference of two sums of
    exponentials, which cancels) where CPU torch's own float32 result is within the tolerance
    of the exact one: at scale 30 it is 1e-5 off, and the device's rounding lands elsewhere."""
    with only_on_device():
        check(lambda x: torch.logcumsumexp(x, 1), rand(2, n, seed=seed) * scale, grad=scale == 1.0)


# -- histc --------------------------------------------------------------------------------------------


def histc_equal(x: torch.Tensor, **kwargs: Any) -> None:
    with only_on_device():
        got = torch.histc(x.to("tt"), **kwargs)
    _close(got, torch.histc(x, **kwargs))


@MODES
def test_histc(on_device_only, compiled):
    check(lambda x: torch.histc(x, bins=7, min=-2, max=3.3), rand(300) * 3, compiled=compiled, grad=False)
    check(lambda x: torch.histc(x, bins=13), rand(8, 9), compiled=compiled, grad=False)
    check(lambda x: torch.histc(x, bins=4), torch.full((5,), 2.5), compiled=compiled, grad=False)
    check(lambda x: torch.histc(x, bins=5, min=0, max=10), torch.tensor(4.0), compiled=compiled, grad=False)
    check(lambda x: torch.histc(x, bins=3), torch.zeros(0), compiled=compiled, grad=False)


def test_histc_edges_nan_and_infinities(device):
    histc_equal(torch.tensor([1.0, NAN, INF, -INF, 3, 0.3, 0, -0.0]), bins=10, min=0, max=3)
    histc_equal(torch.linspace(0, 10, 1001), bins=3, min=0, max=10)  # values on the edges
    histc_equal(torch.arange(100.0) / 10, bins=10, min=0, max=9.9)


@pytest.mark.parametrize("data", [[1.0, INF], [NAN, 2.0], [-INF, -INF]])
def test_histc_of_a_data_range_that_is_not_finite_fails_the_run(device, data):
    with pytest.raises(RuntimeError):
        torch.histc(torch.tensor(data), bins=3)
    with pytest.raises(Exception, match="not finite"):
        torch.histc(torch.tensor(data).to("tt"), bins=3).cpu()


@st.composite
def edge_values(draw: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """Values on the bin edges torch computes in float32, and one float32 step either side."""
    low = draw(st.floats(-100, 100, width=32))
    high = low + draw(st.one_of(st.just(0.0), st.floats(1e-3, 200)))
    high = torch.tensor(high).item()  # a float32 value
    bins = draw(st.integers(1, 40))
    if low == high:
        edges = torch.linspace(low - 1, high + 1, bins + 1)
    else:
        edges = torch.linspace(low, high, bins + 1)
    near = torch.cat([edges, torch.nextafter(edges, torch.tensor(INF)), torch.nextafter(edges, torch.tensor(-INF))])
    picks = draw(st.lists(st.integers(0, near.numel() - 1), min_size=1, max_size=30))
    return near[picks], {"bins": bins, "min": low, "max": high}


@settings(deadline=None)
@given(case=edge_values())
def test_histc_bins_edges_as_torch(device, case):
    x, kwargs = case
    histc_equal(x, **kwargs)


@settings(deadline=None)
@given(n=st.integers(1, 200), bins=st.integers(1, 30), seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 1e-3, 1e4]),
       given_range=st.booleans())
def test_histc_matches_cpu(device, n, bins, seed, scale, given_range):
    x = rand(n, seed=seed) * scale
    kwargs = {"bins": bins, "min": -scale, "max": 1.5 * scale} if given_range else {"bins": bins}
    histc_equal(x, **kwargs)


# -- the margin losses' backward ------------------------------------------------------------------------


@MODES
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_multi_margin_loss_backward(on_device_only, compiled, reduction):
    x, y, w = rand(5, 7), index(7, 5), rand(7, seed=3).abs()
    check(lambda x, y: F.multi_margin_loss(x, y, reduction=reduction), x, y, compiled=compiled)
    check(lambda x, y, w: F.multi_margin_loss(x, y, p=2, margin=0.5, weight=w.detach(), reduction=reduction), x, y,
          w, compiled=compiled)
    if reduction != "none":  # (see test_unreduced_margin_loss_of_one_sample_is_0_d)
        check(lambda x, y: F.multi_margin_loss(x, y, reduction=reduction), rand(6), torch.tensor(2), compiled=compiled)


@MODES
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_multilabel_margin_loss_backward(on_device_only, compiled, reduction):
    x = rand(4, 6)
    y = torch.tensor([[3, 0, -1, 1, 1, 1], [0, 1, 2, 3, 4, 5], [-1, 2, 2, 2, 2, 2], [5, 5, 2, -1, 0, 0]])
    if compiled:
        # Dynamo takes torch's refs decomposition of multilabel_margin_loss, which differs
        # from CPU torch on a repeated target or a -1 (docs/torch-lowering.md): none here.
        y = torch.stack([torch.randperm(6, generator=torch.Generator().manual_seed(k)) for k in range(4)])
    check(lambda x, y: F.multilabel_margin_loss(x, y, reduction=reduction), x, y, compiled=compiled)
    if reduction != "none":
        check(lambda x, y: F.multilabel_margin_loss(x, y, reduction=reduction), rand(6), y[0], compiled=compiled)


def test_unreduced_margin_loss_of_one_sample_is_0_d(device):
    """CPU torch's unreduced loss of one sample (a 0-d target; a 1-d input) is 0-d, where its
    decomposition and its meta kernel say [1]: eagerly the op runs on the CPU (the fallback),
    so the shape is right; the backward still lowers."""
    x, y = rand(6), torch.tensor(2)
    got = F.multi_margin_loss(x.to("tt"), y.to("tt"), reduction="none")
    _close(got, F.multi_margin_loss(x, y, reduction="none"))
    labels = torch.tensor([3, 0, -1, 1, 1, 1])
    got = F.multilabel_margin_loss(x.to("tt"), labels.to("tt"), reduction="none")
    _close(got, F.multilabel_margin_loss(x, labels, reduction="none"))


@settings(deadline=None)
@given(n=st.integers(1, 5), dim=st.integers(1, 8), seed=st.integers(0, 2**16), p=st.sampled_from([1, 2]),
       margin=st.sampled_from([0.0, 0.5, 1.0, 2.0]), weighted=st.booleans(),
       reduction=st.sampled_from(["mean", "sum", "none"]))
def test_multi_margin_loss_matches_cpu(device, n, dim, seed, p, margin, weighted, reduction):
    x, y = rand(n, dim, seed=seed), index(dim, n, seed=seed + 1)
    w = rand(dim, seed=seed + 2).abs() if weighted else torch.ones(dim)
    with only_on_device():
        check(lambda x, y, w: F.multi_margin_loss(x, y, p=p, margin=margin, weight=w.detach() if weighted else None,
                                                  reduction=reduction), x, y, w)


@settings(deadline=None)
@given(n=st.integers(1, 5), dim=st.integers(1, 8), seed=st.integers(0, 2**16),
       reduction=st.sampled_from(["mean", "sum", "none"]))
def test_multilabel_margin_loss_matches_cpu(device, n, dim, seed, reduction):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(-1, dim, (n, dim), generator=g)
    with only_on_device():
        check(lambda x, y: F.multilabel_margin_loss(x, y, reduction=reduction), rand(n, dim, seed=seed), y)
