"""Dispatch cost: a chain of tiny programs, each reading the previous output.

Reported beside the cost of the same number of `anyio.to_thread.run_sync` round trips measured
in the same run, since a design that hops threads per program pays at least that. Runs on each
anyio backend that is installed (trio comes with the test extra); the others are reported as
skipped.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import anyio
import numpy as np

from .._device import open_device
from .._binary import Binary
from .._program import ProgramBuilder
from .._runtime import submit, to_device, to_host
from .._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout


def _chain_binary() -> Binary:
    b = ProgramBuilder("tiny_add")
    x = b.input((32, 32), Layout(MemorySpace.DRAM, TensorLayout.TILE, DataType.FLOAT32))
    b.output(b.add(x, 1.0), Layout(MemorySpace.DRAM, TensorLayout.TILE))
    return Binary([b.build()])


async def _measure(count: int, backend_name: str) -> dict[str, Any]:
    binary = _chain_binary()
    async with open_device(DeviceSpec.small()) as device:
        start = to_device(np.zeros((32, 32), np.float32), device, Layout(MemorySpace.DRAM, TensorLayout.TILE))
        await start
        # Warm-up: first use of a program builds its plan.
        await submit(device, binary, 0, [start])[0]
        t = start
        begin = time.perf_counter()
        submit_time = 0.0
        for _ in range(count):
            s = time.perf_counter()
            (t,) = submit(device, binary, 0, [t])
            submit_time += time.perf_counter() - s
        await t
        total = time.perf_counter() - begin
        value = float((await to_host(t))[0, 0])
        if value != count:
            raise AssertionError(f"chain computed {value}, expected {count}")
    begin = time.perf_counter()
    for _ in range(count):
        await anyio.to_thread.run_sync(lambda: None)
    hop = time.perf_counter() - begin
    return {
        "backend": backend_name,
        "programs": count,
        "us_per_program": total / count * 1e6,
        "us_per_submit": submit_time / count * 1e6,
        "us_per_thread_round_trip": hop / count * 1e6,
        "program_vs_thread_round_trip": (total / count) / (hop / count),
    }


def backend_available(name: str) -> bool:
    """Whether anyio can run on `name` here: asyncio always, trio only once installed."""
    return name == "asyncio" or importlib.util.find_spec(name) is not None


def run(count: int = 2000, backends: tuple[str, ...] = ("asyncio", "trio"),
        quick: bool = False) -> dict[str, Any]:
    """Measures each installed backend; the others are listed under "skipped" with the reason."""
    if quick:
        count = min(count, 200)
    results, skipped = [], []
    for name in backends:
        if backend_available(name):
            results.append(anyio.run(_measure, count, name, backend=name))
        else:
            skipped.append({"backend": name, "reason": f"{name} is not installed (pip install {name})"})
    return {"benchmark": "dispatch", "results": results, "skipped": skipped}


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'backend':<8} {'programs':>8} {'us/program':>11} {'us/submit':>10} "
        f"{'us/thread hop':>14} {'program/hop':>12}"
    ]
    for r in result["results"]:
        lines.append(
            f"{r['backend']:<8} {r['programs']:>8} {r['us_per_program']:>11.1f} "
            f"{r['us_per_submit']:>10.2f} {r['us_per_thread_round_trip']:>14.1f} "
            f"{r['program_vs_thread_round_trip']:>12.2f}"
        )
    for r in result.get("skipped", []):
        lines.append(f"{r['backend']:<8} skipped: {r['reason']}")
    return "\n".join(lines)
