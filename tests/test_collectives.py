"""Collectives as program ops (issue 26, part 2): the builder's shapes, the file format, the
group of one chip; the algorithms over a mesh's links, the bytes each link carries, against
their formulas; SPMD runs against numpy on meshes 1x2, 1x3, 2x2, 2x4; faults.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ttflow as tt
from ttflow._ir.binary import for_mesh
from ttflow._mesh.collectives import Rendezvous
from ttflow._mesh.links import Fabric
from ttflow._mesh.topology import physical
from ttflow._ir.numerics import store_as
from ttflow._ir.interpreter import run_on_host
from ttflow.testing import ordered_sums as summed_in_order

pytestmark = pytest.mark.anyio

F32, BF16, I32, BF8 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.INT32, tt.DataType.BFLOAT8_B
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
    odd, even = b.input((32, 48 * 8)), b.input((32, 64 * 8))
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
    # BFLOAT8_B crosses links as whole packed tiles: a dim cut or joined in chunks that are
    # not multiples of 32 (in the last two dims) is refused; other dims, any size.
    bf8 = b.typecast(b.reshape(x, (2, 3, 4)), BF8)
    with pytest.raises(tt.ShapeError, match="all_gather: a BFLOAT8_B value of .* chunks of 4, not a multiple of 32"):
        b.all_gather(bf8, 2)
    assert b.all_gather(bf8, 0).shape == (16, 3, 4)
    with pytest.raises(tt.ShapeError, match="reduce_scatter: .* along dim 1 in chunks of 48, not"):
        b.reduce_scatter(b.typecast(odd, BF8), 1)
    wide = b.typecast(even, BF8)
    assert b.reduce_scatter(wide, 1).shape == (32, 64)  # parts of whole tiles
    with pytest.raises(tt.ShapeError, match="all_to_all: .* along dim 0 in chunks of 4"):
        b.all_to_all(wide, 0, 1)
    assert b.all_reduce(bf8).shape == (2, 3, 4) and b.broadcast(bf8, (1, 1)).dtype is BF8
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


# -- the algorithms over a mesh's links ------------------------------------------------------------
#
# `reference` is independent of `_mesh.collectives`: each chip's result from numpy (the sums in
# their documented order, bit for bit, and near numpy's own sum), and the payload bytes each
# directed link carries, from each algorithm's closed form (ring and line) or its documented
# route (breadth-first, neighbours in row-major order). The same reference checks runs with
# plain threads (one per chip) and SPMD runs on meshes.

Coord = tuple[int, int]
Links = dict[tuple[Coord, Coord], int]


def grid(spec: tt.MeshSpec) -> list[Coord]:
    return [(r, c) for r in range(spec.shape[0]) for c in range(spec.shape[1])]


def groups(spec: tt.MeshSpec, axis: int | None) -> list[list[Coord]]:
    """The groups of `cluster_axis=axis`, each in mesh-coordinate order."""
    if axis is None:
        return [grid(spec)]
    return [[c for c in grid(spec) if c[1 - axis] == k] for k in range(spec.shape[1 - axis])]


def chain(spec: tt.MeshSpec, group: list[Coord]) -> tuple[list[Coord], bool]:
    """The group as a path of linked chips (a zigzag over a 2-D group) and whether it closes."""
    rows = sorted({r for r, _ in group})
    if len(rows) > 1 and len({c for _, c in group}) > 1:
        path = [c for k, r in enumerate(rows)
                for c in (sorted(g for g in group if g[0] == r)[:: 1 if k % 2 == 0 else -1])]
    else:
        path = list(group)
    return path, len(path) > 2 and spec.linked(path[-1], path[0])


def parents(spec: tt.MeshSpec, root: Coord) -> dict[Coord, Coord]:
    """The breadth-first tree from root, each chip's neighbours in row-major order."""
    parent, todo = {root: root}, [root]
    while todo:
        here = todo.pop(0)
        for there in grid(spec):
            if there not in parent and there != here and spec.linked(here, there):
                parent[there] = here
                todo.append(there)
    return parent


def route(spec: tt.MeshSpec, a: Coord, b: Coord) -> list[tuple[Coord, Coord]]:
    parent, hops = parents(spec, a), []
    while b != a:
        hops.append((parent[b], b))
        b = parent[b]
    return hops[::-1]


def padded_2d(a: np.ndarray) -> tuple[np.ndarray, int, int]:
    """a as (batch, rows, cols) zero padded to whole 32x32 tiles (rank 1: one row), and (h, w)."""
    h, w = (1, a.shape[0]) if a.ndim == 1 else a.shape[-2:]
    batch = a.size // (h * w)
    out = np.zeros((batch, -(-h // 32) * 32, -(-w // 32) * 32), np.float32)
    out[:, :h, :w] = a.reshape(batch, h, w)
    return out, h, w


def bfp8_round(a: np.ndarray) -> np.ndarray:
    """a as BFLOAT8_B holds it, by tests/reference.py's packer (tt-metal's rule, written apart
    from ttflow's kernels): each 16-value row of a face, 16 aligned columns of a tile row, shares
    its largest exponent; a byte's value is magnitude * 2^(exponent - 133), with its sign."""
    from reference import bfp8_pack_rows

    padded, h, w = padded_2d(np.asarray(a, np.float32))
    rows = padded.reshape(*padded.shape[:2], -1, 16)
    shared, byte = bfp8_pack_rows(rows)
    magnitude = (byte & 0x7F).astype(np.float64)
    value = np.ldexp(magnitude, shared.astype(np.int64)[..., None] - 133) * np.where(byte & 0x80, -1, 1)
    return value.reshape(padded.shape)[:, :h, :w].astype(np.float32).reshape(a.shape)


def tiles_of(a: np.ndarray) -> np.ndarray:
    """a's 32x32 tiles, (tiles, 32, 32): batch, then tile rows, then tile columns."""
    padded, _, _ = padded_2d(a)
    b, ph, pw = padded.shape
    return padded.reshape(b, ph // 32, 32, pw // 32, 32).transpose(0, 1, 3, 2, 4).reshape(-1, 32, 32)


def from_tiles(tiles: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    h, w = (1, shape[0]) if len(shape) == 1 else shape[-2:]
    ph, pw = -(-h // 32) * 32, -(-w // 32) * 32
    b = tiles.shape[0] // (ph // 32 * (pw // 32))
    padded = tiles.reshape(b, ph // 32, pw // 32, 32, 32).transpose(0, 1, 3, 2, 4).reshape(b, ph, pw)
    return padded[:, :h, :w].reshape(shape)


def payload(a: np.ndarray, dtype: tt.DataType) -> int:
    """A chunk's bytes on a link: its elements times the dtype's size; BFLOAT8_B, its packed
    tiles (SPEC: 1024 mantissa bytes + 64 exponent bytes per 32x32 tile)."""
    if dtype is BF8:
        h, w = (1, a.shape[0]) if a.ndim == 1 else a.shape[-2:]
        return a.size // (h * w) * -(-h // 32) * -(-w // 32) * (1024 + 64) if a.size else 0
    return a.size * np.dtype(dtype.host_dtype).itemsize


def rounded(a: np.ndarray, dtype: tt.DataType) -> np.ndarray:
    return bfp8_round(a) if dtype is BF8 else store_as(a, dtype)


def host_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: tt.DataType) -> np.ndarray:
    """Values as the device holds them in `dtype`, in its compute dtype (float32 or int64)."""
    if dtype is I32:
        return store_as(rng.integers(-(2**31), 2**31, shape), dtype)  # sums wrap
    return rounded(rng.standard_normal(shape).astype(np.float32) * 100, dtype)


def ordered_sums(path: list[Coord], ring: bool, terms: dict[Coord, dict[Coord, np.ndarray]],
                 dtype: tt.DataType) -> dict[Coord, np.ndarray]:
    """Each path chip's part summed in the documented order (`ttflow.testing.ordered_sums`),
    every partial rounded to `dtype` (BFLOAT8_B: by this file's packer reference)."""
    def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return rounded(a + b, dtype) if a.size else a + b

    return summed_in_order(path, ring, terms, add)


def near_sum(got: np.ndarray, terms: list[np.ndarray], dtype: tt.DataType) -> None:
    """`got` within the documented tolerance of the exact sum of `terms`: N roundings of at
    most half an ulp of the dtype, each of a partial no larger than the sum of magnitudes."""
    if dtype is I32:
        np.testing.assert_array_equal(got, store_as(np.sum(terms, axis=0), dtype))
        return
    exact = np.sum([t.astype(np.float64) for t in terms], axis=0)
    scale = np.sum([np.abs(t).astype(np.float64) for t in terms], axis=0)
    eps = 2.0**-8 if dtype is BF16 else 2.0**-24
    assert np.all(np.abs(got - exact) <= len(terms) * eps * scale)


def reference(op: str, spec: tt.MeshSpec, xs: dict[Coord, np.ndarray], attrs: dict,
              dtype: tt.DataType) -> tuple[dict[Coord, np.ndarray], Links]:
    """Each chip's expected result of one collective, and the bytes each directed link carries
    (BFLOAT8_B: packed tiles, an all_reduce's parts whole tiles, partial sums packed)."""
    out: dict[Coord, np.ndarray] = {}
    links: Links = {}

    def carry(pair: tuple[Coord, Coord], nbytes: int) -> None:
        links[pair] = links.get(pair, 0) + nbytes

    if op in ("broadcast", "point_to_point"):
        sender = tuple(attrs["sender"])
        receiver = tuple(attrs.get("receiver", sender))
        nbytes = payload(xs[sender], dtype)
        for c in grid(spec):
            out[c] = xs[sender] if op == "broadcast" or c == receiver else xs[c]
        parent = parents(spec, sender)
        hops = ([(parent[c], c) for c in grid(spec) if c != sender] if op == "broadcast"
                else route(spec, sender, receiver))
        for pair in hops:  # the tree's links, or the route's, each carrying the value once
            carry(pair, nbytes)
        return out, links
    for group in groups(spec, attrs.get("cluster_axis")):
        path, ring = chain(spec, group)
        n = len(path)
        if op == "all_to_all":
            split, concat = attrs["split_dim"], attrs["concat_dim"]
            for k, c in enumerate(group):
                out[c] = np.concatenate([np.split(xs[m], n, axis=split)[k] for m in group], axis=concat)
            part = payload(np.split(xs[group[0]], n, axis=split)[0], dtype)
            for a in group:
                for b in group:
                    for pair in route(spec, a, b) if a != b else []:
                        carry(pair, part)
            continue
        if op == "all_gather":
            for c in group:
                out[c] = np.concatenate([xs[m] for m in group], axis=attrs["dim"])
            shard = payload(xs[group[0]], dtype)
            for p in range(n - 1 + ring):
                a, b = path[p], path[(p + 1) % n]
                if ring:  # (N-1)/N of the gathered tensor over each link of the ring, one way
                    carry((a, b), (n - 1) * shard)
                else:  # a line's link carries the shards from its side, each way
                    carry((a, b), (p + 1) * shard)
                    carry((b, a), (n - 1 - p) * shard)
            continue
        if op == "reduce_scatter":
            dim = attrs["dim"]
            terms = {c: dict(zip(group, np.split(xs[c], n, axis=dim))) for c in group}
            out.update(ordered_sums(path, ring, terms, dtype))
            for k, c in enumerate(group):
                if dtype is not BF8:  # a block's rounding is relative to its largest value
                    near_sum(out[c], [np.split(xs[m], n, axis=dim)[k] for m in group], dtype)
            chunk = payload(np.split(xs[group[0]], n, axis=dim)[0], dtype)
            for p in range(n - 1 + ring):
                a, b = path[p], path[(p + 1) % n]
                if ring:  # (N-1)/N of the tensor over each link, one way
                    carry((a, b), (n - 1) * chunk)
                else:  # the parts of the chips beyond the link, from each side
                    carry((a, b), (n - 1 - p) * chunk)
                    carry((b, a), (p + 1) * chunk)
            continue
        assert op == "all_reduce"
        shape = xs[group[0]].shape
        if dtype is BF8:  # parts of whole tiles, in tile order; each tile 1088 bytes
            terms = {c: dict(zip(path, np.array_split(tiles_of(xs[c]), n))) for c in group}
            sums = ordered_sums(path, ring, terms, dtype)
            total = from_tiles(np.concatenate([sums[c] for c in path]), shape)
            elements, size = len(tiles_of(xs[group[0]])), 1024 + 64
        else:
            terms = {c: dict(zip(path, np.array_split(xs[c].reshape(-1), n))) for c in group}
            sums = ordered_sums(path, ring, terms, dtype)
            total = np.concatenate([sums[c] for c in path]).reshape(shape)
            near_sum(total, [xs[m] for m in group], dtype)
            elements, size = xs[group[0]].size, np.dtype(dtype.host_dtype).itemsize
        for c in group:
            out[c] = total  # every chip of the group the same bits
        lengths = [len(t) for t in np.array_split(np.empty(elements), n)]
        for p in range(n - 1 + ring):
            a, b = path[p], path[(p + 1) % n]
            if ring:  # every part but the two ends' twice: 2 (N-1)/N of the tensor when N divides it
                carry((a, b), (2 * elements - lengths[p] - lengths[(p + 1) % n]) * size)
            else:  # a line: the whole tensor over each link, both ways
                carry((a, b), elements * size)
                carry((b, a), elements * size)
    return out, links


def run_threads(spec: tt.MeshSpec, op: str, xs: dict[Coord, np.ndarray], attrs: dict, dtype: tt.DataType,
                timeout: float = 30) -> tuple[dict[Coord, np.ndarray], Links, list]:
    """Every chip's result of one collective step run by plain threads (one per chip), the
    payload bytes per directed link that carried some, and the rendezvous's records."""
    counters: dict[tuple[int, int], int] = {}
    fabric = Fabric(spec.shape, range(spec.num_chips),
                    lambda a, b: spec.linked(physical(spec, a), physical(spec, b)), counters)
    log: list = []
    rendezvous = Rendezvous(fabric, "threads", spec.link_bytes_per_second, spec.hop_seconds, log, timeout)
    out: dict[Coord, object] = {}

    def chip(coord: Coord) -> None:
        try:
            out[coord] = rendezvous.peer(coord).collective(3, op, xs[coord], attrs, dtype)
        except Exception as exc:  # noqa: BLE001 - raised below
            out[coord] = exc

    threads = [threading.Thread(target=chip, args=(c,)) for c in grid(spec)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in out.values():
        if isinstance(result, Exception):
            raise result
    cols = spec.shape[1]
    links = {(divmod(a, cols), divmod(b, cols)): n for (a, b), n in counters.items() if n}
    return out, links, log  # type: ignore[return-value]


MESHES = [(1, 2), (1, 3), (2, 2), (2, 4), (1, 4), (3, 1), (3, 3)]
meshes = st.builds(lambda shape, ring: tt.MeshSpec(shape, chip=SMALL, topology="ring" if ring else "line"),
                   st.sampled_from(MESHES), st.booleans())
dtypes = st.sampled_from([F32, BF16, I32])
OPS = ["all_gather", "reduce_scatter", "all_reduce", "broadcast", "point_to_point", "all_to_all"]


@st.composite
def collectives(draw: st.DrawFn, spec: tt.MeshSpec, op: str) -> tuple[tuple[int, ...], dict]:
    """An input shape and the attrs of one `op` step that fits `spec`'s mesh."""
    axis = draw(st.sampled_from([None, 0, 1]))
    n = spec.num_chips if axis is None else spec.shape[axis]
    rank = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))
    dim = draw(st.integers(0, rank - 1))
    if op == "all_gather":
        return tuple(shape), {"dim": dim, "cluster_axis": axis}
    if op == "reduce_scatter":
        shape[dim] *= n
        return tuple(shape), {"dim": dim, "cluster_axis": axis}
    if op == "all_reduce":
        return tuple(shape), {"cluster_axis": axis}
    if op == "all_to_all":
        shape[dim] *= n
        return tuple(shape), {"split_dim": dim, "concat_dim": draw(st.integers(0, rank - 1)), "cluster_axis": axis}
    sender = draw(st.sampled_from(grid(spec)))
    if op == "broadcast":
        return tuple(shape), {"sender": sender}
    return tuple(shape), {"sender": sender, "receiver": draw(st.sampled_from(grid(spec)))}


@given(meshes, st.sampled_from(OPS), dtypes, st.data())
def test_every_collective_over_links_with_threads(spec: tt.MeshSpec, op: str, dtype: tt.DataType,
                                                  data: st.DataObject) -> None:
    shape, attrs = data.draw(collectives(spec, op), label="shape, attrs")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    xs = {c: host_values(rng, shape, dtype) for c in grid(spec)}
    out, links, log = run_threads(spec, op, xs, attrs, dtype)
    want, want_links = reference(op, spec, xs, attrs, dtype)
    for c in grid(spec):
        np.testing.assert_array_equal(out[c], want[c])
    assert links == {k: v for k, v in want_links.items() if v}
    # One record per group, whose links add up to the counters.
    assert len(log) == (1 if "sender" in attrs else len(groups(spec, attrs.get("cluster_axis"))))
    merged: Links = {}
    for record in log:
        assert record.op == op and record.modelled_seconds >= 0
        for pair, nbytes in record.link_bytes.items():
            merged[pair] = merged.get(pair, 0) + nbytes
    assert merged == links


@st.composite
def bf8_collectives(draw: st.DrawFn, spec: tt.MeshSpec, op: str) -> tuple[tuple[int, ...], dict]:
    """A BFLOAT8_B input shape and attrs of one `op` step on `spec`: the dims a collective
    cuts or joins are whole tiles among the last two (32, 64 per chunk), others any size
    (batch dims 1-3, the last two 20, 32 or 40: padded tiles)."""
    axis = draw(st.sampled_from([None, 0, 1]))
    n = spec.num_chips if axis is None else spec.shape[axis]
    rank = draw(st.integers(1, 3))
    dim, other = draw(st.integers(0, rank - 1)), draw(st.integers(0, rank - 1))
    whole = {"all_gather": {dim}, "reduce_scatter": {dim}, "all_to_all": {dim, other}}.get(op, set())
    shape = [draw(st.sampled_from([32, 64]) if d in whole and d >= rank - 2 else
                  st.sampled_from([20, 32, 40]) if d >= rank - 2 else st.integers(1, 3)) for d in range(rank)]
    if op == "all_gather":
        return tuple(shape), {"dim": dim, "cluster_axis": axis}
    if op == "reduce_scatter":
        shape[dim] *= n
        return tuple(shape), {"dim": dim, "cluster_axis": axis}
    if op == "all_to_all":
        shape[dim] *= n
        return tuple(shape), {"split_dim": dim, "concat_dim": other, "cluster_axis": axis}
    if op == "all_reduce":
        return tuple(shape), {"cluster_axis": axis}
    sender = draw(st.sampled_from(grid(spec)))
    if op == "broadcast":
        return tuple(shape), {"sender": sender}
    return tuple(shape), {"sender": sender, "receiver": draw(st.sampled_from(grid(spec)))}


def test_bfp8_round_is_the_kernels_rounding() -> None:
    # The test's reference packer (tests/reference.py) and ttflow's kernels agree, and blocks
    # are 16 aligned columns of a tile row: a large value changes only its own block.
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((3, 40, 72)) * 10).astype(np.float32)
    np.testing.assert_array_equal(bfp8_round(a), store_as(a, BF8))
    b = a.copy()
    b[0, 5, 17] = 1e6
    changed = np.argwhere(bfp8_round(b) != bfp8_round(a))
    assert {(int(i), int(j), int(k) // 16) for i, j, k in changed} == {(0, 5, 1)}


@given(meshes, st.sampled_from(OPS), st.data())
def test_bfloat8_b_collectives_over_links_with_threads(spec: tt.MeshSpec, op: str, data: st.DataObject) -> None:
    shape, attrs = data.draw(bf8_collectives(spec, op), label="shape, attrs")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    xs = {c: host_values(rng, shape, BF8) for c in grid(spec)}
    out, links, _ = run_threads(spec, op, xs, attrs, BF8)
    want, want_links = reference(op, spec, xs, attrs, BF8)
    for c in grid(spec):  # bit for bit: the partial sums packed as they cross
        np.testing.assert_array_equal(out[c], want[c])
    assert links == {k: v for k, v in want_links.items() if v}  # packed tiles, 1088 bytes each


def test_a_t3000s_ring_and_the_formulas() -> None:
    # The 2x4 T3000 as one group: its zigzag 0 1 2 3 7 6 5 4 closes (4 is linked to 0), a ring
    # of 8; a ring all_gather moves 7/8 of the gathered tensor over each of its 8 links, one way.
    spec = tt.MeshSpec.t3000()
    xs = {c: np.full((32, 32), 1 + c[0] * 4 + c[1], np.float32) for c in grid(spec)}
    out, links, log = run_threads(spec, "all_gather", xs, {"dim": 0, "cluster_axis": None}, F32)
    gathered = 8 * 32 * 32 * 4
    ring = [(0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (1, 2), (1, 1), (1, 0)]
    assert links == {(a, b): gathered * 7 // 8 for a, b in zip(ring, ring[1:] + ring[:1])}
    assert [record.topology for record in log] == ["ring"]
    out, links, _ = run_threads(spec, "all_reduce", xs, {"cluster_axis": None}, F32)
    assert links == {(a, b): 2 * 7 * 32 * 32 * 4 // 8 for a, b in zip(ring, ring[1:] + ring[:1])}
    assert all(np.all(out[c] == 36) for c in grid(spec))
    # Along a row of four (cluster_axis=1): a line, both ways.
    out, links, _ = run_threads(spec, "all_gather", xs, {"dim": 0, "cluster_axis": 1}, F32)
    shard = 32 * 32 * 4
    assert links[(0, 0), (0, 1)] == shard and links[(0, 1), (0, 0)] == 3 * shard
    assert sum(links.values()) == 2 * 3 * 4 * shard  # (N-1) T per group, two groups


def test_an_abort_ends_every_wait_and_a_timeout_is_typed() -> None:
    import time


    fabric = Fabric((1, 3), range(3), lambda a, b: abs(a - b) == 1, {})
    for timeout, abort in ((30.0, True), (0.2, False)):
        rendezvous = Rendezvous(fabric, "abort", timeout=timeout)
        out: dict[Coord, object] = {}

        def chip(coord: Coord, r: Rendezvous = rendezvous, out: dict = out) -> None:
            try:
                out[coord] = r.peer(coord).collective(0, "all_reduce", np.ones(4, np.float32), {"cluster_axis": None}, F32)
            except tt.CollectiveError as exc:
                out[coord] = exc

        threads = [threading.Thread(target=chip, args=((0, k),)) for k in (0, 1)]  # (0, 2) never comes
        start = time.monotonic()
        for t in threads:
            t.start()
        if abort:
            time.sleep(0.1)
            rendezvous.peer((0, 2)).abort(tt.OutOfMemoryError("L1", 64, 0))
        for t in threads:
            t.join()
        assert time.monotonic() - start < 5
        errors = [out[(0, k)] for k in (0, 1)]
        assert all(isinstance(e, tt.CollectiveError) and e.collective == "all_reduce" for e in errors)
        if abort:
            assert all(e.chip == (0, 2) and "chip (0, 2) failed first: OutOfMemoryError" in str(e) for e in errors)
        else:  # the first to time out aborts the rendezvous: the other fails at once, naming it
            assert any(e.chip is None and "did not come within 0.2 s" in str(e) for e in errors)


@pytest.mark.parametrize(("op", "n", "nbytes", "want_us"), [
    ("all_gather", 8, 1 << 20, 4.47 + 1.91 * 7 + 7 * (1 << 20) / 11.8e9 * 1e6),
    ("reduce_scatter", 4, 1 << 20, 3.23 + 3.97 * 3 + 3 / 4 * (1 << 20) / 11.1e9 * 1e6),
    ("all_reduce", 2, 1 << 16, 9.07 + 5.82 + (1 << 16) / 10.9e9 * 1e6),
    ("all_gather", 1, 1 << 20, 0.0),
])
def test_the_timing_model_is_tt_metals_fits(op: str, n: int, nbytes: int, want_us: float) -> None:
    from ttflow._mesh.collectives import modelled_seconds

    got = modelled_seconds(op, n, nbytes, n - 1, 0, 12.5e9, 711e-9)
    assert got * 1e6 == pytest.approx(want_us, rel=1e-12)
    # No published fit: hops * hop latency + the busiest link's bytes at 96% of the link rate.
    assert modelled_seconds("point_to_point", 4, 4096, 3, 4096, 12.5e9, 711e-9) == pytest.approx(
        3 * 711e-9 + 4096 / (0.96 * 12.5e9))


@pytest.mark.parametrize("links", [1, 2, 4])  # n300's collectives, T3000, Galaxy
@pytest.mark.parametrize(("op", "fixed_us", "per_chip_us", "gbps", "factor"), [
    ("all_gather", 4.47, 1.91, 11.8, lambda n: n - 1),
    ("reduce_scatter", 3.23, 3.97, 11.1, lambda n: (n - 1) / n),
    ("all_reduce", 9.07, 5.82, 10.9, lambda n: 2 * (n - 1) / n),
])
def test_the_payload_is_split_across_a_pairs_links(links: int, op: str, fixed_us: float, per_chip_us: float,
                                                    gbps: float, factor: Any) -> None:
    from ttflow._mesh.collectives import modelled_seconds

    for n, nbytes, rate in ((2, 1 << 16, 12.5e9), (8, 1 << 20, 12.5e9), (4, 3 << 18, 25e9)):
        want_us = fixed_us + per_chip_us * (n - 1) + factor(n) * nbytes / (gbps * 1e9 * rate / 12.5e9 * links) * 1e6
        got = modelled_seconds(op, n, nbytes, n - 1, 0, rate, 711e-9, links)
        assert got * 1e6 == pytest.approx(want_us, rel=1e-12)
    # No fit: the hops' latency plus the busiest pair's bytes over its links at 96% of the rate.
    assert modelled_seconds("broadcast", 8, 4096, 7, 8192, 12.5e9, 711e-9, links) == pytest.approx(
        7 * 711e-9 + 8192 / (0.96 * 12.5e9 * links), rel=1e-12)


@pytest.mark.parametrize("links", [1, 2, 4])
async def test_a_mesh_times_its_collectives_with_its_links_per_pair(links: int) -> None:
    # The same all_gather and point_to_point on 1x4 lines whose pairs have 1, 2 or 4 links: the
    # bytes per pair are the same (the sum over its links), the modelled payload time 1/links.
    from ttflow._mesh.collectives import collective_log

    spec = tt.MeshSpec((1, 4), chip=SMALL, links_per_pair=links)
    b = tt.ProgramBuilder("timed")
    v = b.all_gather(b.input((32, 64)), 0)
    b.output(b.point_to_point(v, (0, 0), (0, 3)))
    binary = tt.Binary([b.build()])
    async with tt.open_mesh_device(spec) as mesh:
        x = tt.to_device(np.ones((32, 64), np.float32), mesh)
        with collective_log(mesh).listening() as records:
            (y,) = tt.submit(mesh, binary, 0, [x])
            await y
        links_bytes = {k: v for k, v in mesh.stats.link_bytes.items() if v}
    shard = 32 * 64 * 4
    gather, p2p = sorted(records, key=lambda r: r.step)
    assert gather.op == "all_gather" and p2p.op == "point_to_point"
    assert gather.modelled_seconds * 1e6 == pytest.approx(
        4.47 + 1.91 * 3 + 3 * shard / (11.8e9 * links) * 1e6, rel=1e-12)
    assert p2p.modelled_seconds == pytest.approx(3 * 711e-9 + 4 * shard / (0.96 * 12.5e9 * links), rel=1e-12)
    assert gather.links == p2p.links == links
    # a line all_gather's bytes, plus the gathered value along the route (0,0) -> (0,3)
    want = {((0, p), (0, p + 1)): (p + 1) * shard + 4 * shard for p in range(3)}
    want.update({((0, p + 1), (0, p)): (3 - p) * shard for p in range(3)})
    assert links_bytes == want


# -- SPMD: collectives in programs on meshes, against numpy and the link formulas ---------------------


def mesh_spec(shape: tuple[int, int], ring: bool = False) -> tt.MeshSpec:
    return tt.MeshSpec(shape, chip=SMALL, topology="ring" if ring else "line")


def one_step(op: str, shape: tuple[int, ...], layout: tt.Layout, attrs: dict, out_layout: tt.Layout) -> tt.Binary:
    b = tt.ProgramBuilder(op)
    x = b.input(shape, layout)
    b.output(getattr(b, op)(x, **attrs), out_layout)
    return tt.Binary([b.build()])


def link_delta(before: Links, after: Links) -> Links:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


async def run_on_mesh(mesh: tt.MeshDevice, binary: tt.Binary, xs: dict[Coord, np.ndarray],
                      layout: tt.Layout) -> dict[Coord, np.ndarray]:
    """The program on every chip, chip c's input xs[c]; each chip's output."""
    host = {c: x.astype(layout.dtype.host_dtype) for c, x in xs.items()}
    shards = [tt.to_device(host[c], chip, layout) for c, chip in zip(mesh.coords, mesh.chips)]
    (out,) = tt.submit(mesh, binary, 0, [tt.from_shards(shards, mesh)])
    return {c: await tt.to_host(t) for c, t in zip(mesh.coords, tt.device_tensors(out))}


layouts = st.builds(lambda memory, tensor_layout: (memory, tensor_layout),
                    st.sampled_from([DRAM, L1]), st.sampled_from([TILE, RM]))


@given(st.sampled_from([(1, 2), (1, 3), (2, 2), (2, 4)]), st.booleans(), st.sampled_from(OPS), dtypes,
       layouts, layouts, st.data())
async def test_every_collective_on_a_mesh_against_numpy(
        shape: tuple[int, int], ring: bool, op: str, dtype: tt.DataType, lay_in: tuple, lay_out: tuple,
        data: st.DataObject) -> None:
    spec = mesh_spec(shape, ring)
    in_shape, attrs = data.draw(collectives(spec, op), label="shape, attrs")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    xs = {c: host_values(rng, in_shape, dtype) for c in grid(spec)}
    layout, out_layout = tt.Layout(*lay_in, dtype), tt.Layout(*lay_out)
    want, want_links = reference(op, spec, xs, attrs, dtype)
    async with tt.open_mesh_device(spec) as mesh:
        before = mesh.stats.link_bytes
        got = await run_on_mesh(mesh, one_step(op, in_shape, layout, attrs, out_layout), xs, layout)
        links = link_delta(before, mesh.stats.link_bytes)
    for c in grid(spec):  # bit for bit: each chip's result as the documented algorithm gives it
        np.testing.assert_array_equal(got[c].astype(np.float64), want[c].astype(np.float64))
    assert links == {k: v for k, v in want_links.items() if v}  # host traffic never counts


@given(st.sampled_from([(1, 2), (1, 3), (2, 2), (2, 4)]), st.booleans(), st.sampled_from(OPS),
       st.sampled_from([DRAM, L1]), st.sampled_from([DRAM, L1]), st.data())
async def test_bfloat8_b_collectives_on_a_mesh_against_numpy(
        shape: tuple[int, int], ring: bool, op: str, space_in: tt.MemorySpace, space_out: tt.MemorySpace,
        data: st.DataObject) -> None:
    spec = mesh_spec(shape, ring)
    in_shape, attrs = data.draw(bf8_collectives(spec, op), label="shape, attrs")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    xs = {c: host_values(rng, in_shape, BF8) for c in grid(spec)}
    layout, out_layout = tt.Layout(space_in, TILE, BF8), tt.Layout(space_out, TILE, BF8)
    want, want_links = reference(op, spec, xs, attrs, BF8)
    async with tt.open_mesh_device(spec) as mesh:
        before = mesh.stats.link_bytes
        got = await run_on_mesh(mesh, one_step(op, in_shape, layout, attrs, out_layout), xs, layout)
        links = link_delta(before, mesh.stats.link_bytes)
    for c in grid(spec):
        np.testing.assert_array_equal(got[c], want[c])
    assert links == {k: v for k, v in want_links.items() if v}


async def test_bfloat8_b_shapes_that_split_tiles_are_refused_at_submit() -> None:
    b = tt.ProgramBuilder("gather")  # built for a group of one: resolved, and refused, at submit
    b.output(b.all_gather(b.input((32, 48), tt.Layout(tensor_layout=TILE, dtype=BF8)), 1))
    binary = tt.Binary([b.build()])
    async with tt.open_mesh_device(mesh_spec((1, 2))) as mesh:
        x = tt.to_device(np.ones((32, 48), np.float32), mesh, tt.Layout(tensor_layout=TILE, dtype=BF8))
        with pytest.raises(tt.ShapeError, match="does not fit a 1x2 mesh: all_gather: a BFLOAT8_B value"):
            tt.submit(mesh, binary, 0, [x])
        assert all(len(chip._cq0) == 0 for chip in mesh.chips)
        (y,) = tt.submit(mesh.chips[0], binary, 0, [tt.device_tensors(x)[0]])  # a group of one: fine
        np.testing.assert_array_equal(await tt.to_host(y), np.ones((32, 48), np.float32))


async def test_a_one_chip_mesh_is_a_group_of_one() -> None:
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    async with tt.open_mesh_device(mesh_spec((1, 1))) as mesh:
        b = tt.ProgramBuilder("alone")
        v = b.input((8, 8))
        b.output(b.all_reduce(b.all_gather(v, 0)))
        (out,) = tt.submit(mesh, tt.Binary([b.build()]), 0, [tt.to_device(x, mesh)])
        np.testing.assert_array_equal(await tt.to_host(out), np.concatenate([x]))
        assert not any(mesh.stats.link_bytes.values())


async def test_chained_collectives_and_cluster_axes_on_a_t3000() -> None:
    # A program mixing groups: rows (cluster_axis=1), columns (0), every chip; its shapes are
    # resolved for the 2x4 mesh at submit (the program was built for a group of one).
    spec = tt.MeshSpec((2, 4), chip=SMALL)
    rng = np.random.default_rng(7)
    xs = {c: host_values(rng, (4, 8), F32) for c in grid(spec)}
    b = tt.ProgramBuilder("mixed")
    v = b.input((4, 8))
    g = b.all_gather(v, 1, cluster_axis=1)  # (4, 32): a row's four shards
    r = b.all_reduce(b.relu(g), cluster_axis=0)  # the two rows' sum
    b.output(b.reduce_scatter(r, 0))  # 4 rows cannot split over 8 chips: refused at submit
    with pytest.raises(tt.ShapeError, match="does not fit a 2x4 mesh: reduce_scatter"):
        async with tt.open_mesh_device(spec) as mesh:
            await run_on_mesh(mesh, tt.Binary([b.build()]), xs, tt.Layout(dtype=F32))
    b = tt.ProgramBuilder("mixed")
    v = b.input((4, 8))
    g = b.all_gather(v, 1, cluster_axis=1)
    r = b.all_reduce(b.relu(g), cluster_axis=0)
    b.output(b.reduce_scatter(r, 1))
    async with tt.open_mesh_device(spec) as mesh:
        got = await run_on_mesh(mesh, tt.Binary([b.build()]), xs, tt.Layout(dtype=F32))
    rows = {row: np.concatenate([xs[(row, c)] for c in range(4)], axis=1) for row in range(2)}
    total = np.maximum(rows[0], 0) + np.maximum(rows[1], 0)  # two terms: exact in any order
    parts = np.split(total * 8, 8, axis=1)  # reduce_scatter sums 8 equal copies
    for k, c in enumerate(grid(spec)):
        near_sum(got[c], [np.split(total, 8, axis=1)[k]] * 8, F32)
        np.testing.assert_allclose(got[c], parts[k], rtol=1e-6)


# -- faults: a failing chip, a closing mesh, a cancelled block; nothing hangs ---------------------------

def used(mesh: tt.MeshDevice) -> list[tuple[int, int]]:
    return [(chip.memory_used(DRAM), chip.memory_used(L1)) for chip in mesh.chips]


def overflowing(op: str = "all_reduce") -> tt.Binary:
    """x + x, range-checked, then a collective: a chip whose x is near 2**31 fails before it."""
    b = tt.ProgramBuilder("overflow")
    x = b.input((4, 32), tt.Layout(dtype=I32))
    with b.checking_range("chip overflow"):
        y = b.add(x, x)
    b.output(b.all_reduce(y) if op == "all_reduce" else b.all_gather(y, 0))
    return tt.Binary([b.build()])


async def outcomes(tensor: tt.MeshTensor) -> list[BaseException | np.ndarray]:
    got: list[BaseException | np.ndarray] = []
    for shard in tt.device_tensors(tensor):
        try:
            got.append(await tt.to_host(shard))
        except tt.TTFlowError as exc:
            got.append(exc)
    return got


@pytest.mark.parametrize("shape", [(1, 2), (2, 4)])
async def test_a_chip_failing_before_its_collective_fails_every_chip_typed(shape: tuple[int, int]) -> None:
    spec = mesh_spec(shape)
    bad = (0, 1)
    async with tt.open_mesh_device(spec) as mesh:
        empty = used(mesh)
        start = anyio.current_time()
        for op in ("all_reduce", "all_gather"):
            shards = [tt.to_device(np.full((4, 32), 2**30 + 5 if c == bad else k, np.int32), chip)
                      for k, (c, chip) in enumerate(zip(mesh.coords, mesh.chips))]
            x = tt.from_shards(shards, mesh)
            (out,) = tt.submit(mesh, overflowing(op), 0, [x])
            got = await outcomes(out)
            for c, result in zip(mesh.coords, got):
                if c == bad:  # its own error, raised by its run
                    assert isinstance(result, tt.ProgramError) and "chip overflow" in str(result)
                else:  # its peers: typed, naming the chip that failed and the collective
                    assert isinstance(result, tt.CollectiveError), result
                    assert result.chip == bad and result.collective == op
                    assert f"chip {bad} failed first: ProgramError: chip overflow" in str(result)
            # Every chip's command failing *before it runs* (its input failed): each fails with
            # its input's error, and the submit's rendezvous is aborted (nobody waits).
            b = tt.ProgramBuilder("after")
            b.output(b.all_reduce(b.input(out.shape, tt.Layout(dtype=I32))))
            (again,) = tt.submit(mesh, tt.Binary([b.build()]), 0, [out])
            assert [type(r) for r in await outcomes(again)] == [type(r) for r in got]
            for t in (x, out, again):
                tt.deallocate(t)
        assert anyio.current_time() - start < 20  # nothing waited for the timeout (600 s)
        await mesh.synchronize()
        assert used(mesh) == empty  # nothing held
        # The mesh still works.
        ok = tt.from_shards([tt.to_device(np.full((4, 32), k, np.int32), chip) for k, chip in enumerate(mesh.chips)], mesh)
        (out,) = tt.submit(mesh, overflowing(), 0, [ok])
        n = mesh.num_chips
        assert all(np.array_equal(r, np.full((4, 32), n * (n - 1))) for r in await outcomes(out))


async def test_a_deallocated_shard_is_refused_before_any_chip_queues() -> None:
    async with tt.open_mesh_device(mesh_spec((1, 3))) as mesh:
        shards = [tt.to_device(np.ones((4, 32), np.int32), chip) for chip in mesh.chips]
        x = tt.from_shards(shards, mesh)
        tt.deallocate(shards[1])
        with pytest.raises(tt.DeallocatedTensorError):
            tt.submit(mesh, overflowing(), 0, [x])
        assert all(len(chip._cq0) == 0 for chip in mesh.chips)


async def test_closing_drains_queued_collectives() -> None:
    async with tt.open_mesh_device(mesh_spec((2, 2))) as mesh:
        x = tt.from_shards([tt.to_device(np.full((4, 32), k, np.int32), chip) for k, chip in enumerate(mesh.chips)],
                           mesh)
        outs = [tt.submit(mesh, overflowing(), 0, [x])[0] for _ in range(6)]
        assert not all(o.done() for o in outs)
    assert all(o.done() for o in outs) and used(mesh) == [(0, 0)] * 4
    assert mesh.stats.total.programs_run == 24


async def test_closing_on_an_error_fails_queued_collectives_typed() -> None:
    outs: list[tt.MeshTensor] = []
    with pytest.raises(RuntimeError, match="the host's own error"):
        async with tt.open_mesh_device(mesh_spec((1, 4))) as mesh:
            x = tt.from_shards([tt.to_device(np.full((4, 32), k, np.int32), chip)
                                for k, chip in enumerate(mesh.chips)], mesh)
            outs = [tt.submit(mesh, overflowing(), 0, [tt.to_layout(x, tt.Layout(L1, TILE))])[0]
                    for _ in range(8)]
            raise RuntimeError("the host's own error")
    assert used(mesh) == [(0, 0)] * 4
    for out in outs:
        for shard in tt.device_tensors(out):
            assert shard.done()
            try:
                await shard
            except (tt.DeviceClosedError, tt.CollectiveError):
                pass


async def test_cancelling_the_block_mid_collective_leaves_no_chip_hung() -> None:
    # Chip 0's collective program waits for a write of its input, which waits for a long
    # program still reading that input (write after read); the other chips already wait in the
    # collective when the block is cancelled. Chip 0's program then never runs: the mesh aborts
    # the submit as it closes, and nobody waits for the timeout.
    b = tt.ProgramBuilder("long")
    x, big = b.input((4, 32), tt.Layout(dtype=I32)), b.input((1024, 1024))
    for _ in range(12):
        big = b.matmul(big, big)
    b.output(big)
    b.output(b.add(x, 1))
    long = tt.Binary([b.build()])
    start = anyio.current_time()
    with anyio.CancelScope() as scope:
        async with tt.open_mesh_device(mesh_spec((1, 4))) as mesh:
            shards = [tt.to_device(np.full((4, 32), k, np.int32), chip) for k, chip in enumerate(mesh.chips)]
            busy = tt.submit(mesh.chips[0], long, 0, [shards[0], tt.to_device(np.eye(1024, dtype=np.float32),
                                                                               mesh.chips[0])])
            tt.write(shards[0], np.full((4, 32), 5, np.int32))  # after `long` has read it
            (out,) = tt.submit(mesh, overflowing(), 0, [tt.from_shards(shards, mesh)])
            await anyio.sleep(0.1)
            assert not busy[0].done() and [c._cq0._worker.busy for c in mesh.chips] == [True] * 4
            scope.cancel()
            await anyio.sleep(5)
    assert scope.cancelled_caught and anyio.current_time() - start < 5
    assert used(mesh) == [(0, 0)] * 4
    for shard in tt.device_tensors(out):
        assert shard.done()
        with pytest.raises((tt.DeviceClosedError, tt.CollectiveError)):
            await shard


# -- the tensor-parallel MLP (Megatron): column-parallel, then row-parallel with one all_reduce ---------


def mlp(n_chips: int, dtype: tt.DataType, rows: int = 32, d: int = 64, hidden: int = 256) -> tt.Binary:
    """Y = act(X A) B with A split by columns and B by rows over `n_chips`: each chip computes
    its slice of the hidden layer and a partial Y; one all_reduce sums the partials."""
    act = "gelu" if dtype.is_float else "relu"
    b = tt.ProgramBuilder(f"mlp/{n_chips}")
    x = b.input((rows, d), tt.Layout(dtype=dtype))
    a = b.input((d, hidden // n_chips), tt.Layout(dtype=dtype))
    w = b.input((hidden // n_chips, d), tt.Layout(dtype=dtype))
    h = getattr(b, act)(b.matmul(x, a))
    b.output(b.all_reduce(b.matmul(h, w)))
    return tt.Binary([b.build()])


@pytest.mark.parametrize("preset", ["n300", "t3000"])
@pytest.mark.parametrize("dtype", [F32, I32])
async def test_the_tensor_parallel_mlp_equals_one_chip_and_numpy(preset: str, dtype: tt.DataType) -> None:
    import attrs

    spec = attrs.evolve(getattr(tt.MeshSpec, preset)(), chip=SMALL)
    n = spec.num_chips
    rng = np.random.default_rng(11)
    if dtype is I32:
        x, a, w = (rng.integers(-3, 4, s).astype(np.int32) for s in ((32, 64), (64, 256), (256, 64)))
        want = np.maximum(x.astype(np.int64) @ a, 0) @ w
    else:
        x, a, w = (rng.standard_normal(s).astype(np.float32) / 8 for s in ((32, 64), (64, 256), (256, 64)))
        h64 = x.astype(np.float64) @ a
        want = (0.5 * h64 * (1 + np.vectorize(math.erf)(h64 / np.sqrt(2)))) @ w
    async with tt.open_device(SMALL) as device:  # one chip: the same program, the whole hidden layer
        (one,) = tt.submit(device, mlp(1, dtype), 0, [tt.to_device(v, device) for v in (x, a, w)])
        one_chip = await tt.to_host(one)
    async with tt.open_mesh_device(spec) as mesh:
        inputs = [tt.to_device(x, mesh, mapper=tt.replicate()), tt.to_device(a, mesh, mapper=tt.shard(1)),
                  tt.to_device(w, mesh, mapper=tt.shard(0))]
        (y,) = tt.submit(mesh, mlp(n, dtype), 0, inputs)
        per_chip = [await tt.to_host(t) for t in tt.device_tensors(y)]
        links = {k: v for k, v in mesh.stats.link_bytes.items() if v}
    assert all(np.array_equal(p, per_chip[0]) for p in per_chip)  # every chip the same bits
    got = per_chip[0]
    if dtype is I32:  # integer sums: exact in any order, equal to numpy and to one chip
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(one_chip, want)
    else:  # a float sum split N ways: within float32's rounding of the hidden dim's products
        scale = np.abs(x) @ np.abs(a)
        bound = 256 * 2.0**-23 * ((np.abs(scale) + 1) @ np.abs(w)) + 1e-6
        assert np.all(np.abs(got - want) <= bound) and np.all(np.abs(one_chip - want) <= bound)
        np.testing.assert_allclose(got, one_chip, rtol=1e-4, atol=1e-5)
    # One all_reduce of a (32, 64) partial over the group's ring (T3000) or its one link pair.
    tensor = 32 * 64 * 4
    if n == 2:
        assert links == {((0, 0), (0, 1)): tensor, ((0, 1), (0, 0)): tensor}  # a line: T each way
    else:
        assert len(links) == 8 and set(links.values()) == {2 * 7 * tensor // 8}


async def test_the_timeline_draws_link_tracks_timed_by_the_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    spec = mesh_spec((1, 4))
    b = tt.ProgramBuilder("gather")
    b.output(b.all_gather(b.input((32, 64)), 0))
    binary = tt.Binary([b.build()])
    async with tt.open_mesh_device(spec) as mesh:
        t = tt.to_device(np.ones((32, 64), np.float32), mesh, mapper=tt.replicate())
        (warm,) = tt.submit(mesh, binary, 0, [t])  # before the recording: not drawn
        await warm
        with tt.record_timeline(mesh) as recording:
            (out,) = tt.submit(mesh, binary, 0, [t])
            await out
        recording.save(tmp_path / "mesh.json")
    events = json.loads((tmp_path / "mesh.json").read_text())["traceEvents"]
    links = [e for e in events if e.get("pid") == 5]
    names = {e["args"]["name"] for e in links if e["ph"] == "M"}
    assert names == {"ttflow 1x4 links"} | {f"link chip {a} -> chip {b}" for a, b in
                                            [(0, 1), (1, 0), (1, 2), (2, 1), (2, 3), (3, 2)]}
    slices = [e for e in links if e["ph"] == "X"]
    shard = 32 * 64 * 4
    assert len(slices) == 6 and {e["name"] for e in slices} == {"all_gather"}
    assert sorted(e["args"]["bytes"] for e in slices) == sorted([shard, 3 * shard, 2 * shard, 2 * shard, 3 * shard, shard])
    want_us = 4.47 + 1.91 * 3 + 3 * shard / 11.8e9 * 1e6  # tt-metal's line all_gather fit
    assert all(e["dur"] == pytest.approx(want_us, abs=1e-3) for e in slices)
    assert all(set(e["args"]["waited_us"]) == {str((0, k)) for k in range(4)} for e in slices)


async def test_a_mesh_trace_captures_collectives_and_replays_them() -> None:
    # Once refused (TraceError); now captured and replayed with a fresh rendezvous per execute
    # (tests/test_mesh_traces.py has the chains, the faults and the link bytes per replay).
    async with tt.open_mesh_device(mesh_spec((1, 2))) as mesh:
        x = tt.to_device(np.ones((4, 32), np.int32), mesh, mapper=tt.replicate())
        with tt.capture_trace(mesh) as trace:
            (out,) = tt.submit(mesh, overflowing(), 0, [x])
        assert all(np.array_equal(r, np.full((4, 32), 4)) for r in await outcomes(out))
        before = sum(mesh.stats.link_bytes.values())
        for k in range(2, 5):
            tt.write(x, np.full((4, 32), k, np.int32))
            tt.execute_trace(trace)
            assert all(np.array_equal(r, np.full((4, 32), 4 * k)) for r in await outcomes(out))
        # a 2-chip line all_reduce: the whole 4x32 int32 value each way, per replay
        assert sum(mesh.stats.link_bytes.values()) - before == 3 * 2 * 4 * 32 * 4
        tt.release_trace(trace)
