"""Collectives worker to worker (issue 28: `workers="process"`).

A chip's record with collectives travels to its worker process, which meets the other chips'
workers straight (`ttflow/_peers.py`, `ttflow/_workers/endpoint.py`: arrivals and chunks over each worker's endpoint) and
reports each step back to the host (link bytes, arrivals, hops), which keeps the records, the
link counters and the log as when the chips meet in the host. Checked here:

- the same bytes as thread workers, bit for bit, for every collective, dtype and topology, with
  the same link bytes, the same collective records (modelled times included) and the same
  timeline; the records ran in the workers (their pids came back, no record ran on a host
  thread) and no chunk went through a mailbox of the host process;
- faults: a chip whose command fails before it runs or while it runs, a worker killed
  mid-collective (SIGKILL), a mesh closed or cancelled with collectives in flight: every other
  chip fails typed (`CollectiveError` naming the chip, or `DeviceLostError`), within a bound;
- the async tests of test_collectives, test_mesh_examples and test_mesh_traces again on
  worker processes (mesh traces with collectives travel too: a replay's steps carry their
  execute's peers).

After every test: no child process, no /dev/shm file and no endpoint directory of ours is left.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import anyio
import numpy as np
import pytest
from test_collectives import outcomes
from test_process_workers import borrow, nothing_left_behind  # noqa: F401 (autouse)

import ttflow as tt
from ttflow._mesh import collectives
from ttflow._workers.process import ProcessQueueWorker

pytestmark = pytest.mark.anyio

F32, BF16, BF8, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B, tt.DataType.INT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE, RM = tt.TensorLayout.TILE, tt.TensorLayout.ROW_MAJOR
SMALL = tt.DeviceSpec.small()
BOUND = 20.0  # seconds: every fault must fail the waiting chips typed by then, never hang


def _workers(mesh: tt.MeshDevice) -> list[ProcessQueueWorker]:
    workers = [chip._cq0._worker for chip in mesh.chips]
    assert all(isinstance(w, ProcessQueueWorker) for w in workers)
    return workers  # type: ignore[return-value]


def values(shape: tuple[int, ...], dtype: tt.DataType, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype is I32:
        return rng.integers(-1000, 1000, shape, dtype=np.int32)
    return rng.standard_normal(shape).astype(np.float32)


def _every_step(dtype: tt.DataType, layout: tt.TensorLayout) -> tt.Binary:
    """Each collective once, along rows, columns and the whole 2x4 mesh (ring, line, routes)."""
    b = tt.ProgramBuilder(f"every/{dtype.name}", mesh_shape=(2, 4))
    x = b.input((32, 128), tt.Layout(DRAM, layout, dtype))
    y = b.all_gather(x, 0, cluster_axis=1)  # a line of four
    z = b.reduce_scatter(y, 0, cluster_axis=1)
    w = b.all_reduce(z, cluster_axis=0)  # a line of two
    v = b.all_reduce(w)  # the 2x4 ring
    u = b.all_to_all(v, 1, 0, cluster_axis=1)
    t = b.broadcast(u, (1, 2))  # a tree
    s = b.point_to_point(t, (0, 3), (1, 0))  # a route of several hops
    b.output(s, tt.Layout(L1, TILE, dtype))
    b.output(b.all_gather(v, 1))
    return tt.Binary([b.build()])


def _record(r: Any) -> tuple[Any, ...]:
    return (r.op, r.program, r.step, r.group, r.topology, r.nbytes, r.hops, r.links, r.modelled_seconds,
            sorted(r.link_bytes.items()), sorted(r.waited), sorted(r.chip_ids.items()))


async def _run(workers: str) -> tuple[list[np.ndarray], dict[Any, int], list[tuple[Any, ...]], dict[str, int]]:
    """Every step on a 2x4 mesh for each dtype and layout: outputs, link bytes, records, and
    (process workers) what came back from the workers."""
    out: list[np.ndarray] = []
    stats = dict(collectives.STATS)
    async with tt.open_mesh_device(tt.MeshSpec((2, 4), chip=SMALL), workers=workers,
                                   inline_seconds=-1) as mesh:
        with collectives.collective_log(mesh).listening() as log:
            cases = [(F32, TILE), (F32, RM), (BF16, TILE), (I32, RM), (BF8, TILE)]
            for k, (dtype, layout) in enumerate(cases):
                binary = _every_step(dtype, layout)
                shards = [tt.to_device(values((32, 128), dtype, 10 * k + i), chip, tt.Layout(DRAM, layout, dtype))
                          for i, chip in enumerate(mesh.chips)]
                with anyio.fail_after(BOUND * 3):
                    outs = tt.submit(mesh, binary, 0, [tt.from_shards(shards, mesh)])
                    for o in outs:
                        out += [await tt.to_host(t) for t in tt.device_tensors(o)]
        links = mesh.stats.link_bytes
        records = [_record(r) for r in log]
        if workers == "process":
            pids = set(mesh.worker_pids)
            assert None not in pids and pids <= collectives.WORKER_PIDS  # the steps ran there
            assert all(w.local_jobs == 0 and w.sent_jobs >= len(cases) for w in _workers(mesh))
    delta = {k: collectives.STATS[k] - stats[k] for k in stats}
    return out, links, records, delta


async def test_every_collective_equals_thread_workers_bit_for_bit_with_the_same_links_and_records() -> None:
    threads, thread_links, thread_records, thread_delta = await _run("thread")
    processes, links, records, delta = await _run("process")
    assert len(threads) == len(processes) == 5 * 2 * 8
    for a, b in zip(threads, processes):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert links == thread_links and sum(links.values()) > 0
    assert len(records) == len(thread_records) == 5 * 14 and sorted(records) == sorted(thread_records)
    # Thread workers meet in the host; worker processes send their chunks straight to each
    # other: not one went through a mailbox of the host process.
    assert thread_delta["worker_chunks"] == 0 and thread_delta["host_chunks"] > 0
    assert delta["host_chunks"] == 0
    assert delta["worker_chunks"] == thread_delta["host_chunks"]  # chunk for chunk the same algorithm
    assert delta["worker_steps"] == sum(len(r[3]) for r in records)  # each chip reported each step


async def _replays(workers: str) -> tuple[list[np.ndarray], dict[Any, int], list[tuple[Any, ...]], dict[str, int]]:
    """A mesh trace of two submits with collectives, executed three times."""
    stats = dict(collectives.STATS)
    out: list[np.ndarray] = []
    async with tt.open_mesh_device(tt.MeshSpec((2, 2), chip=SMALL), workers=workers, inline_seconds=-1) as mesh:
        with collectives.collective_log(mesh).listening() as log:
            x = tt.to_device(values((32, 128), F32, 1), mesh, mapper=tt.shard(0))
            binary = _every_step(F32, TILE) if mesh.shape == (2, 4) else _two_by_two()
            with tt.capture_trace(mesh) as trace:
                (y,) = tt.submit(mesh, binary, 0, [x])
                (z,) = tt.submit(mesh, binary, 0, [y])
            with anyio.fail_after(BOUND):
                for k in range(3):
                    for i, shard in enumerate(tt.device_tensors(x)):
                        tt.write(shard, values((8, 128), F32, 10 * k + i))
                    tt.execute_trace(trace)
                    out += [await tt.to_host(t) for t in (*tt.device_tensors(y), *tt.device_tensors(z))]
            tt.release_trace(trace)
        links, records = mesh.stats.link_bytes, [_record(r) for r in log]
        if workers == "process":
            assert all(w.local_jobs == 0 for w in _workers(mesh))  # the replays travelled
            assert set(mesh.worker_pids) <= collectives.WORKER_PIDS
    return out, links, records, {k: collectives.STATS[k] - stats[k] for k in stats}


def _two_by_two() -> tt.Binary:
    b = tt.ProgramBuilder("replayed", mesh_shape=(2, 2))
    x = b.input((8, 128))
    y = b.all_gather(b.mul(x, 0.5), 0, cluster_axis=0)
    b.output(b.reduce_scatter(b.all_reduce(y, cluster_axis=1), 0, cluster_axis=0))
    return tt.Binary([b.build()])


async def test_mesh_trace_replays_travel_and_equal_thread_workers() -> None:
    threads, thread_links, thread_records, thread_delta = await _replays("thread")
    processes, links, records, delta = await _replays("process")
    assert len(threads) == len(processes) == 3 * 2 * 4
    assert all(a.tobytes() == b.tobytes() for a, b in zip(threads, processes))
    assert links == thread_links and sorted(records) == sorted(thread_records) and len(records) == 4 * 2 * 3 * 2  # captured, then three executes
    assert delta["host_chunks"] == 0 and delta["worker_chunks"] == thread_delta["host_chunks"] > 0


# -- faults ------------------------------------------------------------------------------------------


def _overflowing() -> tt.Binary:
    """An all_reduce whose input, past 2**30, fails the chip's checked add before the step."""
    b = tt.ProgramBuilder("overflowing")
    x = b.input((4, 32), tt.Layout(dtype=I32))
    with b.checking_range("chip overflow"):
        y = b.add(x, x)
    b.output(b.all_reduce(y))
    return tt.Binary([b.build()])


async def _outcomes(out: tt.MeshTensor) -> list[Any]:
    with anyio.fail_after(BOUND):
        return await outcomes(out)


async def test_a_chip_failing_in_its_worker_fails_the_other_workers_typed() -> None:
    async with tt.open_mesh_device(tt.MeshSpec((1, 4), chip=SMALL), workers="process",
                                   inline_seconds=-1) as mesh:
        start = anyio.current_time()
        shards = [tt.to_device(np.full((4, 32), 2**30 + 5 if k == 2 else k, np.int32), chip)
                  for k, chip in enumerate(mesh.chips)]
        (out,) = tt.submit(mesh, _overflowing(), 0, [tt.from_shards(shards, mesh)])
        got = await _outcomes(out)
        assert isinstance(got[2], tt.TTFlowError) and not isinstance(got[2], tt.CollectiveError)
        for k in (0, 1, 3):
            assert isinstance(got[k], tt.CollectiveError), got[k]
            assert got[k].chip == (0, 2) and got[k].collective == "all_reduce", str(got[k])
            assert "chip (0, 2) failed first" in str(got[k])
        assert anyio.current_time() - start < BOUND
        assert all(w.local_jobs == 0 for w in _workers(mesh))  # they ran, and failed, in the workers
        ok = [tt.to_device(np.full((4, 32), k, np.int32), chip) for k, chip in enumerate(mesh.chips)]
        (out,) = tt.submit(mesh, _overflowing(), 0, [tt.from_shards(ok, mesh)])
        assert all(np.array_equal(r, np.full((4, 32), 12)) for r in await _outcomes(out))


async def _waiting(mesh: tt.MeshDevice, held: int) -> tt.MeshTensor:
    """An all_reduce submitted with chip `held`'s CQ0 worker paused: the others' records wait
    in the collective, in their workers, for it."""
    worker = _workers(mesh)[held]
    worker.pause()
    try:
        shards = [tt.to_device(np.full((4, 32), k, np.int32), chip) for k, chip in enumerate(mesh.chips)]
        (out,) = tt.submit(mesh, _overflowing(), 0, [tt.from_shards(shards, mesh)])
        with anyio.fail_after(BOUND):
            while not all(w.busy for k, w in enumerate(_workers(mesh)) if k != held):
                await anyio.sleep(0.01)
        await anyio.sleep(0.2)  # their records are in the workers, waiting at the barrier
        assert not any(t.done() for t in tt.device_tensors(out))
    except BaseException:  # a held worker would hold the mesh's close forever
        worker.resume()
        raise
    return out


async def test_a_worker_killed_mid_collective_fails_the_others_typed_naming_it() -> None:
    async with tt.open_mesh_device(tt.MeshSpec((1, 4), chip=SMALL), workers="process",
                                   inline_seconds=-1) as mesh:
        out = await _waiting(mesh, held=3)
        killed = mesh.worker_pids[1]
        assert killed is not None
        start = anyio.current_time()
        os.kill(killed, signal.SIGKILL)  # chip 1 dies in the collective
        _workers(mesh)[3].resume()
        got = await _outcomes(out)
        assert anyio.current_time() - start < BOUND
        assert isinstance(got[1], tt.DeviceLostError) and got[1].chip == (0, 1)
        for k in (0, 2, 3):
            assert isinstance(got[k], tt.CollectiveError), got[k]
            # Told by the host (chip 1's command failed: DeviceLostError), or seen by a worker
            # whose message to chip 1's worker found it gone: either way naming chip 1.
            assert got[k].chip == (0, 1), str(got[k])
            assert "DeviceLostError" in str(got[k]) or "(0, 1)'s worker process cannot be reached" in str(got[k])
        # The other chips go on.
        for chip in (mesh.chips[0], mesh.chips[2]):
            x = np.arange(128, dtype=np.int32).reshape(4, 32)
            with anyio.fail_after(BOUND):
                assert np.array_equal(await tt.to_host(tt.to_device(x, chip)), x)


@pytest.mark.parametrize("how", ["error", "cancelled"])
async def test_closing_the_mesh_with_collectives_waiting_in_the_workers(how: str) -> None:
    """Chips 1 and 2 wait in the collective in their workers for chip 0, whose record is held
    on the host until after the block ended (a timer resumes it once the mesh aborted the
    submit, as the mesh closes): every chip fails typed, and the close ends."""
    outs: list[tt.MeshTensor] = []
    start = anyio.current_time()
    timers: list[threading.Timer] = []
    cancel = anyio.CancelScope()  # its deadline is set once the chips wait (their boot varies)

    async def body() -> None:
        async with tt.open_mesh_device(tt.MeshSpec((1, 3), chip=SMALL), workers="process",
                                       inline_seconds=-1) as mesh:
            outs.append(await _waiting(mesh, held=0))
            timers.append(threading.Timer(0.5 if how == "error" else 1.5, _workers(mesh)[0].resume))
            timers[0].start()
            if how == "error":
                raise KeyError("the block failed")
            cancel.deadline = anyio.current_time() + 1.0
            await anyio.sleep(60)

    with anyio.fail_after(BOUND):
        if how == "error":
            with pytest.raises(KeyError):
                await body()
        else:
            with cancel:
                await body()
    timers[0].join()
    assert anyio.current_time() - start < BOUND
    for shard in tt.device_tensors(outs[0]):
        assert shard.done()
        with pytest.raises((tt.DeviceClosedError, tt.CollectiveError)):
            await shard


async def test_an_abort_reaches_a_record_that_comes_later() -> None:
    """A chip fails before its record runs while another chip's record is still queued on the
    host: the queued one travels after the abort and fails at once (the failure travels with
    it, or is waiting in its worker), never waiting for the timeout."""
    async with tt.open_mesh_device(tt.MeshSpec((1, 3), chip=SMALL), workers="process",
                                   inline_seconds=-1, collective_timeout=60.0) as mesh:
        _workers(mesh)[2].pause()
        try:
            start = anyio.current_time()
            shards = [tt.to_device(np.full((4, 32), 2**30 + 5 if k == 1 else k, np.int32), chip)
                      for k, chip in enumerate(mesh.chips)]
            (out,) = tt.submit(mesh, _overflowing(), 0, [tt.from_shards(shards, mesh)])
            first = tt.device_tensors(out)[0]
            with anyio.fail_after(BOUND), pytest.raises(tt.CollectiveError):
                await first
        finally:  # a held worker would hold the mesh's close forever
            _workers(mesh)[2].resume()
        got = await _outcomes(out)
        assert isinstance(got[2], tt.CollectiveError) and got[2].chip == (0, 1)
        assert anyio.current_time() - start < BOUND


# -- existing modules, again on worker processes ---------------------------------------------------


_NOT_BORROWED = {
    # Waits 0.1 s for every chip's CQ0 to be busy; a worker process's first record waits for
    # the child to start. test_closing_the_mesh_with_collectives_waiting_in_the_workers
    # cancels a block with collectives waiting in the workers.
    "test_cancelling_the_block_mid_collective_leaves_no_chip_hung": "times its chips' start",
}


for _module in ("test_collectives", "test_mesh_examples", "test_mesh_traces"):
    borrow(_module, globals(), _NOT_BORROWED)
