"""Row gathers and scatters: `rows_gather` (the compiler's gather and embedding), `rows_scatter`
(its dynamic_update_slice and cache updates), `embedding`.

`rows_gather(input [1.., R, C], indices [1.., K])` gives [1.., K, C]: row `indices[k]` of the
input for each k (`column = false`, windows of one row); `rows_scatter(input, indices, updates)`
gives the input with row `indices[k]` replaced by `updates[k]` (`reduce = invalid`: replace; in
order, so a repeated index keeps its last update) or with `updates[k]` added into it (`reduce =
sum`: every update, repeated indices summed, as `x.at[i].add`). Only
those forms are translated; others are refused by their attributes."""

from __future__ import annotations

from collections.abc import Sequence

import math

from ..._ir.builder import Value
from ..._types import DataType
from ..lower import Lowering, Translator
from ..mlir import attr_bool, attr_ints
from ..reader import TtnnOp


def _check_form(c: Lowering, op: TtnnOp, data: Value, windowed: bool = False) -> tuple[int, int]:
    if attr_bool(op.op, "column", default=False):
        raise c.refuse("a column gather/scatter (column = true)")
    windows = attr_ints(op.op, "windows", default=[1])
    if windows != [1] and not (windowed and len(windows) == 1 and 1 <= windows[0] <= max(data.shape[-2], 1)):
        raise c.refuse(f"windows {windows} (single-row windows, and one window size for a scatter, are translated)")
    if len(data.shape) < 2 or any(d != 1 for d in data.shape[:-2]):
        raise c.refuse(f"an operand of shape {data.shape} (rows of a [1.., R, C] tensor are translated)")
    return data.shape[-2], data.shape[-1]


def _flat(c: Lowering, x: Value) -> Value:
    n = 1
    for d in x.shape:
        n *= d
    return c.b.reshape(x, (n,)) if x.shape != (n,) else x


def _column_gather(c: Lowering, op: TtnnOp, data: Value, indices: Value) -> Value:
    """`column = true` on [B.., 1, C] data and [B.., 1, K] indices: out[b, k] = data[b, 0, idx[b, 0, k]]
    (take_along_axis over the last dim, a row per batch), as the compiler emits it for one."""
    if attrs_windows(op) != [1] or len(data.shape) < 2 or data.shape[-2] != 1 or indices.shape[-2:-1] != (1,) \
            or data.shape[:-2] != indices.shape[:-2]:
        raise c.refuse(f"a column gather of {data.shape} by {indices.shape} (the [B.., 1, C] form is translated)")
    batch = 1
    for d in data.shape[:-2]:
        batch *= d
    rows = c.b.reshape(data, (batch, data.shape[-1]))
    index = c.b.reshape(indices, (batch, indices.shape[-1]))
    return c.b.reshape(c.b.gather(rows, index, 1), c.result_shape(op))


def attrs_windows(op: TtnnOp) -> list[int]:
    return attr_ints(op.op, "windows", default=[1])


def _rows_gather(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    if attr_bool(op.op, "fill_out_of_bounds", default=False):
        raise c.refuse("fill_out_of_bounds = true")
    data, indices = c.operands(op)
    if attr_bool(op.op, "column", default=False):
        return [_column_gather(c, op, data, indices)]
    rows, cols = _check_form(c, op, data)
    table = c.b.reshape(data, (rows, cols))
    return [c.b.reshape(c.b.embedding(_flat(c, indices), table), c.result_shape(op))]


# A scatter's `reduce`: how an update meets what its row holds (None: it replaces it).
_REDUCE = {"#ttcore.reduce_type<invalid>": None, "#ttcore.reduce_type<sum>": "add",
           "#ttcore.reduce_type<prod>": "mul", "#ttcore.reduce_type<max>": "maximum",
           "#ttcore.reduce_type<min>": "minimum"}


def _combine(c: Lowering, kind: str | None, held: Value, update: Value) -> Value:
    return update if kind is None else getattr(c.b, kind)(held, update)


def _column_scatter(c: Lowering, op: TtnnOp, data: Value, indices: Value, updates: Value, kind: str | None) -> Value:
    """`column = true` on [B.., 1, C] data, [B.., 1, K] indices and B.. x K updates: in each row,
    column `idx[b, k]` replaced by `upd[b, k]` (or combined with it: added, multiplied, the
    larger or smaller kept), k in order; an index out of range matches no column, so its update
    is dropped (JAX's scatter rule)."""
    if attrs_windows(op) != [1] or len(data.shape) < 2 or data.shape[-2] != 1 or indices.shape[-2:-1] != (1,):
        raise c.refuse(f"a column scatter into {data.shape} by {indices.shape} (the [B.., 1, C] form is translated)")
    batch = 1
    for d in data.shape[:-2]:
        batch *= d
    cols, k = data.shape[-1], indices.shape[-1]
    if indices.shape[:-2] != data.shape[:-2] or math.prod(updates.shape) != batch * k:
        raise c.refuse(f"updates {updates.shape} and indices {indices.shape} do not fit {data.shape}")
    rows = c.b.reshape(data, (batch, cols))
    index = c.b.reshape(indices, (batch, k))
    if index.dtype is not DataType.INT32:
        index = c.b.typecast(index, DataType.INT32)
    values = c.b.reshape(updates, (batch, k))
    columns = c.b.reshape(c.b.arange(0, cols, 1, DataType.INT32), (1, cols))
    for j in range(k):
        hit = c.b.eq(columns, c.b.slice(index, [0, j], [None, j + 1]))
        value = c.b.slice(values, [0, j], [None, j + 1])
        rows = c.b.where(hit, _combine(c, kind, rows, value), rows)
    return c.b.reshape(rows, c.result_shape(op))


def _rows_scatter(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    reduce = op.op.attributes.get("reduce", "#ttcore.reduce_type<invalid>")
    if reduce not in _REDUCE:
        raise c.refuse(f"reduce {reduce} (replacement, sum, prod, max and min are translated)")
    kind = _REDUCE[reduce]
    data, indices, updates = c.operands(op)
    if attr_bool(op.op, "column", default=False):
        return [_column_scatter(c, op, data, indices, updates, kind)]
    rows, cols = _check_form(c, op, data, windowed=True)
    index = _flat(c, indices)
    (window,) = attr_ints(op.op, "windows", default=[1])
    if window > 1:
        # windows [W]: index k writes W consecutive rows from updates[k W:(k + 1) W], as JAX's
        # `.at[i:i + W].set(...)` and dynamic_update_slice do; the window's start is clamped so
        # that it fits (dynamic_update_slice's rule), then each row is a single-row scatter
        if index.dtype is not DataType.INT32:
            index = c.b.typecast(index, DataType.INT32)
        start = c.b.minimum(c.b.maximum(index, 0.0), float(rows - window))
        offsets = c.b.reshape(c.b.arange(0, window, 1, DataType.INT32), (1, window))
        index = c.b.reshape(c.b.add(c.b.reshape(start, (index.shape[0], 1)), offsets), (index.shape[0] * window,))
    k = index.shape[0]
    rows_of = c.b.reshape(updates, (k, cols))
    cache = c.b.reshape(data, (rows, cols))
    if kind == "add":  # every update added into its row: np.add.at
        added = c.b.embedding_grad(index, rows_of, rows)
        return [c.b.reshape(c.b.add(cache, added), c.result_shape(op))]
    for i in range(k):  # in order: a repeated index keeps the last update, or meets the ones before
        row = rows_of if k == 1 else c.b.slice(rows_of, [i], [i + 1])
        at = index if k == 1 else c.b.slice(index, [i], [i + 1])
        if kind is not None:
            row = _combine(c, kind, c.b.embedding(at, cache), row)
        cache = c.b.update_cache(cache, row, at)
    return [c.b.reshape(cache, c.result_shape(op))]


def _embedding(c: Lowering, op: TtnnOp) -> Sequence[Value]:
    ids, table = c.operands(op)
    if len(table.shape) != 2:
        table = c.b.reshape(table, (table.shape[-2], table.shape[-1]))
    return [c.b.reshape(c.b.embedding(ids, table), c.result_shape(op))]


TRANSLATORS: dict[str, Translator] = {
    "ttnn.rows_gather": _rows_gather, "ttnn.rows_scatter": _rows_scatter, "ttnn.embedding": _embedding,
}

READS: dict[str, frozenset[str]] = {
    "ttnn.rows_gather": frozenset({"column", "fill_out_of_bounds", "sizes", "windows"}),
    "ttnn.rows_scatter": frozenset({"column", "reduce", "sizes", "windows"}),
    "ttnn.embedding": frozenset(),
}
