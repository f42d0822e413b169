"""The program builder's inference and checks, the host interpreter, and the binary file format."""

from __future__ import annotations

import io
import json
import math
import struct
import zlib
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ttflow as tt
from ttflow._ir.binary import _VERSION as NEWEST  # save's version: the newest of the ops' records
from ttflow._ir import binary as _binary
from ttflow._ir.builder import Value
from ttflow._ir.interpreter import run_on_host
from ttflow._types import check_shape, storage_geometry

F32, BF16, BF8 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B
I32, U32 = tt.DataType.INT32, tt.DataType.UINT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE, ROW_MAJOR = tt.TensorLayout.TILE, tt.TensorLayout.ROW_MAJOR
HEADER = struct.Struct("<8sIQI")


def mlp() -> tt.Program:
    b = tt.ProgramBuilder("mlp")
    x = b.input((4, 40))
    w = b.input((40, 8), tt.Layout(L1, TILE, BF16))
    h = b.gelu(b.matmul(x, w))
    b.output(b.softmax(h), tt.Layout(L1, ROW_MAJOR))
    b.output(b.sum(b.transpose(h), axis=-1))
    return b.build()


# -- inference ------------------------------------------------------------------------------------

def test_shapes_dtypes_and_layouts_are_inferred() -> None:
    p = mlp()
    assert [s.shape for s in p.inputs] == [(4, 40), (40, 8)]
    assert p.inputs[0].layout == tt.Layout(DRAM, TILE, F32)  # the default input layout
    assert p.inputs == p.values[:2]
    assert [s.shape for s in p.output_specs] == [(4, 8), (8, 1)]
    assert [s.dtype for s in p.output_specs] == [F32, F32]  # float32 wins over bfloat16
    assert p.output_specs[0].layout == tt.Layout(L1, ROW_MAJOR, F32)  # dtype None: the value's
    assert p.output_specs[1].layout == tt.Layout(DRAM, TILE, F32)  # the default output layout
    assert [s.op for s in p.steps] == ["matmul", "gelu", "softmax", "transpose", "sum"]
    assert [s.output for s in p.steps] == [2, 3, 4, 5, 6] and p.outputs == (4, 6)
    assert p.steps[2].attrs == (("axis", 1),) and p.steps[4].attrs == (("axis", 1),)
    assert p.steps[0].inputs == (0, 1) and p.steps[0].scalar is None


def test_input_layout_without_dtype_is_float32() -> None:
    b = tt.ProgramBuilder("p")
    assert b.input((3,), tt.Layout(L1, ROW_MAJOR)).dtype is F32
    assert b.input((3,), tt.Layout(dtype=I32)).dtype is I32


def test_repr_names_the_program_and_its_specs_not_its_steps() -> None:
    text = repr(mlp())
    assert "mlp" in text and "(4, 40) FLOAT32" in text and "(40, 8) BFLOAT16 L1" in text
    assert "(8, 1)" in text and "5 steps" in text and "gelu" not in text


def test_broadcasting_and_scalars() -> None:
    b = tt.ProgramBuilder("bcast")
    x, bias, w = b.input((2, 3, 5)), b.input((1, 5)), b.input((5, 7))
    col = b.input((3, 1), tt.Layout(dtype=BF16))
    y = b.add(x, bias)
    assert y.shape == (2, 3, 5)
    assert b.sub(col, bias).shape == (3, 5) and b.sub(col, bias).dtype is F32
    assert b.mul(y, 2).shape == (2, 3, 5) and b.mul(y, 2).dtype is F32
    assert b.mul(col, 0.5).dtype is BF16  # a scalar keeps the value's dtype
    assert b.matmul(y, w).shape == (2, 3, 7)
    assert b.transpose(y).shape == (2, 5, 3)
    assert b.gt(col, 0).dtype is BF16
    step = b._steps[-1]
    assert step.op == "gt" and step.scalar == 0.0 and isinstance(step.scalar, float)


def test_matmul_batch_dims_broadcast() -> None:
    b = tt.ProgramBuilder("bmm")
    a, c, d = b.input((2, 1, 3, 4)), b.input((5, 4, 6)), b.input((2, 3, 4))
    assert b.matmul(a, c).shape == (2, 5, 3, 6)
    assert b.matmul(c, b.transpose(c)).shape == (5, 4, 4)
    with pytest.raises(tt.ShapeError, match=r"matmul: batch dims of \(2, 3, 4\) and \(3, 4, 10\)"):
        b.matmul(d, b.reshape(c, (3, 4, 10)))


@pytest.mark.parametrize(("a", "c", "want"), [(F32, BF16, F32), (BF16, BF8, BF16), (BF8, F32, F32),
                                              (BF8, BF8, BF8), (I32, I32, I32), (U32, U32, U32)])
def test_binary_result_dtypes(a: tt.DataType, c: tt.DataType, want: tt.DataType) -> None:
    b = tt.ProgramBuilder("dt")
    x, y = b.input((4, 4), tt.Layout(tensor_layout=TILE, dtype=a)), b.input((4, 4), tt.Layout(tensor_layout=TILE, dtype=c))
    for op in ("add", "sub", "mul", "gt", "matmul"):
        assert getattr(b, op)(x, y).dtype is want, op
        assert getattr(b, op)(y, x).dtype is want, op


def test_unary_and_reduction_inference() -> None:
    b = tt.ProgramBuilder("u")
    x, i = b.input((2, 3, 4)), b.input((2, 3, 4), tt.Layout(dtype=I32))
    for op in ("relu", "gelu", "exp", "sqrt", "reciprocal", "neg"):
        v = getattr(b, op)(x)
        assert (v.shape, v.dtype) == ((2, 3, 4), F32), op
    for op in ("relu", "neg"):
        assert getattr(b, op)(i).dtype is I32
    assert b.sum(x, -2).shape == (2, 1, 4) and b._steps[-1].attrs == (("axis", 1),)
    assert b.max(i, 0).shape == (1, 3, 4) and b.max(i, 0).dtype is I32
    assert b.sum(i, -1).dtype is I32
    assert b.softmax(x, axis=0).shape == (2, 3, 4) and b._steps[-1].attrs == (("axis", 0),)
    assert b.transpose(i).shape == (2, 4, 3)
    cast = b.typecast(x, U32)
    assert cast.dtype is U32 and b._steps[-1].attrs == (("dtype", "uint32"),)
    assert b.reshape(x, (6, 4)).shape == (6, 4)


# -- build-time errors ----------------------------------------------------------------------------

def test_shape_errors_name_the_op_and_shapes() -> None:
    b = tt.ProgramBuilder("bad")
    x, v = b.input((3, 4)), b.input((4,))
    with pytest.raises(tt.ShapeError, match=r"add.*\(3, 4\).*\(4, 3\).*broadcast"):
        b.add(x, b.transpose(x))
    with pytest.raises(tt.ShapeError, match=r"matmul.*inner.*\(3, 4\) @ \(3, 4\)"):
        b.matmul(x, x)
    with pytest.raises(tt.ShapeError, match=r"matmul.*rank >= 2.*\(4,\)"):
        b.matmul(v, x)
    with pytest.raises(tt.ShapeError, match=r"matmul.*rank"):
        b.matmul(x, v)
    with pytest.raises(tt.ShapeError, match=r"transpose.*\(4,\)"):
        b.transpose(v)
    for call in (lambda: b.sum(x, 2), lambda: b.max(x, -3), lambda: b.softmax(x, axis=5),
                 lambda: b.sum(x, 1.0)):  # type: ignore[arg-type]
        with pytest.raises(tt.ShapeError, match="axis"):
            call()
    with pytest.raises(tt.ShapeError, match="element counts"):
        b.reshape(x, (5, 5))
    for shape in ((), (0, 3), (3, -1), 3):
        with pytest.raises(tt.ShapeError):
            tt.ProgramBuilder("s").input(shape)  # type: ignore[arg-type]


def test_check_shape_takes_integers_only() -> None:
    # Before: (32, 1.5) became (32, 1), (32, 2.0) and (True, 3) passed, inf raised a bare
    # OverflowError and nan a bare ValueError.
    for shape in ((32, 1.5), (32, 2.0), (32, np.float32(2.0)), (32, math.inf), (32, -math.inf),
                  (32, math.nan), (True, 3), (3, np.bool_(True)), (3, "4"), (3, None), (3, 2 + 0j),
                  (3, np.array([4])), 32, None):
        with pytest.raises(tt.ShapeError):
            check_shape(shape)
        with pytest.raises(tt.ShapeError):
            tt.ProgramBuilder("s").input(shape)  # type: ignore[arg-type]
    with pytest.raises(tt.ShapeError, match=r"1\.5.*float.*//"):
        check_shape((32, 1.5))
    with pytest.raises(tt.ShapeError, match="bool"):
        check_shape((True, 3))
    with pytest.raises(tt.ShapeError, match=r"\(32,\)"):
        check_shape(32)
    for shape in ((np.int64(3), np.uint8(4), np.int32(5)), [3, 4, 5], np.array([3, 4, 5]),
                  (3, np.array(4), 5), range(3, 6)):
        dims = check_shape(shape)
        assert dims == (3, 4, 5) and all(type(d) is int for d in dims)
    assert check_shape((2**100,)) == (2**100,)  # no upper bound here: memory decides


def test_shapes_are_multiplied_as_python_ints() -> None:
    # np.prod wraps at 2**64: (2**32, 2**32) and (2**33, 2**32) both "held 0 elements", so the
    # reshape was accepted; np.broadcast_shapes refuses dims past int64 as if they did not meet.
    b = tt.ProgramBuilder("huge")
    x = b.input((2**32, 2**32))
    big, row, wider = b.input((2**70, 3)), b.input((1, 3)), b.input((2**70 + 1, 3))
    m, w = b.input((2**64, 2, 3)), b.input((3, 4))
    with pytest.raises(tt.ShapeError, match="element counts"):
        b.reshape(x, (2**33, 2**32))
    with pytest.raises(tt.ShapeError, match="element counts"):
        b.reshape(x, (2**64 + 1,))
    assert b.reshape(x, (2**31, 2**33)).shape == (2**31, 2**33)
    assert b.reshape(x, (2**64,)).shape == (2**64,)
    assert b.add(big, big).shape == (2**70, 3)
    assert b.mul(big, row).shape == (2**70, 3)
    with pytest.raises(tt.ShapeError, match="broadcast"):
        b.add(big, wider)
    assert b.matmul(m, w).shape == (2**64, 2, 4)
    assert storage_geometry((2**1100, 32), F32, TILE) == (4096, 2**1095)  # was an OverflowError
    assert storage_geometry((2**60 + 1, 33), F32, TILE) == (4096, (2**55 + 1) * 2)  # float ceil lost the +1


def test_dtype_errors() -> None:
    b = tt.ProgramBuilder("bad")
    x = b.input((3, 4))
    i, u = b.input((3, 4), tt.Layout(dtype=I32)), b.input((3, 4), tt.Layout(dtype=U32))
    with pytest.raises(tt.LayoutError, match=r"add.*FLOAT32.*INT32.*typecast"):
        b.add(x, i)
    with pytest.raises(tt.LayoutError, match="matmul"):
        b.matmul(i, b.transpose(x))
    with pytest.raises(tt.LayoutError, match=r"INT32.*UINT32"):
        b.sub(i, u)
    for op in ("gelu", "exp", "sqrt", "reciprocal", "softmax"):
        with pytest.raises(tt.LayoutError, match=rf"{op}.*float"):
            getattr(b, op)(i)
    with pytest.raises(tt.LayoutError, match="integral"):
        b.mul(i, 0.5)
    with pytest.raises(tt.LayoutError, match="integral"):
        b.add(u, 2.0**60)
    assert b.add(i, 3.0).dtype is I32  # an integral float is fine
    with pytest.raises(tt.LayoutError, match="dtype"):
        b.typecast(x, "int32")  # type: ignore[arg-type]
    with pytest.raises(tt.LayoutError):
        b.output(i, tt.Layout(dtype=F32))
    with pytest.raises(tt.LayoutError):
        b.output(x, tt.Layout(dtype=U32))
    with pytest.raises(tt.LayoutError):
        tt.ProgramBuilder("p").input((3,), "L1")  # type: ignore[arg-type]
    with pytest.raises(tt.LayoutError):
        b.output(x, tt.MemorySpace.L1)  # type: ignore[arg-type]


def test_program_errors() -> None:
    b = tt.ProgramBuilder("bad")
    x = b.input((3, 4))
    other = tt.ProgramBuilder("other").input((3, 4))
    with pytest.raises(tt.ProgramError, match="another program"):
        b.add(x, other)
    with pytest.raises(tt.ProgramError, match="another program"):
        b.relu(other)
    with pytest.raises(tt.ProgramError, match="another program"):
        b.output(other)
    with pytest.raises(tt.ProgramError, match="Value"):
        b.add(x, np.ones((3, 4)))  # type: ignore[arg-type]
    with pytest.raises(tt.ProgramError, match="boolean"):
        b.add(x, True)
    with pytest.raises(tt.ProgramError, match="NaN"):
        b.mul(x, math.nan)
    b.relu(x)
    with pytest.raises(tt.ProgramError, match="before the first op"):
        b.input((1,))
    with pytest.raises(tt.ProgramError, match="no outputs"):
        b.build()
    with pytest.raises(tt.ProgramError, match="name"):
        tt.ProgramBuilder("")
    b.output(x)
    b.output(x)  # an output may repeat, and may be an input
    p = b.build()
    assert p.outputs == (0, 0)
    for again in (b.build, lambda: b.relu(x), lambda: b.softmax(x, axis=9), lambda: b.output(x),
                  lambda: b.input((1,))):
        with pytest.raises(tt.ProgramError, match="already built"):
            again()


def test_last_use() -> None:
    b = tt.ProgramBuilder("lu")
    x, _unused, w = b.input((2, 2)), b.input((2, 2)), b.input((2, 2))
    h = b.matmul(x, w)  # step 0 -> value 3
    b.relu(h)  # step 1 -> value 4, never read
    y = b.add(h, x)  # step 2 -> value 5
    b.output(y)
    b.output(w)
    assert b.build().last_use() == (2, -1, 3, 2, -1, 3)


# -- the host interpreter -------------------------------------------------------------------------

def test_run_on_host_mlp_matches_numpy() -> None:
    b = tt.ProgramBuilder("mlp")
    x = b.input((8, 40))
    w1 = b.input((40, 32), tt.Layout(L1, TILE, BF16))
    b1 = b.input((1, 32))
    w2 = b.input((32, 10))
    h = b.gelu(b.add(b.matmul(x, w1), b1))
    logits = b.matmul(h, w2)
    b.output(b.softmax(logits))
    b.output(logits, tt.Layout(dtype=BF16))
    program = b.build()

    r = np.random.default_rng(0)
    arrays = [r.standard_normal(s).astype(np.float32) * 0.3 for s in ((8, 40), (40, 32), (1, 32), (32, 10))]
    probs, low = run_on_host(program, arrays)

    w1_bf16 = arrays[1].astype(ml_dtypes.bfloat16).astype(np.float64)  # the input is converted
    pre = arrays[0].astype(np.float64) @ w1_bf16 + arrays[2]
    gelu = 0.5 * pre * (1 + np.vectorize(math.erf)(pre / math.sqrt(2)))
    ref_logits = gelu @ arrays[3]
    e = np.exp(ref_logits - ref_logits.max(-1, keepdims=True))
    assert probs.dtype == np.float32 and probs.shape == (8, 10)
    np.testing.assert_allclose(probs, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    assert low.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(low.astype(np.float32), ref_logits, rtol=2**-8, atol=1e-5)


def test_run_on_host_rounds_every_value_to_its_dtype() -> None:
    b = tt.ProgramBuilder("round")
    x = b.input((1, 3), tt.Layout(tensor_layout=TILE, dtype=BF16))
    b.output(b.mul(b.add(x, 1.0), 1.0))  # 1 + 2**-9 is not a bfloat16: rounded to 1 after add
    (out,) = run_on_host(b.build(), [np.array([[2**-9, 2**-7, -3.0]], np.float32)])
    assert out.dtype == ml_dtypes.bfloat16
    assert out.astype(np.float32).tolist() == [[1.0, 1.0 + 2**-7, -2.0]]


def test_run_on_host_integers_wrap_and_typecast() -> None:
    b = tt.ProgramBuilder("ints")
    i = b.input((4,), tt.Layout(dtype=I32))
    u = b.input((4,), tt.Layout(dtype=U32))
    f = b.input((4,))
    b.output(b.add(i, 1))
    b.output(b.sub(u, 1))
    b.output(b.typecast(f, I32))
    b.output(b.typecast(i, F32))
    b.output(b.sum(i, 0))
    got = run_on_host(b.build(), [np.array([2**31 - 1, -1, 0, 5], np.int32), np.array([0, 1, 2, 3], np.uint32),
                                  np.array([1.9, -1.9, 5e9, np.nan], np.float32)])
    assert [g.dtype for g in got] == [np.int32, np.uint32, np.int32, np.float32, np.int32]
    assert got[0].tolist() == [-(2**31), 0, 1, 6]
    assert got[1].tolist() == [2**32 - 1, 0, 1, 2]
    assert got[2].tolist() == [1, -1, 2**31 - 1, 0]
    assert got[3].tolist() == [2.0**31, -1.0, 0.0, 5.0]  # 2**31 - 1 rounds up in float32
    assert got[4].tolist() == [-(2**31) + 3]  # 2**31 + 3 wraps


def test_run_on_host_bfloat8_b_output() -> None:
    pytest.importorskip("ttflow.kernels")
    b = tt.ProgramBuilder("bfp8")
    x = b.input((1, 16))
    b.output(x, tt.Layout(tensor_layout=TILE, dtype=BF8))
    row = np.array([[1.0, 0.01, -3.0, 0.5] * 4], np.float32)
    (out,) = run_on_host(b.build(), [row])
    # Shared exponent 1 (of 3.0): steps of 2**-5; 0.01 rounds to 0, the rest are exact.
    assert out.dtype == np.float32 and out.tolist() == [[1.0, 0.0, -3.0, 0.5] * 4]


def test_run_on_host_checks_its_inputs() -> None:
    p = mlp()
    with pytest.raises(tt.ProgramError, match="2 inputs"):
        run_on_host(p, [np.zeros((4, 40), np.float32)])
    with pytest.raises(tt.ShapeError, match=r"\(40, 8\)"):
        run_on_host(p, [np.zeros((4, 40), np.float32), np.zeros((8, 40), np.float32)])


# -- binaries -------------------------------------------------------------------------------------

def test_get_layout_and_binary_construction() -> None:
    binary = tt.Binary([mlp(), mlp()])
    assert tt.get_layout(binary, 0, 1) == tt.Layout(L1, TILE, BF16)
    assert tt.get_layout(binary, 1, 0) == tt.Layout(DRAM, TILE, F32)
    for pi, ii in ((2, 0), (-1, 0), (0, 2), (0, -1), ("0", 0)):
        with pytest.raises(tt.ProgramError, match="out of range"):
            tt.get_layout(binary, pi, ii)  # type: ignore[arg-type]
    with pytest.raises(tt.ProgramError):
        tt.get_layout([mlp()], 0, 0)  # type: ignore[arg-type]
    for bad in ([], [1], mlp()):
        with pytest.raises(tt.ProgramError):
            tt.Binary(bad)  # type: ignore[arg-type]


def assert_same(a: tt.Program, c: tt.Program) -> None:
    assert a.name == c.name and a.values == c.values and a.inputs == c.inputs
    assert a.steps == c.steps and a.outputs == c.outputs and a.output_specs == c.output_specs
    assert a.same_as(c)


def test_save_load_round_trip(tmp_path: Path) -> None:
    b = tt.ProgramBuilder("typed \u00e9")
    x = b.input((33,), tt.Layout(L1, ROW_MAJOR, I32))
    b.output(b.typecast(b.add(x, 3), F32), tt.Layout(dtype=BF8, tensor_layout=TILE))
    b.output(b.reshape(x, (3, 11)))
    b.output(x)
    binary = tt.Binary([mlp(), b.build()])
    path = tmp_path / "model.ttb"
    binary.save(path)
    loaded = tt.Binary.load(str(path))
    assert len(loaded.programs) == 2
    for a, c in zip(binary.programs, loaded.programs):
        assert_same(a, c)


_FLOATS = (F32, BF16, BF8)


@st.composite
def programs(draw: st.DrawFn) -> tt.Program:
    """A random small program: ops drawn at random, the ones the builder refuses skipped."""
    b = tt.ProgramBuilder(draw(st.text(min_size=1, max_size=8)))
    values: list[Value] = []
    for _ in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        dtype = draw(st.sampled_from([F32, BF16, BF8, I32, U32]))
        space, tl = draw(st.sampled_from(list(tt.MemorySpace))), draw(st.sampled_from(list(tt.TensorLayout)))
        if dtype is BF8:
            tl = TILE
        values.append(b.input(shape, tt.Layout(space, tl, dtype)))
    for _ in range(draw(st.integers(0, 8))):
        v = draw(st.sampled_from(values))
        op = draw(st.sampled_from(["add", "sub", "mul", "gt", "matmul", "relu", "neg", "gelu", "exp", "sqrt",
                                   "reciprocal", "softmax", "sum", "max", "transpose", "reshape", "typecast"]))
        try:
            if op in ("add", "sub", "mul", "gt"):
                other = draw(st.one_of(st.sampled_from(values), st.integers(-3, 3), st.floats(-2, 2)))
                values.append(getattr(b, op)(v, other))
            elif op == "matmul":
                values.append(b.matmul(v, draw(st.sampled_from(values))))
            elif op in ("softmax", "sum", "max"):
                values.append(getattr(b, op)(v, draw(st.integers(-len(v.shape), len(v.shape) - 1))))
            elif op == "reshape":
                values.append(b.reshape(v, (math.prod(v.shape),)))
            elif op == "typecast":
                values.append(b.typecast(v, draw(st.sampled_from(list(tt.DataType)))))
            else:
                values.append(getattr(b, op)(v))
        except (tt.ShapeError, tt.LayoutError):
            pass
    for v in draw(st.lists(st.sampled_from(values), min_size=1, max_size=3)):
        kinds = [d for d in tt.DataType if d.is_float == v.dtype.is_float] + [None]
        dtype = draw(st.sampled_from(kinds))
        b.output(v, tt.Layout(draw(st.sampled_from(list(tt.MemorySpace))),
                              TILE if dtype is BF8 or (dtype is None and v.dtype is BF8) else ROW_MAJOR, dtype))
    return b.build()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(programs(), min_size=1, max_size=3))
def test_random_programs_round_trip(tmp_path: Path, progs: list[tt.Program]) -> None:
    path = tmp_path / "r.ttb"
    tt.Binary(progs).save(path)
    loaded = tt.Binary.load(path).programs
    assert len(loaded) == len(progs)
    for a, c in zip(progs, loaded):
        assert_same(a, c)


def saved(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "m.ttb"
    tt.Binary([mlp()]).save(path)
    return path, path.read_bytes()


def load_bytes(path: Path, raw: bytes, match: str | None = None) -> None:
    path.write_bytes(raw)
    with pytest.raises(tt.BinaryFormatError, match=match):
        tt.Binary.load(path)


def test_header_errors(tmp_path: Path) -> None:
    path, raw = saved(tmp_path)
    assert raw[:8] == b"TTFLOWB\0" and HEADER.unpack_from(raw)[1:] == (NEWEST, len(raw) - 24, zlib.crc32(raw[24:]))
    load_bytes(path, b"PK\x03\x04" + raw[4:], "not a ttflow binary")
    load_bytes(path, b"", "not a ttflow binary")
    load_bytes(path, b"TTF", "truncated")
    load_bytes(path, raw[:8] + struct.pack("<I", NEWEST + 1) + raw[12:],
               rf"version {NEWEST + 1}.*versions 1 to {NEWEST}.*newer")
    load_bytes(path, raw[:8] + struct.pack("<I", 0) + raw[12:], rf"version 0.*versions 1 to {NEWEST}.*unknown")
    load_bytes(path, raw[:30], "truncated")
    load_bytes(path, raw + b"\0", "stray bytes")
    i = len(raw) // 2
    load_bytes(path, raw[:i] + bytes([raw[i] ^ 1]) + raw[i + 1 :], "checksum")


class CountingFileIO(io.FileIO):
    """A raw file that counts every byte read from the OS (read-ahead buffers included)."""

    opened = 0
    bytes_read = 0

    def __init__(self, path: Any) -> None:
        super().__init__(path, "r")
        CountingFileIO.opened += 1

    def readinto(self, buffer: Any) -> int | None:
        n = super().readinto(buffer)
        CountingFileIO.bytes_read += n or 0
        return n

    def readall(self) -> bytes:
        data = super().readall()
        CountingFileIO.bytes_read += len(data)
        return data

    def read(self, size: int | None = -1) -> bytes | None:
        data = super().read(size)
        CountingFileIO.bytes_read += len(data or b"")
        return data


def counting_open(monkeypatch: pytest.MonkeyPatch) -> type[CountingFileIO]:
    def fake_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        assert mode == "rb" and not args and not kwargs
        return io.BufferedReader(CountingFileIO(path))

    monkeypatch.setattr(CountingFileIO, "opened", 0)
    monkeypatch.setattr(CountingFileIO, "bytes_read", 0)
    monkeypatch.setattr(_binary, "open", fake_open, raising=False)
    return CountingFileIO


def sparse_file(path: Path, head: bytes, size: int) -> Path:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)  # a hole: costs no disk
    return path


def test_load_checks_the_header_before_reading_the_payload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before, load read the whole file first: a 64 MiB foreign file cost 64 MiB of reading.
    _, raw = saved(tmp_path)
    big = 64 << 20
    header = HEADER.unpack_from(raw)
    cases = {
        "not a ttflow binary": b"PK\x03\x04" + raw[4:],  # a zip, say
        f"version {NEWEST + 1}": raw[:8] + struct.pack("<I", NEWEST + 1) + raw[12:],
        "stray bytes": raw,  # the header's length disagrees with the file's size
        r"truncated.*header says 1099511627776": HEADER.pack(header[0], 2, 1 << 40, header[3]) + raw[24:],
    }
    counter = counting_open(monkeypatch)
    for match, head in cases.items():
        counter.bytes_read = counter.opened = 0
        path = sparse_file(tmp_path / "big.ttb", head, big)
        with pytest.raises(tt.BinaryFormatError, match=match):
            tt.Binary.load(path)
        assert counter.opened == 1 and counter.bytes_read <= 64 << 10, match  # the header's buffer
    counter.bytes_read = counter.opened = 0
    path = tmp_path / "ok.ttb"
    path.write_bytes(raw)
    assert_same(tt.Binary.load(path).programs[0], mlp())
    assert counter.opened == 1 and counter.bytes_read == len(raw)  # exactly the file, once


def test_decoding_errors_are_binary_format_errors(tmp_path: Path) -> None:
    # A valid checksum over a 400-digit integer scalar raised a bare OverflowError.
    b = tt.ProgramBuilder("scaled")
    x = b.input((3, 4))
    b.output(b.mul(x, 2.0))
    tt.Binary([b.build()]).save(tmp_path / "s.ttb")
    doc = json.loads((tmp_path / "s.ttb").read_bytes()[HEADER.size :])
    assert doc[0]["steps"][0][2] == 2.0
    path = tmp_path / "huge.ttb"
    for scalar in (10**400, -(10**400)):
        doc[0]["steps"][0][2] = scalar
        path.write_bytes(with_payload(json.dumps(doc).encode()))
        with pytest.raises(tt.BinaryFormatError, match=r"malformed.*OverflowError") as info:
            tt.Binary.load(path)
        assert isinstance(info.value.__cause__, OverflowError)  # chained, so the cause is kept
    doc[0]["steps"][0][2] = 10**20  # a large int that is a float is fine
    path.write_bytes(with_payload(json.dumps(doc).encode()))
    assert tt.Binary.load(path).programs[0].steps[0].scalar == 1e20


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_truncated_or_flipped_files(tmp_path: Path, data: st.DataObject) -> None:
    path, raw = saved(tmp_path)
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        i = data.draw(st.integers(12, len(raw) - 1))  # past magic and version
        raw = raw[:i] + bytes([raw[i] ^ data.draw(st.integers(1, 255))]) + raw[i + 1 :]
    load_bytes(path, raw)


def with_payload(payload: bytes, version: int = 2) -> bytes:
    return HEADER.pack(b"TTFLOWB\0", version, len(payload), zlib.crc32(payload)) + payload


def mlp_json(tmp_path: Path) -> list[Any]:
    """The JSON payload `save` writes for mlp(), read back from the file."""
    _, raw = saved(tmp_path)
    return json.loads(raw[HEADER.size :])


def test_valid_checksum_but_bad_payload(tmp_path: Path) -> None:
    path = tmp_path / "m.ttb"
    good = mlp_json(tmp_path)

    def edited(fn: Any) -> bytes:
        j = json.loads(json.dumps(good))
        fn(j[0])
        return json.dumps(j).encode()

    cases = {
        "not json": b"not json",
        "not utf-8": b"\xff\xfe[]",
        "not a list": b'{"a": 1}',
        "empty list": b"[]",
        "unknown op": edited(lambda p: p["steps"][0].__setitem__(0, "warp")),
        "private name": edited(lambda p: p["steps"][0].__setitem__(0, "_emit")),
        "id out of range": edited(lambda p: p["steps"][0][1].__setitem__(0, 99)),
        "reads a later value": edited(lambda p: p["steps"][0][1].__setitem__(0, 5)),
        "bool id": edited(lambda p: p["steps"][0][1].__setitem__(0, True)),
        "wrong output id": edited(lambda p: p["steps"][0].__setitem__(4, 7)),
        "bad enum": edited(lambda p: p["values"][0].__setitem__(3, "FLOAT64")),
        "bad memory": edited(lambda p: p["values"][0].__setitem__(1, "SRAM")),
        "shape mismatch": edited(lambda p: p["values"][2].__setitem__(0, [4, 9])),
        "dtype mismatch": edited(lambda p: p["values"][2].__setitem__(3, "BFLOAT16")),
        "missing key": edited(lambda p: p.pop("steps")),
        "bad attr": edited(lambda p: p["steps"][2].__setitem__(3, [["axis", "x"]])),
        "extra attr": edited(lambda p: p["steps"][1].__setitem__(3, [["axis", 0]])),
        "bad scalar": edited(lambda p: p["steps"][1].__setitem__(2, "1")),
        "output out of range": edited(lambda p: p["outputs"].__setitem__(0, 50)),
        "output spec shape": edited(lambda p: p["output_specs"][0].__setitem__(0, [1, 1])),
        "spec count": edited(lambda p: p["output_specs"].pop()),
        "num_inputs": edited(lambda p: p.__setitem__("num_inputs", 3)),
        "float shape": edited(lambda p: p["values"][0].__setitem__(0, [4.0, 40])),
        "zero dim": edited(lambda p: p["values"][0].__setitem__(0, [0, 40])),
        "extra value": edited(lambda p: p["values"].append(p["values"][0])),
        "bad step": edited(lambda p: p["steps"].__setitem__(0, 3)),
        "deep": b"[" * 100_000 + b"]" * 100_000,
    }
    for what, payload in cases.items():
        path.write_bytes(with_payload(payload))
        with pytest.raises(tt.BinaryFormatError):
            tt.Binary.load(path)
            pytest.fail(what)
    path.write_bytes(with_payload(json.dumps(good).encode()))
    assert_same(tt.Binary.load(path).programs[0], mlp())  # the edits, not the framing, failed


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 100) | st.floats(allow_nan=False) | st.text(max_size=5)
    | st.sampled_from([10**400, -(10**400), 2**64, 2**70])
    | st.sampled_from(["FLOAT32", "L1", "TILE", "add", "axis", "relu"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_payloads_raise_only_binary_format_error(tmp_path: Path, data: st.DataObject) -> None:
    """Any JSON edit of a valid program either still loads or raises BinaryFormatError."""
    doc = mlp_json(tmp_path)
    node: Any = doc[0]
    while True:  # walk down to a random container, then replace one of its items
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = data.draw(st.sampled_from(keys))
        child = node[key]
        if isinstance(child, (list, dict)) and child and data.draw(st.booleans()):
            node = child
            continue
        node[key] = data.draw(json_values)
        break
    path = tmp_path / "f.ttb"
    path.write_bytes(with_payload(json.dumps(doc).encode()))
    try:
        tt.Binary.load(path)
    except tt.BinaryFormatError:
        pass


def checked_program() -> tt.Program:
    """x * 70000 summed, range-checked; beside it the same product unchecked (it wraps)."""
    b = tt.ProgramBuilder("checked")
    x = b.input((1, 4), tt.Layout(dtype=tt.DataType.INT32))
    f = b.input((1, 4))
    with b.checking_range("int64 x * 70000"):
        total = b.sum(b.mul(x, 70000), 1)
        as_int = b.typecast(f, tt.DataType.INT32)
        halved = b.mul(f, 0.5)  # a float step: nothing to check
        kept = b.relu(x)  # selects values that fit: nothing to check
    b.output(kept)
    b.output(total)
    b.output(b.mul(x, 70000))
    b.output(as_int)
    b.output(halved)
    return b.build()


def test_range_checked_steps_fail_where_unchecked_ones_wrap() -> None:
    program = checked_program()
    assert [program.steps[v - 2].op for v, _ in program.range_checks] == ["mul", "sum", "typecast"]
    small = np.array([[1, -2, 3, 4]], np.int32)
    floats = np.array([[1.5, -2.5, 3e9 - 3e9, 7.0]], np.float32)
    kept, total, product, as_int, halved = run_on_host(program, [small, floats])
    np.testing.assert_array_equal(kept, np.maximum(small, 0))
    np.testing.assert_array_equal(total, (small.astype(np.int64) * 70000).sum(1, keepdims=True))
    np.testing.assert_array_equal(as_int, np.trunc(floats).astype(np.int32))
    np.testing.assert_array_equal(halved, floats * 0.5)
    big = np.array([[70000, 0, 0, 0]], np.int32)
    with pytest.raises(tt.ProgramError, match=r"^int64 x \* 70000: a result of mul, 4900000000, does not fit INT32"):
        run_on_host(program, [big, floats])
    # The unchecked twin wraps as the device does (numpy's int32 arithmetic is the reference).
    b = tt.ProgramBuilder("unchecked")
    b.output(b.mul(b.input((1, 4), tt.Layout(dtype=tt.DataType.INT32)), 70000))
    np.testing.assert_array_equal(run_on_host(b.build(), [big])[0], big * np.int32(70000))
    sums = np.array([[30000, 30000, 30000, 30000]], np.int32)  # each product fits; the sum does not
    with pytest.raises(tt.ProgramError, match="a result of sum, 8400000000"):
        run_on_host(program, [sums, floats])
    for bad in (3e9, np.nan, -np.inf):
        with pytest.raises(tt.ProgramError, match="does not fit INT32 .the device would saturate it"):
            run_on_host(program, [small, np.array([[1, 2, bad, 4]], np.float32)])


def test_a_checked_integer_division_by_zero_fails_where_the_device_gives_zero() -> None:
    b = tt.ProgramBuilder("divide")
    x, d = (b.input((1, 3), tt.Layout(dtype=tt.DataType.INT32)) for _ in range(2))
    with b.checking_range("int64 x // d"):
        outs = [b.floor_divide(x, d), b.remainder(x, d), b.fmod(x, d)]
        with pytest.raises(tt.ProgramError, match="integer division by zero"):
            b.floor_divide(x, 0)  # a zero scalar is known now
    for v in outs:
        b.output(v)
    b.output(b.floor_divide(x, d))  # unchecked: 0, as numpy
    program = b.build()
    xs = np.array([[7, -7, 9]], np.int32)
    got = run_on_host(program, [xs, np.array([[2, 3, -4]], np.int32)])
    ref = xs.astype(np.int64), np.array([[2, 3, -4]])
    for g, want in zip(got, (np.floor_divide(*ref), np.remainder(*ref), np.fmod(*ref), np.floor_divide(*ref))):
        np.testing.assert_array_equal(g, want)
    zero = np.array([[2, 0, -4]], np.int32)
    with pytest.raises(tt.ProgramError, match=r"^int64 x // d: integer division by zero"):
        run_on_host(program, [xs, zero])
    b = tt.ProgramBuilder("unchecked")
    x, d = (b.input((1, 3), tt.Layout(dtype=tt.DataType.INT32)) for _ in range(2))
    b.output(b.floor_divide(x, d))
    np.testing.assert_array_equal(run_on_host(b.build(), [xs, zero])[0], [[3, 0, -3]])


def test_checked_indices_out_of_range_fail_where_the_device_clamps() -> None:
    b = tt.ProgramBuilder("pick")
    table = b.input((5, 3))
    ids = b.input((1, 4), tt.Layout(dtype=tt.DataType.INT32))
    columns = b.input((5, 1), tt.Layout(dtype=tt.DataType.INT32))
    with b.checking_range("picks"):
        b.output(b.embedding(ids, table))
        b.output(b.gather(table, columns, 1))
    b.output(b.embedding(ids, table))  # unchecked: clamped, as the device does
    program = b.build()
    assert len(program.range_checks) == 2
    t = np.arange(15, dtype=np.float32).reshape(5, 3)
    ok_ids, ok_columns = np.array([[4, 0, 2, 1]], np.int32), np.array([[2], [0], [1], [1], [0]], np.int32)
    rows, picked, clamped = run_on_host(program, [t, ok_ids, ok_columns])
    np.testing.assert_array_equal(rows, t[ok_ids])
    np.testing.assert_array_equal(picked, np.take_along_axis(t, ok_columns, 1))
    np.testing.assert_array_equal(clamped, rows)
    for bad_ids, bad_columns, match in (
            (np.array([[5, 0, 2, 1]], np.int32), ok_columns, "picks: index 5 is out of range for 5 rows"),
            (np.array([[1, -1, 2, 1]], np.int32), ok_columns, "picks: index -1 is out of range for 5 rows"),
            (ok_ids, np.array([[2], [3], [1], [1], [0]], np.int32), "index 3 is out of range for 3 places along axis 1")):
        with pytest.raises(tt.ProgramError, match=match):
            run_on_host(program, [t, bad_ids, bad_columns])
    b = tt.ProgramBuilder("clamps")
    b.output(b.embedding(b.input((1, 2), tt.Layout(dtype=tt.DataType.INT32)), b.input((5, 3))))
    np.testing.assert_array_equal(run_on_host(b.build(), [np.array([[7, -1]], np.int32), t])[0], t[[[4, 0]]])


def test_checking_range_takes_a_note_and_a_binary_keeps_the_checks(tmp_path: Path) -> None:
    b = tt.ProgramBuilder("p")
    with pytest.raises(tt.ProgramError, match="note"):
        with b.checking_range(""):
            pass
    program = checked_program()
    tt.Binary([program]).save(tmp_path / "p.ttb")
    loaded = tt.Binary.load(tmp_path / "p.ttb").programs[0]
    assert loaded.same_as(program) and loaded.range_checks == program.range_checks
    payload = _binary._program_to_json(program)
    float_step = next(v for v, spec in enumerate(program.values)
                      if v >= program.num_inputs and spec.dtype is tt.DataType.FLOAT32)
    for checks, match in (([[float_step, "x"]], "a range check where none applies"),
                          ([[99, "x"]], "no step defines"),
                          ([[0, "x"]], "no step defines"),  # an input
                          ([[program.outputs[0], "x"]], "a range check where none applies")):  # relu
        with pytest.raises(tt.BinaryFormatError, match=match):
            _binary._program_from_json(dict(payload, range_checks=checks))
    # A version-4 file has no range checks, whatever its payload says.
    assert _binary._program_from_json(payload, version=4).range_checks == ()
