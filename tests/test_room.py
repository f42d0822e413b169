"""Planning room by compaction (`ttflow._sched.planning.compaction`), as pure address arithmetic.

The plan is replayed move by move on a model of the address line: each move may overlap its own
old place but no buffer that has not moved yet, and at the end no two buffers overlap and one free
block holds the request. Whether a plan exists is compared with a brute force over every run of
movable buffers between two neighbours.
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ttflow._sched.planning import compaction

ALIGN = 32


@st.composite
def lines(draw: st.DrawFn) -> tuple[dict[int, int], set[int], int, int]:
    """Buffers and holes laid out in turn (sizes in units of ALIGN), some buffers pinned, and a
    request no larger than the line."""
    pieces = draw(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6), st.booleans()),
                           min_size=1, max_size=12))
    allocations: dict[int, int] = {}
    movable: set[int] = set()
    cursor = 0
    for hole, size, can_move in pieces:
        cursor += hole * ALIGN
        allocations[cursor] = size * ALIGN
        if can_move:
            movable.add(cursor)
        cursor += size * ALIGN
    line = cursor + draw(st.integers(0, 6)) * ALIGN
    depth = draw(st.integers(1, max(1, line // ALIGN))) * ALIGN
    return allocations, movable, line, depth


def _largest_hole(allocations: dict[int, int], line: int) -> int:
    best, cursor = 0, 0
    for address, size in sorted(allocations.items()):
        best = max(best, address - cursor)
        cursor = address + size
    return max(best, line - cursor)


def _some_run_has_room(allocations: dict[int, int], movable: set[int], line: int, depth: int) -> bool:
    """Brute force: a run of movable buffers (maybe none) whose neighbours are `depth` apart
    plus the run's own bytes."""
    spans = sorted(allocations.items())
    edges = [0] + [a + s for a, s in spans]  # lower neighbour ends
    for i in range(len(spans) + 1):
        for j in range(i, len(spans) + 1):  # run spans[i:j]
            if any(a not in movable for a, _ in spans[i:j]):
                break
            hi = spans[j][0] if j < len(spans) else line
            if hi - edges[i] - sum(s for _, s in spans[i:j]) >= depth:
                return True
    return False


@settings(max_examples=400)  # pure arithmetic, about 1 ms an example: the plan order's bugs need many
@given(lines())
def test_a_plan_moves_safely_and_leaves_the_block(case: tuple[dict[int, int], set[int], int, int]) -> None:
    allocations, movable, line, depth = case
    moves = compaction(allocations, movable, line, depth)
    if _largest_hole(allocations, line) >= depth:
        return  # nothing to compact: the scheduler never asks
    assert (moves is not None) == _some_run_has_room(allocations, movable, line, depth)
    if moves is None:
        return
    placed = dict(allocations)  # address -> size, updated move by move
    for old, new in moves:
        assert old in movable and old in placed and new % ALIGN == 0
        size = placed.pop(old)
        assert 0 <= new and new + size <= line
        for address, other in placed.items():
            assert new + size <= address or address + other <= new, (
                f"moving {old} to {new} overwrites the buffer at {address}")
        placed[new] = size
    assert len(placed) == len(allocations)
    assert _largest_hole(placed, line) >= depth
    assert all(address in placed for address in allocations if address not in movable)


def test_survivors_larger_than_every_hole_slide_over_their_own_old_place() -> None:
    # holes of 3 between buffers of 4 (units of 32 bytes), then a pinned buffer
    allocations = {3 * 32: 4 * 32, 10 * 32: 4 * 32, 17 * 32: 4 * 32, 21 * 32: 8 * 32}
    moves = compaction(allocations, {96, 320, 544}, 29 * 32, 9 * 32)
    # All three holes must merge, below the pinned buffer. The third survivor already lies
    # against it; sliding the other two up (the higher first, each over part of its old place)
    # moves 8 units, as sliding them down would: ties go up.
    assert moves == [(10 * 32, 13 * 32), (3 * 32, 9 * 32)]
