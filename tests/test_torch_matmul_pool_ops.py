"""Matrix products, pooling, resampling and convolutions on tt against CPU torch, eager and
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


def check(fn: Callable[..., Any], *inputs: Any, compiled: bool = False, grad: bool = True) -> None:
    """`fn` of `inputs` on tt (eager, or compiled with backend="tt") equals `fn` on the CPU, and
    so do the gradients of its float inputs (one fixed random upstream gradient)."""
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
    expected = fn(*cpu)
    got = run(*tt_in)
    _close(got, expected.detach())
    if grad:
        upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7))
        want = torch.autograd.grad(expected, [cpu[i] for i in floats], upstream)
        have = torch.autograd.grad(got, [tt_in[i] for i in floats], upstream.to("tt"))
        for h, w in zip(have, want):
            _close(h, w)


def rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-9, 10, shape, generator=g, dtype=dtype)


MODES = pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])


# -- matrix products ---------------------------------------------------------------------------------


PRODUCTS = {
    "mv": (lambda m, v: torch.mv(m, v), ((3, 4), (4,))),
    "matmul matrix-vector": (lambda m, v: m @ v, ((2, 3, 4), (4,))),
    "matmul vector-matrix": (lambda v, m: v @ m, ((4,), (4, 5))),
    "dot": (lambda a, b: torch.dot(a, b), ((6,), (6,))),
    "addmv": (lambda c, m, v: torch.addmv(c, m, v, beta=2, alpha=3), ((3,), (3, 4), (4,))),
    "addmv beta 0": (lambda c, m, v: torch.addmv(c, m, v, beta=0), ((3,), (3, 4), (4,))),
    "addr": (lambda c, a, b: torch.addr(c, a, b, alpha=2), ((3, 4), (3,), (4,))),
    "addbmm": (lambda c, a, b: torch.addbmm(c, a, b, beta=3, alpha=2), ((3, 5), (4, 3, 2), (4, 2, 5))),
    "trace": (lambda x: torch.trace(x), ((4, 3),)),
    "diagonal": (lambda x: torch.diagonal(x, 1, 0, 2) * 1, ((3, 2, 5),)),
    "diagonal of a matrix": (lambda x: torch.diagonal(x, 1) * 1, ((3, 4),)),
    "diagonal below": (lambda x: torch.diagonal(x, -2, -1, 1) * 1, ((2, 4, 3),)),
}


@MODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.int32])
@pytest.mark.parametrize("name", list(PRODUCTS))
def test_products_match_cpu(on_device_only, name, dtype, compiled) -> None:
    fn, shapes = PRODUCTS[name]
    if name == "trace" and dtype.is_floating_point:
        # trace's backward fills a diagonal with index_fill_, which does not lower yet.
        check(fn, *(rand(*s, seed=i, dtype=dtype) for i, s in enumerate(shapes)), compiled=compiled, grad=False)
        return
    check(fn, *(rand(*s, seed=i, dtype=dtype) for i, s in enumerate(shapes)), compiled=compiled)


def test_addmv_beta_zero_ignores_nan_in_the_bias(on_device_only) -> None:
    c = torch.full((3,), float("nan"))
    check(lambda c, m, v: torch.addmv(c, m, v, beta=0), c, rand(3, 4), rand(4), grad=False)


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 5), offset=st.integers(-5, 5),
       seed=st.integers(0, 1000))
def test_diagonal_of_any_offset_matches_cpu(device, rows, cols, offset, seed) -> None:
    x = rand(2, rows, cols, seed=seed, dtype=torch.int64)
    with only_on_device():
        got = torch.diagonal(x.to("tt"), offset, 1, 2).sum(-1)
    _close(got, torch.diagonal(x, offset, 1, 2).sum(-1))


# -- pooling -----------------------------------------------------------------------------------------


POOLS = {
    "max ceil_mode": lambda x: F.max_pool2d(x, 2, 2, ceil_mode=True),
    "max ceil_mode padded": lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True),
    "max 1-d ceil_mode": lambda x: F.max_pool1d(x.flatten(1, 2), 2, 2, ceil_mode=True),
    "avg ceil_mode": lambda x: F.avg_pool2d(x, 2, 2, ceil_mode=True),
    "avg ceil_mode padded": lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
    "avg ceil_mode padded, pad not counted": lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True,
                                                                     count_include_pad=False),
    "avg divisor_override": lambda x: F.avg_pool2d(x, (2, 3), 1, (1, 0), divisor_override=4),
    "avg pad not counted": lambda x: F.avg_pool2d(x, 3, 1, 1, count_include_pad=False),
    "avg 1-d ceil_mode": lambda x: F.avg_pool1d(x.flatten(1, 2), 3, 2, ceil_mode=True),
    "avg": lambda x: F.avg_pool2d(x, 2),
}


@MODES
@pytest.mark.parametrize("name", list(POOLS))
def test_pools_match_cpu(on_device_only, name, compiled) -> None:
    check(POOLS[name], rand(2, 3, 5, 7), compiled=True if name.startswith("max") else compiled)


@pytest.mark.parametrize("name", list(POOLS))
def test_integer_pools_match_cpu(on_device_only, name) -> None:
    """Average pools truncate, as CPU torch's int64 division (it has no int32 average pool)."""
    x = rand(2, 3, 5, 7, dtype=torch.int64) * 7
    if "1-d" in name and name.startswith("max"):
        pytest.skip("CPU torch has no integer max_pool1d")
    check(POOLS[name], x, compiled=name.startswith("max"))


@settings(max_examples=12, deadline=None)
@given(h=st.integers(3, 7), w=st.integers(3, 7), k=st.integers(2, 3), s=st.integers(1, 3),
       pad=st.integers(0, 1), ceil=st.booleans(), include=st.booleans(), seed=st.integers(0, 1000))
def test_avg_pool_options_match_cpu(device, h, w, k, s, pad, ceil, include, seed) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(x, k, s, pad, ceil_mode=ceil, count_include_pad=include)

    with only_on_device():
        check(fn, rand(1, 2, h, w, seed=seed))


# -- convolutions ------------------------------------------------------------------------------------


CONVS = {
    "grouped conv2d": (lambda x, w: F.conv2d(x, w, stride=(2, 1), padding=1, groups=2), (2, 4, 6, 5), (6, 2, 3, 2)),
    "depthwise conv2d dilated": (lambda x, w: F.conv2d(x, w, dilation=2, groups=4), (1, 4, 7, 7), (4, 1, 3, 3)),
    "grouped conv1d": (lambda x, w: F.conv1d(x, w, stride=2, padding=2, groups=3), (2, 3, 9), (6, 1, 4)),
    "conv_transpose2d output_padding past the stride": (
        lambda x, w: F.conv_transpose2d(x, w, stride=(3, 2), padding=(1, 2), output_padding=(2, 3), groups=2,
                                        dilation=(4, 4)), (2, 4, 4, 4), (4, 2, 4, 5)),
    "conv_transpose2d": (lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1),
                         (1, 2, 4, 3), (2, 3, 3, 4)),
}


@MODES
@pytest.mark.parametrize("name", list(CONVS))
def test_convolutions_and_their_gradients_match_cpu(on_device_only, name, compiled) -> None:
    fn, xs, ws = CONVS[name]
    check(fn, rand(*xs, seed=1), rand(*ws, seed=2), compiled=compiled)


@MODES
@pytest.mark.parametrize("name", [n for n in CONVS if "transpose" not in n])
def test_integer_convolutions_are_exact(on_device_only, name, compiled) -> None:
    fn, xs, ws = CONVS[name]
    check(fn, rand(*xs, seed=1, dtype=torch.int64), rand(*ws, seed=2, dtype=torch.int64), compiled=compiled)


def test_an_integer_conv_with_bias_is_exact(on_device_only) -> None:
    x, w, b = (rand(*s, seed=i, dtype=torch.int64) for i, s in enumerate(((2, 3, 5, 6), (4, 3, 2, 3), (4,))))
    check(lambda x, w, b: F.conv2d(x, w, b, padding=(1, 0)), x * 1000, w * 1000, b)


def test_an_integer_transposed_convolution_runs_on_the_cpu(device) -> None:
    from ttflow.torch import _fallback

    _fallback.warned.clear()
    x, w = rand(1, 2, 4, 3, dtype=torch.int64), rand(2, 3, 3, 4, dtype=torch.int64)
    with pytest.warns(UserWarning, match="ran on the CPU"):
        got = F.conv_transpose2d(x.to("tt"), w.to("tt"))
    _close(got, F.conv_transpose2d(x, w))


# -- resampling --------------------------------------------------------------------------------------


RESAMPLES = {
    "nearest 1-d": (lambda x: F.interpolate(x.flatten(1, 2), size=11, mode="nearest"), (2, 3, 2, 5)),
    "nearest-exact 2-d by 1.7": (lambda x: F.interpolate(x, scale_factor=1.7, mode="nearest-exact"), (1, 2, 4, 5)),
    "nearest 3-d": (lambda x: F.interpolate(x.unsqueeze(2).expand(-1, -1, 2, -1, -1), size=(3, 5, 3)), (1, 2, 4, 5)),
    "linear": (lambda x: F.interpolate(x.flatten(1, 2), size=7, mode="linear"), (1, 2, 3, 5)),
    "bilinear down, align_corners": (lambda x: F.interpolate(x, size=(3, 2), mode="bilinear", align_corners=True),
                                     (2, 3, 5, 7)),
    "bilinear by 2.5": (lambda x: F.interpolate(x, scale_factor=2.5, mode="bilinear"), (1, 2, 3, 4)),
    "bicubic": (lambda x: F.interpolate(x, size=(6, 9), mode="bicubic"), (1, 2, 4, 5)),
    "bicubic align_corners": (lambda x: F.interpolate(x, size=(3, 8), mode="bicubic", align_corners=True),
                              (1, 2, 4, 5)),
    "trilinear": (lambda x: F.interpolate(x.reshape(1, 2, 2, 4, 5), size=(3, 6, 4), mode="trilinear"), (1, 4, 4, 5)),
    "area": (lambda x: F.interpolate(x, size=(3, 4), mode="area"), (1, 2, 7, 9)),
    "adaptive avg 1-d": (lambda x: F.adaptive_avg_pool1d(x.flatten(1, 2), 4), (2, 3, 2, 5)),
    "adaptive avg 2-d": (lambda x: F.adaptive_avg_pool2d(x, (5, 3)), (2, 3, 7, 5)),
    "adaptive avg 3-d": (lambda x: F.adaptive_avg_pool3d(x.reshape(1, 3, 3, 4, 5), (2, 3, 4)), (1, 9, 4, 5)),
}


@MODES
@pytest.mark.parametrize("name", list(RESAMPLES))
def test_resampling_and_its_gradient_match_cpu(on_device_only, name, compiled) -> None:
    fn, shape = RESAMPLES[name]
    check(fn, rand(*shape), compiled=compiled)


@settings(max_examples=15, deadline=None)
@given(h=st.integers(1, 6), w=st.integers(1, 6), oh=st.integers(1, 9), ow=st.integers(1, 9),
       mode=st.sampled_from(["nearest", "nearest-exact", "bilinear", "bicubic", "area"]), align=st.booleans(),
       seed=st.integers(0, 1000))
def test_any_resize_matches_cpu(device, h, w, oh, ow, mode, align, seed) -> None:
    corners = align if mode in ("bilinear", "bicubic") else None

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, size=(oh, ow), mode=mode, align_corners=corners)

    with only_on_device():
        check(fn, rand(1, 2, h, w, seed=seed))


@settings(max_examples=10, deadline=None)
@given(h=st.integers(1, 6), factor=st.floats(0.3, 3.0), mode=st.sampled_from(["nearest", "bilinear", "bicubic"]),
       seed=st.integers(0, 1000))
def test_any_scale_factor_matches_cpu(device, h, factor, mode, seed) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=factor, mode=mode)

    x = rand(1, 1, h, h + 1, seed=seed)
    if int(h * factor) < 1:  # torch refuses an empty output
        return
    with only_on_device():
        check(fn, x)


@pytest.mark.parametrize(("mode", "shape"), [
    ("linear", (1, 2, 2)), ("linear", (1, 2, 3)), ("bilinear", (1, 1, 1, 2)), ("bilinear", (1, 1, 4, 2)),
    ("bilinear", (1, 1, 2, 4)), ("bicubic", (1, 1, 4, 2)), ("bicubic", (1, 1, 1, 2)), ("bicubic", (1, 1, 2, 3)),
    ("trilinear", (1, 1, 2, 3, 2)),
])
def test_an_axis_whose_size_stays_is_copied_as_cpu_torch_does(device, mode, shape) -> None:
    """A factor of 1.25 on 2 (or 3) pixels keeps 2 (3): CPU torch's linear kernels copy that axis,
    where torch's own decompositions blend it at the 0.8 spacing; its bicubic forward applies the
    taps there, but its backward copies the gradient when no size changes. Eager tt follows the kernels;
    compiled, torch decomposes `upsample_*.vec` itself before any backend sees it, so tt gives
    what `backend="aot_eager"` gives on the CPU (docs/torch-lowering.md)."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=1.25, mode=mode)

    x = rand(*shape, seed=3)
    with only_on_device():
        check(fn, x)
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="tt", dynamic=False)(x.to("tt"))
    torch._dynamo.reset()
    _close(compiled, torch.compile(fn, backend="aot_eager", dynamic=False)(x))
