"""`tensor.retain` (tt-mlir's retain flag), against numpy and `tt.deallocate` written here.

What must hold: every tensor starts retained; a submit given an input whose retain is False
deallocates it once the program is queued to read it (every later use of the handle raises
DeallocatedTensorError saying why), the program and every command queued before it still read
its value, and its memory comes back once they have run, exactly as `tt.deallocate` after the
submit would give it back. A refused submit deallocates nothing. Donation consumes an input
anyway; a tensor passed twice is deallocated once; a capture refuses an unretained input
(TraceError, nothing queued). On a mesh, `retain` is every shard's. Every test runs on both
implementations of a submit: the C one (`_dispatch.submit`, which leaves an unretained input to
the checked path) and the checked one alone.
"""

from __future__ import annotations

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
SHAPE = (64, 32)


@pytest.fixture(params=["c", "checked"])
def submit_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both implementations of a submit: the C one (`_dispatch.submit`) and the checked path."""
    if request.param == "checked":
        monkeypatch.setattr(_dispatch, "submit", lambda *args: None)
    return str(request.param)


def _binary() -> tt.Binary:
    """Program 0: x * 2 + 1 (one input); program 1: x + y (two inputs); program 2: x * 2 + 1,
    donating x."""
    affine = tt.ProgramBuilder("affine")
    x = affine.input(SHAPE, DRAM_TILE)
    affine.output(affine.add(affine.mul(x, 2.0), 1.0), DRAM_TILE)
    pair = tt.ProgramBuilder("pair")
    a, b = pair.input(SHAPE, DRAM_TILE), pair.input(SHAPE, DRAM_TILE)
    pair.output(pair.add(a, b), DRAM_TILE)
    donating = tt.ProgramBuilder("donating")
    d = donating.input(SHAPE, DRAM_TILE)
    donating.output(donating.add(donating.mul(d, 2.0), 1.0), donates=d)
    return tt.Binary([affine.build(), pair.build(), donating.build()])


def _values(seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(-40, 40, SHAPE).astype(np.float32)


async def test_every_tensor_starts_retained_and_retain_is_a_bool(submit_path: str) -> None:
    binary = _binary()
    async with tt.open_device(SMALL) as device:
        made = [tt.to_device(_values(0), device, DRAM_TILE), tt.empty(SHAPE, F32, device, DRAM_TILE)]
        made.append(tt.to_layout(made[0], tt.Layout(L1, tt.TensorLayout.TILE)))
        made += tt.submit(device, binary, 0, [made[0]])
        assert [t.retain for t in made] == [True] * 4
        made[1].retain = np.bool_(False)  # numpy's bool is a bool
        assert made[1].retain is False
        made[1].retain = True
        for bad in (0, 1, "no", None):
            with pytest.raises(TypeError, match="retain is a bool"):
                made[1].retain = bad  # type: ignore[assignment]
        assert made[1].retain is True


async def test_an_unretained_input_is_read_then_deallocated(submit_path: str) -> None:
    binary = _binary()
    x = _values(1)
    async with tt.open_device(SMALL) as device:
        assert device.memory_used(DRAM) == 0
        t = tt.to_device(x, device, DRAM_TILE)
        t.retain = False
        (y,) = tt.submit(device, binary, 0, [t])
        assert t.is_deallocated and t.retain is False  # at once: the handle refuses new work
        for use in (lambda: tt.to_host(t), lambda: tt.wait(t)):
            with pytest.raises(tt.DeallocatedTensorError, match="retain is False"):
                await use()
        for call in (lambda: tt.submit(device, binary, 0, [t]), lambda: tt.write(t, x),
                     lambda: tt.to_layout(t, DRAM_TILE)):
            with pytest.raises(tt.DeallocatedTensorError, match="retain is False"):
                call()
        np.testing.assert_array_equal(await tt.to_host(y), x * 2 + 1)
        await device.synchronize()
        held = device.memory_used(DRAM)  # y alone: the same as deallocating t by hand (below)
        # The device stays usable, and the same submit on a retained input, then tt.deallocate,
        # leaves the very same bytes used.
        u = tt.to_device(x, device, DRAM_TILE)
        (z,) = tt.submit(device, binary, 0, [u])
        tt.deallocate(u)
        np.testing.assert_array_equal(await tt.to_host(z), x * 2 + 1)
        await device.synchronize()
        assert device.memory_used(DRAM) == 2 * held
        tt.deallocate(y)
        tt.deallocate(z)
        assert device.memory_used(DRAM) == 0


async def test_queued_work_on_the_input_runs_first(submit_path: str, anyio_backend: str) -> None:
    """Programs queued before (on a worker thread each, so still queued at the submit), a
    write queued before: all read the input's value; it is freed after the last of them."""
    binary = _binary()
    x, new = _values(2), _values(3)
    async with tt.open_device(SMALL, inline_seconds=-1) as device:
        t = tt.to_device(x, device, DRAM_TILE)
        before = [tt.submit(device, binary, 0, [t])[0] for _ in range(3)]
        tt.write(t, new)  # after the three reads of x, before the unretained one
        t.retain = False
        (last,) = tt.submit(device, binary, 0, [t])
        assert t.is_deallocated
        for out in before:
            np.testing.assert_array_equal(await tt.to_host(out), x * 2 + 1)
        np.testing.assert_array_equal(await tt.to_host(last), new * 2 + 1)
        await device.synchronize()
        per_tensor = device.memory_used(DRAM) // 4  # the four outputs, t freed
        for out in before:
            tt.deallocate(out)
        assert device.memory_used(DRAM) == per_tensor
        tt.deallocate(last)
        assert device.memory_used(DRAM) == 0


async def test_a_tensor_passed_twice_is_read_twice_and_deallocated_once(submit_path: str) -> None:
    binary = _binary()
    x = _values(4)
    async with tt.open_device(SMALL) as device:
        t = tt.to_device(x, device, DRAM_TILE)
        t.retain = False
        (y,) = tt.submit(device, binary, 1, [t, t])
        assert t.is_deallocated
        np.testing.assert_array_equal(await tt.to_host(y), 2 * x)
        await device.synchronize()
        one = device.memory_used(DRAM)
        tt.deallocate(y)
        assert device.memory_used(DRAM) == 0 and one > 0


async def test_only_the_unretained_input_goes(submit_path: str) -> None:
    binary = _binary()
    x, w = _values(5), _values(6)
    async with tt.open_device(SMALL) as device:
        batch = tt.to_device(x, device, DRAM_TILE)
        one = device.memory_used(DRAM)
        weights = tt.to_device(w, device, DRAM_TILE)
        batch.retain = False
        (y,) = tt.submit(device, binary, 1, [batch, weights])
        assert batch.is_deallocated and not weights.is_deallocated
        np.testing.assert_array_equal(await tt.to_host(y), x + w)
        np.testing.assert_array_equal(await tt.to_host(weights), w)
        await device.synchronize()
        assert device.memory_used(DRAM) == 2 * one  # y and weights
        tt.deallocate(y)
        tt.deallocate(weights)
        assert device.memory_used(DRAM) == 0


async def test_a_refused_submit_deallocates_nothing(submit_path: str) -> None:
    binary = _binary()
    x = _values(7)
    async with tt.open_device(SMALL) as device:
        t = tt.to_device(x, device, DRAM_TILE)
        t.retain = False
        wrong = tt.to_device(np.ones((32, 32), np.float32), device, DRAM_TILE)
        used = device.memory_used(DRAM)
        with pytest.raises(tt.ShapeError):
            tt.submit(device, binary, 1, [t, wrong])
        with pytest.raises(tt.ProgramError):
            tt.submit(device, binary, 7, [t])
        assert not t.is_deallocated and device.memory_used(DRAM) == used
        np.testing.assert_array_equal(await tt.to_host(t), x)


async def test_a_donated_input_is_consumed_whatever_its_retain(submit_path: str) -> None:
    binary = _binary()
    x = _values(8)
    async with tt.open_device(SMALL) as device:
        for retain in (True, False):
            t = tt.to_device(x, device, DRAM_TILE)
            t.retain = retain
            (y,) = tt.submit(device, binary, 2, [t])
            with pytest.raises(tt.DeallocatedTensorError, match="donated"):
                await tt.to_host(t)
            np.testing.assert_array_equal(await tt.to_host(y), x * 2 + 1)
            await device.synchronize()
            used = device.memory_used(DRAM)
            tt.deallocate(y)
            assert device.memory_used(DRAM) == 0 and used > 0
        assert device.stats.donations == 2


async def test_a_capture_refuses_an_unretained_input(submit_path: str) -> None:
    """Chosen: refuse (TraceError, nothing queued), not apply at capture only, since every
    replay reads its inputs where the capture read them."""
    binary = _binary()
    x = _values(9)
    async with tt.open_device(SMALL) as device:
        t = tt.to_device(x, device, DRAM_TILE)
        await t
        t.retain = False
        used, programs = device.memory_used(DRAM), device.stats.programs_run
        with pytest.raises(tt.TraceError, match="retain False"):
            with tt.capture_trace(device):
                tt.submit(device, binary, 0, [t])
        await device.synchronize()
        assert not t.is_deallocated and device.memory_used(DRAM) == used
        assert device.stats.programs_run == programs
        t.retain = True  # retained, the capture takes it
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, binary, 0, [t])
        tt.write(t, x + 1)
        tt.execute_trace(trace)
        np.testing.assert_array_equal(await tt.to_host(y), (x + 1) * 2 + 1)
        tt.release_trace(trace)


async def test_the_c_submit_leaves_an_unretained_input_to_the_checked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    binary = _binary()
    taken: list[bool] = []
    inner = _dispatch.submit

    def spy(*args: Any) -> Any:
        result = inner(*args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(_dispatch, "submit", spy)
    async with tt.open_device(SMALL) as device:
        t = tt.to_device(_values(10), device, DRAM_TILE)
        tt.submit(device, binary, 0, [t])  # the program's first submit: planned by the checked path
        tt.submit(device, binary, 0, [t])
        t.retain = False
        tt.submit(device, binary, 0, [t])
        assert taken == [False, True, False] and t.is_deallocated


async def test_a_mesh_tensor_retain_is_every_shard_s(spmd_path: str) -> None:
    binary = _binary()
    x = np.random.default_rng(11).integers(-40, 40, (4 * SHAPE[0], SHAPE[1])).astype(np.float32)
    spec = tt.MeshSpec((2, 2), chip=SMALL)
    async with tt.open_mesh_device(spec) as mesh:
        t = tt.to_device(x, mesh, DRAM_TILE, mapper=tt.shard(0))
        assert t.retain is True
        t.retain = False
        assert [s.retain for s in tt.device_tensors(t)] == [False] * 4
        (y,) = tt.submit(mesh, binary, 0, [t])
        assert t.is_deallocated and all(s.is_deallocated for s in tt.device_tensors(t))
        with pytest.raises(tt.DeallocatedTensorError, match="retain is False"):
            await tt.to_host(t, composer=tt.concat(0))
        np.testing.assert_array_equal(await tt.to_host(y, composer=tt.concat(0)), x * 2 + 1)
        await mesh.synchronize()
        per_chip = [chip.memory_used(DRAM) for chip in mesh.chips]
        assert len(set(per_chip)) == 1  # one output shard on each chip, its input shard freed
        tt.deallocate(y)
        assert mesh.memory_used(DRAM) == 0
        # One shard unretained: the mesh tensor says False, and only that chip's shard goes.
        u = tt.to_device(x, mesh, DRAM_TILE, mapper=tt.shard(0))
        tt.device_tensors(u)[1].retain = False
        assert u.retain is False
        (z,) = tt.submit(mesh, binary, 0, [u])
        assert [s.is_deallocated for s in tt.device_tensors(u)] == [False, True, False, False]
        np.testing.assert_array_equal(await tt.to_host(z, composer=tt.concat(0)), x * 2 + 1)


# tt-mlir's `deallocateTensor(tensor, force=false)` leaves a retained tensor alone
# (runtime/lib/ttnn/runtime.cpp: "Tensor is retained thus not deallocating"); ttflow's default
# `force=True` is ttnn's `ttnn.deallocate`, which frees.


async def test_deallocate_without_force_leaves_a_retained_tensor_alone() -> None:
    x = _values(12)
    async with tt.open_device(SMALL) as device:
        t = tt.to_device(x, device, DRAM_TILE)
        await t
        used = device.memory_used(DRAM)
        tt.deallocate(t, force=False)
        assert not t.is_deallocated and device.memory_used(DRAM) == used
        np.testing.assert_array_equal(await tt.to_host(t), x)
        t.retain = False
        tt.deallocate(t, force=False)  # "to deallocate, set retain to false first"
        assert t.is_deallocated and device.memory_used(DRAM) == 0
        u = tt.to_device(x, device, DRAM_TILE)
        tt.deallocate(u)  # ttflow's default force=True: retained or not, it goes
        assert u.is_deallocated
        await device.synchronize()
        assert device.memory_used(DRAM) == 0


async def test_deallocate_without_force_on_a_mesh_goes_by_each_shard_s_retain(spmd_path: str) -> None:
    x = np.random.default_rng(13).integers(-40, 40, (4 * SHAPE[0], SHAPE[1])).astype(np.float32)
    spec = tt.MeshSpec((2, 2), chip=SMALL)
    async with tt.open_mesh_device(spec) as mesh:
        t = tt.to_device(x, mesh, DRAM_TILE, mapper=tt.shard(0))
        tt.device_tensors(t)[2].retain = False
        tt.deallocate(t, force=False)
        assert [s.is_deallocated for s in tt.device_tensors(t)] == [False, False, True, False]
        tt.deallocate(t)
        await mesh.synchronize()
        assert mesh.memory_used(DRAM) == 0


async def test_to_layout_follows_tt_mlir_s_retain_rule(anyio_backend: str) -> None:
    """tt-mlir's `toLayout(tensor, device, layout, retain)`: the result's retain is `retain`,
    or the source's; a result that is not retained consumes its source."""
    x = _values(14)
    l1 = tt.Layout(L1, tt.TensorLayout.TILE)
    async with tt.open_device(SMALL) as device:
        t = tt.to_device(x, device, DRAM_TILE)
        kept = tt.to_layout(t, l1)  # the source's retain (True): both stay
        assert kept.retain and not t.is_deallocated
        consumed = tt.to_layout(t, l1, retain=False)
        assert consumed.retain is False and t.is_deallocated
        with pytest.raises(tt.DeallocatedTensorError, match="retain is False"):
            await tt.to_host(t)
        np.testing.assert_array_equal(await tt.to_host(consumed), x)
        np.testing.assert_array_equal(await tt.to_host(kept), x)
        u = tt.to_device(x, device, DRAM_TILE)
        u.retain = False
        inherited = tt.to_layout(u, l1)  # no retain given: the source's False, so it goes
        assert inherited.retain is False and u.is_deallocated
        again = tt.to_layout(inherited, DRAM_TILE, retain=True)  # retained: the source stays too
        assert again.retain and not inherited.is_deallocated and inherited.retain is False
        np.testing.assert_array_equal(await tt.to_host(again), x)
        with pytest.raises(TypeError, match="retain is a bool"):
            tt.to_layout(again, l1, retain=1)  # type: ignore[arg-type]
        for tensor in (kept, consumed, again, inherited):
            tt.deallocate(tensor)
        await device.synchronize()
        assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0
