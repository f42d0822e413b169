"""`ttflow demo`: a small inference pipeline that shows what the runtime does for a front-end.

An MLP classifier runs as two stitched programs (encoder, head) over double-buffered input
batches. The weights are pushed once as DRAM row-major and converted once to the tile layout the
programs declare; the encoder's hidden activations go to the head in L1 without leaving the
device; each batch's logits are left in L1 and moved to DRAM by the next program that needs the
room (an eviction). At the end a few batches are checked against numpy.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import ExitStack
from typing import Any, TextIO

import anyio
import numpy as np

from ._ir.binary import Binary
from ._runtime.device import Device, open_device
from ._memory.banks import MemoryView
from ._observe.memory_map import SPACES, draw_memory_map, record_memory_map, view_as_dict
from ._ir.builder import ProgramBuilder
from ._runtime.calls import empty, submit, to_device, to_host, write
from ._runtime.tensor import Tensor
from ._observe.timeline import record_timeline
from ._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout

F32 = DataType.FLOAT32
DRAM_TILE = Layout(MemorySpace.DRAM, TensorLayout.TILE, F32)
L1_TILE = Layout(MemorySpace.L1, TensorLayout.TILE, F32)


def build_binary(batch: int, d_in: int, hidden: int, classes: int) -> Binary:
    enc = ProgramBuilder("encoder")
    x = enc.input((batch, d_in), DRAM_TILE)
    w1 = enc.input((d_in, hidden), DRAM_TILE)
    enc.output(enc.relu(enc.matmul(x, w1)), L1_TILE)
    head = ProgramBuilder("head")
    h = head.input((batch, hidden), L1_TILE)
    w2 = head.input((hidden, classes), DRAM_TILE)
    head.output(head.softmax(head.matmul(h, w2)), L1_TILE)
    return Binary([enc.build(), head.build()])


def _softmax(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    e = np.exp(x - x.max(-1, keepdims=True))
    result: np.ndarray[Any, Any] = e / e.sum(-1, keepdims=True)
    return result


class _Progress:
    """A one-line bar on stderr, redrawn with carriage returns: only on a terminal, since in a
    log or a pipe every redraw would stay as a line of `\r`-joined text."""

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.total, self.done = total, 0
        self.enabled = enabled and _isatty(self.stream)

    def advance(self) -> None:
        self.done += 1
        if self.enabled:
            width = 30
            filled = width * self.done // self.total
            self.stream.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} batches")
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _weights(small: bool) -> tuple[DeviceSpec, tuple[int, int, int, int], np.ndarray[Any, Any],
                                   np.ndarray[Any, Any], list[np.ndarray[Any, Any]]]:
    """The device, the sizes (batch, d_in, hidden, classes), the weights and up to 4 inputs."""
    spec = DeviceSpec.small() if small else DeviceSpec.wormhole_n150()
    sizes = (32, 64, 64, 32) if small else (256, 1024, 1024, 256)
    batch, d_in, hidden, classes = sizes
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((d_in, hidden)) / math.sqrt(d_in)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, classes)) / math.sqrt(hidden)).astype(np.float32)
    inputs = [rng.standard_normal((batch, d_in)).astype(np.float32) for _ in range(4)]
    return spec, sizes, w1, w2, inputs


async def _pipeline(device: Device, sizes: tuple[int, int, int, int], w1: np.ndarray[Any, Any],
                    w2: np.ndarray[Any, Any], inputs: list[np.ndarray[Any, Any]], batches: int,
                    bar: _Progress | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """Runs `batches` batches, two in flight. Returns every batch's logits, all ready, and the
    weights and input slots: while the caller keeps them, they hold their memory."""
    batch, d_in, hidden, classes = sizes
    binary = build_binary(batch, d_in, hidden, classes)
    tw1, tw2 = to_device(w1, device), to_device(w2, device)  # pushed once, row-major
    tw1.name, tw2.name = "w1", "w2"  # the memory views and the memory map show the names
    slots = [empty((batch, d_in), F32, device, DRAM_TILE) for _ in range(2)]
    for i, slot in enumerate(slots):
        slot.name = f"input slot {i}"
    outputs: list[Tensor] = []
    for i in range(batches):
        slot = slots[i % 2]
        write(slot, inputs[i % len(inputs)])  # CQ1, overlaps the other slot's programs
        (h,) = submit(device, binary, 0, [slot, tw1])
        (logits,) = submit(device, binary, 1, [h, tw2])  # stitched through L1
        h.name, logits.name = f"hidden {i}", f"logits {i}"
        outputs.append(logits)
        if i >= 2:  # keep two batches in flight
            await outputs[i - 2]
            if bar is not None:
                bar.advance()
    for out in outputs[max(0, batches - 2) :]:
        await out
        if bar is not None:
            bar.advance()
    return outputs, [tw1, tw2, *slots]


async def demo(batches: int = 64, trace: str | None = None, small: bool = False,
               progress: bool = True, blas_threads: int | None = 1,
               memory_map: str | None = None, eviction: str = "lookahead") -> dict[str, Any]:
    """Runs the pipeline and returns its figures; `blas_threads` goes to `open_device`.

    `memory_map`: a PNG path for `draw_memory_map` (recording it costs an L1 and a DRAM
    memory view per command, so only when asked). `result["memory_views"]` holds what L1 and DRAM held at the end.
    """
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches must be a whole number of at least 1, got {batches!r}")
    spec, sizes, w1, w2, inputs = _weights(small)
    inputs = inputs[: min(batches, len(inputs))]
    bar = _Progress(batches, progress and batches >= 8)
    began = time.perf_counter()
    async with open_device(spec, blas_threads=blas_threads, eviction=eviction) as device:
        with record_timeline(device) as recorder, ExitStack() as stack:
            mapper = stack.enter_context(record_memory_map(device)) if memory_map else None
            outputs, resident = await _pipeline(device, sizes, w1, w2, inputs, batches, bar)
            checked = [await to_host(outputs[i]) for i in range(len(inputs))]
        wall = time.perf_counter() - began
        stats = device.stats
        views = {space.name: device.memory_view(space) for space in SPACES}
        worst = max(
            float(np.abs(got - _softmax(np.maximum(x @ w1, 0) @ w2)).max())
            for got, x in zip(checked, inputs)
        )
        if trace:
            recorder.save(trace)
        queues = recorder.queue_summary()
        l1_capacity = spec.l1_banks * spec.l1_bank_bytes
        del outputs, resident  # alive until the views were taken
    if mapper is not None and memory_map:
        draw_memory_map(mapper, memory_map, title=f"ttflow demo: {batches} batches on {spec.name}, "
                        f"eviction {eviction!r}")
    return {
        "device": spec.name,
        "batches": batches,
        "programs_run": stats.programs_run,
        "host_to_device_bytes": stats.host_to_device_bytes,
        "device_to_host_bytes": stats.device_to_host_bytes,
        "eviction_policy": eviction,
        "evictions": stats.evictions,
        "eviction_bytes": stats.eviction_bytes,
        "layout_conversions": stats.layout_conversions,
        "l1_peak_bytes": stats.l1_peak_bytes,
        "l1_capacity_bytes": l1_capacity,
        "wall_seconds": wall,
        "blas_threads": "library default" if blas_threads is None else blas_threads,
        "cq0_busy_seconds": queues["CQ0"]["busy_seconds"],
        "cq1_busy_seconds": queues["CQ1"]["busy_seconds"],
        "cq0_bytes": queues["CQ0"]["bytes"],
        "cq1_bytes": queues["CQ1"]["bytes"],
        "overlap_seconds": queues["both_busy_seconds"],
        "max_abs_error": worst,
        "trace_events": len(recorder.events),
        "commands": recorder.commands,
        "memory_views": views,
        "memory_map_commands": mapper.commands if mapper is not None else None,
    }


def _size(n: float) -> str:
    """Bytes in the largest unit that keeps the number at least 1: 512 B, 4.0 KiB, 1.5 MiB."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024 or unit == "MiB":
            break
        n /= 1024
    return f"{n:,.0f} B" if unit == "B" else f"{n:,.1f} {unit}"


def format_summary(r: dict[str, Any]) -> str:
    overlap = r["overlap_seconds"] / r["cq1_busy_seconds"] if r["cq1_busy_seconds"] else 0.0
    rows = [
        ("device", r["device"]),
        ("batches / programs run", f"{r['batches']} / {r['programs_run']}"),
        ("host -> device", _size(r["host_to_device_bytes"])),
        ("device -> host", _size(r["device_to_host_bytes"])),
        ("evictions (bytes moved)",
         f"{r['evictions']} ({_size(r['eviction_bytes'])}; policy {r['eviction_policy']!r})"),
        ("layout conversions", str(r["layout_conversions"])),
        ("L1 peak / capacity", (f"{_size(r['l1_peak_bytes'])} / {_size(r['l1_capacity_bytes'])} "
                                f"({r['l1_peak_bytes'] / r['l1_capacity_bytes']:.1%})")),
        ("wall time", f"{r['wall_seconds'] * 1e3:,.0f} ms (BLAS threads: {r['blas_threads']})"),
        ("CQ0 busy / CQ1 busy", f"{r['cq0_busy_seconds'] * 1e3:,.0f} ms / {r['cq1_busy_seconds'] * 1e3:,.0f} ms"),
        ("CQ0 / CQ1 bytes moved", f"{_size(r['cq0_bytes'])} / {_size(r['cq1_bytes'])}"),
        ("CQ1 writes overlapped", f"{overlap:.0%} of write time ran beside a CQ0 command"),
        ("max |error| vs numpy", f"{r['max_abs_error']:.1e}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def format_views(views: dict[str, MemoryView]) -> str:
    """The memory views as the summary shows them, indented under the table."""
    return "\n".join("  " + str(view).replace("\n", "\n  ") for view in views.values())


def run_demo(batches: int = 64, trace: str | None = None, small: bool = False,
             progress: bool = True, blas_threads: int | None = 1,
             memory_map: str | None = None, eviction: str = "lookahead") -> int:
    print("ttflow demo: an MLP classifier, encoder and head stitched on the device, "
          "weights resident, inputs double-buffered")
    result = anyio.run(demo, batches, trace, small, progress, blas_threads, memory_map, eviction)
    print(format_summary(result))
    print("memory at the end (weights, input slots and every batch's logits still alive):")
    print(format_views(result["memory_views"]))
    if trace:
        print(f"  trace: {trace} ({result['trace_events']} events; open it at ui.perfetto.dev)")
    if memory_map:
        print(f"  memory map: {memory_map} ({result['memory_map_commands']} commands)")
    return 0


MEMORY_BATCHES = 4  # a few outputs in L1 beside the weights and their conversions; quick on n150


async def memory(small: bool = False, batches: int = MEMORY_BATCHES) -> dict[str, MemoryView]:
    """What L1 and DRAM hold after a few batches of the demo pipeline, outputs kept alive."""
    spec, sizes, w1, w2, inputs = _weights(small)
    async with open_device(spec) as device:
        outputs, resident = await _pipeline(device, sizes, w1, w2, inputs, batches)
        views = {space.name: device.memory_view(space) for space in SPACES}
        del outputs, resident  # alive until the views were taken
    return views


def run_memory(small: bool = False, as_json: bool = False) -> int:
    views = anyio.run(memory, small)
    if as_json:
        print(json.dumps({name: view_as_dict(view) for name, view in views.items()}, indent=2))
    else:
        print(f"ttflow memory: after {MEMORY_BATCHES} batches of the demo pipeline, "
              "the weights, input slots and every batch's logits still alive")
        print(format_views(views))
    return 0
