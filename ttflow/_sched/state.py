"""Scheduling state, and the named methods that are the only way to change it.

`TensorState` is what the scheduler knows of one tensor; `SchedulerState` holds the device's
tables. Both keep their fields in C records (`_core._dispatch`'s `StateCore` and
`SchedulerCore`), so that the fast path reads and writes them at C speed. Everything else in
`ttflow._sched` (commands, moves, room, capture, queueing) changes them only by calling a method
here, and the fast path only through `SchedulerCore`'s C methods (which this class inherits and
the Python side calls too: `allocate_geometry`, `free`, `add_storage`, `release`,
`collect_garbage`, `settle_all`). So the answer to "who writes X" is this file (or its C twin):

- a tensor's storages: `add_storage` (C), `replace_storage`, `drop_storage`, `drop_conversions`,
  `drop_duplicates`, `adopt`, `set_storages`, `hand_over`, `release` (C);
- its last writer and reader, and pending count: `mark_queued`, `begin_move`, `settle`,
  `settle_all` (C); its error: `settle_all` (C); `deallocated` and `donated_to`: `deallocate`,
  `consume`, `collect_garbage` (C); `moving`: `begin_move`, `end_move`;
- the buffer tables (`_owned`, `_l1`): `allocate_geometry` and `free` (C), `move_in_place`,
  `adopt`, `set_storages`, `hand_over`; pins and orphans: `pin`, `unpin`, `free` (C), `adopt`;
  buffers in motion (`in_motion`, `free_after_move`): `begin_move`, `end_move`, `unpin`;
- the circular-buffer region (`cb_depth`, `_cb_blocks`, `_cb_holders`, and a command's
  `footprint`): `hold_footprint`, `release_footprint`, `give_back_footprint`;
- counters: `count`, `count_copy`; the layout intern table: `intern`; the open capture and the
  captures to rebind: `open_capture`, `close_capture`; handles (tensors, traces) dropped on any
  thread: `drop`, `drop_trace`; the records in flight on a storage (`flights`) and the frees
  deferred to their landing (`_free_on_landing`): `flight`, `free` (C).

The reads that other modules need (which buffers live in L1, whether one is pinned...) are
methods too, so that no module outside this one names a table.
"""

from __future__ import annotations

import collections
import math
import weakref
from collections.abc import Callable, ItemsView, Sequence
from typing import TYPE_CHECKING, Any, Protocol, final

from .._commands import Compute, Copy, Load, Record, Store
from .._core._dispatch import SchedulerCore, StateCore
from .._errors import OutOfMemoryError, ProgramError
from .._memory.banks import BufferView, MemorySpaceState, MemoryView, Storage, TraceRegion
from .._types import Layout, MemorySpace, TensorLayout, storage_geometry
from . import planning

if TYPE_CHECKING:
    from .._core._allocator import Allocator
    from .._queue import Command, CommandQueue

__all__ = ["TensorState", "SchedulerState", "FootprintClash", "Geometry", "spilled"]


class FootprintClash(OutOfMemoryError):
    """A program's circular buffers (the bottom `requested` bytes of each core's L1) overlap
    live L1 buffers, which must move first; raised to the queue, which asks for room."""

    allowed: frozenset[int] = frozenset()  # addresses that may stay (see `hold_footprint`)


@final
class TensorState(StateCore):
    """What the scheduler knows of one tensor. Written only through `SchedulerState`.

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


def spilled(layout: Layout, spill: bool) -> Layout:
    """`layout`, or its DRAM twin when the command spills (L1 cannot hold its allocations)."""
    if spill and layout.memory is MemorySpace.L1:
        return Layout(MemorySpace.DRAM, layout.tensor_layout, layout.dtype)
    return layout


Geometry = tuple[Layout, MemorySpaceState, int, int, int, int, tuple[int, int, int]]
"""(layout, space, page_size, aligned_page_size, num_pages, depth, dims3) of a storage to be."""


def _named(step: Any) -> tuple[Storage, ...]:
    """The storages a record's step reads or writes (a slide names addresses: its own blocks)."""
    kind = type(step)
    if kind is Store:
        return (step.dst,)
    if kind is Load:
        return (step.src,)
    if kind is Copy:
        return (step.src, step.dst)
    if kind is Compute:
        return (*step.sources, *step.outputs, *step.scratch.values())
    return ()


class _Rebindable(Protocol):
    """A trace capture, as the state sees it: what to tell when a buffer it pins moves, and
    whether a live one writes a tensor (which may then not be donated)."""

    def rebind(self) -> None: ...

    def writes(self, state: TensorState) -> bool: ...


class SchedulerState(SchedulerCore):
    """The scheduling state of one device: its tables, and the methods that change them.

    The tables are fields of the C record `SchedulerCore` (those the fast path reads) and of
    this object: each buffer with its tensor, the L1 ones, pins, orphans, buffers in motion,
    the circular-buffer region, counters and the layout intern table."""

    def __init__(self, spaces: dict[MemorySpace, MemorySpaceState], cq0: CommandQueue,
                 cq1: CommandQueue, eviction: str) -> None:
        self._spaces = spaces
        self.cq0 = cq0
        self.cq1 = cq1
        # Where host-to-device writes go: CQ1, or CQ0 on a device opened with num_hw_cqs=1 (as
        # tt-metal's single command queue carries everything in order).
        self.write_queue = cq1
        # The DRAM region trace buffers live in (`open_device(trace_region_size=...)`), or None:
        # a device opened without one keeps no trace buffers (ttflow's default, see open_device).
        self.trace_region: TraceRegion | None = None
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
        # Storages freed while a record in flight names them: freed when it lands (`flight`).
        self._free_on_landing = set()
        self._captures: weakref.WeakSet[_Rebindable] = weakref.WeakSet()  # to rebind after a move
        # States whose handle was garbage-collected, appended from any thread, freed on the loop.
        # (A dropped trace's capture is queued here too: `collect_garbage` releases it.)
        self._dropped: collections.deque[Any] = collections.deque()
        self._layouts: dict[Layout, Layout] = {}
        # Told as each program starts on the general path (`ProgramCommand.preamble`): the
        # memory log (`Scheduler.starting_programs`, which the scheduler alone changes).
        self.starting: list[Callable[[Command], None]] = []
        # `tt.debug_hooks` (`_debug.DebugHooks`) while its block is open: programs decided
        # meanwhile run op by op, their values in reach of the hooks (never on a fast path).
        self.hooks: Any = None

    # -- reading the tables -----------------------------------------------------------------

    def allocator(self, space: MemorySpace) -> Allocator:
        return self._spaces[space].allocator

    def num_banks(self, space: MemorySpace) -> int:
        return self._spaces[space].num_banks

    def buffers(self) -> ItemsView[Storage, TensorState | None]:
        """Every live buffer, with its tensor (None for scratch, or a trace's orphan)."""
        return self._owned.items()

    def l1_buffers(self) -> ItemsView[Storage, TensorState]:
        """The live L1 buffers of tensors, with their tensor."""
        return self._l1.items()

    def holds_l1(self) -> bool:
        """Whether any tensor has a buffer in L1."""
        return bool(self._l1)

    def owns(self, storage: Storage) -> bool:
        return storage in self._owned

    def is_pinned(self, storage: Storage) -> bool:
        """Whether a trace replays into `storage` (it stays allocated while the trace lives)."""
        return storage in self._pins

    def is_orphan(self, storage: Storage) -> bool:
        """Whether `storage` is kept only for a trace, its tensor having let go of it."""
        return storage in self._orphans

    def footprint_busy(self) -> bool:
        """Whether a command runs in the circular-buffer region now."""
        return self._cb_holders > 0

    def is_footprint_block(self, address: int) -> bool:
        """Whether the L1 allocation at `address` is a block of the circular-buffer region."""
        return address in self._cb_blocks

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
            name = owner.name if owner is not None else None
            buffers.append(BufferView(storage.address, depth, depth * banks, kind, shape,
                                      storage.layout.dtype, storage.layout, name))
        for address, depth in sizes.items():
            if address not in seen:  # the circular buffers of the running program
                buffers.append(BufferView(address, depth, depth * banks, "circular_buffers"))
        if space is MemorySpace.DRAM and self.trace_region is not None:  # above the allocator's reach
            for address, depth in self.trace_region.allocations().items():
                buffers.append(BufferView(address, depth, depth * banks, "trace_buffer"))
        buffers.sort(key=lambda b: b.address)
        return MemoryView(space, banks, allocator.size * banks, allocator.used_bytes * banks,
                          (allocator.size - allocator.used_bytes) * banks,
                          allocator.largest_free * banks, tuple(buffers),
                          tuple(allocator.free_blocks()))

    # -- counters ---------------------------------------------------------------------------

    def count(self, name: str, amount: int) -> None:
        self.counters[name] += amount

    def count_copy(self, src: Storage, dst: Storage) -> None:
        """Counts a copy made for a layout: a conversion if it changes the format, else residency."""
        if src.same_format(dst):
            self.counters["residency_copies"] += 1
            self.counters["residency_copy_bytes"] += dst.nbytes
        else:
            self.counters["layout_conversions"] += 1

    # -- geometry and allocation ------------------------------------------------------------

    def intern(self, layout: Layout) -> Layout:
        """The one object this device uses for layouts equal to `layout`: every storage, declared
        layout and plan holds interned layouts, so that the C fast path finds a storage by
        identity (it falls back to equality all the same, the general path's rule)."""
        return self._layouts.setdefault(layout, layout)

    def geometry(self, layout: Layout, shape: tuple[int, ...]) -> Geometry:
        """Where a value of `shape` in `layout` goes: its pages and their depth in each bank."""
        assert layout.dtype is not None
        layout = self._layouts.setdefault(layout, layout)
        page_size, num_pages = storage_geometry(shape, layout.dtype, layout.tensor_layout)
        space = self._spaces[layout.memory]
        aligned = space.aligned(page_size)
        depth = -(-num_pages // space.num_banks) * aligned
        if len(shape) == 1:
            dims3 = (1, 1, shape[0])
        else:
            dims3 = (math.prod(shape[:-2]), shape[-2], shape[-1])
        return layout, space, page_size, aligned, num_pages, depth, dims3

    def geometry_of(self, storage: Storage, where: MemorySpace | None = None) -> Geometry:
        """The geometry of a twin of an existing storage, in its own space or in `where`."""
        layout = storage.layout
        if where is not None and where is not layout.memory:
            layout = self.intern(Layout(where, layout.tensor_layout, layout.dtype))
        space = self._spaces[layout.memory]
        aligned = space.aligned(storage.page_size)
        depth = -(-storage.num_pages // space.num_banks) * aligned
        return (layout, space, storage.page_size, aligned, storage.num_pages, depth, storage.dims3)

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

    def free_all(self) -> None:
        """Frees every buffer (the device is closing), those that traces still pin too: a trace
        of a closed device is never replayed, and releasing it later unpins nothing."""
        self.collect_garbage()
        self._pins.clear()
        self._orphans.clear()
        self.trace_region = None  # its trace buffers go with the device
        for storage in list(self._owned):
            self.free(storage)

    # -- a tensor's storages (`add_storage`, appending one, is `SchedulerCore`'s, in C) ---------

    def replace_storage(self, state: TensorState, old: Storage, new: Storage) -> None:
        """`new` takes `old`'s place among the state's storages (an eviction copied it to DRAM)."""
        storages = state.storages
        storages[storages.index(old)] = new

    def drop_storage(self, state: TensorState, storage: Storage) -> None:
        """`storage` is no longer one of the state's (evicted where DRAM already held its value).
        When it was the home, the home moved for free: the DRAM copy of the same format is the
        new home (it holds the value exactly; a converted storage may not)."""
        storages = state.storages
        index = storages.index(storage)
        del storages[index]
        if index == 0:
            layout = Layout(MemorySpace.DRAM, storage.layout.tensor_layout, storage.layout.dtype)
            copy = state.find(layout)
            assert copy is not None
            storages.remove(copy)
            storages.insert(0, copy)

    def drop_duplicates(self, state: TensorState) -> None:
        """One storage per layout again, after a pinned one was evicted in place to DRAM where
        its tensor already kept a copy in that layout (`set_storages`' rule: the earlier stays,
        the other is freed; a pinned one stays the trace's, refilled when replayed)."""
        self.set_storages(state, list(state.storages))

    def drop_conversions(self, state: TensorState) -> None:
        """A write of a new value: every storage but the home is stale, and freed."""
        for stale in state.storages[1:]:
            self.free(stale)
        del state.storages[1:]

    def adopt(self, state: TensorState, storage: Storage) -> None:
        """A pinned storage that a replay refilled from the state's value is one of its storages
        again."""
        state.storages.append(storage)
        self._own(state, storage)

    def set_storages(self, state: TensorState, storages: Sequence[Storage]) -> None:
        """The state holds exactly `storages` (what a trace replay leaves in its outputs: the
        capture's snapshot), one per layout; the others (a conversion of the old value, an
        evicted home) are freed. Two of the snapshot's may share a layout since: a pinned home
        evicted in place to DRAM beside a DRAM copy. The first is kept, the other stays the
        trace's alone (pinned: the replay still writes it)."""
        kept: list[Storage] = []
        for storage in storages:
            if all(other.layout != storage.layout for other in kept):
                kept.append(storage)
        for storage in state.storages:
            if storage not in kept:
                self.free(storage)
        for storage in storages:
            if storage not in kept and storage not in state.storages:
                self.free(storage)  # pinned: an orphan of the trace
        state.storages[:] = kept
        for storage in kept:
            self._own(state, storage)

    def _own(self, state: TensorState, storage: Storage) -> None:
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

    # -- pins (a trace replays into a pinned buffer) ------------------------------------------

    def pin(self, storage: Storage) -> None:
        self._pins[storage] = self._pins.get(storage, 0) + 1

    def unpin(self, storage: Storage) -> None:
        pins = self._pins.pop(storage, None)
        if pins is None:  # freed with its device (`free_all`)
            return
        count = pins - 1
        if count:
            self._pins[storage] = count
        elif self._orphans.pop(storage, 0) is None:
            if storage in self.in_motion:
                self.free_after_move.add(storage)
            else:
                self.free(storage)

    def open_capture(self, capture: _Rebindable) -> None:
        """`capture` records what is queued from now on; it is kept (weakly) to be rebound when
        a buffer it pins moves."""
        self.capturing = capture
        self._captures.add(capture)

    def close_capture(self) -> None:
        self.capturing = None

    def traced_writer(self, state: TensorState) -> _Rebindable | None:
        """A live trace whose replays write `state` (one of its outputs), if any."""
        for capture in self._captures:
            if capture.writes(state):
                return capture
        return None

    def rebind_captures(self) -> None:
        """A pinned buffer moved in place: every live capture binds its records to addresses again."""
        for capture in self._captures:
            capture.rebind()

    # -- moves --------------------------------------------------------------------------------

    def begin_move(self, state: TensorState | None, storage: Storage, command: Command,
                   in_place: bool) -> None:
        """`command` moves `storage` (of `state`; None for a trace's orphan) until `end_move`:
        the tensor is not moved again, nor written, and not freed meanwhile (the move counts as
        pending work on it). A buffer moved in place (its `Storage` takes the new address) is
        in motion: a trace letting go of it then frees it when the move ends, not under it."""
        if in_place:
            self.in_motion.add(storage)
        if state is not None:
            state.moving = command
            state.pending += 1  # deallocating it now must wait for the move

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
            self.rebind_captures()

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

    # -- liveness -------------------------------------------------------------------------------

    def mark_queued(self, command: Command) -> None:
        """`command` was queued: it is the last reader of what it reads and the last writer of
        what it writes, and each of those counts it as pending work (`settle_all` undoes this
        when it completes)."""
        for state in command.reads:
            state.last_reader = command
            state.pending += 1
        for state in command.writes:
            state.last_writer = command
            state.pending += 1

    def releases_ahead(self, space: MemorySpace) -> list[tuple[Command, int]]:
        """What CQ1's queued commands give back in `space` as they complete, without CQ0 going
        on: (command, bytes per bank freed when it completes) for each that frees something,
        in CQ1's order. Only the commands at CQ1's head that wait for nothing on CQ0 count
        (the first that does ends the run: the command asking is CQ0's head, so what waits for
        CQ0 waits for it). A deallocated tensor's storages are freed when the last command
        queued on it completes (`settle_all`), a storage freed under a record in flight when
        the record lands; a storage a trace pins stays."""
        sizes = self.allocator(space).allocations()
        pins = self._pins
        left: dict[TensorState, int] = {}  # queued commands on each state, the run's not counted
        run: dict[Command, int] = {}  # each command of the run, with its place in CQ1
        freed: dict[int, int] = {}  # bytes per bank freed as the command at each place completes
        for command in self.cq1._pending:
            blocker = command.blocker()
            if (blocker is not None and blocker not in run) or any(
                    not dep.done and dep not in run for dep in command.deps):
                break
            place = run[command] = len(run)
            for state in (*(command.writes or ()), *(command.reads or ())):
                count = left[state] = left.get(state, state.pending) - 1
                if count == 0 and state.deallocated:
                    freed[place] = freed.get(place, 0) + sum(
                        sizes.get(storage.address, 0) for storage in state.storages
                        if storage.layout.memory is space and storage not in pins)
        for storage in self._free_on_landing:  # freed when the last record naming it lands
            flights = storage.flights or ()
            if storage.layout.memory is space and flights and all(c in run for c in flights):
                place = max(run[c] for c in flights)
                freed[place] = freed.get(place, 0) + sizes.get(storage.address, 0)
        commands = list(run)
        return [(commands[place], nbytes) for place, nbytes in sorted(freed.items()) if nbytes]

    def settle(self, state: TensorState) -> None:
        """One queued command that used the state is done; a deallocated one may now be freed."""
        state.pending -= 1
        if state.deallocated:
            self.release(state)

    def deallocate(self, state: TensorState) -> None:
        if not state.deallocated:
            state.deallocated = True
            self.release(state)

    def label(self, state: TensorState, name: str | None) -> None:
        """The user's name for the tensor (`Tensor.name`), shown by memory views and maps."""
        state.name = name

    def consume(self, state: TensorState, program: str) -> None:
        """A donated input is consumed by `program`: its handle refuses new work, and its buffer
        becomes the program's output when it commits (`hand_over`)."""
        state.deallocated = True
        state.donated_to = program

    def drop(self, state: TensorState) -> None:
        """A handle was garbage-collected (any thread): free its state on the loop thread."""
        self._dropped.append(state)

    def drop_trace(self, capture: Any) -> None:
        """A `Trace` handle was garbage-collected (any thread): its capture is released on the
        loop thread (`collect_garbage` calls its `dropped`)."""
        self._dropped.append(capture)

    # -- records in flight ------------------------------------------------------------------

    def flight(self, command: Command, record: Record, start: bool) -> None:
        """A queue handed `record` to its worker (`start`) or it landed: each storage it names
        knows the commands in flight on it, so that nothing frees or moves it meanwhile (a move
        waits: `moves.in_flight`; a free waits for the landing)."""
        for step in record.steps:
            for storage in _named(step):
                flights = storage.flights
                if start:
                    if flights is None:
                        storage.flights = [command]
                    else:
                        flights.append(command)
                    continue
                assert flights is not None, "a landing without a take-off"
                flights.remove(command)
                if not flights:
                    storage.flights = None
                    if storage in self._free_on_landing:
                        self._free_on_landing.discard(storage)
                        self.free(storage)

    # -- the circular-buffer region -------------------------------------------------------------

    def hold_footprint(self, command: Command, depth: int, allowed: frozenset[int] = frozenset()) -> None:
        """Runs `command` with its circular buffers at the bottom of L1, as tt-metal places a
        program's; FootprintClash when live L1 buffers are in the way.

        The region stays allocated between programs, as deep as the largest program run so far
        (its high-water mark), so that L1 buffers, allocated top-down, keep out of it while L1
        has room; an L1 allocation that finds no room gives it back first (`room.make_room`),
        and the next program takes it again, moving what is in the way.

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
            for gap_start, gap in planning.gaps(allocator, start, depth - start):
                if allocator.claim(gap_start, gap):
                    self._cb_blocks.append(gap_start)
        self.cb_depth = depth
        self._cb_holders += 1
        command.footprint = depth

    def release_footprint(self, command: Command) -> None:
        command.footprint = 0
        self._cb_holders -= 1

    def give_back_footprint(self) -> bool:
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
