"""`constant` (format version 10): any array as a program's value (tt-mlir's `ttnn.constant`),
checked against numpy on the host reference and on a device, through a saved file; refused by
a version-9 file and for values its dtype cannot hold."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from reference import as_format_version

import ttflow as tt
from ttflow._ir.interpreter import run_on_host

F32, BF16, I32, U32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.INT32, tt.DataType.UINT32


def _program(values: np.ndarray, dtype: tt.DataType) -> tt.Program:
    b = tt.ProgramBuilder("constant")
    x = b.input(values.shape, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, dtype))
    b.output(b.add(x, b.constant(values, dtype)))
    return b.build()


@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9),
                  elements=st.floats(width=32, allow_nan=True, allow_infinity=True)))
def test_a_float_constant_is_its_values(values: np.ndarray) -> None:
    (out,) = run_on_host(_program(values, F32), [np.zeros(values.shape, np.float32)])
    np.testing.assert_array_equal(out, values)


@given(hnp.arrays(np.int64, hnp.array_shapes(min_dims=1, max_dims=2, max_side=9),
                  elements=st.integers(-(2**31), 2**31 - 1)))
def test_an_int32_constant_is_its_values(values: np.ndarray) -> None:
    (out,) = run_on_host(_program(values, I32), [np.zeros(values.shape, np.int32)])
    np.testing.assert_array_equal(out, values.astype(np.int32))


@pytest.mark.anyio
async def test_a_constant_runs_on_a_device_and_through_a_saved_file(tmp_path: Path) -> None:
    values = np.linspace(-3, 3, 40 * 33, dtype=np.float32).reshape(40, 33)
    path = tmp_path / "constant.ttb"
    tt.Binary([_program(values, BF16)]).save(path)
    binary = tt.Binary.load(path)
    async with tt.open_device() as device:
        x = tt.to_device(np.ones(values.shape, np.float32), device, tt.get_layout(binary, 0, 0))
        (y,) = tt.submit(device, binary, 0, [x])
        got = (await tt.to_host(y)).astype(np.float32)
    import ml_dtypes

    # the constant rounded to bfloat16, then 1 + it rounded again: the device's bf16 arithmetic
    want = (values.astype(ml_dtypes.bfloat16).astype(np.float32) + 1).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def test_a_version_9_file_cannot_name_constant(tmp_path: Path) -> None:
    path = tmp_path / "constant.ttb"
    tt.Binary([_program(np.ones((2, 2), np.float32), F32)]).save(path)
    raw = path.read_bytes()
    assert struct.unpack_from("<I", raw, 8)[0] >= 10  # save writes the newest version, at least constant's
    path.write_bytes(as_format_version(raw, 9))
    with pytest.raises(tt.BinaryFormatError, match="constant is not an op of format version 9"):
        tt.Binary.load(path)


def test_constant_refuses_what_its_dtype_cannot_hold() -> None:
    b = tt.ProgramBuilder("p")
    with pytest.raises(tt.LayoutError, match="does not fit UINT32"):
        b.constant(np.array([-1]), U32)
    with pytest.raises(tt.LayoutError, match="integral"):
        b.constant(np.array([1.5]), I32)
    with pytest.raises(tt.LayoutError, match="BFLOAT8_B"):
        b.constant(np.array([np.nan]), tt.DataType.BFLOAT8_B)
    with pytest.raises(tt.ShapeError):
        b.constant(np.float32(3.0))  # rank 0
    with pytest.raises(tt.ProgramError, match="numbers"):
        b.constant(np.array(["a"]))
