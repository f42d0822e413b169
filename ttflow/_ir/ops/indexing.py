"""Indexing: elements picked by run-time indices, clamped into range as JAX clamps (embedding,
gather) and embedding's gradient.
"""

from __future__ import annotations


import numpy as np

from ..._errors import LayoutError, ShapeError
from ..core import BuilderCore, Value, _int, _normalise_axis
from ..record import Kind, RangeCheck, op
from ._shared import Array, clamped_index

__all__ = ["IndexingOps"]


def _embedding(arrays: list[Array], scalar: float | None) -> Array:
    ids, table = arrays
    return table[clamped_index(ids, table.shape[0])]


def _gather(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    x, index = arrays
    if x.ndim == 2 and index.ndim == 2 and axis == 1 and index.shape[0] <= x.shape[0]:
        # The common case (a loss picking each row's target), without take_along_axis's
        # general index arrays: the same elements.
        rows = np.arange(index.shape[0])[:, None]
        return x[rows, clamped_index(index, x.shape[1])]
    # PyTorch reads x's leading part along the other dims; numpy broadcasts a dim of 1.
    view = x[tuple(slice(None) if d == axis or n == 1 else slice(0, i)
                   for d, (i, n) in enumerate(zip(index.shape, x.shape)))]
    view = np.broadcast_to(view, tuple(n if d == axis else i for d, (i, n) in enumerate(zip(index.shape, x.shape))))
    return np.take_along_axis(view, clamped_index(index, x.shape[axis]), axis=axis)


def _embedding_grad(arrays: list[Array], scalar: float | None, num_rows: int,
                    padding_idx: int | None) -> Array:
    ids, grad = arrays
    d = grad.shape[-1]
    out = np.zeros((num_rows, d), grad.dtype)
    np.add.at(out, clamped_index(ids, num_rows).reshape(-1), grad.reshape(-1, d))
    if padding_idx is not None:
        out[padding_idx] = 0
    return out


class IndexingOps(BuilderCore):
    """The indexing ops of `ProgramBuilder`."""

    @op("embedding", Kind.INDEXING, 2, _embedding, version=2, range_check=RangeCheck.INDEX_ROWS)
    def embedding(self, ids: Value, table: Value, *, loc: str | None = None) -> Value:
        """Rows of `table` [V, D] picked by the INT32 or UINT32 `ids` (any shape): the result is
        ids.shape + (D,) in the table's dtype. Ids out of range are clamped (see above)."""
        self._check_open()
        ids, table = self._value("embedding", ids), self._value("embedding", table)
        if ids.dtype.is_float:
            raise LayoutError(f"embedding: ids must be INT32 or UINT32, got {ids.dtype.name}; typecast them")
        if len(table.shape) != 2:
            raise ShapeError(f"embedding: the table must be [vocabulary, dim], got {table.shape}")
        return self._emit("embedding", [ids, table], ids.shape + table.shape[1:], table.dtype)

    @op("gather", Kind.INDEXING, 2, _gather, version=3, range_check=RangeCheck.INDEX_AXIS)
    def gather(self, x: Value, index: Value, axis: int, *, loc: str | None = None) -> Value:
        """`np.take_along_axis(x, index, axis)` and `torch.gather(x, axis, index)`: result[i][j]
        [k] = x[i][index[i][j][k]][k] for axis 1, in x's dtype with index's shape. `index` is
        INT32 or UINT32 of x's rank; along every other dim it is no longer than x (PyTorch's
        rule: x's leading part is read) or x's dim is 1 (numpy's broadcast). Indices are clamped
        into [0, x.shape[axis] - 1] at run time, as embedding's ids (numpy would wrap a
        negative one, PyTorch raises)."""
        self._check_open()
        x, index = self._value("gather", x), self._value("gather", index)
        if index.dtype.is_float:
            raise LayoutError(f"gather: the index must be INT32 or UINT32, got {index.dtype.name}; typecast it")
        rank = len(x.shape)
        axis = _normalise_axis("gather", axis, rank)
        if len(index.shape) != rank or any(
            d != axis and not (i <= n or n == 1) for d, (i, n) in enumerate(zip(index.shape, x.shape))
        ):
            raise ShapeError(
                f"gather along axis {axis}: index {index.shape} must have the rank of x {x.shape} and, in every "
                "other dim, be no longer than x (or x's dim 1)"
            )
        return self._emit("gather", [x, index], index.shape, x.dtype, axis=axis)

    @op("embedding_grad", Kind.INDEXING, 2, _embedding_grad, version=3, float_only=True,
        magnitude_bound=True)
    def embedding_grad(self, ids: Value, grad: Value, num_rows: int, padding_idx: int | None = None,
                       *, loc: str | None = None) -> Value:
        """The gradient of `embedding(ids, table)` with respect to a [num_rows, D] table
        (aten.embedding_dense_backward): each row of `grad` (ids.shape + (D,)) summed into the
        row its id names (np.add.at), ids clamped as embedding clamps them, so the gradient goes
        to the row the forward read. Row `padding_idx` (negative counts from the end) gets no
        gradient, as PyTorch's. Floats only; the result in grad's dtype."""
        self._check_open()
        ids, grad = self._value("embedding_grad", ids), self._value("embedding_grad", grad)
        if ids.dtype.is_float:
            raise LayoutError(f"embedding_grad: ids must be INT32 or UINT32, got {ids.dtype.name}; typecast them")
        rows = _int("embedding_grad", "num_rows", num_rows, 1)
        if len(grad.shape) != len(ids.shape) + 1 or grad.shape[:-1] != ids.shape:
            raise ShapeError(f"embedding_grad: grad {grad.shape} must be ids.shape + (D,), ids {ids.shape}")
        pad = None
        if padding_idx is not None:
            pad = _int("embedding_grad", "padding_idx", padding_idx)
            if not -rows <= pad < rows:
                raise ShapeError(f"embedding_grad: padding_idx {pad} is out of range for {rows} rows")
            pad %= rows
        return self._emit("embedding_grad", [ids, grad], (rows, grad.shape[-1]), grad.dtype,
                          num_rows=rows, padding_idx=pad)
