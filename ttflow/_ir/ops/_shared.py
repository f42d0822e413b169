"""The compute helpers several families share: a numpy function of one array as an op's
function, and run-time indices clamped into range.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Array", "unary_compute", "clamped_index"]

Array = np.ndarray[Any, Any]


def unary_compute(fn: Callable[[Array], Array]) -> Callable[..., Array]:
    return lambda arrays, scalar: fn(arrays[0])


def clamped_index(index: Array, size: int) -> Array:
    """Run-time indices clamped into [0, size - 1] (JAX's rule: a device op cannot raise)."""
    return np.clip(index.astype(np.int64), 0, size - 1)
