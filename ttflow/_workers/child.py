"""The worker process's side of `workers="process"` (see `_workers.process`, the host's side):
a fresh interpreter that maps the device's bank memory (the shared files the host made) and
serves each of the host's connections (one per queue) on a thread of its own, running the
records each message carries in order and replying with their outcomes in one message."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .._commands import run, run_all
from .._peers import portable
from .endpoint import Endpoint
from .wire import RUN, decode, plan_from_state, recv_message, send_message

__all__ = ["Executor", "main"]

TIMES = "times"
"""Marks the element after a message's replies that holds each job's span (`_timed`; the host's
`_workers.process._TIMES` is the same)."""


def _portable(error: BaseException) -> BaseException:
    return portable(error, " in the worker process")


class Executor:
    """What runs one queue's messages in a worker: the plans that queue's host side defined
    (by id, `_workers.wire.PlanIds`) and the device's banks. `handle` takes a message (a list of jobs,
    each `(plan definitions, plan ids to forget, RUN or RUN_ALL, record(s) in wire form)`) and
    gives the reply: one `(value, error)` per job, errors made picklable, and a record whose
    collectives ran here (its peers made by `endpoint`, `_workers.endpoint.Endpoint`) also gives their
    report, `(value, error, report)`, for the host (`_workers.endpoint.land`). Transport-free, so that a
    socket (here) or another carrier of messages can drive it."""

    def __init__(self, banks: Any, endpoint: Endpoint | None = None) -> None:
        self.banks = banks
        self.plans: dict[int, Any] = {}
        # Where a record's collective steps meet their peers (`_workers.endpoint.Endpoint`), if anywhere.
        self.endpoint = endpoint

    def handle(self, message: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        plans, banks = self.plans, self.banks
        replies: list[tuple[Any, ...]] = []
        for defs, forget, kind, payload in message:
            try:
                for number, state in defs:
                    plans[number] = plan_from_state(pickle.loads(state))
                peers: list[Any] = []
                if kind == RUN:
                    record = decode(payload, plans, self._peer(peers))
                    if not peers:
                        replies.append((run(record, banks), None))
                    else:  # its collectives ran here: their report goes back with it
                        replies.append(self._run_with_peers(record, peers))
                else:
                    records = [decode(record, plans, self._peer(peers)) for record in payload]
                    errors = run_all(records, banks)
                    replies.append(([None if e is None else _portable(e) for e in errors], None))
            except Exception as exc:
                replies.append((None, _portable(exc)))
            for number in forget:
                plans.pop(number, None)
        return replies


    def _peer(self, peers: list[Any]) -> Any:
        """What `decode` makes a travelling peer into: this worker's `Peer` (kept in `peers`)."""
        endpoint = self.endpoint
        if endpoint is None:
            return None

        def peer(wire: tuple[Any, ...]) -> Any:
            made = endpoint.peer(wire)
            peers.append(made)
            return made

        return peer

    def _run_with_peers(self, record: Any, peers: list[Any]) -> tuple[Any, BaseException | None, Any]:
        assert self.endpoint is not None
        try:
            value, error = run(record, self.banks), None
        except Exception as exc:
            value, error = None, exc
        report = self.endpoint.finish(peers, error)  # a failure aborts the peers' rendezvous
        return value, None if error is None else _portable(error), report


def _serve_connection(connection: Connection, banks: Any, endpoint: Endpoint | None = None) -> None:
    executor = Executor(banks, endpoint)
    while True:
        try:
            message = recv_message(connection)
        except (EOFError, OSError):
            return
        replies = _timed(executor, message)
        try:
            send_message(connection, replies)
        except (EOFError, OSError):
            return
        except Exception as exc:  # a result that does not pickle
            send_message(connection, [(None, _portable(exc))] * len(replies))


def _timed(executor: Executor, message: list[Any]) -> list[Any]:
    """`executor.handle(message)` a job at a time, and after the replies one more element,
    `(TIMES, spans)`: each job's (start, end) on `time.perf_counter` (CLOCK_MONOTONIC, the
    host's clock too), which the host's timeline shows on the chip's worker track."""
    replies: list[Any] = []
    spans = []
    clock = time.perf_counter
    for job in message:
        start = clock()
        replies += executor.handle([job])
        spans.append((start, clock()))
    replies.append((TIMES, spans))
    return replies


def _heartbeat(fd: int, interval: float) -> None:
    """Sends a byte every `interval` s on the heartbeat connection (`_workers.process._listen`),
    on a thread that does nothing else; returns when the host is gone."""
    with socket.socket(fileno=fd) as beat:
        while True:
            try:
                beat.send(b".")
            except OSError:
                return
            time.sleep(interval)


def main(argv: list[str]) -> None:
    """The child: `fds blas_threads space:path:banks:bank_bytes...` (see `WorkerProcess.start`)."""
    from .._blas import limit_blas_threads
    from .._memory.banks import map_shared
    from .._types import MemorySpace
    from .heap import keep_freed_heap

    keep_freed_heap()
    heartbeat = os.environ.pop("TTFLOW_HEARTBEAT", "")
    if heartbeat:
        fd, interval = heartbeat.split(":")
        threading.Thread(target=_heartbeat, args=(int(fd), float(interval)), name="ttflow-heartbeat",
                         daemon=True).start()
    fds, blas = argv[0], argv[1]
    banks: dict[MemorySpace, Any] = {}
    maps = []
    for spec in argv[2:]:
        name, path, num_banks, bank_bytes = spec.rsplit(":", 3)
        nbytes = int(num_banks) * int(bank_bytes)
        mapping = map_shared(path, nbytes)
        maps.append(mapping)
        banks[MemorySpace[name.upper()]] = np.frombuffer(mapping, np.uint8, nbytes).reshape(
            int(num_banks), int(bank_bytes))
    connections = [Connection(int(fd)) for fd in fds.split(",")]
    endpoint = Endpoint.inherited()  # other workers' chunks for this chip's collectives
    with limit_blas_threads(int(blas)) if blas else contextlib.nullcontext():
        threads = [threading.Thread(target=_serve_connection, args=(c, banks, endpoint), daemon=True)
                   for c in connections]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
