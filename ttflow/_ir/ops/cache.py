"""The cache op: `update_cache`, one row of a KV cache replaced (in place when the cache is
donated to the result).
"""

from __future__ import annotations



from ..._errors import LayoutError, ShapeError
from ..core import BuilderCore, Value, _broadcast
from ..record import Kind, op
from ._shared import Array, clamped_index

__all__ = ["CacheOps"]


def _update_cache(arrays: list[Array], scalar: float | None) -> Array:
    cache, value, index = arrays
    out = cache.copy()
    row = int(clamped_index(index, cache.shape[-2])[0])
    out[..., row : row + 1, :] = value  # broadcasts value's batch dims to the cache's
    return out


class CacheOps(BuilderCore):
    """The cache ops of `ProgramBuilder`."""

    @op("update_cache", Kind.CACHE, 3, _update_cache, version=2)
    def update_cache(self, cache: Value, value: Value, index: Value, *, loc: str | None = None) -> Value:
        """A copy of `cache` [..., max_seq, d] with row `index` of axis -2 replaced by `value`
        [..., 1, d] (its batch dims broadcast to the cache's; rounded to the cache's dtype).
        `index` is an INT32 or UINT32 value of shape (1,), clamped into [0, max_seq - 1] at run
        time (as JAX's dynamic_update_slice)."""
        self._check_open()
        cache, value, index = (self._value("update_cache", v) for v in (cache, value, index))
        if len(cache.shape) < 2 or len(value.shape) < 2:
            raise ShapeError(f"update_cache takes cache [..., max_seq, d] and value [..., 1, d], "
                             f"got {cache.shape} and {value.shape}")
        batch = _broadcast(value.shape[:-2], cache.shape[:-2])
        if value.shape[-2:] != (1, cache.shape[-1]) or batch != cache.shape[:-2]:
            raise ShapeError(
                f"update_cache: value {value.shape} is not one row [..., 1, {cache.shape[-1]}] "
                f"whose batch dims broadcast to the cache's {cache.shape}"
            )
        if value.dtype.is_float != cache.dtype.is_float or (not cache.dtype.is_float and value.dtype is not cache.dtype):
            raise LayoutError(
                f"update_cache: a {value.dtype.name} value cannot go into a {cache.dtype.name} cache; typecast it"
            )
        if index.dtype.is_float:
            raise LayoutError(f"update_cache: the index must be INT32 or UINT32, got {index.dtype.name}")
        if index.shape != (1,):
            raise ShapeError(f"update_cache: the index must have shape (1,), got {index.shape}")
        return self._emit("update_cache", [cache, value, index], cache.shape, cache.dtype)
