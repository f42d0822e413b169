"""PyTorch on the tt device: a tiny causal transformer learns to continue counting sequences.

Each sequence counts up modulo a small vocabulary with its own stride: 3, 5, 7, 9, ... (stride 2)
or 14, 1, 4, 7, ... (stride 3, modulo 16). The first token says nothing about the second, but
from the second token on the next one follows from the last two, so the model has to look back
through its causal attention, not only at the current token.

The model is an `nn.Embedding` over int64 ids plus a learned position vector, two
`nn.TransformerEncoderLayer(batch_first=True)` under a causal mask, and a `nn.Linear` to the
vocabulary; the cross-entropy over every position is inside the compiled function, so
`torch.compile(..., backend="tt")` makes forward-and-loss one device program and the backward
another, and torch's own `AdamW` updates the tt parameters in place. Dropout is 0, so the same
training on CPU torch from the same initial weights over the same batches gives the same loss
curve up to float32 rounding; both curves are returned, with the next-token accuracy on
held-out sequences (on tt, an inference program that returns the predicted ids).

The sequences are generated here, no download. Needs `pip install ".[torch]" --extra-index-url https://download.pytorch.org/whl/cpu` from a ttflow
checkout (torch==2.13.0) and a C++ compiler once.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ttflow.torch as ttt

VOCAB, LENGTH = 16, 12
STRIDES = (1, 2, 3, 5)


def counting(n: int, generator: torch.Generator) -> torch.Tensor:
    """n int64 sequences [n, LENGTH + 1]: a random start, counting up by a random stride mod VOCAB."""
    start = torch.randint(0, VOCAB, (n, 1), generator=generator)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (n, 1), generator=generator)]
    return (start + stride * torch.arange(LENGTH + 1)) % VOCAB


class TinyTransformer(nn.Module):
    def __init__(self, width: int = 32, heads: int = 2, layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(LENGTH, width) * 0.1)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=dropout, batch_first=True)
            for _ in range(layers))
        self.out = nn.Linear(width, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.position[: ids.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.out(h)  # [N, T, VOCAB] logits for the token after each position


class WithLoss(nn.Module):
    """Next-token cross-entropy over every position, in the same function as the model."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(ids).reshape(-1, VOCAB), targets.reshape(-1))


class Predict(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).argmax(dim=-1)


def train(model: nn.Module, batches: list[torch.Tensor], held_out: torch.Tensor, lr: float,
          device: str) -> dict[str, Any]:
    """One AdamW step per batch on `device`; the loss per step, the held-out next-token accuracy
    (from the second position on, where the stride is known) and the seconds spent training."""
    model = model.to(device)
    step_fn, predict = WithLoss(model), Predict(model)
    if device != "cpu":
        step_fn = torch.compile(step_fn, backend="tt")
        predict = torch.compile(predict, backend="tt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses: list[torch.Tensor] = []
    begin = time.perf_counter()
    for sequences in batches:
        sequences = sequences.to(device)  # int64 ids; on tt they live as int32
        loss = step_fn(sequences[:, :-1], sequences[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    curve = [float(loss) for loss in losses]  # waits for the device once, at the end
    seconds = time.perf_counter() - begin
    model.eval()
    # In eval mode under no_grad, nn.TransformerEncoderLayer takes torch's fused fast path
    # (aten._transformer_encoder_layer_fwd); ttflow.torch runs it on the device too.
    with torch.no_grad():
        predicted = predict(held_out[:, :-1].to(device)).to("cpu")
    right = (predicted == held_out[:, 1:])[:, 1:]
    return {"losses": curve, "accuracy": float(right.float().mean()), "seconds": seconds,
            "model": model.to("cpu")}


def main(steps: int = 100, batch: int = 32, lr: float = 3e-3, verbose: bool = True) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    batches = [counting(batch, generator) for _ in range(steps)]
    held_out = counting(256, generator)
    torch.manual_seed(0)
    model = TinyTransformer()
    reference = copy.deepcopy(model)  # the same initial weights for the CPU run

    on_tt = train(model, batches, held_out, lr, "tt")
    stats = ttt.device().stats
    ttt.close()
    on_cpu = train(reference, batches, held_out, lr, "cpu")

    differences = [abs(a - b) / abs(b) for a, b in zip(on_tt["losses"], on_cpu["losses"])]
    result = {
        "tt_losses": on_tt["losses"], "cpu_losses": on_cpu["losses"],
        "tt_accuracy": on_tt["accuracy"], "cpu_accuracy": on_cpu["accuracy"],
        "max_relative_difference": max(differences),
        "tt_seconds": on_tt["seconds"], "cpu_seconds": on_cpu["seconds"],
        "programs": stats.programs_run,
    }
    if verbose:
        n = min(5, steps)
        for name, run in (("tt ", on_tt), ("cpu", on_cpu)):
            first, last = sum(run["losses"][:n]) / n, sum(run["losses"][-n:]) / n
            print(f"{name}: loss {first:.4f} -> {last:.4f} over {steps} steps "
                  f"({run['seconds'] / steps * 1e3:.1f} ms/step), held-out next-token accuracy "
                  f"{run['accuracy']:.3f}")
        print(f"per-step loss, tt against CPU: largest relative difference {max(differences):.1e}")
        print(f"programs run on tt: {stats.programs_run}")
    return result


if __name__ == "__main__":
    main()
