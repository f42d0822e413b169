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

This module imports nothing else from `ttflow.torch` (whose `__init__` installs a torch device),
so it can be loaded by path; `UnsupportedOpError` is defined here for that reason.
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import torch

import ttflow as tt

__all__ = [
    "DECOMPOSITIONS", "TRACING", "InputSpec", "Lowered", "OutputSpec", "UnsupportedOpError",
    "device_dtype", "device_shape", "lower",
]

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


from ._errors import UnsupportedOpError

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
    if len(dims) == 2 or _tiled_bytes(dims) <= 2 * math.prod(dims):
        return dims
    # Tiles pad the last two dims to 32: a conv weight's 3x3 kernel would take a whole 32x32
    # tile (113x its bytes), NHWC-less activations' small trailing dims likewise. Such a tensor
    # lives as the 2-D [rows, cols] split of its dims that pads least (ttnn flattens conv
    # weights and activations too); programs reshape it to its torch shape inside.
    splits = [(math.prod(dims[:k]), math.prod(dims[k:])) for k in range(1, len(dims))]
    best = min(splits, key=_tiled_bytes)
    return best if _tiled_bytes(best) < _tiled_bytes(dims) else dims


def _tiled_bytes(dims: Sequence[int]) -> int:
    """Elements a TILE layout holds for `dims`: the last two padded to 32."""
    rows, cols = dims[-2], dims[-1]
    return math.prod(dims[:-2]) * (-(-rows // 32) * 32) * (-(-cols // 32) * 32)


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


# -- decompositions ----------------------------------------------------------------------------------


def _sdpa_cpu_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor,
                       dropout_p: float, is_causal: bool, attn_mask: torch.Tensor | None = None,
                       scale: float | None = None) -> tuple[torch.Tensor, ...]:
    """The math form of `_scaled_dot_product_flash_attention_for_cpu_backward`.

    torch's core decomposition of the forward op (kept in DECOMPOSITIONS) returns the attention
    probabilities P [..., L, S] where the kernel returns logsumexp [..., L], and autograd saves
    that for the backward; with the real kernel's logsumexp, P is recomputed from it."""
    torch._check(dropout_p == 0.0, lambda: "SDPA backward: dropout needs the math path")
    torch._check(query.size(1) == key.size(1), lambda: "SDPA backward: grouped-query attention is not supported")
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    opmath = torch.float32
    q, k, v, g = (t.to(opmath) for t in (query, key, value, grad_out))
    if logsumexp.dim() == query.dim():
        p = logsumexp.to(opmath)
    else:
        s = torch.matmul(q, k.transpose(-2, -1)) * scale
        if is_causal:
            keep = torch.ones(s.size(-2), s.size(-1), dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
        p = torch.exp(s - logsumexp.to(opmath).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), g)
    dp = torch.matmul(g, v.transpose(-2, -1))
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def _log1p(x: torch.Tensor) -> torch.Tensor:
    """log(1 + x) without the cancellation of the plain form (Goldberg's correction: where
    1 + x rounds to u, log(u) * x / (u - 1) is accurate to a few ulps); tiny x gives x itself."""
    u = x + 1
    d = u - 1
    return torch.where(d == 0, x, torch.where(torch.isinf(u), u, torch.log(u) * (x / d)))


def _conv1d_as_2d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, stride: Sequence[int],
                  padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                  output_padding: Sequence[int], groups: int) -> Any:
    """A 1-d convolution as the 2-d one over a height of 1 (as ttnn runs conv1d)."""
    if x.dim() != 3 or transposed:
        return NotImplemented
    y = aten.convolution.default(x.unsqueeze(2), w.unsqueeze(2), bias, [1, stride[0]], [0, padding[0]],
                                 [1, dilation[0]], False, [0, 0], groups)
    return y.squeeze(2)


def _conv1d_backward_as_2d(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias_sizes: Any,
                           stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                           transposed: bool, output_padding: Sequence[int], groups: int,
                           mask: Sequence[bool]) -> Any:
    if x.dim() != 3 or transposed:
        return NotImplemented
    gi, gw, gb = aten.convolution_backward.default(
        grad.unsqueeze(2), x.unsqueeze(2), w.unsqueeze(2), bias_sizes, [1, stride[0]], [0, padding[0]],
        [1, dilation[0]], False, [0, 0], groups, mask)
    return (None if gi is None else gi.squeeze(2), None if gw is None else gw.squeeze(2), gb)


def _nearest_factors(in_hw: Sequence[int], out_hw: Sequence[int], scales: Sequence[float | None]) -> tuple[int, int] | None:
    """(kh, kw) when nearest upsampling from in_hw to out_hw repeats each pixel kh x kw times."""
    factors = []
    for i, o, scale in zip(in_hw, out_hw, scales):
        if o % i or (scale is not None and scale != o // i):
            return None
        factors.append(o // i)
    return factors[0], factors[1]


def _upsample_nearest2d(x: torch.Tensor, output_size: Sequence[int], scales_h: float | None = None,
                        scales_w: float | None = None) -> Any:
    """Nearest upsampling by whole factors (U-Net decoders) as a broadcast: each pixel repeated
    kh x kw times, which is what torch's index rule gives for them."""
    n, c, h, w = x.shape
    factors = _nearest_factors((h, w), output_size, (scales_h, scales_w))
    if factors is None:
        return NotImplemented
    kh, kw = factors
    return x.reshape(n, c, h, 1, w, 1).expand(n, c, h, kh, w, kw).reshape(n, c, h * kh, w * kw)


def _upsample_nearest2d_backward(grad: torch.Tensor, output_size: Sequence[int], input_size: Sequence[int],
                                 scales_h: float | None = None, scales_w: float | None = None) -> Any:
    n, c, h, w = input_size
    factors = _nearest_factors((h, w), output_size, (scales_h, scales_w))
    if factors is None:
        return NotImplemented
    kh, kw = factors
    return grad.reshape(n, c, h, kh, w, kw).sum((3, 5))


def _decompositions() -> dict[Any, Callable[..., Any]]:
    from torch._decomp import core_aten_decompositions, get_decompositions

    table = dict(core_aten_decompositions())
    # Ops torch can decompose but core ATen keeps; their pieces all lower.
    table.update(get_decompositions([aten.hardtanh, aten.leaky_relu, aten.hardsigmoid, aten.hardswish]))
    # Batch norm, in training (batch statistics, running stats as functional outputs) and in
    # eval: core ATen keeps it, torch's own decompositions make it arithmetic.
    table.update(get_decompositions([
        aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
        aten._native_batch_norm_legit_no_training, aten.native_batch_norm_backward,
    ]))
    # Norms (clip_grad_norm_) become pow/abs/sum/amax; log1p (softplus, BCE with logits) the
    # exact-to-a-few-ulps form below.
    table.update(get_decompositions([aten.linalg_vector_norm, aten.native_group_norm,
                                     aten.native_group_norm_backward]))
    table[aten.log1p.default] = _log1p
    table[aten.upsample_nearest2d.default] = _upsample_nearest2d
    table[aten.upsample_nearest2d_backward.default] = _upsample_nearest2d_backward
    table[aten.convolution.default] = _conv1d_as_2d
    table[aten.convolution_backward.default] = _conv1d_backward_as_2d
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _sdpa_cpu_backward
    from ._fused import DECOMPOSITIONS as fused  # torch's fused attention fast paths

    table.update(fused)
    from ._foreach_decomp import DECOMPOSITIONS as foreach  # a compiled optimizer step

    table.update(foreach)
    # Lowered directly: a decomposition would lose the pattern (dropout's mask is one rand op,
    # max-pool's backward reads the forward input rather than indices).
    for op in (aten.native_dropout.default, aten.max_pool2d_with_indices_backward.default,
               aten.embedding.default, aten.gelu.default):
        table.pop(op, None)
    return table


TRACING = threading.RLock()
"""Held while torch traces a function into a graph (make_fx, AOTAutograd): tracing patches torch
globally (nn.Module.__call__ among others), so two threads tracing at once would restore each
other's patches and leave them in place."""

DECOMPOSITIONS: dict[Any, Callable[..., Any]] = _decompositions()
"""What to pass as `aot_autograd(decompositions=...)`: torch's core-ATen decompositions, a few
more, and the math form of CPU SDPA's backward (see docs/torch-lowering.md)."""


# -- the lowering ------------------------------------------------------------------------------------


@attrs.define
class _T:
    """A lowered torch value: the program value (shape `_ishape(shape)`) and torch's view of it.
    A zero-element value has no program value (`v` is None): the device holds no empty
    tensors, and an op either gives an empty result too or reads only its shape (`_EMPTY`)."""

    v: Any
    shape: tuple[int, ...]
    dtype: torch.dtype


def _ishape(shape: Sequence[int]) -> tuple[int, ...]:
    """The in-program shape of a torch shape: itself, rank 0 as (1,)."""
    dims = tuple(int(d) for d in shape)
    return dims or (1,)


def _meta_tensor(t: _T | float | bool) -> Any:
    if isinstance(t, _T):
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    return t


_LOWERINGS: dict[Any, Callable[..., Any]] = {}
_SEEDED: dict[Any, Callable[[torch.fx.Node], bool]] = {}
"""Random ops: whether a node draws random numbers (and so takes a seed input)."""


def _always(node: torch.fx.Node) -> bool:
    return True


def _register(*ops: Any, seeded: Callable[[torch.fx.Node], bool] | None = None
              ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            _LOWERINGS[op] = fn
            if seeded is not None:
                _SEEDED[op] = seeded
        return fn

    return deco


def _user_line(node: torch.fx.Node) -> str:
    """The innermost user-code frame of a node's stack trace, as ' (at file:line: code)'."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return ""
    path, line, fn, code = frames[-1]
    return f" (at {path}:{line} in {fn}: {code.strip()})"


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


class _Lowering:
    """The state of one `lower` call: the builder, the value of each node, the seeds."""

    def __init__(self, name: str) -> None:
        self.b = tt.ProgramBuilder(name)
        self.seeds: list[Any] = []
        self.next_seed = 0
        self.zeros: set[int] = set()  # ids of values known to be all zeros (full(..., 0))
        self.placeholders: set[int] = set()  # ids of values that stand in for torch's (OutputSpec)
        self.node: torch.fx.Node | None = None

    # -- errors ----------------------------------------------------------------------------

    def unsupported(self, why: str) -> UnsupportedOpError:
        node = self.node
        assert node is not None
        return UnsupportedOpError(f"{_op_name(node.target)}: {why}{_user_line(node)}")

    # -- dtype and shape plumbing -------------------------------------------------------------

    def cast(self, t: _T | Any, dtype: torch.dtype) -> Any:
        """The value of `t` in torch dtype `dtype`'s device dtype (bool: 1 where nonzero)."""
        v = t.v if isinstance(t, _T) else t
        target = _value_dtype(dtype, t.shape if isinstance(t, _T) else v.shape)
        if dtype == torch.bool and not (isinstance(t, _T) and t.dtype == torch.bool):
            v = self.b.ne(v, 0)
        if v.dtype is not target:
            v = self.b.typecast(v, target)
        return v

    def f32(self, t: _T) -> Any:
        return self.cast(t, torch.float32)

    def bool01(self, t: _T) -> Any:
        """1/0 INT32 (nonzero is true)."""
        return self.cast(t, torch.bool)

    def fit(self, v: Any, shape: Sequence[int]) -> Any:
        """`v` reshaped to the in-program shape of torch shape `shape` (same element count)."""
        target = _ishape(shape)
        return v if v.shape == target else self.b.reshape(v, target)

    def operand(self, x: _T | float | bool, dtype: torch.dtype) -> Any:
        """A binary op's operand in `dtype`: a program value, or a Python number."""
        if isinstance(x, _T):
            return self.cast(x, dtype)
        if isinstance(x, bool):
            return int(x)
        if isinstance(x, (int, float)):
            if dtype.is_floating_point:
                return float(x)
            return int(x)
        raise self.unsupported(f"operand {x!r:.40} is neither a tensor nor a number")

    def full(self, shape: Sequence[int], value: float | bool, dtype: torch.dtype) -> Any:
        ddtype = _value_dtype(dtype, shape)
        if isinstance(value, float) and math.isnan(value):
            if not ddtype.is_float:
                raise self.unsupported(f"a NaN constant of the integer type {dtype}")
            # The builder takes no NaN scalar (it would make every element NaN by mistake).
            # float("nan") is the positive quiet NaN: -sqrt(-1) (sqrt(-1) is x86's negative one).
            return self.b.neg(self.zero_by_zero(shape, ddtype))
        number = int(value) if (isinstance(value, bool) or not ddtype.is_float) else float(value)
        v = self.b.full(_ishape(shape), number, ddtype)
        if number == 0:
            self.zeros.add(v.id)
        return v

    def zero_by_zero(self, shape: Sequence[int], ddtype: tt.DataType) -> Any:
        """0/0 as x86 computes it, the NaN torch's mean over nothing gives (sign bit set)."""
        return self.b.sqrt(self.b.full(_ishape(shape), -1.0, ddtype))

    def seed(self) -> Any:
        s = self.seeds[self.next_seed]
        self.next_seed += 1
        return s

    def rand(self, shape: Sequence[int]) -> Any:
        """Uniform [0, 1) FLOAT32 of the in-program shape, from the next seed input."""
        return self.b.rand(_ishape(shape), self.seed())

    def nchw_to_nhwc(self, v: Any) -> Any:
        return self.b.permute(v, (0, 2, 3, 1))

    def nhwc_to_nchw(self, v: Any) -> Any:
        return self.b.permute(v, (0, 3, 1, 2))


def lower(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], name: str) -> Lowered:
    """Lowers one AOTAutograd graph (forward or backward, core ATen under DECOMPOSITIONS, static
    shapes) to one ttflow program named `name`.

    `example_inputs` are the graph's inputs (real or fake tensors: only shape and dtype are
    read), one per placeholder. Raises `UnsupportedOpError` naming the first ATen op (and its
    user code line) that has no lowering, a ttflow `ShapeError`/`LayoutError`/`ProgramError`
    (with a note naming the node) where an op's arguments do not fit the device op."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise tt.ProgramError(f"lower takes a torch.fx.GraphModule, got {type(gm).__name__}")
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    examples = list(example_inputs)
    if len(examples) != len(placeholders):
        raise tt.ProgramError(
            f"{name}: the graph has {len(placeholders)} inputs, {len(examples)} example inputs were given"
        )
    L = _Lowering(name)
    env: dict[torch.fx.Node, Any] = {}

    # Inputs first (the builder wants every input before the first op): placeholders, then seeds.
    specs: list[InputSpec] = []
    for index, (node, example) in enumerate(zip(placeholders, examples)):
        meta = node.meta.get("val", example)
        if not isinstance(example, torch.Tensor) or not isinstance(meta, torch.Tensor):
            raise UnsupportedOpError(
                f"{name}: input {index} ({node.name}) is {type(example).__name__}, not a tensor; "
                "tt programs take tensors with static shapes"
            )
        shape = _static(example.shape, f"input {index} ({node.name})")
        if shape != _static(meta.shape, node.name) or example.dtype != meta.dtype:
            raise tt.ProgramError(
                f"{name}: example input {index} is {shape} {example.dtype}, the graph's placeholder "
                f"{node.name} is {tuple(meta.shape)} {meta.dtype}"
            )
        # A Python float that changes between calls reaches the graph as a 0-d float64 tensor: it
        # is taken in float32, as torch computes `float32_tensor * python_float` in float32.
        dtype = torch.float32 if example.dtype == torch.float64 and not shape else example.dtype
        spec = InputSpec(shape, dtype, device_shape(shape), device_dtype(dtype))
        specs.append(spec)
        env[node] = None if spec.empty else L.b.input(spec.device_shape, spec.layout)
    output_node = next(n for n in graph.nodes if n.op == "output")
    results = output_node.args[0]
    flat = list(results) if isinstance(results, (tuple, list)) else [results]
    live = _live_nodes(graph, flat)
    seeds = sum(1 for n in live if n.op == "call_function" and n.target in _SEEDED and _SEEDED[n.target](n))
    L.seeds = [L.b.input((1, 1), _layout(_I32)) for _ in range(seeds)]
    for node, spec in zip(placeholders, specs):
        env[node] = _T(None if spec.empty else L.fit(env[node], spec.shape), spec.shape, spec.dtype)

    for node in graph.nodes:
        if node.op in ("placeholder", "output") or node not in live:
            continue
        L.node = node
        env[node] = _lower_node(L, node, env)

    outputs: list[OutputSpec] = []
    emitted = 0
    for index, out in enumerate(flat):
        if out is None:
            outputs.append(OutputSpec("none", -1, (), None))
            continue
        if not isinstance(out, torch.fx.Node):
            raise UnsupportedOpError(f"{name}: output {index} is {out!r:.40}, not a tensor or None")
        if out.op == "placeholder":
            spec = specs[placeholders.index(out)]
            outputs.append(OutputSpec("input", placeholders.index(out), spec.shape, spec.dtype))
            continue
        t = env[out]
        if not isinstance(t, _T):
            raise UnsupportedOpError(f"{name}: output {index} ({out.name}) is not a tensor")
        if t.v is None:
            outputs.append(OutputSpec("empty", -1, t.shape, t.dtype))
            continue
        L.b.output(L.b.reshape(t.v, device_shape(t.shape)) if t.v.shape != device_shape(t.shape) else t.v,
                   _layout(device_dtype(t.dtype)))
        outputs.append(OutputSpec("program", emitted, t.shape, t.dtype, t.v.id in L.placeholders))
        emitted += 1
    if emitted == 0:
        # A graph whose outputs are all None or inputs: the program still needs an output
        # (a (1, 1) zero no OutputSpec refers to).
        L.b.output(L.b.full((1, 1), 0.0, _F32), _layout(_F32))
    # The decompositions leave transposes of transposes, reshapes there and back and repeated
    # comparisons: each would cost a run a kernel call and a buffer (`tt.simplify`, bit-exact).
    return Lowered(tt.Binary([tt.simplify(L.b.build())]), tuple(specs), seeds, tuple(outputs))


def _live_nodes(graph: torch.fx.Graph, outputs: Sequence[Any]) -> set[torch.fx.Node]:
    live: set[torch.fx.Node] = set()
    stack = [o for o in outputs if isinstance(o, torch.fx.Node)]
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        stack.extend(node.all_input_nodes)
    return live


def _lower_node(L: _Lowering, node: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
    if node.op == "get_attr":
        return _constant(L, node, getattr(node.graph.owning_module, node.target))  # type: ignore[arg-type]
    if node.op != "call_function":
        raise UnsupportedOpError(f"{node.op} {node.target} has no tt lowering{_user_line(node)}")
    if node.target is operator.getitem:
        source, index = cast(torch.fx.Node, node.args[0]), cast(int, node.args[1])
        part = env[source][index]
        if part is None:
            raise L.unsupported(f"output {index} of {source.name} was not lowered")  # pragma: no cover
        return part
    fn = _LOWERINGS.get(node.target)
    if fn is None:
        raise UnsupportedOpError(f"{_op_name(node.target)} has no tt lowering{_user_line(node)}")
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    meta = node.meta.get("val")
    if _all_empty(meta):  # a zero-element result (a slice to nothing, an op on empties): no op
        return _wrap(L, node, meta, None)
    empty = _empty_inputs(args, kwargs)
    if empty:
        rule = _EMPTY.get(node.target)
        if rule is None:
            raise L.unsupported(f"reads the zero-element tensor {empty[0].shape} and gives a "
                                "non-empty one; the device lowering has no rule for that")
        if rule != "drop":
            if not isinstance(meta, torch.Tensor):
                raise L.unsupported(f"reads the zero-element tensor {empty[0].shape} and gives {meta!r:.40}")
            shape = _static(meta.shape, node.name)
            if rule == "0/0":
                return _wrap(L, node, meta, L.zero_by_zero(shape, _value_dtype(meta.dtype, shape)))
            # The value a reduction over nothing gives: its identity.
            return _wrap(L, node, meta, L.full(shape, rule, meta.dtype))
    with _checked(L, node, meta):
        try:
            result = fn(L, node, *args, **kwargs)
        except UnsupportedOpError:
            raise
        except AttributeError as exc:
            if exc.obj is not L.b:
                raise
            raise L.unsupported(f"needs ttflow's op {exc.name!r}, which this ttflow does not have") from exc
        except tt.TTFlowError as exc:
            exc.add_note(f"while lowering {node.name} = {_op_name(node.target)}{_user_line(node)}")
            raise
        return _wrap(L, node, meta, result)


def _all_empty(meta: Any) -> bool:
    metas = meta if isinstance(meta, (tuple, list)) else (meta,)
    tensors = [m for m in metas if isinstance(m, torch.Tensor)]
    return bool(tensors) and len(tensors) == len(metas) and all(m.numel() == 0 for m in tensors)


def _empty_inputs(args: Any, kwargs: Any) -> list[_T]:
    found: list[_T] = []
    stack = [*args, *kwargs.values()]
    while stack:
        item = stack.pop()
        if isinstance(item, _T) and item.v is None:
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


_EMPTY: dict[Any, Any] = {
    # The op's lowering leaves zero-element inputs out (torch's cat skips them too).
    aten.cat.default: "drop",
    # A reduction over nothing gives its identity, as torch does.
    aten.sum.default: 0, aten.sum.dim_IntList: 0, aten.prod.default: 1, aten.prod.dim_int: 1,
    aten.any.default: False, aten.any.dim: False, aten.any.dims: False,
    aten.all.default: True, aten.all.dim: True, aten.all.dims: True,
    # A product over an empty inner dimension is zeros; a mean over nothing is NaN.
    aten.mm.default: 0, aten.bmm.default: 0, aten.mean.default: "0/0", aten.mean.dim: "0/0",
}
"""Ops that read a zero-element input and give a non-empty result, and how: "drop" (the
lowering skips empty inputs), "0/0" (the NaN of a division by zero) or the constant every
element of the result is."""


_INTEGER_DIVISIONS = frozenset({
    aten.div.Tensor_mode, aten.div.Scalar_mode, aten.floor_divide.default, aten.floor_divide.Scalar,
    aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, aten.fmod.Tensor,
    aten.fmod.Scalar,
})


_INDEXING = frozenset({aten.embedding.default, aten.index_select.default, aten.index.Tensor, aten.gather.default})


def _checked(L: _Lowering, node: torch.fx.Node, meta: Any) -> contextlib.AbstractContextManager[None]:
    """An int64 result lives as INT32 on the device: its integer steps are range-checked, so a
    value past int32 fails the run (a ProgramError naming the op) instead of wrapping, which
    CPU torch's int64 would not. An integer division of any width is checked too: by zero the
    device gives 0, where CPU torch raises ZeroDivisionError; and so are the indices an indexing
    op reads, which the device clamps where torch raises IndexError."""
    metas = [m for m in (meta if isinstance(meta, (tuple, list)) else (meta,)) if isinstance(m, torch.Tensor)]
    if _float_to_integer_cast(node, metas):
        return contextlib.nullcontext()  # it saturates, as silicon's typecast does (docs/torch.md)
    if any(m.dtype == torch.int64 for m in metas):
        return L.b.checking_range(
            f"{_op_name(node.target)} gives an int64 tensor, which the tt device holds as INT32"
            f"{_user_line(node)}"
        )
    if node.target in _INTEGER_DIVISIONS and any(not m.dtype.is_floating_point for m in metas):
        return L.b.checking_range(f"{_op_name(node.target)} divides integers{_user_line(node)}")
    if node.target in _INDEXING:  # torch raises IndexError; the device would clamp
        return L.b.checking_range(f"{_op_name(node.target)} indexes{_user_line(node)}")
    return contextlib.nullcontext()


_CASTS: dict[Any, int] = {aten._to_copy.default: 0, torch.ops.prims.convert_element_type.default: 0, aten.copy.default: 1}
"""Cast ops, with the position of the value they cast."""


def _float_to_integer_cast(node: torch.fx.Node, metas: Sequence[torch.Tensor]) -> bool:
    """A cast from a float to an integer type: the device's typecast truncates and saturates
    (NaN to 0). It is not range-checked: a float outside the integer range (T5's log(0) = -inf
    made a bucket index, then discarded by a `where`) is a value in torch, never an error."""
    position = _CASTS.get(node.target)
    if position is None or len(metas) != 1 or metas[0].dtype.is_floating_point or metas[0].dtype == torch.bool:
        return False
    source = node.args[position] if position < len(node.args) else None
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _wrap(L: _Lowering, node: torch.fx.Node, meta: Any, result: Any) -> Any:
    """Checks a lowering's result against the node's fake value and gives it the torch dtype's
    device dtype; tuples element by element (None where an output is not used)."""
    if isinstance(meta, (tuple, list)):
        if result is None:  # every part empty (`_all_empty`)
            return tuple(_wrap(L, node, m, None) for m in meta)
        return tuple(None if r is None else _wrap(L, node, m, r) for m, r in zip(meta, result))
    if not isinstance(meta, torch.Tensor):
        raise L.unsupported(f"gives {type(meta).__name__}, not a tensor")
    shape = _static(meta.shape, node.name)
    if 0 in shape:
        return _T(None, shape, meta.dtype)
    v = result.v if isinstance(result, _T) else result
    if v.shape != _ishape(shape):
        raise tt.ProgramError(
            f"internal error: lowering {node.name} = {_op_name(node.target)} gave shape {v.shape}, "
            f"torch's is {shape}"
        )
    # A lowering whose torch result is a bool gives 1/0 (a comparison's in its operands' dtype).
    target = _value_dtype(meta.dtype, shape)
    if v.dtype is not target:
        v = L.b.typecast(v, target)
    return _T(v, shape, meta.dtype)


def _constant(L: _Lowering, node: torch.fx.Node, value: Any) -> _T:
    """A small tensor constant held by the graph module, built from `full`s."""
    L.node = node
    if not isinstance(value, torch.Tensor):
        raise L.unsupported(f"get_attr {node.target} is not a tensor")
    if value.numel() == 0:
        return _T(None, _static(value.shape, node.name), value.dtype)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if value.numel() > 1024:
        raise L.unsupported(f"a constant tensor of {value.numel()} elements; pass it as an input")
    with unset_fake_temporarily():  # AOTAutograd may call the compiler inside its fake mode
        t = value.detach().to("cpu")
        flat = t.reshape(-1).tolist()
    if len(set(flat)) == 1:
        v = L.full(t.shape, flat[0], t.dtype)
    else:
        v = L.b.reshape(L.b.concat([L.full((1,), x, t.dtype) for x in flat], 0), _ishape(t.shape))
    return _wrap(L, node, node.meta.get("val", t), v)


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _dims(dims: Any, rank: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({_dim(d, rank) for d in dims})


def _out(node: torch.fx.Node) -> Any:
    return node.meta["val"]


def _used(node: torch.fx.Node) -> set[int]:
    """Which elements of a multi-output node's tuple are read (by getitem)."""
    return {cast(int, u.args[1]) for u in node.users if u.target is operator.getitem}


# -- no-ops and casts --------------------------------------------------------------------------------


@_register(aten.alias.default, aten.clone.default, aten.detach.default, aten.lift_fresh_copy.default,
           aten.contiguous.default, aten.lift_fresh.default)
def _identity(L: _Lowering, node: torch.fx.Node, x: _T, *args: Any, **kwargs: Any) -> Any:
    return x.v


@_register(aten._to_copy.default)
def _to_copy(L: _Lowering, node: torch.fx.Node, x: _T, **kwargs: Any) -> Any:
    return _cast_node(L, node, x, _out(node).dtype)


def _cast_node(L: _Lowering, node: torch.fx.Node, x: _T, dtype: torch.dtype) -> Any:
    """A cast op. From a float to an integer type it saturates as silicon's typecast does:
    infinities go to the ends of INT32, NaN to 0, where CPU torch's x86 conversion gives the
    integer-indefinite value (the most negative one). A finite value past INT32 cast to int64
    is still an error naming the op: CPU torch holds it exactly, the device could not."""
    if not (x.dtype.is_floating_point and not dtype.is_floating_point and dtype != torch.bool):
        return L.cast(x, dtype)
    target = _value_dtype(dtype, x.shape)
    if dtype != torch.int64:
        return L.b.typecast(x.v, target)
    finite = L.b.eq(L.b.sub(x.v, x.v), 0)
    with L.b.checking_range(f"{_op_name(node.target)} casts a float to int64, which the tt device "
                            f"holds as INT32{_user_line(node)}"):
        checked = L.b.typecast(L.b.where(finite, x.v, 0.0), target)
    return L.b.where(finite, checked, L.b.typecast(x.v, target))


def _value_dtype(dtype: torch.dtype, shape: Sequence[int]) -> tt.DataType:
    """The device dtype a value inside a program is held in: `device_dtype`, except that a 0-d
    float64 (a Python float argument, and the casts torch wraps around it) is held in FLOAT32."""
    if dtype == torch.float64 and len(shape) == 0:
        return _F32
    return device_dtype(dtype)


@_register(torch.ops.prims.convert_element_type.default)
def _convert_element_type(L: _Lowering, node: torch.fx.Node, x: _T, dtype: torch.dtype) -> Any:
    """What a decomposition casts with (a float argument of a compiled function, into float32)."""
    return _cast_node(L, node, x, _out(node).dtype)


@_register(aten.copy.default)
def _copy(L: _Lowering, node: torch.fx.Node, dst: _T, src: _T, non_blocking: bool = False) -> Any:
    v = _cast_node(L, node, src, dst.dtype)
    return v if v.shape == _ishape(dst.shape) else L.b.broadcast_to(v, _ishape(dst.shape))


# -- elementwise -------------------------------------------------------------------------------------


def _unary(op: str, float_only: bool = True) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
        dtype = _out(node).dtype
        v = L.cast(x, dtype) if (float_only or dtype != torch.bool) else x.v
        return getattr(L.b, op)(v)

    lower.__name__ = f"_{op}"
    return lower


for _op, _name, _float in [
    (aten.exp.default, "exp", True), (aten.sqrt.default, "sqrt", True),
    (aten.rsqrt.default, "rsqrt", True), (aten.reciprocal.default, "reciprocal", True),
    (aten.tanh.default, "tanh", True), (aten.sigmoid.default, "sigmoid", True),
    (aten.erf.default, "erf", True), (aten.log.default, "log", True),
    (aten.silu.default, "silu", True), (aten.relu.default, "relu", False),
    (aten.neg.default, "neg", False), (aten.abs.default, "abs", False),
    (aten.sin.default, "sin", True), (aten.cos.default, "cos", True),
]:
    _register(_op)(_unary(_name, _float))


def _rounding(op: str) -> Callable[..., Any]:
    """floor/ceil/round/trunc: the op on floats, the value itself on integers (as torch)."""

    def lower(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
        if not x.dtype.is_floating_point:
            return x.v
        return getattr(L.b, op)(L.cast(x, _out(node).dtype))

    lower.__name__ = f"_{op}"
    return lower


for _op, _name in [(aten.floor.default, "floor"), (aten.ceil.default, "ceil"),
                   (aten.round.default, "round"), (aten.trunc.default, "trunc")]:
    _register(_op)(_rounding(_name))


@_register(aten.gelu.default)
def _gelu(L: _Lowering, node: torch.fx.Node, x: _T, approximate: str = "none") -> Any:
    if approximate == "none":
        return L.b.gelu(L.cast(x, _out(node).dtype))
    # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), in float32 then rounded once.
    b, v = L.b, L.f32(x)
    inner = b.mul(b.add(v, b.mul(b.mul(b.mul(v, v), v), 0.044715)), math.sqrt(2.0 / math.pi))
    return b.mul(b.mul(v, 0.5), b.add(b.tanh(inner), 1.0))


@_register(aten.sign.default)
def _sign(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    b, v = L.b, L.cast(x, _out(node).dtype)
    return b.sub(b.gt(v, 0), b.lt(v, 0))


@_register(aten.isnan.default)
def _isnan(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    return L.b.ne(x.v, x.v)


@_register(aten.isinf.default)
def _isinf(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    return L.b.eq(L.b.abs(x.v), math.inf) if x.dtype.is_floating_point else L.full(x.shape, 0, torch.bool)


@_register(aten.isfinite.default)
def _isfinite(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    return L.b.eq(L.b.sub(x.v, x.v), 0) if x.dtype.is_floating_point else L.full(x.shape, 1, torch.bool)


@_register(aten.logical_not.default)
def _logical_not(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    return L.b.eq(L.bool01(x), 0)


@_register(aten.bitwise_not.default)
def _bitwise_not(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    if x.dtype == torch.bool:
        return L.b.eq(x.v, 0)
    return L.b.sub(L.b.neg(x.v), 1)  # two's complement: ~x == -x - 1


@_register(aten.pow.Tensor_Scalar)
def _pow(L: _Lowering, node: torch.fx.Node, x: _T, p: float) -> Any:
    dtype = _out(node).dtype
    if p == 1:
        return L.cast(x, dtype)
    if p == 2:
        v = L.cast(x, dtype)
        return L.b.mul(v, v)
    if dtype.is_floating_point:
        return L.b.pow(L.cast(x, dtype), float(p))
    if not float(p).is_integer() or p < 0:
        raise L.unsupported(f"an integer to the power {p!r} (only whole exponents >= 0 lower exactly)")
    return _integer_power(L, L.cast(x, dtype), int(p), _value_dtype(dtype, x.shape))


def _integer_power(L: _Lowering, v: Any, p: int, ddtype: tt.DataType) -> Any:
    """v ** p by squaring, in integer arithmetic: exact (float32 would round past 2**24), and
    no square is larger than the result, so a range check fails only where the result does."""
    result = None
    while p:
        if p & 1:
            result = v if result is None else L.b.mul(result, v)
        p >>= 1
        if p:
            v = L.b.mul(v, v)
    return result if result is not None else L.b.full(v.shape, 1, ddtype)


@_register(aten.pow.Scalar)
def _pow_scalar(L: _Lowering, node: torch.fx.Node, base: float, x: _T) -> Any:
    if not _out(node).dtype.is_floating_point:
        raise L.unsupported(f"{base!r} to an integer tensor's powers (float32 would round them)")
    if not base > 0:
        raise L.unsupported(f"a base of {base!r}: only a positive base lowers (as exp(x * log(base)))")
    return L.b.exp(L.b.mul(L.f32(x), math.log(base)))


@_register(aten.pow.Tensor_Tensor)
def _pow_tensor(L: _Lowering, node: torch.fx.Node, x: _T, p: _T) -> Any:
    if not _out(node).dtype.is_floating_point:
        raise L.unsupported("an integer to an integer tensor's powers (float32 would round them)")
    b = L.b
    return b.exp(b.mul(L.f32(p), b.log(L.f32(x))))  # NaN for a negative base, as numpy's float pow


def _promote(a: Any, b: Any) -> torch.dtype:
    """torch's result dtype of a binary op on these operands (tensors or numbers)."""
    return torch.result_type(_meta_tensor(a), _meta_tensor(b))


_MIRROR = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le", "eq": "eq", "ne": "ne"}


def _compare(op: str) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, a: Any, other: Any) -> Any:
        dtype = _promote(a, other)
        if not isinstance(a, _T):
            return getattr(L.b, _MIRROR[op])(L.operand(other, dtype), L.operand(a, dtype))
        return getattr(L.b, op)(L.operand(a, dtype), L.operand(other, dtype))

    return lower


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    _register(getattr(aten, _name).Tensor, getattr(aten, _name).Scalar)(_compare(_name))


@_register(aten.add.Tensor, aten.add.Scalar)
def _add(L: _Lowering, node: torch.fx.Node, a: Any, other: Any, alpha: float = 1) -> Any:
    dtype, b = _out(node).dtype, L.b
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    if alpha != 1:
        y = y * alpha if not isinstance(other, _T) else b.mul(y, alpha)
    if dtype == torch.bool:
        return b.ne(b.add(x, y), 0)
    if not isinstance(a, _T):
        return b.add(y, x)
    return b.add(x, y)


@_register(aten.sub.Tensor, aten.sub.Scalar)
def _sub(L: _Lowering, node: torch.fx.Node, a: Any, other: Any, alpha: float = 1) -> Any:
    dtype, b = _out(node).dtype, L.b
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    if alpha != 1:
        y = y * alpha if not isinstance(other, _T) else b.mul(y, alpha)
    if not isinstance(a, _T):
        return b.add(b.neg(y), x)
    return b.sub(x, y)


@_register(aten.mul.Tensor, aten.mul.Scalar)
def _mul(L: _Lowering, node: torch.fx.Node, a: Any, other: Any) -> Any:
    dtype = _out(node).dtype
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    return L.b.mul(y, x) if not isinstance(a, _T) else L.b.mul(x, y)


@_register(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div(L: _Lowering, node: torch.fx.Node, a: Any, other: Any, rounding_mode: str | None = None) -> Any:
    b, dtype = L.b, _out(node).dtype
    if rounding_mode is not None:
        return _rounded_div(L, node, a, other, rounding_mode)
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    if not isinstance(a, _T):
        return b.mul(b.reciprocal(y), x) if x != 1 else b.reciprocal(y)
    return b.div(x, y)


def _tensor_operands(L: _Lowering, a: Any, other: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """Both operands of a non-commutative op in `dtype`: a number as the first becomes a
    one-element constant (the second may stay a number: the builder takes it as the scalar)."""
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    if not isinstance(a, _T):
        x = L.full((1,), x, dtype)
    return x, y


def _rounded_div(L: _Lowering, node: torch.fx.Node, a: Any, other: Any, rounding_mode: str) -> Any:
    """`div(rounding_mode=)` and `//` in the result's dtype, as torch computes them: floor by
    `floor_divide` (integers exactly, floats by torch's fmod-based rule); trunc of floats as
    trunc(a / b), of integers as (a - fmod(a, b)) // b, which divides exactly. (Through float32
    and INT32, as before, integers past 2**24 and quotients past 2**31 came out wrong.)"""
    b, dtype = L.b, _out(node).dtype
    if rounding_mode not in ("trunc", "floor"):
        raise L.unsupported(f"rounding_mode={rounding_mode!r}")
    x, y = _tensor_operands(L, a, other, dtype)
    if rounding_mode == "floor":
        return b.floor_divide(x, y)
    if dtype.is_floating_point:
        return b.trunc(b.div(x, y))
    return b.floor_divide(b.sub(x, b.fmod(x, y)), y)


@_register(aten.floor_divide.default, aten.floor_divide.Scalar)
def _floor_divide(L: _Lowering, node: torch.fx.Node, a: Any, other: Any) -> Any:
    return _rounded_div(L, node, a, other, "floor")


def _modulo(op: str) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, a: Any, other: Any) -> Any:
        return getattr(L.b, op)(*_tensor_operands(L, a, other, _out(node).dtype))

    return lower


_register(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)(_modulo("remainder"))
_register(aten.fmod.Tensor, aten.fmod.Scalar)(_modulo("fmod"))
_register(aten.atan2.default)(_modulo("atan2"))


@_register(aten.atan.default)
def _atan(L: _Lowering, node: torch.fx.Node, x: _T) -> Any:
    return L.b.atan2(L.cast(x, _out(node).dtype), 1.0)  # atan(x) is the angle of (1, x)


@_register(aten.flip.default)
def _flip(L: _Lowering, node: torch.fx.Node, x: _T, dims: Sequence[int]) -> Any:
    """Each flipped axis as a gather of a reversed arange (cumsum's backward flips its grad)."""
    b, v = L.b, x.v
    shape = _ishape(x.shape)
    for axis in _dims(dims, len(x.shape)) if x.shape else []:
        n = shape[axis]
        if n == 1:
            continue
        index = b.reshape(b.arange(n - 1, -1, -1), tuple(n if d == axis else 1 for d in range(len(shape))))
        v = b.gather(v, b.broadcast_to(index, shape), axis)
    return v


@_register(aten.cumsum.default)
def _cumsum(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, dtype: Any = None) -> Any:
    v = L.cast(x, _out(node).dtype)
    if not x.shape:  # a 0-d tensor is its own running sum
        return v
    return L.b.cumsum(v, _dims(dim, len(x.shape))[0])


def _minmax(op: str) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, a: _T, other: _T) -> Any:
        dtype = _out(node).dtype
        return getattr(L.b, op)(L.cast(a, dtype), L.cast(other, dtype))

    return lower


_register(aten.maximum.default)(_minmax("maximum"))
_register(aten.minimum.default)(_minmax("minimum"))


@_register(aten.clamp.default, aten.clamp.Tensor)
def _clamp(L: _Lowering, node: torch.fx.Node, x: _T, lo: Any = None, hi: Any = None) -> Any:
    dtype = _out(node).dtype
    v = L.cast(x, dtype)
    if lo is not None:
        v = L.b.maximum(v, L.operand(lo, dtype))
    if hi is not None:
        v = L.b.minimum(v, L.operand(hi, dtype))
    return v


@_register(aten.clamp_min.default, aten.clamp_min.Tensor)
def _clamp_min(L: _Lowering, node: torch.fx.Node, x: _T, lo: Any) -> Any:
    return _clamp(L, node, x, lo, None)


@_register(aten.clamp_max.default, aten.clamp_max.Tensor)
def _clamp_max(L: _Lowering, node: torch.fx.Node, x: _T, hi: Any) -> Any:
    return _clamp(L, node, x, None, hi)


def _logical(op: str) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, a: _T, other: Any) -> Any:
        if not isinstance(other, _T):
            other = _T(L.full((), other, torch.bool), (), torch.bool)
        x, y = L.bool01(a), L.bool01(other)
        if op == "and":
            return L.b.mul(x, y)
        if op == "or":
            return L.b.maximum(x, y)
        return L.b.ne(x, y)

    return lower


for _name, _kind in (("and", "and"), ("or", "or"), ("xor", "xor")):
    _register(getattr(aten, f"logical_{_name}").default)(_logical(_kind))


def _bitwise(op: str) -> Callable[..., Any]:
    logical = _logical(op)

    def lower(L: _Lowering, node: torch.fx.Node, a: _T, other: Any) -> Any:
        dtype = _out(node).dtype
        if dtype == torch.bool:
            return logical(L, node, a, other)
        return getattr(L.b, f"bitwise_{op}")(L.cast(a, dtype), _integer_operand(L, other, dtype))

    return lower


def _integer_operand(L: _Lowering, other: Any, dtype: torch.dtype) -> Any:
    """A bit op's second operand in `dtype`: a value, or a Python int that INT32 holds (an
    int64 tensor lives as INT32; a wider mask would need its high bits)."""
    if isinstance(other, _T):
        return L.cast(other, dtype)
    value = int(other)
    if not -(2**31) <= value < 2**31:
        raise L.unsupported(f"the integer {value} does not fit INT32, which the tt device holds {dtype} in")
    return value


for _name in ("and", "or", "xor"):
    _register(getattr(aten, f"bitwise_{_name}").Tensor, getattr(aten, f"bitwise_{_name}").Scalar)(_bitwise(_name))


def _shift(op: str) -> Callable[..., Any]:
    def lower(L: _Lowering, node: torch.fx.Node, a: Any, other: Any) -> Any:
        dtype = _out(node).dtype
        if not isinstance(a, _T):  # `2 << x`: the number as a constant of x's shape
            a = _T(L.full(other.shape, a, dtype), other.shape, dtype)
        return getattr(L.b, op)(L.cast(a, dtype), _integer_operand(L, other, dtype))

    return lower


_register(aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar,
          aten.bitwise_left_shift.Scalar_Tensor, aten.__lshift__.Tensor, aten.__lshift__.Scalar)(_shift("left_shift"))
_register(aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
          aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Tensor, aten.__rshift__.Scalar)(_shift("right_shift"))


@_register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(L: _Lowering, node: torch.fx.Node, cond: _T, a: Any, other: Any) -> Any:
    dtype = _out(node).dtype
    x, y = L.operand(a, dtype), L.operand(other, dtype)
    if not isinstance(a, _T) and not isinstance(other, _T):
        x = L.full((), x, dtype)
    return L.b.where(cond.v, x, y)


# -- constants and random values ---------------------------------------------------------------------


@_register(aten.full.default)
def _full(L: _Lowering, node: torch.fx.Node, size: Any, value: Any, **kwargs: Any) -> Any:
    meta = _out(node)
    return L.full(meta.shape, value, meta.dtype)


@_register(aten.full_like.default)
def _full_like(L: _Lowering, node: torch.fx.Node, x: _T, value: Any, **kwargs: Any) -> Any:
    meta = _out(node)
    return L.full(meta.shape, value, meta.dtype)


@_register(aten.new_full.default)
def _new_full(L: _Lowering, node: torch.fx.Node, x: _T, size: Any, value: Any, **kwargs: Any) -> Any:
    meta = _out(node)
    return L.full(meta.shape, value, meta.dtype)


@_register(aten.scalar_tensor.default)
def _scalar_tensor(L: _Lowering, node: torch.fx.Node, value: Any, **kwargs: Any) -> Any:
    return L.full((), value, _out(node).dtype)


@_register(aten.empty.memory_format, aten.empty_like.default, aten.zeros_like.default,
           aten.new_empty.default, aten.empty_strided.default, aten.empty_permuted.default,
           aten.zeros.default, aten.new_zeros.default, aten.new_empty_strided.default)
def _empty(L: _Lowering, node: torch.fx.Node, *args: Any, **kwargs: Any) -> Any:
    meta = _out(node)
    return L.full(meta.shape, 0, meta.dtype)  # uninitialised in torch: zeros here


@_register(aten.arange.start_step, aten.arange.start, aten.arange.default)
def _arange(L: _Lowering, node: torch.fx.Node, *args: Any, **kwargs: Any) -> Any:
    numbers: list[Any] = [a for a in args if isinstance(a, (int, float))]
    if node.target is aten.arange.default:
        start, end, step = 0, numbers[0], 1
    else:
        start, end = numbers[0], numbers[1]
        step = numbers[2] if len(numbers) > 2 else 1
    dtype = _out(node).dtype
    return L.b.arange(start, end, step, device_dtype(dtype))


def _dropout_draws(node: torch.fx.Node) -> bool:
    p = cast(float, node.args[1])
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return train is not False and 0 < p < 1


@_register(aten.native_dropout.default, seeded=_dropout_draws)
def _native_dropout(L: _Lowering, node: torch.fx.Node, x: _T, p: float, train: bool | None) -> Any:
    """Dropout from one `rand`: keep where rand < 1 - p, scale the kept by 1 / (1 - p)."""
    b = L.b
    if not _dropout_draws(node):
        if train is not False and p >= 1:
            return L.full(x.shape, 0, x.dtype), L.full(x.shape, 0, torch.bool)
        return x.v, L.full(x.shape, 1, torch.bool)
    keep = b.lt(L.rand(x.shape), 1.0 - p)  # 1.0 / 0.0, FLOAT32
    out = b.where(keep, b.mul(L.f32(x), 1.0 / (1.0 - p)), 0.0)
    return out, keep


@_register(aten.rand.default, seeded=_always)
def _rand(L: _Lowering, node: torch.fx.Node, size: Any, **kwargs: Any) -> Any:
    return L.rand(_out(node).shape)


@_register(aten.rand_like.default, seeded=_always)
def _rand_like(L: _Lowering, node: torch.fx.Node, x: _T, **kwargs: Any) -> Any:
    return L.rand(_out(node).shape)


@_register(aten.bernoulli.p, seeded=_always)
def _bernoulli(L: _Lowering, node: torch.fx.Node, x: _T, p: float = 0.5, **kwargs: Any) -> Any:
    return L.b.lt(L.rand(x.shape), float(p))


# -- shapes ------------------------------------------------------------------------------------------


@_register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
           aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default, aten.view_copy.default,
           aten.flatten.using_ints)
def _reshape(L: _Lowering, node: torch.fx.Node, x: _T, *args: Any) -> Any:
    return L.fit(x.v, _out(node).shape)


@_register(aten.permute.default)
def _permute(L: _Lowering, node: torch.fx.Node, x: _T, dims: Sequence[int]) -> Any:
    rank = len(x.shape)
    perm = tuple(_dim(d, rank) for d in dims)
    if rank < 2 or perm == tuple(range(rank)):
        return x.v
    return L.b.permute(x.v, perm)


@_register(aten.t.default, aten.transpose.int)
def _transpose(L: _Lowering, node: torch.fx.Node, x: _T, d0: int = 0, d1: int = 1) -> Any:
    rank = len(x.shape)
    if rank < 2:
        return x.v
    perm = list(range(rank))
    i, j = _dim(d0, rank), _dim(d1, rank)
    perm[i], perm[j] = perm[j], perm[i]
    return L.b.permute(x.v, perm) if i != j else x.v


@_register(aten.expand.default, aten.expand_copy.default)
def _expand(L: _Lowering, node: torch.fx.Node, x: _T, size: Any, implicit: bool = False) -> Any:
    target = _ishape(_out(node).shape)
    return x.v if x.v.shape == target else L.b.broadcast_to(x.v, target)


@_register(aten.repeat.default)
def _repeat(L: _Lowering, node: torch.fx.Node, x: _T, repeats: Sequence[int]) -> Any:
    """`x.repeat(*repeats)` (tiling, as np.tile): each dim gets a size-1 axis in front, which
    broadcasts to its repeat count, and each pair then merges (rotary embeddings' cos.repeat)."""
    out = _ishape(_out(node).shape)
    if math.prod(repeats) == 1:
        return L.fit(x.v, out)
    shape = (1,) * (len(repeats) - len(x.shape)) + tuple(x.shape)
    paired = tuple(d for n in shape for d in (1, n))
    tiled = tuple(d for r, n in zip(repeats, shape) for d in (r, n))
    return L.fit(L.b.broadcast_to(L.b.reshape(x.v, paired), tiled), out)


@_register(aten.select.int)
def _select(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: int) -> Any:
    rank = len(x.shape)
    d = _dim(dim, rank)
    if x.shape[d] == 1:  # the whole dim (a foreach's scalar per tensor): only a reshape
        return L.fit(x.v, _out(node).shape)
    i = index % x.shape[d]
    v = L.b.slice(x.v, [None] * d + [i], [None] * d + [i + 1])
    return L.fit(v, _out(node).shape)


@_register(aten.slice.Tensor)
def _slice(L: _Lowering, node: torch.fx.Node, x: _T, dim: int = 0, start: int | None = None,
           end: int | None = None, step: int = 1) -> Any:
    d = _dim(dim, len(x.shape))
    if _static(_out(node).shape, node.name) == x.shape:
        return x.v
    return L.b.slice(x.v, [None] * d + [start], [None] * d + [end], [1] * d + [step])


@_register(aten.constant_pad_nd.default)
def _constant_pad_nd(L: _Lowering, node: torch.fx.Node, x: _T, pad: Sequence[int], value: float = 0) -> Any:
    """F.pad's constant mode: pairs (before, after) from the last dim back; a negative amount
    crops. Each padded dim is a concat of constant blocks around x (cropped first)."""
    b = L.b
    dtype = _out(node).dtype
    v, shape = L.cast(x, dtype), list(x.shape)
    for k in range(len(pad) // 2):
        d = len(shape) - 1 - k
        before, after = int(pad[2 * k]), int(pad[2 * k + 1])
        if before < 0 or after < 0:  # crop first
            start, end = max(-before, 0), shape[d] - max(-after, 0)
            v = b.slice(v, [None] * d + [start], [None] * d + [end])
            shape[d] = end - start
        parts = []
        for amount in (before, after):
            parts.append(L.full(shape[:d] + [amount] + shape[d + 1:], value, dtype) if amount > 0 else None)
        pieces = [p for p in (parts[0], v, parts[1]) if p is not None]
        if len(pieces) > 1:
            v = b.concat(pieces, d)
        shape[d] += max(before, 0) + max(after, 0)
    return v


@_register(aten.cat.default, aten.concat.default)
def _cat(L: _Lowering, node: torch.fx.Node, tensors: Sequence[_T], dim: int = 0) -> Any:
    meta = _out(node)
    parts = [t for t in tensors if 0 not in t.shape]
    d = _dim(dim, len(meta.shape))
    vs = [L.cast(t, meta.dtype) for t in parts]
    return vs[0] if len(vs) == 1 else L.b.concat(vs, d)


@_register(aten.slice_scatter.default)
def _slice_scatter(L: _Lowering, node: torch.fx.Node, x: _T, src: _T, dim: int = 0, start: int | None = None,
                   end: int | None = None, step: int = 1) -> Any:
    """x with x[start:end:step] (along dim) replaced by src: the untouched ends joined around
    the middle; a step > 1 spreads src by interleaving it with zeros (a concat and a reshape)
    and picks it where a 1/0 pattern made the same way says so."""
    b, rank = L.b, len(x.shape)
    d = _dim(dim, rank)
    first, last, _ = slice(start, end, step).indices(x.shape[d])
    dtype = _out(node).dtype
    xv, sv = L.cast(x, dtype), L.cast(src, dtype)
    k, span = src.shape[d], last - first

    def take(v: Any, a: int, e: int) -> Any:
        return b.slice(v, [None] * d + [a], [None] * d + [e])

    if step == 1:
        mid = sv
    else:
        def spread(v: Any) -> Any:
            shape = v.shape[: d + 1] + (1,) + v.shape[d + 1:]
            gaps = L.full(v.shape[: d + 1] + (step - 1,) + v.shape[d + 1:], 0, dtype)
            joined = b.concat([b.reshape(v, shape), gaps], d + 1)
            flat = b.reshape(joined, v.shape[:d] + (k * step,) + v.shape[d + 1:])
            return take(flat, 0, span) if k * step != span else flat

        pattern = spread(L.full(sv.shape, 1, dtype))
        mid = b.where(pattern, spread(sv), take(xv, first, last))
    parts = ([take(xv, 0, first)] if first > 0 else []) + [mid] + (
        [take(xv, last, x.shape[d])] if last < x.shape[d] else [])
    return parts[0] if len(parts) == 1 else b.concat(parts, d)


def _split(L: _Lowering, node: torch.fx.Node, x: _T, sizes: Sequence[int], dim: int) -> tuple[Any, ...]:
    d = _dim(dim, len(x.shape))
    used, out, start = _used(node), [], 0
    for i, n in enumerate(sizes):
        out.append(L.b.slice(x.v, [None] * d + [start], [None] * d + [start + n]) if i in used else None)
        start += n
    return tuple(out)


@_register(aten.split_with_sizes.default)
def _split_with_sizes(L: _Lowering, node: torch.fx.Node, x: _T, sizes: Sequence[int], dim: int = 0) -> Any:
    return _split(L, node, x, sizes, dim)


@_register(aten.split.Tensor)
def _split_tensor(L: _Lowering, node: torch.fx.Node, x: _T, size: int, dim: int = 0) -> Any:
    return _split(L, node, x, [m.shape[_dim(dim, len(x.shape))] for m in _out(node)], dim)


@_register(aten.unbind.int)
def _unbind(L: _Lowering, node: torch.fx.Node, x: _T, dim: int = 0) -> Any:
    d = _dim(dim, len(x.shape))
    parts = _split(L, node, x, [1] * x.shape[d], d)
    return tuple(None if p is None else L.fit(p, m.shape) for p, m in zip(parts, _out(node)))


# -- reductions --------------------------------------------------------------------------------------


def _reduce(L: _Lowering, node: torch.fx.Node, op: str, v: Any, axes: Sequence[int]) -> Any:
    for axis in axes:
        v = getattr(L.b, op)(v, axis)
    meta = _out(node)
    return L.fit(v, (meta[0] if isinstance(meta, tuple) else meta).shape)


def _reduce_input(L: _Lowering, node: torch.fx.Node, x: _T, axes: Sequence[int]) -> Any:
    """x in the result's dtype; bfloat16 reduced over several axes in float32 (one rounding)."""
    dtype = _out(node).dtype
    if dtype == torch.bfloat16 and len(axes) > 1:
        return L.f32(x)
    if dtype == torch.bool:
        return L.bool01(x)
    return L.cast(x, dtype)


@_register(aten.sum.dim_IntList, aten.sum.default)
def _sum(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return _reduce(L, node, "sum", _reduce_input(L, node, x, axes), axes)


@_register(aten.prod.dim_int, aten.prod.default)
def _prod(L: _Lowering, node: torch.fx.Node, x: _T, dim: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
    """The product over a dim (or all): float32 left to right along it, as numpy; CPU torch
    multiplies a contiguous run of 32 or more in vectorised partial products, a few ulps apart."""
    axes = _dims(dim, len(x.shape)) if x.shape else []
    return _reduce(L, node, "prod", _reduce_input(L, node, x, axes), axes)


@_register(aten.mean.dim, aten.mean.default)
def _mean(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False, **kwargs: Any) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return _reduce(L, node, "mean", _reduce_input(L, node, x, axes), axes)


def _variance(L: _Lowering, x: _T, dims: Any, correction: Any) -> tuple[Any, Any, list[int]]:
    """(var, mean) of x over `dims` in float32, kept dims; Bessel's `correction` as torch's."""
    axes = _dims(dims, len(x.shape)) if x.shape and dims is not None else list(range(len(x.shape)))
    v = L.f32(x)
    count = 1
    for axis in axes:
        count *= x.shape[axis]
    mean = v
    for axis in axes:
        mean = L.b.mean(mean, axis)
    centred = L.b.sub(v, mean)
    total = L.b.mul(centred, centred)
    for axis in axes:
        total = L.b.sum(total, axis)
    c = 1.0 if correction is None else float(correction)
    return L.b.div(total, max(count - c, 0.0)), mean, axes


@_register(aten.var_mean.correction)
def _var_mean(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, *, correction: Any = None,
              keepdim: bool = False) -> Any:
    var, mean, _ = _variance(L, x, dims, correction)
    meta_var, meta_mean = _out(node)
    return L.fit(var, meta_var.shape), L.fit(mean, meta_mean.shape)


@_register(aten.var.correction)
def _var(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, *, correction: Any = None,
         keepdim: bool = False) -> Any:
    var, _, _ = _variance(L, x, dims, correction)
    return L.fit(var, _out(node).shape)


@_register(aten.amax.default, aten.max.default)
def _amax(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return _reduce(L, node, "max", x.v, axes)


@_register(aten.amin.default, aten.min.default)
def _amin(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return L.b.neg(_reduce(L, node, "max", L.b.neg(x.v), axes))


@_register(aten.any.dim, aten.any.dims, aten.any.default)
def _any(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return _reduce(L, node, "max", L.bool01(x), axes)


@_register(aten.all.dim, aten.all.dims, aten.all.default)
def _all(L: _Lowering, node: torch.fx.Node, x: _T, dims: Any = None, keepdim: bool = False) -> Any:
    axes = _dims(dims, len(x.shape)) if x.shape else []
    return L.b.eq(_reduce(L, node, "max", L.b.eq(L.bool01(x), 0), axes), 0)


def _arg(L: _Lowering, node: torch.fx.Node, v: Any, shape: tuple[int, ...], dim: int | None) -> Any:
    if dim is None:
        v, axis = L.b.reshape(v, (math.prod(shape) or 1,)), 0
    else:
        axis = _dim(dim, len(shape)) if shape else 0
    return L.fit(L.b.argmax(v, axis), _out(node).shape)


@_register(aten.argmax.default)
def _argmax(L: _Lowering, node: torch.fx.Node, x: _T, dim: int | None = None, keepdim: bool = False) -> Any:
    return _arg(L, node, x.v, x.shape, dim)


@_register(aten.argmin.default)
def _argmin(L: _Lowering, node: torch.fx.Node, x: _T, dim: int | None = None, keepdim: bool = False) -> Any:
    return _arg(L, node, L.b.neg(x.v), x.shape, dim)


@_register(aten.max.dim, aten.min.dim)
def _max_dim(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, keepdim: bool = False) -> Any:
    v = x.v if node.target is aten.max.dim else L.b.neg(x.v)
    axis = _dim(dim, len(x.shape)) if x.shape else 0
    used, meta = _used(node), _out(node)
    values = indices = None
    if 0 in used:
        values = L.fit(L.b.max(v, axis), meta[0].shape)
        values = values if node.target is aten.max.dim else L.b.neg(values)
    if 1 in used:
        indices = L.fit(L.b.argmax(v, axis), meta[1].shape)
    return values, indices


# -- matrix products ---------------------------------------------------------------------------------


@_register(aten.mm.default, aten.bmm.default, aten.matmul.default)
def _mm(L: _Lowering, node: torch.fx.Node, a: _T, b: _T) -> Any:
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise L.unsupported("a rank-1 operand (mv or dot); reshape it to a matrix")
    dtype = _out(node).dtype
    return L.b.matmul(L.cast(a, dtype), L.cast(b, dtype))


@_register(aten.addmm.default, aten.baddbmm.default)
def _addmm(L: _Lowering, node: torch.fx.Node, bias: _T, a: _T, b: _T, beta: float = 1,
           alpha: float = 1) -> Any:
    dtype, bb = _out(node).dtype, L.b
    # bfloat16: the product stays float32 until the bias is added, then rounds once (as torch).
    compute = torch.float32 if dtype == torch.bfloat16 else dtype
    prod = bb.matmul(L.cast(a, compute), L.cast(b, dtype))
    if alpha != 1:
        prod = bb.mul(prod, alpha)
    if beta == 0:
        return prod
    c = L.cast(bias, dtype)
    if beta != 1:
        c = bb.mul(c, beta)
    return bb.add(prod, c)


# -- softmax, norms ----------------------------------------------------------------------------------


@_register(aten._softmax.default)
def _softmax(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, half_to_float: bool = False) -> Any:
    return L.b.softmax(L.cast(x, _out(node).dtype), _dim(dim, len(x.shape)) if x.shape else 0)


@_register(aten._log_softmax.default)
def _log_softmax(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, half_to_float: bool = False) -> Any:
    b, axis = L.b, _dim(dim, len(x.shape)) if x.shape else 0
    v = L.f32(x)
    shifted = b.sub(v, b.max(v, axis))
    return b.sub(shifted, b.log(b.sum(b.exp(shifted), axis)))


@_register(aten.native_layer_norm.default)
def _native_layer_norm(L: _Lowering, node: torch.fx.Node, x: _T, normalized_shape: Sequence[int],
                       weight: _T | None, bias: _T | None, eps: float) -> Any:
    b, k = L.b, len(normalized_shape)
    lead, inner = x.shape[: len(x.shape) - k], math.prod(normalized_shape)
    v = x.v if k == 1 else b.reshape(x.v, (*lead, inner) if lead else (inner,))
    w = None if weight is None else L.fit(weight.v, (inner,))
    bb = None if bias is None else L.fit(bias.v, (inner,))
    used, meta = _used(node), _out(node)
    out = mean = rstd = None
    if 0 in used:
        out = L.fit(b.layer_norm(v, w, bb, eps), x.shape)
    if 1 in used or 2 in used:
        v32 = v if v.dtype is _F32 else b.typecast(v, _F32)
        m = b.mean(v32, -1)
        centred = b.sub(v32, m)
        r = b.rsqrt(b.add(b.mean(b.mul(centred, centred), -1), float(eps)))
        mean, rstd = L.fit(m, meta[1].shape), L.fit(r, meta[2].shape)
    return out, mean, rstd


# -- indexing ----------------------------------------------------------------------------------------


@_register(aten.embedding.default)
def _embedding(L: _Lowering, node: torch.fx.Node, weight: _T, ids: _T, *args: Any) -> Any:
    if len(weight.shape) != 2:
        raise L.unsupported(f"an embedding table of shape {weight.shape}; it must be [rows, dim]")
    return L.b.embedding(ids.v, weight.v)


def _gather_table(L: _Lowering, x: _T, dim: int) -> tuple[Any, tuple[int, ...], list[int]]:
    """x with `dim` moved first and the rest flattened: ([n, rest] table, other dims, perm)."""
    rank = len(x.shape)
    d = _dim(dim, rank)
    perm = [d] + [i for i in range(rank) if i != d]
    v = x.v if d == 0 else L.b.permute(x.v, perm)
    others = tuple(x.shape[i] for i in perm[1:])
    return L.b.reshape(v, (x.shape[d], math.prod(others))), others, perm


@_register(aten.index_select.default)
def _index_select(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: _T) -> Any:
    if not x.shape:
        return x.v
    table, others, perm = _gather_table(L, x, dim)
    rows = L.b.embedding(L.fit(index.v, (math.prod(index.shape) or 1,)), table)
    v = L.b.reshape(rows, (rows.shape[0], *others))
    if perm != list(range(len(perm))):
        v = L.b.permute(v, [perm.index(i) for i in range(len(perm))])
    return v


def _linear_index(L: _Lowering, shape: tuple[int, ...], indices: Sequence[_T | None]
                  ) -> tuple[Any, list[int], tuple[int, ...]]:
    """Advanced indexing's integer index tensors as one flat row index into x seen as
    [prod(indexed dims), prod(other dims)]: (the INT32 row index, broadcast to the indices'
    common shape; the indexed dims; that shape). A negative index counts from the end, as in
    Python; each index is checked against its own dim (an embedding into a zero table of that
    many rows, whose result is added in: 0, and the run fails where torch raises IndexError),
    since the flat index alone could land in range with a bad part."""
    b = L.b
    dims = [d for d, t in enumerate(indices) if t is not None]
    for d in dims:
        t = indices[d]
        assert t is not None
        if t.dtype == torch.bool:
            raise L.unsupported("a boolean mask index (the result's shape depends on the values)")
    common = tuple(torch.broadcast_shapes(*(indices[d].shape for d in dims)))  # type: ignore[union-attr]
    flat, stride = None, 1
    for d in reversed(dims):
        t = indices[d]
        assert t is not None
        size = shape[d]
        v = L.cast(t, torch.int32)
        v = b.add(v, b.mul(b.lt(v, 0), size))
        checked = b.embedding(v, b.full((size, 1), 0, _I32))
        v = b.add(v, b.reshape(checked, v.shape))
        if v.shape != _ishape(common):
            v = b.broadcast_to(L.fit(v, (1,) * (len(common) - len(t.shape)) + t.shape), _ishape(common))
        term = v if stride == 1 else b.mul(v, stride)
        flat = term if flat is None else b.add(flat, term)
        stride *= size
    return flat, dims, common


def _indexed_table(L: _Lowering, x: _T, dims: Sequence[int]) -> tuple[Any, list[int], list[int]]:
    """x with `dims` first, as [prod(dims), prod(rest)]; (the table, the permutation, rest)."""
    rank = len(x.shape)
    rest = [d for d in range(rank) if d not in dims]
    perm = [*dims, *rest]
    v = x.v if perm == list(range(rank)) else L.b.permute(x.v, perm)
    rows = math.prod(x.shape[d] for d in dims)
    return L.b.reshape(v, (rows, math.prod(x.shape[d] for d in rest))), perm, rest


def _index_placement(dims: Sequence[int], n_common: int, n_rest: int) -> list[int] | None:
    """Where torch puts the indexed result's dims: in place of the indexed dims when those are
    adjacent, else first. The permutation from (common..., rest...) to torch's order, or None."""
    first = dims[0]
    if list(dims) != list(range(first, first + len(dims))) or first == 0:
        return None
    common, rest = list(range(n_common)), list(range(n_common, n_common + n_rest))
    return rest[:first] + common + rest[first:]


@_register(aten.index.Tensor)
def _index(L: _Lowering, node: torch.fx.Node, x: _T, indices: Sequence[_T | None]) -> Any:
    """`x[i, j]`, `x[:, i]`, `x[i, :, j]`: integer index tensors on any dims (broadcast
    together), as one embedding of x seen as [indexed rows, the rest]."""
    b = L.b
    if not x.shape:
        raise L.unsupported("indexing a 0-d tensor with a tensor")
    flat, dims, common = _linear_index(L, x.shape, indices)
    table, _, rest = _indexed_table(L, x, dims)
    rows = b.embedding(flat, table)
    full = (*common, *(x.shape[d] for d in rest))
    v = b.reshape(rows, _ishape(full))
    order = _index_placement(dims, len(common), len(rest))
    if order is not None:
        v = b.permute(v, order)
    return L.fit(v, _out(node).shape)


def _sorted(L: _Lowering, x: _T, dim: int, descending: bool) -> tuple[Any, Any, int]:
    """(values, INT32 indices, axis) of x sorted along `dim`: stable, NaN as the largest."""
    if not x.shape:
        raise L.unsupported("sorting a 0-d tensor")
    axis = _dim(dim, len(x.shape))
    index = L.b.argsort(x.v, axis, bool(descending))
    return L.b.gather(x.v, index, axis), index, axis


@_register(aten.sort.default, aten.sort.stable)
def _sort(L: _Lowering, node: torch.fx.Node, x: _T, dim: int = -1, descending: bool = False, *,
          stable: bool | None = None) -> Any:
    values, index, _ = _sorted(L, x, dim, descending)  # always stable: a valid unstable order too
    return values, index


@_register(aten.topk.default)
def _topk(L: _Lowering, node: torch.fx.Node, x: _T, k: int, dim: int = -1, largest: bool = True,
          sorted: bool = True) -> Any:
    """The first k of a stable sort (ties: the earlier index first; CPU torch leaves their order
    unspecified, and its values are the same)."""
    values, index, axis = _sorted(L, x, dim, largest)
    ends = [None] * axis + [int(k)]
    return L.b.slice(values, [0] * (axis + 1), ends), L.b.slice(index, [0] * (axis + 1), ends)


@_register(aten.gather.default)
def _gather(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: _T, sparse_grad: bool = False) -> Any:
    rank = len(x.shape)
    d = _dim(dim, rank) if rank else 0
    v = x.v
    if any(i < n for k, (i, n) in enumerate(zip(index.shape, x.shape)) if k != d):
        # torch reads only the index's extent in the other dims; take_along_axis wants them equal.
        ends = [None if k == d else index.shape[k] for k in range(rank)]
        v = L.b.slice(v, [0] * rank, ends)
    return L.b.gather(v, index.v, d)


def _one_hot(L: _Lowering, shape: tuple[int, ...], d: int, index: Any) -> list[Any]:
    """For each position j along `index`'s dim d: 1 where the target position equals index[..., j, ...]."""
    b = L.b
    iota = b.reshape(b.arange(0, shape[d], 1, _I32), tuple(shape[d] if k == d else 1 for k in range(len(shape))))
    masks = []
    for j in range(index.shape[d]):
        idx = index if index.shape[d] == 1 else b.slice(index, [None] * d + [j], [None] * d + [j + 1])
        masks.append(b.eq(idx, iota))
    return masks


@_register(aten.scatter.value, aten.scatter.src, aten.scatter_add.default)
def _scatter(L: _Lowering, node: torch.fx.Node, x: _T, dim: int, index: _T, src: Any) -> Any:
    """Scatter by one-hot masks (an `arange` compared with the index), one `where` per index
    position along `dim`: right for the small index extents of one-hot targets and scatters."""
    rank = len(x.shape)
    if not rank or not index.shape:
        raise L.unsupported("a scatter into or by a 0-d tensor")
    d = _dim(dim, rank)
    if any(i != n for k, (i, n) in enumerate(zip(index.shape, x.shape)) if k != d):
        raise L.unsupported(f"an index of shape {index.shape} into {x.shape}: other dims must match")
    if index.shape[d] > 64:
        raise L.unsupported(f"{index.shape[d]} index positions along dim {d} (64 at most)")
    dtype = _out(node).dtype
    b, v = L.b, L.cast(x, dtype)
    for j, mask in enumerate(_one_hot(L, x.shape, d, L.fit(index.v, index.shape))):
        if isinstance(src, _T):
            s = L.cast(src, dtype)
            if src.shape[d] != 1:
                s = b.slice(s, [None] * d + [j], [None] * d + [j + 1])
            if s.shape != index.shape:
                s = b.slice(s, [0] * rank, list(index.shape))
        else:
            s = L.operand(src, dtype)
        if node.target is aten.scatter_add.default:
            v = b.add(v, b.where(mask, s, 0))
        else:
            v = b.where(mask, s, v)
    return v


@_register(aten.index_put.default, aten._index_put_impl.default)
def _index_put(L: _Lowering, node: torch.fx.Node, x: _T, indices: Sequence[_T | None], values: _T,
               accumulate: bool = False, unsafe: bool = False) -> Any:
    """Two forms. `x[mask] = value` (one bool mask over x's leading dims, a single value, no
    accumulate: PyTorch passes such masks on purpose) as a `where`. And
    `x.index_put_(indices, values, accumulate=True)` with integer index tensors on any dims (the
    backward of embedding, of `x[i, j]`, of index_select) as `embedding_grad` on x seen as
    [indexed rows, the rest], added to x unless x is a constant zero."""
    given = [i for i, t in enumerate(indices) if t is not None]
    if not x.shape or not given:
        raise L.unsupported("index_put on a 0-d tensor or without an index")
    if any(indices[d].dtype == torch.bool for d in given):  # type: ignore[union-attr]
        return _masked_put(L, x, indices, values, accumulate)
    if not accumulate:
        raise L.unsupported("index_put with integer indices and accumulate=False (duplicate indices "
                            "make the written value depend on the order; accumulate=True lowers)")
    b = L.b
    flat, dims, common = _linear_index(L, x.shape, indices)
    rest = [d for d in range(len(x.shape)) if d not in dims]
    # The values as torch lays out x[indices]: then as (common..., rest...), the table's rows.
    indexed = (*common, *(x.shape[d] for d in rest))
    order = _index_placement(dims, len(common), len(rest))
    laid_out = tuple(indexed[i] for i in order) if order is not None else indexed
    grad = L.cast(values, x.dtype)
    if grad.shape != _ishape(laid_out):
        grad = b.broadcast_to(L.fit(grad, (1,) * (len(laid_out) - len(values.shape)) + values.shape),
                              _ishape(laid_out))
    if order is not None:
        grad = b.permute(grad, [order.index(i) for i in range(len(order))])
    rows = math.prod(x.shape[d] for d in dims)
    width = math.prod(x.shape[d] for d in rest)
    g = b.embedding_grad(L.fit(flat, (math.prod(common),)), b.reshape(grad, (math.prod(common), width)), rows)
    g = b.reshape(g, _ishape((*(x.shape[d] for d in dims), *(x.shape[d] for d in rest))))
    perm = [*dims, *rest]
    if perm != list(range(len(perm))):
        g = b.permute(g, [perm.index(i) for i in range(len(perm))])
    return g if x.v.id in L.zeros else b.add(x.v, g)


def _masked_put(L: _Lowering, x: _T, indices: Sequence[_T | None], values: _T, accumulate: bool) -> Any:
    """`x[mask] = value`: where the mask (over the dims it indexes, broadcast over the rest) is
    true, the value. Only a single value (how many elements a mask selects is known at run
    time only, so a tensor of values has no static layout)."""
    given = [i for i, t in enumerate(indices) if t is not None]
    mask = indices[given[0]]
    assert mask is not None
    first = given[0]
    if len(given) != 1 or accumulate or math.prod(values.shape) != 1:
        raise L.unsupported("index_put with a bool mask lowers as `x[mask] = one value` only")
    if tuple(x.shape[first:first + len(mask.shape)]) != tuple(mask.shape):
        raise L.unsupported(f"a bool mask of shape {mask.shape} for dims {first}.. of {x.shape}")
    b = L.b
    full = (1,) * first + tuple(mask.shape) + (1,) * (len(x.shape) - first - len(mask.shape))
    cond = b.broadcast_to(L.fit(L.bool01(mask), full), _ishape(x.shape))
    value = b.broadcast_to(L.fit(L.cast(values, x.dtype), (1,) * len(x.shape)), _ishape(x.shape))
    return b.where(cond, value, x.v)


# -- convolution and pooling (NCHW in torch, NHWC on the device) --------------------------------------


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, (list, tuple)):
        return (int(v[0]), int(v[-1])) if len(v) else (1, 1)
    return int(v), int(v)


@_register(aten.convolution.default)
def _convolution(L: _Lowering, node: torch.fx.Node, x: _T, w: _T, bias: _T | None, stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                 output_padding: Sequence[int], groups: int) -> Any:
    if transposed:
        return _transposed_convolution(L, node, x, w, bias, stride, padding, dilation, output_padding, groups)
    if len(x.shape) != 4:
        raise L.unsupported(f"a {len(x.shape) - 2}-d convolution (input {x.shape}); conv2d on NCHW lowers")
    dtype = _out(node).dtype
    y = L.b.conv2d(L.nchw_to_nhwc(L.cast(x, dtype)), L.cast(w, dtype),
                   None if bias is None else L.cast(bias, dtype),
                   stride=_pair(stride), padding=_pair(padding), dilation=_pair(dilation), groups=groups)
    return L.nhwc_to_nchw(y)


def _transposed_convolution(L: _Lowering, node: torch.fx.Node, x: _T, w: _T, bias: _T | None,
                            stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                            output_padding: Sequence[int], groups: int) -> Any:
    """ConvTranspose2d is the adjoint of conv2d with the same weight: conv2d's input gradient of
    x, into the output size torch's formula gives (output_padding picks among the sizes a stride
    leaves open), plus the bias per channel."""
    if len(x.shape) != 4:
        raise L.unsupported(f"a {len(x.shape) - 2}-d transposed convolution (input {x.shape}); 2-d lowers")
    dtype = _out(node).dtype
    s, p, d, o = _pair(stride), _pair(padding), _pair(dilation), _pair(output_padding)
    n, _, h, wd = x.shape
    k = w.shape[2:]
    size = [(i - 1) * s[j] - 2 * p[j] + d[j] * (k[j] - 1) + o[j] + 1 for j, i in enumerate((h, wd))]
    channels = w.shape[1] * groups
    y = L.b.conv2d_input_grad(L.nchw_to_nhwc(L.cast(x, dtype)), L.cast(w, dtype), (n, size[0], size[1], channels),
                              stride=s, padding=p, dilation=d, groups=groups)
    if bias is not None:
        y = L.b.add(y, L.cast(bias, dtype))
    return L.nhwc_to_nchw(y)


@_register(aten.convolution_backward.default)
def _convolution_backward(L: _Lowering, node: torch.fx.Node, grad: _T, x: _T, w: _T, bias_sizes: Any,
                          stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                          transposed: bool, output_padding: Sequence[int], groups: int,
                          output_mask: Sequence[bool]) -> Any:
    if len(x.shape) != 4 or (groups != 1 and not transposed):
        raise L.unsupported("only the backward of a 2-d convolution (groups=1 unless transposed) lowers")
    b, used = L.b, _used(node)
    s, p, d = _pair(stride), _pair(padding), _pair(dilation)
    g = L.nchw_to_nhwc(grad.v)
    gi = gw = gb = None
    # A transposed convolution is conv2d's adjoint: its input gradient is conv2d of grad, and
    # its weight gradient is conv2d's with the roles of x and grad swapped.
    if 0 in used and output_mask[0]:
        if transposed:
            gi = b.conv2d(g, w.v, None, stride=s, padding=p, dilation=d, groups=groups)
        else:
            n, c, h, wd = x.shape
            gi = b.conv2d_input_grad(g, w.v, (n, h, wd, c), s, p, d)
        gi = L.nhwc_to_nchw(gi)
    if 1 in used and output_mask[1]:
        xv = L.nchw_to_nhwc(x.v)
        gw = b.conv2d_weight_grad(*((g, xv) if transposed else (xv, g)), w.shape, s, p, d, groups)
    if 2 in used and output_mask[2]:
        v = grad.v
        for axis in (0, 2, 3):
            v = b.sum(v, axis)
        gb = b.reshape(v, (grad.shape[1],))
    return gi, gw, gb


def _pool_args(L: _Lowering, kernel: Any, stride: Any, padding: Any) -> tuple[tuple[int, int], ...]:
    k = _pair(kernel)
    s = k if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0) else _pair(stride)
    return k, s, _pair(padding)


def _as_batched(L: _Lowering, x: _T) -> Any:
    if len(x.shape) == 4:
        return x.v
    if len(x.shape) == 3:
        return L.b.reshape(x.v, (1, *x.shape))
    raise L.unsupported(f"pooling an input of shape {x.shape}; 2-d pooling takes [N, C, H, W]")


def _check_pool(L: _Lowering, node: torch.fx.Node, x: _T, k: tuple[int, int], s: tuple[int, int],
                p: tuple[int, int], ceil_mode: bool, dilation: Any = 1) -> None:
    if _pair(dilation) != (1, 1):
        raise L.unsupported("dilated pooling")
    if ceil_mode:
        floor = tuple((n + 2 * pp - kk) // ss + 1 for n, kk, ss, pp in zip(x.shape[-2:], k, s, p))
        if floor != tuple(_out(node)[0].shape[-2:] if isinstance(_out(node), tuple) else _out(node).shape[-2:]):
            raise L.unsupported("ceil_mode=True where it changes the output size")


@_register(aten.max_pool2d_with_indices.default)
def _max_pool2d_with_indices(L: _Lowering, node: torch.fx.Node, x: _T, kernel_size: Any, stride: Any = None,
                             padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> Any:
    """Values by `max_pool2d`. The indices are a placeholder (-1 everywhere): the backward
    lowering reads the forward input instead (max_pool2d_with_indices_backward below)."""
    k, s, p = _pool_args(L, kernel_size, stride, padding)
    _check_pool(L, node, x, k, s, p, ceil_mode, dilation)
    used, meta = _used(node), _out(node)
    values = indices = None
    if 0 in used:
        y = L.nhwc_to_nchw(L.b.max_pool2d(L.nchw_to_nhwc(_as_batched(L, x)), k, s, p))
        values = L.fit(y, meta[0].shape)
    if 1 in used:
        indices = L.full(meta[1].shape, -1, torch.int64)
        L.placeholders.add(indices.id)
    return values, indices


@_register(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward(L: _Lowering, node: torch.fx.Node, grad: _T, x: _T, kernel_size: Any, stride: Any,
                         padding: Any, dilation: Any, ceil_mode: bool, indices: _T) -> Any:
    k, s, p = _pool_args(L, kernel_size, stride, padding)
    _check_pool(L, node, x, k, s, p, False, dilation)
    g = L.nchw_to_nhwc(_as_batched(L, grad))
    xi = L.nchw_to_nhwc(_as_batched(L, x))
    return L.fit(L.nhwc_to_nchw(L.b.max_pool2d_backward(xi, g, k, s, p)), x.shape)


def _check_avg(L: _Lowering, p: tuple[int, int], count_include_pad: bool, divisor_override: Any) -> None:
    if divisor_override is not None:
        raise L.unsupported("divisor_override")
    if not count_include_pad and p != (0, 0):
        raise L.unsupported("count_include_pad=False with padding")


@_register(aten.avg_pool2d.default)
def _avg_pool2d(L: _Lowering, node: torch.fx.Node, x: _T, kernel_size: Any, stride: Any = None, padding: Any = 0,
                ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: Any = None) -> Any:
    k, s, p = _pool_args(L, kernel_size, stride, padding)
    _check_pool(L, node, x, k, s, p, ceil_mode)
    _check_avg(L, p, count_include_pad, divisor_override)
    y = L.nhwc_to_nchw(L.b.avg_pool2d(L.nchw_to_nhwc(_as_batched(L, x)), k, s, p))
    return L.fit(y, _out(node).shape)


@_register(aten.avg_pool2d_backward.default)
def _avg_pool2d_backward(L: _Lowering, node: torch.fx.Node, grad: _T, x: _T, kernel_size: Any, stride: Any,
                         padding: Any, ceil_mode: bool, count_include_pad: bool, divisor_override: Any) -> Any:
    k, s, p = _pool_args(L, kernel_size, stride, padding)
    _check_avg(L, p, count_include_pad, divisor_override)
    xs = (1, *x.shape) if len(x.shape) == 3 else x.shape
    n, c, h, w = xs
    g = L.nchw_to_nhwc(_as_batched(L, grad))
    return L.fit(L.nhwc_to_nchw(L.b.avg_pool2d_backward(g, (n, h, w, c), k, s, p)), x.shape)
