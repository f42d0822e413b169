"""Runtime stitching: two models chained on the device, and a decode loop with a device-resident cache.

Neither the intermediate activations nor the past cache cross to the host: only the final
outputs are copied back, which `device.stats.device_to_host_bytes` shows.
"""

from __future__ import annotations

import anyio
import numpy as np

import ttflow as tt

TILE_DRAM = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, tt.DataType.FLOAT32)


def build(batch: int, d_model: int, n_classes: int) -> tt.Binary:
    enc = tt.ProgramBuilder("encoder")
    x = enc.input((batch, d_model), TILE_DRAM)
    w = enc.input((d_model, d_model), TILE_DRAM)
    enc.output(enc.relu(enc.matmul(x, w)))
    head = tt.ProgramBuilder("head")
    h = head.input((batch, d_model), TILE_DRAM)
    wh = head.input((d_model, n_classes), TILE_DRAM)
    head.output(head.softmax(head.matmul(h, wh)))
    # One decode step: the new cache is a decayed sum of the old one and the step's projection;
    # the step's output attends over it.
    step = tt.ProgramBuilder("decode_step")
    cache = step.input((batch, d_model), TILE_DRAM)
    tok = step.input((batch, d_model), TILE_DRAM)
    wd = step.input((d_model, d_model), TILE_DRAM)
    new_cache = step.add(step.mul(cache, 0.9), step.matmul(tok, wd))
    step.output(new_cache)
    step.output(step.softmax(new_cache))
    return tt.Binary([enc.build(), head.build(), step.build()])


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


async def main(batch: int = 32, d_model: int = 128, n_classes: int = 16, steps: int = 16,
               spec: tt.DeviceSpec | None = None) -> dict[str, float]:
    rng = np.random.default_rng(1)
    binary = build(batch, d_model, n_classes)
    x = rng.standard_normal((batch, d_model)).astype(np.float32)
    w = (rng.standard_normal((d_model, d_model)) / np.sqrt(d_model)).astype(np.float32)
    wh = (rng.standard_normal((d_model, n_classes)) / np.sqrt(d_model)).astype(np.float32)
    toks = [rng.standard_normal((batch, d_model)).astype(np.float32) for _ in range(steps)]
    async with tt.open_device(spec) as device:
        tw, twh = tt.to_device(w, device, TILE_DRAM), tt.to_device(wh, device, TILE_DRAM)
        (hidden,) = tt.submit(device, binary, 0, [tt.to_device(x, device, TILE_DRAM), tw])
        (probs,) = tt.submit(device, binary, 1, [hidden, twh])  # stitched: no host trip
        cache = tt.to_device(np.zeros((batch, d_model), np.float32), device, TILE_DRAM)
        for tok in toks:
            cache, out = tt.submit(device, binary, 2, [cache, tt.to_device(tok, device, TILE_DRAM), tw])
        got_probs, got_out, got_cache = [await tt.to_host(t) for t in (probs, out, cache)]
        s = device.stats
    ref_probs = softmax(np.maximum(x @ w, 0) @ wh)
    ref_cache = np.zeros((batch, d_model), np.float32)
    for tok in toks:
        ref_cache = ref_cache * np.float32(0.9) + tok @ w
    err = max(float(np.abs(got_probs - ref_probs).max()), float(np.abs(got_cache - ref_cache).max()),
              float(np.abs(got_out - softmax(ref_cache)).max()))
    final_bytes = got_probs.nbytes + got_out.nbytes + got_cache.nbytes
    print(f"encoder -> head stitched on device, then {steps} decode steps with a resident cache")
    print(f"  programs run: {s.programs_run}; device->host bytes: {s.device_to_host_bytes} "
          f"(exactly the 3 final outputs: {final_bytes}); intermediate bytes through the host: "
          f"{s.device_to_host_bytes - final_bytes}")
    print(f"  max |error| vs numpy: {err:.2e}")
    return {"d2h": s.device_to_host_bytes, "final_bytes": final_bytes, "max_error": err,
            "programs": s.programs_run}


if __name__ == "__main__":
    anyio.run(main)
