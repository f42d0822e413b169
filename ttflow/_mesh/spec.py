"""MeshSpec: a system of chips and the Ethernet links between them, as facts in fields.

Each chip is a full `DeviceSpec` (its own banks, allocators, CQ0 and CQ1). Chips sit on a 2-D
grid (rows, cols), row-major; a chip is linked to the chips next to it in its row and its
column, and, where `topology` is "ring", the first and last chips of a row (or a column) of
more than two chips are linked too (wrap-around). The link facts (rate, hop latency, ports,
links per neighbour pair) are fields, so a collective's model reads them, never a constant.
Sources: tt-metal's `tech_reports/EthernetMultichip/BasicEthernetGuide.md` and
`tech_reports/Programming Mesh of Devices/Programming Mesh of Devices with TT-NN.md`.
"""

from __future__ import annotations

import operator
from typing import Any, final

import attrs

from .._errors import ShapeError
from .._types import DeviceSpec

__all__ = ["TOPOLOGIES", "MeshSpec", "check_mesh_shape"]

TOPOLOGIES = ("line", "ring")
"""How the ends of a row or column are joined: "line" (not at all) or "ring" (wrap-around)."""

Coord = tuple[int, int]


def check_mesh_shape(shape: Any, what: str = "a mesh shape") -> tuple[int, int]:
    """`shape` as (rows, cols) of positive ints; ShapeError otherwise."""
    try:
        items = tuple(shape)
        dims = tuple(operator.index(d) for d in items if not isinstance(d, bool))
    except TypeError:
        raise ShapeError(f"{what} is (rows, cols), two positive ints; got {shape!r:.60}") from None
    if len(items) != 2 or len(dims) != 2 or min(dims) < 1:
        raise ShapeError(f"{what} is (rows, cols), two positive ints; got {shape!r:.60}")
    return dims[0], dims[1]


def _positive_int(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"MeshSpec.{attribute.name} must be a positive int, got {value!r}")


def _count(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"MeshSpec.{attribute.name} must be an int >= 0, got {value!r}")


def _positive_number(instance: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(f"MeshSpec.{attribute.name} must be a positive number, got {value!r}")


def _topology(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in TOPOLOGIES:
        raise ValueError(f"MeshSpec.topology must be one of {TOPOLOGIES}, got {value!r}")


@final
@attrs.frozen
class MeshSpec:
    """The shape of an emulated multi-chip system. Use a preset, or give any (rows, cols).

    - `shape`: (rows, cols) of chips; chip ids are row-major.
    - `chip`: every chip's `DeviceSpec` (default: a Wormhole n150's).
    - `topology`: "line" or "ring" (the ends of each row and column of more than two chips are
      linked as well).
    - `link_bytes_per_second`: one Ethernet link, one direction (Wormhole: 12.5 GB/s, about 96%
      of it payload after framing); `hop_seconds`: the latency of one hop (711 ns on Wormhole).
    - `ports_per_chip`: Ethernet ports of a chip (16 on Wormhole).
    - `links_per_pair`: links between two neighbouring chips that collectives may use;
      `dispatch_links_per_pair`: links of a pair kept for dispatch (n300: one of its two).
    """

    shape: tuple[int, int] = attrs.field(converter=lambda s: check_mesh_shape(s, "MeshSpec.shape"))
    chip: DeviceSpec = attrs.field(factory=DeviceSpec, validator=attrs.validators.instance_of(DeviceSpec))
    topology: str = attrs.field(default="line", validator=_topology)
    link_bytes_per_second: float = attrs.field(default=12.5e9, validator=_positive_number)
    hop_seconds: float = attrs.field(default=711e-9, validator=_positive_number)
    ports_per_chip: int = attrs.field(default=16, validator=_positive_int)
    links_per_pair: int = attrs.field(default=1, validator=_positive_int)
    dispatch_links_per_pair: int = attrs.field(default=0, validator=_count)
    name: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    def __attrs_post_init__(self) -> None:
        ports = self.max_neighbours * (self.links_per_pair + self.dispatch_links_per_pair)
        if ports > self.ports_per_chip:
            raise ValueError(
                f"a {self.shape[0]}x{self.shape[1]} {self.topology} mesh gives a chip "
                f"{self.max_neighbours} neighbours, each joined by "
                f"{self.links_per_pair + self.dispatch_links_per_pair} links: {ports} Ethernet ports, "
                f"more than the chip's {self.ports_per_chip}"
            )

    @property
    def num_chips(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def label(self) -> str:
        """The preset's name, or "RxC"."""
        return self.name or f"{self.shape[0]}x{self.shape[1]}"

    def wraps(self, axis: int) -> bool:
        """Whether the ends of each line along `axis` (0: columns, 1: rows) are linked."""
        return self.topology == "ring" and self.shape[axis] > 2

    @property
    def max_neighbours(self) -> int:
        """The most neighbours any chip has (an interior chip's)."""
        return sum(2 if self.wraps(axis) else min(n - 1, 2) for axis, n in enumerate(self.shape))

    def linked(self, a: Coord, b: Coord) -> bool:
        """Whether the chips at physical coordinates `a` and `b` share links."""
        (ra, ca), (rb, cb) = a, b
        if ra == rb:
            return _adjacent(ca, cb, self.shape[1], self.wraps(1))
        if ca == cb:
            return _adjacent(ra, rb, self.shape[0], self.wraps(0))
        return False

    # -- presets ------------------------------------------------------------------------------

    @classmethod
    def n300(cls) -> MeshSpec:
        """One n300 card: two Wormhole chips (1x2) joined by two links, one of them kept for
        dispatch (the host reaches the right chip over it), so collectives get one."""
        return cls((1, 2), links_per_pair=1, dispatch_links_per_pair=1, name="n300")

    @classmethod
    def t3000(cls) -> MeshSpec:
        """T3000: four n300 cards, eight chips in a 2x4 grid, two links between neighbours.

        A line topology: the ends of a row of four are not linked, so no ring runs along a row.
        The eight chips do form a ring, around the grid's edge (0 1 2 3 7 6 5 4, the ring of
        ttnn's ring all-gather on a T3000): reshape the mesh to 1x8 and its ends are linked."""
        return cls((2, 4), links_per_pair=2, name="t3000")

    @classmethod
    def galaxy(cls) -> MeshSpec:
        """Galaxy: 32 Wormhole chips in a 4x8 grid, four links between neighbours (an interior
        chip uses all 16 ports). A line topology, as ttnn's TG mesh; a 6U Galaxy's wrap-around
        links are `attrs.evolve(MeshSpec.galaxy(), topology="ring")`."""
        return cls((4, 8), links_per_pair=4, name="galaxy")


def _adjacent(i: int, j: int, n: int, wraps: bool) -> bool:
    gap = abs(i - j)
    return gap == 1 or (wraps and gap == n - 1)
