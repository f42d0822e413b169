"""`MemoryRules`: memory planning under test: fragmentation, relocation, compaction, spilling.

`fragment` fills a share of L1 (or, on small devices, DRAM) and frees every other tensor;
`request` then asks for a tensor larger than any hole but within the free bytes: the runtime must
relocate, evict, compact or spill, never lose a byte, and say OutOfMemoryError only when the
memory is not there. `convert_while_dram_comes_back` leaves DRAM full but for buffers that
tensors deallocated with a write still queued give back once it lands: memory on its way back
counts as there (the runtime waits for it), memory that is not coming does not.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import ml_dtypes
import numpy as np
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from .._runtime.device import Device
from .._errors import OutOfMemoryError, TTFlowError
from .._runtime.calls import deallocate, empty, to_device, write
from .._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout
from ._machine_base import MachineBase, _deallocate_all, arrays_zeros
from ._model import ModelTensor, drain
from ._reference import buffer_footprint, space_capacity, storage_geometry, stored
from ._strategies import INT_RANGE, _seeded_floats, _seeded_ints, arrays, layouts

__all__ = ["MemoryRules"]


class MemoryRules(MachineBase):
    """The memory-planning rules of `RuntimeStateMachine`."""

    # -- memory planning: fragmentation, relocation, spilling ------------------------------------
    #
    # Every draw of these rules comes before the device is looked at (its memory view decides
    # sizes): hypothesis needs the same draws to give the same example, whatever the device does.

    def _can_fragment_dram(self) -> bool:
        return self.fragment_dram and (
            space_capacity(self.spec, MemorySpace.DRAM) <= self.max_ballast_bytes + (8 << 20))

    def _spaces_to_fragment(self) -> list[MemorySpace]:
        spaces = [MemorySpace.L1] + ([MemorySpace.DRAM] if self._can_fragment_dram() else [])
        return [space for space in spaces if space not in self._fragmented]

    @precondition(lambda self: self.room() and bool(self._spaces_to_fragment()))
    @rule(data=st.data())
    def fragment(self, data: st.DataObject) -> None:
        """Fills a good share of one space with 4 to 8 tensors of every layout (or all alike),
        side by side, then deallocates every other one: holes, each smaller than what `request`
        then asks for.

        L1: the tensors take half to all of an L1 bank together (the runtime evicts what is in
        the way, or relocates or spills); maybe drained before and after, so that they sit
        side by side, maybe with everything in flight. DRAM (with `fragment_dram`, on small
        devices): after a drain, the tensors take 16 to 128 KiB per bank each, and a zero
        "ballast" tensor fills the rest of DRAM's largest free block. The survivors are tracked
        like any tensor (their values are checked at every drain). L1 may be fragmented first
        and DRAM then (the ballast keeps new tensors out until `request`): L1's evictions then
        need room in a fragmented DRAM."""
        space = data.draw(st.sampled_from(self._spaces_to_fragment()), label="space")
        n = data.draw(st.integers(4, 8), label="tensors")
        kib = data.draw(st.sampled_from([16, 32, 64, 128]), label="DRAM KiB per bank")
        # All alike (a survivor then fits in any hole), or each its own layout and shape.
        alike = data.draw(st.booleans(), label="alike")
        drawn: list[tuple[Layout, _ShapeChoice, int]] = []
        for k in range(n):
            layout, choice = drawn[0][:2] if alike and drawn else (
                data.draw(layouts(memory=space), label=f"layout {k}"),
                data.draw(_shape_choices(self.spec.banks(space)), label=f"shape {k}"))
            drawn.append((layout, choice, data.draw(st.integers(0, 2**32 - 1), label=f"seed {k}")))
        first = data.draw(st.integers(0, 1), label="first freed")
        # At least a page of DRAM stays free: a drain's fence needs one before the freed
        # fragments' blocks come back (they come back once their queued writes have run).
        slack = data.draw(st.sampled_from([4096, 4096, 8192, 64 * 1024]), label="slack per bank")
        share = data.draw(st.sampled_from([1.0, 0.9, 0.75, 0.5]), label="L1 share of a bank")
        settle = data.draw(st.booleans(), label="L1 settled")
        if space is MemorySpace.L1:
            depth = int(self._usable_l1_bank() * share) // n
            if settle:
                self.run(drain, self.device)
        else:
            depth = kib * 1024
        planned = []
        for layout, choice, seed in drawn:
            assert layout.dtype is not None
            shape = choice.shape(layout, self.spec, depth // 2, depth)
            if shape is not None:
                planned.append((layout, shape, _seeded_array(layout.dtype, shape, seed)))
        if space is MemorySpace.DRAM and not self._fill_dram(planned, slack):
            return
        fragments = []
        for layout, shape, array in planned:
            entry = self.push(array, layout, label=f"{self._next_label()} = fragment")
            assert entry is not None, f"a fragment of {shape} in {layout} was refused"
            fragments.append(entry)
            self._fragments.add(entry)
        if space is MemorySpace.L1 and settle:  # made (what was in L1 evicted), side by side
            self.run(drain, self.device)
        freed = fragments[first::2]
        self.call(_deallocate_all, [e.tensor for e in freed])
        for entry in freed:
            entry.deallocated = True
        self._fragmented[space] = fragments[1 - first::2]
        event(f"fragment {space.name}: {len(fragments)} tensors")

    def _fill_dram(self, planned: list[tuple[Layout, tuple[int, ...], Any]], slack: int) -> bool:
        """Drains, then makes the ballast: all of DRAM's largest free block but the room of
        `planned` and `slack` bytes per bank. False when that would exceed `max_ballast_bytes`."""
        self.run(drain, self.device)
        view = self.call(self.device.memory_view, MemorySpace.DRAM)
        banks = view.num_banks
        room = sum(storage_geometry(shape, layout, self.spec).depth for layout, shape, _ in planned)
        row = _BALLAST_WIDTH * 4  # an INT32 row: one page
        rows = (view.largest_free_block // banks - room - slack) // row * banks
        if rows <= 0 or rows * row > self.max_ballast_bytes:
            return False
        layout = Layout(MemorySpace.DRAM, TensorLayout.ROW_MAJOR, DataType.INT32)
        shape = (rows, _BALLAST_WIDTH)
        tensor = self.call(empty, shape, DataType.INT32, self.device, layout)
        entry = self.model.track(tensor, layout, _Zeros(DataType.INT32, shape),  # type: ignore[arg-type]
                                 label=f"{self._next_label()} = ballast")
        self._ballasts.append(entry)
        self._aside.add(entry)
        return True

    def _ask_l1_room(self, seed: int) -> ModelTensor | None:
        """A BFLOAT16 L1 tensor one page deeper than L1's largest free block (within a bank):
        the runtime must evict, relocate or spill to make it."""
        view = self.call(self.device.memory_view, MemorySpace.L1)
        banks = view.num_banks
        tile = DataType.BFLOAT16.tile_bytes
        pages = min(view.largest_free_block // banks // tile + 1, self._usable_l1_bank() // tile)
        if pages <= 0:
            return None
        shape = (32, 32 * pages * banks)
        layout = Layout(MemorySpace.L1, TensorLayout.TILE, DataType.BFLOAT16)
        entry = self.push(_seeded_array(DataType.BFLOAT16, shape, seed), layout,
                          label=f"{self._next_label()} = room")
        if entry is not None:
            # Its shape depends on the device's state: other rules must not draw it (the same
            # draws must play the same example), and the next drain checks and frees it.
            self._aside.add(entry)
        return entry

    @precondition(lambda self: self.room() and not self._fragmented and self._can_fragment_dram())
    @rule(data=st.data())
    def evict_into_fragmented_dram(self, data: st.DataObject) -> None:
        """L1 holds three tensors of 16 KiB per bank; DRAM is filled to the brim but for 16
        holes of 8 KiB per bank (each smaller than any of them, together more than L1 holds);
        then L1 is asked for more than its largest free block, on an idle device. The L1
        tensors must move to DRAM, which must be compacted first (an eviction makes room for
        its own targets): nothing may fail, and every value is checked at the drain after."""
        seeds = [data.draw(st.integers(0, 2**32 - 1), label=f"seed {k}") for k in range(4)]
        banks_l1 = self.spec.banks(MemorySpace.L1)
        tiles = 16 * 1024 // DataType.BFLOAT16.tile_bytes  # 16 KiB per bank
        shape = (32, 32 * tiles * banks_l1)
        l1 = Layout(MemorySpace.L1, TensorLayout.TILE, DataType.BFLOAT16)
        for seed in seeds[:3]:
            entry = self.push(_seeded_array(DataType.BFLOAT16, shape, seed), l1,
                              label=f"{self._next_label()} = in L1")
            assert entry is not None
        self.run(drain, self.device)
        banks = self.spec.banks(MemorySpace.DRAM)
        int32 = Layout(MemorySpace.DRAM, TensorLayout.ROW_MAJOR, DataType.INT32)
        kept, holes = [], []
        for _ in range(16):  # one page per bank kept, two freed: 8 KiB holes
            kept.append(self.call(empty, (banks, _BALLAST_WIDTH), DataType.INT32, self.device, int32))
            holes.append(self.call(empty, (2 * banks, _BALLAST_WIDTH), DataType.INT32, self.device, int32))
        for tensor in kept:
            entry = self.model.track(tensor, int32, stored(arrays_zeros(tensor.shape, DataType.INT32), DataType.INT32),
                                     label=f"{self._next_label()} = between holes")
            self._aside.add(entry)
        if not self._fill_dram([], 0):
            self.call(_deallocate_all, holes)
            return
        self.call(_deallocate_all, holes)
        self.run(drain, self.device)
        dram = self.call(self.device.memory_view, MemorySpace.DRAM)
        view = self.call(self.device.memory_view, MemorySpace.L1)
        made = self._ask_l1_room(seeds[3])
        fits = dram.free >= 1.25 * view.total + 8192 * banks  # all of L1 would fit in DRAM's holes
        event(f"evict_into_fragmented_dram: largest DRAM hole {dram.largest_free_block // banks} B, "
              f"{'certain' if fits else 'may fail'}")
        if made is not None and not fits:
            made.may_fail = True
        self.drain_and_check()
        self._let_go_of_ballast()

    @precondition(lambda self: self.room() and not self._fragmented and self._can_fragment_dram()
                  and self.has(lambda e: e.usable))
    @rule(data=st.data())
    def convert_while_dram_comes_back(self, data: st.DataObject) -> None:
        """On an idle device, one to six "holes" (INT32 tensors of 1 to 8 pages a bank) and a
        ballast over the rest of DRAM's largest free block; then a new value written into
        each hole, queued on CQ1, and the hole deallocated at once: its buffer comes back
        only when its write lands. Then a tracked tensor converted into a DRAM layout. The
        model's prediction is computed from DRAM's free bytes and the holes' buffers not
        back yet, both read in one step of the loop just before: the conversion is made when
        they hold it together (the runtime waits for the writes if it must, then relocates or
        compacts), and raises OutOfMemoryError when they do not (docs/memory.md, "Wait for
        memory on its way back"). Every value is checked at the drain after."""
        source = self.pick(data, lambda e: e.usable, label="source")
        layout = data.draw(layouts(source.dtype, memory=MemorySpace.DRAM), label="to")
        pages = data.draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=6),
                          label="hole pages a bank")
        slack = data.draw(st.sampled_from([4096, 4096, 16384, 65536]), label="slack a bank")
        self.run(drain, self.device)
        banks = self.spec.banks(MemorySpace.DRAM)
        int32 = Layout(MemorySpace.DRAM, TensorLayout.ROW_MAJOR, DataType.INT32)
        holes = []
        for k in pages:
            tensor = self.call(empty, (k * banks, _BALLAST_WIDTH), DataType.INT32, self.device, int32)
            zeros = stored(arrays_zeros(tensor.shape, DataType.INT32), DataType.INT32)
            entry = self.model.track(tensor, int32, zeros, label=f"{self._next_label()} = hole")
            self._aside.add(entry)  # deallocated below, never picked
            holes.append(entry)
        if not self._fill_dram([], slack):
            self.call(_deallocate_all, [e.tensor for e in holes])
            for entry in holes:
                entry.deallocated = True
            return
        for entry in holes:
            self.call(write, entry.tensor, np.ones(entry.shape, np.int32))
            self.call(deallocate, entry.tensor)
            entry.deallocated = True
        free, returning = self.call(_free_and_returning, self.device, [e.tensor for e in holes])
        resolved = layout.resolve(source.dtype)
        need = storage_geometry(source.shape, resolved, self.spec).depth * banks
        left = free + returning - need
        if left == 0 or free == need:
            # Nothing would be left for the drain's fence (allocated at call time, before or
            # after the conversion is made): not asked.
            event("convert_while_dram_comes_back: an exact fit, not asked")
        else:
            converted = self.convert(source, resolved)
            assert converted is not None
            if left < 0:
                converted.fails_with = OutOfMemoryError
            event("convert_while_dram_comes_back: " + (
                "fits in the free bytes" if need <= free else
                "waits for the holes" if left > 0 else "more than comes back: OutOfMemoryError"))
        self.drain_and_check()
        self._let_go_of_ballast()

    @precondition(lambda self: bool(self._fragmented))
    @rule(data=st.data())
    def request(self, data: st.DataObject) -> None:
        """After `fragment`: a tensor larger than any free block of the space but within its
        free bytes. DRAM must make it (relocating buffers: counted in `stats.relocations`
        when the device was idle), L1 must make it too (relocating, evicting, or spilling it
        to DRAM); a request larger than DRAM's free bytes, or than an L1 bank, must raise
        OutOfMemoryError at once, with the memory view. Then, maybe, a write into a surviving
        fragment, or its deallocation, or (L1) a conversion of it, queued behind the moves;
        then (always for DRAM) a drain checks every value, and the ballast is let go."""
        space = data.draw(st.sampled_from(sorted(self._fragmented, key=lambda s: s.name)), label="space")
        survivors = self._fragmented.pop(space)
        settle = data.draw(st.booleans(), label="settle first")
        too_big = data.draw(st.integers(0, 7), label="too big") == 0
        layout = data.draw(layouts(memory=space), label="layout")
        assert layout.dtype is not None
        choice = data.draw(_shape_choices(self.spec.banks(space)), label="shape")
        use_empty = too_big or data.draw(st.booleans(), label="empty")
        seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
        live = [e for e in survivors if e.usable]
        then = data.draw(st.sampled_from(["nothing", "write", "deallocate", "to_layout"]), label="then")
        target = data.draw(st.sampled_from(live), label="survivor") if live else None
        new_value = target_layout = None
        if target is not None and then == "write":
            new_value = data.draw(arrays(target.dtype, target.shape), label="new value")
        if target is not None and then == "to_layout":
            target_layout = data.draw(layouts(target.dtype, memory=MemorySpace.DRAM), label="to")
        finish = space is MemorySpace.DRAM or data.draw(st.booleans(), label="drain")

        if settle:
            self.run(drain, self.device)
        view = self.call(self.device.memory_view, space)
        banks = view.num_banks
        size = view.total // banks
        if too_big:
            lo = size if space is MemorySpace.L1 else view.free // banks
            hi = 2 * lo + 4096
        else:
            lo, hi = view.largest_free_block // banks, view.free // banks
            if space is MemorySpace.DRAM:
                hi -= 4096  # the drain's fence needs a page
            hi = min(hi, 2 * lo, lo + _MAX_REQUEST_DEPTH)
        shape = choice.shape(layout, self.spec, lo, hi)
        made = self._ask(space, layout, shape, None if use_empty else seed, settle) if shape else None
        if shape is None:  # not fragmented (the ballast went, say): nothing to ask
            event(f"request {space.name}: nothing to ask")
        # The rest does not depend on what the device did (see above).
        if target is not None and then == "write":
            self.call(write, target.tensor, new_value)
            target.expected = stored(new_value, target.dtype)
        elif target is not None and then == "deallocate":
            self.call(deallocate, target.tensor)
            target.deallocated = True
            if made is not None:
                made.moved = False  # its block may be what was missing
        elif target is not None and then == "to_layout" and space is MemorySpace.L1:
            assert target_layout is not None
            self.convert(target, target_layout)
        if finish:
            self.drain_and_check()
            if made is not None:
                made.check_moved(self.call(_relocations, self.device))
        self._let_go_of_ballast()

    def _ask(self, space: MemorySpace, layout: Layout, shape: tuple[int, ...], seed: int | None,
             settled: bool) -> _Request | None:
        """`empty` (seed None) or `to_device` of `shape` in `space`, checked against what the
        runtime promises from the memory view taken just before; the request, or None when it
        was refused at once (as it had to be)."""
        assert layout.dtype is not None
        depth = storage_geometry(shape, layout, self.spec).depth
        array = None if seed is None else _seeded_array(layout.dtype, shape, seed)
        before = self.call(_relocations, self.device)
        view, outcome = self.call(_allocating, self.device, space, layout, shape, array)
        banks = view.num_banks
        if depth > view.total // banks or (space is MemorySpace.DRAM and depth * banks > view.free):
            assert isinstance(outcome, OutOfMemoryError), (
                f"a request of {depth} bytes per bank in {space.name} ({view.free} bytes free "
                f"over {banks} banks) gave {outcome!r}, not OutOfMemoryError at once")
            assert outcome.view is not None, f"the OutOfMemoryError carries no memory view: {outcome}"
            event(f"request {space.name}: refused at once")
            return None
        assert not isinstance(outcome, BaseException), (
            f"a request of {depth} bytes per bank in {space.name}, within its {view.free} free "
            f"bytes (largest free block {view.largest_free_block}) raised {outcome!r}")
        moved = depth > view.largest_free_block // banks
        # L1 always makes it (or spills it to DRAM), DRAM permitting: while DRAM is fragmented
        # too (its ballast in place), on an idle device with DRAM's free bytes 1.25 times what
        # L1 holds and asks (a row-major page's alignment is coarser in DRAM), evictions
        # compact DRAM first and cannot fail.
        # DRAM relocates, compacting if it must: on an idle device every buffer may move, so a
        # request within the free bytes is made.
        if space is MemorySpace.L1 and self._ballasts:
            dram = self.call(self.device.memory_view, MemorySpace.DRAM)
            certain = settled and dram.free >= 1.25 * (view.used + depth * banks) + 8192 * dram.num_banks
            event(f"request L1 with DRAM fragmented: {'certain' if certain else 'may fail'}")
        else:
            certain = space is MemorySpace.L1 or not moved or settled
        expected = stored(array if array is not None else arrays_zeros(shape, layout.dtype), layout.dtype)
        entry = self.model.track(
            outcome, layout, expected, may_fail=not certain,
            label=f"{self._next_label()} = {'empty' if array is None else 'to_device'} (request)")
        self._aside.add(entry)  # deallocated by the next `drain_and_check`, once checked
        event(f"request {space.name}: {'larger than any free block' if moved else 'fits'}, "
              f"{'certain' if certain else 'may fail'}")
        # On an idle device, DRAM can only have made a block larger than its largest by moving.
        return _Request(entry, before, moved and settled and certain and space is MemorySpace.DRAM,
                        f"DRAM made a {depth}-byte block with the largest free block "
                        f"{view.largest_free_block // banks} bytes, and relocated nothing")

    def _let_go_of_ballast(self) -> None:
        """Reads each ballast back (zeros: no move wrote into it), deallocates it, and drains:
        a ballast deallocated by another rule while its zeros were still queued is freed only
        once they are written, and `room` says no until then."""
        if not self._ballasts:
            return
        for entry in self._ballasts:
            if not entry.deallocated:
                self.observe(entry, "to_host")
                self.call(deallocate, entry.tensor)
                entry.deallocated = True
        self.run(drain, self.device)
        self._ballasts = []



_BALLAST_WIDTH = 1024
"""INT32 elements per row of a ballast: one 4 KiB page per row."""
_MAX_REQUEST_DEPTH = 1 << 20
"""`request` asks DRAM for at most about twice this many bytes per bank (arrays to draw)."""


@attrs.frozen(eq=False)
class _Zeros:
    """What a ballast holds: zeros (an `ExpectedValue` without its two arrays of int64, which
    for tens of MiB would cost more than the device)."""

    dtype: DataType
    shape: tuple[int, ...]

    def check(self, actual: Any, what: str = "tensor") -> None:
        a = np.asarray(actual)
        assert a.dtype == self.dtype.host_dtype and a.shape == self.shape, (
            f"{what}: to_host gave {a.dtype} {a.shape}, expected {self.dtype.host_dtype} {self.shape}")
        if a.any():
            index = tuple(int(i) for i in np.argwhere(a)[0])
            raise AssertionError(f"{what}: {int(np.count_nonzero(a))} elements are not 0; the first, "
                                 f"at {index}, is {a[index]!r}")


@attrs.define
class _Request:
    """A tensor `request` made, and whether it must have relocated something (`moved`)."""

    entry: ModelTensor
    relocations_before: int
    moved: bool
    message: str

    def check_moved(self, relocations: int) -> None:
        """After a drain: the relocations counter went up if it had to, and an event says what
        became of the request."""
        entry = self.entry
        event(f"request {entry.home.memory.name}: " + (
            "failed" if entry.error is not None else
            "now in DRAM (spilled or evicted)" if entry.tensor.layout.memory is not entry.home.memory else
            "relocated" if relocations > self.relocations_before else "made"))
        if self.moved and entry.error is None:
            assert relocations > self.relocations_before, self.message


@attrs.frozen
class _ShapeChoice:
    """How `request` and `fragment` shape a tensor, drawn before the size is known."""

    width: int
    fewer: int
    tall: int
    trim: tuple[int, int]

    def shape(self, layout: Layout, spec: DeviceSpec, lo: int, hi: int) -> tuple[int, ...] | None:
        """A 2-D shape whose storage in `layout` takes more than `lo` and at most `hi` bytes per
        bank (`fewer` pages than the most that fit, its edges trimmed within its last tile);
        None if there is none."""
        assert layout.dtype is not None
        banks = spec.banks(layout.memory)
        alignment = spec.alignment(layout.memory)
        tile = layout.tensor_layout is TensorLayout.TILE
        page = layout.dtype.tile_bytes if tile else self.width * layout.dtype.itemsize
        aligned = -(-page // alignment) * alignment
        per_bank = hi // aligned
        if per_bank <= 0 or per_bank * aligned <= lo:
            return None
        pages = per_bank * banks - self.fewer % banks
        if not tile:
            return (pages, self.width)
        tall = max(d for d in range(1, self.tall + 1) if pages % d == 0)
        shape = (32 * tall - self.trim[0], 32 * (pages // tall) - self.trim[1])
        assert storage_geometry(shape, layout, spec).depth == per_bank * aligned
        return shape


@functools.cache
def _shape_choices(banks: int) -> st.SearchStrategy[_ShapeChoice]:
    return st.builds(
        _ShapeChoice, st.sampled_from([256, 33, 1000]), st.integers(0, banks - 1),
        st.sampled_from([1, 2, 4, 8]), st.tuples(st.integers(0, 31), st.integers(0, 31)))


def _seeded_array(dtype: DataType, shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    """A host array for a `dtype` tensor of `shape`, from `seed` (its shape depends on the
    device's state, so it cannot be drawn as the others are)."""
    if dtype.is_float:
        values = _seeded_floats(seed, shape)
        return values.astype(ml_dtypes.bfloat16) if dtype is DataType.BFLOAT16 else values
    low, high = INT_RANGE[dtype]
    return _seeded_ints(seed, shape, low, high).astype(dtype.host_dtype)


def _relocations(device: Device) -> int:
    return device.stats.relocations


def _free_and_returning(device: Device, tensors: list[Any]) -> tuple[int, int]:
    """DRAM's free bytes, and the bytes of the DRAM storages `tensors` (deallocated) still
    hold until the commands queued on them complete, read in one step of the loop."""
    free = device.memory_view(MemorySpace.DRAM).free
    returning = sum(buffer_footprint(buffer, device.spec) for tensor in tensors
                    for _, buffer in tensor.storages if buffer.space is MemorySpace.DRAM)
    return free, returning


def _allocating(device: Device, space: MemorySpace, layout: Layout, shape: tuple[int, ...],
                array: Any) -> tuple[Any, Any]:
    """The memory view of `space`, then `empty` (array None) or `to_device` in one step of the
    loop: the tensor, or the TTFlowError it raised."""
    view = device.memory_view(space)
    assert layout.dtype is not None
    try:
        if array is None:
            return view, empty(shape, layout.dtype, device, layout)
        return view, to_device(array, device, layout)
    except TTFlowError as exc:
        return view, exc

