"""Stress: a long soak, many tasks on one device, a storm of cancellations, closing with work
queued on both queues. Each runs on asyncio and trio in a few seconds; HYPOTHESIS_PROFILE=long
makes them bigger."""

from __future__ import annotations

import os
import random
import resource
import time

import anyio
import numpy as np
import pytest

import ttflow as tt
from ttflow import _queue
from ttflow.testing import buffer_footprint, drain, hold_worker_threads

pytestmark = pytest.mark.anyio

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
F32 = tt.DataType.FLOAT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
DRAM_TILE = tt.Layout(DRAM, tt.TensorLayout.TILE)
L1_TILE = tt.Layout(L1, tt.TensorLayout.TILE)
SPEC = tt.DeviceSpec.small()
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size now (not the peak, which `resource` reports)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:  # not Linux: the peak is an upper bound that still shows steady growth
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def held_bytes(tensors: list[tt.Tensor], space: tt.MemorySpace) -> int:
    """Bytes the given tensors' storages take in `space` (what memory_used should show)."""
    return sum(buffer_footprint(b, SPEC) for t in tensors for _, b in t.storages if b.space is space)


def assert_holds_only(device: tt.Device, tensors: list[tt.Tensor]) -> None:
    for space in tt.MemorySpace:
        assert device.memory_used(space) == held_bytes(tensors, space), space


# -- soak ---------------------------------------------------------------------------------------


def _add_binary() -> tt.Binary:
    b = tt.ProgramBuilder("tiny_add")
    x = b.input((32, 32), tt.Layout(DRAM, tt.TensorLayout.TILE, F32))
    b.output(b.add(x, b.input((32, 32), tt.Layout(DRAM, tt.TensorLayout.TILE, F32))), DRAM_TILE)
    return tt.Binary([b.build()])


async def test_soak_tiny_chained_programs_keep_memory_flat(capsys: pytest.CaptureFixture[str]) -> None:
    # 100k chained 32x32 adds (as in `ttflow bench dispatch`), with a double-buffered input
    # rewritten every 8 programs, so that commands on the two queues wait for each other
    # (write-after-read and read-after-write). After a warm-up of 10k programs, neither the
    # process's RSS nor the device's memory may grow: what a finished command keeps alive must
    # not add up.
    total, warmup, every = (1_000_000, 20_000, 8) if LONG else (100_000, 10_000, 8)
    binary = _add_binary()
    async with tt.open_device(SPEC) as device:
        x = tt.to_device(np.zeros((32, 32), np.float32), device, DRAM_TILE)
        buffers = [tt.empty((32, 32), F32, device, DRAM_TILE) for _ in range(2)]
        expected = 0.0
        increment = 0.0
        baseline_rss = baseline_dram = 0
        begin = time.perf_counter()
        for i in range(total):
            if i % every == 0:
                increment = float((i // every) % 3)  # 0, 1, 2: the sum stays exact in float32
                tt.write(buffers[(i // every) % 2], np.full((32, 32), increment, np.float32))
            (x,) = tt.submit(device, binary, 0, [x, buffers[(i // every) % 2]])
            expected += increment
            if i % 1000 == 999:
                await x  # keep a bounded amount of work queued, as a streaming loop does
            if i == warmup - 1:
                await drain(device)
                baseline_rss = rss_bytes()
                baseline_dram = device.memory_used(DRAM)
        await drain(device)
        elapsed = time.perf_counter() - begin
        grown = rss_bytes() - baseline_rss
        value = await tt.to_host(x)
        assert (value == expected).all(), (value[0, 0], expected)
        assert device.memory_used(DRAM) == baseline_dram
        assert_holds_only(device, [x, *buffers])
        assert device.stats.programs_run == total
        with capsys.disabled():
            print(f"\nsoak: {total} programs, {elapsed / total * 1e6:.1f} us/program, "
                  f"RSS {grown / 2**20:+.2f} MiB after the first {warmup}")
        assert grown < 8 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB after the warm-up"


# -- many tasks on one device -------------------------------------------------------------------


def _task_binary(shape: tuple[int, int]) -> tt.Binary:
    b = tt.ProgramBuilder("scale_relu")
    x = b.input(shape, tt.Layout(L1, tt.TensorLayout.TILE, F32))  # converted to L1 at the start
    b.output(b.relu(b.add(b.mul(x, 2.0), -1.0)), L1_TILE)
    b2 = tt.ProgramBuilder("add_back")
    y = b2.input(shape, L1_TILE)
    b2.output(b2.add(y, b2.input(shape, tt.Layout(DRAM, tt.TensorLayout.ROW_MAJOR, F32))), tt.Layout())
    return tt.Binary([b.build(), b2.build()])


async def test_fifty_tasks_share_one_device() -> None:
    # Each task pushes its own data, chains two programs (L1 conversions, L1 outputs evicted by
    # the other tasks' programs), reads back, checks against numpy and deallocates: nothing of
    # any task may leak or show up in another's results.
    tasks, rounds = (200, 5) if LONG else (50, 3)
    shapes = [(8, 40), (33, 20), (40, 33)]
    binaries = {s: _task_binary(s) for s in shapes}
    failures: list[str] = []

    async def one(device: tt.Device, k: int) -> None:
        rng = np.random.default_rng(k)
        shape = shapes[k % len(shapes)]
        for r in range(rounds):
            data = (rng.integers(-64, 64, shape) / 8).astype(np.float32)
            x = tt.to_device(data, device)
            (h,) = tt.submit(device, binaries[shape], 0, [x])
            if rng.integers(2):
                await anyio.sleep(0)  # other tasks' programs run between: `h` gets evicted
            (y,) = tt.submit(device, binaries[shape], 1, [h, x])
            if rng.integers(2):
                # Done with them as far as this task is concerned: freed once the queued
                # programs that read them have run.
                tt.deallocate(x)
                tt.deallocate(h)
            got = await tt.to_host(y)
            want = np.maximum(data * np.float32(2) + np.float32(-1), 0) + data
            if not np.array_equal(got, want):
                failures.append(f"task {k} round {r}: {np.abs(got - want).max()}")
            for t in (x, h, y):
                tt.deallocate(t)


    async with tt.open_device(SPEC) as device:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for k in range(tasks):
                    tg.start_soon(one, device, k)
        assert not failures, failures[:5]
        await drain(device)
        assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0
        assert device.stats.evictions > 0  # the tasks' L1 tensors did get in each other's way


# -- a storm of cancellations ---------------------------------------------------------------------


async def test_cancellation_storm_leaves_work_and_device_intact() -> None:
    # Many tasks, cancelled at random points while awaiting to_host, tt.wait or the tensor
    # itself (move_on_after with tiny timeouts, CancelScope.cancel from another task, the whole
    # group cancelled): the work they waited for still completes and is right, the device stays
    # usable, and once everything is deallocated nothing is left allocated.
    tasks = 600 if LONG else 150
    shape = (40, 33)
    b = tt.ProgramBuilder("twice_plus")
    b.output(b.add(b.mul(b.input(shape, DRAM_TILE), 2.0), 3.0), L1_TILE)
    binary = tt.Binary([b.build()])
    made: list[tuple[tt.Tensor, np.ndarray]] = []  # every handle, with its expected value
    seed = random.Random(1234)

    async def waiter(device: tt.Device, k: int, scope: anyio.CancelScope) -> None:
        rng = random.Random(k)
        data = np.full(shape, k % 17, np.float32)
        x = tt.to_device(data, device, [tt.Layout(), DRAM_TILE][k % 2])
        made.append((x, data))
        out = x
        want = data
        for _ in range(rng.randrange(1, 4)):
            (out,) = tt.submit(device, binary, 0, [out])
            want = want * np.float32(2) + np.float32(3)
            made.append((out, want))
        how = rng.choice(["to_host", "wait", "await"])
        with scope:
            with anyio.move_on_after(rng.choice([0, 0, 1e-5, 1e-4, 1e-3, None])):  # type: ignore[arg-type]
                if how == "to_host":
                    got = await tt.to_host(out)
                    assert np.array_equal(got, want)
                elif how == "wait":
                    await tt.wait(out)
                else:
                    await out

    async def canceller(scopes: list[anyio.CancelScope]) -> None:
        for scope in seed.sample(scopes, len(scopes) // 3):
            await anyio.sleep(seed.choice([0, 0, 1e-5, 1e-4]))
            scope.cancel()

    async with tt.open_device(SPEC) as device:
        with anyio.fail_after(20):
            scopes = [anyio.CancelScope() for _ in range(tasks)]
            async with anyio.create_task_group() as tg:
                for k in range(tasks):
                    tg.start_soon(waiter, device, k, scopes[k])
                tg.start_soon(canceller, scopes)
            # And a whole group cancelled while its tasks await.
            async with anyio.create_task_group() as tg:
                for k in range(tasks, tasks + tasks // 3):
                    tg.start_soon(waiter, device, k, anyio.CancelScope())
                await anyio.sleep(0)
                tg.cancel_scope.cancel()
            # The work every task queued completed and is right, cancelled waiters or not.
            for tensor, want in made:
                np.testing.assert_array_equal(await tt.to_host(tensor), want)
            x = tt.to_device(np.ones(shape, np.float32), device)
            (y,) = tt.submit(device, binary, 0, [x])
            np.testing.assert_array_equal(await tt.to_host(y), np.full(shape, 5, np.float32))
            for tensor, _ in made:
                tt.deallocate(tensor)
            tt.deallocate(x)
            tt.deallocate(y)
            await drain(device)
        assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0
        assert device.stats.commands_failed == 0


# -- closing with work queued ---------------------------------------------------------------------


def _queue_work(device: tt.Device) -> tuple[list[tt.Tensor], int]:
    """Writes queued on CQ1 and programs on CQ0 behind them (the test sends every command's run
    to a worker thread, so that `hold_worker_threads` keeps them queued)."""
    b = tt.ProgramBuilder("relu")
    b.output(b.relu(b.input((256, 320), DRAM_TILE)), DRAM_TILE)
    binary = tt.Binary([b.build()])
    handles: list[tt.Tensor] = []
    nbytes = 0
    for i in range(4):
        array = np.full((256, 320), float(i), np.float32)  # 320 KiB
        x = tt.to_device(array, device, DRAM_TILE)
        nbytes += array.nbytes
        handles.append(x)
        handles.extend(tt.submit(device, binary, 0, [x]))
        tt.write(x, array + 1)
        nbytes += array.nbytes
    return handles, nbytes


async def _raises_closed(tensor: tt.Tensor, device: tt.Device) -> None:
    for use in (lambda: tt.to_layout(tensor, L1_TILE), lambda: tt.write(tensor, np.zeros(tensor.shape, np.float32)),
                lambda: tt.to_device(np.zeros(4, np.float32), device)):
        with pytest.raises(tt.DeviceClosedError):
            use()
    with pytest.raises(tt.DeviceClosedError):
        await tt.to_host(tensor)
    with pytest.raises(tt.DeviceClosedError):
        await tt.wait(tensor)
    with pytest.raises(tt.DeviceClosedError):
        await tensor
    tt.deallocate(tensor)  # a no-op on a closed device


@pytest.mark.parametrize("exit", ["normal", "error", "cancelled"])
async def test_closing_with_queued_work(exit: str) -> None:
    # Work still queued on both queues when the block exits (held by `hold_worker_threads`
    # until then): a normal exit runs all of it; an error or a cancellation fails what did not
    # start with DeviceClosedError. Either way nothing hangs, every tensor is done, the device
    # frees everything, and every handle then raises DeviceClosedError.
    with anyio.fail_after(30):
        with anyio.CancelScope() as scope:
            try:
                # inline_seconds=-1: every command's run on a worker (held until the exit)
                async with tt.open_device(SPEC, inline_seconds=-1) as device:
                    async with hold_worker_threads():
                        handles, nbytes = _queue_work(device)
                        await anyio.sleep(0.01)
                        assert not any(t.done() for t in handles)  # all of it still queued
                        if exit == "error":
                            raise _UserBug
                        if exit == "cancelled":
                            scope.cancel()
                            await anyio.sleep(5)
            except _UserBug:
                assert exit == "error"
    assert scope.cancelled_caught == (exit == "cancelled")
    assert device.closed and all(t.done() for t in handles)
    stats = device.stats
    if exit == "normal":
        assert stats.programs_run == 4 and stats.commands_failed == 0
        assert stats.host_to_device_bytes == nbytes
    else:
        assert stats.programs_run < 4 and stats.commands_failed > 0
    assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0
    for t in handles:
        await _raises_closed(t, device)


class _UserBug(Exception):
    pass
