"""Constants and random values: full, arange, empty-likes, dropout and the seeded random ops."""

from __future__ import annotations

from typing import Any, cast

import torch

import ttflow as tt

from .device_view import device_dtype
from .graph import _T, _always, _Lowering, _out, _register

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


# -- constants and random values ---------------------------------------------------------------------


@_register(aten.full.default)
def _full(L: _Lowering, node: torch.fx.Node, size: Any, value: Any, **kwargs: Any) -> Any:
    meta = _out(node)
    return L.full(meta.shape, value, meta.dtype)


@_register(aten.full_like.default)
def _full_like(L: _Lowering, node: torch.fx.Node, x: _T, value: Any, **kwargs: Any) -> Any:
    meta = _out(node)
    return L.full(meta.shape, value, meta.dtype)


@_register(aten.new_full.default)
def _new_full(L: _Lowering, node: torch.fx.Node, x: _T, size: Any, value: Any, **kwargs: Any) -> Any:
    meta = _out(node)
    return L.full(meta.shape, value, meta.dtype)


@_register(aten.scalar_tensor.default)
def _scalar_tensor(L: _Lowering, node: torch.fx.Node, value: Any, **kwargs: Any) -> Any:
    return L.full((), value, _out(node).dtype)


@_register(aten.empty.memory_format, aten.empty_like.default, aten.zeros_like.default,
           aten.new_empty.default, aten.empty_strided.default, aten.empty_permuted.default,
           aten.zeros.default, aten.new_zeros.default, aten.new_empty_strided.default)
def _empty(L: _Lowering, node: torch.fx.Node, *args: Any, **kwargs: Any) -> Any:
    meta = _out(node)
    return L.full(meta.shape, 0, meta.dtype)  # uninitialised in torch: zeros here


@_register(aten.arange.start_step, aten.arange.start, aten.arange.default)
def _arange(L: _Lowering, node: torch.fx.Node, *args: Any, **kwargs: Any) -> Any:
    numbers: list[Any] = [a for a in args if isinstance(a, (int, float))]
    if node.target is aten.arange.default:
        start, end, step = 0, numbers[0], 1
    else:
        start, end = numbers[0], numbers[1]
        step = numbers[2] if len(numbers) > 2 else 1
    dtype = _out(node).dtype
    return L.b.arange(start, end, step, device_dtype(dtype))


def _dropout_draws(node: torch.fx.Node) -> bool:
    p = cast(float, node.args[1])
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return train is not False and 0 < p < 1


@_register(aten.native_dropout.default, seeded=_dropout_draws)
def _native_dropout(L: _Lowering, node: torch.fx.Node, x: _T, p: float, train: bool | None) -> Any:
    """Dropout from one `rand`: keep where rand < 1 - p, scale the kept by 1 / (1 - p)."""
    b = L.b
    if not _dropout_draws(node):
        if train is not False and p >= 1:
            return L.full(x.shape, 0, x.dtype), L.full(x.shape, 0, torch.bool)
        return x.v, L.full(x.shape, 1, torch.bool)
    keep = b.lt(L.rand(x.shape), 1.0 - p)  # 1.0 / 0.0, FLOAT32
    out = b.where(keep, b.mul(L.f32(x), 1.0 / (1.0 - p)), 0.0)
    return out, keep


@_register(aten.rand.default, seeded=_always)
def _rand(L: _Lowering, node: torch.fx.Node, size: Any, **kwargs: Any) -> Any:
    return L.rand(_out(node).shape)


@_register(aten.rand_like.default, seeded=_always)
def _rand_like(L: _Lowering, node: torch.fx.Node, x: _T, **kwargs: Any) -> Any:
    return L.rand(_out(node).shape)


@_register(aten.bernoulli.p, seeded=_always)
def _bernoulli(L: _Lowering, node: torch.fx.Node, x: _T, p: float = 0.5, **kwargs: Any) -> Any:
    return L.b.lt(L.rand(x.shape), float(p))
