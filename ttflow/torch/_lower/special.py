"""Special functions (torch.special and their ATen ops): the approximations torch's CPU kernels
use (Cephes' rational and Chebyshev expansions, aten/src/ATen/native/Math.h), evaluated in
FLOAT32 on the device from its add/mul/div/exp/log/sqrt/erf, each compared with CPU torch
across its domain (tests/test_torch_pointwise_ops.py).

The Cephes Math Library is Copyright (c) 2018, Steven Moshier, under the 3-clause BSD license;
the coefficients below are its published ones."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

import ttflow as tt

from .graph import _register
from .pointwise import _float_unary

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32


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


# -- erfc, erfcx --------------------------------------------------------------------------------------

# Cephes ndtr.c: erfc(x) = exp(-x^2) P(x) / Q(x) for 1 <= x < 8, exp(-x^2) R(x) / S(x) beyond.
_ERFC_P = (2.46196981473530512524E-10, 5.64189564831068821977E-1, 7.46321056442269912687E0,
           4.86371970985681366614E1, 1.96520832956077098242E2, 5.26445194995477358631E2,
           9.34528527171957607540E2, 1.02755188689515710272E3, 5.57535335369399327526E2)
_ERFC_Q = (1.32281951154744992508E1, 8.67072140885989742329E1, 3.54937778887819891062E2,
           9.75708501743205489753E2, 1.82390916687909736289E3, 2.24633760818710981792E3,
           1.65666309194161350182E3, 5.57535340817727675546E2)
_ERFC_R = (5.64189583547755073984E-1, 1.27536670759978104416E0, 5.01905042251180477414E0,
           6.16021097993053585195E0, 7.40974269950448939160E0, 2.97886665372100240670E0)
_ERFC_S = (2.26052863220117276590E0, 9.39603524938001434673E0, 1.20489539808096656605E1,
           1.70814450747565897222E1, 9.60896809063285878198E0, 3.36907645100081516050E0)


def _expx2(b: Any, a: Any, sign: float) -> Any:
    """exp(sign * a^2) for a >= 0 without the error of rounding a^2 (Cephes' expx2): a = m + f
    with m a multiple of 1/16 (m^2 exact), exp(sign m^2) * exp(sign f (2m + f))."""
    m = b.div(b.floor(b.add(b.mul(a, 16.0), 0.5)), 16.0)
    f = b.sub(a, m)
    return b.mul(b.exp(b.mul(b.mul(m, m), sign)), b.exp(b.mul(b.mul(f, b.add(m, a)), sign)))


def _erfcx_large(b: Any, a: Any) -> Any:
    """erfcx(a) = exp(a^2) erfc(a) for a >= 1: Cephes' P/Q below 8, R/S to 2**10, then the
    asymptotic series 1/(a sqrt(pi)) (1 - 1/(2a^2)) (the rational forms' powers would
    overflow)."""
    pq = b.div(_polevl(b, a, _ERFC_P), _p1evl(b, a, _ERFC_Q))
    ar = b.minimum(a, 1024.0)
    rs = b.div(_polevl(b, ar, _ERFC_R), _p1evl(b, ar, _ERFC_S))
    inv = b.reciprocal(a)
    asym = b.mul(b.mul(inv, 1.0 / math.sqrt(math.pi)), _rsub(b, 1.0, b.mul(b.mul(inv, inv), 0.5)))
    return b.where(b.lt(a, 8.0), pq, b.where(b.lt(a, 1024.0), rs, asym))


def _erfc_v(b: Any, x: Any) -> Any:
    """Cephes' erfc: 1 - erf(x) for |x| < 1; exp(-x^2) erfcx(|x|) beyond (2 minus it below
    0); 0 and 2 from |x| = 11 on."""
    a = b.abs(x)
    big = b.ge(a, 1.0)
    clamped = b.minimum(b.where(big, a, 1.0), 11.0)  # exp(-121) is 0 in float32
    tail = b.mul(_expx2(b, clamped, -1.0), _erfcx_large(b, clamped))
    tail = b.where(b.lt(x, 0), _rsub(b, 2.0, tail), tail)
    return b.where(big, tail, _rsub(b, 1.0, b.erf(x)))


def _erfcx_v(b: Any, x: Any) -> Any:
    """exp(x^2) erfc(x): the rational forms for x >= 1; exp(x^2) (1 - erf(x)) for |x| < 1;
    2 exp(x^2) - erfcx(-x) below -1 (infinite past -9.4, as torch's)."""
    a = b.abs(x)
    big = b.ge(a, 1.0)
    large = _erfcx_large(b, b.where(big, a, 1.0))
    negative = b.sub(b.mul(_expx2(b, b.minimum(a, 10.0), 1.0), 2.0), large)
    small = b.mul(b.exp(b.mul(x, x)), _rsub(b, 1.0, b.erf(x)))
    r = b.where(big, b.where(b.lt(x, 0), negative, large), small)
    return b.where(b.eq(x, -math.inf), math.inf, r)


# -- erfinv -------------------------------------------------------------------------------------------

_ERFINV_A = (0.886226899, -1.645349621, 0.914624893, -0.140543331)
_ERFINV_B = (-2.118377725, 1.442710462, -0.329097515, 0.012229801)
_ERFINV_C = (-1.970840454, -1.624906493, 3.429567803, 1.641345311)
_ERFINV_D = (3.543889200, 1.637067800)


def _erfinv_v(b: Any, y: Any) -> Any:
    """torch's calc_erfinv (Pavlis's rational approximation, central below 0.7, then two
    Newton steps on erf), step for step in float32; NaN past |y| > 1, +-inf at +-1."""
    a = b.abs(y)
    z = b.mul(y, y)
    num = _polevl(b, z, _ERFINV_A[::-1])
    dem = b.add(b.mul(_polevl(b, z, _ERFINV_B[::-1]), z), 1.0)
    central = b.div(b.mul(y, num), dem)
    w = b.sqrt(b.neg(b.log(b.div(_rsub(b, 1.0, b.minimum(a, 0.99999994)), 2.0))))
    num = _polevl(b, w, _ERFINV_C[::-1])
    dem = b.add(b.mul(b.add(b.mul(w, _ERFINV_D[1]), _ERFINV_D[0]), w), 1.0)
    tail = b.div(b.where(b.lt(y, 0), b.neg(num), num), dem)
    x = b.where(b.le(a, 0.7), central, tail)
    for _ in range(2):
        slope = b.mul(b.exp(b.neg(b.mul(x, x))), 2.0 / math.sqrt(math.pi))
        x = b.sub(x, b.div(b.sub(b.erf(x), y), slope))
    x = b.where(b.eq(a, 1.0), b.mul(y, math.inf), x)
    return b.where(b.gt(a, 1.0), b.sqrt(b.full(a.shape, -1.0, _F32)), x)


for _op, _fn in [(aten.erfc.default, _erfc_v), (aten.special_erfcx.default, _erfcx_v),
                 (aten.erfinv.default, _erfinv_v)]:
    _register(_op)(_float_unary(_fn))

