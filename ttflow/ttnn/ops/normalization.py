"""softmax and RMS norm (the compiler writes layer norm as centring plus rms_norm)."""

from __future__ import annotations

from collections.abc import Sequence

from ..._ir.builder import Value
from ..lower import Lowering, Translator
from ..mlir import attr_float, attr_int, attr_ints
from ..reader import TtnnOp


def _softmax(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    (x,) = c.operands(op)
    return [c.b.softmax(x, attr_int(op.op, "dimension", default=-1))]


def _segments(c: Lowering, op: TtnnOp, names: tuple[str, ...]) -> dict[str, Value | None]:
    """Operands by name from `operandSegmentSizes` (MLIR's optional operands)."""
    values = c.operands(op)
    sizes = attr_ints(op.op, "operandSegmentSizes", default=[1] * len(values))
    if len(sizes) != len(names) or sum(sizes) != len(values) or any(s not in (0, 1) for s in sizes):
        raise c.refuse(f"operandSegmentSizes {sizes} does not fit operands {names}")
    out: dict[str, Value | None] = {}
    it = iter(values)
    for name, size in zip(names, sizes, strict=True):
        out[name] = next(it) if size else None
    return out


def _rms_norm(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    parts = _segments(c, op, ("input", "weight", "bias"))
    x = parts["input"]
    assert x is not None
    y = c.b.rms_norm(x, parts["weight"], attr_float(op.op, "epsilon", default=1e-12))
    if parts["bias"] is not None:
        y = c.b.add(y, parts["bias"])
    return [y]


def _layer_norm(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    parts = _segments(c, op, ("input", "weight", "bias"))
    x = parts["input"]
    assert x is not None
    return [c.b.layer_norm(x, parts["weight"], parts["bias"], attr_float(op.op, "epsilon", default=1e-12))]


TRANSLATORS: dict[str, Translator] = {
    "ttnn.softmax": _softmax, "ttnn.rms_norm": _rms_norm, "ttnn.layer_norm": _layer_norm,
}

READS: dict[str, frozenset[str]] = {
    "ttnn.softmax": frozenset({"dimension", "numericStable"}),  # both forms give softmax's value
    "ttnn.rms_norm": frozenset({"epsilon", "operandSegmentSizes"}),
    "ttnn.layer_norm": frozenset({"epsilon", "operandSegmentSizes"}),
}
