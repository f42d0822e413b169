"""The public surface is deliberate: this test changes when it does."""

from types import ModuleType

import ttflow as tt

EXPECTED = {
    "BinaryFormatError", "DeallocatedTensorError", "DeviceClosedError", "LayoutError",
    "OutOfMemoryError", "ProgramError", "ShapeError", "TTFlowError", "TraceError",
    "Trace", "capture_trace", "execute_trace", "release_trace",
    "Device", "DeviceStatistics", "open_device", "BufferInfo",
    "Binary", "Program", "ProgramBuilder", "get_layout",
    "deallocate", "empty", "submit", "to_device", "to_host", "to_layout", "wait", "write",
    "Tensor", "TraceRecorder", "record_trace",
    "DataType", "DeviceSpec", "Layout", "MemorySpace", "TensorLayout", "kernels",
}


def test_exported_names() -> None:
    assert set(tt.__all__) == EXPECTED
    # Submodules (`ttflow.cli`, the optional `ttflow.torch`) appear once something imports them.
    public = {
        name for name, value in vars(tt).items()
        if not name.startswith("_") and (not isinstance(value, ModuleType) or name == "kernels")
    }
    assert public == EXPECTED


def test_every_error_is_a_ttflow_error() -> None:
    for name in EXPECTED:
        obj = getattr(tt, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, tt.TTFlowError)


def test_kernels_face() -> None:
    assert set(tt.kernels.__all__) >= {
        "tilize", "untilize", "pack_bfloat8_b", "unpack_bfloat8_b", "scatter_pages", "gather_pages",
        "tilize_to_banks", "untilize_from_banks", "pack_bfloat8_b_to_banks", "unpack_bfloat8_b_from_banks",
    }
