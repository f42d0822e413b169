"""Plain-numpy references the tests compare against (independent of ttflow's kernels)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


def tilize(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Tiles in face order, padded with zeros, flattened (numpy reshapes only)."""
    a = array.reshape(1, -1) if array.ndim == 1 else array
    h, w = a.shape[-2:]
    batch = int(np.prod(a.shape[:-2], dtype=np.int64))
    ph, pw = -(-h // 32) * 32, -(-w // 32) * 32
    padded = np.zeros((batch, ph, pw), a.dtype)
    padded[:, :h, :w] = a.reshape(batch, h, w)
    # (batch, tile_row, face_row, row_in_face, tile_col, face_col, col_in_face)
    t = padded.reshape(batch, ph // 32, 2, 16, pw // 32, 2, 16)
    return t.transpose(0, 1, 4, 2, 5, 3, 6).reshape(-1)


def round_to(array: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    """A float32 array rounded as the device stores `dtype`, back in float32."""
    if dtype == "bfloat16":
        return array.astype(ml_dtypes.bfloat16).astype(np.float32)
    return array.astype(np.float32)


def gelu(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    import math

    flat = [0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x.astype(np.float64).ravel()]
    return np.asarray(flat, np.float64).reshape(x.shape).astype(np.float32)


def bfp8_pack_reference(values: np.ndarray[Any, Any]) -> bytes:
    """SPEC's BFLOAT8_B packing of one tile, value by value (1024 face-ordered float32s)."""
    bits = np.asarray(values, np.float32).view(np.uint32).tolist()
    exps, mants = [], []
    for k in range(64):
        row = bits[k * 16 : (k + 1) * 16]
        e = [(v >> 23) & 0xFF for v in row]
        shared = max(e)
        exps.append(shared)
        for v, ev in zip(row, e):
            sign = v >> 31
            if ev == 0:
                mag = 0
            else:
                sig = (v & 0x7FFFFF) | 0x800000
                shift = 17 + shared - ev
                q, rem = sig >> shift, sig & ((1 << shift) - 1)
                half = 1 << (shift - 1)
                if rem > half or (rem == half and q % 2 == 1):
                    q += 1
                mag = min(q, 127)
            mants.append(sign << 7 | mag)
    return bytes(exps + mants)


def bfp8_unpack_reference(tile: bytes) -> np.ndarray[Any, Any]:
    """The 1024 face-ordered float32 values one packed tile holds."""
    out = np.empty(1024, np.float64)
    for k in range(64):
        for c in range(16):
            m = tile[64 + k * 16 + c]
            out[k * 16 + c] = (-1.0 if m & 0x80 else 1.0) * (m & 0x7F) * 2.0 ** (tile[k] - 133)
    return out.astype(np.float32)
