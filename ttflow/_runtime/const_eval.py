"""Const-eval: the part of a program that depends only on its constant inputs runs once.

A program's inputs may be declared constant (`ProgramBuilder.input(..., const=True)`, weights).
`split_of(program)` cuts it, once per program, in two programs:

- the constant program: the constant inputs, every step whose operands all derive from them
  (collectives excepted: they need the other chips of a submit), and as outputs the values of
  those steps that the rest reads or that are outputs (DRAM TILE, in their dtype);
- the main program: the other inputs (and the constants it still reads itself), then those
  values as extra inputs, and the remaining steps.

A device keeps a `ConstEvalCache` (made when first needed): per (program content, constant
tensors) the constant program's output tensors. A submit looks its key up: a hit queues only
the main program on the cached tensors (`stats.const_eval_hits`); a miss queues the constant
program first (`stats.const_eval_misses`). The content key is the program's fields (ops,
values, attrs), so two `Binary` objects holding the same program (loaded twice from one file)
share entries, as tt-mlir's `global_cache_across_binaries`.

An entry is dropped, and its tensors freed, as soon as a constant's value may change or go: any
command queued to write one (`tt.write`, a trace replay into it: `Scheduler.enqueue` calls
`written`), its `tt.deallocate`, a donation that consumes it, a failed constant run (computed
again next time), and the constant's handle being dropped (a finalizer). It lives no longer
than the program that made it either (a finalizer on its `Split`, which lives as long as the
program and any trace that hoisted it): as tt-mlir's runtime keeps a binary's const-eval cache
in the binary, dropping a `Binary` frees what its programs cached. That is the only end of an
entry without constants (`ProgramBuilder.cache_constants`: a compiled program's `load_cached`
of constants it makes itself); an entry another `Binary` of the same content shares goes with
the first (the second computes it again: a miss, never a stale value).

Inside a trace capture, as tt-mlir's runtime hoists const-eval out of its traces, the constant
program is looked up (or run: a miss) once, not replayed, and only the main program is
captured, reading the cached results (`ConstUse`). A constant program run in a capture is still
the capture's command (`Capture.hoisting`): what it moves of the trace's own outputs (an
eviction as it starts) is a step of the trace, or a replay would write where an output no
longer lives. Before each replay the lookup is made again
(`refresh`): a hit when the entry stands; a miss when a constant was written since, whose new
results the replay then reads (its pinned storages refilled from them). A constant written by
the trace itself cannot be hoisted: such a program runs whole in the trace. The values are the
unsplit program's bit for bit: the cut values are stored in their own dtype, as the unsplit run
keeps them between steps.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, final

import attrs

from .._errors import TraceError
from .._ir.ops import COLLECTIVES
from .._ir.program import Program, Step, TensorSpec
from .tensor import Tensor
from .._types import Layout, MemorySpace, TensorLayout

if TYPE_CHECKING:
    from .device import Device
    from .._sched import TensorState

__all__ = ["ConstEvalCache", "Split", "split_of", "submit"]


@final
class Split:
    """A program cut at its constants (see the module's docstring)."""

    __slots__ = ("key", "const_program", "main_program", "const_inputs", "main_inputs", "__weakref__")

    def __init__(self, key: ContentKey, const_program: Program, main_program: Program,
                 const_inputs: tuple[int, ...], main_inputs: tuple[int, ...]) -> None:
        self.key = key  # the program's content
        self.const_program = const_program
        self.main_program = main_program
        self.const_inputs = const_inputs  # the program's inputs the constant program takes
        self.main_inputs = main_inputs  # the program's inputs the main program takes first


_SPLITS: weakref.WeakKeyDictionary[Program, Split | None] = weakref.WeakKeyDictionary()


@final
class ContentKey:
    """What a program computes, as a hashable value (programs hash by identity), its hash taken
    once: a submit looks its entry up by it, and hashing a compiled program's hundreds of steps
    on every submit cost more than many of their runs."""

    __slots__ = ("fields", "_hash")

    def __init__(self, fields: tuple[Any, ...]) -> None:
        self.fields = fields
        self._hash = hash(fields)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, ContentKey) and self._hash == other._hash
                                 and self.fields == other.fields)


def content_key(program: Program) -> ContentKey:
    """What a program computes (see `ContentKey`)."""
    return ContentKey((program.name, program.values, program.steps, program.outputs, program.output_specs,
                       program.num_inputs, program.donations, program.range_checks, program.consts,
                       program.mesh_shape, program.cache_constants))


def split_of(program: Program) -> Split | None:
    """The program cut at its constants, or None when no step depends only on them."""
    try:
        return _SPLITS[program]
    except KeyError:
        split = _SPLITS[program] = _split(program) if program.consts or program.cache_constants else None
        return split


def _cached_spec(spec: TensorSpec) -> TensorSpec:
    return TensorSpec(spec.shape, Layout(MemorySpace.DRAM, TensorLayout.TILE, spec.dtype))


def _split(program: Program) -> Split | None:
    n = program.num_inputs
    const = [False] * len(program.values)
    for index in program.consts:
        const[index] = True
    hoisted: list[int] = []
    for index, step in enumerate(program.steps):
        if step.op not in COLLECTIVES and all(const[v] for v in step.inputs):
            const[step.output] = True
            hoisted.append(index)
    if not hoisted:
        return None
    is_hoisted = set(hoisted)
    read_by_main: set[int] = set(program.outputs)
    for index, step in enumerate(program.steps):
        if index not in is_hoisted:
            read_by_main.update(step.inputs)
    boundary = sorted(v for v in read_by_main if v >= n and const[v])
    if not boundary:
        return None  # what depends on the constants alone is never read: nothing to keep

    def renumber(step: Step, ids: dict[int, int], values: list[TensorSpec]) -> Step:
        ids[step.output] = len(values)
        values.append(program.values[step.output])
        return attrs.evolve(step, inputs=tuple(ids[v] for v in step.inputs), output=ids[step.output])

    # The constant program: the constant inputs, the hoisted steps, the boundary as outputs.
    const_inputs = tuple(sorted(program.consts))
    ids = {v: k for k, v in enumerate(const_inputs)}
    values = [program.values[v] for v in const_inputs]
    steps = [renumber(program.steps[index], ids, values) for index in hoisted]
    const_program = Program(
        name=f"{program.name}.const_eval", values=tuple(values), steps=tuple(steps),
        outputs=tuple(ids[v] for v in boundary),
        output_specs=tuple(_cached_spec(program.values[v]) for v in boundary),
        num_inputs=len(const_inputs),
        range_checks=tuple((ids[v], note) for v, note in program.range_checks if v in ids and v >= n),
        placements=tuple((ids[v], memory) for v, memory in program.placements if v in ids and v >= n),
        locations=tuple((ids[v], loc) for v, loc in program.locations if v in ids and v >= n),
    )
    # The main program: the inputs it still reads, the boundary as inputs, the other steps.
    main_inputs = tuple(i for i in range(n) if not const[i] or i in read_by_main)
    ids = {v: k for k, v in enumerate(main_inputs)}
    values = [program.values[v] for v in main_inputs]
    for v in boundary:
        ids[v] = len(values)
        values.append(_cached_spec(program.values[v]))
    num_inputs = len(values)
    steps = [renumber(step, ids, values) for index, step in enumerate(program.steps) if index not in is_hoisted]
    main_program = Program(
        name=program.name, values=tuple(values), steps=tuple(steps),
        outputs=tuple(ids[v] for v in program.outputs), output_specs=program.output_specs,
        num_inputs=num_inputs, donations=tuple((k, ids[i]) for k, i in program.donations),
        range_checks=tuple((ids[v], note) for v, note in program.range_checks if v >= n and not const[v]),
        placements=tuple((ids[v], memory) for v, memory in program.placements if v >= n and not const[v]),
        locations=tuple((ids[v], loc) for v, loc in program.locations if v >= n and not const[v]),
        mesh_shape=program.mesh_shape,
    )
    return Split(content_key(program), const_program, main_program, const_inputs, main_inputs)


@final
class _Entry:
    __slots__ = ("constants", "results", "finalizers", "__weakref__")

    def __init__(self, constants: tuple[TensorState, ...], results: list[Tensor]) -> None:
        self.constants = constants  # the constant tensors' states, compared by identity
        self.results = results  # the constant program's outputs (handles: freed when dropped)
        self.finalizers: list[weakref.finalize[Any, Any]] = []


@final
class ConstEvalCache:
    """One device's cached constant results, by (program content, constant tensors)."""

    __slots__ = ("scheduler", "entries", "watched", "__weakref__")

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.entries: dict[Any, _Entry] = {}
        self.watched: dict[int, set[Any]] = {}  # id of a constant's state -> the keys that use it

    def written(self, states: Sequence[TensorState]) -> None:
        """Commands were queued that write these states: entries on any of them go."""
        for state in states:
            keys = self.watched.pop(id(state), None)
            if keys:
                for key in keys:
                    entry = self.entries.get(key)
                    if entry is not None and any(c is state for c in entry.constants):
                        self.drop(key)

    def forget(self, state: TensorState) -> None:
        """The state was deallocated or consumed: its entries go."""
        self.written((state,))

    def drop(self, key: Any) -> None:
        """Frees an entry's tensors (once the work queued on them is done)."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return
        for finalizer in entry.finalizers:
            finalizer.detach()
        for tensor in entry.results:
            state = tensor._state
            if not state.deallocated:
                self.scheduler.deallocate(state)

    def store(self, key: Any, split: Split, constants: tuple[TensorState, ...], results: list[Tensor],
              handles: Sequence[Tensor]) -> _Entry:
        entry = self.entries[key] = _Entry(constants, results)
        for state in constants:
            self.watched.setdefault(id(state), set()).add(key)
        # The program going (its split with it) frees the entry as a dropped constant does.
        entry.finalizers.append(weakref.finalize(split, _dropped, weakref.ref(self), key, weakref.ref(entry)))
        for handle in {id(h): h for h in handles}.values():
            # A dropped constant handle frees the entry (on whatever thread collects it: the
            # entry's handles are then dropped as any handle is, not deallocated here).
            entry.finalizers.append(weakref.finalize(handle, _dropped, weakref.ref(self), key, weakref.ref(entry)))
        return entry


def _dropped(cache_ref: weakref.ref[ConstEvalCache], key: Any, entry_ref: weakref.ref[_Entry]) -> None:
    """A finalizer's end of an entry: only that entry (a later one under its key stays)."""
    cache, entry = cache_ref(), entry_ref()
    if cache is not None and entry is not None and cache.entries.get(key) is entry:
        del cache.entries[key]
        for finalizer in entry.finalizers:
            finalizer.detach()


@final
@attrs.frozen(eq=False)
class ConstUse:
    """A captured program's constant part: its cut, the constant tensors it was computed from
    (with weak references to their handles: a trace does not keep a constant alive), and the
    result states the captured main program reads."""

    split: Split
    constants: tuple[TensorState, ...]
    handles: tuple[weakref.ref[Tensor], ...]
    results: tuple[TensorState, ...]


def _lookup(device: Device, split: Split, constants: tuple[TensorState, ...], handles: Sequence[Tensor],
            run: Callable[[Program, tuple[TensorState, ...]], tuple[TensorState, ...]]) -> _Entry:
    """The cache entry of `split` on these constants, its constant program queued on a miss;
    counts the hit or the miss."""
    scheduler = device._scheduler
    cache: ConstEvalCache = scheduler.attach_const_cache(ConstEvalCache)
    key = (split.key, tuple(map(id, constants)))
    entry = cache.entries.get(key)
    if entry is not None and (any(a is not b for a, b in zip(entry.constants, constants))
                              or any(t._state.error is not None or t._state.deallocated for t in entry.results)):
        cache.drop(key)  # another tensor at a reused address, or a failed run: compute again
        entry = None
    if entry is None:
        results = run(split.const_program, constants)
        entry = cache.store(key, split, constants, [Tensor._wrap(device, state) for state in results], handles)
        scheduler.count("const_eval_misses", 1)
    else:
        scheduler.count("const_eval_hits", 1)
    return entry


def submit(device: Device, program: Program, inputs: Sequence[Tensor],
           run: Callable[[Program, tuple[TensorState, ...]], tuple[TensorState, ...]]
           ) -> tuple[TensorState, ...] | None:
    """Queues `program` through its constant cut (`run` queues one program on the device):
    its output states, or None to let the caller run it whole (nothing to cut, or a constant
    the capture under way writes)."""
    split = split_of(program)
    if split is None:
        return None
    scheduler = device._scheduler
    capture = scheduler.capturing
    constants = tuple(inputs[i]._state for i in split.const_inputs)
    handles = [inputs[i] for i in split.const_inputs]
    if capture is None:
        entry = _lookup(device, split, constants, handles, run)
    else:
        if any(state in capture.outputs for state in constants):
            return None  # produced inside the trace: every replay changes it
        with capture.hoisting():
            entry = _lookup(device, split, constants, handles, run)
        capture.const_uses.append(ConstUse(split, constants, tuple(weakref.ref(h) for h in handles),
                                           tuple(t._state for t in entry.results)))
    states = tuple(inputs[i]._state for i in split.main_inputs)
    return run(split.main_program, states + tuple(t._state for t in entry.results))


def refresh(device: Device, capture: Any) -> None:
    """Before a replay of `capture`: each constant part it read is looked up again (a hit, or
    a miss that queues its constant program), and the replay reads the entry's results."""
    scheduler = device._scheduler
    for k, use in enumerate(capture.const_uses):
        handles = [ref() for ref in use.handles]
        for state, handle in zip(use.constants, handles):
            if handle is None or state.deallocated:
                raise TraceError(
                    f"a constant input {state.shape} {state.dtype.name} of the trace was deallocated "
                    "since capture; keep constants alive until the trace is released")
        entry = _lookup(device, use.split, use.constants, handles, scheduler.submit)  # type: ignore[arg-type]
        results = tuple(t._state for t in entry.results)
        if results != use.results:
            for old, new in zip(use.results, results):
                capture.retarget(old, new)
            capture.const_uses[k] = ConstUse(use.split, use.constants, use.handles, results)
