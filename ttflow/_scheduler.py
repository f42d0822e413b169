"""The scheduler: the one owner of scheduling state.

For every device tensor the scheduler keeps a `TensorState`: its storages (the home storage first,
then conversions kept for reuse), the last queued command that writes it and the last that reads
it, how many queued commands use it, its error, and whether its handle is gone. Nothing else
writes these fields: the user's `Tensor` is a handle that reads them, commands decide into records
through the scheduler's methods, and the queues only run records.

What the scheduler decides, when a command reaches the head of its queue:
- a program first moves to DRAM every L1 storage it does not read (an `EvictCommand`, its
  preamble; a storage whose value DRAM already holds in the same format is just freed);
- an input whose storages do not include the declared layout gets one, copied from the cheapest
  source; the copy is kept on the tensor for later programs (converted once). A copy that changes
  layout or dtype is a conversion; one that only changes memory space is residency;
- outputs and scratch are allocated; scratch is freed when the program ends.

Ordering: a command waits for the last writer of what it reads (read-after-write) and, when it
writes, for the last reader and writer (write-after-read, write-after-write). Commands on one queue
run in order, so only cross-queue dependencies are recorded.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, final

import numpy as np

from ._commands import (Compute, Copy, Load, PageCode, Plan, Record, Slide, Store, estimate, page_kernel,
                        pagewise_storages)
from ._core._dispatch import SchedulerCore, StateCore, submit_program
from ._errors import OutOfMemoryError, ProgramError, TraceError, detach_frames
from ._memory import BufferView, MemorySpaceState, MemoryView, Storage
from . import _room
from . import _storage_io as io
from ._storage_io import row_bytes
from . import _queue  # its INLINE_SECONDS, read at each use (ttflow.testing's machine lowers it)
from ._queue import NO_DEPS as _NO_DEPS, RETRY, Command, CommandQueue
from ._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout, storage_geometry

if TYPE_CHECKING:
    from ._program import Program

__all__ = ["Scheduler", "TensorState", "ReadCommand", "Capture", "EVICTION_POLICIES"]

EVICTION_POLICIES = ("lookahead", "eager")
"""`open_device(eviction=...)`: the first is the default (docs/performance.md, "Memory")."""



class FootprintClash(OutOfMemoryError):
    """A program's circular buffers (the bottom `requested` bytes of each core's L1) overlap
    live L1 buffers, which must move first; raised to the queue, which asks for room."""

    allowed: frozenset[int] = frozenset()  # addresses that may stay (see `hold_footprint`)



@final
class TensorState(StateCore):
    """What the scheduler knows of one tensor. Written only by this module.

    Its fields (shape, dtype, declared layout, storages, last writer and reader, pending count,
    error, deallocated, moving, donated_to) live in the C record `StateCore`."""

    __slots__ = ()

    @property
    def layout(self) -> Layout:
        return self.storages[0].layout if self.storages else self.declared

    def done(self) -> bool:
        writer = self.last_writer
        return writer is None or writer.done

    def find(self, layout: Layout) -> Storage | None:
        for storage in self.storages:
            if storage.layout == layout:
                return storage
        return None

    def conversion_source(self, layout: Layout) -> Storage:
        """The cheapest storage to make `layout` from: one that only needs its pages moved."""
        for storage in self.storages:
            if storage.layout.dtype is layout.dtype and storage.layout.tensor_layout is layout.tensor_layout:
                return storage
        return self.storages[0]

    def exact_source(self) -> Storage:
        """A storage holding the value exactly (its own dtype), row-major if there is one."""
        if not self.storages:
            raise ProgramError("the tensor has no device storage: its producer failed")
        exact = [s for s in self.storages if s.layout.dtype is self.dtype]
        for storage in exact:
            if storage.layout.tensor_layout is TensorLayout.ROW_MAJOR:
                return storage
        return exact[0]


class _Scheduled(Command):
    """A command of this scheduler: it reads and writes tensor states."""

    __slots__ = ()

    def __init__(self, scheduler: Scheduler, reads: tuple[TensorState, ...],
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
        `Scheduler.make_room`)."""
        return self.scheduler.make_room(self, error)

    def out_of_memory(self, error: OutOfMemoryError) -> OutOfMemoryError:
        return self.scheduler.out_of_memory(error)

    def complete(self, error: BaseException | None = None) -> None:
        self.reads = ()
        self.writes = ()
        super().complete(error)


class WriteCommand(_Scheduled):
    """A host array (or zeros) into a tensor's home storage; a new value drops old conversions."""

    name = "write"
    batchable = True
    __slots__ = ("array", "new_value", "staged", "tried_ahead")

    def __init__(self, scheduler: Scheduler, state: TensorState,
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
        if home.layout.tensor_layout is not TensorLayout.TILE or estimate(home.nbytes, 0, 0) <= _queue.INLINE_SECONDS:
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
            for stale in state.storages[1:]:
                self.scheduler.free(stale)
            del state.storages[1:]
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

    def __init__(self, scheduler: Scheduler, state: TensorState) -> None:
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

    def __init__(self, scheduler: Scheduler, source: TensorState, target: TensorState,
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
        self.writes[0].storages.append(copy.dst)
        self.scheduler.count_copy(copy.src, copy.dst)

    def rollback(self, record: Record) -> None:
        for step in record.steps:
            assert isinstance(step, Copy)
            self.scheduler.free(step.dst)


def _footprint_of(command: Command) -> int:
    """The circular-buffer bytes a command runs with (a program's, a trace replay's)."""
    if isinstance(command, ProgramCommand):
        return int(command.plan.footprint)
    if isinstance(command, ReplayCommand):
        return command.target.footprint
    return 0


def spilled(layout: Layout, spill: bool) -> Layout:
    """`layout`, or its DRAM twin when the command spills (L1 cannot hold its allocations)."""
    if spill and layout.memory is MemorySpace.L1:
        return Layout(MemorySpace.DRAM, layout.tensor_layout, layout.dtype)
    return layout


class AllocateCommand(_Scheduled):
    """A new tensor's home, when it did not fit at `to_device` / `empty` time although the
    space may make room (free but scattered, or L1 holding buffers that can be evicted): in
    CQ0's order, after what it must move, and before the tensor's write (which waits for it)."""

    name = "allocate"
    __slots__ = ("storage",)

    def __init__(self, scheduler: Scheduler, state: TensorState) -> None:
        super().__init__(scheduler, (), (state,))
        self.storage: Storage | None = None

    def decide(self) -> Record:
        state = self.writes[0]
        self.storage = self.scheduler.allocate_spilling(state.declared, state.shape, state, self.spill)
        return Record(())

    def commit(self, record: Record, result: Any) -> None:
        assert self.storage is not None
        self.writes[0].storages.append(self.storage)
        self.storage = None

    def rollback(self, record: Record) -> None:
        if self.storage is not None:
            self.scheduler.free(self.storage)
            self.storage = None


def _running_writer(states: Iterable[TensorState | None]) -> Command | None:
    """A write running into one of these tensors (a queued write decides its target after
    the move: it waits on `state.moving`)."""
    for state in states:
        writer = state.last_writer if state is not None else None
        if writer is not None and not writer.done and writer.record is not None:
            return writer
    return None


class EvictCommand(Command):
    """Moves live storages out of the way.

    An eviction moves an L1 storage to DRAM (a storage whose value DRAM already holds is just
    freed). A relocation (`relocate`: storage -> the space it goes to) moves a storage to a new
    address, in its own space to make a free block, or to DRAM for a buffer a trace replays into:
    in place, i.e. the `Storage` keeps its identity and takes the new address (and space), so
    that what refers to it (its tensor, a trace's recorded steps) follows it. A relocated storage
    may have no tensor (`state` None): a buffer a trace replays into after its tensor let go.
    While the targets are allocated, the free parts of the block being made (`guards`) are
    held, so that no target lands in it."""

    name = "evict"
    __slots__ = ("victims", "moves", "guards", "relocated")

    def __init__(self, scheduler: Scheduler, victims: Sequence[tuple[TensorState | None, Storage]],
                 relocate: dict[Storage, MemorySpace] | None = None,
                 guards: tuple[MemorySpace, list[tuple[int, int]]] | None = None) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.victims = list(victims)
        self.relocated = relocate if relocate is not None else {}
        self.guards = guards
        self.moves: list[tuple[TensorState | None, Storage, Storage | None]] = []

    def blocker(self) -> Command | None:
        """A write that is running into a victim (a queued write decides its target later)."""
        return _running_writer(state for state, _ in self.victims)

    def decide(self) -> Record:
        s = self.scheduler
        steps = []
        nbytes = 0
        self.moves = []
        guards = self.guards
        held: list[int] = []
        if guards is not None:
            allocator = s._spaces[guards[0]].allocator
            for start, depth in guards[1]:
                if allocator.claim(start, depth):
                    held.append(start)
        try:
            for state, storage in self.victims:
                if state is None:
                    if storage not in s._orphans:
                        continue  # released since it was chosen
                elif storage not in state.storages or state.moving not in (None, self):
                    continue  # freed or moved since it was chosen
                target = None
                where = self.relocated.get(storage)
                if where is not None:
                    target = s.allocate_geometry(s.geometry_of(storage, where), None)
                    steps.append(Copy(storage, target, storage.dims3))
                    nbytes += storage.nbytes + target.nbytes
                    s.in_motion.add(storage)
                else:
                    assert state is not None
                    layout = Layout(MemorySpace.DRAM, storage.layout.tensor_layout, storage.layout.dtype)
                    if state.find(layout) is None:
                        target = s.allocate(layout, state.shape, state)
                        steps.append(Copy(storage, target, state.shape))
                        nbytes += storage.nbytes + target.nbytes
                self.moves.append((state, storage, target))
                if state is not None:
                    state.moving = self
                    state.pending += 1  # deallocating it now must wait for the move
        except BaseException:
            self._undo()
            raise
        finally:
            for start in held:
                allocator.free(start)
        return Record(tuple(steps), nbytes=nbytes)

    def commit(self, record: Record, result: Any) -> None:
        s = self.scheduler
        copied = relocated = moved = 0
        for state, storage, target in self.moves:
            if storage in self.relocated:
                assert target is not None
                within = target.layout.memory is storage.layout.memory
                s.move_in_place(storage, target)
                if within:
                    relocated += target.nbytes
                    moved += 1
                else:  # evicted in place (a buffer a trace replays into)
                    copied += target.nbytes
                s.end_move(state, storage)
                continue
            assert state is not None
            storages = state.storages
            index = storages.index(storage)
            if target is not None:
                storages[index] = target
                copied += target.nbytes
            else:
                del storages[index]
                if index == 0:
                    # The home moved for free: the DRAM copy of the same format is the new home
                    # (it holds the value exactly; a converted storage may not).
                    layout = Layout(MemorySpace.DRAM, storage.layout.tensor_layout, storage.layout.dtype)
                    copy = state.find(layout)
                    assert copy is not None
                    storages.remove(copy)
                    storages.insert(0, copy)
            s.free(storage)
            s.end_move(state, storage)
        s.count("evictions", len(self.moves) - moved)
        s.count("eviction_bytes", copied)
        if moved:
            s.count("relocations", moved)
            s.count("relocation_bytes", relocated)

    def rollback(self, record: Record) -> None:
        self._undo()

    def _undo(self) -> None:
        s = self.scheduler
        for state, storage, target in self.moves:
            if target is not None:
                s.free(target)
            s.end_move(state, storage)
        self.moves = []

    def forget(self) -> None:
        self.victims = []
        self.moves = []
        self.relocated = {}

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["tensors"] = len(self.victims)
        return info


class RelocateCommand(EvictCommand):
    """An `EvictCommand` that relocates (some of) its victims: named apart on the timeline."""

    name = "relocate"
    __slots__ = ()


class SlideCommand(Command):
    """Compaction: slides buffers of one space along the address line, each to the address
    `_room.compaction` chose, so that the holes between them merge into one free block.

    The moves run in order in one record (`Slide` steps: a target may overlap its own old place,
    or a place another buffer left earlier in the record). Each buffer keeps its `Storage`,
    which takes its new address at commit, so its tensor and any trace that replays into it
    follow. While the record runs, the holes of the span it works in are held, so that no
    allocation lands where a buffer is sliding to; a write running into a buffer is waited for
    (`blocker`), a queued one waits for the slide (`state.moving`). A plan that no longer matches
    the allocator when it decides (something was allocated or freed meanwhile) moves nothing:
    room is then planned again."""

    name = "relocate"
    __slots__ = ("space", "plan", "moves", "held")

    def __init__(self, scheduler: Scheduler, space: MemorySpace,
                 plan: Sequence[tuple[TensorState | None, Storage, int]]) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.space = space
        self.plan = list(plan)
        self.moves: list[tuple[TensorState | None, Storage, int, int, int]] = []  # + target, old, depth
        self.held: list[int] = []

    def blocker(self) -> Command | None:
        """A write that is running into a buffer to slide."""
        return _running_writer(state for state, _, _ in self.plan)

    def decide(self) -> Record:
        s = self.scheduler
        allocator = s._spaces[self.space].allocator
        sizes = allocator.allocations()
        moves = []
        for state, storage, target in self.plan:
            still = (storage in s._owned and storage.layout.memory is self.space
                     and storage.address in sizes)
            if state is None:
                still = still and storage in s._orphans
            else:
                still = still and storage in state.storages and state.moving is None
            if not still:
                return Record(())  # planned again once the command fails to decide again
            moves.append((state, storage, target, storage.address, sizes[storage.address]))
        sources = {old for *_, old, _ in moves}
        targets = [(target, target + depth) for _, _, target, _, depth in moves]
        for address, depth in sizes.items():
            if address not in sources and any(address < hi and address + depth > lo for lo, hi in targets):
                return Record(())  # allocated where a buffer was to slide since the plan
        lo = min(min(old, target) for _, _, target, old, _ in moves)
        hi = max(max(old, target) + depth for _, _, target, old, depth in moves)
        held = []
        for start, depth in _room.gaps(allocator, lo, hi - lo):
            if allocator.claim(start, depth):
                held.append(start)
        self.held = held
        self.moves = moves
        steps = []
        nbytes = 0
        for state, storage, target, old, depth in moves:
            steps.append(Slide(self.space, old, target, depth))
            nbytes += 2 * storage.nbytes
            s.in_motion.add(storage)
            if state is not None:
                state.moving = self
                state.pending += 1  # deallocating it now must wait for the slide
        return Record(tuple(steps), nbytes=nbytes)

    def commit(self, record: Record, result: Any) -> None:
        s = self.scheduler
        allocator = s._spaces[self.space].allocator
        for start in self.held:
            allocator.free(start)
        for _, _, _, old, _ in self.moves:
            allocator.free(old)
        moved = 0
        pinned = False
        for state, storage, target, _, depth in self.moves:
            claimed = allocator.claim(target, depth)
            assert claimed, "a slide's target was taken while it was held"
            s.rebase(storage, target)
            moved += storage.nbytes
            pinned = pinned or storage in s._pins
            s.end_move(state, storage)
        if pinned:
            for capture in s._captures:
                capture.rebind()
        s.count("relocations", len(self.moves))
        s.count("relocation_bytes", moved)
        self._release()

    def rollback(self, record: Record) -> None:
        s = self.scheduler
        allocator = s._spaces[self.space].allocator
        for start in self.held:
            allocator.free(start)
        for state, storage, *_ in self.moves:
            s.end_move(state, storage)
        self._release()

    def _release(self) -> None:
        self.moves = []
        self.held = []

    def forget(self) -> None:
        self.plan = []
        self._release()

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["tensors"] = len(self.plan)
        return info


_new_tuple = tuple.__new__  # a NamedTuple made without its Python-level __new__
_NO_SCRATCH: dict[int, Storage] = {}  # shared by every record without scratch: never written


class ProgramCommand(_Scheduled):
    """One program run: evict, convert inputs, allocate, compute the steps, free scratch."""

    name = "program"
    __slots__ = ()

    # Made only by `_core._dispatch.submit_program`, which sets its fields (scheduler, reads,
    # writes, program, plan; `converted`, the inputs each conversion step is kept on, is the
    # shared empty list until `_decide` converts).

    def preamble(self) -> Command | None:
        s = self.scheduler
        if not s._l1 or not s.evict_eagerly:
            return None
        return s.eviction_for(self)

    def decidable_ahead(self) -> bool:
        """(Asked once its cross-queue dependencies are done.) A program whose inputs are committed and already in the layouts it reads (no
        conversion), with no eviction due, no donation, no capture or timeline: then its
        decision is fresh allocations (outputs, scratch), which the running command's commit
        cannot change; it only frees. The two records' scratch is then held at once."""
        plan = self.plan
        s = self.scheduler
        if plan.donated or (s._l1 and s.evict_eagerly) or s.listeners or self.capture is not None:
            return False
        bound = plan.bound
        if bound is not None and bound.seconds <= _queue.INLINE_SECONDS:
            return False
        for state, spec in zip(self.reads, self.program.inputs):
            writer = state.last_writer
            if state.error is not None or (writer is not None and not writer.done):
                return False
            if state.find(spec.layout) is None:
                return False
        return True

    def decide(self) -> Record:
        # The fast path: every input already has a storage in its declared layout and the
        # program needs no scratch, so the decision is the output allocations (their geometry
        # is precomputed per plan and device) and one Compute step.
        plan = self.plan
        bound = plan.bound
        if bound is None or self.spill:
            return self._decide()
        sources = []
        for state, layout in zip(self.reads, plan.input_layouts):
            for storage in state.storages:
                if storage.layout is layout or storage.layout == layout:
                    sources.append(storage)
                    break
            else:
                return self._decide()
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
            s.note_needed(exc, allocated)
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
            return _new_tuple(Record, ((compute,), bound.nbytes, plan.macs, False, 0))
        if plan.pagewise and bound.kernel is not None:
            space, code, rows, depth = bound.kernel
            sources.extend(outputs)
            kernel = (space, code, tuple([storage.address for storage in sources]), rows, depth)
            compute = _new_tuple(Compute, (plan, sources_, outputs_, _NO_SCRATCH, True, kernel))
            return _new_tuple(Record, ((compute,), bound.nbytes, plan.macs, False, bound.nbytes))
        pagewise = pagewise_storages(plan, (*sources_, *outputs_))
        compute = _new_tuple(Compute, (plan, sources_, outputs_, _NO_SCRATCH, pagewise, None))
        return _new_tuple(Record, ((compute,), bound.nbytes, plan.macs, False, 0))

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
            s.note_needed(exc, allocated)
            for storage in allocated:
                s.free(storage)
            self.converted = _NO_DEPS
            if self.footprint:
                s.release_footprint(self)
            raise
        sources_, outputs_ = tuple(sources), tuple(outputs)
        operands = (*sources_, *outputs_, *scratch.values())
        pagewise = pagewise_storages(self.plan, operands)
        kernel = None
        if pagewise:
            kernel = page_kernel(self.plan, operands, s.num_banks(operands[0].layout.memory))
        steps.append(Compute(self.plan, sources_, outputs_, scratch, pagewise, kernel))
        return Record(tuple(steps), nbytes=nbytes, macs=self.plan.macs)

    def commit(self, record: Record, result: Any) -> None:
        s = self.scheduler
        if self.footprint:
            s.release_footprint(self)
        steps = record.steps
        if len(steps) == 1 and not self.plan.donated:  # no conversion, no donation, no cache update
            compute = steps[0]
            assert type(compute) is Compute
            for storage in compute.scratch.values():
                s.free(storage)
            for state, storage in zip(self.writes, compute.outputs):
                state.storages.append(storage)
            s.counters["programs_run"] += 1
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
                state.storages.append(copy.dst)
            s.count_copy(copy.src, copy.dst)
        for k, i in donated.items():
            s.hand_over(compute.outputs[k], self.reads[i], self.writes[k])
        for k in self.plan.in_place.values():
            s.count("cache_update_bytes", row_bytes(compute.outputs[k]))
        for state, storage in zip(self.writes, compute.outputs):
            state.storages.append(storage)
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
        # `Command.complete` and its overrides, flattened: this runs once per program.
        self.reads = ()
        self.writes = ()
        self.error = error
        self.done = True
        self.deps = _NO_DEPS
        self.record = None
        self.capture = None
        if self.converted:
            self.converted = _NO_DEPS
        if self._event is not None:
            self._event.set()

    def describe(self) -> dict[str, Any]:
        record = self.record
        seconds = record.seconds if record is not None else 0.0
        return {"name": self.program.name, "bytes": record.nbytes if record is not None else 0,
                "macs": self.plan.macs, "estimated_us": round(seconds * 1e6, 1),
                "conversions": len(self.converted)}


_Geometry = tuple[Layout, MemorySpaceState, int, int, int, int, tuple[int, int, int]]
"""(layout, space, page_size, aligned_page_size, num_pages, depth, dims3) of a storage to be."""


@final
class _Bound:
    """A plan's figures on one device: its outputs' geometry, the bytes a run moves (the run
    estimate), and for the C kernel (a pagewise plan whose operands all lie alike) what
    `Compute.kernel` holds besides the addresses: (space, code, bank rows, depth)."""

    __slots__ = ("outputs", "scratch", "nbytes", "kernel", "seconds")

    def __init__(self, outputs: tuple[_Geometry, ...],
                 scratch: tuple[tuple[int, _Geometry, _Geometry], ...], nbytes: int,
                 kernel: tuple[MemorySpace, PageCode, int, int] | None, seconds: float) -> None:
        self.outputs = outputs
        self.scratch = scratch  # (value, L1 geometry, DRAM geometry if L1 has no room)
        self.nbytes = nbytes
        self.kernel = kernel
        self.seconds = seconds  # the run estimate of the fast path's record


@final
class Scheduler(SchedulerCore):
    """Owns the scheduling state of one device: tensor states, residency, liveness, counters.

    Its tables are fields of the C record `SchedulerCore`, which also does the bookkeeping every
    command needs (allocate_geometry, free, release, collect_garbage, settle_all)."""

    def __init__(self, spaces: dict[MemorySpace, MemorySpaceState], cq0: CommandQueue,
                 cq1: CommandQueue, spec: DeviceSpec | None = None, eviction: str = "lookahead") -> None:
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        self._spaces = spaces
        self._spec = spec if spec is not None else DeviceSpec()
        self.cq0 = cq0
        self.cq1 = cq1
        self.eviction = eviction
        self.evict_eagerly = eviction == "eager"
        self.l1_allocator = spaces[MemorySpace.L1].allocator
        # The circular-buffer region at the bottom of L1 (see `hold_footprint`): its depth, the
        # allocator blocks that make it, and how many commands run in it now (the running
        # program, and one decided ahead of it that fits in the same region).
        self.cb_depth = 0
        self._cb_blocks: list[int] = []
        self._cb_holders = 0
        self.counters: dict[str, int] = collections.defaultdict(int)
        self._owned: dict[Storage, TensorState | None] = {}  # each buffer, with its tensor if any
        self._l1: dict[Storage, TensorState] = {}
        # Storages a trace replays into stay allocated while it lives, even when their tensor
        # lets go of them (an orphan): replay allocates nothing.
        self._pins: dict[Storage, int] = {}
        self._orphans: dict[Storage, None] = {}
        # Buffers a relocation or slide is moving, and those of them whose trace let go of them
        # meanwhile (orphans): freed when the move ends (`end_move`), not under it.
        self.in_motion: set[Storage] = set()
        self.free_after_move: set[Storage] = set()
        self.capturing: Capture | None = None
        self._captures: weakref.WeakSet[Capture] = weakref.WeakSet()  # to rebind after a relocation
        # States whose handle was garbage-collected, appended from any thread, freed on the loop.
        self._dropped: collections.deque[TensorState] = collections.deque()
        # Per-program plans die with their program: a front-end that builds programs on the fly
        # (one per shape, say) must not find every one it ever built kept alive here.
        self._plans: weakref.WeakKeyDictionary[Program, Plan] = weakref.WeakKeyDictionary()
        self.listeners: list[Callable[[Command, BaseException | None], None]] = []
        # The last plan looked up: a chain submits one program again and again.
        self._last_plan: tuple[weakref.ref[Program], Plan] | None = None
        self._layouts: dict[Layout, Layout] = {}

    # -- bookkeeping used by the commands ---------------------------------------------------

    @contextlib.contextmanager
    def listening(self, listener: Callable[[Command, BaseException | None], None]) -> Iterator[None]:
        """Calls `listener` with every command completed inside the block (a recorder's hook)."""
        self.listeners.append(listener)
        try:
            yield
        finally:
            self.listeners.remove(listener)

    def count(self, name: str, amount: int) -> None:
        self.counters[name] += amount

    def count_copy(self, src: Storage, dst: Storage) -> None:
        """Counts a copy made for a layout: a conversion if it changes the format, else residency."""
        if src.same_format(dst):
            self.counters["residency_copies"] += 1
            self.counters["residency_copy_bytes"] += dst.nbytes
        else:
            self.counters["layout_conversions"] += 1

    def geometry(self, layout: Layout, shape: tuple[int, ...]) -> _Geometry:
        """Where a value of `shape` in `layout` goes: its pages and their depth in each bank."""
        assert layout.dtype is not None
        page_size, num_pages = storage_geometry(shape, layout.dtype, layout.tensor_layout)
        space = self._spaces[layout.memory]
        aligned = space.aligned(page_size)
        depth = -(-num_pages // space.num_banks) * aligned
        if len(shape) == 1:
            dims3 = (1, 1, shape[0])
        else:
            dims3 = (math.prod(shape[:-2]), shape[-2], shape[-1])
        return layout, space, page_size, aligned, num_pages, depth, dims3

    def geometry_of(self, storage: Storage, where: MemorySpace | None = None) -> _Geometry:
        """The geometry of a twin of an existing storage, in its own space or in `where`."""
        layout = storage.layout
        if where is not None and where is not layout.memory:
            layout = self._layouts.setdefault(
                Layout(where, layout.tensor_layout, layout.dtype),
                Layout(where, layout.tensor_layout, layout.dtype))
        space = self._spaces[layout.memory]
        aligned = space.aligned(storage.page_size)
        depth = -(-storage.num_pages // space.num_banks) * aligned
        return (layout, space, storage.page_size, aligned, storage.num_pages, depth, storage.dims3)

    def move_in_place(self, storage: Storage, target: Storage) -> None:
        """`storage` takes `target`'s address (its bytes were copied there); its old block is
        freed and `target`, a placeholder, disappears. Records that captured a trace are bound
        to addresses again."""
        space = self._spaces[storage.layout.memory]
        space.allocator.free(storage.address)
        if target.layout.memory is not storage.layout.memory:  # a pinned buffer evicted in place
            owner = self._l1.pop(storage, None)
            if owner is not None and target.layout.memory is MemorySpace.L1:
                self._l1[storage] = owner
            storage.layout = target.layout
            storage.aligned_page_size = target.aligned_page_size
        self.rebase(storage, target.address)
        del self._owned[target]
        self._l1.pop(target, None)
        if storage in self._pins:
            for capture in self._captures:
                capture.rebind()

    def rebase(self, storage: Storage, address: int) -> None:
        """`storage` now lies at `address` (its bytes were moved there): what was derived from
        the old address (its `BufferInfo`, its cached page view) goes."""
        storage.address = address
        storage._buffer = None
        storage.pages = None

    def end_move(self, state: TensorState | None, storage: Storage) -> None:
        """A move of `storage` is over (made or undone): it is freed now if its trace let go of it
        meanwhile, and its tensor may be moved, written or freed again."""
        self.in_motion.discard(storage)
        if storage in self.free_after_move:
            self.free_after_move.discard(storage)
            self.free(storage)
        if state is not None:
            state.moving = None
            self.settle(state)

    def allocate(self, layout: Layout, shape: tuple[int, ...], owner: TensorState | None) -> Storage:
        return self.allocate_geometry(self.geometry(layout, shape), owner)

    def allocate_spilling(self, layout: Layout, shape: tuple[int, ...], owner: TensorState | None,
                          spill: bool) -> Storage:
        """`allocate`; for a command that spills, an L1 allocation that does not fit goes to
        DRAM (only that one: the others stay in L1, and DRAM keeps its room)."""
        if spill and layout.memory is MemorySpace.L1:
            try:
                return self.allocate(layout, shape, owner)
            except OutOfMemoryError:
                layout = spilled(layout, True)
        return self.allocate(layout, shape, owner)

    def num_banks(self, space: MemorySpace) -> int:
        return self._spaces[space].num_banks

    def pin(self, storage: Storage) -> None:
        self._pins[storage] = self._pins.get(storage, 0) + 1

    def unpin(self, storage: Storage) -> None:
        count = self._pins.pop(storage) - 1
        if count:
            self._pins[storage] = count
        elif self._orphans.pop(storage, 0) is None:
            if storage in self.in_motion:
                self.free_after_move.add(storage)
            else:
                self.free(storage)

    def adopt(self, state: TensorState, storage: Storage) -> None:
        """A pinned storage becomes one of the state's storages again (a replay refilled it)."""
        self._orphans.pop(storage, None)
        if storage in self._owned:
            self._owned[storage] = state
        if storage.layout.memory is MemorySpace.L1:
            self._l1[storage] = state

    def hand_over(self, storage: Storage, donor: TensorState, receiver: TensorState) -> None:
        """A donated buffer changes owner: the consumed input no longer frees it."""
        if storage in donor.storages:
            donor.storages.remove(storage)
        if storage in self._owned:
            self._owned[storage] = receiver
        if storage.layout.memory is MemorySpace.L1:
            self._l1[storage] = receiver
        self.count("donations", 1)
        self.count("donated_bytes", storage.nbytes)

    def settle(self, state: TensorState) -> None:
        """One queued command that used the state is done; a deallocated one may now be freed."""
        state.pending -= 1
        if state.deallocated:
            self.release(state)

    def eviction_for(self, program: ProgramCommand) -> EvictCommand | None:
        """The eviction a starting program needs: ready L1 storages of tensors it does not read."""
        keep = program.reads
        if not self._l1:
            return None
        self.collect_garbage()
        victims = [
            (state, storage)
            for storage, state in self._l1.items()
            if state.last_writer is None and state not in keep
        ]
        if not victims:
            return None
        command = EvictCommand(self, victims)
        command.capture = program.capture  # a captured program's evictions are part of its trace
        return command

    # -- room: circular buffers, evictions on demand, relocation ---------------------------

    def hold_footprint(self, command: Command, depth: int, allowed: frozenset[int] = frozenset()) -> None:
        """Runs `command` with its circular buffers at the bottom of L1, as tt-metal places a
        program's; FootprintClash when live L1 buffers are in the way.

        The region stays allocated between programs, as deep as the largest program run so far
        (its high-water mark), so that L1 buffers, allocated top-down, keep out of it while L1
        has room; an L1 allocation that finds no room gives it back first (`make_room`), and
        the next program takes it again, moving what is in the way.

        `allowed`: addresses of buffers that may stay in the region (a trace replay's own pinned
        buffers: each of its programs ran around them at capture). Then only the free parts of
        the region are held."""
        if depth <= self.cb_depth:
            self._cb_holders += 1
            command.footprint = depth
            return
        if self._cb_holders:  # a program decided ahead, larger than the running one's region
            raise FootprintClash(MemorySpace.L1, depth, self.cb_depth,
                                 reason="the running program's circular buffers are smaller")
        allocator = self.l1_allocator
        start = self.cb_depth
        if allocator.claim(start, depth - start):
            self._cb_blocks.append(start)
        else:
            inside = [a for a, size in allocator.allocations().items()
                      if start <= a < depth and a not in self._cb_blocks]
            if not allowed or any(a not in allowed for a in inside):
                clash = FootprintClash(
                    MemorySpace.L1, depth, allocator.bottom_free,
                    reason=f"the program's circular buffers need the bottom {depth} bytes of "
                    "each core's L1, where L1 buffers are",
                )
                clash.allowed = allowed
                raise clash
            for gap_start, gap in _room.gaps(allocator, start, depth - start):
                if allocator.claim(gap_start, gap):
                    self._cb_blocks.append(gap_start)
        self.cb_depth = depth
        self._cb_holders += 1
        command.footprint = depth

    def release_footprint(self, command: Command) -> None:
        command.footprint = 0
        self._cb_holders -= 1

    def _give_back_footprint(self) -> bool:
        """Frees the idle circular-buffer region for L1 buffers; False if there is none, or a
        command runs in it."""
        if self._cb_holders or not self._cb_blocks:
            return False
        for start in self._cb_blocks:
            self.l1_allocator.free(start)
        self._cb_blocks = []
        self.cb_depth = 0
        return True

    def idle_footprint_bytes(self) -> int:
        """L1 bytes (all banks) of the circular-buffer region while no command runs in it:
        room kept, not memory in use (`memory_used` leaves it out)."""
        if self._cb_holders or not self._cb_blocks:
            return 0
        sizes = self.l1_allocator.allocations()
        return sum(sizes[start] for start in self._cb_blocks) * self._spaces[MemorySpace.L1].num_banks

    def _movable(self, state: TensorState | None, storage: Storage, wait: bool = False) -> bool:
        """Whether a tensor's storage may be moved now, in CQ0's order: not being moved, not a
        committed command's output yet, and not being written (a write still queued decides
        its target when it runs, after the move). With `wait`, a write running into it is no
        obstacle: the move waits for it (`EvictCommand.blocker`)."""
        if state is None or state.moving is not None:
            return False
        if storage not in state.storages:
            return False  # the output or move target of a command not yet committed
        writer = state.last_writer
        return wait or writer is None or writer.done or writer.record is None

    def _relocatable(self, owner: TensorState | None,
                     storage: Storage) -> tuple[TensorState | None, Storage] | None:
        """The victim entry that relocates `storage`, or None when it may not move: a running
        program's scratch or output. A buffer kept for a trace whose tensor let go of it
        (an orphan) moves without a tensor."""
        if storage in self._orphans:
            return (None, storage)
        if self._movable(owner, storage, wait=True):
            return (owner, storage)
        return None

    def make_room(self, command: Command, error: OutOfMemoryError) -> Command | object | None:
        """What makes `command`'s failed allocation fit, to run before it decides again:

        0. L1, for a command that runs no circular buffers: take back the idle region;
        1. L1: evict the fewest L1 buffers, farthest next use first (`_room.choose_victims`),
           among those `command` does not read (under "eager", the preamble evicted the rest
           already);
        2. any space: relocate live buffers to make a free block when the space's free bytes
           would hold it, cheapest block first; in L1 a buffer that does not fit elsewhere in L1
           moves to DRAM; for a clash with circular buffers, the block is the bottom of L1;
        3. L1: spill, i.e. the command's L1 allocations go to DRAM (`RETRY`).

        None when nothing helps; the error then carries the space's memory view."""
        self.collect_garbage()
        space = error.space
        if not isinstance(space, MemorySpace):
            return None
        state_space = self._spaces[space]
        allocator = state_space.allocator
        depth = error.requested
        clash = isinstance(error, FootprintClash)
        if clash and self._cb_holders:
            return None  # only a program decided ahead meets this; it is decided again in turn
        depth = -(-depth // allocator.alignment) * allocator.alignment
        # What the whole decision needs there (it gave back what it had allocated as it failed).
        needed = max(depth, getattr(error, "needed", depth))
        if depth > allocator.size:
            return None  # larger than the whole space: no room can ever be made (nor spilled)
        if space is MemorySpace.L1 and not clash and _footprint_of(command) == 0 \
                and self._give_back_footprint():
            return RETRY
        keep = set(command.reads or ())
        if space is MemorySpace.L1 and not clash:
            uses = _room.next_uses(self.cq0._pending)
            candidates = []
            sizes = allocator.allocations()
            dram_twins: dict[Layout, Layout] = {}
            for storage, state in self._l1.items():
                if state in keep or storage in self._pins or not self._movable(state, storage):
                    continue
                layout = storage.layout
                dram = dram_twins.get(layout)
                if dram is None:
                    dram = dram_twins[layout] = Layout(MemorySpace.DRAM, layout.tensor_layout, layout.dtype)
                free = state.find(dram) is not None
                candidates.append(((state, storage), storage.address, sizes[storage.address],
                                   uses.get(state, _room.NEVER), free))
            victims = (_room.choose_victims(candidates, allocator.free_blocks(), depth, needed)
                       if candidates else None)
            if victims:
                return EvictCommand(self, victims)
        movable: dict[int, tuple[TensorState | None, Storage]] = {}
        for storage, owner in self._owned.items():
            if storage.layout.memory is space:
                entry = self._relocatable(owner, storage)
                if entry is not None:
                    movable[storage.address] = entry
        if clash:  # the block is the bottom of L1, except buffers allowed to stay there
            assert isinstance(error, FootprintClash)
            allocations = allocator.allocations()
            inside = [a for a in allocations
                      if a < depth and a not in error.allowed and a not in self._cb_blocks]
            if not inside or any(a not in movable for a in inside):
                return None
            return self._clear_block(space, 0, depth, inside, movable, frozenset())
        free_bytes = allocator.size - allocator.used_bytes
        if free_bytes >= needed or space is MemorySpace.L1:
            for start, inside in _room.windows(allocator.allocations(), set(movable), allocator.size,
                                               allocator.alignment, needed, allocator.top_down):
                room = self._clear_block(space, start, needed, inside, movable, keep) if inside else None
                if room is not None:
                    return room
        if free_bytes >= needed:  # every hole too small for what is in the way: compact
            moves = _room.compaction(allocator.allocations(), set(movable), allocator.size, needed)
            if moves:
                return SlideCommand(self, space, [(*movable[old], new) for old, new in moves])
        if space is MemorySpace.L1 and not command.spill and command.name != "evict":
            command.spill = True
            return RETRY
        return None

    def note_needed(self, error: BaseException, allocated: list[Storage]) -> None:
        """Notes on an out-of-memory error of a decision how much of the space the decision
        needs in all (`needed`, bytes per bank): what it had allocated there before the failing
        allocation (it gives that back as it fails) plus the failing request."""
        if isinstance(error, OutOfMemoryError) and not isinstance(error, FootprintClash) \
                and isinstance(error.space, MemorySpace):
            sizes = self._spaces[error.space].allocator.allocations()
            held = sum(sizes.get(storage.address, 0) for storage in allocated
                       if storage.layout.memory is error.space)
            error.needed = error.requested + held  # type: ignore[attr-defined]

    def _clear_block(self, space: MemorySpace, start: int, depth: int, inside: list[int],
                     movable: dict[int, tuple[TensorState | None, Storage]],
                     keep: set[TensorState] | frozenset[TensorState]) -> EvictCommand | None:
        """The moves that empty [start, start + depth): each buffer in it relocates where the
        allocator would place it outside; one that does not fit is evicted to DRAM (in place
        when a trace replays into it) unless the command that needs the room reads it; then,
        or in DRAM, the block cannot be made (None)."""
        allocator = self._spaces[space].allocator
        sizes = allocator.allocations()
        places = _room.placement(allocator, (start, depth), inside)
        for address, place in places.items():
            state, storage = movable[address]
            if place is None and (space is not MemorySpace.L1 or state in keep):
                return None
        victims = [movable[a] for a in sorted(inside, key=lambda a: -sizes[a])]
        relocate: dict[Storage, MemorySpace] = {}
        for address, place in places.items():
            state, storage = movable[address]
            if place is not None:
                relocate[storage] = space
            elif state is None or storage in self._pins:
                relocate[storage] = MemorySpace.DRAM  # evicted in place: a trace replays into it
        kind = RelocateCommand if space in relocate.values() else EvictCommand
        return kind(self, victims, relocate, (space, _room.gaps(allocator, start, depth)))

    def out_of_memory(self, error: OutOfMemoryError) -> OutOfMemoryError:
        """`error` as the runtime gives up: with the space's memory view in its message."""
        if error.view is not None or not isinstance(error.space, MemorySpace):
            return error
        return OutOfMemoryError(error.space, error.requested, error.largest_free,
                                self.memory_view(error.space), error.reason)

    def memory_view(self, space: MemorySpace) -> MemoryView:
        """Every live allocation of `space`, with what it is (see `MemoryView`)."""
        self.collect_garbage()
        state_space = self._spaces[space]
        allocator = state_space.allocator
        banks = state_space.num_banks
        sizes = allocator.allocations()
        buffers = []
        seen = set()
        for storage, owner in self._owned.items():
            if storage.layout.memory is not space:
                continue
            depth = sizes.get(storage.address, 0)
            seen.add(storage.address)
            if storage in self._orphans:
                kind = "trace"
            elif owner is None:
                kind = "scratch"
            elif owner.storages and owner.storages[0] is storage:
                kind = "home"
            elif storage in owner.storages:
                kind = "conversion"
            else:
                kind = "pending"
            shape = owner.shape if owner is not None else None
            buffers.append(BufferView(storage.address, depth, depth * banks, kind, shape,
                                      storage.layout.dtype, storage.layout))
        for address, depth in sizes.items():
            if address not in seen:  # the circular buffers of the running program
                buffers.append(BufferView(address, depth, depth * banks, "circular_buffers"))
        buffers.sort(key=lambda b: b.address)
        return MemoryView(space, banks, allocator.size * banks, allocator.used_bytes * banks,
                          (allocator.size - allocator.used_bytes) * banks,
                          allocator.largest_free * banks, tuple(buffers),
                          tuple(allocator.free_blocks()))

    def plan(self, program: Program) -> Plan:
        last = self._last_plan
        if last is not None and last[0]() is program:
            return last[1]
        plan = self._plans.get(program)
        if plan is None:
            plan = self._plans[program] = Plan(program)
            plan.footprint = program.l1_footprint(self._spec)
            plan.bound = self._bind(plan)
        self._last_plan = (weakref.ref(program), plan)
        return plan

    def _bind(self, plan: Plan) -> _Bound | None:
        """What a plan's fast decision needs on this device (see `ProgramCommand.decide`)."""
        # Equal layouts as one object, so that the fast decision finds a storage by identity.
        intern = self._layouts.setdefault
        plan.input_layouts = tuple([intern(layout, layout) for layout in plan.input_layouts])
        plan.output_layouts = tuple([intern(layout, layout) for layout in plan.output_layouts])
        plan.output_states = tuple([(shape, dtype, layout) for (shape, dtype, _), layout
                                    in zip(plan.output_states, plan.output_layouts)])
        if plan.donated:
            return None
        inputs = [self.geometry(layout, spec.shape)
                  for layout, spec in zip(plan.input_layouts, plan.inputs)]
        outputs = tuple(self.geometry(layout, shape)
                        for layout, shape in zip(plan.output_layouts, plan.output_shapes))
        scratch = tuple((value, self.geometry(intern(l1, l1), shape), self.geometry(intern(dram, dram), shape))
                        for value, shape, l1, dram in plan.scratch)
        operands = (*inputs, *outputs)
        spaces = {g[0].memory for g in operands}
        pagewise = len(spaces) == 1 and all(g[2] == g[3] for g in operands)
        nbytes = sum(g[2] * g[4] for g in operands)
        kernel = None
        if pagewise and plan.page_code is not None and not scratch:
            # A pagewise plan's values share one shape and dtype: one geometry for all.
            layout, space, _, _, num_pages, depth, _ = operands[0]
            kernel = (layout.memory, plan.page_code, min(num_pages, space.num_banks), depth)
        nbytes += sum(2 * g[2] * g[4] for _, g, _ in scratch)  # each written, then read
        seconds = estimate(nbytes, nbytes if kernel is not None else 0, plan.macs)
        return _Bound(outputs, scratch, nbytes, kernel, seconds)

    # -- liveness ---------------------------------------------------------------------------

    def drop(self, state: TensorState) -> None:
        """A handle was garbage-collected (any thread): free its state on the loop thread."""
        self._dropped.append(state)

    def deallocate(self, state: TensorState) -> None:
        if not state.deallocated:
            state.deallocated = True
            self.release(state)

    # -- queueing ---------------------------------------------------------------------------

    def push(self, array: np.ndarray[Any, Any] | None, layout: Layout, shape: tuple[int, ...]) -> TensorState:
        """A new tensor in `layout`, filled from `array` (zeros when None) by a CQ1 write."""
        assert layout.dtype is not None
        if self.capturing is not None:
            self.capturing.admit_transfer()
        state = TensorState(shape, layout.dtype, layout)
        try:
            state.storages.append(self.allocate(layout, shape, state))
        except OutOfMemoryError as error:
            self._allocate_in_order(state, error)
        self.enqueue(WriteCommand(self, state, array, new_value=False), self.cq1)
        return state

    def _allocate_in_order(self, state: TensorState, error: OutOfMemoryError) -> None:
        """A new tensor that does not fit now: allocated on CQ0 once room is made (its write
        waits for that), when room can be made; otherwise the error, with the memory view."""
        space = self._spaces[state.declared.memory]
        allocator = space.allocator
        depth = -(-error.requested // space.alignment) * space.alignment
        if depth > allocator.size or (space.space is MemorySpace.DRAM
                                      and allocator.size - allocator.used_bytes < depth):
            raise self.out_of_memory(error) from None  # larger than the space, or than DRAM's free bytes
        self.enqueue(AllocateCommand(self, state), self.cq0)

    def write(self, state: TensorState, array: np.ndarray[Any, Any]) -> None:
        self.enqueue(WriteCommand(self, state, array, new_value=True), self.cq1)

    def read(self, state: TensorState) -> ReadCommand:
        command = ReadCommand(self, state)
        self.enqueue(command, self.cq0)
        return command

    def to_layout(self, state: TensorState, layout: Layout) -> TensorState:
        assert layout.dtype is not None
        target = TensorState(state.shape, layout.dtype, layout)
        self.enqueue(ConvertCommand(self, state, target, layout), self.cq0)
        return target

    def submit(self, program: Program, inputs: tuple[TensorState, ...],
               plan: Plan | None = None) -> tuple[TensorState, ...]:
        """Queues a run of `program` on CQ0; its output states (see `_core._dispatch`)."""
        if plan is None:
            plan = self.plan(program)
        return submit_program(self, self.cq0, program, plan, inputs)

    def _consume(self, command: ProgramCommand, queue: CommandQueue, deps: list[Command] | None,
                 program: str) -> list[Command] | None:
        """Donated inputs are consumed now (their handles refuse new work); their buffers are
        overwritten, so the program also waits for their readers on another queue."""
        if self.capturing is not None:
            raise TraceError(
                f"program {program!r} donates an input; a donating submit cannot be captured "
                "(a replay would write into a buffer its input no longer owns)"
            )
        for i in command.plan.donated.values():
            state = command.reads[i]
            reader = state.last_reader
            if reader is not None and not reader.done and reader.queue is not queue:
                deps = command.deps = [*(deps or ()), reader]
            state.deallocated = True
            state.donated_to = program
        return deps

    def enqueue(self, command: _Scheduled, queue: CommandQueue) -> None:
        """Orders `command` after the writes it reads and the reads it overwrites, then queues it."""
        deps = None
        for state in command.reads:
            writer = state.last_writer
            if writer is not None and not writer.done and writer.queue is not queue:
                deps = deps or [*command.deps]
                deps.append(writer)
        for state in command.writes:
            writer = state.last_writer
            if writer is not None and not writer.done and writer.queue is not queue:
                deps = deps or [*command.deps]
                deps.append(writer)
            reader = state.last_reader
            if reader is not None and not reader.done and reader.queue is not queue:
                deps = deps or [*command.deps]
                deps.append(reader)
        if deps is not None:
            command.deps = deps
        capture = self.capturing
        if capture is not None and command.capture is None:
            capture.admit(command, queue)
        queue.push(command)
        for state in command.reads:
            state.last_reader = command
            state.pending += 1
        for state in command.writes:
            state.last_writer = command
            state.pending += 1

    def complete(self, command: Command, error: BaseException | None) -> None:
        """A queue finished `command` (or failed it): settle what it used, then let it go."""
        counters = self.counters
        counters["commands_run"] += 1
        if error is not None:
            counters["commands_failed"] += 1
            queue = command.queue.name if command.queue is not None else "CQ0"
            detach_frames(error, f"{command.describe()['name']} on {queue}")
            if command.capture is not None:
                command.capture.failed(error)
        for listener in self.listeners:
            listener(command, error)
        if isinstance(command, _Scheduled):
            self.settle_all(command, error)
        command.complete(error)

    def shutdown(self, abort: BaseException) -> None:
        """Fails whatever never ran and frees every buffer (the device is closing)."""
        for queue in (self.cq0, self.cq1):
            queue.close(abort)
            for command in queue.pop_all():
                self.complete(command, abort)
        self.collect_garbage()
        for storage in list(self._owned):
            self.free(storage)

    # -- trace capture and replay -----------------------------------------------------------

    def begin_capture(self) -> Capture:
        if self.capturing is not None:
            raise TraceError("a trace is already being captured on this device; captures do not nest")
        capture = self.capturing = Capture(self)
        self._captures.add(capture)
        return capture

    def end_capture(self, capture: Capture, error: BaseException | None) -> None:
        """Ends the capture; a seal on CQ0 snapshots it once every captured command is done."""
        self.capturing = None
        if error is not None and capture.error is None:
            capture.error = TraceError(f"the capture block raised {type(error).__name__}: {error}")
        self.cq0.push(SealCommand(capture))

    def replay(self, capture: Capture) -> None:
        """Queues one replay of a captured trace on CQ0."""
        if capture.released:
            raise TraceError("the trace was released; capture a new one")
        if self.capturing is not None:
            raise TraceError("a trace cannot be executed while a capture is open on its device")
        if capture.error is not None:
            raise TraceError(f"the capture failed: {capture.error}") from capture.error
        for state in capture.inputs:
            if state.deallocated:
                raise TraceError(
                    f"an input {state.shape} {state.dtype.name} of the trace was deallocated since "
                    "capture; keep traced inputs alive until the trace is released"
                )
        outputs = tuple(state for state in capture.outputs if not state.deallocated)
        capture.replays_pending += 1
        self.enqueue(ReplayCommand(self, capture, tuple(capture.inputs), outputs), self.cq0)

    def release_capture(self, capture: Capture) -> None:
        if not capture.released:
            capture.released = True
            capture.unpin_if_idle()


@final
class Capture:
    """What a trace capture recorded, built as its commands complete (in queue order).

    Frozen at capture: every step (conversions, evictions, programs) of the tensors produced inside
    the trace, and the storages they read. Those storages are pinned, so replay allocates nothing.
    Inputs from outside the trace (weights, a written slot) are read where the trace read them;
    when such a storage is no longer one of its tensor's (a write dropped the conversion, an
    eviction moved the home), replay first refills it from the tensor's current value.
    """

    __slots__ = ("scheduler", "outputs", "inputs", "steps", "external", "pinned", "snapshot",
                 "programs", "nbytes", "kernel_bytes", "macs", "error", "released",
                 "replays_pending", "footprint", "__weakref__")

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.outputs: dict[TensorState, None] = {}  # written by a captured command
        self.inputs: dict[TensorState, None] = {}  # read by one, written by none
        self.steps: list[Any] = []
        self.external: dict[tuple[TensorState, Storage], None] = {}
        self.pinned: dict[Storage, None] = {}
        self.snapshot: list[tuple[TensorState, tuple[Storage, ...]]] = []
        self.programs: list[str] = []
        self.nbytes = 0
        self.kernel_bytes = 0
        self.macs = 0
        self.error: BaseException | None = None
        self.released = False
        self.replays_pending = 0
        self.footprint = 0  # the largest circular-buffer region of its programs

    @staticmethod
    def admit_transfer() -> None:
        raise TraceError(
            "host transfers cannot be captured: push inputs before the capture, write them "
            "between replays (tt.write), and read outputs after tt.execute_trace"
        )

    def admit(self, command: Command, queue: CommandQueue) -> None:
        """A command queued while capturing: it becomes part of the trace."""
        if queue is not self.scheduler.cq0 or isinstance(command, ReadCommand):
            self.admit_transfer()
        assert isinstance(command, _Scheduled)
        command.capture = self
        for state in command.reads:
            if state not in self.outputs:
                self.inputs[state] = None
        for state in command.writes:
            self.outputs[state] = None

    def _pin(self, storage: Storage) -> None:
        if storage not in self.pinned:
            self.pinned[storage] = None
            self.scheduler.pin(storage)

    def _read(self, state: TensorState, storage: Storage) -> None:
        self._pin(storage)
        if state not in self.outputs:
            self.external[state, storage] = None

    def failed(self, error: BaseException) -> None:
        """A captured command failed: the trace cannot be replayed."""
        if self.error is None:
            self.error = error

    def decided(self, command: Command, record: Record) -> None:
        """A captured command was decided: keep what replay must run again, and pin its storages
        before its commit frees any (scratch) for others to take."""
        if isinstance(command, ProgramCommand):
            *copies, compute = record.steps
            assert isinstance(compute, Compute)
            for state, copy in zip(command.converted, copies):
                assert isinstance(copy, Copy)
                if state in self.outputs:
                    self.steps.append(copy)
                    self._pin(copy.src)
                    self._pin(copy.dst)
                # a conversion of an outside input is refilled only when it goes stale
            for state, source in zip(command.reads, compute.sources):
                self._read(state, source)
            for storage in (*compute.outputs, *compute.scratch.values()):
                self._pin(storage)
            self.steps.append(compute)
            self.programs.append(command.program.name)
            self.footprint = max(self.footprint, command.plan.footprint)
            self.macs += record.macs
        elif isinstance(command, ConvertCommand):
            (copy,) = record.steps
            assert isinstance(copy, Copy)
            self._read(command.reads[0], copy.src)
            self._pin(copy.dst)
            self.steps.append(copy)
        elif isinstance(command, EvictCommand):
            moved = iter(record.steps)
            for state, storage, target in command.moves:
                if target is None:
                    continue
                copy = next(moved)
                if state in self.outputs:  # refilled by each replay, so moved again
                    self._pin(storage)
                    self._pin(target)
                    self.steps.append(copy)
        self.nbytes += record.nbytes
        self.kernel_bytes += record.kernel_bytes

    def seal(self) -> None:
        """Every captured command is done: what each produced tensor holds after a replay."""
        self.snapshot = [
            (state, tuple(state.storages)) for state in self.outputs if not state.deallocated
        ]

    def rebind(self) -> None:
        """Recomputes how its recorded programs run on their storages (pagewise or not, the C
        kernel's operand addresses): a pinned storage was moved in place."""
        s = self.scheduler
        for index, step in enumerate(self.steps):
            if type(step) is Compute and step.plan.pagewise:
                # a buffer moved to DRAM may leave the operands in two spaces: then numpy runs it
                operands = (*step.sources, *step.outputs, *step.scratch.values())
                pagewise = pagewise_storages(step.plan, operands)
                kernel = (page_kernel(step.plan, operands, s.num_banks(operands[0].layout.memory))
                          if pagewise else None)
                self.steps[index] = step._replace(pagewise=pagewise, kernel=kernel)

    def unpin_if_idle(self) -> None:
        if self.released and self.replays_pending == 0 and self.pinned:
            for storage in self.pinned:
                self.scheduler.unpin(storage)
            self.pinned.clear()


class SealCommand(Command):
    """Queued on CQ0 after a capture's commands: snapshots the capture once they are done."""

    name = "trace_capture"
    __slots__ = ("target",)

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self.target = capture

    def decide(self) -> Record:
        self.target.seal()
        return Record(())

    def forget(self) -> None:
        pass  # the capture outlives its seal


class ReplayCommand(_Scheduled):
    """One replay of a trace: its frozen steps back to back, as a single queued command."""

    name = "trace_replay"
    __slots__ = ("target", "refilled", "spans")

    def __init__(self, scheduler: Scheduler, capture: Capture, inputs: tuple[TensorState, ...],
                 outputs: tuple[TensorState, ...]) -> None:
        super().__init__(scheduler, inputs, outputs)
        self.target = capture
        self.refilled: list[tuple[TensorState, Storage]] = []
        self.spans: list[tuple[float, float]] = []  # each program's run, for the timeline

    def decide(self) -> Record:
        capture = self.target
        if capture.error is not None:
            raise TraceError(f"the capture failed: {capture.error}") from capture.error
        steps: list[Any] = []
        nbytes = capture.nbytes
        self.refilled = []  # (decided again after room was made)
        for state, storage in capture.external:
            if storage in state.storages:
                continue
            if state.deallocated or not state.storages:
                raise TraceError(
                    f"an input {state.shape} {state.dtype.name} of the trace has no value on the "
                    "device (deallocated, or its producer failed)"
                )
            source = state.conversion_source(storage.layout)
            steps.append(Copy(source, storage, state.shape))
            nbytes += source.nbytes + storage.nbytes
            self.refilled.append((state, storage))
        steps.extend(capture.steps)
        if capture.footprint:  # its programs' circular buffers, for the whole replay
            s = self.scheduler
            try:
                s.hold_footprint(self, capture.footprint)
            except FootprintClash:  # its own pinned buffers may stay (each program ran around them)
                pinned = frozenset(storage.address for storage in capture.pinned
                                   if storage.layout.memory is MemorySpace.L1)
                s.hold_footprint(self, capture.footprint, pinned)
        # Each program's span is for the timeline: timed only while a recorder listens.
        timed = bool(self.scheduler.listeners)
        return Record(tuple(steps), nbytes=nbytes, macs=capture.macs, timed=timed,
                      kernel_bytes=capture.kernel_bytes)

    def rollback(self, record: Record) -> None:
        if self.footprint:
            self.scheduler.release_footprint(self)

    def commit(self, record: Record, result: Any) -> None:
        s = self.scheduler
        if self.footprint:
            s.release_footprint(self)
        self.spans = result if record.timed else []
        for state, storage in self.refilled:
            if state.find(storage.layout) is None:
                state.storages.append(storage)
                s.adopt(state, storage)
        for state, storages in self.target.snapshot:
            if state.deallocated:
                continue
            for storage in state.storages:
                if storage not in storages:
                    s.free(storage)  # a conversion of the old value, or an evicted home
            state.storages[:] = storages
            for storage in storages:
                s.adopt(state, storage)
        s.count("programs_run", len(self.target.programs))
        s.count("trace_replays", 1)

    def complete(self, error: BaseException | None = None) -> None:
        capture = self.target
        capture.replays_pending -= 1
        capture.unpin_if_idle()
        super().complete(error)

    def forget(self) -> None:
        self.refilled = []

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["programs"] = list(self.target.programs)
        info["children"] = list(zip(self.target.programs, self.spans))
        return info
