"""JAX's primitive harnesses on ttflow (tests/conformance/jax_primitives.py), a stratified sample:
the first two harnesses of every primitive whose dtypes the device holds. None may give a wrong
value that raises nothing or crash; every refusal names the op; a harness whose binary computes
something else than JAX (every op of ttflow's within its float64 bound) must be one docs/jax.md
explains. The full run's table is in docs/jax.md."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HAVE_JAX = all(importlib.util.find_spec(m) is not None for m in ("jax", "jax_plugins.libtt", "absl"))
pytestmark = [
    pytest.mark.skipif(not HAVE_JAX, reason="the conformance run needs JAX, Tenstorrent's compiler and absl-py: "
                       "pip install '.[jax]' (Python 3.11)"),
    pytest.mark.timeout(900),
]

HERE = Path(__file__).parent / "conformance"


@pytest.fixture(autouse=True, scope="module")
def _closed_after() -> Iterator[None]:
    """ttflow.jax's devices, their event loop and its compiler processes live until exit; closed
    after this module, so later tests see no worker threads of theirs."""
    yield
    import ttflow.jax

    ttflow.jax.shutdown()

# Binaries that compute something else than JAX, found by the runner and read op by op (docs/jax.md,
# "Where the compiler's binary differs"): every op ttflow runs is within its bound.
KNOWN_BINARY = (
    "round_dtypes_shape_bfloat16",  # floor(|x| + 0.5) with the sum in bfloat16
    "pow_dtypes_lhs_bfloat16",  # exp(y log x) in bfloat16
    "reduce_gen_add",  # the reduce's initial value dropped (StableHLO has it, TTIR does not)
    "reduce_window_add_dtypes_shape_int32",  # the window's size emitted as ttnn.zeros
    "reduce_window_max", "reduce_window_min",  # pooled in bfloat16
    "top_k_sort_inf_nan",  # NaN's place in the sort
    "approx_top_k",  # bfloat16 ties broken otherwise
)


def _runner():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("jax_primitives", HERE / "jax_primitives.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["jax_primitives"] = module
    spec.loader.exec_module(module)
    return module


def test_a_stratified_sample_of_jaxs_primitive_harnesses() -> None:
    runner = _runner()
    rows = [runner.run_one(h) for h in runner.harnesses(per_primitive=2, only=[])]
    summary = runner.summary(rows)
    table = runner.table(rows)
    bad = [r for r in rows if r["outcome"] in ("wrong", "crashed")]
    assert not bad, "\n".join(f"{r['outcome']}: {r['name']}: {r.get('why')}" for r in bad) + "\n" + table
    for r in rows:
        if r["outcome"] == "refused":  # named: the op ttflow cannot run, or the schema member it cannot read
            assert "ttnn." in r["why"] or "ttcore." in r["why"], r
        if r["outcome"] == "binary":
            assert r["name"].startswith(KNOWN_BINARY), f"a binary that differs, not yet explained: {r}"
    assert len({r["primitive"] for r in rows}) >= 100
    assert summary["matched_of_compiled"] >= 0.75, table
