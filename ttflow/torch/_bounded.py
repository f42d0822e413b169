"""A cache that keeps at most `capacity` entries: programs traced per call signature.

Eager ops and foreach calls trace a program per signature (op, argument shapes and dtypes,
constants). A workload whose shapes keep changing (variable-length batches, eager) would keep
every program it ever traced: about 27 KB each (binary, plan, schedule), 80 MB per 1,000 new
shapes of a three-op expression. Past `capacity` the oldest entry goes (an evicted signature is
traced again if it comes back), as XLA bounds its compile cache. Reads are a plain `dict.get`;
writes take a lock, so that two threads inserting at once evict one entry each, never a key
another is iterating to.
"""

from __future__ import annotations

import threading
from typing import TypeVar

__all__ = ["BoundedCache"]

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(dict[K, V]):
    """A dict that forgets its oldest inserted entries past `capacity` (first in, first out: a
    hit costs nothing, and a hot entry comes back after a retrace)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._lock = threading.Lock()

    def __setitem__(self, key: K, value: V) -> None:
        with self._lock:
            super().__setitem__(key, value)
            while len(self) > self.capacity:
                super().__delitem__(next(iter(self)))
