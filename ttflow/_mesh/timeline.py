"""One Perfetto timeline for a mesh: a process per chip, each with its queues' tracks.

Each chip records as `tt.record_timeline(device)` does (its own `TimelineRecorder`); the
recorders share one time origin, and `to_json` gives chip k the process id k + 1, named after
its coordinate and id. (Part 2's links can add their own processes to `to_json`'s events.)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, final

from .. import _timeline
from .._timeline import TimelineRecorder
from .device import MeshDevice

__all__ = ["MeshTimelineRecorder", "record_mesh_timeline"]


@final
class MeshTimelineRecorder:
    """Every chip's `TimelineRecorder` (`recorders`, row-major), written as one trace."""

    def __init__(self, mesh: MeshDevice, recorders: list[TimelineRecorder]) -> None:
        self.mesh = mesh
        self.recorders = tuple(recorders)
        self._names = [f"chip {i} {coord}" for i, coord in zip(mesh.device_ids, mesh.coords)]

    @property
    def commands(self) -> int:
        return sum(recorder.commands for recorder in self.recorders)

    def queue_summary(self) -> list[dict[str, Any]]:
        """Each chip's `TimelineRecorder.queue_summary()`, row-major."""
        return [recorder.queue_summary() for recorder in self.recorders]

    def to_json(self) -> dict[str, Any]:
        events: list[dict[str, Any]] = []
        label = self.mesh.spec.label
        for pid, (recorder, name) in enumerate(zip(self.recorders, self._names), start=1):
            for event in recorder.to_json()["traceEvents"]:
                event = dict(event, pid=pid)
                if event.get("ph") == "M" and event["name"] == "process_name":
                    event["args"] = {"name": f"ttflow {label} {name}"}
                events.append(event)
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the trace; open it at ui.perfetto.dev or chrome://tracing."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f)


@contextmanager
def record_mesh_timeline(mesh: MeshDevice) -> Iterator[MeshTimelineRecorder]:
    """Records every command each chip of the mesh completes inside the block."""
    mesh.check_open()
    with ExitStack() as stack:
        recorders = [stack.enter_context(_timeline.record_timeline(chip)) for chip in mesh._chips]
        origin = time.perf_counter()
        for recorder in recorders:
            recorder.origin = origin
        yield MeshTimelineRecorder(mesh, recorders)
