"""One Perfetto timeline for a mesh: a process per chip, each with its queues' tracks.

Each chip records as `tt.record_timeline(device)` does (its own `TimelineRecorder`); the
recorders share one time origin, and `to_json` gives chip k the process id k + 1, named after
its coordinate and id; a chip's worker process (`workers="process"`) keeps its own pid and
name ("chip (r, c) worker <pid>", see `_timeline`). The links come last, as one more process
("links"): a track per directed link that carried collective bytes, and on it a slice per
collective that used the link, from the moment the last chip of its group arrived, as long as a
real mesh would take
(`CollectiveRecord.modelled_seconds`, the link model, whose payload term is split across the
pair's `links_per_pair` links), with its bytes on that link (the sum over the pair's links), so the trace
shows where a real mesh would wait; each slice's `args` also say how long each chip waited
for its group (`waited_us`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, final

from .._observe import timeline as _timeline
from .._observe.timeline import TimelineRecorder, write_json
from .collectives import CollectiveRecord, collective_log
from .device import MeshDevice

__all__ = ["MeshTimelineRecorder", "record_mesh_timeline"]


@final
class MeshTimelineRecorder:
    """Every chip's `TimelineRecorder` (`recorders`, row-major), written as one trace."""

    def __init__(self, mesh: MeshDevice, recorders: list[TimelineRecorder],
                 collectives: list[CollectiveRecord] | None = None) -> None:
        self.mesh = mesh
        self.recorders = tuple(recorders)
        self._names = [f"chip {i} {coord}" for i, coord in zip(mesh.device_ids, mesh.coords)]
        self._collectives = [] if collectives is None else collectives  # completed while recording

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
                if event.get("pid") != 1:  # the chip's worker process: its own pid
                    events.append(event)
                    continue
                event = dict(event, pid=pid)
                if event.get("ph") == "M" and event["name"] == "process_name":
                    event["args"] = {"name": f"ttflow {label} {name}"}
                events.append(event)
        events += self._link_events(len(self.recorders) + 1)
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def _link_events(self, pid: int) -> list[dict[str, Any]]:
        """The links' process: a track per directed link (chip ids), a slice per collective."""
        origin = self.recorders[0].origin if self.recorders else 0.0
        ours = list(self._collectives)
        tracks: dict[tuple[int, int], int] = {}
        slices: list[dict[str, Any]] = []
        for record in ours:
            for (a, b), nbytes in sorted(record.link_bytes.items()):
                pair = (record.chip_ids[a], record.chip_ids[b])
                tid = tracks.setdefault(pair, len(tracks))
                slices.append({
                    "name": record.op, "cat": "collective", "ph": "X", "pid": pid, "tid": tid,
                    "ts": round((record.started - origin) * 1e6, 3),
                    "dur": round(record.modelled_seconds * 1e6, 3),
                    "args": {"program": record.program, "step": record.step, "bytes": nbytes,
                             "chips": len(record.group), "topology": record.topology,
                             "links_per_pair": record.links,
                             "modelled_us": round(record.modelled_seconds * 1e6, 3),
                             "waited_us": {f"{c}": round(w * 1e6, 1) for c, w in record.waited.items()}},
                })
        if not slices:
            return []
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"ttflow {self.mesh.spec.label} links"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                  "args": {"name": f"link chip {a} -> chip {b}"}} for (a, b), tid in tracks.items()]
        return meta + slices

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the trace; open it at ui.perfetto.dev or chrome://tracing. FileError (also an
        OSError) when the path cannot be written."""
        write_json(path, self.to_json(), "write the timeline to", example="trace.json")


@contextmanager
def record_mesh_timeline(mesh: MeshDevice) -> Iterator[MeshTimelineRecorder]:
    """Records every command each chip of the mesh completes inside the block."""
    mesh.check_open()
    with ExitStack() as stack:
        recorders = [stack.enter_context(_timeline.record_timeline(chip)) for chip in mesh._chips]
        collectives = stack.enter_context(collective_log(mesh).listening())
        origin = time.perf_counter()
        for recorder in recorders:
            recorder.origin = origin
        yield MeshTimelineRecorder(mesh, recorders, collectives)
