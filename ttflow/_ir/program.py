"""The IR: a program's values (`TensorSpec`), its steps in execution order (`Step`), and the
built, immutable `Program` that a front-end compiles and the device runs. `ProgramBuilder`
(`builder.py`) makes one; `interpreter.run_on_host` is its reference run.
"""

from __future__ import annotations

from typing import Any, final

import attrs

from .footprint import program_footprint
from .record import HOST_OP, REGISTRY, Kind
from .._types import DataType, DeviceSpec, Layout, MemorySpace

__all__ = ["TensorSpec", "Step", "Program"]


@final
@attrs.frozen
class TensorSpec:
    """A value's static type: its shape and layout (the layout's dtype is always set)."""

    shape: tuple[int, ...]
    layout: Layout

    @property
    def dtype(self) -> DataType:
        assert self.layout.dtype is not None
        return self.layout.dtype

@final
@attrs.frozen
class Step:
    """One op, in execution order: `output = op(*inputs[, scalar], **attrs)`."""

    op: str
    inputs: tuple[int, ...]
    scalar: float | None
    attrs: tuple[tuple[str, Any], ...]
    output: int

@final
@attrs.frozen(eq=False, repr=False)
class Program:
    """A built program. Value ids 0..len(inputs)-1 are the inputs, in order."""

    name: str
    values: tuple[TensorSpec, ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    output_specs: tuple[TensorSpec, ...]
    num_inputs: int
    donations: tuple[tuple[int, int], ...] = ()
    """(output index, input index) pairs: that output reuses that input's buffer (`donates=`)."""
    range_checks: tuple[tuple[int, str], ...] = ()
    """(value id, note) pairs: the steps the emulator checks (`ProgramBuilder.checking_range`):
    an integer result that would wrap, a division by zero or an index out of range fails the run
    with a ProgramError that begins with the note."""
    mesh_shape: tuple[int, int] | None = None
    """The (rows, cols) of the mesh its collectives' shapes were resolved for (`ProgramBuilder`'s
    `mesh_shape`), or None: a program without collectives, or one built for a group of one
    chip. A submit resolves them again for the mesh it runs on (`_ir.binary.for_mesh`)."""
    consts: tuple[int, ...] = ()
    """The indices of the inputs declared constant (`ProgramBuilder.input(..., const=True)`): the
    steps that depend only on them run once per (program, constant tensors) and their results
    are kept on the device until a constant changes (`_const_eval`)."""
    locations: tuple[tuple[int, str], ...] = ()
    """(value id, location) pairs: where the step that makes the value came from, as MLIR
    locations say (`ProgramBuilder.location`: a source line, an FX node); debug hooks and
    golden reports name ops by it."""
    cache_constants: bool = False
    """Whether the steps that read no input (values made from attributes alone: full, arange,
    constant) are cut out and run once per device like the steps of constant inputs, their
    results kept (`ProgramBuilder.cache_constants`: tt-mlir's `load_cached` of an argument-less
    const-eval function)."""
    placements: tuple[tuple[int, MemorySpace], ...] = ()
    """(value id, memory) pairs: where the program's author (a compiler's plan) put a step's
    value (`ProgramBuilder.placing`). DRAM: it is stored in DRAM only; L1: in L1 while it fits,
    DRAM when L1 is full (a program's scratch is held for the whole program). Values without one
    are placed by the scheduler (L1 first)."""

    inputs: tuple[TensorSpec, ...] = attrs.field(init=False, eq=False)
    host_ops: tuple[tuple[int, str], ...] = attrs.field(init=False, eq=False)
    """(step index, `host_op:<name>`) of each host op (`ProgramBuilder.host_op`), at the step
    that calls its function (its first output's)."""
    has_collectives: bool = attrs.field(init=False, eq=False)
    """Whether a step exchanges values with other chips (a collective: `Kind.COLLECTIVE`)."""

    def __attrs_post_init__(self) -> None:
        # Derived once (a checked submit reads them on every call, `for_mesh` too).
        init = object.__setattr__
        init(self, "inputs", self.values[: self.num_inputs])
        init(self, "host_ops", tuple((index, step.attrs[0][1].label) for index, step in enumerate(self.steps)
                                     if step.op == HOST_OP and dict(step.attrs)["index"] == 0))
        init(self, "has_collectives", any(step.op in REGISTRY and REGISTRY[step.op].kind is Kind.COLLECTIVE
                                          for step in self.steps))

    def last_use(self) -> tuple[int, ...]:
        """For each value id, the index of the last step that reads it, so the runtime can free
        intermediates early: `len(steps)` for a program output (kept to the end), -1 for a value
        nothing reads (an unused input, or a dead step result: free it right after its step)."""
        last = [-1] * len(self.values)
        for index, step in enumerate(self.steps):
            for value in step.inputs:
                last[value] = index
        for value in self.outputs:
            last[value] = len(self.steps)
        return tuple(last)

    def l1_footprint(self, spec: DeviceSpec | None = None) -> int:
        """Bytes of L1 circular buffers each core needs while the program runs (sized from
        its ops' tile counts as tt-metal's op factories size them; see `_footprint`). The
        runtime holds them at the bottom of L1 during the run, beside the program's outputs
        and intermediates, and moves L1 buffers that are in the way first."""
        return program_footprint(self.values, self.steps, spec if spec is not None else DeviceSpec())

    def same_as(self, other: Program) -> bool:
        """Field-by-field equality (programs hash by identity, so the runtime can cache plans)."""
        return attrs.astuple(self, recurse=False) == attrs.astuple(other, recurse=False)

    def __repr__(self) -> str:
        def spec(s: TensorSpec) -> str:
            return f"{s.shape} {s.dtype.name} {s.layout.memory.name} {s.layout.tensor_layout.name}"

        ins = ", ".join(spec(s) for s in self.inputs)
        outs = ", ".join(spec(s) for s in self.output_specs)
        return f"<Program {self.name!r} ({ins}) -> ({outs}), {len(self.steps)} steps>"
