"""Faults a hostile user found, each reproduced deterministically and checked against numpy.

Each test holds one piece of work mid-flight (a write's bytes, by gating the queue's `run`),
then does what a front-end may do meanwhile (evict, donate, deallocate, drop a trace), and
compares every tensor with the value numpy says it holds. Before the fixes, faults 1, 3 and 4
gave wrong values silently or failed with memory free; see issue "No silent corruption".
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import attrs
import numpy as np
import pytest

import ttflow as tt
from ttflow import _commands, _queue

pytestmark = pytest.mark.anyio

F32 = tt.DataType.FLOAT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE, ROW = tt.TensorLayout.TILE, tt.TensorLayout.ROW_MAJOR
DRAM_TILE = tt.Layout(DRAM, TILE, F32)
L1_TILE = tt.Layout(L1, TILE, F32)


@contextmanager
def gated_stores(device: tt.Device, arrays: list[np.ndarray]) -> Iterator[threading.Event]:
    """Every command of `device` is run on its queue's worker thread; a record that stores one
    of `arrays` (by identity) waits there until the event is set. Each queue has its own
    worker, so CQ0 goes on meanwhile."""
    gate = threading.Event()
    original = _queue.run

    def gated(record: Any, banks: Any) -> Any:
        if any(isinstance(step, _commands.Store) and any(step.array is a for a in arrays)
               for step in record.steps):
            gate.wait(20)
        return original(record, banks)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_queue, "run", gated)
        mp.setattr(device, "inline_seconds", -1.0)
        try:
            yield gate
        finally:
            gate.set()


async def _until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.001)


def _program(name: str, shape: tuple[int, ...], src: tt.Layout, out: tt.Layout, add: float) -> tt.Program:
    b = tt.ProgramBuilder(name)
    b.output(b.add(b.input(shape, src), add), out)
    return b.build()


async def test_a_write_in_flight_is_not_overtaken_by_an_eviction() -> None:
    # Fault 1. Two writes to an L1 tensor are queued, the first already decided and running;
    # a program then needs L1 and evicts the tensor. The eviction must wait for the write in
    # flight (or keep its block until it lands): the program's output, allocated in L1 after
    # the eviction, must not be overwritten by the first write landing late.
    spec = tt.DeviceSpec.small()  # 64 KiB of L1 per bank, 4 banks
    shape = (128, 256)  # 32 tiles of FLOAT32: 32 KiB per L1 bank
    binary = tt.Binary([_program("inc_to_l1", shape, DRAM_TILE, L1_TILE, 1.0)])
    rng = np.random.default_rng(1)
    a0, a1, a2, z0 = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    async with tt.open_device(spec) as device:
        x = tt.to_device(a0, device, L1_TILE)
        z = tt.to_device(z0, device, DRAM_TILE)
        await x
        await z
        with gated_stores(device, [a1]) as gate:
            tt.write(x, a1)
            await _until(lambda: device._cq1._worker._outstanding != set())  # decided, held
            tt.write(x, a2)
            (y,) = tt.submit(device, binary, 0, [z])  # its L1 output needs x's room
            await anyio.sleep(0.05)  # CQ0 may go on while the first write is held
            gate.set()
            got_y = await tt.to_host(y)
            got_x = await tt.to_host(x)
        np.testing.assert_array_equal(got_x, a2)
        np.testing.assert_array_equal(got_y, z0 + np.float32(1))


async def test_a_write_into_a_failed_tensor_fails_typed_and_makes_no_room() -> None:
    # Fault 2. A write whose tensor holds a stored OutOfMemoryError must fail with it, on CQ1,
    # without making room there: room is made only in CQ0's order.
    spec = tt.DeviceSpec.small()
    rows = spec.l1_bank_bytes * spec.l1_banks // (32 * 4) + 32  # one tile more than L1 holds
    binary = tt.Binary([_program("too_big", (rows, 32), DRAM_TILE, L1_TILE, 1.0)])
    calls: list[str] = []
    original = _queue.CommandQueue._decide_with_room

    async def recording(self: Any, command: Any, error: Any) -> Any:
        calls.append(self.name)
        return await original(self, command, error)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_queue.CommandQueue, "_decide_with_room", recording)
        async with tt.open_device(spec) as device:
            big = tt.to_device(np.ones((rows, 32), np.float32), device, DRAM_TILE)
            (y,) = tt.submit(device, binary, 0, [big])
            with pytest.raises(tt.OutOfMemoryError):
                await y
            tt.write(y, np.zeros((rows, 32), np.float32))
            with pytest.raises(tt.OutOfMemoryError):
                await y
            ok = tt.to_device(np.arange(12, dtype=np.float32), device)
            np.testing.assert_array_equal(await tt.to_host(ok), np.arange(12, dtype=np.float32))
            for t in (big, y, ok):
                tt.deallocate(t)
            await device.synchronize()
            assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0
    assert "CQ1" not in calls, f"room was made from {calls}"


async def test_a_traced_output_cannot_be_donated() -> None:
    # Fault 3. A replay writes into its outputs' buffers: donating one to a later program
    # would let every replay overwrite the receiver. The donating submit is refused.
    b = tt.ProgramBuilder("inc")
    b.output(b.add(b.input((32, 32), DRAM_TILE), 1.0), DRAM_TILE)
    d = tt.ProgramBuilder("double_in_place")
    x = d.input((32, 32), DRAM_TILE)
    d.output(d.mul(x, 2.0), donates=x)
    binary = tt.Binary([b.build(), d.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        slot = tt.to_device(np.zeros((32, 32), np.float32), device, DRAM_TILE)
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, binary, 0, [slot])
        await y
        with pytest.raises(tt.TraceError, match="trace"):
            tt.submit(device, binary, 1, [y])
        tt.write(slot, np.full((32, 32), 5, np.float32))
        tt.execute_trace(trace)
        np.testing.assert_array_equal(await tt.to_host(y), np.full((32, 32), 6, np.float32))
        tt.release_trace(trace)
        (z,) = tt.submit(device, binary, 1, [y])  # released: y is the user's again
        np.testing.assert_array_equal(await tt.to_host(z), np.full((32, 32), 12, np.float32))
        for t in (slot, z):
            tt.deallocate(t)
        await device.synchronize()
        assert device.memory_used(DRAM) == 0


def _fragment_dram(device: tt.Device, hole_pages: int, holes: int) -> list[tt.Tensor]:
    """Fills DRAM with row-major INT32 tensors of one 4 KiB page per bank each and holes of
    `hole_pages` pages per bank between them, to the brim: returns the tensors kept."""
    spec = device.spec
    banks = spec.dram_banks
    page = 4096
    kept, freed = [], []
    for _ in range(holes):
        kept.append(tt.empty((banks, 1024), tt.DataType.INT32, device, tt.Layout(dtype=tt.DataType.INT32)))
        freed.append(tt.empty((banks * hole_pages, 1024), tt.DataType.INT32, device,
                              tt.Layout(dtype=tt.DataType.INT32)))
    kept.append(tt.empty((banks, 1024), tt.DataType.INT32, device, tt.Layout(dtype=tt.DataType.INT32)))
    rest = device.memory_view(DRAM).largest_free_block // banks // page
    if rest:
        kept.append(tt.empty((banks * rest, 1024), tt.DataType.INT32, device, tt.Layout(dtype=tt.DataType.INT32)))
    for t in freed:
        tt.deallocate(t)
    return kept


@pytest.mark.parametrize("victims", [1, 2])
async def test_an_eviction_compacts_dram_when_its_holes_are_too_small(victims: int) -> None:
    # Fault 4. L1 must evict its buffers to DRAM (one of 32 KiB per bank, or two of 16 KiB);
    # DRAM's holes are each smaller than a buffer, but together four times what moves: DRAM is
    # compacted (or relocated) first for all of the eviction's targets, nothing fails. (With two
    # victims, room made for one target at a time undid itself: each relocation filled the
    # block the last one had made.)
    spec = attrs.evolve(tt.DeviceSpec.small(), dram_bank_bytes=2**20)  # 1 MiB per bank
    shape = (128, 256)  # 32 KiB per bank, L1 or DRAM
    part = (128 // victims, 256)
    binary = tt.Binary([_program("inc_to_l1", shape, DRAM_TILE, L1_TILE, 1.0)])
    rng = np.random.default_rng(2)
    parts = [rng.standard_normal(part).astype(np.float32) for _ in range(victims)]
    z0 = rng.standard_normal(shape).astype(np.float32)
    async with tt.open_device(spec) as device:
        xs = [tt.to_device(a, device, L1_TILE) for a in parts]
        z = tt.to_device(z0, device, DRAM_TILE)
        await device.synchronize()
        hole_pages = 4 // victims  # 16 KiB or 8 KiB holes: smaller than each victim
        kept = _fragment_dram(device, hole_pages=hole_pages, holes=16)
        await device.synchronize()
        view = device.memory_view(DRAM)
        assert view.largest_free_block // spec.dram_banks < 32 * 1024 // victims
        assert 4 * 32 * 1024 <= view.free // spec.dram_banks * victims
        (y,) = tt.submit(device, binary, 0, [z])  # needs L1's room: the xs go to DRAM
        np.testing.assert_array_equal(await tt.to_host(y), z0 + np.float32(1))
        for x, a in zip(xs, parts):
            np.testing.assert_array_equal(await tt.to_host(x), a)
        for t in (*xs, y, z, *kept):
            tt.deallocate(t)
        await device.synchronize()
        assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0


async def test_deallocating_a_traced_input_right_after_a_replay_waits_for_it() -> None:
    # Fault 5. `deallocate` waits for queued readers; a queued replay that refills a converted
    # input (its conversion dropped by a write) is one of them.
    b = tt.ProgramBuilder("inc_tile")
    b.output(b.add(b.input((32, 64), DRAM_TILE), 1.0), DRAM_TILE)
    binary = tt.Binary([b.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        slot = tt.to_device(np.zeros((32, 64), np.float32), device)  # row-major: converted
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, binary, 0, [slot])
        await y
        before = device.stats.layout_conversions
        tt.write(slot, np.full((32, 64), 3, np.float32))  # drops the kept conversion
        tt.execute_trace(trace)
        tt.deallocate(slot)
        np.testing.assert_array_equal(await tt.to_host(y), np.full((32, 64), 4, np.float32))
        # Fault 7: the replay's refill is a conversion like any other.
        assert device.stats.layout_conversions == before + 1
        tt.release_trace(trace)
        tt.deallocate(y)
        await device.synchronize()
        assert device.memory_used(DRAM) == 0


async def test_a_dropped_trace_gives_its_memory_back() -> None:
    # Fault 6. A trace dropped without release_trace is released, as a dropped tensor is freed.
    b = tt.ProgramBuilder("chain")
    x = b.input((32, 32), DRAM_TILE)
    b.output(b.add(b.relu(b.add(x, 1.0)), 2.0), DRAM_TILE)
    binary = tt.Binary([b.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        slot = tt.to_device(np.zeros((32, 32), np.float32), device)
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, binary, 0, [slot])
        tt.execute_trace(trace)
        await y
        tt.deallocate(slot)
        tt.deallocate(y)
        del trace
        gc.collect()
        await device.synchronize()
        assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0


async def test_hand_written_layouts_take_the_fast_path() -> None:
    # Fault 8. A tensor made with a hand-written tt.Layout equal to the declared one must run
    # as fast as one made with tt.get_layout: the C fast path matched layouts by identity.
    b = tt.ProgramBuilder("inc")
    b.output(b.add(b.input((32, 32), tt.Layout(DRAM, TILE, F32)), 1.0), tt.Layout(DRAM, TILE, F32))
    binary = tt.Binary([b.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        x = tt.to_device(np.zeros((32, 32), np.float32), device, tt.Layout(DRAM, TILE, F32))
        await x
        counters = device._scheduler.counters
        (y,) = tt.submit(device, binary, 0, [x])
        await y
        before = counters["fast_path_programs"]
        for _ in range(20):
            (y,) = tt.submit(device, binary, 0, [y])
        np.testing.assert_array_equal(await tt.to_host(y), np.full((32, 32), 21, np.float32))
        assert counters["fast_path_programs"] - before == 20
