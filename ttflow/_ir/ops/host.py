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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, final

import numpy as np

from ..._errors import HostOpError, LayoutError, ProgramError
from ..._types import DataType, Layout, MemorySpace, TensorLayout, check_shape
from ..core import BuilderCore, Value
from ..program import Step
from ..record import HOST_OP, located
from ..spans import ThreadSpans

__all__ = ["HOST_OP", "HostOps", "HostFunction", "HostSpan", "host_step", "timing_host_ops"]

"""The op name of a host op's steps (not in `_ir.ops.OPS`: it has no device meaning)."""

HostSpan = tuple[str, float, float]
"""A host op's call: its label (`host_op:<name>`) and its perf_counter start and end."""

_timing: ThreadSpans[HostSpan] = ThreadSpans()  # where this thread's host op calls are noted


def timing_host_ops() -> AbstractContextManager[list[HostSpan]]:
    """Notes the span of every host op called on this thread inside the block (a timed
    record's run: the timeline draws each as a slice inside its program's)."""
    return _timing.collecting()

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
            spans = _timing.current()
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


class HostOps(BuilderCore):
    """The host op of `ProgramBuilder` (a user's function, run on the host)."""

    @located
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
