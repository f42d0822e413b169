"""The core-ATen -> ttflow lowering (ttflow/torch/_lower/).

Each case is captured as torch.compile's `aot_autograd` backend sees it (forward and backward
graphs, with `_lower.DECOMPOSITIONS`), each graph is lowered to one program, run on an emulated
device, and compared with the same graph module run by CPU torch on the same inputs (recorded
when the compiled function ran). The hypothesis tests trace with `make_fx` instead (the same
decompositions, a few milliseconds per graph instead of a few hundred).


"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)

import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.proxy_tensor import make_fx

import ttflow as tt
from ttflow._types import tiled_elements

ttt = pytest.importorskip("ttflow.torch")
from ttflow.torch import _lower

pytestmark = pytest.mark.anyio


# -- capture -----------------------------------------------------------------------------------------


class Graph:
    """One captured graph: the module, its example inputs, and the inputs and outputs of a run."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        self.gm, self.example_inputs = gm, list(example_inputs)
        self.args: list[Any] = []
        self.outs: list[Any] = []


def capture(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], seed: int = 1) -> dict[str, Graph]:
    """The forward and backward graphs AOTAutograd makes of `fn`, with the inputs each was run
    on and what CPU torch computed. The backward is driven by a random output gradient (a
    gradient of ones would hide a transposed matrix)."""
    graphs: dict[str, Graph] = {}

    def compiler(kind: str) -> Callable[..., Any]:
        def compile_(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
            graph = graphs[kind] = Graph(gm, example_inputs)

            def run(*args: Any) -> Any:
                graph.args = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
                out = gm(*args)
                graph.outs = [o.detach().clone() if isinstance(o, torch.Tensor) else o for o in out]
                return out

            return make_boxed_func(run)

        return compile_

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=compiler("fw"), bw_compiler=compiler("bw"),
                           decompositions=_lower.DECOMPOSITIONS)
    result = torch.compile(fn, backend=backend, dynamic=False)(*inputs)
    outs = [o for o in (result if isinstance(result, tuple) else (result,))
            if isinstance(o, torch.Tensor) and o.requires_grad]
    if outs:
        g = torch.Generator().manual_seed(seed)
        torch.autograd.backward(outs, [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs])
    return graphs


def host_array(t: torch.Tensor, spec: Any) -> np.ndarray:
    """A torch tensor as the numpy array `tt.to_device` takes for an input spec."""
    t = t.detach()
    if spec.device_dtype is tt.DataType.INT32:
        a = t.to(torch.int64).numpy().astype(np.int32)
    elif spec.device_dtype is tt.DataType.BFLOAT16:
        a = t.float().numpy().astype(ml_dtypes.bfloat16)
    else:
        a = t.numpy().astype(np.float32)
    return a.reshape(spec.device_shape)


async def run_lowered(lowered: Any, args: Sequence[torch.Tensor], seeds: Sequence[int] = ()) -> list[Any]:
    """Runs a lowered graph on a fresh device; the graph's outputs as torch tensors (None and
    returned inputs as the graph gives them)."""
    assert len(seeds) == lowered.seeds
    async with tt.open_device() as device:
        inputs = [tt.to_device(host_array(a, s), device, s.layout) for a, s in zip(args, lowered.inputs)]
        inputs += [tt.to_device(np.array([[s]], np.int32), device, lowered.seed_layout) for s in seeds]
        program_outs = [await tt.to_host(t) for t in tt.submit(device, lowered.binary, 0, inputs)]
    results: list[Any] = []
    for spec in lowered.outputs:
        if spec.kind == "none":
            results.append(None)
        elif spec.kind == "input":
            results.append(args[spec.index])
        elif spec.placeholder:
            assert (np.asarray(program_outs[spec.index]) == -1).all()
            results.append(None)
        else:
            a = np.asarray(program_outs[spec.index])
            assert a.shape == spec.device_shape
            a = a.astype(np.float32) if spec.dtype.is_floating_point else a.astype(np.int64)
            results.append(torch.from_numpy(a.reshape(spec.shape)).to(spec.dtype))
    return results


def assert_close(got: Sequence[Any], want: Sequence[Any], dtype: torch.dtype, what: str) -> None:
    """float32: 1e-4 relative and absolute (one matmul's reassociation). bfloat16: each step
    rounds to 8 significant bits (a relative step of 2**-8 = 0.4%), and the device and torch
    may round a few intermediate values differently, each a step apart that the next ops carry;
    3% of the output's largest magnitude bounds that by an order of magnitude and still catches a
    wrong op (which is off by O(1))."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None:  # a placeholder (max-pool indices) or a None gradient
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} output {i}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        if not w.dtype.is_floating_point:
            assert torch.equal(g, w), f"{what} output {i}: {g} vs {w}"
            continue
        g32, w32 = g.float(), w.float()
        if dtype == torch.bfloat16 or w.dtype == torch.bfloat16:
            scale = max(1.0, float(w32.abs().max()))
            torch.testing.assert_close(g32, w32, rtol=0, atol=0.03 * scale, msg=lambda m, i=i: f"{what} output {i}: {m}")
        else:
            torch.testing.assert_close(g32, w32, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"{what} output {i}: {m}")


async def check_graphs(graphs: dict[str, Graph], dtype: torch.dtype, name: str) -> None:
    assert set(graphs) >= {"fw"}, "nothing was compiled"
    for kind, graph in graphs.items():
        lowered = _lower.lower(graph.gm, graph.example_inputs, f"{name}_{kind}")
        got = await run_lowered(lowered, graph.args, list(range(11, 11 + lowered.seeds)))
        assert_close(got, graph.outs, dtype, f"{name} {kind}")


# -- the modules -------------------------------------------------------------------------------------


def _x(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


def _model(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    return module.to(dtype).train()


def case_linear(dtype):
    torch.manual_seed(0)
    m = _model(nn.Linear(24, 16), dtype)
    return m, [_x(3, 5, 24, dtype=dtype)]


def case_mlp(dtype):
    torch.manual_seed(0)
    m = _model(nn.Sequential(nn.Linear(12, 20), nn.ReLU(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 6),
                             nn.Sigmoid()), dtype)
    return m, [_x(7, 12, dtype=dtype)]


def case_activations(dtype):
    def fn(x):
        return (F.gelu(x) + F.gelu(x, approximate="tanh") * 0.5 + F.silu(x) - torch.tanh(x)
                + torch.sigmoid(x) * F.relu(x))

    return fn, [_x(6, 10, dtype=dtype)]


def case_softmax(dtype):
    return (lambda x: torch.softmax(x, -1) * 2.0 + torch.log_softmax(x, 0)), [_x(5, 9, dtype=dtype)]


def case_layernorm(dtype):
    torch.manual_seed(0)
    m = _model(nn.LayerNorm(16), dtype)
    with torch.no_grad():
        m.weight.normal_()
        m.bias.normal_()
    return m, [_x(2, 3, 16, dtype=dtype)]


def case_rmsnorm(dtype):
    torch.manual_seed(0)
    m = _model(nn.RMSNorm(16), dtype)
    with torch.no_grad():
        m.weight.normal_()
    return m, [_x(4, 16, dtype=dtype)]


def case_conv(dtype):
    torch.manual_seed(0)
    m = _model(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(4, 5, 3, stride=2, padding=1), nn.AvgPool2d(2), nn.Flatten(),
                             nn.Linear(5, 3)), dtype)
    return m, [_x(2, 3, 8, 8, dtype=dtype)]


def case_embedding(dtype):
    torch.manual_seed(0)
    emb = _model(nn.Embedding(11, 8), dtype)
    ids = torch.tensor([[0, 3, 3, 10], [5, 1, 3, 0], [2, 2, 9, 7]])
    return (lambda i: emb(i) * 2.0), [ids]


def _mha(batch_first: bool, dtype: torch.dtype, need_weights: bool) -> tuple[Any, list[torch.Tensor]]:
    torch.manual_seed(0)
    mha = _model(nn.MultiheadAttention(16, 4, batch_first=batch_first), dtype)
    x = _x(2, 5, 16, dtype=dtype) if batch_first else _x(5, 2, 16, dtype=dtype)
    return (lambda q: mha(q, q, q, need_weights=need_weights)[0]), [x]


def case_mha_batch_first(dtype):
    return _mha(True, dtype, True)


def case_mha_seq_first(dtype):
    return _mha(False, dtype, False)


def case_sdpa(dtype):
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v)), [
        _x(2, 3, 5, 8, dtype=dtype, seed=s) for s in range(3)]


def case_sdpa_causal(dtype):
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), [
        _x(2, 3, 5, 8, dtype=dtype, seed=s) for s in range(3)]


def case_sdpa_mask(dtype):
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, 0] = True
    additive = torch.randn(5, 7, generator=torch.Generator().manual_seed(4)).to(dtype)
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            + F.scaled_dot_product_attention(q, k, v, attn_mask=additive)), [
        _x(2, 3, 5, 8, dtype=dtype, seed=0), _x(2, 3, 7, 8, dtype=dtype, seed=1), _x(2, 3, 7, 8, dtype=dtype, seed=2)]


def case_encoder_layer(dtype):
    torch.manual_seed(0)
    m = _model(nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True), dtype)
    return m, [_x(2, 5, 16, dtype=dtype)]


def case_cross_entropy(dtype):
    torch.manual_seed(0)
    lin = _model(nn.Linear(10, 6), dtype)
    target = torch.tensor([0, 5, 2, 2, 1, 3, 4])
    return (lambda x, t: F.cross_entropy(lin(x), t)), [_x(7, 10, dtype=dtype), target]


def case_mse_l1(dtype):
    torch.manual_seed(0)
    lin = _model(nn.Linear(10, 6), dtype)
    y = _x(7, 6, dtype=dtype, seed=5).detach()
    return (lambda x, t: F.mse_loss(lin(x), t) + F.l1_loss(lin(x), t)), [_x(7, 10, dtype=dtype), y]


CASES: dict[str, tuple[Callable[[torch.dtype], Any], tuple[str, ...]]] = {
    "linear": (case_linear, ()),
    "mlp": (case_mlp, ("full",)),
    "activations": (case_activations, ("full",)),
    "softmax": (case_softmax, ()),
    "layernorm": (case_layernorm, ()),
    "rmsnorm": (case_rmsnorm, ("broadcast_to",)),
    "conv": (case_conv, ("full", "broadcast_to", "conv2d_input_grad", "conv2d_weight_grad",
                         "max_pool2d_backward", "avg_pool2d_backward")),
    "embedding": (case_embedding, ("full", "embedding_grad")),
    "mha_batch_first": (case_mha_batch_first, ("full", "broadcast_to")),
    "mha_seq_first": (case_mha_seq_first, ("full", "broadcast_to")),
    "sdpa": (case_sdpa, ("full", "broadcast_to")),
    "sdpa_causal": (case_sdpa_causal, ("full", "broadcast_to")),
    "sdpa_mask": (case_sdpa_mask, ("full", "broadcast_to")),
    "encoder_layer": (case_encoder_layer, ("full", "broadcast_to")),
    "cross_entropy": (case_cross_entropy, ("full", "gather")),
    "mse_l1": (case_mse_l1, ("full", "broadcast_to")),
}


@functools.cache
def captured(case: str, dtype: torch.dtype) -> dict[str, Graph]:
    fn, inputs = CASES[case][0](dtype)
    return capture(fn, inputs)


DTYPES = [pytest.param(torch.float32, id="f32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
async def test_module_forward_and_backward(case: str, dtype: torch.dtype) -> None:
    await check_graphs(captured(case, dtype), dtype, case)


# -- dropout: one rand per dropout, seeded by an input -----------------------------------------------


async def test_dropout_follows_its_mask_and_seed() -> None:
    p = 0.3
    drop = nn.Dropout(p).train()
    lin = nn.Linear(16, 16)
    graphs = capture(lambda x: drop(lin(x)) * 1.5, [_x(40, 16, dtype=torch.float32)])
    fw, bw = graphs["fw"], graphs["bw"]
    lowered = _lower.lower(fw.gm, fw.example_inputs, "dropout_fw")
    assert lowered.seeds == 1
    assert lowered.inputs[-1].shape == (40, 16)  # seeds are extra program inputs, not specs
    outs = {seed: await run_lowered(lowered, fw.args, [seed]) for seed in (5, 5, 6)}
    out, mask = None, None
    for o in outs[5]:
        if o is not None and o.dtype == torch.bool:
            mask = o
    assert mask is not None, "the forward saves the mask for the backward"
    out = outs[5][0]
    again = next(o for o in outs[5] if o is not None and o.dtype == torch.bool)
    assert torch.equal(mask, again)
    other = next(o for o in outs[6] if o is not None and o.dtype == torch.bool)
    assert not torch.equal(mask, other), "another seed draws another mask"
    keep = mask.float().mean().item()
    assert abs(keep - (1 - p)) < 0.08, keep
    h = fw.args[2] @ fw.args[0].T + fw.args[1]  # lin(x) from the forward's inputs (weight, bias, x)
    torch.testing.assert_close(out, h * mask / (1 - p) * 1.5, rtol=1e-4, atol=1e-4)
    # The backward reads the forward's mask: feed it ours and the gradient is masked the same way.
    bw_lowered = _lower.lower(bw.gm, bw.example_inputs, "dropout_bw")
    assert bw_lowered.seeds == 0
    mask_slots = [i for i, s in enumerate(bw_lowered.inputs) if s.dtype == torch.bool]
    assert len(mask_slots) == 1
    args = list(bw.args)
    args[mask_slots[0]] = mask
    got = await run_lowered(bw_lowered, args)
    bw_ref = bw.gm(*args)
    assert_close(got, bw_ref, torch.float32, "dropout bw")


@pytest.mark.parametrize("p", [0.0, 1.0])
async def test_dropout_that_draws_nothing_takes_no_seed(p: float) -> None:
    drop = nn.Dropout(p).train()
    graphs = capture(lambda x: drop(x) + 1.0, [_x(4, 8, dtype=torch.float32)])
    lowered = _lower.lower(graphs["fw"].gm, graphs["fw"].example_inputs, "dropout_p")
    assert lowered.seeds == 0


# -- the tensor ops users write ----------------------------------------------------------------------


def ops_shapes(x, w, v):
    y = x @ w  # [4, 6, 5]
    a = y.transpose(1, 2).reshape(4, 30).T  # [30, 4]
    b = a.t().view(4, 5, 6).permute(2, 0, 1).flatten(1)  # [6, 20]
    c = torch.cat([b, b * 2.0, v.unsqueeze(0).expand(6, 7)], dim=1)  # [6, 47]
    d = c.unsqueeze(1).squeeze(1).unsqueeze(-1).expand(6, 47, 3).sum(-1)
    return d + v.sum()


def ops_reductions(x, w, v):
    y = x @ w  # [4, 6, 5]
    r = (y.sum(1) + y.mean(dim=(0, 1), keepdim=True).squeeze(0) + y.amax(-1, keepdim=True)[:, 0]
         - y.max(dim=1).values + y.min(dim=2, keepdim=True)[0].squeeze(-1)[:, :5])
    return r * y.sum() + y.mean() + v.max() + v.sum(dtype=torch.float32)


def ops_indexing(x, w, v):
    y = x @ w  # [4, 6, 5]
    idx = torch.tensor([3, 0, 3, 1])
    g = torch.gather(y, 2, torch.tensor([[[1], [0], [4], [2], [2], [3]]]).expand(4, 6, 1))
    return (y[1] + y[1:3].sum(0) + y[..., ::2].sum(-1, keepdim=True) + y[idx].sum(0)
            + torch.index_select(y, 1, torch.tensor([5, 0, 0, 2, 1, 1])).mean(0) + g + y[-1, 2:, -3] .sum())


def ops_elementwise(x, w, v):
    y = x @ w
    pos = y.abs() + 0.5
    r = torch.where(y > 0, y, 0.1 * y) + torch.clamp(y, -0.5, 0.7) + pos.pow(1.5) + pos.sqrt() + torch.exp(-pos)
    r = r + torch.log(pos) - (-y) + 1 - y / pos + 2.0 / pos + y * 2.0 + y ** 2 + torch.rsqrt(pos)
    cmp = (y >= 0.2) & (y < 1.0) | (y == 0.0) | torch.isnan(y) | ~(y <= -1.0)
    r = r + torch.addmm(v[:5], x[0], w, beta=0.5, alpha=2.0)
    return r * cmp + torch.maximum(y, v[:5]) + torch.minimum(y, torch.zeros_like(y)) + y.clamp(min=0.1)


def ops_constants(x, w, v):
    y = x @ w  # [4, 6, 5]
    ar = torch.arange(5, dtype=torch.float32) + torch.arange(0, 10, 2).float()
    k = torch.full((6, 5), 3.0) + torch.ones(5) + torch.scalar_tensor(2.5) + torch.zeros_like(y)
    ints = (y * 4).int()  # truncation toward zero
    back = ints.float() + y.to(torch.bfloat16).float() + (y > 0).float() + y.clone() + y.detach()
    n = ints.sum()
    return back * ar + k - n.float() * 1e-3 + y.long().float()


def ops_modular(x, w, v):
    # Floors and moduli jump: their operands are exact (x times 10 is one rounding on both sides),
    # not a matmul's, whose summation order may differ by an ulp.
    y = x * 10
    q = y // 0.7 + torch.div(y, -1.3, rounding_mode="trunc") + torch.div(y, 2.2, rounding_mode="floor")
    r = y % 1.5 + torch.fmod(y, -0.9) + torch.remainder(y, v[:3].abs() + 0.5) + torch.remainder(3.0, y.abs().detach() + 1)
    c = y.cumsum(1) + y.flip(0, 2) + y.cumsum(-1).flip(1) + torch.roll(y, (2, -1), (1, 2))  # roll: an fmod of an arange
    c = c + y.repeat(1, 2, 2)[:, 3:9, 1:4] + y[0].repeat(4, 1, 1)  # tiling, rank kept and grown
    # Integers past 2**24 (float32's exact range), compared exactly.
    big = (y * 1e6).long() + 100000001
    ints = torch.div(big, 3, rounding_mode="trunc") + big // -7 + big % 9 + torch.fmod(-big, 5) + big.cumsum(0) // 4
    return q.detach() + r + c + (x @ w)[..., :3], ints


def ops_sorting(x, w, v):
    y = x * 10  # exact: ties and order are the same on both sides
    ordered = y.sort(-1, descending=True).values + y.topk(2, 1, largest=False).values.sum(1, keepdim=True)
    ordered = ordered + torch.atan2(y, v[:3] + 2) + torch.atan(y)  # angles, and their gradients
    big = (y * 1e6).long()
    places = (big % 3).sort(dim=1, stable=True).indices + big.topk(2, -1).indices.sum(-1, keepdim=True)
    return ordered + (x @ w)[..., :3], places


OPS = {
    "modular": (ops_modular, ("full", "broadcast_to")),
    "sorting": (ops_sorting, ("full", "broadcast_to")),
    "shapes": (ops_shapes, ("full", "broadcast_to")),
    "reductions": (ops_reductions, ("full", "broadcast_to")),
    "indexing": (ops_indexing, ("full", "broadcast_to", "gather", "embedding_grad")),
    "elementwise": (ops_elementwise, ("full", "broadcast_to")),
    "constants": (ops_constants, ("full", "broadcast_to")),
}


@functools.cache
def captured_ops(name: str, dtype: torch.dtype) -> dict[str, Graph]:
    inputs = [_x(4, 6, 3, dtype=dtype, seed=1), _x(3, 5, dtype=dtype, seed=2), _x(7, dtype=dtype, seed=3)]
    return capture(OPS[name][0], inputs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(OPS))
async def test_tensor_ops_forward_and_backward(name: str, dtype: torch.dtype) -> None:
    await check_graphs(captured_ops(name, dtype), dtype, name)


# -- the interface: specs, errors --------------------------------------------------------------------


def test_device_shape_and_dtype() -> None:
    assert _lower.device_shape(()) == (1, 1)
    assert _lower.device_shape((5,)) == (1, 5)
    assert _lower.device_shape(torch.Size([2, 40, 64])) == (2, 40, 64)  # pads under 2x: kept
    # A conv weight's 3x3 kernel would take a 32x32 tile (113x): it lives as [512, 512 * 9].
    assert _lower.device_shape((512, 512, 3, 3)) == (512, 4608)
    assert _lower.device_shape((512, 256, 1, 1)) == (512, 256)
    assert _lower.device_shape(torch.Size([2, 3, 4])) == (2, 12)  # one 32x32 tile, not two
    for shape in [(3, 5, 11), (1, 1, 1, 1), (4, 64, 16, 16), (2, 4, 8, 8), (7, 33, 65)]:
        flat = _lower.device_shape(shape)
        assert math.prod(flat) == math.prod(shape)
        assert tiled_elements(flat) <= tiled_elements(shape)
    assert _lower.device_dtype(torch.float32) is tt.DataType.FLOAT32
    assert _lower.device_dtype(torch.bfloat16) is tt.DataType.BFLOAT16
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool):
        assert _lower.device_dtype(dtype) is tt.DataType.INT32
    with pytest.raises(_lower.UnsupportedOpError, match="torch.float64"):
        _lower.device_dtype(torch.float64)
    assert issubclass(_lower.UnsupportedOpError, tt.ProgramError)
    assert issubclass(_lower.UnsupportedOpError, NotImplementedError)


def trace(fn: Callable[..., Any], *inputs: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, decomposition_table=_lower.DECOMPOSITIONS, tracing_mode="fake")(*inputs)


def test_an_op_without_lowering_is_named_with_the_user_line() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.matrix_exp(x) + 1.0

    graphs = capture(fn, [_x(3, 3, dtype=torch.float32)])
    with pytest.raises(_lower.UnsupportedOpError, match=r"aten\.linalg_matrix_exp\.default") as info:
        _lower.lower(graphs["fw"].gm, graphs["fw"].example_inputs, "matrix_exp")
    assert "test_torch_lower.py" in str(info.value) and "torch.linalg.matrix_exp(x)" in str(info.value)


def test_unsupported_arguments_are_named() -> None:
    gm = trace(lambda x: F.max_pool2d(x, 2, dilation=2), torch.randn(1, 2, 4, 4))
    with pytest.raises(_lower.UnsupportedOpError, match="max_pool2d.*dilated"):
        _lower.lower(gm, [torch.randn(1, 2, 4, 4)], "pool")
    gm = trace(lambda x: x.masked_select(x > 0).sum(), torch.randn(3))
    with pytest.raises(_lower.UnsupportedOpError):
        _lower.lower(gm, [torch.randn(3)], "dynamic")


def test_bad_inputs_fail_clearly() -> None:
    gm = trace(lambda x, y: x + y, torch.randn(2, 3), torch.randn(3))
    with pytest.raises(tt.ProgramError, match="2 inputs, 1 example"):
        _lower.lower(gm, [torch.randn(2, 3)], "count")
    with pytest.raises(tt.ProgramError, match=r"example input 1 is \(4,\)"):
        _lower.lower(gm, [torch.randn(2, 3), torch.randn(4)], "shape")
    with pytest.raises(tt.ProgramError, match="GraphModule"):
        _lower.lower(lambda x: x, [torch.randn(2)], "fn")  # type: ignore[arg-type]
    gm64 = trace(lambda x: x * 2, torch.randn(2, 3, dtype=torch.float64))
    with pytest.raises(_lower.UnsupportedOpError, match="torch.float64"):
        _lower.lower(gm64, [torch.randn(2, 3, dtype=torch.float64)], "f64")
    gm_empty = trace(lambda x: x * 2, torch.randn(0, 3))  # fine: no input, an empty output
    empty = _lower.lower(gm_empty, [torch.randn(0, 3)], "empty")
    assert empty.inputs[0].empty and [o.kind for o in empty.outputs] == ["empty"]
    gm_reads_empty = trace(lambda b, x: torch.addmm(b, x.T, x), torch.randn(3, 3), torch.randn(0, 3))
    with pytest.raises(_lower.UnsupportedOpError, match=r"addmm.default: reads the zero-element tensor"):
        _lower.lower(gm_reads_empty, [torch.randn(3, 3), torch.randn(0, 3)], "reads_empty")


def test_a_device_op_error_names_the_node() -> None:
    gm = trace(lambda x: F.max_pool2d(x, 2, padding=1), torch.randn(1, 1, 4, 4))
    # Tamper with the graph so the device op refuses it: padding more than half the kernel.
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.max_pool2d_with_indices.default:
            node.args = (node.args[0], [2, 2], [2, 2], [3, 3])
    gm.recompile()
    with pytest.raises(tt.ShapeError) as info:
        _lower.lower(gm, [torch.randn(1, 1, 4, 4)], "pool")
    assert any("max_pool2d_with_indices" in note for note in getattr(info.value, "__notes__", []))


async def test_outputs_that_are_inputs_or_none_are_not_emitted() -> None:
    gm = trace(lambda x, y: (x, y * 2.0, x), torch.randn(2, 3), torch.randn(3))
    gm.graph.output_node().args = ((*gm.graph.output_node().args[0], None),)
    gm.recompile()
    lowered = _lower.lower(gm, [torch.randn(2, 3), torch.randn(3)], "passthrough")
    kinds = [(o.kind, o.index) for o in lowered.outputs]
    assert kinds == [("input", 0), ("program", 0), ("input", 0), ("none", -1)]
    assert lowered.outputs[1].shape == (3,) and lowered.outputs[1].device_shape == (1, 3)
    assert [s.device_shape for s in lowered.inputs] == [(2, 3), (1, 3)]
    x, y = torch.randn(2, 3), torch.randn(3)
    got = await run_lowered(lowered, [x, y])
    assert got[0] is x and got[3] is None
    torch.testing.assert_close(got[1], y * 2.0)


async def test_a_graph_with_no_device_output_still_builds() -> None:
    gm = trace(lambda x: x, torch.randn(2, 3))
    lowered = _lower.lower(gm, [torch.randn(2, 3)], "identity")
    assert [o.kind for o in lowered.outputs] == ["input"]
    assert len(lowered.binary.programs[0].outputs) == 1  # a stand-in the specs do not name


async def test_scalars_and_vectors_keep_their_device_shapes() -> None:
    def fn(v: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> Any:
        return v.sum(), (v * s).unsqueeze(0) + m, m.sum(0), m.mean(), s + 1

    inputs = [torch.randn(4), torch.randn(()), torch.randn(3, 4)]
    gm = trace(fn, *inputs)
    lowered = _lower.lower(gm, inputs, "ranks")
    assert [s.device_shape for s in lowered.inputs] == [(1, 4), (1, 1), (3, 4)]
    assert [o.shape for o in lowered.outputs] == [(), (3, 4), (4,), (), ()]
    got = await run_lowered(lowered, inputs)
    assert_close(got, list(fn(*inputs)), torch.float32, "ranks")


# -- hypothesis: broadcasting and reductions over shapes of rank 0 to 3 --------------------------------

BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b * 0.5, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b.abs() + 1.0), "maximum": torch.maximum,
    "where": lambda a, b: torch.where(a > b, a, b * 2.0), "lt": lambda a, b: a < b,
}


@settings(max_examples=25, deadline=None)
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=5),
       op=st.sampled_from(sorted(BINARY)), data=st.data())
def test_broadcast_then_reduce(shapes: Any, op: str, data: st.DataObject) -> None:
    """An elementwise op on two broadcast shapes (rank 0 and 1 included: they live as (1, 1) and
    (1, n) on the device), then a reduction over some dims, keepdim or not."""
    out_rank = len(shapes.result_shape)
    dims = data.draw(st.lists(st.integers(0, max(out_rank - 1, 0)), unique=True, max_size=out_rank), "dims")
    keepdim = data.draw(st.booleans(), "keepdim")
    reduce = data.draw(st.sampled_from(["sum", "mean", "amax", "none"]), "reduce")

    def fn(a: torch.Tensor, b: torch.Tensor) -> Any:
        y = BINARY[op](a, b)
        if y.dtype == torch.bool:
            return y, y.sum(dims, keepdim=keepdim) if dims else y.sum()
        if reduce == "none" or not out_rank:
            return (y,)
        r = getattr(y, reduce)(dims, keepdim=keepdim) if dims else getattr(y, reduce)()
        return y, r

    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s, generator=g) for s in shapes.input_shapes]
    lowered = _lower.lower(trace(fn, *inputs), inputs, "broadcast")
    got = anyio.run(run_lowered, lowered, inputs)
    assert_close(got, list(fn(*inputs)), torch.float32, "broadcast")


@settings(max_examples=15, deadline=None)
@given(shape=hnp.array_shapes(min_dims=1, max_dims=4, max_side=4), data=st.data())
def test_reshapes_permutes_and_slices(shape: tuple[int, ...], data: st.DataObject) -> None:
    """A permutation, a slice of one dim, an unsqueeze and a flatten: shape plumbing against
    torch's own, forward and (through make_fx of the vjp) backward."""
    rank = len(shape)
    perm = data.draw(st.permutations(range(rank)), "perm")
    dim = data.draw(st.integers(0, rank - 1), "dim")
    start = data.draw(st.integers(0, shape[dim] - 1), "start")
    step = data.draw(st.integers(1, 3), "step")

    def fn(x: torch.Tensor, g: torch.Tensor) -> Any:
        def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            z = x.permute(*perm).transpose(0, -1)
            s = x.movedim(dim, 0)[start::step]
            return (z.flatten().unsqueeze(0) * 2.0).sum(0), s.reshape(-1)

        outs, vjp = torch.func.vjp(f, x)
        return (*outs, *vjp((g[: outs[0].numel()], torch.ones_like(outs[1]))))

    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(shape, generator=gen), torch.randn(math.prod(shape), generator=gen)]
    lowered = _lower.lower(trace(fn, *inputs), inputs, "shapes")
    got = anyio.run(run_lowered, lowered, inputs)
    assert_close(got, list(fn(*inputs)), torch.float32, "shapes")


async def test_encoder_layer_with_dropout_takes_one_seed_per_dropout() -> None:
    """Training-mode dropout inside attention (SDPA's math path) and the layer's three dropouts:
    four seeds. The forward's masks are the device's own; the backward reads the masks it is
    given, so with torch's masks it must match torch's backward."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.2, batch_first=True).train()
    graphs = capture(layer, [_x(2, 5, 16, dtype=torch.float32)])
    fw = _lower.lower(graphs["fw"].gm, graphs["fw"].example_inputs, "enc_fw")
    assert fw.seeds == 4
    got = await run_lowered(fw, graphs["fw"].args, [1, 2, 3, 4])
    assert got[0].shape == (2, 5, 16) and torch.isfinite(got[0]).all()
    bw = _lower.lower(graphs["bw"].gm, graphs["bw"].example_inputs, "enc_bw")
    assert bw.seeds == 0
    assert_close(await run_lowered(bw, graphs["bw"].args), graphs["bw"].outs, torch.float32, "enc bw")


def test_decompositions_keep_sdpa_gradients_exact() -> None:
    """DECOMPOSITIONS swaps CPU SDPA's fused backward for its math form: the compiled gradients
    must still be torch's eager ones."""
    mask = torch.rand(5, 6, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[:, 0] = True
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}, {"scale": 0.3}):
        q, k, v = (_x(2, 3, 5 if i == 0 else 6, 4, dtype=torch.float32, seed=i) for i in range(3))
        fn = functools.partial(F.scaled_dot_product_attention, **kwargs)
        grads = []
        def boxed(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            return make_boxed_func(gm.forward)

        backend = aot_autograd(fw_compiler=boxed, bw_compiler=boxed, decompositions=_lower.DECOMPOSITIONS)
        for run in (fn, torch.compile(fn, backend=backend)):
            torch._dynamo.reset()
            for t in (q, k, v):
                t.grad = None
            (run(q, k, v) * torch.arange(4.0)).sum().backward()
            grads.append([t.grad.clone() for t in (q, k, v)])
        for eager, compiled in zip(*grads):
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
async def test_conv_and_pool_forward(dtype: torch.dtype) -> None:
    """The conv case's forward alone (conv2d, max_pool2d with its placeholder indices,
    avg_pool2d): its device ops predate the backward ones."""
    await check_graphs({"fw": captured("conv", dtype)["fw"]}, dtype, "conv")


async def test_selecting_from_a_dim_of_one_is_a_reshape_not_a_slice() -> None:
    # A foreach optimizer step takes each tensor's scalar with select(0, i) from a (1,) list:
    # on a dim of size 1 that is only a reshape (it had been a slice op per tensor). Forward and
    # backward against CPU torch.
    x = _x(1, 8, 16, dtype=torch.float32)
    graphs = capture(lambda t: t.select(0, 0) * 2 + t.select(0, -1), [x])
    fw = graphs["fw"]
    lowered = _lower.lower(fw.gm, fw.example_inputs, "select_dim1")
    assert "slice" not in {step.op for step in lowered.binary.programs[0].steps}
    await check_graphs(graphs, torch.float32, "select_dim1")
