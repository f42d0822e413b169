"""Meshes (issue 26): collectives' bytes per link and modelled time, the host cost of an SPMD
submit, and the tensor-parallel MLP's host wall time as chips grow.

Three measurements, in one run:

- **Collectives**: `all_gather` (dim 0) and `all_reduce` on 1xN meshes, a line (N = 2, 4, 8) and
  a ring (N = 4, 8), for two sizes of one chip's input. The bytes each directed link carried
  (`mesh.stats.link_bytes`, one submit's difference) against the algorithm's formula
  (docs/mesh.md, "Bytes per link"): the ratio of their totals, and whether every link matched
  exactly; the link model's time (`CollectiveRecord.modelled_seconds`, what a real mesh would
  take) and the emulation's host wall time for the same submit (best of the rounds).
- **SPMD submit**: the host cost of `tt.submit` of `add(x, 1)` on one 32x32 float32 tile on a
  mesh of 1x1, 1x2 and 2x4 chips (a replicated `MeshTensor` in) against a submit on one
  `Device` and on the 1x1 mesh, and what each chip past the first adds: the submit calls alone,
  best of the rounds, rounds interleaved across the four.
- **Tensor-parallel MLP** (Megatron: X A column-parallel, GELU, then B row-parallel and one
  all_reduce): host wall time from the submit to the result read, weights resident, on one
  `Device` (the whole hidden layer), 1x2 and 2x4 meshes; numpy's MLP (the same exact GELU) on
  the host in the same run, with BLAS on one thread as the devices run it. Each result is compared
  with numpy (its largest absolute difference is reported).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from typing import Any

import anyio
import numpy as np

from .._ir.binary import Binary
from .._blas import limit_blas_threads
from .._runtime.device import open_device
from .._mesh.api import submit, to_device, to_host, wait
from .._mesh.collectives import collective_log
from .._mesh.device import open_mesh_device
from .._mesh.placement import replicate, shard
from .._mesh.spec import MeshSpec
from .._mesh.tensor import device_tensors
from .._ir.numerics import erf
from .._ir.builder import ProgramBuilder
from .._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout

Coord = tuple[int, int]
Links = dict[tuple[Coord, Coord], int]


# -- collectives: bytes per link against the formula, modelled time ----------------------------------


def _collective_binary(op: str, shape: tuple[int, int]) -> Binary:
    b = ProgramBuilder(op)
    x = b.input(shape)
    b.output(b.all_gather(x, 0) if op == "all_gather" else b.all_reduce(x))
    return Binary([b.build()])


def expected_link_bytes(op: str, topology: str, n: int, nbytes: int, itemsize: int) -> Links:
    """The formula of docs/mesh.md's "Bytes per link" for a 1xN mesh (the path is the row):
    `nbytes` is one chip's input (all_gather: its shard)."""
    at = [(0, p) for p in range(n)]
    out: Links = {}
    if topology == "ring":
        elements = nbytes // itemsize
        parts = [len(part) for part in np.array_split(np.empty(elements), n)]
        for p in range(n):
            q = (p + 1) % n
            if op == "all_gather":
                out[at[p], at[q]] = (n - 1) * nbytes
            else:  # reduce_scatter sends every part but p's, all_gather every part but p+1's
                out[at[p], at[q]] = (2 * elements - parts[p] - parts[q]) * itemsize
        return out
    for p in range(n - 1):
        if op == "all_gather":
            out[at[p], at[p + 1]] = (p + 1) * nbytes
            out[at[p + 1], at[p]] = (n - 1 - p) * nbytes
        else:
            out[at[p], at[p + 1]] = out[at[p + 1], at[p]] = nbytes
    return out


async def _collective_case(op: str, topology: str, n: int, shape: tuple[int, int], chip: DeviceSpec,
                           rounds: int) -> dict[str, Any]:
    binary = _collective_binary(op, shape)
    x = np.random.default_rng(n).standard_normal(shape).astype(np.float32)
    nbytes = x.nbytes
    async with open_mesh_device(MeshSpec((1, n), chip=chip, topology=topology)) as mesh:
        t = to_device(x, mesh, mapper=replicate())
        await wait(submit(mesh, binary, 0, [t])[0])  # warm-up: the program resolved for the mesh
        measured: Links = {}
        modelled: list[float] = []
        walls: list[float] = []
        for _ in range(rounds):
            before = mesh.stats.link_bytes
            with collective_log(mesh).listening() as records:
                begin = time.perf_counter()
                (y,) = submit(mesh, binary, 0, [t])
                await wait(y)
                walls.append(time.perf_counter() - begin)
            after = mesh.stats.link_bytes
            measured = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
            modelled.append(sum(r.modelled_seconds for r in records))
            del y
    want = expected_link_bytes(op, topology, n, nbytes, x.itemsize)
    return {
        "op": op, "topology": topology, "chips": n, "shape": list(shape), "input_bytes": nbytes,
        "link_bytes_total": sum(measured.values()), "formula_total": sum(want.values()),
        "ratio": sum(measured.values()) / sum(want.values()),
        "every_link_exact": measured == want,
        "busiest_link_bytes": max(measured.values()),
        "modelled_us": modelled[-1] * 1e6,
        "host_wall_us": min(walls) * 1e6,
    }


# -- the host cost of an SPMD submit ------------------------------------------------------------------


def _tiny_binary() -> Binary:
    b = ProgramBuilder("tiny_add")
    x = b.input((32, 32), Layout(MemorySpace.DRAM, TensorLayout.TILE, DataType.FLOAT32))
    b.output(b.add(x, 1.0), Layout(MemorySpace.DRAM, TensorLayout.TILE))
    return Binary([b.build()])


async def _submit_us(target: Any, binary: Binary, x: Any, count: int) -> float:
    """us per submit call (the calls alone) of `count` submits on one resident input."""
    gc.collect()
    spent = 0.0
    y = None
    for _ in range(count):
        begin = time.perf_counter()
        (y,) = submit(target, binary, 0, [x])
        spent += time.perf_counter() - begin
    assert y is not None
    await wait(y)
    return spent / count * 1e6


SUBMIT_MESHES: tuple[Coord, ...] = ((1, 1), (1, 2), (2, 4))


async def _submit_cost(count: int, rounds: int) -> dict[str, Any]:
    binary = _tiny_binary()
    x = np.zeros((32, 32), np.float32)
    samples: dict[str, list[float]] = {"device": [], **{f"{r}x{c}": [] for r, c in SUBMIT_MESHES}}
    async with contextlib.AsyncExitStack() as stack:
        device = await stack.enter_async_context(open_device(DeviceSpec()))
        targets: dict[str, tuple[Any, Any]] = {"device": (device, to_device(x, device))}
        for shape in SUBMIT_MESHES:
            mesh = await stack.enter_async_context(open_mesh_device(MeshSpec(shape)))
            targets[f"{shape[0]}x{shape[1]}"] = (mesh, to_device(x, mesh, mapper=replicate()))
        for target, t in targets.values():  # warm-up
            await _submit_us(target, binary, t, min(count, 50))
        for _ in range(rounds):
            for name, (target, t) in targets.items():
                samples[name].append(await _submit_us(target, binary, t, count))
    best = {name: min(v) for name, v in samples.items()}
    meshes = [name for name in best if name != "device"]
    return {
        "program": "add(x, 1) on one 32x32 float32 tile", "submits_per_round": count, "rounds": rounds,
        "us_per_submit": best,
        "vs_device": {name: best[name] / best["device"] for name in meshes},
        "vs_1x1_mesh": {name: best[name] / best["1x1"] for name in meshes},
        # what each chip past the first adds: (2x4 - 1x1) / 7
        "us_per_extra_chip": (best["2x4"] - best["1x1"]) / 7,
    }


# -- the tensor-parallel MLP as chips grow ---------------------------------------------------------------


def mlp_binary(n_chips: int, rows: int, d: int, hidden: int) -> Binary:
    """Y = gelu(X A) B, A split by columns and B by rows over `n_chips`, one all_reduce."""
    b = ProgramBuilder(f"mlp/{n_chips}")
    x, a, w = b.input((rows, d)), b.input((d, hidden // n_chips)), b.input((hidden // n_chips, d))
    b.output(b.all_reduce(b.matmul(b.gelu(b.matmul(x, a)), w)))
    return Binary([b.build()])


def numpy_mlp(x: np.ndarray, a: np.ndarray, w: np.ndarray) -> np.ndarray:
    h = x @ a
    h = (0.5 * h * (1 + erf(h.astype(np.float64) / math.sqrt(2)))).astype(np.float32)
    return h @ w  # type: ignore[no-any-return]


MLP_CHIPS: tuple[tuple[int, Coord | None], ...] = ((1, None), (2, (1, 2)), (8, (2, 4)))


async def _mlp_on(n: int, shape: Coord | None, sizes: tuple[int, int, int], arrays: tuple[np.ndarray, ...],
                  repeats: int) -> tuple[float, np.ndarray]:
    rows, d, hidden = sizes
    binary = mlp_binary(n, rows, d, hidden)
    x, a, w = arrays

    async def timed(target: Any, inputs: list[Any]) -> tuple[float, np.ndarray]:
        best, out = math.inf, None
        for _ in range(repeats + 1):  # the first is a warm-up
            begin = time.perf_counter()
            (y,) = submit(target, binary, 0, inputs)
            out = await to_host(device_tensors(y)[0])
            best = min(best, time.perf_counter() - begin) if out is not None else best
            del y
        assert out is not None
        return best, out

    if shape is None:
        async with open_device(DeviceSpec()) as device:
            return await timed(device, [to_device(v, device) for v in (x, a, w)])
    async with open_mesh_device(MeshSpec(shape)) as mesh:
        return await timed(mesh, [to_device(x, mesh, mapper=replicate()), to_device(a, mesh, mapper=shard(1)),
                                  to_device(w, mesh, mapper=shard(0))])


async def _mlp(sizes: tuple[int, int, int], repeats: int) -> dict[str, Any]:
    rows, d, hidden = sizes
    rng = np.random.default_rng(0)
    arrays = tuple(rng.standard_normal(s).astype(np.float32) / 8 for s in ((rows, d), (d, hidden), (hidden, d)))
    numpy_s = math.inf
    with limit_blas_threads(1):  # the devices' own BLAS policy (open_device's blas_threads=1)
        numpy_mlp(*arrays)  # warm-up
        for _ in range(max(repeats, 3)):
            begin = time.perf_counter()
            want = numpy_mlp(*arrays)
            numpy_s = min(numpy_s, time.perf_counter() - begin)
    runs: dict[str, Any] = {}
    for n, shape in MLP_CHIPS:
        seconds, got = await _mlp_on(n, shape, sizes, arrays, repeats)
        runs[str(n)] = {"mesh": "one Device" if shape is None else f"{shape[0]}x{shape[1]}",
                        "wall_us": seconds * 1e6, "vs_numpy": seconds / numpy_s,
                        "max_abs_error_vs_numpy": float(np.max(np.abs(got - want)))}
    return {"rows": rows, "d_model": d, "hidden": hidden, "dtype": "float32", "numpy_us": numpy_s * 1e6,
            "chips": runs, "vs_one_chip": {n: r["wall_us"] / runs["1"]["wall_us"] for n, r in runs.items()}}


# -- the suite -----------------------------------------------------------------------------------------------


def run(quick: bool = False) -> dict[str, Any]:
    chip = DeviceSpec.small() if quick else DeviceSpec()
    shapes = [(32, 64)] if quick else [(32, 256), (256, 1024)]
    cases = [(topology, n) for topology, ns in (("line", (2, 4, 8)), ("ring", (4, 8))) for n in ns]
    rounds = 2 if quick else 5

    async def main() -> dict[str, Any]:
        collectives = [await _collective_case(op, topology, n, shape, chip, rounds)
                       for op in ("all_gather", "all_reduce") for topology, n in cases for shape in shapes]
        submits = await _submit_cost(50 if quick else 200, 3 if quick else 15)
        mlp = await _mlp((32, 64, 256) if quick else (128, 512, 2048), 2 if quick else 5)
        return {"benchmark": "mesh", "collectives": collectives, "submit": submits, "mlp": mlp}

    return anyio.run(main)


def format_table(result: dict[str, Any]) -> str:
    lines = ["collectives on 1xN meshes (float32; bytes per link against docs/mesh.md's formula)",
             (f"{'op':<11} {'topology':<8} {'chips':>5} {'input':>10} {'link bytes':>11} {'ratio':>6} "
              f"{'exact':>6} {'modelled us':>12} {'host us':>9}")]
    for c in result["collectives"]:
        lines.append(f"{c['op']:<11} {c['topology']:<8} {c['chips']:>5} {'x'.join(map(str, c['shape'])):>10} "
                     f"{c['link_bytes_total']:>11} {c['ratio']:>6.2f} {c['every_link_exact']!s:>6} "
                     f"{c['modelled_us']:>12.2f} {c['host_wall_us']:>9.0f}")
    s = result["submit"]
    lines.append("")
    lines.append(f"SPMD submit of {s['program']} (best of {s['rounds']} rounds of {s['submits_per_round']})")
    lines.append(f"{'target':<8} {'us/submit':>10} {'vs device':>10} {'vs 1x1':>8}")
    for name, us in s["us_per_submit"].items():
        vs, vs_mesh = s["vs_device"].get(name), s["vs_1x1_mesh"].get(name)
        lines.append(f"{name:<8} {us:>10.2f} {'' if vs is None else f'{vs:.1f}x':>10} "
                     f"{'' if vs_mesh is None else f'{vs_mesh:.1f}x':>8}")
    lines.append(f"each chip past the first adds {s['us_per_extra_chip']:.2f} us")
    m = result["mlp"]
    lines.append("")
    lines.append(f"tensor-parallel MLP: x {m['rows']}x{m['d_model']}, hidden {m['hidden']}, float32; "
                 f"numpy {m['numpy_us']:.0f} us")
    lines.append(f"{'chips':>5} {'mesh':<11} {'wall us':>9} {'vs numpy':>9} {'vs 1 chip':>10} {'max |err|':>10}")
    for n, r in m["chips"].items():
        lines.append(f"{n:>5} {r['mesh']:<11} {r['wall_us']:>9.0f} {r['vs_numpy']:>8.1f}x "
                     f"{m['vs_one_chip'][n]:>9.2f}x {r['max_abs_error_vs_numpy']:>10.2e}")
    return "\n".join(lines)
