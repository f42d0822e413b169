"""ttflow: device-resident tensors on an emulated tile-based AI accelerator."""

try:  # the C extensions: absent from a source tree that was never built in place
    from ._core._allocator import Allocator as _Allocator  # noqa: F401
except ModuleNotFoundError as _missing:  # pragma: no cover - exercised in a subprocess
    if not (_missing.name or "").startswith("ttflow."):
        raise
    import os as _os

    raise ImportError(
        f"ttflow was imported from its source tree ({_os.path.dirname(_os.path.abspath(__file__))}), "
        "whose C extensions are not built, and which shadows any installed ttflow. Build them in "
        "place with `pip install -e .` in the checkout, or run Python from another folder to use "
        "the installed ttflow (as numpy asks of its own source tree)."
    ) from None

from ._errors import BinaryFormatError as BinaryFormatError
from ._errors import DeallocatedTensorError as DeallocatedTensorError
from ._errors import DeviceClosedError as DeviceClosedError
from ._errors import LayoutError as LayoutError
from ._errors import OutOfMemoryError as OutOfMemoryError
from ._errors import ProgramError as ProgramError
from ._errors import ShapeError as ShapeError
from ._errors import TTFlowError as TTFlowError
from ._errors import TraceError as TraceError
from ._errors import MeshError as MeshError
from ._errors import DebugHookError as DebugHookError
from ._debug import OpContext as OpContext
from ._debug import OpTensor as OpTensor
from ._debug import ProgramContext as ProgramContext
from ._debug import debug_hooks as debug_hooks
from ._golden import GoldenReport as GoldenReport
from ._golden import GoldenRow as GoldenRow
from ._golden import compare_with_golden as compare_with_golden
from ._errors import CollectiveError as CollectiveError
from ._errors import HostOpError as HostOpError
from ._errors import DeviceLostError as DeviceLostError
from ._memory import RemoteMemoryError as RemoteMemoryError
from ._device import Device as Device
from ._device import DeviceStatistics as DeviceStatistics
from ._device import open_device as open_device
from ._trace import Trace as Trace
from ._mesh.api import capture_trace as capture_trace
from ._mesh.api import execute_trace as execute_trace
from ._mesh.api import release_trace as release_trace
from ._memory import BufferInfo as BufferInfo
from ._memory import BufferView as BufferView
from ._memory import MemoryView as MemoryView
from ._memory_map import MemoryMapRecorder as MemoryMapRecorder
from ._memory_map import draw_memory_map as draw_memory_map
from ._memory_map import memory_map_figure as memory_map_figure
from ._memory_map import record_memory_map as record_memory_map
from ._binary import Binary as Binary
from ._program import Program as Program
from ._program import ProgramBuilder as ProgramBuilder
from ._simplify import simplify as simplify
from ._binary import get_layout as get_layout
from ._mesh.api import deallocate as deallocate
from ._mesh.api import empty as empty
from ._mesh.api import submit as submit
from ._mesh.api import to_device as to_device
from ._mesh.api import to_host as to_host
from ._mesh.api import to_layout as to_layout
from ._mesh.api import wait as wait
from ._mesh.api import write as write
from ._tensor import Tensor as Tensor
from ._timeline import TimelineRecorder as TimelineRecorder
from ._mesh.api import record_timeline as record_timeline
from ._mesh.device import MeshDevice as MeshDevice
from ._mesh.device import MeshStatistics as MeshStatistics
from ._mesh.device import create_submesh as create_submesh
from ._mesh.device import open_mesh_device as open_mesh_device
from ._mesh.device import release_submesh as release_submesh
from ._mesh.placement import concat as concat
from ._mesh.placement import concat_2d as concat_2d
from ._mesh.placement import replicate as replicate
from ._mesh.placement import shard as shard
from ._mesh.placement import shard_2d as shard_2d
from ._mesh.spec import MeshSpec as MeshSpec
from ._mesh.tensor import MeshTensor as MeshTensor
from ._mesh.tensor import device_tensors as device_tensors
from ._mesh.timeline import MeshTimelineRecorder as MeshTimelineRecorder
from ._mesh.trace import MeshTrace as MeshTrace
from ._mesh.transfer import from_shards as from_shards
from ._timeline import record_trace as record_trace
from ._program_cache import clear_program_cache as clear_program_cache
from ._memory_log import set_memory_log as set_memory_log
from ._types import DataType as DataType
from ._types import DeviceSpec as DeviceSpec
from ._types import Layout as Layout
from ._types import MemorySpace as MemorySpace
from ._types import TensorLayout as TensorLayout
from . import kernels as kernels



def __getattr__(name: str) -> object:
    if name == "TraceRecorder":  # deprecated for one release
        import warnings

        warnings.warn(
            "tt.TraceRecorder is deprecated: use tt.TimelineRecorder", DeprecationWarning, stacklevel=2
        )
        return TimelineRecorder
    raise AttributeError(f"module 'ttflow' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "BinaryFormatError", "DeallocatedTensorError", "DeviceClosedError", "LayoutError",
    "OutOfMemoryError", "ProgramError", "ShapeError", "TTFlowError", "TraceError", "MeshError",
    "CollectiveError", "HostOpError", "DeviceLostError", "RemoteMemoryError",
    "Trace", "capture_trace", "execute_trace", "release_trace",
    "Device", "DeviceStatistics", "open_device", "BufferInfo",
    "MemoryView", "BufferView", "MemoryMapRecorder", "record_memory_map", "draw_memory_map",
    "memory_map_figure",
    "Binary", "Program", "ProgramBuilder", "simplify", "get_layout",
    "deallocate", "empty", "submit", "to_device", "to_host", "to_layout", "wait", "write",
    "Tensor", "TimelineRecorder", "record_timeline", "record_trace", "TraceRecorder",
    "DataType", "DeviceSpec", "Layout", "MemorySpace", "TensorLayout", "kernels",
    "MeshSpec", "MeshDevice", "MeshStatistics", "MeshTensor", "MeshTrace", "MeshTimelineRecorder",
    "open_mesh_device", "create_submesh", "release_submesh", "device_tensors", "from_shards",
    "replicate", "shard", "shard_2d", "concat", "concat_2d",
    "clear_program_cache", "set_memory_log",
    "DebugHookError", "OpContext", "OpTensor", "ProgramContext", "debug_hooks",
    "GoldenReport", "GoldenRow", "compare_with_golden",
]
