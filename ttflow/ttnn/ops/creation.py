"""Creation ops: full, zeros, ones, arange. Each result's shape and dtype are its MLIR type's."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..._ir.builder import Value
from ..lower import Lowering, Translator
from ..mlir import attr_float, attr_int, attr_shape
from ..reader import TtnnOp


def _filled(value: float | None) -> Translator:
    def translate(c: Lowering, op: TtnnOp) -> Sequence[Value]:
        fill = attr_float(op.op, "fill_value") if value is None else value
        if "shape" in op.op.attributes and tuple(attr_shape(op.op, "shape")) != tuple(op.op.result_types[0].shape or ()):
            raise c.refuse("its shape attribute and its result type disagree")
        if math.isnan(fill):  # NaN (jnp.take's fill for an index out of range): ttflow's full refuses it,
            zero = c.b.full(c.result_shape(op), 0.0, c.result_dtype(op))  # so it is made as 0 / 0
            return [c.b.div(zero, zero)]
        return [c.b.full(c.result_shape(op), fill, c.result_dtype(op))]
    return translate


def _arange(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    start, end = attr_int(op.op, "start"), attr_int(op.op, "end")
    step = attr_int(op.op, "step", default=1)
    return [c.b.arange(start, end, step, c.result_dtype(op))]


TRANSLATORS: dict[str, Translator] = {
    "ttnn.full": _filled(None), "ttnn.zeros": _filled(0.0), "ttnn.ones": _filled(1.0),
    "ttnn.arange": _arange,
}

READS: dict[str, frozenset[str]] = {
    "ttnn.full": frozenset({"fill_value", "shape"}), "ttnn.zeros": frozenset({"shape"}),
    "ttnn.ones": frozenset({"shape"}), "ttnn.arange": frozenset({"start", "end", "step"}),
}
