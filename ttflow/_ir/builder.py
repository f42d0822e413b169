"""`ProgramBuilder`: every family's op methods over the builder's plumbing (`core.BuilderCore`).

`ProgramBuilder` records ops in execution order and checks shapes and dtypes as each op is
called, so a malformed program fails where it is written (ShapeError, LayoutError, ProgramError
raised by the op call, naming the op and the shapes), not when it runs.

Dtype rules:
- a program input always has a concrete dtype: FLOAT32 when its layout leaves it out;
- a binary op (add, sub, mul, matmul, maximum, minimum and the comparisons eq, ne, lt, le, gt,
  ge) on two float values gives the wider float (FLOAT32 > BFLOAT16 > BFLOAT8_B); two equal
  integer dtypes keep it; mixing integers and floats, or INT32 with UINT32, raises LayoutError
  (use `typecast`). A comparison gives 1 or 0 in that dtype. The same rule joins the operands
  of concat, of where's two branches (the condition may have any dtype: nonzero selects `a`)
  and of conv2d (input, weight, bias);
- with a Python scalar operand the dtype is the value's; an integer value takes only integral
  scalars (|s| <= 2**53, so the float the step holds is exact), and no scalar may be NaN;
- gelu, exp, softmax, sqrt, reciprocal, rsqrt, tanh, sigmoid, silu, pow, mean, layer_norm,
  rms_norm, conv2d, avg_pool2d, div, log, erf, embedding_grad, conv2d_input_grad,
  conv2d_weight_grad, avg_pool2d_backward, sin, cos, floor, ceil, round and trunc need floats (LayoutError on integers); relu, neg,
  abs, sum, prod, max, argmax, transpose, reshape, slice, permute, concat, broadcast_to, gather,
  max_pool2d, max_pool2d_backward and the binary ops work on integers too;
- bitwise_and, bitwise_or, bitwise_xor, left_shift and right_shift need INT32 or UINT32 values
  (LayoutError on floats); a scalar operand of bitwise_and, bitwise_or or bitwise_xor must fit
  the value's dtype (LayoutError otherwise: the results then always fit, unchecked);
- layer_norm and rms_norm give x's dtype (weight and bias may be any float dtype);
  argmax gives INT32; embedding gives the table's dtype (ids must be INT32 or UINT32);
  update_cache gives the cache's dtype (the new row is rounded to it; it must be of the cache's
  kind, and its index INT32 or UINT32); arange and full give the dtype they are asked for (INT32
  and FLOAT32 by default); rand gives FLOAT32 (its seed INT32 or UINT32); gather gives x's dtype
  (its index INT32 or UINT32), embedding_grad and the pool gradients grad's, the conv2d
  gradients the binary rule of their two operands;
- an output keeps its value's dtype unless its layout names another one of the same kind
  (float to float, integer to integer); it is then rounded when stored.

Shape rules of the newer ops (`docs/ops.md` is the table, with numpy and PyTorch equivalents):
- reductions (sum, prod, max, mean, argmax) keep the reduced axis with size 1; axes may be negative;
- slice(x, starts, ends, steps) is `x[starts[0]:ends[0]:steps[0], ...]`: Python's clamping and
  negative indices, None for an open end; fewer entries than the rank slice the leading axes
  (numpy's `x[a:b]`); steps must be positive; an empty result is a ShapeError;
- run-time indices (embedding's and embedding_grad's ids, update_cache's row, gather's index)
  are clamped into range, as JAX clamps (a device op has no way to raise): id -1 reads row 0,
  an id past the table its last row;
- conv2d and the pools take NHWC input (as ttnn) and give NHWC; conv2d's weight is PyTorch's
  [C_out, C_in / groups, kH, kW]; stride, padding, dilation and kernel_size are an int or a
  pair; padding is zeros on both sides (max_pool2d pads with -inf and, as PyTorch, takes at most
  half the kernel); avg_pool2d divides by kH * kW, padding included (`count_include_pad`);
  output sizes follow PyTorch's formula (floor), and a size below 1 is a ShapeError. Their
  gradients (conv2d_input_grad, conv2d_weight_grad, max_pool2d_backward, avg_pool2d_backward)
  take the same arguments and layouts, the forward input's or weight's shape where it cannot be
  read off a value, and check that grad has the forward result's shape.

Collectives (all_gather, reduce_scatter, all_reduce, broadcast, point_to_point, all_to_all)
exchange a value with the other chips of a mesh: `cluster_axis=a` groups the chips that differ
only in coordinate a (None: every chip), results are in mesh-coordinate order along the group,
reductions are sums. Their shapes depend on the group's size, which a program carries as the
builder's `mesh_shape` (None: one chip) and a submit resolves for its mesh.

Every intermediate value is typed L1 TILE in its dtype; where it is really stored is the runtime's
choice. `Program.last_use` says when each value can be freed, and `run_on_host` is the reference
interpreter: the runtime's loop, on host arrays.
"""

from __future__ import annotations

from typing import final

from .core import Value
from .ops.cache import CacheOps
from .ops.collectives import CollectiveOps
from .ops.creation import CreationOps
from .ops.data_movement import DataMovementOps
from .ops.eltwise import EltwiseOps
from .ops.host import HostOps
from .ops.indexing import IndexingOps
from .ops.matmul_conv import MatmulConvOps
from .ops.normalization import NormalizationOps
from .ops.reduction import ReductionOps

__all__ = ["ProgramBuilder", "Value"]


@final
class ProgramBuilder(EltwiseOps, ReductionOps, MatmulConvOps, DataMovementOps, NormalizationOps, CreationOps,
                     IndexingOps, CollectiveOps, CacheOps, HostOps):
    """Records a program op by op; `build()` returns the immutable `Program`.

    `mesh_shape` (rows, cols): the mesh whose group sizes the collectives' shapes are resolved
    for. Left out, a collective's group is one chip (an all_gather's result is its input's
    shape); a submit to a mesh resolves the shapes again for that mesh, so one program runs on
    any mesh whose groups fit it (see docs/mesh.md, "Collectives").

    Each op is a method defined with its record in its family's file (`ops/<family>.py`)."""


