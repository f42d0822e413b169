"""Data movement: reshape, permute, transpose, slice, concat, repeat, pad."""

from __future__ import annotations

from collections.abc import Sequence

from ..._ir.builder import Value
from ..lower import Lowering, Translator
from ..mlir import attr_float, attr_int, attr_ints
from ..reader import TtnnOp


def _reshape(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    (x,) = c.operands(op)
    return [c.b.reshape(x, c.result_shape(op))]


def _permute(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    (x,) = c.operands(op)
    return [c.b.permute(x, attr_ints(op.op, "permutation"))]


def _transpose(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    (x,) = c.operands(op)
    axes = list(range(len(x.shape)))
    a, b = attr_int(op.op, "dim0") % len(axes), attr_int(op.op, "dim1") % len(axes)
    axes[a], axes[b] = axes[b], axes[a]
    return [c.b.permute(x, axes)]


def _slice(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    (x,) = c.operands(op)
    begins, ends = attr_ints(op.op, "begins"), attr_ints(op.op, "ends")
    steps = attr_ints(op.op, "step", default=[1] * len(begins))
    if any(s <= 0 for s in steps):
        raise c.refuse(f"step {steps}: ttflow's slice takes positive steps")
    return [c.b.slice(x, begins, ends, steps)]


def _concat(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    values = c.operands(op)
    if len(values) == 1:
        return values
    return [c.b.concat(values, attr_int(op.op, "dim"))]


def _repeat(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    (x,) = c.operands(op)
    reps = attr_ints(op.op, "repeat_dims")
    if len(reps) != len(x.shape) or any(r < 1 for r in reps):
        raise c.refuse(f"repeat_dims {reps} does not fit a rank-{len(x.shape)} operand")
    for axis, r in enumerate(reps):
        if r > 1:
            x = c.b.concat([x] * r, axis)
    return [x]


def _pad(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    """`padding` is (before, after) per dim, outermost first; the value fills both sides."""
    (x,) = c.operands(op)
    padding = attr_ints(op.op, "padding")
    if len(padding) != 2 * len(x.shape) or any(p < 0 for p in padding):
        raise c.refuse(f"padding {padding} does not fit a rank-{len(x.shape)} operand")
    value = attr_float(op.op, "value", default=0.0)
    for axis in range(len(x.shape)):
        before, after = padding[2 * axis], padding[2 * axis + 1]
        parts = []
        for size in (before, None, after):
            if size is None:
                parts.append(x)
            elif size:
                shape = list(x.shape)
                shape[axis] = size
                parts.append(c.b.full(shape, value, x.dtype))
        if len(parts) > 1:
            x = c.b.concat(parts, axis)
    return [x]


def _repeat_interleave(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    """Each element along `dim` repeated `repeats` times in place (torch.repeat_interleave): a new
    axis after `dim`, `repeats` copies along it, folded back."""
    (x,) = c.operands(op)
    dim = attr_int(op.op, "dim") % len(x.shape)
    r = attr_int(op.op, "repeats")
    if r < 1:
        raise c.refuse(f"repeats {r}")
    spread = c.b.reshape(x, (*x.shape[:dim + 1], 1, *x.shape[dim + 1:]))
    copies = c.b.concat([spread] * r, dim + 1) if r > 1 else spread
    return [c.b.reshape(copies, c.result_shape(op))]


TRANSLATORS: dict[str, Translator] = {
    "ttnn.repeat_interleave": _repeat_interleave,
    "ttnn.reshape": _reshape, "ttnn.permute": _permute, "ttnn.transpose": _transpose,
    "ttnn.slice_static": _slice, "ttnn.concat": _concat, "ttnn.repeat": _repeat, "ttnn.pad": _pad,
}

READS: dict[str, frozenset[str]] = {
    "ttnn.repeat_interleave": frozenset({"dim", "repeats"}),
    "ttnn.reshape": frozenset({"shape"}), "ttnn.permute": frozenset({"permutation", "pad_value"}),
    "ttnn.transpose": frozenset({"dim0", "dim1"}), "ttnn.slice_static": frozenset({"begins", "ends", "step"}),
    "ttnn.concat": frozenset({"dim"}), "ttnn.repeat": frozenset({"repeat_dims"}),
    "ttnn.pad": frozenset({"padding", "value", "use_multicore"}),
}
