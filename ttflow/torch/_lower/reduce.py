"""Reductions: sum, prod, mean, var, max/min, any/all, argmax/argmin; and those built on sorting and
searching (median, nanmedian, kthvalue, mode, searchsorted, bucketize), cumprod, cummax and cummin,
and histc."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

import ttflow as tt

from .device_view import _value_dtype
from .graph import _EMPTY, _T, _dim, _dims, _Lowering, _out, _register, _used

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
    if x.v is None:  # over nothing: 0/0 for both, as torch gives
        return tuple(L.full(m.shape, float("nan"), m.dtype) for m in _out(node))
    var, mean, _ = _variance(L, x, dims, correction)
    meta_var, meta_mean = _out(node)
    return L.fit(var, meta_var.shape), L.fit(mean, meta_mean.shape)


@_register(aten.var.correction)
def _var(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, *, correction: Any = None,
         keepdim: bool = False) -> Any:
    if x.v is None:
        return L.full(_out(node).shape, float("nan"), _out(node).dtype)
    var, _, _ = _variance(L, x, dims, correction)
    return L.fit(var, _out(node).shape)


# A variance over nothing is NaN (the lowerings above give it; a result that is itself empty never
# reaches them).
_EMPTY[aten.var.correction] = "drop"
_EMPTY[aten.var_mean.correction] = "drop"


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


# -- running products ---------------------------------------------------------------------------------


_CUMPROD_MAX = 1024


@_register(aten.cumprod.default)
def _cumprod(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, *, dtype: Any = None) -> Any:
    """Running products along `dim`, one `mul` a step in torch's order (left to right, so floats
    match CPU torch's serial loop bit for bit, zeros and infinities included, and integers are
    exact: INT32 wraps as torch's int32, an int64 product is range-checked)."""
    b, out = L.b, _out(node).dtype
    v = L.cast(x, out)
    if not x.shape:
        return v
    axis = _dim(dim, len(x.shape))
    n = x.shape[axis]
    if n > _CUMPROD_MAX:
        raise L.unsupported(f"a running product over {n} elements ({_CUMPROD_MAX} at most)")
    if n == 1:
        return v
    parts = [b.slice(v, [None] * axis + [0], [None] * axis + [1])]
    for j in range(1, n):
        parts.append(b.mul(parts[-1], b.slice(v, [None] * axis + [j], [None] * axis + [j + 1])))
    return b.concat(parts, axis)


# -- running maxima and minima -------------------------------------------------------------------------


def _along(L: _Lowering, v: Any, axis: int, start: int, end: int) -> Any:
    return L.b.slice(v, [None] * axis + [start], [None] * axis + [end])


def _scan(L: _Lowering, v: Any, axis: int, op: str) -> Any:
    """The inclusive running `op` (maximum or minimum) of v along `axis`, by doubling
    (Hillis-Steele: ceil(log2 n) rounds, each element combined with the one 2**k before it).
    Both ops are exact and propagate NaN, so any order of combining gives the serial result."""
    n = v.shape[axis]
    step = 1
    while step < n:
        combined = getattr(L.b, op)(_along(L, v, axis, step, n), _along(L, v, axis, 0, n - step))
        v = L.b.concat([_along(L, v, axis, 0, step), combined], axis)
        step *= 2
    return v


@_register(aten.cummax.default, aten.cummin.default)
def _cummax(L: _Lowering, node: torch.fx.Node, x: _T, dim: int) -> Any:
    """(values, indices) of CPU torch's `cummax_cummin_helper`: along dim, the running value
    moves to x[i] where x[i] is NaN or (the running value is not NaN and) x[i] >= it (<= for
    cummin), so ties and NaNs take the later index. Position i's index is the last j <= i
    where x[j] equals the running max at j (or is NaN): the running max of those positions.
    The values are x gathered there (a -0.0 after a 0.0 is the value, as torch's)."""
    b = L.b
    if not x.shape:
        return x.v, b.full((1,), 0, _I32)
    axis = _dim(dim, len(x.shape))
    n = x.shape[axis]
    v = x.v
    running = _scan(L, v, axis, "maximum" if node.target is aten.cummax.default else "minimum")
    record = b.eq(v, running)
    if v.dtype.is_float:
        record = b.maximum(record, b.ne(v, v))
    iota = b.reshape(b.arange(0, n, 1, _I32), tuple(n if k == axis else 1 for k in range(len(v.shape))))
    index = _scan(L, b.where(record, b.broadcast_to(iota, v.shape), 0), axis, "maximum")
    return b.gather(v, index, axis), index


# -- histograms ----------------------------------------------------------------------------------------


def _f32(value: float) -> float:
    """`value` rounded to float32 (C++'s `static_cast<float>`), as a Python float."""
    return float(struct.unpack("f", struct.pack("f", value))[0])


_HISTC_BINS_MAX = 2**24


@_register(aten.histc.default)
def _histc(L: _Lowering, node: torch.fx.Node, x: _T, bins: int = 100, min: float = 0, max: float = 0) -> Any:
    """CPU torch's histc (`histogramdd_cpu_contiguous`, LINEAR_INTERPOLATION) step for step in
    float32: the edges are min and max as floats (the linspace's ends); an element outside
    them or NaN counts nowhere; else its bin is trunc((x - left) * bins / (right - left)), each
    operation rounded to float32 as the C++ computes it, the last bin taking its right edge.
    min == max takes the data's min and max (and widens equal ones by 1 each way); a range
    that is not finite then fails the run (torch raises). Counts are exact float32 sums."""
    b = L.b
    if x.dtype != torch.float32:
        raise L.unsupported(f"histc of {x.dtype} (float32 only: torch computes in the input's type)")
    n = int(bins)
    if not 0 < n < _HISTC_BINS_MAX:
        raise L.unsupported(f"histc with {n} bins")
    low, high = float(min), float(max)
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise L.unsupported(f"histc over [{low}, {high}] (torch raises)")
    count = math.prod(x.shape)
    v = b.reshape(x.v, (count,))
    check = None
    left: Any
    right: Any
    if low == high:  # the data's range
        left = b.neg(b.max(b.neg(v), 0))
        right = b.max(v, 0)
        same = b.eq(left, right)
        left, right = b.where(same, b.sub(left, 1.0), left), b.where(same, b.add(right, 1.0), right)
        finite = b.mul(b.eq(b.sub(left, left), 0), b.eq(b.sub(right, right), 0))
        # Index 1 into a 1-row table where the range is not finite: the run fails.
        with b.checking_range("aten.histc.default: the range of the data is not finite (torch raises)"):
            check = b.embedding(b.typecast(b.eq(finite, 0), _I32), b.full((1, 1), 0, _I32))
        width: Any = b.sub(right, left)
    else:
        first, last = _f32(low), _f32(high)
        if not first < last:
            raise L.unsupported(f"histc over [{low}, {high}], one float32 value (torch divides by 0)")
        left, right, width = first, last, _f32(last - first)
    inside = b.mul(b.ge(v, left), b.le(v, right))
    pos = b.typecast(b.div(b.mul(b.sub(v, left), float(n)), width), _I32)
    pos = b.maximum(b.minimum(pos, n - 1), 0)
    if check is not None:
        pos = b.add(pos, b.reshape(check, (1,)))
    counts = b.embedding_grad(pos, b.reshape(b.typecast(inside, _F32), (count, 1)), n)
    return b.reshape(counts, (n,))


_EMPTY[aten.histc.default] = 0  # nothing counted


# -- order statistics ---------------------------------------------------------------------------------


_Position = Callable[[_Lowering, Any, int, int], Any]


def _pick(L: _Lowering, x: _T, dim: int | None, position: int | _Position,
          shapes: tuple[Any, Any]) -> tuple[Any, Any]:
    """(values, INT32 indices) of x's sorted order along `dim` (None: flattened) at `position`:
    an int, or a function of (L, sorted values, the dim's axis, its length) giving a keepdim
    INT32 position. Stable sort, NaN as the largest (`argsort`). `shapes`: the torch shapes of
    the two results, None for one not wanted."""
    b = L.b
    if dim is None or not x.shape:
        v, axis, n = b.reshape(x.v, (math.prod(x.shape) or 1,)), 0, math.prod(x.shape) or 1
    else:
        v, axis = x.v, _dim(dim, len(x.shape))
        n = x.shape[axis]
    order = b.argsort(v, axis)
    if isinstance(position, int):
        pos = b.slice(order, [None] * axis + [position], [None] * axis + [position + 1])
    else:
        pos = b.gather(order, position(L, b.gather(v, order, axis), axis, n), axis)
    values_shape, index_shape = shapes
    return (None if values_shape is None else L.fit(b.gather(v, pos, axis), values_shape),
            None if index_shape is None else L.fit(pos, index_shape))


def _shapes(node: torch.fx.Node) -> tuple[Any, Any]:
    used, meta = _used(node), _out(node)
    return (meta[0].shape if 0 in used else None, meta[1].shape if 1 in used else None)


def _non_nan(L: _Lowering, s: Any, axis: int) -> Any:
    """How many of s along axis are not NaN (keepdim, INT32)."""
    if not s.dtype.is_float:
        return L.b.full(tuple(1 if k == axis else n for k, n in enumerate(s.shape)), s.shape[axis], _I32)
    return L.b.sum(L.b.typecast(L.b.eq(s, s), _I32), axis)


def _median_position(L: _Lowering, s: Any, axis: int, n: int) -> Any:
    """The lower median's sorted position, or the first NaN's if the row has one."""
    count = _non_nan(L, s, axis)
    return L.b.where(L.b.lt(count, n), count, L.b.full(count.shape, (n - 1) // 2, _I32))


def _nanmedian_position(L: _Lowering, s: Any, axis: int, n: int) -> Any:
    """The lower median of the non-NaN values (a row all NaN: position 0, a NaN)."""
    return L.b.maximum(L.b.floor_divide(L.b.sub(_non_nan(L, s, axis), 1), 2), 0)


@_register(aten.median.dim, aten.nanmedian.dim)
def _median_dim(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, keepdim: bool = False) -> Any:
    """The lower median along dim (torch's): NaN if the row has one (median), or of the non-NaN
    values (nanmedian); the index is one of the picked value's (torch leaves ties open)."""
    position = _nanmedian_position if node.target is aten.nanmedian.dim else _median_position
    return _pick(L, x, dim, position, _shapes(node))


@_register(aten.median.default, aten.nanmedian.default)
def _median(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    position = _nanmedian_position if node.target is aten.nanmedian.default else _median_position
    return _pick(L, x, None, position, (_out(node).shape, None))[0]


@_register(aten.kthvalue.default)
def _kthvalue(L: _Lowering, node: torch.fx.Node, x: _T, k: int, dim: int = -1, keepdim: bool = False) -> Any:
    """The k-th smallest along dim (NaN as the largest, as torch's)."""
    return _pick(L, x, dim, int(k) - 1, _shapes(node))


_MODE_MAX = 1024


@_register(aten.mode.default)
def _mode(L: _Lowering, node: torch.fx.Node, x: _T, dim: int = -1, keepdim: bool = False) -> Any:
    """The most frequent value along dim, the smallest of equally frequent ones (CPU torch's
    scan of the sorted row keeps the first run that is strictly longer), and an index of it.
    Each sorted element's count is a sum of equalities with its row (n x n: n <= 1024)."""
    b = L.b
    n = x.shape[_dim(dim, len(x.shape))] if x.shape else 1
    if n > _MODE_MAX:
        raise L.unsupported(f"the mode of {n} elements ({_MODE_MAX} at most)")

    def position(L: _Lowering, s: Any, axis: int, n: int) -> Any:
        row = b.reshape(s, s.shape[: axis + 1] + (1,) + s.shape[axis + 1:])
        col = b.reshape(s, s.shape[:axis] + (1,) + s.shape[axis:])
        count = b.reshape(b.sum(b.typecast(b.eq(row, col), _I32), axis + 1), s.shape)
        most = b.max(count, axis)
        first = b.argmax(b.eq(count, most), axis)  # the smallest value with the top count
        return b.add(first, b.sub(most, 1))  # the last of its run
    return _pick(L, x, dim, position, _shapes(node))


# -- searching a sorted sequence ----------------------------------------------------------------------


def _binary_search(L: _Lowering, seq: Any, values: Any, right: bool, sorter: Any | None) -> Any:
    """CPU torch's binary search (Bucketization.cpp), step for step: along seq's last axis,
    `start` moves past `mid` while `!(seq[mid] >= v)` (left) or `!(seq[mid] > v)` (right), for
    bit_length(n) rounds, each a `gather`; so NaN in either place ends where torch's does.
    seq [..., n] and values [..., m] share their leading dims (or seq is [1, n])."""
    b = L.b
    n = seq.shape[-1]
    shape = values.shape
    start = b.full(shape, 0, _I32)
    end = b.full(shape, n, _I32)
    for _ in range(max(n, 1).bit_length()):
        active = b.lt(start, end)
        mid = b.add(start, b.right_shift(b.sub(end, start), 1))
        at = b.minimum(mid, n - 1)
        if sorter is not None:
            at = b.gather(sorter, at, -1)
        pivot = b.gather(seq, at, -1)
        below = b.typecast(b.eq(b.gt(pivot, values) if right else b.ge(pivot, values), 0), _I32)
        move = b.mul(active, below)
        start = b.where(move, b.add(mid, 1), start)
        end = b.where(b.mul(active, b.eq(below, 0)), mid, end)
    return start


def _search(L: _Lowering, node: torch.fx.Node, seq: _T, values: _T | float, right: bool, side: str | None,
            sorter: _T | None) -> Any:
    b = L.b
    right = bool(right) or side == "right"
    vshape = values.shape if isinstance(values, _T) else ()
    common = seq.dtype if not isinstance(values, _T) else torch.promote_types(seq.dtype, values.dtype)
    sv = L.cast(seq, common)
    vv = L.cast(values, common) if isinstance(values, _T) else b.full((1,), L.operand(values, common),
                                                                      _value_dtype(common, (1,)))
    if len(seq.shape) <= 1:
        n = seq.shape[0] if seq.shape else 1
        sv = b.reshape(sv, (1, n))
        vv = b.reshape(vv, (1, math.prod(vshape) or 1))
        so = None if sorter is None else b.reshape(L.cast(sorter, torch.int32), (1, n))
    else:
        so = None if sorter is None else L.cast(sorter, torch.int32)
    return L.fit(_binary_search(L, sv, vv, right, so), _out(node).shape)


@_register(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def _searchsorted(L: _Lowering, node: torch.fx.Node, seq: _T, values: _T | float, *, out_int32: bool = False,
                  right: bool = False, side: str | None = None, sorter: _T | None = None) -> Any:
    return _search(L, node, seq, values, right, side, sorter)


@_register(aten.bucketize.Tensor, aten.bucketize.Scalar)
def _bucketize(L: _Lowering, node: torch.fx.Node, values: _T | float, boundaries: _T, *, out_int32: bool = False,
               right: bool = False) -> Any:
    return _search(L, node, boundaries, values, right, None, None)
