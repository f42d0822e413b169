"""Every error ttflow raises on purpose.

    TTFlowError
    ├── LayoutError            (also a ValueError) unsupported dtype/layout pairing
    ├── ShapeError             (also a ValueError) shapes that cannot meet
    ├── OutOfMemoryError       (also a MemoryError) a bank space has no block that fits
    ├── DeallocatedTensorError a tensor used after `deallocate`
    ├── ProgramError           a program that cannot be built, submitted or run
    ├── BinaryFormatError      a binary file that is corrupt, truncated or foreign
    └── DeviceClosedError      work sent to a device that is closed

Each class says what went wrong; each message says what to do next.
"""

from __future__ import annotations

__all__ = [
    "TTFlowError",
    "LayoutError",
    "ShapeError",
    "OutOfMemoryError",
    "DeallocatedTensorError",
    "ProgramError",
    "BinaryFormatError",
    "DeviceClosedError",
]


class TTFlowError(Exception):
    """Base class of every error ttflow raises on purpose."""


class LayoutError(TTFlowError, ValueError):
    """A dtype, tensor layout or memory space that cannot be used where it was asked for."""


class ShapeError(TTFlowError, ValueError):
    """A shape that is empty, has the wrong rank, or does not match what was declared."""


class OutOfMemoryError(TTFlowError, MemoryError):
    """No free block of a memory space is large enough; deallocate something and retry."""

    def __init__(self, space: object, requested: int, largest_free: int) -> None:
        self.space = space
        self.requested = requested
        self.largest_free = largest_free
        super().__init__(
            f"out of {space} memory: asked for {requested} bytes per bank, "
            f"largest free block is {largest_free} bytes"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.space, self.requested, self.largest_free))


class DeallocatedTensorError(TTFlowError):
    """A tensor was used after `deallocate` freed it."""


class ProgramError(TTFlowError):
    """A program is malformed, was submitted with the wrong inputs, or failed while running."""


class BinaryFormatError(TTFlowError):
    """A binary file is corrupt, truncated, of another version, or not a ttflow binary."""


class DeviceClosedError(TTFlowError):
    """The device was closed; open a new one with `tt.open_device()`."""
