"""Debug hooks: what a compiler's test harness sees of every op a device runs.

tt-mlir's runtime gives a harness callbacks around each op with the op's tensors, and access to
the pool of intermediates (read and replace); `ttrt run` and Chisel compare every op with a
golden and swap golden values in. An emulator has every intermediate in bank memory already, so
ttflow gives the same without a second build:

    with tt.debug_hooks(device, pre_op=f, post_op=g, pre_program=p, post_program=q):
        ...

Each callback (a function or a coroutine function) gets one context: an `OpContext` (the
program, the op's index, name and location, handles to its inputs and outputs) or a
`ProgramContext` (the program, its inputs and outputs). A handle, an `OpTensor`, is read with
`await tt.to_host(h)` and replaced with `tt.write(h, array)`: the bytes change in bank memory
at once, and every later op reads the new value. A handle is valid only inside the callback
that received it.

How it runs: while hooks are set, a program is decided by the general path (never a fast path:
the C kernel, pages in place, a record decided ahead), and its steps run on a thread of anyio's;
around each step that thread calls the hook on the event loop and waits for it. The program's
command is shielded (it runs to the end, as every command does once started). A callback that
raises fails the program with that error. Programs decided after the block ends run as usual.

Traces are refused while hooks are set (`TraceError`): a replay runs captured records straight
through, with nothing in between for a hook.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, final

import anyio.from_thread
import attrs
import numpy as np

from .._memory import storage_io as io
from .._runtime.device import Device
from .._errors import DebugHookError, ShapeError, TraceError
from .._ir.ops.host import HOST_OP
from .._memory.banks import RemoteMemoryError
from .._ir.program import Program
from .._runtime.calls import _host_array
from .._types import DataType, Layout

if TYPE_CHECKING:
    from .._commands import Plan
    from .._memory.banks import Storage

__all__ = ["DebugHooks", "OpContext", "OpTensor", "ProgramContext", "debug_hooks"]

Callback = Callable[[Any], Any]


@final
class OpTensor:
    """One value of a running program, as a hook sees it: `shape`, `dtype`, `layout`, `value`
    (its id in the program), `is_input` (a program input: the caller's tensor, read only).

    `await tt.to_host(h)` reads it from bank memory; `tt.write(h, array)` replaces it there
    (an array of its shape and host dtype, as `tt.write` takes), and later ops read the new
    value. Valid only inside the callback that received it (`DebugHookError` after)."""

    __slots__ = ("_run", "_storage", "dtype", "is_input", "layout", "shape", "value")

    def __init__(self, run: _HookedRun, value: int, storage: Storage, shape: tuple[int, ...],
                 dtype: DataType, is_input: bool) -> None:
        self._run = run
        self._storage = storage
        self.value = value
        self.shape = shape
        self.dtype = dtype
        self.layout: Layout = storage.layout
        self.is_input = is_input

    def _check_live(self, what: str) -> None:
        if self not in self._run.live:
            raise DebugHookError(
                f"{what}: this OpTensor belonged to a finished hook callback; a handle is valid "
                "only inside the callback that received it (copy the array out there)"
            )

    def read(self) -> np.ndarray[Any, Any]:
        """The value as a host array (what `tt.to_host` returns)."""
        self._check_live("to_host")
        storage = self._storage
        return io.read_array(self._run.banks[storage.layout.memory], storage, self.shape)

    def write(self, array: Any) -> None:
        """Replaces the value in bank memory; later ops read it."""
        self._check_live("write")
        if self.is_input:
            raise DebugHookError(
                f"write: value {self.value} is an input of the program, the caller's tensor; a hook "
                "replaces what ops make (write the op's output in post_op, or the tensor before submit)"
            )
        host = _host_array(array, self.dtype, "write", convert=True)
        if tuple(host.shape) != self.shape:
            raise ShapeError(f"write: cannot write a {host.shape} array into a {self.shape} value")
        storage = self._storage
        io.write_array(self._run.banks[storage.layout.memory], storage, host)
        self._run.replaced.add(self.value)

    def __repr__(self) -> str:
        role = "input" if self.is_input else "value"
        return (f"<ttflow.OpTensor {role} {self.value} shape={self.shape} dtype={self.dtype.name} "
                f"{self.layout.memory.name}>")


@final
@attrs.frozen
class OpContext:
    """What an op callback gets: the `device` (a mesh's chip), the `program`, the op's `index`
    among its steps, its `name` (the op), `loc` (`ProgramBuilder.location`, or None), and
    handles to its `inputs` and `outputs`."""

    device: Device
    program: Program
    index: int
    name: str
    loc: str | None
    inputs: tuple[OpTensor, ...]
    outputs: tuple[OpTensor, ...]


@final
@attrs.frozen
class ProgramContext:
    """What a program callback gets: the `device`, the `program`, handles to its `inputs` and
    `outputs` (before the first op, the outputs hold what their buffers held)."""

    device: Device
    program: Program
    inputs: tuple[OpTensor, ...]
    outputs: tuple[OpTensor, ...]


async def _call(callback: Callback, context: Any) -> None:
    result = callback(context)
    if inspect.isawaitable(result):
        await result


@final
class DebugHooks:
    """The callbacks of one `debug_hooks` block on one device (a mesh's chips each get one);
    `Compute.hooks` of the programs decided meanwhile."""

    __slots__ = ("device", "post_op", "post_program", "pre_op", "pre_program")

    def __init__(self, device: Device, pre_op: Callback | None, post_op: Callback | None,
                 pre_program: Callback | None, post_program: Callback | None) -> None:
        self.device = device
        self.pre_op, self.post_op = pre_op, post_op
        self.pre_program, self.post_program = pre_program, post_program

    def for_program(self, program: Program) -> _ProgramHooks:
        """`Compute.hooks` of one decided run of `program`."""
        return _ProgramHooks(self, program)


@final
class _ProgramHooks:
    __slots__ = ("hooks", "program")

    def __init__(self, hooks: DebugHooks, program: Program) -> None:
        self.hooks, self.program = hooks, program

    def run(self, plan: Plan, sources: tuple[Storage, ...], outputs: tuple[Storage, ...],
            scratch: dict[int, Storage], banks: Any) -> _HookedRun:
        """The program's run under the hooks (made on the thread that runs its steps)."""
        return _HookedRun(self.hooks, self.program, plan, sources, outputs, scratch, banks)


@final
class _HookedRun:
    """One program's run: the storage of each value, and the calls around each step. Called by
    `_commands._run_schedule` on a thread of anyio's; each callback runs on the event loop."""

    def __init__(self, hooks: DebugHooks, program: Program, plan: Plan, sources: tuple[Storage, ...],
                 outputs: tuple[Storage, ...], scratch: dict[int, Storage], banks: Any) -> None:
        self.hooks = hooks
        self.plan = plan
        self.program = program
        self.banks = banks
        self.replaced: set[int] = set()
        self.live: tuple[OpTensor, ...] = ()  # the handles of the callback running now
        program = self.program
        self.storage_of: dict[int, Storage] = dict(enumerate(sources))
        for step in program.steps:
            k = plan.store_in_output.get(step.output)
            self.storage_of[step.output] = outputs[k] if k is not None else scratch[plan.scratch_slot[step.output]]
        self.output_storages = outputs
        self.locations = dict(program.locations)
        # A host op's steps are named "host_op:<its name>" (`ProgramBuilder.host_op`).
        self.names = {index: dict(step.attrs)["host"].label for index, step in enumerate(program.steps)
                      if step.op == HOST_OP}

    def _handle(self, value: int) -> OpTensor:
        spec = self.program.values[value]
        assert spec.layout.dtype is not None
        return OpTensor(self, value, self.storage_of[value], spec.shape, spec.layout.dtype,
                        value < self.program.num_inputs)

    def _call(self, callback: Callback | None, context: Any, handles: tuple[OpTensor, ...],
              values: list[Any] | None) -> None:
        if callback is None:
            return
        self.live = handles
        try:
            anyio.from_thread.run(_call, callback, context)
        finally:
            self.live = ()
        if self.replaced and values is not None:
            self._read_replaced(values)

    def _read_replaced(self, values: list[Any]) -> None:
        """Later steps read the replaced values as now stored (rounded to their dtypes)."""
        plan = self.plan
        for value in self.replaced:
            storage = self.storage_of[value]
            spec = self.program.values[value]
            array = io.read_array(self.banks[storage.layout.memory], storage, spec.shape)
            values[value] = array.reshape(spec.shape).astype(plan.value_dtypes[value], copy=False)
        self.replaced.clear()

    def _program_context(self) -> ProgramContext:
        program = self.program
        inputs = tuple(self._handle(v) for v in range(program.num_inputs))
        outputs = tuple(
            OpTensor(self, value, storage, spec.shape, spec.layout.dtype or DataType.FLOAT32, False)
            for value, storage, spec in zip(program.outputs, self.output_storages, program.output_specs)
        )
        return ProgramContext(self.hooks.device, program, inputs, outputs)

    def _op_context(self, index: int) -> OpContext:
        step = self.program.steps[index]
        inputs = tuple(self._handle(v) for v in step.inputs)
        outputs = (self._handle(step.output),)
        return OpContext(self.hooks.device, self.program, index, self.names.get(index, step.op),
                         self.locations.get(step.output), inputs, outputs)

    def begin(self, values: list[Any]) -> None:
        if self.hooks.pre_program is not None:
            context = self._program_context()
            self._call(self.hooks.pre_program, context, (*context.inputs, *context.outputs), values)

    def before(self, index: int, values: list[Any]) -> None:
        if self.hooks.pre_op is not None:
            context = self._op_context(index)
            self._call(self.hooks.pre_op, context, (*context.inputs, *context.outputs), values)

    def after(self, index: int, values: list[Any]) -> None:
        if self.hooks.post_op is not None:
            context = self._op_context(index)
            self._call(self.hooks.post_op, context, (*context.inputs, *context.outputs), values)

    def end(self) -> None:
        if self.hooks.post_program is not None:
            context = self._program_context()
            self._call(self.hooks.post_program, context, (*context.inputs, *context.outputs), None)


def _devices(device: Any) -> list[Device]:
    if isinstance(device, Device):
        return [device]
    chips = getattr(device, "chips", None)  # a mesh: every chip
    if chips is not None and all(isinstance(chip, Device) for chip in chips):
        return list(chips)
    raise TypeError(f"debug_hooks takes a tt.Device or a tt.MeshDevice, got {type(device).__name__}")


@contextlib.contextmanager
def debug_hooks(device: Any, *, pre_op: Callback | None = None, post_op: Callback | None = None,
                pre_program: Callback | None = None, post_program: Callback | None = None) -> Iterator[None]:
    """Calls the hooks around every op and program the device (every chip of a mesh) runs
    while the block is open (see the module's docstring). One block per device at a time;
    refused while a trace is being captured (`TraceError`)."""
    for name, callback in (("pre_op", pre_op), ("post_op", post_op), ("pre_program", pre_program),
                           ("post_program", post_program)):
        if callback is not None and not callable(callback):
            raise TypeError(f"debug_hooks: {name} must be callable, got {type(callback).__name__}")
    devices = _devices(device)
    for chip in devices:
        chip.check_open()
        if chip.workers == "ray":
            raise RemoteMemoryError("debug_hooks: a Ray chip's memory is in its actor, and hooks read and write "
                                    "it from this process between ops; debug on a device with "
                                    'workers="thread" or "process"')
        s = chip._scheduler
        if s.hooks is not None:
            raise DebugHookError("debug_hooks: the device already has hooks set (one block at a time)")
        if s.capturing is not None:
            raise TraceError("debug_hooks: a trace is being captured on the device; hooks and traces "
                             "do not mix (a replay runs its records straight through)")
    with contextlib.ExitStack() as stack:
        for chip in devices:
            s = chip._scheduler
            s.hooks = DebugHooks(chip, pre_op, post_op, pre_program, post_program)
            stack.callback(setattr, s, "hooks", None)
            # A listener keeps every program off the fast paths (as a timeline recorder does).
            stack.enter_context(s.listening(_watching))
        yield


def _watching(command: Any, error: BaseException | None) -> None:
    """The listener debug hooks hold: its presence alone keeps programs off the fast paths."""
