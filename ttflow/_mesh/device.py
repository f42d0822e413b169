"""MeshDevice: chips plus links, each chip a full `Device`; views of them (submeshes, reshapes).

`open_mesh_device` opens one `Device` per chip (each with its own banks, allocators, CQ0 and
CQ1, eviction and worker threads), all in the caller's event loop, and closes them together.
A `MeshDevice` is a view: a shape and the chips in row-major order over it. The mesh that
`open_mesh_device` yields is the system's own view; `create_submesh` and `reshape` make others
over the same `Device` objects. Chips next to each other in any view are physically linked
(`topology.py`), so a view's neighbours are its links.

State and its owners: the chips (`_System.chips`) are opened and closed here; the per-link
payload counters (`_System.link_bytes`) are written by the collectives (part 2 of issue 26)
and read by `MeshDevice.stats`; a view's shape and order are written by `reshape` only.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, final

import anyio
import attrs

from .._runtime.device import Device, DeviceStatistics, open_device
from .._errors import DeviceClosedError, MeshError, ShapeError
from .._memory.banks import MemoryView
from .._types import MemorySpace
from .spec import Coord, MeshSpec, check_mesh_shape
from .topology import linked_pairs, physical, reshape_order

__all__ = ["MeshDevice", "MeshStatistics", "create_submesh", "open_mesh_device", "release_submesh"]


@final
@attrs.frozen
class MeshStatistics:
    """A snapshot of a mesh's counters.

    `link_bytes`: collective payload bytes sent over each link of the mesh, keyed by
    `(from_coord, to_coord)` (both directions of every linked pair of chips of this view; host
    traffic never counts). `chips`: each chip's `DeviceStatistics`, row-major; `total`: their
    sum, field by field (the peaks summed too: a bound on the mesh's peak, since chips peak at
    different times).
    """

    link_bytes: dict[tuple[Coord, Coord], int]
    chips: tuple[DeviceStatistics, ...]
    total: DeviceStatistics


COLLECTIVE_TIMEOUT = 600.0
"""How long a chip waits for its peers in one collective before it gives up (CollectiveError),
unless its mesh was opened with another `collective_timeout`: a last resort, far above any
emulated program's run; aborts end every wait at once. A constant, never overwritten: a test
that wants a shorter wait opens its mesh with one."""


@final
class _System:
    """What every view of one opened mesh shares: the spec, the chips by id, the link counters."""

    def __init__(self, spec: MeshSpec, chips: Sequence[Device], collective_timeout: float) -> None:
        self.spec = spec
        self.chips = tuple(chips)
        # Seconds a chip waits for its group in one collective (`open_mesh_device`).
        self.collective_timeout = collective_timeout
        self.closed = False
        # (from_id, to_id) -> collective payload bytes; every directed link starts at 0.
        self.link_bytes = dict.fromkeys(linked_pairs(spec, range(len(chips))), 0)
        # The rendezvous of SPMD submits with collectives still running (`collectives.py`):
        # aborted if the mesh closes on an error, so no chip waits for one that will not run.
        self.rendezvous: weakref.WeakSet[Any] = weakref.WeakSet()


@final
class MeshDevice:
    """A mesh of emulated chips. Made by `tt.open_mesh_device`, `tt.create_submesh`.

    `shape` (rows, cols); `chips` (each a `tt.Device`), `device_ids` (ids in the opened
    system, row-major there) and `coords`, all row-major over this mesh's shape. Every runtime
    call takes a mesh where it takes a device (`tt.to_device`, `tt.submit`, `tt.to_host`, ...):
    work on a mesh runs on every chip.
    """

    __slots__ = ("_children", "_chips", "_decided", "_ids", "_parent", "_released", "_root", "_shape", "_system")

    _system: _System
    _shape: Coord
    _ids: tuple[int, ...]
    _chips: tuple[Device, ...]
    _parent: MeshDevice | None
    _children: list[MeshDevice]
    _released: bool
    _root: bool
    _decided: tuple[Any, ...] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("tt.MeshDevice has no public constructor: use tt.open_mesh_device or tt.create_submesh")

    @classmethod
    def _view(cls, system: _System, shape: Coord, ids: Sequence[int], parent: MeshDevice | None) -> MeshDevice:
        mesh = object.__new__(cls)
        mesh._system = system
        mesh._parent = parent
        mesh._children = []
        mesh._released = False
        mesh._root = parent is None
        mesh._set(shape, ids)
        return mesh

    def _set(self, shape: Coord, ids: Sequence[int]) -> None:
        self._shape = shape
        self._ids = tuple(ids)
        self._chips = tuple(self._system.chips[i] for i in self._ids)
        # The SPMD fast path's decided record: the last program's plan on each chip, for these
        # very chips. `_core._dispatch.submit_spmd` is its one writer; a record made under an
        # older plan token (a chip's plans cleared or not kept since) is stale and made again.
        self._decided = None

    # -- what it is -------------------------------------------------------------------------

    @property
    def spec(self) -> MeshSpec:
        """The spec of the system `open_mesh_device` opened (a submesh's too)."""
        return self._system.spec

    @property
    def shape(self) -> Coord:
        return self._shape

    @property
    def num_chips(self) -> int:
        return len(self._ids)

    @property
    def chips(self) -> list[Device]:
        """Each chip's `Device`, row-major over `shape`."""
        return list(self._chips)

    @property
    def worker_pids(self) -> list[int | None]:
        """Each chip's worker process id (`open_mesh_device(workers="process")`), row-major over
        `shape`; None for a chip whose records run on threads."""
        return [chip.worker_pid for chip in self._chips]

    @property
    def device_ids(self) -> list[int]:
        """The chips' ids in the opened system (row-major there), row-major over `shape`."""
        return list(self._ids)

    @property
    def coords(self) -> list[Coord]:
        """Every coordinate of this mesh, row-major."""
        rows, cols = self._shape
        return [(r, c) for r in range(rows) for c in range(cols)]

    def chip(self, coord: Coord) -> Device:
        """The chip at `coord` (row, col)."""
        return self._chips[self._index(coord)]

    def coord_of(self, device: Device) -> Coord:
        """Where `device` sits in this mesh; MeshError if it is not one of its chips."""
        for k, chip in enumerate(self._chips):
            if chip is device:
                return divmod(k, self._shape[1])  # type: ignore[return-value]
        raise MeshError(f"{device!r} is not a chip of {self!r}")

    def neighbours(self, coord: Coord) -> list[Coord]:
        """The coordinates of the chips linked to the chip at `coord`, in row-major order: the
        chips next to it in its row and column, and across the wrap-around where the system's
        topology is a ring (and, after a reshape to a line, the line's ends if they are linked)."""
        here = self._ids[self._index(coord)]
        spec = self._system.spec
        return [c for c, i in zip(self.coords, self._ids)
                if i != here and spec.linked(physical(spec, here), physical(spec, i))]

    def _index(self, coord: Any) -> int:
        try:
            r, c = coord
            r, c = operator.index(r), operator.index(c)
        except (TypeError, ValueError):
            raise TypeError(f"a mesh coordinate is (row, col), got {coord!r:.40}") from None
        rows, cols = self._shape
        if not (0 <= r < rows and 0 <= c < cols):
            raise MeshError(f"coordinate {(r, c)} is outside the {rows}x{cols} mesh")
        return r * cols + c

    @property
    def parent(self) -> MeshDevice | None:
        """The mesh this submesh was cut from (None for the mesh `open_mesh_device` opened)."""
        return self._parent

    @property
    def closed(self) -> bool:
        return self._system.closed

    @property
    def released(self) -> bool:
        return self._released

    def check_open(self) -> None:
        """Raises if the mesh takes no work: released (MeshError) or closed (DeviceClosedError)."""
        if self._released:
            raise MeshError(f"{self!r} was released (tt.release_submesh); use its parent mesh or a new submesh")
        if self._system.closed:
            raise DeviceClosedError("the mesh is closed; open a new one with tt.open_mesh_device()")

    def __repr__(self) -> str:
        rows, cols = self._shape
        status = " released" if self._released else " closed" if self._system.closed else ""
        return f"<ttflow.MeshDevice {rows}x{cols} of {self._system.spec.label}, chips {list(self._ids)}{status}>"

    # -- counters and memory ----------------------------------------------------------------

    @property
    def stats(self) -> MeshStatistics:
        coord = {i: divmod(k, self._shape[1]) for k, i in enumerate(self._ids)}
        links = {(coord[a], coord[b]): n for (a, b), n in self._system.link_bytes.items()
                 if a in coord and b in coord}
        chips = tuple(chip.stats for chip in self._chips)
        total = DeviceStatistics(**{
            field.name: sum(getattr(s, field.name) for s in chips) for field in attrs.fields(DeviceStatistics)
        })
        return MeshStatistics(links, chips, total)  # type: ignore[arg-type]

    @property
    def program_cache_enabled(self) -> bool:
        """`Device.program_cache_enabled` of every chip (False if any chip's is); set, it sets
        every chip's (and the mesh keeps no decided record of a program while it is False)."""
        return all(chip.program_cache_enabled for chip in self._chips)

    @program_cache_enabled.setter
    def program_cache_enabled(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"program_cache_enabled is a bool, got {type(enabled).__name__}")
        for chip in self._chips:  # turning a chip's cache off renews the plan token: the decided record goes stale
            chip.program_cache_enabled = enabled

    def memory_view(self, space: MemorySpace) -> list[MemoryView]:
        """Each chip's `memory_view(space)`, row-major."""
        return [chip.memory_view(space) for chip in self._chips]

    def memory_used(self, space: MemorySpace) -> int:
        """Bytes allocated in `space`, summed over the chips (per chip: `mesh.chips[k]`)."""
        return sum(chip.memory_used(space) for chip in self._chips)

    def memory_free(self, space: MemorySpace) -> int:
        """Free bytes of `space`, summed over the chips."""
        return sum(chip.memory_free(space) for chip in self._chips)

    async def synchronize(self) -> None:
        """Waits until every command queued on every chip so far has completed."""
        for chip in self._chips:
            await chip.synchronize()

    # -- reshaping --------------------------------------------------------------------------

    def reshape(self, shape: tuple[int, int]) -> None:
        """Lays the same chips out as a `shape` mesh, in place (as ttnn's `MeshDevice.reshape`
        and tt-mlir's `reshapeMeshDevice`).

        Allowed when chips next to each other in the new shape are physically linked: to a line
        (1xN or Nx1) the chips go in a zigzag through the mesh (row 0 left to right, row 1 right
        to left, ...; a line stays the line it is); to a grid, the chips' physical block in that
        shape or rotated. Tensors made before keep their shards' order (`t.mesh_shape` says the
        grid they were laid on); a submit pairs shards with chips by chip, not by position.
        ShapeError if the chip count differs; MeshError if no order keeps the links, or while a
        submesh of this mesh is live.
        """
        self.check_open()
        new = check_mesh_shape(shape, "reshape's shape")
        if new[0] * new[1] != len(self._ids):
            raise ShapeError(f"cannot reshape a {self._shape[0]}x{self._shape[1]} mesh "
                             f"({len(self._ids)} chips) to {new[0]}x{new[1]} ({new[0] * new[1]} chips)")
        if any(not child._released for child in self._children):
            raise MeshError("cannot reshape a mesh while submeshes of it are live: release them first "
                            "(tt.release_submesh)")
        order = reshape_order(self._system.spec, self._shape, self._ids, new)
        if order is None:
            raise MeshError(
                f"cannot reshape {self!r} to {new[0]}x{new[1]}: its chips cannot be laid out so with "
                "every pair of neighbours linked (a line goes in a zigzag through the mesh; a grid "
                "takes the chips' physical block in that shape or rotated)"
            )
        self._set(new, order)


@asynccontextmanager
async def open_mesh_device(spec: MeshSpec | tuple[int, int], *, collective_timeout: float = COLLECTIVE_TIMEOUT,
                           **open_device_kwargs: Any) -> AsyncIterator[MeshDevice]:
    """Opens a mesh of emulated chips: one `tt.open_device` per chip, in this event loop.

    `spec`: a `tt.MeshSpec` (a preset, `MeshSpec.n300()`, or any shape) or a (rows, cols)
    shape of default chips. `open_device_kwargs` (`blas_threads`, `eviction`,
    `inline_seconds`, `workers`: "process" gives each chip a worker process) go to every chip.
    On exit every chip drains its queued work (or fails it with DeviceClosedError, if the block
    raised), frees every buffer and closes, as `open_device` does.

    workers="ray": the chips go in Ray actors, `chips_per_worker` chips (default 1) in each
    (row-major: chips 0..n-1 in the first), placed with one Ray placement group of a bundle of
    `ray_cpus` CPUs per actor, `ray_strategy` "PACK" (the default: as few nodes as fit) or
    "SPREAD" (one actor per node while nodes last). Closing kills the actors and removes the
    group.

    `collective_timeout`: seconds a chip waits for its group in one collective before it fails
    with `tt.CollectiveError` (600 s: a last resort; a failing chip aborts its peers at once). A
    setting of this mesh, as `inline_seconds` is of a device, never a process-wide global.
    """
    if (isinstance(collective_timeout, bool) or not isinstance(collective_timeout, (int, float))
            or not math.isfinite(collective_timeout) or collective_timeout <= 0):
        raise ValueError(f"collective_timeout is a positive number of seconds, got {collective_timeout!r}")
    if not isinstance(spec, MeshSpec):
        spec = MeshSpec(spec)
    async with AsyncExitStack() as stack:
        per_chip: list[dict[str, Any]] = [{}] * spec.num_chips
        ray_options = {name: open_device_kwargs.pop(name) for name in ("chips_per_worker", "ray_strategy")
                       if name in open_device_kwargs}
        if open_device_kwargs.get("workers") == "ray":
            per_chip = await _ray_chips(stack, spec, open_device_kwargs, **ray_options)
        elif ray_options:
            raise ValueError(f"{', '.join(ray_options)}: only for workers='ray'")
        chips = [await stack.enter_async_context(open_device(spec.chip, **open_device_kwargs, **per_chip[i]))
                 for i in range(spec.num_chips)]
        for index, chip in enumerate(chips):  # named by a DeviceLostError
            chip._set_chip(divmod(index, spec.shape[1]))
        system = _System(spec, chips, float(collective_timeout))
        mesh = MeshDevice._view(system, spec.shape, range(spec.num_chips), None)
        try:
            yield mesh
        except BaseException as exc:  # an error or a cancellation: no collective waits any more
            closed = DeviceClosedError(f"the mesh closed ({type(exc).__name__}) before this collective completed")
            for rendezvous in list(system.rendezvous):
                rendezvous.abort(None, closed)
            raise
        finally:
            system.closed = True  # the chips close as the stack unwinds, the last first


async def _ray_chips(stack: AsyncExitStack, spec: MeshSpec, kwargs: dict[str, Any], chips_per_worker: int = 1,
                     ray_strategy: str = "PACK") -> list[dict[str, Any]]:
    """Places the mesh's Ray actors (`_workers.ray.RayWorkers`, stopped when `stack` unwinds,
    after the chips closed); each chip's `open_device` argument naming its place."""
    from .._workers.process import WORKER_TIMEOUT
    from .._workers.ray import STRATEGIES, RayWorkers, spaces_of

    if isinstance(chips_per_worker, bool) or not isinstance(chips_per_worker, int) or chips_per_worker < 1:
        raise ValueError(f"chips_per_worker must be a positive int, got {chips_per_worker!r}")
    if ray_strategy not in STRATEGIES:
        raise ValueError(f"ray_strategy must be one of {', '.join(map(repr, STRATEGIES))}, got {ray_strategy!r}")
    workers = RayWorkers([spaces_of(spec.chip)] * spec.num_chips, chips_per_worker, kwargs.get("blas_threads", 1),
                         ray_strategy, kwargs.pop("ray_cpus", 1.0), kwargs.get("worker_timeout", WORKER_TIMEOUT))
    await anyio.to_thread.run_sync(workers.start)
    stack.callback(workers.stop)
    return [{"_ray_chip": chip} for chip in workers.chips]


def create_submesh(mesh: MeshDevice, shape: tuple[int, int], offset: tuple[int, int] = (0, 0)) -> MeshDevice:
    """A `shape` mesh over the chips of `mesh` from `offset` (row, col) on: a view over the same
    `Device` objects (tt-mlir's `createSubMeshDevice`, ttnn's `create_submesh`). Work on the two
    shares the chips' queues and memory. `tt.release_submesh` ends it."""
    if not isinstance(mesh, MeshDevice):
        raise TypeError(f"expected a tt.MeshDevice, got {type(mesh).__name__}")
    mesh.check_open()
    rows, cols = check_mesh_shape(shape, "a submesh's shape")
    try:
        r0, c0 = (operator.index(v) for v in offset)
    except (TypeError, ValueError):
        raise TypeError(f"a submesh's offset is (row, col), got {offset!r:.40}") from None
    parent_rows, parent_cols = mesh.shape
    if r0 < 0 or c0 < 0 or r0 + rows > parent_rows or c0 + cols > parent_cols:
        raise ShapeError(f"a {rows}x{cols} submesh at offset {(r0, c0)} does not fit in the "
                         f"{parent_rows}x{parent_cols} mesh")
    ids = [mesh._ids[(r0 + r) * parent_cols + c0 + c] for r in range(rows) for c in range(cols)]
    sub = MeshDevice._view(mesh._system, (rows, cols), ids, mesh)
    mesh._children = [child for child in mesh._children if not child._released] + [sub]
    return sub


def release_submesh(submesh: MeshDevice) -> None:
    """Ends a submesh (tt-mlir's `releaseSubMeshDevice`): it, and the submeshes cut from it,
    refuse work from now on (MeshError). Its chips and their tensors are untouched; idempotent."""
    if not isinstance(submesh, MeshDevice):
        raise TypeError(f"expected a tt.MeshDevice, got {type(submesh).__name__}")
    if submesh._root:
        raise MeshError("this is the mesh tt.open_mesh_device opened; it closes when its `async with` block ends")
    pending = [submesh]
    while pending:
        mesh = pending.pop()
        mesh._released = True
        pending += mesh._children
