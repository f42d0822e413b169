"""Matrix products, convolutions and pooling (NCHW in torch, NHWC on the device)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import ttflow as tt

from .graph import _T, _Lowering, _out, _register, _used

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


# -- matrix products ---------------------------------------------------------------------------------


@_register(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _mm(L: _Lowering, node: torch.fx.Node, a: _T, b: _T) -> Any:
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise L.unsupported("a rank-1 operand (mv or dot); reshape it to a matrix")
    dtype = _out(node).dtype
    return L.b.matmul(L.cast(a, dtype), L.cast(b, dtype))


@_register(aten.addmm.default, aten.baddbmm.default)
def _addmm(L: _Lowering, node: torch.fx.Node, bias: _T, a: _T, b: _T, beta: float = 1,
           alpha: float = 1) -> Any:
    dtype, bb = _out(node).dtype, L.b
    # bfloat16: the product stays float32 until the bias is added, then rounds once (as torch).
    compute = torch.float32 if dtype == torch.bfloat16 else dtype
    prod = bb.matmul(L.cast(a, compute), L.cast(b, dtype))
    if alpha != 1:
        prod = bb.mul(prod, alpha)
    if beta == 0:
        return prod
    c = L.cast(bias, dtype)
    if beta != 1:
        c = bb.mul(c, beta)
    return bb.add(prod, c)


# -- convolution and pooling (NCHW in torch, NHWC on the device) --------------------------------------


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, (list, tuple)):
        return (int(v[0]), int(v[-1])) if len(v) else (1, 1)
    return int(v), int(v)


@_register(aten.convolution.default)
def _convolution(L: _Lowering, node: torch.fx.Node, x: _T, w: _T, bias: _T | None, stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                 output_padding: Sequence[int], groups: int) -> Any:
    if transposed:
        return _transposed_convolution(L, node, x, w, bias, stride, padding, dilation, output_padding, groups)
    if len(x.shape) != 4:
        raise L.unsupported(f"a {len(x.shape) - 2}-d convolution (input {x.shape}); conv2d on NCHW lowers")
    dtype = _out(node).dtype
    y = L.b.conv2d(L.nchw_to_nhwc(L.cast(x, dtype)), L.cast(w, dtype),
                   None if bias is None else L.cast(bias, dtype),
                   stride=_pair(stride), padding=_pair(padding), dilation=_pair(dilation), groups=groups)
    return L.nhwc_to_nchw(y)


def _transposed_convolution(L: _Lowering, node: torch.fx.Node, x: _T, w: _T, bias: _T | None,
                            stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                            output_padding: Sequence[int], groups: int) -> Any:
    """ConvTranspose2d is the adjoint of conv2d with the same weight: conv2d's input gradient of
    x, into the output size torch's formula gives (output_padding picks among the sizes a stride
    leaves open), plus the bias per channel."""
    if len(x.shape) != 4:
        raise L.unsupported(f"a {len(x.shape) - 2}-d transposed convolution (input {x.shape}); 2-d lowers")
    dtype = _out(node).dtype
    s, p, d, o = _pair(stride), _pair(padding), _pair(dilation), _pair(output_padding)
    n, _, h, wd = x.shape
    k = w.shape[2:]
    size = [(i - 1) * s[j] - 2 * p[j] + d[j] * (k[j] - 1) + o[j] + 1 for j, i in enumerate((h, wd))]
    channels = w.shape[1] * groups
    y = L.b.conv2d_input_grad(L.nchw_to_nhwc(L.cast(x, dtype)), L.cast(w, dtype), (n, size[0], size[1], channels),
                              stride=s, padding=p, dilation=d, groups=groups)
    if bias is not None:
        y = L.b.add(y, L.cast(bias, dtype))
    return L.nhwc_to_nchw(y)


@_register(aten.convolution_backward.default)
def _convolution_backward(L: _Lowering, node: torch.fx.Node, grad: _T, x: _T, w: _T, bias_sizes: Any,
                          stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                          transposed: bool, output_padding: Sequence[int], groups: int,
                          output_mask: Sequence[bool]) -> Any:
    if len(x.shape) != 4 or (groups != 1 and not transposed):
        raise L.unsupported("only the backward of a 2-d convolution (groups=1 unless transposed) lowers")
    b, used = L.b, _used(node)
    s, p, d = _pair(stride), _pair(padding), _pair(dilation)
    g = L.nchw_to_nhwc(grad.v)
    gi = gw = gb = None
    # A transposed convolution is conv2d's adjoint: its input gradient is conv2d of grad, and
    # its weight gradient is conv2d's with the roles of x and grad swapped.
    if 0 in used and output_mask[0]:
        if transposed:
            gi = b.conv2d(g, w.v, None, stride=s, padding=p, dilation=d, groups=groups)
        else:
            n, c, h, wd = x.shape
            gi = b.conv2d_input_grad(g, w.v, (n, h, wd, c), s, p, d)
        gi = L.nhwc_to_nchw(gi)
    if 1 in used and output_mask[1]:
        xv = L.nchw_to_nhwc(x.v)
        gw = b.conv2d_weight_grad(*((g, xv) if transposed else (xv, g)), w.shape, s, p, d, groups)
    if 2 in used and output_mask[2]:
        v = grad.v
        for axis in (0, 2, 3):
            v = b.sum(v, axis)
        gb = b.reshape(v, (grad.shape[1],))
    return gi, gw, gb


def _pool_args(L: _Lowering, kernel: Any, stride: Any, padding: Any) -> tuple[tuple[int, int], ...]:
    k = _pair(kernel)
    s = k if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0) else _pair(stride)
    return k, s, _pair(padding)


def _as_batched(L: _Lowering, x: _T) -> Any:
    if len(x.shape) == 4:
        return x.v
    if len(x.shape) == 3:
        return L.b.reshape(x.v, (1, *x.shape))
    raise L.unsupported(f"pooling an input of shape {x.shape}; 2-d pooling takes [N, C, H, W]")


def _check_pool(L: _Lowering, node: torch.fx.Node, x: _T, k: tuple[int, int], s: tuple[int, int],
                p: tuple[int, int], ceil_mode: bool, dilation: Any = 1) -> None:
    if _pair(dilation) != (1, 1):
        raise L.unsupported("dilated pooling")
    if ceil_mode:
        floor = tuple((n + 2 * pp - kk) // ss + 1 for n, kk, ss, pp in zip(x.shape[-2:], k, s, p))
        if floor != tuple(_out(node)[0].shape[-2:] if isinstance(_out(node), tuple) else _out(node).shape[-2:]):
            raise L.unsupported("ceil_mode=True where it changes the output size")


@_register(aten.max_pool2d_with_indices.default)
def _max_pool2d_with_indices(L: _Lowering, node: torch.fx.Node, x: _T, kernel_size: Any, stride: Any = None,
                             padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> Any:
    """Values by `max_pool2d`. The indices are a placeholder (-1 everywhere): the backward
    lowering reads the forward input instead (max_pool2d_with_indices_backward below)."""
    k, s, p = _pool_args(L, kernel_size, stride, padding)
    _check_pool(L, node, x, k, s, p, ceil_mode, dilation)
    used, meta = _used(node), _out(node)
    values = indices = None
    if 0 in used:
        y = L.nhwc_to_nchw(L.b.max_pool2d(L.nchw_to_nhwc(_as_batched(L, x)), k, s, p))
        values = L.fit(y, meta[0].shape)
    if 1 in used:
        indices = L.full(meta[1].shape, -1, torch.int64)
        L.placeholders.add(indices.id)
    return values, indices


@_register(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward(L: _Lowering, node: torch.fx.Node, grad: _T, x: _T, kernel_size: Any, stride: Any,
                         padding: Any, dilation: Any, ceil_mode: bool, indices: _T) -> Any:
    k, s, p = _pool_args(L, kernel_size, stride, padding)
    _check_pool(L, node, x, k, s, p, False, dilation)
    g = L.nchw_to_nhwc(_as_batched(L, grad))
    xi = L.nchw_to_nhwc(_as_batched(L, x))
    return L.fit(L.nhwc_to_nchw(L.b.max_pool2d_backward(xi, g, k, s, p)), x.shape)


def _check_avg(L: _Lowering, p: tuple[int, int], count_include_pad: bool, divisor_override: Any) -> None:
    if divisor_override is not None:
        raise L.unsupported("divisor_override")
    if not count_include_pad and p != (0, 0):
        raise L.unsupported("count_include_pad=False with padding")


@_register(aten.avg_pool2d.default)
def _avg_pool2d(L: _Lowering, node: torch.fx.Node, x: _T, kernel_size: Any, stride: Any = None, padding: Any = 0,
                ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: Any = None) -> Any:
    k, s, p = _pool_args(L, kernel_size, stride, padding)
    _check_pool(L, node, x, k, s, p, ceil_mode)
    _check_avg(L, p, count_include_pad, divisor_override)
    y = L.nhwc_to_nchw(L.b.avg_pool2d(L.nchw_to_nhwc(_as_batched(L, x)), k, s, p))
    return L.fit(y, _out(node).shape)


@_register(aten.avg_pool2d_backward.default)
def _avg_pool2d_backward(L: _Lowering, node: torch.fx.Node, grad: _T, x: _T, kernel_size: Any, stride: Any,
                         padding: Any, ceil_mode: bool, count_include_pad: bool, divisor_override: Any) -> Any:
    k, s, p = _pool_args(L, kernel_size, stride, padding)
    _check_avg(L, p, count_include_pad, divisor_override)
    xs = (1, *x.shape) if len(x.shape) == 3 else x.shape
    n, c, h, w = xs
    g = L.nchw_to_nhwc(_as_batched(L, grad))
    return L.fit(L.nhwc_to_nchw(L.b.avg_pool2d_backward(g, (n, h, w, c), k, s, p)), x.shape)
