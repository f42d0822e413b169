"""Reductions (sum, mean, max, min over `dim_arg`, `keep_dim`), argmax, cumsum, sort."""

from __future__ import annotations

from collections.abc import Sequence

from ..._ir.builder import Value
from ..lower import Lowering, Translator
from ..mlir import attr_bool, attr_int, attr_ints
from ..reader import TtnnOp


def _dims(c: Lowering, op: TtnnOp, rank: int) -> list[int]:
    text = op.op.attributes.get("dim_arg")
    if text is None:
        dims = list(range(rank))
    elif text.startswith(("[", "array<")):
        dims = attr_ints(op.op, "dim_arg")
    else:  # prod's is one axis
        dims = [attr_int(op.op, "dim_arg")]
    out = sorted({d % rank for d in dims})
    if len(out) != len(dims):
        raise c.refuse(f"dim_arg {dims} names an axis twice")
    return out


def _squeeze(c: Lowering, op: TtnnOp, x: Value) -> Value:
    """Drop the reduced axes when keep_dim is false: the result type's shape says which remain."""
    if attr_bool(op.op, "keep_dim", default=False) and x.shape == c.result_shape(op):
        return x
    return c.b.reshape(x, c.result_shape(op))


def _reduce(kind: str) -> Translator:
    def translate(c: Lowering, op: TtnnOp) -> Sequence[Value]:
        (x,) = c.operands(op)
        for axis in _dims(c, op, len(x.shape)):
            if kind == "sum":
                x = c.b.sum(x, axis)
            elif kind == "mean":
                x = c.b.mean(x, axis)
            elif kind == "prod":
                x = c.b.prod(x, axis)
            elif kind == "max":
                x = c.b.max(x, axis)
            else:  # min(x) = -max(-x), exact in every dtype but INT32's most negative value
                x = c.b.neg(c.b.max(c.b.neg(x), axis))
        return [_squeeze(c, op, x)]
    return translate


def _argmax(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    (x,) = c.operands(op)
    if "dim" not in op.op.attributes:
        x = c.b.reshape(x, (_size(x.shape),))
        return [c.b.reshape(c.b.argmax(x, 0), c.result_shape(op))]
    return [_squeeze(c, op, c.b.argmax(x, attr_int(op.op, "dim")))]


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _cumsum(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    (x,) = c.operands(op)
    return [c.b.cumsum(x, attr_int(op.op, "dim"))]


def _topk(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    """The k largest (or smallest) along `dim`, sorted: a stable argsort's first k and a gather
    (ties keep their order, as XLA's top_k on the CPU keeps them)."""
    (x,) = c.operands(op)
    axis = attr_int(op.op, "dim", default=-1) % len(x.shape)
    if not attr_bool(op.op, "sorted", default=True):
        raise c.refuse("sorted = false (an unsorted top-k's order is the kernel's)")
    index = c.b.argsort(x, axis, attr_bool(op.op, "largest", default=True))
    k = attr_int(op.op, "k")
    starts = [0] * len(x.shape)
    ends: list[int | None] = [None] * len(x.shape)
    ends[axis] = k
    index = c.b.slice(index, starts, ends)
    return [c.b.gather(x, index, axis), index]


def _sort(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    """Values and indices: a stable argsort and a gather (ttflow's argsort is stable; an unstable
    sort may order ties either way, so it is a valid result of `stable = false` too)."""
    (x,) = c.operands(op)
    axis = attr_int(op.op, "dim", default=-1)
    index = c.b.argsort(x, axis, attr_bool(op.op, "descending", default=False))
    return [c.b.gather(x, index, axis), index]


TRANSLATORS: dict[str, Translator] = {
    "ttnn.sum": _reduce("sum"),
    "ttnn.mean": _reduce("mean"),
    "ttnn.max": _reduce("max"),
    "ttnn.min": _reduce("min"),
    "ttnn.argmax": _argmax,
    "ttnn.cumsum": _cumsum,
    "ttnn.sort": _sort,
    "ttnn.topk": _topk,
    "ttnn.prod": _reduce("prod"),
}

READS: dict[str, frozenset[str]] = {
    **{f"ttnn.{n}": frozenset({"dim_arg", "keep_dim"}) for n in ("sum", "mean", "max", "min")},
    "ttnn.argmax": frozenset({"dim", "keep_dim", "use_multicore"}),
    "ttnn.cumsum": frozenset({"dim"}),
    "ttnn.sort": frozenset({"dim", "descending", "stable"}),  # a stable sort is a valid unstable one
    "ttnn.topk": frozenset({"dim", "k", "largest", "sorted"}),
    "ttnn.prod": frozenset({"dim_arg", "keep_dim"}),
}
