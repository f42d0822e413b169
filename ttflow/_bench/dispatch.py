"""Dispatch cost: a chain of tiny programs (32x32 float32 `x + 1`), each reading the previous output.

Measured on each installed anyio backend (trio comes with the test extra; the others are listed
as skipped): untraced (submit per program), and replayed (the chain captured once with
`tt.capture_trace`, then `tt.execute_trace` per pass). Peers measured in the same run, in the
same rounds: PyTorch eager's `x = x + 1` on a 32x32 float32 tensor (when torch is installed),
numpy's, and an `anyio.to_thread.run_sync` round trip (what a design that hops threads per
program pays). Five rounds of each, interleaved: the figures are the best of their rounds and the
ratios the median of the rounds' ratios, so a slow spell of a shared machine does not decide them.

Also, per round: the same program submitted again and again on one resident input (as a front-end
runs a step on its weights), made once with `tt.get_layout` and once with a hand-written
`tt.Layout(...)` equal to it. The two must cost the same: a layout is matched by value (the C fast
path once matched it by identity, and a hand-made one paid 2.5x).
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import time
from typing import Any

import anyio
import numpy as np

from .._runtime.device import open_device
from .._ir.binary import Binary
from .._ir.builder import ProgramBuilder
from .._runtime.calls import submit, to_device, to_host, wait
from .._ir.binary import get_layout
from .._runtime.trace import capture_trace, execute_trace, release_trace
from .._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout


def _chain_binary() -> Binary:
    b = ProgramBuilder("tiny_add")
    x = b.input((32, 32), Layout(MemorySpace.DRAM, TensorLayout.TILE, DataType.FLOAT32))
    b.output(b.add(x, 1.0), Layout(MemorySpace.DRAM, TensorLayout.TILE))
    return Binary([b.build()])


def _peer_step(kind: str) -> tuple[Any, Any]:
    """`x = x + 1` on a 32x32 float32 array of `kind` ("numpy" or "torch"): (step, x)."""
    if kind == "torch":
        import torch

        return (lambda x: x + 1), torch.zeros((32, 32), dtype=torch.float32)
    return (lambda x: x + 1), np.zeros((32, 32), np.float32)


def _peer_us(kind: str, count: int) -> float:
    step, x = _peer_step(kind)
    for _ in range(min(count, 200)):  # warm-up
        x = step(x)
    gc.collect()  # as before each ttflow measurement
    begin = time.perf_counter()
    for _ in range(count):
        x = step(x)
    return (time.perf_counter() - begin) / count * 1e6


async def _resident_us(device: Any, binary: Binary, x: Any, count: int) -> float:
    """us per program of `count` submits reading the same resident input `x`."""
    gc.collect()
    begin = time.perf_counter()
    y = None
    for _ in range(count):
        (y,) = submit(device, binary, 0, [x])
    assert y is not None
    await wait(y)
    return (time.perf_counter() - begin) / count * 1e6


def _peer_kinds() -> list[str]:
    return ["numpy"] + (["torch"] if importlib.util.find_spec("torch") is not None else [])


async def _measure(count: int, backend_name: str, chain: int, rounds: int) -> dict[str, Any]:
    """`rounds` rounds of: the untraced chain, the replayed chain, and each peer's loop, so that
    a slow spell of the (shared, noisy) machine hits ttflow and its peers alike. Each figure is
    the best of its rounds (as `timeit` reports), and each ratio the median of the per-round
    ratios (the same round's ttflow over the same round's peer)."""
    binary = _chain_binary()
    tile = Layout(MemorySpace.DRAM, TensorLayout.TILE)
    samples: dict[str, list[float]] = {"program": [], "submit": [], "replayed": [],
                                       "get_layout": [], "hand_layout": []}
    peers: dict[str, list[float]] = {kind: [] for kind in _peer_kinds()}
    async with open_device(DeviceSpec.small()) as device:
        start = to_device(np.zeros((32, 32), np.float32), device, tile)
        await start
        # Warm-up: first use of a program builds its plan.
        await submit(device, binary, 0, [start])[0]
        with capture_trace(device) as trace:
            t = start
            for _ in range(chain):
                (t,) = submit(device, binary, 0, [t])
        await t
        declared = get_layout(binary, 0, 0)
        by_get_layout = to_device(np.zeros((32, 32), np.float32), device, declared)
        by_hand = to_device(np.zeros((32, 32), np.float32), device,
                            Layout(MemorySpace.DRAM, TensorLayout.TILE, DataType.FLOAT32))
        replays = max(1, count // chain)
        for _ in range(rounds):
            # Each measurement starts from the same collector state: the objects an earlier run
            # (another backend's) promoted to the oldest generation would otherwise bring a full
            # collection into this one (it made trio, measured second, look 2-4x slower).
            gc.collect()
            u = start
            begin = time.perf_counter()
            submit_time = 0.0
            for _ in range(count):
                s = time.perf_counter()
                (u,) = submit(device, binary, 0, [u])
                submit_time += time.perf_counter() - s
            await u
            total = time.perf_counter() - begin
            value = float((await to_host(u))[0, 0])
            if value != count:
                raise AssertionError(f"chain computed {value}, expected {count}")
            del u
            samples["program"].append(total / count * 1e6)
            samples["submit"].append(submit_time / count * 1e6)
            gc.collect()
            begin = time.perf_counter()
            for _ in range(replays):
                execute_trace(trace)
            await t
            samples["replayed"].append((time.perf_counter() - begin) / (replays * chain) * 1e6)
            value = float((await to_host(t))[0, 0])
            if value != chain:
                raise AssertionError(f"replayed chain computed {value}, expected {chain}")
            samples["get_layout"].append(await _resident_us(device, binary, by_get_layout, count))
            samples["hand_layout"].append(await _resident_us(device, binary, by_hand, count))
            for kind in peers:
                peers[kind].append(_peer_us(kind, count))
        release_trace(trace)
    begin = time.perf_counter()
    for _ in range(count):
        await anyio.to_thread.run_sync(lambda: None)
    hop = time.perf_counter() - begin
    result: dict[str, Any] = {
        "backend": backend_name,
        "programs": count,
        "rounds": rounds,
        "us_per_program": min(samples["program"]),
        "us_per_submit": min(samples["submit"]),
        "us_per_program_replayed": min(samples["replayed"]),
        "us_per_thread_round_trip": hop / count * 1e6,
        "rounds_us_per_program": samples["program"],
        "rounds_us_per_submit": samples["submit"],
        "us_per_program_get_layout": min(samples["get_layout"]),
        "us_per_program_hand_layout": min(samples["hand_layout"]),
        "hand_layout_vs_get_layout": statistics.median(
            p / q for p, q in zip(samples["hand_layout"], samples["get_layout"])),
    }
    for kind, times in peers.items():
        result[f"{kind}_us_per_op"] = min(times)
        result[f"program_vs_{kind}_best"] = min(samples["program"]) / min(times)
        result[f"program_vs_{kind}"] = statistics.median(
            p / q for p, q in zip(samples["program"], times))
        result[f"replayed_vs_{kind}"] = statistics.median(
            p / q for p, q in zip(samples["replayed"], times))
        for layout in ("get_layout", "hand_layout"):
            result[f"{layout}_vs_{kind}"] = statistics.median(
                p / q for p, q in zip(samples[layout], times))
    return result


def backend_available(name: str) -> bool:
    """Whether anyio can run on `name` here: asyncio always, trio only once installed."""
    return name == "asyncio" or importlib.util.find_spec(name) is not None


def run(count: int = 2000, backends: tuple[str, ...] = ("asyncio", "trio"),
        quick: bool = False, chain: int = 100, rounds: int = 5) -> dict[str, Any]:
    """Measures each installed backend; the others are listed under "skipped" with the reason."""
    if quick:
        count, rounds = min(count, 200), min(rounds, 2)
    chain = min(chain, count)
    results, skipped = [], []
    for name in backends:
        if backend_available(name):
            results.append(anyio.run(_measure, count, name, chain, rounds, backend=name))
        else:
            skipped.append({"backend": name, "reason": f"{name} is not installed (pip install {name})"})
    for r in results:
        r["program_vs_thread_round_trip"] = r["us_per_program"] / r["us_per_thread_round_trip"]
        # The names of the figures the earlier versions reported.
        if "program_vs_torch" in r:
            r["program_vs_torch_eager"] = r["program_vs_torch"]
            r["replayed_vs_torch_eager"] = r["replayed_vs_torch"]
    # Peers: the best of every round of every backend.
    peer = {f"{kind}_us_per_op" if kind == "numpy" else "torch_eager_us_per_op":
            min(r[f"{kind}_us_per_op"] for r in results) for kind in _peer_kinds()} if results else {}
    return {"benchmark": "dispatch", "results": results, "skipped": skipped, "peers": peer}


def format_table(result: dict[str, Any]) -> str:
    peer = result.get("peers", {})
    torch_us = peer.get("torch_eager_us_per_op")
    rounds = result["results"][0]["rounds"] if result["results"] else 0
    lines = [
        f"{'backend':<8} {'programs':>8} {'us/program':>11} {'us/submit':>10} {'us/replayed':>12} "
        f"{'vs torch':>9} {'replay vs torch':>16}"
    ]
    for r in result["results"]:
        vs = f"{r['program_vs_torch_eager']:>8.2f}x" if torch_us else f"{'-':>9}"
        rvs = f"{r['replayed_vs_torch_eager']:>15.2f}x" if torch_us else f"{'-':>16}"
        lines.append(
            f"{r['backend']:<8} {r['programs']:>8} {r['us_per_program']:>11.1f} "
            f"{r['us_per_submit']:>10.2f} {r['us_per_program_replayed']:>12.1f} {vs} {rvs}"
        )
    for r in result.get("skipped", []):
        lines.append(f"{r['backend']:<8} skipped: {r['reason']}")
    for r in result["results"]:
        vs = f", vs torch {r['hand_layout_vs_torch']:.2f}x / {r['get_layout_vs_torch']:.2f}x" if torch_us else ""
        lines.append(
            f"{r['backend']:<8} one resident input: hand-written layout {r['us_per_program_hand_layout']:.1f} us, "
            f"tt.get_layout {r['us_per_program_get_layout']:.1f} us ({r['hand_layout_vs_get_layout']:.2f}x){vs}")
    lines.append(f"(times: the best of {rounds} interleaved rounds; ratios: the median of the rounds' "
                 "ratios; JSON has every round)")
    lines.append(
        "peers: numpy {:.2f} us/op".format(peer.get("numpy_us_per_op", float("nan")))
        + (f", PyTorch eager {torch_us:.2f} us/op" if torch_us else ", PyTorch not installed")
        + "; thread round trip "
        + ", ".join(f"{r['backend']} {r['us_per_thread_round_trip']:.0f} us" for r in result["results"])
    )
    return "\n".join(lines)
