"""Normalization: softmax, layer_norm and rms_norm, along the last axis (softmax along any).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..._errors import BinaryFormatError, LayoutError, ShapeError
from .. import footprint
from ..core import BuilderCore, Value, _normalise_axis, _number, along_axis, replay_flag, replay_optional
from ..record import Kind, op
from ._shared import Array

__all__ = ["NormalizationOps"]


def _softmax(arrays: list[Array], scalar: float | None, axis: int = -1) -> Array:
    x = arrays[0]
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _layer_norm(arrays: list[Array], scalar: float | None, eps: float, has_weight: bool,
                has_bias: bool) -> Array:
    x, *rest = arrays
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float32)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True, dtype=np.float32)  # biased, as PyTorch's
    y = centred / np.sqrt(var + np.float32(eps))
    if has_weight:
        y = y * rest.pop(0)
    if has_bias:
        y = y + rest.pop(0)
    return y


def _rms_norm(arrays: list[Array], scalar: float | None, eps: float, has_weight: bool) -> Array:
    x = arrays[0]
    ms = (x * x).mean(axis=-1, keepdims=True, dtype=np.float32)
    y = x / np.sqrt(ms + np.float32(eps))
    return y * arrays[1] if has_weight else y


def _last_dim(attrs_: dict[str, Any], shapes: list[tuple[int, ...]]) -> int:
    return shapes[0][-1]


def _replay_layer_norm(b: Any, args: list[Any], scalar: float | None, attrs_: dict[str, Any]) -> Any:
    x, *rest = args
    w = replay_optional(rest, replay_flag(attrs_, "has_weight"))
    bias = replay_optional(rest, replay_flag(attrs_, "has_bias"))
    if rest:
        raise BinaryFormatError("layer_norm: more inputs than its attrs say")
    return b.layer_norm(x, w, bias, **attrs_)


def _replay_rms_norm(b: Any, args: list[Any], scalar: float | None, attrs_: dict[str, Any]) -> Any:
    x, *rest = args
    w = replay_optional(rest, replay_flag(attrs_, "has_weight"))
    if rest:
        raise BinaryFormatError("rms_norm: more inputs than its attrs say")
    return b.rms_norm(x, w, **attrs_)


def _layer_norm64(a: list[Array], s: float | None, eps: float, has_weight: bool, has_bias: bool) -> Array:
    x, *rest = a
    centred = x - x.mean(axis=-1, keepdims=True)
    y = centred / np.sqrt((centred * centred).mean(axis=-1, keepdims=True) + eps)
    if has_weight:
        y = y * rest.pop(0)
    if has_bias:
        y = y + rest.pop(0)
    return y


def _rms_norm64(a: list[Array], s: float | None, eps: float, has_weight: bool) -> Array:
    y = a[0] / np.sqrt((a[0] * a[0]).mean(axis=-1, keepdims=True) + eps)
    return y * a[1] if has_weight else y


class NormalizationOps(BuilderCore):
    """The normalization ops of `ProgramBuilder`."""

    @op("softmax", Kind.NORMALIZATION, 1, _softmax, version=1, float_only=True,
        footprint=footprint.row_wise(3), accumulates=along_axis)
    def softmax(self, x: Value, axis: int = -1, *, loc: str | None = None) -> Value:
        """exp(x - max) / sum(exp(x - max)) along `axis`: never overflows."""
        self._check_open()
        x = self._value("softmax", x)
        return self._unary("softmax", x, axis=_normalise_axis("softmax", axis, len(x.shape)))

    def _affine(self, op: str, x: Value, name: str, v: Value | None) -> Value | None:
        """A norm's weight or bias: None, or a float value of shape (..., D) or (..., 1) with
        every leading dim 1 and no more dims than x."""
        if v is None:
            return None
        v = self._value(op, v)
        if not v.dtype.is_float:
            raise LayoutError(f"{op}: {name} must be a float, got {v.dtype.name}")
        if (math.prod(v.shape[:-1]) != 1 or v.shape[-1] not in (1, x.shape[-1])
                or len(v.shape) > len(x.shape)):
            raise ShapeError(f"{op}: {name} of shape {v.shape} does not fit the last dim of {x.shape}")
        return v

    @op("layer_norm", Kind.NORMALIZATION, 3, _layer_norm, float64=_layer_norm64, version=2, float_only=True,
        footprint=footprint.row_wise(4), accumulates=_last_dim, replay=_replay_layer_norm)
    def layer_norm(self, x: Value, weight: Value | None = None, bias: Value | None = None,
                   eps: float = 1e-5, *, loc: str | None = None) -> Value:
        """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, the variance biased
        (PyTorch's layer_norm); weight and bias (D,) or left out; the result in x's dtype."""
        self._check_open()
        x = self._value("layer_norm", x)
        w, bb = self._affine("layer_norm", x, "weight", weight), self._affine("layer_norm", x, "bias", bias)
        eps = _number("layer_norm", "eps", eps)
        inputs = [v for v in (x, w, bb) if v is not None]
        return self._emit("layer_norm", inputs, x.shape, x.dtype, eps=eps,
                          has_weight=w is not None, has_bias=bb is not None)

    @op("rms_norm", Kind.NORMALIZATION, 2, _rms_norm, float64=_rms_norm64, version=2, float_only=True,
        footprint=footprint.row_wise(4), accumulates=_last_dim, replay=_replay_rms_norm)
    def rms_norm(self, x: Value, weight: Value | None = None, eps: float = 1e-5, *, loc: str | None = None) -> Value:
        """x / sqrt(mean(x**2) + eps) * weight over the last dim (no bias; weight (D,) or left
        out); the result in x's dtype."""
        self._check_open()
        x = self._value("rms_norm", x)
        w = self._affine("rms_norm", x, "weight", weight)
        eps = _number("rms_norm", "eps", eps)
        inputs = [x] if w is None else [x, w]
        return self._emit("rms_norm", inputs, x.shape, x.dtype, eps=eps, has_weight=w is not None)
