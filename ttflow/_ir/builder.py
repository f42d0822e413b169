"""Programs: what a front-end compiles and the device runs (the IR), and its host reference.

`ProgramBuilder` records ops in execution order and checks shapes and dtypes as each op is
called, so a malformed program fails where it is written (ShapeError, LayoutError, ProgramError
raised by the op call, naming the op and the shapes), not when it runs.

Dtype rules:
- a program input always has a concrete dtype: FLOAT32 when its layout leaves it out;
- a binary op (add, sub, mul, matmul, maximum, minimum and the comparisons eq, ne, lt, le, gt,
  ge) on two float values gives the wider float (FLOAT32 > BFLOAT16 > BFLOAT8_B); two equal
  integer dtypes keep it; mixing integers and floats, or INT32 with UINT32, raises LayoutError
  (use `typecast`). A comparison gives 1 or 0 in that dtype. The same rule joins the operands
  of concat, of where's two branches (the condition may have any dtype: nonzero selects `a`)
  and of conv2d (input, weight, bias);
- with a Python scalar operand the dtype is the value's; an integer value takes only integral
  scalars (|s| <= 2**53, so the float the step holds is exact), and no scalar may be NaN;
- gelu, exp, softmax, sqrt, reciprocal, rsqrt, tanh, sigmoid, silu, pow, mean, layer_norm,
  rms_norm, conv2d, avg_pool2d, div, log, erf, embedding_grad, conv2d_input_grad,
  conv2d_weight_grad, avg_pool2d_backward, sin, cos, floor, ceil, round and trunc need floats (LayoutError on integers); relu, neg,
  abs, sum, prod, max, argmax, transpose, reshape, slice, permute, concat, broadcast_to, gather,
  max_pool2d, max_pool2d_backward and the binary ops work on integers too;
- bitwise_and, bitwise_or, bitwise_xor, left_shift and right_shift need INT32 or UINT32 values
  (LayoutError on floats); a scalar operand of bitwise_and, bitwise_or or bitwise_xor must fit
  the value's dtype (LayoutError otherwise: the results then always fit, unchecked);
- layer_norm and rms_norm give x's dtype (weight and bias may be any float dtype);
  argmax gives INT32; embedding gives the table's dtype (ids must be INT32 or UINT32);
  update_cache gives the cache's dtype (the new row is rounded to it; it must be of the cache's
  kind, and its index INT32 or UINT32); arange and full give the dtype they are asked for (INT32
  and FLOAT32 by default); rand gives FLOAT32 (its seed INT32 or UINT32); gather gives x's dtype
  (its index INT32 or UINT32), embedding_grad and the pool gradients grad's, the conv2d
  gradients the binary rule of their two operands;
- an output keeps its value's dtype unless its layout names another one of the same kind
  (float to float, integer to integer); it is then rounded when stored.

Shape rules of the newer ops (`docs/ops.md` is the table, with numpy and PyTorch equivalents):
- reductions (sum, prod, max, mean, argmax) keep the reduced axis with size 1; axes may be negative;
- slice(x, starts, ends, steps) is `x[starts[0]:ends[0]:steps[0], ...]`: Python's clamping and
  negative indices, None for an open end; fewer entries than the rank slice the leading axes
  (numpy's `x[a:b]`); steps must be positive; an empty result is a ShapeError;
- run-time indices (embedding's and embedding_grad's ids, update_cache's row, gather's index)
  are clamped into range, as JAX clamps (a device op has no way to raise): id -1 reads row 0,
  an id past the table its last row;
- conv2d and the pools take NHWC input (as ttnn) and give NHWC; conv2d's weight is PyTorch's
  [C_out, C_in / groups, kH, kW]; stride, padding, dilation and kernel_size are an int or a
  pair; padding is zeros on both sides (max_pool2d pads with -inf and, as PyTorch, takes at most
  half the kernel); avg_pool2d divides by kH * kW, padding included (`count_include_pad`);
  output sizes follow PyTorch's formula (floor), and a size below 1 is a ShapeError. Their
  gradients (conv2d_input_grad, conv2d_weight_grad, max_pool2d_backward, avg_pool2d_backward)
  take the same arguments and layouts, the forward input's or weight's shape where it cannot be
  read off a value, and check that grad has the forward result's shape.

Collectives (all_gather, reduce_scatter, all_reduce, broadcast, point_to_point, all_to_all)
exchange a value with the other chips of a mesh: `cluster_axis=a` groups the chips that differ
only in coordinate a (None: every chip), results are in mesh-coordinate order along the group,
reductions are sums. Their shapes depend on the group's size, which a program carries as the
builder's `mesh_shape` (None: one chip) and a submit resolves for its mesh.

Every intermediate value is typed L1 TILE in its dtype; where it is really stored is the runtime's
choice. `Program.last_use` says when each value can be freed, and `run_on_host` is the reference
interpreter: the runtime's loop, on host arrays.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, final

import numpy as np

from .._errors import LayoutError, ProgramError, ShapeError
from .._types import DataType, Layout, MemorySpace, TensorLayout, check_shape
from .numerics import arange_length, checked, zero_divisor
from .ops import COLLECTIVES, OPS
from .ops.host import HOST_OP, HostFunction
from .program import Program, Step, TensorSpec

__all__ = ["ProgramBuilder", "Value"]

_DEFAULT_LAYOUT = Layout(MemorySpace.DRAM, TensorLayout.TILE)
_FLOAT_RANK = {DataType.BFLOAT8_B: 0, DataType.BFLOAT16: 1, DataType.FLOAT32: 2}








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


def _scalar(op: str, dtype: DataType, other: float) -> float:
    """A scalar operand as the float a Step holds; checked against the dtype of the value it
    meets."""
    value = float(other)
    if value != value:
        raise ProgramError(f"{op}: a NaN operand makes every element NaN; pass a number")
    if not dtype.is_float and (not value.is_integer() or abs(value) > 2.0**53):
        raise LayoutError(
            f"{op}: a {dtype.name} value takes integral scalars (|s| <= 2**53), got {other!r}; "
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


def _int(op: str, name: str, v: Any, minimum: int | None = None) -> int:
    """An integer argument (a Python or numpy int, not a bool), at least `minimum`."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ShapeError(f"{op}: {name} must be an integer, got {v!r:.40}")
    if minimum is not None and v < minimum:
        raise ShapeError(f"{op}: {name} must be at least {minimum}, got {v}")
    return int(v)


def _pair(op: str, name: str, v: Any, minimum: int) -> tuple[int, int]:
    """An int or a pair of ints (height, width), as PyTorch's conv and pool arguments."""
    if isinstance(v, (list, tuple)):
        if len(v) != 2:
            raise ShapeError(f"{op}: {name} is an int or a pair (height, width), got {v!r:.40}")
        return _int(op, name, v[0], minimum), _int(op, name, v[1], minimum)
    value = _int(op, name, v, minimum)
    return value, value


def _ints(op: str, name: str, v: Any, allow_none: bool = False) -> list[Any]:
    """A sequence of integer arguments (None entries allowed where `allow_none`)."""
    if not isinstance(v, (list, tuple)):
        raise ShapeError(f"{op}: {name} must be a sequence of ints, got {v!r:.40}")
    return [None if (allow_none and e is None) else _int(op, name, e) for e in v]


def _number(op: str, name: str, v: Any) -> float:
    """A finite real argument (not a bool), as a float."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ProgramError(f"{op}: {name} must be a number, got {v!r:.40}")
    value = float(v)
    if not math.isfinite(value):
        raise ProgramError(f"{op}: {name} must be finite, got {v!r}")
    return value


def _window_size(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """PyTorch's conv/pool output size: floor((size + 2p - d (k - 1) - 1) / s) + 1."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


_Op = TypeVar("_Op", bound=Callable[..., Any])


def _located(method: _Op) -> _Op:
    """Every op method takes `loc=`, as MLIR's Python builders do: the steps it emits come
    from that location, as if built inside `ProgramBuilder.location(loc)` (which it nests in,
    and replaces for those steps). The method's own `loc` parameter is what callers and type
    checkers see; this wrapper is what acts on it."""

    @functools.wraps(method)
    def at(self: ProgramBuilder, *args: Any, loc: str | None = None, **kwargs: Any) -> Any:
        if loc is None:
            return method(self, *args, **kwargs)
        with self.location(loc):
            return method(self, *args, **kwargs)

    return at  # type: ignore[return-value]


@final
class ProgramBuilder:
    """Records a program op by op; `build()` returns the immutable `Program`.

    `mesh_shape` (rows, cols): the mesh whose group sizes the collectives' shapes are resolved
    for. Left out, a collective's group is one chip (an all_gather's result is its input's
    shape); a submit to a mesh resolves the shapes again for that mesh, so one program runs on
    any mesh whose groups fit it (see docs/mesh.md, "Collectives")."""

    def __init__(self, name: str, mesh_shape: Sequence[int] | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ProgramError("a program needs a non-empty name")
        self.name = name
        # The (rows, cols) of the mesh the collectives' shapes are resolved for; None: a group
        # of one chip until a submit resolves them for its mesh (`_ir.binary.for_mesh`).
        self.mesh_shape = _mesh_shape(mesh_shape)
        self._values: list[TensorSpec] = []
        self._steps: list[Step] = []
        self._outputs: list[tuple[int, TensorSpec]] = []
        self._donated: list[int] = []  # per output: the input it donates, or -1
        self._num_inputs = 0
        self._built = False
        self._range_note: str | None = None  # set inside `checking_range`
        self._range_checks: list[tuple[int, str]] = []
        self._consts: list[int] = []  # the inputs declared constant
        self._location: str | None = None  # set inside `location`
        self._locations: list[tuple[int, str]] = []

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
        if OPS[op].int_only and result.is_float:
            raise LayoutError(f"{op} needs INT32 or UINT32 inputs, got {result.name}: it has no float "
                              "meaning; typecast to an integer type first")
        check = self._range_note is not None and checked(op, result)
        if check and zero_divisor(op, scalar):
            raise ProgramError(f"{self._range_note}: integer division by zero")
        layout = Layout(MemorySpace.L1, TensorLayout.TILE, result)
        out = self._new(out_shape, layout)
        self._steps.append(
            Step(op, tuple(v.id for v in inputs), scalar, tuple(sorted(step_attrs.items())), out.id)
        )
        if check:
            assert self._range_note is not None
            self._range_checks.append((out.id, self._range_note))
        self._locate(out)
        return out

    def _locate(self, out: Value) -> None:
        if self._location is not None:
            self._locations.append((out.id, self._location))

    @contextlib.contextmanager
    def location(self, loc: str) -> Iterator[None]:
        """The steps emitted inside come from `loc` (a source line, a model's layer, an FX node),
        as ops built inside MLIR's `with Location(...)` carry it: debug hooks (`OpContext.loc`)
        and golden reports name an op by it. Nested blocks replace the outer location."""
        self._check_open()
        if not isinstance(loc, str) or not loc:
            raise ProgramError("location needs a non-empty string")
        outer, self._location = self._location, loc
        try:
            yield
        finally:
            self._location = outer

    @contextlib.contextmanager
    def checking_range(self, note: str) -> Iterator[None]:
        """Integer results of the steps emitted inside must fit their dtype: the device wraps an
        INT32 result to 32 bits, and a run whose checked result would wrap fails instead, with
        a ProgramError that begins with `note`; so does an integer division by a zero element
        (floor_divide, remainder, fmod give 0 on the device; a checked division by a zero scalar
        is refused here), and an embedding id or a gather index out of range (the device clamps
        them). Only the ops that can leave the range of operands inside it are checked
        (`numerics.checked`: arithmetic, products, left shifts, divisions, typecast, indexing); the
        others select, compare, move or mask values that already fit.

        For a front-end that holds a type the device lacks in a narrower one (ttflow.torch keeps
        int64 as INT32): a result past the narrow type's range is then an error, not a wrong
        value. A float-to-integer typecast checks its input (the device saturates it)."""
        self._check_open()
        if not isinstance(note, str) or not note:
            raise ProgramError("checking_range needs a note naming what is checked")
        outer, self._range_note = self._range_note, note
        try:
            yield
        finally:
            self._range_note = outer

    # -- inputs and outputs -----------------------------------------------------------------

    def input(self, shape: Sequence[int], layout: Layout | None = None, *, const: bool = False) -> Value:
        """Declares the next input; inputs must come before any op.

        `const=True` declares it constant (weights, as tt-mlir's const-eval): the steps that
        depend only on constant inputs run once per (program, constant tensors) on a device, and
        their results are kept there and reused by later submits until a constant is written
        (`tt.write`, a trace replay into it) or freed. A constant input cannot be donated."""
        self._check_open()
        if not isinstance(const, (bool, np.bool_)):
            raise ProgramError(f"input: const must be a bool, got {const!r:.40}")
        if self._steps:
            raise ProgramError("declare every input before the first op")
        if layout is not None and not isinstance(layout, Layout):
            raise LayoutError(f"layout must be a tt.Layout, got {layout!r}")
        layout = (layout or _DEFAULT_LAYOUT).resolve(DataType.FLOAT32)
        value = self._new(check_shape(shape), layout)
        if const:
            self._consts.append(self._num_inputs)
        self._num_inputs += 1
        return value

    def output(self, value: Value, layout: Layout | None = None, *,
               donates: Value | None = None) -> None:
        """Marks a value as an output (default DRAM TILE, the value's dtype).

        `donates=x` (an input of this program) makes the output reuse x's buffer, as JAX's
        `donate_argnums`: `submit` consumes the tensor passed as x, and the output takes its
        storage, with no allocation. The output must have x's shape and layout (its layout is
        then the default); with `update_cache` this updates a cache in place."""
        self._check_open()
        value = self._value("output", value)
        if layout is not None and not isinstance(layout, Layout):
            raise LayoutError(f"layout must be a tt.Layout, got {layout!r}")
        donated: TensorSpec | None = None
        if donates is not None:
            donates = self._value("output(donates=)", donates)
            if donates.id >= self._num_inputs:
                raise ProgramError(
                    f"output(donates=): {donates} is not an input of {self.name!r}; only an "
                    "input's buffer can be donated"
                )
            if donates.id in self._consts:
                raise ProgramError(
                    f"output(donates=): input {donates.id} is declared const; a constant's buffer "
                    "cannot be donated (its cached results would outlive its value)"
                )
            if any(v == donates.id for v in self._donated):
                raise ProgramError(f"output(donates=): input {donates.id} is already donated to another output")
            donated = self._values[donates.id]
            if layout is None:
                layout = donated.layout
        resolved = (layout or _DEFAULT_LAYOUT).resolve(value.dtype)
        if resolved.dtype.is_float != value.dtype.is_float:  # type: ignore[union-attr]
            raise LayoutError(
                f"output: a {value.dtype.name} value cannot be stored as {resolved.dtype.name}"  # type: ignore[union-attr]
            )
        spec = TensorSpec(value.shape, resolved)
        if donated is not None:
            if spec.shape != donated.shape:
                raise ShapeError(
                    f"output(donates=): the output has shape {spec.shape}, the donated input "
                    f"{donated.shape}; a donated buffer holds a value of its own shape"
                )
            if spec.layout != donated.layout:
                raise LayoutError(
                    f"output(donates=): the output is stored as {spec.layout}, the donated input "
                    f"is {donated.layout}; a donated buffer keeps its layout and dtype"
                )
            assert donates is not None
            self._donated.append(donates.id)
        else:
            self._donated.append(-1)
        self._outputs.append((value.id, spec))

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
            donations=tuple((k, i) for k, i in enumerate(self._donated) if i >= 0),
            range_checks=tuple(self._range_checks),
            locations=tuple(self._locations),
            mesh_shape=self.mesh_shape if any(step.op in COLLECTIVES for step in self._steps) else None,
            consts=tuple(self._consts),
        )

    # -- host ops ----------------------------------------------------------------------------

    @_located
    def host_op(self, fn: Any, inputs: Sequence[Value],
                outputs: Sequence[tuple[Sequence[int], Layout | DataType | None]], *,
                name: str | None = None, loc: str | None = None) -> list[Value]:
        """A step that runs `fn` on the host (tt-mlir's CPU hoisting); returns its output values.

        At run time the runtime reads `inputs` back from bank memory, calls `fn(*arrays)` on the
        queue's worker thread (never on the event loop), in queue order, and stores what it
        returns. `fn` gets read-only numpy arrays in each input's host dtype (float32 for
        FLOAT32 and BFLOAT8_B, ml_dtypes.bfloat16, int32, uint32) and returns a tuple or list of
        arrays (one array alone when it declares one output), each of the declared shape and
        host dtype. `outputs` declares them as `(shape, layout)` pairs: only the layout's dtype
        counts (a `DataType` may stand for it; None or no dtype: FLOAT32), as the op's results
        are intermediates like any op's. A failing `fn`, or results of another count, shape or
        dtype, fail the program's outputs with a HostOpError naming `host_op:<name>` (`name`,
        default `fn.__name__`); the exception `fn` raised is its `__cause__`.

        A program with a host op runs on devices and meshes (once per chip), in traces and
        under `run_on_host`, but cannot be saved to a file (`Binary.save` raises HostOpError).
        """
        self._check_open()
        if not callable(fn):
            raise ProgramError(f"host_op: fn must be callable, got {type(fn).__name__}")
        label = name if name is not None else getattr(fn, "__name__", None) or type(fn).__name__
        if not isinstance(label, str) or not label:
            raise ProgramError(f"host_op: name must be a non-empty str, got {name!r:.40}")
        if isinstance(inputs, Value) or not isinstance(inputs, (list, tuple)):
            raise ProgramError(f"host_op:{label}: inputs must be a list of Values, got {type(inputs).__name__}")
        values = [self._value(f"host_op:{label}", v) for v in inputs]
        if not isinstance(outputs, (list, tuple)) or not outputs:
            raise ProgramError(f"host_op:{label}: outputs must be a non-empty list of (shape, layout) pairs")
        declared: list[tuple[tuple[int, ...], DataType]] = []
        for k, entry in enumerate(outputs):
            if not isinstance(entry, (list, tuple)) or len(entry) != 2 or not isinstance(entry[0], (list, tuple)):
                raise ProgramError(f"host_op:{label}: output {k} must be a (shape, layout) pair, got {entry!r:.60}")
            shape, layout = entry
            if isinstance(layout, DataType):
                dtype = layout
            elif layout is None or isinstance(layout, Layout):
                dtype = layout.dtype if layout is not None and layout.dtype is not None else DataType.FLOAT32
            else:
                raise LayoutError(f"host_op:{label}: output {k}'s layout must be a tt.Layout or tt.DataType, "
                                  f"got {layout!r:.60}")
            declared.append((check_shape(shape), dtype))
        host = HostFunction(fn, label, [v.dtype for v in values], declared)
        results: list[Value] = []
        for k, (shape, dtype) in enumerate(declared):
            out = self._new(shape, Layout(MemorySpace.L1, TensorLayout.TILE, dtype))
            # The first step calls fn on the inputs; the later ones take their result after it.
            reads = tuple(v.id for v in values) if k == 0 else (results[0].id,)
            self._steps.append(Step(HOST_OP, reads, None, (("host", host), ("index", k)), out.id))
            self._locate(out)
            results.append(out)
        return results

    # -- ops ---------------------------------------------------------------------------------

    def _binary(self, op: str, a: Value, other: Value | float) -> Value:
        self._check_open()
        a = self._value(op, a)
        if isinstance(other, (bool, np.bool_)):
            raise ProgramError(f"{op}: a boolean operand is ambiguous; use 0 or 1")
        if isinstance(other, (int, float, np.integer, np.floating)):
            return self._emit(op, [a], a.shape, a.dtype, _scalar(op, a.dtype, other))
        b = self._value(op, other)
        shape = _broadcast(a.shape, b.shape)
        if shape is None:
            raise ShapeError(f"{op}: shapes {a.shape} and {b.shape} do not broadcast")
        return self._emit(op, [a, b], shape, _result_dtype(op, a.dtype, b.dtype))

    @_located
    def add(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a + other; `other` a value (numpy broadcasting) or a Python scalar."""
        return self._binary("add", a, other)

    @_located
    def sub(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a - other; `other` a value (numpy broadcasting) or a Python scalar."""
        return self._binary("sub", a, other)

    @_located
    def mul(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a * other; `other` a value (numpy broadcasting) or a Python scalar."""
        return self._binary("mul", a, other)

    @_located
    def gt(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a > other, else 0, in a's dtype (e.g. the mask of ReLU's backward)."""
        return self._binary("gt", a, other)

    @_located
    def matmul(self, a: Value, b: Value, *, loc: str | None = None) -> Value:
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

    @_located
    def relu(self, x: Value, *, loc: str | None = None) -> Value:
        """max(x, 0)."""
        return self._unary("relu", x)

    @_located
    def gelu(self, x: Value, *, loc: str | None = None) -> Value:
        """0.5 x (1 + erf(x / sqrt 2)): the exact form, PyTorch's default."""
        return self._unary("gelu", x)

    @_located
    def exp(self, x: Value, *, loc: str | None = None) -> Value:
        """e**x (floats only)."""
        return self._unary("exp", x)

    @_located
    def sqrt(self, x: Value, *, loc: str | None = None) -> Value:
        """Square root (floats only; NaN below 0)."""
        return self._unary("sqrt", x)

    @_located
    def reciprocal(self, x: Value, *, loc: str | None = None) -> Value:
        """1 / x (floats only; inf at 0)."""
        return self._unary("reciprocal", x)

    @_located
    def neg(self, x: Value, *, loc: str | None = None) -> Value:
        """-x."""
        return self._unary("neg", x)

    @_located
    def softmax(self, x: Value, axis: int = -1, *, loc: str | None = None) -> Value:
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

    @_located
    def sum(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Sum over `axis`, keeping it with size 1."""
        return self._reduce("sum", x, axis)

    @_located
    def max(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Maximum over `axis`, keeping it with size 1."""
        return self._reduce("max", x, axis)

    @_located
    def prod(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Product over `axis`, keeping it with size 1 (torch.prod(x, axis, keepdim=True),
        np.prod); floats or integers, x's dtype.

        A float product is float32 multiplied left to right along the axis (np.prod of float32),
        then rounded to x's dtype. CPU torch (2.13) multiplies in the same order, bit for bit,
        along a strided dim or one of fewer than 32 elements; along a dim of 32 or more that is
        contiguous (the innermost, or followed by size-1 dims only) it keeps vectorised partial
        products and combines them at the end, so the two can differ by a few ulps there (both
        within about (n - 1) * 2**-24 relative of the exact product of n floats, the bound for
        any order). An integer product is int64 (wrapping past 2**63, as torch's int64 prod),
        stored wrapped to 32 bits (torch's int32 result); `checking_range` checks the int64
        product."""
        return self._reduce("prod", x, axis)

    @_located
    def cumsum(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Running sums along `axis` (torch.cumsum, np.cumsum); x's shape and dtype. Floats sum
        in float64 and round each partial sum once, as torch's CPU kernel."""
        self._check_open()
        x = self._value("cumsum", x)
        return self._emit("cumsum", [x], x.shape, x.dtype, axis=_normalise_axis("cumsum", axis, len(x.shape)))

    @_located
    def remainder(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a mod other with the divisor's sign (torch.remainder, np.remainder, Python's %);
        `other` a value (numpy broadcasting) or a Python scalar. An integer mod 0 is 0."""
        return self._binary("remainder", a, other)

    @_located
    def floor_divide(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """floor(a / other) (torch.floor_divide and `div(rounding_mode="floor")`, np.floor_divide,
        Python's //); floats give float results. An integer divided by 0 is 0."""
        return self._binary("floor_divide", a, other)

    @_located
    def atan2(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """The angle of the point (other, a) in radians, in [-pi, pi] (torch.atan2, np.arctan2;
        floats only); `other` a value (numpy broadcasting) or a Python scalar."""
        return self._binary("atan2", a, other)

    @_located
    def fmod(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a mod other with a's sign (torch.fmod, np.fmod, C's fmod). An integer mod 0 is 0."""
        return self._binary("fmod", a, other)

    def _bitwise(self, op: str, a: Value, other: Value | int) -> Value:
        """A bitwise binary op: a scalar operand must fit the value's dtype, so that the result
        always does (these ops are not range-checked)."""
        self._check_open()
        a = self._value(op, a)
        if (not a.dtype.is_float and isinstance(other, (int, float, np.integer, np.floating))
                and not isinstance(other, (bool, np.bool_))):
            low, high = (-(2**31), 2**31 - 1) if a.dtype is DataType.INT32 else (0, 2**32 - 1)
            value = _scalar(op, a.dtype, other)
            if not low <= value <= high:
                raise LayoutError(
                    f"{op}: the scalar {other!r} does not fit {a.dtype.name} [{low}, {high}]; torch's "
                    f"int32 ops use its low 32 bits: pass it wrapped into {a.dtype.name}'s range"
                )
        return self._binary(op, a, other)

    @_located
    def bitwise_and(self, a: Value, other: Value | int, *, loc: str | None = None) -> Value:
        """a & other, bit by bit (torch.bitwise_and, np.bitwise_and); INT32 or UINT32 only;
        `other` a value of a's dtype (numpy broadcasting) or a Python int that fits it."""
        return self._bitwise("bitwise_and", a, other)

    @_located
    def bitwise_or(self, a: Value, other: Value | int, *, loc: str | None = None) -> Value:
        """a | other, bit by bit (torch.bitwise_or, np.bitwise_or); as `bitwise_and`."""
        return self._bitwise("bitwise_or", a, other)

    @_located
    def bitwise_xor(self, a: Value, other: Value | int, *, loc: str | None = None) -> Value:
        """a ^ other, bit by bit (torch.bitwise_xor, np.bitwise_xor); as `bitwise_and`."""
        return self._bitwise("bitwise_xor", a, other)

    @_located
    def left_shift(self, a: Value, other: Value | int, *, loc: str | None = None) -> Value:
        """a << other (torch.bitwise_left_shift); INT32 or UINT32 only; `other`, the counts, a
        value of a's dtype (numpy broadcasting) or a Python int. The bits shifted past 32 are
        lost (INT32 wraps, as torch's int32); a count outside [0, 31] gives 0, as CPU torch's
        int32 kernel (C leaves it undefined). Under `checking_range` the int64 result, torch's
        int64 x << s (0 for a count outside [0, 63]), must fit the dtype."""
        return self._binary("left_shift", a, other)

    @_located
    def right_shift(self, a: Value, other: Value | int, *, loc: str | None = None) -> Value:
        """a >> other (torch.bitwise_right_shift); INT32 or UINT32 only; arithmetic on INT32
        (the sign fills in), logical on UINT32. A count outside [0, 31] gives the sign fill
        alone (-1 for a negative INT32 element, else 0), as CPU torch's int32 kernel."""
        return self._binary("right_shift", a, other)

    @_located
    def transpose(self, x: Value, *, loc: str | None = None) -> Value:
        """Swaps the last two dims."""
        self._check_open()
        x = self._value("transpose", x)
        if len(x.shape) < 2:
            raise ShapeError(f"transpose swaps the last two dims; {x.shape} has rank {len(x.shape)}")
        shape = x.shape[:-2] + (x.shape[-1], x.shape[-2])
        return self._emit("transpose", [x], shape, x.dtype)

    @_located
    def reshape(self, x: Value, shape: Sequence[int], *, loc: str | None = None) -> Value:
        """The same elements in another shape (row-major order, as numpy's reshape)."""
        self._check_open()
        x = self._value("reshape", x)
        dims = check_shape(shape)
        if math.prod(dims) != math.prod(x.shape):  # Python ints: exact at any size
            raise ShapeError(f"reshape: cannot view {x.shape} as {dims}: element counts differ")
        return self._emit("reshape", [x], dims, x.dtype, shape=dims)

    @_located
    def typecast(self, x: Value, dtype: DataType, *, loc: str | None = None) -> Value:
        """x in another dtype (float to int truncates and saturates; see `ops`)."""
        self._check_open()
        x = self._value("typecast", x)
        if not isinstance(dtype, DataType):
            raise LayoutError(f"typecast: dtype must be a tt.DataType, got {dtype!r}")
        return self._emit("typecast", [x], x.shape, dtype, dtype=dtype.value)

    # -- the ops of format version 2 -----------------------------------------------------------

    @_located
    def eq(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a == other, else 0 (as `gt`)."""
        return self._binary("eq", a, other)

    @_located
    def ne(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a != other, else 0 (as `gt`; NaN != NaN is 1)."""
        return self._binary("ne", a, other)

    @_located
    def lt(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a < other, else 0 (as `gt`)."""
        return self._binary("lt", a, other)

    @_located
    def le(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a <= other, else 0 (as `gt`)."""
        return self._binary("le", a, other)

    @_located
    def ge(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """1 where a >= other, else 0 (as `gt`)."""
        return self._binary("ge", a, other)

    @_located
    def maximum(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """The elementwise larger of a and other (np.maximum: NaN wins)."""
        return self._binary("maximum", a, other)

    @_located
    def minimum(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """The elementwise smaller of a and other (np.minimum: NaN wins)."""
        return self._binary("minimum", a, other)

    @_located
    def rsqrt(self, x: Value, *, loc: str | None = None) -> Value:
        """1 / sqrt(x) (floats only; inf at 0, NaN below 0)."""
        return self._unary("rsqrt", x)

    @_located
    def tanh(self, x: Value, *, loc: str | None = None) -> Value:
        """Hyperbolic tangent (floats only)."""
        return self._unary("tanh", x)

    @_located
    def sigmoid(self, x: Value, *, loc: str | None = None) -> Value:
        """1 / (1 + exp(-x)), evaluated so that it never overflows (floats only)."""
        return self._unary("sigmoid", x)

    @_located
    def silu(self, x: Value, *, loc: str | None = None) -> Value:
        """x * sigmoid(x) (floats only; PyTorch's SiLU, a.k.a. swish)."""
        return self._unary("silu", x)

    @_located
    def pow(self, x: Value, p: float, *, loc: str | None = None) -> Value:
        """x ** p for a Python scalar exponent (floats only; NaN for a negative base and a
        non-integral p, as numpy)."""
        self._check_open()
        x = self._value("pow", x)
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)):
            raise ProgramError(f"pow takes a Python scalar exponent, got {type(p).__name__}")
        return self._emit("pow", [x], x.shape, x.dtype, _scalar("pow", x.dtype, p))

    @_located
    def mean(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Mean over `axis`, keeping it with size 1 (floats only)."""
        return self._reduce("mean", x, axis)

    @_located
    def argmax(self, x: Value, axis: int, *, loc: str | None = None) -> Value:
        """Index of the maximum along `axis` (INT32), keeping the axis with size 1; the first
        index on ties, the first NaN's index if there is one (numpy)."""
        self._check_open()
        x = self._value("argmax", x)
        axis = _normalise_axis("argmax", axis, len(x.shape))
        shape = x.shape[:axis] + (1,) + x.shape[axis + 1 :]
        return self._emit("argmax", [x], shape, DataType.INT32, axis=axis)

    @_located
    def argsort(self, x: Value, axis: int = -1, descending: bool = False, *, loc: str | None = None) -> Value:
        """The indices (INT32, x's shape) that sort x along `axis`: stable (equal values keep
        their order), NaN as the largest value (torch.sort(stable=True), np.argsort(kind=
        "stable") ascending). Sorted values are `gather(x, argsort(x), axis)`."""
        self._check_open()
        x = self._value("argsort", x)
        if not isinstance(descending, bool):
            raise ProgramError(f"argsort: descending must be a bool, got {descending!r:.40}")
        axis = _normalise_axis("argsort", axis, len(x.shape))
        return self._emit("argsort", [x], x.shape, DataType.INT32, axis=axis, descending=descending)

    @_located
    def slice(self, x: Value, starts: Sequence[int | None], ends: Sequence[int | None],
              steps: Sequence[int] | None = None, *, loc: str | None = None) -> Value:
        """`x[starts[0]:ends[0]:steps[0], ...]`: Python's clamping and negative indices, None
        for an open end, positive steps; fewer entries than x's rank slice the leading axes."""
        self._check_open()
        x = self._value("slice", x)
        first, last = _ints("slice", "starts", starts, True), _ints("slice", "ends", ends, True)
        step = [1] * len(first) if steps is None else _ints("slice", "steps", steps)
        if not len(first) == len(last) == len(step) <= len(x.shape):
            raise ShapeError(
                f"slice: starts, ends and steps need one entry per sliced axis (at most {len(x.shape)} "
                f"for {x.shape}), got {len(first)}, {len(last)} and {len(step)}"
            )
        if any(s < 1 for s in step):
            raise ShapeError(f"slice: steps must be positive, got {tuple(step)}")
        full = len(x.shape) - len(first)
        bounds = [slice(a, e, s).indices(dim) for a, e, s, dim in
                  zip(first + [None] * full, last + [None] * full, step + [1] * full, x.shape)]
        shape = tuple(len(range(*b)) for b in bounds)
        if 0 in shape:
            raise ShapeError(f"slice: {x.shape}[{_slice_text(bounds)}] is empty")
        return self._emit("slice", [x], shape, x.dtype, starts=tuple(b[0] for b in bounds),
                          ends=tuple(b[1] for b in bounds), steps=tuple(b[2] for b in bounds))

    @_located
    def concat(self, values: Sequence[Value], axis: int, *, loc: str | None = None) -> Value:
        """The values joined along `axis` (np.concatenate); the other dims must agree."""
        self._check_open()
        if isinstance(values, Value) or not isinstance(values, (list, tuple)) or not values:
            raise ProgramError("concat takes a non-empty list of values: b.concat([x, y], axis)")
        vs = [self._value("concat", v) for v in values]
        rank = len(vs[0].shape)
        axis = _normalise_axis("concat", axis, rank)
        for v in vs:
            if len(v.shape) != rank or v.shape[:axis] + v.shape[axis + 1 :] != vs[0].shape[:axis] + vs[0].shape[axis + 1 :]:
                raise ShapeError(
                    f"concat along axis {axis}: {[v.shape for v in vs]} differ in another dim or in rank"
                )
        dtype = vs[0].dtype
        for v in vs[1:]:
            dtype = _result_dtype("concat", dtype, v.dtype)
        shape = vs[0].shape[:axis] + (sum(v.shape[axis] for v in vs),) + vs[0].shape[axis + 1 :]
        return self._emit("concat", vs, shape, dtype, axis=axis)

    @_located
    def permute(self, x: Value, axes: Sequence[int], *, loc: str | None = None) -> Value:
        """x's dims reordered: result dim i is x's dim axes[i] (np.transpose, torch.permute)."""
        self._check_open()
        x = self._value("permute", x)
        rank = len(x.shape)
        given = _ints("permute", "axes", axes)
        perm = tuple(a % rank if -rank <= a < rank else -1 for a in given)
        if sorted(perm) != list(range(rank)):
            raise ShapeError(f"permute: axes {tuple(given)} are not a permutation of the {rank} dims of {x.shape}")
        return self._emit("permute", [x], tuple(x.shape[a] for a in perm), x.dtype, axes=perm)

    @_located
    def embedding(self, ids: Value, table: Value, *, loc: str | None = None) -> Value:
        """Rows of `table` [V, D] picked by the INT32 or UINT32 `ids` (any shape): the result is
        ids.shape + (D,) in the table's dtype. Ids out of range are clamped (see above)."""
        self._check_open()
        ids, table = self._value("embedding", ids), self._value("embedding", table)
        if ids.dtype.is_float:
            raise LayoutError(f"embedding: ids must be INT32 or UINT32, got {ids.dtype.name}; typecast them")
        if len(table.shape) != 2:
            raise ShapeError(f"embedding: the table must be [vocabulary, dim], got {table.shape}")
        return self._emit("embedding", [ids, table], ids.shape + table.shape[1:], table.dtype)

    @_located
    def where(self, cond: Value, a: Value | float, b: Value | float, *, loc: str | None = None) -> Value:
        """`a` where cond is nonzero, else `b` (np.where); cond of any dtype, `a` and `b`
        values or Python scalars (at least one a value, which gives the dtype); all broadcast."""
        self._check_open()
        cond = self._value("where", cond)
        branches: list[Value] = []
        scalars: list[float | None] = []
        for branch in (a, b):
            if isinstance(branch, (bool, np.bool_)):
                raise ProgramError("where: a boolean operand is ambiguous; use 0 or 1")
            if isinstance(branch, (int, float, np.integer, np.floating)):
                scalars.append(float(branch))
            else:
                branches.append(self._value("where", branch))
                scalars.append(None)
        if not branches:
            raise ProgramError("where needs a value for a or b (it gives the dtype); typecast cond instead")
        dtype = branches[0].dtype
        for v in branches[1:]:
            dtype = _result_dtype("where", dtype, v.dtype)
        scalars = [None if s is None else _scalar("where", dtype, s) for s in scalars]
        shape: tuple[int, ...] | None = cond.shape
        for v in branches:
            shape = _broadcast(shape, v.shape) if shape is not None else None
        if shape is None:
            raise ShapeError(
                f"where: shapes {cond.shape} and {[v.shape for v in branches]} do not broadcast"
            )
        return self._emit("where", [cond, *branches], shape, dtype, a_scalar=scalars[0], b_scalar=scalars[1])

    def _affine(self, op: str, x: Value, name: str, v: Value | None) -> Value | None:
        """A norm's weight or bias: None, or a float value of shape (..., D) or (..., 1) with
        every leading dim 1 and no more dims than x."""
        if v is None:
            return None
        v = self._value(op, v)
        if not v.dtype.is_float:
            raise LayoutError(f"{op}: {name} must be a float, got {v.dtype.name}")
        if (math.prod(v.shape[:-1]) != 1 or v.shape[-1] not in (1, x.shape[-1])
                or len(v.shape) > len(x.shape)):
            raise ShapeError(f"{op}: {name} of shape {v.shape} does not fit the last dim of {x.shape}")
        return v

    @_located
    def layer_norm(self, x: Value, weight: Value | None = None, bias: Value | None = None,
                   eps: float = 1e-5, *, loc: str | None = None) -> Value:
        """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, the variance biased
        (PyTorch's layer_norm); weight and bias (D,) or left out; the result in x's dtype."""
        self._check_open()
        x = self._value("layer_norm", x)
        w, bb = self._affine("layer_norm", x, "weight", weight), self._affine("layer_norm", x, "bias", bias)
        eps = _number("layer_norm", "eps", eps)
        inputs = [v for v in (x, w, bb) if v is not None]
        return self._emit("layer_norm", inputs, x.shape, x.dtype, eps=eps,
                          has_weight=w is not None, has_bias=bb is not None)

    @_located
    def rms_norm(self, x: Value, weight: Value | None = None, eps: float = 1e-5, *, loc: str | None = None) -> Value:
        """x / sqrt(mean(x**2) + eps) * weight over the last dim (no bias; weight (D,) or left
        out); the result in x's dtype."""
        self._check_open()
        x = self._value("rms_norm", x)
        w = self._affine("rms_norm", x, "weight", weight)
        eps = _number("rms_norm", "eps", eps)
        inputs = [x] if w is None else [x, w]
        return self._emit("rms_norm", inputs, x.shape, x.dtype, eps=eps, has_weight=w is not None)

    @_located
    def arange(self, start: float, stop: float, step: float = 1,
               dtype: DataType = DataType.INT32, *, loc: str | None = None) -> Value:
        """[start, start + step, ...) below `stop` (above it for a negative step), numpy's
        arange: ceil((stop - start) / step) elements. Needs no input; integer dtypes take
        integral bounds whose elements fit the type."""
        self._check_open()
        if not isinstance(dtype, DataType):
            raise LayoutError(f"arange: dtype must be a tt.DataType, got {dtype!r}")
        bounds = [_number("arange", name, v) for name, v in (("start", start), ("stop", stop), ("step", step))]
        if bounds[2] == 0:
            raise ProgramError("arange: step must be nonzero")
        if not math.isfinite((bounds[1] - bounds[0]) / bounds[2]):
            raise ShapeError(f"arange({start}, {stop}, {step}) has too many elements to count")
        if dtype.is_float:
            first, end, by = bounds
            n = arange_length(first, end, by)
            attrs_: dict[str, Any] = {"start": first, "stop": end, "step": by}
        else:
            if not all(v.is_integer() and abs(v) <= 2.0**53 for v in bounds):
                raise LayoutError(f"arange: {dtype.name} takes integral bounds, got {start!r}, {stop!r}, {step!r}")
            first, end, by = (int(v) for v in bounds)
            n = arange_length(first, end, by)
            low, high = (-(2**31), 2**31 - 1) if dtype is DataType.INT32 else (0, 2**32 - 1)
            if n and not (low <= first <= high and low <= first + (n - 1) * by <= high):
                raise LayoutError(f"arange({start}, {stop}, {step}) does not fit {dtype.name}")
            attrs_ = {"start": first, "stop": end, "step": by}
        if n == 0:
            raise ShapeError(f"arange({start}, {stop}, {step}) is empty")
        return self._emit("arange", [], (n,), dtype, dtype=dtype.value, **attrs_)

    @_located
    def conv2d(self, x: Value, weight: Value, bias: Value | None = None, stride: int | Sequence[int] = 1,
               padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1,
               groups: int = 1, *, loc: str | None = None) -> Value:
        """2-D convolution (cross-correlation, as PyTorch's): x NHWC [N, H, W, C_in] (as ttnn),
        weight [C_out, C_in / groups, kH, kW] (PyTorch's), bias (C_out,); the result NHWC
        [N, H_out, W_out, C_out]. Floats only."""
        self._check_open()
        x, weight = self._value("conv2d", x), self._value("conv2d", weight)
        b = None if bias is None else self._value("conv2d", bias)
        if len(x.shape) != 4 or len(weight.shape) != 4:
            raise ShapeError(
                f"conv2d takes x [N, H, W, C_in] and weight [C_out, C_in/groups, kH, kW], got {x.shape} and {weight.shape}"
            )
        s, p, d = (_pair("conv2d", "stride", stride, 1), _pair("conv2d", "padding", padding, 0),
                   _pair("conv2d", "dilation", dilation, 1))
        g = _int("conv2d", "groups", groups, 1)
        c_in, (c_out, c_in_g, kh, kw) = x.shape[3], weight.shape
        if c_in % g or c_out % g or c_in_g * g != c_in:
            raise ShapeError(
                f"conv2d: x {x.shape} with {c_in} channels and weight {weight.shape} do not fit groups={g} "
                f"(the weight's dim 1 must be C_in / groups, C_out a multiple of groups)"
            )
        if b is not None and b.shape != (c_out,):
            raise ShapeError(f"conv2d: bias must have shape ({c_out},), got {b.shape}")
        out_hw = (_window_size(x.shape[1], kh, s[0], p[0], d[0]),
                  _window_size(x.shape[2], kw, s[1], p[1], d[1]))
        if min(out_hw) < 1:
            raise ShapeError(
                f"conv2d: kernel ({kh}, {kw}) with dilation {d} is larger than the padded input {x.shape}"
            )
        dtype = _result_dtype("conv2d", x.dtype, weight.dtype)
        if b is not None:
            dtype = _result_dtype("conv2d", dtype, b.dtype)
        inputs = [x, weight] if b is None else [x, weight, b]
        return self._emit("conv2d", inputs, (x.shape[0], *out_hw, c_out), dtype, stride=s, padding=p,
                          dilation=d, groups=g, has_bias=b is not None)

    def _pool(self, op: str, x: Value, kernel_size: int | Sequence[int],
              stride: int | Sequence[int] | None, padding: int | Sequence[int]) -> Value:
        self._check_open()
        x = self._value(op, x)
        k, s, p, out_shape = _pool_geometry(op, "x", x.shape, kernel_size, stride, padding)
        return self._emit(op, [x], out_shape, x.dtype, kernel_size=k, stride=s, padding=p)

    @_located
    def max_pool2d(self, x: Value, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
                   padding: int | Sequence[int] = 0, *, loc: str | None = None) -> Value:
        """Window maxima of NHWC x (stride defaults to the kernel; -inf padding, at most half
        the kernel)."""
        return self._pool("max_pool2d", x, kernel_size, stride, padding)

    @_located
    def avg_pool2d(self, x: Value, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
                   padding: int | Sequence[int] = 0, *, loc: str | None = None) -> Value:
        """Window means of NHWC x (stride defaults to the kernel; zero padding counted in the
        divisor, PyTorch's count_include_pad=True). Floats only."""
        return self._pool("avg_pool2d", x, kernel_size, stride, padding)

    @_located
    def update_cache(self, cache: Value, value: Value, index: Value, *, loc: str | None = None) -> Value:
        """A copy of `cache` [..., max_seq, d] with row `index` of axis -2 replaced by `value`
        [..., 1, d] (its batch dims broadcast to the cache's; rounded to the cache's dtype).
        `index` is an INT32 or UINT32 value of shape (1,), clamped into [0, max_seq - 1] at run
        time (as JAX's dynamic_update_slice)."""
        self._check_open()
        cache, value, index = (self._value("update_cache", v) for v in (cache, value, index))
        if len(cache.shape) < 2 or len(value.shape) < 2:
            raise ShapeError(f"update_cache takes cache [..., max_seq, d] and value [..., 1, d], "
                             f"got {cache.shape} and {value.shape}")
        batch = _broadcast(value.shape[:-2], cache.shape[:-2])
        if value.shape[-2:] != (1, cache.shape[-1]) or batch != cache.shape[:-2]:
            raise ShapeError(
                f"update_cache: value {value.shape} is not one row [..., 1, {cache.shape[-1]}] "
                f"whose batch dims broadcast to the cache's {cache.shape}"
            )
        if value.dtype.is_float != cache.dtype.is_float or (not cache.dtype.is_float and value.dtype is not cache.dtype):
            raise LayoutError(
                f"update_cache: a {value.dtype.name} value cannot go into a {cache.dtype.name} cache; typecast it"
            )
        if index.dtype.is_float:
            raise LayoutError(f"update_cache: the index must be INT32 or UINT32, got {index.dtype.name}")
        if index.shape != (1,):
            raise ShapeError(f"update_cache: the index must have shape (1,), got {index.shape}")
        return self._emit("update_cache", [cache, value, index], cache.shape, cache.dtype)

    # -- the ops of format version 3 -----------------------------------------------------------

    @_located
    def div(self, a: Value, other: Value | float, *, loc: str | None = None) -> Value:
        """a / other, true division (torch.div, np.divide); `other` a value (numpy
        broadcasting) or a Python scalar. Floats only: inf for x / 0, NaN for 0 / 0."""
        self._check_open()
        a = self._value("div", a)
        b_dtype = other.dtype if isinstance(other, Value) else a.dtype
        if not (a.dtype.is_float and b_dtype.is_float):
            raise LayoutError(
                f"div needs float operands, got {a.dtype.name} and {b_dtype.name}; typecast them first"
            )
        return self._binary("div", a, other)

    @_located
    def log(self, x: Value, *, loc: str | None = None) -> Value:
        """Natural logarithm (floats only; -inf at 0, NaN below 0)."""
        return self._unary("log", x)

    @_located
    def erf(self, x: Value, *, loc: str | None = None) -> Value:
        """The error function (floats only; torch.erf)."""
        return self._unary("erf", x)

    @_located
    def sin(self, x: Value, *, loc: str | None = None) -> Value:
        """sin(x) (floats only; torch.sin)."""
        return self._unary("sin", x)

    @_located
    def cos(self, x: Value, *, loc: str | None = None) -> Value:
        """cos(x) (floats only; torch.cos)."""
        return self._unary("cos", x)

    @_located
    def floor(self, x: Value, *, loc: str | None = None) -> Value:
        """The largest integer <= x, as a float (floats only; torch.floor)."""
        return self._unary("floor", x)

    @_located
    def ceil(self, x: Value, *, loc: str | None = None) -> Value:
        """The smallest integer >= x, as a float (floats only; torch.ceil)."""
        return self._unary("ceil", x)

    @_located
    def round(self, x: Value, *, loc: str | None = None) -> Value:
        """x rounded to the nearest integer, halves to even (floats only; torch.round)."""
        return self._unary("round", x)

    @_located
    def trunc(self, x: Value, *, loc: str | None = None) -> Value:
        """x rounded toward zero (floats only; torch.trunc)."""
        return self._unary("trunc", x)

    @_located
    def abs(self, x: Value, *, loc: str | None = None) -> Value:
        """|x| (any dtype; INT32's -2**31 stays -2**31, as two's complement wraps)."""
        return self._unary("abs", x)

    @_located
    def full(self, shape: Sequence[int], value: float, dtype: DataType = DataType.FLOAT32,
             *, loc: str | None = None) -> Value:
        """A constant of `shape` with every element `value` (torch.full, np.full); needs no
        input. Floats take any number but NaN (infinities too, as an attention mask's -inf,
        except BFLOAT8_B, which cannot hold them); integer dtypes take integral values that fit."""
        self._check_open()
        if not isinstance(dtype, DataType):
            raise LayoutError(f"full: dtype must be a tt.DataType, got {dtype!r}")
        dims = check_shape(shape)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ProgramError(f"full: value must be a number, got {value!r:.40}")
        fill: float | int
        if isinstance(value, (int, np.integer)) and not dtype.is_float:
            fill = int(value)
        else:
            number = float(value)
            if number != number:
                raise ProgramError("full: value must not be NaN")
            if dtype.is_float:
                if dtype is DataType.BFLOAT8_B and not math.isfinite(number):
                    raise LayoutError(f"full: BFLOAT8_B cannot hold {number}; use BFLOAT16 or FLOAT32")
                fill = number
            elif not number.is_integer():
                raise LayoutError(f"full: {dtype.name} takes an integral value, got {value!r}")
            else:
                fill = int(number)
        if not dtype.is_float:
            low, high = (-(2**31), 2**31 - 1) if dtype is DataType.INT32 else (0, 2**32 - 1)
            if not low <= fill <= high:
                raise LayoutError(f"full: {value!r} does not fit {dtype.name}")
        return self._emit("full", [], dims, dtype, dtype=dtype.value, shape=dims, value=fill)

    @_located
    def broadcast_to(self, x: Value, shape: Sequence[int], *, loc: str | None = None) -> Value:
        """x broadcast to `shape` by numpy's rule (np.broadcast_to, torch.expand), the result
        materialised: every dim of x is 1 or `shape`'s, and `shape` has at least x's rank."""
        self._check_open()
        x = self._value("broadcast_to", x)
        dims = check_shape(shape)
        if len(dims) < len(x.shape) or _broadcast(x.shape, dims) != dims:
            raise ShapeError(f"broadcast_to: {x.shape} does not broadcast to {dims}")
        return self._emit("broadcast_to", [x], dims, x.dtype, shape=dims)

    @_located
    def rand(self, shape: Sequence[int], seed: Value, *, loc: str | None = None) -> Value:
        """Uniform FLOAT32 numbers in [0, 1) of `shape` (torch.rand), from an INT32 or UINT32
        `seed` value with one element (shape (1,) or (1, 1), say): a counter-based generator
        (Philox4x32-10, see `docs/ops.md`), so each element is a function of the seed and its
        row-major index alone: the same seed gives the same numbers on any device or host."""
        self._check_open()
        seed = self._value("rand", seed)
        dims = check_shape(shape)
        if seed.dtype.is_float:
            raise LayoutError(f"rand: the seed must be INT32 or UINT32, got {seed.dtype.name}; typecast it")
        if math.prod(seed.shape) != 1:
            raise ShapeError(f"rand: the seed must have one element (shape (1,) or (1, 1)), got {seed.shape}")
        return self._emit("rand", [seed], dims, DataType.FLOAT32, shape=dims)

    @_located
    def gather(self, x: Value, index: Value, axis: int, *, loc: str | None = None) -> Value:
        """`np.take_along_axis(x, index, axis)` and `torch.gather(x, axis, index)`: result[i][j]
        [k] = x[i][index[i][j][k]][k] for axis 1, in x's dtype with index's shape. `index` is
        INT32 or UINT32 of x's rank; along every other dim it is no longer than x (PyTorch's
        rule: x's leading part is read) or x's dim is 1 (numpy's broadcast). Indices are clamped
        into [0, x.shape[axis] - 1] at run time, as embedding's ids (numpy would wrap a
        negative one, PyTorch raises)."""
        self._check_open()
        x, index = self._value("gather", x), self._value("gather", index)
        if index.dtype.is_float:
            raise LayoutError(f"gather: the index must be INT32 or UINT32, got {index.dtype.name}; typecast it")
        rank = len(x.shape)
        axis = _normalise_axis("gather", axis, rank)
        if len(index.shape) != rank or any(
            d != axis and not (i <= n or n == 1) for d, (i, n) in enumerate(zip(index.shape, x.shape))
        ):
            raise ShapeError(
                f"gather along axis {axis}: index {index.shape} must have the rank of x {x.shape} and, in every "
                "other dim, be no longer than x (or x's dim 1)"
            )
        return self._emit("gather", [x, index], index.shape, x.dtype, axis=axis)

    @_located
    def embedding_grad(self, ids: Value, grad: Value, num_rows: int, padding_idx: int | None = None,
                       *, loc: str | None = None) -> Value:
        """The gradient of `embedding(ids, table)` with respect to a [num_rows, D] table
        (aten.embedding_dense_backward): each row of `grad` (ids.shape + (D,)) summed into the
        row its id names (np.add.at), ids clamped as embedding clamps them, so the gradient goes
        to the row the forward read. Row `padding_idx` (negative counts from the end) gets no
        gradient, as PyTorch's. Floats only; the result in grad's dtype."""
        self._check_open()
        ids, grad = self._value("embedding_grad", ids), self._value("embedding_grad", grad)
        if ids.dtype.is_float:
            raise LayoutError(f"embedding_grad: ids must be INT32 or UINT32, got {ids.dtype.name}; typecast them")
        rows = _int("embedding_grad", "num_rows", num_rows, 1)
        if len(grad.shape) != len(ids.shape) + 1 or grad.shape[:-1] != ids.shape:
            raise ShapeError(f"embedding_grad: grad {grad.shape} must be ids.shape + (D,), ids {ids.shape}")
        pad = None
        if padding_idx is not None:
            pad = _int("embedding_grad", "padding_idx", padding_idx)
            if not -rows <= pad < rows:
                raise ShapeError(f"embedding_grad: padding_idx {pad} is out of range for {rows} rows")
            pad %= rows
        return self._emit("embedding_grad", [ids, grad], (rows, grad.shape[-1]), grad.dtype,
                          num_rows=rows, padding_idx=pad)

    # -- collectives (format version 7): values exchanged with the other chips of a mesh -------

    def _collective(self, op: str, x: Value, cluster_axis: Any) -> tuple[Value, int | None, int]:
        """x checked for a collective, the group's axis and its size: the chips that differ only
        in coordinate `cluster_axis` (0: a column's, 1: a row's), or every chip (None). The size
        is the builder's mesh's (1 while it has none: resolved again at submit)."""
        self._check_open()
        x = self._value(op, x)
        if cluster_axis is not None:
            cluster_axis = _int(op, "cluster_axis", cluster_axis)
            if cluster_axis not in (0, 1):
                raise ShapeError(f"{op}: cluster_axis is 0 (the chips of a mesh column), 1 (of a mesh row) "
                                 f"or None (every chip), got {cluster_axis}")
        rows, cols = self.mesh_shape or (1, 1)
        size = rows * cols if cluster_axis is None else (rows, cols)[cluster_axis]
        return x, cluster_axis, size

    @staticmethod
    def _whole_tiles(op: str, x: Value, n: int, dims: dict[int, int]) -> None:
        """A BFLOAT8_B value crosses links as its packed tiles are (each 16-value face row shares
        one exponent, so a chunk cut inside a tile would pack to other bytes and values): when a
        group of `n` > 1 chips cuts or joins it along one of its last two dims, each chunk's size
        along that dim (`dims`: dim -> size) must be whole 32-wide tiles (ShapeError)."""
        if x.dtype is not DataType.BFLOAT8_B or n <= 1:
            return
        rank = len(x.shape)
        for dim, size in dims.items():
            if dim >= rank - 2 and size % 32:
                raise ShapeError(
                    f"{op}: a BFLOAT8_B value of {x.shape} crosses links as whole packed 32x32 tiles, "
                    f"but a group of {n} chips cuts or joins it along dim {dim} in chunks of {size}, not a "
                    "multiple of 32 (a chunk would split tiles, whose rows share exponents): make that "
                    "dim's chunks whole tiles, or typecast to BFLOAT16 first")

    def _coord(self, op: str, name: str, coord: Any) -> tuple[int, int]:
        """A chip's mesh coordinate (row, col), inside the builder's mesh when it has one."""
        if not isinstance(coord, (list, tuple)) or len(coord) != 2:
            raise ShapeError(f"{op}: {name} is a mesh coordinate (row, col), got {coord!r:.40}")
        r, c = _int(op, name, coord[0], 0), _int(op, name, coord[1], 0)
        if self.mesh_shape is not None and not (r < self.mesh_shape[0] and c < self.mesh_shape[1]):
            rows, cols = self.mesh_shape
            raise ShapeError(f"{op}: {name} {(r, c)} is outside the {rows}x{cols} mesh")
        return r, c

    @_located
    def all_gather(self, x: Value, dim: int, cluster_axis: int | None = None, *, loc: str | None = None) -> Value:
        """The group's values joined along `dim` in mesh-coordinate order along the group
        (ttnn.all_gather): every chip of the group gets the same result, `dim` N times longer
        for a group of N chips. A BFLOAT8_B value moves as its packed tiles: along one of its
        last two dims each chip's size must be a multiple of 32 (ShapeError)."""
        x, axis_, n = self._collective("all_gather", x, cluster_axis)
        dim = _normalise_axis("all_gather", dim, len(x.shape))
        self._whole_tiles("all_gather", x, n, {dim: x.shape[dim]})
        shape = x.shape[:dim] + (x.shape[dim] * n,) + x.shape[dim + 1:]
        return self._emit("all_gather", [x], shape, x.dtype, dim=dim, cluster_axis=axis_)

    @_located
    def reduce_scatter(self, x: Value, dim: int, cluster_axis: int | None = None, *, loc: str | None = None) -> Value:
        """The sum of the group's values, split along `dim` into N equal parts, the k-th chip
        of the group (in mesh-coordinate order) keeping part k (ttnn.reduce_scatter, Sum only).
        `dim` must split evenly over the group (ShapeError, here or at submit); a BFLOAT8_B
        value's parts along one of its last two dims must be whole tiles (multiples of 32), and its
        partial sums are rounded to BFLOAT8_B before they cross a link."""
        x, axis_, n = self._collective("reduce_scatter", x, cluster_axis)
        dim = _normalise_axis("reduce_scatter", dim, len(x.shape))
        if x.shape[dim] % n:
            raise ShapeError(f"reduce_scatter: dim {dim} of {x.shape} has size {x.shape[dim]}, which a group "
                             f"of {n} chips cannot split evenly")
        self._whole_tiles("reduce_scatter", x, n, {dim: x.shape[dim] // n})
        shape = x.shape[:dim] + (x.shape[dim] // n,) + x.shape[dim + 1:]
        return self._emit("reduce_scatter", [x], shape, x.dtype, dim=dim, cluster_axis=axis_)

    @_located
    def all_reduce(self, x: Value, cluster_axis: int | None = None, *, loc: str | None = None) -> Value:
        """The sum of the group's values on every chip of the group (ttnn.all_reduce, Sum
        only); x's shape and dtype. Integers wrap as the device's additions do; a BFLOAT8_B
        value's parts are whole tiles, its partial sums rounded to BFLOAT8_B as they cross."""
        x, axis_, _ = self._collective("all_reduce", x, cluster_axis)
        return self._emit("all_reduce", [x], x.shape, x.dtype, cluster_axis=axis_)

    @_located
    def broadcast(self, x: Value, sender: tuple[int, int], *, loc: str | None = None) -> Value:
        """The value of the chip at mesh coordinate `sender` (row, col), on every chip
        (ttnn.broadcast); x's shape and dtype."""
        x, _, _ = self._collective("broadcast", x, None)
        return self._emit("broadcast", [x], x.shape, x.dtype, sender=self._coord("broadcast", "sender", sender))

    @_located
    def point_to_point(self, x: Value, sender: tuple[int, int], receiver: tuple[int, int],
                       *, loc: str | None = None) -> Value:
        """x sent from the chip at mesh coordinate `sender` to the chip at `receiver`
        (ttnn.point_to_point): the receiver's result is the sender's x, every other chip's its
        own x (tt-mlir's rule). x's shape and dtype."""
        x, _, _ = self._collective("point_to_point", x, None)
        return self._emit("point_to_point", [x], x.shape, x.dtype,
                          sender=self._coord("point_to_point", "sender", sender),
                          receiver=self._coord("point_to_point", "receiver", receiver))

    @_located
    def all_to_all(self, x: Value, split_dim: int, concat_dim: int, cluster_axis: int | None = None,
                   *, loc: str | None = None) -> Value:
        """Each chip splits x along `split_dim` into N parts, sends part k to the k-th chip of
        the group, and joins the parts it receives along `concat_dim` in mesh-coordinate order
        (ttnn.all_to_all): `split_dim` N times shorter, `concat_dim` N times longer."""
        x, axis_, n = self._collective("all_to_all", x, cluster_axis)
        split = _normalise_axis("all_to_all", split_dim, len(x.shape))
        concat = _normalise_axis("all_to_all", concat_dim, len(x.shape))
        if x.shape[split] % n:
            raise ShapeError(f"all_to_all: split dim {split} of {x.shape} has size {x.shape[split]}, which a "
                             f"group of {n} chips cannot split evenly")
        part = list(x.shape)
        part[split] //= n
        self._whole_tiles("all_to_all", x, n, {split: part[split], concat: part[concat]})
        shape = list(x.shape)
        shape[split] //= n
        shape[concat] *= n
        return self._emit("all_to_all", [x], tuple(shape), x.dtype, split_dim=split, concat_dim=concat,
                          cluster_axis=axis_)

    # -- gradients of conv2d and the pools (the same conventions as the forward ops) --------------

    @_located
    def conv2d_input_grad(self, grad: Value, weight: Value, input_shape: Sequence[int],
                          stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                          dilation: int | Sequence[int] = 1, groups: int = 1, *, loc: str | None = None) -> Value:
        """The gradient of `conv2d(x, weight, ...)` with respect to x, given the gradient of
        its result: `grad` NHWC [N, H_out, W_out, C_out], `weight` [C_out, C_in / groups, kH,
        kW]; the result NHWC `input_shape` (it resolves H and W where a stride leaves them
        ambiguous). A transposed convolution, as aten.convolution_backward's grad_input.
        Floats only; the binary rule of grad and weight gives the dtype."""
        self._check_open()
        op = "conv2d_input_grad"
        grad, weight = self._value(op, grad), self._value(op, weight)
        x_shape = check_shape(input_shape)
        if len(x_shape) != 4 or len(grad.shape) != 4 or len(weight.shape) != 4:
            raise ShapeError(f"{op} takes grad [N, H_out, W_out, C_out], weight [C_out, C_in/groups, kH, kW] and "
                             f"input_shape [N, H, W, C_in], got {grad.shape}, {weight.shape} and {x_shape}")
        geometry = _conv_geometry(op, x_shape, weight.shape, grad.shape, stride, padding, dilation, groups)
        return self._emit(op, [grad, weight], x_shape, _result_dtype(op, grad.dtype, weight.dtype),
                          input_shape=x_shape, **geometry)

    @_located
    def conv2d_weight_grad(self, x: Value, grad: Value, weight_shape: Sequence[int],
                           stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                           dilation: int | Sequence[int] = 1, groups: int = 1, *, loc: str | None = None) -> Value:
        """The gradient of `conv2d(x, weight, ...)` with respect to the weight, given the
        gradient of its result: x NHWC [N, H, W, C_in], `grad` NHWC [N, H_out, W_out, C_out];
        the result [C_out, C_in / groups, kH, kW] = `weight_shape` (PyTorch's layout), as
        aten.convolution_backward's grad_weight (the bias's is `grad` summed over N, H, W).
        Floats only; the binary rule of x and grad gives the dtype."""
        self._check_open()
        op = "conv2d_weight_grad"
        x, grad = self._value(op, x), self._value(op, grad)
        w_shape = check_shape(weight_shape)
        if len(x.shape) != 4 or len(grad.shape) != 4 or len(w_shape) != 4:
            raise ShapeError(f"{op} takes x [N, H, W, C_in], grad [N, H_out, W_out, C_out] and weight_shape "
                             f"[C_out, C_in/groups, kH, kW], got {x.shape}, {grad.shape} and {w_shape}")
        geometry = _conv_geometry(op, x.shape, w_shape, grad.shape, stride, padding, dilation, groups)
        return self._emit(op, [x, grad], w_shape, _result_dtype(op, x.dtype, grad.dtype),
                          weight_shape=w_shape, **geometry)

    @_located
    def max_pool2d_backward(self, x: Value, grad: Value, kernel_size: int | Sequence[int],
                            stride: int | Sequence[int] | None = None,
                            padding: int | Sequence[int] = 0, *, loc: str | None = None) -> Value:
        """The gradient of `max_pool2d(x, ...)` with respect to x, given the gradient of its
        result (NHWC, the pool's output shape): each window's gradient goes to the element
        PyTorch's CPU kernel picks, the first maximum in row-major window order (a later NaN
        wins over a number and over an earlier NaN; padding never), and overlapping windows add
        up. The result has x's shape and grad's dtype."""
        self._check_open()
        op = "max_pool2d_backward"
        x, grad = self._value(op, x), self._value(op, grad)
        k, s, p, out_shape = _pool_geometry(op, "x", x.shape, kernel_size, stride, padding)
        if grad.shape != out_shape:
            raise ShapeError(f"{op}: grad {grad.shape} is not the pool's output shape {out_shape} for x {x.shape}")
        return self._emit(op, [x, grad], x.shape, grad.dtype, kernel_size=k, stride=s, padding=p)

    @_located
    def avg_pool2d_backward(self, grad: Value, input_shape: Sequence[int], kernel_size: int | Sequence[int],
                            stride: int | Sequence[int] | None = None, padding: int | Sequence[int] = 0,
                            count_include_pad: bool = True, *, loc: str | None = None) -> Value:
        """The gradient of `avg_pool2d(x, ...)` with respect to x (NHWC `input_shape`), given
        the gradient of its result: each window's gradient divided by its divisor and spread
        over the window (overlaps add up). The divisor is kH * kW (`count_include_pad=True`, the
        forward's rule) or the number of the window's elements inside the input (False, as
        PyTorch's). Floats only; the result in grad's dtype."""
        self._check_open()
        op = "avg_pool2d_backward"
        grad = self._value(op, grad)
        x_shape = check_shape(input_shape)
        if not isinstance(count_include_pad, (bool, np.bool_)):
            raise ProgramError(f"{op}: count_include_pad must be a bool, got {count_include_pad!r:.40}")
        k, s, p, out_shape = _pool_geometry(op, "input_shape", x_shape, kernel_size, stride, padding)
        if grad.shape != out_shape:
            raise ShapeError(f"{op}: grad {grad.shape} is not the pool's output shape {out_shape} for input {x_shape}")
        return self._emit(op, [grad], x_shape, grad.dtype, input_shape=x_shape, kernel_size=k, stride=s,
                          padding=p, count_include_pad=bool(count_include_pad))


def _pool_geometry(op: str, what: str, shape: tuple[int, ...], kernel_size: Any, stride: Any,
                   padding: Any) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, ...]]:
    """A pool's kernel, stride and padding pairs and its NHWC output shape, checked as PyTorch
    checks them (padding at most half the kernel, an output of at least one pixel)."""
    if len(shape) != 4:
        raise ShapeError(f"{op} takes {what} in NHWC [N, H, W, C], got {shape}")
    k = _pair(op, "kernel_size", kernel_size, 1)
    s = k if stride is None else _pair(op, "stride", stride, 1)
    p = _pair(op, "padding", padding, 0)
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ShapeError(f"{op}: padding {p} is more than half the kernel {k} (as PyTorch refuses)")
    out_hw = (_window_size(shape[1], k[0], s[0], p[0], 1), _window_size(shape[2], k[1], s[1], p[1], 1))
    if min(out_hw) < 1:
        raise ShapeError(f"{op}: kernel {k} is larger than the padded input {shape}")
    return k, s, p, (shape[0], *out_hw, shape[3])


def _conv_geometry(op: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...], grad_shape: tuple[int, ...],
                   stride: Any, padding: Any, dilation: Any, groups: Any) -> dict[str, Any]:
    """The canonical stride, padding, dilation and groups of a conv2d gradient, after checking
    that x, the weight and the result's gradient fit one conv2d (as `conv2d` checks them)."""
    s, p, d = _pair(op, "stride", stride, 1), _pair(op, "padding", padding, 0), _pair(op, "dilation", dilation, 1)
    g = _int(op, "groups", groups, 1)
    c_in, (c_out, c_in_g, kh, kw) = x_shape[3], w_shape
    if c_in % g or c_out % g or c_in_g * g != c_in:
        raise ShapeError(f"{op}: x {x_shape} with {c_in} channels and weight {w_shape} do not fit groups={g} "
                         "(the weight's dim 1 must be C_in / groups, C_out a multiple of groups)")
    out_hw = (_window_size(x_shape[1], kh, s[0], p[0], d[0]), _window_size(x_shape[2], kw, s[1], p[1], d[1]))
    if min(out_hw) < 1:
        raise ShapeError(f"{op}: kernel ({kh}, {kw}) with dilation {d} is larger than the padded input {x_shape}")
    if tuple(grad_shape) != (x_shape[0], *out_hw, c_out):
        raise ShapeError(f"{op}: grad {grad_shape} is not conv2d's output shape {(x_shape[0], *out_hw, c_out)} "
                         f"for x {x_shape} and weight {w_shape}")
    return {"stride": s, "padding": p, "dilation": d, "groups": g}


def _mesh_shape(shape: Any) -> tuple[int, int] | None:
    """A builder's mesh shape: None, or (rows, cols) of positive ints."""
    if shape is None:
        return None
    if not isinstance(shape, (list, tuple)) or len(shape) != 2:
        raise ShapeError(f"mesh_shape is (rows, cols), two positive ints, got {shape!r:.40}")
    return _int("ProgramBuilder", "mesh_shape", shape[0], 1), _int("ProgramBuilder", "mesh_shape", shape[1], 1)


def _slice_text(bounds: list[tuple[int, int, int]]) -> str:
    return ", ".join(f"{a}:{e}:{s}" for a, e, s in bounds)


