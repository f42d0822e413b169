"""Interleaved scatter/gather: every page at the formula's bank and address, nothing else touched."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ttflow as tt
from reference import tilize as tilize_reference

geometry = st.tuples(
    st.integers(1, 6),  # banks
    st.integers(1, 96),  # page size
    st.integers(0, 64),  # alignment gap
    st.integers(0, 200),  # address
    st.integers(1, 30),  # pages
    st.integers(0, 7),  # first page
)


def page_location(i: int, nbanks: int, address: int, aligned: int) -> tuple[int, int]:
    return i % nbanks, address + (i // nbanks) * aligned


@given(geometry, st.integers(0, 2**16))
def test_scatter_then_gather(g: tuple[int, ...], seed: int) -> None:
    nbanks, page, gap, address, n, first = g
    aligned = page + gap
    depth = address + ((first + n - 1) // nbanks + 1) * aligned
    banks = np.random.default_rng(seed).integers(0, 256, (nbanks, depth + 5), dtype=np.uint8)
    before = banks.copy()
    pages = np.random.default_rng(seed + 1).integers(0, 256, (n, page), dtype=np.uint8)
    tt.kernels.scatter_pages(pages, banks, address, page, aligned, first)
    expected = before.copy()
    for j in range(n):
        bank, at = page_location(first + j, nbanks, address, aligned)
        expected[bank, at : at + page] = pages[j]
    np.testing.assert_array_equal(banks, expected)  # pages where the formula says, gaps untouched
    np.testing.assert_array_equal(tt.kernels.gather_pages(banks, address, page, aligned, n, first), pages.ravel())


@given(st.tuples(st.integers(1, 3), st.integers(1, 70), st.integers(1, 70)),
       st.sampled_from([np.float32, ml_dtypes.bfloat16, np.int32]), st.integers(1, 5), st.integers(0, 3))
def test_fused_tilize_matches_two_steps(shape: tuple[int, int, int], dtype: type, nbanks: int, first: int) -> None:
    x = (np.random.default_rng(0).standard_normal(shape) * 100).astype(dtype)
    tile_bytes = 1024 * np.dtype(dtype).itemsize
    aligned = tile_bytes + 32
    tiles = tilize_reference(x).view(np.uint8)
    n = tiles.size // tile_bytes
    depth = ((first + n - 1) // nbanks + 1) * aligned + 64
    fused = np.zeros((nbanks, depth), np.uint8)
    tt.kernels.tilize_to_banks(x, fused, 64, aligned, first)
    two = np.zeros_like(fused)
    tt.kernels.scatter_pages(tiles, two, 64, tile_bytes, aligned, first)
    np.testing.assert_array_equal(fused, two)
    back = tt.kernels.untilize_from_banks(fused, 64, aligned, shape, dtype, first)
    np.testing.assert_array_equal(back, x)


def test_fused_bfp8_matches_two_steps() -> None:
    x = np.random.default_rng(1).standard_normal((2, 45, 70)).astype(np.float32)
    packed = tt.kernels.pack_bfloat8_b(x)
    fused = np.zeros((3, 8 * 1120), np.uint8)
    tt.kernels.pack_bfloat8_b_to_banks(x, fused, 0, 1120, 1)
    two = np.zeros_like(fused)
    tt.kernels.scatter_pages(packed, two, 0, 1088, 1120, 1)
    np.testing.assert_array_equal(fused, two)
    np.testing.assert_array_equal(tt.kernels.unpack_bfloat8_b_from_banks(fused, 0, 1120, x.shape, 1),
                                  tt.kernels.unpack_bfloat8_b(packed, x.shape))


def test_bad_geometry() -> None:
    banks = np.zeros((4, 1024), np.uint8)
    pages = np.zeros(256, np.uint8)
    with pytest.raises(tt.ShapeError, match="smaller"):
        tt.kernels.scatter_pages(pages, banks, 0, 128, 64)
    with pytest.raises(tt.ShapeError, match="past the bank"):
        tt.kernels.scatter_pages(pages, banks, 1000, 128, 128)
    with pytest.raises(tt.ShapeError, match="whole number"):
        tt.kernels.scatter_pages(pages, banks, 0, 100, 128)
    with pytest.raises(tt.LayoutError):
        tt.kernels.scatter_pages(pages, banks.astype(np.int8), 0, 128, 128)
    with pytest.raises(tt.ShapeError):
        tt.kernels.gather_pages(banks[:, ::2], 0, 128, 128, 2)
    with pytest.raises(tt.ShapeError):
        tt.kernels.gather_pages(banks, -1, 128, 128, 2)
    with pytest.raises(tt.ShapeError, match="past the bank"):
        tt.kernels.tilize_to_banks(np.ones((64, 64), np.float32), banks, 0, 4096)
    assert not banks.any()
