"""BFLOAT8_B packing byte for byte against SPEC's rule (integer reference), and its error bound."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ttflow as tt

TILE_BYTES = 1088


def face_order(x: np.ndarray) -> np.ndarray:
    """Padded tiles in SPEC's face order, flattened (np.pad and reshape/transpose only)."""
    a = x.reshape(1, -1) if x.ndim == 1 else x
    h, w = a.shape[-2:]
    a = np.pad(a.reshape(-1, h, w), ((0, 0), (0, -h % 32), (0, -w % 32)))
    b, ph, pw = a.shape
    return a.reshape(b, ph // 32, 2, 16, pw // 32, 2, 16).transpose(0, 1, 4, 2, 5, 3, 6).reshape(-1)


def pack_tile(values: np.ndarray) -> bytes:
    """SPEC's BFLOAT8_B rule for one tile of 1024 face-ordered float32s, value by value."""
    bits = values.astype(np.float32).view(np.uint32).tolist()
    exps, mants = [], []
    for k in range(64):
        row = bits[k * 16 : (k + 1) * 16]
        shared = max((v >> 23) & 0xFF for v in row)
        exps.append(shared)
        for v in row:
            e, sign, mag = (v >> 23) & 0xFF, v >> 31, 0
            if e:  # exponent 0 (zero or subnormal): magnitude 0, sign kept
                sig = (v & 0x7FFFFF) | 0x800000  # the full 24-bit significand
                shift = 17 + shared - e  # keep 7 bits of it, then align to the shared exponent
                q, rem, half = sig >> shift, sig & ((1 << shift) - 1), 1 << (shift - 1)
                if rem > half or (rem == half and q & 1):
                    q += 1
                mag = min(q, 127)
            mants.append(sign << 7 | mag)
    return bytes(exps + mants)


def reference_pack(x: np.ndarray) -> bytes:
    t = face_order(x.astype(np.float32))
    return b"".join(pack_tile(t[i : i + 1024]) for i in range(0, t.size, 1024))


def reference_unpack(packed: bytes) -> np.ndarray:
    """Face-ordered float32 values: (-1)^sign * magnitude * 2^(shared - 127 - 6), exactly."""
    out = []
    for i in range(0, len(packed), TILE_BYTES):
        tile = packed[i : i + TILE_BYTES]
        for k in range(1024):
            m = tile[64 + k]
            out.append((-1.0 if m & 0x80 else 1.0) * (m & 0x7F) * 2.0 ** (tile[k // 16] - 133))
    return np.array(out, np.float64).astype(np.float32)


def float_bits(exponents: st.SearchStrategy[int]) -> st.SearchStrategy[float]:
    """float32 values from their bits: any sign and fraction, the given biased exponents."""
    return st.tuples(st.integers(0, 1), exponents, st.integers(0, 2**23 - 1)).map(
        lambda t: float(np.uint32(t[0] << 31 | t[1] << 23 | t[2]).view(np.float32))
    )


# Rows that mix exponents near each other (rounding, clamping), far apart (shifts past 24),
# tiny (shared exponent < 6), subnormal and zero, plus exact ties.
values = st.one_of(
    float_bits(st.integers(120, 136)),
    float_bits(st.integers(1, 254)),
    float_bits(st.integers(0, 8)),
    st.sampled_from([0.0, -0.0, 1.5, 2.5, -3.5, 1e-40, -1e-45, 126.5, 127.5, 255.0]),
)
small_shapes = st.one_of(
    st.tuples(st.integers(1, 40)),
    st.tuples(st.integers(1, 40), st.integers(1, 40)),
    st.tuples(st.integers(1, 2), st.integers(1, 20), st.integers(1, 34)),
)


@given(hnp.arrays(np.float32, small_shapes, elements=values))
def test_pack_is_byte_exact(x: np.ndarray) -> None:
    packed = tt.kernels.pack_bfloat8_b(x)
    assert packed.dtype == np.uint8 and packed.ndim == 1
    assert packed.tobytes() == reference_pack(x)


@given(st.integers(1, 3), st.integers(0, 2**16))
def test_unpack_matches_reference_decode(ntiles: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, ntiles * TILE_BYTES, dtype=np.uint8)
    for i in range(ntiles):  # any exponent byte except 255 (which overflows float32)
        packed[i * TILE_BYTES : i * TILE_BYTES + 64] = rng.integers(0, 255, 64)
    shape = (ntiles * 32 - 5, 29)  # padding dropped at the bottom and the right
    out = tt.kernels.unpack_bfloat8_b(packed, shape)
    assert out.dtype == np.float32 and out.shape == shape
    logical = face_order(np.ones(shape, bool))  # where the logical values sit among the tiles
    expected = reference_unpack(packed.tobytes())[logical]
    np.testing.assert_array_equal(face_order(out)[logical].view(np.uint32), expected.view(np.uint32))


@given(hnp.arrays(np.float32, small_shapes, elements=values))
def test_round_trip_error_bound(x: np.ndarray) -> None:
    packed = tt.kernels.pack_bfloat8_b(x)
    back = tt.kernels.unpack_bfloat8_b(packed, x.shape)
    # Per value: the row's step is 2^(shared - 133) (magnitude 1 of the 7-bit grid). Rounding to
    # nearest leaves at most half a step; a clamp only happens for |x| in [127.5, 128) steps
    # (own exponent = shared), so it leaves less than one step; exponent-0 inputs become +-0.
    exps = np.concatenate([packed[i : i + 64] for i in range(0, packed.size, TILE_BYTES)])
    step = np.repeat(np.ldexp(1.0, exps.astype(np.int64) - 133), 16)
    t_in = face_order(x).astype(np.float64)
    t_out = face_order(back).astype(np.float64)
    err = np.abs(t_in - t_out)
    subnormal = np.abs(t_in) < 2.0**-126  # biased exponent 0: zeros and subnormals
    clamped = (np.abs(t_out) == 127 * step) & (np.abs(t_in) >= 127.5 * step)
    assert np.all(t_out[subnormal] == 0)
    assert np.all(err[clamped] < step[clamped])
    assert np.all(err[~clamped & ~subnormal] <= step[~clamped & ~subnormal] / 2)
    assert np.all(np.signbit(t_out) == np.signbit(t_in))


def row_bytes(row: list[float]) -> tuple[int, list[int]]:
    x = np.zeros((1, 16), np.float32)
    x[0, : len(row)] = row
    tile = tt.kernels.pack_bfloat8_b(x)
    return int(tile[0]), tile[64 : 64 + len(row)].tolist()


def test_rounding_ties_to_even_and_clamp() -> None:
    # Shared exponent from 64.0 (2^6): the step is 2^(6 + 127 - 133) = 1.
    exp, mags = row_bytes([64.0, 2.5, 3.5, -2.5, 126.5, 127.5, 127.7, 0.5, 1.5])
    assert exp == 127 + 6
    assert mags == [64, 2, 4, 0x80 | 2, 126, 127, 127, 0, 2]  # ties to even; 127.5 and 127.7 clamp
    # Rounding happens once, from all 24 bits: 2.5 + 2^-21 is above the tie (a two-step rounding
    # through the top 6 fraction bits would see an exact tie and round to 2).
    exp, mags = row_bytes([64.0, 2.5 + 2.0**-21])
    assert mags == [64, 3]


def test_zero_rows_signs_and_subnormals() -> None:
    x = np.array([[-0.0, 1e-40, -1e-40, 1.0, 0.0]], np.float32)
    tile = tt.kernels.pack_bfloat8_b(x)
    assert tile[0] == 127 and list(tile[64:69]) == [0x80, 0, 0x80, 64, 0]
    assert tile[1:64].tolist() == [0] * 63  # all-zero rows (here: padding) have exponent 0
    assert row_bytes([1e-40, -1e-39]) == (0, [0, 0x80])  # a row of subnormals flushes to 0
    back = tt.kernels.unpack_bfloat8_b(tile, x.shape)
    assert back.tolist() == [[-0.0, 0.0, -0.0, 1.0, 0.0]] and np.signbit(back[0, 2])


def test_tiny_rows_keep_their_precision() -> None:
    # A shared exponent below 6 needs a scale above float32's range; results stay exact.
    row = [2.0**-125, 3 * 2.0**-127, -(2.0**-126), 2.0**-122 * 1.75]
    exp, mags = row_bytes(row)
    assert exp == 5 and mags == [8, 6, 0x80 | 4, 112]  # step 2^(5 - 133)
    x = np.array([row], np.float32)
    np.testing.assert_array_equal(tt.kernels.unpack_bfloat8_b(tt.kernels.pack_bfloat8_b(x), x.shape), x)


def test_largest_values() -> None:
    big = float(np.finfo(np.float32).max)
    exp, mags = row_bytes([big, -big, 2.0**127])
    assert exp == 254 and mags == [127, 0xFF, 64]
    back = tt.kernels.unpack_bfloat8_b(tt.kernels.pack_bfloat8_b(np.array([big, 2.0**127], np.float32)), (2,))
    assert back.tolist() == [127 * 2.0**121, 2.0**127]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_raise(bad: float) -> None:
    x = np.ones((3, 5), np.float32)
    x[2, 4] = bad
    with pytest.raises(tt.LayoutError, match="NaN or infinity.*index 14"):
        tt.kernels.pack_bfloat8_b(x)
    banks = np.zeros((2, 4096), np.uint8)
    with pytest.raises(tt.LayoutError, match="NaN or infinity"):
        tt.kernels.pack_bfloat8_b_to_banks(x, banks, 0, TILE_BYTES)
    assert not banks.any()  # checked before any byte is written


@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16])
def test_other_float_dtypes_are_converted(dtype: type) -> None:
    x = (np.arange(70, dtype=np.float64).reshape(7, 10) - 30) / 8
    expected = tt.kernels.pack_bfloat8_b(x.astype(dtype).astype(np.float32))
    np.testing.assert_array_equal(tt.kernels.pack_bfloat8_b(x.astype(dtype)), expected)


def test_non_contiguous_input_and_out() -> None:
    base = np.random.default_rng(5).standard_normal((70, 90)).astype(np.float32)
    x = base[::2, 5:].T
    expected = reference_pack(np.ascontiguousarray(x))
    out = np.full(len(expected), 0xCD, np.uint8)
    assert tt.kernels.pack_bfloat8_b(x, out=out) is out
    assert out.tobytes() == expected
    back = np.empty(x.shape, np.float32)
    assert tt.kernels.unpack_bfloat8_b(out, x.shape, out=back) is back
    np.testing.assert_array_equal(back, tt.kernels.unpack_bfloat8_b(out, x.shape))


def test_bad_input() -> None:
    with pytest.raises(tt.LayoutError, match="int32"):
        tt.kernels.pack_bfloat8_b(np.ones((2, 2), np.int32))
    with pytest.raises(tt.ShapeError, match="0-d"):
        tt.kernels.pack_bfloat8_b(np.float32(1))
    with pytest.raises(tt.ShapeError, match="positive"):
        tt.kernels.pack_bfloat8_b(np.ones((2, 0), np.float32))
    with pytest.raises(tt.ShapeError, match="1088"):
        tt.kernels.unpack_bfloat8_b(np.zeros(1087, np.uint8), (2, 2))
    with pytest.raises(tt.LayoutError, match="uint8"):
        tt.kernels.unpack_bfloat8_b(np.zeros(1088, np.int8), (2, 2))
    with pytest.raises(tt.LayoutError, match="uint8"):
        tt.kernels.pack_bfloat8_b(np.ones((2, 2), np.float32), out=np.empty(1088, np.int8))
    with pytest.raises(tt.ShapeError, match="1088"):
        tt.kernels.pack_bfloat8_b(np.ones((2, 2), np.float32), out=np.empty(1087, np.uint8))
    with pytest.raises(tt.LayoutError, match="float32"):
        tt.kernels.unpack_bfloat8_b(np.zeros(1088, np.uint8), (2, 2), out=np.empty((2, 2), np.float64))
