"""A device's records in a worker process (issue 28, first step: `workers="process"`).

The same programs on the same inputs, with thread workers and with a worker process, must give
the same bytes: elementwise, matmul and conversion programs, donation, eviction under L1
pressure, a trace replay, an SPMD program on a 1x2 mesh (and one with collectives, whose records
stay in the host process, as do host ops and programs under debug hooks). Most runs set `inline_seconds=-1`, so that every record travels to
the worker (none runs inline on the loop). Faults: a killed worker fails pending and later
awaits with a typed `DeviceLostError`, never a hang; the other chip of a mesh goes on; closing
(normally with work queued, on an error, cancelled) reaps the child. After every test: no child
process and no shared-memory file of ours is left. The runtime state machine runs a short while
on a process-worker device too, and the plain async tests of test_mesh, test_trace and
test_donation run again with every device on worker processes (`_borrow`).
"""

from __future__ import annotations

import functools
import glob
import os
import signal
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import ml_dtypes
import numpy as np
import pytest
from hypothesis import settings

import ttflow as tt
from ttflow._memory.banks import SHARED_DIR, SHARED_PREFIX
from ttflow._workers.endpoint import ENDPOINT_PREFIX
from ttflow._workers.process import ProcessQueueWorker

pytestmark = pytest.mark.anyio

F32, BF16, BF8, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B, tt.DataType.INT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE, RM = tt.TensorLayout.TILE, tt.TensorLayout.ROW_MAJOR
SMALL = tt.DeviceSpec.small()
LOST_WITHIN = 20.0  # seconds: a lost worker must fail awaits by then, not hang


def _children() -> list[int]:
    """Pids of this process's live (or unreaped) children, from /proc (no psutil)."""
    me, found = os.getpid(), []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found.append(int(stat.split("/")[2]))
    return found


def _segments() -> list[str]:
    return glob.glob(os.path.join(SHARED_DIR, SHARED_PREFIX + "*"))


def _endpoints() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"{ENDPOINT_PREFIX}{os.getpid()}-*"))


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After each test: no child process, shared-memory file or endpoint directory left (the
    other worker test files import this fixture)."""
    before = set(_children())
    yield
    assert set(_children()) - before == set(), "a worker process outlived its device"
    assert _segments() == [], "a shared bank memory outlived its device"
    assert _endpoints() == [], "an endpoint's directory outlived its worker"


def _workers(device: tt.Device) -> list[ProcessQueueWorker]:
    workers = [device._cq0._worker, device._cq1._worker]
    assert all(isinstance(w, ProcessQueueWorker) for w in workers)
    return workers  # type: ignore[return-value]


Scenario = Callable[[dict[str, Any]], Awaitable[list[np.ndarray]]]


async def both(scenario: Scenario, inline_seconds: float | None = -1.0) -> list[np.ndarray]:
    """Runs `scenario(open_kwargs)` with thread workers and with a worker process: equal bytes."""
    threads = await scenario({"workers": "thread", "inline_seconds": inline_seconds})
    processes = await scenario({"workers": "process", "inline_seconds": inline_seconds})
    assert len(threads) == len(processes) > 0
    for a, b in zip(threads, processes):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    return processes


def values(shape: tuple[int, ...], dtype: tt.DataType = F32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype is I32:
        return rng.integers(-1000, 1000, shape, dtype=np.int32)
    return rng.standard_normal(shape).astype(dtype.host_dtype)


# -- the same bytes ------------------------------------------------------------------------------


async def _programs(kwargs: dict[str, Any]) -> list[np.ndarray]:
    b = tt.ProgramBuilder("mlp")
    x = b.input((64, 96), tt.Layout(DRAM, TILE, F32))
    w = b.input((96, 80), tt.Layout(L1, TILE, BF16))
    h = b.gelu(b.matmul(x, b.typecast(w, F32)))
    b.output(b.softmax(h, axis=-1), tt.Layout(DRAM, RM, F32))
    b.output(b.sum(b.exp(b.mul(h, 0.01)), 0), tt.Layout(DRAM, TILE, BF8))
    mlp = b.build()
    b = tt.ProgramBuilder("pointwise")
    p = b.input((64, 64), tt.Layout(DRAM, TILE, F32))
    b.output(b.relu(b.sub(b.mul(p, p), 0.5)), tt.Layout(DRAM, TILE, F32))
    pointwise = b.build()
    b = tt.ProgramBuilder("ints")
    i = b.input((40, 33), tt.Layout(DRAM, RM, I32))
    b.output(b.add(i, b.input((40, 33), tt.Layout(L1, TILE, I32))), tt.Layout(L1, TILE))
    ints = b.build()
    binary = tt.Binary([mlp, pointwise, ints])
    out = []
    async with tt.open_device(SMALL, **kwargs) as device:
        xt = tt.to_device(values((64, 96)), device)  # ROW_MAJOR: converted at the start
        wt = tt.to_device(values((96, 80), BF16, 1), device)
        for _ in range(3):  # the plan travels once, then its id
            a, s = tt.submit(device, binary, 1 - 1, [xt, wt])
            out += [await tt.to_host(a), await tt.to_host(s)]
        q = tt.to_device(values((64, 64), F32, 2), device, tt.Layout(DRAM, TILE))
        for _ in range(4):
            (q,) = tt.submit(device, binary, 1, [q])
        out.append(await tt.to_host(q))
        ia, ib = tt.to_device(values((40, 33), I32, 3), device), tt.to_device(values((40, 33), I32, 4), device)
        (s,) = tt.submit(device, binary, 2, [ia, ib])
        out.append(await tt.to_host(s))
        converted = tt.to_layout(xt, tt.Layout(L1, TILE, BF8))
        out.append(await tt.to_host(converted))
        tt.write(xt, values((64, 96), F32, 5))
        out.append(await tt.to_host(tt.to_layout(xt, tt.Layout(DRAM, TILE, BF16))))
        out.append(np.frombuffer(device.read_bank(DRAM, 0, 0, 4096), np.uint8).copy())
        if kwargs["workers"] == "process":
            cq0, cq1 = _workers(device)
            assert cq0.sent_jobs > 0 and cq0.local_jobs == 0
            if kwargs["inline_seconds"] == -1:  # every record travelled, but writes and reads
                assert cq1.transfers > 0 and len(cq0._plans._ids) == 3  # each plan defined once
    return out


async def test_programs_and_conversions_equal_thread_workers_bit_for_bit() -> None:
    await both(_programs)


async def test_the_default_inline_threshold_mixes_host_and_worker_runs_on_shared_banks() -> None:
    await both(_programs, inline_seconds=None)


async def _donation(kwargs: dict[str, Any]) -> list[np.ndarray]:
    b = tt.ProgramBuilder("bump")
    x = b.input((64, 64))
    b.output(b.add(x, 1.0), donates=x)
    binary = tt.Binary([b.build()])
    async with tt.open_device(SMALL, **kwargs) as device:
        t = tt.to_device(values((64, 64)), device, tt.get_layout(binary, 0, 0))
        address = None
        for _ in range(5):
            (t,) = tt.submit(device, binary, 0, [t])
            await t
            address = address or t.buffer.address
            assert t.buffer.address == address  # the donated buffer, every time
        assert device.stats.donations == 5
        return [await tt.to_host(t)]


async def test_donation() -> None:
    await both(_donation)


async def _eviction(kwargs: dict[str, Any]) -> list[np.ndarray]:
    b = tt.ProgramBuilder("l1_add")
    lay = tt.Layout(L1, TILE, F32)
    b.output(b.add(b.input((64, 128), lay), b.input((64, 128), lay)), lay)
    binary = tt.Binary([b.build()])
    async with tt.open_device(SMALL, **kwargs) as device:
        ts = [tt.to_device(values((64, 128), F32, k), device, lay) for k in range(6)]  # 192 KiB of 256
        outs = []
        for k in range(10):
            (y,) = tt.submit(device, binary, 0, [ts[k % 6], ts[(k + 1) % 6]])
            outs.append(y)
        got = [await tt.to_host(y) for y in outs] + [await tt.to_host(t) for t in ts]
        assert device.stats.evictions > 0
        return got


async def test_eviction_under_l1_pressure() -> None:
    await both(_eviction)


async def _trace(kwargs: dict[str, Any]) -> list[np.ndarray]:
    b = tt.ProgramBuilder("step")
    x = b.input((64, 64), tt.Layout(DRAM, TILE, F32))
    b.output(b.gelu(b.matmul(x, x)), tt.Layout(DRAM, TILE, F32))
    binary = tt.Binary([b.build()])
    out = []
    async with tt.open_device(SMALL, **kwargs) as device:
        slot = tt.empty((64, 64), F32, device, tt.Layout(DRAM, TILE))
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, binary, 0, [slot])
        for step in range(3):
            tt.write(slot, values((64, 64), F32, step) * 0.1)
            tt.execute_trace(trace)
            out.append(await tt.to_host(y))
        assert device.stats.trace_replays == 3
        tt.release_trace(trace)
    return out


async def test_trace_replay() -> None:
    await both(_trace)


def _mlp_binary() -> tt.Binary:
    b = tt.ProgramBuilder("matmul_relu")
    x = b.input((64, 40), tt.Layout(DRAM, TILE, F32))
    w = b.input((40, 24), tt.Layout(L1, TILE, F32))
    b.output(b.relu(b.matmul(x, w)))
    return tt.Binary([b.build()])


def _gather_binary() -> tt.Binary:
    """A 1x2 mesh program with two collectives: an all_gather, then an all_reduce of it."""
    b = tt.ProgramBuilder("gather", mesh_shape=(1, 2))
    v = b.input((8, 12))
    b.output(b.all_reduce(b.all_gather(b.mul(v, 3.0), -1, cluster_axis=1), cluster_axis=1))
    return tt.Binary([b.build()])


async def _mesh(kwargs: dict[str, Any]) -> list[np.ndarray]:
    binary = _mlp_binary()
    gather = _gather_binary()
    async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL), **kwargs) as mesh:
        pids = mesh.worker_pids
        assert len(pids) == 2 and (pids == [None, None]) == (kwargs["workers"] == "thread")
        xt = tt.to_device(values((128, 40)), mesh, tt.Layout(DRAM, TILE), mapper=tt.shard(0))
        wt = tt.to_device(values((40, 24), F32, 1), mesh)
        ys = []
        for _ in range(3):
            (y,) = tt.submit(mesh, binary, 0, [xt, wt])
            ys.append(y)
        out = [await tt.to_host(y, tt.concat(0)) for y in ys]
        g = tt.to_device(values((16, 12), F32, 2), mesh, mapper=tt.shard(0))
        (z,) = tt.submit(mesh, gather, 0, [g])
        out.append(await tt.to_host(z, tt.concat(0)))
        if kwargs["workers"] == "process":
            for chip in mesh.chips:
                cq0, _ = _workers(chip)
                assert cq0.sent_jobs >= 4  # the SPMD programs travelled, and the collectives
                assert cq0.local_jobs == 0  # (tests/test_process_collectives.py)
    return out


async def test_a_1x2_mesh_spmd_program_and_one_with_collectives() -> None:
    await both(_mesh)


def _hosted_and_plain() -> tuple[tt.Binary, tt.Binary]:
    """A program with a host op (sort, between device ops) and a plain one (gelu), 64x64."""
    b = tt.ProgramBuilder("hosted")
    x = b.input((64, 64), tt.Layout(DRAM, TILE, F32))
    (h,) = b.host_op(lambda a: np.sort(a, axis=-1), [b.mul(x, 2.0)], [((64, 64), F32)], name="sort")
    b.output(b.add(h, 1.0), tt.Layout(DRAM, TILE, F32))
    hosted = tt.Binary([b.build()])
    b = tt.ProgramBuilder("plain")
    b.output(b.gelu(b.input((64, 64), tt.Layout(DRAM, TILE, F32))), tt.Layout(DRAM, TILE, F32))
    return hosted, tt.Binary([b.build()])


async def _in_process(kwargs: dict[str, Any]) -> list[np.ndarray]:
    """A host op's program (its function runs in the host process, on the queue's worker thread,
    in queue order) and a program under debug hooks (run on a thread of anyio's that calls back
    into the loop): neither travels in this step."""
    hosted, plain = _hosted_and_plain()
    seen: list[str] = []
    async with tt.open_device(SMALL, **kwargs) as device:
        t = tt.to_device(values((64, 64)), device, tt.Layout(DRAM, TILE))
        out = [await tt.to_host(tt.submit(device, hosted, 0, [t])[0])]
        with tt.debug_hooks(device, post_op=lambda ctx: seen.append(ctx.name)):
            out.append(await tt.to_host(tt.submit(device, plain, 0, [t])[0]))
        out.append(await tt.to_host(tt.submit(device, plain, 0, [t])[0]))
        if kwargs["workers"] == "process":
            cq0, _ = _workers(device)
            assert cq0.local_jobs == 1  # the host op's record
            assert cq0.sent_jobs >= 1  # the last, unhooked program
    assert seen == ["gelu"]
    return out


async def test_host_ops_and_debug_hooks_run_in_the_host_process() -> None:
    await both(_in_process)


# -- writes and reads in the host, on the shared banks ---------------------------------------------


async def test_writes_and_reads_run_in_the_host_on_the_shared_banks() -> None:
    # A 1 MiB write and its read back, a BFLOAT16 one, and a program between that the worker
    # runs on what the host wrote: the transfers never travel (no round trip, nothing pickled),
    # the worker sees the host's bytes and the host the worker's. Values equal numpy's.
    big = values((512, 512))
    half = values((256, 512), F32, 3)
    async with tt.open_device(SMALL, workers="process", inline_seconds=-1) as device:
        t = tt.to_device(big, device, tt.Layout(DRAM, TILE))
        b = tt.to_device(half, device, tt.Layout(DRAM, RM, BF16))
        doubled = tt.submit(device, _double_binary(), 0, [t])[0]
        assert np.array_equal(await tt.to_host(t), big)
        assert np.array_equal(await tt.to_host(doubled), big * np.float32(2))
        got = await tt.to_host(b)
        assert np.array_equal(got.astype(np.float32), half.astype(ml_dtypes.bfloat16).astype(np.float32))
        cq0, cq1 = _workers(device)
        assert cq1.sent_jobs == 0 and cq1.transfers >= 1  # the writes (a batch of them is one)
        assert cq0.sent_jobs == 1 and cq0.transfers >= 3  # the program travelled; the reads did not
        assert cq0.local_jobs == cq1.local_jobs == 0


def _double_binary() -> tt.Binary:
    b = tt.ProgramBuilder("double")
    b.output(b.mul(b.input((512, 512), tt.Layout(DRAM, TILE)), 2.0), tt.Layout(DRAM, TILE))
    return tt.Binary([b.build()])


# -- faults --------------------------------------------------------------------------------------


async def _killed(device: tt.Device) -> None:
    pid = device.worker_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


async def test_a_killed_worker_fails_pending_and_later_awaits_typed() -> None:
    binary = _mlp_binary()
    async with tt.open_device(SMALL, workers="process", inline_seconds=-1) as device:
        assert device.worker_pid is not None and len(_segments()) == 2  # DRAM and L1
        xt = tt.to_device(values((64, 40)), device, tt.Layout(DRAM, TILE))
        wt = tt.to_device(values((40, 24), F32, 1), device)
        before = await tt.to_host(tt.submit(device, binary, 0, [xt, wt])[0])
        for worker in _workers(device):
            worker.pause()  # what is sent from now on stays on its way
        pending = [tt.submit(device, binary, 0, [xt, wt])[0] for _ in range(3)]
        await anyio.sleep(0.05)
        await _killed(device)
        for worker in _workers(device):
            worker.resume()
        with anyio.fail_after(LOST_WITHIN):
            for y in pending:
                with pytest.raises(tt.DeviceLostError) as lost:
                    await y
                assert lost.value.chip is None and "worker process" in str(lost.value)
            later = tt.submit(device, binary, 0, [xt, wt])[0]
            with pytest.raises(tt.DeviceLostError):
                await tt.to_host(later)
            with pytest.raises(tt.DeviceLostError):
                await tt.to_host(tt.to_device(values((4, 4)), device))
        assert before.shape == (64, 24)
    assert device.closed


async def test_a_killed_worker_while_idle_fails_the_next_work() -> None:
    async with tt.open_device(SMALL, workers="process") as device:  # default threshold: inline runs too
        t = tt.to_device(values((32, 32)), device)
        await t
        await _killed(device)
        with anyio.fail_after(LOST_WITHIN):
            while not device._cq0._aborted:  # the watcher tells the queues
                await anyio.sleep(0.01)
            with pytest.raises(tt.DeviceLostError):
                await tt.to_host(t)


async def test_a_lost_chip_names_its_coordinate_and_the_other_goes_on() -> None:
    binary = _mlp_binary()
    async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL), workers="process", inline_seconds=-1) as mesh:
        pids = mesh.worker_pids
        assert len(set(pids)) == 2 and None not in pids
        chip0, chip1 = mesh.chips
        x1 = tt.to_device(values((64, 40)), chip1, tt.Layout(DRAM, TILE))
        w1 = tt.to_device(values((40, 24), F32, 1), chip1)
        await _killed(chip1)
        with anyio.fail_after(LOST_WITHIN):
            with pytest.raises(tt.DeviceLostError) as lost:
                await tt.to_host(tt.submit(chip1, binary, 0, [x1, w1])[0])
        assert lost.value.chip == (0, 1)
        x0 = tt.to_device(values((64, 40)), chip0, tt.Layout(DRAM, TILE))
        w0 = tt.to_device(values((40, 24), F32, 1), chip0)
        got = await tt.to_host(tt.submit(chip0, binary, 0, [x0, w0])[0])
        np.testing.assert_allclose(got, np.maximum(values((64, 40)) @ values((40, 24), F32, 1), 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["normally", "error", "cancelled"])
async def test_closing_with_work_queued_reaps_the_worker(how: str) -> None:
    binary = _mlp_binary()
    pids: list[int | None] = []
    outs: list[tt.Tensor] = []

    async def body() -> None:
        async with tt.open_device(SMALL, workers="process", inline_seconds=-1) as device:
            pids.append(device.worker_pid)
            xt = tt.to_device(values((64, 40)), device, tt.Layout(DRAM, TILE))
            wt = tt.to_device(values((40, 24), F32, 1), device)
            outs.extend(tt.submit(device, binary, 0, [xt, wt])[0] for _ in range(20))
            if how == "error":
                raise KeyError("the block failed")
            if how == "cancelled":
                await anyio.sleep(60)

    if how == "error":
        with pytest.raises(KeyError):
            await body()
    elif how == "cancelled":
        with anyio.move_on_after(0.3):
            await body()
    else:
        await body()
    assert pids[0] is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # reaped: gone
    if how == "normally":
        assert all(t.done() for t in outs)


async def test_workers_is_checked() -> None:
    with pytest.raises(ValueError, match="workers"):
        async with tt.open_device(SMALL, workers="gpu"):
            pass
    async with tt.open_device(SMALL) as device:
        assert device.worker_pid is None


# -- the runtime state machine, with a worker process -------------------------------------------


def _process_machine() -> Any:
    from test_runtime_machine import RuntimeMachine

    class ProcessRuntimeMachine(RuntimeMachine):
        """The runtime machine's rules on a device whose records run in a worker process."""

        workers = "process"

        def __init__(self) -> None:
            super().__init__()
            assert self.device.worker_pid is not None

        def teardown(self) -> None:
            workers = _workers(self.device)
            try:
                super().teardown()
            finally:
                SENT.append(sum(w.sent_jobs for w in workers))

    return ProcessRuntimeMachine


SENT: list[int] = []  # records each machine run sent to its worker process


def _scaled(examples: int) -> int:
    """`examples` under the ci profile (40 examples), as many more under a longer one."""
    return max(examples, settings.default.max_examples * examples // 40)


def test_the_runtime_machine_on_a_worker_process() -> None:
    machine = _process_machine()
    case = machine.TestCase
    case.settings = settings(max_examples=_scaled(8), stateful_step_count=30, deadline=None)
    SENT.clear()
    case().runTest()
    assert sum(SENT) > 0


def _process_mesh_machine() -> Any:
    from ttflow.testing import MeshStateMachine

    class ProcessMeshMachine(MeshStateMachine):
        """The mesh machine's rules (collectives, mappers, L1 pressure, a failing peer,
        submeshes) on a 1x3 ring whose chips run their records in worker processes."""

        mesh_spec = tt.MeshSpec((1, 3), chip=SMALL, topology="ring")

        workers = "process"

        def __init__(self) -> None:
            super().__init__()
            assert all(pid is not None for pid in self.mesh.worker_pids)

        def teardown(self) -> None:
            workers = [w for chip in self.chips for w in _workers(chip)]
            try:
                super().teardown()
            finally:
                SENT.append(sum(w.sent_jobs for w in workers))

    return ProcessMeshMachine


def test_the_mesh_machine_on_worker_processes() -> None:
    case = _process_mesh_machine().TestCase
    case.settings = settings(max_examples=_scaled(6), stateful_step_count=30, deadline=None)
    SENT.clear()
    case().runTest()
    assert sum(SENT) > 0


# -- existing modules, again on worker processes -------------------------------------------------


def _on_processes(test: Any) -> Any:
    """`test` (an async test of another module) with every device and mesh it opens through
    `tt.open_device` / `tt.open_mesh_device` on worker processes, every record sent there."""

    @functools.wraps(test)
    async def wrapper(*args: Any, **kwargs: Any) -> None:
        opened, opened_mesh = tt.open_device, tt.open_mesh_device
        # Every record to the worker, unless the test sets its own threshold.
        tt.open_device = functools.partial(opened, workers="process", inline_seconds=-1)  # type: ignore[assignment]
        tt.open_mesh_device = functools.partial(  # type: ignore[assignment]
            opened_mesh, workers="process", inline_seconds=-1)
        try:
            await test(*args, **kwargs)
        finally:
            tt.open_device, tt.open_mesh_device = opened, opened_mesh  # type: ignore[assignment]

    return wrapper


_NOT_BORROWED = {
    # Counts CQ0's commands in a timeline: at inline_seconds=-1 a replay's preamble shows as one
    # more, with thread workers too.
    "test_the_timeline_shows_a_replay_as_one_command_with_its_programs_inside":
        "counts commands at the default inline threshold",
    # Reads memory_used right after dropping a replicated tensor whose zero fill on chip 1 may
    # still be in flight (its free waits for the landing): timing, which a process round trip
    # makes visible.
    "test_layout_write_and_deallocate_act_on_every_shard": "reads memory with a store in flight",
}


def borrow(module_name: str, into: dict[str, Any], not_borrowed: dict[str, str]) -> None:
    """Every plain async test of `module_name` (hypothesis' excepted: a process per example is
    too slow here; and `not_borrowed`'s), again in `into` (a test module's globals) as
    `<name>_on_processes`."""
    import importlib
    import inspect

    module = importlib.import_module(module_name)
    for name, test in vars(module).items():
        if (name.startswith("test_") and inspect.iscoroutinefunction(test)
                and not getattr(test, "is_hypothesis_test", False) and name not in not_borrowed):
            into[f"{name}_on_processes"] = _on_processes(test)


for _module in ("test_mesh", "test_trace", "test_donation", "test_mesh_submit"):
    borrow(_module, globals(), _NOT_BORROWED)
