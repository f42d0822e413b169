"""`FlightRules`: work held in flight on one queue while the other goes on, and the fast path.

Each mechanism that decides how work interleaves gets rules that drive it:

- `run_one_queue`: one queue's worker runs until that queue is idle or waits for the other,
  whose records stay in flight: CQ0 evicts, relocates and compacts while CQ1 holds writes.
- `writes_in_flight`: several writes to one tensor queued, the first decided and held on CQ1's
  worker, then room asked for in L1 (a tensor larger than its largest hole) and CQ0 let run.
- `inline_threshold`: the device's inline threshold (-1: every record on a worker, so held;
  the default: tiny programs on the C fast path; 1 s: everything inline, nothing held).
- `submit_chain`: a chain of programs, each reading an output of the one before in its declared
  layout, submitted in one go at `inline_seconds=-1`: the queue decides and sends them to its
  (held) worker ahead of their turn, each reading the storage the one before will write
  (`ProgramCommand.decidable_ahead`), so that later rules free, move and wait around records in
  flight that read what has not yet been written.
- `submit_fast_path`: chains of pagewise DRAM programs (`fast_programs`) on tensors made with
  hand-written layouts equal to the declared ones. Every queue checks the C fast path against
  its Python twin (`CommandQueue.check_twin`); the `fast_path_agrees` invariant fails when the
  C path refused a program its twin says it must take.
"""

from __future__ import annotations

from typing import Any, ClassVar

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from .._commands import INLINE_SECONDS
from .._runtime.device import Device
from .._ir.program import TensorSpec
from .._runtime.calls import submit, write
from .._types import Layout
from ._machine_base import ModelProgram, _settled
from ._machine_memory import MemoryRules
from ._model import ModelTensor
from ._reference import stored
from ._strategies import arrays

__all__ = ["FlightRules"]

_THRESHOLDS = (-1.0, INLINE_SECONDS, 1.0)


def _set_inline(device: Device, seconds: float) -> None:
    device.inline_seconds = seconds


def _check_twins(device: Device, on: bool) -> None:
    for queue in (device._cq0, device._cq1):
        queue.check_twin = on


def _missed(device: Device) -> int:
    return int(device._cq0.fast_path_missed + device._cq1.fast_path_missed)


def _fast_runs(device: Device) -> int:
    return int(device._scheduler.counters["fast_path_programs"])


def _submit_all(device: Device, submits: list[tuple[ModelProgram, list[Any], int | None]]) -> list[list[Any]]:
    """Submits each program in turn, on the loop thread with nothing in between (`inputs`: its
    tensors, the one at `chained` taken from the previous submit's first output)."""
    outputs: list[list[Any]] = []
    for chosen, inputs, chained in submits:
        tensors = list(inputs)
        if chained is not None:
            tensors[chained] = outputs[-1][0]
        outputs.append(submit(device, chosen.binary, chosen.index, tensors))
    return outputs


def _chains_into(before: ModelProgram, after: ModelProgram) -> int | None:
    """The input of `after` that `before`'s first output fits exactly (shape and declared
    layout), or None."""
    out = before.program.output_specs[0]
    for k, spec in enumerate(after.program.inputs):
        if spec.shape == out.shape and spec.layout == out.layout:
            return k
    return None


def _hand_written(layout: Layout) -> Layout:
    """An equal layout, made anew (not the object the program holds)."""
    return Layout(layout.memory, layout.tensor_layout, layout.dtype)


class FlightRules(MemoryRules):
    """The in-flight and fast-path rules of `RuntimeStateMachine`."""

    failing_programs: ClassVar[tuple[tuple[ModelProgram, type[Exception]], ...]] = ()
    """Programs whose run always fails, and the error it fails with (one that stores an
    infinity as BFLOAT8_B, say: decided, sent, then failed in the worker), which `submit_chain`
    may start a chain with: what is sent behind them must fail with their error."""
    fast_programs: ClassVar[tuple[ModelProgram, ...]] = ()
    """Pagewise programs whose operands all lie in DRAM alike (what the C fast path runs), for
    `submit_fast_path`."""

    def __init__(self) -> None:
        super().__init__()
        self.call(_check_twins, self.device, True)

    @invariant()
    def fast_path_agrees(self) -> None:
        """The C fast path took every program its Python twin says it must."""
        missed = self.call(_missed, self.device)
        assert missed == 0, (
            f"the C fast path refused {missed} program(s) that its Python twin "
            "(ProgramCommand.takes_fast_path) says it must take: the two drifted apart")

    @invariant()
    def room_made_in_cq0_only(self) -> None:
        """Room is made in one place, in CQ0's order: CQ1 (writes) never asks for it."""
        asked = self.device._cq1.room_requests
        assert asked == 0, f"CQ1 asked for room {asked} time(s): two queues moving buffers at once"

    @precondition(lambda self: self.has(lambda e: not e.deallocated and e.known_failed, any_shape=True))
    @rule(data=st.data())
    def write_into_failed(self, data: st.DataObject) -> None:
        """A write into a tensor whose producer failed (out of memory, say): it fails on CQ1
        with the tensor's error, which stays, and CQ1 makes no room for it (a write allocates
        nothing: `room_made_in_cq0_only`)."""
        entry = self.pick(data, lambda e: not e.deallocated and e.known_failed, any_shape=True)
        self.call(write, entry.tensor, data.draw(arrays(entry.dtype, entry.shape), label="array"))
        event(f"write into a tensor that failed with {entry.error.__name__ if entry.error else '?'}")

    @precondition(lambda self: self.hold is not None and self.hold.held)
    @rule(which=st.sampled_from(["CQ0", "CQ1"]))
    def run_one_queue(self, which: str) -> None:
        """Lets one queue run while the other's records stay in flight (held on its worker)."""
        assert self.hold is not None
        self.portal.call(self.hold.run_alone, which, self.timeout)
        event(f"run_one_queue: {which}")

    @rule(seconds=st.sampled_from(_THRESHOLDS))
    def inline_threshold(self, seconds: float) -> None:
        self.call(_set_inline, self.device, seconds)

    @precondition(lambda self: self.room() and self.has(lambda e: e.usable, any_shape=True))
    @rule(data=st.data())
    def writes_in_flight(self, data: st.DataObject) -> None:
        """Two or three writes to one tensor, the queue settled after the first (CQ1 decides it
        and hands it to its held worker: in flight), then maybe room asked for in L1 and CQ0
        let run alone: nothing may move or free the tensor's buffer under the write in flight,
        nor reuse it (its value and every other tensor's are checked at the next drain)."""
        entry = self.pick(data, lambda e: e.usable, any_shape=True)
        count = data.draw(st.integers(2, 3), label="writes")
        values = [data.draw(arrays(entry.dtype, entry.shape), label=f"write {k}") for k in range(count)]
        then = data.draw(st.sampled_from(["nothing", "room", "room_and_run"]), label="then")
        choice_seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
        for k, value in enumerate(values):
            self.call(write, entry.tensor, value)
            entry.expected = stored(value, entry.dtype)
            if k == 0:
                self.portal.call(_settled, lambda: None, self.settle_checkpoints)
        if then != "nothing":
            self._ask_l1_room(choice_seed)
        if then == "room_and_run" and self.hold is not None and self.hold.held:
            self.portal.call(self.hold.run_alone, "CQ0", self.timeout)
        event(f"writes_in_flight: {entry.tensor.layout.memory.name}, then {then}")

    @precondition(lambda self: self.room() and bool(self.programs))
    @rule(data=st.data())
    def submit_chain(self, data: st.DataObject) -> None:
        """Two to four programs, each reading the one before's first output in its declared
        layout, submitted with nothing in between at `inline_seconds=-1`: all decided and sent
        to the (held) worker ahead of their turn, reading storages not yet written (when the
        device settled first: a fresh input's write still queued on CQ1 blocks the chain)."""
        failing = dict(self.failing_programs)
        pool = [*self.programs, *failing]
        chain = [data.draw(st.sampled_from(pool), label="program 0")]
        links: list[int | None] = [None]
        for k in range(1, data.draw(st.integers(2, 4), label="chain")):
            fitting = [p for p in pool if _chains_into(chain[-1], p) is not None]
            if not fitting:
                break
            chain.append(data.draw(st.sampled_from(fitting), label=f"program {k}"))
            links.append(_chains_into(chain[-2], chain[-1]))

        def declared(k: int, spec: TensorSpec) -> st.SearchStrategy[Layout]:
            return st.just(spec.layout)

        drawn = [self._draw_inputs(data, chosen.program, declared) for chosen in chain]
        if data.draw(st.booleans(), label="settle first"):  # else fresh inputs' writes block it
            self.drain_and_check()
        self.call(_set_inline, self.device, -1.0)
        submitted = self.call(_submit_all, self.device, [
            (chosen, [e.tensor for e in inputs], link) for chosen, inputs, link in zip(chain, drawn, links)])
        previous: list[ModelTensor] = []
        for chosen, inputs, link, outputs in zip(chain, drawn, links, submitted):
            if link is not None:
                inputs = [*inputs[:link], previous[0], *inputs[link + 1:]]
            previous = self.run_program(chosen, inputs, submitted=outputs)
            if chosen in failing:
                for entry in previous:
                    entry.expected, entry.fails_with = None, failing[chosen]
        event(f"submit_chain: {len(chain)} programs" + (", one failing" if set(chain) & set(failing) else ""))

    @precondition(lambda self: self.room() and bool(self.fast_programs))
    @rule(data=st.data())
    def submit_fast_path(self, data: st.DataObject) -> None:
        """A chain of pagewise DRAM programs on tensors made with hand-written layouts (equal to
        the declared ones, other objects), at the default inline threshold: the C fast path's
        territory. Its twin check (`fast_path_agrees`) says whether it took each one it must."""
        chosen = data.draw(st.sampled_from(self.fast_programs), label="program")
        length = data.draw(st.integers(1, 4), label="chain")
        settle = data.draw(st.booleans(), label="settle first")

        def hand_written(k: int, spec: TensorSpec) -> st.SearchStrategy[Layout]:
            return st.just(_hand_written(spec.layout))

        inputs = self._draw_inputs(data, chosen.program, hand_written)
        before = self.call(_fast_runs, self.device)
        self.call(_set_inline, self.device, INLINE_SECONDS)
        if settle:
            self.drain_and_check()
        outputs: list[Any] = []
        for _ in range(length):
            outputs = self.run_program(chosen, inputs)
            fits = [o for o in outputs if o.shape == chosen.program.inputs[0].shape
                    and o.dtype is chosen.program.inputs[0].dtype]
            if not fits:
                break
            inputs = [fits[0], *inputs[1:]]
        event(f"submit_fast_path: {self.call(_fast_runs, self.device) - before} on the fast path now")
