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
