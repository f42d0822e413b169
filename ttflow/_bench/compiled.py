"""Binaries Tenstorrent's compiler wrote (the checkout's tests/data/ttnn corpus), on the device
and against JAX on the CPU in the same run:

- load time per binary (`tt.Binary.from_bytes`: read, decode every op's MLIR, translate, build),
  median of several cold loads (the MLIR type caches emptied before each), with its op count:
  the goal is <= 20 ms for a 200-op binary, estimated by the least-squares line through the
  corpus's (ops, load time) points (a fixed part per binary plus a part per op), and, beside
  it, 200 times the median of the per-op times (which the small binaries' fixed part inflates);
- warm run time of `main` (inputs resident, after a warm-up; submit to outputs ready), median of
  several, against the same function `jax.jit`-ed on JAX's CPU backend (the corpus script's own
  function and inputs, `block_until_ready`): the goal is a median ratio <= 5x.

Without jax installed (the compiler extra) the JAX column is left out, with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import numpy as np

CORPUS = Path(__file__).resolve().parents[2] / "tests" / "data" / "ttnn"


def corpus_path() -> Path:
    for path in (CORPUS, Path.cwd() / "tests" / "data" / "ttnn"):
        if (path / "make_corpus.py").is_file():
            return path
    raise FileNotFoundError(
        f"ttflow bench compiled runs the corpus of tests/data/ttnn, found neither at {CORPUS} nor in "
        "./tests/data/ttnn; run it from a checkout of ttflow"
    )


def _corpus_module(folder: Path) -> ModuleType:
    name = "_ttflow_make_corpus"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, folder / "make_corpus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _jax_cases(folder: Path) -> tuple[dict[str, Any], str | None]:
    if importlib.util.find_spec("jax") is None:
        return {}, "jax is not installed (pip install '.[compiler]')"
    # JAX on the CPU only: with the plugin installed, the tt platform would try to open a chip.
    # Set while JAX starts its backends, then put back (children, a compile, see the caller's).
    previous = os.environ.get("JAX_PLATFORMS")
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        import jax

        jax.devices()
    finally:
        if previous is None:
            del os.environ["JAX_PLATFORMS"]
        else:
            os.environ["JAX_PLATFORMS"] = previous

    cases = _corpus_module(folder)._cases()
    return {name: (jax.jit(fn), inputs) for name, (fn, inputs) in cases.items()}, None


def _cold_load(data: bytes) -> Any:
    """A load as a fresh process makes it: the type parser's caches emptied first (a binary's
    own repeated types still hit them, as they do in any load)."""
    import ttflow as tt
    from ttflow.ttnn import mlir

    mlir.clear_caches()
    return tt.Binary.from_bytes(data)


def _median_seconds(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _device_runs(names: list[str], folder: Path, repeats: int) -> dict[str, dict[str, Any]]:
    import ttflow as tt
    from ttflow.ttnn.reader import read_ttnn

    out: dict[str, dict[str, Any]] = {}
    async with tt.open_device() as device:
        for name in names:
            data = (folder / f"{name}.ttnn").read_bytes()
            ops = sum(len(p.ops) for p in read_ttnn(data).programs)
            load = _median_seconds(lambda data=data: _cold_load(data), repeats)
            binary = tt.Binary.from_bytes(data)
            arrays = np.load(folder / f"{name}.npz")
            inputs = []
            for j in range(len(binary.programs[0].inputs)):
                a = arrays[f"in{j}"]
                inputs.append(tt.to_device(a.reshape(a.shape or (1,)), device, tt.get_layout(binary, 0, j)))
            for tensor in inputs:
                await tt.wait(tensor)

            donations = binary.programs[0].donations

            async def once() -> None:
                outs = tt.submit(device, binary, 0, inputs)
                for o in outs:
                    await tt.wait(o)
                for out, given in donations:  # a donated input is consumed: its output feeds the next run
                    inputs[given] = outs[out]

            await once()  # warm: plans, const-eval, program cache
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                await once()
                times.append(time.perf_counter() - start)
            out[name] = {"ops": ops, "load_seconds": load, "run_seconds": statistics.median(times)}
    return out


def run(quick: bool = False) -> dict[str, Any]:
    folder = corpus_path()
    names = sorted(p.stem for p in folder.glob("*.ttnn") if not p.with_suffix(".json").exists())
    if quick:  # a few, one of them with a donated input (its output feeds the next run)
        names = names[:3] + [n for n in names if n == "kv_donated"]
    repeats = 3 if quick else 15
    device = anyio.run(_device_runs, names, folder, repeats)
    jitted, skipped = _jax_cases(folder)
    rows = []
    for name in names:
        row = {"binary": name, **device[name]}
        if name in jitted:
            fn, inputs = jitted[name]
            import jax

            args = [jax.device_put(a) for a in inputs]
            jax.block_until_ready(fn(*args))
            row["jax_cpu_seconds"] = _median_seconds(lambda fn=fn, args=args: jax.block_until_ready(fn(*args)), repeats)
            row["run_vs_jax_cpu"] = row["run_seconds"] / row["jax_cpu_seconds"]
        rows.append(row)
    ratios = [r["run_vs_jax_cpu"] for r in rows if "run_vs_jax_cpu" in r]
    per_op = [r["load_seconds"] / r["ops"] for r in rows]
    ops = np.array([r["ops"] for r in rows], float)
    fixed, each = np.linalg.lstsq(np.vstack([np.ones_like(ops), ops]).T,
                                  np.array([r["load_seconds"] for r in rows]), rcond=None)[0]
    return {
        "load_seconds_at_200_ops": float(fixed + 200 * each),
        "load_seconds_fixed": float(fixed),
        "load_seconds_per_op": float(each),
        "binaries": rows,
        "median_run_vs_jax_cpu": statistics.median(ratios) if ratios else None,
        "load_seconds_per_200_ops": statistics.median(per_op) * 200,
        "jax_skipped": skipped,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{'binary':<16} {'ops':>5} {'load ms':>8} {'run ms':>8} {'JAX CPU ms':>11} {'=JAX':>7}"]
    for r in result["binaries"]:
        jax_ms = f"{r['jax_cpu_seconds'] * 1e3:>11.3f}" if "jax_cpu_seconds" in r else f"{'-':>11}"
        ratio = f"{r['run_vs_jax_cpu']:>6.1f}x" if "run_vs_jax_cpu" in r else f"{'-':>7}"
        lines.append(f"{r['binary']:<16} {r['ops']:>5} {r['load_seconds'] * 1e3:>8.2f} "
                     f"{r['run_seconds'] * 1e3:>8.3f} {jax_ms} {ratio}")
    lines.append(f"load time of a 200-op binary (the corpus's fit: {result['load_seconds_fixed'] * 1e3:.2f} ms "
                 f"+ {result['load_seconds_per_op'] * 1e6:.0f} us per op): "
                 f"{result['load_seconds_at_200_ops'] * 1e3:.1f} ms (goal <= 20 ms); 200x the median per-op "
                 f"time: {result['load_seconds_per_200_ops'] * 1e3:.1f} ms")
    if result["median_run_vs_jax_cpu"] is not None:
        lines.append(f"warm run against JAX CPU, median: {result['median_run_vs_jax_cpu']:.1f}x (goal <= 5x)")
    if result["jax_skipped"]:
        lines.append(f"JAX CPU skipped: {result['jax_skipped']}")
    return "\n".join(lines)
