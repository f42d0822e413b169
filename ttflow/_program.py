"""Programs: what a front-end compiles and the device runs (the IR), and its host reference.

`ProgramBuilder` records ops in execution order and checks shapes and dtypes as each op is
called, so a malformed program fails where it is written (ShapeError, LayoutError, ProgramError
raised by the op call, naming the op and the shapes), not when it runs.

Dtype rules:
- a program input always has a concrete dtype: FLOAT32 when its layout leaves it out;
- a binary op (add, sub, mul, gt, matmul) on two float values gives the wider float
  (FLOAT32 > BFLOAT16 > BFLOAT8_B); two equal integer dtypes keep it; mixing integers and floats,
  or INT32 with UINT32, raises LayoutError (use `typecast`);
- with a Python scalar operand the dtype is the value's; an integer value takes only integral
  scalars (|s| <= 2**53, so the float the step holds is exact), and no scalar may be NaN;
- gelu, exp, softmax, sqrt and reciprocal need floats (LayoutError on integers); relu, neg, sum,
  max, transpose, reshape and the binary ops work on integers too;
- an output keeps its value's dtype unless its layout names another one of the same kind
  (float to float, integer to integer); it is then rounded when stored.

Every intermediate value is typed L1 TILE in its dtype; where it is really stored is the runtime's
choice. `Program.last_use` says when each value can be freed, and `run_on_host` is the reference
interpreter: the runtime's loop, on host arrays.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, final

import attrs
import numpy as np

from ._errors import LayoutError, ProgramError, ShapeError
from ._ops import OPS, store_as, to_host_dtype
from ._types import DataType, Layout, MemorySpace, TensorLayout, check_shape

__all__ = [
    "TensorSpec", "Step", "Program", "ProgramBuilder", "Value", "run_on_host",
]

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


def _scalar(op: str, a: Value, other: float) -> float:
    """A scalar operand as the float a Step holds; checked against the value's dtype."""
    value = float(other)
    if value != value:
        raise ProgramError(f"{op}: a NaN operand makes every element NaN; pass a number")
    if not a.dtype.is_float and (not value.is_integer() or abs(value) > 2.0**53):
        raise LayoutError(
            f"{op}: a {a.dtype.name} value takes integral scalars (|s| <= 2**53), got {other!r}; "
            "typecast the value to a float type first"
        )
    return value


def _result_dtype(op: str, a: DataType, b: DataType) -> DataType:
    if a.is_float and b.is_float:
        return a if _FLOAT_RANK[a] >= _FLOAT_RANK[b] else b
    if a is b:
        return a
    raise LayoutError(f"{op}: cannot mix {a.name} and {b.name}; typecast one operand first")


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """numpy's broadcast of two shapes, or None; on Python ints, so dims past int64 are exact
    (np.broadcast_shapes refuses them with a ValueError that would read as a mismatch)."""
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + a, (1,) * (rank - len(b)) + b
    if any(x != y and x != 1 and y != 1 for x, y in zip(a, b)):
        return None
    return tuple(y if x == 1 else x for x, y in zip(a, b))


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
            return self._emit(op, [a], a.shape, a.dtype, _scalar(op, a, other))
        b = self._value(op, other)
        shape = _broadcast(a.shape, b.shape)
        if shape is None:
            raise ShapeError(f"{op}: shapes {a.shape} and {b.shape} do not broadcast")
        return self._emit(op, [a, b], shape, _result_dtype(op, a.dtype, b.dtype))

    def add(self, a: Value, other: Value | float) -> Value:
        """a + other; `other` a value (numpy broadcasting) or a Python scalar."""
        return self._binary("add", a, other)

    def sub(self, a: Value, other: Value | float) -> Value:
        """a - other; `other` a value (numpy broadcasting) or a Python scalar."""
        return self._binary("sub", a, other)

    def mul(self, a: Value, other: Value | float) -> Value:
        """a * other; `other` a value (numpy broadcasting) or a Python scalar."""
        return self._binary("mul", a, other)

    def gt(self, a: Value, other: Value | float) -> Value:
        """1 where a > other, else 0, in a's dtype (e.g. the mask of ReLU's backward)."""
        return self._binary("gt", a, other)

    def matmul(self, a: Value, b: Value) -> Value:
        """[..., M, K] @ [..., K, N]; batch dims broadcast as numpy's do, rank 1 is refused."""
        self._check_open()
        a, b = self._value("matmul", a), self._value("matmul", b)
        if len(a.shape) < 2 or len(b.shape) < 2:
            raise ShapeError(f"matmul needs operands of rank >= 2, got {a.shape} and {b.shape}")
        if a.shape[-1] != b.shape[-2]:
            raise ShapeError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape}")
        batch = _broadcast(a.shape[:-2], b.shape[:-2])
        if batch is None:
            raise ShapeError(f"matmul: batch dims of {a.shape} and {b.shape} do not broadcast")
        shape = batch + (a.shape[-2], b.shape[-1])
        return self._emit("matmul", [a, b], shape, _result_dtype("matmul", a.dtype, b.dtype))

    def _unary(self, op: str, x: Value, **step_attrs: Any) -> Value:
        self._check_open()
        x = self._value(op, x)
        return self._emit(op, [x], x.shape, x.dtype, **step_attrs)

    def relu(self, x: Value) -> Value:
        """max(x, 0)."""
        return self._unary("relu", x)

    def gelu(self, x: Value) -> Value:
        """0.5 x (1 + erf(x / sqrt 2)): the exact form, PyTorch's default."""
        return self._unary("gelu", x)

    def exp(self, x: Value) -> Value:
        """e**x (floats only)."""
        return self._unary("exp", x)

    def sqrt(self, x: Value) -> Value:
        """Square root (floats only; NaN below 0)."""
        return self._unary("sqrt", x)

    def reciprocal(self, x: Value) -> Value:
        """1 / x (floats only; inf at 0)."""
        return self._unary("reciprocal", x)

    def neg(self, x: Value) -> Value:
        """-x."""
        return self._unary("neg", x)

    def softmax(self, x: Value, axis: int = -1) -> Value:
        """exp(x - max) / sum(exp(x - max)) along `axis`: never overflows."""
        self._check_open()
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
        """Maximum over `axis`, keeping it with size 1."""
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
        if math.prod(dims) != math.prod(x.shape):  # Python ints: exact at any size
            raise ShapeError(f"reshape: cannot view {x.shape} as {dims}: element counts differ")
        return self._emit("reshape", [x], dims, x.dtype, shape=dims)

    def typecast(self, x: Value, dtype: DataType) -> Value:
        """x in another dtype (float to int truncates and saturates; see `_ops`)."""
        self._check_open()
        x = self._value("typecast", x)
        if not isinstance(dtype, DataType):
            raise LayoutError(f"typecast: dtype must be a tt.DataType, got {dtype!r}")
        return self._emit("typecast", [x], x.shape, dtype, dtype=dtype.value)


def run_on_host(program: Program, arrays: Sequence[Any]) -> list[np.ndarray[Any, Any]]:
    """Runs a program on host arrays exactly as the device does, for tests and a CPU fallback.

    Each input is first converted to its declared dtype (as `submit` converts it at the
    program's start); each step computes in float32 or int64 and its result is rounded to the
    value's dtype (`store_as`); each output is rounded to its declared dtype and returned as
    `to_host` would return it (float32 for BFLOAT8_B, ml_dtypes.bfloat16 for BFLOAT16)."""
    if len(arrays) != len(program.inputs):
        raise ProgramError(
            f"program {program.name!r} takes {len(program.inputs)} inputs, {len(arrays)} were given"
        )
    values: list[Any] = [None] * len(program.values)  # each set before any step reads it
    for index, (array, spec) in enumerate(zip(arrays, program.inputs)):
        host = np.asarray(array)
        if host.shape != spec.shape:
            raise ShapeError(
                f"input {index} of {program.name!r} has shape {host.shape}, the program declares {spec.shape}"
            )
        values[index] = store_as(host, spec.dtype)
    for step in program.steps:
        result = OPS[step.op].compute([values[v] for v in step.inputs], step.scalar, **dict(step.attrs))
        values[step.output] = store_as(result, program.values[step.output].dtype)
    return [
        to_host_dtype(store_as(values[v], spec.dtype), spec.dtype)
        for v, spec in zip(program.outputs, program.output_specs)
    ]
