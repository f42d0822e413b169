"""JAX's own primitive test suite as ttflow's conformance: every harness of
`jax._src.internal_test_util.test_harnesses.all_harnesses` (5,594 cases over 132 primitives, each
with its shapes, dtypes and argument makers) whose dtypes ttflow's device holds, compiled by
Tenstorrent's compiler through `ttflow.jax.jit`, run on ttflow, and compared with the same harness
on JAX's CPU backend.

    python tests/conformance/jax_primitives.py [--per-primitive N] [--only PRIM ...] [--json FILE]

Each harness ends in one of:

- `matched`: every output within the tolerance (below) of JAX's CPU.
- `wrong`: it ran and an output is outside it, and an op of ttflow's is off its float64 value: a
  wrong value that raised nothing (goal: none).
- `binary`: it ran and an output is outside it, but every op of the binary is within its bound of
  its float64 value from what it read (`tt.compare_with_golden`): the binary computes something
  other than JAX (the compiler's decomposition, its dtypes, an operand it dropped).
- `crashed`: anything else raised while loading or running it (goal: none).
- `refused`: ttflow refused the binary at load, naming the op (ProgramError, BinaryFormatError).
- `compiler`: Tenstorrent's compiler refused the function (its gap, counted apart).
- `skipped`: a dtype the device does not hold (float16, float64, int8/16, uint8/16, complex), or a
  harness JAX itself marks unimplemented on the CPU.

The tolerance: JAX's own test defaults per dtype (`jax._src.test_util.default_tolerance`: float32
1e-6, bfloat16 1e-2), as `rtol` and, scaled by the largest |CPU value| of the output, `atol`,
relaxed where the device's arithmetic requires, each relaxation written in RELAXED with its
reason. NaNs must be where JAX has NaNs, infinities equal; integers and booleans exact.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time
from typing import Any

import numpy as np

import ttflow.jax  # noqa: F401  # before JAX's harnesses: it makes this process's JAX a CPU JAX

SUPPORTED = {"float32", "bfloat16", "int32", "uint32", "bool"}

# Where ttflow (or the compiler's lowering) computes a primitive differently from XLA's CPU, the
# tolerance a harness is held to, and why. Only float dtypes are ever relaxed.
RELAXED: dict[str, tuple[float, str]] = {
}


def default_tolerance(dtype: Any) -> float:
    from jax._src import test_util as jtu

    return float(jtu.default_tolerance()[np.dtype(dtype)]) if np.dtype(dtype) in jtu.default_tolerance() else 0.0


def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def harnesses(per_primitive: int | None, only: list[str]) -> list[Any]:
    """The harnesses to run: all, or the first `per_primitive` of each primitive whose dtype the
    device holds (a stratified sample: JAX lists a primitive's harnesses shape by shape)."""
    from jax._src.internal_test_util import test_harnesses as th

    chosen = []
    taken: collections.Counter[str] = collections.Counter()
    for h in th.all_harnesses:
        if only and h.group_name not in only:
            continue
        if per_primitive is not None:
            if dtype_name(h.dtype) not in SUPPORTED or not h.filter("cpu"):
                continue
            if taken[h.group_name] >= per_primitive:
                continue
            taken[h.group_name] += 1
        chosen.append(h)
    return chosen


def _agree(got: np.ndarray, want: np.ndarray, tol: float) -> bool:
    if want.dtype.kind in "iub":
        return bool(np.array_equal(got.astype(np.int64), want.astype(np.int64)))
    g, w = got.astype(np.float64), want.astype(np.float64)
    if not np.array_equal(np.isnan(g), np.isnan(w)):
        return False
    inf = np.isinf(w) | np.isinf(g)
    if not np.array_equal(g[inf], w[inf]):
        return False
    finite = np.isfinite(w) & np.isfinite(g)
    if not finite.any():
        return True
    scale = float(np.max(np.abs(w[finite])))
    return bool(np.all(np.abs(g[finite] - w[finite]) <= tol * scale + tol * np.abs(w[finite])))


def run_one(h: Any) -> dict[str, Any]:
    import jax

    import ttflow as tt
    import ttflow.jax as tj

    row: dict[str, Any] = {"primitive": h.group_name, "name": h.fullname, "dtype": dtype_name(h.dtype)}
    if dtype_name(h.dtype) not in SUPPORTED:
        return {**row, "outcome": "skipped", "why": f"dtype {dtype_name(h.dtype)}"}
    if not h.filter("cpu"):
        return {**row, "outcome": "skipped", "why": "JAX marks it unimplemented on the CPU"}
    args = h.dyn_args_maker(np.random.RandomState(0))
    cpu = jax.devices("cpu")[0]
    try:
        want = jax.tree_util.tree_leaves(jax.jit(h.dyn_fun)(*(jax.device_put(a, cpu) for a in args)))
    except Exception as exc:  # noqa: BLE001
        return {**row, "outcome": "skipped", "why": f"JAX's CPU fails it: {type(exc).__name__}"}
    arg_dtypes = {dtype_name(np.asarray(a).dtype) for a in args}
    out_dtypes = {dtype_name(w.dtype) for w in want}
    if not (arg_dtypes | out_dtypes) <= SUPPORTED:
        return {**row, "outcome": "skipped", "why": f"dtypes {sorted((arg_dtypes | out_dtypes) - SUPPORTED)}"}
    try:
        got = jax.tree_util.tree_leaves(tj.jit(h.dyn_fun)(*args))
    except tj.CompileError as exc:
        return {**row, "outcome": "compiler", "why": _first_line(str(exc).split("\n", 1)[-1])}
    except (tt.ProgramError, tt.BinaryFormatError) as exc:
        return {**row, "outcome": "refused", "why": _first_line(str(exc))}
    except Exception as exc:  # noqa: BLE001  # counted: the goal is none
        return {**row, "outcome": "crashed", "why": f"{type(exc).__name__}: {_first_line(str(exc))}"}
    relaxed, _ = RELAXED.get(h.group_name, (0.0, ""))
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = np.asarray(g), np.asarray(w)
        tol = max(default_tolerance(w.dtype), relaxed if w.dtype.kind == "f" or w.dtype.name == "bfloat16" else 0.0)
        if g.shape != w.shape or not _agree(g, w, tol):
            err = float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))) if g.shape == w.shape else math.nan
            why = f"output {j}: shape {g.shape} vs {w.shape}, max |err| {err:.3g} (tolerance {tol:g})"
            return {**row, "outcome": _who_differs(h, args), "why": why}
    return {**row, "outcome": "matched"}


def _who_differs(h: Any, args: list[Any]) -> str:
    """"binary" when ttflow ran every op of the binary within its bound of that op's float64
    value from the very inputs it read (`tt.compare_with_golden`, through `ttflow.jax.compare`):
    the binary itself computes something other than JAX (the compiler's decomposition, its
    dtypes, an operand it dropped). Else "wrong": one of ttflow's ops is off."""
    import ttflow.jax as tj

    try:
        comparison = tj.compare(h.dyn_fun, *args)
    except Exception:  # noqa: BLE001
        return "wrong"
    return "binary" if all(row.golden.ok for row in comparison.rows) else "wrong"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else ""


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_prim: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in rows:
        by_prim[r["primitive"]][r["outcome"]] += 1
    total = collections.Counter(r["outcome"] for r in rows)
    compiled = total["matched"] + total["wrong"] + total["crashed"] + total["refused"] + total["binary"]
    return {"total": dict(total), "compiled": compiled,
            "matched_of_compiled": total["matched"] / compiled if compiled else None,
            "by_primitive": {p: dict(c) for p, c in sorted(by_prim.items())}}


def table(rows: list[dict[str, Any]]) -> str:
    s = summary(rows)
    cols = ["matched", "binary", "wrong", "crashed", "refused", "compiler", "skipped"]
    lines = ["| primitive | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for prim, counts in s["by_primitive"].items():
        lines.append(f"| {prim} | " + " | ".join(str(counts.get(c, 0) or "") for c in cols) + " |")
    t = s["total"]
    lines.append("| **all** | " + " | ".join(f"**{t.get(c, 0)}**" for c in cols) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-primitive", type=int, default=None, help="a stratified sample: N per primitive")
    parser.add_argument("--only", nargs="*", default=[], help="these primitives only")
    parser.add_argument("--json", help="write every harness's row here")
    args = parser.parse_args()
    rows = []
    start = time.perf_counter()
    chosen = harnesses(args.per_primitive, args.only)
    for k, h in enumerate(chosen):
        row = run_one(h)
        rows.append(row)
        if row["outcome"] in ("wrong", "crashed", "binary"):
            print(f"[{k + 1}/{len(chosen)}] {row['outcome']}: {row['name']}: {row.get('why')}", file=sys.stderr)
    elapsed = time.perf_counter() - start
    print(table(rows))
    s = summary(rows)
    print(f"\n{len(rows)} harnesses in {elapsed:.0f} s; compiled {s['compiled']}, matched "
          f"{s['matched_of_compiled']:.1%} of those" if s["compiled"] else f"\n{len(rows)} harnesses")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": s, "rows": rows, "seconds": elapsed}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
