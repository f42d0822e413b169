"""The ops of format version 6 (bitwise_and, bitwise_or, bitwise_xor, left_shift, right_shift,
prod) against references written here, element by element in Python ints or float32 numpy, and
against CPU PyTorch on int32 and float32, never `ttflow._ir.ops`.

As in `test_ops_model`: each op on hypothesis-drawn shapes, dtypes and operands through
`run_on_host`, the builder's refusals (`OpRecord.int_only`, scalars that do not fit), the range
checks of left_shift and prod, and one program holding every new op saved, loaded and run on the
emulated device (asyncio and trio), whose results must equal the host's bit for bit; a
version-5 file that names a version-6 op is refused.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_ops_model import (
    BF8,
    BF16,
    F32,
    FLOATS,
    I32,
    U32,
    check_on_device,
    check_saved_and_on_host,
    exact,
    host,
    rounded,
    seeds,
    shapes,
    tile,
)

import ttflow as tt
from ttflow._ir.binary import _VERSION as NEWEST  # save's version: the newest of the ops' records
from ttflow._commands import Plan
from ttflow._ir.interpreter import run_on_host

Array = np.ndarray[Any, Any]
INTS = [I32, U32]
BITWISE = ("bitwise_and", "bitwise_or", "bitwise_xor")
SHIFTS = ("left_shift", "right_shift")
V6 = (*BITWISE, *SHIFTS, "prod")
RANGE = {I32: (-(2**31), 2**31 - 1), U32: (0, 2**32 - 1)}
HOST = {I32: np.int32, U32: np.uint32}


def torch_module() -> Any:
    return pytest.importorskip("torch")


def ints_of(dtype: tt.DataType, shape: tuple[int, ...]) -> st.SearchStrategy[Array]:
    """Arrays over the whole range of `dtype` (its edges and 0 and -1 likely)."""
    low, high = RANGE[dtype]
    edges = st.sampled_from([low, high, 0, 1, high // 2 + 1] + ([-1] if low < 0 else []))
    return hnp.arrays(HOST[dtype], shape, elements=st.integers(low, high) | edges)


def broadcast_pair(dtype: tt.DataType) -> st.SearchStrategy[tuple[Array, Array]]:
    return hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=1, max_dims=3, max_side=5).flatmap(
        lambda s: st.tuples(*(ints_of(dtype, shape) for shape in s.input_shapes)))


# -- references: one element at a time, in Python ints ----------------------------------------


def wrap(value: int, dtype: tt.DataType) -> int:
    """`value` wrapped to 32 bits, as `dtype` holds it (two's complement for INT32)."""
    value &= 0xFFFFFFFF
    return value - 2**32 if dtype is I32 and value >= 2**31 else value


def ref_elementwise(fn: Callable[[int, int], int], a: Array, b: Array | int, dtype: tt.DataType) -> Array:
    a64, b64 = np.broadcast_arrays(np.asarray(a, np.int64), np.asarray(b, np.int64))
    out = [wrap(fn(int(x), int(y)), dtype) for x, y in zip(a64.ravel(), b64.ravel())]
    return np.array(out, np.int64).reshape(a64.shape)


def ref_left(x: int, s: int) -> int:
    """CPU torch's int32 x << s: the low 32 bits of x * 2**s; 0 for a count outside [0, 31]."""
    return x << s if 0 <= s <= 31 else 0


def ref_right(x: int, s: int) -> int:
    """CPU torch's int32 x >> s: floor(x / 2**s) (Python's >> is arithmetic); for a count
    outside [0, 31] the sign fill alone."""
    return x >> s if 0 <= s <= 31 else (-1 if x < 0 else 0)


REFS: dict[str, Callable[[int, int], int]] = {
    "bitwise_and": lambda x, y: x & y,
    "bitwise_or": lambda x, y: x | y,
    "bitwise_xor": lambda x, y: x ^ y,
    "left_shift": ref_left,
    "right_shift": ref_right,
}


def ref_prod_float32(x: Array, axis: int) -> Array:
    """float32 products, left to right along `axis`, each rounded to float32 (numpy's order)."""
    lanes = np.moveaxis(np.asarray(x, np.float32), axis, 0)
    acc = np.ones(lanes.shape[1:], np.float32)
    with np.errstate(all="ignore"):
        for row in lanes:
            acc = np.asarray(acc * row, np.float32)  # float32 times float32: rounded once
    return np.expand_dims(acc, axis)


def ref_prod_int(x: Array, axis: int, dtype: tt.DataType) -> Array:
    lanes = np.moveaxis(np.asarray(x, np.int64), axis, -1)
    out = [wrap(functools.reduce(lambda p, v: p * int(v), lane, 1), dtype) for lane in lanes.reshape(-1, lanes.shape[-1])]
    return np.expand_dims(np.array(out, np.int64).reshape(lanes.shape[:-1]), axis)


# -- bitwise and, or, xor ---------------------------------------------------------------------------


@settings(deadline=None)
@given(st.sampled_from(BITWISE), st.sampled_from(INTS), st.data())
def test_bitwise_ops_broadcast_like_numpy_and_torch(op: str, dtype: tt.DataType, data: st.DataObject) -> None:
    a, b = data.draw(broadcast_pair(dtype), "operands")
    out, got = host(lambda bld, x, y: getattr(bld, op)(x, y), (a, dtype), (b, dtype))
    shape = np.broadcast_shapes(a.shape, b.shape)
    assert out.dtype is dtype and out.shape == shape and got.dtype == HOST[dtype]
    np.testing.assert_array_equal(got, ref_elementwise(REFS[op], a, b, dtype))
    np.testing.assert_array_equal(got, getattr(np, op)(a, b))  # numpy on int32 / uint32
    torch = torch_module()
    np.testing.assert_array_equal(got, getattr(torch, op)(torch.from_numpy(a), torch.from_numpy(b)).numpy())


@settings(deadline=None)
@given(st.sampled_from(BITWISE), st.sampled_from(INTS), shapes(1, 3), st.data())
def test_bitwise_ops_with_a_scalar(op: str, dtype: tt.DataType, shape: tuple[int, ...], data: st.DataObject) -> None:
    a = data.draw(ints_of(dtype, shape), "a")
    low, high = RANGE[dtype]
    s = data.draw(st.integers(low, high) | st.sampled_from([low, high, 0, 0xFF]), "scalar")
    out, got = host(lambda bld, x: getattr(bld, op)(x, s), (a, dtype))
    assert out.dtype is dtype
    np.testing.assert_array_equal(got, ref_elementwise(REFS[op], a, s, dtype))
    torch = torch_module()
    np.testing.assert_array_equal(got, getattr(torch, op)(torch.from_numpy(a), s).numpy())


def test_a_bitwise_scalar_must_fit_the_dtype() -> None:
    b = tt.ProgramBuilder("p")
    x, u = b.input((2, 3), tile(I32)), b.input((2, 3), tile(U32))
    for op in BITWISE:
        getattr(b, op)(x, 2**31 - 1)
        getattr(b, op)(x, -(2**31))
        getattr(b, op)(u, 2**32 - 1)
        getattr(b, op)(u, np.uint32(7))
        for value, bad in ((x, 2**31), (x, -(2**31) - 1), (x, 2**40), (u, -1), (u, 2**32)):
            with pytest.raises(tt.LayoutError, match=rf"{op}: the scalar {bad} does not fit"):
                getattr(b, op)(value, bad)
        with pytest.raises(tt.LayoutError, match="integral scalars"):
            getattr(b, op)(x, 1.5)
        with pytest.raises(tt.ProgramError, match="boolean"):
            getattr(b, op)(x, True)


# -- shifts -----------------------------------------------------------------------------------------

counts = st.integers(0, 31) | st.integers(-70, 70) | st.sampled_from([-(2**31), 2**31 - 1, 32, 63, 64, -1])


@settings(deadline=None)
@given(st.sampled_from(SHIFTS), st.data())
def test_int32_shifts_are_torchs_with_any_count(op: str, data: st.DataObject) -> None:
    sa, sb = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=1, max_dims=3, max_side=5),
                       "shapes").input_shapes
    a = data.draw(ints_of(I32, sa), "a")
    s = data.draw(hnp.arrays(np.int32, sb, elements=counts), "counts")
    out, got = host(lambda bld, x, y: getattr(bld, op)(x, y), (a, I32), (s, I32))
    assert out.dtype is I32 and got.shape == np.broadcast_shapes(sa, sb)
    np.testing.assert_array_equal(got, ref_elementwise(REFS[op], a, s, I32))
    torch = torch_module()
    want = getattr(torch, f"bitwise_{op}")(torch.from_numpy(a), torch.from_numpy(s))
    np.testing.assert_array_equal(got, want.numpy())


@settings(deadline=None)
@given(st.sampled_from(SHIFTS), shapes(1, 3), counts, st.data())
def test_int32_shifts_by_a_scalar_count(op: str, shape: tuple[int, ...], s: int, data: st.DataObject) -> None:
    a = data.draw(ints_of(I32, shape), "a")
    _, got = host(lambda bld, x: getattr(bld, op)(x, s), (a, I32))
    np.testing.assert_array_equal(got, ref_elementwise(REFS[op], a, s, I32))
    torch = torch_module()
    np.testing.assert_array_equal(got, getattr(torch, f"bitwise_{op}")(torch.from_numpy(a), s).numpy())


@settings(deadline=None)
@given(st.sampled_from(SHIFTS), shapes(1, 2), st.data())
def test_uint32_shifts_are_logical(op: str, shape: tuple[int, ...], data: st.DataObject) -> None:
    # CPU torch has no uint32 shift kernel: C's uint32 shifts, 0 for a count outside [0, 31].
    a = data.draw(ints_of(U32, shape), "a")
    s = data.draw(hnp.arrays(np.uint32, shape, elements=st.integers(0, 40) | st.sampled_from([2**32 - 1, 2**31])),
                  "counts")
    _, got = host(lambda bld, x, y: getattr(bld, op)(x, y), (a, U32), (s, U32))
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, ref_elementwise(REFS[op], a, s, U32))
    in_range = s < 32
    shifted = (a << np.where(in_range, s, 0)) if op == "left_shift" else (a >> np.where(in_range, s, 0))
    np.testing.assert_array_equal(got, np.where(in_range, shifted, 0))  # numpy's uint32 shifts


def test_shift_edges() -> None:
    a = np.array([1, -1, 2**31 - 1, -(2**31), 5, -8], np.int32)
    _, left = host(lambda b, x: b.left_shift(x, 31), (a, I32))
    np.testing.assert_array_equal(left, [-(2**31), -(2**31), -(2**31), 0, -(2**31), 0])
    _, right = host(lambda b, x: b.right_shift(x, 1), (a, I32))
    np.testing.assert_array_equal(right, [0, -1, 2**30 - 1, -(2**30), 2, -4])  # arithmetic: floors
    for s in (32, 33, 63, 64, -1, -(2**31)):
        np.testing.assert_array_equal(host(lambda b, x, s=s: b.left_shift(x, s), (a, I32))[1], np.zeros(6))
        np.testing.assert_array_equal(host(lambda b, x, s=s: b.right_shift(x, s), (a, I32))[1],
                                      [0, -1, 0, -1, 0, -1])


# -- prod -------------------------------------------------------------------------------------------


@settings(deadline=None)
@given(shapes(1, 3), st.sampled_from([F32, BF16, BF8]), st.data(), seeds)
def test_float_prod_is_float32_left_to_right(shape: tuple[int, ...], dtype: tt.DataType, data: st.DataObject,
                                             seed: int) -> None:
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), "axis")
    rng = np.random.default_rng(seed)
    x = (rng.uniform(0.5, 1.9, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)
    if data.draw(st.booleans(), "special"):
        x.flat[rng.integers(0, x.size)] = data.draw(st.sampled_from([0.0, -0.0, np.inf, np.nan, 1e30]), "value")
        if dtype is BF8:
            x = np.nan_to_num(x, nan=0.0, posinf=1e30)  # BFLOAT8_B has no NaN or infinity
    out, got = host(lambda b, v: b.prod(v, axis), (x, dtype))
    expected_shape = tuple(1 if d == axis % len(shape) else n for d, n in enumerate(shape))
    assert out.dtype is dtype and out.shape == expected_shape
    want = ref_prod_float32(rounded(x, dtype), axis)  # of x as the device holds it
    exact(got, want, dtype)  # the same float32 products, rounded once to dtype


@settings(deadline=None)
@given(st.lists(st.integers(1, 70), min_size=1, max_size=3).map(tuple), st.data(), seeds)
def test_float32_prod_against_torch(shape: tuple[int, ...], data: st.DataObject, seed: int) -> None:
    """CPU torch multiplies in the same order along a strided dim or a short one (bit for bit);
    along a contiguous dim (the innermost, or followed by size-1 dims) of 32 or more elements
    its vectorised partial products can differ by a few ulps (both are within (n - 1) * 2**-24 relative of the exact product)."""
    torch = torch_module()
    axis = data.draw(st.integers(0, len(shape) - 1), "axis")
    rng = np.random.default_rng(seed)
    x = (rng.uniform(0.5, 1.9, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)
    _, got = host(lambda b, v: b.prod(v, axis), (x, F32))
    want = torch.prod(torch.from_numpy(x), axis, keepdim=True).numpy()
    n = shape[axis]
    if any(d > 1 for d in shape[axis + 1 :]) or n < 32:  # strided, or short: torch's order
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2 * n * 2.0**-24, atol=0)
    exact_product = np.prod(x.astype(np.float64), axis, keepdims=True)  # float64: exact for n < 8
    np.testing.assert_allclose(got, exact_product, rtol=n * 2.0**-24, atol=0)


def test_torch_differs_along_a_long_contiguous_dim() -> None:
    # Documents why the test above allows ulps: numpy's order is not torch's there.
    torch = torch_module()
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.9, (64, 100)).astype(np.float32)
    _, got = host(lambda b, v: b.prod(v, 1), (x, F32))
    assert not np.array_equal(got, torch.prod(torch.from_numpy(x), 1, keepdim=True).numpy())
    np.testing.assert_array_equal(got, ref_prod_float32(x, 1))


@settings(deadline=None)
@given(shapes(1, 3), st.sampled_from(INTS), st.data())
def test_integer_prod_wraps_like_torchs_int32(shape: tuple[int, ...], dtype: tt.DataType, data: st.DataObject) -> None:
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), "axis")
    x = data.draw(ints_of(dtype, shape) | hnp.arrays(HOST[dtype], shape, elements=st.integers(0, 5)), "x")
    out, got = host(lambda b, v: b.prod(v, axis), (x, dtype))
    assert out.dtype is dtype and got.dtype == HOST[dtype]
    np.testing.assert_array_equal(got, ref_prod_int(x, axis, dtype))
    if dtype is I32:
        torch = torch_module()
        want = torch.prod(torch.from_numpy(x), axis, keepdim=True, dtype=torch.int32)
        np.testing.assert_array_equal(got, want.numpy())


# -- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [*BITWISE, *SHIFTS])
@pytest.mark.parametrize("dtype", FLOATS)
def test_int_only_ops_refuse_floats(op: str, dtype: tt.DataType) -> None:
    b = tt.ProgramBuilder("p")
    f, g = b.input((2, 3), tile(dtype)), b.input((2, 3), tile(dtype))
    i = b.input((2, 3), tile(I32))
    for call in (lambda: getattr(b, op)(f, g), lambda: getattr(b, op)(f, 1)):
        with pytest.raises(tt.LayoutError, match=rf"^{op} needs INT32 or UINT32 inputs, got {dtype.name}"):
            call()
    with pytest.raises(tt.LayoutError, match="cannot mix"):
        getattr(b, op)(i, f)
    with pytest.raises(tt.LayoutError, match="cannot mix"):
        getattr(b, op)(i, b.typecast(i, U32))
    with pytest.raises(tt.ShapeError, match="do not broadcast"):
        getattr(b, op)(i, b.reshape(i, (3, 2)))


def test_an_op_needs_floats_or_integers_not_both() -> None:
    from ttflow._ir.record import Kind, OpRecord

    with pytest.raises(ValueError, match="both"):
        OpRecord("odd", Kind.ELEMENTWISE, 1, lambda arrays, scalar: arrays[0], version=1, float_only=True,
                 int_only=True)


def test_prod_is_a_reduction_as_sum_is() -> None:
    b = tt.ProgramBuilder("p")
    x = b.input((2, 3, 4), tile(I32))
    for axis in range(-3, 3):
        assert b.prod(x, axis).shape == b.sum(x, axis).shape
    for bad in (3, -4, 1.0, "0"):
        with pytest.raises(tt.ShapeError, match="prod: axis"):
            b.prod(x, bad)  # type: ignore[arg-type]


# -- range checks -----------------------------------------------------------------------------------


def checked_shifts_and_products() -> tt.Program:
    b = tt.ProgramBuilder("checked")
    x, s = b.input((1, 4), tile(I32)), b.input((1, 4), tile(I32))
    with b.checking_range("int64 bits"):
        b.output(b.left_shift(x, s))
        b.output(b.prod(x, 1))
        b.output(b.right_shift(x, s))  # fits: unchecked
        b.output(b.bitwise_xor(x, s))  # fits: unchecked
    b.output(b.left_shift(x, s))  # outside: wraps as torch's int32
    return b.build()


def test_left_shift_and_prod_are_range_checked() -> None:
    program = checked_shifts_and_products()
    assert [program.steps[v - 2].op for v, _ in program.range_checks] == ["left_shift", "prod"]
    x, s = np.array([[1, -3, 5, 7]], np.int32), np.array([[30, 4, 0, 2]], np.int32)
    left, product, right, xor, wrapped = run_on_host(program, [x, s])
    np.testing.assert_array_equal(left, x.astype(np.int64) << s)
    np.testing.assert_array_equal(product, [[-105]])
    np.testing.assert_array_equal(wrapped, left)
    np.testing.assert_array_equal(right, x >> s)
    np.testing.assert_array_equal(xor, x ^ s)
    for counts, value in (([31, 0, 0, 0], 2147483648), ([40, 0, 0, 0], 1099511627776), ([0, 0, 0, 29], 3758096384)):
        with pytest.raises(tt.ProgramError, match=rf"^int64 bits: a result of left_shift, {value}, does not fit INT32"):
            run_on_host(program, [x, np.array([counts], np.int32)])
    # Torch's int64 x << s is 0 for a count past 63, and so is the checked value (no error).
    (left, *_) = run_on_host(program, [x, np.array([[64, 70, -1, 0]], np.int32)])
    np.testing.assert_array_equal(left, [[0, 0, 0, 7]])
    big = np.array([[70000, 70000, 1, 1]], np.int32)
    with pytest.raises(tt.ProgramError, match=r"^int64 bits: a result of prod, 4900000000, does not fit INT32"):
        run_on_host(program, [big, np.zeros((1, 4), np.int32)])
    # Unchecked, the product wraps as torch's int32 prod.
    b = tt.ProgramBuilder("unchecked")
    b.output(b.prod(b.input((1, 4), tile(I32)), 1))
    np.testing.assert_array_equal(run_on_host(b.build(), [big])[0], [[wrap(70000 * 70000, I32)]])


def test_the_checked_product_is_torchs_int64_product() -> None:
    # An int64 product past 2**63 wraps, as torch's int64 prod does: 2**64 is 0 and fits.
    torch = torch_module()
    b = tt.ProgramBuilder("p")
    x = b.input((1, 4), tile(I32))
    with b.checking_range("int64 prod"):
        b.output(b.prod(x, 1))
    program = b.build()
    xs = np.array([[2**16, 2**16, 2**16, 2**16]], np.int32)
    assert torch.prod(torch.from_numpy(xs.astype(np.int64)), 1).item() == 0
    np.testing.assert_array_equal(run_on_host(program, [xs])[0], [[0]])
    with pytest.raises(tt.ProgramError, match=r"a result of prod, 281474976710656, does not fit INT32"):
        run_on_host(program, [np.array([[2**16, 2**16, 2**16, 1]], np.int32)])


@pytest.mark.anyio
async def test_a_checked_left_shift_fails_on_the_device() -> None:
    binary = tt.Binary([checked_shifts_and_products()])
    layout = binary.programs[0].inputs[0].layout
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        x = tt.to_device(np.array([[1, -3, 5, 7]], np.int32), device, layout)
        ok = tt.submit(device, binary, 0, [x, tt.to_device(np.array([[3, 4, 0, 2]], np.int32), device, layout)])
        np.testing.assert_array_equal(await tt.to_host(ok[0]), [[8, -48, 5, 28]])
        bad = tt.submit(device, binary, 0, [x, tt.to_device(np.array([[31, 0, 0, 0]], np.int32), device, layout)])
        with pytest.raises(tt.ProgramError, match=r"^int64 bits: a result of left_shift, 2147483648, does not fit"):
            await tt.to_host(bad[0])


# -- every op in one program: saved, loaded, on the device ---------------------------------------------


def every_version_6_op(dtype: tt.DataType) -> tuple[tt.Program, list[Array], list[Any]]:
    """Every new op on INT32 values (the shifts' counts inside and outside [0, 31], broadcast
    and scalar operands), and prod of float values of `dtype`."""
    b = tt.ProgramBuilder("v6")
    rng = np.random.default_rng(6)
    x = rng.integers(-(2**31), 2**31, (3, 40)).astype(np.int32)
    c = rng.integers(-4, 40, (1, 40)).astype(np.int32)
    f = rng.uniform(0.5, 1.5, (3, 40)).astype(np.float32)
    small = rng.integers(-9, 10, (3, 40)).astype(np.int32)
    v, w, g, m = b.input((3, 40), tile(I32)), b.input((1, 40), tile(I32)), b.input((3, 40), tile(dtype)), \
        b.input((3, 40), tile(I32))

    def ints(op: str, other: Any) -> Any:
        return lambda r: (ref_elementwise(REFS[op], r[0], r[1] if other is None else other, I32), "exact")

    refs: list[Any] = [ints("bitwise_and", None), ints("bitwise_or", 0x0F0F0F0F), ints("bitwise_xor", None),
                       ints("left_shift", None), ints("right_shift", None), ints("right_shift", 3),
                       lambda r: (ref_prod_int(r[3], 0, I32), "exact"),
                       lambda r: (ref_prod_float32(r[2], 1), "exact")]
    b.output(b.bitwise_and(v, w))
    b.output(b.bitwise_or(v, 0x0F0F0F0F))
    b.output(b.bitwise_xor(v, w))
    b.output(b.left_shift(v, w))
    b.output(b.right_shift(v, w))
    with b.checking_range("right shifts fit"):  # a range check the file keeps
        b.output(b.right_shift(v, 3))
        b.output(b.prod(m, 0))
    b.output(b.prod(g, 1))
    return b.build(), [x, c, f, small], refs


@pytest.mark.parametrize("dtype", FLOATS)
def test_every_version_6_op_saves_loads_and_runs_on_the_host(tmp_path: Path, dtype: tt.DataType) -> None:
    program, arrays, refs = every_version_6_op(dtype)
    assert len(program.range_checks) == 1  # prod's; right_shift is never checked
    check_saved_and_on_host(tmp_path, program, arrays, refs)  # saved as the newest version (7)


@pytest.mark.anyio
@pytest.mark.parametrize("dtype", [F32, BF16])
async def test_every_version_6_op_on_the_device(dtype: tt.DataType) -> None:
    await check_on_device(*every_version_6_op(dtype))


def one_op_program(op: str) -> tt.Program:
    b = tt.ProgramBuilder(op)
    x = b.input((2, 3), tile(I32))
    b.output(b.prod(x, 1) if op == "prod" else getattr(b, op)(x, x))
    return b.build()


def with_version(raw: bytes, version: int) -> bytes:
    return raw[:8] + struct.pack("<I", version) + raw[12:]


@pytest.mark.parametrize("op", V6)
def test_a_version_5_file_cannot_hold_a_version_6_op(tmp_path: Path, op: str) -> None:
    path = tmp_path / "p.ttb"
    tt.Binary([one_op_program(op)]).save(path)
    raw = path.read_bytes()
    assert struct.unpack("<I", raw[8:12]) == (NEWEST,)
    path.write_bytes(with_version(raw, 5))
    with pytest.raises(tt.BinaryFormatError, match=f"step 0: {op} is not an op of format version 5"):
        tt.Binary.load(path)


def test_a_version_5_file_of_version_5_ops_still_loads(tmp_path: Path) -> None:
    b = tt.ProgramBuilder("v5")
    x = b.input((2, 3), tile(I32))
    with b.checking_range("kept"):
        b.output(b.cumsum(b.remainder(x, 3), 1))
    program = b.build()
    path = tmp_path / "p.ttb"
    tt.Binary([program]).save(path)
    path.write_bytes(with_version(path.read_bytes(), 5))
    (loaded,) = tt.Binary.load(path).programs
    assert loaded.same_as(program) and loaded.range_checks == program.range_checks


# -- the runtime's paths ------------------------------------------------------------------------------


def test_no_new_op_takes_the_c_pointwise_path() -> None:
    # The C kernel knows add, sub, mul, relu and neg on FLOAT32 pages of one shape: a float32
    # prod over an axis of size 1 has that shape, and must still go through numpy.
    def program(step: Callable[[tt.ProgramBuilder, Any], Any], dtype: tt.DataType) -> tt.Program:
        b = tt.ProgramBuilder("p")
        x = b.input((1, 32, 32), tile(dtype))
        b.output(b.add(step(b, x), x) if dtype is F32 else step(b, x))
        return b.build()

    assert Plan(program(lambda b, x: b.mul(x, 2.0), F32)).pagewise  # the control: this one runs in C
    plans = [Plan(program(lambda b, x: b.prod(x, 0), F32)), Plan(program(lambda b, x: b.prod(x, 0), I32))]
    plans += [Plan(program(lambda b, x, op=op: getattr(b, op)(x, 3), I32)) for op in (*BITWISE, *SHIFTS)]
    for plan in plans:
        assert not plan.pagewise and plan.page_code is None


@pytest.mark.anyio
async def test_a_float32_prod_of_page_shape_runs_on_the_device() -> None:
    b = tt.ProgramBuilder("p")
    x = b.input((1, 32, 32), tile(F32))
    b.output(b.add(b.prod(x, 0), x))
    program = b.build()
    data = np.random.default_rng(1).uniform(-2, 2, (1, 32, 32)).astype(np.float32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        (out,) = tt.submit(device, tt.Binary([program]), 0, [tt.to_device(data, device)])
        np.testing.assert_array_equal(await tt.to_host(out), data + data)


def test_simplify_lifts_the_bitwise_ops_through_reshapes() -> None:
    b = tt.ProgramBuilder("p")
    x, y = b.input((1, 40), tile(I32)), b.input((1, 40), tile(I32))
    flat = [b.reshape(x, (40,)), b.reshape(y, (40,))]
    z = b.right_shift(b.bitwise_xor(b.left_shift(flat[0], 3), flat[1]), 1)
    b.output(b.reshape(b.bitwise_and(z, 0xFFFF), (1, 40)))
    program = b.build()
    simplified = tt.simplify(program)
    assert [s.op for s in simplified.steps] == ["left_shift", "bitwise_xor", "right_shift", "bitwise_and"]
    rng = np.random.default_rng(2)
    arrays = [rng.integers(-(2**31), 2**31, (1, 40)).astype(np.int32) for _ in range(2)]
    np.testing.assert_array_equal(run_on_host(simplified, arrays)[0], run_on_host(program, arrays)[0])
