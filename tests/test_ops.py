"""Each op's compute against numpy written here (math.erf for GELU), and the storage rounding."""

from __future__ import annotations

import math
import warnings
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from reference import bfp8_pack_reference, bfp8_unpack_reference, tilize
from ttflow import DataType
from ttflow._ir.ops import OPS
from ttflow._ir.numerics import compute_dtype, erf, store_as, to_host_dtype

Array = np.ndarray[Any, Any]
F32, BF16, BF8, I32, U32 = (DataType.FLOAT32, DataType.BFLOAT16, DataType.BFLOAT8_B,
                            DataType.INT32, DataType.UINT32)

shapes = hnp.array_shapes(min_dims=1, max_dims=3, max_side=6)
floats = hnp.arrays(np.float32, shapes, elements=st.floats(-50, 50, width=32))
ints = hnp.arrays(np.int64, shapes, elements=st.integers(-(2**31), 2**31 - 1))


def pair(dtype: Any, elements: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[Array, Array]]:
    """Two arrays whose shapes broadcast (numpy's broadcastable_shapes)."""
    return hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=1, max_dims=3, max_side=4).flatmap(
        lambda s: st.tuples(*(hnp.arrays(dtype, shape, elements=elements) for shape in s.input_shapes))
    )


def test_the_op_table() -> None:
    v1 = {"add", "sub", "mul", "gt", "matmul", "relu", "neg", "gelu", "exp", "sqrt", "reciprocal",
          "softmax", "sum", "max", "transpose", "reshape", "typecast"}
    v2 = {"eq", "ne", "lt", "le", "ge", "maximum", "minimum", "embedding", "update_cache", "where",
          "layer_norm", "rms_norm", "conv2d", "concat", "arange", "slice", "permute", "argmax",
          "mean", "rsqrt", "tanh", "sigmoid", "silu", "pow", "max_pool2d", "avg_pool2d"}
    v3 = {"div", "log", "erf", "abs", "full", "broadcast_to", "rand", "gather", "embedding_grad",
          "conv2d_input_grad", "conv2d_weight_grad", "max_pool2d_backward", "avg_pool2d_backward"}
    v4 = {"sin", "cos", "floor", "ceil", "round", "trunc"}
    v5 = {"remainder", "floor_divide", "fmod", "cumsum", "argsort", "atan2"}
    v6 = {"bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift", "prod"}
    v7 = {"all_gather", "reduce_scatter", "all_reduce", "broadcast", "point_to_point", "all_to_all"}
    v8: set[str] = set()  # (version 8 added locations, no op)
    v9 = {"clamp"}
    v10 = {"constant"}
    assert set(OPS) == v1 | v2 | v3 | v4 | v5 | v6 | v7 | v9 | v10
    assert {n for n, op in OPS.items() if op.int_only} == v6 - {"prod"}
    assert {n for n, op in OPS.items() if op.float_only} == {
        "gelu", "exp", "sqrt", "reciprocal", "softmax", "layer_norm", "rms_norm", "conv2d", "mean",
        "rsqrt", "tanh", "sigmoid", "silu", "pow", "avg_pool2d", "div", "log", "erf", "embedding_grad",
        "conv2d_input_grad", "conv2d_weight_grad", "avg_pool2d_backward", *v4, "atan2"}
    assert all(op.name == n for n, op in OPS.items())
    assert {n for n, op in OPS.items() if op.arity == 2} == {
        "add", "sub", "mul", "gt", "matmul", "eq", "ne", "lt", "le", "ge", "maximum", "minimum",
        "embedding", "rms_norm", "div", "gather", "embedding_grad", "conv2d_input_grad",
        "conv2d_weight_grad", "max_pool2d_backward", "remainder", "floor_divide", "fmod", "atan2",
        "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift"}
    # Each record says which format version introduced its op (what `Binary.load` accepts).
    for version, ops in enumerate([v1, v2, v3, v4, v5, v6, v7, v8, v9, v10], start=1):
        assert {n for n, op in OPS.items() if op.version == version} == ops, version
    assert {n for n, op in OPS.items() if op.arity == 3} == {"update_cache", "where", "layer_norm", "conv2d"}
    assert {n: op.arity for n, op in OPS.items() if op.arity < 1} == {"concat": -1, "arange": 0, "full": 0,
                                                                     "constant": 0}


@given(pair(np.float32, st.floats(-1e3, 1e3, width=32)))
def test_binary_ops_broadcast_like_numpy(arrays: tuple[Array, Array]) -> None:
    a, b = arrays
    for op, ref in (("add", a + b), ("sub", a - b), ("mul", a * b),
                    ("gt", np.where(a > b, np.float32(1), np.float32(0)))):
        got = OPS[op].compute([a, b], None)
        assert got.dtype == np.float32 and got.shape == ref.shape, op
        np.testing.assert_array_equal(got, ref, err_msg=op)


@given(floats, st.floats(-10, 10, width=32))
def test_scalar_operands(x: Array, c: float) -> None:
    c32 = np.float32(c)
    for op, ref in (("add", x + c32), ("sub", x - c32), ("mul", x * c32), ("gt", (x > c32).astype(np.float32))):
        got = OPS[op].compute([x], float(c))
        assert got.dtype == np.float32, op
        np.testing.assert_array_equal(got, ref, err_msg=op)


@given(floats)
def test_float_unary_ops(x: Array) -> None:
    np.testing.assert_array_equal(OPS["relu"].compute([x], None), np.where(x > 0, x, np.float32(0)))
    np.testing.assert_array_equal(OPS["neg"].compute([x], None), -x)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(OPS["exp"].compute([x], None), np.exp(x64), rtol=2e-7)
    pos = np.abs(x) + np.float32(0.5)
    np.testing.assert_allclose(OPS["sqrt"].compute([pos], None), np.sqrt(pos.astype(np.float64)), rtol=2e-7)
    np.testing.assert_allclose(OPS["reciprocal"].compute([pos], None), 1.0 / pos.astype(np.float64), rtol=2e-7)
    for op in ("relu", "neg", "exp", "sqrt", "reciprocal", "gelu"):
        assert OPS[op].compute([x], None).dtype == np.float32, op


@given(hnp.arrays(np.float32, shapes, elements=st.floats(-12, 12, width=32)))
def test_gelu_matches_math_erf(x: Array) -> None:
    ref = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(float).ravel()])
    np.testing.assert_allclose(OPS["gelu"].compute([x], None).ravel(), ref, rtol=1e-6, atol=1e-7)


def test_gelu_tails_and_zero() -> None:
    x = np.array([0.0, -0.0, -40.0, 40.0, -6.0, 1e-30], np.float32)
    got = OPS["gelu"].compute([x], None)
    np.testing.assert_allclose(got, [0.0, 0.0, 0.0, 40.0, -6.0 * 0.5 * math.erfc(6 / math.sqrt(2)), 5e-31],
                               rtol=1e-6, atol=1e-30)


def test_erf_is_accurate_everywhere() -> None:
    xs = np.concatenate([np.linspace(-8, 8, 4001), [0.0, 0.5, -0.5, 4.0, -4.0, 1e-8, 30.0, -30.0]])
    np.testing.assert_allclose(erf(xs), [math.erf(v) for v in xs], rtol=1e-13, atol=1e-15)


@given(hnp.arrays(np.float64, st.integers(0, 40), elements=st.floats(allow_nan=True, allow_infinity=True)))
def test_erf_kernel_matches_math_erf(x: Array) -> None:
    """The C kernel (`_kernels._special`) on any float64: math.erf's value, sign of zero, NaN."""
    got = erf(x)
    want = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0.0)
    assert np.array_equal(np.signbit(got), np.signbit(want))


@given(floats, st.integers(-3, 2))
def test_reductions_and_softmax_with_negative_axes(x: Array, axis: int) -> None:
    if not -x.ndim <= axis < x.ndim:
        axis = axis % x.ndim - x.ndim  # a negative axis, as the runtime may also pass
    x64 = x.astype(np.float64)
    total = OPS["sum"].compute([x], None, axis=axis)
    assert total.dtype == np.float32
    np.testing.assert_allclose(total, x64.sum(axis, keepdims=True), rtol=1e-5, atol=1e-3)
    np.testing.assert_array_equal(OPS["max"].compute([x], None, axis=axis), x.max(axis, keepdims=True))
    s = OPS["softmax"].compute([x], None, axis=axis)
    assert s.dtype == np.float32 and s.shape == x.shape
    e = np.exp(x64 - x64.max(axis, keepdims=True))
    np.testing.assert_allclose(s, e / e.sum(axis, keepdims=True), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(s.sum(axis), 1.0, rtol=1e-5)


def test_softmax_is_stable_for_large_inputs() -> None:
    x = np.array([[1000.0, 1000.0, -1000.0], [88.0, 89.0, 90.0]], np.float32)
    s = OPS["softmax"].compute([x], None, axis=-1)
    assert np.isfinite(s).all()
    np.testing.assert_allclose(s[0], [0.5, 0.5, 0.0], atol=1e-7)
    e = np.exp(np.array([-2.0, -1.0, 0.0]))
    np.testing.assert_allclose(s[1], e / e.sum(), rtol=1e-6)


@given(hnp.mutually_broadcastable_shapes(signature="(m,k),(k,n)->(m,n)", max_dims=4, max_side=5),
       st.integers(0, 2**16))
def test_matmul_broadcasts_batch_dims(shapes_: Any, seed: int) -> None:
    r = np.random.default_rng(seed)
    a, b = (r.standard_normal(s).astype(np.float32) for s in shapes_.input_shapes)
    got = OPS["matmul"].compute([a, b], None)
    assert got.dtype == np.float32 and got.shape == shapes_.result_shape
    ref = np.einsum("...ij,...jk->...ik", a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_transpose_and_reshape() -> None:
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_array_equal(OPS["transpose"].compute([x], None), x.transpose(0, 2, 1))
    np.testing.assert_array_equal(OPS["reshape"].compute([x], None, shape=(6, 4)), x.reshape(6, 4))
    np.testing.assert_array_equal(OPS["reshape"].compute([x], None, shape=[24]), x.reshape(24))


@given(pair(np.int64, st.integers(-(2**31), 2**31 - 1)))
def test_integer_ops_stay_int64(arrays: tuple[Array, Array]) -> None:
    a, b = arrays
    checks = {"add": a + b, "sub": a - b, "mul": a * b, "gt": (a > b).astype(np.int64)}
    for op, ref in checks.items():
        got = OPS[op].compute([a, b], None)
        assert got.dtype == np.int64, op
        np.testing.assert_array_equal(got, ref, err_msg=op)
    np.testing.assert_array_equal(OPS["relu"].compute([a], None), np.where(a > 0, a, 0))
    np.testing.assert_array_equal(OPS["neg"].compute([a], None), -a)
    np.testing.assert_array_equal(OPS["sum"].compute([a], None, axis=-1), a.sum(-1, keepdims=True))
    np.testing.assert_array_equal(OPS["max"].compute([a], None, axis=0), a.max(0, keepdims=True))
    for op in ("relu", "neg"):
        assert OPS[op].compute([a], None).dtype == np.int64


def test_integer_matmul_scalars_and_transpose() -> None:
    a = np.array([[1, -2, 3], [4, 5, -6]], np.int64)
    np.testing.assert_array_equal(OPS["matmul"].compute([a, a.T.copy()], None), [[14, -24], [-24, 77]])
    np.testing.assert_array_equal(OPS["transpose"].compute([a], None), [[1, 4], [-2, 5], [3, -6]])
    big = np.array([[2**31 - 1, -5]], np.int64)
    got = OPS["add"].compute([big], 1.0)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [[2**31, -4]])  # int64 here; the store wraps it
    np.testing.assert_array_equal(OPS["gt"].compute([a], 3.0), [[0, 0, 0], [1, 1, 0]])


def test_typecast() -> None:
    f = np.array([1.7, -1.7, 3e9, -3e9, np.nan, np.inf, -np.inf, 0.5], np.float32)
    tc = OPS["typecast"].compute
    np.testing.assert_array_equal(tc([f], None, dtype="int32"),
                                  [1, -1, 2**31 - 1, -(2**31), 0, 2**31 - 1, -(2**31), 0])
    np.testing.assert_array_equal(tc([f], None, dtype="uint32"), [1, 0, 3e9, 0, 0, 2**32 - 1, 0, 0])
    assert tc([f], None, dtype="int32").dtype == np.int64
    i = np.array([-1, 7], np.int64)
    got = tc([i], None, dtype="float32")
    assert got.dtype == np.float32 and got.tolist() == [-1.0, 7.0]
    assert tc([i], None, dtype="uint32").tolist() == [-1, 7]  # the store wraps -1 to 2**32 - 1
    assert tc([f], None, dtype="bfloat16").dtype == np.float32  # the store rounds


def test_ops_never_warn() -> None:
    x = np.array([-1.0, 0.0, 100.0, np.nan], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isnan(OPS["sqrt"].compute([x], None)[0])
        assert OPS["reciprocal"].compute([x], None)[1] == np.inf
        assert OPS["exp"].compute([x], None)[2] == np.inf
        OPS["mul"].compute([x], 1e38)
        OPS["typecast"].compute([x], None, dtype="int32")


# -- rounding as the device stores each dtype ------------------------------------------------------

def bfloat16_reference(x: Array) -> Array:
    """Round-to-nearest-even to the top 16 bits of float32, on the bit patterns."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def bfloat8_b_reference(x: Array) -> Array:
    """One 32x32 tile through SPEC's BFLOAT8_B, element by element (tests/reference.py)."""
    order = tilize(np.arange(1024).reshape(32, 32))  # face order -> row-major position
    faced = np.asarray(x, np.float32).ravel()[order]
    out = np.empty(1024, np.float32)
    out[order] = bfp8_unpack_reference(bfp8_pack_reference(faced))
    return out.reshape(32, 32)


@given(hnp.arrays(np.float32, (3, 5), elements=st.floats(-(2.0**100), 2.0**100, width=32)))
def test_store_as_floats(x: Array) -> None:
    np.testing.assert_array_equal(store_as(x, F32), x)
    got = store_as(x, BF16)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, bfloat16_reference(x))
    host = to_host_dtype(got, BF16)
    assert host.dtype == ml_dtypes.bfloat16 and host.astype(np.float32).tolist() == got.tolist()


def test_store_as_bfloat8_b() -> None:
    pytest.importorskip("ttflow.kernels")
    r = np.random.default_rng(3)
    x = (r.standard_normal((32, 32)) * np.exp2(r.integers(-6, 6, (32, 1)))).astype(np.float32)
    got = store_as(x, BF8)
    assert got.dtype == np.float32 and got.shape == (32, 32)
    np.testing.assert_array_equal(got, bfloat8_b_reference(x))
    part = x[:5, :7]  # padding is zero, so a partial tile rounds like the corner of a full one
    padded = np.zeros((32, 32), np.float32)
    padded[:5, :7] = part
    np.testing.assert_array_equal(store_as(part, BF8), bfloat8_b_reference(padded)[:5, :7])


@given(ints)
def test_store_as_integers_wraps_to_32_bits(x: Array) -> None:
    x = x * 3  # past the 32-bit range
    wrapped = ((x + 2**31) % 2**32) - 2**31
    got = store_as(x, I32)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, wrapped)
    np.testing.assert_array_equal(store_as(x, U32), x % 2**32)
    assert to_host_dtype(store_as(x, U32), U32).dtype == np.uint32


def test_store_as_float_array_into_integers_and_compute_dtypes() -> None:
    got = store_as(np.array([2.9, -2.9, np.nan, 1e20], np.float32), I32)
    assert got.dtype == np.int64 and got.tolist() == [2, -2, 0, 2**31 - 1]
    assert store_as(np.array([3, 4], np.int32), F32).dtype == np.float32
    assert {dt: compute_dtype(dt) for dt in DataType} == {
        F32: np.float32, BF16: np.float32, BF8: np.float32, I32: np.int64, U32: np.int64}


def test_every_op_is_one_record_beside_its_builder_method() -> None:
    """An op is defined once: its record is registered by the builder method it decorates, in
    the op's family file (`ttflow/_ir/ops/<family>.py`), and every record has its method."""
    import inspect

    from ttflow import ProgramBuilder
    from ttflow._ir.record import REGISTRY

    assert OPS is REGISTRY
    families = set()
    for name, record in OPS.items():
        method = inspect.unwrap(getattr(ProgramBuilder, name))
        module = method.__module__
        assert module.startswith("ttflow._ir.ops."), (name, module)
        families.add(module.rsplit(".", 1)[1])
    assert families == {"eltwise", "reduction", "matmul_conv", "data_movement", "normalization", "creation",
                        "indexing", "collectives", "cache"}


def test_the_registry_is_complete_whatever_part_of_the_ir_is_imported_first() -> None:
    import subprocess
    import sys

    code = "import ttflow._ir.record as r; print(len(r.REGISTRY))"  # before anything imports the builder
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == len(OPS)
