"""`MeshStateMachine`: a mesh of chips driven by hypothesis, against a numpy model of every shard.

What `RuntimeStateMachine` does for one device (work kept in flight between rules, every handle
kept, exact accounting whenever the device is idle), this machine does for a mesh (issue 26):

- Work stays queued between rules. The mesh is opened with `inline_seconds=-1` (every command on
  a worker thread) and every chip's two queue workers are paused (`QueueHold`, one per chip):
  each command stops after its bookkeeping, so submits, deallocations, conversions and reads
  are made against queued programs and queued collectives; `run_one_chip` lets one chip run
  alone (its collectives then wait in the rendezvous for held peers). A rule that awaits lets
  every chip go, awaits with a timeout (a hang is a test failure, never a stuck CI; the
  machine's mesh is opened with `collective_timeout=rendezvous_timeout`, so even a hung chip's thread ends), drains every chip and holds them again. `call`
  boxes results: anyio's `BlockingPortal.call` would await a `Tensor`/`MeshTensor` result.
- Every handle is kept: each chip has its own `DeviceModel` of its shards (a shard `from_shards`
  takes as it is stays one entry), so memory checks per chip reuse the single-device ones
  (`DeviceModel.check_bounds`, `check_drained`, `_check_memory_views`), and whenever the mesh is
  idle each chip's memory equals its live shards' storages to the byte and every live shard
  reads back as the model says.
- The model is independent of `ttflow._mesh`: mappers split with numpy; collectives give each
  chip its result from the documented order (docs/mesh.md "Collectives": mesh-coordinate
  order; sums in the documented order, rounded to the dtype at every step, so bit for bit;
  integers wrap); paths, rings, routes and trees are recomputed from `MeshSpec.linked`, and the
  payload bytes each directed link carries from the closed forms of "Bytes per link". At every
  idle point `mesh.stats.link_bytes` must have moved by exactly the formulas of the submits
  whose groups all completed (a group a failure cut short: at most its formula).
- Faults: a collective whose peer fails (a range-checked addition overflowing on one chip, or
  an input that ran out of L1 on one chip) must fail that chip with its own error and every
  chip of its group with `tt.CollectiveError` naming it; chips of other groups either complete
  or fail typed. Per-chip L1 outputs too large fail with OutOfMemoryError on every chip.
- Submeshes: `create_submesh`, work on them (collectives too: the link counters are the
  system's), `release_submesh`, after which the submesh and its tensors refuse work with
  `tt.MeshError` (deallocation is still allowed).

Bugs planted by monkeypatching, each run the ci profile's 40 examples of 50 steps without
shrinking, seeds 1-4, on the asyncio 2x2 line and the trio 1x3 ring (with the C SPMD path off,
so the planted Python path runs; `failing example` messages quoted):

- a collective that returns results in path order instead of mesh-coordinate order (all_gather
  joining its parts along the path): 4 of 4 asyncio runs ("all_gather(m24, {'dim': 0,
  'cluster_axis': None})[0]: 576 of 1152 elements are off": the 2x2's path zigzags 0 1 3 2,
  and half the fresh collective inputs have shards that differ on every chip); 0 of 4 trio
  runs, by construction: every group of a 1x3 mesh is a row, whose path is its mesh order;
- an all_reduce whose partial skips one chip's term (the last path position's terms zero):
  8 of 8 runs (int32 exactly, floats outside the documented order's value);
- a Link that counts one hop too few (the first hop of a multi-hop route not counted): 4 of 4
  asyncio runs ("link chip 0 -> chip 1 carried 288 bytes; the formulas say 432": a
  point_to_point or all_to_all across the 2x2's diagonal); 0 of 4 trio runs, by construction
  (the three chips of a 1x3 ring are all neighbours: every route is one hop);
- a rendezvous abort that does not wake waiting peers (no `notify_all`): 8 of 8 runs, each a
  typed test failure ("drain did not complete within 5.0 s: a hang"), never a stuck run: the
  machine's await timeout, then the lowered rendezvous timeout frees the chips' threads;
- an SPMD submit that checks liveness only of chip 0's shard: 8 of 8 runs ("a refused submit
  queued work: [0, 0, 0] -> [1, 0, 0]"). The C SPMD path, uncommitted, had this bug on
  2026-11-26: `deallocate_shard` found it ("submit did not raise DeallocatedTensorError", 5
  of 7 seeds) before b81eeb8 landed; tests/test_mesh_machine.py keeps a regression test.

Found by the machine, documented rather than a bug: a failure on a chip of one cluster_axis
group aborts the whole submit, so a group that is mid-exchange can split, one chip holding
its (correct) result while its peer, still waiting for a chunk, fails with CollectiveError.
The model allows it (a CollectiveError is certain only on the failing chip's own group).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar

import attrs
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from .._runtime import calls as _runtime
from .._ir.binary import Binary, for_mesh
from .._runtime.device import Device
from .._errors import (
    CollectiveError,
    DeallocatedTensorError,
    MeshError,
    OutOfMemoryError,
    ProgramError,
    TTFlowError,
)
from .._mesh import api as mesh_api
from .._mesh.device import MeshDevice, create_submesh, open_mesh_device, release_submesh
from .._mesh.placement import concat, concat_2d, replicate, shard, shard_2d
from .._mesh.spec import MeshSpec
from .._mesh.tensor import MeshTensor, device_tensors
from .._mesh.transfer import from_shards
from .._ir.builder import ProgramBuilder
from .._runtime.tensor import Tensor
from .._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout
from ._machine_base import _check_memory_views
from ._machine_loop import LoopHarness
from ._model import DeviceModel, ModelTensor, QueueHold
from ._reference import ExpectedValue, ordered_sums, round_as, storage_geometry, stored
from ._strategies import arrays

__all__ = ["MeshStateMachine"]

T = TypeVar("T")
Array = np.ndarray[Any, Any]
Coord = tuple[int, int]
Pair = tuple[int, int]  # (from chip id, to chip id)

F32, BF16, BF8, I32 = DataType.FLOAT32, DataType.BFLOAT16, DataType.BFLOAT8_B, DataType.INT32
DRAM, L1 = MemorySpace.DRAM, MemorySpace.L1
TILE, RM = TensorLayout.TILE, TensorLayout.ROW_MAJOR
DTYPES = (F32, BF16, BF8, I32)
OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "point_to_point", "all_to_all")

SHARD = (12, 24)
"""The shard shape of most tensors: divisible by every group size of the meshes used (1-4)."""
MED = (96, 320)
"""L1 pressure: a FLOAT32 TILE shard takes 32 KiB of a small chip's 64 KiB L1 bank."""
BIG = (128, 640)
"""Too large for L1: a FLOAT32 shard takes 80 KiB per bank (OutOfMemoryError)."""


# -- the independent reference: groups, paths, routes, link bytes, results ------------------------


def _grid(shape: Coord) -> list[Coord]:
    return [(r, c) for r in range(shape[0]) for c in range(shape[1])]


def _groups(shape: Coord, axis: int | None) -> list[list[Coord]]:
    """The groups of `cluster_axis=axis`, each in mesh-coordinate order."""
    if axis is None:
        return [_grid(shape)]
    return [[c for c in _grid(shape) if c[1 - axis] == k] for k in range(shape[1 - axis])]


@attrs.frozen
class _View:
    """A mesh view's facts, for the reference: shape, chip id per coordinate, links."""

    spec: MeshSpec
    shape: Coord
    ids: tuple[int, ...]

    def id(self, c: Coord) -> int:
        return self.ids[c[0] * self.shape[1] + c[1]]

    def linked(self, a: Coord, b: Coord) -> bool:
        cols = self.spec.shape[1]
        return bool(self.spec.linked(divmod(self.id(a), cols), divmod(self.id(b), cols)))  # type: ignore[arg-type]

    def chain(self, group: list[Coord]) -> tuple[list[Coord], bool]:
        """The group as a path of linked chips (a zigzag over a 2-D group), and whether it closes."""
        rows = sorted({r for r, _ in group})
        if len(rows) > 1 and len({c for _, c in group}) > 1:
            path = [c for k, r in enumerate(rows)
                    for c in sorted(g for g in group if g[0] == r)[:: 1 if k % 2 == 0 else -1]]
        else:
            path = list(group)
        return path, len(path) > 2 and self.linked(path[-1], path[0])

    def parents(self, root: Coord) -> dict[Coord, Coord]:
        """The breadth-first tree from root, each chip's neighbours in row-major order."""
        parent, todo = {root: root}, [root]
        while todo:
            here = todo.pop(0)
            for there in _grid(self.shape):
                if there not in parent and there != here and self.linked(here, there):
                    parent[there] = here
                    todo.append(there)
        return parent

    def route(self, a: Coord, b: Coord) -> list[tuple[Coord, Coord]]:
        parent, hops = self.parents(a), []
        while b != a:
            hops.append((parent[b], b))
            b = parent[b]
        return hops[::-1]


def _ordered_sums(path: list[Coord], ring: bool, terms: dict[Coord, dict[Coord, Array]],
                  dtype: DataType) -> dict[Coord, Array]:
    """`ordered_sums` (the one copy of the documented order), each partial rounded to `dtype`."""
    def add(a: Array, b: Array) -> Array:
        if dtype.is_float:
            return round_as(a.astype(np.float32) + b.astype(np.float32), dtype)
        return round_as(a.astype(np.int64) + b.astype(np.int64), dtype)

    return ordered_sums(path, ring, terms, add)


def collective_results(view: _View, op: str, attrs_: dict[str, Any], xs: dict[Coord, Array],
                       dtype: DataType) -> dict[Coord, Array]:
    """Each chip's result of one collective step (docs/mesh.md, "Groups, order and shapes")."""
    out: dict[Coord, Array] = {}
    if op in ("broadcast", "point_to_point"):
        sender = tuple(attrs_["sender"])
        receiver = tuple(attrs_.get("receiver", sender))
        for c in _grid(view.shape):
            out[c] = xs[sender] if op == "broadcast" or c == receiver else xs[c]  # type: ignore[index]
        return out
    for group in _groups(view.shape, attrs_.get("cluster_axis")):
        n = len(group)
        if op == "all_gather":
            for c in group:
                out[c] = np.concatenate([xs[m] for m in group], axis=attrs_["dim"])
        elif op == "all_to_all":
            split, cat = attrs_["split_dim"], attrs_["concat_dim"]
            for k, c in enumerate(group):
                out[c] = np.concatenate([np.split(xs[m], n, axis=split)[k] for m in group], axis=cat)
        elif op == "reduce_scatter":
            if n == 1:
                out[group[0]] = xs[group[0]]
                continue
            path, ring = view.chain(group)
            terms = {c: dict(zip(group, np.split(xs[c], n, axis=attrs_["dim"]))) for c in group}
            out.update(_ordered_sums(path, ring, terms, dtype))
        else:
            assert op == "all_reduce"
            if n == 1:
                out[group[0]] = xs[group[0]]
                continue
            path, ring = view.chain(group)
            shape = xs[group[0]].shape
            terms = {c: dict(zip(path, np.array_split(xs[c].reshape(-1), n))) for c in group}
            sums = _ordered_sums(path, ring, terms, dtype)
            total = np.concatenate([sums[c] for c in path]).reshape(shape)
            for c in group:
                out[c] = total
    return out


def link_bytes(view: _View, op: str, attrs_: dict[str, Any], elements: int,
               itemsize: int) -> list[tuple[list[Coord], dict[Pair, int]]]:
    """Per barrier group (its chips, the bytes each directed link carries, by chip ids), from the
    closed forms of docs/mesh.md "Bytes per link"."""
    size = elements * itemsize
    if op in ("broadcast", "point_to_point"):
        links: dict[Pair, int] = {}
        sender = tuple(attrs_["sender"])
        if op == "broadcast":
            parent = view.parents(sender)  # type: ignore[arg-type]
            hops = [(parent[c], c) for c in _grid(view.shape) if c != sender]
        else:
            hops = view.route(sender, tuple(attrs_["receiver"]))  # type: ignore[arg-type]
        for a, b in hops:
            key = (view.id(a), view.id(b))
            links[key] = links.get(key, 0) + size
        return [(_grid(view.shape), links)]
    result = []
    for group in _groups(view.shape, attrs_.get("cluster_axis")):
        links = {}

        def carry(a: Coord, b: Coord, nbytes: int) -> None:
            key = (view.id(a), view.id(b))
            links[key] = links.get(key, 0) + nbytes

        n = len(group)
        path, ring = view.chain(group)
        if op == "all_to_all":
            for a in group:
                for b in group:
                    for hop in (view.route(a, b) if a != b else []):
                        carry(*hop, size // n)
        elif n > 1:
            for p in range(n - 1 + ring):
                a, b = path[p], path[(p + 1) % n]
                if op == "all_gather":
                    if ring:
                        carry(a, b, (n - 1) * size)
                    else:
                        carry(a, b, (p + 1) * size)
                        carry(b, a, (n - 1 - p) * size)
                elif op == "reduce_scatter":
                    if ring:
                        carry(a, b, (n - 1) * size // n)
                    else:
                        carry(a, b, (n - 1 - p) * size // n)
                        carry(b, a, (p + 1) * size // n)
                else:  # all_reduce
                    lengths = [len(t) for t in np.array_split(np.empty(elements), n)]
                    if ring:
                        carry(a, b, (2 * elements - lengths[p] - lengths[(p + 1) % n]) * itemsize)
                    else:
                        carry(a, b, size)
                        carry(b, a, size)
        result.append((group, links))
    return result


def _split_for(mapper: tuple[Any, ...], array: Array, shape: Coord) -> list[Array]:
    """What each chip (row-major) should hold when `mapper` lays `array` out over `shape`."""
    kind, dims = mapper
    rows, cols = shape
    if kind == "replicate":
        return [array] * (rows * cols)
    if kind == "shard":
        return list(np.split(array, rows * cols, axis=dims))
    d0, d1 = dims
    out = []
    for r in range(rows):
        row = array if d0 is None else np.split(array, rows, axis=d0)[r]
        for c in range(cols):
            out.append(row if d1 is None else np.split(row, cols, axis=d1)[c])
    return out


def _compose(kind: str, dims: Any, parts: list[Array], shape: Coord) -> Array:
    if kind == "concat":
        return np.concatenate(parts, axis=dims)
    d0, d1 = dims
    rows = []
    for r in range(shape[0]):
        row = parts[r * shape[1]:(r + 1) * shape[1]]
        rows.append(row[0] if d1 is None else np.concatenate(row, axis=d1))
    return rows[0] if d0 is None else np.concatenate(rows, axis=d0)


# -- programs ------------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class _PerChip:
    """A program without collectives and its reference on one chip's `ExpectedValue`s."""

    binary: Binary
    reference: Callable[..., ExpectedValue]

    @property
    def program(self) -> Any:
        return self.binary.programs[0]

    def __repr__(self) -> str:
        return f"<program {self.program.name!r}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


def _matmul_t(a: ExpectedValue, b: ExpectedValue) -> ExpectedValue:
    """a @ b.T in float32 (any summation order): the exact product of any values in the
    intervals, within n u |a| |b|^T of the computed one (n the inner dimension)."""
    mid_a, mid_b = a.midpoint, b.midpoint
    rad_a, rad_b = (a.hi - a.lo) / 2, (b.hi - b.lo) / 2
    abs_a, abs_b = np.abs(mid_a) + rad_a, np.abs(mid_b) + rad_b
    centre = mid_a @ mid_b.T
    n = a.shape[1]
    radius = rad_a @ abs_b.T + abs_a @ rad_b.T + (n + 1) * 2.0**-24 * (abs_a @ abs_b.T) + 2.0**-140
    return ExpectedValue(F32, centre - radius, centre + radius)


def _per_chip_programs(shape: tuple[int, int]) -> list[_PerChip]:
    built: list[_PerChip] = []

    def add(b: ProgramBuilder, reference: Callable[..., ExpectedValue]) -> None:
        built.append(_PerChip(Binary([b.build()]), reference))

    b = ProgramBuilder(f"scale_add{shape}")
    b.output(b.add(b.mul(b.input(shape, Layout(DRAM, TILE, F32)), 2.0), 1.0), Layout(L1, TILE))
    add(b, lambda x: x.map(lambda a: a * np.float32(2) + np.float32(1)))

    b = ProgramBuilder(f"add_to_bf16{shape}")
    x = b.input(shape, Layout(L1, TILE, F32))
    b.output(b.add(x, b.input(shape, Layout(DRAM, RM, F32))), Layout(DRAM, RM, BF16))
    add(b, lambda x, y: x.map(np.add, y).stored_as(BF16))

    b = ProgramBuilder(f"int_add{shape}")
    x = b.input(shape, Layout(DRAM, RM, I32))
    b.output(b.add(x, b.input(shape, Layout(L1, TILE, I32))), Layout(L1, TILE))
    add(b, lambda x, y: x.map(np.add, y))

    if shape == SHARD:
        b = ProgramBuilder("row_max")
        b.output(b.max(b.input(shape, Layout(DRAM, TILE, F32)), 1), Layout(L1, RM))
        add(b, lambda x: x.map(lambda a: a.max(axis=1, keepdims=True)))

        b = ProgramBuilder("matmul_t")
        x, y = b.input(shape, Layout(DRAM, TILE, F32)), b.input(shape, Layout(L1, TILE, BF16))
        b.output(b.matmul(x, b.transpose(y)), Layout(DRAM, TILE, F32))
        add(b, _matmul_t)
    return built


PER_CHIP = tuple(_per_chip_programs(SHARD) + _per_chip_programs(MED))


def _oom_program() -> _PerChip:
    """A BIG FLOAT32 output in L1: larger than a bank on every chip (OutOfMemoryError)."""
    b = ProgramBuilder("relu_to_l1_big")
    b.output(b.relu(b.input(BIG, Layout(DRAM, TILE, BF16))), Layout(L1, TILE, F32))
    return _PerChip(Binary([b.build()]), lambda x: x.map(lambda a: np.maximum(a, np.float32(0))).stored_as(F32))


OOM_PROGRAM = _oom_program()


@functools.lru_cache(maxsize=None)
def _collective_binary(op: str, attrs_items: tuple[tuple[str, Any], ...], shape: tuple[int, int],
                       in_layout: Layout, out_layout: Layout, checked: bool) -> Binary:
    """One collective step on an input (after a range-checked x + x, if `checked`)."""
    b = ProgramBuilder(f"{op}{'_checked' if checked else ''}")
    x = b.input(shape, in_layout)
    if checked:
        with b.checking_range("chip overflow"):
            x = b.add(x, x)
    b.output(getattr(b, op)(x, **dict(attrs_items)), out_layout)
    return Binary([b.build()])


# -- the model of a mesh: shards, the commands that make them, submits -------------------------------


class _Unset:
    def __repr__(self) -> str:
        return "unset"


UNSET: Any = _Unset()


@attrs.define(eq=False, repr=False)
class _Command:
    """One chip's command that makes shards (a conversion, a program run), and what it may do."""

    inputs: tuple[_Shard, ...] = ()
    fails_with: type[BaseException] | None = None
    may_fail: bool = False
    submit: _Submit | None = None
    coord: Coord | None = None
    observed: Any = UNSET  # None (ran) or the exception it raised
    outputs: list[_Shard] = attrs.Factory(list)

    def __repr__(self) -> str:
        return f"<command at {self.coord}, observed {self.observed!r}>"


@attrs.define(eq=False, repr=False)
class _Submit:
    """An SPMD submit of a program with collectives: every chip's command and its groups."""

    op: str
    commands: dict[Coord, _Command]
    groups: list[tuple[list[Coord], dict[Pair, int]]]
    """Each barrier group and the bytes its links must carry when all of it completes."""
    counted: bool = False


@attrs.define(eq=False, repr=False)
class _Shard:
    m: ModelTensor
    chip: int
    """Its chip's index in the opened mesh."""
    command: _Command | None = None

    def __repr__(self) -> str:
        return repr(self.m)


@attrs.define(eq=False, repr=False)
class _Entry:
    """A `MeshTensor` the machine made, its mesh and what its shards hold."""

    tensor: MeshTensor
    mesh: MeshDevice
    shards: list[_Shard]
    composer: tuple[str, Any] | None
    """How `to_host` joins it: ("concat", dim), ("concat_2d", dims); None: replicated."""
    label: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.shards[0].m.shape

    @property
    def dtype(self) -> DataType:
        return self.shards[0].m.dtype

    @property
    def deallocated(self) -> bool:
        return any(s.m.deallocated for s in self.shards)

    @property
    def released(self) -> bool:
        return self.mesh.released

    @property
    def usable(self) -> bool:
        return not self.deallocated and not self.released

    def __repr__(self) -> str:
        state = "deallocated" if self.deallocated else "released" if self.released else "live"
        return f"<{self.label}: {self.dtype.name} {self.shape} x{len(self.shards)}, {state}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


def _own(command: _Command | None) -> tuple[bool, frozenset[type[BaseException]]]:
    """Whether a command may run, and which errors it may raise, its peers left aside."""
    if command is None:
        return True, frozenset()
    if command.observed is not UNSET:
        error = command.observed
        return error is None, frozenset() if error is None else frozenset({type(error)})
    errors: set[type[BaseException]] = set()
    for source in command.inputs:
        ok, errs = outcome(source.command)
        errors |= errs
        if not ok:
            return False, frozenset(errors)
    if command.may_fail:
        errors.add(OutOfMemoryError)  # it allocates in L1: room depends on timing
    if command.fails_with is not None:
        return False, frozenset(errors | {command.fails_with})
    if command.may_fail:
        errors.add(OutOfMemoryError)
    return True, frozenset(errors)


def outcome(command: _Command | None) -> tuple[bool, frozenset[type[BaseException]]]:
    """Whether a command may run, and which errors it may raise: its own, and for a chip of a
    submit with collectives, CollectiveError when a peer may fail (certainly, when a peer of its
    barrier group certainly fails)."""
    ok, errors = _own(command)
    if command is None or command.submit is None or command.observed is not UNSET or not ok:
        return ok, errors
    errs = set(errors)
    for coord, peer in command.submit.commands.items():
        if peer is command:
            continue
        peer_ok, peer_errors = _own(peer)
        if peer_errors:
            errs.add(CollectiveError)
        # A peer of its barrier group that fails before the collective (its own error: every
        # failure the machine plants comes first) keeps the group from meeting. A peer that
        # failed with CollectiveError says nothing: an abort that reaches a group mid-exchange
        # fails the chips still waiting in it, and not the ones that had their chunks.
        same_group = any(coord in g and command.coord in g for g, _ in command.submit.groups)
        if not peer_ok and same_group and not isinstance(peer.observed, CollectiveError):
            return False, frozenset(errs)
    return True, frozenset(errs)


# -- talking to the loop --------------------------------------------------------------------------


def _mesh_tensor(tensor: Any) -> MeshTensor:
    assert type(tensor) is MeshTensor, f"a mesh call gave {tensor!r}, not a tt.MeshTensor"
    return tensor


def _deallocate_entries(entries: list[_Entry]) -> None:
    for entry in entries:
        mesh_api.deallocate(entry.tensor)


async def _outcome_of(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Awaits `fn(*args)`: its result, or the TTFlowError it raised."""
    try:
        return await fn(*args)
    except TTFlowError as exc:
        return exc


async def _await(tensor: Any) -> None:
    await tensor


async def _read_all(tensors: list[Tensor]) -> list[Any]:
    outcomes = []
    for tensor in tensors:
        outcomes.append(await _outcome_of(_runtime.to_host, tensor))
    return outcomes


class MeshStateMachine(LoopHarness, RuleBasedStateMachine):
    """A hypothesis state machine over a mesh of chips (see the module docstring), to subclass.

    Class attributes: `backend` ("asyncio" or "trio"), `mesh_spec` (a small mesh: the model
    runs the reference of every collective on every chip), `eviction` (each chip's L1 policy),
    `timeout` (seconds any await may take before the machine calls it a hang) and
    `rendezvous_timeout` (the collectives' last resort while the machine runs). Then
    `TestX = MyMachine.TestCase`.

    Rules: `to_device` (replicate, shard, shard_2d; every dtype and layout), `from_shards`
    (arrays, or per-chip tensors in per-chip layouts), `empty`, `to_layout`, `submit` (per-chip
    programs: elementwise, a matmul, a row max), `submit_collective` (all six collectives, with
    and without cluster_axis, on the mesh or a submesh), `failing_peer` (a collective whose
    peer chip fails), `out_of_l1` (per-chip L1 outputs that cannot fit), `l1_pressure` (L1
    shards that force eviction on some chips), `deallocate` (then a use must raise),
    `deallocate_shard` (one chip's shard: a submit must refuse before any chip queues),
    `to_host` (with the composer), `wait` (`tt.wait` or `await`), `drain`, `run_one_chip`,
    `create_submesh` and `release_submesh`. Invariants after every step, waiting for nothing:
    each chip's `DeviceModel.check_bounds` and memory views, and its DRAM within what live and
    queued shards may hold.
    """

    mesh_spec: ClassVar[MeshSpec] = MeshSpec((2, 2), chip=DeviceSpec.small())
    eviction: ClassVar[str] = "lookahead"
    workers: ClassVar[str] = "thread"  # "process": each chip's records in a worker process
    timeout: ClassVar[float] = 20.0
    rendezvous_timeout: ClassVar[float] = 40.0
    max_entries: ClassVar[int] = 40

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[_Entry] = []
        self.shard_of: dict[int, _Shard] = {}
        self.submits: list[_Submit] = []
        self.submeshes: list[MeshDevice] = []
        self.holds: list[QueueHold] = []
        self._drained: set[int] = set()
        self.open_loop()
        self._mesh_cm: Any = None
        try:
            self._mesh_cm = self.portal.wrap_async_context_manager(
                open_mesh_device(self.mesh_spec, eviction=self.eviction, inline_seconds=-1.0,
                                 workers=self.workers, collective_timeout=self.rendezvous_timeout))
            self.mesh: MeshDevice = self._mesh_cm.__enter__()
            self.chips: list[Device] = self.mesh.chips
            self.models = [DeviceModel(self.mesh_spec.chip) for _ in self.chips]
            self.holds = [QueueHold(chip) for chip in self.chips]
            for hold in self.holds:
                self.portal.call(hold.acquire)
            self.links_before = self._link_counters()
        except BaseException:
            self._close()
            raise

    # -- the loop (`LoopHarness`: call, run, expect_raises, expect_raises_async) -------------

    def held_queues(self) -> tuple[Sequence[QueueHold], Sequence[Device]]:
        return self.holds, self.chips

    # -- the model -------------------------------------------------------------------------------

    def _label(self) -> str:
        return f"m{len(self.entries)}"

    def room(self) -> bool:
        return len(self.entries) < self.max_entries

    def _chip_index(self, device: Device) -> int:
        return next(k for k, chip in enumerate(self.chips) if chip is device)

    def _view(self, mesh: MeshDevice) -> _View:
        return _View(self.mesh_spec, mesh.shape, tuple(mesh.device_ids))

    def _shard(self, tensor: Tensor, layout: Layout, expected: ExpectedValue | None, label: str,
               command: _Command | None = None) -> _Shard:
        """The model of one chip's shard (one per `Tensor`: a shard taken as it is stays one)."""
        known = self.shard_of.get(id(tensor))
        if known is not None and known.m.tensor is tensor:
            return known
        k = self._chip_index(tensor.device)
        ok, errors = outcome(command)
        m = self.models[k].track(tensor, layout, expected if ok else None, label=label,
                                 may_fail=bool(errors) or not ok)
        entry = _Shard(m, k, command)
        if command is not None:
            command.outputs.append(entry)
        self.shard_of[id(tensor)] = entry
        return entry

    def _entry(self, tensor: MeshTensor, mesh: MeshDevice, shards: list[_Shard],
               composer: tuple[str, Any] | None, label: str) -> _Entry:
        entry = _Entry(tensor, mesh, shards, composer, label)
        self.entries.append(entry)
        return entry

    def _meshes(self, live_only: bool = True) -> list[MeshDevice]:
        return [self.mesh] + [m for m in self.submeshes if not (live_only and m.released)]

    def _pick_mesh(self, data: st.DataObject, live_only: bool = False) -> MeshDevice:
        # Mostly a live mesh; a released submesh now and then (its refusals are checked).
        meshes = self._meshes(live_only=True)
        released = [m for m in self.submeshes if m.released]
        if released and not live_only and data.draw(st.integers(0, 7), label="released?") == 0:
            return data.draw(st.sampled_from(released), label="released mesh")
        return data.draw(st.sampled_from(meshes), label="mesh")

    def _pick(self, data: st.DataObject, where: Callable[[_Entry], bool], label: str = "tensor") -> _Entry:
        candidates = [e for e in reversed(self.entries) if where(e)]
        return data.draw(st.sampled_from(candidates), label=label)

    def _has(self, where: Callable[[_Entry], bool]) -> bool:
        return any(where(e) for e in self.entries)

    def _l1_depth(self, shape: tuple[int, ...], layout: Layout) -> int:
        return storage_geometry(shape, layout, self.mesh_spec.chip).depth if layout.memory is L1 else 0

    def _usable_l1_bank(self) -> int:
        size = self.mesh_spec.chip.l1_bank_bytes
        return size - size % self.mesh_spec.chip.l1_alignment

    def _draw_mapper(self, data: st.DataObject, mesh: MeshDevice,
                     shard_shape: tuple[int, int]) -> tuple[tuple[Any, ...], tuple[int, ...]]:
        """A mapper as (kind, dims) and the global shape that gives `shard_shape` per chip."""
        rows, cols = mesh.shape
        kind = data.draw(st.sampled_from(["replicate", "shard", "shard_2d"]), label="mapper")
        h, w = shard_shape
        if kind == "replicate":
            return ("replicate", None), shard_shape
        if kind == "shard":
            dim = data.draw(st.integers(0, 1), label="dim")
            n = rows * cols
            return ("shard", dim), (h * n, w) if dim == 0 else (h, w * n)
        dims = data.draw(st.sampled_from([(0, 1), (1, 0), (None, 0), (1, None), (0, None), (None, 1)]),
                         label="dims")
        shape = [h, w]
        for axis, d in enumerate(dims):
            if d is not None:
                shape[d] *= mesh.shape[axis]
        return ("shard_2d", dims), (shape[0], shape[1])

    @staticmethod
    def _mapper(kind: str, dims: Any) -> Any:
        return replicate() if kind == "replicate" else shard(dims) if kind == "shard" else shard_2d(dims)

    def push(self, data: st.DataObject, mesh: MeshDevice, shard_shape: tuple[int, int], layout: Layout,
             mapper: tuple[tuple[Any, ...], tuple[int, ...]] | None = None) -> _Entry | None:
        """`tt.to_device(array, mesh, layout, mapper)`, tracked (None if the mesh refused it)."""
        assert layout.dtype is not None
        (kind, dims), shape = mapper if mapper is not None else self._draw_mapper(data, mesh, shard_shape)
        host = F32 if layout.dtype.is_float and data.draw(st.booleans(), label="f32") else layout.dtype
        array = data.draw(arrays(host, shape), label="array")
        if mesh.released:
            self.expect_raises(MeshError, mesh_api.to_device, array, mesh, layout, self._mapper(kind, dims))
            return None
        tensor = _mesh_tensor(self.call(mesh_api.to_device, array, mesh, layout, self._mapper(kind, dims)))
        assert tensor.shape == tuple(shape) and tensor.shard_shape == shard_shape, tensor
        label = self._label()
        self.call(setattr, tensor, "name", label)
        parts = _split_for((kind, dims), array, mesh.shape)
        shards = []
        for k, (part, t) in enumerate(zip(parts, device_tensors(tensor))):
            assert t.device is mesh.chips[k], f"{label}: shard {k} is not on chip {k} of {mesh!r}"
            s = self._shard(t, layout, stored(part, layout.dtype), f"{label}[{k}]")
            s.m.given_name = label
            shards.append(s)
        composer = (None if kind == "replicate" else ("concat", dims) if kind == "shard" else ("concat_2d", dims))
        return self._entry(tensor, mesh, shards, composer, label)

    def push_distinct(self, data: st.DataObject, mesh: MeshDevice, dtype: DataType) -> _Entry:
        """`tt.from_shards` of one array per chip, a drawn array plus the chip's index: shards
        that differ wherever they are, so a collective that mixes up their order shows."""
        memory = data.draw(st.sampled_from([DRAM, L1]), label="memory")
        layout = Layout(memory, TILE, dtype)
        base = data.draw(arrays(F32 if dtype.is_float else dtype, SHARD), label="array")
        values = [(base + np.asarray(k + 1, base.dtype)) for k in range(mesh.num_chips)]
        tensor = _mesh_tensor(self.call(from_shards, values, mesh, layout))
        label = self._label()
        shards = [self._shard(t, layout, stored(v, dtype), f"{label}[{k}]")
                  for k, (v, t) in enumerate(zip(values, device_tensors(tensor)))]
        return self._entry(tensor, mesh, shards, ("concat", 0), label)

    # -- outcomes --------------------------------------------------------------------------------

    def settle(self, command: _Command, result: Any) -> None:
        """Checks an observed outcome of a command (None: it ran) and records it."""
        error = result if isinstance(result, BaseException) else None
        if command.observed is not UNSET:
            before = command.observed
            assert type(before) is type(error), (
                f"{command.outputs}: observed {before!r} once and {error!r} now")
            return
        ok, errors = outcome(command)
        if error is None:
            assert ok, f"{command.outputs} should have failed with one of {sorted(e.__name__ for e in errors)}"
        else:
            assert isinstance(error, tuple(errors)), (
                f"{command.outputs} raised {type(error).__name__}: {error}; expected "
                + (f"one of {sorted(e.__name__ for e in errors)}" if errors else "its value"))
        command.observed = error
        for s in command.outputs:
            s.m.resolved = True
            s.m.error = None if error is None else type(error)
            if error is not None:
                s.m.expected = None

    def check_submits(self) -> None:
        """Once every chip of a collective submit is observed: a CollectiveError names the chip
        that failed first and its op, and that chip failed with its own error."""
        for submit in self.submits:
            if submit.counted or any(c.observed is UNSET for c in submit.commands.values()):
                continue
            def inherited(c: _Command) -> bool:
                # Its error may be an input's (an input failed, or was freed unread: unobserved).
                return any(i.command is not None and i.command.observed is not None for i in c.inputs)

            own = {coord for coord, c in submit.commands.items() if c.observed is not None
                   and (not isinstance(c.observed, CollectiveError) or inherited(c))}
            for coord, command in submit.commands.items():
                error = command.observed
                if isinstance(error, CollectiveError) and not inherited(command):
                    assert error.collective == submit.op, f"chip {coord}: {error!r} names {error.collective}"
                    named = submit.commands.get(error.chip) if error.chip is not None else None
                    assert error.chip in own, (
                        f"chip {coord} failed with CollectiveError naming chip {error.chip}, which "
                        f"failed with {named.observed if named is not None else None!r}: {error}")

    def drain_and_check(self) -> None:
        """Every chip idle: every live shard read back against the model, the submits' errors
        and link bytes, and each chip's memory exactly."""
        live = [s for model in self.models for m in model.tensors if not m.deallocated
                for s in [self.shard_of[id(m.tensor)]]]
        outcomes = self.run(_read_all, [s.m.tensor for s in live])
        for s, result in zip(live, outcomes):
            if s.command is not None:
                self.settle(s.command, result)
            elif isinstance(result, BaseException):
                raise AssertionError(f"{s!r} (made by a transfer) raised {result!r}")
            if not isinstance(result, BaseException):
                assert s.m.expected is not None, (
                    f"{s!r} read back a value; the model knows none (its command: {s.command!r}, "
                    f"inputs {s.command.inputs if s.command else ()})")
                s.m.expected.check(result, what=repr(s))
        self.check_submits()
        self.check_link_bytes()
        for chip, model in zip(self.chips, self.models):
            self.call(model.check_drained, chip, None)
        # Shards freed by now hold nothing: the bound of `memory_within_bounds` leaves them out.
        self._drained = {id(m) for model in self.models for m in model.tensors if m.deallocated}

    def _link_counters(self) -> dict[Pair, int]:
        cols = self.mesh.shape[1]
        return {(a[0] * cols + a[1], b[0] * cols + b[1]): n for (a, b), n in self.call(
            lambda: self.mesh.stats.link_bytes).items()}

    def check_link_bytes(self) -> None:
        """Since the last idle point: each directed link carried exactly the formulas of the
        groups that completed, plus at most those of groups a failure cut short."""
        now = self._link_counters()
        lo: dict[Pair, int] = {}
        hi: dict[Pair, int] = {}
        for submit in self.submits:
            if submit.counted:
                continue
            for group, links in submit.groups:
                # An output deallocated unread leaves its command unobserved: complete if it could not fail.
                complete = all(submit.commands[c].observed is None
                               or (submit.commands[c].observed is UNSET
                                   and outcome(submit.commands[c]) == (True, frozenset()))
                               for c in group)
                for pair, nbytes in links.items():
                    hi[pair] = hi.get(pair, 0) + nbytes
                    if complete:
                        lo[pair] = lo.get(pair, 0) + nbytes
            submit.counted = True
        before, self.links_before = self.links_before, now  # teardown's check starts afresh
        self.submits = [s for s in self.submits if not s.counted]
        for pair in sorted(set(now) | set(lo) | set(hi)):
            moved = now.get(pair, 0) - before.get(pair, 0)
            assert lo.get(pair, 0) <= moved <= hi.get(pair, 0), (
                f"link chip {pair[0]} -> chip {pair[1]} carried {moved} bytes; the formulas say "
                + (f"{lo.get(pair, 0)}" if lo.get(pair, 0) == hi.get(pair, 0)
                   else f"{lo.get(pair, 0)} to {hi.get(pair, 0)}"))

    # -- rules: making tensors -----------------------------------------------------------------

    @precondition(lambda self: self.room())
    @rule(data=st.data())
    def to_device(self, data: st.DataObject) -> None:
        mesh = self._pick_mesh(data)
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        layout = Layout(data.draw(st.sampled_from([DRAM, L1]), label="memory"),
                        TILE if dtype is BF8 else data.draw(st.sampled_from([TILE, RM]), label="tiles"), dtype)
        self.push(data, mesh, SHARD, layout)

    @precondition(lambda self: self.room())
    @rule(data=st.data())
    def empty(self, data: st.DataObject) -> None:
        mesh = self._pick_mesh(data)
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        layout = Layout(data.draw(st.sampled_from([DRAM, L1]), label="memory"), TILE, dtype)
        if mesh.released:
            self.expect_raises(MeshError, mesh_api.empty, SHARD, dtype, mesh, layout)
            return
        tensor = _mesh_tensor(self.call(mesh_api.empty, SHARD, dtype, mesh, layout))
        label = f"{self._label()} = empty"
        zeros = stored(np.zeros(SHARD, dtype.host_dtype), dtype)
        shards = [self._shard(t, layout, zeros, f"{label}[{k}]") for k, t in enumerate(device_tensors(tensor))]
        self._entry(tensor, mesh, shards, None, label)

    @precondition(lambda self: self.room())
    @rule(data=st.data())
    def from_shards(self, data: st.DataObject) -> None:
        """Arrays, one per chip (copied, in one layout), or `Tensor`s already on their chips in
        layouts of their own: fresh ones, or the shards of a live tensor (taken as they are)."""
        mesh = self._pick_mesh(data, live_only=True)
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        label = self._label()
        how = data.draw(st.sampled_from(["arrays", "tensors"]), label="how")
        shards: list[_Shard] = []
        if how == "arrays":
            layout = Layout(data.draw(st.sampled_from([DRAM, L1]), label="memory"), TILE, dtype)
            values = [data.draw(arrays(dtype, SHARD), label=f"array {k}") for k in range(mesh.num_chips)]
            tensor = self.call(from_shards, values, mesh, layout)
            for k, (v, t) in enumerate(zip(values, device_tensors(tensor))):
                shards.append(self._shard(t, layout, stored(v, dtype), f"{label}[{k}]"))
        else:
            tensors = []
            for k, chip in enumerate(mesh.chips):
                reuse = [e for e in self.entries if e.usable and e.mesh is mesh and e.dtype is dtype
                         and e.shape == SHARD]
                use_tracked = bool(reuse) and data.draw(st.booleans(), label=f"reuse {k}")
                if use_tracked:
                    source = data.draw(st.sampled_from(reuse), label=f"source {k}")
                    shards.append(source.shards[k])
                    tensors.append(source.shards[k].m.tensor)
                    continue
                layout = Layout(data.draw(st.sampled_from([DRAM, L1]), label=f"memory {k}"),
                                TILE if dtype is BF8 else data.draw(st.sampled_from([TILE, RM]), label=f"tiles {k}"),
                                dtype)
                v = data.draw(arrays(dtype, SHARD), label=f"array {k}")
                t = self.call(_runtime.to_device, v, chip, layout)
                tensors.append(t)
                shards.append(self._shard(t, layout, stored(v, dtype), f"{label}[{k}]"))
            tensor = self.call(from_shards, tensors, mesh)
            assert device_tensors(tensor) == tensors  # taken as they are
        self._entry(tensor, mesh, shards, ("concat", 0), label)

    @precondition(lambda self: self.room() and self._has(lambda e: True))
    @rule(data=st.data())
    def to_layout(self, data: st.DataObject) -> None:
        source = self._pick(data, lambda e: True, "source")
        if source.dtype.is_float:
            dtype = data.draw(st.sampled_from([F32, BF16, BF8]), label="dtype")
        else:
            dtype = source.dtype
        layout = Layout(data.draw(st.sampled_from([DRAM, L1]), label="memory"),
                        TILE if dtype is BF8 else data.draw(st.sampled_from([TILE, RM]), label="tiles"), dtype)
        if source.released:
            self.expect_raises(MeshError, mesh_api.to_layout, source.tensor, layout)
            return
        if source.deallocated:
            self.expect_raises(DeallocatedTensorError, mesh_api.to_layout, source.tensor, layout)
            return
        target = _mesh_tensor(self.call(mesh_api.to_layout, source.tensor, layout))
        label = f"{self._label()} = to_layout({source.label.split(' = ')[0]})"
        too_big = self._l1_depth(source.shape, layout) > self._usable_l1_bank()
        shards = []
        for k, (s, t) in enumerate(zip(source.shards, device_tensors(target))):
            command = _Command((s,), fails_with=OutOfMemoryError if too_big else None)
            expected = s.m.expected.stored_as(dtype) if s.m.expected is not None else None
            shards.append(self._shard(t, layout, expected, f"{label}[{k}]", command))
        self._entry(target, source.mesh, shards, source.composer, label)

    @precondition(lambda self: self.room())
    @rule(data=st.data())
    def l1_pressure(self, data: st.DataObject) -> None:
        """MED shards in L1 on some chips (each a third of an L1 bank and more), DRAM on the others:
        the chips that hold several must evict; nothing may be lost."""
        mesh = self._pick_mesh(data, live_only=True)
        label = self._label()
        tensors, shards = [], []
        dtype = data.draw(st.sampled_from([F32, BF16]), label="dtype")  # one for every shard
        for k, chip in enumerate(mesh.chips):
            layout = Layout(data.draw(st.sampled_from([L1, DRAM]), label=f"memory {k}"), TILE, dtype)
            v = data.draw(arrays(F32, MED), label=f"array {k}")
            t = self.call(_runtime.to_device, v, chip, layout)
            tensors.append(t)
            shards.append(self._shard(t, layout, stored(v, dtype), f"{label}[{k}]"))
        self._entry(self.call(from_shards, tensors, mesh), mesh, shards, ("concat", 0), label)

    # -- rules: programs -------------------------------------------------------------------------

    def _inputs(self, data: st.DataObject, mesh: MeshDevice, specs: Sequence[Any]) -> list[_Entry] | None:
        """An input per spec: a usable tensor of `mesh` of that shape and dtype class, or a fresh one."""
        inputs = []
        for k, spec in enumerate(specs):
            def fits(e: _Entry, spec: Any = spec) -> bool:
                return (e.usable and e.mesh is mesh and e.shape == spec.shape
                        and (e.dtype is spec.dtype or (e.dtype.is_float and spec.dtype.is_float)))
            if self._has(fits) and data.draw(st.booleans(), label=f"tracked {k}"):
                inputs.append(self._pick(data, fits, f"input {k}"))
                continue
            dtype = spec.dtype if not spec.dtype.is_float else data.draw(
                st.sampled_from([F32, BF16, BF8]), label=f"dtype {k}")
            memory = data.draw(st.sampled_from([DRAM, L1]), label=f"memory {k}")
            if spec.shape == BIG:
                memory = DRAM
            entry = self.push(data, mesh, spec.shape, Layout(memory, TILE, dtype))
            if entry is None:
                return None
            inputs.append(entry)
        return inputs

    def _chip_need(self, inputs: Sequence[_Entry], program: Any) -> tuple[int, int]:
        """(L1 bytes per bank a chip's run allocates, its largest single L1 allocation)."""
        sizes = list({(id(e), spec.layout): self._l1_depth(e.shape, spec.layout.resolve(e.dtype))
                      for e, spec in zip(inputs, program.inputs)}.values())
        sizes += [self._l1_depth(s.shape, s.layout) for s in program.output_specs]
        return sum(sizes), max(sizes, default=0)

    @precondition(lambda self: self.room())
    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        chosen = data.draw(st.sampled_from(PER_CHIP), label="program")
        mesh = self._pick_mesh(data)
        program = chosen.program
        if mesh.released:
            fits = [e for e in self.entries if e.mesh is mesh and e.shape == program.inputs[0].shape]
            if fits:
                self.expect_raises(MeshError, mesh_api.submit, mesh, chosen.binary, 0,
                                   [fits[0].tensor] * len(program.inputs))
            return
        inputs = self._inputs(data, mesh, program.inputs)
        if inputs is None:
            return
        self.run_per_chip(chosen, mesh, inputs)

    def run_per_chip(self, chosen: _PerChip, mesh: MeshDevice, inputs: list[_Entry]) -> _Entry:
        program = chosen.program
        outputs = [_mesh_tensor(t) for t in self.call(mesh_api.submit, mesh, chosen.binary, 0,
                                                      [e.tensor for e in inputs])]
        assert len(outputs) == 1
        need, largest = self._chip_need(inputs, program)
        label = f"{self._label()} = {program.name}({', '.join(e.label.split(' = ')[0] for e in inputs)})"
        spec = program.output_specs[0]
        shards = []
        for k, t in enumerate(device_tensors(outputs[0])):
            assert t.device is mesh.chips[k]
            chip_inputs = [e.shards[k] for e in inputs]
            command = _Command(tuple(chip_inputs), fails_with=OutOfMemoryError if largest > self._usable_l1_bank()
                               else None, may_fail=need > 0)
            expected = None
            if all(s.m.expected is not None for s in chip_inputs):
                args = [s.m.expected.stored_as(p.dtype) for s, p in zip(chip_inputs, program.inputs)]  # type: ignore[union-attr]
                expected = chosen.reference(*args).stored_as(spec.dtype)
            shards.append(self._shard(t, spec.layout, expected, f"{label}[{k}]", command))
        return self._entry(outputs[0], mesh, shards, ("concat", 0), label)

    def _draw_collective(self, data: st.DataObject, mesh: MeshDevice,
                         shape: tuple[int, int]) -> tuple[str, dict[str, Any]]:
        op = data.draw(st.sampled_from(OPS), label="op")
        grid = _grid(mesh.shape)
        if op == "broadcast":
            return op, {"sender": data.draw(st.sampled_from(grid), label="sender")}
        if op == "point_to_point":
            return op, {"sender": data.draw(st.sampled_from(grid), label="sender"),
                        "receiver": data.draw(st.sampled_from(grid), label="receiver")}
        axis = data.draw(st.sampled_from([None, 0, 1]), label="cluster_axis")
        n = mesh.num_chips if axis is None else mesh.shape[axis]
        if op == "all_reduce":
            return op, {"cluster_axis": axis}
        dim = data.draw(st.sampled_from([d for d in (0, 1) if op == "all_gather" or shape[d] % n == 0]),
                        label="dim")
        if op == "all_to_all":
            return op, {"split_dim": dim, "concat_dim": data.draw(st.integers(0, 1), label="concat_dim"),
                        "cluster_axis": axis}
        return op, {"dim": dim, "cluster_axis": axis}

    def run_collective(self, mesh: MeshDevice, binary: Binary, op: str, attrs_: dict[str, Any],
                       inputs: list[_Entry], checked: bool) -> _Entry:
        """Submits a one-collective program, tracks every chip's output, the expected values
        (from the reference) and the bytes each group's links must carry."""
        program = for_mesh(binary.programs[0], mesh.shape)  # its shapes for this mesh
        in_spec = program.inputs[0]
        outputs = [_mesh_tensor(t) for t in self.call(mesh_api.submit, mesh, binary, 0, [e.tensor for e in inputs])]
        view = self._view(mesh)
        coords = _grid(mesh.shape)
        dtype = in_spec.dtype
        itemsize = np.dtype(dtype.host_dtype).itemsize
        groups = link_bytes(view, op, attrs_, int(np.prod(in_spec.shape)), itemsize)
        submit = _Submit(op, {}, groups)
        need, largest = self._chip_need(inputs, program)
        source = inputs[0]
        chip_inputs = [source.shards[k] for k in range(len(coords))]
        # A chip whose input is known to fail fails its group (the model says so, `outcome`);
        # its value (zeros here) then reaches only results that are never read.
        args = [s.m.expected.stored_as(dtype) if s.m.expected is not None
                else ExpectedValue.exactly(np.zeros(in_spec.shape, dtype.host_dtype), dtype) for s in chip_inputs]
        out_spec = program.output_specs[0]
        label = f"{self._label()} = {program.name}({source.label.split(' = ')[0]}, {attrs_})"
        shards = []
        for k, (coord, t) in enumerate(zip(coords, device_tensors(outputs[0]))):
            assert t.device is mesh.chips[k] and t.shape == out_spec.shape
            command = _Command((chip_inputs[k],), fails_with=(
                ProgramError if checked and np.any(np.abs(2 * args[k].lo) >= 2**31)
                else OutOfMemoryError if largest > self._usable_l1_bank() else None),
                may_fail=need > 0, submit=submit, coord=coord)
            submit.commands[coord] = command

            def result(*xs: Array, coord: Coord = coord) -> Array:
                values = [round_as(2 * x, dtype) for x in xs] if checked else list(xs)
                return collective_results(view, op, attrs_, dict(zip(coords, values)), dtype)[coord]

            expected = args[0].map(result, *args[1:]).stored_as(out_spec.dtype)
            shards.append(self._shard(t, out_spec.layout, expected, f"{label}[{k}]", command))
        self.submits.append(submit)
        return self._entry(outputs[0], mesh, shards, ("concat", 0), label)

    @precondition(lambda self: self.room())
    @rule(data=st.data())
    def submit_collective(self, data: st.DataObject) -> None:
        self._collective(data, self._pick_mesh(data), data.draw(st.sampled_from([F32, BF16, I32]), label="dtype"))

    @precondition(lambda self: self.room() and self._has(lambda e: e.usable and e.shape == SHARD and e.dtype is not BF8))
    @rule(data=st.data())
    def chain_collective(self, data: st.DataObject) -> None:
        """A collective on a tracked tensor (often the output of one still queued): collectives
        back to back in the chips' queues, a failure upstream reaching every chip's next one."""
        source = self._pick(data, lambda e: e.usable and e.shape == SHARD and e.dtype is not BF8, "source")
        dtype = source.dtype if not source.dtype.is_float else data.draw(st.sampled_from([F32, BF16]), label="dtype")
        self._collective(data, source.mesh, dtype, source)

    def _collective(self, data: st.DataObject, mesh: MeshDevice, dtype: DataType, source: _Entry | None = None) -> None:
        op, attrs_ = self._draw_collective(data, mesh, SHARD)
        in_layout = Layout(data.draw(st.sampled_from([DRAM, L1]), label="in memory"),
                           data.draw(st.sampled_from([TILE, RM]), label="in tiles"), dtype)
        out_layout = Layout(data.draw(st.sampled_from([DRAM, L1]), label="out memory"),
                            data.draw(st.sampled_from([TILE, RM]), label="out tiles"))
        binary = _collective_binary(op, tuple(sorted(attrs_.items())), SHARD, in_layout, out_layout, False)
        if mesh.released:
            fits = [e for e in self.entries if e.mesh is mesh and e.shape == SHARD]
            if fits:
                self.expect_raises(MeshError, mesh_api.submit, mesh, binary, 0, [fits[0].tensor])
            return
        if source is not None:
            inputs: list[_Entry] | None = [source]
        elif data.draw(st.booleans(), label="distinct shards"):
            inputs = [self.push_distinct(data, mesh, dtype)]
        else:
            inputs = self._inputs(data, mesh, binary.programs[0].inputs)
        if inputs is not None:
            self.run_collective(mesh, binary, op, attrs_, inputs, checked=False)

    @precondition(lambda self: self.room())
    @rule(data=st.data())
    def failing_peer(self, data: st.DataObject) -> None:
        """A collective whose peer chip fails: its own error on that chip, CollectiveError on
        every chip of its group naming it; nothing hangs."""
        mesh = self._pick_mesh(data, live_only=True)
        if mesh.num_chips < 2:
            return
        bad = data.draw(st.integers(0, mesh.num_chips - 1), label="failing chip")
        how = data.draw(st.sampled_from(["overflow", "out of L1"]), label="how")
        label = self._label()
        if how == "overflow":
            op, attrs_ = self._draw_collective(data, mesh, SHARD)
            layout = Layout(data.draw(st.sampled_from([DRAM, L1]), label="memory"), TILE, I32)
            values = [np.full(SHARD, 2**30 + 5, np.int32) if k == bad
                      else data.draw(arrays(I32, SHARD), label=f"array {k}") for k in range(mesh.num_chips)]
            tensor = self.call(from_shards, values, mesh, layout)
            shards = [self._shard(t, layout, stored(v, I32), f"{label}[{k}]")
                      for k, (v, t) in enumerate(zip(values, device_tensors(tensor)))]
            source = self._entry(tensor, mesh, shards, ("concat", 0), label)
            binary = _collective_binary(op, tuple(sorted(attrs_.items())), SHARD, layout, Layout(DRAM, TILE), True)
            self.run_collective(mesh, binary, op, attrs_, [source], checked=True)
            return
        # One chip's input ran out of L1 (a BIG conversion into L1), the others' are in DRAM.
        op = data.draw(st.sampled_from(["all_gather", "all_reduce", "broadcast"]), label="op")
        attrs_ = ({"dim": 0, "cluster_axis": None} if op == "all_gather" else {"cluster_axis": None}
                  if op == "all_reduce" else {"sender": (0, 0)})
        dram = Layout(DRAM, TILE, F32)
        tensors, shards = [], []
        for k, chip in enumerate(mesh.chips):
            v = np.full(BIG, float(k + 1), np.float32)
            t = self.call(_runtime.to_device, v, chip, dram)
            s = self._shard(t, dram, stored(v, F32), f"{label}[{k}]")
            if k == bad:
                t = self.call(_runtime.to_layout, t, Layout(L1, TILE))
                s = self._shard(t, Layout(L1, TILE, F32), None, f"{label}[{k}] in L1",
                                _Command((s,), fails_with=OutOfMemoryError))
            tensors.append(t)
            shards.append(s)
        source = self._entry(self.call(from_shards, tensors, mesh), mesh, shards, ("concat", 0), label)
        binary = _collective_binary(op, tuple(sorted(attrs_.items())), BIG, dram, dram, False)
        self.run_collective(mesh, binary, op, attrs_, [source], checked=False)

    @precondition(lambda self: self.room())
    @rule(data=st.data())
    def out_of_l1(self, data: st.DataObject) -> None:
        """A program whose per-chip L1 output cannot fit: OutOfMemoryError on every chip."""
        mesh = self._pick_mesh(data, live_only=True)
        label = self._label()
        dram = Layout(DRAM, TILE, BF16)
        v = np.full(BIG, 1.5, np.float32)
        tensor = _mesh_tensor(self.call(mesh_api.to_device, v, mesh, dram))
        shards = [self._shard(t, dram, stored(v, BF16), f"{label}[{k}]")
                  for k, t in enumerate(device_tensors(tensor))]
        source = self._entry(tensor, mesh, shards, None, label)
        self.run_per_chip(OOM_PROGRAM, mesh, [source])

    # -- rules: freeing, reading, waiting --------------------------------------------------------

    @precondition(lambda self: self._has(lambda e: not e.deallocated))
    @rule(data=st.data())
    def deallocate(self, data: st.DataObject) -> None:
        entry = self._pick(data, lambda e: not e.deallocated)
        self.call(mesh_api.deallocate, entry.tensor)
        for s in entry.shards:
            s.m.deallocated = True
        assert entry.tensor.is_deallocated
        use = data.draw(st.sampled_from(["to_host", "wait", "submit", "to_layout"]), label="then")
        error = MeshError if entry.released else DeallocatedTensorError
        t = entry.tensor
        if use == "to_host":
            self.expect_raises_async(error, mesh_api.to_host, t, concat(0))
        elif use == "wait":  # the shards are awaited first
            self.expect_raises_async(DeallocatedTensorError, mesh_api.wait, t)
        elif use == "submit" and t.shard_shape == SHARD and not entry.released and t.dtype is not BF8:
            binary = _collective_binary("all_reduce", (("cluster_axis", None),), SHARD, Layout(dtype=t.dtype),
                                        Layout(), False)
            self.expect_raises(DeallocatedTensorError, mesh_api.submit, entry.mesh, binary, 0, [t])
        else:
            self.expect_raises(error, mesh_api.to_layout, t, Layout(DRAM, TILE))

    @precondition(lambda self: self._has(lambda e: e.usable and len(e.shards) > 1))
    @rule(data=st.data())
    def deallocate_shard(self, data: st.DataObject) -> None:
        """One chip's shard freed (`tt.device_tensors(t)[k]`): the mesh tensor is deallocated,
        a submit with it refuses before any chip queues; the other shards still read back."""
        entry = self._pick(data, lambda e: e.usable and len(e.shards) > 1)
        k = data.draw(st.integers(0, len(entry.shards) - 1), label="shard")
        self.call(mesh_api.deallocate, device_tensors(entry.tensor)[k])
        entry.shards[k].m.deallocated = True
        assert entry.tensor.is_deallocated
        if entry.shape == SHARD and entry.dtype is not BF8:
            queued = [len(chip._cq0) for chip in self.chips]
            op = data.draw(st.sampled_from(["all_reduce", "relu"]), label="program")
            if op == "relu":
                b = ProgramBuilder("relu")
                b.output(b.relu(b.input(SHARD, Layout(dtype=entry.dtype))))
                binary = Binary([b.build()])
            else:
                binary = _collective_binary("all_reduce", (("cluster_axis", None),), SHARD,
                                            Layout(dtype=entry.dtype), Layout(), False)
            self.expect_raises(DeallocatedTensorError, mesh_api.submit, entry.mesh, binary, 0, [entry.tensor])
            after = [len(chip._cq0) for chip in self.chips]
            assert after == queued, f"a refused submit queued work: {queued} -> {after}"
        self.expect_raises_async(DeallocatedTensorError, mesh_api.to_host, entry.tensor, concat(0))

    @precondition(lambda self: self._has(lambda e: True))
    @rule(data=st.data())
    def to_host(self, data: st.DataObject) -> None:
        """The shards joined by the composer their mapper calls for (or concat(0) for a
        per-device tensor), against the model's shards joined alike; then every chip idles
        and everything is checked exactly."""
        entry = self._pick(data, lambda e: True)
        if entry.released or entry.deallocated:
            self.expect_raises_async(MeshError if entry.released else DeallocatedTensorError,
                                     mesh_api.to_host, entry.tensor, concat(0))
            return
        kind: str
        dims: Any
        kind, dims = entry.composer if entry.composer is not None else ("none", None)
        if kind == "none" and data.draw(st.booleans(), label="concat anyway"):
            kind, dims = "concat", 1
        composer: Any = None if kind == "none" else concat(dims) if kind == "concat" else concat_2d(dims)
        result = self.run(_outcome_of, mesh_api.to_host, entry.tensor, composer)
        self.drain_and_check()
        errors = [s.m.error for s in entry.shards if s.m.error is not None]
        if isinstance(result, BaseException):
            assert errors and isinstance(result, errors[0]), (
                f"to_host({entry!r}) raised {result!r}; the shards' errors: {errors}")
            return
        assert not errors, f"to_host({entry!r}) read a value; shards failed with {errors}"
        grid = entry.tensor.mesh_shape
        values = [s.m.expected for s in entry.shards]
        assert all(v is not None for v in values)
        if kind == "none":
            want = values[0]
        else:
            lo = _compose(kind, dims, [v.lo for v in values], grid)  # type: ignore[union-attr]
            hi = _compose(kind, dims, [v.hi for v in values], grid)  # type: ignore[union-attr]
            want = ExpectedValue(entry.dtype, lo, hi)
        assert want is not None
        want.check(result, what=f"to_host({entry!r}, {composer!r})")

    @precondition(lambda self: self._has(lambda e: True))
    @rule(data=st.data())
    def wait(self, data: st.DataObject) -> None:
        """`tt.wait(t)` or `await t`: the shards are awaited in order, the first that failed or
        was deallocated raises its error; a released submesh's tensor raises MeshError after."""
        entry = self._pick(data, lambda e: True)
        how = data.draw(st.sampled_from(["wait", "await"]), label="how")
        waiter = mesh_api.wait if how == "wait" else _await
        if entry.shards[0].m.deallocated:
            self.expect_raises_async(DeallocatedTensorError, waiter, entry.tensor)
            return
        result = self.run(_outcome_of, waiter, entry.tensor)
        self.drain_and_check()
        want: type[BaseException] | None = MeshError if entry.released else None
        for s in entry.shards:
            if s.m.deallocated or s.m.error is not None:
                want = DeallocatedTensorError if s.m.deallocated else s.m.error
                break
        if want is None:
            assert not isinstance(result, BaseException), f"{how} {entry!r} raised {result!r}"
        else:
            assert isinstance(result, want), f"{how} {entry!r} gave {result!r}, not {want.__name__}"

    @rule()
    def drain(self) -> None:
        self.drain_and_check()

    @rule(data=st.data())
    def run_one_chip(self, data: st.DataObject) -> None:
        """One chip's queues run alone for a moment while the others' stay held: its
        collectives wait in their rendezvous for peers that do not come yet."""
        k = data.draw(st.integers(0, len(self.chips) - 1), label="chip")
        queue = data.draw(st.sampled_from(["CQ1", "CQ0"]), label="queue")
        self.portal.call(self.holds[k].run_alone, queue, 0.02)

    # -- rules: submeshes ------------------------------------------------------------------------

    @precondition(lambda self: len(self.submeshes) < 4)
    @rule(data=st.data())
    def create_submesh(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._meshes()), label="parent")
        rows = data.draw(st.integers(1, parent.shape[0]), label="rows")
        cols = data.draw(st.integers(1, parent.shape[1]), label="cols")
        offset = (data.draw(st.integers(0, parent.shape[0] - rows), label="row offset"),
                  data.draw(st.integers(0, parent.shape[1] - cols), label="col offset"))
        sub = self.call(create_submesh, parent, (rows, cols), offset)
        want = [parent.chips[(offset[0] + r) * parent.shape[1] + offset[1] + c]
                for r in range(rows) for c in range(cols)]
        assert sub.chips == want and sub.parent is parent
        self.submeshes.append(sub)

    @precondition(lambda self: any(not m.released for m in self.submeshes))
    @rule(data=st.data())
    def release_submesh(self, data: st.DataObject) -> None:
        sub = data.draw(st.sampled_from([m for m in self.submeshes if not m.released]), label="submesh")
        self.call(release_submesh, sub)
        pending = [sub]
        while pending:  # it and the submeshes cut from it
            m = pending.pop()
            assert m.released, f"{m!r} is not released with its parent"
            pending += [c for c in self.submeshes if c.parent is m]
        self.expect_raises(MeshError, mesh_api.to_device, np.zeros(SHARD, np.float32), sub)
        self.expect_raises(MeshError, create_submesh, sub, (1, 1))

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def memory_within_bounds(self) -> None:
        """Per chip, with work in flight: `DeviceModel.check_bounds`, its memory views, and DRAM
        used within what its live shards and the ones freed since the last idle point may hold
        (a home, a conversion and an evicted copy each)."""
        def check() -> None:
            for chip, model in zip(self.chips, self.models):
                model.check_bounds(chip)
                _check_memory_views(chip, model)
                # Each shard: its home, a conversion for each of the layouts queued programs read
                # it in, an evicted copy, a program's scratch of its shape: four FLOAT32 copies.
                bound = sum(4 * max(storage_geometry(m.shape, Layout(DRAM, t, F32), model.spec).footprint
                                    for t in (TILE, RM))
                            for m in model.tensors if id(m) not in self._drained)
                used = chip.memory_used(DRAM)
                assert used <= bound + 4096, (
                    f"chip {chip!r}: {used} bytes of DRAM used, its shards may hold at most {bound}\n"
                    f"{chip.memory_view(DRAM)}\n{[m for m in model.tensors if id(m) not in self._drained]}")
        self.call(check)

    # -- teardown ----------------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            self.call(_deallocate_entries, self.entries)
            for model in self.models:
                for m in model.tensors:
                    self.call(_runtime.deallocate, m.tensor)
                    m.deallocated = True
            self.drain_and_check()
            for chip in self.chips:
                for space in MemorySpace:
                    used = self.call(chip.memory_used, space)
                    assert used == 0, f"{chip!r} {space.name}: {used} bytes allocated with every tensor freed"
        finally:
            self._close()

    def _close(self) -> None:
        try:
            for hold in self.holds:
                self.call(hold.release)
            if self._mesh_cm is not None and hasattr(self, "mesh"):
                self._mesh_cm.__exit__(None, None, None)
        finally:
            self.close_loop()

