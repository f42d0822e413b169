"""Elementwise ops: each result element from the same place of each operand (numpy
broadcasting), unary, binary and `where`; arithmetic, comparisons, transcendental
functions, rounding, bitwise logic and shifts, and `typecast`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..._errors import BinaryFormatError, LayoutError, ProgramError, ShapeError
from ..._types import DataType
from ..core import BuilderCore, Value, _broadcast, _result_dtype, _scalar
from ..numerics import _to_int, erf
from ..record import Kind, PageOp, RangeCheck, op
from ._shared import Array, unary_compute

__all__ = ["EltwiseOps"]


def _scalar_like(array: Array, scalar: float) -> Any:
    return array.dtype.type(scalar)


def _binary(ufunc: Any) -> Callable[..., Array]:
    def fn(arrays: list[Array], scalar: float | None) -> Array:
        a = arrays[0]
        b = arrays[1] if scalar is None else _scalar_like(a, scalar)
        return ufunc(a, b)

    return fn


def _compare(ufunc: Any) -> Callable[..., Array]:
    """1 where `ufunc(a, b)` holds, else 0, in a's compute dtype."""

    def fn(arrays: list[Array], scalar: float | None) -> Array:
        a = arrays[0]
        b = arrays[1] if scalar is None else _scalar_like(a, scalar)
        return ufunc(a, b).astype(a.dtype)

    return fn


def _gelu(arrays: list[Array], scalar: float | None) -> Array:
    x = arrays[0]
    x64 = x.astype(np.float64)
    return (0.5 * x64 * (1.0 + erf(x64 / np.sqrt(2.0)))).astype(x.dtype)


def _typecast(arrays: list[Array], scalar: float | None, dtype: str) -> Array:
    # The runtime rounds to the target dtype when it stores the value (and wraps integers).
    target = DataType(dtype)
    x = arrays[0]
    if target.is_float:
        return x.astype(np.float32)
    return _to_int(x, target) if x.dtype.kind == "f" else x.astype(np.int64)


def _shift_operands(arrays: list[Array], scalar: float | None) -> tuple[Array, Array, Array]:
    """The values, the counts (int64) and where a count is one a 64-bit shift honours (0..63)."""
    a = arrays[0]
    counts = np.asarray(arrays[1] if scalar is None else _scalar_like(a, scalar))
    return a, counts, (counts >= 0) & (counts < 64)


def _left_shift(arrays: list[Array], scalar: float | None) -> Array:
    # torch's int64 x << s: the bits of x moved up, wrapping past 2**63 (through uint64, where
    # a shift that overflows is defined); 0 for a count outside [0, 63].
    a, counts, inside = _shift_operands(arrays, scalar)
    moved = a.astype(np.uint64) << np.where(inside, counts, 0).astype(np.uint64)
    return np.where(inside, moved.astype(np.int64), np.int64(0))


def _right_shift(arrays: list[Array], scalar: float | None) -> Array:
    # torch's int64 x >> s: arithmetic (the sign fills in); for a count outside [0, 63] the sign
    # fill alone, -1 for a negative x, else 0.
    a, counts, inside = _shift_operands(arrays, scalar)
    fill = np.where(a < 0, np.int64(-1), np.int64(0))
    return np.where(inside, a >> np.where(inside, counts, 0), fill)


def _where(arrays: list[Array], scalar: float | None, a_scalar: float | None,
           b_scalar: float | None) -> Array:
    cond, *rest = arrays
    a = rest.pop(0) if a_scalar is None else None
    b = rest.pop(0) if b_scalar is None else None
    dtype = (a if a is not None else b).dtype  # type: ignore[union-attr]  # one is a tensor
    a = a if a is not None else dtype.type(a_scalar)
    b = b if b is not None else dtype.type(b_scalar)
    return np.where(cond != 0, a, b)


def _sigmoid_of(x: Array) -> Array:
    # exp(-|x|) only: it never overflows, and each half keeps full relative precision.
    e = np.exp(-np.abs(x))
    one = x.dtype.type(1)
    return np.where(x >= 0, one / (one + e), e / (one + e))


def _erf(arrays: list[Array], scalar: float | None) -> Array:
    x = arrays[0]
    return erf(x).astype(x.dtype)


def _replay_typecast(b: Any, args: list[Any], scalar: float | None, attrs_: dict[str, Any]) -> Any:
    (x,) = args
    return b.typecast(x, DataType(attrs_.pop("dtype")), **attrs_)


def _replay_where(b: Any, args: list[Any], scalar: float | None, attrs_: dict[str, Any]) -> Any:
    cond, *rest = args
    branches = [attrs_.pop(k) for k in ("a_scalar", "b_scalar")]
    if attrs_ or len(rest) != sum(v is None for v in branches):
        raise BinaryFormatError("where: its attrs do not match its inputs")
    a, c = (rest.pop(0) if v is None else v for v in branches)
    return b.where(cond, a, c)


def _clamp(arrays: list[Array], scalar: float | None, min: float | None, max: float | None) -> Array:
    """max(x, min) then min(., max), as torch.clamp: NaN stays NaN, and min > max gives max."""
    x = arrays[0]
    if min is not None:
        x = np.maximum(x, x.dtype.type(min))
    if max is not None:
        x = np.minimum(x, x.dtype.type(max))
    return x


class EltwiseOps(BuilderCore):
    """The eltwise ops of `ProgramBuilder`."""

    @op("add", Kind.ELEMENTWISE, 2, _binary(np.add), version=1, range_check=RangeCheck.RESULT,
        magnitude_bound=True, page=PageOp(lambda a, b, out: np.add(a, b, out=out), "OP_ADD"))
    def add(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a + other; `other` a value (numpy broadcasting) or a Python scalar."""
        return self._binary("add", a, other)

    @op("sub", Kind.ELEMENTWISE, 2, _binary(np.subtract), version=1, range_check=RangeCheck.RESULT,
        magnitude_bound=True, page=PageOp(lambda a, b, out: np.subtract(a, b, out=out), "OP_SUB"))
    def sub(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a - other; `other` a value (numpy broadcasting) or a Python scalar."""
        return self._binary("sub", a, other)

    @op("mul", Kind.ELEMENTWISE, 2, _binary(np.multiply), version=1, range_check=RangeCheck.RESULT,
        magnitude_bound=True, page=PageOp(lambda a, b, out: np.multiply(a, b, out=out), "OP_MUL"))
    def mul(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a * other; `other` a value (numpy broadcasting) or a Python scalar."""
        return self._binary("mul", a, other)

    @op("gt", Kind.ELEMENTWISE, 2, _compare(np.greater), version=1, comparison=True)
    def gt(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a > other, else 0, in a's dtype (e.g. the mask of ReLU's backward)."""
        return self._binary("gt", a, other)

    @op("relu", Kind.ELEMENTWISE, 1, unary_compute(lambda x: np.maximum(x, x.dtype.type(0))), version=1,
        page=PageOp(lambda a, b, out: np.maximum(a, np.float32(0), out=out), "OP_RELU"))
    def relu(self, x: Value, *, loc: str | None = None) -> Value:
        """max(x, 0)."""
        return self._unary("relu", x)

    @op("gelu", Kind.ELEMENTWISE, 1, _gelu, version=1, float_only=True)
    def gelu(self, x: Value, *, loc: str | None = None) -> Value:
        """0.5 x (1 + erf(x / sqrt 2)): the exact form, PyTorch's default."""
        return self._unary("gelu", x)

    @op("exp", Kind.ELEMENTWISE, 1, unary_compute(np.exp), version=1, float_only=True)
    def exp(self, x: Value, *, loc: str | None = None) -> Value:
        """e**x (floats only)."""
        return self._unary("exp", x)

    @op("sqrt", Kind.ELEMENTWISE, 1, unary_compute(np.sqrt), version=1, float_only=True)
    def sqrt(self, x: Value, *, loc: str | None = None) -> Value:
        """Square root (floats only; NaN below 0)."""
        return self._unary("sqrt", x)

    @op("reciprocal", Kind.ELEMENTWISE, 1, unary_compute(lambda x: np.reciprocal(x)), version=1,
        float_only=True)
    def reciprocal(self, x: Value, *, loc: str | None = None) -> Value:
        """1 / x (floats only; inf at 0)."""
        return self._unary("reciprocal", x)

    @op("neg", Kind.ELEMENTWISE, 1, unary_compute(np.negative), version=1, range_check=RangeCheck.RESULT,
        magnitude_bound=True, page=PageOp(lambda a, b, out: np.negative(a, out=out), "OP_NEG"))
    def neg(self, x: Value, *, loc: str | None = None) -> Value:
        """-x."""
        return self._unary("neg", x)

    @op("remainder", Kind.ELEMENTWISE, 2, _binary(np.remainder), version=5, range_check=RangeCheck.DIVISION)
    def remainder(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a mod other with the divisor's sign (torch.remainder, np.remainder, Python's %);
        `other` a value (numpy broadcasting) or a Python scalar. An integer mod 0 is 0."""
        return self._binary("remainder", a, other)

    @op("floor_divide", Kind.ELEMENTWISE, 2, _binary(np.floor_divide), version=5,
        range_check=RangeCheck.DIVISION)
    def floor_divide(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """floor(a / other) (torch.floor_divide and `div(rounding_mode="floor")`, np.floor_divide,
        Python's //); floats give float results. An integer divided by 0 is 0."""
        return self._binary("floor_divide", a, other)

    @op("atan2", Kind.ELEMENTWISE, 2, _binary(np.arctan2), version=5, float_only=True)
    def atan2(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """The angle of the point (other, a) in radians, in [-pi, pi] (torch.atan2, np.arctan2;
        floats only); `other` a value (numpy broadcasting) or a Python scalar."""
        return self._binary("atan2", a, other)

    @op("fmod", Kind.ELEMENTWISE, 2, _binary(np.fmod), version=5, range_check=RangeCheck.DIVISION)
    def fmod(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a mod other with a's sign (torch.fmod, np.fmod, C's fmod). An integer mod 0 is 0."""
        return self._binary("fmod", a, other)

    def _bitwise(self, op: str, a: Value, other: Value | int) -> Value:
        """A bitwise binary op: a scalar operand must fit the value's dtype, so that the result
        always does (these ops are not range-checked)."""
        self._check_open()
        a = self._value(op, a)
        if (not a.dtype.is_float and isinstance(other, (int, float, np.integer, np.floating))
                and not isinstance(other, (bool, np.bool_))):
            low, high = (-(2**31), 2**31 - 1) if a.dtype is DataType.INT32 else (0, 2**32 - 1)
            value = _scalar(op, a.dtype, other)
            if not low <= value <= high:
                raise LayoutError(
                    f"{op}: the scalar {other!r} does not fit {a.dtype.name} [{low}, {high}]; torch's "
                    f"int32 ops use its low 32 bits: pass it wrapped into {a.dtype.name}'s range"
                )
        return self._binary(op, a, other)

    @op("bitwise_and", Kind.ELEMENTWISE, 2, _binary(np.bitwise_and), version=6, int_only=True)
    def bitwise_and(self, a: Value, other: Value | int, *, loc: str | None = None) -> Value:
        """a & other, bit by bit (torch.bitwise_and, np.bitwise_and); INT32 or UINT32 only;
        `other` a value of a's dtype (numpy broadcasting) or a Python int that fits it."""
        return self._bitwise("bitwise_and", a, other)

    @op("bitwise_or", Kind.ELEMENTWISE, 2, _binary(np.bitwise_or), version=6, int_only=True)
    def bitwise_or(self, a: Value, other: Value | int, *, loc: str | None = None) -> Value:
        """a | other, bit by bit (torch.bitwise_or, np.bitwise_or); as `bitwise_and`."""
        return self._bitwise("bitwise_or", a, other)

    @op("bitwise_xor", Kind.ELEMENTWISE, 2, _binary(np.bitwise_xor), version=6, int_only=True)
    def bitwise_xor(self, a: Value, other: Value | int, *, loc: str | None = None) -> Value:
        """a ^ other, bit by bit (torch.bitwise_xor, np.bitwise_xor); as `bitwise_and`."""
        return self._bitwise("bitwise_xor", a, other)

    @op("left_shift", Kind.ELEMENTWISE, 2, _left_shift, version=6, int_only=True,
        range_check=RangeCheck.RESULT)
    def left_shift(self, a: Value, other: Value | int, *, loc: str | None = None) -> Value:
        """a << other (torch.bitwise_left_shift); INT32 or UINT32 only; `other`, the counts, a
        value of a's dtype (numpy broadcasting) or a Python int. The bits shifted past 32 are
        lost (INT32 wraps, as torch's int32); a count outside [0, 31] gives 0, as CPU torch's
        int32 kernel (C leaves it undefined). Under `checking_range` the int64 result, torch's
        int64 x << s (0 for a count outside [0, 63]), must fit the dtype."""
        return self._binary("left_shift", a, other)

    @op("right_shift", Kind.ELEMENTWISE, 2, _right_shift, version=6, int_only=True)
    def right_shift(self, a: Value, other: Value | int, *, loc: str | None = None) -> Value:
        """a >> other (torch.bitwise_right_shift); INT32 or UINT32 only; arithmetic on INT32
        (the sign fills in), logical on UINT32. A count outside [0, 31] gives the sign fill
        alone (-1 for a negative INT32 element, else 0), as CPU torch's int32 kernel."""
        return self._binary("right_shift", a, other)

    @op("typecast", Kind.ELEMENTWISE, 1, _typecast, version=1, range_check=RangeCheck.CAST,
        replay=_replay_typecast)
    def typecast(self, x: Value, dtype: DataType, *, loc: str | None = None) -> Value:
        """x in another dtype (float to int truncates and saturates; see `ops`)."""
        self._check_open()
        x = self._value("typecast", x)
        if not isinstance(dtype, DataType):
            raise LayoutError(f"typecast: dtype must be a tt.DataType, got {dtype!r}")
        return self._emit("typecast", [x], x.shape, dtype, dtype=dtype.value)

    @op("eq", Kind.ELEMENTWISE, 2, _compare(np.equal), version=2, comparison=True)
    def eq(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a == other, else 0 (as `gt`)."""
        return self._binary("eq", a, other)

    @op("ne", Kind.ELEMENTWISE, 2, _compare(np.not_equal), version=2, comparison=True)
    def ne(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a != other, else 0 (as `gt`; NaN != NaN is 1)."""
        return self._binary("ne", a, other)

    @op("lt", Kind.ELEMENTWISE, 2, _compare(np.less), version=2, comparison=True)
    def lt(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a < other, else 0 (as `gt`)."""
        return self._binary("lt", a, other)

    @op("le", Kind.ELEMENTWISE, 2, _compare(np.less_equal), version=2, comparison=True)
    def le(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a <= other, else 0 (as `gt`)."""
        return self._binary("le", a, other)

    @op("ge", Kind.ELEMENTWISE, 2, _compare(np.greater_equal), version=2, comparison=True)
    def ge(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a >= other, else 0 (as `gt`)."""
        return self._binary("ge", a, other)

    @op("maximum", Kind.ELEMENTWISE, 2, _binary(np.maximum), version=2)
    def maximum(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """The elementwise larger of a and other (np.maximum: NaN wins)."""
        return self._binary("maximum", a, other)

    @op("minimum", Kind.ELEMENTWISE, 2, _binary(np.minimum), version=2)
    def minimum(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """The elementwise smaller of a and other (np.minimum: NaN wins)."""
        return self._binary("minimum", a, other)

    @op("clamp", Kind.ELEMENTWISE, 1, _clamp, version=9)
    def clamp(self, x: Value, min: float | None = None, max: float | None = None, *,
              loc: str | None = None) -> Value:
        """x limited to [min, max] (torch.clamp, np.clip with one bound left out as None, at
        least one given): max(x, min), then the minimum of that and max, so min > max gives max
        everywhere (torch's rule) and NaN stays NaN. Floats or integers; an integer value takes
        integral bounds (as any scalar operand)."""
        self._check_open()
        x = self._value("clamp", x)
        if min is None and max is None:
            raise ProgramError("clamp needs min, max or both")
        bounds = {name: None if v is None else _scalar("clamp", x.dtype, v) for name, v in (("min", min), ("max", max))}
        return self._emit("clamp", [x], x.shape, x.dtype, **bounds)

    @op("rsqrt", Kind.ELEMENTWISE, 1, unary_compute(lambda x: x.dtype.type(1) / np.sqrt(x)), version=2,
        float_only=True)
    def rsqrt(self, x: Value, *, loc: str | None = None) -> Value:
        """1 / sqrt(x) (floats only; inf at 0, NaN below 0)."""
        return self._unary("rsqrt", x)

    @op("tanh", Kind.ELEMENTWISE, 1, unary_compute(np.tanh), version=2, float_only=True)
    def tanh(self, x: Value, *, loc: str | None = None) -> Value:
        """Hyperbolic tangent (floats only)."""
        return self._unary("tanh", x)

    @op("sigmoid", Kind.ELEMENTWISE, 1, unary_compute(_sigmoid_of), version=2, float_only=True)
    def sigmoid(self, x: Value, *, loc: str | None = None) -> Value:
        """1 / (1 + exp(-x)), evaluated so that it never overflows (floats only)."""
        return self._unary("sigmoid", x)

    @op("silu", Kind.ELEMENTWISE, 1, unary_compute(lambda x: x * _sigmoid_of(x)), version=2,
        float_only=True)
    def silu(self, x: Value, *, loc: str | None = None) -> Value:
        """x * sigmoid(x) (floats only; PyTorch's SiLU, a.k.a. swish)."""
        return self._unary("silu", x)

    @op("pow", Kind.ELEMENTWISE, 1, lambda arrays,
        scalar: np.power(arrays[0], arrays[0].dtype.type(scalar)), version=2, float_only=True)
    def pow(self, x: Value, p: float, *, loc: str | None = None) -> Value:
        """x ** p for a Python scalar exponent (floats only; NaN for a negative base and a
        non-integral p, as numpy)."""
        self._check_open()
        x = self._value("pow", x)
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)):
            raise ProgramError(f"pow takes a Python scalar exponent, got {type(p).__name__}")
        return self._emit("pow", [x], x.shape, x.dtype, _scalar("pow", x.dtype, p))

    @op("where", Kind.ELEMENTWISE, 3, _where, version=2, replay=_replay_where)
    def where(self, cond: Value, a: Value | float, b: Value | float, *, loc: str | None = None) -> Value:
        """`a` where cond is nonzero, else `b` (np.where); cond of any dtype, `a` and `b`
        values or Python scalars (at least one a value, which gives the dtype); all broadcast."""
        self._check_open()
        cond = self._value("where", cond)
        branches: list[Value] = []
        scalars: list[float | None] = []
        for branch in (a, b):
            if isinstance(branch, (bool, np.bool_)):
                raise ProgramError("where: a boolean operand is ambiguous; use 0 or 1")
            if isinstance(branch, (int, float, np.integer, np.floating)):
                scalars.append(float(branch))
            else:
                branches.append(self._value("where", branch))
                scalars.append(None)
        if not branches:
            raise ProgramError("where needs a value for a or b (it gives the dtype); typecast cond instead")
        dtype = branches[0].dtype
        for v in branches[1:]:
            dtype = _result_dtype("where", dtype, v.dtype)
        scalars = [None if s is None else _scalar("where", dtype, s) for s in scalars]
        shape: tuple[int, ...] | None = cond.shape
        for v in branches:
            shape = _broadcast(shape, v.shape) if shape is not None else None
        if shape is None:
            raise ShapeError(
                f"where: shapes {cond.shape} and {[v.shape for v in branches]} do not broadcast"
            )
        return self._emit("where", [cond, *branches], shape, dtype, a_scalar=scalars[0], b_scalar=scalars[1])

    @op("div", Kind.ELEMENTWISE, 2, _binary(np.divide), version=3, float_only=True)
    def div(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a / other, true division (torch.div, np.divide); `other` a value (numpy
        broadcasting) or a Python scalar. Floats only: inf for x / 0, NaN for 0 / 0."""
        self._check_open()
        a = self._value("div", a)
        b_dtype = other.dtype if isinstance(other, Value) else a.dtype
        if not (a.dtype.is_float and b_dtype.is_float):
            raise LayoutError(
                f"div needs float operands, got {a.dtype.name} and {b_dtype.name}; typecast them first"
            )
        return self._binary("div", a, other)

    @op("log", Kind.ELEMENTWISE, 1, unary_compute(np.log), version=3, float_only=True)
    def log(self, x: Value, *, loc: str | None = None) -> Value:
        """Natural logarithm (floats only; -inf at 0, NaN below 0)."""
        return self._unary("log", x)

    @op("erf", Kind.ELEMENTWISE, 1, _erf, version=3, float_only=True)
    def erf(self, x: Value, *, loc: str | None = None) -> Value:
        """The error function (floats only; torch.erf)."""
        return self._unary("erf", x)

    @op("sin", Kind.ELEMENTWISE, 1, unary_compute(np.sin), version=4, float_only=True)
    def sin(self, x: Value, *, loc: str | None = None) -> Value:
        """sin(x) (floats only; torch.sin)."""
        return self._unary("sin", x)

    @op("cos", Kind.ELEMENTWISE, 1, unary_compute(np.cos), version=4, float_only=True)
    def cos(self, x: Value, *, loc: str | None = None) -> Value:
        """cos(x) (floats only; torch.cos)."""
        return self._unary("cos", x)

    @op("floor", Kind.ELEMENTWISE, 1, unary_compute(np.floor), version=4, float_only=True)
    def floor(self, x: Value, *, loc: str | None = None) -> Value:
        """The largest integer <= x, as a float (floats only; torch.floor)."""
        return self._unary("floor", x)

    @op("ceil", Kind.ELEMENTWISE, 1, unary_compute(np.ceil), version=4, float_only=True)
    def ceil(self, x: Value, *, loc: str | None = None) -> Value:
        """The smallest integer >= x, as a float (floats only; torch.ceil)."""
        return self._unary("ceil", x)

    @op("round", Kind.ELEMENTWISE, 1, unary_compute(np.rint), version=4, float_only=True)
    def round(self, x: Value, *, loc: str | None = None) -> Value:
        """x rounded to the nearest integer, halves to even (floats only; torch.round)."""
        return self._unary("round", x)

    @op("trunc", Kind.ELEMENTWISE, 1, unary_compute(np.trunc), version=4, float_only=True)
    def trunc(self, x: Value, *, loc: str | None = None) -> Value:
        """x rounded toward zero (floats only; torch.trunc)."""
        return self._unary("trunc", x)

    @op("abs", Kind.ELEMENTWISE, 1, unary_compute(np.abs), version=3, range_check=RangeCheck.RESULT)
    def abs(self, x: Value, *, loc: str | None = None) -> Value:
        """|x| (any dtype; INT32's -2**31 stays -2**31, as two's complement wraps)."""
        return self._unary("abs", x)
