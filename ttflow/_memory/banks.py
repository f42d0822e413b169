"""Bank memory and its allocator: addresses and bytes, no tensors.

A memory space (DRAM or L1) is `num_banks` banks of `bank_bytes` each, held as one 2-D uint8
array `banks[bank, address]`. It is an anonymous `MAP_NORESERVE` mapping, so the kernel commits a
page only when it is first written: a 12 GiB n150 DRAM costs no RSS until it is used, and the
device opens in milliseconds. A device whose records run in a worker process
(`open_device(workers="process")`) keeps each space in a shared file instead
(`/dev/shm/ttflow-<pid>-<n>-<space>`, sparse: only touched pages take memory), which the host
and the worker both map; the host removes it when the device closes.

A shared file's pages are backed explicitly, before bytes can land in them: touching an
unbacked page of a full tmpfs raises SIGBUS, which kills the process that touched it (the host
too). `MemorySpaceState.reserve` (and a claim of a given range: circular buffers, a slide's
target) commits the bank rows' range in every bank with `posix_fallocate`, a chunk at a time
(`BankMemory.commit`: a chunk once), and turns a failure into an `OutOfMemoryError` naming the
file system, the allocation undone and the device usable.

Interleaved buffers are allocated in lockstep: one address range, the same in every bank,
`ceil(pages / banks)` aligned pages deep. The allocator therefore manages a single address line
per space: a best-fit free list that coalesces freed neighbours, bottom-up for DRAM and top-down
for L1, as tt-metal does.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import weakref
from typing import Any, final

import attrs
import numpy as np

from .._core._allocator import Allocator
from .._core._dispatch import StorageCore
from .._errors import OutOfMemoryError, ShapeError, TTFlowError
from .._types import DataType, DeviceSpec, Layout, MemorySpace

__all__ = ["BufferInfo", "BufferView", "MemoryView", "Storage", "BankMemory", "Allocator",
           "MemorySpaceState", "TraceRegion", "TRACE_BYTES_PER_COMMAND", "RemoteBanks", "RemoteBankMemory", "RemoteMemoryError", "SHARED_PREFIX",
           "map_shared", "shared_path"]

_MAP_NORESERVE = 0x4000  # Linux; Python < 3.13 does not export it.


@final
@attrs.frozen
class BufferInfo:
    """Where an interleaved buffer lives: page i is in bank i % banks at address + (i // banks) * aligned_page_size."""

    space: MemorySpace
    address: int
    page_size: int
    aligned_page_size: int
    num_pages: int


@final
@attrs.frozen
class BufferView:
    """One live allocation of a memory space, as `Device.memory_view` shows it.

    `address` is the same in every bank (lockstep allocation) and `depth` the bytes it takes in
    each; `nbytes` is `depth` summed over the banks. `kind` says why it is there:
    "home" (a tensor's own copy), "conversion" (a copy of a tensor in another layout, kept for
    reuse), "pending" (an output or move target of a command that is running), "scratch" (a
    running program's intermediate), "circular_buffers" (the L1 footprint of the running
    program, at the bottom of L1), "trace" (kept for a captured trace's replays), "trace_buffer"
    (a trace's recorded commands, in the DRAM trace region `open_device(trace_region_size=...)`
    reserves at the top of every bank: not counted in `memory_used`). `tensor` is
    the name its tensor was given (`Tensor.name`), if any.
    """

    address: int
    depth: int
    nbytes: int
    kind: str
    shape: tuple[int, ...] | None = None
    dtype: DataType | None = None
    layout: Layout | None = None
    tensor: str | None = None

    def describe(self) -> str:
        """What the buffer holds, for a table or a map: the tensor's name (if it has one), then
        its shape, dtype and layout; "" for circular buffers."""
        what = f"{self.tensor}: " if self.tensor is not None else ""
        if self.shape is not None and self.layout is not None and self.dtype is not None:
            what += f"{self.shape} {self.dtype.name} {self.layout.tensor_layout.name}"
        return what.rstrip(": ")


@final
@attrs.frozen
class MemoryView:
    """A snapshot of one memory space (tt-mlir's `getMemoryView`, with the buffers in it).

    Bytes are summed over the space's banks. `fragmentation` is 1 - largest_free_block / free:
    0 when the free memory is one block, near 1 when it is scattered in small holes (then an
    allocation can fail with plenty free; the runtime relocates buffers before that happens).
    """

    space: MemorySpace
    num_banks: int
    total: int
    used: int
    free: int
    largest_free_block: int
    buffers: tuple[BufferView, ...]
    free_blocks: tuple[tuple[int, int], ...] = ()
    """(address, depth) of each free block of the address line."""

    @property
    def fragmentation(self) -> float:
        return 0.0 if self.free == 0 else 1.0 - self.largest_free_block / self.free

    def __str__(self) -> str:
        lines = [
            f"{self.space.name}: {_mib(self.used)} used of {_mib(self.total)} "
            f"({self.used / self.total:.1%}), {_mib(self.free)} free, largest free block "
            f"{_mib(self.largest_free_block)}, fragmentation {self.fragmentation:.2f}, "
            f"{len(self.buffers)} buffers"
        ]
        circular = sum(b.nbytes for b in self.buffers if b.kind == "circular_buffers")
        if circular:
            lines[0] += f" (used includes {_mib(circular)} of circular buffers)"
        shown = sorted(self.buffers, key=lambda b: -b.nbytes)[:_SHOWN]
        for b in sorted(shown, key=lambda b: b.address):
            lines.append(f"  0x{b.address:08x}  {_mib(b.nbytes):>11}  {b.kind:<16} {b.describe()}".rstrip())
        if len(self.buffers) > _SHOWN:
            lines.append(f"  ... and {len(self.buffers) - _SHOWN} smaller buffers")
        return "\n".join(lines)


_SHOWN = 12  # buffers a printed view lists (the largest)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**16 else f"{nbytes} B"


@final
class Storage(StorageCore):
    """One copy of a value in one layout, at one place in bank memory (no tensor state).

    The geometry is kept as plain fields of the C record (what the hot paths read, see
    `_core._dispatch.StorageCore`); `buffer` is the public `BufferInfo` of the same, made when
    first asked for.
    """

    __slots__ = ()

    @property
    def buffer(self) -> BufferInfo:
        buffer = self._buffer
        if buffer is None:
            buffer = self._buffer = BufferInfo(self.layout.memory, self.address, self.page_size,
                                               self.aligned_page_size, self.num_pages)
        return buffer

    def same_format(self, other: Storage) -> bool:
        """Whether a copy between the two only moves pages (same dtype and tensor layout)."""
        return (
            self.layout.dtype is other.layout.dtype
            and self.layout.tensor_layout is other.layout.tensor_layout
        )

    def __repr__(self) -> str:
        return f"Storage({self.layout}, {self.buffer})"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


SHARED_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
"""Where shared bank memory lives (a RAM file system on Linux)."""
SHARED_PREFIX = f"ttflow-{os.getpid()}-"
"""The name every shared bank memory of this process starts with (tests look for leftovers)."""
_shared_ids = itertools.count()


def shared_path(tag: str) -> str:
    """A new path for a shared bank memory of this process: `<dir>/ttflow-<pid>-<n>-<tag>`."""
    return os.path.join(SHARED_DIR, f"{SHARED_PREFIX}{next(_shared_ids)}-{tag}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _close_and_unlink(fd: int, path: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    _unlink(path)


_fallocate = os.posix_fallocate  # (tests replace it to fail)
_FULL = (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG)
"""Errors of `posix_fallocate` that mean: no room left (anything else is a bug, raised as is)."""
_CHUNK = 1 << 16
"""The smallest range of a bank that `BankMemory.commit` backs at once (bytes)."""


@final
class BankMemory:
    """`num_banks` x `bank_bytes` of zero-filled memory, committed lazily by the OS.

    With `shared_path`, the memory is that file, made here (sparse, so still committed page by
    page) and mapped shared, so that a worker process can map the same bytes
    (`_workers.process`); `close` removes the file (and so does the interpreter's exit, if the
    memory was never closed)."""

    def __init__(self, num_banks: int, bank_bytes: int, shared_path: str | None = None) -> None:
        self.num_banks = num_banks
        self.bank_bytes = bank_bytes
        self.shared_path = shared_path
        nbytes = num_banks * bank_bytes
        self._committed: bytearray | None = None  # per chunk of the bank line: backed yet
        self._chunk = 1
        self._fd = -1
        if shared_path is None:
            self._map = _anonymous_map(nbytes)
        else:
            self._map = map_shared(shared_path, nbytes, create=True)
            try:
                self._fd = os.open(shared_path, os.O_RDWR)  # kept for `commit`
            except BaseException:
                _unlink(shared_path)
                raise
            self._unlink = weakref.finalize(self, _close_and_unlink, self._fd, shared_path)
            self._chunk = min(bank_bytes, max(_CHUNK, _round_up(bank_bytes // 1024, mmap.PAGESIZE)))
            self._committed = bytearray(-(-bank_bytes // self._chunk))
        self.banks: np.ndarray[Any, np.dtype[np.uint8]] = np.frombuffer(
            self._map, dtype=np.uint8, count=nbytes
        ).reshape(num_banks, bank_bytes)

    def read(self, bank: int, address: int, nbytes: int) -> bytes:
        if not 0 <= bank < self.num_banks:
            raise ShapeError(f"bank {bank} does not exist: there are {self.num_banks} banks")
        if nbytes < 0 or address < 0 or address + nbytes > self.bank_bytes:
            raise ShapeError(
                f"bytes [{address}, {address + nbytes}) are outside the bank's "
                f"{self.bank_bytes} bytes"
            )
        return self.banks[bank, address : address + nbytes].tobytes()

    def commit(self, address: int, depth: int) -> None:
        """Backs bytes [address, address + depth) of every bank of a shared memory with pages
        (whole chunks, each once), so that no write there can meet a full file system (SIGBUS);
        OSError (ENOSPC...) when the file system has no room. Nothing to do when not shared."""
        committed = self._committed
        if committed is None or depth <= 0:
            return
        chunk = self._chunk
        first, last = address // chunk, -(-(address + depth) // chunk)
        if committed.find(0, first, last) < 0:
            return  # the common case: backed already
        bank_bytes, fd = self.bank_bytes, self._fd
        i = first
        while i < last:
            if committed[i]:
                i += 1
                continue
            j = i
            while j < last and not committed[j]:
                j += 1
            start = i * chunk
            length = min(j * chunk, bank_bytes) - start
            for bank in range(self.num_banks):
                _fallocate(fd, bank * bank_bytes + start, length)
            committed[i:j] = b"\x01" * (j - i)
            i = j

    def committed_bytes(self) -> int | None:
        """Bytes of the shared file backed so far (None when not shared)."""
        committed = self._committed
        if committed is None:
            return None
        return sum(min((i + 1) * self._chunk, self.bank_bytes) - i * self._chunk
                   for i, c in enumerate(committed) if c) * self.num_banks

    def close(self) -> None:
        """Give the pages back to the OS. The array must not be used afterwards."""
        self.banks = np.empty((0, 0), np.uint8)
        try:
            self._map.close()
        except BufferError:
            # A view of the mapping is still alive (a test holding it, an exception frame kept
            # by a failing example while hypothesis shrinks): the mapping is released when the
            # last view dies, but its pages go back now (they read as zeros from here on), so
            # that a thousand closed devices do not hold a thousand devices' memory.
            if hasattr(mmap, "MADV_DONTNEED"):
                self._map.madvise(mmap.MADV_DONTNEED)
        if self.shared_path is not None:
            self._committed = None
            self._unlink()  # the file's pages go once no process maps it (and the fd closes)


class RemoteMemoryError(TTFlowError):
    """Something in the host process tried to read or write a chip's bank memory that lives
    elsewhere (`open_device(workers="ray")`: in a Ray actor, maybe on another host), or to run
    there what cannot travel to it (debug hooks, host ops)."""


@final
class RemoteBanks:
    """The host's stand-in for the banks of a memory space that lives in a Ray actor: every
    read, write, view or conversion of it raises `RemoteMemoryError`, so that no record can
    run on the host against a copy that is not the chip's (a wrong value raising nothing)."""

    __slots__ = ("space", "where")

    def __init__(self, space: str, where: str) -> None:
        self.space = space
        self.where = where

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RemoteMemoryError(
            f"the {self.space} banks of this device live in {self.where}, not in this process: "
            "the host never reads or writes them (every record runs there: debug hooks and host ops, "
            "which would run here, cannot)")

    __getitem__ = __setitem__ = __array__ = __len__ = __iter__ = __bytes__ = _refuse

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse()

    def __repr__(self) -> str:
        return f"<RemoteBanks {self.space} in {self.where}>"


@final
class RemoteBankMemory:
    """A memory space's bank memory as the host holds it when it lives in a Ray actor: its
    shape, and `banks` that refuse every access (`RemoteBanks`); `read` refuses too (the
    device reads a bank through its actor, `Device.read_bank`)."""

    shared_path = None
    _committed = None
    _chunk = 1

    def __init__(self, num_banks: int, bank_bytes: int, space: str, where: str) -> None:
        self.num_banks = num_banks
        self.bank_bytes = bank_bytes
        self.banks: Any = RemoteBanks(space, where)

    def read(self, bank: int, address: int, nbytes: int) -> bytes:
        return self.banks[bank, address: address + nbytes]  # type: ignore[no-any-return]

    def commit(self, address: int, depth: int) -> None:
        pass  # the actor's memory is committed as it is touched

    def committed_bytes(self) -> None:
        return None

    def close(self) -> None:
        pass


def map_shared(path: str, nbytes: int, create: bool = False) -> mmap.mmap:
    """A shared mapping of the file at `path` (`create`: made here, `nbytes` long and sparse;
    it must not exist yet)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            try:
                os.ftruncate(fd, nbytes)
            except BaseException:
                _unlink(path)
                raise
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _MAP_NORESERVE)
    finally:
        os.close(fd)


def _anonymous_map(nbytes: int) -> mmap.mmap:
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | _MAP_NORESERVE
    try:
        return mmap.mmap(-1, nbytes, flags=flags)
    except (OSError, ValueError):
        # Not Linux, or the flag was refused: an ordinary anonymous mapping is still lazy.
        return mmap.mmap(-1, nbytes)


class _BackedAllocator(Allocator):
    """The allocator of a shared memory space: a placement at a given address (a program's
    circular buffers, a slide's target) is backed too, as `MemorySpaceState.reserve` backs an
    allocation (`space` is set after construction: the C constructor takes three arguments)."""

    space: MemorySpaceState

    def claim(self, start: int, nbytes: int) -> bool:
        if not super().claim(start, nbytes):
            return False
        self.space.back(start, nbytes)
        return True


TRACE_BYTES_PER_COMMAND = 4096
"""What a trace buffer holds for each command it replays: ttflow's model of the dispatch
commands (launch messages, runtime arguments) tt-metal records into a trace buffer."""


@final
class TraceRegion:
    """The DRAM region trace buffers live in (`open_device(trace_region_size=...)`): the top
    `trace_region_size` bytes of every DRAM bank, as tt-metal reserves them, allocated
    bottom-up, interleaved like any DRAM buffer. A capture whose buffer does not fit fails."""

    def __init__(self, dram: MemorySpaceState) -> None:
        self.base = dram.bank_bytes - dram.reserved_top
        self.num_banks = dram.num_banks
        self.allocator = Allocator(dram.reserved_top, dram.alignment, top_down=False)

    @property
    def size(self) -> int:
        """Bytes of the region, summed over the banks."""
        return self.allocator.size * self.num_banks

    def used_bytes(self) -> int:
        return self.allocator.used_bytes * self.num_banks

    def allocate(self, nbytes: int) -> int:
        """The bank address of a trace buffer of `nbytes` (interleaved); OutOfMemoryError
        naming the region when it does not fit."""
        depth = _round_up(-(-nbytes // self.num_banks), self.allocator.alignment)
        address = self.allocator.allocate(depth)
        if address is None:
            raise OutOfMemoryError(
                "trace region", depth, self.allocator.largest_free,
                reason=f"a trace buffer of {nbytes} bytes; the region holds {self.size} bytes, "
                f"{self.size - self.used_bytes()} free: open the device with a larger trace_region_size")
        return self.base + address

    def free(self, address: int) -> None:
        self.allocator.free(address - self.base)

    def allocations(self) -> dict[int, int]:
        """Bank address -> depth of each trace buffer."""
        return {self.base + a: depth for a, depth in self.allocator.allocations().items()}


@final
class MemorySpaceState:
    """One memory space of a device: its banks and the allocator of their shared address line."""

    def __init__(self, spec: DeviceSpec, space: MemorySpace, shared: bool = False,
                 remote: str | None = None, reserved_top: int = 0) -> None:
        self.space = space
        self.num_banks = spec.banks(space)
        self.bank_bytes = spec.bank_bytes(space)
        self.alignment = spec.alignment(space)
        # The top of every bank kept out of the allocator's reach: L1's `l1_small_size`, DRAM's
        # trace region (`open_device`); the banks still hold it (a `TraceRegion` lives there).
        self.reserved_top = _round_up(reserved_top, self.alignment)
        path = shared_path(space.name.lower()) if shared else None
        # `remote`: where the banks live instead (a Ray actor): the host keeps only refusals.
        self.memory: Any = (BankMemory(self.num_banks, self.bank_bytes, path) if remote is None
                            else RemoteBankMemory(self.num_banks, self.bank_bytes, space.name, remote))
        self.allocator: Allocator = (_BackedAllocator if shared else Allocator)(
            self.bank_bytes - self.reserved_top, self.alignment, top_down=space is MemorySpace.L1
        )
        # A shared space's chunks backed so far (`BankMemory.commit`), read here for its fast path.
        self._committed = self.memory._committed
        self._chunk = self.memory._chunk
        if shared:
            self.allocator.space = self  # type: ignore[attr-defined]
        self.peak_bytes = 0

    @property
    def banks(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return self.memory.banks

    def used_bytes(self) -> int:
        return self.allocator.used_bytes * self.num_banks

    def free_bytes(self) -> int:
        return (self.allocator.size - self.allocator.used_bytes) * self.num_banks

    def allocate(self, page_size: int, num_pages: int) -> BufferInfo:
        """Room for `num_pages` interleaved pages; OutOfMemoryError when no block fits."""
        aligned = _round_up(page_size, self.alignment)
        address = self.reserve(-(-num_pages // self.num_banks) * aligned)
        return BufferInfo(self.space, address, page_size, aligned, num_pages)

    def reserve(self, depth: int) -> int:
        """The address of `depth` bytes in every bank; OutOfMemoryError when no block fits."""
        allocator = self.allocator
        address = allocator.allocate(depth)
        if address is None:
            raise OutOfMemoryError(self.space, depth, allocator.largest_free)
        committed = self._committed
        if committed is not None:
            chunk = self._chunk
            if committed.find(0, address // chunk, -(-(address + depth) // chunk)) >= 0:
                self.back(address, depth)
        used = allocator.used_bytes * self.num_banks
        if used > self.peak_bytes:
            self.peak_bytes = used
        return address

    def back(self, address: int, depth: int) -> None:
        """Commits the shared file's pages of [address, address + depth) in every bank (see the
        module); when the file system is full, frees the allocation at `address` and raises
        OutOfMemoryError saying so."""
        try:
            self.memory.commit(address, depth)
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
            self.allocator.free(address)
            raise OutOfMemoryError(
                self.space, depth, self.allocator.largest_free,
                reason=f"{SHARED_DIR} is full: could not back {depth} bytes per bank of "
                f"{self.memory.shared_path} ({os.strerror(exc.errno)}); free room in {SHARED_DIR} "
                "(or grow it), or use workers='thread'") from None

    def aligned(self, page_size: int) -> int:
        return _round_up(page_size, self.alignment)

    def free(self, buffer: BufferInfo) -> None:
        self.allocator.free(buffer.address)

    def close(self) -> None:
        self.memory.close()
