"""Commands as records: what the scheduler decided, as plain data, and `run` that moves the bytes.

A record names storages (addresses in bank memory), never tensors: `run(record, banks)` reads and
writes bank memory and touches no scheduling state, so it is safe on a worker thread, and a record
decided once can be run again (trace replay runs the records of a captured sequence back to back).

A record is a tuple of steps:

- `Store(dst, array, staged)`: a host array (or zeros, for `array=None`) into a storage; when
  `staged`, the array was converted to device pages ahead and only the pages move;
- `Load(src, shape)`: a storage's value out to a host array (the result of `run`);
- `Copy(src, dst, shape)`: a value between storages (a page copy, or a conversion of layout or
  dtype through the kernels);
- `Compute(plan, sources, outputs, scratch, ..., peers)`: a program's steps over its input
  storages; `peers`, on a chip of an SPMD submit, is what its collective steps exchange values
  through (its place in the submit's rendezvous, `_mesh.collectives`), None elsewhere (a
  collective then runs as in a group of one chip);
- `Slide(space, source, target, depth)`: a buffer's bytes, `depth` per bank in every bank, to a
  new address that may overlap the old one (compaction: the buffer keeps its storage).
"""

from __future__ import annotations

import heapq
import math
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NamedTuple, Union, cast, final

import numpy as np

from ._memory import storage_io as io
from ._ir.ops.host import HOST_OP, host_step, timing_host_ops
from ._kernels import _pointwise
from ._memory.banks import Storage
from ._ir.ops import COLLECTIVES, OPS
from ._ir.numerics import compute_dtype
from ._ir.record import Kind, PageOp, check_range
from ._ir.spans import ThreadSpans
from ._types import DataType, Layout, MemorySpace, TensorLayout, least_padded_shape

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._ir.program import Program, TensorSpec
    from ._ir.program import Step as ProgramStep

__all__ = [
    "Store", "Load", "Copy", "Slide", "Compute", "Step", "Record", "Plan", "Banks", "run", "run_all",
    "pagewise_storages", "page_kernel", "estimate", "is_transfer", "KERNEL_BYTES_PER_SECOND",
    "INLINE_SECONDS",
    "PROCESS_INLINE_SECONDS",
]

Banks = dict[MemorySpace, np.ndarray[Any, np.dtype[np.uint8]]]

BYTES_PER_SECOND = 4e9
"""Rough rate at which runs move bytes here (tilize 8 GB/s, untilize and gathers slower, plus
numpy's own copies), for estimates."""
MACS_PER_SECOND = 2e10
"""Rough single-thread BLAS rate here, multiply-accumulates per second (small sgemms 15-20 G,
large ones 30 G), for estimates."""
KERNEL_BYTES_PER_SECOND = 12e9
"""Rate of the C pointwise kernel (`_kernels._pointwise`), operands' bytes per second: 12 GB/s
for a 32x32 add including its call, 25-55 GB/s on large pages. A replay of a hundred tiny
programs so stays inline instead of paying a thread hand-off."""
INLINE_SECONDS = 100e-6
"""Records estimated below this run inline in the queue task: a thread hand-off costs 85-180 us
here, so moving shorter work off the loop would make it slower, not the loop freer."""

PROCESS_INLINE_SECONDS = 25e-6
"""The same for a device whose records run in a worker process (`workers="process"`): a record
sent there takes no host time to run, and a chain of them goes in a few messages, so a smaller
record pays off there; one estimated below this still runs here (the estimate leaves out the
interpreter's cost per op: a 32x32 residual block is estimated at 11 us and runs in 100 us,
a 64x64 one at 50 us, run in 170 us; `ttflow bench mesh --workers` measures both)."""


class Store(NamedTuple):
    dst: Storage
    array: np.ndarray[Any, Any] | None
    staged: np.ndarray[Any, Any] | None = None  # the array already as the storage's pages


class Load(NamedTuple):
    src: Storage
    shape: tuple[int, ...]


class Copy(NamedTuple):
    src: Storage
    dst: Storage
    shape: tuple[int, ...]


class Slide(NamedTuple):
    space: MemorySpace
    source: int
    target: int
    depth: int


def page_ops_of(steps: Sequence[ProgramStep], pagewise: bool) -> tuple[PageOp, ...]:
    """The page kernels of a pagewise plan's steps, in step order (none for another plan): a
    plan's own, and a worker's copy of it, which gets them again from its `OPS` by op name
    (their functions do not pickle; `_workers.wire.plan_from_state`)."""
    if not pagewise:
        return ()
    pages = [OPS[step.op].page for step in steps]
    return tuple(page for page in pages if page is not None)


@final
class Plan:
    """What a program needs that does not change between submissions (cached per program).

    Immutable: a plan is shared by every queued run of its program, and `_core._dispatch` reads
    it in C, so nothing may change under them; assigning a field once it is built raises. What
    depends on the device (its circular-buffer bytes, its layouts as the device's interned
    objects, the output geometry of the fast decision) is bound at construction too: a device's
    scheduler makes its own plan from the plain one (`bound_to`)."""

    __slots__ = ("values", "steps", "inputs", "outputs", "pagewise", "last_read", "step_attrs",
                 "store_in_output", "copied_out", "compute", "value_dtypes", "scratch", "macs",
                 "page_code", "input_layouts", "output_layouts", "output_shapes", "input_checks",
                 "bound", "donated", "in_place", "output_states", "footprint", "schedule", "range_checks",
                 "collectives", "host_ops", "consts", "checked_submit", "page_ops", "scratch_slot", "_built")

    def __init__(self, program: Program) -> None:
        # The parts of the program a run reads (not the program: a plan cached under its program
        # must not keep it alive).
        self.values = program.values
        self.steps = program.steps
        self.inputs = program.inputs
        self.outputs = program.outputs
        self.last_read = [-1] * len(program.values)  # the last step reading each value
        for index, step in enumerate(program.steps):
            for value in step.inputs:
                self.last_read[value] = index
        self.step_attrs = [dict(step.attrs) for step in program.steps]
        self.range_checks = dict(program.range_checks)
        # run() silences FP warnings; a host op's step calls the user's function (`_host_ops`).
        self.compute: list[Any] = [host_step if step.op == HOST_OP else OPS[step.op].fn for step in program.steps]
        # The steps that exchange values with other chips: such a plan never takes the fast
        # paths (its record waits for its peers, so it runs on its queue's worker thread).
        self.collectives = tuple(index for index, step in enumerate(program.steps) if step.op in COLLECTIVES)
        # (step index, `host_op:<name>`) of each host op: a record calling one runs on the
        # queue's worker thread (`_queue._calls_host`); the timeline names and times them.
        self.host_ops = program.host_ops
        # The inputs declared constant: a submit goes through the checked path, which runs the
        # program through its constant cut (`_const_eval`).
        self.consts = program.consts
        self.value_dtypes = [compute_dtype(spec.dtype) for spec in program.values]
        # A step value that is an output of the same dtype is stored straight into that output.
        self.store_in_output: dict[int, int] = {}
        for k, value in enumerate(program.outputs):
            if value >= len(program.inputs) and value not in self.store_in_output:
                if program.output_specs[k].dtype is program.values[value].dtype:
                    self.store_in_output[value] = k
        # Values some output receives by a copy after the steps (not stored in place).
        self.copied_out = [False] * len(program.values)
        for k, value in enumerate(program.outputs):
            if self.store_in_output.get(value) != k:
                self.copied_out[value] = True
        self.pagewise = _pagewise(program)
        # Each step's page kernel (its record's `page`), looked up once here for a pagewise
        # plan's numpy path (`_compute_pages`), not once per step per run.
        self.page_ops = page_ops_of(program.steps, self.pagewise)
        # Step values that need scratch storage: (value id, storage shape, L1 layout, DRAM
        # fallback). A value that tiles would pad to more than twice its size is stored as its
        # least padded 2-D split (`least_padded_shape`; same elements, same order); a pagewise
        # program's values keep their shape (its pages must line up), and BFLOAT8_B ones too
        # (a block's shared exponent depends on which values share a tile row).
        # A value its program places in DRAM (`ProgramBuilder.placing`: a compiler's plan) is
        # tried in DRAM only; one placed in L1, or not placed, in L1 first.
        in_dram = {v for v, memory in program.placements if memory is MemorySpace.DRAM}
        needs = [
            (index, step.output, _scratch_shape(program.values[step.output], self.pagewise),
             Layout(MemorySpace.DRAM if step.output in in_dram else MemorySpace.L1, TensorLayout.TILE,
                    program.values[step.output].dtype),
             Layout(MemorySpace.DRAM, TensorLayout.TILE, program.values[step.output].dtype))
            for index, step in enumerate(program.steps)
            if step.output not in self.store_in_output
        ]
        # A value's scratch is free once its last reader has run, as `ttnn.deallocate` frees a
        # compiled op's result at its point: a later value of the same storage shape and layouts
        # takes it (from the step after: never an operand of the step that writes it). Each
        # value's slot is named by the first value stored there; `scratch` lists the slots. A
        # pagewise program keeps a storage per value (its C kernel's operands are its pages).
        self.scratch_slot: dict[int, int] = {}
        free: dict[Any, list[int]] = {}
        # A heap of (the step after which it is free, the value, its key, its slot).
        released: list[tuple[int, int, Any, int]] = []
        self.scratch = []
        for index, value, shape, l1, dram in needs:
            key = (shape, l1, dram)
            while released and released[0][0] < index:
                _, _, done_key, slot = heapq.heappop(released)
                free.setdefault(done_key, []).append(slot)
            pool = free.get(key)
            if pool and not self.pagewise:
                slot = pool.pop()
            else:
                slot = value
                self.scratch.append((value, shape, l1, dram))
            self.scratch_slot[value] = slot
            if not self.copied_out[value]:
                heapq.heappush(released, (max(self.last_read[value], index), value, key, slot))
        # The pagewise program as C kernel code (see `_page_code`), or None.
        self.page_code = _page_code(program, self.store_in_output, self.scratch) if self.pagewise else None
        self.input_layouts = tuple(spec.layout for spec in program.inputs)
        self.output_layouts = tuple(spec.layout for spec in program.output_specs)
        self.output_shapes = tuple(spec.shape for spec in program.output_specs)
        # (shape, dtype, layout) of each output's new tensor state (in the device's interned
        # layouts once bound).
        self.output_states = tuple((spec.shape, spec.dtype, spec.layout) for spec in program.output_specs)
        # What submit checks of each input: (shape, dtype, whether a float dtype).
        self.input_checks = tuple((spec.shape, spec.dtype, spec.dtype.is_float) for spec in program.inputs)
        # What the scheduler of one device precomputes (output geometry): bound by `bound_to`.
        self.bound: Any = None
        # Per-core L1 bytes of circular buffers while it runs (`_footprint`): bound by `bound_to`.
        self.footprint = 0
        self.macs = sum(_macs(program, step) for step in program.steps)
        # Output index -> the input index whose buffer it takes over (`output(donates=)`).
        self.donated = dict(program.donations)
        # Steps that update a donated cache in place: step index -> the output it writes.
        self.in_place = _in_place_steps(program, self.donated, self.store_in_output)
        # The submit gate, one rule for both C fast paths (`_core._dispatch.submit`,
        # `submit_spmd`): a donation (inputs consumed), collectives (resolved for the mesh's
        # groups, a rendezvous to join) or constant inputs (the const-eval cut) take the
        # checked path.
        self.checked_submit = bool(self.donated or self.collectives or self.consts or program.cache_constants)
        self.schedule = _Schedule(self)
        self._built = True  # from here on, fields are read-only

    def bound_to(self, footprint: int, input_layouts: tuple[Layout, ...],
                 output_layouts: tuple[Layout, ...], bound: Any) -> Plan:
        """This plan as one device runs it, as a new plan (this one is left as it is):
        `footprint`, the per-core L1 bytes of its circular buffers there; its input and output
        layouts as the device's own objects (equal layouts as one object, so that the fast
        decision finds a storage by identity), and its outputs' new states in those layouts;
        `bound`, what the device precomputed for the fast decision (None when it has none)."""
        plan = Plan.__new__(Plan)
        init = object.__setattr__
        for name in Plan.__slots__:
            if name != "_built":
                init(plan, name, getattr(self, name))
        init(plan, "footprint", footprint)
        init(plan, "input_layouts", input_layouts)
        init(plan, "output_layouts", output_layouts)
        init(plan, "output_states", tuple([(shape, dtype, layout) for (shape, dtype, _), layout
                                           in zip(self.output_states, output_layouts)]))
        init(plan, "bound", bound)
        init(plan, "_built", True)
        return plan

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_built", False):
            raise AttributeError(f"a Plan is immutable: cannot set {name!r} (a device binds its own "
                                 "copy with `Plan.bound_to`)")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a Plan is immutable: cannot delete {name!r}")


class _Schedule:
    """A plan's run with every per-step decision taken once: which inputs are read, and per
    step its op, where its result goes, whether a later step reads it back and which values
    die after it. `_compute` then only moves arrays (the per-step bookkeeping had cost a small
    program as much as its numpy calls)."""

    __slots__ = ("copies", "reads", "steps")

    def __init__(self, plan: Plan) -> None:
        skipped = {plan.steps[index].inputs[0] for index in plan.in_place}  # caches written in place
        self.reads = tuple(
            (index, spec.shape, plan.value_dtypes[index])
            for index, spec in enumerate(plan.inputs)
            if (plan.last_read[index] >= 0 or plan.copied_out[index]) and index not in skipped
        )
        steps = []
        checks = plan.range_checks
        for index, op in enumerate(plan.steps):
            value = op.output
            k = plan.store_in_output.get(value, -1)
            kept = plan.last_read[value] > index or plan.copied_out[value]
            dies = tuple(v for v in dict.fromkeys(op.inputs)
                         if plan.last_read[v] == index and not plan.copied_out[v])
            spec = plan.values[value]
            # Tiles of an exact dtype are written here, by the kernel (`io.write_array` otherwise).
            host_dtype = None if spec.dtype is DataType.BFLOAT8_B else spec.dtype.host_dtype
            # An `update_cache` into its donated buffer: (cache shape, value, index) instead of an op.
            cache = (plan.values[op.inputs[0]].shape, op.inputs[1], op.inputs[2]) if index in plan.in_place else None
            # A checked step (`ProgramBuilder.checking_range`): (note, op, dtype).
            check = (checks[value], op.op, spec.dtype) if value in checks else None
            # A collective: (step index, op, dtype), for the peers it exchanges values with.
            collective = (index, op.op, spec.dtype) if op.op in COLLECTIVES else None
            steps.append((plan.compute[index], op.inputs, op.scalar, plan.step_attrs[index], value, k,
                          kept, spec.shape, plan.value_dtypes[value], dies, host_dtype, cache, check,
                          collective, plan.scratch_slot.get(value, value)))
        self.steps = tuple(steps)
        self.copies = tuple((k, value) for k, value in enumerate(plan.outputs)
                            if plan.store_in_output.get(value) != k)


def _scratch_shape(spec: TensorSpec, pagewise: bool) -> tuple[int, ...]:
    if pagewise or spec.dtype is DataType.BFLOAT8_B:
        return tuple(spec.shape)
    return least_padded_shape(tuple(spec.shape))


def _in_place_steps(program: Program, donated: dict[int, int],
                    store_in_output: dict[int, int]) -> dict[int, int]:
    """The `update_cache` steps that may write only their row into the donated buffer: the
    cache is a donated input that no other step reads and no output copies, and the step's
    result is stored straight into the output that takes that buffer over."""
    readers = [0] * len(program.values)
    for step in program.steps:
        for value in step.inputs:
            readers[value] += 1
    in_place = {}
    for index, step in enumerate(program.steps):
        if step.op not in OPS or OPS[step.op].kind is not Kind.CACHE:  # `update_cache`
            continue
        cache = step.inputs[0]
        k = store_in_output.get(step.output)
        if (k is not None and donated.get(k) == cache and readers[cache] == 1
                and cache not in program.outputs):
            in_place[index] = k
    return in_place


def _macs(program: Program, step: Any) -> int:
    """Multiply-accumulates of a step, for the run estimate (its record's rule: a matmul's K
    per output element, a conv2d's C_in / groups * kH * kW; none for the others). A host op's
    cost is unknown: its measured span is the timeline's (`_ir.ops.host`)."""
    record = OPS.get(step.op)
    return record.macs(program.values, step) if record is not None and record.macs is not None else 0


def _pagewise(program: Program) -> bool:
    """Whether the program can run on its tiles' pages as they lie in bank memory.

    True when every value is FLOAT32 of one shape whose last two dims are multiples of 32 (so
    tiles have no padding), every input and output is in TILE layout, and every step is an
    exactly rounded pointwise op (add, sub, mul with a tensor of the same shape or a scalar;
    relu; neg). Element i of every tile page is then the same logical element in every operand,
    so the ops run on the pages directly: no untilize or tilize, and the same bits as the
    general path (the same IEEE operations on the same float32 values)."""
    shape = program.values[0].shape if program.values else ()
    if len(shape) < 2 or shape[-1] % 32 or shape[-2] % 32:
        return False
    f32 = DataType.FLOAT32
    if any(v.shape != shape or v.dtype is not f32 for v in program.values):
        return False
    specs = (*program.inputs, *program.output_specs)
    if any(s.layout.tensor_layout is not TensorLayout.TILE or s.layout.dtype is not f32 for s in specs):
        return False
    return all(step.op in OPS and OPS[step.op].page is not None for step in program.steps)


PageCode = tuple[tuple[int, int, int, float, int], ...]
"""`_pointwise.run` code: (op, operand a, operand b or -1 for the scalar, scalar, out) each."""
Kernel = tuple[MemorySpace, PageCode, tuple[int, ...], int, int]
"""A Compute step run by the C kernel: (memory space, code, operand addresses, rows, depth)."""


def _page_code(program: Program, store_in_output: dict[int, int],
               scratch: list[Any]) -> PageCode | None:
    """A pagewise program as `_pointwise.run` code over operand slots (inputs, then outputs,
    then scratch in the plan's order), or None to run it through numpy instead: a NaN scalar
    (numpy gives the scalar's NaN, a choice of its loops), or more operands than the kernel takes."""
    n_in, n_out = len(program.inputs), len(program.outputs)
    if n_in + n_out + len(scratch) > _pointwise.MAX_OPERANDS:
        return None
    slot = {value: value for value in range(n_in)}
    for value, k in store_in_output.items():
        slot[value] = n_in + k
    for index, (value, *_) in enumerate(scratch):
        slot[value] = n_in + n_out + index
    code = []
    for step in program.steps:
        scalar = 0.0
        if step.scalar is not None:
            scalar = float(step.scalar)
            if math.isnan(scalar):
                return None
        second = slot[step.inputs[1]] if len(step.inputs) > 1 else -1
        page = OPS[step.op].page
        assert page is not None
        code.append((getattr(_pointwise, page.opcode), slot[step.inputs[0]], second, scalar, slot[step.output]))
    for k, value in enumerate(program.outputs):
        if store_in_output.get(value) != k:
            code.append((_pointwise.OP_COPY, slot[value], -1, 0.0, n_in + k))
    return tuple(code)


class Compute(NamedTuple):
    plan: Plan
    sources: tuple[Storage, ...]
    outputs: tuple[Storage, ...]
    scratch: dict[int, Storage]
    pagewise: bool = False  # run on the pages in place (see `pagewise_storages`)
    # For the C kernel: (memory space, code, operand addresses, bank rows, depth), or None.
    kernel: Kernel | None = None
    # On a chip of an SPMD submit: its place in the submit's rendezvous (`_mesh.collectives.
    # Peer`), through which the collective steps exchange values with the other chips.
    peers: Any = None
    # Under debug hooks (`_debug.DebugHooks`): `hooks.run(...)` gives the run whose `before` and
    # `after` are called around each step (on a thread of anyio's: they call back into the loop).
    hooks: Any = None


def page_kernel(plan: Plan, operands: tuple[Storage, ...], num_banks: int) -> Kernel | None:
    """`Compute.kernel` for a pagewise plan on these storages (inputs, outputs, scratch in the
    plan's order), or None when numpy runs it."""
    code = plan.page_code
    if code is None:
        return None
    first = operands[0]
    pages = first.num_pages
    depth = -(-pages // num_banks) * first.aligned_page_size
    return first.layout.memory, code, tuple([s.address for s in operands]), min(pages, num_banks), depth


def pagewise_storages(plan: Plan, storages: tuple[Storage, ...]) -> bool:
    """Whether a pagewise plan may run in place on these storages: all in one memory space (so
    page i lies in the same bank and slot in every operand) with unpadded pages."""
    if not plan.pagewise or not storages:
        return False
    space = storages[0].layout.memory
    return all(
        s.layout.memory is space and s.aligned_page_size == s.page_size
        for s in storages
    )


Step = Union[Store, Load, Copy, Slide, Compute]


OpSpan = tuple[int, float, float]  # a step's index in its program, and its perf_counter span
_op_timing: ThreadSpans[OpSpan] = ThreadSpans()


def timing_steps() -> AbstractContextManager[list[OpSpan]]:
    """Notes the span of every step a program runs on this thread inside the block (a timed
    record's run: the timeline draws each op as a slice inside its program's, named by its
    location). Pagewise programs and the C kernel run whole and note none."""
    return _op_timing.collecting()


class Record(NamedTuple):
    """A decided command: its steps, and what they move and compute (for the run estimate)."""

    steps: tuple[Step, ...]
    nbytes: int = 0
    macs: int = 0
    timed: bool = False  # run returns each Compute step's (start, end, host op spans, op spans), for the timeline
    kernel_bytes: int = 0  # the part of nbytes that the C pointwise kernel moves

    @property
    def seconds(self) -> float:
        """A rough estimate of the run time: decides inline versus a worker thread (a host op's
        unknown time is not in it)."""
        return estimate(self.nbytes, self.kernel_bytes, self.macs)


def estimate(nbytes: int, kernel_bytes: int, macs: int) -> float:
    """Seconds to move `nbytes` (of which `kernel_bytes` by the pointwise kernel) and do `macs`."""
    return ((nbytes - kernel_bytes) / BYTES_PER_SECOND + kernel_bytes / KERNEL_BYTES_PER_SECOND
            + macs / MACS_PER_SECOND)


def is_transfer(record: Record) -> bool:
    """Whether `record` only moves bytes between host arrays and the banks (a write, a read, a
    batch of writes): a worker process's queue runs these in the host (`_workers.process`)."""
    for step in record.steps:  # (a loop, not all(): asked of every record a worker is sent)
        kind = type(step)
        if kind is not Store and kind is not Load:
            return False
    return True


def run(record: Record, banks: Banks) -> Any:
    """Runs a record's steps in order; returns what its `Load` step read, if it has one (or,
    for a timed record, the perf_counter span of each Compute step, with the spans of the host
    ops it called and of each op it ran: `(start, end, [HostSpan, ...], [OpSpan, ...])`)."""
    steps = record.steps
    if len(steps) == 1 and not record.timed:
        step = steps[0]
        if type(step) is Compute:
            kernel = step.kernel  # type: ignore[union-attr]
            if kernel is not None:  # the tiny-op path: C, which raises no FP warnings
                space, code, addresses, rows, depth = kernel
                _pointwise.run(banks[space], code, addresses, rows, depth)
                return None
    with np.errstate(all="ignore"):  # once per record, not per op: ops' results are results
        return _run(record, banks)


def _run(record: Record, banks: Banks) -> Any:
    timed = record.timed
    result: Any = [] if timed else None
    perf_counter = time.perf_counter
    kernel_run = _pointwise.run
    for step in record.steps:
        kind = type(step)  # exact types: cheaper than isinstance on the hot path
        if kind is Compute:
            kernel = step.kernel  # type: ignore[union-attr]
            start = perf_counter() if timed else 0.0
            if kernel is not None:  # a replay's tiny programs: straight to the C kernel
                kernel_run(banks[kernel[0]], kernel[1], kernel[2], kernel[3], kernel[4])
                if timed:
                    result.append((start, perf_counter(), (), ()))
            elif timed:
                with timing_host_ops() as host_spans, timing_steps() as op_spans:
                    _compute(cast(Compute, step), banks)
                result.append((start, perf_counter(), host_spans, op_spans))
            else:
                _compute(cast(Compute, step), banks)
        elif kind is Copy:
            copy = cast(Copy, step)
            src, dst = copy.src, copy.dst
            io.copy_storage(banks[src.layout.memory], src, banks[dst.layout.memory], dst, copy.shape)
        elif kind is Slide:
            slide = cast(Slide, step)
            bank = banks[slide.space]
            # numpy copies through a temporary when the ranges overlap, as memmove does.
            bank[:, slide.target:slide.target + slide.depth] = bank[:, slide.source:slide.source + slide.depth]
        elif kind is Store:
            store = cast(Store, step)
            dst = store.dst
            if store.staged is not None:
                io.land(banks[dst.layout.memory], dst, store.staged)
            elif store.array is None:
                io.zero_fill(banks[dst.layout.memory], dst)
            else:
                io.write_array(banks[dst.layout.memory], dst, store.array)
        else:
            load = cast(Load, step)
            result = io.read_array(banks[load.src.layout.memory], load.src, load.shape)
    return result


def run_all(records: list[Record], banks: Banks) -> list[BaseException | None]:
    """Runs several records (one worker hand-off for all); each fails alone."""
    errors: list[BaseException | None] = []
    for record in records:
        try:
            run(record, banks)
            errors.append(None)
        except Exception as exc:
            errors.append(exc)
    return errors


def _pages(storage: Storage, banks: Banks) -> np.ndarray[Any, Any]:
    """The storage's pages as float32, as they lie in its banks (page i: bank i % banks)."""
    pages = storage.pages
    if pages is not None:
        return pages
    buf = storage
    bank = banks[storage.layout.memory]
    banks_used = min(buf.num_pages, bank.shape[0])
    depth = -(-buf.num_pages // bank.shape[0]) * buf.aligned_page_size
    pages = storage.pages = bank[:banks_used, buf.address : buf.address + depth].view(np.float32)
    return pages


def _compute_pages(step: Compute, banks: Banks) -> None:
    kernel = step.kernel
    if kernel is not None:
        space, code, addresses, rows, depth = kernel
        _pointwise.run(banks[space], code, addresses, rows, depth)
        return
    plan, sources, outputs, scratch = step.plan, step.sources, step.outputs, step.scratch
    views: list[Any] = [None] * len(plan.values)
    for index, storage in enumerate(sources):
        views[index] = _pages(storage, banks)
    for op, page in zip(plan.steps, plan.page_ops):  # a pagewise plan's steps all have one (`_pagewise`)
        k = plan.store_in_output.get(op.output)
        out = _pages(outputs[k] if k is not None else scratch[op.output], banks)
        b = None if len(op.inputs) < 2 and op.scalar is None else (
            views[op.inputs[1]] if op.scalar is None else np.float32(op.scalar))
        page.run(views[op.inputs[0]], b, out)
        views[op.output] = out
    for k, value in enumerate(plan.outputs):
        if plan.store_in_output.get(value) != k:
            np.copyto(_pages(outputs[k], banks), views[value])


def _compute(step: Compute, banks: Banks) -> None:
    plan = step.plan
    if step.hooks is not None:  # decided op by op (never pagewise, never the kernel)
        run = step.hooks.run(plan, step.sources, step.outputs, step.scratch, banks)
        _run_schedule(plan.schedule, len(plan.values), step.sources, step.outputs, step.scratch, banks,
                      step.peers, run)
        return
    if step.pagewise:
        _compute_pages(step, banks)
        return
    _run_schedule(plan.schedule, len(plan.values), step.sources, step.outputs, step.scratch, banks,
                  step.peers)


def _run_schedule(schedule: _Schedule, n_values: int, sources: tuple[Storage, ...],
                  outputs: tuple[Storage, ...], scratch: dict[int, Storage], banks: Banks,
                  peers: Any = None, hooked: Any = None) -> None:
    """The program's steps over numpy arrays; `hooked` (a debug-hooks run) is told before and
    after each step, and may replace values in their storages (`values` is read again)."""
    values: list[np.ndarray[Any, Any] | None] = [None] * n_values
    read, write, write_tiles, tile = io.read_array, io.write_array, io.write_tiles, TensorLayout.TILE
    op_spans = _op_timing.current()  # a timeline listens
    perf_counter = time.perf_counter
    for index, shape, dtype in schedule.reads:
        storage = sources[index]
        values[index] = read(banks[storage.layout.memory], storage, shape).astype(dtype, copy=False)
    if hooked is not None:
        hooked.begin(values)
    for step_index, (fn, inputs, scalar, attrs, value, k, kept, shape, dtype, dies, host_dtype, cache, check,
                     collective, slot) in enumerate(schedule.steps):
        if hooked is not None:
            hooked.before(step_index, values)
        if op_spans is not None:
            op_start = perf_counter()
        storage = outputs[k] if k >= 0 else scratch[slot]
        layout = storage.layout
        bank = banks[layout.memory]
        stored: np.ndarray[Any, Any] | None
        if cache is not None:
            cache_shape, new_row, row_index = cache
            _update_in_place(cache_shape, values[new_row], values[row_index], bank, storage)
            stored = None  # the rest of the buffer was not written here: read back if needed
        else:
            operands = [values[v] for v in inputs]
            if collective is not None and peers is not None:  # bytes to and from the other chips
                result = peers.collective(collective[0], collective[1], operands[0], attrs, collective[2])
            else:
                result = fn(operands, scalar, **attrs)
            if check is not None:
                check_range(check[0], check[1], operands, result, check[2], attrs)
            if host_dtype is not None and layout.tensor_layout is tile:
                stored = np.asarray(result).astype(host_dtype, copy=False)
                write_tiles(bank, storage, stored)
            else:
                stored = write(bank, storage, result)
        if kept:
            # Later steps and copies read the value as it is stored: rounded to its dtype. An
            # exact store says what it stored; a BFLOAT8_B one (or a cache updated in place) is
            # read back from the banks.
            if stored is None:
                stored = read(bank, storage, shape)
            values[value] = stored.reshape(shape).astype(dtype, copy=False)
        if op_spans is not None:
            op_spans.append((step_index, op_start, perf_counter()))
        if hooked is not None:
            hooked.after(step_index, values)
        for v in dies:
            values[v] = None
    for k, value in schedule.copies:
        storage = outputs[k]
        kept_value = values[value]
        assert kept_value is not None  # copied out: never dies
        write(banks[storage.layout.memory], storage, kept_value)
    if hooked is not None:
        hooked.end()


def _update_in_place(cache_shape: tuple[int, ...], value: Any, index: Any, bank: np.ndarray[Any, Any],
                     storage: Storage) -> None:
    """An `update_cache` into its donated buffer: only the row band is rewritten (the cache
    buffer already holds every other row), with the op's semantics (index clamped into range,
    the value's batch dims broadcast to the cache's)."""
    row = min(max(int(index.reshape(-1)[0]), 0), cache_shape[-2] - 1)
    rows = np.broadcast_to(value, (*cache_shape[:-2], 1, cache_shape[-1]))
    io.update_row(bank, storage, row, rows.reshape(-1, cache_shape[-1]))
