"""Every error ttflow raises on purpose.

    TTFlowError
    ├── LayoutError            (also a ValueError) unsupported dtype/layout pairing
    ├── ShapeError             (also a ValueError) shapes that cannot meet
    ├── OutOfMemoryError       (also a MemoryError) a bank space has no block that fits
    ├── DeallocatedTensorError a tensor used after `deallocate`
    ├── ProgramError           a program that cannot be built, submitted or run
    │   └── HostOpError        a host op's function that failed, or cannot be saved
    ├── BinaryFormatError      a binary file that is corrupt, truncated or foreign
    ├── FileError              (also an OSError) a path that cannot be read or written
    ├── DeviceClosedError      work sent to a device that is closed
    ├── DeviceLostError        a device whose worker process died
    ├── TraceError             a trace captured or replayed where it cannot be
    ├── MeshError              a mesh, or a tensor of one, used where it cannot be
    └── CollectiveError        a collective whose group could not complete it

Each class says what went wrong; each message says what to do next.
"""

from __future__ import annotations

import copy
import os
import traceback
from typing import NoReturn

__all__ = [
    "DebugHookError",
    "TTFlowError",
    "LayoutError",
    "ShapeError",
    "OutOfMemoryError",
    "DeallocatedTensorError",
    "ProgramError",
    "HostOpError",
    "BinaryFormatError",
    "FileError",
    "DeviceClosedError",
    "DeviceLostError",
    "TraceError",
    "MeshError",
    "CollectiveError",
]


class TTFlowError(Exception):
    """Base class of every error ttflow raises on purpose."""


class LayoutError(TTFlowError, ValueError):
    """A dtype, tensor layout or memory space that cannot be used where it was asked for."""


class ShapeError(TTFlowError, ValueError):
    """A shape that is empty, has the wrong rank, or does not match what was declared."""


class OutOfMemoryError(TTFlowError, MemoryError):
    """No free block of a memory space is large enough; deallocate something and retry."""

    def __init__(self, space: object, requested: int, largest_free: int, view: object = None,
                 reason: str = "") -> None:
        self.space = space
        self.requested = requested
        self.largest_free = largest_free
        self.view = view  # the space's `MemoryView` when the runtime gave up, else None
        self.reason = reason
        # The message is made when it is read (`__str__`): the scheduler raises and catches
        # many of these (an L1 try before DRAM), and formatting each cost more than the try.
        super().__init__()

    def __str__(self) -> str:
        message = (
            f"out of {self.space} memory: asked for {self.requested} bytes per bank, "
            f"largest free block is {self.largest_free} bytes"
        )
        if self.reason:
            message += f" ({self.reason})"
        if self.view is not None:
            message += f"\n{self.view}"
        return message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.space, self.requested, self.largest_free, self.view, self.reason))


class DeallocatedTensorError(TTFlowError):
    """A tensor was used after `deallocate` freed it."""


class ProgramError(TTFlowError):
    """A program is malformed, was submitted with the wrong inputs, or failed while running."""


class HostOpError(ProgramError):
    """A host op (`ProgramBuilder.host_op`) whose function raised, or returned arrays other than
    the ones it declares; or a program with one that was asked to go to a file (a Python
    function cannot be saved). `op` is `host_op:<name>`; a raised exception is the
    `__cause__` of the error the program's outputs hold."""

    def __init__(self, message: str, op: str | None = None) -> None:
        super().__init__(message)
        self.op = op

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.op), self.__dict__)


class DebugHookError(TTFlowError):
    """A debug hook misused: an `OpTensor` used after its callback, a program input replaced,
    a second `tt.debug_hooks` block on one device."""


class BinaryFormatError(TTFlowError):
    """A binary file is corrupt, truncated, of another version, or not a ttflow binary."""


class FileError(TTFlowError, OSError):
    """A file ttflow was asked to read or write could not be: missing, a folder, in a folder
    that does not exist, not permitted, on a full disk. Also an `OSError` (`except OSError`
    still catches it) with the system's `errno` and `strerror` and the path as `filename`; the
    system's own error is the `__cause__`. The message names the path and what to do."""

    def __init__(self, message: str, filename: str, errno: int | None = None,
                 strerror: str | None = None) -> None:
        super().__init__(errno, strerror, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message, self.filename, self.errno, self.strerror))

    @classmethod
    def of(cls, error: OSError, action: str, path: str | os.PathLike[str], *, writing: bool,
           example: str | None = None) -> FileError:
        """The error to raise `from error`, which the system raised when ttflow tried to
        `action` `path` ("save the binary to"); `example` is a file name to suggest when the
        path is a folder."""
        name = os.fspath(path)
        if isinstance(error, IsADirectoryError):
            reason = "it is a folder" + (f"; give a file name, e.g. {os.path.join(name, example)!r}"
                                         if example else "")
        elif isinstance(error, NotADirectoryError):
            reason = "a part of its path is a file, not a folder"
        elif isinstance(error, FileNotFoundError):
            folder = os.path.dirname(name) or "."
            reason = (f"the folder {folder!r} does not exist; create it first" if writing
                      and not os.path.isdir(folder) else "no such file")
        elif isinstance(error, PermissionError):
            reason = "permission denied; " + ("choose a path you may write" if writing
                                              else "check the file's permissions")
        else:
            reason = error.strerror or str(error)
        return cls(f"cannot {action} {name!r}: {reason}", name, error.errno, error.strerror)


class DeviceClosedError(TTFlowError):
    """The device was closed; open a new one with `tt.open_device()`."""


class DeviceLostError(TTFlowError):
    """The worker process that runs a device's records (`open_device(workers="process")`) died:
    every command of the device that had not completed fails with this error, and so does every
    later one. `chip` is the mesh coordinate of the lost chip (None for a lone device). Other
    devices and chips go on; close this one (`async with` exits cleanly) and open a new one."""

    def __init__(self, message: str, chip: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.chip = chip

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.chip))


class TraceError(TTFlowError):
    """A trace cannot be captured or replayed: a host transfer inside a capture, a released
    trace, a traced input deallocated, or a captured command that failed."""


class MeshError(TTFlowError):
    """A mesh, or a tensor distributed over one, used where it cannot be: a released submesh, a
    tensor of another mesh, sharded shards read without a composer, a reshape the chips'
    links do not allow."""


class CollectiveError(TTFlowError):
    """A collective (all_gather, all_reduce, ...) whose group could not complete it: a peer
    chip's command failed first (its error, an earlier command's, no memory, its device
    closed, a cancelled block), or the group never met within the timeout. `chip` is the
    coordinate of the chip that failed first (None when the submit was aborted as a whole or
    timed out), `collective` the op; the message says both and the first error. The chips of
    the submit fail their commands with it instead of waiting: fix the failing chip's error."""

    def __init__(self, message: str, chip: tuple[int, int] | None = None, collective: str | None = None) -> None:
        super().__init__(message)
        self.chip = chip
        self.collective = collective

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.chip, self.collective))


def detach_frames(error: BaseException, origin: str) -> None:
    """Makes a stored error hold no frames: it may outlive them by a long time.

    An error kept on a failed tensor is re-raised by every await; its traceback's frames would
    keep the failed command, its inputs and every caller's locals alive while the tensor lives.
    The frames are dropped (an unexpected error keeps where it came from as a note).
    """
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        tb = link.__traceback__
        if tb is not None:
            if link is error:
                link.add_note(f"raised by {origin}")
                if not isinstance(link, TTFlowError):
                    link.add_note("".join(traceback.format_tb(tb)).rstrip())
            link.__traceback__ = None
        link = link.__cause__ or link.__context__


def raise_stored(error: BaseException) -> NoReturn:
    """Raises a fresh copy of a stored error, caused by the original.

    Raising the stored object itself would append the awaiting frames to its traceback on every
    await (a traceback that grows without bound and pins each caller's frames).
    """
    try:
        fresh = copy.copy(error)
    except Exception:
        fresh = None
    if fresh is None or type(fresh) is not type(error) or fresh is error:
        raise error.with_traceback(None)
    raise fresh.with_traceback(None) from error
