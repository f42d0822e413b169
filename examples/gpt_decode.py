"""Greedy decoding with a GPT-2-style decoder whose KV cache lives on the device.

The model: token + position embedding, `n_layer` pre-LayerNorm blocks (causal multi-head
attention, a GELU MLP), a final LayerNorm, an LM head and argmax. Seeded random weights.

Two programs in one `tt.Binary`:

- `prefill` reads the whole prompt at once, writes rows 0..P-1 of every layer's K and V cache
  (it takes zeroed caches from `tt.empty` and gives them back filled) and gives the first new
  token and the next position;
- `decode_step` takes the last token, its position, the weights and the caches, writes the
  token's K and V rows into the caches with `update_cache`, attends over the whole fixed-size
  cache with a causal mask built on the device (`arange(max_seq) <= pos`), and gives the next
  token (argmax of the logits), the updated caches and `pos + 1`.

Nothing crosses to the host per token but the token id (4 bytes): the token and the position a
step gives are the next step's inputs, on the device. With `donate=True` each cache output
`donates=` its input, so a step updates the caches in place (no new buffer, the old handle is
consumed); with `donate=False` the programs are the same without `donates=`, each step gives
new caches, and the loop drops the old ones as it swaps the handles. The loop is one code for
both.

`NumpyGPT` is the same model written independently in numpy (its own LayerNorm, softmax and
GELU, a growing KV cache). In float32 the device's tokens equal its tokens, token for token.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import attrs
import numpy as np

import ttflow as tt

F32, BF16, BF8, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B, tt.DataType.INT32
IDS = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.ROW_MAJOR, I32)  # token ids and positions
PREFILL, DECODE_STEP = 0, 1
Value = Any  # a value of the program being built (what ProgramBuilder's ops take and give)


@attrs.frozen
class Config:
    vocab: int = 128
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    max_seq: int = 96
    head_scale: float = 4.0  # the LM head's scale: a wide top-1 / top-2 logit margin

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head


# -- weights --------------------------------------------------------------------------------


def layer_names(layer: int) -> list[str]:
    return [f"h{layer}.{n}" for n in ("ln1_g", "ln1_b", "w_qkv", "b_qkv", "w_o", "b_o",
                                      "ln2_g", "ln2_b", "w_fc", "b_fc", "w_proj", "b_proj")]


def weight_names(cfg: Config) -> list[str]:
    """The weights in the order both programs take them (after their own first inputs)."""
    return list(weight_shapes(cfg))


def weight_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    d, f = cfg.d_model, 4 * cfg.d_model
    shapes: dict[str, tuple[int, ...]] = {"wte": (cfg.vocab, d), "wpe": (cfg.max_seq, d)}
    for layer in range(cfg.n_layer):
        per_layer: list[tuple[int, ...]] = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),
                                            (d,), (d,), (d, f), (f,), (f, d), (d,)]
        shapes.update(zip(layer_names(layer), per_layer))
    return shapes | {"lnf_g": (d,), "lnf_b": (d,), "w_head": (d, cfg.vocab)}


def init_weights(cfg: Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random weights: unit-variance residual stream, matrices scaled by 1/sqrt(fan in),
    norm gains near 1, small biases; the LM head scaled by `head_scale`."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(cfg).items():
        kind = name.split(".")[-1]
        z = rng.standard_normal(shape).astype(np.float32)
        if kind.endswith("_g"):
            weights[name] = 1 + 0.1 * z
        elif kind.startswith("b_") or kind.endswith("_b"):
            weights[name] = 0.1 * z
        elif name == "wpe":
            weights[name] = 0.5 * z
        elif name == "wte":
            weights[name] = z
        else:
            scale = cfg.head_scale if name == "w_head" else 1.0
            weights[name] = (z * (scale / math.sqrt(shape[0]))).astype(np.float32)
    return weights


# -- the device programs ----------------------------------------------------------------------


def build(cfg: Config, prompt_len: int, *, donate: bool = True, act: tt.DataType = F32,
          weights: tt.DataType = F32) -> tt.Binary:
    """`prefill` and `decode_step` for prompts of `prompt_len` tokens.

    Activations (and the caches) are `act`, the weights are stored as `weights` (e.g.
    act=BFLOAT16, weights=BFLOAT8_B): an op of the two gives the wider dtype, so activations
    stay `act`. `donate` makes each cache output take over its input's buffer."""
    if not 0 < prompt_len < cfg.max_seq:
        raise ValueError(f"the prompt needs 1 to {cfg.max_seq - 1} tokens, got {prompt_len}")
    return tt.Binary([_program(cfg, "prefill", prompt_len, donate, act, weights),
                      _program(cfg, "decode_step", 1, donate, act, weights)])


def _program(cfg: Config, name: str, n: int, donate: bool, act: tt.DataType,
             weight_dtype: tt.DataType) -> tt.Program:
    """One program over `n` new tokens: the prompt (prefill) or the last token (decode_step)."""
    d, h, dh, s = cfg.d_model, cfg.n_head, cfg.d_head, cfg.max_seq
    cache_layout = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, act)
    b = tt.ProgramBuilder(name)
    decode = name == "decode_step"
    ids = b.input((n,), IDS)
    pos = b.input((1,), IDS) if decode else None
    wl = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, weight_dtype)
    w = {key: b.input(shape, wl) for key, shape in weight_shapes(cfg).items()}
    caches = [b.input((h, s, dh), cache_layout) for _ in range(2 * cfg.n_layer)]

    def linear(x: Value, layer: str, name: str) -> Value:
        return b.add(b.matmul(x, w[f"{layer}w_{name}"]), w[f"{layer}b_{name}"])

    def heads(x: Value) -> Value:  # [n, d] -> [h, n, dh]
        return b.reshape(x, (h, 1, dh)) if decode else b.permute(b.reshape(x, (n, h, dh)), (1, 0, 2))

    tok_emb = b.embedding(ids, w["wte"])
    if decode:
        assert pos is not None
        pos_emb = b.embedding(pos, w["wpe"])
        # Key j is visible from the new token at `pos` when j <= pos: one row over the cache.
        mask = b.le(b.arange(0, s), pos)  # [s]
    else:
        pos_emb = b.slice(w["wpe"], [0], [n])
        # Causal over the prompt: row i sees keys j <= i.
        mask = b.le(b.reshape(b.arange(0, n), (1, n)), b.reshape(b.arange(0, n), (n, 1)))  # [n, n]
    x = b.add(b.typecast(tok_emb, act), b.typecast(pos_emb, act))  # [n, d]
    new_caches = []
    for layer in range(cfg.n_layer):
        p = f"h{layer}."
        a = b.layer_norm(x, w[p + "ln1_g"], w[p + "ln1_b"])
        qkv = linear(a, p, "qkv")  # [n, 3d]
        q, k, v = (heads(b.slice(qkv, [0, i * d], [n, (i + 1) * d])) for i in range(3))
        k_cache, v_cache = caches[2 * layer], caches[2 * layer + 1]
        if decode:
            assert pos is not None
            k_cache, v_cache = b.update_cache(k_cache, k, pos), b.update_cache(v_cache, v, pos)
            keys, values = k_cache, v_cache  # attend over the whole cache, masked
        else:
            # Rows 0..n-1 are the prompt's, the rest stay as they were (zeros).
            k_cache = b.concat([k, b.slice(k_cache, [0, n], [h, s])], axis=1)
            v_cache = b.concat([v, b.slice(v_cache, [0, n], [h, s])], axis=1)
            keys, values = k, v
        new_caches += [k_cache, v_cache]
        scores = b.mul(b.matmul(q, b.transpose(keys)), 1 / math.sqrt(dh))  # [h, n, keys]
        attn = b.matmul(b.softmax(b.where(mask, scores, -1e9)), values)  # [h, n, dh]
        merged = b.reshape(attn, (1, d)) if decode else b.reshape(b.permute(attn, (1, 0, 2)), (n, d))
        x = b.add(x, linear(merged, p, "o"))
        m = b.layer_norm(x, w[p + "ln2_g"], w[p + "ln2_b"])
        x = b.add(x, linear(b.gelu(linear(m, p, "fc")), p, "proj"))
    last = x if decode else b.slice(x, [n - 1], [n])  # [1, d]
    logits = b.matmul(b.layer_norm(last, w["lnf_g"], w["lnf_b"]), w["w_head"])  # [1, vocab]
    b.output(b.reshape(b.argmax(logits, -1), (1,)), IDS)  # the next token
    b.output(b.arange(n, n + 1) if pos is None else b.add(pos, 1), IDS)  # its position
    for old, new in zip(caches, new_caches):
        if donate:
            b.output(new, cache_layout, donates=old)
        else:
            b.output(new, cache_layout)
    return b.build()


# -- the loop on the device -------------------------------------------------------------------


def push_weights(device: tt.Device, cfg: Config, weights: dict[str, np.ndarray],
                 dtype: tt.DataType = F32) -> list[tt.Tensor]:
    """Each weight to the device once, stored as the programs declare it (no conversion later)."""
    layout = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, dtype)
    return [tt.to_device(weights[name], device, layout) for name in weight_names(cfg)]


async def generate(device: tt.Device, binary: tt.Binary, cfg: Config, weights: Sequence[tt.Tensor],
                   prompt: np.ndarray, new_tokens: int, *, act: tt.DataType = F32,
                   ahead: int = 4) -> AsyncIterator[int]:
    """Yields `new_tokens` greedy tokens as they come.

    The token a step gives is the next step's input on the device; the host reads each one
    (4 bytes) `ahead` steps later, so the device always has the next programs queued."""
    cache_layout = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, act)
    caches = [tt.empty((cfg.n_head, cfg.max_seq, cfg.d_head), act, device, cache_layout)
              for _ in range(2 * cfg.n_layer)]
    ids = tt.to_device(np.asarray(prompt, np.int32), device, IDS)
    token, pos, *caches = tt.submit(device, binary, PREFILL, [ids, *weights, *caches])
    pending = deque([token])
    for _ in range(new_tokens - 1):
        # Donated: the old caches are consumed. Not donated: they are dropped here.
        token, pos, *caches = tt.submit(device, binary, DECODE_STEP, [token, pos, *weights, *caches])
        pending.append(token)
        if len(pending) > ahead:
            yield int((await tt.to_host(pending.popleft()))[0])
    while pending:
        yield int((await tt.to_host(pending.popleft()))[0])


# -- the numpy reference ----------------------------------------------------------------------


try:  # the reference's own erf: scipy's if it is installed, else the standard library's
    from scipy.special import erf as _erf  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - depends on the environment
    _erf = np.vectorize(math.erf, otypes=[np.float64])


class NumpyGPT:
    """The same model in float32 numpy, eagerly, with a KV cache that grows by one row a token."""

    def __init__(self, cfg: Config, weights: dict[str, np.ndarray]) -> None:
        self.cfg, self.w = cfg, weights

    @staticmethod
    def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + np.float32(1e-5)) * g + b

    @staticmethod
    def gelu(x: np.ndarray) -> np.ndarray:
        return (0.5 * x * (1 + _erf(x / math.sqrt(2)))).astype(np.float32)

    def forward(self, ids: np.ndarray, start: int, cache: list[np.ndarray]) -> np.ndarray:
        """Logits [n, vocab] of tokens `ids` at positions start.., appending to `cache` (per
        layer K then V, each [n_head, length, d_head])."""
        cfg, w = self.cfg, self.w
        n, h, dh = len(ids), cfg.n_head, cfg.d_head
        x = w["wte"][ids] + w["wpe"][start : start + n]
        causal = np.tril(np.ones((n, start + n), bool), start)  # query i sees keys <= start + i
        for layer in range(cfg.n_layer):
            p = f"h{layer}."
            qkv = self.layer_norm(x, w[p + "ln1_g"], w[p + "ln1_b"]) @ w[p + "w_qkv"] + w[p + "b_qkv"]
            q, k, v = (qkv[:, i * cfg.d_model : (i + 1) * cfg.d_model].reshape(n, h, dh).transpose(1, 0, 2)
                       for i in range(3))
            cache[2 * layer] = k = np.concatenate([cache[2 * layer], k], axis=1)
            cache[2 * layer + 1] = v = np.concatenate([cache[2 * layer + 1], v], axis=1)
            scores = np.where(causal, q @ k.transpose(0, 2, 1) / np.float32(math.sqrt(dh)), -np.inf)
            e = np.exp(scores - scores.max(-1, keepdims=True))
            attn = (e / e.sum(-1, keepdims=True)) @ v  # [h, n, dh]
            x = x + attn.transpose(1, 0, 2).reshape(n, cfg.d_model) @ w[p + "w_o"] + w[p + "b_o"]
            m = self.layer_norm(x, w[p + "ln2_g"], w[p + "ln2_b"])
            x = x + self.gelu(m @ w[p + "w_fc"] + w[p + "b_fc"]) @ w[p + "w_proj"] + w[p + "b_proj"]
        return self.layer_norm(x, w["lnf_g"], w["lnf_b"]) @ w["w_head"]

    def generate(self, prompt: np.ndarray, new_tokens: int) -> tuple[list[int], float]:
        """Greedy tokens, and the smallest top-1 minus top-2 logit margin among them."""
        empty = np.zeros((self.cfg.n_head, 0, self.cfg.d_head), np.float32)
        cache = [empty] * (2 * self.cfg.n_layer)
        logits = self.forward(np.asarray(prompt), 0, cache)[-1]
        tokens, margin, pos = [], math.inf, len(prompt)
        while True:
            top2 = np.sort(logits)[-2:]
            margin = min(margin, float(top2[1] - top2[0]))
            tokens.append(int(np.argmax(logits)))
            if len(tokens) == new_tokens:
                return tokens, margin
            logits = self.forward(np.array(tokens[-1:]), pos, cache)[-1]
            pos += 1


# -- putting it together ------------------------------------------------------------------------


def dram_bytes(tensors: Sequence[tt.Tensor]) -> int:
    """Bytes of the DRAM buffers holding `tensors` (once they are ready), over all banks."""
    total = 0
    for t in tensors:
        info = t.buffer
        assert info is not None
        total += info.num_pages * info.aligned_page_size
    return total


async def run_on_device(cfg: Config, weights: dict[str, np.ndarray], prompt: np.ndarray, new_tokens: int,
                        *, donate: bool, act: tt.DataType = F32, weight_dtype: tt.DataType = F32,
                        spec: tt.DeviceSpec | None = None, stream: Any = None,
                        warm_up: bool = False) -> dict[str, Any]:
    """Generates on a fresh device: the tokens, the time, what crossed to the host, and the
    cache bytes a step writes.

    Without donation a step writes every layer's K and V into new buffers, whole (the size of
    one set of caches, as allocated); with it, only the band of tiles holding the new row of
    each cache (`device.stats.cache_update_bytes`), in place."""
    binary = build(cfg, len(prompt), donate=donate, act=act, weights=weight_dtype)
    async with tt.open_device(spec) as device:
        on_device = push_weights(device, cfg, weights, weight_dtype)
        for t in on_device:
            await t
        if warm_up:  # a prefill and a step first, so a timing does not pay for planning
            async for _ in generate(device, binary, cfg, on_device, prompt, 2, act=act):
                pass
        before = device.stats
        tokens = []
        start = time.perf_counter()
        async for token in generate(device, binary, cfg, on_device, prompt, new_tokens, act=act):
            tokens.append(token)
            if stream is not None:
                stream(token)
        seconds = time.perf_counter() - start
        after = device.stats
        layout = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, act)
        caches = [tt.empty((cfg.n_head, cfg.max_seq, cfg.d_head), act, device, layout)
                  for _ in range(2 * cfg.n_layer)]
        for cache in caches:
            await cache
        cache_bytes = dram_bytes(caches)
    steps = new_tokens - 1  # the prefill gives the first token
    updated = getattr(after, "cache_update_bytes", 0) - getattr(before, "cache_update_bytes", 0)
    return {"tokens": tokens, "seconds": seconds,
            "device_to_host_bytes": after.device_to_host_bytes - before.device_to_host_bytes,
            "host_to_device_bytes": after.host_to_device_bytes - before.host_to_device_bytes,
            "programs": after.programs_run - before.programs_run,
            "new_cache_bytes_per_step": 0 if donate else cache_bytes,
            "cache_bytes_written_per_step": updated / max(steps, 1) if donate else cache_bytes}


def donation_supported() -> bool:
    """Whether this ttflow has `output(..., donates=)`."""
    b = tt.ProgramBuilder("probe")
    x = b.input((1, 1))
    try:
        b.output(x, donates=x)
    except TypeError:
        return False
    return True


async def main(cfg: Config = Config(), prompt_len: int = 8, new_tokens: int = 64, seed: int = 3,
               spec: tt.DeviceSpec | None = None, quiet: bool = False) -> dict[str, Any]:
    # Seed 3 is picked for its wide smallest logit margin (0.10, where logits spread about 4):
    # float32 results that differ in the last bits cannot swap the top two tokens.
    weights = init_weights(cfg, seed)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab, prompt_len).astype(np.int32)
    ref, margin = NumpyGPT(cfg, weights).generate(prompt, new_tokens)
    donate = donation_supported()
    say = (lambda *a, **k: None) if quiet else print
    say(f"prompt {prompt.tolist()}\nfloat32 on the device, streaming:", end="")
    f32 = await run_on_device(cfg, weights, prompt, new_tokens, donate=donate, spec=spec,
                              stream=None if quiet else (lambda t: print(f" {t}", end="", flush=True)))
    say()
    say(f"  equal to the numpy float32 reference token for token: {f32['tokens'] == ref} "
        f"(smallest top-1/top-2 logit margin {margin:.3f})")
    say(f"  {new_tokens} tokens in {f32['seconds']:.3f} s ({new_tokens / f32['seconds']:.0f} tokens/s); per token "
        f"{f32['device_to_host_bytes'] / new_tokens:.0f} bytes device -> host, "
        f"{f32['host_to_device_bytes'] / new_tokens:.1f} host -> device (the prompt)")
    plain = await run_on_device(cfg, weights, prompt, new_tokens, donate=False, spec=spec)
    if donate:
        say(f"  cache bytes written per token: {f32['cache_bytes_written_per_step']:.0f} donated (in place), "
            f"{plain['cache_bytes_written_per_step']:.0f} without donation (new caches each step); "
            f"tokens equal either way: {plain['tokens'] == f32['tokens']}")
    else:
        say(f"  (this ttflow has no donation: each step writes {plain['cache_bytes_written_per_step']:.0f} "
            "cache bytes into new buffers)")
    low = await run_on_device(cfg, weights, prompt, new_tokens, donate=donate, act=BF16,
                              weight_dtype=BF8, spec=spec)
    same = [a == b for a, b in zip(low["tokens"], ref)]
    first = same.index(False) if not all(same) else None
    say(f"BFLOAT16 activations, BFLOAT8_B weights: {sum(same)}/{new_tokens} tokens equal the float32 ones"
        + (f", the first difference at token {first}" if first is not None else ""))
    return {"tokens": f32["tokens"], "reference": ref, "margin": margin, "donate": donate,
            "not_donated_tokens": plain["tokens"], "cache_bytes_written": {
                "donated": f32["cache_bytes_written_per_step"] if donate else None,
                "not_donated": plain["cache_bytes_written_per_step"]},
            "low_precision_tokens": low["tokens"], "low_precision_agreement": sum(same) / new_tokens,
            "first_divergence": first, "d2h_per_token": f32["device_to_host_bytes"] / new_tokens,
            "h2d": f32["host_to_device_bytes"]}


if __name__ == "__main__":
    anyio.run(main)
