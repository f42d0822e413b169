"""Traces on a mesh: one trace per chip, captured together, replayed together.

`tt.capture_trace(mesh)` opens a capture on every chip (a submit on the mesh is one submit per
chip, each recorded by its chip's capture); `tt.execute_trace` queues one replay per chip,
`tt.release_trace` releases them all. Each chip's trace is an ordinary `tt.Trace`, with its
guarantees (pinned storages, refills, byte-exact replays).

Programs with collectives are captured too. A captured submit's chips met in its own
`Rendezvous` (their `Compute` steps keep their `Peer`); every execute gives the chips' replays
one `ReplayRendezvous`, in which each captured rendezvous gets a fresh one the first time a
chip's replay is decided: the chips of one execute meet there, count their bytes on the links
again, and a failing chip's replay aborts them (`tt.CollectiveError`), as a submit's does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, final

from .._runtime import trace as _trace
from .._runtime.trace import Trace
from .collectives import ReplayPeers, ReplayRendezvous
from .device import MeshDevice
from .spec import Coord

__all__ = ["MeshTrace", "capture_mesh_trace", "execute_mesh_trace", "release_mesh_trace"]


@final
class MeshTrace:
    """A trace of mesh work: `traces`, one `tt.Trace` per chip, row-major."""

    __slots__ = ("coords", "mesh", "traces")

    mesh: MeshDevice
    traces: tuple[Trace, ...]
    coords: tuple[Coord, ...]  # each trace's chip's coordinate at capture (its collectives')

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("tt.MeshTrace has no public constructor: use `with tt.capture_trace(mesh)`")

    @classmethod
    def _wrap(cls, mesh: MeshDevice, traces: list[Trace]) -> MeshTrace:
        trace = object.__new__(cls)
        trace.mesh = mesh
        trace.traces = tuple(traces)
        trace.coords = tuple(mesh.coords)
        return trace

    @property
    def programs(self) -> tuple[str, ...]:
        """Names of the programs recorded (every chip records the same ones)."""
        return self.traces[0].programs

    @property
    def released(self) -> bool:
        return all(trace.released for trace in self.traces)

    def __repr__(self) -> str:
        return f"<ttflow.MeshTrace of {len(self.traces)} chips on {self.mesh!r}>"


@contextmanager
def capture_mesh_trace(mesh: MeshDevice) -> Iterator[MeshTrace]:
    """A capture on every chip of the mesh, for the block (see `tt.capture_trace`)."""
    mesh.check_open()
    with ExitStack() as stack:
        traces = [stack.enter_context(_trace.capture_trace(chip)) for chip in mesh._chips]
        yield MeshTrace._wrap(mesh, traces)


def execute_mesh_trace(trace: MeshTrace) -> None:
    """Queues one replay on every chip (each on its CQ0), each with its place in this execute
    (`ReplayPeers`: its collectives meet the other chips' replays of this execute). Every chip's
    trace is checked before any queues (released, failed, an input deallocated: TraceError)."""
    mesh = trace.mesh
    mesh.check_open()
    for chip_trace in trace.traces:
        _trace.check_replay(chip_trace)
    execution = ReplayRendezvous()
    mesh._system.rendezvous.add(execution)  # aborted if the mesh closes on an error
    queued = 0
    try:
        for coord, chip_trace in zip(trace.coords, trace.traces):
            _trace.execute_with_peers(chip_trace, ReplayPeers(execution, coord))
            queued += 1
    except BaseException as exc:  # the chips queued so far must not wait for the others
        execution.abort(trace.coords[queued], exc)
        raise


def release_mesh_trace(trace: MeshTrace) -> None:
    """Releases every chip's trace; idempotent."""
    for chip_trace in trace.traces:
        _trace.release_trace(chip_trace)
