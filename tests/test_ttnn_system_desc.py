"""The system descriptor ttflow writes for tt-mlir (`ttflow.ttnn.system_desc`): its fields against
the DeviceSpec's numbers, its bytes against tt-mlir's published field slots (read with the
flatbuffers package's own low-level reader), every field of the hardware-made descriptors
against it, corrupt files refused with BinaryFormatError only, and, with the compiler installed,
real compiles against ttflow's own files (n150, p150, a 1x2 n300 and a 2x4 T3000)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import flatbuffers
import pytest
from flatbuffers import number_types as N
from flatbuffers.table import Table
from hypothesis import given
from hypothesis import strategies as st

import ttflow as tt
from ttflow.cli import main
from ttflow.testing import device_specs
from ttflow.ttnn.descriptor import (
    SCHEMA_HASH,
    ChipChannel,
    ChipCoord,
    ChipDesc,
    SystemDesc,
    system_desc,
)

HERE = Path(__file__).resolve().parent
REFERENCES = HERE / "data" / "ttsys"
ROOT = HERE.parent


def reference(name: str) -> SystemDesc:
    return SystemDesc.load(REFERENCES / f"{name}.ttsys")


# (ttflow's system, the hardware-made descriptor of the same system)
PAIRS: dict[str, tuple[tt.DeviceSpec | tt.MeshSpec, str]] = {
    "n150": (tt.DeviceSpec.wormhole_n150(), "n150"),
    "p150": (tt.DeviceSpec.blackhole_p150(), "p150"),
    "n300": (tt.MeshSpec.n300(), "n300"),
    "t3000": (tt.MeshSpec.t3000(), "n300-llmbox"),
}


# -- the fields: ttflow's spec, by its own numbers ------------------------------------------------


def test_the_n150_descriptor_is_ttflows_n150() -> None:
    desc = system_desc(tt.DeviceSpec())
    (chip,) = desc.chips
    assert desc.num_chips == 1 and desc.chip_desc_indices == (0,) and desc.mmio_chips == (0,)
    assert chip.arch == "Wormhole_b0"
    assert chip.grid_size == (8, 8) == desc.grid_size
    # ttflow's L1 bank: 1,499,136 bytes, allocatable from address 0 (CBs at the bottom).
    assert (chip.l1_size, chip.l1_unreserved_base, chip.usable_l1_size) == (1_499_136, 0, 1_499_136)
    assert (chip.num_dram_channels, chip.dram_channel_size) == (12, 1 << 30)
    assert (chip.dram_unreserved_base, chip.dram_unreserved_end) == (0, 1 << 30)
    assert chip.dram_grid_size == (1, 12)
    assert (chip.noc_l1_address_align_bytes, chip.noc_dram_address_align_bytes) == (16, 32)
    assert chip.supported_data_types == ("Float32", "BFloat16", "BFP_BFloat8", "UInt32", "Int32")
    assert chip.supported_tile_sizes == ((32, 32),)
    assert len(chip.dram_bank_to_logical_worker_noc0) == 12
    assert desc.schema_hash == SCHEMA_HASH and desc.cpu_descs[0].role == "Host"
    assert desc.chip_channels == () and desc.chip_coords == (ChipCoord(0, 0, 0, 0),)


def test_the_p150_descriptor_is_ttflows_p150() -> None:
    (chip,) = system_desc(tt.DeviceSpec.blackhole_p150()).chips
    assert chip.arch == "Blackhole" and chip.grid_size == (10, 13)
    assert (chip.l1_size, chip.l1_unreserved_base) == (1_572_864, 0)
    assert (chip.num_dram_channels, chip.dram_channel_size, chip.dram_unreserved_end) == (8, 4_278_190_080, 4_278_190_080)
    assert (chip.noc_l1_address_align_bytes, chip.noc_dram_address_align_bytes) == (16, 64)
    assert chip.dram_grid_size == (1, 8)


@given(device_specs(max_grid=6))
def test_any_spec_is_described_field_by_field(spec: tt.DeviceSpec) -> None:
    (chip,) = system_desc(spec).chips
    assert chip.grid_size == spec.worker_grid
    assert (chip.l1_size, chip.l1_unreserved_base) == (spec.l1_bank_bytes, 0)
    assert (chip.num_dram_channels, chip.dram_channel_size) == (spec.dram_banks, spec.dram_bank_bytes)
    assert (chip.dram_unreserved_base, chip.dram_unreserved_end) == (0, spec.dram_bank_bytes)
    assert chip.noc_l1_address_align_bytes == spec.l1_alignment
    assert chip.noc_dram_address_align_bytes == spec.dram_alignment
    assert chip.dram_grid_size == (1, spec.dram_banks)
    rows, cols = spec.worker_grid
    for workers in (chip.dram_bank_to_logical_worker_noc0, chip.dram_bank_to_logical_worker_noc1):
        assert len(workers) == spec.dram_banks
        assert all(0 <= y < rows and 0 <= x < cols for y, x in workers)


def test_the_mesh_descriptors_are_ttflows_meshes() -> None:
    n300 = system_desc(tt.MeshSpec.n300())
    assert n300.num_chips == 2 and n300.chips[0] == n300.chips[1] == system_desc(tt.DeviceSpec()).chips[0]
    assert n300.mmio_chips == (0,)  # the card's second chip is reached over the dispatch link
    assert n300.chip_channels == (ChipChannel(0, (0, 0), 1, (0, 0)),)  # its one collective link
    assert n300.chip_coords == (ChipCoord(0, 0, 0, 0), ChipCoord(0, 0, 0, 1))
    t3000 = system_desc(tt.MeshSpec.t3000())
    assert t3000.num_chips == 8 and t3000.mmio_chips == tuple(range(8))
    assert [(c.y, c.x) for c in t3000.chip_coords] == [(r, c) for r in range(2) for c in range(4)]
    pairs = [(ch.device_id0, ch.device_id1) for ch in t3000.chip_channels]
    assert sorted(set(pairs)) == [(0, 1), (0, 4), (1, 2), (1, 5), (2, 3), (2, 6), (3, 7), (4, 5), (5, 6), (6, 7)]
    assert all(pairs.count(p) == 2 for p in pairs)  # links_per_pair
    galaxy = system_desc(tt.MeshSpec.galaxy())
    used = [0] * 32
    for ch in galaxy.chip_channels:
        used[ch.device_id0] += 1
        used[ch.device_id1] += 1
    assert max(used) == 16  # an interior chip: 4 neighbours x 4 links, every Ethernet port


@pytest.mark.anyio
async def test_an_open_device_is_described_with_what_it_keeps_at_the_top(anyio_backend: str) -> None:
    small = tt.DeviceSpec.small()
    async with tt.open_device(small, l1_small_size=8 * 1024 + 3, trace_region_size=1 << 20) as device:
        (chip,) = system_desc(device).chips
    assert chip.l1_size == small.l1_bank_bytes - 8 * 1024 - 16  # rounded up to L1's alignment
    assert chip.dram_unreserved_end == small.dram_bank_bytes - (1 << 20)
    async with tt.open_mesh_device(tt.MeshSpec.n300()) as mesh:
        assert system_desc(mesh) == system_desc(tt.MeshSpec.n300())


def test_what_cannot_be_described_is_refused() -> None:
    with pytest.raises(TypeError, match="takes a tt.DeviceSpec"):
        system_desc("n150")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="32-bit"):
        system_desc(tt.DeviceSpec(dram_bank_bytes=1 << 32))
    chip = system_desc(tt.DeviceSpec()).chips[0]
    with pytest.raises(ValueError, match="uint32"):
        attrs.evolve(chip, num_cbs=-1)
    with pytest.raises(ValueError, match="Float8"):
        attrs.evolve(chip, supported_data_types=("Float8",))
    with pytest.raises(ValueError, match="past the 1 chip_descs"):
        SystemDesc((chip,), (0, 1), (1, 1), (), ())


# -- the bytes: tt-mlir's field slots, read with flatbuffers' own Table ---------------------------

# tt-mlir's published layout (include/ttmlir/Target/Common/types.fbs, 2026-04-28 on): the
# slot of each ChipDesc field this test reads.
CHIP_SLOTS = {"arch": 0, "grid_size": 1, "l1_size": 3, "num_dram_channels": 4, "dram_channel_size": 5,
              "noc_l1_address_align_bytes": 6, "noc_dram_address_align_bytes": 8,
              "l1_unreserved_base": 9, "dram_unreserved_end": 12, "supported_data_types": 13,
              "dram_grid_size": 19}


def _field(t: Table, slot: int) -> int:
    return int(t.Offset(4 + 2 * slot))


def _indirect(t: Table, slot: int) -> Table:
    return Table(t.Bytes, t.Indirect(t.Pos + _field(t, slot)))


def _raw_fields(data: bytes) -> dict[str, Any]:
    """The fields of chip 0 read by slot with flatbuffers' Table, knowing nothing of ttflow."""
    buf = bytearray(data)
    assert flatbuffers.encode.Get(N.UOffsetTFlags.packer_type, buf, 0) == len(buf) - 4
    assert bytes(buf[8:12]) == b"TTSY"
    root = Table(buf, 4 + flatbuffers.encode.Get(N.UOffsetTFlags.packer_type, buf, 4))
    system = _indirect(root, 4)
    chips = _field(system, 1)
    chip = Table(buf, system.Indirect(system.Vector(chips)))

    def scalar(name: str, flags: Any) -> int:
        at = _field(chip, CHIP_SLOTS[name])
        return 0 if at == 0 else int(chip.Get(flags, chip.Pos + at))

    def pair(name: str) -> tuple[int, int]:
        at = chip.Pos + _field(chip, CHIP_SLOTS[name])
        return chip.Get(N.Int32Flags, at), chip.Get(N.Int32Flags, at + 4)

    dtypes = _field(chip, CHIP_SLOTS["supported_data_types"])
    start = chip.Vector(dtypes)
    return {
        "schema_hash": root.String(root.Pos + _field(root, 1)).decode(),
        "chips": system.VectorLen(chips),
        "arch": scalar("arch", N.Uint32Flags),
        "grid_size": pair("grid_size"),
        "l1_size": scalar("l1_size", N.Uint64Flags),
        "num_dram_channels": scalar("num_dram_channels", N.Uint32Flags),
        "dram_channel_size": scalar("dram_channel_size", N.Uint64Flags),
        "noc_l1_address_align_bytes": scalar("noc_l1_address_align_bytes", N.Uint32Flags),
        "noc_dram_address_align_bytes": scalar("noc_dram_address_align_bytes", N.Uint32Flags),
        "l1_unreserved_base": scalar("l1_unreserved_base", N.Uint32Flags),
        "dram_unreserved_end": scalar("dram_unreserved_end", N.Uint32Flags),
        "supported_data_types": [chip.Get(N.Uint16Flags, start + 2 * i) for i in range(chip.VectorLen(dtypes))],
        "dram_grid_size": pair("dram_grid_size"),
    }


def test_the_bytes_put_every_field_in_tt_mlirs_slot() -> None:
    raw = _raw_fields(system_desc(tt.DeviceSpec()).to_bytes())
    assert raw == {
        "schema_hash": SCHEMA_HASH, "chips": 1, "arch": 0, "grid_size": (8, 8), "l1_size": 1_499_136,
        "num_dram_channels": 12, "dram_channel_size": 1 << 30, "noc_l1_address_align_bytes": 16,
        "noc_dram_address_align_bytes": 32, "l1_unreserved_base": 0, "dram_unreserved_end": 1 << 30,
        "supported_data_types": [0, 2, 4, 9, 12], "dram_grid_size": (1, 12),
    }
    # Slots that the n150 fills alike would not catch a swap: a lopsided spec does.
    odd = tt.DeviceSpec(name="blackhole_odd", worker_grid=(3, 5), l1_bank_bytes=70_000, dram_banks=7,
                        dram_bank_bytes=5_000_000, dram_alignment=128, l1_alignment=64)
    raw = _raw_fields(system_desc(odd).to_bytes())
    assert (raw["arch"], raw["grid_size"], raw["l1_size"], raw["num_dram_channels"]) == (1, (3, 5), 70_000, 7)
    assert (raw["dram_channel_size"], raw["dram_unreserved_end"], raw["dram_grid_size"]) == (5_000_000, 5_000_000, (1, 7))
    assert (raw["noc_l1_address_align_bytes"], raw["noc_dram_address_align_bytes"]) == (64, 128)


def test_the_reader_reads_the_slots_flatbuffers_reads() -> None:
    for name in ("n150", "p150", "n300", "n300-llmbox"):
        data = (REFERENCES / f"{name}.ttsys").read_bytes()
        raw, desc = _raw_fields(data), SystemDesc.from_bytes(data)
        chip = desc.chips[0]
        assert raw["chips"] == len(desc.chip_descs) and raw["schema_hash"] == desc.schema_hash
        assert raw["arch"] == ("Wormhole_b0", "Blackhole").index(chip.arch)
        for field in set(raw) - {"chips", "schema_hash", "arch", "supported_data_types"}:
            assert raw[field] == getattr(chip, field), (name, field)
        assert len(raw["supported_data_types"]) == len(chip.supported_data_types) == 13


# -- round trips ----------------------------------------------------------------------------------


SYSTEMS: list[tt.DeviceSpec | tt.MeshSpec] = [tt.DeviceSpec(), tt.DeviceSpec.blackhole_p150(), tt.DeviceSpec.small(), tt.MeshSpec.n300(),
           tt.MeshSpec.t3000(), tt.MeshSpec.galaxy(), tt.MeshSpec((3, 3), topology="ring")]


@pytest.mark.parametrize("spec", SYSTEMS, ids=lambda s: getattr(s, "label", None) or s.name)
def test_written_then_read_is_the_same_descriptor(spec: Any, tmp_path: Path) -> None:
    desc = system_desc(spec)
    assert SystemDesc.from_bytes(desc.to_bytes()) == desc
    path = desc.save(tmp_path / "system_desc.ttsys")
    assert path == tmp_path / "system_desc.ttsys" and SystemDesc.load(path) == desc
    assert json.loads(json.dumps(desc.to_dict()))["chip_desc_indices"] == list(range(desc.num_chips))


@given(device_specs(max_grid=8))
def test_any_spec_round_trips(spec: tt.DeviceSpec) -> None:
    desc = system_desc(spec)
    assert SystemDesc.from_bytes(desc.to_bytes()) == desc


@pytest.mark.parametrize("name", ["n150", "p150", "n300", "n300-llmbox"])
def test_a_hardware_descriptor_round_trips(name: str) -> None:
    desc = reference(name)
    assert SystemDesc.from_bytes(desc.to_bytes()) == desc
    assert desc.schema_hash == SCHEMA_HASH and desc.version == (0, 0, 3758)
    assert desc.ttmlir_git_hash == "464a5f341908d5a3f790e697be5ffa6fd3fb6f32"


# -- against the hardware-made descriptors -------------------------------------------------------

DIFFERENT = {
    # ttflow's banks are allocatable whole (docs/compiler.md says why, field by field).
    "n150": {"l1_unreserved_base", "dram_unreserved_base", "dram_unreserved_end",
             "supported_data_types", "supported_tile_sizes"},
    # ... and ttflow's p150 has the full 13 columns where tt-xla's chip gave the compiler 11.
    "p150": {"l1_unreserved_base", "dram_unreserved_base", "dram_unreserved_end",
             "supported_data_types", "supported_tile_sizes", "grid_size"},
}
PER_CHIP = {"dram_bank_to_logical_worker_noc0", "dram_bank_to_logical_worker_noc1"}
"""Differ from chip to chip of a real system (each chip's harvesting moves its best cores)."""


def _differences(ours: ChipDesc, theirs: ChipDesc) -> set[str]:
    return {f.name for f in attrs.fields(ChipDesc) if getattr(ours, f.name) != getattr(theirs, f.name)}


@pytest.mark.parametrize("system", list(PAIRS))
def test_ttflow_agrees_with_the_hardware_where_it_must(system: str) -> None:
    spec, name = PAIRS[system]
    ours, theirs = system_desc(spec), reference(name)
    # Structure: one ChipDesc per chip, indexed in order; one host CPU of the same triple.
    assert ours.num_chips == theirs.num_chips == len(ours.chip_descs) == len(theirs.chip_descs)
    assert ours.chip_desc_indices == theirs.chip_desc_indices == tuple(range(ours.num_chips))
    assert ours.cpu_descs == theirs.cpu_descs
    assert len(ours.chip_capabilities) == len(theirs.chip_capabilities) == ours.num_chips
    assert 0 in ours.mmio_chips and 0 in theirs.mmio_chips
    for mine, real in zip(ours.chips, theirs.chips, strict=True):
        # dtypes and tile sizes: what ttflow holds, a subset of the chip's, under the same codes.
        assert set(mine.supported_data_types) < set(real.supported_data_types)
        assert set(mine.supported_tile_sizes) < set(real.supported_tile_sizes)
        assert (32, 32) in real.supported_tile_sizes
        allowed = DIFFERENT["p150" if system == "p150" else "n150"] | (PER_CHIP if ours.num_chips > 1 else set())
        assert _differences(mine, real) <= allowed, system
        assert real.l1_unreserved_base > 0 and real.dram_unreserved_base > 0  # the firmware's
        assert mine.usable_l1_size == mine.l1_size and mine.usable_l1_size > real.usable_l1_size
    # Chip coordinates: the same struct; tt-metal writes one placeholder, ttflow each chip's.
    assert theirs.chip_coords == (ChipCoord(0, 0, 0, 0),)
    assert ours.chip_coords[0] == ChipCoord(0, 0, 0, 0) and len(ours.chip_coords) == ours.num_chips
    # Ethernet: logical Ethernet cores (channel, 0), lower chip id first.
    for channels in (ours.chip_channels, theirs.chip_channels):
        for ch in channels:
            assert ch.device_id0 < ch.device_id1 < ours.num_chips
            assert ch.ethernet_core_coord0[1] == ch.ethernet_core_coord1[1] == 0
            assert 0 <= ch.ethernet_core_coord0[0] < 16 and 0 <= ch.ethernet_core_coord1[0] < 16


def test_the_hardware_differs_from_ttflows_n150_where_the_docs_say() -> None:
    for system in ("n150", "p150"):
        spec, name = PAIRS[system]
        assert _differences(system_desc(spec).chips[0], reference(name).chips[0]) == DIFFERENT[system]


def _pairs(desc: SystemDesc) -> set[tuple[int, int]]:
    return {(ch.device_id0, ch.device_id1) for ch in desc.chip_channels}


def test_the_n300s_link_is_ttflows() -> None:
    ours, theirs = system_desc(tt.MeshSpec.n300()), reference("n300")
    assert _pairs(ours) == _pairs(theirs) == {(0, 1)}
    # One link listed: the card's other link carries dispatch (tt-metal lists it as inactive),
    # as ttflow's n300 keeps one of its two links for dispatch.
    assert len(ours.chip_channels) == len(theirs.chip_channels) == tt.MeshSpec.n300().links_per_pair
    assert ours.chip_capabilities == theirs.chip_capabilities == (1, 0)


def test_the_llmbox_is_a_2x4_grid_of_links_as_ttflows_t3000() -> None:
    ours, theirs = system_desc(tt.MeshSpec.t3000()), reference("n300-llmbox")
    grid = {frozenset(p) for p in _pairs(ours)}
    hardware = [tuple(p) for p in _pairs(theirs)]
    assert len(grid) == len(hardware) == 10
    # tt-metal numbers the chips its own way: some renumbering makes its link graph ttflow's.
    assert any({frozenset((order[a], order[b])) for a, b in hardware} == grid
               for order in itertools.permutations(range(8)))
    # ttflow's T3000 gives collectives two links per neighbour pair (20); the hardware lists 14
    # (a card's second chip keeps links for dispatch), and 4 chips are reached over Ethernet.
    assert (len(ours.chip_channels), len(theirs.chip_channels)) == (20, 14)
    assert (len(ours.mmio_chips), len(theirs.mmio_chips)) == (8, 4)


# -- corrupt files --------------------------------------------------------------------------------

SEEDS = [system_desc(tt.DeviceSpec()).to_bytes(), system_desc(tt.MeshSpec.n300()).to_bytes(),
         (REFERENCES / "n150.ttsys").read_bytes()]


def _read_or_refuse(data: bytes) -> None:
    try:
        desc = SystemDesc.from_bytes(data)
    except tt.BinaryFormatError as exc:
        assert "system descriptor" in str(exc)
        return
    assert SystemDesc.from_bytes(desc.to_bytes()) == desc  # a valid read is a whole descriptor


@given(st.sampled_from(SEEDS), st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=8),
       st.one_of(st.none(), st.integers(0, 1 << 16)))
def test_a_corrupt_file_is_refused_or_read_never_crashes(seed: bytes, flips: list[tuple[int, int]],
                                                          cut: int | None) -> None:
    data = bytearray(seed)
    for at, value in flips:
        data[at % len(data)] = value
    if cut is not None:
        data = data[:cut % (len(data) + 1)]
    _read_or_refuse(bytes(data))


@given(st.sampled_from(SEEDS), st.integers(12, 1 << 16), st.integers(0, 255))
def test_a_flipped_byte_past_the_header_keeps_the_size_prefix(seed: bytes, at: int, value: int) -> None:
    data = bytearray(seed)
    data[12 + at % (len(data) - 12)] = value  # the walk itself meets the damage
    _read_or_refuse(bytes(data))


def test_the_refusals_name_what_is_wrong(tmp_path: Path) -> None:
    data = system_desc(tt.DeviceSpec()).to_bytes()
    with pytest.raises(tt.BinaryFormatError, match="truncated"):
        SystemDesc.from_bytes(data[:-8])
    with pytest.raises(tt.BinaryFormatError, match="file identifier"):
        SystemDesc.from_bytes(data[:8] + b"TTNN" + data[12:])
    with pytest.raises(tt.BinaryFormatError, match="too few"):
        SystemDesc.from_bytes(b"")
    bad = bytearray(data)
    root = 4 + int.from_bytes(data[4:8], "little")
    bad[root:root + 4] = (1 << 20).to_bytes(4, "little", signed=True)  # the vtable far away
    with pytest.raises(tt.BinaryFormatError, match=r"SystemDescRoot's vtable .* at offset -"):
        SystemDesc.from_bytes(bytes(bad))
    path = tmp_path / "x.ttsys"
    path.write_bytes(data[:100] + bytes(4))
    with pytest.raises(tt.BinaryFormatError, match="x.ttsys"):
        SystemDesc.load(path)
    with pytest.raises(tt.FileError, match="no such file"):
        SystemDesc.load(tmp_path / "missing.ttsys")
    with pytest.raises(tt.FileError, match="folder"):
        system_desc(tt.DeviceSpec()).save(tmp_path)


# -- ttflow query ---------------------------------------------------------------------------------


def test_query_saves_the_descriptor_where_ttrt_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["query", "--save-artifacts"]) == 0
    assert SystemDesc.load(tmp_path / "ttrt-artifacts" / "system_desc.ttsys") == system_desc(tt.DeviceSpec())
    out = capsys.readouterr().out
    assert "worker grid 8x8" in out and "ttrt-artifacts/system_desc.ttsys" in out
    assert main(["query", "--device", "t3000", "--save-artifacts", "deep/dir", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chip_desc_indices"] == list(range(8))
    assert SystemDesc.load(tmp_path / "deep/dir/system_desc.ttsys") == system_desc(tt.MeshSpec.t3000())
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit:
        main(["query", "--save-artifacts", "file"])
    assert exit.value.code == 2 and "is a file" in capsys.readouterr().err


# -- the docs' table -----------------------------------------------------------------------------


def test_the_docs_table_has_every_field_and_the_values_it_compares() -> None:
    text = (ROOT / "docs" / "compiler.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+)` \|(.*)$", text, re.MULTILINE)}
    ours, theirs = system_desc(tt.DeviceSpec()).chips[0], reference("n150").chips[0]
    assert set(attrs.fields_dict(ChipDesc)) <= set(rows)
    for name in attrs.fields_dict(ChipDesc):
        hardware, mine = (cell.strip() for cell in rows[name].split("|")[:2])
        for cell, value in ((hardware, getattr(theirs, name)), (mine, getattr(ours, name))):
            if isinstance(value, int):
                assert cell.replace(",", "").replace("_", "").startswith(str(value)), (name, cell)
            elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], int):
                assert cell.startswith(f"{value[0]}x{value[1]}"), (name, cell)
            elif name != "arch":
                assert cell.startswith(str(len(value))), (name, cell)  # "13: ..." for a list
        assert ("**differs**" in rows[name]) == (name in DIFFERENT["n150"]), name


# -- compiling against ttflow's own descriptor ----------------------------------------------------

HAVE_COMPILER = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("jax_plugins.libtt") is not None
needs_compiler = pytest.mark.skipif(
    not HAVE_COMPILER, reason="Tenstorrent's compiler is not installed: pip install '.[compiler]' "
    "(jax==0.10.2, jax-tt-plugin==0.1.3; Python 3.11)")

COMPILE = """
import sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
rows, cols = int(sys.argv[2]), int(sys.argv[3])
devices = jax.devices("tt")
assert len(devices) == rows * cols, f"the plugin sees {len(devices)} devices"
def f(x, w):
    return jnp.maximum(x @ w, 0)
opts = {"export_path": sys.argv[1]}
if len(devices) == 1:
    x = jax.device_put(np.ones((32, 64), np.float32), devices[0])
    w = jax.device_put(np.ones((64, 32), np.float32), devices[0])
    jax.jit(f, compiler_options=opts)(x, w)
else:  # K sharded over the mesh's columns, rows replicated: a matmul and an all-reduce
    mesh = Mesh(np.array(devices).reshape(rows, cols), ("r", "c"))
    k = 64 * cols
    x = jax.device_put(np.ones((32, k), np.float32), NamedSharding(mesh, P(None, "c")))
    w = jax.device_put(np.ones((k, 32), np.float32), NamedSharding(mesh, P("c", None)))
    jax.jit(f, compiler_options=opts, out_shardings=NamedSharding(mesh, P()))(x, w)
"""

COMPILED = {"n150": ((1, 1), "8x8"), "p150": ((1, 1), "10x13"), "n300": ((1, 2), "8x8"),
            "t3000": ((2, 4), "8x8")}


def _compile(desc: SystemDesc, out: Path) -> subprocess.CompletedProcess[str]:
    """One compile in a child: one PJRT client per process, compile-only set before it starts."""
    path = desc.save(out.with_suffix(".ttsys"))
    rows, cols = (1, desc.num_chips) if desc.num_chips <= 2 else (2, desc.num_chips // 2)
    env = {**os.environ, "TT_COMPILE_ONLY_SYSTEM_DESC": str(path)}
    env.pop("JAX_PLATFORMS", None)  # the plugin's platform must load
    return subprocess.run([sys.executable, "-c", COMPILE, str(out), str(rows), str(cols)], env=env,
                          capture_output=True, text=True, timeout=240, check=False)


@needs_compiler
@pytest.mark.timeout(300)
@pytest.mark.parametrize("system", list(COMPILED))
def test_the_compiler_plans_for_ttflows_descriptor(system: str, tmp_path: Path) -> None:
    spec = PAIRS[system][0]
    (rows, cols), grid = COMPILED[system]
    run = _compile(system_desc(spec), tmp_path / system)
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.stdout[-1500:]}\n{run.stderr[-3000:]}"
    written = sorted(p.name for p in (tmp_path / system).rglob("*") if p.is_file())
    assert len([name for name in written if name.startswith("fb_") and name.endswith(".ttnn")]) == 1, written
    # The compiler's own IR holds the descriptor it planned against: ttflow's numbers.
    irs = list((tmp_path / system / "irs").glob("ttnn_runtime_*.mlir"))
    assert len(irs) == 1, written
    ir = irs[0]
    text = ir.read_text()
    chip = system_desc(spec).chips[0]
    assert f"grid = {grid}," in text and f"l1_size = {chip.l1_size}," in text
    assert "l1_unreserved_base = 0," in text and f"num_dram_channels = {chip.num_dram_channels}," in text
    assert f"dram_unreserved_end = {chip.dram_unreserved_end}," in text
    if rows * cols > 1:
        assert f'<"mesh" = {rows}x{cols}>' in text and "ttnn.all_reduce" in text


@needs_compiler
@pytest.mark.timeout(300)
def test_the_compiler_refuses_another_schema_hash(tmp_path: Path) -> None:
    """The compiles above read ttflow's file: one with another schema hash does not compile."""
    run = _compile(attrs.evolve(system_desc(tt.DeviceSpec()), schema_hash="0" * 64), tmp_path / "bad")
    assert run.returncode != 0 and "schema mismatch" in run.stdout + run.stderr
