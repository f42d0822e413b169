"""Reductions: sum, prod, mean, var, max/min, any/all, argmax/argmin."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

import ttflow as tt

from .graph import _T, _dim, _dims, _Lowering, _out, _register, _used

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


# -- reductions --------------------------------------------------------------------------------------


def _reduce(L: _Lowering, node: torch.fx.Node, op: str, v: Any, axes: Sequence[int]) -> Any:
    for axis in axes:
        v = getattr(L.b, op)(v, axis)
    meta = _out(node)
    return L.fit(v, (meta[0] if isinstance(meta, tuple) else meta).shape)


def _reduce_input(L: _Lowering, node: torch.fx.Node, x: _T, axes: Sequence[int]) -> Any:
    """x in the result's dtype; bfloat16 reduced over several axes in float32 (one rounding)."""
    dtype = _out(node).dtype
    if dtype == torch.bfloat16 and len(axes) > 1:
        return L.f32(x)
    if dtype == torch.bool:
        return L.bool01(x)
    return L.cast(x, dtype)


@_register(aten.sum.dim_IntList, aten.sum.default)
def _sum(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return _reduce(L, node, "sum", _reduce_input(L, node, x, axes), axes)


@_register(aten.prod.dim_int, aten.prod.default)
def _prod(L: _Lowering, node: torch.fx.Node, x: _T, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
    """The product over a dim (or all): float32 left to right along it, as numpy; CPU torch
    multiplies a contiguous run of 32 or more in vectorised partial products, a few ulps apart."""
    axes = _dims(dim, len(x.shape)) if x.shape else []
    return _reduce(L, node, "prod", _reduce_input(L, node, x, axes), axes)


@_register(aten.mean.dim, aten.mean.default)
def _mean(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return _reduce(L, node, "mean", _reduce_input(L, node, x, axes), axes)


def _variance(L: _Lowering, x: _T, dims: Any, correction: Any) -> tuple[Any, Any, list[int]]:
    """(var, mean) of x over `dims` in float32, kept dims; Bessel's `correction` as torch's."""
    axes = _dims(dims, len(x.shape)) if x.shape and dims is not None else list(range(len(x.shape)))
    v = L.f32(x)
    count = 1
    for axis in axes:
        count *= x.shape[axis]
    mean = v
    for axis in axes:
        mean = L.b.mean(mean, axis)
    centred = L.b.sub(v, mean)
    total = L.b.mul(centred, centred)
    for axis in axes:
        total = L.b.sum(total, axis)
    c = 1.0 if correction is None else float(correction)
    return L.b.div(total, max(count - c, 0.0)), mean, axes


@_register(aten.var_mean.correction)
def _var_mean(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, *, correction: Any = None,
              keepdim: bool = False) -> Any:
    var, mean, _ = _variance(L, x, dims, correction)
    meta_var, meta_mean = _out(node)
    return L.fit(var, meta_var.shape), L.fit(mean, meta_mean.shape)


@_register(aten.var.correction)
def _var(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, *, correction: Any = None,
         keepdim: bool = False) -> Any:
    var, _, _ = _variance(L, x, dims, correction)
    return L.fit(var, _out(node).shape)


@_register(aten.amax.default, aten.max.default)
def _amax(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return _reduce(L, node, "max", x.v, axes)


@_register(aten.amin.default, aten.min.default)
def _amin(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return L.b.neg(_reduce(L, node, "max", L.b.neg(x.v), axes))


@_register(aten.any.dim, aten.any.dims, aten.any.default)
def _any(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return _reduce(L, node, "max", L.bool01(x), axes)


@_register(aten.all.dim, aten.all.dims, aten.all.default)
def _all(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return L.b.eq(_reduce(L, node, "max", L.b.eq(L.bool01(x), 0), axes), 0)


def _arg(L: _Lowering, node: torch.fx.Node, v: Any, shape: tuple[int, ...], dim: int | None) -> Any:
    if dim is None:
        v, axis = L.b.reshape(v, (math.prod(shape) or 1,)), 0
    else:
        axis = _dim(dim, len(shape)) if shape else 0
    return L.fit(L.b.argmax(v, axis), _out(node).shape)


@_register(aten.argmax.default)
def _argmax(L: _Lowering, node: torch.fx.Node, x: _T, dim: int | None = None, keepdim: bool = False) -> Any:
    return _arg(L, node, x.v, x.shape, dim)


@_register(aten.argmin.default)
def _argmin(L: _Lowering, node: torch.fx.Node, x: _T, dim: int | None = None, keepdim: bool = False) -> Any:
    return _arg(L, node, L.b.neg(x.v), x.shape, dim)


@_register(aten.max.dim, aten.min.dim)
def _max_dim(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, keepdim: bool = False) -> Any:
    v = x.v if node.target is aten.max.dim else L.b.neg(x.v)
    axis = _dim(dim, len(x.shape)) if x.shape else 0
    used, meta = _used(node), _out(node)
    values = indices = None
    if 0 in used:
        values = L.fit(L.b.max(v, axis), meta[0].shape)
        values = values if node.target is aten.max.dim else L.b.neg(values)
    if 1 in used:
        indices = L.fit(L.b.argmax(v, axis), meta[1].shape)
    return values, indices
