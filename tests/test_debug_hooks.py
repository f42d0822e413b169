"""Debug hooks (issue 27): every op of every program, seen, read and replaced, on asyncio and trio.

Against numpy: the values each op reads and writes, the run's outputs after a value is replaced
(the replaced value carried through the later ops as numpy computes them), and a program's
outputs untouched when hooks only look. The refusals are typed and leave the device usable:
a handle kept past its callback, a program input replaced, a second block, traces. Programs
decided after the block take the fast path again; inside it they never do.

Planted, each caught here: later ops reading the value as computed instead of as replaced
(`_HookedRun._read_replaced` a no-op: the replacement tests), hooks skipped for the programs
the fast decision takes (`ProgramCommand.decide` not checking `hooks`: every op test), a
handle kept alive after its callback (the refusal test).
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

import ttflow as tt

pytestmark = pytest.mark.anyio

F32, BF16 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE, RM = tt.TensorLayout.TILE, tt.TensorLayout.ROW_MAJOR


def mlp() -> tt.Binary:
    b = tt.ProgramBuilder("mlp")
    x, w = b.input((32, 64)), b.input((64, 32))
    with b.location("mlp.py:10 (fc)"):
        h = b.matmul(x, w)
    with b.location("mlp.py:11 (act)"):
        r = b.relu(h)
    b.output(b.add(r, 1.0))
    return tt.Binary([b.build()])


def arrays(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((64, 32)).astype(np.float32)


async def test_every_op_is_seen_in_order_with_its_values_and_location() -> None:
    xs, ws = arrays()
    seen: list[tuple[str, Any]] = []

    def pre_program(ctx: tt.ProgramContext) -> None:  # a plain function
        seen.append(("pre_program", ctx.program.name))

    async def pre_op(ctx: tt.OpContext) -> None:
        seen.append(("pre", ctx.index, ctx.name, ctx.loc, [await tt.to_host(h) for h in ctx.inputs]))

    async def post_op(ctx: tt.OpContext) -> None:
        seen.append(("post", ctx.index, [await tt.to_host(h) for h in ctx.outputs]))

    async def post_program(ctx: tt.ProgramContext) -> None:
        seen.append(("post_program", await tt.to_host(ctx.outputs[0])))

    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tx, tw = tt.to_device(xs, device), tt.to_device(ws, device)
        with tt.debug_hooks(device, pre_op=pre_op, post_op=post_op, pre_program=pre_program,
                            post_program=post_program):
            (y,) = tt.submit(device, mlp(), 0, [tx, tw])
            out = await tt.to_host(y)
    h = xs @ ws
    assert [entry[0] for entry in seen] == ["pre_program", "pre", "post", "pre", "post", "pre", "post", "post_program"]
    _, index, name, loc, (x_read, w_read) = seen[1]
    assert (index, name, loc) == (0, "matmul", "mlp.py:10 (fc)")
    np.testing.assert_array_equal(x_read, xs)
    np.testing.assert_array_equal(w_read, ws)
    np.testing.assert_allclose(seen[2][2][0], h, rtol=1e-5, atol=1e-5)
    assert seen[3][1:4] == (1, "relu", "mlp.py:11 (act)")
    np.testing.assert_array_equal(seen[3][4][0], seen[2][2][0])  # relu reads what matmul wrote
    np.testing.assert_array_equal(seen[4][2][0], np.maximum(seen[2][2][0], 0))
    assert seen[5][1:4] == (2, "add", None)
    np.testing.assert_array_equal(seen[7][1], out)
    np.testing.assert_array_equal(out, np.maximum(seen[2][2][0], 0) + 1)


async def test_a_replaced_value_is_what_later_ops_read() -> None:
    xs, ws = arrays(1)
    replacement = np.random.default_rng(2).standard_normal((32, 32)).astype(np.float32)

    async def post_op(ctx: tt.OpContext) -> None:
        if ctx.name == "matmul":
            tt.write(ctx.outputs[0], replacement)
            np.testing.assert_array_equal(await tt.to_host(ctx.outputs[0]), replacement)

    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tx, tw = tt.to_device(xs, device), tt.to_device(ws, device)
        with tt.debug_hooks(device, post_op=post_op):
            (y,) = tt.submit(device, mlp(), 0, [tx, tw])
            np.testing.assert_array_equal(await tt.to_host(y), np.maximum(replacement, 0) + 1)
        (z,) = tt.submit(device, mlp(), 0, [tx, tw])  # the block is over: nothing replaced
        np.testing.assert_allclose(await tt.to_host(z), np.maximum(xs @ ws, 0) + 1, rtol=1e-5, atol=1e-5)


async def test_a_bfloat16_value_replaced_is_rounded_as_stored() -> None:
    b = tt.ProgramBuilder("bf")
    x = b.input((32, 32), tt.Layout(DRAM, TILE, BF16))
    b.output(b.mul(b.exp(x), 2.0))
    binary = tt.Binary([b.build()])
    xs = np.random.default_rng(3).standard_normal((32, 32)).astype(np.float32)
    new = np.full((32, 32), 1.0 + 2.0**-10, np.float32)  # rounds to 1 in bfloat16

    def post_op(ctx: tt.OpContext) -> None:
        if ctx.name == "exp":
            tt.write(ctx.outputs[0], new)

    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tx = tt.to_device(xs, device, tt.Layout(DRAM, TILE, BF16))
        with tt.debug_hooks(device, post_op=post_op):
            (y,) = tt.submit(device, binary, 0, [tx])
            out = await tt.to_host(y)
    np.testing.assert_array_equal(out.astype(np.float32), np.full((32, 32), 2.0, np.float32))


async def test_programs_with_conversions_and_donation_under_hooks() -> None:
    """An input converted at the program's start (row-major DRAM into tiles in L1) and a donated
    input: the hooks read the converted value, the outputs equal numpy's."""
    b = tt.ProgramBuilder("step")
    w = b.input((64, 32), tt.Layout(L1, TILE, F32))
    g = b.input((64, 32), tt.Layout(DRAM, TILE, F32))
    b.output(b.sub(w, b.mul(g, 0.5)), tt.Layout(DRAM, TILE, F32), donates=g)
    binary = tt.Binary([b.build()])
    rng = np.random.default_rng(4)
    ws, gs = rng.standard_normal((2, 64, 32)).astype(np.float32)
    reads: list[np.ndarray] = []

    async def pre_op(ctx: tt.OpContext) -> None:
        if ctx.name == "sub":
            reads.append(await tt.to_host(ctx.inputs[0]))

    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tw = tt.to_device(ws, device, tt.Layout(DRAM, RM, F32))  # converted when the program starts
        tg = tt.to_device(gs, device, tt.Layout(DRAM, TILE, F32))
        with tt.debug_hooks(device, pre_op=pre_op):
            (y,) = tt.submit(device, binary, 0, [tw, tg])
            out = await tt.to_host(y)
        assert tg.is_deallocated
    np.testing.assert_array_equal(reads[0], ws)
    np.testing.assert_array_equal(out, ws - gs * np.float32(0.5))


async def test_hooks_keep_programs_off_the_fast_path_only_inside_the_block() -> None:
    xs, ws = arrays(5)
    b = tt.ProgramBuilder("tiny")
    b.output(b.add(b.input((32, 32), tt.Layout(DRAM, TILE, F32)), 1.0), tt.Layout(DRAM, TILE, F32))
    tiny = tt.Binary([b.build()])
    calls: list[int] = []
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        t = tt.to_device(xs[:, :32].copy(), device, tt.Layout(DRAM, TILE, F32))
        await tt.wait(tt.submit(device, tiny, 0, [t])[0])
        fast = device._scheduler.counters["fast_path_programs"]
        with tt.debug_hooks(device, post_op=lambda ctx: calls.append(ctx.index)):
            for _ in range(3):
                (y,) = tt.submit(device, tiny, 0, [t])
            await y
        assert calls == [0, 0, 0]
        assert device._scheduler.counters["fast_path_programs"] == fast
        for _ in range(3):
            (y,) = tt.submit(device, tiny, 0, [t])
        np.testing.assert_array_equal(await tt.to_host(y), xs[:, :32] + 1)
        assert device._scheduler.counters["fast_path_programs"] == fast + 3
        assert calls == [0, 0, 0]


async def test_misuse_is_typed_and_the_device_stays_usable() -> None:
    xs, ws = arrays(6)
    kept: list[tt.OpTensor] = []

    def keep(ctx: tt.OpContext) -> None:
        kept.append(ctx.outputs[0])

    def replace_input(ctx: tt.OpContext) -> None:
        tt.write(ctx.inputs[0], np.zeros((32, 64), np.float32))

    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tx, tw = tt.to_device(xs, device), tt.to_device(ws, device)
        with tt.debug_hooks(device, post_op=keep):
            await tt.submit(device, mlp(), 0, [tx, tw])[0]
            with pytest.raises(tt.DebugHookError, match="only inside the callback"):
                await tt.to_host(kept[-1])  # the last callback's, too
            with pytest.raises(tt.DebugHookError, match="only inside the callback"):
                tt.write(kept[0], np.zeros((32, 32), np.float32))
            with pytest.raises(tt.DebugHookError, match="one block at a time"):
                with tt.debug_hooks(device, post_op=keep):
                    pass
            with pytest.raises(tt.TraceError, match="debug hooks"):
                with tt.capture_trace(device):
                    pass
        with tt.debug_hooks(device, pre_op=replace_input):
            (y,) = tt.submit(device, mlp(), 0, [tx, tw])
            with pytest.raises(tt.DebugHookError, match="input of the program"):
                await y
        np.testing.assert_array_equal(await tt.to_host(tx), xs)  # the caller's tensor untouched

        def fail(ctx: tt.OpContext) -> None:
            raise RuntimeError("harness bug")

        with tt.debug_hooks(device, post_op=fail):
            (y,) = tt.submit(device, mlp(), 0, [tx, tw])
            with pytest.raises(RuntimeError, match="harness bug"):
                await y
        with tt.capture_trace(device) as trace:
            (y,) = tt.submit(device, mlp(), 0, [tx, tw])
            with pytest.raises(tt.TraceError, match="hooks and traces"):
                with tt.debug_hooks(device, post_op=keep):
                    pass
        await y
        with tt.debug_hooks(device, post_op=keep):
            with pytest.raises(tt.TraceError, match="debug hooks"):
                tt.execute_trace(trace)
        tt.release_trace(trace)
        (y,) = tt.submit(device, mlp(), 0, [tx, tw])
        np.testing.assert_allclose(await tt.to_host(y), np.maximum(xs @ ws, 0) + 1, rtol=1e-5, atol=1e-5)
        for t in (tx, tw, y):
            tt.deallocate(t)
        assert device.memory_used(DRAM) == 0 and device.memory_used(L1) == 0


async def test_hooks_on_a_mesh_see_every_chip() -> None:
    b = tt.ProgramBuilder("tp")
    x, w = b.input((32, 64)), b.input((64, 16))
    b.output(b.all_reduce(b.matmul(x, w)))
    binary = tt.Binary([b.build()])
    rng = np.random.default_rng(7)
    xs, ws = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((64, 32)).astype(np.float32)
    seen: list[tuple[int, str]] = []
    async with tt.open_mesh_device(tt.MeshSpec((1, 2), chip=tt.DeviceSpec.small())) as mesh:
        tx, tw = tt.to_device(xs, mesh), tt.to_device(ws, mesh, mapper=tt.shard(1))
        (plain,) = tt.submit(mesh, binary, 0, [tx, tw])
        want = await tt.to_host(plain, composer=tt.concat(1))
        with tt.debug_hooks(mesh, post_op=lambda ctx: seen.append((mesh.chips.index(ctx.device), ctx.name))):
            (y,) = tt.submit(mesh, binary, 0, [tx, tw])
            with anyio.fail_after(60):
                got = await tt.to_host(y, composer=tt.concat(1))
    assert sorted(seen) == [(0, "all_reduce"), (0, "matmul"), (1, "all_reduce"), (1, "matmul")]
    np.testing.assert_array_equal(got, want)  # the same bits as the run without hooks


def test_locations_survive_the_file_simplify_and_a_mesh_resolution(tmp_path: Any) -> None:
    b = tt.ProgramBuilder("located")
    x = b.input((32, 64))
    with b.location("model.py:1 (scale)"):
        y = b.mul(x, 2.0)
        with b.location("model.py:2 (inner)"):
            z = b.exp(y)
        dead = b.add(y, 1.0)  # removed by simplify: its location goes with it
    b.output(b.all_gather(b.add(z, 0.0), 0))
    program = b.build()
    assert dead.id in dict(program.locations)
    want = {"mul": "model.py:1 (scale)", "exp": "model.py:2 (inner)", "all_gather": None}
    path = tmp_path / "located.ttb"
    tt.Binary([program]).save(path)
    loaded = tt.Binary.load(path).programs[0]
    simplified = tt.simplify(program)
    from ttflow._ir.binary import for_mesh

    for p in (program, loaded, simplified, for_mesh(program, (1, 2))):
        locs = dict(p.locations)
        got = {step.op: locs.get(step.output) for step in p.steps if step.op in want}
        assert got == want, p
    with pytest.raises(tt.ProgramError, match="non-empty"):
        with tt.ProgramBuilder("fresh").location(""):
            pass


def test_every_op_takes_loc_as_mlir_builders_do() -> None:
    """`loc=` on an op call, as MLIR's Python builders take it beside a location context: it
    names that op's steps (a composite's too), wins over an enclosing `location` block for
    them alone, and is checked as the block's argument is."""
    import inspect

    b = tt.ProgramBuilder("located")
    x, w = b.input((32, 64)), b.input((64, 32))
    h = b.matmul(x, w, loc="mlp.py:10")
    with b.location("mlp.py:11 (block)"):
        s = b.softmax(h, axis=-1, loc="mlp.py:12")  # several steps, one location
        r = b.relu(s)
    (host,) = b.host_op(np.negative, [r], [((32, 32), F32)], loc="mlp.py:13")
    plain = b.add(host, 1.0)
    b.output(plain)
    program = b.build()
    locs = dict(program.locations)
    assert locs[h.id] == "mlp.py:10" and locs[r.id] == "mlp.py:11 (block)"
    assert locs[host.id] == "mlp.py:13" and plain.id not in locs
    softmax_steps = [st.output for st in program.steps if st.output not in (h.id, r.id, host.id, plain.id)]
    assert softmax_steps and {locs[i] for i in softmax_steps} == {"mlp.py:12"}
    with pytest.raises(tt.ProgramError, match="non-empty"):
        fresh = tt.ProgramBuilder("fresh")
        fresh.exp(fresh.input((1, 1)), loc="")
    # Every op method says so in its signature (what an editor and a type checker read).
    fresh = tt.ProgramBuilder("ops")
    skip = {"input", "output", "build", "location", "checking_range", "placing", "cache_constants"}
    ops = [n for n in dir(fresh) if not n.startswith("_") and n not in skip
           and callable(getattr(fresh, n)) and n != "mesh_shape"]
    assert len(ops) > 70
    for name in ops:
        param = inspect.signature(getattr(fresh, name)).parameters.get("loc")
        assert param is not None and param.kind is param.KEYWORD_ONLY and param.default is None, name


def test_ttflow_golden_on_a_file(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from ttflow.cli import main

    path = tmp_path / "mlp.ttb"
    mlp().save(path)
    assert main(["golden", str(path), "--small"]) == 0
    out = capsys.readouterr().out
    assert "mlp.py:10 (fc)" in out and "matmul" in out and " NO " not in out
    assert main(["golden", str(path), "--small", "--json", "--substitute", "--seed", "3"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["substitute"] is True and [op["name"] for op in data["ops"]] == ["matmul", "relu", "add"]
    for usage in (["golden", str(tmp_path / "missing.ttb")], ["golden", str(path), "--program", "4", "--small"]):
        with pytest.raises(SystemExit) as exited:  # usage errors exit 2, as argparse's do
            main(usage)
        assert exited.value.code == 2


async def test_a_host_op_under_hooks_and_golden_and_never_on_the_loop() -> None:
    """A host op is named by its label in hooks and golden rows, and runs off the event loop
    even when the device's inline threshold would run everything inline."""
    import math
    import threading

    loop_thread: list[int] = []
    fn_threads: list[int] = []

    def double(a: np.ndarray) -> np.ndarray:
        fn_threads.append(threading.get_ident())
        return (a * 2).astype(np.float32)

    b = tt.ProgramBuilder("hosted")
    x = b.input((32, 32))
    (h,) = b.host_op(double, [b.exp(x)], outputs=[((32, 32), F32)], name="double")
    b.output(b.add(h, 1.0))
    binary = tt.Binary([b.build()])
    xs = np.random.default_rng(8).standard_normal((32, 32)).astype(np.float32) / 4
    names: list[str] = []
    async with tt.open_device(tt.DeviceSpec.small(), inline_seconds=math.inf) as device:
        loop_thread.append(threading.get_ident())
        t = tt.to_device(xs, device)
        with tt.debug_hooks(device, post_op=lambda ctx: names.append(ctx.name)):
            out = await tt.to_host(tt.submit(device, binary, 0, [t])[0])
        report = await tt.compare_with_golden(device, binary, 0, [t])
        fn_threads.clear()
        (y,) = tt.submit(device, binary, 0, [t])  # no hooks: the plain path, threshold infinite
        plain = await tt.to_host(y)
    assert names == ["exp", "host_op:double", "add"]
    assert [row.name for row in report.ops] == ["exp", "host_op:double", "add"] and report.ok
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_allclose(plain, np.exp(xs) * 2 + 1, rtol=1e-6)
    assert fn_threads and loop_thread[0] not in fn_threads
