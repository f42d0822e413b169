"""The system descriptor (`.ttsys`): the chip tt-mlir plans its programs against, written for the
device ttflow emulates, and read back (ttflow's own files and the ones real hardware made).

tt-mlir's compiler never asks a chip anything: it reads a system descriptor, a size-prefixed
flatbuffer (file identifier "TTSY") that `ttrt query --save-artifacts` writes on a machine with a
chip, and sizes its L1 budgets, DRAM interleaving, grids and multi-chip meshes from it. For a
binary that ttflow then runs, the descriptor must describe ttflow's device, not a real one:
`system_desc(tt.DeviceSpec())` describes ttflow's n150 (the L1 bank ttflow allocates in from
address 0, its DRAM banks, its alignments, its dtypes), `system_desc(tt.MeshSpec.t3000())` its
eight chips and their links. Facts ttflow does not model (NOC coordinate offsets, Ethernet
cores' L1, the DST register) are the real chip's, from hardware-made descriptors.
docs/compiler.md compares every field with a hardware-made descriptor and says which is right.

The layout is tt-mlir's `SystemDescRoot` as the `jax-tt-plugin==0.1.3` compiler reads it
(`include/ttmlir/Target/Common/{system_desc,types}.fbs` from 2026-04-28 on, 22 `ChipDesc` fields):
each table's fields are listed below in schema order (a field's slot is its index), and written
with `flatbuffers.Builder`.
The compiler refuses a file whose `schema_hash` is not the one it was built with; the reader
refuses a file it cannot walk (BinaryFormatError, naming the offset and field), never a bare
IndexError.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar, final

import attrs
import flatbuffers

import ttflow as tt
from ttflow import BinaryFormatError, DataType, DeviceSpec, FileError
from ttflow._types import TILE

__all__ = ["SCHEMA_HASH", "ChipChannel", "ChipCoord", "ChipDesc", "CpuDesc", "SystemDesc", "system_desc"]

SCHEMA_HASH = "f0b54f1568f8f39c9910f4e652cd40fa551fdb1bf4172fab3710429031c23159"
"""The schema hash the `jax-tt-plugin==0.1.3` compiler was built with: it refuses any other."""

FILE_IDENTIFIER = b"TTSY"

# tt-mlir's enums, by their numbers in the schema.
ARCHS = ("Wormhole_b0", "Blackhole", "Quasar")
DATA_TYPES = ("Float32", "Float16", "BFloat16", "BFP_Float8", "BFP_BFloat8", "BFP_Float4",
              "BFP_BFloat4", "BFP_Float2", "BFP_BFloat2", "UInt32", "UInt16", "UInt8", "Int32",
              "Float64", "Int64", "UInt64", "Int16", "Int8", "Bool")
CPU_ROLES = ("Host", "Device")
HOST_MMIO = 1
"""`ChipCapability.HostMMIO`: the host reaches the chip over PCIe, not over another chip's links."""

_TT_DATA_TYPES = {DataType.FLOAT32: "Float32", DataType.BFLOAT16: "BFloat16",
                  DataType.BFLOAT8_B: "BFP_BFloat8", DataType.UINT32: "UInt32", DataType.INT32: "Int32"}
"""ttflow's dtypes under tt-mlir's names: what a ttflow chip holds (`supported_data_types`)."""

Coord = tuple[int, int]
"""(y, x), tt-mlir's `Dim2d` order."""


# -- the values -------------------------------------------------------------------------------


def _uint(bits: int) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    top = (1 << bits) - 1

    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= top:
            raise ValueError(f"{type(instance).__name__}.{attribute.name} is a uint{bits} "
                             f"(0 to {top}), got {value!r}")
    return check


def _int32(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 31) <= value < 1 << 31


def _coord(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not (isinstance(value, tuple) and len(value) == 2 and all(map(_int32, value))):
        raise ValueError(f"{type(instance).__name__}.{attribute.name} is (y, x), two int32s; got {value!r}")


def _coords(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    for item in value:
        _coord(instance, attribute, item)


def _member_of(names: Sequence[str]) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        items = value if isinstance(value, tuple) else (value,)
        bad = [v for v in items if v not in names]
        if bad:
            raise ValueError(f"{type(instance).__name__}.{attribute.name}: {bad[0]!r} is not one "
                             f"of tt-mlir's {', '.join(names)}")
    return check


def _tuple(value: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(value)


def _tuples(value: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)


_u32, _u64, _u16 = _uint(32), _uint(64), _uint(16)


@final
@attrs.frozen
class CpuDesc:
    """A CPU of the system: the host, which runs the ops the compiler hoists off the chip."""

    role: str = attrs.field(default="Host", validator=_member_of(CPU_ROLES))
    target_triple: str = attrs.field(default="x86_64-pc-linux", validator=attrs.validators.instance_of(str))


@final
@attrs.frozen
class ChipDesc:
    """One chip, as tt-mlir's `ChipDesc` table has it (the same names; (y, x) pairs).

    The compiler's L1 budget is `l1_size - l1_unreserved_base` (`usable_l1_size`) per core, its
    DRAM one `dram_unreserved_end - dram_unreserved_base` per channel."""

    arch: str = attrs.field(validator=_member_of(ARCHS))
    grid_size: Coord = attrs.field(converter=_tuple, validator=_coord)
    coord_translation_offsets: Coord = attrs.field(converter=_tuple, validator=_coord)
    l1_size: int = attrs.field(validator=_u64)
    num_dram_channels: int = attrs.field(validator=_u32)
    dram_channel_size: int = attrs.field(validator=_u64)
    noc_l1_address_align_bytes: int = attrs.field(validator=_u32)
    pcie_address_align_bytes: int = attrs.field(validator=_u32)
    noc_dram_address_align_bytes: int = attrs.field(validator=_u32)
    l1_unreserved_base: int = attrs.field(validator=_u32)
    erisc_l1_unreserved_base: int = attrs.field(validator=_u32)
    dram_unreserved_base: int = attrs.field(validator=_u32)
    dram_unreserved_end: int = attrs.field(validator=_u32)
    supported_data_types: tuple[str, ...] = attrs.field(converter=_tuple, validator=_member_of(DATA_TYPES))
    supported_tile_sizes: tuple[Coord, ...] = attrs.field(converter=_tuples, validator=_coords)
    dst_physical_size_tiles: int = attrs.field(validator=_u32)
    num_cbs: int = attrs.field(validator=_u32)
    num_compute_threads: int = attrs.field(validator=_u32)
    num_datamovement_threads: int = attrs.field(validator=_u32)
    dram_grid_size: Coord = attrs.field(converter=_tuple, validator=_coord)
    dram_bank_to_logical_worker_noc0: tuple[Coord, ...] = attrs.field(converter=_tuples, validator=_coords)
    dram_bank_to_logical_worker_noc1: tuple[Coord, ...] = attrs.field(converter=_tuples, validator=_coords)

    @property
    def usable_l1_size(self) -> int:
        """L1 bytes per core the compiler may plan for."""
        return self.l1_size - self.l1_unreserved_base

    @property
    def usable_dram_channel_size(self) -> int:
        """DRAM bytes per channel the compiler may plan for."""
        return self.dram_unreserved_end - self.dram_unreserved_base


@final
@attrs.frozen
class ChipCoord:
    """Where a chip sits: rack, shelf, then (y, x) on the shelf's grid."""

    rack: int = attrs.field(default=0, validator=_u32)
    shelf: int = attrs.field(default=0, validator=_u32)
    y: int = attrs.field(default=0, validator=_u32)
    x: int = attrs.field(default=0, validator=_u32)


@final
@attrs.frozen
class ChipChannel:
    """One Ethernet link: chip `device_id0`'s Ethernet core `ethernet_core_coord0` to chip
    `device_id1`'s (logical Ethernet core coordinates, (y, x): y is the channel, x is 0)."""

    device_id0: int = attrs.field(validator=_u32)
    ethernet_core_coord0: Coord = attrs.field(converter=_tuple, validator=_coord)
    device_id1: int = attrs.field(validator=_u32)
    ethernet_core_coord1: Coord = attrs.field(converter=_tuple, validator=_coord)


def _each(kind: type) -> Callable[[Any, attrs.Attribute[Any], Any], None]:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        for item in value:
            if not isinstance(item, kind):
                raise TypeError(f"SystemDesc.{attribute.name} holds {kind.__name__}s, got {item!r:.60}")
    return check


def _version(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if len(value) != 3:
        raise ValueError(f"SystemDesc.version is (major, minor, patch), got {value!r}")
    for check, part in zip((_u16, _u16, _u32), value, strict=True):
        check(instance, attribute, part)


@final
@attrs.frozen
class SystemDesc:
    """A system descriptor: the chips of a system, their links and the host, as tt-mlir reads it.

    `system_desc(spec)` makes the one of a ttflow device; `SystemDesc.load(path)` reads any
    `.ttsys`. Fields are tt-mlir's (`SystemDescRoot` and `SystemDesc`, the chip tables as
    `ChipDesc`); `chips` is each chip's `ChipDesc` (`chip_descs[chip_desc_indices[i]]`), and
    `grid_size`, `l1_size`, `num_dram_channels`, `dram_channel_size`, `arch` read chip 0's.
    `to_bytes()`/`save(path)` write the file; reading it back gives an equal `SystemDesc`."""

    chip_descs: tuple[ChipDesc, ...] = attrs.field(converter=_tuple, validator=_each(ChipDesc))
    chip_desc_indices: tuple[int, ...] = attrs.field(converter=_tuple)
    chip_capabilities: tuple[int, ...] = attrs.field(converter=_tuple)
    chip_coords: tuple[ChipCoord, ...] = attrs.field(converter=_tuple, validator=_each(ChipCoord))
    chip_channels: tuple[ChipChannel, ...] = attrs.field(converter=_tuple, validator=_each(ChipChannel))
    cpu_descs: tuple[CpuDesc, ...] = attrs.field(default=(CpuDesc(),), converter=_tuple, validator=_each(CpuDesc))
    version: tuple[int, int, int] = attrs.field(default=(0, 0, 0), converter=_tuple, validator=_version)
    schema_hash: str = attrs.field(default=SCHEMA_HASH, validator=attrs.validators.instance_of(str))
    ttmlir_git_hash: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    product_identifier: str = attrs.field(default="", validator=attrs.validators.instance_of(str))

    @chip_desc_indices.validator
    def _check_indices(self, attribute: attrs.Attribute[Any], value: tuple[int, ...]) -> None:
        for index in value:
            _u32(self, attribute, index)
            if index >= len(self.chip_descs):
                raise ValueError(f"SystemDesc.chip_desc_indices: {index} is past the "
                                 f"{len(self.chip_descs)} chip_descs")

    @chip_capabilities.validator
    def _check_capabilities(self, attribute: attrs.Attribute[Any], value: tuple[int, ...]) -> None:
        for flags in value:
            _u32(self, attribute, flags)

    @property
    def chips(self) -> tuple[ChipDesc, ...]:
        """Each chip's description, by chip id."""
        return tuple(self.chip_descs[i] for i in self.chip_desc_indices)

    @property
    def num_chips(self) -> int:
        return len(self.chip_desc_indices)

    @property
    def mmio_chips(self) -> tuple[int, ...]:
        """The chips the host reaches over PCIe (the rest over other chips' Ethernet links)."""
        return tuple(i for i, flags in enumerate(self.chip_capabilities) if flags & HOST_MMIO)

    def _chip0(self) -> ChipDesc:
        if not self.chip_desc_indices:
            raise ValueError("this system descriptor describes no chip")
        return self.chips[0]

    @property
    def arch(self) -> str:
        return self._chip0().arch

    @property
    def grid_size(self) -> Coord:
        """Chip 0's worker grid, (y, x)."""
        return self._chip0().grid_size

    @property
    def l1_size(self) -> int:
        return self._chip0().l1_size

    @property
    def num_dram_channels(self) -> int:
        return self._chip0().num_dram_channels

    @property
    def dram_channel_size(self) -> int:
        return self._chip0().dram_channel_size

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready data (lists for tuples), as `ttflow query --json` prints it."""
        return attrs.asdict(self)

    def summary(self) -> str:
        """A line per distinct chip: its arch, grid and memory as the compiler will plan for."""
        lines = [(f"{self.product_identifier or 'a system descriptor'}: {self.num_chips} chip"
                  f"{'' if self.num_chips == 1 else 's'}, {len(self.chip_channels)} Ethernet links, "
                  f"host MMIO on chips {list(self.mmio_chips)}")]
        groups: dict[ChipDesc, list[int]] = {}
        for chip_id, chip in enumerate(self.chips):
            groups.setdefault(chip, []).append(chip_id)
        for chip, ids in groups.items():
            lines.append(
                f"  chip{'' if len(ids) == 1 else 's'} {', '.join(map(str, ids))}: {chip.arch}, "
                f"worker grid {chip.grid_size[0]}x{chip.grid_size[1]}, L1 {chip.usable_l1_size} of "
                f"{chip.l1_size} bytes per core usable, {chip.num_dram_channels} DRAM channels of "
                f"{chip.dram_channel_size} bytes ({chip.usable_dram_channel_size} usable), "
                f"dtypes {', '.join(chip.supported_data_types)}")
        return "\n".join(lines)

    def to_bytes(self) -> bytes:
        """The `.ttsys` file's bytes: a size-prefixed flatbuffer, file identifier "TTSY"."""
        return _write(self)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Writes the file (ttrt names it `system_desc.ttsys`) and returns its path. A path that
        cannot be written is a FileError (also an OSError) naming it."""
        data = self.to_bytes()
        try:
            with open(path, "wb") as f:
                f.write(data)
        except OSError as exc:
            raise FileError.of(exc, "save the system descriptor to", path, writing=True,
                               example="system_desc.ttsys") from exc
        return Path(path)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, name: str = "the system descriptor") -> SystemDesc:
        """Reads a `.ttsys` file's bytes; BinaryFormatError (naming the offset and the field) for
        bytes that are not a whole system descriptor."""
        return _Reader(bytes(data), name).read()

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SystemDesc:
        """Reads a `.ttsys` file (ttflow's or one real hardware made). FileError (also an
        OSError) for a path that cannot be read, BinaryFormatError for a file that is not one."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise FileError.of(exc, "load a system descriptor from", path, writing=False) from exc
        return cls.from_bytes(data, repr(os.fspath(path)))


# -- the descriptor of a ttflow device ----------------------------------------------------------


@final
@attrs.frozen
class _ArchFacts:
    """What ttflow does not model, as the real chip reports it (tt-xla's n150 and p150
    descriptors, made on hardware)."""

    arch: str
    coord_translation_offsets: Coord
    pcie_address_align_bytes: int
    erisc_l1_unreserved_base: int
    dram_bank_to_logical_worker: tuple[Coord, ...]
    dst_physical_size_tiles: int = 16
    num_cbs: int = 64
    num_compute_threads: int = 1
    num_datamovement_threads: int = 2


_WORMHOLE = _ArchFacts(
    "Wormhole_b0", (18, 18), 32, 98304,
    ((7, 3), (0, 0), (4, 0), (5, 0), (0, 4), (3, 7), (1, 4), (7, 4), (6, 4), (2, 4), (4, 4), (5, 4)))
_BLACKHOLE = _ArchFacts(
    "Blackhole", (2, 1), 64, 87872,
    ((9, 0), (0, 0), (7, 0), (3, 0), (9, 6), (1, 6), (6, 6), (4, 6)))


def _arch_facts(spec: DeviceSpec) -> _ArchFacts:
    """The chip a spec emulates, by its name: "blackhole..." is a Blackhole, anything else (the
    n150 and the test devices) a Wormhole."""
    return _BLACKHOLE if spec.name.lower().startswith("blackhole") else _WORMHOLE


def _bank_workers(spec: DeviceSpec, facts: _ArchFacts) -> tuple[Coord, ...]:
    """The worker core that reads each DRAM bank best: the real chip's assignment when the spec
    has its banks and its grid holds those cores; else cores spread evenly over the grid, row
    by row (ttflow's cores are equally far from every bank)."""
    rows, cols = spec.worker_grid
    table = facts.dram_bank_to_logical_worker
    if len(table) == spec.dram_banks and all(y < rows and x < cols for y, x in table):
        return table
    cores = rows * cols
    return tuple(divmod(bank * cores // spec.dram_banks % cores, cols) for bank in range(spec.dram_banks))


def _chip_desc(spec: DeviceSpec, l1_small_size: int = 0, trace_region_size: int = 0) -> ChipDesc:
    """A chip as ttflow emulates it. ttflow's allocators own whole banks from address 0 (L1's
    CBs at the bottom and tensors top-down, DRAM bottom-up), less what `open_device` keeps at
    the top (`l1_small_size` of L1, `trace_region_size` of DRAM)."""
    facts = _arch_facts(spec)
    dram_end = spec.dram_bank_bytes - trace_region_size
    if dram_end >= 1 << 32:
        raise ValueError(
            f"a DRAM bank of {spec.dram_bank_bytes} bytes cannot be described: tt-mlir's "
            "dram_unreserved_end is 32-bit (at most 4 GiB - 1 per channel); use a smaller "
            "dram_bank_bytes, or open the device with a trace_region_size that brings the end below")
    workers = _bank_workers(spec, facts)
    return ChipDesc(
        arch=facts.arch,
        grid_size=spec.worker_grid,
        coord_translation_offsets=facts.coord_translation_offsets,
        l1_size=spec.l1_bank_bytes - l1_small_size,
        num_dram_channels=spec.dram_banks,
        dram_channel_size=spec.dram_bank_bytes,
        noc_l1_address_align_bytes=spec.l1_alignment,
        pcie_address_align_bytes=facts.pcie_address_align_bytes,
        noc_dram_address_align_bytes=spec.dram_alignment,
        l1_unreserved_base=0,
        erisc_l1_unreserved_base=facts.erisc_l1_unreserved_base,
        dram_unreserved_base=0,
        dram_unreserved_end=dram_end,
        supported_data_types=tuple(_TT_DATA_TYPES[dtype] for dtype in DataType),
        supported_tile_sizes=((TILE, TILE),),
        dst_physical_size_tiles=facts.dst_physical_size_tiles,
        num_cbs=facts.num_cbs,
        num_compute_threads=facts.num_compute_threads,
        num_datamovement_threads=facts.num_datamovement_threads,
        dram_grid_size=(1, spec.dram_banks),
        dram_bank_to_logical_worker_noc0=workers,
        dram_bank_to_logical_worker_noc1=workers,
    )


def _channels(mesh: tt.MeshSpec) -> tuple[ChipChannel, ...]:
    """`links_per_pair` links between each pair of linked chips (the links collectives use: a
    link kept for dispatch is not listed, as tt-metal lists only active Ethernet cores), each
    link on the next free Ethernet channel of both chips (`MeshSpec` checks that a chip's
    links fit its `ports_per_chip`)."""
    rows, cols = mesh.shape
    coords = [(r, c) for r in range(rows) for c in range(cols)]
    next_channel = [0] * len(coords)
    channels = []
    for a, ca in enumerate(coords):
        for b in range(a + 1, len(coords)):
            if not mesh.linked(ca, coords[b]):
                continue
            for _ in range(mesh.links_per_pair):
                channels.append(ChipChannel(a, (next_channel[a], 0), b, (next_channel[b], 0)))
                next_channel[a] += 1
                next_channel[b] += 1
    return tuple(channels)


def _capabilities(mesh: tt.MeshSpec) -> tuple[int, ...]:
    """Which chips the host reaches over PCIe. A mesh that keeps links for dispatch
    (`dispatch_links_per_pair`, the n300's) is made of n300 cards along its rows: a card's
    second chip is reached over its first chip's link. Otherwise ttflow's host writes every
    chip's banks itself: every chip is HostMMIO."""
    cols = mesh.shape[1]
    tunnelled = mesh.dispatch_links_per_pair > 0
    return tuple(0 if tunnelled and chip % cols % 2 else HOST_MMIO for chip in range(mesh.num_chips))


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _describe(mesh: tt.MeshSpec, l1_small_size: int, trace_region_size: int, label: str) -> SystemDesc:
    spec = mesh.chip  # the reserved tops as the device's allocators round them (banks.py)
    chip = _chip_desc(spec, _round_up(l1_small_size, spec.l1_alignment),
                      _round_up(trace_region_size, spec.dram_alignment))
    rows, cols = mesh.shape
    return SystemDesc(
        chip_descs=(chip,) * mesh.num_chips,
        chip_desc_indices=tuple(range(mesh.num_chips)),
        chip_capabilities=_capabilities(mesh),
        chip_coords=tuple(ChipCoord(0, 0, r, c) for r in range(rows) for c in range(cols)),
        chip_channels=_channels(mesh),
        product_identifier=f"ttflow {tt.__version__} emulated {label}",
    )


def system_desc(spec_or_device: DeviceSpec | tt.MeshSpec | tt.Device | tt.MeshDevice) -> SystemDesc:
    """The system descriptor of a ttflow device: what tt-mlir must plan for so that ttflow can
    run the binary it makes.

    Takes a `DeviceSpec` (one chip), a `MeshSpec` (its chips, row-major ids, and its links), an
    open `Device` or `MeshDevice` (its spec, and what `open_device` keeps at the top of the
    banks: `l1_small_size` comes off `l1_size`, `trace_region_size` off `dram_unreserved_end`;
    a submesh is described as a system of its own shape). ValueError for a spec the format
    cannot hold (a DRAM bank of 4 GiB or more)."""
    if isinstance(spec_or_device, DeviceSpec):
        return _describe(tt.MeshSpec((1, 1), chip=spec_or_device), 0, 0, spec_or_device.name)
    if isinstance(spec_or_device, tt.MeshSpec):
        return _describe(spec_or_device, 0, 0, f"{spec_or_device.label} of {spec_or_device.chip.name}")
    if isinstance(spec_or_device, tt.Device):
        options = spec_or_device.options
        return _describe(tt.MeshSpec((1, 1), chip=spec_or_device.spec), options.l1_small_size,
                         options.trace_region_size or 0, spec_or_device.spec.name)
    if isinstance(spec_or_device, tt.MeshDevice):
        mesh = spec_or_device.spec
        if mesh.shape != spec_or_device.shape:
            mesh = attrs.evolve(mesh, shape=spec_or_device.shape, name="")
        options = spec_or_device.chips[0].options
        return _describe(mesh, options.l1_small_size, options.trace_region_size or 0,
                         f"{mesh.label} of {mesh.chip.name}")
    raise TypeError(f"system_desc takes a tt.DeviceSpec, tt.MeshSpec, tt.Device or tt.MeshDevice, "
                    f"got {type(spec_or_device).__name__}")


# -- writing ----------------------------------------------------------------------------------
# Each table's fields in schema order: the slot is the index. The flatbuffer is built from the
# leaves up (a table's strings, vectors and subtables before the table itself).

_ROOT_FIELDS = ("version", "schema_hash", "ttmlir_git_hash", "product_identifier", "system_desc")
_SYSTEM_FIELDS = ("cpu_descs", "chip_descs", "chip_desc_indices", "chip_capabilities",
                  "chip_coords", "chip_channels")
_CPU_FIELDS = ("role", "target_triple")
_CHIP_LAYOUT = (
    ("arch", "arch"), ("grid_size", "coord"), ("coord_translation_offsets", "coord"),
    ("l1_size", "<Q"), ("num_dram_channels", "<I"), ("dram_channel_size", "<Q"),
    ("noc_l1_address_align_bytes", "<I"), ("pcie_address_align_bytes", "<I"),
    ("noc_dram_address_align_bytes", "<I"), ("l1_unreserved_base", "<I"),
    ("erisc_l1_unreserved_base", "<I"), ("dram_unreserved_base", "<I"),
    ("dram_unreserved_end", "<I"), ("supported_data_types", "dtypes"),
    ("supported_tile_sizes", "coords"), ("dst_physical_size_tiles", "<I"), ("num_cbs", "<I"),
    ("num_compute_threads", "<I"), ("num_datamovement_threads", "<I"),
    ("dram_grid_size", "coord"), ("dram_bank_to_logical_worker_noc0", "coords"),
    ("dram_bank_to_logical_worker_noc1", "coords"),
)
"""`ChipDesc`'s fields as (name, kind), slot by slot: "<I"/"<Q" a uint32/uint64, "coord" a
`Dim2d` struct inline, "coords" a vector of them, "dtypes" a vector of uint16 `DataType`s,
"arch" the uint32 `Arch`."""


def _prepend_coord(b: flatbuffers.Builder, coord: Coord) -> int:
    b.Prep(4, 8)
    b.PrependInt32(coord[1])  # x: the builder writes backwards, so a struct's last field first
    b.PrependInt32(coord[0])  # y
    return int(b.Offset())


def _coord_vector(b: flatbuffers.Builder, coords: Sequence[Coord]) -> int:
    b.StartVector(8, len(coords), 4)
    for coord in reversed(coords):
        b.PrependInt32(coord[1])
        b.PrependInt32(coord[0])
    return int(b.EndVector())


T = TypeVar("T")


def _vector(b: flatbuffers.Builder, size: int, items: Sequence[T], prepend: Callable[[T], None]) -> int:
    b.StartVector(size, len(items), size)
    for item in reversed(items):
        prepend(item)
    return int(b.EndVector())


def _write_chip(b: flatbuffers.Builder, chip: ChipDesc) -> int:
    vectors = {}
    for name, kind in _CHIP_LAYOUT:
        if kind == "coords":
            vectors[name] = _coord_vector(b, getattr(chip, name))
        elif kind == "dtypes":
            codes = [DATA_TYPES.index(d) for d in chip.supported_data_types]
            vectors[name] = _vector(b, 2, codes, b.PrependUint16)
    b.StartObject(len(_CHIP_LAYOUT))
    for slot, (name, kind) in enumerate(_CHIP_LAYOUT):
        if kind == "<Q":
            b.PrependUint64Slot(slot, getattr(chip, name), 0)
        elif kind == "<I":
            b.PrependUint32Slot(slot, getattr(chip, name), 0)
        elif kind == "arch":
            b.PrependUint32Slot(slot, ARCHS.index(chip.arch), 0)
        elif name in vectors:
            b.PrependUOffsetTRelativeSlot(slot, vectors[name], 0)
    # Structs are written inline, each just before its slot; always, even when zero (tt-mlir
    # reads them without a null check).
    for slot, (name, kind) in enumerate(_CHIP_LAYOUT):
        if kind == "coord":
            b.PrependStructSlot(slot, _prepend_coord(b, getattr(chip, name)), 0)
    return int(b.EndObject())


def _write(desc: SystemDesc) -> bytes:
    b = flatbuffers.Builder(1024)
    cpus = []
    for cpu in desc.cpu_descs:
        triple = b.CreateString(cpu.target_triple)
        b.StartObject(len(_CPU_FIELDS))
        b.PrependUOffsetTRelativeSlot(1, triple, 0)
        b.PrependUint8Slot(0, CPU_ROLES.index(cpu.role), 0)
        cpus.append(int(b.EndObject()))
    chips = [_write_chip(b, chip) for chip in desc.chip_descs]
    vectors = [
        _vector(b, 4, cpus, b.PrependUOffsetTRelative),
        _vector(b, 4, chips, b.PrependUOffsetTRelative),
        _vector(b, 4, desc.chip_desc_indices, b.PrependUint32),
        _vector(b, 4, desc.chip_capabilities, b.PrependUint32),
    ]
    b.StartVector(16, len(desc.chip_coords), 4)
    for coord in reversed(desc.chip_coords):
        for part in (coord.x, coord.y, coord.shelf, coord.rack):
            b.PrependUint32(part)
    vectors.append(int(b.EndVector()))
    b.StartVector(24, len(desc.chip_channels), 4)
    for ch in reversed(desc.chip_channels):
        b.PrependInt32(ch.ethernet_core_coord1[1])
        b.PrependInt32(ch.ethernet_core_coord1[0])
        b.PrependUint32(ch.device_id1)
        b.PrependInt32(ch.ethernet_core_coord0[1])
        b.PrependInt32(ch.ethernet_core_coord0[0])
        b.PrependUint32(ch.device_id0)
    vectors.append(int(b.EndVector()))
    b.StartObject(len(_SYSTEM_FIELDS))
    for slot, vector in enumerate(vectors):
        b.PrependUOffsetTRelativeSlot(slot, vector, 0)
    system = int(b.EndObject())
    strings = [b.CreateString(s) for s in (desc.schema_hash, desc.ttmlir_git_hash, desc.product_identifier)]
    b.StartObject(len(_ROOT_FIELDS))
    b.PrependUOffsetTRelativeSlot(4, system, 0)
    for slot, string in zip((1, 2, 3), strings, strict=True):
        b.PrependUOffsetTRelativeSlot(slot, string, 0)
    major, minor, patch = desc.version
    b.Prep(4, 8)
    b.PrependUint32(patch)
    b.PrependUint16(minor)
    b.PrependUint16(major)
    b.PrependStructSlot(0, b.Offset(), 0)
    b.FinishSizePrefixed(b.EndObject(), FILE_IDENTIFIER)
    return bytes(b.Output())


# -- reading ----------------------------------------------------------------------------------
# A small walker over the bytes that checks every offset before it reads, so that a corrupt file
# is a BinaryFormatError naming where it went wrong (flatbuffers' own Table reads unchecked).


@final
class _Reader:
    def __init__(self, data: bytes, name: str) -> None:
        self.data = data
        self.name = name

    def fail(self, what: str, offset: int | None = None) -> BinaryFormatError:
        where = f" at offset {offset}" if offset is not None else ""
        return BinaryFormatError(f"{self.name} is not a whole system descriptor (.ttsys): {what}{where}")

    def unpack(self, fmt: str, offset: int, field: str) -> Any:
        size = struct.calcsize(fmt)
        if offset < 0 or offset + size > len(self.data):
            raise self.fail(f"{field} ({size} bytes) runs past the end of the {len(self.data)} bytes", offset)
        return struct.unpack_from(fmt, self.data, offset)

    def u32(self, offset: int, field: str) -> int:
        return int(self.unpack("<I", offset, field)[0])

    def table(self, offset: int, field: str) -> _Table:
        vtable = offset - int(self.unpack("<i", offset, field)[0])
        vlen, tlen = self.unpack("<HH", vtable, f"{field}'s vtable")
        if vlen < 4 or vlen % 2 or tlen < 4:
            raise self.fail(f"{field}'s vtable is malformed (vtable {vlen} bytes, table {tlen})", vtable)
        if offset + tlen > len(self.data):
            raise self.fail(f"{field} ({tlen} bytes) runs past the end", offset)
        slots = self.unpack(f"<{(vlen - 4) // 2}H", vtable + 4, f"{field}'s vtable")
        for slot, at in enumerate(slots):
            if at and (at < 4 or at >= tlen):
                raise self.fail(f"{field}'s field {slot} is outside its table ({at} of {tlen} bytes)", vtable)
        return _Table(self, offset, field, tlen, slots)

    def vector(self, at: int, field: str, size: int) -> tuple[int, int]:
        start = at + self.u32(at, field)
        count = self.u32(start, f"{field}'s length")
        if start + 4 + count * size > len(self.data):
            raise self.fail(f"{field} of {count} items runs past the end", start)
        return start + 4, count

    def string(self, at: int, field: str) -> str:
        start, count = self.vector(at, field, 1)
        try:
            return self.data[start:start + count].decode()
        except UnicodeDecodeError:
            raise self.fail(f"{field} is not UTF-8", start) from None

    def read(self) -> SystemDesc:
        if len(self.data) < 12:
            raise self.fail(f"{len(self.data)} bytes are too few for a size-prefixed flatbuffer")
        if self.data[8:12] != FILE_IDENTIFIER:
            raise self.fail(f"the file identifier is {self.data[8:12]!r}, not {FILE_IDENTIFIER!r}", 8)
        size = self.u32(0, "the size prefix")
        if size != len(self.data) - 4:
            raise self.fail(f"the size prefix says {size} bytes follow, the file holds {len(self.data) - 4}"
                            + (" (truncated)" if size > len(self.data) - 4 else ""), 0)
        root = self.table(4 + self.u32(4, "the root offset"), "SystemDescRoot")
        system = root.table(4, "system_desc")
        try:
            return SystemDesc(
                version=root.version(),
                schema_hash=root.string(1, "schema_hash"),
                ttmlir_git_hash=root.string(2, "ttmlir_git_hash"),
                product_identifier=root.string(3, "product_identifier"),
                cpu_descs=[self.cpu(t) for t in system.tables(0, "cpu_descs")],
                chip_descs=[self.chip(t) for t in system.tables(1, "chip_descs")],
                chip_desc_indices=system.scalars(2, "chip_desc_indices", "<I"),
                chip_capabilities=system.scalars(3, "chip_capabilities", "<I"),
                chip_coords=[ChipCoord(*c) for c in system.structs(4, "chip_coords", "<4I")],
                chip_channels=[ChipChannel(d0, (y0, x0), d1, (y1, x1))
                               for d0, y0, x0, d1, y1, x1 in system.structs(5, "chip_channels", "<IiiIii")],
            )
        except (ValueError, TypeError) as exc:  # a value the classes refuse: an index, an enum
            raise self.fail(str(exc)) from None

    def cpu(self, t: _Table) -> CpuDesc:
        return CpuDesc(role=t.enum(0, "role", "<B", CPU_ROLES), target_triple=t.string(1, "target_triple"))

    def chip(self, t: _Table) -> ChipDesc:
        values: dict[str, Any] = {}
        for slot, (name, kind) in enumerate(_CHIP_LAYOUT):
            if kind == "arch":
                values[name] = t.enum(slot, name, "<I", ARCHS)
            elif kind == "coord":
                values[name] = t.coord(slot, name)
            elif kind == "coords":
                values[name] = t.structs(slot, name, "<ii")
            elif kind == "dtypes":
                values[name] = [_name(self, DATA_TYPES, code, f"ChipDesc.{name}")
                                for code in t.scalars(slot, name, "<H")]
            else:
                values[name] = t.scalar(slot, name, kind)
        return ChipDesc(**values)


def _name(reader: _Reader, names: Sequence[str], code: int, field: str) -> str:
    if code >= len(names):
        raise reader.fail(f"{field}: {code} is not one of tt-mlir's {len(names)} values")
    return names[code]


@final
class _Table:
    """One table of the file: its field offsets (0: absent, the field's default)."""

    def __init__(self, reader: _Reader, offset: int, field: str, size: int, slots: Sequence[int]) -> None:
        self.r = reader
        self.offset = offset
        self.field = field
        self.size = size
        self.slots = slots

    def at(self, slot: int, name: str, size: int) -> int | None:
        """Where field `slot` is, or None when it is absent."""
        at = self.slots[slot] if slot < len(self.slots) else 0
        if not at:
            return None
        if at + size > self.size:
            raise self.r.fail(f"{self.field}.{name} runs past its table", self.offset + at)
        return self.offset + at

    def scalar(self, slot: int, name: str, fmt: str) -> int:
        at = self.at(slot, name, struct.calcsize(fmt))
        return 0 if at is None else int(self.r.unpack(fmt, at, name)[0])

    def enum(self, slot: int, name: str, fmt: str, names: Sequence[str]) -> str:
        return _name(self.r, names, self.scalar(slot, name, fmt), f"{self.field}.{name}")

    def coord(self, slot: int, name: str) -> Coord:
        at = self.at(slot, name, 8)
        if at is None:  # tt-mlir reads these without a check: a file without one crashes it
            raise self.r.fail(f"{self.field}.{name} is missing", self.offset)
        y, x = self.r.unpack("<ii", at, name)
        return y, x

    def _vector(self, slot: int, name: str, size: int) -> tuple[int, int]:
        at = self.at(slot, name, 4)
        if at is None:
            return 0, 0
        return self.r.vector(at, f"{self.field}.{name}", size)

    def scalars(self, slot: int, name: str, fmt: str) -> list[int]:
        size = struct.calcsize(fmt)
        start, count = self._vector(slot, name, size)
        return [int(v[0]) for v in struct.iter_unpack(fmt, self.r.data[start:start + count * size])]

    def structs(self, slot: int, name: str, fmt: str) -> list[tuple[int, ...]]:
        size = struct.calcsize(fmt)
        start, count = self._vector(slot, name, size)
        return list(struct.iter_unpack(fmt, self.r.data[start:start + count * size]))

    def tables(self, slot: int, name: str) -> list[_Table]:
        start, count = self._vector(slot, name, 4)
        return [self.r.table(start + 4 * i + self.r.u32(start + 4 * i, name), f"{name}[{i}]")
                for i in range(count)]

    def table(self, slot: int, name: str) -> _Table:
        at = self.at(slot, name, 4)
        if at is None:
            raise self.r.fail(f"{self.field}.{name} is missing", self.offset)
        return self.r.table(at + self.r.u32(at, name), name)

    def string(self, slot: int, name: str) -> str:
        at = self.at(slot, name, 4)
        return "" if at is None else self.r.string(at, f"{self.field}.{name}")

    def version(self) -> tuple[int, int, int]:
        at = self.at(0, "version", 8)
        if at is None:
            return 0, 0, 0
        major, minor, patch = self.r.unpack("<HHI", at, "version")
        return major, minor, patch
