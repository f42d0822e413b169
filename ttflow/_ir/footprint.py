"""A program's L1 footprint: the circular buffers its ops need on each core while it runs.

tt-metal sizes an op's circular buffers from its tile counts when it builds the op's program and
places them at the bottom of each core's L1, below every L1 buffer (which the allocator places
top-down). The rules here follow tt-metal's program factories, in tiles of each value's dtype:

- eltwise ops (unary, binary, ternary) and data movement: two tiles per input and two for the
  output, double-buffered (`eltwise_binary_program_factory`, `copy`, `transpose`, `permute`);
- reductions: two input tiles, one scaler tile, two output tiles (`reduce_op`);
- softmax: a whole row of tiles in, a row of exponentials, a row out, and three one-tile
  helpers (scaler, max, reciprocal) (`softmax_op`, numerically stable variant);
- layer/RMS norm: a row in, a row of x - mean, rows of gamma and beta, and a few one-tile
  helpers (`layernorm_op`);
- matmul (and conv2d as the matmul of its im2col): the multi-core reuse factory: each core
  computes a per_core_M x per_core_N block of output tiles, reading in0 blocks of
  per_core_M x in0_block_w and in1 blocks of in0_block_w x per_core_N, both double-buffered,
  and holding its output block. The output tiles are spread over the worker grid; a block too
  large for half of L1 is split in halves until it fits (tt-metal's matmul picks smaller
  subblocks the same way rather than fail).

A program runs its steps in order and each step's buffers are reused by the next, so the
footprint of the program is the largest footprint of its steps. Each op's record names its
rule (`OpRecord.footprint`: the functions here; none is the eltwise rule).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from collections.abc import Callable
from typing import Protocol

from .._types import DataType, DeviceSpec
from .record import REGISTRY


class _Value(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> DataType: ...


class _Step(Protocol):
    @property
    def op(self) -> str: ...
    @property
    def inputs(self) -> tuple[int, ...]: ...
    @property
    def output(self) -> int: ...

__all__ = ["program_footprint", "eltwise", "reduction", "row_wise", "matmul_like", "matmul_dims",
           "conv2d_dims", "channel_dims"]

_ELTWISE_TILES = 2  # double-buffered, per input and output

Rule = Callable[[Sequence[_Value], _Step, DeviceSpec], int]


def _tiles(n: int) -> int:
    return max(1, -(-n // 32))


def program_footprint(values: Sequence[_Value], steps: Sequence[_Step], spec: DeviceSpec) -> int:
    """Bytes of circular buffers per core (aligned to L1's alignment) while a program of these
    values and steps runs (`Program.l1_footprint`)."""
    if not steps:
        return 0
    largest = max((REGISTRY[step.op].footprint or eltwise)(values, step, spec) if step.op in REGISTRY
                  else eltwise(values, step, spec) for step in steps)
    alignment = spec.l1_alignment
    return -(-largest // alignment) * alignment


def _tile_bytes(values: Sequence[_Value], step: _Step) -> tuple[list[_Value], int, int]:
    out_tile = values[step.output].dtype.tile_bytes
    inputs = [values[i] for i in step.inputs]
    in_tile = max((v.dtype.tile_bytes for v in inputs), default=out_tile)
    return inputs, in_tile, out_tile


def eltwise(values: Sequence[_Value], step: _Step, spec: DeviceSpec) -> int:
    """Two tiles per input and two for the output (eltwise ops, data movement; a host op)."""
    inputs, _, out_tile = _tile_bytes(values, step)
    return sum(_ELTWISE_TILES * v.dtype.tile_bytes for v in inputs) + _ELTWISE_TILES * out_tile


def reduction(values: Sequence[_Value], step: _Step, spec: DeviceSpec) -> int:
    """Two input tiles, one scaler tile, two output tiles."""
    _, in_tile, out_tile = _tile_bytes(values, step)
    return _ELTWISE_TILES * in_tile + DataType.FLOAT32.tile_bytes + _ELTWISE_TILES * out_tile


def row_wise(helpers: int) -> Rule:
    """A whole row of tiles in (and a row of each affine operand: gamma, beta), a row of
    intermediates in the compute format, two output tiles and `helpers` one-tile helpers
    (softmax: 3, the norms: 4)."""

    def rule(values: Sequence[_Value], step: _Step, spec: DeviceSpec) -> int:
        inputs, in_tile, out_tile = _tile_bytes(values, step)
        compute = DataType.FLOAT32.tile_bytes  # intermediates in the compute format
        affine = len(inputs) - 1  # gamma, beta

        def size(row: int) -> int:
            return row * in_tile * (1 + affine) + row * compute + 2 * out_tile + helpers * compute

        row = _tiles(inputs[0].shape[-1] if inputs[0].shape else 1)
        # A row too wide for half of L1 streams in blocks of two tiles (the ops' "large" variant).
        return size(row) if size(row) <= spec.l1_bank_bytes // 2 else size(2)

    return rule


def matmul_dims(values: Sequence[_Value], step: _Step) -> tuple[int, int, int]:
    """(M, K, N) in elements of a matmul step."""
    out = values[step.output]
    a, b = (values[i].shape for i in step.inputs[:2])
    k = a[-1] if a else 1
    m = math.prod(out.shape[:-1]) if len(out.shape) > 1 else 1
    return m, k, out.shape[-1] if out.shape else 1


def conv2d_dims(values: Sequence[_Value], step: _Step) -> tuple[int, int, int]:
    """(M, K, N) of a conv2d as the matmul of its im2col: weight [C_out, C_in / groups, kH, kW],
    so K is C_in / groups * kH * kW."""
    out = values[step.output]
    k = math.prod(values[step.inputs[1]].shape[1:])
    return math.prod(out.shape[:-1]), k, out.shape[-1]


def channel_dims(values: Sequence[_Value], step: _Step) -> tuple[int, int, int]:
    """(M, K, N) of a conv2d gradient: a matmul over the channels of its first operand."""
    out = values[step.output]
    x = values[step.inputs[0]].shape
    return max(1, math.prod(out.shape[:-1])), x[-1] if x else 1, out.shape[-1] if out.shape else 1


def matmul_like(dims: Callable[[Sequence[_Value], _Step], tuple[int, int, int]]) -> Rule:
    """The multi-core reuse matmul factory's buffers for a step that is a matmul of `dims`."""

    def rule(values: Sequence[_Value], step: _Step, spec: DeviceSpec) -> int:
        _, in_tile, out_tile = _tile_bytes(values, step)
        m, k, n = dims(values, step)
        mt, kt, nt = _tiles(m), _tiles(k), _tiles(n)
        grid_x, grid_y = spec.worker_grid
        per_core_m, per_core_n = -(-mt // grid_y), -(-nt // grid_x)
        in0_block_w = 2 if kt % 2 == 0 else 1
        budget = spec.l1_bank_bytes // 2

        def size(pm: int, pn: int) -> int:
            return (2 * pm * in0_block_w + 2 * in0_block_w * pn) * in_tile + pm * pn * out_tile

        while size(per_core_m, per_core_n) > budget and (per_core_m > 1 or per_core_n > 1):
            if per_core_m >= per_core_n:
                per_core_m = -(-per_core_m // 2)
            else:
                per_core_n = -(-per_core_n // 2)
        return size(per_core_m, per_core_n)

    return rule
