"""Bessel functions (modified of the first kind I0/I1 and scaled, of the first and second kind
J0/J1/Y0/Y1, modified of the second kind K0/K1 and scaled, spherical j0) and Airy's Ai, as torch's
CPU kernels compute them (aten/src/ATen/native/Math.h, Cephes), in FLOAT32 on the device.

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
from .series import _chbevl, _polevl, _rsub

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


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


for _op, _fn in [
    (aten.special_bessel_j0.default, _bessel_j0_v), (aten.special_bessel_j1.default, _bessel_j1_v),
    (aten.special_bessel_y0.default, _bessel_y0_v), (aten.special_bessel_y1.default, _bessel_y1_v),
    (aten.special_modified_bessel_i0.default, _i0_v), (aten.special_modified_bessel_i1.default, _i1_v),
    (aten.special_modified_bessel_k0.default, _modified_bessel_k0_v),
    (aten.special_modified_bessel_k1.default, _modified_bessel_k1_v),
    (aten.special_scaled_modified_bessel_k0.default, _scaled_modified_bessel_k0_v),
    (aten.special_scaled_modified_bessel_k1.default, _scaled_modified_bessel_k1_v),
    (aten.special_airy_ai.default, _airy_ai_v),
]:
    _register(_op)(_float_unary(_fn))
