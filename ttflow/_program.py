"""Programs: what a front-end compiles and the device runs, and the binary file that holds them.

`ProgramBuilder` records ops in execution order and checks shapes and dtypes as each op is
called, so a malformed program fails where it is written, not when it runs.

Dtype rules. A binary op on two float values gives the wider float (FLOAT32 > BFLOAT16 >
BFLOAT8_B); two equal integer dtypes keep it; mixing integers and floats, or INT32 with UINT32,
raises LayoutError (use `typecast`). With a Python scalar operand the dtype is the value's.
Transcendental ops (gelu, exp, softmax, sqrt, reciprocal) need floats. A program input always
has a concrete dtype: FLOAT32 when its layout leaves it out.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Sequence
from typing import Any, final

import attrs
import numpy as np

from ._errors import BinaryFormatError, LayoutError, ProgramError, ShapeError
from ._ops import OPS
from ._types import DataType, Layout, MemorySpace, TensorLayout, check_shape

__all__ = ["TensorSpec", "Step", "Program", "Binary", "ProgramBuilder", "Value", "get_layout"]

_DEFAULT_LAYOUT = Layout(MemorySpace.DRAM, TensorLayout.TILE)
_FLOAT_RANK = {DataType.BFLOAT8_B: 0, DataType.BFLOAT16: 1, DataType.FLOAT32: 2}


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

    inputs: tuple[TensorSpec, ...] = attrs.field(init=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "inputs", self.values[: self.num_inputs])

    def same_as(self, other: Program) -> bool:
        """Field-by-field equality (programs hash by identity, so the runtime can cache plans)."""
        return attrs.astuple(self, recurse=False) == attrs.astuple(other, recurse=False)

    def __repr__(self) -> str:
        def spec(s: TensorSpec) -> str:
            return f"{s.shape} {s.dtype.name} {s.layout.memory.name} {s.layout.tensor_layout.name}"

        ins = ", ".join(spec(s) for s in self.inputs)
        outs = ", ".join(spec(s) for s in self.output_specs)
        return f"<Program {self.name!r} ({ins}) -> ({outs}), {len(self.steps)} steps>"


@final
class Value:
    """A value inside a program being built; pass it to the builder's ops."""

    __slots__ = ("builder", "id", "shape", "dtype")

    def __init__(self, builder: ProgramBuilder, vid: int, shape: tuple[int, ...], dtype: DataType) -> None:
        self.builder = builder
        self.id = vid
        self.shape = shape
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"<Value %{self.id} {self.shape} {self.dtype.name}>"


def _result_dtype(op: str, a: DataType, b: DataType) -> DataType:
    if a.is_float and b.is_float:
        return a if _FLOAT_RANK[a] >= _FLOAT_RANK[b] else b
    if a is b:
        return a
    raise LayoutError(f"{op}: cannot mix {a.name} and {b.name}; typecast one operand first")


def _normalise_axis(op: str, axis: int, rank: int) -> int:
    if not isinstance(axis, (int, np.integer)) or not -rank <= axis < rank:
        raise ShapeError(f"{op}: axis {axis!r} is out of range for rank {rank}")
    return int(axis) % rank


@final
class ProgramBuilder:
    """Records a program op by op; `build()` returns the immutable `Program`."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ProgramError("a program needs a non-empty name")
        self.name = name
        self._values: list[TensorSpec] = []
        self._steps: list[Step] = []
        self._outputs: list[tuple[int, TensorSpec]] = []
        self._num_inputs = 0
        self._built = False

    # -- plumbing -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._built:
            raise ProgramError(f"program {self.name!r} was already built; start a new builder")

    def _value(self, op: str, v: Any) -> Value:
        if not isinstance(v, Value):
            raise ProgramError(f"{op}: expected a Value of this builder, got {type(v).__name__}")
        if v.builder is not self:
            raise ProgramError(f"{op}: the value belongs to another program ({v.builder.name!r})")
        return v

    def _new(self, shape: tuple[int, ...], layout: Layout) -> Value:
        spec = TensorSpec(shape, layout)
        self._values.append(spec)
        assert layout.dtype is not None
        return Value(self, len(self._values) - 1, shape, layout.dtype)

    def _emit(self, op: str, inputs: Sequence[Value], out_shape: tuple[int, ...], result: DataType,
              scalar: float | None = None, /, **step_attrs: Any) -> Value:
        if OPS[op].float_only and not result.is_float:
            raise LayoutError(f"{op} needs a float input, got {result.name}; typecast it first")
        layout = Layout(MemorySpace.L1, TensorLayout.TILE, result)
        out = self._new(out_shape, layout)
        self._steps.append(
            Step(op, tuple(v.id for v in inputs), scalar, tuple(sorted(step_attrs.items())), out.id)
        )
        return out

    # -- inputs and outputs -----------------------------------------------------------------

    def input(self, shape: Sequence[int], layout: Layout | None = None) -> Value:
        """Declares the next input; inputs must come before any op."""
        self._check_open()
        if self._steps:
            raise ProgramError("declare every input before the first op")
        if layout is not None and not isinstance(layout, Layout):
            raise LayoutError(f"layout must be a tt.Layout, got {layout!r}")
        layout = (layout or _DEFAULT_LAYOUT).resolve(DataType.FLOAT32)
        value = self._new(check_shape(shape), layout)
        self._num_inputs += 1
        return value

    def output(self, value: Value, layout: Layout | None = None) -> None:
        """Marks a value as an output (default DRAM TILE, the value's dtype)."""
        self._check_open()
        value = self._value("output", value)
        if layout is not None and not isinstance(layout, Layout):
            raise LayoutError(f"layout must be a tt.Layout, got {layout!r}")
        resolved = (layout or _DEFAULT_LAYOUT).resolve(value.dtype)
        if resolved.dtype.is_float != value.dtype.is_float:  # type: ignore[union-attr]
            raise LayoutError(
                f"output: a {value.dtype.name} value cannot be stored as {resolved.dtype.name}"  # type: ignore[union-attr]
            )
        self._outputs.append((value.id, TensorSpec(value.shape, resolved)))

    def build(self) -> Program:
        self._check_open()
        if not self._outputs:
            raise ProgramError(f"program {self.name!r} has no outputs; call output() first")
        self._built = True
        return Program(
            name=self.name,
            values=tuple(self._values),
            steps=tuple(self._steps),
            outputs=tuple(v for v, _ in self._outputs),
            output_specs=tuple(s for _, s in self._outputs),
            num_inputs=self._num_inputs,
        )

    # -- ops ---------------------------------------------------------------------------------

    def _binary(self, op: str, a: Value, other: Value | float) -> Value:
        self._check_open()
        a = self._value(op, a)
        if isinstance(other, (bool, np.bool_)):
            raise ProgramError(f"{op}: a boolean operand is ambiguous; use 0 or 1")
        if isinstance(other, (int, float, np.integer, np.floating)):
            return self._emit(op, [a], a.shape, a.dtype, float(other))
        b = self._value(op, other)
        try:
            shape = tuple(np.broadcast_shapes(a.shape, b.shape))
        except ValueError:
            raise ShapeError(f"{op}: shapes {a.shape} and {b.shape} do not broadcast") from None
        return self._emit(op, [a, b], shape, _result_dtype(op, a.dtype, b.dtype))

    def add(self, a: Value, other: Value | float) -> Value:
        return self._binary("add", a, other)

    def sub(self, a: Value, other: Value | float) -> Value:
        return self._binary("sub", a, other)

    def mul(self, a: Value, other: Value | float) -> Value:
        return self._binary("mul", a, other)

    def gt(self, a: Value, other: Value | float) -> Value:
        """1 where a > other, else 0, in a's dtype (e.g. the mask of ReLU's backward)."""
        return self._binary("gt", a, other)

    def matmul(self, a: Value, b: Value) -> Value:
        self._check_open()
        a, b = self._value("matmul", a), self._value("matmul", b)
        if len(a.shape) < 2 or len(b.shape) < 2:
            raise ShapeError(f"matmul needs operands of rank >= 2, got {a.shape} and {b.shape}")
        if a.shape[-1] != b.shape[-2]:
            raise ShapeError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape}")
        try:
            batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        except ValueError:
            raise ShapeError(f"matmul: batch dims of {a.shape} and {b.shape} do not broadcast") from None
        shape = batch + (a.shape[-2], b.shape[-1])
        return self._emit("matmul", [a, b], shape, _result_dtype("matmul", a.dtype, b.dtype))

    def _unary(self, op: str, x: Value, **step_attrs: Any) -> Value:
        self._check_open()
        x = self._value(op, x)
        return self._emit(op, [x], x.shape, x.dtype, **step_attrs)

    def relu(self, x: Value) -> Value:
        return self._unary("relu", x)

    def gelu(self, x: Value) -> Value:
        return self._unary("gelu", x)

    def exp(self, x: Value) -> Value:
        return self._unary("exp", x)

    def sqrt(self, x: Value) -> Value:
        return self._unary("sqrt", x)

    def reciprocal(self, x: Value) -> Value:
        return self._unary("reciprocal", x)

    def neg(self, x: Value) -> Value:
        return self._unary("neg", x)

    def softmax(self, x: Value, axis: int = -1) -> Value:
        x = self._value("softmax", x)
        return self._unary("softmax", x, axis=_normalise_axis("softmax", axis, len(x.shape)))

    def _reduce(self, op: str, x: Value, axis: int) -> Value:
        self._check_open()
        x = self._value(op, x)
        axis = _normalise_axis(op, axis, len(x.shape))
        shape = x.shape[:axis] + (1,) + x.shape[axis + 1 :]
        return self._emit(op, [x], shape, x.dtype, axis=axis)

    def sum(self, x: Value, axis: int) -> Value:
        """Sum over `axis`, keeping it with size 1."""
        return self._reduce("sum", x, axis)

    def max(self, x: Value, axis: int) -> Value:
        return self._reduce("max", x, axis)

    def transpose(self, x: Value) -> Value:
        """Swaps the last two dims."""
        self._check_open()
        x = self._value("transpose", x)
        if len(x.shape) < 2:
            raise ShapeError(f"transpose swaps the last two dims; {x.shape} has rank {len(x.shape)}")
        shape = x.shape[:-2] + (x.shape[-1], x.shape[-2])
        return self._emit("transpose", [x], shape, x.dtype)

    def reshape(self, x: Value, shape: Sequence[int]) -> Value:
        """The same elements in another shape (row-major order, as numpy's reshape)."""
        self._check_open()
        x = self._value("reshape", x)
        dims = check_shape(shape)
        if int(np.prod(dims)) != int(np.prod(x.shape)):
            raise ShapeError(f"reshape: cannot view {x.shape} as {dims}: element counts differ")
        return self._emit("reshape", [x], dims, x.dtype, shape=dims)

    def typecast(self, x: Value, dtype: DataType) -> Value:
        self._check_open()
        x = self._value("typecast", x)
        if not isinstance(dtype, DataType):
            raise LayoutError(f"typecast: dtype must be a tt.DataType, got {dtype!r}")
        return self._emit("typecast", [x], x.shape, dtype, dtype=dtype.value)


def get_layout(binary: Binary, program_index: int, input_index: int) -> Layout:
    """The layout a program declares for one of its inputs."""
    programs = binary.programs
    if not 0 <= program_index < len(programs):
        raise ProgramError(f"program index {program_index} is out of range (0..{len(programs) - 1})")
    inputs = programs[program_index].inputs
    if not 0 <= input_index < len(inputs):
        raise ProgramError(
            f"input index {input_index} is out of range: {programs[program_index].name!r} "
            f"has {len(inputs)} inputs"
        )
    return inputs[input_index].layout


# -- the binary file ---------------------------------------------------------------------------

_MAGIC = b"TTFLOWB\0"
_VERSION = 1
_HEADER = struct.Struct("<8sIQI")  # magic, version, payload length, crc32 of payload


@final
class Binary:
    """The programs of one compiled model, as `submit` takes them."""

    __slots__ = ("programs",)

    def __init__(self, programs: Sequence[Program]) -> None:
        programs = tuple(programs)
        if not programs or not all(isinstance(p, Program) for p in programs):
            raise ProgramError("a Binary holds a non-empty sequence of Program objects")
        self.programs = programs

    def __repr__(self) -> str:
        return f"<Binary {[p.name for p in self.programs]}>"

    def save(self, path: str | os.PathLike[str]) -> None:
        payload = json.dumps([_program_to_json(p) for p in self.programs], separators=(",", ":")).encode()
        with open(path, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, _VERSION, len(payload), zlib.crc32(payload)))
            f.write(payload)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Binary:
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < _HEADER.size or data[:8] != _MAGIC:
            raise BinaryFormatError(f"{os.fspath(path)!r} is not a ttflow binary (bad magic bytes)")
        _, version, length, crc = _HEADER.unpack_from(data)
        if version != _VERSION:
            raise BinaryFormatError(
                f"{os.fspath(path)!r} has format version {version}; this ttflow reads version {_VERSION}"
            )
        payload = data[_HEADER.size :]
        if len(payload) != length:
            raise BinaryFormatError(
                f"{os.fspath(path)!r} is truncated or has trailing bytes: "
                f"payload is {len(payload)} bytes, header says {length}"
            )
        if zlib.crc32(payload) != crc:
            raise BinaryFormatError(f"{os.fspath(path)!r} is corrupt (checksum mismatch)")
        try:
            programs = [_program_from_json(p) for p in json.loads(payload)]
            return cls(programs)
        except BinaryFormatError:
            raise
        except Exception as exc:
            raise BinaryFormatError(f"{os.fspath(path)!r} has a malformed payload: {exc}") from None


def _spec_to_json(s: TensorSpec) -> list[Any]:
    return [list(s.shape), s.layout.memory.name, s.layout.tensor_layout.name, s.dtype.name]


def _spec_from_json(j: list[Any]) -> TensorSpec:
    shape, memory, tensor_layout, dtype = j
    return TensorSpec(
        check_shape(shape), Layout(MemorySpace[memory], TensorLayout[tensor_layout], DataType[dtype])
    )


def _program_to_json(p: Program) -> dict[str, Any]:
    return {
        "name": p.name,
        "num_inputs": p.num_inputs,
        "values": [_spec_to_json(v) for v in p.values],
        "steps": [[s.op, list(s.inputs), s.scalar, [list(a) for a in s.attrs], s.output] for s in p.steps],
        "outputs": list(p.outputs),
        "output_specs": [_spec_to_json(s) for s in p.output_specs],
    }


def _program_from_json(j: dict[str, Any]) -> Program:
    values = tuple(_spec_from_json(v) for v in j["values"])
    n = len(values)
    steps = []
    for op, inputs, scalar, step_attrs, output in j["steps"]:
        if op not in OPS:
            raise BinaryFormatError(f"unknown op {op!r}")
        ids = [*inputs, output]
        if not all(isinstance(i, int) and 0 <= i < n for i in ids):
            raise BinaryFormatError(f"op {op!r} refers to a value id out of range")
        if scalar is not None and not isinstance(scalar, (int, float)):
            raise BinaryFormatError(f"op {op!r} has a non-numeric scalar")
        steps.append(Step(op, tuple(inputs), None if scalar is None else float(scalar),
                          tuple((str(k), tuple(v) if isinstance(v, list) else v)
                                for k, v in step_attrs), output))
    outputs = tuple(j["outputs"])
    if not all(isinstance(i, int) and 0 <= i < n for i in outputs):
        raise BinaryFormatError("an output refers to a value id out of range")
    output_specs = tuple(_spec_from_json(s) for s in j["output_specs"])
    num_inputs = j["num_inputs"]
    if not isinstance(num_inputs, int) or not 0 <= num_inputs <= n or len(output_specs) != len(outputs):
        raise BinaryFormatError("inconsistent input or output counts")
    return Program(str(j["name"]), values, tuple(steps), outputs, output_specs, num_inputs)
