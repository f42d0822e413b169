"""The mesh as a state machine (ttflow.testing.MeshStateMachine) against the numpy model of every
chip's shard: a 2x2 line of small chips on asyncio, a 1x3 ring on trio.

Work stays queued between rules (every chip's queue workers held), so submits, deallocations,
conversions and reads overlap queued programs and collectives; whenever the mesh is idle each
chip's memory equals its live shards' storages to the byte, every live shard reads back as the
model says, and `mesh.stats.link_bytes` moved by exactly the documented formulas. See the
module docstring of `ttflow.testing._machine_mesh` for the bugs planted and how often the ci
profile caught each.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings

import ttflow as tt
from ttflow.testing import MeshStateMachine

SMALL = tt.DeviceSpec.small()


class MeshMachine(MeshStateMachine):
    mesh_spec = tt.MeshSpec((2, 2), chip=SMALL)


class TrioRingMeshMachine(MeshStateMachine):
    """On trio, a 1x3 ring (its ends linked: ring algorithms), with the "eager" L1 policy."""

    backend = "trio"
    mesh_spec = tt.MeshSpec((1, 3), chip=SMALL, topology="ring")
    eviction = "eager"


MACHINE_SETTINGS = settings(stateful_step_count=50)
TestMeshAsyncio = MeshMachine.TestCase
TestMeshAsyncio.settings = MACHINE_SETTINGS
TestMeshTrio = TrioRingMeshMachine.TestCase
TestMeshTrio.settings = MACHINE_SETTINGS


# -- the model's own reference, against docs/mesh.md's worked figures ---------------------------------


def test_the_models_link_formulas_give_the_documented_figures() -> None:
    from ttflow.testing._machine_mesh import _View, link_bytes

    t3000 = tt.MeshSpec.t3000()
    view = _View(t3000, (2, 4), tuple(range(8)))
    # The tensor-parallel MLP: one all_reduce of a 32x64 float32 partial over the T3000's ring:
    # 14336 bytes on link (0, 0) -> (0, 1), 2 (N-1)/N of the tensor on each of the 8 ring links.
    ((group, links),) = link_bytes(view, "all_reduce", {"cluster_axis": None}, 32 * 64, 4)
    assert len(group) == 8 and links[0, 1] == 14336
    ring = [0, 1, 2, 3, 7, 6, 5, 4]
    assert links == {(a, b): 14336 for a, b in zip(ring, ring[1:] + ring[:1])}
    # A ring all_gather: (N-1) S one way on each link; a row of four (cluster_axis=1) is a line:
    # (p -> p+1) carries (p+1) S and (p+1 -> p) (N-1-p) S.
    ((_, links),) = link_bytes(view, "all_gather", {"dim": 0, "cluster_axis": None}, 1024, 4)
    assert links == {(a, b): 7 * 4096 for a, b in zip(ring, ring[1:] + ring[:1])}
    rows = link_bytes(view, "all_gather", {"dim": 0, "cluster_axis": 1}, 1024, 4)
    assert [sorted(links.items()) for _, links in rows][0] == sorted(
        {(0, 1): 4096, (1, 0): 3 * 4096, (1, 2): 2 * 4096, (2, 1): 2 * 4096, (2, 3): 3 * 4096, (3, 2): 4096}.items())


# -- bugs the machine found ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_submit_refuses_a_deallocated_shard_on_any_chip() -> None:
    # Found by MeshStateMachine's `deallocate_shard` rule in the working tree of 2026-11-26 (the
    # C SPMD fast path, `_dispatch.submit_spmd`, then uncommitted): with chip 1's or chip 2's
    # shard freed, a program without collectives was queued on every chip, the freed shard's
    # chip reading freed memory, instead of DeallocatedTensorError before any chip queues.
    async with tt.open_mesh_device(tt.MeshSpec((1, 3), chip=SMALL)) as mesh:
        b = tt.ProgramBuilder("relu")
        b.output(b.relu(b.input((12, 24))))
        relu = tt.Binary([b.build()])
        for k in range(3):
            x = tt.to_device(np.ones((12, 24), np.float32), mesh)
            await x
            tt.deallocate(tt.device_tensors(x)[k])
            queued = [chip.stats.programs_run for chip in mesh.chips]
            with pytest.raises(tt.DeallocatedTensorError):
                tt.submit(mesh, relu, 0, [x])
            await mesh.synchronize()
            assert [chip.stats.programs_run for chip in mesh.chips] == queued  # nothing ran anywhere
            tt.deallocate(x)
