"""Making room: what runs before a command that ran out of memory decides again.

The policy, in one place and in CQ0's order: take back the idle circular-buffer region, evict
L1 buffers (farthest next use first), relocate buffers to make a free block, compact, spill the
command's L1 allocations to DRAM, and last wait for what deallocated tensors give back once the
writes queued into them land (`make_room`); under the "eager" policy, evict before every
program (`eviction_for`). The arithmetic over addresses is `planning`'s; the moves are
`moves`' commands, queued like any other.

These are plain functions of the scheduler's state, not methods of a scheduler class: the
commands that run out of memory (`commands`, above this module) call them directly, so the
dependency is an import that runs downward and that the layers contract checks, not a call
back up through the scheduler object. Room reads the tables through `SchedulerState`'s
methods and changes nothing itself, except the two things it decides on the spot: giving back
the idle circular-buffer region (`SchedulerState.give_back_footprint`) and marking a command
as spilling (`Command.spill`). Every move is a command it returns.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from .._errors import OutOfMemoryError
from .._memory.banks import Storage
from .._queue import RETRY, Command
from .._types import Layout, MemorySpace
from . import planning
from .moves import AwaitReleaseCommand, EvictCommand, RelocateCommand, SlideCommand
from .state import FootprintClash, SchedulerState, TensorState

if TYPE_CHECKING:
    from collections.abc import Collection

__all__ = ["make_room", "eviction_for", "note_needed", "FootprintClash"]


def eviction_for(s: SchedulerState, program: Command) -> EvictCommand | None:
    """The eviction a starting program needs: ready L1 storages of tensors it does not read."""
    keep = program.reads
    if not s.holds_l1():
        return None
    s.collect_garbage()
    victims = [
        (state, storage)
        for storage, state in s.l1_buffers()
        if state.last_writer is None and state not in keep
    ]
    if not victims:
        return None
    command = EvictCommand(s, victims, room=_room_of(s))
    command.capture = program.capture  # a captured program's evictions are part of its trace
    return command


def _room_of(s: SchedulerState) -> functools.partial[Command | object | None]:
    """What a move that runs out of memory itself asks for room (an eviction's DRAM targets:
    DRAM is relocated or compacted first)."""
    return functools.partial(_room_for_move, s)


def _room_for_move(s: SchedulerState, command: Command, error: OutOfMemoryError) -> Command | object | None:
    return make_room(s, command, error, 0)


def _movable(state: TensorState | None, storage: Storage, wait: bool = False) -> bool:
    """Whether a tensor's storage may be moved now, in CQ0's order: not being moved, not a
    committed command's output yet, and named by no record in flight (a write the other queue
    runs into it: a write still queued decides its target when it runs, after the move). With
    `wait`, a record in flight is no obstacle: the move waits for it (`EvictCommand.blocker`)."""
    if state is None or state.moving is not None:
        return False
    if storage not in state.storages:
        return False  # the output or move target of a command not yet committed
    return wait or not storage.flights


def _relocatable(s: SchedulerState, owner: TensorState | None,
                 storage: Storage) -> tuple[TensorState | None, Storage] | None:
    """The victim entry that relocates `storage`, or None when it may not move: a running
    program's scratch or output. A buffer kept for a trace whose tensor let go of it
    (an orphan) moves without a tensor."""
    if s.is_orphan(storage):
        return (None, storage)
    if _movable(owner, storage, wait=True):
        return (owner, storage)
    return None


def make_room(s: SchedulerState, command: Command, error: OutOfMemoryError,
              footprint: int) -> Command | object | None:
    """What makes `command`'s failed allocation fit, to run before it decides again
    (`footprint`: the circular-buffer bytes `command` runs with, 0 for none):

    0. L1, for a command that runs no circular buffers: take back the idle region;
    1. L1: evict the fewest L1 buffers, farthest next use first (`planning.choose_victims`),
       among those `command` does not read (under "eager", the preamble evicted the rest
       already);
    2. any space: relocate live buffers to make a free block when the space's free bytes
       would hold it, cheapest block first; in L1 a buffer that does not fit elsewhere in L1
       moves to DRAM; for a clash with circular buffers, the block is the bottom of L1;
    3. L1: spill, i.e. the command's L1 allocations go to DRAM (`RETRY`);
    4. any space: wait for memory on its way back. A tensor the user deallocated keeps its
       buffers until the commands queued on it complete; when CQ1's writes into such tensors,
       which wait for nothing on CQ0, free enough (`SchedulerState.releases_ahead`), wait for
       them (`AwaitReleaseCommand`), then decide again (relocating or compacting if what came
       back is not one block). Memory that a command behind this one on CQ0 still needs is
       not waited for: it cannot come back first.

    None when nothing helps; the error then carries the space's memory view."""
    s.collect_garbage()
    space = error.space
    if not isinstance(space, MemorySpace):
        return None
    allocator = s.allocator(space)
    depth = error.requested
    clash = isinstance(error, FootprintClash)
    if clash and s.footprint_busy():
        return None  # only a program decided ahead meets this; it is decided again in turn
    depth = -(-depth // allocator.alignment) * allocator.alignment
    # What the whole decision needs there (it gave back what it had allocated as it failed).
    needed = max(depth, getattr(error, "needed", depth))
    if depth > allocator.size:
        return None  # larger than the whole space: no room can ever be made (nor spilled)
    if space is MemorySpace.L1 and not clash and footprint == 0 and s.give_back_footprint():
        return RETRY
    keep = set(command.reads or ())
    if space is MemorySpace.L1 and not clash:
        uses = planning.next_uses(s.cq0._pending)
        candidates = []
        sizes = allocator.allocations()
        dram_twins: dict[Layout, Layout] = {}
        for storage, state in s.l1_buffers():
            if state in keep or s.is_pinned(storage) or not _movable(state, storage):
                continue
            layout = storage.layout
            dram = dram_twins.get(layout)
            if dram is None:
                dram = dram_twins[layout] = Layout(MemorySpace.DRAM, layout.tensor_layout, layout.dtype)
            free = state.find(dram) is not None
            candidates.append(((state, storage), storage.address, sizes[storage.address],
                               uses.get(state, planning.NEVER), free))
        victims = (planning.choose_victims(candidates, allocator.free_blocks(), depth, needed)
                   if candidates else None)
        if victims:
            return EvictCommand(s, victims, room=_room_of(s))
    movable: dict[int, tuple[TensorState | None, Storage]] = {}
    for storage, owner in s.buffers():
        if storage.layout.memory is space:
            entry = _relocatable(s, owner, storage)
            if entry is not None:
                movable[storage.address] = entry
    if clash:  # the block is the bottom of L1, except buffers allowed to stay there
        assert isinstance(error, FootprintClash)
        allocations = allocator.allocations()
        inside = [a for a in allocations
                  if a < depth and a not in error.allowed and not s.is_footprint_block(a)]
        if not inside or any(a not in movable for a in inside):
            return None
        return _clear_block(s, space, 0, depth, inside, movable, frozenset())
    free_bytes = allocator.size - allocator.used_bytes
    if free_bytes >= needed or space is MemorySpace.L1:
        for start, inside in planning.windows(allocator.allocations(), set(movable), allocator.size,
                                              allocator.alignment, needed, allocator.top_down):
            room = _clear_block(s, space, start, needed, inside, movable, keep) if inside else None
            if room is not None:
                return room
    if free_bytes >= needed:  # every hole too small for what is in the way: compact
        moves = planning.compaction(allocator.allocations(), set(movable), allocator.size, needed)
        if moves:
            return SlideCommand(s, space, [(*movable[old], new) for old, new in moves])
    if space is MemorySpace.L1 and not command.spill and command.spillable:
        command.spill = True  # a move is not spilled: its targets are where it moves them
        return RETRY
    until = _release_to_await(s, space, needed - free_bytes)
    if until is not None:  # memory deallocated tensors give back once CQ1's writes into them run
        return AwaitReleaseCommand(until)
    return None


def _release_to_await(s: SchedulerState, space: MemorySpace, short: int) -> Command | None:
    """The first of CQ1's commands ahead (`SchedulerState.releases_ahead`) whose completion
    frees `short` more bytes per bank in `space` than are free now, counting those before it
    (at least one release when the free bytes would hold the request but are not one block: a
    release may join them); None when even all of them would not."""
    got = 0
    for until, nbytes in s.releases_ahead(space):
        got += nbytes
        if got >= max(short, 1):
            return until
    return None


def _clear_block(s: SchedulerState, space: MemorySpace, start: int, depth: int, inside: list[int],
                 movable: dict[int, tuple[TensorState | None, Storage]],
                 keep: Collection[TensorState]) -> EvictCommand | None:
    """The moves that empty [start, start + depth): each buffer in it relocates where the
    allocator would place it outside; one that does not fit is evicted to DRAM (in place
    when a trace replays into it) unless the command that needs the room reads it; then,
    or in DRAM, the block cannot be made (None)."""
    allocator = s.allocator(space)
    sizes = allocator.allocations()
    places = planning.placement(allocator, (start, depth), inside)
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
        elif state is None or s.is_pinned(storage):
            relocate[storage] = MemorySpace.DRAM  # evicted in place: a trace replays into it
    kind = RelocateCommand if space in relocate.values() else EvictCommand
    return kind(s, victims, relocate, (space, planning.gaps(allocator, start, depth)), room=_room_of(s))


def note_needed(s: SchedulerState, error: BaseException, allocated: list[Storage]) -> None:
    """Notes on an out-of-memory error of a decision how much of the space the decision
    needs in all (`needed`, bytes per bank): what it had allocated there before the failing
    allocation (it gives that back as it fails) plus the failing request."""
    if isinstance(error, OutOfMemoryError) and not isinstance(error, FootprintClash) \
            and isinstance(error.space, MemorySpace):
        sizes = s.allocator(error.space).allocations()
        held = sum(sizes.get(storage.address, 0) for storage in allocated
                   if storage.layout.memory is error.space)
        error.needed = error.requested + held  # type: ignore[attr-defined]

