"""Matrix products, convolutions and pooling (NCHW in torch, NHWC on the device)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import ttflow as tt

from .graph import _T, _dim, _Lowering, _out, _register, _used

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


# -- matrix products ---------------------------------------------------------------------------------


@_register(aten.mm.default, aten.bmm.default, aten.matmul.default, aten.mv.default, aten.dot.default)
def _mm(L: _Lowering, node: torch.fx.Node, a: _T, b: _T) -> Any:
    dtype = _out(node).dtype
    return L.fit(_product(L, L.cast(a, dtype), L.cast(b, dtype)), _out(node).shape)


def _product(L: _Lowering, av: Any, bv: Any) -> Any:
    """`matmul(av, bv)` with numpy's rank-1 rule: a vector is a row on the left, a column on
    the right (the caller fits the result to torch's shape)."""
    if len(av.shape) == 1:
        av = L.b.reshape(av, (1, av.shape[0]))
    if len(bv.shape) == 1:
        bv = L.b.reshape(bv, (bv.shape[0], 1))
    return L.b.matmul(av, bv)


@_register(aten.addmm.default, aten.baddbmm.default, aten.addmv.default)
def _addmm(L: _Lowering, node: torch.fx.Node, bias: _T, a: _T, b: _T, beta: float = 1,
           alpha: float = 1) -> Any:
    dtype = _out(node).dtype
    # bfloat16: the product stays float32 until the bias is added, then rounds once (as torch).
    compute = torch.float32 if dtype == torch.bfloat16 else dtype
    prod = L.fit(_product(L, L.cast(a, compute), L.cast(b, dtype)), _out(node).shape)
    return _scaled_sum(L, prod, bias, beta, alpha, dtype)


def _scaled_sum(L: _Lowering, prod: Any, bias: _T, beta: float, alpha: float, dtype: torch.dtype) -> Any:
    """`beta * bias + alpha * prod` as torch's addmm family computes it: beta == 0 ignores the
    bias (its NaN and inf too)."""
    bb = L.b
    if alpha != 1:
        prod = bb.mul(prod, L.operand(alpha, dtype))
    if beta == 0:
        return prod
    c = L.cast(bias, dtype)
    if beta != 1:
        c = bb.mul(c, L.operand(beta, dtype))
    return bb.add(prod, c)


@_register(aten.addbmm.default)
def _addbmm(L: _Lowering, node: torch.fx.Node, bias: _T, a: _T, b: _T, beta: float = 1,
            alpha: float = 1) -> Any:
    """The sum over the batch of `a[i] @ b[i]` as one matmul: [n, B*k] @ [B*k, p]."""
    dtype, bb = _out(node).dtype, L.b
    nb, n, k = a.shape
    p = b.shape[2]
    av = bb.reshape(bb.permute(L.cast(a, dtype), (1, 0, 2)), (n, nb * k))
    bv = bb.reshape(L.cast(b, dtype), (nb * k, p))
    return _scaled_sum(L, bb.matmul(av, bv), bias, beta, alpha, dtype)


@_register(aten.diagonal.default)
def _diagonal(L: _Lowering, node: torch.fx.Node, x: _T, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Any:
    """dim1 and dim2 moved last and flattened; the diagonal is a strided slice of that row
    (step n2 + 1), put last as torch puts it."""
    bb, rank = L.b, len(x.shape)
    d1, d2 = _dim(dim1, rank), _dim(dim2, rank)
    rest = [d for d in range(rank) if d not in (d1, d2)]
    n1, n2 = x.shape[d1], x.shape[d2]
    count = _out(node).shape[-1]
    v = x.v if rest + [d1, d2] == list(range(rank)) else bb.permute(x.v, (*rest, d1, d2))
    v = bb.reshape(v, (*(x.shape[d] for d in rest), n1 * n2))
    start = offset if offset >= 0 else -offset * n2
    v = bb.slice(v, [0] * len(rest) + [start], [None] * len(rest) + [start + (count - 1) * (n2 + 1) + 1],
                 [1] * len(rest) + [n2 + 1])
    return L.fit(v, _out(node).shape)


@_register(aten.diagonal_scatter.default)
def _diagonal_scatter(L: _Lowering, node: torch.fx.Node, x: _T, src: _T, offset: int = 0, dim1: int = 0,
                      dim2: int = 1) -> Any:
    """diagonal's backward: src spread along the flattened (dim1, dim2) row at stride n2 + 1
    (each element followed by n2 zeros), and selected into x where a 1/0 mask spread alike is 1."""
    bb, rank, dtype = L.b, len(x.shape), _out(node).dtype
    d1, d2 = _dim(dim1, rank), _dim(dim2, rank)
    rest = [d for d in range(rank) if d not in (d1, d2)]
    lead = tuple(x.shape[d] for d in rest)
    n1, n2 = x.shape[d1], x.shape[d2]
    count = src.shape[-1]
    start = offset if offset >= 0 else -offset * n2
    order = (*rest, d1, d2)
    v = L.cast(x, dtype)
    if list(order) != list(range(rank)):
        v = bb.permute(v, order)
    v = bb.reshape(v, (*lead, n1 * n2))

    def spread(w: Any) -> Any:
        w = bb.reshape(w, (*lead, count, 1))
        w = bb.concat([w, bb.full((*lead, count, n2), 0, w.dtype)], len(lead) + 1)
        w = bb.reshape(w, (*lead, count * (n2 + 1)))
        parts = [bb.full((*lead, start), 0, w.dtype)] if start else []
        used = min(count * (n2 + 1), n1 * n2 - start)
        parts.append(w if used == count * (n2 + 1) else bb.slice(w, [0] * len(lead) + [0],
                                                                 [None] * len(lead) + [used]))
        if start + used < n1 * n2:
            parts.append(bb.full((*lead, n1 * n2 - start - used), 0, w.dtype))
        return parts[0] if len(parts) == 1 else bb.concat(parts, len(lead))

    mask = spread(bb.full((*lead, count), 1, _I32))
    out = bb.where(mask, spread(L.fit(L.cast(src, dtype), (*lead, count))), v)
    out = bb.reshape(out, (*lead, n1, n2))
    if list(order) != list(range(rank)):
        out = bb.permute(out, [order.index(d) for d in range(rank)])
    return out


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
    if not dtype.is_floating_point:
        return L.nhwc_to_nchw(_integer_conv2d(L, node, L.nchw_to_nhwc(L.cast(x, dtype)), L.cast(w, dtype),
                                              None if bias is None else L.cast(bias, dtype),
                                              _pair(stride), _pair(padding), _pair(dilation), groups))
    y = L.b.conv2d(L.nchw_to_nhwc(L.cast(x, dtype)), L.cast(w, dtype),
                   None if bias is None else L.cast(bias, dtype),
                   stride=_pair(stride), padding=_pair(padding), dilation=_pair(dilation), groups=groups)
    return L.nhwc_to_nchw(y)


def _integer_conv2d(L: _Lowering, node: torch.fx.Node, x: Any, w: Any, bias: Any, s: tuple[int, int],
                    p: tuple[int, int], d: tuple[int, int], groups: int) -> Any:
    """An integer conv2d, exact as CPU torch's: im2col by one strided slice per tap (NHWC),
    one integer matmul per group (int64 sums, range-checked for an int64 result)."""
    bb = L.b
    n = x.shape[0]
    c_out, c_in_g, kh, kw = w.shape
    ho, wo = _out(node).shape[-2:]
    for axis, pad in ((1, p[0]), (2, p[1])):
        if pad:
            side = list(x.shape)
            side[axis] = pad
            zeros = bb.full(tuple(side), 0, x.dtype)
            x = bb.concat([zeros, x, zeros], axis)
    taps = [bb.slice(x, [0, i * d[0], j * d[1]], [None, i * d[0] + (ho - 1) * s[0] + 1, j * d[1] + (wo - 1) * s[1] + 1],
                     [1, s[0], s[1]]) for i in range(kh) for j in range(kw)]
    wt = bb.permute(w, (2, 3, 1, 0))  # [kH, kW, C_in/groups, C_out]: im2col's row order
    c_out_g, outs = c_out // groups, []
    for gr in range(groups):
        cols = [t if groups == 1 else bb.slice(t, [0, 0, 0, gr * c_in_g], [None, None, None, (gr + 1) * c_in_g])
                for t in taps]
        col = cols[0] if len(cols) == 1 else bb.concat(cols, 3)
        wg = wt if groups == 1 else bb.slice(wt, [0, 0, 0, gr * c_out_g], [None, None, None, (gr + 1) * c_out_g])
        outs.append(bb.matmul(bb.reshape(col, (n * ho * wo, kh * kw * c_in_g)), bb.reshape(wg, (kh * kw * c_in_g, c_out_g))))
    y = bb.reshape(outs[0] if groups == 1 else bb.concat(outs, 1), (n, ho, wo, c_out))
    return y if bias is None else bb.add(y, bias)


def _transposed_convolution(L: _Lowering, node: torch.fx.Node, x: _T, w: _T, bias: _T | None,
                            stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                            output_padding: Sequence[int], groups: int) -> Any:
    """ConvTranspose2d is the adjoint of conv2d with the same weight: conv2d's input gradient of
    x, into the output size torch's formula gives (output_padding picks among the sizes a stride
    leaves open), plus the bias per channel."""
    if len(x.shape) != 4:
        raise L.unsupported(f"a {len(x.shape) - 2}-d transposed convolution (input {x.shape}); 2-d lowers")
    dtype = _out(node).dtype
    if not dtype.is_floating_point:
        raise L.unsupported(f"an integer ({dtype}) transposed convolution; the device's is float32")
    s, p, d, o = _pair(stride), _pair(padding), _pair(dilation), _pair(output_padding)
    n, _, h, wd = x.shape
    k = w.shape[2:]
    size = [(i - 1) * s[j] - 2 * p[j] + d[j] * (k[j] - 1) + o[j] + 1 for j, i in enumerate((h, wd))]
    channels = w.shape[1] * groups
    if all(o[j] < s[j] for j in range(2)):
        y = L.b.conv2d_input_grad(L.nchw_to_nhwc(L.cast(x, dtype)), L.cast(w, dtype),
                                  (n, size[0], size[1], channels), stride=s, padding=p, dilation=d, groups=groups)
    else:
        y = _wide_transposed(L, L.nchw_to_nhwc(L.cast(x, dtype)), L.cast(w, dtype), size, channels, s, p, d, groups)
    if bias is not None:
        y = L.b.add(y, L.cast(bias, dtype))
    return L.nhwc_to_nchw(y)


def _wide_transposed(L: _Lowering, x: Any, w: Any, size: Sequence[int], channels: int, s: tuple[int, int],
                     p: tuple[int, int], d: tuple[int, int], groups: int) -> Any:
    """A transposed convolution whose output_padding reaches a stride or more (allowed below
    the dilation): conv2d's input gradient into the whole unpadded output, which every tap
    reaches, then torch's window [p, p + size) of it, zeros past its end."""
    bb = L.b
    n, h, wd, _ = x.shape
    k = w.shape[2:]
    full = [(i - 1) * s[j] + d[j] * (k[j] - 1) + 1 for j, i in enumerate((h, wd))]
    y = bb.conv2d_input_grad(x, w, (n, full[0], full[1], channels), stride=s, padding=0, dilation=d, groups=groups)
    y = bb.slice(y, [0, p[0], p[1]], [None, min(p[0] + size[0], full[0]), min(p[1] + size[1], full[1])])
    for axis, j in ((1, 0), (2, 1)):
        short = p[j] + size[j] - full[j]
        if short > 0:
            shape = list(y.shape)
            shape[axis] = short
            y = bb.concat([y, bb.full(tuple(shape), 0, y.dtype)], axis)
    return y


def _unpadded_frame(L: _Lowering, g: Any, x_hw: Sequence[int], k: Sequence[int], s: tuple[int, int],
                    p: tuple[int, int], d: tuple[int, int]) -> Any:
    """The gradient of `_wide_transposed`'s output, in its whole unpadded frame: grad placed at
    [p, p + size), zeros before, and the part past the frame (which no tap reaches) dropped."""
    bb = L.b
    for axis, j in ((1, 0), (2, 1)):
        full = (x_hw[j] - 1) * s[j] + d[j] * (k[j] - 1) + 1
        size = g.shape[axis]
        if p[j] + size > full:
            ends: list[int | None] = [None, None, None]
            ends[axis] = full - p[j]
            g = bb.slice(g, [0, 0, 0], ends)
        size = g.shape[axis]
        before, after = list(g.shape), list(g.shape)
        before[axis], after[axis] = p[j], full - p[j] - size
        parts = [bb.full(tuple(before), 0, g.dtype)] if p[j] else []
        parts.append(g)
        if after[axis] > 0:
            parts.append(bb.full(tuple(after), 0, g.dtype))
        g = parts[0] if len(parts) == 1 else bb.concat(parts, axis)
    return g


@_register(aten.convolution_backward.default)
def _convolution_backward(L: _Lowering, node: torch.fx.Node, grad: _T, x: _T, w: _T, bias_sizes: Any,
                          stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                          transposed: bool, output_padding: Sequence[int], groups: int,
                          output_mask: Sequence[bool]) -> Any:
    if len(x.shape) != 4:
        raise L.unsupported("only the backward of a 2-d convolution lowers")
    b, used = L.b, _used(node)
    s, p, d = _pair(stride), _pair(padding), _pair(dilation)
    g = L.nchw_to_nhwc(grad.v)
    if transposed and any(o >= ss for o, ss in zip(_pair(output_padding), s)):
        g, p = _unpadded_frame(L, g, x.shape[2:], w.shape[2:], s, p, d), (0, 0)
    gi = gw = gb = None
    # A transposed convolution is conv2d's adjoint: its input gradient is conv2d of grad, and
    # its weight gradient is conv2d's with the roles of x and grad swapped.
    if 0 in used and output_mask[0]:
        if transposed:
            gi = b.conv2d(g, w.v, None, stride=s, padding=p, dilation=d, groups=groups)
        else:
            n, c, h, wd = x.shape
            gi = b.conv2d_input_grad(g, w.v, (n, h, wd, c), s, p, d, groups)
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


def _extra(n: int, out: int, k: int, s: int, p: int) -> int:
    """Pixels past the right padding the last window reaches (ceil_mode): the device's pools
    take floor's output size, so the input grows by that many and keeps floor's formula."""
    return max(0, (out - 1) * s + k - (n + 2 * p))


def _grow(L: _Lowering, v: Any, extra: Sequence[int], fill: float) -> Any:
    """NHWC `v` with `extra` rows and columns of `fill` appended at the bottom and right."""
    bb = L.b
    for axis, e in ((1, extra[0]), (2, extra[1])):
        if e:
            shape = list(v.shape)
            shape[axis] = e
            v = bb.concat([v, bb.full(tuple(shape), fill, v.dtype)], axis)
    return v


def _crop(L: _Lowering, v: Any, hw: Sequence[int]) -> Any:
    if tuple(v.shape[1:3]) == tuple(hw):
        return v
    return L.b.slice(v, [0, 0, 0], [None, hw[0], hw[1]])


def _pool_plan(L: _Lowering, x_shape: Sequence[int], out_hw: Sequence[int], k: tuple[int, int],
               s: tuple[int, int], p: tuple[int, int], dilation: Any = 1) -> tuple[int, int]:
    if _pair(dilation) != (1, 1):
        raise L.unsupported("dilated pooling")
    e = tuple(_extra(n, o, kk, ss, pp) for n, o, kk, ss, pp in zip(x_shape[-2:], out_hw, k, s, p))
    return e[0], e[1]


def _lowest(dtype: tt.DataType) -> float:
    return float("-inf") if dtype.is_float else -(2**31)


@_register(aten.max_pool2d_with_indices.default)
def _max_pool2d_with_indices(L: _Lowering, node: torch.fx.Node, x: _T, kernel_size: Any, stride: Any = None,
                             padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> Any:
    """Values by `max_pool2d` (ceil_mode: the input grown by -inf where the last window reaches
    past it). The indices, where only the backward reads them, are a placeholder (-1
    everywhere): the backward lowering reads the forward input instead
    (max_pool2d_with_indices_backward below). Where anything else does (the user, max_unpool),
    they are computed as CPU torch does (`_max_pool_indices`)."""
    k, s, p = _pool_args(L, kernel_size, stride, padding)
    used, meta = _used(node), _out(node)
    extra = _pool_plan(L, x.shape, meta[0].shape[-2:], k, s, p, dilation)
    values = indices = None
    if 0 in used:
        xv = L.nchw_to_nhwc(_as_batched(L, x))
        y = L.nhwc_to_nchw(L.b.max_pool2d(_grow(L, xv, extra, _lowest(xv.dtype)), k, s, p))
        values = L.fit(y, meta[0].shape)
    if 1 in used:
        if L.only_saved(node, 1, _READ_POOLED_INPUT):
            indices = L.full(meta[1].shape, -1, torch.int64)
            L.placeholders.add(indices.id)
        else:
            indices = L.fit(_max_pool_indices(L, x, k, s, p, meta[1].shape[-2:]), meta[1].shape)
    return values, indices


_READ_POOLED_INPUT = frozenset({aten.max_pool2d_with_indices_backward.default})
"""Ops that read max-pool indices and ignore them (the backward reads the pooled input)."""


def _max_pool_indices(L: _Lowering, x: _T, k: tuple[int, int], s: tuple[int, int], p: tuple[int, int],
                      out_hw: Sequence[int]) -> Any:
    """Each window's argmax as a flat index h * W + w into its input plane, as CPU torch's
    max_pool2d finds it: the window's in-bounds taps in row-major order, a tap taken when its
    value is greater than the best so far or NaN (so a later NaN wins), the first in-bounds tap
    when none is (all -inf). One strided slice of the padded input a tap, NCHW."""
    bb = L.b
    v = _as_batched(L, x)  # [N, C, H, W]
    n, c, h, w = v.shape
    (kh, kw), (sh, sw), (ph, pw), (ho, wo) = k, s, p, tuple(out_hw)
    fill = _lowest(v.dtype)
    for axis, size, pad, need in ((2, h, ph, (ho - 1) * sh + kh), (3, w, pw, (wo - 1) * sw + kw)):
        after = max(0, need - size - pad)
        parts = []
        for extent in (pad, None, after):
            if extent is None:
                parts.append(v)
            elif extent:
                shape = list(v.shape)
                shape[axis] = extent
                parts.append(bb.full(tuple(shape), fill, v.dtype))
        v = bb.concat(parts, axis) if len(parts) > 1 else v
    best = bb.full((n, c, ho, wo), fill, v.dtype)
    index = bb.full((n, c, ho, wo), 0, _I32)
    found = bb.full((n, c, ho, wo), 0, _F32)
    for i in range(kh):
        rows = bb.reshape(bb.arange(i - ph, i - ph + sh * ho, sh), (ho, 1))  # the tap's input row
        row_ok = bb.mul(bb.ge(rows, 0), bb.lt(rows, h))
        for j in range(kw):
            cols = bb.reshape(bb.arange(j - pw, j - pw + sw * wo, sw), (1, wo))
            inside = bb.mul(row_ok, bb.mul(bb.ge(cols, 0), bb.lt(cols, w)))  # [Ho, Wo] 1/0
            tap = bb.slice(v, [0, 0, i, j], [None, None, i + (ho - 1) * sh + 1, j + (wo - 1) * sw + 1],
                           [1, 1, sh, sw])
            better = bb.maximum(bb.gt(tap, best), bb.ne(tap, tap))  # greater, or NaN
            take = bb.where(inside, bb.where(found, better, 1.0), 0.0)
            best = bb.where(take, tap, best)
            index = bb.where(take, bb.add(bb.mul(rows, w), cols), index)
            found = bb.where(inside, 1.0, found)
    return index


@_register(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward(L: _Lowering, node: torch.fx.Node, grad: _T, x: _T, kernel_size: Any, stride: Any,
                         padding: Any, dilation: Any, ceil_mode: bool, indices: _T) -> Any:
    """The grown input's gradient (the -inf pixels after the real ones in each window never
    win over them: the first maximum wins), cropped back to x."""
    k, s, p = _pool_args(L, kernel_size, stride, padding)
    extra = _pool_plan(L, x.shape, grad.shape[-2:], k, s, p, dilation)
    g = L.nchw_to_nhwc(_as_batched(L, grad))
    xi = L.nchw_to_nhwc(_as_batched(L, x))
    gi = L.b.max_pool2d_backward(_grow(L, xi, extra, _lowest(xi.dtype)), g, k, s, p)
    return L.fit(L.nhwc_to_nchw(_crop(L, gi, x.shape[-2:])), x.shape)


def _divisors(n: int, out: int, k: int, s: int, p: int, count_include_pad: bool) -> list[int]:
    """Each output position's divisor along one axis, as torch's CPU kernel computes it: the
    window clipped to the padded input (count_include_pad), or to the input."""
    sizes = []
    for o in range(out):
        start = o * s - p
        end = min(start + k, n + p)
        if not count_include_pad:
            start, end = max(start, 0), min(end, n)
        sizes.append(max(end - start, 1))  # a window of padding alone sums nothing: 0 / 1
    return sizes


def _host_vector(L: _Lowering, values: Sequence[float], dtype: tt.DataType) -> Any:
    """A constant (len(values),) value: one `full` per run of equal values, concatenated."""
    parts, i = [], 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        parts.append(L.b.full((j - i,), values[i], dtype))
        i = j
    return parts[0] if len(parts) == 1 else L.b.concat(parts, 0)


def _avg_divisor(L: _Lowering, x_hw: Sequence[int], out_hw: Sequence[int], k: tuple[int, int],
                 s: tuple[int, int], p: tuple[int, int], count_include_pad: bool, divisor_override: Any,
                 dtype: tt.DataType) -> Any:
    """The divisor of each output pixel, (Ho, Wo, 1) for NHWC, or a number; None when it is
    kH * kW everywhere (the device's avg_pool2d's own)."""
    if divisor_override is not None:
        return float(divisor_override) if dtype.is_float else int(divisor_override)
    dh, dw = (_divisors(n, o, kk, ss, pp, count_include_pad) for n, o, kk, ss, pp in zip(x_hw, out_hw, k, s, p))
    if set(dh) == {k[0]} and set(dw) == {k[1]}:
        return None
    cast = float if dtype.is_float else int
    return L.b.mul(L.b.reshape(_host_vector(L, [cast(d) for d in dh], dtype), (len(dh), 1, 1)),
                   L.b.reshape(_host_vector(L, [cast(d) for d in dw], dtype), (1, len(dw), 1)))


def _window_sum(L: _Lowering, v: Any, out_hw: Sequence[int], k: tuple[int, int], s: tuple[int, int],
                p: tuple[int, int]) -> Any:
    """Each window's sum of NHWC `v` (zero padding), tap by tap in row-major window order, as
    torch's CPU kernel adds them: one strided slice per tap."""
    bb = L.b
    for axis, pad in ((2, p[1]), (1, p[0])):
        if pad:
            side = list(v.shape)
            side[axis] = pad
            zeros = bb.full(tuple(side), 0, v.dtype)
            v = bb.concat([zeros, v, zeros], axis)
    total = None
    for i in range(k[0]):
        for j in range(k[1]):
            tap = bb.slice(v, [0, i, j], [None, i + (out_hw[0] - 1) * s[0] + 1, j + (out_hw[1] - 1) * s[1] + 1],
                           [1, s[0], s[1]])
            total = tap if total is None else bb.add(total, tap)
    return total


def _pool_args_avg(L: _Lowering, x_shape: Sequence[int], out_hw: Sequence[int], kernel_size: Any, stride: Any,
                   padding: Any) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]:
    k, s, p = _pool_args(L, kernel_size, stride, padding)
    return k, s, p, _pool_plan(L, x_shape, out_hw, k, s, p)


@_register(aten.avg_pool2d.default)
def _avg_pool2d(L: _Lowering, node: torch.fx.Node, x: _T, kernel_size: Any, stride: Any = None, padding: Any = 0,
                ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: Any = None) -> Any:
    """Floats: `avg_pool2d` of the input grown by zeros where ceil_mode's last window reaches
    past it, rescaled by kH * kW / divisor where torch's divisor is not kH * kW (a window cut by
    the input's end, count_include_pad=False, divisor_override). Integers: the window sums in
    int64, then torch's division, which truncates."""
    bb, meta = L.b, _out(node)
    out_hw = meta.shape[-2:]
    k, s, p, extra = _pool_args_avg(L, x.shape, out_hw, kernel_size, stride, padding)
    xv = L.nchw_to_nhwc(_as_batched(L, x))
    div = _avg_divisor(L, x.shape[-2:], out_hw, k, s, p, count_include_pad, divisor_override, xv.dtype)
    if not xv.dtype.is_float:
        total = _window_sum(L, _grow(L, xv, extra, 0), out_hw, k, s, p)
        d = k[0] * k[1] if div is None else div
        y = bb.floor_divide(bb.sub(total, bb.fmod(total, d)), d)
    else:
        y = bb.avg_pool2d(_grow(L, xv, extra, 0.0), k, s, p)
        if div is not None:
            y = bb.div(bb.mul(y, float(k[0] * k[1])), div)
    return L.fit(L.nhwc_to_nchw(y), meta.shape)


@_register(aten.avg_pool2d_backward.default)
def _avg_pool2d_backward(L: _Lowering, node: torch.fx.Node, grad: _T, x: _T, kernel_size: Any, stride: Any,
                         padding: Any, ceil_mode: bool, count_include_pad: bool, divisor_override: Any) -> Any:
    """The adjoint of the forward: grad rescaled by kH * kW / divisor, spread by
    `avg_pool2d_backward` over the grown input, cropped back to x."""
    bb = L.b
    out_hw = grad.shape[-2:]
    k, s, p, extra = _pool_args_avg(L, x.shape, out_hw, kernel_size, stride, padding)
    xs = (1, *x.shape) if len(x.shape) == 3 else x.shape
    n, c, h, w = xs
    g = L.nchw_to_nhwc(_as_batched(L, grad))
    div = _avg_divisor(L, (h, w), out_hw, k, s, p, count_include_pad, divisor_override, g.dtype)
    if div is not None:
        g = bb.div(bb.mul(g, float(k[0] * k[1])), div)
    gi = bb.avg_pool2d_backward(g, (n, h + extra[0], w + extra[1], c), k, s, p)
    return L.fit(L.nhwc_to_nchw(_crop(L, gi, (h, w))), x.shape)


# -- resampling: a constant matrix per spatial axis -----------------------------------------------------
#
# Interpolation and adaptive average pooling are linear and separable: along each spatial axis,
# output = M @ input with a constant (out, in) matrix M, and the backward is M's transpose. M is
# computed on the host the way torch's CPU kernels compute their source indices (in float32,
# their opmath type, so each index is torch's) and weights.


def _f32(v: float) -> np.float32:
    return np.float32(v)


def _linear_scale(n_in: int, n_out: int, align_corners: bool, scale: float | None) -> np.float32:
    """`area_pixel_compute_scale<float>`."""
    if align_corners:
        return _f32((n_in - 1) / (n_out - 1)) if n_out > 1 else _f32(0)
    if scale is not None and scale > 0:
        return _f32(1.0 / scale)
    return _f32(n_in) / _f32(n_out)


def _source(scale: np.float32, dst: int, align_corners: bool, cubic: bool) -> np.float32:
    """`area_pixel_compute_source_index<float>`."""
    if align_corners:
        return scale * _f32(dst)
    src = scale * (_f32(dst) + _f32(0.5)) - _f32(0.5)
    return src if cubic or src >= 0 else _f32(0)


def _linear_matrix(n_in: int, n_out: int, align_corners: bool, scale: float | None) -> np.ndarray[Any, Any]:
    """Linear interpolation's weights along one axis; an axis whose size does not change is
    copied, whatever the scale factor says (CPU torch's kernels skip it: a factor of 1.25 on 2
    pixels keeps 2, each itself, where the 0.8 spacing alone would blend them)."""
    if n_in == n_out:
        return np.eye(n_in)
    m = np.zeros((n_out, n_in))
    sc = _linear_scale(n_in, n_out, align_corners, scale)
    for o in range(n_out):
        real = _source(sc, o, align_corners, False)
        i0 = min(int(np.floor(real)), n_in - 1)
        lam = float(min(max(real - _f32(i0), _f32(0)), _f32(1)))
        i1 = i0 + (1 if i0 < n_in - 1 else 0)
        m[o, i0] += 1 - lam
        m[o, i1] += lam
    return m


def _cubic_matrix(n_in: int, n_out: int, align_corners: bool, scale: float | None) -> np.ndarray[Any, Any]:
    """upsample_bicubic2d's taps: four around floor(source), clamped to the edge, Keys' kernel
    with A = -0.75."""
    a = -0.75
    m = np.zeros((n_out, n_in))
    sc = _linear_scale(n_in, n_out, align_corners, scale)
    for o in range(n_out):
        real = _source(sc, o, align_corners, True)
        i = int(np.floor(real))
        t = float(real - _f32(i))
        x1, x2 = t + 1, 1 - t
        w = [((a * x1 - 5 * a) * x1 + 8 * a) * x1 - 4 * a, ((a + 2) * t - (a + 3)) * t * t + 1,
             ((a + 2) * x2 - (a + 3)) * x2 * x2 + 1, ((a * (x2 + 1) - 5 * a) * (x2 + 1) + 8 * a) * (x2 + 1) - 4 * a]
        for k in range(4):
            m[o, min(max(i - 1 + k, 0), n_in - 1)] += w[k]
    return m


def _nearest_matrix(n_in: int, n_out: int, scale: float | None, exact: bool) -> np.ndarray[Any, Any]:
    """`nearest_idx` / `nearest_exact_idx`: floor((dst [+ 0.5]) * scale) in float32."""
    m = np.zeros((n_out, n_in))
    sc = _f32(1.0 / scale) if scale is not None and scale > 0 else _f32(n_in) / _f32(n_out)
    for o in range(n_out):
        if n_out == n_in:
            i = o
        elif n_out == 2 * n_in and not exact:
            i = o >> 1
        else:
            i = min(int(np.floor((_f32(o) + _f32(0.5 if exact else 0)) * sc)), n_in - 1)
        m[o, i] = 1
    return m


def _adaptive_matrix(n_in: int, n_out: int) -> np.ndarray[Any, Any]:
    """Adaptive average pooling: output o averages input [floor(o * in / out), ceil((o + 1) * in / out))."""
    m = np.zeros((n_out, n_in))
    for o in range(n_out):
        start, end = (o * n_in) // n_out, -(-((o + 1) * n_in) // n_out)
        m[o, start:end] = 1 / (end - start)
    return m


def _apply_matrices(L: _Lowering, v: Any, mats: Sequence[np.ndarray[Any, Any]], dtype: tt.DataType) -> Any:
    """`v` [N, C, *spatial] (or without N) with each of its last len(mats) axes multiplied by
    its matrix (out, in): moved last, flattened to 2-d, one matmul by the constant M^T."""
    bb = L.b
    rank = len(v.shape)
    for j, m in enumerate(mats):
        axis = rank - len(mats) + j
        if m.shape[0] == m.shape[1] and np.array_equal(m, np.eye(m.shape[0])):
            continue
        if not dtype.is_float and not np.array_equal(m, np.round(m)):
            raise L.unsupported("an integer tensor resampled with fractional weights")
        order = [d for d in range(rank) if d != axis] + [axis]
        moved = v if axis == rank - 1 else bb.permute(v, order)
        lead = moved.shape[:-1]
        flat = bb.reshape(moved, (math.prod(lead), m.shape[1]))
        mt = m.T
        cast = float if dtype.is_float else int
        const = bb.reshape(_host_vector(L, [cast(e) for e in mt.reshape(-1)], dtype), mt.shape)
        out = bb.reshape(bb.matmul(flat, const), (*lead, m.shape[0]))
        v = out if axis == rank - 1 else bb.permute(out, [order.index(d) for d in range(rank)])
    return v


def _scales(args: Sequence[Any], count: int) -> list[float | None]:
    found = [None if a is None else float(a) for a in args[:count]]
    return found + [None] * (count - len(found))


def _resampler(kind: str, spatial: int, backward: bool) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, x: _T, *args: Any) -> Any:
        if backward:
            output_size, input_size, *rest = args
            sizes_in, sizes_out = list(input_size)[-spatial:], list(output_size)[-spatial:]
        else:
            output_size, *rest = args
            sizes_in, sizes_out = list(x.shape[-spatial:]), list(output_size)[-spatial:]
        align = bool(rest.pop(0)) if kind in ("linear", "cubic") else False
        scales = _scales(rest, spatial)
        mats = []
        for n_in, n_out, scale in zip(sizes_in, sizes_out, scales):
            if backward and kind == "cubic" and sizes_in == sizes_out:
                # CPU torch's bicubic backward copies the gradient when no size changes (its
                # forward does not: it applies the taps at the factor's spacing).
                mats.append(np.eye(n_in))
            elif kind == "linear":
                mats.append(_linear_matrix(n_in, n_out, align, scale))
            elif kind == "cubic":
                mats.append(_cubic_matrix(n_in, n_out, align, scale))
            else:
                mats.append(_nearest_matrix(n_in, n_out, scale, kind == "nearest-exact"))
        dtype = _out(node).dtype
        v = L.cast(x, dtype)
        return _apply_matrices(L, v, [m.T for m in mats] if backward else mats, v.dtype)

    return lower


for _kind, _ops in {
    "nearest": (aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d),
    "nearest-exact": (aten._upsample_nearest_exact1d, aten._upsample_nearest_exact2d, aten._upsample_nearest_exact3d),
    "linear": (aten.upsample_linear1d, aten.upsample_bilinear2d, aten.upsample_trilinear3d),
    "cubic": (None, aten.upsample_bicubic2d, None),
}.items():
    for _spatial, _op in enumerate(_ops, 1):
        if _op is None:
            continue
        _register(_op.default)(_resampler(_kind, _spatial, False))
        _back = getattr(aten, _op.__name__ + "_backward")
        _register(_back.default)(_resampler(_kind, _spatial, True))


def _adaptive_avg(spatial: int, backward: bool) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, x: _T, other: Any) -> Any:
        if backward:  # (grad, self): grad's spatial sizes are the pooled ones
            sizes_in, sizes_out = list(other.shape[-spatial:]), list(x.shape[-spatial:])
        else:
            sizes_in, sizes_out = list(x.shape[-spatial:]), list(other)[-spatial:]
        mats = [_adaptive_matrix(i, o) for i, o in zip(sizes_in, sizes_out)]
        v = L.cast(x, _out(node).dtype)
        if not v.dtype.is_float:
            raise L.unsupported("an integer adaptive average pool")
        return _apply_matrices(L, v, [m.T for m in mats] if backward else mats, v.dtype)

    return lower


_register(aten._adaptive_avg_pool2d.default)(_adaptive_avg(2, False))
_register(aten._adaptive_avg_pool2d_backward.default)(_adaptive_avg(2, True))
_register(aten._adaptive_avg_pool3d.default)(_adaptive_avg(3, False))
_register(aten._adaptive_avg_pool3d_backward.default)(_adaptive_avg(3, True))
