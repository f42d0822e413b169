"""Collectives over a mesh's links: all_gather, reduce_scatter, all_reduce, point_to_point.

On a mesh every shape in the binary is the per-chip shard, as in ttflow's own mesh programs: a
collective's `cluster_axis` groups the chips that differ only in that mesh coordinate (None: the
whole mesh), and its bytes cross the emulated Ethernet links. Only sum reductions are
translated (ttflow's collectives sum). A point_to_point with an accumulator (a ppermute, an
all_to_all written as point_to_points) also exchanges each chip's coordinate, a few bytes more
over the links than silicon sends."""

from __future__ import annotations

from collections.abc import Sequence

from ..._ir.builder import Value
from ..._types import DataType
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


def _coordinate(c: Lowering, axis: int) -> Value:
    """This chip's coordinate along mesh axis `axis`, shape (1,): a reduce_scatter of the ramp
    0..n-1 over that axis gives chip k the k-th element of n times the ramp (its bytes cross the
    links, as every collective's do)."""
    mesh = c.program.mesh_shape or (1, 1)
    n = mesh[axis]
    if n == 1:
        return c.b.full((1,), 0.0)
    ramp = c.b.arange(0, n, 1, DataType.FLOAT32)
    return c.b.div(c.b.reduce_scatter(ramp, 0, axis), float(n))


def _point_to_point(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    """The receiver gets the sender's x; every other chip keeps the accumulator operand (tt-mlir's
    rule; without one, its own x). ttflow's point_to_point keeps each chip's own x, so with an
    accumulator that is not x the result is chosen per chip: the receiver's mask made from the
    chips' coordinates (`_coordinate`), the sender's x where it is set, the accumulator elsewhere."""
    values = c.operands(op)
    sender = attr_ints(op.op, "sender_coord")
    receiver = attr_ints(op.op, "receiver_coord")
    moved = c.b.point_to_point(values[0], (sender[0], sender[1]), (receiver[0], receiver[1]))
    if len(values) == 1 or values[1].id == values[0].id:
        return [moved]
    here = c.b.mul(c.b.eq(_coordinate(c, 0), float(receiver[0])), c.b.eq(_coordinate(c, 1), float(receiver[1])))
    return [c.b.where(here, moved, values[1])]


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
