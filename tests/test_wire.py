"""The wire form of a plan (`ttflow._workers.wire`): what a worker process or a Ray actor gets."""

from __future__ import annotations

import pickle

import ttflow as tt
from ttflow._commands import Plan
from ttflow._workers.wire import plan_from_state, plan_state

F32, BF16 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16
DRAM, L1, TILE = tt.MemorySpace.DRAM, tt.MemorySpace.L1, tt.TensorLayout.TILE


def test_every_field_of_a_plan_crosses_the_wire() -> None:
    """A plan as a worker gets it (`plan_state`, pickled, `plan_from_state`) equals the host's,
    field by field: a pagewise one (its page kernels, which do not pickle, found again by op
    name) and a general one. A new `Plan` field that does not pickle or is not rebuilt fails
    here, not as a record silently kept in the host (or refused on a Ray device)."""
    b = tt.ProgramBuilder("pages")
    x = b.input((64, 64), tt.Layout(DRAM, TILE, F32))
    b.output(b.relu(b.sub(b.mul(x, x), 0.5)), tt.Layout(DRAM, TILE, F32))
    pages = Plan(b.build())
    b = tt.ProgramBuilder("general")
    x = b.input((64, 96), tt.Layout(DRAM, TILE, F32))
    b.output(b.softmax(b.matmul(x, b.input((96, 32), tt.Layout(L1, TILE, BF16))), axis=-1))
    general = Plan(b.build())
    assert pages.pagewise and pages.page_ops and not general.pagewise
    for plan in (pages, general):
        copy = plan_from_state(pickle.loads(pickle.dumps(plan_state(plan))))
        for name in Plan.__slots__:
            if name not in ("bound", "schedule"):
                assert getattr(copy, name) == getattr(plan, name), name
        assert [op.opcode for op in copy.page_ops] == [op.opcode for op in plan.page_ops]
