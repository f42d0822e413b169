"""The builder's plumbing (`BuilderCore`): values, inputs and outputs, locations, range checks,
`build()`, and the helpers every family's op methods share (argument canonicalisation, the
binary dtype rule, numpy broadcasting, window sizes).

The op methods themselves live with their records in `ops/<family>.py`, each family a mixin
of `BuilderCore`; `builder.ProgramBuilder` is all of them. The dtype and shape rules every op
follows are in `builder`'s docstring.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, final

import numpy as np

from .._errors import BinaryFormatError, LayoutError, ProgramError, ShapeError
from .._types import DataType, Layout, MemorySpace, TensorLayout, check_shape
from .program import Program, Step, TensorSpec
from .record import REGISTRY, Kind, checked, zero_divisor

__all__ = ["BuilderCore", "Value", "along_axis", "replay_flag", "replay_optional"]

_DEFAULT_LAYOUT = Layout(MemorySpace.DRAM, TensorLayout.TILE)
_FLOAT_RANK = {DataType.BFLOAT8_B: 0, DataType.BFLOAT16: 1, DataType.FLOAT32: 2}


@final
class Value:
    """A value inside a program being built; pass it to the builder's ops."""

    __slots__ = ("builder", "id", "shape", "dtype")

    def __init__(self, builder: BuilderCore, vid: int, shape: tuple[int, ...], dtype: DataType) -> None:
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


class BuilderCore:
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
        self._cache_constants = False  # set by `cache_constants`
        self._placement: MemorySpace | None = None  # set inside `placing`
        self._placements: list[tuple[int, MemorySpace]] = []


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
        record = REGISTRY[op]
        if record.float_only and not result.is_float:
            raise LayoutError(f"{op} needs a float input, got {result.name}; typecast it first")
        if record.int_only and result.is_float:
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
        if self._placement is not None:
            self._placements.append((out.id, self._placement))

    def cache_constants(self) -> None:
        """The program's steps that read no input (full, arange, constant and what reads only
        them), with those of its constant inputs, run once per device and their results are kept
        for later submits (tt-mlir's `load_cached` of a const-eval function without arguments),
        counted in `stats.const_eval_hits` / `const_eval_misses`."""
        self._check_open()
        self._cache_constants = True

    @contextlib.contextmanager
    def placing(self, memory: MemorySpace) -> Iterator[None]:
        """The values of the steps emitted inside are stored in `memory`, as a compiler's plan
        puts them: DRAM only, or L1 while it fits (DRAM when it is full). The scheduler places
        the others. Nested blocks replace the outer placement."""
        self._check_open()
        if not isinstance(memory, MemorySpace):
            raise ProgramError(f"placing needs a tt.MemorySpace, got {memory!r:.40}")
        outer, self._placement = self._placement, memory
        try:
            yield
        finally:
            self._placement = outer

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
            placements=tuple(self._placements),
            cache_constants=self._cache_constants,
            mesh_shape=self.mesh_shape if any(step.op in REGISTRY and REGISTRY[step.op].kind is Kind.COLLECTIVE
                                            for step in self._steps) else None,
            consts=tuple(self._consts),
        )

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


    def _unary(self, op: str, x: Value, **step_attrs: Any) -> Value:
        self._check_open()
        x = self._value(op, x)
        return self._emit(op, [x], x.shape, x.dtype, **step_attrs)


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




def along_axis(attrs_: dict[str, Any], shapes: list[tuple[int, ...]]) -> int:
    """The terms an op adds into one result along its `axis` attribute (golden's K)."""
    axis = attrs_.get("axis")
    return shapes[0][axis] if isinstance(axis, int) and shapes else 1


def replay_flag(attrs_: dict[str, Any], name: str) -> bool:
    """A stored step's boolean attribute, taken out of its attrs (a `replay`'s helper)."""
    value = attrs_.pop(name)
    if not isinstance(value, bool):
        raise BinaryFormatError(f"attr {name} must be a JSON boolean, got {value!r:.40}")
    return value


def replay_optional(args: list[Value], present: bool) -> Value | None:
    """The next optional operand of a stored step (a norm's weight or bias, a conv's bias)."""
    return args.pop(0) if present else None
