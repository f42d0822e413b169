"""What the PyTorch front-end's tests share: a guard that fails on any op run on the CPU (the
fixtures `device` and `on_device_only` are in conftest.py)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any


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


def assert_matches_cpu(got: Any, expected: Any) -> None:
    """`got`, a tt tensor, equals CPU torch's `expected`: shape and dtype exactly, integers and
    bools exactly, floats within 1e-5 (relative and absolute), NaN where the CPU has NaN."""
    import torch

    assert got.device.type == "tt"
    got = got.cpu()
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got, expected)
    if expected.dtype.is_floating_point:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, equal_nan=True)
    else:
        assert torch.equal(got, expected), (got, expected)
