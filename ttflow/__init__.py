"""ttflow: device-resident tensors on an emulated tile-based AI accelerator.

The public names load lazily (PEP 562): `import ttflow` imports only the C-extension check below,
and each name's submodule is imported the first time the name is read (`tt.open_device`, `from
ttflow import Device`). So `import ttflow` and the `ttflow` command's `--help` stay cheap; a
program that uses the device pays for the device model, ml_dtypes and numpy when it first does.
"""

import importlib as _importlib
import typing as _typing

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

if _typing.TYPE_CHECKING:  # the re-exports, as type checkers and IDEs read them
    from . import kernels as kernels
    from ._ir.binary import Binary as Binary
    from ._ir.binary import get_layout as get_layout
    from ._observe.debug import OpContext as OpContext
    from ._observe.debug import OpTensor as OpTensor
    from ._observe.debug import ProgramContext as ProgramContext
    from ._observe.debug import debug_hooks as debug_hooks
    from ._runtime.device import Device as Device
    from ._runtime.device import DeviceStatistics as DeviceStatistics
    from ._runtime.device import open_device as open_device
    from ._errors import BinaryFormatError as BinaryFormatError
    from ._errors import CollectiveError as CollectiveError
    from ._errors import DeallocatedTensorError as DeallocatedTensorError
    from ._errors import DebugHookError as DebugHookError
    from ._errors import DeviceClosedError as DeviceClosedError
    from ._errors import DeviceLostError as DeviceLostError
    from ._errors import FileError as FileError
    from ._errors import HostOpError as HostOpError
    from ._errors import LayoutError as LayoutError
    from ._errors import MeshError as MeshError
    from ._errors import OutOfMemoryError as OutOfMemoryError
    from ._errors import ProgramError as ProgramError
    from ._errors import ShapeError as ShapeError
    from ._errors import TraceError as TraceError
    from ._errors import TTFlowError as TTFlowError
    from ._golden import GoldenReport as GoldenReport
    from ._golden import GoldenRow as GoldenRow
    from ._golden import compare_with_golden as compare_with_golden
    from ._memory.banks import BufferInfo as BufferInfo
    from ._memory.banks import BufferView as BufferView
    from ._memory.banks import MemoryView as MemoryView
    from ._memory.banks import RemoteMemoryError as RemoteMemoryError
    from ._memory_log import set_memory_log as set_memory_log
    from ._observe.memory_map import MemoryMapRecorder as MemoryMapRecorder
    from ._observe.memory_map import draw_memory_map as draw_memory_map
    from ._observe.memory_map import memory_map_figure as memory_map_figure
    from ._observe.memory_map import record_memory_map as record_memory_map
    from ._mesh.api import capture_trace as capture_trace
    from ._mesh.api import deallocate as deallocate
    from ._mesh.api import empty as empty
    from ._mesh.api import execute_trace as execute_trace
    from ._mesh.api import record_timeline as record_timeline
    from ._mesh.api import release_trace as release_trace
    from ._mesh.api import submit as submit
    from ._mesh.api import to_device as to_device
    from ._mesh.api import to_host as to_host
    from ._mesh.api import to_layout as to_layout
    from ._mesh.api import wait as wait
    from ._mesh.api import write as write
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
    from ._ir.program import Program as Program
    from ._ir.builder import ProgramBuilder as ProgramBuilder
    from ._program_cache import clear_program_cache as clear_program_cache
    from ._ir.simplify import simplify as simplify
    from ._runtime.tensor import Tensor as Tensor
    from ._observe.timeline import TimelineRecorder as TimelineRecorder
    from ._observe.timeline import record_trace as record_trace
    from ._runtime.trace import Trace as Trace
    from ._types import DataType as DataType
    from ._types import DeviceSpec as DeviceSpec
    from ._types import Layout as Layout
    from ._types import MemorySpace as MemorySpace
    from ._types import TensorLayout as TensorLayout

# The one table of where each public name lives: `__getattr__` imports the submodule the first
# time the name is read, then binds the name here, so later reads are plain lookups. Importing
# `ttflow` (or `ttflow.cli`) therefore costs nothing until a name is used. The block above is the
# same table as a type checker reads it; tests/test_lazy_import.py checks that the two agree
# (deriving this table from the block with `ast` would need the source at run time, which a
# bytecode-only install lacks, and a parse on every import; the test costs nothing at run time).
_SOURCES: dict[str, str] = {name: module for module, names in {
    "._errors": ("BinaryFormatError", "DeallocatedTensorError", "DeviceClosedError", "LayoutError",
                 "OutOfMemoryError", "ProgramError", "ShapeError", "TTFlowError", "TraceError",
                 "MeshError", "DebugHookError", "CollectiveError", "HostOpError", "DeviceLostError",
                 "FileError"),
    "._observe.debug": ("OpContext", "OpTensor", "ProgramContext", "debug_hooks"),
    "._golden": ("GoldenReport", "GoldenRow", "compare_with_golden"),
    "._memory.banks": ("RemoteMemoryError", "BufferInfo", "BufferView", "MemoryView"),
    "._runtime.device": ("Device", "DeviceStatistics", "open_device"),
    "._runtime.trace": ("Trace",),
    "._mesh.api": ("capture_trace", "execute_trace", "release_trace", "deallocate", "empty", "submit",
                   "to_device", "to_host", "to_layout", "wait", "write", "record_timeline"),
    "._observe.memory_map": ("MemoryMapRecorder", "draw_memory_map", "memory_map_figure", "record_memory_map"),
    "._ir.binary": ("Binary", "get_layout"),
    "._ir.program": ("Program",),
    "._ir.builder": ("ProgramBuilder",),
    "._ir.simplify": ("simplify",),
    "._runtime.tensor": ("Tensor",),
    "._observe.timeline": ("TimelineRecorder", "record_trace"),
    "._mesh.device": ("MeshDevice", "MeshStatistics", "create_submesh", "open_mesh_device",
                      "release_submesh"),
    "._mesh.placement": ("concat", "concat_2d", "replicate", "shard", "shard_2d"),
    "._mesh.spec": ("MeshSpec",),
    "._mesh.tensor": ("MeshTensor", "device_tensors"),
    "._mesh.timeline": ("MeshTimelineRecorder",),
    "._mesh.trace": ("MeshTrace",),
    "._mesh.transfer": ("from_shards",),
    "._program_cache": ("clear_program_cache",),
    "._memory_log": ("set_memory_log",),
    "._types": ("DataType", "DeviceSpec", "Layout", "MemorySpace", "TensorLayout"),
    ".kernels": ("kernels",),  # a submodule: the name is the module itself
}.items() for name in names}


def __getattr__(name: str) -> object:
    source = _SOURCES.get(name)
    if source is not None:
        module = _importlib.import_module(source, __name__)
        value = module if source == f".{name}" else getattr(module, name)
        globals()[name] = value
        return value
    if name == "TraceRecorder":  # deprecated for one release
        import warnings

        warnings.warn(
            "tt.TraceRecorder is deprecated: use tt.TimelineRecorder", DeprecationWarning, stacklevel=2
        )
        return __getattr__("TimelineRecorder")
    raise AttributeError(f"module 'ttflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})


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
    "FileError",
]
