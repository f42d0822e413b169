"""The caller's JAX: a CPU JAX, never the plugin's platform.

With `jax-tt-plugin` installed, JAX starts every platform it finds when a backend is first asked
for, and the plugin without `TT_COMPILE_ONLY_SYSTEM_DESC` tries to open a chip and fails. The chip
of `ttflow.jax` is ttflow's device, and the compiler runs in its own process (`_compiler`), so the
caller's JAX is made a CPU JAX before its first backend starts, unless the user chose platforms
(`JAX_PLATFORMS`, `jax_platforms`) or started a backend already.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

__all__ = ["cpu_device", "host_jax"]

_ready = False


def host_jax() -> ModuleType:
    """`jax`, with its platforms chosen (ImportError naming the extra when it is missing)."""
    global _ready
    try:
        import jax
    except ImportError as exc:
        raise ImportError("ttflow.jax needs JAX and Tenstorrent's compiler: pip install '.[jax]' from the "
                          "ttflow checkout (jax==0.10.2, jax-tt-plugin==0.1.3; Python 3.11)") from exc
    if not _ready:
        from jax._src import xla_bridge

        chosen = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms  # type: ignore[attr-defined]
        if not chosen and not xla_bridge._backends:
            jax.config.update("jax_platforms", "cpu")
        _ready = True
    return jax


def cpu_device() -> Any:
    return host_jax().devices("cpu")[0]
