"""The scheduler: queueing commands in dependency order, program plans, and listeners.

`Scheduler` is the face the device and the runtime talk to (`push`, `write`, `read`,
`to_layout`, `submit`, `deallocate`, trace capture, `complete`, `shutdown`). What it queues it
orders here (`enqueue`: after the writes it reads and the reads it overwrites); everything it
knows it keeps in `SchedulerState`, its base class, and changes only through that class's
methods. Each program gets a `Plan` once per device (`plan`), bound to the device's layouts and
geometry so that the fast decision (`ProgramCommand.decide`) and `_core._dispatch`'s C path
allocate without recomputing anything.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, final

import numpy as np

from .._commands import Plan, estimate
from .._core._dispatch import renew_plan_token, submit_program
from .._errors import OutOfMemoryError, TraceError, detach_frames
from .._memory.banks import MemorySpaceState
from .._queue import Command, CommandQueue
from .._types import DeviceSpec, Layout, MemorySpace
from . import capture as _capture
from . import room
from .capture import Capture
from .commands import (AllocateCommand, ConvertCommand, ProgramCommand, ReadCommand, WriteCommand,
                       _Bound, _Scheduled)
from .state import SchedulerState, TensorState

if TYPE_CHECKING:
    from .._ir.program import Program

__all__ = ["Scheduler", "EVICTION_POLICIES"]

EVICTION_POLICIES = ("lookahead", "eager")
"""`open_device(eviction=...)`: the first is the default (docs/performance.md, "Memory")."""


@final
class Scheduler(SchedulerState):
    """Owns the scheduling state of one device: tensor states, residency, liveness, counters.

    Its tables are `SchedulerState`'s (fields of the C record `SchedulerCore`, which also does
    the bookkeeping every command needs: allocate_geometry, free, add_storage, release,
    collect_garbage, settle_all); this class queues commands and keeps the plans."""

    def __init__(self, spaces: dict[MemorySpace, MemorySpaceState], cq0: CommandQueue,
                 cq1: CommandQueue, spec: DeviceSpec | None = None, eviction: str = "lookahead") -> None:
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        super().__init__(spaces, cq0, cq1, eviction)
        self._spec = spec if spec is not None else DeviceSpec()
        # Per-program plans die with their program: a front-end that builds programs on the fly
        # (one per shape, say) must not find every one it ever built kept alive here.
        self._plans: weakref.WeakKeyDictionary[Program, Plan] = weakref.WeakKeyDictionary()
        self.listeners: list[Callable[[Command, BaseException | None], None]] = []
        # How many listeners want the runs timed (a timeline: spans of programs, ops, host ops);
        # a record is timed only then, so a memory log or hooks cost a run no clock reads.
        self.timing = 0
        # The const-eval cache (`_runtime.const_eval.ConstEvalCache`), attached by the first
        # submit of a program with constant inputs (`attach_const_cache`, its only writer); told
        # of every queued write (`enqueue`).
        self.const_cache: Any = None
        # The last plan looked up: a chain submits one program again and again.
        self._last_plan: tuple[weakref.ref[Program], Plan] | None = None

    @contextlib.contextmanager
    def listening(self, listener: Callable[[Command, BaseException | None], None],
                  timed: bool = False) -> Iterator[None]:
        """Calls `listener` with every command completed inside the block (a recorder's hook);
        `timed`: it wants the spans of each run's parts (`Record.timed`)."""
        self.listeners.append(listener)
        self.timing += timed
        try:
            yield
        finally:
            self.timing -= timed
            self.listeners.remove(listener)

    # -- plans ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def starting_programs(self, listener: Callable[[Command], None]) -> Iterator[None]:
        """Calls `listener` with every program as it starts inside the block (before its
        preamble); with a completion listener beside it, every program takes the general path."""
        self.starting.append(listener)
        try:
            yield
        finally:
            self.starting.remove(listener)

    def plan(self, program: Program) -> Plan:
        """The program's plan on this device: kept (a hit) or made now (a miss; kept unless the
        cache is off). `_core._dispatch.submit` tests `_last_plan` itself, and counts its hits."""
        last = self._last_plan
        if last is not None and last[0]() is program:
            self.plan_hits += 1
            return last[1]
        plan = self._plans.get(program)
        if plan is None:
            self.plan_misses += 1
            plan = self._bind(Plan(program), program.l1_footprint(self._spec))
            if self.plans_uncached:
                return plan
            self._plans[program] = plan
        else:
            self.plan_hits += 1
        self._last_plan = (weakref.ref(program), plan)
        return plan

    def attach_const_cache(self, make: Callable[[Scheduler], Any]) -> Any:
        """The device's const-eval cache, made by `make(self)` on first use. The runtime layer
        above defines the cache; the scheduler holds it, because every queued write must reach
        it (`enqueue`), and this is the one place it is set."""
        if self.const_cache is None:
            self.const_cache = make(self)
        return self.const_cache

    def keep_plans(self, keep: bool) -> None:
        """`Device.program_cache_enabled`: with False, every submit plans again and no plan is
        kept (those kept until now are dropped)."""
        self.plans_uncached = not keep
        if not keep:
            self.clear_plans()

    def clear_plans(self) -> None:
        """`tt.clear_program_cache`: drops every kept plan (commands queued keep their own)."""
        self._plans.clear()
        self._last_plan = None
        renew_plan_token()  # a mesh's decided record holds these plans too

    def _bind(self, plan: Plan, footprint: int) -> Plan:
        """`plan` as this device runs it: its layouts interned (equal layouts as one object, so
        that the fast decision finds a storage by identity), its circular-buffer bytes, and what
        its fast decision needs here (`_Bound`, see `ProgramCommand.decide`; None when it
        donates)."""
        intern = self.intern
        input_layouts = tuple([intern(layout) for layout in plan.input_layouts])
        output_layouts = tuple([intern(layout) for layout in plan.output_layouts])
        if plan.donated or plan.collectives:  # decided by the general path (`_decide`)
            return plan.bound_to(footprint, input_layouts, output_layouts, None)
        inputs = [self.geometry(layout, spec.shape)
                  for layout, spec in zip(input_layouts, plan.inputs)]
        outputs = tuple(self.geometry(layout, shape)
                        for layout, shape in zip(output_layouts, plan.output_shapes))
        scratch = tuple((value, self.geometry(intern(l1), shape), self.geometry(intern(dram), shape))
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
        bound = _Bound(outputs, scratch, nbytes, kernel, seconds)
        return plan.bound_to(footprint, input_layouts, output_layouts, bound)

    # -- queueing ---------------------------------------------------------------------------

    def push(self, array: np.ndarray[Any, Any] | None, layout: Layout, shape: tuple[int, ...]) -> TensorState:
        """A new tensor in `layout`, filled from `array` (zeros when None) by a write on the
        write queue (CQ1, or CQ0 with one hardware queue)."""
        assert layout.dtype is not None
        if self.capturing is not None:
            self.capturing.admit_transfer()
        layout = self.intern(layout)
        state = TensorState(shape, layout.dtype, layout)
        try:
            self.add_storage(state, self.allocate(layout, shape, state))
        except OutOfMemoryError as error:
            self._allocate_in_order(state, error)
        self.enqueue(WriteCommand(self, state, array, new_value=False), self.write_queue)
        return state

    def _allocate_in_order(self, state: TensorState, error: OutOfMemoryError) -> None:
        """A new tensor that does not fit now: allocated on CQ0 once room is made (its write
        waits for that), when room can be made; otherwise the error, with the memory view."""
        space = state.declared.memory
        allocator = self.allocator(space)
        depth = -(-error.requested // allocator.alignment) * allocator.alignment
        if depth > allocator.size or (space is MemorySpace.DRAM
                                      and allocator.size - allocator.used_bytes < depth):
            raise self.out_of_memory(error) from None  # larger than the space, or than DRAM's free bytes
        self.enqueue(AllocateCommand(self, state), self.cq0)

    def write(self, state: TensorState, array: np.ndarray[Any, Any]) -> None:
        self.enqueue(WriteCommand(self, state, array, new_value=True), self.write_queue)

    def read(self, state: TensorState) -> ReadCommand:
        command = ReadCommand(self, state)
        self.enqueue(command, self.cq0)
        return command

    def to_layout(self, state: TensorState, layout: Layout) -> TensorState:
        assert layout.dtype is not None
        layout = self.intern(layout)
        target = TensorState(state.shape, layout.dtype, layout)
        self.enqueue(ConvertCommand(self, state, target, layout), self.cq0)
        return target

    def submit(self, program: Program, inputs: tuple[TensorState, ...],
               plan: Plan | None = None, peers: Any = None) -> tuple[TensorState, ...]:
        """Queues a run of `program` on CQ0; its output states (see `_core._dispatch`).
        `peers`: the chip's place in its SPMD submit's rendezvous, for a program with
        collectives (`_mesh.collectives.submit_collective`)."""
        if plan is None:
            plan = self.plan(program)
        return submit_program(self, self.cq0, program, plan, inputs, peers)

    def set_retain(self, state: TensorState, retain: bool) -> None:
        """`Tensor.retain`: with False, a submit deallocates the tensor once it is queued to
        read it (`release_unretained`)."""
        state.unretained = not retain

    def release_unretained(self, states: list[TensorState]) -> None:
        """Inputs whose retain is False, read by a program just queued: deallocated now (their
        handles refuse new work), freed when the last queued command that uses them completes.
        A donated input was consumed already; an input passed twice is deallocated once."""
        for state in states:
            self.deallocate(state)

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
            if self.traced_writer(command.reads[i]) is not None:
                # Every later replay would write into the buffer the donation hands over.
                raise TraceError(
                    f"program {program!r} donates a tensor that a trace writes on every replay; "
                    "release the trace first (tt.release_trace), or donate a copy (tt.to_layout)"
                )
        for i in command.plan.donated.values():
            state = command.reads[i]
            reader = state.last_reader
            if reader is not None and not reader.done and reader.queue is not queue:
                deps = command.deps = [*(deps or ()), reader]
            self.consume(state, program)
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
        self.mark_queued(command)
        if self.const_cache is not None and command.writes:  # a constant's cached results go
            self.const_cache.written(command.writes)

    def complete(self, command: Command, error: BaseException | None) -> None:
        """A queue finished `command` (or failed it): settle what it used, then let it go."""
        self.count("commands_run", 1)
        if error is not None:
            self.count("commands_failed", 1)
            queue = command.queue.name if command.queue is not None else "CQ0"
            detach_frames(error, f"{command.describe()['name']} on {queue}")
            if command.capture is not None:
                command.capture.failed(error)
        for listener in self.listeners:
            listener(command, error)
        if isinstance(command, _Scheduled):
            self.settle_all(command, error)
        peers = command.peers
        if peers is not None:  # a chip's program of an SPMD submit with collectives
            if error is not None:
                peers.abort(error)  # its peers' collectives fail typed instead of waiting for it
            command.peers = None
        command.complete(error)

    def shutdown(self, abort: BaseException) -> None:
        """Fails whatever never ran and frees every buffer (the device is closing)."""
        for queue in (self.cq0, self.cq1):
            queue.close(abort)
            for command in queue.pop_all():
                self.complete(command, abort)
        self.free_all()

    # -- trace capture and replay (the rules are `capture`'s) --------------------------------

    def begin_capture(self) -> Capture:
        return _capture.begin(self)

    def end_capture(self, capture: Capture, error: BaseException | None) -> TraceError | None:
        """Ends the capture; a seal on CQ0 snapshots it once every captured command is done.
        The error to raise when its trace buffer does not fit the trace region."""
        return _capture.end(self, capture, error)

    def replay(self, capture: Capture) -> None:
        """Queues one replay of a captured trace on CQ0."""
        self.enqueue(_capture.replay(self, capture), self.cq0)

    def release_capture(self, capture: Capture) -> None:
        _capture.release(capture)
