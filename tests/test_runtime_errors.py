"""Bad input gets a typed error, raised early; afterwards accounting is exact and the device works."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import ttflow as tt
from ttflow import _ops

pytestmark = pytest.mark.anyio

F32 = tt.DataType.FLOAT32
DRAM_TILE = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE)
L1_TILE = tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE)


def relu_binary(shape: tuple[int, ...] = (3, 50)) -> tt.Binary:
    b = tt.ProgramBuilder("relu")
    b.output(b.relu(b.input(shape, DRAM_TILE)))
    return tt.Binary([b.build()])


async def still_works(device: tt.Device) -> None:
    data = np.arange(150, dtype=np.float32).reshape(3, 50) - 75
    (out,) = tt.submit(device, relu_binary(), 0, [tt.to_device(data, device)])
    np.testing.assert_array_equal(await tt.to_host(out), np.maximum(data, 0))
    del out


def used(device: tt.Device) -> tuple[int, int]:
    return device.memory_used(tt.MemorySpace.DRAM), device.memory_used(tt.MemorySpace.L1)


async def test_submit_checks_before_queuing() -> None:
    binary = relu_binary()
    async with tt.open_device(tt.DeviceSpec.small()) as device, tt.open_device(tt.DeviceSpec.small()) as other:
        good = tt.to_device(np.ones((3, 50), np.float32), device)
        wide = tt.to_device(np.ones((3, 51), np.float32), device)
        ints = tt.to_device(np.ones((3, 50), np.int32), device)
        foreign = tt.to_device(np.ones((3, 50), np.float32), other)
        gone = tt.to_device(np.ones((3, 50), np.float32), device)
        tt.deallocate(gone)
        for t in (good, wide, ints, foreign):
            await t
        before = (used(device), device.stats)
        with pytest.raises(tt.ProgramError, match="out of range"):
            tt.submit(device, binary, 1, [good])
        with pytest.raises(tt.ProgramError, match="takes 1 inputs"):
            tt.submit(device, binary, 0, [good, good])
        with pytest.raises(tt.ShapeError, match="shape"):
            tt.submit(device, binary, 0, [wide])
        with pytest.raises(tt.LayoutError, match="INT32"):
            tt.submit(device, binary, 0, [ints])
        with pytest.raises(tt.ProgramError, match="another|copy it"):
            tt.submit(device, binary, 0, [foreign])
        with pytest.raises(tt.DeallocatedTensorError):
            tt.submit(device, binary, 0, [gone])
        with pytest.raises(TypeError):
            tt.submit(device, binary, 0, [np.ones((3, 50), np.float32)])
        with pytest.raises(tt.ProgramError, match="Binary"):
            tt.submit(device, binary.programs[0], 0, [good])  # type: ignore[arg-type]
        assert used(device) == before[0] and device.stats == before[1]
        await still_works(device)


async def test_host_array_errors() -> None:
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        with pytest.raises(tt.ShapeError):
            tt.to_device(np.float32(1.0), device)
        with pytest.raises(tt.ShapeError):
            tt.to_device(np.ones((0, 3), np.float32), device)
        with pytest.raises(tt.LayoutError, match="float64"):
            tt.to_device(np.ones((2, 3)), device)
        with pytest.raises(tt.LayoutError):
            tt.to_device(np.ones((2, 3), np.complex64), device, tt.Layout(dtype=F32))
        t = tt.to_device(np.ones((2, 3)), device, tt.Layout(dtype=F32))  # explicit dtype casts
        np.testing.assert_array_equal(await tt.to_host(t), np.ones((2, 3), np.float32))
        with pytest.raises(tt.ShapeError):
            tt.write(t, np.ones((3, 2), np.float32))
        assert used(device) == (device.memory_used(tt.MemorySpace.DRAM), 0)
        await still_works(device)


async def test_l1_and_dram_exhaustion_raise_and_leave_the_device_usable() -> None:
    spec = tt.DeviceSpec.small()
    async with tt.open_device(spec) as device:
        base = used(device)
        big = np.ones((4 * 64, 64 * 16), np.float32)  # 64 KiB per bank > L1
        with pytest.raises(tt.OutOfMemoryError, match="L1"):
            tt.to_device(big, device, L1_TILE)
        with pytest.raises(tt.OutOfMemoryError, match="DRAM"):
            tt.empty((4096, 4097), F32, device, DRAM_TILE)
        assert used(device) == base
        await still_works(device)


async def test_program_outputs_that_do_not_fit_fail_only_their_dependents() -> None:
    spec = tt.DeviceSpec.small()
    b = tt.ProgramBuilder("big_l1_output")
    b.output(b.relu(b.input((4 * 64, 64 * 16), DRAM_TILE)), L1_TILE)  # 1 MiB > 256 KiB of L1
    binary = tt.Binary([b.build()])
    async with tt.open_device(spec) as device:
        base = used(device)
        big = tt.to_device(np.ones((4 * 64, 64 * 16), np.float32), device)
        (out,) = tt.submit(device, binary, 0, [big])
        (after,) = tt.submit(device, relu_binary((4 * 64, 64 * 16)), 0, [out])
        with pytest.raises(tt.OutOfMemoryError, match="L1"):
            await out
        with pytest.raises(tt.OutOfMemoryError):
            await tt.to_host(after)
        del out, after
        tt.deallocate(big)
        assert used(device) == base
        await still_works(device)


async def test_a_program_whose_kernel_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    class Exploding:
        def compute(self, *args: object, **kwargs: object) -> np.ndarray:
            raise RuntimeError("kernel fault")

    binary = relu_binary()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        base = used(device)
        x = tt.to_device(np.ones((3, 50), np.float32), device)
        monkeypatch.setitem(_ops.OPS, "relu", Exploding())
        (bad,) = tt.submit(device, binary, 0, [x])
        (dependent,) = tt.submit(device, binary, 0, [bad])
        with pytest.raises(RuntimeError, match="kernel fault"):
            await bad
        with pytest.raises(RuntimeError, match="kernel fault"):
            await tt.to_host(dependent)
        monkeypatch.undo()
        assert device.stats.commands_failed >= 2
        np.testing.assert_array_equal(await tt.to_host(x), np.ones((3, 50), np.float32))
        del bad, dependent
        tt.deallocate(x)
        assert used(device) == base
        await still_works(device)


async def test_cancelling_a_waiter_leaves_the_work_and_the_device_intact() -> None:
    data = np.arange(150, dtype=np.float32).reshape(3, 50)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        t = tt.to_device(data, device)
        (out,) = tt.submit(device, relu_binary(), 0, [t])
        with anyio.CancelScope() as scope:
            scope.cancel()
            await out
        assert scope.cancelled_caught
        with anyio.move_on_after(0):
            await tt.to_host(out)
        np.testing.assert_array_equal(await tt.to_host(out), data)
        await still_works(device)


async def test_closing_drains_pending_work_and_frees_everything() -> None:
    data = np.ones((3, 50), np.float32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        outs = [tt.submit(device, relu_binary(), 0, [tt.to_device(data * i, device)])[0] for i in range(5)]
        assert not outs[-1].done()
    assert all(o.done() for o in outs)
    assert used(device) == (0, 0) and device.stats.programs_run == 5
    for call in (lambda: tt.to_device(data, device), lambda: tt.submit(device, relu_binary(), 0, outs[:1]),
                 lambda: device.read_bank(tt.MemorySpace.DRAM, 0, 0, 4)):
        with pytest.raises(tt.DeviceClosedError):
            call()
    with pytest.raises(tt.DeviceClosedError):
        await tt.to_host(outs[0])


async def test_an_error_in_the_block_fails_pending_work_and_closes() -> None:
    data = np.ones((3, 50), np.float32)
    with pytest.raises(KeyError):
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            outs = [tt.submit(device, relu_binary(), 0, [tt.to_device(data, device)])[0] for _ in range(3)]
            raise KeyError("user bug")
    assert used(device) == (0, 0)
    with pytest.raises(tt.DeviceClosedError):
        await outs[-1]


async def test_cancelling_the_block_closes_cleanly() -> None:
    data = np.ones((3, 50), np.float32)
    with anyio.CancelScope() as scope:
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            outs = [tt.submit(device, relu_binary(), 0, [tt.to_device(data, device)])[0] for _ in range(3)]
            scope.cancel()
            await anyio.sleep(1)
    assert scope.cancelled_caught
    assert used(device) == (0, 0) and device.closed
    assert all(o.done() for o in outs)


async def test_batched_writes_fail_one_by_one() -> None:
    # Ready host writes share one worker-thread hand-off; a write that fails (NaN has no
    # BFLOAT8_B encoding) fails alone and the others land.
    bfp8 = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, tt.DataType.BFLOAT8_B)
    arrays = [np.full((256, 256), i + 1, np.float32) for i in range(6)]
    arrays[3][5, 5] = np.nan
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        with tt.record_trace(device) as recorder:
            tensors = [tt.to_device(a, device, bfp8) for a in arrays]
            with pytest.raises(tt.LayoutError, match="NaN"):
                await tensors[3]
            for i, t in enumerate(tensors):
                if i != 3:
                    np.testing.assert_array_equal(await tt.to_host(t), arrays[i])
        starts = {e["ts"] for e in recorder.events if e["ph"] == "X" and e["name"] == "write"}
        assert len(starts) == 1  # one batch
        assert device.stats.host_to_device_bytes == 5 * arrays[0].nbytes


async def test_to_layout_that_does_not_fit_fails_its_tensor_only() -> None:
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        big = tt.to_device(np.ones((4 * 64, 64 * 16), np.float32), device)  # 1 MiB > 256 KiB of L1
        base = used(device)
        moved = tt.to_layout(big, L1_TILE)
        with pytest.raises(tt.OutOfMemoryError, match="L1"):
            await moved
        with pytest.raises(tt.OutOfMemoryError):
            await tt.to_host(moved)
        np.testing.assert_array_equal(await tt.to_host(big), np.ones((4 * 64, 64 * 16), np.float32))
        del moved
        assert used(device) == base
        await still_works(device)
