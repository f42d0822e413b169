"""The BLAS thread policy: `open_device(blas_threads=...)` limits BLAS while the device is open
and restores the previous setting after, process-wide and reference-counted."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import numpy as np
import pytest
import threadpoolctl
from threadpoolctl import threadpool_info, threadpool_limits

import ttflow as tt

SMALL = tt.DeviceSpec.small()
START = 3  # a setting that is neither the runtime's default nor the library's on most machines


def blas_threads() -> list[int]:
    """The thread count of every BLAS library threadpoolctl finds, as threadpool_info says."""
    return [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]


pytestmark = pytest.mark.skipif(not blas_threads(), reason="threadpoolctl finds no BLAS library")


def let_go() -> None:
    """threadpoolctl 3.8+ lets the thread that last set OpenBLAS keep it: give it up, as
    ttflow does, so that devices on other threads can set it."""
    clear = getattr(getattr(threadpoolctl, "OpenBLASController", None), "clear_controlling_thread", None)
    if clear is not None:
        clear()


@pytest.fixture(autouse=True)
def known_setting() -> Iterator[None]:
    """Every test starts from START threads, so "restored" cannot be confused with a default."""
    limiter = threadpool_limits(limits=START, user_api="blas")
    let_go()
    assert blas_threads() == [START] * len(blas_threads())
    yield
    limiter.restore_original_limits()
    let_go()


def all_at(n: int) -> list[int]:
    return [n] * len(blas_threads())


@pytest.mark.anyio
async def test_open_device_limits_blas_to_one_thread_and_restores_it() -> None:
    assert blas_threads() == all_at(START)
    async with tt.open_device(SMALL) as device:
        assert blas_threads() == all_at(1)
        # The queues run large commands in worker threads: the limit is process-wide.
        assert await anyio.to_thread.run_sync(blas_threads) == all_at(1)
        b = tt.ProgramBuilder("mm")
        x = b.input((64, 64))
        b.output(b.matmul(x, x))
        (y,) = tt.submit(device, tt.Binary([b.build()]), 0, [tt.to_device(np.eye(64, dtype=np.float32), device)])
        np.testing.assert_array_equal(await tt.to_host(y), np.eye(64, dtype=np.float32))
        assert blas_threads() == all_at(1)
    assert blas_threads() == all_at(START)


@pytest.mark.anyio
async def test_blas_threads_none_leaves_the_setting_alone_and_n_sets_n() -> None:
    async with tt.open_device(SMALL, blas_threads=None):
        assert blas_threads() == all_at(START)
    async with tt.open_device(SMALL, blas_threads=2):
        assert blas_threads() == all_at(2)
    assert blas_threads() == all_at(START)


@pytest.mark.anyio
async def test_nested_devices_use_the_smallest_limit_and_the_last_close_restores() -> None:
    async with tt.open_device(SMALL, blas_threads=2):
        assert blas_threads() == all_at(2)
        async with tt.open_device(SMALL):  # 1
            assert blas_threads() == all_at(1)
            async with tt.open_device(SMALL, blas_threads=None):
                assert blas_threads() == all_at(1)
            assert blas_threads() == all_at(1)
        assert blas_threads() == all_at(2)  # the inner device's limit is gone
    assert blas_threads() == all_at(START)


@pytest.mark.anyio
async def test_the_limit_is_restored_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        async with tt.open_device(SMALL):
            assert blas_threads() == all_at(1)
            raise RuntimeError("boom")
    assert blas_threads() == all_at(START)


def test_two_devices_on_different_threads_share_the_limit() -> None:
    # A opens (2), B opens (1) on another thread, A closes while B is open, then B closes.
    a_open, b_open, a_closed = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    async def wait(event: threading.Event) -> None:
        if not await anyio.to_thread.run_sync(event.wait, 30):
            raise TimeoutError("the other thread did not get there")

    async def device_a() -> None:
        async with tt.open_device(SMALL, blas_threads=2):
            seen["a open"] = blas_threads()
            a_open.set()
            await wait(b_open)
        a_closed.set()

    async def device_b() -> None:
        await wait(a_open)
        async with tt.open_device(SMALL, blas_threads=1):
            seen["b open"] = blas_threads()
            b_open.set()
            await wait(a_closed)
            seen["a closed, b open"] = blas_threads()

    def run(fn: object) -> None:
        try:
            anyio.run(fn)  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)
            a_open.set(), b_open.set(), a_closed.set()

    threads = [threading.Thread(target=run, args=(fn,)) for fn in (device_a, device_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert seen == {"a open": all_at(2), "b open": all_at(1), "a closed, b open": all_at(1)}
    assert blas_threads() == all_at(START)


@pytest.mark.anyio
@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (True, TypeError), (1.5, TypeError)])
async def test_a_bad_blas_threads_raises_before_anything_changes(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="blas_threads"):
        async with tt.open_device(SMALL, blas_threads=bad):  # type: ignore[arg-type]
            pass
    assert blas_threads() == all_at(START)
    async with tt.open_device(SMALL):  # nothing was left held
        assert blas_threads() == all_at(1)
    assert blas_threads() == all_at(START)
