"""JAX's PartitionSpecs on a ttflow mesh: the piece each chip holds, and the whole from the pieces.

A mesh's chips are row-major over `mesh_shape`, whose axes JAX names (`axis_names`, one per mesh
dimension). A PartitionSpec gives, per array dimension, None (not split) or mesh axes: the
dimension is split into as many blocks as those axes have chips, the block index the chip's
coordinates on them read as one mixed-radix number (the first axis the most significant), as
`jax.sharding.NamedSharding` cuts it. Chips that differ only on axes the spec does not use hold
copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import MeshError, ShapeError

__all__ = ["Spec", "assemble", "normalize", "piece_shape", "pieces"]

Spec = tuple[tuple[str, ...], ...]  # per array dimension, the mesh axes it is split over
Array = np.ndarray[Any, Any]


def normalize(spec: Any, rank: int, axis_names: Sequence[str], what: str) -> Spec:
    """A PartitionSpec (or a tuple of its entries, or None: nothing split) as `Spec`."""
    entries = tuple(spec) if spec is not None else ()
    if len(entries) > rank:
        raise ShapeError(f"{what}: the sharding {spec} names {len(entries)} dimensions, the array has {rank}")
    out: list[tuple[str, ...]] = []
    used: set[str] = set()
    for entry in entries:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for axis in axes:
            if axis not in axis_names:
                raise MeshError(f"{what}: the sharding {spec} names the axis {axis!r}; the mesh's axes are "
                                f"{tuple(axis_names)}")
            if axis in used:
                raise MeshError(f"{what}: the sharding {spec} uses the axis {axis!r} twice")
            used.add(axis)
        out.append(axes)
    return tuple(out) + ((),) * (rank - len(out))


def _block(spec: Spec, dim: int, coord: Sequence[int], mesh_shape: Sequence[int],
           axis_names: Sequence[str]) -> tuple[int, int]:
    """(block index, blocks) of dimension `dim` for the chip at `coord`."""
    index, parts = 0, 1
    for axis in spec[dim]:
        a = list(axis_names).index(axis)
        index = index * mesh_shape[a] + coord[a]
        parts *= mesh_shape[a]
    return index, parts


def piece_shape(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int], axis_names: Sequence[str],
                what: str) -> tuple[int, ...]:
    out = []
    for dim, size in enumerate(shape):
        _, parts = _block(spec, dim, [0] * len(mesh_shape), mesh_shape, axis_names)
        if size % parts:
            raise ShapeError(f"{what}: dimension {dim} (size {size}) does not split into {parts} equal blocks")
        out.append(size // parts)
    return tuple(out)


def pieces(array: Array, spec: Spec, mesh_shape: Sequence[int], axis_names: Sequence[str], what: str) -> list[Array]:
    """Each chip's piece of `array`, row-major over the mesh."""
    local = piece_shape(array.shape, spec, mesh_shape, axis_names, what)
    out = []
    for chip in range(math.prod(mesh_shape)):
        coord = [int(c) for c in np.unravel_index(chip, tuple(mesh_shape))]
        index = []
        for dim, size in enumerate(local):
            block, _ = _block(spec, dim, coord, mesh_shape, axis_names)
            index.append(slice(block * size, (block + 1) * size))
        out.append(array[tuple(index)])
    return out


def assemble(parts: Sequence[Array], spec: Spec, mesh_shape: Sequence[int], axis_names: Sequence[str],
             what: str) -> Array:
    """The whole array from every chip's piece. Copies must agree: chips meant to hold one value
    that hold different bits are a MeshError, never one of them chosen silently."""
    first = parts[0]
    shape = []
    for dim, size in enumerate(first.shape):
        _, blocks = _block(spec, dim, [0] * len(mesh_shape), mesh_shape, axis_names)
        shape.append(size * blocks)
    whole = np.empty(shape, first.dtype)
    written: dict[tuple[int, ...], int] = {}
    for chip, part in enumerate(parts):
        coord = [int(c) for c in np.unravel_index(chip, tuple(mesh_shape))]
        at = tuple(_block(spec, dim, coord, mesh_shape, axis_names)[0] for dim in range(first.ndim))
        where = tuple(slice(b * s, (b + 1) * s) for b, s in zip(at, first.shape, strict=True))
        if at in written:
            if np.ascontiguousarray(whole[where]).tobytes() != np.ascontiguousarray(part).tobytes():
                raise MeshError(f"{what}: chips {written[at]} and {chip} hold different values for the "
                                "same replicated block")
            continue
        written[at] = chip
        whole[where] = part
    return whole
