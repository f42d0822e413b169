"""A tt-mlir TTNN flatbuffer (`.ttnn`), read into plain records: programs, their inputs and
outputs with the layouts the compiler chose, and every op with its MLIR text and location.

The file is size-prefixed with identifier `TTNN`; its root names the schema hash it was written
with, and only a schema in `schema.SCHEMAS` is read (another hash is a BinaryFormatError naming
it and the supported ones). Each op is decoded by its own MLIR text (`mlir.parse_op`), checked
against the table its union tag names; operands and results are the text's SSA names, which the
module's MLIR shares (its `return` lines say which values a program returns).
"""

from __future__ import annotations

import re
from typing import final

import attrs
from flatbuffers import number_types as N

from .._errors import BinaryFormatError
from . import mlir
from .flatbuffer import Table, size_prefixed_root
from .schema import BUFFER_TYPES, DATA_TYPES, MEMORY_LAYOUTS, SCHEMAS, Schema

__all__ = ["TtnnFile", "TtnnOp", "TtnnProgram", "TtnnTensor", "is_ttnn", "read_ttnn"]

IDENTIFIER = b"TTNN"


def is_ttnn(data: bytes) -> bool:
    """Whether `data` starts as a size-prefixed TTNN flatbuffer does (identifier at bytes 8-12)."""
    return len(data) >= 12 and bytes(data[8:12]) == IDENTIFIER


@final
@attrs.frozen
class TtnnTensor:
    """A program input or output as its TensorRef describes it."""

    global_id: int
    shape: tuple[int, ...]
    data_type: str  # "f32", "bf16", "si32", ... (schema.DATA_TYPES)
    buffer: str  # "dram", "l1", "system_memory", ...
    tiled: bool  # 32x32 tiles (else row-major)
    memory_layout: str  # "interleaved", "height_sharded", ...
    on_host: bool  # storage type Host
    mesh_shape: tuple[int, ...] = ()
    local_shape: tuple[int, ...] = ()
    argument_type: str = "input"  # the module's ttcore.argument_type: input, parameter, constant
    name: str = ""  # its location in the module ("x", "w1": the JAX argument's name)
    aliases_output: int | None = None  # the output that may reuse its buffer (JAX's donation)


@final
@attrs.frozen
class TtnnOp:
    """One operation: its union tag, its parsed MLIR text and its location."""

    index: int
    tag: int
    op: mlir.MlirOp
    loc: str
    data: bytes | None = None  # a constant's values, as its table holds them
    data_type: str | None = None  # their data type (schema.DATA_TYPES)

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def compute_config(self) -> str:
        """Its compute config as silicon runs it (`hifi4 fp32_acc`), or "" for an op without one:
        the math fidelity and whether the destination accumulates in float32."""
        text = self.op.attributes.get("compute_config", "")
        if not text:
            return ""
        fields = mlir.struct_fields(text)
        parts = [fields.get("math_fidelity", "")]
        if fields.get("fp32_dest_acc_en") == "true":
            parts.append("fp32_acc")
        if fields.get("math_approx_mode") == "true":
            parts.append("approx")
        return " ".join(p for p in parts if p)

    @property
    def location(self) -> str:
        """What the program records as the op's location: the name its location gives (JAX's
        `jit(f)/add`), the source line and the compute config, `jit(f)/add @ f.py:12:5 [hifi4
        fp32_acc]`, so debug hooks, golden reports and `ttflow read` show all three."""
        name = re.match(r'\s*loc\((?:callsite\()?"([^"]*)"', self.loc)
        source = self.source
        if name and name[1] != source and not source.startswith(name[1]):
            where = f"{name[1]} @ {source}" if source != self.loc else name[1]
        else:
            where = source or self.name
        config = self.compute_config
        return f"{where} [{config}]" if config else where

    @property
    def source(self) -> str:
        """The innermost source position its location names (`file:line:col`), or the location."""
        found = re.findall(r'"([^"]+)":(\d+):(\d+)', self.loc)
        if found:
            path, line, col = found[0]
            return f"{path}:{line}:{col}"
        return self.loc


@final
@attrs.frozen
class TtnnProgram:
    name: str
    private: bool
    inputs: tuple[TtnnTensor, ...]
    outputs: tuple[TtnnTensor, ...]
    ops: tuple[TtnnOp, ...]
    results: tuple[str, ...]  # the SSA values it returns, in output order
    arguments: tuple[str, ...]  # its inputs' SSA names (%arg0, ...)
    mesh_shape: tuple[int, int] | None


@final
@attrs.frozen
class TtnnFile:
    schema: Schema
    git_hash: str
    programs: tuple[TtnnProgram, ...]
    mlir: str
    system_desc_offset: int  # where the embedded system descriptor table starts (0: absent)


def read_ttnn(data: bytes, what: str = "the binary") -> TtnnFile:
    """The records of a TTNN flatbuffer; BinaryFormatError for anything that is not one whole."""
    root = size_prefixed_root(data, IDENTIFIER, what)
    found = None
    # The schema hash's slot is the same in every schema ttflow reads (TTNNBinary's second field).
    for candidate in SCHEMAS.values():
        found = root.string(candidate.root_schema_hash, "schema_hash")
        break
    known = SCHEMAS.get(found or "")
    if known is None:
        raise BinaryFormatError(
            f"{what} was written with tt-mlir schema {found!r}; this ttflow reads "
            + ", ".join(f"{s.hash} ({s.producer})" for s in SCHEMAS.values())
        )
    schema = known
    module = _mlir_source(root, schema)
    functions = _functions(module, what)
    programs = []
    for i, table in enumerate(root.tables(schema.root_programs, "programs")):
        programs.append(_program(table, schema, functions, what, i))
    if not programs:
        raise BinaryFormatError(f"{what} holds no programs")
    sd = root.table(schema.root_system_desc, "system_desc")
    return TtnnFile(schema, root.string(schema.root_git_hash, "ttmlir_git_hash") or "", tuple(programs),
                    module, sd.pos if sd else 0)


def _mlir_source(root: Table, schema: Schema) -> str:
    table = root.table(schema.root_mlir, "mlir")
    return (table.string(1, "mlir.source") or "") if table else ""


@final
@attrs.frozen
class _Function:
    arguments: tuple[str, ...]
    argument_types: tuple[str, ...]
    argument_names: tuple[str, ...]
    results: tuple[str, ...]
    aliases: tuple[int | None, ...] = ()


_FUNC = re.compile(r"func\.func (?:public |private )?@([\w.$-]+)\((.*?)\)\s*(?:->|attributes|\{)", re.DOTALL)


def _functions(module: str, what: str) -> dict[str, _Function]:
    """Each function of the module's MLIR: its arguments (name, argument type, location) and the
    values its `return` gives."""
    out = {}
    for m in _FUNC.finditer(module):
        name = m[1]
        args = mlir.split_top(m[2]) if m[2].strip() else []
        arg_names, kinds, locs, aliases = [], [], [], []
        for arg in args:
            arg_names.append(arg.split(":", 1)[0].strip())
            alias = re.search(r"tf\.aliasing_output = (\d+)", arg)
            aliases.append(int(alias[1]) if alias else None)
            kind = re.search(r"ttcore\.argument_type<(\w+)>", arg)
            kinds.append(kind[1] if kind else "input")
            loc = re.search(r'loc\("([^"]*)"\)\s*$', arg)
            locs.append(loc[1] if loc else "")
        body_start = module.find("{", m.end() - 1)
        ret = re.compile(r"^\s*return\b(.*?)(?::|$)", re.MULTILINE).search(module, body_start)
        results: tuple[str, ...] = ()
        if ret:
            results = tuple(r.strip() for r in ret[1].split(",") if r.strip())
        out[name] = _Function(tuple(arg_names), tuple(kinds), tuple(locs), results, tuple(aliases))
    return out


def _tensor(ref: Table, schema: Schema, kind: str, name: str, alias: int | None = None) -> TtnnTensor:
    gid = int(ref.scalar(schema.ref_global_id, N.Uint32Flags, 0, "global_id"))
    desc = ref.table(schema.ref_desc, "desc")
    if desc is None:
        raise BinaryFormatError(f"{ref.what}: {ref.path} has no tensor description")
    shape = tuple(int(d) for d in desc.scalars(schema.desc_shape, "i", "shape"))
    mesh = tuple(int(d) for d in desc.scalars(schema.desc_mesh_shape, "i", "mesh_shape"))
    local = tuple(int(d) for d in desc.scalars(schema.desc_local_shape, "i", "local_shape"))
    layout = desc.table(schema.desc_layout, "layout")
    memory = layout.table(schema.layout_memory_desc, "memory_desc") if layout else None
    if memory is None:
        raise BinaryFormatError(f"{ref.what}: {ref.path} has no memory description")
    storage = int(memory.scalar(schema.memory_storage_type, N.Uint16Flags, 0, "storage_type"))
    tile = memory.struct(schema.memory_tile_shape, "ii", "tile_shape") or (1, 1)
    dtype = int(memory.scalar(schema.memory_data_type, N.Uint16Flags, 0, "data_type"))
    config = memory.table(schema.memory_config, "memory_config")
    buffer = int(config.scalar(schema.config_buffer_type, N.Uint16Flags, 0, "buffer_type")) if config else 2
    mem_layout = int(config.scalar(schema.config_memory_layout, N.Uint16Flags, 0, "tensor_memory_layout")) if config else 0
    for value, names, field in ((dtype, DATA_TYPES, "data_type"), (buffer, BUFFER_TYPES, "buffer_type"),
                                (mem_layout, MEMORY_LAYOUTS, "tensor_memory_layout")):
        if not 0 <= value < len(names):
            raise BinaryFormatError(f"{ref.what}: {ref.path}.{field} is {value}, not one of the schema's")
    if tuple(tile) not in ((1, 1), (32, 32)):
        raise BinaryFormatError(f"{ref.what}: {ref.path} has tile shape {tuple(tile)}; ttflow's tiles are 32x32")
    return TtnnTensor(gid, shape, DATA_TYPES[dtype], BUFFER_TYPES[buffer], tuple(tile) == (32, 32),
                      MEMORY_LAYOUTS[mem_layout], storage == 0, mesh, local, kind, name, alias)


def _program(table: Table, schema: Schema, functions: dict[str, _Function], what: str, index: int) -> TtnnProgram:
    name = table.string(schema.program_name, "name")
    if not name:
        raise BinaryFormatError(f"{what}: program {index} has no name")
    function = functions.get(name)
    if function is None:
        raise BinaryFormatError(f"{what}: program {name!r} has no function in the binary's MLIR module")
    in_refs = table.tables(schema.program_inputs, "inputs")
    out_refs = table.tables(schema.program_outputs, "outputs")
    if len(in_refs) != len(function.arguments) or len(out_refs) != len(function.results):
        raise BinaryFormatError(
            f"{what}: program {name!r} has {len(in_refs)} inputs and {len(out_refs)} outputs, its MLIR "
            f"function {len(function.arguments)} arguments and {len(function.results)} results"
        )
    inputs = tuple(_tensor(r, schema, function.argument_types[i], function.argument_names[i],
                           function.aliases[i] if function.aliases else None)
                   for i, r in enumerate(in_refs))
    outputs = tuple(_tensor(r, schema, "output", "") for r in out_refs)
    ops = []
    for i, op in enumerate(table.tables(schema.program_operations, "operations")):
        tag = int(op.scalar(schema.op_tag, N.Uint8Flags, 0, "type_type"))
        text = op.string(schema.op_debug_info, "debug_info") or ""
        loc = op.string(schema.op_loc_info, "loc_info") or ""
        try:
            parsed = mlir.parse_op(text)
        except BinaryFormatError as exc:
            raise BinaryFormatError(f"{what}: program {name!r} op {i}: {exc}") from None
        if parsed.name not in schema.names(tag):
            known = schema.ops.get(tag)
            raise BinaryFormatError(
                f"{what}: program {name!r} op {i} is union member {tag} "
                f"({known.table if known else 'unknown to schema ' + schema.hash[:12]}), but its MLIR "
                f"text names {parsed.name}: {text[:300]}"
            )
        data = data_type = None
        if schema.ops[tag].table == schema.constant_table:
            body = op.table(schema.op_table, "type")
            if body is None:
                raise BinaryFormatError(f"{what}: program {name!r} op {i} (a constant) has no table")
            data = body.bytes_of(schema.constant_data, "input") or b""
            code = int(body.scalar(schema.constant_data_type, N.Uint16Flags, 0, "input_dtype"))
            if not 0 <= code < len(DATA_TYPES):
                raise BinaryFormatError(f"{what}: program {name!r} op {i}: input_dtype {code} is not a data type")
            data_type = DATA_TYPES[code]
        ops.append(TtnnOp(i, tag, parsed, loc, data, data_type))
    mesh = table.struct(schema.program_mesh_shape, "ii", "mesh_shape")
    return TtnnProgram(
        name, bool(table.scalar(schema.program_private, N.BoolFlags, False, "private")), inputs, outputs,
        tuple(ops), function.results, function.arguments, (int(mesh[0]), int(mesh[1])) if mesh else None,
    )
