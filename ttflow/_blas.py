"""The BLAS thread policy for the work a device runs.

A program's matmul runs in numpy's BLAS, which by default starts one thread per core. The
emulated device already runs two command queues at once (CQ1 copies beside CQ0 programs), and
often shares the machine with other processes: a BLAS that wants every core then waits for the
busy ones, and each program gets several times slower (see docs/performance.md, "BLAS threads").
So `open_device(blas_threads=1)` limits BLAS while the device is open.

threadpoolctl sets the limit, because it handles OpenBLAS, MKL and BLIS alike. Their thread
counts are process-wide, so the limit is too, and it is shared by reference count:

- the first limit taken saves the libraries' settings; the last one released restores them;
- while several are held (devices nested, or open at once on different threads) BLAS uses the
  smallest number asked for, and closing one device re-applies the smallest of those still open;
- `blas_threads=None` takes no part: such a device runs with whatever is in force.

BLAS libraries loaded after the first limit was taken (say `import torch` inside the block) are
not limited until every limit is released and a new one is taken. A `threadpool_limits` block of
the user's own on another thread keeps control of OpenBLAS while it lasts (threadpoolctl lets
one thread at a time set it), and then the device's limit does nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, final

import threadpoolctl
from threadpoolctl import ThreadpoolController

__all__ = ["limit_blas_threads"]


@final
class _SharedLimit:
    """The one process-wide BLAS limit, held by any number of callers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[int] = []  # one entry per holder
        self._controller: ThreadpoolController | None = None
        self._original: Any = None  # a threadpoolctl limiter that remembers the settings before

    def acquire(self, threads: int) -> None:
        with self._lock:
            before = min(self._held, default=None)
            self._held.append(threads)
            if self._controller is None:
                # A new controller each time the first limit is taken: it sees the libraries
                # loaded by then.
                self._controller = ThreadpoolController()
                self._original = self._controller.limit(limits=threads, user_api="blas")
                _let_go_of_openblas()
            elif before is not None and threads < before:
                self._controller.limit(limits=threads, user_api="blas")
                _let_go_of_openblas()

    def release(self, threads: int) -> None:
        with self._lock:
            self._held.remove(threads)
            if not self._held:
                self._original.restore_original_limits()
                _let_go_of_openblas()
                self._controller = self._original = None
            elif threads < min(self._held):
                assert self._controller is not None
                self._controller.limit(limits=min(self._held), user_api="blas")
                _let_go_of_openblas()


def _let_go_of_openblas() -> None:
    """Lets the next change come from any thread.

    threadpoolctl (3.8 on) lets one thread at a time set OpenBLAS's process-wide pool size: the
    first that sets it, until that thread clears it or ends; calls from other threads do
    nothing. The first device may open on one thread and the last close on another, and this
    module's lock already orders the changes, so it clears the claim after each one. (A
    `threadpool_limits` block of the user's own, held on another thread, keeps its claim.)
    """
    openblas = getattr(threadpoolctl, "OpenBLASController", None)
    clear = getattr(openblas, "clear_controlling_thread", None)
    if clear is not None:
        clear()


_LIMIT = _SharedLimit()


def limit_blas_threads(threads: int) -> AbstractContextManager[None]:
    """Limits BLAS to `threads` threads inside the block, then restores the previous setting.

    Process-wide and reference-counted (see the module docstring): nested or concurrent blocks
    run with the smallest limit among them, and the setting from before the first block comes
    back when the last one exits. Does nothing if threadpoolctl finds no BLAS library. A bad
    `threads` raises here, before anything changes.
    """
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"blas_threads must be a positive int or None, got {threads!r}")
    if threads < 1:
        raise ValueError(f"blas_threads must be at least 1 (or None for the library default), got {threads}")
    return _held(threads)


@contextmanager
def _held(threads: int) -> Iterator[None]:
    _LIMIT.acquire(threads)
    try:
        yield
    finally:
        _LIMIT.release(threads)
