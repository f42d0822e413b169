"""Faults and observability of worker processes (issue 28, parts 3 and 4).

A worker that is alive but silent (SIGSTOP) is declared lost by its heartbeat within
`worker_timeout`: pending and later awaits fail with a typed `DeviceLostError` that says why, the
child is killed and reaped, the device closes. A long but healthy record is not declared lost.
After every test, as in test_process_workers: no child process and no shared-memory file of
ours is left.
"""

from __future__ import annotations

import glob
import os
import signal
import time
from collections.abc import Iterator

import anyio
import numpy as np
import pytest

import ttflow as tt
from ttflow._memory import SHARED_DIR, SHARED_PREFIX

pytestmark = pytest.mark.anyio

F32 = tt.DataType.FLOAT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE, RM = tt.TensorLayout.TILE, tt.TensorLayout.ROW_MAJOR
SMALL = tt.DeviceSpec.small()


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


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    before = set(_children())
    yield
    assert set(_children()) - before == set(), "a worker process outlived its device"
    assert _segments() == [], "a shared bank memory outlived its device"


def values(shape: tuple[int, ...], seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _matmul_relu() -> tt.Binary:
    b = tt.ProgramBuilder("matmul_relu")
    x = b.input((64, 40), tt.Layout(DRAM, TILE, F32))
    w = b.input((40, 24), tt.Layout(L1, TILE, F32))
    b.output(b.relu(b.matmul(x, w)))
    return tt.Binary([b.build()])


async def _until(condition: object, seconds: float) -> None:
    with anyio.fail_after(seconds):
        while not condition():  # type: ignore[operator]
            await anyio.sleep(0.01)


# -- a silent worker -----------------------------------------------------------------------------


TIMEOUT = 1.0  # the tests' worker_timeout
LOST_WITHIN = TIMEOUT + 10.0  # a silent worker's awaits must fail by then (loaded 2-core machine)


@pytest.mark.parametrize("where", ["device", "mesh"])
async def test_a_stopped_worker_is_declared_lost_within_its_timeout(where: str) -> None:
    binary = _matmul_relu()
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
            assert time.monotonic() - stopped >= TIMEOUT * 0.9  # declared by the deadline, not before
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


CHAIN = 48  # 1024x1024 matmuls in one program: one record of seconds in the worker


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

