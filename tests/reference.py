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


def bfp8_pack_rows(rows: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """tt-metal's BFLOAT8_B host packer (`convert_u32_to_bfp`), written from SPEC's rule with
    integer ops on the uint32 view: (exponent byte per row, 16 mantissa bytes per row).

    `rows`: float32 values, 16 per face row (shape (..., 16)). Per row, the shared exponent is
    the largest biased exponent (zeros and subnormals count as 0). Per value: exponent 0 packs
    to 0x00; else its 24-bit significand is shifted right by shared - exponent (the bits shifted
    out are dropped), rounded to 7 bits on the low 17 bits (ties to even), clamped to 127; the
    byte is sign << 7 | magnitude, and 0x00 when the magnitude is 0."""
    bits = np.asarray(rows, np.float32).view(np.uint32).astype(np.int64)
    exp = (bits >> 23) & 0xFF
    shared = exp.max(axis=-1, keepdims=True)
    sig = (bits & 0x7FFFFF) | 0x800000
    kept = sig >> np.minimum(shared - exp, 31)  # sig < 2^24: a shift of 24 or more leaves 0
    low, mag = kept & 0x1FFFF, kept >> 17
    mag = mag + ((low > 0x10000) | ((low == 0x10000) & ((mag & 1) == 1)))
    mag = np.where(exp == 0, 0, np.minimum(mag, 127))
    byte = np.where(mag == 0, 0, (bits >> 31) << 7 | mag)
    return shared[..., 0].astype(np.uint8), byte.astype(np.uint8)


def bfp8_pack_reference(values: np.ndarray[Any, Any]) -> bytes:
    """One BFLOAT8_B tile (1024 face-ordered float32s): 64 exponent bytes, 1024 mantissa bytes."""
    exps, mants = bfp8_pack_rows(np.asarray(values, np.float32).reshape(64, 16))
    return exps.tobytes() + mants.tobytes()


def bfp8_pack_array_reference(array: np.ndarray[Any, Any]) -> bytes:
    """All BFLOAT8_B tiles of a float32 array of any shape (tilized, zero padded)."""
    tiles = tilize(np.asarray(array, np.float32)).reshape(-1, 64, 16)
    exps, mants = bfp8_pack_rows(tiles)
    return np.concatenate([exps, mants.reshape(-1, 1024)], axis=1).tobytes()


def bfp8_unpack_reference(tile: bytes) -> np.ndarray[Any, Any]:
    """The 1024 face-ordered float32 values one packed tile holds."""
    out = np.empty(1024, np.float64)
    for k in range(64):
        for c in range(16):
            m = tile[64 + k * 16 + c]
            out[k * 16 + c] = (-1.0 if m & 0x80 else 1.0) * (m & 0x7F) * 2.0 ** (tile[k] - 133)
    return out.astype(np.float32)


def as_format_version(raw: bytes, version: int) -> bytes:
    """A saved ttflow binary's bytes with its header claiming `version` (the payload as it is,
    its checksum made again): what an older ttflow would have written, for the refusal tests."""
    import struct
    import zlib

    payload = raw[24:]
    return struct.pack("<8sIQI", b"TTFLOWB\0", version, len(payload), zlib.crc32(payload)) + payload
