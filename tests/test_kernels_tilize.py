"""tilize/untilize against a plain-numpy reference, over shapes, dtypes, strides and `out=`."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ttflow as tt

DTYPES = [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint32), np.dtype(np.int32)]
dims = st.one_of(st.integers(1, 100), st.sampled_from([16, 32, 48, 64, 96]))
outer = st.lists(st.integers(1, 3), min_size=0, max_size=2)
# Rank 1-4: up to two small batch dims in front of (h, w); rank 1 is a single row.
shapes = st.one_of(
    st.tuples(dims),
    st.tuples(outer, dims, dims).map(lambda t: (*t[0], t[1], t[2])),
)


def numpy_tilize(x: np.ndarray) -> np.ndarray:
    """SPEC's TILE order with np.pad and reshape/transpose: (batch, tile row, tile col, face row,
    face col, row in face, col in face)."""
    a = x.reshape(1, -1) if x.ndim == 1 else x
    h, w = a.shape[-2:]
    a = a.reshape(-1, h, w)
    a = np.pad(a, ((0, 0), (0, -h % 32), (0, -w % 32)))
    b, ph, pw = a.shape
    t = a.reshape(b, ph // 32, 2, 16, pw // 32, 2, 16).transpose(0, 1, 4, 2, 5, 3, 6)
    return t.reshape(-1)


def numpy_untilize(tiles: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    h, w = (1, shape[0]) if len(shape) == 1 else shape[-2:]
    ph, pw = -(-h // 32) * 32, -(-w // 32) * 32
    b = tiles.size // (ph * pw)
    t = tiles.reshape(b, ph // 32, pw // 32, 2, 2, 16, 16).transpose(0, 1, 3, 5, 2, 4, 6)
    return t.reshape(b, ph, pw)[:, :h, :w].reshape(shape)


def make(shape: tuple[int, ...], dtype: np.dtype, seed: int) -> np.ndarray:
    bits = np.random.default_rng(seed).integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
    if dtype.itemsize == 2:
        return (bits >> 16).astype(np.uint16).view(dtype)  # any bit pattern, NaNs included
    return bits.view(dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}"))


def test_reference_places_element_rc_of_tile_t_where_spec_says() -> None:
    x = np.arange(2 * 64 * 96, dtype=np.int32).reshape(2, 64, 96)
    flat = numpy_tilize(x)
    for b, r, c in [(0, 0, 0), (0, 17, 5), (1, 40, 70), (1, 63, 95), (0, 15, 16)]:
        t = (b * 2 + r // 32) * 3 + c // 32
        rr, cc = r % 32, c % 32
        assert flat[t * 1024 + ((rr // 16) * 2 + cc // 16) * 256 + (rr % 16) * 16 + cc % 16] == x[b, r, c]


@given(shapes, st.sampled_from(DTYPES), st.integers(0, 2**16))
def test_tilize_matches_reference_and_round_trips(shape: tuple[int, ...], dtype: np.dtype, seed: int) -> None:
    x = make(shape, dtype, seed)
    tiles = tt.kernels.tilize(x)
    assert tiles.dtype == dtype and tiles.ndim == 1
    same_bits(tiles, numpy_tilize(x))
    same_bits(numpy_untilize(tiles, shape), x)
    same_bits(tt.kernels.untilize(tiles, shape), x)


@given(st.tuples(st.integers(2, 70), st.integers(2, 70)), st.sampled_from(DTYPES),
       st.sampled_from(["transpose", "step", "reverse", "column slice", "batch step"]), st.integers(0, 99))
def test_non_contiguous_inputs(shape: tuple[int, int], dtype: np.dtype, kind: str, seed: int) -> None:
    base = make((2, shape[0] * 2, shape[1] * 2), dtype, seed)
    x = {
        "transpose": base[0].T,
        "step": base[0, ::2, ::2],
        "reverse": base[1, ::-1, 1:],
        "column slice": base[:, 1:, 3:],  # last dim contiguous, rows strided
        "batch step": base[::-1, ::3],
    }[kind]
    assert not x.flags.c_contiguous
    same_bits(tt.kernels.tilize(x), numpy_tilize(np.ascontiguousarray(x)))


@given(shapes, st.sampled_from(DTYPES))
def test_out_is_filled_and_returned(shape: tuple[int, ...], dtype: np.dtype) -> None:
    x = make(shape, dtype, 2)
    ref = numpy_tilize(x)
    out = np.full(ref.nbytes, 0xAB, np.uint8).view(dtype)  # garbage where the padding goes
    assert tt.kernels.tilize(x, out=out) is out
    same_bits(out, ref)
    back = np.empty(shape, dtype)
    assert tt.kernels.untilize(out, shape, out=back) is back
    same_bits(back, x)


def test_untilize_accepts_tiles_of_any_contiguous_shape() -> None:
    x = make((3, 40, 33), np.dtype(np.float32), 4)
    tiles = tt.kernels.tilize(x)
    same_bits(tt.kernels.untilize(tiles.reshape(-1, 32, 32), x.shape), x)
    same_bits(tt.kernels.untilize(tiles.reshape(2, -1)[:, :].copy(), x.shape), x)


def test_bad_input() -> None:
    f32 = np.ones((4, 4), np.float32)
    with pytest.raises(tt.LayoutError, match="float64"):
        tt.kernels.tilize(np.ones((4, 4)))
    with pytest.raises(tt.LayoutError, match="int16"):
        tt.kernels.tilize(np.ones((4, 4), np.int16))
    with pytest.raises(tt.LayoutError, match="float16"):
        tt.kernels.untilize(np.ones(1024, np.float16), (4, 4))
    with pytest.raises(tt.ShapeError, match="0-d"):
        tt.kernels.tilize(np.float32(1))
    with pytest.raises(tt.ShapeError, match="0-d"):
        tt.kernels.untilize(np.ones(1024, np.float32), ())
    with pytest.raises(tt.ShapeError, match="positive"):
        tt.kernels.tilize(np.ones((0, 4), np.float32))
    with pytest.raises(tt.ShapeError, match="positive"):
        tt.kernels.untilize(np.ones(1024, np.float32), (3, 0, 4))
    with pytest.raises(tt.LayoutError, match="int32"):
        tt.kernels.tilize(f32, out=np.empty(1024, np.int32))
    with pytest.raises(tt.ShapeError, match="1024"):
        tt.kernels.tilize(f32, out=np.empty(1023, np.float32))
    with pytest.raises(tt.ShapeError, match="shape"):
        tt.kernels.tilize(f32, out=np.empty((32, 32), np.float32))
    with pytest.raises(tt.LayoutError, match="contiguous"):
        tt.kernels.tilize(f32, out=np.empty(2048, np.float32)[::2])
    with pytest.raises(tt.ShapeError, match="2048"):
        tt.kernels.untilize(np.ones(1024, np.float32), (33, 1))
    with pytest.raises(tt.ShapeError, match="shape"):
        tt.kernels.untilize(np.ones(1024, np.float32), (4, 4), out=np.empty(16, np.float32))
    with pytest.raises(tt.LayoutError, match="dtype"):
        tt.kernels.untilize(np.ones(1024, np.float32), (4, 4), out=np.empty((4, 4), np.int32))


@pytest.mark.parametrize("shape", [(2, 1100, 1000), (3000, 777), (1, 2080, 1056)])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)])
def test_large_arrays_take_the_streaming_paths(shape: tuple[int, ...], dtype: np.dtype) -> None:
    # Outputs over 8 MiB use streaming stores; (3000, 777) bfloat16 rows are not 16-byte
    # multiples, so its untilize falls back to regular stores.
    if math.prod(shape) * dtype.itemsize <= 8 << 20:
        shape = (3, *shape[1:]) if len(shape) == 3 else (3, *shape)
    x = make(shape, dtype, 3)
    tiles = tt.kernels.tilize(x)
    same_bits(tiles, numpy_tilize(x))
    same_bits(tt.kernels.untilize(tiles, shape), x)
    view = np.empty(x.size + 8, dtype)[3:-5].reshape(shape)  # a destination off 16-byte alignment
    same_bits(tt.kernels.untilize(tiles, shape, out=view), x)
