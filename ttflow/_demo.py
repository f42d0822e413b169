"""`ttflow demo`: a small inference pipeline that shows what the runtime does for a front-end.

An MLP classifier runs as two stitched programs (encoder, head) over double-buffered input
batches. The weights are pushed once as DRAM row-major and converted once to the tile layout the
programs declare; the encoder's hidden activations go to the head in L1 without leaving the
device; each batch's logits are left in L1 and moved to DRAM by the next program that needs the
room (an eviction). At the end a few batches are checked against numpy.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

import anyio
import numpy as np

from ._device import open_device
from ._binary import Binary
from ._program import ProgramBuilder
from ._runtime import empty, submit, to_device, to_host, write
from ._tensor import Tensor
from ._timeline import record_timeline
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


async def demo(batches: int = 64, trace: str | None = None, small: bool = False,
               progress: bool = True, blas_threads: int | None = 1) -> dict[str, Any]:
    """Runs the pipeline and returns its figures; `blas_threads` goes to `open_device`."""
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ValueError(f"batches must be a whole number of at least 1, got {batches!r}")
    spec = DeviceSpec.small() if small else DeviceSpec.wormhole_n150()
    batch, d_in, hidden, classes = (32, 64, 64, 32) if small else (256, 1024, 1024, 256)
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((d_in, hidden)) / math.sqrt(d_in)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, classes)) / math.sqrt(hidden)).astype(np.float32)
    inputs = [rng.standard_normal((batch, d_in)).astype(np.float32) for _ in range(min(batches, 4))]
    binary = build_binary(batch, d_in, hidden, classes)
    bar = _Progress(batches, progress and batches >= 8)
    began = time.perf_counter()
    async with open_device(spec, blas_threads=blas_threads) as device:
        with record_timeline(device) as recorder:
            tw1, tw2 = to_device(w1, device), to_device(w2, device)  # pushed once, row-major
            slots = [empty((batch, d_in), F32, device, DRAM_TILE) for _ in range(2)]
            outputs: list[Tensor] = []
            for i in range(batches):
                slot = slots[i % 2]
                write(slot, inputs[i % len(inputs)])  # CQ1, overlaps the other slot's programs
                (h,) = submit(device, binary, 0, [slot, tw1])
                (logits,) = submit(device, binary, 1, [h, tw2])  # stitched through L1
                outputs.append(logits)
                if i >= 2:  # keep two batches in flight
                    await outputs[i - 2]
                    bar.advance()
            for out in outputs[max(0, batches - 2) :]:
                await out
                bar.advance()
            checked = [await to_host(outputs[i]) for i in range(min(batches, len(inputs)))]
        wall = time.perf_counter() - began
        stats = device.stats
        worst = max(
            float(np.abs(got - _softmax(np.maximum(x @ w1, 0) @ w2)).max())
            for got, x in zip(checked, inputs)
        )
        if trace:
            recorder.save(trace)
        queues = recorder.queue_summary()
        l1_capacity = spec.l1_banks * spec.l1_bank_bytes
    return {
        "device": spec.name,
        "batches": batches,
        "programs_run": stats.programs_run,
        "host_to_device_bytes": stats.host_to_device_bytes,
        "device_to_host_bytes": stats.device_to_host_bytes,
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
        ("evictions (bytes moved)", f"{r['evictions']} ({_size(r['eviction_bytes'])})"),
        ("layout conversions", str(r["layout_conversions"])),
        ("L1 peak / capacity", f"{_size(r['l1_peak_bytes'])} / {_size(r['l1_capacity_bytes'])} "
         f"({r['l1_peak_bytes'] / r['l1_capacity_bytes']:.1%})"),
        ("wall time", f"{r['wall_seconds'] * 1e3:,.0f} ms (BLAS threads: {r['blas_threads']})"),
        ("CQ0 busy / CQ1 busy", f"{r['cq0_busy_seconds'] * 1e3:,.0f} ms / {r['cq1_busy_seconds'] * 1e3:,.0f} ms"),
        ("CQ0 / CQ1 bytes moved", f"{_size(r['cq0_bytes'])} / {_size(r['cq1_bytes'])}"),
        ("CQ1 writes overlapped", f"{overlap:.0%} of write time ran beside a CQ0 command"),
        ("max |error| vs numpy", f"{r['max_abs_error']:.1e}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def run_demo(batches: int = 64, trace: str | None = None, small: bool = False,
             progress: bool = True, blas_threads: int | None = 1) -> int:
    print("ttflow demo: an MLP classifier, encoder and head stitched on the device, "
          "weights resident, inputs double-buffered")
    result = anyio.run(demo, batches, trace, small, progress, blas_threads)
    print(format_summary(result))
    if trace:
        print(f"  trace: {trace} ({result['trace_events']} events; open it at ui.perfetto.dev)")
    return 0
