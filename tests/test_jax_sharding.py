"""`ttflow.jax`'s PartitionSpecs on a mesh (`_sharding`), property-tested against an independent
reference: numpy's `array_split` cut along each split dimension, block by block, with the chip's
coordinates read as JAX's NamedSharding reads them (the spec's axes for one dimension, the first
the most significant). Needs no JAX."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ttflow as tt
from ttflow.jax import _sharding

NAMES = ("x", "y")


@st.composite
def cases(draw: st.DrawFn) -> tuple[np.ndarray, tuple[tuple[str, ...], ...], tuple[int, int]]:
    mesh = (draw(st.integers(1, 2)), draw(st.integers(1, 4)))
    rank = draw(st.integers(1, 3))
    free = list(NAMES)
    spec: list[tuple[str, ...]] = []
    for _ in range(rank):
        k = draw(st.integers(0, len(free)))
        axes = tuple(draw(st.permutations(free))[:k]) if k else ()
        for a in axes:
            free.remove(a)
        spec.append(axes)
    shape = []
    for axes in spec:
        parts = math.prod(mesh[NAMES.index(a)] for a in axes)
        shape.append(parts * draw(st.integers(1, 3)))
    array = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    return array, tuple(spec), mesh


def reference_piece(array: np.ndarray, spec: tuple[tuple[str, ...], ...], mesh: tuple[int, int],
                    chip: int) -> np.ndarray:
    coord = (chip // mesh[1], chip % mesh[1])
    piece = array
    for dim, axes in enumerate(spec):
        sizes = [mesh[NAMES.index(a)] for a in axes]
        block = 0
        for a, size in zip(axes, sizes, strict=True):
            block = block * size + coord[NAMES.index(a)]
        piece = np.array_split(piece, math.prod(sizes), axis=dim)[block]
    return piece


@given(cases())
def test_pieces_are_namedshardings_and_assemble_inverts_them(case) -> None:  # type: ignore[no-untyped-def]
    array, spec, mesh = case
    parts = _sharding.pieces(array, spec, mesh, NAMES, "a")
    chips = mesh[0] * mesh[1]
    assert len(parts) == chips
    for chip, part in enumerate(parts):
        np.testing.assert_array_equal(part, reference_piece(array, spec, mesh, chip))
    np.testing.assert_array_equal(_sharding.assemble(parts, spec, mesh, NAMES, "a"), array)


@given(cases(), st.data())
def test_replicas_that_differ_are_a_mesh_error(case, data) -> None:  # type: ignore[no-untyped-def]
    array, spec, mesh = case
    used = {a for axes in spec for a in axes}
    replicated = [a for a in NAMES if a not in used and mesh[NAMES.index(a)] > 1]
    parts = [p.copy() for p in _sharding.pieces(array, spec, mesh, NAMES, "a")]
    if not replicated:
        return
    # a chip whose coordinate on a replicated axis is not 0 holds a copy: change one element of it
    chips = [c for c in range(len(parts)) if (c // mesh[1], c % mesh[1])[NAMES.index(replicated[0])] > 0]
    chip = data.draw(st.sampled_from(chips))
    parts[chip].reshape(-1)[0] += 1.0
    with pytest.raises(tt.MeshError, match="hold different values"):
        _sharding.assemble(parts, spec, mesh, NAMES, "output 0")


def test_a_spec_is_checked_before_it_is_used() -> None:
    with pytest.raises(tt.MeshError, match="names the axis 'z'"):
        _sharding.normalize(("z",), 2, NAMES, "argument 0")
    with pytest.raises(tt.MeshError, match="uses the axis 'x' twice"):
        _sharding.normalize(("x", "x"), 2, NAMES, "argument 0")
    with pytest.raises(tt.ShapeError, match="names 3 dimensions"):
        _sharding.normalize((None, None, None), 2, NAMES, "argument 0")
    with pytest.raises(tt.ShapeError, match="does not split into 2 equal blocks"):
        _sharding.piece_shape((3, 4), (("y",), ()), (1, 2), NAMES, "argument 0")
    assert list(itertools.chain(*_sharding.normalize((("x", "y"), None), 3, NAMES, "a"))) == ["x", "y"]
