"""The data-path commands: a host write, a host read, a layout conversion, a deferred
allocation, and a program run.

Each decides into a `Record` (plain data naming storages) and commits by calling
`SchedulerState`'s methods; none assigns a scheduling field or edits a table itself. When a
decision runs out of memory, the command asks `room` what to run first (`make_room`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, final

import numpy as np

from .._commands import Compute, Copy, Load, PageCode, Record, Store, estimate, page_kernel, pagewise_storages
from .._errors import OutOfMemoryError, ProgramError
from .._memory.banks import Storage
from .._memory import storage_io as io
from .._queue import NO_DEPS as _NO_DEPS, Command
from .._core._dispatch import finish
from .._memory.storage_io import row_bytes
from .._types import Layout, MemorySpace, TensorLayout
from . import room
from .state import Geometry, SchedulerState, TensorState, spilled

__all__ = ["WriteCommand", "ReadCommand", "ConvertCommand", "AllocateCommand", "ProgramCommand"]


class _Scheduled(Command):
    """A command of this scheduler: it reads and writes tensor states."""

    spillable = True  # its own L1 allocations may go to DRAM (`room.make_room`)
    __slots__ = ()

    def __init__(self, scheduler: SchedulerState, reads: tuple[TensorState, ...],
                 writes: tuple[TensorState, ...]) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.reads = reads
        self.writes = writes

    def failed_input(self) -> BaseException | None:
        for state in self.reads:
            if state.error is not None:
                return state.error
        return None

    def make_room(self, error: OutOfMemoryError) -> Command | object | None:
        """What to run before deciding again, after `decide` ran out of memory (see
        `room.make_room`)."""
        return room.make_room(self.scheduler, self, error, self.circular_buffer_bytes())

    def out_of_memory(self, error: OutOfMemoryError) -> OutOfMemoryError:
        return self.scheduler.out_of_memory(error)

    def circular_buffer_bytes(self) -> int:
        """The per-core L1 bytes of circular buffers the command runs with (a program's, a
        trace replay's; none here), held or not: room does not take back the region from a
        command that needs it."""
        return 0


class WriteCommand(_Scheduled):
    """A host array (or zeros) into a tensor's home storage; a new value drops old conversions."""

    name = "write"
    batchable = True
    __slots__ = ("array", "new_value", "staged", "tried_ahead")

    def __init__(self, scheduler: SchedulerState, state: TensorState,
                 array: np.ndarray[Any, Any] | None, new_value: bool) -> None:
        super().__init__(scheduler, (), (state,))
        self.array = array
        self.new_value = new_value
        self.staged: np.ndarray[Any, Any] | None = None  # the array as the home storage's pages
        self.tried_ahead = False

    def work_ahead(self) -> Callable[[], np.ndarray[Any, Any]] | None:
        """Converts the array to the home storage's pages while an earlier command still reads
        the tensor (a double-buffered input slot): worth a worker hand-off only when large. The
        home storage's format (dtype, TILE) is the tensor's for life; an eviction only moves it."""
        array, state = self.array, self.writes[0]
        if self.tried_ahead or array is None or not state.storages:
            return None
        home = state.storages[0]
        queue = self.queue
        inline = queue.inline_seconds if queue is not None else 0.0
        if home.layout.tensor_layout is not TensorLayout.TILE or estimate(home.nbytes, 0, 0) <= inline:
            return None
        self.tried_ahead = True
        return functools.partial(io.stage_array, state.dtype, array)

    def worked_ahead(self, result: Any) -> None:
        self.staged = result

    def blocker(self) -> Command | None:
        moving = self.writes[0].moving
        if moving is not None and not moving.done:
            return moving
        return super().blocker()

    def decide(self) -> Record:
        state = self.writes[0]
        if not state.storages:
            if state.error is not None:  # its home could not be allocated (`AllocateCommand`)
                raise state.error
            raise ProgramError("the tensor has no device storage: its producer failed")
        if self.new_value:
            self.scheduler.drop_conversions(state)
        target = state.storages[0]
        return Record((Store(target, self.array, self.staged),), nbytes=target.nbytes)

    def commit(self, record: Record, result: Any) -> None:
        if self.array is not None:
            self.scheduler.count("host_to_device_bytes", self.array.nbytes)

    def forget(self) -> None:
        self.array = None
        self.staged = None

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["name"] = "write" if self.array is not None else "zero_fill"
        return info


class ReadCommand(_Scheduled):
    """A tensor's value back to a host array (`result`)."""

    name = "read"
    __slots__ = ("result",)

    def __init__(self, scheduler: SchedulerState, state: TensorState) -> None:
        super().__init__(scheduler, (state,), ())
        self.result: np.ndarray[Any, Any] | None = None

    def decide(self) -> Record:
        state = self.reads[0]
        source = state.exact_source()
        return Record((Load(source, state.shape),), nbytes=source.nbytes)

    def commit(self, record: Record, result: Any) -> None:
        self.result = result
        self.scheduler.count("device_to_host_bytes", result.nbytes)


class ConvertCommand(_Scheduled):
    """`to_layout`: a new tensor holding the source's value in another layout."""

    name = "to_layout"
    __slots__ = ("layout",)

    def __init__(self, scheduler: SchedulerState, source: TensorState, target: TensorState,
                 layout: Layout) -> None:
        super().__init__(scheduler, (source,), (target,))
        self.layout = layout

    def decide(self) -> Record:
        source, target = self.reads[0], self.writes[0]
        if not source.storages:
            raise ProgramError("the source tensor has no device storage")
        src = source.conversion_source(self.layout)
        dst = self.scheduler.allocate_spilling(self.layout, target.shape, target, self.spill)
        return Record((Copy(src, dst, source.shape),), nbytes=src.nbytes + dst.nbytes)

    def commit(self, record: Record, result: Any) -> None:
        (copy,) = record.steps
        assert isinstance(copy, Copy)
        self.scheduler.add_storage(self.writes[0], copy.dst)
        self.scheduler.count_copy(copy.src, copy.dst)

    def rollback(self, record: Record) -> None:
        for step in record.steps:
            assert isinstance(step, Copy)
            self.scheduler.free(step.dst)


class AllocateCommand(_Scheduled):
    """A new tensor's home, when it did not fit at `to_device` / `empty` time although the
    space may make room (free but scattered, or L1 holding buffers that can be evicted): in
    CQ0's order, after what it must move, and before the tensor's write (which waits for it)."""

    name = "allocate"
    __slots__ = ("storage",)

    def __init__(self, scheduler: SchedulerState, state: TensorState) -> None:
        super().__init__(scheduler, (), (state,))
        self.storage: Storage | None = None

    def decide(self) -> Record:
        state = self.writes[0]
        self.storage = self.scheduler.allocate_spilling(state.declared, state.shape, state, self.spill)
        return Record(())

    def commit(self, record: Record, result: Any) -> None:
        assert self.storage is not None
        self.scheduler.add_storage(self.writes[0], self.storage)
        self.storage = None

    def rollback(self, record: Record) -> None:
        if self.storage is not None:
            self.scheduler.free(self.storage)
            self.storage = None


_new_tuple = tuple.__new__  # a NamedTuple made without its Python-level __new__
_NO_SCRATCH: dict[int, Storage] = {}  # shared by every record without scratch: never written


class ProgramCommand(_Scheduled):
    """One program run: evict, convert inputs, allocate, compute the steps, free scratch."""

    name = "program"
    __slots__ = ("host_spans", "op_spans")

    # Made only by `_core._dispatch.submit_program`, which sets its fields (scheduler, reads,
    # writes, program, plan; `converted`, the inputs each conversion step is kept on, is the
    # shared empty list until `_decide` converts). `host_spans`, `op_spans`: the host ops'
    # calls and the ops of its run, set by `commit` when the run was timed (a timeline
    # listens), else unset.

    def _timed(self) -> bool:
        """Whether the run notes its ops' and host ops' spans: a timeline listens."""
        return self.scheduler.timing > 0

    def preamble(self) -> Command | None:
        s = self.scheduler
        for listener in s.starting:  # the memory log (`Scheduler.starting_programs`)
            listener(self)
        if not s.evict_eagerly or not s.holds_l1():
            return None
        return room.eviction_for(s, self)

    def circular_buffer_bytes(self) -> int:
        return int(self.plan.footprint)

    def takes_fast_path(self, inline_seconds: float) -> bool:
        """The Python twin of `_core._dispatch.run_program`'s test: whether the C fast path
        must take this program now (its dependencies done, nothing unusual due, every input
        held in its declared layout, room for its outputs). A queue that checks its twin
        (`CommandQueue.check_twin`) counts each program the C path refused although this says
        it must take it: the two implementations of one rule drifted apart."""
        if self.capture is not None or any(not dep.done for dep in self.deps):
            return False
        s = self.scheduler
        if (s.evict_eagerly and s.holds_l1()) or s.listeners:
            return False
        if any(state.error is not None for state in self.reads):
            return False
        plan = self.plan
        bound = plan.bound
        if bound is None or bound.kernel is None or not plan.pagewise or bound.seconds > inline_seconds:
            return False
        if bound.kernel[0] is MemorySpace.L1 or plan.footprint > s.cb_depth:
            return False
        if any(state.find(layout) is None for state, layout in zip(self.reads, plan.input_layouts)):
            return False
        taken: list[tuple[Any, int]] = []  # its outputs must fit (tried on the allocator, undone)
        try:
            for _, space, _, _, _, depth, _ in bound.outputs:
                address = space.allocator.allocate(depth)
                if address is None:
                    return False
                taken.append((space.allocator, address))
        finally:
            for allocator, address in taken:
                allocator.free(address)
        return True

    def decidable_ahead(self) -> bool:
        """(Asked once its cross-queue dependencies are done.) A program whose inputs are
        already in the layouts it reads (no conversion), with no eviction due, no donation, no
        capture or timeline: then its decision is fresh allocations (outputs, scratch), which
        the running commands' commits cannot change; they only free. An input may be the output
        of a program ahead of it in its queue, decided and in flight (a chain): it then reads
        the storage that program's record writes (`_landing`), which the worker fills first,
        since it runs the queue's records in order. The records' scratch is then held at once."""
        plan = self.plan
        s = self.scheduler
        if (plan.donated or (s.evict_eagerly and s.holds_l1()) or s.listeners or s.starting
                or self.capture is not None):
            return False
        bound = plan.bound
        queue = self.queue
        assert queue is not None  # asked by the queue it waits in
        if bound is not None and bound.seconds <= queue.inline_seconds:
            return False
        for state, spec in zip(self.reads, self.program.inputs):
            if state.error is not None:
                return False
            writer = state.last_writer
            if writer is not None and not writer.done:
                if self.peers is not None or _landing(writer, state, spec.layout, queue) is None:
                    return False
            elif state.find(spec.layout) is None:
                return False
        return True

    def decide(self) -> Record:
        # The fast path: every input already has a storage in its declared layout and the
        # program needs no scratch, so the decision is the output allocations (their geometry
        # is precomputed per plan and device) and one Compute step.
        plan = self.plan
        bound = plan.bound
        if bound is None or self.spill or self.scheduler.hooks is not None:
            return self._decide()
        sources = []
        for state, layout in zip(self.reads, plan.input_layouts):
            for storage in state.storages:
                if storage.layout is layout or storage.layout == layout:
                    sources.append(storage)
                    break
            else:
                writer = state.last_writer
                landing = None
                if writer is not None and not writer.done:  # decided ahead: a chain (see above)
                    landing = _landing(writer, state, layout, self.queue)
                if landing is None:
                    return self._decide()
                sources.append(landing)
        s = self.scheduler
        if plan.footprint:
            s.hold_footprint(self, plan.footprint)
        outputs = []
        scratch: dict[int, Storage] = _NO_SCRATCH
        try:
            for state, geometry in zip(self.writes, bound.outputs):
                outputs.append(s.allocate_geometry(geometry, state))
            if bound.scratch:
                scratch = {}
                for value, l1, dram in bound.scratch:
                    try:
                        scratch[value] = s.allocate_geometry(l1, None)
                    except OutOfMemoryError:
                        scratch[value] = s.allocate_geometry(dram, None)
        except BaseException as exc:
            allocated = [*outputs, *scratch.values()]
            room.note_needed(s, exc, allocated)
            for storage in allocated:
                s.free(storage)
            if self.footprint:
                s.release_footprint(self)
            raise
        sources_, outputs_ = tuple(sources), tuple(outputs)
        if scratch:
            operands = (*sources_, *outputs_, *scratch.values())
            pagewise = pagewise_storages(plan, operands)
            kernel = page_kernel(plan, operands, s.num_banks(operands[0].layout.memory)) if pagewise else None
            compute = Compute(plan, sources_, outputs_, scratch, pagewise, kernel)
            return _new_tuple(Record, ((compute,), bound.nbytes, plan.macs, self._timed(), 0))
        if plan.pagewise and bound.kernel is not None:
            space, code, rows, depth = bound.kernel
            sources.extend(outputs)
            kernel = (space, code, tuple([storage.address for storage in sources]), rows, depth)
            compute = _new_tuple(Compute, (plan, sources_, outputs_, _NO_SCRATCH, True, kernel, None, None))
            return _new_tuple(Record, ((compute,), bound.nbytes, plan.macs, False, bound.nbytes))
        pagewise = pagewise_storages(plan, (*sources_, *outputs_))
        compute = _new_tuple(Compute, (plan, sources_, outputs_, _NO_SCRATCH, pagewise, None, None, None))
        return _new_tuple(Record, ((compute,), bound.nbytes, plan.macs, self._timed(), 0))

    def _decide(self) -> Record:
        """The general decision: conversions, scratch (L1, else DRAM), and outputs."""
        s = self.scheduler
        spill = self.spill
        if self.plan.footprint:
            s.hold_footprint(self, self.plan.footprint)
        self.converted = []
        program = self.program
        steps: list[Any] = []
        allocated: list[Storage] = []
        nbytes = 0
        made: dict[tuple[int, Layout], Storage] = {}  # one copy for an input given twice
        try:
            sources = []
            for state, spec in zip(self.reads, program.inputs):
                layout = spec.layout
                storage = state.find(layout) or made.get((id(state), layout))
                if storage is None and spill:  # a DRAM twin made or kept earlier will do
                    layout = spilled(layout, True)
                    storage = state.find(layout) or made.get((id(state), layout))
                if storage is None:
                    if not state.storages:
                        raise ProgramError("an input tensor has no device storage")
                    storage = s.allocate_spilling(spec.layout, state.shape, state, spill)
                    layout = storage.layout
                    allocated.append(storage)
                    steps.append(Copy(state.conversion_source(layout), storage, state.shape))
                    self.converted.append(state)
                    made[id(state), layout] = storage
                    nbytes += 2 * storage.nbytes
                sources.append(storage)
                nbytes += storage.nbytes
            outputs = []
            donated = self.plan.donated
            for k, (state, spec) in enumerate(zip(self.writes, program.output_specs)):
                if k in donated:  # the donated input's buffer, as its source found or made it
                    outputs.append(sources[donated[k]])
                    continue
                storage = s.allocate_spilling(spec.layout, spec.shape, state, spill)
                allocated.append(storage)
                outputs.append(storage)
                nbytes += storage.nbytes
            scratch = {}
            for value, shape, l1_layout, dram_layout in self.plan.scratch:
                try:
                    storage = s.allocate(l1_layout, shape, None)
                except OutOfMemoryError:
                    storage = s.allocate(dram_layout, shape, None)
                allocated.append(storage)
                scratch[value] = storage
                nbytes += 2 * storage.nbytes
        except BaseException as exc:
            room.note_needed(s, exc, allocated)
            for storage in allocated:
                s.free(storage)
            self.converted = _NO_DEPS
            if self.footprint:
                s.release_footprint(self)
            raise
        sources_, outputs_ = tuple(sources), tuple(outputs)
        hooks = s.hooks
        if hooks is not None:  # op by op, each step's values in reach of the hooks
            steps.append(Compute(self.plan, sources_, outputs_, scratch, False, None, self.peers,
                                 hooks.for_program(self.program)))
            return Record(tuple(steps), nbytes=nbytes, macs=self.plan.macs, timed=self._timed())
        operands = (*sources_, *outputs_, *scratch.values())
        pagewise = pagewise_storages(self.plan, operands)
        kernel = None
        if pagewise:
            kernel = page_kernel(self.plan, operands, s.num_banks(operands[0].layout.memory))
        steps.append(Compute(self.plan, sources_, outputs_, scratch, pagewise, kernel, self.peers))
        return Record(tuple(steps), nbytes=nbytes, macs=self.plan.macs, timed=self._timed())

    def commit(self, record: Record, result: Any) -> None:
        s = self.scheduler
        if self.footprint:
            s.release_footprint(self)
        if record.timed:
            self.host_spans, self.op_spans = result[-1][2], result[-1][3]
        steps = record.steps
        if len(steps) == 1 and not self.plan.donated:  # no conversion, no donation, no cache update
            compute = steps[0]
            assert type(compute) is Compute
            for storage in compute.scratch.values():
                s.free(storage)
            for state, storage in zip(self.writes, compute.outputs):
                s.add_storage(state, storage)
            s.count("programs_run", 1)
            return
        *copies, compute = steps
        assert isinstance(compute, Compute)
        self._commit(compute, copies)

    def _commit(self, compute: Compute, copies: Sequence[Any]) -> None:
        """The general commit: conversions kept, donated buffers handed over, caches counted."""
        s = self.scheduler
        for storage in compute.scratch.values():
            s.free(storage)
        donated = self.plan.donated
        taken = {id(compute.outputs[k]) for k in donated}  # buffers the outputs take over
        for state, copy in zip(self.converted, copies):
            assert isinstance(copy, Copy)
            if id(copy.dst) not in taken:
                s.add_storage(state, copy.dst)
            s.count_copy(copy.src, copy.dst)
        for k, i in donated.items():
            s.hand_over(compute.outputs[k], self.reads[i], self.writes[k])
        for k in self.plan.in_place.values():
            s.count("cache_update_bytes", row_bytes(compute.outputs[k]))
        for state, storage in zip(self.writes, compute.outputs):
            s.add_storage(state, storage)
        s.count("programs_run", 1)

    def rollback(self, record: Record) -> None:
        s = self.scheduler
        if self.footprint:
            s.release_footprint(self)
        donated = self.plan.donated
        for step in record.steps:
            if isinstance(step, Copy):
                s.free(step.dst)
            elif isinstance(step, Compute):
                for storage in step.scratch.values():
                    s.free(storage)
                for k, storage in enumerate(step.outputs):
                    if k not in donated:  # a donated buffer stays its input's (or its copy's)
                        s.free(storage)
        self.converted = _NO_DEPS

    def forget(self) -> None:
        self.converted = _NO_DEPS

    def complete(self, error: BaseException | None = None) -> None:
        # Straight to the one copy of the step (its `forget` is part of it): once per program.
        finish(self, error)

    def describe(self) -> dict[str, Any]:
        record = self.record
        seconds = record.seconds if record is not None else 0.0
        info = {"name": self.program.name, "bytes": record.nbytes if record is not None else 0,
                "macs": self.plan.macs, "estimated_us": round(seconds * 1e6, 1),
                "conversions": len(self.converted)}
        children: list[tuple[str, tuple[float, float], str, dict[str, Any]]] = []
        op_spans = getattr(self, "op_spans", ())
        if op_spans:  # each op a slice: its name, and its location (a compiled op's compute config)
            steps, locations = self.program.steps, dict(self.program.locations)
            for index, start, end in op_spans:
                step = steps[index]
                loc = locations.get(step.output)
                children.append((step.op, (start, end), "op", {"step": index, "loc": loc} if loc else {"step": index}))
        if self.plan.host_ops:  # steps run on the host (`ProgramBuilder.host_op`), by name
            info["host_ops"] = [label for _, label in self.plan.host_ops]
            children += [(label, (start, end), "host op", {})
                         for label, start, end in getattr(self, "host_spans", ())]
        if children:
            info["children"] = children
        return info


def _landing(writer: Command, state: TensorState, layout: Layout, queue: Any) -> Storage | None:
    """The storage in which `writer`, a program decided and in flight ahead of the asking
    command in `queue`, leaves `state`'s value, when it is in `layout`; else None. (Not a
    donated output: its commit hands a buffer over rather than adding one.)"""
    if type(writer) is not ProgramCommand or writer.queue is not queue or writer.plan.donated:
        return None
    record = writer.record
    if record is None:
        return None
    compute = record.steps[-1]
    if type(compute) is not Compute:
        return None
    for written, storage in zip(writer.writes, compute.outputs):
        if written is state:
            return storage if storage.layout is layout or storage.layout == layout else None
    return None


@final
class _Bound:
    """A plan's figures on one device: its outputs' geometry, the bytes a run moves (the run
    estimate), and for the C kernel (a pagewise plan whose operands all lie alike) what
    `Compute.kernel` holds besides the addresses: (space, code, bank rows, depth)."""

    __slots__ = ("outputs", "scratch", "nbytes", "kernel", "seconds")

    def __init__(self, outputs: tuple[Geometry, ...],
                 scratch: tuple[tuple[int, Geometry, Geometry], ...], nbytes: int,
                 kernel: tuple[MemorySpace, PageCode, int, int] | None, seconds: float) -> None:
        self.outputs = outputs
        self.scratch = scratch  # (value, L1 geometry, DRAM geometry if L1 has no room)
        self.nbytes = nbytes
        self.kernel = kernel
        self.seconds = seconds  # the run estimate of the fast path's record


