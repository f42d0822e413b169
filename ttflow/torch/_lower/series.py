"""Evaluating Cephes' series on the device: polynomials (Horner), monic ones, Chebyshev
series (Clenshaw), shared by the special-function lowerings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import ttflow as tt

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


def _polevl(b: Any, x: Any, coefficients: Sequence[float]) -> Any:
    """c[0] x**n + ... + c[n] by Horner's rule (Cephes' polevl)."""
    r = b.add(b.mul(x, coefficients[0]), coefficients[1])
    for c in coefficients[2:]:
        r = b.add(b.mul(r, x), c)
    return r


def _p1evl(b: Any, x: Any, coefficients: Sequence[float]) -> Any:
    """x**n + c[0] x**(n-1) + ... + c[n-1]: Cephes' p1evl (a leading 1 left out)."""
    r = b.add(x, coefficients[0])
    for c in coefficients[1:]:
        r = b.add(b.mul(r, x), c)
    return r


def _rsub(b: Any, c: float, v: Any) -> Any:
    """c - v for a number c."""
    return b.add(b.neg(v), c)


def _chbevl(b: Any, x: Any, coefficients: Sequence[float]) -> Any:
    """Cephes' chbevl: the Chebyshev series sum at x (Clenshaw's recurrence), halved."""
    b0 = b.full(x.shape, coefficients[0], _F32)
    b1: Any = 0.0
    b2: Any = 0.0
    for c in coefficients[1:]:
        b2, b1 = b1, b0
        t = b.mul(x, b1)
        b0 = b.add(b.sub(t, b2) if not isinstance(b2, float) else t, c)
    return b.mul(b.sub(b0, b2) if not isinstance(b2, float) else b0, 0.5)


def _split(b: Any, a: Any) -> tuple[Any, Any]:
    """Veltkamp's split of float32 a into 12-bit halves hi + lo == a (|a| <= 2**100, so that
    4097 a cannot overflow)."""
    t = b.mul(a, 4097.0)
    hi = b.sub(t, b.sub(t, a))
    return hi, b.sub(a, hi)
