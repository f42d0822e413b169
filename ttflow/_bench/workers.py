"""`ttflow bench mesh --workers thread,process`: the same mesh work with each kind of chip
worker, in the same run (rounds interleaved, best of the rounds), the first kind the reference.

- **chains**: on a 1x2 mesh of small chips, each chip runs a chain of residual blocks,
  `layer_norm(gelu(x @ w) + x)` (each block's output the next one's input, `w` resident),
  submitted SPMD all at once, then read back: wall time per block, for n x n blocks with n in
  32, 64, 96 and 128 (about 0.1, 0.17, 0.4 and 0.6 ms each to run). Small programs are
  dispatch-bound: with thread workers every chip's Python runs under one interpreter lock.
- **mlp**: the tensor-parallel MLP of `ttflow bench mesh` (large matmuls, which release the
  interpreter lock) on a 1x2 mesh: wall time per step.
- **submit**: the `tt.submit` call alone of a tiny SPMD program on a 1x2 mesh (the host's cost
  per submit, work queued meanwhile).

Each kind runs at its own default inline threshold (a Ray chip runs nothing in the host). Outputs of every kind are compared bit for
bit with the first kind's. A worker process is started before anything is timed (its first
record waited for).
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import numpy as np

from .._ir.binary import Binary
from .._mesh.api import submit, to_device, to_host, wait
from .._mesh.device import MeshDevice, open_mesh_device
from .._mesh.placement import concat, replicate, shard
from .._mesh.spec import MeshSpec
from .._mesh.tensor import device_tensors
from .._ir.builder import ProgramBuilder
from .._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout
from .mesh import _submit_us, _tiny_binary, mlp_binary

__all__ = ["run", "format_table", "WORKER_KINDS"]

WORKER_KINDS = ("thread", "process", "ray")
"""The kinds `--workers` takes ("ray": chips in Ray actors, one per chip, on a local Ray instance
this run starts unless `ray.init()` was called already)."""

TILE = Layout(MemorySpace.DRAM, TensorLayout.TILE, DataType.FLOAT32)


def block_binary(n: int) -> Binary:
    """One residual block on n x n values: layer_norm(gelu(x @ w) + x), which stays O(1) down a
    chain of any length."""
    b = ProgramBuilder(f"block{n}")
    x, w = b.input((n, n), TILE), b.input((n, n), TILE)
    b.output(b.layer_norm(b.add(b.gelu(b.matmul(x, w)), x)), TILE)
    return Binary([b.build()])


async def _started(mesh: MeshDevice) -> None:
    """Waits until every chip's worker runs records (a worker process boots in the background:
    its first record waits for it), so that no timing includes a boot."""
    b = ProgramBuilder("boot")
    b.output(b.matmul(b.input((256, 256), TILE), b.input((256, 256), TILE)), TILE)
    binary = Binary([b.build()])
    x = to_device(np.zeros((256, 256), np.float32), mesh, TILE, replicate())
    await wait(submit(mesh, binary, 0, [x, x])[0])


async def _chain(workers: str, n: int, length: int) -> tuple[float, np.ndarray]:
    binary = block_binary(n)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 2 * n)).astype(np.float32)
    w = (rng.standard_normal((n, n)) / math.sqrt(n)).astype(np.float32)
    async with open_mesh_device(MeshSpec((1, 2), chip=DeviceSpec.small()), workers=workers) as mesh:
        await _started(mesh)
        tw = to_device(w, mesh, TILE, replicate())
        y = to_device(x, mesh, TILE, shard(1))
        (y,) = submit(mesh, binary, 0, [y, tw])  # the plans made, the wire's plan sent
        await wait(y)
        begin = time.perf_counter()
        for _ in range(length):
            (y,) = submit(mesh, binary, 0, [y, tw])
        out = await to_host(y, concat(1))
        return (time.perf_counter() - begin) / length, out


async def _mlp(workers: str, sizes: tuple[int, int, int], repeats: int) -> tuple[float, np.ndarray]:
    rows, d, hidden = sizes
    rng = np.random.default_rng(0)
    x, a, w = (rng.standard_normal(s).astype(np.float32) / 8 for s in ((rows, d), (d, hidden), (hidden, d)))
    binary = mlp_binary(2, rows, d, hidden)
    async with open_mesh_device(MeshSpec((1, 2)), workers=workers) as mesh:
        await _started(mesh)
        inputs = [to_device(x, mesh, mapper=replicate()), to_device(a, mesh, mapper=shard(1)),
                  to_device(w, mesh, mapper=shard(0))]
        best, out = math.inf, None
        for _ in range(repeats + 1):  # the first is a warm-up
            begin = time.perf_counter()
            (y,) = submit(mesh, binary, 0, inputs)
            out = await to_host(device_tensors(y)[0])
            best = min(best, time.perf_counter() - begin)
            del y
        assert out is not None
        return best, out


async def _submit(workers: str, count: int) -> float:
    async with open_mesh_device(MeshSpec((1, 2), chip=DeviceSpec.small()), workers=workers) as mesh:
        await _started(mesh)
        x = to_device(np.zeros((32, 32), np.float32), mesh, mapper=replicate())
        await _submit_us(mesh, _tiny_binary(), x, min(count, 50))  # warm-up
        return await _submit_us(mesh, _tiny_binary(), x, count)


def run(quick: bool = False, workers: tuple[str, ...] = ("thread", "process")) -> dict[str, Any]:
    if "ray" not in workers:
        return _run(quick, workers)
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        return _run(quick, workers)
    finally:
        if started:
            ray.shutdown()


def _run(quick: bool, workers: tuple[str, ...]) -> dict[str, Any]:
    sizes = (64, 96) if quick else (32, 64, 96, 128)
    length = 60 if quick else 300
    rounds = 2 if quick else 3
    mlp_sizes = (32, 64, 256) if quick else (128, 512, 2048)

    async def main() -> dict[str, Any]:
        chains: list[dict[str, Any]] = []
        for n in sizes:
            best: dict[str, float] = {kind: math.inf for kind in workers}
            outs: dict[str, np.ndarray] = {}
            for _ in range(rounds):
                for kind in workers:
                    seconds, outs[kind] = await _chain(kind, n, length)
                    best[kind] = min(best[kind], seconds)
            chains.append({"n": n, "blocks": length, "us_per_block": {k: v * 1e6 for k, v in best.items()},
                           "speedup_vs_" + workers[0]: {k: best[workers[0]] / v for k, v in best.items()},
                           "equal": all(np.array_equal(outs[workers[0]], o) for o in outs.values())})
        mlp_best: dict[str, float] = {kind: math.inf for kind in workers}
        mlp_outs: dict[str, np.ndarray] = {}
        for _ in range(rounds):
            for kind in workers:
                seconds, mlp_outs[kind] = await _mlp(kind, mlp_sizes, 2 if quick else 5)
                mlp_best[kind] = min(mlp_best[kind], seconds)
        submit_best: dict[str, float] = {kind: math.inf for kind in workers}
        for _ in range(rounds):
            for kind in workers:
                submit_best[kind] = min(submit_best[kind], await _submit(kind, 50 if quick else 200))
        return {
            "benchmark": "mesh --workers", "workers": list(workers), "mesh": "1x2",
            "chains": chains,
            "mlp": {"rows": mlp_sizes[0], "d_model": mlp_sizes[1], "hidden": mlp_sizes[2],
                    "wall_us": {k: v * 1e6 for k, v in mlp_best.items()},
                    "vs_" + workers[0]: {k: v / mlp_best[workers[0]] for k, v in mlp_best.items()},
                    "equal": all(np.array_equal(mlp_outs[workers[0]], o) for o in mlp_outs.values())},
            "submit": {"us_per_submit": submit_best,
                       "vs_" + workers[0]: {k: v / submit_best[workers[0]] for k, v in submit_best.items()}},
        }

    return anyio.run(main)


def format_table(result: dict[str, Any]) -> str:
    kinds = result["workers"]
    first = kinds[0]
    lines = [f"chains of residual blocks on a {result['mesh']} mesh (us per block; speed-up against {first})",
             f"{'n':>4} " + " ".join(f"{k:>10}" for k in kinds) + " " + " ".join(
                 f"{'x ' + k:>12}" for k in kinds[1:]) + "  equal"]
    for c in result["chains"]:
        speed = c["speedup_vs_" + first]
        lines.append(f"{c['n']:>4} " + " ".join(f"{c['us_per_block'][k]:>10.0f}" for k in kinds) + " "
                     + " ".join(f"{speed[k]:>11.2f}x" for k in kinds[1:]) + f"  {c['equal']}")
    m = result["mlp"]
    lines.append("")
    lines.append(f"tensor-parallel MLP on {result['mesh']}: x {m['rows']}x{m['d_model']}, hidden {m['hidden']} "
                 f"(wall us; time against {first})")
    lines.append("  " + "  ".join(f"{k}: {m['wall_us'][k]:.0f} ({m['vs_' + first][k]:.2f}x)" for k in kinds)
                 + f"  equal: {m['equal']}")
    s = result["submit"]
    lines.append("")
    lines.append(f"SPMD submit call on {result['mesh']} (us; against {first})")
    lines.append("  " + "  ".join(f"{k}: {s['us_per_submit'][k]:.2f} ({s['vs_' + first][k]:.2f}x)" for k in kinds))
    return "\n".join(lines)


if __name__ == "__main__":  # `python -m ttflow._bench.workers [--quick]`
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(format_table(run(parser.parse_args().quick)))
