"""Creation ops: full, zeros, ones, arange, constant. Each result's shape and dtype are its MLIR type's."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

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


_HOST = {"f32": "<f4", "si32": "<i4", "ui32": "<u4", "ui16": "<u2", "ui8": "u1", "bf16": "<u2"}


def _constant(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    """The values its table holds (little-endian, its input_dtype), as the result's shape."""
    shape = c.result_shape(op)
    code = _HOST.get(op.data_type or "")
    if op.data is None or code is None:
        raise c.refuse(f"its data (of type {op.data_type}) cannot be read")
    raw = np.frombuffer(op.data, np.dtype(code))
    if raw.size != math.prod(shape):
        raise c.refuse(f"it holds {raw.size} values for a result of {math.prod(shape)}")
    values = (raw.astype(np.uint32) << 16).view(np.float32) if op.data_type == "bf16" else raw
    return [c.b.constant(values.reshape(shape), c.result_dtype(op))]


TRANSLATORS: dict[str, Translator] = {
    "ttnn.constant": _constant,
    "ttnn.full": _filled(None), "ttnn.zeros": _filled(0.0), "ttnn.ones": _filled(1.0),
    "ttnn.arange": _arange,
}

READS: dict[str, frozenset[str]] = {
    "ttnn.constant": frozenset({"value"}),  # printed elided; the table's bytes are read instead
    "ttnn.full": frozenset({"fill_value", "shape"}), "ttnn.zeros": frozenset({"shape"}),
    "ttnn.ones": frozenset({"shape"}), "ttnn.arange": frozenset({"start", "end", "step"}),
}
