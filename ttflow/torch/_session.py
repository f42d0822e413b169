"""The synchronous face of the asynchronous runtime: one event loop thread, its open devices.

torch code is synchronous, ttflow's runtime is async and must be driven from its event loop. A
module-level `Session` owns an anyio blocking portal (an event loop in a background thread) and
the devices opened on it.

Work that only queues (`submit`, `to_device`, freeing) goes through `post`: the caller appends a
call to an ordered inbox and returns at once, and the loop thread runs the inbox in order. A
burst of eager ops costs the caller no thread hand-off (one `post` wakes the loop, the rest find
it awake). Calls that need an answer (`to_host`) go through `call`, which runs what is in the
inbox first, then the call, and waits. Values a posted call produces are `Pending` cells that
later posted calls read on the loop thread; an error in a posted call is kept in its cells and
raised by the first `call` that reads them (as CUDA reports an asynchronous error at the next
synchronising call).

The loop thread runs posted calls when the poster pauses or waits, not while it is busy: the two
threads share one GIL, so running them side by side only adds the cost of taking turns. A
poster that has `MAX_QUEUED` calls queued waits for them to run, as CUDA's host does at a full
launch queue.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

import anyio
import anyio.from_thread

import ttflow as tt

__all__ = ["MAX_DEVICES", "Pending", "Session", "session"]

T = TypeVar("T")
MAX_DEVICES = 8
"""The most devices ttflow.torch opens (the guard reports this many to torch, for autograd's
device threads; `Session.device_count` is how many can be used)."""
BATCH_SECONDS = 0.005
"""The loop thread runs posted calls once nothing more was posted for this long (or a caller waits)."""
MAX_DELAY_SECONDS = 0.05
"""... or once the oldest has waited this long, if the poster never pauses."""
PROCESS_INLINE_SECONDS = 150e-6
"""`inline_seconds` of a `workers="process"` device opened here (`tt.open_device`'s default there
is 25 us, for chains of programs submitted ahead): torch's eager ops and compiled graphs are
small programs (estimated 30-130 us in the MLP step) dispatched one by one from the user's
thread, and sending one to the worker costs the host about what running it does, plus a round
trip the next op waits for. Measured (`ttflow bench torch --workers thread,process`, the same
run): the eager MLP step 5.6-7.0x CPU torch with this against 9.8-10.4x with 25 us (thread
workers 4.9-5.9x); fully compiled 4.4-4.6x against 5.1-5.3x."""
MAX_QUEUED = 256
"""A poster with this many calls queued waits until they, and the device work they queued, have
run (CUDA's launch queue blocks the host the same way): memory held by queued work stays bounded."""


class Pending:
    """A value a posted call will produce: set on the loop thread, read by later posted calls.

    A ttflow tensor is released only on the loop thread (its release changes the scheduler's
    state): a cell dropped on another thread hands its value to the loop thread to drop.
    """

    __slots__ = ("error", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

    def __del__(self) -> None:
        value = self.value
        if value is not None and not on_loop_thread():
            self.value = None
            try:
                session.post(_drop, value)
            except Exception:  # noqa: BLE001, S110  # the session is closed: the device went with it
                pass

    def get(self) -> Any:
        """The value (on the loop thread, after its producer ran); re-raises the producer's error."""
        if self.error is not None:
            raise self.error
        return self.value


_loop_thread = [0]  # the ident of the event loop thread


def on_loop_thread() -> bool:
    """Whether the caller is the event loop's thread (which must never wait for itself)."""
    return threading.get_ident() == _loop_thread[0]


def _drop(value: Any) -> None:
    """Runs on the loop thread; the value's last reference goes with the posted call."""


class _Inbox:
    """Calls posted from torch's threads, run in order on the loop thread by one serving task."""

    def __init__(self) -> None:
        self._items: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._lock = threading.Lock()
        self._awake = False
        self._wake: Callable[[], None] | None = None
        self._event: anyio.Event | None = None
        self.errors: list[BaseException] = []  # errors of posted calls that had no cell to keep them
        self.posted = 0  # calls posted so far (how the loop thread sees that the poster paused)
        self.on_full: Callable[[], None] | None = None  # what a poster calls at MAX_QUEUED

    def post(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        item = (fn, args)  # made before taking the lock: an allocation may run the garbage
        with self._lock:  # collector, whose `Pending.__del__` posts too
            self._items.append(item)
            self.posted += 1
            full = len(self._items) >= MAX_QUEUED
            if self._awake and not full:
                return
            wake = not self._awake
            self._awake = True
        if wake:
            assert self._wake is not None
            self._wake()
        if full and not on_loop_thread() and self.on_full is not None:
            self.on_full()

    def run_queued(self) -> None:
        """Runs everything posted so far (on the loop thread)."""
        while True:
            with self._lock:
                if not self._items:
                    self._awake = False
                    return
                batch = list(self._items)
                self._items.clear()
            for fn, args in batch:
                try:
                    fn(*args)
                except BaseException as exc:  # kept for the next synchronising call  # noqa: BLE001
                    self.errors.append(exc)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._wake = _waker(self._set_event)
        _loop_thread[0] = threading.get_ident()
        self._event = anyio.Event()
        task_status.started()
        while True:
            await self._event.wait()
            # Let the poster finish what it is doing first: two threads running Python at once
            # take turns at the GIL at every numpy or torch call, and each turn costs more than
            # a small op (a training step of the digits MLP: 4.0 ms of CPU in all with the loop
            # thread running 5 ms after the first post, 3.2 ms when it waits for a pause).
            # Anything that waits (`call`) runs the inbox at once.
            deadline = anyio.current_time() + MAX_DELAY_SECONDS
            while True:
                seen = self.posted
                await anyio.sleep(BATCH_SECONDS)
                if self.posted == seen or anyio.current_time() > deadline:
                    break
            self._event = anyio.Event()
            self.run_queued()

    def _set_event(self) -> None:
        assert self._event is not None
        self._event.set()


def _waker(fn: Callable[[], None]) -> Callable[[], None]:
    """A thread-safe, non-blocking way to run `fn` soon on the session's event loop (asyncio:
    `start_blocking_portal`'s default; anyio's own thread calls all wait for the answer)."""
    loop = asyncio.get_running_loop()

    def wake() -> None:
        loop.call_soon_threadsafe(fn)

    return wake


class Session:
    """The event loop thread and the ttflow devices behind torch's "tt:N" devices."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._portal_stack: contextlib.ExitStack | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._inbox: _Inbox | None = None
        self._devices: dict[int, tuple[tt.Device, contextlib.ExitStack]] = {}
        self._atexit = False
        self.on_device_count: Callable[[int], None] | None = None
        """Told the new `device_count()` whenever it changes (the guard keeps a copy, to refuse
        a tensor made on a device past it)."""

    def device_count(self) -> int:
        """How many tt devices can be used: tt:0 to tt:n-1. tt:0 opens on first use, so it
        counts before it is open; the others count once opened (they are opened in order)."""
        return max(self._devices, default=0) + 1

    def not_open(self, index: int) -> str:
        """Why tt:index cannot be used (the guard's message for the same refusal is alike)."""
        count = self.device_count()
        return (f"tt:{index} is not open: torch.tt.device_count() is {count} (tt:0 to tt:{count - 1}); "
                f"ttflow.torch.open_device() opens the next one, tt:{count}")

    def check_index(self, index: int) -> None:
        """Raises the clear error for a device index past `device_count()`."""
        if not 0 <= index < self.device_count():
            raise RuntimeError(self.not_open(index))

    def _count_changed(self) -> None:
        if self.on_device_count is not None:
            self.on_device_count(self.device_count())

    def _ensure_portal(self) -> anyio.from_thread.BlockingPortal:
        if self._portal is None:
            stack = contextlib.ExitStack()
            portal = stack.enter_context(anyio.from_thread.start_blocking_portal())
            inbox = _Inbox()
            inbox.on_full = self.drain
            future, _ = portal.start_task(inbox.serve)
            stack.callback(future.cancel)
            self._portal, self._portal_stack, self._inbox = portal, stack, inbox
            if not self._atexit:
                atexit.register(self.close)
                self._atexit = True
        return self._portal

    def open(self, spec: tt.DeviceSpec | None = None, index: int | None = None, workers: str = "thread",
             inline_seconds: float | None = None) -> int:
        """Opens an emulated device as "tt:index" (the lowest free index by default); `workers`
        and `inline_seconds` as `tt.open_device`'s, except that a worker process's device keeps
        records up to `PROCESS_INLINE_SECONDS` in the host unless told otherwise."""
        if inline_seconds is None and workers == "process":
            inline_seconds = PROCESS_INLINE_SECONDS
        with self._lock:
            if index is None:
                index = next((i for i in range(MAX_DEVICES) if i not in self._devices), None)
                if index is None:
                    raise RuntimeError(f"ttflow.torch opens at most {MAX_DEVICES} devices; close one first")
            if not 0 <= index < MAX_DEVICES:
                raise ValueError(f"tt device index must be in 0..{MAX_DEVICES - 1}, got {index}")
            if index in self._devices:
                raise RuntimeError(f"tt:{index} is already open; call ttflow.torch.close() first")
            if index > self.device_count():
                # Numbered without gaps, as torch's devices are: code loops over
                # range(torch.tt.device_count()), and each of those must be usable.
                raise ValueError(f"tt:{index} cannot be opened before tt:{self.device_count()}: open the tt "
                                 "devices in order, the lowest first (ttflow.torch.open_device() opens the next)")
            portal = self._ensure_portal()
            stack = contextlib.ExitStack()
            device = stack.enter_context(portal.wrap_async_context_manager(tt.open_device(spec, workers=workers,
                                                                                   inline_seconds=inline_seconds)))
            self._devices[index] = (device, stack)
            self._count_changed()
            return index

    def device(self, index: int | None) -> tt.Device:
        """The device behind "tt:index"; the default device opens on first use of tt:0."""
        index = 0 if index is None else index
        entry = self._devices.get(index)
        if entry is not None:
            return entry[0]
        with self._lock:
            entry = self._devices.get(index)
            if entry is None:
                if index != 0:
                    raise RuntimeError(self.not_open(index))
                self.open(None, 0)
                entry = self._devices[0]
            return entry[0]

    def index_of(self, device: tt.Device) -> int | None:
        for index, (d, _) in self._devices.items():
            if d is device:
                return index
        return None

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queues `fn(*args)` (sync) to run on the loop thread after everything posted before."""
        inbox = self._inbox
        if inbox is None:
            raise tt.DeviceClosedError("no tt device is open; ttflow.torch.close() was called")
        inbox.post(fn, args)

    @overload
    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T: ...

    @overload
    def call(self, fn: Callable[..., T], *args: Any) -> T: ...

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs everything posted, then `fn(*args)` (sync or async) on the loop thread; waits."""
        portal, inbox = self._portal, self._inbox
        if portal is None or inbox is None:
            raise tt.DeviceClosedError("no tt device is open; ttflow.torch.close() was called")
        return portal.call(_after_inbox, inbox, fn, args)[0]

    def drain(self) -> None:
        """Runs everything posted, then waits until the devices have run all their queued work."""
        portal, inbox = self._portal, self._inbox
        if portal is None or inbox is None:
            return
        portal.call(_drained, inbox, [d for d, _ in self._devices.values()])

    def close(self) -> None:
        """Closes every device (draining its queued work), then stops the event loop thread."""
        with self._lock:
            if self._portal is not None and self._inbox is not None:
                with contextlib.suppress(Exception):
                    self._portal.call(_after_inbox, self._inbox, _nothing, ())
            devices, self._devices = self._devices, {}
            self._count_changed()
            errors = []
            for _, stack in devices.values():
                try:
                    stack.close()
                except Exception as exc:  # close the rest anyway  # noqa: BLE001
                    errors.append(exc)
            if self._portal_stack is not None:
                stack, self._portal_stack, self._portal, self._inbox = self._portal_stack, None, None, None
                stack.close()
            if errors:
                raise errors[0]


def _nothing() -> None:
    return None


async def _drained(inbox: _Inbox, devices: list[tt.Device]) -> None:
    inbox.run_queued()
    for device in devices:
        await device.synchronize()


async def _after_inbox(inbox: _Inbox, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any]:
    inbox.run_queued()
    if inbox.errors:
        error, inbox.errors[:] = inbox.errors[0], []
        raise error
    result = fn(*args)
    if hasattr(result, "__await__"):
        result = await result
    # In a tuple: the portal would await an awaitable result (a ttflow Tensor is one).
    return (result,)


session = Session()
