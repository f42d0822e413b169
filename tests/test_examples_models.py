"""The model examples: GPT-style greedy decoding with a device-resident KV cache, and a CNN.

The decoder's tokens must equal its independent numpy float32 reference token for token, on
both anyio backends, with the caches donated (updated in place) and without. A planted bug (the
causal mask shifted by one position) must break that equality: the test sees it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import anyio
import numpy as np
import pytest
from test_use_cases import ROOT, load_example

import ttflow as tt
from ttflow.cli import main as cli_main

SMALL = tt.DeviceSpec.small()
PROMPT, NEW = 8, 64


@pytest.fixture(scope="module")
def gpt() -> ModuleType:
    return load_example("gpt_decode")


@pytest.fixture(scope="module")
def model(gpt: ModuleType) -> dict[str, Any]:
    cfg = gpt.Config()
    weights = gpt.init_weights(cfg, seed=3)
    prompt = np.random.default_rng(1).integers(0, cfg.vocab, PROMPT).astype(np.int32)
    tokens, margin = gpt.NumpyGPT(cfg, weights).generate(prompt, NEW)
    return {"cfg": cfg, "weights": weights, "prompt": prompt, "reference": tokens, "margin": margin}


def donation(gpt: ModuleType, donate: bool) -> bool:
    if donate and not gpt.donation_supported():
        pytest.skip("this ttflow has no output(donates=): the donated variant needs it")
    return donate


@pytest.mark.anyio
@pytest.mark.parametrize("donate", [True, False], ids=["donated", "not_donated"])
async def test_gpt_decode_tokens_equal_numpy_float32(gpt: ModuleType, model: dict[str, Any], donate: bool) -> None:
    donate = donation(gpt, donate)
    assert model["margin"] > 0.05  # the reference's choices are not near-ties
    r = await gpt.run_on_device(model["cfg"], model["weights"], model["prompt"], NEW, donate=donate, spec=SMALL)
    assert r["tokens"] == model["reference"]
    assert r["device_to_host_bytes"] == 4 * NEW  # the token ids, nothing else
    assert r["host_to_device_bytes"] == model["prompt"].nbytes  # after the weights: the prompt only
    assert r["programs"] == NEW  # one prefill, NEW - 1 steps


def test_a_shifted_causal_mask_breaks_token_equality(gpt: ModuleType, model: dict[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The planted bug: keys j < pos instead of j <= pos (the token does not see itself).
    monkeypatch.setattr(tt.ProgramBuilder, "le", tt.ProgramBuilder.lt)
    r = anyio.run(lambda: gpt.run_on_device(model["cfg"], model["weights"], model["prompt"], NEW,
                                            donate=False, spec=SMALL))
    assert r["tokens"] != model["reference"]


def _steps(gpt: ModuleType, device: tt.Device, binary: tt.Binary, cfg: Any, weights: list[tt.Tensor],
           prompt: np.ndarray) -> Iterator[tuple[tt.Tensor, list[tt.Tensor]]]:
    """Prefill, then decode steps: each time the token and the caches."""
    layout = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, tt.DataType.FLOAT32)
    caches = [tt.empty((cfg.n_head, cfg.max_seq, cfg.d_head), tt.DataType.FLOAT32, device, layout)
              for _ in range(2 * cfg.n_layer)]
    ids = tt.to_device(prompt, device, gpt.IDS)
    token, pos, *caches = tt.submit(device, binary, gpt.PREFILL, [ids, *weights, *caches])
    while True:
        yield token, caches
        token, pos, *caches = tt.submit(device, binary, gpt.DECODE_STEP, [token, pos, *weights, *caches])


@pytest.mark.anyio
async def test_donated_caches_stay_in_place_and_memory_stays_constant(gpt: ModuleType, model: dict[str, Any]) -> None:
    donation(gpt, True)
    cfg = model["cfg"]
    binary = gpt.build(cfg, PROMPT, donate=True)
    async with tt.open_device(SMALL) as device:
        weights = gpt.push_weights(device, cfg, model["weights"])
        used, addresses, tokens = {}, {}, []
        for step, (token, caches) in enumerate(_steps(gpt, device, binary, cfg, weights, model["prompt"]), 1):
            tokens.append(int((await tt.to_host(token))[0]))
            if step in (10, NEW):
                addresses[step] = [c.buffer.address for c in caches]  # type: ignore[union-attr]
                used[step] = device.memory_used(tt.MemorySpace.DRAM)
            if step == NEW:
                break
        stats = device.stats
    assert tokens == model["reference"]
    assert used[10] == used[NEW]
    assert addresses[10] == addresses[NEW]  # the same buffers, updated in place
    assert stats.donations == 2 * cfg.n_layer * NEW
    # Each step writes one band of tiles (32 rows) per head and cache, not the whole cache.
    band = 2 * cfg.n_layer * cfg.n_head * 4096
    assert stats.cache_update_bytes == band * (NEW - 1)


@pytest.mark.anyio
async def test_a_donated_cache_is_consumed(gpt: ModuleType, model: dict[str, Any]) -> None:
    donation(gpt, True)
    cfg = model["cfg"]
    binary = gpt.build(cfg, PROMPT, donate=True)
    async with tt.open_device(SMALL) as device:
        weights = gpt.push_weights(device, cfg, model["weights"])
        steps = _steps(gpt, device, binary, cfg, weights, model["prompt"])
        _, prefilled = next(steps)
        token, _ = next(steps)  # the step took the prefilled caches' buffers over
        await token
        with pytest.raises(tt.DeallocatedTensorError, match="donated"):
            await tt.to_host(prefilled[0])


@pytest.mark.anyio
async def test_gpt_decode_low_precision_runs_and_reports_agreement(gpt: ModuleType, model: dict[str, Any]) -> None:
    r = await gpt.run_on_device(model["cfg"], model["weights"], model["prompt"], NEW,
                                donate=gpt.donation_supported(), act=tt.DataType.BFLOAT16,
                                weight_dtype=tt.DataType.BFLOAT8_B, spec=SMALL)
    assert len(r["tokens"]) == NEW and all(0 <= t < model["cfg"].vocab for t in r["tokens"])
    assert r["device_to_host_bytes"] == 4 * NEW


def test_gpt_decode_example_main(gpt: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    r = anyio.run(lambda: gpt.main(spec=SMALL))
    assert r["tokens"] == r["reference"] == r["not_donated_tokens"] and r["d2h_per_token"] == 4
    assert 0 <= r["low_precision_agreement"] <= 1
    assert "token for token: True" in capsys.readouterr().out


def test_cnn_digits_matches_numpy() -> None:
    r = anyio.run(lambda: load_example("cnn_digits").main(batch=32, train=300, spec=SMALL))
    assert r["max_error"] < 1e-4 and r["same_predictions"]
    assert r["accuracy"] > 0.8


def test_bench_decode_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "decode", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    runs = result["device"]
    assert all(r["tokens_equal_numpy"] for r in runs.values())
    assert all(r["device_to_host_bytes_per_token"] == 4 for r in runs.values())
    assert runs["not_donated"]["new_cache_bytes_per_step"] > 0
    if "donated" in runs:
        assert runs["donated"]["new_cache_bytes_per_step"] == 0
        assert runs["donated"]["cache_bytes_written_per_step"] < runs["not_donated"]["cache_bytes_written_per_step"]
    assert result["numpy_vs_device"] > 0


@pytest.mark.parametrize("name, says", [("gpt_decode", "token for token: True"),
                                        ("cnn_digits", "predictions equal numpy's: True")])
def test_model_examples_run_as_scripts(name: str, says: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert says in done.stdout
