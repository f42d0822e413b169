"""The program builder's checks, and the binary file format."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ttflow as tt

F32, BF16, I32, U32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.INT32, tt.DataType.UINT32
TILE = tt.TensorLayout.TILE


def mlp() -> tt.Program:
    b = tt.ProgramBuilder("mlp")
    x = b.input((4, 40))
    w = b.input((40, 8), tt.Layout(tt.MemorySpace.L1, TILE, BF16))
    h = b.gelu(b.matmul(x, w))
    b.output(b.softmax(h), tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.ROW_MAJOR))
    b.output(b.sum(b.transpose(h), axis=-1))
    return b.build()


def test_shapes_and_dtypes_are_inferred() -> None:
    p = mlp()
    assert [s.shape for s in p.inputs] == [(4, 40), (40, 8)]
    assert p.inputs[0].layout == tt.Layout(tt.MemorySpace.DRAM, TILE, F32)  # the default
    assert [s.shape for s in p.output_specs] == [(4, 8), (8, 1)]
    assert [s.dtype for s in p.output_specs] == [F32, F32]  # float32 wins over bfloat16
    assert p.output_specs[1].layout == tt.Layout(tt.MemorySpace.DRAM, TILE, F32)
    assert [s.op for s in p.steps] == ["matmul", "gelu", "softmax", "transpose", "sum"]
    assert "mlp" in repr(p) and "steps" in repr(p)


def test_broadcasting_and_scalars() -> None:
    b = tt.ProgramBuilder("bcast")
    x, bias = b.input((2, 3, 5)), b.input((1, 5))
    w = b.input((5, 7))
    y = b.add(x, bias)
    assert y.shape == (2, 3, 5)
    assert b.mul(y, 2).shape == (2, 3, 5) and b.mul(y, 2).dtype is F32
    assert b.matmul(y, w).shape == (2, 3, 7)
    assert b.transpose(y).shape == (2, 5, 3)


def test_build_time_errors() -> None:
    b = tt.ProgramBuilder("bad")
    x, i, u = b.input((3, 4)), b.input((3, 4), tt.Layout(dtype=I32)), b.input((3, 4), tt.Layout(dtype=U32))
    with pytest.raises(tt.ShapeError, match="broadcast"):
        b.add(x, b.transpose(x))
    with pytest.raises(tt.ShapeError, match="inner"):
        b.matmul(x, x)
    with pytest.raises(tt.LayoutError, match="INT32"):
        b.add(x, i)
    with pytest.raises(tt.LayoutError):
        b.add(i, u)
    with pytest.raises(tt.LayoutError, match="float"):
        b.exp(i)
    with pytest.raises(tt.ShapeError, match="axis"):
        b.sum(x, axis=2)
    other = tt.ProgramBuilder("other").input((3, 4))
    with pytest.raises(tt.ProgramError, match="another program"):
        b.add(x, other)
    with pytest.raises(tt.ProgramError, match="before the first op"):
        b.input((1,))
    with pytest.raises(tt.ProgramError, match="no outputs"):
        tt.ProgramBuilder("empty").build()
    with pytest.raises(tt.LayoutError):
        b.output(i, tt.Layout(dtype=F32))
    b.output(b.relu(i))
    b.build()
    with pytest.raises(tt.ProgramError, match="already built"):
        b.relu(x)
    r = tt.ProgramBuilder("r")
    with pytest.raises(tt.ShapeError, match="rank"):
        r.transpose(r.input((4,)))
    with pytest.raises(tt.ShapeError, match="element counts"):
        r.reshape(r.input((4, 6)), (5, 5))


def test_get_layout() -> None:
    binary = tt.Binary([mlp()])
    assert tt.get_layout(binary, 0, 1) == tt.Layout(tt.MemorySpace.L1, TILE, BF16)
    with pytest.raises(tt.ProgramError):
        tt.get_layout(binary, 1, 0)
    with pytest.raises(tt.ProgramError):
        tt.get_layout(binary, 0, 2)
    with pytest.raises(tt.ProgramError):
        tt.Binary([])


def test_save_load_round_trip(tmp_path: Path) -> None:
    b = tt.ProgramBuilder("typed")
    x = b.input((33,), tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.ROW_MAJOR, I32))
    b.output(b.typecast(b.add(x, 3), F32), tt.Layout(dtype=tt.DataType.BFLOAT8_B, tensor_layout=TILE))
    b.output(b.reshape(x, (3, 11)))
    binary = tt.Binary([mlp(), b.build()])
    path = tmp_path / "model.ttb"
    binary.save(path)
    loaded = tt.Binary.load(path)
    assert len(loaded.programs) == 2
    for a, c in zip(binary.programs, loaded.programs):
        assert a.same_as(c)


@settings(max_examples=30)
@given(data=st.data())
def test_corrupt_files_raise_binary_format_error(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    path = tmp_path_factory.mktemp("bin") / "m.ttb"
    tt.Binary([mlp()]).save(path)
    raw = path.read_bytes()
    kind = data.draw(st.sampled_from(["truncate", "flip", "magic", "version"]))
    if kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "flip":
        i = data.draw(st.integers(24, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ 0x5A]) + raw[i + 1 :]
    elif kind == "magic":
        raw = b"PK\x03\x04" + raw[4:]
    else:
        raw = raw[:8] + struct.pack("<I", 99) + raw[12:]
    path.write_bytes(raw)
    with pytest.raises(tt.BinaryFormatError):
        tt.Binary.load(path)


def test_valid_checksum_but_bad_schema(tmp_path: Path) -> None:
    import json
    import zlib

    for payload in (b"not json", json.dumps([{"name": "x"}]).encode(),
                    json.dumps([{"name": "x", "num_inputs": 0, "values": [], "steps": [["warp", [0], None, [], 0]],
                                 "outputs": [], "output_specs": []}]).encode()):
        path = tmp_path / "m.ttb"
        path.write_bytes(struct.pack("<8sIQI", b"TTFLOWB\0", 1, len(payload), zlib.crc32(payload)) + payload)
        with pytest.raises(tt.BinaryFormatError):
            tt.Binary.load(path)
