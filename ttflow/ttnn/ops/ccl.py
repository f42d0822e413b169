"""Collectives over a mesh's links: all_gather, reduce_scatter, all_reduce, point_to_point.

On a mesh every shape in the binary is the per-chip shard, as in ttflow's own mesh programs: a
collective's `cluster_axis` groups the chips that differ only in that mesh coordinate (None: the
whole mesh), and its bytes cross the emulated Ethernet links. Only sum reductions are
translated (ttflow's collectives sum)."""

from __future__ import annotations

from collections.abc import Sequence

from ..._ir.builder import Value
from ..lower import Lowering, Translator
from ..mlir import attr_int, attr_ints
from ..reader import TtnnOp


def _axis(op: TtnnOp) -> int | None:
    return attr_int(op.op, "cluster_axis") if "cluster_axis" in op.op.attributes else None


def _sum_only(c: Lowering, op: TtnnOp) -> None:
    reduce = op.op.attributes.get("reduce_type", "#ttcore.reduce_type<sum>")
    if reduce != "#ttcore.reduce_type<sum>":
        raise c.refuse(f"reduce_type {reduce} (ttflow's collectives sum)")


def _all_gather(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    (x,) = c.operands(op)
    dim = attr_int(op.op, "all_gather_dim" if "all_gather_dim" in op.op.attributes else "dim")
    return [c.b.all_gather(x, dim, _axis(op))]


def _reduce_scatter(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    _sum_only(c, op)
    (x,) = c.operands(op)
    dim = attr_int(op.op, "scatter_dim" if "scatter_dim" in op.op.attributes else "dim")
    return [c.b.reduce_scatter(x, dim, _axis(op))]


def _all_reduce(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    _sum_only(c, op)
    (x,) = c.operands(op)
    return [c.b.all_reduce(x, _axis(op))]


def _point_to_point(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    """The receiver gets the sender's x; every other chip keeps the optional accumulator operand
    (tt-mlir's rule). ttflow's point_to_point keeps each chip's own x, so the two-operand form is
    translated when the accumulator is x itself (the compiler passes an `assign` copy of it)."""
    values = c.operands(op)
    if len(values) == 2 and values[1].id != values[0].id:
        raise c.refuse("an accumulator that is not a copy of the input (the chips that do not "
                       "receive would keep it, not their input)")
    sender = attr_ints(op.op, "sender_coord")
    receiver = attr_ints(op.op, "receiver_coord")
    return [c.b.point_to_point(values[0], (sender[0], sender[1]), (receiver[0], receiver[1]))]


TRANSLATORS: dict[str, Translator] = {
    "ttnn.all_gather": _all_gather, "ttnn.reduce_scatter": _reduce_scatter,
    "ttnn.all_reduce": _all_reduce, "ttnn.point_to_point": _point_to_point,
}

READS: dict[str, frozenset[str]] = {
    "ttnn.all_gather": frozenset({"all_gather_dim", "dim", "cluster_axis"}),
    "ttnn.reduce_scatter": frozenset({"scatter_dim", "dim", "cluster_axis", "reduce_type"}),
    "ttnn.all_reduce": frozenset({"cluster_axis", "reduce_type"}),
    "ttnn.point_to_point": frozenset({"sender_coord", "receiver_coord"}),
}
