"""The commands the two queues run, and the residency rules they follow.

CQ1 carries host-to-device writes; CQ0 carries programs, layout conversions, evictions and
device-to-host reads. When a program reaches the head of CQ0 it first moves to DRAM every L1
storage it does not use (an `EvictCommand`, its preamble), then converts inputs whose storage
does not match the declared layout (the conversion is kept on the tensor for the next program),
allocates its outputs and intermediates, runs its steps and frees the intermediates.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _storage_io as io
from ._errors import OutOfMemoryError, ProgramError
from ._ops import OPS, compute_dtype
from ._queue import Command
from ._tensor import Storage, Tensor
from ._types import Layout, MemorySpace, TensorLayout

if TYPE_CHECKING:
    from ._device import Device
    from ._program import Program

__all__ = ["WriteCommand", "ReadCommand", "ConvertCommand", "EvictCommand", "ProgramCommand"]

_L1_TILE = Layout(MemorySpace.L1, TensorLayout.TILE)


def _nbytes(storage: Storage) -> int:
    return storage.buffer.page_size * storage.buffer.num_pages


def _same_format(a: Storage, b: Storage) -> bool:
    """Whether a copy between the two only moves pages (same dtype and tensor layout)."""
    return a.layout.dtype is b.layout.dtype and a.layout.tensor_layout is b.layout.tensor_layout


def _count_copy(device: Device, src: Storage, dst: Storage) -> None:
    """Counts a copy made for a layout: a conversion if it changes the format, else residency."""
    if _same_format(src, dst):
        device._count("residency_copies", 1)
        device._count("residency_copy_bytes", _nbytes(dst))
    else:
        device._count("layout_conversions", 1)




class WriteCommand(Command):
    """Host array (or zeros) into a tensor's home storage; a new value drops old conversions."""

    name = "write"
    batchable = True
    __slots__ = ("device", "array", "new_value", "target", "zero")

    def __init__(
        self, device: Device, tensor: Tensor, array: np.ndarray[Any, Any] | None, new_value: bool
    ) -> None:
        super().__init__((), (tensor,))
        self.device = device
        self.array = array
        self.zero = array is None
        self.new_value = new_value
        self.target: Storage | None = None

    @property
    def tensor(self) -> Tensor:
        return self.writes[0]

    def blocker(self) -> Command | None:
        moving = self.tensor._moving
        if moving is not None and not moving.done:
            return moving
        return super().blocker()

    def prepare(self) -> None:
        tensor = self.tensor
        if not tensor._storages:
            raise ProgramError("the tensor has no device storage: its producer failed")
        if self.new_value:
            for stale in tensor._storages[1:]:
                self.device._free(stale)
            del tensor._storages[1:]
        self.target = tensor._storages[0]
        self.cost = _nbytes(self.target)

    def run(self) -> None:
        assert self.target is not None
        banks = self.device._banks(self.target.layout.memory)
        if self.array is None:
            io.zero_fill(banks, self.target)
        else:
            io.write_array(banks, self.target, self.array)

    def finish(self) -> None:
        if self.array is not None:
            self.device._count("host_to_device_bytes", self.array.nbytes)

    def forget(self) -> None:
        self.array = None
        self.target = None

    def describe(self) -> dict[str, Any]:
        return {"name": "zero_fill" if self.zero else "write", "bytes": self.cost}


class ReadCommand(Command):
    """A tensor's value back to a host array."""

    name = "read"
    __slots__ = ("device", "source", "result")

    def __init__(self, device: Device, tensor: Tensor) -> None:
        super().__init__((tensor,), ())
        self.device = device
        self.source: Storage | None = None
        self.result: np.ndarray[Any, Any] | None = None

    @property
    def tensor(self) -> Tensor:
        return self.reads[0]

    def prepare(self) -> None:
        # Chosen here, on the loop thread: `run` may be on a worker and reads no tensor state.
        self.source = self._pick_source()
        self.cost = _nbytes(self.source)

    def _pick_source(self) -> Storage:
        storages = self.tensor._storages
        if not storages:
            raise ProgramError("the tensor has no device storage")
        # Any storage of the value's own dtype is exact; row-major ones are cheapest to read.
        exact = [s for s in storages if s.layout.dtype is self.tensor.dtype]
        for storage in exact:
            if storage.layout.tensor_layout is TensorLayout.ROW_MAJOR:
                return storage
        return exact[0]

    def run(self) -> None:
        source = self.source
        assert source is not None
        self.result = io.read_array(
            self.device._banks(source.layout.memory), source, self.tensor.shape
        )

    def finish(self) -> None:
        assert self.result is not None
        self.device._count("device_to_host_bytes", self.result.nbytes)

    def forget(self) -> None:
        self.source = None

    def describe(self) -> dict[str, Any]:
        return {"name": "read", "bytes": self.cost}


class ConvertCommand(Command):
    """`to_layout`: a new tensor holding the source's value in another layout."""

    name = "to_layout"
    __slots__ = ("device", "layout", "dst", "src")

    def __init__(self, device: Device, source: Tensor, target: Tensor, layout: Layout) -> None:
        super().__init__((source,), (target,))
        self.device = device
        self.layout = layout
        self.dst: Storage | None = None
        self.src: Storage | None = None

    @property
    def source(self) -> Tensor:
        return self.reads[0]

    @property
    def target(self) -> Tensor:
        return self.writes[0]

    def prepare(self) -> None:
        storages = self.source._storages
        if not storages:
            raise ProgramError("the source tensor has no device storage")
        self.src = self.source._conversion_source(self.layout)
        self.dst = self.device._allocate(self.layout, self.target.shape, self.target)
        self.cost = _nbytes(self.src) + _nbytes(self.dst)

    def run(self) -> None:
        assert self.src is not None and self.dst is not None
        d = self.device
        io.copy_storage(
            d._banks(self.src.layout.memory), self.src, d._banks(self.dst.layout.memory),
            self.dst, self.source.shape,
        )

    def finish(self) -> None:
        assert self.dst is not None and self.src is not None
        self.target._storages.append(self.dst)
        _count_copy(self.device, self.src, self.dst)

    def rollback(self) -> None:
        if self.dst is not None:
            self.device._free(self.dst)
            self.dst = None

    def forget(self) -> None:
        self.src = self.dst = None

    def describe(self) -> dict[str, Any]:
        return {"name": "to_layout", "bytes": self.cost}


class EvictCommand(Command):
    """Moves L1 storages to DRAM; a storage whose value DRAM already holds is just freed."""

    name = "evict"
    __slots__ = ("device", "moves", "copied")

    def __init__(self, device: Device, victims: list[tuple[Tensor, Storage]]) -> None:
        super().__init__((), ())
        self.device = device
        self.moves: list[tuple[Tensor, Storage, Storage | None]] = [(t, s, None) for t, s in victims]
        self.copied = 0

    def prepare(self) -> None:
        moves = []
        try:
            for tensor, storage, _ in self.moves:
                layout = Layout(MemorySpace.DRAM, storage.layout.tensor_layout, storage.layout.dtype)
                target = None
                if tensor._find_storage(layout) is None:
                    target = self.device._allocate(layout, tensor.shape, tensor)
                    self.cost += 2 * _nbytes(storage)
                moves.append((tensor, storage, target))
                tensor._moving = self
                tensor._pending += 1  # deallocating it now must wait for the move
        finally:
            self.moves = moves + self.moves[len(moves) :]

    def run(self) -> None:
        d = self.device
        l1 = d._banks(MemorySpace.L1)
        dram = d._banks(MemorySpace.DRAM)
        for tensor, storage, target in self.moves:
            if target is not None:
                self.copied += io.copy_storage(l1, storage, dram, target, tensor.shape)

    def finish(self) -> None:
        d = self.device
        for tensor, storage, target in self.moves:
            storages = tensor._storages
            index = storages.index(storage)
            if target is not None:
                storages[index] = target
            else:
                del storages[index]
                if index == 0:
                    # The home moved for free: the DRAM copy of the same format is the new home
                    # (it holds the value exactly; a converted storage may not).
                    layout = Layout(MemorySpace.DRAM, storage.layout.tensor_layout, storage.layout.dtype)
                    copy = tensor._find_storage(layout)
                    assert copy is not None
                    storages.remove(copy)
                    storages.insert(0, copy)
            d._free(storage)
            tensor._moving = None
            d._settle(tensor)
        d._count("evictions", len(self.moves))
        d._count("eviction_bytes", self.copied)

    def rollback(self) -> None:
        for tensor, _, target in self.moves:
            if tensor._moving is not self:
                continue  # prepare failed before reaching it
            if target is not None:
                self.device._free(target)
            tensor._moving = None
            self.device._settle(tensor)

    def forget(self) -> None:
        self.moves = []

    def describe(self) -> dict[str, Any]:
        return {"name": "evict", "bytes": self.copied, "tensors": len(self.moves)}


class _Plan:
    """What a program needs that does not change between submissions."""

    __slots__ = ("last_read", "step_attrs", "store_in_output", "copied_out", "compute",
                 "value_dtypes", "scratch", "matmul_cost")

    def __init__(self, program: Program) -> None:
        self.last_read = [-1] * len(program.values)  # the last step reading each value
        for index, step in enumerate(program.steps):
            for value in step.inputs:
                self.last_read[value] = index
        self.step_attrs = [dict(step.attrs) for step in program.steps]
        self.compute = [OPS[step.op].compute for step in program.steps]
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
        # Step values that need scratch storage: (value id, shape, L1 layout, DRAM fallback).
        self.scratch = [
            (step.output, program.values[step.output].shape,
             Layout(MemorySpace.L1, TensorLayout.TILE, program.values[step.output].dtype),
             Layout(MemorySpace.DRAM, TensorLayout.TILE, program.values[step.output].dtype))
            for step in program.steps
            if step.output not in self.store_in_output
        ]
        self.matmul_cost = sum(
            math.prod(program.values[step.inputs[0]].shape) * program.values[step.inputs[1]].shape[-1]
            for step in program.steps
            if step.op == "matmul"
        )


class ProgramCommand(Command):
    """One program run: evict, convert inputs, allocate, compute the steps, free scratch."""

    name = "program"
    __slots__ = ("device", "program", "plan", "sources", "conversions", "out_storages", "scratch",
                 "moved")

    def __init__(
        self, device: Device, program: Program, plan: _Plan, inputs: tuple[Tensor, ...],
        outputs: tuple[Tensor, ...],
    ) -> None:
        super().__init__(inputs, outputs)
        self.device = device
        self.program = program
        self.plan = plan
        self.sources: list[Storage] = []
        self.conversions: list[tuple[Tensor, Storage, Storage]] = []
        self.out_storages: list[Storage] = []
        self.scratch: dict[int, Storage] = {}
        self.moved = 0  # bytes the run reads and writes (the trace's `bytes`)

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return self.reads

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return self.writes

    def preamble(self) -> Command | None:
        if not self.device._l1:
            return None
        victims = self.device._eviction_victims(self.inputs)
        return EvictCommand(self.device, victims) if victims else None

    def prepare(self) -> None:
        d = self.device
        program = self.program
        cost = 0
        for tensor, spec in zip(self.inputs, program.inputs):
            storage = tensor._find_storage(spec.layout)
            if storage is None:
                if not tensor._storages:
                    raise ProgramError("an input tensor has no device storage")
                storage = d._allocate(spec.layout, tensor.shape, tensor)
                self.conversions.append((tensor, tensor._conversion_source(spec.layout), storage))
                cost += 2 * _nbytes(storage)
            self.sources.append(storage)
            cost += _nbytes(storage)
        for tensor, spec in zip(self.outputs, program.output_specs):
            storage = d._allocate(spec.layout, spec.shape, tensor)
            self.out_storages.append(storage)
            cost += _nbytes(storage)
        for value, shape, l1_layout, dram_layout in self.plan.scratch:
            try:
                storage = d._allocate(l1_layout, shape, None)
            except OutOfMemoryError:
                storage = d._allocate(dram_layout, shape, None)
            self.scratch[value] = storage
            cost += 2 * _nbytes(storage)
        self.moved = cost
        self.cost = cost + self.plan.matmul_cost

    def run(self) -> None:
        d = self.device
        program = self.program
        plan = self.plan
        for tensor, source, storage in self.conversions:
            io.copy_storage(
                d._banks(source.layout.memory), source, d._banks(storage.layout.memory),
                storage, tensor.shape,
            )
        values: list[np.ndarray[Any, Any] | None] = [None] * len(program.values)
        for index, (storage, spec) in enumerate(zip(self.sources, program.inputs)):
            if plan.last_read[index] >= 0 or plan.copied_out[index]:
                array = io.read_array(d._banks(storage.layout.memory), storage, spec.shape)
                values[index] = array.astype(plan.value_dtypes[index], copy=False)
        for index, step in enumerate(program.steps):
            args = [values[v] for v in step.inputs]  # every operand is live: last_read says so
            result = plan.compute[index](args, step.scalar, **plan.step_attrs[index])  # type: ignore[arg-type]
            value = step.output
            k = plan.store_in_output.get(value)
            storage = self.out_storages[k] if k is not None else self.scratch[value]
            banks = d._banks(storage.layout.memory)
            io.write_array(banks, storage, result)
            if plan.last_read[value] > index or plan.copied_out[value]:
                # Later steps and copies read the value as it is stored: rounded to its dtype.
                spec = program.values[value]
                stored = io.read_array(banks, storage, spec.shape)
                values[value] = stored.astype(plan.value_dtypes[value], copy=False)
            for v in step.inputs:
                if plan.last_read[v] == index and not plan.copied_out[v]:
                    values[v] = None
        for k, value in enumerate(program.outputs):
            if plan.store_in_output.get(value) == k:
                continue
            storage = self.out_storages[k]
            kept = values[value]
            assert kept is not None
            io.write_array(d._banks(storage.layout.memory), storage, kept)

    def finish(self) -> None:
        d = self.device
        for storage in self.scratch.values():
            d._free(storage)
        self.scratch.clear()
        for tensor, source, storage in self.conversions:
            tensor._storages.append(storage)
            _count_copy(d, source, storage)
        for tensor, storage in zip(self.outputs, self.out_storages):
            tensor._storages.append(storage)
        d._count("programs_run", 1)

    def rollback(self) -> None:
        d = self.device
        for storage in self.scratch.values():
            d._free(storage)
        for _, _, storage in self.conversions:
            d._free(storage)
        for storage in self.out_storages:
            d._free(storage)
        self.scratch.clear()
        self.conversions.clear()
        self.out_storages.clear()

    def forget(self) -> None:
        self.sources = []
        self.conversions = []
        self.out_storages = []
        self.scratch = {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.program.name, "bytes": self.moved, "cost": self.cost,
                "conversions": len(self.conversions)}
