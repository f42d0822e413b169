"""MeshTensor: one shard `Tensor` per chip of a mesh, and how they were laid out.

ttnn calls this a multi-device tensor (colloquially a "MeshTensor"), tt-mlir a multi-device
tensor; `tt.Tensor` stays the single-chip handle. A MeshTensor holds no scheduling state of its
own: each shard is an ordinary `Tensor` on its chip, with that chip's scheduler as its owner.
It adds the mesh, the placement (the mapper that laid the shards out, or "per-device" for a
program's outputs and `tt.from_shards`), the global shape a mapper split, and the grid (the
mesh's shape when the shards were laid out, row-major).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any, final

import anyio.lowlevel
import numpy as np

from .._core._dispatch import MeshTensorCore, wrap
from .._runtime.device import Device
from .._errors import MeshError
from .._runtime.tensor import Tensor
from .._types import DataType, Layout
from .device import MeshDevice
from .placement import PerDevice, Placement
from .spec import Coord

__all__ = ["MeshTensor", "device_tensors"]


@final
class MeshTensor(MeshTensorCore):
    """A tensor distributed over a mesh: one shard `tt.Tensor` per chip. Awaiting it waits for
    every shard.

    Made by `tt.to_device(array, mesh, mapper=...)`, `tt.empty` on a mesh, `tt.from_shards`,
    `tt.to_layout` and `tt.submit` on a mesh. `shape` is the global shape a mapper split (for a
    replicated tensor, the array's shape); a per-device tensor (a program's output,
    `tt.from_shards`) has no global shape until a composer says how its shards join, so its
    `shape` is its shards' (`shard_shape`).
    """

    __slots__ = ()  # the fields are the C record `MeshTensorCore`'s

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "tt.MeshTensor has no public constructor: make one with tt.to_device(array, mesh, mapper=...), "
            "tt.from_shards or tt.submit on a mesh"
        )

    @classmethod
    def _make(cls, mesh: MeshDevice, shards: Sequence[Tensor], placement: Placement,
              shape: tuple[int, ...] | None = None) -> MeshTensor:
        """A mesh tensor of `shards`, one handle per chip of `mesh`, row-major."""
        tensor: MeshTensor = MeshTensorCore.__new__(cls)
        tensor._mesh = mesh
        tensor._handles = handles = tuple(shards)
        tensor._states = tuple([shard._state for shard in handles])
        tensor._placement = placement
        tensor._shape = handles[0].shape if shape is None else tuple(shape)
        tensor._grid = mesh.shape
        tensor._chips = mesh._chips  # the very tuple: `_on` knows at once when the mesh kept its order
        return tensor

    @property
    def _shards(self) -> tuple[Tensor, ...]:
        """The per-chip handles (made now if an SPMD submit made this tensor without them)."""
        handles = self._handles
        if handles is None:
            handles = self._handles = tuple([wrap(Tensor, chip, state) for chip, state in zip(self._chips, self._states)])
        return handles

    # -- what it is -------------------------------------------------------------------------

    @property
    def mesh(self) -> MeshDevice:
        return self._mesh

    @property
    def device(self) -> MeshDevice:
        """The mesh (as a ttnn multi-device tensor's `device()` is its mesh device)."""
        return self._mesh

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape a mapper split; a per-device tensor's shard shape."""
        return self._shape

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return self._states[0].shape  # type: ignore[no-any-return]

    @property
    def dtype(self) -> DataType:
        return self._states[0].dtype  # type: ignore[no-any-return]

    @property
    def layout(self) -> Layout:
        """Where shard 0 lives now (an eviction moves one chip's shard, not the others')."""
        return self._states[0].layout  # type: ignore[no-any-return]

    @property
    def placement(self) -> Placement:
        """The mapper that laid the shards out (`tt.replicate()`, `tt.shard(dim)`,
        `tt.shard_2d(dims)`), or per-device."""
        return self._placement

    @property
    def mesh_shape(self) -> Coord:
        """The mesh's shape when the shards were laid out (row-major); a later `mesh.reshape`
        leaves a tensor's shards where they are."""
        return self._grid

    @property
    def num_shards(self) -> int:
        return len(self._states)

    @property
    def name(self) -> str | None:
        return self._states[0].name  # type: ignore[no-any-return]

    @name.setter
    def name(self, name: str | None) -> None:
        for shard in self._shards:
            shard.name = name

    @property
    def retain(self) -> bool:
        """`Tensor.retain` of every shard (False if any shard's is): set, it sets every
        shard's, so that a submit on the mesh deallocates each chip's shard once its program
        there is queued to read it."""
        return not any(state.unretained for state in self._states)

    @retain.setter
    def retain(self, retain: bool) -> None:
        if not isinstance(retain, (bool, np.bool_)):
            raise TypeError(f"a tensor's retain is a bool, got {type(retain).__name__}")
        for chip, state in zip(self._chips, self._states):
            chip._scheduler.set_retain(state, bool(retain))

    @property
    def is_deallocated(self) -> bool:
        """True once any shard was deallocated (or donated)."""
        return any(state.deallocated for state in self._states)

    def done(self) -> bool:
        """True once every shard's queued writes have completed (or failed)."""
        return all(state.done() for state in self._states)

    def __await__(self) -> Generator[Any, None, MeshTensor]:
        return self._wait().__await__()

    async def _wait(self) -> MeshTensor:
        if not self._shards:  # pragma: no cover - a mesh has at least one chip
            await anyio.lowlevel.checkpoint()
        for shard in self._shards:  # the first failed shard (chip order) raises its error
            await shard
        self._mesh.check_open()
        return self

    def check_usable(self) -> None:
        """Raises if the tensor cannot be used in new work: its mesh released (MeshError) or
        closed, a shard deallocated or donated."""
        self._mesh.check_open()
        for shard in self._shards:
            shard.check_usable()

    def _on(self, chips: Sequence[Device]) -> list[Tensor]:
        """The shards in the order of `chips` (the mesh's chips now: after a reshape a
        tensor's own order may differ). MeshError if a chip holds no shard."""
        shards = self._shards
        if chips is self._chips:
            return list(shards)
        by_chip = {id(s.device): s for s in shards}
        try:
            return [by_chip[id(chip)] for chip in chips]
        except KeyError:
            raise MeshError("the tensor has no shard on a chip of the mesh") from None

    def __repr__(self) -> str:
        status = ("deallocated" if self.is_deallocated
                  else "failed" if any(s._state.error is not None for s in self._shards)
                  else "ready" if self.done() else "pending")
        layout = self.layout
        rows, cols = self._grid
        return (
            f"<ttflow.MeshTensor shape={self._shape} shards={self.num_shards}x{self.shard_shape} "
            f"dtype={self.dtype.name} {layout.memory.name} {layout.tensor_layout.name} "
            f"{self._placement!r} on {rows}x{cols} {status}>"
        )


def device_tensors(tensor: MeshTensor | Tensor) -> list[Tensor]:
    """The per-chip `tt.Tensor` handles of a tensor, row-major over its `mesh_shape` (each
    shard's `.device` is its chip); a single-chip tensor's list is itself (tt-mlir's
    `getDeviceTensors`, ttnn's `get_device_tensors`)."""
    if type(tensor) is MeshTensor:
        return list(tensor._shards)
    if type(tensor) is Tensor:
        return [tensor]
    raise TypeError(f"expected a tt.MeshTensor or a tt.Tensor, got {type(tensor).__name__}")


PER_DEVICE = PerDevice()
"""The placement of every per-device tensor (one instance: an SPMD submit makes many)."""


def per_device(mesh: MeshDevice, shards: Sequence[Tensor]) -> MeshTensor:
    """A per-device tensor of `mesh` from its shards, row-major."""
    return MeshTensor._make(mesh, shards, PER_DEVICE)
