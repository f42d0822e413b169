"""`clamp` (format version 9), the op added as one record in its family's file: checked against
torch.clamp on the CPU (numpy's minimum of maximum where torch is absent), on the host reference
and on a device, through a saved file, and refused by a version-8 file and on bad bounds."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from reference import as_format_version

import ttflow as tt
from ttflow._ir.interpreter import run_on_host

F32, BF16, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.INT32

pytestmark = pytest.mark.anyio


def _reference(x: np.ndarray, low: float | None, high: float | None) -> np.ndarray:
    """torch.clamp on the CPU (numpy's minimum of maximum without torch: the same rule)."""
    try:
        import torch
    except ModuleNotFoundError:
        out = x if low is None else np.maximum(x, x.dtype.type(low))
        return out if high is None else np.minimum(out, x.dtype.type(high))
    return torch.clamp(torch.from_numpy(x), min=low, max=high).numpy()


def _program(shape: tuple[int, ...], dtype: tt.DataType, low: float | None, high: float | None) -> tt.Program:
    b = tt.ProgramBuilder("clamp")
    x = b.input(shape, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, dtype))
    b.output(b.clamp(x, low, high))
    return b.build()


bounds = st.one_of(st.none(), st.floats(-4, 4, width=32))


@settings(deadline=None)
@given(x=hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=40),
                    elements=st.floats(-8, 8, width=32) | st.just(float("nan"))),
       low=bounds, high=bounds)
def test_clamp_is_torch_s_on_floats(x: np.ndarray, low: float | None, high: float | None) -> None:
    if low is None and high is None:
        with pytest.raises(tt.ProgramError, match="min, max or both"):
            _program(x.shape, F32, low, high)
        return
    (got,) = run_on_host(_program(x.shape, F32, low, high), [x])
    np.testing.assert_array_equal(got, _reference(x, low, high))  # NaN where x is NaN, as torch


@settings(deadline=None)
@given(x=hnp.arrays(np.int32, (5, 7), elements=st.integers(-100, 100)),
       low=st.integers(-50, 50), high=st.integers(-50, 50))
def test_clamp_is_torch_s_on_integers_even_when_min_exceeds_max(x: np.ndarray, low: int, high: int) -> None:
    (got,) = run_on_host(_program(x.shape, I32, low, high), [x])
    np.testing.assert_array_equal(got, _reference(x, low, high))


async def test_clamp_runs_on_a_device_and_through_a_saved_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 96)) * 3).astype(np.float32)
    binary = tt.Binary([_program(x.shape, BF16, -1.5, 2.0)])
    path = tmp_path / "clamp.ttb"
    binary.save(path)
    loaded = tt.Binary.load(path)
    want = _reference(x.astype(tt.DataType.BFLOAT16.host_dtype).astype(np.float32), -1.5, 2.0)
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        (out,) = tt.submit(device, loaded, 0, [tt.to_device(x, device)])
        got = await tt.to_host(out)
    np.testing.assert_array_equal(got.astype(np.float32), want)


def test_a_version_8_file_cannot_name_clamp(tmp_path: Path) -> None:
    path = tmp_path / "clamp.ttb"
    tt.Binary([_program((4, 4), F32, 0.0, None)]).save(path)
    raw = path.read_bytes()
    assert struct.unpack_from("<I", raw, 8)[0] >= 9  # save writes the newest version, at least clamp's
    path.write_bytes(as_format_version(raw, 8))
    with pytest.raises(tt.BinaryFormatError, match="clamp is not an op of format version 8"):
        tt.Binary.load(path)
    assert "clamp" in json.dumps(json.loads(raw[24:]))


def test_clamp_checks_its_bounds() -> None:
    b = tt.ProgramBuilder("p")
    i = b.input((4,), tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, I32))
    with pytest.raises(tt.LayoutError, match="integral"):
        b.clamp(i, 0.5)
    with pytest.raises(tt.ProgramError, match="NaN"):
        b.clamp(i, float("nan"))
    v = b.clamp(i, 1, loc="model.py:3")
    b.output(v)
    assert b.build().locations == ((v.id, "model.py:3"),)
