"""Bad input gets a typed error, raised early; afterwards accounting is exact and the device works."""

from __future__ import annotations

import anyio
import ml_dtypes
import attrs
import numpy as np
import pytest

import ttflow as tt
from ttflow._ir import ops as _ops

pytestmark = pytest.mark.anyio

F32, BF16, BF8 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B
I32, U32 = tt.DataType.INT32, tt.DataType.UINT32
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
            tt.submit(device, binary, 0, [[1.0] * 50])
        with pytest.raises(tt.ShapeError, match="host array of shape"):  # checked before it is copied
            tt.submit(device, binary, 0, [np.ones((3, 51), np.float32)])
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


def tile(dtype: tt.DataType) -> tt.Layout:
    return tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, dtype)


async def test_write_takes_only_the_tensors_host_dtype_and_shape() -> None:
    # write never converts: the array's dtype must be tensor.dtype.host_dtype (float32 for
    # BFLOAT8_B) and its shape the tensor's. Before, anything numeric was cast on the device
    # side: 3e10 became -2147483648 in an INT32 tensor, lists and bools went through.
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        ints = tt.to_device(np.arange(6, dtype=np.int32).reshape(2, 3), device)
        floats = tt.to_device(np.ones((2, 3), np.float32), device)
        halves = tt.to_device(np.ones((2, 3), ml_dtypes.bfloat16), device)
        blocks = tt.to_device(np.ones((2, 3), np.float32), device, tile(BF8))
        for t in (ints, floats, halves, blocks):
            await t
        before = (used(device), device.stats)
        bad = [
            (ints, np.array([[3e10, 1, 2], [3, 4, 5]], np.float32), r"float32.*INT32.*astype\(np\.int32\)"),
            (ints, np.arange(6).reshape(2, 3), r"int64.*INT32.*astype\(np\.int32\)"),
            (ints, np.ones((2, 3), bool), r"bool.*INT32"),
            (ints, np.ones((2, 3), np.uint32), r"uint32.*INT32"),
            (floats, np.ones((2, 3)), r"float64.*FLOAT32.*astype\(np\.float32\)"),
            (floats, np.ones((2, 3), np.int32), r"int32.*FLOAT32"),
            (floats, np.ones((2, 3), ml_dtypes.bfloat16), r"bfloat16.*FLOAT32"),
            (halves, np.ones((2, 3), np.float32), r"float32.*BFLOAT16.*ml_dtypes\.bfloat16"),
            (blocks, np.ones((2, 3), ml_dtypes.bfloat16), r"bfloat16.*BFLOAT8_B.*np\.float32"),
            (blocks, np.array([[1, np.nan, 2], [3, 4, 5]], np.float32), r"NaN.*index 1"),
            (blocks, np.array([[1, 2, 3], [4, 5, -np.inf]], np.float32), r"infinity.*index 5"),
        ]
        for tensor, array, match in bad:
            with pytest.raises(tt.LayoutError, match=match):
                tt.write(tensor, array)
        for tensor in (ints, floats):
            with pytest.raises(tt.LayoutError, match="numpy array"):
                tt.write(tensor, [[1, 2, 3], [4, 5, 6]])
            with pytest.raises(tt.LayoutError, match="numpy array"):
                tt.write(tensor, 1.0)
        with pytest.raises(tt.ShapeError, match=r"\(3, 2\).*\(2, 3\)"):
            tt.write(floats, np.ones((3, 2), np.float32))
        with pytest.raises(tt.ShapeError, match=r"0-d"):
            tt.write(floats, np.float32(1.0))
        assert (used(device), device.stats) == before  # nothing allocated, queued or counted
        np.testing.assert_array_equal(await tt.to_host(ints), np.arange(6, dtype=np.int32).reshape(2, 3))
        np.testing.assert_array_equal(await tt.to_host(blocks), np.ones((2, 3), np.float32))
        tt.write(ints, np.full((2, 3), 7, np.int32))  # the right dtype still writes
        tt.write(blocks, np.full((2, 3), 0.5, np.float32))
        np.testing.assert_array_equal(await tt.to_host(ints), np.full((2, 3), 7, np.int32))
        np.testing.assert_array_equal(await tt.to_host(blocks), np.full((2, 3), 0.5, np.float32))
        for t in (ints, floats, halves, blocks):
            tt.deallocate(t)
        assert used(device) == (0, 0)
        await still_works(device)


async def test_to_device_takes_numpy_arrays_and_converts_only_floats_to_floats() -> None:
    # The array's dtype must be a device dtype, or the layout's host dtype; the one conversion
    # is float to float when the layout names a float dtype (ttnn's from_torch(dtype=...)),
    # and a finite value that would become infinity is refused. Before, lists and strings went
    # through np.asarray, and any numeric array was cast to the layout's dtype.
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        base = used(device), device.stats
        refused: list[tuple[object, tt.Layout | None, str]] = [
            ("hello", None, "numpy array"),
            ([[1.0, 2.0]], None, "numpy array"),
            ([[1.0, 2.0]], tt.Layout(dtype=F32), "numpy array"),
            ((1, 2), tt.Layout(dtype=I32), "numpy array"),
            (np.array(["a", "b"]), None, r"<U1.*astype"),
            (np.array([1, "a"], object), None, r"object.*astype"),
            (np.array(["a", "b"]), tt.Layout(dtype=F32), r"<U1.*FLOAT32"),
            (np.ones(3), None, r"float64.*astype\(np\.float32\).*Layout\(dtype"),
            (np.ones(3, np.int64), None, r"int64.*astype"),
            (np.ones(3, bool), None, r"bool"),
            (np.ones(3, np.int64), tt.Layout(dtype=I32), r"int64.*INT32.*astype\(np\.int32\)"),
            (np.ones(3, np.int32), tt.Layout(dtype=U32), r"int32.*UINT32"),
            (np.ones(3, bool), tt.Layout(dtype=I32), r"bool.*INT32"),
            (np.array([3e10], np.float32), tt.Layout(dtype=I32), r"float32.*INT32.*only between float"),
            (np.ones(3, np.int32), tt.Layout(dtype=F32), r"int32.*FLOAT32.*only between float"),
            (np.ones(3, np.int32), tile(BF8), r"int32.*BFLOAT8_B"),
            (np.array([1.0, 1e300]), tt.Layout(dtype=F32), r"1e\+300.*index 1.*FLOAT32.*infinity"),
            (np.array([3.4e38], np.float32), tt.Layout(dtype=BF16), r"BFLOAT16.*infinity"),
            (np.array([[1.0, np.nan]], np.float32), tile(BF8), r"NaN.*index 1"),
            (np.array([[np.inf]], ml_dtypes.bfloat16), tile(BF8), r"infinity"),
        ]
        for array, layout, match in refused:
            with pytest.raises(tt.LayoutError, match=match):
                tt.to_device(array, device, layout)
        with pytest.raises(tt.ShapeError, match="0-d"):
            tt.to_device(np.array(1.0, np.float32), device)
        assert (used(device), device.stats) == base  # refused before allocating or queuing
        accepted = [
            (np.array([1.5, 1e30]), tt.Layout(dtype=F32), np.array([1.5, 1e30], np.float32)),
            (np.array([1.0 + 2**-10, np.inf, -np.inf], np.float32), tt.Layout(dtype=BF16),
             np.array([1.0, np.inf, -np.inf], ml_dtypes.bfloat16)),  # infinity is not an overflow
            (np.array([[0.5, -3.0]], ml_dtypes.bfloat16), tile(BF8), np.array([[0.5, -3.0]], np.float32)),
            (np.array([[2.0, 4.0]], np.float16), tile(F32), np.array([[2.0, 4.0]], np.float32)),
        ]
        for array, layout, want in accepted:
            t = tt.to_device(array, device, layout)
            back = await tt.to_host(t)
            assert back.dtype == want.dtype
            np.testing.assert_array_equal(back, want)
            tt.deallocate(t)
        assert used(device) == base[0]
        await still_works(device)


async def test_to_device_and_empty_check_their_other_arguments() -> None:
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        base = used(device), device.stats
        with pytest.raises(tt.LayoutError, match="tt.Layout"):
            tt.to_device(np.ones(3, np.float32), device, "L1")  # type: ignore[arg-type]
        with pytest.raises(tt.LayoutError, match="tt.Layout"):
            tt.empty((3,), F32, device, tt.MemorySpace.L1)  # type: ignore[arg-type]
        with pytest.raises(tt.LayoutError, match="from_numpy"):
            tt.empty((3,), np.float32, device)  # type: ignore[arg-type]
        for shape in ((32, 1.5), (32, 2.0), (32, float("inf")), (32, float("nan")), (True, 32), 32):
            with pytest.raises(tt.ShapeError):
                tt.empty(shape, F32, device)  # type: ignore[arg-type]
        # Page counts are exact Python ints: a huge shape is out of memory, not an OverflowError.
        for shape, layout in (((2**1100, 32), DRAM_TILE), ((2**70, 2**70), DRAM_TILE),
                              ((2**1100, 32), tt.Layout())):
            with pytest.raises(tt.OutOfMemoryError, match="DRAM"):
                tt.empty(shape, F32, device, layout)
        assert (used(device), device.stats) == base
        t = tt.empty((np.int64(3), np.uint8(50)), F32, device)  # numpy integers are dims
        assert t.shape == (3, 50) and all(type(d) is int for d in t.shape)
        np.testing.assert_array_equal(await tt.to_host(t), np.zeros((3, 50), np.float32))
        tt.deallocate(t)
        assert used(device) == base[0]
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
    def exploding(*args: object, **kwargs: object) -> np.ndarray:
        raise RuntimeError("kernel fault")

    binary = relu_binary()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        base = used(device)
        x = tt.to_device(np.ones((3, 50), np.float32), device)
        monkeypatch.setitem(_ops.OPS, "relu", attrs.evolve(_ops.OPS["relu"], fn=exploding, page=None))
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


async def test_a_range_checked_result_that_would_wrap_fails_its_program_only() -> None:
    """`checking_range` on the device: the run fails with the note instead of storing a wrapped
    INT32; its dependents fail, its inputs and the device stay as they were."""
    b = tt.ProgramBuilder("scaled")
    x = b.input((2, 40), tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, I32))
    with b.checking_range("int64 x * 70000"):
        b.output(b.add(b.mul(x, 70000), 1), tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, I32))
    binary = tt.Binary([b.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        base = used(device)
        fits = np.arange(80, dtype=np.int32).reshape(2, 40)
        (ok,) = tt.submit(device, binary, 0, [tt.to_device(fits, device, binary.programs[0].inputs[0].layout)])
        np.testing.assert_array_equal(await tt.to_host(ok), fits.astype(np.int64) * 70000 + 1)
        wraps = fits * 1000
        x_big = tt.to_device(wraps, device, binary.programs[0].inputs[0].layout)
        (bad,) = tt.submit(device, binary, 0, [x_big])
        (dependent,) = tt.submit(device, binary, 0, [bad])
        with pytest.raises(tt.ProgramError, match=r"int64 x \* 70000: a result of mul, \d+, does not fit INT32"):
            await tt.to_host(bad)
        with pytest.raises(tt.ProgramError, match="does not fit INT32"):
            await dependent
        np.testing.assert_array_equal(await tt.to_host(x_big), wraps)
        del ok, bad, dependent
        tt.deallocate(x_big)
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
    # BFLOAT8_B encoding) fails alone and the others land. to_device refuses a NaN it can see,
    # so the NaN is planted after it (the array is read when the copy runs: nothing has run
    # before the first await).
    bfp8 = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, tt.DataType.BFLOAT8_B)
    arrays = [np.full((256, 256), i + 1, np.float32) for i in range(6)]
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        with tt.record_timeline(device) as recorder:
            tensors = [tt.to_device(a, device, bfp8) for a in arrays]
            arrays[3][5, 5] = np.nan
            with pytest.raises(tt.LayoutError, match="NaN"):
                await tensors[3]
            for i, t in enumerate(tensors):
                if i != 3:
                    np.testing.assert_array_equal(await tt.to_host(t), arrays[i])
        writes = [e for e in recorder.events if e["ph"] == "X" and e["name"] == "write"]
        assert len(writes) == 6  # one batch: each but the first ran with the one before
        assert [bool(e["args"].get("ran_with_previous")) for e in writes] == [False] + [True] * 5
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
