"""`matmul` and `linear` (matmul plus bias, its fused activation), with their transposes. The
program config (core grid, block sizes) and compute config are the compiler's plan for silicon;
the product they give is the same, and ttflow records them with the op's text."""

from __future__ import annotations

from collections.abc import Sequence

from ..._ir.builder import Value
from ..._types import DataType
from ..lower import Lowering, Translator
from ..mlir import attr_bool
from ..reader import TtnnOp
from .eltwise import UNARY


def _t(c: Lowering, x: Value) -> Value:
    axes = list(range(len(x.shape)))
    axes[-2], axes[-1] = axes[-1], axes[-2]
    return c.b.permute(x, axes)


def _product(c: Lowering, op: TtnnOp, a: Value, b: Value) -> Value:
    if c.result_dtype(op) is DataType.FLOAT32:  # bf16 operands, a float32 result: the product is
        a, b = (v if v.dtype is DataType.FLOAT32 else c.b.typecast(v, DataType.FLOAT32) for v in (a, b))
        # accumulated and stored in float32 (fp32_dest_acc_en), never rounded to the operands' dtype
    if attr_bool(op.op, "transpose_a", default=False):
        a = _t(c, a)
    if attr_bool(op.op, "transpose_b", default=False):
        b = _t(c, b)
    if len(a.shape) == 1 or len(b.shape) == 1:
        raise c.refuse("a rank-1 operand (ttflow's matmul takes rank >= 2)")
    return c.b.matmul(a, b)


def _activation(c: Lowering, op: TtnnOp, y: Value) -> Value:
    name = op.op.attributes.get("activation")
    if name is None:
        return y
    name = name.strip('"')
    if name not in UNARY:
        raise c.refuse(f"fused activation {name!r} has no translation")
    return UNARY[name](c, y)


def _matmul(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    a, b = c.operands(op)
    return [_activation(c, op, _product(c, op, a, b))]


def _linear(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    values = c.operands(op)
    y = _product(c, op, values[0], values[1])
    if len(values) > 2:
        y = c.b.add(y, values[2])
    return [_activation(c, op, y)]


TRANSLATORS: dict[str, Translator] = {"ttnn.matmul": _matmul, "ttnn.linear": _linear}

_PRODUCT = frozenset({"transpose_a", "transpose_b", "activation"})
READS: dict[str, frozenset[str]] = {"ttnn.matmul": _PRODUCT, "ttnn.linear": _PRODUCT}
