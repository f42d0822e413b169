"""What the PyTorch front-end's tests share: a guard that fails on any op run on the CPU (the
fixtures `device` and `on_device_only` are in conftest.py)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def only_on_device() -> Iterator[None]:
    """Fails on any op run on the CPU or any compiled graph run op by op (the fallback warns
    once per op per process: its record is cleared first, so an earlier test cannot hide one)."""
    from ttflow.torch import _fallback

    _fallback.warned.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran on the CPU")
        warnings.filterwarnings("error", message=".*runs eagerly, op by op")
        yield
