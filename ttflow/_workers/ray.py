"""Chips in Ray actors (`open_device(workers="ray")`, `open_mesh_device(..., workers="ray")`).

A Ray actor (`ChipActor`) holds a group of chips: each chip's bank memory (`np.zeros`, whose
pages the OS commits as they are touched), an `_workers.child.Executor` per chip and queue (the
plans that queue defined, as a worker process keeps them) and, per chip, a collectives
`_workers.endpoint.Endpoint` listening on TCP (the node's address), so that a chunk for a chip in another
actor, on this host or another, goes straight to that chip's actor. The actor may be on
another host: its memory never is in the host process, and nothing here reads or writes it
except by a call to the actor.

The host side of a chip is a `RayChip` (what `Device` holds where a worker process's
`WorkerProcess` would be: pid, endpoint address, chip coordinate, loss) and two
`RayQueueWorker`s, `_workers.process.ProcessQueueWorker`s whose batches (up to 8 records, in wire
form) each cross as one actor call (`ChipActor.handle`, one `ray.get`), instead of a socket
message. The device's own banks are `_memory.RemoteBanks`, which refuse every access, and its
`inline_seconds` is -1, so that no record runs in the host. What cannot travel is refused
before it is queued (`tt.submit` of a program with host ops, `tt.debug_hooks` on a Ray chip:
`RemoteMemoryError`); a record that still cannot (`_why_not`) fails the same way, never runs on a
stand-in.

`RayWorkers` places the actors: one per group of `chips_per_worker` chips, in one Ray
placement group (a bundle per actor, `strategy` "PACK" or "SPREAD"), and closing kills them and
removes the group. A call that fails because its actor died (`RayActorError`, or no reply
within `worker_timeout`) marks every chip of that actor lost: their pending and later work
fails with `DeviceLostError` naming the chip; other actors' chips go on.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._commands import Compute, run, run_all
from .._errors import DeviceLostError, ShapeError, TTFlowError
from .._memory.banks import RemoteMemoryError
from .child import Executor, _timed
from .endpoint import Endpoint
from .process import ProcessQueueWorker, _landed
from .thread import _call_soon_threadsafe

__all__ = ["ChipActor", "RayChip", "RayQueueWorker", "RayWorkers", "STRATEGIES", "require_ray", "spaces_of"]

STRATEGIES = ("PACK", "SPREAD")
"""Placement group strategies a Ray mesh may ask for (`open_mesh_device(ray_strategy=...)`)."""

_READY_SECONDS = 120.0
"""How long the host waits for the placement group and the actors to be up."""


def spaces_of(spec: Any) -> list[tuple[str, int, int]]:
    """A chip's memory spaces as its actor makes them: (space name, banks, bank bytes)."""
    from .._types import MemorySpace

    return [(space.name, spec.banks(space), spec.bank_bytes(space)) for space in MemorySpace]


def require_ray() -> Any:
    """The `ray` module, once `ray.init()` was called; a typed error otherwise."""
    try:
        import ray
    except ImportError:
        raise TTFlowError('workers="ray" needs Ray: pip install ".[ray]" from the ttflow checkout') from None
    if not ray.is_initialized():
        raise TTFlowError('workers="ray" places chips on the Ray cluster this process joined: call '
                          "ray.init() first (ray.init(address=...) for a cluster, ray.init() for a local "
                          "instance)")
    return ray


# -- the actor ---------------------------------------------------------------------------------


class ChipActor:
    """One group of chips in a Ray actor (see the module). `chips`: each chip's memory spaces,
    `(space name, banks, bank bytes)`. Runs as a threaded actor: each queue's call, and a
    collective's chips waiting for each other, run at once."""

    def __init__(self, chips: Sequence[Sequence[tuple[str, int, int]]], blas_threads: int | None) -> None:
        from .._blas import limit_blas_threads
        from .._types import MemorySpace
        from .heap import keep_freed_heap

        keep_freed_heap()  # the actor's process is its own, as a worker process is
        if blas_threads is not None:
            self._blas = limit_blas_threads(blas_threads)
            self._blas.__enter__()  # for the actor's life
        self.banks = [{MemorySpace[name]: np.zeros((banks, bank_bytes), np.uint8)
                       for name, banks, bank_bytes in spaces} for spaces in chips]
        try:
            import ray

            host = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - outside Ray (a test): loopback
            host = "127.0.0.1"
        # An endpoint per chip, not one per actor: an endpoint retires a rendezvous (dropping its
        # mail) when its last running record there finishes, so a chip of this actor whose
        # record has not started yet would lose the chunks other actors already sent it. Chips
        # of one actor reach each other over loopback instead.
        self.endpoints = [_tcp_endpoint(host) for _ in chips]
        self._executors: dict[tuple[int, int], Executor] = {}
        self._lock = threading.Lock()

    def ready(self) -> tuple[int, list[Any]]:
        """This actor's pid and each chip's endpoint address."""
        return os.getpid(), [endpoint.address for endpoint in self.endpoints]

    def handle(self, chip: int, queue: int, message: list[tuple[Any, ...]]) -> list[Any]:
        """One batch of a chip's queue (`_workers.child.Executor.handle`, timed as a worker
        process times it)."""
        key = (chip, queue)
        executor = self._executors.get(key)
        if executor is None:
            with self._lock:
                executor = self._executors.setdefault(key, Executor(self.banks[chip], self.endpoints[chip]))
        return _timed(executor, message)

    def read_bank(self, chip: int, space: str, bank: int, address: int, nbytes: int) -> bytes:
        from .._types import MemorySpace

        return self.banks[chip][MemorySpace[space]][bank, address:address + nbytes].tobytes()

    def ping(self) -> float:
        return time.perf_counter()


def _tcp_endpoint(host: str) -> Endpoint:
    """A chip's collectives endpoint listening on TCP at `host` (any free port), started."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((host, 0))
        listener.listen(64)
    except BaseException:
        listener.close()
        raise
    endpoint = Endpoint(listener)
    threading.Thread(target=endpoint._accept, name="ttflow-endpoint", daemon=True).start()
    return endpoint


# -- the host's side ---------------------------------------------------------------------------


class _Group:
    """One actor as the host holds it: its handle, pid, chips' addresses, and whether it is lost."""

    def __init__(self, index: int, chips: list[RayChip]) -> None:
        self.index = index
        self.chips = chips
        self.actor: Any = None
        self.pid: int | None = None
        self.addresses: list[Any] = []
        self.lost: str | None = None
        self._lock = threading.Lock()

    def mark_lost(self, why: str) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = why
        for chip in self.chips:
            chip._tell_lost()


class RayWorkers:
    """The actors of one device or mesh (see the module): `start` places them (blocking: call
    it off the event loop), `chips[i]` is chip i's `RayChip`, `stop` kills them and removes the
    placement group."""

    def __init__(self, spaces: list[list[tuple[str, int, int]]], chips_per_worker: int = 1,
                 blas_threads: int | None = 1, strategy: str = "PACK", cpus: float = 1.0,
                 timeout: float | None = None) -> None:
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 < cpus < float("inf"):
            raise ValueError(f"ray_cpus must be a positive number of CPUs, got {cpus!r}")
        self._ray = require_ray()
        self._spaces = spaces
        self.timeout = timeout
        self._blas = blas_threads
        self.strategy = strategy
        self.cpus = cpus
        self.chips = [RayChip(self, i) for i in range(len(spaces))]
        self.groups = [_Group(g, self.chips[start:start + chips_per_worker])
                       for g, start in enumerate(range(0, len(spaces), chips_per_worker))]
        for group in self.groups:
            for slot, chip in enumerate(group.chips):
                chip.group, chip.slot = group, slot
        self.placement: Any = None
        self.calls = 0  # actor calls made (tests, benchmarks)

    def start(self) -> None:
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = self.placement = ray.util.placement_group([{"CPU": self.cpus}] * len(self.groups),
                                                       strategy=self.strategy)
        try:
            ready, _ = ray.wait([pg.ready()], timeout=_READY_SECONDS)
            if not ready:
                raise TTFlowError(
                    f"the Ray cluster could not place {len(self.groups)} chip workers of {self.cpus:g} CPU each "
                    f"({self.strategy}) within {_READY_SECONDS:g} s: give it more CPUs, or put more chips in "
                    "each worker (chips_per_worker=) or ask less (ray_cpus=)")
            actor_class = ray.remote(ChipActor)
            for group in self.groups:
                group.actor = actor_class.options(
                    num_cpus=self.cpus, max_concurrency=4 * len(group.chips) + 4,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=group.index),
                ).remote([self._spaces[chip.index] for chip in group.chips], self._blas)
            answers = ray.get([group.actor.ready.remote() for group in self.groups], timeout=_READY_SECONDS)
            for group, (pid, addresses) in zip(self.groups, answers):
                group.pid, group.addresses = pid, addresses
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Kills the actors and removes the placement group (idempotent)."""
        ray = self._ray
        for group in self.groups:
            actor, group.actor = group.actor, None
            if actor is not None:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - gone already
                    pass
        pg, self.placement = self.placement, None
        if pg is not None:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - gone already
                pass

    def call(self, group: _Group, method: str, *args: Any) -> Any:
        """One call to `group`'s actor, waited for (on a worker thread, never the event loop's):
        its answer, or the actor marked lost and DeviceLostError raised."""
        ray = self._ray
        actor = group.actor
        if group.lost is None and actor is not None:
            self.calls += 1
            try:
                return ray.get(getattr(actor, method).remote(*args), timeout=self.timeout)
            except ray.exceptions.GetTimeoutError:
                group.mark_lost(f"no answer within worker_timeout={self.timeout:g} s; killed")
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
            except ray.exceptions.RayError as exc:
                group.mark_lost(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        raise DeviceLostError("", None)  # replaced by the caller (it knows the chip)


class RayChip:
    """One chip's place in a Ray actor, as its `Device` sees it (where a worker process's
    `WorkerProcess` would be: `pid`, `address`, `chip`, `lost`, `error`, `start`, `stop`)."""

    connections = (None, None)  # what `ProcessQueueWorker.__init__` looks up (unused here)

    def __init__(self, workers: RayWorkers, index: int) -> None:
        self.workers = workers
        self.index = index
        self.group: _Group
        self.slot = 0
        self.chip: tuple[int, int] | None = None
        self._on_lost: Callable[[DeviceLostError], None] | None = None
        self._call_soon: Callable[[Callable[[], None]], Any] | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        """The actor's process id (on its node)."""
        return self.group.pid

    @property
    def address(self) -> Any:
        """The chip's collectives endpoint, (host, port)."""
        addresses = self.group.addresses
        return addresses[self.slot] if addresses else None

    @property
    def lost(self) -> str | None:
        return self.group.lost

    def start(self, on_lost: Callable[[DeviceLostError], None]) -> None:
        """On the event loop's thread: `on_lost(error)` is called there if the actor dies."""
        self._on_lost = on_lost
        self._call_soon = _call_soon_threadsafe()

    def _tell_lost(self) -> None:
        call_soon, on_lost = self._call_soon, self._on_lost
        if call_soon is not None and on_lost is not None and not self._stopping:
            error = self.error()
            try:
                call_soon(lambda: on_lost(error))
            except Exception:  # noqa: BLE001 - the loop is gone: nobody is left to tell
                pass

    def mark_lost(self, why: str) -> None:
        self.group.mark_lost(why)

    def connection_closed(self) -> None:
        self.group.mark_lost("its actor call failed")

    def error(self) -> DeviceLostError:
        where = "the device" if self.chip is None else f"chip {self.chip}"
        return DeviceLostError(
            f"the Ray actor of {where} (worker {self.group.index}, pid {self.pid}) is gone "
            f"({self.lost or 'call failed'}): its work is lost; close the device and open a new one", self.chip)

    def call(self, method: str, *args: Any) -> Any:
        try:
            return self.workers.call(self.group, method, self.slot, *args)
        except DeviceLostError:
            raise self.error() from None

    def read_bank(self, space: str, num_banks: int, bank_bytes: int, bank: int, address: int, nbytes: int) -> bytes:
        if not 0 <= bank < num_banks:
            raise ShapeError(f"bank {bank} does not exist: there are {num_banks} banks")
        if nbytes < 0 or address < 0 or address + nbytes > bank_bytes:
            raise ShapeError(f"bytes [{address}, {address + nbytes}) are outside the bank's {bank_bytes} bytes")
        return self.call("read_bank", space, bank, address, nbytes)  # type: ignore[no-any-return]

    def stop(self) -> None:
        """The chip's queues have stopped; its actor goes with its `RayWorkers`."""
        self._stopping = True


def _why_not(records: Sequence[Any]) -> str:
    """Why a record cannot travel to its actor (`_workers.wire.encode` gave None)."""
    for record in records:
        for step in record.steps:
            if type(step) is Compute:
                if step.hooks is not None:
                    return ("it runs under debug hooks, which read and write the chip's memory from the host "
                            "between ops, and a Ray chip's memory is in its actor")
                if step.plan.host_ops:
                    return ("its program has host ops, Python functions of this process that do not travel "
                            "to the chip's actor")
                if step.peers is not None and step.peers.wire() is None:
                    return "its collectives meet in this process, and their chips are in Ray actors"
    return "its plan does not pickle"


class RayQueueWorker(ProcessQueueWorker):
    """A queue's worker whose batches run in the chip's Ray actor, one actor call per batch
    (`ProcessQueueWorker`'s batching; see the module). A record that cannot travel fails with
    `RemoteMemoryError`; host work that needs no bank (a write's conversion ahead) runs here."""

    transfers_here = False  # the banks are the actor's

    def __init__(self, name: str, chip: RayChip, index: int) -> None:
        super().__init__(name, chip, index)  # type: ignore[arg-type]
        self._chip = chip
        self._queue_index = index

    def _local(self, function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, BaseException | None]:
        if self._chip.lost is not None and (function is run or function is run_all):
            return self._lost(function, args)
        if function is run or function is run_all:
            records = args[0] if function is run_all else [args[0]]
            error = RemoteMemoryError(f'a record cannot run on this workers="ray" device: {_why_not(records)}')
            if function is run_all:
                return [error for _ in records], None
            return None, error
        return super()._local(function, args)

    def _exchange(self, batch: list[Any]) -> list[tuple[Any, BaseException | None]]:
        chip = self._chip
        if chip.lost is None:
            try:
                replies: list[Any] = chip.call("handle", self._queue_index, [job[3] for job in batch])
            except DeviceLostError:
                pass
            else:
                self.sent_messages += 1
                self.sent_jobs += len(batch)
                self._take_times(batch, replies)
                return [reply if len(reply) == 2 else _landed(job, reply) for job, reply in zip(batch, replies)]
        return [self._lost(job[1], job[2]) for job in batch]
