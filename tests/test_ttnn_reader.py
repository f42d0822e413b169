"""Reading tt-mlir binaries: structure, layouts and locations from the file, typed errors for a
foreign schema, a truncated or corrupted file, an op ttflow cannot run; and a fuzz of mutated
corpus binaries (every mutant a typed error or a program, never another exception)."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ttflow as tt
from ttflow.ttnn import mlir
from ttflow.ttnn.reader import read_ttnn
from ttflow.ttnn.schema import SCHEMAS

CORPUS = Path(__file__).parent / "data" / "ttnn"
HASH = "912b70aa54f878b01d094638d22c35ee6e20c7e7f1813913242a47e7f79c9bd2"


def corpus(name: str) -> bytes:
    return (CORPUS / f"{name}.ttnn").read_bytes()


def test_programs_names_and_order_are_the_files() -> None:
    file = read_ttnn(corpus("attention"))
    names = [p.name for p in file.programs]
    assert names[0] == "main" and names[1:] == [f"main_const_eval_{i}" for i in range(len(names) - 1)]
    assert [p.private for p in file.programs] == [False] + [True] * (len(names) - 1)
    binary = tt.Binary.load(CORPUS / "attention.ttnn")
    assert [p.name for p in binary.programs] == names


def test_layouts_come_from_the_file() -> None:
    binary = tt.Binary.load(CORPUS / "int_ops.ttnn")
    file = read_ttnn(corpus("int_ops"))
    a, _ = file.programs[0].inputs
    assert (a.shape, a.data_type, a.buffer, a.tiled, a.name) == ((32, 32), "si32", "dram", False, "a")
    assert tt.get_layout(binary, 0, 0) == tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.ROW_MAJOR, tt.DataType.INT32)
    out = file.programs[0].outputs[0]
    assert (out.buffer, out.tiled, out.data_type) == ("dram", True, "si32")
    assert binary.programs[0].output_specs[0].layout == tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, tt.DataType.INT32)


def test_every_op_keeps_its_location() -> None:
    file = read_ttnn(corpus("mlp"))
    linear = [op for op in file.programs[0].ops if op.name == "ttnn.linear"]
    assert len(linear) == 2
    assert all("make_corpus.py:" in op.source for op in linear)
    # and the translated program carries them: its steps' locations name the JAX source line
    program = tt.Binary.load(CORPUS / "mlp.ttnn").programs[0]
    assert any("make_corpus.py:" in loc and "jit(mlp)" in loc for _, loc in program.locations)


def test_a_ttflow_binary_still_loads_beside(tmp_path: Path) -> None:
    b = tt.ProgramBuilder("p")
    x = b.input((32, 32))
    b.output(b.relu(x))
    path = tmp_path / "own.ttb"
    tt.Binary([b.build()]).save(path)
    assert tt.Binary.load(path).programs[0].name == "p"
    assert tt.Binary.from_bytes(path.read_bytes()).programs[0].name == "p"
    assert tt.Binary.from_bytes(corpus("mlp")).programs[0].name == "main"


def _replace(data: bytes, old: bytes, new: bytes) -> bytes:
    assert len(old) == len(new) and old in data
    return data.replace(old, new, 1)


def test_another_schema_hash_is_refused_naming_both() -> None:
    data = _replace(corpus("mlp"), HASH.encode(), b"0" * 64)
    with pytest.raises(tt.BinaryFormatError, match="schema '0{64}'.*" + HASH):
        tt.Binary.from_bytes(data)


def test_truncated_and_stray_bytes_are_refused() -> None:
    data = corpus("mlp")
    with pytest.raises(tt.BinaryFormatError, match="truncated"):
        tt.Binary.from_bytes(data[:-100])
    with pytest.raises(tt.BinaryFormatError, match="stray"):
        tt.Binary.from_bytes(data + b"\0" * 8)


def test_an_op_ttflow_cannot_run_is_refused_at_load_by_name() -> None:
    """`ttnn.mish` is a member of the unary table (so the file is well formed) with no translation."""
    data = _replace(corpus("mlp"), b'"ttnn.relu"', b'"ttnn.mish"')
    with pytest.raises(tt.ProgramError, match=r"cannot run ttnn\.mish.*make_corpus\.py:\d+.*\n.*ttnn\.mish"):
        tt.Binary.from_bytes(data)


def test_an_attribute_no_translation_reads_is_refused() -> None:
    """An attribute a translation does not know might change the value: refused, not ignored."""
    data = _replace(corpus("mlp"), b"numericStable = true", b"numericStabXe = true")
    with pytest.raises(tt.ProgramError, match=r"cannot run ttnn\.softmax.*\['numericStabXe'\]"):
        tt.Binary.from_bytes(data)


def test_a_tag_and_a_text_that_disagree_are_a_format_error() -> None:
    """The op's union tag says unary, its text says sum: decoded by neither alone."""
    data = _replace(corpus("mlp"), b'"ttnn.relu"', b'"ttnn.sum" ')
    with pytest.raises(tt.BinaryFormatError, match=r"union member 47 \(EltwiseUnaryOp\).*names ttnn\.sum"):
        tt.Binary.from_bytes(data)


def test_mlir_text_parses_results_operands_attributes_and_layouts() -> None:
    op = mlir.parse_op(
        '%values, %indices = "ttnn.sort"(%0) <{descending = false, dim = 1 : si8, stable = true}> : '
        "(tensor<16x64xf32, #ttnn.ttnn_layout<(d0, d1) -> (d0, d1), <1x1>, memref<1x2x!ttcore.tile<32x32, f32>, "
        "#ttnn.buffer_type<dram>>, <interleaved>>>) -> (tensor<16x64xf32, #ttnn.ttnn_layout<(d0, d1) -> (d0, d1), "
        "<1x1>, memref<16x64xf32, #ttnn.buffer_type<l1>>, <height_sharded>>>, tensor<16x64xui16>) loc(\"x\")"
    )
    assert op.name == "ttnn.sort" and op.results == ("%values", "%indices") and op.operands == ("%0",)
    assert mlir.attr_int(op, "dim") == 1 and mlir.attr_bool(op, "descending") is False
    (t,) = op.operand_types
    assert (t.shape, t.element, t.buffer, t.tiled, t.tile_element, t.memory_layout, t.grid, t.shard) == (
        (16, 64), "f32", "dram", True, "f32", "interleaved", (1, 1), (1, 2))
    r0, r1 = op.result_types
    assert (r0.buffer, r0.tiled, r0.memory_layout, r0.shard) == ("l1", False, "height_sharded", (16, 64))
    assert (r1.shape, r1.element, r1.buffer) == ((16, 64), "ui16", None)


def test_mlir_attribute_forms() -> None:
    op = mlir.parse_op(
        '%1 = "ttnn.x"(%0) <{a = [1 : i32, -2 : i32], b = array<i64: 3, 4>, c = #ttnn.shape<1x32>, '
        "d = 9.99999974E-6 : f32, e = 0x7FC00000 : f32, f = #ttnn<mesh_shape 1x1>}> : (tensor<2xf32>) -> tensor<2xf32>"
    )
    assert mlir.attr_ints(op, "a") == [1, -2] and mlir.attr_ints(op, "b") == [3, 4]
    assert mlir.attr_ints(op, "c") == [1, 32]
    assert mlir.attr_float(op, "d") == pytest.approx(1e-5)
    value = mlir.attr_float(op, "e")
    assert math.isnan(value)  # NaN, printed as its bits
    with pytest.raises(tt.BinaryFormatError):
        mlir.attr_ints(op, "f")
    with pytest.raises(tt.BinaryFormatError, match="no attribute 'g'"):
        mlir.attr_int(op, "g")


@pytest.mark.parametrize("text", ["", "not an op", '%1 = "ttnn.x"(%0', '%1 = "ttnn.x"(%0) : (tensor<2xf32>)',
                                  '%1 = "ttnn.x"(%0, %2) : (tensor<2xf32>) -> tensor<2xf32>'])
def test_malformed_mlir_text_is_a_format_error(text: str) -> None:
    with pytest.raises(tt.BinaryFormatError):
        mlir.parse_op(text)


def test_the_schema_table_knows_the_plugins_hash() -> None:
    assert HASH in SCHEMAS and SCHEMAS[HASH].producer == "jax-tt-plugin 0.1.3"


_SMALL = ["mlp", "reductions", "cumsum_sort", "layer_norm"]


@settings(max_examples=60)
@given(st.sampled_from(_SMALL), st.data())
def test_mutated_binaries_are_typed_errors_or_programs(name: str, data: st.DataObject) -> None:
    raw = bytearray(corpus(name))
    kind = data.draw(st.sampled_from(["flip", "truncate", "offset"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:  # a u32 somewhere (offsets, lengths, vtable entries) pointed anywhere
        i = data.draw(st.integers(0, len(raw) - 4)) & ~3
        struct.pack_into("<I", raw, i, data.draw(st.integers(0, 2**32 - 1)))
    try:
        binary = tt.Binary.from_bytes(bytes(raw))
    except (tt.BinaryFormatError, tt.ProgramError):
        return
    assert binary.programs


def test_what_the_compiler_emits_and_ttflow_cannot_run_is_refused_by_name() -> None:
    """A `jax.lax.pmax` over a mesh: an all_reduce taking the maximum (ttflow's collectives sum)."""
    with pytest.raises(tt.ProgramError, match=r"cannot run ttnn\.all_reduce .*reduce_type #ttcore\.reduce_type<max>"):
        tt.Binary.load(CORPUS / "refused" / "n300_pmax.ttnn")
