"""Traces on a mesh: one trace per chip, captured together, replayed together.

`tt.capture_trace(mesh)` opens a capture on every chip (a submit on the mesh is one submit per
chip, each recorded by its chip's capture); `tt.execute_trace` queues one replay per chip,
`tt.release_trace` releases them all. Each chip's trace is an ordinary `tt.Trace`, with its
guarantees (pinned storages, refills, byte-exact replays).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, final

from .. import _trace
from .._trace import Trace
from .device import MeshDevice

__all__ = ["MeshTrace", "capture_mesh_trace", "execute_mesh_trace", "release_mesh_trace"]


@final
class MeshTrace:
    """A trace of mesh work: `traces`, one `tt.Trace` per chip, row-major."""

    __slots__ = ("mesh", "traces")

    mesh: MeshDevice
    traces: tuple[Trace, ...]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("tt.MeshTrace has no public constructor: use `with tt.capture_trace(mesh)`")

    @classmethod
    def _wrap(cls, mesh: MeshDevice, traces: list[Trace]) -> MeshTrace:
        trace = object.__new__(cls)
        trace.mesh = mesh
        trace.traces = tuple(traces)
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
    """Queues one replay on every chip (each on its CQ0)."""
    trace.mesh.check_open()
    for chip_trace in trace.traces:
        _trace.execute_trace(chip_trace)


def release_mesh_trace(trace: MeshTrace) -> None:
    """Releases every chip's trace; idempotent."""
    for chip_trace in trace.traces:
        _trace.release_trace(chip_trace)
