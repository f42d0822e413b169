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

from .graph import _T, _ishape, _Lowering, _op_name, _out, _register, _user_line
from .pointwise import _float_unary, _frexp_v

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
    """Orders 0 and 1 as digamma and trigamma; from 2 on torch's (-1)**(n+1) n! zeta(n + 1, x)
    (its float n! is exp(lgamma(n + 1)), within an ulp of the exact one used here), the powers
    (x + k)**-(n+1) by repeated multiplication."""
    if n == 0:
        return _digamma_v(L.b, L.f32(x))
    if n == 1:
        return _trigamma_v(L.b, L.f32(x))
    b = L.b
    if n < 0 or n > 30:
        raise L.unsupported(f"polygamma of order {n} (orders 0 to 30 lower)")
    v = L.f32(x)
    order = b.full(_ishape(x.shape), float(n + 1), _F32)

    def power(a: Any) -> Any:  # a**-(n+1), the sign of a negative a's odd powers kept
        return b.reciprocal(_integer_power_v(b, a, n + 1))

    factor = float(math.factorial(n)) * (1.0 if n % 2 else -1.0)
    # below 0 the reflection psi(n)(x) = (-1)**n psi(n)(1 - x) - pi**(n+1) P_n(cot(pi x)) (the
    # direct sum would cancel terms far larger than the result in float32; torch's runs in double)
    negative = b.lt(v, 0)
    z = _hurwitz_zeta(L, order, b.where(negative, _rsub(b, 1.0, v), v), power, integer_x=True)
    direct = b.mul(z, factor)
    r = b.sub(v, b.round(v))  # exact; cot(pi x) = cot(pi r)
    # cot(pi r) = cos / sin below |r| = 1/4, sign(r) tan(pi (1/2 - |r|)) above (1/2 - |r| is exact,
    # so cot keeps its relative precision near its zero at 1/2, where cos(pi r) would not)
    ar = b.abs(r)
    t = b.mul(r, math.pi)
    near = b.div(b.cos(t), b.sin(t))
    u = b.mul(_rsub(b, 0.5, ar), math.pi)
    far = b.div(b.sin(u), b.cos(u))
    cot = b.where(b.le(ar, 0.25), near, b.where(b.lt(r, 0), b.neg(far), far))
    c2 = b.mul(cot, cot)
    coefficients = _cot_derivative(n)  # P_n(c) = c**(n % 2 == 0) * sum_k coefficients[k] c**(2k)
    poly = _polevl(b, c2, coefficients[::-1]) if len(coefficients) > 1 else b.full(c2.shape, coefficients[0], _F32)
    if n % 2 == 0:
        poly = b.mul(poly, cot)
    reflected = b.sub(b.mul(direct, 1.0 if n % 2 == 0 else -1.0), b.mul(poly, math.pi ** (n + 1)))
    pole = b.mul(negative, b.maximum(b.eq(r, 0), b.eq(v, -math.inf)))
    reflected = b.where(pole, factor * math.inf, reflected)  # torch's sign * n! * inf at the poles
    return b.where(negative, reflected, direct)


def _cot_derivative(n: int) -> list[float]:
    """The n-th derivative of cot(u) is P_n(cot u), P_0(c) = c, P_(k+1) = -(1 + c**2) P_k'(c):
    P_n's coefficients of c**(n%2==0 ? 1 : 0) * c**(2k) (its parity is n + 1's; one sign)."""
    p = [0, 1]  # coefficients of c**j
    for _ in range(n):
        d = [j * p[j] for j in range(1, len(p))] + [0]
        p = [-((d[j] if j < len(d) else 0) + (d[j - 2] if j >= 2 else 0)) for j in range(len(d) + 2)]
        while p and p[-1] == 0:
            p.pop()
    start = 1 if n % 2 == 0 else 0
    return [float(p[j]) if j < len(p) else 0.0 for j in range(start, len(p), 2)]


# -- Hurwitz's zeta ------------------------------------------------------------------------------------

_ZETA_A = (12.0, -720.0, 30240.0, -1209600.0, 47900160.0, -1.8924375803183791606e9, 7.47242496e10,
           -2.950130727918164224e12, 1.1646782814350067249e14, -4.5979787224074726105e15,
           1.8152105401943546773e17, -7.1661652561756670113e18)
_MACHEP = 1.11022302462515654042e-16
_ZETA_TERMS = 32
"""torch's zeta sums (q + k)**-x for k = 0 to at least 9, on until q + k passes 9, before its
Euler-Maclaurin tail: 32 unrolled terms reach every q > -22 (OpInfo's reach -9); a lane with q
further below fails the run with a ProgramError naming the op, never a wrong value."""


def _integer_power_v(b: Any, a: Any, p: int) -> Any:
    """a**p for a whole p >= 1 by squaring, in float32."""
    result = None
    while p:
        if p & 1:
            result = a if result is None else b.mul(result, a)
        p >>= 1
        if p:
            a = b.mul(a, a)
    return result


def _hurwitz_zeta(L: _Lowering, x: Any, q: Any, power: Any, integer_x: bool) -> Any:
    """torch's zeta(x, q) (Cephes' zeta.c, which torch runs in double for float32): inf at x = 1,
    NaN below; for q <= 0 inf at the integers and NaN for a fractional x; else the direct sum
    of `power(q + k)` (= (q + k)**-x) for k up to max(9, 9 - q) and the Euler-Maclaurin tail
    b w / (x - 1) - b / 2 + sum_i B_2i/(2i)! x(x+1)...(x+2i-1) b / w**2i over 12 Bernoulli
    terms at w = q + k. torch returns the direct sum once a term is below 1.1e-16 of it (so at
    infinite sums and exponents), and so does this (the float32 test may decide otherwise near
    the threshold, where both results are the same float32); its tail's own stop is left out:
    the terms it skips change no float32 sum."""
    b = L.b
    s = power(q)
    a = q
    last = s
    done = b.full(s.shape, 0.0, _F32)  # torch's return from the direct sum
    for i in range(1, _ZETA_TERMS + 1):
        going = b.eq(done, 0)
        if i > 9:  # torch's `while (i < 9 || a <= 9)`
            going = b.mul(going, b.le(a, 9.0))
        a_next = b.add(a, 1.0)
        term = power(a_next)
        total = b.add(s, term)
        s, a, last = b.where(going, total, s), b.where(going, a_next, a), b.where(going, term, last)
        small = b.mul(b.lt(b.mul(total, -_MACHEP), term), b.lt(term, b.mul(total, _MACHEP)))
        done = b.where(b.mul(going, small), 1.0, done)
    more = b.mul(b.le(a, 9.0), b.eq(done, 0))  # would need another term (NaN q: compares false)
    direct = s
    w = a
    s = b.add(s, b.div(b.mul(last, w), b.sub(x, 1.0)))
    s = b.sub(s, b.mul(last, 0.5))
    c = b.div(b.mul(x, last), w)  # x (x+1) ... (x+2i) b / w**(2i+1), step by step
    for i, coefficient in enumerate(_ZETA_A):
        if i:
            c = b.mul(b.mul(c, b.div(b.add(x, float(2 * i - 1)), w)), b.div(b.add(x, float(2 * i)), w))
        s = b.add(s, b.div(c, coefficient))
    s = b.where(b.ne(done, 0), direct, s)
    # the domain
    nan = b.sqrt(b.full(s.shape, -1.0, _F32))
    nonpositive = b.le(q, 0)
    whole_q = b.eq(q, b.floor(q))
    r = s
    if not integer_x:
        r = b.where(b.mul(nonpositive, b.ne(x, b.floor(x))), nan, r)
    r = b.where(b.mul(nonpositive, whole_q), math.inf, r)
    r = b.where(b.eq(q, math.inf), nan, r)
    r = b.where(b.lt(x, 1.0), nan, b.where(b.eq(x, 1.0), math.inf, r))
    assert L.node is not None
    needs_more = b.mul(more, b.eq(b.mul(nonpositive, whole_q), 0))
    flag = b.typecast(needs_more, _F32)
    with b.checking_range(f"{_op_name(L.node.target)} of q below -{_ZETA_TERMS - 10} (the tt device sums "
                          f"{_ZETA_TERMS} terms of its series){_user_line(L.node)}"):
        check = b.typecast(b.mul(flag, 3.0e9), _I32)  # 0, or a failed range check
    r = b.where(b.eq(check, 0), r, r)
    if not integer_x:  # polygamma reflects a negative argument instead
        odd = b.mul(b.mul(b.lt(q, 0), b.ne(q, b.floor(q))), b.eq(b.fmod(x, 2.0), 1.0))
        with b.checking_range(f"{_op_name(L.node.target)} of a negative q and an odd x (its terms of "
                              f"both signs cancel in float32; torch sums in double){_user_line(L.node)}"):
            check = b.typecast(b.mul(b.typecast(odd, _F32), 3.0e9), _I32)
        r = b.where(b.eq(check, 0), r, r)
    return r


_LN2_HI = 0.693145751953125  # 16 bits: e * _LN2_HI is exact for |e| < 256
_LN2_LO = 1.4286068203094172321e-06


def _power_v(b: Any, a: Any, x: Any) -> Any:
    """|a|**-x (x >= 1), accurate to about an ulp where exp(-x log|a|) in float32 would lose
    |x log a| ulps: log|a| = e ln2 + log m (m in [sqrt 1/2, sqrt 2), e ln2 split in two), the
    product with x exact by Dekker's, exp of its high part times (1 + the rest); for a negative
    a (then torch's x is whole) the sign of the odd powers."""
    aa = b.abs(a)
    ordinary = b.mul(b.gt(aa, 0), b.lt(aa, math.inf))
    m, e = _frexp_v(b, b.where(ordinary, aa, 1.0))
    low = b.lt(m, 0.70710678)
    m, e = b.where(low, b.mul(m, 2.0), m), b.sub(e, b.typecast(low, _I32))
    ef = b.typecast(e, _F32)
    hi = b.mul(ef, _LN2_HI)
    lm = b.log(m)
    log_hi = b.add(hi, lm)
    log_lo = b.add(b.sub(lm, b.sub(log_hi, hi)), b.mul(ef, _LN2_LO))  # two-sum (|hi| >= |lm| or hi = 0)
    p = b.mul(x, log_hi)
    xh, xl = _split(b, b.where(b.lt(b.abs(x), 2.0**100), x, 0.0))
    gh, gl = _split(b, log_hi)
    pe = b.add(b.add(b.add(b.sub(b.mul(xh, gh), p), b.mul(xh, gl)), b.mul(xl, gh)), b.mul(xl, gl))
    rest = b.add(pe, b.mul(x, log_lo))
    big = b.exp(b.neg(p))
    r = b.sub(big, b.mul(big, rest))
    r = b.where(b.eq(b.sub(r, r), 0), r, big)  # the correction's own overflow or NaN
    r = b.where(b.eq(aa, 0), math.inf, b.where(b.eq(aa, math.inf), 0.0, r))
    r = b.where(b.eq(aa, 1.0), 1.0, r)  # 1**-x, x infinite too
    odd = b.mul(b.lt(a, 0), b.eq(b.fmod(x, 2.0), 1.0))
    r = b.where(odd, b.neg(r), r)
    return b.where(b.ne(aa, aa), aa, r)


@_register(aten.special_zeta.default, aten.special_zeta.self_scalar, aten.special_zeta.other_scalar)
def _zeta(L: _Lowering, node: torch.fx.Node, x: Any, q: Any) -> Any:
    b = L.b
    shape = _ishape(_out(node).shape)
    xv, qv = ((L.f32(v) if isinstance(v, _T) else b.full(shape, float(v), _F32)) for v in (x, q))
    xv, qv = ((v if v.shape == shape else b.broadcast_to(v, shape)) for v in (xv, qv))
    return _hurwitz_zeta(L, xv, qv, lambda a: _power_v(b, a, xv), integer_x=False)


# -- Bessel functions of the first and second kind, modified of the second kind, Airy's Ai, ndtri ------
#
# torch's bessel_j0/j1/y0/y1, modified_bessel_k0/k1 (and scaled), airy_ai and calc_ndtri
# (aten/src/ATen/native/Math.h, Cephes j0.c, j1.c, k0.c, k1.c, airy.c, ndtri.c), step for step in
# float32 (the float kernels' own type): each branch reads its argument clamped into its own range,
# so the branches not taken stay finite and the where picks torch's.

_AIRY_AN = (0.346538101525629, 12.007595273964581, 76.27960536152345, 168.08922493463058, 159.75639135016442,
            70.53609068404442, 14.026469116338967, 1.0)
_AIRY_AD = (0.5675945326387702, 14.75625625848472, 84.51389701414746, 177.31808814540045, 164.2346928715297,
            71.47784008255756, 14.095913560783403, 1.0)
_AIRY_AFN = (-0.1316963234183318, -0.6264565444319123, -0.6931580360369335, -0.2797799815451191,
             -0.04919001326095003, -0.004062659235948854, -0.0001592764962392621, -2.776491081552329e-06,
             -1.6778769848911465e-08)
_AIRY_AFD = (13.356042070655324, 32.682503279522464, 26.736704094149957, 9.187074029072596,
             1.4752914677166642, 0.11568717379518804, 0.004402916416152112, 7.547203482874142e-05,
             4.5185009297058035e-07)
_AIRY_AGN = (0.01973399320916857, 0.39110302961568827, 1.0657989759959559, 0.9391692298166502,
             0.35146565610554764, 0.06338889196289255, 0.005858041130483885, 0.000282851600836737,
             6.98793669997261e-06, 8.117892395543892e-08, 3.415517847659236e-10)
_AIRY_AGD = (9.30892908077442, 19.835292871831214, 15.564662893286462, 5.476860694229755, 0.9542936116189619,
             0.08645808263523921, 0.004126565238242226, 0.00010125908511650914, 1.1716673321441352e-06,
             4.9183457006293e-09)
_J0_PP = (0.0007969367292973471, 0.08283523921074408, 1.239533716464143, 5.447250030587687, 8.74716500199817,
          5.303240382353949, 1.0)
_J0_PQ = (0.0009244088105588637, 0.08562884743544745, 1.2535274390105895, 5.470977403304171,
          8.761908832370695, 5.306052882353947, 1.0)
_J0_QP = (-0.011366383889846916, -1.2825271867050931, -19.553954425773597, -93.20601521237683,
          -177.68116798048806, -147.07750515495118, -51.41053267665993, -6.050143506007285)
_J0_QQ = (64.3178256118178, 856.4300259769806, 3882.4018360540163, 7240.467741956525, 5930.727011873169,
          2062.0933166032783, 242.0057402402914)
_J0_RP = (-4794432209.782018, 1956174919465.5657, -249248344360967.72, 9708622510473064.0)
_J0_RQ = (499.563147152651, 173785.4016763747, 48440965.83399621, 11185553704.535683, 2112775201154.892,
          310518229857422.56, 3.1812195594320496e+16, 1.7108629408104315e+18)
_J1_PP = (0.0007621256162081731, 0.07313970569409176, 1.1271960812968493, 5.112079511468076,
          8.424045901417724, 5.214515986823615, 1.0)
_J1_PQ = (0.0005713231280725487, 0.06884559087544954, 1.105142326340617, 5.073863861286015,
          8.399855543276042, 5.209828486823619, 1.0)
_J1_QP = (0.05108625947501766, 4.982138729512334, 75.82382841325453, 366.7796093601508, 710.8563049989261,
          597.4896124006136, 211.68875710057213, 25.207020585802372)
_J1_QQ = (74.23732770356752, 1056.4488603826283, 4986.410583376536, 9562.318924047562, 7997.041604473507,
          2826.1927851763908, 336.0936078106983)
_J1_RP = (-899971225.7055594, 452228297998.19403, -72749424522181.83, 3682957328638529.0)
_J1_RQ = (620.8364781180543, 256987.25675774884, 83514679.14319493, 22151159547.97925, 4749141220799.914,
          784369607876235.9, 8.952223361846274e+16, 5.322786203326801e+18)
_Y0_YP = (15592.436785523574, -14663929.59039716, 5435264770.518765, -982136065717.9115, 87590639439536.7,
          -3466283033847297.0, 4.4273326857256984e+16, -1.8495080043698668e+16)
_Y0_YQ = (1041.2835366425984, 626107.330137135, 268919633.39381415, 86400248710.3935, 20297961275010.555,
          3171577528429750.5, 2.5059625617265306e+17)
_Y1_YP = (1263204747.9017804, -647355876379.1603, 114509511541823.73, -8127702555013251.0,
          2.024394757135949e+17, -7.788771962659501e+17)
_Y1_YQ = (594.3015923461282, 235564.09294306856, 73481194.44597217, 18760131610.870617, 3882312774962.3857,
          620557727146953.8, 6.871410873553005e+16, 3.9727060811656064e+18)
_K0_A = (1.374465435613523e-16, 4.25981614279661e-14, 1.0349695257633842e-11, 1.904516377220209e-09,
         2.5347910790261494e-07, 2.286212103119452e-05, 0.001264615411446926, 0.0359799365153615,
         0.3442898999246285, -0.5353273932339028)
_K0_B = (5.300433772686263e-18, -1.6475804301524212e-17, 5.2103915050390274e-17, -1.678231096805412e-16,
         5.512055978524319e-16, -1.848593377343779e-15, 6.3400764774050706e-15, -2.2275133269916698e-14,
         8.032890775363575e-14, -2.9800969231727303e-13, 1.140340588208475e-12, -4.514597883373944e-12,
         1.8559491149547177e-11, -7.957489244477107e-11, 3.577397281400301e-10, -1.69753450938906e-09,
         8.574034017414225e-09, -4.660489897687948e-08, 2.766813639445015e-07, -1.8317555227191195e-06,
         1.39498137188765e-05, -0.00012849549581627802, 0.0015698838857300533, -0.0314481013119645,
         2.4403030820659555)
_K1_A = (-7.023863479386288e-18, -2.427449850519366e-15, -6.666901694199329e-13, -1.4114883926335278e-10,
         -2.213387630734726e-08, -2.4334061415659684e-06, -0.0001730288957513052, -0.006975723859639864,
         -0.12261118082265715, -0.3531559607765449, 1.5253002273389478)
_K1_B = (-5.756744483665017e-18, 1.7940508731475592e-17, -5.689462558442859e-17, 1.838093544366639e-16,
         -6.057047248373319e-16, 2.038703165624334e-15, -7.019837090418314e-15, 2.4771544244813043e-14,
         -8.976705182324994e-14, 3.3484196660784293e-13, -1.2891739609510289e-12, 5.13963967348173e-12,
         -2.1299678384275683e-11, 9.218315187605006e-11, -4.1903547593418965e-10, 2.015049755197033e-09,
         -1.0345762465678097e-08, 5.7410841254500495e-08, -3.5019606030878126e-07, 2.406484947837217e-06,
         -1.936197974166083e-05, 0.00019521551847135162, -0.002857816859622779, 0.10392373657681724,
         2.7206261904844427)
_NDTRI_P0 = (-59.96335010141079, 98.00107541859997, -56.67628574690703, 13.931260938727968,
             -1.2391658386738125)
_NDTRI_Q0 = (1.0, 1.9544885833814176, 4.676279128988815, 86.36024213908905, -225.46268785411937,
             200.26021238006066, -82.03722561683334, 15.90562251262117, -1.1833162112133)
_NDTRI_P1 = (4.0554489230596245, 31.525109459989388, 57.16281922464213, 44.08050738932008,
             14.684956192885803, 2.1866330685079025, -0.1402560791713545, -0.03504246268278482,
             -0.0008574567851546854)
_NDTRI_Q1 = (1.0, 15.779988325646675, 45.39076351288792, 41.3172038254672, 15.04253856929075,
             2.504649462083094, -0.14218292285478779, -0.03808064076915783, -0.0009332594808954574)
_NDTRI_P2 = (3.2377489177694603, 6.915228890689842, 3.9388102529247444, 1.3330346081580755,
             0.20148538954917908, 0.012371663481782003, 0.00030158155350823543, 2.6580697468673755e-06,
             6.239745391849833e-09)
_NDTRI_Q2 = (1.0, 6.02427039364742, 3.6798356385616087, 1.3770209948908132, 0.21623699359449663,
             0.013420400608854318, 0.00032801446468212774, 2.8924786474538068e-06, 6.790194080099813e-09)

_PIO4 = 0.785398163397448309615660845819875721
_3PIO4 = 2.356194490192344928846982537459627163
_SQ2OPI = 0.797884560802865355879892119868763737
_TWOOPI = 0.636619772367581343075535053490057448


def _hankel(b: Any, a: Any, pp: Sequence[float], pq: Sequence[float], qp: Sequence[float],
            qq: Sequence[float], shift: float, order: int, second_kind: bool) -> Any:
    """The large-argument form for a >= 5: P cos(a - shift) - 5/a Q sin(a - shift) (J), or
    P sin + 5/a Q cos (Y), times sqrt(2/pi) / sqrt(a); P and Q rational in 25/a^2 (order 0) or
    (5/a)(5/a) (order 1), as torch writes each."""
    if order == 0:
        w = b.div(b.full(a.shape, 25.0, _F32), b.mul(a, a))
    else:
        f = b.div(b.full(a.shape, 5.0, _F32), a)
        w = b.mul(f, f)
    p = b.div(_polevl(b, w, pp), _polevl(b, w, pq))
    q = b.mul(b.div(b.full(a.shape, 5.0, _F32), a), b.div(_polevl(b, w, qp), _polevl(b, w, qq)))
    t = b.sub(a, shift)
    if second_kind:
        r = b.add(b.mul(p, b.sin(t)), b.mul(q, b.cos(t)))
    else:
        r = b.sub(b.mul(p, b.cos(t)), b.mul(q, b.sin(t)))
    return b.div(b.mul(r, _SQ2OPI), b.sqrt(a))


def _j0_small(b: Any, a: Any) -> Any:
    """J0 for 0 <= a <= 5: (a^2 - r1^2)(a^2 - r2^2) RP(a^2) / RQ(a^2), 1 - a^2/4 below 1e-5."""
    z = b.mul(a, a)
    roots = b.mul(b.sub(z, 5.78318596294678452118), b.sub(z, 3.04712623436620863991e+01))
    r = b.div(b.mul(roots, _polevl(b, z, _J0_RP)), _polevl(b, z, _J0_RQ))
    return b.where(b.lt(a, 0.00001), _rsub(b, 1.0, b.div(z, 4.0)), r)


def _j1_small(b: Any, x: Any) -> Any:
    """J1 for |x| <= 5 (odd: torch's -J1(-x) is this form at x itself, which is odd)."""
    z = b.mul(x, x)
    r = b.mul(b.div(_polevl(b, z, _J1_RP), _polevl(b, z, _J1_RQ)), x)
    return b.mul(b.mul(r, b.sub(z, 1.46819706421238932572e+01)), b.sub(z, 4.92184563216946036703e+01))


def _bessel_j0_v(b: Any, x: Any) -> Any:
    a = b.abs(x)
    near = _j0_small(b, b.minimum(a, 5.0))
    far = _hankel(b, b.maximum(a, 5.0), _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PIO4, 0, False)
    return b.where(b.le(a, 5.0), near, far)


def _bessel_j1_v(b: Any, x: Any) -> Any:
    a = b.abs(x)
    near = _j1_small(b, b.minimum(b.maximum(x, -5.0), 5.0))
    far = _hankel(b, b.maximum(a, 5.0), _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _3PIO4, 1, False)
    return b.where(b.le(a, 5.0), near, b.where(b.lt(x, 0), b.neg(far), far))


def _bessel_y_v(b: Any, x: Any, order: int) -> Any:
    """Y0 / Y1: -inf at +-0, NaN below 0; the rational form plus 2/pi log(x) J (minus 2/(pi x)
    for Y1) up to 5, the large-argument form beyond."""
    s = b.where(b.gt(x, 0), b.minimum(x, 5.0), 1.0)
    if order == 0:
        ratio = b.div(_polevl(b, b.mul(s, s), _Y0_YP), _polevl(b, b.mul(s, s), _Y0_YQ))
        near = b.add(ratio, b.mul(b.mul(b.log(s), _TWOOPI), _j0_small(b, s)))
        far = _hankel(b, b.maximum(x, 5.0), _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PIO4, 0, True)
    else:
        ratio = b.mul(s, b.div(_polevl(b, b.mul(s, s), _Y1_YP), _polevl(b, b.mul(s, s), _Y1_YQ)))
        inner = b.sub(b.mul(_j1_small(b, s), b.log(s)), b.reciprocal(s))
        near = b.add(ratio, b.mul(inner, _TWOOPI))
        far = _hankel(b, b.maximum(x, 5.0), _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _3PIO4, 1, True)
    nan = b.sqrt(b.full(x.shape, -1.0, _F32))
    near = b.where(b.eq(x, 0), -math.inf, b.where(b.lt(x, 0), nan, near))
    return b.where(b.le(x, 5.0), near, far)


def _bessel_y0_v(b: Any, x: Any) -> Any:
    return _bessel_y_v(b, x, 0)


def _bessel_y1_v(b: Any, x: Any) -> Any:
    return _bessel_y_v(b, x, 1)


def _bessel_k_v(b: Any, x: Any, order: int, scaled: bool) -> Any:
    """K0 / K1 (times exp(x) if scaled): inf at +-0, NaN below 0; up to 2 the Chebyshev series in
    x^2 - 2 with the log(x/2) I term, beyond exp(-x) chbevl(8/x - 2) / sqrt(x)."""
    s = b.where(b.gt(x, 0), b.minimum(x, 2.0), 1.0)
    if order == 0:
        # torch's K0 takes log(0.5 * x) in double (a double 0.5): x / 2 is no subnormal's zero
        half_log = b.sub(b.log(s), math.log(2.0)) if not scaled else b.log(b.mul(s, 0.5))
        near = b.sub(_chbevl(b, b.sub(b.mul(s, s), 2.0), _K0_A), b.mul(half_log, _i0_v(b, s)))
    else:
        near = b.add(b.mul(b.log(b.mul(s, 0.5)), _i1_v(b, s)),
                     b.div(_chbevl(b, b.sub(b.mul(s, s), 2.0), _K1_A), s))
    far_x = b.maximum(x, 2.0)
    series = _chbevl(b, b.sub(b.div(b.full(x.shape, 8.0, _F32), far_x), 2.0), _K0_B if order == 0 else _K1_B)
    if scaled:
        near = b.mul(near, b.exp(s))
        far = b.div(series, b.sqrt(far_x))
    else:
        far = b.div(b.mul(b.exp(b.neg(far_x)), series), b.sqrt(far_x))
    nan = b.sqrt(b.full(x.shape, -1.0, _F32))
    near = b.where(b.eq(x, 0), math.inf, b.where(b.lt(x, 0), nan, near))
    return b.where(b.le(x, 2.0), near, far)


def _modified_bessel_k0_v(b: Any, x: Any) -> Any:
    return _bessel_k_v(b, x, 0, False)


def _modified_bessel_k1_v(b: Any, x: Any) -> Any:
    return _bessel_k_v(b, x, 1, False)


def _scaled_modified_bessel_k0_v(b: Any, x: Any) -> Any:
    return _bessel_k_v(b, x, 0, True)


def _scaled_modified_bessel_k1_v(b: Any, x: Any) -> Any:
    return _bessel_k_v(b, x, 1, True)


_AIRY_STEPS = 11
"""torch's power series of Ai stops when a term is below float32's epsilon relative to the sum:
for |x| < 2.09 (the only range whose value it gives) that is after at most 11 steps (every
float32 of magnitude 0.5 to 2.09 counted with numpy's float32 arithmetic: 11 next to the zero
of f at -1.98635, at most 7 above 0, 5 below magnitude 1), so 11 unrolled steps, each lane
keeping its value once done, are its loop."""


def _airy_ai_v(b: Any, x: Any) -> Any:
    """torch's airy_ai: NaN at +-inf, 0 past 103.892; below -2.09 the oscillating asymptotic form
    (AFN/AFD, AGN/AGD in z^2, z = 3 / (2 (-x)^1.5)), from 2.09 on AN/AD in 1/zeta, between them
    the power series f, g of Ai = c1 f - c2 g."""
    # x < -2.09
    n = b.minimum(x, -2.09)
    zeta = b.div(b.mul(b.mul(n, -2.0), b.sqrt(b.neg(n))), 3.0)
    z = b.reciprocal(zeta)
    zz = b.mul(z, z)
    ratio_f = b.div(b.mul(zz, _polevl(b, zz, _AIRY_AFN)), _polevl(b, zz, _AIRY_AFD))
    ratio_g = b.div(b.mul(z, _polevl(b, zz, _AIRY_AGN)), _polevl(b, zz, _AIRY_AGD))
    t = b.add(zeta, float(torch.tensor(0.25, dtype=torch.float32) * torch.tensor(math.pi, dtype=torch.float32)))
    wave = b.sub(b.mul(b.sin(t), b.add(ratio_f, 1.0)), b.mul(b.cos(t), ratio_g))
    negative = b.mul(b.div(b.full(x.shape, 5.64189583547756286948e-01, _F32), b.sqrt(b.sqrt(b.neg(n)))), wave)
    # x >= 2.09 (to 103.892)
    p = b.minimum(b.maximum(x, 2.09), 103.892)
    zeta = b.div(b.mul(b.mul(p, 2.0), b.sqrt(p)), 3.0)
    w = b.reciprocal(zeta)
    ratio = b.div(_polevl(b, w, _AIRY_AN), _polevl(b, w, _AIRY_AD))
    positive = b.div(b.mul(ratio, 5.64189583547756286948e-01), b.mul(b.mul(b.sqrt(b.sqrt(p)), 2.0), b.exp(zeta)))
    # |x| < 2.09: the power series, unrolled
    s = b.minimum(b.maximum(x, -2.09), 2.09)
    f = b.full(x.shape, 1.0, _F32)
    g, k, m, nn = s, b.full(x.shape, 1.0, _F32), b.full(x.shape, 1.0, _F32), s
    cube = b.mul(b.mul(s, s), s)
    going = b.full(x.shape, 1.0, _F32)
    for _ in range(_AIRY_STEPS):
        m2 = b.mul(m, cube)
        k2 = b.add(k, 1.0)
        m2 = b.div(m2, k2)
        n2 = b.div(b.mul(nn, cube), b.add(k2, 1.0))
        k2 = b.add(k2, 1.0)
        m2 = b.div(m2, k2)
        f2 = b.add(f, m2)
        k2 = b.add(k2, 1.0)
        n2 = b.div(n2, k2)
        g2 = b.add(g, n2)
        on = b.ne(going, 0)
        f, g, k, m, nn = (b.where(on, new, old) for new, old in ((f2, f), (g2, g), (k2, k), (m2, m), (n2, nn)))
        going = b.where(on, b.typecast(b.gt(b.abs(b.div(m2, f2)), 2.0**-23), _F32), going)
    series = b.sub(b.mul(f, 0.355028053887817239260), b.mul(g, 0.258819403792806798405))
    nan = b.sqrt(b.full(x.shape, -1.0, _F32))
    r = b.where(b.lt(x, -2.09), negative, b.where(b.ge(x, 2.09), positive, series))
    r = b.where(b.gt(x, 103.892), 0.0, r)
    return b.where(b.eq(b.abs(x), math.inf), nan, r)


_EXP_M2 = 0.13533528323661269189
_S2PI = 2.50662827463100050242


def _ndtri_v(b: Any, y0: Any) -> Any:
    """torch's calc_ndtri: -inf at 0, inf at 1, NaN outside [0, 1]; the central rational form
    in (y - 1/2)^2 where y and 1 - y pass exp(-2), else x = sqrt(-2 log y) and x - log(x)/x
    minus a rational form in 1/x (one for x < 8, one beyond), negated on the lower side."""
    flip = b.gt(y0, 1.0 - _EXP_M2)
    y = b.where(flip, _rsub(b, 1.0, y0), y0)
    c = b.sub(b.minimum(b.maximum(y, _EXP_M2), 1.0 - _EXP_M2), 0.5)
    c2 = b.mul(c, c)
    central = b.mul(b.add(c, b.mul(c, b.div(b.mul(c2, _polevl(b, c2, _NDTRI_P0)), _polevl(b, c2, _NDTRI_Q0)))), _S2PI)
    t = b.minimum(b.maximum(y, 2.0**-149), _EXP_M2)
    x = b.sqrt(b.mul(b.log(t), -2.0))
    x0 = b.sub(x, b.div(b.log(x), x))
    z = b.reciprocal(x)
    x1 = b.where(b.lt(x, 8.0), b.div(b.mul(z, _polevl(b, z, _NDTRI_P1)), _polevl(b, z, _NDTRI_Q1)),
                 b.div(b.mul(z, _polevl(b, z, _NDTRI_P2)), _polevl(b, z, _NDTRI_Q2)))
    tail = b.sub(x0, x1)
    tail = b.where(flip, tail, b.neg(tail))
    r = b.where(b.gt(y, _EXP_M2), central, tail)
    nan = b.sqrt(b.full(y0.shape, -1.0, _F32))
    r = b.where(b.maximum(b.lt(y0, 0), b.gt(y0, 1.0)), nan, r)
    return b.where(b.eq(y0, 0), -math.inf, b.where(b.eq(y0, 1.0), math.inf, r))


for _op, _fn in [
    (aten.special_bessel_j0.default, _bessel_j0_v), (aten.special_bessel_j1.default, _bessel_j1_v),
    (aten.special_bessel_y0.default, _bessel_y0_v), (aten.special_bessel_y1.default, _bessel_y1_v),
    (aten.special_modified_bessel_i0.default, _i0_v), (aten.special_modified_bessel_i1.default, _i1_v),
    (aten.special_modified_bessel_k0.default, _modified_bessel_k0_v),
    (aten.special_modified_bessel_k1.default, _modified_bessel_k1_v),
    (aten.special_scaled_modified_bessel_k0.default, _scaled_modified_bessel_k0_v),
    (aten.special_scaled_modified_bessel_k1.default, _scaled_modified_bessel_k1_v),
    (aten.special_airy_ai.default, _airy_ai_v), (aten.special_ndtri.default, _ndtri_v),
]:
    _register(_op)(_float_unary(_fn))


# -- orthogonal polynomials of a tensor degree ----------------------------------------------------------
#
# torch's kernels (Math.h) take x and n (n truncated to an integer; NaN, the infinities and n past
# int64 are negative, so 0), the closed values at x = +-1 (0 and 1 for the shifted ones), a closed
# trigonometric form for |x| < 1 past a degree (Chebyshev), else the three-term recurrence up to n,
# which stops early where it reaches NaN. Integer and bool inputs compute in float32, as torch's.
# The recurrence is unrolled `_POLY_STEPS` times, a lane keeping its value once its n is reached;
# a lane that would need more steps (and has not reached NaN by then) fails the run with a
# ProgramError naming the op, never a wrong value. (For NaN x past degree 1 torch returns an
# uninitialised variable for U, V, W, He, L and P: there the device gives NaN.)

_POLY_DEGREE = 128
"""The largest degree the unrolled recurrence reaches: torch's own limit for float32 Hermite
polynomials (past it they are NaN); OpInfo's samples use degrees up to 9."""

_CHEBYSHEV: dict[str, tuple[float, int, int]] = {
    # kind: (the added constant of the first-degree polynomial 2y + c (T: y itself), the degree past
    # which |y| < 1 takes the closed form, unshifted and shifted)
    "t": (0.0, 6, 6), "u": (0.0, 8, 6), "v": (-1.0, 8, 6), "w": (1.0, 8, 4),
}


def _degree(L: _Lowering, n: Any, shape: Sequence[int]) -> tuple[Any, int]:
    """torch's integer degree as a float32 value (-1 for NaN, the infinities and past 2**63),
    and how many recurrence steps the program needs: a number degree fixes them."""
    b = L.b
    if not isinstance(n, _T):
        value = float(n)
        k = int(value) if math.isfinite(value) and abs(value) < 2.0**63 else -1
        return b.full(tuple(shape), float(max(k, -1)), _F32), max(1, min(k, _POLY_DEGREE))
    v = L.f32(n)
    t = b.trunc(v)
    bad = b.maximum(b.ne(v, v), b.ge(b.abs(v), 2.0**63))
    return b.where(bad, -1.0, t), _POLY_DEGREE


def _poly_operands(L: _Lowering, node: torch.fx.Node, x: Any, n: Any) -> tuple[Any, Any, int]:
    b = L.b
    shape = _ishape(_out(node).shape)
    xv = L.f32(x) if isinstance(x, _T) else b.full(shape, float(x), _F32)
    if xv.shape != shape:
        xv = b.broadcast_to(xv, shape)
    nf, steps = _degree(L, n, shape)
    if nf.shape != shape:
        nf = b.broadcast_to(nf, shape)
    return xv, nf, steps


def _recurrence(b: Any, nf: Any, p: Any, q: Any, steps: int, step: Any) -> tuple[Any, Any]:
    """q after min(n, steps + 1) - 1 steps (p, q) -> (q, step(j, p, q)) for j = 1, 2, ...; also
    whether a lane still needs steps past them (not NaN yet)."""
    for j in range(1, steps):
        r = step(j, p, q)
        on = b.ge(nf, float(j + 1))
        p, q = b.where(on, q, p), b.where(on, r, q)
    more = b.mul(b.gt(nf, float(steps)), b.eq(q, q))
    return q, more


def _refuse_where(L: _Lowering, more: Any, result: Any, where_needed: Any) -> Any:
    """`result`, or a failed run where a lane needs more recurrence steps than unrolled."""
    b = L.b
    assert L.node is not None
    flag = b.typecast(b.mul(more, where_needed), _F32)
    with b.checking_range(f"{_op_name(L.node.target)} of degree past {_POLY_DEGREE} (the tt device "
                          f"unrolls its recurrence that far){_user_line(L.node)}"):
        check = b.typecast(b.mul(flag, 3.0e9), _I32)  # 0, or a failed range check
    return b.where(b.eq(check, 0), result, result)


def _parity_sign(b: Any, nf: Any) -> Any:
    """1 for an even degree, -1 for an odd one (nf >= 0)."""
    return _rsub(b, 1.0, b.mul(b.fmod(nf, 2.0), 2.0))


def _split(b: Any, a: Any) -> tuple[Any, Any]:
    """Veltkamp's split of float32 a into 12-bit halves hi + lo == a (|a| <= 2**100, so that
    4097 a cannot overflow)."""
    t = b.mul(a, 4097.0)
    hi = b.sub(t, b.sub(t, a))
    return hi, b.sub(a, hi)


def _fma_operand(b: Any, v: Any) -> tuple[Any, ...]:
    """A factor of `_fma` made ready once (a recurrence's fixed factor is split outside its
    loop): v, v scaled by 2**-64 past 2**100 (where its split would overflow), that scale, the
    halves, and whether v is finite."""
    big = b.gt(b.abs(v), 2.0**100)
    scaled = b.where(big, b.mul(v, 2.0**-64), v)
    hi, lo = _split(b, scaled)
    scale = b.add(b.mul(b.typecast(big, _F32), 2.0**64 - 1.0), 1.0)  # 2**64 or 1
    return v, scaled, scale, hi, lo, b.eq(b.sub(v, v), 0)


def _fma(b: Any, a: Any, c: Any, d: Any) -> Any:
    """a * c + d rounded once, as the FMA instruction torch's CPU kernels are compiled to use in
    `a * c - e` (GCC contracts the first product of a recurrence step): Dekker's exact product
    p + e == a c and Knuth's two-sum of p and d, then s + (t + e), which rounds as the fused
    operation does but in a tie between two float32 (far rarer than one ulp of a step). A factor
    past 2**100 is scaled by 2**-64 first, and d with it, the result back (exact: powers of two);
    infinite or NaN factors, and a product past float32, take the plain a * c + d (IEEE's rules
    then agree), and with both factors finite an infinite d is the result itself. `a` and `c` are
    values or `_fma_operand`s."""
    a_v, a_s, a_scale, ah, al, a_finite = a if isinstance(a, tuple) else _fma_operand(b, a)
    c_v, c_s, c_scale, ch, cl, c_finite = c if isinstance(c, tuple) else _fma_operand(b, c)
    scale = b.mul(a_scale, c_scale)
    d_s = b.div(d, scale)
    p = b.mul(a_s, c_s)
    e = b.add(b.add(b.add(b.sub(b.mul(ah, ch), p), b.mul(ah, cl)), b.mul(al, ch)), b.mul(al, cl))
    s = b.add(p, d_s)
    bv = b.sub(s, p)
    t = b.add(b.sub(p, b.sub(s, bv)), b.sub(d_s, bv))
    te = b.add(t, e)
    fused = b.mul(b.where(b.eq(te, 0), s, b.add(s, te)), scale)  # s keeps an exact zero's sign
    plain = b.add(b.mul(a_v, c_v), d)
    r = b.where(b.eq(b.sub(fused, fused), 0), fused, plain)
    r = b.where(b.eq(b.abs(d), math.inf), d, r)
    return b.where(b.mul(a_finite, c_finite), r, plain)


# fdlibm's acosf (Sun Microsystems, 1993, freely distributable; glibc's float acos, which torch's
# float kernels call), step for step in float32: the closed forms of Chebyshev polynomials
# multiply its angle by the degree, so it must be glibc's to the bit (checked on 240k arguments).
_ACOS_PS = (1.6666667163e-01, -3.2556581497e-01, 2.0121252537e-01, -4.0055535734e-02, 7.9153501429e-04,
            3.4793309169e-05)
_ACOS_QS = (-2.4033949375e+00, 2.0209457874e+00, -6.8828397989e-01, 7.7038154006e-02)
_ACOS_PI = 3.1415925026e+00
_ACOS_PIO2_HI = 1.5707962513e+00
_ACOS_PIO2_LO = 7.5497894159e-08


def _acos_r(b: Any, z: Any) -> Any:
    """fdlibm's rational approximation p(z) / q(z) of (asin(sqrt z) / sqrt z - 1) / z-ish."""
    p = b.mul(z, _ACOS_PS[-1])
    for c in _ACOS_PS[-2::-1]:
        p = b.mul(z, b.add(p, c))
    q = b.mul(z, _ACOS_QS[-1])
    for c in _ACOS_QS[-2::-1]:
        q = b.mul(z, b.add(q, c))
    return b.div(p, b.add(q, 1.0))


def _high_12_bits(b: Any, s: Any) -> Any:
    """s in [2**-13, 1) with all but its 12 leading significant bits cleared (fdlibm's bit
    mask): its exponent from a ladder of comparisons, then an exact power-of-two scaling."""
    scale = b.full(s.shape, 2.0**24, _F32)
    for e in range(-12, 0):
        scale = b.where(b.ge(s, 2.0**e), 2.0 ** (11 - e), scale)
    return b.div(b.trunc(b.mul(s, scale)), scale)


def _acosf(b: Any, x: Any) -> Any:
    """glibc's acosf for |x| <= 1 (NaN beyond): the odd series below 0.5, acos = pi - 2 asin
    sqrt((1 + x) / 2) below -0.5 and 2 asin sqrt((1 - x) / 2) above 0.5, with sqrt's 12 high
    bits split off so that the sum keeps its low ones."""
    a = b.abs(x)
    z = b.mul(x, x)
    central = _rsub(b, _ACOS_PIO2_HI, b.sub(x, _rsub(b, _ACOS_PIO2_LO, b.mul(x, _acos_r(b, z)))))
    central = b.where(b.le(a, 2.0**-57), _ACOS_PIO2_HI + _ACOS_PIO2_LO, central)
    z = b.mul(b.add(b.minimum(x, -0.5), 1.0), 0.5)
    s = b.sqrt(z)
    w = b.sub(b.mul(_acos_r(b, z), s), _ACOS_PIO2_LO)
    lower = _rsub(b, _ACOS_PI, b.mul(b.add(s, w), 2.0))
    z = b.mul(_rsub(b, 1.0, b.minimum(b.maximum(x, 0.5), 1.0 - 2.0**-24)), 0.5)
    s = b.sqrt(z)
    df = _high_12_bits(b, s)
    c = b.div(b.sub(z, b.mul(df, df)), b.add(s, df))
    upper = b.mul(b.add(df, b.add(b.mul(_acos_r(b, z), s), c)), 2.0)
    r = b.where(b.lt(a, 0.5), central, b.where(b.lt(x, 0), lower, upper))
    r = b.where(b.eq(x, 1.0), 0.0, b.where(b.eq(x, -1.0), _ACOS_PI + 2.0 * _ACOS_PIO2_LO, r))
    return b.where(b.gt(a, 1.0), b.sqrt(b.full(x.shape, -1.0, _F32)), r)


def _chebyshev(kind: str, shifted: bool) -> Any:
    c, unshifted_degree, shifted_degree = _CHEBYSHEV[kind]
    closed_degree = shifted_degree if shifted else unshifted_degree

    def lower(L: _Lowering, node: torch.fx.Node, x: Any, n: Any) -> Any:
        b = L.b
        xv, nf, steps = _poly_operands(L, node, x, n)
        y = b.sub(b.add(xv, xv), 1.0) if shifted else xv
        two_y = b.add(y, y)
        first = y if kind == "t" else (two_y if c == 0 else b.add(two_y, c))
        factor = _fma_operand(b, two_y)
        q, more = _recurrence(b, nf, b.full(xv.shape, 1.0, _F32), first, steps,
                              lambda j, p, q: _fma(b, factor, q, b.neg(p)))
        value = b.where(b.eq(nf, 0), 1.0, b.where(b.eq(nf, 1), first, q))
        # the closed form for |y| < 1 past the degree
        inside = b.lt(b.abs(y), 1.0)
        theta = _acosf(b, b.where(inside, y, 0.0))
        sign = _parity_sign(b, nf)
        two_n1 = b.add(b.add(nf, nf), 1.0)
        if kind == "t":
            closed = b.cos(b.mul(nf, theta))
        elif kind == "u":
            n1 = b.add(nf, 1.0)
            closed = b.div(b.sin(b.mul(n1, theta)), b.sin(theta))
        else:
            half = b.div(theta, 2.0)
            angle = b.mul(b.add(nf, 0.5), theta)
            if kind == "v":
                closed = b.where(b.ne(b.sin(half), 1.0), b.div(b.cos(angle), b.cos(half)), b.mul(sign, two_n1))
            else:
                at_zero = sign if shifted else b.where(b.gt(xv, 0), two_n1, sign)
                closed = b.where(b.ne(b.cos(half), 1.0), b.div(b.sin(angle), b.sin(half)), at_zero)
        use_closed = b.mul(b.gt(nf, float(closed_degree)), inside)
        value = b.where(use_closed, closed, value)
        value = _refuse_where(L, more, value, b.eq(use_closed, 0))
        # the ends: y = 1 and y = -1 (x = 1 and x = 0 shifted)
        at_one: Any = {"t": 1.0, "u": b.add(nf, 1.0), "v": 1.0, "w": two_n1}[kind]
        at_minus_one: Any = {"t": sign, "u": b.mul(sign, b.add(nf, 1.0)), "v": b.mul(sign, two_n1), "w": sign}[kind]
        value = b.where(b.eq(y, 1.0), at_one, b.where(b.eq(y, -1.0), at_minus_one, value))
        return b.where(b.lt(nf, 0), 0.0, value)

    lower.__name__ = f"_{'shifted_' if shifted else ''}chebyshev_polynomial_{kind}"
    return lower


def _hermite(probabilists: bool) -> Any:
    def lower(L: _Lowering, node: torch.fx.Node, x: Any, n: Any) -> Any:
        b = L.b
        xv, nf, steps = _poly_operands(L, node, x, n)
        if probabilists:  # He: r = x q - k p
            first = xv
            factor = _fma_operand(b, xv)
            step = (lambda j, p, q: _fma(b, factor, q, b.neg(b.mul(p, float(j)))))
        else:  # H: r = 2x q - 2k p
            first = b.add(xv, xv)
            factor = _fma_operand(b, first)
            step = (lambda j, p, q: _fma(b, factor, q, b.neg(b.mul(p, float(2 * j)))))
        q, _ = _recurrence(b, nf, b.full(xv.shape, 1.0, _F32), first, steps, step)
        nan = b.sqrt(b.full(xv.shape, -1.0, _F32))
        value = b.where(b.gt(nf, float(_POLY_DEGREE)), nan, q)  # torch's float32 limit
        value = b.where(b.eq(nf, 0), 1.0, b.where(b.eq(nf, 1), first, value))
        return b.where(b.lt(nf, 0), 0.0, value)

    lower.__name__ = "_hermite_polynomial_he" if probabilists else "_hermite_polynomial_h"
    return lower


@_register(aten.special_laguerre_polynomial_l.default, aten.special_laguerre_polynomial_l.x_scalar,
           aten.special_laguerre_polynomial_l.n_scalar)
def _laguerre_polynomial_l(L: _Lowering, node: torch.fx.Node, x: Any, n: Any) -> Any:
    """L_n(x): 1 at x = 0; r = ((2k + (1 - x)) q - k p) / (k + 1)."""
    b = L.b
    xv, nf, steps = _poly_operands(L, node, x, n)
    first = _rsub(b, 1.0, xv)
    q, more = _recurrence(b, nf, b.full(xv.shape, 1.0, _F32), first, steps,
                          lambda j, p, q: b.div(_fma(b, b.add(first, float(2 * j)), q, b.neg(b.mul(p, float(j)))),
                                                float(j + 1)))
    value = b.where(b.eq(nf, 0), 1.0, b.where(b.eq(nf, 1), first, q))
    value = _refuse_where(L, more, value, b.ne(xv, 0))
    value = b.where(b.eq(xv, 0), 1.0, value)
    return b.where(b.lt(nf, 0), 0.0, value)


@_register(aten.special_legendre_polynomial_p.default, aten.special_legendre_polynomial_p.x_scalar,
           aten.special_legendre_polynomial_p.n_scalar)
def _legendre_polynomial_p(L: _Lowering, node: torch.fx.Node, x: Any, n: Any) -> Any:
    """P_n(x): +-1 at x = +-1; r = ((2k + 1) x q - k p) / (k + 1)."""
    b = L.b
    xv, nf, steps = _poly_operands(L, node, x, n)
    q, more = _recurrence(b, nf, b.full(xv.shape, 1.0, _F32), xv, steps,
                          lambda j, p, q: b.div(_fma(b, b.mul(xv, float(2 * j + 1)), q, b.neg(b.mul(p, float(j)))),
                                                float(j + 1)))
    value = b.where(b.eq(nf, 0), 1.0, b.where(b.eq(nf, 1), xv, q))
    ends = b.eq(b.abs(xv), 1.0)
    value = _refuse_where(L, more, value, b.eq(ends, 0))
    value = b.where(b.eq(xv, 1.0), 1.0, b.where(b.eq(xv, -1.0), _parity_sign(b, nf), value))
    return b.where(b.lt(nf, 0), 0.0, value)


for _kind in "tuvw":
    for _shifted in (False, True):
        _packet = getattr(aten, f"special_{'shifted_' if _shifted else ''}chebyshev_polynomial_{_kind}")
        _register(_packet.default, _packet.x_scalar, _packet.n_scalar)(_chebyshev(_kind, _shifted))
for _packet, _he in [(aten.special_hermite_polynomial_h, False), (aten.special_hermite_polynomial_he, True)]:
    _register(_packet.default, _packet.x_scalar, _packet.n_scalar)(_hermite(_he))
