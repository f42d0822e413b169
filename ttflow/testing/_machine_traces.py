"""`TraceRules`: traces captured, replayed, written into, released and dropped, checked by numpy.

The model of a trace is its steps: which program each captured submit ran, on which tensors
from outside the trace (its inputs) or outputs of an earlier step. A replay recomputes every
step from the inputs' current values (as `tt.execute_trace` does on the device), so each output
then holds what numpy says; a replay of a trace whose capture failed, or one of whose inputs was
deallocated (or donated), must raise TraceError at once. A tensor a live trace writes cannot be
donated (TraceError). While a trace lives, the buffers it alone keeps count beside the live
tensors in the exact accounting; once every trace is released (or dropped: its handle
garbage-collected), the accounting is exact again, so a trace that keeps its pins is a leak the
next drain finds.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from .._runtime.device import Device
from .._errors import DeallocatedTensorError, TraceError, TTFlowError
from .._runtime.calls import deallocate, submit, write
from .._runtime.tensor import Tensor
from .._runtime.trace import Trace, capture_trace, execute_trace, release_trace
from .._ir.program import TensorSpec
from .._types import DataType, Layout, MemorySpace
from ._machine_base import ModelProgram
from ._machine_flight import FlightRules
from ._model import ModelTensor
from ._reference import ExpectedValue, stored
from ._strategies import arrays, layouts

__all__ = ["TraceRules"]

Ref = tuple[str, Any, int]
"""Where a captured step's input comes from: ("input", ModelTensor, 0) or ("step", j, k)."""


@attrs.define(eq=False)
class _ModelTrace:
    """A captured trace and what a replay recomputes."""

    handle: Trace | None
    steps: list[tuple[ModelProgram, list[Ref]]]
    outputs: list[list[ModelTensor]]
    failed: bool = False
    released: bool = False

    @property
    def inputs(self) -> list[ModelTensor]:
        seen: dict[int, ModelTensor] = {}
        for _, refs in self.steps:
            for kind, entry, _ in refs:
                if kind == "input":
                    seen.setdefault(id(entry), entry)
        return list(seen.values())

    @property
    def live(self) -> bool:
        return not self.released

    def written(self) -> list[ModelTensor]:
        return [entry for outputs in self.outputs for entry in outputs]


def _capture(device: Device, steps: list[tuple[ModelProgram, list[Ref]]],
             inputs: dict[int, Tensor]) -> tuple[Trace, list[list[Tensor]]] | BaseException:
    """Captures the steps in one go on the loop thread (nothing else runs meanwhile)."""
    outputs: list[list[Tensor]] = []
    try:
        with capture_trace(device) as trace:
            for program, refs in steps:
                args = [inputs[id(entry)] if kind == "input" else outputs[entry][k]
                        for kind, entry, k in refs]
                outputs.append(submit(device, program.binary, program.index, args))
                for tensor in inputs.values():  # a host transfer, refused on whichever queue
                    _refused_in_capture(tensor)
    except TTFlowError as exc:
        return exc
    return trace, outputs


def _refused_in_capture(tensor: Tensor) -> None:
    """A write into `tensor` inside a capture raises TraceError and changes nothing (on a
    one-queue device it would queue on CQ0, among the captured work)."""
    try:
        write(tensor, np.zeros(tensor.shape, tensor.dtype.host_dtype))
    except (TraceError, DeallocatedTensorError):
        return
    raise AssertionError("a write inside a capture was not refused")


def _pinned(device: Device) -> dict[MemorySpace, int]:
    return {space: sum(b.nbytes for b in device.memory_view(space).buffers if b.kind == "trace")
            for space in MemorySpace}


class TraceRules(FlightRules):
    """The trace rules of `RuntimeStateMachine`."""

    max_traces = 3

    def __init__(self) -> None:
        super().__init__()
        self.traces: list[_ModelTrace] = []

    def _live_traces(self) -> list[_ModelTrace]:
        return [t for t in self.traces if t.live]

    def pinned_by_traces(self) -> dict[MemorySpace, int] | None:
        if not self._live_traces():
            return None  # exact: no trace keeps anything
        return self.call(_pinned, self.device)

    def donation_refused(self, donors: Sequence[ModelTensor]) -> bool:
        return any(donor is written for t in self._live_traces() for written in t.written()
                   for donor in donors)

    def let_go_of_traces(self) -> None:
        for trace in self._live_traces():
            if trace.handle is not None:
                self.call(release_trace, trace.handle)
            trace.released = True
        self.traces.clear()  # their steps hold programs, whose cached constants teardown counts

    # -- rules ----------------------------------------------------------------------------------

    @precondition(lambda self: self.room() and bool(self.programs)
                  and len(self._live_traces()) < self.max_traces)
    @rule(data=st.data())
    def capture(self, data: st.DataObject) -> None:
        """Captures one to three submits (a later one may read an earlier one's output), on
        tensors made before the capture or made then; the device is drained after, so whether
        the capture failed (an input failed, or a program ran out of L1) is known."""
        count = data.draw(st.integers(1, 3), label="steps")
        steps: list[tuple[ModelProgram, list[Ref]]] = []
        for j in range(count):
            chosen = data.draw(st.sampled_from(self.programs), label=f"program {j}")
            refs: list[Ref] = []
            for k, spec in enumerate(chosen.program.inputs):
                earlier = [(i, o) for i, (p, _) in enumerate(steps)
                           for o, out in enumerate(p.program.output_specs)
                           if out.shape == spec.shape and (out.dtype is spec.dtype
                                                           or (out.dtype.is_float and spec.dtype.is_float))]
                from_step = bool(earlier) and data.draw(st.booleans(), label=f"step {j} input {k} from a step")
                if from_step:
                    i, o = data.draw(st.sampled_from(earlier), label=f"step {j} input {k}")
                    refs.append(("step", i, o))
                else:
                    refs.append(("input", None, k))  # drawn below
            steps.append((chosen, refs))
        # The inputs from outside, made (or picked) before the capture opens, in any layout of
        # a dtype the program takes: one that differs is converted, and the trace reads the
        # kept conversion (refilled by a replay once a write drops it).
        def any_layout(k: int, spec: TensorSpec) -> st.SearchStrategy[Layout]:
            floats = [DataType.FLOAT32, DataType.BFLOAT16, DataType.BFLOAT8_B]
            return st.sampled_from(floats if spec.dtype.is_float else [spec.dtype]).flatmap(layouts)

        for j, (chosen, refs) in enumerate(steps):
            fresh = self._draw_inputs(data, chosen.program, any_layout)
            refs[:] = [("input", fresh[k], 0) if ref[0] == "input" else ref
                       for k, ref in enumerate(refs)]
        tensors = {id(entry): entry.tensor for _, refs in steps for kind, entry, _ in refs if kind == "input"}
        outcome = self.call(_capture, self.device, steps, tensors)
        assert not isinstance(outcome, BaseException), f"the capture raised {outcome!r}"
        handle, submitted = outcome
        outputs: list[list[ModelTensor]] = []
        for (chosen, refs), tensors_out in zip(steps, submitted):
            args = [entry if kind == "input" else outputs[entry][k] for kind, entry, k in refs]
            outputs.append(self.run_program(chosen, args, submitted=tensors_out))
        trace = _ModelTrace(handle, steps, outputs)
        self.traces.append(trace)
        self.drain_and_check()
        trace.failed = any(e.error is not None for e in trace.written()) or any(
            e.error is not None for e in trace.inputs)
        event(f"capture: {count} steps, {'failed' if trace.failed else 'ok'}")

    @precondition(lambda self: bool(self._live_traces()))
    @rule(data=st.data())
    def execute(self, data: st.DataObject) -> None:
        """Maybe writes new values into some of the trace's inputs (which drops conversions the
        trace reads: the replay refills them), replays it, then maybe deallocates an input at
        once (the queued replay still reads its value) or writes into an output."""
        trace = data.draw(st.sampled_from(self._live_traces()), label="trace")
        inputs = trace.inputs
        for entry in inputs:
            if entry.usable and data.draw(st.booleans(), label=f"write {entry.name}"):
                array = data.draw(arrays(entry.dtype, entry.shape), label=f"value {entry.name}")
                self.call(write, entry.tensor, array)
                entry.expected = stored(array, entry.dtype)
        then = data.draw(st.sampled_from(["nothing", "deallocate_input", "write_output"]), label="then")
        assert trace.handle is not None
        if trace.failed or any(e.deallocated for e in inputs):
            self.expect_raises(TraceError, execute_trace, trace.handle)
            return
        assert all(e.known_ok for e in inputs), f"a traced input of unknown outcome: {inputs}"
        self.call(execute_trace, trace.handle)
        self._replayed(trace)
        if then == "deallocate_input":
            victim = data.draw(st.sampled_from(inputs), label="deallocated input")
            self.call(deallocate, victim.tensor)
            victim.deallocated = True
        elif then == "write_output":
            live = [e for e in trace.written() if e.usable]
            if live:
                target = data.draw(st.sampled_from(live), label="written output")
                value = data.draw(arrays(target.dtype, target.shape), label="output value")
                self.call(write, target.tensor, value)
                target.expected = stored(value, target.dtype)
        event(f"execute: then {then}")

    def _replayed(self, trace: _ModelTrace) -> None:
        """What each output of `trace` holds after a replay queued now: every step recomputed
        from the inputs' current values."""
        values: list[list[ExpectedValue]] = []
        for (chosen, refs), outputs in zip(trace.steps, trace.outputs):
            program = chosen.program
            args = []
            for (kind, entry, k), spec in zip(refs, program.inputs):
                value = entry.expected if kind == "input" else values[entry][k]
                assert value is not None
                args.append(value.stored_as(spec.dtype))
            results = [r.stored_as(s.dtype) for r, s in zip(chosen.reference(*args), program.output_specs)]
            values.append(results)
            for entry, result in zip(outputs, results):
                if not entry.deallocated:
                    assert entry.known_ok, f"a traced output of unknown outcome: {entry!r}"
                    entry.expected = result

    @precondition(lambda self: any(not t.failed and all(e.usable for e in t.inputs)
                                   for t in self._live_traces()))
    @rule(data=st.data())
    def replay_then_deallocate(self, data: st.DataObject) -> None:
        """New values written into every input of a trace (which drops the conversions it
        reads: the replay refills them from the new values), a replay, and one input
        deallocated at once: the queued replay still reads its value (`deallocate` waits for
        queued readers); the next `execute` raises TraceError."""
        traces = [t for t in self._live_traces() if not t.failed and all(e.usable for e in t.inputs)]
        trace = data.draw(st.sampled_from(traces), label="trace")
        for entry in trace.inputs:
            array = data.draw(arrays(entry.dtype, entry.shape), label=f"value {entry.name}")
            self.call(write, entry.tensor, array)
            entry.expected = stored(array, entry.dtype)
        victim = data.draw(st.sampled_from(trace.inputs), label="deallocated input")
        assert trace.handle is not None
        self.call(execute_trace, trace.handle)
        self._replayed(trace)
        self.call(deallocate, victim.tensor)
        victim.deallocated = True

    @precondition(lambda self: self.room() and bool(self._live_traces()) and bool(self.donating_programs))
    @rule(data=st.data())
    def donate_traced_output(self, data: st.DataObject) -> None:
        """A donating submit whose donor a live trace writes: TraceError, the donor kept."""
        pairs = []
        for trace in self._live_traces():
            for entry in trace.written():
                if not entry.usable:
                    continue
                for program in self.donating_programs:
                    for _, i in program.program.donations:
                        spec = program.program.inputs[i]
                        declared = entry.tensor.layout == spec.layout or any(
                            layout == spec.layout for layout, _ in entry.tensor.storages)
                        if entry.shape == spec.shape and entry.dtype is spec.dtype and declared:
                            pairs.append((program, i, entry))
        if not pairs:
            event("donate_traced_output: no donor in layout")
            return
        program, index, donor = data.draw(st.sampled_from(pairs), label="donation")
        others = self._draw_inputs(data, program.program, lambda k, spec: st.just(spec.layout))
        args = [donor.tensor if k == index else e.tensor for k, e in enumerate(others)]
        if any(e is donor for k, e in enumerate(others) if k != index):
            return  # given twice: the donating rule covers that
        self.expect_raises(TraceError, submit, self.device, program.binary, program.index, args)
        event("donate_traced_output: refused")

    @precondition(lambda self: bool(self._live_traces()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        trace = data.draw(st.sampled_from(self._live_traces()), label="trace")
        assert trace.handle is not None
        self.call(release_trace, trace.handle)
        if data.draw(st.booleans(), label="twice"):
            self.call(release_trace, trace.handle)  # idempotent
        trace.released = True

    @precondition(lambda self: bool(self._live_traces()))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """Lets go of the trace's handle without releasing it: the garbage collector's drop
        releases it, as it frees a dropped tensor."""
        trace = data.draw(st.sampled_from(self._live_traces()), label="trace")
        trace.handle = None
        trace.released = True
        gc.collect()
