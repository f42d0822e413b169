"""Bulk bytes between the host and a worker process: a staging area in shared memory.

A host array that a write carries, and the array a read gives back, cross the process boundary
as a slot of a sparse shared file (`/dev/shm/ttflow-<pid>-<n>-staging`) that both processes
map, never pickled: the host copies a write's array into a slot and sends its `Staged`
reference (offset, dtype, shape), which the worker reads in place; for a read the host reserves
the slot the result takes, the worker writes the result there, and the host copies it out. The
host owns the slots (`StagingArea`, allocated and freed under one lock: the event loop's thread
puts, the queue's thread frees once the message's reply is in, when the worker no longer
touches them); the worker only maps the file (`_memory.map_shared`, `staged_view`).

A slot's pages are committed (`posix_fallocate`) before any byte lands in them, as bank memory's
are (`_memory`): on a full /dev/shm a byte written to an unbacked page would raise SIGBUS. An
array that finds no room (the area is full, or /dev/shm is) crosses pickled instead, counted in
`spilled`: slower, never wrong, so a full staging area is not an error.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from typing import Any, NamedTuple

import numpy as np

from ._core._allocator import Allocator
from ._memory import map_shared, shared_path

__all__ = ["STAGING_BYTES", "STAGE_MIN_BYTES", "Staged", "StagingArea", "staged_view"]

STAGING_BYTES = 64 * 2**20
"""The staging file's size per device (sparse: only slots ever used take memory)."""

STAGE_MIN_BYTES = 16 * 2**10
"""Arrays smaller than this cross pickled: for them a slot costs more than the pickling."""

_ALIGNMENT = 64
_CHUNK = 2**20
"""Pages are committed a chunk at a time, each once (the high-water mark only grows)."""


class Staged(NamedTuple):
    """An array in a slot of the staging area: what crosses instead of the array."""

    offset: int
    dtype: np.dtype[Any]  # the object (bfloat16's `.str` would be a void type)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class StagingArea:
    """One device's staging file, on the host side (see the module). `path`, `nbytes`: what the
    worker maps; `staged`/`spilled`: arrays that crossed in a slot / pickled for want of one."""

    def __init__(self, nbytes: int | None = None) -> None:
        self.nbytes = nbytes = STAGING_BYTES if nbytes is None else nbytes
        self.path = shared_path("staging")
        self._map = map_shared(self.path, nbytes, create=True)
        self._fd: int | None = os.open(self.path, os.O_RDWR)
        self._allocator = Allocator(nbytes, _ALIGNMENT, top_down=False)
        self._lock = threading.Lock()
        self._backed = 0  # bytes from the start committed in the file
        self._full = False  # /dev/shm refused to commit more: slots stay within what is backed
        self.staged = 0
        self.spilled = 0

    def _slot(self, nbytes: int) -> int | None:
        """A slot's offset, its pages committed; None when there is no room. Under the lock."""
        offset = self._allocator.allocate(max(nbytes, 1))
        if offset is None:
            return None
        end = offset + nbytes
        if end > self._backed:
            if self._full or self._fd is None:
                self._allocator.free(offset)
                return None
            target = min(self.nbytes, -(-end // _CHUNK) * _CHUNK)
            try:
                os.posix_fallocate(self._fd, self._backed, target - self._backed)
            except OSError:
                self._full = True
                self._allocator.free(offset)
                return None
            self._backed = target
        return offset

    def _view(self, ref: Staged) -> np.ndarray[Any, Any]:
        return np.frombuffer(self._map, ref.dtype, math.prod(ref.shape), ref.offset).reshape(ref.shape)

    def put(self, array: np.ndarray[Any, Any]) -> Staged | None:
        """`array` copied into a new slot, or None (it crosses pickled: too small, or no room)."""
        if array.dtype.hasobject:
            return None
        ref = self.reserve(array.dtype, tuple(array.shape))
        if ref is None:
            return None
        np.copyto(self._view(ref), array)
        return ref

    def reserve(self, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Staged | None:
        """A slot for an array the worker will write (a read's result), or None (it comes back
        pickled)."""
        ref = Staged(0, np.dtype(dtype), tuple(shape))
        if ref.nbytes < STAGE_MIN_BYTES:
            return None
        with self._lock:
            offset = self._slot(ref.nbytes)
            if offset is None:
                self.spilled += 1
                return None
            self.staged += 1
        return ref._replace(offset=offset)

    def take(self, ref: Staged) -> np.ndarray[Any, Any]:
        """A copy of the array in `ref`'s slot, which is freed."""
        array = self._view(ref).copy()
        self.release(ref)
        return array

    def release(self, ref: Staged) -> None:
        with self._lock:
            self._allocator.free(ref.offset)

    def used_bytes(self) -> int:
        with self._lock:
            return int(self._allocator.used_bytes)

    def close(self) -> None:
        """Unmaps and removes the file (the worker's mapping, if any, keeps its pages alive)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def staged_view(mapping: mmap.mmap, ref: Staged) -> np.ndarray[Any, Any]:
    """The array in `ref`'s slot, in place (the worker reads a write's array there, and writes
    a read's result there)."""
    return np.frombuffer(mapping, ref.dtype, math.prod(ref.shape), ref.offset).reshape(ref.shape)
