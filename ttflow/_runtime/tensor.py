"""Tensor: the user's handle to a value that will exist on the device (a future).

The handle holds no scheduling state: it reads the `TensorState` its device's scheduler owns
(storages, pending writes, error). A tensor may hold several storages of one value: the
original, and the conversions made for programs that declared another layout (kept so that
weights are converted once, not every iteration). The first storage is the tensor's home: what
`layout` and `buffer` describe and what `to_host` reads. Dropping the last handle frees the
tensor's memory once queued work no longer needs it, as a PJRT buffer or a ttnn tensor does.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, final

import anyio.lowlevel
import numpy as np

from .._core._dispatch import TensorCore, wrap
from .._errors import DeallocatedTensorError, DeviceClosedError, raise_stored
from .._memory.banks import BufferInfo
from .._types import DataType, Layout

if TYPE_CHECKING:
    from .device import Device
    from .._sched import TensorState

__all__ = ["Tensor"]


@final
class Tensor(TensorCore):
    """A device tensor. Awaiting it waits for every queued command that writes it.

    Tensors are made by `tt.to_device`, `tt.empty`, `tt.to_layout` and `tt.submit`.
    """

    __slots__ = ()  # shape, dtype, device and _state are fields of the C record `TensorCore`

    shape: tuple[int, ...]
    dtype: DataType
    device: Device
    _state: TensorState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "tt.Tensor has no public constructor: make tensors with tt.to_device, tt.empty, "
            "tt.to_layout or tt.submit"
        )

    @classmethod
    def _wrap(cls, device: Device, state: TensorState) -> Tensor:
        tensor: Tensor = wrap(cls, device, state)
        return tensor

    @property
    def layout(self) -> Layout:
        """Where the tensor lives now (an eviction moves it from L1 to DRAM)."""
        return self._state.layout

    @property
    def name(self) -> str | None:
        """A label of your choosing (None until set): `device.memory_view`, `ttflow memory` and
        the memory map show it beside the tensor's buffers. It names the value, not the
        handle: a conversion or an eviction keeps it."""
        return self._state.name

    @name.setter
    def name(self, name: str | None) -> None:
        if name is not None and not isinstance(name, str):
            raise TypeError(f"a tensor's name is a str or None, got {type(name).__name__}")
        self.device._scheduler.label(self._state, name)

    @property
    def retain(self) -> bool:
        """Whether the tensor outlives a `submit` that reads it. Every ttflow tensor starts
        retained, a program's outputs included; tt-mlir's start with retain False, and tt-xla's
        PJRT plugin sets it on every buffer it hands over, as ttflow's default does for you
        (docs/frontend-guide.md says why). Set it to False and the next `submit` taking it as
        an input deallocates it once the program is queued (tt-mlir's `test_input_deallocate`):
        the handle raises `DeallocatedTensorError` from then on, and its memory comes back once
        the program (and any other queued command that reads it) has run. Retain also decides
        `tt.deallocate(t, force=False)` (a retained tensor is left alone) and
        `tt.to_layout(t, layout)` (a result that is not retained consumes its source), as in
        tt-mlir. A donated input is consumed either way; a submit inside `tt.capture_trace`
        given an input with retain False raises `TraceError`."""
        return not self._state.unretained

    @retain.setter
    def retain(self, retain: bool) -> None:
        if not isinstance(retain, (bool, np.bool_)):
            raise TypeError(f"a tensor's retain is a bool, got {type(retain).__name__}")
        self.device._scheduler.set_retain(self._state, bool(retain))

    @property
    def buffer(self) -> BufferInfo | None:
        """The home storage's buffer once the tensor is ready; None before."""
        state = self._state
        if not state.done() or not state.storages:
            return None
        return state.storages[0].buffer

    @property
    def storages(self) -> tuple[tuple[Layout, BufferInfo], ...]:
        """Every copy of the value on the device: the home storage first, then conversions."""
        return tuple((s.layout, s.buffer) for s in self._state.storages)

    @property
    def is_deallocated(self) -> bool:
        return self._state.deallocated

    def done(self) -> bool:
        """True once every queued write of this tensor has completed (or failed)."""
        return self._state.done()

    def __await__(self) -> Generator[Any, None, Tensor]:
        return self._wait().__await__()

    async def _wait(self) -> Tensor:
        # Same checks, in the same order, as `tt.wait`: a deallocated tensor or a closed device
        # raises, whether or not the value was ready before.
        state = self._state
        writer = state.last_writer
        if writer is not None and not writer.done and not state.deallocated:
            await anyio.lowlevel.checkpoint_if_cancelled()
            await writer.wait()
        else:
            await anyio.lowlevel.checkpoint()
        self.check_usable()
        if state.error is not None:
            raise_stored(state.error)
        return self

    def check_usable(self) -> None:
        """Raises if the tensor cannot be used in new work (deallocated, device closed)."""
        state = self._state
        if state.deallocated:
            if state.donated_to is not None:
                raise DeallocatedTensorError(
                    f"tensor {self.shape} {self.dtype.name} was donated to program "
                    f"{state.donated_to!r}, which consumed it; use that program's output instead"
                )
            if state.unretained:
                raise DeallocatedTensorError(
                    f"tensor {self.shape} {self.dtype.name} was deallocated: its retain is False, "
                    "so the submit (or the unretained tt.to_layout) that read it freed it; set "
                    "tensor.retain = True (or pass retain=True) before that call to keep it"
                )
            raise DeallocatedTensorError(
                f"tensor {self.shape} {self.dtype.name} was deallocated; "
                "keep it alive until its last use"
            )
        if self.device.closed:
            raise DeviceClosedError("the tensor's device is closed")

    def __repr__(self) -> str:
        state = self._state
        status = (
            "donated"
            if state.donated_to is not None
            else "deallocated"
            if state.deallocated
            else "failed"
            if state.error is not None
            else "ready"
            if state.done()
            else "pending"
        )
        layout = self.layout
        return (
            f"<ttflow.Tensor shape={self.shape} dtype={self.dtype.name} "
            f"{layout.memory.name} {layout.tensor_layout.name} {status}>"
        )
