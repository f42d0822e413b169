"""Program cache control and the memory log (issue 27, item 6), against counts and views
taken here.

What must hold: a device keeps one plan per program and counts each submit as a hit (the plan
was kept) or a miss (planned now), on both implementations of a submit (the C one counts its
own hits) and on every chip of a mesh (both SPMD paths); with `program_cache_enabled` False
every submit is a miss and nothing is kept; `tt.clear_program_cache` makes the next submit of
each program a miss; values never change (numpy's). The memory log writes, before and after
each program, what `device.memory_view` says then.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

import ttflow as tt
from ttflow._core import _dispatch

pytestmark = pytest.mark.anyio

SMALL = tt.DeviceSpec.small()
F32 = tt.DataType.FLOAT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
DRAM_TILE = tt.Layout(DRAM, tt.TensorLayout.TILE, F32)
SHAPE = (32, 64)


@pytest.fixture(params=["c", "checked"])
def submit_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both implementations of a submit: the C one (`_dispatch.submit`) and the checked path."""
    if request.param == "checked":
        monkeypatch.setattr(_dispatch, "submit", lambda *args: None)
    return str(request.param)


def _binary() -> tt.Binary:
    """Program 0: x + 1; program 1: x * 3."""
    add = tt.ProgramBuilder("add1")
    x = add.input(SHAPE, DRAM_TILE)
    add.output(add.add(x, 1.0), DRAM_TILE)
    mul = tt.ProgramBuilder("mul3")
    y = mul.input(SHAPE, DRAM_TILE)
    mul.output(mul.mul(y, 3.0), DRAM_TILE)
    return tt.Binary([add.build(), mul.build()])


def _values(seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(-40, 40, SHAPE).astype(np.float32)


def _counts(device: tt.Device) -> tuple[int, int]:
    stats = device.stats
    return stats.program_cache_hits, stats.program_cache_misses


async def _chain(device: Any, binary: tt.Binary, order: list[int], x: np.ndarray[Any, Any],
                 **kwargs: Any) -> np.ndarray[Any, Any]:
    """Runs the programs in `order` one after the other on x; the host result."""
    t = tt.to_device(x, device, DRAM_TILE, **kwargs)
    for index in order:
        (t,) = tt.submit(device, binary, index, [t])
    composer = {"composer": tt.concat(0)} if "mapper" in kwargs else {}
    return await tt.to_host(t, **composer)


def _reference(order: list[int], x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    for index in order:
        x = x + 1 if index == 0 else x * 3
    return x


ORDER = [0, 0, 0, 1, 1, 0, 1, 0, 0, 0]  # a run of one program (the last plan), and switches


async def test_hits_and_misses_are_counted_on_both_paths(submit_path: str) -> None:
    binary = _binary()
    x = _values(0)
    async with tt.open_device(SMALL) as device:
        assert device.program_cache_enabled is True and _counts(device) == (0, 0)
        out = await _chain(device, binary, ORDER, x)
        np.testing.assert_array_equal(out, _reference(ORDER, x))
        assert _counts(device) == (len(ORDER) - 2, 2)  # one miss per program, the rest hits
        out = await _chain(device, binary, ORDER, x)
        assert _counts(device) == (2 * len(ORDER) - 2, 2)
        np.testing.assert_array_equal(out, _reference(ORDER, x))


async def test_with_the_cache_off_every_submit_plans_and_nothing_is_kept(submit_path: str) -> None:
    binary = _binary()
    x = _values(1)
    async with tt.open_device(SMALL) as device:
        await _chain(device, binary, [0, 1], x)
        scheduler = device._scheduler
        assert len(scheduler._plans) == 2
        device.program_cache_enabled = False
        assert device.program_cache_enabled is False
        assert len(scheduler._plans) == 0 and scheduler._last_plan is None  # dropped
        hits, misses = _counts(device)
        out = await _chain(device, binary, ORDER, x)
        np.testing.assert_array_equal(out, _reference(ORDER, x))
        assert _counts(device) == (hits, misses + len(ORDER))
        assert len(scheduler._plans) == 0 and scheduler._last_plan is None
        device.program_cache_enabled = True
        out = await _chain(device, binary, ORDER, x)
        np.testing.assert_array_equal(out, _reference(ORDER, x))
        assert _counts(device) == (hits + len(ORDER) - 2, misses + len(ORDER) + 2)
        with pytest.raises(TypeError, match="a bool"):
            device.program_cache_enabled = 0  # type: ignore[assignment]
        assert device.program_cache_enabled is True


async def test_clearing_makes_the_next_submit_of_each_program_a_miss(submit_path: str) -> None:
    binary = _binary()
    x = _values(2)
    async with tt.open_device(SMALL) as device:
        await _chain(device, binary, [0, 1], x)
        assert _counts(device) == (0, 2)
        tt.clear_program_cache(device)
        assert len(device._scheduler._plans) == 0 and device.program_cache_enabled
        out = await _chain(device, binary, ORDER, x)
        np.testing.assert_array_equal(out, _reference(ORDER, x))
        assert _counts(device) == (len(ORDER) - 2, 4)
        with pytest.raises(TypeError, match="tt.Device or a tt.MeshDevice"):
            tt.clear_program_cache("device")  # type: ignore[arg-type]


async def test_a_mesh_counts_on_every_chip(spmd_path: str) -> None:
    binary = _binary()
    x = np.random.default_rng(3).integers(-40, 40, (4 * SHAPE[0], SHAPE[1])).astype(np.float32)
    async with tt.open_mesh_device(tt.MeshSpec((2, 2), chip=SMALL)) as mesh:
        shard = tt.shard(0)
        out = await _chain(mesh, binary, ORDER, x, mapper=shard)
        np.testing.assert_array_equal(out, _reference(ORDER, x))
        assert [_counts(chip) for chip in mesh.chips] == [(len(ORDER) - 2, 2)] * 4
        assert mesh.stats.total.program_cache_misses == 8
        tt.clear_program_cache(mesh)
        await _chain(mesh, binary, [0, 0], x, mapper=shard)
        assert [_counts(chip) for chip in mesh.chips] == [(len(ORDER) - 1, 3)] * 4
        mesh.program_cache_enabled = False
        assert not mesh.program_cache_enabled and not any(c.program_cache_enabled for c in mesh.chips)
        out = await _chain(mesh, binary, ORDER, x, mapper=shard)
        np.testing.assert_array_equal(out, _reference(ORDER, x))
        assert [_counts(chip) for chip in mesh.chips] == [(len(ORDER) - 1, 3 + len(ORDER))] * 4
        # One chip's cache turned back on: that chip hits again, the others still miss.
        mesh.program_cache_enabled = True
        mesh.chips[1].program_cache_enabled = False
        await _chain(mesh, binary, [0, 0, 0], x, mapper=shard)
        counts = [_counts(chip) for chip in mesh.chips]
        assert counts[1] == (len(ORDER) - 1, 6 + len(ORDER))
        assert counts[0] == counts[2] == counts[3] == (len(ORDER) + 1, 4 + len(ORDER))


async def test_a_chip_turned_off_alone_is_not_served_by_the_mesh_s_record(spmd_path: str) -> None:
    """The SPMD C path's decided record (the last program's plan per chip) is a cache too: a
    chip whose cache is cleared or turned off afterwards must not be served from it."""
    binary = _binary()
    x = np.random.default_rng(4).integers(-40, 40, (2 * SHAPE[0], SHAPE[1])).astype(np.float32)
    async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL)) as mesh:
        await _chain(mesh, binary, [0, 0], x, mapper=tt.shard(0))
        assert [_counts(chip) for chip in mesh.chips] == [(1, 1)] * 2
        tt.clear_program_cache(mesh.chips[0])
        await _chain(mesh, binary, [0], x, mapper=tt.shard(0))
        assert [_counts(chip) for chip in mesh.chips] == [(1, 2), (2, 1)]
        mesh.chips[1].program_cache_enabled = False
        out = await _chain(mesh, binary, [0, 0], x, mapper=tt.shard(0))
        np.testing.assert_array_equal(out, x + 2)
        assert [_counts(chip) for chip in mesh.chips] == [(3, 2), (2, 3)]


# -- the memory log ------------------------------------------------------------------------


def _records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ttflow.memory"]


def _summary(device: tt.Device) -> str:
    views = [(space, device.memory_view(space)) for space in (L1, DRAM)]
    return "; ".join(f"{space.name} used {view.used} free {view.free}" for space, view in views)


async def test_the_summary_log_says_what_the_memory_view_says(caplog: pytest.LogCaptureFixture) -> None:
    binary = _binary()
    x = _values(5)
    caplog.set_level(logging.INFO, logger="ttflow.memory")
    async with tt.open_device(SMALL) as device:
        t = tt.to_device(x, device, DRAM_TILE)
        await t
        fast = device._scheduler.counters["fast_path_programs"]
        tt.set_memory_log(device, "summary")
        before = _summary(device)  # idle: what the program's start sees
        (y,) = tt.submit(device, binary, 0, [t])
        np.testing.assert_array_equal(await tt.to_host(y), x + 1)
        await device.synchronize()
        after = _summary(device)  # its output held, its input retained: what its end saw
        assert before != after
        assert _records(caplog) == [f"before program 'add1' on {device!r}: {before}",
                                    f"after program 'add1' on {device!r}: {after}"]
        # The general path ran it (the C fast path runs no Python between programs).
        assert device._scheduler.counters["fast_path_programs"] == fast
        tt.set_memory_log(device, None)
        caplog.clear()
        (z,) = tt.submit(device, binary, 0, [y])
        np.testing.assert_array_equal(await tt.to_host(z), x + 2)
        assert _records(caplog) == [] and device._scheduler.counters["fast_path_programs"] == fast + 1


async def test_the_detail_log_is_the_memory_view_tables(caplog: pytest.LogCaptureFixture) -> None:
    binary = _binary()
    x = _values(6)
    caplog.set_level(logging.INFO, logger="ttflow.memory")
    async with tt.open_device(SMALL) as device:
        t = tt.to_device(x, device, DRAM_TILE)
        t.name = "x"
        await t
        tt.set_memory_log(device, "detail")

        def tables() -> str:
            return "\n".join(str(device.memory_view(space)) for space in (L1, DRAM))

        before = tables()
        t.retain = False  # freed after the program: the "after" view still holds it
        (y,) = tt.submit(device, binary, 1, [t])
        y.name = "y"
        np.testing.assert_array_equal(await tt.to_host(y), 3 * x)
        await device.synchronize()
        logged = _records(caplog)
        assert logged[0] == f"before program 'mul3' on {device!r}:\n{before}"
        # After: its output, and its unretained input not yet freed; then the input goes.
        tt.set_memory_log(device, "off")
        x_line = next(line for line in before.splitlines() if "x: (32, 64)" in line)
        assert logged[1].startswith(f"after program 'mul3' on {device!r}:\n")
        assert x_line in logged[1].splitlines() and any("y: (32, 64)" in line for line in logged[1].splitlines())
        assert x_line not in tables().splitlines() and "y: (32, 64)" in tables()
        assert len(logged) == 2


async def test_every_chip_of_a_mesh_logs(caplog: pytest.LogCaptureFixture) -> None:
    binary = _binary()
    x = np.ones((2 * SHAPE[0], SHAPE[1]), np.float32)
    caplog.set_level(logging.INFO, logger="ttflow.memory")
    async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL)) as mesh:
        tt.set_memory_log(mesh, "summary")
        await _chain(mesh, binary, [0], x, mapper=tt.shard(0))
        logged = _records(caplog)
        for coord in mesh.coords:
            mine = [line for line in logged if f"at chip {coord}:" in line]
            assert [line.split()[0] for line in mine] == ["before", "after"]
        assert len(logged) == 4
        tt.set_memory_log(mesh, None)


async def test_a_bad_level_or_device_is_refused() -> None:
    async with tt.open_device(SMALL) as device:
        with pytest.raises(ValueError, match="'summary'"):
            tt.set_memory_log(device, "verbose")
        with pytest.raises(TypeError, match="tt.Device or a tt.MeshDevice"):
            tt.set_memory_log(None, "summary")  # type: ignore[arg-type]
        tt.set_memory_log(device, "detail")
        tt.set_memory_log(device, "summary")  # replaces: one log, not two
        assert len(device._scheduler.starting) == 1
        tt.set_memory_log(device, None)
        assert device._scheduler.starting == [] and device._scheduler.listeners == []
    with pytest.raises(tt.DeviceClosedError):
        tt.set_memory_log(device, "summary")


async def test_the_op_log_has_a_line_after_every_op(caplog: pytest.LogCaptureFixture, anyio_backend: str) -> None:
    """Level "op": tt-mlir's per-op memory log. After each op of the program (as the builder made
    them, in order, with their locations): where its result lives and each space's totals, and
    the program's summary lines around them; the values are numpy's."""
    b = tt.ProgramBuilder("mlp")
    xin, win = b.input((32, 64), DRAM_TILE), b.input((64, 32), DRAM_TILE)
    h = b.matmul(xin, win, loc="mlp.py:10")
    b.output(b.add(b.relu(h, loc="mlp.py:11"), 1.0), DRAM_TILE)
    program = b.build()
    binary = tt.Binary([program])
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((64, 32)).astype(np.float32)
    caplog.set_level(logging.INFO, logger="ttflow.memory")
    async with tt.open_device(SMALL) as device:
        tx, tw = tt.to_device(x, device, DRAM_TILE), tt.to_device(w, device, DRAM_TILE)
        await tx
        await tw
        tt.set_memory_log(device, "op")
        with pytest.raises(tt.DebugHookError, match="already has hooks set"):
            with tt.debug_hooks(device, post_op=lambda ctx: None):
                pass
        (y,) = tt.submit(device, binary, 0, [tx, tw])
        np.testing.assert_allclose(await tt.to_host(y), np.maximum(x @ w, 0) + 1, rtol=1e-5, atol=1e-5)
        await device.synchronize()
        logged = _records(caplog)
        ops = [line for line in logged if line.startswith("after op ")]
        assert [line.split()[3] for line in ops] == [step.op for step in program.steps]
        assert [line.split()[2] for line in ops] == [str(i) for i in range(len(program.steps))]
        assert "matmul at mlp.py:10 " in ops[0] and "relu at mlp.py:11 " in ops[1]
        for line in ops:
            assert "bytes)" in line and "L1 used" in line and "DRAM used" in line
        assert logged[0].startswith("before program 'mlp'") and logged[-1].startswith("after program 'mlp'")
        tt.set_memory_log(device, "off")  # hooks gone with it: a block may open again
        with tt.debug_hooks(device, post_op=lambda ctx: None):
            pass
