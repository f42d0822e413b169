"""Making room in a memory space: which buffers to evict, and where a block can be made.

Pure planning over addresses and sizes (no tensors, no bank memory): the scheduler asks, then
queues the moves as an `EvictCommand` that runs in queue order like any other command.

- `choose_victims`: Belady's MIN over the known queue. The buffers whose next use is farthest go
  first (a buffer no queued command reads is never needed again, as far as the runtime can know);
  among those, one whose value DRAM already holds goes first (evicting it copies nothing). Only as
  many as make a free block of the size asked for.
- `windows`: where a block of `depth` bytes could be made by moving live buffers out of the way,
  cheapest first (fewest bytes to move), skipping any window that holds a buffer that cannot move
  (a running program's scratch or circular buffers, a buffer pinned by a trace).
- `placement`: whether the buffers in a window fit elsewhere, simulated on a copy of the
  allocator; best fit is deterministic, so the real allocations land where the simulation says.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from ._core._allocator import Allocator

__all__ = ["NEVER", "next_uses", "choose_victims", "largest_block", "windows", "placement", "gaps"]

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
