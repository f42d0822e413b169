"""Making room in a memory space: which buffers to evict, and where a block can be made.

Pure planning over addresses and sizes (no tensors, no bank memory): `room` asks, then queues
the moves (`moves`' commands) that run in queue order like any other command.

- `choose_victims`: Belady's MIN over the known queue. The buffers whose next use is farthest go
  first (a buffer no queued command reads is never needed again, as far as the runtime can know);
  among those, one whose value DRAM already holds goes first (evicting it copies nothing). Only as
  many as make a free block of the size asked for.
- `windows`: where a block of `depth` bytes could be made by moving live buffers out of the way,
  cheapest first (fewest bytes to move), skipping any window that holds a buffer that cannot move
  (a running program's scratch or circular buffers, a buffer pinned by a trace).
- `placement`: whether the buffers in a window fit elsewhere, simulated on a copy of the
  allocator; best fit is deterministic, so the real allocations land where the simulation says.
- `compaction`: when no window's buffers fit into the holes elsewhere (every hole a little too
  small), slides a run of buffers together, some down and some up, so that the holes between
  them merge into one block: the cheapest such run, as a list of moves in the order to make them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from .._core._allocator import Allocator

__all__ = ["NEVER", "next_uses", "choose_victims", "largest_block", "windows", "placement", "gaps", "compaction"]

NEVER = math.inf
"""The next use of a buffer that no queued command reads."""

T = TypeVar("T")


def next_uses(commands: Iterable[Any]) -> dict[Any, int]:
    """For each tensor state some queued command reads: the position of the first such command."""
    first: dict[Any, int] = {}
    for position, command in enumerate(commands):
        for state in command.reads or ():  # None for a command that reads no tensor
            first.setdefault(state, position)
    return first


def largest_block(free_blocks: Iterable[tuple[int, int]], freed: Iterable[tuple[int, int]]) -> int:
    """The largest free block once `freed` ranges are free too (neighbours coalesce)."""
    ranges = sorted([*free_blocks, *freed])
    best = 0
    start = end = -1
    for s, size in ranges:
        if s > end:
            start, end = s, s + size
        else:
            end = max(end, s + size)
        best = max(best, end - start)
    return best


def choose_victims(candidates: Sequence[tuple[T, int, int, float, bool]], free_blocks: list[tuple[int, int]],
                   depth: int, needed: int | None = None) -> list[T] | None:
    """The fewest candidates, in Belady order, whose eviction makes a free block of `depth`
    and `needed` bytes free in all (a decision that allocates several buffers).

    A candidate is (item, address, depth, next use, free to evict). None when even evicting
    every candidate leaves no such block (then buffers must move, or L1 cannot hold it)."""
    order = sorted(candidates, key=lambda c: (c[3], c[4], c[2]), reverse=True)
    freed: list[tuple[int, int]] = []
    chosen: list[T] = []
    free = sum(size for _, size in free_blocks)
    needed = depth if needed is None else max(depth, needed)
    for item, address, size, _, _ in order:
        freed.append((address, size))
        chosen.append(item)
        free += size
        if free >= needed and largest_block(free_blocks, freed) >= depth:
            return chosen
    return None


def windows(allocations: dict[int, int], movable: set[int], line: int, alignment: int, depth: int,
            top_down: bool) -> list[tuple[int, list[int]]]:
    """Windows [start, start + depth) that could be emptied, as (start, addresses of the movable
    buffers in it), fewest bytes to move first."""
    starts = {0, line - depth}
    for address, size in allocations.items():
        starts.add(address + size)
        starts.add(address - depth)
    found = []
    spans = sorted(allocations.items())
    for start in starts:
        start -= start % alignment
        if start < 0 or start + depth > line:
            continue
        end = start + depth
        inside = [a for a, size in spans if a < end and a + size > start]
        if any(a not in movable for a in inside):
            continue
        cost = sum(allocations[a] for a in inside)
        found.append((cost, -start if top_down else start, start, inside))
    found.sort(key=lambda f: (f[0], f[1]))
    return [(start, inside) for _, _, start, inside in found]


def placement(allocator: Allocator, window: tuple[int, int], movers: Sequence[int]) -> dict[int, int | None]:
    """Where each mover (by address) would be allocated while the window's free parts are held
    (the movers' old buffers are still allocated then): an address, or None when it does not
    fit. Movers are placed largest first, as `EvictCommand` allocates them."""
    used = allocator.allocations()
    sim = Allocator(allocator.size, allocator.alignment, allocator.top_down)
    for address, size in used.items():
        sim.claim(address, size)
    for gap in gaps(allocator, *window):
        sim.claim(*gap)
    places: dict[int, int | None] = {}
    for address in sorted(movers, key=lambda a: -used[a]):
        places[address] = sim.allocate(used[address])
    return places


def gaps(allocator: Allocator, start: int, depth: int) -> list[tuple[int, int]]:
    """The free parts of [start, start + depth)."""
    found = []
    for gap_start, gap_size in allocator.free_blocks():
        lo, hi = max(gap_start, start), min(gap_start + gap_size, start + depth)
        if lo < hi:
            found.append((lo, hi - lo))
    return found


def compaction(allocations: dict[int, int], movable: set[int], line: int,
               depth: int) -> list[tuple[int, int]] | None:
    """Moves (old address, new address) that slide buffers together so that a free block of
    `depth` bytes appears, fewest bytes moved first; None when no run of movable buffers holds
    that many free bytes between its neighbours.

    A run is buffers i..j, all movable, between their neighbours (or the ends of the line): its
    free bytes are the holes between. Buffers i..k-1 slide down against the lower neighbour and
    k..j up against the upper one, so the holes merge between k-1 and k; buffers already against
    their neighbour stay. Moves are listed in an order in which each target overlaps no buffer
    that has not moved yet (the down ones lowest first, the up ones highest first), though it
    may overlap its own old place: a move copies as memmove does. Only the smallest run from each
    first buffer is tried (growing a run only adds buffers to move), so planning is O(n^2)."""
    spans = sorted(allocations.items())
    n = len(spans)
    best: tuple[int, list[tuple[int, int]]] | None = None
    for i in range(n):
        if spans[i][0] not in movable:
            continue
        lo = spans[i - 1][0] + spans[i - 1][1] if i > 0 else 0
        held = 0
        for j in range(i, n):
            address, size = spans[j]
            if address not in movable:
                break
            held += size
            hi = spans[j + 1][0] if j + 1 < n else line
            if (hi - lo) - held < depth:
                continue
            run = spans[i:j + 1]
            cost, moves = _cheapest_split(run, lo, hi)
            if best is None or cost < best[0]:
                best = (cost, moves)
            break  # a longer run from i only adds buffers to move
    return best[1] if best is not None else None


def _cheapest_split(run: list[tuple[int, int]], lo: int, hi: int) -> tuple[int, list[tuple[int, int]]]:
    """Of the ways to slide `run` (address, size) down against `lo` and up against `hi`, the one
    that moves the fewest bytes: its cost and moves, in a safe order."""
    count = len(run)
    # down[k]: bytes moved packing run[:k] down; up[k]: packing run[k:] up.
    down = [0] * (count + 1)
    cursor = lo
    for k, (address, size) in enumerate(run):
        down[k + 1] = down[k] + (size if address != cursor else 0)
        cursor += size
    up = [0] * (count + 1)
    cursor = hi
    for k in range(count - 1, -1, -1):
        address, size = run[k]
        cursor -= size
        up[k] = up[k + 1] + (size if address != cursor else 0)
    split = min(range(count + 1), key=lambda k: down[k] + up[k])
    moves = []
    cursor = lo
    for address, size in run[:split]:
        if address != cursor:
            moves.append((address, cursor))
        cursor += size
    cursor = hi
    for address, size in reversed(run[split:]):
        cursor -= size
        if address != cursor:
            moves.append((address, cursor))
    return down[split] + up[split], moves
