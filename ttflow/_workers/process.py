"""A device's records run in a worker process (`open_device(workers="process")`).

The host keeps everything it decides with (the scheduler, the queues, the C fast path) and
answers `submit` at once, as with thread workers; only the records its queues would hand to
their worker threads go to one child process per device, which maps the device's bank memory
(a shared file, `_memory.BankMemory(shared_path=...)`) and runs `_commands.run(record, banks)`
there. Records travel in wire form (`_workers.wire`): storages as their geometry, a program's plan once
per connection, then its id. Writes and reads do not travel: they run on the queue's thread
here, on the same shared bytes (`transfers_here`).

`WorkerProcess` is the child (a new interpreter running `main`, never forked: the
host has threads, and a fork would copy them half-run) and its shared files' names; each queue
of the device has a `ProcessQueueWorker`, a `QueueWorker` (same tickets, thread-limiter tokens,
pause and resume) whose thread sends the queue's records down its own connection, as many as
are waiting in one message, instead of running them. What cannot travel (a record that calls
host functions or runs under debug hooks, work done ahead of a write) runs on that same thread, in its
turn, on the host's view of the same bytes. The child serves each connection on a thread of its
own, so that a CQ1 write still overlaps a CQ0 program.

A child that dies (killed, crashed) is seen by the thread that waits for its reply (the
connection ends) or by the thread that waits for the child: every record then fails with
`DeviceLostError` naming the chip, and the device's queues fail what they hold and everything
queued later (`Device._lose`). Closing the device closes the connections, on which the child
exits, and reaps it (killed after a grace period); the shared files go with the device's memory.

A child that is alive but silent (stopped, or stuck in a kernel forever) is seen by its
heartbeat: the child sends a byte on a connection of its own every `beat_interval(timeout)`
seconds from a thread that does nothing else (a numpy kernel releases the interpreter lock, a
Python loop yields it every switch interval, so a long but healthy record does not stop it),
and a host thread (`_listen`) that hears nothing for `timeout` seconds (`open_device(
worker_timeout=...)`) declares the child lost, with why, and kills it: the connections then end
and everything fails as for a death. Bytes the host did not read yet count as heard, so a host
that stalls does not misfire; the first beat may take `_START_SECONDS` (the child's imports).
"""

from __future__ import annotations

import functools
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .._commands import is_transfer, run, run_all
from .._errors import DeviceLostError
from .endpoint import ENDPOINT_FD, land, listen
from .thread import QueueWorker, Ticket, _call_soon_threadsafe
from .wire import RUN, RUN_ALL, PlanIds, encode, recv_message, send_message

__all__ = ["WorkerProcess", "ProcessQueueWorker"]


_MESSAGE_MAX = 8
"""Most jobs one message carries (all that wait on the connection's thread, up to this)."""

_STOP_SECONDS = 5.0
"""How long a closing device waits for its child to exit on its own before killing it."""

WORKER_TIMEOUT = 30.0
"""Seconds of silence (no heartbeat) after which a worker process is declared lost (default)."""

_START_SECONDS = 60.0
"""How long the first heartbeat may take: the child imports numpy and ttflow first."""

_HEARTBEAT_ENV = "TTFLOW_HEARTBEAT"
"""The child's heartbeat connection and interval, `<fd>:<seconds>` (unset: no heartbeat)."""

_TIMES = "times"
"""Marks the element after a message's replies that holds each job's span in the child
(`_workers.child.TIMES`, the same)."""

_NOTHING = object()


def beat_interval(timeout: float) -> float:
    """Seconds between two heartbeats of a child declared lost after `timeout` s of silence."""
    return max(0.005, min(1.0, timeout / 10))

_CHILD = "import sys; from ttflow._workers.child import main; main(sys.argv[1:])"
"""The child's program (not `-m`: the package imports this module before running it)."""


class WorkerProcess:
    """One device's worker process: `connections` connections (one per queue), the child's
    command line (`paths`: each memory space's shared file and shape), its pid once started, and
    whether it was lost. `start` on the event loop's thread; `stop` after the queues stopped."""

    def __init__(self, spaces: list[tuple[str, str, int, int]], connections: int = 2,
                 blas_threads: int | None = 1, timeout: float | None = WORKER_TIMEOUT) -> None:
        self._spaces = spaces  # (space name, shared path, banks, bank bytes)
        self._blas_threads = blas_threads
        pairs = [socket.socketpair() for _ in range(connections)]
        self._child_ends = [child for _, child in pairs]
        self.connections = [Connection(host.detach()) for host, _ in pairs]
        self._popen: subprocess.Popen[bytes] | None = None
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self.lost: str | None = None  # why the child is gone, once it is (set once)
        self.chip: tuple[int, int] | None = None  # the mesh coordinate, named by DeviceLostError
        self._on_lost: Callable[[DeviceLostError], None] | None = None
        self._call_soon: Callable[[Callable[[], None]], Any] | None = None
        # The child's endpoint (`_peers`): where other workers and the host reach it.
        self.address: str | None = None
        self._endpoint_dir: str | None = None
        # The heartbeat: the child's end goes to it, the host's is read by `_listen`.
        self.timeout = timeout
        self.beats = 0  # heartbeats heard (tests)
        self._beat: socket.socket | None = None
        self._beat_child: socket.socket | None = None
        self._listener: threading.Thread | None = None
        if timeout is not None:
            self._beat, self._beat_child = socket.socketpair()

    @property
    def pid(self) -> int | None:
        return None if self._popen is None else self._popen.pid

    def start(self, on_lost: Callable[[DeviceLostError], None]) -> None:
        """Starts the child; `on_lost(error)` is called on this (the loop's) thread if it dies
        before `stop`."""
        self._on_lost = on_lost
        self._call_soon = _call_soon_threadsafe()
        listener, self.address, self._endpoint_dir = listen()
        fds = [end.fileno() for end in self._child_ends]
        beat_fds = [] if self._beat_child is None else [self._beat_child.fileno()]
        argv = [sys.executable, "-c", _CHILD, ",".join(map(str, fds)),
                "" if self._blas_threads is None else str(self._blas_threads)]
        for name, path, banks, bank_bytes in self._spaces:
            argv.append(f"{name}:{path}:{banks}:{bank_bytes}")
        env = dict(os.environ)
        # The child imports this very ttflow, wherever it was imported from.
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        env[ENDPOINT_FD] = str(listener.fileno())
        env.pop(_HEARTBEAT_ENV, None)
        if self.timeout is not None:
            env[_HEARTBEAT_ENV] = f"{beat_fds[0]}:{beat_interval(self.timeout)!r}"
        try:
            # A session of its own: a terminal's Ctrl-C interrupts the host, which then closes
            # the device (and its child) in order, instead of killing the child under it.
            self._popen = subprocess.Popen(argv, pass_fds=[*fds, *beat_fds, listener.fileno()], env=env,
                                           start_new_session=True,
                                           stdin=subprocess.DEVNULL)
        finally:
            listener.close()
            for end in self._child_ends:
                end.close()
            self._child_ends = []
            if self._beat_child is not None:
                self._beat_child.close()
                self._beat_child = None
        self._monitor = threading.Thread(target=self._watch, name=f"ttflow-watch-{self._popen.pid}",
                                         daemon=True)
        self._monitor.start()
        if self._beat is not None:
            self._listener = threading.Thread(target=self._listen, name=f"ttflow-heartbeat-{self._popen.pid}",
                                              daemon=True)
            self._listener.start()

    def _watch(self) -> None:
        assert self._popen is not None
        self.mark_lost(_exit_reason(self._popen.wait()))

    def connection_closed(self) -> None:
        """A connection to the child ended: it died, most likely. Its exit status, if it comes
        within a moment, is the reason given (a signal by name: SIGBUS, SIGKILL...). The moment
        is 2 s: on a loaded machine 0.5 s was sometimes too short for the exit status to come."""
        code = None
        if self._popen is not None:
            try:
                code = self._popen.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
        self.mark_lost("its connection closed" if code is None else _exit_reason(code))

    def _listen(self) -> None:
        """Hears the child's heartbeat; silence for `timeout` s declares it lost and kills it."""
        beat, timeout = self._beat, self.timeout
        assert beat is not None and timeout is not None and self._popen is not None
        poller = select.poll()
        poller.register(beat, select.POLLIN)
        wait = max(timeout, _START_SECONDS)  # the first beat comes after the child's imports
        while True:
            heard = poller.poll(wait * 1000)
            if self._stopping:
                return
            if not heard:
                self.mark_lost(f"silent for {wait:g} s: no heartbeat, worker_timeout={timeout:g} s; "
                               "killed")
                self._popen.kill()  # a stopped process dies too; `_watch` reaps it
                return
            try:
                data = beat.recv(4096)
            except OSError:
                return
            if not data:
                return  # the child exited: `_watch` tells
            self.beats += len(data)
            wait = timeout

    def mark_lost(self, why: str) -> None:
        """Records that the child is gone (from any thread); tells the device once, unless it is
        being stopped."""
        with self._lock:
            if self.lost is not None or self._stopping:
                return
            self.lost = why
        call_soon, on_lost = self._call_soon, self._on_lost
        if call_soon is not None and on_lost is not None:
            error = self.error()
            try:
                call_soon(lambda: on_lost(error))
            except Exception:  # noqa: BLE001 - the loop is gone: nobody is left to tell
                pass

    def error(self) -> DeviceLostError:
        """A new error for one failed command of the lost device."""
        where = "the device" if self.chip is None else f"chip {self.chip}"
        return DeviceLostError(
            f"the worker process of {where} (pid {self.pid}) is gone ({self.lost or 'connection lost'}): "
            "its work is lost; close the device and open a new one", self.chip)

    def stop(self) -> None:
        """Closes the connections (the child exits on their end) and reaps the child, killed if
        it does not exit within a grace period. Call once the queues' threads have stopped."""
        with self._lock:
            self._stopping = True
        if self._beat is not None:
            try:
                self._beat.shutdown(socket.SHUT_RDWR)  # wakes `_listen`
            except OSError:
                pass
            if self._listener is not None:
                self._listener.join()
            self._beat.close()
        if self._beat_child is not None:  # never started
            self._beat_child.close()
            self._beat_child = None
        for connection in self.connections:
            connection.close()
        for end in self._child_ends:
            end.close()
        self._child_ends = []
        popen = self._popen
        if popen is not None:
            try:
                popen.wait(_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
        if self._monitor is not None:
            self._monitor.join()
        if self._endpoint_dir is not None:
            shutil.rmtree(self._endpoint_dir, ignore_errors=True)
            self._endpoint_dir = None


def _landed(job: Any, reply: tuple[Any, ...]) -> tuple[Any, BaseException | None]:
    """The outcome of a record that ran collectives in the worker, its report landed."""
    records = job[2][0] if job[1] is run_all else [job[2][0]]
    land(records, reply[2])
    return reply[0], reply[1]


def _exit_reason(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"killed by signal {-code}"


def _finish_all(tickets: list[Ticket]) -> None:
    for ticket in tickets:
        ticket.finished()


class ProcessQueueWorker(QueueWorker):
    """A queue's worker whose records run in the device's worker process (see the module)."""

    transfers_here = True
    """Writes and reads run here, on this thread, straight on the shared banks: the bytes cross
    once, with no round trip to the child (a 256 KiB read took 320 us through the child
    against 40 us in a thread-worker device)."""

    def __init__(self, name: str, process: WorkerProcess, index: int) -> None:
        super().__init__(name)
        self._process = process
        self._connection = process.connections[index]
        self._plans = PlanIds()
        self.sent_messages = 0  # messages sent (tests, benchmarks)
        self.sent_jobs = 0
        self.local_jobs = 0  # jobs run on this thread, in the host process (transfers aside)
        self.transfers = 0  # writes and reads (or batches of them) run on this thread
        # While a timeline records (`_timeline`): id(record) -> (record, start, end, records in
        # its job) of each record that ran in the child, on the child's perf_counter clock.
        self.spans: dict[int, tuple[Any, float, float, int]] | None = None

    def _put(self, ticket: Ticket, function: Callable[..., Any], args: tuple[Any, ...]) -> Ticket:
        assert self._call_soon is not None, "QueueWorker used before start"
        wire: tuple[Any, ...] | None = None
        transfer = False
        if function is run:
            transfer = self.transfers_here and is_transfer(args[0])
            record = None if transfer else encode(args[0], self._plans)
            if record is not None:
                wire = (*self._plans.take(), RUN, record)
        elif function is run_all:
            transfer = self.transfers_here and all(is_transfer(record) for record in args[0])
            records = [] if transfer else [encode(record, self._plans) for record in args[0]]
            if records and all(record is not None for record in records):
                wire = (*self._plans.take(), RUN_ALL, records)
        if transfer:
            self.transfers += 1
        elif wire is None:
            self.local_jobs += 1
        self._outstanding.add(ticket)
        self._jobs.put((ticket, function, args, wire))
        return ticket

    def _serve(self) -> None:
        jobs, call_soon = self._jobs, self._call_soon
        assert call_soon is not None
        held: Any = _NOTHING
        while True:
            job = jobs.get() if held is _NOTHING else held
            held = _NOTHING
            if job is None:
                return
            self._running.wait()
            self.busy = True
            if job[3] is None:
                ticket = job[0]
                ticket.outcome = self._local(job[1], job[2])
                batch = [job]
            else:
                batch = [job]
                while len(batch) < _MESSAGE_MAX and self._running.is_set():
                    try:
                        more = jobs.get_nowait()
                    except queue.Empty:
                        break
                    if more is None or more[3] is None:
                        held = more
                        break
                    batch.append(more)
                outcomes = self._exchange(batch)
                for done, outcome in zip(batch, outcomes):
                    done[0].outcome = outcome
            self.busy = False
            call_soon(functools.partial(_finish_all, [done[0] for done in batch]))
            del job, batch

    def _lost(self, function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, BaseException | None]:
        """The outcome of a record of the lost device: its error (one per record of a batch,
        which `run_all` reports as its value, never raising)."""
        if function is run_all:
            return [self._process.error() for _ in args[0]], None
        return None, self._process.error()

    def _local(self, function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, BaseException | None]:
        if self._process.lost is not None and (function is run or function is run_all):
            return self._lost(function, args)
        try:
            return function(*args), None
        except BaseException as exc:  # noqa: BLE001 - carried back to the awaiting task
            return None, exc

    def _take_times(self, batch: list[Any], replies: list[Any]) -> None:
        """Removes the spans element the child puts after its replies; keeps each record's span
        while a timeline records (`spans`)."""
        if len(replies) <= len(batch) or type(replies[-1][0]) is not str or replies[-1][0] != _TIMES:
            return
        times = replies.pop()[1]
        spans = self.spans
        if spans is None:
            return
        for job, (start, end) in zip(batch, times):
            records = job[2][0] if job[1] is run_all else (job[2][0],)
            for record in records:
                spans[id(record)] = (record, start, end, len(records))

    def _exchange(self, batch: list[Any]) -> list[tuple[Any, BaseException | None]]:
        """Sends the batch's records in one message and returns the child's outcomes."""
        process = self._process
        if process.lost is None:
            try:
                send_message(self._connection, [job[3] for job in batch])
            except (OSError, EOFError):
                process.connection_closed()
            except Exception:  # an array that does not pickle: run the batch here instead
                self.local_jobs += len(batch)
                return [self._local(job[1], job[2]) for job in batch]
            else:
                self.sent_messages += 1
                self.sent_jobs += len(batch)
                try:
                    replies: list[tuple[Any, ...]] = recv_message(self._connection)
                    self._take_times(batch, replies)
                except (OSError, EOFError):
                    process.connection_closed()
                else:  # a record with collectives also brings its report (`_workers.endpoint.land`)
                    return [(reply[0], reply[1]) if len(reply) == 2 else _landed(job, reply)
                            for job, reply in zip(batch, replies)]
        return [self._lost(job[1], job[2]) for job in batch]
