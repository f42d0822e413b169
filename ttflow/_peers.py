"""One chip's side of collectives, wherever the chip runs: the algorithms, and the meeting they
run in (`_mesh/collectives.py` describes both; this module holds what a worker process needs
of them too, below the `_mesh` layer).

- `Peer` and `_Exchange` run a collective step's algorithm (ring, line, tree, routes) on one
  chip. They talk to a `Meeting`: the barrier of a step (`_arrive`), a chunk sent over links
  (`_send`, `_deliver`), a chunk received (`_receive`), a step left (`_leave`), the first failure
  (`abort`). In the host process the meeting is `_mesh.collectives.Rendezvous` (the chips'
  threads share it); in a worker process (`workers="process"`) it is a `ChipRendezvous`.
- `ChipRendezvous` is one chip's part of a submit's rendezvous in its worker process. Its
  chip's arrival at a step is announced to the group's other chips, and a chunk for another chip
  goes straight to that chip's worker, over the worker's `Endpoint` (a listening Unix socket
  in a private directory, `listen`; an address per worker, as a TCP endpoint would be). The host
  relays no chunk. What the host must still know (each finished step's arrivals, link bytes
  and hops; the bytes every link carried) goes back with the record's outcome (`finish`), and
  the host's `Rendezvous.merge` completes the step's `CollectiveRecord`, counts the bytes on
  its `Link`s and logs it, as a step that ran in the host does.
- A failure travels too. A record that fails in a worker aborts its rendezvous there and tells
  the group's other workers (`ABORT` to their endpoints). The host's `Rendezvous.abort` (a chip
  whose command failed before it ran, a lost worker, a mesh closing) tells every worker of the
  rendezvous (`post_abort`). A worker keeps aborted rendezvous for a while (`_RETIRED`), so an
  abort that arrives before the record still fails it.

A chunk crosses as one header (pickled: kind, rendezvous, step, tag, receiver, dtype, shape)
and its raw bytes, received straight into the receiver's new array. The `FabricFacts` a worker
runs an algorithm over (each chip's groups, paths and rings, routes, trees) are the host
`Fabric`'s answers, computed there once per mesh view (`_mesh.collectives.fabric_facts`): the
worker runs no topology code of its own.
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
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any, Protocol, final

import numpy as np

from ._errors import CollectiveError, TTFlowError
from ._ops import store_as
from ._types import DataType

__all__ = [
    "ABORT",
    "ARRIVE",
    "CHUNK",
    "ENDPOINT_PREFIX",
    "ChipRendezvous",
    "CollectiveRecord",
    "Endpoint",
    "FabricFacts",
    "Meeting",
    "Peer",
    "land",
    "listen",
    "payload_bytes",
    "portable",
    "post_abort",
]

Array = np.ndarray[Any, Any]
Coord = tuple[int, int]

CHUNK, ARRIVE, ABORT = range(3)
"""What a message to an endpoint carries: a chunk for a chip's mailbox (its bytes follow), a
chip's arrival at a step, a rendezvous's first failure."""

ENDPOINT_FD = "TTFLOW_ENDPOINT_FD"
"""The environment variable that gives a worker process its endpoint's listening socket (an
inherited descriptor; `_process_worker` sets it, `Endpoint.inherited` reads it)."""

ENDPOINT_PREFIX = "ttflow-endpoint-"
"""An endpoint's private directory: `<temp dir>/ttflow-endpoint-<host pid>-<random>`, removed
when its worker's device closes."""

_RETIRED = 4096
"""Finished or aborted rendezvous a worker keeps (so that late messages and late records find
them), the oldest dropped first."""

_POST_SECONDS = 5.0
"""How long the host waits to connect to, and write an abort to, one worker's endpoint."""


class LinkLike(Protocol):
    """What an algorithm uses of a link (`_mesh.links.Link`, or a worker's `FactLink`)."""

    source: Coord
    target: Coord

    def carry(self, chunk: Array, nbytes: int) -> Array: ...


def portable(error: BaseException, where: str = "") -> BaseException:
    """`error` if it survives pickling, else a TTFlowError that says what it was (and `where`)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return TTFlowError(f"{type(error).__name__}{where}: {error}")


class Meeting:
    """What the chips of one submit meet in, as far as one process holds it: the chunks
    addressed to its chips, the first failure, and waiting for either. `Rendezvous` (host) and
    `ChipRendezvous` (a worker) add the barrier, the sending and the leaving."""

    fabric: Any

    def __init__(self, program: str, timeout: float) -> None:
        self.program = program
        self.timeout = timeout
        self._cond = threading.Condition()
        self._mail: dict[tuple[int, Any, Coord], Array] = {}  # (step, tag, to) -> a chunk
        self._failed: tuple[Coord | None, BaseException] | None = None

    @property
    def failed(self) -> tuple[Coord | None, BaseException] | None:
        """(chip, error) of the first failure, or None."""
        return self._failed

    def abort(self, chip: Coord | None, error: BaseException) -> None:
        """A chip's command failed (or the mesh is closing): every chip waiting in a collective
        of this submit, now or later, fails with a CollectiveError naming `chip`. The first
        failure is kept; later ones change nothing."""
        self._fail(chip, error)

    def _fail(self, chip: Coord | None, error: BaseException) -> bool:
        """Keeps the first failure and wakes every waiter; whether this one was the first."""
        with self._cond:
            if self._failed is not None:
                return False
            self._failed = (chip, error)
            self._mail.clear()
            self._cond.notify_all()
            return True

    def wire(self, coord: Coord) -> tuple[Any, ...] | None:
        """The chip at `coord`'s place as it travels to a worker process, or None (it stays)."""
        return None

    def _wait(self, ready: Callable[[], bool], op: str, step: int, me: Coord) -> None:
        """Waits (holding the condition) until `ready()`; raises CollectiveError once the
        rendezvous is aborted or after the timeout. Ready wins: data that arrived is used."""
        deadline = time.monotonic() + self.timeout
        while not ready():
            if self._failed is not None:
                chip, error = self._failed
                who = "the submit was aborted" if chip is None else f"chip {chip} failed first"
                raise CollectiveError(
                    f"{op} (step {step} of program {self.program!r}) on chip {me} cannot complete: {who}: "
                    f"{type(error).__name__}: {error}", chip, op)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                error = CollectiveError(
                    f"{op} (step {step} of program {self.program!r}) on chip {me}: its peers did not "
                    f"come within {self.timeout:g} s (a chip that never ran this submit, or more chips "
                    "in a group than free worker-thread tokens); the submit is aborted", None, op)
                if self._failed is None:
                    self._failed = (me, error)
                    self._mail.clear()
                    self._cond.notify_all()
                raise error
            self._cond.wait(remaining)

    def _post(self, step: int, tag: Any, to: Coord, chunk: Array) -> None:
        """A chunk into `to`'s mailbox here (dropped once the rendezvous failed)."""
        with self._cond:
            if self._failed is None:
                self._mail[step, tag, to] = chunk
                self._cond.notify_all()

    def _receive(self, op: str, step: int, tag: Any, me: Coord) -> Array:
        key = (step, tag, me)
        with self._cond:
            self._wait(lambda: key in self._mail, op, step, me)
            return self._mail.pop(key)

    # What the algorithms call besides (see `Rendezvous` and `ChipRendezvous`).

    def _arrive(self, op: str, step: int, group: tuple[Coord, ...], topology: str, me: Coord,
                nbytes: int) -> CollectiveRecord:
        raise NotImplementedError

    def _leave(self, record: CollectiveRecord) -> None:
        raise NotImplementedError

    def _send(self, step: int, tag: Any, to: Coord, chunk: Array, nbytes: int, links: Sequence[LinkLike],
              record: CollectiveRecord) -> None:
        raise NotImplementedError

    def _deliver(self, step: int, tag: Any, to: Coord, chunk: Array, nbytes: int, links: Sequence[LinkLike],
                 record: CollectiveRecord) -> None:
        raise NotImplementedError


@final
class CollectiveRecord:
    """One collective step of one group, as it ran: for the timeline and the counters.

    `started` (perf_counter) is when the last chip of the group arrived; `waited` how long
    each chip waited for it; `link_bytes` the payload this collective sent over each directed
    link (by coordinates); `modelled_seconds` what a real mesh would take (`modelled_seconds`)."""

    __slots__ = (
        "_arrived",
        "_left",
        "chip_ids",
        "group",
        "hops",
        "link_bytes",
        "links",
        "modelled_seconds",
        "nbytes",
        "op",
        "program",
        "started",
        "step",
        "topology",
        "waited",
    )

    def __init__(self, op: str, program: str, step: int, group: tuple[Coord, ...], topology: str) -> None:
        self.op = op
        self.program = program
        self.step = step
        self.group = group
        self.topology = topology
        self.nbytes = 0  # one chip's input
        self.started = 0.0
        self.waited: dict[Coord, float] = {}
        self.link_bytes: dict[tuple[Coord, Coord], int] = {}
        self.hops = 0  # the longest route a chunk took (point_to_point, broadcast, all_to_all)
        self.chip_ids: dict[Coord, int] = {}  # each coordinate's chip id in the system
        self.modelled_seconds = 0.0
        self.links = 1  # links per neighbour pair the chunks were split across
        self._arrived: dict[Coord, float] = {}
        self._left = 0

    def __repr__(self) -> str:
        return (f"<CollectiveRecord {self.op} step {self.step} of {self.program!r}, {len(self.group)} chips "
                f"({self.topology}), {sum(self.link_bytes.values())} link bytes, "
                f"modelled {self.modelled_seconds * 1e6:.2f} us>")




@final
class Peer:
    """One chip's place in a rendezvous: what its program's collective steps call."""

    __slots__ = ("coord", "rendezvous")

    def __init__(self, rendezvous: Meeting, coord: Coord) -> None:
        self.rendezvous = rendezvous
        self.coord = coord

    def abort(self, error: BaseException) -> None:
        """This chip's command failed: its peers must not wait for it."""
        self.rendezvous.abort(self.coord, error)

    def wire(self) -> tuple[Any, ...] | None:
        """This place as it travels to a worker process (`_wire`), or None: the record stays."""
        return self.rendezvous.wire(self.coord)

    def collective(self, step: int, op: str, x: Array, attrs: dict[str, Any], dtype: DataType) -> Array:
        """The result of collective step `step` (`op` with its attrs) on this chip, whose
        operand is `x` (in its compute dtype, rounded to `dtype`)."""
        r = self.rendezvous
        fabric = r.fabric
        axis = attrs.get("cluster_axis")
        group = fabric.group(self.coord, axis)
        path, ring = fabric.path(group)
        topology = ("ring" if ring else "line") if op in _ALONG_PATH else "routes"
        itemsize = 0 if dtype is DataType.BFLOAT8_B else np.dtype(dtype.host_dtype).itemsize
        record = r._arrive(op, step, group, topology, self.coord, payload_bytes(x, itemsize))
        exchange = _Exchange(r, step, op, self.coord, group, path, ring, itemsize, dtype, record)
        result = _ALGORITHMS[op](exchange, x, **{k: v for k, v in attrs.items() if k != "cluster_axis"})
        r._leave(record)
        return result


@final
class _Exchange:
    """One chip's side of one collective step: its group, path, and send / receive."""

    __slots__ = ("dtype", "group", "itemsize", "me", "op", "path", "pos", "r", "record", "ring", "step")

    def __init__(self, r: Meeting, step: int, op: str, me: Coord, group: tuple[Coord, ...],
                 path: list[Coord], ring: bool, itemsize: int, dtype: DataType, record: CollectiveRecord) -> None:
        self.r, self.step, self.op, self.me = r, step, op, me
        self.group, self.path, self.ring = group, path, ring
        self.pos = path.index(me)
        self.itemsize, self.dtype, self.record = itemsize, dtype, record

    def at(self, offset: int) -> Coord:
        """The chip `offset` places along the path from this one (around it on a ring)."""
        return self.path[(self.pos + offset) % len(self.path)]

    def send(self, to: Coord, tag: Any, chunk: Array, links: Sequence[LinkLike] | None = None) -> None:
        """`chunk` to `to` (a neighbour, unless `links` is its route)."""
        if links is None:
            links = (self.r.fabric.link(self.me, to),)
        self.r._send(self.step, tag, to, chunk, payload_bytes(chunk, self.itemsize), links, self.record)

    def receive(self, tag: Any) -> Array:
        return self.r._receive(self.op, self.step, tag, self.me)

    def add(self, a: Array, b: Array) -> Array:
        """a + b as the device stores a partial sum: in the value's dtype (a BFLOAT8_B part is
        whole tiles, so its rows share exponents as the device's buffer packs them)."""
        if a.size == 0:
            return a + b
        return store_as(a + b, self.dtype)

    # -- the building blocks of the ring and line algorithms ---------------------------------

    def gather(self, mine: Array) -> dict[Coord, Array]:
        """Every chip's `mine`, by chip (all_gather's data movement)."""
        n, pos = len(self.path), self.pos
        parts = {self.me: mine}
        if self.ring:
            for s in range(n - 1):
                self.send(self.at(1), ("ag", s), parts[self.at(-s)])
                parts[self.at(-1 - s)] = self.receive(("ag", s))
            return parts
        if pos + 1 < n:
            self.send(self.at(1), ("agr", self.me), mine)
        if pos > 0:
            self.send(self.at(-1), ("agl", self.me), mine)
        for k in range(1, pos + 1):  # from the left end, forwarded rightwards
            home = self.at(-k)
            parts[home] = self.receive(("agr", home))
            if pos + 1 < n:
                self.send(self.at(1), ("agr", home), parts[home])
        for k in range(1, n - pos):  # from the right end, forwarded leftwards
            home = self.at(k)
            parts[home] = self.receive(("agl", home))
            if pos > 0:
                self.send(self.at(-1), ("agl", home), parts[home])
        return parts

    def reduce_scatter(self, parts: dict[Coord, Array]) -> Array:
        """The sum over the group of each chip's `parts[self.me]` (reduce_scatter's data
        movement: `parts` is this chip's term of every chip's part)."""
        n, pos = len(self.path), self.pos
        if self.ring:
            partial = parts[self.at(-1)]
            for s in range(n - 1):
                self.send(self.at(1), ("rs", s), partial)
                partial = self.add(self.receive(("rs", s)), parts[self.at(-2 - s)])
            return partial  # after round N - 2: this chip's own part, summed
        for home in self.path[pos + 1:]:  # partial sums flowing rightwards
            partial = parts[home] if pos == 0 else self.add(self.receive(("rsr", home)), parts[home])
            self.send(self.at(1), ("rsr", home), partial)
        for home in reversed(self.path[:pos]):  # and leftwards
            partial = parts[home] if pos == n - 1 else self.add(self.receive(("rsl", home)), parts[home])
            self.send(self.at(-1), ("rsl", home), partial)
        mine = parts[self.me]
        if pos > 0:
            mine = self.add(self.receive(("rsr", self.me)), mine)
        if pos < n - 1:
            mine = self.add(mine, self.receive(("rsl", self.me)))
        return mine


def _all_gather(ex: _Exchange, x: Array, dim: int) -> Array:
    if len(ex.group) == 1:
        return x
    parts = ex.gather(x)
    return np.concatenate([parts[c] for c in ex.group], axis=dim)


def _reduce_scatter(ex: _Exchange, x: Array, dim: int) -> Array:
    if len(ex.group) == 1:
        return x
    return ex.reduce_scatter(dict(zip(ex.group, np.split(x, len(ex.group), axis=dim))))


def _all_reduce(ex: _Exchange, x: Array) -> Array:
    if len(ex.group) == 1:
        return x
    if ex.dtype is DataType.BFLOAT8_B:  # parts of whole packed tiles, in tile order
        tiles = _tiles(x)
        mine = ex.reduce_scatter(dict(zip(ex.path, np.array_split(tiles, len(ex.path)))))
        parts = ex.gather(mine)
        return _untile(np.concatenate([parts[c] for c in ex.path]), x.shape)
    flat = x.reshape(-1)
    mine = ex.reduce_scatter(dict(zip(ex.path, np.array_split(flat, len(ex.path)))))
    parts = ex.gather(mine)
    return np.concatenate([parts[c] for c in ex.path]).reshape(x.shape)


def _tiles(x: Array) -> Array:
    """x's 32x32 tiles (zero padded; a rank-1 x is one row), (tiles, 32, 32) in tile order:
    batch, then tile rows, then tile columns, as the device's pages hold them."""
    h, w = (1, x.shape[0]) if x.ndim == 1 else x.shape[-2:]
    batch = x.size // (h * w) if h * w else 0
    ph, pw = -(-h // 32) * 32, -(-w // 32) * 32
    padded = np.zeros((batch, ph, pw), x.dtype)
    padded[:, :h, :w] = x.reshape(batch, h, w)
    return padded.reshape(batch, ph // 32, 32, pw // 32, 32).transpose(0, 1, 3, 2, 4).reshape(-1, 32, 32)


def _untile(tiles: Array, shape: tuple[int, ...]) -> Array:
    """The value of `shape` whose tiles (`_tiles`' order) these are."""
    h, w = (1, shape[0]) if len(shape) == 1 else shape[-2:]
    ph, pw = -(-h // 32) * 32, -(-w // 32) * 32
    batch = tiles.shape[0] // ((ph // 32) * (pw // 32))
    padded = tiles.reshape(batch, ph // 32, pw // 32, 32, 32).transpose(0, 1, 3, 2, 4).reshape(batch, ph, pw)
    return np.ascontiguousarray(padded[:, :h, :w]).reshape(shape)


def payload_bytes(chunk: Array, itemsize: int) -> int:
    """The bytes a chunk is on a link: its elements times `itemsize`, or, for BFLOAT8_B
    (`itemsize` 0), its packed tiles: each 32x32 tile (zero padded) 1088 bytes, 64 shared
    exponents and 1024 mantissas (a rank-1 chunk is one row of tiles)."""
    if itemsize:
        return chunk.size * itemsize
    if chunk.size == 0:
        return 0
    h, w = (1, chunk.shape[0]) if chunk.ndim == 1 else chunk.shape[-2:]
    return chunk.size // (h * w) * -(-h // 32) * -(-w // 32) * DataType.BFLOAT8_B.tile_bytes


def _broadcast(ex: _Exchange, x: Array, sender: tuple[int, int]) -> Array:
    if ex.me != tuple(sender):
        return ex.receive("broadcast")
    nbytes = payload_bytes(x, ex.itemsize)
    held = {ex.me: x}
    route: dict[Coord, tuple[LinkLike, ...]] = {ex.me: ()}
    for link in ex.r.fabric.tree(ex.me):  # parents before children: each link carries x once
        held[link.target] = link.carry(held[link.source], nbytes)
        route[link.target] = (*route[link.source], link)
        ex.r._deliver(ex.step, "broadcast", link.target, held[link.target], nbytes, (link,), ex.record)
    with ex.r._cond:
        ex.record.hops = max(len(links) for links in route.values())
    return x


def _point_to_point(ex: _Exchange, x: Array, sender: tuple[int, int], receiver: tuple[int, int]) -> Array:
    sender, receiver = tuple(sender), tuple(receiver)  # type: ignore[assignment]
    if sender == receiver:
        return x
    if ex.me == sender:
        ex.send(receiver, "p2p", x, ex.r.fabric.route(sender, receiver))
    elif ex.me == receiver:
        return ex.receive("p2p")
    return x


def _all_to_all(ex: _Exchange, x: Array, split_dim: int, concat_dim: int) -> Array:
    n = len(ex.group)
    if n == 1:
        return x
    parts = np.split(x, n, axis=split_dim)
    fabric = ex.r.fabric
    received = {}
    for dest, part in zip(ex.group, parts):
        if dest == ex.me:
            received[dest] = part
        else:
            ex.send(dest, ("a2a", ex.me), part, fabric.route(ex.me, dest))
    for source in ex.group:
        if source != ex.me:
            received[source] = ex.receive(("a2a", source))
    return np.concatenate([received[c] for c in ex.group], axis=concat_dim)


_ALGORITHMS: dict[str, Callable[..., Array]] = {
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "point_to_point": _point_to_point,
    "all_to_all": _all_to_all,
}
_ALONG_PATH = frozenset({"all_gather", "reduce_scatter", "all_reduce"})



# -- a chip in a worker process ------------------------------------------------------------------


@final
class FactLink:
    """A link as a worker's algorithm sees it: its ends. A chunk is counted where it is
    delivered (`ChipRendezvous._deliver`), so crossing it copies nothing."""

    __slots__ = ("source", "target")

    def __init__(self, source: Coord, target: Coord) -> None:
        self.source = source
        self.target = target

    def carry(self, chunk: Array, nbytes: int) -> Array:
        return chunk

    def __repr__(self) -> str:
        return f"<FactLink {self.source} -> {self.target}>"


@final
class FabricFacts:
    """The host `Fabric`'s answers for one mesh view, as a worker's algorithm asks them:
    `state` is (groups by (coord, cluster axis), (path, ring) by group, the directed links,
    routes by (from, to), trees by root), each link a (from, to) pair of coordinates."""

    __slots__ = ("_groups", "_links", "_paths", "_routes", "_trees")

    def __init__(self, state: tuple[Any, ...]) -> None:
        groups, paths, links, routes, trees = state
        self._groups: dict[tuple[Coord, int | None], tuple[Coord, ...]] = groups
        self._paths: dict[tuple[Coord, ...], tuple[list[Coord], bool]] = paths
        self._links = {pair: FactLink(*pair) for pair in links}
        self._routes = {ends: [self._links[pair] for pair in route] for ends, route in routes.items()}
        self._trees = {root: [self._links[pair] for pair in tree] for root, tree in trees.items()}

    def group(self, coord: Coord, cluster_axis: int | None) -> tuple[Coord, ...]:
        return self._groups[coord, cluster_axis]

    def path(self, group: Sequence[Coord]) -> tuple[list[Coord], bool]:
        path, ring = self._paths[tuple(group)]
        return list(path), ring

    def link(self, a: Coord, b: Coord) -> FactLink:
        return self._links[a, b]

    def route(self, a: Coord, b: Coord) -> list[FactLink]:
        return self._routes[a, b]

    def tree(self, root: Coord) -> list[FactLink]:
        return self._trees[root]


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
        """The chip's `Peer` for a record's collective steps (`_wire.decode`), from the wire
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
    (host, port) pair (TCP: a Ray actor's chip, `_ray_worker`, maybe on another host)."""
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
