"""BFLOAT8_B packing byte for byte against tt-metal's host packer (`convert_u32_to_bfp`), as
written from SPEC's rule in `reference.bfp8_pack_rows`; the fused bank path against pack; unpack
against its exact decode."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ttflow as tt
from reference import (
    bfp8_pack_array_reference,
    bfp8_pack_reference,
    bfp8_pack_rows,
    bfp8_unpack_reference,
    tilize,
)

TILE_BYTES = 1088


def face_order(x: np.ndarray) -> np.ndarray:
    """Padded tiles in SPEC's face order, flattened."""
    return tilize(np.asarray(x))


def pack_tile(values: np.ndarray) -> bytes:
    """The reference packing of one tile of 1024 face-ordered float32s (other tests use it)."""
    return bfp8_pack_reference(values)


def from_faces(faced: np.ndarray) -> np.ndarray:
    """The (n, 32, 32) array whose tiles, in face order, are `faced` (n * 1024 values)."""
    return faced.reshape(-1, 2, 2, 16, 16).transpose(0, 1, 3, 2, 4).reshape(-1, 32, 32)


def f32(sign: int, exp: int, fraction: int) -> float:
    return float(np.uint32(sign << 31 | exp << 23 | fraction).view(np.float32))


def float_bits(exponents: st.SearchStrategy[int]) -> st.SearchStrategy[float]:
    """float32 values from their bits: any sign and fraction, the given biased exponents."""
    return st.builds(f32, st.integers(0, 1), exponents, st.integers(0, 2**23 - 1))


@st.composite
def value_in_row(draw: st.DrawFn, shared: int) -> float:
    """One value for a row whose shared exponent is `shared`, aimed at the rule's edges."""
    sign = draw(st.integers(0, 1))
    kind = draw(st.sampled_from(["near", "any", "tie", "tie", "clamp", "tiny", "subnormal", "zero"]))
    if kind == "zero":
        return f32(sign, 0, 0)
    if kind == "subnormal":
        return f32(sign, 0, draw(st.integers(1, 2**23 - 1)))
    if kind == "any":
        return f32(sign, draw(st.integers(1, shared)), draw(st.integers(0, 2**23 - 1)))
    if kind in ("near", "tiny"):  # tiny: shifted so far that it rounds to 0 or 1
        lo, hi = (0, 6) if kind == "near" else (7, 30)
        d = min(draw(st.integers(lo, hi)), shared - 1)
        return f32(sign, shared - d, draw(st.integers(0, 2**23 - 1)))
    if kind == "clamp":  # own exponent = shared, top bits 127: rounds to 127 or to 128 (clamped)
        low = draw(st.sampled_from([0xFFFF, 0x10000, 0x10001, 0x1FFFF]) | st.integers(0, 0x1FFFF))
        return f32(sign, shared, (127 << 17 | low) & 0x7FFFFF)
    # tie: after the shift, the 17 rounding bits are at (or one off) the tie, with dropped bits
    # below them that are zero, one, all ones or anything (only ties with d <= 7 exist).
    d = min(draw(st.integers(0, 7)), shared - 1)
    lo_a, hi_a = 1 << (23 - d), (1 << (24 - d)) - 1  # sig >> d of a 24-bit significand
    low = draw(st.sampled_from([0x10000, 0x10000, 0xFFFF, 0x10001]))
    kept = draw(st.integers(lo_a >> 17, hi_a >> 17)) << 17 | low
    assume(lo_a <= kept <= hi_a)
    top = (1 << d) - 1
    dropped = draw(st.sampled_from([0, 1, top]) | st.integers(0, top)) & top
    sig = kept << d | dropped
    return f32(sign, shared - d, sig & 0x7FFFFF)


@st.composite
def face_row(draw: st.DrawFn) -> list[float]:
    """16 values: one at the row's shared exponent (which may be tiny or 0), the rest mixed."""
    # Below 24 the kernel takes its integer path, from 24 its SIMD path: both get rows.
    shared = draw(st.sampled_from([0, 1, 23, 24, 137, 254]) | st.integers(1, 30) | st.integers(1, 254))
    if shared == 0:
        return draw(st.lists(float_bits(st.just(0)), min_size=16, max_size=16))
    row = draw(st.lists(value_in_row(shared), min_size=15, max_size=15))
    anchor = f32(draw(st.integers(0, 1)), shared, draw(st.integers(0, 2**23 - 1)))
    row.insert(draw(st.integers(0, 15)), anchor)
    return row


def wide_range_rows(seed: int, n: int) -> np.ndarray:
    """n rows of 16 float32 spread over ~40 binades below a random top (some subnormal)."""
    rng = np.random.default_rng(seed)
    top = rng.integers(1, 255, (n, 1))
    exp = np.clip(top - rng.integers(0, 40, (n, 16)), 0, 254)
    bits = rng.integers(0, 2, (n, 16)) << 31 | exp << 23 | rng.integers(0, 2**23, (n, 16))
    return bits.astype(np.uint32).view(np.float32)


@st.composite
def tiles(draw: st.DrawFn) -> np.ndarray:
    """(n, 32, 32) float32: wide-range rows, some replaced by drawn edge-case rows."""
    n = draw(st.integers(1, 2))
    rows = wide_range_rows(draw(st.integers(0, 2**32 - 1)), 64 * n)
    for _ in range(draw(st.integers(1, 10))):
        rows[draw(st.integers(0, 64 * n - 1))] = draw(face_row())
    return from_faces(rows.reshape(-1))


# Elementwise values for arbitrary shapes (padding at the edges): rows that mix exponents near
# each other, far apart, tiny (shared exponent below 24), subnormal and zero, and exact ties.
values = st.one_of(
    float_bits(st.integers(120, 136)),
    float_bits(st.integers(1, 254)),
    float_bits(st.integers(0, 8)),
    float_bits(st.integers(15, 30)),
    st.sampled_from([0.0, -0.0, 1.5, 2.5, -3.5, 1e-40, -1e-45, 126.5, 127.5, 255.0, -(2.0**-8)]),
)
small_shapes = st.one_of(
    st.tuples(st.integers(1, 40)),
    st.tuples(st.integers(1, 40), st.integers(1, 40)),
    st.tuples(st.integers(1, 2), st.integers(1, 20), st.integers(1, 34)),
)


@given(tiles())
def test_pack_matches_tt_metal_rule(x: np.ndarray) -> None:
    packed = tt.kernels.pack_bfloat8_b(x)
    assert packed.tobytes() == bfp8_pack_array_reference(x)


@given(hnp.arrays(np.float32, small_shapes, elements=values))
def test_pack_is_byte_exact(x: np.ndarray) -> None:
    packed = tt.kernels.pack_bfloat8_b(x)
    assert packed.dtype == np.uint8 and packed.ndim == 1
    assert packed.tobytes() == bfp8_pack_array_reference(x)
    mant = packed.reshape(-1, TILE_BYTES)[:, 64:]
    assert not (mant == 0x80).any()  # no negative zero


@given(
    st.one_of(tiles(), hnp.arrays(np.float32, small_shapes, elements=values)),
    st.integers(1, 5),  # banks
    st.integers(0, 200),  # address
    st.integers(0, 48),  # page gap: aligned page size = 1088 + gap
    st.integers(0, 6),  # first page
    st.integers(0, 2**16),
)
def test_pack_to_banks_equals_pack(x: np.ndarray, nbanks: int, address: int, gap: int,
                                   first: int, seed: int) -> None:
    pages = tt.kernels.pack_bfloat8_b(x).reshape(-1, TILE_BYTES)
    aligned = TILE_BYTES + gap
    depth = -(-(first + len(pages)) // nbanks)
    blank = np.random.default_rng(seed).integers(0, 256, (nbanks, address + depth * aligned), np.uint8)
    banks = blank.copy()
    tt.kernels.pack_bfloat8_b_to_banks(x, banks, address, aligned, first)
    expected = blank.copy()
    for t, page in enumerate(pages):
        at = address + (first + t) // nbanks * aligned
        expected[(first + t) % nbanks, at : at + TILE_BYTES] = page
    np.testing.assert_array_equal(banks, expected)


def row_bytes(row: list[float]) -> tuple[int, list[int]]:
    x = np.zeros((1, 16), np.float32)
    x[0, : len(row)] = row
    tile = tt.kernels.pack_bfloat8_b(x)
    return int(tile[0]), tile[64 : 64 + len(row)].tolist()


def test_shifted_out_bits_are_dropped_before_rounding() -> None:
    # SPEC's named case: 8.0001087 (exponent 130) in a row of shared exponent 137 (1024.0) is
    # shifted right by 7; what is left is exactly the tie 0x10000 with an even (0) kept part,
    # so it rounds to 0. Rounding with the dropped bits as a sticky bit would give 1.
    v = int(np.float32(8.0001087).view(np.uint32))
    sig = (v & 0x7FFFFF) | 0x800000
    assert (v >> 23) & 0xFF == 130 and sig >> 7 == 0x10000 and sig & 0x7F != 0
    assert row_bytes([1024.0, 8.0001087]) == (137, [64, 0])
    assert row_bytes([-1024.0, -8.0001087]) == (137, [0xC0, 0])
    assert bfp8_pack_rows(np.array([[1024.0, 8.0001087] + [0.0] * 14], np.float32))[1][0, 1] == 0
    # Shared exponent 2^6 (step 1): 2.5 + 2^-21 is shifted by 5, dropping the 2^-21 bit: a tie,
    # to even (2). 2.5 + 2^-17 keeps its extra bit above the tie and rounds up to 3.
    assert row_bytes([64.0, 2.5 + 2.0**-21, 2.5 + 2.0**-17]) == (133, [64, 2, 3])


def test_rounding_ties_to_even_and_clamp() -> None:
    # Shared exponent from 64.0 (2^6): the step is 2^(6 + 127 - 133) = 1.
    exp, mags = row_bytes([64.0, 2.5, 3.5, -2.5, 126.5, 127.5, 127.7, 0.5, 1.5, 127.4999])
    assert exp == 127 + 6
    assert mags == [64, 2, 4, 0x80 | 2, 126, 127, 127, 0, 2, 127]  # ties to even; clamp at 127
    big = float(np.finfo(np.float32).max)  # all ones: 127 and a round value above the tie
    assert row_bytes([big, -big, 2.0**127]) == (254, [127, 0xFF, 64])


def test_values_rounding_to_zero_have_no_sign() -> None:
    # Step 1 (shared 2^6): -0.5 is a tie to 0, -0.25 and -2^-30 are below it, -0.0 and a
    # negative subnormal are exponent 0: all pack to 0x00, never 0x80. -0.75 rounds to 1.
    exp, mags = row_bytes([64.0, -0.5, -0.25, -(2.0**-30), -0.0, -1e-40, -0.75, -0.5000001])
    assert exp == 133 and mags == [64, 0, 0, 0, 0, 0, 0x81, 0]


def test_zero_rows_and_subnormals() -> None:
    x = np.array([[-0.0, 1e-40, -1e-40, 1.0, 0.0]], np.float32)
    tile = tt.kernels.pack_bfloat8_b(x)
    assert tile[0] == 127 and list(tile[64:69]) == [0, 0, 0, 64, 0]
    assert tile[1:64].tolist() == [0] * 63  # all-zero rows (here: padding) have exponent 0
    assert row_bytes([1e-40, -1e-39, -0.0]) == (0, [0, 0, 0])  # a row of subnormals: all 0x00
    back = tt.kernels.unpack_bfloat8_b(tile, x.shape)
    assert back.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]] and not np.signbit(back).any()


def test_unpack_of_zero_magnitudes() -> None:
    # 0x00 is +0.0; 0x80 (never packed, but a byte a device could hold) reads as -0.0.
    for exp in (0, 1, 6, 7, 133, 254):
        tile = np.zeros(TILE_BYTES, np.uint8)
        tile[0], tile[64:66] = exp, [0x00, 0x80]
        back = tt.kernels.unpack_bfloat8_b(tile, (1, 2))
        assert back.tolist() == [[0.0, 0.0]] and np.signbit(back).tolist() == [[False, True]]


@pytest.mark.parametrize("shared", [1, 5, 22, 23, 24, 25, 137, 254])
def test_tiny_and_boundary_shared_exponents(shared: int) -> None:
    # Shared exponents below 24 take the kernel's integer path, 24 and up its SIMD path.
    rows = wide_range_rows(shared, 64)
    rows[:, 0] = f32(0, shared, 0x7FFFFF)
    rows[:, 1] = f32(1, shared, 0x7E0000 | 0x10000)  # 127.5 steps: a tie that clamps
    rows[:, 2] = f32(1, max(shared - 7, 1), 0)  # the tie 0x10000 after a shift of 7
    rows[:, 3] = f32(1, 0, 12345)  # a negative subnormal
    rows[:, 4] = f32(0, max(shared - 7, 1), 0x7F)  # the tie again, the dropped bits all ones
    rows[:, 5] = f32(1, max(shared - 9, 1), 0x7FFFFF)  # rounds to magnitude 0: 0x00
    rows = np.where((rows.view(np.uint32) >> 23 & 0xFF) > shared, np.float32(0), rows)
    x = from_faces(rows.reshape(-1))
    assert tt.kernels.pack_bfloat8_b(x).tobytes() == bfp8_pack_array_reference(x)


def test_tiny_rows_keep_their_precision() -> None:
    # A shared exponent below 24 cannot use a float scale; results stay exact.
    row = [2.0**-125, 3 * 2.0**-127, -(2.0**-126), 2.0**-122 * 1.75]
    exp, mags = row_bytes(row)
    assert exp == 5 and mags == [8, 6, 0x80 | 4, 112]  # step 2^(5 - 133)
    x = np.array([row], np.float32)
    np.testing.assert_array_equal(tt.kernels.unpack_bfloat8_b(tt.kernels.pack_bfloat8_b(x), x.shape), x)


def test_largest_values() -> None:
    big = float(np.finfo(np.float32).max)
    back = tt.kernels.unpack_bfloat8_b(tt.kernels.pack_bfloat8_b(np.array([big, 2.0**127], np.float32)), (2,))
    assert back.tolist() == [127 * 2.0**121, 2.0**127]


def reference_unpack(packed: bytes) -> np.ndarray:
    """Face-ordered float32 values of all tiles, decoded exactly."""
    return np.concatenate([bfp8_unpack_reference(packed[i : i + TILE_BYTES])
                           for i in range(0, len(packed), TILE_BYTES)])


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


@given(st.one_of(tiles(), hnp.arrays(np.float32, small_shapes, elements=values)))
def test_round_trip_error_bound(x: np.ndarray) -> None:
    packed = tt.kernels.pack_bfloat8_b(x)
    back = tt.kernels.unpack_bfloat8_b(packed, x.shape)
    # Per value, the row's step is 2^(shared - 133) (magnitude 1 of the 7-bit grid). Dropping
    # the shifted-out bits loses less than 2^-17 of a step, rounding to nearest at most half a
    # step more; a clamp only happens for |x| in [127.5, 128) steps, so it leaves less than one
    # step; exponent-0 inputs become 0. Nothing reads back as -0.0.
    exps = np.concatenate([packed[i : i + 64] for i in range(0, packed.size, TILE_BYTES)])
    step = np.repeat(np.ldexp(1.0, exps.astype(np.int64) - 133), 16)
    t_in = face_order(x).astype(np.float64)
    t_out = face_order(back).astype(np.float64)
    err = np.abs(t_in - t_out)
    subnormal = np.abs(t_in) < 2.0**-126  # biased exponent 0: zeros and subnormals
    clamped = (np.abs(t_out) == 127 * step) & (np.abs(t_in) >= 127.5 * step)
    rest = ~clamped & ~subnormal
    assert np.all(t_out[subnormal] == 0)
    assert np.all(err[clamped] < step[clamped])
    assert np.all(err[rest] < step[rest] * (0.5 + 2.0**-17))
    assert np.all(np.signbit(t_out) == (np.signbit(t_in) & (t_out != 0)))


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
    expected = bfp8_pack_array_reference(np.ascontiguousarray(x))
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
