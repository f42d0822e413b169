"""The flatbuffer schemas ttflow reads, one table per schema hash.

tt-mlir's schema changes every few days, and members are inserted in the middle of its op union,
so a union tag means nothing without the schema it was written with. Each supported schema is one
`Schema` here: the field slots of the tables ttflow walks (root, program, tensor reference,
operation) and, for the op union, which op table each tag is and which MLIR op names that table
carries. A binary's op is decoded by the name its own MLIR text gives, and that name must be one
its tag's table carries, so neither the tag nor the text alone decides.

The plugin's schema (`jax-tt-plugin==0.1.3`, hash 912b70aa...) is newer than any public copy of
tt-mlir's `.fbs` files: its tags were learnt from binaries whose ops name themselves (the corpus
script `tests/data/ttnn/make_corpus.py`), its table layouts checked against tt-mlir's published
field order. Adding the next schema is one more `Schema` in `SCHEMAS`.
"""

from __future__ import annotations

from typing import final

import attrs

__all__ = ["SCHEMAS", "OpTable", "Schema"]


@final
@attrs.frozen
class OpTable:
    """One member of the op union: its table's name and the MLIR ops that table carries."""

    table: str
    ops: frozenset[str]


def _t(table: str, *ops: str) -> OpTable:
    return OpTable(table, frozenset(ops))


_BINARY = ("add", "multiply", "logical_right_shift", "subtract", "eq", "ne", "ge", "gt", "le", "lt",
           "divide", "logical_and", "logical_or", "logical_xor")
_BINARY_COMPOSITE = ("maximum", "minimum", "remainder", "pow", "atan2", "bitwise_and", "bitwise_or",
                     "bitwise_xor", "logical_left_shift", "bitwise_left_shift", "bitwise_right_shift",
                     "pow_tensor")
_UNARY = ("abs", "ceil", "cos", "floor", "gelu", "isfinite", "logical_not", "neg", "relu", "sqrt",
          "rsqrt", "sigmoid", "sin", "reciprocal", "sign", "tan", "tanh", "atan", "exp", "erf", "erfc",
          "log", "expm1", "leaky_relu", "bitwise_not", "relu6", "silu", "hardsigmoid", "mish", "round")
_UNARY_COMPOSITE = ("cbrt", "clamp_scalar", "clamp_tensor", "log1p")


def _ttnn(*names: str) -> tuple[str, ...]:
    return tuple(f"ttnn.{n}" for n in names)


@final
@attrs.frozen
class Schema:
    """Where one schema keeps the fields ttflow reads (flatbuffer field slots, 0-based)."""

    hash: str
    producer: str  # the compiler release that writes it
    ops: dict[int, OpTable]
    # TTNNBinary: version (struct), schema_hash, ttmlir_git_hash, system_desc, mlir, programs
    root_schema_hash: int = 1
    root_git_hash: int = 2
    root_system_desc: int = 3
    root_mlir: int = 4
    root_programs: int = 5
    # Program: name, inputs, outputs, operations, dylibs, debug_info, private, mesh_shape
    program_name: int = 0
    program_inputs: int = 1
    program_outputs: int = 2
    program_operations: int = 3
    program_private: int = 6
    program_mesh_shape: int = 7
    # Operation: type (union: tag slot, table slot), debug_info (its MLIR), loc_info
    op_tag: int = 0
    op_table: int = 1
    op_debug_info: int = 2
    op_loc_info: int = 3
    # TensorRef {global_id, desc}; TensorDesc {shape, mesh_shape, layout, shard_status, local_shape}
    ref_global_id: int = 0
    ref_desc: int = 1
    desc_shape: int = 0
    desc_mesh_shape: int = 1
    desc_layout: int = 2
    desc_local_shape: int = 4
    # LayoutDesc {oob_val, memory_desc}; MemoryDesc {storage_type, tile_shape, data_type, memory_config}
    layout_memory_desc: int = 1
    memory_storage_type: int = 0
    memory_tile_shape: int = 1
    memory_data_type: int = 2
    memory_config: int = 3
    # MemoryConfig {tensor_memory_layout, buffer_type, shard_spec, nd_shard_spec}
    config_memory_layout: int = 0
    config_buffer_type: int = 1
    config_shard_spec: int = 2

    # ConstantOp {device, input: [ubyte], input_dtype, dtype, layout, memcfg, out}: its data is not in
    # its MLIR text (printed `dense_resource<__elided__>`), only in the table.
    constant_table: str = "ConstantOp"
    constant_data: int = 1
    constant_data_type: int = 2

    def names(self, tag: int) -> frozenset[str]:
        entry = self.ops.get(tag)
        return entry.ops if entry else frozenset()


# tt-mlir's DataType, BufferType, TensorMemoryLayout enums (Common/types.fbs, TTNN/types.fbs): their
# order has not changed across the schemas ttflow reads.
DATA_TYPES = ("f32", "f16", "bf16", "bfp_f8", "bfp_bf8", "bfp_f4", "bfp_bf4", "bfp_f2", "bfp_bf2",
              "ui32", "ui16", "ui8", "si32", "f64", "si64", "ui64", "si16", "si8", "i1")
BUFFER_TYPES = ("dram", "l1", "system_memory", "l1_small", "trace")
MEMORY_LAYOUTS = ("interleaved", "height_sharded", "width_sharded", "block_sharded", "nd_sharded")

_PLUGIN_0_1_3 = Schema(
    hash="912b70aa54f878b01d094638d22c35ee6e20c7e7f1813913242a47e7f79c9bd2",
    producer="jax-tt-plugin 0.1.3",
    ops={
        3: _t("AllGatherOp", "ttnn.all_gather"),
        5: _t("AllReduceOp", "ttnn.all_reduce"),
        9: _t("ArangeOp", "ttnn.arange"),
        10: _t("AssignOp", "ttnn.assign"),
        18: _t("ConcatOp", "ttnn.concat"),
        25: _t("ConstantOp", "ttnn.constant"),
        # control flow: members whose table names are not published (learnt from binaries)
        26: _t("tag 26 (case)", "ttcore.case"),
        27: _t("tag 27 (while_loop)", "ttcore.while_loop"),
        29: _t("Conv2dOp", "ttnn.conv2d"),
        30: _t("ConvTranspose2dOp", "ttnn.conv_transpose2d"),
        35: _t("DeallocateOp", "ttnn.deallocate"),
        40: _t("EltwiseBinaryCompositeOp", *_ttnn(*_BINARY_COMPOSITE)),
        # a member the corpus shows carrying atan and atan2 (its table's name is not published)
        41: _t("tag 41 (atan, atan2)", "ttnn.atan", "ttnn.atan2"),
        43: _t("EltwiseBinaryOp", *_ttnn(*_BINARY)),
        45: _t("EltwiseTernaryWhereOp", "ttnn.where"),
        46: _t("EltwiseUnaryCompositeOp", *_ttnn(*_UNARY_COMPOSITE)),
        47: _t("EltwiseUnaryOp", *_ttnn(*_UNARY)),
        55: _t("FromDeviceOp", "ttnn.from_device"),
        56: _t("FullOp", "ttnn.full"),
        59: _t("RowsGatherOp", "ttnn.rows_gather"),
        60: _t("RowsScatterOp", "ttnn.rows_scatter"),
        66: _t("GetDeviceOp", "ttnn.get_device"),
        75: _t("LinearOp", "ttnn.linear"),
        76: _t("LoadCachedOp", "ttcore.load_cached"),
        77: _t("MatmulOp", "ttnn.matmul"),
        79: _t("MaxPool2dWithIndicesOp", "ttnn.max_pool2d_with_indices"),
        86: _t("CumSumOp", "ttnn.cumsum"),
        87: _t("CumProdOp", "ttnn.cumprod"),
        88: _t("NamedFullOp", "ttnn.zeros", "ttnn.ones"),
        90: _t("PadOp", "ttnn.pad"),
        95: _t("PermuteOp", "ttnn.permute"),
        96: _t("PointToPointOp", "ttnn.point_to_point"),
        97: _t("Pool2dOp", "ttnn.max_pool2d", "ttnn.avg_pool2d"),
        105: _t("ReductionArgMaxOp", "ttnn.argmax"),
        106: _t("ReductionOp", "ttnn.sum", "ttnn.mean", "ttnn.max", "ttnn.min"),
        107: _t("ReductionProdOp", "ttnn.prod"),
        108: _t("ReduceScatterOp", "ttnn.reduce_scatter"),
        109: _t("RepeatInterleaveOp", "ttnn.repeat_interleave"),
        110: _t("RepeatOp", "ttnn.repeat"),
        114: _t("RMSNormOp", "ttnn.rms_norm"),
        116: _t("ReshapeOp", "ttnn.reshape"),
        125: _t("SliceOp", "ttnn.slice_static", "ttnn.slice_dynamic"),
        126: _t("SoftmaxOp", "ttnn.softmax"),
        128: _t("SortOp", "ttnn.sort"),
        132: _t("ToLayoutOp", "ttnn.to_layout"),
        135: _t("TypecastOp", "ttnn.typecast"),
        147: _t("TopKOp", "ttnn.topk"),
    },
)

SCHEMAS: dict[str, Schema] = {s.hash: s for s in (_PLUGIN_0_1_3,)}
