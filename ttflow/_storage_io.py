"""Moving a tensor's value between host arrays and bank memory, through the kernels.

Each function takes the bank array of the storage's memory space and a `Storage`; none of them
touch device state, so they are safe to call from a worker thread. The geometry of a storage was
checked when it was allocated, so the tile paths call the Cython kernels directly: the public
checks in `ttflow.kernels` cost more than a one-tile kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import kernels
from ._kernels import _bfp8, _tiles
from ._ops import to_host_dtype
from ._memory import Storage
from ._types import DataType, TensorLayout

__all__ = ["write_array", "read_array", "copy_storage", "zero_fill"]

Banks = np.ndarray[Any, np.dtype[np.uint8]]


def write_array(banks: Banks, storage: Storage, array: np.ndarray[Any, Any]) -> None:
    """Stores a logical host array into the storage's pages, converting to its dtype."""
    layout, buf = storage.layout, storage
    dtype = layout.dtype
    assert dtype is not None
    array = to_host_dtype(array, dtype)
    if layout.tensor_layout is TensorLayout.ROW_MAJOR:
        kernels.scatter_pages(
            np.ascontiguousarray(array), banks, buf.address, buf.page_size, buf.aligned_page_size
        )
    elif dtype is DataType.BFLOAT8_B:
        kernels.pack_bfloat8_b_to_banks(array, banks, buf.address, buf.aligned_page_size)
    else:
        _tiles.tilize_into(array.reshape(storage.dims3), banks, banks.shape[0], banks.shape[1],
                           buf.address, buf.aligned_page_size, 0)


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
