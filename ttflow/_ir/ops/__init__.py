"""The op set: every op, one record each, defined by family in the files of this package.

What each op computes, on host numpy arrays:

The runtime reads a step's operands out of bank memory (float32 for float dtypes, int64 for
integer ones), calls `OPS[op].compute(arrays, scalar, **attrs)` (the op's record, `record.OpRecord`), and rounds the result to the
value's dtype as it stores it (`store_as`). So the compute functions never round: they take and
return float32 for floats and int64 for integers (an int64 result wraps to 32 bits when stored).
They never warn either: overflow to inf, 0 -> inf reciprocals and NaN from sqrt of a negative are
results, as on the device, so numpy's floating-point warnings are silenced around each op.

GELU is the exact form, 0.5 * x * (1 + erf(x / sqrt(2))), PyTorch's default. numpy has no erf,
so `erf` evaluates W. J. Cody's rational approximations in float64 (about 1e-15 relative), far
below float32 resolution.

`typecast` from a float to an integer type truncates toward zero, saturates at the target type's
range and maps NaN to 0; between integer types it wraps (two's complement, like a C cast).

The ops of format version 2 (`docs/ops.md` is the reference table) follow numpy and PyTorch:
comparisons give 1/0 in the compute dtype; `maximum`/`minimum` propagate NaN; `argmax` takes the
first index on ties and the first NaN's index when there is one (numpy); `sigmoid` is evaluated
as exp(-|x|) based halves, so it never overflows; `mean`, `layer_norm` and `rms_norm` reduce in
float32 (numpy's pairwise sums) with the biased variance (PyTorch). Indices read at run time
(`embedding` ids, `update_cache`'s row) are clamped into range, as JAX's gathers and
`dynamic_update_slice` clamp: a device op has no way to raise. `conv2d` and the pools cut
windows out of the zero- (or -inf-) padded input with `sliding_window_view` and reduce them
with one matmul per group (im2col).

The ops of format version 3: `div` is IEEE float32 division; `erf` is Cody's float64 erf
rounded; `rand` is Philox4x32-10 of (seed, flat index) (`docs/ops.md` gives the exact rule);
`gather` and `embedding_grad` clamp their indices as `embedding` does. The convolution
gradients are the adjoints of `_windows`: the input's scatters each tap's matmul product back
with a strided add (`_scatter_taps`), the weight's is im2col again. `max_pool2d_backward` replays
PyTorch's CPU scan of each window (the first maximum; NaN wins; padding never) and both pool
gradients add overlapping windows in row-major window order, so their float32 sums are
PyTorch's bit for bit.

The ops of format version 5 are numpy's on the compute dtypes: `remainder` and `floor_divide`
floored, `fmod` truncated (an integer divided by 0 gives 0), `cumsum`, whose float running
sums are float64 rounded once each, as PyTorch's CPU kernel, `argsort`, stable, NaN as the
largest value (PyTorch's order), and `atan2`, float32 numpy (within 1 ulp, as torch's kernel).

The ops of format version 6 take integers only (`OpRecord.int_only`), except `prod`. `bitwise_and`,
`bitwise_or` and `bitwise_xor` are numpy's on int64; on two's complement values that fit 32 bits
their results fit too. The shifts are torch's int64 ones (a count outside [0, 63] gives 0 to the
left, the sign fill to the right; `>>` is arithmetic on int64, so logical on UINT32's
non-negative values), which stored wrapped to 32 bits are torch's int32 ones (a count outside
[0, 31] gives 0 to the left, the sign fill to the right). `prod` multiplies in the compute dtype
in numpy's order (float32 left to right along the axis; int64 wrapping, as torch's int64 prod).

The ops of format version 7 are the collectives (`COLLECTIVES`): all_gather, reduce_scatter,
all_reduce, broadcast, point_to_point and all_to_all. What they compute depends on the chips
of their group, so a chip's run hands them to the rendezvous of its SPMD submit (`_mesh`);
the functions here are their meaning for a group of one chip (a single device, a 1x1 mesh,
`run_on_host`), where each is the identity.
"""

from __future__ import annotations

from ..record import REGISTRY, Kind, OpRecord
from . import cache, collectives, creation, data_movement, eltwise, host, indexing, matmul_conv
from . import normalization, reduction

__all__ = ["OPS", "COLLECTIVES", "OpRecord", "FAMILIES"]


FAMILIES = (eltwise, reduction, matmul_conv, data_movement, normalization, creation, indexing, collectives,
            cache, host)
"""The families' modules, in the order `ProgramBuilder` lists their op methods."""

OPS: dict[str, OpRecord] = REGISTRY
"""Every op's record by name (the host op has none: a user's function, `host`)."""


COLLECTIVES = frozenset(name for name, record in OPS.items() if record.kind is Kind.COLLECTIVE)
"""The ops whose result depends on the other chips of a mesh (run by `_mesh.collectives`)."""
