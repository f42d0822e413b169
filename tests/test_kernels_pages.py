"""Interleaved pages: every page at the formula's bank and address, nothing else touched; the
fused bank kernels equal both the two-step composition and a plain-numpy placement."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ttflow as tt

geometry = st.tuples(
    st.integers(1, 6),  # banks
    st.integers(1, 96),  # page size
    st.integers(0, 64),  # alignment gap
    st.integers(0, 200),  # address
    st.integers(1, 30),  # pages
    st.integers(0, 7),  # first page
)


def page_at(banks: np.ndarray, i: int, address: int, aligned: int, size: int) -> np.ndarray:
    """Buffer page i, read with plain slicing where SPEC's interleaving puts it."""
    at = address + (i // banks.shape[0]) * aligned
    return banks[i % banks.shape[0], at : at + size]


def place(banks: np.ndarray, pages: np.ndarray, address: int, aligned: int, first: int) -> np.ndarray:
    """The numpy reference of a scatter: a copy of `banks` with each page sliced into place."""
    out = banks.copy()
    for j, page in enumerate(pages.reshape(-1, pages.shape[-1])):
        page_at(out, first + j, address, aligned, page.size)[:] = page
    return out


def face_order(x: np.ndarray) -> np.ndarray:
    h, w = x.shape[-2:]
    a = np.pad(x.reshape(-1, h, w), ((0, 0), (0, -h % 32), (0, -w % 32)))
    b, ph, pw = a.shape
    return a.reshape(b, ph // 32, 2, 16, pw // 32, 2, 16).transpose(0, 1, 4, 2, 5, 3, 6).reshape(-1)


def random_banks(seed: int, nbanks: int, depth: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (nbanks, depth), dtype=np.uint8)


@given(geometry, st.integers(0, 2**16))
def test_scatter_then_gather(g: tuple[int, ...], seed: int) -> None:
    nbanks, page, gap, address, n, first = g
    aligned = page + gap
    depth = address + ((first + n - 1) // nbanks + 1) * aligned + 5
    banks = random_banks(seed, nbanks, depth)  # random bytes: any stray write shows
    pages = random_banks(seed + 1, n, page)
    expected = place(banks, pages, address, aligned, first)
    tt.kernels.scatter_pages(pages, banks, address, page, aligned, first)
    np.testing.assert_array_equal(banks, expected)  # pages where the formula says, gaps untouched
    for j in range(n):
        np.testing.assert_array_equal(page_at(banks, first + j, address, aligned, page), pages[j])
    got = tt.kernels.gather_pages(banks, address, page, aligned, n, first)
    assert got.dtype == np.uint8 and got.shape == (n * page,)
    np.testing.assert_array_equal(got, pages.ravel())


def test_gather_into_an_out_of_any_dtype() -> None:
    x = np.arange(24 * 16, dtype=np.float32).reshape(24, 16)  # 24 pages of one 64-byte row
    banks = np.zeros((5, 6 * 96), np.uint8)
    tt.kernels.scatter_pages(x, banks, 0, 64, 96)
    out = np.empty((24, 16), np.float32)
    assert tt.kernels.gather_pages(banks, 0, 64, 96, 24, out=out) is out
    np.testing.assert_array_equal(out, x)


@pytest.mark.parametrize("page", [4096, 2048 + 32, 1088])
def test_large_copies_take_the_streaming_path(page: int) -> None:
    n = (12 << 20) // page  # over 8 MiB: streaming stores
    pages = np.random.default_rng(page).integers(0, 256, (n, page), dtype=np.uint8)
    banks = random_banks(0, 12, 8 + (n // 12 + 1) * (page + 16))
    expected = place(banks, pages, 8, page + 16, 3 % 12)
    tt.kernels.scatter_pages(pages, banks, 8, page, page + 16, 3 % 12)
    np.testing.assert_array_equal(banks, expected)
    np.testing.assert_array_equal(tt.kernels.gather_pages(banks, 8, page, page + 16, n, 3), pages.ravel())


@given(st.tuples(st.integers(1, 3), st.integers(1, 70), st.integers(1, 70)),
       st.sampled_from([np.float32, ml_dtypes.bfloat16, np.int32, np.uint32]),
       st.integers(1, 5), st.integers(0, 3), st.sampled_from([0, 32, 96]))
def test_fused_tilize(shape: tuple[int, int, int], dtype: type, nbanks: int, first: int, gap: int) -> None:
    x = (np.random.default_rng(0).standard_normal(shape) * 100).astype(dtype)
    tile_bytes = 1024 * np.dtype(dtype).itemsize
    aligned = tile_bytes + gap
    tiles = face_order(x).view(np.uint8).reshape(-1, tile_bytes)
    depth = 64 + ((first + len(tiles) - 1) // nbanks + 1) * aligned + 8
    blank = random_banks(1, nbanks, depth)
    fused = blank.copy()
    tt.kernels.tilize_to_banks(x, fused, 64, aligned, first)
    np.testing.assert_array_equal(fused, place(blank, tiles, 64, aligned, first))  # numpy reference
    two = blank.copy()
    tt.kernels.scatter_pages(tt.kernels.tilize(x), two, 64, tile_bytes, aligned, first)
    np.testing.assert_array_equal(fused, two)  # the two-step composition
    back = tt.kernels.untilize_from_banks(fused, 64, aligned, shape, dtype, first)
    assert back.dtype == np.dtype(dtype) and back.shape == shape
    np.testing.assert_array_equal(back, x)
    out = np.empty(shape, dtype)
    assert tt.kernels.untilize_from_banks(fused, 64, aligned, shape, dtype, first, out=out) is out
    np.testing.assert_array_equal(out, x)


def test_fused_bfloat8_b() -> None:
    from test_kernels_bfp8 import pack_tile

    x = np.random.default_rng(1).standard_normal((2, 45, 40)).astype(np.float32)
    t = face_order(x)
    reference = np.frombuffer(b"".join(pack_tile(t[i : i + 1024]) for i in range(0, t.size, 1024)),
                              np.uint8).reshape(-1, 1088)
    blank = random_banks(2, 3, 8 * 1120)
    fused = blank.copy()
    tt.kernels.pack_bfloat8_b_to_banks(x, fused, 0, 1120, 1)
    np.testing.assert_array_equal(fused, place(blank, reference, 0, 1120, 1))
    two = blank.copy()
    tt.kernels.scatter_pages(tt.kernels.pack_bfloat8_b(x), two, 0, 1088, 1120, 1)
    np.testing.assert_array_equal(fused, two)
    got = tt.kernels.unpack_bfloat8_b_from_banks(fused, 0, 1120, x.shape, 1)
    np.testing.assert_array_equal(got, tt.kernels.unpack_bfloat8_b(reference.ravel(), x.shape))
    out = np.empty(x.shape, np.float32)
    assert tt.kernels.unpack_bfloat8_b_from_banks(fused, 0, 1120, x.shape, 1, out=out) is out
    np.testing.assert_array_equal(out, got)


def test_bad_geometry_raises_before_touching_memory() -> None:
    banks = np.zeros((4, 1024), np.uint8)
    pages = np.zeros(256, np.uint8)
    f32 = np.ones((64, 64), np.float32)
    with pytest.raises(tt.ShapeError, match="smaller"):
        tt.kernels.scatter_pages(pages, banks, 0, 128, 64)
    with pytest.raises(tt.ShapeError, match="past the bank"):
        tt.kernels.scatter_pages(pages, banks, 1000, 128, 128)
    with pytest.raises(tt.ShapeError, match="past the bank"):
        tt.kernels.gather_pages(banks, 0, 128, 128, 33)
    with pytest.raises(tt.ShapeError, match="whole number"):
        tt.kernels.scatter_pages(pages, banks, 0, 100, 128)
    with pytest.raises(tt.ShapeError, match="positive"):
        tt.kernels.scatter_pages(pages, banks, 0, 0, 128)
    with pytest.raises(tt.ShapeError, match="non-negative"):
        tt.kernels.gather_pages(banks, -1, 128, 128, 2)
    with pytest.raises(tt.ShapeError, match="non-negative"):
        tt.kernels.scatter_pages(pages, banks, 0, 128, 128, first_page=-1)
    with pytest.raises(tt.LayoutError, match="uint8"):
        tt.kernels.scatter_pages(pages, banks.astype(np.int8), 0, 128, 128)
    with pytest.raises(tt.ShapeError, match="2-D"):
        tt.kernels.gather_pages(banks[:, ::2], 0, 128, 128, 2)
    with pytest.raises(tt.ShapeError, match="2-D"):
        tt.kernels.gather_pages(banks.reshape(-1), 0, 128, 128, 2)
    with pytest.raises(tt.ShapeError, match="256 bytes"):
        tt.kernels.gather_pages(banks, 0, 128, 128, 2, out=np.empty(255, np.uint8))
    with pytest.raises(tt.ShapeError, match="past the bank"):
        tt.kernels.tilize_to_banks(f32, banks, 0, 4096)
    with pytest.raises(tt.ShapeError, match="smaller"):
        tt.kernels.tilize_to_banks(f32, banks, 0, 1024)
    with pytest.raises(tt.LayoutError, match="float64"):
        tt.kernels.tilize_to_banks(f32.astype(np.float64), banks, 0, 4096)
    with pytest.raises(tt.ShapeError, match="past the bank"):
        tt.kernels.pack_bfloat8_b_to_banks(f32, banks, 0, 1088)
    with pytest.raises(tt.ShapeError, match="past the bank"):
        tt.kernels.untilize_from_banks(banks, 0, 4096, (64, 64), np.float32)
    with pytest.raises(tt.LayoutError, match="int8"):
        tt.kernels.untilize_from_banks(banks, 0, 1024, (4, 4), np.int8)
    with pytest.raises(tt.ShapeError, match="0-d"):
        tt.kernels.unpack_bfloat8_b_from_banks(banks, 0, 1088, ())
    assert not banks.any()
