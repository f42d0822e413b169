"""The command queues' worker threads and writes converted ahead.

A queue hands its large records to its own thread at once (not after every other ready task, as
`anyio.to_thread.run_sync` does), and a write waiting behind a program that still reads its
tensor converts its array to device pages meanwhile, landing only once the program is done.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ttflow as tt
from ttflow import _commands, _queue, _sched
from ttflow._memory import storage_io as _storage_io
from ttflow.testing import hold_worker_threads

pytestmark = pytest.mark.anyio  # the async tests; the hypothesis one runs each backend itself

F32, BF16, BFP8 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B
SMALL = tt.DeviceSpec.small()
SPEC = tt.DeviceSpec.wormhole_n150()  # its L1 holds the large slot (the small spec's does not)
SHAPE = (640, 640)  # large enough to run on a worker thread in every dtype (BFLOAT8_B: 435 KB)


def _double(dtype: tt.DataType, space: tt.MemorySpace) -> tt.Binary:
    layout = tt.Layout(space, tt.TensorLayout.TILE, dtype)
    b = tt.ProgramBuilder("double")
    b.output(b.mul(b.input(SHAPE, layout), 2.0), tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32))
    return tt.Binary([b.build()])


def _as_stored(array: np.ndarray[Any, Any], dtype: tt.DataType) -> np.ndarray[Any, Any]:
    """What a tensor of `dtype` holds for `array`, by the kernels' own rules (tested against
    tt-metal's elsewhere): bfloat16 rounding, or BFLOAT8_B's shared-exponent packing."""
    if dtype is BF16:
        return array.astype(ml_dtypes.bfloat16).astype(np.float32)
    if dtype is BFP8:
        return tt.kernels.unpack_bfloat8_b(tt.kernels.pack_bfloat8_b(array), array.shape)
    return array


@pytest.mark.parametrize("space", [tt.MemorySpace.DRAM, tt.MemorySpace.L1])
@pytest.mark.parametrize("dtype", [F32, BF16, BFP8], ids=lambda d: d.name)
async def test_a_write_behind_a_reader_converts_ahead_and_lands_after_it(
    dtype: tt.DataType, space: tt.MemorySpace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The program's run is held until the write's conversion has finished (and a little
    # longer), so a write that landed without waiting for its reader would change what the
    # program reads.
    staged: list[tuple[int, ...]] = []
    conversion_done = threading.Event()
    stage_array, run = _storage_io.stage_array, _queue.run

    def spy(dtype: Any, array: np.ndarray[Any, Any]) -> Any:
        staged.append(array.shape)
        try:
            return stage_array(dtype, array)
        finally:
            conversion_done.set()

    def held_program(record: Any, banks: Any) -> Any:
        if any(type(step) is _commands.Compute for step in record.steps):
            conversion_done.wait(timeout=2)
            time.sleep(0.05)  # time enough for a landing that does not wait to happen first
        return run(record, banks)

    monkeypatch.setattr(_storage_io, "stage_array", spy)
    monkeypatch.setattr(_queue, "run", held_program)
    rng = np.random.default_rng(0)
    old, new = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))
    host_dtype = dtype.host_dtype
    binary = _double(dtype, space)
    async with tt.open_device(SPEC) as device:
        slot = tt.to_device(old.astype(host_dtype), device, tt.Layout(space, tt.TensorLayout.TILE, dtype))
        await slot
        async with hold_worker_threads() as hold:
            (y,) = tt.submit(device, binary, 0, [slot])  # decided, then held before its run
            tt.write(slot, new.astype(host_dtype))  # blocked by the program: converts ahead
            await anyio.sleep(0.01)
            hold.release()
            assert np.array_equal(await tt.to_host(y), 2 * _as_stored(old, dtype))
            assert np.array_equal(np.asarray(await tt.to_host(slot), np.float32), _as_stored(new, dtype))
        assert staged == [SHAPE]
        # Nothing left behind: only the two tensors' storages are held.
        tt.deallocate(y)
        tt.deallocate(slot)
        await anyio.lowlevel.checkpoint()
        for memory in tt.MemorySpace:
            assert device.memory_used(memory) == 0


async def test_a_row_major_or_small_write_is_not_converted_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    staged: list[Any] = []
    monkeypatch.setattr(_storage_io, "stage_array", lambda *a: staged.append(a))
    rm = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.ROW_MAJOR, F32)
    b = tt.ProgramBuilder("double")
    b.output(b.mul(b.input(SHAPE, rm), 2.0), rm)
    binary = tt.Binary([b.build()])
    x = np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE)
    async with tt.open_device(SPEC) as device:
        slot = tt.to_device(x, device, rm)
        async with hold_worker_threads() as hold:
            (y,) = tt.submit(device, binary, 0, [slot])
            tt.write(slot, -x)
            await anyio.sleep(0.01)
            hold.release()
            assert np.array_equal(await tt.to_host(y), 2 * x)
            assert np.array_equal(await tt.to_host(slot), -x)
    assert staged == []


async def test_a_large_run_starts_while_other_tasks_still_run() -> None:
    # The host's code goes on after a submit without yielding (here it polls, holding the loop
    # for up to 5 s): the device's work must start anyway, as on a chip. Through
    # `anyio.to_thread.run_sync` it would wait for that code to yield first.
    started = threading.Event()
    run = _commands.run

    def watched(record: Any, banks: Any) -> Any:
        started.set()
        return run(record, banks)

    binary = _double(F32, tt.MemorySpace.DRAM)
    x = np.ones(SHAPE, np.float32)
    async with tt.open_device(SPEC) as device:
        slot = tt.to_device(x, device, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32))
        await slot
        original = _queue.run
        _queue.run = watched
        try:
            used = device.memory_used(tt.MemorySpace.DRAM)
            (y,) = tt.submit(device, binary, 0, [slot])
            while device.memory_used(tt.MemorySpace.DRAM) == used:
                await anyio.lowlevel.checkpoint()  # until CQ0's task has decided (allocated the output)
            deadline = time.monotonic() + 5
            while not started.is_set() and time.monotonic() < deadline:
                time.sleep(0.001)  # noqa: ASYNC251 - the loop stays busy with this task, on purpose
            assert started.is_set(), "the program's run waited for the host's code to yield"
            assert np.array_equal(await tt.to_host(y), 2 * x)
        finally:
            _queue.run = original


async def test_the_worker_threads_end_with_the_device() -> None:
    def workers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("ttflow-CQ")]

    before = workers()
    async with tt.open_device(SPEC) as device:
        big = tt.to_device(np.ones(SHAPE, np.float32), device, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32))
        await big
        assert sorted(set(workers()) - set(before)) == ["ttflow-CQ0", "ttflow-CQ1"]
    assert workers() == before


# -- programs decided ahead ---------------------------------------------------------------------


def _layer() -> tt.Binary:
    """y = relu(x @ w): its matmul intermediate is scratch, and it runs on a worker thread."""
    tile = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
    b = tt.ProgramBuilder("layer")
    b.output(b.relu(b.matmul(b.input((256, 512), tile), b.input((512, 256), tile))), tile)
    return tt.Binary([b.build()])


def _count_sent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the programs whose record went to the worker before their turn."""
    sent = [0]
    send_ahead = _queue.CommandQueue._send_ahead

    def counting(self: Any, command: Any) -> bool:
        taken = send_ahead(self, command)
        sent[0] += taken
        return taken

    monkeypatch.setattr(_queue.CommandQueue, "_send_ahead", counting)
    return sent


def _relu_matmul(x: np.ndarray[Any, Any], w: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.maximum(x.astype(np.float64) @ w.astype(np.float64), 0)


async def test_programs_decided_ahead_give_the_values_and_leave_the_memory_of_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Independent programs (each reads resident inputs) are decided while the one before runs,
    # and so is a program reading the one before's output (a chain: it reads the storage that
    # record writes). Values against float64 numpy; memory afterwards is exactly the tensors held.
    sent = _count_sent(monkeypatch)
    binary = _layer()
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((256, 512)).astype(np.float32) for _ in range(6)]
    w = (rng.standard_normal((512, 256)) / 16).astype(np.float32)
    w2 = (rng.standard_normal((256, 512))[:256, :256] / 16).astype(np.float32)
    tile = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
    sq = tt.ProgramBuilder("square_layer")
    sq.output(sq.relu(sq.matmul(sq.input((256, 256), tile), sq.input((256, 256), tile))), tile)
    square = tt.Binary([sq.build()])
    async with tt.open_device(SPEC) as device:
        tw, tw2 = tt.to_device(w, device, tile), tt.to_device(w2, device, tile)
        txs = [tt.to_device(x, device, tile) for x in xs]
        for t in [tw, tw2, *txs]:
            await t
        outs = [tt.submit(device, binary, 0, [tx, tw])[0] for tx in txs]
        chained = tt.submit(device, square, 0, [outs[-1], tw2])[0]  # reads the one before
        for x, out in zip(xs, outs):
            np.testing.assert_allclose(await tt.to_host(out), _relu_matmul(x, w), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(await tt.to_host(chained), _relu_matmul(_relu_matmul(xs[-1], w), w2),
                                   rtol=1e-4, atol=1e-4)
        assert sent[0] >= 6, sent  # all but the first
        held = [tw, tw2, *txs, *outs, chained]
        for space in tt.MemorySpace:
            assert device.memory_used(space) == sum(
                tt.testing.buffer_footprint(b, SPEC) for t in held for _, b in t.storages if b.space is space)


async def test_a_program_decided_ahead_of_a_failing_one_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = _count_sent(monkeypatch)
    run = _queue.run
    failures = [1]

    def failing_once(record: Any, banks: Any) -> Any:
        if failures[0] and any(type(s) is _commands.Compute for s in record.steps):
            failures[0] = 0
            time.sleep(0.05)  # the next program is decided meanwhile
            raise tt.ProgramError("planted failure")
        return run(record, banks)

    monkeypatch.setattr(_queue, "run", failing_once)
    binary = _layer()
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((256, 512)).astype(np.float32), rng.standard_normal((512, 256)).astype(np.float32)
    tile = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
    async with tt.open_device(SPEC) as device:
        tx, tw = tt.to_device(x, device, tile), tt.to_device(w, device, tile)
        await tx
        await tw
        (bad,) = tt.submit(device, binary, 0, [tx, tw])
        (good,) = tt.submit(device, binary, 0, [tx, tw])
        np.testing.assert_allclose(await tt.to_host(good), _relu_matmul(x, w), rtol=1e-4, atol=1e-3)
        with pytest.raises(tt.ProgramError, match="planted failure"):
            await bad
        assert sent[0] == 1
        tt.deallocate(bad)
        for space in tt.MemorySpace:
            assert device.memory_used(space) == sum(
                tt.testing.buffer_footprint(b, SPEC) for t in (tx, tw, good) for _, b in t.storages if b.space is space)


async def test_nothing_is_decided_ahead_without_a_spare_thread_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # With one token in the thread limiter, the running program holds it: no program is decided
    # ahead (work sent ahead never takes the last quarter of the tokens); each runs in its turn.
    sent = _count_sent(monkeypatch)
    binary = _layer()
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((256, 512)).astype(np.float32), rng.standard_normal((512, 256)).astype(np.float32)
    tile = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
    async with tt.open_device(SPEC) as device:
        limiter = anyio.to_thread.current_default_thread_limiter()
        tokens = limiter.total_tokens
        tx, tw = tt.to_device(x, device, tile), tt.to_device(w, device, tile)
        await tx
        await tw
        limiter.total_tokens = 1
        try:
            outs = [tt.submit(device, binary, 0, [tx, tw])[0] for _ in range(3)]
            for out in outs:
                np.testing.assert_allclose(await tt.to_host(out), _relu_matmul(x, w), rtol=1e-4, atol=1e-3)
        finally:
            limiter.total_tokens = tokens
        assert sent[0] == 0
        for space in tt.MemorySpace:
            assert device.memory_used(space) == sum(
                tt.testing.buffer_footprint(b, SPEC) for t in (tx, tw, *outs) for _, b in t.storages if b.space is space)


def _block() -> tt.Binary:
    """A residual block whose output stays O(1) down a long chain: layer_norm(gelu(x @ w) + x)."""
    tile = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
    b = tt.ProgramBuilder("block")
    x, w = b.input((64, 64), tile), b.input((64, 64), tile)
    b.output(b.layer_norm(b.add(b.gelu(b.matmul(x, w)), x)), tile)
    return tt.Binary([b.build()])


def _block_numpy(x: np.ndarray[Any, Any], w: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    import math

    h = x.astype(np.float64) @ w.astype(np.float64)
    h = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2))) + x
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    return (h - mean) / np.sqrt(var + 1e-5)


def _block_inputs(seed: int) -> tuple[np.ndarray, np.ndarray, tt.Layout]:
    """A 64x64 input and weight for `_block`, and the TILE layout they go to the device in."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 64)) / 8).astype(np.float32)
    return x, w, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)


@pytest.mark.parametrize("workers", ["thread", "process"])
async def test_a_chain_goes_to_the_worker_ahead_of_its_turn_and_gives_numpys_values(
        workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Twelve programs, each reading the last one's output, submitted at once: all but the
    # first are decided and sent while an earlier one runs (a worker process takes them in a
    # few messages). Each value against float64 numpy; memory afterwards is the tensors held.
    sent = _count_sent(monkeypatch)
    x, w, tile = _block_inputs(4)
    async with tt.open_device(SMALL, workers=workers, inline_seconds=-1) as device:
        tx, tw = tt.to_device(x, device, tile), tt.to_device(w, device, tile)
        await tw
        chain = [tx]
        for _ in range(12):
            chain.append(tt.submit(device, _block(), 0, [chain[-1], tw])[0])
        expected = x
        for out in chain[1:]:
            expected = _block_numpy(expected, w)
            np.testing.assert_allclose(await tt.to_host(out), expected, rtol=1e-3, atol=1e-3)
        assert sent[0] >= 6, sent
        for space in tt.MemorySpace:
            assert device.memory_used(space) == sum(
                tt.testing.buffer_footprint(b, SMALL) for t in (tw, *chain) for _, b in t.storages
                if b.space is space)


@pytest.mark.parametrize("workers", ["thread", "process"])
async def test_a_program_pushed_while_one_runs_is_sent_behind_it(
        workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # One program at a time, the host busy in between (a training loop's shape): each is
    # pushed while the one before is on the worker (held there: paused), and is decided and
    # sent behind it then, not when it lands. Values against float64 numpy.
    sent = _count_sent(monkeypatch)
    x, w, tile = _block_inputs(6)
    async with tt.open_device(SMALL, workers=workers, inline_seconds=-1) as device:
        tx, tw = tt.to_device(x, device, tile), tt.to_device(w, device, tile)
        await tx
        await tw
        y, expected = tx, x
        device._cq0._worker.pause()
        try:
            for _ in range(6):
                y = tt.submit(device, _block(), 0, [y, tw])[0]
                expected = _block_numpy(expected, w)
                for _ in range(3):  # the queue takes the program and sends it
                    await anyio.lowlevel.checkpoint()
            assert sent[0] == 5, sent  # all but the first, which runs (held) in its turn
        finally:
            device._cq0._worker.resume()
        np.testing.assert_allclose(await tt.to_host(y), expected, rtol=1e-3, atol=1e-3)


def _failing_binary() -> tt.Binary:
    """x + (x / 0 through BFLOAT8_B): fails when it runs (BFLOAT8_B has no infinity)."""
    tile = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
    b = tt.ProgramBuilder("failing")
    x = b.input((64, 64), tile)
    b.output(b.add(b.typecast(b.typecast(b.div(x, 0.0), tt.DataType.BFLOAT8_B), F32), x), tile)
    return tt.Binary([b.build()])


@pytest.mark.parametrize("workers", ["thread", "process"])
async def test_a_chain_sent_ahead_fails_after_the_program_it_reads_fails(
        workers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The chain's third program fails when it runs (it stores an infinity as BFLOAT8_B, which
    # has no encoding for it: the same in a worker process); the programs sent behind it read
    # what it never wrote, so each must fail with its error, never hand back the bytes its run
    # left. The device goes on.
    sent = _count_sent(monkeypatch)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 64)) / 8).astype(np.float32)
    tile = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
    async with tt.open_device(SMALL, workers=workers, inline_seconds=-1) as device:
        tx, tw = tt.to_device(x, device, tile), tt.to_device(w, device, tile)
        await tw
        chain = [tt.submit(device, _block(), 0, [tx, tw])[0]]
        chain.append(tt.submit(device, _block(), 0, [chain[-1], tw])[0])
        failing = _failing_binary()
        chain.append(tt.submit(device, failing, 0, [chain[-1]])[0])
        for _ in range(5):
            chain.append(tt.submit(device, _block(), 0, [chain[-1], tw])[0])
        np.testing.assert_allclose(await tt.to_host(chain[1]), _block_numpy(_block_numpy(x, w), w),
                                   rtol=1e-3, atol=1e-3)
        for out in chain[2:]:
            with pytest.raises(tt.LayoutError, match="no encoding"):
                await tt.to_host(out)
        assert sent[0] >= 4, sent
        for out in chain[2:]:
            tt.deallocate(out)
        after = tt.submit(device, _block(), 0, [chain[1], tw])[0]
        np.testing.assert_allclose(await tt.to_host(after), _block_numpy(_block_numpy(_block_numpy(x, w), w), w),
                                   rtol=1e-3, atol=1e-3)
        for space in tt.MemorySpace:
            assert device.memory_used(space) == sum(
                tt.testing.buffer_footprint(b, SMALL) for t in (tx, tw, chain[0], chain[1], after)
                for _, b in t.storages if b.space is space)


# -- property: queued work with every record on the workers ---------------------------------------

_TILE = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
_SMALL = (64, 64)


def _two_op_binary() -> tt.Binary:
    """Program 0: a + b, then relu (a scratch intermediate); program 1: 2a (pagewise)."""
    b = tt.ProgramBuilder("add_relu")
    b.output(b.relu(b.add(b.input(_SMALL, _TILE), b.input(_SMALL, _TILE))), _TILE)
    m = tt.ProgramBuilder("double")
    m.output(m.mul(m.input(_SMALL, _TILE), 2.0), _TILE)
    return tt.Binary([b.build(), m.build()])


_actions = st.lists(
    st.one_of(
        st.tuples(st.just("add_relu"), st.integers(0, 7), st.integers(0, 7)),
        st.tuples(st.just("double"), st.integers(0, 7)),
        st.tuples(st.just("write"), st.integers(0, 7), st.integers(0, 2**16)),
        st.tuples(st.just("deallocate"), st.integers(0, 7)),
        st.tuples(st.just("await"), st.integers(0, 7)),
    ),
    min_size=1, max_size=30,
)


async def _run_actions(actions: list[tuple[Any, ...]], workers: str = "thread") -> None:
    binary = _two_op_binary()
    rng = np.random.default_rng(0)
    async with tt.open_device(tt.DeviceSpec.small(), inline_seconds=-1, workers=workers) as device:
        pool: list[tuple[tt.Tensor, np.ndarray[Any, Any]]] = []
        for _ in range(3):
            value = rng.standard_normal(_SMALL).astype(np.float32)
            pool.append((tt.to_device(value, device, _TILE), value))
        for action in actions:
            kind, i = action[0], action[1] % len(pool)
            tensor, value = pool[i]
            if kind == "add_relu":
                other, other_value = pool[action[2] % len(pool)]
                (out,) = tt.submit(device, binary, 0, [tensor, other])
                pool.append((out, np.maximum(value + other_value, np.float32(0))))
            elif kind == "double":
                (out,) = tt.submit(device, binary, 1, [tensor])
                pool.append((out, value * np.float32(2)))
            elif kind == "write":
                new = np.random.default_rng(action[2]).standard_normal(_SMALL).astype(np.float32)
                tt.write(tensor, new)
                pool[i] = (tensor, new)
            elif kind == "deallocate" and len(pool) > 2:
                tt.deallocate(tensor)
                del pool[i]
            elif kind == "await":
                assert np.array_equal(await tt.to_host(tensor), value)
        for tensor, value in pool:
            assert np.array_equal(await tt.to_host(tensor), value)
        for space in tt.MemorySpace:
            assert device.memory_used(space) == sum(
                tt.testing.buffer_footprint(b, tt.DeviceSpec.small()) for t, _ in pool
                for _, b in t.storages if b.space is space)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(actions=_actions)
def test_queued_work_on_the_workers_matches_numpy(
    backend: str, actions: list[tuple[Any, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every record runs on a worker thread (so writes behind readers convert ahead, and programs
    # are decided ahead), nothing is awaited until an `await` action: values equal numpy's
    # (exact: float32 adds, relu and doubling), and the memory held is the tensors held.
    anyio.run(_run_actions, actions, backend=backend)


@settings(deadline=None, max_examples=12, suppress_health_check=[HealthCheck.too_slow])
@given(actions=_actions)
def test_queued_work_on_a_worker_process_matches_numpy(actions: list[tuple[Any, ...]]) -> None:
    # The same property with the records in a worker process (a process per example: fewer
    # examples): chains and writes behind readers go there in batches, in wire form.
    anyio.run(_run_actions, actions, "process")
