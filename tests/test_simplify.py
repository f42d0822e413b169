"""`tt.simplify`: fewer steps, the same bits.

Random programs of reshapes, permutes (often of each other), repeated comparisons and pointwise
ops, in float32, bfloat16 and int32, are simplified; the simplified program run on the host and
on the device must give bit-identical outputs to the original run on the host (`run_on_host`,
the reference every program is held to).
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ttflow as tt
from ttflow._ir.ops import OPS
from ttflow._ir.numerics import store_as
from ttflow._ir.interpreter import run_on_host

F32, BF16, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.INT32
DRAM_TILE = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE)


def _layout(dtype: tt.DataType) -> tt.Layout:
    return tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, dtype)


@st.composite
def chains(draw: st.DrawFn) -> tuple[tt.Program, list[np.ndarray]]:
    dtype = draw(st.sampled_from([F32, BF16, I32, tt.DataType.BFLOAT8_B]))
    shape = draw(st.sampled_from([(4, 6), (2, 3, 4), (2, 3, 4, 5), (8, 8), (1, 12)]))
    b = tt.ProgramBuilder("chain")
    x = b.input(shape, _layout(dtype))
    y = b.input(shape, _layout(dtype))
    z = b.input((1, 1), _layout(dtype))  # a one-element operand, as an optimizer's scalar
    pool = [x, y]
    for _ in range(draw(st.integers(1, 12))):
        v = pool[-1] if draw(st.booleans()) else draw(st.sampled_from(pool))  # chains, often
        kind = draw(st.sampled_from(["reshape", "permute", "twice", "add", "mul", "cmp", "back", "scalars",
                                     "flat", "scale", "tiny", "fill", "constant", "cast_cond"]))
        if kind == "reshape":
            n = math.prod(v.shape)
            target = draw(st.sampled_from([s for s in [(n,), (1, n), (n, 1), v.shape[::-1], v.shape]
                                           if math.prod(s) == n]))
            pool.append(b.reshape(v, target))
        elif kind == "permute":  # one, or two in a row (which compose in order)
            axes = draw(st.permutations(range(len(v.shape))))
            v = b.permute(v, axes)
            if draw(st.booleans()):
                v = b.permute(v, draw(st.permutations(range(len(v.shape)))))
            pool.append(v)
        elif kind == "twice":  # the pattern lowerings emit: a transpose of a transpose
            axes = list(range(len(v.shape)))
            if len(axes) >= 2:
                axes[-1], axes[-2] = axes[-2], axes[-1]
            pool.append(b.permute(b.permute(v, axes), axes))
        elif kind == "back":  # a reshape there and back
            pool.append(b.reshape(b.reshape(v, (math.prod(v.shape),)), v.shape))
        elif kind == "flat":  # what a foreach optimizer step lowers to: p + s * g, flattened
            w = draw(st.sampled_from([p for p in pool if p.shape == v.shape]))
            flat = (math.prod(v.shape),)
            scaled = b.mul(b.reshape(z, (1,)), b.reshape(w, flat))
            pool.append(b.reshape(b.add(b.reshape(v, flat), scaled), v.shape))
        elif kind == "scale":  # a (1, 1) scalar seen as (1,), broadcast against a value
            pool.append(b.mul(b.reshape(z, (1,)), v))
        elif kind == "tiny":  # only one-element operands: the result keeps its (1,) shape
            pool.append(b.add(b.reshape(z, (1,)), b.reshape(b.mul(z, z), (1,))))
        elif kind == "fill":  # a where against a one-element constant, on either side
            c = draw(st.sampled_from([0, 2, -3] if dtype is I32 else
                                     [0.0, 0.1, -1.5] + ([] if dtype is tt.DataType.BFLOAT8_B else [-math.inf])))
            shape_c = draw(st.sampled_from([(1,), (1, 1), (1,) * len(v.shape)]))
            constant = b.full(shape_c, c, v.dtype)
            cond = b.ne(v, 0.0)
            pool.append(b.where(cond, v, constant) if draw(st.booleans()) else b.where(cond, constant, v))
        elif kind == "cast_cond":  # a where on a typecast condition: a ReLU's backward, or not
            ones_and_zeros = draw(st.booleans())
            source = b.le(v, 0.0) if ones_and_zeros else b.mul(v, 3 if v.dtype is I32 else 0.25)  # 1/0, or not
            # BFLOAT8_B holds no infinity (a "fill" may have put one in v): cast only 1/0 there.
            target = draw(st.sampled_from([I32, F32, BF16] + ([tt.DataType.BFLOAT8_B] if ones_and_zeros else [])))
            w = draw(st.sampled_from([p for p in pool if p.shape == v.shape]))
            pool.append(b.where(b.typecast(source, target), 0.0, w))
        elif kind == "constant":  # a reshaped constant, added in
            c = 3 if dtype is I32 else 0.75
            pool.append(b.add(v, b.reshape(b.full((1,), c, v.dtype), (1,) * len(v.shape))))
        elif kind == "scalars":  # one op with two scalars: not one step
            s1, s2 = draw(st.sampled_from([1.0, 2.0, -1.0])), draw(st.sampled_from([1.0, 2.0, -1.0]))
            pool.append(b.sub(b.mul(v, s1), b.mul(v, s2)))
        else:
            w = draw(st.sampled_from([p for p in pool if p.shape == v.shape]))
            if kind == "add":
                pool.append(b.add(v, w))
            elif kind == "mul":
                pool.append(b.mul(v, w))
            else:  # the same comparison, twice
                pool.append(b.add(b.ne(v, 0.0), b.ne(v, 0.0)))
    for v in draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3)):
        b.output(v, _layout(v.dtype))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arrays = []
    for dims in (shape, shape, (1, 1)):
        a = rng.integers(-3, 4, dims) if dtype is I32 else rng.standard_normal(dims) * 2.0 ** rng.integers(-8, 8, dims)
        arrays.append(a.astype(np.int32 if dtype is I32 else np.float32))
    return b.build(), arrays


def _shapes_hold(program: tt.Program, arrays: list[np.ndarray]) -> bool:
    """Whether every step's result has the shape its value declares (the device allocates by
    the declared shape)."""
    values: list = [store_as(np.asarray(a), spec.dtype) for a, spec in zip(arrays, program.inputs)]
    values += [None] * (len(program.values) - len(values))
    for step in program.steps:
        result = OPS[step.op].compute([values[v] for v in step.inputs], step.scalar, **dict(step.attrs))
        if np.shape(result) != program.values[step.output].shape:
            return False
        values[step.output] = store_as(result, program.values[step.output].dtype)
    return True


def _bits(arrays: list[np.ndarray]) -> list[bytes]:
    return [np.ascontiguousarray(a).tobytes() for a in arrays]


@settings(max_examples=150)
@given(chains())
def test_simplified_programs_give_the_same_bits_on_the_host(case: tuple[tt.Program, list[np.ndarray]]) -> None:
    program, arrays = case
    simpler = tt.simplify(program)
    assert len(simpler.steps) <= len(program.steps)
    want = run_on_host(program, arrays)
    got = run_on_host(simpler, arrays)
    assert _shapes_hold(simpler, arrays)
    assert [a.shape for a in got] == [a.shape for a in want]
    assert _bits(got) == _bits(want)


@pytest.mark.anyio
@settings(max_examples=20)
@given(case=chains())
async def test_simplified_programs_give_the_same_bits_on_the_device(case: tuple[tt.Program, list[np.ndarray]]) -> None:
    program, arrays = case
    simpler = tt.simplify(program)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        inputs = [tt.to_device(a, device, spec.layout) for a, spec in zip(arrays, simpler.inputs)]
        outputs = tt.submit(device, tt.Binary([simpler]), 0, inputs)
        got = [await tt.to_host(t) for t in outputs]
    assert _bits(got) == _bits(run_on_host(program, arrays))


def test_the_lowerings_patterns_go() -> None:
    b = tt.ProgramBuilder("patterns")
    x = b.input((64, 10), _layout(F32))
    t = b.permute(b.permute(x, (1, 0)), (1, 0))  # x itself
    r = b.reshape(b.reshape(b.sum(t, 0), (10,)), (1, 10))  # the sum itself
    m = b.where(b.ne(x, 0.0), x, 0.0)
    n = b.where(b.ne(x, 0.0), x, 1.0)  # the same ne
    dead = b.exp(x)  # read by nothing
    del dead
    b.output(r, _layout(F32))
    b.output(b.add(m, n), _layout(F32))
    b.output(t, _layout(F32))
    program = b.build()
    simpler = tt.simplify(program)
    assert [s.op for s in simpler.steps] == ["sum", "ne", "where", "where", "add"]
    assert simpler.outputs[2] == 0  # the input, copied out
    x_host = np.random.default_rng(1).standard_normal((64, 10)).astype(np.float32)
    assert _bits(run_on_host(simpler, [x_host])) == _bits(run_on_host(program, [x_host]))


def test_a_typecast_condition_goes_only_when_it_is_a_comparison() -> None:
    """A ReLU's backward in torch's decompositions: where(typecast(le(x, 0), INT32), 0, g). The
    typecast goes; a typecast of a value that is not 1 or 0 (0.25 truncates to 0) stays."""
    b = tt.ProgramBuilder("relu_backward")
    x = b.input((8, 8), _layout(F32))
    g = b.input((8, 8), _layout(F32))
    relu_grad = b.where(b.typecast(b.le(x, 0.0), I32), 0.0, g)
    truncated = b.where(b.typecast(b.mul(x, 0.25), I32), 0.0, g)
    b.output(relu_grad, _layout(F32))
    b.output(truncated, _layout(F32))
    program = b.build()
    simpler = tt.simplify(program)
    assert [s.op for s in simpler.steps] == ["le", "where", "mul", "typecast", "where"]
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((8, 8)).astype(np.float32) * 4, rng.standard_normal((8, 8)).astype(np.float32)]
    assert _bits(run_on_host(simpler, arrays)) == _bits(run_on_host(program, arrays))


def test_programs_with_donations_or_in_place_updates_are_left_alone() -> None:
    b = tt.ProgramBuilder("cache")
    cache = b.input((1, 32, 32), _layout(F32))
    value = b.input((1, 1, 32), _layout(F32))
    index = b.input((1,), _layout(I32))
    b.output(b.update_cache(b.permute(b.permute(cache, (0, 2, 1)), (0, 2, 1)), value, index),
             donates=cache)
    program = b.build()
    assert tt.simplify(program) is program


def test_bfloat16_values_are_not_merged_with_float32_ones() -> None:
    b = tt.ProgramBuilder("dtypes")
    x = b.input((4, 4), _layout(F32))
    y = b.typecast(x, BF16)
    b.output(b.reshape(b.reshape(y, (16,)), (4, 4)), _layout(BF16))
    b.output(b.reshape(b.reshape(x, (16,)), (4, 4)), _layout(F32))
    program = b.build()
    simpler = tt.simplify(program)
    assert [s.op for s in simpler.steps] == ["typecast"]
    x_host = np.linspace(-2, 2, 16, dtype=np.float32).reshape(4, 4) + np.float32(1e-3)
    got, want = run_on_host(simpler, [x_host]), run_on_host(program, [x_host])
    assert got[0].dtype == ml_dtypes.bfloat16 and _bits(got) == _bits(want)


@pytest.mark.anyio
async def test_a_one_element_operand_keeps_broadcasting_as_it_did() -> None:
    # x, y of shape (12,) seen as (1, 12); the scalar z (1, 1) seen as (1,). Lifted, the op runs
    # on (12,): z must come in as (1,) (as (1, 1) it would make the result (1, 12)).
    b = tt.ProgramBuilder("bias_step")
    x, y = b.input((12,), _layout(F32)), b.input((12,), _layout(F32))
    z = b.input((1, 1), _layout(F32))
    r = b.add(b.reshape(x, (1, 12)), b.mul(b.reshape(z, (1,)), b.reshape(y, (1, 12))))
    b.output(b.reshape(r, (12,)), _layout(F32))  # back to (12,): lifting wins, 3 steps for 6
    program = b.build()
    simpler = tt.simplify(program)
    lifted = [s for s in simpler.steps if s.op in ("add", "mul")]
    assert [simpler.values[s.output].shape for s in lifted] == [(12,), (12,)]
    assert all(math.prod(simpler.values[v].shape) == 12 or simpler.values[v].shape == (1,)
               for s in lifted for v in s.inputs)
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(s.shape).astype(np.float32) for s in program.inputs]
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        inputs = [tt.to_device(a, device, spec.layout) for a, spec in zip(arrays, simpler.inputs)]
        (out,) = tt.submit(device, tt.Binary([simpler]), 0, inputs)
        got = await tt.to_host(out)
    assert got.shape == (12,) and _bits([got]) == _bits(run_on_host(program, arrays))


def test_a_constant_is_a_where_scalar_only_with_the_wheres_dtype_and_shape() -> None:
    b = tt.ProgramBuilder("constants")
    x = b.input((12,), _layout(F32))
    wider = b.where(b.ne(x, 0.0), x, b.full((1, 1), 0.5, F32))  # (1, 12): the constant widens it
    rounded = b.where(b.ne(x, 0.0), x, b.full((1,), 0.1, BF16))  # a bfloat16 0.1 in a float32 where
    same = b.where(b.ne(x, 0.0), b.full((1,), 0.1, F32), x)  # this one folds
    for v in (wider, rounded, same):
        b.output(v, _layout(F32))
    program = b.build()
    simpler = tt.simplify(program)
    assert [s.op for s in simpler.steps].count("full") == 2
    x_host = np.array([0, 1, -2, 0, 3, 0, 0.5, 0, 0, 7, 0, 1], np.float32)
    assert _shapes_hold(simpler, [x_host])
    assert _bits(run_on_host(simpler, [x_host])) == _bits(run_on_host(program, [x_host]))


def test_range_checks_stay_with_their_steps() -> None:
    """A checked step keeps its check through lifting and renumbering, and is never merged
    with an equal unchecked step (one fails where the other wraps)."""
    i32 = _layout(tt.DataType.INT32)
    b = tt.ProgramBuilder("checked")
    x = b.input((1, 8), i32)
    flat = b.reshape(x, (8,))  # a 1-D view, as the lowerings make
    unchecked = b.mul(flat, 70000)
    with b.checking_range("int64 product"):
        checked = b.mul(flat, 70000)
    b.output(b.reshape(unchecked, (1, 8)), i32)
    b.output(b.reshape(checked, (1, 8)), i32)
    program = b.build()
    simplified = tt.simplify(program)
    assert len(simplified.steps) < len(program.steps)  # the reshapes went
    assert [s.op for s in simplified.steps] == ["mul", "mul"]
    assert [simplified.values[v].dtype for v, _ in simplified.range_checks] == [tt.DataType.INT32]
    small = np.arange(8, dtype=np.int32).reshape(1, 8)
    assert _bits(run_on_host(simplified, [small])) == _bits(run_on_host(program, [small]))
    for p in (program, simplified):
        with pytest.raises(tt.ProgramError, match="int64 product: a result of mul"):
            run_on_host(p, [small * 10000])


@pytest.mark.anyio
async def test_constant_inputs_stay_constant() -> None:
    """A program with constant inputs keeps them through simplify (inputs are never
    renumbered): its constant part is still cut and cached, and its values are the original's."""
    b = tt.ProgramBuilder("scaled_weights")
    x, w = b.input((32, 32)), b.input((32, 32), const=True)
    scaled = b.reshape(b.reshape(b.mul(w, 2.0), (1024,)), (32, 32))  # a reshape pair that goes
    b.output(b.add(x, scaled))
    program = b.build()
    simplified = tt.simplify(program)
    assert len(simplified.steps) < len(program.steps) and simplified.consts == program.consts == (1,)
    rng = np.random.default_rng(3)
    xs, ws = rng.standard_normal((32, 32), np.float32), rng.standard_normal((32, 32), np.float32)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        x_t, w_t = tt.to_device(xs, device), tt.to_device(ws, device)
        binary = tt.Binary([simplified])
        for _ in range(2):
            (out,) = tt.submit(device, binary, 0, [x_t, w_t])
            assert _bits([await tt.to_host(out)]) == _bits(run_on_host(program, [xs, ws]))
        assert (device.stats.const_eval_misses, device.stats.const_eval_hits) == (1, 1)


@pytest.mark.anyio
async def test_pointwise_ops_move_inside_the_same_permute() -> None:
    """A convolution's NHWC result seen as NCHW for a ReLU and a bias, then permuted back for
    the pool: the ops run on the NHWC value and the two permutes cancel. Operands permuted by
    different axes, or a permuted one beside a plain one, stay as they are."""
    b = tt.ProgramBuilder("nchw")
    x = b.input((2, 3, 4, 5), _layout(F32))  # NHWC
    other = b.input((2, 5, 3, 4), _layout(F32))  # already NCHW
    nchw = b.permute(x, (0, 3, 1, 2))
    scale = b.full((1, 1, 1, 1), 0.5, F32)
    y = b.relu(b.mul(nchw, scale))
    b.output(b.permute(y, (0, 2, 3, 1)), _layout(F32))  # back to NHWC: the moves cancel
    b.output(b.add(nchw, other), _layout(F32))  # a plain operand: kept
    program = b.build()
    simpler = tt.simplify(program)
    ops = [s.op for s in simpler.steps]
    assert ops.count("permute") == 1 and ops.count("mul") == 1 and ops.count("relu") == 1, ops
    first = simpler.steps[ops.index("mul")]
    assert simpler.values[first.output].shape == (2, 3, 4, 5)  # runs on the NHWC value
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal((2, 3, 4, 5)).astype(np.float32), rng.standard_normal((2, 5, 3, 4)).astype(np.float32)]
    assert _bits(run_on_host(simpler, arrays)) == _bits(run_on_host(program, arrays))
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        outs = tt.submit(device, tt.Binary([simpler]), 0, [tt.to_device(a, device, _layout(F32)) for a in arrays])
        got = [await tt.to_host(t) for t in outs]
    assert _bits(got) == _bits(run_on_host(program, arrays))
    # Two operands permuted by different axes: no common source shape to run on.
    c = tt.ProgramBuilder("mixed")
    sq = c.input((3, 3, 3), _layout(F32))
    c.output(c.add(c.permute(sq, (1, 0, 2)), c.permute(c.relu(sq), (2, 1, 0))), _layout(F32))
    mixed = c.build()
    square = rng.standard_normal((3, 3, 3)).astype(np.float32)
    assert _bits(run_on_host(tt.simplify(mixed), [square])) == _bits(run_on_host(mixed, [square]))
