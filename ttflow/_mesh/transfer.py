"""Host <-> mesh: a host array laid out by a mapper, shards joined by a composer, writes.

Every call checks what it can before anything is queued on any chip (the array, its split, each
shard's array), then queues one single-chip call per chip (`_runtime`'s, so each chip checks,
converts and counts as a device does). A chip that refuses after others have queued (out of
memory) has the shards made so far deallocated before the error is raised: nothing leaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._runtime import calls as _runtime
from .._errors import LayoutError, MeshError, ShapeError, raise_stored
from .._runtime.calls import _host_array
from .._runtime.tensor import Tensor
from .._types import DataType, Layout, check_shape
from .device import MeshDevice
from .placement import Concat, Concat2D, Mapper, PerDevice, Replicate, Shard, Shard2D
from .tensor import MeshTensor, per_device

__all__ = ["distribute", "empty_on", "from_shards", "read", "write_shards"]

Array = np.ndarray[Any, Any]


def _layout(layout: Any) -> Layout:
    if layout is not None and not isinstance(layout, Layout):
        raise LayoutError(f"layout must be a tt.Layout, got {layout!r:.60}")
    return layout if layout is not None else Layout()


def _each_chip(mesh: MeshDevice, make: Any) -> list[Tensor]:
    """`make(k, chip)` for every chip; if one raises, the shards made so far are freed."""
    made: list[Tensor] = []
    try:
        for k, chip in enumerate(mesh._chips):
            made.append(make(k, chip))
    except BaseException:
        for shard in made:
            _runtime.deallocate(shard)
        raise
    return made


def distribute(array: Any, mesh: MeshDevice, layout: Layout | None, mapper: Mapper | None) -> MeshTensor:
    """`tt.to_device` on a mesh: one shard per chip, laid out by `mapper` (default: replicate,
    as ttnn's `from_torch` on a mesh device without a mapper)."""
    mesh.check_open()
    layout = _layout(layout)
    mapper = Replicate() if mapper is None else mapper
    if not isinstance(mapper, (Replicate, Shard, Shard2D)):
        raise TypeError(f"mapper must be tt.replicate(), tt.shard(dim) or tt.shard_2d(dims), got {mapper!r:.60}")
    array = _host_array(array, layout.dtype, "to_device", convert=True)  # converted once, for every chip
    shards = mapper.map(array, mesh.shape)
    return MeshTensor._make(mesh, _each_chip(mesh, lambda k, chip: _runtime.to_device(shards[k], chip, layout)),
                            mapper, tuple(array.shape))


def empty_on(shape: Sequence[int], dtype: DataType, mesh: MeshDevice, layout: Layout | None) -> MeshTensor:
    """`tt.empty` on a mesh: a zero-filled tensor of `shape` on every chip (replicated)."""
    mesh.check_open()
    shape = check_shape(shape)
    return MeshTensor._make(mesh, _each_chip(mesh, lambda k, chip: _runtime.empty(shape, dtype, chip, layout)),
                            Replicate(), shape)


def from_shards(shards: Sequence[Any], mesh: MeshDevice, layout: Layout | None = None) -> MeshTensor:
    """A per-device tensor from one shard per chip, row-major: numpy arrays (copied to their
    chips, as `tt.to_device` would, in `layout`) or `tt.Tensor`s already on their chips (taken as
    they are). tt-mlir's multi-device host tensor (`createMultiDeviceHostTensor`), put on the
    mesh at once. Every shard must have one shape and dtype (ShapeError, LayoutError)."""
    if not isinstance(mesh, MeshDevice):
        raise TypeError(f"expected a tt.MeshDevice, got {type(mesh).__name__}")
    mesh.check_open()
    items = list(shards)
    chips = mesh._chips
    if len(items) != len(chips):
        raise MeshError(f"tt.from_shards takes one shard per chip: {len(items)} given for a "
                        f"{mesh.shape[0]}x{mesh.shape[1]} mesh ({len(chips)} chips)")
    given = _layout(layout)
    kinds: list[tuple[tuple[int, ...], DataType]] = []
    for k, (item, chip) in enumerate(zip(items, chips)):
        if type(item) is Tensor:
            if layout is not None:
                raise LayoutError("tt.from_shards takes tt.Tensor shards as they are; convert them "
                                  "first (tt.to_layout) or pass arrays with the layout")
            item.check_usable()
            if item.device is not chip:
                raise MeshError(
                    f"shard {k} is on {item.device!r}, and the chip at {mesh.coords[k]} is {chip!r}: "
                    "tt.from_shards does not move tensors between chips; pass its array "
                    "(await tt.to_host(shard)) instead"
                )
            kinds.append((item.shape, item.dtype))
        elif isinstance(item, MeshTensor):
            raise TypeError(f"shard {k} is a tt.MeshTensor; pass its shards (tt.device_tensors)")
        else:
            items[k] = array = _host_array(item, given.dtype, "from_shards", convert=True)
            kinds.append((tuple(array.shape), given.dtype or DataType.from_numpy(array.dtype)))
    for k, (shape, dtype) in enumerate(kinds):
        if shape != kinds[0][0]:
            raise ShapeError(f"tt.from_shards: shard {k} has shape {shape}, shard 0 {kinds[0][0]}; "
                             "an SPMD program needs one shape on every chip")
        if dtype is not kinds[0][1]:
            raise LayoutError(f"tt.from_shards: shard {k} is {dtype.name}, shard 0 {kinds[0][1].name}")
    made = _each_chip(mesh, lambda k, chip: items[k] if type(items[k]) is Tensor
                      else _runtime.to_device(items[k], chip, given))
    return per_device(mesh, made)


async def read(tensor: MeshTensor, composer: Any) -> Array:
    """`tt.to_host` of a mesh tensor: its shards joined by `composer`.

    With no composer: a replicated tensor (or one of a one-chip mesh) reads shard 0, as ttnn
    does (the shards are not compared); anything else raises MeshError naming the composer."""
    tensor.check_usable()
    shards = tensor._shards
    if composer is None:
        placement = tensor._placement
        if isinstance(placement, Replicate) or len(shards) == 1:
            return await _runtime.to_host(shards[0])
        inverse = placement.composer()
        hint = (f"pass composer={inverse!r} to join them as they were split" if inverse is not None
                else "pass composer=tt.concat(dim) (or tt.concat_2d(dims)) to join them, or read "
                     "them one by one (tt.device_tensors)")
        what = "per-device values" if isinstance(placement, PerDevice) else f"laid out by {placement!r}"
        raise MeshError(f"the tensor holds {len(shards)} shards, {what}: {hint}")
    if not isinstance(composer, (Concat, Concat2D)):
        raise TypeError(f"composer must be tt.concat(dim) or tt.concat_2d(dims), got {composer!r:.60}")
    # Every read is queued before the first wait, so the chips copy out together (as
    # `_runtime.to_host` queues one: on CQ0 of the shard's chip).
    commands = [shard.device._scheduler.read(shard._state) for shard in shards]
    arrays = []
    for command in commands:
        await command.wait()
        if command.error is not None:
            raise_stored(command.error)
        assert command.result is not None
        arrays.append(command.result)
    return composer.compose(arrays, tensor._grid)


def write_shards(tensor: MeshTensor, data: Any) -> None:
    """`tt.write` into a mesh tensor: `data` is one array laid out as the tensor was (its
    placement's mapper splits it; the global shape must match), or a list of one array per
    shard (row-major; the one way to write a per-device tensor). Every array is checked before
    any chip queues its write."""
    tensor.check_usable()
    shards = tensor._shards
    if isinstance(data, (list, tuple)):
        arrays = list(data)
        if len(arrays) != len(shards):
            raise MeshError(f"tt.write: {len(arrays)} arrays for a tensor of {len(shards)} shards")
    else:
        placement = tensor._placement
        if isinstance(placement, PerDevice):
            raise MeshError("tt.write into a per-device tensor takes a list of arrays, one per shard")
        array = _host_array(data, tensor.dtype, "write", convert=False)
        if tuple(array.shape) != tensor.shape:
            raise ShapeError(f"write: cannot write a {array.shape} array into a {tensor.shape} tensor "
                             f"laid out by {placement!r}; the shapes must be equal")
        arrays = placement.map(array, tensor._grid)
    for k, (shard, array) in enumerate(zip(shards, arrays)):
        array = _host_array(array, shard.dtype, f"write (shard {k})", convert=False)
        if tuple(array.shape) != shard.shape:
            raise ShapeError(f"write: shard {k} is {shard.shape}, its array {array.shape}")
        arrays[k] = array
    for shard, array in zip(shards, arrays):
        _runtime.write(shard, array)
