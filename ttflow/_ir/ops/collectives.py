"""Collectives: a value exchanged with the other chips of a mesh (the group of `cluster_axis`).
Their shapes depend on the group's size (the builder's `mesh_shape`, resolved again at
submit); in a group of one chip each is the identity (`_alone`), and on a mesh a chip's run
hands them to its submit's rendezvous (`ttflow._mesh`, `ttflow._peers`).
"""

from __future__ import annotations

from typing import Any


from ..._errors import ShapeError
from ..._types import DataType
from ..core import BuilderCore, Value, _int, _normalise_axis
from ..record import Kind, op
from ._shared import Array

__all__ = ["CollectiveOps"]


def _alone(arrays: list[Array], scalar: float | None, **attrs_: Any) -> Array:
    """A collective in a group of one chip: every one is the identity there (the gather of one
    shard, the sum of one term, a broadcast from and to the one chip)."""
    return arrays[0]


class CollectiveOps(BuilderCore):
    """The collectives ops of `ProgramBuilder`."""

    def _collective(self, op: str, x: Value, cluster_axis: Any) -> tuple[Value, int | None, int]:
        """x checked for a collective, the group's axis and its size: the chips that differ only
        in coordinate `cluster_axis` (0: a column's, 1: a row's), or every chip (None). The size
        is the builder's mesh's (1 while it has none: resolved again at submit)."""
        self._check_open()
        x = self._value(op, x)
        if cluster_axis is not None:
            cluster_axis = _int(op, "cluster_axis", cluster_axis)
            if cluster_axis not in (0, 1):
                raise ShapeError(f"{op}: cluster_axis is 0 (the chips of a mesh column), 1 (of a mesh row) "
                                 f"or None (every chip), got {cluster_axis}")
        rows, cols = self.mesh_shape or (1, 1)
        size = rows * cols if cluster_axis is None else (rows, cols)[cluster_axis]
        return x, cluster_axis, size

    @staticmethod
    def _whole_tiles(op: str, x: Value, n: int, dims: dict[int, int]) -> None:
        """A BFLOAT8_B value crosses links as its packed tiles are (each 16-value face row shares
        one exponent, so a chunk cut inside a tile would pack to other bytes and values): when a
        group of `n` > 1 chips cuts or joins it along one of its last two dims, each chunk's size
        along that dim (`dims`: dim -> size) must be whole 32-wide tiles (ShapeError)."""
        if x.dtype is not DataType.BFLOAT8_B or n <= 1:
            return
        rank = len(x.shape)
        for dim, size in dims.items():
            if dim >= rank - 2 and size % 32:
                raise ShapeError(
                    f"{op}: a BFLOAT8_B value of {x.shape} crosses links as whole packed 32x32 tiles, "
                    f"but a group of {n} chips cuts or joins it along dim {dim} in chunks of {size}, not a "
                    "multiple of 32 (a chunk would split tiles, whose rows share exponents): make that "
                    "dim's chunks whole tiles, or typecast to BFLOAT16 first")

    def _coord(self, op: str, name: str, coord: Any) -> tuple[int, int]:
        """A chip's mesh coordinate (row, col), inside the builder's mesh when it has one."""
        if not isinstance(coord, (list, tuple)) or len(coord) != 2:
            raise ShapeError(f"{op}: {name} is a mesh coordinate (row, col), got {coord!r:.40}")
        r, c = _int(op, name, coord[0], 0), _int(op, name, coord[1], 0)
        if self.mesh_shape is not None and not (r < self.mesh_shape[0] and c < self.mesh_shape[1]):
            rows, cols = self.mesh_shape
            raise ShapeError(f"{op}: {name} {(r, c)} is outside the {rows}x{cols} mesh")
        return r, c

    @op("all_gather", Kind.COLLECTIVE, 1, _alone, version=7, along_path=True)
    def all_gather(self, x: Value, dim: int, cluster_axis: int | None = None, *, loc: str | None = None) -> Value:
        """The group's values joined along `dim` in mesh-coordinate order along the group
        (ttnn.all_gather): every chip of the group gets the same result, `dim` N times longer
        for a group of N chips. A BFLOAT8_B value moves as its packed tiles: along one of its
        last two dims each chip's size must be a multiple of 32 (ShapeError)."""
        x, axis_, n = self._collective("all_gather", x, cluster_axis)
        dim = _normalise_axis("all_gather", dim, len(x.shape))
        self._whole_tiles("all_gather", x, n, {dim: x.shape[dim]})
        shape = x.shape[:dim] + (x.shape[dim] * n,) + x.shape[dim + 1:]
        return self._emit("all_gather", [x], shape, x.dtype, dim=dim, cluster_axis=axis_)

    @op("reduce_scatter", Kind.COLLECTIVE, 1, _alone, version=7, along_path=True)
    def reduce_scatter(self, x: Value, dim: int, cluster_axis: int | None = None, *, loc: str | None = None) -> Value:
        """The sum of the group's values, split along `dim` into N equal parts, the k-th chip
        of the group (in mesh-coordinate order) keeping part k (ttnn.reduce_scatter, Sum only).
        `dim` must split evenly over the group (ShapeError, here or at submit); a BFLOAT8_B
        value's parts along one of its last two dims must be whole tiles (multiples of 32), and its
        partial sums are rounded to BFLOAT8_B before they cross a link."""
        x, axis_, n = self._collective("reduce_scatter", x, cluster_axis)
        dim = _normalise_axis("reduce_scatter", dim, len(x.shape))
        if x.shape[dim] % n:
            raise ShapeError(f"reduce_scatter: dim {dim} of {x.shape} has size {x.shape[dim]}, which a group "
                             f"of {n} chips cannot split evenly")
        self._whole_tiles("reduce_scatter", x, n, {dim: x.shape[dim] // n})
        shape = x.shape[:dim] + (x.shape[dim] // n,) + x.shape[dim + 1:]
        return self._emit("reduce_scatter", [x], shape, x.dtype, dim=dim, cluster_axis=axis_)

    @op("all_reduce", Kind.COLLECTIVE, 1, _alone, version=7, along_path=True)
    def all_reduce(self, x: Value, cluster_axis: int | None = None, *, loc: str | None = None) -> Value:
        """The sum of the group's values on every chip of the group (ttnn.all_reduce, Sum
        only); x's shape and dtype. Integers wrap as the device's additions do; a BFLOAT8_B
        value's parts are whole tiles, its partial sums rounded to BFLOAT8_B as they cross."""
        x, axis_, _ = self._collective("all_reduce", x, cluster_axis)
        return self._emit("all_reduce", [x], x.shape, x.dtype, cluster_axis=axis_)

    @op("broadcast", Kind.COLLECTIVE, 1, _alone, version=7)
    def broadcast(self, x: Value, sender: tuple[int, int], *, loc: str | None = None) -> Value:
        """The value of the chip at mesh coordinate `sender` (row, col), on every chip
        (ttnn.broadcast); x's shape and dtype."""
        x, _, _ = self._collective("broadcast", x, None)
        return self._emit("broadcast", [x], x.shape, x.dtype, sender=self._coord("broadcast", "sender", sender))

    @op("point_to_point", Kind.COLLECTIVE, 1, _alone, version=7)
    def point_to_point(self, x: Value, sender: tuple[int, int], receiver: tuple[int, int],
                       *, loc: str | None = None) -> Value:
        """x sent from the chip at mesh coordinate `sender` to the chip at `receiver`
        (ttnn.point_to_point): the receiver's result is the sender's x, every other chip's its
        own x (tt-mlir's rule). x's shape and dtype."""
        x, _, _ = self._collective("point_to_point", x, None)
        return self._emit("point_to_point", [x], x.shape, x.dtype,
                          sender=self._coord("point_to_point", "sender", sender),
                          receiver=self._coord("point_to_point", "receiver", receiver))

    @op("all_to_all", Kind.COLLECTIVE, 1, _alone, version=7)
    def all_to_all(self, x: Value, split_dim: int, concat_dim: int, cluster_axis: int | None = None,
                   *, loc: str | None = None) -> Value:
        """Each chip splits x along `split_dim` into N parts, sends part k to the k-th chip of
        the group, and joins the parts it receives along `concat_dim` in mesh-coordinate order
        (ttnn.all_to_all): `split_dim` N times shorter, `concat_dim` N times longer."""
        x, axis_, n = self._collective("all_to_all", x, cluster_axis)
        split = _normalise_axis("all_to_all", split_dim, len(x.shape))
        concat = _normalise_axis("all_to_all", concat_dim, len(x.shape))
        if x.shape[split] % n:
            raise ShapeError(f"all_to_all: split dim {split} of {x.shape} has size {x.shape[split]}, which a "
                             f"group of {n} chips cannot split evenly")
        part = list(x.shape)
        part[split] //= n
        self._whole_tiles("all_to_all", x, n, {split: part[split], concat: part[concat]})
        shape = list(x.shape)
        shape[split] //= n
        shape[concat] *= n
        return self._emit("all_to_all", [x], tuple(shape), x.dtype, split_dim=split, concat_dim=concat,
                          cluster_axis=axis_)
