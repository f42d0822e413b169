"""Host ops in programs (`ProgramBuilder.host_op`, tt-mlir's CPU hoisting): the user's function
runs off the event loop in queue order, its results are checked and stored, its failures are
typed, and a program holding one runs everywhere a program runs but in a file.

Every value is compared with numpy computed here and with `run_on_host`; both submit paths (the
C one and the checked one it falls back to) run every device test."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import ml_dtypes
import numpy as np
import pytest

import ttflow as tt
from ttflow._core import _dispatch
from ttflow._ir.interpreter import run_on_host

pytestmark = pytest.mark.anyio

SMALL = tt.DeviceSpec.small()
F32, BF16, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.INT32
DRAM_TILE = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE)


@pytest.fixture(params=["c", "checked"])
def submit_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both implementations of a submit: the C one (`_dispatch.submit`) and the checked path."""
    if request.param == "checked":
        monkeypatch.setattr(_dispatch, "submit", lambda *args: None)
    return str(request.param)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _split_program(calls: list[Any] | None = None) -> tuple[tt.Program, Any]:
    """relu(x) -> host op (2 * a, row sums as int32 of floor, a's max) -> device ops again."""

    def split(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if calls is not None:
            calls.append(threading.get_ident())
        return (a * np.float32(2), np.floor(a.sum(axis=-1, keepdims=True)).astype(np.int32))

    b = tt.ProgramBuilder("split")
    x = b.input((40, 64), tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, BF16))
    w = b.input((64, 32))
    doubled, sums = b.host_op(split, [b.relu(x)], outputs=[((40, 64), F32), ((40, 1), tt.Layout(dtype=I32))])
    b.output(b.matmul(doubled, w))
    b.output(b.add(sums, 3))
    return b.build(), split


def _split_reference(x: np.ndarray, w: np.ndarray) -> list[np.ndarray]:
    """numpy's own: the host op's math on the bfloat16 relu it is given, then the device ops."""
    a = np.maximum(x.astype(ml_dtypes.bfloat16), ml_dtypes.bfloat16(0))
    doubled = (a * np.float32(2)).astype(np.float32)
    sums = np.floor(a.sum(axis=-1, keepdims=True)).astype(np.int32)
    return [doubled @ w, sums + 3]


async def test_host_op_between_device_ops(submit_path: str) -> None:
    calls: list[Any] = []
    program, _ = _split_program(calls)
    binary = tt.Binary([program])
    x = _rng(1).standard_normal((40, 64)).astype(np.float32)
    w = _rng(2).standard_normal((64, 32)).astype(np.float32)
    async with tt.open_device(SMALL) as device:
        loop_thread = threading.get_ident()
        tx = tt.to_device(x.astype(ml_dtypes.bfloat16), device)
        tw = tt.to_device(w, device)
        out, sums = tt.submit(device, binary, 0, [tx, tw])
        got = [await tt.to_host(out), await tt.to_host(sums)]
        reference = _split_reference(x, w)
        np.testing.assert_allclose(got[0], reference[0], rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(got[1], reference[1])
        assert got[1].dtype == np.int32
        host = run_on_host(program, [x.astype(ml_dtypes.bfloat16), w])
        for a, h in zip(got, host):
            np.testing.assert_array_equal(a, h)  # bit for bit the host interpreter
        assert len(calls) == 2 and calls[0] != loop_thread  # run_on_host called it here, the device not
        del out, sums
        tt.deallocate(tx)
        tt.deallocate(tw)
        await device.synchronize()
        assert device.memory_used(tt.MemorySpace.DRAM) == 0
        assert device.memory_used(tt.MemorySpace.L1) == 0


class _Gate:
    """A host function (x + 1) that, once armed, blocks until the test releases it: a run on
    the event loop's thread would deadlock on it, a run on a worker thread lets the loop go on."""

    def __init__(self, armed: bool) -> None:
        self.started, self.release, self.armed = threading.Event(), threading.Event(), threading.Event()
        if armed:
            self.armed.set()

    def __call__(self, a: np.ndarray) -> np.ndarray:
        if self.armed.is_set():
            self.started.set()
            if not self.release.wait(10):
                raise TimeoutError("the event loop never ran while the host op waited")
        return a + np.float32(1)


def _gated_program(name: str, gate: _Gate) -> tt.Program:
    b = tt.ProgramBuilder(name)
    (y,) = b.host_op(gate, [b.input((32, 32))], outputs=[((32, 32), None)], name="gate")
    b.output(y)
    return b.build()


async def test_host_op_never_runs_inline(submit_path: str) -> None:
    """A tiny program with a host op still runs on the worker: its function blocks until the
    event loop (free meanwhile) lets it go, which an inline run would deadlock on."""
    gate = _Gate(armed=True)
    binary = tt.Binary([_gated_program("tiny", gate)])
    ones = np.ones((32, 32), np.float32)
    async with tt.open_device(SMALL, inline_seconds=1e6) as device:  # everything else inline
        (out,) = tt.submit(device, binary, 0, [tt.to_device(ones, device)])
        with anyio.fail_after(10):
            while not gate.started.is_set():
                await anyio.sleep(0.001)  # the loop runs while the function waits
        gate.release.set()
        np.testing.assert_array_equal(await tt.to_host(out), ones + 1)


async def test_queue_order_with_writes(submit_path: str) -> None:
    """The function sees each submit's value: a write after a submit is not seen by it, and a
    submit after the write sees the new value; outputs feed later programs in order."""
    seen: list[np.ndarray] = []

    def record(a: np.ndarray) -> np.ndarray:
        seen.append(a.copy())
        return a * np.float32(3)

    b = tt.ProgramBuilder("triple")
    x = b.input((32, 32))
    (y,) = b.host_op(record, [b.add(x, 1.0)], outputs=[((32, 32), F32)])
    b.output(y)
    binary = tt.Binary([b.build()])
    values = [_rng(k).standard_normal((32, 32)).astype(np.float32) for k in range(4)]
    async with tt.open_device(SMALL) as device:
        slot = tt.to_device(values[0], device, DRAM_TILE)
        outs = []
        for k in range(4):
            if k:
                tt.write(slot, values[k])
            (out,) = tt.submit(device, binary, 0, [slot])
            (again,) = tt.submit(device, binary, 0, [out])  # reads the previous run's result
            outs.append((out, again))
        for k, (out, again) in enumerate(outs):
            first = (values[k] + 1) * 3
            np.testing.assert_array_equal(await tt.to_host(out), first)
            np.testing.assert_array_equal(await tt.to_host(again), (first + 1) * 3)
        assert len(seen) == 8
        for k in range(4):
            np.testing.assert_array_equal(seen[2 * k], values[k] + 1)


def _one_output(fn: Any, shape: tuple[int, ...] = (32, 32), dtype: Any = F32) -> tt.Binary:
    b = tt.ProgramBuilder("failing")
    x = b.input((32, 32))
    (y,) = b.host_op(fn, [b.relu(x)], outputs=[(shape, dtype)])
    b.output(b.add(y, 1.0))
    b.output(b.neg(x))
    return tt.Binary([b.build()])


def _raises(a: np.ndarray) -> np.ndarray:
    raise KeyError("no such row")


@pytest.mark.parametrize(
    "fn, message",
    [
        (_raises, "host_op:_raises raised KeyError"),
        (lambda a: a[:16], "output 0 has shape (16, 32), it declares (32, 32)"),
        (lambda a: a.astype(np.float64), "output 0 has dtype float64, it declares FLOAT32"),
        (lambda a: (a, a), "returned 2 arrays, it declares 1"),
        (lambda a: 3.0, "returned float"),
        (lambda a: [a.tolist()], "output 0 is a list, not a numpy array"),
        (lambda a: a.__iadd__(1), "raised ValueError"),  # the inputs are read-only
    ],
)
async def test_failures_are_typed(submit_path: str, fn: Any, message: str) -> None:
    binary = _one_output(fn)
    x = _rng(3).standard_normal((32, 32)).astype(np.float32)
    async with tt.open_device(SMALL) as device:
        tx = tt.to_device(x, device)
        used = device.memory_used(tt.MemorySpace.DRAM)
        y, z = tt.submit(device, binary, 0, [tx])
        with pytest.raises(tt.HostOpError, match="host_op:") as info:
            await tt.to_host(y)
        assert message in str(info.value)
        assert info.value.op is not None and info.value.op.startswith("host_op:")
        if fn is _raises:  # the user's exception is kept, under the stored error
            causes = []
            link: BaseException | None = info.value
            while link is not None:
                causes.append(link)
                link = link.__cause__
            assert any(isinstance(c, KeyError) for c in causes)
        with pytest.raises(tt.HostOpError):
            await tt.to_host(z)  # every output of the program fails
        del y, z
        await device.synchronize()
        assert device.memory_used(tt.MemorySpace.DRAM) == used  # nothing leaked
        assert device.memory_used(tt.MemorySpace.L1) == 0
        # The device stays usable, and so does the input.
        ok = _one_output(lambda a: a * np.float32(2))
        y, z = tt.submit(device, ok, 0, [tx])
        np.testing.assert_array_equal(await tt.to_host(y), np.maximum(x, 0) * 2 + 1)
        np.testing.assert_array_equal(await tt.to_host(z), -x)


def test_read_only_inputs_keep_the_schedule_s_values() -> None:
    """A function may not change what it is given: later steps read the same value."""

    def sneaky(a: np.ndarray) -> np.ndarray:
        before = a.copy()
        try:
            a += 1  # would change the value the `sub` below reads
        except ValueError:
            pass
        return before

    b = tt.ProgramBuilder("sneaky")
    x = b.input((32, 32))
    r = b.relu(x)
    (y,) = b.host_op(sneaky, [r], outputs=[((32, 32), F32)])
    b.output(b.sub(y, r))
    x_host = _rng(4).standard_normal((32, 32)).astype(np.float32)
    (out,) = run_on_host(b.build(), [x_host])
    np.testing.assert_array_equal(out, np.zeros((32, 32), np.float32))


def test_builder_refusals() -> None:
    b = tt.ProgramBuilder("p")
    x = b.input((32, 32))
    other = tt.ProgramBuilder("q").input((32, 32))
    with pytest.raises(tt.ProgramError, match="callable"):
        b.host_op(3, [x], outputs=[((32, 32), F32)])
    with pytest.raises(tt.ProgramError, match="another program"):
        b.host_op(abs, [other], outputs=[((32, 32), F32)])
    with pytest.raises(tt.ProgramError, match="list of Values"):
        b.host_op(abs, x, outputs=[((32, 32), F32)])
    with pytest.raises(tt.ProgramError, match="non-empty list"):
        b.host_op(abs, [x], outputs=[])
    with pytest.raises(tt.ProgramError, match="pair"):
        b.host_op(abs, [x], outputs=[(32, 32)])
    with pytest.raises(tt.LayoutError, match="tt.Layout or tt.DataType"):
        b.host_op(abs, [x], outputs=[((32, 32), np.float32)])
    with pytest.raises(tt.ShapeError):
        b.host_op(abs, [x], outputs=[((0, 32), F32)])
    (y,) = b.host_op(abs, [x], outputs=[((32, 32), F32)], name="absolute")
    b.output(y)
    assert b.build().host_ops == ((0, "host_op:absolute"),)


def test_save_refuses_host_ops(tmp_path: Any) -> None:
    program, _ = _split_program()
    plain = tt.ProgramBuilder("plain")
    plain.output(plain.relu(plain.input((32, 32))))
    binary = tt.Binary([plain.build(), program])
    path = tmp_path / "model.ttb"
    with pytest.raises(tt.HostOpError, match=r"'split' cannot be saved: step 1 is host_op:split") as info:
        binary.save(path)
    assert info.value.op == "host_op:split"
    assert not path.exists()


def _sleepy_binary(seconds: float) -> tt.Binary:
    """x @ w, then a host op that sleeps `seconds` and adds one: the timeline's subject."""

    def nap(a: np.ndarray) -> np.ndarray:
        time.sleep(seconds)
        return a + np.float32(1)

    b = tt.ProgramBuilder("napping")
    x, w = b.input((40, 64)), b.input((64, 32))
    (y,) = b.host_op(nap, [b.matmul(x, w)], outputs=[((40, 32), F32)])
    b.output(b.relu(y))
    return tt.Binary([b.build()])


def _inside(child: dict[str, Any], parent: dict[str, Any]) -> bool:
    return (child["pid"], child["tid"]) == (parent["pid"], parent["tid"]) and \
        parent["ts"] <= child["ts"] and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + 1e-3


async def test_the_timeline_shows_each_host_op_as_its_own_slice_and_real_estimates() -> None:
    """A host op is a timed slice nested in its program's (and in a replay's), and the
    program's slice reports what the device does: the matmul's M*N*K multiply-accumulates and
    an estimate of microseconds, not the internal figure that keeps it off the event loop."""
    nap = 0.03
    binary = _sleepy_binary(nap)
    x = _rng(1).standard_normal((40, 64)).astype(np.float32)
    w = _rng(2).standard_normal((64, 32)).astype(np.float32)
    async with tt.open_device(SMALL) as device:
        tx, tw = tt.to_device(x, device), tt.to_device(w, device)
        await tx
        await tw
        with tt.record_timeline(device) as recorder:
            (out,) = tt.submit(device, binary, 0, [tx, tw])
            np.testing.assert_allclose(await tt.to_host(out), np.maximum(x @ w + 1, 0), rtol=1e-5, atol=1e-5)
            with tt.capture_trace(device) as trace:
                (replayed,) = tt.submit(device, binary, 0, [tx, tw])
            tt.execute_trace(trace)
            await replayed
            tt.release_trace(trace)
        events = recorder.events
        programs = [e for e in events if e.get("name") == "napping" and e.get("cat") == "ProgramCommand"]
        replays = [e for e in events if e.get("cat") == "ReplayCommand"]
        host = [e for e in events if e.get("cat") == "host op"]
        assert len(programs) == 2 and len(replays) == 1  # the submit and the capture's own run
        assert len(host) == 3 and {e["name"] for e in host} == {"host_op:nap"}
        for parent in (*programs, *replays):
            mine = [e for e in host if _inside(e, parent)]
            assert len(mine) == 1, parent
            assert mine[0]["dur"] >= nap * 1e6 * 0.99  # it slept that long, at least
        for program in programs:
            assert program["args"]["macs"] == 40 * 32 * 64
            assert 0 < program["args"]["estimated_us"] < 1e3
            assert program["args"]["host_ops"] == ["host_op:nap"]


async def test_a_replayed_host_op_never_runs_inline_wherever_it_stands() -> None:
    """A trace whose host op is in its first program (not its last) replays on the worker: the
    function blocks until the event loop lets it go, which an inline replay would deadlock on."""
    gate = _Gate(armed=False)  # the capture's own run goes through; the replay's waits
    plain = tt.ProgramBuilder("plain after")
    plain.output(plain.add(plain.input((32, 32)), 1.0))
    binary = tt.Binary([_gated_program("host first", gate), plain.build()])
    ones = np.ones((32, 32), np.float32)
    async with tt.open_device(SMALL, inline_seconds=1e6) as device:  # everything else inline
        tx = tt.to_device(ones, device)
        await tx
        with tt.capture_trace(device) as trace:
            (mid,) = tt.submit(device, binary, 0, [tx])
            (last,) = tt.submit(device, binary, 1, [mid])
        await last
        gate.armed.set()
        tt.execute_trace(trace)
        with anyio.fail_after(10):
            while not gate.started.is_set():
                await anyio.sleep(0.001)  # the loop runs while the function waits
        gate.release.set()
        np.testing.assert_array_equal(await tt.to_host(last), ones + 2)
        tt.release_trace(trace)


async def test_trace_replays_call_the_function(submit_path: str) -> None:
    calls: list[Any] = []
    program, _ = _split_program(calls)
    binary = tt.Binary([program])
    xs = [_rng(10 + k).standard_normal((40, 64)).astype(ml_dtypes.bfloat16) for k in range(3)]
    w = _rng(9).standard_normal((64, 32)).astype(np.float32)
    async with tt.open_device(SMALL) as device:
        slot = tt.to_device(xs[0], device, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, BF16))
        tw = tt.to_device(w, device)
        await slot
        with tt.capture_trace(device) as trace:
            out, sums = tt.submit(device, binary, 0, [slot, tw])
        for x in xs[1:]:
            tt.write(slot, x)
            tt.execute_trace(trace)
            expected = run_on_host(program, [x, w])
            np.testing.assert_array_equal(await tt.to_host(out), expected[0])
            np.testing.assert_array_equal(await tt.to_host(sums), expected[1])
        tt.release_trace(trace)
        assert len(calls) == 3 + 2  # the capture's run, two replays, two run_on_host


async def test_mesh_runs_the_function_per_chip(spmd_path: str) -> None:
    threads: list[int] = []

    def per_chip(a: np.ndarray) -> np.ndarray:
        threads.append(threading.get_ident())
        return (a - a.mean(axis=0, keepdims=True)).astype(np.float32)

    b = tt.ProgramBuilder("centre")
    x = b.input((32, 32))
    (y,) = b.host_op(per_chip, [b.mul(x, 2.0)], outputs=[((32, 32), F32)])
    b.output(b.relu(y))
    binary = tt.Binary([b.build()])
    x_host = _rng(5).standard_normal((64, 32)).astype(np.float32)
    async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=SMALL)) as mesh:
        tx = tt.to_device(x_host, mesh, mapper=tt.shard(0))
        (out,) = tt.submit(mesh, binary, 0, [tx])
        got = await tt.to_host(out, composer=tt.concat(0))
        shards = [x_host[:32] * 2, x_host[32:] * 2]
        expected = np.concatenate([np.maximum(s - s.mean(axis=0, keepdims=True), 0) for s in shards])
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        assert len(threads) == 2 and len(set(threads)) == 2  # once per chip, each on its own worker
