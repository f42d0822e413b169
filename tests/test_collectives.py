"""Collectives as program ops (issue 26, part 2): the builder's shapes, the file format, the
group of one chip; the algorithms over a mesh's links, the bytes each link carries, against
their formulas; SPMD runs against numpy on meshes 1x2, 1x3, 2x2, 2x4; faults.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ttflow as tt
from ttflow._binary import for_mesh
from ttflow._program import run_on_host

pytestmark = pytest.mark.anyio

F32, BF16, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.INT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE, RM = tt.TensorLayout.TILE, tt.TensorLayout.ROW_MAJOR
SMALL = tt.DeviceSpec.small()


# -- the builder: shapes for a group size, checks ------------------------------------------------


def every_collective(mesh_shape: tuple[int, int] | None = None) -> tt.Program:
    b = tt.ProgramBuilder("all six", mesh_shape=mesh_shape)
    x = b.input((8, 12))
    y = b.all_gather(x, -1, cluster_axis=1)
    z = b.reduce_scatter(y, 0)
    w = b.all_reduce(z, cluster_axis=0)
    v = b.all_to_all(w, 1, 0, cluster_axis=1)
    u = b.broadcast(v, (0, 0))
    b.output(b.point_to_point(u, (0, 0), (0, 0)))
    return b.build()


@pytest.mark.parametrize(("mesh", "shapes"), [
    (None, [(8, 12), (8, 12), (8, 12), (8, 12)]),
    ((1, 1), [(8, 12), (8, 12), (8, 12), (8, 12)]),
    ((2, 4), [(8, 48), (1, 48), (1, 48), (4, 12)]),
    ((2, 2), [(8, 24), (2, 24), (2, 24), (4, 12)]),
])
def test_shapes_follow_the_group_size(mesh: tuple[int, int] | None, shapes: list[tuple[int, ...]]) -> None:
    p = every_collective(mesh)
    assert [p.values[s.output].shape for s in p.steps[:4]] == shapes
    assert p.mesh_shape == mesh and p.has_collectives
    assert dict(p.steps[0].attrs) == {"dim": 1, "cluster_axis": 1}  # canonical: a non-negative dim


def test_the_builder_refuses_what_no_mesh_runs() -> None:
    b = tt.ProgramBuilder("bad", mesh_shape=(2, 4))
    x = b.input((6, 4))
    with pytest.raises(tt.ShapeError, match="reduce_scatter: dim 0 .* size 6, which a group of 8"):
        b.reduce_scatter(x, 0)
    with pytest.raises(tt.ShapeError, match="all_to_all: split dim 1 .* group of 4"):
        b.all_to_all(b.reshape(x, (4, 6)), 1, 0, cluster_axis=1)
    with pytest.raises(tt.ShapeError, match="cluster_axis is 0 .* 1 .* or None"):
        b.all_reduce(x, cluster_axis=2)
    with pytest.raises(tt.ShapeError, match=r"sender \(2, 0\) is outside the 2x4 mesh"):
        b.broadcast(x, (2, 0))
    with pytest.raises(tt.ShapeError, match="receiver is a mesh coordinate"):
        b.point_to_point(x, (0, 0), 3)
    with pytest.raises(tt.ShapeError, match="axis 2 is out of range"):
        b.all_gather(x, 2)
    with pytest.raises(tt.LayoutError, match="BFLOAT8_B values do not cross links"):
        b.all_gather(b.typecast(x, tt.DataType.BFLOAT8_B), 0)
    with pytest.raises(tt.ShapeError, match="mesh_shape must be at least 1"):
        tt.ProgramBuilder("p", mesh_shape=(2, 0))
    with pytest.raises(tt.ShapeError, match="mesh_shape is"):
        tt.ProgramBuilder("p", mesh_shape=8)  # type: ignore[arg-type]


def test_dtypes_pass_through() -> None:
    for dtype in (F32, BF16, I32, tt.DataType.UINT32):
        b = tt.ProgramBuilder("dtypes", mesh_shape=(1, 2))
        x = b.input((2, 4), tt.Layout(dtype=dtype))
        assert b.all_reduce(x).dtype is dtype and b.all_gather(x, 0).shape == (4, 4)


# -- the file format (version 7) and the resolution for a mesh ----------------------------------------


def test_a_binary_keeps_collectives_and_its_mesh_shape(tmp_path) -> None:  # type: ignore[no-untyped-def]
    programs = [every_collective(), every_collective((2, 4))]
    tt.Binary(programs).save(tmp_path / "c.ttb")
    loaded = tt.Binary.load(tmp_path / "c.ttb").programs
    assert all(a.same_as(b) for a, b in zip(loaded, programs))
    assert [p.mesh_shape for p in loaded] == [None, (2, 4)]


def test_a_version_6_file_naming_a_collective_is_malformed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json
    import struct
    import zlib

    path = tmp_path / "c.ttb"
    tt.Binary([every_collective()]).save(path)
    raw = path.read_bytes()
    payload = raw[24:]
    for version, match in ((6, "all_gather is not an op of format version 6"), (7, None)):
        path.write_bytes(struct.pack("<8sIQI", b"TTFLOWB\0", version, len(payload), zlib.crc32(payload)) + payload)
        if match is None:
            tt.Binary.load(path)
        else:
            with pytest.raises(tt.BinaryFormatError, match=match):
                tt.Binary.load(path)
    # A version-6 file's "mesh_shape" is not read: there is none before version 7.
    doc = json.loads(payload)
    doc[0]["mesh_shape"] = [2, 4]
    doc[0]["steps"] = []
    doc[0]["values"] = doc[0]["values"][:1]
    doc[0]["outputs"] = [0]
    doc[0]["output_specs"] = [doc[0]["values"][0]]
    body = json.dumps(doc).encode()
    path.write_bytes(struct.pack("<8sIQI", b"TTFLOWB\0", 6, len(body), zlib.crc32(body)) + body)
    assert tt.Binary.load(path).programs[0].mesh_shape is None


def test_for_mesh_resolves_again_and_keeps_the_result() -> None:
    p = every_collective()
    on_t3000 = for_mesh(p, (2, 4))
    assert on_t3000 is for_mesh(p, (2, 4)) and on_t3000.same_as(every_collective((2, 4)))
    assert for_mesh(on_t3000, (2, 4)) is on_t3000
    assert for_mesh(on_t3000, (1, 1)).same_as(every_collective((1, 1)))
    plain = tt.ProgramBuilder("plain", mesh_shape=(2, 4))
    plain.output(plain.relu(plain.input((2, 2))))
    no_collectives = plain.build()
    assert no_collectives.mesh_shape is None and for_mesh(no_collectives, (2, 2)) is no_collectives


def test_a_program_that_does_not_fit_the_mesh_is_refused_naming_both() -> None:
    b = tt.ProgramBuilder("fixed")
    x = b.input((4, 8))
    b.output(b.reshape(b.all_gather(x, 0), (32,)))  # a shape literal of the group of one
    with pytest.raises(tt.ShapeError, match=r"program 'fixed' does not fit a 1x2 mesh: reshape"):
        for_mesh(b.build(), (1, 2))


def test_run_on_host_is_the_group_of_one() -> None:
    x = np.arange(96, dtype=np.float32).reshape(8, 12)
    (out,) = run_on_host(every_collective(), [x])
    np.testing.assert_array_equal(out, x)
    with pytest.raises(tt.ProgramError, match="built for a 2x4 mesh"):
        run_on_host(every_collective((2, 4)), [x])


@given(st.sampled_from([F32, BF16, I32]), st.sampled_from([TILE, RM]), st.sampled_from([DRAM, L1]))
async def test_a_device_runs_collectives_as_a_group_of_one(dtype: tt.DataType, layout: tt.TensorLayout,
                                                            space: tt.MemorySpace) -> None:
    # A single device is a 1x1 mesh: every collective is the identity there, whatever mesh the
    # program was built for (it is resolved again for 1x1), and a sender elsewhere is refused.
    rng = np.random.default_rng(0)
    x = (rng.integers(-100, 100, (8, 12)) if dtype is I32 else rng.standard_normal((8, 12))).astype(dtype.host_dtype)
    lay = tt.Layout(space, layout, dtype)
    async with tt.open_device(SMALL) as device:
        t = tt.to_device(x, device, lay)
        for mesh in (None, (2, 4)):
            b = tt.ProgramBuilder("p", mesh_shape=mesh)
            v = b.input((8, 12), lay)
            v = b.all_gather(v, 0, cluster_axis=1)
            v = b.reduce_scatter(v, 0, cluster_axis=1)
            v = b.all_reduce(v)
            b.output(b.all_to_all(b.point_to_point(b.broadcast(v, (0, 0)), (0, 0), (0, 0)), 0, 1), lay)
            (out,) = tt.submit(device, tt.Binary([b.build()]), 0, [t])
            assert out.shape == (8, 12)
            np.testing.assert_array_equal(await tt.to_host(out), x)
        b = tt.ProgramBuilder("elsewhere")
        b.output(b.broadcast(b.input((8, 12), lay), (0, 1)))
        with pytest.raises(tt.ShapeError, match=r"does not fit a 1x1 mesh: broadcast: sender \(0, 1\)"):
            tt.submit(device, tt.Binary([b.build()]), 0, [t])
