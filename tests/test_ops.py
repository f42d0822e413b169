"""Each op's compute against numpy written here (and math.erf for GELU)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ttflow._ops import OPS, erf

floats = hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6),
                    elements=st.floats(-50, 50, width=32))


@given(floats)
def test_elementwise_ops(x: np.ndarray) -> None:
    y = x[::-1].copy() if x.ndim == 1 else x
    np.testing.assert_array_equal(OPS["add"].compute([x, y], None), x + y)
    np.testing.assert_array_equal(OPS["sub"].compute([x], 2.5), x - np.float32(2.5))
    np.testing.assert_array_equal(OPS["mul"].compute([x, y], None), x * y)
    np.testing.assert_array_equal(OPS["gt"].compute([x], 0.0), (x > 0).astype(np.float32))
    np.testing.assert_array_equal(OPS["relu"].compute([x], None), np.where(x > 0, x, 0))
    np.testing.assert_array_equal(OPS["neg"].compute([x], None), -x)
    assert OPS["add"].compute([x], 1.0).dtype == np.float32


@given(floats)
def test_gelu_matches_math_erf(x: np.ndarray) -> None:
    ref = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(float).ravel()])
    np.testing.assert_allclose(OPS["gelu"].compute([x], None).ravel(), ref, rtol=1e-6, atol=1e-7)


def test_erf_is_accurate_everywhere() -> None:
    xs = np.concatenate([np.linspace(-8, 8, 4001), [0.0, 0.5, -0.5, 4.0, -4.0, 1e-8]])
    np.testing.assert_allclose(erf(xs), [math.erf(v) for v in xs], rtol=1e-13, atol=1e-15)


@given(floats, st.integers(-3, 2))
def test_reductions_and_softmax(x: np.ndarray, axis: int) -> None:
    axis = axis % x.ndim
    np.testing.assert_allclose(OPS["sum"].compute([x], None, axis=axis), x.sum(axis, keepdims=True), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(OPS["max"].compute([x], None, axis=axis), x.max(axis, keepdims=True))
    s = OPS["softmax"].compute([x], None, axis=axis)
    e = np.exp(x.astype(np.float64) - x.max(axis, keepdims=True))
    np.testing.assert_allclose(s, e / e.sum(axis, keepdims=True), rtol=1e-5, atol=1e-6)


def test_matmul_transpose_and_integers() -> None:
    r = np.random.default_rng(0)
    a, b = r.standard_normal((2, 3, 4)).astype(np.float32), r.standard_normal((4, 5)).astype(np.float32)
    np.testing.assert_allclose(OPS["matmul"].compute([a, b], None), np.einsum("bij,jk->bik", a, b), rtol=1e-5)
    np.testing.assert_array_equal(OPS["transpose"].compute([a], None), a.transpose(0, 2, 1))
    i = np.array([[2**31 - 1, -5]], np.int64)
    np.testing.assert_array_equal(OPS["add"].compute([i], 1.0), [[2**31, -4]])  # wraps when stored
    np.testing.assert_array_equal(OPS["typecast"].compute([np.array([1.7, -1.7], np.float32)], None, dtype="int32"), [1, -1])


@pytest.mark.parametrize("op", ["exp", "sqrt", "reciprocal"])
def test_float_unary(op: str) -> None:
    x = np.array([0.25, 1.0, 4.0], np.float32)
    ref = {"exp": np.exp(x), "sqrt": np.sqrt(x), "reciprocal": 1 / x}[op]
    np.testing.assert_allclose(OPS[op].compute([x], None), ref, rtol=1e-6)


def test_reshape() -> None:
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_array_equal(OPS["reshape"].compute([x], None, shape=(6, 4)), x.reshape(6, 4))
    np.testing.assert_array_equal(OPS["reshape"].compute([x], None, shape=[24]), x.reshape(24))
