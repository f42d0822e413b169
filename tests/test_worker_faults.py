"""Faults and observability of worker processes (issue 28, parts 3 and 4).

A worker that is alive but silent (SIGSTOP) is declared lost by its heartbeat within
`worker_timeout`: pending and later awaits fail with a typed `DeviceLostError` that says why, the
child is killed and reaped, the device closes. A long but healthy record is not declared lost.
After every test, as in test_process_workers: no child process and no shared-memory file of
ours is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import anyio
import numpy as np
import pytest
from test_process_workers import _children, _mlp_binary, _segments, nothing_left_behind  # noqa: F401 (autouse)

import ttflow as tt

pytestmark = pytest.mark.anyio

F32 = tt.DataType.FLOAT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE, RM = tt.TensorLayout.TILE, tt.TensorLayout.ROW_MAJOR
SMALL = tt.DeviceSpec.small()




def values(shape: tuple[int, ...], seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


async def _until(condition: object, seconds: float) -> None:
    with anyio.fail_after(seconds):
        while not condition():  # type: ignore[operator]
            await anyio.sleep(0.01)


# -- a silent worker -----------------------------------------------------------------------------


TIMEOUT = 1.0  # the tests' worker_timeout
LOST_WITHIN = TIMEOUT + 10.0  # a silent worker's awaits must fail by then (loaded 2-core machine)


@pytest.mark.parametrize("where", ["device", "mesh"])
async def test_a_stopped_worker_is_declared_lost_within_its_timeout(where: str) -> None:
    binary = _mlp_binary()
    x, w = values((64, 40)), values((40, 24), 1)
    expected = np.maximum(x @ w, 0)
    opened = (tt.open_device(SMALL, workers="process", inline_seconds=-1, worker_timeout=TIMEOUT)
              if where == "device" else
              tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL), workers="process", inline_seconds=-1,
                                  worker_timeout=TIMEOUT))
    pid = None
    async with opened as opened_device:
        if where == "device":
            device, other = opened_device, None
        else:
            other, device = opened_device.chips
        process = device._process
        assert process is not None and process.timeout == TIMEOUT
        pid = device.worker_pid
        assert pid is not None
        try:
            xt = tt.to_device(x, device, tt.Layout(DRAM, TILE))
            wt = tt.to_device(w, device)
            np.testing.assert_allclose(await tt.to_host(tt.submit(device, binary, 0, [xt, wt])[0]),
                                       expected, rtol=1e-5, atol=1e-5)
            await _until(lambda: process.beats > 0, 60)
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            pending = [tt.submit(device, binary, 0, [xt, wt])[0] for _ in range(3)]
            read = tt.to_host(xt)
            with anyio.fail_after(LOST_WITHIN):
                for y in pending:
                    with pytest.raises(tt.DeviceLostError) as lost:
                        await y
                    assert lost.value.chip == (None if where == "device" else (0, 1))
                    assert "silent" in str(lost.value) and "worker_timeout" in str(lost.value)
                with pytest.raises(tt.DeviceLostError):
                    await read
                with pytest.raises(tt.DeviceLostError):  # later work fails too
                    await tt.to_host(tt.submit(device, binary, 0, [xt, wt])[0])
            assert time.monotonic() - stopped >= TIMEOUT * 0.8  # by the deadline, not before (less a beat)
            if other is not None:  # the other chip goes on
                x0, w0 = tt.to_device(x, other, tt.Layout(DRAM, TILE)), tt.to_device(w, other)
                with anyio.fail_after(60):
                    got = await tt.to_host(tt.submit(other, binary, 0, [x0, w0])[0])
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        finally:
            if process.lost is None:  # the heartbeat did not fire (a planted bug): let close go on
                os.kill(pid, signal.SIGKILL)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped


async def test_a_worker_stopped_while_idle_does_not_hang_close() -> None:
    with anyio.fail_after(60):
        async with tt.open_device(SMALL, workers="process", inline_seconds=-1, worker_timeout=TIMEOUT) as device:
            t = tt.to_device(values((64, 64)), device)
            await t
            process = device._process
            assert process is not None
            await _until(lambda: process.beats > 0, 60)
            os.kill(process.pid or 0, signal.SIGSTOP)
            try:
                await _until(lambda: device._cq0._aborted, LOST_WITHIN)  # lost though nothing waited
            finally:
                if process.lost is None:
                    os.kill(process.pid or 0, signal.SIGKILL)
            with pytest.raises(tt.DeviceLostError, match="silent"):
                await tt.to_host(t)



@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSEGV])
async def test_a_dead_worker_is_named_by_its_signal(how: signal.Signals) -> None:
    binary = _mlp_binary()
    async with tt.open_device(SMALL, workers="process", inline_seconds=-1) as device:
        xt = tt.to_device(values((64, 40)), device, tt.Layout(DRAM, TILE))
        wt = tt.to_device(values((40, 24), 1), device)
        await tt.to_host(tt.submit(device, binary, 0, [xt, wt])[0])
        pid = device.worker_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the next records wait in the worker, their replies awaited
        pending = [tt.submit(device, binary, 0, [xt, wt])[0] for _ in range(2)]
        await _until(lambda: device._cq0._worker.busy, 30)
        os.kill(pid, how)
        with contextlib.suppress(ProcessLookupError):  # (SIGKILL needs none: reaped already)
            os.kill(pid, signal.SIGCONT)  # a pending SIGSEGV is delivered
        with anyio.fail_after(LOST_WITHIN):
            for y in pending:
                with pytest.raises(tt.DeviceLostError, match=f"killed by signal {int(how)} \\({how.name}\\)"):
                    await y



class _Exited:
    """A child's Popen stand-in whose exit status is there: killed by SIGBUS."""

    pid = 12345

    def wait(self, timeout: float | None = None) -> int:
        return -int(signal.SIGBUS)


def test_a_connection_that_ends_reports_the_exit_status_it_finds() -> None:
    """Whichever of the watcher and a queue's thread (its connection ended) tells first, the
    reason is the exit status, here checked on the queue's path alone."""
    from ttflow._workers.process import WorkerProcess

    process = WorkerProcess([], 0, timeout=None)
    process._popen = _Exited()  # type: ignore[assignment]
    process.connection_closed()
    assert process.lost == "killed by signal 7 (SIGBUS)"
    assert "killed by signal 7 (SIGBUS)" in str(process.error())


CHAIN = 96  # 1024x1024 matmuls in one program: one record of seconds in the worker (48 took 0.98 s here)


async def test_a_long_healthy_record_is_not_declared_lost() -> None:
    timeout = 0.25
    b = tt.ProgramBuilder("chain")
    v = b.input((1024, 1024), tt.Layout(DRAM, TILE, F32))
    m = b.input((1024, 1024), tt.Layout(DRAM, TILE, F32))
    for _ in range(CHAIN):
        v = b.matmul(v, m)
    b.output(v, tt.Layout(DRAM, TILE, F32))
    binary = tt.Binary([b.build()])
    x, w = values((1024, 1024), 0), values((1024, 1024), 1, 1 / 32)
    expected = x
    for _ in range(CHAIN):
        expected = expected @ w
    async with tt.open_device(workers="process", inline_seconds=-1, worker_timeout=timeout) as device:
        process = device._process
        assert process is not None
        xt = tt.to_device(x, device, tt.Layout(DRAM, TILE))
        wt = tt.to_device(w, device, tt.Layout(DRAM, TILE))
        await xt
        await wt
        await _until(lambda: process.beats > 0, 60)
        beats = process.beats
        started = time.monotonic()
        with anyio.fail_after(300):
            got = await tt.to_host(tt.submit(device, binary, 0, [xt, wt])[0])
        took = time.monotonic() - started
        assert took > 4 * timeout, f"the record took {took:.2f} s: too short to show anything"
        assert process.lost is None
        assert process.beats - beats >= 2  # beats went on while the record ran
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3 * scale)


async def test_worker_timeout_is_checked() -> None:
    for bad in (0, -1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="worker_timeout"):
            async with tt.open_device(SMALL, workers="process", worker_timeout=bad):  # type: ignore[arg-type]
                pass
    async with tt.open_device(SMALL, workers="process", worker_timeout=None) as device:
        assert device._process is not None and device._process.timeout is None
        t = tt.to_device(values((8, 8)), device)
        np.testing.assert_array_equal(await tt.to_host(t), values((8, 8)))


# -- a full shared-memory segment ----------------------------------------------------------------


def _blocks(path: str | None) -> int:
    assert path is not None
    return os.stat(path).st_blocks * 512


async def test_an_allocation_backs_its_pages_before_any_byte_lands() -> None:
    async with tt.open_device(SMALL, workers="process") as device:
        state = device._spaces[DRAM]
        depth = 1 << 20  # per bank
        before = _blocks(state.memory.shared_path)
        address = state.reserve(depth)
        try:
            # The file's pages are allocated now, before any record writes there.
            assert _blocks(state.memory.shared_path) - before >= depth * state.num_banks
        finally:
            state.free(tt.BufferInfo(DRAM, address, depth, depth, state.num_banks) if hasattr(tt, "BufferInfo")
                       else _Buffer(address))
        l1 = device._spaces[L1]
        before = _blocks(l1.memory.shared_path)
        assert l1.allocator.claim(0, 4096)  # a placement at an address (circular buffers) too
        try:
            assert _blocks(l1.memory.shared_path) - before >= 4096 * l1.num_banks
        finally:
            l1.allocator.free(0)
    async with tt.open_device(SMALL) as device:  # thread workers: anonymous memory, nothing backed
        assert device._spaces[DRAM].memory.committed_bytes() is None


class _Buffer:
    def __init__(self, address: int) -> None:
        self.address = address


def _no_room(*args: object) -> None:
    raise OSError(28, os.strerror(28))  # ENOSPC, as a full tmpfs answers


async def test_a_full_shared_memory_gives_a_typed_error_where_it_allocates(monkeypatch: pytest.MonkeyPatch) -> None:
    import ttflow._memory.banks as memory

    b = tt.ProgramBuilder("double")
    b.output(b.mul(b.input((512, 512), tt.Layout(DRAM, TILE, F32)), 2.0), tt.Layout(DRAM, TILE, F32))
    double = tt.Binary([b.build()])
    big = values((1024, 1024))  # 4 MiB: 1 MiB per bank of the small chip's DRAM
    async with tt.open_device(SMALL, workers="process", inline_seconds=-1) as device:
        x = tt.to_device(values((512, 512), 1), device, tt.Layout(DRAM, TILE))
        await x
        used = device.memory_used(DRAM)
        monkeypatch.setattr(memory, "_fallocate", _no_room)
        with anyio.fail_after(60), pytest.raises(tt.OutOfMemoryError, match="/dev/shm is full") as full:
            await tt.to_device(big, device)  # by the write that allocates its home
        assert full.value.space is DRAM and "No space left" in str(full.value)
        assert device.memory_used(DRAM) == used  # the allocation was undone
        with anyio.fail_after(60):  # a program whose output finds no room: typed, on its output
            (y,) = tt.submit(device, double, 0, [x])
            with pytest.raises(tt.OutOfMemoryError, match="/dev/shm"):
                await y
        monkeypatch.undo()
        with anyio.fail_after(60):  # the device is usable
            t = tt.to_device(big, device)
            np.testing.assert_array_equal(await tt.to_host(t), big)
            np.testing.assert_array_equal(await tt.to_host(tt.submit(device, double, 0, [x])[0]),
                                          values((512, 512), 1) * 2)
            np.testing.assert_array_equal(await tt.to_host(x), values((512, 512), 1))



_FULL_SCRIPT = """
import anyio, numpy as np, ttflow as tt

async def main():
    lay = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE)
    async with tt.open_device(tt.DeviceSpec.small(), workers="process", inline_seconds=-1) as device:
        small = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
        t = tt.to_device(small, device, lay)
        assert (await tt.to_host(t) == small).all()
        big = np.ones((2048, 1024), np.float32)  # 8 MiB, 2 MiB per bank: the tmpfs holds 4
        try:
            await tt.to_host(tt.to_device(big, device, lay))
        except tt.OutOfMemoryError as error:
            assert "/dev/shm is full" in str(error), error
            print("typed:", error)
        else:
            raise SystemExit("no error: the bytes landed on a full tmpfs")
        t2 = tt.to_device(small * 2, device, lay)  # usable after
        assert (await tt.to_host(t2) == small * 2).all() and (await tt.to_host(t) == small).all()
    print("closed cleanly")

anyio.run(main)
"""


def test_a_real_full_tmpfs_gives_a_typed_error_not_sigbus() -> None:
    """The host and its worker in a mount namespace whose /dev/shm is a 4 MiB tmpfs (a real
    limit, no root needed where user namespaces are allowed): without backing, the write lands
    on pages the tmpfs cannot give and SIGBUS kills the worker (or the host)."""
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) to make a small private tmpfs")
    probe = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=4m tmpfs /dev/shm"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private tmpfs here: {probe.stderr.decode().strip()}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(tt.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c",
         'mount -t tmpfs -o size=4m tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable, _FULL_SCRIPT],
        capture_output=True, timeout=240, env=env, cwd=root)
    output = done.stdout.decode() + done.stderr.decode()
    assert done.returncode == 0, f"exit {done.returncode}: {output[-3000:]}"
    assert "typed: out of DRAM memory" in output and "closed cleanly" in output, output[-3000:]



# -- cancellation mid-transfer -------------------------------------------------------------------


async def _cancelled_mid_transfer(workers: str, what: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Cancels a task awaiting a 4 MiB transfer while its record is in the worker: the queue's
    worker thread paused with the record handed to it (a worker process's device runs its
    writes and reads on that thread too, on the shared banks). Then lets it go on. Returns the
    tensor's value, a later read of it and DRAM in use."""
    old, new = values((1024, 1024), 1), values((1024, 1024), 2)
    lay = tt.Layout(DRAM, TILE)
    async with tt.open_device(SMALL, workers=workers, inline_seconds=-1) as device:
        t = tt.to_device(old, device, lay)
        await t
        queue = device._cq0 if what == "to_host" else device._cq1
        worker = queue._worker
        worker.pause()
        try:
            if what == "write":
                tt.write(t, new)
                awaited: object = tt.wait(t)
            elif what == "to_device":
                t = tt.to_device(new, device, lay)
                awaited = tt.wait(t)
            else:
                awaited = tt.to_host(t)

            async def in_worker() -> bool:  # the record was handed over, and has not run
                return bool(worker._outstanding)

            cancelled = []
            with anyio.move_on_after(30) as scope:  # a bound; cancelled as soon as the record is in
                async def cancel_when_in() -> None:
                    while not await in_worker():
                        await anyio.sleep(0.005)
                    await anyio.sleep(0.05)
                    cancelled.append(True)
                    scope.cancel()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_when_in)
                    await awaited  # type: ignore[misc]
                    raise AssertionError("the await finished with its record held in the worker")
            assert scope.cancelled_caught and cancelled, "the record never reached the worker"
            assert await in_worker()  # still held: the cancel came mid-transfer
        finally:
            worker.resume()
        with anyio.fail_after(60):
            value = await tt.to_host(t)
            again = await tt.to_host(tt.to_layout(t, tt.Layout(DRAM, RM)))
        assert device._process is None or device._process.lost is None
        return value, again, device.memory_used(DRAM)


@pytest.mark.parametrize("what", ["write", "to_device", "to_host"])
async def test_cancelling_an_await_mid_transfer_keeps_the_device_consistent(what: str) -> None:
    """As documented for thread workers (docs/concepts.md): cancelling a task that awaits a
    tensor cancels only the wait; the queued transfer belongs to the device and completes. So a
    cancelled write or to_device leaves the new value, a cancelled to_host the old one; the same
    with a worker process, and the device goes on, with the same memory in use."""
    expected = values((1024, 1024), 1 if what == "to_host" else 2)
    results = [await _cancelled_mid_transfer(workers, what) for workers in ("thread", "process")]
    for value, again, _ in results:
        np.testing.assert_array_equal(value, expected)
        np.testing.assert_array_equal(again, expected)
    assert results[0][2] == results[1][2]


# -- observability -------------------------------------------------------------------------------


def _chain_binary() -> tt.Binary:
    b = tt.ProgramBuilder("mm_gelu")
    x = b.input((128, 128), tt.Layout(DRAM, TILE, F32))
    b.output(b.gelu(b.matmul(x, x)), tt.Layout(DRAM, TILE, F32))
    return tt.Binary([b.build()])


def _slices(trace: dict, pid: int | None = None) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and (pid is None or e["pid"] == pid)]


def _process_names(trace: dict) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e["name"] == "process_name"}


def _inside(worker: dict, hosts: list[dict]) -> bool:
    """Whether a worker slice lies within one of the host slices of its command (same track and
    name; 1 ns of rounding)."""
    end = worker["ts"] + worker["dur"]
    return any(h["tid"] == worker["tid"] and h["name"] == worker["name"]
               and h["ts"] - 1e-3 <= worker["ts"] and end <= h["ts"] + h["dur"] + 1e-3 for h in hosts)


async def _observed(workers: str, programs: int = 4) -> tuple[dict, list[tt.DeviceStatistics], list, list[np.ndarray]]:
    """A 1x2 mesh's timeline, stats and memory views after writes, programs and reads."""
    binary = _chain_binary()
    async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL), workers=workers, inline_seconds=-1) as mesh:
        with tt.record_timeline(mesh) as recorder:
            x = tt.to_device(values((256, 128)), mesh, tt.Layout(DRAM, TILE), mapper=tt.shard(0))
            await x
            ys = []
            for _ in range(programs):
                (x,) = tt.submit(mesh, binary, 0, [x])
                ys.append(x)
                await x
            out = [await tt.to_host(y, tt.concat(0)) for y in ys]
        trace = recorder.to_json()
        trace["worker_pids"] = mesh.worker_pids
        trace["chips"] = [str(chip.chip) for chip in mesh.chips]
        return trace, [mesh.stats.total, *mesh.stats.chips], [mesh.memory_view(space) for space in (DRAM, L1)], out


async def test_the_timeline_has_a_worker_process_per_chip_with_its_records() -> None:
    programs = 4
    trace, stats, views, out = await _observed("process", programs)
    names = _process_names(trace)
    pids = trace["worker_pids"]
    assert len(set(pids)) == 2 and None not in pids
    for pid, chip in zip(pids, trace["chips"]):
        assert names[pid] == f"chip {chip} worker {pid}"
        worker = _slices(trace, pid)
        hosts = [e for e in _slices(trace) if e["pid"] not in pids and e["cat"] != "worker"]
        assert all(e["cat"] == "worker" for e in worker)
        ran = [e for e in worker if e["name"] == "mm_gelu"]
        assert len(ran) == programs  # every program ran in the chip's worker (inline_seconds=-1)
        assert all(e["tid"] == 0 for e in ran)
        # Writes and reads run in the host, on the shared banks: no worker slice of theirs.
        assert not any(e["name"] in ("write", "read") for e in worker)
        assert any(e["name"] in ("write", "read") for e in hosts)
        for e in worker:  # inside its command's host slice, on the same clock
            assert _inside(e, hosts), e
        threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                   if e.get("ph") == "M" and e["name"] == "thread_name" and e["pid"] == pid}
        assert 0 in threads and set(threads) <= {0, 1}
    # Host slices stay where they were: a process per chip (pids 1 and 2) and no other.
    host_pids = {e["pid"] for e in _slices(trace)} - set(pids)
    assert host_pids == {1, 2}
    # The same run with thread workers: no worker process, and the same stats, memory and values.
    threads, stats_t, views_t, out_t = await _observed("thread", programs)
    assert {e["pid"] for e in _slices(threads)} == {1, 2} and set(_process_names(threads)) == {1, 2}
    assert stats == stats_t
    assert views == views_t
    for a, b in zip(out, out_t):
        assert a.tobytes() == b.tobytes()


async def test_a_lone_device_timeline_names_its_worker() -> None:
    binary = _chain_binary()
    async with tt.open_device(SMALL, workers="process", inline_seconds=-1) as device:
        with tt.record_timeline(device) as recorder:
            x = tt.to_device(values((128, 128)), device, tt.Layout(DRAM, TILE))
            (y,) = tt.submit(device, binary, 0, [x])
            await tt.to_host(y)
        pid = device.worker_pid
        trace = recorder.to_json()
        assert _process_names(trace)[pid] == f"ttflow {SMALL.name} worker {pid}"
        hosts = _slices(trace, 1)
        worker = _slices(trace, pid)
        # every record travelled but the write and the read, which run in the host (its ops'
        # slices, inside the program's, came back with its result)
        assert sorted(e["name"] for e in worker) == sorted(e["name"] for e in hosts
                                                          if e["name"] not in ("write", "read") and e["cat"] != "op")
        assert sorted(e["name"] for e in hosts if e["cat"] == "op") == ["gelu", "matmul"]
        assert sorted(e["name"] for e in worker) == ["mm_gelu"]
        assert all(_inside(e, hosts) for e in worker)
        assert recorder.queue_summary()["CQ0"]["commands"] == len([e for e in hosts if e["tid"] == 0
                                                                    and e["cat"] != "op"])
        workers = [device._cq0._worker, device._cq1._worker]
    assert all(w.spans is None for w in workers)  # detached
