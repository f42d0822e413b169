"""The caller's JAX: a CPU JAX, never the plugin's platform.

With `jax-tt-plugin` installed, JAX starts every platform it finds when a backend is first asked
for, and the plugin without `TT_COMPILE_ONLY_SYSTEM_DESC` tries to open a chip and fails. The chip
of `ttflow.jax` is ttflow's device, and the compiler runs in its own process (`_compiler`), so the
caller's JAX is made a CPU JAX when `ttflow.jax` is imported, unless the user chose platforms
(`JAX_PLATFORMS`, `jax_platforms`), set up the plugin's compile-only mode in this process, or
started a backend already.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["choose_platforms", "cpu_device", "host_jax"]


def choose_platforms() -> None:
    """Makes JAX a CPU JAX if it is installed, no backend has started, and neither JAX_PLATFORMS,
    `jax_platforms` nor TT_COMPILE_ONLY_SYSTEM_DESC (the user's own compile-only plugin) is set."""
    if os.environ.get("JAX_PLATFORMS") or os.environ.get("TT_COMPILE_ONLY_SYSTEM_DESC"):
        return
    try:
        import jax
        from jax._src import xla_bridge
    except ImportError:
        return  # host_jax says what to install, when JAX is first needed
    if not jax.config.jax_platforms and not xla_bridge._backends:  # type: ignore[attr-defined]
        jax.config.update("jax_platforms", "cpu")
    # the source line a binary records for an op is the caller's, never ttflow.jax's own frames
    from jax._src import source_info_util

    source_info_util.register_exclusion(str(Path(__file__).parent))


def host_jax() -> ModuleType:
    """`jax` (ImportError naming the extra when it is missing)."""
    try:
        import jax
    except ImportError as exc:
        raise ImportError("ttflow.jax needs JAX and Tenstorrent's compiler: pip install '.[jax]' from the "
                          "ttflow checkout (jax==0.10.2, jax-tt-plugin==0.1.3; Python 3.11)") from exc
    return jax


def cpu_device() -> Any:
    return host_jax().devices("cpu")[0]
