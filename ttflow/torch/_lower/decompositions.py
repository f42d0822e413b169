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
    return table


TRACING = threading.RLock()
"""Held while torch traces a function into a graph (make_fx, AOTAutograd): tracing patches torch
globally (nn.Module.__call__ among others), so two threads tracing at once would restore each
other's patches and leave them in place."""

DECOMPOSITIONS: dict[Any, Callable[..., Any]] = _decompositions()
"""What to pass as `aot_autograd(decompositions=...)`: torch's core-ATen decompositions, a few
more, and the math form of CPU SDPA's backward (see docs/torch-lowering.md)."""
