"""The staging area in shared memory through which a worker process's bulk bytes cross
(`ttflow/_staging.py`): what goes into a slot comes out of the worker's mapping bit for bit,
slots are reused once released, a full area (or a full /dev/shm) sends arrays pickled instead,
and nothing is left in /dev/shm."""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttflow import _staging
from ttflow._memory import map_shared
from ttflow._staging import STAGE_MIN_BYTES, StagingArea, staged_view

DTYPES = [np.float32, np.int32, np.uint32, ml_dtypes.bfloat16, np.uint8]


@pytest.fixture
def area() -> Any:
    staging = StagingArea(4 * 2**20)
    yield staging
    staging.close()
    assert not os.path.exists(staging.path)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_staged_array_reads_back_bit_for_bit_in_the_workers_mapping(data: st.DataObject) -> None:
    staging = StagingArea(4 * 2**20)
    try:
        worker = map_shared(staging.path, staging.nbytes)  # as the worker maps it
        dtype = np.dtype(data.draw(st.sampled_from(DTYPES)))
        rows = data.draw(st.integers(1, 300))
        least = -(-STAGE_MIN_BYTES // (rows * dtype.itemsize))  # staged, not pickled
        cols = data.draw(st.integers(least, max(least, 2**20 // (rows * dtype.itemsize))))
        seed = data.draw(st.integers(0, 2**32 - 1))
        raw = np.random.default_rng(seed).integers(0, 256, rows * cols * dtype.itemsize, np.uint8)
        array = raw.view(dtype).reshape(rows, cols)
        ref = staging.put(array)
        assert ref is not None
        seen = staged_view(worker, ref)
        assert seen.dtype == array.dtype and seen.shape == array.shape
        assert seen.tobytes() == array.tobytes()
        # A read's result: the worker writes the slot the host reserved, the host copies it out.
        back = staging.reserve(dtype, (rows, cols))
        assert back is not None and back.offset != ref.offset
        np.copyto(staged_view(worker, back), array[::-1])
        assert staging.take(back).tobytes() == array[::-1].tobytes()
        staging.release(ref)
        assert staging.used_bytes() == 0
        del seen
        worker.close()
    finally:
        staging.close()


def test_small_arrays_cross_pickled(area: StagingArea) -> None:
    assert area.put(np.zeros(STAGE_MIN_BYTES // 4 - 1, np.float32)) is None
    assert area.reserve(np.dtype(np.float32), (8, 8)) is None
    assert area.staged == 0 and area.spilled == 0  # small is not a spill


def test_a_full_area_spills_to_pickling_and_takes_slots_again_once_released(area: StagingArea) -> None:
    block = np.ones((2**20 // 4,), np.float32)  # 1 MiB
    refs = [area.put(block) for _ in range(4)]
    assert all(r is not None for r in refs)
    assert area.put(block) is None and area.spilled == 1  # full: the array crosses pickled
    area.release(refs[1])  # type: ignore[arg-type]
    again = area.put(block * 2)
    assert again is not None and again.offset == refs[1].offset  # type: ignore[union-attr]
    for ref in (refs[0], again, refs[2], refs[3]):
        area.release(ref)  # type: ignore[arg-type]
    assert area.used_bytes() == 0


def test_a_full_dev_shm_spills_to_pickling(area: StagingArea, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_staging.os, "posix_fallocate", no_room)
    assert area.put(np.ones(2**16, np.float32)) is None and area.spilled == 1
    assert area.used_bytes() == 0  # the slot was given back
