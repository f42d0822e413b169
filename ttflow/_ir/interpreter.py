"""The reference interpreter: a program run on host arrays exactly as the device runs it (the
runtime's loop, on host arrays), for tests, golden comparison and a CPU fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import ProgramError, ShapeError
from .numerics import store_as, to_host_dtype
from .record import check_range
from .ops import OPS
from .ops.host import HOST_OP, host_step
from .program import Program

__all__ = ["run_on_host"]


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
    if program.mesh_shape not in (None, (1, 1)):
        rows, cols = program.mesh_shape
        raise ProgramError(
            f"program {program.name!r} was built for a {rows}x{cols} mesh; run_on_host runs one chip "
            "(its collectives as a group of one): build it without mesh_shape"
        )
    values: list[Any] = [None] * len(program.values)  # each set before any step reads it
    for index, (array, spec) in enumerate(zip(arrays, program.inputs)):
        host = np.asarray(array)
        if host.shape != spec.shape:
            raise ShapeError(
                f"input {index} of {program.name!r} has shape {host.shape}, the program declares {spec.shape}"
            )
        values[index] = store_as(host, spec.dtype)
    checks = dict(program.range_checks)
    for step in program.steps:
        operands = [values[v] for v in step.inputs]
        if step.op == HOST_OP:  # the user's function, as the runtime calls it
            result = host_step(operands, step.scalar, **dict(step.attrs))
        else:
            result = OPS[step.op].compute(operands, step.scalar, **dict(step.attrs))
        dtype = program.values[step.output].dtype
        note = checks.get(step.output)
        if note is not None:
            check_range(note, step.op, operands, result, dtype, dict(step.attrs))
        values[step.output] = store_as(result, dtype)
    return [
        to_host_dtype(store_as(values[v], spec.dtype), spec.dtype)
        for v, spec in zip(program.outputs, program.output_specs)
    ]
