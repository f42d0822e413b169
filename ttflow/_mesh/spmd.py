"""SPMD submit: one program, every chip of a mesh, each on its own shards.

`submit_spmd` is the one place a program is sent to a mesh's chips: one single-chip
`tt.submit` per chip (`_runtime.submit`, so the C fast path, every check and donation apply on
each chip), in row-major order, each queued on its chip's CQ0. The chips then run concurrently:
each has its own queues and worker threads, and kernels release the GIL.

Part 2 of issue 26 (collectives as program ops) hooks in here: a program with collective steps
goes to `collectives.submit_collective`, which resolves it for the mesh's shape and gives every
chip's command of this submit its place in one shared `Rendezvous` (the group, the links, the
mesh's `_System.link_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._runtime import calls as _runtime
from .._ir.binary import Binary
from .._core import _dispatch
from .._errors import MeshError
from .._runtime.tensor import Tensor
from .collectives import submit_collective
from .device import MeshDevice
from .tensor import PER_DEVICE, MeshTensor, per_device

__all__ = ["submit_spmd"]


def _shards_per_chip(mesh: MeshDevice, inputs: Sequence[Any]) -> list[list[Tensor]]:
    """Each chip's inputs (its shards), after checking that every input is a live tensor of
    this mesh (a one-chip mesh also takes its chip's plain tensors)."""
    chips = mesh._chips
    columns: list[list[Tensor]] = []
    for index, tensor in enumerate(inputs):
        if type(tensor) is MeshTensor:
            if tensor._mesh is not mesh:
                raise MeshError(
                    f"input {index} is a tensor of {tensor._mesh!r}, not of {mesh!r}; a program runs on "
                    "the mesh its inputs were made on (tt.from_shards(tt.device_tensors(t), mesh) re-homes "
                    "shards that already sit on that mesh's chips)"
                )
            shards = tensor._on(chips)
            for shard in shards:
                if shard._state.deallocated:
                    shard.check_usable()  # raises what a device would (deallocated, donated)
            columns.append(shards)
        elif type(tensor) is Tensor and len(chips) == 1:
            columns.append([tensor])  # a one-chip mesh takes a device's tensors (the chip checks whose)
        elif type(tensor) is Tensor:
            raise MeshError(
                f"input {index} is a single-chip tt.Tensor, and the program runs on every chip of a "
                f"{mesh.shape[0]}x{mesh.shape[1]} mesh: pass a tt.MeshTensor "
                "(tt.to_device(array, mesh, mapper=tt.replicate()) or tt.from_shards)"
            )
        else:
            raise TypeError(f"input {index}: expected a tt.MeshTensor, got {type(tensor).__name__}")
    return [list(row) for row in zip(*columns)] if columns else [[] for _ in chips]


def _check_donations(binary: Any, program_index: Any, per_chip: list[list[Tensor]]) -> None:
    """A donation is checked on every chip before any chip queues (a shard's layout may differ
    from chip to chip after an eviction): a refusal leaves every input unconsumed."""
    if not (type(binary) is Binary and type(program_index) is int
            and 0 <= program_index < len(binary.programs)):
        return  # chip 0's submit says what is wrong, before anything is queued
    program = binary.programs[program_index]
    if not program.donations or len(per_chip[0]) != len(program.inputs):
        return
    for chip_inputs in per_chip:
        for _, index in program.donations:
            _runtime._check_donation(program, program_index, chip_inputs, index)


def submit_spmd(mesh: MeshDevice, binary: Binary, program_index: int,
                inputs: Sequence[MeshTensor | Tensor]) -> list[Any]:
    """`tt.submit` on a mesh: the program on every chip, on that chip's shards; returns one
    per-device `MeshTensor` per output (a one-chip mesh given plain tensors returns plain
    tensors, as its device would).

    Checked before any chip queues: the mesh is open, each input is a tensor of this mesh with
    a live shard on every chip, and donations. Chip 0's submit then checks the program, the
    input count, shapes and dtypes, which every chip shares (a mesh tensor's shards have one
    shape and dtype), so a refusal queues nothing anywhere.
    """
    if mesh._released or mesh._system.closed:
        mesh.check_open()
    if type(inputs) is not list and type(inputs) is not tuple:
        raise TypeError(f"inputs must be a list or tuple of tensors, got {type(inputs).__name__}")
    chips = mesh._chips
    # Every chip decided at a glance, then queued, in C; any doubt (and collectives, donations,
    # a one-chip mesh given plain tensors) takes the checked path below, which says what is wrong.
    fast = _dispatch.submit_spmd(mesh, chips, binary, program_index, inputs, MeshTensor, PER_DEVICE, mesh._shape)
    if fast is not None:
        return fast
    if len(chips) == 1 and all(type(t) is not MeshTensor for t in inputs):
        return _runtime.submit(chips[0], binary, program_index, inputs)
    per_chip = _shards_per_chip(mesh, inputs)
    _check_donations(binary, program_index, per_chip)
    shared = submit_collective(mesh, binary, program_index, per_chip)  # None: no collectives
    if shared is not None:
        return [per_device(mesh, [chip_outputs[j] for chip_outputs in shared]) for j in range(len(shared[0]))]
    outputs: list[list[Tensor]] = []
    try:
        for chip, chip_inputs in zip(chips, per_chip):
            outputs.append(_runtime.submit(chip, binary, program_index, chip_inputs))
    except BaseException:
        for chip_outputs in outputs:
            for output in chip_outputs:
                _runtime.deallocate(output)
        raise
    return [per_device(mesh, [chip_outputs[j] for chip_outputs in outputs]) for j in range(len(outputs[0]))]
