"""The ops of format version 2 (issue 10) against references written here, in float64 numpy (and
PyTorch's conv and pools when torch is installed), never `ttflow._ir.ops`.

Each op is checked three ways: `run_on_host` on hypothesis-drawn shapes, axes, dtypes and
edge cases (one row, widths 1, 5, 33, 40, negative indices, NaN, ties); the emulated device end
to end, once for a program holding every op; and the builder's refusals. A reference takes the
inputs as the device holds them (rounded to their dtype), so the only tolerance is the op's
float32 arithmetic and the rounding of its result to the output dtype. Ops that only move data
(slice, permute, concat, embedding, where, update_cache, max_pool2d) must match bit for bit.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ttflow as tt
from ttflow._ir.binary import _VERSION as NEWEST  # save's version: the newest of the ops' records
from ttflow._commands import Plan
from ttflow._ir.builder import Value
from ttflow._ir.interpreter import run_on_host

Array = np.ndarray[Any, Any]
F32, BF16, BF8 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B
I32, U32 = tt.DataType.INT32, tt.DataType.UINT32
FLOATS = [F32, BF16, BF8]
WIDTH = {BF8: 0, BF16: 1, F32: 2}  # the binary ops' rule: the wider float wins
DATA = Path(__file__).parent / "data"

sides = st.sampled_from([1, 2, 3, 5, 32, 33, 40])
seeds = st.integers(0, 2**32 - 1)
float_dtypes = st.sampled_from(FLOATS)


def shapes(min_rank: int = 1, max_rank: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(sides, min_size=min_rank, max_size=max_rank).map(tuple)


def tile(dtype: tt.DataType) -> tt.Layout:
    return tt.Layout(tensor_layout=tt.TensorLayout.TILE, dtype=dtype)


def rounded(x: Array, dtype: tt.DataType) -> Array:
    """`x` as the device holds it in `dtype`, as float64 (floats) or int64 (integers)."""
    if dtype is BF16:
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    if dtype is BF8:  # the kernels' packer is checked bit for bit in test_kernels_bfp8
        f = np.asarray(x, np.float32)
        return tt.kernels.unpack_bfloat8_b(tt.kernels.pack_bfloat8_b(f), f.shape).astype(np.float64)
    if dtype is F32:
        return np.asarray(x, np.float32).astype(np.float64)
    return np.asarray(x).astype(np.int64).astype(np.int32 if dtype is I32 else np.uint32).astype(np.int64)


def make(rng: np.random.Generator, shape: tuple[int, ...], dtype: tt.DataType, scale: float = 2.0) -> Array:
    """Random host data for an input of `dtype` (values the dtype can hold)."""
    if dtype is I32:
        return rng.integers(-60, 60, shape).astype(np.int32)
    if dtype is U32:
        return rng.integers(0, 120, shape).astype(np.uint32)
    return rng.uniform(-scale, scale, shape).astype(np.float32)


def host(build: Callable[..., Value], *inputs: tuple[Array, tt.DataType]) -> tuple[Value, Array]:
    """Builds `build(b, *inputs)` as a one-output program and runs it on the host."""
    b = tt.ProgramBuilder("op")
    values = [b.input(np.shape(a), tile(dtype)) for a, dtype in inputs]
    out = build(b, *values)
    b.output(out)
    (got,) = run_on_host(b.build(), [a for a, _ in inputs])
    return out, np.asarray(got)


def check(got: Array, want: Array, dtype: tt.DataType, rtol: float = 2e-6, atol: float = 1e-6) -> None:
    """`got` (a result of `dtype`) against a float64 reference: exact for integers; for floats
    within the op's float32 error plus the rounding to `dtype`."""
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    if not dtype.is_float:
        np.testing.assert_array_equal(got.astype(np.int64), want.astype(np.int64))
        return
    want = want.astype(np.float64)
    if dtype is BF16:
        rtol += 2.0**-8
    if dtype is BF8:  # each 16-value row of a face shares its largest exponent, 7-bit mantissas
        finite = np.abs(want[np.isfinite(want)])
        atol += 2.0**-5 * (finite.max() if finite.size else 0.0)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol)


def exact(got: Array, want: Array, dtype: tt.DataType) -> None:
    """For ops that only move values: the reference rounded to the output dtype, bit for bit."""
    assert got.shape == np.shape(want)
    np.testing.assert_array_equal(got.astype(np.float64), rounded(want, dtype))


# -- references (float64 numpy; only the documented semantics, written out) ------------------


def ref_first_argmax(x: Array, axis: int) -> Array:
    """numpy's argmax rule by hand: the first NaN, else the first maximum, per lane."""

    def lane(v: Array) -> int:
        nan = np.flatnonzero(np.isnan(v))
        if nan.size:
            return int(nan[0])
        best = 0
        for i in range(1, len(v)):
            if v[i] > v[best]:
                best = i
        return best

    return np.expand_dims(np.apply_along_axis(lane, axis, x), axis)


def ref_maximum(a: Array, b: Array, larger: bool) -> Array:
    pick = np.where(a > b, a, b) if larger else np.where(a < b, a, b)
    return np.where(np.isnan(a) | np.isnan(b), np.nan, pick)


def ref_sigmoid(x: Array) -> Array:
    return np.array([1.0 / (1.0 + math.exp(-v)) if v > -700 else 0.0 for v in x.ravel()]).reshape(x.shape)


def ref_layer_norm(x: Array, w: Array | None, b: Array | None, eps: float) -> Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    return y * (1.0 if w is None else w) + (0.0 if b is None else b)


def ref_rms_norm(x: Array, w: Array | None, eps: float) -> Array:
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * (1.0 if w is None else w)


def ref_conv2d_loops(x: Array, w: Array, bias: Array | None, stride: tuple[int, int],
                     padding: tuple[int, int], dilation: tuple[int, int], groups: int) -> Array:
    """NHWC conv2d by loops over output pixels and kernel taps (PyTorch's definition)."""
    n, h, wd, _ = x.shape
    c_out, c_in_g, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((n, ho, wo, c_out))
    c_out_g = c_out // groups
    for oc in range(c_out):
        g = oc // c_out_g
        for i in range(kh):
            for j in range(kw):
                for oy in range(ho):
                    y = oy * sh - ph + i * dh
                    if not 0 <= y < h:
                        continue
                    for ox in range(wo):
                        xx = ox * sw - pw + j * dw
                        if 0 <= xx < wd:
                            out[:, oy, ox, oc] += x[:, y, xx, g * c_in_g : (g + 1) * c_in_g] @ w[oc, :, i, j]
    return out + (0.0 if bias is None else bias)


def ref_pool_loops(x: Array, k: tuple[int, int], s: tuple[int, int], p: tuple[int, int], kind: str) -> Array:
    """NHWC pooling by loops: max ignores padding, avg divides by kH * kW (count_include_pad)."""
    n, h, w, c = x.shape
    ho, wo = (h + 2 * p[0] - k[0]) // s[0] + 1, (w + 2 * p[1] - k[1]) // s[1] + 1
    out = np.zeros((n, ho, wo, c))
    for oy in range(ho):
        for ox in range(wo):
            y0, x0 = oy * s[0] - p[0], ox * s[1] - p[1]
            win = x[:, max(y0, 0) : y0 + k[0], max(x0, 0) : x0 + k[1], :]
            out[:, oy, ox] = win.max(axis=(1, 2)) if kind == "max" else win.sum(axis=(1, 2)) / (k[0] * k[1])
    return out


def torch_or_none() -> Any:
    try:
        import torch
    except ImportError:  # the test extra does not install torch; the loop references still run
        return None
    return torch


# -- data movement ------------------------------------------------------------------------------


@given(shapes(1, 4), st.sampled_from([F32, BF16, BF8, I32]), seeds, st.data())
def test_slice_is_python_slicing(shape: tuple[int, ...], dtype: tt.DataType, seed: int, data: st.DataObject) -> None:
    x = make(np.random.default_rng(seed), shape, dtype)
    k = data.draw(st.integers(0, len(shape)), label="sliced axes")
    bound = [st.none() | st.integers(-n - 3, n + 3) for n in shape[:k]]
    starts = [data.draw(s, label="start") for s in bound]
    ends = [data.draw(s, label="end") for s in bound]
    steps = data.draw(st.none() | st.lists(st.integers(1, 3), min_size=k, max_size=k), label="steps")
    want = rounded(x, dtype)[tuple(slice(a, e, s) for a, e, s in zip(starts, ends, steps or [1] * k))]
    if want.size == 0:
        b = tt.ProgramBuilder("empty")
        with pytest.raises(tt.ShapeError, match="slice.*empty"):
            b.slice(b.input(shape), starts, ends, steps)
        return
    out, got = host(lambda b, v: b.slice(v, starts, ends, steps), (x, dtype))
    assert out.dtype is dtype
    exact(got, want, dtype)


@given(shapes(1, 3), st.lists(st.sampled_from(FLOATS), min_size=1, max_size=3), seeds, st.data())
def test_concat_joins_and_widens_floats(shape: tuple[int, ...], dtypes: list[tt.DataType], seed: int,
                                        data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), label="axis")
    parts = []
    for dtype in dtypes:
        s = list(shape)
        s[axis] = data.draw(sides, label="size along axis")
        parts.append((make(rng, tuple(s), dtype), dtype))
    want = np.concatenate([rounded(a, d) for a, d in parts], axis=axis)
    out, got = host(lambda b, *vs: b.concat(list(vs), axis), *parts)
    widest = max(dtypes, key=WIDTH.__getitem__)
    assert out.dtype is widest
    exact(got, want, widest)


def test_concat_of_integers_and_one_value() -> None:
    a, c = np.arange(6, dtype=np.int32).reshape(2, 3), np.full((2, 1), -7, np.int32)
    _, got = host(lambda b, x, y: b.concat((x, y), -1), (a, I32), (c, I32))
    np.testing.assert_array_equal(got, np.concatenate([a, c], -1))
    _, got = host(lambda b, x: b.concat([x], 0), (a, I32))
    np.testing.assert_array_equal(got, a)


@given(shapes(1, 4), st.sampled_from([F32, BF16, BF8, U32]), seeds, st.data())
def test_permute_is_numpy_transpose(shape: tuple[int, ...], dtype: tt.DataType, seed: int, data: st.DataObject) -> None:
    x = make(np.random.default_rng(seed), shape, dtype)
    perm = data.draw(st.permutations(range(len(shape))), label="perm")
    negative = [a - len(shape) if data.draw(st.booleans()) else a for a in perm]
    out, got = host(lambda b, v: b.permute(v, negative), (x, dtype))
    assert out.shape == tuple(shape[a] for a in perm)
    exact(got, np.transpose(rounded(x, dtype), perm), dtype)


@given(st.sampled_from([I32, U32]), st.sampled_from(FLOATS + [I32]), shapes(1, 2), st.integers(1, 40),
       st.sampled_from([1, 5, 33, 40]), seeds)
def test_embedding_gathers_rows_and_clamps_ids(id_dtype: tt.DataType, dtype: tt.DataType, id_shape: tuple[int, ...],
                                               vocab: int, dim: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    low = -3 if id_dtype is I32 else 0
    ids = rng.integers(low, vocab + 3, id_shape).astype(np.int32 if id_dtype is I32 else np.uint32)
    table = make(rng, (vocab, dim), dtype)
    out, got = host(lambda b, i, t: b.embedding(i, t), (ids, id_dtype), (table, dtype))
    assert out.dtype is dtype and got.shape == id_shape + (dim,)
    rows = np.array([min(max(int(i), 0), vocab - 1) for i in ids.ravel()]).reshape(id_shape)
    exact(got, rounded(table, dtype)[rows], dtype)


@given(shapes(1, 3), st.sampled_from(FLOATS + [I32]), seeds, st.data())
def test_argmax_takes_the_first_maximum_or_nan(shape: tuple[int, ...], dtype: tt.DataType, seed: int,
                                                data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 3, shape).astype(np.float32 if dtype.is_float else np.int32)  # many ties
    if dtype in (F32, BF16) and data.draw(st.booleans(), label="nan"):
        x[rng.random(shape) < 0.1] = np.nan
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), label="axis")
    out, got = host(lambda b, v: b.argmax(v, axis), (x, dtype))
    assert out.dtype is I32 and got.dtype == np.int32
    np.testing.assert_array_equal(got, ref_first_argmax(rounded(x, dtype), axis))


@given(st.data(), seeds)
def test_where_selects_a_where_cond_is_nonzero(data: st.DataObject, seed: int) -> None:
    rng = np.random.default_rng(seed)
    shapes3 = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=1, max_dims=3, max_side=5))
    cond_dtype = data.draw(st.sampled_from([F32, BF16, I32, U32]), label="cond dtype")
    da, db = data.draw(float_dtypes, label="a dtype"), data.draw(float_dtypes, label="b dtype")
    cond = rng.integers(0, 2, shapes3.input_shapes[0]) * rng.integers(1, 5, shapes3.input_shapes[0])
    cond = cond.astype(np.float32) * (-1 if cond_dtype is I32 else 1)
    a, c = make(rng, shapes3.input_shapes[1], da), make(rng, shapes3.input_shapes[2], db)
    scalar_a, scalar_b = data.draw(st.sampled_from([(False, False), (True, False), (False, True)]), label="scalars")
    inputs, args = [(cond, cond_dtype)], []
    for is_scalar, arr, dt in ((scalar_a, a, da), (scalar_b, c, db)):
        if is_scalar:
            args.append(-1.25)
        else:
            args.append(len(inputs))
            inputs.append((arr, dt))

    def build(b: tt.ProgramBuilder, *vs: Value) -> Value:
        return b.where(vs[0], *(vs[x] if isinstance(x, int) else x for x in args))

    out, got = host(build, *inputs)
    dtypes = [dt for s, dt in ((scalar_a, da), (scalar_b, db)) if not s]
    want_dtype = max(dtypes, key=WIDTH.__getitem__)
    assert out.dtype is want_dtype
    va = -1.25 if scalar_a else rounded(a, da)
    vb = -1.25 if scalar_b else rounded(c, db)
    want = np.where(rounded(cond, cond_dtype) != 0, va, vb)
    exact(got, want, want_dtype)  # np.where broadcasts cond and the value branches


# -- elementwise ---------------------------------------------------------------------------------

COMPARISONS = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
               "gt": np.greater, "ge": np.greater_equal}


@given(st.sampled_from(sorted(COMPARISONS)), st.sampled_from([(F32, F32), (BF16, F32), (BF8, BF16), (I32, I32), (U32, U32)]),
       st.data(), seeds)
def test_comparisons_give_one_or_zero(op: str, dtypes: tuple[tt.DataType, tt.DataType], data: st.DataObject,
                                      seed: int) -> None:
    rng = np.random.default_rng(seed)
    sa, sb = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=1, max_dims=3, max_side=5)).input_shapes
    low = 0 if dtypes[0] is U32 else -2  # small integers: many equal pairs
    a = rng.integers(low, 3, sa).astype(dtypes[0].host_dtype if not dtypes[0].is_float else np.float32)
    c = rng.integers(low, 3, sb).astype(dtypes[1].host_dtype if not dtypes[1].is_float else np.float32)
    if dtypes[0] is F32 and data.draw(st.booleans(), label="nan"):
        a[rng.random(sa) < 0.2] = np.nan
    scalar = data.draw(st.booleans(), label="scalar operand")
    ra = rounded(a, dtypes[0])
    if scalar:
        out, got = host(lambda b, x: getattr(b, op)(x, 1), (a, dtypes[0]))
        want = COMPARISONS[op](ra, 1.0)
    else:
        out, got = host(lambda b, x, y: getattr(b, op)(x, y), (a, dtypes[0]), (c, dtypes[1]))
        want = COMPARISONS[op](ra, rounded(c, dtypes[1]))
    assert out.dtype is (dtypes[0] if scalar else max(dtypes, key=lambda d: WIDTH.get(d, 0)))
    exact(got, want.astype(np.float64), out.dtype)


@given(st.sampled_from(["maximum", "minimum"]), st.sampled_from([F32, BF16, BF8, I32]), st.data(), seeds)
def test_maximum_and_minimum_propagate_nan(op: str, dtype: tt.DataType, data: st.DataObject, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sa, sb = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=1, max_dims=3, max_side=6)).input_shapes
    a, c = make(rng, sa, dtype), make(rng, sb, dtype)
    if dtype in (F32, BF16):
        a[rng.random(sa) < 0.1] = np.nan
        c[rng.random(sb) < 0.1] = np.nan
    if data.draw(st.booleans(), label="scalar"):
        out, got = host(lambda b, x: getattr(b, op)(x, 0), (a, dtype))
        want = ref_maximum(rounded(a, dtype), np.zeros(()), op == "maximum")
    else:
        out, got = host(lambda b, x, y: getattr(b, op)(x, y), (a, dtype), (c, dtype))
        want = ref_maximum(rounded(a, dtype), rounded(c, dtype), op == "maximum")
    assert out.dtype is dtype
    exact(got, want, dtype)


UNARY: dict[str, Callable[[Array], Array]] = {
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "tanh": np.tanh,
    "sigmoid": ref_sigmoid,
    "silu": lambda x: x * ref_sigmoid(x),
}


@given(st.sampled_from(sorted(UNARY)), shapes(1, 3), float_dtypes, seeds)
def test_unary_float_ops(op: str, shape: tuple[int, ...], dtype: tt.DataType, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = make(rng, shape, dtype, scale=12.0)
    if op == "rsqrt":
        x = np.abs(x) + np.float32(0.5)  # BFLOAT8_B would flush small values to 0 (rsqrt inf)
    out, got = host(lambda b, v: getattr(b, op)(v), (x, dtype))
    assert out.dtype is dtype
    check(got, UNARY[op](rounded(x, dtype)), dtype, rtol=4e-6, atol=1e-7)


def test_unary_edge_values() -> None:
    x = np.array([0.0, -0.0, 1e4, -1e4, 88.8, -88.8, 1e-30, np.inf, -np.inf, np.nan], np.float32)
    with np.errstate(all="raise"):  # the ops silence nothing of the caller's: no warning escapes
        _, sig = host(lambda b, v: b.sigmoid(v), (x, F32))
        _, silu = host(lambda b, v: b.silu(v), (x, F32))
        _, rs = host(lambda b, v: b.rsqrt(v), (x, F32))
        _, th = host(lambda b, v: b.tanh(v), (x, F32))
    np.testing.assert_array_equal(sig[[0, 2, 3, 7, 8]], [0.5, 1.0, 0.0, 1.0, 0.0])
    assert np.isnan(sig[9]) and np.isnan(silu[9]) and np.isnan(rs[9])
    np.testing.assert_array_equal(silu[[0, 2, 3]], [0.0, 1e4, -0.0])
    np.testing.assert_array_equal(rs[[0, 1, 7]], [np.inf, -np.inf, 0.0])
    np.testing.assert_array_equal(th[[2, 3, 7, 8]], [1.0, -1.0, 1.0, -1.0])
    _, neg = host(lambda b, v: b.rsqrt(v), (np.array([-1.0], np.float32), F32))
    assert np.isnan(neg).all()


@given(shapes(1, 3), float_dtypes, st.sampled_from([0, 1, 2, 3, -1, 0.5, 1.5, -2.5]), seeds)
def test_pow_with_a_scalar_exponent(shape: tuple[int, ...], dtype: tt.DataType, p: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = make(rng, shape, dtype, scale=3.0)
    if dtype is BF8:  # BFLOAT8_B has no NaN or inf to store: positive bases only
        x = np.abs(x) + np.float32(0.5)
    out, got = host(lambda b, v: b.pow(v, p), (x, dtype))
    assert out.dtype is dtype
    with np.errstate(all="ignore"):
        want = np.power(rounded(x, dtype), float(p))  # NaN for a negative base, fractional p
    assert (np.isnan(got.astype(np.float64)) == np.isnan(want)).all()
    finite = np.isfinite(want)
    check(got.astype(np.float64)[finite], want[finite], dtype, rtol=4e-6, atol=1e-6)


# -- reductions and norms --------------------------------------------------------------------------


@given(shapes(1, 3), float_dtypes, seeds, st.data())
def test_mean_keeps_the_axis(shape: tuple[int, ...], dtype: tt.DataType, seed: int, data: st.DataObject) -> None:
    x = make(np.random.default_rng(seed), shape, dtype)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), label="axis")
    out, got = host(lambda b, v: b.mean(v, axis), (x, dtype))
    assert out.dtype is dtype
    check(got, rounded(x, dtype).mean(axis=axis, keepdims=True), dtype, rtol=1e-5, atol=1e-6)


@given(shapes(1, 3), float_dtypes, float_dtypes, st.booleans(), st.booleans(),
       st.sampled_from([1e-5, 1e-3, 0.1]), seeds)
def test_layer_norm_matches_pytorch_formula(shape: tuple[int, ...], dtype: tt.DataType, wdtype: tt.DataType,
                                            with_weight: bool, with_bias: bool, eps: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = make(rng, shape, dtype) + np.float32(rng.uniform(-3, 3))  # an offset: centring matters
    d = shape[-1]
    inputs = [(x, dtype)]
    w = make(rng, (d,), wdtype) if with_weight else None
    bias = make(rng, (1, d) if len(shape) > 1 else (d,), wdtype) if with_bias else None
    inputs += [(a, wdtype) for a in (w, bias) if a is not None]

    def build(b: tt.ProgramBuilder, v: Value, *rest: Value) -> Value:
        it = iter(rest)
        return b.layer_norm(v, next(it) if with_weight else None, next(it) if with_bias else None, eps=eps)

    out, got = host(build, *inputs)
    assert out.dtype is dtype
    want = ref_layer_norm(rounded(x, dtype), None if w is None else rounded(w, wdtype),
                          None if bias is None else rounded(bias, wdtype), eps)
    check(got, want, dtype, rtol=1e-4, atol=1e-4)


@given(shapes(1, 3), float_dtypes, st.booleans(), st.sampled_from([1e-6, 1e-5, 0.5]), seeds)
def test_rms_norm_has_no_bias(shape: tuple[int, ...], dtype: tt.DataType, with_weight: bool, eps: float,
                              seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = make(rng, shape, dtype)
    w = make(rng, (shape[-1],), BF16) if with_weight else None
    inputs = [(x, dtype)] + ([(w, BF16)] if w is not None else [])
    out, got = host(lambda b, v, *r: b.rms_norm(v, r[0] if r else None, eps), *inputs)
    assert out.dtype is dtype
    check(got, ref_rms_norm(rounded(x, dtype), None if w is None else rounded(w, BF16), eps), dtype,
          rtol=1e-4, atol=1e-5)


def test_single_row_norms() -> None:
    # One element per row: layer_norm gives bias (x - mean = 0); rms_norm gives sign(x) * w.
    x = np.array([[3.0], [-2.0]], np.float32)
    _, ln = host(lambda b, v, bb: b.layer_norm(v, None, bb), (x, F32), (np.array([0.5], np.float32), F32))
    np.testing.assert_array_equal(ln, [[0.5], [0.5]])
    _, rms = host(lambda b, v: b.rms_norm(v, eps=0.0), (x, F32))
    np.testing.assert_allclose(rms, [[1.0], [-1.0]], rtol=1e-7)


# -- matmul, arange -----------------------------------------------------------------------------------


@given(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=1, max_dims=2, max_side=3),
       st.sampled_from([1, 5, 33]), st.sampled_from([1, 5, 33, 40]), st.sampled_from([1, 7, 40]),
       float_dtypes, float_dtypes, seeds)
def test_batched_matmul_broadcasts_batch_dims(batch: Any, m: int, k: int, n: int, da: tt.DataType,
                                              db: tt.DataType, seed: int) -> None:
    rng = np.random.default_rng(seed)
    sa, sb = batch.input_shapes
    a, c = make(rng, sa + (m, k), da, 1.0), make(rng, sb + (k, n), db, 1.0)
    out, got = host(lambda b, x, y: b.matmul(x, y), (a, da), (c, db))
    assert out.shape == batch.result_shape + (m, n) and 3 <= len(out.shape) <= 4
    check(got, rounded(a, da) @ rounded(c, db), out.dtype, rtol=1e-5, atol=1e-5 * math.sqrt(k))


def test_matmul_macs_count_the_broadcast_batch() -> None:
    b = tt.ProgramBuilder("macs")
    a, w = b.input((1, 5, 7)), b.input((3, 4, 7, 9))
    x, k = b.input((2, 9, 11, 6)), b.input((8, 3, 3, 2))  # groups=2: 3 input channels a group
    b.output(b.matmul(a, w))
    b.output(b.conv2d(x, k, stride=2, padding=1, groups=2))
    p = b.build()
    conv_out = (2, 5, 6, 8)
    assert Plan(p).macs == 3 * 4 * 5 * 9 * 7 + math.prod(conv_out) * 3 * 3 * 2
    assert p.values[p.outputs[1]].shape == conv_out


@given(st.sampled_from([I32, U32, F32, BF16]), st.data())
def test_arange_is_numpys(dtype: tt.DataType, data: st.DataObject) -> None:
    if dtype.is_float:
        start = data.draw(st.sampled_from([0.0, -1.5, 2.25, 0.1]), label="start")
        step = data.draw(st.sampled_from([0.5, 0.1, -0.25, 3.0, 1.0]), label="step")
        stop = start + step * data.draw(st.floats(0.5, 70), label="count")
    else:
        start = data.draw(st.integers(0 if dtype is U32 else -50, 50), label="start")
        step = data.draw(st.sampled_from([1, 2, 3, 7, -1, -4]), label="step")
        stop = data.draw(st.integers(-60, 100), label="stop")
        if dtype is U32 and step < 0:
            stop = max(stop, 0)
    want = np.arange(start, stop, step, dtype=np.float64 if dtype.is_float else np.int64)
    b = tt.ProgramBuilder("arange")
    if want.size == 0:
        with pytest.raises(tt.ShapeError, match="empty"):
            b.arange(start, stop, step, dtype)
        return
    out = b.arange(start, stop, step, dtype)
    b.output(out)
    (got,) = run_on_host(b.build(), [])
    assert out.dtype is dtype and got.shape == want.shape
    check(np.asarray(got), want, dtype, rtol=1e-6, atol=1e-6)


# -- conv2d and the pools ----------------------------------------------------------------------------

conv_cases = st.fixed_dictionaries({
    "n": st.integers(1, 2), "h": st.integers(1, 9), "w": st.sampled_from([1, 4, 7, 10]),
    "groups": st.integers(1, 3), "cig": st.integers(1, 3), "cog": st.integers(1, 3),
    "k": st.tuples(st.integers(1, 3), st.integers(1, 3)), "stride": st.tuples(st.integers(1, 3), st.integers(1, 2)),
    "padding": st.tuples(st.integers(0, 2), st.integers(0, 1)), "dilation": st.tuples(st.integers(1, 2), st.integers(1, 2)),
    "bias": st.booleans(), "dtype": float_dtypes, "seed": seeds,
})


@given(conv_cases)
def test_conv2d_nhwc_with_pytorch_weights(c: dict[str, Any]) -> None:
    rng = np.random.default_rng(c["seed"])
    g, dtype = c["groups"], c["dtype"]
    x = make(rng, (c["n"], c["h"], c["w"], g * c["cig"]), dtype, 1.0)
    w = make(rng, (g * c["cog"], c["cig"], *c["k"]), dtype, 1.0)
    bias = make(rng, (g * c["cog"],), dtype, 1.0) if c["bias"] else None
    kwargs = {"stride": c["stride"], "padding": c["padding"], "dilation": c["dilation"], "groups": g}
    span = [(k - 1) * d + 1 for k, d in zip(c["k"], c["dilation"])]
    if c["h"] + 2 * c["padding"][0] < span[0] or c["w"] + 2 * c["padding"][1] < span[1]:
        b = tt.ProgramBuilder("conv")
        with pytest.raises(tt.ShapeError, match="conv2d.*larger than the padded input"):
            b.conv2d(b.input(x.shape), b.input(w.shape), **kwargs)
        return
    inputs = [(x, dtype), (w, dtype)] + ([(bias, dtype)] if bias is not None else [])
    out, got = host(lambda b, *vs: b.conv2d(*vs, **kwargs), *inputs)
    rx, rw = rounded(x, dtype), rounded(w, dtype)
    rb = None if bias is None else rounded(bias, dtype)
    want = ref_conv2d_loops(rx, rw, rb, c["stride"], c["padding"], c["dilation"], g)
    assert out.dtype is dtype and out.shape == want.shape
    check(got, want, dtype, rtol=1e-5, atol=1e-5)
    torch = torch_or_none()
    if torch is not None:
        t = torch.nn.functional.conv2d(torch.from_numpy(rx).permute(0, 3, 1, 2), torch.from_numpy(rw),
                                       None if rb is None else torch.from_numpy(rb), **kwargs)
        np.testing.assert_allclose(t.permute(0, 2, 3, 1).numpy(), want, rtol=1e-10, atol=1e-12)


def test_conv2d_against_pytorch_at_a_realistic_size() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    x, w, bias = make(rng, (2, 33, 40, 8), F32, 1.0), make(rng, (16, 4, 3, 3), F32, 0.3), make(rng, (16,), F32)
    _, got = host(lambda b, *vs: b.conv2d(*vs, stride=(2, 1), padding=1, dilation=(1, 2), groups=2),
                  (x, F32), (w, F32), (bias, F32))
    t = torch.nn.functional.conv2d(torch.from_numpy(x.astype(np.float64)).permute(0, 3, 1, 2),
                                   torch.from_numpy(w.astype(np.float64)), torch.from_numpy(bias.astype(np.float64)),
                                   stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    check(got, t.permute(0, 2, 3, 1).numpy(), F32, rtol=1e-5, atol=1e-5)


pool_cases = st.fixed_dictionaries({
    "shape": st.tuples(st.integers(1, 2), st.integers(1, 9), st.sampled_from([1, 5, 8]), st.sampled_from([1, 3, 33])),
    "k": st.tuples(st.integers(1, 4), st.integers(1, 3)), "stride": st.none() | st.tuples(st.integers(1, 3), st.integers(1, 3)),
    "pad": st.tuples(st.integers(0, 2), st.integers(0, 1)), "dtype": st.sampled_from(FLOATS + [I32]), "seed": seeds,
})


@given(st.sampled_from(["max", "avg"]), pool_cases)
def test_pools_are_pytorchs(kind: str, c: dict[str, Any]) -> None:
    dtype = c["dtype"]
    if kind == "avg" and not dtype.is_float:
        dtype = F32
    x = make(np.random.default_rng(c["seed"]), c["shape"], dtype)
    k, pad = c["k"], c["pad"]
    s = k if c["stride"] is None else c["stride"]
    op = f"{kind}_pool2d"
    b = tt.ProgramBuilder("pool")
    if pad[0] > k[0] // 2 or pad[1] > k[1] // 2:
        with pytest.raises(tt.ShapeError, match=f"{op}: padding .* half the kernel"):
            getattr(b, op)(b.input(x.shape), k, c["stride"], pad)
        return
    if c["shape"][1] + 2 * pad[0] < k[0] or c["shape"][2] + 2 * pad[1] < k[1]:
        with pytest.raises(tt.ShapeError, match=f"{op}: kernel .* larger"):
            getattr(b, op)(b.input(x.shape), k, c["stride"], pad)
        return
    out, got = host(lambda bb, v: getattr(bb, op)(v, k, c["stride"], pad), (x, dtype))
    rx = rounded(x, dtype)
    want = ref_pool_loops(rx, k, s, pad, kind)
    assert out.dtype is dtype
    if kind == "max":
        exact(got, want, dtype)
    else:
        check(got, want, dtype, rtol=2e-6, atol=1e-6)
    torch = torch_or_none()
    if torch is not None and dtype.is_float:
        fn = getattr(torch.nn.functional, op)
        t = fn(torch.from_numpy(rx).permute(0, 3, 1, 2), k, s, pad)
        np.testing.assert_allclose(t.permute(0, 2, 3, 1).numpy(), want, rtol=1e-12)


# -- update_cache ---------------------------------------------------------------------------------------


@given(st.sampled_from([(), (1,), (3,), (2, 3)]), st.sampled_from([1, 5, 33]), st.sampled_from([1, 5, 40]),
       st.sampled_from(FLOATS), st.sampled_from(FLOATS), st.sampled_from([I32, U32]), st.integers(-4, 40),
       st.booleans(), seeds)
def test_update_cache_replaces_one_row(batch: tuple[int, ...], seq: int, d: int, dtype: tt.DataType,
                                       vdtype: tt.DataType, idtype: tt.DataType, index: int,
                                       broadcast: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    if idtype is U32:
        index = abs(index)
    cache = make(rng, batch + (seq, d), dtype)
    vbatch = tuple(1 for _ in batch[1:]) if broadcast else batch  # fewer and size-1 batch dims
    value = make(rng, vbatch + (1, d), vdtype)
    idx = np.array([index], np.int32 if idtype is I32 else np.uint32)
    out, got = host(lambda b, c, v, i: b.update_cache(c, v, i), (cache, dtype), (value, vdtype), (idx, idtype))
    assert out.dtype is dtype and out.shape == cache.shape
    want = rounded(cache, dtype).copy()
    row = min(max(index, 0), seq - 1)  # clamped, as JAX's dynamic_update_slice
    want[..., row, :] = np.broadcast_to(rounded(value, vdtype)[..., 0, :], batch + (d,))
    exact(got, want, dtype)


def test_update_cache_of_integers() -> None:
    cache = np.zeros((2, 4, 3), np.int32)
    value = np.array([[[1, 2, 3]], [[4, 5, 6]]], np.int32)
    _, got = host(lambda b, c, v, i: b.update_cache(c, v, i), (cache, I32), (value, I32), (np.array([9], np.int32), I32))
    want = cache.copy()
    want[:, 3] = value[:, 0]
    np.testing.assert_array_equal(got, want)


# -- build-time errors ------------------------------------------------------------------------------------


def bad_calls() -> list[tuple[str, type[Exception], str, Callable[..., Any]]]:
    """(id, error, message pattern, call(b, x, i, t, like)): x (4, 5) FLOAT32, i (3,) INT32,
    t (1, 6, 6, 4) FLOAT32, like(shape) another FLOAT32 input."""
    return [
        ("slice axis count", tt.ShapeError, r"slice.*one entry", lambda b, x, i, t, like: b.slice(x, [0, 0, 0], [1, 1, 1])),
        ("slice lengths", tt.ShapeError, r"slice.*one entry", lambda b, x, i, t, like: b.slice(x, [0], [1, 2])),
        ("slice step 0", tt.ShapeError, r"slice: steps must be positive", lambda b, x, i, t, like: b.slice(x, [0], [2], [0])),
        ("slice step -1", tt.ShapeError, r"slice: steps must be positive", lambda b, x, i, t, like: b.slice(x, [3], [0], [-1])),
        ("slice empty", tt.ShapeError, r"slice: \(4, 5\)\[3:1:1, 0:5:1\] is empty", lambda b, x, i, t, like: b.slice(x, [3], [1])),
        ("slice float", tt.ShapeError, r"slice: starts must be an integer", lambda b, x, i, t, like: b.slice(x, [0.5], [2])),
        ("slice bool", tt.ShapeError, r"slice: ends must be an integer", lambda b, x, i, t, like: b.slice(x, [0], [True])),
        ("slice not a list", tt.ShapeError, r"slice: starts must be a sequence", lambda b, x, i, t, like: b.slice(x, 0, 2)),
        ("concat empty", tt.ProgramError, r"concat takes a non-empty list", lambda b, x, i, t, like: b.concat([], 0)),
        ("concat value", tt.ProgramError, r"concat takes a non-empty list", lambda b, x, i, t, like: b.concat(x, 0)),
        ("concat dims", tt.ShapeError, r"concat along axis 0: \[\(4, 5\), \(4, 6\)\]",
         lambda b, x, i, t, like: b.concat([x, like((4, 6))], 0)),
        ("concat rank", tt.ShapeError, r"concat", lambda b, x, i, t, like: b.concat([x, t], 0)),
        ("concat axis", tt.ShapeError, r"concat: axis 2 is out of range", lambda b, x, i, t, like: b.concat([x, x], 2)),
        ("concat dtypes", tt.LayoutError, r"concat: cannot mix FLOAT32 and INT32",
         lambda b, x, i, t, like: b.concat([b.reshape(x, (20,)), i], 0)),
        ("permute repeat", tt.ShapeError, r"permute: axes \(0, 0\) are not a permutation", lambda b, x, i, t, like: b.permute(x, [0, 0])),
        ("permute short", tt.ShapeError, r"permute", lambda b, x, i, t, like: b.permute(x, [0])),
        ("permute range", tt.ShapeError, r"permute", lambda b, x, i, t, like: b.permute(x, [0, 2])),
        ("matmul batch", tt.ShapeError, r"matmul: batch dims", lambda b, x, i, t, like: b.matmul(t, like((3, 4, 3)))),
        ("embedding float ids", tt.LayoutError, r"embedding: ids must be INT32 or UINT32, got FLOAT32",
         lambda b, x, i, t, like: b.embedding(x, x)),
        ("embedding table rank", tt.ShapeError, r"embedding: the table must be \[vocabulary, dim\], got \(1, 6, 6, 4\)",
         lambda b, x, i, t, like: b.embedding(i, t)),
        ("argmax axis", tt.ShapeError, r"argmax: axis 2 is out of range for rank 2", lambda b, x, i, t, like: b.argmax(x, 2)),
        ("where shapes", tt.ShapeError, r"where: shapes \(4, 5\) and \[\(3,\)\]", lambda b, x, i, t, like: b.where(x, b.typecast(i, tt.DataType.FLOAT32), 0.0)),
        ("where two scalars", tt.ProgramError, r"where needs a value", lambda b, x, i, t, like: b.where(x, 1.0, 0.0)),
        ("where mix", tt.LayoutError, r"where: cannot mix INT32 and FLOAT32", lambda b, x, i, t, like: b.where(i, i, b.sum(x, 0))),
        ("where int scalar", tt.LayoutError, r"where: a INT32 value takes integral scalars", lambda b, x, i, t, like: b.where(x, i, 0.5)),
        ("where bool", tt.ProgramError, r"where: a boolean", lambda b, x, i, t, like: b.where(x, x, True)),
        ("compare shapes", tt.ShapeError, r"le: shapes \(4, 5\) and \(1, 6, 6, 4\) do not broadcast", lambda b, x, i, t, like: b.le(x, t)),
        ("compare mix", tt.LayoutError, r"eq: cannot mix", lambda b, x, i, t, like: b.eq(i, b.sum(b.sum(x, 0), 1))),
        ("maximum nan", tt.ProgramError, r"maximum: a NaN operand", lambda b, x, i, t, like: b.maximum(x, float("nan"))),
        ("minimum int scalar", tt.LayoutError, r"minimum: a INT32 value takes integral", lambda b, x, i, t, like: b.minimum(i, 0.5)),
        ("mean int", tt.LayoutError, r"mean needs a float input, got INT32", lambda b, x, i, t, like: b.mean(i, 0)),
        ("mean axis", tt.ShapeError, r"mean: axis -3 is out of range", lambda b, x, i, t, like: b.mean(x, -3)),
        ("rsqrt int", tt.LayoutError, r"rsqrt needs a float", lambda b, x, i, t, like: b.rsqrt(i)),
        ("tanh int", tt.LayoutError, r"tanh needs a float", lambda b, x, i, t, like: b.tanh(i)),
        ("sigmoid int", tt.LayoutError, r"sigmoid needs a float", lambda b, x, i, t, like: b.sigmoid(i)),
        ("silu int", tt.LayoutError, r"silu needs a float", lambda b, x, i, t, like: b.silu(i)),
        ("pow tensor", tt.ProgramError, r"pow takes a Python scalar exponent, got Value", lambda b, x, i, t, like: b.pow(x, x)),
        ("pow nan", tt.ProgramError, r"pow: a NaN", lambda b, x, i, t, like: b.pow(x, float("nan"))),
        ("pow int", tt.LayoutError, r"pow needs a float", lambda b, x, i, t, like: b.pow(i, 2)),
        ("layer_norm weight", tt.ShapeError, r"layer_norm: weight of shape \(4,\) does not fit the last dim of \(4, 5\)",
         lambda b, x, i, t, like: b.layer_norm(x, like((4,)))),
        ("layer_norm bias rank", tt.ShapeError, r"layer_norm: bias of shape \(1, 1, 5\)",
         lambda b, x, i, t, like: b.layer_norm(x, None, like((1, 1, 5)))),
        ("layer_norm int weight", tt.LayoutError, r"layer_norm: weight must be a float, got INT32",
         lambda b, x, i, t, like: b.layer_norm(b.reshape(x, (20,)), b.concat([i] * 6 + [b.slice(i, [0], [2])], 0))),
        ("layer_norm int", tt.LayoutError, r"layer_norm needs a float", lambda b, x, i, t, like: b.layer_norm(i)),
        ("layer_norm eps", tt.ProgramError, r"layer_norm: eps must be a number", lambda b, x, i, t, like: b.layer_norm(x, eps="1")),
        ("rms_norm eps inf", tt.ProgramError, r"rms_norm: eps must be finite", lambda b, x, i, t, like: b.rms_norm(x, eps=math.inf)),
        ("rms_norm weight", tt.ShapeError, r"rms_norm: weight of shape \(2, 5\)", lambda b, x, i, t, like: b.rms_norm(x, like((2, 5)))),
        ("arange step 0", tt.ProgramError, r"arange: step must be nonzero", lambda b, x, i, t, like: b.arange(0, 5, 0)),
        ("arange empty", tt.ShapeError, r"arange\(5, 0, 1\) is empty", lambda b, x, i, t, like: b.arange(5, 0)),
        ("arange float int", tt.LayoutError, r"arange: INT32 takes integral bounds", lambda b, x, i, t, like: b.arange(0, 2.5)),
        ("arange range", tt.LayoutError, r"arange\(-3, 2, 1\) does not fit UINT32", lambda b, x, i, t, like: b.arange(-3, 2, 1, U32)),
        ("arange nan", tt.ProgramError, r"arange: stop must be finite", lambda b, x, i, t, like: b.arange(0.0, math.nan, 1.0, F32)),
        ("arange dtype", tt.LayoutError, r"arange: dtype must be a tt.DataType", lambda b, x, i, t, like: b.arange(0, 3, 1, "int32")),
        ("conv rank", tt.ShapeError, r"conv2d takes x \[N, H, W, C_in\]", lambda b, x, i, t, like: b.conv2d(x, t)),
        ("conv channels", tt.ShapeError, r"conv2d: x \(1, 6, 6, 4\) with 4 channels and weight \(2, 3, 1, 1\) do not fit groups=1",
         lambda b, x, i, t, like: b.conv2d(t, like((2, 3, 1, 1)))),
        ("conv groups", tt.ShapeError, r"groups=3", lambda b, x, i, t, like: b.conv2d(t, like((3, 1, 1, 1)), groups=3)),
        ("conv bias", tt.ShapeError, r"conv2d: bias must have shape \(2,\), got \(3,\)",
         lambda b, x, i, t, like: b.conv2d(t, like((2, 4, 1, 1)), like((3,)))),
        ("conv kernel", tt.ShapeError, r"conv2d: kernel \(7, 1\)", lambda b, x, i, t, like: b.conv2d(t, like((2, 4, 7, 1)))),
        ("conv stride 0", tt.ShapeError, r"conv2d: stride must be at least 1, got 0", lambda b, x, i, t, like: b.conv2d(t, like((2, 4, 1, 1)), stride=0)),
        ("conv padding", tt.ShapeError, r"conv2d: padding is an int or a pair", lambda b, x, i, t, like: b.conv2d(t, like((2, 4, 1, 1)), padding=(1, 1, 1, 1))),
        ("conv groups 0", tt.ShapeError, r"conv2d: groups must be at least 1", lambda b, x, i, t, like: b.conv2d(t, like((2, 4, 1, 1)), groups=0)),
        ("conv int", tt.LayoutError, r"conv2d: cannot mix FLOAT32 and INT32",
         lambda b, x, i, t, like: b.conv2d(t, b.typecast(like((2, 4, 1, 1)), I32))),
        ("pool rank", tt.ShapeError, r"max_pool2d takes x in NHWC", lambda b, x, i, t, like: b.max_pool2d(x, 2)),
        ("pool padding", tt.ShapeError, r"avg_pool2d: padding \(2, 2\) is more than half the kernel \(3, 3\)",
         lambda b, x, i, t, like: b.avg_pool2d(t, 3, padding=2)),
        ("pool kernel", tt.ShapeError, r"max_pool2d: kernel \(7, 7\) is larger", lambda b, x, i, t, like: b.max_pool2d(t, 7)),
        ("pool kernel 0", tt.ShapeError, r"max_pool2d: kernel_size must be at least 1", lambda b, x, i, t, like: b.max_pool2d(t, 0)),
        ("avg pool int", tt.LayoutError, r"avg_pool2d needs a float", lambda b, x, i, t, like: b.avg_pool2d(b.typecast(t, I32), 2)),
        ("cache rank", tt.ShapeError, r"update_cache takes cache", lambda b, x, i, t, like: b.update_cache(i, i, i)),
        ("cache row", tt.ShapeError, r"update_cache: value \(2, 5\) is not one row", lambda b, x, i, t, like: b.update_cache(x, like((2, 5)), i)),
        ("cache width", tt.ShapeError, r"is not one row \[\.\.\., 1, 5\]", lambda b, x, i, t, like: b.update_cache(x, like((1, 4)), i)),
        ("cache batch", tt.ShapeError, r"broadcast to the cache's \(1, 6, 6, 4\)",
         lambda b, x, i, t, like: b.update_cache(t, like((2, 6, 1, 4)), b.slice(i, [0], [1]))),
        ("cache index shape", tt.ShapeError, r"update_cache: the index must have shape \(1,\), got \(3,\)",
         lambda b, x, i, t, like: b.update_cache(x, like((1, 5)), i)),
        ("cache index dtype", tt.LayoutError, r"update_cache: the index must be INT32 or UINT32, got FLOAT32",
         lambda b, x, i, t, like: b.update_cache(x, like((1, 5)), like((1,)))),
        ("cache kinds", tt.LayoutError, r"update_cache: a INT32 value cannot go into a FLOAT32 cache",
         lambda b, x, i, t, like: b.update_cache(x, b.typecast(like((1, 5)), I32), b.slice(i, [0], [1]))),
    ]


@pytest.mark.parametrize("case", bad_calls(), ids=lambda c: c[0])
def test_bad_input_fails_at_build_time(case: tuple[str, type[Exception], str, Callable[..., Any]]) -> None:
    _, error, pattern, call = case
    b = tt.ProgramBuilder("bad")
    x, i, t = b.input((4, 5)), b.input((3,), tile(I32)), b.input((1, 6, 6, 4))
    # The other float inputs the calls use, by shape (inputs come before any op).
    like = {s: b.input(s) for s in ((4, 6), (3, 4, 3), (4,), (1, 1, 5), (2, 5), (2, 3, 1, 1), (3, 1, 1, 1),
                                    (2, 4, 1, 1), (3,), (2, 4, 7, 1), (1, 4), (2, 6, 1, 4), (1, 5), (1,))}
    with pytest.raises(error, match=pattern):
        call(b, x, i, t, like.__getitem__)


# -- the binary format ----------------------------------------------------------------------------------


def every_op(dtype: tt.DataType) -> tuple[tt.Program, list[Array], list[Callable[[list[Array]], tuple[Array, str]]]]:
    """A program using every op of version 2 on `dtype` inputs, its inputs, and for each output
    a reference on the rounded inputs: (expected, "exact" or "close")."""
    rng = np.random.default_rng(3)
    b = tt.ProgramBuilder(f"every op {dtype.name}")
    specs = [((2, 5, 33), dtype), ((5,), I32), ((10, 40), dtype), ((1, 7, 9, 4), dtype), ((6, 2, 3, 3), dtype),
             ((6,), F32), ((2, 8, 40), dtype), ((1, 40), dtype), ((1,), U32), ((33,), BF16), ((1, 33, 5), dtype)]
    arrays = [make(rng, s, d) for s, d in specs]
    arrays[1] = np.array([0, 9, 12, -1, 4], np.int32)  # two ids out of range: clamped
    arrays[8] = np.array([11], np.uint32)  # past the cache's 8 rows: the last row
    x, ids, table, img, w, bias, cache, row, idx, g, y = (b.input(s, tile(d)) for s, d in specs)
    R = Callable[[list[Array]], tuple[Array, str]]
    refs: list[R] = []

    def out(value: Value, ref: R) -> None:
        b.output(value)
        refs.append(ref)

    out(b.slice(x, [None, -3], [None, None], [1, 2]), lambda r: (r[0][:, -3::2], "exact"))
    out(b.concat([x, b.neg(x)], -1), lambda r: (np.concatenate([r[0], -r[0]], -1), "exact"))
    out(b.permute(x, [2, 0, -2]), lambda r: (r[0].transpose(2, 0, 1), "exact"))
    out(b.matmul(x, y), lambda r: (r[0] @ r[10], "close"))
    out(b.embedding(ids, table), lambda r: (r[2][np.clip(r[1], 0, 9)], "exact"))
    out(b.argmax(x, -1), lambda r: (ref_first_argmax(r[0], -1), "exact"))
    out(b.where(b.gt(x, 0.0), x, 0.5), lambda r: (np.where(r[0] > 0, r[0], 0.5), "exact"))
    for op, fn in COMPARISONS.items():
        out(getattr(b, op)(x, 0.25), lambda r, fn=fn: (fn(r[0], 0.25).astype(np.float64), "exact"))
    out(b.maximum(x, b.neg(x)), lambda r: (np.abs(r[0]), "exact"))
    out(b.minimum(x, 0.0), lambda r: (np.minimum(r[0], 0.0), "exact"))
    out(b.mean(x, 1), lambda r: (r[0].mean(1, keepdims=True), "close"))
    out(b.rsqrt(b.add(b.mul(x, x), 1.0)),  # each step's result is rounded to x's dtype
        lambda r: (1 / np.sqrt(rounded(rounded(r[0] * r[0], dtype) + 1, dtype)), "close"))
    for op, fn in UNARY.items():
        if op != "rsqrt":
            out(getattr(b, op)(x), lambda r, fn=fn: (fn(r[0]), "close"))
    out(b.pow(x, 2), lambda r: (r[0] ** 2, "close"))
    out(b.layer_norm(x, g, None), lambda r: (ref_layer_norm(r[0], r[9], None, 1e-5), "close"))
    out(b.rms_norm(x, g, 1e-3), lambda r: (ref_rms_norm(r[0], r[9], 1e-3), "close"))
    out(b.arange(0, 10, 3), lambda r: (np.arange(0, 10, 3), "exact"))
    out(b.conv2d(img, w, bias, stride=2, padding=1, groups=2),
        lambda r: (ref_conv2d_loops(r[3], r[4], r[5], (2, 2), (1, 1), (1, 1), 2), "close"))
    out(b.max_pool2d(img, 3, 2, 1), lambda r: (ref_pool_loops(r[3], (3, 3), (2, 2), (1, 1), "max"), "exact"))
    out(b.avg_pool2d(img, (2, 3), 1), lambda r: (ref_pool_loops(r[3], (2, 3), (1, 1), (0, 0), "avg"), "close"))

    def cache_ref(r: list[Array]) -> tuple[Array, str]:
        c = r[6].copy()
        c[:, 7, :] = r[7][0]
        return c, "exact"

    out(b.update_cache(cache, row, idx), cache_ref)
    return b.build(), arrays, refs


def check_every_op(program: tt.Program, arrays: list[Array], refs: list[Any], results: list[Array]) -> None:
    inputs = [rounded(a, spec.dtype) for a, spec in zip(arrays, program.inputs)]
    for k, (ref, got, spec) in enumerate(zip(refs, results, program.output_specs)):
        want, how = ref(inputs)
        got = np.asarray(got)
        assert got.shape == want.shape, k
        if how == "exact":
            exact(got, want, spec.dtype)
        else:
            check(got, want, spec.dtype, rtol=2e-5, atol=2e-5)


def check_saved_and_on_host(tmp_path: Path, program: tt.Program, arrays: list[Array], refs: list[Any]) -> None:
    """Saved in the newest format version, loaded back equal, run on the host, checked."""
    path = tmp_path / "every.ttb"
    tt.Binary([program]).save(path)
    assert struct.unpack_from("<I", path.read_bytes(), 8) == (NEWEST,)
    (loaded,) = tt.Binary.load(path).programs
    assert loaded.same_as(program)
    check_every_op(loaded, arrays, refs, run_on_host(loaded, arrays))


async def check_on_device(program: tt.Program, arrays: list[Array], refs: list[Any]) -> None:
    """Run on a device: equal to the host's run, byte for byte, and checked."""
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        outs = tt.submit(device, tt.Binary([program]), 0, [tt.to_device(a, device) for a in arrays])
        results = [await tt.to_host(t) for t in outs]
    for got, want in zip(results, run_on_host(program, arrays)):  # the device runs the host's reference
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    check_every_op(program, arrays, refs, results)


@pytest.mark.parametrize("dtype", FLOATS)
def test_every_op_saves_loads_and_runs_on_the_host(tmp_path: Path, dtype: tt.DataType) -> None:
    check_saved_and_on_host(tmp_path, *every_op(dtype))


@pytest.mark.anyio
@pytest.mark.parametrize("dtype", [F32, BF8])
async def test_every_op_on_the_device(dtype: tt.DataType) -> None:
    await check_on_device(*every_op(dtype))


@pytest.mark.anyio
async def test_a_program_without_inputs_on_the_device() -> None:
    b = tt.ProgramBuilder("positions")
    pos = b.arange(0, 40)
    b.output(pos)
    b.output(b.arange(-1.0, 1.0, 0.125, BF16))
    b.output(b.mul(b.typecast(pos, F32), 0.5))
    binary = tt.Binary([b.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        outs = tt.submit(device, binary, 0, [])
        ints, halves, scaled = [await tt.to_host(t) for t in outs]
    np.testing.assert_array_equal(ints, np.arange(40, dtype=np.int32))
    assert ints.dtype == np.int32 and halves.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(halves.astype(np.float64), np.arange(-1.0, 1.0, 0.125))
    np.testing.assert_array_equal(scaled, np.arange(40) * 0.5)


def test_a_version_1_file_still_loads() -> None:
    # Written by the code of df4f670, before version 2: every op of that format.
    raw = (DATA / "v1_all_ops.ttb").read_bytes()
    assert struct.unpack_from("<I", raw, 8) == (1,)
    (loaded,) = tt.Binary.load(DATA / "v1_all_ops.ttb").programs
    b = tt.ProgramBuilder("v1_all_ops")
    x = b.input((2, 5, 33))
    w = b.input((33, 7), tt.Layout(dtype=BF16))
    i = b.input((4,), tt.Layout(dtype=I32))
    h = b.matmul(x, w)
    h = b.add(h, 1.5)
    h = b.sub(h, b.mul(h, 0.25))
    g = b.gt(h, 0.0)
    h = b.reciprocal(b.sqrt(b.exp(b.mul(b.gelu(b.relu(b.neg(h))), -1.0))))
    h = b.softmax(h, axis=1)
    s, m, t = b.sum(h, -1), b.max(h, 0), b.transpose(h)
    r = b.reshape(t, (14, 5))
    for v in (g, s, m, r, b.typecast(r, I32), b.add(b.sum(i, 0), 3)):
        b.output(v)
    b.output(h, tile(BF8))
    assert loaded.same_as(b.build())


def test_a_version_1_file_cannot_hold_a_newer_op(tmp_path: Path) -> None:
    program, _, _ = every_op(F32)
    path = tmp_path / "p.ttb"
    tt.Binary([program]).save(path)
    raw = path.read_bytes()
    path.write_bytes(raw[:8] + struct.pack("<I", 1) + raw[12:])
    with pytest.raises(tt.BinaryFormatError, match="slice is not an op of format version 1"):
        tt.Binary.load(path)


json_values = st.none() | st.booleans() | st.integers(-3, 50) | st.floats(allow_nan=False) | st.text(max_size=3) \
    | st.lists(st.none() | st.integers(-3, 9) | st.floats(-2, 2) | st.lists(st.integers(0, 3), max_size=2), max_size=4) \
    | st.dictionaries(st.text(max_size=2), st.integers(), max_size=2)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_edited_attrs_load_or_raise_binary_format_error(tmp_path: Path, data: st.DataObject) -> None:
    """Any edit of a step's attrs, inputs or scalar either still loads or raises BinaryFormatError."""
    program, _, _ = every_op(F32)
    path = tmp_path / "p.ttb"
    tt.Binary([program]).save(path)
    doc = json.loads(path.read_bytes()[24:])
    steps = doc[0]["steps"]
    step = steps[data.draw(st.integers(0, len(steps) - 1), label="step")]
    what = data.draw(st.sampled_from(["attr", "drop attr", "inputs", "scalar"]), label="edit")
    if what == "attr" and step[3]:
        step[3][data.draw(st.integers(0, len(step[3]) - 1))][1] = data.draw(json_values, label="value")
    elif what == "drop attr" and step[3]:
        step[3].pop(data.draw(st.integers(0, len(step[3]) - 1)))
    elif what == "inputs":
        step[1] = data.draw(st.lists(st.integers(0, 10), max_size=4), label="inputs")
    else:
        step[2] = data.draw(json_values, label="scalar")
    payload = json.dumps(doc).encode()
    path.write_bytes(struct.pack("<8sIQI", b"TTFLOWB\0", 3, len(payload), zlib.crc32(payload)) + payload)
    try:
        tt.Binary.load(path)
    except tt.BinaryFormatError:
        pass


def test_the_ops_page_lists_every_op() -> None:
    from ttflow._ir.ops import OPS  # the table of ops only; the references above are this file's

    page = (Path(__file__).parent.parent / "docs" / "ops.md").read_text()
    first_column = {name for line in page.splitlines() if line.startswith("| ")
                    for name in line.split("|")[1].replace(",", " ").split()}
    assert set(OPS) <= first_column, set(OPS) - first_column
