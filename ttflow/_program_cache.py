"""Program cache control: dropping the plans a device keeps of the programs it has run.

A device plans each program once (`_sched.scheduler.Scheduler.plan`: its layouts interned, its
operands' geometry bound to the device) and keeps the plan for the next submit of the program,
as tt-mlir's runtime keeps its program cache. A compiler's harness turns the cache off
(`device.program_cache_enabled = False`) or clears it to check or time planning itself;
`device.stats.program_cache_hits` / `program_cache_misses` count either way.
"""

from __future__ import annotations

from ._runtime.device import Device
from ._mesh.device import MeshDevice

__all__ = ["clear_program_cache"]


def clear_program_cache(device: Device | MeshDevice) -> None:
    """Drops every program plan `device` keeps (on a mesh: every chip's, and the mesh's record
    of the last program decided on its chips); the next submit of each program plans it again
    (a miss). Commands already queued keep their own plans. The cache stays on (see
    `device.program_cache_enabled`)."""
    if isinstance(device, MeshDevice):
        chips = device.chips  # clearing a chip's plans renews the plan token: the mesh's decided record goes stale
    elif isinstance(device, Device):
        chips = [device]
    else:
        raise TypeError(f"expected a tt.Device or a tt.MeshDevice, got {type(device).__name__}")
    for chip in chips:
        chip._scheduler.clear_plans()
