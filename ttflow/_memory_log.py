"""The memory log: a device's memory, logged before and after each program it runs.

`tt.set_memory_log(device, level)` logs, to the `logging` logger "ttflow.memory" at INFO, what
each memory space holds as each program starts (before its preamble: evictions, conversions,
its outputs' allocation) and as it completes (its outputs committed; before the inputs it alone
kept alive are freed). "summary": one line per space, its used and free bytes as
`device.memory_view` counts them; "detail": the whole `memory_view` table of each space (every
buffer with what it holds). tt-mlir's runtime prints its memory report around each program the
same way. While a log is on, every program takes the general path (the C fast path runs no
Python between programs): values are unchanged, only the host cost differs.

"op" adds a line after every op of every program (tt-mlir's per-op memory log, ttrt's
`--memory` report per op): the op's index, name and location, where its result lives (space,
address, bytes) and each space's used and free bytes then. It runs programs op by op through
the debug-hook machinery (`_debug.DebugHooks`, a post-op callback on the event loop), so while
it is on, `tt.debug_hooks` and trace captures on the device are refused, as under hooks.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, final

from ._observe.debug import DebugHooks, OpContext
from ._runtime.device import Device
from ._errors import DebugHookError, TraceError
from ._mesh.device import MeshDevice
from ._queue import Command
from ._types import MemorySpace

__all__ = ["set_memory_log", "MEMORY_LOG_LEVELS", "logger"]

logger = logging.getLogger("ttflow.memory")

MEMORY_LOG_LEVELS = (None, "off", "summary", "detail", "op")
"""`set_memory_log`'s levels: None and "off" turn the log off."""

_SPACES = (MemorySpace.L1, MemorySpace.DRAM)


@final
class _MemoryLog:
    """One device's log: its level, and its two listeners on the device's scheduler."""

    def __init__(self, device: Device, level: str, label: str) -> None:
        self.level = level
        self._label = label  # the device's repr, and its coordinate on a mesh
        self._device = weakref.ref(device)
        self._programs = 0
        self._stack = contextlib.ExitStack()
        scheduler = device._scheduler
        if level == "op":  # op by op, as under debug hooks (checked by `set_memory_log` first)
            hooks = DebugHooks(device, None, self._op, None, None)
            scheduler.hooks = hooks
            self._stack.callback(lambda: setattr(scheduler, "hooks", None) if scheduler.hooks is hooks else None)
        self._stack.enter_context(scheduler.starting_programs(self._starting))
        self._stack.enter_context(scheduler.listening(self._completed))

    def close(self) -> None:
        self._stack.close()

    def _op(self, ctx: OpContext) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        where = ", ".join(
            f"{out.layout.memory.name} @ {out._storage.address} ({out._storage.nbytes} bytes)"
            for out in ctx.outputs)
        loc = f" at {ctx.loc}" if ctx.loc else ""
        totals = "; ".join(
            f"{space.name} used {view.used} free {view.free}"
            for space, view in ((space, ctx.device.memory_view(space)) for space in _SPACES))
        logger.info("after op %d %s%s of program %r on %s: result in %s; %s", ctx.index, ctx.name, loc,
                    ctx.program.name, self._label, where or "no buffer", totals)

    def _starting(self, command: Command) -> None:
        self._programs += 1
        self._log("before", command, None)

    def _completed(self, command: Command, error: BaseException | None) -> None:
        if getattr(command, "name", None) == "program":  # a class attribute of ProgramCommand
            self._log("after", command, error)

    def _log(self, when: str, command: Any, error: BaseException | None) -> None:
        device = self._device()
        if device is None or not logger.isEnabledFor(logging.INFO):
            return
        views = [(space, device.memory_view(space)) for space in _SPACES]  # device: still open
        failed = f" (failed: {type(error).__name__})" if error is not None else ""
        head = f"{when} program {command.program.name!r}{failed} on {self._label}"
        if self.level in ("summary", "op"):
            logger.info("%s: %s", head, "; ".join(
                f"{space.name} used {view.used} free {view.free}" for space, view in views))
        else:
            logger.info("%s:\n%s", head, "\n".join(str(view) for _, view in views))


_logs: weakref.WeakKeyDictionary[Device, _MemoryLog] = weakref.WeakKeyDictionary()


def set_memory_log(device: Device | MeshDevice, level: str | None) -> None:
    """Logs `device`'s memory before and after each program (to the logger "ttflow.memory", at
    INFO) from now on: `level` "summary" (used and free bytes per space), "detail" (every
    space's `memory_view` table), "op" (the summary, and a line after every op: see the
    module), or None / "off" (no log, the default). On a mesh, every
    chip's programs. A new level replaces the old one; while a log is on, programs take the
    general path (no C fast path), so set it off before timing anything."""
    if level not in MEMORY_LOG_LEVELS:
        raise ValueError(
            f"memory log level must be one of {', '.join(map(repr, MEMORY_LOG_LEVELS))}, got {level!r}"
        )
    if isinstance(device, MeshDevice):
        chips = device.chips
        labels = [f"{chip!r} at chip {coord}" for chip, coord in zip(chips, device.coords)]
    elif isinstance(device, Device):
        chips = [device]
        labels = [repr(device)]
    else:
        raise TypeError(f"expected a tt.Device or a tt.MeshDevice, got {type(device).__name__}")
    for chip in chips:
        chip.check_open()
        if level == "op":
            s = chip._scheduler
            ours = isinstance(_logs.get(chip), _MemoryLog) and _logs[chip].level == "op"
            if s.hooks is not None and not ours:
                raise DebugHookError('set_memory_log(level="op") runs programs op by op through debug '
                                     "hooks, and the device has hooks set (tt.debug_hooks): one at a time")
            if s.capturing is not None:
                raise TraceError('set_memory_log(level="op"): a trace is being captured on the device')
    for chip, label in zip(chips, labels):
        old = _logs.pop(chip, None)
        if old is not None:
            old.close()
        if level is not None and level != "off":
            _logs[chip] = _MemoryLog(chip, level, label)
