"""An ATen op the device lacks, as a host op inside the compiled program (issue 27's CPU hoisting).

Before, one op without a lowering sent its whole compiled graph to run eagerly, op by op. Now
the graph stays one program: the op becomes a `ProgramBuilder.host_op` step that the device's
queue runs on its worker thread, in queue order, on CPU torch tensors made from the values read
back from bank memory, and whose results are written back. The rest of the graph stays on the
device, and the CPU torch op computes what CPU torch computes, bit for bit.

This module is the function such a step calls: device host arrays in (FLOAT32 as float32,
BFLOAT16 as `ml_dtypes.bfloat16`, every integer and bool as INT32), torch tensors of the
graph's dtypes and shapes to the ATen op, its results back in the device's dtypes. An integer
result past INT32's range is an error (the device would hold it wrapped), never a wrong value.
Ops whose results are random (`nondeterministic_seeded`: they draw from the tt generator) are
not hosted: `hostable` says why not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .._errors import UnsupportedOpError

__all__ = ["Slot", "host_function", "hostable"]

Array = np.ndarray[Any, Any]
_INT32 = np.iinfo(np.int32)
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.layout, torch.memory_format)


class Slot:
    """Where a tensor argument goes among the op's flattened arguments."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def hostable(target: Any, leaves: Sequence[Any]) -> str | None:
    """Why `target` cannot run as a host op with these flattened arguments, or None."""
    if not isinstance(target, torch._ops.OpOverload):
        return f"{target!r:.40} is not an ATen op"
    if torch.Tag.nondeterministic_seeded in target.tags:
        return "its result is random (drawn from the tt generator on the device only)"
    for leaf in leaves:
        if not isinstance(leaf, (Slot, *_PLAIN, torch.device)) and not (
                isinstance(leaf, (list, tuple)) and all(isinstance(x, _PLAIN) for x in leaf)):
            return f"an argument is {type(leaf).__name__}, which a host op cannot take"
    return None


def _to_torch(array: Array, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A device value's host array as the graph's torch tensor (its shape and dtype)."""
    # Copied: the step's arrays are read-only views of what it read from bank memory.
    if array.dtype.kind == "i" or array.dtype.kind == "u":
        tensor = torch.from_numpy(np.array(array, np.int64))
        tensor = tensor != 0 if dtype == torch.bool else tensor.to(dtype)
    else:
        tensor = torch.from_numpy(np.array(array, np.float32)).to(dtype)
    return tensor.reshape(shape)


def _to_device(value: Any, shape: tuple[int, ...], ishape: tuple[int, ...], host_dtype: np.dtype[Any],
               what: str) -> Array:
    """A torch result as the device value's host array (checked against the graph's shape)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what} gave {type(value).__name__}, not a tensor")
    if tuple(value.shape) != shape:
        raise ValueError(f"{what} gave shape {tuple(value.shape)}, the graph says {shape}")
    value = value.detach().to("cpu")
    if value.dtype.is_floating_point or value.dtype.is_complex:
        out = value.to(torch.float32).contiguous().numpy().astype(host_dtype)
    else:
        wide = value.to(torch.int64).contiguous().numpy()
        if wide.size and (wide.min() < _INT32.min or wide.max() > _INT32.max):
            raise OverflowError(f"{what} gave an integer past INT32's range, which the device "
                                "holds its integers in (it would wrap)")
        out = wide.astype(host_dtype)
    return out.reshape(ishape)


def host_function(target: Any, leaves: Sequence[Any], rebuild: Callable[[list[Any]], tuple[Any, Any]],
                  inputs: Sequence[tuple[tuple[int, ...], torch.dtype]],
                  outputs: Sequence[tuple[tuple[int, ...], tuple[int, ...], np.dtype[Any]]],
                  multiple: bool) -> Callable[..., tuple[Array, ...]]:
    """The function a host-op step calls: `target` on the inputs (`inputs`: each one's torch
    shape and dtype), `leaves` the flattened arguments with a `Slot` per tensor and `rebuild`
    their structure; `outputs`: each result's torch shape, program shape and host dtype."""
    name = str(target)
    for leaf in leaves:
        if isinstance(leaf, Slot) and not 0 <= leaf.index < len(inputs):  # pragma: no cover
            raise UnsupportedOpError(f"{name}: a tensor argument with no input")

    def call(*arrays: Array) -> tuple[Array, ...]:
        tensors = [_to_torch(a, shape, dtype) for a, (shape, dtype) in zip(arrays, inputs)]
        filled = [tensors[leaf.index] if isinstance(leaf, Slot)
                  else torch.device("cpu") if isinstance(leaf, torch.device) else leaf for leaf in leaves]
        args, kwargs = rebuild(filled)
        with torch.no_grad():
            result = target(*args, **kwargs)
        results = tuple(result) if multiple else (result,)
        if len(results) != len(outputs):
            raise ValueError(f"{name} gave {len(results)} results, the graph says {len(outputs)}")
        return tuple(_to_device(r, shape, ishape, dtype, name)
                     for r, (shape, ishape, dtype) in zip(results, outputs))

    call.__name__ = name
    return call
