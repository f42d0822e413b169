"""Records as messages: the wire form in which a decided record travels to a worker process.

A record names storages, and a `Storage` is a C record of the host's scheduler (with its
flights and cached views) that must not travel. What `run` needs of one is its geometry, so a
storage travels as the tuple

    (layout, address, page_size, aligned_page_size, num_pages, dims3)

and a step as a tuple tagged by its kind:

    (STORE, storage, array, staged)         a host array (or None: zeros) into a storage
    (LOAD, storage, shape)                  a storage's value back to the host (the reply)
    (COPY, source, target, shape)
    (SLIDE, space, source, target, depth)
    (COMPUTE, plan id, sources, outputs, scratch items, pagewise, kernel, peer)

A worker process gets no writes or reads: they run in the host, on the shared banks
(`_workers.process.ProcessQueueWorker.transfers_here`). A Ray actor does, and their arrays cross
pickled, in Ray's object store (the actor may be on another host).

A record is `(steps, timed)`. A `Plan` (the program's values and steps, what `Plan.__init__`
derived from them) travels once per program and connection, as its fields (`plan_state`: the
ops by name, not their functions), and the
worker keeps it under the id its `Compute` steps name (`PlanIds`); the host keeps the plan alive
while the id is in use, so an id never names two plans, and tells the worker which ids to forget
once it drops them.

A `Compute` that exchanges values with other chips carries its `peer`, the wire form of its
`_peers.Peer` (`Peer.wire`: the rendezvous's key, the chip's coordinate and what the worker needs
to meet the others: the program's name, the timeout, the fabric's facts, each chip's endpoint
address, the first failure so far), None otherwise; the worker makes it its own `Peer`
(`decode`'s `peer`, `_workers.endpoint.Endpoint.peer`).

Not every record can travel: a `Compute` whose rendezvous does not travel (`Peer.wire` gives
None: a chip without a worker process, or a rendezvous whose first chip ran in the host), runs
under debug hooks (`hooks`) or calls host functions (`Plan.host_ops`) stays in the host process
(`encode` returns None), as does a plan whose fields do not pickle.
"""

from __future__ import annotations

import collections
import pickle
from collections.abc import Callable
from typing import Any

from .._commands import Compute, Copy, Load, Plan, Record, Slide, Store, _Schedule, page_ops_of
from .._memory.banks import Storage
from .._ir.ops import OPS

__all__ = ["STORE", "LOAD", "COPY", "SLIDE", "COMPUTE", "RUN", "RUN_ALL", "PlanIds", "encode", "decode",
           "plan_state", "plan_from_state", "send_message", "recv_message"]

STORE, LOAD, COPY, SLIDE, COMPUTE = range(5)

RUN, RUN_ALL = 0, 1
"""The jobs a message carries: one record run (its result), or a batch of them (`run_all`)."""

_PLAN_FIELDS = tuple(name for name in Plan.__slots__ if name not in ("bound", "compute", "page_ops", "schedule", "_built"))
"""What travels of a plan: all but the device's precomputed geometry (`bound`, for the host's
fast decision only) and the ops' functions and page kernels (closures, which do not pickle): the worker takes
those from its own `_ir.ops.OPS` by the steps' op names, and schedules the plan again."""

_PLANS_KEPT = 256
"""Plans a connection keeps ids for (their plans kept alive on the host) before the oldest goes."""


def plan_state(plan: Plan) -> tuple[Any, ...]:
    """The fields of `plan` that a worker's copy needs, in `_PLAN_FIELDS` order."""
    return tuple(getattr(plan, name) for name in _PLAN_FIELDS)


def plan_from_state(state: tuple[Any, ...]) -> Plan:
    """A plan rebuilt in the worker from `plan_state`'s fields (immutable as any plan)."""
    plan = Plan.__new__(Plan)
    init = object.__setattr__
    for name, value in zip(_PLAN_FIELDS, state):
        init(plan, name, value)
    init(plan, "bound", None)
    # As `Plan.__init__` takes them (a plan that travels has no host op).
    init(plan, "compute", [OPS[step.op].fn for step in plan.steps])
    init(plan, "page_ops", page_ops_of(plan.steps, plan.pagewise))
    init(plan, "schedule", _Schedule(plan))
    init(plan, "_built", True)
    return plan


class PlanIds:
    """The ids of the plans one connection's worker holds (host side, one per connection).

    `ref(plan)` gives a plan's id, with its definition queued for the next message the first time
    (None when the plan cannot travel); `take()` gives and clears the definitions and the ids to
    forget, for the message that goes now."""

    def __init__(self) -> None:
        self._ids: collections.OrderedDict[int, tuple[Plan, int]] = collections.OrderedDict()
        self._refused: dict[int, Plan] = {}  # plans that cannot travel (kept, so ids stay unique)
        self._next = 0
        self._defs: list[tuple[int, bytes]] = []
        self._forget: list[int] = []

    def ref(self, plan: Plan) -> int | None:
        key = id(plan)
        entry = self._ids.get(key)
        if entry is not None:
            self._ids.move_to_end(key)
            return entry[1]
        if key in self._refused:
            return None
        try:
            # Pickled now: a plan whose functions do not pickle by reference stays in-process.
            state = pickle.dumps(plan_state(plan), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            if len(self._refused) >= _PLANS_KEPT:
                self._refused.clear()
            self._refused[key] = plan
            return None
        number = self._next
        self._next += 1
        self._ids[key] = (plan, number)
        self._defs.append((number, state))
        if len(self._ids) > _PLANS_KEPT:
            _, (_, old) = self._ids.popitem(last=False)
            self._forget.append(old)
        return number

    def take(self) -> tuple[list[tuple[int, bytes]], list[int]]:
        defs, forget = self._defs, self._forget
        if defs:
            self._defs = []
        if forget:
            self._forget = []
        return defs, forget


def _storage(s: Storage) -> tuple[Any, ...]:
    return (s.layout, s.address, s.page_size, s.aligned_page_size, s.num_pages, s.dims3)


def encode(record: Record, plans: PlanIds) -> tuple[Any, ...] | None:
    """`record` in wire form, or None when it must run in the host process (see the module)."""
    steps: list[tuple[Any, ...]] = []
    for step in record.steps:
        kind = type(step)
        if kind is Compute:
            compute: Compute = step  # type: ignore[assignment]
            if compute.hooks is not None or compute.plan.host_ops:
                return None
            peer = None
            if compute.peers is not None:
                peer = compute.peers.wire()
                if peer is None:
                    return None
            number = plans.ref(compute.plan)
            if number is None:
                return None
            steps.append((COMPUTE, number, tuple([_storage(s) for s in compute.sources]),
                          tuple([_storage(s) for s in compute.outputs]),
                          tuple([(k, _storage(s)) for k, s in compute.scratch.items()]),
                          compute.pagewise, compute.kernel, peer))
        elif kind is Store:
            store: Store = step  # type: ignore[assignment]
            steps.append((STORE, _storage(store.dst), store.array, store.staged))
        elif kind is Load:
            load: Load = step  # type: ignore[assignment]
            steps.append((LOAD, _storage(load.src), load.shape))
        elif kind is Copy:
            copy: Copy = step  # type: ignore[assignment]
            steps.append((COPY, _storage(copy.src), _storage(copy.dst), copy.shape))
        elif kind is Slide:
            slide: Slide = step  # type: ignore[assignment]
            steps.append((SLIDE, slide.space, slide.source, slide.target, slide.depth))
        else:
            return None
    return tuple(steps), record.timed


def send_message(connection: Any, message: Any) -> None:
    """Sends a message (a batch of records, or their replies) on a worker's connection.

    Not `Connection.send`: multiprocessing's pickler copies its table of reducers for every
    message (3 us a batch of one record here, against 0.5 us for `pickle.dumps`), and nothing on
    the wire needs its reducers. A message that does not pickle raises before anything is sent.
    """
    connection.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))


def recv_message(connection: Any) -> Any:
    """The next message `send_message` sent on the other end of `connection`."""
    return pickle.loads(connection.recv_bytes())


def _decode_storage(wire: tuple[Any, ...]) -> Storage:
    return Storage(*wire)


def decode(wire: tuple[Any, ...], plans: dict[int, Plan],
           peer: Callable[[tuple[Any, ...]], Any] | None = None) -> Record:
    """The record a worker runs, from its wire form (`plans`: the worker's plans by id; `peer`:
    what makes a travelling peer this worker's, `_workers.endpoint.Endpoint.peer`)."""
    wire_steps, timed = wire
    steps: list[Any] = []
    for step in wire_steps:
        kind = step[0]
        if kind == COMPUTE:
            _, number, sources, outputs, scratch, pagewise, kernel, wire_peer = step
            peers = None
            if wire_peer is not None:
                if peer is None:
                    raise ValueError("a record with collectives reached a worker without an endpoint")
                peers = peer(wire_peer)
            steps.append(Compute(plans[number], tuple([_decode_storage(s) for s in sources]),
                                 tuple([_decode_storage(s) for s in outputs]),
                                 {k: _decode_storage(s) for k, s in scratch}, pagewise, kernel, peers))
        elif kind == STORE:
            steps.append(Store(_decode_storage(step[1]), step[2], step[3]))
        elif kind == LOAD:
            steps.append(Load(_decode_storage(step[1]), step[2]))
        elif kind == COPY:
            steps.append(Copy(_decode_storage(step[1]), _decode_storage(step[2]), step[3]))
        elif kind == SLIDE:
            steps.append(Slide(*step[1:]))
        else:
            raise ValueError(f"unknown step kind {kind!r} on the wire")
    return Record(tuple(steps), timed=timed)
