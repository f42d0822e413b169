"""The kernel layer: tilize/untilize, BFLOAT8_B pack/unpack, interleaved page copies.

These are the Cython kernels themselves (`ttflow/_kernels`), behind argument checks: each check
raises before any byte moves, and every loop runs with the GIL released so a worker thread's copy
overlaps the event loop and the other queue. Pass `out=` to fill a preallocated result: a fresh
allocation costs 40-65% of copy bandwidth on a small machine.

Bank memory is one 2-D uint8 C-contiguous array `banks[bank, address]`; page `i` of an
interleaved buffer lives in bank `i % banks.shape[0]` at `address + (i // banks.shape[0]) *
aligned_page_size`.

BFLOAT8_B follows tt-metal's host packer byte for byte (SPEC section 1). NaN and infinity have
no encoding, so packing one raises `LayoutError`; subnormal float32 inputs pack to 0x00.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from ._errors import LayoutError, ShapeError
from ._kernels import _bfp8, _tiles
from ._types import check_shape

__all__ = [
    "tilize",
    "untilize",
    "pack_bfloat8_b",
    "unpack_bfloat8_b",
    "scatter_pages",
    "gather_pages",
    "tilize_to_banks",
    "untilize_from_banks",
    "pack_bfloat8_b_to_banks",
    "unpack_bfloat8_b_from_banks",
    "BFLOAT8_B_TILE_BYTES",
]

Array = np.ndarray[Any, Any]
BFLOAT8_B_TILE_BYTES = 1088
_ELEMENT_DTYPES = (
    np.dtype(np.float32),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.uint32),
    np.dtype(np.int32),
)


def _element_dtype(dtype: Any) -> np.dtype[Any]:
    dt = np.dtype(dtype)
    if dt not in _ELEMENT_DTYPES:
        raise LayoutError(
            f"unsupported dtype {dt}: tiles hold float32, bfloat16 (ml_dtypes), uint32 or int32"
        )
    return dt


def _geometry(shape: Any) -> tuple[tuple[int, ...], int, int, int]:
    """(shape, batch, h, w) of a logical shape; rank 1 is one row."""
    dims = check_shape(shape)
    if len(dims) == 1:
        return dims, 1, 1, dims[0]
    return dims, math.prod(dims[:-2]), dims[-2], dims[-1]


def _num_tiles(batch: int, h: int, w: int) -> int:
    return batch * -(-h // 32) * -(-w // 32)


def _as_3d(array: Array, batch: int, h: int, w: int) -> Array:
    # A view whenever numpy can express one (any strides in the last two dims); else a copy.
    return array.reshape(batch, h, w)


def _out(out: Array | None, nbytes: int, dtype: np.dtype[Any], what: str,
         shape: tuple[int, ...] | None = None) -> Array:
    if out is None:
        return np.empty(nbytes // dtype.itemsize, dtype)
    if shape is not None and isinstance(out, np.ndarray) and out.shape != shape:
        raise ShapeError(f"{what}: out has shape {out.shape}, the result has shape {shape}")
    if not isinstance(out, np.ndarray) or not out.flags.c_contiguous:
        raise LayoutError(f"{what}: out must be a C-contiguous numpy array")
    if out.dtype != dtype:
        raise LayoutError(f"{what}: out has dtype {out.dtype}, expected {dtype}")
    if out.nbytes != nbytes:
        raise ShapeError(f"{what}: out holds {out.nbytes} bytes, {nbytes} are needed")
    return out


def _shaped(result: Array, out: Array | None, dims: tuple[int, ...]) -> Array:
    """`out` itself when the caller gave one (checked to have the logical shape), else a view."""
    return result.reshape(dims) if out is None else out


def _check_banks(banks: Any) -> None:
    if not isinstance(banks, np.ndarray) or banks.ndim != 2 or not banks.flags.c_contiguous:
        raise ShapeError("banks must be a 2-D C-contiguous array (bank, address)")
    if banks.dtype != np.uint8:
        raise LayoutError(f"banks must be uint8, got {banks.dtype}")
    if not banks.flags.writeable:
        raise LayoutError("banks must be writeable")


def _check_pages(banks: Array, address: int, page_size: int, aligned: int, num_pages: int,
                 first_page: int) -> None:
    _check_banks(banks)
    if page_size <= 0:
        raise ShapeError(f"page size must be positive, got {page_size}")
    if aligned < page_size:
        raise ShapeError(f"aligned page size {aligned} is smaller than the page size {page_size}")
    if address < 0 or first_page < 0 or num_pages < 0:
        raise ShapeError("address, first page and page count must be non-negative")
    if num_pages == 0:
        return
    nbanks, bank_bytes = banks.shape
    last = first_page + num_pages - 1
    end = address + (last // nbanks) * aligned + page_size
    if end > bank_bytes:
        raise ShapeError(f"pages would end at byte {end}, past the bank's {bank_bytes} bytes")


def tilize(array: Any, out: Array | None = None) -> Array:
    """Pads to whole tiles and reorders into tiles of faces; returns a 1-D array.

    Tile t's element (r, c) lands at t*1024 + ((r//16)*2 + c//16)*256 + (r%16)*16 + c%16; tiles
    run row-major over the tile grid with the batch dims flattened in front, each batch slice
    padded with zeros on its own. Any strides are accepted (a C-contiguous last dim is fastest).
    `out`: a 1-D C-contiguous array of the same dtype and exactly num_tiles*1024 elements."""
    array = np.asarray(array)
    dt = _element_dtype(array.dtype)
    _, batch, h, w = _geometry(array.shape)
    n = _num_tiles(batch, h, w)
    result = _out(out, n * 1024 * dt.itemsize, dt, "tilize", (n * 1024,))
    _tiles.tilize_into(_as_3d(array, batch, h, w), result, 1, 0, 0, 1024 * dt.itemsize, 0)
    return result


def untilize(tiles: Any, shape: Any, out: Array | None = None) -> Array:
    """The logical array of `shape` held by face-ordered tiles (padding dropped)."""
    tiles = np.asarray(tiles)
    dt = _element_dtype(tiles.dtype)
    dims, batch, h, w = _geometry(shape)
    n = _num_tiles(batch, h, w)
    if tiles.size != n * 1024:
        raise ShapeError(f"untilize: {dims} needs {n * 1024} elements of tiles, got {tiles.size}")
    tiles = np.ascontiguousarray(tiles)
    result = _out(out, math.prod(dims) * dt.itemsize, dt, "untilize", dims)
    _tiles.untilize_into(tiles, result, batch, h, w, 1, 0, 0, 1024 * dt.itemsize, 0)
    return _shaped(result, out, dims)


def _float32(array: Any, what: str) -> Array:
    array = np.asarray(array)
    if array.dtype.kind != "f" and array.dtype != np.dtype(ml_dtypes.bfloat16):
        raise LayoutError(f"{what}: BFLOAT8_B packs float arrays, got {array.dtype}")
    return array if array.dtype == np.float32 else array.astype(np.float32)


def _raise_non_finite(array: Array) -> None:
    bad = np.flatnonzero(~np.isfinite(array.reshape(-1)))
    raise LayoutError(
        f"BFLOAT8_B has no encoding for NaN or infinity (first at flat index {int(bad[0])})"
    )


def pack_bfloat8_b(array: Any, out: Array | None = None) -> Array:
    """Tilizes a float array and packs each tile into 1088 BFLOAT8_B bytes.

    float32 is packed as is; other float dtypes (bfloat16, float16, float64) are converted to
    float32 first; integer arrays raise LayoutError. As tt-metal's `convert_u32_to_bfp`: each
    16-value face row shares the largest biased exponent of its values; a value's 24-bit
    significand is shifted right to that exponent (the bits shifted out are dropped), then
    rounded to a 7-bit magnitude, to nearest with ties to even, and clamped to 127. A magnitude
    of 0 packs as 0x00 with no sign bit, as do zeros and subnormals (an all-zero row has
    exponent 0). Unpacking gives magnitude * 2^(exponent - 133) exactly, with the sign.
    NaN and infinity have no encoding: they raise LayoutError naming the first one's flat index
    (found by the exponent scan the pack does anyway; `out`, if given, is then partly written)."""
    array = _float32(array, "pack_bfloat8_b")
    _, batch, h, w = _geometry(array.shape)
    n = _num_tiles(batch, h, w)
    result = _out(out, n * BFLOAT8_B_TILE_BYTES, np.dtype(np.uint8), "pack_bfloat8_b",
                  (n * BFLOAT8_B_TILE_BYTES,))
    if _bfp8.pack_into(_as_3d(array, batch, h, w), result, 1, 0, 0, BFLOAT8_B_TILE_BYTES, 0):
        _raise_non_finite(array)
    return result


def unpack_bfloat8_b(packed: Any, shape: Any, out: Array | None = None) -> Array:
    """The float32 array of `shape` that BFLOAT8_B tiles hold: each byte's magnitude (its low 7
    bits) times 2^(row exponent - 133), exactly, negated if its top bit is set (so 0x80, which
    pack never writes, reads as -0.0)."""
    packed = np.ascontiguousarray(packed)
    if packed.dtype != np.uint8:
        raise LayoutError(f"unpack_bfloat8_b: packed tiles are uint8, got {packed.dtype}")
    dims, batch, h, w = _geometry(shape)
    n = _num_tiles(batch, h, w)
    if packed.size != n * BFLOAT8_B_TILE_BYTES:
        raise ShapeError(
            f"unpack_bfloat8_b: {dims} needs {n * BFLOAT8_B_TILE_BYTES} bytes, got {packed.size}"
        )
    result = _out(out, math.prod(dims) * 4, np.dtype(np.float32), "unpack_bfloat8_b", dims)
    _bfp8.unpack_into(packed, result, batch, h, w, 1, 0, 0, BFLOAT8_B_TILE_BYTES, 0)
    return _shaped(result, out, dims)


def scatter_pages(pages: Any, banks: Array, address: int, page_size: int,
                  aligned_page_size: int, first_page: int = 0) -> None:
    """Writes each page of the contiguous `pages` to its bank and address."""
    if not isinstance(pages, np.ndarray) or not pages.flags.c_contiguous:
        raise LayoutError("pages must be a C-contiguous numpy array")
    if page_size <= 0:
        raise ShapeError(f"page size must be positive, got {page_size}")
    if pages.nbytes % page_size:
        raise ShapeError(f"{pages.nbytes} bytes of pages are not a whole number of {page_size}-byte pages")
    num_pages = pages.nbytes // page_size
    _check_pages(banks, address, page_size, aligned_page_size, num_pages, first_page)
    _tiles.scatter(pages, banks, num_pages, page_size, address, aligned_page_size, first_page)


def gather_pages(banks: Array, address: int, page_size: int, aligned_page_size: int,
                 num_pages: int, first_page: int = 0, out: Array | None = None) -> Array:
    """Reads `num_pages` pages into one contiguous buffer (uint8, or `out` of any dtype)."""
    _check_pages(banks, address, page_size, aligned_page_size, num_pages, first_page)
    nbytes = num_pages * page_size
    if out is None:
        out = np.empty(nbytes, np.uint8)
    elif not isinstance(out, np.ndarray) or not out.flags.c_contiguous or out.nbytes != nbytes:
        raise ShapeError(f"gather_pages: out must be C-contiguous with exactly {nbytes} bytes")
    _tiles.gather(banks, out, num_pages, page_size, address, aligned_page_size, first_page)
    return out


def tilize_to_banks(array: Any, banks: Array, address: int, aligned_page_size: int,
                    first_page: int = 0) -> None:
    """Tilizes straight into bank memory: tile t becomes page first_page + t."""
    array = np.asarray(array)
    dt = _element_dtype(array.dtype)
    _, batch, h, w = _geometry(array.shape)
    tile_bytes = 1024 * dt.itemsize
    _check_pages(banks, address, tile_bytes, aligned_page_size, _num_tiles(batch, h, w), first_page)
    _tiles.tilize_into(_as_3d(array, batch, h, w), banks, banks.shape[0], banks.shape[1],
                       address, aligned_page_size, first_page)


def untilize_from_banks(banks: Array, address: int, aligned_page_size: int, shape: Any,
                        dtype: Any, first_page: int = 0, out: Array | None = None) -> Array:
    """The logical array whose tiles are pages first_page.. of an interleaved buffer."""
    dt = _element_dtype(dtype)
    dims, batch, h, w = _geometry(shape)
    _check_pages(banks, address, 1024 * dt.itemsize, aligned_page_size, _num_tiles(batch, h, w), first_page)
    result = _out(out, math.prod(dims) * dt.itemsize, dt, "untilize_from_banks", dims)
    _tiles.untilize_into(banks, result, batch, h, w, banks.shape[0], banks.shape[1], address,
                         aligned_page_size, first_page)
    return _shaped(result, out, dims)


def pack_bfloat8_b_to_banks(array: Any, banks: Array, address: int, aligned_page_size: int,
                            first_page: int = 0) -> None:
    """Packs straight into bank memory, one 1088-byte page per tile.

    NaN or infinity raise LayoutError before any byte is written (a read-only scan first)."""
    array = _float32(array, "pack_bfloat8_b_to_banks")
    _, batch, h, w = _geometry(array.shape)
    _check_pages(banks, address, BFLOAT8_B_TILE_BYTES, aligned_page_size, _num_tiles(batch, h, w), first_page)
    if _bfp8.any_non_finite(array):
        _raise_non_finite(array)  # checked first: bank memory must not be half written
    _bfp8.pack_into(_as_3d(array, batch, h, w), banks, banks.shape[0], banks.shape[1], address,
                    aligned_page_size, first_page)


def unpack_bfloat8_b_from_banks(banks: Array, address: int, aligned_page_size: int, shape: Any,
                                first_page: int = 0, out: Array | None = None) -> Array:
    """The float32 array of `shape` held by BFLOAT8_B pages first_page.. of a buffer."""
    dims, batch, h, w = _geometry(shape)
    _check_pages(banks, address, BFLOAT8_B_TILE_BYTES, aligned_page_size, _num_tiles(batch, h, w), first_page)
    result = _out(out, math.prod(dims) * 4, np.dtype(np.float32), "unpack_bfloat8_b_from_banks", dims)
    _bfp8.unpack_into(banks, result, batch, h, w, banks.shape[0], banks.shape[1], address,
                      aligned_page_size, first_page)
    return _shaped(result, out, dims)
