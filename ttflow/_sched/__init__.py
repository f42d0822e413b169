"""The scheduler: the one owner of scheduling state, split by job.

For every device tensor the scheduler keeps a `TensorState`: its storages (the home storage first,
then conversions kept for reuse), the last queued command that writes it and the last that reads
it, how many queued commands use it, its error, and whether its handle is gone. Nothing else
writes these fields: the user's `Tensor` is a handle that reads them, commands decide into records
and commit through the state's named methods, and the queues only run records.

What the scheduler decides, when a command reaches the head of its queue:
- a program first moves to DRAM every L1 storage it does not read (an `EvictCommand`, its
  preamble; a storage whose value DRAM already holds in the same format is just freed);
- an input whose storages do not include the declared layout gets one, copied from the cheapest
  source; the copy is kept on the tensor for later programs (converted once). A copy that changes
  layout or dtype is a conversion; one that only changes memory space is residency;
- outputs and scratch are allocated; scratch is freed when the program ends.

Ordering: a command waits for the last writer of what it reads (read-after-write) and, when it
writes, for the last reader and writer (write-after-read, write-after-write). Commands on one queue
run in order, so only cross-queue dependencies are recorded.

One file per job, each importing only those below it (import-linter checks the order):

    scheduler   `Scheduler`: queueing in dependency order, program plans, listeners
    capture     trace capture: `Capture`, its seal, its replay
    commands    the data path: write, read, to_layout, deferred allocation, program
    room        making room: eviction policy, relocation, compaction, spilling
    moves       the commands that move live buffers: evict, relocate, slide
    state       `TensorState` and the tables, with the named methods that alone change them
    planning    room's arithmetic over addresses and sizes (no tensors)
"""

from .capture import Capture as Capture
from .capture import ReplayCommand as ReplayCommand
from .capture import SealCommand as SealCommand
from .commands import AllocateCommand as AllocateCommand
from .commands import ConvertCommand as ConvertCommand
from .commands import ProgramCommand as ProgramCommand
from .commands import ReadCommand as ReadCommand
from .commands import WriteCommand as WriteCommand
from .moves import EvictCommand as EvictCommand
from .moves import RelocateCommand as RelocateCommand
from .moves import SlideCommand as SlideCommand
from .scheduler import EVICTION_POLICIES as EVICTION_POLICIES
from .scheduler import Scheduler as Scheduler
from .state import FootprintClash as FootprintClash
from .state import SchedulerState as SchedulerState
from .state import TensorState as TensorState

__all__ = [
    "Scheduler", "SchedulerState", "TensorState", "EVICTION_POLICIES", "Capture", "SealCommand",
    "ReplayCommand", "WriteCommand", "ReadCommand", "ConvertCommand", "AllocateCommand",
    "ProgramCommand", "EvictCommand", "RelocateCommand", "SlideCommand", "FootprintClash",
]
