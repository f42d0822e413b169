"""The memory map recorder against buffer geometry worked out by hand, and its PNG."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import ttflow as tt
from ttflow._observe.memory_map import (
    INSTALL_HINT,
    MemoryMapRecorder,
    draw_memory_map,
    memory_map_figure,
    record_memory_map,
    view_as_dict,
)

pytestmark = pytest.mark.anyio

L1, DRAM = tt.MemorySpace.L1, tt.MemorySpace.DRAM
SMALL = tt.DeviceSpec.small()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _tile_depth(spec: tt.DeviceSpec, shape: tuple[int, int], space: tt.MemorySpace) -> int:
    """Per-bank bytes of a float32 TILE tensor: ceil(tiles / banks) aligned 32x32 tiles."""
    tiles = _ceil(shape[0], 32) * _ceil(shape[1], 32)
    aligned = _ceil(32 * 32 * 4, spec.alignment(space)) * spec.alignment(space)
    return _ceil(tiles, spec.banks(space)) * aligned


def _row_major_depth(spec: tt.DeviceSpec, shape: tuple[int, int], space: tt.MemorySpace) -> int:
    """Per-bank bytes of a float32 ROW_MAJOR tensor: a page per row, rows dealt to the banks."""
    aligned = _ceil(shape[1] * 4, spec.alignment(space)) * spec.alignment(space)
    return _ceil(shape[0], spec.banks(space)) * aligned


async def test_a_pushed_l1_tensor_is_a_home_block_at_the_top_of_l1() -> None:
    layout = tt.Layout(L1, tt.TensorLayout.TILE)
    async with tt.open_device(SMALL) as device:
        with record_memory_map(device) as recorder:
            t = tt.to_device(np.ones((64, 96), np.float32), device, layout)
            await t
        depth = _tile_depth(SMALL, (64, 96), L1)
        assert depth == 2 * 4096  # 6 tiles over 4 banks: 2 deep
        line = SMALL.l1_bank_bytes
        assert recorder.line_bytes[L1] == line and recorder.num_banks[L1] == SMALL.l1_banks
        first, *rest = recorder.snapshots[L1]
        assert first == (0, ())  # a fresh device holds nothing
        assert [index for index, _ in rest] == [1] and recorder.commands == 1
        assert rest[-1][1] == ((line - depth, depth, "home", "(64, 96) FLOAT32 TILE"),)  # L1 fills top-down
        assert recorder.snapshots[DRAM] == [(0, ()), (1, ())]
        del t


async def test_dram_blocks_are_bottom_up_and_set_the_high_water_mark() -> None:
    async with tt.open_device(SMALL) as device:
        with record_memory_map(device) as recorder:
            a = tt.to_device(np.ones((40, 40), np.float32), device)  # DRAM ROW_MAJOR
            b = tt.to_layout(a, tt.Layout(DRAM, tt.TensorLayout.TILE))
            await b
        da = _row_major_depth(SMALL, (40, 40), DRAM)
        db = _tile_depth(SMALL, (40, 40), DRAM)
        assert (da, db) == (10 * 160, 4096)
        final = recorder.snapshots[DRAM][-1][1]
        kinds = {kind for _, _, kind, _ in final}
        assert final[0] == (0, da, "home", "(40, 40) FLOAT32 ROW_MAJOR")
        assert final[1][:2] == (da, db) and kinds <= {"home", "conversion", "pending"}
        assert recorder.high_water[DRAM] == da + db
        del a, b


async def test_snapshots_count_every_command_and_stop_when_the_block_ends() -> None:
    async with tt.open_device(SMALL) as device:
        before = device.stats.commands_run
        with record_memory_map(device) as recorder:
            t = tt.to_device(np.ones((32, 32), np.float32), device)
            u = tt.to_layout(t, tt.Layout(L1, tt.TensorLayout.TILE))
            await tt.to_host(u)
        assert recorder.on_command not in device._scheduler.listeners
        assert recorder.commands == device.stats.commands_run - before == 3
        assert all(len(s) == 4 for s in recorder.snapshots.values())
        await tt.to_host(t)  # after the block: not recorded
        assert recorder.commands == 3 and all(len(s) == 4 for s in recorder.snapshots.values())
        del t, u


async def test_a_freed_buffer_ends_its_span_at_the_next_snapshot() -> None:
    layout = tt.Layout(L1, tt.TensorLayout.TILE)
    async with tt.open_device(SMALL) as device:
        with record_memory_map(device) as recorder:
            t = tt.to_device(np.ones((32, 32), np.float32), device, layout)
            await t
            tt.deallocate(t)
            u = tt.to_device(np.ones((64, 96), np.float32), device, layout)
            await u
        line, dt, du = SMALL.l1_bank_bytes, _tile_depth(SMALL, (32, 32), L1), _tile_depth(SMALL, (64, 96), L1)
        assert dt != du  # (a block is its address, depth, kind and tensor: an equal one would continue t's span)
        # t lived from the first command until the second; u, in t's old room, to the end.
        assert recorder.spans(L1) == [(1, 2, (line - dt, dt, "home", "(32, 32) FLOAT32 TILE")),
                                      (2, 3, (line - du, du, "home", "(64, 96) FLOAT32 TILE"))]
        del u


async def test_the_last_snapshot_matches_the_memory_view() -> None:
    async with tt.open_device(SMALL) as device:
        with record_memory_map(device) as recorder:
            kept = [tt.to_device(np.full((32, 32 * (i + 1)), i, np.float32), device,
                                 tt.Layout(space, tt.TensorLayout.TILE))
                    for i, space in enumerate([L1, DRAM, L1, DRAM])]
            for t in kept:
                await t
        for space in (L1, DRAM):
            view = device.memory_view(space)
            assert recorder.snapshots[space][-1][1] == tuple(
                (b.address, b.depth, b.kind, b.describe()) for b in view.buffers)
            data = view_as_dict(view)
            assert data["used"] == sum(b["nbytes"] for b in data["buffers"]) == view.used
            assert {tuple(b["shape"]) for b in data["buffers"]} == {t.shape for t in kept if t.layout.memory is space}
        del kept


async def test_draw_memory_map_writes_a_png(tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    async with tt.open_device(SMALL) as device:
        with record_memory_map(device) as recorder:
            t = tt.to_device(np.ones((64, 64), np.float32), device, tt.Layout(L1, tt.TensorLayout.TILE))
            await t
        del t
    path = tmp_path / "map.png"
    draw_memory_map(recorder, path)  # DRAM was never used: its panel is empty, not an error
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert image.imread(path).shape[:2] == (750, 1100)


def test_drawing_without_matplotlib_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import matplotlib...` raises ImportError
    recorder = MemoryMapRecorder.__new__(MemoryMapRecorder)
    with pytest.raises(RuntimeError, match="needs matplotlib") as error:
        draw_memory_map(recorder, tmp_path / "map.png")
    assert INSTALL_HINT in str(error.value) and "[plot]" in INSTALL_HINT
    assert not (tmp_path / "map.png").exists()


async def test_a_named_tensor_is_named_in_the_views_and_the_map() -> None:
    """The name follows the value (its conversion too) into the view, the table, JSON and map."""
    pytest.importorskip("matplotlib")
    async with tt.open_device(SMALL) as device:
        with record_memory_map(device) as recorder:
            big = tt.to_device(np.ones((256, 256), np.float32), device)
            big.name = "weights"
            b = tt.ProgramBuilder("reads_tiles")  # converts big to TILE, kept beside it
            b.output(b.relu(b.input((256, 256), tt.Layout(DRAM, tt.TensorLayout.TILE))))
            (converted,) = tt.submit(device, tt.Binary([b.build()]), 0, [big])
            small = tt.to_device(np.ones((32, 32), np.float32), device)
            await converted, await small
        view = device.memory_view(DRAM)
        assert sorted((b.kind, str(b.tensor)) for b in view.buffers) == [
            ("conversion", "weights"), ("home", "None"), ("home", "None"), ("home", "weights")]
        assert "weights: (256, 256) FLOAT32 ROW_MAJOR" in str(view)
        assert [b["tensor"] for b in view_as_dict(view)["buffers"]].count("weights") == 2
        figure = memory_map_figure(recorder, title="a run")
        assert figure._suptitle.get_text() == "a run"
        dram_key = figure.axes[1].texts[-1].get_text().splitlines()
        assert dram_key[0] == "largest buffers:"
        assert "1  weights: (256, 256) FLOAT32 ROW_MAJOR" in dram_key
        default = memory_map_figure(recorder)._suptitle.get_text()
        assert default == f"{SMALL.name}: {recorder.commands} commands, eviction policy 'lookahead'"
        with pytest.raises(TypeError, match="str or None"):
            big.name = 3  # type: ignore[assignment]
        del big, converted, small


def test_a_map_labels_its_largest_buffers() -> None:
    from ttflow._observe.memory_map import LABELLED, labelled

    large = [(0, 100, (i * 60, 50 + i, "home", f"t{i}")) for i in range(LABELLED + 2)]
    unnamed = (0, 100, (0, 500, "circular_buffers", ""))     # holds no tensor
    brief = (90, 100, (900, 300, "pending", "brief"))         # tall, but for 10 commands only
    chosen = labelled([brief, *large, unnamed])
    assert [span[2][3] for span in chosen] == [f"t{i}" for i in range(2, LABELLED + 2)]


def label_boxes(figure: object) -> list[tuple[int, object]]:
    """(panel, display-space bounding box) of every number drawn inside a panel, its rounded
    white box included, as matplotlib's renderer lays them out in the saved PNG."""
    from matplotlib.transforms import Bbox

    figure.canvas.draw()  # type: ignore[attr-defined]
    renderer = figure.canvas.get_renderer()  # type: ignore[attr-defined]
    boxes = []
    for panel, ax in enumerate(figure.axes):  # type: ignore[attr-defined]
        for text in ax.texts:
            if not text.get_text().isdigit() or not text.get_visible():
                continue  # the key beside the panel
            extents = [text.get_window_extent(renderer)]
            if text.get_bbox_patch() is not None:
                extents.append(text.get_bbox_patch().get_window_extent(renderer))
            boxes.append((panel, Bbox.union(extents)))
    return boxes


def overlap(a: object, b: object) -> float:
    width = min(a.x1, b.x1) - max(a.x0, b.x0)  # type: ignore[attr-defined]
    height = min(a.y1, b.y1) - max(a.y0, b.y0)  # type: ignore[attr-defined]
    return max(width, 0.0) * max(height, 0.0)


async def many_small_dram_buffers() -> MemoryMapRecorder:
    """One large DRAM tensor, a few medium ones, then many small ones that live to the end: in
    a panel scaled to the large one, each small one is a sliver a pixel or two high, stacked on
    the next (the numbers of the eight largest used to be drawn on top of each other)."""
    async with tt.open_device(SMALL) as device:
        with record_memory_map(device) as recorder:
            kept = [tt.to_device(np.ones((512, 512), np.float32), device)]
            kept += [tt.to_device(np.ones((256, 128), np.float32), device) for _ in range(3)]
            for i in range(24):
                kept.append(tt.to_device(np.full((32, 32 + 8 * (i % 3)), i, np.float32), device))
                kept[-1].name = f"small {i}"
            for t in kept:
                await t
        del kept
    return recorder


async def test_the_numbers_in_a_panel_never_overlap() -> None:
    pytest.importorskip("matplotlib")
    recorder = await many_small_dram_buffers()
    figure = memory_map_figure(recorder, title="many small buffers")
    boxes = label_boxes(figure)
    assert len(boxes) >= 4, "the large buffer and the medium ones have room for their numbers"
    for i, (panel, box) in enumerate(boxes):
        for other_panel, other in boxes[i + 1:]:
            assert panel != other_panel or overlap(box, other) == 0, (box, other)
    # Every number in a panel is one of its key's lines, and the key has no line without one.
    for panel, ax in enumerate(figure.axes):
        drawn = sorted(int(t.get_text()) for t in ax.texts if t.get_text().isdigit())
        keys = [t for t in ax.texts if t.get_text().startswith("largest buffers:")]
        listed = [int(line.split()[0]) for line in keys[0].get_text().splitlines()[1:]] if keys else []
        assert drawn == listed == list(range(1, len(drawn) + 1)), (panel, drawn, listed)
