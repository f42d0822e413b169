"""Simplifying a built program without changing a bit of what it computes.

A front-end that lowers graph by graph (ttflow.torch lowers what PyTorch's decompositions and
AOTAutograd give it) emits steps a person would not write: a transpose of a transpose, a reshape
of a reshape, a reshape to the shape a value already has, the same comparison three times. Each
step costs a run a kernel call and an intermediate buffer, so `simplify` removes them:

- a reshape of a reshape is one reshape; a reshape to its input's shape is its input;
- a permute of a permute is one permute; the identity permute is its input;
- a `where` branch that is a one-element constant (`full`) becomes the where's scalar, and a
  reshaped constant is the constant of the new shape; a `where` condition that is a typecast of
  a comparison (1 or 0) is the comparison;
- a one-element operand that is a reshape (a scalar seen as (1,)) is used as it was, when the
  op's result keeps its shape;
- a pointwise op whose operands are all reshapes of values of one shape (a 1-D bias seen as
  (n,) while it lives as (1, n)), or all the same permute of them (a convolution's NHWC result
  seen as NCHW for a ReLU, then permuted back for the pool), runs on those values, and its
  result is reshaped or permuted instead: the moves around a chain of such ops then meet and
  cancel;
- a step equal to an earlier one (same op, inputs, scalar and attributes) is that step's value
  (common-subexpression elimination: every op is a function of its inputs, the random ones of
  their seed input included);
- a step whose value nothing reads is dropped.

Reshapes and permutes move elements without changing them, a pointwise op computes each element
alone, and an equal step computes equal bits, so the outputs are bit-identical (the tests compare
with `run_on_host` of the original). BFLOAT8_B is the exception: its blocks of 16 share an
exponent in tile order, so reshaping or permuting a BFLOAT8_B value rounds its elements anew;
its chains are kept as they are, and ops on it are not lifted.
A program with donations or an in-place op (`update_cache`) is returned as it is: their buffers
are part of the contract, not just the values. Inputs keep their numbers, so constant inputs
(const-eval), locations, placements and range checks carry over.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from .ops import COLLECTIVES, OPS
from .program import Program, Step, TensorSpec
from .._types import DataType
from .record import Kind

__all__ = ["simplify"]


def _kind(op: str) -> Kind | None:
    """The op's kind (None: a host op, which has no record)."""
    record = OPS.get(op)
    return record.kind if record is not None else None



def simplify(program: Program) -> Program:
    """`program` with the steps above removed (the same object when nothing changes)."""
    if program.donations or any(_kind(step.op) is Kind.CACHE for step in program.steps):
        return program
    # Lifting pays when the reshapes it moves meet others and cancel; where they do not, it
    # would add a step, so the fewer steps of the two passes win.
    plain = _simplified(program, lift=False)
    lifted = _simplified(program, lift=True)
    return lifted if len(lifted.steps) < len(plain.steps) else plain


def _simplified(program: Program, lift: bool) -> Program:
    values = list(program.values)  # grows by the values of lifted pointwise ops
    alias: dict[int, int] = {}  # value -> the earlier value it equals
    made: dict[int, Step] = {}  # value -> the (rewritten) step that makes it
    seen: dict[Hashable, int] = {}  # step key -> its value
    steps: list[Step] = []
    checks = dict(program.range_checks)  # value -> its note; a lifted op's inner value gains one

    def resolve(value: int) -> int:
        return alias.get(value, value)

    for step in program.steps:
        inputs = tuple(resolve(v) for v in step.inputs)
        op, attrs = step.op, step.attrs
        if op == "where":
            inputs = _comparison_as_condition(made, inputs)
            inputs, attrs = _constants_as_scalars(values, made, inputs, attrs, step.output)
        if op == "reshape" and (source := made.get(inputs[0])) is not None and source.op == "full" \
                and _exact(values, step.output):
            # A reshaped constant is the constant of the new shape.
            op, inputs = "full", ()
            attrs = tuple(sorted({**dict(source.attrs), "shape": values[step.output].shape}.items()))
        if op == "reshape":
            source = made.get(inputs[0])
            if source is not None and source.op == "reshape" and _exact(values, inputs[0]):
                inputs = source.inputs  # a reshape of a reshape
            if values[inputs[0]].shape == values[step.output].shape and _same(values, inputs[0], step.output):
                alias[step.output] = inputs[0]
                continue
        elif op == "permute":
            axes = tuple(dict(attrs)["axes"])
            source = made.get(inputs[0])
            if source is not None and source.op == "permute" and _exact(values, inputs[0]):
                first = tuple(dict(source.attrs)["axes"])
                axes = tuple(first[a] for a in axes)
                inputs = source.inputs
                attrs = tuple(sorted({**dict(attrs), "axes": axes}.items()))
            if axes == tuple(range(len(axes))) and _same(values, inputs[0], step.output):
                alias[step.output] = inputs[0]
                continue
        elif _kind(op) is Kind.ELEMENTWISE:
            lifted = _lifted(values, made, inputs, step.output) if lift else None
            if lifted is None:
                inputs = _unreshaped_one_elements(values, made, inputs, step.output)
            else:
                sources, shape, mover = lifted
                inner = len(values)
                values.append(TensorSpec(shape, values[step.output].layout))
                if step.output in checks:
                    checks[inner] = checks[step.output]
                result = _emit(steps, made, seen, values, Step(op, sources, step.scalar, attrs, inner),
                               checks.get(inner))
                moved = Step(mover.op, (result,), None, mover.attrs, step.output)
                made[step.output] = moved
                steps.append(moved)
                continue
        key = _key(op, inputs, step.scalar, attrs, checks.get(step.output))
        if key is not None:
            earlier = seen.get(key)
            if earlier is not None and _same(values, earlier, step.output):
                alias[step.output] = earlier
                continue
            seen[key] = step.output
        rewritten = Step(op, inputs, step.scalar, attrs, step.output)
        made[step.output] = rewritten
        steps.append(rewritten)
    outputs = tuple(resolve(v) for v in program.outputs)
    steps = _live(steps, outputs)
    if len(steps) == len(program.steps) and len(values) == len(program.values):
        return program
    return _renumbered(program, values, steps, outputs, checks)


def _emit(steps: list[Step], made: dict[int, Step], seen: dict[Hashable, int],
          values: list[TensorSpec], step: Step, check: str | None) -> int:
    """Appends `step` unless an equal one was made: the value that holds its result."""
    key = _key(step.op, step.inputs, step.scalar, step.attrs, check)
    if key is not None:
        earlier = seen.get(key)
        if earlier is not None and _same(values, earlier, step.output):
            return earlier
        seen[key] = step.output
    made[step.output] = step
    steps.append(step)
    return step.output




def _comparison_as_condition(made: dict[int, Step], inputs: tuple[int, ...]) -> tuple[int, ...]:
    """A `where` whose condition is a typecast of a comparison (a ReLU's backward: `le`, then
    INT32 because torch's comparison gives a bool), with the comparison as its condition: a
    comparison is 1 or 0, which every dtype holds exactly, so the where picks the same branch
    (it reads any nonzero condition as true). A typecast of anything else may turn a nonzero
    into 0 (0.5 -> 0 as an integer) and stays."""
    cast = made.get(inputs[0])
    if cast is None or cast.op != "typecast":
        return inputs
    comparison = made.get(cast.inputs[0])
    if comparison is None or not (comparison.op in OPS and OPS[comparison.op].comparison):
        return inputs
    return (cast.inputs[0], *inputs[1:])


def _constants_as_scalars(values: list[TensorSpec], made: dict[int, Step], inputs: tuple[int, ...],
                          attrs: Any, output: int) -> tuple[tuple[int, ...], Any]:
    """A `where` whose branch is a one-element `full` of the where's own dtype, with that
    constant as the branch's scalar instead (`where` keeps a tensor branch, which gives it its
    dtype, and its result keeps its shape); else the step's inputs and attributes."""
    dtype = values[output].dtype
    given = dict(attrs)
    if dtype is DataType.BFLOAT8_B or given["a_scalar"] is not None or given["b_scalar"] is not None:
        return inputs, attrs  # a scalar branch already: the other one gives the dtype
    cond, a, b = inputs
    for k, (branch, kept) in enumerate(((a, b), (b, a))):
        constant = made.get(branch)
        if constant is None or constant.op != "full" or math.prod(values[branch].shape) != 1:
            continue
        if values[branch].dtype is not dtype or values[kept].dtype is not dtype:
            continue
        try:
            shape = np.broadcast_shapes(values[cond].shape, values[kept].shape)
        except ValueError:
            continue
        if shape != values[output].shape:
            continue
        scalar = float(dict(constant.attrs)["value"])
        given["a_scalar" if k == 0 else "b_scalar"] = scalar
        return (cond, kept), tuple(sorted(given.items()))
    return inputs, attrs


def _unreshaped_one_elements(values: list[TensorSpec], made: dict[int, Step], inputs: tuple[int, ...],
                             output: int) -> tuple[int, ...]:
    """A pointwise op's operands, with a one-element operand that is a reshape (a scalar seen
    as (1,), say) replaced by what it reshapes, when the op's result keeps its shape (the
    element broadcasts the same either way)."""
    replaced = list(inputs)
    for k, v in enumerate(inputs):
        step = made.get(v)
        if step is not None and step.op == "reshape" and math.prod(values[v].shape) == 1 \
                and _exact(values, v) and _exact(values, step.inputs[0]):
            replaced[k] = step.inputs[0]
    if replaced == list(inputs):
        return inputs
    try:
        shape = np.broadcast_shapes(*(values[v].shape for v in replaced))
    except ValueError:
        return inputs
    return tuple(replaced) if shape == values[output].shape else inputs


def _lifted(values: list[TensorSpec], made: dict[int, Step], inputs: tuple[int, ...],
            output: int) -> tuple[tuple[int, ...], tuple[int, ...], Step] | None:
    """For a pointwise op on `inputs`: the operands to run it on instead, their shape, and the
    step that moves the result back (its `op` and `attrs`), when every operand of more than one
    element is the same move of a value of one other shape: a reshape to the op's shape, or a
    permute by the same axes (a convolution's NHWC result seen as NCHW around a ReLU); a
    one-element operand broadcasts against that shape as it did against the op's. Else None."""
    shape = values[output].shape
    if math.prod(shape) == 1 or any(values[v].dtype is DataType.BFLOAT8_B for v in (*inputs, output)):
        return None
    source_shape: tuple[int, ...] | None = None
    mover: Step | None = None
    sources: list[int] = []
    for v in inputs:
        if math.prod(values[v].shape) == 1:
            sources.append(v)  # placed below, once the shape is known
            continue
        step = made.get(v)
        if values[v].shape != shape or step is None or step.op not in ("reshape", "permute"):
            return None
        if mover is None:
            mover = step
        elif step.op != mover.op or (step.op == "permute" and step.attrs != mover.attrs):
            return None
        source = step.inputs[0]
        if source_shape is None:
            source_shape = values[source].shape
        elif values[source].shape != source_shape:
            return None
        sources.append(source)
    if source_shape is None or mover is None or (mover.op == "reshape" and source_shape == shape):
        return None  # (a permute may keep the shape: a square matrix transposed)
    if mover.op == "reshape":
        mover = Step("reshape", (), None, (("shape", shape),), output)
    for k, v in enumerate(sources):
        if math.prod(values[v].shape) == 1:
            placed = _one_element(values, made, v, len(source_shape))
            if placed is None:
                return None
            sources[k] = placed
    return tuple(sources), source_shape, mover


def _one_element(values: Sequence[TensorSpec], made: dict[int, Step], v: int, rank: int) -> int | None:
    """A one-element operand that broadcasts against a value of `rank` dims as it did: itself,
    or what it is a reshape of, when not of more dims."""
    step = made.get(v)
    if step is not None and step.op == "reshape" and len(values[step.inputs[0]].shape) <= rank:
        return step.inputs[0]
    return v if len(values[v].shape) <= rank else None


def _exact(values: Sequence[TensorSpec], value: int) -> bool:
    """Whether a value holds its elements exactly as computed, whatever its shape: not BFLOAT8_B,
    whose blocks of 16 share an exponent in tile order, so that reshaping or permuting it
    rounds its elements anew (a reshape of a BFLOAT8_B reshape is not one reshape)."""
    return values[value].dtype is not DataType.BFLOAT8_B


def _same(values: Sequence[TensorSpec], a: int, b: int) -> bool:
    """Whether value a may stand for value b: the same shape and dtype (an intermediate's layout
    is where the runtime puts it, not part of its value)."""
    return values[a].shape == values[b].shape and values[a].dtype is values[b].dtype


def _key(op: str, inputs: tuple[int, ...], scalar: float | None, attrs: Any,
         check: str | None) -> Hashable | None:
    # A range-checked step and an unchecked one differ: one fails where the other wraps.
    key = (op, inputs, scalar, attrs, check)
    try:
        hash(key)
    except TypeError:
        return None  # an unhashable attribute: never merged
    if scalar is not None and scalar != scalar:  # NaN: equal keys must mean equal steps
        return None
    return key


def _live(steps: list[Step], outputs: tuple[int, ...]) -> list[Step]:
    """The steps some output depends on, in order."""
    needed = set(outputs)
    kept = []
    for step in reversed(steps):
        if step.output in needed:
            kept.append(step)
            needed.update(step.inputs)
    kept.reverse()
    return kept


def _renumbered(program: Program, specs: list[TensorSpec], steps: list[Step],
                outputs: tuple[int, ...], checks: dict[int, str]) -> Program:
    """A program of `steps` with value ids 0..n-1 again (inputs first, then step values in order).
    A range check stays with its step; one on a value that became an alias goes: its source
    was stored (wrapped, or checked) before, so the alias could never fail it."""
    number = {v: v for v in range(program.num_inputs)}
    locations = dict(program.locations)  # a location stays with its step, as a check does
    placements = dict(program.placements)  # and so does a placement
    values = list(program.values[: program.num_inputs])
    for step in steps:
        number[step.output] = len(values)
        values.append(specs[step.output])
    return Program(
        name=program.name,
        values=tuple(values),
        steps=tuple(Step(s.op, tuple(number[v] for v in s.inputs), s.scalar, s.attrs, number[s.output])
                    for s in steps),
        outputs=tuple(number[v] for v in outputs),
        output_specs=program.output_specs,
        num_inputs=program.num_inputs,
        range_checks=tuple(sorted((number[step.output], checks[step.output])
                                  for step in steps if step.output in checks)),
        locations=tuple((number[step.output], locations[step.output])
                        for step in steps if step.output in locations),
        placements=tuple((number[step.output], placements[step.output])
                         for step in steps if step.output in placements),
        consts=program.consts,  # inputs keep their numbers
        cache_constants=program.cache_constants,
        mesh_shape=program.mesh_shape if any(s.op in COLLECTIVES for s in steps) else None,
    )
