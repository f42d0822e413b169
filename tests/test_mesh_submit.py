"""The SPMD submit's two paths, held to one behaviour: the C fast path (`_core._dispatch.submit_spmd`:
one decided record per program and mesh, every chip checked before any queues, outputs made
without per-chip handles) and the checked path it falls back to (one single-chip submit per chip).

Every test runs on both (the `spmd_path` fixture; tests/test_mesh.py and test_mesh_examples.py
run on both too). Against numpy and the checked path: what is refused and how (typed, before any
chip queues: nothing allocated, nothing queued), the values of programs that alternate on one mesh
(the decided record is keyed by program and chips), reshapes and submeshes over the same chips, and
the lifetime of outputs whose handles were never made (dropped, kept through `device_tensors`,
deallocated: every chip's memory back to what the user holds).

Planted in the C path, each caught here on the "c" runs only: liveness checked on chip 0's shard
alone (the refusal tests), a decided record reused for another program (the alternating test), a
mesh tensor dropped without handles that frees nothing (the lifetime tests).
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import ttflow as tt
from ttflow._core import _dispatch

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("spmd_path")]

F32, I32 = tt.DataType.FLOAT32, tt.DataType.INT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
SMALL = tt.DeviceSpec.small()


def small(shape: tuple[int, int]) -> tt.MeshSpec:
    return tt.MeshSpec(shape, chip=SMALL)


def used(mesh: tt.MeshDevice) -> list[tuple[int, int]]:
    return [(chip.memory_used(DRAM), chip.memory_used(L1)) for chip in mesh.chips]


def queued(mesh: tt.MeshDevice) -> list[int]:
    return [len(chip._cq0) for chip in mesh.chips]


def binary_of(name: str, op: str, shape: tuple[int, int] = (32, 32), dtype: tt.DataType = F32) -> tt.Binary:
    b = tt.ProgramBuilder(name)
    x = b.input(shape, tt.Layout(DRAM, tt.TensorLayout.TILE, dtype))
    y = b.input(shape, tt.Layout(DRAM, tt.TensorLayout.TILE, dtype))
    b.output(b.add(x, y) if op == "add" else b.mul(x, y))
    return tt.Binary([b.build()])


def shard_values(n: int, shape: tuple[int, int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-50, 50, (n * shape[0], shape[1])).astype(np.float32)


async def test_the_fast_path_is_the_one_taken(spmd_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the "c" runs an ordinary submit is decided in C (so the other tests here do test it)."""
    taken: list[bool] = []
    inner = _dispatch.submit_spmd

    def spy(*args: Any) -> Any:
        result = inner(*args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(_dispatch, "submit_spmd", spy)
    binary = binary_of("add", "add")
    async with tt.open_mesh_device(small((2, 2))) as mesh:
        a = tt.to_device(shard_values(4, (32, 32), 0), mesh, mapper=tt.shard(0))
        (y,) = tt.submit(mesh, binary, 0, [a, a])
        np.testing.assert_array_equal(await tt.to_host(y, composer=tt.concat(0)), 2 * shard_values(4, (32, 32), 0))
    assert taken == [spmd_path == "c"]


def _refusals(mesh: tt.MeshDevice, other: tt.MeshDevice) -> list[tuple[str, Any]]:
    """Each case: a name, and a function of (binary) that submits bad input."""
    x = np.ones((32, 32), np.float32)
    good = tt.to_device(x, mesh)
    foreign = tt.to_device(x, other)
    wrong_shape = tt.to_device(np.ones((32, 64), np.float32), mesh)
    wrong_dtype = tt.to_device(x.astype(np.int32), mesh)
    last_dead = tt.to_device(x, mesh)
    tt.deallocate(tt.device_tensors(last_dead)[-1])  # only the last chip's shard
    middle_dead = tt.to_device(x, mesh)
    tt.deallocate(tt.device_tensors(middle_dead)[1])
    plain = tt.device_tensors(good)[0]
    return [
        ("a tensor of another mesh", lambda b: tt.submit(mesh, b, 0, [good, foreign])),
        ("a shape the program does not declare", lambda b: tt.submit(mesh, b, 0, [good, wrong_shape])),
        ("an integer tensor for a float input", lambda b: tt.submit(mesh, b, 0, [wrong_dtype, good])),
        ("the last chip's shard deallocated", lambda b: tt.submit(mesh, b, 0, [good, last_dead])),
        ("a middle chip's shard deallocated", lambda b: tt.submit(mesh, b, 0, [middle_dead, good])),
        ("one input too few", lambda b: tt.submit(mesh, b, 0, [good])),
        ("a program index out of range", lambda b: tt.submit(mesh, b, 1, [good, good])),
        ("a single-chip tensor on a 4-chip mesh", lambda b: tt.submit(mesh, b, 0, [good, plain])),
        ("inputs that are not a list", lambda b: tt.submit(mesh, b, 0, iter([good, good]))),
        ("not a binary", lambda b: tt.submit(mesh, b.programs[0], 0, [good, good])),
    ]


async def test_every_refusal_is_typed_and_queues_nothing_on_any_chip() -> None:
    """Each bad submit raises the checked path's error (type and message, recorded on the checked
    run and compared on the fast one through the shared expectation below), with nothing queued
    or allocated on any chip; the mesh then runs a good submit."""
    expected = {
        "a tensor of another mesh": (tt.MeshError, "is a tensor of"),
        "a shape the program does not declare": (tt.ShapeError, "has shape (32, 64), the program declares (32, 32)"),
        "an integer tensor for a float input": (tt.LayoutError, "input 0 is INT32 but the program declares FLOAT32"),
        "the last chip's shard deallocated": (tt.TTFlowError, "deallocated"),
        "a middle chip's shard deallocated": (tt.TTFlowError, "deallocated"),
        "one input too few": (tt.ProgramError, "takes 2 inputs, 1 were given"),
        "a program index out of range": (tt.ProgramError, "out of range"),
        "a single-chip tensor on a 4-chip mesh": (tt.MeshError, "single-chip tt.Tensor"),
        "inputs that are not a list": (TypeError, "list or tuple"),
        "not a binary": (tt.ProgramError, "expected a tt.Binary"),
    }
    binary = binary_of("add", "add")
    async with tt.open_mesh_device(small((2, 2))) as mesh, tt.open_mesh_device(small((2, 2))) as other:
        cases = _refusals(mesh, other)
        await mesh.synchronize()
        before = used(mesh)
        for name, submit in cases:
            error, words = expected[name]
            with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
                submit(binary)
            assert queued(mesh) == [0, 0, 0, 0], name
            assert used(mesh) == before, name
        good = tt.to_device(np.full((32, 32), 3, np.float32), mesh)
        (y,) = tt.submit(mesh, binary, 0, [good, good])
        for shard in tt.device_tensors(y):
            np.testing.assert_array_equal(await tt.to_host(shard), np.full((32, 32), 6, np.float32))


async def test_programs_alternating_on_one_mesh_each_give_their_own_values() -> None:
    """The decided record is one program's; another program (same shapes and dtypes, other op)
    must not reuse it."""
    add, mul = binary_of("add", "add"), binary_of("mul", "mul")
    async with tt.open_mesh_device(small((1, 3))) as mesh:
        a_host, b_host = shard_values(3, (32, 32), 1), shard_values(3, (32, 32), 2)
        a = tt.to_device(a_host, mesh, mapper=tt.shard(0))
        b = tt.to_device(b_host, mesh, mapper=tt.shard(0))
        outs = []
        for _ in range(3):
            outs.append(("add", tt.submit(mesh, add, 0, [a, b])[0]))
            outs.append(("mul", tt.submit(mesh, mul, 0, [a, b])[0]))
        for op, y in outs:
            want = a_host + b_host if op == "add" else a_host * b_host
            np.testing.assert_array_equal(await tt.to_host(y, composer=tt.concat(0)), want)


async def test_a_submesh_and_a_reshape_over_the_same_chips() -> None:
    """A submesh's chips are its parent's; a reshape reorders them: the same program on each view
    pairs every shard with its own chip (numpy's values, shard by shard)."""
    binary = binary_of("add", "add")
    async with tt.open_mesh_device(small((2, 2))) as mesh:
        host = shard_values(4, (32, 32), 3)
        t = tt.to_device(host, mesh, mapper=tt.shard(0))
        (y,) = tt.submit(mesh, binary, 0, [t, t])
        sub = tt.create_submesh(mesh, (1, 2), (1, 0))
        s_host = shard_values(2, (32, 32), 4)
        s = tt.to_device(s_host, sub, mapper=tt.shard(0))
        (z,) = tt.submit(sub, binary, 0, [s, s])
        np.testing.assert_array_equal(await tt.to_host(z, composer=tt.concat(0)), 2 * s_host)
        tt.release_submesh(sub)
        mesh.reshape((1, 4))  # chips 0 1 3 2: t and y keep their shards, each on its chip
        in_new_order = np.concatenate([host[:64], host[96:], host[64:96]])
        (w,) = tt.submit(mesh, binary, 0, [t, y])  # laid out in the new order
        np.testing.assert_array_equal(await tt.to_host(w, composer=tt.concat(0)), 3 * in_new_order)
        np.testing.assert_array_equal(await tt.to_host(y, composer=tt.concat(0)), 2 * host)
        (v,) = tt.submit(mesh, binary, 0, [w, w])
        np.testing.assert_array_equal(await tt.to_host(v, composer=tt.concat(0)), 6 * in_new_order)


async def test_outputs_dropped_unread_free_every_chip() -> None:
    binary = binary_of("add", "add")
    async with tt.open_mesh_device(small((2, 2))) as mesh:
        t = tt.to_device(np.ones((32, 32), np.float32), mesh)
        await tt.submit(mesh, binary, 0, [t, t])[0]  # t's conversion to the program's layout, kept
        held = used(mesh)
        for _ in range(20):
            tt.submit(mesh, binary, 0, [t, t])  # the output dropped at once, never awaited
        await mesh.synchronize()
        gc.collect()
        (y,) = tt.submit(mesh, binary, 0, [t, t])  # frees what was dropped, on every chip
        await y
        del y
        gc.collect()
        tt.submit(mesh, binary, 0, [t, t])
        await mesh.synchronize()
        assert used(mesh) == held


async def test_a_shard_handle_outlives_its_mesh_tensor_and_deallocate_frees_every_chip() -> None:
    binary = binary_of("add", "add")
    async with tt.open_mesh_device(small((1, 3))) as mesh:
        host = shard_values(3, (32, 32), 5)
        t = tt.to_device(host, mesh, mapper=tt.shard(0))
        await tt.submit(mesh, binary, 0, [t, t])[0]  # t's conversion to the program's layout, kept
        held = used(mesh)
        (y,) = tt.submit(mesh, binary, 0, [t, t])
        middle = tt.device_tensors(y)[1]  # the handles made now, after the submit
        del y
        gc.collect()
        (z,) = tt.submit(mesh, binary, 0, [t, t])  # collects what dropping y gave back
        np.testing.assert_array_equal(await tt.to_host(middle), 2 * host[32:64])
        assert used(mesh)[1] != held[1]  # the kept shard, and z's
        tt.deallocate(z)
        del middle
        gc.collect()
        tt.submit(mesh, binary, 0, [t, t])
        await mesh.synchronize()
        assert used(mesh) == held
