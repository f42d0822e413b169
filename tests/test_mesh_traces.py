"""Mesh traces of programs with collectives (issue 26): a capture records each chip's programs,
and every `tt.execute_trace` gives the chips' replays a fresh rendezvous per captured submit.

Each replay is compared with an independent reference: numpy's result of each collective in
its documented order (`test_collectives.reference`, which shares no code with `_mesh`), the
captured run and a plain submit of the same programs (bit for bit), and the bytes each link
carries by the formulas of docs/mesh.md, counted again on every replay.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import numpy as np
import pytest
from test_collectives import (
    F32,
    I32,
    SMALL,
    Coord,
    Links,
    grid,
    host_values,
    link_delta,
    mesh_spec,
    outcomes,
    overflowing,
    reference,
    used,
)

import ttflow as tt

pytestmark = pytest.mark.anyio

LIMIT = 60  # seconds a test may take: a hang is a failure, never a stuck run


SHORT_TIMEOUT = 20.0  # a chip that never meets its group fails typed after 20 s (the last resort is 600 s)


# -- a chain of programs with collectives: captured once, replayed with new inputs ---------------------

ROWS, COLS = 8, 32  # one chip's shard of x


def chain(dtype: tt.DataType) -> tt.Binary:
    """Four programs, each with a collective at step 0 (one step index in several programs, so
    their rendezvous must not mix): relu(all_gather(x, 0)); all_reduce; reduce_scatter(., 1);
    broadcast from (0, 0), then point_to_point (0, 0) -> (0, 1), then all_to_all(., 0, 1)."""
    lay = tt.Layout(dtype=dtype)
    b = tt.ProgramBuilder("gather")
    b.output(b.relu(b.all_gather(b.input((ROWS, COLS), lay), 0)), lay)
    gather = b.build()
    b = tt.ProgramBuilder("reduce")
    b.output(b.all_reduce(b.input((4 * ROWS, COLS), lay)), lay)
    reduce = b.build()
    b = tt.ProgramBuilder("scatter")
    b.output(b.reduce_scatter(b.input((4 * ROWS, COLS), lay), 1), lay)
    scatter = b.build()
    b = tt.ProgramBuilder("routes")
    v = b.broadcast(b.input((4 * ROWS, COLS // 4), lay), (0, 0))
    v = b.point_to_point(v, (0, 0), (0, 1))
    b.output(b.all_to_all(v, 0, 1), lay)
    routes = b.build()
    return tt.Binary([gather, reduce, scatter, routes])


def expected(spec: tt.MeshSpec, xs: dict[Coord, np.ndarray], dtype: tt.DataType) -> tuple[list[dict], Links]:
    """Each program's output on every chip, from numpy (`reference`, step by step), and the
    bytes each directed link carries over the whole chain."""
    links: Links = {}

    def step(op: str, values: dict, attrs: dict) -> dict:
        out, carried = reference(op, spec, values, attrs, dtype)
        for pair, nbytes in carried.items():
            links[pair] = links.get(pair, 0) + nbytes
        return out

    gathered = {c: np.maximum(v, 0) for c, v in step("all_gather", xs, {"dim": 0, "cluster_axis": None}).items()}
    reduced = step("all_reduce", gathered, {"cluster_axis": None})
    scattered = step("reduce_scatter", reduced, {"dim": 1, "cluster_axis": None})
    routed = step("broadcast", scattered, {"sender": (0, 0)})
    routed = step("point_to_point", routed, {"sender": (0, 0), "receiver": (0, 1)})
    routed = step("all_to_all", routed, {"split_dim": 0, "concat_dim": 1, "cluster_axis": None})
    return [gathered, reduced, scattered, routed], links


def submit_chain(mesh: tt.MeshDevice, binary: tt.Binary, x: tt.MeshTensor) -> list[tt.MeshTensor]:
    outs: list[tt.MeshTensor] = []
    for index in range(len(binary.programs)):
        (y,) = tt.submit(mesh, binary, index, [outs[-1] if outs else x])
        outs.append(y)
    return outs


async def per_chip(tensors: list[tt.MeshTensor]) -> list[list[np.ndarray]]:
    return [[await tt.to_host(s) for s in tt.device_tensors(t)] for t in tensors]


def assert_chain(got: list[list[np.ndarray]], want: list[dict], coords: list[Coord]) -> None:
    for program, (values, ref) in enumerate(zip(got, want)):
        for c, value in zip(coords, values):
            np.testing.assert_array_equal(value, ref[c].astype(value.dtype), err_msg=f"program {program} chip {c}")


def shards(rng: np.random.Generator, spec: tt.MeshSpec, dtype: tt.DataType) -> dict[Coord, np.ndarray]:
    return {c: host_values(rng, (ROWS, COLS), dtype).astype(dtype.host_dtype) for c in grid(spec)}


SPECS = {"2x2": ((2, 2), False), "1x4 ring": ((1, 4), True), "1x4 line": ((1, 4), False)}


@pytest.mark.parametrize("dtype", [F32, I32], ids=["f32", "i32"])
@pytest.mark.parametrize("name", list(SPECS))
async def test_replays_equal_numpy_a_submit_and_the_capture_and_count_their_bytes(name: str, dtype: tt.DataType) -> None:
    spec = mesh_spec(*SPECS[name])
    binary = chain(dtype)
    rng = np.random.default_rng(5)
    with anyio.fail_after(LIMIT):
        async with tt.open_mesh_device(spec, collective_timeout=SHORT_TIMEOUT) as mesh:
            xs = shards(rng, spec, dtype)
            x = tt.from_shards([tt.to_device(xs[c], chip) for c, chip in zip(mesh.coords, mesh.chips)], mesh)
            before = mesh.stats.link_bytes
            with tt.capture_trace(mesh) as trace:
                outs = submit_chain(mesh, binary, x)
            captured = await per_chip(outs)
            assert trace.programs == ("gather", "reduce", "scatter", "routes")
            want, want_links = expected(spec, xs, dtype)
            assert_chain(captured, want, mesh.coords)  # the captured run is a run
            assert link_delta(before, mesh.stats.link_bytes) == {k: v for k, v in want_links.items() if v}
            for replay in range(3):  # as ttnn users do: write the inputs, execute the trace, read
                xs = shards(rng, spec, dtype)
                tt.write(x, [xs[c] for c in mesh.coords])
                before = mesh.stats.link_bytes
                tt.execute_trace(trace)
                got = await per_chip(outs)
                assert link_delta(before, mesh.stats.link_bytes) == {k: v for k, v in want_links.items() if v}
                want, _ = expected(spec, xs, dtype)
                assert_chain(got, want, mesh.coords)
                plain = await per_chip(submit_chain(mesh, binary, x))  # a plain submit: the same bits
                for a, b in zip(got, plain):
                    for u, v in zip(a, b):
                        np.testing.assert_array_equal(u, v)
            # Several executes queued back to back, each after its write: the last one's value.
            for _ in range(4):
                xs = shards(rng, spec, dtype)
                tt.write(x, [xs[c] for c in mesh.coords])
                tt.execute_trace(trace)
            before_total = sum(mesh.stats.link_bytes.values())
            assert_chain(await per_chip(outs), expected(spec, xs, dtype)[0], mesh.coords)
            tt.release_trace(trace)
            await mesh.synchronize()
            assert mesh.stats.total.trace_replays == 7 * mesh.num_chips
            assert before_total <= sum(mesh.stats.link_bytes.values())


async def test_queued_replays_count_bytes_once_each() -> None:
    # Eight executes queued at once (no read between): the links carry eight times the formula.
    spec = mesh_spec((2, 2))
    binary = chain(F32)
    with anyio.fail_after(LIMIT):
        async with tt.open_mesh_device(spec, collective_timeout=SHORT_TIMEOUT) as mesh:
            xs = shards(np.random.default_rng(1), spec, F32)
            x = tt.from_shards([tt.to_device(xs[c], chip) for c, chip in zip(mesh.coords, mesh.chips)], mesh)
            with tt.capture_trace(mesh) as trace:
                outs = submit_chain(mesh, binary, x)
            await mesh.synchronize()
            before = mesh.stats.link_bytes
            for _ in range(8):
                tt.execute_trace(trace)
            await mesh.synchronize()
            _, want_links = expected(spec, xs, F32)
            assert link_delta(before, mesh.stats.link_bytes) == {k: 8 * v for k, v in want_links.items() if v}
            assert_chain(await per_chip(outs), expected(spec, xs, F32)[0], mesh.coords)


async def test_the_timeline_draws_the_links_of_replays(tmp_path: Any) -> None:
    spec = tt.MeshSpec((1, 4), chip=SMALL, topology="ring", links_per_pair=2)
    binary = chain(F32)
    with anyio.fail_after(LIMIT):
        async with tt.open_mesh_device(spec, collective_timeout=SHORT_TIMEOUT) as mesh:
            xs = shards(np.random.default_rng(2), spec, F32)
            x = tt.from_shards([tt.to_device(xs[c], chip) for c, chip in zip(mesh.coords, mesh.chips)], mesh)
            with tt.capture_trace(mesh) as trace:
                submit_chain(mesh, binary, x)
            await mesh.synchronize()
            with tt.record_timeline(mesh) as recording:
                before = mesh.stats.link_bytes
                tt.execute_trace(trace)
                tt.execute_trace(trace)
                await mesh.synchronize()
                carried = link_delta(before, mesh.stats.link_bytes)
            recording.save(tmp_path / "mesh.json")
    events = json.loads((tmp_path / "mesh.json").read_text())["traceEvents"]
    slices = [e for e in events if e.get("pid") == 5 and e["ph"] == "X"]
    ops = [e["name"] for e in slices]
    # Two replays, each with six collectives: every one drawn, and its bytes are the counters'.
    for op in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast", "point_to_point"):
        assert ops.count(op) % 2 == 0 and ops.count(op) > 0
    assert sum(e["args"]["bytes"] for e in slices) == sum(carried.values())
    # Timed by the model, the payload split across the pair's two links (as the submit's are).
    shard = ROWS * COLS * 4
    for e in slices:
        assert e["args"]["links_per_pair"] == 2
        if e["name"] == "all_gather":
            assert e["dur"] == pytest.approx(4.47 + 1.91 * 3 + 3 * shard / (11.8e9 * 2) * 1e6, abs=1e-3)
    replays = [e for e in events if e.get("pid") == 1 and e.get("name") == "trace_replay"]
    assert len(replays) == 2


async def test_a_bfloat8_b_trace_replays_packed_tiles() -> None:
    # BFLOAT8_B in a trace: an all_reduce (parts of whole tiles, partial sums packed) then an
    # all_gather along rows; each replay bit for bit the reference, its bytes 1088 per tile.
    from test_collectives import BF8

    spec = mesh_spec((1, 4), ring=True)
    lay = tt.Layout(tensor_layout=tt.TensorLayout.TILE, dtype=BF8)
    b = tt.ProgramBuilder("bf8")
    b.output(b.all_gather(b.all_reduce(b.input((32, 40), lay)), 0), lay)
    binary = tt.Binary([b.build()])
    rng = np.random.default_rng(9)
    with anyio.fail_after(LIMIT):
        async with tt.open_mesh_device(spec, collective_timeout=SHORT_TIMEOUT) as mesh:
            xs = {c: host_values(rng, (32, 40), BF8) for c in grid(spec)}
            x = tt.from_shards([tt.to_device(xs[c], chip, lay) for c, chip in zip(mesh.coords, mesh.chips)], mesh)
            with tt.capture_trace(mesh) as trace:
                (y,) = tt.submit(mesh, binary, 0, [x])
            await y
            for _ in range(3):
                xs = {c: host_values(rng, (32, 40), BF8) for c in grid(spec)}
                tt.write(x, [xs[c] for c in mesh.coords])
                before = mesh.stats.link_bytes
                tt.execute_trace(trace)
                got = [await tt.to_host(s) for s in tt.device_tensors(y)]
                reduced, links = reference("all_reduce", spec, xs, {"cluster_axis": None}, BF8)
                gathered, more = reference("all_gather", spec, reduced, {"dim": 0, "cluster_axis": None}, BF8)
                for pair, nbytes in more.items():
                    links[pair] = links.get(pair, 0) + nbytes
                for c, value in zip(mesh.coords, got):
                    np.testing.assert_array_equal(value, gathered[c])
                assert link_delta(before, mesh.stats.link_bytes) == {k: v for k, v in links.items() if v}
                # a 32x40 value is 2 padded tiles: the ring all_reduce's parts are 1, 1, 0, 0 tiles
                assert sum(links.values()) == 1088 * (2 * 2 * 4 - 2 * 2) + 4 * 3 * 2 * 1088


# -- faults ---------------------------------------------------------------------------------------------


async def test_a_chip_failing_inside_a_replay_fails_its_peers_typed_and_the_trace_stays_usable() -> None:
    spec = mesh_spec((2, 2))
    bad = (1, 0)
    with anyio.fail_after(LIMIT):
        async with tt.open_mesh_device(spec, collective_timeout=SHORT_TIMEOUT) as mesh:
            empty = used(mesh)
            ok = [np.full((4, 32), k, np.int32) for k in range(4)]
            x = tt.from_shards([tt.to_device(a, chip) for a, chip in zip(ok, mesh.chips)], mesh)
            with tt.capture_trace(mesh) as trace:
                (out,) = tt.submit(mesh, overflowing(), 0, [x])
            assert all(np.array_equal(r, np.full((4, 32), 12)) for r in await outcomes(out))
            start = anyio.current_time()
            for _ in range(2):
                tt.write(x, [np.full((4, 32), 2**30 + 5 if c == bad else 1, np.int32) for c in mesh.coords])
                tt.execute_trace(trace)
                got = await outcomes(out)
                for c, result in zip(mesh.coords, got):
                    if c == bad:  # its own error, raised by its replay
                        assert isinstance(result, tt.ProgramError) and "chip overflow" in str(result)
                    else:
                        assert isinstance(result, tt.CollectiveError), result
                        assert result.chip == bad and result.collective == "all_reduce"
                        assert f"chip {bad} failed first: ProgramError: chip overflow" in str(result)
                # the trace still replays, with a fresh rendezvous: the failure stayed in its execute
                tt.write(x, [np.full((4, 32), k + 1, np.int32) for k in range(4)])
                tt.execute_trace(trace)
                assert all(np.array_equal(r, np.full((4, 32), 20)) for r in await outcomes(out))
            assert anyio.current_time() - start < 15  # nobody waited for a timeout
            tt.release_trace(trace)
            tt.deallocate(out)
            tt.deallocate(x)
            await mesh.synchronize()
            assert used(mesh) == empty


async def test_a_replay_failing_before_it_runs_releases_its_peers() -> None:
    # Two traces: T1 doubles x, range-checked (no collective); T2 all_reduces T1's output. When
    # chip (0, 1)'s T1 replay fails, its T2 replay fails before it runs (its input's error):
    # the other chips' T2 replays fail typed instead of waiting for it.
    spec = mesh_spec((1, 3))
    bad = (0, 1)
    lay = tt.Layout(dtype=I32)
    b = tt.ProgramBuilder("double")
    v = b.input((4, 32), lay)
    with b.checking_range("chip overflow"):
        b.output(b.add(v, v))
    double = tt.Binary([b.build()])
    b = tt.ProgramBuilder("sum")
    b.output(b.all_reduce(b.input((4, 32), lay)))
    total = tt.Binary([b.build()])
    with anyio.fail_after(LIMIT):
        async with tt.open_mesh_device(spec, collective_timeout=SHORT_TIMEOUT) as mesh:
            x = tt.from_shards([tt.to_device(np.ones((4, 32), np.int32), chip) for chip in mesh.chips], mesh)
            with tt.capture_trace(mesh) as t1:
                (y,) = tt.submit(mesh, double, 0, [x])
            with tt.capture_trace(mesh) as t2:
                (out,) = tt.submit(mesh, total, 0, [y])
            assert all(np.array_equal(r, np.full((4, 32), 6)) for r in await outcomes(out))
            start = anyio.current_time()
            tt.write(x, [np.full((4, 32), 2**30 + 5 if c == bad else 2, np.int32) for c in mesh.coords])
            tt.execute_trace(t1)
            tt.execute_trace(t2)
            got = await outcomes(out)
            for c, result in zip(mesh.coords, got):
                if c == bad:  # its input's error
                    assert isinstance(result, tt.ProgramError) and "chip overflow" in str(result)
                else:
                    assert isinstance(result, tt.CollectiveError), result
                    assert result.chip == bad and result.collective == "all_reduce"
            assert anyio.current_time() - start < 15
            tt.write(x, [np.full((4, 32), 3, np.int32) for _ in mesh.coords])
            tt.execute_trace(t1)
            tt.execute_trace(t2)
            assert all(np.array_equal(r, np.full((4, 32), 18)) for r in await outcomes(out))


async def test_release_then_execute_is_refused_typed_and_queues_nothing() -> None:
    spec = mesh_spec((1, 2))
    async with tt.open_mesh_device(spec, collective_timeout=SHORT_TIMEOUT) as mesh:
        x = tt.to_device(np.ones((4, 32), np.int32), mesh)
        with tt.capture_trace(mesh) as trace:
            tt.submit(mesh, overflowing(), 0, [x])
        await mesh.synchronize()
        # one chip's trace alone would wait for its peers: refused
        with pytest.raises(tt.TraceError, match="execute the mesh trace"):
            tt.execute_trace(trace.traces[0])
        tt.release_trace(trace)
        assert trace.released
        with pytest.raises(tt.TraceError, match="released"):
            tt.execute_trace(trace)
        assert all(len(chip._cq0) == 0 for chip in mesh.chips)
        await mesh.synchronize()
        assert mesh.stats.total.trace_replays == 0


async def test_a_deallocated_input_on_one_chip_refuses_the_execute_on_every_chip() -> None:
    spec = mesh_spec((1, 3))
    async with tt.open_mesh_device(spec, collective_timeout=SHORT_TIMEOUT) as mesh:
        per = [tt.to_device(np.ones((4, 32), np.int32), chip) for chip in mesh.chips]
        x = tt.from_shards(per, mesh)
        with tt.capture_trace(mesh) as trace:
            tt.submit(mesh, overflowing(), 0, [x])
        await mesh.synchronize()
        tt.deallocate(per[2])
        with pytest.raises(tt.TraceError, match="deallocated"):
            tt.execute_trace(trace)
        assert all(len(chip._cq0) == 0 for chip in mesh.chips)  # not chip 0's, not chip 1's


async def test_closing_drains_queued_replays() -> None:
    with anyio.fail_after(LIMIT):
        async with tt.open_mesh_device(mesh_spec((2, 2)), collective_timeout=SHORT_TIMEOUT) as mesh:
            x = tt.from_shards([tt.to_device(np.full((4, 32), k, np.int32), chip)
                                for k, chip in enumerate(mesh.chips)], mesh)
            with tt.capture_trace(mesh) as trace:
                (out,) = tt.submit(mesh, overflowing(), 0, [x])
            for _ in range(6):
                tt.execute_trace(trace)
            tt.release_trace(trace)  # unpinned once its queued replays are done
            assert not out.done()
    assert out.done() and used(mesh) == [(0, 0)] * 4
    assert mesh.stats.total.trace_replays == 24
    assert mesh.stats.total.programs_run == 28


async def test_closing_on_an_error_fails_queued_replays_typed() -> None:
    out = None
    with anyio.fail_after(LIMIT):
        with pytest.raises(RuntimeError, match="the host's own error"):
            async with tt.open_mesh_device(mesh_spec((1, 4)), collective_timeout=SHORT_TIMEOUT) as mesh:
                x = tt.from_shards([tt.to_device(np.full((4, 32), k, np.int32), chip)
                                    for k, chip in enumerate(mesh.chips)], mesh)
                with tt.capture_trace(mesh) as trace:
                    (out,) = tt.submit(mesh, overflowing(), 0, [x])
                for _ in range(8):
                    tt.execute_trace(trace)
                tt.release_trace(trace)
                raise RuntimeError("the host's own error")
    assert used(mesh) == [(0, 0)] * 4
    assert out is not None
    for shard in tt.device_tensors(out):
        assert shard.done()
        try:
            await shard
        except (tt.DeviceClosedError, tt.CollectiveError):
            pass


async def test_a_mesh_trace_without_collectives_replays_inline_as_before() -> None:
    # No collective: the replays carry no peers once decided (they may run inline), and equal numpy.
    async with tt.open_mesh_device(mesh_spec((1, 2)), collective_timeout=SHORT_TIMEOUT) as mesh:
        b = tt.ProgramBuilder("add")
        b.output(b.add(b.input((4, 32)), 1.0))
        x = tt.to_device(np.zeros((4, 32), np.float32), mesh)
        with tt.capture_trace(mesh) as trace:
            (y,) = tt.submit(mesh, tt.Binary([b.build()]), 0, [x])
        for k in range(3):
            tt.write(x, np.full((4, 32), k, np.float32))
            tt.execute_trace(trace)
            for shard in tt.device_tensors(y):
                np.testing.assert_array_equal(await tt.to_host(shard), np.full((4, 32), k + 1, np.float32))
        assert not any(mesh.stats.link_bytes.values())
