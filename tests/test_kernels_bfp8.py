"""BFLOAT8_B packing byte for byte against SPEC's rule, and its error bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ttflow as tt
from reference import bfp8_pack_reference, bfp8_unpack_reference
from reference import tilize as tilize_reference

finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
shapes = st.tuples(st.integers(1, 40), st.integers(1, 40))


def reference_pack(x: np.ndarray) -> bytes:
    t = tilize_reference(x.astype(np.float32))
    return b"".join(bfp8_pack_reference(t[i : i + 1024]) for i in range(0, t.size, 1024))


@given(hnp.arrays(np.float32, shapes, elements=finite | st.sampled_from([0.0, -0.0, 1.5, 2.5, 1e-40])))
def test_pack_is_byte_exact(x: np.ndarray) -> None:
    packed = tt.kernels.pack_bfloat8_b(x)
    assert packed.tobytes() == reference_pack(x)


@given(hnp.arrays(np.float32, shapes, elements=st.floats(-1000, 1000, width=32)))
def test_unpack_and_error_bound(x: np.ndarray) -> None:
    packed = tt.kernels.pack_bfloat8_b(x)
    back = tt.kernels.unpack_bfloat8_b(packed, x.shape)
    ref = np.concatenate([bfp8_unpack_reference(packed[i : i + 1088].tobytes())
                          for i in range(0, packed.size, 1088)])
    np.testing.assert_array_equal(tilize_reference(back), ref)
    # Each value is within half a step of its row's grid 2^(shared-133), unless it was clamped
    # (then it is the largest magnitude, 127 steps) or flushed (subnormal).
    exps = np.concatenate([packed[i : i + 64] for i in range(0, packed.size, 1088)]).astype(np.int64)
    step = np.repeat(2.0 ** (exps - 133), 16)
    t_in, t_out = tilize_reference(x).astype(np.float64), tilize_reference(back).astype(np.float64)
    clamped = np.abs(t_out) == 127 * step
    flushed = (np.abs(t_in) < 2.0**-126) & (t_out == 0)
    assert np.all((np.abs(t_in - t_out) <= step / 2) | clamped | flushed)
    assert np.all(np.abs(t_in - t_out)[clamped] <= step[clamped])


def test_rounding_ties_to_even_and_clamp() -> None:
    # Row shared exponent from 64.0 (2^6): step = 2^(6+127-133) = 1.
    row = np.zeros((1, 16), np.float32)
    row[0, :6] = [64.0, 2.5, 3.5, -2.5, 126.6, 127.7]
    tile = tt.kernels.pack_bfloat8_b(row)
    assert tile[0] == 127 + 6
    assert list(tile[64:70]) == [64, 2, 4, 0x80 | 2, 127, 127]  # ties to even; 127.7 clamps
    assert tile[1:16].tolist() == [0] * 15  # all-zero rows (padding) have exponent 0


def test_zero_sign_and_subnormals() -> None:
    x = np.array([[-0.0, 1e-40, -1e-40, 1.0]], np.float32)
    tile = tt.kernels.pack_bfloat8_b(x)
    assert list(tile[64:68]) == [0x80, 0, 0x80, 64]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_raise(bad: float) -> None:
    x = np.ones((3, 5), np.float32)
    x[2, 4] = bad
    with pytest.raises(tt.LayoutError, match="NaN or infinity.*index 14"):
        tt.kernels.pack_bfloat8_b(x)
    banks = np.zeros((2, 4096), np.uint8)
    with pytest.raises(tt.LayoutError):
        tt.kernels.pack_bfloat8_b_to_banks(x, banks, 0, 1088)
    assert not banks.any()


def test_bad_input() -> None:
    with pytest.raises(tt.LayoutError):
        tt.kernels.pack_bfloat8_b(np.ones((2, 2), np.int32))
    with pytest.raises(tt.ShapeError):
        tt.kernels.unpack_bfloat8_b(np.zeros(1087, np.uint8), (2, 2))
    with pytest.raises(tt.ShapeError):
        tt.kernels.pack_bfloat8_b(np.float32(1))
