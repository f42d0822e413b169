"""The compiler's memory plan, checked: each op's result allocated where its layout puts it, each
`ttnn.deallocate` freeing at its point, on the chip the binary was compiled for.

ttflow runs a loaded program through its own scheduler, which places intermediates itself (L1
first, DRAM when L1 is full: docs/compiler.md). Whether the *compiler's* placement fits the chip is
a separate question with a definite answer, and a plan that would not fit on silicon must not run
silently on the emulator: `check_plan` replays the plan on a model of the chip's banks and raises
the OutOfMemoryError silicon's allocator would, naming the op, its location and the bytes; it also
gives each program's peaks (`ttflow run --memory`, `ttflow read`).

The model is tt-metal's rule for a buffer's bytes per bank: an interleaved buffer's pages (a
32x32 tile, or one row of a row-major tensor, aligned to the memory's alignment) go round-robin
over the banks, every bank holding ceil(pages / banks) of them at one address range; a sharded
buffer holds its shard on each core of its grid. Each memory is one address range per bank, from
the descriptor's unreserved base to its end, allocated first-fit (lowest address) as tt-metal's
free-list allocator does; system-memory tensors live on the host.
"""

from __future__ import annotations

import math
import re
from typing import final

import attrs

from .._errors import BinaryFormatError, OutOfMemoryError
from .mlir import TensorType
from .reader import TtnnFile, TtnnProgram, TtnnTensor

__all__ = ["Chip", "ProgramPlan", "check_plan", "chip_of", "buffer_bytes"]

_ELEMENT_BYTES = {"f32": 4, "si32": 4, "ui32": 4, "i32": 4, "bf16": 2, "f16": 2, "ui16": 2, "u16": 2,
                  "ui8": 1, "u8": 1, "si8": 1}
_TILE_BYTES = {"bfp_bf8": 1088, "bfp_f8": 1088, "bfp_bf4": 576, "bfp_f4": 576, "bfp_bf2": 320, "bfp_f2": 320}


@final
@attrs.frozen
class Chip:
    """What the plan needs of the chip: its banks, their usable range and alignments."""

    l1_banks: int
    l1_base: int
    l1_end: int
    dram_banks: int
    dram_base: int
    dram_end: int
    l1_alignment: int = 16
    dram_alignment: int = 32


def chip_of(file: TtnnFile) -> Chip:
    """The chip the binary was compiled for, from its module's `#system_desc` (its first chip)."""
    m = re.search(r"#system_desc = #ttcore\.system_desc<(.*)", file.mlir)
    text = m[1] if m else ""

    def field(name: str) -> int:
        found = re.search(rf"\b{name} = (\d+)", text)
        if not found:
            raise BinaryFormatError(f"the binary's system descriptor has no {name}")
        return int(found[1])

    grid = re.search(r"grid = (\d+)x(\d+)", text)
    if not grid:
        raise BinaryFormatError("the binary's system descriptor has no grid")
    return Chip(
        l1_banks=int(grid[1]) * int(grid[2]), l1_base=field("l1_unreserved_base"), l1_end=field("l1_size"),
        dram_banks=field("num_dram_channels"), dram_base=field("dram_unreserved_base"),
        dram_end=field("dram_unreserved_end"),
        l1_alignment=field("noc_l1_address_align_bytes"), dram_alignment=field("noc_dram_address_align_bytes"),
    )


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def buffer_bytes(t: TensorType, chip: Chip) -> tuple[str, int] | None:
    """(memory, bytes per bank) a tensor of this type takes, or None on the host."""
    if t.shape is None or t.buffer in (None, "system_memory"):
        return None
    memory = "l1" if t.buffer in ("l1", "l1_small") else "dram"
    banks, alignment = (chip.l1_banks, chip.l1_alignment) if memory == "l1" else (chip.dram_banks, chip.dram_alignment)
    shard = t.shard or ()
    if t.tiled:
        element = t.tile_element or t.element or "f32"
        page = _TILE_BYTES.get(element, 32 * 32 * _ELEMENT_BYTES.get(element, 4))
        pages = math.prod(shard) if shard else 1
        rows = 0
    else:
        element = t.element or "f32"
        width = shard[-1] if shard else (t.shape[-1] if t.shape else 1)
        page = width * _ELEMENT_BYTES.get(element, 4)
        rows = math.prod(shard[:-1]) if len(shard) > 1 else 1
        pages = rows
    aligned = _align(page, alignment)
    if t.memory_layout in (None, "interleaved"):
        return memory, -(-pages // banks) * aligned
    return memory, pages * aligned  # a shard on each core of its grid: its memref is the shard


@final
@attrs.frozen
class ProgramPlan:
    name: str
    peak_l1_per_core: int
    peak_dram_per_bank: int


class _Space:
    """One bank's address range, first-fit: (start, size) blocks in use."""

    def __init__(self, name: str, base: int, end: int) -> None:
        self.name, self.base, self.end = name, base, end
        self.used: dict[str, tuple[int, int]] = {}
        self.peak = 0

    def allocate(self, key: str, size: int) -> int | None:
        start = self.base
        for at, length in sorted(self.used.values()):
            if at - start >= size:
                break
            start = max(start, at + length)
        if start + size > self.end:
            return None
        self.used[key] = (start, size)
        self.peak = max(self.peak, sum(s for _, s in self.used.values()))
        return start

    def largest_free(self) -> int:
        start, best = self.base, 0
        for at, length in sorted(self.used.values()):
            best = max(best, at - start)
            start = max(start, at + length)
        return max(best, self.end - start)


def check_plan(file: TtnnFile, program: TtnnProgram, chip: Chip | None = None) -> ProgramPlan:
    """The program's plan replayed on the chip's banks; OutOfMemoryError at the op that does not fit."""
    chip = chip or chip_of(file)
    spaces = {"l1": _Space("L1", chip.l1_base, chip.l1_end), "dram": _Space("DRAM", chip.dram_base, chip.dram_end)}
    where: dict[str, str] = {}  # a live value -> its memory
    for name, given in zip(program.arguments, program.inputs, strict=True):  # the caller's tensors
        if given.on_host or given.buffer == "system_memory":
            continue
        layout = TensorType("", given.shape or (1,), given.data_type, given.buffer, given.tiled, given.data_type,
                            given.memory_layout, None, _input_shard(given))
        placed = buffer_bytes(layout, chip)
        if placed is not None and spaces[placed[0]].allocate(name, placed[1]) is not None:
            where[name] = placed[0]
    # Tensors someone else holds too: the caller's inputs and the const-eval cache's results. A
    # `deallocate` with force=false leaves them (ttnn frees a buffer another handle shares only
    # when forced); force=true frees them all the same.
    shared = set(program.arguments)
    for op in program.ops:
        if op.name == "ttcore.load_cached":
            shared.update(op.op.results)
        if op.name == "ttnn.deallocate":
            (name,) = op.op.operands[:1] or ("",)
            forced = op.op.attributes.get("force") == "true"
            if name in where and (forced or name not in shared):
                spaces[where.pop(name)].used.pop(name, None)
            continue
        for name, t in zip(op.op.results, op.op.result_types, strict=True):
            placed = buffer_bytes(t, chip)
            if placed is None:
                continue
            memory, size = placed
            space = spaces[memory]
            if space.allocate(name, size) is None:
                raise OutOfMemoryError(
                    space.name, size, space.largest_free(),
                    reason=f"the compiled plan of {program.name!r} does not fit: op {op.index} {op.name} "
                    f"at {op.location} puts {name} ({'x'.join(map(str, t.shape or ()))} {t.element}) in "
                    f"{space.name}, {sum(s for _, s in space.used.values())} bytes per bank already in use "
                    f"of {space.end - space.base}",
                )
            where[name] = memory
    return ProgramPlan(program.name, spaces["l1"].peak, spaces["dram"].peak)


def _input_shard(t: TtnnTensor) -> tuple[int, ...]:
    """An input's memref as its TensorRef implies it (interleaved: the whole tensor in tiles or rows)."""
    shape: tuple[int, ...] = t.shape or (1,)
    if t.tiled:  # each 2-D slice padded to whole tiles, the slices stacked
        tile_rows = math.prod(shape[:-2]) * -(-shape[-2] // 32) if len(shape) > 1 else 1
        return (tile_rows, -(-shape[-1] // 32))
    return (math.prod(shape[:-1]) if len(shape) > 1 else 1, shape[-1])
