"""The event loop a blocking `ttflow.jax.jit` call runs on, and the devices opened on it.

JAX code is synchronous and ttflow's runtime is async: an anyio blocking portal (an event loop in a
background thread) owns the devices that `jit(f, device=spec)` opens, one per spec, shared by every
jitted function, so a tensor one function left on a device is there for the next. A call blocks
until its outputs are on the host, as a JAX user expects of `jax.jit` with `block_until_ready`.
Tensors are dropped on the loop thread only (their release changes the scheduler's state).
Everything is closed at the interpreter's exit, or by `ttflow.jax.shutdown()`.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio.from_thread

import ttflow as tt

__all__ = ["Loop", "loop"]

T = TypeVar("T")


class Loop:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._portal_cm: Any = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._devices: dict[Any, tuple[Any, Any]] = {}  # spec -> (device, its context manager)

    def _started(self) -> anyio.from_thread.BlockingPortal:
        with self._lock:
            if self._portal is None:
                self._portal_cm = anyio.from_thread.start_blocking_portal()
                self._portal = self._portal_cm.__enter__()
            return self._portal

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`await fn(*args)` on the loop; its result is boxed, so a Tensor in it is not awaited."""
        async def boxed() -> tuple[T]:
            return (await fn(*args),)

        return self._started().call(boxed)[0]

    def device(self, spec: tt.DeviceSpec | tt.MeshSpec) -> Any:
        """The device (or mesh) of `spec` opened on the loop, opened on first use."""
        portal = self._started()
        with self._lock:
            if spec not in self._devices:
                opener = tt.open_mesh_device(spec) if isinstance(spec, tt.MeshSpec) else tt.open_device(spec)
                cm = portal.wrap_async_context_manager(opener)
                self._devices[spec] = (cm.__enter__(), cm)
            return self._devices[spec][0]

    def drop(self, value: Any) -> None:
        """Releases `value` (a tensor) on the loop thread; nothing once the loop is closed."""
        portal = self._portal
        if portal is None:
            return

        async def release(held: list[Any]) -> None:
            held.clear()

        held = [value]
        del value
        with contextlib.suppress(Exception):  # the loop closed: its devices went with it
            portal.start_task_soon(release, held)

    def close(self) -> None:
        with self._lock:
            devices, self._devices = list(self._devices.values()), {}
            portal_cm, self._portal_cm, self._portal = self._portal_cm, None, None
        for _, cm in reversed(devices):
            cm.__exit__(None, None, None)
        if portal_cm is not None:
            portal_cm.__exit__(None, None, None)


loop = Loop()
atexit.register(loop.close)
