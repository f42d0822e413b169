"""Memory that plans ahead: circular-buffer footprints, clashes, lookahead eviction, relocation,
spilling, and the memory view.

Every figure is computed here from the buffers' geometry (tiles per bank times the tile size,
top-down L1, bottom-up DRAM) or from tt-metal's circular-buffer rules, and every value is
compared with numpy.
"""

from __future__ import annotations

import math
from typing import Any, Self

import anyio

import numpy as np
import pytest

import ttflow as tt
from ttflow import _queue
from ttflow.testing import WorkerThreadHold, hold_worker_threads

pytestmark = pytest.mark.anyio

SMALL = tt.DeviceSpec.small()  # 4 L1 banks of 64 KiB, 4 DRAM banks of 16 MiB
F32, BF16 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE = tt.TensorLayout.TILE
DRAM_TILE = tt.Layout(DRAM, TILE, F32)
DRAM_RM = tt.Layout(DRAM, tt.TensorLayout.ROW_MAJOR, F32)
L1_TILE = tt.Layout(L1, TILE, F32)


def depth(shape: tuple[int, ...], dtype: tt.DataType = F32, banks: int = 4) -> int:
    """Bytes per bank of a TILE tensor: ceil(tiles / banks) tiles of the dtype's tile size."""
    tiles = math.prod(shape[:-2]) * -(-shape[-2] // 32) * -(-shape[-1] // 32)
    return -(-tiles // banks) * dtype.tile_bytes


def unary(name: str, shape: tuple[int, ...], src: tt.Layout, dst: tt.Layout, op: str = "relu") -> tt.Program:
    b = tt.ProgramBuilder(name)
    b.output(getattr(b, op)(b.input(shape, src)), dst)
    return b.build()


def add(shape: tuple[int, ...], src: tt.Layout = DRAM_TILE, dst: tt.Layout = DRAM_TILE) -> tt.Program:
    b = tt.ProgramBuilder("add")
    b.output(b.add(b.input(shape, src), b.input(shape, src)), dst)
    return b.build()


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0)


# -- footprints ---------------------------------------------------------------------------------


def test_footprints_follow_tt_metal_circular_buffer_sizing() -> None:
    n150 = tt.DeviceSpec()
    # eltwise binary: two double-buffered tiles per input and for the output
    assert add((64, 64)).l1_footprint(n150) == 3 * 2 * 4096
    b = tt.ProgramBuilder("mixed")
    b.output(b.add(b.input((64, 64), DRAM_TILE), b.input((64, 64), tt.Layout(DRAM, TILE, BF16))), DRAM_TILE)
    assert b.build().l1_footprint(n150) == 2 * 4096 + 2 * 2048 + 2 * 4096
    # matmul, multi-core reuse on the 8x8 grid: Mt=8, Kt=16, Nt=32 -> per core 1 x 4 output
    # tiles, in0_block_w 2: in0 2*1*2 tiles, in1 2*2*4 tiles, out 1*4 tiles
    b = tt.ProgramBuilder("mm")
    b.output(b.matmul(b.input((256, 512), DRAM_TILE), b.input((512, 1024), DRAM_TILE)), DRAM_TILE)
    mm = b.build()
    assert mm.l1_footprint(n150) == (2 * 1 * 2 + 2 * 2 * 4) * 4096 + 1 * 4 * 4096
    # softmax over a 32-tile row: the row in, a row of exponentials, 2 out, 3 helper tiles
    b = tt.ProgramBuilder("mm_softmax")
    b.output(b.softmax(b.matmul(b.input((256, 512), DRAM_TILE), b.input((512, 1024), DRAM_TILE))), DRAM_TILE)
    assert b.build().l1_footprint(n150) == 32 * 4096 + 32 * 4096 + 2 * 4096 + 3 * 4096  # the largest step
    # a row too wide for half of the small device's L1 streams two tiles at a time
    b = tt.ProgramBuilder("wide_softmax")
    b.output(b.softmax(b.input((32, 1024), DRAM_TILE)), DRAM_TILE)
    assert b.build().l1_footprint(SMALL) == 2 * 4096 + 2 * 4096 + 2 * 4096 + 3 * 4096


# -- clashes: L1 buffers where a program's circular buffers must go ---------------------------


async def _fill_l1(device: tt.Device, count: int, shape: tuple[int, int] = (32, 256)) -> tuple[list[tt.Tensor], list[np.ndarray]]:
    rng = np.random.default_rng(count)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(count)]
    tensors = [tt.to_device(a, device, L1_TILE) for a in arrays]
    for t in tensors:
        await t
    return tensors, arrays


async def test_a_clash_relocates_l1_buffers_within_l1_when_there_is_room() -> None:
    program = add((32, 32))
    fp = program.l1_footprint(SMALL)
    assert fp == 24576
    async with tt.open_device(SMALL) as device:
        tensors, arrays = await _fill_l1(device, 8)  # 8 x 8192 per bank: all of L1, top-down
        d = depth((32, 256))
        assert [t.buffer.address for t in tensors] == [65536 - (i + 1) * d for i in range(8)]
        for t in tensors[:3]:
            tt.deallocate(t)  # room at the top for the three at the bottom
        x = np.ones((32, 32), np.float32)
        (out,) = tt.submit(device, tt.Binary([program]), 0, [tt.to_device(x, device, DRAM_TILE)] * 2)
        np.testing.assert_array_equal(await tt.to_host(out), x + x)
        s = device.stats
        assert (s.relocations, s.evictions) == (3, 0)
        assert s.relocation_bytes == 3 * 32 * 256 * 4
        for t, a in zip(tensors[3:], arrays[3:]):
            assert t.layout == L1_TILE and t.buffer.address >= fp
            np.testing.assert_array_equal(await tt.to_host(t), a)
        view = device.memory_view(L1)
        assert [(b.address, b.depth) for b in view.buffers if b.kind == "circular_buffers"] == [(0, fp)]
        assert device.memory_used(L1) == 5 * d * 4  # the idle circular buffers are room, not use


async def test_a_clash_evicts_to_dram_what_l1_cannot_hold_elsewhere() -> None:
    async with tt.open_device(SMALL) as device:
        tensors, arrays = await _fill_l1(device, 8)  # L1 full
        x = np.ones((32, 32), np.float32)
        (out,) = tt.submit(device, tt.Binary([add((32, 32))]), 0, [tt.to_device(x, device, DRAM_TILE)] * 2)
        np.testing.assert_array_equal(await tt.to_host(out), x + x)
        s = device.stats
        assert (s.evictions, s.eviction_bytes, s.relocations) == (3, 3 * 32 * 256 * 4, 0)
        assert [t.layout.memory for t in tensors] == [L1] * 5 + [DRAM] * 3
        for t, a in zip(tensors, arrays):
            np.testing.assert_array_equal(await tt.to_host(t), a)


async def test_a_clash_with_the_programs_own_input_moves_it_before_it_is_read() -> None:
    program = unary("relu_l1", (32, 256), L1_TILE, DRAM_TILE)
    fp = program.l1_footprint(SMALL)
    assert fp == 2 * 2 * 4096
    async with tt.open_device(SMALL) as device:
        tensors, arrays = await _fill_l1(device, 8)
        tt.deallocate(tensors[0])
        tt.deallocate(tensors[1])
        bottom = tensors[7]
        assert bottom.buffer.address == 0
        (out,) = tt.submit(device, tt.Binary([program]), 0, [bottom])
        new = -arrays[7]
        tt.write(bottom, new)  # queued behind the program that reads the old value
        np.testing.assert_array_equal(await tt.to_host(out), relu(arrays[7]))
        np.testing.assert_array_equal(await tt.to_host(bottom), new)
        assert bottom.layout == L1_TILE and bottom.buffer.address >= fp
        assert device.stats.relocations == 2  # the input and the buffer above it (8192 < 16384)


async def test_a_clash_with_a_trace_buffer_relocates_it_and_replays_stay_right() -> None:
    small = unary("relu_l1", (32, 256), L1_TILE, L1_TILE)  # pagewise: replayed by the C kernel
    big = add((32, 32))
    assert small.l1_footprint(SMALL) == 16384 < big.l1_footprint(SMALL) == 24576
    rng = np.random.default_rng(3)
    async with tt.open_device(SMALL) as device:
        fillers, _ = await _fill_l1(device, 8, (32, 128))  # 8 x 4096: free [0, 32768)
        x = tt.to_device(rng.standard_normal((32, 256)).astype(np.float32), device, L1_TILE)
        await x
        assert x.buffer.address == 24576
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, tt.Binary([small]), 0, [x])
        await y
        assert y.buffer.address == 16384  # just above the capture's circular buffers
        for t in fillers[:6]:
            tt.deallocate(t)
        ones = tt.to_device(np.ones((32, 32), np.float32), device, DRAM_TILE)
        await tt.submit(device, tt.Binary([big]), 0, [ones, ones])[0]  # moves the trace's buffer
        assert device.stats.relocations == 1 and y.buffer.address >= 24576
        for _ in range(2):
            new = rng.standard_normal((32, 256)).astype(np.float32)
            tt.write(x, new)
            tt.execute_trace(trace)
            np.testing.assert_array_equal(await tt.to_host(y), relu(new))
        tt.release_trace(trace)


async def test_a_trace_buffer_that_l1_cannot_hold_moves_to_dram_in_place() -> None:
    small = unary("relu_l1", (32, 256), L1_TILE, L1_TILE)
    big = add((32, 32))
    rng = np.random.default_rng(4)
    async with tt.open_device(SMALL) as device:
        fillers, _ = await _fill_l1(device, 8, (32, 128))  # free: [0, 32768), held to the end
        x = tt.to_device(rng.standard_normal((32, 256)).astype(np.float32), device, L1_TILE)
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, tt.Binary([small]), 0, [x])
        await y
        assert y.buffer.address == 16384
        ones = tt.to_device(np.ones((32, 32), np.float32), device, DRAM_TILE)
        await tt.submit(device, tt.Binary([big]), 0, [ones, ones])[0]  # L1 is full: y must leave
        assert y.layout == DRAM_TILE and device.stats.evictions == 1
        for _ in range(2):
            new = rng.standard_normal((32, 256)).astype(np.float32)
            tt.write(x, new)
            tt.execute_trace(trace)  # writes y where it now is
            np.testing.assert_array_equal(await tt.to_host(y), relu(new))
        tt.release_trace(trace)
        assert len(fillers) == 8


async def test_outputs_and_scratch_never_land_in_the_running_programs_circular_buffers() -> None:
    b = tt.ProgramBuilder("two_steps")  # relu's result is scratch (L1 first), exp's the output
    b.output(b.exp(b.relu(b.input((32, 256), DRAM_TILE))), L1_TILE)
    program = b.build()
    fp = program.l1_footprint(SMALL)
    seen: list[int] = []
    async with tt.open_device(SMALL) as device:
        tensors, _ = await _fill_l1(device, 7)  # free: [0, 8192) only
        for t in tensors[:2]:
            tt.deallocate(t)
        device._scheduler.listeners.append(
            lambda command, error: seen.extend(s.address for s in getattr(command.record, "steps", [None])[-1].outputs)
            if type(command).__name__ == "ProgramCommand" and command.record is not None else None)
        x = np.linspace(-1, 1, 32 * 256, dtype=np.float32).reshape(32, 256)
        (out,) = tt.submit(device, tt.Binary([program]), 0, [tt.to_device(x, device, DRAM_TILE)])
        np.testing.assert_allclose(await tt.to_host(out), np.exp(relu(x)), rtol=1e-6)
        assert seen and all(address >= fp for address in seen)
        assert out.buffer.address >= fp


# -- lookahead -------------------------------------------------------------------------------


def _relus() -> tt.Binary:
    """Program 0: relu from L1 to L1; program 1: relu from L1 to DRAM (32 x 256 float32)."""
    return tt.Binary([unary("relu_to_l1", (32, 256), L1_TILE, L1_TILE),
                      unary("relu_to_dram", (32, 256), L1_TILE, DRAM_TILE)])


async def _circular_buffers_placed(device: tt.Device, binary: tt.Binary) -> None:
    """Runs program 1 once on a scratch input, so that its circular buffers (16384 bytes a core)
    are at the bottom of L1, and lets the input (and its L1 copy) go."""
    warm = tt.to_device(np.zeros((32, 256), np.float32), device, DRAM_TILE)
    await tt.submit(device, binary, 1, [warm])[0]
    tt.deallocate(warm)


async def test_lookahead_evicts_the_tensor_used_farthest_ahead_only() -> None:
    binary = _relus()
    async with tt.open_device(SMALL) as device:
        await _circular_buffers_placed(device, binary)
        tensors, arrays = await _fill_l1(device, 6)  # 6 x 8192: L1 is full
        # Queued at once: the first needs room for an L1 output; the others read T1..T4 in turn.
        (first,) = tt.submit(device, binary, 0, [tensors[0]])
        later = [tt.submit(device, binary, 1, [tensors[i]])[0] for i in (1, 2, 3, 4)]
        np.testing.assert_array_equal(await tt.to_host(first), relu(arrays[0]))
        for out, i in zip(later, (1, 2, 3, 4)):
            np.testing.assert_array_equal(await tt.to_host(out), relu(arrays[i]))
        s = device.stats
        assert (s.evictions, s.eviction_bytes) == (1, 32 * 256 * 4)
        assert [t.layout.memory for t in tensors] == [L1] * 5 + [DRAM]  # T5: never read again
        np.testing.assert_array_equal(await tt.to_host(tensors[5]), arrays[5])


async def test_lookahead_prefers_a_victim_whose_value_dram_already_holds() -> None:
    binary = _relus()
    async with tt.open_device(SMALL) as device:
        await _circular_buffers_placed(device, binary)
        tensors, arrays = await _fill_l1(device, 5)
        # a sixth value whose home is a DRAM tile: its L1 copy (made by reading it) is free to drop
        clean = tt.to_device(np.full((32, 256), 7, np.float32), device, DRAM_TILE)
        await tt.submit(device, binary, 1, [clean])[0]
        assert [layout.memory for layout, _ in clean.storages] == [DRAM, L1]
        before = device.stats
        # L1 is full (6 x 8192 + 16384); the next output needs room, and nothing queued reads
        # T1..T4 or clean again: clean's copy goes, for free
        (out,) = tt.submit(device, binary, 0, [tensors[0]])
        np.testing.assert_array_equal(await tt.to_host(out), relu(arrays[0]))
        s = device.stats
        assert s.evictions - before.evictions == 1 and s.eviction_bytes == before.eviction_bytes
        assert [layout.memory for layout, _ in clean.storages] == [DRAM]
        assert all(t.layout.memory is L1 for t in tensors)


# -- no out-of-memory while memory is free -----------------------------------------------------


async def test_fragmented_dram_is_compacted_for_a_block_larger_than_any_hole() -> None:
    rng = np.random.default_rng(9)
    mib_per_bank = (1024, 1024)  # 1024 tiles of 4 KiB: 1 MiB in each of the 4 banks
    async with tt.open_device(SMALL) as device:
        arrays = [rng.standard_normal(mib_per_bank).astype(np.float32) for _ in range(16)]
        tensors = [tt.to_device(a, device, DRAM_TILE) for a in arrays]  # DRAM full
        for t in tensors:
            await t
        for t in tensors[::2]:
            tt.deallocate(t)
        view = device.memory_view(DRAM)
        assert view.free == 8 * 4 * 2**20 and view.largest_free_block == 4 * 2**20
        assert view.fragmentation == pytest.approx(1 - 1 / 8)
        big = rng.standard_normal((1024, 2048)).astype(np.float32)  # 2 MiB per bank
        tb = tt.to_device(big, device, DRAM_TILE)  # no hole holds it: buffers move first
        np.testing.assert_array_equal(await tt.to_host(tb), big)
        assert device.stats.relocations >= 1
        survivors = tensors[1::2]
        for t, a in zip(survivors, arrays[1::2]):
            np.testing.assert_array_equal(await tt.to_host(t), a)
        # and a program whose output needs a block again larger than any hole
        for t in survivors[::2]:
            tt.deallocate(t)
        (out,) = tt.submit(device, tt.Binary([unary("relu_big", (1024, 2048), DRAM_TILE, DRAM_TILE)]), 0, [tb])
        np.testing.assert_array_equal(await tt.to_host(out), relu(big))
        for t, a in zip(survivors[1::2], arrays[3::4]):
            np.testing.assert_array_equal(await tt.to_host(t), a)


@pytest.mark.parametrize("request_by", ["to_device", "program_output"])
async def test_holes_each_too_small_for_any_buffer_are_merged_by_sliding_buffers(request_by: str) -> None:
    """Holes of 3 tiles a bank between survivors of 4: no survivor fits any hole, so no single
    block can be emptied into the others; the survivors slide (each over part of its own old
    place) until 8 tiles a bank lie free together."""
    tile = F32.tile_bytes
    rng = np.random.default_rng(4)
    async with tt.open_device(SMALL) as device:
        holes, survivors = [], []
        for _ in range(4):
            holes.append(tt.to_device(np.zeros((32, 32 * 12), np.float32), device, DRAM_TILE))  # 3 a bank
            array = rng.standard_normal((32, 32 * 16)).astype(np.float32)  # 4 a bank
            survivors.append((tt.to_device(array, device, DRAM_TILE), array))
        free = device.memory_view(DRAM).free // 4
        ballast = tt.empty((32, 32 * 4 * (free // tile)), F32, device, DRAM_TILE)  # the rest of DRAM
        await ballast
        for t in holes:
            tt.deallocate(t)
        view = device.memory_view(DRAM)
        assert view.free == 4 * 12 * tile and view.largest_free_block == 4 * 3 * tile
        before = {t.buffer.address for t, _ in survivors}
        big = rng.standard_normal((32, 32 * 32)).astype(np.float32)  # 8 tiles a bank
        if request_by == "to_device":
            tb = tt.to_device(big, device, DRAM_TILE)
            expected = big
        else:  # from L1 (32 KiB of each core's 64 KiB) to a DRAM output
            program = unary("relu_out", big.shape, L1_TILE, DRAM_TILE)
            (tb,) = tt.submit(device, tt.Binary([program]), 0, [tt.to_device(big, device, L1_TILE)])
            expected = relu(big)
        np.testing.assert_array_equal(await tt.to_host(tb), expected)
        for t, array in survivors:
            np.testing.assert_array_equal(await tt.to_host(t), array)
        assert {t.buffer.address for t, _ in survivors} != before
        assert device.stats.relocations >= 2
        view = device.memory_view(DRAM)
        assert view.free == 4 * 4 * tile
        addresses = sorted((b.address, b.depth) for b in view.buffers)
        assert all(a + d <= b for (a, d), (b, _) in zip(addresses, addresses[1:]))  # no overlap


class _DeallocatedWhileWritten:
    """DRAM full but for one tile a bank, with four tensors of 4 tiles a bank each, then every
    worker thread held (`inline_seconds=-1`: every record goes to a worker, so holdable). A
    test gives the four new values, queued on CQ1, and deallocates them, as the runtime
    state machine's `fragment` does: a deallocated tensor keeps its buffer until the commands
    queued on it have run, so those blocks come back only as CQ1's writes land. `x` (`tiles`
    a bank, ROW_MAJOR) is idle, ready to be converted."""

    def __init__(self, device: tt.Device, rng: np.random.Generator, tiles: int) -> None:
        self.device, self.rng, self.tiles = device, rng, tiles

    async def __aenter__(self) -> Self:
        device = self.device
        tile = F32.tile_bytes
        self.value = self.rng.standard_normal((32, 32 * 4 * self.tiles)).astype(np.float32)
        self.x = tt.to_device(self.value, device, DRAM_RM)
        self.fragments = [tt.to_device(np.zeros((32, 32 * 16), np.float32), device, DRAM_TILE)
                          for _ in range(4)]
        free = device.memory_view(DRAM).free // 4 // tile
        self.ballast = tt.empty((32, 32 * 4 * (free - 1)), F32, device, DRAM_TILE)
        for t in (self.x, *self.fragments, self.ballast):
            await t
        assert device.memory_view(DRAM).free == 4 * tile
        self.hold = WorkerThreadHold()
        await self.hold.acquire()
        return self

    def write_and_deallocate(self, fragments: list[tt.Tensor]) -> None:
        for t in fragments:
            tt.write(t, np.ones((32, 32 * 16), np.float32))
            tt.deallocate(t)

    async def __aexit__(self, *exc: object) -> None:
        self.hold.release()


def _dram_bytes(*tensors: tt.Tensor) -> int:
    return sum(t.buffer.num_pages * t.buffer.aligned_page_size for t in tensors)


async def test_room_that_deallocated_tensors_give_back_when_their_writes_land_is_waited_for() -> None:
    """The runtime state machine's finding (`capture`, `fragment` L1, `fragment` DRAM, `request`
    L1, then a conversion of an L1 survivor into DRAM raised OutOfMemoryError, "asked for 16384
    bytes per bank, largest free block is 6560 bytes", while the freed DRAM fragments' writes
    were still queued; the trace played no part). A conversion that needs 4 tiles a bank,
    decided while DRAM has one free, waits for the CQ1 writes after which the deallocated
    tensors give their blocks back, then is made: as on tt-metal, where `deallocate` frees at
    once, memory the user has let go of is free."""
    async with tt.open_device(SMALL, inline_seconds=-1) as device, \
            _DeallocatedWhileWritten(device, np.random.default_rng(11), tiles=4) as dram:
        dram.write_and_deallocate(dram.fragments)
        y = tt.to_layout(dram.x, DRAM_TILE)
        await anyio.sleep(0.05)  # CQ0 decides it now: DRAM holds one tile a bank
        assert not y.done(), "the conversion did not wait for the deallocated tensors' blocks"
        assert device.memory_view(DRAM).free == 4 * F32.tile_bytes
        dram.hold.release()
        np.testing.assert_array_equal(await tt.to_host(y), dram.value)
        np.testing.assert_array_equal(await tt.to_host(dram.x), dram.value)
        assert device.memory_used(DRAM) == _dram_bytes(dram.x, y, dram.ballast)


async def test_room_that_a_command_behind_it_still_needs_is_not_waited_for() -> None:
    """The last deallocated tensor is read by a conversion queued on CQ0 behind the one that
    needs the room, so its block cannot come back first: the first conversion (16 tiles a
    bank; one free, and 12 that the other three give back) raises OutOfMemoryError, as it
    would on tt-metal, where the fourth was still allocated when it was queued. The second
    waits for the three and is made; nothing leaks, and the device stays usable."""
    async with tt.open_device(SMALL, inline_seconds=-1) as device, \
            _DeallocatedWhileWritten(device, np.random.default_rng(12), tiles=16) as dram:
        *three, last = dram.fragments
        dram.write_and_deallocate(three)
        tt.write(last, np.ones((32, 32 * 16), np.float32))
        y = tt.to_layout(dram.x, DRAM_TILE)
        z = tt.to_layout(last, DRAM_RM)
        tt.deallocate(last)
        dram.hold.release()
        with pytest.raises(tt.OutOfMemoryError, match="DRAM"):
            await y
        np.testing.assert_array_equal(await tt.to_host(z), np.ones((32, 32 * 16), np.float32))
        np.testing.assert_array_equal(await tt.to_host(dram.x), dram.value)
        assert device.memory_used(DRAM) == _dram_bytes(dram.x, z, dram.ballast)
        tt.deallocate(z)
        again = tt.to_layout(dram.x, DRAM_TILE)  # 17 tiles a bank free now
        np.testing.assert_array_equal(await tt.to_host(again), dram.value)
        assert device.memory_used(DRAM) == _dram_bytes(dram.x, again, dram.ballast)


async def test_room_behind_a_write_that_waits_for_cq0_is_not_waited_for() -> None:
    """A new value for `x`, queued on CQ1 after the conversions that read `x` (it waits for
    the second, behind the first on CQ0), then the four tensors' writes and deallocations,
    queued behind it on CQ1: their blocks cannot come back before CQ0 goes past the first
    conversion, so it raises OutOfMemoryError at once instead of waiting for ever. The
    second conversion reads the old value, and nothing leaks."""
    with anyio.fail_after(30):  # a wait for CQ1 would be a deadlock: fail, cancelling the device
        async with tt.open_device(SMALL, inline_seconds=-1) as device, \
                _DeallocatedWhileWritten(device, np.random.default_rng(13), tiles=4) as dram:
            y = tt.to_layout(dram.x, DRAM_TILE)
            in_l1 = tt.to_layout(dram.x, tt.Layout(L1, tt.TensorLayout.ROW_MAJOR, F32))
            new = np.full(dram.value.shape, 3.0, np.float32)
            tt.write(dram.x, new)
            dram.write_and_deallocate(dram.fragments)
            dram.hold.release()
            with pytest.raises(tt.OutOfMemoryError, match="DRAM"):
                await y
            np.testing.assert_array_equal(await tt.to_host(in_l1), dram.value)
            np.testing.assert_array_equal(await tt.to_host(dram.x), new)
            assert device.memory_used(DRAM) == _dram_bytes(dram.x, dram.ballast)


class _TraceAmongHoles:
    """DRAM laid out as hole x hole y hole kept, then a ballast over the rest: x and kept hold
    random values, y = relu(x) is a captured trace's output (pagewise: the C kernel replays it
    at the addresses captured), each 4 tiles a bank; the holes, 3 tiles a bank, are free. No
    survivor fits a hole, so a request of 9 tiles a bank is made only by sliding them."""

    def __init__(self, device: tt.Device, rng: np.random.Generator) -> None:
        self.device, self.rng = device, rng

    async def __aenter__(self) -> Self:
        device, rng = self.device, self.rng

        def block(tiles_per_bank: int) -> tt.Tensor:
            return tt.to_device(np.zeros((32, 32 * 4 * tiles_per_bank), np.float32), device, DRAM_TILE)

        holes = [block(3)]
        self.x = tt.to_device(rng.standard_normal((32, 32 * 16)).astype(np.float32), device, DRAM_TILE)
        holes.append(block(3))
        slot = block(4)  # where the trace's output will go
        holes.append(block(3))
        self.kept_value = rng.standard_normal((32, 32 * 16)).astype(np.float32)
        self.kept = tt.to_device(self.kept_value, device, DRAM_TILE)
        free = device.memory_view(DRAM).free // 4 // F32.tile_bytes
        self.ballast = tt.empty((32, 32 * 4 * free), F32, device, DRAM_TILE)
        await self.ballast
        tt.deallocate(slot)
        with tt.capture_trace(device) as trace:
            (self.y,) = tt.submit(device, tt.Binary([unary("relu_dram", (32, 32 * 16), DRAM_TILE, DRAM_TILE)]),
                                  0, [self.x])
        self.trace = trace
        await self.y
        for t in holes:
            tt.deallocate(t)
        assert device.memory_view(DRAM).largest_free_block == 4 * 3 * F32.tile_bytes
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    def request(self) -> tuple[tt.Tensor, np.ndarray]:
        """A tensor of 9 tiles a bank: the three holes' bytes."""
        big = self.rng.standard_normal((32, 32 * 4 * 9)).astype(np.float32)
        return tt.to_device(big, self.device, DRAM_TILE), big


async def test_compaction_slides_a_traces_buffers_and_its_replays_follow() -> None:
    """The trace's input and output sit among the survivors that slide; its replays, run by the
    C kernel at the addresses captured, must then read and write where the buffers went."""
    rng = np.random.default_rng(7)
    async with tt.open_device(SMALL) as device, _TraceAmongHoles(device, rng) as dram:
        x, y = dram.x, dram.y
        before = (x.buffer.address, y.buffer.address)
        tb, big = dram.request()
        np.testing.assert_array_equal(await tt.to_host(tb), big)
        assert (x.buffer.address, y.buffer.address) != before
        np.testing.assert_array_equal(await tt.to_host(dram.kept), dram.kept_value)
        for _ in range(2):
            new = rng.standard_normal((32, 32 * 16)).astype(np.float32)
            tt.write(x, new)
            tt.execute_trace(dram.trace)
            np.testing.assert_array_equal(await tt.to_host(y), relu(new))
        np.testing.assert_array_equal(await tt.to_host(tb), big)
        tt.release_trace(dram.trace)


async def test_a_trace_let_go_of_while_its_buffer_slides_frees_it_after_the_slide(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The trace's output buffer, which only the trace keeps (its tensor was deallocated), is
    sliding (held on its worker thread) when the trace is released: it is freed when the slide
    ends, not under it, and DRAM then holds exactly the live tensors."""
    # inline_seconds=-1: every record on a worker, so holdable
    async with tt.open_device(SMALL, inline_seconds=-1) as device, _TraceAmongHoles(device, np.random.default_rng(8)) as dram:
        tt.deallocate(dram.y)  # the trace alone keeps its buffer now
        async with hold_worker_threads() as hold:
            tb, big = dram.request()  # its room: a slide, held before its run
            await anyio.sleep(0.05)
            relocations = device.stats.relocations
            tt.release_trace(dram.trace)  # unpins the sliding buffer
            hold.release()
            np.testing.assert_array_equal(await tt.to_host(tb), big)
        assert device.stats.relocations > relocations == 0
        await anyio.lowlevel.checkpoint()
        live = sum(t.buffer.num_pages * t.buffer.aligned_page_size for t in (dram.x, dram.kept, dram.ballast, tb))
        assert device.memory_used(DRAM) == live


async def test_an_l1_output_that_l1_cannot_hold_spills_to_dram() -> None:
    program = unary("relu_wide", (32, 32 * 40), L1_TILE, L1_TILE)  # 10 tiles a bank each
    x = np.linspace(-1, 1, 32 * 32 * 40, dtype=np.float32).reshape(32, 32 * 40)
    async with tt.open_device(SMALL) as device:
        t = tt.to_device(x, device, L1_TILE)  # 40960 of each bank's 65536, read by the program
        (out,) = tt.submit(device, tt.Binary([program]), 0, [t])
        np.testing.assert_array_equal(await tt.to_host(out), relu(x))
        assert out.layout == DRAM_TILE and t.layout == L1_TILE


async def test_out_of_memory_only_when_it_truly_does_not_fit_and_it_shows_the_view() -> None:
    async with tt.open_device(SMALL) as device:
        held = tt.to_device(np.ones((1024, 1024 * 15), np.float32), device, DRAM_TILE)  # 15 of 16 MiB
        await held
        with pytest.raises(tt.OutOfMemoryError) as caught:
            tt.to_device(np.ones((1024, 2048), np.float32), device, DRAM_TILE)
        assert isinstance(caught.value.view, tt.MemoryView)
        assert "largest free block" in str(caught.value) and "home" in str(caught.value)
        program = unary("too_big_for_l1", (64, 64 * 40), DRAM_TILE, L1_TILE)  # 80 KiB a bank
        (out,) = tt.submit(device, tt.Binary([program]), 0, [tt.to_device(np.ones((64, 64 * 40), np.float32), device, DRAM_TILE)])
        with pytest.raises(tt.OutOfMemoryError, match="L1"):
            await out
        tt.deallocate(held)
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        np.testing.assert_array_equal(await tt.to_host(tt.to_device(x, device)), x)  # still usable


# -- the memory view ---------------------------------------------------------------------------


async def test_memory_view_names_every_buffer_and_adds_up() -> None:
    async with tt.open_device(SMALL) as device:
        home = tt.to_device(np.ones((64, 64), np.float32), device, L1_TILE)
        rm = tt.to_device(np.ones((64, 64), np.float32), device)  # DRAM row-major
        (out,) = tt.submit(device, tt.Binary([unary("relu", (64, 64), L1_TILE, DRAM_TILE)]), 0, [rm])
        await out
        for space in (L1, DRAM):
            view = device.memory_view(space)
            assert view.used == sum(b.nbytes for b in view.buffers)
            assert view.free == view.total - view.used and view.largest_free_block <= view.free
            spans = sorted((b.address, b.address + b.depth) for b in view.buffers)
            assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        l1 = {b.kind: b for b in device.memory_view(L1).buffers}
        assert l1["home"].depth == depth((64, 64)) and l1["home"].shape == (64, 64)
        assert l1["home"].address == home.buffer.address == 65536 - depth((64, 64))
        assert l1["conversion"].layout == L1_TILE  # rm, converted for the program and kept
        assert l1["circular_buffers"].address == 0
        dram = [b.kind for b in device.memory_view(DRAM).buffers]
        assert sorted(dram) == ["home", "home"]
        assert "home" in str(device.memory_view(L1))


# -- scratch shapes --------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "stored_tiles"), [
    ((4, 64, 8, 8), 8 * 2),      # as 256 x 64: tiles would pad 8x8 to 32x32 (256 tiles, 16x)
    ((5, 33, 40), 6 * 2),        # as 165 x 40 (192 x 64 padded), not 5 x 64 x 64 (3.1x)
    ((4, 3, 32, 32), 12),        # no padding: its own shape
    ((2, 40, 64), 2 * 2 * 2),    # pads 1.6x: its own shape
    ((2, 20000), 40),            # as 1250 x 32 (40 tiles), not 2 rows padded to 32 (625 tiles)
])
async def test_a_programs_scratch_is_stored_as_its_least_padded_2d_split(shape: tuple[int, ...],
                                                                         stored_tiles: int) -> None:
    """A value tiles would pad to more than twice its size takes the bytes of the 2-D split of its
    dims that pads least (counted here by hand), and the program's result is numpy's."""
    b = tt.ProgramBuilder("scratch")  # relu's and exp's results are scratch, the sum the output
    b.output(b.sum(b.exp(b.relu(b.input(shape, DRAM_TILE))), axis=-1), DRAM_TILE)
    scratch: list[Any] = []
    async with tt.open_device(SMALL) as device:
        device._scheduler.listeners.append(
            lambda command, error: scratch.extend(getattr(command.record, "steps", [None])[-1].scratch.values())
            if type(command).__name__ == "ProgramCommand" and command.record is not None else None)
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        (out,) = tt.submit(device, tt.Binary([b.build()]), 0, [tt.to_device(x, device, DRAM_TILE)])
        got = await tt.to_host(out)
    np.testing.assert_allclose(got, np.exp(relu(x), dtype=np.float64).sum(axis=-1, keepdims=True), rtol=1e-5)
    assert len(scratch) == 2
    assert all(s.num_pages == stored_tiles and s.page_size == F32.tile_bytes for s in scratch)
