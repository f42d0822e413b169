"""Small frozen value types: data types, memory spaces, layouts and device specs.

A bad value cannot exist: validators reject it when it is made, so code further down never has to
ask again whether a `Layout` or a `DeviceSpec` makes sense.
"""

from __future__ import annotations

import enum
import functools
import math
import operator
from collections.abc import Sequence
from typing import Any, final

import attrs
import ml_dtypes
import numpy as np

from ._errors import LayoutError, ShapeError

__all__ = [
    "TILE",
    "FACE",
    "DataType",
    "MemorySpace",
    "TensorLayout",
    "Layout",
    "DeviceSpec",
    "storage_geometry",
    "check_shape",
]

TILE = 32
"""Tile edge in elements: TILE-layout tensors are cut into TILE x TILE tiles."""
FACE = 16
"""Face edge in elements: a tile is stored as four FACE x FACE faces."""


class DataType(enum.Enum):
    """Element types a device tensor can hold."""

    # Members are singletons: identity hashing is exact and runs in C (Enum's own is Python).
    __hash__ = object.__hash__

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    BFLOAT8_B = "bfloat8_b"
    UINT32 = "uint32"
    INT32 = "int32"

    @property
    def host_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of host arrays of this type (BFLOAT8_B reads back as float32)."""
        return _HOST_DTYPES[self]

    @property
    def tile_bytes(self) -> int:
        """Bytes of one 32x32 tile in bank memory."""
        return _TILE_BYTES[self]

    @property
    def itemsize(self) -> int:
        """Bytes of one element in ROW_MAJOR layout (BFLOAT8_B has none: it is tile-only)."""
        if self is DataType.BFLOAT8_B:
            raise LayoutError("BFLOAT8_B has no per-element size: it exists only in TILE layout")
        return self.host_dtype.itemsize

    @property
    def is_float(self) -> bool:
        return self in (DataType.FLOAT32, DataType.BFLOAT16, DataType.BFLOAT8_B)

    @classmethod
    def from_numpy(cls, dtype: Any) -> DataType:
        """The device type for a host dtype; LayoutError for types the device cannot hold."""
        dt = np.dtype(dtype)
        for member, host in _NATIVE_DTYPES.items():
            if dt == host:
                return member
        raise LayoutError(
            f"unsupported dtype {dt}: the device holds float32, bfloat16 (ml_dtypes.bfloat16), "
            "uint32 and int32 arrays; convert the array with .astype() first"
        )

    def __repr__(self) -> str:
        return f"DataType.{self.name}"


_NATIVE_DTYPES: dict[DataType, np.dtype[Any]] = {
    DataType.FLOAT32: np.dtype(np.float32),
    DataType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.INT32: np.dtype(np.int32),
}
_HOST_DTYPES = {**_NATIVE_DTYPES, DataType.BFLOAT8_B: np.dtype(np.float32)}
_TILE_BYTES = {
    DataType.FLOAT32: 4096,
    DataType.BFLOAT16: 2048,
    DataType.BFLOAT8_B: 1088,
    DataType.UINT32: 4096,
    DataType.INT32: 4096,
}


class MemorySpace(enum.Enum):
    """Where a buffer lives: DRAM banks, or the L1 SRAM of the worker cores."""

    # Members are singletons: identity hashing is exact and runs in C (Enum's own is Python).
    __hash__ = object.__hash__

    DRAM = "dram"
    L1 = "l1"

    def __repr__(self) -> str:
        return f"MemorySpace.{self.name}"

    def __str__(self) -> str:
        return self.name


class TensorLayout(enum.Enum):
    """How elements are laid out in pages: one row per page, or one 32x32 tile per page."""

    # Members are singletons: identity hashing is exact and runs in C (Enum's own is Python).
    __hash__ = object.__hash__

    ROW_MAJOR = "row_major"
    TILE = "tile"

    def __repr__(self) -> str:
        return f"TensorLayout.{self.name}"


def _check_layout(instance: Layout, attribute: attrs.Attribute[Any], value: Any) -> None:
    if instance.dtype is DataType.BFLOAT8_B and instance.tensor_layout is not TensorLayout.TILE:
        raise LayoutError("BFLOAT8_B exists only in TILE layout; ask for TensorLayout.TILE")


@final
@attrs.frozen
class Layout:
    """Where and how a tensor is stored. `dtype=None` keeps the tensor's own dtype."""

    memory: MemorySpace = attrs.field(
        default=MemorySpace.DRAM, validator=attrs.validators.instance_of(MemorySpace)
    )
    tensor_layout: TensorLayout = attrs.field(
        default=TensorLayout.ROW_MAJOR, validator=attrs.validators.instance_of(TensorLayout)
    )
    dtype: DataType | None = attrs.field(
        default=None,
        validator=[attrs.validators.optional(attrs.validators.instance_of(DataType)), _check_layout],
    )

    def resolve(self, dtype: DataType) -> Layout:
        """This layout with `dtype=None` replaced by the tensor's dtype."""
        if self.dtype is not None:
            return self
        return attrs.evolve(self, dtype=dtype)


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"DeviceSpec.{attribute.name} must be a positive int, got {value!r}")


def _power_of_two(instance: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    _positive(instance, attribute, value)
    if value & (value - 1):
        raise ValueError(f"DeviceSpec.{attribute.name} must be a power of two, got {value}")


def _to_grid(value: Any) -> tuple[int, int]:
    return tuple(value)  # type: ignore[return-value]  # the validator checks the length


def _grid(instance: Any, attribute: attrs.Attribute[Any], value: tuple[int, int]) -> None:
    if len(value) != 2 or any(not isinstance(v, int) or v <= 0 for v in value):
        raise ValueError(f"DeviceSpec.worker_grid must be two positive ints, got {value!r}")


@final
@attrs.frozen
class DeviceSpec:
    """The shape of an emulated device. Use a preset, or `attrs.evolve` one to change a field."""

    name: str = "wormhole_n150"
    worker_grid: tuple[int, int] = attrs.field(default=(8, 8), converter=_to_grid, validator=_grid)
    l1_bank_bytes: int = attrs.field(default=1_499_136, validator=_positive)
    dram_banks: int = attrs.field(default=12, validator=_positive)
    dram_bank_bytes: int = attrs.field(default=1 << 30, validator=_positive)
    dram_alignment: int = attrs.field(default=32, validator=_power_of_two)
    l1_alignment: int = attrs.field(default=16, validator=_power_of_two)

    @property
    def l1_banks(self) -> int:
        """One L1 bank per worker core."""
        return self.worker_grid[0] * self.worker_grid[1]

    def banks(self, space: MemorySpace) -> int:
        return self.dram_banks if space is MemorySpace.DRAM else self.l1_banks

    def bank_bytes(self, space: MemorySpace) -> int:
        return self.dram_bank_bytes if space is MemorySpace.DRAM else self.l1_bank_bytes

    def alignment(self, space: MemorySpace) -> int:
        return self.dram_alignment if space is MemorySpace.DRAM else self.l1_alignment

    @classmethod
    def wormhole_n150(cls) -> DeviceSpec:
        return cls()

    @classmethod
    def blackhole_p150(cls) -> DeviceSpec:
        return cls(
            name="blackhole_p150",
            worker_grid=(10, 13),
            l1_bank_bytes=1_572_864,
            dram_banks=8,
            dram_bank_bytes=4_278_190_080,
            dram_alignment=64,
        )

    @classmethod
    def small(cls) -> DeviceSpec:
        """A tiny device for tests: small enough that running out of memory is easy."""
        return cls(
            name="small",
            worker_grid=(2, 2),
            l1_bank_bytes=64 * 1024,
            dram_banks=4,
            dram_bank_bytes=16 * 1024 * 1024,
        )


def check_shape(shape: Any) -> tuple[int, ...]:
    """A tensor shape as a tuple of positive Python ints.

    Each dim must be an integer: a Python int or a numpy integer (anything `operator.index`
    takes). A float is refused even when it is integral (`2.0`): a float dim is a mistake
    upstream (a `/` where `//` was meant), and truncating it would hide it. Bools, NaN and
    infinities are refused too. ShapeError for those, for 0-d shapes and for dims below 1.
    """
    try:
        items = tuple(shape)
    except TypeError:
        hint = f"; for one dim write ({shape!r:.20},)" if isinstance(shape, (int, np.integer)) else ""
        raise ShapeError(f"a shape is a sequence of ints, got {shape!r:.60}{hint}") from None
    dims = []
    for d in items:
        if isinstance(d, (bool, np.bool_)):
            raise ShapeError(f"a shape's dims are ints, got the bool {d!r} in {items!r:.80}")
        try:
            dims.append(operator.index(d))
        except TypeError:
            finite_float = isinstance(d, (float, np.floating)) and math.isfinite(d)
            hint = "; use // for integer division, or int()" if finite_float else ""
            raise ShapeError(
                f"a shape's dims are ints, got {d!r:.40} ({type(d).__name__}) in {items!r:.80}{hint}"
            ) from None
    if not dims:
        raise ShapeError("0-d tensors are not supported: reshape to (1,) first")
    if any(d <= 0 for d in dims):
        raise ShapeError(f"every dimension must be positive, got shape {tuple(dims)}")
    return tuple(dims)


@functools.lru_cache(maxsize=4096)
def storage_geometry(
    shape: tuple[int, ...], dtype: DataType, tensor_layout: TensorLayout
) -> tuple[int, int]:
    """(page_size, num_pages) of a tensor: one page per tile, or one per row of the last dim."""
    *outer, width = shape
    if tensor_layout is TensorLayout.TILE:
        height = outer.pop() if outer else 1
        tiles = -(-height // TILE) * -(-width // TILE) * math.prod(outer)  # exact for any int
        return dtype.tile_bytes, tiles
    if dtype is DataType.BFLOAT8_B:
        raise LayoutError("BFLOAT8_B exists only in TILE layout; ask for TensorLayout.TILE")
    return width * dtype.itemsize, math.prod(outer)


def tiled_elements(shape: Sequence[int]) -> int:
    """Elements a TILE layout holds for `shape` (rank 2 or more): the last two dims padded to 32."""
    rows, cols = shape[-2], shape[-1]
    return math.prod(shape[:-2]) * -(-rows // TILE) * TILE * -(-cols // TILE) * TILE


@functools.lru_cache(maxsize=4096)
def least_padded_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape to store a value of `shape` in TILE layout with: itself, unless tiles would pad
    it to more than twice its size; then the 2-D [rows, cols] view of its elements that pads
    least: a split between two of its dims, or all its elements as rows of a multiple of 32
    (a 1-D value of 20,000 elements as 625 x 32, not one row padded to 32).

    Tiles pad the last two dims to 32: an NCHW activation of 8x8 (or a 3x3 conv kernel) would
    fill a 32x32 tile with 16 (113) times its bytes. ttnn flattens such tensors (convolution
    activations to [1, 1, N*H*W, C]); the element order is the same, so a value stored this way
    reads back as itself."""
    dims = (1, *shape) if len(shape) == 1 else shape
    if len(dims) < 2 or tiled_elements(dims) <= 2 * math.prod(dims):
        return shape
    count = math.prod(dims)
    splits = [(math.prod(dims[:k]), math.prod(dims[k:])) for k in range(1, len(dims))]
    splits += [(count // cols, cols) for cols in range(TILE, min(count, 64 * TILE) + 1, TILE) if count % cols == 0]
    best = min(splits, key=tiled_elements)  # the first of the least padded: a split of dims first
    return best if tiled_elements(best) < tiled_elements(dims) else shape
