"""What AOTAutograd decomposes before lowering: torch's core-ATen table, a few more, and the math
form of CPU SDPA's backward; and the lock that tracing holds."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

import ttflow as tt

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


# -- decompositions ----------------------------------------------------------------------------------


def _sdpa_cpu_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor,
                       dropout_p: float, is_causal: bool, attn_mask: torch.Tensor | None = None,
                       scale: float | None = None) -> tuple[torch.Tensor, ...]:
    """The math form of `_scaled_dot_product_flash_attention_for_cpu_backward`.

    torch's core decomposition of the forward op (kept in DECOMPOSITIONS) returns the attention
    probabilities P [..., L, S] where the kernel returns logsumexp [..., L], and autograd saves
    that for the backward; with the real kernel's logsumexp, P is recomputed from it."""
    torch._check(dropout_p == 0.0, lambda: "SDPA backward: dropout needs the math path")
    torch._check(query.size(1) == key.size(1), lambda: "SDPA backward: grouped-query attention is not supported")
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    opmath = torch.float32
    q, k, v, g = (t.to(opmath) for t in (query, key, value, grad_out))
    if logsumexp.dim() == query.dim():
        p = logsumexp.to(opmath)
    else:
        s = torch.matmul(q, k.transpose(-2, -1)) * scale
        if is_causal:
            keep = torch.ones(s.size(-2), s.size(-1), dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
        p = torch.exp(s - logsumexp.to(opmath).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), g)
    dp = torch.matmul(g, v.transpose(-2, -1))
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _log1p(x: torch.Tensor) -> torch.Tensor:
    """log(1 + x) without the cancellation of the plain form (Goldberg's correction: where
    1 + x rounds to u, log(u) * x / (u - 1) is accurate to a few ulps); tiny x gives x itself."""
    u = x + 1
    d = u - 1
    return torch.where(d == 0, x, torch.where(torch.isinf(u), u, torch.log(u) * (x / d)))


def _conv1d_as_2d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
                  padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                  output_padding: Sequence[int], groups: int) -> Any:
    """A 1-d convolution as the 2-d one over a height of 1 (as ttnn runs conv1d)."""
    if x.dim() != 3 or transposed:
        return NotImplemented
    y = aten.convolution.default(x.unsqueeze(2), w.unsqueeze(2), bias, [1, stride[0]], [0, padding[0]],
                                 [1, dilation[0]], False, [0, 0], groups)
    return y.squeeze(2)


def _conv1d_backward_as_2d(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias_sizes: Any,
                           stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                           transposed: bool, output_padding: Sequence[int], groups: int,
                           mask: Sequence[bool]) -> Any:
    if x.dim() != 3 or transposed:
        return NotImplemented
    gi, gw, gb = aten.convolution_backward.default(
        grad.unsqueeze(2), x.unsqueeze(2), w.unsqueeze(2), bias_sizes, [1, stride[0]], [0, padding[0]],
        [1, dilation[0]], False, [0, 0], groups, mask)
    return (None if gi is None else gi.squeeze(2), None if gw is None else gw.squeeze(2), gb)


def _nearest_factors(in_hw: Sequence[int], out_hw: Sequence[int], scales: Sequence[float | None]) -> tuple[int, int] | None:
    """(kh, kw) when nearest upsampling from in_hw to out_hw repeats each pixel kh x kw times."""
    factors = []
    for i, o, scale in zip(in_hw, out_hw, scales):
        if o % i or (scale is not None and scale != o // i):
            return None
        factors.append(o // i)
    return factors[0], factors[1]


def _upsample_nearest2d(x: torch.Tensor, output_size: Sequence[int], scales_h: float | None = None,
                        scales_w: float | None = None) -> Any:
    """Nearest upsampling by whole factors (U-Net decoders) as a broadcast: each pixel repeated
    kh x kw times, which is what torch's index rule gives for them."""
    n, c, h, w = x.shape
    factors = _nearest_factors((h, w), output_size, (scales_h, scales_w))
    if factors is None:
        return NotImplemented
    kh, kw = factors
    return x.reshape(n, c, h, 1, w, 1).expand(n, c, h, kh, w, kw).reshape(n, c, h * kh, w * kw)


def _upsample_nearest2d_backward(grad: torch.Tensor, output_size: Sequence[int], input_size: Sequence[int],
                                 scales_h: float | None = None, scales_w: float | None = None) -> Any:
    n, c, h, w = input_size
    factors = _nearest_factors((h, w), output_size, (scales_h, scales_w))
    if factors is None:
        return NotImplemented
    kh, kw = factors
    return grad.reshape(n, c, h, kh, w, kw).sum((3, 5))


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x.take(index)`: x flattened, indexed (`aten.index`, range-checked on the device, negative
    indices from the end). torch's own decomposition writes `flat[index]`, which reads a 0-d
    index as a Python int (`_local_scalar_dense`, untraceable)."""
    return aten.index.Tensor(x.reshape(-1), [index])


def _logcumsumexp(x: torch.Tensor, dim: int) -> Any:
    """log(cumsum(exp(x))) along dim as M + log1p(T): M the running max, T the sum of exp(x_j - M)
    over the other terms. (M, T) pairs combine by doubling (ceil(log2 n) rounds, each position
    with the one 2**k before it): the larger M stays, the other pair's 1 + T is scaled by
    exp(low - high) (1 where the two are the same, infinities included). CPU torch runs its
    log-add-exp step serially in double and rounds each result once; here the large part M is
    exact and only the small log1p(T) carries float32's error, so a result near 1e4 still lands
    within about an ulp of torch's (its gradient exponentiates differences of such results).
    NaN propagates through M; -inf terms add nothing; bfloat16 computes in float32."""
    if not x.is_floating_point():
        return NotImplemented
    if x.dim() == 0 or x.numel() == 0:
        return x.clone()
    d = dim % x.dim()
    n = x.shape[d]
    m = x.float() if x.dtype == torch.bfloat16 else x
    t = torch.zeros_like(m)
    step = 1
    while step < n:
        m1, t1 = m.narrow(d, step, n - step), t.narrow(d, step, n - step)
        m2, t2 = m.narrow(d, 0, n - step), t.narrow(d, 0, n - step)
        high, low = torch.maximum(m1, m2), torch.minimum(m1, m2)
        scale = torch.where(low == high, 1.0, torch.exp(low - high))
        first = m1 >= m2
        total = torch.where(first, t1, t2) + (1 + torch.where(first, t2, t1)) * scale
        m = torch.cat([m.narrow(d, 0, step), high], d)
        t = torch.cat([t.narrow(d, 0, step), total], d)
        step *= 2
    return (m + _log1p(t)).to(x.dtype)


def _f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _times_grad_output(grad: torch.Tensor, grad_output: torch.Tensor, reduction: int) -> torch.Tensor:
    """The margin losses' last step: a reduced (or 0-d) upstream gradient scales every element,
    a per-sample one its row."""
    if reduction != 0 or grad_output.dim() == 0:
        return grad * grad_output.reshape(())
    return grad * grad_output.reshape(-1, 1)


def _multi_margin_loss_backward(grad_output: torch.Tensor, x: torch.Tensor, target: torch.Tensor, p: Any,
                                margin: Any, weight: torch.Tensor | None = None, reduction: int = 1) -> Any:
    """CPU torch's `multi_margin_loss_backward_cpu_kernel` in tensor ops: z = (margin - x[y]) + x
    in float32; where z > 0 off the target, h = g (p 1) or (2 g) z (p 2), times weight[y]; the
    target gets minus the row's sum of h; g = 1 / (N * dim) (mean) or 1 / dim, in float32."""
    if x.dtype != torch.float32:
        return NotImplemented
    rows = x.reshape(-1, x.shape[-1] if x.dim() else 1)
    nframe, dim = rows.shape
    g = _f32(1.0 / (nframe * dim) if reduction == 1 else 1.0 / dim)
    y = target.reshape(-1, 1)
    z = (_f32(float(margin)) - rows.gather(1, y)) + rows
    is_target = torch.arange(dim, device=x.device).reshape(1, dim) == y
    h = torch.where(z > 0, z * (2 * g), 0.0) if int(p) == 2 else torch.where(z > 0, g, 0.0)
    if weight is not None:
        h = h * weight[y]
    h = torch.where(is_target, 0.0, h)
    grad = torch.where(is_target, -h.sum(1, keepdim=True), h)
    return _times_grad_output(grad, grad_output, reduction).reshape(x.shape)


def _multilabel_margin_loss_backward(grad_output: torch.Tensor, x: torch.Tensor, target: torch.Tensor,
                                     reduction: int, is_target: torch.Tensor) -> Any:
    """CPU torch's `multilabel_margin_loss_backward_out_frame` in tensor ops: for each target
    k of a row's prefix before the first -1 and each non-target d with (1 - x[k]) + x[d] > 0,
    g moves from x[k]'s gradient to x[d]'s; g = 1 / (N * dim) (mean) or 1 / dim, in float32.
    Each gradient is g times its count (torch adds g count times: a few ulps apart)."""
    if x.dtype != torch.float32:
        return NotImplemented
    dim = x.shape[-1] if x.dim() else 1
    rows, targets = x.reshape(-1, dim), target.reshape(-1, dim)
    marked = is_target.reshape(-1, dim) != 0
    nframe = rows.shape[0]
    g = _f32(1.0 / (nframe * dim) if reduction == 1 else 1.0 / dim)
    valid = (targets < 0).cumsum(1) == 0
    k = torch.where(valid, targets, 0)
    z = (1 - rows.gather(1, k)).unsqueeze(2) + rows.unsqueeze(1)  # [N, target k, d]
    hit = (z > 0) & valid.unsqueeze(2) & ~marked.unsqueeze(1)
    gained = hit.sum(1).to(x.dtype) * g
    lost = torch.zeros_like(rows).scatter_add(1, k, torch.where(valid, hit.sum(2).to(x.dtype) * g, 0.0))
    grad = torch.where(marked, -lost, gained)
    return _times_grad_output(grad, grad_output, reduction).reshape(x.shape)


def _multi_margin_loss(x: torch.Tensor, target: torch.Tensor, p: Any = 1, margin: Any = 1,
                       weight: torch.Tensor | None = None, reduction: int = 1) -> torch.Tensor:
    """torch's decomposition, whose unreduced loss of a 0-d target is [1] where CPU torch's is 0-d."""
    from torch._decomp import decomposition_table

    loss = decomposition_table[aten.multi_margin_loss.default](x, target, p, margin, weight, reduction)
    return loss.reshape(()) if reduction == 0 and target.dim() == 0 else loss


def _multilabel_margin_loss_forward(x: torch.Tensor, target: torch.Tensor, reduction: int) -> Any:
    """CPU torch's `multilabel_margin_loss_forward_out_frame` in tensor ops: a row's targets are
    its prefix before the first -1 (a repeated one counts again); each target k and non-target
    d add (1 - x[k]) + x[d] where positive; the sum over dim (and N for the mean). torch's own
    decomposition reads the targets after a -1 and counts a repeated one once, and gives an
    unreduced loss of a 1-d input as [1] where CPU torch's is 0-d."""
    if x.dtype != torch.float32:
        return NotImplemented
    dim = x.shape[-1] if x.dim() else 1
    rows, targets = x.reshape(-1, dim), target.reshape(-1, dim)
    valid = (targets < 0).cumsum(1) == 0
    k = torch.where(valid, targets, 0)
    is_target = torch.zeros_like(rows).scatter_add(1, k, valid.to(x.dtype)) > 0
    z = (1 - rows.gather(1, k)).unsqueeze(2) + rows.unsqueeze(1)  # [N, target k, d]
    hit = (z > 0) & valid.unsqueeze(2) & ~is_target.unsqueeze(1)
    per_row = torch.where(hit, z, 0.0).sum((1, 2)) / dim
    if reduction == 0:
        loss = per_row.reshape(()) if target.dim() <= 1 else per_row
    else:
        loss = per_row.sum() / rows.shape[0] if reduction == 1 else per_row.sum()
    return loss, is_target.to(x.dtype).reshape(target.shape)


def _multilabel_margin_loss(x: torch.Tensor, target: torch.Tensor, reduction: int = 1) -> Any:
    return _multilabel_margin_loss_forward(x, target, reduction)[0]


def _decompositions() -> dict[Any, Callable[..., Any]]:
    from torch._decomp import core_aten_decompositions, get_decompositions

    table = dict(core_aten_decompositions())
    # Ops torch can decompose but core ATen keeps; their pieces all lower.
    table.update(get_decompositions([aten.hardtanh, aten.leaky_relu, aten.hardsigmoid, aten.hardswish]))
    # Batch norm, in training (batch statistics, running stats as functional outputs) and in
    # eval: core ATen keeps it, torch's own decompositions make it arithmetic.
    table.update(get_decompositions([
        aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
        aten._native_batch_norm_legit_no_training, aten.native_batch_norm_backward,
    ]))
    # Norms (clip_grad_norm_) become pow/abs/sum/amax; log1p (softplus, BCE with logits) the
    # exact-to-a-few-ulps form below.
    table.update(get_decompositions([aten.linalg_vector_norm, aten.native_group_norm,
                                     aten.native_group_norm_backward]))
    table[aten.log1p.default] = _log1p
    table[aten.upsample_nearest2d.default] = _upsample_nearest2d
    table[aten.upsample_nearest2d_backward.default] = _upsample_nearest2d_backward
    table[aten.convolution.default] = _conv1d_as_2d
    table[aten.convolution_backward.default] = _conv1d_backward_as_2d
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _sdpa_cpu_backward
    table[aten.take.default] = _take
    table[aten.logcumsumexp.default] = _logcumsumexp
    table[aten.multi_margin_loss.default] = _multi_margin_loss
    table[aten.multilabel_margin_loss_forward.default] = _multilabel_margin_loss_forward
    table[aten.multilabel_margin_loss.default] = _multilabel_margin_loss
    table[aten.multi_margin_loss_backward.default] = _multi_margin_loss_backward
    table[aten.multilabel_margin_loss_backward.default] = _multilabel_margin_loss_backward
    table[aten._logcumsumexp.default] = _logcumsumexp
    from .._fused import DECOMPOSITIONS as fused  # torch's fused attention fast paths

    table.update(fused)
    from .._foreach_decomp import DECOMPOSITIONS as foreach  # a compiled optimizer step

    table.update(foreach)
    # Lowered directly: a decomposition would lose the pattern (dropout's mask is one rand op,
    # max-pool's backward reads the forward input rather than indices).
    for op in (aten.native_dropout.default, aten.max_pool2d_with_indices_backward.default,
               aten.embedding.default, aten.gelu.default):
        table.pop(op, None)
    # Lowered directly (matmul_conv's resampling matrices, CPU torch's kernels): torch's own
    # decompositions of these blend an axis whose size does not change (a factor of 1.25 on 2
    # pixels), which CPU torch's kernels copy; `backend="aot_eager"` differs from eager likewise.
    for packet in (aten.upsample_linear1d, aten.upsample_trilinear3d, aten.upsample_bicubic2d,
                   aten.upsample_linear1d_backward, aten.upsample_trilinear3d_backward,
                   aten.upsample_bicubic2d_backward):
        for overload in packet.overloads():
            if overload != "vec":
                table.pop(getattr(packet, overload), None)
    return table


TRACING = threading.RLock()
"""Held while torch traces a function into a graph (make_fx, AOTAutograd): tracing patches torch
globally (nn.Module.__call__ among others), so two threads tracing at once would restore each
other's patches and leave them in place."""

DECOMPOSITIONS: dict[Any, Callable[..., Any]] = _decompositions()
"""What to pass as `aot_autograd(decompositions=...)`: torch's core-ATen decompositions, a few
more, and the math form of CPU SDPA's backward (see docs/torch-lowering.md)."""
