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

from .graph import _T, _Lowering, _register
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



# -- modified Bessel functions of the first kind --------------------------------------------------------

# Cephes i0.c / i1.c: Chebyshev coefficients of exp(-x) I(x) on [0, 8] (A), of exp(-x) sqrt(x) I(x)
# on [8, inf) in 32/x - 2 (B); torch's calc_i0, calc_i0e, calc_i1, calc_i1e use the same.
_I0_A = (-4.41534164647933937950E-18, 3.33079451882223809783E-17, -2.43127984654795469359E-16,
         1.71539128555513303061E-15, -1.16853328779934516808E-14, 7.67618549860493561688E-14,
         -4.85644678311192946090E-13, 2.95505266312963983461E-12, -1.72682629144155570723E-11,
         9.67580903537323691224E-11, -5.18979560163526290666E-10, 2.65982372468238665035E-9,
         -1.30002500998624804212E-8, 6.04699502254191894932E-8, -2.67079385394061173391E-7,
         1.11738753912010371815E-6, -4.41673835845875056359E-6, 1.64484480707288970893E-5,
         -5.75419501008210370398E-5, 1.88502885095841655729E-4, -5.76375574538582365885E-4,
         1.63947561694133579842E-3, -4.32430999505057594430E-3, 1.05464603945949983183E-2,
         -2.37374148058994688156E-2, 4.93052842396707084878E-2, -9.49010970480476444210E-2,
         1.71620901522208775349E-1, -3.04682672343198398683E-1, 6.76795274409476084995E-1)
_I0_B = (-7.23318048787475395456E-18, -4.83050448594418207126E-18, 4.46562142029675999901E-17,
         3.46122286769746109310E-17, -2.82762398051658348494E-16, -3.42548561967721913462E-16,
         1.77256013305652638360E-15, 3.81168066935262242075E-15, -9.55484669882830764870E-15,
         -4.15056934728722208663E-14, 1.54008621752140982691E-14, 3.85277838274214270114E-13,
         7.18012445138366623367E-13, -1.79417853150680611778E-12, -1.32158118404477131188E-11,
         -3.14991652796324136454E-11, 1.18891471078464383424E-11, 4.94060238822496958910E-10,
         3.39623202570838634515E-9, 2.26666899049817806459E-8, 2.04891858946906374183E-7,
         2.89137052083475648297E-6, 6.88975834691682398426E-5, 3.36911647825569408990E-3,
         8.04490411014108831608E-1)
_I1_A = (2.77791411276104639959E-18, -2.11142121435816608115E-17, 1.55363195773620046921E-16,
         -1.10559694773538630805E-15, 7.60068429473540693410E-15, -5.04218550472791168711E-14,
         3.22379336594557470981E-13, -1.98397439776494371520E-12, 1.17361862988909016308E-11,
         -6.66348972350202774223E-11, 3.62559028155211703701E-10, -1.88724975172282928790E-9,
         9.38153738649577178388E-9, -4.44505912879632808065E-8, 2.00329475355213526229E-7,
         -8.56872026469545474066E-7, 3.47025130813767847674E-6, -1.32731636560394358279E-5,
         4.78156510755005422638E-5, -1.61760815825896745588E-4, 5.12285956168575772895E-4,
         -1.51357245063125314899E-3, 4.15642294431288815669E-3, -1.05640848946261981558E-2,
         2.47264490306265168283E-2, -5.29459812080949914269E-2, 1.02643658689847095384E-1,
         -1.76416518357834055153E-1, 2.52587186443633654823E-1)
_I1_B = (7.51729631084210481353E-18, 4.41434832307170791151E-18, -4.65030536848935832153E-17,
         -3.20952592199342395980E-17, 2.96262899764595013876E-16, 3.30820231092092828324E-16,
         -1.88035477551078244854E-15, -3.81440307243700780478E-15, 1.04202769841288027642E-14,
         4.27244001671195135429E-14, -2.10154184277266431302E-14, -4.08355111109219731823E-13,
         -7.19855177624590851209E-13, 2.03562854414708950722E-12, 1.41258074366137813316E-11,
         3.25260358301548823856E-11, -1.89749581235054123450E-11, -5.58974346219658380687E-10,
         -3.83538038596423702205E-9, -2.63146884688951950684E-8, -2.51223623787020892529E-7,
         -3.88256480887769039346E-6, -1.10588938762623716291E-4, -9.76109749136146840777E-3,
         7.78576235018280120474E-1)


def _scaled_bessel(b: Any, a: Any, A: Sequence[float], B: Sequence[float], order: int) -> Any:
    """exp(-a) I_order(a) for a = |x| >= 0: chbevl(a/2 - 2, A) (times a for order 1) up to 8,
    chbevl(32/a - 2, B) / sqrt(a) beyond; each branch reads a clamped into its own range."""
    low = b.minimum(a, 8.0)
    near = _chbevl(b, b.sub(b.mul(low, 0.5), 2.0), A)
    if order == 1:
        near = b.mul(near, low)
    high = b.maximum(a, 8.0)
    far = b.div(_chbevl(b, b.sub(b.div(b.full(a.shape, 32.0, _F32), high), 2.0), B), b.sqrt(high))
    return b.where(b.le(a, 8.0), near, far)


def _i0e_v(b: Any, x: Any) -> Any:
    return _scaled_bessel(b, b.abs(x), _I0_A, _I0_B, 0)


def _i0_v(b: Any, x: Any) -> Any:
    a = b.abs(x)  # exp(|x|) overflows past 88.72, and so does torch's float32 i0
    return b.mul(b.exp(a), _scaled_bessel(b, a, _I0_A, _I0_B, 0))


def _i1e_v(b: Any, x: Any) -> Any:
    s = _scaled_bessel(b, b.abs(x), _I1_A, _I1_B, 1)
    return b.where(b.lt(x, 0), b.neg(s), s)


def _i1_v(b: Any, x: Any) -> Any:
    a = b.abs(x)
    s = b.mul(b.exp(a), _scaled_bessel(b, a, _I1_A, _I1_B, 1))
    return b.where(b.lt(x, 0), b.neg(s), s)


def _spherical_bessel_j0_v(b: Any, x: Any) -> Any:
    """torch's: 0 at +-inf, the Taylor series to x^12 below |x| = 0.5, sin(x) / x beyond."""
    x2 = b.mul(x, x)
    series = _polevl(b, x2, (1.0 / 6227020800.0, -1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0,
                             1.0 / 120.0, -1.0 / 6.0, 1.0))
    ratio = b.div(b.sin(x), x)
    r = b.where(b.lt(b.abs(x), 0.5), series, ratio)
    return b.where(b.eq(b.abs(x), math.inf), 0.0, r)


for _op, _fn in [(aten.i0.default, _i0_v), (aten.special_i0e.default, _i0e_v),
                 (aten.special_i1.default, _i1_v), (aten.special_i1e.default, _i1e_v),
                 (aten.special_spherical_bessel_j0.default, _spherical_bessel_j0_v)]:
    _register(_op)(_float_unary(_fn))


# -- digamma, trigamma, lgamma ----------------------------------------------------------------------------

_PI32 = float(torch.tensor(math.pi, dtype=torch.float32))
_PI32_SQUARED = float(torch.tensor(_PI32, dtype=torch.float32) * torch.tensor(_PI32, dtype=torch.float32))
_PSI_10 = 2.25175258906672110764
_DIGAMMA_A = (8.33333333333333333333E-2, -2.10927960927960927961E-2, 7.57575757575757575758E-3,
              -4.16666666666666666667E-3, 3.96825396825396825397E-3, -8.33333333333333333333E-3,
              8.33333333333333333333E-2)


def _digamma_v(b: Any, x: Any) -> Any:
    """torch's float32 calc_digamma (Cephes psi): -+inf at +-0, NaN at the negative integers,
    digamma(1 - x) - pi / tan(pi x) below 0, else 1/x steps up to
    x >= 10 (at most 10: unrolled, finished lanes keep their value) and the asymptotic series."""
    negative = b.lt(x, 0)
    v = b.where(negative, _rsub(b, 1.0, x), x)
    result = b.full(x.shape, 0.0, _F32)
    for _ in range(10):
        below = b.lt(v, 10.0)
        result = b.sub(result, b.where(below, b.reciprocal(v), 0.0))
        v = b.where(below, b.add(v, 1.0), v)
    z = b.reciprocal(b.mul(v, v))
    y = b.mul(z, _polevl(b, z, _DIGAMMA_A))
    series = b.sub(b.sub(b.add(result, b.log(v)), b.div(b.full(v.shape, 0.5, _F32), v)), y)
    psi = b.where(b.eq(v, 10.0), b.add(result, _PSI_10), series)
    # tan(pi x) as tan(pi s) with s = x - round(x) exact: pi s rounds relatively, as torch's
    # (pi * x itself would lose the digits of x's fraction near a pole)
    t = b.mul(b.sub(x, b.round(x)), math.pi)
    reflected = b.sub(psi, b.div(b.full(x.shape, math.pi, _F32), b.div(b.sin(t), b.cos(t))))
    nan = b.sqrt(b.full(x.shape, -1.0, _F32))
    psi = b.where(negative, b.where(b.eq(x, b.trunc(x)), nan, reflected), psi)
    zero = b.neg(b.reciprocal(x))  # +0 -> -inf, -0 -> +inf
    return b.where(b.eq(x, 0), zero, psi)


def _trigamma_v(b: Any, x: Any) -> Any:
    """torch's float32 trigamma, step for step: below 0.5 the reflection (-pi^2 / sin^2(pi x),
    then x -> 1 - x and the whole negated), six 1/x^2 steps, the asymptotic series."""
    small = b.lt(x, 0.5)
    s = b.sin(b.mul(x, _PI32))
    result = b.where(small, b.neg(b.div(b.full(x.shape, _PI32_SQUARED, _F32), b.mul(s, s))), 0.0)
    v = b.where(small, _rsub(b, 1.0, x), x)
    for _ in range(6):
        result = b.add(result, b.reciprocal(b.mul(v, v)))
        v = b.add(v, 1.0)
    ixx = b.reciprocal(b.mul(v, v))
    inner = _rsub(b, 1.0 / 30, b.mul(ixx, 1.0 / 42))
    inner = _rsub(b, 1.0 / 6, b.mul(ixx, inner))
    tail = b.add(b.add(b.reciprocal(b.mul(v, 2.0)), 1.0), b.mul(ixx, inner))
    result = b.add(result, b.div(tail, v))
    return b.where(small, b.neg(result), result)


_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _lgamma_v(b: Any, x: Any) -> Any:
    """log|Gamma(x)|: for x >= 0, Stirling's series at v = x + k >= 8 (k <= 8 shifts, one product
    of the shifted factors), minus log of that product; below 0 the reflection
    log(pi) - log|sin(pi r)| - lgamma(1 - x) with r = x - round(x) (exact); inf at 0, at the
    negative integers (every float32 past 2**23 is one) and at the infinities."""
    negative = b.lt(x, 0)
    v = b.where(negative, _rsub(b, 1.0, x), x)
    product = b.full(x.shape, 1.0, _F32)
    for _ in range(8):
        below = b.lt(v, 8.0)
        product = b.where(below, b.mul(product, v), product)
        v = b.where(below, b.add(v, 1.0), v)
    inv = b.reciprocal(v)
    inv2 = b.mul(inv, inv)
    correction = b.mul(inv, _polevl(b, inv2, (-1.0 / 1680, 1.0 / 1260, -1.0 / 360, 1.0 / 12)))
    stirling = b.add(b.add(b.sub(b.mul(b.sub(v, 0.5), b.log(v)), v), _HALF_LOG_2PI), correction)
    positive = b.sub(stirling, b.log(product))
    r = b.sub(x, b.round(x))
    reflected = b.sub(_rsub(b, math.log(math.pi), b.log(b.abs(b.sin(b.mul(r, math.pi))))), positive)
    result = b.where(negative, b.where(b.eq(r, 0), math.inf, reflected), positive)
    return b.where(b.eq(b.abs(x), math.inf), math.inf, result)


for _op, _fn in [(aten.digamma.default, _digamma_v), (aten.lgamma.default, _lgamma_v)]:
    _register(_op)(_float_unary(_fn))


@_register(aten.polygamma.default)
def _polygamma(L: _Lowering, node: torch.fx.Node, n: int, x: _T) -> Any:
    if n == 0:
        return _digamma_v(L.b, L.f32(x))
    if n == 1:
        return _trigamma_v(L.b, L.f32(x))
    raise L.unsupported(f"polygamma of order {n}: only orders 0 and 1 lower (higher ones need "
                        "Hurwitz's zeta with a data-dependent number of terms)")
