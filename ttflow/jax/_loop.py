"""The event loop a blocking `ttflow.jax.jit` call runs on, and the devices opened on it.

JAX code is synchronous and ttflow's runtime is async: an anyio blocking portal (an event loop in a
background thread) owns the devices that `jit(f, device=spec)` opens, one per spec, shared by every
jitted function, so a tensor one function left on a device is there for the next. A call blocks
until its outputs are on the host, as a JAX user expects of `jax.jit` with `block_until_ready`.
Tensors are dropped on the loop thread only (their release changes the scheduler's state).
Everything is closed at the interpreter's exit, or by `ttflow.jax.shutdown()`.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio.from_thread

import ttflow as tt

__all__ = ["Loop", "loop"]

T = TypeVar("T")
_DROP_BATCH = 64
INLINE_SECONDS = 5e-3
"""`inline_seconds` of the devices opened here (tt.open_device's default is 100 us): a blocking
call leaves the loop nothing else to do while its program runs, so a program estimated below this
runs on the loop thread itself rather than paying two thread hand-offs (85-180 us each here)."""


async def _nothing() -> None:
    return None


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


class Loop:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._portal_cm: Any = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._asyncio_loop: asyncio.AbstractEventLoop | None = None
        self._devices: dict[Any, tuple[Any, Any]] = {}  # spec -> (device, its context manager)
        # released on the loop thread by the next call; appended without a lock, since a drop
        # comes from a garbage collector's callback that may run inside any locked section
        self._dropped: collections.deque[Any] = collections.deque()

    def _started(self) -> anyio.from_thread.BlockingPortal:
        with self._lock:
            if self._portal is None:
                self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio")
                self._portal = self._portal_cm.__enter__()
                self._asyncio_loop = self._portal.call(_running_loop)
            return self._portal

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`await fn(*args)` on the loop, after releasing what was dropped since the last call.
        Handed over with asyncio's own `run_coroutine_threadsafe` (27 us against the portal's
        66, measured), into the portal's asyncio loop, where anyio code runs as in any task."""
        self._started()
        assert self._asyncio_loop is not None

        async def released_then() -> T:
            self._release_dropped()
            return await fn(*args)

        return asyncio.run_coroutine_threadsafe(released_then(), self._asyncio_loop).result()

    def device(self, spec: tt.DeviceSpec | tt.MeshSpec) -> Any:
        """The device (or mesh) of `spec` opened on the loop, opened on first use."""
        portal = self._started()
        with self._lock:
            if spec not in self._devices:
                opener = (tt.open_mesh_device(spec, inline_seconds=INLINE_SECONDS) if isinstance(spec, tt.MeshSpec)
                          else tt.open_device(spec, inline_seconds=INLINE_SECONDS))
                cm = portal.wrap_async_context_manager(opener)
                self._devices[spec] = (cm.__enter__(), cm)
            return self._devices[spec][0]

    def _release_dropped(self) -> None:
        while self._dropped:
            self._dropped.popleft()

    def drop(self, value: Any) -> None:
        """Releases `value` (a tensor) on the loop thread: at the next call, or soon when many are
        waiting (a hand-off per dropped array would cost each call one more)."""
        portal = self._portal
        if portal is None:
            return
        self._dropped.append(value)
        if len(self._dropped) >= _DROP_BATCH:

            async def release() -> None:
                self._release_dropped()

            with contextlib.suppress(Exception):  # the loop closed, or this is its thread (the next call)
                portal.start_task_soon(release)

    def close(self) -> None:
        if self._portal is not None:
            with contextlib.suppress(Exception):  # what was dropped goes first, on the loop thread
                self.call(_nothing)
        with self._lock:
            devices, self._devices = list(self._devices.values()), {}
            portal_cm, self._portal_cm, self._portal = self._portal_cm, None, None
            self._asyncio_loop = None
        self._dropped.clear()
        for _, cm in reversed(devices):
            cm.__exit__(None, None, None)
        if portal_cm is not None:
            portal_cm.__exit__(None, None, None)


loop = Loop()
atexit.register(loop.close)
