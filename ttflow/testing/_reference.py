"""The numpy reference model: what a device tensor should hold, and what its memory should hold.

Values are modelled as intervals: `ExpectedValue(dtype, lo, hi)` says that every element of the
tensor, read back with `to_host`, lies in `[lo, hi]`. FLOAT32, BFLOAT16, INT32 and UINT32 are
exact (`lo == hi`): the device rounds to nearest even exactly as numpy and ml_dtypes do, so a
front-end's results can be compared bit for bit. BFLOAT8_B is a block format whose rounding
depends on the other values of each 16-value row; the model does not re-implement the packer, it
bounds it (`bfloat8_b_error_bound`), so a test written against the model holds for any correct
packer, not only for this one.

Memory is modelled from SPEC's geometry rules alone (`storage_geometry`, `buffer_footprint`):
page sizes, page counts, alignment and lockstep interleaving, computed here without importing
the runtime's own geometry code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, final

import attrs
import ml_dtypes
import numpy as np

from .._memory.banks import BufferInfo
from .._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout

__all__ = [
    "ExpectedValue",
    "StorageGeometry",
    "bfloat8_b_error_bound",
    "buffer_footprint",
    "ordered_sums",
    "round_as",
    "space_capacity",
    "storage_geometry",
    "stored",
]

Array = np.ndarray[Any, Any]

_INT_RANGES = {DataType.INT32: (-(2**31), 2**31 - 1), DataType.UINT32: (0, 2**32 - 1)}
_MIN_NORMAL = float(np.finfo(np.float32).tiny)  # 2**-126


# -- BFLOAT8_B ---------------------------------------------------------------------------------


def _face_rows(values: Array) -> tuple[Array, int]:
    """`values` as (rows, padded width) float32, zero-padded to whole 16-value face rows.

    Every logical row of a TILE tensor is cut into face rows at columns 0, 16, 32, ...: a tile is
    32 columns wide and its two faces side by side are 16 wide, so the face row of element
    (..., i, j) is row i, columns [16 * (j // 16), 16 * (j // 16) + 16). Padding is zero and never
    raises a row's shared exponent, so the logical rows decide it alone.
    """
    x = np.asarray(values, np.float32)
    rows = x.reshape(1, -1) if x.ndim == 1 else x.reshape(-1, x.shape[-1])
    width = rows.shape[1]
    padded = np.zeros((rows.shape[0], -(-width // 16) * 16), np.float32)
    padded[:, :width] = rows
    return padded, width


def _row_unit(magnitudes: Array) -> Array:
    """2**(shared_exp - 133) per element: the unit of its face row (float64, logical shape).

    `shared_exp` is the largest biased float32 exponent among the row's magnitudes.
    """
    padded, width = _face_rows(magnitudes)
    exponents = ((padded.view(np.uint32) >> 23) & 0xFF).astype(np.int64)
    shared = exponents.reshape(padded.shape[0], -1, 16).max(axis=-1)
    per_element = np.repeat(shared, 16, axis=1)[:, :width]
    return np.ldexp(1.0, per_element - 133).reshape(np.shape(magnitudes))


def bfloat8_b_error_bound(values: Any) -> Array:
    """Per element, a bound on |stored - x| for float32 `values` stored as BFLOAT8_B (float64).

    The derivation follows SPEC's rule (tt-metal's host packer). In a face row of 16 values with
    shared exponent E (the largest biased exponent of the row), a normal element x with biased
    exponent e and 24-bit significand s (hidden bit included) is |x| = s * 2**(e - 150). Let
    u = 2**(E - 133), the unit of the stored magnitude (unpack gives q * u), and r = |x| / u =
    s / 2**(17 + E - e); since e <= E and s < 2**24, r < 128. The packer shifts s right by E - e
    (discarding those bits, an error below 2**-17 in units of u), then rounds the remaining 17
    low bits away to nearest (error at most 1/2), and clamps a result of 128 to 127. So

        |q - r| <= max(1/2 + 2**-17, r - 127)        (always < 1: the error is below one unit)

    the second term being the clamp, reached when r >= 127.5. A zero or subnormal x packs to 0:
    its error is |x|. A row of small values next to a large one loses them entirely: they are
    below half a unit of the large one's exponent, and the bound says so. The bound is within
    2**-17 units of tight: rounding r = n + 1/2 exactly, and r just below 128, reach it.
    """
    x = np.asarray(values, np.float32)
    magnitude = np.abs(x.astype(np.float64))
    unit = _row_unit(np.abs(x))
    bound = unit * np.maximum(0.5 + 2.0**-17, magnitude / unit - 127.0)
    return np.where(magnitude < _MIN_NORMAL, magnitude, bound)


def _bfloat8_b_interval_bound(lo: Array, hi: Array) -> Array:
    """A bound on the BFLOAT8_B error of any float32 array lying elementwise in [lo, hi].

    The actual row exponent is unknown, but no larger than that of the row's largest possible
    magnitude; the error is below one unit of the actual exponent, so below one unit of that.
    """
    envelope = np.maximum(np.abs(lo), np.abs(hi)).astype(np.float32)
    unit = _row_unit(envelope)
    # a subnormal packs to zero: error |x|, up to the envelope
    return np.maximum(unit, np.where(envelope < _MIN_NORMAL, envelope.astype(np.float64), 0.0))


# -- rounding helpers ---------------------------------------------------------------------------


def _f32_up(x: Array) -> Array:
    """The smallest float32 >= x (float64 in, float32 out)."""
    y = x.astype(np.float32)
    return np.where(y.astype(np.float64) < x, np.nextafter(y, np.float32(np.inf)), y)


def _f32_down(x: Array) -> Array:
    """The largest float32 <= x."""
    y = x.astype(np.float32)
    return np.where(y.astype(np.float64) > x, np.nextafter(y, np.float32(-np.inf)), y)


def _round_float(x: Array, dtype: DataType) -> Array:
    """float64 `x` rounded to nearest even as `dtype` stores it, back in float64 (monotone)."""
    f = x.astype(np.float32)
    if dtype is DataType.BFLOAT16:
        f = f.astype(ml_dtypes.bfloat16).astype(np.float32)
    return f.astype(np.float64)


def _host_values(array: Any) -> Array:
    """A host array as float64 (floats, bfloat16) or int64 (integers)."""
    a = np.asarray(array)
    if a.dtype.kind in "iub":
        return a.astype(np.int64)
    return a.astype(np.float32).astype(np.float64)


# -- expected values ----------------------------------------------------------------------------


def _frozen_copy(array: Any) -> Array:
    a = np.array(array, copy=True)
    a.setflags(write=False)
    return a


@final
@attrs.frozen(eq=False)
class ExpectedValue:
    """What a device tensor of `dtype` should hold: every element lies in `[lo, hi]`.

    `lo` and `hi` are float64 for float dtypes and int64 for integer dtypes, in the tensor's
    logical shape; they are equal where the value is known exactly. Make one with `stored`, move
    it through a program with `map` and `stored_as`, and compare a `to_host` result with `check`.
    """

    dtype: DataType
    lo: Array = attrs.field(converter=_frozen_copy)
    hi: Array = attrs.field(converter=_frozen_copy)

    def __attrs_post_init__(self) -> None:
        if self.lo.shape != self.hi.shape:
            raise ValueError(f"lo {self.lo.shape} and hi {self.hi.shape} differ in shape")
        if np.any(self.lo > self.hi):
            raise ValueError("an expected value needs lo <= hi everywhere")
        if not self.dtype.is_float and not self.exact:
            raise ValueError(f"{self.dtype.name} values are modelled exactly: lo must equal hi")

    @classmethod
    def exactly(cls, array: Any, dtype: DataType) -> ExpectedValue:
        """An exactly known value: `array` must already be representable in `dtype`."""
        values = _host_values(array)
        return cls(dtype, values, values)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.lo.shape)

    @property
    def exact(self) -> bool:
        return bool(np.array_equal(self.lo, self.hi))

    @property
    def midpoint(self) -> Array:
        """The centre of each interval (the value itself where it is exact)."""
        if not self.dtype.is_float:
            return self.lo
        return (self.lo + self.hi) / 2

    def stored_as(self, dtype: DataType) -> ExpectedValue:
        """What the device holds after storing this value as `dtype` (a conversion, an output).

        Float to float rounds (BFLOAT8_B by its error bound); integer to float is exact while
        the integers fit in the float's significand. Integers to another integer type, and
        floats to integers (a typecast), are not modelled: ValueError.
        """
        if dtype is self.dtype:
            return self
        if not dtype.is_float:
            raise ValueError(f"storing {self.dtype.name} as {dtype.name} is not modelled")
        lo, hi = self.lo.astype(np.float64), self.hi.astype(np.float64)
        if not self.dtype.is_float:
            limit = 2**24 if dtype is DataType.FLOAT32 else 2**8
            if np.any(np.abs(self.lo) > limit):
                raise ValueError(f"integers beyond {limit} are not exact in {dtype.name}")
        if dtype is DataType.BFLOAT8_B:
            lo32, hi32 = _f32_up(lo).astype(np.float64), _f32_down(hi).astype(np.float64)
            if np.array_equal(lo32, hi32):
                bound = bfloat8_b_error_bound(lo32)
            else:
                bound = _bfloat8_b_interval_bound(lo32, hi32)
            return ExpectedValue(dtype, lo32 - bound, hi32 + bound)
        # Round to nearest is monotone: any value in [lo, hi] rounds into [round(lo), round(hi)].
        return ExpectedValue(dtype, _round_float(lo, dtype), _round_float(hi, dtype))

    def map(
        self, fn: Callable[..., Array], *others: ExpectedValue, dtype: DataType | None = None
    ) -> ExpectedValue:
        """`fn(self, *others)`, computed as the device computes, stored as `dtype`.

        `fn` takes and returns numpy arrays in the compute dtype (float32 for floats, int64 for
        integers) and must be non-decreasing in every argument (add, multiply by a positive
        scalar, relu, max, a positive scale then a shift, ...): it is evaluated at the lower and
        at the upper ends of the intervals. For floats the device's operands are float32 values
        inside the intervals, so the ends are first moved inward to float32 values. `fn` must
        round intermediates as the program stores them (`round_as`). `dtype` defaults to this
        value's dtype.
        """
        dtype = dtype if dtype is not None else self.dtype
        args = (self, *others)
        floats = [a.dtype.is_float for a in args]
        if not any(floats):
            if dtype.is_float:
                raise ValueError(f"an integer result stored as {dtype.name} is not modelled")
            result = np.asarray(fn(*(a.lo for a in args)), np.int64)
            return ExpectedValue.exactly(_wrap(result, dtype), dtype)
        if not all(floats) or not dtype.is_float:
            raise ValueError("ExpectedValue.map models float-to-float and int-to-int programs")
        lows = [_f32_up(a.lo.astype(np.float64)) for a in args]
        highs = [_f32_down(a.hi.astype(np.float64)) for a in args]
        lo = np.asarray(fn(*lows), np.float32).astype(np.float64)
        hi = np.asarray(fn(*highs), np.float32).astype(np.float64)
        if lo.shape != hi.shape or np.any(lo > hi):
            raise ValueError("ExpectedValue.map: fn is not non-decreasing on these values")
        if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
            raise ValueError("ExpectedValue.map: the result overflows float32")
        return ExpectedValue(DataType.FLOAT32, lo, hi).stored_as(dtype)

    def check(self, actual: Any, what: str = "tensor") -> None:
        """Asserts that a `to_host` result holds this value (dtype, shape, every element)."""
        a = np.asarray(actual)
        assert a.dtype == self.dtype.host_dtype, (
            f"{what}: to_host gave {a.dtype}, a {self.dtype.name} tensor reads back as "
            f"{self.dtype.host_dtype}"
        )
        assert a.shape == self.shape, f"{what}: to_host gave shape {a.shape}, expected {self.shape}"
        values = _host_values(a)
        bad = (values < self.lo) | (values > self.hi)
        if self.dtype.is_float:
            bad |= ~np.isfinite(values)
        if bad.any():
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            raise AssertionError(
                f"{what}: {int(bad.sum())} of {bad.size} elements are off; the first, at "
                f"{index}, is {values[index]!r}, expected "
                + (f"{self.lo[index]!r}" if self.lo[index] == self.hi[index]
                   else f"within [{self.lo[index]!r}, {self.hi[index]!r}]")
                + f" ({self.dtype.name})"
            )


def _wrap(values: Array, dtype: DataType) -> Array:
    """int64 values wrapped to `dtype`'s 32 bits, as the device stores an integer result."""
    if dtype is DataType.INT32:
        return values.astype(np.int32).astype(np.int64)
    return values.astype(np.uint32).astype(np.int64)


def round_as(array: Any, dtype: DataType) -> Array:
    """`array` rounded as a program stores a value of `dtype`, in the compute dtype.

    For use inside an `ExpectedValue.map` function, on intermediate values: float32 stays,
    BFLOAT16 rounds to nearest even, integers wrap to 32 bits. BFLOAT8_B intermediates depend on
    whole rows and cannot be rounded elementwise: ValueError.
    """
    a = np.asarray(array)
    if dtype is DataType.BFLOAT8_B:
        raise ValueError("a BFLOAT8_B intermediate has no elementwise rounding; bound it instead")
    if dtype.is_float:
        return _round_float(a.astype(np.float64), dtype).astype(np.float32)
    return _wrap(a.astype(np.int64), dtype)


def stored(value: Any, dtype: DataType) -> ExpectedValue:
    """What the device holds after storing the host array `value` as `dtype`.

    FLOAT32: the float32 value (a float array is first rounded to float32). BFLOAT16: rounded to
    nearest even (ml_dtypes). INT32 and UINT32: exact; out-of-range values raise ValueError, as
    the device refuses to convert them. BFLOAT8_B: `value` rounded to float32, give or take
    `bfloat8_b_error_bound` per element.
    """
    a = np.asarray(value)
    if not dtype.is_float:
        if a.dtype.kind not in "iub":
            raise ValueError(f"{dtype.name} tensors hold integers, got a {a.dtype} array")
        ints = a.astype(np.int64)
        low, high = _INT_RANGES[dtype]
        if ints.size and (ints.min() < low or ints.max() > high):
            raise ValueError(f"values outside {dtype.name}'s range [{low}, {high}]")
        return ExpectedValue.exactly(ints, dtype)
    if a.dtype.kind in "iub":
        return ExpectedValue.exactly(a, DataType.INT32).stored_as(dtype)
    f = a.astype(np.float32)
    if not np.isfinite(f).all():
        raise ValueError("the model covers finite values only (BFLOAT8_B cannot hold NaN or inf)")
    return ExpectedValue(DataType.FLOAT32, f, f).stored_as(dtype)


# -- memory ------------------------------------------------------------------------------------


@final
@attrs.frozen
class StorageGeometry:
    """Where a storage's pages go, from SPEC's rules (per bank and summed over banks)."""

    page_size: int
    aligned_page_size: int
    num_pages: int
    depth: int
    """Bytes the buffer takes in each bank: ceil(pages / banks) aligned pages (lockstep)."""
    footprint: int
    """Bytes it takes in its memory space, summed over the banks: what `memory_used` counts."""


@functools.lru_cache(maxsize=4096)
def storage_geometry(shape: tuple[int, ...], layout: Layout, spec: DeviceSpec) -> StorageGeometry:
    """The geometry of a tensor of `shape` stored in `layout` (its dtype set) on `spec`.

    TILE: one page per 32x32 tile, every batch slice padded to whole tiles; ROW_MAJOR: one page
    per row of the last dim (a 1-D tensor is one row). Pages are aligned to the space's
    alignment and interleaved over its banks, the same address range in every bank.
    """
    dtype = layout.dtype
    if dtype is None:
        raise ValueError("storage_geometry needs a layout with its dtype set")
    *outer, width = shape
    if layout.tensor_layout is TensorLayout.TILE:
        height = outer.pop() if outer else 1
        batch = int(np.prod(outer, dtype=np.int64)) if outer else 1
        page, pages = dtype.tile_bytes, batch * -(-height // 32) * -(-width // 32)
    else:
        page, pages = width * dtype.itemsize, int(np.prod(outer, dtype=np.int64)) if outer else 1
    alignment = spec.alignment(layout.memory)
    aligned = -(-page // alignment) * alignment
    banks = spec.banks(layout.memory)
    depth = -(-pages // banks) * aligned
    return StorageGeometry(page, aligned, pages, depth, depth * banks)


def buffer_footprint(buffer: BufferInfo, spec: DeviceSpec) -> int:
    """Bytes an interleaved buffer takes in its memory space, summed over the banks."""
    banks = spec.banks(buffer.space)
    return -(-buffer.num_pages // banks) * buffer.aligned_page_size * banks


def space_capacity(spec: DeviceSpec, space: MemorySpace) -> int:
    """Bytes `memory_used(space)` can reach: every bank's usable, aligned size."""
    size = spec.bank_bytes(space)
    return (size - size % spec.alignment(space)) * spec.banks(space)


def ordered_sums(path: Sequence[Any], ring: bool, terms: Mapping[Any, Mapping[Any, Array]],
                 add: Callable[[Array, Array], Array]) -> dict[Any, Array]:
    """Each path chip's part of a reducing collective summed in the documented order
    (docs/mesh.md, "Sums"): `terms[chip][home]` is chip's term of home's part, `add(a, b)` one
    partial sum as the device stores it (rounded to the dtype). On a ring the part of the chip
    at position h is x[h+1] + x[h+2] + ... + x[h-1], then + x[h]; on a line it is
    ((x[0] + ... + x[h-1]) + x[h]) + (x[N-1] + ... + x[h+1]). The one copy of the rule, read by
    the collective tests and the mesh state machine alike."""
    n = len(path)
    sums = {}
    for h, home in enumerate(path):
        if ring:
            total = terms[path[(h + 1) % n]][home]
            for k in range(2, n):
                total = add(total, terms[path[(h + k) % n]][home])
            total = add(total, terms[home][home])
        else:
            total = terms[home][home]
            if h > 0:
                left = terms[path[0]][home]
                for k in range(1, h):
                    left = add(left, terms[path[k]][home])
                total = add(left, total)
            if h < n - 1:
                right = terms[path[-1]][home]
                for k in range(n - 2, h, -1):
                    right = add(right, terms[path[k]][home])
                total = add(total, right)
        sums[home] = total
    return sums
