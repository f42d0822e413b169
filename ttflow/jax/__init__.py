"""JAX on ttflow: JAX functions compiled by Tenstorrent's real compiler (tt-mlir in the
`jax-tt-plugin` PJRT plugin, compile-only, against ttflow's descriptor of the device) and run on
ttflow's emulated device, with real values (docs/jax.md).

- `jit(f, ...)`: call it as `jax.jit(f)`; each new signature is compiled once, outputs come back as
  JAX CPU arrays, JAX arrays passed again stay resident on the device.
- `compile(f, *args)`: the `tt.Binary`, for users who drive `tt.submit` themselves.
- `compare(f, *args)`: the binary run on ttflow beside the same function on JAX's CPU, op by op,
  each op named by the JAX primitive and source line the binary records.

The `[jax]` extra installs what it needs (Python 3.11). Importing this module makes the caller's
JAX a CPU JAX (`_host`: the plugin's platform would try to open a chip), unless the user chose
JAX's platforms; the first compile starts the compiler's process, which imports this package with
`TTFLOW_JAX_COMPILER_PROCESS` set, and is left alone.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if not os.environ.get("TTFLOW_JAX_COMPILER_PROCESS"):
    from ._host import choose_platforms

    choose_platforms()

if TYPE_CHECKING:
    from ._compare import Comparison as Comparison
    from ._compare import ComparisonRow as ComparisonRow
    from ._compare import compare as compare
    from ._compiler import CompileError as CompileError
    from ._jit import Compiled as Compiled
    from ._jit import Jitted as Jitted
    from ._jit import compile as compile
    from ._jit import jit as jit

_NAMES = {
    "jit": "._jit", "compile": "._jit", "Compiled": "._jit", "Jitted": "._jit",
    "compare": "._compare", "Comparison": "._compare", "ComparisonRow": "._compare",
    "CompileError": "._compiler",
}


def __getattr__(name: str) -> Any:
    """Public names imported when first read: importing ttflow.jax (e.g. for the compiler's own
    process, `ttflow.jax._server`) starts nothing."""
    if name in _NAMES:
        import importlib

        value = getattr(importlib.import_module(_NAMES[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ttflow.jax' has no attribute {name!r}")


def shutdown() -> None:
    """Closes what ttflow.jax opened: the compiler processes, the devices and their event loop
    (done at the interpreter's exit too; the next call opens them again)."""
    from ._compiler import shutdown as stop_compilers
    from ._loop import loop

    stop_compilers()
    loop.close()


__all__ = [
    "Comparison",
    "ComparisonRow",
    "CompileError",
    "Compiled",
    "Jitted",
    "compare",
    "compile",
    "jit",
    "shutdown",
]
