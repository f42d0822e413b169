"""Special functions of the error and gamma families (torch.special and their ATen ops): erfc,
erfcx, erfinv, ndtri, digamma, lgamma, polygamma and Hurwitz's zeta, as torch's CPU kernels
compute them (Cephes' rational and Chebyshev expansions, aten/src/ATen/native/Math.h), in
FLOAT32 on the device, each compared with CPU torch across its domain
(tests/test_torch_pointwise_ops.py).

The Cephes Math Library is Copyright (c) 2018, Steven Moshier, under the 3-clause BSD license;
the coefficients below are its published ones."""

from __future__ import annotations

import math
from typing import Any

import torch

import ttflow as tt

from .graph import _T, _ishape, _Lowering, _op_name, _out, _register, _user_line
from .pointwise import _float_unary, _frexp_v
from .series import _p1evl, _polevl, _rsub, _split

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


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
    # log|sin(pi r)|; for a tiny r, log(pi) + log|r|: pi * r would round a subnormal r to its
    # coarse grid (lgamma(-2**-149) was 5% off inside the log).
    tiny = b.lt(b.abs(r), 2.0**-20)
    log_sin = b.where(tiny, b.add(b.log(b.abs(r)), math.log(math.pi)), b.log(b.abs(b.sin(b.mul(r, math.pi)))))
    reflected = b.sub(_rsub(b, math.log(math.pi), log_sin), positive)
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


# -- ndtri ---------------------------------------------------------------------------------------------

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


_register(aten.special_ndtri.default)(_float_unary(_ndtri_v))
