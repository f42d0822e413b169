"""Pointwise float math and special functions on tt against CPU torch, eager and compiled: the
inverse and hyperbolic trigonometric functions, expm1/exp2/log2/log10, hypot, fmax/fmin,
copysign/signbit, ELU, rounding to decimals, gcd/lcm and the special functions, across their
domains with the edges (signed zeros, infinities, NaN, poles, overflow), within OpInfo's float32
tolerance (1e-5 relative and absolute) and with no CPU fallback."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch_support import only_on_device

import ttflow as tt

TOL = {"rtol": 1e-5, "atol": 1e-5}

EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1e-30, -1e-30, 1e-7, -1e-7, 2.0**-12, 3.0, -3.0, 8.9,
         20.0, 88.0, 88.8, 89.5, -88.8, -100.0, 1e10, -1e10, 3e38, -3e38, math.inf, -math.inf,
         math.nan, 0.999999, -0.999999, 1.000001, 8193.0, 1e-40, 126.7, -149.5, 128.5]


def _domain() -> torch.Tensor:
    return torch.cat([
        torch.tensor(EDGES), torch.linspace(-10, 10, 401), torch.logspace(-8, 38, 200),
        -torch.logspace(-8, 38, 200), torch.linspace(-1.2, 1.2, 201),
    ])


def assert_matches(got: torch.Tensor, expected: torch.Tensor, zero_signs: bool = True) -> None:
    """Values within OpInfo's float32 tolerance, NaN where torch's is, and a zero's sign."""
    assert got.device.type == "tt" and got.dtype == expected.dtype and got.shape == expected.shape
    got = got.cpu()
    torch.testing.assert_close(got, expected, equal_nan=True, **TOL)
    if expected.dtype.is_floating_point and zero_signs:
        zeros = expected == 0
        assert torch.equal(torch.signbit(got[zeros]), torch.signbit(expected[zeros]))


UNARY = {
    "asin": torch.asin, "acos": torch.acos, "atanh": torch.atanh, "asinh": torch.asinh,
    "acosh": torch.acosh, "cosh": torch.cosh, "sinh": torch.sinh, "tan": torch.tan,
    "expm1": torch.expm1, "exp2": torch.exp2, "log2": torch.log2, "log10": torch.log10,
}


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_float_math_matches_cpu_across_the_domain(on_device_only, name) -> None:
    x = _domain()
    assert_matches(UNARY[name](x.to("tt")), UNARY[name](x))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
@pytest.mark.parametrize("name", list(UNARY))
def test_unary_float_math_of_integers_is_float32(on_device_only, name, dtype) -> None:
    x = torch.tensor([-7, -1, 0, 1, 2, 5, 40, 100]).to(dtype)
    assert_matches(UNARY[name](x.to("tt")), UNARY[name](x))


@settings(deadline=None)
@given(st.lists(st.floats(width=32), min_size=1, max_size=12), st.sampled_from(sorted(UNARY)))
def test_unary_float_math_matches_cpu_on_any_float32(device, values, name) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    with only_on_device():
        assert_matches(UNARY[name](x.to("tt")), UNARY[name](x))


BINARY = {
    "hypot": torch.hypot, "fmax": torch.fmax, "fmin": torch.fmin, "copysign": torch.copysign,
}


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_float_math_matches_cpu(on_device_only, name) -> None:
    x = torch.tensor([3.0, 0.0, -0.0, 1e30, -1e-30, math.inf, -math.inf, math.nan, 2.5, -7.0])
    y = torch.tensor([4.0, -0.0, 0.0, 1e30, 5.0, math.nan, 1.0, 2.0, math.nan, -math.inf])
    if name == "copysign":  # a NaN's sign bit the device cannot read (see below)
        y = torch.where(y.isnan(), -1.5, y)
    assert_matches(BINARY[name](x.to("tt"), y.to("tt")), BINARY[name](x, y))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_fmax_fmin_of_integers_are_exact(on_device_only, dtype) -> None:
    x, y = torch.tensor([5, -3, 0, 1]).to(dtype), torch.tensor([2, 9, 0, 0]).to(dtype)
    for fn in (torch.fmax, torch.fmin):
        got = fn(x.to("tt"), y.to("tt"))
        assert got.dtype == fn(x, y).dtype and torch.equal(got.cpu(), fn(x, y))


@settings(deadline=None)
@given(st.lists(st.tuples(st.floats(width=32, allow_nan=False), st.floats(width=32, allow_nan=False)),
                min_size=1, max_size=10), st.sampled_from(sorted(BINARY)))
def test_binary_float_math_matches_cpu_on_any_float32(device, pairs, name) -> None:
    x = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    y = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    with only_on_device():
        assert_matches(BINARY[name](x.to("tt"), y.to("tt")), BINARY[name](x, y))


def test_signbit_reads_signed_zeros_and_refuses_a_nan(on_device_only) -> None:
    x = torch.tensor([0.0, -0.0, 1.0, -2.0, -1e-40, math.inf, -math.inf])
    assert torch.equal(torch.signbit(x.to("tt")).cpu(), torch.signbit(x))
    ints = torch.tensor([-3, 0, 4])
    assert torch.equal(torch.signbit(ints.to("tt")).cpu(), torch.signbit(ints))
    with pytest.raises(tt.ProgramError, match="sign bit of a NaN"):
        torch.signbit(torch.tensor([1.0, math.nan]).to("tt")).cpu()


def test_gradients_match_cpu(on_device_only) -> None:
    x = torch.tensor([0.3, -0.7, 0.05, 0.9])
    for name, fn in UNARY.items():
        if name in ("acosh",):
            a = (x.abs() + 1.5).requires_grad_()
        else:
            a = x.clone().requires_grad_()
        b = a.detach().to("tt").requires_grad_()
        (ga,) = torch.autograd.grad(fn(a).sum(), a)
        (gb,) = torch.autograd.grad(fn(b).sum(), b)
        assert_matches(gb, ga)


def test_compiled_float_math_matches_cpu(on_device_only) -> None:
    def fn(x, y):
        u = torch.asinh(x) + torch.acosh(x.abs() + 1) + torch.expm1(x / 10) + torch.exp2(x)
        v = torch.hypot(x, y) + torch.fmax(x, y) + torch.copysign(x, y) + torch.log2(y.abs())
        return u, v, torch.tan(torch.asin(y / 20)), torch.cosh(x) - torch.sinh(y)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tt")
    x = torch.linspace(-9, 9, 37)
    y = torch.linspace(17, -17, 37)
    for got, expected in zip(compiled(x.to("tt"), y.to("tt")), fn(x, y)):
        assert_matches(got, expected)


# -- activations, rounding, angle ------------------------------------------------------------------


ACTIVATIONS = {
    "elu": lambda x: torch.nn.functional.elu(x, alpha=0.7),
    "celu": lambda x: torch.nn.functional.celu(x, alpha=1.5),
    "selu": torch.nn.functional.selu,
    "hardshrink": lambda x: torch.nn.functional.hardshrink(x, 0.5),
    "softshrink": lambda x: torch.nn.functional.softshrink(x, 0.5),
    "angle": torch.angle,
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activations_and_their_gradients_match_cpu(on_device_only, name) -> None:
    fn = ACTIVATIONS[name]
    x = torch.cat([torch.tensor(EDGES), torch.linspace(-3, 3, 61)])
    # softshrink's forward is torch's own decomposition (a where that passes -0.0 through)
    assert_matches(fn(x.to("tt")), fn(x), zero_signs=name != "softshrink")
    a = torch.linspace(-2, 2, 41).requires_grad_()
    b = a.detach().to("tt").requires_grad_()
    (ga,) = torch.autograd.grad(fn(a).sum(), a)
    (gb,) = torch.autograd.grad(fn(b).sum(), b)
    assert_matches(gb, ga)


@settings(deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, min_value=-1e6, max_value=1e6), min_size=1, max_size=12),
       st.integers(-4, 4))
def test_round_to_decimals_is_torchs_bit_for_bit(device, values, decimals) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    with only_on_device():
        got = torch.round(x.to("tt"), decimals=decimals).cpu()
    assert torch.equal(got, torch.round(x, decimals=decimals))


# -- gcd, lcm ------------------------------------------------------------------------------------------


INT32 = st.integers(-(2**31) + 1, 2**31 - 1)


@settings(deadline=None)
@given(st.lists(st.tuples(INT32, INT32), min_size=1, max_size=8), st.sampled_from([torch.int64, torch.int32]))
def test_gcd_is_exact_on_any_int32(device, pairs, dtype) -> None:
    x = torch.tensor([p[0] for p in pairs], dtype=dtype)
    y = torch.tensor([p[1] for p in pairs], dtype=dtype)
    with only_on_device():
        got = torch.gcd(x.to("tt"), y.to("tt")).cpu()
    assert torch.equal(got, torch.gcd(x, y))


def test_gcd_takes_the_most_steps_at_consecutive_fibonacci_numbers(on_device_only) -> None:
    x = torch.tensor([1836311903, -(2**31), 0, 0, 2**31 - 1], dtype=torch.int32)
    y = torch.tensor([1134903170, 0, 0, -7, 2**31 - 2], dtype=torch.int32)
    assert torch.equal(torch.gcd(x.to("tt"), y.to("tt")).cpu(), torch.gcd(x, y))


@settings(deadline=None)
@given(st.lists(st.tuples(st.integers(-50000, 50000), st.integers(-50000, 50000)), min_size=1, max_size=8),
       st.sampled_from([torch.int64, torch.int32]))
def test_lcm_is_exact(device, pairs, dtype) -> None:
    x = torch.tensor([p[0] for p in pairs], dtype=dtype)
    y = torch.tensor([p[1] for p in pairs], dtype=dtype)
    expected = torch.lcm(x, y)
    if dtype == torch.int64 and expected.abs().max() >= 2**31:
        with pytest.raises(tt.ProgramError, match="int64"):
            torch.lcm(x.to("tt"), y.to("tt")).cpu()
        return
    with only_on_device():
        got = torch.lcm(x.to("tt"), y.to("tt")).cpu()
    assert torch.equal(got, expected)  # int32 products past 2**31 wrap, as torch's


# -- special functions ---------------------------------------------------------------------------------


SPECIAL = {
    "erfc": (torch.erfc, None), "erfcx": (torch.special.erfcx, None),
    "erfinv": (torch.erfinv, torch.cat([torch.linspace(-1.1, 1.1, 2201),
                                        torch.tensor([0.99999994, -0.9999999, 1.0, -1.0, 0.0, -0.0, math.nan])])),
    "i0": (torch.i0, None), "i0e": (torch.special.i0e, None), "i1": (torch.special.i1, None),
    "i1e": (torch.special.i1e, None), "spherical_bessel_j0": (torch.special.spherical_bessel_j0, None),
    # the poles (0, the negative integers, near them) and the roots (1.4616, -2.4570) included
    "digamma": (torch.digamma, None), "trigamma": (lambda x: torch.polygamma(1, x), None),
    "lgamma": (torch.lgamma, None),
}
for _name in ("digamma", "trigamma", "lgamma"):
    SPECIAL[_name] = (SPECIAL[_name][0], torch.cat([
        _domain(), torch.linspace(-5.5, 5.5, 1101),
        torch.tensor([-1.0, -2.0, -100.0, 1e-6, -1e-6, -0.9999989867, -9.995, -2.4570247, 1.4616321]),
    ]))


@pytest.mark.parametrize("name", list(SPECIAL))
def test_special_functions_match_cpu_across_the_domain(on_device_only, name) -> None:
    fn, x = SPECIAL[name]
    x = _domain() if x is None else x
    assert_matches(fn(x.to("tt")), fn(x))


@settings(deadline=None)
@given(st.lists(st.floats(width=32), min_size=1, max_size=12), st.sampled_from(sorted(SPECIAL)))
@example([-1.401298464324817e-45, 1.401298464324817e-45, -1e-40], "lgamma")  # the long profile's find
def test_special_functions_match_cpu_on_any_float32(device, values, name) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    with only_on_device():
        assert_matches(SPECIAL[name][0](x.to("tt")), SPECIAL[name][0](x))


def test_erfc_keeps_its_relative_precision_in_the_tail(on_device_only) -> None:
    x = torch.linspace(0, 9.5, 400)  # 1 - erf(x) would be 0 from 4 on
    got, expected = torch.erfc(x.to("tt")).cpu(), torch.erfc(x)
    assert ((got - expected).abs() / expected).max() < 2e-6


def test_special_function_gradients_match_cpu(on_device_only) -> None:
    x = torch.tensor([0.3, -0.7, 2.5, 9.0, -3.3, 12.0])
    for fn in (torch.i0, torch.special.i0e, torch.special.i1, torch.special.i1e, torch.digamma,
               torch.lgamma, torch.erfc, torch.special.erfcx):
        a = x.clone().requires_grad_()
        b = a.detach().to("tt").requires_grad_()
        (ga,) = torch.autograd.grad(fn(a).sum(), a)
        (gb,) = torch.autograd.grad(fn(b).sum(), b)
        assert_matches(gb, ga)


def _polygamma_domain() -> torch.Tensor:
    # the poles (0, the negative integers, -inf), the half-integers (where the reflection's cot is 0),
    # near them (its largest terms), large arguments (the Euler-Maclaurin tail alone)
    return torch.cat([
        torch.linspace(-21.5, 12, 1351), torch.logspace(-6, 8, 60),
        torch.tensor([0.0, -0.0, -3.0, 1e-20, -1e-20, 1e-3, math.inf, -math.inf, math.nan, -2.5, -21.5,
                      -1.4992589950561523, -8.478373527526855, -14.502222061157227, 3e38]),
    ])


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 10])
def test_polygamma_of_order_two_and_more_matches_cpu(on_device_only, n) -> None:
    x = _polygamma_domain()
    assert_matches(torch.polygamma(n, x.to("tt")), torch.polygamma(n, x))


@settings(deadline=None)
@given(st.lists(st.floats(-21.0, 1e6, width=32), min_size=1, max_size=12), st.integers(2, 7))
def test_polygamma_matches_cpu_on_any_float32(device, values, n) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    with only_on_device():
        assert_matches(torch.polygamma(n, x.to("tt")), torch.polygamma(n, x))


def test_polygamma_gradient_and_integer_arguments_match_cpu(on_device_only) -> None:
    a = torch.tensor([0.3, -0.7, 2.5, 9.0, -3.3, 12.0]).requires_grad_()
    b = a.detach().to("tt").requires_grad_()
    for n in (1, 2, 4):
        (ga,) = torch.autograd.grad(torch.polygamma(n, a).sum(), a)
        (gb,) = torch.autograd.grad(torch.polygamma(n, b).sum(), b)
        assert_matches(gb, ga)
    for dtype in (torch.int64, torch.int32, torch.bool):
        x = torch.tensor([-3, 0, 1, 2, 9, 40]).to(dtype)
        assert_matches(torch.polygamma(3, x.to("tt")), torch.polygamma(3, x))


def _zeta_grid() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor([1.0, 0.5, math.nan, math.inf, 1.0001, 1.5, 2.0, 3.0, 4.0, 7.0, 20.0, 50.0, 87.0, 2.7, 8.4])
    q = torch.cat([torch.tensor([0.1, 0.01, 1.0, -3.0, -0.0, 0.0, math.inf, -math.inf, -2.5, -7.25, 0.3, 2.0, 0.9,
                                 1e-20, 1e6, math.nan]), torch.linspace(-21.7, 12, 46)])
    return x[:, None].expand(-1, len(q)).reshape(-1), q[None, :].expand(len(x), -1).reshape(-1)


def test_zeta_matches_cpu_on_a_grid(on_device_only) -> None:
    x, q = _zeta_grid()
    keep = ~((q < 0) & (q != q.floor()) & (x % 2 == 1))  # refused below
    x, q = x[keep], q[keep]
    assert_matches(torch.special.zeta(x.to("tt"), q.to("tt")), torch.special.zeta(x, q))


@settings(deadline=None)
@given(st.lists(st.tuples(st.floats(1.0, 100.0, width=32), st.floats(-21.0, 1e6, width=32)), min_size=1, max_size=10))
def test_zeta_matches_cpu_on_any_float32(device, pairs) -> None:
    x = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    q = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    odd = (q < 0) & (q != q.floor()) & (x % 2 == 1)
    if bool(odd.any()):
        with pytest.raises(tt.ProgramError, match="negative q and an odd x"):
            torch.special.zeta(x.to("tt"), q.to("tt")).cpu()
        return
    with only_on_device():
        assert_matches(torch.special.zeta(x.to("tt"), q.to("tt")), torch.special.zeta(x, q))


def test_zeta_refuses_what_float32_cannot_sum(device) -> None:
    with pytest.raises(tt.ProgramError, match="negative q and an odd x"):  # terms of both signs cancel
        torch.special.zeta(torch.tensor([11.0, 2.0]).to("tt"), torch.tensor([-2.5, 0.5]).to("tt")).cpu()
    with pytest.raises(tt.ProgramError, match="q below -22"):  # more terms than unrolled
        torch.special.zeta(torch.tensor([2.0]).to("tt"), torch.tensor([-30.5]).to("tt")).cpu()
    with only_on_device():  # an even x sums terms of one sign; the polygamma reflects instead
        x, q = torch.tensor([4.0, 2.0]), torch.tensor([-2.5, -20.5])
        assert_matches(torch.special.zeta(x.to("tt"), q.to("tt")), torch.special.zeta(x, q))
        assert_matches(torch.polygamma(3, torch.tensor([-40.5]).to("tt")), torch.polygamma(3, torch.tensor([-40.5])))


def test_zeta_of_integers_and_numbers_matches_cpu(on_device_only) -> None:
    for dtype in (torch.int64, torch.int32):
        x, q = torch.tensor([2, 3, 5, 1, 0, 4]).to(dtype), torch.tensor([1, 2, 7, 3, -2, 0]).to(dtype)
        assert_matches(torch.special.zeta(x.to("tt"), q.to("tt")), torch.special.zeta(x, q))
    q = torch.linspace(0.1, 9, 12)
    assert_matches(torch.special.zeta(3.0, q.to("tt")), torch.special.zeta(3.0, q))
    assert_matches(torch.special.zeta(q.to("tt") + 1, 2.0), torch.special.zeta(q + 1, 2.0))


def test_compiled_special_functions_match_cpu(on_device_only) -> None:
    def fn(x, y):
        return (torch.erfc(x), torch.special.erfcx(x), torch.erfinv(y), torch.gcd(x.long(), (y * 40).long()),
                torch.round(x, decimals=2), torch.lgamma(x), torch.digamma(x), torch.special.i1e(x),
                torch.polygamma(3, x), torch.special.zeta(x.abs() + 1, y.abs() + 0.5))

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tt")
    x = torch.linspace(-9, 9, 37)
    y = torch.linspace(-0.99, 0.99, 37)
    for got, expected in zip(compiled(x.to("tt"), y.to("tt")), fn(x, y)):
        assert_matches(got, expected)


# -- Bessel functions, Airy's Ai, ndtri ------------------------------------------------------------------


BESSEL = {name: getattr(torch.special, name) for name in (
    "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0", "modified_bessel_i1",
    "modified_bessel_k0", "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1",
    "airy_ai", "ndtri")}


def _bessel_domain() -> torch.Tensor:
    # each function's branch points (5, 2, 8, +-2.09, 8.32, 103.892, exp(-2)), the zeros of Ai's
    # power series f near -1.98635 (the most series steps), ndtri's (0, 1) densely
    return torch.cat([
        _domain(), torch.tensor([5.0, -5.0, 2.0, 8.0, 2.09, -2.09, 8.3203353, 103.892, 103.9, 1e-5, 9.99e-6,
                                 0.1353352832, 0.8646647168, 1 - 1e-7, 1e-38, 1e-45]),
        torch.linspace(-120, 120, 2401), torch.linspace(-1.99, -1.98, 101), torch.linspace(0, 1, 1001),
        torch.logspace(-30, -1, 100),
    ])


@pytest.mark.parametrize("name", list(BESSEL))
def test_bessel_airy_ndtri_match_cpu_across_the_domain(on_device_only, name) -> None:
    x = _bessel_domain()
    assert_matches(BESSEL[name](x.to("tt")), BESSEL[name](x))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_bessel_airy_ndtri_of_integers_are_float32(on_device_only, dtype) -> None:
    x = torch.tensor([-9, -3, -1, 0, 1, 2, 5, 9, 40, 120]).to(dtype)
    for fn in BESSEL.values():
        assert_matches(fn(x.to("tt")), fn(x))


@settings(deadline=None)
@given(st.lists(st.floats(width=32), min_size=1, max_size=12), st.sampled_from(sorted(BESSEL)))
def test_bessel_airy_ndtri_match_cpu_on_any_float32(device, values, name) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    with only_on_device():
        assert_matches(BESSEL[name](x.to("tt")), BESSEL[name](x))


@settings(deadline=None)
@given(st.lists(st.floats(-2.0899999141693115, 2.0899999141693115, width=32), min_size=1, max_size=16))
def test_airy_ai_power_series_matches_cpu(device, values) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    with only_on_device():
        assert_matches(torch.special.airy_ai(x.to("tt")), torch.special.airy_ai(x))


def test_ndtri_gradient_matches_cpu(on_device_only) -> None:
    a = torch.tensor([0.03, 0.2, 0.5, 0.77, 0.97, 0.999]).requires_grad_()
    b = a.detach().to("tt").requires_grad_()
    (ga,) = torch.autograd.grad(torch.special.ndtri(a).sum(), a)
    (gb,) = torch.autograd.grad(torch.special.ndtri(b).sum(), b)
    assert_matches(gb, ga)


def test_compiled_bessel_functions_match_cpu(on_device_only) -> None:
    def fn(x, p):
        s = torch.special
        return (s.bessel_j0(x) + s.bessel_y1(x.abs()), s.bessel_j1(x) * s.bessel_y0(x.abs() + 0.1),
                s.modified_bessel_k0(x.abs()) + s.scaled_modified_bessel_k1(x.abs()) + s.modified_bessel_i1(x),
                s.airy_ai(x), s.ndtri(p))

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tt")
    x = torch.linspace(-9, 9, 37)
    p = torch.linspace(0, 1, 37)
    for got, expected in zip(compiled(x.to("tt"), p.to("tt")), fn(x, p)):
        assert_matches(got, expected)


# -- orthogonal polynomials of a tensor degree -------------------------------------------------------


POLYNOMIALS = {name: getattr(torch.special, name) for name in (
    "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v", "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
    "legendre_polynomial_p")}

# x: the ends (+-1, 0, 1 - 2**-24: the closed forms' ties), inside, just outside (slow growth: the most
# steps), far outside (overflow, then NaN stops torch's loop); n: negative, fractional (truncated), the
# closed forms' thresholds, up to the unrolled 128, NaN and the infinities (0, as torch's casts give).
POLY_X = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1 - 2.0**-24, 1 - 2.0**-23, -1 + 2.0**-24, 2.0**-24, 1e-30,
          1.0001, -1.0001, 1.3, 3.0, -8.5, 9.0, 1e10, math.inf, -math.inf, 0.05, -0.95, 0.3, 0.7, 0.999]
POLY_N = [-3.0, -0.5, 0.0, 0.7, 1.0, 1.9, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 9.9, 12.0, 20.0, 33.0, 64.0,
          100.0, 127.0, 128.0, math.nan, -math.inf, math.inf]


def _poly_grid() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor(POLY_X + torch.linspace(-1.1, 1.1, 23).tolist())
    n = torch.tensor(POLY_N)
    return x[:, None].expand(-1, len(n)).contiguous(), n[None, :].expand(len(x), -1).contiguous()


@pytest.mark.parametrize("name", list(POLYNOMIALS))
def test_polynomials_match_cpu_on_a_grid_of_x_and_degrees(on_device_only, name) -> None:
    x, n = _poly_grid()
    assert_matches(POLYNOMIALS[name](x.to("tt"), n.to("tt")), POLYNOMIALS[name](x, n))


@settings(deadline=None)
@given(st.lists(st.tuples(st.floats(width=32, allow_nan=False), st.integers(-2, 128)), min_size=1, max_size=8),
       st.sampled_from(sorted(POLYNOMIALS)))
def test_polynomials_match_cpu_on_any_float32(device, pairs, name) -> None:
    x = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    n = torch.tensor([float(p[1]) for p in pairs])
    fn = POLYNOMIALS[name]
    with only_on_device():
        assert_matches(fn(x.to("tt"), n.to("tt")), fn(x, n))


@settings(deadline=None)
@given(st.lists(st.tuples(st.floats(-1.5, 1.5, width=32), st.integers(0, 128)), min_size=1, max_size=8),
       st.sampled_from(["hermite_polynomial_h", "hermite_polynomial_he", "laguerre_polynomial_l",
                        "legendre_polynomial_p", "chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u"]))
def test_polynomial_recurrences_are_torchs_fused_multiply_adds_bit_for_bit(device, pairs, name) -> None:
    """torch's kernels are compiled with FMA contraction: the device's emulated fused step gives
    the same float32 even where the recurrence amplifies one rounding (x near 1, high degrees)."""
    x = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    n = torch.tensor([float(p[1]) for p in pairs])
    fn = POLYNOMIALS[name]
    with only_on_device():
        got = fn(x.to("tt"), n.to("tt")).cpu()
    expected = fn(x, n)
    closed = (n > 4) & ((2 * x - 1).abs() < 1 if name.startswith("shifted") else x.abs() < 1)
    if name.startswith(("chebyshev", "shifted")):  # the closed forms' sin/cos differ by an ulp
        torch.testing.assert_close(got[closed], expected[closed], equal_nan=True, **TOL)
        got, expected = got[~closed], expected[~closed]
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[~got.isnan()], expected[~expected.isnan()])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_polynomials_of_integers_are_float32(on_device_only, dtype) -> None:
    x = torch.tensor([-8, -1, 0, 1, 2, 9, 0, 0, 3, -2]).to(dtype)
    n = torch.tensor([6, 5, 9, 10, 11, 7, 1, 0, -2, 4]).to(dtype)
    for fn in POLYNOMIALS.values():
        assert_matches(fn(x.to("tt"), n.to("tt")), fn(x, n))


def test_polynomials_take_a_number_for_x_or_n(on_device_only) -> None:
    x = torch.linspace(-1.5, 1.5, 31)
    n = torch.tensor([0.0, 1.0, 3.0, 7.0, 12.0, 40.0, -1.0])
    for fn in POLYNOMIALS.values():
        assert_matches(fn(x.to("tt"), 5), fn(x, 5))
        assert_matches(fn(x.to("tt"), 11.7), fn(x, 11.7))
        assert_matches(fn(0.3, n.to("tt")), fn(0.3, n))


def test_polynomials_past_the_unrolled_degree_fail_the_run_not_the_value(device) -> None:
    s = torch.special
    for fn, x in [(s.legendre_polynomial_p, 0.5), (s.laguerre_polynomial_l, 0.5), (s.chebyshev_polynomial_t, 1.0001),
                  (s.shifted_chebyshev_polynomial_v, 1.00001)]:
        with pytest.raises(tt.ProgramError, match="degree past 128"):
            fn(torch.tensor([x, 0.25]).to("tt"), torch.tensor([129.0, 3.0]).to("tt")).cpu()
    # lanes that need no more steps: torch's closed forms, NaN reached, Hermite's limit, x = 0
    x = torch.tensor([0.3, 3.0, 0.5, -7.0])
    n = torch.tensor([500.0, 200.0, 1000.0, 129.0])
    with only_on_device():
        for fn in (s.chebyshev_polynomial_t, s.chebyshev_polynomial_w, s.hermite_polynomial_h, s.hermite_polynomial_he):
            assert_matches(fn(x.to("tt"), n.to("tt")), fn(x, n))
        assert_matches(s.laguerre_polynomial_l(torch.zeros(2).to("tt"), n[:2].to("tt")),
                       s.laguerre_polynomial_l(torch.zeros(2), n[:2]))


def test_compiled_polynomials_match_cpu(on_device_only) -> None:
    s = torch.special

    def fn(x, n):
        return (s.chebyshev_polynomial_t(x, n) + s.chebyshev_polynomial_u(x, 3), s.legendre_polynomial_p(x, n),
                s.hermite_polynomial_h(x, n) - s.laguerre_polynomial_l(x, n), s.shifted_chebyshev_polynomial_w(x, n))

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tt")
    x = torch.linspace(-1.2, 1.2, 25)
    n = torch.arange(25.0) % 13
    for got, expected in zip(compiled(x.to("tt"), n.to("tt")), fn(x, n)):
        assert_matches(got, expected)


# -- frexp, nextafter ----------------------------------------------------------------------------------


def _float32_specials() -> torch.Tensor:
    powers = 2.0 ** torch.arange(-149, 128).float()  # every exponent, subnormals too
    return torch.cat([
        torch.tensor([0.0, -0.0, 0.75, 3.0, 1e-45, -2.8e-45, -1e-40, 1.1754942e-38, 3.4028235e38, -3.4028235e38,
                      math.inf, -math.inf, math.nan, 0.99999994, 1.0000001]),
        powers, -powers, powers * 1.5, powers * 0.99999994,
    ])


def _same_floats(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit, a NaN for a NaN (its sign bit aside), a zero's sign."""
    assert torch.equal(got.isnan(), expected.isnan())
    numbers = ~expected.isnan()
    assert torch.equal(got[numbers], expected[numbers])
    assert torch.equal(torch.signbit(got[numbers]), torch.signbit(expected[numbers]))


def test_frexp_is_exact_across_every_exponent(on_device_only) -> None:
    x = _float32_specials()
    mantissa, exponent = torch.frexp(x.to("tt"))
    expected_mantissa, expected_exponent = torch.frexp(x)
    assert exponent.dtype == torch.int32
    _same_floats(mantissa.cpu(), expected_mantissa)
    assert torch.equal(exponent.cpu(), expected_exponent)


@settings(deadline=None)
@given(st.lists(st.floats(width=32), min_size=1, max_size=16))
def test_frexp_is_exact_on_any_float32(device, values) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    with only_on_device():
        mantissa, exponent = torch.frexp(x.to("tt"))
    expected_mantissa, expected_exponent = torch.frexp(x)
    _same_floats(mantissa.cpu(), expected_mantissa)
    assert torch.equal(exponent.cpu(), expected_exponent)


def test_frexp_gradient_matches_cpu(on_device_only) -> None:
    a = torch.tensor([0.3, -7.5, 1e-20, 3e30, 1.0]).requires_grad_()
    b = a.detach().to("tt").requires_grad_()
    (ga,) = torch.autograd.grad(torch.frexp(a).mantissa.sum(), a)
    (gb,) = torch.autograd.grad(torch.frexp(b).mantissa.sum(), b)
    assert_matches(gb, ga)


def test_nextafter_is_exact_toward_every_direction(on_device_only) -> None:
    x = _float32_specials()
    for y in (torch.zeros_like(x), -torch.zeros_like(x), torch.full_like(x, math.inf), torch.full_like(x, -math.inf),
              x, x.flip(0), torch.full_like(x, math.nan)):
        _same_floats(torch.nextafter(x.to("tt"), y.to("tt")).cpu(), torch.nextafter(x, y))


@settings(deadline=None)
@given(st.lists(st.tuples(st.floats(width=32), st.floats(width=32)), min_size=1, max_size=16))
def test_nextafter_is_exact_on_any_float32(device, pairs) -> None:
    x = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    y = torch.tensor([p[1] for p in pairs], dtype=torch.float32)
    with only_on_device():
        got = torch.nextafter(x.to("tt"), y.to("tt")).cpu()
    _same_floats(got, torch.nextafter(x, y))


def test_compiled_frexp_and_nextafter_match_cpu(on_device_only) -> None:
    def fn(x, y):
        m, e = torch.frexp(x * 3)
        return m, e, torch.nextafter(x, y), torch.nextafter(x[:1], y)  # broadcast

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tt")
    x = torch.linspace(-9, 9, 37)
    y = torch.linspace(17, -17, 37)
    for got, expected in zip(compiled(x.to("tt"), y.to("tt")), fn(x, y)):
        assert got.dtype == expected.dtype
        _same_floats(got.cpu().float(), expected.float())
