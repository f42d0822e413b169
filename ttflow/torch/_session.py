"""The synchronous face of the asynchronous runtime: one event loop thread, its open devices.

torch code is synchronous, ttflow's runtime is async and must be driven from its event loop. A
module-level `Session` owns an anyio blocking portal (an event loop in a background thread) and
the devices opened on it. Every runtime call goes through `call`, which runs it on the loop
thread; calls that only queue work (`submit`, `to_device`) return at once, `to_host` waits.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio.from_thread

import ttflow as tt

__all__ = ["Session", "session"]

T = TypeVar("T")
MAX_DEVICES = 8  # the guard reports this many "tt" devices to torch


class Session:
    """The event loop thread and the ttflow devices behind torch's "tt:N" devices."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._portal_stack: contextlib.ExitStack | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._devices: dict[int, tuple[tt.Device, contextlib.ExitStack]] = {}
        self._atexit = False

    def _ensure_portal(self) -> anyio.from_thread.BlockingPortal:
        if self._portal is None:
            stack = contextlib.ExitStack()
            self._portal = stack.enter_context(anyio.from_thread.start_blocking_portal())
            self._portal_stack = stack
            if not self._atexit:
                atexit.register(self.close)
                self._atexit = True
        return self._portal

    def open(self, spec: tt.DeviceSpec | None = None, index: int | None = None) -> int:
        """Opens an emulated device as "tt:index" (the lowest free index by default)."""
        with self._lock:
            if index is None:
                index = next((i for i in range(MAX_DEVICES) if i not in self._devices), None)
                if index is None:
                    raise RuntimeError(f"ttflow.torch opens at most {MAX_DEVICES} devices; close one first")
            if not 0 <= index < MAX_DEVICES:
                raise ValueError(f"tt device index must be in 0..{MAX_DEVICES - 1}, got {index}")
            if index in self._devices:
                raise RuntimeError(f"tt:{index} is already open; call ttflow.torch.close() first")
            portal = self._ensure_portal()
            stack = contextlib.ExitStack()
            device = stack.enter_context(portal.wrap_async_context_manager(tt.open_device(spec)))
            self._devices[index] = (device, stack)
            return index

    def device(self, index: int | None) -> tt.Device:
        """The device behind "tt:index"; the default device opens on first use of tt:0."""
        index = 0 if index is None else index
        with self._lock:
            entry = self._devices.get(index)
            if entry is None:
                if index != 0:
                    raise RuntimeError(
                        f"tt:{index} is not open; open it with ttflow.torch.open_device(spec, index={index})"
                    )
                self.open(None, 0)
                entry = self._devices[0]
            return entry[0]

    def index_of(self, device: tt.Device) -> int | None:
        for index, (d, _) in self._devices.items():
            if d is device:
                return index
        return None

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn(*args)` (sync or async) on the event loop thread and returns its result."""
        portal = self._portal
        if portal is None:
            raise tt.DeviceClosedError("no tt device is open; ttflow.torch.close() was called")
        return portal.call(fn, *args)

    def close(self) -> None:
        """Closes every device (draining its queued work), then stops the event loop thread."""
        with self._lock:
            devices, self._devices = self._devices, {}
            errors = []
            for _, stack in devices.values():
                try:
                    stack.close()
                except Exception as exc:  # close the rest anyway
                    errors.append(exc)
            if self._portal_stack is not None:
                stack, self._portal_stack, self._portal = self._portal_stack, None, None
                stack.close()
            if errors:
                raise errors[0]


session = Session()
