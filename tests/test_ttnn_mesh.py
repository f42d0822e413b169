"""Mesh binaries Tenstorrent's compiler wrote for n300 (1x2) and an 8-chip T3000-shaped mesh
(2x4): inputs given per chip as JAX's in-shardings cut them, the collectives' bytes across the
emulated links, and every chip's output against the same function on JAX's CPU backend, cut as
its out-sharding says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import ttflow as tt
from ttflow.ttnn.reader import read_ttnn

pytestmark = pytest.mark.anyio

CORPUS = Path(__file__).parent / "data" / "ttnn"
CASES = sorted(p.stem for p in CORPUS.glob("*.json"))
AXES = {"x": 0, "y": 1}  # the corpus's mesh axes: rows, columns


def shard(array: np.ndarray, spec: str, mesh_shape: tuple[int, int], chip: int) -> np.ndarray:
    """The piece of `array` chip `chip` (row-major) holds under a PartitionSpec written "y,-"."""
    coord = divmod(chip, mesh_shape[1])
    index = []
    for dim, axis in enumerate(spec.split(",")):
        if axis == "-":
            index.append(slice(None))
            continue
        parts = mesh_shape[AXES[axis]]
        size = array.shape[dim] // parts
        at = coord[AXES[axis]]
        index.append(slice(at * size, (at + 1) * size))
    return array[tuple(index)]


def test_the_mesh_corpus_is_there() -> None:
    assert {"n300_tp_mlp", "n300_dp_mlp", "t3000_mlp"} <= set(CASES), CASES


@pytest.mark.parametrize("name", CASES)
async def test_mesh_binary_matches_jax_cpu_on_every_chip(name: str) -> None:
    meta = json.loads((CORPUS / f"{name}.json").read_text())
    mesh_shape = tuple(meta["mesh_shape"])
    spec = tt.MeshSpec.n300() if mesh_shape == (1, 2) else tt.MeshSpec.t3000()
    assert spec.shape == mesh_shape
    binary = tt.Binary.load(CORPUS / f"{name}.ttnn")
    data = np.load(CORPUS / f"{name}.npz")
    chips = mesh_shape[0] * mesh_shape[1]
    async with tt.open_mesh_device(spec) as mesh:
        inputs = [
            tt.from_shards([shard(data[f"in{j}"], s, mesh_shape, c) for c in range(chips)], mesh,
                           tt.get_layout(binary, 0, j))
            for j, s in enumerate(meta["in_specs"])
        ]
        before = sum(mesh.stats.link_bytes.values())
        (out,) = tt.submit(mesh, binary, 0, inputs)
        pieces = [await tt.to_host(t) for t in tt.device_tensors(out)]
        expected = data["out0"]
        for c, piece in enumerate(pieces):
            want = shard(expected, meta["out_specs"][0], mesh_shape, c)
            np.testing.assert_allclose(piece, want, rtol=1e-5, atol=1e-5, err_msg=f"{name} chip {c}")
        crossed = sum(mesh.stats.link_bytes.values()) - before
        collectives = [op.name for op in read_ttnn((CORPUS / f"{name}.ttnn").read_bytes()).programs[0].ops
                       if op.name in ("ttnn.all_gather", "ttnn.all_reduce", "ttnn.reduce_scatter", "ttnn.point_to_point")]
        # a collective's bytes cross the emulated links; a program without one sends none
        assert (crossed > 0) == bool(collectives), (name, collectives, crossed)
