"""Control flow: `ttcore.case` (jax.lax.cond, switch) and `ttcore.while_loop` with static bounds
(jax.lax.scan, fori_loop), both over programs of the binary.

ttflow's programs are straight-line, so a case computes every branch (inlined, as load_cached's
functions are) and keeps the one its index selects, per element of the result, with stablehlo's
rule that an index out of range takes the last branch; the branches have no side effects, so the
value is the taken branch's. A counted loop is unrolled: its body inlined once per iteration
from `initial` to `limit` by `step`, the state threaded through, the invariant operands passed to
every iteration. A loop too long to unroll is refused by its size."""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..._ir.builder import Value
from ..lower import Lowering, Translator
from ..mlir import attr_int, attr_ints, split_top
from ..reader import TtnnOp

MAX_UNROLLED_OPS = 20_000  # iterations x body ops a loop may unroll to


def _program(c: Lowering, op: TtnnOp, name: str) -> object:
    program = c.functions.get(name.lstrip("@"))
    if program is None:
        raise c.refuse(f"it names {name}, which the binary does not hold")
    return program


def _case(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    index, *args = c.operands(op)
    text = op.op.attributes.get("branch_programs", "")
    branches = [b.strip() for b in split_top(text.strip()[1:-1])] if text.startswith("[") else []
    if not branches:
        raise c.refuse("a case with no branch programs")
    results = [c.run_ops(_program(c, op, b), args) for b in branches]  # type: ignore[arg-type]
    if any(len(r) != len(op.op.results) for r in results):
        raise c.refuse("a branch returns another number of results than the case")
    chosen = list(results[-1])  # out of range: the last branch
    for k in range(len(branches) - 2, -1, -1):
        taken = c.b.eq(index, float(k))
        chosen = [c.b.where(taken, mine, other) for mine, other in zip(results[k], chosen, strict=True)]
    return chosen


def _bound(c: Lowering, op: TtnnOp, key: str) -> int:
    m = re.fullmatch(r"#ttcore\.loop_bound<(-?\d+)>", op.op.attributes.get(key, ""))
    if not m:
        raise c.refuse(f"{key} is not a static loop bound")
    return int(m[1])


def _while_loop(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    operands = c.operands(op)
    body = _program(c, op, op.op.attributes.get("body_program", ""))
    count = attr_int(op.op, "state_count")
    state, invariant = list(operands[:count]), operands[count:]
    steps = range(_bound(c, op, "initial"), _bound(c, op, "limit"), _bound(c, op, "step") or 1)
    if len(steps) * len(body.ops) > MAX_UNROLLED_OPS:  # type: ignore[attr-defined]
        raise c.refuse(f"{len(steps)} iterations of {len(body.ops)} ops: past {MAX_UNROLLED_OPS} unrolled")  # type: ignore[attr-defined]
    for _ in steps:
        new = c.run_ops(body, [*state, *invariant])  # type: ignore[arg-type]
        if len(new) < count:
            raise c.refuse(f"its body returns {len(new)} values for {count} of state")
        state = list(new[:count])
    outputs = attr_ints(op.op, "output_indices", default=list(range(len(op.op.results))))
    if len(outputs) != len(op.op.results) or any(not 0 <= k < count for k in outputs):
        raise c.refuse(f"output_indices {outputs} do not name its state")
    return [state[k] for k in outputs]


TRANSLATORS: dict[str, Translator] = {"ttcore.case": _case, "ttcore.while_loop": _while_loop}

READS: dict[str, frozenset[str]] = {
    "ttcore.case": frozenset({"branch_programs"}),
    "ttcore.while_loop": frozenset({"body_program", "initial", "limit", "step", "state_count", "output_indices"}),
}
