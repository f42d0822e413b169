"""Commands that make room: evictions, relocations and compaction's slides move live buffers out
of the way; a wait lets memory that deallocated tensors still hold come back.

`room` decides which buffers move and where; these commands make the moves in CQ0's order, like
any other command: `decide` allocates the targets (or checks that a slide's plan still matches
the allocator) and returns the copies as a record, `commit` gives the tensors their new storages.
They change scheduling state only through `SchedulerState`'s methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._commands import Copy, Record, Slide
from .._errors import OutOfMemoryError
from .._memory.banks import Storage
from .._queue import Command
from .._types import Layout, MemorySpace
from . import planning
from .state import SchedulerState, TensorState

__all__ = ["AwaitReleaseCommand", "EvictCommand", "RelocateCommand", "SlideCommand"]


def in_flight(storages: Iterable[Storage]) -> Command | None:
    """A command in flight (decided, its record handed to a worker and not landed) that names
    one of these storages: a move waits for it. A queued write decides its target after the
    move (it waits on `state.moving`); one already in flight must land first, however many
    writes are queued behind it."""
    for storage in storages:
        flights = storage.flights
        if flights:
            for command in flights:
                if not command.done:
                    return command
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
    __slots__ = ("victims", "moves", "guards", "relocated", "room")

    def __init__(self, scheduler: SchedulerState, victims: Sequence[tuple[TensorState | None, Storage]],
                 relocate: dict[Storage, MemorySpace] | None = None,
                 guards: tuple[MemorySpace, list[tuple[int, int]]] | None = None,
                 room: Callable[[Command, OutOfMemoryError], Command | object | None] | None = None) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.victims = list(victims)
        self.relocated = relocate if relocate is not None else {}
        self.guards = guards
        self.moves: list[tuple[TensorState | None, Storage, Storage | None]] = []
        self.room = room  # room's policy (above this module), for the targets' own room

    def blocker(self) -> Command | None:
        """A command in flight on a victim (a write the other queue is running into it)."""
        return in_flight(storage for _, storage in self.victims)

    def make_room(self, error: OutOfMemoryError) -> Command | object | None:
        """Its DRAM targets did not fit: DRAM is relocated or compacted first (`room`)."""
        return self.room(self, error) if self.room is not None else None

    def out_of_memory(self, error: OutOfMemoryError) -> OutOfMemoryError:
        return self.scheduler.out_of_memory(error)

    def decide(self) -> Record:
        s = self.scheduler
        steps = []
        nbytes = 0
        self.moves = []
        guards = self.guards
        held: list[int] = []
        if guards is not None:
            allocator = s.allocator(guards[0])
            for start, depth in guards[1]:
                if allocator.claim(start, depth):
                    held.append(start)
        try:
            for state, storage in self.victims:
                if state is None:
                    if not s.is_orphan(storage):
                        continue  # released since it was chosen
                elif storage not in state.storages or state.moving not in (None, self):
                    continue  # freed or moved since it was chosen
                target = None
                where = self.relocated.get(storage)
                if where is not None:
                    target = s.allocate_geometry(s.geometry_of(storage, where), None)
                    steps.append(Copy(storage, target, storage.dims3))
                    nbytes += storage.nbytes + target.nbytes
                else:
                    assert state is not None
                    layout = Layout(MemorySpace.DRAM, storage.layout.tensor_layout, storage.layout.dtype)
                    if state.find(layout) is None:
                        target = s.allocate(layout, state.shape, state)
                        steps.append(Copy(storage, target, state.shape))
                        nbytes += storage.nbytes + target.nbytes
                self.moves.append((state, storage, target))
                s.begin_move(state, storage, self, in_place=where is not None)
        except OutOfMemoryError as error:
            self._undo()
            # What the whole move needs there, so that room is made for all of its targets
            # at once (one target's block at a time, each relocation would undo the last).
            error.needed = max(error.requested, self._needed(error.space))  # type: ignore[attr-defined]
            raise
        except BaseException:
            self._undo()
            raise
        finally:
            for start in held:
                allocator.free(start)
        return Record(tuple(steps), nbytes=nbytes)

    def _needed(self, space: Any) -> int:
        """Bytes per bank the targets in `space` take together (the victims still to move)."""
        s = self.scheduler
        total = 0
        for state, storage in self.victims:
            where = self.relocated.get(storage)
            if where is not None:
                if where is space:
                    total += s.geometry_of(storage, where)[5]
            elif state is not None and space is MemorySpace.DRAM and storage in state.storages:
                layout = Layout(MemorySpace.DRAM, storage.layout.tensor_layout, storage.layout.dtype)
                if state.find(layout) is None:
                    total += s.geometry(layout, state.shape)[5]
        return total

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
                    if state is not None:
                        s.drop_duplicates(state)
                s.end_move(state, storage)
                continue
            assert state is not None
            if target is not None:
                s.replace_storage(state, storage, target)
                copied += target.nbytes
            else:
                s.drop_storage(state, storage)
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
    `planning.compaction` chose, so that the holes between them merge into one free block.

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

    def __init__(self, scheduler: SchedulerState, space: MemorySpace,
                 plan: Sequence[tuple[TensorState | None, Storage, int]]) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.space = space
        self.plan = list(plan)
        self.moves: list[tuple[TensorState | None, Storage, int, int, int]] = []  # + target, old, depth
        self.held: list[int] = []

    def blocker(self) -> Command | None:
        """A command in flight on a buffer to slide (a write the other queue is running)."""
        return in_flight(storage for _, storage, _ in self.plan)

    def decide(self) -> Record:
        s = self.scheduler
        allocator = s.allocator(self.space)
        sizes = allocator.allocations()
        moves = []
        for state, storage, target in self.plan:
            still = (s.owns(storage) and storage.layout.memory is self.space
                     and storage.address in sizes)
            if state is None:
                still = still and s.is_orphan(storage)
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
        for start, depth in planning.gaps(allocator, lo, hi - lo):
            if allocator.claim(start, depth):
                held.append(start)
        self.held = held
        self.moves = moves
        steps = []
        nbytes = 0
        for state, storage, target, old, depth in moves:
            steps.append(Slide(self.space, old, target, depth))
            nbytes += 2 * storage.nbytes
            s.begin_move(state, storage, self, in_place=True)
        return Record(tuple(steps), nbytes=nbytes)

    def commit(self, record: Record, result: Any) -> None:
        s = self.scheduler
        allocator = s.allocator(self.space)
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
            pinned = pinned or s.is_pinned(storage)
            s.end_move(state, storage)
        if pinned:
            s.rebind_captures()
        s.count("relocations", len(self.moves))
        s.count("relocation_bytes", moved)
        self._release()

    def rollback(self, record: Record) -> None:
        s = self.scheduler
        allocator = s.allocator(self.space)
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


class AwaitReleaseCommand(Command):
    """Room on its way: tensors the user deallocated still hold their buffers while writes
    queued on CQ1 into them run; this waits for `until` (a CQ1 command that waits for nothing
    on CQ0, `SchedulerState.releases_ahead`), whose completion frees enough of them, and moves
    nothing. The command that asked then decides again (and relocates or compacts if the
    freed bytes are not one block)."""

    name = "await_release"
    __slots__ = ("until",)

    def __init__(self, until: Command) -> None:
        super().__init__()
        self.until: Command | None = until

    def blocker(self) -> Command | None:
        until = self.until
        return until if until is not None and not until.done else None

    def decide(self) -> Record:
        return Record(())

    def forget(self) -> None:
        self.until = None
