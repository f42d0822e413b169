"""Memory and residency under real use: what is held is what the user holds plus what is queued.

Each test reproduces a bug found by using the runtime outside its demos (a streaming loop, chained
programs with L1 weights, a deallocation racing an eviction, a failed tensor awaited many times,
a closed device) and checks the fix against figures computed here from the buffers' sizes.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import anyio
import attrs
import numpy as np
import pytest

import ttflow as tt
from ttflow import _commands, _queue

pytestmark = pytest.mark.anyio

F32 = tt.DataType.FLOAT32
DRAM = tt.MemorySpace.DRAM
L1 = tt.MemorySpace.L1
DRAM_TILE = tt.Layout(DRAM, tt.TensorLayout.TILE, F32)
L1_TILE = tt.Layout(L1, tt.TensorLayout.TILE, F32)


def _footprint(tensor: tt.Tensor, spec: tt.DeviceSpec, space: tt.MemorySpace) -> int:
    """Bytes a tensor's storages in `space` take over all banks (lockstep allocation)."""
    total = 0
    for _, buf in tensor.storages:
        if buf.space is space:
            banks = spec.banks(space)
            total += -(-buf.num_pages // banks) * buf.aligned_page_size * banks
    return total


def _mlp(batch: int, d_in: int, hidden: int, classes: int) -> tt.Binary:
    """Encoder then head, the hidden activations handed over in L1 (as in the demo)."""
    enc = tt.ProgramBuilder("encoder")
    x = enc.input((batch, d_in), DRAM_TILE)
    w1 = enc.input((d_in, hidden), DRAM_TILE)
    enc.output(enc.relu(enc.matmul(x, w1)), L1_TILE)
    head = tt.ProgramBuilder("head")
    h = head.input((batch, hidden), L1_TILE)
    w2 = head.input((hidden, classes), DRAM_TILE)
    head.output(head.matmul(h, w2), L1_TILE)
    return tt.Binary([enc.build(), head.build()])


async def test_streaming_loop_holds_a_bounded_live_set() -> None:
    # Two slots written in turn, encoder then head, awaiting only the output two batches back:
    # every finished intermediate must be given back, so DRAM stays near the live set however
    # many batches run (it grew by one encoder output per batch, and ran out at batch ~37).
    batch, d_in, hidden, classes = 64, 128, 1024, 64
    spec = attrs.evolve(tt.DeviceSpec.wormhole_n150(), dram_bank_bytes=2**20)  # 12 MiB of DRAM
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((d_in, hidden)) / 16).astype(np.float32)
    w2 = (rng.standard_normal((hidden, classes)) / 32).astype(np.float32)
    xs = [rng.standard_normal((batch, d_in)).astype(np.float32) for _ in range(2)]
    binary = _mlp(batch, d_in, hidden, classes)
    async with tt.open_device(spec) as device:
        tw1, tw2 = tt.to_device(w1, device), tt.to_device(w2, device)
        slots = [tt.empty((batch, d_in), F32, device, DRAM_TILE) for _ in range(2)]
        in_flight: list[tt.Tensor] = []
        for i in range(100):
            tt.write(slots[i % 2], xs[i % 2])
            (h,) = tt.submit(device, binary, 0, [slots[i % 2], tw1])
            (y,) = tt.submit(device, binary, 1, [h, tw2])
            in_flight.append(y)
            if len(in_flight) > 2:
                await in_flight.pop(0)
        got = await tt.to_host(in_flight[-1])
        np.testing.assert_allclose(got, np.maximum(xs[1] @ w1, 0) @ w2, rtol=1e-4, atol=1e-4)
        held = sum(_footprint(t, spec, DRAM) for t in (tw1, tw2, *slots))
        # At most three batches in flight, each an encoder output and a head output (in DRAM
        # once evicted), beside what the user holds (weights with their conversions, slots).
        per_batch = 4 * batch * (hidden + classes)
        live = held + 3 * per_batch
        assert device.stats.dram_peak_bytes <= 2 * live


def _l1_weights_binary() -> tt.Binary:
    enc = tt.ProgramBuilder("encoder")
    x = enc.input((32, 64), DRAM_TILE)
    w = enc.input((64, 64), L1_TILE)
    enc.output(enc.relu(enc.matmul(x, w)), L1_TILE)
    head = tt.ProgramBuilder("head")
    h = head.input((32, 64), L1_TILE)
    w = head.input((64, 32), L1_TILE)
    head.output(head.matmul(h, w), DRAM_TILE)
    return tt.Binary([enc.build(), head.build()])


@pytest.mark.parametrize("eviction", ["eager", "lookahead"])
@pytest.mark.parametrize("batches", [1, 10, 30])
async def test_chained_l1_weights_are_converted_once(batches: int, eviction: str) -> None:
    # Eager: each program's L1 weight is evicted by the other program every batch and comes back
    # as a page copy of its DRAM tile copy: that is residency, not a layout conversion. After the
    # first eviction copied each weight's tiles to DRAM, evicting them again copies nothing.
    # Lookahead: both weights fit in L1 together, so nothing is evicted or copied back.
    binary = _l1_weights_binary()
    rng = np.random.default_rng(1)
    w1 = rng.standard_normal((64, 64)).astype(np.float32)
    w2 = rng.standard_normal((64, 32)).astype(np.float32)
    async with tt.open_device(tt.DeviceSpec.small(), eviction=eviction) as device:
        tw1, tw2 = tt.to_device(w1, device), tt.to_device(w2, device)  # DRAM row-major
        for _ in range(batches):
            x = rng.standard_normal((32, 64)).astype(np.float32)
            (h,) = tt.submit(device, binary, 0, [tt.to_device(x, device, DRAM_TILE), tw1])
            (y,) = tt.submit(device, binary, 1, [h, tw2])
        np.testing.assert_allclose(await tt.to_host(y), np.maximum(x @ w1, 0) @ w2, rtol=1e-4, atol=1e-3)
        stats = device.stats
        assert stats.layout_conversions == 2
        if eviction == "lookahead":
            assert (stats.evictions, stats.eviction_bytes, stats.residency_copies) == (0, 0, 0)
            assert {s.layout.memory for s in (tw1._state.storages[1], tw2._state.storages[1])} == {L1}
            return
        # Each batch after the first brings both weights back into L1 by a page copy.
        assert stats.residency_copies == 2 * (batches - 1)
        assert stats.residency_copy_bytes == (batches - 1) * (64 * 64 + 64 * 32) * 4
        # Only the first eviction of each weight copies bytes (64x64 then 64x32 float32 tiles;
        # w2 is first evicted by the second batch's encoder). Encoder outputs are read by the
        # head before anything evicts them.
        assert stats.eviction_bytes == 64 * 64 * 4 + (64 * 32 * 4 if batches > 1 else 0)


async def test_deallocate_while_its_eviction_runs_on_a_worker() -> None:
    # A large eviction runs on a worker thread; deallocating the evicted tensor meanwhile must
    # free its new DRAM copy when the move finishes, not when the handle is garbage-collected.
    started, release = threading.Event(), threading.Event()
    original_run = _queue.run

    def slow_run(record: Any, banks: Any) -> Any:
        if any(isinstance(step, _commands.Copy) and step.src.layout.memory is L1 for step in record.steps):
            started.set()  # the eviction's copy, on a worker thread
            release.wait(10)
        return original_run(record, banks)

    spec = tt.DeviceSpec.small()
    b = tt.ProgramBuilder("touch")
    b.output(b.add(b.input((32, 32), DRAM_TILE), 1.0), DRAM_TILE)
    binary = tt.Binary([b.build()])
    big = np.ones((256, 256), np.float32)  # 256 KiB: moved on a worker thread
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_queue, "run", slow_run)
        async with tt.open_device(spec) as device:
            victim = tt.to_device(big, device, L1_TILE)
            x = tt.to_device(np.zeros((32, 32), np.float32), device, DRAM_TILE)
            await victim
            await x
            before = device.memory_used(DRAM)
            (y,) = tt.submit(device, binary, 0, [x])  # evicts `victim`, which it does not read
            while not started.is_set():
                await anyio.sleep(0.001)
            tt.deallocate(victim)  # the handle stays referenced: GC cannot hide a leak
            release.set()
            await y
            assert device.memory_used(L1) == 0
            assert device.memory_used(DRAM) == before + _footprint(y, spec, DRAM)
            assert victim.storages == ()


class _Boom(Exception):
    """An error whose class has a required keyword: it cannot be copied, only re-raised."""

    def __init__(self, *, why: str) -> None:
        super().__init__(why)


def _oom_binary(spec: tt.DeviceSpec) -> tt.Binary:
    b = tt.ProgramBuilder("too_big")
    rows = spec.l1_bank_bytes * spec.l1_banks // (32 * 4) + 32  # one tile more than L1 holds
    b.output(b.add(b.input((rows, 32), DRAM_TILE), b.input((1, 32), DRAM_TILE)), L1_TILE)
    return tt.Binary([b.build()])


async def test_repeated_awaits_of_a_failed_tensor_neither_grow_nor_pin() -> None:
    spec = tt.DeviceSpec.small()
    binary = _oom_binary(spec)
    rows = binary.programs[0].inputs[0].shape[0]
    async with tt.open_device(spec) as device:
        a = tt.to_device(np.ones((1, 32), np.float32), device, DRAM_TILE)
        big = tt.to_device(np.ones((rows, 32), np.float32), device, DRAM_TILE)
        (failed,) = tt.submit(device, binary, 0, [big, a])
        (dependant,) = tt.submit(device, tt.Binary([_identity((rows, 32))]), 0, [failed])
        inputs = [weakref.ref(a), weakref.ref(big)]
        del a, big  # the user drops the inputs: the failure must not keep them allocated
        depths = []
        for _ in range(5000):
            try:
                await failed
            except tt.OutOfMemoryError as exc:
                depths.append(_depth(exc))
        for waiter in (tt.wait, tt.to_host):
            with pytest.raises(tt.OutOfMemoryError):
                await waiter(failed)
        with pytest.raises(tt.OutOfMemoryError):
            await tt.to_host(dependant)
        assert len(depths) == 5000 and max(depths) == depths[0] <= 3
        gc.collect()
        assert [ref() for ref in inputs] == [None, None]
        assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0
        # The failed tensor is still usable as a handle: deallocating it is fine.
        tt.deallocate(failed)


def _identity(shape: tuple[int, ...]) -> tt.Program:
    b = tt.ProgramBuilder("identity")
    b.output(b.add(b.input(shape, L1_TILE), 0.0), DRAM_TILE)
    return b.build()


def _depth(exc: BaseException) -> int:
    tb, depth = exc.__traceback__, 0
    while tb is not None:
        depth, tb = depth + 1, tb.tb_next
    for link in (exc.__cause__, exc.__context__):
        if link is not None:
            depth += _depth(link)
    return depth


async def test_a_failed_command_keeps_no_frames() -> None:
    # An unexpected error inside a command (here from a broken op) is kept on the failed tensor
    # without the frames it was raised through: they hold the command and its inputs.
    def broken(args: Any, scalar: Any, **attrs: Any) -> Any:
        raise _Boom(why="op failed")

    b = tt.ProgramBuilder("broken")
    b.output(b.relu(b.input((32, 32), DRAM_TILE)), DRAM_TILE)
    binary = tt.Binary([b.build()])
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        x = tt.to_device(np.ones((32, 32), np.float32), device, DRAM_TILE)
        with pytest.MonkeyPatch.context() as mp:
            plan = device._scheduler.plan(binary.programs[0])
            mp.setattr(type(plan), "__setattr__", object.__setattr__)  # plans are immutable: not here
            mp.setattr(plan, "compute", [broken])
            mp.setattr(plan, "pagewise", False)  # through the general path, which calls ops
            mp.setattr(plan, "schedule", type(plan.schedule)(plan))  # made again, with the broken op
            (y,) = tt.submit(device, binary, 0, [x])
            ref = weakref.ref(x)
            del x
            for _ in range(100):
                with pytest.raises(_Boom) as info:
                    await y
            mp.undo()
        assert _depth(info.value) <= 3
        assert any("broken" in note for note in getattr(info.value, "__notes__", ()))
        gc.collect()
        assert ref() is None
        assert device.memory_used(DRAM) == 0


async def test_await_and_wait_agree_on_a_closed_device() -> None:
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        ready = tt.to_device(np.ones((4, 4), np.float32), device)
        await ready
    for waiter in (lambda t: t, tt.wait, tt.to_host):
        with pytest.raises(tt.DeviceClosedError):
            await waiter(ready)


async def test_finished_commands_keep_nothing_alive() -> None:
    # A chain whose intermediates the user drops: nothing but the last output stays allocated,
    # even while a queued command still lists finished ones among its dependencies.
    b = tt.ProgramBuilder("inc")
    b.output(b.add(b.input((32, 32), DRAM_TILE), 1.0), DRAM_TILE)
    binary = tt.Binary([b.build()])
    spec = tt.DeviceSpec.small()
    async with tt.open_device(spec) as device:
        slot = tt.empty((32, 32), F32, device, DRAM_TILE)
        t = slot
        refs = []
        for i in range(50):
            (t,) = tt.submit(device, binary, 0, [t])
            refs.append(weakref.ref(t))
            tt.write(slot, np.full((32, 32), i, np.float32))  # waits on the first reader
        await t
        await slot
        assert sum(ref() is not None for ref in refs) == 1  # no gc.collect: refcounts alone
        assert device.memory_used(DRAM) == _footprint(t, spec, DRAM) + _footprint(slot, spec, DRAM)
        np.testing.assert_array_equal(await tt.to_host(t), np.full((32, 32), 50, np.float32))


async def test_a_dropped_binary_is_not_kept_by_the_device() -> None:
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        x = tt.to_device(np.ones((32, 32), np.float32), device, DRAM_TILE)
        programs = []
        for i in range(20):  # a front-end that builds a program per call
            b = tt.ProgramBuilder(f"step{i}")
            b.output(b.add(b.input((32, 32), DRAM_TILE), float(i)), DRAM_TILE)
            binary = tt.Binary([b.build()])
            (y,) = tt.submit(device, binary, 0, [x])
            np.testing.assert_array_equal(await tt.to_host(y), np.full((32, 32), 1.0 + i, np.float32))
            programs.append(weakref.ref(binary.programs[0]))
            del binary, b
        gc.collect()
        assert sum(ref() is not None for ref in programs) <= 1


async def test_a_tiny_program_that_does_not_fit_fails_alone() -> None:
    # The C fast path allocates a tiny program's output; when it does not fit, the program must
    # fail with OutOfMemoryError (through the general path) and the device must go on.
    b = tt.ProgramBuilder("plus_one")
    b.output(b.add(b.input((32, 32), DRAM_TILE), 1.0), DRAM_TILE)
    binary = tt.Binary([b.build()])
    spec = tt.DeviceSpec.small()
    async with tt.open_device(spec) as device:
        x = tt.to_device(np.zeros((32, 32), np.float32), device, DRAM_TILE)
        await x
        # Fill DRAM with one-tile tensors until nothing more fits.
        fill = []
        with pytest.raises(tt.OutOfMemoryError):
            for _ in range(100_000):
                fill.append(tt.to_device(np.zeros((32, 32), np.float32), device, DRAM_TILE))
        used = device.memory_used(DRAM)
        (y,) = tt.submit(device, binary, 0, [x])
        with pytest.raises(tt.OutOfMemoryError):
            await y
        assert device.memory_used(DRAM) == used
        del fill[-1]
        await tt.wait(x)
        (z,) = tt.submit(device, binary, 0, [x])
        np.testing.assert_array_equal(await tt.to_host(z), np.ones((32, 32), np.float32))
