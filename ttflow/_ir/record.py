"""The op record: every fact about one op, in one place, read by every part of ttflow.

An op is defined once, in its family's file (`ops/<family>.py`), as a `ProgramBuilder` method
decorated with its record (`op(...)`): the method is its argument and attribute rules, its
shape and dtype rule and its canonical form (what the step stores); the record says what it
computes (`fn`, on numpy), its `kind`, the file format version that introduced it, its L1
circular-buffer rule (`footprint`), its cost (`macs`), its golden reference and tolerance (`float64`,
`accumulates`, `magnitude_bound`), which integer results `checking_range` checks (`range_check`), how a
stored step calls its builder method again (`replay`), whether it runs on tile pages as they
lie (`page`), and, for a collective, how its bytes move (`along_path`). The file format, the
simplifier, the footprint, the scheduler's plans, golden comparison, the collectives and the
reference run look the record up by the step's op name (`REGISTRY`, complete once
`ttflow._ir` is imported: its package imports every family).

Adding an op is one decorated method (and its compute) in one family file, and its test.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, final

import attrs
import numpy as np

from .._errors import ProgramError
from .._types import DataType
from .numerics import _INT_RANGE

__all__ = ["Kind", "RangeCheck", "PageOp", "OpRecord", "REGISTRY", "HOST_OP", "op", "checked",
           "zero_divisor", "check_range"]

Array = np.ndarray[Any, Any]

HOST_OP = "host_op"
"""The op name of a host op's steps (`ops/host.py`): a user's function, no record here."""


class Kind(enum.Enum):
    """What an op does to its operands' elements, as tt-mlir groups its runtime's operations."""

    ELEMENTWISE = "elementwise"  # each result element from the same place of each operand
    REDUCTION = "reduction"  # along one axis
    MATMUL_CONV = "matmul_conv"  # matrix products, convolutions, pools and their gradients
    DATA_MOVEMENT = "data_movement"  # the same elements, elsewhere (reshape, slice, concat, ...)
    NORMALIZATION = "normalization"  # softmax, layer_norm, rms_norm
    CREATION = "creation"  # a value from attributes alone (arange, full, rand)
    INDEXING = "indexing"  # elements picked by run-time indices
    COLLECTIVE = "collective"  # a value exchanged with the other chips of a mesh
    CACHE = "cache"  # a cache updated in place (its first operand's buffer, when donated)


class RangeCheck(enum.Enum):
    """What `ProgramBuilder.checking_range` checks of a step of the op."""

    NONE = "none"  # it selects, compares, moves or masks values that already fit
    RESULT = "result"  # an integer result can leave its dtype's range (arithmetic, products)
    DIVISION = "division"  # an integer division: a zero divisor fails (the device gives 0)
    CAST = "cast"  # a typecast: a float source must fit the integer type (the device saturates)
    INDEX_ROWS = "index_rows"  # ids (operand 0) into the rows of a table (operand 1)
    INDEX_AXIS = "index_axis"  # an index (operand 1) along `axis` of operand 0


@final
@attrs.frozen
class PageOp:
    """An exactly rounded float32 op that runs on tile pages as they lie in bank memory (the
    pagewise plans): `run(a, b, out)` in numpy (`b` the other operand or the scalar; a unary op
    ignores it), and its code in the C kernel (`ttflow._kernels._pointwise.<opcode>`)."""

    run: Callable[[Array, Any, Array], Any]
    opcode: str


@final
@attrs.frozen(eq=False)
class OpRecord:
    """Every fact about one op (see the module's docstring).

    `arity` is the most tensor operands a step of the op reads: fewer when optional operands are
    left out (a `where` with a scalar branch, a `layer_norm` without weight), -1 for any number
    (`concat`), 0 for none (`arange`). The builder refuses a float_only op on integers and an
    int_only one (bitwise logic, shifts) on floats, with a LayoutError."""

    name: str
    kind: Kind
    arity: int
    fn: Callable[..., Array]
    """What the op computes: `fn(arrays, scalar, **attrs)` on operands in their compute dtype
    (float32 or int64), unrounded (`numerics.store_as` rounds it as it is stored)."""
    version: int
    """The format version of ttflow's binary file that introduced the op (`binary`)."""
    float_only: bool = False
    int_only: bool = attrs.field(default=False)
    comparison: bool = False
    """A comparison: 1 where it holds, else 0 (so any dtype holds its result exactly)."""
    range_check: RangeCheck = RangeCheck.NONE
    footprint: Callable[[Sequence[Any], Any, Any], int] | None = None
    """Its circular buffers' bytes per core, `footprint(values, step, spec)` (`footprint`'s
    rules); None: the elementwise rule."""
    macs: Callable[[Sequence[Any], Any], int] | None = None
    """Multiply-accumulates of a step, `macs(values, step)`, for the run estimate; None: none."""
    accumulates: Callable[[dict[str, Any], list[tuple[int, ...]]], int] | None = None
    """How many terms it adds into one result, `accumulates(attrs, operand shapes)` (K of
    golden's error bound); None: one."""
    float64: Callable[..., Array] | None = None
    """The op in float64 for golden comparison, where `fn` keeps float32 (mean, the norms,
    cumsum); None: `fn`, which computes in the operands' dtype."""
    magnitude_bound: bool = False
    """Its value applied to |operands| bounds the sum of the absolute terms it adds (golden)."""
    replay: Callable[..., Any] | None = None
    """How a stored step calls the builder: `replay(builder, operands, scalar, attrs)`; None:
    `method(*operands[, scalar], **attrs)`."""
    page: PageOp | None = None
    along_path: bool = False
    """A collective whose bytes go along a path of links (a line or ring: gathers and
    reductions), not by routes from each chip to each (broadcast, point_to_point, all_to_all)."""

    @int_only.validator
    def _one_kind(self, attribute: Any, value: bool) -> None:
        if value and self.float_only:
            raise ValueError(f"op {self.name!r} cannot need both float and integer operands")

    def compute(self, arrays: list[Array], scalar: float | None, **attrs_: Any) -> Array:
        """The op's result in the operands' compute dtype (float32 or int64), unrounded."""
        with np.errstate(all="ignore"):
            return self.fn(arrays, scalar, **attrs_)


REGISTRY: dict[str, OpRecord] = {}
"""Every op's record by name, in definition order (filled as the family files are imported)."""

_Method = TypeVar("_Method", bound=Callable[..., Any])


def op(name: str, kind: Kind, arity: int, fn: Callable[..., Array], **facts: Any) -> Callable[[_Method], _Method]:
    """Declares the decorated builder method's op: its record is registered, and the method
    takes `loc=` as every op does (MLIR's Python builders accept both `loc=` and a location
    context: its steps come from that location, as if built inside `ProgramBuilder.location`)."""
    record = OpRecord(name, kind, arity, fn, **facts)

    def declare(method: _Method) -> _Method:
        if method.__name__ != name:
            raise ValueError(f"op {name!r} is declared on a method named {method.__name__!r}")
        if name in REGISTRY:
            raise ValueError(f"op {name!r} is declared twice")
        REGISTRY[name] = record
        return located(method)

    return declare


def located(method: _Method) -> _Method:
    """The method with `loc=` acted on: inside `self.location(loc)` when it is given. The
    method's own `loc` parameter is what callers and type checkers see."""

    @functools.wraps(method)
    def at(self: Any, *args: Any, loc: str | None = None, **kwargs: Any) -> Any:
        if loc is None:
            return method(self, *args, **kwargs)
        with self.location(loc):
            return method(self, *args, **kwargs)

    return at  # type: ignore[return-value]


def checked(op: str, result: DataType) -> bool:
    """Whether `checking_range` checks a step of `op` giving `result`: index reads always,
    integer results of the ops that can leave their range (`RangeCheck`)."""
    check = REGISTRY[op].range_check
    if check is RangeCheck.INDEX_ROWS or check is RangeCheck.INDEX_AXIS:
        return True
    return check is not RangeCheck.NONE and not result.is_float


def zero_divisor(op: str, scalar: float | None) -> bool:
    """Whether a step divides by the scalar 0 (refused by a checked builder at once)."""
    return REGISTRY[op].range_check is RangeCheck.DIVISION and scalar == 0


def _check_indices(note: str, index: Array, size: int, what: str) -> None:
    bad = (index < 0) | (index >= size)
    if bad.any():
        raise ProgramError(f"{note}: index {index[bad].flat[0]} is out of range for {size} {what} "
                           "(the device would clamp it)")


def check_range(note: str, op: str, operands: list[Any], result: Array, dtype: DataType,
                attrs: dict[str, Any] | None = None) -> None:
    """Raises ProgramError, beginning with `note`, when a `checked` step's unrounded integer
    result does not fit `dtype` (`ProgramBuilder.checking_range`): the device would wrap it. A typecast from
    a float is checked on its truncated input, since the op saturates it (NaN fails too); an
    integer division (floor_divide, remainder, fmod) by a zero element fails, where the device
    gives 0. An embedding's ids and a gather's index are checked against the rows or the axis
    they pick from, which the device clamps into."""
    check = REGISTRY[op].range_check
    if check is RangeCheck.INDEX_ROWS:
        _check_indices(note, operands[0], operands[1].shape[0], "rows")
        return
    if check is RangeCheck.INDEX_AXIS:
        axis = (attrs or {})["axis"]
        _check_indices(note, operands[1], operands[0].shape[axis], f"places along axis {axis}")
        return
    low, high = _INT_RANGE[dtype]
    if check is RangeCheck.DIVISION and len(operands) > 1 and not np.all(operands[1]):
        raise ProgramError(f"{note}: integer division by zero (the device would give 0)")
    if check is RangeCheck.CAST and operands[0].dtype.kind == "f":
        source = np.trunc(np.asarray(operands[0], np.float64))
        bad = ~((source >= low) & (source <= high))  # NaN compares False both ways
        if bad.any():
            raise ProgramError(f"{note}: {source[bad].flat[0]} does not fit {dtype.name} "
                               "(the device would saturate it)")
        return
    values = np.asarray(result)
    if values.size and (values.min() < low or values.max() > high):
        example = values[(values < low) | (values > high)].flat[0]
        raise ProgramError(f"{note}: a result of {op}, {example}, does not fit {dtype.name} "
                           "(the device would wrap it)")
