"""A command queue's own worker thread: where its large records run, as a device's queue
processor runs its commands while the host goes on.

`anyio.to_thread.run_sync` would do the same work, but it yields to every ready task before it
hands the call over (a checkpoint), so the device's next program waited behind whatever the
host's code did next: in the pipeline benchmark, a whole `write` call (0.8 ms) per batch. Here
the hand-off is immediate, and the result comes back through the event loop's thread-safe
callback (asyncio's `call_soon_threadsafe`, trio's `run_sync_soon`).

A run still takes a token of anyio's default thread limiter, as `to_thread.run_sync` does, so
that `ttflow.testing.hold_worker_threads` can stop large commands between decision and run.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

__all__ = ["QueueWorker"]

T = TypeVar("T")


def _call_soon_threadsafe() -> Callable[[Callable[[], None]], Any]:
    """The running event loop's way to have a callback run on its thread, from any thread
    (anyio runs on asyncio or trio; without a running asyncio loop it is trio)."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon


class QueueWorker:
    """One thread, started and stopped by the queue task that owns it (`running`)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._call_soon: Callable[[Callable[[], None]], Any] | None = None

    def start(self) -> None:
        """Starts the thread; call on the event loop thread, from the owning task."""
        self._call_soon = _call_soon_threadsafe()
        self._thread = threading.Thread(target=self._serve, name=f"ttflow-{self._name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Lets the thread finish (it is idle: every run was awaited) and joins it."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """Runs `function(*args)` on the thread and returns its result (or raises its error).
        Shielded: once handed over, the call runs to the end and is waited for."""
        assert self._call_soon is not None, "QueueWorker.run before start"
        limiter = anyio.to_thread.current_default_thread_limiter()
        borrower = object()
        try:
            limiter.acquire_on_behalf_of_nowait(borrower)  # no checkpoint when a token is free
        except anyio.WouldBlock:
            await limiter.acquire_on_behalf_of(borrower)
        try:
            done = anyio.Event()
            outcome: list[Any] = []
            self._jobs.put((function, args, outcome, done.set, self._call_soon))
            with anyio.CancelScope(shield=True):
                await done.wait()
        finally:
            limiter.release_on_behalf_of(borrower)
        value, error = outcome
        if error is not None:
            raise error
        return value  # type: ignore[no-any-return]

    def _serve(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            function, args, outcome, notify, call_soon = job
            try:
                outcome += (function(*args), None)
            except BaseException as exc:  # noqa: BLE001 - carried back to the awaiting task
                outcome += (None, exc)
            del function, args, job
            call_soon(notify)
