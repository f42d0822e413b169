"""Data movement: the same elements elsewhere (transpose, reshape, slice, concat, permute,
broadcast_to).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..._errors import ProgramError, ShapeError
from ..._types import check_shape
from ..core import BuilderCore, Value, _broadcast, _ints, _normalise_axis, _result_dtype, _slice_text
from ..record import Kind, op
from ._shared import Array, unary_compute

__all__ = ["DataMovementOps"]


def _slice(arrays: list[Array], scalar: float | None, starts: tuple[int, ...],
           ends: tuple[int, ...], steps: tuple[int, ...]) -> Array:
    return arrays[0][tuple(slice(a, e, s) for a, e, s in zip(starts, ends, steps))]


def _concat(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    return np.concatenate(arrays, axis=axis)


def _permute(arrays: list[Array], scalar: float | None, axes: tuple[int, ...]) -> Array:
    return np.transpose(arrays[0], axes)


def _broadcast_to(arrays: list[Array], scalar: float | None, shape: tuple[int, ...]) -> Array:
    return np.ascontiguousarray(np.broadcast_to(arrays[0], tuple(shape)))


def _replay_reshape(b: Any, args: list[Any], scalar: float | None, attrs_: dict[str, Any]) -> Any:
    (x,) = args
    return b.reshape(x, **attrs_)


def _replay_concat(b: Any, args: list[Any], scalar: float | None, attrs_: dict[str, Any]) -> Any:
    return b.concat(args, **attrs_)


class DataMovementOps(BuilderCore):
    """The data movement ops of `ProgramBuilder`."""

    @op("transpose", Kind.DATA_MOVEMENT, 1, unary_compute(lambda x: np.swapaxes(x, -1, -2)), version=1)
    def transpose(self, x: Value, *, loc: str | None = None) -> Value:
        """Swaps the last two dims."""
        self._check_open()
        x = self._value("transpose", x)
        if len(x.shape) < 2:
            raise ShapeError(f"transpose swaps the last two dims; {x.shape} has rank {len(x.shape)}")
        shape = x.shape[:-2] + (x.shape[-1], x.shape[-2])
        return self._emit("transpose", [x], shape, x.dtype)

    @op("reshape", Kind.DATA_MOVEMENT, 1, lambda arrays, scalar, shape: arrays[0].reshape(tuple(shape)),
        version=1, replay=_replay_reshape)
    def reshape(self, x: Value, shape: Sequence[int], *, loc: str | None = None) -> Value:
        """The same elements in another shape (row-major order, as numpy's reshape)."""
        self._check_open()
        x = self._value("reshape", x)
        dims = check_shape(shape)
        if math.prod(dims) != math.prod(x.shape):  # Python ints: exact at any size
            raise ShapeError(f"reshape: cannot view {x.shape} as {dims}: element counts differ")
        return self._emit("reshape", [x], dims, x.dtype, shape=dims)

    @op("slice", Kind.DATA_MOVEMENT, 1, _slice, version=2)
    def slice(self, x: Value, starts: Sequence[int | None], ends: Sequence[int | None],
              steps: Sequence[int] | None = None, *, loc: str | None = None) -> Value:
        """`x[starts[0]:ends[0]:steps[0], ...]`: Python's clamping and negative indices, None
        for an open end, positive steps; fewer entries than x's rank slice the leading axes."""
        self._check_open()
        x = self._value("slice", x)
        first, last = _ints("slice", "starts", starts, True), _ints("slice", "ends", ends, True)
        step = [1] * len(first) if steps is None else _ints("slice", "steps", steps)
        if not len(first) == len(last) == len(step) <= len(x.shape):
            raise ShapeError(
                f"slice: starts, ends and steps need one entry per sliced axis (at most {len(x.shape)} "
                f"for {x.shape}), got {len(first)}, {len(last)} and {len(step)}"
            )
        if any(s < 1 for s in step):
            raise ShapeError(f"slice: steps must be positive, got {tuple(step)}")
        full = len(x.shape) - len(first)
        bounds = [slice(a, e, s).indices(dim) for a, e, s, dim in
                  zip(first + [None] * full, last + [None] * full, step + [1] * full, x.shape)]
        shape = tuple(len(range(*b)) for b in bounds)
        if 0 in shape:
            raise ShapeError(f"slice: {x.shape}[{_slice_text(bounds)}] is empty")
        return self._emit("slice", [x], shape, x.dtype, starts=tuple(b[0] for b in bounds),
                          ends=tuple(b[1] for b in bounds), steps=tuple(b[2] for b in bounds))

    @op("concat", Kind.DATA_MOVEMENT, -1, _concat, version=2, replay=_replay_concat)
    def concat(self, values: Sequence[Value], axis: int, *, loc: str | None = None) -> Value:
        """The values joined along `axis` (np.concatenate); the other dims must agree."""
        self._check_open()
        if isinstance(values, Value) or not isinstance(values, (list, tuple)) or not values:
            raise ProgramError("concat takes a non-empty list of values: b.concat([x, y], axis)")
        vs = [self._value("concat", v) for v in values]
        rank = len(vs[0].shape)
        axis = _normalise_axis("concat", axis, rank)
        for v in vs:
            if len(v.shape) != rank or v.shape[:axis] + v.shape[axis + 1 :] != vs[0].shape[:axis] + vs[0].shape[axis + 1 :]:
                raise ShapeError(
                    f"concat along axis {axis}: {[v.shape for v in vs]} differ in another dim or in rank"
                )
        dtype = vs[0].dtype
        for v in vs[1:]:
            dtype = _result_dtype("concat", dtype, v.dtype)
        shape = vs[0].shape[:axis] + (sum(v.shape[axis] for v in vs),) + vs[0].shape[axis + 1 :]
        return self._emit("concat", vs, shape, dtype, axis=axis)

    @op("permute", Kind.DATA_MOVEMENT, 1, _permute, version=2)
    def permute(self, x: Value, axes: Sequence[int], *, loc: str | None = None) -> Value:
        """x's dims reordered: result dim i is x's dim axes[i] (np.transpose, torch.permute)."""
        self._check_open()
        x = self._value("permute", x)
        rank = len(x.shape)
        given = _ints("permute", "axes", axes)
        perm = tuple(a % rank if -rank <= a < rank else -1 for a in given)
        if sorted(perm) != list(range(rank)):
            raise ShapeError(f"permute: axes {tuple(given)} are not a permutation of the {rank} dims of {x.shape}")
        return self._emit("permute", [x], tuple(x.shape[a] for a in perm), x.dtype, axes=perm)

    @op("broadcast_to", Kind.DATA_MOVEMENT, 1, _broadcast_to, version=3)
    def broadcast_to(self, x: Value, shape: Sequence[int], *, loc: str | None = None) -> Value:
        """x broadcast to `shape` by numpy's rule (np.broadcast_to, torch.expand), the result
        materialised: every dim of x is 1 or `shape`'s, and `shape` has at least x's rank."""
        self._check_open()
        x = self._value("broadcast_to", x)
        dims = check_shape(shape)
        if len(dims) < len(x.shape) or _broadcast(x.shape, dims) != dims:
            raise ShapeError(f"broadcast_to: {x.shape} does not broadcast to {dims}")
        return self._emit("broadcast_to", [x], dims, x.dtype, shape=dims)
