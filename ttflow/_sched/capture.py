"""Trace capture: what a capture records, the command that seals it, and its replay.

A capture sees every command queued while it is open (`Capture.admit`) and keeps the records
they decide, pinning the storages those read and write (`SchedulerState.pin`), so that a replay
allocates nothing and runs the records back to back as one command (`ReplayCommand`). The
scheduler's entry points (`Scheduler.begin_capture`, ...) are thin: the rules are the functions
at the end of this module, and the state they change goes through `SchedulerState`'s methods
(`open_capture`, `close_capture`, `pin`, `unpin`, `adopt`, `set_storages`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, final

from .._commands import Compute, Copy, Record, page_kernel, pagewise_storages
from .._errors import OutOfMemoryError, TraceError
from .._memory.banks import TRACE_BYTES_PER_COMMAND, Storage
from .._queue import Command, CommandQueue
from .._types import MemorySpace
from .commands import ConvertCommand, ProgramCommand, ReadCommand, WriteCommand, _Scheduled
from .moves import EvictCommand
from .state import FootprintClash, SchedulerState, TensorState

__all__ = ["Capture", "SealCommand", "ReplayCommand", "begin", "end", "check_replay", "replay", "release"]


@final
class Capture:
    """What a trace capture recorded, built as its commands complete (in queue order).

    Frozen at capture: every step (conversions, evictions, programs) of the tensors produced inside
    the trace, and the storages they read. Those storages are pinned, so replay allocates nothing.
    Inputs from outside the trace (weights, a written slot) are read where the trace read them;
    when such a storage is no longer one of its tensor's (a write dropped the conversion, an
    eviction moved the home), replay first refills it from the tensor's current value.
    """

    __slots__ = ("scheduler", "outputs", "inputs", "steps", "external", "pinned", "snapshot",
                 "programs", "nbytes", "kernel_bytes", "macs", "error", "released",
                 "replays_pending", "footprint", "collective_steps", "commands", "trace_buffer",
                 "const_uses", "renamed", "hoisted", "hoisting_now", "__weakref__")

    def __init__(self, scheduler: SchedulerState) -> None:
        self.scheduler = scheduler
        self.outputs: dict[TensorState, None] = {}  # written by a captured command
        self.inputs: dict[TensorState, None] = {}  # read by one, written by none
        self.steps: list[Any] = []
        self.external: dict[tuple[TensorState, Storage], None] = {}
        self.pinned: dict[Storage, None] = {}
        self.snapshot: list[tuple[TensorState, tuple[Storage, ...]]] = []
        self.programs: list[str] = []
        self.nbytes = 0
        self.kernel_bytes = 0
        self.macs = 0
        self.error: BaseException | None = None
        self.released = False
        self.replays_pending = 0
        self.footprint = 0  # the largest circular-buffer region of its programs
        # The steps whose programs exchange values with other chips (a mesh trace's collectives:
        # their `Compute.peers` is the captured submit's place in its rendezvous); each replay
        # gives them a fresh one (`ReplayCommand.peers.replace`).
        self.collective_steps: list[int] = []
        self.commands = 0  # captured commands: what its trace buffer holds (`end`)
        self.trace_buffer: int | None = None  # its address in the device's trace region, if any
        # What its programs read from the device's const-eval cache (`_const_eval.ConstUse`):
        # computed outside the trace, looked up again before each replay.
        self.const_uses: list[Any] = []
        self.renamed: dict[TensorState, TensorState] = {}  # retargeted inputs (`retarget`)
        # Commands queued while it is open but run once, outside the trace (a program's constant
        # part: `hoisting`), not yet decided; and whether such commands are being queued now.
        self.hoisted: set[Command] = set()
        self.hoisting_now = False

    @staticmethod
    def admit_transfer() -> None:
        raise TraceError(
            "host transfers cannot be captured: push inputs before the capture, write them "
            "between replays (tt.write), and read outputs after tt.execute_trace"
        )

    @contextmanager
    def hoisting(self) -> Iterator[None]:
        """What is queued inside runs once and is not replayed (a program's constant part,
        `_const_eval`). Its commands still belong to the capture (`hoisted`): the evictions they
        make of the trace's own outputs are captured steps like any captured command's, so that
        a replay writes where the outputs then live."""
        assert not self.hoisting_now
        self.hoisting_now = True
        try:
            yield
        finally:
            self.hoisting_now = False

    def admit(self, command: Command, queue: CommandQueue) -> None:
        """A command queued while capturing: it becomes part of the trace."""
        if queue is not self.scheduler.cq0 or isinstance(command, (ReadCommand, WriteCommand)):
            self.admit_transfer()  # (a write is on CQ0 too with one hardware queue)
        assert isinstance(command, _Scheduled)
        command.capture = self
        if self.hoisting_now:
            self.hoisted.add(command)
            return
        self.commands += 1
        for state in command.reads:
            if state not in self.outputs:
                self.inputs[state] = None
        for state in command.writes:
            self.outputs[state] = None

    def _pin(self, storage: Storage) -> None:
        if storage not in self.pinned:
            self.pinned[storage] = None
            self.scheduler.pin(storage)

    def _read(self, state: TensorState, storage: Storage) -> None:
        self._pin(storage)
        if state not in self.outputs:
            # (a captured command decided after a `retarget` still names the old state)
            self.external[self.renamed.get(state, state), storage] = None

    def retarget(self, old: TensorState, new: TensorState) -> None:
        """Its replays read `new` where they read `old` (a constant result computed again):
        each replay refills the storage it pinned from `new`'s value, as it does an input
        whose storage a write dropped. Its captured commands not yet decided read `new` too."""
        for renamed, target in self.renamed.items():
            if target is old:
                self.renamed[renamed] = new
        self.renamed[old] = new
        if old in self.inputs:
            del self.inputs[old]
            self.inputs[new] = None
        for state, storage in [key for key in self.external if key[0] is old]:
            del self.external[state, storage]
            self.external[new, storage] = None

    def failed(self, error: BaseException) -> None:
        """A captured command failed: the trace cannot be replayed."""
        if self.error is None:
            self.error = error

    def decided(self, command: Command, record: Record) -> None:
        """A captured command was decided: keep what replay must run again, and pin its storages
        before its commit frees any (scratch) for others to take."""
        if command in self.hoisted:  # run once, not replayed (`hoisting`)
            self.hoisted.discard(command)
            return
        if isinstance(command, ProgramCommand):
            *copies, compute = record.steps
            assert isinstance(compute, Compute)
            for state, copy in zip(command.converted, copies):
                assert isinstance(copy, Copy)
                if state in self.outputs:
                    self.steps.append(copy)
                    self._pin(copy.src)
                    self._pin(copy.dst)
                # a conversion of an outside input is refilled only when it goes stale
            for state, source in zip(command.reads, compute.sources):
                self._read(state, source)
            for storage in (*compute.outputs, *compute.scratch.values()):
                self._pin(storage)
            if compute.peers is not None:
                self.collective_steps.append(len(self.steps))
            self.steps.append(compute)
            self.programs.append(command.program.name)
            self.footprint = max(self.footprint, command.plan.footprint)
            self.macs += record.macs
        elif isinstance(command, ConvertCommand):
            (copy,) = record.steps
            assert isinstance(copy, Copy)
            self._read(command.reads[0], copy.src)
            self._pin(copy.dst)
            self.steps.append(copy)
        elif isinstance(command, EvictCommand):
            moved = iter(record.steps)
            for state, storage, target in command.moves:
                if target is None:
                    continue
                copy = next(moved)
                if state in self.outputs:  # refilled by each replay, so moved again
                    self._pin(storage)
                    self._pin(target)
                    self.steps.append(copy)
        self.nbytes += record.nbytes
        self.kernel_bytes += record.kernel_bytes

    def seal(self) -> None:
        """Every captured command is done: what each produced tensor holds after a replay."""
        self.snapshot = [
            (state, tuple(state.storages)) for state in self.outputs if not state.deallocated
        ]

    def rebind(self) -> None:
        """Recomputes how its recorded programs run on their storages (pagewise or not, the C
        kernel's operand addresses): a pinned storage was moved in place."""
        s = self.scheduler
        for index, step in enumerate(self.steps):
            if type(step) is Compute and step.plan.pagewise:
                # a buffer moved to DRAM may leave the operands in two spaces: then numpy runs it
                operands = (*step.sources, *step.outputs, *step.scratch.values())
                pagewise = pagewise_storages(step.plan, operands)
                kernel = (page_kernel(step.plan, operands, s.num_banks(operands[0].layout.memory))
                          if pagewise else None)
                self.steps[index] = step._replace(pagewise=pagewise, kernel=kernel)

    def writes(self, state: TensorState) -> bool:
        """Whether its replays write `state` (one of its outputs) while it lives."""
        return not self.released and state in self.outputs

    def dropped(self) -> None:
        """Its `Trace` handle was garbage-collected (`collect_garbage`, on the loop thread):
        released, as a dropped tensor is freed."""
        release(self)

    def unpin_if_idle(self) -> None:
        if self.released and self.replays_pending == 0:
            for storage in self.pinned:
                self.scheduler.unpin(storage)
            self.pinned.clear()
            if self.trace_buffer is not None:
                region = self.scheduler.trace_region
                if region is not None:  # (None: the device closed and freed every buffer)
                    region.free(self.trace_buffer)
                self.trace_buffer = None


class SealCommand(Command):
    """Queued on CQ0 after a capture's commands: snapshots the capture once they are done."""

    name = "trace_capture"
    __slots__ = ("target",)

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self.target = capture

    def decide(self) -> Record:
        self.target.seal()
        return Record(())

    def forget(self) -> None:
        pass  # the capture outlives its seal


class ReplayCommand(_Scheduled):
    """One replay of a trace: its frozen steps back to back, as a single queued command.

    A replay of a mesh trace's chip carries `peers` (`_mesh.collectives.ReplayPeers`, one per
    chip and execute): its captured collective steps meet the other chips' replays of the same
    execute through it (`peers.replace(captured_peer)`), and its failure aborts them
    (`Scheduler.complete`). A replay whose trace has no collectives drops it when decided."""

    name = "trace_replay"
    __slots__ = ("target", "refilled", "spans")

    def __init__(self, scheduler: SchedulerState, capture: Capture, inputs: tuple[TensorState, ...],
                 outputs: tuple[TensorState, ...]) -> None:
        super().__init__(scheduler, inputs, outputs)
        self.target = capture
        self.refilled: list[tuple[TensorState, Storage, Storage]] = []  # (state, source, refilled)
        # Each program's run, its host ops' calls and its ops, for the timeline (`_commands.run`).
        self.spans: list[tuple[float, float, Any, Any]] = []

    def decide(self) -> Record:
        capture = self.target
        if capture.error is not None:
            raise TraceError(f"the capture failed: {capture.error}") from capture.error
        steps: list[Any] = []
        nbytes = capture.nbytes
        self.refilled = []  # (decided again after room was made)
        for state, storage in capture.external:
            if storage in state.storages:
                continue
            if not state.storages:  # a deallocated input keeps them while this replay is queued
                raise TraceError(
                    f"an input {state.shape} {state.dtype.name} of the trace has no value on the "
                    "device (its producer failed)"
                )
            source = state.conversion_source(storage.layout)
            steps.append(Copy(source, storage, state.shape))
            nbytes += source.nbytes + storage.nbytes
            self.refilled.append((state, source, storage))
        steps.extend(capture.steps)
        if capture.collective_steps:  # each captured collective step meets this execute's peers
            peers = self.peers
            if peers is None:
                raise TraceError(_ALONE)
            base = len(steps) - len(capture.steps)
            for index in capture.collective_steps:
                step = steps[base + index]
                steps[base + index] = step._replace(peers=peers.replace(step.peers))
        elif self.peers is not None:  # nothing to meet: it may run inline like any replay
            self.peers = None
        if capture.footprint:  # its programs' circular buffers, for the whole replay
            s = self.scheduler
            try:
                s.hold_footprint(self, capture.footprint)
            except FootprintClash:  # its own pinned buffers may stay (each program ran around them)
                pinned = frozenset(storage.address for storage in capture.pinned
                                   if storage.layout.memory is MemorySpace.L1)
                s.hold_footprint(self, capture.footprint, pinned)
        # Each program's span is for the timeline: timed only while a recorder listens.
        timed = self.scheduler.timing > 0
        return Record(tuple(steps), nbytes=nbytes, macs=capture.macs, timed=timed,
                      kernel_bytes=capture.kernel_bytes)

    def circular_buffer_bytes(self) -> int:
        return self.target.footprint

    def rollback(self, record: Record) -> None:
        if self.footprint:
            self.scheduler.release_footprint(self)

    def commit(self, record: Record, result: Any) -> None:
        s = self.scheduler
        if self.footprint:
            s.release_footprint(self)
        self.spans = result if record.timed else []
        for state, source, storage in self.refilled:
            s.count_copy(source, storage)  # a conversion (or residency copy) like any other
            if not state.deallocated and state.find(storage.layout) is None:
                s.adopt(state, storage)
        for state, storages in self.target.snapshot:
            if state.deallocated:
                continue
            s.set_storages(state, storages)
        s.count("programs_run", len(self.target.programs))
        s.count("trace_replays", 1)

    def complete(self, error: BaseException | None = None) -> None:
        capture = self.target
        capture.replays_pending -= 1
        capture.unpin_if_idle()
        super().complete(error)

    def forget(self) -> None:
        self.refilled = []

    def describe(self) -> dict[str, Any]:
        info = super().describe()
        info["programs"] = list(self.target.programs)
        children: list[tuple[str, tuple[float, float], str]] = []
        for program, (start, end, host_spans, _) in zip(self.target.programs, self.spans):
            children.append((program, (start, end), "replayed program"))
            children += [(label, (t0, t1), "host op") for label, t0, t1 in host_spans]
        info["children"] = children
        return info


def begin(s: SchedulerState) -> Capture:
    """Opens a capture on the device: what is queued from now on is recorded."""
    if s.capturing is not None:
        raise TraceError("a trace is already being captured on this device; captures do not nest")
    if s.hooks is not None:
        raise TraceError("a trace cannot be captured while debug hooks are set on the device: its "
                         "replays would run with none (capture it outside the tt.debug_hooks block)")
    capture = Capture(s)
    s.open_capture(capture)
    return capture


def end(s: SchedulerState, capture: Capture, error: BaseException | None) -> TraceError | None:
    """Ends the capture; a seal on CQ0 snapshots it once every captured command is done. On a
    device with a trace region, its trace buffer is allocated there now; the TraceError to
    raise from the capture block when it does not fit (the trace cannot be replayed)."""
    s.close_capture()
    if error is not None and capture.error is None:
        capture.error = TraceError(f"the capture block raised {type(error).__name__}: {error}")
    refused = None
    region = s.trace_region
    if region is not None and capture.error is None:
        nbytes = capture.commands * TRACE_BYTES_PER_COMMAND
        try:
            capture.trace_buffer = region.allocate(nbytes)
        except OutOfMemoryError as exc:
            refused = capture.error = TraceError(
                f"the trace's buffer ({capture.commands} commands, {nbytes} bytes) does not fit the "
                f"device's trace region: {exc}")
            refused.__cause__ = exc
    s.cq0.push(SealCommand(capture))
    return refused


_ALONE = ("this trace's programs exchange values with other chips (collectives): execute the mesh "
          "trace (tt.execute_trace(mesh_trace)), whose chips replay together, not one chip's trace")


def check_replay(s: SchedulerState, capture: Capture) -> None:
    """Raises TraceError if the trace cannot be replayed now (what `replay` checks first)."""
    if capture.released:
        raise TraceError("the trace was released; capture a new one")
    if s.capturing is not None:
        raise TraceError("a trace cannot be executed while a capture is open on its device")
    if s.hooks is not None:
        raise TraceError("a trace cannot be executed while debug hooks are set on its device: a "
                         "replay runs its records straight through, with no op for a hook to see")
    if capture.error is not None:
        raise TraceError(f"the capture failed: {capture.error}") from capture.error
    for state in capture.inputs:
        if state.deallocated:
            raise TraceError(
                f"an input {state.shape} {state.dtype.name} of the trace was deallocated since "
                "capture; keep traced inputs alive until the trace is released"
            )


def replay(s: SchedulerState, capture: Capture, peers: Any = None) -> ReplayCommand:
    """One replay of a captured trace, to queue on CQ0 (the capture counts it pending); `peers`:
    a mesh trace's chip's place in its execute (see `ReplayCommand`)."""
    check_replay(s, capture)
    if peers is None and capture.collective_steps:
        raise TraceError(_ALONE)
    outputs = tuple(state for state in capture.outputs if not state.deallocated)
    capture.replays_pending += 1
    command = ReplayCommand(s, capture, tuple(capture.inputs), outputs)
    if peers is not None:
        command.peers = peers
    return command


def release(capture: Capture) -> None:
    """The trace is released: its storages are unpinned once no replay of it is queued."""
    if not capture.released:
        capture.released = True
        # Nothing replays it again: the constant parts it hoisted (`_const_eval.ConstUse`) no
        # longer keep their programs' cut, so a dropped binary frees what it cached.
        capture.const_uses.clear()
        capture.unpin_if_idle()
