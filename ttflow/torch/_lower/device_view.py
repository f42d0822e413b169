"""The device's view of torch tensors: which dtype and shape a torch tensor has on the device,
and the specs of a lowered program's inputs and outputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

import ttflow as tt
from ttflow._types import least_padded_shape

from .._errors import UnsupportedOpError

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


# -- the device's view of torch tensors --------------------------------------------------------------

_DTYPES = {
    torch.float32: tt.DataType.FLOAT32, torch.bfloat16: tt.DataType.BFLOAT16,
    torch.int64: _I32, torch.int32: _I32, torch.int16: _I32, torch.int8: _I32, torch.uint8: _I32,
    torch.bool: _I32,
}


def device_dtype(dtype: torch.dtype) -> tt.DataType:
    """The device dtype a torch dtype lives in: float32 and bfloat16 as themselves, every
    integer type and bool as INT32 (bool as 1/0; int64 results are range-checked, not wrapped)."""
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):
        raise UnsupportedOpError(
            f"{dtype} has no tt device dtype (float32, bfloat16, integers and bool do); "
            "convert the tensor first, e.g. .float()"
        ) from None


_device_shapes: dict[tuple[int, ...], tuple[int, ...]] = {}


def device_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The device shape of a torch shape: rank 0 -> (1, 1), rank 1 (n,) -> (1, n) (a tile needs
    two dims), rank 2 the same; rank 3 and more the same unless tiles would pad it to more than
    twice its size, then the 2-D split of its dims that pads least (`_device_shape`)."""
    try:
        known = _device_shapes.get(shape)  # type: ignore[call-overload]  # a Size or tuple of ints
    except TypeError:  # a list, or a symbolic size (unhashable)
        known = None
    if known is not None:
        return known
    dims = _static(shape, "a tensor")
    result = _device_shape(dims)
    if len(_device_shapes) < 4096 and all(type(d) is int for d in shape):
        _device_shapes[tuple(shape)] = result
    return result


def _device_shape(dims: tuple[int, ...]) -> tuple[int, ...]:
    if len(dims) == 0:
        return (1, 1)
    if len(dims) == 1:
        return (1, dims[0])
    if len(dims) == 2:
        return dims  # torch's 2-D tensors are the device's 2-D tensors (a rank-1 one's (1, n) too)
    # Tiles pad the last two dims to 32: a conv weight's 3x3 kernel would take a whole 32x32
    # tile (113x its bytes), NCHW activations' small trailing dims likewise. Such a tensor lives
    # as the 2-D split of its dims that pads least, as a program's scratch does (ttnn flattens
    # conv weights and activations too); programs reshape it to its torch shape inside.
    return least_padded_shape(dims)


def _static(shape: Sequence[Any], what: str) -> tuple[int, ...]:
    dims = []
    for d in shape:
        if not isinstance(d, int):
            try:
                d = int(d)  # a SymInt with a hint would pass here; a static graph has plain ints
            except (TypeError, ValueError, RuntimeError):
                raise UnsupportedOpError(
                    f"{what} has a symbolic shape {tuple(shape)}; tt programs have static shapes "
                    "(torch.compile(..., dynamic=False))"
                ) from None
            if not isinstance(d, int):
                raise UnsupportedOpError(f"{what} has a symbolic shape {tuple(shape)}")
        dims.append(d)
    return tuple(dims)


def _layout(dtype: tt.DataType) -> tt.Layout:
    return tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, dtype)


@attrs.frozen
class InputSpec:
    """One program input: a graph placeholder's torch shape and dtype, and how it lives on the
    device (`layout` is DRAM TILE in `device_dtype`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device_shape: tuple[int, ...]
    device_dtype: tt.DataType

    @property
    def layout(self) -> tt.Layout:
        return _layout(self.device_dtype)

    @property
    def empty(self) -> bool:
        """A zero-element input: it has no elements to pass, so it is not a program input
        (callers skip it), and the program sees only its shape."""
        return 0 in self.shape


@attrs.frozen
class OutputSpec:
    """One graph output. `kind` "program": the program's output `index`; "input": the graph
    returns its input `index` unchanged (nothing is emitted); "empty": a zero-element tensor
    (no program output: the caller makes an empty tensor of `shape`, `index` is -1); "none":
    the graph returns None (`index` is -1). `shape` and `dtype` are torch's (for "none": ()
    and None).

    `placeholder`: the program gives a stand-in, not torch's value: max-pool indices are -1
    everywhere, because the lowered backward reads the pooled input instead of them. Such an
    output may be handed to the backward program, never to the user."""

    kind: str = attrs.field(validator=attrs.validators.in_(("program", "input", "empty", "none")))
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    placeholder: bool = False

    @property
    def device_shape(self) -> tuple[int, ...]:
        return device_shape(self.shape)


@attrs.frozen
class Lowered:
    """A lowered graph: one program (index 0 of `binary`), its inputs (one per placeholder, in
    order, the empty ones not passed (`InputSpec.empty`), then `seeds` trailing (1, 1) INT32
    seeds the caller draws per call, one per random op), and what each graph output is."""

    binary: tt.Binary
    inputs: tuple[InputSpec, ...]
    seeds: int
    outputs: tuple[OutputSpec, ...]
    hosted: tuple[str, ...] = ()
    """The warnings of the ops it runs as host ops (`host.py`), one per op: the compiler gives
    them each time it uses the program, a lowering kept in its cache included."""

    @property
    def seed_layout(self) -> tt.Layout:
        return _layout(_I32)

    def check_user_outputs(self, count: int) -> None:
        """Refuses a stand-in output (max-pool indices, `OutputSpec.placeholder`) among the
        first `count` outputs, the ones the user gets: only a backward may read those."""
        for spec in self.outputs[:count]:
            if spec.placeholder:
                raise UnsupportedOpError(
                    "max-pool indices returned to the caller: the device's max-pool backward reads "
                    "the pooled input, so its forward makes no indices (they run on the CPU)")

def _value_dtype(dtype: torch.dtype, shape: Sequence[int]) -> tt.DataType:
    """The device dtype a value inside a program is held in: `device_dtype`, except that a 0-d
    float64 (a Python float argument, and the casts torch wraps around it) is held in FLOAT32."""
    if dtype == torch.float64 and len(shape) == 0:
        return _F32
    return device_dtype(dtype)
