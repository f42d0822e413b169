"""conv2d and the 2-D pools, on ttnn's flattened activations.

ttnn hands a convolution its input as [1, 1, N*H*W, C] with `batch_size`, `input_height` and
`input_width` attributes, its weight as PyTorch's [C_out, C_in / groups, kH, kW] (on the host: the
compiler moves it there for the op's weight preparation) and its bias as [1, 1, 1, C_out], and it
gives [1, 1, N*Ho*Wo, C_out]; the pools likewise. ttflow's conv2d and pools take NHWC, so the
translation unflattens, runs, and flattens back. `padding` is (top, bottom, left, right) for
conv2d, (height, width) for the pools; only symmetric padding is translated."""

from __future__ import annotations

from collections.abc import Sequence

from ..._ir.builder import Value
from ..lower import Lowering, Translator, dtype_of
from ..mlir import attr_bool, attr_int, attr_ints, struct_fields
from ..reader import TtnnOp
from .eltwise import UNARY


def _nhwc(c: Lowering, op: TtnnOp, x: Value, channels: int) -> Value:
    n, h, w = attr_int(op.op, "batch_size"), attr_int(op.op, "input_height"), attr_int(op.op, "input_width")
    return c.b.reshape(x, (n, h, w, channels))


def _flatten(c: Lowering, op: TtnnOp, y: Value) -> Value:
    return c.b.reshape(y, c.result_shape(op))


def _pairs(c: Lowering, op: TtnnOp, key: str, size: int) -> tuple[int, int]:
    values = attr_ints(op.op, key, default=[0] * size)
    if len(values) == 2:
        return values[0], values[1]
    if len(values) == 4 and values[0] == values[1] and values[2] == values[3]:
        return values[0], values[2]
    raise c.refuse(f"{key} {values} (only symmetric padding is translated)")


# conv2d_config fields that change a value (the rest pick kernels and shards on silicon).
_CONV_CONFIG_READS = frozenset({
    "weights_dtype", "activation", "enable_kernel_stride_folding", "config_tensors_in_dram",
    "deallocate_activation", "reallocate_halo_output", "act_block_h_override", "act_block_w_div",
    "reshard_if_not_optimal", "override_sharding_config", "shard_layout", "core_grid",
    "transpose_shards", "output_layout", "enable_act_double_buffer", "enable_weights_double_buffer",
    "in_place",
})


def _conv2d(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    values = c.operands(op)
    x, weight = values[0], values[1]
    bias = values[2] if len(values) > 2 else None
    x = _nhwc(c, op, x, attr_int(op.op, "in_channels"))
    weights_dtype = struct_fields(op.op.attributes.get("conv2d_config", "")).get("weights_dtype")
    if weights_dtype:  # the op's weight preparation stores the weights in this dtype
        weight = c.b.typecast(weight, dtype_of(weights_dtype, "conv2d weights_dtype"))
    if bias is not None:
        bias = c.b.reshape(bias, (bias.shape[-1],))
    y = c.b.conv2d(x, weight, bias, stride=tuple(attr_ints(op.op, "stride", default=[1, 1])),
                   padding=_pairs(c, op, "padding", 4), dilation=tuple(attr_ints(op.op, "dilation", default=[1, 1])),
                   groups=attr_int(op.op, "groups", default=1))
    config = struct_fields(op.op.attributes.get("conv2d_config", ""))
    unknown = sorted(set(config) - _CONV_CONFIG_READS)
    if unknown:
        raise c.refuse(f"conv2d_config field(s) {unknown} may change its value and are not translated")
    activation = config.get("activation")
    if activation:
        name = struct_fields(activation).get("op_type", activation)
        if name not in UNARY:
            raise c.refuse(f"fused activation {activation} has no translation")
        y = UNARY[name](c, y)
    return [_flatten(c, op, y)]


def _pool(kind: str) -> Translator:
    def translate(c: Lowering, op: TtnnOp) -> Sequence[Value]:
        (x,) = c.operands(op)
        if "ceil_mode" in op.op.attributes and op.op.attributes["ceil_mode"] != "false":
            raise c.refuse("ceil_mode = true")
        if attr_ints(op.op, "dilation", default=[1, 1]) != [1, 1]:
            raise c.refuse("a dilated pool")
        x = _nhwc(c, op, x, attr_int(op.op, "channels"))
        kernel = tuple(attr_ints(op.op, "kernel_size"))
        stride = tuple(attr_ints(op.op, "stride", default=list(kernel)))
        padding = _pairs(c, op, "padding", 2)
        if kind == "max":
            return [_flatten(c, op, c.b.max_pool2d(x, kernel, stride, padding))]
        if any(padding) and not attr_bool(op.op, "count_include_pad", default=True):
            raise c.refuse("count_include_pad = false with padding (ttflow's avg_pool2d counts the pad)")
        y = c.b.avg_pool2d(x, kernel, stride, padding)
        # the window's sum over this divisor; 0 is none (a divisor of 0 means nothing, and the
        # compiler writes it for a reduce_window sum it then multiplies by the window's size)
        override = attr_int(op.op, "divisor_override", default=0)
        if override:
            y = c.b.mul(y, (kernel[0] * kernel[1]) / override)
        return [_flatten(c, op, y)]
    return translate


TRANSLATORS: dict[str, Translator] = {
    "ttnn.conv2d": _conv2d, "ttnn.max_pool2d": _pool("max"), "ttnn.avg_pool2d": _pool("avg"),
}

_GEOMETRY = frozenset({"batch_size", "input_height", "input_width", "kernel_size", "stride", "padding",
                       "dilation", "ceil_mode"})
READS: dict[str, frozenset[str]] = {
    "ttnn.conv2d": _GEOMETRY | {"in_channels", "out_channels", "groups", "conv2d_config"},
    "ttnn.max_pool2d": _GEOMETRY | {"channels"},
    "ttnn.avg_pool2d": _GEOMETRY | {"channels", "count_include_pad", "divisor_override"},
}
