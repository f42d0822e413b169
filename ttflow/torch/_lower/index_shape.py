"""Shapes (views, permutes, slices, cat, split, pad) and indexing (embedding, gather, scatter,
index, index_put, sort)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

import ttflow as tt

from .device_view import _static
from .graph import (
    _EMPTY,
    _T,
    _dim,
    _ishape,
    _Lowering,
    _op_name,
    _out,
    _register,
    _used,
)

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


# -- shapes ------------------------------------------------------------------------------------------


@_register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
           aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default, aten.view_copy.default,
           aten.flatten.using_ints)
def _reshape(L: _Lowering, node: torch.fx.Node, x: _T, *args: Any) -> Any:
    return L.fit(x.v, _out(node).shape)


@_register(aten.permute.default)
def _permute(L: _Lowering, node: torch.fx.Node, x: _T, dims: Sequence[int]) -> Any:
    rank = len(x.shape)
    perm = tuple(_dim(d, rank) for d in dims)
    if rank < 2 or perm == tuple(range(rank)):
        return x.v
    return L.b.permute(x.v, perm)


@_register(aten.t.default, aten.transpose.int)
def _transpose(L: _Lowering, node: torch.fx.Node, x: _T, d0: int = 0, d1: int = 1) -> Any:
    rank = len(x.shape)
    if rank < 2:
        return x.v
    perm = list(range(rank))
    i, j = _dim(d0, rank), _dim(d1, rank)
    perm[i], perm[j] = perm[j], perm[i]
    return L.b.permute(x.v, perm) if i != j else x.v


@_register(aten.expand.default, aten.expand_copy.default)
def _expand(L: _Lowering, node: torch.fx.Node, x: _T, size: Any, implicit: bool = False) -> Any:
    target = _ishape(_out(node).shape)
    return x.v if x.v.shape == target else L.b.broadcast_to(x.v, target)


@_register(aten.repeat.default)
def _repeat(L: _Lowering, node: torch.fx.Node, x: _T, repeats: Sequence[int]) -> Any:
    """`x.repeat(*repeats)` (tiling, as np.tile): each dim gets a size-1 axis in front, which
    broadcasts to its repeat count, and each pair then merges (rotary embeddings' cos.repeat)."""
    out = _ishape(_out(node).shape)
    if math.prod(repeats) == 1:
        return L.fit(x.v, out)
    shape = (1,) * (len(repeats) - len(x.shape)) + tuple(x.shape)
    paired = tuple(d for n in shape for d in (1, n))
    tiled = tuple(d for r, n in zip(repeats, shape) for d in (r, n))
    return L.fit(L.b.broadcast_to(L.b.reshape(x.v, paired), tiled), out)


@_register(aten.select.int)
def _select(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: int) -> Any:
    rank = len(x.shape)
    d = _dim(dim, rank)
    if x.shape[d] == 1:  # the whole dim (a foreach's scalar per tensor): only a reshape
        return L.fit(x.v, _out(node).shape)
    i = index % x.shape[d]
    v = L.b.slice(x.v, [None] * d + [i], [None] * d + [i + 1])
    return L.fit(v, _out(node).shape)


@_register(aten.slice.Tensor)
def _slice(L: _Lowering, node: torch.fx.Node, x: _T, dim: int = 0, start: int | None = None,
           end: int | None = None, step: int = 1) -> Any:
    d = _dim(dim, len(x.shape))
    if _static(_out(node).shape, node.name) == x.shape:
        return x.v
    return L.b.slice(x.v, [None] * d + [start], [None] * d + [end], [1] * d + [step])


@_register(aten.constant_pad_nd.default)
def _constant_pad_nd(L: _Lowering, node: torch.fx.Node, x: _T, pad: Sequence[int], value: float = 0) -> Any:
    """F.pad's constant mode: pairs (before, after) from the last dim back; a negative amount
    crops. Each padded dim is a concat of constant blocks around x (cropped first)."""
    b = L.b
    dtype = _out(node).dtype
    v, shape = L.cast(x, dtype), list(x.shape)
    for k in range(len(pad) // 2):
        d = len(shape) - 1 - k
        before, after = int(pad[2 * k]), int(pad[2 * k + 1])
        if before < 0 or after < 0:  # crop first
            start, end = max(-before, 0), shape[d] - max(-after, 0)
            v = b.slice(v, [None] * d + [start], [None] * d + [end])
            shape[d] = end - start
        parts = []
        for amount in (before, after):
            parts.append(L.full(shape[:d] + [amount] + shape[d + 1:], value, dtype) if amount > 0 else None)
        pieces = [p for p in (parts[0], v, parts[1]) if p is not None]
        if len(pieces) > 1:
            v = b.concat(pieces, d)
        shape[d] += max(before, 0) + max(after, 0)
    return v


@_register(aten.cat.default, aten.concat.default)
def _cat(L: _Lowering, node: torch.fx.Node, tensors: Sequence[_T], dim: int = 0) -> Any:
    meta = _out(node)
    parts = [t for t in tensors if 0 not in t.shape]
    d = _dim(dim, len(meta.shape))
    vs = [L.cast(t, meta.dtype) for t in parts]
    return vs[0] if len(vs) == 1 else L.b.concat(vs, d)


@_register(aten.slice_scatter.default)
def _slice_scatter(L: _Lowering, node: torch.fx.Node, x: _T, src: _T, dim: int = 0, start: int | None = None,
                   end: int | None = None, step: int = 1) -> Any:
    """x with x[start:end:step] (along dim) replaced by src: the untouched ends joined around
    the middle; a step > 1 spreads src by interleaving it with zeros (a concat and a reshape)
    and picks it where a 1/0 pattern made the same way says so."""
    b, rank = L.b, len(x.shape)
    d = _dim(dim, rank)
    first, last, _ = slice(start, end, step).indices(x.shape[d])
    dtype = _out(node).dtype
    xv, sv = L.cast(x, dtype), L.cast(src, dtype)
    k, span = src.shape[d], last - first

    def take(v: Any, a: int, e: int) -> Any:
        return b.slice(v, [None] * d + [a], [None] * d + [e])

    if step == 1:
        mid = sv
    else:
        def spread(v: Any) -> Any:
            shape = v.shape[: d + 1] + (1,) + v.shape[d + 1:]
            gaps = L.full(v.shape[: d + 1] + (step - 1,) + v.shape[d + 1:], 0, dtype)
            joined = b.concat([b.reshape(v, shape), gaps], d + 1)
            flat = b.reshape(joined, v.shape[:d] + (k * step,) + v.shape[d + 1:])
            return take(flat, 0, span) if k * step != span else flat

        pattern = spread(L.full(sv.shape, 1, dtype))
        mid = b.where(pattern, spread(sv), take(xv, first, last))
    parts = ([take(xv, 0, first)] if first > 0 else []) + [mid] + (
        [take(xv, last, x.shape[d])] if last < x.shape[d] else [])
    return parts[0] if len(parts) == 1 else b.concat(parts, d)


def _split(L: _Lowering, node: torch.fx.Node, x: _T, sizes: Sequence[int], dim: int) -> tuple[Any, ...]:
    d = _dim(dim, len(x.shape))
    used, out, start = _used(node), [], 0
    for i, n in enumerate(sizes):
        out.append(L.b.slice(x.v, [None] * d + [start], [None] * d + [start + n]) if i in used else None)
        start += n
    return tuple(out)


@_register(aten.split_with_sizes.default)
def _split_with_sizes(L: _Lowering, node: torch.fx.Node, x: _T, sizes: Sequence[int], dim: int = 0) -> Any:
    return _split(L, node, x, sizes, dim)


@_register(aten.split.Tensor)
def _split_tensor(L: _Lowering, node: torch.fx.Node, x: _T, size: int, dim: int = 0) -> Any:
    return _split(L, node, x, [m.shape[_dim(dim, len(x.shape))] for m in _out(node)], dim)


@_register(aten.unbind.int)
def _unbind(L: _Lowering, node: torch.fx.Node, x: _T, dim: int = 0) -> Any:
    d = _dim(dim, len(x.shape))
    parts = _split(L, node, x, [1] * x.shape[d], d)
    return tuple(None if p is None else L.fit(p, m.shape) for p, m in zip(parts, _out(node)))


# -- indexing ----------------------------------------------------------------------------------------


@_register(aten.embedding.default)
def _embedding(L: _Lowering, node: torch.fx.Node, weight: _T, ids: _T, *args: Any) -> Any:
    if len(weight.shape) != 2:
        raise L.unsupported(f"an embedding table of shape {weight.shape}; it must be [rows, dim]")
    return L.b.embedding(ids.v, weight.v)


def _gather_table(L: _Lowering, x: _T, dim: int) -> tuple[Any, tuple[int, ...], list[int]]:
    """x with `dim` moved first and the rest flattened: ([n, rest] table, other dims, perm)."""
    rank = len(x.shape)
    d = _dim(dim, rank)
    perm = [d] + [i for i in range(rank) if i != d]
    v = x.v if d == 0 else L.b.permute(x.v, perm)
    others = tuple(x.shape[i] for i in perm[1:])
    return L.b.reshape(v, (x.shape[d], math.prod(others))), others, perm


@_register(aten.index_select.default)
def _index_select(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: _T) -> Any:
    if not x.shape:
        return x.v
    table, others, perm = _gather_table(L, x, dim)
    rows = L.b.embedding(L.fit(index.v, (math.prod(index.shape) or 1,)), table)
    v = L.b.reshape(rows, (rows.shape[0], *others))
    if perm != list(range(len(perm))):
        v = L.b.permute(v, [perm.index(i) for i in range(len(perm))])
    return v


def _linear_index(L: _Lowering, shape: tuple[int, ...], indices: Sequence[_T | None]
                  ) -> tuple[Any, list[int], tuple[int, ...]]:
    """Advanced indexing's integer index tensors as one flat row index into x seen as
    [prod(indexed dims), prod(other dims)]: (the INT32 row index, broadcast to the indices'
    common shape; the indexed dims; that shape). A negative index counts from the end, as in
    Python; each index is checked against its own dim (an embedding into a zero table of that
    many rows, whose result is added in: 0, and the run fails where torch raises IndexError),
    since the flat index alone could land in range with a bad part."""
    b = L.b
    dims = [d for d, t in enumerate(indices) if t is not None]
    for d in dims:
        t = indices[d]
        assert t is not None
        if t.dtype == torch.bool:
            raise L.unsupported("a boolean mask index (the result's shape depends on the values)")
    common = tuple(torch.broadcast_shapes(*(indices[d].shape for d in dims)))  # type: ignore[union-attr]
    flat, stride = None, 1
    for d in reversed(dims):
        t = indices[d]
        assert t is not None
        size = shape[d]
        v = L.cast(t, torch.int32)
        v = b.add(v, b.mul(b.lt(v, 0), size))
        checked = b.embedding(v, b.full((size, 1), 0, _I32))
        v = b.add(v, b.reshape(checked, v.shape))
        if v.shape != _ishape(common):
            v = b.broadcast_to(L.fit(v, (1,) * (len(common) - len(t.shape)) + t.shape), _ishape(common))
        term = v if stride == 1 else b.mul(v, stride)
        flat = term if flat is None else b.add(flat, term)
        stride *= size
    return flat, dims, common


def _indexed_table(L: _Lowering, x: _T, dims: Sequence[int]) -> tuple[Any, list[int], list[int]]:
    """x with `dims` first, as [prod(dims), prod(rest)]; (the table, the permutation, rest)."""
    rank = len(x.shape)
    rest = [d for d in range(rank) if d not in dims]
    perm = [*dims, *rest]
    v = x.v if perm == list(range(rank)) else L.b.permute(x.v, perm)
    rows = math.prod(x.shape[d] for d in dims)
    return L.b.reshape(v, (rows, math.prod(x.shape[d] for d in rest))), perm, rest


def _index_placement(dims: Sequence[int], n_common: int, n_rest: int) -> list[int] | None:
    """Where torch puts the indexed result's dims: in place of the indexed dims when those are
    adjacent, else first. The permutation from (common..., rest...) to torch's order, or None."""
    first = dims[0]
    if list(dims) != list(range(first, first + len(dims))) or first == 0:
        return None
    common, rest = list(range(n_common)), list(range(n_common, n_common + n_rest))
    return rest[:first] + common + rest[first:]


@_register(aten.index.Tensor)
def _index(L: _Lowering, node: torch.fx.Node, x: _T, indices: Sequence[_T | None]) -> Any:
    """`x[i, j]`, `x[:, i]`, `x[i, :, j]`: integer index tensors on any dims (broadcast
    together), as one embedding of x seen as [indexed rows, the rest]."""
    b = L.b
    if not x.shape:
        raise L.unsupported("indexing a 0-d tensor with a tensor")
    flat, dims, common = _linear_index(L, x.shape, indices)
    table, _, rest = _indexed_table(L, x, dims)
    rows = b.embedding(flat, table)
    full = (*common, *(x.shape[d] for d in rest))
    v = b.reshape(rows, _ishape(full))
    order = _index_placement(dims, len(common), len(rest))
    if order is not None:
        v = b.permute(v, order)
    return L.fit(v, _out(node).shape)


def _sorted(L: _Lowering, x: _T, dim: int, descending: bool) -> tuple[Any, Any, int]:
    """(values, INT32 indices, axis) of x sorted along `dim`: stable, NaN as the largest."""
    if not x.shape:
        raise L.unsupported("sorting a 0-d tensor")
    axis = _dim(dim, len(x.shape))
    index = L.b.argsort(x.v, axis, bool(descending))
    return L.b.gather(x.v, index, axis), index, axis


@_register(aten.sort.default, aten.sort.stable)
def _sort(L: _Lowering, node: torch.fx.Node, x: _T, dim: int = -1, descending: bool = False, *,
          stable: bool | None = None) -> Any:
    values, index, _ = _sorted(L, x, dim, descending)  # always stable: a valid unstable order too
    return values, index


@_register(aten.topk.default)
def _topk(L: _Lowering, node: torch.fx.Node, x: _T, k: int, dim: int = -1, largest: bool = True,
          sorted: bool = True) -> Any:
    """The first k of a stable sort (ties: the earlier index first; CPU torch leaves their order
    unspecified, and its values are the same)."""
    values, index, axis = _sorted(L, x, dim, largest)
    ends = [None] * axis + [int(k)]
    return L.b.slice(values, [0] * (axis + 1), ends), L.b.slice(index, [0] * (axis + 1), ends)


@_register(aten.gather.default)
def _gather(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: _T, sparse_grad: bool = False) -> Any:
    rank = len(x.shape)
    d = _dim(dim, rank) if rank else 0
    v = x.v
    if any(i < n for k, (i, n) in enumerate(zip(index.shape, x.shape)) if k != d):
        # torch reads only the index's extent in the other dims; take_along_axis wants them equal.
        ends = [None if k == d else index.shape[k] for k in range(rank)]
        v = L.b.slice(v, [0] * rank, ends)
    return L.b.gather(v, index.v, d)


def _one_hot(L: _Lowering, shape: tuple[int, ...], d: int, index: Any) -> list[Any]:
    """For each position j along `index`'s dim d: 1 where the target position equals index[..., j, ...]."""
    b = L.b
    iota = b.reshape(b.arange(0, shape[d], 1, _I32), tuple(shape[d] if k == d else 1 for k in range(len(shape))))
    masks = []
    for j in range(index.shape[d]):
        idx = index if index.shape[d] == 1 else b.slice(index, [None] * d + [j], [None] * d + [j + 1])
        masks.append(b.eq(idx, iota))
    return masks


_ONE_HOT_MAX = 64
"""Index positions along the scattered dim that the one-hot form unrolls (one `where` each)."""

_REDUCE_NAMES = {"add": "sum", "sum": "sum", "multiply": "prod", "prod": "prod", "mean": "mean",
                 "amax": "amax", "amin": "amin"}


def _identity(L: _Lowering, shape: Sequence[int], reduce: str, dtype: torch.dtype) -> Any:
    """The value a reduction starts from (torch's init value for include_self=False)."""
    if reduce in ("sum", "mean"):
        return L.full(shape, 0, dtype)
    if reduce == "prod":
        return L.full(shape, 1, dtype)
    big: float = math.inf if dtype.is_floating_point else (1 if dtype == torch.bool else 2**31 - 1)
    small: float = -math.inf if dtype.is_floating_point else (0 if dtype == torch.bool else -(2**31))
    return L.full(shape, small if reduce == "amax" else big, dtype)


def _check_index(L: _Lowering, idx: Any, size: int, what: str) -> Any:
    """idx unchanged, but the run fails where an index is outside [0, size) (torch raises
    IndexError; a one-hot mask would drop it, an embedding clamp it): an embedding into a zero
    table of `size` rows, whose result (0) is added in."""
    b = L.b
    with b.checking_range(f"{what} indexes"):
        checked = b.embedding(idx, b.full((size, 1), 0, _I32))
        return b.add(idx, b.reshape(checked, idx.shape))


def _scatter_into(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: _T, src: _T | float,
                  reduce: str | None, include_self: bool = True) -> Any:
    """`x.scatter_reduce(dim, index, src, reduce, include_self)` (reduce None: a plain scatter,
    the last index position along `dim` wins, as CPU torch's serial loop). torch reads only
    index's extent in the other dims: x is cut to that block, scattered, and joined back. An
    index extent along `dim` of at most 64 unrolls one-hot masks (each position's reduction
    step in torch's order, so floats match bit for bit); a longer one scatters by flat ids
    (`_accumulate_rows` / `_last_writer`) for a plain scatter, sum and mean."""
    b, dtype = L.b, _out(node).dtype
    xv = L.cast(x, dtype)
    if index.v is None:  # nothing scattered
        return xv
    xs, ishape = _ishape(x.shape), _ishape(index.shape)
    rank = len(xs)
    d = _dim(dim, len(x.shape)) if x.shape else 0
    if len(ishape) != rank:
        raise L.unsupported(f"an index of shape {index.shape} into {x.shape}")
    cut, sub = [], xv
    for k in range(rank):
        if k != d and ishape[k] < xs[k]:
            cut.append((k, b.slice(sub, [None] * k + [ishape[k]], [None] * (k + 1))))
            sub = b.slice(sub, [None] * k + [0], [None] * k + [ishape[k]])
    shape = tuple(ishape[k] if k != d else xs[d] for k in range(rank))
    idx = _check_index(L, L.cast(index, torch.int32), xs[d], _op_name(node.target))
    if isinstance(src, _T):
        sv = L.cast(src, dtype)
        if sv.shape != ishape:  # torch reads src's leading block too
            sv = b.slice(sv, [0] * rank, list(ishape))
    else:
        sv = L.operand(src, dtype)
    if ishape[d] <= _ONE_HOT_MAX:
        out = _scatter_one_hot(L, sub, shape, d, idx, sv, reduce, include_self, dtype)
    else:
        out = _scatter_flat(L, sub, shape, d, idx, sv, reduce, include_self, dtype)
    for k, rest in reversed(cut):
        out = b.concat([out, rest], k)
    return b.ne(out, 0) if dtype == torch.bool and reduce in ("sum", "mean") else out


def _scatter_one_hot(L: _Lowering, v: Any, shape: tuple[int, ...], d: int, idx: Any, sv: Any,
                     reduce: str | None, include_self: bool, dtype: torch.dtype) -> Any:
    b = L.b
    masks = _one_hot(L, shape, d, idx)
    if reduce is not None and not include_self:
        hit = masks[0]
        for m in masks[1:]:
            hit = b.maximum(hit, m)
        v = b.where(hit, _identity(L, shape, reduce, dtype), v)
    count = None
    for j, mask in enumerate(masks):
        s = sv
        if not isinstance(sv, (int, float)) and sv.shape[d] != 1:
            s = b.slice(sv, [None] * d + [j], [None] * d + [j + 1])
        if isinstance(s, (int, float)) and reduce is not None:
            s = L.b.full((1,) * len(shape), s, v.dtype)
        if reduce is None:
            v = b.where(mask, s, v)
        elif reduce in ("sum", "mean"):
            v = b.add(v, b.where(mask, s, 0))
            if reduce == "mean":
                count = mask if count is None else b.add(count, mask)
        elif reduce == "prod":
            v = b.mul(v, b.where(mask, s, 1))
        elif reduce == "amax":
            v = b.maximum(v, b.where(mask, s, v))
        else:
            v = b.minimum(v, b.where(mask, s, v))
    if reduce == "mean":
        assert count is not None
        return _mean_of(L, v, count, include_self, dtype)
    return v


def _mean_of(L: _Lowering, total: Any, count: Any, include_self: bool, dtype: torch.dtype) -> Any:
    """torch's scatter mean: the sum over the count (self counted once if included; 0 read as
    1), a floor division for integers."""
    b = L.b
    if include_self:
        count = b.add(count, 1)
    count = b.where(b.eq(count, 0), 1, count)
    if dtype.is_floating_point:
        return b.div(total, b.typecast(count, total.dtype))
    return b.floor_divide(total, count)


def _flat_ids(L: _Lowering, shape: tuple[int, ...], d: int, idx: Any) -> Any:
    """The (N,) flat ids into `shape` of each index element's target (its own position with the
    index along `d`); idx has `shape` but along `d`."""
    b = L.b
    rank = len(shape)
    strides = [math.prod(shape[k + 1:]) for k in range(rank)]
    lin = idx if strides[d] == 1 else b.mul(idx, strides[d])
    for k in range(rank):
        if k == d or shape[k] == 1:
            continue
        r = b.reshape(b.arange(0, shape[k], 1, _I32), tuple(shape[k] if q == k else 1 for q in range(rank)))
        lin = b.add(lin, r if strides[k] == 1 else b.mul(r, strides[k]))
    return b.reshape(lin, (math.prod(lin.shape),))


def _scatter_flat(L: _Lowering, v: Any, shape: tuple[int, ...], d: int, idx: Any, sv: Any,
                  reduce: str | None, include_self: bool, dtype: torch.dtype) -> Any:
    b = L.b
    if reduce not in (None, "sum", "mean"):
        raise L.unsupported(f"a scatter {reduce} of {idx.shape[d]} index positions along dim {d} "
                            f"({_ONE_HOT_MAX} at most)")
    ids = _flat_ids(L, shape, d, idx)
    n, rows = ids.shape[0], math.prod(shape)
    if isinstance(sv, (int, float)):
        values = b.full((n, 1), sv, v.dtype)
    else:
        values = b.reshape(sv if sv.shape == idx.shape else b.broadcast_to(sv, idx.shape), (n, 1))
    table = b.reshape(v, (rows, 1))
    if reduce is None:
        hit, pos = _last_writer(L, ids, rows)
        out = b.where(hit, b.embedding(pos, values), table)
    else:
        total = _accumulate_rows(L, ids, values, rows, dtype, table if include_self else None)
        if not include_self:
            hit, _ = _last_writer(L, ids, rows, positions=False)
            total = b.where(hit, total, table)
        out = total
        if reduce == "mean":
            count, _ = _last_writer(L, ids, rows, positions=False, counts=True)
            out = _mean_of(L, total, count, include_self, dtype)
    return b.reshape(out, shape)


def _last_writer(L: _Lowering, ids: Any, rows: int, positions: bool = True, counts: bool = False
                 ) -> tuple[Any, Any]:
    """For each of `rows` targets of the (N,) INT32 `ids`: (1 where some id names it (its count
    with `counts`) [rows, 1], the position in ids of the last id naming it (rows,), or None).
    The last one is found without a loop: a histogram of the ids (float32 sums of ones, exact
    below 2**24), its running sum (how many ids are <= each row), and a stable argsort of the
    ids, whose entry at that running sum - 1 is the last id of the row."""
    b = L.b
    n = ids.shape[0]
    if n >= 2**24:
        raise L.unsupported(f"{n} scattered elements (fewer than 2**24)")
    hist = b.typecast(b.embedding_grad(ids, b.full((n, 1), 1.0, _F32), rows), _I32)
    hit = hist if counts else b.gt(hist, 0)
    if not positions:
        return hit, None
    upto = b.reshape(b.cumsum(hist, 0), (rows,))
    order = b.reshape(b.argsort(ids, 0), (n, 1))
    pos = b.embedding(b.maximum(b.sub(upto, 1), 0), order)
    return hit, b.reshape(pos, (rows,))


def _accumulate_rows(L: _Lowering, ids: Any, values: Any, rows: int, dtype: torch.dtype,
                     first: Any | None = None) -> Any:
    """`np.add.at(first or zeros, ids, values)` into a [rows, W] table: (N,) INT32 ids, [N, W]
    values in `dtype`'s device dtype, exact as torch's serial loop. Floats by `embedding_grad`
    (float32 sums in id order, `first` going first, as torch starts from self). Integers by
    their four bytes, each summed exactly in float32 (below 2**24 for fewer than 65793 terms)
    and joined back (the top byte signed): exact for INT32, and for int64 held as INT32 the
    joins are range-checked steps, each in range exactly when the total is. Bools: any."""
    b = L.b
    if first is not None:
        ids = b.concat([b.arange(0, rows, 1, _I32), ids], 0)
        values = b.concat([first, values], 0)
    if dtype.is_floating_point:
        return b.embedding_grad(ids, values, rows)
    if dtype == torch.bool:
        return b.typecast(b.gt(b.embedding_grad(ids, b.typecast(values, _F32), rows), 0), values.dtype)
    n, width = values.shape
    if n >= 65793:
        raise L.unsupported(f"an integer accumulation of {n} terms (65792 at most)")
    parts = [b.bitwise_and(values, 255), b.bitwise_and(b.right_shift(values, 8), 255),
             b.bitwise_and(b.right_shift(values, 16), 255), b.right_shift(values, 24)]
    sums = b.typecast(b.embedding_grad(ids, b.typecast(b.concat(parts, 1), _F32), rows), values.dtype)
    chunk = [b.slice(sums, [0, k * width], [rows, (k + 1) * width]) for k in range(4)]
    total = chunk[3]
    for k in (2, 1, 0):
        total = b.add(b.mul(total, 256), chunk[k])
    return total


@_register(aten.scatter.value, aten.scatter.src, aten.scatter_add.default)
def _scatter(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: _T, src: Any) -> Any:
    reduce = "sum" if node.target is aten.scatter_add.default else None
    return _scatter_into(L, node, x, dim, index, src, reduce)


@_register(aten.scatter.reduce, aten.scatter.value_reduce)
def _scatter_reduce_legacy(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: _T, src: Any, *,
                           reduce: str) -> Any:
    """`scatter(..., reduce="add" | "multiply")`: self included."""
    return _scatter_into(L, node, x, dim, index, src, _REDUCE_NAMES[reduce])


@_register(aten.scatter_reduce.two)
def _scatter_reduce(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: _T, src: _T, reduce: str, *,
                    include_self: bool = True) -> Any:
    return _scatter_into(L, node, x, dim, index, src, _REDUCE_NAMES[reduce], include_self)


for _op in (aten.scatter.value, aten.scatter.src, aten.scatter_add.default, aten.scatter.reduce,
            aten.scatter.value_reduce, aten.scatter_reduce.two):
    _EMPTY[_op] = "drop"  # an empty index scatters nothing: x (`_scatter_into`)


@_register(aten.index_put.default, aten._index_put_impl.default)
def _index_put(L: _Lowering, node: torch.fx.Node, x: _T, indices: Sequence[_T | None], values: _T,
               accumulate: bool = False, unsafe: bool = False) -> Any:
    """Two forms. `x[mask] = value` (one bool mask over x's leading dims, a single value, no
    accumulate: PyTorch passes such masks on purpose) as a `where`. And
    `x.index_put_(indices, values, accumulate)` with integer index tensors on any dims (the
    backward of embedding, of `x[i, j]`, of index_select; index_copy, index_fill, max_unpool)
    on x seen as [indexed rows, the rest]: accumulate=True sums into each row in torch's order,
    x first (`_accumulate_rows`: exact for integers); accumulate=False writes each row from the
    last index naming it in row-major order (`_last_writer`), which is what CPU torch's serial
    loop leaves (torch leaves the winner among duplicates unspecified)."""
    given = [i for i, t in enumerate(indices) if t is not None]
    if not x.shape or not given:
        raise L.unsupported("index_put on a 0-d tensor or without an index")
    if any(indices[d].dtype == torch.bool for d in given):  # type: ignore[union-attr]
        return _masked_put(L, x, indices, values, accumulate)
    b = L.b
    flat, dims, common = _linear_index(L, x.shape, indices)
    rest = [d for d in range(len(x.shape)) if d not in dims]
    # The values as torch lays out x[indices]: then as (common..., rest...), the table's rows.
    indexed = (*common, *(x.shape[d] for d in rest))
    order = _index_placement(dims, len(common), len(rest))
    laid_out = tuple(indexed[i] for i in order) if order is not None else indexed
    grad = L.cast(values, x.dtype)
    if grad.shape != _ishape(laid_out):
        grad = b.broadcast_to(L.fit(grad, (1,) * (len(laid_out) - len(values.shape)) + values.shape),
                              _ishape(laid_out))
    if order is not None:
        grad = b.permute(grad, [order.index(i) for i in range(len(order))])
    rows = math.prod(x.shape[d] for d in dims)
    width = math.prod(x.shape[d] for d in rest)
    ids = L.fit(flat, (math.prod(common),))
    grad = b.reshape(grad, (math.prod(common), width))
    table, perm, _ = _indexed_table(L, x, dims)
    if accumulate:
        g = _accumulate_rows(L, ids, grad, rows, x.dtype, None if x.v.id in L.zeros else table)
    else:
        hit, pos = _last_writer(L, ids, rows)
        g = b.where(hit, b.embedding(pos, grad), table)
    g = b.reshape(g, _ishape((*(x.shape[d] for d in dims), *(x.shape[d] for d in rest))))
    if perm != list(range(len(perm))):
        g = b.permute(g, [perm.index(i) for i in range(len(perm))])
    return g


def _masked_put(L: _Lowering, x: _T, indices: Sequence[_T | None], values: _T, accumulate: bool) -> Any:
    """`x[mask] = value`: where the mask (over the dims it indexes, broadcast over the rest) is
    true, the value. Only a single value (how many elements a mask selects is known at run
    time only, so a tensor of values has no static layout)."""
    given = [i for i, t in enumerate(indices) if t is not None]
    mask = indices[given[0]]
    assert mask is not None
    first = given[0]
    if len(given) != 1 or accumulate or math.prod(values.shape) != 1:
        raise L.unsupported("index_put with a bool mask lowers as `x[mask] = one value` only")
    if tuple(x.shape[first:first + len(mask.shape)]) != tuple(mask.shape):
        raise L.unsupported(f"a bool mask of shape {mask.shape} for dims {first}.. of {x.shape}")
    b = L.b
    full = (1,) * first + tuple(mask.shape) + (1,) * (len(x.shape) - first - len(mask.shape))
    cond = b.broadcast_to(L.fit(L.bool01(mask), full), _ishape(x.shape))
    value = b.broadcast_to(L.fit(L.cast(values, x.dtype), (1,) * len(x.shape)), _ishape(x.shape))
    return b.where(cond, value, x.v)


@_register(aten.index_reduce.default)
def _index_reduce(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: _T, source: _T, reduce: str, *,
                  include_self: bool = True) -> Any:
    """`x.index_reduce(dim, index, source, reduce)`: the scatter_reduce whose index is `index`
    laid along `dim` of source's shape (each source slice i goes to x's slice index[i], in i's
    order, as CPU torch's loop)."""
    if index.v is None or source.v is None:
        return L.cast(x, _out(node).dtype)
    rank = len(source.shape)
    d = _dim(dim, rank) if rank else 0
    shape = _ishape(source.shape)
    along = tuple(shape[d] if k == d else 1 for k in range(len(shape)))
    idx = L.b.broadcast_to(L.b.reshape(L.cast(index, torch.int32), along), shape)
    return _scatter_into(L, node, x, dim, _T(idx, tuple(source.shape), torch.int32), source,
                         _REDUCE_NAMES[reduce], include_self)


_EMPTY[aten.index_reduce.default] = "drop"


@_register(aten.put.default)
def _put(L: _Lowering, node: torch.fx.Node, x: _T, index: _T, source: _T, accumulate: bool = False) -> Any:
    """`x.put(index, source, accumulate)`: x flattened, indexed like index_put (negative indices
    from the end; an index out of range fails the run, as torch raises)."""
    b, dtype = L.b, _out(node).dtype
    xv = L.cast(x, dtype)
    if index.v is None:
        return xv
    numel = math.prod(x.shape)
    with b.checking_range(f"{_op_name(node.target)} indexes"):
        flat, _, _ = _linear_index(L, (numel,), [_T(L.fit(index.v, (math.prod(index.shape),)),
                                                     (math.prod(index.shape),), index.dtype)])
    n = flat.shape[0]
    values = b.reshape(L.cast(source, dtype), (n, 1))
    table = b.reshape(xv, (numel, 1))
    if accumulate:
        out = _accumulate_rows(L, flat, values, numel, dtype, table)
    else:
        hit, pos = _last_writer(L, flat, numel)
        out = b.where(hit, b.embedding(pos, values), table)
    return L.fit(out, x.shape)


_EMPTY[aten.put.default] = "drop"


@_register(aten.unfold.default)
def _unfold(L: _Lowering, node: torch.fx.Node, x: _T, dimension: int, size: int, step: int) -> Any:
    """`x.unfold(dim, size, step)`: the windows along dim as an index_select of a constant
    window index ([windows, size]: start * step + offset), the size dim moved last."""
    b = L.b
    if not x.shape:
        return L.fit(x.v, _out(node).shape)
    rank = len(x.shape)
    d = _dim(dimension, rank)
    windows = _out(node).shape[d]
    starts = b.reshape(b.arange(0, windows * step, step, _I32), (windows, 1))
    idx = b.add(starts, b.reshape(b.arange(0, size, 1, _I32), (1, size)))
    table, others, perm = _gather_table(L, x, d)
    rows = b.reshape(b.embedding(idx, table), (windows, size, *others))  # axes: d, size, the others
    order = [0 if k == d else 2 + perm[1:].index(k) for k in range(rank)] + [1]
    return L.fit(b.permute(rows, order) if order != list(range(rank + 1)) else rows, _out(node).shape)
