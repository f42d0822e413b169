"""The offline optimum of L1 eviction, for `ttflow bench memory`: what a policy that knew the
whole run in advance would have copied out of L1.

A run is recorded as a sequence of steps (`AccessTrace`), one per completed command that touches
L1 or reads a value: the L1 copies ("items") each program needs resident while it runs (its L1
inputs and L1 outputs), its circular-buffer footprint, and the values it reads from wherever they
are (a host read, a DRAM input). `TraceRecorder` builds one from a device's scheduler listeners.

`simulate` replays a trace on an L1 of `capacity` bytes per bank (depths per bank, no
fragmentation: it is a bound) and evicts only when a step's items and footprint do not fit:

- an item is born at its first need: a program's L1 output, or the first L1 copy of a value that
  lives in DRAM. It is clean when DRAM already holds its value in its format (then evicting it
  copies nothing), dirty otherwise; an evicted item is clean from then on (its copy stays in DRAM),
  and one brought back is a reload;
- an item whose value is never used again is dead: it is dropped for free (the offline policy
  knows the tensor will not be read again, whether or not it was deallocated);
- which item goes, `rule`:
  - "optimum" (the default): clean items first, farthest next need first (Belady's MIN among
    items that cost nothing to evict), then dirty items, the one whose value lives longest
    first. With equal sizes this is the fewest bytes copied out: a clean eviction is free and
    only costs a reload, and spilling the dirty value that would stay longest covers the most
    later steps (the interval-scheduling exchange argument). With unequal sizes it is a good
    schedule, not a proven optimum: `lower_bound` gives the floor.
  - "belady": Belady's MIN by farthest next need alone (clean first on ties): the fewest
    reloads with equal sizes, but it may copy a dirty item out where a clean one would do.
  - "lru": least recently needed first (clean first on ties): the baseline MIN beats.

`lower_bound`: at each step, the dirty values alive (born, not dead) plus the step's needs and
footprint must fit, so at least the excess must have been copied out by then: a floor that no
policy, offline or not, with or without fragmentation, can go under.
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

from .._types import Layout, MemorySpace

if TYPE_CHECKING:
    from .._runtime.device import Device

__all__ = ["RULES", "AccessTrace", "Item", "SimResult", "Step", "TraceRecorder", "lower_bound", "simulate"]

RULES = ("optimum", "belady", "lru")

NEVER = math.inf


@dataclass(frozen=True)
class Item:
    """One L1 copy of a value: `depth` bytes in each bank, `nbytes` copied when it is evicted
    dirty; `clean` when DRAM holds its value in its format before it is born."""

    depth: int
    nbytes: int
    clean: bool
    value: int


@dataclass(frozen=True)
class Step:
    """One command: the items it needs in L1 while it runs (L1 inputs and outputs), the values it
    reads from wherever they are, and its circular buffers (bytes per bank)."""

    needs: tuple[int, ...] = ()
    uses: tuple[int, ...] = ()
    footprint: int = 0
    name: str = ""


@dataclass
class AccessTrace:
    """A run's L1 accesses, built with `item` and `step` (or by a `TraceRecorder`)."""

    items: list[Item] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    values: int = 0

    def value(self) -> int:
        """A new value id (items of one value share its liveness)."""
        self.values += 1
        return self.values - 1

    def item(self, depth: int, nbytes: int | None = None, clean: bool = False,
             value: int | None = None) -> int:
        """A new item; its own new value unless `value` is given; `nbytes` defaults to depth."""
        if value is None:
            value = self.value()
        self.items.append(Item(depth, depth if nbytes is None else nbytes, clean, value))
        return len(self.items) - 1

    def step(self, needs: Iterable[int] = (), uses: Iterable[int] = (), footprint: int = 0,
             name: str = "") -> None:
        needs = tuple(dict.fromkeys(needs))  # an input given twice is one item
        self.steps.append(Step(needs, tuple(dict.fromkeys(uses)), footprint, name))

    def summary(self) -> dict[str, int]:
        born_dirty = sum(1 for item in self.items if not item.clean)
        return {"steps": len(self.steps), "items": len(self.items), "values": self.values,
                "dirty_items": born_dirty,
                "needs": sum(len(step.needs) for step in self.steps)}


@dataclass
class SimResult:
    rule: str
    capacity: int
    eviction_bytes: int = 0  # dirty items copied out
    evictions: int = 0  # every item moved out (clean ones copy nothing), dead drops excluded
    dirty_evictions: int = 0
    reloads: int = 0  # items brought back after an eviction
    reload_bytes: int = 0
    dead_drops: int = 0
    overflow_steps: int = 0  # steps whose needs and footprint alone exceed the capacity
    peak: int = 0  # the most bytes per bank held (items and footprint)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _timeline(trace: AccessTrace) -> tuple[list[list[int]], list[float]]:
    """For each item, the steps that need it (ascending); for each value, its last use."""
    needed: list[list[int]] = [[] for _ in trace.items]
    last: list[float] = [-1] * trace.values
    for t, step in enumerate(trace.steps):
        for i in step.needs:
            needed[i].append(t)
            last[trace.items[i].value] = t
        for v in step.uses:
            last[v] = t
    return needed, last


def simulate(trace: AccessTrace, capacity: int, rule: str = "optimum") -> SimResult:
    """Replays `trace` on an L1 of `capacity` bytes per bank, evicting by `rule` (see the module
    docstring); what it copied and moved."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    items = trace.items
    needed, last = _timeline(trace)
    cursor = [0] * len(items)  # index into needed[i] of the next need at or after the step
    resident: dict[int, None] = {}
    dirty = [not item.clean for item in items]
    born = [False] * len(items)
    recent = [-1] * len(items)  # the last step that needed it, for LRU
    used = 0
    result = SimResult(rule, capacity)

    def next_need(i: int, t: int) -> float:
        steps, k = needed[i], cursor[i]
        while k < len(steps) and steps[k] < t:
            k += 1
        cursor[i] = k
        return steps[k] if k < len(steps) else NEVER

    def order(t: int) -> Callable[[int], tuple[Any, ...]]:
        """A key: the item to evict first has the largest key."""
        if rule == "optimum":
            # clean first, then dirty; each by farthest next need, then the latest last use
            return lambda i: (not dirty[i], next_need(i, t), last[items[i].value], -items[i].nbytes)
        if rule == "belady":
            return lambda i: (next_need(i, t), not dirty[i], items[i].depth)
        return lambda i: (-recent[i], not dirty[i], items[i].depth)

    for t, step in enumerate(trace.steps):
        # values used for the last time before this step: their items go for free
        for i in [i for i in resident if last[items[i].value] < t]:
            del resident[i]
            used -= items[i].depth
            result.dead_drops += 1
        needs = step.needs
        incoming = 0
        for i in needs:
            if i not in resident:
                incoming += items[i].depth
        if incoming + step.footprint + sum(items[i].depth for i in needs if i in resident) > capacity:
            # L1 cannot hold the step even alone: the runtime spills its L1 allocations to DRAM.
            # Nothing moves; what it makes lives in DRAM (clean once it is first brought in).
            result.overflow_steps += 1
            for i in needs:
                if not born[i]:
                    born[i] = True
                    dirty[i] = False
            continue
        want = used + incoming + step.footprint
        if want > capacity:
            key = order(t)
            keep = set(needs)
            heap = [(_negate(key(i)), i) for i in resident if i not in keep]
            heapq.heapify(heap)
            while want > capacity and heap:
                _, i = heapq.heappop(heap)
                del resident[i]
                used -= items[i].depth
                want -= items[i].depth
                result.evictions += 1
                if dirty[i]:
                    dirty[i] = False
                    result.dirty_evictions += 1
                    result.eviction_bytes += items[i].nbytes
        for i in needs:
            if i not in resident:
                resident[i] = None
                used += items[i].depth
                if born[i]:
                    result.reloads += 1
                    result.reload_bytes += items[i].nbytes
                born[i] = True
            recent[i] = t
        result.peak = max(result.peak, used + step.footprint)
    return result


def _negate(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """A max-heap key from a tuple of numbers, bools and nested tuples of them."""
    return tuple(_negate(k) if isinstance(k, tuple) else -k for k in key)


def lower_bound(trace: AccessTrace, capacity: int) -> int:
    """Bytes that any policy must copy out of L1 (see the module docstring).

    At step t, every dirty-born item whose value is alive (born at or before t, used at or after
    t) is either still in L1 or was copied out; with the step's needs and footprint that is more
    than the capacity by some excess, which was copied out, at no fewer bytes per byte of depth
    than the cheapest dirty item's `nbytes / depth`, and no fewer than the smallest item that
    could have gone. A step whose needs and footprint alone exceed the capacity is left out (the
    runtime spills it to DRAM)."""
    items = trace.items
    needed, last = _timeline(trace)
    dirty = [i for i, item in enumerate(items) if not item.clean and needed[i]]
    if not dirty:
        return 0
    ratio = min((items[i].nbytes / items[i].depth for i in dirty if items[i].depth), default=0.0)
    starts = sorted((needed[i][0], i) for i in dirty)
    alive: list[tuple[float, int]] = []  # (last use of its value, item), alive dirty items
    alive_depth = 0
    k = 0
    worst = 0
    for t, step in enumerate(trace.steps):
        while k < len(starts) and starts[k][0] <= t:
            i = starts[k][1]
            heapq.heappush(alive, (last[items[i].value], i))
            alive_depth += items[i].depth
            k += 1
        while alive and alive[0][0] < t:
            _, i = heapq.heappop(alive)
            alive_depth -= items[i].depth
        need = step.footprint + sum(items[i].depth for i in step.needs)
        if need > capacity:
            continue
        # the dirty needs are alive, so in alive_depth; the clean ones come on top
        load = alive_depth + step.footprint + sum(items[i].depth for i in step.needs if items[i].clean)
        excess = load - capacity
        if excess > 0:
            # copied out: at least `ratio` bytes per byte of depth, and at least one whole item
            needs = set(step.needs)
            smallest = min((items[i].nbytes for _, i in alive if i not in needs), default=0)
            worst = max(worst, math.ceil(excess * ratio), smallest)
    return worst


def _twin(storage_layout: Layout) -> tuple[Any, Any]:
    return storage_layout.dtype, storage_layout.tensor_layout


class TraceRecorder:
    """Records a device's L1 accesses into an `AccessTrace` while it is entered, through the
    scheduler's completion listeners (called on the loop thread, in completion order).

    Per program: its L1 inputs and outputs (by declared layout, so a recording does not depend on
    the policy that ran it), its footprint and every value it reads. A host read is a use; a
    write of a new value starts a new value (the old one's items die); a write into an L1 home
    and a `to_layout` into L1 make an item. Commands that fail are left out."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.scheduler = device._scheduler
        self.trace = AccessTrace()
        self._values: dict[Any, int] = {}  # TensorState -> its current value id
        self._items: dict[tuple[int, Layout], int] = {}
        self.commands: dict[str, int] = {}  # completed commands seen, by class name
        self.spilled_outputs = 0  # L1 outputs the runtime put in DRAM (L1 could not hold them)
        self._listening = contextlib.ExitStack()

    def __enter__(self) -> Self:
        self._listening.enter_context(self.scheduler.listening(self._listen))
        return self

    def __exit__(self, *exc: object) -> None:
        self._listening.close()
        self._values.clear()  # the states: no longer needed

    def _value(self, state: Any) -> int:
        value = self._values.get(state)
        if value is None:
            value = self._values[state] = self.trace.value()
        return value

    def _item(self, state: Any, layout: Layout, born_here: bool) -> int:
        value = self._value(state)
        key = (value, layout)
        item = self._items.get(key)
        if item is None:
            geometry = self.scheduler.geometry(layout, tuple(state.shape))
            depth, nbytes = geometry[5], geometry[2] * geometry[4]
            twin = _twin(layout)
            clean = not born_here and any(
                s.layout.memory is MemorySpace.DRAM and _twin(s.layout) == twin for s in state.storages
            )
            item = self._items[key] = self.trace.item(depth, nbytes, clean, value)
        return item

    def _listen(self, command: Any, error: BaseException | None) -> None:
        kind = type(command).__name__
        self.commands[kind] = self.commands.get(kind, 0) + 1
        if error is not None:
            return
        if kind == "ProgramCommand":
            plan = command.plan
            needs, uses = [], []
            for state, layout in zip(command.reads, plan.input_layouts):
                uses.append(self._value(state))
                if layout.memory is MemorySpace.L1:
                    needs.append(self._item(state, layout, born_here=False))
            for state, layout in zip(command.writes, plan.output_layouts):
                if layout.memory is MemorySpace.L1:
                    needs.append(self._item(state, layout, born_here=True))
                    if not any(s.layout.memory is MemorySpace.L1 for s in state.storages):
                        self.spilled_outputs += 1
            self.trace.step(needs, uses, plan.footprint, command.program.name)
        elif kind == "WriteCommand":
            (state,) = command.writes
            if command.new_value and state in self._values:
                del self._values[state]  # a new value; the old one's items are dead
            if state.declared.memory is MemorySpace.L1:
                item = self._item(state, state.declared, born_here=True)
                self.trace.step([item], name="write")
        elif kind == "ConvertCommand":
            (source,), (target,) = command.reads, command.writes
            needs = []
            if command.layout.memory is MemorySpace.L1:
                needs.append(self._item(target, command.layout, born_here=True))
            self.trace.step(needs, [self._value(source)], name="to_layout")
        elif kind in ("ReadCommand", "ReplayCommand"):
            reads = getattr(command, "reads", ())
            self.trace.step((), [self._value(state) for state in reads], name=kind)
