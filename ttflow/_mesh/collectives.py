"""Collectives: how the chips of one SPMD submit exchange values, over the links of their mesh.

Every chip runs its own program command in its own CQ0, on its own worker thread (a record
with collectives never runs inline on the event loop, whose thread would then wait for chips
that cannot start). The chips of a submit share one `Rendezvous`, made by `submit_collective`
(the SPMD hook, called by `spmd.py`); each chip's command carries its `Peer` (its coordinate in
the rendezvous), and its run hands each collective step to `Peer.collective`:

1. the chips of the step's group meet (`Rendezvous._arrive`: a barrier per step and group);
2. the step's algorithm moves the chunks chip to chip over the group's links (`links.py`),
   one hop after another, each hop a copy counted on its directed link;
3. each chip returns its result, which its run stores in its own bank memory.

Nothing hangs. A chip whose command fails, before it runs (an earlier command's error, no
memory, a closed device, a cancelled submit) or while it runs, aborts the rendezvous
(`Rendezvous.abort`, called where a command completes with an error, and by the mesh when it
closes on an error): every chip waiting in, or reaching, a collective of that submit then
fails its command with a `CollectiveError` naming the chip that failed and the collective. A
wait longer than the mesh's `collective_timeout` (a last resort: a peer that never comes;
`open_mesh_device(collective_timeout=...)`, `COLLECTIVE_TIMEOUT` s unless given) fails the same
way.

The algorithms (N chips in the group, its path as `Fabric.path` lays it out; ranks are the
group's mesh-coordinate order, positions the path's order):

- all_gather: on a ring, unidirectional, N - 1 rounds: in round s the chip at position p sends
  the shard of the chip at position p - s to position p + 1; on a line, bidirectional: each
  chip sends its shard both ways and forwards what it receives onwards.
- reduce_scatter: on a ring, N - 1 rounds: in round s position p sends its partial sum of the
  part that belongs to position p - 1 - s, and adds its own term to what it receives; the part
  of position h is summed x[h+1] + x[h+2] + ... + x[h-1], then + x[h] (path order). On a line,
  the partial sums of position h's part flow in from both ends: ((x[0] + x[1]) + ... + x[h-1])
  + x[h], then + (x[N-1] + ... + x[h+1]).
- all_reduce: the value flattened and cut into N near-equal parts (np.array_split), a
  reduce_scatter of the parts, then an all_gather of the reduced parts; every chip gets the
  same bits.
- broadcast: the sender's value down the breadth-first tree from the sender (`Fabric.tree`).
- point_to_point: the sender's value along the shortest route to the receiver.
- all_to_all: each part along the shortest route from its chip to its destination.

Partial sums cross links in the value's dtype (a BFLOAT16 partial is rounded before it is
sent), as the device's buffers hold them; integer sums wrap as the device's do. A BFLOAT8_B
value crosses as its packed tiles (`payload_bytes`: 1088 bytes per 32x32 tile, padding
included): the builder lets a collective cut or join it only along whole tiles, an
all_reduce cuts it into parts of whole tiles (in tile order, `_tiles`) rather than flat
elements, and each partial sum is packed (its 16-value face rows sharing exponents) before it
crosses.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, final

import numpy as np

from .._runtime import calls as _runtime
from .._ir.binary import Binary, for_mesh
from .._errors import CollectiveError
from .._peers import (
    Array,
    CollectiveRecord,
    LinkLike,
    Meeting,
    Peer,
    payload_bytes,
    portable,
)
from .._runtime.tensor import Tensor
from .._workers.endpoint import post_abort
from .device import COLLECTIVE_TIMEOUT, MeshDevice
from .links import Fabric
from .spec import Coord
from .topology import physical

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "CollectiveLog",
    "CollectiveRecord",
    "Peer",
    "Rendezvous",
    "ReplayPeers",
    "ReplayRendezvous",
    "Wiring",
    "collective_log",
    "fabric_facts",
    "fabric_of",
    "modelled_seconds",
    "payload_bytes",
    "submit_collective",
]

PAYLOAD_FRACTION = 0.96
"""The part of a link's rate that is payload after Ethernet framing (tt-metal's
BasicEthernetGuide): the derived timing model's rate is `link_bytes_per_second` times this."""

_WORMHOLE_LINK_BYTES_PER_SECOND = 12.5e9
_FITS: dict[str, tuple[float, float, float]] = {
    # op: (fixed seconds, seconds per chip past the first, payload rate in bytes/s). tt-metal's
    # published fits (Wormhole, bfloat16, traced, one link; SPEC.md): the payload term is
    # factor(N) * bytes / rate, bytes one chip's input (see `modelled_seconds`).
    "all_gather": (4.47e-6, 1.91e-6, 11.8e9),
    "reduce_scatter": (3.23e-6, 3.97e-6, 11.1e9),
    "all_reduce": (9.07e-6, 5.82e-6, 10.9e9),
}


def modelled_seconds(op: str, n: int, nbytes: int, hops: int, busiest_link_bytes: int,
                     link_bytes_per_second: float, hop_seconds: float, links: int = 1) -> float:
    """How long a real mesh takes for one collective (a model; the bytes moved are real).

    all_gather, reduce_scatter and all_reduce follow tt-metal's published fits, their payload
    term scaled by the spec's link rate against Wormhole's 12.5 GB/s: fixed + per_chip * (N - 1)
    + factor * nbytes / (rate * links), with `nbytes` one chip's input and factor N - 1
    (all_gather: each chip receives N - 1 shards), (N - 1) / N (reduce_scatter) and 2 (N - 1) / N
    (all_reduce). broadcast, point_to_point and all_to_all have no published fit; they are
    derived from the spec: `hops` (the longest route's hops) times `hop_seconds`, plus the busiest
    neighbour pair's bytes at the payload rate (`PAYLOAD_FRACTION` of `link_bytes_per_second`)
    of its `links`. A group of one chip: 0.

    `links`: the links of each neighbour pair the collective uses (the spec's `links_per_pair`,
    ttnn's `num_links`): its chunks are split across them, which carry their slices in parallel,
    so the payload term is divided by `links`; the fixed and per-chip terms (setup, handshakes,
    hop latency) are not."""
    if n <= 1:
        return 0.0
    fit = _FITS.get(op)
    if fit is None:
        return hops * hop_seconds + busiest_link_bytes / (PAYLOAD_FRACTION * link_bytes_per_second * links)
    fixed, per_chip, rate = fit
    factor = {"all_gather": n - 1, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}[op]
    scaled = rate * link_bytes_per_second / _WORMHOLE_LINK_BYTES_PER_SECOND
    return fixed + per_chip * (n - 1) + factor * nbytes / (scaled * links)


@final
class Wiring:
    """What a rendezvous needs for its chips to meet in their worker processes
    (`workers="process"`): each chip's endpoint address (by coordinate, in the fabric's order)
    and the fabric's facts (`fabric_facts`: an id and their pickled state)."""

    __slots__ = ("addresses", "facts", "facts_id")

    def __init__(self, addresses: tuple[tuple[Coord, Any], ...], facts_id: int, facts: bytes) -> None:
        self.addresses = addresses
        self.facts_id = facts_id
        self.facts = facts


_KEYS = itertools.count()
"""Rendezvous keys, unique in this process: what names a rendezvous in the workers."""

STATS = {"host_chunks": 0, "worker_chunks": 0, "worker_steps": 0}
"""Chunks delivered into a mailbox of this (the host) process; chunks the workers sent each
other and collective steps they ran, as their reports said (tests read the differences)."""
WORKER_PIDS: set[int] = set()
"""The worker processes whose reports came back (tests)."""
_STATS_LOCK = threading.Lock()


@final
class Rendezvous(Meeting):
    """What the chips of one SPMD submit share: the barriers of its collective steps, the
    chunks in transit (each addressed to a chip), and the first failure.

    `fabric`: the links of the mesh view the submit runs on; `program`: the program's name
    (for messages); `link_bytes_per_second`, `hop_seconds`, `links_per_pair`: the spec's link
    facts (the timing model); `log`: where each completed collective's `CollectiveRecord` goes
    (or None); `wiring`: where the chips' worker processes listen, when every chip has one.

    With a wiring the chips' records travel to their workers, which meet among themselves
    (`_workers.endpoint.ChipRendezvous`) and report each step back (`merge`); this object then keeps the
    records, counts the links and tells the workers of a failure (`abort`). Which way a
    rendezvous goes is settled by its first chip: a record that cannot travel (debug hooks)
    makes the rest stay in the host too (`wire` gives None), and one that already travelled
    makes a later local run fail typed."""

    def __init__(self, fabric: Fabric, program: str, link_bytes_per_second: float = 12.5e9,
                 hop_seconds: float = 711e-9, log: list[CollectiveRecord] | CollectiveLog | None = None,
                 timeout: float = COLLECTIVE_TIMEOUT, links_per_pair: int = 1, wiring: Wiring | None = None) -> None:
        super().__init__(program, timeout)
        self.fabric = fabric
        self.links_per_pair = links_per_pair
        self.link_bytes_per_second = link_bytes_per_second
        self.hop_seconds = hop_seconds
        self.log = log
        self.wiring = wiring
        self.key = next(_KEYS)
        self._travelled: bool | None = None  # settled by the first chip: in the workers, or here
        self._records: dict[tuple[int, Coord], CollectiveRecord] = {}  # (step, group's first chip)

    def peer(self, coord: Coord) -> Peer:
        """The chip at `coord`'s place in the rendezvous (what its command carries)."""
        return Peer(self, coord)

    def fresh(self) -> Rendezvous:
        """A new rendezvous of the same chips, links and model, with nothing arrived, sent or
        failed: what one execute of a trace gives a submit the trace captured."""
        return Rendezvous(self.fabric, self.program, self.link_bytes_per_second, self.hop_seconds,
                          self.log, self.timeout, self.links_per_pair, self.wiring)

    def abort(self, chip: Coord | None, error: BaseException) -> None:
        """A chip's command failed (or the mesh is closing): every chip waiting in a collective
        of this submit, now or later, fails with a CollectiveError naming `chip`. The first
        failure is kept; later ones change nothing. The workers hear of it if a record went
        there."""
        with self._cond:
            first = self._fail(chip, error)
            tell = first and self._travelled is True
        if tell:
            assert self.wiring is not None
            post_abort([address for _, address in self.wiring.addresses], self.key, chip, error)

    def wire(self, coord: Coord) -> tuple[Any, ...] | None:
        """The chip's place for its worker (`_workers.endpoint.Endpoint.peer`), or None: it meets here."""
        wiring = self.wiring
        if wiring is None:
            return None
        with self._cond:
            if self._travelled is False:
                return None
            self._travelled = True
            failed = self._failed
        if failed is not None:
            failed = (failed[0], portable(failed[1]))
        return (self.key, coord, (self.program, self.timeout, wiring.facts_id, wiring.facts, wiring.addresses, failed))

    # -- what the chips call, on their worker threads ------------------------------------------

    def _arrive(self, op: str, step: int, group: tuple[Coord, ...], topology: str, me: Coord,
                nbytes: int) -> CollectiveRecord:
        """The barrier of a collective step: returns once every chip of `group` arrived."""
        key = (step, group[0])
        with self._cond:
            if self._travelled:
                error = CollectiveError(
                    f"{op} (step {step} of program {self.program!r}) on chip {me}: this chip runs it in "
                    "the host process (under debug hooks), its peers in their worker processes; they "
                    "cannot meet (put debug hooks on every chip of the mesh, or none)", me, op)
                self._fail(me, error)
                raise error
            self._travelled = False
            record = self._records.get(key)
            if record is None:
                record = self._records[key] = CollectiveRecord(op, self.program, step, group, topology)
                record.nbytes = nbytes
                record.chip_ids = self.fabric.ids
            now = time.perf_counter()
            record._arrived[me] = now
            if len(record._arrived) == len(group):
                record.started = now
                record.waited = {c: now - t for c, t in record._arrived.items()}
                self._cond.notify_all()
            else:
                self._wait(lambda: len(record._arrived) == len(group), op, step, me)
        return record

    def _leave(self, record: CollectiveRecord) -> None:
        """A chip is done with a collective; the last one completes its record."""
        with self._cond:
            record._left += 1
            if record._left < len(record.group):
                return
            del self._records[record.step, record.group[0]]
        self._complete(record)

    def _complete(self, record: CollectiveRecord) -> None:
        """A step every chip of its group left: its timing model, then the log."""
        hops = len(record.group) - 1 if record.topology != "routes" else record.hops
        record.links = self.links_per_pair
        record.modelled_seconds = modelled_seconds(
            record.op, len(record.group), record.nbytes, hops, max(record.link_bytes.values(), default=0),
            self.link_bytes_per_second, self.hop_seconds, self.links_per_pair)
        if self.log is not None:
            self.log.append(record)

    def _send(self, step: int, tag: Any, to: Coord, chunk: Array, nbytes: int, links: Sequence[LinkLike],
              record: CollectiveRecord) -> None:
        """`chunk` across `links`, one hop after another, then into `to`'s mailbox."""
        for link in links:
            chunk = link.carry(chunk, nbytes)
        self._deliver(step, tag, to, chunk, nbytes, links, record)

    def _deliver(self, step: int, tag: Any, to: Coord, chunk: Array, nbytes: int, links: Sequence[LinkLike],
                 record: CollectiveRecord) -> None:
        """A chunk that crossed `links` into `to`'s mailbox, its bytes on the record."""
        with self._cond:
            for link in links:
                pair = (link.source, link.target)
                record.link_bytes[pair] = record.link_bytes.get(pair, 0) + nbytes
            record.hops = max(record.hops, len(links))
        with _STATS_LOCK:
            STATS["host_chunks"] += 1
        self._post(step, tag, to, chunk)

    # -- what the workers report (`_workers.endpoint.land`, on a queue's worker thread) -------------------

    def merge(self, done: list[tuple[Any, ...]], sent: dict[tuple[Coord, Coord], int],
              chunks: tuple[int, int], pid: int, failed: tuple[Coord | None, BaseException] | None) -> None:
        """One worker's report of its chip's record: each step it left (its arrival, the link
        bytes it sent, its longest route), the bytes it sent over each link (counted on the
        mesh's links, failed steps' too), the chunks it sent, and the rendezvous's first failure
        as the worker knows it. A step's record completes when every chip of its group reported
        it, as the last chip's `_leave` completes it. A failure is kept here without telling
        the workers (they told each other): the chip's command then completing with its
        CollectiveError changes nothing, so a later record names the chip that failed first."""
        if failed is not None:
            self._fail(*failed)
        for (a, b), nbytes in sent.items():
            self.fabric.link(a, b).carry(_NO_BYTES, nbytes)  # counted, nothing copied
        complete = []
        with self._cond:
            for me, step, group, op, topology, nbytes, arrived, link_bytes, hops in done:
                key = (step, group[0])
                record = self._records.get(key)
                if record is None:
                    record = self._records[key] = CollectiveRecord(op, self.program, step, group, topology)
                    record.nbytes = nbytes
                    record.chip_ids = self.fabric.ids
                record._arrived[me] = arrived
                for pair, n in link_bytes.items():
                    record.link_bytes[pair] = record.link_bytes.get(pair, 0) + n
                record.hops = max(record.hops, hops)
                record._left += 1
                if record._left == len(group):
                    del self._records[key]
                    record.started = max(record._arrived.values())
                    record.waited = {c: record.started - t for c, t in record._arrived.items()}
                    complete.append(record)
        for record in complete:
            self._complete(record)
        with _STATS_LOCK:
            STATS["worker_chunks"] += chunks[0]
            STATS["worker_steps"] += len(done)
            WORKER_PIDS.add(pid)


_NO_BYTES = np.zeros(0, np.uint8)




# -- the SPMD hook: one rendezvous per submit --------------------------------------------------------

_FABRICS: weakref.WeakKeyDictionary[Any, dict[tuple[Coord, tuple[int, ...]], Fabric]] = weakref.WeakKeyDictionary()


def fabric_of(mesh: MeshDevice) -> Fabric:
    """The links of `mesh`'s view (kept per system and view: shape and chip order)."""
    system = mesh._system
    fabrics = _FABRICS.get(system)
    if fabrics is None:
        fabrics = _FABRICS[system] = {}
    key = (mesh._shape, mesh._ids)
    fabric = fabrics.get(key)
    if fabric is None:
        spec = system.spec
        fabric = fabrics[key] = Fabric(mesh._shape, mesh._ids,
                                       lambda a, b: spec.linked(physical(spec, a), physical(spec, b)),
                                       system.link_bytes)
    return fabric


def fabric_facts(fabric: Fabric) -> bytes:
    """What a worker's algorithms ask of `fabric` (`_peers.FabricFacts`), pickled: every chip's
    group along each cluster axis, each group's path and whether it is a ring, the directed
    links, the route between every two chips and the tree from every chip, each link a
    (from, to) pair of coordinates. The fabric's own answers, so the worker runs no topology
    code of its own."""
    coords = fabric.coords
    groups = {(c, axis): fabric.group(c, axis) for c in coords for axis in (None, 0, 1)}
    paths = {group: fabric.path(group) for group in set(groups.values())}
    links = [(link.source, link.target) for link in fabric.links]
    routes = {(a, b): tuple((link.source, link.target) for link in fabric.route(a, b))
              for a in coords for b in coords if a != b}
    trees = {c: tuple((link.source, link.target) for link in fabric.tree(c)) for c in coords}
    return pickle.dumps((groups, paths, links, routes, trees), pickle.HIGHEST_PROTOCOL)


_WIRINGS: weakref.WeakKeyDictionary[Any, dict[tuple[Coord, tuple[int, ...]], Wiring | None]] = \
    weakref.WeakKeyDictionary()


def wiring_of(mesh: MeshDevice) -> Wiring | None:
    """Where the chips of `mesh`'s view meet when each has a worker process (`Wiring`, kept per
    system and view), or None: they meet in this process."""
    system = mesh._system
    wirings = _WIRINGS.get(system)
    if wirings is None:
        wirings = _WIRINGS[system] = {}
    key = (mesh._shape, mesh._ids)
    if key not in wirings:
        # A chip without a worker process (or one of another kind) meets here.
        addresses = [getattr(chip._process, "address", None) for chip in mesh._chips]
        wiring = None
        if None not in addresses:
            wiring = Wiring(tuple(zip(mesh.coords, addresses)), next(_KEYS), fabric_facts(fabric_of(mesh)))
        wirings[key] = wiring
    return wirings[key]


def submit_collective(mesh: MeshDevice, binary: Binary, program_index: int,
                      per_chip: list[list[Tensor]]) -> list[list[Tensor]] | None:
    """An SPMD submit of a program with collectives: one checked single-chip submit per chip
    (the program resolved for the mesh's shape, `_ir.binary.for_mesh`), each chip's command given
    its `Peer` of one new `Rendezvous`; each chip's outputs. None for a program without
    collectives (or a binary or index the first chip's submit must refuse): the caller submits
    it as any other.

    If a chip's submit raises after others queued theirs, the rendezvous is aborted (their
    collectives fail typed) and their outputs are deallocated before the error propagates."""
    if not (type(binary) is Binary and type(program_index) is int and 0 <= program_index < len(binary.programs)):
        return None
    program = binary.programs[program_index]
    if not program.has_collectives:
        return None
    for_mesh(program, mesh._shape)  # a program that does not fit the mesh: refused before any chip queues
    system = mesh._system
    spec = system.spec
    rendezvous = Rendezvous(fabric_of(mesh), program.name, spec.link_bytes_per_second, spec.hop_seconds,
                            collective_log(mesh), timeout=system.collective_timeout,
                            links_per_pair=spec.links_per_pair, wiring=wiring_of(mesh))
    system.rendezvous.add(rendezvous)
    outputs: list[list[Tensor]] = []
    try:
        for coord, chip, inputs in zip(mesh.coords, mesh._chips, per_chip):
            outputs.append(_runtime._submit_checked(chip, binary, program_index, inputs, mesh._shape,
                                                    peers=rendezvous.peer(coord)))
    except BaseException as exc:
        rendezvous.abort(mesh.coords[len(outputs)], exc)
        for chip_outputs in outputs:
            for output in chip_outputs:
                _runtime.deallocate(output)
        raise
    return outputs


# -- trace replays: a fresh rendezvous per captured submit and execute ---------------------------------


@final
class ReplayRendezvous:
    """What the chips' replays of one execute of a mesh trace share: for each submit the trace
    captured (each its own `Rendezvous`), a fresh one, made when the first chip's replay is
    decided (`renew`), so that every execute meets anew and counts its bytes anew.

    It stands in `_System.rendezvous` as a submit's rendezvous does: `abort(chip, error)` (a
    chip's replay failed, or the mesh closes on an error) aborts every fresh rendezvous made so
    far and those made later, so no chip of this execute waits for one that will not come."""

    __slots__ = ("__weakref__", "_failed", "_fresh", "_lock")

    def __init__(self) -> None:
        self._fresh: dict[Rendezvous, Rendezvous] = {}
        self._failed: tuple[Coord | None, BaseException] | None = None
        self._lock = threading.Lock()

    def renew(self, captured: Rendezvous) -> Rendezvous:
        """This execute's rendezvous for a captured submit's (the same one for every chip)."""
        with self._lock:
            fresh = self._fresh.get(captured)
            if fresh is None:
                fresh = self._fresh[captured] = captured.fresh()
                if self._failed is not None:
                    fresh.abort(*self._failed)
            return fresh

    def abort(self, chip: Coord | None, error: BaseException) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = (chip, error)
            fresh = list(self._fresh.values())
        for rendezvous in fresh:
            rendezvous.abort(chip, error)


@final
class ReplayPeers:
    """One chip's place in one execute of a mesh trace: what its replay command carries
    (`command.peers`). `replace` gives each captured collective step this execute's `Peer`;
    `abort` (the replay failed) releases the chip's peers, as a submit's `Peer.abort` does."""

    __slots__ = ("coord", "execution")

    def __init__(self, execution: ReplayRendezvous, coord: Coord) -> None:
        self.execution = execution
        self.coord = coord

    def replace(self, captured: Peer) -> Peer:
        rendezvous = captured.rendezvous
        assert isinstance(rendezvous, Rendezvous)
        return self.execution.renew(rendezvous).peer(captured.coord)

    def abort(self, error: BaseException) -> None:
        self.execution.abort(self.coord, error)


@final
class CollectiveLog:
    """Where a system's completed collectives go: into every list listening now (a timeline
    recording, say), and nowhere when none listens, so a long run keeps no record it does not
    need. Appended to from the chips' worker threads."""

    __slots__ = ("_listeners",)

    def __init__(self) -> None:
        self._listeners: tuple[list[CollectiveRecord], ...] = ()

    def append(self, record: CollectiveRecord) -> None:
        for listener in self._listeners:
            listener.append(record)

    @contextlib.contextmanager
    def listening(self) -> Iterator[list[CollectiveRecord]]:
        """The collectives completed inside the block, in the order their last chip left them."""
        records: list[CollectiveRecord] = []
        self._listeners = (*self._listeners, records)
        try:
            yield records
        finally:
            self._listeners = tuple(r for r in self._listeners if r is not records)


_LOGS: weakref.WeakKeyDictionary[Any, CollectiveLog] = weakref.WeakKeyDictionary()


def collective_log(mesh: MeshDevice) -> CollectiveLog:
    """The log of the mesh's system (shared by its submeshes and reshapes)."""
    log = _LOGS.get(mesh._system)
    if log is None:
        log = _LOGS[mesh._system] = CollectiveLog()
    return log
