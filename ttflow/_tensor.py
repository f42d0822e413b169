"""Tensor: a handle to an immutable value that will exist on the device (a future).

A tensor may hold several storages of one value: the original, and the conversions made for
programs that declared another layout (kept so that weights are converted once, not every
iteration). The first storage is the tensor's home: what `layout` and `buffer` describe and what
`to_host` reads. A `write` gives the tensor a new value and drops the conversions of the old one.

Ordering is tracked per tensor with two commands: the last one that writes the value, and the
last one queued that reads it. Readers are all on CQ0, which runs in order, so a write that must
follow every queued reader (write-after-read) only has to wait for the last.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, final

import anyio.lowlevel

from ._errors import DeallocatedTensorError, DeviceClosedError, raise_stored
from ._memory import BufferInfo
from ._types import DataType, Layout

if TYPE_CHECKING:
    from ._device import Device
    from ._queue import Command

__all__ = ["Storage", "Tensor"]


@final
class Storage:
    """One copy of a tensor's value in one layout, at one place in bank memory."""

    __slots__ = ("layout", "buffer", "dims3")

    def __init__(self, layout: Layout, buffer: BufferInfo, shape: tuple[int, ...]) -> None:
        self.layout = layout
        self.buffer = buffer
        # (batch, rows, cols) of the logical shape: how the tile kernels see it.
        if len(shape) == 1:
            self.dims3 = (1, 1, shape[0])
        else:
            batch = 1
            for d in shape[:-2]:
                batch *= d
            self.dims3 = (batch, shape[-2], shape[-1])

    def __repr__(self) -> str:
        return f"Storage({self.layout}, {self.buffer})"


@final
class Tensor:
    """A device tensor. Awaiting it waits for every queued command that writes it."""

    __slots__ = (
        "shape",
        "dtype",
        "device",
        "_storages",
        "_layout",
        "_last_writer",
        "_last_reader",
        "_pending",
        "_error",
        "_deallocated",
        "_moving",
        "__weakref__",
    )

    def __init__(self, device: Device, shape: tuple[int, ...], dtype: DataType, layout: Layout) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self._storages: list[Storage] = []
        self._layout = layout
        self._last_writer: Command | None = None
        self._last_reader: Command | None = None
        self._pending = 0  # queued commands that read or write this tensor
        self._error: BaseException | None = None
        self._deallocated = False
        self._moving: Command | None = None

    @property
    def layout(self) -> Layout:
        """Where the tensor lives now (an eviction moves it from L1 to DRAM)."""
        return self._storages[0].layout if self._storages else self._layout

    @property
    def buffer(self) -> BufferInfo | None:
        """The home storage's buffer once the tensor is ready; None before."""
        if not self.done() or not self._storages:
            return None
        return self._storages[0].buffer

    @property
    def storages(self) -> tuple[tuple[Layout, BufferInfo], ...]:
        """Every copy of the value on the device: the home storage first, then conversions."""
        return tuple((s.layout, s.buffer) for s in self._storages)

    @property
    def is_deallocated(self) -> bool:
        return self._deallocated

    def done(self) -> bool:
        """True once every queued write of this tensor has completed (or failed)."""
        writer = self._last_writer
        return writer is None or writer.done

    def __await__(self) -> Generator[Any, None, Tensor]:
        return self._wait().__await__()

    async def _wait(self) -> Tensor:
        # Same checks, in the same order, as `tt.wait`: a deallocated tensor or a closed device
        # raises, whether or not the value was ready before.
        writer = self._last_writer
        if writer is not None and not writer.done and not self._deallocated:
            await anyio.lowlevel.checkpoint_if_cancelled()
            await writer.wait()
        else:
            await anyio.lowlevel.checkpoint()
        self.check_usable()
        if self._error is not None:
            raise_stored(self._error)
        return self

    def __del__(self) -> None:
        # A dropped tensor gives its memory back, as a PJRT buffer or a ttnn tensor does. This
        # may run on any thread: hand the storages to the device, which frees them on its own.
        storages = self._storages
        if storages:
            try:
                self.device._garbage.append(storages)
            except Exception:
                pass

    def check_usable(self) -> None:
        """Raises if the tensor cannot be used in new work (deallocated, device closed)."""
        if self._deallocated:
            raise DeallocatedTensorError(
                f"tensor {self.shape} {self.dtype.name} was deallocated; "
                "keep it alive until its last use"
            )
        if self.device.closed:
            raise DeviceClosedError("the tensor's device is closed")

    def __repr__(self) -> str:
        state = (
            "deallocated"
            if self._deallocated
            else "failed"
            if self._error is not None
            else "ready"
            if self.done()
            else "pending"
        )
        layout = self.layout
        return (
            f"<ttflow.Tensor shape={self.shape} dtype={self.dtype.name} "
            f"{layout.memory.name} {layout.tensor_layout.name} {state}>"
        )

    def _find_storage(self, layout: Layout) -> Storage | None:
        for storage in self._storages:
            if storage.layout == layout:
                return storage
        return None

    def _conversion_source(self, layout: Layout) -> Storage:
        """The cheapest storage to convert from: one that only needs its pages moved, if any."""
        for storage in self._storages:
            if (
                storage.layout.dtype is layout.dtype
                and storage.layout.tensor_layout is layout.tensor_layout
            ):
                return storage
        return self._storages[0]
