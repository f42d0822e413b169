"""The runtime-stitching API (tt-mlir's runtime calls, with Pythonic names).

Each function validates everything that can be known now and raises before anything is queued;
then it hands a command to the device's queues and returns. None of them blocks; only `to_host`
and `wait` are async, and they only wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from . import const_eval as _const_eval
from .._core import _dispatch
from .device import Device
from .._errors import LayoutError, ProgramError, ShapeError, TraceError, raise_stored
from .._kernels import _bfp8, _pointwise
from .._memory.banks import RemoteMemoryError, Storage
from .._queue import NO_DEPS
from .._sched import ProgramCommand, TensorState
from .._ir.binary import Binary, for_mesh
from .._ir.program import Program
from .tensor import Tensor
from .._types import DataType, Layout, MemorySpace, check_shape

__all__ = [
    "to_device",
    "to_host",
    "wait",
    "submit",
    "to_layout",
    "empty",
    "write",
    "deallocate",
]

# The fast path of `_core._dispatch` makes objects of these types and calls the C kernel.
_dispatch.bind(Storage, TensorState, ProgramCommand, Tensor, Binary, NO_DEPS, _pointwise.run,
               MemorySpace.L1)


_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_DTYPE_NAMES = {
    np.dtype(np.float32): "np.float32",
    _BFLOAT16: "ml_dtypes.bfloat16",
    np.dtype(np.int32): "np.int32",
    np.dtype(np.uint32): "np.uint32",
}


def _is_float(dtype: np.dtype[Any]) -> bool:
    return dtype.kind == "f" or dtype == _BFLOAT16


def _host_array(array: Any, dtype: DataType | None, what: str, convert: bool) -> np.ndarray[Any, Any]:
    """`array` checked for a tensor of `dtype` (None: the array's own dtype).

    The rule: the array's dtype must be `dtype.host_dtype` (float32 for BFLOAT8_B). When
    `convert` (to_device given a layout dtype) a float array may also go into a float dtype: it
    is rounded here, and a finite value that overflows to infinity is an error. Integers are
    never converted, nor floats to integers or back. BFLOAT8_B has no NaN or infinity. Every
    refusal is a LayoutError (dtype, values) or a ShapeError (0-d, empty), before anything is
    allocated or queued.
    """
    if isinstance(array, np.generic):
        array = np.asarray(array)  # a numpy scalar is a 0-d array: the shape check says so
    if not isinstance(array, np.ndarray):
        raise LayoutError(
            f"{what} takes a numpy array, got {type(array).__name__}; "
            "make one with np.asarray(data, dtype=np.float32) (or the dtype you want on the device)"
        )
    array = np.asarray(array)  # ndarray subclasses (np.matrix, memmap) as plain arrays
    if array.ndim == 0:
        raise ShapeError(f"{what}: 0-d arrays and numpy scalars are not supported: reshape to (1,) first")
    check_shape(array.shape)
    if dtype is None:
        if array.dtype not in _DTYPE_NAMES:
            hint = (" or pass a float layout, e.g. tt.Layout(dtype=tt.DataType.FLOAT32), to convert it"
                    if _is_float(array.dtype) else "")
            raise LayoutError(
                f"{what}: an array of dtype {array.dtype} has no device dtype: the device holds float32, "
                f"bfloat16 (ml_dtypes.bfloat16), int32 and uint32 arrays; convert with "
                f"array.astype(np.float32) (or np.int32){hint}"
            )
        return array
    host = dtype.host_dtype
    if array.dtype != host:
        if not (convert and dtype.is_float and _is_float(array.dtype)):
            if not convert:
                rule = f"write never converts: the tensor holds {dtype.name}, whose host arrays are {host}"
            elif dtype.is_float or _is_float(array.dtype):
                rule = "to_device converts only between float types"
            else:
                rule = f"integer arrays are not converted: {dtype.name} takes {host} arrays"
            raise LayoutError(
                f"{what}: cannot store an array of dtype {array.dtype} as {dtype.name}: {rule}; convert with "
                f"array.astype({_DTYPE_NAMES[host]}) first, checking that the values fit"
            )
        with np.errstate(over="ignore"):  # an overflow is reported below, not warned about
            converted = array.astype(host)
        overflow = np.isinf(converted) & np.isfinite(array)
        if overflow.any():
            index = int(np.flatnonzero(overflow.reshape(-1))[0])
            raise LayoutError(
                f"{what}: {array.reshape(-1)[index].item()!r} (flat index {index}) does not fit in "
                f"{dtype.name}: it would become infinity; scale or clip the array first"
            )
        array = converted
    if dtype is DataType.BFLOAT8_B and _bfp8.any_non_finite(array):
        index = int(np.flatnonzero(~np.isfinite(array.reshape(-1)))[0])
        raise LayoutError(
            f"{what}: BFLOAT8_B has no encoding for NaN or infinity (first at flat index {index}); "
            "replace them first (e.g. np.nan_to_num) or use a FLOAT32 or BFLOAT16 layout"
        )
    return array


def _check_tensor(tensor: Any, device: Device | None = None) -> Tensor:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"expected a ttflow Tensor, got {type(tensor).__name__}")
    tensor.check_usable()
    if device is not None and tensor.device is not device:
        raise ProgramError(
            f"a tensor of {tensor.device!r} was passed to {device!r}; "
            "copy it with to_host and to_device first"
        )
    return tensor


def to_device(array: Any, device: Device, layout: Layout | None = None) -> Tensor:
    """Starts copying a host array to the device (on CQ1); returns its device tensor at once.

    `array` must be a numpy array of a device dtype (float32, ml_dtypes.bfloat16, int32,
    uint32). A layout with a float dtype also takes any float array and rounds it now, as
    ttnn's `from_torch(dtype=...)` does; no other conversion is made (see docs/api.md).
    Otherwise the array is read when the copy runs: do not modify it until the tensor is ready.
    Default layout: DRAM, ROW_MAJOR, the array's dtype.
    """
    device.check_open()
    if layout is not None and not isinstance(layout, Layout):
        raise LayoutError(f"layout must be a tt.Layout, got {layout!r:.60}")
    layout = layout if layout is not None else Layout()
    array = _host_array(array, layout.dtype, "to_device", convert=True)
    layout = layout.resolve(layout.dtype or DataType.from_numpy(array.dtype))
    assert layout.dtype is not None
    return Tensor._wrap(device, device._scheduler.push(array, layout, tuple(array.shape)))


def empty(shape: Sequence[int], dtype: DataType, device: Device, layout: Layout | None = None) -> Tensor:
    """A zero-filled device tensor (a fixed place for `write` to fill, e.g. double buffers)."""
    device.check_open()
    shape = check_shape(shape)
    if not isinstance(dtype, DataType):
        raise LayoutError(
            f"dtype must be a tt.DataType, got {dtype!r:.60}; for a numpy dtype use tt.DataType.from_numpy"
        )
    if layout is not None and not isinstance(layout, Layout):
        raise LayoutError(f"layout must be a tt.Layout, got {layout!r:.60}")
    layout = (layout if layout is not None else Layout()).resolve(dtype)
    if layout.dtype is not dtype:
        raise LayoutError(f"layout dtype {layout.dtype} differs from dtype {dtype}")
    return Tensor._wrap(device, device._scheduler.push(None, layout, shape))


def write(tensor: Tensor, array: Any) -> None:
    """Queues a new value for `tensor` (on CQ1), after every queued program that reads the old one.

    `array` must be a numpy array of the tensor's shape and host dtype (`tensor.dtype.host_dtype`:
    float32 for BFLOAT8_B); nothing is converted. It is read when the write runs: do not modify
    it until the tensor is ready.
    """
    tensor = _check_tensor(tensor)
    array = _host_array(array, tensor.dtype, "write", convert=False)
    if tuple(array.shape) != tensor.shape:
        raise ShapeError(
            f"write: cannot write a {array.shape} array into a {tensor.shape} tensor; "
            "the shapes must be equal (reshape the array, or write into a tensor of its shape)"
        )
    tensor.device._scheduler.write(tensor._state, array)


async def to_host(tensor: Tensor) -> np.ndarray[Any, Any]:
    """Waits for the tensor and copies its value out (on CQ0); the device copy stays."""
    tensor = _check_tensor(tensor)
    command = tensor.device._scheduler.read(tensor._state)
    await command.wait()
    if command.error is not None:
        raise_stored(command.error)
    assert command.result is not None
    return command.result


async def wait(tensor: Tensor) -> None:
    """Waits for every queued write of the tensor; re-raises its producer's error."""
    if not isinstance(tensor, Tensor):
        raise TypeError(f"expected a ttflow Tensor, got {type(tensor).__name__}")
    await tensor


def to_layout(tensor: Tensor, layout: Layout, retain: bool | None = None) -> Tensor:
    """A new tensor holding the same value in `layout` (converted on CQ0).

    tt-mlir's `toLayout` rule: the result's retain is `retain`, or the source's when None; a
    result that is not retained consumes its source, which is deallocated once the conversion
    is queued (its memory comes back when the conversion has read it). ttflow's tensors start
    retained, so by default the source stays valid."""
    tensor = _check_tensor(tensor)
    if not isinstance(layout, Layout):
        raise LayoutError(f"layout must be a tt.Layout, got {layout!r}")
    if retain is not None and not isinstance(retain, (bool, np.bool_)):
        raise TypeError(f"retain is a bool or None, got {type(retain).__name__}")
    layout = layout.resolve(tensor.dtype)
    assert layout.dtype is not None
    device = tensor.device
    scheduler = device._scheduler
    keep = not tensor._state.unretained if retain is None else bool(retain)
    if not keep and scheduler.capturing is not None:
        raise TraceError(
            "tt.to_layout would consume its source (retain False) inside tt.capture_trace: every "
            "replay reads the source again; keep it retained for the capture"
        )
    result = Tensor._wrap(device, scheduler.to_layout(tensor._state, layout))
    if not keep:  # both unretained: the source's handle says why it went
        scheduler.set_retain(result._state, False)
        scheduler.set_retain(tensor._state, False)
        deallocate(tensor, force=True)
    return result


def deallocate(tensor: Tensor, force: bool = True) -> None:
    """Frees the tensor's device memory once the queued work that reads it is done; any later
    use of the tensor raises DeallocatedTensorError.

    With `force=False` this is tt-mlir's `deallocateTensor` (whose default it is): a tensor
    whose retain is True is left alone. ttflow's default, `force=True`, is ttnn's
    `ttnn.deallocate`: the tensor is freed whatever its retain, since ttflow's tensors start
    retained and `tt.deallocate(t)` must free. (tt-mlir's `force` frees a buffer other tensors
    still share; a ttflow tensor's storage has one owner, so that meaning has nothing to act on.)
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"expected a ttflow Tensor, got {type(tensor).__name__}")
    if tensor.device.closed:
        return
    if not force and not tensor._state.unretained:
        return
    scheduler = tensor.device._scheduler
    scheduler.deallocate(tensor._state)
    if scheduler.const_cache is not None:  # what was computed from it as a constant goes too
        scheduler.const_cache.forget(tensor._state)


def _check_dtype(tensor: Tensor, declared: DataType, index: int) -> None:
    if tensor.dtype is declared or (tensor.dtype.is_float and declared.is_float):
        return
    raise LayoutError(
        f"input {index} is {tensor.dtype.name} but the program declares {declared.name}; "
        "integer and float tensors are not converted implicitly: use tt.to_layout"
    )


def submit(device: Device, binary: Binary, program_index: int, inputs: Sequence[Tensor]) -> list[Tensor]:
    """Queues a program run on CQ0 and returns its output tensors at once (never blocks).

    Checked now: the program index, the input count, each input's device, liveness, shape and
    dtype. When the program starts, inputs in another layout are converted (and the conversion
    kept), L1 tensors it does not read move to DRAM, then it runs.
    """
    # The checks at a glance, in C (`_core._dispatch.submit`): any doubt goes through
    # `_submit_checked`, which says what is wrong.
    outputs = _dispatch.submit(device, binary, program_index, inputs)
    if outputs is not None:
        return outputs
    return _submit_checked(device, binary, program_index, inputs)


def _check_donation(program: Program, program_index: int, inputs: Sequence[Tensor], index: int) -> None:
    """A donated input must be passed once, and already be in the layout the program declares:
    made in it (wherever eviction moved it since) or holding a copy in it. Its buffer becomes
    the output's as it is, with no conversion."""
    state = inputs[index]._state
    for other, tensor in enumerate(inputs):
        if other != index and tensor._state is state:
            raise ProgramError(
                f"input {index} of {program.name!r} is donated, and the same tensor is input "
                f"{other} too; a donated buffer is overwritten, so pass it once"
            )
    layout = program.inputs[index].layout
    if state.declared != layout and state.find(layout) is None:  # its home, or a kept copy
        raise LayoutError(
            f"input {index} of {program.name!r} is donated but is {state.layout}, the program "
            f"declares {layout}; a donated buffer is not converted: make the tensor in that layout "
            f"(tt.to_device(array, device, tt.get_layout(binary, {program_index}, {index}))) or "
            "convert it first (tt.to_layout)"
        )


def _host_inputs(device: Device, program: Program, inputs: Sequence[Any]) -> list[Tensor]:
    """Host arrays given in tensors' places (tt-mlir's host tensors, which its runtime moves to
    the device for the program): each copied to the device in the layout the program declares
    for that input (`to_device`, on CQ1 ahead of the run), a tensor of its own that goes when
    the run no longer needs it. Every array is checked before any is copied."""
    specs = program.inputs
    for index, (value, spec) in enumerate(zip(inputs, specs)):
        if isinstance(value, np.ndarray) and value.shape != spec.shape:
            raise ShapeError(f"input {index} of {program.name!r} is a host array of shape {value.shape}, "
                             f"the program declares {spec.shape}")
    return [to_device(value, device, spec.layout) if isinstance(value, np.ndarray) else value
            for value, spec in zip(inputs, specs)]


def _submit_checked(device: Device, binary: Binary, program_index: int,
                    inputs: Sequence[Tensor], mesh_shape: tuple[int, int] = (1, 1),
                    peers: Any = None) -> list[Tensor]:
    """`submit` with every check said aloud; `mesh_shape`: the mesh whose chip `device` is
    (an SPMD submit's, `_mesh.collectives`), for which the program's collectives are resolved;
    `peers`: the chip's place in that submit's rendezvous, which the command carries from the
    moment it is queued (the one with the collectives: a constant part has none)."""
    device.check_open()
    if not isinstance(binary, Binary):
        raise ProgramError(f"expected a tt.Binary, got {type(binary).__name__}")
    programs = binary.programs
    if not 0 <= program_index < len(programs):
        raise ProgramError(
            f"program index {program_index} is out of range: the binary has {len(programs)} programs"
        )
    program: Program = programs[program_index]
    specs = program.inputs
    if len(inputs) != len(specs):
        raise ProgramError(
            f"program {program.name!r} takes {len(specs)} inputs, {len(inputs)} were given"
        )
    if any(isinstance(tensor, np.ndarray) for tensor in inputs):
        inputs = _host_inputs(device, program, inputs)
    for index, (tensor, spec) in enumerate(zip(inputs, specs)):
        _check_tensor(tensor, device)
        if tensor.shape != spec.shape:
            raise ShapeError(
                f"input {index} of {program.name!r} has shape {tensor.shape}, "
                f"the program declares {spec.shape}"
            )
        _check_dtype(tensor, spec.dtype, index)
    for _, index in program.donations:
        _check_donation(program, program_index, inputs, index)
    if program.host_ops and device.workers == "ray":
        raise RemoteMemoryError(
            f"{program.name!r} has host ops ({', '.join(label for _, label in program.host_ops)}): "
            "Python functions of this process, which do not travel to a Ray chip's actor; "
            'run it on a device with workers="thread" or "process"')
    scheduler = device._scheduler
    unretained = [tensor._state for tensor in inputs if tensor._state.unretained]
    if unretained and scheduler.capturing is not None:
        raise TraceError(
            f"an input of {program.name!r} has retain False, inside tt.capture_trace: every "
            "replay reads its inputs where the capture did, so a trace cannot deallocate one; "
            "set tensor.retain = True for the capture (tt.deallocate it after the trace's release)"
        )
    # A device is a 1x1 mesh: its collectives run as in a group of one chip (identities).
    program = for_mesh(program, mesh_shape)
    def run(program: Program, states: tuple[TensorState, ...]) -> tuple[TensorState, ...]:
        return scheduler.submit(program, states, peers=peers if program.has_collectives else None)
    states = None
    if program.consts or program.cache_constants:  # its constant cut, cached on the device (`_const_eval`)
        states = _const_eval.submit(device, program, inputs, run)
    if states is None:
        states = run(program, tuple(tensor._state for tensor in inputs))
    cache = scheduler.const_cache
    if cache is not None and (program.donations or unretained):  # consumed: cached results go
        for state in (*(inputs[i]._state for _, i in program.donations), *unretained):
            cache.forget(state)
    if unretained:  # the C path leaves these to this one (`_core._dispatch.submit`)
        scheduler.release_unretained(unretained)
    return [Tensor._wrap(device, state) for state in states]
