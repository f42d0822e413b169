"""The MLIR text of one TTNN op, parsed: its results, name, operands, attributes and types.

Every operation in a tt-mlir binary carries its own MLIR text (the `debug_info` string the
compiler prints from the module), and that text is the one description of an op that does not
change with the flatbuffer schema: its name, its attributes with their values and every operand's
and result's type with its layout (`#ttnn.ttnn_layout<...>`: buffer type, tile or row-major, data
type, interleaved or sharded). ttflow decodes an op from it, and checks it against the union tag
the flatbuffer gives (`schema.py`), so neither source alone decides.

The grammar is MLIR's generic form as the compiler prints it:

    %r = "ttnn.add"(%a, %b) <{attr = value, ...}> : (type, type) -> type loc(...)
    %values, %indices = "ttnn.sort"(%x) <{...}> : (type) -> (type, type)
    %0 = ttcore.load_cached(@main_const_eval_0, [%arg1]) : (type) -> type
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any, final

import attrs

from .._errors import BinaryFormatError

__all__ = [
    "MlirOp",
    "TensorType",
    "attr_bool",
    "attr_float",
    "attr_int",
    "attr_ints",
    "attr_shape",
    "parse_op",
    "parse_type",
    "split_top",
]

_NAME = r"%[A-Za-z0-9_$.#-]+"
_SSA_NAME = re.compile(_NAME)
_HEAD = re.compile(
    rf"^\s*(?:(?P<results>{_NAME}(?::\d+)?(?:\s*,\s*{_NAME})*)\s*=\s*)?"
    r'(?:"(?P<quoted>[\w.]+)"|(?P<bare>[a-z_]+\.[\w.]+))\s*\('
)
_OPEN = {"(": ")", "[": "]", "{": "}", "<": ">"}
_CLOSE = {v: k for k, v in _OPEN.items()}


@final
@attrs.frozen
class TensorType:
    """An operand's or a result's type: `tensor<32x64xf32, #ttnn.ttnn_layout<...>>` with its shape,
    element type and what its layout says; `!ttnn.device` and the like have `shape=None`."""

    text: str
    shape: tuple[int, ...] | None = None
    element: str | None = None  # "f32", "bf16", "si32", "ui32", "ui16", "i1", ...
    buffer: str | None = None  # "dram", "l1", "system_memory"; None when the layout leaves it out
    tiled: bool = False  # the layout's memref holds !ttcore.tile<32x32, ...> pages
    tile_element: str | None = None  # the tile's data type (bfp_bf8 where the element is bf16)
    memory_layout: str | None = None  # "interleaved", "height_sharded", "width_sharded", "block_sharded"
    grid: tuple[int, ...] | None = None  # the layout's core grid (<1x1> for interleaved)
    shard: tuple[int, ...] | None = None  # the memref's shape: per-core shard (tiles or elements)


@final
@attrs.frozen
class MlirOp:
    """One op's text, parsed. `attributes` keeps each value's text; the `attr_*` helpers read it."""

    name: str  # "ttnn.add", "ttcore.load_cached"
    results: tuple[str, ...]
    operands: tuple[str, ...]
    attributes: dict[str, str]
    operand_types: tuple[TensorType, ...]
    result_types: tuple[TensorType, ...]
    callee: str | None = None  # load_cached's function
    text: str = ""


# The characters the bracket walk stops at: quotes, brackets, separators, and the arrows and
# comparisons whose '>' closes nothing. A regex finds them; the text between is skipped at C speed.
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SPECIAL = re.compile(r'"(?:[^"\\]|\\.)*"|->|>=|[-=]<|[()\[\]{}<>,]')


def _match(text: str, start: int) -> int:
    """The index just past the bracket group opening at `start` (strings skipped)."""
    stack: list[str] = []
    for m in _SPECIAL.finditer(text, start):
        token = m.group()
        c = token[-1] if len(token) == 2 and token[0] in "-=" and token[1] == "<" else token
        if token[0] == '"' or token in ("->", ">=") or len(token) == 2:
            continue
        if c in _OPEN:
            stack.append(c)
        elif c in _CLOSE:
            if not stack or stack[-1] != _CLOSE[c]:
                raise BinaryFormatError(f"unbalanced {c!r} at {m.start()} in MLIR text {text[:200]!r}")
            stack.pop()
            if not stack:
                return m.end()
    raise BinaryFormatError(f"unclosed {text[start]!r} at {start} in MLIR text {text[:200]!r}")


def _top_level(text: str) -> Iterator[re.Match[str]]:
    """The separators, arrows and comparisons of `text` outside every bracket and string."""
    depth = 0
    for m in _SPECIAL.finditer(text):
        token = m.group()
        if token[0] == '"':
            continue
        if token in _OPEN:
            depth += 1
        elif token in _CLOSE:
            depth -= 1
        elif depth == 0:
            yield m


def split_top(text: str, sep: str = ",") -> list[str]:
    """`text` split at `sep` outside brackets and strings, each part stripped, empty ones dropped."""
    parts, start = [], 0
    for m in _top_level(text):
        if m.group() == sep:
            parts.append(text[start:m.start()].strip())
            start = m.end()
    parts.append(text[start:].strip())
    return [p for p in parts if p]


@functools.lru_cache(maxsize=4096)  # ops of one kind and shape repeat their attributes
def _attribute_block(block: str) -> dict[str, str] | None:
    """`<{...}>`'s attributes (the caller copies the dict), or None when the text is not one
    whole bracket group."""
    if '"' in _STRING.sub("", block):
        return None  # cut inside a string
    try:
        whole = _match(block, 0) == len(block)
    except BinaryFormatError:  # cut inside a bracket group: the walk decides
        whole = False
    return _attributes(block[2:-2]) if whole else None


def _attributes(text: str) -> dict[str, str]:
    out = {}
    for part in split_top(text):
        key, eq, value = part.partition("=")
        out[key.strip()] = value.strip() if eq else "unit"
    return out


_TENSOR = re.compile(r"^tensor<(?P<dims>(?:\d+x)*)(?P<element>[a-z]+\d*)\s*(?:,\s*(?P<layout>.*))?>$", re.DOTALL)
_MEMREF = re.compile(r"memref<(?P<shard>(?:\d+x)*)(?P<rest>.*)>\s*$", re.DOTALL)
_BUFFER = re.compile(r"#ttnn\.buffer_type<(\w+)>")
_TILE = re.compile(r"!ttcore\.tile<\d+x\d+,\s*(\w+)>")
_MEMLAYOUT = re.compile(r"<(interleaved|height_sharded|width_sharded|block_sharded|nd_sharded)>")


@functools.lru_cache(maxsize=4096)  # a program repeats a few types many times
def parse_type(text: str) -> TensorType:
    """A type's text, read: shape, element, and the layout's buffer, tiling, grid and shard."""
    text = text.strip()
    m = _TENSOR.match(text)
    if not m:
        return TensorType(text)
    shape = tuple(int(d) for d in m["dims"].split("x") if d)
    layout = m["layout"] or ""
    buffer = _BUFFER.search(layout)
    tile = _TILE.search(layout)
    mem = _MEMLAYOUT.search(layout)
    grid = shard = None
    if layout.startswith("#ttnn.ttnn_layout<"):
        parts = split_top(layout[len("#ttnn.ttnn_layout<"):-1])
        for part in parts:
            if re.fullmatch(r"<\d+(?:x\d+)*>", part) and grid is None:
                grid = tuple(int(d) for d in part[1:-1].split("x"))
            mm = _MEMREF.match(part)
            if mm:
                shard = tuple(int(d) for d in mm["shard"].split("x") if d)
    return TensorType(
        text, shape, m["element"], buffer[1] if buffer else None, tile is not None,
        tile[1] if tile else None, mem[1] if mem else None, grid, shard,
    )


def _top_arrow(signature: str) -> int | None:
    """Where the signature's own `->` is (not one inside a layout's affine map)."""
    return next((m.start() for m in _top_level(signature) if m.group() == "->"), None)


@functools.lru_cache(maxsize=4096)  # whole signatures repeat too: a program's ops share a few
def _signature(signature: str) -> tuple[tuple[TensorType, ...], tuple[TensorType, ...]] | None:
    """An op's `(operand types) -> result types`, read; None without a top-level arrow."""
    arrow = _top_arrow(signature)
    if arrow is None:
        return None
    return _types(signature[:arrow]), _types(signature[arrow + 2:])


@functools.lru_cache(maxsize=4096)  # signatures repeat: the same shapes and layouts
def _types(text: str) -> tuple[TensorType, ...]:
    text = text.strip()
    if text.startswith("(") and _match(text, 0) == len(text):
        text = text[1:-1]
    # Most lists are tensor types only: split where the next one starts (no layout holds
    # "tensor<"), each part checked to be one whole `tensor<...>` (once per type text); any
    # other list (a `!ttnn.device` among them) is walked.
    parts = _NEXT_TENSOR.split(text)
    if not all(_one_tensor(p) for p in parts):
        parts = split_top(text)
    return tuple(parse_type(t) for t in parts)


_NEXT_TENSOR = re.compile(r",\s*(?=tensor<)")


@functools.lru_cache(maxsize=4096)
def _one_tensor(text: str) -> bool:
    """Whether `text` is one `tensor<...>` bracket group, whole."""
    try:
        return text.startswith("tensor<") and _match(text, 6) == len(text)
    except BinaryFormatError:
        return False


def parse_op(text: str) -> MlirOp:
    """One op's MLIR text, parsed; BinaryFormatError naming the text when it is not an op."""
    if not isinstance(text, str) or not text.strip():
        raise BinaryFormatError("an operation carries no MLIR text (ttflow decodes ops by it)")
    m = _HEAD.match(text)
    if not m:
        raise BinaryFormatError(f"not an MLIR operation: {text[:200]!r}")
    results: tuple[str, ...] = ()
    for r in (m["results"].split(",") if m["results"] else ()):
        name_, _, count = r.strip().partition(":")
        # `%0:2 = ...` names two results, used as %0#0 and %0#1
        results += tuple(f"{name_}#{k}" for k in range(int(count))) if count else (name_,)
    name = m["quoted"] or m["bare"]
    open_paren = m.end() - 1
    close = text.find(")", open_paren) + 1  # plain operands: `(%a, %b)`, nothing nested
    if close == 0 or any(c in text[open_paren + 1:close] for c in '(["<{'):
        close = _match(text, open_paren)
    inside = text[open_paren + 1:close - 1]
    callee = None
    if m["bare"]:  # custom syntax: load_cached(@fn, [%a, %b])
        parts = split_top(inside)
        if not parts or not parts[0].startswith("@"):
            raise BinaryFormatError(f"{name} names no function: {text[:200]!r}")
        callee = parts[0][1:]
        operands = tuple(split_top(parts[1][1:-1])) if len(parts) > 1 else ()
    else:
        operands = tuple(split_top(inside))
    rest = text[close:].lstrip()
    attributes: dict[str, str] = {}
    if rest.startswith("<{"):
        # The block most often ends where the signature starts; a block that is not whole
        # there (a string holding "}> : ") is walked bracket by bracket.
        end = rest.find("}> : ") + 2
        block = _attribute_block(rest[:end]) if end >= 2 else None
        if block is None:
            end = _match(rest, 0)
            block = _attributes(rest[2:end - 2])
        attributes = dict(block)
        rest = rest[end:].lstrip()
    if not rest.startswith(":"):
        raise BinaryFormatError(f"{name}: no type signature in {text[:200]!r}")
    rest = rest[1:]
    loc = rest.find(" loc(")
    signature = rest[:loc] if loc >= 0 else rest
    typed = _signature(signature)
    if typed is None:
        raise BinaryFormatError(f"{name}: no '->' in its type signature {signature[:200]!r}")
    operand_types, result_types = typed
    if len(operand_types) != len(operands) or len(result_types) != len(results):
        raise BinaryFormatError(
            f"{name}: {len(operands)} operands and {len(results)} results, but its signature types "
            f"{len(operand_types)} and {len(result_types)}"
        )
    for o in operands:
        if not _SSA_NAME.fullmatch(o):
            raise BinaryFormatError(f"{name}: operand {o!r} is not an SSA value")
    return MlirOp(name, results, operands, attributes, operand_types, result_types, callee, text)


def clear_caches() -> None:
    """Empty the type parser's caches (a benchmark's cold load)."""
    parse_type.cache_clear()
    _types.cache_clear()
    _signature.cache_clear()
    _attribute_block.cache_clear()
    _one_tensor.cache_clear()


# Attribute values -----------------------------------------------------------------------------

_NUMBER = re.compile(r"^\s*(-?[\d.]+(?:[eE][-+]?\d+)?|-?inf|nan|0x[0-9A-Fa-f]+)\s*(?::\s*\w+)?\s*$")


def _need(op: MlirOp, key: str) -> str:
    if key not in op.attributes:
        raise BinaryFormatError(f"{op.name} has no attribute {key!r}: {op.text[:300]!r}")
    return op.attributes[key]


def attr_int(op: MlirOp, key: str, default: int | None = None) -> int:
    if default is not None and key not in op.attributes:
        return default
    text = _need(op, key)
    m = _NUMBER.match(text)
    try:
        return int(m[1], 0) if m else int("x")
    except ValueError:
        raise BinaryFormatError(f"{op.name}: attribute {key} = {text!r} is not an integer") from None


def attr_float(op: MlirOp, key: str, default: float | None = None) -> float:
    if default is not None and key not in op.attributes:
        return default
    text = _need(op, key)
    m = _NUMBER.match(text)
    if not m:
        raise BinaryFormatError(f"{op.name}: attribute {key} = {text!r} is not a number")
    value = m[1]
    if value.startswith("0x"):  # MLIR prints a non-finite float as its bits
        import struct

        bits = int(value, 16)
        return float(struct.unpack("<f", bits.to_bytes(4, "little"))[0]) if bits < 1 << 32 else \
            float(struct.unpack("<d", bits.to_bytes(8, "little"))[0])
    return float(value)


def attr_bool(op: MlirOp, key: str, default: bool | None = None) -> bool:
    if default is not None and key not in op.attributes:
        return default
    text = _need(op, key)
    if text not in ("true", "false", "unit"):
        raise BinaryFormatError(f"{op.name}: attribute {key} = {text!r} is not a bool")
    return text != "false"


def attr_ints(op: MlirOp, key: str, default: list[int] | None = None) -> list[int]:
    """`[1 : i32, 2 : i32]`, `array<i64: 1, 2>`, `#ttnn.shape<1x32>` as a list of ints."""
    if default is not None and key not in op.attributes:
        return default
    text = _need(op, key)
    try:
        if text.startswith("array<"):
            body = text[len("array<"):-1].partition(":")[2]
            return [int(v) for v in split_top(body)]
        if text.startswith("["):
            return [int(v.partition(":")[0]) for v in split_top(text[1:-1])]
        if text.startswith("#ttnn.shape<"):
            return attr_shape(op, key)
    except ValueError:
        pass
    raise BinaryFormatError(f"{op.name}: attribute {key} = {text!r} is not a list of integers")


def attr_shape(op: MlirOp, key: str) -> list[int]:
    text = _need(op, key)
    m = re.fullmatch(r"#ttnn\.shape<((?:\d+x)*\d*)>", text)
    if not m:
        raise BinaryFormatError(f"{op.name}: attribute {key} = {text!r} is not a #ttnn.shape")
    return [int(d) for d in m[1].split("x") if d]


def activations(op: MlirOp, key: str) -> list[tuple[str, list[float]]]:
    """A fused activation list, `[#ttnn.unary_with_param<op_type = exp>, ...]`: (op, params)."""
    text = op.attributes.get(key, "[]")
    if not (text.startswith("[") and text.endswith("]")):
        raise BinaryFormatError(f"{op.name}: attribute {key} = {text!r} is not a list")
    out = []
    for item in split_top(text[1:-1]):
        m = re.fullmatch(r"#ttnn\.unary_with_param<(.*)>", item, re.DOTALL)
        if not m:
            raise BinaryFormatError(f"{op.name}: {key} holds {item!r}, not a unary_with_param")
        fields = {k.strip(): v.strip() for k, _, v in (p.partition("=") for p in split_top(m[1]))}
        params = [float(p.partition(":")[0]) for p in split_top(fields.get("params", "[]")[1:-1])]
        out.append((fields.get("op_type", ""), params))
    return out


def struct_fields(text: str) -> dict[str, Any]:
    """`#ttnn.x<a = 1, b = true>` as {"a": "1", "b": "true"}."""
    start = text.find("<")
    if start < 0 or not text.endswith(">"):
        return {}
    return _attributes(text[start + 1:-1])
