"""Creation: values from attributes alone (arange, full, constant) or a seed (rand: Philox4x32-10).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._errors import BinaryFormatError, LayoutError, ProgramError, ShapeError
from ..._types import DataType, check_shape
from ..core import BuilderCore, Value, _number
from ..numerics import _U32, arange_length, philox4x32_10
from ..record import Kind, op
from ._shared import Array

__all__ = ["CreationOps"]


def _arange(arrays: list[Array], scalar: float | None, start: float, stop: float, step: float,
            dtype: str) -> Array:
    n = arange_length(start, stop, step)
    if DataType(dtype).is_float:
        return (start + np.arange(n, dtype=np.float64) * step).astype(np.float32)
    return int(start) + np.arange(n, dtype=np.int64) * int(step)


def _full(arrays: list[Array], scalar: float | None, shape: tuple[int, ...], value: float,
          dtype: str) -> Array:
    return np.full(tuple(shape), value, np.float32 if DataType(dtype).is_float else np.int64)


def _constant(arrays: list[Array], scalar: float | None, shape: tuple[int, ...], values: tuple[float, ...],
              dtype: str) -> Array:
    return np.asarray(values, np.float32 if DataType(dtype).is_float else np.int64).reshape(tuple(shape))


def _rand(arrays: list[Array], scalar: float | None, shape: tuple[int, ...]) -> Array:
    # Element i is word i % 4 of Philox4x32-10 at counter (i // 4 low word, high word, 0, 0)
    # and key (seed as uint32, 0); its top 24 bits times 2**-24 (exact in float32, below 1).
    n = math.prod(shape)
    seed = int(arrays[0].reshape(-1)[0]) & _U32
    block = np.arange((n + 3) // 4, dtype=np.uint64)
    zero = np.zeros_like(block)
    words = philox4x32_10((block & np.uint64(_U32), block >> np.uint64(32), zero, zero), (seed, 0))
    bits = np.stack(words, axis=1).reshape(-1)[:n] >> np.uint64(8)
    return (bits.astype(np.float32) * np.float32(2.0**-24)).reshape(tuple(shape))


def _replay_arange(b: Any, args: list[Any], scalar: float | None, attrs_: dict[str, Any]) -> Any:
    if args:
        raise BinaryFormatError("arange reads no values")
    return b.arange(dtype=DataType(attrs_.pop("dtype")), **attrs_)


def _replay_full(b: Any, args: list[Any], scalar: float | None, attrs_: dict[str, Any]) -> Any:
    if args:
        raise BinaryFormatError("full reads no values")
    return b.full(dtype=DataType(attrs_.pop("dtype")), **attrs_)


def _replay_constant(b: Any, args: list[Any], scalar: float | None, attrs_: dict[str, Any]) -> Any:
    if args:
        raise BinaryFormatError("constant reads no values")
    shape, values = attrs_.pop("shape"), attrs_.pop("values")
    if not isinstance(values, (list, tuple)):
        raise BinaryFormatError("constant's values must be a list")
    return b.constant(np.asarray(values, np.float64).reshape(check_shape(shape)), DataType(attrs_.pop("dtype")),
                      **attrs_)


def _replay_rand(b: Any, args: list[Any], scalar: float | None, attrs_: dict[str, Any]) -> Any:
    (seed,) = args
    return b.rand(seed=seed, **attrs_)


class CreationOps(BuilderCore):
    """The creation ops of `ProgramBuilder`."""

    @op("arange", Kind.CREATION, 0, _arange, version=2, replay=_replay_arange)
    def arange(self, start: float, stop: float, step: float = 1,
               dtype: DataType = DataType.INT32, *, loc: str | None = None) -> Value:
        """[start, start + step, ...) below `stop` (above it for a negative step), numpy's
        arange: ceil((stop - start) / step) elements. Needs no input; integer dtypes take
        integral bounds whose elements fit the type."""
        self._check_open()
        if not isinstance(dtype, DataType):
            raise LayoutError(f"arange: dtype must be a tt.DataType, got {dtype!r}")
        bounds = [_number("arange", name, v) for name, v in (("start", start), ("stop", stop), ("step", step))]
        if bounds[2] == 0:
            raise ProgramError("arange: step must be nonzero")
        if not math.isfinite((bounds[1] - bounds[0]) / bounds[2]):
            raise ShapeError(f"arange({start}, {stop}, {step}) has too many elements to count")
        if dtype.is_float:
            first, end, by = bounds
            n = arange_length(first, end, by)
            attrs_: dict[str, Any] = {"start": first, "stop": end, "step": by}
        else:
            if not all(v.is_integer() and abs(v) <= 2.0**53 for v in bounds):
                raise LayoutError(f"arange: {dtype.name} takes integral bounds, got {start!r}, {stop!r}, {step!r}")
            first, end, by = (int(v) for v in bounds)
            n = arange_length(first, end, by)
            low, high = (-(2**31), 2**31 - 1) if dtype is DataType.INT32 else (0, 2**32 - 1)
            if n and not (low <= first <= high and low <= first + (n - 1) * by <= high):
                raise LayoutError(f"arange({start}, {stop}, {step}) does not fit {dtype.name}")
            attrs_ = {"start": first, "stop": end, "step": by}
        if n == 0:
            raise ShapeError(f"arange({start}, {stop}, {step}) is empty")
        return self._emit("arange", [], (n,), dtype, dtype=dtype.value, **attrs_)

    @op("full", Kind.CREATION, 0, _full, version=3, replay=_replay_full)
    def full(self, shape: Sequence[int], value: float, dtype: DataType = DataType.FLOAT32,
             *, loc: str | None = None) -> Value:
        """A constant of `shape` with every element `value` (torch.full, np.full); needs no
        input. Floats take any number but NaN (infinities too, as an attention mask's -inf,
        except BFLOAT8_B, which cannot hold them); integer dtypes take integral values that fit."""
        self._check_open()
        if not isinstance(dtype, DataType):
            raise LayoutError(f"full: dtype must be a tt.DataType, got {dtype!r}")
        dims = check_shape(shape)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ProgramError(f"full: value must be a number, got {value!r:.40}")
        fill: float | int
        if isinstance(value, (int, np.integer)) and not dtype.is_float:
            fill = int(value)
        else:
            number = float(value)
            if number != number:
                raise ProgramError("full: value must not be NaN")
            if dtype.is_float:
                if dtype is DataType.BFLOAT8_B and not math.isfinite(number):
                    raise LayoutError(f"full: BFLOAT8_B cannot hold {number}; use BFLOAT16 or FLOAT32")
                fill = number
            elif not number.is_integer():
                raise LayoutError(f"full: {dtype.name} takes an integral value, got {value!r}")
            else:
                fill = int(number)
        if not dtype.is_float:
            low, high = (-(2**31), 2**31 - 1) if dtype is DataType.INT32 else (0, 2**32 - 1)
            if not low <= fill <= high:
                raise LayoutError(f"full: {value!r} does not fit {dtype.name}")
        return self._emit("full", [], dims, dtype, dtype=dtype.value, shape=dims, value=fill)

    @op("constant", Kind.CREATION, 0, _constant, version=10, replay=_replay_constant)
    def constant(self, values: Any, dtype: DataType = DataType.FLOAT32, *, loc: str | None = None) -> Value:
        """A constant of any values (tt-mlir's `ttnn.constant`, a `torch.tensor` literal): an
        array-like of rank >= 1, held in the step (and in a saved file) as its values, rounded to
        `dtype` when the program runs. Floats take any value, NaN and infinities included (not in
        BFLOAT8_B); integer dtypes take integral values that fit."""
        self._check_open()
        if not isinstance(dtype, DataType):
            raise LayoutError(f"constant: dtype must be a tt.DataType, got {dtype!r}")
        try:
            array = np.asarray(values)
        except (ValueError, TypeError) as exc:
            raise ProgramError(f"constant: values must be an array of numbers: {exc}") from None
        if array.dtype.kind not in "biuf" or array.dtype.kind == "b":
            raise ProgramError(f"constant: values must be numbers, got an array of {array.dtype}")
        dims = check_shape(array.shape)
        flat = array.reshape(-1)
        if dtype.is_float:
            items: tuple[float, ...] = tuple(float(v) for v in flat.astype(np.float64))
            if dtype is DataType.BFLOAT8_B and not np.all(np.isfinite(flat)):
                raise LayoutError("constant: BFLOAT8_B cannot hold NaN or infinities; use BFLOAT16 or FLOAT32")
        else:
            if array.dtype.kind == "f" and not np.all(np.isfinite(flat) & (flat == np.round(flat))):
                raise LayoutError(f"constant: {dtype.name} takes integral values")
            ints = flat.astype(np.int64)
            low, high = (-(2**31), 2**31 - 1) if dtype is DataType.INT32 else (0, 2**32 - 1)
            if ints.size and (int(ints.min()) < low or int(ints.max()) > high):
                raise LayoutError(f"constant: a value does not fit {dtype.name}")
            items = tuple(int(v) for v in ints)
        return self._emit("constant", [], dims, dtype, dtype=dtype.value, shape=dims, values=items)

    @op("rand", Kind.CREATION, 1, _rand, version=3, replay=_replay_rand)
    def rand(self, shape: Sequence[int], seed: Value, *, loc: str | None = None) -> Value:
        """Uniform FLOAT32 numbers in [0, 1) of `shape` (torch.rand), from an INT32 or UINT32
        `seed` value with one element (shape (1,) or (1, 1), say): a counter-based generator
        (Philox4x32-10, see `docs/ops.md`), so each element is a function of the seed and its
        row-major index alone: the same seed gives the same numbers on any device or host."""
        self._check_open()
        seed = self._value("rand", seed)
        dims = check_shape(shape)
        if seed.dtype.is_float:
            raise LayoutError(f"rand: the seed must be INT32 or UINT32, got {seed.dtype.name}; typecast it")
        if math.prod(seed.shape) != 1:
            raise ShapeError(f"rand: the seed must have one element (shape (1,) or (1, 1)), got {seed.shape}")
        return self._emit("rand", [seed], dims, DataType.FLOAT32, shape=dims)
