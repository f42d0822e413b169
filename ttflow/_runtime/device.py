"""The emulated device: its memory spaces, its two command queues, and its counters.

`open_device` owns the queue tasks (structured concurrency): on a normal exit it drains both
queues, on an error or cancellation it fails what has not started, and either way it frees
every buffer and releases the bank memory before returning.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext
from typing import Any, final

import anyio
import attrs

from .._blas import limit_blas_threads
from .._commands import INLINE_SECONDS, PROCESS_INLINE_SECONDS
from .._errors import DeviceClosedError, DeviceLostError
from .._memory.banks import MemorySpaceState, MemoryView, TraceRegion
from .._queue import Command, CommandQueue
from .._sched import EVICTION_POLICIES, Scheduler
from .._types import DeviceSpec, MemorySpace
from .._workers.process import WORKER_TIMEOUT, ProcessQueueWorker, WorkerProcess
from .._workers.ray import STRATEGIES, RayChip, RayQueueWorker, RayWorkers, spaces_of

__all__ = ["Device", "DeviceStatistics", "open_device", "WORKERS"]

WORKERS = ("thread", "process", "ray")
"""Where a device's large records run (`open_device(workers=...)`)."""


@final
@attrs.frozen
class DeviceStatistics:
    """A snapshot of a device's counters (bytes are those of host arrays, not padded tiles).

    `layout_conversions` counts copies that change a value's layout or dtype (by `to_layout` or
    at a program's start); `residency_copies` / `residency_copy_bytes` count copies that only
    move a value between memory spaces (an evicted L1 copy brought back); `evictions` /
    `eviction_bytes` count L1 storages moved to DRAM and the bytes copied (an eviction whose
    value DRAM already holds copies nothing). `programs_run` includes programs run by trace
    replays; `trace_replays` counts the replays. `donations` / `donated_bytes` count output
    buffers taken over from donated inputs (no allocation, no copy); `cache_update_bytes` the
    bytes that donated `update_cache` steps wrote in place (the row's band of tiles, not the
    whole cache). `relocations` / `relocation_bytes` count buffers moved within their memory
    space to make a free block (an allocation that would otherwise have failed with memory free,
    or a program's circular buffers where L1 buffers were). `const_eval_hits` /
    `const_eval_misses` count submits whose constant-only part of the program was found in the
    device's const-eval cache / had to be computed (and cached) first.
    `program_cache_hits` / `program_cache_misses` count submits that found their program's
    plan kept on the device / had to plan it (every submit, while `program_cache_enabled` is
    False).
    """

    host_to_device_bytes: int = 0
    device_to_host_bytes: int = 0
    programs_run: int = 0
    evictions: int = 0
    eviction_bytes: int = 0
    layout_conversions: int = 0
    residency_copies: int = 0
    residency_copy_bytes: int = 0
    trace_replays: int = 0
    donations: int = 0
    donated_bytes: int = 0
    cache_update_bytes: int = 0
    relocations: int = 0
    relocation_bytes: int = 0
    l1_peak_bytes: int = 0
    dram_peak_bytes: int = 0
    commands_run: int = 0
    commands_failed: int = 0
    const_eval_hits: int = 0
    const_eval_misses: int = 0
    program_cache_hits: int = 0
    program_cache_misses: int = 0


_COUNTERS = tuple(
    f.name for f in attrs.fields(DeviceStatistics)
    if not f.name.endswith("_peak_bytes") and not f.name.startswith("program_cache_")
)


def _check_size(name: str) -> Any:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if value is None and name == "trace_region_size":
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int of bytes per bank, got {value!r}")
    return check


@final
@attrs.frozen
class DeviceOptions:
    """The options tt-mlir's `openMeshDevice` takes (`MeshDeviceOptions`), each in the emulated
    memory map: `num_hw_cqs` hardware command queues (2: host writes on CQ1 beside CQ0's work;
    1: everything on CQ0, in order); `l1_small_size` bytes at the top of every L1 bank kept
    from L1 buffers (tt-metal's L1_SMALL region; ttflow allocates nothing there); and
    `trace_region_size` bytes at the top of every DRAM bank where trace buffers live
    (`TraceRegion`), None for none: ttflow's traces then keep no trace buffer."""

    num_hw_cqs: int = attrs.field(default=2)
    l1_small_size: int = attrs.field(default=0, validator=_check_size("l1_small_size"))
    trace_region_size: int | None = attrs.field(default=None, validator=_check_size("trace_region_size"))

    @num_hw_cqs.validator
    def _check_queues(self, attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or value not in (1, 2):
            raise ValueError(f"num_hw_cqs must be 1 or 2 (tt-metal's hardware command queues), got {value!r}")

    def check_fits(self, spec: DeviceSpec) -> None:
        """Each reserved region leaves room for buffers in its space."""
        for name, size, space in (("l1_small_size", self.l1_small_size, MemorySpace.L1),
                                  ("trace_region_size", self.trace_region_size or 0, MemorySpace.DRAM)):
            if size >= spec.bank_bytes(space):
                raise ValueError(f"{name}={size} leaves no room in a {space.name} bank of "
                                 f"{spec.bank_bytes(space)} bytes")


@final
class Device:
    """An open emulated device. Made by `tt.open_device()`.

    The device is the hardware (bank memory, allocators, two command queues) and its public face
    (counters, memory use, raw bank reads). What the runtime knows about tensors lives in its
    scheduler, the one writer of that state.
    """

    def __init__(self, spec: DeviceSpec, eviction: str = "lookahead",
                 inline_seconds: float = INLINE_SECONDS, workers: str = "thread",
                 blas_threads: int | None = 1, worker_timeout: float | None = WORKER_TIMEOUT,
                 ray_chip: RayChip | None = None, options: DeviceOptions | None = None) -> None:
        self.spec = spec
        self.closed = False
        self.workers = workers
        self.options = options if options is not None else DeviceOptions()
        shared = workers == "process"
        # workers="ray": the banks live in the chip's Ray actor; the host keeps refusals.
        remote = None if ray_chip is None else "a Ray actor"
        reserved = {MemorySpace.L1: self.options.l1_small_size,
                    MemorySpace.DRAM: self.options.trace_region_size or 0}
        self._spaces = {space: MemorySpaceState(spec, space, shared, remote, reserved[space])
                        for space in MemorySpace}
        self._banks = {space: state.banks for space, state in self._spaces.items()}
        scheduler_complete = self._complete
        # With workers="process", the records the queues hand to their workers run in one child
        # process that maps the same bank memory (`_workers.process`); the rest is as with threads.
        self._process: Any = ray_chip  # a WorkerProcess, or a RayChip (the same interface)
        workers_of: list[ProcessQueueWorker | None] = [None, None]
        if ray_chip is not None:
            workers_of = [RayQueueWorker(name, ray_chip, i) for i, name in enumerate(("CQ0", "CQ1"))]
        elif shared:
            self._process = WorkerProcess(
                [(space.name, state.memory.shared_path or "", state.num_banks, state.bank_bytes)
                 for space, state in self._spaces.items()], 2, blas_threads, worker_timeout)
            workers_of = [ProcessQueueWorker(name, self._process, i) for i, name in enumerate(("CQ0", "CQ1"))]
        # Room is made in CQ0's order only (`CommandQueue.makes_room`): CQ1's writes never
        # allocate (a tensor's home is made at `to_device`, or on CQ0 when it must wait for room).
        self._cq0 = CommandQueue("CQ0", self._banks, scheduler_complete, makes_room=True,
                                 inline_seconds=inline_seconds, worker=workers_of[0])
        self._cq1 = CommandQueue("CQ1", self._banks, scheduler_complete, inline_seconds=inline_seconds,
                                 worker=workers_of[1])
        self._scheduler = Scheduler(self._spaces, self._cq0, self._cq1, spec, eviction)
        if self.options.num_hw_cqs == 1:  # one queue carries everything, in order
            self._scheduler.write_queue = self._cq0
        if self.options.trace_region_size is not None:
            self._scheduler.trace_region = TraceRegion(self._spaces[MemorySpace.DRAM])
        # The queues report straight to the scheduler (one call less per command).
        self._cq0.on_complete = self._cq1.on_complete = self._scheduler.complete
        self._cq0.in_flight = self._cq1.in_flight = self._scheduler.flight

    @property
    def inline_seconds(self) -> float:
        """Records estimated to run at most this long run inline on the event loop's thread,
        longer ones on their queue's worker thread (`open_device(inline_seconds=...)`)."""
        return self._cq0.inline_seconds

    @inline_seconds.setter
    def inline_seconds(self, seconds: float) -> None:
        if self.workers == "ray" and not seconds < 0:
            raise ValueError('a workers="ray" device runs every record in its actor: inline_seconds stays '
                             f"negative, got {seconds!r}")
        self._cq0.inline_seconds = self._cq1.inline_seconds = float(seconds)
        self._cq0.transfer_inline_seconds = self._cq1.transfer_inline_seconds = None  # this governs all

    @property
    def worker_pid(self) -> int | None:
        """The pid of the worker process that runs this device's records (`workers="process"`),
        None with thread workers."""
        return None if self._process is None else self._process.pid

    @property
    def chip(self) -> tuple[int, int] | None:
        """The device's coordinate in its mesh (None for a lone device)."""
        return None if self._process is None else self._process.chip

    def _set_chip(self, coord: tuple[int, int]) -> None:
        if self._process is not None:
            self._process.chip = coord

    def _lose(self, error: DeviceLostError) -> None:
        """The worker process died: both queues fail what they hold and all later work."""
        self._cq0.abort(error)
        self._cq1.abort(error)

    def _complete(self, command: Command, error: BaseException | None) -> None:
        self._scheduler.complete(command, error)

    def __repr__(self) -> str:
        return f"<ttflow.Device {self.spec.name}{' closed' if self.closed else ''}>"

    # -- public inspection ------------------------------------------------------------------

    @property
    def stats(self) -> DeviceStatistics:
        counters = self._scheduler.counters
        return DeviceStatistics(
            **{name: counters.get(name, 0) for name in _COUNTERS},
            l1_peak_bytes=self._spaces[MemorySpace.L1].peak_bytes,
            dram_peak_bytes=self._spaces[MemorySpace.DRAM].peak_bytes,
            # C fields of the scheduler's record: the C submit counts its hits at C speed.
            program_cache_hits=self._scheduler.plan_hits,
            program_cache_misses=self._scheduler.plan_misses,
        )

    @property
    def program_cache_enabled(self) -> bool:
        """Whether the device keeps each program's plan (its layouts and geometry bound to this
        device, made at the first submit) for the next submit of that program. Set it False
        and every submit plans again and nothing is kept (what was kept is dropped), as a
        compiler's harness does to time or check planning itself; `tt.clear_program_cache`
        drops what is kept once. `stats.program_cache_hits` / `program_cache_misses` count."""
        return not self._scheduler.plans_uncached

    @program_cache_enabled.setter
    def program_cache_enabled(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"program_cache_enabled is a bool, got {type(enabled).__name__}")
        self._scheduler.keep_plans(enabled)

    def memory_used(self, space: MemorySpace) -> int:
        """Bytes allocated in `space`, summed over its banks. The circular-buffer region kept at
        the bottom of L1 between programs is room, not use: it counts only while a program runs
        in it (`memory_view` shows it either way)."""
        scheduler = self._scheduler
        scheduler.collect_garbage()
        used = self._spaces[space].used_bytes()
        return used - scheduler.idle_footprint_bytes() if space is MemorySpace.L1 else used

    def memory_free(self, space: MemorySpace) -> int:
        scheduler = self._scheduler
        scheduler.collect_garbage()
        free = self._spaces[space].free_bytes()
        return free + scheduler.idle_footprint_bytes() if space is MemorySpace.L1 else free

    @property
    def eviction(self) -> str:
        """The eviction policy the device was opened with ("lookahead" or "eager")."""
        return self._scheduler.eviction

    def memory_view(self, space: MemorySpace) -> MemoryView:
        """What `space` holds now: totals, the largest free block, fragmentation, and every
        live buffer with what it is (a tensor's home, a conversion, scratch, circular
        buffers). `print()` it for a table."""
        return self._scheduler.memory_view(space)

    def read_bank(self, space: MemorySpace, bank: int, address: int, nbytes: int) -> bytes:
        """Raw bytes of one bank, for debugging and byte-exact tests."""
        self.check_open()
        state = self._spaces[space]
        if self.workers == "ray":  # a call to the chip's actor, which holds the bytes
            return self._process.read_bank(space.name, state.num_banks, state.bank_bytes, bank, address, nbytes)  # type: ignore[no-any-return]
        return state.memory.read(bank, address, nbytes)

    async def synchronize(self) -> None:
        """Waits until every command queued on the device so far has completed (as
        `ttnn.synchronize_device` or `torch.cuda.synchronize`); errors stay with their tensors."""
        while len(self._cq0) or len(self._cq1):  # a command of one queue may queue work on the other
            await self._cq0.drained()
            await self._cq1.drained()

    def check_open(self) -> None:
        if self.closed:
            raise DeviceClosedError("the device is closed; open a new one with tt.open_device()")

    # -- lifetime ---------------------------------------------------------------------------

    async def _serve(self, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        if self._process is not None:
            self._process.start(self._lose)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._cq0.serve)
            tg.start_soon(self._cq1.serve)
            task_status.started()

    def _shutdown(self) -> None:
        """Fails whatever never ran, frees every buffer and releases the bank memory."""
        self.closed = True
        try:
            if self._process is not None:  # the queues' threads have stopped: nothing is sent
                self._process.stop()
        finally:
            self._scheduler.shutdown(DeviceClosedError("the device was closed before this command ran"))
            for state in self._spaces.values():
                state.close()


@asynccontextmanager
async def open_device(
    spec: DeviceSpec | None = None, *, blas_threads: int | None = 1, eviction: str = "lookahead",
    inline_seconds: float | None = None, workers: str = "thread",
    worker_timeout: float | None = WORKER_TIMEOUT, ray_cpus: float = 1.0,
    num_hw_cqs: int = 2, l1_small_size: int = 0, trace_region_size: int | None = None,
    _ray_chip: RayChip | None = None,
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

    `eviction`: when L1 tensors move to DRAM. "lookahead" (the default) evicts only when an
    allocation needs the room, the tensors whose next use in the queued work is farthest first;
    "eager" moves every L1 tensor a starting program does not read (the rule of the first
    ttflow). On the demo, lookahead copies none of eager's eviction bytes (docs/performance.md,
    "Memory").
    The limit is process-wide (threadpoolctl) and reference-counted: devices open at once,
    nested or on different threads, run with the smallest limit among them, and the setting
    from before the first one comes back when the last one closes.

    `inline_seconds`: a command whose run is estimated at most this long runs inline on the
    event loop's thread (a thread hand-off costs more), a longer one on its queue's worker
    thread. The default (100 us; 25 us with workers="process", where a record sent away costs
    the host nothing to run, writes and reads keeping 100 us) suits production; tests set -1 to send every command to a
    thread (so that a held thread stops it mid-flight) or a large value to run all inline.
    A setting of this device alone (`device.inline_seconds` changes it while it is open).

    `workers`: where the records too large to run inline run. "thread" (the default): on each
    queue's own thread. "process": in one worker process per device (`device.worker_pid`),
    which maps the device's bank memory, shared with this process; the host still decides every
    command and answers `submit` at once, and writes, reads and records that call host functions
    still run here (collectives meet worker to worker). If that process dies, the device's
    pending and later work fails with `DeviceLostError`.

    `worker_timeout` (workers="process"): seconds the worker process may stay silent before it
    is declared lost (default 30). The worker sends a heartbeat from a thread of its own, which
    a long record does not stop (numpy releases the interpreter lock); a worker that is stopped
    or stuck is killed after this long, and the device's pending and later work fails with
    `DeviceLostError` saying so. `None`: no heartbeat (a silent worker then hangs its awaits).
    With workers="ray", the longest one actor call (a batch of up to 8 records) may take.

    workers="ray": the device's bank memory and every record's run are in a Ray actor (placed
    on the cluster `ray.init()` joined, which must be called first), which may be on another
    host; the host decides and answers `submit` at once, and batches each queue's records into
    one actor call. Nothing runs inline in the host (`inline_seconds` is negative), and what
    cannot travel is refused with `RemoteMemoryError`: a submit of a program with host ops,
    `tt.debug_hooks`. `ray_cpus`: the CPUs the actor asks of the cluster (its placement bundle).
    `tt.open_mesh_device(..., workers="ray", chips_per_worker=n)` puts n chips in each actor.

    tt-mlir's `openMeshDevice` options, each with its meaning in the emulated memory map
    (`device.options`): `num_hw_cqs` (2, the default: host writes on CQ1 overlap CQ0's
    programs; 1: writes queue on CQ0 behind them, as on a one-queue tt-metal device);
    `l1_small_size` (bytes per L1 bank, default 0: the top of every L1 bank that L1 buffers do
    not take, tt-metal's L1_SMALL region); `trace_region_size` (bytes per DRAM bank at the top
    of every bank where each captured trace's buffer lives, `TRACE_BYTES_PER_COMMAND` per
    captured command; a capture that does not fit raises TraceError, and `memory_view(DRAM)`
    lists the buffers as "trace_buffer"). Its default, None, keeps no trace buffers: traces
    work without asking for a region, where tt-metal's default of 0 refuses every capture
    (docs/frontend-guide.md). tt-mlir's default `num_hw_cqs` is 1; ttflow's is 2 (SPEC).
    """
    if eviction not in EVICTION_POLICIES:
        raise ValueError(f"eviction must be one of {', '.join(map(repr, EVICTION_POLICIES))}, got {eviction!r}")
    if workers not in WORKERS:
        raise ValueError(f"workers must be one of {', '.join(map(repr, WORKERS))}, got {workers!r}")
    if worker_timeout is not None and (isinstance(worker_timeout, bool) or not isinstance(worker_timeout, (int, float))
                                       or not 0 < worker_timeout < float("inf")):
        raise ValueError(f"worker_timeout must be a positive number of seconds or None, got {worker_timeout!r}")
    spec = spec if spec is not None else DeviceSpec()
    options = DeviceOptions(num_hw_cqs, l1_small_size, trace_region_size)
    options.check_fits(spec)
    ray_workers: RayWorkers | None = None
    if workers == "ray":
        if inline_seconds is not None and not inline_seconds < 0:
            raise ValueError('a workers="ray" device runs every record in its actor: inline_seconds must be '
                             f"negative (or None), got {inline_seconds!r}")
        inline_seconds = -1.0
        if _ray_chip is None:  # a lone device: one actor of its own
            ray_workers = RayWorkers([spaces_of(spec)], 1, blas_threads, STRATEGIES[0], ray_cpus, worker_timeout)
            await anyio.to_thread.run_sync(ray_workers.start)
            _ray_chip = ray_workers.chips[0]
    elif _ray_chip is not None:
        raise ValueError('a Ray chip needs workers="ray"')
    try:
        async with _open(spec, eviction, inline_seconds, workers, blas_threads, worker_timeout, _ray_chip,
                         options) as device:
            yield device
    finally:
        if ray_workers is not None:
            ray_workers.stop()


@asynccontextmanager
async def _open(spec: DeviceSpec, eviction: str, inline_seconds: float | None, workers: str,
                blas_threads: int | None, worker_timeout: float | None,
                ray_chip: RayChip | None, options: DeviceOptions) -> AsyncIterator[Device]:
    blas = nullcontext() if blas_threads is None else limit_blas_threads(blas_threads)
    device = Device(spec, eviction,
                    (PROCESS_INLINE_SECONDS if workers == "process" else INLINE_SECONDS) if inline_seconds is None
                    else float(inline_seconds), workers, blas_threads,
                    None if worker_timeout is None else float(worker_timeout), ray_chip, options)
    if workers == "process" and inline_seconds is None:
        # Writes and reads run in the host either way (`ProcessQueueWorker.transfers_here`):
        # inline as a thread-worker device's do.
        device._cq0.transfer_inline_seconds = device._cq1.transfer_inline_seconds = INLINE_SECONDS
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
