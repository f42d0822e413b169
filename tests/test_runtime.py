"""The runtime API against plain-numpy references, on asyncio and trio."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import ttflow as tt
from reference import round_to, tilize
from ttflow import _commands
from ttflow._commands import Plan

pytestmark = pytest.mark.anyio

F32, BF16, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.INT32
DRAM_RM = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.ROW_MAJOR)
DRAM_TILE = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE)
L1_TILE = tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE)
L1_RM = tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.ROW_MAJOR)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def mlp_binary(batch: int = 4, d_in: int = 40, hidden: int = 48, d_out: int = 10,
               w_layout: tt.Layout = L1_TILE) -> tt.Binary:
    b = tt.ProgramBuilder("mlp")
    x = b.input((batch, d_in), tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32))
    w1 = b.input((d_in, hidden), tt.Layout(w_layout.memory, w_layout.tensor_layout, F32))
    w2 = b.input((hidden, d_out), tt.Layout(w_layout.memory, w_layout.tensor_layout, F32))
    b.output(b.matmul(b.relu(b.matmul(x, w1)), w2), DRAM_TILE)
    return tt.Binary([b.build()])


def mlp_reference(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    return np.maximum(x @ w1, 0) @ w2


def elementwise_binary() -> tt.Binary:
    """program 0: a + b; program 1: a * 0.5 + 1 (one input); program 2: relu(a) - b, to bf16."""
    progs = []
    b = tt.ProgramBuilder("add")
    x, y = b.input((3, 50), DRAM_TILE), b.input((3, 50), DRAM_TILE)
    b.output(b.add(x, y))
    progs.append(b.build())
    b = tt.ProgramBuilder("affine")
    x = b.input((3, 50), DRAM_TILE)
    b.output(b.add(b.mul(x, 0.5), 1.0))
    progs.append(b.build())
    b = tt.ProgramBuilder("relu_sub")
    x, y = b.input((3, 50), DRAM_TILE), b.input((3, 50), DRAM_TILE)
    b.output(b.sub(b.relu(x), y), tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.ROW_MAJOR, BF16))
    progs.append(b.build())
    return tt.Binary(progs)


@pytest.mark.parametrize("dtype", [F32, BF16, tt.DataType.UINT32, I32])
@pytest.mark.parametrize("layout", [DRAM_RM, DRAM_TILE, L1_TILE, L1_RM])
async def test_round_trip_every_dtype_and_layout(dtype: tt.DataType, layout: tt.Layout) -> None:
    data = (rng().standard_normal((2, 37, 70)) * 100).astype(dtype.host_dtype)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        t = tt.to_device(data, device, layout)
        back = await tt.to_host(t)
        assert back.dtype == dtype.host_dtype and back.shape == data.shape
        np.testing.assert_array_equal(back, data)
        assert device.stats.host_to_device_bytes == data.nbytes
        assert device.stats.device_to_host_bytes == data.nbytes


async def test_tile_pages_sit_at_the_interleaving_formula() -> None:
    data = rng().standard_normal((70, 100)).astype(np.float32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        t = await tt.to_device(data, device, DRAM_TILE)
        buf = t.buffer
        assert buf is not None and buf.page_size == 4096 and buf.num_pages == 3 * 4
        tiles = tilize(data).view(np.uint8).reshape(-1, 4096)
        for page in range(buf.num_pages):
            bank, row = page % 4, page // 4
            raw = device.read_bank(tt.MemorySpace.DRAM, bank, buf.address + row * buf.aligned_page_size, 4096)
            assert raw == tiles[page].tobytes()


async def test_bfloat8_b_tensor_is_tile_only_and_rounds() -> None:
    data = rng().standard_normal((33, 40)).astype(np.float32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        with pytest.raises(tt.LayoutError):
            tt.to_device(data, device, tt.Layout(dtype=tt.DataType.BFLOAT8_B))
        t = tt.to_device(data, device, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, tt.DataType.BFLOAT8_B))
        back = await tt.to_host(t)
        assert back.dtype == np.float32
        # Each row of 16 shares an exponent: error at most half a step of 2^(e-6).
        np.testing.assert_allclose(back, data, atol=np.abs(data).max() * 2.0**-6)
        assert t.buffer is not None and t.buffer.page_size == 1088


async def test_submit_is_non_blocking_and_matches_numpy() -> None:
    r = rng(1)
    a, b = r.standard_normal((2, 3, 50)).astype(np.float32)
    binary = elementwise_binary()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        ta, tb = tt.to_device(a, device), tt.to_device(b, device)
        (out,) = tt.submit(device, binary, 0, [ta, tb])
        assert not out.done() and out.buffer is None  # nothing has run: no await happened yet
        assert out.shape == (3, 50) and out.dtype is F32
        np.testing.assert_array_equal(await tt.to_host(out), a + b)
        assert out.done() and out.buffer is not None
        (aff,) = tt.submit(device, binary, 1, [out])
        (rs,) = tt.submit(device, binary, 2, [aff, tb])
        result = await tt.to_host(rs)
        assert result.dtype == tt.DataType.BFLOAT16.host_dtype
        expected = round_to(np.maximum((a + b) * 0.5 + 1, 0) - b, "bfloat16")
        np.testing.assert_array_equal(result.astype(np.float32), expected)


async def test_resident_weights_pushed_once_converted_once() -> None:
    r = rng(2)
    w1 = r.standard_normal((40, 48)).astype(np.float32)
    w2 = r.standard_normal((48, 10)).astype(np.float32)
    binary = mlp_binary()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tw1, tw2 = tt.to_device(w1, device), tt.to_device(w2, device)  # DRAM row-major
        xs = [r.standard_normal((4, 40)).astype(np.float32) for _ in range(5)]
        outs = [tt.submit(device, binary, 0, [tt.to_device(x, device), tw1, tw2])[0] for x in xs]
        for x, out in zip(xs, outs):
            np.testing.assert_allclose(await tt.to_host(out), mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-4)
        s = device.stats
        assert s.host_to_device_bytes == w1.nbytes + w2.nbytes + sum(x.nbytes for x in xs)
        # Weights converted (DRAM row-major -> L1 tile) once, each batch (row-major -> tile) once.
        assert s.layout_conversions == 2 + len(xs)
        assert s.programs_run == 5
        assert len(tw1.storages) == 2 and tw1.layout == tt.Layout(dtype=F32)


async def test_stitching_and_past_cache_never_touch_the_host() -> None:
    r = rng(3)
    b = tt.ProgramBuilder("step")
    cache = b.input((8, 32), DRAM_TILE)
    x = b.input((8, 32), DRAM_TILE)
    new_cache = b.add(b.mul(cache, 0.5), x)
    b.output(new_cache)
    b.output(b.sum(new_cache, axis=-1))
    binary = tt.Binary([b.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        c = np.zeros((8, 32), np.float32)
        tc = tt.to_device(c, device, DRAM_TILE)
        sums = []
        for _ in range(6):
            x = r.standard_normal((8, 32)).astype(np.float32)
            tc, ts = tt.submit(device, binary, 0, [tc, tt.to_device(x, device, DRAM_TILE)])
            sums.append(ts)
            c = c * np.float32(0.5) + x
        before = device.stats.device_to_host_bytes
        assert before == 0
        np.testing.assert_allclose(await tt.to_host(tc), c, rtol=1e-6)
        np.testing.assert_allclose(await tt.to_host(sums[-1]), c.sum(-1, keepdims=True), rtol=1e-5)
        assert device.stats.device_to_host_bytes == c.nbytes + 8 * 4
        assert device.stats.layout_conversions == 0


async def test_training_loop_updates_weights_on_device() -> None:
    r = rng(4)
    n, d = 64, 8
    X = r.standard_normal((n, d)).astype(np.float32)
    w_true = r.standard_normal((d, 1)).astype(np.float32)
    y = X @ w_true
    lr = np.float32(0.1)
    b = tt.ProgramBuilder("sgd_step")
    w = b.input((d, 1), DRAM_TILE)
    xs = b.input((n, d), DRAM_TILE)
    ys = b.input((n, 1), DRAM_TILE)
    err = b.sub(b.matmul(xs, w), ys)
    grad = b.mul(b.matmul(b.transpose(xs), err), float(2.0 / n))
    b.output(b.sub(w, b.mul(grad, float(lr))))
    b.output(b.sum(b.mul(err, err), axis=0))
    binary = tt.Binary([b.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tx, ty = tt.to_device(X, device, DRAM_TILE), tt.to_device(y, device, DRAM_TILE)
        tw = tt.to_device(np.zeros((d, 1), np.float32), device, DRAM_TILE)
        w_ref = np.zeros((d, 1), np.float32)
        losses = []
        for _ in range(30):
            tw, loss = tt.submit(device, binary, 0, [tw, tx, ty])
            losses.append(loss)
            e = X @ w_ref - y
            w_ref = w_ref - (X.T @ e * np.float32(2.0 / n)) * lr
        final = await tt.to_host(tw)
        pushed = device.stats.host_to_device_bytes
        first, last = await tt.to_host(losses[0]), await tt.to_host(losses[-1])
        assert last[0, 0] < first[0, 0] * 0.01
        np.testing.assert_allclose(final, w_ref, rtol=1e-3, atol=1e-4)
        assert pushed == X.nbytes + y.nbytes + d * 4
        assert device.stats.device_to_host_bytes == d * 4 + 2 * 4


async def test_eviction_moves_parked_l1_tensor_to_dram_intact() -> None:
    r = rng(5)
    parked = r.standard_normal((64, 64)).astype(np.float32)
    a, b = r.standard_normal((2, 3, 50)).astype(np.float32)
    binary = elementwise_binary()
    async with tt.open_device(tt.DeviceSpec.small(), eviction="eager") as device:
        tp = await tt.to_device(parked, device, L1_TILE)
        assert tp.layout.memory is tt.MemorySpace.L1
        assert device.memory_used(tt.MemorySpace.L1) == 4 * 4096
        (out,) = tt.submit(device, binary, 0, [tt.to_device(a, device), tt.to_device(b, device)])
        await out
        assert tp.layout == tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
        assert device.stats.evictions == 1 and device.stats.eviction_bytes == 4 * 4096
        assert device.memory_used(tt.MemorySpace.L1) == 0
        np.testing.assert_array_equal(await tt.to_host(tp), parked)


async def test_evicting_a_conversion_with_a_dram_copy_moves_no_bytes() -> None:
    r = rng(6)
    w1 = r.standard_normal((40, 48)).astype(np.float32)
    w2 = r.standard_normal((48, 10)).astype(np.float32)
    x = r.standard_normal((4, 40)).astype(np.float32)
    mlp = mlp_binary()
    other = elementwise_binary()
    async with tt.open_device(tt.DeviceSpec.small(), eviction="eager") as device:
        tw1 = tt.to_device(w1, device, DRAM_TILE)
        tw2 = tt.to_device(w2, device, DRAM_TILE)
        (y1,) = tt.submit(device, mlp, 0, [tt.to_device(x, device, DRAM_TILE), tw1, tw2])
        await y1
        assert {layout.memory for layout, _ in tw1.storages} == {tt.MemorySpace.DRAM, tt.MemorySpace.L1}
        a = tt.to_device(np.ones((3, 50), np.float32), device)
        (z,) = tt.submit(device, other, 1, [a])
        await z
        s = device.stats
        assert s.evictions == 2 and s.eviction_bytes == 0
        assert len(tw1.storages) == 1 and device.memory_used(tt.MemorySpace.L1) == 0
        (y2,) = tt.submit(device, mlp, 0, [tt.to_device(x, device, DRAM_TILE), tw1, tw2])
        np.testing.assert_allclose(await tt.to_host(y2), await tt.to_host(y1), rtol=0, atol=0)


async def test_to_layout_converts_and_counts() -> None:
    data = rng(7).standard_normal((5, 40)).astype(np.float32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        t = tt.to_device(data, device)
        bf = tt.to_layout(t, tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE, BF16))
        assert bf.dtype is BF16
        back = await tt.to_host(bf)
        np.testing.assert_array_equal(back.astype(np.float32), round_to(data, "bfloat16"))
        assert device.stats.layout_conversions == 1
        with pytest.raises(tt.LayoutError):
            tt.to_layout(t, tt.Layout(dtype=tt.DataType.BFLOAT8_B))


async def test_double_buffering_with_empty_and_write_orders_write_after_read() -> None:
    r = rng(8)
    binary = elementwise_binary()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        bufs = [tt.empty((3, 50), F32, device, DRAM_TILE) for _ in range(2)]
        np.testing.assert_array_equal(await tt.to_host(bufs[0]), np.zeros((3, 50), np.float32))
        addresses = [t.buffer.address for t in bufs]  # type: ignore[union-attr]
        batches = [r.standard_normal((3, 50)).astype(np.float32) for _ in range(6)]
        outs = []
        for i, batch in enumerate(batches):
            buf = bufs[i % 2]
            tt.write(buf, batch)  # queued after the program two iterations back that read buf
            outs.append(tt.submit(device, binary, 1, [buf])[0])
        for batch, out in zip(batches, outs):
            np.testing.assert_allclose(await tt.to_host(out), batch * 0.5 + 1, rtol=1e-6)
        assert [t.buffer.address for t in bufs] == addresses  # type: ignore[union-attr]
        await bufs[1]
        np.testing.assert_array_equal(await tt.to_host(bufs[1]), batches[-1])


async def test_write_drops_stale_conversions() -> None:
    mlp = mlp_binary()
    r = rng(9)
    w1, w1b = r.standard_normal((2, 40, 48)).astype(np.float32)
    w2 = r.standard_normal((48, 10)).astype(np.float32)
    x = r.standard_normal((4, 40)).astype(np.float32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tw1, tw2 = tt.to_device(w1, device), tt.to_device(w2, device)
        tx = tt.to_device(x, device, DRAM_TILE)
        (y1,) = tt.submit(device, mlp, 0, [tx, tw1, tw2])
        tt.write(tw1, w1b)
        (y2,) = tt.submit(device, mlp, 0, [tx, tw1, tw2])
        np.testing.assert_allclose(await tt.to_host(y1), mlp_reference(x, w1, w2), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(await tt.to_host(y2), mlp_reference(x, w1b, w2), rtol=1e-4, atol=1e-4)
        assert device.stats.layout_conversions == 3  # w1 twice (new value), w2 once


async def test_deallocate_frees_after_queued_readers() -> None:
    data = np.ones((3, 50), np.float32)
    binary = elementwise_binary()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        base = device.memory_used(tt.MemorySpace.DRAM)
        t = tt.to_device(data, device)
        (out,) = tt.submit(device, binary, 1, [t])
        tt.deallocate(t)
        assert device.memory_used(tt.MemorySpace.DRAM) > base  # still needed by the queued program
        np.testing.assert_array_equal(await tt.to_host(out), data * 0.5 + 1)
        tt.deallocate(out)
        assert device.memory_used(tt.MemorySpace.DRAM) == base
        for use in (lambda: tt.submit(device, binary, 1, [t]), lambda: tt.write(t, data),
                    lambda: tt.to_layout(t, DRAM_TILE)):
            with pytest.raises(tt.DeallocatedTensorError):
                use()
        with pytest.raises(tt.DeallocatedTensorError):
            await tt.to_host(t)
        with pytest.raises(tt.DeallocatedTensorError):
            await t


async def test_dropped_tensors_give_their_memory_back() -> None:
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        t = await tt.to_device(np.ones((64, 64), np.float32), device, L1_TILE)
        assert device.memory_used(tt.MemorySpace.L1) > 0
        del t
        assert device.memory_used(tt.MemorySpace.L1) == 0


async def test_synchronize_waits_for_every_queued_command() -> None:
    r = rng(11)
    a, b = r.standard_normal((2, 3, 50)).astype(np.float32)
    binary = elementwise_binary()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        ta, tb = tt.to_device(a, device), tt.to_device(b, device)
        chain = [ta]
        for _ in range(6):  # CQ0 programs, each reading the last, behind CQ1 writes
            chain.append(tt.submit(device, binary, 0, [chain[-1], tb])[0])
        late = tt.to_device(b, device)
        assert not any(t.done() for t in chain[1:]) and not late.done()
        await device.synchronize()
        assert all(t.done() for t in chain) and late.done()
        assert device.stats.commands_run >= 9
        expected = a
        for _ in range(6):
            expected = expected + b
        np.testing.assert_array_equal(await tt.to_host(chain[-1]), expected)
        await device.synchronize()  # nothing queued: returns at once


async def test_cq1_write_overlaps_a_cq0_program() -> None:
    # Large enough that both commands go to worker threads; the kernels and the matmul release
    # the GIL, so the write of the next batch runs while the program reads the other buffer.
    b = tt.ProgramBuilder("wide")
    x = b.input((1024, 1024), DRAM_TILE)
    w = b.input((1024, 256), DRAM_TILE)
    b.output(b.relu(b.matmul(x, w)))
    binary = tt.Binary([b.build()])
    r = rng(10)
    batches = [r.standard_normal((1024, 1024)).astype(np.float32) for _ in range(2)]
    async with tt.open_device() as device:
        tw = tt.to_device(r.standard_normal((1024, 256)).astype(np.float32), device, DRAM_TILE)
        bufs = [tt.empty((1024, 1024), F32, device, DRAM_TILE) for _ in range(2)]
        for buf in bufs:
            await buf
        with tt.record_timeline(device) as recorder:
            outs = []
            for i in range(6):
                tt.write(bufs[i % 2], batches[i % 2])
                outs.append(tt.submit(device, binary, 0, [bufs[i % 2], tw])[0])
            for out in outs:
                await out
        spans = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in recorder.events if e["ph"] == "X"]
        writes = [(s, e) for tid, s, e in spans if tid == 1]
        programs = [(s, e) for tid, s, e in spans if tid == 0]
        overlapped = sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in writes for s2, e2 in programs)
        assert overlapped > 0, "no CQ1 write ran while a CQ0 program ran"


async def test_a_queues_slices_follow_one_another_even_when_writes_ran_as_a_batch() -> None:
    # Small writes queued together run as one batch on CQ1's worker and share a start time: each
    # still gets its own slice, after the one before, never nested in it or partly over it.
    arrays = [np.full((32, 32), i, np.float32) for i in range(16)]
    async with tt.open_device(tt.DeviceSpec.small(), inline_seconds=-1) as device:
        b = tt.ProgramBuilder("inc")
        b.output(b.add(b.input((32, 32)), 1.0))
        binary = tt.Binary([b.build()])
        with tt.record_timeline(device) as recorder:
            tensors = [tt.to_device(a, device) for a in arrays]
            outs = [tt.submit(device, binary, 0, [t])[0] for t in tensors]
            for out, a in zip(outs, arrays):
                np.testing.assert_array_equal(await tt.to_host(out), a + 1)
        slices = [e for e in recorder.events if e["ph"] == "X"]
        assert any(e["args"].get("ran_with_previous") for e in slices if e["tid"] == 1)  # a batch ran
        for track in (0, 1):
            mine = [e for e in slices if e["tid"] == track]
            assert mine
            for before, after in zip(mine, mine[1:]):
                assert after["ts"] >= before["ts"] + before["dur"] - 1e-3, (before, after)


async def test_large_ready_writes_do_not_wait_for_each_other() -> None:
    # Ready writes share a worker-thread hand-off only up to about a millisecond of work: four
    # 4 MiB writes go one by one, so a program reading the first need not wait for the fourth.
    arrays = [np.full((1024, 1024), i, np.float32) for i in range(4)]
    async with tt.open_device() as device:
        with tt.record_timeline(device) as recorder:
            tensors = [tt.to_device(a, device, DRAM_TILE) for a in arrays]
            for t in tensors:
                await t
        writes = [e for e in recorder.events if e["ph"] == "X" and e["name"] == "write"]
        assert len(writes) == 4
        assert not any(e["args"].get("ran_with_previous") for e in writes)  # four hand-offs, not one batch
        for t, a in zip(tensors, arrays):
            np.testing.assert_array_equal(await tt.to_host(t), a)


async def test_evicting_the_home_for_free_keeps_an_exact_home() -> None:
    # The home (L1 tile f32) has a bf16 conversion and a DRAM tile f32 conversion: evicting it
    # costs nothing, and the DRAM f32 copy (not the lossy bf16 one) becomes the home.
    x = rng(11).standard_normal((3, 50)).astype(np.float32)
    progs = []
    for name, layout in (("bf16_in", tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE, BF16)),
                         ("f32_in", tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32))):
        b = tt.ProgramBuilder(name)
        b.output(b.relu(b.input((3, 50), layout)), DRAM_TILE)
        progs.append(b.build())
    binary = tt.Binary(progs + list(elementwise_binary().programs))
    async with tt.open_device(tt.DeviceSpec.small(), eviction="eager") as device:
        t = tt.to_device(x, device, tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE))
        await tt.submit(device, binary, 0, [t])[0]
        await tt.submit(device, binary, 1, [t])[0]
        assert [layout.dtype for layout, _ in t.storages] == [F32, BF16, F32]
        await tt.submit(device, binary, 3, [tt.to_device(x, device)])[0]  # does not read t
        assert t.layout == tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
        assert device.memory_used(tt.MemorySpace.L1) == 0
        np.testing.assert_array_equal(await tt.to_host(t), x)


async def test_reshape_program_on_device() -> None:
    x = rng(12).standard_normal((2, 3, 40)).astype(np.float32)
    b = tt.ProgramBuilder("reshape")
    v = b.input((2, 3, 40))
    b.output(b.sum(b.reshape(v, (6, 40)), axis=0))
    b.output(b.reshape(v, (240,)), tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.ROW_MAJOR))
    binary = tt.Binary([b.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        s, flat = tt.submit(device, binary, 0, [tt.to_device(x, device, DRAM_TILE)])
        np.testing.assert_allclose(await tt.to_host(s), x.reshape(6, 40).sum(0, keepdims=True), rtol=1e-5)
        np.testing.assert_array_equal(await tt.to_host(flat), x.reshape(240))


async def test_one_program_with_inputs_in_every_layout_matches_numpy() -> None:
    # Plans are cached per program and the decision has a fast path for inputs already in their
    # declared layout: the same program, submitted again and again with inputs in other layouts
    # (converted first), in the declared one, or one tensor given twice, must compute each time
    # from the inputs it was given. Program 0 needs no scratch (the fast path), program 1 does.
    declared = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
    programs = []
    for name in ("one_step", "three_steps"):
        b = tt.ProgramBuilder(name)
        x, y = b.input((64, 96), declared), b.input((64, 96), declared)
        v = b.mul(x, y) if name == "one_step" else b.sub(b.mul(b.relu(x), y), b.add(x, 0.5))
        b.output(v, declared)
        programs.append(b.build())
    binary = tt.Binary(programs)
    reference = [lambda a, c: a * c, lambda a, c: np.maximum(a, 0) * c - (a + np.float32(0.5))]
    layouts = [declared, DRAM_RM, L1_TILE, L1_RM, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, BF16)]
    r = rng(7)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        for round_ in range(2):
            for lx in layouts:
                for ly in (declared, lx):
                    a = r.standard_normal((64, 96)).astype(np.float32)
                    c = r.standard_normal((64, 96)).astype(np.float32)
                    ta, tc = tt.to_device(a, device, lx), tt.to_device(c, device, ly)
                    a = (await tt.to_host(ta)).astype(np.float32)  # as stored (bf16 rounds)
                    c = (await tt.to_host(tc)).astype(np.float32)
                    for index, ref in enumerate(reference):
                        (out,) = tt.submit(device, binary, index, [ta, tc])
                        (same,) = tt.submit(device, binary, index, [ta, ta])
                        np.testing.assert_array_equal(await tt.to_host(out), ref(a, c))
                        np.testing.assert_array_equal(await tt.to_host(same), ref(a, a))


async def test_a_pagewise_program_the_c_kernel_refuses_runs_each_steps_own_page_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More operands than the C kernel takes keep a pagewise program off it
    (`_commands._page_code`): numpy runs it page by page, each step with its own record's page
    op (`Plan.page_ops`, bound once per plan). Four different ops in turn, so a step given
    another's op is seen; the run is watched to be sure it took that path."""
    x = rng(7).standard_normal((32, 32)).astype(np.float32)
    layout = tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE, F32)  # with its scratch: one space
    b = tt.ProgramBuilder("long_chain")
    t = b.input((32, 32), layout)
    v, expected = t, x
    for k in range(70):
        if k % 4 == 0:
            v, expected = b.mul(v, 0.5), expected * np.float32(0.5)
        elif k % 4 == 1:
            v, expected = b.sub(v, t), expected - x
        elif k % 4 == 2:
            v, expected = b.neg(v), -expected
        else:
            v, expected = b.relu(v), np.maximum(expected, np.float32(0))
    b.output(v, layout)
    program = b.build()
    plan = Plan(program)
    assert plan.pagewise and plan.page_code is None  # too many operands for the C kernel
    numpy_page_runs = []
    compute_pages = _commands._compute_pages

    def watched(step: Any, banks: Any) -> None:
        numpy_page_runs.append(step.kernel is None)
        compute_pages(step, banks)

    monkeypatch.setattr(_commands, "_compute_pages", watched)
    async with tt.open_device(tt.DeviceSpec()) as device:  # its L1 holds all 69 scratch values
        (out,) = tt.submit(device, tt.Binary([program]), 0, [tt.to_device(x, device, layout)])
        np.testing.assert_array_equal(await tt.to_host(out), expected)
    assert numpy_page_runs == [True]
