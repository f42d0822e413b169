"""The ops of format version 3 (what a PyTorch front-end lowering core-ATen graphs needs) against
references written here: float64 numpy, `math.erf`, a pure-Python Philox4x32-10 and CPU PyTorch
autograd for the gradients (permuted between NHWC and NCHW), never `ttflow._ir.ops`.

As in `test_ops_model`: each op on hypothesis-drawn shapes and dtypes through `run_on_host`, the
builder's refusals, and one program holding every new op saved, loaded and run on the emulated
device (asyncio and trio), whose results must equal the host's bit for bit.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_ops_model import (
    BF8,
    BF16,
    F32,
    FLOATS,
    I32,
    U32,
    WIDTH,
    check,
    check_on_device,
    check_saved_and_on_host,
    exact,
    host,
    make,
    rounded,
    seeds,
    shapes,
    tile,
)

import ttflow as tt
from ttflow._ir.binary import _VERSION as NEWEST  # save's version: the newest of the ops' records
from ttflow._ir.builder import Value
from ttflow._ir.interpreter import run_on_host

Array = np.ndarray[Any, Any]
float_dtypes = st.sampled_from(FLOATS)


def torch_module() -> Any:
    return pytest.importorskip("torch")


# -- group 1: div, log, erf, abs -------------------------------------------------------------------


@given(st.data(), st.sampled_from(FLOATS), st.sampled_from(FLOATS), st.booleans(), seeds)
def test_div_is_true_division_with_broadcasting(data: st.DataObject, da: tt.DataType, db: tt.DataType,
                                                scalar: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sa, sb = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=1, max_dims=3, max_side=6)).input_shapes
    a = make(rng, sa, da, 5.0)
    c = (rng.uniform(0.25, 4.0, sb) * rng.choice([-1.0, 1.0], sb)).astype(np.float32)  # never 0
    if scalar:
        s = data.draw(st.sampled_from([3.0, -0.5, 7, 1e-3]), label="scalar")
        out, got = host(lambda b, x: b.div(x, s), (a, da))
        want, dtype = rounded(a, da) / float(s), da
    else:
        out, got = host(lambda b, x, y: b.div(x, y), (a, da), (c, db))
        want, dtype = rounded(a, da) / rounded(c, db), max((da, db), key=WIDTH.__getitem__)
    assert out.dtype is dtype and out.shape == want.shape
    check(got, want, dtype, rtol=2e-7 if dtype is F32 else 2e-6, atol=0.0 if dtype is F32 else 1e-6)


def test_div_edge_values_are_ieee() -> None:
    a = np.array([1.0, -1.0, 0.0, np.inf, 6.0, np.nan], np.float32)
    c = np.array([0.0, 0.0, 0.0, 2.0, -3.0, 1.0], np.float32)
    with np.errstate(all="raise"):  # no warning escapes the op
        _, got = host(lambda b, x, y: b.div(x, y), (a, F32), (c, F32))
    np.testing.assert_array_equal(got[[0, 1, 3, 4]], [np.inf, -np.inf, np.inf, -2.0])
    assert np.isnan(got[2]) and np.isnan(got[5])


UNARY3: dict[str, Callable[[Array], Array]] = {
    "log": lambda x: np.log(x),
    "erf": lambda x: np.vectorize(math.erf)(x),
    "abs": np.abs,
}


@given(st.sampled_from(sorted(UNARY3)), shapes(1, 3), float_dtypes, seeds)
def test_unary_float_ops_of_version_3(op: str, shape: tuple[int, ...], dtype: tt.DataType, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = make(rng, shape, dtype, scale=4.0)
    if op == "log":
        x = np.abs(x) + np.float32(0.125)
    out, got = host(lambda b, v: getattr(b, op)(v), (x, dtype))
    assert out.dtype is dtype
    want = UNARY3[op](rounded(x, dtype))
    if op == "abs":
        exact(got, want, dtype)
    else:
        check(got, want, dtype, rtol=4e-7 if dtype is F32 else 2e-6, atol=1e-7)


def test_abs_of_integers_wraps_like_torch() -> None:
    x = np.array([-(2**31), -5, 0, 7, 2**31 - 1], np.int32)
    out, got = host(lambda b, v: b.abs(v), (x, I32))
    assert out.dtype is I32
    np.testing.assert_array_equal(got, [-(2**31), 5, 0, 7, 2**31 - 1])
    torch = torch_module()
    np.testing.assert_array_equal(got, torch.abs(torch.from_numpy(x)).numpy())
    u = np.array([0, 3, 2**32 - 1], np.uint32)
    np.testing.assert_array_equal(host(lambda b, v: b.abs(v), (u, U32))[1], u)


def test_log_and_erf_edge_values() -> None:
    x = np.array([0.0, -0.0, -1.0, np.inf, -np.inf, np.nan, 1.0, 6.0, -6.0, 1e-30], np.float32)
    with np.errstate(all="raise"):
        _, lg = host(lambda b, v: b.log(v), (x, F32))
        _, ef = host(lambda b, v: b.erf(v), (x, F32))
    np.testing.assert_array_equal(lg[[0, 1, 3, 6]], [-np.inf, -np.inf, np.inf, 0.0])
    assert np.isnan(lg[[2, 4, 5]]).all()
    np.testing.assert_array_equal(ef[[0, 3, 4, 7, 8]], [0.0, 1.0, -1.0, 1.0, -1.0])
    assert np.isnan(ef[5]) and np.signbit(ef[1])
    np.testing.assert_allclose(ef[9], 2 / math.sqrt(math.pi) * 1e-30, rtol=1e-6)


# -- group 2: full, broadcast_to --------------------------------------------------------------------


@given(shapes(1, 3), st.sampled_from([F32, BF16, BF8, I32, U32]),
       st.sampled_from([0, 1, -3, 2.5, 1e-3, 65504.0, -1e30, math.inf, -math.inf, 2**31 - 1, 2**32 - 1]))
def test_full_is_a_constant(shape: tuple[int, ...], dtype: tt.DataType, value: float) -> None:
    b = tt.ProgramBuilder("full")
    integral = isinstance(value, int) or (math.isfinite(value) and float(value).is_integer())
    fits = {I32: -(2**31) <= value < 2**31, U32: 0 <= value < 2**32}
    if (not dtype.is_float and not (integral and fits[dtype])) or (dtype is BF8 and math.isinf(value)):
        with pytest.raises(tt.LayoutError, match="full"):
            b.full(shape, value, dtype)
        return
    out = b.full(shape, value, dtype)
    b.output(out)
    (got,) = run_on_host(b.build(), [])
    assert out.dtype is dtype and out.shape == shape and got.shape == shape
    exact(np.asarray(got), np.full(shape, value, np.float64 if dtype.is_float else np.int64), dtype)


def test_full_takes_float32_by_default_and_refuses_nan() -> None:
    b = tt.ProgramBuilder("full")
    assert b.full((2, 3), 1).dtype is F32
    with pytest.raises(tt.ProgramError, match="full: value must not be NaN"):
        b.full((2,), math.nan)


@given(st.data(), st.sampled_from([F32, BF16, BF8, I32, U32]), seeds)
def test_broadcast_to_is_numpys(data: st.DataObject, dtype: tt.DataType, seed: int) -> None:
    target = data.draw(hnp.array_shapes(min_dims=1, max_dims=4, max_side=5), label="target")
    rank = data.draw(st.integers(1, len(target)), label="x rank")
    shape = tuple(1 if data.draw(st.booleans()) else d for d in target[len(target) - rank :])
    x = make(np.random.default_rng(seed), shape, dtype)
    out, got = host(lambda b, v: b.broadcast_to(v, target), (x, dtype))
    assert out.dtype is dtype and out.shape == target
    exact(got, np.broadcast_to(rounded(x, dtype), target), dtype)


# -- group 3: rand ----------------------------------------------------------------------------------


def philox_reference(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """Philox4x32-10 from the paper (Salmon et al., SC'11), one counter, on Python ints."""
    c, (k0, k1), m = list(counter), key, 0xFFFFFFFF
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & m, (p0 >> 32) ^ c[3] ^ k1, p0 & m]
    return tuple(c)


def rand_reference(n: int, seed: int) -> Array:
    """docs/ops.md's rule: element i is word i % 4 of the block i // 4, its top 24 bits / 2**24."""
    out = []
    for i in range(n):
        q = i // 4
        word = philox_reference((q & 0xFFFFFFFF, q >> 32, 0, 0), (seed & 0xFFFFFFFF, 0))[i % 4]
        out.append((word >> 8) / 2.0**24)
    return np.array(out)


def test_the_philox_reference_passes_random123s_known_answers() -> None:
    kat = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
           ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
           ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in kat:
        assert philox_reference(counter, key) == want


def run_rand(shape: tuple[int, ...], seed: int, dtype: tt.DataType = I32, seed_shape: tuple[int, ...] = (1, 1)) -> Array:
    b = tt.ProgramBuilder("rand")
    out = b.rand(shape, b.input(seed_shape, tile(dtype)))
    assert out.dtype is F32 and out.shape == shape
    b.output(out)
    seed_array = np.array(seed, np.int64).astype(dtype.host_dtype).reshape(seed_shape)
    (got,) = run_on_host(b.build(), [seed_array])
    assert got.dtype == np.float32
    return np.asarray(got)


@given(shapes(1, 3), st.integers(-(2**31), 2**31 - 1))
def test_rand_is_philox_of_the_seed_and_the_index(shape: tuple[int, ...], seed: int) -> None:
    got = run_rand(shape, seed)
    np.testing.assert_array_equal(got.ravel().astype(np.float64), rand_reference(got.size, seed))
    again = run_rand(shape, seed)
    np.testing.assert_array_equal(got, again)  # the same seed, the same numbers
    # An INT32 seed is its bits: -1 is UINT32's 2**32 - 1; (1,) seeds as (1, 1) ones.
    np.testing.assert_array_equal(run_rand(shape, seed & 0xFFFFFFFF, U32, (1,)), got)


def test_rand_of_another_shape_is_a_prefix_and_other_seeds_differ() -> None:
    a = run_rand((7, 9), 42)
    np.testing.assert_array_equal(run_rand((63,), 42), a.ravel())  # element i depends on i only
    others = [run_rand((7, 9), s) for s in (43, 0, -42, 2**31 - 1)]
    for o in others:
        assert np.mean(o == a) < 0.05


def test_rand_is_uniform_on_a_large_sample() -> None:
    n = 1 << 18
    x = run_rand((512, 512), 1234).astype(np.float64).ravel()
    assert x.min() >= 0.0 and x.max() < 1.0
    sigma_mean = math.sqrt(1 / 12 / n)
    assert abs(x.mean() - 0.5) < 5 * sigma_mean
    assert abs(x.var() - 1 / 12) < 5 * math.sqrt(1 / 180 / n)  # the variance of U(0,1)'s squares
    counts = np.bincount((x * 64).astype(np.int64), minlength=64)  # chi-square, 63 dof
    chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum()
    assert chi2 < 63 + 6 * math.sqrt(2 * 63)
    pairs = x[: n // 2 * 2].reshape(-1, 2)  # neighbours are uncorrelated
    assert abs(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]) < 5 / math.sqrt(n / 2)
    assert np.unique(x).size > n * 0.99  # 24 bits: few repeats


# -- group 4: gather, embedding_grad ----------------------------------------------------------------


def ref_gather(x: Array, index: Array, axis: int) -> Array:
    """torch.gather's definition by loops over the index, indices clamped into range."""
    out = np.zeros(index.shape, x.dtype)
    for pos in np.ndindex(*index.shape):
        src = list(pos)
        src[axis] = min(max(int(index[pos]), 0), x.shape[axis] - 1)
        src = [0 if x.shape[d] == 1 and d != axis else p for d, p in enumerate(src)]  # numpy's broadcast
        out[pos] = x[tuple(src)]
    return out


@given(shapes(1, 3), st.sampled_from([F32, BF16, BF8, I32]), st.sampled_from([I32, U32]), seeds, st.data())
def test_gather_takes_along_an_axis(shape: tuple[int, ...], dtype: tt.DataType, idtype: tt.DataType, seed: int,
                                    data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), label="axis")
    a = axis % len(shape)
    ishape = tuple(data.draw(st.integers(1, 6), label="index length") if d == a
                   else data.draw(st.sampled_from(sorted({1, n, max(1, n - 1)} | ({3} if n == 1 else set()))),
                                  label="index dim")
                   for d, n in enumerate(shape))
    x = make(rng, shape, dtype)
    n = shape[a]
    index = rng.integers(-2 if idtype is I32 else 0, n + 2, ishape).astype(idtype.host_dtype)
    out, got = host(lambda b, v, i: b.gather(v, i, axis), (x, dtype), (index, idtype))
    assert out.dtype is dtype and out.shape == ishape
    rx = rounded(x, dtype)
    want = ref_gather(rx, index.astype(np.int64), a)
    exact(got, want, dtype)
    if all(i == m or m == 1 for d, (i, m) in enumerate(zip(ishape, shape)) if d != a):  # numpy's own
        np.testing.assert_array_equal(want, np.take_along_axis(rx, np.clip(index.astype(np.int64), 0, n - 1), a))
    if dtype is F32 and all(i <= m for i, m in zip(ishape, shape)):
        torch = torch_module()
        t = torch.gather(torch.from_numpy(rx), a, torch.from_numpy(np.clip(index.astype(np.int64), 0, n - 1)))
        np.testing.assert_array_equal(got, t.numpy())


def ref_embedding_grad(ids: Array, grad: Array, rows: int, padding_idx: int | None) -> Array:
    out = np.zeros((rows, grad.shape[-1]))
    for pos in np.ndindex(*ids.shape):
        r = min(max(int(ids[pos]), 0), rows - 1)
        if r != padding_idx:
            out[r] += grad[pos]
    return out


@given(st.sampled_from([I32, U32]), float_dtypes, shapes(1, 2), st.integers(1, 12), st.sampled_from([1, 5, 33]),
       st.none() | st.integers(-3, 2), seeds)
def test_embedding_grad_sums_rows_into_their_ids(idtype: tt.DataType, dtype: tt.DataType, ishape: tuple[int, ...],
                                                 rows: int, d: int, padding_idx: int | None, seed: int) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.integers(-2 if idtype is I32 else 0, rows + 2, ishape).astype(idtype.host_dtype)
    grad = make(rng, ishape + (d,), dtype)
    if padding_idx is not None and not -rows <= padding_idx < rows:
        b = tt.ProgramBuilder("bad")
        with pytest.raises(tt.ShapeError, match="padding_idx .* out of range"):
            b.embedding_grad(b.input(ishape, tile(idtype)), b.input(grad.shape), rows, padding_idx)
        return
    out, got = host(lambda b, i, g: b.embedding_grad(i, g, rows, padding_idx), (ids, idtype), (grad, dtype))
    assert out.dtype is dtype and out.shape == (rows, d)
    pad = None if padding_idx is None else padding_idx % rows
    rg = rounded(grad, dtype)
    want = ref_embedding_grad(ids, rg, rows, pad)
    check(got, want, dtype, rtol=1e-5, atol=1e-5 * math.prod(ishape))
    if dtype is F32:  # PyTorch autograd of F.embedding (ids in range, as PyTorch needs them)
        torch = torch_module()
        table = torch.zeros((rows, d), dtype=torch.float64, requires_grad=True)
        clamped = torch.from_numpy(np.clip(ids.astype(np.int64), 0, rows - 1))
        torch.nn.functional.embedding(clamped, table, padding_idx=pad).backward(torch.from_numpy(rg))
        np.testing.assert_allclose(want, table.grad.numpy(), rtol=1e-12, atol=1e-12)


# -- group 5: the gradients of conv2d and the pools (against PyTorch autograd on NCHW) ------------------


def nchw(a: Array) -> Any:
    torch = torch_module()
    return torch.from_numpy(np.ascontiguousarray(a, np.float64)).permute(0, 3, 1, 2)


def nhwc(t: Any) -> Array:
    return t.permute(0, 2, 3, 1).numpy()


def torch_conv_grads(x: Array, w: Array, gy: Array, **kwargs: Any) -> tuple[Array, Array]:
    """PyTorch autograd of F.conv2d in float64: (d/dx NHWC, d/dweight)."""
    torch = torch_module()
    tx = nchw(x).clone().requires_grad_(True)
    tw = torch.from_numpy(w.astype(np.float64)).requires_grad_(True)
    torch.nn.functional.conv2d(tx, tw, **kwargs).backward(nchw(gy))
    return nhwc(tx.grad), tw.grad.numpy()


conv_grad_cases = st.fixed_dictionaries({
    "n": st.integers(1, 2), "h": st.integers(1, 9), "w": st.sampled_from([1, 4, 7, 10]),
    "groups": st.integers(1, 3), "cig": st.integers(1, 3), "cog": st.integers(1, 3),
    "k": st.tuples(st.integers(1, 3), st.integers(1, 3)), "stride": st.tuples(st.integers(1, 3), st.integers(1, 2)),
    "padding": st.tuples(st.integers(0, 2), st.integers(0, 1)), "dilation": st.tuples(st.integers(1, 2), st.integers(1, 2)),
    "dtypes": st.tuples(float_dtypes, float_dtypes), "seed": seeds,
})


@given(conv_grad_cases)
def test_conv2d_gradients_are_pytorch_autograds(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    g, (da, db) = c["groups"], c["dtypes"]
    kwargs = {"stride": c["stride"], "padding": c["padding"], "dilation": c["dilation"], "groups": g}
    span = [(k - 1) * d + 1 for k, d in zip(c["k"], c["dilation"])]
    if c["h"] + 2 * c["padding"][0] < span[0] or c["w"] + 2 * c["padding"][1] < span[1]:
        return  # conv2d refuses it (test_ops_model); so do its gradients (bad_calls)
    x = make(rng, (c["n"], c["h"], c["w"], g * c["cig"]), da, 1.0)
    w = make(rng, (g * c["cog"], c["cig"], *c["k"]), db, 1.0)
    ho = (c["h"] + 2 * c["padding"][0] - span[0]) // c["stride"][0] + 1
    wo = (c["w"] + 2 * c["padding"][1] - span[1]) // c["stride"][1] + 1
    gy = make(rng, (c["n"], ho, wo, g * c["cog"]), da, 1.0)
    dx_out, dx = host(lambda b, gv, wv: b.conv2d_input_grad(gv, wv, x.shape, **kwargs), (gy, da), (w, db))
    dw_out, dw = host(lambda b, xv, gv: b.conv2d_weight_grad(xv, gv, w.shape, **kwargs), (x, da), (gy, da))
    want_dx, want_dw = torch_conv_grads(rounded(x, da), rounded(w, db), rounded(gy, da), **kwargs)
    wide = max((da, db), key=WIDTH.__getitem__)
    assert dx_out.dtype is wide and dx_out.shape == x.shape and dw_out.dtype is da and dw_out.shape == w.shape
    taps = c["cog"] * c["k"][0] * c["k"][1]
    check(dx, want_dx, wide, rtol=1e-5, atol=1e-6 * taps)
    check(dw, want_dw, da, rtol=1e-5, atol=1e-6 * c["n"] * ho * wo)


def test_conv2d_input_grad_takes_the_input_size_a_stride_leaves_open() -> None:
    # H = 6 and H = 7 both give H_out = 3 with kernel 2 and stride 2: the last row of 7 gets 0.
    rng = np.random.default_rng(1)
    w, gy = make(rng, (4, 3, 2, 2), F32), make(rng, (1, 3, 3, 4), F32)
    for h in (6, 7):
        _, dx = host(lambda b, gv, wv: b.conv2d_input_grad(gv, wv, (1, h, h, 3), stride=2), (gy, F32), (w, F32))
        want, _ = torch_conv_grads(np.zeros((1, h, h, 3)), rounded(w, F32), rounded(gy, F32), stride=2)
        check(dx, want, F32, rtol=1e-6, atol=1e-6)
    assert not dx[:, 6].any() and not dx[:, :, 6].any()


def test_conv2d_gradients_against_pytorch_at_a_realistic_size() -> None:
    rng = np.random.default_rng(7)
    kwargs = {"stride": (2, 1), "padding": 1, "dilation": (1, 2), "groups": 2}
    x, w = make(rng, (2, 33, 40, 8), F32, 1.0), make(rng, (16, 4, 3, 3), F32, 0.3)
    gy = make(rng, (2, 17, 38, 16), F32, 1.0)
    _, dx = host(lambda b, gv, wv: b.conv2d_input_grad(gv, wv, x.shape, **kwargs), (gy, F32), (w, F32))
    _, dw = host(lambda b, xv, gv: b.conv2d_weight_grad(xv, gv, w.shape, **kwargs), (x, F32), (gy, F32))
    want_dx, want_dw = torch_conv_grads(x, w, gy, **kwargs)
    check(dx, want_dx, F32, rtol=1e-5, atol=1e-5)
    check(dw, want_dw, F32, rtol=1e-5, atol=1e-3)  # sums of 2 * 17 * 38 products


pool_grad_cases = st.fixed_dictionaries({
    "shape": st.tuples(st.integers(1, 2), st.integers(1, 9), st.sampled_from([1, 5, 8]), st.sampled_from([1, 3, 33])),
    "k": st.tuples(st.integers(1, 4), st.integers(1, 3)), "stride": st.none() | st.tuples(st.integers(1, 3), st.integers(1, 3)),
    "pad": st.tuples(st.integers(0, 2), st.integers(0, 1)), "dtype": float_dtypes, "seed": seeds,
    "ties": st.booleans(), "nan": st.booleans(), "count_include_pad": st.booleans(),
})


def pool_fits(c: dict[str, Any]) -> bool:
    k, pad, shape = c["k"], c["pad"], c["shape"]
    return (pad[0] <= k[0] // 2 and pad[1] <= k[1] // 2
            and shape[1] + 2 * pad[0] >= k[0] and shape[2] + 2 * pad[1] >= k[1])


@given(pool_grad_cases)
def test_max_pool2d_backward_is_pytorchs(c: dict[str, Any]) -> None:
    if not pool_fits(c):
        return  # refused as max_pool2d refuses it (bad_calls, test_ops_model)
    torch = torch_module()
    rng = np.random.default_rng(c["seed"])
    dtype, k, s, pad = c["dtype"], c["k"], c["stride"], c["pad"]
    x = make(rng, c["shape"], dtype)
    if c["ties"]:  # few distinct values: ties in most windows (PyTorch takes the first)
        x = rng.integers(-2, 2, c["shape"]).astype(np.float32)
    if c["nan"] and dtype is not BF8:  # a NaN wins its window (the last one, as PyTorch's scan)
        x[rng.random(x.shape) < 0.1] = np.nan
        x[rng.random(x.shape) < 0.1] = -np.inf
    rx = rounded(x, dtype)
    tx = nchw(rx).clone().requires_grad_(True)
    y = torch.nn.functional.max_pool2d(tx, k, s, pad)
    gy = make(rng, nhwc(y.detach()).shape, dtype)
    y.backward(nchw(rounded(gy, dtype)))
    out, got = host(lambda b, xv, gv: b.max_pool2d_backward(xv, gv, k, s, pad), (x, dtype), (gy, dtype))
    assert out.dtype is dtype and out.shape == x.shape
    check(got, nhwc(tx.grad), dtype, rtol=1e-6, atol=1e-6)


@given(pool_grad_cases)
def test_avg_pool2d_backward_is_pytorchs(c: dict[str, Any]) -> None:
    if not pool_fits(c):
        return
    torch = torch_module()
    rng = np.random.default_rng(c["seed"])
    dtype, k, s, pad, cip = c["dtype"], c["k"], c["stride"], c["pad"], c["count_include_pad"]
    x = make(rng, c["shape"], dtype)
    tx = nchw(rounded(x, dtype)).clone().requires_grad_(True)
    y = torch.nn.functional.avg_pool2d(tx, k, s, pad, count_include_pad=cip)
    gy = make(rng, nhwc(y.detach()).shape, dtype)
    y.backward(nchw(rounded(gy, dtype)))
    out, got = host(lambda b, gv: b.avg_pool2d_backward(gv, x.shape, k, s, pad, count_include_pad=cip), (gy, dtype))
    assert out.dtype is dtype and out.shape == x.shape
    check(got, nhwc(tx.grad), dtype, rtol=1e-6, atol=1e-6)


def test_pool_backwards_sum_as_pytorch_does_in_float32() -> None:
    # Overlapping windows: each pixel sums its windows in row-major order, as PyTorch's loop.
    torch = torch_module()
    rng = np.random.default_rng(3)
    x = rng.integers(-2, 2, (2, 9, 8, 3)).astype(np.float32)  # ties
    tx = torch.from_numpy(x).permute(0, 3, 1, 2).clone().requires_grad_(True)
    y = torch.nn.functional.max_pool2d(tx, 3, 1, 1)
    gy = rng.standard_normal(tuple(y.permute(0, 2, 3, 1).shape)).astype(np.float32)
    y.backward(torch.from_numpy(gy).permute(0, 3, 1, 2))
    _, got = host(lambda b, xv, gv: b.max_pool2d_backward(xv, gv, 3, 1, 1), (x, F32), (gy, F32))
    np.testing.assert_array_equal(got, tx.grad.permute(0, 2, 3, 1).numpy())
    for cip in (True, False):
        tx = torch.from_numpy(x).permute(0, 3, 1, 2).clone().requires_grad_(True)
        torch.nn.functional.avg_pool2d(tx, 3, 1, 1, count_include_pad=cip).backward(torch.from_numpy(gy).permute(0, 3, 1, 2))
        _, got = host(lambda b, gv: b.avg_pool2d_backward(gv, x.shape, 3, 1, 1, cip), (gy, F32))
        np.testing.assert_array_equal(got, tx.grad.permute(0, 2, 3, 1).numpy())


def test_max_pool2d_backward_of_integer_x() -> None:
    x = np.array([[1, 5], [5, 2]], np.int32).reshape(1, 2, 2, 1)  # a tie: the first 5 wins
    gy = np.array([3.0], np.float32).reshape(1, 1, 1, 1)
    out, got = host(lambda b, xv, gv: b.max_pool2d_backward(xv, gv, 2), (x, I32), (gy, F32))
    assert out.dtype is F32
    np.testing.assert_array_equal(got.reshape(2, 2), [[0, 3], [0, 0]])


# -- build-time errors ---------------------------------------------------------------------------


def bad_calls() -> list[tuple[str, type[Exception], str, Callable[..., Any]]]:
    """(id, error, message pattern, call(b, x, i, t, like)): x (4, 5) FLOAT32, i (3,) INT32,
    t (1, 6, 6, 4) FLOAT32, like(shape) another FLOAT32 input."""
    return [
        ("div int", tt.LayoutError, r"div needs float operands, got INT32 and INT32", lambda b, x, i, t, like: b.div(i, i)),
        ("div int scalar", tt.LayoutError, r"div needs float operands, got INT32", lambda b, x, i, t, like: b.div(i, 0.5)),
        ("div mixed", tt.LayoutError, r"div needs float operands, got FLOAT32 and INT32", lambda b, x, i, t, like: b.div(x, i)),
        ("div shapes", tt.ShapeError, r"div: shapes \(4, 5\) and \(3,\) do not broadcast",
         lambda b, x, i, t, like: b.div(x, like((3,)))),
        ("div nan", tt.ProgramError, r"div: a NaN operand", lambda b, x, i, t, like: b.div(x, math.nan)),
        ("div bool", tt.ProgramError, r"div: a boolean operand", lambda b, x, i, t, like: b.div(x, True)),
        ("div not a value", tt.ProgramError, r"div: expected a Value", lambda b, x, i, t, like: b.div(x, "2")),
        ("log int", tt.LayoutError, r"log needs a float", lambda b, x, i, t, like: b.log(i)),
        ("erf int", tt.LayoutError, r"erf needs a float", lambda b, x, i, t, like: b.erf(i)),
        ("full shape", tt.ShapeError, r"shape", lambda b, x, i, t, like: b.full((2, 0), 1.0)),
        ("full value", tt.ProgramError, r"full: value must be a number", lambda b, x, i, t, like: b.full((2,), "1")),
        ("full bool", tt.ProgramError, r"full: value must be a number", lambda b, x, i, t, like: b.full((2,), True)),
        ("full dtype", tt.LayoutError, r"full: dtype must be a tt.DataType", lambda b, x, i, t, like: b.full((2,), 1, "f")),
        ("full int", tt.LayoutError, r"full: INT32 takes an integral value", lambda b, x, i, t, like: b.full((2,), 0.5, I32)),
        ("full range", tt.LayoutError, r"full: -1 does not fit UINT32", lambda b, x, i, t, like: b.full((2,), -1, U32)),
        ("full bf8 inf", tt.LayoutError, r"full: BFLOAT8_B cannot hold -inf", lambda b, x, i, t, like: b.full((2,), -math.inf, BF8)),
        ("broadcast_to", tt.ShapeError, r"broadcast_to: \(4, 5\) does not broadcast to \(4, 3\)",
         lambda b, x, i, t, like: b.broadcast_to(x, (4, 3))),
        ("rand float seed", tt.LayoutError, r"rand: the seed must be INT32 or UINT32, got FLOAT32",
         lambda b, x, i, t, like: b.rand((2, 3), like((1,)))),
        ("rand seed shape", tt.ShapeError, r"rand: the seed must have one element .*got \(3,\)",
         lambda b, x, i, t, like: b.rand((2, 3), i)),
        ("rand shape", tt.ShapeError, r"shape", lambda b, x, i, t, like: b.rand(5, b.slice(i, [0], [1]))),
        ("rand not a value", tt.ProgramError, r"rand: expected a Value", lambda b, x, i, t, like: b.rand((2,), 3)),
        ("gather float index", tt.LayoutError, r"gather: the index must be INT32 or UINT32, got FLOAT32",
         lambda b, x, i, t, like: b.gather(x, x, 0)),
        ("gather rank", tt.ShapeError, r"gather along axis 0: index \(3,\) must have the rank of x \(4, 5\)",
         lambda b, x, i, t, like: b.gather(x, i, 0)),
        ("gather longer", tt.ShapeError, r"gather along axis 0: index \(2, 6\)",
         lambda b, x, i, t, like: b.gather(x, b.reshape(b.concat([i, i, i, i], 0), (2, 6)), 0)),
        ("gather axis", tt.ShapeError, r"gather: axis 2 is out of range", lambda b, x, i, t, like: b.gather(x, i, 2)),
        ("embedding_grad ids", tt.LayoutError, r"embedding_grad: ids must be INT32 or UINT32",
         lambda b, x, i, t, like: b.embedding_grad(x, x, 3)),
        ("embedding_grad shape", tt.ShapeError, r"embedding_grad: grad \(4, 5\) must be ids.shape \+ \(D,\), ids \(3,\)",
         lambda b, x, i, t, like: b.embedding_grad(i, x, 3)),
        ("embedding_grad rows", tt.ShapeError, r"embedding_grad: num_rows must be at least 1",
         lambda b, x, i, t, like: b.embedding_grad(i, like((3, 4)), 0)),
        ("embedding_grad rows float", tt.ShapeError, r"embedding_grad: num_rows must be an integer",
         lambda b, x, i, t, like: b.embedding_grad(i, like((3, 4)), 2.0)),
        ("embedding_grad int", tt.LayoutError, r"embedding_grad needs a float",
         lambda b, x, i, t, like: b.embedding_grad(i, b.typecast(like((3, 4)), I32), 5)),
        ("embedding_grad padding", tt.ShapeError, r"padding_idx 5 is out of range for 5 rows",
         lambda b, x, i, t, like: b.embedding_grad(i, like((3, 4)), 5, 5)),
        ("conv input grad shape", tt.ShapeError, r"conv2d_input_grad: grad \(1, 6, 6, 4\) is not conv2d's output shape \(1, 4, 4, 2\)",
         lambda b, x, i, t, like: b.conv2d_input_grad(t, like((2, 4, 3, 3)), (1, 6, 6, 4))),
        ("conv input grad rank", tt.ShapeError, r"conv2d_input_grad takes grad",
         lambda b, x, i, t, like: b.conv2d_input_grad(x, like((2, 4, 3, 3)), (1, 6, 6, 4))),
        ("conv input grad groups", tt.ShapeError, r"conv2d_input_grad: .* do not fit groups=3",
         lambda b, x, i, t, like: b.conv2d_input_grad(t, like((2, 4, 3, 3)), (1, 6, 6, 4), groups=3)),
        ("conv input grad kernel", tt.ShapeError, r"conv2d_input_grad: kernel \(3, 3\) with dilation \(4, 4\) is larger",
         lambda b, x, i, t, like: b.conv2d_input_grad(t, like((2, 4, 3, 3)), (1, 6, 6, 4), dilation=4)),
        ("conv input grad input_shape", tt.ShapeError, r"shape",
         lambda b, x, i, t, like: b.conv2d_input_grad(t, like((2, 4, 3, 3)), (1, 6, 0, 4))),
        ("conv input grad int", tt.LayoutError, r"conv2d_input_grad: cannot mix FLOAT32 and INT32",
         lambda b, x, i, t, like: b.conv2d_input_grad(like((1, 4, 4, 2)), b.typecast(like((2, 4, 3, 3)), I32), (1, 6, 6, 4))),
        ("conv weight grad shape", tt.ShapeError, r"conv2d_weight_grad: grad \(1, 4, 4, 2\) is not conv2d's output shape \(1, 2, 2, 2\)",
         lambda b, x, i, t, like: b.conv2d_weight_grad(t, like((1, 4, 4, 2)), (2, 4, 3, 3), stride=2)),
        ("conv weight grad weight_shape", tt.ShapeError, r"conv2d_weight_grad takes x",
         lambda b, x, i, t, like: b.conv2d_weight_grad(t, like((1, 4, 4, 2)), (2, 4, 3))),
        ("conv weight grad stride", tt.ShapeError, r"conv2d_weight_grad: stride must be at least 1",
         lambda b, x, i, t, like: b.conv2d_weight_grad(t, like((1, 4, 4, 2)), (2, 4, 3, 3), stride=0)),
        ("max pool backward grad", tt.ShapeError, r"max_pool2d_backward: grad \(1, 4, 4, 2\) is not the pool's output shape \(1, 3, 3, 4\)",
         lambda b, x, i, t, like: b.max_pool2d_backward(t, like((1, 4, 4, 2)), 2)),
        ("max pool backward padding", tt.ShapeError, r"max_pool2d_backward: padding \(2, 2\) is more than half",
         lambda b, x, i, t, like: b.max_pool2d_backward(t, t, 3, 1, 2)),
        ("max pool backward rank", tt.ShapeError, r"max_pool2d_backward takes x in NHWC",
         lambda b, x, i, t, like: b.max_pool2d_backward(x, x, 2)),
        ("avg pool backward grad", tt.ShapeError, r"avg_pool2d_backward: grad \(1, 6, 6, 4\) is not the pool's output shape \(1, 3, 3, 4\)",
         lambda b, x, i, t, like: b.avg_pool2d_backward(t, (1, 6, 6, 4), 2)),
        ("avg pool backward kernel", tt.ShapeError, r"avg_pool2d_backward: kernel \(7, 7\) is larger",
         lambda b, x, i, t, like: b.avg_pool2d_backward(t, (1, 6, 6, 4), 7)),
        ("avg pool backward rank", tt.ShapeError, r"avg_pool2d_backward takes input_shape in NHWC",
         lambda b, x, i, t, like: b.avg_pool2d_backward(t, (6, 6, 4), 2)),
        ("avg pool backward int", tt.LayoutError, r"avg_pool2d_backward needs a float",
         lambda b, x, i, t, like: b.avg_pool2d_backward(b.typecast(t, I32), (1, 12, 12, 4), 2)),
        ("avg pool backward flag", tt.ProgramError, r"count_include_pad must be a bool",
         lambda b, x, i, t, like: b.avg_pool2d_backward(t, (1, 12, 12, 4), 2, count_include_pad=1)),
        ("broadcast_to rank", tt.ShapeError, r"broadcast_to: \(4, 5\) does not broadcast to \(5,\)",
         lambda b, x, i, t, like: b.broadcast_to(x, (5,))),
    ]


@pytest.mark.parametrize("case", bad_calls(), ids=lambda c: c[0])
def test_bad_input_fails_at_build_time(case: tuple[str, type[Exception], str, Callable[..., Any]]) -> None:
    _, error, pattern, call = case
    b = tt.ProgramBuilder("bad")
    x, i, t = b.input((4, 5)), b.input((3,), tile(I32)), b.input((1, 6, 6, 4))
    like = {s: b.input(s) for s in ((3,), (1,), (3, 4), (2, 4, 3, 3), (1, 4, 4, 2))}
    with pytest.raises(error, match=pattern):
        call(b, x, i, t, like.__getitem__)


# -- one program of every new op: binary round trip, host and device ------------------------------------


def every_new_op(dtype: tt.DataType) -> tuple[tt.Program, list[Array], list[Callable[[list[Array]], tuple[Array, str]]]]:
    """A program using every op of version 3 on `dtype` inputs, its inputs, and for each output
    a reference on the rounded inputs: (expected, "exact" or "close")."""
    rng = np.random.default_rng(5)
    b = tt.ProgramBuilder(f"every new op {dtype.name}")
    specs = [((2, 5, 33), dtype), ((5, 33), dtype), ((1, 1), I32), ((2, 3, 33), I32), ((4, 3), U32),
             ((1, 7, 9, 4), dtype), ((6, 2, 3, 3), dtype), ((1, 4, 5, 6), dtype), ((1, 4, 5, 4), dtype)]
    arrays = [make(rng, s, d) for s, d in specs]
    arrays[1] = np.abs(arrays[1]) + np.float32(0.5)  # a divisor and a log argument
    arrays[2] = np.array([[-7]], np.int32)
    arrays[3] = rng.integers(-1, 7, (2, 3, 33)).astype(np.int32)  # along axis 1 of x: 0..4, some clamped
    arrays[4] = np.array([[0, 2, 2], [9, 1, 0], [3, 3, 3], [1, 0, 2]], np.uint32)
    x, pos, seed, index, ids, img, w, gconv, gpool = (b.input(s, tile(d)) for s, d in specs)
    R = Callable[[list[Array]], tuple[Array, str]]
    refs: list[R] = []

    def out(value: Value, ref: R) -> None:
        b.output(value)
        refs.append(ref)

    out(b.div(x, pos), lambda r: (r[0] / r[1], "close"))
    out(b.div(x, 3.0), lambda r: (r[0] / 3.0, "close"))
    out(b.log(pos), lambda r: (np.log(r[1]), "close"))
    out(b.erf(x), lambda r: (UNARY3["erf"](r[0]), "close"))
    out(b.abs(x), lambda r: (np.abs(r[0]), "exact"))
    out(b.full((3, 33), -math.inf, F32), lambda r: (np.full((3, 33), -np.inf), "exact"))
    out(b.full((2, 2), 7, I32), lambda r: (np.full((2, 2), 7), "exact"))
    out(b.add(b.broadcast_to(pos, (2, 5, 33)), x), lambda r: (r[1] + r[0], "close"))
    out(b.rand((3, 40), seed), lambda r: (rand_reference(120, -7).reshape(3, 40), "exact"))
    out(b.gather(x, index, 1), lambda r: (ref_gather(r[0], r[3], 1), "exact"))
    rows = b.broadcast_to(b.slice(x, [0, 0], [1, 3]), (4, 3, 33))  # ids.shape + (D,)
    out(b.embedding_grad(ids, rows, 6, padding_idx=-1),
        lambda r: (ref_embedding_grad(r[4], np.broadcast_to(r[0][:1, :3], (4, 3, 33)), 6, 5), "close"))
    conv = {"stride": 2, "padding": 1, "groups": 2}
    out(b.conv2d_input_grad(gconv, w, (1, 7, 9, 4), **conv),
        lambda r: (torch_conv_grads(np.zeros((1, 7, 9, 4)), r[6], r[7], **conv)[0], "close"))
    out(b.conv2d_weight_grad(img, gconv, (6, 2, 3, 3), **conv),
        lambda r: (torch_conv_grads(r[5], np.zeros((6, 2, 3, 3)), r[7], **conv)[1], "close"))
    out(b.max_pool2d_backward(img, gpool, 3, 2, 1), lambda r: (torch_pool_grad("max", r[5], r[8], 3, 2, 1), "close"))
    out(b.avg_pool2d_backward(gpool, (1, 7, 9, 4), 3, 2, 1, count_include_pad=False),
        lambda r: (torch_pool_grad("avg", r[5], r[8], 3, 2, 1, count_include_pad=False), "close"))
    return b.build(), arrays, refs


def torch_pool_grad(kind: str, x: Array, gy: Array, *args: Any, **kwargs: Any) -> Array:
    torch = torch_module()
    tx = nchw(x).clone().requires_grad_(True)
    getattr(torch.nn.functional, f"{kind}_pool2d")(tx, *args, **kwargs).backward(nchw(gy))
    return nhwc(tx.grad)




# -- format version 4: sin, cos, floor, ceil, round, trunc ----------------------------------------

UNARY4: dict[str, Callable[[Array], Array]] = {  # float64 references, then rounded by `check`
    "sin": np.sin, "cos": np.cos, "floor": np.floor, "ceil": np.ceil, "round": np.round, "trunc": np.trunc,
}


@given(st.sampled_from(sorted(UNARY4)), shapes(1, 3), float_dtypes, seeds)
def test_unary_float_ops_of_version_4(op: str, shape: tuple[int, ...], dtype: tt.DataType, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = make(rng, shape, dtype, scale=20.0)
    out, got = host(lambda b, v: getattr(b, op)(v), (x, dtype))
    assert out.dtype is dtype
    want = UNARY4[op](rounded(x, dtype).astype(np.float64))
    if op in ("sin", "cos"):
        check(got, want, dtype, rtol=4e-7 if dtype is F32 else 8e-3, atol=2e-7 if dtype is F32 else 8e-3)
    else:
        exact(got, want, dtype)


def test_rounding_edge_values() -> None:
    x = np.array([2.5, -2.5, 0.5, -0.5, 1.5, -0.0, 1e30, np.inf, -np.inf, np.nan, 2.7, -2.7], np.float32)
    _, rd = host(lambda b, v: b.round(v), (x, F32))
    _, fl = host(lambda b, v: b.floor(v), (x, F32))
    _, tr = host(lambda b, v: b.trunc(v), (x, F32))
    np.testing.assert_array_equal(rd, np.array([2.0, -2.0, 0.0, -0.0, 2.0, -0.0, 1e30, np.inf, -np.inf, np.nan, 3.0, -3.0], np.float32))
    np.testing.assert_array_equal(fl[[0, 1, 10, 11]], [2.0, -3.0, 2.0, -3.0])
    np.testing.assert_array_equal(tr[[0, 1, 10, 11]], [2.0, -2.0, 2.0, -2.0])
    assert np.signbit(rd[3]) and np.signbit(rd[5])
    torch = torch_module()
    for op, got in (("round", rd), ("floor", fl), ("trunc", tr)):
        np.testing.assert_array_equal(got, getattr(torch, op)(torch.from_numpy(x)).numpy())


def test_version_4_ops_refuse_integers() -> None:
    b = tt.ProgramBuilder("p")
    x = b.input((2, 3), tile(I32))
    for op in UNARY4:
        with pytest.raises(tt.LayoutError):
            getattr(b, op)(x)


def every_version_4_op(dtype: tt.DataType) -> tuple[tt.Program, list[Array], list[Any]]:
    b = tt.ProgramBuilder("v4")
    rng = np.random.default_rng(4)
    x = make(rng, (3, 40), dtype, scale=20.0)
    v = b.input((3, 40), tile(dtype))
    refs: list[Any] = []
    for op, ref in UNARY4.items():
        b.output(getattr(b, op)(v))
        refs.append(lambda r, ref=ref, op=op: (ref(r[0].astype(np.float64)), "close" if op in ("sin", "cos") else "exact"))
    return b.build(), [x], refs


# -- format version 5: remainder, floor_divide, fmod, cumsum ---------------------------------------

MODULO5 = ("remainder", "floor_divide", "fmod")  # torch's names too


def as_torch(torch: Any, x: Array, dtype: tt.DataType) -> Any:
    """The values the device holds, as the torch tensor CPU torch would compute on (int64 for
    the integer types: the device's integers compute in int64)."""
    return torch.from_numpy(rounded(x, dtype).astype(np.float32 if dtype.is_float else np.int64))


@given(st.sampled_from(MODULO5), shapes(1, 3), st.sampled_from([F32, BF16, I32]), st.booleans(), seeds)
def test_modulo_ops_of_version_5_match_torch(op: str, shape: tuple[int, ...], dtype: tt.DataType,
                                              by_scalar: bool, seed: int) -> None:
    torch = torch_module()
    rng = np.random.default_rng(seed)
    a = make(rng, shape, dtype, scale=50.0)
    if dtype.is_float:
        d = make(rng, shape, dtype, scale=4.0)
        d.flat[0] = 0.0  # NaN or +-inf, as torch's
    else:  # CPU torch raises for an integer divided by 0 (the device gives 0)
        d = (rng.integers(1, 9, shape) * rng.choice([-1, 1], shape)).astype(np.int32)
    if by_scalar:
        scalar = float(d.flat[-1]) if dtype.is_float else int(d.flat[-1])
        _, got = host(lambda b, v: getattr(b, op)(v, scalar), (a, dtype))
        want = getattr(torch, op)(as_torch(torch, a, dtype), scalar)
    else:
        _, got = host(lambda b, v, w: getattr(b, op)(v, w), (a, dtype), (d, dtype))
        want = getattr(torch, op)(as_torch(torch, a, dtype), as_torch(torch, d, dtype))
    exact(got, want.numpy(), dtype)  # NaN where torch has NaN; -0.0 and 0.0 alike


@given(shapes(1, 3), st.sampled_from([F32, BF16, I32]), st.data(), seeds)
def test_cumsum_matches_torch_bit_for_bit(shape: tuple[int, ...], dtype: tt.DataType, data: st.DataObject,
                                          seed: int) -> None:
    torch = torch_module()
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), "axis")
    x = make(np.random.default_rng(seed), shape, dtype, scale=100.0)
    out, got = host(lambda b, v: b.cumsum(v, axis), (x, dtype))
    assert out.dtype is dtype and out.shape == shape
    # CPU torch sums float32 in float64 and rounds each running sum once: so must the device.
    exact(got, torch.cumsum(as_torch(torch, x, dtype), axis).numpy(), dtype)


def test_a_float32_cumsum_is_not_numpys_float32_running_sum() -> None:
    # The reason for the float64 accumulator: 1000 float32 additions drift from it.
    x = (np.random.default_rng(0).standard_normal(1000) * 100).astype(np.float32)
    _, got = host(lambda b, v: b.cumsum(v, 0), (x, F32))
    np.testing.assert_array_equal(got, np.cumsum(x.astype(np.float64)).astype(np.float32))
    assert not np.array_equal(got, np.cumsum(x))


@given(shapes(1, 3), float_dtypes, st.booleans(), seeds)
def test_atan2_is_within_an_ulp_of_torch(shape: tuple[int, ...], dtype: tt.DataType, by_scalar: bool, seed: int) -> None:
    torch = torch_module()
    rng = np.random.default_rng(seed)
    a, d = make(rng, shape, dtype, scale=5.0), make(rng, shape, dtype, scale=5.0)
    d.flat[0] = 0.0  # the axis: +-pi/2, or 0 or +-pi
    if by_scalar:
        out, got = host(lambda b, v: b.atan2(v, -1.5), (a, dtype))
        want = torch.atan2(as_torch(torch, a, dtype), torch.tensor(-1.5))
    else:
        out, got = host(lambda b, v, w: b.atan2(v, w), (a, dtype), (d, dtype))
        want = torch.atan2(as_torch(torch, a, dtype), as_torch(torch, d, dtype))
    assert out.dtype is dtype
    check(got, want.numpy().astype(np.float64), dtype, rtol=2.4e-7, atol=2e-7)


def test_atan2_refuses_integers() -> None:
    b = tt.ProgramBuilder("p")
    with pytest.raises(tt.LayoutError):
        b.atan2(b.input((2, 3), tile(I32)), 1)


@given(shapes(1, 3), st.sampled_from([F32, BF16, I32]), st.booleans(), st.data(), seeds)
def test_argsort_is_torchs_stable_sort(shape: tuple[int, ...], dtype: tt.DataType, descending: bool,
                                       data: st.DataObject, seed: int) -> None:
    torch = torch_module()
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), "axis")
    rng = np.random.default_rng(seed)
    x = make(rng, shape, dtype, scale=3.0)
    if dtype.is_float:
        x = np.round(x)  # ties, which a stable sort keeps in order
        x.flat[rng.integers(0, x.size)] = np.nan if data.draw(st.booleans(), "nan") else x.flat[0]
    out, got = host(lambda b, v: b.argsort(v, axis, descending), (x, dtype))
    assert out.dtype is I32 and out.shape == shape
    want = torch.sort(as_torch(torch, x, dtype), dim=axis, descending=descending, stable=True).indices
    np.testing.assert_array_equal(got, want.numpy())


def every_version_5_op(dtype: tt.DataType) -> tuple[tt.Program, list[Array], list[Any]]:
    b = tt.ProgramBuilder("v5")
    rng = np.random.default_rng(5)
    x, d = make(rng, (3, 40), dtype, scale=20.0), make(rng, (3, 40), dtype, scale=3.0) + np.float32(3.5)
    v, w = b.input((3, 40), tile(dtype)), b.input((3, 40), tile(dtype))
    refs: list[Any] = [
        lambda r: (np.remainder(r[0], r[1]), "exact"),
        lambda r: (np.floor_divide(r[0], 1.5), "exact"),
        lambda r: (np.fmod(r[0], r[1]), "exact"),
        lambda r: (np.cumsum(r[0], axis=1), "exact"),
        lambda r: (np.sort(r[0], axis=1), "exact"),
        lambda r: (np.arctan2(r[0], r[1]), "close"),
    ]
    b.output(b.remainder(v, w))
    b.output(b.floor_divide(v, 1.5))
    b.output(b.fmod(v, w))
    b.output(b.cumsum(v, 1))
    b.output(b.gather(v, b.argsort(v, 1), 1))
    b.output(b.atan2(v, w))
    return b.build(), [x, d], refs


BUILDS = [every_new_op, every_version_4_op, every_version_5_op]  # every op of format version 3, of 4, of 5


@pytest.mark.parametrize("build", BUILDS, ids=["v3", "v4", "v5"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_every_new_op_saves_loads_and_runs_on_the_host(tmp_path: Path, build: Any, dtype: tt.DataType) -> None:
    check_saved_and_on_host(tmp_path, *build(dtype))


@pytest.mark.anyio
@pytest.mark.parametrize("build", BUILDS, ids=["v3", "v4", "v5"])
@pytest.mark.parametrize("dtype", [F32, BF16])
async def test_every_new_op_on_the_device(build: Any, dtype: tt.DataType) -> None:
    await check_on_device(*build(dtype))


@pytest.mark.parametrize(("build", "older", "first_op"), [(every_new_op, 2, "div"), (every_version_4_op, 3, "sin"),
                                                         (every_version_5_op, 4, "remainder")],
                         ids=["v3_op_in_v2", "v4_op_in_v3", "v5_op_in_v4"])
def test_an_older_version_file_cannot_hold_a_newer_op(tmp_path: Path, build: Any, older: int, first_op: str) -> None:
    program, _, _ = build(F32)
    path = tmp_path / "p.ttb"
    tt.Binary([program]).save(path)
    raw = path.read_bytes()
    assert struct.unpack("<I", raw[8:12]) == (NEWEST,)
    path.write_bytes(raw[:8] + struct.pack("<I", older) + raw[12:])
    with pytest.raises(tt.BinaryFormatError, match=f"{first_op} is not an op of format version {older}"):
        tt.Binary.load(path)
