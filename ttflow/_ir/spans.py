"""Spans a timed run notes on its own thread, for the timeline: one collector per kind (a
program's ops, its host ops), each a thread-local list that `collecting` installs for the
block and that the code being timed appends to when one is installed (`current`), so an
untimed run pays one attribute lookup."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar, final

__all__ = ["ThreadSpans"]

S = TypeVar("S")


@final
class ThreadSpans(Generic[S]):
    """Where this thread's spans of one kind are noted, if anywhere."""

    __slots__ = ("_local",)

    def __init__(self) -> None:
        self._local = threading.local()

    def current(self) -> list[S] | None:
        """The list being filled on this thread, or None when nothing is timed."""
        spans: Any = getattr(self._local, "spans", None)
        return spans  # type: ignore[no-any-return]

    @contextmanager
    def collecting(self) -> Iterator[list[S]]:
        """Notes this thread's spans inside the block (nested blocks each get their own)."""
        spans: list[S] = []
        outer = getattr(self._local, "spans", None)
        self._local.spans = spans
        try:
            yield spans
        finally:
            self._local.spans = outer
