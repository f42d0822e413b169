"""Golden comparison (issue 27): each op against float64 on the host, the first failure named.

The reference for the figures is plain numpy in float64 (a matmul and a relu computed here);
the reference for which op is wrong is the plant itself: a post_op hook (the test-only seam the
issue asks for) moves one element of one op's output just past that op's bound, as a device op
off by one ulp beyond its dtype's rounding would be. In the chain mode it must be the first
failure; in the substitution mode (Chisel's isolation) the only one. Moved by less than the
smallest element's bound, it must not be flagged, so the bound is not zero either.
"""

from __future__ import annotations

import json
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import ttflow as tt

pytestmark = pytest.mark.anyio

F32, BF16, BF8, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B, tt.DataType.INT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE = tt.TensorLayout.TILE


def model(dtype: tt.DataType = F32) -> tt.Binary:
    """Six ops a transformer block has: matmul, gelu, softmax, a bfloat16 weight cast up, matmul, sum."""
    b = tt.ProgramBuilder("block")
    x = b.input((32, 64), tt.Layout(DRAM, TILE, dtype))
    w1 = b.input((64, 32))
    w2 = b.input((32, 16), tt.Layout(DRAM, TILE, BF16))
    with b.location("block.py:3 (fc1)"):
        h = b.matmul(b.typecast(x, F32) if dtype is not F32 else x, w1)
    with b.location("block.py:4 (gelu)"):
        h = b.gelu(h)
    with b.location("block.py:5 (softmax)"):
        h = b.softmax(h, -1)
    with b.location("block.py:6 (fc2)"):
        y = b.matmul(h, b.typecast(w2, F32))
    b.output(b.sum(y, -1))
    return tt.Binary([b.build()])


def inputs(device: tt.Device, dtype: tt.DataType = F32) -> list[tt.Tensor]:
    rng = np.random.default_rng(0)
    return [tt.to_device(rng.standard_normal((32, 64)).astype(np.float32), device, tt.Layout(DRAM, TILE, dtype)),
            tt.to_device(rng.standard_normal((64, 32)).astype(np.float32), device),
            tt.to_device(rng.standard_normal((32, 16)).astype(np.float32), device, tt.Layout(DRAM, TILE, BF16))]


@pytest.mark.parametrize("dtype", [F32, BF16, BF8])
async def test_a_correct_run_passes_every_op_and_its_outputs_are_the_plain_runs(dtype: tt.DataType) -> None:
    binary = model(dtype)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        ins = inputs(device, dtype)
        (y,) = tt.submit(device, binary, 0, ins)
        plain = await tt.to_host(y)
        for substitute in (False, True):
            report = await tt.compare_with_golden(device, binary, 0, ins, substitute=substitute)
            assert report.ok, report.table()
            assert [row.name for row in report.ops][-4:] == ["gelu", "softmax", "typecast", "matmul", "sum"][-4:]
            assert report.ops[-2].loc == "block.py:6 (fc2)"
            assert all(row.pcc > 0.9999 for row in report.ops)
            if not substitute:
                np.testing.assert_array_equal(report.outputs[0], plain)  # hooks that only look change nothing


async def test_the_figures_are_numpys_in_float64() -> None:
    b = tt.ProgramBuilder("mm")
    x, w = b.input((32, 64)), b.input((64, 32))
    b.output(b.relu(b.matmul(x, w)))
    binary = tt.Binary([b.build()])
    rng = np.random.default_rng(1)
    xs, ws = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((64, 32)).astype(np.float32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        report = await tt.compare_with_golden(device, binary, 0, [tt.to_device(xs, device), tt.to_device(ws, device)])
    golden = xs.astype(np.float64) @ ws.astype(np.float64)
    out = report.outputs[0].astype(np.float64)
    matmul, relu = report.ops
    # relu's chain error is the device's against numpy's float64 relu of the float64 matmul
    assert relu.max_abs == pytest.approx(np.abs(out - np.maximum(golden, 0)).max(), rel=1e-12, abs=1e-300)
    assert matmul.max_abs >= relu.max_abs - 1e-300
    # the matmul's bound: its float32 rounding and 4 K u of |x| |w| (K = 64)
    magnitude = np.abs(xs).astype(np.float64) @ np.abs(ws).astype(np.float64)
    want = (2.0**-24 * np.abs(golden) + 4 * 64 * 2.0**-24 * magnitude).max()
    assert matmul.bound == pytest.approx(want, rel=1e-9)
    assert relu.local_max_abs == 0.0  # relu is exact on what it read


def _perturbing(target: int, amount: float) -> Any:
    """A post_op hook that moves one element of op `target`'s output by `amount` and one ulp."""
    async def post_op(ctx: tt.OpContext) -> None:
        if ctx.index == target:
            out = ctx.outputs[0]
            value = await tt.to_host(out)
            moved = value.astype(np.float32).copy().reshape(-1)
            k = int(np.argmax(moved))  # the largest: it reaches the output (gelu passes it on)
            moved[k] = np.nextafter(np.float32(moved[k] + amount), np.float32(np.inf))
            moved = moved.reshape(value.shape)
            tt.write(out, moved.astype(value.dtype))
    return post_op


@pytest.mark.parametrize("target", [0, 2, 4])
async def test_a_planted_op_is_named_first_and_alone_when_substituting(target: int) -> None:
    binary = model()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        ins = inputs(device)
        clean = await tt.compare_with_golden(device, binary, 0, ins)
        bound = clean.ops[target].bound  # the largest element's bound: past every element's
        chain = await tt.compare_with_golden(device, binary, 0, ins, post_op=_perturbing(target, bound))
        assert chain.first_failure is not None and chain.first_failure.index == target, chain.table()
        isolated = await tt.compare_with_golden(device, binary, 0, ins, substitute=True,
                                                post_op=_perturbing(target, bound))
        assert [row.index for row in isolated.ops if not row.ok] == [target], isolated.table()
        assert isolated.first_failure is not None and isolated.first_failure.name == binary.programs[0].steps[target].op
        # Substituted, the run went on from the golden: its output is bit for bit a clean
        # substituting run's; left in, the moved element reaches the output.
        clean_isolated = await tt.compare_with_golden(device, binary, 0, ins, substitute=True)
        np.testing.assert_array_equal(isolated.outputs[0], clean_isolated.outputs[0])
        assert not np.array_equal(chain.outputs[0], clean.outputs[0])
        one_ulp = await tt.compare_with_golden(device, binary, 0, ins, substitute=True,
                                               post_op=_perturbing(target, 0.0))  # one ulp: within
        assert one_ulp.ok, one_ulp.table()


async def test_reports_as_table_json_and_plot(tmp_path: Any) -> None:
    binary = model()
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        ins = inputs(device)
        clean = await tt.compare_with_golden(device, binary, 0, ins)
        report = await tt.compare_with_golden(device, binary, 0, ins, post_op=_perturbing(1, clean.ops[1].bound))
    text = report.table()
    assert "block.py:4 (gelu)  <- first failure" in text
    data = json.loads(report.to_json())
    assert data["first_failure"] == 1 and data["ops"][1]["ok"] is False and len(data["ops"]) == len(report.ops)
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    report.plot(str(tmp_path / "errors.png"))
    assert (tmp_path / "errors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_integer_ops_are_exact_and_bad_calls_are_typed() -> None:
    b = tt.ProgramBuilder("ints")
    x = b.input((32, 32), tt.Layout(DRAM, TILE, I32))
    b.output(b.sum(b.mul(x, 3), -1))
    binary = tt.Binary([b.build()])
    xs = np.random.default_rng(2).integers(-100, 100, (32, 32)).astype(np.int32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        t = tt.to_device(xs, device, tt.Layout(DRAM, TILE, I32))
        report = await tt.compare_with_golden(device, binary, 0, [t])
        assert report.ok and all(row.bound == 0.0 and row.max_abs == 0.0 for row in report.ops)
        np.testing.assert_array_equal(report.outputs[0], (xs.astype(np.int64) * 3).sum(-1, keepdims=True))
        with pytest.raises(tt.ProgramError, match="out of range"):
            await tt.compare_with_golden(device, binary, 3, [t])
        with pytest.raises(tt.ProgramError, match="takes 1 inputs"):
            await tt.compare_with_golden(device, binary, 0, [t, t])
        assert device.memory_used(L1) == 0


async def test_a_program_with_a_constant_part_is_compared_on_its_own_ops_with_their_locations() -> None:
    """A program whose constant inputs feed steps of their own runs those apart first (const-eval,
    `main.const_eval`): the report has a row per op of the rest, each with its location, and the
    figures are numpy's float64 from the constant part's device values. (Before, the constant part's hooks were taken as the program's
    ops, and the cut dropped every location.)"""
    b = tt.ProgramBuilder("scaled")
    x, w = b.input((32, 64)), b.input((64, 32), const=True)
    with b.location("scaled.py:2 (scale)"):
        w2 = b.mul(w, w)  # depends on the constant alone: runs in the constant part
    with b.location("scaled.py:3 (fc)"):
        h = b.matmul(x, w2)
    with b.location("scaled.py:4 (act)"):
        b.output(b.tanh(h))
    binary = tt.Binary([b.build()])
    rng = np.random.default_rng(3)
    xs, ws = rng.standard_normal((32, 64)).astype(np.float32), rng.standard_normal((64, 32)).astype(np.float32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        ins = [tt.to_device(xs, device), tt.to_device(ws, device)]
        report = await tt.compare_with_golden(device, binary, 0, ins)
    assert [(row.name, row.loc) for row in report.ops] == [("matmul", "scaled.py:3 (fc)"), ("tanh", "scaled.py:4 (act)")]
    assert report.ok, report.table()
    # the constant part is taken as the device computed it (float32 w * w), the rest in float64
    want = np.tanh(xs.astype(np.float64) @ (ws * ws).astype(np.float64))
    assert report.ops[-1].max_abs == pytest.approx(np.abs(report.outputs[0] - want).max(), rel=1e-9, abs=1e-300)


async def test_a_nan_in_one_element_leaves_the_others_bounds_finite() -> None:
    """log of a negative is NaN (as numpy's), and the NaN must not make every other element's
    bound NaN: the run passes, and an element moved past its bound is still caught."""
    b = tt.ProgramBuilder("logs")
    x = b.input((32, 32), tt.Layout(DRAM, TILE, BF16))
    b.output(b.exp(b.log(x)))
    binary = tt.Binary([b.build()])
    xs = np.random.default_rng(5).uniform(0.5, 4.0, (32, 32)).astype(np.float32)
    xs[0, :4] = [-1.0, -2.0, 0.0, np.inf]
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        ins = [tt.to_device(xs, device, tt.Layout(DRAM, TILE, BF16))]
        report = await tt.compare_with_golden(device, binary, 0, ins)
        assert report.ok, report.table()
        assert all(np.isfinite(row.bound) and row.bound > 0 for row in report.ops)
        async def nudge(ctx: tt.OpContext) -> None:  # a finite element of log's output, past its bound
            if ctx.index == 0:
                value = (await tt.to_host(ctx.outputs[0])).astype(np.float32)
                value[5, 5] += 0.25
                tt.write(ctx.outputs[0], value.astype(ml_dtypes.bfloat16))

        moved = await tt.compare_with_golden(device, binary, 0, ins, post_op=nudge)
        assert moved.first_failure is not None and moved.first_failure.index == 0, moved.table()


async def test_an_overflow_to_infinity_is_the_dtypes_rounding_not_an_error() -> None:
    """A float32 product beyond float32's largest value is an infinity on the device; the float64
    golden is finite there, and rounded to float32 it is that infinity: the op is ok."""
    b = tt.ProgramBuilder("overflow")
    x, y = b.input((32, 32)), b.input((32, 32))
    b.output(b.mul(x, y))
    binary = tt.Binary([b.build()])
    xs = np.full((32, 32), 2.0, np.float32)
    ys = np.full((32, 32), 3.0, np.float32)
    xs[0, :2], ys[0, :2] = 3e38, [2.0, -2.0]  # 6e38 and -6e38: past float32's 3.4e38
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        report = await tt.compare_with_golden(device, binary, 0, [tt.to_device(xs, device), tt.to_device(ys, device)])
    assert report.outputs[0][0, 0] == np.inf and report.outputs[0][0, 1] == -np.inf
    assert report.ok, report.table()
