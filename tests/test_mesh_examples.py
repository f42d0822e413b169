"""Issue 26's worked examples on meshes, each compared with a one-chip run and with numpy.

- A data-parallel training step of a two-layer MLP: the batch sharded over the chips, the
  weights replicated, forward and backward written as one ttflow program, the gradients
  all_reduced, an SGD update on every chip; on an n300 and a T3000 it equals the one-chip step
  on the whole batch: bit for bit when every sum is exact (small integers, power-of-two scales),
  within the documented sum tolerance otherwise (docs/mesh.md, "Sums: their order and their
  tolerance": a batch sum split N ways adds in another order).
- examples/gpt_decode.py's decoder with its attention heads split across a T3000 (a head per
  chip: W_qkv by columns, the K and V caches by heads, W_o by rows and one all_reduce per layer):
  its greedy tokens equal the one-chip run's and numpy's, token for token, every chip picking
  the same one.

The other examples of the issue live beside the code they exercise: the tensor-parallel MLP in
tests/test_collectives.py, two 1x1 submeshes driven by two tasks (tt-mlir's test_data_parallel)
in tests/test_mesh.py.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import pytest

import ttflow as tt

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("spmd_path")]

SMALL = tt.DeviceSpec.small()
BATCH, D_IN, HIDDEN, D_OUT = 64, 32, 64, 16
LR = 2.0**-4


def train_step(rows: int, batch: int = BATCH, lr: float = LR) -> tt.Binary:
    """One SGD step of y = relu(x W1) W2 under the mean squared error, on `rows` rows of a
    global batch of `batch`: each chip's gradients are its rows' share of the batch mean's, so
    their all_reduce is the whole batch's gradient. Outputs: W1', W2', dW1, dW2 and the loss."""
    b = tt.ProgramBuilder("dp_step")
    x, t = b.input((rows, D_IN)), b.input((rows, D_OUT))
    w1, w2 = b.input((D_IN, HIDDEN)), b.input((HIDDEN, D_OUT))
    z = b.matmul(x, w1)
    a = b.relu(z)
    err = b.sub(b.matmul(a, w2), t)
    loss = b.all_reduce(b.mul(b.sum(b.sum(b.mul(err, err), 1), 0), 1.0 / batch))
    g_out = b.mul(err, 2.0 / batch)                           # dL/dy
    g_w2 = b.all_reduce(b.matmul(b.transpose(a), g_out))      # dL/dW2, summed over the chips
    g_z = b.where(b.gt(z, 0.0), b.matmul(g_out, b.transpose(w2)), 0.0)
    g_w1 = b.all_reduce(b.matmul(b.transpose(x), g_z))        # dL/dW1
    b.output(b.sub(w1, b.mul(g_w1, lr)))
    b.output(b.sub(w2, b.mul(g_w2, lr)))
    for v in (g_w1, g_w2, loss):
        b.output(v)
    return tt.Binary([b.build()])


def numpy_step(x: np.ndarray, t: np.ndarray, w1: np.ndarray, w2: np.ndarray, lr: float = LR) -> list[np.ndarray]:
    """The same step in float64 (the exact values the device's float32 rounds)."""
    x, t, w1, w2 = (v.astype(np.float64) for v in (x, t, w1, w2))
    z = x @ w1
    a = np.maximum(z, 0)
    err = a @ w2 - t
    g_out = err * 2 / len(x)
    g_w2 = a.T @ g_out
    g_z = np.where(z > 0, g_out @ w2.T, 0)
    g_w1 = x.T @ g_z
    return [w1 - lr * g_w1, w2 - lr * g_w2, g_w1, g_w2, np.array([[np.sum(err * err) / len(x)]])]


def data(exact: bool, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    shapes = ((BATCH, D_IN), (BATCH, D_OUT), (D_IN, HIDDEN), (HIDDEN, D_OUT))
    if exact:  # -1, 0, 1: every product and sum of one step is exact in float32 (below 2**24,
        # in steps of 2**-9 at the finest: the 2 / BATCH and LR scales are powers of two)
        return tuple(rng.integers(-1, 2, s).astype(np.float32) for s in shapes)
    return tuple((rng.standard_normal(s) / 4).astype(np.float32) for s in shapes)


async def one_chip(x: np.ndarray, t: np.ndarray, w1: np.ndarray, w2: np.ndarray, steps: int) -> list[np.ndarray]:
    """`steps` SGD steps on one device, the whole batch at once (its all_reduces are the identity)."""
    binary = train_step(BATCH)
    async with tt.open_device(SMALL) as device:
        xs, ts = tt.to_device(x, device), tt.to_device(t, device)
        weights = [tt.to_device(w1, device), tt.to_device(w2, device)]
        for _ in range(steps):
            outs = tt.submit(device, binary, 0, [xs, ts, *weights])
            weights = outs[:2]
        return [await tt.to_host(o) for o in outs]


async def data_parallel(spec: tt.MeshSpec, x: np.ndarray, t: np.ndarray, w1: np.ndarray, w2: np.ndarray,
                        steps: int) -> tuple[list[list[np.ndarray]], dict]:
    """`steps` SGD steps on the mesh: the batch sharded by rows, the weights replicated and
    updated on every chip. Each output per chip, and the link bytes."""
    n = spec.num_chips
    binary = train_step(BATCH // n)
    async with tt.open_mesh_device(spec) as mesh:
        xs, ts = tt.to_device(x, mesh, mapper=tt.shard(0)), tt.to_device(t, mesh, mapper=tt.shard(0))
        weights = [tt.to_device(w1, mesh), tt.to_device(w2, mesh)]  # replicated
        for _ in range(steps):
            outs = tt.submit(mesh, binary, 0, [xs, ts, *weights])
            weights = list(outs[:2])  # per-device tensors, one copy per chip: the next step's input
        per_chip = [[await tt.to_host(s) for s in tt.device_tensors(o)] for o in outs]
        return per_chip, {k: v for k, v in mesh.stats.link_bytes.items() if v}


PRESETS = ["n300", "t3000"]


def spec_of(preset: str) -> tt.MeshSpec:
    return attrs.evolve(getattr(tt.MeshSpec, preset)(), chip=SMALL)


@pytest.mark.parametrize("preset", PRESETS)
async def test_data_parallel_training_is_the_one_chip_step_bit_for_bit_when_sums_are_exact(preset: str) -> None:
    x, t, w1, w2 = data(exact=True)
    steps = 1
    per_chip, links = await data_parallel(spec_of(preset), x, t, w1, w2, steps)
    single = await one_chip(x, t, w1, w2, steps)
    want = [w1, w2]
    for _ in range(steps):
        want = numpy_step(x, t, want[0], want[1])
    names = ["W1'", "W2'", "dW1", "dW2", "loss"]
    for name, chips, one, ref in zip(names, per_chip, single, want):
        for k, got in enumerate(chips):  # every chip holds the same weights: the replicas stay in step
            np.testing.assert_array_equal(got, one, err_msg=f"{name} on chip {k}")
        np.testing.assert_array_equal(one, ref.astype(np.float32), err_msg=name)
    # Three all_reduces (dW1 32x64, dW2 64x16, the 1x1 loss), float32.
    n = spec_of(preset).num_chips
    elements = D_IN * HIDDEN + HIDDEN * D_OUT
    if n == 2:  # a line: every all_reduce moves its whole value each way
        assert links == {((0, 0), (0, 1)): steps * 4 * (elements + 1), ((0, 1), (0, 0)): steps * 4 * (elements + 1)}
    else:  # the T3000's ring: 2 (N-1)/N of each value per link (the 1x1 loss: 2 - e(p) - e(p+1))
        assert len(links) == 8 and sum(links.values()) == steps * 4 * (2 * (n - 1) * elements + 2 * n - 2)


@pytest.mark.parametrize("preset", PRESETS)
async def test_data_parallel_training_equals_the_one_chip_step_within_the_sum_tolerance(preset: str) -> None:
    x, t, w1, w2 = data(exact=False, seed=5)
    per_chip, _ = await data_parallel(spec_of(preset), x, t, w1, w2, 1)
    single = await one_chip(x, t, w1, w2, 1)
    assert single[4][0, 0] > 0.1  # a loss to learn from
    want = numpy_step(x, t, w1, w2)
    for chips in per_chip:
        assert all(np.array_equal(c, chips[0]) for c in chips)  # one result on every chip
    # The gradients' batch sums add in another order on the mesh (each chip its rows, then the
    # all_reduce): each of the BATCH - 1 additions rounds once, so the two runs differ by at most
    # 2 BATCH u sum |terms|, u = 2**-24; the terms are x^T g_z's and a^T g_out's products.
    x64, w1_64, w2_64 = (v.astype(np.float64) for v in (x, w1, w2))
    z = x64 @ w1_64
    g_out = np.abs((np.maximum(z, 0) @ w2_64 - t) * 2 / BATCH)
    terms = {"dW1": np.abs(x64).T @ (np.abs(g_out) @ np.abs(w2_64).T), "dW2": np.abs(np.maximum(z, 0)).T @ g_out}
    for index, name in ((2, "dW1"), (3, "dW2")):
        bound = 2 * BATCH * 2.0**-24 * terms[name] + 1e-7
        mesh_grad, one_grad = per_chip[index][0], single[index]
        assert np.all(np.abs(mesh_grad - one_grad) <= bound), name
        assert np.all(np.abs(one_grad - want[index]) <= bound), name
        assert np.all(np.abs(mesh_grad - want[index]) <= bound), name
    for index, name in ((0, "W1'"), (1, "W2'")):  # w - lr g: the gradients' difference, times lr
        np.testing.assert_allclose(per_chip[index][0], single[index], rtol=1e-6, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(per_chip[index][0], want[index], rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(per_chip[4][0], single[4], rtol=1e-5)
    np.testing.assert_allclose(per_chip[4][0], want[4], rtol=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
async def test_a_few_data_parallel_steps_keep_the_replicas_equal_and_the_loss_falling(preset: str) -> None:
    x, t, w1, w2 = data(exact=False, seed=5)
    steps = 4
    per_chip, _ = await data_parallel(spec_of(preset), x, t, w1, w2, steps)
    single = await one_chip(x, t, w1, w2, steps)
    want = [w1, w2]
    losses = []
    for _ in range(steps):
        want = numpy_step(x, t, want[0], want[1])
        losses.append(want[4][0, 0])
    assert losses == sorted(losses, reverse=True)  # SGD learns (the loss before each step)
    for index, chips in enumerate(per_chip):
        assert all(np.array_equal(c, chips[0]) for c in chips)  # the replicas never drift apart
        np.testing.assert_allclose(chips[0], single[index], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(chips[0], want[index], rtol=1e-4, atol=1e-6)


# -- GPT decode with its attention heads split across a T3000 (Megatron's attention) ------------------


def tp_decoder(gpt: Any, cfg: Any, name: str, n: int, chips: int) -> tt.Program:
    """examples/gpt_decode.py's program with each chip holding `n_head / chips` heads: its
    columns of W_qkv (column-parallel), its heads' K and V caches, and its rows of W_o
    (row-parallel), whose partial products one all_reduce sums before b_o is added. The rest
    (embeddings, norms, the MLP, the head) is replicated, so every chip picks the same token."""
    dl, dh, s = cfg.d_model // chips, cfg.d_head, cfg.max_seq
    hl = cfg.n_head // chips
    cache = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, tt.DataType.FLOAT32)
    b = tt.ProgramBuilder(name)
    decode = name == "decode_step"
    ids = b.input((n,), gpt.IDS)
    pos = b.input((1,), gpt.IDS) if decode else None
    w = {key: b.input(shape) for key, shape in local_shapes(gpt, cfg, chips).items()}
    caches = [b.input((hl, s, dh), cache) for _ in range(2 * cfg.n_layer)]

    def linear(x: Any, layer: str, name: str) -> Any:
        return b.add(b.matmul(x, w[f"{layer}w_{name}"]), w[f"{layer}b_{name}"])

    def heads(x: Any) -> Any:
        return b.reshape(x, (hl, 1, dh)) if decode else b.permute(b.reshape(x, (n, hl, dh)), (1, 0, 2))

    tok_emb = b.embedding(ids, w["wte"])
    if decode:
        assert pos is not None
        pos_emb, mask = b.embedding(pos, w["wpe"]), b.le(b.arange(0, s), pos)
    else:
        pos_emb = b.slice(w["wpe"], [0], [n])
        mask = b.le(b.reshape(b.arange(0, n), (1, n)), b.reshape(b.arange(0, n), (n, 1)))
    x = b.add(tok_emb, pos_emb)
    new_caches = []
    for layer in range(cfg.n_layer):
        p = f"h{layer}."
        qkv = linear(b.layer_norm(x, w[p + "ln1_g"], w[p + "ln1_b"]), p, "qkv")  # [n, 3 dl]
        q, k, v = (heads(b.slice(qkv, [0, i * dl], [n, (i + 1) * dl])) for i in range(3))
        k_cache, v_cache = caches[2 * layer], caches[2 * layer + 1]
        if decode:
            assert pos is not None
            k_cache, v_cache = b.update_cache(k_cache, k, pos), b.update_cache(v_cache, v, pos)
            keys, values = k_cache, v_cache
        else:
            k_cache = b.concat([k, b.slice(k_cache, [0, n], [hl, s])], axis=1)
            v_cache = b.concat([v, b.slice(v_cache, [0, n], [hl, s])], axis=1)
            keys, values = k, v
        new_caches += [k_cache, v_cache]
        scores = b.mul(b.matmul(q, b.transpose(keys)), 1 / math.sqrt(dh))
        attn = b.matmul(b.softmax(b.where(mask, scores, -1e9)), values)  # [hl, n, dh]
        merged = b.reshape(attn, (1, dl)) if decode else b.reshape(b.permute(attn, (1, 0, 2)), (n, dl))
        x = b.add(x, b.add(b.all_reduce(b.matmul(merged, w[p + "w_o"])), w[p + "b_o"]))
        m = b.layer_norm(x, w[p + "ln2_g"], w[p + "ln2_b"])
        x = b.add(x, linear(b.gelu(linear(m, p, "fc")), p, "proj"))
    last = x if decode else b.slice(x, [n - 1], [n])
    logits = b.matmul(b.layer_norm(last, w["lnf_g"], w["lnf_b"]), w["w_head"])
    b.output(b.reshape(b.argmax(logits, -1), (1,)), gpt.IDS)
    b.output(b.arange(n, n + 1) if pos is None else b.add(pos, 1), gpt.IDS)
    for old, new in zip(caches, new_caches):
        b.output(new, cache, donates=old)
    return b.build()


def local_shapes(gpt: Any, cfg: Any, chips: int) -> dict[str, tuple[int, ...]]:
    shapes = dict(gpt.weight_shapes(cfg))
    d, dl = cfg.d_model, cfg.d_model // chips
    for layer in range(cfg.n_layer):
        p = f"h{layer}."
        shapes |= {p + "w_qkv": (d, 3 * dl), p + "b_qkv": (3 * dl,), p + "w_o": (dl, d)}
    return shapes


def shard_weights(cfg: Any, weights: dict[str, np.ndarray], chips: int) -> dict[str, list[np.ndarray] | np.ndarray]:
    """Each chip's part of the split weights (its heads' q, k and v columns side by side, its rows
    of W_o); the others whole, to replicate."""
    d, dl = cfg.d_model, cfg.d_model // chips
    out: dict[str, list[np.ndarray] | np.ndarray] = dict(weights)
    for layer in range(cfg.n_layer):
        p = f"h{layer}."
        w_qkv, b_qkv, w_o = weights[p + "w_qkv"], weights[p + "b_qkv"], weights[p + "w_o"]
        cols = [np.concatenate([np.arange(i * d + c * dl, i * d + (c + 1) * dl) for i in range(3)])
                for c in range(chips)]
        out[p + "w_qkv"] = [np.ascontiguousarray(w_qkv[:, c]) for c in cols]
        out[p + "b_qkv"] = [np.ascontiguousarray(b_qkv[c]) for c in cols]
        out[p + "w_o"] = [np.ascontiguousarray(w_o[c * dl:(c + 1) * dl]) for c in range(chips)]
    return out


async def test_gpt_decode_with_its_heads_split_across_a_t3000_equals_one_chip_and_numpy() -> None:
    from test_use_cases import load_example

    gpt = load_example("gpt_decode")
    cfg = gpt.Config(n_head=8)  # a head per chip
    spec = spec_of("t3000")
    chips = spec.num_chips
    weights = gpt.init_weights(cfg, seed=3)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab, 8).astype(np.int32)
    new_tokens = 24
    reference, margin = gpt.NumpyGPT(cfg, weights).generate(prompt, new_tokens)
    one_chip_run = await gpt.run_on_device(cfg, weights, prompt, new_tokens, donate=True, spec=SMALL)
    binary = tt.Binary([tp_decoder(gpt, cfg, "prefill", len(prompt), chips),
                        tp_decoder(gpt, cfg, "decode_step", 1, chips)])
    parts = shard_weights(cfg, weights, chips)
    tokens: list[int] = []
    async with tt.open_mesh_device(spec) as mesh:
        on_mesh = [tt.from_shards(v, mesh) if isinstance(v, list) else tt.to_device(v, mesh)
                   for v in (parts[key] for key in gpt.weight_names(cfg))]
        tile = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, tt.DataType.FLOAT32)  # as donated
        caches = [tt.to_device(np.zeros((cfg.n_head, cfg.max_seq, cfg.d_head), np.float32), mesh, tile,
                               mapper=tt.shard(0)) for _ in range(2 * cfg.n_layer)]  # each chip its heads
        ids = tt.to_device(prompt, mesh, gpt.IDS)
        token, pos, *caches = tt.submit(mesh, binary, gpt.PREFILL, [ids, *on_mesh, *caches])
        outs = [token]
        for _ in range(new_tokens - 1):
            token, pos, *caches = tt.submit(mesh, binary, gpt.DECODE_STEP, [token, pos, *on_mesh, *caches])
            outs.append(token)
        for out in outs:
            per_chip = [int((await tt.to_host(s))[0]) for s in tt.device_tensors(out)]
            assert len(set(per_chip)) == 1, per_chip  # every chip picked the same token
            tokens.append(per_chip[0])
        links = {k: v for k, v in mesh.stats.link_bytes.items() if v}
    assert tokens == one_chip_run["tokens"] == reference, (tokens, reference, margin)
    # One all_reduce of a [n, d] float32 partial per layer and program, over the T3000's ring:
    # 2 (N-1)/N of it per link (n = 8 in the prefill, 1 in each step).
    elements = cfg.n_layer * cfg.d_model * (len(prompt) + new_tokens - 1)
    assert len(links) == chips and sum(links.values()) == 2 * (chips - 1) * elements * 4
