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
wait longer than `TIMEOUT_SECONDS` (a last resort: a peer that never comes) fails the same way.

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
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, final

import numpy as np

from .. import _runtime
from .._binary import Binary, for_mesh
from .._errors import CollectiveError
from .._ops import store_as
from .._tensor import Tensor
from .._types import DataType
from .device import MeshDevice
from .links import Fabric, Link
from .spec import Coord
from .topology import physical

__all__ = [
    "TIMEOUT_SECONDS",
    "CollectiveLog",
    "CollectiveRecord",
    "Peer",
    "Rendezvous",
    "ReplayPeers",
    "ReplayRendezvous",
    "collective_log",
    "fabric_of",
    "modelled_seconds",
    "payload_bytes",
    "submit_collective",
]

Array = np.ndarray[Any, Any]

TIMEOUT_SECONDS = 600.0
"""How long a chip waits for its peers in one collective before it gives up (CollectiveError):
a last resort, far above any emulated program's run; aborts end every wait at once."""

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
class Rendezvous:
    """What the chips of one SPMD submit share: the barriers of its collective steps, the
    chunks in transit (each addressed to a chip), and the first failure.

    `fabric`: the links of the mesh view the submit runs on; `program`: the program's name
    (for messages); `link_bytes_per_second`, `hop_seconds`, `links_per_pair`: the spec's link
    facts (the timing model); `log`: where each completed collective's `CollectiveRecord` goes
    (or None)."""

    def __init__(self, fabric: Fabric, program: str, link_bytes_per_second: float = 12.5e9,
                 hop_seconds: float = 711e-9, log: list[CollectiveRecord] | CollectiveLog | None = None,
                 timeout: float | None = None, links_per_pair: int = 1) -> None:
        self.fabric = fabric
        self.links_per_pair = links_per_pair
        self.program = program
        self.link_bytes_per_second = link_bytes_per_second
        self.hop_seconds = hop_seconds
        self.log = log
        self.timeout = TIMEOUT_SECONDS if timeout is None else timeout
        self._cond = threading.Condition()
        self._records: dict[tuple[int, Coord], CollectiveRecord] = {}  # (step, group's first chip)
        self._mail: dict[tuple[int, Any, Coord], Array] = {}  # (step, tag, to) -> a chunk
        self._failed: tuple[Coord | None, BaseException] | None = None

    def peer(self, coord: Coord) -> Peer:
        """The chip at `coord`'s place in the rendezvous (what its command carries)."""
        return Peer(self, coord)

    def fresh(self) -> Rendezvous:
        """A new rendezvous of the same chips, links and model, with nothing arrived, sent or
        failed: what one execute of a trace gives a submit the trace captured."""
        return Rendezvous(self.fabric, self.program, self.link_bytes_per_second, self.hop_seconds,
                          self.log, self.timeout, self.links_per_pair)

    @property
    def failed(self) -> tuple[Coord | None, BaseException] | None:
        """(chip, error) of the first failure, or None."""
        return self._failed

    def abort(self, chip: Coord | None, error: BaseException) -> None:
        """A chip's command failed (or the mesh is closing): every chip waiting in a collective
        of this submit, now or later, fails with a CollectiveError naming `chip`. The first
        failure is kept; later ones change nothing."""
        with self._cond:
            if self._failed is None:
                self._failed = (chip, error)
                self._mail.clear()
                self._cond.notify_all()

    # -- what the chips call, on their worker threads ------------------------------------------

    def _wait(self, ready: Any, op: str, step: int, me: Coord) -> None:
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

    def _arrive(self, op: str, step: int, group: tuple[Coord, ...], topology: str, me: Coord,
                nbytes: int) -> CollectiveRecord:
        """The barrier of a collective step: returns once every chip of `group` arrived."""
        key = (step, group[0])
        with self._cond:
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
        hops = len(record.group) - 1 if record.topology != "routes" else record.hops
        record.links = self.links_per_pair
        record.modelled_seconds = modelled_seconds(
            record.op, len(record.group), record.nbytes, hops, max(record.link_bytes.values(), default=0),
            self.link_bytes_per_second, self.hop_seconds, self.links_per_pair)
        if self.log is not None:
            self.log.append(record)

    def _send(self, step: int, tag: Any, to: Coord, chunk: Array, nbytes: int, links: Sequence[Link],
              record: CollectiveRecord) -> None:
        """`chunk` across `links`, one hop after another, then into `to`'s mailbox."""
        for link in links:
            chunk = link.carry(chunk, nbytes)
        self._deliver(step, tag, to, chunk, nbytes, links, record)

    def _deliver(self, step: int, tag: Any, to: Coord, chunk: Array, nbytes: int, links: Sequence[Link],
                 record: CollectiveRecord) -> None:
        """A chunk that crossed `links` into `to`'s mailbox, its bytes on the record."""
        with self._cond:
            for link in links:
                pair = (link.source, link.target)
                record.link_bytes[pair] = record.link_bytes.get(pair, 0) + nbytes
            record.hops = max(record.hops, len(links))
            if self._failed is None:
                self._mail[step, tag, to] = chunk
                self._cond.notify_all()

    def _receive(self, op: str, step: int, tag: Any, me: Coord) -> Array:
        key = (step, tag, me)
        with self._cond:
            self._wait(lambda: key in self._mail, op, step, me)
            return self._mail.pop(key)


@final
class Peer:
    """One chip's place in a rendezvous: what its program's collective steps call."""

    __slots__ = ("coord", "rendezvous")

    def __init__(self, rendezvous: Rendezvous, coord: Coord) -> None:
        self.rendezvous = rendezvous
        self.coord = coord

    def abort(self, error: BaseException) -> None:
        """This chip's command failed: its peers must not wait for it."""
        self.rendezvous.abort(self.coord, error)

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

    def __init__(self, r: Rendezvous, step: int, op: str, me: Coord, group: tuple[Coord, ...],
                 path: list[Coord], ring: bool, itemsize: int, dtype: DataType, record: CollectiveRecord) -> None:
        self.r, self.step, self.op, self.me = r, step, op, me
        self.group, self.path, self.ring = group, path, ring
        self.pos = path.index(me)
        self.itemsize, self.dtype, self.record = itemsize, dtype, record

    def at(self, offset: int) -> Coord:
        """The chip `offset` places along the path from this one (around it on a ring)."""
        return self.path[(self.pos + offset) % len(self.path)]

    def send(self, to: Coord, tag: Any, chunk: Array, links: Sequence[Link] | None = None) -> None:
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
    route: dict[Coord, tuple[Link, ...]] = {ex.me: ()}
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


def submit_collective(mesh: MeshDevice, binary: Binary, program_index: int,
                      per_chip: list[list[Tensor]]) -> list[list[Tensor]] | None:
    """An SPMD submit of a program with collectives: one checked single-chip submit per chip
    (the program resolved for the mesh's shape, `_binary.for_mesh`), each chip's command given
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
                            collective_log(mesh), links_per_pair=spec.links_per_pair)
    system.rendezvous.add(rendezvous)
    outputs: list[list[Tensor]] = []
    try:
        for coord, chip, inputs in zip(mesh.coords, mesh._chips, per_chip):
            chip_outputs = _runtime._submit_checked(chip, binary, program_index, inputs, mesh._shape)
            outputs.append(chip_outputs)
            command = chip_outputs[0]._state.last_writer  # the program command just queued
            assert command is not None and command.plan.collectives
            command.peers = rendezvous.peer(coord)
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
        return self.execution.renew(captured.rendezvous).peer(captured.coord)

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
