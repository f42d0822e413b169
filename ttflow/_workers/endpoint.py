"""Where worker processes meet for collectives: each worker's `Endpoint` (a listening socket, an
address per worker), its chip's part of a submit's rendezvous (`ChipRendezvous`, a `_peers.Meeting`),
and the host's side of them: the listening socket a worker inherits (`listen`), a rendezvous's
failure told to every worker (`post_abort`), the workers' reports landed in the host's
rendezvous (`land`). `_peers` describes the whole exchange; this module is its transport.
"""

from __future__ import annotations

import collections
import os
import pickle
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, final

import numpy as np

from .._errors import CollectiveError
from .._peers import (
    Array,
    CollectiveRecord,
    Coord,
    FabricFacts,
    LinkLike,
    Meeting,
    Peer,
    portable,
)

__all__ = ["ABORT", "ARRIVE", "CHUNK", "ENDPOINT_FD", "ENDPOINT_PREFIX", "ChipRendezvous", "Endpoint", "land",
           "listen", "post_abort"]

CHUNK, ARRIVE, ABORT = range(3)
"""What a message to an endpoint carries: a chunk for a chip's mailbox (its bytes follow), a
chip's arrival at a step, a rendezvous's first failure."""

ENDPOINT_FD = "TTFLOW_ENDPOINT_FD"
"""The environment variable that gives a worker process its endpoint's listening socket (an
inherited descriptor; `_workers.process` sets it, `Endpoint.inherited` reads it)."""

ENDPOINT_PREFIX = "ttflow-endpoint-"
"""An endpoint's private directory: `<temp dir>/ttflow-endpoint-<host pid>-<random>`, removed
when its worker's device closes."""

_RETIRED = 4096
"""Finished or aborted rendezvous a worker keeps (so that late messages and late records find
them), the oldest dropped first."""

_POST_SECONDS = 5.0
"""How long the host waits to connect to, and write an abort to, one worker's endpoint."""


@final
class ChipRendezvous(Meeting):
    """One submit's rendezvous as a worker process holds it (see the module): its chips' mail,
    the arrivals announced to them, and what goes back to the host once their record is done.
    Made by the first message or record that names it (`Endpoint.state`)."""

    def __init__(self, endpoint: Endpoint, key: Any) -> None:
        super().__init__("", 600.0)
        self.endpoint = endpoint
        self.key = key
        self.fabric: FabricFacts | None = None
        self.addresses: dict[Coord, Any] = {}
        self._arrivals: dict[tuple[int, Coord], dict[Coord, float]] = {}
        self.active = 0  # records running with it here
        self.retired = False  # its records are done (or it was aborted before any came)
        self._told = False  # its failure was sent to the group's other workers
        self._done: list[tuple[Any, ...]] = []  # each step left here, for the host
        self._sent: dict[tuple[Coord, Coord], int] = {}  # payload bytes per directed link
        self.chunks_sent = 0  # to other workers
        self.chunks_received = 0  # from other workers

    def bind(self, context: tuple[Any, ...]) -> None:
        """What the record says of the rendezvous: (program, timeout, facts id, facts, each
        chip's endpoint address, the host's first failure or None)."""
        program, timeout, facts_id, facts, addresses, failed = context
        with self._cond:
            if self.fabric is None:
                self.program, self.timeout = program, timeout
                self.fabric = self.endpoint.facts(facts_id, facts)
                self.addresses = dict(addresses)
        if failed is not None:
            self.heard(*failed)

    def _fail(self, chip: Coord | None, error: BaseException) -> bool:
        with self._cond:
            self._arrivals.clear()
        return super()._fail(chip, error)

    def abort(self, chip: Coord | None, error: BaseException) -> None:
        """Fails the rendezvous here and tells the group's other workers (once)."""
        self._fail(chip, error)
        self.tell()

    def heard(self, chip: Coord | None, error: BaseException) -> None:
        """The failure another worker or the host told (it told the others too)."""
        if self._fail(chip, error):
            with self._cond:
                self._told = True

    def tell(self) -> None:
        """Sends the first failure to every other worker of the rendezvous (once)."""
        with self._cond:
            if self._told or self._failed is None or not self.addresses:
                return
            self._told = True
            chip, error = self._failed
        header = (ABORT, self.key, chip, portable(error))
        for address in set(self.addresses.values()) - {self.endpoint.address}:
            try:
                self.endpoint.send(address, header)
            except OSError:  # that worker is gone: nobody waits there
                pass

    def _message(self, address: Any, header: tuple[Any, ...], op: str, step: int, to: Coord,
                 payload: Array | None = None) -> None:
        try:
            self.endpoint.send(address, header, payload)
        except OSError as exc:
            error = CollectiveError(
                f"{op} (step {step} of program {self.program!r}): chip {to}'s worker process cannot be "
                f"reached ({type(exc).__name__}: {exc}); the submit is aborted", to, op)
            self.abort(to, error)
            raise error from None

    def arrived(self, step: int, first: Coord, coord: Coord, when: float) -> None:
        """Another chip of the group reached step `step` (a message)."""
        with self._cond:
            if self._failed is None and not self.retired:
                self._arrivals.setdefault((step, first), {})[coord] = when
                self._cond.notify_all()

    def _arrive(self, op: str, step: int, group: tuple[Coord, ...], topology: str, me: Coord,
                nbytes: int) -> CollectiveRecord:
        """The barrier: announces this chip to the group's others, then waits for theirs."""
        now = time.perf_counter()
        if self._failed is None:
            header = (ARRIVE, self.key, step, group[0], me, now)
            for coord in group:
                if coord != me:
                    address = self.addresses[coord]
                    if address == self.endpoint.address:
                        self.arrived(step, group[0], me, now)
                    else:
                        self._message(address, header, op, step, coord)
        with self._cond:
            arrivals = self._arrivals.setdefault((step, group[0]), {})
            arrivals[me] = now
            self._wait(lambda: len(arrivals) >= len(group), op, step, me)
        # Each chip keeps its own record of the step (the host joins them, `Rendezvous.merge`).
        record = CollectiveRecord(op, self.program, step, group, topology)
        record.nbytes = nbytes
        record._arrived = {me: now}
        return record

    def _leave(self, record: CollectiveRecord) -> None:
        with self._cond:
            (me, arrived), = record._arrived.items()
            self._done.append((me, record.step, record.group, record.op, record.topology, record.nbytes,
                               arrived, dict(record.link_bytes), record.hops))

    def _send(self, step: int, tag: Any, to: Coord, chunk: Array, nbytes: int, links: Sequence[LinkLike],
              record: CollectiveRecord) -> None:
        self._deliver(step, tag, to, chunk, nbytes, links, record)

    def _deliver(self, step: int, tag: Any, to: Coord, chunk: Array, nbytes: int, links: Sequence[LinkLike],
                 record: CollectiveRecord) -> None:
        """Counts the chunk on `links` and hands it to `to`: into the mailbox here if `to` is a
        chip of this worker, else straight to `to`'s worker."""
        with self._cond:
            for link in links:
                pair = (link.source, link.target)
                record.link_bytes[pair] = record.link_bytes.get(pair, 0) + nbytes
                self._sent[pair] = self._sent.get(pair, 0) + nbytes
            record.hops = max(record.hops, len(links))
            if self._failed is not None:
                return
        address = self.addresses[to]
        if address == self.endpoint.address:
            self._post(step, tag, to, np.array(chunk, copy=True))
            return
        chunk = np.ascontiguousarray(chunk)
        header = (CHUNK, self.key, step, tag, to, chunk.dtype, chunk.shape)
        self._message(address, header, record.op, step, to, chunk)
        with self._cond:
            self.chunks_sent += 1

    def received(self, step: int, tag: Any, to: Coord, chunk: Array) -> None:
        with self._cond:
            self.chunks_received += 1
        if not self.retired:
            self._post(step, tag, to, chunk)

    def report(self) -> tuple[Any, ...]:
        """What the host needs of this rendezvous's records here, taken (see `land`)."""
        with self._cond:
            done, sent, self._done, self._sent = self._done, self._sent, [], {}
            chunks = (self.chunks_sent, self.chunks_received)
            self.chunks_sent = self.chunks_received = 0
            failed = self._failed
        if failed is not None:  # the first failure as this worker knows it (it told the others)
            failed = (failed[0], portable(failed[1]))
        return (self.key, done, sent, chunks, os.getpid(), failed)


class Endpoint:
    """A worker process's place on the fabric (see the module): its listening socket, the
    rendezvous it holds, its connections to other workers' endpoints (made on first use)."""

    def __init__(self, listener: socket.socket) -> None:
        self._listener = listener
        self.address: Any = listener.getsockname()
        self._lock = threading.Lock()
        self._states: dict[Any, ChipRendezvous] = {}
        self._retired: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self._facts: collections.OrderedDict[Any, FabricFacts] = collections.OrderedDict()
        self._out: dict[Any, list[Any]] = {}  # address -> [connection or None, its lock]

    @classmethod
    def inherited(cls) -> Endpoint | None:
        """The endpoint whose listening socket this process inherited (`ENDPOINT_FD`), started."""
        fd = os.environ.pop(ENDPOINT_FD, "")
        if not fd:
            return None
        endpoint = cls(socket.socket(fileno=int(fd)))
        threading.Thread(target=endpoint._accept, name="ttflow-endpoint", daemon=True).start()
        return endpoint

    # -- what the worker's records call -----------------------------------------------------

    def peer(self, wire: tuple[Any, ...]) -> Peer:
        """The chip's `Peer` for a record's collective steps (`_workers.wire.decode`), from the wire
        form of its host peer: (rendezvous key, coordinate, context, see `bind`)."""
        key, coord, context = wire
        state = self.state(key)
        with self._lock:
            state.active += 1
            self._retired.pop(key, None)
            state.retired = False
        state.bind(context)
        return Peer(state, coord)

    def finish(self, peers: list[Peer], error: BaseException | None) -> list[tuple[Any, ...]]:
        """A record with these peers ran (`error`: how it failed): on failure its rendezvous
        are aborted here and at the group's other workers; what the host needs of each."""
        states = list({id(peer.rendezvous): peer for peer in peers}.values())
        reports = []
        for peer in states:
            state = peer.rendezvous
            assert isinstance(state, ChipRendezvous)
            if error is not None:
                state.abort(peer.coord, error)
            reports.append(state.report())
            with self._lock:
                state.active -= 1
                if state.active == 0:
                    self._retire(state)
        return reports

    # -- what other workers and the host send ----------------------------------------------

    def state(self, key: Any) -> ChipRendezvous:
        with self._lock:
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = ChipRendezvous(self, key)
            return state

    def _retire(self, state: ChipRendezvous) -> None:
        """(Holding the lock.) Keeps the rendezvous a while, for late messages."""
        state.retired = True
        with state._cond:
            state._mail.clear()
            state._arrivals.clear()
        self._retired[state.key] = None
        while len(self._retired) > _RETIRED:
            old, _ = self._retired.popitem(last=False)
            if self._states[old].active == 0:
                del self._states[old]

    def facts(self, facts_id: Any, state: bytes) -> FabricFacts:
        with self._lock:
            facts = self._facts.get(facts_id)
            if facts is None:
                facts = self._facts[facts_id] = FabricFacts(pickle.loads(state))
                if len(self._facts) > 64:
                    self._facts.popitem(last=False)
            return facts

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(Connection(sock.detach()),), daemon=True,
                             name="ttflow-endpoint-peer").start()

    def _serve(self, connection: Connection) -> None:
        with connection:
            while True:
                try:
                    header = pickle.loads(connection.recv_bytes())
                    kind, key = header[0], header[1]
                    if kind == CHUNK:
                        _, _, step, tag, to, dtype, shape = header
                        chunk = np.empty(shape, dtype)
                        connection.recv_bytes_into(chunk.reshape(-1).view(np.uint8))
                        self.state(key).received(step, tag, to, chunk)
                    elif kind == ARRIVE:
                        self.state(key).arrived(*header[2:])
                    elif kind == ABORT:
                        state = self.state(key)
                        state.heard(header[2], header[3])
                        with self._lock:
                            if state.active == 0 and not state.retired:
                                self._retire(state)
                except (EOFError, OSError):
                    return

    def send(self, address: Any, header: tuple[Any, ...], payload: Array | None = None) -> None:
        """One message to the endpoint at `address` (raises OSError if it cannot be reached)."""
        with self._lock:
            out = self._out.get(address)
            if out is None:
                out = self._out[address] = [None, threading.Lock()]
        with out[1]:
            connection = out[0]
            try:
                if connection is None:
                    sock = _socket_for(address)
                    try:
                        sock.connect(address)
                    except OSError:
                        sock.close()
                        raise
                    connection = out[0] = Connection(sock.detach())
                connection.send_bytes(pickle.dumps(header, pickle.HIGHEST_PROTOCOL))
                if payload is not None:
                    connection.send_bytes(payload.reshape(-1).view(np.uint8))
            except (OSError, EOFError) as exc:
                if connection is not None:
                    connection.close()
                out[0] = None
                raise OSError(str(exc)) from exc


# -- the host's side -----------------------------------------------------------------------------


def _socket_for(address: Any) -> socket.socket:
    """A socket to reach the endpoint at `address`: a path (a Unix socket, `listen`) or a
    (host, port) pair (TCP: a Ray actor's chip, `_workers.ray`, maybe on another host)."""
    if not isinstance(address, tuple):
        return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock = socket.socket(socket.AF_INET6 if len(address) == 4 else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a chunk's header and bytes go at once
    return sock


def listen() -> tuple[socket.socket, str, str]:
    """A new endpoint's listening socket for a worker process to inherit, its address and the
    private directory it lives in (remove it once the worker is gone)."""
    directory = tempfile.mkdtemp(prefix=f"{ENDPOINT_PREFIX}{os.getpid()}-")
    address = os.path.join(directory, "socket")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address)
        listener.listen(64)
    except BaseException:
        listener.close()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return listener, address, directory


def post_abort(addresses: Sequence[Any], key: Any, chip: Coord | None, error: BaseException) -> None:
    """Tells the workers at `addresses` that rendezvous `key` failed (best effort: a worker that
    is gone has nobody waiting)."""
    data = pickle.dumps((ABORT, key, chip, portable(error)), pickle.HIGHEST_PROTOCOL)
    frame = len(data).to_bytes(4, "big") + data  # `Connection.send_bytes`' framing
    for address in addresses:
        try:
            with _socket_for(address) as sock:
                sock.settimeout(_POST_SECONDS)
                sock.connect(address)
                sock.sendall(frame)
        except OSError:
            pass


def land(records: Sequence[Any], reports: list[tuple[Any, ...]]) -> None:
    """The reports of records that ran in a worker (`Endpoint.finish`), into the host's
    rendezvous their `Compute` steps' peers name (`Rendezvous.merge`)."""
    meetings = {}
    for record in records:
        for step in record.steps:
            peer = getattr(step, "peers", None)
            if isinstance(peer, Peer):
                meetings[getattr(peer.rendezvous, "key", None)] = peer.rendezvous
    for report in reports:
        meeting = meetings.get(report[0])
        if meeting is not None:
            meeting.merge(*report[1:])  # type: ignore[attr-defined]
