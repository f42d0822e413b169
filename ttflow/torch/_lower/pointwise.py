"""Elementwise ops: casts, unary math, arithmetic, comparisons, logical and bitwise ops, where."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

import ttflow as tt

from .device_view import _value_dtype
from .graph import (
    _T,
    _dims,
    _ishape,
    _Lowering,
    _meta_tensor,
    _op_name,
    _out,
    _register,
    _user_line,
)

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


# -- no-ops and casts --------------------------------------------------------------------------------


@_register(aten.alias.default, aten.clone.default, aten.detach.default, aten.lift_fresh_copy.default,
           aten.contiguous.default, aten.lift_fresh.default)
def _identity(L: _Lowering, node: torch.fx.Node, x: _T, *args: Any, **kwargs: Any) -> Any:
    return x.v


@_register(aten._to_copy.default)
def _to_copy(L: _Lowering, node: torch.fx.Node, x: _T, **kwargs: Any) -> Any:
    return _cast_node(L, node, x, _out(node).dtype)


def _cast_node(L: _Lowering, node: torch.fx.Node, x: _T, dtype: torch.dtype) -> Any:
    """A cast op. From a float to an integer type it saturates as silicon's typecast does:
    infinities go to the ends of INT32, NaN to 0, where CPU torch's x86 conversion gives the
    integer-indefinite value (the most negative one). A finite value past INT32 cast to int64
    is still an error naming the op: CPU torch holds it exactly, the device could not."""
    if not (x.dtype.is_floating_point and not dtype.is_floating_point and dtype != torch.bool):
        return L.cast(x, dtype)
    target = _value_dtype(dtype, x.shape)
    if dtype != torch.int64:
        return L.b.typecast(x.v, target)
    finite = L.b.eq(L.b.sub(x.v, x.v), 0)
    with L.b.checking_range(f"{_op_name(node.target)} casts a float to int64, which the tt device "
                            f"holds as INT32{_user_line(node)}"):
        checked = L.b.typecast(L.b.where(finite, x.v, 0.0), target)
    return L.b.where(finite, checked, L.b.typecast(x.v, target))



@_register(torch.ops.prims.convert_element_type.default)
def _convert_element_type(L: _Lowering, node: torch.fx.Node, x: _T, dtype: torch.dtype) -> Any:
    """What a decomposition casts with (a float argument of a compiled function, into float32)."""
    return _cast_node(L, node, x, _out(node).dtype)


@_register(aten.copy.default)
def _copy(L: _Lowering, node: torch.fx.Node, dst: _T, src: _T, non_blocking: bool = False) -> Any:
    v = _cast_node(L, node, src, dst.dtype)
    return v if v.shape == _ishape(dst.shape) else L.b.broadcast_to(v, _ishape(dst.shape))


# -- elementwise -------------------------------------------------------------------------------------


def _unary(op: str, float_only: bool = True) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
        dtype = _out(node).dtype
        v = L.cast(x, dtype) if (float_only or dtype != torch.bool) else x.v
        return getattr(L.b, op)(v)

    lower.__name__ = f"_{op}"
    return lower


for _op, _name, _float in [
    (aten.exp.default, "exp", True), (aten.sqrt.default, "sqrt", True),
    (aten.rsqrt.default, "rsqrt", True), (aten.reciprocal.default, "reciprocal", True),
    (aten.tanh.default, "tanh", True), (aten.sigmoid.default, "sigmoid", True),
    (aten.erf.default, "erf", True), (aten.log.default, "log", True),
    (aten.silu.default, "silu", True), (aten.relu.default, "relu", False),
    (aten.neg.default, "neg", False), (aten.abs.default, "abs", False),
    (aten.sin.default, "sin", True), (aten.cos.default, "cos", True),
]:
    _register(_op)(_unary(_name, _float))


def _rounding(op: str) -> Callable[..., Any]:
    """floor/ceil/round/trunc: the op on floats, the value itself on integers (as torch)."""

    def lower(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
        if not x.dtype.is_floating_point:
            return x.v
        return getattr(L.b, op)(L.cast(x, _out(node).dtype))

    lower.__name__ = f"_{op}"
    return lower


for _op, _name in [(aten.floor.default, "floor"), (aten.ceil.default, "ceil"),
                   (aten.round.default, "round"), (aten.trunc.default, "trunc")]:
    _register(_op)(_rounding(_name))


@_register(aten.gelu.default)
def _gelu(L: _Lowering, node: torch.fx.Node, x: _T, approximate: str = "none") -> Any:
    if approximate == "none":
        return L.b.gelu(L.cast(x, _out(node).dtype))
    # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in float32 then rounded once.
    b, v = L.b, L.f32(x)
    inner = b.mul(b.add(v, b.mul(b.mul(b.mul(v, v), v), 0.044715)), math.sqrt(2.0 / math.pi))
    return b.mul(b.mul(v, 0.5), b.add(b.tanh(inner), 1.0))


@_register(aten.sign.default)
def _sign(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    b, v = L.b, L.cast(x, _out(node).dtype)
    return b.sub(b.gt(v, 0), b.lt(v, 0))


@_register(aten.isnan.default)
def _isnan(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    return L.b.ne(x.v, x.v)


@_register(aten.isinf.default)
def _isinf(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    return L.b.eq(L.b.abs(x.v), math.inf) if x.dtype.is_floating_point else L.full(x.shape, 0, torch.bool)


@_register(aten.isfinite.default)
def _isfinite(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    return L.b.eq(L.b.sub(x.v, x.v), 0) if x.dtype.is_floating_point else L.full(x.shape, 1, torch.bool)


@_register(aten.logical_not.default)
def _logical_not(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    return L.b.eq(L.bool01(x), 0)


@_register(aten.bitwise_not.default)
def _bitwise_not(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    if x.dtype == torch.bool:
        return L.b.eq(x.v, 0)
    return L.b.sub(L.b.neg(x.v), 1)  # two's complement: ~x == -x - 1


@_register(aten.pow.Tensor_Scalar)
def _pow(L: _Lowering, node: torch.fx.Node, x: _T, p: float) -> Any:
    dtype = _out(node).dtype
    if p == 1:
        return L.cast(x, dtype)
    if p == 2:
        v = L.cast(x, dtype)
        return L.b.mul(v, v)
    if dtype.is_floating_point:
        return L.b.pow(L.cast(x, dtype), float(p))
    if not float(p).is_integer() or p < 0:
        raise L.unsupported(f"an integer to the power {p!r} (only whole exponents >= 0 lower exactly)")
    return _integer_power(L, L.cast(x, dtype), int(p), _value_dtype(dtype, x.shape))


def _integer_power(L: _Lowering, v: Any, p: int, ddtype: tt.DataType) -> Any:
    """v ** p by squaring, in integer arithmetic: exact (float32 would round past 2**24), and
    no square is larger than the result, so a range check fails only where the result does."""
    result = None
    while p:
        if p & 1:
            result = v if result is None else L.b.mul(result, v)
        p >>= 1
        if p:
            v = L.b.mul(v, v)
    return result if result is not None else L.b.full(v.shape, 1, ddtype)


@_register(aten.pow.Scalar)
def _pow_scalar(L: _Lowering, node: torch.fx.Node, base: float, x: _T) -> Any:
    if not _out(node).dtype.is_floating_point:
        raise L.unsupported(f"{base!r} to an integer tensor's powers (float32 would round them)")
    if not base > 0:
        raise L.unsupported(f"a base of {base!r}: only a positive base lowers (as exp(x * log(base)))")
    return L.b.exp(L.b.mul(L.f32(x), math.log(base)))


@_register(aten.pow.Tensor_Tensor)
def _pow_tensor(L: _Lowering, node: torch.fx.Node, x: _T, p: _T) -> Any:
    if not _out(node).dtype.is_floating_point:
        raise L.unsupported("an integer to an integer tensor's powers (float32 would round them)")
    b = L.b
    return b.exp(b.mul(L.f32(p), b.log(L.f32(x))))  # NaN for a negative base, as numpy's float pow


def _promote(a: Any, b: Any) -> torch.dtype:
    """torch's result dtype of a binary op on these operands (tensors or numbers)."""
    return torch.result_type(_meta_tensor(a), _meta_tensor(b))


_MIRROR = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le", "eq": "eq", "ne": "ne"}


def _compare(op: str) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, a: Any, other: Any) -> Any:
        dtype = _promote(a, other)
        if not isinstance(a, _T):
            return getattr(L.b, _MIRROR[op])(L.operand(other, dtype), L.operand(a, dtype))
        return getattr(L.b, op)(L.operand(a, dtype), L.operand(other, dtype))

    return lower


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    _register(getattr(aten, _name).Tensor, getattr(aten, _name).Scalar)(_compare(_name))


@_register(aten.add.Tensor, aten.add.Scalar)
def _add(L: _Lowering, node: torch.fx.Node, a: Any, other: Any, alpha: float = 1) -> Any:
    dtype, b = _out(node).dtype, L.b
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    if alpha != 1:
        y = y * alpha if not isinstance(other, _T) else b.mul(y, alpha)
    if dtype == torch.bool:
        return b.ne(b.add(x, y), 0)
    if not isinstance(a, _T):
        return b.add(y, x)
    return b.add(x, y)


@_register(aten.sub.Tensor, aten.sub.Scalar)
def _sub(L: _Lowering, node: torch.fx.Node, a: Any, other: Any, alpha: float = 1) -> Any:
    dtype, b = _out(node).dtype, L.b
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    if alpha != 1:
        y = y * alpha if not isinstance(other, _T) else b.mul(y, alpha)
    if not isinstance(a, _T):
        return b.add(b.neg(y), x)
    return b.sub(x, y)


@_register(aten.mul.Tensor, aten.mul.Scalar)
def _mul(L: _Lowering, node: torch.fx.Node, a: Any, other: Any) -> Any:
    dtype = _out(node).dtype
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    return L.b.mul(y, x) if not isinstance(a, _T) else L.b.mul(x, y)


@_register(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div(L: _Lowering, node: torch.fx.Node, a: Any, other: Any, rounding_mode: str | None = None) -> Any:
    b, dtype = L.b, _out(node).dtype
    if rounding_mode is not None:
        return _rounded_div(L, node, a, other, rounding_mode)
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    if not isinstance(a, _T):
        return b.mul(b.reciprocal(y), x) if x != 1 else b.reciprocal(y)
    return b.div(x, y)


def _tensor_operands(L: _Lowering, a: Any, other: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """Both operands of a non-commutative op in `dtype`: a number as the first becomes a
    one-element constant (the second may stay a number: the builder takes it as the scalar)."""
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    if not isinstance(a, _T):
        x = L.full((1,), x, dtype)
    return x, y


def _rounded_div(L: _Lowering, node: torch.fx.Node, a: Any, other: Any, rounding_mode: str) -> Any:
    """`div(rounding_mode=)` and `//` in the result's dtype, as torch computes them: floor by
    `floor_divide` (integers exactly, floats by torch's fmod-based rule); trunc of floats as
    trunc(a / b), of integers as (a - fmod(a, b)) // b, which divides exactly. (Through float32
    and INT32, as before, integers past 2**24 and quotients past 2**31 came out wrong.)"""
    b, dtype = L.b, _out(node).dtype
    if rounding_mode not in ("trunc", "floor"):
        raise L.unsupported(f"rounding_mode={rounding_mode!r}")
    x, y = _tensor_operands(L, a, other, dtype)
    if rounding_mode == "floor":
        return b.floor_divide(x, y)
    if dtype.is_floating_point:
        return b.trunc(b.div(x, y))
    return b.floor_divide(b.sub(x, b.fmod(x, y)), y)


@_register(aten.floor_divide.default, aten.floor_divide.Scalar)
def _floor_divide(L: _Lowering, node: torch.fx.Node, a: Any, other: Any) -> Any:
    return _rounded_div(L, node, a, other, "floor")


def _modulo(op: str) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, a: Any, other: Any) -> Any:
        return getattr(L.b, op)(*_tensor_operands(L, a, other, _out(node).dtype))

    return lower


_register(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)(_modulo("remainder"))
_register(aten.fmod.Tensor, aten.fmod.Scalar)(_modulo("fmod"))
_register(aten.atan2.default)(_modulo("atan2"))


@_register(aten.atan.default)
def _atan(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    return L.b.atan2(L.cast(x, _out(node).dtype), 1.0)  # atan(x) is the angle of (1, x)


@_register(aten.flip.default)
def _flip(L: _Lowering, node: torch.fx.Node, x: _T, dims: Sequence[int]) -> Any:
    """Each flipped axis as a gather of a reversed arange (cumsum's backward flips its grad)."""
    b, v = L.b, x.v
    shape = _ishape(x.shape)
    for axis in _dims(dims, len(x.shape)) if x.shape else []:
        n = shape[axis]
        if n == 1:
            continue
        index = b.reshape(b.arange(n - 1, -1, -1), tuple(n if d == axis else 1 for d in range(len(shape))))
        v = b.gather(v, b.broadcast_to(index, shape), axis)
    return v


@_register(aten.cumsum.default)
def _cumsum(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, dtype: Any = None) -> Any:
    v = L.cast(x, _out(node).dtype)
    if not x.shape:  # a 0-d tensor is its own running sum
        return v
    return L.b.cumsum(v, _dims(dim, len(x.shape))[0])


def _minmax(op: str) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, a: _T, other: _T) -> Any:
        dtype = _out(node).dtype
        return getattr(L.b, op)(L.cast(a, dtype), L.cast(other, dtype))

    return lower


_register(aten.maximum.default)(_minmax("maximum"))
_register(aten.minimum.default)(_minmax("minimum"))


@_register(aten.clamp.default, aten.clamp.Tensor)
def _clamp(L: _Lowering, node: torch.fx.Node, x: _T, lo: Any = None, hi: Any = None) -> Any:
    dtype = _out(node).dtype
    v = L.cast(x, dtype)
    if lo is not None:
        v = L.b.maximum(v, L.operand(lo, dtype))
    if hi is not None:
        v = L.b.minimum(v, L.operand(hi, dtype))
    return v


@_register(aten.clamp_min.default, aten.clamp_min.Tensor)
def _clamp_min(L: _Lowering, node: torch.fx.Node, x: _T, lo: Any) -> Any:
    return _clamp(L, node, x, lo, None)


@_register(aten.clamp_max.default, aten.clamp_max.Tensor)
def _clamp_max(L: _Lowering, node: torch.fx.Node, x: _T, hi: Any) -> Any:
    return _clamp(L, node, x, None, hi)


def _logical(op: str) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, a: _T, other: Any) -> Any:
        if not isinstance(other, _T):
            other = _T(L.full((), other, torch.bool), (), torch.bool)
        x, y = L.bool01(a), L.bool01(other)
        if op == "and":
            return L.b.mul(x, y)
        if op == "or":
            return L.b.maximum(x, y)
        return L.b.ne(x, y)

    return lower


for _name, _kind in (("and", "and"), ("or", "or"), ("xor", "xor")):
    _register(getattr(aten, f"logical_{_name}").default)(_logical(_kind))


def _bitwise(op: str) -> Callable[..., Any]:
    logical = _logical(op)

    def lower(L: _Lowering, node: torch.fx.Node, a: _T, other: Any) -> Any:
        dtype = _out(node).dtype
        if dtype == torch.bool:
            return logical(L, node, a, other)
        return getattr(L.b, f"bitwise_{op}")(L.cast(a, dtype), _integer_operand(L, other, dtype))

    return lower


def _integer_operand(L: _Lowering, other: Any, dtype: torch.dtype) -> Any:
    """A bit op's second operand in `dtype`: a value, or a Python int that INT32 holds (an
    int64 tensor lives as INT32; a wider mask would need its high bits)."""
    if isinstance(other, _T):
        return L.cast(other, dtype)
    value = int(other)
    if not -(2**31) <= value < 2**31:
        raise L.unsupported(f"the integer {value} does not fit INT32, which the tt device holds {dtype} in")
    return value


for _name in ("and", "or", "xor"):
    _register(getattr(aten, f"bitwise_{_name}").Tensor, getattr(aten, f"bitwise_{_name}").Scalar)(_bitwise(_name))


def _shift(op: str) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, a: Any, other: Any) -> Any:
        dtype = _out(node).dtype
        if not isinstance(a, _T):  # `2 << x`: the number as a constant of x's shape
            a = _T(L.full(other.shape, a, dtype), other.shape, dtype)
        return getattr(L.b, op)(L.cast(a, dtype), _integer_operand(L, other, dtype))

    return lower


_register(aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
          aten.bitwise_left_shift.Scalar_Tensor, aten.__lshift__.Tensor, aten.__lshift__.Scalar)(_shift("left_shift"))
_register(aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
          aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Tensor, aten.__rshift__.Scalar)(_shift("right_shift"))


@_register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(L: _Lowering, node: torch.fx.Node, cond: _T, a: Any, other: Any) -> Any:
    dtype = _out(node).dtype
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    if not isinstance(a, _T) and not isinstance(other, _T):
        x = L.full((), x, dtype)
    return L.b.where(cond.v, x, y)


# -- float32 math composed from the device's exp, log, sqrt, atan2, sin, cos ----------------------
#
# Each helper takes and gives FLOAT32 program values. The device's exp, log, sqrt, sin, cos and
# atan2 are within about 1 ulp (numpy's float32 functions, as torch's vectorised CPU kernels);
# the compositions below avoid the cancellations and overflows of the textbook formulas (1 - x*x
# near 1, exp(x) - 1 near 0, e**x past 88), so each stays within a few ulps of the exact value.


def _log1p_v(b: Any, y: Any) -> Any:
    """log(1 + y) by Kahan's trick: log(u) * (y / (u - 1)) with u = 1 + y rounded (exact where
    u - 1 == 0: then y itself); y / (u - 1) first, so a huge y does not overflow."""
    u = b.add(y, 1.0)
    d = b.sub(u, 1.0)
    zero = b.eq(d, 0)
    r = b.mul(b.log(u), b.div(y, b.where(zero, 1.0, d)))
    return b.where(b.eq(u, math.inf), u, b.where(zero, y, r))


def _expm1_v(b: Any, x: Any) -> Any:
    """exp(x) - 1 by Kahan's trick: (u - 1) * x / log(u) with u = exp(x); x itself where u
    rounds to 1 (signed zeros kept), -1 where u - 1 is -1, infinity where u overflows."""
    u = b.exp(x)
    d = b.sub(u, 1.0)
    one = b.eq(u, 1.0)
    r = b.mul(d, b.div(x, b.where(one, 1.0, b.log(u))))
    r = b.where(one, x, r)
    r = b.where(b.eq(d, -1.0), -1.0, r)
    return b.where(b.eq(u, math.inf), u, r)


def _scale2_v(b: Any, v: Any, n: Any) -> Any:
    """v * 2**n for an INT32 n with |n| <= 254, exactly (one rounding at most, where the result
    is subnormal): one multiplication or division by 2**k per bit k of |n|, so no factor
    overflows (2**n itself may not be a float32)."""
    neg = b.lt(n, 0)
    m = b.abs(n)
    for k, factor in ((1, 2.0), (2, 4.0), (4, 16.0), (8, 256.0), (16, 65536.0), (32, 2.0**32),
                      (64, 2.0**64), (128, 2.0**64), (128, 2.0**64)):
        bit = b.typecast(b.ne(b.bitwise_and(m, k), 0), _F32)
        f = b.add(b.mul(bit, factor - 1.0), 1.0)  # 2**k or 1 (2**64 - 1 rounds to 2**64)
        v = b.where(neg, b.div(v, f), b.mul(v, f))
    return v


def _exp2_v(b: Any, x: Any) -> Any:
    """2**x as 2**n * exp(f * ln 2) with n = round(x) (clamped to [-127, 127]) and f = x - n,
    exact: whole x give exact powers of two, and exp's argument stays small."""
    n = b.minimum(b.maximum(b.round(x), -127.0), 127.0)
    f = b.sub(x, n)
    return _scale2_v(b, b.exp(b.mul(f, math.log(2.0))), b.typecast(n, _I32))


def _signed(b: Any, x: Any, magnitude: Any) -> Any:
    """`magnitude` (>= 0) with x's sign; x itself where |x| < 2**-12, where an odd function
    such as sinh or asinh equals x in float32 (signed zeros kept)."""
    r = b.where(b.lt(x, 0), b.neg(magnitude), magnitude)
    return b.where(b.lt(b.abs(x), 2.0**-12), x, r)


def _float_unary(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    """A float op of one tensor: integer and bool inputs are cast to the result dtype (float32
    or bfloat16), the math runs in FLOAT32, the result is rounded once."""

    def lower(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
        return fn(L.b, L.f32(x))

    lower.__name__ = f"_{fn.__name__.strip('_')}"
    return lower


def _asin_v(b: Any, x: Any) -> Any:
    # atan2(x, sqrt((1 - x)(1 + x))): 1 - x is exact near 1; NaN past |x| > 1 (sqrt of < 0).
    return b.atan2(x, b.sqrt(b.mul(b.add(b.neg(x), 1.0), b.add(x, 1.0))))


def _acos_v(b: Any, x: Any) -> Any:
    return b.atan2(b.sqrt(b.mul(b.add(b.neg(x), 1.0), b.add(x, 1.0))), x)


def _atanh_v(b: Any, x: Any) -> Any:
    # log1p(2a / (1 - a)) / 2 with a = |x| (1 - a exact near 1), x's sign: +-inf at +-1, NaN
    # past them.
    a = b.abs(x)
    return _signed(b, x, b.mul(_log1p_v(b, b.div(b.mul(a, 2.0), b.add(b.neg(a), 1.0))), 0.5))


_LN2 = math.log(2.0)


def _asinh_v(b: Any, x: Any) -> Any:
    # log1p(a + a^2 / (1 + sqrt(1 + a^2))) for a = |x| <= 2**13; log(a) + ln 2 beyond (a^2 would
    # overflow, and there sqrt(1 + a^2) is a in float32).
    a = b.abs(x)
    a2 = b.mul(a, a)
    small = _log1p_v(b, b.add(a, b.div(a2, b.add(b.sqrt(b.add(a2, 1.0)), 1.0))))
    large = b.add(b.log(a), _LN2)
    return _signed(b, x, b.where(b.gt(a, 2.0**13), large, small))


def _acosh_v(b: Any, x: Any) -> Any:
    # log1p(t + sqrt(t) sqrt(t + 2)) with t = x - 1 (exact near 1; NaN below 1 from sqrt(t));
    # log(x) + ln 2 past 2**13.
    t = b.sub(x, 1.0)
    small = _log1p_v(b, b.add(t, b.mul(b.sqrt(t), b.sqrt(b.add(t, 2.0)))))
    large = b.add(b.log(x), _LN2)
    return b.where(b.gt(x, 2.0**13), large, small)


def _cosh_v(b: Any, x: Any) -> Any:
    # (e + 1/e) / 2 with e = exp(|x|): infinite where e is, past 88.72, as torch's float32 cosh.
    e = b.exp(b.abs(x))
    return b.mul(b.add(e, b.reciprocal(e)), 0.5)


def _sinh_v(b: Any, x: Any) -> Any:
    # (m + m / (m + 1)) / 2 with m = expm1(|x|) (no cancellation near 0); infinite where m is,
    # past 88.72, as torch's float32 sinh.
    m = _expm1_v(b, b.abs(x))
    s = b.mul(b.add(m, b.div(m, b.add(m, 1.0))), 0.5)
    return _signed(b, x, b.where(b.eq(m, math.inf), math.inf, s))


def _tan_v(b: Any, x: Any) -> Any:
    return b.div(b.sin(x), b.cos(x))


def _log2_v(b: Any, x: Any) -> Any:
    return b.mul(b.log(x), 1.0 / _LN2)


def _log10_v(b: Any, x: Any) -> Any:
    return b.mul(b.log(x), 1.0 / math.log(10.0))


for _op, _fn in [
    (aten.asin.default, _asin_v), (aten.acos.default, _acos_v), (aten.atanh.default, _atanh_v),
    (aten.asinh.default, _asinh_v), (aten.acosh.default, _acosh_v), (aten.cosh.default, _cosh_v),
    (aten.sinh.default, _sinh_v), (aten.tan.default, _tan_v), (aten.expm1.default, _expm1_v),
    (aten.exp2.default, _exp2_v), (aten.log2.default, _log2_v), (aten.log10.default, _log10_v),
]:
    _register(_op)(_float_unary(_fn))


@_register(aten.hypot.default)
def _hypot(L: _Lowering, node: torch.fx.Node, a: _T, other: _T) -> Any:
    """m * sqrt(1 + (n / m)**2) with m, n the larger and smaller magnitude (no overflow of the
    squares); 0 where both are 0, inf where either is inf (even with a NaN, as C's hypot)."""
    b = L.b
    x, y = b.abs(L.f32(a)), b.abs(L.f32(other))
    m, n = b.maximum(x, y), b.minimum(x, y)
    r = b.div(n, b.where(b.eq(m, 0), 1.0, m))
    h = b.mul(m, b.sqrt(b.add(b.mul(r, r), 1.0)))
    inf = b.maximum(b.eq(x, math.inf), b.eq(y, math.inf))
    return b.where(inf, math.inf, h)


def _fminmax(op: str) -> Callable[..., Any]:
    """fmax/fmin: the larger/smaller, a NaN losing to a number (C's fmax), x on a tie (torch's
    fmax(0.0, -0.0) is 0.0, fmax(-0.0, 0.0) is -0.0)."""

    def lower(L: _Lowering, node: torch.fx.Node, a: _T, other: _T) -> Any:
        dtype, b = _out(node).dtype, L.b
        x, y = L.cast(a, dtype), L.cast(other, dtype)
        if not dtype.is_floating_point:
            return b.maximum(x, y) if op == "ge" else b.minimum(x, y)
        r = b.where(getattr(b, op)(x, y), x, y)
        return b.where(b.ne(x, x), y, b.where(b.ne(y, y), x, r))

    return lower


_register(aten.fmax.default)(_fminmax("ge"))
_register(aten.fmin.default)(_fminmax("le"))


def _sign_bit(L: _Lowering, v: Any) -> Any:
    """INT32 1/0: whether float32 v's sign bit is set, for numbers and signed zeros (1 / -0 is
    -inf). A NaN's sign bit the device cannot see (it has no bitcast): a NaN fails the run (a
    ProgramError naming the op) rather than giving a sign that may be wrong."""
    b = L.b
    assert L.node is not None
    with b.checking_range(f"{_op_name(L.node.target)} reads the sign bit of a NaN, which the tt "
                          f"device cannot see{_user_line(L.node)}"):
        nan = b.typecast(b.mul(b.typecast(b.ne(v, v), _F32), 3.0e9), _I32)  # 0, or a failed range check
    negative = b.maximum(b.lt(v, 0), b.lt(b.reciprocal(v), 0))
    return b.add(b.typecast(negative, _I32), nan)


@_register(aten.signbit.default)
def _signbit(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    if x.dtype == torch.bool:
        return L.full(x.shape, 0, torch.bool)
    if not x.dtype.is_floating_point:
        return L.b.lt(x.v, 0)
    return _sign_bit(L, L.f32(x))


@_register(aten.copysign.Tensor, aten.copysign.Scalar)
def _copysign(L: _Lowering, node: torch.fx.Node, a: _T, other: Any) -> Any:
    b = L.b
    x = b.abs(L.f32(a))
    if not isinstance(other, _T):
        s = float(other)
        negative = math.copysign(1.0, s) < 0
        return b.neg(x) if negative else x
    return b.where(_sign_bit(L, L.f32(other)), b.neg(x), x)


@_register(aten.elu.default)
def _elu(L: _Lowering, node: torch.fx.Node, x: _T, alpha: float = 1, scale: float = 1,
         input_scale: float = 1) -> Any:
    """torch's CPU kernel: x * scale above 0, expm1(x * input_scale) * alpha * scale at or
    below (NaN stays NaN)."""
    b, v = L.b, L.f32(x)
    negative = b.mul(_expm1_v(b, b.mul(v, float(input_scale))), float(alpha) * float(scale))
    return b.where(b.le(v, 0), negative, b.mul(v, float(scale)))


@_register(aten.hardshrink_backward.default, aten.softshrink_backward.default)
def _shrink_backward(L: _Lowering, node: torch.fx.Node, grad: _T, x: _T, lambd: float) -> Any:
    """The gradient passes where x is outside [-lambd, lambd] (a NaN x passes it, as torch)."""
    b = L.b
    v, g = L.f32(x), L.f32(grad)
    inside = b.mul(b.ge(v, -float(lambd)), b.le(v, float(lambd)))
    return b.where(inside, 0.0, g)


@_register(aten.round.decimals)
def _round_decimals(L: _Lowering, node: torch.fx.Node, x: _T, *, decimals: int = 0) -> Any:
    """torch's float32 kernel step by step: rint(x * 10**d) / 10**d, or for d < 0
    rint(x / 10**-d) * 10**-d, 10**|d| rounded to float32 (each step rounds as the CPU's)."""
    b = L.b
    if not x.dtype.is_floating_point:
        return x.v
    v = L.cast(x, _out(node).dtype)
    ten = float(torch.tensor(10.0 ** abs(decimals), dtype=torch.float32))
    if decimals < 0:
        return b.mul(b.round(b.div(v, ten)), ten)
    return b.div(b.round(b.mul(v, ten)), ten)


@_register(aten.angle.default)
def _angle(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    """A real number's angle: pi below 0, else 0; NaN stays NaN."""
    b, v = L.b, L.f32(x)
    pi = b.mul(b.typecast(b.lt(v, 0), _F32), math.pi)
    return b.where(b.ne(v, v), v, pi)


_EUCLID_STEPS = 48
"""Euclid's algorithm on integers below 2**31 in magnitude takes at most 45 remainder steps
(Lamé: the Fibonacci number F(47) passes 2**31), one more to swap a smaller first operand."""


def _gcd_v(L: _Lowering, x: Any, y: Any) -> Any:
    """torch's calc_gcd step by step: a, b = |x|, |y|; while a != 0: a, b = b % a, a (C's %,
    fmod's sign), unrolled `_EUCLID_STEPS` times; a zero divisor is never divided by (it would
    fail a checked run), the lanes that are done keep their value."""
    b = L.b
    a, c = b.abs(x), b.abs(y)
    for _ in range(_EUCLID_STEPS):
        done = b.eq(a, 0)
        r = b.fmod(c, b.where(done, 1, a))
        a, c = b.where(done, a, r), b.where(done, c, a)
    return c


@_register(aten.gcd.default)
def _gcd(L: _Lowering, node: torch.fx.Node, x: _T, other: _T) -> Any:
    dtype = _out(node).dtype
    return _gcd_v(L, L.cast(x, dtype), L.cast(other, dtype))


@_register(aten.lcm.default)
def _lcm(L: _Lowering, node: torch.fx.Node, x: _T, other: _T) -> Any:
    """torch's: g = gcd(x, y); 0 where g is 0, else |x / g * y| (x / g exact, the product
    wraps in int32 as torch's int32 does; an int64 result past INT32 fails the run)."""
    b, dtype = L.b, _out(node).dtype
    u, w = L.cast(x, dtype), L.cast(other, dtype)
    g = _gcd_v(L, u, w)
    zero = b.eq(g, 0)
    q = b.floor_divide(u, b.where(zero, 1, g))
    return b.where(zero, 0, b.abs(b.mul(q, w)))


# -- frexp, nextafter: a float's exponent without a bitcast -----------------------------------------


def _frexp_v(b: Any, a: Any) -> tuple[Any, Any]:
    """m in [0.5, 1) and the INT32 e with a == m * 2**e, for finite a > 0 (subnormals too):
    e from floor(log2 a) + 1, then corrected by one either way (log2 may round across a whole
    number), m by the exact power-of-two scaling."""
    e = b.typecast(b.add(b.floor(_log2_v(b, a)), 1.0), _I32)
    m = _scale2_v(b, a, b.neg(e))
    high = b.ge(m, 1.0)
    m, e = b.where(high, b.mul(m, 0.5), m), b.add(e, b.typecast(high, _I32))
    low = b.lt(m, 0.5)
    return b.where(low, b.mul(m, 2.0), m), b.sub(e, b.typecast(low, _I32))


@_register(aten.frexp.Tensor)
def _frexp(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    """torch.frexp: x = mantissa * 2**exponent, |mantissa| in [0.5, 1) with x's sign; zeros
    (signed), the infinities and NaN are their own mantissa with exponent 0, as C's frexp."""
    b, v = L.b, L.f32(x)
    a = b.abs(v)
    ordinary = b.mul(b.gt(a, 0), b.lt(a, math.inf))  # NaN is neither
    m, e = _frexp_v(b, b.where(ordinary, a, 1.0))
    mantissa = b.where(ordinary, b.where(b.lt(v, 0), b.neg(m), m), v)
    return mantissa, b.where(ordinary, e, 0)


_F32_MAX = float(torch.finfo(torch.float32).max)


@_register(aten.nextafter.default)
def _nextafter(L: _Lowering, node: torch.fx.Node, x: _T, other: _T) -> Any:
    """The float32 next to x toward other, as C's nextafterf: other itself where they are equal
    (so nextafter(0, -0) is -0), NaN if either is; +-2**-149 from zero; else x plus or minus
    one unit in the last place, exact (2**(e - 24) for x = m 2**e, 2**-149 at least, half that
    toward zero from a power of two); +-inf steps to +-max, max steps to inf by the addition."""
    if _out(node).dtype != torch.float32:
        raise L.unsupported(f"nextafter of {_out(node).dtype} (float32 only)")
    b = L.b
    shape = _ishape(_out(node).shape)
    u, w = (v if v.shape == shape else b.broadcast_to(v, shape) for v in (L.f32(x), L.f32(other)))
    a = b.abs(u)
    m, e = _frexp_v(b, b.where(b.mul(b.gt(a, 0), b.lt(a, math.inf)), a, 1.0))
    one = b.full(u.shape, 1.0, _F32)
    up = _scale2_v(b, one, b.maximum(b.sub(e, 24), -149))
    down = b.where(b.eq(m, 0.5), _scale2_v(b, one, b.maximum(b.sub(e, 25), -149)), up)
    away = b.eq(b.gt(w, u), b.gt(u, 0))  # the step grows |x| (x != 0)
    step = b.where(away, up, down)
    r = b.where(b.gt(w, u), b.add(u, step), b.sub(u, step))
    r = b.where(b.eq(r, 0), b.mul(u, 0.0), r)  # -2**-149 steps up to -0
    r = b.where(b.eq(a, math.inf), b.where(b.gt(u, 0), b.full(shape, _F32_MAX, _F32), -_F32_MAX), r)
    r = b.where(b.eq(u, 0), b.mul(b.sub(b.typecast(b.gt(w, 0), _F32), 0.5), 2.0**-148), r)
    r = b.where(b.eq(u, w), w, r)
    nan = b.maximum(b.ne(u, u), b.ne(w, w))
    return b.where(nan, b.add(u, w), r)
