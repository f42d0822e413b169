"""Donation (`output(donates=)`) and the in-place `update_cache`, against numpy written here.

What must hold: a donated input is consumed at `submit` (every later use of its handle raises
DeallocatedTensorError saying so), the output takes its buffer (no allocation: memory stays
constant over a decode loop), queued readers of the old value see the old value, a donated
`update_cache` rewrites only the row's band of tiles, and bad donations are typed errors that
consume nothing.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ttflow as tt

pytestmark = pytest.mark.anyio

F32, BF16, BF8, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B, tt.DataType.INT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE, RM = tt.TensorLayout.TILE, tt.TensorLayout.ROW_MAJOR
INDEX = tt.Layout(DRAM, RM, I32)


def _cache_step(cache_layout: tt.Layout, shape: tuple[int, ...], donate: bool = True) -> tt.Binary:
    """One decode step: the value's row written at `pos`, and pos + 1 (both on the device)."""
    b = tt.ProgramBuilder("cache_step")
    cache = b.input(shape, cache_layout)
    value = b.input((*shape[:-2], 1, shape[-1]), tt.Layout(DRAM, TILE, F32))
    pos = b.input((1,), INDEX)
    updated = b.update_cache(cache, value, pos)
    if donate:
        b.output(updated, donates=cache)
    else:
        b.output(updated, cache_layout)
    b.output(b.add(pos, 1), INDEX)
    return tt.Binary([b.build()])


def _rounded(array: np.ndarray[Any, Any], dtype: tt.DataType) -> np.ndarray[Any, Any]:
    """numpy's rounding to `dtype` (BFLOAT8_B: within its bound, checked separately)."""
    if dtype is BF16:
        return array.astype(ml_dtypes.bfloat16).astype(np.float32)
    return array


@pytest.mark.parametrize("cache_layout", [
    tt.Layout(DRAM, TILE, F32), tt.Layout(L1, TILE, F32), tt.Layout(DRAM, TILE, BF16),
    tt.Layout(DRAM, RM, F32), tt.Layout(DRAM, TILE, BF8),
], ids=["dram-f32", "l1-f32", "dram-bf16", "row-major", "bf8"])
async def test_a_donated_cache_is_updated_in_place_row_by_row(cache_layout: tt.Layout) -> None:
    shape, steps = (2, 40, 48), 40  # rows past one tile row, columns not a multiple of 32
    binary = _cache_step(cache_layout, shape)
    rng = np.random.default_rng(7)
    reference = np.zeros(shape, np.float32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        cache = tt.to_device(reference.astype(cache_layout.dtype.host_dtype), device, cache_layout)  # type: ignore[union-attr]
        pos = tt.to_device(np.zeros(1, np.int32), device, INDEX)
        await cache
        before = device.memory_used(DRAM) + device.memory_used(L1)
        for step in range(steps):
            row = rng.standard_normal((2, 1, 48)).astype(np.float32)
            cache, pos = tt.submit(device, binary, 0, [cache, tt.to_device(row, device), pos])
            reference[:, step] = row[:, 0]
        got = (await tt.to_host(cache)).astype(np.float32)
        assert int((await tt.to_host(pos))[0]) == steps
        if cache_layout.dtype is BF8:
            np.testing.assert_allclose(got, reference, rtol=2**-6, atol=2**-6 * np.abs(reference).max())
        else:
            np.testing.assert_array_equal(got, _rounded(reference, cache_layout.dtype))  # type: ignore[arg-type]
        # No buffer was allocated for the caches: the step outputs took the donated ones.
        stats = device.stats
        assert stats.donations == steps
        cache_bytes = cache.storages[0][1].num_pages * cache.storages[0][1].page_size
        assert stats.donated_bytes == steps * cache_bytes
        band = 2 * (48 * 4 if cache_layout.tensor_layout is RM else 2 * cache.storages[0][1].page_size)
        assert stats.cache_update_bytes == steps * band < steps * cache_bytes
        del row
        await tt.wait(pos)
        assert device.memory_used(DRAM) + device.memory_used(L1) == before


@settings(max_examples=20)
@given(rows=st.integers(1, 70), index=st.integers(-5, 80), batch_value=st.booleans(),
       dtype=st.sampled_from([F32, BF16]))
async def test_update_cache_in_place_equals_numpy_at_any_index(rows: int, index: int, batch_value: bool,
                                                              dtype: tt.DataType) -> None:
    # The index is clamped into range (as JAX's dynamic_update_slice); a value of batch 1 is
    # broadcast over the cache's batch.
    shape = (3, rows, 20)
    layout = tt.Layout(DRAM, TILE, dtype)
    b = tt.ProgramBuilder("write_row")
    cache = b.input(shape, layout)
    value = b.input((3 if batch_value else 1, 1, 20))
    pos = b.input((1,), INDEX)
    b.output(b.update_cache(cache, value, pos), donates=cache)
    binary = tt.Binary([b.build()])
    rng = np.random.default_rng(rows)
    start = rng.standard_normal(shape).astype(np.float32)
    row = rng.standard_normal((3 if batch_value else 1, 1, 20)).astype(np.float32)
    expected = start.copy()
    expected[:, min(max(index, 0), rows - 1)] = row[:, 0]
    async with tt.open_device(tt.DeviceSpec.small(), blas_threads=None) as device:
        (out,) = tt.submit(device, binary, 0, [
            tt.to_device(start, device, layout), tt.to_device(row, device),
            tt.to_device(np.array([index], np.int32), device, INDEX)])
        got = (await tt.to_host(out)).astype(np.float32)
    np.testing.assert_array_equal(got, _rounded(expected, dtype))


async def test_every_use_of_a_donated_handle_says_it_was_donated() -> None:
    b = tt.ProgramBuilder("double")
    x = b.input((32, 32))
    b.output(b.mul(x, 2.0), donates=x)
    binary = tt.Binary([b.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        x0 = tt.to_device(np.ones((32, 32), np.float32), device, tt.Layout(DRAM, TILE))
        (y,) = tt.submit(device, binary, 0, [x0])
        assert "donated" in repr(x0) and x0.is_deallocated
        uses = [lambda: tt.submit(device, binary, 0, [x0]), lambda: tt.to_layout(x0, tt.Layout(L1, TILE)),
                lambda: tt.write(x0, np.zeros((32, 32), np.float32))]
        for use in uses:
            with pytest.raises(tt.DeallocatedTensorError, match="donated to program 'double'"):
                use()
        for waiter in (tt.to_host, tt.wait):
            with pytest.raises(tt.DeallocatedTensorError, match="donated"):
                await waiter(x0)
        with pytest.raises(tt.DeallocatedTensorError, match="donated"):
            await x0
        np.testing.assert_array_equal(await tt.to_host(y), np.full((32, 32), 2, np.float32))
        tt.deallocate(x0)  # a no-op, as for any deallocated handle


async def test_queued_readers_see_the_value_before_the_donation() -> None:
    # Write-after-read: programs and reads queued before the donating submit read the old value;
    # a write queued before it (on the other queue) is what the donating program reads.
    b = tt.ProgramBuilder("double")
    x = b.input((64, 64))
    b.output(b.mul(x, 2.0), donates=x)
    r = tt.ProgramBuilder("plus_one")
    r.output(r.add(r.input((64, 64)), 1.0))
    binary = tt.Binary([b.build(), r.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        base = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
        x0 = tt.to_device(base, device, tt.Layout(DRAM, TILE))
        (before,) = tt.submit(device, binary, 1, [x0])  # queued, not run
        tt.write(x0, base * 10)  # CQ1, after the reader: the reader still sees `base`
        (after,) = tt.submit(device, binary, 1, [x0])
        (doubled,) = tt.submit(device, binary, 0, [x0])
        np.testing.assert_array_equal(await tt.to_host(doubled), base * 20)
        np.testing.assert_array_equal(await tt.to_host(before), base + 1)
        np.testing.assert_array_equal(await tt.to_host(after), base * 10 + 1)


async def test_a_decode_loop_with_donation_holds_constant_memory_for_1000_steps() -> None:
    shape = (4, 64, 32)
    binary = _cache_step(tt.Layout(DRAM, TILE, BF16), shape)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        cache = tt.to_device(np.zeros(shape, ml_dtypes.bfloat16), device, tt.Layout(DRAM, TILE, BF16))
        pos = tt.to_device(np.zeros(1, np.int32), device, INDEX)
        value = tt.to_device(np.ones((4, 1, 32), np.float32), device)
        used = []
        for step in range(1000):
            cache, pos = tt.submit(device, binary, 0, [cache, value, pos])
            if step % 100 == 99:
                await pos
                used.append((device.memory_used(DRAM), device.memory_used(L1)))
        assert len(set(used)) == 1, used
        got = (await tt.to_host(cache)).astype(np.float32)
        assert int((await tt.to_host(pos))[0]) == 1000
        np.testing.assert_array_equal(got, np.ones(shape, np.float32))  # every row written; the last clamped


async def test_without_donation_the_same_step_allocates_a_new_cache_each_time() -> None:
    # The comparison the decode benchmark reports: the functional update writes whole caches.
    shape = (2, 64, 64)
    layout = tt.Layout(DRAM, TILE, F32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        results = {}
        for donate in (True, False):
            binary = _cache_step(layout, shape, donate=donate)
            cache = tt.to_device(np.zeros(shape, np.float32), device, layout)
            pos = tt.to_device(np.zeros(1, np.int32), device, INDEX)
            value = tt.to_device(np.ones((2, 1, 64), np.float32), device)
            first = device.stats
            for _ in range(8):
                cache, pos = tt.submit(device, binary, 0, [cache, value, pos])
            got = await tt.to_host(cache)
            last = device.stats
            results[donate] = (got, last.donated_bytes - first.donated_bytes,
                               last.cache_update_bytes - first.cache_update_bytes)
        np.testing.assert_array_equal(results[True][0], results[False][0])
        assert results[False][1:] == (0, 0)
        assert results[True][1] == 8 * 2 * 64 * 64 * 4 and results[True][2] == 8 * 2 * 2 * 4096


async def test_bad_donations_are_typed_errors_that_consume_nothing() -> None:
    b = tt.ProgramBuilder("acc")
    acc = b.input((32, 32), tt.Layout(DRAM, TILE, F32))
    b.output(b.add(acc, b.input((32, 32))), donates=acc)
    binary = tt.Binary([b.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        x = tt.to_device(np.ones((32, 32), np.float32), device, tt.Layout(DRAM, TILE))
        with pytest.raises(tt.ProgramError, match="pass it once"):
            tt.submit(device, binary, 0, [x, x])
        row_major = tt.to_device(np.ones((32, 32), np.float32), device, tt.Layout(DRAM, RM))
        with pytest.raises(tt.LayoutError, match="a donated buffer is not converted"):
            tt.submit(device, binary, 0, [row_major, x])
        bf16 = tt.to_device(np.ones((32, 32), np.float32), device, tt.Layout(DRAM, TILE, BF16))
        with pytest.raises(tt.LayoutError):
            tt.submit(device, binary, 0, [bf16, x])
        with pytest.raises(tt.TraceError, match="cannot be captured"), tt.capture_trace(device):
            tt.submit(device, binary, 0, [x, row_major])
        for t in (x, row_major, bf16):  # none was consumed
            assert not t.is_deallocated
        (y,) = tt.submit(device, binary, 0, [x, row_major])
        np.testing.assert_array_equal(await tt.to_host(y), np.full((32, 32), 2, np.float32))


def test_bad_donations_are_refused_by_the_builder() -> None:
    b = tt.ProgramBuilder("p")
    x = b.input((32, 32))
    w = b.input((32, 64))
    h = b.matmul(x, w)
    with pytest.raises(tt.ProgramError, match="not an input"):
        b.output(h, donates=h)
    with pytest.raises(tt.ShapeError, match="donated"):
        b.output(h, donates=x)
    with pytest.raises(tt.LayoutError, match="keeps its layout"):
        b.output(b.relu(x), tt.Layout(L1, TILE), donates=x)
    b.output(b.relu(x), donates=x)
    with pytest.raises(tt.ProgramError, match="already donated"):
        b.output(b.neg(x), donates=x)
    other = tt.ProgramBuilder("other")
    with pytest.raises(tt.ProgramError, match="another program"):
        b.output(b.neg(x), donates=other.input((32, 32)))


def test_donations_survive_a_binary_round_trip(tmp_path: Any) -> None:
    binary = _cache_step(tt.Layout(L1, TILE, BF16), (2, 64, 32))
    binary.save(tmp_path / "step.ttb")
    loaded = tt.Binary.load(tmp_path / "step.ttb")
    assert loaded.programs[0].donations == ((0, 0),)
    assert loaded.programs[0].same_as(binary.programs[0])


async def test_a_failed_donating_program_leaks_nothing() -> None:
    # BFLOAT8_B has no encoding for infinity: the in-place row write fails at run time.
    layout = tt.Layout(DRAM, TILE, BF8)
    binary = _cache_step(layout, (1, 32, 32))
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        before = device.memory_used(DRAM)
        cache = tt.to_device(np.zeros((1, 32, 32), np.float32), device, layout)
        pos = tt.to_device(np.zeros(1, np.int32), device, INDEX)
        bad = tt.to_device(np.full((1, 1, 32), np.inf, np.float32), device)
        new_cache, new_pos = tt.submit(device, binary, 0, [cache, bad, pos])
        with pytest.raises(tt.LayoutError):
            await new_cache
        del cache, new_cache, new_pos, pos, bad
        await tt.wait(tt.to_device(np.zeros(1, np.float32), device))
        assert device.memory_used(DRAM) == before
