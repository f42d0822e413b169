"""Thread workers against a worker process per chip (issue 28, first step): a measurement.

On a 1x2 mesh of small chips, each chip runs a chain of programs (each program's output is the
next one's input), submitted SPMD to both chips; the same run with `workers="thread"` and
`workers="process"`, interleaved, best of the rounds:

- **wall**: from the first submit to the last result read, per program;
- **submit**: the `tt.submit` calls alone (the host's cost per submit, work queued meanwhile);

for three programs: `add` (a 32x32 tile plus one: runs inline on the loop either way),
`matmul` (a 128x128 matmul and GELU, about 0.1 ms: on the workers), `large` (256x256, 0.8 ms),
and once more with `inline_seconds=-1` (every record to the workers) for `add`. Run
`python -m ttflow._bench.workers [--quick]`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio
import numpy as np

from .._binary import Binary
from .._mesh.api import submit, to_device, to_host, wait
from .._mesh.device import open_mesh_device
from .._mesh.placement import concat
from .._mesh.spec import MeshSpec
from .._program import ProgramBuilder
from .._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout

TILE = Layout(MemorySpace.DRAM, TensorLayout.TILE, DataType.FLOAT32)


def _binary(kind: str) -> tuple[Binary, int]:
    b = ProgramBuilder(kind)
    if kind == "add":
        x = b.input((32, 32), TILE)
        b.output(b.add(x, 1.0), TILE)
        return Binary([b.build()]), 32
    n = 128 if kind == "matmul" else 256
    x = b.input((n, n), TILE)
    b.output(b.gelu(b.mul(b.matmul(x, x), 1.0 / n)), TILE)
    return Binary([b.build()]), n


async def _chain(workers: str, kind: str, length: int, inline_seconds: float | None) -> tuple[float, float, Any]:
    binary, n = _binary(kind)
    spec = MeshSpec((1, 2), chip=DeviceSpec.small())
    async with open_mesh_device(spec, workers=workers, inline_seconds=inline_seconds) as mesh:
        x = to_device(np.full((n, n), 0.01, np.float32), mesh, TILE)
        await wait(x)
        warm = submit(mesh, binary, 0, [x])[0]  # plans made, the worker's first message sent
        await wait(warm)
        submitting = 0.0
        start = time.perf_counter()
        y = x
        for _ in range(length):
            t = time.perf_counter()
            (y,) = submit(mesh, binary, 0, [y])
            submitting += time.perf_counter() - t
        result = await to_host(y, concat(0))
        wall = time.perf_counter() - start
    return wall / length, submitting / length, result


def run(quick: bool = False) -> list[dict[str, Any]]:
    cases = [("add", None), ("add", -1.0), ("matmul", None), ("large", None)]
    length = 50 if quick else 200
    rounds = 2 if quick else 3
    rows = []
    for kind, inline in cases:
        best: dict[str, list[float]] = {"thread": [np.inf, np.inf], "process": [np.inf, np.inf]}
        results: dict[str, Any] = {}
        for _ in range(rounds):
            for workers in ("thread", "process"):
                wall, sub, result = anyio.run(_chain, workers, kind, length if kind != "large" else length // 4, inline)
                best[workers] = [min(best[workers][0], wall), min(best[workers][1], sub)]
                results[workers] = result
        rows.append({
            "program": kind, "inline_seconds": "default" if inline is None else inline,
            "thread_wall_us": best["thread"][0] * 1e6, "process_wall_us": best["process"][0] * 1e6,
            "thread_submit_us": best["thread"][1] * 1e6, "process_submit_us": best["process"][1] * 1e6,
            "equal": bool(np.array_equal(results["thread"], results["process"])),
        })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["program  inline    wall us/program (thread, process, process/thread)   "
             "submit us (thread, process, ratio)  equal"]
    for r in rows:
        lines.append(
            f"{r['program']:<8} {r['inline_seconds']!s:<9} {r['thread_wall_us']:9.1f} {r['process_wall_us']:9.1f} "
            f"{r['process_wall_us'] / r['thread_wall_us']:6.2f}x{'':27} {r['thread_submit_us']:7.1f} "
            f"{r['process_submit_us']:7.1f} {r['process_submit_us'] / r['thread_submit_us']:6.2f}x  {r['equal']}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(format_table(run(parser.parse_args().quick)))
