"""Trace capture and replay, with ttnn's semantics and Pythonic names.

    with tt.capture_trace(device) as trace:      # submits are recorded (and run once)
        (y,) = tt.submit(device, binary, 0, [slot, weights])
    for batch in batches:
        tt.write(slot, batch)                    # inputs change by write, as in ttnn
        tt.execute_trace(trace)                  # queues the whole recorded sequence at once
        out = await tt.to_host(y)                # y holds the latest replay's value
    tt.release_trace(trace)

Every decision (addresses, conversions, evictions) is made once, at capture; a replay allocates
nothing and runs the recorded records back to back as one command on CQ0. The storages a trace
reads and writes stay allocated until `release_trace` (or the device closes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, final

from .._sched import capture as _capture
from . import const_eval as _const_eval

if TYPE_CHECKING:
    from .device import Device
    from .._sched import Capture

__all__ = ["Trace", "capture_trace", "check_replay", "execute_trace", "execute_with_peers", "release_trace"]


@final
class Trace:
    """A captured sequence of device work, replayed by `tt.execute_trace`."""

    __slots__ = ("device", "_capture")

    device: Device
    _capture: Capture

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("tt.Trace has no public constructor: use `with tt.capture_trace(device)`")

    @classmethod
    def _wrap(cls, device: Device, capture: Capture) -> Trace:
        trace = object.__new__(cls)
        trace.device = device
        trace._capture = capture
        return trace

    def __del__(self) -> None:
        # May run on any thread (garbage collection): the scheduler releases the trace on the
        # loop thread, as it frees a dropped tensor. A trace kept alive is released by
        # `release_trace` or when its device closes.
        capture = getattr(self, "_capture", None)
        if capture is not None and not capture.released:
            try:
                self.device._scheduler.drop_trace(capture)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    @property
    def programs(self) -> tuple[str, ...]:
        """Names of the programs recorded so far, in order (complete once the capture ran)."""
        return tuple(self._capture.programs)

    @property
    def released(self) -> bool:
        return self._capture.released

    def __repr__(self) -> str:
        capture = self._capture
        status = "released" if capture.released else "failed" if capture.error else "ready"
        return f"<ttflow.Trace of {len(capture.outputs)} tensors on {self.device!r} {status}>"


@contextmanager
def capture_trace(device: Device) -> Iterator[Trace]:
    """Records the device work submitted inside the block (which also runs once, as usual).

    While the block is open every submit and `to_layout` on the device is captured, from any task;
    host transfers (`to_device`, `empty`, `write`, `to_host`) raise TraceError. On a device
    opened with `trace_region_size`, the trace's buffer is allocated in that region as the block
    ends; when it does not fit, the block raises TraceError (the captured work ran once, as
    usual; the trace cannot be replayed).
    """
    device.check_open()
    scheduler = device._scheduler
    capture = scheduler.begin_capture()
    error: BaseException | None = None
    refused = None
    try:
        yield Trace._wrap(device, capture)
    except BaseException as exc:
        error = exc
        raise
    finally:
        if not device.closed:
            refused = scheduler.end_capture(capture, error)
    if refused is not None:  # its trace buffer did not fit the trace region (`open_device`)
        raise refused


def _check(trace: Any) -> Trace:
    if not isinstance(trace, Trace):
        raise TypeError(f"expected a tt.Trace, got {type(trace).__name__}")
    trace.device.check_open()
    return trace


def execute_trace(trace: Trace) -> None:
    """Queues one replay of the trace on CQ0 (non-blocking); its tensors then hold the new values.

    A replay is ordered like a write into the tensors the trace produced: after every queued
    reader of their previous values, and it drops conversions made of those values since.
    """
    trace = _check(trace)
    _refresh_constants(trace)
    trace.device._scheduler.replay(trace._capture)


def _refresh_constants(trace: Trace) -> None:
    """The const-eval results the trace reads, looked up again (`_const_eval.refresh`) when it
    can be replayed at all (`check_replay` says why not, after)."""
    capture, scheduler = trace._capture, trace.device._scheduler
    if (capture.const_uses and not capture.released and capture.error is None
            and scheduler.capturing is None and scheduler.hooks is None):
        _const_eval.refresh(trace.device, capture)


def check_replay(trace: Trace) -> None:
    """Raises what `execute_trace` would before queuing (a mesh trace checks every chip's
    first), once the trace's const-eval results are looked up again (a miss queues its constant
    program: before the check, which would find the old results deallocated)."""
    trace = _check(trace)
    _refresh_constants(trace)
    _capture.check_replay(trace.device._scheduler, trace._capture)


def execute_with_peers(trace: Trace, peers: Any) -> None:
    """`execute_trace` for one chip of a mesh trace: its replay carries `peers`, its place in
    this execute (`_mesh.collectives.ReplayPeers`), through which its collectives meet the
    other chips' replays."""
    trace = _check(trace)
    scheduler = trace.device._scheduler  # (its constants were looked up by `check_replay`)
    scheduler.enqueue(_capture.replay(scheduler, trace._capture, peers), scheduler.cq0)


def release_trace(trace: Trace) -> None:
    """Gives back the memory the trace pins (once queued replays are done); idempotent. A trace
    whose handle is dropped is released as well (as a dropped tensor is freed)."""
    if not isinstance(trace, Trace):
        raise TypeError(f"expected a tt.Trace, got {type(trace).__name__}")
    if not trace.device.closed:  # a closed device freed everything already
        trace.device._scheduler.release_capture(trace._capture)
