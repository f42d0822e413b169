"""The bank memory and its allocator, against an independent model of used intervals."""

from __future__ import annotations

import resource

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ttflow as tt
from ttflow._memory.banks import Allocator, BankMemory, MemorySpaceState


def _gaps(used: dict[int, int], size: int) -> list[tuple[int, int]]:
    """Free (start, length) gaps of [0, size) around the used intervals."""
    gaps, cursor = [], 0
    for start in sorted(used):
        if start > cursor:
            gaps.append((cursor, start - cursor))
        cursor = start + used[start]
    if cursor < size:
        gaps.append((cursor, size - cursor))
    return gaps


def _expected_address(gaps: list[tuple[int, int]], size: int, top_down: bool) -> int | None:
    fitting = [g for g in gaps if g[1] >= size]
    if not fitting:
        return None
    smallest = min(length for _, length in fitting)
    candidates = [start for start, length in fitting if length == smallest]
    if top_down:
        start = max(candidates)
        return start + smallest - size
    return min(candidates)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.alloc: Allocator | None = None
        self.used: dict[int, int] = {}

    @precondition(lambda self: self.alloc is None)
    @rule(
        size=st.integers(64, 4096),
        alignment=st.sampled_from([16, 32, 64]),
        top_down=st.booleans(),
    )
    def create(self, size: int, alignment: int, top_down: bool) -> None:
        self.alloc = Allocator(size, alignment, top_down)
        self.size = size - size % alignment
        self.alignment = alignment
        self.top_down = top_down

    @precondition(lambda self: self.alloc is not None)
    @rule(nbytes=st.integers(1, 1500))
    def allocate(self, nbytes: int) -> None:
        assert self.alloc is not None
        rounded = -(-nbytes // self.alignment) * self.alignment
        expected = _expected_address(_gaps(self.used, self.size), rounded, self.top_down)
        got = self.alloc.allocate(nbytes)
        assert got == expected
        if got is not None:
            self.used[got] = rounded

    @precondition(lambda self: self.alloc is not None and bool(self.used))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        assert self.alloc is not None
        address = data.draw(st.sampled_from(sorted(self.used)))
        self.alloc.free(address)
        del self.used[address]

    @precondition(lambda self: self.alloc is not None)
    @rule()
    def free_everything(self) -> None:
        assert self.alloc is not None
        for address in list(self.used):
            self.alloc.free(address)
        self.used.clear()
        assert self.alloc.free_blocks() == [(0, self.size)]

    @invariant()
    def accounting_matches_model(self) -> None:
        if self.alloc is None:
            return
        assert self.alloc.allocations() == self.used
        assert self.alloc.used_bytes == sum(self.used.values())
        # Free blocks are exactly the model's gaps: coalesced, never adjacent, never overlapping.
        assert self.alloc.free_blocks() == _gaps(self.used, self.size)
        assert self.alloc.largest_free == max((g[1] for g in _gaps(self.used, self.size)), default=0)
        for start, length in self.used.items():
            assert start % self.alignment == 0 and length % self.alignment == 0
            assert 0 <= start and start + length <= self.size


TestAllocatorMachine = AllocatorMachine.TestCase


def test_dram_is_bottom_up_and_l1_top_down() -> None:
    spec = tt.DeviceSpec.small()
    dram = MemorySpaceState(spec, tt.MemorySpace.DRAM)
    l1 = MemorySpaceState(spec, tt.MemorySpace.L1)
    a = dram.allocate(100, 9)  # 3 pages deep in 4 banks, 128-byte aligned pages
    b = dram.allocate(100, 1)
    assert (a.address, a.aligned_page_size, b.address) == (0, 128, 3 * 128)
    c = l1.allocate(100, 4)
    assert c.address == spec.l1_bank_bytes - 112
    assert dram.used_bytes() == 4 * 4 * 128


def test_out_of_memory_names_space_request_and_largest_block() -> None:
    spec = tt.DeviceSpec.small()
    l1 = MemorySpaceState(spec, tt.MemorySpace.L1)
    l1.allocate(1024, 4 * 40)  # 40 KiB deep
    with pytest.raises(tt.OutOfMemoryError) as info:
        l1.allocate(1024, 4 * 30)
    message = str(info.value)
    assert "L1" in message and "30720" in message and str(24 * 1024) in message
    assert info.value.largest_free == 24 * 1024
    # The failed request changed nothing: the remaining block is still whole.
    assert l1.allocate(1024, 4 * 24).address == 0


def test_default_device_memory_is_lazily_committed() -> None:
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    before = rss()
    dram = MemorySpaceState(tt.DeviceSpec.wormhole_n150(), tt.MemorySpace.DRAM)
    assert dram.banks.shape == (12, 1 << 30)
    dram.banks[11, (1 << 30) - 1] = 1  # touch the very last byte
    assert rss() - before < 32 << 20
    dram.close()


def test_read_bank_bounds() -> None:
    mem = BankMemory(2, 256)
    mem.banks[1, 10:13] = [1, 2, 3]
    assert mem.read(1, 10, 3) == b"\x01\x02\x03"
    with pytest.raises(tt.ShapeError):
        mem.read(2, 0, 1)
    with pytest.raises(tt.ShapeError):
        mem.read(0, 250, 7)
    assert not np.any(mem.banks[0])
