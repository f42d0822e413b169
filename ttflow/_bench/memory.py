"""L1 eviction policies against each other and against the offline optimum.

Three workloads (the first in two lengths), each run under `open_device(eviction="eager")` and `eviction="lookahead"` on the
n150 (`quick`: the small test device, sizes that still fill its L1):

(a) demo_pipeline: the `ttflow demo` MLP (`build_binary`, the demo's: encoder and head, the hidden
    activations and each batch's logits in L1), two batches in flight, every batch's logits
    kept and read back at the end: as `ttflow demo` runs (64 batches), and long enough that the
    logits outgrow L1 (demo_long);
(b) chained_weights: a chain of programs, each reading its own weight declared in L1 TILE (pushed
    once to DRAM row-major, converted to L1 by its first use) and the previous activation in
    L1, for many iterations; every weight fits in L1 at once, so lookahead should evict nothing
    while eager moves every weight out before each program that does not read it;
(c) decode_growing: a decode-style loop whose every step makes a new L1 tensor that stays alive
    (a growing KV list) and reads the two before it, one from halfway back and one at random,
    until L1 cannot hold them all.

For each: the bytes copied out of L1 (`stats.eviction_bytes`), the evictions, the bytes copied
back in (`residency_copy_bytes`), the wall time of the loop, and, from a third, recorded run, the
offline optimum (`belady.simulate`: the whole run known in advance, L1 without fragmentation) and
a floor no policy can go under (`belady.lower_bound`). Every output is checked against numpy at
the end of each run, so an eviction that lost or mixed up a value cannot go unnoticed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import nullcontext
from typing import Any

import anyio
import numpy as np

from .._ir.binary import Binary
from .._runtime.device import Device, open_device
from .._ir.builder import ProgramBuilder
from .._runtime.calls import empty, submit, to_device, to_host, write
from .._runtime.tensor import Tensor
from .._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout
from .._demo import _softmax, build_binary
from . import belady

F32 = DataType.FLOAT32
DRAM_TILE = Layout(MemorySpace.DRAM, TensorLayout.TILE, F32)
L1_TILE = Layout(MemorySpace.L1, TensorLayout.TILE, F32)

POLICIES = ("eager", "lookahead")

Workload = Callable[..., Awaitable[tuple[float, float]]]


class ValueMismatch(AssertionError):
    """A workload's outputs differ from numpy's: the runtime lost or mixed up a value."""


async def _checked(name: str, outputs: Sequence[Tensor], expected: Sequence[np.ndarray[Any, Any]],
                   tolerance: float) -> float:
    """The largest |error| of the outputs against numpy's values; ValueMismatch above tolerance
    (a NaN too: each output is checked alone, as `max` would pass a NaN over)."""
    worst = 0.0
    for out, value in zip(outputs, expected, strict=True):
        error = float(np.abs(await to_host(out) - value).max())
        if not error <= tolerance:  # also catches NaN
            raise ValueMismatch(f"{name}: max |error| vs numpy is {error:.3g}, above {tolerance:.1g}")
        worst = max(worst, error)
    return worst


# -- (a) the demo pipeline ---------------------------------------------------------------------


async def demo_pipeline(device: Device, batches: int, batch: int, d_in: int, hidden: int,
                        classes: int) -> tuple[float, float]:
    """`ttflow demo`'s loop with every batch's logits kept; (seconds, max |error|)."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((d_in, hidden)) / math.sqrt(d_in)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, classes)) / math.sqrt(hidden)).astype(np.float32)
    inputs = [rng.standard_normal((batch, d_in)).astype(np.float32) for _ in range(4)]
    binary = build_binary(batch, d_in, hidden, classes)
    began = time.perf_counter()
    tw1, tw2 = to_device(w1, device), to_device(w2, device)  # pushed once, row-major
    slots = [empty((batch, d_in), F32, device, DRAM_TILE) for _ in range(2)]
    outputs: list[Tensor] = []
    for i in range(batches):
        slot = slots[i % 2]
        write(slot, inputs[i % len(inputs)])
        (h,) = submit(device, binary, 0, [slot, tw1])
        (logits,) = submit(device, binary, 1, [h, tw2])
        outputs.append(logits)
        if i >= 2:
            await outputs[i - 2]
    for out in outputs:
        await out
    seconds = time.perf_counter() - began
    expected = [_softmax(np.maximum(x @ w1, 0) @ w2) for x in inputs]
    cycled = [expected[i % len(inputs)] for i in range(batches)]
    return seconds, await _checked("demo_pipeline", outputs, cycled, 1e-5)


# -- (b) chained programs with L1 weights -----------------------------------------------------


def chain_binary(programs: int, batch: int, d: int) -> Binary:
    """Program k: tanh(x @ w_k), w_k declared in L1 TILE; x from DRAM for the first, the previous
    activation in L1 for the others; the last one's output to DRAM."""
    built = []
    for k in range(programs):
        b = ProgramBuilder(f"layer{k}")
        x = b.input((batch, d), DRAM_TILE if k == 0 else L1_TILE)
        w = b.input((d, d), L1_TILE)
        b.output(b.tanh(b.matmul(x, w)), DRAM_TILE if k == programs - 1 else L1_TILE)
        built.append(b.build())
    return Binary(built)


async def chained_weights(device: Device, iterations: int, programs: int, batch: int,
                          d: int) -> tuple[float, float]:
    """`iterations` passes through the chain, two in flight, each pass's output kept."""
    rng = np.random.default_rng(1)
    weights = [(rng.standard_normal((d, d)) / math.sqrt(d)).astype(np.float32) for _ in range(programs)]
    inputs = [rng.standard_normal((batch, d)).astype(np.float32) for _ in range(4)]
    binary = chain_binary(programs, batch, d)
    began = time.perf_counter()
    tws = [to_device(w, device) for w in weights]  # DRAM row-major; L1 TILE at first use
    slots = [empty((batch, d), F32, device, DRAM_TILE) for _ in range(2)]
    outputs: list[Tensor] = []
    for i in range(iterations):
        slot = slots[i % 2]
        write(slot, inputs[i % len(inputs)])
        x = slot
        for k, tw in enumerate(tws):
            (x,) = submit(device, binary, k, [x, tw])
        outputs.append(x)
        if i >= 2:
            await outputs[i - 2]
    for out in outputs:
        await out
    seconds = time.perf_counter() - began
    expected = []
    for a in inputs:
        for w in weights:
            a = np.tanh(a @ w)
        expected.append(a)
    cycled = [expected[i % len(inputs)] for i in range(iterations)]
    return seconds, await _checked("chained_weights", outputs, cycled, 1e-4)


# -- (c) a decode loop with a growing set of live tensors -------------------------------------

COEFFICIENTS = (0.35, -0.25, 0.2, -0.1)
"""Weights of the four earlier tensors a step reads: a contraction (their magnitudes sum to
0.9), so the recurrence stays bounded and a rounding difference does not grow over the steps."""


def decode_binary(rows: int, cols: int) -> Binary:
    """kv_t = tanh(x_t + 0.35 kv_{t-1} - 0.25 kv_{t-2} + 0.2 kv_{t//2} - 0.1 kv_r)."""
    b = ProgramBuilder("decode_step")
    x = b.input((rows, cols), DRAM_TILE)
    earlier = [b.input((rows, cols), L1_TILE) for _ in COEFFICIENTS]
    acc = x
    for value, c in zip(earlier, COEFFICIENTS):
        acc = b.add(acc, b.mul(value, c))
    b.output(b.tanh(acc), L1_TILE)
    return Binary([b.build()])


def decode_picks(steps: int, seed: int = 2) -> list[tuple[int, int, int, int]]:
    """For each step t >= 2, the indices of the earlier tensors it reads."""
    rng = np.random.default_rng(seed)
    return [(t - 1, t - 2, t // 2, int(rng.integers(0, t))) for t in range(2, steps)]


async def decode_growing(device: Device, steps: int, rows: int, cols: int) -> tuple[float, float]:
    """`steps` tensors kv_0..kv_{steps-1}, all alive to the end; two steps in flight."""
    rng = np.random.default_rng(3)
    tokens = [rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(8)]
    first = [np.tanh(rng.standard_normal((rows, cols))).astype(np.float32) for _ in range(2)]
    binary = decode_binary(rows, cols)
    picks = decode_picks(steps)
    began = time.perf_counter()
    kv: list[Tensor] = [to_device(a, device, L1_TILE) for a in first]
    slots = [empty((rows, cols), F32, device, DRAM_TILE) for _ in range(2)]
    for t, pick in zip(range(2, steps), picks):
        slot = slots[t % 2]
        write(slot, tokens[t % len(tokens)])
        (new,) = submit(device, binary, 0, [slot, *(kv[j] for j in pick)])
        kv.append(new)
        if t >= 4:
            await kv[t - 2]
    for tensor in kv:
        await tensor
    seconds = time.perf_counter() - began
    expected = list(first)
    for t, pick in zip(range(2, steps), picks):
        acc = tokens[t % len(tokens)]
        for c, j in zip(COEFFICIENTS, pick):
            acc = acc + expected[j] * np.float32(c)
        expected.append(np.tanh(acc))
    return seconds, await _checked("decode_growing", kv, expected, 1e-5)


# -- running -----------------------------------------------------------------------------------


def workloads(quick: bool) -> tuple[DeviceSpec, dict[str, tuple[Workload, dict[str, int]]]]:
    """The device and each workload with its sizes."""
    if quick:
        return DeviceSpec.small(), {
            "demo_pipeline": (demo_pipeline, {"batches": 24, "batch": 32, "d_in": 64, "hidden": 64,
                                              "classes": 32}),
            "chained_weights": (chained_weights, {"iterations": 6, "programs": 3, "batch": 32, "d": 64}),
            "decode_growing": (decode_growing, {"steps": 40, "rows": 32, "cols": 128}),
        }
    return DeviceSpec.wormhole_n150(), {
        # `ttflow demo` as it runs by default: 64 batches, every batch's logits kept.
        "demo": (demo_pipeline, {"batches": 64, "batch": 256, "d_in": 1024, "hidden": 1024,
                                 "classes": 256}),
        # The same, run long: 256 KiB of logits a batch, 4 KiB in each of the 64 banks, so L1
        # fills at about 340 batches and logits must leave it.
        "demo_long": (demo_pipeline, {"batches": 448, "batch": 256, "d_in": 1024, "hidden": 1024,
                                          "classes": 256}),
        # 12 weights of 4 MiB, 768 KiB of each bank's 1.43 MiB.
        "chained_weights": (chained_weights, {"iterations": 24, "programs": 12, "batch": 256, "d": 1024}),
        # 256 KiB a step, 4 KiB a bank: about 360 fit.
        "decode_growing": (decode_growing, {"steps": 640, "rows": 128, "cols": 512}),
    }


_STATS = ("eviction_bytes", "evictions", "residency_copy_bytes", "residency_copies", "relocations",
          "relocation_bytes", "l1_peak_bytes", "programs_run")


async def _run(workload: Workload, sizes: dict[str, int], spec: DeviceSpec, policy: str,
               record: bool) -> tuple[dict[str, Any], belady.TraceRecorder | None]:
    async with open_device(spec, eviction=policy) as device:
        recorder = belady.TraceRecorder(device) if record else None
        with recorder if recorder is not None else nullcontext():
            seconds, worst = await workload(device, **sizes)
        stats = device.stats
    figures: dict[str, Any] = {name: getattr(stats, name) for name in _STATS}
    figures["seconds"] = seconds
    figures["max_abs_error"] = worst
    return figures, recorder


def _ratio(a: float, b: float) -> float | None:
    """a / b; 1.0 when both are 0; None when only b is (no finite ratio)."""
    if b == 0:
        return 1.0 if a == 0 else None
    return a / b


def run_workload(name: str, workload: Workload, sizes: dict[str, int], spec: DeviceSpec) -> dict[str, Any]:
    """Both policies (timed, nothing listening), then a recorded lookahead run for the optimum."""
    result: dict[str, Any] = {"sizes": dict(sizes)}
    for policy in POLICIES:
        result[policy], _ = anyio.run(_run, workload, sizes, spec, policy, False)
    _, recorder = anyio.run(_run, workload, sizes, spec, "lookahead", True)
    assert recorder is not None
    trace = recorder.trace
    capacity = spec.l1_bank_bytes
    optimum = belady.simulate(trace, capacity, "optimum")
    classic = belady.simulate(trace, capacity, "belady")
    lru = belady.simulate(trace, capacity, "lru")
    chosen = min((optimum, classic), key=lambda sim: sim.eviction_bytes)  # both are schedules
    best = chosen.eviction_bytes
    result["optimum_rule"] = chosen.rule
    result["optimum_eviction_bytes"] = best
    result["optimum_evictions"] = chosen.evictions
    result["optimum_reload_bytes"] = chosen.reload_bytes
    result["lower_bound_eviction_bytes"] = belady.lower_bound(trace, capacity)
    result["simulated"] = {sim.rule: sim.as_dict() for sim in (optimum, classic, lru)}
    result["trace"] = dict(trace.summary(), spilled_outputs=recorder.spilled_outputs)
    la, ea = result["lookahead"]["eviction_bytes"], result["eager"]["eviction_bytes"]
    result["lookahead_over_optimum"] = _ratio(la, best)
    result["lookahead_over_eager"] = _ratio(la, ea)
    moved = {p: result[p]["eviction_bytes"] + result[p]["residency_copy_bytes"] for p in POLICIES}
    result["moved_bytes_lookahead_over_eager"] = _ratio(moved["lookahead"], moved["eager"])
    return result


def run(quick: bool = False) -> dict[str, Any]:
    spec, chosen = workloads(quick)
    return {
        "benchmark": "memory",
        "device": spec.name,
        "l1_banks": spec.l1_banks,
        "l1_bank_bytes": spec.l1_bank_bytes,
        "workloads": {name: run_workload(name, fn, sizes, spec) for name, (fn, sizes) in chosen.items()},
    }


# -- the table ---------------------------------------------------------------------------------


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            break
        n /= 1024
    return f"{n:,.0f} B" if unit == "B" else f"{n:,.1f} {unit}"


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}"


def format_table(r: dict[str, Any]) -> str:
    title = (f"memory on {r['device']} (L1: {r['l1_banks']} banks x {_size(r['l1_bank_bytes'])}): "
             "bytes copied out of L1 by eviction, eager vs lookahead vs the offline optimum")
    header = (f"  {'workload':<16} {'policy':<10} {'evicted':>11} {'evictions':>9} {'copied back':>11} "
              f"{'seconds':>8} {'max |err|':>9}")
    lines = [title, header]
    for name, w in r["workloads"].items():
        for k, policy in enumerate(POLICIES):
            p = w[policy]
            lines.append(
                f"  {name if k == 0 else '':<16} {policy:<10} {_size(p['eviction_bytes']):>11} "
                f"{p['evictions']:>9} {_size(p['residency_copy_bytes']):>11} {p['seconds']:>8.2f} "
                f"{p['max_abs_error']:>9.1e}"
            )
        lines.append(
            f"  {'':<16} {'optimum':<10} {_size(w['optimum_eviction_bytes']):>11} "
            f"{w['optimum_evictions']:>9} {_size(w['optimum_reload_bytes']):>11}"
            f"   (floor {_size(w['lower_bound_eviction_bytes'])})"
        )
        lines.append(
            f"  {'':<16} lookahead / optimum {_times(w['lookahead_over_optimum'])}, "
            f"lookahead / eager {_times(w['lookahead_over_eager'])} (with bytes copied back: "
            f"{_times(w['moved_bytes_lookahead_over_eager'])}); "
            f"{w['trace']['steps']} steps recorded, {w['trace']['spilled_outputs']} outputs spilled"
        )
    return "\n".join(lines)
