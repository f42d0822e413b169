"""The emulated device: its memory spaces, its two command queues, and its counters.

`open_device` owns the queue tasks (structured concurrency): on a normal exit it drains both
queues, on an error or cancellation it fails what has not started, and either way it frees
every buffer and releases the bank memory before returning.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from typing import Any, final

import anyio
import attrs

from ._blas import limit_blas_threads
from ._errors import DeviceClosedError, detach_frames
from ._memory import MemorySpaceState
from ._queue import Command, CommandQueue
from ._tensor import Storage, Tensor
from ._types import DeviceSpec, Layout, MemorySpace, storage_geometry

__all__ = ["Device", "DeviceStatistics", "open_device"]


@final
@attrs.frozen
class DeviceStatistics:
    """A snapshot of a device's counters (bytes are those of host arrays, not padded tiles)."""

    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    programs_run: int = 0
    evictions: int = 0
    eviction_bytes: int = 0
    layout_conversions: int = 0
    residency_copies: int = 0
    residency_copy_bytes: int = 0
    l1_peak_bytes: int = 0
    dram_peak_bytes: int = 0
    commands_run: int = 0
    commands_failed: int = 0


_COUNTERS = tuple(
    f.name for f in attrs.fields(DeviceStatistics) if not f.name.endswith("_peak_bytes")
)


@final
class Device:
    """An open emulated device. Make one with `tt.open_device()`."""

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self.closed = False
        self._spaces = {space: MemorySpaceState(spec, space) for space in MemorySpace}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._cq0 = CommandQueue("CQ0", self._complete)
        self._cq1 = CommandQueue("CQ1", self._complete)
        self._owned: dict[Storage, None] = {}
        self._l1: dict[Storage, weakref.ReferenceType[Tensor]] = {}
        self._garbage: collections.deque[list[Storage]] = collections.deque()
        # Per-program plans die with their program: a front-end that builds programs on the fly
        # (one per shape, say) must not find every one it ever built kept alive here.
        self._plans: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._listeners: list[Any] = []

    def __repr__(self) -> str:
        return f"<ttflow.Device {self.spec.name}{' closed' if self.closed else ''}>"

    # -- public inspection ------------------------------------------------------------------

    @property
    def stats(self) -> DeviceStatistics:
        return DeviceStatistics(
            **self._counters,
            l1_peak_bytes=self._spaces[MemorySpace.L1].peak_bytes,
            dram_peak_bytes=self._spaces[MemorySpace.DRAM].peak_bytes,
        )

    def memory_used(self, space: MemorySpace) -> int:
        """Bytes allocated in `space`, summed over its banks."""
        self._collect_garbage()
        return self._spaces[space].used_bytes()

    def memory_free(self, space: MemorySpace) -> int:
        self._collect_garbage()
        return self._spaces[space].free_bytes()

    def read_bank(self, space: MemorySpace, bank: int, address: int, nbytes: int) -> bytes:
        """Raw bytes of one bank, for debugging and byte-exact tests."""
        self.check_open()
        return self._spaces[space].memory.read(bank, address, nbytes)

    def check_open(self) -> None:
        if self.closed:
            raise DeviceClosedError("the device is closed; open a new one with tt.open_device()")

    # -- used by the runtime and the scheduler (event loop thread only) ---------------------

    def _banks(self, space: MemorySpace) -> Any:
        return self._spaces[space].banks

    def _count(self, name: str, amount: int) -> None:
        self._counters[name] += amount

    def _allocate(self, layout: Layout, shape: tuple[int, ...], owner: Tensor | None) -> Storage:
        assert layout.dtype is not None
        self._collect_garbage()
        page_size, num_pages = storage_geometry(shape, layout.dtype, layout.tensor_layout)
        storage = Storage(layout, self._spaces[layout.memory].allocate(page_size, num_pages), shape)
        self._owned[storage] = None
        if owner is not None and layout.memory is MemorySpace.L1:
            self._l1[storage] = weakref.ref(owner)
        return storage

    def _free(self, storage: Storage) -> None:
        if storage in self._owned:
            del self._owned[storage]
            self._spaces[storage.layout.memory].free(storage.buffer)
            self._l1.pop(storage, None)

    def _collect_garbage(self) -> None:
        garbage = self._garbage
        while garbage:
            for storage in garbage.popleft():
                self._free(storage)

    def _enqueue(self, command: Command, queue: CommandQueue) -> None:
        """Orders `command` after the writes it reads and the reads it overwrites, then queues it."""
        deps = command.deps
        for tensor in command.reads:
            writer = tensor._last_writer
            if writer is not None and not writer.done and writer.queue is not queue:
                deps.append(writer)
        for tensor in command.writes:
            writer = tensor._last_writer
            if writer is not None and not writer.done and writer.queue is not queue:
                deps.append(writer)
            reader = tensor._last_reader
            if reader is not None and not reader.done and reader.queue is not queue:
                deps.append(reader)
        queue.push(command)
        for tensor in command.reads:
            tensor._last_reader = command
            tensor._pending += 1
        for tensor in command.writes:
            tensor._last_writer = command
            tensor._pending += 1

    def _complete(self, command: Command, error: BaseException | None) -> None:
        self._counters["commands_run"] += 1
        if error is not None:
            self._counters["commands_failed"] += 1
            detach_frames(error, f"{command.describe()['name']} on {command.queue.name if command.queue else 'CQ0'}")
        for listener in self._listeners:
            listener(command, error)
        for tensor in command.writes:
            tensor._error = error
            if tensor._last_writer is command:
                tensor._last_writer = None
            self._settle(tensor)
        for tensor in command.reads:
            if tensor._last_reader is command:
                tensor._last_reader = None
            self._settle(tensor)
        command.complete(error)

    def _settle(self, tensor: Tensor) -> None:
        tensor._pending -= 1
        if tensor._deallocated:
            self._release(tensor)

    def _release(self, tensor: Tensor) -> None:
        """Frees a deallocated tensor's storages once no queued command needs them."""
        if tensor._pending == 0:
            for storage in tensor._storages:
                self._free(storage)
            tensor._storages.clear()

    def _eviction_victims(self, keep: tuple[Tensor, ...]) -> list[tuple[Tensor, Storage]]:
        """Ready L1 storages of tensors a starting program does not read."""
        victims = []
        for storage, ref in self._l1.items():
            tensor = ref()
            if tensor is None or tensor in keep or tensor._last_writer is not None:
                continue
            victims.append((tensor, storage))
        return victims

    # -- lifetime ---------------------------------------------------------------------------

    async def _serve(self, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._cq0.serve)
            tg.start_soon(self._cq1.serve)
            task_status.started()

    def _shutdown(self) -> None:
        """Fails whatever never ran, frees every buffer and releases the bank memory."""
        self.closed = True
        abort = DeviceClosedError("the device was closed before this command ran")
        for queue in (self._cq0, self._cq1):
            queue.close(abort)
            while len(queue):
                self._complete(queue._pending.popleft(), abort)
        self._collect_garbage()
        for storage in list(self._owned):
            self._free(storage)
        for state in self._spaces.values():
            state.close()


@asynccontextmanager
async def open_device(
    spec: DeviceSpec | None = None, *, blas_threads: int | None = 1
) -> AsyncIterator[Device]:
    """Opens an emulated device (default: a Wormhole n150) and its two command queues.

    On exit, pending work is drained (or, if the block raised, failed with DeviceClosedError),
    every buffer is freed and the device is closed.

    `blas_threads`: while the device is open, numpy's BLAS (which runs the programs' matmuls)
    uses at most this many threads; `None` leaves the library's setting alone. The default, 1,
    keeps a matmul on one core, so a CQ1 copy runs on another and a busy core does not stall
    every program: on 2 cores with one kept busy by another process, the demo ran 4.0-8.4x
    faster than with the library default (one thread per core), and double buffering overlapped
    0.88-1.00 instead of 0.62-0.84 on a quiet machine (docs/performance.md, "BLAS threads").
    A larger number may pay for a large compute-bound program on an idle many-core machine.
    The limit is process-wide (threadpoolctl) and reference-counted: devices open at once,
    nested or on different threads, run with the smallest limit among them, and the setting
    from before the first one comes back when the last one closes.
    """
    blas = nullcontext() if blas_threads is None else limit_blas_threads(blas_threads)
    device = Device(spec if spec is not None else DeviceSpec())
    body_error: Exception | None = None
    with blas:
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(device._serve)
                try:
                    yield device
                except Exception as exc:
                    body_error = exc
                    abort = DeviceClosedError("the device was closed before this command ran")
                    device._cq0.close(abort)
                    device._cq1.close(abort)
                else:
                    device._cq0.close()
                    device._cq1.close()
        finally:
            device._shutdown()
    if body_error is not None:
        raise body_error
