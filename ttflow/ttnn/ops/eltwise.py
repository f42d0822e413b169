"""Elementwise ops: unary, binary (with their fused activation chains), `where`, clamps."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..._ir.builder import Value
from ..lower import Lowering, Translator
from ..mlir import activations, attr_float, attr_int
from ..reader import TtnnOp

Unary = Callable[[Lowering, Value], Value]

# A unary op by its TTNN name (as an op and as a fused activation's op_type).
UNARY: dict[str, Unary] = {
    "abs": lambda c, x: c.b.abs(x),
    "ceil": lambda c, x: c.b.ceil(x),
    "cos": lambda c, x: c.b.cos(x),
    "floor": lambda c, x: c.b.floor(x),
    "gelu": lambda c, x: c.b.gelu(x),
    "neg": lambda c, x: c.b.neg(x),
    "relu": lambda c, x: c.b.relu(x),
    "sqrt": lambda c, x: c.b.sqrt(x),
    "rsqrt": lambda c, x: c.b.rsqrt(x),
    "sigmoid": lambda c, x: c.b.sigmoid(x),
    "sin": lambda c, x: c.b.sin(x),
    "reciprocal": lambda c, x: c.b.reciprocal(x),
    "recip": lambda c, x: c.b.reciprocal(x),
    "tanh": lambda c, x: c.b.tanh(x),
    "exp": lambda c, x: c.b.exp(x),
    "erf": lambda c, x: c.b.erf(x),
    "log": lambda c, x: c.b.log(x),
    "silu": lambda c, x: c.b.silu(x),
    "square": lambda c, x: c.b.mul(x, x),
    "logical_not": lambda c, x: c.b.eq(x, 0),
    "logical_not_unary": lambda c, x: c.b.eq(x, 0),  # the fused activation's name for it
    "relu6": lambda c, x: c.b.clamp(x, 0.0, 6.0),
    "tan": lambda c, x: c.b.div(c.b.sin(x), c.b.cos(x)),
    "atan": lambda c, x: c.b.atan2(x, 1.0),
    "round": lambda c, x: c.b.round(x),
    "expm1": lambda c, x: _expm1(c, x),
    "log1p": lambda c, x: _log1p(c, x),
    "cbrt": lambda c, x: c.b.mul(c.b.sub(c.b.gt(x, 0.0), c.b.lt(x, 0.0)), c.b.pow(c.b.abs(x), 1.0 / 3.0)),
    # x - x is 0 for a finite x, NaN for an infinity or NaN (and NaN == 0 is false)
    "isfinite": lambda c, x: c.b.eq(c.b.sub(x, x), 0.0),
    # sign: 1, 0 or -1 in x's dtype, NaN for NaN (as JAX's and torch's): x != x only there
    "sign": lambda c, x: _sign(c, x),
}

BINARY: dict[str, Callable[[Lowering, Value, Value], Value]] = {
    "add": lambda c, a, b: c.b.add(a, b),
    "subtract": lambda c, a, b: c.b.sub(a, b),
    "multiply": lambda c, a, b: c.b.mul(a, b),
    "divide": lambda c, a, b: c.b.div(a, b),
    "eq": lambda c, a, b: c.b.eq(a, b),
    "ne": lambda c, a, b: c.b.ne(a, b),
    "gt": lambda c, a, b: c.b.gt(a, b),
    "ge": lambda c, a, b: c.b.ge(a, b),
    "lt": lambda c, a, b: c.b.lt(a, b),
    "le": lambda c, a, b: c.b.le(a, b),
    "maximum": lambda c, a, b: c.b.maximum(a, b),
    "minimum": lambda c, a, b: c.b.minimum(a, b),
    "bitwise_and": lambda c, a, b: c.b.bitwise_and(a, b),
    "bitwise_or": lambda c, a, b: c.b.bitwise_or(a, b),
    "bitwise_xor": lambda c, a, b: c.b.bitwise_xor(a, b),
    # ttnn.remainder truncates, the dividend's sign (tt-mlir's definition: -17 rem 3 = -2), as
    # stablehlo.remainder and C's fmod: ttflow's fmod (jnp's floored % is rem plus a fix-up)
    "remainder": lambda c, a, b: c.b.fmod(a, b),
    "atan2": lambda c, a, b: c.b.atan2(a, b),
    "bitwise_left_shift": lambda c, a, b: c.b.left_shift(a, b),
    "bitwise_right_shift": lambda c, a, b: c.b.right_shift(a, b),
    "logical_left_shift": lambda c, a, b: c.b.left_shift(a, b),
    "logical_and": lambda c, a, b: c.b.mul(c.b.ne(a, 0), c.b.ne(b, 0)),
    "logical_or": lambda c, a, b: c.b.maximum(c.b.ne(a, 0), c.b.ne(b, 0)),
    "logical_xor": lambda c, a, b: c.b.ne(c.b.ne(a, 0), c.b.ne(b, 0)),
}


def _sign(c: Lowering, x: Value) -> Value:
    step = c.b.sub(c.b.gt(x, 0), c.b.lt(x, 0))
    return c.b.where(c.b.ne(x, x), x, step) if x.dtype.is_float else step


def _expm1(c: Lowering, x: Value) -> Value:
    """exp(x) - 1 without the cancellation near 0: Kahan's (u - 1) * x / log(u), u = exp(x), with
    x itself where u rounds to 1 and -1 where u - 1 is -1."""
    u = c.b.exp(x)
    um1 = c.b.sub(u, 1.0)
    body = c.b.mul(um1, c.b.div(x, c.b.log(u)))
    return c.b.where(c.b.eq(u, 1.0), x, c.b.where(c.b.eq(um1, -1.0), -1.0, body))


def _log1p(c: Lowering, x: Value) -> Value:
    """log(1 + x) without the cancellation near 0: Kahan's log(u) * x / (u - 1), u = 1 + x, with x
    itself where u rounds to 1."""
    u = c.b.add(x, 1.0)
    body = c.b.mul(c.b.log(u), c.b.div(x, c.b.sub(u, 1.0)))
    return c.b.where(c.b.eq(u, 1.0), x, body)


def _pow(c: Lowering, a: Value, b: Value) -> Value:
    """a ** b elementwise, with pow's special cases (C99's, as XLA's): |a| ** b as exp(b log |a|),
    negative a to an integral b signed by b's parity and to any other b NaN, x ** 0 = 1."""
    mag = c.b.exp(c.b.mul(b, c.b.log(c.b.abs(a))))
    integral = c.b.eq(b, c.b.floor(b))
    odd = c.b.ne(c.b.remainder(b, 2.0), 0.0)
    signed = c.b.where(odd, c.b.neg(mag), mag)
    nan = c.b.exp(c.b.mul(b, c.b.log(a)))  # log of a negative number: NaN where it is wanted
    out = c.b.where(c.b.lt(a, 0.0), c.b.where(integral, signed, nan), mag)
    return c.b.where(c.b.eq(b, 0.0), 1.0, out)


BINARY["pow_tensor"] = _pow


def _chain(c: Lowering, op: TtnnOp, key: str, x: Value) -> Value:
    """Apply the fused activations listed under `key`, in order (tt-mlir's unary_with_param)."""
    for name, params in activations(op.op, key):
        if name == "round" and params == [0.0]:  # round to 0 decimals: round
            params = []
        if params or name not in UNARY:
            raise c.refuse(f"fused activation {name}{params or ''} under {key} has no translation")
        x = UNARY[name](c, x)
    return x


def _unary(name: str) -> Translator:
    def translate(c: Lowering, op: TtnnOp) -> Sequence[Value]:
        (x,) = c.operands(op)
        if "decimals" in op.op.attributes and attr_int(op.op, "decimals") != 0:
            raise c.refuse("rounding to decimals other than 0")
        return [UNARY[name](c, x)]
    return translate


def _binary(name: str) -> Translator:
    def translate(c: Lowering, op: TtnnOp) -> Sequence[Value]:
        a, b = c.operands(op)
        a = _chain(c, op, "input_tensor_a_activations", a)
        b = _chain(c, op, "input_tensor_b_activations", b)
        return [_chain(c, op, "activations", BINARY[name](c, a, b))]
    return translate


def _where(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    cond, a, b = c.operands(op)
    return [c.b.where(cond, a, b)]


def _clamp_scalar(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    (x,) = c.operands(op)
    return [c.b.clamp(x, attr_float(op.op, "min"), attr_float(op.op, "max"))]


def _clamp_tensor(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    """min(max(x, low), high), elementwise (JAX's clamp with array bounds)."""
    x, low, high = c.operands(op)
    return [c.b.minimum(c.b.maximum(x, low), high)]


TRANSLATORS: dict[str, Translator] = {
    **{f"ttnn.{n}": _unary(n) for n in UNARY if n not in ("recip", "square", "logical_not_unary")},
    **{f"ttnn.{n}": _binary(n) for n in BINARY},
    "ttnn.where": _where,
    "ttnn.clamp_scalar": _clamp_scalar,
    "ttnn.clamp_tensor": _clamp_tensor,
}

_ACTIVATIONS = frozenset({"activations", "input_tensor_a_activations", "input_tensor_b_activations"})
READS: dict[str, frozenset[str]] = {
    **{f"ttnn.{n}": frozenset() for n in UNARY if n not in ("recip", "square", "logical_not_unary")},
    "ttnn.round": frozenset({"decimals"}),
    **{f"ttnn.{n}": _ACTIVATIONS for n in BINARY},
    "ttnn.where": frozenset(),
    "ttnn.clamp_scalar": frozenset({"min", "max"}),
    "ttnn.clamp_tensor": frozenset(),
}
