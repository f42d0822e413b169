"""Mappers and composers: how a host array becomes one shard per chip, and shards an array.

A mapper (`tt.replicate()`, `tt.shard(dim)`, `tt.shard_2d(dims)`) splits a host array into
shards in row-major chip order; a composer (`tt.concat(dim)`, `tt.concat_2d(dims)`) joins the
shards back. ttnn's names: `ReplicateTensorToMesh`, `ShardTensorToMesh`, `ShardTensor2dMesh`,
`ConcatMeshToTensor`, `ConcatMesh2dToTensor`. Plain numpy on host arrays; no device here.

Uneven shards are refused (ShapeError naming the dim, its size and the chip count), never
padded: an SPMD program is one program for every chip, so every shard must have one shape.
(ttnn's mapper refuses them too since its n-d rewrite, with "Shard shape mismatch"; its
older `ShardTensorToMesh` cut `torch.chunk`-style, the last shard smaller.)
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, final, overload

import attrs
import numpy as np

from .._errors import ShapeError
from .spec import Coord, check_mesh_shape

__all__ = [
    "Composer",
    "Concat",
    "Concat2D",
    "Mapper",
    "PerDevice",
    "Placement",
    "Replicate",
    "Shard",
    "Shard2D",
    "concat",
    "concat_2d",
    "replicate",
    "shard",
    "shard_2d",
]

Array = np.ndarray[Any, Any]
Dims2D = tuple[int | None, int | None]


def _dim(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} is an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} is an int, got {value!r:.40}") from None


def _dims(value: Any, what: str) -> Dims2D:
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{what} is a pair (row dim, column dim), each an int or None; got {value!r:.40}") from None
    if len(items) != 2:
        raise TypeError(f"{what} is a pair (row dim, column dim), each an int or None; got {value!r:.40}")
    return (None if items[0] is None else _dim(items[0], what),
            None if items[1] is None else _dim(items[1], what))


def _axis(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise ShapeError(f"{what}: dim {dim} is out of range for a {ndim}-d tensor")
    return dim % ndim


def _split(array: Array, dim: int, parts: int, what: str, over: str) -> list[Array]:
    size = array.shape[dim]
    if size % parts:
        raise ShapeError(
            f"{what}: dim {dim} has size {size}, which {parts} {over} cannot split evenly "
            f"({size} % {parts} = {size % parts}); ttflow does not pad shards: pad the array to a "
            f"multiple of {parts} (np.pad) or split another dim"
        )
    return np.split(array, parts, axis=dim)


def _check_grid(mesh_shape: Coord | None, grid: Coord, what: str) -> None:
    if mesh_shape is not None and mesh_shape != grid:
        raise ShapeError(f"{what} was made for a {mesh_shape[0]}x{mesh_shape[1]} mesh, used on a "
                         f"{grid[0]}x{grid[1]} one")


# -- placements (mappers) --------------------------------------------------------------------


@final
@attrs.frozen
class Replicate:
    """Every chip holds the whole array (ttnn's `ReplicateTensorToMesh`)."""

    def map(self, array: Array, grid: Coord) -> list[Array]:
        return [array] * (grid[0] * grid[1])

    def shard_shape(self, shape: tuple[int, ...], grid: Coord) -> tuple[int, ...]:
        return shape

    def composer(self) -> None:
        return None  # no composer needed: shard 0 is the value

    def __repr__(self) -> str:
        return "tt.replicate()"


@final
@attrs.frozen
class Shard:
    """The array split along `dim` over every chip, in row-major chip order (ttnn's
    `ShardTensorToMesh`)."""

    dim: int = attrs.field(converter=lambda d: _dim(d, "tt.shard's dim"))

    def map(self, array: Array, grid: Coord) -> list[Array]:
        what = repr(self)
        return _split(array, _axis(self.dim, array.ndim, what), grid[0] * grid[1], what, "chips")

    def shard_shape(self, shape: tuple[int, ...], grid: Coord) -> tuple[int, ...]:
        return self.map(np.broadcast_to(np.empty((), np.uint8), shape), grid)[0].shape

    def composer(self) -> Concat:
        return Concat(self.dim)

    def __repr__(self) -> str:
        return f"tt.shard({self.dim})"


@final
@attrs.frozen
class Shard2D:
    """Tensor dim `dims[0]` split over the mesh's rows and `dims[1]` over its columns; None
    replicates along that mesh axis (ttnn's `ShardTensor2dMesh`)."""

    dims: Dims2D = attrs.field(converter=lambda d: _dims(d, "tt.shard_2d's dims"))
    mesh_shape: Coord | None = attrs.field(
        default=None, converter=lambda s: None if s is None else check_mesh_shape(s, "tt.shard_2d's mesh shape"))

    def __attrs_post_init__(self) -> None:
        if self.dims == (None, None):
            raise ShapeError("tt.shard_2d((None, None)) shards nothing: use tt.replicate()")

    def map(self, array: Array, grid: Coord) -> list[Array]:
        what = repr(self)
        _check_grid(self.mesh_shape, grid, what)
        rows_dim, cols_dim = (None if d is None else _axis(d, array.ndim, what) for d in self.dims)
        if rows_dim is not None and rows_dim == cols_dim:
            raise ShapeError(f"{what} splits dim {rows_dim} over both mesh axes: use tt.shard({rows_dim})")
        rows = ([array] * grid[0] if rows_dim is None
                else _split(array, rows_dim, grid[0], what, "mesh rows"))
        shards: list[Array] = []
        for row in rows:
            shards += ([row] * grid[1] if cols_dim is None
                       else _split(row, cols_dim, grid[1], what, "mesh columns"))
        return shards

    def shard_shape(self, shape: tuple[int, ...], grid: Coord) -> tuple[int, ...]:
        return self.map(np.broadcast_to(np.empty((), np.uint8), shape), grid)[0].shape

    def composer(self) -> Concat2D:
        return Concat2D(self.dims)

    def __repr__(self) -> str:
        shape = "" if self.mesh_shape is None else f"{self.mesh_shape}, "
        return f"tt.shard_2d({shape}{self.dims})"


@final
@attrs.frozen
class PerDevice:
    """Each chip's own value (a program's outputs, `tt.from_shards`): no global array is known
    until a composer says how the shards join."""

    def composer(self) -> None:
        return None

    def __repr__(self) -> str:
        return "per-device"


# -- composers -------------------------------------------------------------------------------


def _join(arrays: Sequence[Array], dim: int, what: str) -> Array:
    axis = _axis(dim, arrays[0].ndim, what)
    try:
        return np.concatenate(arrays, axis=axis)
    except ValueError as error:
        raise ShapeError(f"{what}: the shards cannot join along dim {dim}: {error}") from None


@final
@attrs.frozen
class Concat:
    """The shards joined along `dim` in row-major chip order (ttnn's `ConcatMeshToTensor`)."""

    dim: int = attrs.field(converter=lambda d: _dim(d, "tt.concat's dim"))

    def compose(self, arrays: Sequence[Array], grid: Coord) -> Array:
        return _join(arrays, self.dim, repr(self))

    def __repr__(self) -> str:
        return f"tt.concat({self.dim})"


@final
@attrs.frozen
class Concat2D:
    """Each mesh row's shards joined along `dims[1]`, then the rows along `dims[0]` (ttnn's
    `ConcatMesh2dToTensor`); None takes the first shard along that mesh axis (the inverse of
    `shard_2d`'s replication)."""

    dims: Dims2D = attrs.field(converter=lambda d: _dims(d, "tt.concat_2d's dims"))
    mesh_shape: Coord | None = attrs.field(
        default=None, converter=lambda s: None if s is None else check_mesh_shape(s, "tt.concat_2d's mesh shape"))

    def __attrs_post_init__(self) -> None:
        if self.dims == (None, None):
            raise ShapeError("tt.concat_2d((None, None)) joins nothing: read a replicated tensor "
                             "with no composer")

    def compose(self, arrays: Sequence[Array], grid: Coord) -> Array:
        what = repr(self)
        _check_grid(self.mesh_shape, grid, what)
        rows_dim, cols_dim = self.dims
        ndim = arrays[0].ndim
        if (rows_dim is not None and cols_dim is not None
                and _axis(rows_dim, ndim, what) == _axis(cols_dim, ndim, what)):
            raise ShapeError(f"{what} joins dim {rows_dim} along both mesh axes: use tt.concat({rows_dim})")
        rows = []
        for r in range(grid[0]):
            row = arrays[r * grid[1]:(r + 1) * grid[1]]
            rows.append(row[0] if cols_dim is None else _join(row, cols_dim, what))
        return rows[0] if rows_dim is None else _join(rows, rows_dim, what)

    def __repr__(self) -> str:
        shape = "" if self.mesh_shape is None else f"{self.mesh_shape}, "
        return f"tt.concat_2d({shape}{self.dims})"


Mapper = Replicate | Shard | Shard2D
Placement = Replicate | Shard | Shard2D | PerDevice
Composer = Concat | Concat2D


def replicate() -> Replicate:
    """A mapper: every chip gets the whole array (ttnn's `ReplicateTensorToMesh`)."""
    return Replicate()


def shard(dim: int) -> Shard:
    """A mapper: the array split evenly along `dim` over every chip of the mesh, in row-major
    chip order, on a 2-D mesh too (ttnn's `ShardTensorToMesh`)."""
    return Shard(dim)


@overload
def shard_2d(dims: tuple[int | None, int | None], /) -> Shard2D: ...
@overload
def shard_2d(mesh_shape: tuple[int, int], dims: tuple[int | None, int | None], /) -> Shard2D: ...
def shard_2d(*args: Any) -> Shard2D:
    """A mapper: tensor dim `dims[0]` split over the mesh rows, `dims[1]` over the mesh columns;
    None replicates along that axis (ttnn's `ShardTensor2dMesh`). ttnn's argument order
    `shard_2d(mesh_shape, dims)` is taken too; the mesh shape must then be the mesh's."""
    if len(args) == 1:
        return Shard2D(args[0])
    if len(args) == 2:
        return Shard2D(args[1], args[0])
    raise TypeError("tt.shard_2d takes dims, or mesh_shape and dims")


def concat(dim: int) -> Concat:
    """A composer: the shards joined along `dim` in row-major chip order (ttnn's
    `ConcatMeshToTensor`)."""
    return Concat(dim)


@overload
def concat_2d(dims: tuple[int | None, int | None], /) -> Concat2D: ...
@overload
def concat_2d(mesh_shape: tuple[int, int], dims: tuple[int | None, int | None], /) -> Concat2D: ...
def concat_2d(*args: Any) -> Concat2D:
    """A composer: each mesh row's shards joined along `dims[1]`, the rows along `dims[0]`;
    None takes the first shard along that axis (ttnn's `ConcatMesh2dToTensor`, which also
    takes `(mesh_shape, dims)`)."""
    if len(args) == 1:
        return Concat2D(args[0])
    if len(args) == 2:
        return Concat2D(args[1], args[0])
    raise TypeError("tt.concat_2d takes dims, or mesh_shape and dims")
