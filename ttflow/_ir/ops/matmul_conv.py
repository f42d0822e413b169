"""Matrix products, convolution and pools (NHWC, as ttnn), and their gradients: the ops that
run as matmuls (conv2d as the matmul of its im2col).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..._errors import BinaryFormatError, ProgramError, ShapeError
from ..._types import check_shape
from .. import footprint
from ..core import (BuilderCore, Value, _broadcast, _conv_geometry, _int, _pair, _pool_geometry,
                    _result_dtype, _window_size, replay_flag, replay_optional)
from ..record import Kind, RangeCheck, op
from ._shared import Array

__all__ = ["MatmulConvOps"]


def _matmul(arrays: list[Array], scalar: float | None) -> Array:
    # Row-major operands: BLAS sums in an order that depends on how they lie in memory (a
    # transposed view takes another kernel), so the same values give the same bits whether a
    # step's operand was kept between steps or read back from bank memory (const-eval's cut).
    return np.matmul(np.ascontiguousarray(arrays[0]), np.ascontiguousarray(arrays[1]))


def _windows(x: Array, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
             dilation: tuple[int, int], fill: Any) -> Array:
    """NHWC `x`, padded with `fill`, as windows [N, H_out, W_out, C, kH, kW] (a strided view)."""
    (ph, pw), (sh, sw), (dh, dw) = padding, stride, dilation
    if ph or pw:
        x = np.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0)), constant_values=fill)
    span = ((kernel[0] - 1) * dh + 1, (kernel[1] - 1) * dw + 1)
    view = np.lib.stride_tricks.sliding_window_view(x, span, axis=(1, 2))
    return view[:, ::sh, ::sw, :, ::dh, ::dw]


def _conv2d(arrays: list[Array], scalar: float | None, stride: tuple[int, int],
            padding: tuple[int, int], dilation: tuple[int, int], groups: int,
            has_bias: bool) -> Array:
    x, weight = arrays[0], arrays[1]
    c_out, c_in_g, kh, kw = weight.shape
    win = _windows(x, (kh, kw), stride, padding, dilation, x.dtype.type(0))
    n, ho, wo = win.shape[:3]
    c_out_g, k = c_out // groups, c_in_g * kh * kw
    # im2col: one [N*Ho*Wo, C_in/g*kH*kW] @ [.., C_out/g] matmul a group, the groups batched
    # (a depthwise conv has as many groups as channels: one call, not one per channel).
    cols = _grouped(win.reshape(n * ho * wo, groups, k))
    w = weight.reshape(groups, c_out_g, k).transpose(0, 2, 1)
    out = (cols @ w).transpose(1, 0, 2).reshape(n, ho, wo, c_out)
    if has_bias:
        out += arrays[2]
    return out


def _max_pool2d(arrays: list[Array], scalar: float | None, kernel_size: tuple[int, int],
                stride: tuple[int, int], padding: tuple[int, int]) -> Array:
    x = arrays[0]
    fill = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min  # never wins: pad <= k/2
    return _windows(x, kernel_size, stride, padding, (1, 1), fill).max(axis=(-2, -1))


def _avg_pool2d(arrays: list[Array], scalar: float | None, kernel_size: tuple[int, int],
                stride: tuple[int, int], padding: tuple[int, int]) -> Array:
    x = arrays[0]
    win = _windows(x, kernel_size, stride, padding, (1, 1), x.dtype.type(0))
    # count_include_pad=True (PyTorch's default): every window divides by kH * kW.
    return win.sum(axis=(-2, -1), dtype=np.float32) / np.float32(kernel_size[0] * kernel_size[1])


def _grouped(rows: Array) -> Array:
    """[rows, groups, k] as [groups, rows, k], contiguous: one matmul a group, batched."""
    if rows.shape[1] == 1:
        return rows.reshape(1, rows.shape[0], rows.shape[2])  # no copy
    return np.ascontiguousarray(rows.transpose(1, 0, 2))


def _scatter_taps(out: Array, taps: Callable[[int, int], Array], kernel: tuple[int, int],
                  stride: tuple[int, int], dilation: tuple[int, int], out_hw: tuple[int, int]) -> None:
    """Adds each kernel tap's [N, H_out, W_out, C] contribution into the padded NHWC `out` at
    the input pixels that tap read (the adjoint of `_windows`), one strided slice a tap. The
    taps go last to first, so each pixel sums its windows in row-major window order, as
    PyTorch's pooling backward loops do (the same float32 sums, not only close ones)."""
    (sh, sw), (dh, dw), (ho, wo) = stride, dilation, out_hw
    for i in reversed(range(kernel[0])):
        for j in reversed(range(kernel[1])):
            out[:, i * dh : i * dh + (ho - 1) * sh + 1 : sh, j * dw : j * dw + (wo - 1) * sw + 1 : sw] += taps(i, j)


def _crop(padded: Array, padding: tuple[int, int], h: int, w: int) -> Array:
    return np.ascontiguousarray(padded[:, padding[0] : padding[0] + h, padding[1] : padding[1] + w])


def _conv2d_input_grad(arrays: list[Array], scalar: float | None, input_shape: tuple[int, ...],
                       stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                       groups: int) -> Array:
    grad, weight = arrays
    n, h, w, c_in = input_shape
    c_out, c_in_g, kh, kw = weight.shape
    ho, wo = grad.shape[1:3]
    c_out_g = c_out // groups
    dx = np.zeros((n, h + 2 * padding[0], w + 2 * padding[1], c_in), np.result_type(grad, weight))
    # Every tap of a group in one matmul, [N*Ho*Wo, C_out/g] @ [.., C_in/g*kH*kW], the groups
    # batched; group g's columns are channels g*C_in/g.. of the input, in order.
    gg = _grouped(grad.reshape(n * ho * wo, groups, c_out_g))
    wg = weight.reshape(groups, c_out_g, c_in_g * kh * kw)
    cols = (gg @ wg).transpose(1, 0, 2).reshape(n, ho, wo, c_in, kh, kw)
    _scatter_taps(dx, lambda i, j: cols[..., i, j], (kh, kw), stride, dilation, (ho, wo))
    return _crop(dx, padding, h, w)


def _conv2d_weight_grad(arrays: list[Array], scalar: float | None, weight_shape: tuple[int, ...],
                        stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                        groups: int) -> Array:
    x, grad = arrays
    c_out, c_in_g, kh, kw = weight_shape
    win = _windows(x, (kh, kw), stride, padding, dilation, x.dtype.type(0))
    rows = math.prod(win.shape[:3])
    c_out_g = c_out // groups
    # im2col: [C_out/g, N*Ho*Wo] @ [N*Ho*Wo, C_in/g*kH*kW] a group, the groups batched.
    cols = _grouped(win.reshape(rows, groups, c_in_g * kh * kw))
    gg = _grouped(grad.reshape(rows, groups, c_out_g))
    dw = gg.transpose(0, 2, 1) @ cols
    return dw.reshape(tuple(weight_shape)).astype(np.result_type(x, grad), copy=False)


def _valid_taps(size: int, out: int, kernel: int, stride: int, padding: int) -> Array:
    """[out, kernel]: whether tap k of window o reads an input pixel (not padding)."""
    pos = np.arange(out)[:, None] * stride - padding + np.arange(kernel)[None, :]
    return (pos >= 0) & (pos < size)


def _max_pool2d_backward(arrays: list[Array], scalar: float | None, kernel_size: tuple[int, int],
                         stride: tuple[int, int], padding: tuple[int, int]) -> Array:
    x, grad = arrays
    n, h, w, c = x.shape
    (kh, kw), (ho, wo) = kernel_size, grad.shape[1:3]
    win = _windows(x, kernel_size, stride, padding, (1, 1), x.dtype.type(0))
    vy = _valid_taps(h, ho, kh, stride[0], padding[0])
    vx = _valid_taps(w, wo, kw, stride[1], padding[1])
    # PyTorch's CPU scan, per window: the tap starts at the first input pixel with -inf as the
    # maximum; a pixel becomes the tap when it is greater than the maximum or NaN.
    is_float = x.dtype.kind == "f"
    best = np.full((n, ho, wo, c), -np.inf if is_float else np.iinfo(np.int64).min, x.dtype)
    tap = np.full((n, ho, wo, c), -1, np.int64)
    for i in range(kh):
        for j in range(kw):
            v = win[..., i, j]
            valid = (vy[:, i][:, None] & vx[:, j][None, :])[None, :, :, None]
            better = valid & ((v > best) | np.isnan(v)) if is_float else valid & (v > best)
            tap = np.where(better | (valid & (tap < 0)), i * kw + j, tap)
            best = np.where(better, v, best)
    dx = np.zeros((n, h + 2 * padding[0], w + 2 * padding[1], c), grad.dtype)
    zero = grad.dtype.type(0)
    _scatter_taps(dx, lambda i, j: np.where(tap == i * kw + j, grad, zero), kernel_size, stride, (1, 1), (ho, wo))
    return _crop(dx, padding, h, w)


def _avg_pool2d_backward(arrays: list[Array], scalar: float | None, input_shape: tuple[int, ...],
                         kernel_size: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
                         count_include_pad: bool) -> Array:
    grad = arrays[0]
    n, h, w, c = input_shape
    (kh, kw), (ho, wo) = kernel_size, grad.shape[1:3]
    if count_include_pad:
        divisor = np.full((ho, wo), kh * kw, np.float32)
    else:  # the window's pixels inside the input
        divisor = np.outer(_valid_taps(h, ho, kh, stride[0], padding[0]).sum(1),
                           _valid_taps(w, wo, kw, stride[1], padding[1]).sum(1)).astype(np.float32)
    share = grad / divisor[None, :, :, None]
    dx = np.zeros((n, h + 2 * padding[0], w + 2 * padding[1], c), grad.dtype)
    _scatter_taps(dx, lambda i, j: share, kernel_size, stride, (1, 1), (ho, wo))
    return _crop(dx, padding, h, w)


def _matmul_macs(values: Sequence[Any], step: Any) -> int:
    """K multiply-accumulates per output element of a (batched, broadcast) matmul."""
    return math.prod(values[step.output].shape) * values[step.inputs[0]].shape[-1]


def _conv2d_macs(values: Sequence[Any], step: Any) -> int:
    """C_in / groups * kH * kW multiply-accumulates per output element of a conv2d."""
    _, c_in_g, kh, kw = values[step.inputs[1]].shape
    return math.prod(values[step.output].shape) * c_in_g * kh * kw


def _inner_dim(attrs_: dict[str, Any], shapes: list[tuple[int, ...]]) -> int:
    return shapes[0][-1]


def _weight_taps(attrs_: dict[str, Any], shapes: list[tuple[int, ...]]) -> int:
    return math.prod(shapes[1][1:])


def _kernel_taps(attrs_: dict[str, Any], shapes: list[tuple[int, ...]]) -> int:
    return math.prod(attrs_["kernel_size"])


def _replay_conv2d(b: Any, args: list[Any], scalar: float | None, attrs_: dict[str, Any]) -> Any:
    x, *rest = args
    weight = rest.pop(0)
    bias = replay_optional(rest, replay_flag(attrs_, "has_bias"))
    if rest:
        raise BinaryFormatError("conv2d: more inputs than its attrs say")
    return b.conv2d(x, weight, bias, **attrs_)


class MatmulConvOps(BuilderCore):
    """The matmul conv ops of `ProgramBuilder`."""

    @op("matmul", Kind.MATMUL_CONV, 2, _matmul, version=1, range_check=RangeCheck.RESULT,
        footprint=footprint.matmul_like(footprint.matmul_dims), macs=_matmul_macs, accumulates=_inner_dim,
        magnitude_bound=True)
    def matmul(self, a: Value, b: Value, *, loc: str | None = None) -> Value:
        """[..., M, K] @ [..., K, N]; batch dims broadcast as numpy's do, rank 1 is refused."""
        self._check_open()
        a, b = self._value("matmul", a), self._value("matmul", b)
        if len(a.shape) < 2 or len(b.shape) < 2:
            raise ShapeError(f"matmul needs operands of rank >= 2, got {a.shape} and {b.shape}")
        if a.shape[-1] != b.shape[-2]:
            raise ShapeError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape}")
        batch = _broadcast(a.shape[:-2], b.shape[:-2])
        if batch is None:
            raise ShapeError(f"matmul: batch dims of {a.shape} and {b.shape} do not broadcast")
        shape = batch + (a.shape[-2], b.shape[-1])
        return self._emit("matmul", [a, b], shape, _result_dtype("matmul", a.dtype, b.dtype))

    @op("conv2d", Kind.MATMUL_CONV, 3, _conv2d, version=2, float_only=True,
        footprint=footprint.matmul_like(footprint.conv2d_dims), macs=_conv2d_macs, accumulates=_weight_taps,
        magnitude_bound=True, replay=_replay_conv2d)
    def conv2d(self, x: Value, weight: Value, bias: Value | None = None, stride: int | Sequence[int] = 1,
               padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1,
               groups: int = 1, *, loc: str | None = None) -> Value:
        """2-D convolution (cross-correlation, as PyTorch's): x NHWC [N, H, W, C_in] (as ttnn),
        weight [C_out, C_in / groups, kH, kW] (PyTorch's), bias (C_out,); the result NHWC
        [N, H_out, W_out, C_out]. Floats only."""
        self._check_open()
        x, weight = self._value("conv2d", x), self._value("conv2d", weight)
        b = None if bias is None else self._value("conv2d", bias)
        if len(x.shape) != 4 or len(weight.shape) != 4:
            raise ShapeError(
                f"conv2d takes x [N, H, W, C_in] and weight [C_out, C_in/groups, kH, kW], got {x.shape} and {weight.shape}"
            )
        s, p, d = (_pair("conv2d", "stride", stride, 1), _pair("conv2d", "padding", padding, 0),
                   _pair("conv2d", "dilation", dilation, 1))
        g = _int("conv2d", "groups", groups, 1)
        c_in, (c_out, c_in_g, kh, kw) = x.shape[3], weight.shape
        if c_in % g or c_out % g or c_in_g * g != c_in:
            raise ShapeError(
                f"conv2d: x {x.shape} with {c_in} channels and weight {weight.shape} do not fit groups={g} "
                f"(the weight's dim 1 must be C_in / groups, C_out a multiple of groups)"
            )
        if b is not None and b.shape != (c_out,):
            raise ShapeError(f"conv2d: bias must have shape ({c_out},), got {b.shape}")
        out_hw = (_window_size(x.shape[1], kh, s[0], p[0], d[0]),
                  _window_size(x.shape[2], kw, s[1], p[1], d[1]))
        if min(out_hw) < 1:
            raise ShapeError(
                f"conv2d: kernel ({kh}, {kw}) with dilation {d} is larger than the padded input {x.shape}"
            )
        dtype = _result_dtype("conv2d", x.dtype, weight.dtype)
        if b is not None:
            dtype = _result_dtype("conv2d", dtype, b.dtype)
        inputs = [x, weight] if b is None else [x, weight, b]
        return self._emit("conv2d", inputs, (x.shape[0], *out_hw, c_out), dtype, stride=s, padding=p,
                          dilation=d, groups=g, has_bias=b is not None)

    def _pool(self, op: str, x: Value, kernel_size: int | Sequence[int],
              stride: int | Sequence[int] | None, padding: int | Sequence[int]) -> Value:
        self._check_open()
        x = self._value(op, x)
        k, s, p, out_shape = _pool_geometry(op, "x", x.shape, kernel_size, stride, padding)
        return self._emit(op, [x], out_shape, x.dtype, kernel_size=k, stride=s, padding=p)

    @op("max_pool2d", Kind.MATMUL_CONV, 1, _max_pool2d, version=2, accumulates=_kernel_taps)
    def max_pool2d(self, x: Value, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
                   padding: int | Sequence[int] = 0, *, loc: str | None = None) -> Value:
        """Window maxima of NHWC x (stride defaults to the kernel; -inf padding, at most half
        the kernel)."""
        return self._pool("max_pool2d", x, kernel_size, stride, padding)

    @op("avg_pool2d", Kind.MATMUL_CONV, 1, _avg_pool2d, version=2, float_only=True,
        accumulates=_kernel_taps, magnitude_bound=True)
    def avg_pool2d(self, x: Value, kernel_size: int | Sequence[int], stride: int | Sequence[int] | None = None,
                   padding: int | Sequence[int] = 0, *, loc: str | None = None) -> Value:
        """Window means of NHWC x (stride defaults to the kernel; zero padding counted in the
        divisor, PyTorch's count_include_pad=True). Floats only."""
        return self._pool("avg_pool2d", x, kernel_size, stride, padding)

    @op("conv2d_input_grad", Kind.MATMUL_CONV, 2, _conv2d_input_grad, version=3, float_only=True,
        footprint=footprint.matmul_like(footprint.channel_dims), magnitude_bound=True)
    def conv2d_input_grad(self, grad: Value, weight: Value, input_shape: Sequence[int],
                          stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                          dilation: int | Sequence[int] = 1, groups: int = 1, *, loc: str | None = None) -> Value:
        """The gradient of `conv2d(x, weight, ...)` with respect to x, given the gradient of
        its result: `grad` NHWC [N, H_out, W_out, C_out], `weight` [C_out, C_in / groups, kH,
        kW]; the result NHWC `input_shape` (it resolves H and W where a stride leaves them
        ambiguous). A transposed convolution, as aten.convolution_backward's grad_input.
        Floats only; the binary rule of grad and weight gives the dtype."""
        self._check_open()
        op = "conv2d_input_grad"
        grad, weight = self._value(op, grad), self._value(op, weight)
        x_shape = check_shape(input_shape)
        if len(x_shape) != 4 or len(grad.shape) != 4 or len(weight.shape) != 4:
            raise ShapeError(f"{op} takes grad [N, H_out, W_out, C_out], weight [C_out, C_in/groups, kH, kW] and "
                             f"input_shape [N, H, W, C_in], got {grad.shape}, {weight.shape} and {x_shape}")
        geometry = _conv_geometry(op, x_shape, weight.shape, grad.shape, stride, padding, dilation, groups)
        return self._emit(op, [grad, weight], x_shape, _result_dtype(op, grad.dtype, weight.dtype),
                          input_shape=x_shape, **geometry)

    @op("conv2d_weight_grad", Kind.MATMUL_CONV, 2, _conv2d_weight_grad, version=3, float_only=True,
        footprint=footprint.matmul_like(footprint.channel_dims), magnitude_bound=True)
    def conv2d_weight_grad(self, x: Value, grad: Value, weight_shape: Sequence[int],
                           stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
                           dilation: int | Sequence[int] = 1, groups: int = 1, *, loc: str | None = None) -> Value:
        """The gradient of `conv2d(x, weight, ...)` with respect to the weight, given the
        gradient of its result: x NHWC [N, H, W, C_in], `grad` NHWC [N, H_out, W_out, C_out];
        the result [C_out, C_in / groups, kH, kW] = `weight_shape` (PyTorch's layout), as
        aten.convolution_backward's grad_weight (the bias's is `grad` summed over N, H, W).
        Floats only; the binary rule of x and grad gives the dtype."""
        self._check_open()
        op = "conv2d_weight_grad"
        x, grad = self._value(op, x), self._value(op, grad)
        w_shape = check_shape(weight_shape)
        if len(x.shape) != 4 or len(grad.shape) != 4 or len(w_shape) != 4:
            raise ShapeError(f"{op} takes x [N, H, W, C_in], grad [N, H_out, W_out, C_out] and weight_shape "
                             f"[C_out, C_in/groups, kH, kW], got {x.shape}, {grad.shape} and {w_shape}")
        geometry = _conv_geometry(op, x.shape, w_shape, grad.shape, stride, padding, dilation, groups)
        return self._emit(op, [x, grad], w_shape, _result_dtype(op, x.dtype, grad.dtype),
                          weight_shape=w_shape, **geometry)

    @op("max_pool2d_backward", Kind.MATMUL_CONV, 2, _max_pool2d_backward, version=3)
    def max_pool2d_backward(self, x: Value, grad: Value, kernel_size: int | Sequence[int],
                            stride: int | Sequence[int] | None = None,
                            padding: int | Sequence[int] = 0, *, loc: str | None = None) -> Value:
        """The gradient of `max_pool2d(x, ...)` with respect to x, given the gradient of its
        result (NHWC, the pool's output shape): each window's gradient goes to the element
        PyTorch's CPU kernel picks, the first maximum in row-major window order (a later NaN
        wins over a number and over an earlier NaN; padding never), and overlapping windows add
        up. The result has x's shape and grad's dtype."""
        self._check_open()
        op = "max_pool2d_backward"
        x, grad = self._value(op, x), self._value(op, grad)
        k, s, p, out_shape = _pool_geometry(op, "x", x.shape, kernel_size, stride, padding)
        if grad.shape != out_shape:
            raise ShapeError(f"{op}: grad {grad.shape} is not the pool's output shape {out_shape} for x {x.shape}")
        return self._emit(op, [x, grad], x.shape, grad.dtype, kernel_size=k, stride=s, padding=p)

    @op("avg_pool2d_backward", Kind.MATMUL_CONV, 1, _avg_pool2d_backward, version=3, float_only=True,
        magnitude_bound=True)
    def avg_pool2d_backward(self, grad: Value, input_shape: Sequence[int], kernel_size: int | Sequence[int],
                            stride: int | Sequence[int] | None = None, padding: int | Sequence[int] = 0,
                            count_include_pad: bool = True, *, loc: str | None = None) -> Value:
        """The gradient of `avg_pool2d(x, ...)` with respect to x (NHWC `input_shape`), given
        the gradient of its result: each window's gradient divided by its divisor and spread
        over the window (overlaps add up). The divisor is kH * kW (`count_include_pad=True`, the
        forward's rule) or the number of the window's elements inside the input (False, as
        PyTorch's). Floats only; the result in grad's dtype."""
        self._check_open()
        op = "avg_pool2d_backward"
        grad = self._value(op, grad)
        x_shape = check_shape(input_shape)
        if not isinstance(count_include_pad, (bool, np.bool_)):
            raise ProgramError(f"{op}: count_include_pad must be a bool, got {count_include_pad!r:.40}")
        k, s, p, out_shape = _pool_geometry(op, "input_shape", x_shape, kernel_size, stride, padding)
        if grad.shape != out_shape:
            raise ShapeError(f"{op}: grad {grad.shape} is not the pool's output shape {out_shape} for input {x_shape}")
        return self._emit(op, [grad], x_shape, grad.dtype, input_shape=x_shape, kernel_size=k, stride=s,
                          padding=p, count_include_pad=bool(count_include_pad))
