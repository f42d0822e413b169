"""Trace capture and replay: replays equal untraced runs byte for byte, and allocate nothing."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ttflow as tt


F32, BF16 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
ROW, TILE = tt.TensorLayout.ROW_MAJOR, tt.TensorLayout.TILE
SHAPE = (32, 64)
LAYOUTS = [tt.Layout(m, t, d) for m in (DRAM, L1) for t in (ROW, TILE) for d in (F32, BF16)]


def _program(name: str, op: str, a: tt.Layout, b: tt.Layout, out: tt.Layout) -> tt.Program:
    builder = tt.ProgramBuilder(name)
    x, y = builder.input(SHAPE, a), builder.input(SHAPE, b)
    value = {"add": lambda: builder.add(x, y), "mul": lambda: builder.mul(x, builder.relu(y)),
             "sub_scaled": lambda: builder.sub(builder.mul(x, 0.5), y)}[op]()
    builder.output(value, out)
    return builder.build()


def _numpy(op: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return {"add": lambda: x + y, "mul": lambda: x * np.maximum(y, 0),
            "sub_scaled": lambda: x * np.float32(0.5) - y}[op]()


programs = st.tuples(
    st.sampled_from(["add", "mul", "sub_scaled"]),
    st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS), st.sampled_from(LAYOUTS),
)
# Each step: a program and which two earlier tensors it reads (0, 1: the slots; 2: weights).
sequences = st.lists(
    st.tuples(programs, st.integers(0, 99), st.integers(0, 99)), min_size=1, max_size=6
)


async def _run(sequence: list[Any], inputs: list[np.ndarray], weights: np.ndarray,
               traced: list[np.ndarray] | None) -> list[list[np.ndarray]]:
    """Runs the sequence once per batch: untraced, or captured on the first and replayed after.

    Returns every produced tensor's value after each batch.
    """
    binary = tt.Binary([_program(f"p{i}", op, a, b, out)
                        for i, ((op, a, b, out), _, _) in enumerate(sequence)])
    results = []
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        w = tt.to_device(weights, device, tt.Layout(L1, TILE))  # an L1 input outside the trace
        slots = [tt.to_device(inputs[0], device), tt.to_device(inputs[0] * 2, device)]
        values: list[tt.Tensor] = []

        def submit_all() -> list[tt.Tensor]:
            produced: list[tt.Tensor] = []
            for i, (_, j, k) in enumerate(sequence):
                pool = [*slots, w, *produced]
                (out,) = tt.submit(device, binary, i, [pool[j % len(pool)], pool[k % len(pool)]])
                produced.append(out)
            return produced

        trace = None
        for batch, x in enumerate(inputs):
            tt.write(slots[0], x)
            tt.write(slots[1], x * 2)
            if traced is None:
                values = submit_all()
            elif trace is None:
                with tt.capture_trace(device) as trace:
                    values = submit_all()
            else:
                tt.execute_trace(trace)
            results.append([await tt.to_host(v) for v in values])
        if trace is not None:
            tt.release_trace(trace)
        del values, w, slots
        assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0
    return results


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=sequences, seed=st.integers(0, 2**32 - 1))
def test_replay_equals_the_untraced_run_byte_for_byte(
    backend: str, sequence: list[Any], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
    weights = rng.standard_normal(SHAPE).astype(np.float32)
    untraced = anyio.run(_run, sequence, inputs, weights, None, backend=backend)
    replayed = anyio.run(_run, sequence, inputs, weights, [], backend=backend)
    for got_batch, want_batch in zip(replayed, untraced):
        for got, want in zip(got_batch, want_batch):
            assert got.dtype == want.dtype
            assert got.tobytes() == want.tobytes()


def _scalar_op(name: str, op: str, scalar: float) -> tt.Program:
    """A one-step program on a 32x32 DRAM tile: `x <op> scalar`."""
    b = tt.ProgramBuilder(name)
    x = b.input((32, 32), tt.Layout(DRAM, TILE, F32))
    b.output(getattr(b, op)(x, scalar), tt.Layout(DRAM, TILE))
    return b.build()


def _chain() -> tt.Binary:
    enc = tt.ProgramBuilder("encoder")
    x = enc.input((32, 64), tt.Layout(DRAM, TILE, F32))
    w = enc.input((64, 64), tt.Layout(L1, TILE, F32))
    enc.output(enc.relu(enc.matmul(x, w)), tt.Layout(L1, TILE))
    head = tt.ProgramBuilder("head")
    h = head.input((32, 64), tt.Layout(L1, TILE, F32))
    w = head.input((64, 32), tt.Layout(L1, TILE, F32))
    head.output(head.matmul(h, w), tt.Layout(DRAM, ROW))
    return tt.Binary([enc.build(), head.build()])


@pytest.mark.anyio
async def test_replay_runs_the_chain_with_new_inputs_and_allocates_nothing() -> None:
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((64, 64)).astype(np.float32)
    w2 = rng.standard_normal((64, 32)).astype(np.float32)
    binary = _chain()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tw1, tw2 = tt.to_device(w1, device), tt.to_device(w2, device)  # DRAM row-major
        slot = tt.empty((32, 64), F32, device, tt.Layout(DRAM, TILE))
        with tt.capture_trace(device) as trace:
            (h,) = tt.submit(device, binary, 0, [slot, tw1])
            (y,) = tt.submit(device, binary, 1, [h, tw2])
        await y
        assert trace.programs == ("encoder", "head")
        used = {space: device.memory_used(space) for space in tt.MemorySpace}
        before = device.stats
        for _ in range(5):
            x = rng.standard_normal((32, 64)).astype(np.float32)
            tt.write(slot, x)
            tt.execute_trace(trace)
            np.testing.assert_allclose(await tt.to_host(y), np.maximum(x @ w1, 0) @ w2, rtol=1e-5, atol=1e-4)
            assert {space: device.memory_used(space) for space in tt.MemorySpace} == used
        after = device.stats
        assert after.programs_run - before.programs_run == 10
        assert after.layout_conversions == before.layout_conversions  # weights converted once
        assert after.evictions == before.evictions  # every decision was made at capture
        # An untraced program in between moves the weights around; the replay still holds.
        (h2,) = tt.submit(device, binary, 0, [slot, tw1])
        x = rng.standard_normal((32, 64)).astype(np.float32)
        tt.write(slot, x)
        tt.execute_trace(trace)
        np.testing.assert_allclose(await tt.to_host(y), np.maximum(x @ w1, 0) @ w2, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(await tt.to_host(h), np.maximum(x @ w1, 0), rtol=1e-5, atol=1e-4)
        tt.release_trace(trace)
        tt.release_trace(trace)  # idempotent
        for t in (tw1, tw2, slot, h, h2, y):
            tt.deallocate(t)
        assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0


@pytest.mark.anyio
async def test_replay_is_ordered_like_a_write_into_its_outputs() -> None:
    binary = tt.Binary([_scalar_op("double", "mul", 2.0)])
    convert = tt.ProgramBuilder("as_row_major")
    convert.output(convert.add(convert.input((32, 32), tt.Layout(DRAM, ROW, F32)), 0.0))
    reader = tt.Binary([convert.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        slot = tt.to_device(np.ones((32, 32), np.float32), device, tt.Layout(DRAM, TILE))
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, binary, 0, [slot])
        (old_copy,) = tt.submit(device, reader, 0, [y])  # queued before the replay: reads 2
        tt.write(slot, np.full((32, 32), 5, np.float32))
        tt.execute_trace(trace)
        (new_copy,) = tt.submit(device, reader, 0, [y])  # its conversion of y is made anew
        assert (await tt.to_host(old_copy) == 2).all()
        assert (await tt.to_host(y) == 10).all()
        assert (await tt.to_host(new_copy) == 10).all()
        assert len(y.storages) == 2  # the replay dropped the old conversion, a new one was made
        tt.release_trace(trace)


@pytest.mark.anyio
async def test_host_transfers_inside_a_capture_raise_and_leak_nothing() -> None:
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        x = tt.to_device(np.ones((4, 32), np.float32), device)
        await x
        used = device.memory_used(DRAM)
        with tt.capture_trace(device) as trace:
            with pytest.raises(tt.TraceError, match="host transfers"):
                tt.to_device(np.ones((4, 32), np.float32), device)
            with pytest.raises(tt.TraceError):
                tt.empty((4, 32), F32, device)
            with pytest.raises(tt.TraceError):
                tt.write(x, np.zeros((4, 32), np.float32))
            with pytest.raises(tt.TraceError):
                await tt.to_host(x)
            with pytest.raises(tt.TraceError, match="nest"):
                with tt.capture_trace(device):
                    pass
        assert device.memory_used(DRAM) == used
        np.testing.assert_array_equal(await tt.to_host(x), np.ones((4, 32), np.float32))
        tt.execute_trace(trace)  # an empty trace replays to nothing
        tt.release_trace(trace)
        with pytest.raises(tt.TraceError, match="released"):
            tt.execute_trace(trace)


@pytest.mark.anyio
async def test_a_deallocated_input_or_a_failed_capture_is_a_trace_error() -> None:
    spec = tt.DeviceSpec.small()
    rows = spec.l1_bank_bytes * spec.l1_banks // (32 * 4) + 32  # more than L1 holds
    big = tt.ProgramBuilder("too_big")
    big.output(big.add(big.input((rows, 32), tt.Layout(DRAM, TILE, F32)), 1.0), tt.Layout(L1, TILE))
    binary = tt.Binary([_scalar_op("inc", "add", 1.0), big.build()])
    async with tt.open_device(spec) as device:
        x = tt.to_device(np.ones((32, 32), np.float32), device, tt.Layout(DRAM, TILE))
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, binary, 0, [x])
        await y
        tt.deallocate(x)
        with pytest.raises(tt.TraceError, match="deallocated"):
            tt.execute_trace(trace)
        tt.release_trace(trace)
        large = tt.to_device(np.ones((rows, 32), np.float32), device, tt.Layout(DRAM, TILE))
        with tt.capture_trace(device) as failed:
            (z,) = tt.submit(device, binary, 1, [large])
        with pytest.raises(tt.OutOfMemoryError):
            await z
        with pytest.raises(tt.TraceError, match="capture failed"):
            tt.execute_trace(failed)
        tt.release_trace(failed)
        for t in (y, large, z):
            tt.deallocate(t)
        assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0


@pytest.mark.anyio
async def test_executing_before_the_capture_ran_still_replays_in_order() -> None:
    binary = tt.Binary([_scalar_op("inc", "add", 1.0)])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        x = tt.to_device(np.zeros((32, 32), np.float32), device, tt.Layout(DRAM, TILE))
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, binary, 0, [x])
            (z,) = tt.submit(device, binary, 0, [y])
        for _ in range(3):  # queued at once, before anything ran
            tt.execute_trace(trace)
        assert (await tt.to_host(z) == 2).all()
        tt.release_trace(trace)
        for t in (x, y, z):
            tt.deallocate(t)
        assert device.memory_used(DRAM) == 0


@pytest.mark.anyio
async def test_the_timeline_shows_a_replay_as_one_command_with_its_programs_inside() -> None:
    binary = _chain()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tw1 = tt.to_device(np.ones((64, 64), np.float32), device)
        tw2 = tt.to_device(np.ones((64, 32), np.float32), device)
        slot = tt.empty((32, 64), F32, device, tt.Layout(DRAM, TILE))
        with tt.capture_trace(device) as trace:
            (h,) = tt.submit(device, binary, 0, [slot, tw1])
            (y,) = tt.submit(device, binary, 1, [h, tw2])
        await y
        with tt.record_timeline(device) as recorder:
            tt.execute_trace(trace)
            await y
        slices = [e for e in recorder.events if e["ph"] == "X"]
        (replay,) = [e for e in slices if e["name"] == "trace_replay"]
        inside = [e for e in slices if e["cat"] == "replayed program"]
        assert [e["name"] for e in inside] == ["encoder", "head"]
        for e in inside:
            assert e["tid"] == replay["tid"]
            assert replay["ts"] <= e["ts"] and e["ts"] + e["dur"] <= replay["ts"] + replay["dur"]
        assert recorder.queue_summary()["CQ0"]["commands"] == 1
        tt.release_trace(trace)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.sampled_from(["add", "sub", "mul", "relu", "neg", "add_scalar", "mul_scalar"]),
                 min_size=1, max_size=5),
    rows=st.sampled_from([32, 64, 160]), seed=st.integers(0, 2**32 - 1),
    space=st.sampled_from([DRAM, L1]),
)
def test_programs_run_in_place_on_pages_match_the_tile_path_bit_for_bit(
    backend: str, ops: list[str], rows: int, seed: int, space: tt.MemorySpace
) -> None:
    """Pointwise float32 programs on unpadded tiles run on the pages where they lie; the result
    must be the general path's (untilize, compute, tilize), bit for bit, NaN and -0.0 included."""
    from ttflow import _commands

    layout = tt.Layout(space, TILE, F32)
    b = tt.ProgramBuilder("pointwise")
    x, y = b.input((rows, 64), layout), b.input((rows, 64), layout)
    v = x
    for op in ops:
        v = {"add": lambda: b.add(v, y), "sub": lambda: b.sub(y, v), "mul": lambda: b.mul(v, y),
             "relu": lambda: b.relu(v), "neg": lambda: b.neg(v),
             "add_scalar": lambda: b.add(v, 0.1), "mul_scalar": lambda: b.mul(v, -3.0)}[op]()
    b.output(v, layout)
    binary = tt.Binary([b.build()])
    assert _commands.Plan(binary.programs[0]).pagewise
    rng = np.random.default_rng(seed)
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e38, -1e-45], np.float32)
    xs = [rng.standard_normal((rows, 64)).astype(np.float32) for _ in range(2)]
    for a in xs:
        a.reshape(-1)[rng.integers(0, a.size, 8)] = rng.choice(special, 8)

    async def run(pagewise: bool) -> bytes:
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            plan = device._scheduler.plan(binary.programs[0])
            object.__setattr__(plan, "pagewise", pagewise)  # plans are immutable: forced, for the test
            tx, ty = (tt.to_device(a, device, layout) for a in xs)
            (out,) = tt.submit(device, binary, 0, [tx, ty])
            return (await tt.to_host(out)).tobytes()

    assert anyio.run(run, True, backend=backend) == anyio.run(run, False, backend=backend)


@pytest.mark.anyio
async def test_closing_with_a_trace_unreleased_frees_what_it_pinned() -> None:
    """A device (or mesh) closed while a trace still pins buffers frees them with the rest; the
    trace released afterwards is a no-op and a replay is refused typed."""
    rng = np.random.default_rng(1)
    binary = _chain()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tw1 = tt.to_device(rng.standard_normal((64, 64)).astype(np.float32), device)
        tw2 = tt.to_device(rng.standard_normal((64, 32)).astype(np.float32), device)
        slot = tt.empty((32, 64), F32, device, tt.Layout(DRAM, TILE))
        with tt.capture_trace(device) as trace:
            (h,) = tt.submit(device, binary, 0, [slot, tw1])
            (y,) = tt.submit(device, binary, 1, [h, tw2])
        tt.execute_trace(trace)
        await y
    assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0
    tt.release_trace(trace)
    with pytest.raises(tt.TTFlowError):
        tt.execute_trace(trace)
    async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=tt.DeviceSpec.small())) as mesh:
        w = tt.to_device(rng.standard_normal((64, 64)).astype(np.float32), mesh)
        mesh_slot = tt.empty((32, 64), F32, mesh, tt.Layout(DRAM, TILE))
        with tt.capture_trace(mesh) as mesh_trace:
            (z,) = tt.submit(mesh, binary, 0, [mesh_slot, w])
        tt.execute_trace(mesh_trace)
        await z
    assert [chip.memory_used(space) for chip in mesh.chips for space in (DRAM, L1)] == [0, 0, 0, 0]
    tt.release_trace(mesh_trace)


@pytest.mark.parametrize("write_between", [False, True])
async def test_a_dropped_trace_gives_back_what_it_pinned_while_its_inputs_live(
        anyio_backend: str, write_between: bool) -> None:
    """A `Trace` dropped without `release_trace`, its inputs kept: every buffer it pinned goes
    (none of kind "trace" is left), and the device holds what the same work without a trace
    leaves: the inputs and their cached conversions."""
    import gc

    dram_tile = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE)
    l1_tile = tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE)
    b = tt.ProgramBuilder("chain")
    x = b.input((64, 64), l1_tile)
    b.output(b.add(b.mul(x, 2.0), 1.0), dram_tile)
    binary = tt.Binary([b.build()])
    host = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)
    held = {}
    for traced in (False, True):
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            t = tt.to_device(host, device)  # DRAM row-major: converted for the program
            await t
            if traced:
                with tt.capture_trace(device) as trace:
                    (y,) = tt.submit(device, binary, 0, [t])
                    (z,) = tt.submit(device, binary, 0, [y])
            else:
                (y,) = tt.submit(device, binary, 0, [t])
                (z,) = tt.submit(device, binary, 0, [y])
            np.testing.assert_allclose(await tt.to_host(z), (host * 2 + 1) * 2 + 1, rtol=1e-6)
            if write_between:
                tt.write(t, host * 3)
                if traced:
                    tt.execute_trace(trace)
                else:
                    (y,) = tt.submit(device, binary, 0, [t])
                    (z,) = tt.submit(device, binary, 0, [y])
                np.testing.assert_allclose(await tt.to_host(z), (host * 6 + 1) * 2 + 1, rtol=1e-6)
            if traced:
                del trace
            del y, z
            gc.collect()
            await device.synchronize()
            kinds = {b.kind for space in tt.MemorySpace for b in device.memory_view(space).buffers}
            assert "trace" not in kinds and "trace_buffer" not in kinds
            held[traced] = {space: device.memory_used(space) for space in tt.MemorySpace}
            np.testing.assert_array_equal(await tt.to_host(t), host * 3 if write_between else host)
    assert held[True] == held[False]
