"""Moving a tensor's value between host arrays and bank memory, through the kernels.

Each function takes the bank array of the storage's memory space and a `Storage`; none of them
touch device state, so they are safe to call from a worker thread. The geometry of a storage was
checked when it was allocated, so the tile paths call the Cython kernels directly: the public
checks in `ttflow.kernels` cost more than a one-tile kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import kernels
from .._kernels import _bfp8, _tiles
from .._ir.numerics import to_host_dtype
from .banks import Storage
from .._types import DataType, TensorLayout

__all__ = ["write_array", "write_tiles", "read_array", "copy_storage", "zero_fill", "update_row", "row_bytes",
           "stage_array", "land"]

Banks = np.ndarray[Any, np.dtype[np.uint8]]


def write_array(banks: Banks, storage: Storage, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    """Stores a logical host array into the storage's pages, converting to its dtype.

    Returns the array as stored (what `read_array` would give back) when the store is exact,
    i.e. for every dtype but BFLOAT8_B, whose blocks share an exponent: None then."""
    layout, buf = storage.layout, storage
    dtype = layout.dtype
    assert dtype is not None
    array = to_host_dtype(array, dtype)
    if layout.tensor_layout is TensorLayout.ROW_MAJOR:
        kernels.scatter_pages(
            np.ascontiguousarray(array), banks, buf.address, buf.page_size, buf.aligned_page_size
        )
    elif dtype is DataType.BFLOAT8_B:
        # Packed without the separate read-only scan `kernels.pack_bfloat8_b_to_banks` makes
        # first: a failed store fails its command, so a half-written buffer is never read as a
        # value, and the scan would read the whole array once more.
        if _bfp8.pack_into(array.reshape(storage.dims3), banks, banks.shape[0], banks.shape[1],
                           buf.address, buf.aligned_page_size, 0):
            kernels._raise_non_finite(array)
        return None
    else:
        write_tiles(banks, storage, array)
    return array


def write_tiles(banks: Banks, storage: Storage, array: np.ndarray[Any, Any]) -> None:
    """`write_array` for a TILE storage of an exact dtype with `array` already in its host dtype:
    the tilize kernel, nothing else (a program's run stores each step's result this way)."""
    _tiles.tilize_into(array.reshape(storage.dims3), banks, banks.shape[0], banks.shape[1],
                       storage.address, storage.aligned_page_size, 0)


def stage_array(dtype: DataType, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A TILE storage's pages for `array`, page after page (uint8), converted now, as tt-metal's
    host leaves a write in the command queue's system memory before the device copies it into
    the buffer: `land` then only moves pages. Reads no bank memory. Raises as `write_array`
    would (a NaN or infinity for BFLOAT8_B)."""
    if dtype is DataType.BFLOAT8_B:
        return kernels.pack_bfloat8_b(array)
    return kernels.tilize(to_host_dtype(array, dtype)).view(np.uint8)


def land(banks: Banks, storage: Storage, pages: np.ndarray[Any, Any]) -> None:
    """Moves staged pages (`stage_array`, for the storage's dtype) into the storage's banks."""
    kernels.scatter_pages(pages, banks, storage.address, storage.page_size, storage.aligned_page_size)


def read_array(banks: Banks, storage: Storage, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """The storage's value as a logical host array of the storage's host dtype."""
    layout, buf = storage.layout, storage
    dtype = layout.dtype
    assert dtype is not None
    if layout.tensor_layout is TensorLayout.ROW_MAJOR:
        out = np.empty(shape, dtype.host_dtype)
        kernels.gather_pages(
            banks, buf.address, buf.page_size, buf.aligned_page_size, buf.num_pages, out=out
        )
        return out
    out = np.empty(shape, dtype.host_dtype)
    kernel = _bfp8.unpack_into if dtype is DataType.BFLOAT8_B else _tiles.untilize_into
    kernel(banks, out, *storage.dims3, banks.shape[0], banks.shape[1], buf.address,
           buf.aligned_page_size, 0)
    return out


def copy_storage(
    src_banks: Banks, src: Storage, dst_banks: Banks, dst: Storage, shape: tuple[int, ...]
) -> int:
    """Copies a value between storages, converting layout and dtype; returns bytes written."""
    same_format = (
        src.layout.dtype is dst.layout.dtype
        and src.layout.tensor_layout is dst.layout.tensor_layout
    )
    if same_format:
        sb = src
        pages = kernels.gather_pages(
            src_banks, sb.address, sb.page_size, sb.aligned_page_size, sb.num_pages
        )
        db = dst
        kernels.scatter_pages(pages, dst_banks, db.address, db.page_size, db.aligned_page_size)
    else:
        write_array(dst_banks, dst, read_array(src_banks, src, shape))
    return dst.nbytes


def zero_fill(banks: Banks, storage: Storage) -> None:
    """Zeroes every page of the storage (the whole lockstep range in every bank)."""
    buf = storage
    depth = -(-buf.num_pages // banks.shape[0]) * buf.aligned_page_size
    banks[:, buf.address : buf.address + depth] = 0


def update_row(banks: Banks, storage: Storage, row: int, value: np.ndarray[Any, Any]) -> int:
    """Writes `value` (each batch's new row, shape (batch, cols)) into row `row` of every batch
    of the storage, in place; returns the bytes written.

    Only the pages holding that row are rewritten: in TILE layout the band of tiles of the row's
    tile row (read, the row replaced, written back: a tile is the unit a kernel moves, and a
    BFLOAT8_B tile shares exponents along its rows), in ROW_MAJOR layout the row's page. This is
    what makes a donated `update_cache` cost one row band, not the whole cache."""
    layout = storage.layout
    dtype = layout.dtype
    assert dtype is not None
    batches, rows, cols = storage.dims3
    host = to_host_dtype(value, dtype)
    nb = banks.shape[0]
    if layout.tensor_layout is TensorLayout.ROW_MAJOR:
        for b in range(batches):
            page = b * rows + row
            start = storage.address + (page // nb) * storage.aligned_page_size
            banks[page % nb, start : start + storage.page_size] = host[b].view(np.uint8)
        return row_bytes(storage)
    row_tiles, col_tiles = -(-rows // 32), -(-cols // 32)
    band_row = row % 32
    for b in range(batches):
        first = (b * row_tiles + row // 32) * col_tiles
        if dtype is DataType.BFLOAT8_B:
            band = kernels.unpack_bfloat8_b_from_banks(
                banks, storage.address, storage.aligned_page_size, (32, cols), first)
            band[band_row] = host[b]
            kernels.pack_bfloat8_b_to_banks(band, banks, storage.address, storage.aligned_page_size, first)
        else:
            band = kernels.untilize_from_banks(
                banks, storage.address, storage.aligned_page_size, (32, cols), dtype.host_dtype, first)
            band[band_row] = host[b]
            kernels.tilize_to_banks(band, banks, storage.address, storage.aligned_page_size, first)
    return row_bytes(storage)


def row_bytes(storage: Storage) -> int:
    """The bytes `update_row` writes into the storage: one page per batch in ROW_MAJOR layout,
    one band of tiles (a tile row) per batch in TILE layout."""
    batches, _, cols = storage.dims3
    if storage.layout.tensor_layout is TensorLayout.ROW_MAJOR:
        return batches * storage.page_size
    return batches * -(-cols // 32) * storage.page_size
