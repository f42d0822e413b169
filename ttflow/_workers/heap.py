"""Keeps a worker's freed heap for its next program (glibc's malloc).

A program's ops make large temporaries (erf's float64 arrays, matmul's outputs) and free them
at once. In a worker process glibc gives such memory back to the kernel between programs (it
trims the heap top, or maps and unmaps each block), so every program pays its page faults
again: measured on the tensor-parallel MLP of `ttflow bench mesh --workers`, a worker's program
took 15.5 ms of CPU against 8 ms in a thread of the host (its gelu alone faulted 5 MiB of pages
a call), and 8.1 ms with this. A
worker is a long-lived process that runs the same programs over and over, so it keeps what it
freed: blocks up to `MMAP_THRESHOLD` come from the heap, the heap is trimmed only beyond
`TRIM_THRESHOLD` free at its top, and it grows `TOP_PAD` at a time. What it keeps is bounded by
the largest working set of a program it ran (plus the pad), as the host's already is.
Nothing happens outside glibc (no `mallopt`) or when the user set `MALLOC_*` variables of their
own: theirs win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["keep_freed_heap"]

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold
TRIM_THRESHOLD = 256 << 20
TOP_PAD = 64 << 20


def keep_freed_heap() -> bool:
    """Sets glibc's malloc to keep freed memory for reuse (see the module); True if it did."""
    if any(name.startswith("MALLOC_") for name in os.environ):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(option, value) == 1 for option, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD)))
