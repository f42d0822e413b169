"""torch's fused inference kernels for attention, spelled with the ops the device has.

In eval under `no_grad`, `nn.TransformerEncoderLayer` and `nn.MultiheadAttention` take a "fast
path" on every device torch lists as supported, which includes PrivateUse1: one fused call
(`aten._transformer_encoder_layer_fwd`, `aten._native_multi_head_attention`) that has no
decomposition in torch. These are the same computations in standard ops, added to the
lowering's decompositions, so the fused calls run on the device, eagerly and compiled.
Inputs are batch-first, as the fast path requires.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["DECOMPOSITIONS"]

aten = torch.ops.aten


def _attention_mask(mask: torch.Tensor | None, mask_type: int | None, batch: int, length: int) -> Any:
    """The fast path's merged mask as `scaled_dot_product_attention`'s `attn_mask`: bool masks
    there mark what takes part (the fast path's mark what is left out); float masks add."""
    if mask is None:
        return None
    if mask_type == 1:  # a key padding mask, (batch, length)
        mask = mask.view(batch, 1, 1, length)
    return mask.logical_not() if mask.dtype == torch.bool else mask


def _attention(q_in: torch.Tensor, k_in: torch.Tensor, v_in: torch.Tensor, heads: int, qkv_weight: torch.Tensor,
               qkv_bias: torch.Tensor, proj_weight: torch.Tensor, proj_bias: torch.Tensor, mask: Any,
               mask_type: int | None, need_weights: bool = False,
               average: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    batch, length, embed = q_in.shape
    source = k_in.shape[1]
    d = embed // heads
    wq, wk, wv = qkv_weight.chunk(3)
    bq, bk, bv = qkv_bias.chunk(3)
    q = F.linear(q_in, wq, bq).view(batch, length, heads, d).transpose(1, 2)
    k = F.linear(k_in, wk, bk).view(batch, source, heads, d).transpose(1, 2)
    v = F.linear(v_in, wv, bv).view(batch, source, heads, d).transpose(1, 2)
    attn_mask = _attention_mask(mask, mask_type, batch, source)
    scores = q @ k.transpose(-2, -1) / (d ** 0.5)
    if attn_mask is not None:
        scores = scores.masked_fill(attn_mask.logical_not(), float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(batch, length, embed)
    out = F.linear(out, proj_weight, proj_bias)
    if not need_weights:
        return out, None
    return out, weights.mean(dim=1) if average else weights


def _native_multi_head_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embed_dim: int,
                                 num_head: int, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor,
                                 proj_weight: torch.Tensor, proj_bias: torch.Tensor, mask: Any = None,
                                 need_weights: bool = True, average_attn_weights: bool = True,
                                 mask_type: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out, weights = _attention(query, key, value, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
                              mask, mask_type, need_weights, average_attn_weights)
    return out, (weights if weights is not None else out.new_zeros(0))


def _transformer_encoder_layer_fwd(src: torch.Tensor, embed_dim: int, num_heads: int, qkv_weight: torch.Tensor,
                                   qkv_bias: torch.Tensor, proj_weight: torch.Tensor, proj_bias: torch.Tensor,
                                   use_gelu: bool, norm_first: bool, eps: float, norm_weight_1: torch.Tensor,
                                   norm_bias_1: torch.Tensor, norm_weight_2: torch.Tensor,
                                   norm_bias_2: torch.Tensor, ffn_weight_1: torch.Tensor,
                                   ffn_bias_1: torch.Tensor, ffn_weight_2: torch.Tensor,
                                   ffn_bias_2: torch.Tensor, mask: Any = None,
                                   mask_type: int | None = None) -> torch.Tensor:
    shape = (embed_dim,)

    def attend(x: torch.Tensor) -> torch.Tensor:
        return _attention(x, x, x, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, mask_type)[0]

    def feed_forward(x: torch.Tensor) -> torch.Tensor:
        hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(hidden) if use_gelu else F.relu(hidden), ffn_weight_2, ffn_bias_2)

    x = src
    if norm_first:
        x = x + attend(F.layer_norm(x, shape, norm_weight_1, norm_bias_1, eps))
        return x + feed_forward(F.layer_norm(x, shape, norm_weight_2, norm_bias_2, eps))
    x = F.layer_norm(x + attend(x), shape, norm_weight_1, norm_bias_1, eps)
    return F.layer_norm(x + feed_forward(x), shape, norm_weight_2, norm_bias_2, eps)


DECOMPOSITIONS = {
    aten._native_multi_head_attention.default: _native_multi_head_attention,
    aten._transformer_encoder_layer_fwd.default: _transformer_encoder_layer_fwd,
}
