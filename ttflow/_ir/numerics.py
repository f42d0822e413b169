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

from .._types import DataType

__all__ = ["compute_dtype", "store_as", "to_host_dtype", "erf", "philox4x32_10", "arange_length"]

Array = np.ndarray[Any, Any]


# Cody's erf coefficients (|x| <= 0.5, 0.5 < |x| <= 4, |x| > 4).
_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
      3.20937758913846947e03, 1.85777706184603153e-1)

_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
      2.84423683343917062e03)

_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
      2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
      2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)

_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
      1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
      3.43936767414372164e03, 1.23033935480374942e03)

_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
      1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)

_Q = (2.56852019228982242e00, 1.87295284992346725e00, 5.27905102951428412e-1,
      6.05183413124413191e-2, 2.33520497626869185e-3)

_SQRT_PI_INV = 5.6418958354775628695e-1

def erf(x: Array) -> Array:
    """erf in float64 by Cody's rational approximations (vectorised)."""
    x = np.asarray(x, np.float64)
    y = np.abs(x)
    out = np.full_like(y, np.nan)  # NaN is in none of the three ranges: it stays NaN
    small = y <= 0.5
    mid = (y > 0.5) & (y <= 4.0)
    big = y > 4.0
    if small.any():
        z = y[small] ** 2
        num = _A[4] * z
        den = z
        for i in range(3):
            num = (num + _A[i]) * z
            den = (den + _B[i]) * z
        out[small] = y[small] * (num + _A[3]) / (den + _B[3])
    if mid.any():
        v = y[mid]
        num = _C[8] * v
        den = v
        for i in range(7):
            num = (num + _C[i]) * v
            den = (den + _D[i]) * v
        erfc = (num + _C[7]) / (den + _D[7]) * np.exp(-v * v)
        out[mid] = 1.0 - erfc
    if big.any():
        v = y[big]
        z = 1.0 / (v * v)
        num = _P[5] * z
        den = z
        for i in range(4):
            num = (num + _P[i]) * z
            den = (den + _Q[i]) * z
        r = z * (num + _P[4]) / (den + _Q[4])
        erfc = (_SQRT_PI_INV - r) / v * np.exp(-v * v)
        out[big] = 1.0 - erfc
    return np.copysign(out, x)

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
