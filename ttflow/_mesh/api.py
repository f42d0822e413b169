"""The runtime calls for a device or a mesh: ttflow's public `to_device`, `submit`, `to_host`, ...

Each takes what `_runtime` takes (a `Device`, its `Tensor`s) and hands it over unchanged after
one type test, or a `MeshDevice` and its `MeshTensor`s, which this package serves: a call on a
mesh is one single-chip call per chip. The runtime below knows nothing of meshes.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, overload

import numpy as np

import anyio.lowlevel

from .._runtime import calls as _runtime, trace as _trace
from .._observe import timeline as _timeline
from .._observe.debug import OpTensor
from .._ir.binary import Binary
from .._core import _dispatch
from .._runtime.device import Device
from .._errors import LayoutError, MeshError
from .._runtime.tensor import Tensor
from .._observe.timeline import TimelineRecorder
from .._runtime.trace import Trace
from .._types import DataType, Layout
from .device import MeshDevice
from .placement import Composer, Mapper
from .spmd import submit_spmd
from .tensor import MeshTensor
from .timeline import MeshTimelineRecorder, record_mesh_timeline
from .trace import MeshTrace, capture_mesh_trace, execute_mesh_trace, release_mesh_trace
from .transfer import distribute, empty_on, read, write_shards

__all__ = [
    "capture_trace",
    "deallocate",
    "empty",
    "execute_trace",
    "record_timeline",
    "release_trace",
    "submit",
    "to_device",
    "to_host",
    "to_layout",
    "wait",
    "write",
]


@overload
def to_device(array: Any, device: Device, layout: Layout | None = None, mapper: None = None) -> Tensor: ...
@overload
def to_device(array: Any, device: MeshDevice, layout: Layout | None = None,
              mapper: Mapper | None = None) -> MeshTensor: ...
def to_device(array: Any, device: Device | MeshDevice, layout: Layout | None = None,
              mapper: Mapper | None = None) -> Tensor | MeshTensor:
    """Starts copying a host array to a device (on CQ1) and returns its tensor at once; on a
    mesh, one shard per chip, laid out by `mapper`: `tt.replicate()` (the default, as ttnn's),
    `tt.shard(dim)` or `tt.shard_2d(dims)`. See `_runtime.to_device` for the array's rules."""
    if type(device) is MeshDevice:
        return distribute(array, device, layout, mapper)
    if mapper is not None:
        raise MeshError(f"a mapper lays an array out over a mesh; {device!r} is one chip: drop the mapper "
                        "or pass a tt.MeshDevice")
    return _runtime.to_device(array, device, layout)  # type: ignore[arg-type]


async def to_host(tensor: Tensor | MeshTensor | OpTensor, composer: Composer | None = None) -> np.ndarray[Any, Any]:
    """Waits for the tensor and copies its value out (on CQ0); the device copy stays. A mesh
    tensor's shards are joined by `composer` (`tt.concat(dim)`, `tt.concat_2d(dims)`); a
    replicated one, or one of a one-chip mesh, needs none (shard 0 is read, as in ttnn)."""
    if type(tensor) is MeshTensor:
        return await read(tensor, composer)
    if type(tensor) is OpTensor:  # a value of a program a debug hook is looking at
        await anyio.lowlevel.checkpoint()
        return tensor.read()
    if composer is not None:
        raise MeshError("a composer joins a mesh tensor's shards; this is a single-chip tt.Tensor: drop it")
    return await _runtime.to_host(tensor)  # type: ignore[arg-type]


async def wait(tensor: Tensor | MeshTensor) -> None:
    """Waits for every queued write of the tensor (of every shard); re-raises a producer's error."""
    if type(tensor) is MeshTensor:
        await tensor
        return
    await _runtime.wait(tensor)  # type: ignore[arg-type]


@overload
def submit(device: Device, binary: Binary, program_index: int, inputs: Sequence[Tensor]) -> list[Tensor]: ...
@overload
def submit(device: MeshDevice, binary: Binary, program_index: int,
           inputs: Sequence[MeshTensor]) -> list[MeshTensor]: ...
@overload
def submit(device: MeshDevice, binary: Binary, program_index: int, inputs: Sequence[Tensor]) -> list[Tensor]: ...
def submit(device: Device | MeshDevice, binary: Binary, program_index: int,
           inputs: Sequence[Tensor] | Sequence[MeshTensor]) -> list[Tensor] | list[MeshTensor]:
    """Queues a program run on CQ0 and returns its output tensors at once (never blocks).

    On a mesh: the program runs on every chip on that chip's shards (SPMD) and each output is a
    per-device `MeshTensor`; a one-chip mesh given plain tensors returns plain tensors. Checked
    now: the program index, the input count, each input's device (or mesh), liveness, shape and
    dtype. When the program starts, inputs in another layout are converted (and the conversion
    kept), L1 tensors it does not read move to DRAM, then it runs.
    """
    if type(device) is MeshDevice:
        return submit_spmd(device, binary, program_index, inputs)
    # `_runtime.submit`, inlined (one Python frame fewer on the hot path of every device submit):
    # the checks at a glance in C, and any doubt through the checked path that says what is wrong.
    outputs = _dispatch.submit(device, binary, program_index, inputs)
    if outputs is not None:
        return outputs  # type: ignore[no-any-return]
    return _runtime._submit_checked(device, binary, program_index, inputs)  # type: ignore[arg-type]


@overload
def to_layout(tensor: Tensor, layout: Layout, retain: bool | None = None) -> Tensor: ...
@overload
def to_layout(tensor: MeshTensor, layout: Layout, retain: bool | None = None) -> MeshTensor: ...
def to_layout(tensor: Tensor | MeshTensor, layout: Layout,
              retain: bool | None = None) -> Tensor | MeshTensor:
    """A new tensor holding the same value in `layout` (converted on CQ0; each shard on its
    chip). tt-mlir's `toLayout` rule for `retain`: the result's is `retain`, or the source's
    when None, and a result that is not retained consumes its source."""
    if type(tensor) is MeshTensor:
        tensor.check_usable()
        if not isinstance(layout, Layout):
            raise LayoutError(f"layout must be a tt.Layout, got {layout!r}")
        shards = [_runtime.to_layout(shard, layout, retain) for shard in tensor._shards]
        return MeshTensor._make(tensor._mesh, shards, tensor._placement, tensor._shape)
    return _runtime.to_layout(tensor, layout, retain)  # type: ignore[arg-type]


@overload
def empty(shape: Sequence[int], dtype: DataType, device: Device, layout: Layout | None = None) -> Tensor: ...
@overload
def empty(shape: Sequence[int], dtype: DataType, device: MeshDevice, layout: Layout | None = None) -> MeshTensor: ...
def empty(shape: Sequence[int], dtype: DataType, device: Device | MeshDevice,
          layout: Layout | None = None) -> Tensor | MeshTensor:
    """A zero-filled device tensor (a fixed place for `write` to fill); on a mesh, a replicated
    tensor of `shape` on every chip."""
    if type(device) is MeshDevice:
        return empty_on(shape, dtype, device, layout)
    return _runtime.empty(shape, dtype, device, layout)  # type: ignore[arg-type]


def write(tensor: Tensor | MeshTensor | OpTensor, array: Any) -> None:
    """Queues a new value for `tensor` (on CQ1), after every queued program that reads the old one.

    A mesh tensor takes one array laid out as the tensor was (its mapper splits it), or a list of
    one array per shard (the way to write a per-device tensor)."""
    if type(tensor) is MeshTensor:
        write_shards(tensor, array)
        return
    if type(tensor) is OpTensor:  # replaced in bank memory now: later ops read it
        tensor.write(array)
        return
    _runtime.write(tensor, array)  # type: ignore[arg-type]


def deallocate(tensor: Tensor | MeshTensor, force: bool = True) -> None:
    """Frees the tensor's device memory (every shard's) once the queued work that reads it is
    done. Any later use raises DeallocatedTensorError. With `force=False`, tt-mlir's rule: a
    retained tensor is left alone (on a mesh, each shard by its own retain, as tt-mlir's
    distributed runtime forwards to the same rule)."""
    if type(tensor) is MeshTensor:
        for shard in tensor._shards:
            _runtime.deallocate(shard, force)
        return
    _runtime.deallocate(tensor, force)  # type: ignore[arg-type]


@overload
def capture_trace(device: Device) -> AbstractContextManager[Trace]: ...
@overload
def capture_trace(device: MeshDevice) -> AbstractContextManager[MeshTrace]: ...
def capture_trace(device: Device | MeshDevice) -> AbstractContextManager[Trace] | AbstractContextManager[MeshTrace]:
    """Records the device work submitted inside the block (which also runs once, as usual); on a
    mesh, a trace per chip, captured together (a `tt.MeshTrace`)."""
    if type(device) is MeshDevice:
        return capture_mesh_trace(device)
    return _trace.capture_trace(device)  # type: ignore[arg-type]


def execute_trace(trace: Trace | MeshTrace) -> None:
    """Queues one replay of the trace on CQ0 (non-blocking); on a mesh, one per chip."""
    if type(trace) is MeshTrace:
        execute_mesh_trace(trace)
        return
    _trace.execute_trace(trace)  # type: ignore[arg-type]


def release_trace(trace: Trace | MeshTrace) -> None:
    """Gives back the memory the trace pins (every chip's, on a mesh); idempotent."""
    if type(trace) is MeshTrace:
        release_mesh_trace(trace)
        return
    _trace.release_trace(trace)  # type: ignore[arg-type]


@overload
def record_timeline(device: Device) -> AbstractContextManager[TimelineRecorder]: ...
@overload
def record_timeline(device: MeshDevice) -> AbstractContextManager[MeshTimelineRecorder]: ...
def record_timeline(device: Device | MeshDevice) -> (
        AbstractContextManager[TimelineRecorder] | AbstractContextManager[MeshTimelineRecorder]):
    """Records every command the device completes inside the block as Perfetto trace events; on
    a mesh, one trace with a process per chip."""
    if type(device) is MeshDevice:
        return record_mesh_timeline(device)
    return _timeline.record_timeline(device)  # type: ignore[arg-type]
