"""The MLIR op-text parser, as a property: texts generated in the compiler's printed form (names,
operands, nested attribute values, tensor types with layouts, locations) parse back to what made
them; any corruption of one is a BinaryFormatError or a parse, never another exception."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

import ttflow as tt
from ttflow.ttnn import mlir

NAMES = st.from_regex(r"%(?:[0-9]{1,3}|arg[0-9]|[a-z]{1,8}(?:_[0-9])?)", fullmatch=True)
ELEMENTS = st.sampled_from(["f32", "bf16", "si32", "ui32", "ui16"])
BUFFERS = st.sampled_from(["dram", "l1", "system_memory"])


@st.composite
def tensor_types(draw: st.DrawFn) -> tuple[str, tuple[int, ...], str, str, bool]:
    shape = tuple(draw(st.lists(st.integers(1, 300), min_size=0, max_size=4)))
    element, buffer, tiled = draw(ELEMENTS), draw(BUFFERS), draw(st.booleans())
    rank = max(len(shape), 1)
    dims = ", ".join(f"d{i}" for i in range(rank))
    page = f"!ttcore.tile<32x32, {element}>" if tiled else element
    text = (f"tensor<{''.join(f'{d}x' for d in shape)}{element}, #ttnn.ttnn_layout<({dims}) -> ({dims}), <1x1>, "
            f"memref<2x3x{page}, #ttnn.buffer_type<{buffer}>>, <interleaved>>>")
    return text, shape, element, buffer, tiled


ATOMS = st.one_of(
    st.integers(-(2**40), 2**40).map(lambda v: f"{v} : si32"),
    st.sampled_from(["true", "false", "1.000000e+00 : f32", "0x7FC00000 : f32", "#ttcore.reduce_type<sum>"]),
    st.lists(st.integers(-99, 99), max_size=5).map(lambda v: f"array<i64: {', '.join(map(str, v))}>"),
    st.lists(st.integers(-99, 99), max_size=5).map(lambda v: "[" + ", ".join(f"{x} : i32" for x in v) + "]"),
    st.text(st.sampled_from("ab(){}<>[],= "), max_size=12).map(lambda t: '"' + t + '"'),
    # strings holding where an attribute block most often ends (the parser's shortcut)
    st.sampled_from(['"x}> : y"', '"q\\" }> : (a) -> b"']),
)
VALUES = st.recursive(ATOMS, lambda inner: st.lists(inner, max_size=3).map(
    lambda v: "#ttnn.cfg<" + ", ".join(f"k{i} = {x}" for i, x in enumerate(v)) + ">"), max_leaves=6)


@given(st.lists(NAMES, min_size=0, max_size=3, unique=True), st.lists(NAMES, max_size=4),
       st.dictionaries(st.from_regex(r"[a-z][a-z_]{0,10}", fullmatch=True), VALUES, max_size=4),
       st.data())
def test_a_printed_op_parses_back(results: list[str], operands: list[str], attributes: dict[str, str],
                                  data: st.DataObject) -> None:
    in_types = [data.draw(tensor_types()) for _ in operands]
    out_types = [data.draw(tensor_types()) for _ in results]
    head = f"{', '.join(results)} = " if results else ""
    attrs = ("<{" + ", ".join(f"{k} = {v}" for k, v in attributes.items()) + "}> ") if attributes else ""
    outs = ", ".join(t for t, *_ in out_types)
    text = (f'{head}"ttnn.op_x"({", ".join(operands)}) {attrs}: ({", ".join(t for t, *_ in in_types)}) -> '
            f'{"(" + outs + ")" if len(out_types) != 1 else outs} loc("f.py":1:2)')
    op = mlir.parse_op(text)
    assert op.name == "ttnn.op_x" and op.results == tuple(results) and op.operands == tuple(operands)
    assert op.attributes == attributes
    for parsed, (_, shape, element, buffer, tiled) in zip((*op.operand_types, *op.result_types),
                                                          (*in_types, *out_types), strict=True):
        assert (parsed.shape, parsed.element, parsed.buffer, parsed.tiled) == (shape, element, buffer, tiled)


@given(st.data())
def test_a_corrupted_op_text_is_a_format_error_or_a_parse(data: st.DataObject) -> None:
    text, *_ = data.draw(tensor_types())
    good = f'%1 = "ttnn.add"(%0, %arg1) <{{dim = [1 : i32], cfg = #ttnn.c<a = <b = 1>>}}> : ({text}, {text}) -> {text}'
    chars = list(good)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(chars) - 1))
        chars[i] = data.draw(st.sampled_from(list("()<>[]{}\",=%:- ax0")))
    try:
        mlir.parse_op("".join(chars))
    except tt.BinaryFormatError:
        pass
