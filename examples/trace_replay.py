"""Trace capture and replay: a two-program pipeline captured once, then replayed per batch.

`tt.capture_trace` records the submits inside it (they also run once, as usual). Every decision
(addresses, conversions, evictions) is made at capture; `tt.execute_trace` then queues the whole
recorded sequence as one command that allocates nothing. Inputs change between replays by
`tt.write`, as in ttnn; the traced outputs hold the latest replay's values.

The example compares the time per batch with the same pipeline submitted program by program:
both timed loops do the same work (write the batch, queue the work, read the result back), and
every result of both is checked against numpy after the clocks stop.
"""

from __future__ import annotations

import time

import anyio
import numpy as np

import ttflow as tt

F32 = tt.DataType.FLOAT32
DRAM_TILE = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
L1_TILE = tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE, F32)


def build(batch: int, d: int, classes: int) -> tt.Binary:
    enc = tt.ProgramBuilder("encoder")
    x = enc.input((batch, d), DRAM_TILE)
    w = enc.input((d, d), L1_TILE)
    enc.output(enc.relu(enc.matmul(x, w)), L1_TILE)
    head = tt.ProgramBuilder("head")
    h = head.input((batch, d), L1_TILE)
    wh = head.input((d, classes), L1_TILE)
    head.output(head.matmul(h, wh), DRAM_TILE)
    return tt.Binary([enc.build(), head.build()])


def reference(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    """What the pipeline computes, in numpy."""
    return np.maximum(x @ w1, 0) @ w2


def speedup(before: float, after: float) -> str:
    """How `after` compares with `before`, both times: "2.50x faster", "1.25x slower"."""
    ratio = before / after
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


async def main(batches: int = 50, batch: int = 32, d: int = 128, classes: int = 32,
               spec: tt.DeviceSpec | None = None) -> dict[str, float]:
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
    w2 = (rng.standard_normal((d, classes)) / np.sqrt(d)).astype(np.float32)
    xs = [rng.standard_normal((batch, d)).astype(np.float32) for _ in range(batches)]
    binary = build(batch, d, classes)
    async with tt.open_device(spec) as device:
        tw1, tw2 = tt.to_device(w1, device), tt.to_device(w2, device)  # pushed once
        slot = tt.empty((batch, d), F32, device, DRAM_TILE)

        untraced_out = []
        begin = time.perf_counter()  # program by program
        for x in xs:
            tt.write(slot, x)
            (h,) = tt.submit(device, binary, 0, [slot, tw1])
            (y,) = tt.submit(device, binary, 1, [h, tw2])
            untraced_out.append(await tt.to_host(y))
        untraced = (time.perf_counter() - begin) / batches

        with tt.capture_trace(device) as trace:  # recorded, and run once
            (h,) = tt.submit(device, binary, 0, [slot, tw1])
            (y,) = tt.submit(device, binary, 1, [h, tw2])
        await y

        replayed_out = []
        begin = time.perf_counter()  # the same work, the two programs one queued command
        for x in xs:
            tt.write(slot, x)
            tt.execute_trace(trace)
            replayed_out.append(await tt.to_host(y))
        replayed = (time.perf_counter() - begin) / batches
        tt.release_trace(trace)  # gives back the memory the trace pinned
        stats = device.stats
    # Checked once the clocks have stopped, so that neither loop's time includes numpy's.
    worst = max(float(np.abs(got - reference(x, w1, w2)).max())
                for outputs in (untraced_out, replayed_out) for got, x in zip(outputs, xs))
    print(f"{batches} batches of {batch}x{d}, encoder and head with L1 weights")
    print(f"  program by program: {untraced * 1e6:,.0f} us per batch")
    print(f"  replayed trace:     {replayed * 1e6:,.0f} us per batch ({speedup(untraced, replayed)})")
    print(f"  max |error| vs numpy: {worst:.1e}; layout conversions: {stats.layout_conversions}; "
          f"replays: {stats.trace_replays}")
    return {"untraced_s": untraced, "replayed_s": replayed, "max_error": worst}


if __name__ == "__main__":
    anyio.run(main)
