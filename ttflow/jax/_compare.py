"""`ttflow.jax.compare`: where the device's numbers part from JAX's CPU, op by op of the binary.

The binary records, for each op, the location JAX gave the StableHLO it came from:
`jit(f)/<primitive> @ <file>:<line>:<col>` (the name stack is sometimes cut, and an op the
compiler fused from several primitives carries the last one's: a softmax is its `div`). The
function's jaxpr is evaluated on JAX's CPU backend one equation at a time (inside `jit`,
`custom_jvp` and `custom_vjp` calls too, an inner equation taking its caller's source line when
it has none of its own), and each value is kept under (primitive, file, line, column). Each op of
the binary, run once through `tt.compare_with_golden` (whose rows give the op's own error against
float64: the existing golden machinery, not a second one), is then compared with the JAX value of
its location: of the equations there whose values have as many elements, the one it agrees with
best. The compiler sometimes gives an op a neighbour's location, so an op that agrees with none
there is also held against every other value of the function, save those it read.

An op is `ok` when every element is within `atol * max|cpu| + rtol * |cpu|` of JAX's (NaNs where
JAX has NaNs, the same infinities). An op whose location names no equation (a layout change, a
typecast the compiler added) is compared with nothing (`matched` False), and so is an op that
agrees with nothing but is not the last op of its location: a part of a primitive the compiler
decomposed, judged instead by its own error against float64 (the golden row's `ok`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, final

import attrs
import numpy as np

import ttflow as tt

from ._host import cpu_device, host_jax
from ._jit import Target, jit
from ._loop import loop

__all__ = ["Comparison", "ComparisonRow", "compare"]

Array = np.ndarray[Any, Any]
_LOC = re.compile(r"^(?:(?P<stack>.*)/)?(?P<prim>[A-Za-z0-9_.-]+) @ (?P<file>.+):(?P<line>\d+):(?P<col>\d+)")


@final
@attrs.frozen
class ComparisonRow:
    """One op of the binary: `index`, `op` (ttflow's), `loc` (the binary's), `primitive` and
    `source` (`file:line`) read from it, `matched` (a JAX value was found for it), and against
    that value `pcc`, `max_abs`, `max_rel`, `ok`; `golden` is the op's `tt.GoldenRow` (its own
    error against float64, from the very inputs it read)."""

    index: int
    op: str
    loc: str | None
    primitive: str | None
    source: str | None
    matched: bool
    pcc: float
    max_abs: float
    max_rel: float
    ok: bool
    golden: tt.GoldenRow = attrs.field(repr=False)


@final
@attrs.frozen
class Comparison:
    """`rows`, one per op of program 0 in order; `outputs`, the device's outputs (host arrays)."""

    rows: tuple[ComparisonRow, ...]
    outputs: tuple[Array, ...] = attrs.field(eq=False, repr=False)

    @property
    def first_divergence(self) -> ComparisonRow | None:
        """The first op whose value parts from JAX's CPU beyond the tolerance, or None."""
        return next((row for row in self.rows if row.matched and not row.ok), None)

    @property
    def ok(self) -> bool:
        return self.first_divergence is None

    def table(self) -> str:
        first = self.first_divergence
        lines = [(f"{'#':>4} {'op':<14} {'primitive':<18} {'pcc':>10} {'max_abs':>10} {'max_rel':>10} "
                  f"{'own_err':>10} {'ok':>3}  source")]
        for row in self.rows:
            mark = "  <- first divergence" if row is first else ""
            if not row.matched:
                lines.append(f"{row.index:>4} {row.op:<14} {row.primitive or '-':<18} {'':>10} {'':>10} {'':>10} "
                             f"{row.golden.local_max_abs:>10.3e} {'-':>3}  {row.loc or ''}")
                continue
            lines.append(f"{row.index:>4} {row.op:<14} {row.primitive or '-':<18} {row.pcc:>10.6f} "
                         f"{row.max_abs:>10.3e} {row.max_rel:>10.3e} {row.golden.local_max_abs:>10.3e} "
                         f"{'yes' if row.ok else 'NO':>3}  {row.source}{mark}")
        return "\n".join(lines)


def parse_loc(loc: str | None) -> tuple[str, str, int, int] | None:
    """(primitive, file, line, column) of a binary's op location, or None."""
    if not loc:
        return None
    m = _LOC.match(loc)
    if m is None:
        return None
    return m["prim"], m["file"], int(m["line"]), int(m["col"])


def jax_values(fun: Callable[..., Any], args: Sequence[Any],
               static_argnums: tuple[int, ...] = ()) -> dict[tuple[str, int, int], list[tuple[str, Array]]]:
    """Every equation's (primitive, value) on JAX's CPU, by (file, line, column), in order."""
    jax = host_jax()
    from jax._src import core, source_info_util

    cpu = cpu_device()
    closed = jax.make_jaxpr(fun, static_argnums=static_argnums)(*args)
    dynamic = [a for i, a in enumerate(args) if i not in set(static_argnums)]
    flat = [jax.device_put(np.asarray(a), cpu) for a in jax.tree_util.tree_leaves(dynamic)]
    values: dict[tuple[str, int, int], list[tuple[str, Array]]] = {}

    def frame(eqn: Any, outer: tuple[str, int, int] | None) -> tuple[str, int, int] | None:
        f = source_info_util.user_frame(eqn.source_info.traceback)
        return outer if f is None else (f.file_name, f.start_line, f.start_column)

    def run(jaxpr: Any, consts: Sequence[Any], inputs: Sequence[Any], outer: tuple[str, int, int] | None) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, core.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, inputs, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            where = frame(eqn, outer)
            invals = [read(v) for v in eqn.invars]
            inner = None
            name = eqn.primitive.name
            if name in ("jit", "pjit", "closed_call", "core_call"):
                inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
            elif name.startswith(("custom_jvp_call", "custom_vjp_call")):
                inner = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
            if inner is not None:
                sub = getattr(inner, "jaxpr", inner)
                outs = run(sub, getattr(inner, "consts", ()), invals[len(invals) - len(sub.invars):], where)
            else:
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
            if where is not None:
                for out in outs:
                    values.setdefault(where, []).append((name, np.asarray(out)))
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    with jax.default_device(cpu):
        run(closed.jaxpr, closed.consts, flat, None)
    return values


def _agreement(device: Array, cpu: Array, rtol: float, atol: float) -> tuple[float, float, float, bool]:
    d = np.asarray(device, np.float64).reshape(-1)
    c = np.asarray(cpu, np.float64).reshape(-1)
    if d.size == 0:
        return 1.0, 0.0, 0.0, True
    same_nan = np.isnan(d) == np.isnan(c)
    finite = np.isfinite(c) & np.isfinite(d)
    same_inf = np.where(np.isinf(c) | np.isinf(d), d == c, True)
    diff = np.abs(d - c)
    scale = float(np.max(np.abs(c[np.isfinite(c)]), initial=0.0))
    within = np.where(finite, diff <= atol * scale + rtol * np.abs(c), True)
    ok = bool(np.all(same_nan & same_inf & within))
    max_abs = float(np.max(diff[finite], initial=0.0))
    with np.errstate(all="ignore"):
        rel = np.where(c[finite] != 0, diff[finite] / np.abs(c[finite]), np.where(diff[finite] == 0, 0.0, np.inf))
    max_rel = float(np.max(rel, initial=0.0))
    x, y = d[finite], c[finite]
    if x.size < 2 or np.array_equal(x, y) or x.std() == 0 or y.std() == 0:
        pcc = 1.0 if np.allclose(x, y) else 0.0
    else:
        pcc = float(np.mean((x - x.mean()) * (y - y.mean())) / (x.std() * y.std()))
    return pcc, max_abs, max_rel, ok


def compare(fun: Callable[..., Any], *args: Any, device: Target | None = None, rtol: float = 1e-3,
            atol: float = 1e-3, static_argnums: int | Sequence[int] = (),
            post_op: Callable[[tt.OpContext], Any] | None = None, **compiler_options: Any) -> Comparison:
    """Runs `fun`'s binary on a ttflow device (one chip) once, each op's value beside the value of
    its JAX location on the CPU (see the module). `post_op` is `tt.compare_with_golden`'s: a test
    makes an op compute wrongly there, to see it named first."""
    statics = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    jitted = jit(fun, device=device, static_argnums=statics, **compiler_options)
    if jitted.is_mesh or isinstance(jitted.target, (tt.Device, tt.MeshDevice)):
        raise tt.MeshError("ttflow.jax.compare runs on one chip that ttflow.jax opens: give a tt.DeviceSpec")
    compiled = jitted.lower(*args)
    reference = jax_values(fun, args, statics)
    leaves, _, _, _ = jitted._split(args, {})
    program = compiled.binary.programs[0]
    values: dict[int, tuple[Array, list[Array]]] = {}

    async def capture(ctx: tt.OpContext) -> None:
        if ctx.program.name != program.name:  # a constant part, run apart (see compare_with_golden)
            return
        if post_op is not None:
            result = post_op(ctx)
            if hasattr(result, "__await__"):
                await result
        values[ctx.index] = (await tt.to_host(ctx.outputs[0]), [await tt.to_host(h) for h in ctx.inputs])

    async def run(target: Any) -> tt.GoldenReport:
        inputs = []
        for j, leaf in enumerate(leaves):
            held = jitted._input(target, compiled, j, host_jax().numpy.asarray(leaf, device=cpu_device()))
            inputs.append(held)
        return await tt.compare_with_golden(target, compiled.binary, 0, inputs, post_op=capture)

    report = loop.call(run, loop.device(jitted.target))
    elsewhere = [v for found in reference.values() for _, v in found]
    # a primitive the compiler decomposes (an erfc into sixty multiply-adds) gives all its ops its
    # location: the last of them gives the primitive's value, the others are parts of it, and
    # an error in one reaches the last
    last_at = {golden.loc: golden.index for golden in report.ops}
    rows = []
    for golden in report.ops:
        loc = golden.loc
        parsed = parse_loc(loc)
        device_value, operands = values[golden.index]
        source = None if parsed is None else f"{parsed[1]}:{parsed[2]}"
        primitive = None if parsed is None else parsed[0]
        here = [] if parsed is None else [v for _, v in reference.get(parsed[1:], []) if v.size == device_value.size]
        if not here:
            rows.append(ComparisonRow(golden.index, golden.name, loc, primitive, source, False,
                                      float("nan"), float("nan"), float("nan"), True, golden))
            continue
        scored = [_agreement(device_value, v, rtol, atol) for v in here]
        best = min(scored, key=lambda s: (not s[3], s[1]))
        if not best[3]:
            # The compiler sometimes gives an op a neighbour's location (a relu the line of the
            # tanh it feeds): agreeing with a JAX value elsewhere counts, unless that value is
            # also one the op read (an op that did nothing agrees with its own input).
            for v in elsewhere:
                if v.size != device_value.size:
                    continue
                agreement = _agreement(device_value, v, rtol, atol)
                if agreement[3] and not any(o.size == v.size and _agreement(o, v, rtol, atol)[3] for o in operands):
                    best = agreement
                    break
        pcc, max_abs, max_rel, ok = best
        if not ok and last_at[loc] != golden.index:
            # a part of a decomposed primitive: judged by its own error against float64 from what
            # it read (the golden's check), so a part that is itself off is still named first
            rows.append(ComparisonRow(golden.index, golden.name, loc, primitive, source, not golden.ok,
                                      pcc, max_abs, max_rel, golden.ok, golden))
            continue
        rows.append(ComparisonRow(golden.index, golden.name, loc, primitive, source, True,
                                  pcc, max_abs, max_rel, ok, golden))
    return Comparison(tuple(rows), report.outputs)
