"""What each op computes, on host numpy arrays.

The runtime reads a step's operands out of bank memory (float32 for float dtypes, int64 for
integer ones), calls `OPS[op].compute(arrays, scalar, **attrs)`, and rounds the result to the
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

The ops of format version 6 take integers only (`OpDef.int_only`), except `prod`. `bitwise_and`,
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

import math
from collections.abc import Callable
from typing import Any, final

import attrs
import ml_dtypes
import numpy as np

from ..._errors import ProgramError
from ..._types import DataType
from ..numerics import _INT_RANGE, _U32, _to_int, arange_length, erf, philox4x32_10

__all__ = ["OpDef", "OPS", "COLLECTIVES", "erf", "philox4x32_10", "arange_length", "check_range", "checked",
           "compute_dtype", "store_as", "to_host_dtype", "zero_divisor"]

Array = np.ndarray[Any, Any]


@final
@attrs.frozen
class OpDef:
    """An op's arity, whether it needs float (or integer) operands, and what it computes.

    `arity` is the most tensor operands a step of the op reads: fewer when optional operands are
    left out (a `where` with a scalar branch, a `layer_norm` without weight), -1 for any number
    (`concat`), 0 for none (`arange`). The builder refuses a float_only op on integers and an
    int_only one (bitwise logic, shifts) on floats, with a LayoutError."""

    name: str
    arity: int
    fn: Callable[..., Array]
    float_only: bool = False
    int_only: bool = attrs.field(default=False)

    @int_only.validator
    def _one_kind(self, attribute: Any, value: bool) -> None:
        if value and self.float_only:
            raise ValueError(f"op {self.name!r} cannot need both float and integer operands")

    def compute(self, arrays: list[Array], scalar: float | None, **attrs_: Any) -> Array:
        """The op's result in the operands' compute dtype (float32 or int64), unrounded."""
        with np.errstate(all="ignore"):
            return self.fn(arrays, scalar, **attrs_)


def _scalar_like(array: Array, scalar: float) -> Any:
    return array.dtype.type(scalar)


def _binary(ufunc: Any) -> Callable[..., Array]:
    def fn(arrays: list[Array], scalar: float | None) -> Array:
        a = arrays[0]
        b = arrays[1] if scalar is None else _scalar_like(a, scalar)
        return ufunc(a, b)

    return fn


def _compare(ufunc: Any) -> Callable[..., Array]:
    """1 where `ufunc(a, b)` holds, else 0, in a's compute dtype."""

    def fn(arrays: list[Array], scalar: float | None) -> Array:
        a = arrays[0]
        b = arrays[1] if scalar is None else _scalar_like(a, scalar)
        return ufunc(a, b).astype(a.dtype)

    return fn






def _gelu(arrays: list[Array], scalar: float | None) -> Array:
    x = arrays[0]
    x64 = x.astype(np.float64)
    return (0.5 * x64 * (1.0 + erf(x64 / np.sqrt(2.0)))).astype(x.dtype)


def _softmax(arrays: list[Array], scalar: float | None, axis: int = -1) -> Array:
    x = arrays[0]
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _sum(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    return arrays[0].sum(axis=axis, keepdims=True, dtype=arrays[0].dtype)


def _cumsum(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    # Floats accumulate in float64, each partial sum rounded once: torch's CPU cumsum, bit for bit.
    x = arrays[0]
    if x.dtype.kind == "f":
        return np.cumsum(x, axis=axis, dtype=np.float64).astype(np.float32)
    return np.cumsum(x, axis=axis)


def _prod(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    # numpy's order: float32 left to right along the axis (numpy sums pairwise, but multiplies
    # in order); int64 wraps past 2**63, as torch's int64 prod does.
    return arrays[0].prod(axis=axis, keepdims=True, dtype=arrays[0].dtype)


def _max(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    return arrays[0].max(axis=axis, keepdims=True)


def _matmul(arrays: list[Array], scalar: float | None) -> Array:
    # Row-major operands: BLAS sums in an order that depends on how they lie in memory (a
    # transposed view takes another kernel), so the same values give the same bits whether a
    # step's operand was kept between steps or read back from bank memory (const-eval's cut).
    return np.matmul(np.ascontiguousarray(arrays[0]), np.ascontiguousarray(arrays[1]))


def _unary(fn: Callable[[Array], Array]) -> Callable[..., Array]:
    return lambda arrays, scalar: fn(arrays[0])






def _typecast(arrays: list[Array], scalar: float | None, dtype: str) -> Array:
    # The runtime rounds to the target dtype when it stores the value (and wraps integers).
    target = DataType(dtype)
    x = arrays[0]
    if target.is_float:
        return x.astype(np.float32)
    return _to_int(x, target) if x.dtype.kind == "f" else x.astype(np.int64)


# -- the ops of format version 6 (shifts; the bitwise ones are `_binary` of numpy's) ------------


def _shift_operands(arrays: list[Array], scalar: float | None) -> tuple[Array, Array, Array]:
    """The values, the counts (int64) and where a count is one a 64-bit shift honours (0..63)."""
    a = arrays[0]
    counts = np.asarray(arrays[1] if scalar is None else _scalar_like(a, scalar))
    return a, counts, (counts >= 0) & (counts < 64)


def _left_shift(arrays: list[Array], scalar: float | None) -> Array:
    # torch's int64 x << s: the bits of x moved up, wrapping past 2**63 (through uint64, where
    # a shift that overflows is defined); 0 for a count outside [0, 63].
    a, counts, inside = _shift_operands(arrays, scalar)
    moved = a.astype(np.uint64) << np.where(inside, counts, 0).astype(np.uint64)
    return np.where(inside, moved.astype(np.int64), np.int64(0))


def _right_shift(arrays: list[Array], scalar: float | None) -> Array:
    # torch's int64 x >> s: arithmetic (the sign fills in); for a count outside [0, 63] the sign
    # fill alone, -1 for a negative x, else 0.
    a, counts, inside = _shift_operands(arrays, scalar)
    fill = np.where(a < 0, np.int64(-1), np.int64(0))
    return np.where(inside, a >> np.where(inside, counts, 0), fill)


# -- the ops of format version 2 ------------------------------------------------------------


def _slice(arrays: list[Array], scalar: float | None, starts: tuple[int, ...],
           ends: tuple[int, ...], steps: tuple[int, ...]) -> Array:
    return arrays[0][tuple(slice(a, e, s) for a, e, s in zip(starts, ends, steps))]


def _concat(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    return np.concatenate(arrays, axis=axis)


def _permute(arrays: list[Array], scalar: float | None, axes: tuple[int, ...]) -> Array:
    return np.transpose(arrays[0], axes)


def _clamped_index(index: Array, size: int) -> Array:
    """Run-time indices clamped into [0, size - 1] (JAX's rule: a device op cannot raise)."""
    return np.clip(index.astype(np.int64), 0, size - 1)


def _embedding(arrays: list[Array], scalar: float | None) -> Array:
    ids, table = arrays
    return table[_clamped_index(ids, table.shape[0])]


def _argmax(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    # numpy's argmax: the first index of the maximum, or of the first NaN.
    return np.expand_dims(np.argmax(arrays[0], axis=axis), axis).astype(np.int64)


def _argsort(arrays: list[Array], scalar: float | None, axis: int, descending: bool) -> Array:
    # Stable, as torch.sort(stable=True): equal keys keep their order. NaN sorts as the largest
    # value (last ascending, first descending), as torch's does.
    x = arrays[0]
    if not descending:
        return np.argsort(x, axis=axis, kind="stable").astype(np.int64)
    nan = np.isnan(x) if x.dtype.kind == "f" else np.zeros(x.shape, bool)
    keys = np.where(nan, 0, -x.astype(np.float64) if x.dtype.kind == "f" else -x)
    order = np.argsort(keys, axis=axis, kind="stable")
    # NaN first: a second stable sort on "not NaN" keeps the first one's order within each part.
    return np.take_along_axis(order, np.argsort(~np.take_along_axis(nan, order, axis), axis=axis,
                                                 kind="stable"), axis).astype(np.int64)


def _where(arrays: list[Array], scalar: float | None, a_scalar: float | None,
           b_scalar: float | None) -> Array:
    cond, *rest = arrays
    a = rest.pop(0) if a_scalar is None else None
    b = rest.pop(0) if b_scalar is None else None
    dtype = (a if a is not None else b).dtype  # type: ignore[union-attr]  # one is a tensor
    a = a if a is not None else dtype.type(a_scalar)
    b = b if b is not None else dtype.type(b_scalar)
    return np.where(cond != 0, a, b)


def _mean(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    x = arrays[0]
    return x.sum(axis=axis, keepdims=True, dtype=np.float32) / np.float32(x.shape[axis])


def _sigmoid_of(x: Array) -> Array:
    # exp(-|x|) only: it never overflows, and each half keeps full relative precision.
    e = np.exp(-np.abs(x))
    one = x.dtype.type(1)
    return np.where(x >= 0, one / (one + e), e / (one + e))


def _layer_norm(arrays: list[Array], scalar: float | None, eps: float, has_weight: bool,
                has_bias: bool) -> Array:
    x, *rest = arrays
    mean = x.mean(axis=-1, keepdims=True, dtype=np.float32)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True, dtype=np.float32)  # biased, as PyTorch's
    y = centred / np.sqrt(var + np.float32(eps))
    if has_weight:
        y = y * rest.pop(0)
    if has_bias:
        y = y + rest.pop(0)
    return y


def _rms_norm(arrays: list[Array], scalar: float | None, eps: float, has_weight: bool) -> Array:
    x = arrays[0]
    ms = (x * x).mean(axis=-1, keepdims=True, dtype=np.float32)
    y = x / np.sqrt(ms + np.float32(eps))
    return y * arrays[1] if has_weight else y




def _arange(arrays: list[Array], scalar: float | None, start: float, stop: float, step: float,
            dtype: str) -> Array:
    n = arange_length(start, stop, step)
    if DataType(dtype).is_float:
        return (start + np.arange(n, dtype=np.float64) * step).astype(np.float32)
    return int(start) + np.arange(n, dtype=np.int64) * int(step)


def _windows(x: Array, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
             dilation: tuple[int, int], fill: Any) -> Array:
    """NHWC `x`, padded with `fill`, as windows [N, H_out, W_out, C, kH, kW] (a strided view)."""
    (ph, pw), (sh, sw), (dh, dw) = padding, stride, dilation
    if ph or pw:
        x = np.pad(x, ((0, 0), (ph, ph), (pw, pw), (0, 0)), constant_values=fill)
    span = ((kernel[0] - 1) * dh + 1, (kernel[1] - 1) * dw + 1)
    view = np.lib.stride_tricks.sliding_window_view(x, span, axis=(1, 2))
    return view[:, ::sh, ::sw, :, ::dh, ::dw]


def _conv2d(arrays: list[Array], scalar: float | None, stride: tuple[int, int],
            padding: tuple[int, int], dilation: tuple[int, int], groups: int,
            has_bias: bool) -> Array:
    x, weight = arrays[0], arrays[1]
    c_out, c_in_g, kh, kw = weight.shape
    win = _windows(x, (kh, kw), stride, padding, dilation, x.dtype.type(0))
    n, ho, wo = win.shape[:3]
    c_out_g, k = c_out // groups, c_in_g * kh * kw
    # im2col: one [N*Ho*Wo, C_in/g*kH*kW] @ [.., C_out/g] matmul a group, the groups batched
    # (a depthwise conv has as many groups as channels: one call, not one per channel).
    cols = _grouped(win.reshape(n * ho * wo, groups, k))
    w = weight.reshape(groups, c_out_g, k).transpose(0, 2, 1)
    out = (cols @ w).transpose(1, 0, 2).reshape(n, ho, wo, c_out)
    if has_bias:
        out += arrays[2]
    return out


def _max_pool2d(arrays: list[Array], scalar: float | None, kernel_size: tuple[int, int],
                stride: tuple[int, int], padding: tuple[int, int]) -> Array:
    x = arrays[0]
    fill = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min  # never wins: pad <= k/2
    return _windows(x, kernel_size, stride, padding, (1, 1), fill).max(axis=(-2, -1))


def _avg_pool2d(arrays: list[Array], scalar: float | None, kernel_size: tuple[int, int],
                stride: tuple[int, int], padding: tuple[int, int]) -> Array:
    x = arrays[0]
    win = _windows(x, kernel_size, stride, padding, (1, 1), x.dtype.type(0))
    # count_include_pad=True (PyTorch's default): every window divides by kH * kW.
    return win.sum(axis=(-2, -1), dtype=np.float32) / np.float32(kernel_size[0] * kernel_size[1])


def _update_cache(arrays: list[Array], scalar: float | None) -> Array:
    cache, value, index = arrays
    out = cache.copy()
    row = int(_clamped_index(index, cache.shape[-2])[0])
    out[..., row : row + 1, :] = value  # broadcasts value's batch dims to the cache's
    return out


# -- the ops of format version 3 ------------------------------------------------------------


def _erf(arrays: list[Array], scalar: float | None) -> Array:
    x = arrays[0]
    return erf(x).astype(x.dtype)



def _full(arrays: list[Array], scalar: float | None, shape: tuple[int, ...], value: float,
          dtype: str) -> Array:
    return np.full(tuple(shape), value, np.float32 if DataType(dtype).is_float else np.int64)


def _broadcast_to(arrays: list[Array], scalar: float | None, shape: tuple[int, ...]) -> Array:
    return np.ascontiguousarray(np.broadcast_to(arrays[0], tuple(shape)))







def _rand(arrays: list[Array], scalar: float | None, shape: tuple[int, ...]) -> Array:
    # Element i is word i % 4 of Philox4x32-10 at counter (i // 4 low word, high word, 0, 0)
    # and key (seed as uint32, 0); its top 24 bits times 2**-24 (exact in float32, below 1).
    n = math.prod(shape)
    seed = int(arrays[0].reshape(-1)[0]) & _U32
    block = np.arange((n + 3) // 4, dtype=np.uint64)
    zero = np.zeros_like(block)
    words = philox4x32_10((block & np.uint64(_U32), block >> np.uint64(32), zero, zero), (seed, 0))
    bits = np.stack(words, axis=1).reshape(-1)[:n] >> np.uint64(8)
    return (bits.astype(np.float32) * np.float32(2.0**-24)).reshape(tuple(shape))



def _gather(arrays: list[Array], scalar: float | None, axis: int) -> Array:
    x, index = arrays
    if x.ndim == 2 and index.ndim == 2 and axis == 1 and index.shape[0] <= x.shape[0]:
        # The common case (a loss picking each row's target), without take_along_axis's
        # general index arrays: the same elements.
        rows = np.arange(index.shape[0])[:, None]
        return x[rows, _clamped_index(index, x.shape[1])]
    # PyTorch reads x's leading part along the other dims; numpy broadcasts a dim of 1.
    view = x[tuple(slice(None) if d == axis or n == 1 else slice(0, i)
                   for d, (i, n) in enumerate(zip(index.shape, x.shape)))]
    view = np.broadcast_to(view, tuple(n if d == axis else i for d, (i, n) in enumerate(zip(index.shape, x.shape))))
    return np.take_along_axis(view, _clamped_index(index, x.shape[axis]), axis=axis)


def _embedding_grad(arrays: list[Array], scalar: float | None, num_rows: int,
                    padding_idx: int | None) -> Array:
    ids, grad = arrays
    d = grad.shape[-1]
    out = np.zeros((num_rows, d), grad.dtype)
    np.add.at(out, _clamped_index(ids, num_rows).reshape(-1), grad.reshape(-1, d))
    if padding_idx is not None:
        out[padding_idx] = 0
    return out



def _grouped(rows: Array) -> Array:
    """[rows, groups, k] as [groups, rows, k], contiguous: one matmul a group, batched."""
    if rows.shape[1] == 1:
        return rows.reshape(1, rows.shape[0], rows.shape[2])  # no copy
    return np.ascontiguousarray(rows.transpose(1, 0, 2))


def _scatter_taps(out: Array, taps: Callable[[int, int], Array], kernel: tuple[int, int],
                  stride: tuple[int, int], dilation: tuple[int, int], out_hw: tuple[int, int]) -> None:
    """Adds each kernel tap's [N, H_out, W_out, C] contribution into the padded NHWC `out` at
    the input pixels that tap read (the adjoint of `_windows`), one strided slice a tap. The
    taps go last to first, so each pixel sums its windows in row-major window order, as
    PyTorch's pooling backward loops do (the same float32 sums, not only close ones)."""
    (sh, sw), (dh, dw), (ho, wo) = stride, dilation, out_hw
    for i in reversed(range(kernel[0])):
        for j in reversed(range(kernel[1])):
            out[:, i * dh : i * dh + (ho - 1) * sh + 1 : sh, j * dw : j * dw + (wo - 1) * sw + 1 : sw] += taps(i, j)


def _crop(padded: Array, padding: tuple[int, int], h: int, w: int) -> Array:
    return np.ascontiguousarray(padded[:, padding[0] : padding[0] + h, padding[1] : padding[1] + w])


def _conv2d_input_grad(arrays: list[Array], scalar: float | None, input_shape: tuple[int, ...],
                       stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                       groups: int) -> Array:
    grad, weight = arrays
    n, h, w, c_in = input_shape
    c_out, c_in_g, kh, kw = weight.shape
    ho, wo = grad.shape[1:3]
    c_out_g = c_out // groups
    dx = np.zeros((n, h + 2 * padding[0], w + 2 * padding[1], c_in), np.result_type(grad, weight))
    # Every tap of a group in one matmul, [N*Ho*Wo, C_out/g] @ [.., C_in/g*kH*kW], the groups
    # batched; group g's columns are channels g*C_in/g.. of the input, in order.
    gg = _grouped(grad.reshape(n * ho * wo, groups, c_out_g))
    wg = weight.reshape(groups, c_out_g, c_in_g * kh * kw)
    cols = (gg @ wg).transpose(1, 0, 2).reshape(n, ho, wo, c_in, kh, kw)
    _scatter_taps(dx, lambda i, j: cols[..., i, j], (kh, kw), stride, dilation, (ho, wo))
    return _crop(dx, padding, h, w)


def _conv2d_weight_grad(arrays: list[Array], scalar: float | None, weight_shape: tuple[int, ...],
                        stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
                        groups: int) -> Array:
    x, grad = arrays
    c_out, c_in_g, kh, kw = weight_shape
    win = _windows(x, (kh, kw), stride, padding, dilation, x.dtype.type(0))
    rows = math.prod(win.shape[:3])
    c_out_g = c_out // groups
    # im2col: [C_out/g, N*Ho*Wo] @ [N*Ho*Wo, C_in/g*kH*kW] a group, the groups batched.
    cols = _grouped(win.reshape(rows, groups, c_in_g * kh * kw))
    gg = _grouped(grad.reshape(rows, groups, c_out_g))
    dw = gg.transpose(0, 2, 1) @ cols
    return dw.reshape(tuple(weight_shape)).astype(np.result_type(x, grad), copy=False)


def _valid_taps(size: int, out: int, kernel: int, stride: int, padding: int) -> Array:
    """[out, kernel]: whether tap k of window o reads an input pixel (not padding)."""
    pos = np.arange(out)[:, None] * stride - padding + np.arange(kernel)[None, :]
    return (pos >= 0) & (pos < size)


def _max_pool2d_backward(arrays: list[Array], scalar: float | None, kernel_size: tuple[int, int],
                         stride: tuple[int, int], padding: tuple[int, int]) -> Array:
    x, grad = arrays
    n, h, w, c = x.shape
    (kh, kw), (ho, wo) = kernel_size, grad.shape[1:3]
    win = _windows(x, kernel_size, stride, padding, (1, 1), x.dtype.type(0))
    vy = _valid_taps(h, ho, kh, stride[0], padding[0])
    vx = _valid_taps(w, wo, kw, stride[1], padding[1])
    # PyTorch's CPU scan, per window: the tap starts at the first input pixel with -inf as the
    # maximum; a pixel becomes the tap when it is greater than the maximum or NaN.
    is_float = x.dtype.kind == "f"
    best = np.full((n, ho, wo, c), -np.inf if is_float else np.iinfo(np.int64).min, x.dtype)
    tap = np.full((n, ho, wo, c), -1, np.int64)
    for i in range(kh):
        for j in range(kw):
            v = win[..., i, j]
            valid = (vy[:, i][:, None] & vx[:, j][None, :])[None, :, :, None]
            better = valid & ((v > best) | np.isnan(v)) if is_float else valid & (v > best)
            tap = np.where(better | (valid & (tap < 0)), i * kw + j, tap)
            best = np.where(better, v, best)
    dx = np.zeros((n, h + 2 * padding[0], w + 2 * padding[1], c), grad.dtype)
    zero = grad.dtype.type(0)
    _scatter_taps(dx, lambda i, j: np.where(tap == i * kw + j, grad, zero), kernel_size, stride, (1, 1), (ho, wo))
    return _crop(dx, padding, h, w)


def _avg_pool2d_backward(arrays: list[Array], scalar: float | None, input_shape: tuple[int, ...],
                         kernel_size: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
                         count_include_pad: bool) -> Array:
    grad = arrays[0]
    n, h, w, c = input_shape
    (kh, kw), (ho, wo) = kernel_size, grad.shape[1:3]
    if count_include_pad:
        divisor = np.full((ho, wo), kh * kw, np.float32)
    else:  # the window's pixels inside the input
        divisor = np.outer(_valid_taps(h, ho, kh, stride[0], padding[0]).sum(1),
                           _valid_taps(w, wo, kw, stride[1], padding[1]).sum(1)).astype(np.float32)
    share = grad / divisor[None, :, :, None]
    dx = np.zeros((n, h + 2 * padding[0], w + 2 * padding[1], c), grad.dtype)
    _scatter_taps(dx, lambda i, j: share, kernel_size, stride, (1, 1), (ho, wo))
    return _crop(dx, padding, h, w)


def _alone(arrays: list[Array], scalar: float | None, **attrs_: Any) -> Array:
    """A collective in a group of one chip: every one is the identity there (the gather of one
    shard, the sum of one term, a broadcast from and to the one chip)."""
    return arrays[0]


OPS: dict[str, OpDef] = {
    op.name: op
    for op in (
        OpDef("add", 2, _binary(np.add)),
        OpDef("sub", 2, _binary(np.subtract)),
        OpDef("mul", 2, _binary(np.multiply)),
        OpDef("gt", 2, _compare(np.greater)),
        OpDef("matmul", 2, _matmul),
        OpDef("relu", 1, _unary(lambda x: np.maximum(x, x.dtype.type(0)))),
        OpDef("neg", 1, _unary(np.negative)),
        OpDef("gelu", 1, _gelu, float_only=True),
        OpDef("exp", 1, _unary(np.exp), float_only=True),
        OpDef("sqrt", 1, _unary(np.sqrt), float_only=True),
        OpDef("reciprocal", 1, _unary(lambda x: np.reciprocal(x)), float_only=True),
        OpDef("softmax", 1, _softmax, float_only=True),
        OpDef("sum", 1, _sum),
        OpDef("max", 1, _max),
        OpDef("transpose", 1, _unary(lambda x: np.swapaxes(x, -1, -2))),
        OpDef("reshape", 1, lambda arrays, scalar, shape: arrays[0].reshape(tuple(shape))),
        OpDef("typecast", 1, _typecast),
        # Format version 2.
        OpDef("eq", 2, _compare(np.equal)),
        OpDef("ne", 2, _compare(np.not_equal)),
        OpDef("lt", 2, _compare(np.less)),
        OpDef("le", 2, _compare(np.less_equal)),
        OpDef("ge", 2, _compare(np.greater_equal)),
        OpDef("maximum", 2, _binary(np.maximum)),
        OpDef("minimum", 2, _binary(np.minimum)),
        OpDef("embedding", 2, _embedding),
        OpDef("update_cache", 3, _update_cache),
        OpDef("where", 3, _where),
        OpDef("layer_norm", 3, _layer_norm, float_only=True),
        OpDef("rms_norm", 2, _rms_norm, float_only=True),
        OpDef("conv2d", 3, _conv2d, float_only=True),
        OpDef("concat", -1, _concat),
        OpDef("arange", 0, _arange),
        OpDef("slice", 1, _slice),
        OpDef("permute", 1, _permute),
        OpDef("argmax", 1, _argmax),
        OpDef("mean", 1, _mean, float_only=True),
        OpDef("rsqrt", 1, _unary(lambda x: x.dtype.type(1) / np.sqrt(x)), float_only=True),
        OpDef("tanh", 1, _unary(np.tanh), float_only=True),
        OpDef("sigmoid", 1, _unary(_sigmoid_of), float_only=True),
        OpDef("silu", 1, _unary(lambda x: x * _sigmoid_of(x)), float_only=True),
        OpDef("pow", 1, lambda arrays, scalar: np.power(arrays[0], arrays[0].dtype.type(scalar)),
              float_only=True),
        OpDef("max_pool2d", 1, _max_pool2d),
        OpDef("avg_pool2d", 1, _avg_pool2d, float_only=True),
        # Format version 3.
        OpDef("div", 2, _binary(np.divide), float_only=True),
        OpDef("log", 1, _unary(np.log), float_only=True),
        OpDef("erf", 1, _erf, float_only=True),
        OpDef("abs", 1, _unary(np.abs)),
        OpDef("full", 0, _full),
        OpDef("broadcast_to", 1, _broadcast_to),
        OpDef("rand", 1, _rand),
        OpDef("gather", 2, _gather),
        OpDef("embedding_grad", 2, _embedding_grad, float_only=True),
        OpDef("conv2d_input_grad", 2, _conv2d_input_grad, float_only=True),
        OpDef("conv2d_weight_grad", 2, _conv2d_weight_grad, float_only=True),
        OpDef("max_pool2d_backward", 2, _max_pool2d_backward),
        OpDef("avg_pool2d_backward", 1, _avg_pool2d_backward, float_only=True),
        # Format version 4: float32 numpy (sin and cos within 1 ulp, as torch's CPU kernels; round
        # is half to even, as torch.round).
        OpDef("sin", 1, _unary(np.sin), float_only=True),
        OpDef("cos", 1, _unary(np.cos), float_only=True),
        OpDef("floor", 1, _unary(np.floor), float_only=True),
        OpDef("ceil", 1, _unary(np.ceil), float_only=True),
        OpDef("round", 1, _unary(np.rint), float_only=True),
        OpDef("trunc", 1, _unary(np.trunc), float_only=True),
        # Format version 5: numpy's, on integers (int64) and floats (float32). remainder and
        # floor_divide are Python's (and torch's) floored ones, fmod C's truncated one; an integer
        # divided by 0 gives 0 (a device op has no way to raise; CPU torch raises).
        OpDef("remainder", 2, _binary(np.remainder)),
        OpDef("floor_divide", 2, _binary(np.floor_divide)),
        OpDef("fmod", 2, _binary(np.fmod)),
        OpDef("cumsum", 1, _cumsum),
        OpDef("argsort", 1, _argsort),
        OpDef("atan2", 2, _binary(np.arctan2), float_only=True),
        # Format version 6: integer bitwise logic and shifts (INT32 and UINT32 only), computed
        # in int64 as torch's int64 ops and stored wrapped, which gives torch's int32 results;
        # and prod, a reduction as sum is.
        OpDef("bitwise_and", 2, _binary(np.bitwise_and), int_only=True),
        OpDef("bitwise_or", 2, _binary(np.bitwise_or), int_only=True),
        OpDef("bitwise_xor", 2, _binary(np.bitwise_xor), int_only=True),
        OpDef("left_shift", 2, _left_shift, int_only=True),
        OpDef("right_shift", 2, _right_shift, int_only=True),
        OpDef("prod", 1, _prod),
        # Format version 7: the collectives, as a group of one chip computes them (see above).
        *(OpDef(name, 1, _alone) for name in (
            "all_gather", "reduce_scatter", "all_reduce", "broadcast", "point_to_point", "all_to_all")),
    )
}

COLLECTIVES = frozenset({"all_gather", "reduce_scatter", "all_reduce", "broadcast", "point_to_point",
                         "all_to_all"})
"""The ops whose result depends on the other chips of a mesh (run by `_mesh.collectives`)."""
















