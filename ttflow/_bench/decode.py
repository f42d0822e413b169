"""Greedy decoding of `examples/gpt_decode.py`'s GPT-2-style model, on the device and in numpy.

The model is the example's own code (loaded from the checkout's `examples/` folder, so there is
one copy of it), run on asyncio in float32, best of three alternating runs:

- tokens/s on the device, with the caches donated (updated in place) and without (each step
  gives new caches; the loop drops the old ones), timed from the prompt's upload to the last
  token read; the tokens are checked against the numpy reference;
- host bytes per generated token, both ways (`device.stats`): the goal is the token id only;
- device bytes per generated token, both ways: the DRAM the caches a step gives take (new
  buffers without donation, none with it), and the bytes written into the caches
  (`cache_update_bytes`, the row's band of tiles, with donation; the whole new caches without);
- the same model in numpy eager on the host (`NumpyGPT`, a growing KV cache), in the same run:
  the emulation's overhead factor is numpy's tokens/s over the device's.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import numpy as np

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt_decode.py"
"""The example in the checkout ttflow was installed from in place (`pip install -e .`)."""


def example_path() -> Path:
    """The example file: next to the package (an in-place install), else in the current
    folder's `examples/` (README's `pip install .` run from the checkout)."""
    for path in (EXAMPLE, Path.cwd() / "examples" / "gpt_decode.py"):
        if path.is_file():
            return path
    raise FileNotFoundError(
        "ttflow bench decode runs the model of examples/gpt_decode.py, found neither at "
        f"{EXAMPLE} nor in ./examples; run it from a checkout of ttflow"
    )


def load_model() -> ModuleType:
    """The example module (its `Config`, `build`, `NumpyGPT`, ...)."""
    example = example_path()
    name = "_ttflow_example_gpt_decode"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, example)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _decode(gpt: ModuleType, cfg: Any, weights: dict[str, np.ndarray], prompt: np.ndarray,
            new_tokens: int, donate: bool) -> dict[str, Any]:
    r = anyio.run(partial(gpt.run_on_device, cfg, weights, prompt, new_tokens, donate=donate, warm_up=True))
    return {
        "tokens": r["tokens"], "seconds": r["seconds"], "tokens_per_s": new_tokens / r["seconds"],
        "device_to_host_bytes_per_token": r["device_to_host_bytes"] / new_tokens,
        "host_to_device_bytes_per_token": r["host_to_device_bytes"] / new_tokens,
        "new_cache_bytes_per_step": r["new_cache_bytes_per_step"],
        "cache_bytes_written_per_step": r["cache_bytes_written_per_step"],
    }


def _numpy(gpt: ModuleType, cfg: Any, weights: dict[str, np.ndarray], prompt: np.ndarray,
           new_tokens: int) -> dict[str, Any]:
    model = gpt.NumpyGPT(cfg, weights)
    model.generate(prompt, 2)  # warm-up
    start = time.perf_counter()
    tokens, margin = model.generate(prompt, new_tokens)
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "margin": margin, "seconds": seconds, "tokens_per_s": new_tokens / seconds}


def run(quick: bool = False, repeats: int = 3) -> dict[str, Any]:
    """Each run `repeats` times (once with `quick`), alternating, the best tokens/s kept: on a
    noisy machine the ratios then compare runs that saw the same load."""
    gpt = load_model()
    if quick:
        cfg, prompt_len, new_tokens = gpt.Config(), 8, 32
    else:
        cfg, prompt_len, new_tokens = gpt.Config(vocab=512, d_model=128, n_layer=4, n_head=4, max_seq=256), 16, 128
    weights = gpt.init_weights(cfg, seed=3)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab, prompt_len).astype(np.int32)
    donation = gpt.donation_supported()
    runs: dict[str, dict[str, Any]] = {}
    reference: dict[str, Any] = {}
    for _ in range(1 if quick else repeats):
        n = _numpy(gpt, cfg, weights, prompt, new_tokens)
        if not reference or n["tokens_per_s"] > reference["tokens_per_s"]:
            reference = n
        for donate in ((True, False) if donation else (False,)):
            r = _decode(gpt, cfg, weights, prompt, new_tokens, donate)
            name = "donated" if donate else "not_donated"
            equal = r.pop("tokens") == n["tokens"] and runs.get(name, {}).get("tokens_equal_numpy", True)
            if name not in runs or r["tokens_per_s"] > runs[name]["tokens_per_s"]:
                runs[name] = r
            runs[name]["tokens_equal_numpy"] = equal  # in every repeat
    result: dict[str, Any] = {
        "benchmark": "decode",
        "model": {"vocab": cfg.vocab, "d_model": cfg.d_model, "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                  "max_seq": cfg.max_seq, "prompt": prompt_len, "new_tokens": new_tokens, "dtype": "float32"},
        "device": runs,
        "numpy": {"tokens_per_s": reference["tokens_per_s"], "smallest_logit_margin": reference["margin"]},
    }
    if not donation:
        result["skipped"] = [{"run": "donated", "reason": "this ttflow has no output(donates=)"}]
    best = runs.get("donated", runs["not_donated"])
    result["numpy_vs_device"] = reference["tokens_per_s"] / best["tokens_per_s"]
    if donation:
        nd, d = runs["not_donated"], runs["donated"]
        result["cache_bytes_written_not_donated_vs_donated"] = (
            nd["cache_bytes_written_per_step"] / d["cache_bytes_written_per_step"]
            if d["cache_bytes_written_per_step"] else None)
        result["donated_vs_not_donated_tokens_per_s"] = d["tokens_per_s"] / nd["tokens_per_s"]
    return result


def format_table(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = [
        (f"GPT-2-style decoder: vocab {m['vocab']}, d_model {m['d_model']}, {m['n_layer']} layers x "
         f"{m['n_head']} heads, max_seq {m['max_seq']}; prompt {m['prompt']}, {m['new_tokens']} new tokens, float32"),
        (f"{'run':<14} {'tokens/s':>9} {'=numpy':>7} {'d2h B/token':>12} {'h2d B/token':>12} "
         f"{'new cache B/step':>17} {'cache B written/step':>21}"),
    ]
    for name, r in result["device"].items():
        lines.append(
            f"{name:<14} {r['tokens_per_s']:>9.1f} {r['tokens_equal_numpy']!s:>7} "
            f"{r['device_to_host_bytes_per_token']:>12.1f} {r['host_to_device_bytes_per_token']:>12.2f} "
            f"{r['new_cache_bytes_per_step']:>17.0f} {r['cache_bytes_written_per_step']:>21.0f}"
        )
    for s in result.get("skipped", []):
        lines.append(f"{s['run']:<14} skipped: {s['reason']}")
    lines.append(f"{'numpy eager':<14} {result['numpy']['tokens_per_s']:>9.1f}   "
                 f"(smallest top-1/top-2 logit margin {result['numpy']['smallest_logit_margin']:.4f})")
    lines.append(f"emulation overhead: numpy eager is {result['numpy_vs_device']:.1f}x the device's tokens/s")
    if result.get("cache_bytes_written_not_donated_vs_donated"):
        lines.append(f"donation writes {result['cache_bytes_written_not_donated_vs_donated']:.0f}x fewer cache bytes "
                     f"per token and runs {result['donated_vs_not_donated_tokens_per_s']:.2f}x as fast")
    return "\n".join(lines)
