"""The memory map: where every buffer of L1 and DRAM sat, command by command, as a PNG.

`record_memory_map(device)` snapshots both memory spaces after each completed command (only
address, depth and kind per buffer, so a long run stays cheap to keep); `draw_memory_map`
draws one panel per space: time (commands completed) across, the bank address line up, each
buffer a rectangle coloured by its kind. It shows what a table of totals cannot: where
fragmentation comes from, how long conversions and pending outputs live, and that L1 fills
top-down while the circular buffers sit at its bottom.

matplotlib is optional (`pip install '.[plot]'` from the ttflow checkout): only drawing needs it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, final

from .._errors import FileError
from .._types import MemorySpace

if TYPE_CHECKING:
    from .._runtime.device import Device
    from .._memory.banks import MemoryView
    from .._queue import Command

__all__ = ["Block", "MemoryMapRecorder", "draw_memory_map", "memory_map_figure", "record_memory_map",
           "view_as_dict"]

Block = tuple[int, int, str, str]
"""(address, depth, kind, what) of one buffer: `depth` bytes from `address` in every bank;
`what` is `BufferView.describe()` (the tensor's name, shape, dtype and layout)."""

LABELLED = 8
"""Buffers per panel a map numbers and names in its key: the largest rectangles."""

SPACES = (MemorySpace.L1, MemorySpace.DRAM)

# Fixed colours, so that a kind looks the same in every map.
KIND_COLORS = {
    "home": "#1f77b4",
    "conversion": "#ff7f0e",
    "pending": "#7f7f7f",
    "scratch": "#d62728",
    "circular_buffers": "#2ca02c",
    "trace": "#9467bd",
}
_OTHER_COLOR = "#000000"  # a kind this module does not know yet still shows

INSTALL_HINT = "pip install '.[plot]' from the ttflow checkout"


@final
class MemoryMapRecorder:
    """Snapshots of L1 and DRAM after each command completed while attached to a device.

    `snapshots[space]` is a list of `(index, blocks)`: `index` counts the commands completed
    since recording began (0 is the state when it began) and `blocks` the space's buffers,
    sorted by address. A snapshot equal to the one before it shares its tuple.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.commands = 0
        self.num_banks: dict[MemorySpace, int] = {}
        self.line_bytes: dict[MemorySpace, int] = {}  # the size of each bank's address line
        self.high_water: dict[MemorySpace, int] = dict.fromkeys(SPACES, 0)
        self.snapshots: dict[MemorySpace, list[tuple[int, tuple[Block, ...]]]] = {s: [] for s in SPACES}
        self._snapshot()

    def on_command(self, command: Command, error: BaseException | None) -> None:
        self.commands += 1
        self._snapshot()

    def _snapshot(self) -> None:
        for space in SPACES:
            view = self.device.memory_view(space)
            self.num_banks[space] = view.num_banks
            self.line_bytes[space] = view.total // view.num_banks
            blocks = tuple([(b.address, b.depth, b.kind, b.describe()) for b in view.buffers])
            taken = self.snapshots[space]
            if taken and taken[-1][1] == blocks:
                blocks = taken[-1][1]
            elif blocks:
                top = max(address + depth for address, depth, _, _ in blocks)
                self.high_water[space] = max(self.high_water[space], top)
            taken.append((self.commands, blocks))

    def spans(self, space: MemorySpace) -> list[tuple[int, int, Block]]:
        """`(first, end, block)`: the block stayed unchanged from snapshot `first` until `end`
        (exclusive), so a buffer that lived through many commands is one rectangle. (A buffer
        freed and replaced by an equal block between two snapshots continues the span.)"""
        spans: list[tuple[int, int, Block]] = []
        open_: dict[Block, int] = {}
        for index, blocks in self.snapshots[space]:
            now = set(blocks)
            for block in [b for b in open_ if b not in now]:
                spans.append((open_.pop(block), index, block))
            for block in blocks:
                open_.setdefault(block, index)
        end = self.commands + 1
        spans.extend((first, end, block) for block, first in open_.items())
        spans.sort(key=lambda s: (s[0], s[2][0]))
        return spans


def view_as_dict(view: MemoryView) -> dict[str, Any]:
    """A memory view as plain JSON data (`ttflow memory --json`): bytes summed over banks,
    except a buffer's `address` and `depth`, which are per bank (the same in every bank)."""
    return {
        "num_banks": view.num_banks,
        "total": view.total,
        "used": view.used,
        "free": view.free,
        "largest_free_block": view.largest_free_block,
        "fragmentation": view.fragmentation,
        "buffers": [
            {
                "address": b.address,
                "depth": b.depth,
                "nbytes": b.nbytes,
                "kind": b.kind,
                "shape": list(b.shape) if b.shape is not None else None,
                "dtype": b.dtype.name if b.dtype is not None else None,
                "layout": b.layout.tensor_layout.name if b.layout is not None else None,
                "tensor": b.tensor,
            }
            for b in view.buffers
        ],
    }


@contextmanager
def record_memory_map(device: Device) -> Iterator[MemoryMapRecorder]:
    """Snapshots L1 and DRAM after every command the device completes inside the block."""
    recorder = MemoryMapRecorder(device)
    with device._scheduler.listening(recorder.on_command):
        yield recorder


def draw_memory_map(recorder: MemoryMapRecorder, path: str | os.PathLike[str],
                    title: str | None = None) -> None:
    """Writes the map as a PNG: one panel per space, time across, bank addresses up.

    `title` names the run (by default the device, the commands recorded and the eviction
    policy). The largest buffers of each panel are numbered, and a key beside the panel says
    what each holds (its tensor's `name`, shape, dtype and layout). DRAM's panel shows only the addresses ever used (its banks
    are a GiB each). RuntimeError when matplotlib is missing; the hint says how to install it.
    FileError (also an OSError) when the path cannot be written.
    """
    figure = memory_map_figure(recorder, title)
    try:
        figure.savefig(path, format="png")
    except OSError as exc:
        raise FileError.of(exc, "write the memory map to", path, writing=True, example="memory.png") from exc


def memory_map_figure(recorder: MemoryMapRecorder, title: str | None = None) -> Any:
    """The map as a matplotlib Figure (`draw_memory_map` saves it), for a caller that adds to
    it or checks what it shows."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
        from matplotlib.ticker import FuncFormatter, MaxNLocator, MultipleLocator
    except ImportError as exc:
        raise RuntimeError(f"drawing a memory map needs matplotlib: {INSTALL_HINT}") from exc

    # A bare Figure on the Agg canvas: no pyplot state, no display, safe off the main thread.
    figure = Figure(figsize=(11, 7.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(title if title is not None else _run_title(recorder), fontsize=12)
    axes = figure.subplots(len(SPACES), 1, sharex=True)
    end = recorder.commands + 1
    shown: set[str] = set()
    panels: list[tuple[Any, list[tuple[int, int, Block]]]] = []
    for ax, space in zip(axes, SPACES):
        line = recorder.line_bytes.get(space, 0)
        top = line if space is MemorySpace.L1 else recorder.high_water[space]
        top = max(top, 1)
        spans = recorder.spans(space)
        for first, stop, (address, depth, kind, _) in spans:
            shown.add(kind)
            # A white outline separates neighbours, but would wash out a buffer a pixel high.
            ax.add_patch(Rectangle((first, address), stop - first, depth,
                                   linewidth=0.3 if depth * 100 >= top else 0, edgecolor="white",
                                   facecolor=KIND_COLORS.get(kind, _OTHER_COLOR)))
        panels.append((ax, spans))
        ax.set_xlim(0, end)
        ax.set_ylim(0, top)
        # Ticks a power of two apart, so that they read as round sizes (256 KiB, not 195.3).
        ax.yaxis.set_major_locator(MultipleLocator(1 << max(0, (top // 8 - 1).bit_length())))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: _size(y)))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("address in each bank")
        ax.set_title(_title(recorder, space, top), fontsize=10, loc="left")
        ax.grid(axis="y", linewidth=0.3, alpha=0.5)
    axes[-1].set_xlabel("commands completed")
    kinds = [k for k in KIND_COLORS if k in shown] + sorted(shown - KIND_COLORS.keys())
    handles: list[Any] = [Patch(facecolor=KIND_COLORS.get(k, _OTHER_COLOR), label=k) for k in kinds]
    if handles:
        figure.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False)
    _number_the_largest(figure, panels)
    return figure


_NUMBER_STYLE: dict[str, Any] = {
    "ha": "center", "va": "center", "fontsize": 7, "clip_on": True,
    "bbox": {"boxstyle": "round,pad=0.15", "facecolor": "white", "alpha": 0.85, "linewidth": 0},
}


def _number_the_largest(figure: Any, panels: list[tuple[Any, list[tuple[int, int, Block]]]]) -> None:
    """Numbers the largest buffers of each panel whose rectangle, as drawn, holds its number
    (`labelled`), with a key beside the panel saying what each holds.

    A number sits inside its own rectangle, and rectangles never overlap, so numbers never do:
    a buffer too thin or too brief to hold one (a small DRAM buffer in a panel scaled to a large
    one) goes unnumbered rather than covering its neighbours' numbers. Whether a number fits
    depends on the rectangle's size in pixels, known once the layout is: each key first reserves
    its widest possible text, the layout runs and is then frozen, and each key is written again
    for the buffers numbered (a narrower key cannot move the axes any more)."""
    keys = []
    for ax, spans in panels:
        whats = [what for _, _, (_, _, _, what) in spans if what]
        key = None
        if whats:  # the widest key this panel could need, in a monospace font
            key = _key(ax, [f"{LABELLED}  {max(whats, key=len)}"] * min(LABELLED, len(whats)))
        keys.append(key)
    figure.draw_without_rendering()  # runs the constrained layout
    figure.set_layout_engine("none")  # and keeps its result: what follows is placed for it
    renderer = figure.canvas.get_renderer()
    for (ax, spans), key in zip(panels, keys):
        if key is None:
            continue
        key.remove()
        chosen = labelled(spans, _room_for(ax, _number_size(ax, renderer)))
        for number, (first, stop, (address, depth, _, _)) in enumerate(chosen, 1):
            ax.text((first + stop) / 2, address + depth / 2, str(number), **_NUMBER_STYLE)
        if chosen:
            _key(ax, [f"{number}  {what}" for number, (_, _, (_, _, _, what)) in enumerate(chosen, 1)])


def _key(ax: Any, lines: list[str]) -> Any:
    return ax.text(1.01, 1.0, "largest buffers:\n" + "\n".join(lines), transform=ax.transAxes,
                   va="top", ha="left", fontsize=7, family="monospace")


def _number_size(ax: Any, renderer: Any) -> tuple[float, float]:
    """Width and height in pixels of a drawn number, its white box included (every number is
    one digit: there are at most `LABELLED`)."""
    probe = ax.text(0, 0, str(LABELLED), **_NUMBER_STYLE)
    probe.update_bbox_position_size(renderer)
    text, box = probe.get_window_extent(renderer), probe.get_bbox_patch().get_window_extent(renderer)
    probe.remove()
    return (max(text.x1, box.x1) - min(text.x0, box.x0), max(text.y1, box.y1) - min(text.y0, box.y0))


def _room_for(ax: Any, size: tuple[float, float]) -> Callable[[tuple[int, int, Block]], bool]:
    """Whether a span's rectangle, as drawn in `ax`, holds a number of `size` with a pixel to
    spare on every side."""
    need_w, need_h = size[0] + 2, size[1] + 2

    def fits(span: tuple[int, int, Block]) -> bool:
        first, stop, (address, depth, _, _) = span
        (x0, y0), (x1, y1) = ax.transData.transform([(first, address), (stop, address + depth)])
        return bool(abs(x1 - x0) >= need_w and abs(y1 - y0) >= need_h)

    return fits


def labelled(spans: list[tuple[int, int, Block]],
             fits: Callable[[tuple[int, int, Block]], bool] = lambda span: True) -> list[tuple[int, int, Block]]:
    """The spans a panel names: the `LABELLED` largest (bytes times commands) that hold a
    tensor and whose rectangle has room for its number (`fits`), in address order (top of the
    key = bottom of the panel)."""
    named = [s for s in spans if s[2][3]]
    named.sort(key=lambda s: -(s[1] - s[0]) * s[2][1])
    chosen: list[tuple[int, int, Block]] = []
    for span in named:
        if len(chosen) == LABELLED:
            break
        if fits(span):
            chosen.append(span)
    return sorted(chosen, key=lambda s: (s[2][0], s[0]))


def _run_title(recorder: MemoryMapRecorder) -> str:
    device = recorder.device
    return (f"{device.spec.name}: {recorder.commands} commands, "
            f"eviction policy {device.eviction!r}")


def _title(recorder: MemoryMapRecorder, space: MemorySpace, top: int) -> str:
    banks = recorder.num_banks.get(space, 0)
    line = recorder.line_bytes.get(space, 0)
    if space is MemorySpace.L1:
        return f"L1: {banks} banks of {_size(line)}, allocated top-down"
    return (f"DRAM: {banks} banks of {_size(line)}, allocated bottom-up; "
            f"shown up to the highest address used, {_size(top)}")


def _size(n: float) -> str:
    """An address as a tick label: 0 B, 512 B, 96 KiB, 1.5 MiB."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:.4g} GiB"
