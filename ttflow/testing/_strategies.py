"""Hypothesis strategies for ttflow's value types, host arrays and programs.

Every strategy draws only valid values: a `Layout` never pairs BFLOAT8_B with ROW_MAJOR, an
array's elements are finite and in a range where every dtype behaves (no overflow to infinity in
BFLOAT16, no subnormals that BFLOAT8_B flushes), a program only combines values whose shapes
meet. They shrink toward small shapes, DRAM, ROW_MAJOR, FLOAT32 and zeros.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, final

import attrs
import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as npst

from .._ir.binary import Binary
from .._ir.program import Program
from .._ir.builder import ProgramBuilder
from .._types import DataType, DeviceSpec, Layout, MemorySpace, TensorLayout
from ._reference import storage_geometry

__all__ = [
    "ProgramCase",
    "arrays",
    "arrays_for",
    "binaries",
    "device_specs",
    "dtypes",
    "layouts",
    "program_cases",
    "programs",
    "shapes",
]

Array = np.ndarray[Any, Any]

FLOAT_MAGNITUDE = (2.0**-20, 256.0)
"""Nonzero float elements have magnitudes in this range: exact in float32, normal in BFLOAT16,
far from BFLOAT8_B's flush-to-zero, and sums and products of a few of them stay finite."""
INT_RANGE = {DataType.INT32: (-(2**20), 2**20), DataType.UINT32: (0, 2**20)}
"""Integer elements: small enough that a chain of additions stays far from wrapping."""

_SMALL_ARRAY = 64
"""Up to this many elements, arrays are drawn element by element; larger ones repeat a drawn
pattern of up to this many elements, or come from a seeded generator (drawing thousands of
elements one by one through hypothesis takes tens of milliseconds per array)."""


def device_specs(
    *,
    max_grid: int = 3,
    l1_bank_bytes: tuple[int, int] = (32 * 1024, 256 * 1024),
    dram_banks: tuple[int, int] = (1, 8),
    dram_bank_bytes: tuple[int, int] = (1 << 20, 8 << 20),
) -> st.SearchStrategy[DeviceSpec]:
    """Small valid `DeviceSpec`s: a worker grid up to `max_grid` x `max_grid`, L1 banks and DRAM
    banks in the given byte ranges (multiples of 1 KiB), alignments 16-64 (L1) and 32-128 (DRAM).

    Bank memory is committed lazily, so even the largest costs no memory until it is written.
    """
    kib = st.integers
    return st.builds(
        DeviceSpec,
        name=st.just("hypothesis"),
        worker_grid=st.tuples(st.integers(1, max_grid), st.integers(1, max_grid)),
        l1_bank_bytes=kib(l1_bank_bytes[0] // 1024, l1_bank_bytes[1] // 1024).map(lambda k: k * 1024),
        dram_banks=st.integers(*dram_banks),
        dram_bank_bytes=kib(dram_bank_bytes[0] // 1024, dram_bank_bytes[1] // 1024).map(
            lambda k: k * 1024
        ),
        dram_alignment=st.sampled_from([32, 64, 128]),
        l1_alignment=st.sampled_from([16, 32, 64]),
    )


def dtypes(*, floats: bool = True, integers: bool = True) -> st.SearchStrategy[DataType]:
    """Device data types (FLOAT32 first: it shrinks there)."""
    chosen = [d for d in DataType if (d.is_float and floats) or (not d.is_float and integers)]
    if not chosen:
        raise ValueError("dtypes() needs floats or integers")
    return st.sampled_from(chosen)


def layouts(
    dtype: DataType | None = None,
    *,
    memory: MemorySpace | None = None,
    tensor_layout: TensorLayout | None = None,
    keep_dtype: bool = False,
) -> st.SearchStrategy[Layout]:
    """Valid `Layout`s; BFLOAT8_B only with TILE.

    `dtype`, `memory`, `tensor_layout`: fix that field (None draws it). With `keep_dtype`, the
    layout's dtype is None ("keep the tensor's dtype", as `to_layout` and program inputs take
    it) instead of a drawn or given one.
    """
    if dtype is DataType.BFLOAT8_B and tensor_layout is TensorLayout.ROW_MAJOR and not keep_dtype:
        raise ValueError("BFLOAT8_B exists only in TILE layout")
    return _layouts(dtype, memory, tensor_layout, keep_dtype)


@functools.lru_cache(maxsize=None)
def _layouts(
    dtype: DataType | None, memory: MemorySpace | None, tensor_layout: TensorLayout | None,
    keep_dtype: bool,
) -> st.SearchStrategy[Layout]:
    # One sampled_from over every valid combination: ten times cheaper to draw than a flatmap,
    # and it shrinks to the first (DRAM, ROW_MAJOR, FLOAT32).
    choices = [
        Layout(m, tl, None if keep_dtype else d)
        for d in ([dtype] if dtype is not None or keep_dtype else list(DataType))
        for m in ([memory] if memory is not None else list(MemorySpace))
        for tl in ([tensor_layout] if tensor_layout is not None else list(TensorLayout))
        if keep_dtype or not (d is DataType.BFLOAT8_B and tl is TensorLayout.ROW_MAJOR)
    ]
    return st.sampled_from(list(dict.fromkeys(choices)))


def shapes(*, min_dims: int = 1, max_dims: int = 3, max_side: int = 70) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes: every dim in [1, max_side] (tiles are padded: 33 and 70 are interesting)."""
    return st.lists(st.integers(1, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def _float_elements() -> st.SearchStrategy[float]:
    low, high = FLOAT_MAGNITUDE
    return st.one_of(
        st.just(0.0),
        st.floats(low, high, width=32),
        st.floats(-high, -low, width=32),
    )


def _seeded_floats(seed: int, shape: tuple[int, ...]) -> Array:
    rng = np.random.default_rng(seed)
    low, high = (int(np.log2(b)) for b in FLOAT_MAGNITUDE)
    scale = np.exp2(rng.integers(low, high, shape)) if rng.integers(2) else 2.0 ** rng.integers(-4, 4)
    values = rng.uniform(-1.0, 1.0, shape) * scale
    values[rng.uniform(size=shape) < rng.uniform(0, 0.3)] = 0.0  # some zeros
    values = np.clip(values, -FLOAT_MAGNITUDE[1], FLOAT_MAGNITUDE[1]).astype(np.float32)
    values[np.abs(values) < FLOAT_MAGNITUDE[0]] = 0.0
    return values


def _seeded_ints(seed: int, shape: tuple[int, ...], low: int, high: int) -> Array:
    return np.random.default_rng(seed).integers(low, high, shape, endpoint=True)


def arrays(
    dtype: DataType, shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]]
) -> st.SearchStrategy[Array]:
    """Host arrays that a `dtype` tensor takes: `dtype.host_dtype` (float32 for BFLOAT8_B,
    `ml_dtypes.bfloat16` for BFLOAT16), finite, and within `FLOAT_MAGNITUDE` / `INT_RANGE`.

    Small arrays are drawn element by element; larger ones repeat a drawn pattern (both shrink
    to zeros) or come from a seeded generator with varied magnitudes per row, which exercises
    BFLOAT8_B's shared exponents and every tile of a large tensor.
    """
    if isinstance(shape, st.SearchStrategy):
        return shape.flatmap(lambda s: arrays(dtype, s))
    return _arrays(dtype, tuple(int(d) for d in shape))


@functools.lru_cache(maxsize=256)
def _arrays(dtype: DataType, shape: tuple[int, ...]) -> st.SearchStrategy[Array]:
    size = int(np.prod(shape))
    elements: st.SearchStrategy[Any]
    host: np.dtype[Any]
    if dtype.is_float:
        elements, host = _float_elements(), np.dtype(np.float32)
        seeded = st.integers(0, 2**32 - 1).map(lambda seed: _seeded_floats(seed, shape))
    else:
        low, high = INT_RANGE[dtype]
        elements, host = st.integers(low, high), np.dtype(np.int64)
        seeded = st.integers(0, 2**32 - 1).map(lambda seed: _seeded_ints(seed, shape, low, high))
    strategy: st.SearchStrategy[Array]
    if size <= _SMALL_ARRAY:
        strategy = npst.arrays(host, shape, elements=elements)
    else:
        # A short drawn pattern repeated over the array (shrinks to zeros), or seeded values.
        pattern = st.lists(elements, min_size=1, max_size=_SMALL_ARRAY).map(
            lambda values: np.resize(np.asarray(values, host), shape)
        )
        strategy = pattern | seeded
    if dtype is DataType.BFLOAT16:
        return strategy.map(lambda a: a.astype(ml_dtypes.bfloat16))
    return strategy.map(lambda a: a.astype(dtype.host_dtype))


def arrays_for(layout: Layout, shape: tuple[int, ...] | st.SearchStrategy[tuple[int, ...]]) -> st.SearchStrategy[Array]:
    """Host arrays for a tensor in `layout` (its dtype must be set): `arrays(layout.dtype, shape)`."""
    if layout.dtype is None:
        raise ValueError("arrays_for needs a layout with its dtype set; use Layout.resolve")
    return arrays(layout.dtype, shape)


# -- random programs ---------------------------------------------------------------------------


@final
@attrs.frozen(eq=False)
class ProgramCase:
    """A random program, host inputs for it, and its outputs computed here with plain numpy.

    The reference runs in float32 without the device's per-step storage rounding, so compare
    with `check` (relative and absolute tolerances), not bit for bit.
    """

    program: Program
    inputs: tuple[Array, ...]
    expected: tuple[Array, ...]
    rtol: float = 2e-5
    atol: float = 2e-4

    def check(self, outputs: Sequence[Any]) -> None:
        """Asserts that `outputs` (e.g. the `to_host` of each output tensor) match `expected`."""
        assert len(outputs) == len(self.expected), f"{len(outputs)} outputs, expected {len(self.expected)}"
        for k, (got, want) in enumerate(zip(outputs, self.expected)):
            got = np.asarray(got)
            assert got.shape == want.shape, f"output {k}: shape {got.shape}, expected {want.shape}"
            np.testing.assert_allclose(got.astype(np.float32), want, rtol=self.rtol, atol=self.atol,
                                       err_msg=f"output {k} of {self.program.name!r}")


_OPS = ["add", "sub", "mul", "add_s", "mul_s", "relu", "neg", "exp", "transpose", "sum",
        "softmax", "gram", "reshape"]
_FLOAT_LAYOUTS = [Layout(m, tl) for m in MemorySpace for tl in TensorLayout]


@st.composite
def program_cases(
    draw: st.DrawFn,
    *,
    max_side: int = 40,
    max_inputs: int = 3,
    max_steps: int = 6,
    max_outputs: int = 3,
    spec: DeviceSpec | None = None,
    name: str = "random",
) -> ProgramCase:
    """A random float32 program (built with `tt.ProgramBuilder`), inputs and expected outputs.

    Inputs are (h, w) with sides up to `max_side`, each declared in a random layout; the steps
    combine elementwise ops with tensors and scalars, relu, neg, exp, transpose, sum, softmax,
    a Gram matrix (matmul) and a reshape. Outputs go to L1 only when they take at most an
    eighth of an L1 bank of `spec` (default: `DeviceSpec.small()`), so a run on a fresh device
    never runs out of memory.
    """
    spec = spec if spec is not None else DeviceSpec.small()
    h, w = draw(st.integers(1, max_side), label="h"), draw(st.integers(1, max_side), label="w")
    rng = np.random.default_rng(draw(st.integers(0, 2**16), label="seed"))
    b = ProgramBuilder(name)
    values: list[tuple[Any, Array]] = []
    inputs = []
    for _ in range(draw(st.integers(1, max_inputs))):
        x = rng.uniform(-2, 2, (h, w)).astype(np.float32)
        inputs.append(x)
        values.append((b.input((h, w), draw(st.sampled_from(_FLOAT_LAYOUTS))), x))
    for _ in range(draw(st.integers(1, max_steps))):
        v, ref = values[draw(st.integers(0, len(values) - 1))]
        same = [(u, a) for u, a in values if u.shape == v.shape]
        op = draw(st.sampled_from(_OPS))
        out: tuple[Any, Array]
        if op in ("add", "sub", "mul"):
            u, other = same[draw(st.integers(0, len(same) - 1))]
            ufunc = {"add": np.add, "sub": np.subtract, "mul": np.multiply}[op]
            out = (getattr(b, op)(v, u), ufunc(ref, other))
        elif op in ("add_s", "mul_s"):
            c = draw(st.sampled_from([0.5, -1.25, 3.0]))
            out = (b.add(v, c), ref + np.float32(c)) if op == "add_s" else (b.mul(v, c), ref * np.float32(c))
        elif op == "relu":
            out = (b.relu(v), np.maximum(ref, 0))
        elif op == "neg":
            out = (b.neg(v), -ref)
        elif op == "exp":
            out = (b.exp(b.mul(v, 0.0)), np.exp(ref * np.float32(0.0)))
        elif op == "transpose":
            out = (b.transpose(v), ref.T)
        elif op == "sum":
            axis = draw(st.sampled_from([0, 1, -1]))
            out = (b.sum(v, axis), ref.sum(axis, keepdims=True, dtype=np.float32))
        elif op == "softmax":
            e = np.exp(ref - ref.max(-1, keepdims=True))
            out = (b.softmax(v), e / e.sum(-1, keepdims=True))
        elif op == "gram":
            out = (b.matmul(v, b.transpose(v)), ref @ ref.T)
        elif v.shape[0] * v.shape[1] <= max_side * max_side:
            out = (b.reshape(v, (v.shape[0] * v.shape[1], 1)), ref.reshape(-1, 1))
        else:  # a column of a Gram matrix's every element: 16 MiB a bank, more than the device's DRAM
            out = (b.relu(v), np.maximum(ref, 0))
        values.append(out)
    chosen = draw(st.lists(st.integers(0, len(values) - 1), min_size=1, max_size=max_outputs))
    expected = []
    for i in chosen:
        shape = tuple(values[i][1].shape)
        fits = [
            layout for layout in _FLOAT_LAYOUTS
            if layout.memory is MemorySpace.DRAM
            or storage_geometry(shape, layout.resolve(DataType.FLOAT32), spec).depth
            <= spec.l1_bank_bytes // 8
        ]
        b.output(values[i][0], draw(st.sampled_from(fits)))
        expected.append(values[i][1].astype(np.float32))
    return ProgramCase(b.build(), tuple(inputs), tuple(expected))


def programs(**kwargs: Any) -> st.SearchStrategy[Program]:
    """Random valid programs: the `program` of `program_cases(**kwargs)`."""
    return program_cases(**kwargs).map(lambda case: case.program)


def binaries(*, max_programs: int = 3, **kwargs: Any) -> st.SearchStrategy[Binary]:
    """A `tt.Binary` of 1 to `max_programs` random programs (`programs(**kwargs)`)."""
    return st.lists(programs(**kwargs), min_size=1, max_size=max_programs).map(Binary)
