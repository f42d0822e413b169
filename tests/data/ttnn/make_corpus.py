"""Make the corpus of tt-mlir binaries ttflow's compiler-path tests read: JAX functions compiled
by Tenstorrent's real compiler (the `jax-tt-plugin` PJRT plugin, compile-only), each saved as
`<case>.ttnn` beside `<case>.npz` (its inputs `in0..`, and the same function's outputs on JAX's CPU
backend `out0..`, the independent reference the tests compare against).

Run it with the `[compiler]` extra installed (Python 3.11):

    python tests/data/ttnn/make_corpus.py [--only CASE ...] [--system-desc FILE]

Every case compiles in a child process per system descriptor (the plugin opens one PJRT client per
process, and compile-only mode must be set before it starts). The default descriptor is the one
ttflow writes for its emulated n150 (`ttflow.ttnn.system_desc`), so the compiler plans for the
device that runs the binary; `--system-desc` compiles against another file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _cases() -> dict[str, tuple[object, list[object]]]:
    """Each case: (function, numpy inputs). Imported inside the child only (jax is an extra)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)

    def f32(*shape: int, scale: float = 1.0) -> object:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def mlp(x, w1, b1, w2, b2):  # type: ignore[no-untyped-def]
        h = jax.nn.relu(x @ w1 + b1)
        return jax.nn.softmax(h @ w2 + b2, axis=-1)

    def eltwise(x, y):  # type: ignore[no-untyped-def]
        return (
            jnp.exp(x) * y - jnp.tanh(y),
            jnp.sqrt(jnp.abs(x)) + jnp.log(jnp.abs(y) + 1.0),
            jax.nn.sigmoid(x) / (1.0 + y * y),
            jnp.maximum(x, y) - jnp.minimum(x, 0.5),
            jnp.where(x > y, x, -y),
            jax.nn.gelu(x),
            jnp.negative(jnp.floor(x * 3.0)) + jnp.ceil(y),
            jnp.sin(x) + jnp.cos(y),
            jax.lax.rsqrt(jnp.abs(x) + 1.0),
        )

    def reductions(x):  # type: ignore[no-untyped-def]
        return (
            jnp.sum(x, axis=1),
            jnp.mean(x, axis=0, keepdims=True),
            jnp.max(x, axis=-1),
            jnp.min(x, axis=0),
            jnp.sum(x),
        )

    def layer_norm(x, g, b):  # type: ignore[no-untyped-def]
        mu = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b

    def data_movement(x, y):  # type: ignore[no-untyped-def]
        return (
            jnp.transpose(x),
            jnp.reshape(x, (16, 128)),
            jnp.concatenate([x, y], axis=0),
            x[2:30:1, 8:40],
            jnp.pad(y, ((1, 3), (0, 32))),
            jnp.tile(y[:4], (2, 1)),
            jnp.flip(x, axis=1),
            jnp.broadcast_to(y[:1], (8, 64)) + 1.0,
        )

    def int_ops(a, b):  # type: ignore[no-untyped-def]
        return (a + b, a * b, a - b, jnp.maximum(a, b), a & b, a | b, a ^ b, (a > b).astype(jnp.int32))

    def cumsum_sort(x):  # type: ignore[no-untyped-def]
        return (jnp.cumsum(x, axis=1), jnp.sort(x, axis=-1), jnp.argmax(x, axis=-1))

    def embedding(table, ids):  # type: ignore[no-untyped-def]
        return jnp.take(table, ids, axis=0) * 2.0

    def attention(x, wq, wk, wv, wo):  # type: ignore[no-untyped-def]
        q, k, v = x @ wq, x @ wk, x @ wv
        heads = 2
        s, d = x.shape[0], wq.shape[1] // heads

        def split(t):  # type: ignore[no-untyped-def]
            return jnp.transpose(jnp.reshape(t, (s, heads, d)), (1, 0, 2))

        q, k, v = split(q), split(k), split(v)
        scores = jnp.einsum("hqd,hkd->hqk", q, k) / np.sqrt(d)
        mask = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.where(mask, scores, -1e9)
        out = jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(scores, axis=-1), v)
        return jnp.reshape(jnp.transpose(out, (1, 0, 2)), (s, heads * d)) @ wo

    def cnn(img, k1, k2):  # type: ignore[no-untyped-def]
        y = jax.lax.conv_general_dilated(img, k1, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = jax.nn.relu(y)
        y = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        y = jax.lax.conv_general_dilated(y, k2, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(y, axis=(1, 2))

    def train_step(w, b, x, t):  # type: ignore[no-untyped-def]
        def loss(w, b):  # type: ignore[no-untyped-def]
            return jnp.mean((jnp.tanh(x @ w + b) - t) ** 2)

        value, (gw, gb) = jax.value_and_grad(loss, argnums=(0, 1))(w, b)
        return value, w - 0.1 * gw, b - 0.1 * gb

    def kv_decode(cache, new, pos):  # type: ignore[no-untyped-def]
        cache = jax.lax.dynamic_update_slice(cache, new, (pos[0], 0))
        return cache, jnp.sum(cache, axis=0)

    def unary(x):  # type: ignore[no-untyped-def]
        return (jnp.exp(x), jnp.log(jnp.abs(x) + 0.5), jnp.square(x), jax.nn.silu(x),
                jax.nn.gelu(x, approximate=False), jnp.clip(x, -0.5, 0.5), jnp.sign(x), x ** 3,
                jax.lax.erf(x), 1.0 / (jnp.abs(x) + 1.0))

    def compare(x, y):  # type: ignore[no-untyped-def]
        a, b = x > 0, y < 0
        return (jnp.where(x == y, 1.0, 0.0), jnp.where(x != y, x, y), jnp.where(x <= y, x, 0.0),
                jnp.where(jnp.logical_or(a, b), 1.0, -1.0), jnp.where(jnp.logical_not(a), x, y),
                jnp.where(jnp.logical_xor(a, b), 2.0, 3.0))

    def int_div(a, b):  # type: ignore[no-untyped-def]
        return (a // b, a % b, jnp.abs(a), -a, a << 2, a >> 1)

    def bf16_mlp(x, w):  # type: ignore[no-untyped-def]
        return jax.nn.relu(x @ w).astype(jnp.float32)

    def top_k(x):  # type: ignore[no-untyped-def]
        values, indices = jax.lax.top_k(x, 4)
        return values, indices, jnp.argsort(x, axis=-1), jnp.argmin(x, axis=0)

    def pools(img):  # type: ignore[no-untyped-def]
        avg = jax.lax.reduce_window(img, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4.0
        mx = jax.lax.reduce_window(img, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
        return avg, mx

    def gpt2_block(x, g1, b1, wqkv, wo, g2, b2, w1, w2):  # type: ignore[no-untyped-def]
        def ln(t, g, b):  # type: ignore[no-untyped-def]
            mu = jnp.mean(t, -1, keepdims=True)
            return (t - mu) / jnp.sqrt(jnp.var(t, -1, keepdims=True) + 1e-5) * g + b
        s, d = x.shape
        h = ln(x, g1, b1) @ wqkv
        q, k, v = jnp.split(h, 3, axis=-1)
        att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s), bool)), q @ k.T / np.sqrt(d), -jnp.inf), axis=-1)
        x = x + (att @ v) @ wo
        return x + jax.nn.gelu(ln(x, g2, b2) @ w1) @ w2

    def prefill(x, wk, wv):  # type: ignore[no-untyped-def]
        return x @ wk, x @ wv

    def decode(k_cache, v_cache, x, wq, wk, wv, pos):  # type: ignore[no-untyped-def]
        k_cache = jax.lax.dynamic_update_slice(k_cache, x @ wk, (pos[0], 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, x @ wv, (pos[0], 0))
        mask = jnp.arange(k_cache.shape[0])[None, :] <= pos[0]
        scores = jnp.where(mask, (x @ wq) @ k_cache.T / 8.0, -1e9)
        return k_cache, v_cache, jax.nn.softmax(scores, axis=-1) @ v_cache

    def strided(x):  # type: ignore[no-untyped-def]
        return x[::2, 1::3], jnp.transpose(jnp.reshape(x, (4, 8, 32)), (2, 0, 1)), jnp.prod(x[:4, :4], axis=1)

    table = np.linspace(-1.0, 1.0, 64 * 32, dtype=np.float32).reshape(64, 32)

    def constants(x):  # type: ignore[no-untyped-def]
        return x @ table + jnp.array([1.0, 2.0, 3.0, 4.0] * 8, jnp.float32)

    def sdpa(q, k, v):  # type: ignore[no-untyped-def]
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def conv_bias(img, k, bias):  # type: ignore[no-untyped-def]
        y = jax.lax.conv_general_dilated(img, k, (2, 2), ((1, 1), (1, 1)),
                                         dimension_numbers=("NHWC", "HWIO", "NHWC")) + bias
        z = jax.lax.conv_general_dilated(img, jnp.tile(k[:, :, :1, :], (1, 1, 1, 1)), (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=4)
        return jax.nn.relu(y), z

    def shapes(x, y):  # type: ignore[no-untyped-def]
        return (jnp.expand_dims(x, 0) * 2.0, jnp.squeeze(x[:1]), jnp.max(x, axis=(0, 1)),
                jnp.einsum("bij,bjk->bik", jnp.reshape(x, (2, 4, 16)), jnp.reshape(y, (2, 16, 4))),
                jax.nn.logsumexp(x, axis=-1), jnp.clip(x, y * 0.1, y * 0.1 + 1.0), jnp.power(jnp.abs(x) + 1.0, y),
                jnp.take_along_axis(x, jnp.argsort(y, axis=1), axis=1), jax.nn.one_hot(jnp.argmax(x, 1), 8))

    def unary2(x, y):  # type: ignore[no-untyped-def]
        return (jnp.tan(x), jnp.arctan(x), jnp.arctan2(x, y), jnp.expm1(x * 1e-4), jnp.log1p(jnp.abs(x) * 1e-4),
                jnp.cbrt(x), jnp.round(x * 3), jnp.sinh(x), jnp.arcsinh(x), jax.nn.softplus(x), jax.nn.elu(x))

    def remainders(a, b, x, y):  # type: ignore[no-untyped-def]
        # every sign of dividend and divisor: fmod truncates, % (jnp.mod) floors
        return jnp.fmod(a, b), a % b, jnp.fmod(x, y), x % y

    def mixed(x, y, img, k):  # type: ignore[no-untyped-def]
        return (jnp.pad(x, ((2, 2), (1, 1)), mode="edge"),  # repeat_interleave
                (((x > 0) & (y < 0)) | ~(x > y)).astype(jnp.float32),  # logical ops, fused not
                jnp.dot(x.astype(jnp.bfloat16), y.astype(jnp.bfloat16), preferred_element_type=jnp.float32),
                jax.lax.conv_general_dilated(img, k, (1, 1), "SAME", rhs_dilation=(2, 2),
                                             dimension_numbers=("NHWC", "HWIO", "NHWC")),
                jax.lax.reduce_window(img, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME") / 9.0,
                (img - img.mean((0, 1, 2))) / jnp.sqrt(img.var((0, 1, 2)) + 1e-5))

    def edge_values(x, y, i, j):  # type: ignore[no-untyped-def]
        """NaN, infinities, -0.0, values past int32 and float32's range, integer wrap-around."""
        return (x.astype(jnp.int32), x.astype(jnp.uint32), i.astype(jnp.float32), i + i, i * j, x / y,
                jnp.maximum(x, y), jnp.max(x, axis=1), jnp.argmax(x, axis=1), jnp.sort(x, axis=1),
                jax.nn.softmax(jnp.where(jnp.isfinite(x), x * 1e-3, -jnp.inf), axis=1), jnp.exp(x * 0.1),
                jnp.log(x), jnp.sqrt(x), jnp.sign(x), jnp.floor(x) + jnp.ceil(x), jnp.clip(x, -1, 1),
                (x == x).astype(jnp.float32) + (x != y).astype(jnp.float32),
                x.astype(jnp.bfloat16).astype(jnp.float32),
                (x.astype(jnp.bfloat16) + y.astype(jnp.bfloat16)).astype(jnp.float32))

    def int_floor_div(a, b):  # type: ignore[no-untyped-def]
        # the compiler divides int32 in float32 (exact below 2**24 only): tests compare with numpy's
        # run of the same float32 sequence as well as JAX's exact quotient on small values
        return a // b

    def control_flow(x, w):  # type: ignore[no-untyped-def]
        # a cond (ttcore.case: both branches, the taken one kept) and a scan (ttcore.while_loop:
        # unrolled), its per-step outputs written by column scatters
        y = jax.lax.cond(jnp.sum(x) > 0, lambda a: a * 2.0, lambda a: -a, x)

        def step(h, _):  # type: ignore[no-untyped-def]
            h = jnp.tanh(h @ w)
            return h, jnp.sum(h)

        h, sums = jax.lax.scan(step, x, None, length=4)
        return y, h, sums

    def xent_step(w, x, labels):  # type: ignore[no-untyped-def]
        def loss(w):  # type: ignore[no-untyped-def]
            logp = jax.nn.log_softmax(x @ w)
            return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))
        value, grad = jax.value_and_grad(loss)(w)
        return value, w - 0.5 * grad

    def gpt2_tiny(tokens, wte, wpe, ln_g, ln_b, w_qkv, w_o, w_up, w_down, ln_f_g, ln_f_b):  # type: ignore[no-untyped-def]
        """Two GPT-2 layers (shared weights per layer index), tied embeddings, logits."""
        def ln(t, g, b):  # type: ignore[no-untyped-def]
            mu = jnp.mean(t, -1, keepdims=True)
            return (t - mu) * jax.lax.rsqrt(jnp.var(t, -1, keepdims=True) + 1e-5) * g + b
        s = tokens.shape[0]
        x = wte[tokens] + wpe[:s]
        heads, d = 4, wte.shape[1] // 4
        for layer in range(2):
            h = ln(x, ln_g[layer], ln_b[layer]) @ w_qkv[layer]
            q, k, v = (jnp.transpose(jnp.reshape(t, (s, heads, d)), (1, 0, 2)) for t in jnp.split(h, 3, -1))
            att = jnp.einsum("hqd,hkd->hqk", q, k) / np.sqrt(d)
            att = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, -1e9), -1)
            y = jnp.reshape(jnp.transpose(jnp.einsum("hqk,hkd->hqd", att, v), (1, 0, 2)), (s, heads * d))
            x = x + y @ w_o[layer]
            x = x + jax.nn.gelu(ln(x, ln_g[layer], ln_b[layer]) @ w_up[layer]) @ w_down[layer]
        return ln(x, ln_f_g, ln_f_b) @ wte.T

    def kv_donated(k_cache, x, wk, pos):  # type: ignore[no-untyped-def]
        k_cache = jax.lax.dynamic_update_slice(k_cache, x @ wk, (pos[0], 0))
        return k_cache, jnp.sum(k_cache, axis=0)

    kv_donated.donate = (0,)  # type: ignore[attr-defined]

    def scatter_add(x, idx, upd):  # type: ignore[no-untyped-def]
        return x.at[idx].add(upd), x.at[idx].set(upd)

    ids = rng.integers(0, 50, (8, 16)).astype(np.int32)
    bf16 = jnp.bfloat16
    return {
        "mlp": (mlp, [f32(32, 64), f32(64, 128, scale=0.1), f32(128, scale=0.1), f32(128, 32, scale=0.1), f32(32)]),
        "eltwise": (eltwise, [f32(32, 64), f32(32, 64)]),
        "reductions": (reductions, [f32(64, 96)]),
        "layer_norm": (layer_norm, [f32(32, 128), f32(128), f32(128)]),
        "data_movement": (data_movement, [f32(32, 64), f32(16, 64)]),
        "int_ops": (int_ops, [rng.integers(-1000, 1000, (32, 32)).astype(np.int32),
                              rng.integers(-1000, 1000, (32, 32)).astype(np.int32)]),
        "cumsum_sort": (cumsum_sort, [f32(16, 64)]),
        "embedding": (embedding, [f32(50, 64), ids]),
        "attention": (attention, [f32(32, 64), *(f32(64, 64, scale=0.125) for _ in range(4))]),
        "cnn": (cnn, [f32(2, 16, 16, 3), f32(3, 3, 3, 8, scale=0.3), f32(3, 3, 8, 16, scale=0.2)]),
        "train_step": (train_step, [f32(64, 32, scale=0.1), f32(32), f32(16, 64), f32(16, 32)]),
        "kv_decode": (kv_decode, [np.zeros((64, 32), np.float32), f32(1, 32), np.array([5], np.int32)]),
        "unary": (unary, [f32(32, 64)]),
        "compare": (compare, [np.round(f32(32, 32)), np.round(f32(32, 32))]),
        "int_div": (int_div, [rng.integers(-1000, 1000, (32, 32)).astype(np.int32),
                              rng.integers(1, 50, (32, 32)).astype(np.int32)]),
        "bf16_mlp": (bf16_mlp, [np.asarray(f32(32, 64), bf16), np.asarray(f32(64, 32, scale=0.1), bf16)]),
        "top_k": (top_k, [f32(8, 64)]),
        "pools": (pools, [f32(1, 8, 8, 16)]),
        "gpt2_block": (gpt2_block, [f32(32, 64), f32(64), f32(64), f32(64, 192, scale=0.1), f32(64, 64, scale=0.1),
                                    f32(64), f32(64), f32(64, 256, scale=0.1), f32(256, 64, scale=0.1)]),
        "prefill": (prefill, [f32(16, 64), f32(64, 64, scale=0.1), f32(64, 64, scale=0.1)]),
        "decode": (decode, [f32(32, 64), f32(32, 64), f32(1, 64), *(f32(64, 64, scale=0.1) for _ in range(3)),
                            np.array([16], np.int32)]),
        "strided": (strided, [f32(32, 32)]),
        "constants": (constants, [f32(16, 64)]),
        "sdpa": (sdpa, [f32(1, 32, 2, 64), f32(1, 32, 2, 64), f32(1, 32, 2, 64)]),
        "conv_bias": (conv_bias, [f32(1, 16, 16, 4), f32(3, 3, 4, 8, scale=0.3), f32(8)]),
        "shapes": (shapes, [f32(8, 16), f32(8, 16)]),
        "edge_values": (edge_values, [_edges(f32(32, 32, scale=1e3)), _zeros_in(f32(32, 32)),
                                      rng.integers(-2**31, 2**31 - 1, (32, 32), dtype=np.int64).astype(np.int32),
                                      rng.integers(-5, 5, (32, 32)).astype(np.int32)]),
        "int_floor_div": (int_floor_div, [rng.integers(-2**31, 2**31 - 1, (32, 32), dtype=np.int64).astype(np.int32),
                                          rng.choice([-7, -3, -1, 1, 2, 5], (32, 32)).astype(np.int32)]),
        "control_flow": (control_flow, [f32(8, 32), f32(32, 32, scale=0.2)]),
        "xent_step": (xent_step, [f32(32, 10, scale=0.1), f32(16, 32), rng.integers(0, 10, (16,)).astype(np.int32)]),
        "mixed": (mixed, [f32(32, 32), f32(32, 32), f32(1, 8, 8, 4), f32(3, 3, 4, 4, scale=0.3)]),
        "unary2": (unary2, [f32(32, 32), f32(32, 32)]),
        "remainders": (remainders, [rng.integers(-100, 100, (32, 32)).astype(np.int32),
                                    rng.choice([-7, -3, 2, 5], (32, 32)).astype(np.int32), f32(32, 32, scale=5.0),
                                    np.where(rng.random((32, 32)) < 0.5, -1.0, 1.0).astype(np.float32) * 1.5]),
        "gpt2_tiny": (gpt2_tiny, [rng.integers(0, 96, (32,)).astype(np.int32), f32(96, 64, scale=0.2),
                                  f32(64, 64, scale=0.1), 1.0 + f32(2, 64, scale=0.1), f32(2, 64, scale=0.1),
                                  f32(2, 64, 192, scale=0.1), f32(2, 64, 64, scale=0.1), f32(2, 64, 256, scale=0.1),
                                  f32(2, 256, 64, scale=0.1), 1.0 + f32(64, scale=0.1), f32(64, scale=0.1)]),
        "kv_donated": (kv_donated, [f32(64, 32), f32(1, 32), f32(32, 32, scale=0.1), np.array([9], np.int32)]),
        "scatter_add": (scatter_add, [f32(16, 8), np.array([3, 7, 3], np.int32), f32(3, 8)]),
    }


def _mesh_cases() -> dict[str, tuple[object, list[object], list[str], str, tuple[int, int]]]:
    """Each case: (function, global numpy inputs, input PartitionSpecs, output PartitionSpec, mesh
    shape). A spec is written as text, one entry per dim ("-" unsharded): mesh axes "x" (rows)
    and "y" (columns)."""
    import jax
    import numpy as np

    rng = np.random.default_rng(1)

    def f32(*shape: int, scale: float = 1.0) -> object:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def mlp(x, w1, w2):  # type: ignore[no-untyped-def]
        return jax.nn.relu(x @ w1) @ w2

    def scaled(x):  # type: ignore[no-untyped-def]
        return x * 2.0 + 1.0

    def matmul(x, w):  # type: ignore[no-untyped-def]
        return x @ w

    from jax.sharding import PartitionSpec

    try:
        from jax import shard_map  # type: ignore[attr-defined]
    except ImportError:  # older jax
        from jax.experimental.shard_map import shard_map

    def on_mesh(body):  # type: ignore[no-untyped-def]
        """A shard_map over the columns, built for whichever mesh (tt's, or the CPU's for the
        reference): `fn.build(mesh)`."""
        def build(mesh):  # type: ignore[no-untyped-def]
            return shard_map(body, mesh=mesh, in_specs=PartitionSpec(None, "y"), out_specs=PartitionSpec(None, "y"))
        build.build = build  # type: ignore[attr-defined]
        return build

    return {
        # tensor parallel on n300: w1 column-sharded, w2 row-sharded, one all_reduce
        "n300_tp_mlp": (mlp, [f32(32, 64), f32(64, 128, scale=0.1), f32(128, 64, scale=0.1)],
                        ["-,-", "-,y", "y,-"], "-,-", (1, 2)),
        # data parallel on n300: the batch sharded, weights replicated, no collective
        "n300_dp_mlp": (mlp, [f32(64, 64), f32(64, 128, scale=0.1), f32(128, 64, scale=0.1)],
                        ["y,-", "-,-", "-,-"], "y,-", (1, 2)),
        # a sharded input gathered to every chip
        "n300_gather": (scaled, [f32(32, 128)], ["-,y"], "-,-", (1, 2)),
        # contraction over a sharded dim, the result left sharded: a reduce_scatter
        "n300_reduce_scatter": (matmul, [f32(32, 128), f32(128, 64, scale=0.1)], ["-,y", "y,-"], "-,y", (1, 2)),
        # a swap between the two chips: point_to_points whose accumulator is the other's result
        "n300_ppermute": (on_mesh(lambda a: jax.lax.ppermute(a, "y", [(0, 1), (1, 0)])), [f32(32, 64)],
                          ["-,y"], "-,y", (1, 2)),
        # all_to_all over the columns (split and concat the rows): slices, point_to_points, a concat
        "n300_all_to_all": (on_mesh(lambda a: jax.lax.all_to_all(a, "y", 0, 0, tiled=True)), [f32(32, 64)],
                            ["-,y"], "-,y", (1, 2)),
        # 8 chips (2x4): batch over rows, tensor parallel over columns
        "t3000_mlp": (mlp, [f32(64, 64), f32(64, 256, scale=0.1), f32(256, 64, scale=0.1)],
                      ["x,-", "-,y", "y,-"], "x,-", (2, 4)),
    }


def _refused_cases() -> dict[str, tuple[object, list[object], tuple[int, int]]]:
    """Programs ttflow refuses at load, by name (tests/test_ttnn_reader.py): the compiler's real
    output for what ttflow cannot run yet. Written to `refused/<case>.ttnn`, without references."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec

    try:
        from jax import shard_map  # type: ignore[attr-defined]
    except ImportError:  # older jax
        from jax.experimental.shard_map import shard_map

    def pmax(mesh):  # type: ignore[no-untyped-def]
        # an all_reduce that takes the maximum: ttflow's collectives sum
        return shard_map(lambda a: jax.lax.pmax(a, "y"), mesh=mesh,
                         in_specs=PartitionSpec(None, "y"), out_specs=PartitionSpec(None, "y"))

    return {"n300_pmax": (pmax, [np.arange(32 * 64, dtype=np.float32).reshape(32, 64)], (1, 2))}


def _spec(text: str) -> object:
    from jax.sharding import PartitionSpec

    return PartitionSpec(*(None if d == "-" else d for d in text.split(",")))


def _edges(x: Any) -> Any:
    x = x.copy()
    x[0, :8] = [float("nan"), float("inf"), -float("inf"), -0.0, 3e9, -3e9, 0.5, -0.5]
    return x


def _zeros_in(y: Any) -> Any:
    y = y.copy()
    y[1, :4] = 0.0
    return y


def _child(out: Path, only: list[str], mesh: bool) -> None:
    """Compile every case against the descriptor this process was started with."""
    import jax
    import numpy as np

    cpu = jax.devices("cpu")[0]
    if mesh:
        _mesh_child(out, only)
        return
    tt = jax.devices("tt")[0]
    made = {}
    for name, (fn, inputs) in _cases().items():
        if only and name not in only:
            continue
        expected = jax.jit(fn)(*(jax.device_put(a, cpu) for a in inputs))
        expected = expected if isinstance(expected, tuple) else (expected,)
        export = Path(tempfile.mkdtemp(prefix=f"ttnn-{name}-"))
        donate = getattr(fn, "donate", ())  # JAX's donate_argnums: the binary marks the aliases
        jax.jit(fn, donate_argnums=donate, compiler_options={"export_path": str(export)})(
            *(jax.device_put(a, tt) for a in inputs))
        (binary,) = export.glob("*.ttnn")
        shutil.copy(binary, out / f"{name}.ttnn")
        np.savez(out / f"{name}.npz",
                 **{f"in{i}": _storable(a) for i, a in enumerate(inputs)},
                 **{f"out{i}": _storable(e) for i, e in enumerate(expected)})
        shutil.rmtree(export)
        made[name] = (out / f"{name}.ttnn").stat().st_size
    print(json.dumps(made))


def _mesh_child(out: Path, only: list[str]) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    cpu = jax.devices("cpu")[0]
    devices = jax.devices("tt")
    made = {}
    for name, (fn, inputs, in_specs, out_spec, shape) in _mesh_cases().items():
        if (only and name not in only) or len(devices) != shape[0] * shape[1]:
            continue
        mesh = Mesh(np.array(devices).reshape(shape), ("x", "y"))
        if hasattr(fn, "build"):  # a shard_map: the reference on a CPU mesh of the same shape
            cpu_mesh = Mesh(np.array(jax.devices("cpu")[: shape[0] * shape[1]]).reshape(shape), ("x", "y"))
            cpu_args = [jax.device_put(a, NamedSharding(cpu_mesh, _spec(s))) for a, s in zip(inputs, in_specs, strict=True)]
            expected = np.asarray(jax.jit(fn.build(cpu_mesh))(*cpu_args))
            fn = fn.build(mesh)
        else:
            expected = jax.jit(fn)(*(jax.device_put(a, cpu) for a in inputs))  # type: ignore[operator]
        args = [jax.device_put(a, NamedSharding(mesh, _spec(s))) for a, s in zip(inputs, in_specs, strict=True)]
        export = Path(tempfile.mkdtemp(prefix=f"ttnn-{name}-"))
        jax.jit(fn, out_shardings=NamedSharding(mesh, _spec(out_spec)),  # type: ignore[arg-type]
                compiler_options={"export_path": str(export)})(*args)
        (binary,) = export.glob("*.ttnn")
        shutil.copy(binary, out / f"{name}.ttnn")
        np.savez(out / f"{name}.npz", **{f"in{i}": _storable(a) for i, a in enumerate(inputs)},
                 out0=_storable(expected))
        (out / f"{name}.json").write_text(json.dumps(
            {"mesh_shape": list(shape), "in_specs": in_specs, "out_specs": [out_spec]}) + "\n")
        shutil.rmtree(export)
        made[name] = (out / f"{name}.ttnn").stat().st_size
    for name, (build, inputs, shape) in _refused_cases().items():
        if (only and name not in only) or len(devices) != shape[0] * shape[1]:
            continue
        mesh = Mesh(np.array(devices).reshape(shape), ("x", "y"))
        export = Path(tempfile.mkdtemp(prefix=f"ttnn-{name}-"))
        args = [jax.device_put(a, NamedSharding(mesh, _spec("-,y"))) for a in inputs]
        jax.jit(build(mesh), compiler_options={"export_path": str(export)})(*args)  # type: ignore[operator]
        (binary,) = export.glob("*.ttnn")
        (out / "refused").mkdir(exist_ok=True)
        shutil.copy(binary, out / "refused" / f"{name}.ttnn")
        shutil.rmtree(export)
        made[name] = (out / "refused" / f"{name}.ttnn").stat().st_size
    print(json.dumps(made))


def _storable(a: object) -> object:
    """npz keeps numpy's own dtypes only: bfloat16 is saved as the float32 of the same value."""
    import numpy as np

    array = np.asarray(a)
    return array.astype(np.float32) if array.dtype.name == "bfloat16" else array


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="cases to make (default: all)")
    parser.add_argument("--system-desc", type=Path, help="descriptor to compile against (one chip)")
    parser.add_argument("--mesh-system-descs", type=Path, nargs="*", default=None,
                        help="descriptors of the meshes to compile the mesh cases against")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--child", choices=["chip", "mesh"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.out, args.only, args.child == "mesh")
        return
    import ttflow as tt

    folder = Path(tempfile.mkdtemp())
    chip = args.system_desc
    meshes = args.mesh_system_descs
    if chip is None or meshes is None:
        from ttflow.ttnn import system_desc

        chip = chip or system_desc(tt.DeviceSpec.wormhole_n150()).save(folder / "n150.ttsys")
        if meshes is None:
            meshes = [system_desc(tt.MeshSpec.n300()).save(folder / "n300.ttsys"),
                      system_desc(tt.MeshSpec.t3000()).save(folder / "t3000.ttsys")]
    for kind, desc in [("chip", chip), *(("mesh", m) for m in meshes)]:
        env = {**os.environ, "TT_COMPILE_ONLY_SYSTEM_DESC": str(desc),
               # eight CPU devices: the shard_map cases' reference runs on a CPU mesh
               "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()}
        env.pop("JAX_PLATFORMS", None)
        command = [sys.executable, __file__, "--child", kind, "--out", str(args.out), "--only", *args.only]
        subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()
