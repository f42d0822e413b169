"""In-order command queues: each takes its commands in turn, has them decided, runs the records.

A command goes through three phases. `decide` (on the event loop thread, by the scheduler that owns
the command: allocation, residency, conversions) returns a `Record`; `run(record, banks)` moves the
bytes (kernels and numpy, which release the GIL) and touches no scheduling state; `commit` gives
the result back to the scheduler. Small records run inline in the queue's task: a thread
hand-off costs 85-180 us here, more than a tiny program. Records estimated above the queue's
`inline_seconds` (the device's setting, `INLINE_SECONDS` by default) go to the queue's own
worker thread (`_workers.thread.py`), so the event loop is never
blocked by a large kernel and a CQ1 write overlaps a CQ0 program. A program whose collectives
wait for other chips (`Command.peers`, an SPMD submit's) always runs on the worker: inline, its
wait would block the loop that must run the other chips' queues. Consecutive ready host writes
travel together: one hand-off carries up to 32 of them, and no more than about a millisecond of
work (none completes before the whole batch has run, so a larger batch would only delay the
program waiting for its first write).
While a large record runs on the worker, the next program is decided and queued behind it when
its decision cannot depend on the running one (`Command.decidable_ahead`), and a command
blocked by another queue may do host-side work meanwhile (`Command.work_ahead`: a write
converting its array to device pages).

A record handed to a worker is *in flight* from its decision until it lands (its run is over,
before its commit): the queue tells the scheduler both moments (`in_flight`), so that nothing
frees or moves a storage the record names meanwhile. Room is made only by the queue that
`makes_room` (CQ0): an out-of-memory decision on CQ1 fails its command, so that two queues never
move buffers at once.

Completion is a flag plus an `anyio.Event` made only when somebody waits: most commands are
never awaited directly, and an event per command would cost more than the command.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel

from ._commands import INLINE_SECONDS, Banks, Compute, Record, estimate, is_transfer, run, run_all
from ._core._dispatch import CommandCore, QueueCore, finish, run_program
from ._errors import DeviceClosedError, OutOfMemoryError
from ._workers.thread import QueueWorker, Ticket

__all__ = ["Command", "CommandQueue", "NO_DEPS", "RETRY"]

RETRY = object()
"""What `Command.make_room` returns when the command only needs to decide again (it changed
how it allocates: its L1 allocations spill to DRAM)."""

_ROOM_ATTEMPTS = 16
"""Times a command that ran out of memory has room made and decides again before it fails."""

_ROOM_DEPTH = 2
"""How deep room-making nests: a command's room (an eviction to DRAM) may need room of its own
(DRAM compacted first), which needs none."""

NO_DEPS: list[Any] = []
"""The shared empty list of a command with no dependencies (saves a list per command): never
mutate it; code that adds one makes a list of its own first."""
"""The dependencies of a command that has none: shared, so never appended to (`enqueue` gives
a command its own list when it has some)."""

_BATCH_MAX = 32
"""Most commands one worker-thread hand-off carries."""

_BATCH_SECONDS = 1e-3
"""Estimated run time at which a batch closes: about ten hand-offs, so a batch still pays for its
hand-off, while the first write of a stream of large ones is not held back by those after it."""

_AHEAD_MAX = 16
"""Most commands of a queue decided and sent to its worker behind the running one: enough for
a worker process to take a chain of small programs in one message (`_workers.process`)."""

_YIELD_EVERY = 0.002
"""Seconds a queue may run ready commands back to back before it lets other tasks in."""


class Command(CommandCore):
    """One unit of queued device work. The scheduler's subclasses decide and commit it.

    Its fields live in the C record `CommandCore` (with those of the scheduler's commands), so
    that dispatch's fast path reads them at C speed."""

    name = "command"
    spillable = False
    """Whether the command's own L1 allocations may go to DRAM when L1 has no room (a
    scheduler command's may; a move's targets are where it moves them)."""
    batchable = False
    """Whether consecutive ready commands of this kind may share one worker-thread hand-off:
    true when `decide` does not depend on an earlier command's `commit` (host writes)."""
    __slots__ = ()

    def __init__(self) -> None:
        self.queue: CommandQueue | None = None
        self.deps: list[Command] = NO_DEPS
        self.done = False
        self.error: BaseException | None = None
        self._event: anyio.Event | None = None
        self.started = 0.0
        self.record: Record | None = None
        self.capture: Any = None  # the trace capture that records this command, if any

    def blocker(self) -> Command | None:
        """A command that must finish before this one may start, or None when it may start."""
        for dep in self.deps:
            if not dep.done:
                return dep
        return None

    def failed_input(self) -> BaseException | None:
        """The error of an input that failed (this command then fails with it), or None."""
        return None

    def decidable_ahead(self) -> bool:
        """Whether the command may be decided while the one before it in its queue still runs
        (its record then goes to the worker right behind that one's): only when its decision
        cannot depend on that command's commit. False unless a subclass knows better."""
        return False

    def work_ahead(self) -> Callable[[], Any] | None:
        """Host-side work this command can do while it waits for its blocker (a write converting
        its array to device pages), as a function for a worker thread; None when there is none.

        The result goes to `worked_ahead` on the loop thread. The work must touch neither bank
        memory nor scheduling state: the command has not been decided."""
        return None

    def worked_ahead(self, result: Any) -> None:
        """Keeps what `work_ahead`'s function returned: None if it raised (the command then does
        that work in its own run, which reports the error)."""

    def preamble(self) -> Command | None:
        """Work that must complete before this command is decided (a program's evictions)."""
        return None

    def takes_fast_path(self, inline_seconds: float) -> bool:
        """Whether the C fast path (`_core._dispatch.run_program`) must take this command now,
        by the Python twin of its rule (a program's; see `CommandQueue.check_twin`)."""
        return False

    def make_room(self, error: OutOfMemoryError) -> Command | object | None:
        """After `decide` ran out of memory: a command that makes room (evictions, relocations)
        to run before deciding again, `RETRY` to decide again at once, or None to fail."""
        return None

    def out_of_memory(self, error: OutOfMemoryError) -> OutOfMemoryError:
        """The error to fail with when no room could be made (with the memory view)."""
        return error

    def decide(self) -> Record:
        """Decides what the command does (allocations, sources) as a record. Raises to fail;
        a failed decide leaves nothing behind."""
        raise NotImplementedError

    def commit(self, record: Record, result: Any) -> None:
        """Applies a record that ran: the scheduler's bookkeeping after the bytes moved."""

    def rollback(self, record: Record) -> None:
        """Undoes a decided record that failed to run (frees what it allocated)."""

    def complete(self, error: BaseException | None = None) -> None:
        """Marks the command done and lets go of everything it referenced.

        A finished command may stay reachable for a long time (a queued command's `deps`, an
        awaiting caller), so it must not keep tensors, storages or other commands alive: memory
        held stays bounded by what the user holds plus what is queued.
        """
        self.forget()
        finish(self, error)  # the one copy of the step (`_core._dispatch.finish`)

    def forget(self) -> None:
        """Drops the references a subclass keeps."""

    async def wait(self) -> None:
        """Waits until the command has completed (successfully or not)."""
        if not self.done:
            if self._event is None:
                self._event = anyio.Event()
            await self._event.wait()

    def describe(self) -> dict[str, Any]:
        """What the timeline shows of the command: its name, bytes moved and other figures."""
        record = self.record
        return {"name": self.name, "bytes": record.nbytes if record is not None else 0}


def _no_flight(command: Command, record: Record, start: bool) -> None:
    pass


def _calls_host(record: Record) -> bool:
    """Whether `record` runs a program with a host op (`ProgramBuilder.host_op`): a program's
    record, or a replay's with such a program anywhere in it."""
    for step in record.steps:  # (a loop: asked of every small record the queue runs)
        if type(step) is Compute and step.plan.host_ops:  # type: ignore[union-attr]
            return True
    return False


def _hooked(record: Record) -> bool:
    """Whether `record` is a program decided under debug hooks (its last step, the Compute)."""
    steps = record.steps
    return bool(steps) and type(steps[-1]) is Compute and steps[-1].hooks is not None  # type: ignore[union-attr]


class CommandQueue(QueueCore):
    """An in-order queue served by one task; `close` makes it exit once empty.

    `makes_room`: whether an out-of-memory decision has room made (CQ0) or fails (CQ1).
    `inline_seconds`: records estimated at most this long run inline in the queue's task,
    longer ones on its worker thread (the device's setting: tests lower it to stop every
    command mid-flight, or raise it to run everything inline)."""

    def __init__(
        self, name: str, banks: Banks, on_complete: Callable[[Command, BaseException | None], None],
        *, makes_room: bool = False, inline_seconds: float = INLINE_SECONDS,
        worker: QueueWorker | None = None,
    ) -> None:
        self.name = name
        self.makes_room = makes_room
        self.inline_seconds = inline_seconds
        # When set, writes and reads run inline up to this long instead (a worker process's
        # queue runs them on its own thread in the host: they would not leave the host anyway).
        self.transfer_inline_seconds: float | None = None
        # Told when a record is handed to the worker (start) and when it lands (the scheduler's
        # `flight`): what it names stays put meanwhile.
        self.in_flight: Callable[[Command, Record, bool], None] = _no_flight
        # Tests set `check_twin`: each command the C fast path refused is asked whether its
        # Python twin would have taken it; `fast_path_missed` counts those it would have.
        self.check_twin = False
        self.fast_path_missed = 0
        self.room_requests = 0  # times a command of this queue asked for room (CQ0's only)
        self._banks = banks
        self._pending: collections.deque[Command] = collections.deque()
        self._append = self._pending.append
        self._wakeup: anyio.Event | None = None
        self._closing = False
        self._aborted: BaseException | None = None
        self.on_complete = on_complete
        # Where large records run: a thread of this process, or one that sends them to the
        # device's worker process (`_workers.process`, the same interface).
        self._worker = worker if worker is not None else QueueWorker(name)

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

    async def drained(self) -> None:
        """Waits until every command pushed so far has completed (they complete in order)."""
        while self._pending:
            await self._pending[-1].wait()

    def pop_all(self) -> list[Command]:
        """Takes every command that has not started (the device is shutting down)."""
        commands = list(self._pending)
        self._pending.clear()
        return commands

    def close(self, abort: BaseException | None = None) -> None:
        """Stops accepting work; with `abort`, fails what has not started with that error."""
        self._closing = True
        if abort is not None:
            self._aborted = abort
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    def abort(self, error: BaseException) -> None:
        """Fails every command that has not started, and every one pushed later, with `error`
        (the device's worker process is lost): the queue still takes work, and fails it."""
        if self._aborted is None:
            self._aborted = error
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    async def serve(self) -> None:
        self._worker.start()
        try:
            await self._serve()
        finally:
            self._worker.stop()

    async def _serve(self) -> None:
        pending = self._pending
        banks = self._banks
        on_complete = self.on_complete
        perf_counter = time.perf_counter
        deadline = perf_counter() + _YIELD_EVERY
        while True:
            if not pending:
                if self._closing:
                    return
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                deadline = perf_counter() + _YIELD_EVERY
                continue
            command = pending[0]
            ticket = command.sent
            if ticket is not None:  # decided ahead: its record is on the worker already
                command.sent = None
                record = command.record
                assert record is not None
                error = await self._finish(command, record, ticket)
                pending.popleft()
                on_complete(command, error)
                del command, ticket, record
                deadline = perf_counter() + _YIELD_EVERY
                continue
            if self._aborted is not None:
                pending.popleft()
                on_complete(command, self._aborted)
                continue
            if run_program(command, banks, self.inline_seconds):  # a tiny program, all in C
                pending.popleft()
                del command
                if perf_counter() > deadline:
                    await anyio.lowlevel.checkpoint()
                    deadline = perf_counter() + _YIELD_EVERY
                continue
            if self.check_twin and command.takes_fast_path(self.inline_seconds):
                self.fast_path_missed += 1
            blocker = command.blocker()
            if blocker is not None:
                ahead = command.work_ahead()
                if ahead is not None:
                    # As a device's queue fetches a write's data while an earlier command still
                    # runs: the costly conversion overlaps the wait, only the landing waits.
                    await self._work_ahead(command, ahead)
                else:
                    await blocker.wait()
                deadline = perf_counter() + _YIELD_EVERY  # the loop was free while it waited
                continue
            if command.batchable and len(pending) > 1:
                batch = self._ready_batch()
                if len(batch) > 1:
                    errors = await self._execute_batch(batch)  # may take only the first few
                    deadline = perf_counter() + _YIELD_EVERY
                    for done, error in zip(batch, errors):
                        pending.popleft()
                        on_complete(done, error)
                    del batch, command
                    continue
            # The phases of one command, inline in this loop (no coroutine per command): only a
            # preamble or a record too large to run here awaits. Once started, a command runs
            # to the end: cancellation is only delivered between commands, so device state is
            # never left half-updated.
            error = command.failed_input()
            if error is None:
                try:
                    preamble = command.preamble()
                except Exception as exc:
                    error = exc
                    preamble = None
                if preamble is not None:
                    preamble.queue = self
                    error = await self._phases(preamble)
                    on_complete(preamble, error)
            if error is None:
                command.started = perf_counter()
                record = None
                try:
                    record = command.decide()
                except OutOfMemoryError as exc:  # room is made in CQ0's order, then decided again
                    if self.makes_room:
                        record, error = await self._decide_with_room(command, exc)
                    else:
                        error = command.out_of_memory(exc)
                    deadline = perf_counter() + _YIELD_EVERY
                except Exception as exc:
                    error = exc
                if record is not None:
                    command.record = record
                    if command.capture is not None:
                        try:
                            command.capture.decided(command, record)  # before a commit can free anything
                        except Exception as exc:
                            command.rollback(record)
                            error = exc
                if error is None and record is not None:
                    if _hooked(record):
                        error = await self._run_hooked(command, record)
                    # A record whose collectives wait for other chips, or that calls a host
                    # function (which may block), never runs on the loop, whatever the threshold.
                    elif (estimate(record.nbytes, record.kernel_bytes, record.macs) > self._limit(record)
                            or command.peers is not None or _calls_host(record)):
                        error = await self._run_on_worker(command, record)
                        # The loop was free while the worker ran: go straight on to the next
                        # command, whose hand-off would otherwise wait for every task the
                        # checkpoint lets in (a host loop preparing the next batch, say).
                        deadline = perf_counter() + _YIELD_EVERY
                    else:
                        try:
                            command.commit(record, run(record, banks))
                        except Exception as exc:
                            command.rollback(record)
                            error = exc
            pending.popleft()
            on_complete(command, error)
            del command  # an idle queue must not keep the last command alive
            if perf_counter() > deadline and not (pending and pending[0].sent is not None):
                await anyio.lowlevel.checkpoint()
                deadline = perf_counter() + _YIELD_EVERY

    async def _decide_with_room(self, command: Command, error: OutOfMemoryError,
                                depth: int = 0) -> tuple[Record | None, BaseException | None]:
        """Has room made for `command` (see `Command.make_room`) and decides it again, a few
        times; the record, or the error to fail it with. Only on the queue that makes room."""
        self.room_requests += 1
        for _ in range(_ROOM_ATTEMPTS):
            room = command.make_room(error)
            if room is None:
                break
            if isinstance(room, Command):
                room.queue = self
                blocker = room.blocker()
                while blocker is not None:  # a write in flight into a buffer that must move
                    await blocker.wait()
                    blocker = room.blocker()
                failed = await self._phases(room, depth + 1)
                self.on_complete(room, failed)
                if failed is not None:
                    return None, failed
            try:
                return command.decide(), None
            except OutOfMemoryError as exc:
                error = exc
            except Exception as exc:
                return None, exc
        return None, command.out_of_memory(error)

    def _limit(self, record: Record) -> float:
        """The longest estimated run of `record` that runs inline (`transfer_inline_seconds`
        for a write or a read, when set)."""
        transfer = self.transfer_inline_seconds
        return self.inline_seconds if transfer is None or not is_transfer(record) else transfer

    def _ready_batch(self) -> list[Command]:
        batch: list[Command] = []
        for command in self._pending:
            if len(batch) == _BATCH_MAX or not command.batchable or command.blocker() is not None:
                break
            batch.append(command)
        return batch

    async def _execute_batch(self, batch: list[Command]) -> list[BaseException | None]:
        """Decides commands of `batch` in order until they hold `_BATCH_SECONDS` of work, runs
        them in one hand-off (if large), then commits each. Returns one outcome per command
        taken, in order; the rest of `batch` stays pending, undecided."""
        errors: list[BaseException | None] = []
        decided: list[int] = []
        seconds = 0.0
        now = time.perf_counter()
        for i, command in enumerate(batch):
            if seconds >= _BATCH_SECONDS:
                break
            command.started = now
            errors.append(None)
            try:
                command.record = command.decide()
                decided.append(i)
                seconds += command.record.seconds
            except Exception as exc:
                errors[i] = exc
        records = [record for i in decided if (record := batch[i].record) is not None]
        if records and seconds > self._limit(records[0]):  # a batch of writes
            flying = [batch[i] for i in decided]
            for command, record in zip(flying, records):
                self.in_flight(command, record, True)
            try:
                ran = await self._worker.run(run_all, records, self._banks)
            finally:
                for command, record in zip(flying, records):
                    self.in_flight(command, record, False)
        else:
            ran = run_all(records, self._banks)
        for i, error in zip(decided, ran):
            command = batch[i]
            record = command.record
            assert record is not None
            try:
                if error is not None:
                    raise error
                command.commit(record, None)
            except Exception as exc:
                command.rollback(record)
                errors[i] = exc
        return errors

    async def _work_ahead(self, command: Command, work: Callable[[], Any]) -> None:
        try:
            result = await self._worker.run(work)
        except Exception:  # noqa: BLE001 - redone, and reported, by the command's own run
            result = None
        command.worked_ahead(result)

    async def _phases(self, command: Command, depth: int = 0) -> BaseException | None:
        """Decides, runs and commits a command that makes room (`depth`: how deep in room-making
        it is); its own room, if it runs out of memory, is made first (an eviction needs DRAM)."""
        command.started = time.perf_counter()
        try:
            try:
                record = command.decide()
            except OutOfMemoryError as exc:
                if depth >= _ROOM_DEPTH:
                    raise
                decided, error = await self._decide_with_room(command, exc, depth)
                if error is not None:
                    return error
                assert decided is not None
                record = decided
            command.record = record
            if command.capture is not None:
                command.capture.decided(command, record)  # before a commit can free anything
        except Exception as exc:
            return exc
        if record.seconds > self.inline_seconds:
            return await self._run_on_worker(command, record)
        try:
            command.commit(record, run(record, self._banks))
        except Exception as exc:
            command.rollback(record)
            return exc
        return None

    async def _run_on_worker(self, command: Command, record: Record) -> BaseException | None:
        """Runs a large record on the worker thread (shielded: it runs to the end), then commits.
        In flight from now (it may wait for a thread) until it lands."""
        self.in_flight(command, record, True)
        try:
            ticket = await self._worker.send_when_free(run, record, self._banks)
        except BaseException:
            self.in_flight(command, record, False)
            raise
        return await self._finish(command, record, ticket)

    async def _run_hooked(self, command: Command, record: Record) -> BaseException | None:
        """Runs a program under debug hooks on a thread of anyio's, from which each hook is
        called on the event loop between the program's steps (the queue's own worker thread
        cannot call back into the loop); shielded: it runs to the end. Then commits."""
        self.in_flight(command, record, True)
        try:
            try:
                with anyio.CancelScope(shield=True):
                    result = await anyio.to_thread.run_sync(run, record, self._banks)
            finally:
                self.in_flight(command, record, False)
            command.commit(record, result)
        except Exception as exc:
            command.rollback(record)
            return exc
        return None

    async def _finish(self, command: Command, record: Record, ticket: Ticket) -> BaseException | None:
        """Waits for a record sent to the worker (in flight), then commits it (or rolls it
        back). Meanwhile the next command is decided and sent behind it when it may be, so that
        the worker goes from one record to the next without waiting for the event loop, as a
        device's queue runs its commands back to back."""
        self._decide_ahead(command)
        if not ticket.done:
            await self._wait_or_decide_ahead(command, ticket)
        try:
            try:
                result = await self._worker.wait(ticket)
            finally:
                self.in_flight(command, record, False)
            failed = command.failed_input()  # decided ahead: a program it reads from failed
            if failed is not None:
                raise failed
            command.commit(record, result)
        except Exception as exc:
            command.rollback(record)
            return exc
        return None

    async def _wait_or_decide_ahead(self, running: Command, ticket: Ticket) -> None:
        """Waits for `ticket` (the running command's record) to land, deciding ahead whatever is
        pushed meanwhile (`_decide_ahead`): a host that submits one program at a time, with its
        own work in between, still keeps its worker fed. Each push wakes this wait once (the
        queue's `_wakeup`, as when it is idle). Shielded: the record runs to the end."""
        with anyio.CancelScope(shield=True):
            while not ticket.done:
                wake = anyio.Event()
                ticket.also = self._wakeup = wake
                try:
                    await wake.wait()
                finally:
                    ticket.also = None
                    if self._wakeup is wake:
                        self._wakeup = None
                if ticket.done or self._aborted is not None or self._closing:
                    return
                if self._pending[-1] is not running:
                    self._decide_ahead(running)

    def _decide_ahead(self, running: Command) -> None:
        """Decides the commands after `running`, in order, and sends their records to the
        worker behind it, while each may be decided now (see `Command.decidable_ahead`: a chain
        of programs, each reading the last one's output, may) and nothing it waits for on
        another queue is pending; at most `_AHEAD_MAX` are sent ahead, and never the last half
        of the thread limiter's tokens. A program waiting for a write is decided in its turn,
        not retried when the write lands (tried in the pipeline benchmark: 7% slower, the two
        workers and the loop then fighting over two cores)."""
        pending = self._pending
        if len(pending) < 2 or pending[0] is not running or self._aborted is not None:
            return
        for i in range(1, min(len(pending), _AHEAD_MAX + 1)):
            command = pending[i]
            if command.sent is None and not self._send_ahead(command):
                return

    def _send_ahead(self, command: Command) -> bool:
        """Decides `command` and sends its record to the worker, in flight from now (it lands
        in `_finish`, in its turn); False (nothing decided) when it may not be now."""
        if command.blocker() is not None or not command.decidable_ahead() or not self._worker.spare_tokens():
            return False
        command.started = time.perf_counter()
        try:
            record = command.decide()
        except Exception:  # decided again, in turn, which reports the error then
            return False
        steps = record.steps
        compute = steps[0]
        ahead = (len(steps) == 1 and type(compute) is Compute
                 and (record.seconds > self.inline_seconds or command.peers is not None
                      or _calls_host(record)))
        ticket = self._worker.send(run, record, self._banks) if ahead else None
        if ticket is None:  # a conversion, a small record or no free token: undo
            command.rollback(record)
            return False
        self.in_flight(command, record, True)
        command.record = record
        command.sent = ticket
        return True
