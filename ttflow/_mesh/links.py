"""Links: the Ethernet links among a mesh view's chips as objects chunks cross, and the paths a
collective's algorithm takes over them.

A `Fabric` is made for one mesh view from facts only: the view's shape, each coordinate's chip
id, which chip ids share links (the system's `MeshSpec`) and the system's payload counters,
keyed by (from id, to id). `Fabric.link(a, b)` is one direction of the links between the chips
at coordinates a and b (neighbours in the view are always linked, see `topology.py`): a chunk
crosses it by `carry`, which copies the chunk (the chip on the far side holds bytes of its
own) and adds its payload bytes to the counter of that directed link. A chunk bound for a chip
further away crosses every link of its route, one hop after another, as the fabric's routers
forward it; it is counted on each.

What a collective's algorithm runs over:

- `group(coord, cluster_axis)`: the chips that differ from `coord` only in coordinate
  `cluster_axis` (0: its column, 1: its row), or every chip (None), in mesh-coordinate order
  (row-major): the order of a collective's results;
- `path(group)`: the group's chips in an order where each is linked to the next, and whether
  the last is linked to the first (a ring). A row or a column is its own path; the chips of a
  2-D view go in a zigzag (row 0 left to right, row 1 right to left, ...), tt-metal's
  `get_line_coordinates`: on a T3000's 2x4 that is 0 1 2 3 7 6 5 4, the ring of its ring
  collectives, whose ends (4 and 0) are linked;
- `route(a, b)`: the links of a shortest path from a to b (breadth-first over the view's links,
  each chip's neighbours in row-major order, so along the row first, then the column);
- `tree(root)`: the links of the breadth-first tree from `root` over the view, each chip
  reached by one link (a broadcast's multicast tree: each link carries the value once).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, final

import numpy as np

from .spec import Coord

__all__ = ["Fabric", "Link"]

Array = np.ndarray[Any, Any]

_COUNTING = threading.Lock()
"""Guards every payload counter: the chips of one submit (and of submeshes working at once)
carry chunks from their own worker threads."""


@final
class Link:
    """One direction of the links between two neighbouring chips of a view."""

    __slots__ = ("_counters", "_key", "source", "target")

    def __init__(self, source: Coord, target: Coord, key: tuple[int, int], counters: dict[tuple[int, int], int]) -> None:
        self.source = source
        self.target = target
        self._key = key
        self._counters = counters

    def carry(self, chunk: Array, nbytes: int) -> Array:
        """The chunk as it arrives on the far side: a copy, its `nbytes` of payload counted."""
        arrived = np.array(chunk, copy=True)
        with _COUNTING:
            self._counters[self._key] += nbytes
        return arrived

    def __repr__(self) -> str:
        return f"<Link {self.source} -> {self.target}>"


@final
class Fabric:
    """The links among the chips of one mesh view, and the paths collectives take over them."""

    __slots__ = ("_links", "_neighbours", "_routes", "coords", "ids", "shape")

    def __init__(self, shape: Coord, ids: Sequence[int], linked: Callable[[int, int], bool],
                 counters: dict[tuple[int, int], int]) -> None:
        rows, cols = shape
        self.shape = shape
        self.coords: list[Coord] = [(r, c) for r in range(rows) for c in range(cols)]
        chip = self.ids = dict(zip(self.coords, ids))  # each coordinate's chip id in the system
        self._links: dict[tuple[Coord, Coord], Link] = {}
        for a in self.coords:
            for b in self.coords:
                if a != b and linked(chip[a], chip[b]):
                    key = (chip[a], chip[b])
                    counters.setdefault(key, 0)
                    self._links[a, b] = Link(a, b, key, counters)
        self._neighbours = {a: [b for b in self.coords if (a, b) in self._links] for a in self.coords}
        self._routes: dict[tuple[Coord, Coord], list[Link]] = {}

    def link(self, a: Coord, b: Coord) -> Link:
        return self._links[a, b]

    @property
    def links(self) -> list[Link]:
        return list(self._links.values())

    def group(self, coord: Coord, cluster_axis: int | None) -> tuple[Coord, ...]:
        """The chips of `coord`'s group in mesh-coordinate order (see the module's docstring)."""
        if cluster_axis is None:
            return tuple(self.coords)
        return tuple(c for c in self.coords if all(c[a] == coord[a] for a in (0, 1) if a != cluster_axis))

    def path(self, group: Sequence[Coord]) -> tuple[list[Coord], bool]:
        """The group's chips in linked order, and whether the ends are linked too (a ring of
        more than two chips)."""
        rows = {r for r, _ in group}
        if len(rows) > 1 and len({c for _, c in group}) > 1:  # a 2-D group: a zigzag
            path: list[Coord] = []
            for k, row in enumerate(sorted(rows)):
                line = sorted(c for c in group if c[0] == row)
                path += line if k % 2 == 0 else line[::-1]
        else:
            path = list(group)
        ring = len(path) > 2 and (path[-1], path[0]) in self._links
        return path, ring

    def route(self, a: Coord, b: Coord) -> list[Link]:
        """The links of the shortest path from a to b (row first; see the module's docstring)."""
        route = self._routes.get((a, b))
        if route is None:
            parent = self._search(a)
            hops = []
            at = b
            while at != a:
                hops.append(self._links[parent[at], at])
                at = parent[at]
            route = self._routes[a, b] = hops[::-1]
        return route

    def tree(self, root: Coord) -> list[Link]:
        """The links of the breadth-first tree from `root`, parents before children."""
        parent = self._search(root)  # in the order the search reached them: by depth
        return [self._links[parent[c], c] for c in parent if c != root]

    def _search(self, root: Coord) -> dict[Coord, Coord]:
        """Each chip's parent on the breadth-first tree from `root` (the root its own)."""
        parent = {root: root}
        todo = deque([root])
        while todo:
            here = todo.popleft()
            for there in self._neighbours[here]:
                if there not in parent:
                    parent[there] = here
                    todo.append(there)
        return parent
