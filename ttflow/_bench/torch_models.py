"""The model test bed's models on tt against CPU torch, in the same run (`ttflow bench torch --models`).

Hugging Face's GPT-2, Llama (grouped-query attention), BERT, T5 and ViT and torchvision's
resnet18 and mobilenet_v3_small, in the tiny random-weight configs `tests/test_torch_models.py`
checks (nothing downloaded). Per model, best of `rounds` interleaved rounds:

- **forward**, warm, `eval()` under `no_grad`: tt eager and tt compiled against CPU torch eager;
- **training step**, warm (compiled forward and backward on tt, AdamW or SGD with momentum;
  the same step eagerly on CPU torch);
- **cold**: the first compiled forward call (dynamo, AOTAutograd, lowering, the first run)
  against CPU torch's own `torch.compile(backend="aot_eager")` first call on the same model.

Needs torch and the models extra (`transformers`; torchvision for the CNNs, whose model code is
used alone where its C++ ops do not load). Models whose package is missing are listed as skipped.
"""

from __future__ import annotations

import copy
import sys
import time
import types
from collections.abc import Callable
from typing import Any

__all__ = ["format_table", "models", "run", "torchvision_module"]


def torchvision_module() -> types.ModuleType | None:
    """torchvision's model code. PyPI's torchvision 0.28 is a CUDA build whose C++ ops do not
    load beside CPU torch (its import fails registering `torchvision::nms`); the models need none
    of those ops, so the module that registers them is left out."""
    try:
        import torchvision
    except ImportError:
        return None
    except RuntimeError:
        for name in [n for n in sys.modules if n.startswith("torchvision")]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision
    return torchvision


def models() -> dict[str, tuple[Callable[[], Any], Callable[[], dict[str, Any]], str]]:
    """name -> (make the model, make its inputs, what a training step minimizes): the test
    bed's tiny configs. Skips the families whose package is missing."""
    import torch

    found: dict[str, tuple[Callable[[], Any], Callable[[], dict[str, Any]], str]] = {}
    vision = torchvision_module()  # first: transformers imports torchvision when it is there

    def ids(*shape: int, seed: int = 0) -> Any:
        return torch.randint(2, 95, shape, generator=torch.Generator().manual_seed(seed))

    try:
        import transformers as hf
    except ImportError:
        hf = None  # type: ignore[assignment]
    if hf is not None:
        found["gpt2"] = (lambda: hf.GPT2LMHeadModel(hf.GPT2Config(
            vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=95,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
            lambda: {"input_ids": ids(2, 8), "labels": ids(2, 8)}, "loss")
        found["llama"] = (lambda: hf.LlamaForCausalLM(hf.LlamaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=95)),
            lambda: {"input_ids": ids(2, 8), "labels": ids(2, 8)}, "loss")
        found["bert"] = (lambda: hf.BertModel(hf.BertConfig(
            vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
            lambda: {"input_ids": ids(2, 8)}, "hidden")
        found["t5"] = (lambda: hf.T5ForConditionalGeneration(hf.T5Config(  # type: ignore[call-arg]
            vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
            lambda: {"input_ids": ids(2, 8), "labels": ids(2, 4, seed=1)}, "loss")
        found["vit"] = (lambda: hf.ViTModel(hf.ViTConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
            lambda: {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))},
            "hidden")
    if vision is not None:
        images = {"x": torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
        def cnn(name: str) -> Callable[[], Any]:
            return lambda: getattr(vision.models, name)(num_classes=10)

        for name in ("resnet18", "mobilenet_v3_small"):
            found[name] = (cnn(name), lambda: dict(images), "classes")
    return found


def _loss(kind: str, out: Any) -> Any:
    import torch

    if kind == "loss":
        return out.loss
    if kind == "classes":
        return torch.nn.functional.cross_entropy(out, torch.arange(out.shape[0], device=out.device) % 10)
    return out[0].square().mean()


def _call(model: Any, inputs: dict[str, Any]) -> Any:
    return model(inputs["x"]) if list(inputs) == ["x"] else model(**inputs)


def _time(fn: Callable[[], Any]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def _measure(name: str, make: Callable[[], Any], inputs: Callable[[], dict[str, Any]], kind: str,
             rounds: int) -> dict[str, Any]:
    import torch

    import ttflow.torch as ttt

    torch.manual_seed(0)
    cpu = make()
    x = inputs()
    forward_x = x  # with the labels: T5's decoder starts from them, the LMs add their loss
    tt_model = copy.deepcopy(cpu).to("tt")
    xt = {k: v.to("tt") for k, v in x.items()}
    forward_xt = xt

    def sync(value: Any) -> Any:
        ttt.synchronize()
        return value

    # Cold: the first compiled call, against torch's own compile of the same model on the CPU.
    cpu.eval(), tt_model.eval()
    torch._dynamo.reset()
    with torch.no_grad():
        cold_cpu = _time(lambda: _call(torch.compile(cpu, backend="aot_eager"), forward_x))
        compiled = torch.compile(tt_model, backend="tt")
        cold_tt = _time(lambda: sync(_call(compiled, forward_xt)))
    forward: dict[str, list[float]] = {"cpu": [], "tt_eager": [], "tt_compiled": []}
    with torch.no_grad():
        _call(tt_model, forward_xt), sync(None)  # warm the eager programs
        for _ in range(rounds):
            forward["cpu"].append(_time(lambda: _call(cpu, forward_x)))
            forward["tt_eager"].append(_time(lambda: sync(_call(tt_model, forward_xt))))
            forward["tt_compiled"].append(_time(lambda: sync(_call(compiled, forward_xt))))
    # A training step: compiled forward and backward on tt, torch's optimizer on tt parameters.
    cpu.train(), tt_model.train()
    torch._dynamo.reset()
    trained = torch.compile(tt_model, backend="tt")
    make_opt = (lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9)) if kind == "classes" else (
        lambda p: torch.optim.AdamW(p, lr=1e-3))
    cpu_opt, tt_opt = make_opt(cpu.parameters()), make_opt(tt_model.parameters())

    def step(model: Any, opt: Any, data: dict[str, Any]) -> float:
        loss = _loss(kind, _call(model, data))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.item())

    step(trained, tt_opt, xt)  # compiles
    training: dict[str, list[float]] = {"cpu": [], "tt": []}
    for _ in range(rounds):
        training["cpu"].append(_time(lambda: step(cpu, cpu_opt, x)))
        training["tt"].append(_time(lambda: step(trained, tt_opt, xt)))
    best = {k: min(v) for k, v in forward.items()}
    best_step = {k: min(v) for k, v in training.items()}
    torch._dynamo.reset()
    return {
        "model": name,
        "forward_ms_cpu": best["cpu"] * 1e3,
        "forward_ms_tt_eager": best["tt_eager"] * 1e3,
        "forward_ms_tt_compiled": best["tt_compiled"] * 1e3,
        "forward_ratio_eager": best["tt_eager"] / best["cpu"],
        "forward_ratio_compiled": best["tt_compiled"] / best["cpu"],
        "step_ms_cpu": best_step["cpu"] * 1e3,
        "step_ms_tt": best_step["tt"] * 1e3,
        "step_ratio": best_step["tt"] / best_step["cpu"],
        "cold_s_cpu_aot_eager": cold_cpu,
        "cold_s_tt": cold_tt,
        "cold_ratio": cold_tt / cold_cpu,
    }


def run(quick: bool = False, rounds: int = 3) -> dict[str, Any]:
    import logging
    import warnings

    import torch

    import ttflow.torch as ttt

    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU torch's second thread mostly spins on this machine's 2 cores
    found = models()
    chosen = list(found)[:2] if quick else list(found)
    results = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in chosen:
                make, inputs, kind = found[name]
                results.append(_measure(name, make, inputs, kind, 1 if quick else rounds))
    finally:
        torch.set_num_threads(threads)
        ttt.close()
    expected = ["gpt2", "llama", "bert", "t5", "vit", "resnet18", "mobilenet_v3_small"]
    skipped = [{"model": n, "reason": "transformers or torchvision is not installed (the models extra)"}
               for n in expected if n not in found]
    return {"benchmark": "torch_models", "results": results, "skipped": skipped}


def format_table(result: dict[str, Any]) -> str:
    lines = ["The model test bed on tt vs CPU torch (same run, best of rounds; ratio = tt / CPU)",
             f"  {'model':<20}{'forward eager':>15}{'compiled':>10}{'train step':>12}{'cold':>8}"]
    for r in result["results"]:
        lines.append(f"  {r['model']:<20}{r['forward_ratio_eager']:>14.1f}x{r['forward_ratio_compiled']:>9.1f}x"
                     f"{r['step_ratio']:>11.1f}x{r['cold_ratio']:>7.1f}x")
    lines.append("  (cold: the first compiled forward against CPU torch.compile(backend='aot_eager')'s first call)")
    for s in result["skipped"]:
        lines.append(f"  {s['model']}: skipped, {s['reason']}")
    return "\n".join(lines)
