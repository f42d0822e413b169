"""A tensor-parallel MLP (Megatron-LM) on one chip, an n300 and a T3000, compared with numpy.

Y = gelu(X A) B. On N chips, each holds a 1/N slice of the hidden layer: A split by columns
(column-parallel), B by rows (row-parallel). Every chip computes gelu(X A_k) B_k, a partial Y,
and one all_reduce sums the partials over the mesh's links, so every chip ends with all of Y.
A program is mesh-agnostic: the same builder code for every N, its shapes the slice's.

Run: python examples/mesh_tensor_parallel.py   (docs/mesh.md explains the mesh and the links)
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import attrs
import numpy as np

import ttflow as tt

ROWS, D_MODEL, HIDDEN = 64, 128, 512


def mlp(n_chips: int) -> tt.Binary:
    b = tt.ProgramBuilder(f"mlp/{n_chips}")
    x = b.input((ROWS, D_MODEL))
    a = b.input((D_MODEL, HIDDEN // n_chips))   # this chip's columns of A
    w = b.input((HIDDEN // n_chips, D_MODEL))   # this chip's rows of B
    b.output(b.all_reduce(b.matmul(b.gelu(b.matmul(x, a)), w)))  # the partials summed
    return tt.Binary([b.build()])


def numpy_mlp(x: np.ndarray, a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """In float64: the exact values float32 runs round."""
    h = x.astype(np.float64) @ a
    return (0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))) @ w


async def on_one_chip(x: np.ndarray, a: np.ndarray, w: np.ndarray, spec: tt.DeviceSpec) -> np.ndarray:
    async with tt.open_device(spec) as device:  # the whole hidden layer; the all_reduce of one term
        (y,) = tt.submit(device, mlp(1), 0, [tt.to_device(v, device) for v in (x, a, w)])
        return await tt.to_host(y)


async def on_mesh(x: np.ndarray, a: np.ndarray, w: np.ndarray, spec: tt.MeshSpec) -> dict[str, Any]:
    async with tt.open_mesh_device(spec) as mesh:
        inputs = [tt.to_device(x, mesh),                      # replicated
                  tt.to_device(a, mesh, mapper=tt.shard(1)),  # A by columns
                  tt.to_device(w, mesh, mapper=tt.shard(0))]  # B by rows
        start = time.perf_counter()
        (y,) = tt.submit(mesh, mlp(mesh.num_chips), 0, inputs)
        per_chip = [await tt.to_host(t) for t in tt.device_tensors(y)]
        seconds = time.perf_counter() - start
        links = {k: v for k, v in mesh.stats.link_bytes.items() if v}
    return {"per_chip": per_chip, "seconds": seconds, "links": links}


async def main(chip: tt.DeviceSpec | None = None) -> dict[str, Any]:
    chip = chip or tt.DeviceSpec.small()
    rng = np.random.default_rng(0)
    x, a, w = ((rng.standard_normal(s) / 8).astype(np.float32)
               for s in ((ROWS, D_MODEL), (D_MODEL, HIDDEN), (HIDDEN, D_MODEL)))
    want = numpy_mlp(x, a, w)
    one = await on_one_chip(x, a, w, chip)
    # The documented tolerance (docs/mesh.md, "Sums"): a sum over the hidden layer split N ways
    # adds in another order, each of its HIDDEN additions rounding once.
    bound = HIDDEN * 2.0**-23 * ((np.abs(x) @ np.abs(a) + 1) @ np.abs(w)) + 1e-6
    print(f"Y = gelu(X A) B, X {ROWS}x{D_MODEL}, hidden {HIDDEN}, float32")
    print(f"  one chip: largest difference from numpy {np.max(np.abs(one - want)):.2e}, "
          f"within float32's rounding: {bool(np.all(np.abs(one - want) <= bound))}")
    summary: dict[str, Any] = {"one_chip_error": float(np.max(np.abs(one - want)))}
    for preset in ("n300", "t3000"):
        spec = attrs.evolve(getattr(tt.MeshSpec, preset)(), chip=chip)
        r = await on_mesh(x, a, w, spec)
        y = r["per_chip"][0]
        same = all(np.array_equal(p, y) for p in r["per_chip"])
        close = bool(np.all(np.abs(y - want) <= bound) and np.all(np.abs(y - one) <= 2 * bound))
        n, tensor = spec.num_chips, ROWS * D_MODEL * 4
        # an n300's two chips: a line, the whole partial each way; a T3000's ring: 2 (N-1)/N of it
        per_link = tensor if n == 2 else 2 * (n - 1) * tensor // n
        print(f"  {preset} ({spec.shape[0]}x{spec.shape[1]}): every chip the same result: {same}; "
              f"largest difference from numpy {np.max(np.abs(y - want)):.2e}, from one chip "
              f"{np.max(np.abs(y - one)):.2e}; within float32's rounding of one chip: {close}")
        print(f"    the all_reduce moved {sum(r['links'].values())} bytes over {len(r['links'])} directed links, "
              f"{per_link} each as its formula says: {set(r['links'].values()) == {per_link}}; "
              f"host wall time {r['seconds'] * 1e3:.1f} ms")
        summary[preset] = {"same_on_every_chip": same, "within_tolerance": close,
                           "error": float(np.max(np.abs(y - want))), "link_bytes": r["links"]}
    return summary


if __name__ == "__main__":
    anyio.run(main)
