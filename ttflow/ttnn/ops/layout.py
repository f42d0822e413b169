"""Layout, memory and lifetime ops: what the runtime owns.

`to_layout` and `typecast` change bytes (tile or row-major, data type); in ttflow's IR a value's
tiling is the scheduler's, so only a dtype change emits a step. `deallocate`, `get_device`,
`to_memory_config`, `to_device` and `from_device` emit nothing: ttflow frees a value after its last
use (where the compiler's `deallocate` stands) and a value moved to the host and back is the same
value."""

from __future__ import annotations

from collections.abc import Sequence

from ..._ir.builder import Value
from ..lower import Lowering, Translator
from ..reader import TtnnOp


def _same(c: Lowering, op: TtnnOp) -> Sequence[Value | None]:
    (x,) = c.operands(op)
    return [x]  # a dtype change is the typecast `Lowering` adds when the result type asks for it


def _nothing(c: Lowering, op: TtnnOp) -> Sequence[Value | None]:
    c.operands(op)  # its operands must exist all the same
    return [None] * len(op.op.results)


TRANSLATORS: dict[str, Translator] = {
    "ttnn.to_layout": _same, "ttnn.assign": _same, "ttnn.typecast": _same, "ttnn.to_memory_config": _same,
    "ttnn.to_device": _same, "ttnn.from_device": _same, "ttnn.to_dtype": _same,
    "ttnn.deallocate": _nothing, "ttnn.get_device": _nothing,
}

READS: dict[str, frozenset[str]] = {
    **{name: frozenset() for name in TRANSLATORS},
    "ttnn.deallocate": frozenset({"force"}),  # ttflow frees after the last use whatever force says
}
