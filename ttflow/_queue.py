"""Commands and the in-order command queues that run them.

A command goes through three phases: `prepare` (bookkeeping: allocation, residency; always on
the event loop thread, so device state has a single writer), `run` (bytes and arithmetic only:
kernels and numpy, which release the GIL) and `finish` (bookkeeping again). Small commands run
all three inline in the queue's task: a thread hand-off costs 85-150 us here, more than a tiny
program. Commands whose `run` moves more than `INLINE_COST` bytes go to a worker thread so the
event loop is never blocked by a large kernel, and a CQ1 write overlaps a CQ0 program.
Consecutive ready host writes travel together: one hand-off carries up to 32 of them.

Completion is a flag plus an `anyio.Event` made only when somebody waits: most commands are
never awaited directly, and an event per command would cost more than the command.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from ._errors import DeviceClosedError

if TYPE_CHECKING:
    from ._tensor import Tensor

__all__ = ["Command", "CommandQueue", "INLINE_COST"]

INLINE_COST = 256 * 1024
"""Bytes of work below which a command runs inline in the queue task (no thread hand-off)."""

_BATCH_MAX = 32
"""Most commands one worker-thread hand-off carries."""

_YIELD_EVERY = 0.002
"""Seconds a queue may run ready commands back to back before it lets other tasks in."""


class Command:
    """One unit of queued device work; subclasses say what it reads, writes and does."""

    name = "command"
    batchable = False
    """Whether consecutive ready commands of this kind may share one worker-thread hand-off:
    true when `prepare` does not depend on an earlier command's `finish` (host writes)."""
    __slots__ = (
        "queue", "deps", "done", "error", "_event", "reads", "writes", "cost", "started",
        "__weakref__",
    )

    def __init__(self, reads: tuple[Tensor, ...], writes: tuple[Tensor, ...]) -> None:
        self.queue: CommandQueue | None = None
        self.deps: list[Command] = []
        self.done = False
        self.error: BaseException | None = None
        self._event: anyio.Event | None = None
        self.reads = reads
        self.writes = writes
        self.cost = 0
        self.started = 0.0

    def blocker(self) -> Command | None:
        """A command that must finish before this one may start, or None when it may start."""
        for dep in self.deps:
            if not dep.done:
                return dep
        return None

    def preamble(self) -> Command | None:
        """Work that must complete before this command prepares (a program's evictions)."""
        return None

    def prepare(self) -> None:
        """Bookkeeping before the bytes move; sets `self.cost`. Raises to fail the command."""

    def run(self) -> None:
        """Moves bytes and computes; may run on a worker thread, so it touches no shared state."""

    def finish(self) -> None:
        """Bookkeeping after the bytes moved."""

    def rollback(self) -> None:
        """Undoes what a failed `prepare` or `run` left behind (allocations)."""

    def complete(self, error: BaseException | None = None) -> None:
        """Marks the command done and lets go of everything it referenced.

        A finished command may stay reachable for a long time (a queued command's `deps`, an
        awaiting caller), so it must not keep tensors, storages or other commands alive: memory
        held stays bounded by what the user holds plus what is queued.
        """
        self.error = error
        self.done = True
        self.deps = []
        self.reads = ()
        self.writes = ()
        self.forget()
        if self._event is not None:
            self._event.set()

    def forget(self) -> None:
        """Drops the references a subclass keeps beyond `reads`, `writes` and `deps`."""

    async def wait(self) -> None:
        """Waits until the command has completed (successfully or not)."""
        if not self.done:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


class CommandQueue:
    """An in-order queue served by one task; `closing` makes it exit once empty."""

    def __init__(self, name: str, on_complete: Any) -> None:
        self.name = name
        self._pending: collections.deque[Command] = collections.deque()
        self._wakeup: anyio.Event | None = None
        self._closing = False
        self._aborted: BaseException | None = None
        self._on_complete = on_complete

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, command: Command) -> None:
        if self._closing:
            raise DeviceClosedError("the device is closing; no new work is accepted")
        command.queue = self
        self._pending.append(command)
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    def close(self, abort: BaseException | None = None) -> None:
        """Stops accepting work; with `abort`, fails what has not started with that error."""
        self._closing = True
        if abort is not None:
            self._aborted = abort
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    async def serve(self) -> None:
        pending = self._pending
        deadline = time.perf_counter() + _YIELD_EVERY
        while True:
            if not pending:
                if self._closing:
                    return
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                deadline = time.perf_counter() + _YIELD_EVERY
                continue
            command = pending[0]
            if self._aborted is not None:
                pending.popleft()
                self._on_complete(command, self._aborted)
                continue
            blocker = command.blocker()
            if blocker is not None:
                await blocker.wait()
                continue
            if command.batchable and len(pending) > 1:
                batch = self._ready_batch()
                if len(batch) > 1:
                    errors = await self._execute_batch(batch)
                    for done, error in zip(batch, errors):
                        pending.popleft()
                        self._on_complete(done, error)
                    del batch, command
                    continue
            error = await self._execute(command)
            pending.popleft()
            self._on_complete(command, error)
            del command  # an idle queue must not keep the last command's tensors alive
            if time.perf_counter() > deadline:
                await anyio.lowlevel.checkpoint()
                deadline = time.perf_counter() + _YIELD_EVERY

    def _ready_batch(self) -> list[Command]:
        batch: list[Command] = []
        for command in self._pending:
            if len(batch) == _BATCH_MAX or not command.batchable or command.blocker() is not None:
                break
            batch.append(command)
        return batch

    async def _execute_batch(self, batch: list[Command]) -> list[BaseException | None]:
        """Prepares every command, runs them all in one hand-off (if large), then finishes each."""
        errors: list[BaseException | None] = [None] * len(batch)
        prepared = []
        now = time.perf_counter()
        for i, command in enumerate(batch):
            command.started = now
            try:
                command.prepare()
                prepared.append(i)
            except Exception as exc:
                command.rollback()
                errors[i] = exc

        def run_all() -> None:
            for i in prepared:
                try:
                    batch[i].run()
                except Exception as exc:
                    errors[i] = exc

        if sum(batch[i].cost for i in prepared) > INLINE_COST:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(run_all)
        else:
            run_all()
        for i in prepared:
            command = batch[i]
            try:
                if errors[i] is not None:
                    raise errors[i]  # type: ignore[misc]
                command.finish()
            except Exception as exc:
                command.rollback()
                errors[i] = exc
        return errors

    async def _execute(self, command: Command) -> BaseException | None:
        # Once started, a command runs to the end: cancellation is only delivered between
        # commands, so device state is never left half-updated.
        for tensor in command.reads:
            if tensor._error is not None:
                return tensor._error  # an input failed: so does this command
        try:
            preamble = command.preamble()
        except Exception as exc:
            return exc
        if preamble is not None:
            preamble.queue = self
            error = await self._phases(preamble)
            self._on_complete(preamble, error)
            if error is not None:
                return error
        return await self._phases(command)

    async def _phases(self, command: Command) -> BaseException | None:
        command.started = time.perf_counter()
        try:
            command.prepare()
            if command.cost > INLINE_COST:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(command.run)
            else:
                command.run()
            command.finish()
        except Exception as exc:
            command.rollback()
            return exc
        return None
