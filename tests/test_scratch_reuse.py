"""A program's scratch is reused once a value's last reader has run (`Plan.scratch_slot`), as a
compiled program's `ttnn.deallocate` frees a result at its point: fewer storages, and every
value still what it was made as whenever something reads it.

Checked through debug hooks, whose handles read the banks: before each op, every input as
stored must equal what its producer stored (its post_op read), on a chain that reads an early
value late and on random programs. Planted, each caught by both tests: a slot freed at its own
step (not after its last reader); one free at its last reader's step (taken by that step's own
result, which post_op's read of the inputs sees).
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
from hypothesis import given, settings

import ttflow as tt
from ttflow._commands import Plan
from ttflow.testing import ProgramCase, program_cases

F32 = np.float32


def _chain() -> tt.Program:
    b = tt.ProgramBuilder("late_reader")
    x = b.input((64, 64))
    a = b.mul(x, 2.0)
    c = b.mul(b.add(a, 1.0), 3.0)
    d = b.sub(c, b.exp(b.neg(c)))
    b.output(b.add(d, a))  # `a` read last: its storage must hold it until here
    return b.build()


def _numpy(x: np.ndarray) -> np.ndarray:
    a = x * F32(2)
    c = (a + F32(1)) * F32(3)
    return (c - np.exp(-c)) + a


async def _run_checked(program: tt.Program, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Runs `program` under hooks that read every op's inputs before it and its inputs and
    output after it, each against what its producer stored."""
    made: dict[int, np.ndarray] = {}

    def check_inputs(ctx: tt.OpContext) -> None:
        step = ctx.program.steps[ctx.index]
        for value, handle in zip(step.inputs, ctx.inputs):
            if value in made:
                assert handle.read().tobytes() == made[value].tobytes(), (
                    f"op {ctx.index} ({ctx.name}) reads value {value} changed since it was made")

    async def pre_op(ctx: tt.OpContext) -> None:
        check_inputs(ctx)

    async def post_op(ctx: tt.OpContext) -> None:
        check_inputs(ctx)
        made[ctx.program.steps[ctx.index].output] = ctx.outputs[0].read().copy()

    async with tt.open_device(tt.DeviceSpec.small()) as device:
        tensors = [tt.to_device(x, device) for x in inputs]
        with tt.debug_hooks(device, pre_op=pre_op, post_op=post_op):
            outs = tt.submit(device, tt.Binary([program]), 0, tensors)
            results = [await tt.to_host(o) for o in outs]
        # and without hooks (the plain run), the same values
        plain = [await tt.to_host(o) for o in tt.submit(device, tt.Binary([program]), 0, tensors)]
        for a, b in zip(results, plain, strict=True):
            assert a.tobytes() == b.tobytes()
    return results


def test_a_chain_shares_storages_and_reads_each_value_intact() -> None:
    program = _chain()
    plan = Plan(program)
    assert len(plan.scratch) < len(plan.scratch_slot)  # storages were shared
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(F32)
    for backend in ("asyncio", "trio"):
        (out,) = anyio.run(_run_checked, program, [x], backend=backend)
        np.testing.assert_allclose(out, _numpy(x), rtol=1e-6, atol=1e-6)


@settings(deadline=None, max_examples=40)
@given(program_cases())
def test_random_programs_read_each_value_intact(case: ProgramCase) -> None:
    results: Any = anyio.run(_run_checked, case.program, list(case.inputs))
    case.check(results)
