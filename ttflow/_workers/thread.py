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

__all__ = ["QueueWorker", "Ticket"]

T = TypeVar("T")


def _call_soon_threadsafe() -> Callable[[Callable[[], None]], Any]:
    """The running event loop's way to have a callback run on its thread, from any thread
    (anyio runs on asyncio or trio; without a running asyncio loop it is trio)."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon


class Ticket:
    """A call handed to a worker: its outcome (value, error) once `done`. The ticket is also the
    borrower of the thread-limiter token the call holds until it is awaited. Its event is made
    only when someone waits before it is done (a record decided ahead is mostly done by then,
    and an event costs more to make than the rest of the ticket)."""

    __slots__ = ("done", "outcome", "also", "_event")

    def __init__(self) -> None:
        self.done = False
        self.outcome: tuple[Any, BaseException | None] = (None, None)
        self.also: anyio.Event | None = None  # set with `done` (a queue waiting for more too)
        self._event: anyio.Event | None = None

    def finished(self) -> None:
        """Marks the call done and wakes its waiters (and `also`); on the event loop's thread."""
        self.done = True
        if self._event is not None:
            self._event.set()
        also = self.also
        if also is not None:
            also.set()

    async def wait_done(self) -> None:
        """Returns once the call is done (on the event loop's thread)."""
        if not self.done:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()


class QueueWorker:
    """One thread, started and stopped by the queue task that owns it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._call_soon: Callable[[Callable[[], None]], Any] | None = None
        self._limiter: Any = None
        self._outstanding: set[Ticket] = set()  # sent, not yet awaited: each holds a token
        # Cleared by `pause` (tests): the thread then takes no job until `resume`.
        self._running = threading.Event()
        self._running.set()
        self.busy = False  # a job is running (read by tests to tell a settled queue)

    def start(self) -> None:
        """Starts the thread; call on the event loop thread, from the owning task."""
        self._call_soon = _call_soon_threadsafe()
        self._limiter = anyio.to_thread.current_default_thread_limiter()
        self._thread = threading.Thread(target=self._serve, name=f"ttflow-{self._name}", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Holds every job sent from now on (and the next one, if one runs) until `resume`:
        a test's way to keep one queue's records in flight while the other queue goes on."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def stop(self) -> None:
        """Lets the thread finish what it was sent (all of it awaited, unless the queue's task
        was cancelled) and joins it; tokens of calls nobody awaited go back to the limiter."""
        self._running.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()
        for ticket in list(self._outstanding):
            self._release(ticket)

    def spare_tokens(self) -> bool:
        """Whether more than a quarter of the thread limiter's tokens are free: work sent ahead
        of its turn takes no more, leaving the rest to `anyio.to_thread` callers."""
        limiter = self._limiter
        return bool(limiter.available_tokens * 4 > limiter.total_tokens)

    def send(self, function: Callable[..., Any], *args: Any) -> Ticket | None:
        """Hands `function(*args)` over without waiting, to run after everything sent before;
        None (nothing sent) when no token of the thread limiter is free. Await the ticket with
        `wait`, always: it holds the token until then."""
        ticket = Ticket()
        try:
            self._limiter.acquire_on_behalf_of_nowait(ticket)  # no checkpoint
        except anyio.WouldBlock:
            return None
        return self._put(ticket, function, args)

    async def send_when_free(self, function: Callable[..., Any], *args: Any) -> Ticket:
        """`send`, waiting for a token of the thread limiter when none is free. Shielded: a
        decided command waiting here runs, so the device is never left half-updated."""
        ticket = self.send(function, *args)
        if ticket is None:
            ticket = Ticket()
            with anyio.CancelScope(shield=True):
                await self._limiter.acquire_on_behalf_of(ticket)
            self._put(ticket, function, args)
        return ticket

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """Runs `function(*args)` on the thread and returns its result (or raises its error).
        Shielded once handed over: the call runs to the end and is waited for."""
        return await self.wait(await self.send_when_free(function, *args))  # type: ignore[no-any-return]

    async def wait(self, ticket: Ticket) -> Any:
        """The result of a sent call (or its error, raised), once it has run. Shielded."""
        try:
            if not ticket.done:  # a batch's later calls are done when the first is
                with anyio.CancelScope(shield=True):
                    await ticket.wait_done()
        finally:
            self._release(ticket)
        value, error = ticket.outcome
        if error is not None:
            raise error
        return value

    def _put(self, ticket: Ticket, function: Callable[..., Any], args: tuple[Any, ...]) -> Ticket:
        assert self._call_soon is not None, "QueueWorker used before start"
        self._outstanding.add(ticket)
        self._jobs.put((ticket, function, args))
        return ticket

    def _release(self, ticket: Ticket) -> None:
        if ticket in self._outstanding:
            self._outstanding.discard(ticket)
            self._limiter.release_on_behalf_of(ticket)

    def _serve(self) -> None:
        jobs, call_soon = self._jobs, self._call_soon
        assert call_soon is not None
        while True:
            job = jobs.get()
            if job is None:
                return
            self._running.wait()
            ticket, function, args = job
            self.busy = True
            try:
                ticket.outcome = (function(*args), None)
            except BaseException as exc:  # noqa: BLE001 - carried back to the awaiting task
                ticket.outcome = (None, exc)
            self.busy = False
            del function, args, job
            call_soon(ticket.finished)
            del ticket
