"""Meshes of chips (issue 26, part 1): systems, open and split, distributed tensors, SPMD submit.

Everything against numpy, on asyncio and trio: mappers and composers (hypothesis over mesh
shapes, dims, dtypes and layouts), shards in their own chip's bank bytes, a program on every
chip equal to numpy and to a one-chip run, submeshes driven by two tasks at once, reshapes,
a one-chip mesh used as a device, and closing with work queued (typed, nothing left allocated).
"""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import anyio.lowlevel
import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ttflow as tt

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("spmd_path")]

F32, BF16, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.INT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE, RM = tt.TensorLayout.TILE, tt.TensorLayout.ROW_MAJOR
SMALL = tt.DeviceSpec.small()
SHAPES = [(1, 1), (1, 2), (1, 3), (2, 2), (2, 4)]


def small(shape: tuple[int, int], **fields: Any) -> tt.MeshSpec:
    return tt.MeshSpec(shape, chip=SMALL, **fields)


def used(mesh: tt.MeshDevice) -> list[tuple[int, int]]:
    return [(chip.memory_used(DRAM), chip.memory_used(L1)) for chip in mesh.chips]


def values(shape: tuple[int, ...], dtype: tt.DataType, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype is I32:
        return rng.integers(-1000, 1000, shape, dtype=np.int32)
    return rng.standard_normal(shape).astype(dtype.host_dtype)


def mlp_binary(rows: int = 64, d_in: int = 40, d_out: int = 24) -> tt.Binary:
    b = tt.ProgramBuilder("matmul_relu")
    x = b.input((rows, d_in), tt.Layout(DRAM, TILE, F32))
    w = b.input((d_in, d_out), tt.Layout(L1, TILE, F32))
    b.output(b.relu(b.matmul(x, w)))
    return tt.Binary([b.build()])


def add_one_binary(shape: tuple[int, ...] = (32, 32)) -> tt.Binary:
    b = tt.ProgramBuilder("add_one")
    b.output(b.add(b.input(shape), 1.0))
    return tt.Binary([b.build()])


# -- systems ---------------------------------------------------------------------------------


def test_presets_hold_the_board_facts() -> None:
    n300, t3000, galaxy = tt.MeshSpec.n300(), tt.MeshSpec.t3000(), tt.MeshSpec.galaxy()
    assert (n300.shape, n300.links_per_pair, n300.dispatch_links_per_pair) == ((1, 2), 1, 1)
    assert (t3000.shape, t3000.links_per_pair, t3000.topology) == ((2, 4), 2, "line")
    assert (galaxy.shape, galaxy.links_per_pair, galaxy.max_neighbours) == ((4, 8), 4, 4)
    for spec in (n300, t3000, galaxy):
        assert spec.chip == tt.DeviceSpec() and spec.ports_per_chip == 16
        assert spec.link_bytes_per_second == 12.5e9 and spec.hop_seconds == 711e-9
    assert tt.MeshSpec((1, 3)).shape == (1, 3) and tt.MeshSpec([2, 2]).shape == (2, 2)
    assert hash(t3000) == hash(tt.MeshSpec.t3000())  # frozen values


def test_a_bad_spec_cannot_exist() -> None:
    for shape in [(0, 2), (2,), (1, 2, 3), (1.0, 2), "ab", 3]:
        with pytest.raises(tt.ShapeError, match="rows, cols"):
            tt.MeshSpec(shape)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="topology"):
        tt.MeshSpec((1, 2), topology="torus")
    with pytest.raises(ValueError, match="links_per_pair"):
        tt.MeshSpec((1, 2), links_per_pair=0)
    # 4 neighbours of an interior galaxy chip x 5 links = 20 ports > 16
    with pytest.raises(ValueError, match="20 Ethernet ports"):
        attrs.evolve(tt.MeshSpec.galaxy(), links_per_pair=5)
    with pytest.raises(ValueError, match="link_bytes_per_second"):
        tt.MeshSpec((1, 2), link_bytes_per_second=0)


async def test_open_mesh_device_opens_one_device_per_chip() -> None:
    async with tt.open_mesh_device(small((2, 4)), eviction="eager") as mesh:
        chips = mesh.chips
        assert mesh.shape == (2, 4) and mesh.num_chips == 8 and mesh.device_ids == list(range(8))
        assert mesh.coords == [(r, c) for r in range(2) for c in range(4)]
        assert len({id(c) for c in chips}) == 8 and all(type(c) is tt.Device for c in chips)
        assert all(c.spec == SMALL and c.eviction == "eager" for c in chips)
        assert mesh.chip((1, 2)) is chips[6] and mesh.coord_of(chips[6]) == (1, 2)
        assert mesh.neighbours((0, 0)) == [(0, 1), (1, 0)]
        assert mesh.neighbours((1, 2)) == [(0, 2), (1, 1), (1, 3)]
        with pytest.raises(tt.MeshError, match="outside"):
            mesh.chip((2, 0))
        stats = mesh.stats
        pairs = {(a, n) for a in mesh.coords for n in mesh.neighbours(a)}
        assert set(stats.link_bytes) == pairs and len(pairs) == 2 * 10  # 10 links in a 2x4 grid
        assert set(stats.link_bytes.values()) == {0}  # collectives come in part 2
        assert len(stats.chips) == 8 and stats.total.programs_run == 0
        assert [v.total for v in mesh.memory_view(L1)] == [c.memory_view(L1).total for c in chips]
    assert mesh.closed and all(c.closed for c in chips)
    with pytest.raises(tt.DeviceClosedError):
        tt.to_device(np.ones(4, np.float32), mesh)


async def test_ring_topology_links_the_ends_of_long_lines() -> None:
    async with tt.open_mesh_device(small((2, 3), topology="ring")) as mesh:
        assert mesh.neighbours((0, 0)) == [(0, 1), (0, 2), (1, 0)]  # a column of 2 does not wrap
    async with tt.open_mesh_device(small((1, 3))) as mesh:
        assert mesh.neighbours((0, 0)) == [(0, 1)]


# -- distributed tensors ---------------------------------------------------------------------


@st.composite
def layouts_and_mappers(draw: st.DrawFn) -> tuple[Any, ...]:
    shape = draw(st.sampled_from(SHAPES))
    rows, cols = shape
    dtype = draw(st.sampled_from([F32, BF16, I32]))
    layout = tt.Layout(draw(st.sampled_from([DRAM, L1])), draw(st.sampled_from([TILE, RM])), dtype)
    ndim = draw(st.integers(1, 3))
    dims = [draw(st.integers(1, 5)) for _ in range(ndim)]
    kind = draw(st.sampled_from(["replicate", "shard", "shard_2d"]))
    if kind == "replicate":
        return shape, layout, tuple(dims), tt.replicate(), None
    if kind == "shard":
        dim = draw(st.integers(-ndim, ndim - 1))
        dims[dim] *= rows * cols
        return shape, layout, tuple(dims), tt.shard(dim), tt.concat(dim)
    row_dim = draw(st.none() | st.integers(0, ndim - 1))
    col_dim = draw(st.none() | st.integers(0, ndim - 1).filter(lambda d: d != row_dim))
    if row_dim is None and col_dim is None:
        col_dim = ndim - 1
    if row_dim is not None:
        dims[row_dim] *= rows
    if col_dim is not None:
        dims[col_dim] *= cols
    return shape, layout, tuple(dims), tt.shard_2d((row_dim, col_dim)), tt.concat_2d((row_dim, col_dim))


def expected_shards(array: np.ndarray, mapper: Any, shape: tuple[int, int]) -> list[np.ndarray]:
    rows, cols = shape
    if mapper == tt.replicate():
        return [array] * (rows * cols)
    if isinstance(mapper, type(tt.shard(0))):
        return np.split(array, rows * cols, axis=mapper.dim)
    row_dim, col_dim = mapper.dims
    out = []
    for row in (np.split(array, rows, axis=row_dim) if row_dim is not None else [array] * rows):
        out += np.split(row, cols, axis=col_dim) if col_dim is not None else [row] * cols
    return out


@given(case=layouts_and_mappers())
async def test_every_mapper_and_composer_round_trips_against_numpy(case: tuple[Any, ...]) -> None:
    shape, layout, dims, mapper, composer = case
    array = values(dims, layout.dtype, seed=sum(dims))
    async with tt.open_mesh_device(small(shape)) as mesh:
        t = tt.to_device(array, mesh, layout, mapper=mapper)
        assert t.num_shards == mesh.num_chips and t.shape == dims and t.placement == mapper
        assert t.mesh is mesh and t.device is mesh and t.mesh_shape == shape and t.dtype is layout.dtype
        shards = tt.device_tensors(t)
        for k, (shard, want) in enumerate(zip(shards, expected_shards(array, mapper, shape))):
            assert shard.device is mesh.chips[k] and shard.shape == want.shape == t.shard_shape
            assert shard.layout == layout
            np.testing.assert_array_equal(await tt.to_host(shard), want)
        if composer is not None:
            np.testing.assert_array_equal(await tt.to_host(t, composer=composer), array)
        if mapper == tt.replicate() or mesh.num_chips == 1:
            np.testing.assert_array_equal(await tt.to_host(t), array)  # no composer needed
        else:
            with pytest.raises(tt.MeshError, match=re.escape(f"composer={composer!r}")):
                await tt.to_host(t)
        tt.deallocate(t)
        assert t.is_deallocated and used(mesh) == [(0, 0)] * mesh.num_chips


async def test_shards_sit_in_their_own_chips_banks() -> None:
    # ROW_MAJOR DRAM: page i (one row) in bank i % 4 at the buffer's address, on the shard's chip.
    array = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    async with tt.open_mesh_device(small((1, 2))) as mesh:
        t = await tt.to_device(array, mesh, mapper=tt.shard(0))
        for k, (chip, shard) in enumerate(zip(mesh.chips, tt.device_tensors(t))):
            buffer = shard.buffer
            assert buffer is not None and buffer.num_pages == 4 and buffer.page_size == 64
            for page in range(4):
                raw = chip.read_bank(DRAM, page % 4, buffer.address + (page // 4) * buffer.aligned_page_size, 64)
                assert raw == array[4 * k + page].tobytes()
        assert mesh.stats.total.host_to_device_bytes == array.nbytes
        assert [s.host_to_device_bytes for s in mesh.stats.chips] == [array.nbytes // 2] * 2


async def test_uneven_shards_are_refused_naming_the_dim_its_size_and_the_chips() -> None:
    async with tt.open_mesh_device(small((2, 2))) as mesh:
        with pytest.raises(tt.ShapeError, match=r"dim 1 has size 10, which 4 chips cannot split evenly"):
            tt.to_device(np.ones((3, 10), np.float32), mesh, mapper=tt.shard(-1))
        with pytest.raises(tt.ShapeError, match=r"dim 0 has size 3, which 2 mesh rows cannot split"):
            tt.to_device(np.ones((3, 10), np.float32), mesh, mapper=tt.shard_2d((0, 1)))
        with pytest.raises(tt.ShapeError, match=r"dim 1 has size 5, which 2 mesh columns cannot split"):
            tt.to_device(np.ones((4, 5), np.float32), mesh, mapper=tt.shard_2d((None, 1)))
        with pytest.raises(tt.ShapeError, match="out of range"):
            tt.to_device(np.ones((4, 4), np.float32), mesh, mapper=tt.shard(2))
        with pytest.raises(tt.ShapeError, match="made for a 1x4 mesh"):
            tt.to_device(np.ones((4, 4), np.float32), mesh, mapper=tt.shard_2d((1, 4), (0, 1)))
        assert used(mesh) == [(0, 0)] * 4  # refused before anything was allocated


async def test_shard_2d_in_ttnns_argument_order_and_its_refusals() -> None:
    assert tt.shard_2d((2, 4), (0, None)).dims == tt.shard_2d((0, None)).dims == (0, None)
    assert repr(tt.shard_2d((2, 4), (0, None))) == "tt.shard_2d((2, 4), (0, None))"
    with pytest.raises(tt.ShapeError, match="replicate"):
        tt.shard_2d((None, None))
    with pytest.raises(tt.ShapeError, match=r"tt.concat\(1\)"):
        tt.concat_2d((1, 1)).compose([np.ones((2, 2))] * 4, (2, 2))
    array = values((4, 8), F32)
    async with tt.open_mesh_device(small((2, 2))) as mesh:
        with pytest.raises(tt.ShapeError, match=r"tt.shard\(1\)"):
            tt.to_device(array, mesh, mapper=tt.shard_2d((1, -1)))
        t = tt.to_device(array, mesh, mapper=tt.shard_2d((2, 2), (1, 0)))  # rows split dim 1
        np.testing.assert_array_equal(await tt.to_host(tt.device_tensors(t)[1]), array[2:, :4])
        np.testing.assert_array_equal(await tt.to_host(t, tt.concat_2d((2, 2), (1, 0))), array)


async def test_from_shards_takes_arrays_or_the_chips_own_tensors() -> None:
    async with tt.open_mesh_device(small((1, 3))) as mesh:
        arrays = [values((5, 7), F32, seed=k) for k in range(3)]
        t = tt.from_shards(arrays, mesh, tt.Layout(DRAM, TILE))
        assert t.placement == tt.from_shards(arrays, mesh).placement and t.shape == (5, 7)
        np.testing.assert_array_equal(await tt.to_host(t, tt.concat(0)), np.concatenate(arrays))
        with pytest.raises(tt.MeshError, match="tt.concat"):
            await tt.to_host(t)
        kept = tt.from_shards(tt.device_tensors(t), mesh)  # no copy: the same handles
        assert tt.device_tensors(kept) == tt.device_tensors(t)
        mixed = tt.from_shards([arrays[0], tt.device_tensors(t)[1], arrays[2]], mesh)
        np.testing.assert_array_equal(await tt.to_host(mixed, tt.concat(1)), np.concatenate(arrays, 1))
        with pytest.raises(tt.MeshError, match="does not move tensors between chips"):
            tt.from_shards(tt.device_tensors(t)[::-1], mesh)
        with pytest.raises(tt.MeshError, match="one shard per chip: 2 given"):
            tt.from_shards(arrays[:2], mesh)
        with pytest.raises(tt.ShapeError, match="shard 2 has shape"):
            tt.from_shards([*arrays[:2], np.ones((5, 8), np.float32)], mesh)
        with pytest.raises(tt.LayoutError, match="shard 1 is INT32"):
            tt.from_shards([arrays[0], np.ones((5, 7), np.int32), arrays[2]], mesh)
        with pytest.raises(tt.LayoutError, match="as they are"):
            tt.from_shards(tt.device_tensors(t), mesh, tt.Layout())
        del t, kept, mixed
        assert used(mesh) == [(0, 0)] * 3


async def test_layout_write_and_deallocate_act_on_every_shard() -> None:
    array = values((6, 64), F32)
    async with tt.open_mesh_device(small((1, 2))) as mesh:
        t = tt.to_device(array, mesh, mapper=tt.shard(1))
        moved = tt.to_layout(t, tt.Layout(L1, TILE))
        assert moved.layout == tt.Layout(L1, TILE, F32) and moved.placement == t.placement
        assert all(s.layout.memory is L1 for s in tt.device_tensors(moved))
        np.testing.assert_array_equal(await tt.to_host(moved, tt.concat(1)), array)
        new = values((6, 64), F32, seed=1)
        tt.write(t, new)  # split as the tensor was
        np.testing.assert_array_equal(await tt.to_host(t, tt.concat(1)), new)
        tt.write(t, [new[:, 32:], new[:, :32]])  # one array per shard
        np.testing.assert_array_equal(await tt.to_host(t, tt.concat(1)), np.roll(new, 32, 1))
        with pytest.raises(tt.ShapeError, match="shapes must be equal"):
            tt.write(t, new[:, :32])
        with pytest.raises(tt.LayoutError, match="never converts"):
            tt.write(t, new.astype(np.float64))
        e = tt.empty((3, 4), I32, mesh)
        assert e.placement == tt.replicate() and e.shape == (3, 4)
        np.testing.assert_array_equal(await tt.to_host(e), np.zeros((3, 4), np.int32))
        t.name = "x"
        assert [s.name for s in tt.device_tensors(t)] == ["x", "x"]
        tt.deallocate(t)
        with pytest.raises(tt.DeallocatedTensorError):
            await tt.to_host(t, tt.concat(1))
        with pytest.raises(tt.DeallocatedTensorError):
            tt.write(t, new)
        del moved, e
        assert used(mesh) == [(0, 0)] * 2


# -- SPMD submit -----------------------------------------------------------------------------


async def test_spmd_matmul_relu_equals_numpy_per_shard_and_a_one_chip_run() -> None:
    binary = mlp_binary()
    x = values((4 * 64, 40), F32)
    w = values((40, 24), F32, seed=1)
    async with tt.open_mesh_device(small((2, 2))) as mesh:
        xt = tt.to_device(x, mesh, tt.Layout(DRAM, TILE), mapper=tt.shard(0))
        wt = tt.to_device(w, mesh)  # replicated; converted to L1 TILE on every chip at the start
        (y,) = tt.submit(mesh, binary, 0, [xt, wt])
        assert isinstance(y, tt.MeshTensor) and y.num_shards == 4 and y.shape == (64, 24)
        await tt.wait(y)
        shards = [await tt.to_host(s) for s in tt.device_tensors(y)]
        for k, shard in enumerate(shards):
            np.testing.assert_allclose(shard, np.maximum(x[64 * k:64 * (k + 1)] @ w, 0), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(await tt.to_host(y, tt.concat(0)), np.concatenate(shards))
        assert mesh.stats.total.programs_run == 4 and all(s.programs_run == 1 for s in mesh.stats.chips)
    async with tt.open_device(SMALL) as device:
        for k, shard in enumerate(shards):  # the same program on one chip: bit for bit
            (one,) = tt.submit(device, binary, 0, [tt.to_device(x[64 * k:64 * (k + 1)], device), tt.to_device(w, device)])
            np.testing.assert_array_equal(await tt.to_host(one), shard)


@given(shape=st.sampled_from(SHAPES), rows=st.integers(1, 40), dtype=st.sampled_from([F32, BF16]),
       two_d=st.booleans())
async def test_spmd_on_any_mesh_equals_a_one_chip_run_shard_by_shard(
        shape: tuple[int, int], rows: int, dtype: tt.DataType, two_d: bool) -> None:
    b = tt.ProgramBuilder("layer")
    x = b.input((rows, 24), tt.Layout(DRAM, TILE, dtype))
    w = b.input((24, 8), tt.Layout(DRAM, RM, dtype))
    b.output(b.add(b.relu(b.matmul(x, w)), 1.0))
    binary = tt.Binary([b.build()])
    n = shape[0] * shape[1]
    xs = values((rows * n, 24), dtype, seed=rows)
    w_host = values((24, 8), dtype, seed=1)
    mapper = tt.shard_2d((0, None)) if two_d and shape[1] == 1 else tt.shard(0)
    async with tt.open_mesh_device(small(shape)) as mesh:
        (y,) = tt.submit(mesh, binary, 0, [tt.to_device(xs, mesh, tt.Layout(DRAM, TILE), mapper),
                                           tt.to_device(w_host, mesh)])
        got = await tt.to_host(y, tt.concat(0))
    async with tt.open_device(SMALL) as device:
        wt = tt.to_device(w_host, device)
        for k in range(n):
            (one,) = tt.submit(device, binary, 0, [tt.to_device(xs[rows * k:rows * (k + 1)], device), wt])
            np.testing.assert_array_equal(await tt.to_host(one), got[rows * k:rows * (k + 1)])


async def test_spmd_submit_refuses_what_is_not_this_meshs_and_queues_nothing() -> None:
    binary = add_one_binary()
    a = np.ones((32, 32), np.float32)
    async with tt.open_mesh_device(small((1, 2))) as mesh, tt.open_mesh_device(small((1, 2))) as other:
        mine, theirs = tt.to_device(a, mesh), tt.to_device(a, other)
        with pytest.raises(tt.MeshError, match="not of"):
            tt.submit(mesh, binary, 0, [theirs])
        with pytest.raises(tt.MeshError, match="single-chip tt.Tensor"):
            tt.submit(mesh, binary, 0, [tt.device_tensors(mine)[0]])
        with pytest.raises(tt.ShapeError, match="has shape"):
            tt.submit(mesh, binary, 0, [tt.to_device(np.ones((2, 2), np.float32), mesh)])
        with pytest.raises(tt.ProgramError, match="takes 1 inputs"):
            tt.submit(mesh, binary, 0, [])
        with pytest.raises(TypeError):
            tt.submit(mesh, binary, 0, [a])  # type: ignore[list-item]
        sub = tt.create_submesh(mesh, (1, 1), (0, 1))
        with pytest.raises(tt.MeshError, match="not of"):
            tt.submit(sub, binary, 0, [mine])
        await mesh.synchronize()
        assert mesh.stats.total.programs_run == 0
        # re-homed on the submesh: the shard that sits on its chip
        (y,) = tt.submit(sub, binary, 0, [tt.from_shards(tt.device_tensors(mine)[1:], sub)])
        np.testing.assert_array_equal(await tt.to_host(y), a + 1)
        with pytest.raises(tt.MeshError, match="a mapper lays an array out over a mesh"):
            tt.to_device(a, mesh.chips[0], mapper=tt.replicate())
        with pytest.raises(tt.MeshError, match="drop it"):
            await tt.to_host(tt.device_tensors(mine)[0], tt.concat(0))


async def test_a_donation_on_a_mesh_consumes_every_shard() -> None:
    b = tt.ProgramBuilder("bump")
    x = b.input((32, 32))
    b.output(b.add(x, 1.0), donates=x)
    binary = tt.Binary([b.build()])
    async with tt.open_mesh_device(small((1, 2))) as mesh:
        a = tt.to_device(np.zeros((32, 32), np.float32), mesh, tt.get_layout(binary, 0, 0), mapper=tt.replicate())
        (y,) = tt.submit(mesh, binary, 0, [a])
        assert a.is_deallocated
        np.testing.assert_array_equal(await tt.to_host(y, tt.concat(0)), np.ones((64, 32), np.float32))
        assert [s.donations for s in mesh.stats.chips] == [1, 1]
        with pytest.raises(tt.DeallocatedTensorError, match="donated"):
            tt.submit(mesh, binary, 0, [a])
        # a shard not in the declared layout refuses before any chip consumes its input
        rm = tt.to_device(np.zeros((32, 32), np.float32), mesh)
        with pytest.raises(tt.LayoutError, match="donated"):
            tt.submit(mesh, binary, 0, [rm])
        assert not rm.is_deallocated


async def test_two_submeshes_driven_by_two_tasks_at_once() -> None:
    # tt-mlir's test_data_parallel: each 1x1 submesh runs its own batches, concurrently.
    binary = mlp_binary()
    w = values((40, 24), F32, seed=7)
    batches = [[values((64, 40), F32, seed=10 * s + i) for i in range(4)] for s in range(2)]
    results: dict[int, list[np.ndarray]] = {}
    async with tt.open_mesh_device(small((1, 2))) as mesh:
        subs = [tt.create_submesh(mesh, (1, 1), (0, k)) for k in range(2)]
        assert [s.chips for s in subs] == [[mesh.chips[0]], [mesh.chips[1]]] and subs[1].device_ids == [1]

        async def run(k: int) -> None:
            sub = subs[k]
            weights = tt.to_device(w, sub)
            outs = []
            for batch in batches[k]:
                (y,) = tt.submit(sub, binary, 0, [tt.to_device(batch, sub), weights])
                outs.append(y)
                await anyio.lowlevel.checkpoint()
            results[k] = [await tt.to_host(y) for y in outs]

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, 0)
            tg.start_soon(run, 1)
        assert [s.programs_run for s in mesh.stats.chips] == [4, 4]
        for k in range(2):
            for batch, out in zip(batches[k], results[k]):
                np.testing.assert_allclose(out, np.maximum(batch @ w, 0), rtol=1e-5, atol=1e-5)
        for sub in subs:
            tt.release_submesh(sub)
        assert used(mesh) == [(0, 0)] * 2


async def test_a_released_submesh_refuses_work_typed() -> None:
    binary = add_one_binary()
    async with tt.open_mesh_device(small((2, 2))) as mesh:
        sub = tt.create_submesh(mesh, (1, 2), (1, 0))
        assert sub.device_ids == [2, 3] and sub.parent is mesh and sub.spec is mesh.spec
        inner = tt.create_submesh(sub, (1, 1), (0, 1))
        assert inner.device_ids == [3]
        t = tt.to_device(np.ones((32, 32), np.float32), sub)
        (y,) = tt.submit(sub, binary, 0, [t])
        await y
        tt.release_submesh(sub)
        tt.release_submesh(sub)  # idempotent
        assert sub.released and inner.released and not mesh.released
        for call in (lambda: tt.to_device(np.ones(3, np.float32), sub), lambda: tt.submit(sub, binary, 0, [t]),
                     lambda: tt.create_submesh(sub, (1, 1)), lambda: sub.reshape((2, 1)),
                     lambda: tt.empty((2,), F32, inner), lambda: tt.to_layout(t, tt.Layout(L1))):
            with pytest.raises(tt.MeshError, match="released"):
                call()
        with pytest.raises(tt.MeshError, match="released"):
            await tt.to_host(y)
        tt.deallocate(y)  # freeing is always allowed
        with pytest.raises(tt.MeshError, match="closes when its `async with` block ends"):
            tt.release_submesh(mesh)
        with pytest.raises(tt.ShapeError, match="does not fit"):
            tt.create_submesh(mesh, (2, 2), (0, 1))
        mesh.reshape((1, 4))  # its submeshes are released: the mesh may reshape
        tt.deallocate(t)
        assert used(mesh) == [(0, 0)] * 4


async def test_reshape_keeps_neighbours_linked() -> None:
    async with tt.open_mesh_device(tt.MeshSpec.t3000()) as mesh:
        x = values((8, 32), F32)
        t = tt.to_device(x, mesh, mapper=tt.shard(0))
        mesh.reshape((1, 8))  # the zigzag through the grid: the T3000 ring
        assert mesh.shape == (1, 8) and mesh.device_ids == [0, 1, 2, 3, 7, 6, 5, 4]
        assert mesh.neighbours((0, 0)) == [(0, 1), (0, 7)]  # chips 0 and 4: the ring closes
        mesh.reshape((8, 1))
        assert mesh.device_ids == [0, 1, 2, 3, 7, 6, 5, 4]  # a line stays the line it is
        mesh.reshape((2, 4))
        assert mesh.device_ids == list(range(8))
        mesh.reshape((4, 2))  # rotated
        assert mesh.device_ids == [0, 4, 1, 5, 2, 6, 3, 7]
        assert mesh.neighbours((1, 0)) == [(0, 0), (1, 1), (2, 0)]
        with pytest.raises(tt.ShapeError, match="8 chips"):
            mesh.reshape((3, 3))
        # a tensor made before keeps its shards; a submit pairs shards with chips by chip
        np.testing.assert_array_equal(await tt.to_host(t, tt.concat(0)), x)
        assert t.mesh_shape == (2, 4)
        (y,) = tt.submit(mesh, add_one_binary((1, 32)), 0, [t])
        assert [s.device for s in tt.device_tensors(y)] == mesh.chips
        got = [await tt.to_host(s) for s in tt.device_tensors(y)]
        np.testing.assert_array_equal(np.concatenate(got), x[mesh.device_ids] + 1)
        sub = tt.create_submesh(mesh, (2, 2))
        with pytest.raises(tt.MeshError, match="submeshes of it are live"):
            mesh.reshape((2, 4))
        tt.release_submesh(sub)
    async with tt.open_mesh_device(small((1, 4))) as line:
        with pytest.raises(tt.MeshError, match="cannot reshape"):
            line.reshape((2, 2))  # chips 0-1-2-3 on a line hold no 2x2 grid
        sub = tt.create_submesh(line, (1, 3), (0, 1))
        sub.reshape((3, 1))
        assert sub.device_ids == [1, 2, 3] and line.device_ids == [0, 1, 2, 3]


async def test_a_one_chip_mesh_behaves_as_a_device() -> None:
    binary = mlp_binary()
    x, w = values((64, 40), F32), values((40, 24), F32, seed=1)
    want = np.maximum(x @ w, 0)
    async with tt.open_mesh_device((1, 1)) as mesh:
        assert mesh.spec.chip == tt.DeviceSpec() and mesh.num_chips == 1
        xt, wt = tt.to_device(x, mesh), tt.to_device(w, mesh)  # no mapper
        (y,) = tt.submit(mesh, binary, 0, [xt, wt])
        np.testing.assert_allclose(await tt.to_host(y), want, rtol=1e-5, atol=1e-5)  # no composer
        await tt.wait(y)
        await y
        assert y.done() and tt.device_tensors(y)[0].device is mesh.chips[0]
        chip = mesh.chips[0]
        plain = [tt.to_device(x, chip), tt.to_device(w, chip)]
        (z,) = tt.submit(mesh, binary, 0, plain)  # a device's tensors: a device's answer
        assert type(z) is tt.Tensor and tt.device_tensors(z) == [z]
        np.testing.assert_array_equal(await tt.to_host(z), await tt.to_host(y))
        moved = tt.to_layout(y, tt.Layout(L1, TILE))
        np.testing.assert_array_equal(await tt.to_host(moved), await tt.to_host(y))
        with tt.capture_trace(mesh) as trace:
            (traced,) = tt.submit(mesh, binary, 0, [xt, wt])
        await traced
        assert isinstance(trace, tt.MeshTrace) and trace.programs == ("matmul_relu",)
        tt.write(xt, 2 * x)
        tt.execute_trace(trace)
        np.testing.assert_allclose(await tt.to_host(traced), np.maximum(2 * x @ w, 0), rtol=1e-5, atol=1e-4)
        tt.release_trace(trace)
        assert trace.released
        assert mesh.memory_used(DRAM) == chip.memory_used(DRAM) > 0
        for t in (xt, wt, y, z, moved, traced, *plain):
            tt.deallocate(t)
        assert mesh.memory_used(DRAM) == mesh.memory_used(L1) == 0


async def test_traces_on_a_mesh_replay_on_every_chip() -> None:
    binary = add_one_binary()
    async with tt.open_mesh_device(small((1, 3))) as mesh:
        slot = tt.empty((32, 32), F32, mesh)
        with tt.capture_trace(mesh) as trace:
            (y,) = tt.submit(mesh, binary, 0, [slot])
        assert len(trace.traces) == 3 and all(t.device is c for t, c in zip(trace.traces, mesh.chips))
        for step in range(3):
            tt.write(slot, [np.full((32, 32), 10 * k + step, np.float32) for k in range(3)])
            tt.execute_trace(trace)
            got = await tt.to_host(y, tt.concat(0))
            want = np.concatenate([np.full((32, 32), 10 * k + step + 1, np.float32) for k in range(3)])
            np.testing.assert_array_equal(got, want)
        assert [s.trace_replays for s in mesh.stats.chips] == [3, 3, 3]
        tt.release_trace(trace)
        with pytest.raises(tt.TraceError):
            tt.execute_trace(trace)


async def test_one_timeline_with_a_process_per_chip(tmp_path: Any) -> None:
    async with tt.open_mesh_device(small((1, 2))) as mesh:
        with tt.record_timeline(mesh) as recorder:
            t = tt.to_device(np.ones((32, 32), np.float32), mesh)
            (y,) = tt.submit(mesh, add_one_binary(), 0, [t])
            await tt.to_host(y, tt.concat(0))
        assert isinstance(recorder, tt.MeshTimelineRecorder) and recorder.commands == 6
        recorder.save(tmp_path / "mesh.json")
        events = json.loads((tmp_path / "mesh.json").read_text())["traceEvents"]
        names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        workers = {pid: f"chip {chip.chip} worker {pid}" for chip, pid in zip(mesh.chips, mesh.worker_pids) if pid}
        assert names == {1: "ttflow 1x2 chip 0 (0, 0)", 2: "ttflow 1x2 chip 1 (0, 1)", **workers}
        for pid in (1, 2):
            assert {e["name"] for e in events if e["ph"] == "X" and e["pid"] == pid} >= {"write", "add_one"}
        assert [s["CQ1"]["commands"] for s in recorder.queue_summary()] == [1, 1]


# -- closing ---------------------------------------------------------------------------------


async def test_an_error_in_the_block_fails_queued_work_on_every_chip() -> None:
    binary = add_one_binary()
    with pytest.raises(KeyError):
        async with tt.open_mesh_device(small((2, 2)), inline_seconds=-1) as mesh:
            t = tt.to_device(np.ones((32, 32), np.float32), mesh, mapper=tt.replicate())
            outs = [tt.submit(mesh, binary, 0, [t])[0] for _ in range(3)]
            raise KeyError("user bug")
    assert mesh.closed and used(mesh) == [(0, 0)] * 4
    with pytest.raises(tt.DeviceClosedError):
        await outs[-1]
    for shard in tt.device_tensors(outs[-1]):
        with pytest.raises(tt.DeviceClosedError):
            await shard
    with pytest.raises(tt.DeviceClosedError):
        await tt.to_host(outs[0], tt.concat(0))


async def test_closing_drains_queued_work_and_frees_every_chip() -> None:
    binary = add_one_binary()
    async with tt.open_mesh_device(small((1, 3))) as mesh:
        t = tt.to_device(np.ones((32, 32), np.float32), mesh)
        outs = [tt.submit(mesh, binary, 0, [t])[0] for _ in range(4)]
        assert not outs[-1].done()
    assert all(o.done() for o in outs) and used(mesh) == [(0, 0)] * 3
    assert mesh.stats.total.programs_run == 12


async def test_cancelling_the_block_closes_every_chip() -> None:
    with anyio.CancelScope() as scope:
        async with tt.open_mesh_device(small((1, 2))) as mesh:
            t = tt.to_device(np.ones((32, 32), np.float32), mesh)
            outs = [tt.submit(mesh, add_one_binary(), 0, [t])[0] for _ in range(3)]
            scope.cancel()
            await anyio.sleep(1)
    assert scope.cancelled_caught and mesh.closed and used(mesh) == [(0, 0)] * 2
    assert all(o.done() for o in outs)
