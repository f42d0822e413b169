"""tilize/untilize against the numpy reshape reference, over shapes, dtypes and strides."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ttflow as tt
from reference import tilize as tilize_reference

DTYPES = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint32), np.dtype(np.int32)]
dims = st.one_of(st.integers(1, 100), st.sampled_from([16, 32, 64, 96]))
shapes = st.lists(dims, min_size=1, max_size=3).flatmap(
    lambda s: st.just(tuple(s)) if len(s) < 3 else st.just((2, *s[1:]))
) | st.tuples(st.integers(1, 2), st.integers(1, 3), dims, dims)


def make(shape: tuple[int, ...], dtype: np.dtype, seed: int) -> np.ndarray:
    r = np.random.default_rng(seed)
    return (r.standard_normal(shape) * 1000).astype(dtype)


@given(shapes, st.sampled_from(DTYPES), st.integers(0, 2**16))
def test_tilize_matches_reference_and_round_trips(shape: tuple[int, ...], dtype: np.dtype, seed: int) -> None:
    x = make(shape, dtype, seed)
    tiles = tt.kernels.tilize(x)
    assert tiles.dtype == dtype and tiles.ndim == 1
    np.testing.assert_array_equal(tiles.view(np.uint8), tilize_reference(x).view(np.uint8))
    np.testing.assert_array_equal(tt.kernels.untilize(tiles, shape), x)


@given(st.tuples(st.integers(2, 70), st.integers(2, 70)), st.sampled_from(DTYPES),
       st.sampled_from(["transpose", "step", "reverse"]))
def test_non_contiguous_inputs(shape: tuple[int, int], dtype: np.dtype, kind: str) -> None:
    base = make((shape[0] * 2, shape[1] * 2), dtype, 1)
    x = {"transpose": base.T, "step": base[::2, ::2], "reverse": base[::-1, 1:]}[kind]
    assert not x.flags.c_contiguous
    np.testing.assert_array_equal(tt.kernels.tilize(x), tilize_reference(np.ascontiguousarray(x)))


def test_out_is_filled_and_padding_is_zeroed() -> None:
    x = make((3, 40, 33), np.dtype(np.float32), 2)
    out = np.full(3 * 2 * 2 * 1024, 7.0, np.float32)  # garbage where padding goes
    assert tt.kernels.tilize(x, out=out) is out
    np.testing.assert_array_equal(out, tilize_reference(x))
    back = np.empty((3, 40, 33), np.float32)
    assert tt.kernels.untilize(out, (3, 40, 33), out=back) is back
    np.testing.assert_array_equal(back, x)


def test_bad_input() -> None:
    with pytest.raises(tt.LayoutError, match="float64"):
        tt.kernels.tilize(np.ones((4, 4)))
    with pytest.raises(tt.LayoutError):
        tt.kernels.tilize(np.ones((4, 4), np.int16))
    with pytest.raises(tt.ShapeError, match="0-d"):
        tt.kernels.tilize(np.float32(1))
    with pytest.raises(tt.ShapeError):
        tt.kernels.tilize(np.ones((0, 4), np.float32))
    with pytest.raises(tt.LayoutError):
        tt.kernels.tilize(np.ones((4, 4), np.float32), out=np.empty(1024, np.int32))
    with pytest.raises(tt.ShapeError):
        tt.kernels.tilize(np.ones((4, 4), np.float32), out=np.empty(1023, np.float32))
    with pytest.raises(tt.ShapeError):
        tt.kernels.untilize(np.ones(1024, np.float32), (33, 1))


@pytest.mark.parametrize("shape", [(2, 1100, 1000), (3000, 777)])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)])
def test_large_arrays_take_the_streaming_paths(shape: tuple[int, ...], dtype: np.dtype) -> None:
    # Outputs over 8 MiB use streaming stores and, for untilize, a blocked two-pass copy.
    x = make(shape, dtype, 3)
    if x.nbytes <= 8 << 20:
        x = np.concatenate([x, x, x])
        shape = x.shape
    tiles = tt.kernels.tilize(x)
    np.testing.assert_array_equal(tiles.view(np.uint8), tilize_reference(x).view(np.uint8))
    np.testing.assert_array_equal(tt.kernels.untilize(tiles, shape), x)
    banks = np.zeros((12, -(-tiles.size // 1024 // 12) * 1024 * dtype.itemsize + 64), np.uint8)
    tt.kernels.tilize_to_banks(x, banks, 64, 1024 * dtype.itemsize)
    np.testing.assert_array_equal(tt.kernels.untilize_from_banks(banks, 64, 1024 * dtype.itemsize, shape, dtype), x)
