"""A TTNN file's programs as ttflow programs: each op's translator emits builder calls, and every
result is checked against the shape and data type the compiler's MLIR gives it.

The check is what keeps a translation honest: a translator that gets an attribute's meaning wrong
(an axis, a transpose, a padding order) almost always produces a different shape, and a refused
shape is a ProgramError at load naming the op, its MLIR text and its location, never a wrong value
at run time. Where the builder's dtype rule gives another dtype than the compiler's (a comparison
of floats is bool, printed bf16, in TTNN; argmax is ui32), the result is typecast to the
compiler's, as the device would hold it.

What runs where:
- `main` and every public program become one ttflow program each, in the file's order, with the
  file's names; a const-eval function called through `ttcore.load_cached` is inlined at its call,
  its inputs declared const when the module marks them parameters or constants, and the program
  caches its constants (`ProgramBuilder.cache_constants`), so the runtime's const-eval cache runs
  it once per device and parameter set (tt-mlir's `load_cached`).
- every step an op emits is placed where the compiler put its result (`ProgramBuilder.placing`:
  DRAM only, or L1 while it fits), the addresses left to ttflow's allocator;
- `ttnn.deallocate`, `get_device` and memory moves (`to_memory_config`, `to_device`,
  `from_device`) emit nothing: ttflow frees a value after its last use, which is where the
  compiler deallocates it (a program's scratch is held until it ends: the compiler's own plan is
  checked at load, `plan.py`).
- a rank-0 tensor is held as shape (1,) (ttflow's tensors have rank >= 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, final

from .._errors import ProgramError
from .._ir.builder import ProgramBuilder, Value
from .._ir.program import Program
from .._types import DataType, Layout, MemorySpace, TensorLayout
from . import mlir
from .reader import TtnnFile, TtnnOp, TtnnProgram, TtnnTensor

__all__ = ["Lowering", "dtype_of", "lower_file", "ttflow_shape"]

_DTYPES = {
    "f32": DataType.FLOAT32, "bf16": DataType.BFLOAT16, "bfp_bf8": DataType.BFLOAT8_B,
    "si32": DataType.INT32, "i32": DataType.INT32, "ui32": DataType.UINT32,
    # ttflow has no 16- or 8-bit integers or bool: they are held widened, values unchanged
    # (sort's u16 indices, bool masks the compiler prints as bf16 already).
    "ui16": DataType.UINT32, "u16": DataType.UINT32, "ui8": DataType.UINT32, "u8": DataType.UINT32,
    "i1": DataType.BFLOAT16,
}


def dtype_of(element: str | None, where: str) -> DataType:
    if element in _DTYPES:
        return _DTYPES[element]
    raise ProgramError(f"{where}: data type {element!r} has no ttflow equivalent")


def ttflow_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(shape) if len(shape) else (1,)


def layout_of(t: TtnnTensor, where: str) -> Layout:
    """The ttflow layout of a program input or output as its TensorRef describes it. System memory
    (a host tensor in tt-mlir) is given as DRAM row-major: ttflow's inputs are device tensors, and
    `tt.to_device` of a numpy array is how a host tensor arrives."""
    memory = MemorySpace.L1 if t.buffer in ("l1", "l1_small") else MemorySpace.DRAM
    tiled = TensorLayout.TILE if t.tiled else TensorLayout.ROW_MAJOR
    dtype = dtype_of(t.data_type, where)
    if dtype is DataType.BFLOAT8_B and not t.tiled:
        dtype = DataType.BFLOAT16
    return Layout(memory, tiled, dtype)


Translator = Callable[["Lowering", TtnnOp], Sequence[Value | None]]

PLACEMENT = frozenset({
    "compute_config", "matmul_program_config", "memory_config", "config_tensors_in_dram",
    "reallocate_halo_output", "use_multicore", "mesh_offset", "mesh_shape", "dtype", "layout",
    "output_dtype", "in_place_halo", "applied_shard_scheme", "sub_core_grids", "num_links",
})
"""Attributes that place an op or pick its kernels on silicon (its core grid, program config,
memory config, the result's data type and layout, which the result's MLIR type states and the
translation enforces), never its value: no translation needs to read them. The compute config's
math fidelity does change a value on silicon; ttflow computes at full fidelity (docs/compiler.md)."""


@final
class Lowering:
    """The state of one program's translation: the builder, and each SSA name's value."""

    def __init__(self, file: TtnnFile, program: TtnnProgram, translators: dict[str, Translator],
                 reads: dict[str, frozenset[str]]) -> None:
        self.file, self.program, self.translators, self.reads = file, program, translators, reads
        mesh = program.mesh_shape if program.mesh_shape not in (None, (1, 1)) else None
        self.b = ProgramBuilder(program.name, mesh_shape=mesh)
        self.values: dict[str, Value | None] = {}
        self.input_values: list[Value] = []
        self.consts: set[int] = set()
        self.functions = {p.name: p for p in file.programs}
        self.op: TtnnOp | None = None

    # what translators call ----------------------------------------------------------------------
    def refuse(self, why: str, op: TtnnOp | None = None) -> ProgramError:
        op = op or self.op
        assert op is not None
        return ProgramError(
            f"ttflow cannot run {op.name} (op {op.index} of {self.program.name!r}, at {op.source}): {why}\n"
            f"  {op.op.text[:600]}"
        )

    def operands(self, op: TtnnOp) -> list[Value]:
        out = []
        for name, t in zip(op.op.operands, op.op.operand_types, strict=True):
            if t.shape is None:  # the device handle
                continue
            value = self.values.get(name)
            if value is None:
                raise self.refuse(f"operand {name} is not defined before it is used", op)
            out.append(value)
        return out

    def result_dtype(self, op: TtnnOp, i: int = 0) -> DataType:
        return dtype_of(op.op.result_types[i].element, f"{op.name} result {i}")

    def result_shape(self, op: TtnnOp, i: int = 0) -> tuple[int, ...]:
        shape = op.op.result_types[i].shape
        if shape is None:
            raise self.refuse(f"result {i} is not a tensor", op)
        return ttflow_shape(shape)

    def _memory(self, op: TtnnOp) -> MemorySpace:
        return _memory_of(op)

    # the walk -----------------------------------------------------------------------------------
    def declare_inputs(self, const_inputs: set[int]) -> None:
        self.consts = const_inputs
        for i, (name, t) in enumerate(zip(self.program.arguments, self.program.inputs, strict=True)):
            layout = layout_of(t, f"{self.program.name} input {i}")
            value = self.b.input(ttflow_shape(t.shape), layout, const=i in const_inputs)
            self.values[name] = value
            self.input_values.append(value)

    def run_ops(self, program: TtnnProgram, arguments: Sequence[Value]) -> list[Value]:
        """Emit `program`'s ops with its arguments bound to `arguments` (a call inlines this way);
        returns the values it returns."""
        outer = self.values
        if program is not self.program:
            self.values = dict(zip(program.arguments, arguments, strict=True))
        try:
            for op in program.ops:
                self._emit(op)
            missing = [r for r in program.results if self.values.get(r) is None]
            if missing:
                raise ProgramError(f"{program.name!r} returns {missing}, which no op of it defines")
            return [v for r in program.results if (v := self.values[r]) is not None]
        finally:
            if program is not self.program:
                self.values = outer

    def _emit(self, op: TtnnOp) -> None:
        translator = self.translators.get(op.name)
        if translator is None:
            raise self.refuse("no translation of this op into ttflow's op set (yet)", op)
        unknown = sorted(set(op.op.attributes) - self.reads.get(op.name, frozenset()) - PLACEMENT)
        if unknown:
            raise self.refuse(f"attribute(s) {unknown}: its translation does not read them, and they may "
                              "change its value", op)
        outer, self.op = self.op, op
        try:
            with self.b.location(op.location), self.b.placing(self._memory(op)):
                try:
                    results = list(translator(self, op))
                except ProgramError as exc:
                    if str(exc).startswith("ttflow cannot run"):
                        raise
                    raise self.refuse(f"{type(exc).__name__}: {exc}", op) from exc
                except (ValueError, TypeError) as exc:  # ShapeError and LayoutError are ValueErrors
                    raise self.refuse(f"{type(exc).__name__}: {exc}", op) from exc
                if len(results) != len(op.op.results):
                    raise self.refuse(f"its translation gave {len(results)} results, the op has {len(op.op.results)}", op)
                for i, (name, value) in enumerate(zip(op.op.results, results, strict=True)):
                    t = op.op.result_types[i]
                    if value is None:
                        if t.shape is not None:
                            raise self.refuse(f"result {name} is a tensor its translation did not give", op)
                        self.values[name] = None
                        continue
                    want = ttflow_shape(t.shape) if t.shape is not None else None
                    if value.shape != want:
                        raise self.refuse(
                            f"its translation gives shape {value.shape} for {name}, the compiler's type says {want}", op)
                    dtype = self.result_dtype(op, i)
                    if value.dtype is not dtype:
                        value = self.b.typecast(value, dtype)
                    self.values[name] = value
        finally:
            self.op = outer


def _memory_of(op: TtnnOp) -> MemorySpace:
    """Where the compiler put the op's result: L1 for an L1 buffer, DRAM for DRAM (and for a
    system-memory one: ttflow keeps no host tensors inside a program)."""
    for t in op.op.result_types:
        if t.shape is not None:
            return MemorySpace.L1 if t.buffer in ("l1", "l1_small") else MemorySpace.DRAM
    return MemorySpace.DRAM


def _const_inputs(file: TtnnFile, program: TtnnProgram) -> set[int]:
    """Inputs the module marks parameters or constants that a const-eval call reads."""
    read: set[str] = set()
    for op in program.ops:
        if op.op.callee is not None:
            read.update(op.op.operands)
    return {i for i, (name, t) in enumerate(zip(program.arguments, program.inputs, strict=True))
            if name in read and t.argument_type in ("parameter", "constant")}


def lower_program(file: TtnnFile, program: TtnnProgram, translators: dict[str, Translator],
                  reads: dict[str, frozenset[str]]) -> Program:
    lowering = Lowering(file, program, translators, reads)
    lowering.declare_inputs(_const_inputs(file, program))
    if any(op.op.callee is not None for op in program.ops):
        # tt-mlir's load_cached: what a const-eval function computes runs once per device, its
        # results kept, counted as ttflow's const-eval cache counts (the functions this compiler
        # writes take no argument or the program's parameters)
        lowering.b.cache_constants()
    results = lowering.run_ops(program, [])
    donors = {t.aliases_output: j for j, t in enumerate(program.inputs) if t.aliases_output is not None}
    for i, (value, t) in enumerate(zip(results, program.outputs, strict=True)):
        if value.shape != ttflow_shape(t.shape):
            raise ProgramError(f"{program.name!r} output {i} has shape {value.shape}, its TensorRef {t.shape}")
        donor = donors.get(i)
        if donor is not None and donor not in lowering.consts:
            given = lowering.input_values[donor]
            if given.shape == value.shape and given.dtype is value.dtype and value.id != given.id:
                # JAX's donation (`tf.aliasing_output`): the output takes the input's buffer, in the
                # input's layout (a donated buffer keeps its layout), so a cache is updated in place.
                lowering.b.output(value, donates=given)
                continue
        lowering.b.output(value, layout_of(t, f"{program.name} output {i}"))
    return lowering.b.build()


def lower_file(file: TtnnFile, translators: dict[str, Translator],
               reads: dict[str, frozenset[str]]) -> list[Program]:
    """Every program of the file, in its order; a const-eval function is a program of its own
    (ttrt runs it by index) and is also inlined where `load_cached` calls it."""
    def call(lowering: Lowering, op: TtnnOp) -> list[Any]:
        callee = lowering.functions.get(op.op.callee or "")
        if callee is None:
            raise lowering.refuse(f"it calls {op.op.callee!r}, which the binary does not hold", op)
        return lowering.run_ops(callee, lowering.operands(op))

    translators = {**translators, "ttcore.load_cached": call}
    return [lower_program(file, p, translators, {**reads, "ttcore.load_cached": frozenset()})
            for p in file.programs]

