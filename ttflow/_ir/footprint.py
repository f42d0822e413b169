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
footprint of the program is the largest footprint of its steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from .._types import DataType, DeviceSpec


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

__all__ = ["program_footprint"]

_ELTWISE_TILES = 2  # double-buffered, per input and output
_ROW_OPS = {"softmax"}
_NORM_OPS = {"layer_norm", "rms_norm"}
_REDUCE_OPS = {"sum", "prod", "max", "mean", "argmax", "cumsum", "argsort"}
_MATMUL_OPS = {"matmul", "conv2d", "conv2d_input_grad", "conv2d_weight_grad"}


def _tiles(n: int) -> int:
    return max(1, -(-n // 32))


def program_footprint(values: Sequence[_Value], steps: Sequence[_Step], spec: DeviceSpec) -> int:
    """Bytes of circular buffers per core (aligned to L1's alignment) while a program of these
    values and steps runs (`Program.l1_footprint`)."""
    if not steps:
        return 0
    largest = max(_step_footprint(values, step, spec) for step in steps)
    alignment = spec.l1_alignment
    return -(-largest // alignment) * alignment


def _step_footprint(values: Sequence[_Value], step: _Step, spec: DeviceSpec) -> int:
    out = values[step.output]
    out_tile = out.dtype.tile_bytes
    inputs = [values[i] for i in step.inputs]
    in_tile = max((v.dtype.tile_bytes for v in inputs), default=out_tile)
    if step.op in _MATMUL_OPS:
        return _matmul_footprint(values, step, spec, in_tile, out_tile)
    if step.op in _ROW_OPS or step.op in _NORM_OPS:
        compute = DataType.FLOAT32.tile_bytes  # intermediates in the compute format
        helpers = 3 if step.op in _ROW_OPS else 4
        affine = len(inputs) - 1  # gamma, beta

        def size(row: int) -> int:
            return row * in_tile * (1 + affine) + row * compute + 2 * out_tile + helpers * compute

        row = _tiles(inputs[0].shape[-1] if inputs[0].shape else 1)
        # A row too wide for half of L1 streams in blocks of two tiles (the ops' "large" variant).
        return size(row) if size(row) <= spec.l1_bank_bytes // 2 else size(2)
    if step.op in _REDUCE_OPS:
        return _ELTWISE_TILES * in_tile + DataType.FLOAT32.tile_bytes + _ELTWISE_TILES * out_tile
    tiles = sum(_ELTWISE_TILES * v.dtype.tile_bytes for v in inputs)
    return tiles + _ELTWISE_TILES * out_tile


def _matmul_dims(values: Sequence[_Value], step: _Step) -> tuple[int, int, int]:
    """(M, K, N) in elements of the step as a matrix product."""
    out = values[step.output]
    if step.op == "matmul":
        a, b = (values[i].shape for i in step.inputs[:2])
        k = a[-1] if a else 1
        m = math.prod(out.shape[:-1]) if len(out.shape) > 1 else 1
        return m, k, out.shape[-1] if out.shape else 1
    if step.op == "conv2d":  # weight [C_out, C_in / groups, kH, kW]: K is C_in / groups * kH * kW
        k = math.prod(values[step.inputs[1]].shape[1:])
        return math.prod(out.shape[:-1]), k, out.shape[-1]
    # a gradient of conv2d: a matmul over the channels of its first operand
    x = values[step.inputs[0]].shape
    return max(1, math.prod(out.shape[:-1])), x[-1] if x else 1, out.shape[-1] if out.shape else 1


def _matmul_footprint(values: Sequence[_Value], step: _Step, spec: DeviceSpec, in_tile: int,
                      out_tile: int) -> int:
    m, k, n = _matmul_dims(values, step)
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
