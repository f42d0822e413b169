"""Lowering a core-ATen fx graph from AOTAutograd to one ttflow program.

`torch.compile` hands a backend the forward and the backward graph of a function as fx graphs
of core-ATen ops (after the decompositions the backend asks for: `DECOMPOSITIONS`), with static
shapes. `lower` turns one such graph into one ttflow program, deciding everything once: which
program inputs (one per graph placeholder, then one INT32 seed per random op), which ops, which
outputs; the caller then only moves tensors and submits.

Conventions (the caller's contract, `InputSpec` and `OutputSpec` restate them per tensor):

- every program input and output is `DRAM TILE` in `device_dtype(torch dtype)` with shape
  `device_shape(torch shape)`: rank 0 becomes (1, 1), rank 1 (n,) becomes (1, n); integers
  and bools are INT32 (a bool is 1 or 0; int64 values past int32's range are refused on the
  way in and every int64 result is range-checked, never wrapped);
- inside the program a value has its torch shape (rank 0 as (1,)), so each ATen op maps onto
  ttflow's numpy-like op with the same axes; inputs and outputs are reshaped at the edges;
- after each node the value is checked against the node's `meta["val"]`: its shape must be the
  torch shape (a lowering that disagrees is a bug, reported at once), and its dtype is made the
  torch dtype's device dtype (a comparison's 1/0 float becomes INT32, as torch gives a bool);
- composite float lowerings (log_softmax, tanh-GELU, layer norm statistics, multi-axis means
  of bfloat16) compute in FLOAT32 and round once, as PyTorch's fused CPU kernels do;
- only nodes a graph output depends on are lowered.

`docs/torch-lowering.md` is the table of ATen ops and what each becomes.

The package is split as tt-mlir's runtime groups its operations: `graph` walks a graph and holds
the registry, `device_view` says what a torch tensor is on the device, `decompositions` what
AOTAutograd decomposes first, and one module per op family registers its lowerings (pointwise,
creation, index_shape, reduce, matmul_conv, norm; the special functions in special, bessel
and polynomials, over series' evaluation helpers). Below it in `ttflow.torch` are only the
pieces everything uses (`_errors`, `_warn`, and `_fused`/`_foreach_decomp`'s decompositions):
the lowering is pure, no device, no session. `host` makes the function a host-op step calls for
an op a compiled graph needs and the device lacks (CPU torch, inside the program).
"""

from .._errors import UnsupportedOpError as UnsupportedOpError
from . import (  # noqa: F401  (register the lowerings)
    bessel,
    creation,
    index_shape,
    matmul_conv,
    norm,
    pointwise,
    polynomials,
    reduce,
    special,
)
from .decompositions import DECOMPOSITIONS as DECOMPOSITIONS
from .decompositions import TRACING as TRACING
from .device_view import InputSpec as InputSpec
from .device_view import Lowered as Lowered
from .device_view import OutputSpec as OutputSpec
from .device_view import device_dtype as device_dtype
from .device_view import device_shape as device_shape
from .graph import lower as lower

__all__ = [
    "DECOMPOSITIONS", "TRACING", "InputSpec", "Lowered", "OutputSpec", "UnsupportedOpError",
    "device_dtype", "device_shape", "lower",
]
