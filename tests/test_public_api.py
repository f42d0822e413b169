"""The public surface is deliberate: this test changes when it does."""

from types import ModuleType

import anyio
import numpy as np
import pytest

import ttflow as tt

EXPECTED = {
    "BinaryFormatError", "DeallocatedTensorError", "DeviceClosedError", "LayoutError",
    "OutOfMemoryError", "ProgramError", "ShapeError", "TTFlowError", "TraceError",
    "Trace", "capture_trace", "execute_trace", "release_trace",
    "Device", "DeviceStatistics", "open_device", "BufferInfo",
    "MemoryView", "BufferView", "MemoryMapRecorder", "record_memory_map", "draw_memory_map",
    "memory_map_figure",
    "Binary", "Program", "ProgramBuilder", "simplify", "get_layout",
    "deallocate", "empty", "submit", "to_device", "to_host", "to_layout", "wait", "write",
    "Tensor", "TimelineRecorder", "record_timeline", "record_trace", "TraceRecorder",
    "DataType", "DeviceSpec", "Layout", "MemorySpace", "TensorLayout", "kernels",
    "MeshError", "CollectiveError", "MeshSpec", "MeshDevice", "MeshStatistics", "MeshTensor", "MeshTrace",
    "MeshTimelineRecorder", "open_mesh_device", "create_submesh", "release_submesh",
    "device_tensors", "from_shards", "replicate", "shard", "shard_2d", "concat", "concat_2d",
    "HostOpError",  # issue 27: host ops in programs
    "clear_program_cache", "set_memory_log",  # issue 27: program cache control, memory log
    "DebugHookError", "OpContext", "OpTensor", "ProgramContext", "debug_hooks",  # issue 27: hooks
    "GoldenReport", "GoldenRow", "compare_with_golden",  # issue 27: golden comparison
    "DeviceLostError",  # issue 28: a device whose worker process died
    "RemoteMemoryError",  # issue 28: the host reaching for a Ray chip's memory
    "FileError",  # issue 36: a path the API cannot read or write (also an OSError)
}


def test_exported_names() -> None:
    assert set(tt.__all__) == EXPECTED
    # The names load on first use (PEP 562), so `vars(tt)` holds only those read so far: what
    # the module lists is `dir(tt)`, and every listed name must resolve. Submodules
    # (`ttflow.cli`, the optional `ttflow.torch`) appear once something imports them.
    listed = {name for name in dir(tt) if not name.startswith("_")}
    public = {name for name in listed if not isinstance(getattr(tt, name), ModuleType) or name == "kernels"}
    assert public == EXPECTED - DEPRECATED_ATTRIBUTES
    for name in EXPECTED - DEPRECATED_ATTRIBUTES:
        assert getattr(tt, name) is vars(tt)[name]  # resolved once, then bound on the module


DEPRECATED_ATTRIBUTES = {"TraceRecorder"}  # served by the module's __getattr__, with a warning


def test_old_timeline_names_warn_and_still_work() -> None:
    with pytest.warns(DeprecationWarning, match="TimelineRecorder"):
        assert tt.TraceRecorder is tt.TimelineRecorder

    async def body() -> int:
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            with pytest.warns(DeprecationWarning, match="record_timeline"):
                recorder = tt.record_trace(device)
            with recorder as rec:
                await tt.to_device(np.ones((4, 4), np.float32), device)
            return rec.commands

    assert anyio.run(body) == 1


def test_every_error_is_a_ttflow_error() -> None:
    for name in EXPECTED - DEPRECATED_ATTRIBUTES:
        obj = getattr(tt, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, tt.TTFlowError)


def test_kernels_face() -> None:
    assert set(tt.kernels.__all__) >= {
        "tilize", "untilize", "pack_bfloat8_b", "unpack_bfloat8_b", "scatter_pages", "gather_pages",
        "tilize_to_banks", "untilize_from_banks", "pack_bfloat8_b_to_banks", "unpack_bfloat8_b_from_banks",
    }


TORCH_PUBLIC = {"TTTensor", "UnsupportedOpError", "backend", "close", "compile", "device", "open_device",
                "synchronize"}


def test_the_torch_front_ends_surface_is_pinned() -> None:
    ttt = pytest.importorskip("ttflow.torch", reason="the PyTorch front-end is optional")
    assert set(ttt.__all__) == TORCH_PUBLIC
    exported = {n for n in vars(ttt) if not n.startswith("_") and not isinstance(vars(ttt)[n], ModuleType)}
    assert exported - {"annotations"} == TORCH_PUBLIC, exported ^ TORCH_PUBLIC


def test_the_ttnn_front_ends_names() -> None:
    """tt-mlir's binaries: `tt.Binary.load` reads them; `ttflow.ttnn` adds the descriptor writer
    (lazily: the command line names `SECTIONS` and `INITS` without importing numpy)."""
    import ttflow.ttnn as ttnn

    assert ttnn.__all__ == ["INITS", "SECTIONS", "SystemDesc", "system_desc"]
    assert callable(ttnn.system_desc) and isinstance(ttnn.SystemDesc, type)
    assert ttnn.SECTIONS == ("version", "system_desc", "mlir", "programs", "inputs", "outputs", "ops")
