"""The core of `RuntimeStateMachine`: the device on a portal, the model, and the data rules.

Three things make the machine able to find real bugs, where a naive portal-driven machine cannot:

- Work stays queued between rules. `BlockingPortal.call` awaits any awaitable result, and a
  `Tensor` is awaitable: `portal.call(tt.to_device, ...)` would wait for the copy. `call` boxes
  the result instead. And the machine pauses its device's two queue workers (`QueueHold`), with
  every command sent to a worker (`inline_seconds = -1`, until the `inline_threshold` rule
  changes it): each command stops after its bookkeeping (allocations made, an eviction under
  way) with its record in flight, and everything behind it waits, until a rule awaits
  something or lets one queue run alone (`run_one_queue`). Deallocating, writing or submitting
  against work in flight then happens in a reproducible order, so failing examples shrink.
- Every handle is kept (`DeviceModel`), deallocated and failed ones too, so a leak cannot be
  hidden by the garbage collector freeing a dropped tensor.
- Accounting is exact where it can be: the rules that wait (`to_host`, `wait`, `drain`) let the
  device run until it is idle, then `memory_used` must equal the storages of the live tensors
  (and the buffers only live traces keep) to the byte; after every other rule the invariant
  checks bounds that hold with work in flight.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import attrs
import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from .._observe.timeline import TimelineRecorder, record_timeline
from .._runtime.device import Device, open_device
from .._errors import (DeallocatedTensorError, LayoutError, OutOfMemoryError, ProgramError, TraceError,
                       TTFlowError)
from .._ir.binary import Binary
from .._ir.program import Program, TensorSpec
from .._runtime.calls import deallocate, empty, submit, to_device, to_host, to_layout, wait, write
from .._runtime.tensor import Tensor
from .._types import DataType, DeviceSpec, Layout, MemorySpace
from ._machine_loop import LoopHarness
from ._model import DeviceModel, ModelTensor, QueueHold, drain
from ._reference import ExpectedValue, space_capacity, storage_geometry, stored
from ._strategies import arrays, layouts

__all__ = ["MachineBase", "ModelProgram", "arrays_zeros"]


def _submit_recording_layouts(device: Device, chosen: ModelProgram, tensors: list[Tensor],
                              donors: list[int]) -> tuple[Any, list[bool]]:
    """Submits on the loop thread; returns its outputs or its error, and whether each donor was
    in the declared layout just before (made in it, or holding a copy in it)."""
    program = chosen.program
    in_layout = []
    for i in donors:
        layout = program.inputs[i].layout
        state = tensors[i]._state
        in_layout.append(state.declared == layout or any(l == layout for l, _ in tensors[i].storages))
    try:
        return submit(device, chosen.binary, chosen.index, tensors), in_layout
    except TTFlowError as exc:
        return exc, in_layout

T = TypeVar("T")


@attrs.frozen(eq=False)
class ModelProgram:
    """A program the machine may submit, and its reference.

    `reference(*inputs)` takes one `ExpectedValue` per program input, already converted to the
    input's declared dtype (as the program's start converts it), and returns one per output
    before the output's own rounding (the machine stores each as its declared dtype). Build the
    results with `ExpectedValue.map`, which needs functions non-decreasing in every argument.
    """

    binary: Binary
    reference: Callable[..., Sequence[ExpectedValue]]
    index: int = 0

    @property
    def program(self) -> Program:
        return self.binary.programs[self.index]

    def __repr__(self) -> str:
        return f"<ModelProgram {self.program.name!r}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis prints failing steps so
        p.text(repr(self))


async def _settled(check: Callable[[], None], checkpoints: int) -> None:
    """Lets the queues take every step they can without waiting (a few checkpoints), then
    runs `check`: with worker threads held, each rule then starts from a settled device, which
    keeps failing examples reproducible while hypothesis shrinks them."""
    for _ in range(checkpoints):
        await anyio.lowlevel.checkpoint()
    check()


async def _await(tensor: Tensor) -> None:
    await tensor


async def _outcomes(tensors: list[Tensor], how: str) -> list[Any]:
    """Waits for each tensor in turn; each outcome is None or the TTFlowError it raised, except
    the last one's with `how == "to_host"`: its value."""
    outcomes: list[Any] = []
    for k, tensor in enumerate(tensors):
        try:
            if k == len(tensors) - 1 and how == "to_host":
                outcomes.append(await to_host(tensor))
            else:
                await (_await(tensor) if how == "await" else wait(tensor))
                outcomes.append(None)
        except TTFlowError as exc:
            outcomes.append(exc)
    return outcomes


async def _drained_outcomes(device: Device, tensors: list[Tensor]) -> list[Any]:
    """Drains the device, then reads each tensor back: its value, or the TTFlowError it raises."""
    await drain(device)
    outcomes: list[Any] = []
    for tensor in tensors:
        try:
            outcomes.append(await to_host(tensor))
        except TTFlowError as exc:
            outcomes.append(exc)
    return outcomes



class MachineBase(LoopHarness, RuleBasedStateMachine):
    """The device, the model and the data rules of `RuntimeStateMachine` (which see)."""

    spec: ClassVar[DeviceSpec] = DeviceSpec.small()
    shapes: ClassVar[Sequence[tuple[int, ...]]] = ((40, 33),)
    programs: ClassVar[Sequence[ModelProgram]] = ()
    donating_programs: ClassVar[Sequence[ModelProgram]] = ()
    """Programs with `output(donates=)`, for the `submit_donating` rule (not `submit`'s: a
    donation consumes its input, which the model must know)."""
    max_tensors: ClassVar[int] = 64
    hold_workers: ClassVar[bool] = True
    """Hold the worker threads between waiting rules (see the module docstring). False lets
    commands run on their own, concurrently with the rules: more like production, but an
    example that fails may not fail again the same way, which makes shrinking slow."""
    inline_seconds: ClassVar[float | None] = -1.0
    """ttflow runs a command inline when its estimated run time is at most this many seconds,
    else on a worker thread. -1 (the default here) sends every command to a thread, so that a held thread stops
    every command mid-flight; None keeps ttflow's setting (100 us): then only large commands
    stop, the others run inline. The device's own setting (`open_device(inline_seconds=...)`),
    which the `inline_threshold` rule changes while the machine runs."""
    settle_checkpoints: ClassVar[int] = 8
    """Checkpoints the loop gets after each rule before the invariant (see `_settled`)."""
    eviction: ClassVar[str] = "lookahead"
    """The device's L1 eviction policy (`open_device(eviction=...)`)."""
    workers: ClassVar[str] = "thread"
    """Where the device's records run (`open_device(workers=...)`): "process" drives every rule
    against a worker process (held records then wait in its queue's thread or in the child)."""
    num_hw_cqs: ClassVar[int] = 2
    """The device's hardware command queues (`open_device(num_hw_cqs=...)`): with 1, every
    write queues on CQ0 among the programs it feeds and the reads that follow."""
    fragment_dram: ClassVar[bool] = False
    """Whether `fragment` also fragments DRAM: it fills DRAM to the brim (a zero "ballast"
    tensor over all of it but the fragments' room and a few KiB) until `request` runs. Meanwhile
    `room()` is False: set it only if every rule of yours that allocates checks `room()`. Only
    on devices whose DRAM takes at most `max_ballast_bytes` (the small one's 64 MiB, not an
    n150's 12 GiB). L1 is fragmented in any case."""
    max_ballast_bytes: ClassVar[int] = 128 * 2**20

    def __init__(self) -> None:
        super().__init__()
        self._ballasts: list[ModelTensor] = []
        # Tensors the other rules leave alone (never picked, freed, or counted by `room`): the
        # ballasts and requests of `request`, whose shapes depend on the device's memory view.
        # Drawing from them would make an example play differently when it is replayed.
        self._aside: set[ModelTensor] = set()
        # The tensors of `fragment` and their conversions, of shapes not among `shapes`: only
        # the rules here that take any shape pick them (`pick`).
        self._fragments: set[ModelTensor] = set()
        self._fragmented: dict[MemorySpace, list[ModelTensor]] = {}
        self.hold: QueueHold | None = None
        # the timeline the `timeline` rule records, while it does: its runs take the timed path
        self._timeline: tuple[Any, TimelineRecorder] | None = None
        self.open_loop()
        try:
            self._device_cm = self.portal.wrap_async_context_manager(
                open_device(self.spec, eviction=self.eviction, inline_seconds=self.inline_seconds,
                            workers=self.workers, num_hw_cqs=self.num_hw_cqs))
            self.device: Device = self._device_cm.__enter__()
            self.model = DeviceModel(self.spec)
            self.hold = QueueHold(self.device)
            if self.hold_workers:
                self.portal.call(self.hold.acquire)
        except BaseException:
            self._close()
            raise

    # -- talking to the loop (`LoopHarness`: call, run, expect_raises, expect_raises_async) ----

    def held_queues(self) -> tuple[Sequence[QueueHold], Sequence[Device]]:
        if self.hold is not None and self.hold.held:
            return [self.hold], [self.device]
        return [], []

    # -- the model ----------------------------------------------------------------------------

    def pick(self, data: st.DataObject, where: Callable[[ModelTensor], bool] | None = None,
             label: str = "tensor", *, any_shape: bool = False) -> ModelTensor:
        """Draws a tracked tensor (deallocated and failed ones too, unless `where` says).

        Not the tensors of `fragment` (and their conversions), whose shapes are not among
        `shapes`, unless `any_shape` (the machine's own rules that take any shape); never a
        ballast or request (`request`).
        """
        # Newest first: an example shrinks toward using the latest tensor, and deleting an
        # unrelated earlier step does not change which tensor a later step picks.
        candidates = [e for e in reversed(self.model.tensors)
                      if (where is None or where(e)) and self._pickable(e, any_shape)]
        if not candidates:
            raise ValueError(f"no tracked tensor for {label}: guard the rule with a precondition")
        return data.draw(st.sampled_from(candidates), label=label)

    def has(self, where: Callable[[ModelTensor], bool] | None = None, *, any_shape: bool = False) -> bool:
        """Whether `pick` has a candidate."""
        return any((where is None or where(e)) and self._pickable(e, any_shape) for e in self.model.tensors)

    def _pickable(self, entry: ModelTensor, any_shape: bool) -> bool:
        return entry not in self._aside and (any_shape or entry not in self._fragments)

    def _is_ballast(self, entry: ModelTensor) -> bool:
        return any(entry is b for b in self._ballasts)

    def room(self) -> bool:
        """Whether new tensors are welcome: few enough, and DRAM far from full (no ballast)."""
        return (
            len(self.model.tensors) - len(self._aside) < self.max_tensors
            and not self._ballasts  # DRAM is full until `request` lets go of it
            and self.model.dram_estimate() - self._aside_estimate()
            < space_capacity(self.spec, MemorySpace.DRAM) // 4
        )

    def _aside_estimate(self) -> int:
        """`DeviceModel.dram_estimate` of the live tensors set aside."""
        return sum(
            3 * storage_geometry(e.shape, attrs.evolve(e.home, memory=MemorySpace.DRAM), self.spec).footprint
            for e in self._aside if not e.deallocated
        )

    def _usable_l1_bank(self) -> int:
        size = self.spec.l1_bank_bytes
        return size - size % self.spec.l1_alignment

    def _l1_depth(self, shape: tuple[int, ...], layout: Layout) -> int:
        if layout.memory is not MemorySpace.L1:
            return 0
        return storage_geometry(shape, layout, self.spec).depth

    def push(self, array: Any, layout: Layout, label: str | None = None) -> ModelTensor | None:
        """`to_device(array, layout)`, tracked; None when it is an L1 tensor larger than an L1
        bank, which must raise OutOfMemoryError at once. Any other L1 tensor must be made (the
        runtime evicts, relocates or spills it to DRAM), and so must a DRAM one (`room`)."""
        layout = layout.resolve(DataType.from_numpy(array.dtype))
        assert layout.dtype is not None
        depth = self._l1_depth(tuple(array.shape), layout)
        try:
            tensor = self.call(to_device, array, self.device, layout)
        except OutOfMemoryError as exc:
            self._check_refused("to_device", layout, depth, exc)
            return None
        assert depth <= self._usable_l1_bank(), (
            f"to_device gave an L1 tensor of {depth} bytes per bank; banks hold {self.spec.l1_bank_bytes}"
        )
        entry = self.model.track(tensor, layout, stored(array, layout.dtype), label=label)
        # Every pushed tensor is named, on the loop thread, while its write may still be queued
        # or in flight: `memory_views_consistent` then checks that each of its storages (the
        # home, conversions, an evicted copy, a trace's) is shown with that name. No draw, so
        # the examples the machine explores stay the same.
        self.call(setattr, tensor, "name", entry.name)
        entry.given_name = entry.name
        return entry

    def _check_refused(self, what: str, layout: Layout, depth: int, exc: OutOfMemoryError) -> None:
        """An OutOfMemoryError at call time: only for an L1 request larger than an L1 bank (the
        machine keeps DRAM far from full outside `fragment`), with the memory view."""
        assert layout.memory is MemorySpace.L1, f"{what} ran out of DRAM far below capacity: {exc}"
        assert depth > self._usable_l1_bank(), (
            f"{what} of an L1 tensor of {depth} bytes per bank raised {exc}; it fits in an L1 bank "
            f"({self._usable_l1_bank()} bytes): the runtime must make room, or spill it to DRAM"
        )
        assert exc.view is not None, f"{what}: the OutOfMemoryError carries no memory view: {exc}"

    def convert(self, source: ModelTensor, layout: Layout, consume: bool = False) -> ModelTensor | None:
        """`to_layout(source, layout)`, tracked (a deallocated source must raise). `consume`:
        with retain=False, tt-mlir's rule: the source is deallocated once the conversion that
        reads it is queued (the result's retain is set back, so later submits keep it)."""
        if source.deallocated:
            self.expect_raises(DeallocatedTensorError, to_layout, source.tensor, layout)
            return None
        target = self.call(to_layout, source.tensor, layout, False if consume else None)
        if consume:
            assert source.tensor.is_deallocated and target.retain is False
            source.deallocated = True
            target.retain = True
        resolved = layout.resolve(source.dtype)
        assert resolved.dtype is not None
        expected = source.expected.stored_as(resolved.dtype) if source.expected is not None else None
        # Into L1: larger than an L1 bank, it fails; otherwise the runtime makes room (evicts,
        # relocates) or spills the copy to DRAM: it cannot fail on its own.
        depth = self._l1_depth(source.shape, resolved)
        entry = self.model.track(
            target, resolved, expected,
            label=f"{self._next_label()} = to_layout({source.name})",
            fails_with=OutOfMemoryError if depth > self._usable_l1_bank() else None,
            parents=(source,),
        )
        if source in self._fragments:
            self._fragments.add(entry)
        return entry

    def run_program(self, model_program: ModelProgram, inputs: Sequence[ModelTensor],
                    submitted: Sequence[Tensor] | None = None) -> list[ModelTensor]:
        """`submit` of a model program on `inputs`, its outputs tracked with their references
        (`submitted`: the outputs of a submit the caller made itself)."""
        program = model_program.program
        outputs = submitted if submitted is not None else self.call(
            submit, self.device, model_program.binary, model_program.index, [e.tensor for e in inputs])
        # The L1 it allocates: its L1 inputs (once per tensor and layout) and L1 outputs (but a
        # donated output, which takes its input's buffer). One larger than an L1 bank fails it;
        # otherwise the runtime evicts, relocates or spills to DRAM, but the program's circular
        # buffers at the bottom of L1 may still clash with what it reads there: it may fail.
        l1_inputs = {(id(e), spec.layout): self._l1_depth(e.shape, spec.layout)
                     for e, spec in zip(inputs, program.inputs)}
        donated = dict(program.donations)
        sizes = [*l1_inputs.values()] + [
            self._l1_depth(s.shape, s.layout) for k, s in enumerate(program.output_specs)
            if k not in donated
        ]
        need, largest = sum(sizes), max(sizes, default=0)
        expected: list[ExpectedValue | None] = [None] * len(outputs)
        if all(e.expected is not None for e in inputs):
            args = [e.expected.stored_as(s.dtype) for e, s in zip(inputs, program.inputs)]  # type: ignore[union-attr]
            results = list(model_program.reference(*args))
            assert len(results) == len(outputs), f"the reference of {program.name!r} gave {len(results)} results"
            expected = [r.stored_as(s.dtype) for r, s in zip(results, program.output_specs)]
        names = ", ".join(e.name for e in inputs)
        return [
            self.model.track(
                tensor, spec.layout, value,
                label=f"{self._next_label()} = {program.name}({names})[{k}]",
                fails_with=OutOfMemoryError if largest > self._usable_l1_bank() else None,
                may_fail=need > 0, parents=tuple(inputs),
            )
            for k, (tensor, spec, value) in enumerate(zip(outputs, program.output_specs, expected))
        ]

    def observe(self, entry: ModelTensor, how: str = "to_host") -> None:
        """Waits for `entry` (`how`: "to_host", "wait" or "await") and checks the outcome.

        Its unsettled ancestors are waited for first, oldest first: their outcomes say what to
        expect of it (a failed input fails it).
        """
        if entry.deallocated:
            waiter = {"to_host": to_host, "wait": wait, "await": _await}[how]
            self.expect_raises_async(DeallocatedTensorError, waiter, entry.tensor)
            return
        ancestors = self._unsettled_ancestors(entry)
        outcomes = self.run(_outcomes, [a.tensor for a in ancestors] + [entry.tensor], how)
        for ancestor, outcome in zip(ancestors, outcomes):
            ancestor.record(outcome if isinstance(outcome, BaseException) else None)
        result = outcomes[-1]
        if isinstance(result, BaseException):
            entry.record(result)
            return
        entry.record(None)
        if how == "to_host":
            assert entry.expected is not None
            entry.expected.check(result, what=repr(entry))

    def drain_and_check(self) -> None:
        """Waits for every queued command, then reads every live tensor back and checks its
        value or its error against the model, and the device's memory exactly."""
        # A ballast of `fragment` (tens of MiB of zeros) is read back once, by `request`.
        live = [e for e in self.model.tensors if not e.deallocated and not self._is_ballast(e)]
        outcomes = self.run(_drained_outcomes, self.device, [e.tensor for e in live])
        for entry, outcome in zip(live, outcomes):
            if isinstance(outcome, BaseException):
                entry.record(outcome)
            else:
                entry.record(None)
                assert entry.expected is not None
                entry.expected.check(outcome, what=repr(entry))
        self.call(self.model.check_drained, self.device, self.pinned_by_traces())
        done = [e for e in self.model.tensors
                if e in self._aside and not e.deallocated and not self._is_ballast(e)]
        self.call(_deallocate_all, [e.tensor for e in done])
        for entry in done:
            entry.deallocated = True

    def pinned_by_traces(self) -> dict[MemorySpace, int] | None:
        """Bytes per space that only live traces keep (none here: see `TraceRules`)."""
        return None

    def donation_refused(self, donors: Sequence[ModelTensor]) -> bool:
        """Whether a donating submit of `donors` must raise TraceError (a live trace writes one)."""
        return False

    def _unsettled_ancestors(self, entry: ModelTensor) -> list[ModelTensor]:
        found: dict[int, ModelTensor] = {}
        stack = list(entry.parents)
        while stack:
            e = stack.pop()
            if id(e) not in found and not e.resolved and not e.deallocated and not e.known_ok:
                found[id(e)] = e
                stack.extend(e.parents)
        order = {id(e): i for i, e in enumerate(self.model.tensors)}
        return sorted(found.values(), key=lambda e: order[id(e)])

    def _next_label(self) -> str:
        return f"t{len(self.model.tensors)}"

    def _fits(self, entry: ModelTensor, spec: TensorSpec) -> bool:
        return (
            not entry.deallocated
            and entry.shape == spec.shape
            and (entry.dtype is spec.dtype or (entry.dtype.is_float and spec.dtype.is_float))
        )

    def _draw_inputs(self, data: st.DataObject, program: Program,
                     layout_for: Callable[[int, TensorSpec], st.SearchStrategy[Layout]]) -> list[ModelTensor]:
        """One tracked tensor per program input: an existing one that fits, or a new one in a
        layout drawn from `layout_for(k, spec)` (in DRAM when L1 has no room now)."""
        inputs = []
        for k, spec in enumerate(program.inputs):
            fits = functools.partial(self._fits, spec=spec)
            if self.has(fits) and not data.draw(st.booleans(), label=f"fresh input {k}"):
                inputs.append(self.pick(data, fits, label=f"input {k}"))
                continue
            layout = data.draw(layout_for(k, spec), label=f"layout {k}")
            array = data.draw(arrays(layout.dtype, spec.shape), label=f"array {k}")  # type: ignore[arg-type]
            entry = self.push(array, layout, label=self._next_label())
            if entry is None:  # no room in L1 now: DRAM then
                entry = self.push(array, attrs.evolve(layout, memory=MemorySpace.DRAM),
                                  label=self._next_label())
            assert entry is not None
            inputs.append(entry)
        return inputs

    # -- rules --------------------------------------------------------------------------------

    @precondition(lambda self: self.room())
    @rule(data=st.data())
    def to_device(self, data: st.DataObject) -> None:
        shape = data.draw(st.sampled_from(self.shapes), label="shape")
        layout = data.draw(layouts(), label="layout")
        assert layout.dtype is not None
        # A float layout also takes a float32 array, rounded by to_device.
        host = DataType.FLOAT32 if layout.dtype.is_float and data.draw(st.booleans(), label="f32") else layout.dtype
        self.push(data.draw(arrays(host, shape), label="array"), layout, label=self._next_label())

    @precondition(lambda self: self.room())
    @rule(data=st.data())
    def empty(self, data: st.DataObject) -> None:
        shape = data.draw(st.sampled_from(self.shapes), label="shape")
        layout = data.draw(layouts(), label="layout")
        assert layout.dtype is not None
        try:
            tensor = self.call(empty, shape, layout.dtype, self.device, layout)
        except OutOfMemoryError as exc:
            self._check_refused("empty", layout, self._l1_depth(shape, layout), exc)
            return
        zeros = stored(arrays_zeros(shape, layout.dtype), layout.dtype)
        self.model.track(tensor, layout, zeros, label=f"{self._next_label()} = empty")

    @precondition(lambda self: self.room() and self.has(any_shape=True))
    @rule(data=st.data())
    def to_layout(self, data: st.DataObject) -> None:
        source = self.pick(data, label="source", any_shape=True)
        if source.dtype.is_float:
            floats = [DataType.FLOAT32, DataType.BFLOAT16, DataType.BFLOAT8_B]
            dtype = data.draw(st.sampled_from([None, *floats]), label="dtype")
        else:
            dtype = data.draw(st.sampled_from([None, source.dtype]), label="dtype")
        layout = data.draw(layouts(dtype if dtype is not None else source.dtype), label="layout")
        consume = data.draw(st.booleans(), label="consume (retain=False)")
        self.convert(source, attrs.evolve(layout, dtype=dtype), consume)  # dtype None: keep the tensor's

    @precondition(lambda self: self.room() and bool(self.programs))
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        chosen = data.draw(st.sampled_from(self.programs), label="program")

        def any_layout(k: int, spec: TensorSpec) -> st.SearchStrategy[Layout]:
            # Any layout of a dtype the program takes.
            dtypes = [DataType.FLOAT32, DataType.BFLOAT16, DataType.BFLOAT8_B] if spec.dtype.is_float else [spec.dtype]
            return layouts(data.draw(st.sampled_from(dtypes), label=f"dtype {k}"))

        self.run_program(chosen, self._draw_inputs(data, chosen.program, any_layout))

    @precondition(lambda self: self.room() and bool(self.donating_programs))
    @rule(data=st.data())
    def submit_donating(self, data: st.DataObject) -> None:
        """A program that donates an input: the donor is consumed (its handle then refuses new
        work) and the output takes its buffer. A donor given twice is a ProgramError, one that
        is neither made in nor already converted to the declared layout a LayoutError; after
        either the donor is not consumed."""
        chosen = data.draw(st.sampled_from(self.donating_programs), label="program")
        program = chosen.program
        # Mostly the declared layout (a donor must be in it), sometimes another one of its dtype.
        inputs = self._draw_inputs(
            data, program, lambda k, spec: st.one_of(st.just(spec.layout), layouts(spec.dtype)))
        donors = {i for _, i in program.donations}
        outcome, in_layout = self.call(_submit_recording_layouts, self.device, chosen,
                                       [e.tensor for e in inputs], sorted(donors))
        twice = any(inputs[i] is e for i in donors for j, e in enumerate(inputs) if j != i)
        if twice:
            assert isinstance(outcome, ProgramError), f"a donor given twice gave {outcome!r}"
            return
        if not all(in_layout):
            assert isinstance(outcome, LayoutError), f"a donor in another layout gave {outcome!r}"
            return
        if self.donation_refused([inputs[i] for i in sorted(donors)]):
            assert isinstance(outcome, TraceError), f"donating a traced output gave {outcome!r}"
            return
        assert not isinstance(outcome, BaseException), f"the donating submit raised {outcome!r}"
        self.run_program(chosen, inputs, submitted=outcome)
        for i in donors:
            inputs[i].deallocated = True
            self.expect_raises(DeallocatedTensorError, write, inputs[i].tensor,
                               arrays_zeros(inputs[i].shape, inputs[i].dtype))

    @precondition(lambda self: self.room() and bool(self.programs))
    @rule(data=st.data())
    def write_between_runs(self, data: st.DataObject) -> None:
        """A program, a new value written into one of its inputs, the program again: the second
        run must see the new value (write-after-read ordering, and the input's conversions
        made for the first run dropped), the first the old one."""
        chosen = data.draw(st.sampled_from(self.programs), label="program")
        specs = chosen.program.inputs
        known = [
            [e for e in reversed(self.model.tensors) if self._fits(e, s) and e.known_ok] for s in specs
        ]
        if not all(known):
            return
        inputs = [data.draw(st.sampled_from(c), label=f"input {k}") for k, c in enumerate(known)]
        self.run_program(chosen, inputs)
        target = data.draw(st.sampled_from(inputs), label="written")
        array = data.draw(arrays(target.dtype, target.shape), label="array")
        self.call(write, target.tensor, array)
        target.expected = stored(array, target.dtype)
        self.run_program(chosen, inputs)

    @precondition(lambda self: self.has(lambda e: e.deallocated or e.known_ok or e.known_failed,
                                        any_shape=True))
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        """A new value; into a deallocated tensor it raises at once, into a failed one (its
        producer ran out of memory, say) it fails on CQ1 with the tensor's error, which stays
        (CQ1 never makes room: a write allocates nothing)."""
        entry = self.pick(data, lambda e: e.deallocated or e.known_ok or e.known_failed, any_shape=True)
        array = data.draw(arrays(entry.dtype, entry.shape), label="array")
        if entry.deallocated:
            self.expect_raises(DeallocatedTensorError, write, entry.tensor, array)
            return
        self.call(write, entry.tensor, array)
        if entry.known_ok:
            entry.expected = stored(array, entry.dtype)
        else:
            event(f"write into a tensor that failed with {entry.error.__name__ if entry.error else '?'}")

    @precondition(lambda self: self.has(lambda e: not e.deallocated, any_shape=True))
    @rule(data=st.data())
    def deallocate(self, data: st.DataObject) -> None:
        entry = self.pick(data, lambda e: not e.deallocated, any_shape=True)
        if data.draw(st.booleans(), label="force=False first"):
            self.call(deallocate, entry.tensor, False)  # tt-mlir's rule: retained, so left alone
            assert not entry.tensor.is_deallocated, "deallocate(force=False) freed a retained tensor"
        self.call(deallocate, entry.tensor)
        if data.draw(st.booleans(), label="twice"):
            self.call(deallocate, entry.tensor)  # a no-op
        entry.deallocated = True
        use = data.draw(st.sampled_from(["to_host", "wait", "await", "to_layout", "write", "submit"]),
                        label="then")
        t = entry.tensor
        if use in ("to_host", "wait", "await"):
            self.observe(entry, use)
        elif use == "write":
            self.expect_raises(DeallocatedTensorError, write, t, arrays_zeros(t.shape, t.dtype))
        elif use == "submit" and self.programs:
            program = data.draw(st.sampled_from(self.programs), label="program")
            args = [t] * len(program.program.inputs)  # the first input is checked first
            self.expect_raises(DeallocatedTensorError, submit, self.device, program.binary,
                               program.index, args)
        else:
            self.expect_raises(DeallocatedTensorError, to_layout, t, Layout())

    @precondition(lambda self: self.has(lambda e: not e.deallocated))
    @rule(data=st.data())
    def deallocate_many(self, data: st.DataObject) -> None:
        """Frees a batch at once, as a front-end does at the end of a step."""
        live = [e for e in self.model.tensors if not e.deallocated and e not in self._aside]
        chosen = [e for e in live if data.draw(st.booleans(), label=f"free {e.name}")]
        self.call(_deallocate_all, [e.tensor for e in chosen])
        for entry in chosen:
            entry.deallocated = True

    @precondition(lambda self: self.has(any_shape=True))
    @rule(data=st.data())
    def to_host(self, data: st.DataObject) -> None:

        self.observe(self.pick(data, any_shape=True), "to_host")
        if self.hold_workers:  # the device is idle: check it exactly
            self.drain_and_check()

    @precondition(lambda self: self.has(any_shape=True))
    @rule(data=st.data())
    def wait(self, data: st.DataObject) -> None:
        entry = self.pick(data, any_shape=True)
        self.observe(entry, data.draw(st.sampled_from(["wait", "await"]), label="how"))
        if self.hold_workers:
            self.drain_and_check()

    @rule()
    def drain(self) -> None:
        self.drain_and_check()

    @rule(on=st.booleans())
    def timeline(self, on: bool) -> None:
        """Starts or stops recording a timeline. Runs inside it take `_commands.run`'s timed
        path: no one-step fast path, a clock read around each op, host ops' and ops' spans
        noted; every value still checked against the model. Stopped, each op slice it holds sits
        inside its program's slice, and the scheduler times no more runs."""
        if on and self._timeline is None:
            cm = record_timeline(self.device)
            self._timeline = (cm, self.call(cm.__enter__))
        elif not on and self._timeline is not None:
            self._stop_timeline()

    def _stop_timeline(self) -> None:
        assert self._timeline is not None
        cm, recorder = self._timeline
        self._timeline = None
        self.call(cm.__exit__, None, None, None)
        events = self.call(lambda: list(recorder.events))
        programs = [e for e in events if e.get("cat") == "ProgramCommand"]
        for op in (e for e in events if e.get("cat") == "op"):
            assert isinstance(op["args"]["step"], int), op
            assert any(p["ts"] <= op["ts"] and op["ts"] + op["dur"] <= p["ts"] + p["dur"] + 1e-3
                       for p in programs), f"op slice {op} outside every program's slice"

    @invariant()
    def runs_are_timed_only_while_a_timeline_records(self) -> None:
        timing = self.device._scheduler.timing
        assert timing == (self._timeline is not None), f"scheduler.timing {timing}, recording {self._timeline is not None}"


    @invariant()
    def memory_within_bounds(self) -> None:
        self.portal.call(
            _settled, functools.partial(self.model.check_bounds, self.device), self.settle_checkpoints
        )

    @invariant()
    def memory_views_consistent(self) -> None:
        """`memory_view` of each space adds up, nothing in it overlaps, and every storage a
        tracked tensor lists is in it, at its address, as deep as SPEC says (no waiting)."""
        self.call(_check_memory_views, self.device, self.model)

    def let_go_of_traces(self) -> None:
        """Releases whatever traces the rules keep (see `TraceRules`), before teardown."""

    def teardown(self) -> None:
        try:
            if self._timeline is not None:
                self._stop_timeline()
            self.let_go_of_traces()
            self.call(_deallocate_all, [e.tensor for e in self.model.tensors])
            for entry in self.model.tensors:
                entry.deallocated = True
            self.drain_and_check()
            for space in MemorySpace:
                used = self.call(self.device.memory_used, space)
                assert used == 0, f"{space.name}: {used} bytes still allocated with every tensor deallocated"
        finally:
            self._close()

    def _close(self) -> None:
        try:
            if self.hold is not None:
                self.call(self.hold.release)
            if hasattr(self, "device"):
                self._device_cm.__exit__(None, None, None)
        finally:
            self.close_loop()




def _check_memory_views(device: Device, model: DeviceModel) -> None:
    spec = model.spec
    for space in MemorySpace:
        view = device.memory_view(space)
        banks = spec.banks(space)
        what = f"{space.name} memory view"
        assert view.space is space and view.num_banks == banks, f"{what}: {view.space}, {view.num_banks} banks"
        assert view.total == space_capacity(spec, space), f"{what}: total {view.total}"
        assert view.used == sum(b.nbytes for b in view.buffers), (
            f"{what}: used {view.used}, its buffers add up to {sum(b.nbytes for b in view.buffers)}\n{view}")
        assert view.free == view.total - view.used, f"{what}: free {view.free} + used {view.used} != {view.total}"
        assert 0 <= view.largest_free_block <= view.free, (
            f"{what}: largest free block {view.largest_free_block}, free {view.free}")
        blocks = sorted(view.free_blocks)
        assert sum(d for _, d in blocks) * banks == view.free, f"{what}: free blocks {blocks}, free {view.free}"
        assert max((d for _, d in blocks), default=0) * banks == view.largest_free_block, (
            f"{what}: free blocks {blocks}, largest {view.largest_free_block}")
        size = view.total // banks
        spans = sorted([(b.address, b.address + b.depth, b.kind) for b in view.buffers]
                       + [(a, a + d, "free") for a, d in blocks])
        for b in view.buffers:
            assert b.depth > 0 and b.nbytes == b.depth * banks, f"{what}: {b}"
            assert b.kind in _KINDS, f"{what}: a buffer of kind {b.kind!r}"
        for (start, end, kind), (next_start, _, next_kind) in itertools.pairwise(spans):
            assert 0 <= start < end <= next_start, (
                f"{what}: [{start}, {end}) ({kind}) overlaps [{next_start}, ...) ({next_kind})\n{view}")
        assert not spans or spans[-1][1] <= size, f"{what}: {spans[-1]} beyond the bank's {size} bytes"
        used = device.memory_used(space)
        idle = sum(b.nbytes for b in view.buffers if b.kind == "circular_buffers")
        assert used == view.used or (space is MemorySpace.L1 and used == view.used - idle), (
            f"{what}: memory_used is {used}, the view says {view.used} ({idle} of circular buffers)")
        at = {b.address: b for b in view.buffers}
        for e in model.tensors:
            for k, (layout, buffer) in enumerate(e.tensor.storages):
                if buffer.space is not space:
                    continue
                shown = at.get(buffer.address)
                want = -(-buffer.num_pages // banks) * buffer.aligned_page_size
                assert shown is not None and shown.depth == want, (
                    f"{what}: {e!r} lists a storage at {buffer.address}, {want} bytes deep; the view "
                    f"has {shown}\n{view}")
                if shown.kind != "pending":  # a move's target is its command's until it lands
                    assert shown.tensor == e.given_name, (
                        f"{what}: {e!r} (named {e.given_name!r}) has its storage at {buffer.address} "
                        f"shown as {shown.tensor!r}\n{view}")
                assert shown.kind == ("home" if k == 0 else "conversion"), (
                    f"{what}: storage {k} of {e!r} is a {shown.kind!r} buffer")
                assert (shown.layout, shown.shape) == (layout, e.shape), (
                    f"{what}: storage {k} of {e!r} ({layout}) shows as {shown}")


_KINDS = frozenset({"home", "conversion", "pending", "scratch", "circular_buffers", "trace"})


def _deallocate_all(tensors: list[Tensor]) -> None:
    for tensor in tensors:
        deallocate(tensor)


def arrays_zeros(shape: tuple[int, ...], dtype: DataType) -> np.ndarray[Any, Any]:
    """A zero host array for a `dtype` tensor."""
    return np.zeros(shape, dtype.host_dtype)
