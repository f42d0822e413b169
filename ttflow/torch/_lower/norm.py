"""Softmax, log-softmax and layer norm."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

import ttflow as tt

from .graph import _T, _dim, _Lowering, _out, _register, _used

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


# -- softmax, norms ----------------------------------------------------------------------------------


@_register(aten._softmax.default)
def _softmax(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, half_to_float: bool = False) -> Any:
    return L.b.softmax(L.cast(x, _out(node).dtype), _dim(dim, len(x.shape)) if x.shape else 0)


@_register(aten._log_softmax.default)
def _log_softmax(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, half_to_float: bool = False) -> Any:
    b, axis = L.b, _dim(dim, len(x.shape)) if x.shape else 0
    v = L.f32(x)
    shifted = b.sub(v, b.max(v, axis))
    return b.sub(shifted, b.log(b.sum(b.exp(shifted), axis)))


@_register(aten.native_layer_norm.default)
def _native_layer_norm(L: _Lowering, node: torch.fx.Node, x: _T, normalized_shape: Sequence[int],
                       weight: _T | None, bias: _T | None, eps: float) -> Any:
    b, k = L.b, len(normalized_shape)
    lead, inner = x.shape[: len(x.shape) - k], math.prod(normalized_shape)
    v = x.v if k == 1 else b.reshape(x.v, (*lead, inner) if lead else (inner,))
    w = None if weight is None else L.fit(weight.v, (inner,))
    bb = None if bias is None else L.fit(bias.v, (inner,))
    used, meta = _used(node), _out(node)
    out = mean = rstd = None
    if 0 in used:
        out = L.fit(b.layer_norm(v, w, bb, eps), x.shape)
    if 1 in used or 2 in used:
        v32 = v if v.dtype is _F32 else b.typecast(v, _F32)
        m = b.mean(v32, -1)
        centred = b.sub(v32, m)
        r = b.rsqrt(b.add(b.mean(b.mul(centred, centred), -1), float(eps)))
        mean, rstd = L.fit(m, meta[1].shape), L.fit(r, meta[2].shape)
    return out, mean, rstd
