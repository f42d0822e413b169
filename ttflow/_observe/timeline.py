"""The timeline: what the command queues did, as Chrome/Perfetto trace-event JSON.

(Named "timeline" because "trace" means capture and replay, as in ttnn and tt-mlir; the old
names `record_trace` and `TraceRecorder` remain for one release, deprecated.)

One track per command queue (each command a complete event with its name, duration and, in
`args`, what the command's `describe()` reports: `bytes` is the bytes it moved, other keys are
passed through as they are) and a counter track of L1 and DRAM occupancy. A queue's slices
follow one another: a command's slice starts when it started or when the one before it on its
queue ended, whichever is later, so commands that ran together (a batch of host writes, which
all start at once) show as consecutive slices sharing the batch's time, never as slices nested
in one another; such a slice has `args["ran_with_previous"]`. Only a command's own parts (a
replay's programs) nest inside it. Recording costs
nothing when no recorder is attached: the device calls its listeners only if there are any.
A program's ops are slices inside the program's slice (category "op", named by the op, with
its step index and location in `args`: a compiled op's location names its compute config),
and so are its host ops (`ProgramBuilder.host_op`: category "host op", named
`host_op:<name>`), timed as they ran (a replay's host ops too).

A device whose records run in a worker process (`open_device(workers="process")`) gets one more
process in the trace, pid = the worker's pid, named "chip (r, c) worker <pid>" ("ttflow <spec>
worker <pid>" for a lone device), with a track per queue: a slice per record that ran there,
from the moment the worker started it to the moment it finished, on the worker's clock (Linux's
CLOCK_MONOTONIC, which the host shares), so it lies inside its command's host slice (a batch of
host writes, one job in the worker, shows as one slice per write, each the batch's span,
`args["records"]` > 1). Records that ran in the host (inline, collectives, host ops) have none.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, final

from .._errors import FileError
from .._types import MemorySpace

if TYPE_CHECKING:
    from .._runtime.device import Device
    from .._queue import Command

__all__ = ["TimelineRecorder", "queue_summary", "record_timeline", "record_trace"]

_TRACKS = {"CQ0": 0, "CQ1": 1}
_TRACK_NAMES = {0: "CQ0: programs, conversions, evictions, reads", 1: "CQ1: host-to-device writes"}
_WORKER_TRACK_NAMES = {0: "CQ0 records in the worker", 1: "CQ1 records in the worker"}


@final
class TimelineRecorder:
    """Collects one trace event per completed command while attached to a device."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.origin = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self.commands = 0
        self._track_end: dict[int, float] = {}  # where each track's last slice ended
        # Spans of the records that ran in the device's worker process, filled by its queues'
        # workers while this recorder is attached (`record_timeline`); None with thread workers.
        self.worker_spans: dict[int, tuple[Any, float, float, int]] | None = None

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def on_command(self, command: Command, error: BaseException | None) -> None:
        end = time.perf_counter()
        queue = command.queue.name if command.queue is not None else "CQ0"
        info = command.describe()
        children = info.pop("children", ())
        args = {k: v for k, v in info.items() if k != "name"}
        if error is not None:
            args["error"] = f"{type(error).__name__}: {error}"
        track = _TRACKS.get(queue, 0)
        started = command.started or end
        start = self._slice_start(track, started, end)
        if start > started:
            # It began before the previous command of its queue ended: the two ran together
            # (one hand-off to the worker thread, as batched host writes are).
            args["ran_with_previous"] = True
        self.commands += 1
        self.events.append(
            {
                "name": info["name"],
                "cat": type(command).__name__,
                "ph": "X",
                "ts": self._us(start),
                "dur": max(self._us(end) - self._us(start), 0.0),
                "pid": 1,
                "tid": track,
                "args": args,
            }
        )
        # Its parts, inside it: a replay's programs, a program's host ops (and a replay's).
        for name, (child_start, child_end), category, *extra in children:
            child_start, child_end = min(max(child_start, start), end), min(max(child_end, start), end)
            self.events.append(
                {
                    "name": name,
                    "cat": category,
                    "ph": "X",
                    "ts": self._us(child_start),
                    "dur": max(self._us(child_end) - self._us(child_start), 0.0),
                    "pid": 1,
                    "tid": track,
                    "args": extra[0] if extra else {},
                }
            )
        spans = self.worker_spans
        if spans is not None and command.record is not None:
            ran = spans.pop(id(command.record), None)
            if ran is not None and ran[0] is command.record:
                self._worker_slice(info["name"], track, ran)
        spaces = self.device._spaces
        self.events.append(
            {
                "name": "memory used (bytes)",
                "ph": "C",
                "ts": self._us(end),
                "pid": 1,
                "args": {space.name: spaces[space].used_bytes() for space in MemorySpace},
            }
        )

    def _worker_slice(self, name: str, track: int, ran: tuple[Any, float, float, int]) -> None:
        """The slice of a record that ran in the worker process, on its process's track."""
        _, start, end, records = ran
        args: dict[str, Any] = {}
        if records > 1:
            args["records"] = records  # one job of several records: they share its span
        self.events.append(
            {
                "name": name,
                "cat": "worker",
                "ph": "X",
                "ts": self._us(start),
                "dur": max(self._us(end) - self._us(start), 0.0),
                "pid": self.device.worker_pid,
                "tid": track,
                "args": args,
            }
        )

    def _slice_start(self, track: int, started: float, end: float) -> float:
        """Where a slice of `track` begins: not before the track's last slice ended (commands
        of one queue complete in order, so `end` never goes back)."""
        start = min(max(started, self._track_end.get(track, started)), end)
        self._track_end[track] = end
        return start

    def queue_summary(self) -> dict[str, Any]:
        """What each queue did: `{"CQ0": {...}, "CQ1": {...}, "both_busy_seconds": s}`.

        Per queue: `busy_seconds`, the length of the union of its commands' spans (commands
        that run together, such as batched host writes, are counted once), `bytes`, the sum of
        the commands' `args["bytes"]`, and `commands`. `both_busy_seconds` is how long both
        queues were busy at once.
        """
        return queue_summary(self.events)

    def to_json(self) -> dict[str, Any]:
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"ttflow {self.device.spec.name}"}}
        ]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}}
            for tid, name in _TRACK_NAMES.items()
        ]
        pid = self.device.worker_pid
        if pid is not None:
            chip = self.device.chip
            where = f"chip {chip}" if chip is not None else f"ttflow {self.device.spec.name}"
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{where} worker {pid}"}})
            meta += [
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                for tid, name in _WORKER_TRACK_NAMES.items()
            ]
        return {"traceEvents": meta + self.events, "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the trace; open it at ui.perfetto.dev or chrome://tracing. FileError (also an
        OSError) when the path cannot be written."""
        write_json(path, self.to_json(), "write the timeline to", example="trace.json")


def write_json(path: str | os.PathLike[str], data: Any, action: str, example: str) -> None:
    """Writes `data` as JSON to `path`; a path that cannot be written is a FileError saying it
    could not `action` the path (the trace files of devices and meshes)."""
    text = json.dumps(data)  # before the file is opened: a failure leaves no empty file
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise FileError.of(exc, action, path, writing=True, example=example) from exc


@contextmanager
def record_timeline(device: Device) -> Iterator[TimelineRecorder]:
    """Records every command the device completes inside the block."""
    recorder = TimelineRecorder(device)
    # A worker process's queue workers keep the spans of the records they sent while recording.
    workers = [worker for worker in (device._cq0._worker, device._cq1._worker) if hasattr(worker, "spans")]
    if workers:
        recorder.worker_spans = {}
        for worker in workers:
            worker.spans = recorder.worker_spans
    try:
        with device._scheduler.listening(recorder.on_command, timed=True):
            yield recorder
    finally:
        for worker in workers:
            if worker.spans is recorder.worker_spans:
                worker.spans = None


def queue_summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """`TimelineRecorder.queue_summary` over trace events (also those of a saved trace)."""
    spans: dict[int, list[tuple[float, float]]] = {tid: [] for tid in _TRACKS.values()}
    moved = dict.fromkeys(_TRACKS.values(), 0)
    for event in events:
        if event.get("ph") == "X" and event.get("tid") in spans and "bytes" in event.get("args", {}):
            # (a command's nested slices, such as a replay's programs, have no bytes of their own)
            spans[event["tid"]].append((event["ts"], event["ts"] + event["dur"]))
            moved[event["tid"]] += int(event.get("args", {}).get("bytes", 0))
    busy = {tid: _union(s) for tid, s in spans.items()}
    summary: dict[str, Any] = {
        queue: {
            "busy_seconds": sum(end - start for start, end in busy[tid]) / 1e6,
            "bytes": moved[tid],
            "commands": len(spans[tid]),
        }
        for queue, tid in _TRACKS.items()
    }
    summary["both_busy_seconds"] = _intersection(busy[0], busy[1]) / 1e6
    return summary


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as `spans`."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two sorted, disjoint interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def record_trace(device: Device) -> AbstractContextManager[TimelineRecorder]:
    """Deprecated: `record_timeline` ("trace" now means capture and replay, `tt.capture_trace`)."""
    warnings.warn(
        "tt.record_trace is deprecated: use tt.record_timeline (a trace is now a captured "
        "sequence of device work, see tt.capture_trace)",
        DeprecationWarning,
        stacklevel=2,
    )
    return record_timeline(device)
