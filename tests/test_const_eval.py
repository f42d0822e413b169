"""Const-eval (`ProgramBuilder.input(..., const=True)`): what depends only on constants runs once
per (program, constant tensors), is kept on the device, and is computed again after any change
of a constant's value; the results equal the same programs without constants bit for bit, and
numpy's. Both submit paths (the C one falls back to the checked one) run every device test."""

from __future__ import annotations

import gc
import math
from typing import Any

import numpy as np
import pytest

import ttflow as tt
from ttflow._core import _dispatch

pytestmark = pytest.mark.anyio

SMALL = tt.DeviceSpec.small()
F32 = tt.DataType.FLOAT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE = tt.Layout(DRAM, tt.TensorLayout.TILE)


@pytest.fixture(params=["c", "checked"])
def submit_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "checked":
        monkeypatch.setattr(_dispatch, "submit", lambda *args: None)
    return str(request.param)


def _pipeline(const: bool) -> tt.Binary:
    """Three programs of an MLP whose weights are constants: each transposes or scales its
    weights (a part that depends on them alone), then multiplies."""
    p0 = tt.ProgramBuilder("layer0")
    x, w1 = p0.input((32, 64)), p0.input((48, 64), const=const)
    p0.output(p0.relu(p0.matmul(x, p0.mul(p0.transpose(w1), 0.5))))
    p1 = tt.ProgramBuilder("layer1")
    h, w2, b2 = p1.input((32, 48)), p1.input((32, 48), const=const), p1.input((1, 32), const=const)
    p1.output(p1.gelu(p1.add(p1.matmul(h, p1.transpose(w2)), p1.mul(b2, 2.0))))
    p2 = tt.ProgramBuilder("layer2")
    h2, w3 = p2.input((32, 32)), p2.input((32, 16), const=const)
    p2.output(p2.softmax(p2.matmul(h2, p2.sub(p2.mul(w3, w3), 1.0)), axis=-1))
    return tt.Binary([p0.build(), p1.build(), p2.build()])


def _numpy(x: np.ndarray, w: list[np.ndarray]) -> np.ndarray:
    h = np.maximum(x @ (w[0].T * 0.5), 0)
    z = h @ w[1].T + w[2] * 2
    h2 = 0.5 * z * (1 + np.vectorize(math.erf)(z / np.sqrt(2)))
    logits = h2 @ (w[3] * w[3] - 1)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _run(device: Any, binary: tt.Binary, x: Any, w: list[Any]) -> tt.Tensor:
    (h,) = tt.submit(device, binary, 0, [x, w[0]])
    (h2,) = tt.submit(device, binary, 1, [h, w[1], w[2]])
    (out,) = tt.submit(device, binary, 2, [h2, w[3]])
    return out


async def test_pipeline_runs_constants_once(submit_path: str) -> None:
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(s).astype(np.float32) * 0.2 for s in [(48, 64), (32, 48), (1, 32), (32, 16)]]
    xs = [rng.standard_normal((32, 64)).astype(np.float32) for _ in range(4)]
    cached, plain = _pipeline(True), _pipeline(False)
    async with tt.open_device(SMALL) as device:
        slot = tt.to_device(xs[0], device, TILE)
        held = device.memory_used(DRAM)  # what the user keeps to the end
        w = [tt.to_device(a, device) for a in weights]
        runs = device.stats.programs_run
        for i in range(100):
            if i % 25 == 0:
                tt.write(slot, xs[i // 25])
            out = _run(device, cached, slot, w)
            if i % 25 == 24:
                got = await tt.to_host(out)
                np.testing.assert_array_equal(got, await tt.to_host(_run(device, plain, slot, w)))
                np.testing.assert_allclose(got, _numpy(xs[i // 25], weights), rtol=1e-4, atol=1e-5)
        stats = device.stats
        assert (stats.const_eval_misses, stats.const_eval_hits) == (3, 297)
        # 300 programs, 3 constant programs, and the 4 x 3 uncached ones run for comparison.
        assert stats.programs_run - runs == 300 + 3 + 12
        # A write into one constant: only its program computes its constants again.
        weights[1] = weights[1] * np.float32(-1.5)
        tt.write(w[1], weights[1])
        for _ in range(3):
            out = _run(device, cached, slot, w)
        assert (device.stats.const_eval_misses, device.stats.const_eval_hits) == (4, 305)
        got = await tt.to_host(out)
        np.testing.assert_array_equal(got, await tt.to_host(_run(device, plain, slot, w)))
        np.testing.assert_allclose(got, _numpy(xs[3], weights), rtol=1e-4, atol=1e-5)
        # Freed with the constants: nothing is held but what the user holds.
        del out
        for t in w:
            tt.deallocate(t)
        await device.synchronize()
        assert device.memory_used(DRAM) == held, device.memory_view(DRAM)
        assert device.memory_used(L1) == 0
        assert not device._scheduler.const_cache.entries


async def test_shared_across_binaries(tmp_path: Any, submit_path: str) -> None:
    """Two Binary objects of the same programs (built twice; loaded twice from one file) share
    the device's cache; the file keeps the constant flags."""
    path = tmp_path / "mlp.ttb"
    _pipeline(True).save(path)
    first, second = tt.Binary.load(path), tt.Binary.load(path)
    assert [p.consts for p in first.programs] == [(1,), (1, 2), (1,)]
    rng = np.random.default_rng(1)
    weights = [rng.standard_normal(s).astype(np.float32) for s in [(48, 64), (32, 48), (1, 32), (32, 16)]]
    x_host = rng.standard_normal((32, 64)).astype(np.float32)
    async with tt.open_device(SMALL) as device:
        w = [tt.to_device(a, device) for a in weights]
        x = tt.to_device(x_host, device)
        a = await tt.to_host(_run(device, first, x, w))
        b = await tt.to_host(_run(device, second, x, w))
        c = await tt.to_host(_run(device, _pipeline(True), x, w))
        assert (device.stats.const_eval_misses, device.stats.const_eval_hits) == (3, 6)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(a, await tt.to_host(_run(device, _pipeline(False), x, w)))


def _scaled() -> tuple[tt.Binary, tt.Binary]:
    """out = x + 3 * w (w constant), and the same without the constant."""
    binaries = []
    for const in (True, False):
        b = tt.ProgramBuilder("scaled")
        x, w = b.input((32, 32)), b.input((32, 32), const=const)
        b.output(b.add(x, b.mul(w, 3.0)))
        binaries.append(tt.Binary([b.build()]))
    return binaries[0], binaries[1]


async def test_every_change_of_a_constant_recomputes(submit_path: str) -> None:
    cached, plain = _scaled()
    rng = np.random.default_rng(2)
    x_host = rng.standard_normal((32, 32)).astype(np.float32)
    w_host = rng.standard_normal((32, 32)).astype(np.float32)

    async def check(device: Any, x: Any, w: Any, w_value: np.ndarray) -> None:
        (got,) = tt.submit(device, cached, 0, [x, w])
        (want,) = tt.submit(device, plain, 0, [x, w])
        got_host = await tt.to_host(got)
        np.testing.assert_array_equal(got_host, await tt.to_host(want))
        np.testing.assert_array_equal(got_host, x_host + np.float32(3) * w_value)

    async with tt.open_device(SMALL) as device:
        x = tt.to_device(x_host, device, TILE)  # as the program reads it: no conversion kept
        # The constant is the output of a trace: each replay writes it.
        slot = tt.to_device(w_host, device)
        b = tt.ProgramBuilder("negate")
        b.output(b.neg(b.input((32, 32), tt.Layout())), tt.Layout())
        negate = tt.Binary([b.build()])
        await slot
        held = device.memory_used(DRAM)  # x and slot, kept to the end
        with tt.capture_trace(device) as trace:
            (w,) = tt.submit(device, negate, 0, [slot])
        await check(device, x, w, -w_host)
        await check(device, x, w, -w_host)
        assert (device.stats.const_eval_misses, device.stats.const_eval_hits) == (1, 1)
        tt.write(slot, w_host * 2)
        tt.execute_trace(trace)  # writes w
        await check(device, x, w, -2 * w_host)
        assert device.stats.const_eval_misses == 2
        tt.release_trace(trace)
        # A write into it.
        tt.write(w, w_host * 5)
        await check(device, x, w, 5 * w_host)
        assert device.stats.const_eval_misses == 3
        # Donated to another program: its new value is another tensor (and the old entry goes).
        d = tt.ProgramBuilder("bump")
        v = d.input((32, 32), tt.Layout())
        d.output(d.add(v, 1.0), donates=v)
        (w2,) = tt.submit(device, tt.Binary([d.build()]), 0, [w])
        assert not device._scheduler.const_cache.entries
        await check(device, x, w2, 5 * w_host + 1)
        assert device.stats.const_eval_misses == 4
        # A constant whose handle is dropped frees its entry.
        del w2
        gc.collect()
        assert not device._scheduler.const_cache.entries
        await device.synchronize()
        assert device.memory_used(DRAM) == held


async def test_capture_runs_constants_in_the_trace(submit_path: str) -> None:
    """A replay after a write to the constant uses the new value: the constant part, hoisted
    out of the trace, is computed again before the replay (a stale cached tensor would not)."""
    cached, _ = _scaled()
    rng = np.random.default_rng(3)
    x_host = rng.standard_normal((32, 32)).astype(np.float32)
    w_host = rng.standard_normal((32, 32)).astype(np.float32)
    async with tt.open_device(SMALL) as device:
        x, w = tt.to_device(x_host, device), tt.to_device(w_host, device)
        (warm,) = tt.submit(device, cached, 0, [x, w])  # cached before the capture
        await warm
        with tt.capture_trace(device) as trace:
            (out,) = tt.submit(device, cached, 0, [x, w])
        np.testing.assert_array_equal(await tt.to_host(out), x_host + np.float32(3) * w_host)
        tt.write(w, w_host * 7)
        tt.execute_trace(trace)
        np.testing.assert_array_equal(await tt.to_host(out), x_host + np.float32(3) * (w_host * 7))
        tt.release_trace(trace)


async def test_a_trace_counts_const_eval_as_tt_mlir_s_runtime_does(submit_path: str) -> None:
    """Const-eval is hoisted out of a captured trace: the capture's run is a miss, each replay a
    hit (the counters stayed (0, 0) when the trace ran the program whole); a replay after a
    write to the constant is a miss again and reads the new constant, and the trace's release
    gives back what it pinned."""
    cached, _ = _scaled()
    rng = np.random.default_rng(4)
    x_host = rng.standard_normal((32, 32)).astype(np.float32)
    w_host = rng.standard_normal((32, 32)).astype(np.float32)
    async with tt.open_device(SMALL) as device:
        x, w = tt.to_device(x_host, device), tt.to_device(w_host, device)
        await x
        await w
        held = device.memory_used(DRAM)

        def counters() -> tuple[int, int]:
            return device.stats.const_eval_misses, device.stats.const_eval_hits

        with tt.capture_trace(device) as trace:
            (out,) = tt.submit(device, cached, 0, [x, w])
        assert counters() == (1, 0)
        np.testing.assert_array_equal(await tt.to_host(out), x_host + np.float32(3) * w_host)
        for k in range(3):
            tt.execute_trace(trace)
            np.testing.assert_array_equal(await tt.to_host(out), x_host + np.float32(3) * w_host)
        assert counters() == (1, 3)
        programs = device.stats.programs_run
        tt.write(w, w_host * 7)
        tt.execute_trace(trace)  # the entry went with the write: computed again, then replayed
        np.testing.assert_array_equal(await tt.to_host(out), x_host + np.float32(3) * (w_host * 7))
        assert counters() == (2, 3) and device.stats.programs_run == programs + 2
        tt.execute_trace(trace)
        assert counters() == (2, 4)
        (plain_out,) = tt.submit(device, cached, 0, [x, w])  # outside the trace: the same entry
        assert counters() == (2, 5)
        np.testing.assert_array_equal(await tt.to_host(plain_out), x_host + np.float32(3) * (w_host * 7))
        tt.release_trace(trace)
        del out, plain_out, trace
        await device.synchronize()
        banks = SMALL.banks(DRAM)
        cached_bytes = sum(-(-b.num_pages // banks) * b.aligned_page_size * banks
                           for entry in device._scheduler.const_cache.entries.values()
                           for t in entry.results for _, b in t.storages)
        view = device.memory_view(DRAM)
        assert {b.kind for b in view.buffers} <= {"home", "conversion"}  # nothing the trace pinned
        conversions = sum(b.nbytes for b in view.buffers if b.kind == "conversion")  # x's, w's
        assert cached_bytes > 0 and device.memory_used(DRAM) == held + cached_bytes + conversions


@pytest.mark.parametrize("on_mesh", [False, True])
async def test_a_replay_right_after_the_capture_and_a_write_reads_the_new_constant(
        submit_path: str, on_mesh: bool) -> None:
    """Nothing awaited: the capture's own run is still queued when the constant is written and
    the trace executed, so the captured program is decided after its constants were looked up
    again; it reads the new results (it read the old, deallocated ones: "no value")."""
    b = tt.ProgramBuilder("exp_const")
    x, w = b.input((32, 32)), b.input((32, 32), const=True)
    b.output(b.add(x, b.exp(w)))
    binary = tt.Binary([b.build()])
    x_host = np.random.default_rng(8).standard_normal((32, 32)).astype(np.float32)
    w_new = np.random.default_rng(9).standard_normal((32, 32)).astype(np.float32)
    opened = tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL)) if on_mesh else tt.open_device(SMALL)
    async with opened as device:
        place = {"mapper": tt.replicate()} if on_mesh else {}
        x = tt.to_device(x_host, device, **place)
        w = tt.to_device(np.zeros((32, 32), np.float32), device, **place)
        with tt.capture_trace(device) as trace:
            (out,) = tt.submit(device, binary, 0, [x, w])
        tt.write(w, w_new)
        tt.execute_trace(trace)
        got = await (tt.to_host(out, composer=tt.concat(0)) if on_mesh else tt.to_host(out))
        want = x_host + np.exp(w_new)
        for part in np.split(got, 2) if on_mesh else [got]:
            np.testing.assert_allclose(part, want, rtol=1e-6, atol=1e-6)
        tt.release_trace(trace)


async def test_a_replay_writes_an_output_where_the_hoisted_constant_part_moved_it(submit_path: str) -> None:
    """On an "eager" device the constant program, starting inside the capture, evicts the L1
    output of the program captured before it; that move is a step of the trace like any
    captured program's eviction, so each replay writes the output where it then lives. (Run
    outside the capture, the move was unrecorded: a replay wrote the old L1 storage and the
    output kept its first value, a wrong value that raised nothing: the runtime machine's
    finding, docs/testing.md.)"""
    first = tt.ProgramBuilder("double")
    v = first.input((32, 32))
    first.output(first.mul(v, 2.0), tt.Layout(L1, tt.TensorLayout.TILE))
    second = tt.ProgramBuilder("plus_exp_const")
    y, w = second.input((32, 32), tt.Layout(L1, tt.TensorLayout.TILE)), second.input((32, 32), const=True)
    second.output(second.add(y, second.exp(w)))
    binary = tt.Binary([first.build(), second.build()])
    rng = np.random.default_rng(11)
    x_host, w_host = (rng.standard_normal((32, 32)).astype(np.float32) for _ in range(2))
    async with tt.open_device(SMALL, eviction="eager") as device:
        x, w = tt.to_device(x_host, device), tt.to_device(w_host, device)
        with tt.capture_trace(device) as trace:
            (doubled,) = tt.submit(device, binary, 0, [x])
            (out,) = tt.submit(device, binary, 1, [doubled, w])
        await out
        evictions = device.stats.evictions
        for k in range(1, 4):
            x_new = x_host + np.float32(k)
            tt.write(x, x_new)
            tt.execute_trace(trace)
            np.testing.assert_array_equal(await tt.to_host(doubled), x_new * np.float32(2))
            np.testing.assert_allclose(await tt.to_host(out), x_new * 2 + np.exp(w_host), rtol=1e-6, atol=1e-6)
        assert evictions > 0  # the case this test is about happened
        tt.release_trace(trace)


async def test_a_trace_refuses_a_constant_deallocated_since_capture(submit_path: str) -> None:
    cached, _ = _scaled()
    ones = np.ones((32, 32), np.float32)
    async with tt.open_device(SMALL) as device:
        x, w = tt.to_device(ones, device), tt.to_device(ones, device)
        with tt.capture_trace(device) as trace:
            tt.submit(device, cached, 0, [x, w])
        tt.deallocate(w)
        with pytest.raises(tt.TraceError, match="constant input"):
            tt.execute_trace(trace)
        tt.release_trace(trace)


async def test_a_failed_constant_run_is_computed_again(submit_path: str) -> None:
    """A constant part that failed (here a host op) is not kept: the next submit runs it again."""
    calls = []

    def flaky(a: np.ndarray) -> np.ndarray:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first call fails")
        return a * np.float32(2)

    b = tt.ProgramBuilder("hoisted_host_op")
    x, w = b.input((32, 32)), b.input((32, 32), const=True)
    (w2,) = b.host_op(flaky, [w], outputs=[((32, 32), F32)])
    b.output(b.add(x, w2))
    binary = tt.Binary([b.build()])
    ones = np.ones((32, 32), np.float32)
    async with tt.open_device(SMALL) as device:
        x_t, w_t = tt.to_device(ones, device), tt.to_device(ones * 3, device)
        (out,) = tt.submit(device, binary, 0, [x_t, w_t])
        with pytest.raises(tt.HostOpError, match="host_op:flaky"):
            await tt.to_host(out)
        for _ in range(3):
            (out,) = tt.submit(device, binary, 0, [x_t, w_t])
            np.testing.assert_array_equal(await tt.to_host(out), ones + 6)
        assert len(calls) == 2
        assert (device.stats.const_eval_misses, device.stats.const_eval_hits) == (2, 2)


async def test_cached_constants_live_as_long_as_their_binary(submit_path: str) -> None:
    """`cache_constants` (a compiled program's `load_cached` of constants it makes itself): the
    part without inputs runs once, and its cached result, which no constant can end, is freed
    when the binary goes (as tt-mlir's runtime keeps the cache in the binary); a binary of the
    same content loaded afterwards computes it again."""

    def build() -> tt.Binary:
        b = tt.ProgramBuilder("made_constants")
        x = b.input((64, 64))
        b.output(b.add(x, b.mul(b.full((64, 64), 0.25), 8.0)))
        b.cache_constants()
        return tt.Binary([b.build()])

    ones = np.ones((64, 64), np.float32)
    async with tt.open_device(SMALL) as device:
        x = tt.to_device(ones, device)

        def held() -> int:  # x's storages (its tile conversion is made by the first run)
            return sum(buffer.num_pages * buffer.aligned_page_size for _, buffer in x.storages)

        binary = build()
        for _ in range(3):
            (out,) = tt.submit(device, binary, 0, [x])
            np.testing.assert_array_equal(await tt.to_host(out), ones + 2)
            tt.deallocate(out)
        assert (device.stats.const_eval_misses, device.stats.const_eval_hits) == (1, 2)
        await tt.to_host(x)
        assert device.memory_used(DRAM) == held() + 64 * 64 * 4  # the cached result
        del binary
        gc.collect()
        (out,) = tt.submit(device, build(), 0, [x])  # the same content: computed again
        np.testing.assert_array_equal(await tt.to_host(out), ones + 2)
        assert (device.stats.const_eval_misses, device.stats.const_eval_hits) == (2, 2)
        tt.deallocate(out)
        gc.collect()
        await tt.to_host(x)
        assert device.memory_used(DRAM) == held()


def test_builder() -> None:
    b = tt.ProgramBuilder("p")
    x, w = b.input((32, 32)), b.input((32, 32), const=True)
    with pytest.raises(tt.ProgramError, match="declared const"):
        b.output(b.add(x, w), donates=w)
    with pytest.raises(tt.ProgramError, match="const must be a bool"):
        tt.ProgramBuilder("q").input((32, 32), const="yes")
    b.output(b.add(x, w))
    assert b.build().consts == (1,)


async def test_mesh_keeps_constants_per_chip(spmd_path: str) -> None:
    """On a mesh each chip keeps its own (the C SPMD submit falls back to the per-chip one)."""
    b = tt.ProgramBuilder("sharded")
    x, w = b.input((32, 32)), b.input((32, 32), const=True)
    b.output(b.matmul(x, b.mul(b.transpose(w), 2.0)))
    cached = tt.Binary([b.build()])
    rng = np.random.default_rng(4)
    x_host = rng.standard_normal((64, 32)).astype(np.float32)
    w_host = rng.standard_normal((32, 32)).astype(np.float32)
    async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL)) as mesh:
        x, w = tt.to_device(x_host, mesh, mapper=tt.shard(0)), tt.to_device(w_host, mesh)
        for _ in range(3):
            (out,) = tt.submit(mesh, cached, 0, [x, w])
        got = await tt.to_host(out, composer=tt.concat(0))
        np.testing.assert_allclose(got, x_host @ (w_host.T * 2), rtol=1e-5, atol=1e-5)
        assert [(c.stats.const_eval_misses, c.stats.const_eval_hits) for c in mesh.chips] == [(1, 2), (1, 2)]
