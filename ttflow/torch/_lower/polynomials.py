"""The orthogonal polynomials of a tensor degree (Chebyshev T/U/V/W and shifted, Hermite H/He,
Laguerre L, Legendre P), as torch's CPU kernels compute them, in FLOAT32 on the device."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

import ttflow as tt

from .graph import _T, _ishape, _Lowering, _op_name, _out, _register, _user_line
from .series import _rsub, _split

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


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
