"""One chip's side of collectives, wherever the chip runs: the algorithms, and the meeting they
run in (`_mesh/collectives.py` describes both; this module holds what a worker process needs
of them too, below the `_mesh` layer).

- `Peer` and `_Exchange` run a collective step's algorithm (ring, line, tree, routes) on one
  chip. They talk to a `Meeting`: the barrier of a step (`_arrive`), a chunk sent over links
  (`_send`, `_deliver`), a chunk received (`_receive`), a step left (`_leave`), the first failure
  (`abort`). In the host process the meeting is `_mesh.collectives.Rendezvous` (the chips'
  threads share it); in a worker process (`workers="process"`) it is a `ChipRendezvous`.
- `ChipRendezvous` (in `_workers.endpoint`, with the rest of the transport) is one chip's part of a submit's rendezvous in its worker process. Its
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

import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, final

import numpy as np

from ._errors import CollectiveError, TTFlowError
from ._ir.numerics import store_as
from ._ir.ops import OPS
from ._types import DataType

__all__ = ["CollectiveRecord", "FabricFacts", "LinkLike", "Meeting", "Peer", "payload_bytes", "portable"]

Array = np.ndarray[Any, Any]
Coord = tuple[int, int]

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
        """This place as it travels to a worker process (`_workers.wire`), or None: the record stays."""
        return self.rendezvous.wire(self.coord)

    def collective(self, step: int, op: str, x: Array, attrs: dict[str, Any], dtype: DataType) -> Array:
        """The result of collective step `step` (`op` with its attrs) on this chip, whose
        operand is `x` (in its compute dtype, rounded to `dtype`)."""
        r = self.rendezvous
        fabric = r.fabric
        axis = attrs.get("cluster_axis")
        group = fabric.group(self.coord, axis)
        path, ring = fabric.path(group)
        topology = ("ring" if ring else "line") if OPS[op].along_path else "routes"
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
