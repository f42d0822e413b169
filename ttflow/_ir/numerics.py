"""The device's number rules that every op and every reader of values shares: the dtype ops
compute in (float32 or int64), how a value is stored (`store_as`: rounding, wrapping,
saturating), host dtypes, and the exact
functions that several ops evaluate (Cody's erf, Philox4x32-10, numpy's arange length).
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from .._kernels import _special
from .._types import DataType

__all__ = ["compute_dtype", "store_as", "to_host_dtype", "erf", "philox4x32_10", "arange_length"]

Array = np.ndarray[Any, Any]


def erf(x: Array) -> Array:
    """erf in float64 by Cody's rational approximations, elementwise in C
    (`ttflow._kernels._special`: the formulas, their source, NaN and signed zeros), so every op
    that needs it (gelu, erf, what front-ends build of them) evaluates the same function."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    _special.erf(np.ascontiguousarray(x).reshape(-1), out.reshape(-1))
    return out


_INT_RANGE = {DataType.INT32: (-(2**31), 2**31 - 1), DataType.UINT32: (0, 2**32 - 1)}

def _to_int(x: Array, target: DataType) -> Array:
    """Float to integer: truncate toward zero, saturate at the target's range, NaN -> 0."""
    low, high = _INT_RANGE[target]
    t = np.trunc(x, dtype=np.float64)  # exact: float32 and bfloat16 values are float64 values
    np.clip(t, low, high, out=t)  # infinities saturate; NaN stays NaN
    np.copyto(t, 0.0, where=np.isnan(t))
    return t.astype(np.int64)

def arange_length(start: float, stop: float, step: float) -> int:
    """numpy's arange length: ceil((stop - start) / step), at least 0; exact for ints, in
    float64 (as numpy) for floats."""
    if isinstance(start, int) and isinstance(stop, int) and isinstance(step, int):
        return max(0, -((start - stop) // step))
    return max(0, math.ceil((stop - start) / step))

_U32 = 0xFFFFFFFF

_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))  # Random123's multipliers

_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # its Weyl key increments

def philox4x32_10(counter: tuple[Array, Array, Array, Array], key: tuple[int, int]) -> list[Array]:
    """Philox4x32-10 (Salmon et al., SC'11; Random123's `philox4x32`) of uint64 arrays holding
    32-bit counter words, vectorised: four uint32 words (as uint64) per counter."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) for c in counter)
    k0, k1 = key[0] & _U32, key[1] & _U32
    mask, shift = np.uint64(_U32), np.uint64(32)
    for r in range(10):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _U32, (k1 + _PHILOX_W[1]) & _U32
        p0, p1 = _PHILOX_M[0] * c0, _PHILOX_M[1] * c2  # 32 x 32 -> 64 bits: no wrap
        c0, c1, c2, c3 = ((p1 >> shift) ^ c1 ^ np.uint64(k0), p1 & mask,
                          (p0 >> shift) ^ c3 ^ np.uint64(k1), p0 & mask)
    return [c0, c1, c2, c3]

def compute_dtype(dtype: DataType) -> np.dtype[Any]:
    """The dtype ops compute in: float32 for float types, int64 for integer types."""
    return np.dtype(np.float32) if dtype.is_float else np.dtype(np.int64)

def store_as(array: Array, dtype: DataType) -> Array:
    """`array` as the device stores a `dtype` value, read back in the compute dtype.

    Floats round to nearest even (bfloat16 through ml_dtypes, BFLOAT8_B through the kernels'
    pack/unpack, which raise LayoutError for NaN or infinity: the format has no encoding for
    them). Integers wrap to 32 bits; a float array stored as an integer type is typecast
    (truncated, saturated, NaN -> 0), as an input of another dtype is converted at a program's
    start."""
    a = np.asarray(array)
    if dtype.is_float:
        f = a.astype(np.float32)
        if dtype is DataType.BFLOAT16:
            return f.astype(ml_dtypes.bfloat16).astype(np.float32)
        if dtype is DataType.BFLOAT8_B:
            from .. import kernels  # the lowest layer; imported late so ops work without it

            return kernels.unpack_bfloat8_b(kernels.pack_bfloat8_b(f), f.shape)
        return f
    if a.dtype.kind in "fc" or a.dtype == ml_dtypes.bfloat16:
        a = _to_int(a.astype(np.float32), dtype)
    wrapped = a.astype(np.int64).astype(np.int32 if dtype is DataType.INT32 else np.uint32)
    return wrapped.astype(np.int64)










def to_host_dtype(array: Array, dtype: DataType) -> Array:
    """`array` as `dtype.host_dtype` (floats round to nearest even, integers wrap to 32 bits);
    no copy when it already is."""
    return np.asarray(array).astype(dtype.host_dtype, copy=False)
