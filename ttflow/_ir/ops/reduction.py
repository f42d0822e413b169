"""Reductions along one axis, which they keep with size 1 (sum, max, prod, mean, argmax), and
the scans that keep the shape (cumsum, argsort).
"""

from __future__ import annotations


import numpy as np

from ..._errors import ProgramError
from ..._types import DataType
from .. import footprint
from ..core import BuilderCore, Value, _normalise_axis, along_axis
from ..record import Kind, RangeCheck, op
from ._shared import Array

__all__ = ["ReductionOps"]


def _sum(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    return arrays[0].sum(axis=axis, keepdims=True, dtype=arrays[0].dtype)


def _cumsum(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    # Floats accumulate in float64, each partial sum rounded once: torch's CPU cumsum, bit for bit.
    x = arrays[0]
    if x.dtype.kind == "f":
        return np.cumsum(x, axis=axis, dtype=np.float64).astype(np.float32)
    return np.cumsum(x, axis=axis)


def _prod(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    # numpy's order: float32 left to right along the axis (numpy sums pairwise, but multiplies
    # in order); int64 wraps past 2**63, as torch's int64 prod does.
    return arrays[0].prod(axis=axis, keepdims=True, dtype=arrays[0].dtype)


def _max(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    return arrays[0].max(axis=axis, keepdims=True)


def _argmax(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    # numpy's argmax: the first index of the maximum, or of the first NaN.
    return np.expand_dims(np.argmax(arrays[0], axis=axis), axis).astype(np.int64)


def _argsort(arrays: list[Array], scalar: float | None, axis: int, descending: bool) -> Array:
    # Stable, as torch.sort(stable=True): equal keys keep their order. NaN sorts as the largest
    # value (last ascending, first descending), as torch's does.
    x = arrays[0]
    if not descending:
        return np.argsort(x, axis=axis, kind="stable").astype(np.int64)
    nan = np.isnan(x) if x.dtype.kind == "f" else np.zeros(x.shape, bool)
    keys = np.where(nan, 0, -x.astype(np.float64) if x.dtype.kind == "f" else -x)
    order = np.argsort(keys, axis=axis, kind="stable")
    # NaN first: a second stable sort on "not NaN" keeps the first one's order within each part.
    return np.take_along_axis(order, np.argsort(~np.take_along_axis(nan, order, axis), axis=axis,
                                                 kind="stable"), axis).astype(np.int64)


def _mean(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    x = arrays[0]
    return x.sum(axis=axis, keepdims=True, dtype=np.float32) / np.float32(x.shape[axis])


def _mean64(a: list[Array], s: float | None, axis: int) -> Array:
    return a[0].mean(axis=axis, keepdims=True)


def _cumsum64(a: list[Array], s: float | None, axis: int) -> Array:
    return np.cumsum(a[0], axis=axis)


class ReductionOps(BuilderCore):
    """The reduction ops of `ProgramBuilder`."""

    def _reduce(self, op: str, x: Value, axis: int) -> Value:
        self._check_open()
        x = self._value(op, x)
        axis = _normalise_axis(op, axis, len(x.shape))
        shape = x.shape[:axis] + (1,) + x.shape[axis + 1 :]
        return self._emit(op, [x], shape, x.dtype, axis=axis)

    @op("sum", Kind.REDUCTION, 1, _sum, version=1, range_check=RangeCheck.RESULT,
        footprint=footprint.reduction, accumulates=along_axis, magnitude_bound=True)
    def sum(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Sum over `axis`, keeping it with size 1."""
        return self._reduce("sum", x, axis)

    @op("max", Kind.REDUCTION, 1, _max, version=1, footprint=footprint.reduction)
    def max(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Maximum over `axis`, keeping it with size 1."""
        return self._reduce("max", x, axis)

    @op("prod", Kind.REDUCTION, 1, _prod, version=6, range_check=RangeCheck.RESULT,
        footprint=footprint.reduction, accumulates=along_axis)
    def prod(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Product over `axis`, keeping it with size 1 (torch.prod(x, axis, keepdim=True),
        np.prod); floats or integers, x's dtype.

        A float product is float32 multiplied left to right along the axis (np.prod of float32),
        then rounded to x's dtype. CPU torch (2.13) multiplies in the same order, bit for bit,
        along a strided dim or one of fewer than 32 elements; along a dim of 32 or more that is
        contiguous (the innermost, or followed by size-1 dims only) it keeps vectorised partial
        products and combines them at the end, so the two can differ by a few ulps there (both
        within about (n - 1) * 2**-24 relative of the exact product of n floats, the bound for
        any order). An integer product is int64 (wrapping past 2**63, as torch's int64 prod),
        stored wrapped to 32 bits (torch's int32 result); `checking_range` checks the int64
        product."""
        return self._reduce("prod", x, axis)

    @op("cumsum", Kind.REDUCTION, 1, _cumsum, float64=_cumsum64, version=5, range_check=RangeCheck.RESULT,
        footprint=footprint.reduction, accumulates=along_axis, magnitude_bound=True)
    def cumsum(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Running sums along `axis` (torch.cumsum, np.cumsum); x's shape and dtype. Floats sum
        in float64 and round each partial sum once, as torch's CPU kernel."""
        self._check_open()
        x = self._value("cumsum", x)
        return self._emit("cumsum", [x], x.shape, x.dtype, axis=_normalise_axis("cumsum", axis, len(x.shape)))

    @op("mean", Kind.REDUCTION, 1, _mean, float64=_mean64, version=2, float_only=True,
        footprint=footprint.reduction, accumulates=along_axis, magnitude_bound=True)
    def mean(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Mean over `axis`, keeping it with size 1 (floats only)."""
        return self._reduce("mean", x, axis)

    @op("argmax", Kind.REDUCTION, 1, _argmax, version=2, footprint=footprint.reduction)
    def argmax(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Index of the maximum along `axis` (INT32), keeping the axis with size 1; the first
        index on ties, the first NaN's index if there is one (numpy)."""
        self._check_open()
        x = self._value("argmax", x)
        axis = _normalise_axis("argmax", axis, len(x.shape))
        shape = x.shape[:axis] + (1,) + x.shape[axis + 1 :]
        return self._emit("argmax", [x], shape, DataType.INT32, axis=axis)

    @op("argsort", Kind.REDUCTION, 1, _argsort, version=5, footprint=footprint.reduction)
    def argsort(self, x: Value, axis: int = -1, descending: bool = False, *, loc: str | None = None) -> Value:
        """The indices (INT32, x's shape) that sort x along `axis`: stable (equal values keep
        their order), NaN as the largest value (torch.sort(stable=True), np.argsort(kind=
        "stable") ascending). Sorted values are `gather(x, argsort(x), axis)`."""
        self._check_open()
        x = self._value("argsort", x)
        if not isinstance(descending, bool):
            raise ProgramError(f"argsort: descending must be a bool, got {descending!r:.40}")
        axis = _normalise_axis("argsort", axis, len(x.shape))
        return self._emit("argsort", [x], x.shape, DataType.INT32, axis=axis, descending=descending)
