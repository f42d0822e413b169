"""tt-mlir's `openMeshDevice` options on `tt.open_device` (issue 36): `num_hw_cqs`,
`l1_small_size`, `trace_region_size`, each with its meaning in the emulated memory map, checked
against the device spec's numbers and numpy, on asyncio and trio."""

from __future__ import annotations

import numpy as np
import pytest

import ttflow as tt
from ttflow._memory.banks import TRACE_BYTES_PER_COMMAND

pytestmark = pytest.mark.anyio

SMALL = tt.DeviceSpec.small()
F32 = tt.DataType.FLOAT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
DRAM_TILE = tt.Layout(DRAM, tt.TensorLayout.TILE)
L1_TILE = tt.Layout(L1, tt.TensorLayout.TILE)


def _affine() -> tt.Binary:
    b = tt.ProgramBuilder("affine")
    x = b.input((64, 64), DRAM_TILE)
    b.output(b.add(b.mul(x, 2.0), 1.0), DRAM_TILE)
    return tt.Binary([b.build()])


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


async def test_l1_small_size_keeps_the_top_of_every_l1_bank_from_buffers(anyio_backend: str) -> None:
    small = 8 * 1024 + 3  # rounded up to L1's 16-byte alignment
    reserved = _round_up(small, 16)
    async with tt.open_device(SMALL) as plain, tt.open_device(SMALL, l1_small_size=small) as device:
        assert device.options.l1_small_size == small
        banks = SMALL.banks(L1)
        assert plain.memory_free(L1) - device.memory_free(L1) == reserved * banks
        assert device.memory_view(L1).total == (SMALL.l1_bank_bytes - reserved) * banks
        x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
        t = tt.to_device(x, device, L1_TILE)
        await t
        assert t.buffer is not None
        depth = _round_up(-(-t.buffer.num_pages // banks), 1) * t.buffer.aligned_page_size
        assert t.buffer.address + depth <= SMALL.l1_bank_bytes - reserved  # below the region
        np.testing.assert_array_equal(await tt.to_host(t), x)


async def test_trace_buffers_live_in_the_trace_region_and_can_run_out_of_it(anyio_backend: str) -> None:
    binary = _affine()
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    banks = SMALL.banks(DRAM)
    region = 4 * _round_up(-(-TRACE_BYTES_PER_COMMAND // banks), 32)  # room for four commands
    async with tt.open_device(SMALL, trace_region_size=region) as device:
        assert device.memory_free(DRAM) == (SMALL.dram_bank_bytes - region) * banks
        t = tt.to_device(x, device, DRAM_TILE)
        await t
        used = device.memory_used(DRAM)
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, binary, 0, [t])
            (z,) = tt.submit(device, binary, 0, [y])
        tt.execute_trace(trace)
        np.testing.assert_allclose(await tt.to_host(z), (x * 2 + 1) * 2 + 1, rtol=1e-6)
        buffers = [b for b in device.memory_view(DRAM).buffers if b.kind == "trace_buffer"]
        assert len(buffers) == 1 and buffers[0].address >= SMALL.dram_bank_bytes - region
        assert buffers[0].depth == _round_up(-(-2 * TRACE_BYTES_PER_COMMAND // banks), 32)
        assert device.memory_used(DRAM) > used  # the trace's pinned buffers, not its trace buffer
        # Three more commands do not fit beside the two: the block raises, the work ran once.
        with pytest.raises(tt.TraceError, match="trace region"):
            with tt.capture_trace(device) as big:
                outs = [tt.submit(device, binary, 0, [t])[0] for _ in range(3)]
        for out in outs:
            np.testing.assert_allclose(await tt.to_host(out), x * 2 + 1, rtol=1e-6)
        with pytest.raises(tt.TraceError, match="trace region"):
            tt.execute_trace(big)
        tt.release_trace(trace)
        await device.synchronize()
        assert not [b for b in device.memory_view(DRAM).buffers if b.kind == "trace_buffer"]
        with tt.capture_trace(device) as again:  # the region is free again: three fit now
            outs = [tt.submit(device, binary, 0, [t])[0] for _ in range(3)]
        tt.execute_trace(again)
        np.testing.assert_allclose(await tt.to_host(outs[-1]), x * 2 + 1, rtol=1e-6)
    async with tt.open_device(SMALL, trace_region_size=0) as device:  # tt-metal's default: none
        t = tt.to_device(x, device, DRAM_TILE)
        with pytest.raises(tt.TraceError, match="trace region"):
            with tt.capture_trace(device):
                tt.submit(device, binary, 0, [t])


async def test_one_hardware_queue_carries_the_writes_behind_the_programs(anyio_backend: str) -> None:
    binary = _affine()
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(4)]
    for queues, write_track in ((1, "CQ0"), (2, "CQ1")):
        async with tt.open_device(SMALL, num_hw_cqs=queues) as device:
            slots = [tt.empty((64, 64), F32, device, DRAM_TILE) for _ in range(2)]
            outs = []
            with tt.record_timeline(device) as recorder:
                for i, batch in enumerate(batches):
                    tt.write(slots[i % 2], batch)
                    outs.append(tt.submit(device, binary, 0, [slots[i % 2]])[0])
                got = [await tt.to_host(o) for o in outs]
            for batch, value in zip(batches, got):
                np.testing.assert_allclose(value, batch * 2 + 1, rtol=1e-6)
            summary = recorder.queue_summary()
            writes = [e for e in recorder.events if e.get("cat") == "WriteCommand"]
            assert len(writes) == 6  # the two slots' zero fills and the four batches
            assert {e["tid"] for e in writes} == {0 if write_track == "CQ0" else 1}
            if queues == 1:
                assert summary["CQ1"]["commands"] == 0


@pytest.mark.parametrize("options, message", [
    ({"num_hw_cqs": 3}, "num_hw_cqs must be 1 or 2"),
    ({"num_hw_cqs": True}, "num_hw_cqs must be 1 or 2"),
    ({"l1_small_size": -1}, "l1_small_size must be a non-negative int"),
    ({"l1_small_size": 1.5}, "l1_small_size must be a non-negative int"),
    ({"trace_region_size": "big"}, "trace_region_size must be a non-negative int"),
    ({"l1_small_size": SMALL.l1_bank_bytes}, "leaves no room"),
    ({"trace_region_size": SMALL.dram_bank_bytes}, "leaves no room"),
])
async def test_bad_options_are_refused_before_the_device_opens(
        anyio_backend: str, options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        async with tt.open_device(SMALL, **options):  # type: ignore[arg-type]
            pass


async def test_a_mesh_gives_every_chip_the_options(anyio_backend: str) -> None:
    spec = tt.MeshSpec((1, 2), chip=SMALL)
    async with tt.open_mesh_device(spec, l1_small_size=4096, num_hw_cqs=1) as mesh:
        assert [chip.options.l1_small_size for chip in mesh.chips] == [4096, 4096]
        assert all(chip.memory_view(L1).total == (SMALL.l1_bank_bytes - 4096) * SMALL.banks(L1)
                   for chip in mesh.chips)


async def test_one_hardware_queue_still_refuses_host_transfers_in_a_capture(anyio_backend: str) -> None:
    binary = _affine()
    async with tt.open_device(SMALL, num_hw_cqs=1) as device:
        t = tt.to_device(np.ones((64, 64), np.float32), device, DRAM_TILE)
        with tt.capture_trace(device):
            tt.submit(device, binary, 0, [t])
            with pytest.raises(tt.TraceError, match="host transfers"):
                tt.write(t, np.zeros((64, 64), np.float32))  # on CQ0 now, a transfer still
        np.testing.assert_array_equal(await tt.to_host(t), np.ones((64, 64), np.float32))
