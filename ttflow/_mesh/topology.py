"""Where chips sit: the physical links among a view's chips, and the orders a reshape may take.

Pure functions of chip ids and the system's `MeshSpec` (a chip's physical coordinate is its id
in row-major order over `spec.shape`). Every mesh view keeps one invariant: chips next to each
other in the view (same row or column, one apart) are physically linked. A submesh (a block of
a view) keeps it; a reshape is allowed only to an order that keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence

from .spec import Coord, MeshSpec

__all__ = ["keeps_links", "linked_pairs", "physical", "reshape_order"]


def physical(spec: MeshSpec, chip_id: int) -> Coord:
    """The physical (row, col) of a chip of the system."""
    return divmod(chip_id, spec.shape[1])  # type: ignore[return-value]


def linked_pairs(spec: MeshSpec, ids: Sequence[int]) -> list[tuple[int, int]]:
    """Every ordered pair (a, b) of the given chips that share links, both directions."""
    coords = [physical(spec, i) for i in ids]
    return [(a, b) for a, ca in zip(ids, coords) for b, cb in zip(ids, coords)
            if a != b and spec.linked(ca, cb)]


def keeps_links(spec: MeshSpec, shape: Coord, ids: Sequence[int]) -> bool:
    """Whether `ids`, laid row-major on `shape`, put only linked chips next to each other."""
    rows, cols = shape
    for r in range(rows):
        for c in range(cols):
            here = physical(spec, ids[r * cols + c])
            if c + 1 < cols and not spec.linked(here, physical(spec, ids[r * cols + c + 1])):
                return False
            if r + 1 < rows and not spec.linked(here, physical(spec, ids[(r + 1) * cols + c])):
                return False
    return True


def _snake(shape: Coord, ids: Sequence[int]) -> list[int]:
    """The view's chips in a zigzag: row 0 left to right, row 1 right to left, ... (tt-metal's
    `MeshDeviceView::get_line_coordinates`): a path of linked chips through any view."""
    rows, cols = shape
    order: list[int] = []
    for r in range(rows):
        row = list(ids[r * cols:(r + 1) * cols])
        order += row if r % 2 == 0 else row[::-1]
    return order


def _block(spec: MeshSpec, ids: Sequence[int]) -> tuple[Coord, Coord] | None:
    """(origin, shape) of the physical block the chips fill, if they fill one exactly."""
    coords = {physical(spec, i) for i in ids}
    r0, c0 = min(r for r, _ in coords), min(c for _, c in coords)
    r1, c1 = max(r for r, _ in coords), max(c for _, c in coords)
    shape = (r1 - r0 + 1, c1 - c0 + 1)
    return ((r0, c0), shape) if shape[0] * shape[1] == len(coords) else None


def reshape_order(spec: MeshSpec, shape: Coord, ids: Sequence[int], new: Coord) -> list[int] | None:
    """The chips of a `shape` view (ids row-major) in row-major order over `new`, or None when
    no order considered keeps neighbours linked.

    ttnn's rule (`MeshDevice::reshape`): to a line (1xN or Nx1), the chips in a zigzag through
    the view (a line stays the line it is); to a grid, the chips' physical block in that shape
    or rotated (`SystemMesh::get_mapped_devices` tries the requested shape, then it rotated).
    """
    candidates: list[list[int]] = []
    if new[0] == 1 or new[1] == 1:
        candidates.append(list(ids) if shape[0] == 1 or shape[1] == 1 else _snake(shape, ids))
    else:
        if new == shape:
            candidates.append(list(ids))
        if new == (shape[1], shape[0]):  # the view rotated: new (r, c) is the view's (c, r)
            candidates.append([ids[c * shape[1] + r] for r in range(new[0]) for c in range(new[1])])
        block = _block(spec, ids)
        if block is not None:
            (r0, c0), (rows, cols) = block
            at = {physical(spec, i): i for i in ids}
            if new == (rows, cols):
                candidates.append([at[(r0 + r, c0 + c)] for r in range(rows) for c in range(cols)])
            if new == (cols, rows):
                candidates.append([at[(r0 + c, c0 + r)] for r in range(cols) for c in range(rows)])
    for order in candidates:
        if keeps_links(spec, new, order):
            return order
    return None
