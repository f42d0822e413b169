"""Pipeline benchmarks, all in one run and reported as ratios.

(a) double buffering: time per iteration with writes (CQ1) and programs (CQ0) overlapped, against
    each alone; overlap = max(copy, compute) / pipelined (1.0 ideal, 0.5 serial), the median of
    interleaved rounds' own ratios. Next to it, in the same rounds, the same overlap of the same
    kernels on two plain threads, without the runtime: what this machine gives right now (on two
    cores that other processes share, it can be well below 1.0).
(b) stitching: two programs chained on the device vs the same two with the intermediate copied
    to the host and back; bytes through the host and time.
(c) resident weights: weights pushed once vs pushed every iteration.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import threading

import anyio
import numpy as np
from threadpoolctl import threadpool_info

from .. import kernels
from .._ir.binary import Binary
from .._runtime.device import Device, open_device
from .._ir.builder import ProgramBuilder
from .._runtime.calls import empty, submit, to_device, to_host, write
from .._runtime.tensor import Tensor
from .._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout

F32 = DataType.FLOAT32
TILE = Layout(MemorySpace.DRAM, TensorLayout.TILE, F32)
BFP8 = Layout(MemorySpace.DRAM, TensorLayout.TILE, DataType.BFLOAT8_B)


ROUNDS = 5
"""Rounds of (copy alone, compute alone, both), for ttflow and for plain threads, that the
double-buffering figures take the median ratio (and the best times) of."""


def _layer(name: str, batch: int, d: int, d_out: int | None = None,
           x_layout: Layout = TILE) -> ProgramBuilder:
    d_out = d if d_out is None else d_out
    b = ProgramBuilder(name)
    x = b.input((batch, d), x_layout)
    w = b.input((d, d_out), TILE)
    b.output(b.relu(b.matmul(x, w)), TILE)
    return b


def _blas_in_force() -> str:
    """The BLAS libraries threadpoolctl finds and their thread counts, as they are now."""
    found = [f"{i['internal_api']} {i['num_threads']}" for i in threadpool_info() if i["user_api"] == "blas"]
    return ", ".join(found) or "no BLAS library found"


async def _double_buffering(device: Device, iterations: int, batch: int, d: int,
                            d_out: int) -> dict[str, Any]:
    # Copy and compute balanced. A program reads its whole input back out of bank memory, and
    # for float32 tiles that untilize costs as much as the write's tilize, so a float32 layer is
    # always slower than its write (2-4x here). Batches streamed as BFLOAT8_B (packing is the
    # costly direction, unpacking cheap) into a narrow layer balance the two.
    binary = Binary([_layer("layer", batch, d, d_out, BFP8).build()])
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((d, d_out)) / math.sqrt(d)).astype(np.float32)
    # Distinct host arrays, as a real input stream would have.
    batches = [rng.standard_normal((batch, d)).astype(np.float32) for _ in range(4)]
    tw = to_device(w, device, TILE)
    slots = [empty((batch, d), DataType.BFLOAT8_B, device, BFP8) for _ in range(2)]

    async def run(copy: bool, compute: bool) -> float:
        outs: list[Tensor] = []
        begin = time.perf_counter()
        for i in range(iterations):
            slot = slots[i % 2]
            if copy:
                write(slot, batches[i % len(batches)])
            if compute:
                outs.append(submit(device, binary, 0, [slot, tw])[0])
            if len(outs) > 2:
                await outs[-3]
        for t in [*slots, *outs]:
            await t
        return (time.perf_counter() - begin) / iterations

    await run(True, True)  # warm up
    plain = _PlainThreads(iterations, batches, w)
    plain.copy_loop()
    # Interleaved rounds, each of ttflow's three figures and then the plain threads' three. The
    # overlap is the median of the rounds' own ratios, so that a slow spell of the shared machine
    # falls on both sides of a ratio (as `ttflow bench dispatch` does); the ratio of the best
    # times is reported beside it.
    rounds: list[tuple[float, float, float]] = []
    plain_rounds: list[tuple[float, float, float]] = []
    for _ in range(ROUNDS):
        rounds.append((await run(True, False), await run(False, True), await run(True, True)))
        plain_rounds.append(plain.round())
    copy, compute, pipelined = (min(r[k] for r in rounds) for k in range(3))
    overlaps = [max(c, k) / p for c, k, p in rounds]
    plain_overlaps = [max(c, k) / p for c, k, p in plain_rounds]
    return {
        "copy_ms": copy * 1e3,
        "compute_ms": compute * 1e3,
        "pipelined_ms": pipelined * 1e3,
        "serial_ms": (copy + compute) * 1e3,
        "overlap": statistics.median(overlaps),
        "overlap_of_best_times": max(copy, compute) / pipelined,
        "rounds_overlap": overlaps,
        "plain_threads_overlap": statistics.median(plain_overlaps),
        "rounds_plain_threads_overlap": plain_overlaps,
    }


class _PlainThreads:
    """The kernels the loop above runs (pack into bank bytes; unpack, matmul, relu), each stream
    on its own plain thread, without the runtime and without waiting for each other: the
    ceiling for `overlap` on this machine right now."""

    def __init__(self, iterations: int, batches: list[np.ndarray[Any, Any]], w: np.ndarray[Any, Any]) -> None:
        self.iterations, self.batches, self.w = iterations, batches, w
        self.tile_bytes = kernels.BFLOAT8_B_TILE_BYTES
        depth = -(-batches[0].size // (1024 * 12)) * self.tile_bytes
        self.banks = [np.zeros((12, depth), np.uint8) for _ in range(2)]

    def copy_loop(self) -> None:
        for i in range(self.iterations):
            kernels.pack_bfloat8_b_to_banks(self.batches[i % len(self.batches)], self.banks[i % 2], 0,
                                            self.tile_bytes)

    def compute_loop(self) -> None:
        for i in range(self.iterations):
            x = kernels.unpack_bfloat8_b_from_banks(self.banks[i % 2], 0, self.tile_bytes,
                                                    self.batches[0].shape)
            np.maximum(x @ self.w, np.float32(0))

    def both(self) -> None:
        thread = threading.Thread(target=self.copy_loop)
        thread.start()
        self.compute_loop()
        thread.join()

    def round(self) -> tuple[float, float, float]:
        """Seconds per iteration of copy alone, compute alone, and both at once."""
        def timed(loop: Any) -> float:
            begin = time.perf_counter()
            loop()
            return (time.perf_counter() - begin) / self.iterations

        return timed(self.copy_loop), timed(self.compute_loop), timed(self.both)


async def _stitching(device: Device, iterations: int, batch: int, d: int) -> dict[str, float]:
    binary = Binary([_layer("first", batch, d).build(), _layer("second", batch, d).build()])
    rng = np.random.default_rng(1)
    w1, w2 = (rng.standard_normal((2, d, d)) / math.sqrt(d)).astype(np.float32)
    x = rng.standard_normal((batch, d)).astype(np.float32)
    tw1, tw2, tx = (to_device(a, device, TILE) for a in (w1, w2, x))

    async def stitched() -> tuple[float, int]:
        before = device.stats.device_to_host_bytes + device.stats.host_to_device_bytes
        begin = time.perf_counter()
        for _ in range(iterations):
            (h,) = submit(device, binary, 0, [tx, tw1])
            (y,) = submit(device, binary, 1, [h, tw2])
            await y
        moved = device.stats.device_to_host_bytes + device.stats.host_to_device_bytes - before
        return (time.perf_counter() - begin) / iterations, moved // iterations

    async def round_trip() -> tuple[float, int]:
        before = device.stats.device_to_host_bytes + device.stats.host_to_device_bytes
        begin = time.perf_counter()
        for _ in range(iterations):
            (h,) = submit(device, binary, 0, [tx, tw1])
            host = await to_host(h)
            (y,) = submit(device, binary, 1, [to_device(host, device, TILE), tw2])
            await y
        moved = device.stats.device_to_host_bytes + device.stats.host_to_device_bytes - before
        return (time.perf_counter() - begin) / iterations, moved // iterations

    await stitched()
    s_time, s_bytes = min([await stitched() for _ in range(2)])
    r_time, r_bytes = min([await round_trip() for _ in range(2)])
    return {
        "stitched_ms": s_time * 1e3,
        "host_round_trip_ms": r_time * 1e3,
        "speedup": r_time / s_time,
        "stitched_host_bytes_per_iteration": s_bytes,
        "round_trip_host_bytes_per_iteration": r_bytes,
    }


async def _resident(device: Device, iterations: int, batch: int, d: int) -> dict[str, float]:
    binary = Binary([_layer("layer", batch, d).build()])
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((d, d)) / math.sqrt(d)).astype(np.float32)
    x = rng.standard_normal((batch, d)).astype(np.float32)

    async def resident() -> float:
        tw = to_device(w, device)
        begin = time.perf_counter()
        for _ in range(iterations):
            (y,) = submit(device, binary, 0, [to_device(x, device, TILE), tw])
            await y
        return (time.perf_counter() - begin) / iterations

    async def pushed() -> float:
        begin = time.perf_counter()
        for _ in range(iterations):
            (y,) = submit(device, binary, 0, [to_device(x, device, TILE), to_device(w, device)])
            await y
        return (time.perf_counter() - begin) / iterations

    await resident()
    r = min([await resident() for _ in range(2)])
    p = min([await pushed() for _ in range(2)])
    return {"resident_ms": r * 1e3, "pushed_every_iteration_ms": p * 1e3, "speedup": p / r}


async def _all(quick: bool, only_overlap: bool = False, blas_threads: int | None = 1) -> dict[str, Any]:
    spec = DeviceSpec.small() if quick else DeviceSpec.wormhole_n150()
    # 32 iterations: filling and draining the pipeline costs about one iteration, so `overlap`
    # cannot exceed 32/33 even on an idle machine.
    it, batch, d, d_out = (4, 64, 128, 32) if quick else (32, 2048, 1024, 32)
    async with open_device(spec, blas_threads=blas_threads) as device:
        result: dict[str, Any] = {
            "benchmark": "pipeline",
            "device": spec.name,
            "sizes": {"iterations": it, "batch": batch, "d": d, "overlap_layer_out": d_out},
            "blas_threads": _blas_in_force(),
            "double_buffering": await _double_buffering(device, it, batch, d, d_out),
        }
        if not only_overlap:
            result["stitching"] = await _stitching(device, max(it // 4, 2), batch // 2, d)
            result["resident_weights"] = await _resident(device, max(it // 4, 2), batch // 2, d)
        return result


def run(quick: bool = False) -> dict[str, Any]:
    """Everything with ttflow's default BLAS policy (`open_device(blas_threads=1)`), then the
    double-buffering figure again under each policy, so the choice stays checked every run."""
    result = anyio.run(_all, quick)
    policies: dict[str, int | None] = {"1_thread": 1, "library_default": None}
    result["blas_thread_policy"] = {}
    for name, threads in policies.items():
        measured = anyio.run(_all, quick, True, threads)
        result["blas_thread_policy"][name] = dict(measured["double_buffering"], blas=measured["blas_threads"])
    return result


def format_table(r: dict[str, Any]) -> str:
    db, st, rw = r["double_buffering"], r["stitching"], r["resident_weights"]
    policy = ", ".join(
        f"{name.replace('_', ' ')} ({v['blas']}): overlap {v['overlap']:.2f} "
        f"(plain threads {v['plain_threads_overlap']:.2f}), pipelined {v['pipelined_ms']:.2f} ms"
        for name, v in r["blas_thread_policy"].items()
    )
    return "\n".join([
        f"pipeline on {r['device']} ({r['sizes']}, BLAS threads: {r['blas_threads']})",
        f"  double buffering: copy {db['copy_ms']:.2f} ms, compute {db['compute_ms']:.2f} ms, "
        f"pipelined {db['pipelined_ms']:.2f} ms per iteration (best of {ROUNDS}) -> overlap "
        f"{db['overlap']:.2f} (median of the rounds; of the best times {db['overlap_of_best_times']:.2f}; "
        f"1.0 ideal, 0.5 serial; the same kernels on plain threads: {db['plain_threads_overlap']:.2f})",
        f"  stitching: {st['stitched_ms']:.2f} ms vs host round trip {st['host_round_trip_ms']:.2f} ms "
        f"({st['speedup']:.2f}x); host bytes per iteration {st['stitched_host_bytes_per_iteration']} "
        f"vs {st['round_trip_host_bytes_per_iteration']}",
        f"  resident weights: {rw['resident_ms']:.2f} ms vs pushed every iteration "
        f"{rw['pushed_every_iteration_ms']:.2f} ms ({rw['speedup']:.2f}x)",
        f"  BLAS thread policy (double buffering again): {policy}",
    ])
