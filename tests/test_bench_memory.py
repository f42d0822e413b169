"""`ttflow._bench.belady` (the offline optimum of L1 eviction) on hand-made access sequences
with known answers, the recorder on a real device, and a quick run of `ttflow._bench.memory`."""

from __future__ import annotations

import math

import anyio
import numpy as np
import pytest

import ttflow as tt
from ttflow._bench import belady, memory
from ttflow._bench.belady import AccessTrace, lower_bound, simulate


def _abc(clean: bool) -> tuple[AccessTrace, list[int]]:
    """Three items of depth 1 (8 bytes each), needed A B C A B C; all read by the host at the end."""
    trace = AccessTrace()
    items = [trace.item(1, 8, clean=clean) for _ in range(3)]
    for i in (0, 1, 2, 0, 1, 2):
        trace.step([items[i]])
    trace.step(uses=[trace.items[i].value for i in items])
    return trace, items


def test_everything_fits_nothing_moves() -> None:
    trace, _ = _abc(clean=False)
    for rule in belady.RULES:
        r = simulate(trace, 3, rule)
        assert (r.evictions, r.eviction_bytes, r.reloads, r.overflow_steps) == (0, 0, 0, 0)
        assert r.peak == 3
    assert lower_bound(trace, 3) == 0


def test_farthest_next_use_beats_lru_on_reloads() -> None:
    # Capacity 2, A B C A B C: LRU always throws out the one needed next (every later need
    # misses, 3 reloads); MIN evicts B at C (A is needed sooner), then A at B (never again): 1.
    trace, _ = _abc(clean=True)
    minimum, lru = simulate(trace, 2, "belady"), simulate(trace, 2, "lru")
    assert (minimum.reloads, minimum.evictions) == (1, 2)
    assert (lru.reloads, lru.evictions) == (3, 4)
    assert minimum.eviction_bytes == lru.eviction_bytes == 0  # clean: copying out is free
    assert simulate(trace, 2, "optimum").reloads == 1


def test_farthest_next_use_beats_lru_on_bytes_copied() -> None:
    # The same with dirty items (program outputs): each first eviction copies 8 bytes. MIN
    # copies B, then A (2 copies); LRU copies A, B and C, then moves a clean A for free.
    trace, _ = _abc(clean=False)
    minimum, lru = simulate(trace, 2, "optimum"), simulate(trace, 2, "lru")
    assert (minimum.eviction_bytes, minimum.dirty_evictions) == (16, 2)
    assert (lru.eviction_bytes, lru.dirty_evictions, lru.evictions) == (24, 3, 4)
    assert simulate(trace, 2, "belady").eviction_bytes == 16
    # The floor: with all three alive and room for two, one must have been copied out.
    assert lower_bound(trace, 2) == 8


def test_a_clean_item_goes_before_a_dirty_one_needed_later() -> None:
    # Capacity 2. A is made in L1 (dirty), B comes from DRAM (clean); C needs room. A's next use
    # is later than B's, so plain MIN copies A out; evicting B copies nothing (B is reloaded).
    trace = AccessTrace()
    a, b, c = trace.item(1, 100), trace.item(1, 100, clean=True), trace.item(1, 100, clean=True)
    trace.step([a])
    trace.step([b])
    trace.step([c])
    trace.step([b])
    trace.step([a])
    best, plain = simulate(trace, 2, "optimum"), simulate(trace, 2, "belady")
    assert (best.eviction_bytes, best.reloads) == (0, 1)
    assert (plain.eviction_bytes, plain.reloads) == (100, 1)
    assert lower_bound(trace, 2) == 0


def test_a_dead_value_is_dropped_for_free() -> None:
    # A is made and never read again (its handle may even be alive): the offline policy knows.
    trace = AccessTrace()
    a, b = trace.item(1, 50), trace.item(1, 50)
    trace.step([a])
    trace.step([b])
    r = simulate(trace, 1)
    assert (r.evictions, r.eviction_bytes, r.dead_drops) == (0, 0, 1)
    assert lower_bound(trace, 1) == 0


def test_a_host_read_keeps_a_value_alive_without_needing_l1() -> None:
    trace = AccessTrace()
    a, b = trace.item(1, 50), trace.item(1, 50)
    trace.step([a])
    trace.step([b])
    trace.step(uses=[trace.items[a].value])  # to_host(A): from DRAM, after A was copied there
    r = simulate(trace, 1)
    assert (r.evictions, r.eviction_bytes, r.reloads) == (1, 50, 0)
    assert lower_bound(trace, 1) == 50


def test_a_footprint_takes_room_and_the_cost_is_nbytes() -> None:
    # A (depth 2, 128 bytes copied) must leave while a program's circular buffers take 3 of 4.
    trace = AccessTrace()
    a = trace.item(2, 128)
    trace.step([a])
    trace.step(footprint=3)
    trace.step([a])
    r = simulate(trace, 4)
    assert (r.evictions, r.eviction_bytes, r.reloads, r.reload_bytes) == (1, 128, 1, 128)
    assert r.peak == 3
    assert lower_bound(trace, 4) == 128  # the cheapest dirty item's 64 bytes per unit of depth


def test_a_step_larger_than_l1_spills_instead_of_evicting() -> None:
    trace = AccessTrace()
    a, big = trace.item(1, 10), trace.item(5, 50)
    trace.step([a])
    trace.step([big])  # needs 5 of 4: the runtime puts it in DRAM
    trace.step([a, big])  # 6 of 4: spilled too
    trace.step([a])
    r = simulate(trace, 4)
    assert (r.overflow_steps, r.evictions, r.eviction_bytes) == (2, 0, 0)
    assert lower_bound(trace, 4) == 0


def test_items_of_one_value_share_its_liveness() -> None:
    # Two L1 copies of one value (two layouts): the value is alive while either is needed.
    trace = AccessTrace()
    v = trace.value()
    tile, rows = trace.item(1, 10, value=v), trace.item(1, 10, value=v)
    other = trace.item(1, 10)
    trace.step([tile])
    trace.step([other])
    trace.step([rows])
    r = simulate(trace, 1)
    assert (r.dirty_evictions, r.eviction_bytes) == (1, 10)  # the tile copy, to make room for other
    assert r.dead_drops == 1  # other, once its value is dead


def test_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="rule"):
        simulate(AccessTrace(), 1, "fifo")


def test_recorder_sees_l1_inputs_outputs_and_footprints() -> None:
    f32 = tt.DataType.FLOAT32
    binary = memory.chain_binary(2, 32, 64)

    async def main() -> belady.TraceRecorder:
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            rng = np.random.default_rng(0)
            ws = [tt.to_device(rng.standard_normal((64, 64)).astype(np.float32), device) for _ in range(2)]
            x = tt.to_device(rng.standard_normal((32, 64)).astype(np.float32), device, memory.DRAM_TILE)
            with belady.TraceRecorder(device) as recorder:
                for _ in range(2):
                    (h,) = tt.submit(device, binary, 0, [x, ws[0]])
                    (y,) = tt.submit(device, binary, 1, [h, ws[1]])
                    await tt.to_host(y)
            assert recorder._listen not in device._scheduler.listeners
            assert y.dtype is f32
        return recorder

    recorder = anyio.run(main)
    trace = recorder.trace
    programs = [s for s in trace.steps if s.name.startswith("layer")]
    assert [s.name for s in trace.steps] == ["layer0", "layer1", "ReadCommand"] * 2
    # layer0 needs w0 (L1) and makes h (L1); layer1 needs h and w1; the weights are the same
    # items both times, the activations new ones.
    assert [len(s.needs) for s in programs] == [2, 2, 2, 2]
    assert programs[0].needs[0] == programs[2].needs[0]  # w0
    assert programs[1].needs[1] == programs[3].needs[1]  # w1
    assert len(trace.items) == 4  # w0, w1, h twice
    assert all(s.footprint > 0 for s in programs)
    # a weight pushed row-major has no DRAM copy in TILE: its L1 copy is dirty, as the runtime
    # counts it (evicting it copies)
    assert not any(item.clean for item in trace.items)
    assert trace.items[programs[0].needs[0]].depth == 4096  # 4 tiles over 4 banks
    assert recorder.spilled_outputs == 0
    assert simulate(trace, tt.DeviceSpec.small().l1_bank_bytes).evictions == 0


def test_recorder_counts_a_weight_with_a_dram_tile_copy_as_clean() -> None:
    binary = memory.chain_binary(1, 32, 64)

    async def main() -> AccessTrace:
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            w = tt.to_device(np.eye(64, dtype=np.float32), device, memory.DRAM_TILE)
            x = tt.to_device(np.ones((32, 64), np.float32), device, memory.DRAM_TILE)
            with belady.TraceRecorder(device) as recorder:
                (y,) = tt.submit(device, binary, 0, [x, w])
                np.testing.assert_allclose(await tt.to_host(y), np.tanh(np.ones((32, 64))), rtol=1e-6)
        return recorder.trace

    trace = anyio.run(main)
    assert [item.clean for item in trace.items] == [True]


def test_a_wrong_value_is_not_let_through() -> None:
    async def main() -> None:
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            stored = np.zeros((2, 2), np.float32)
            out = tt.to_device(stored, device)
            assert await memory._checked("w", [out], [stored + np.float32(1e-7)], 1e-5) == np.float32(1e-7)
            for wrong in (1e-3, math.nan):
                with pytest.raises(memory.ValueMismatch):
                    await memory._checked("w", [out], [stored + np.float32(wrong)], 1e-5)

    anyio.run(main)


def test_quick_run_structure_and_lookahead_copies_no_more_than_eager() -> None:
    result = memory.run(quick=True)
    assert result["benchmark"] == "memory" and result["device"] == "small"
    assert set(result["workloads"]) == {"demo_pipeline", "chained_weights", "decode_growing"}
    for name, w in result["workloads"].items():
        for policy in memory.POLICIES:
            figures = w[policy]
            for key in ("eviction_bytes", "evictions", "seconds", "max_abs_error", "residency_copy_bytes"):
                assert key in figures, (name, policy, key)
            assert figures["seconds"] > 0
        for key in ("optimum_eviction_bytes", "lower_bound_eviction_bytes", "lookahead_over_optimum",
                    "lookahead_over_eager"):
            assert key in w, (name, key)
        la, ea = w["lookahead"]["eviction_bytes"], w["eager"]["eviction_bytes"]
        assert la <= ea, name
        # the floor is below the offline schedule, which is below what the runtime managed
        assert w["lower_bound_eviction_bytes"] <= w["optimum_eviction_bytes"] <= la, name
        assert w["trace"]["steps"] > 0
    # each workload puts L1 under pressure where it should
    workloads = result["workloads"]
    assert workloads["chained_weights"]["lookahead"]["eviction_bytes"] == 0
    assert workloads["chained_weights"]["eager"]["evictions"] > 0
    assert workloads["decode_growing"]["optimum_eviction_bytes"] > 0
    assert workloads["demo_pipeline"]["optimum_eviction_bytes"] > 0
    table = memory.format_table(result)
    assert "decode_growing" in table and "lookahead / optimum" in table
