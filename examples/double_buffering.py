"""Double buffering: two fixed input tensors, written alternately while programs run.

Batch i+1 is written into one buffer (on CQ1) while the program reads batch i from the other
(on CQ0). `tt.write` waits only for the program that read the buffer's previous contents, so
copies and compute overlap. The example times the pipeline against copies alone and compute alone.
"""

from __future__ import annotations

import time

import anyio
import numpy as np

import ttflow as tt

TILE = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, tt.DataType.FLOAT32)


def build(batch: int, d: int) -> tt.Binary:
    b = tt.ProgramBuilder("layer")
    x = b.input((batch, d), TILE)
    w = b.input((d, d), TILE)
    b.output(b.relu(b.matmul(x, w)))
    return tt.Binary([b.build()])


async def _run(device: tt.Device, binary: tt.Binary, tw: tt.Tensor, bufs: list[tt.Tensor],
               batches: list[np.ndarray], copy: bool, compute: bool) -> tuple[float, list[tt.Tensor]]:
    outs: list[tt.Tensor] = []
    begin = time.perf_counter()
    for i, batch in enumerate(batches):
        buf = bufs[i % 2]
        if copy:
            tt.write(buf, batch)
        if compute:
            outs.append(tt.submit(device, binary, 0, [buf, tw])[0])
    for buf in bufs:
        await buf
    for out in outs:
        await out
    return time.perf_counter() - begin, outs


async def main(iterations: int = 16, batch: int = 1024, d: int = 1024,
               spec: tt.DeviceSpec | None = None) -> dict[str, float]:
    rng = np.random.default_rng(3)
    binary = build(batch, d)
    w = (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
    batches = [rng.standard_normal((batch, d)).astype(np.float32) for _ in range(iterations)]
    async with tt.open_device(spec) as device:
        tw = tt.to_device(w, device, TILE)
        bufs = [tt.empty((batch, d), tt.DataType.FLOAT32, device, TILE) for _ in range(2)]
        await _run(device, binary, tw, bufs, batches[:2], True, True)  # warm up
        copy_only, _ = await _run(device, binary, tw, bufs, batches, True, False)
        compute_only, _ = await _run(device, binary, tw, bufs, batches, False, True)
        pipelined, outs = await _run(device, binary, tw, bufs, batches, True, True)
        worst = 0.0
        for x, out in zip(batches, outs):
            worst = max(worst, float(np.abs(await tt.to_host(out) - np.maximum(x @ w, 0)).max()))
    ideal = max(copy_only, compute_only)
    overlap = ideal / pipelined
    print(f"{iterations} iterations, batch {batch}x{d} FLOAT32, two input buffers")
    print(f"  copies alone {copy_only * 1e3:.1f} ms, compute alone {compute_only * 1e3:.1f} ms, "
          f"pipelined {pipelined * 1e3:.1f} ms (serial would be {(copy_only + compute_only) * 1e3:.1f} ms)")
    print(f"  overlap: max(copy, compute) / pipelined = {overlap:.2f} (1.0 is ideal, 0.5 serial)")
    print(f"  max |error| vs numpy: {worst:.2e}")
    return {"copy_s": copy_only, "compute_s": compute_only, "pipelined_s": pipelined,
            "overlap": overlap, "max_error": worst}


if __name__ == "__main__":
    anyio.run(main)
