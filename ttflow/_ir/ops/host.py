"""Host ops: program steps that run a Python function on the host (tt-mlir's CPU hoisting).

`ProgramBuilder.host_op(fn, inputs, outputs=[(shape, layout), ...])` records one step per
declared output, each an ordinary step of op `HOST_OP` whose attrs hold the `HostFunction` and
the output's index. The first step reads the op's inputs, calls `fn` once and keeps the other
results for the steps after it (they read the first result, so nothing runs between them, and
the kept results are per thread: every chip of a mesh runs its own call on its own worker).

At run time the schedule reads the inputs back from bank memory (as for any step), the step
hands them to `fn` as read-only numpy arrays in their host dtype (`DataType.host_dtype`:
float32 for BFLOAT8_B, `ml_dtypes.bfloat16` for BFLOAT16, int32, uint32), and checks what `fn`
returns against the declared shapes and host dtypes before the schedule stores it. Any failure
(an exception in `fn`, a wrong count, shape or dtype) is a `HostOpError` naming the op and its
program step, with the user's exception as its `__cause__`; it fails the program's outputs as
any run-time error does.

A host op's cost is unknown and it may block: a record that calls one always runs on the
queue's worker thread, never inline on the event loop, whatever its estimate (`_queue`'s
`_calls_host`; never on the C fast path either, which takes pagewise programs only). Its run
estimate counts the device's work alone; each call's measured span goes to the timeline
(`timing_host_ops`), as a slice nested in its program's.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, final

import numpy as np

from ..._errors import HostOpError
from ..._types import DataType

__all__ = ["HOST_OP", "HostFunction", "HostSpan", "host_step", "timing_host_ops"]

HOST_OP = "host_op"
"""The op name of a host op's steps (not in `_ir.ops.OPS`: it has no device meaning)."""

HostSpan = tuple[str, float, float]
"""A host op's call: its label (`host_op:<name>`) and its perf_counter start and end."""

_timing = threading.local()  # `spans`: where this thread's host op calls are noted, if anywhere


@contextmanager
def timing_host_ops() -> Iterator[list[HostSpan]]:
    """Notes the span of every host op called on this thread inside the block (a timed
    record's run: the timeline draws each as a slice inside its program's)."""
    spans: list[HostSpan] = []
    outer = getattr(_timing, "spans", None)
    _timing.spans = spans
    try:
        yield spans
    finally:
        _timing.spans = outer

Array = np.ndarray[Any, Any]


@final
class HostFunction:
    """The function of one host op and what it declares: its name (`host_op:<name>` in errors
    and the timeline), its inputs' dtypes, and its outputs' shapes and dtypes. Compared by
    identity: two host ops are the same op only if they are the same object."""

    __slots__ = ("fn", "name", "input_dtypes", "outputs", "_kept", "__weakref__")

    def __init__(self, fn: Callable[..., Any], name: str, input_dtypes: Sequence[DataType],
                 outputs: Sequence[tuple[tuple[int, ...], DataType]]) -> None:
        self.fn = fn
        self.name = name
        self.input_dtypes = tuple(input_dtypes)
        self.outputs = tuple(outputs)
        self._kept = threading.local()  # results after the first, per thread, until their steps

    @property
    def label(self) -> str:
        return f"{HOST_OP}:{self.name}"

    def __repr__(self) -> str:
        return f"<HostFunction {self.label}>"

    def call(self, operands: Sequence[Array]) -> tuple[Array, ...]:
        """Calls the function on the operands (compute dtype, as the schedule read them) and
        returns its checked results; HostOpError for anything wrong."""
        arrays = []
        for array, dtype in zip(operands, self.input_dtypes):
            host = np.asarray(array).astype(dtype.host_dtype, copy=False)
            host = host.view()
            host.flags.writeable = False  # the schedule's own value: the function must not change it
            arrays.append(host)
        start = time.perf_counter()
        try:
            results = self.fn(*arrays)
        except Exception as exc:
            error = HostOpError(f"{self.label} raised {type(exc).__name__}: {exc}", self.label)
            error.add_note("".join(traceback.format_exception(exc)).rstrip())
            raise error from exc
        finally:
            spans = getattr(_timing, "spans", None)
            if spans is not None:
                spans.append((self.label, start, time.perf_counter()))
        return self._check(results)

    def _check(self, results: Any) -> tuple[Array, ...]:
        declared = self.outputs
        if isinstance(results, np.ndarray) and len(declared) == 1:
            results = (results,)
        if not isinstance(results, (tuple, list)):
            raise HostOpError(
                f"{self.label} returned {type(results).__name__}; it must return a tuple or list of "
                f"{len(declared)} numpy arrays (the outputs it declares)", self.label)
        if len(results) != len(declared):
            raise HostOpError(
                f"{self.label} returned {len(results)} arrays, it declares {len(declared)} outputs",
                self.label)
        for k, (result, (shape, dtype)) in enumerate(zip(results, declared)):
            if not isinstance(result, np.ndarray):
                raise HostOpError(
                    f"{self.label}: output {k} is a {type(result).__name__}, not a numpy array", self.label)
            if result.shape != shape:
                raise HostOpError(
                    f"{self.label}: output {k} has shape {result.shape}, it declares {shape}", self.label)
            if result.dtype != dtype.host_dtype:
                raise HostOpError(
                    f"{self.label}: output {k} has dtype {result.dtype}, it declares {dtype.name} "
                    f"(host arrays of dtype {dtype.host_dtype}); convert with "
                    f"astype(...) in the function", self.label)
        return tuple(results)


def host_step(operands: list[Array], scalar: float | None, *, host: HostFunction, index: int) -> Array:
    """A host op's step as a schedule step function: the first output's step calls the
    function and keeps the rest for this thread; the later outputs' steps take theirs."""
    count = len(host.outputs)
    if index == 0:
        results = host.call(operands)
        if count > 1:
            host._kept.results = results
        return results[0]
    kept: tuple[Array, ...] | None = getattr(host._kept, "results", None)
    if kept is None:
        raise HostOpError(f"{host.label}: output {index} was asked for before the op ran", host.label)
    if index == count - 1:
        host._kept.results = None
    return kept[index]
