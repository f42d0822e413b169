"""`ttflow bench jax`: JAX functions through `ttflow.jax.jit`, against `jax.jit` on JAX's CPU in
the same run.

Per example: the compile (a new signature: export, the compiler's process, load; the process
started once before, as a warm one is), the first call and the warm call (median), each beside
`jax.jit` on the CPU; and a warm call's host overhead, the call minus the program's own run (the
same binary submitted on the same loop with its inputs resident and its outputs read, timed
inside the loop): signature lookup, argument handling, the loop hop, the outputs made JAX arrays.
The goal for the overhead is <= 100 us.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import ttflow as tt

from .compiled import _median_seconds


def _examples() -> dict[str, tuple[Callable[..., Any], list[Any]]]:
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)

    def f32(*shape: int, scale: float = 1.0) -> Any:
        return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32))

    def mlp(x, w1, b1, w2):  # type: ignore[no-untyped-def]
        return jax.nn.softmax(jax.nn.relu(x @ w1 + b1) @ w2, axis=-1)

    def sgd_step(w, b, x, t):  # type: ignore[no-untyped-def]
        def loss(w, b):  # type: ignore[no-untyped-def]
            return jnp.mean((jnp.tanh(x @ w + b) - t) ** 2)

        value, (gw, gb) = jax.value_and_grad(loss, argnums=(0, 1))(w, b)
        return w - 0.1 * gw, b - 0.1 * gb, value

    def attention(x, wq, wk, wv):  # type: ignore[no-untyped-def]
        q, k, v = x @ wq, x @ wk, x @ wv
        return jax.nn.softmax(q @ k.T / 8.0, axis=-1) @ v

    def tiny(x):  # type: ignore[no-untyped-def]
        return x * 2.0 + 1.0

    return {
        "tiny (32x32 axpy)": (tiny, [f32(32, 32)]),
        "mlp 64-256-64": (mlp, [f32(64, 64), f32(64, 256, scale=0.1), f32(256), f32(256, 64, scale=0.1)]),
        "sgd step 64x64": (sgd_step, [f32(64, 64, scale=0.1), f32(64), f32(32, 64), f32(32, 64)]),
        "attention 64x64": (attention, [f32(64, 64), f32(64, 64, scale=0.1), f32(64, 64, scale=0.1),
                                        f32(64, 64, scale=0.1)]),
    }


def run(quick: bool = False) -> dict[str, Any]:
    try:
        import ttflow.jax as tj
    except ImportError as exc:  # pragma: no cover - the jax extra
        return {"skipped": str(exc)}
    import jax

    from ttflow.jax._jit import resident
    from ttflow.jax._loop import loop

    repeats = 5 if quick else 30
    cpu = jax.devices("cpu")[0]
    tj.jit(lambda x: x + 1.0)(np.ones((32, 32), np.float32))  # the compiler's process, started
    rows: list[dict[str, Any]] = []
    for name, (fn, args) in _examples().items():
        cpu_jit = jax.jit(fn)
        start = time.perf_counter()
        jax.block_until_ready(cpu_jit(*args))
        cpu_first = time.perf_counter() - start
        cpu_warm = _median_seconds(lambda: jax.block_until_ready(cpu_jit(*args)), repeats)  # noqa: B023
        f = tj.jit(fn)
        start = time.perf_counter()
        compiled = f.lower(*args)
        compile_seconds = time.perf_counter() - start
        start = time.perf_counter()
        f(*args)
        first = time.perf_counter() - start
        warm = _median_seconds(lambda: f(*args), repeats)  # noqa: B023
        device = loop.device(tt.DeviceSpec.wormhole_n150())
        held = [resident.get(a, device) for a in args]

        async def program_alone(held: list[Any] = held, compiled: Any = compiled, device: Any = device) -> float:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                for out in tt.submit(device, compiled.binary, 0, held):
                    await tt.to_host(out)
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        alone = loop.call(program_alone)
        ours = jax.tree_util.tree_leaves(f(*args))
        theirs = jax.tree_util.tree_leaves(cpu_jit(*[jax.device_put(a, cpu) for a in args]))
        err = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                  for a, b in zip(ours, theirs, strict=True))
        rows.append({"example": name, "ops": len(compiled.binary.programs[0].steps),
                     "compile_s": compile_seconds, "first_call_s": first, "warm_call_s": warm,
                     "jax_cpu_first_s": cpu_first, "jax_cpu_warm_s": cpu_warm,
                     "warm_vs_jax_cpu": warm / cpu_warm, "program_alone_s": alone,
                     "host_overhead_us": (warm - alone) * 1e6, "max_abs_err_vs_jax_cpu": err})
    return {"examples": rows, "repeats": repeats,
            "median_warm_vs_jax_cpu": statistics.median(float(r["warm_vs_jax_cpu"]) for r in rows),
            "max_host_overhead_us": max(float(r["host_overhead_us"]) for r in rows),
            "overhead_goal_us": 100.0}


def format_table(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"ttflow bench jax: skipped: {result['skipped']}"
    lines = [(f"{'example':<20} {'ops':>4} {'compile':>9} {'first':>9} {'warm':>9} {'jax cpu':>9} "
              f"{'ratio':>6} {'alone':>9} {'overhead':>9} {'max err':>9}")]
    for r in result["examples"]:
        lines.append(f"{r['example']:<20} {r['ops']:>4} {r['compile_s'] * 1e3:>7.1f}ms {r['first_call_s'] * 1e3:>7.2f}ms "
                     f"{r['warm_call_s'] * 1e6:>7.0f}us {r['jax_cpu_warm_s'] * 1e6:>7.0f}us "
                     f"{r['warm_vs_jax_cpu']:>5.1f}x {r['program_alone_s'] * 1e6:>7.0f}us "
                     f"{r['host_overhead_us']:>7.0f}us {r['max_abs_err_vs_jax_cpu']:>9.1e}")
    lines.append(f"median warm call {result['median_warm_vs_jax_cpu']:.1f}x JAX on the CPU; largest host overhead "
                 f"{result['max_host_overhead_us']:.0f} us (goal <= {result['overhead_goal_us']:.0f} us)")
    return "\n".join(lines)
