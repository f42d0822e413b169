"""The event loop both state machines drive: a blocking portal, and the rules' ways to reach it.

`RuntimeStateMachine` (one device) and `MeshStateMachine` (a mesh of chips) run hypothesis on
the test's thread and the runtime on an anyio event loop in a blocking portal. What they ask of
the loop is the same, so it is written once here:

- `call(fn, *args)`: a synchronous runtime call on the loop thread, its result boxed so the
  portal never awaits it (a `Tensor` is awaitable: `portal.call(tt.to_device, ...)` would wait
  for the copy and hide the work in flight the machines exist to reach).
- `run(fn, *args)`: an await within `timeout` (a hang is a failure, never a stuck run). With
  queue workers held, they are let go meanwhile; afterwards every held device runs until idle
  and is held again, so the next rule starts from a state that does not depend on timing.
- `expect_raises` / `expect_raises_async`: the call must raise that error, at once (held
  workers stay held).

A machine says which workers it holds (`held_queues`) and opens its devices on `portal`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.from_thread

from .._runtime.device import Device
from ._model import QueueHold, drain

__all__ = ["LoopHarness", "within"]

T = TypeVar("T")


def _boxed(fn: Callable[..., T], args: tuple[Any, ...]) -> list[T]:
    return [fn(*args)]


async def within(seconds: float, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    """`await fn(*args)`, or an AssertionError naming a hang after `seconds`."""
    try:
        with anyio.fail_after(seconds):
            return await fn(*args)
    except TimeoutError:
        raise AssertionError(
            f"{getattr(fn, '__name__', fn)} did not complete within {seconds} s: a hang"
        ) from None


async def _released(holds: Sequence[QueueHold], devices: Sequence[Device], seconds: float,
                    fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    """`fn(*args)` with every hold's workers let go; then every device runs until idle and the
    workers are held again."""
    for hold in holds:
        hold.release()
    try:
        return await within(seconds, fn, args)
    finally:
        try:
            for device in devices:
                await within(seconds, drain, (device,))
        finally:
            with anyio.move_on_after(seconds):
                for hold in holds:
                    await hold.acquire()


class LoopHarness:
    """A state machine's event loop (see the module docstring); mixed into both machines."""

    backend: ClassVar[str] = "asyncio"
    """The anyio backend of the loop: "asyncio" or "trio"."""
    timeout: ClassVar[float] = 60.0
    """Seconds any single await may take before the machine calls it a hang."""

    portal: anyio.from_thread.BlockingPortal

    def open_loop(self) -> None:
        """Starts the portal (`close_loop` stops it)."""
        self._portal_cm = anyio.from_thread.start_blocking_portal(self.backend)
        self.portal = self._portal_cm.__enter__()

    def close_loop(self) -> None:
        self._portal_cm.__exit__(None, None, None)

    def held_queues(self) -> tuple[Sequence[QueueHold], Sequence[Device]]:
        """The holds whose workers are held now, and the devices they hold."""
        raise NotImplementedError

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the event loop thread; the result is returned as is, never awaited."""
        return self.portal.call(_boxed, fn, args)[0]

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Awaits `fn(*args)` on the event loop, within `timeout`; held workers are let go
        meanwhile, and afterwards their devices run until idle and are held again."""
        holds, devices = self.held_queues()
        if holds:
            return self.portal.call(_released, holds, devices, self.timeout, fn, args)
        return self.portal.call(within, self.timeout, fn, args)

    def expect_raises(self, error: type[BaseException], fn: Callable[..., Any], *args: Any) -> BaseException:
        """Asserts that the synchronous call `fn(*args)` raises `error` (on the loop thread)."""
        try:
            self.call(fn, *args)
        except error as exc:
            return exc
        raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {error.__name__}")

    def expect_raises_async(self, error: type[BaseException], fn: Callable[..., Awaitable[Any]],
                            *args: Any) -> None:
        """Asserts that awaiting `fn(*args)` raises `error`, at once (held workers stay held)."""
        try:
            self.portal.call(within, self.timeout, fn, args)
        except error:
            return
        raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {error.__name__}")
