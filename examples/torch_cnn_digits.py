"""PyTorch on the tt device: a small CNN learns 8x8 digit images, and CPU torch runs the same.

Conv2d -> ReLU -> MaxPool2d -> Conv2d -> ReLU -> AvgPool2d -> Flatten -> Linear, with the
cross-entropy inside the compiled function: `torch.compile(..., backend="tt")` makes the
forward (loss included) one device program and the backward another, and torch's own
`Adam` updates the tt parameters in place. The batches come from a
`torch.utils.data.DataLoader` whose data set (300 images) is not a multiple of the batch size
(32), so every epoch ends with a batch of 12: the compiled function is built once more for that
shape and then reused.

The same training runs on CPU torch from the same initial weights and over the same shuffled
batches, so the two loss curves can be laid side by side; the held-out accuracy is measured on
both (on tt, an inference program that returns only the predicted class per image).

The images are drawn here, no download: a hand-made 8x8 bitmap per digit, shifted by up to a
pixel, dimmed and sprinkled with noise. Needs `pip install ".[torch]" --extra-index-url https://download.pytorch.org/whl/cpu` from a ttflow checkout
(torch==2.13.0) and a C++ compiler once.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ttflow.torch as ttt

GLYPHS = [  # 0-9, 8x8
    ["..####..", ".#....#.", ".#....#.", ".#....#.", ".#....#.", ".#....#.", ".#....#.", "..####.."],
    ["...##...", "..###...", "...##...", "...##...", "...##...", "...##...", "...##...", "..####.."],
    ["..####..", ".#....#.", "......#.", ".....#..", "....#...", "...#....", "..#.....", ".######."],
    ["..####..", ".#....#.", "......#.", "...###..", "......#.", "......#.", ".#....#.", "..####.."],
    [".....#..", "....##..", "...#.#..", "..#..#..", ".######.", ".....#..", ".....#..", ".....#.."],
    [".######.", ".#......", ".#......", ".#####..", "......#.", "......#.", ".#....#.", "..####.."],
    ["..####..", ".#......", ".#......", ".#####..", ".#....#.", ".#....#.", ".#....#.", "..####.."],
    [".######.", "......#.", ".....#..", "....#...", "...#....", "...#....", "...#....", "...#...."],
    ["..####..", ".#....#.", ".#....#.", "..####..", ".#....#.", ".#....#.", ".#....#.", "..####.."],
    ["..####..", ".#....#.", ".#....#.", ".#....#.", "..#####.", "......#.", "......#.", "..####.."],
]
CLASSES = 10


def digits(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n noisy digit images [n, 1, 8, 8] in [0, 1] and their int64 labels."""
    glyphs = torch.tensor([[[c == "#" for c in row] for row in g] for g in GLYPHS], dtype=torch.float32)
    labels = torch.randint(0, CLASSES, (n,), generator=generator)
    shifts = torch.randint(-1, 2, (n, 2), generator=generator).tolist()
    images = torch.stack([torch.roll(glyphs[int(label)], tuple(shift), dims=(0, 1))
                          for label, shift in zip(labels, shifts)])
    brightness = torch.rand(n, 1, 1, generator=generator) * 0.4 + 0.6
    noise = torch.randn(n, 8, 8, generator=generator) * 0.2
    return (images * brightness + noise).clamp(0, 1).unsqueeze(1), labels


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # [N, 16, 4, 4]
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),  # [N, 32, 2, 2]
            nn.Flatten(),
        )
        self.head = nn.Linear(32 * 2 * 2, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class WithLoss(nn.Module):
    """The classifier and its cross-entropy in one function, so one program computes both."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x), y)


class Predict(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).argmax(dim=1)


def train(model: nn.Module, data: torch.utils.data.Dataset, held_out: tuple[torch.Tensor, torch.Tensor],
          steps: int, batch: int, lr: float, device: str) -> dict[str, Any]:
    """`steps` Adam steps over shuffled epochs of `data` on `device`; the loss per step, the
    held-out accuracy and the seconds spent training."""
    model = model.to(device)
    step_fn, predict = WithLoss(model), Predict(model)
    if device != "cpu":
        step_fn = torch.compile(step_fn, backend="tt")  # forward + loss, and backward: programs
        predict = torch.compile(predict, backend="tt")  # an inference program
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    # The same seed gives both runs the same shuffled order.
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True,
                                         generator=torch.Generator().manual_seed(1))
    losses: list[torch.Tensor] = []
    begin = time.perf_counter()
    while len(losses) < steps:
        for x, y in loader:
            loss = step_fn(x.to(device), y.to(device))  # on tt: queued, not yet computed
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            if len(losses) == steps:
                break
    curve = [float(loss) for loss in losses]  # waits for the device once, at the end
    seconds = time.perf_counter() - begin
    x, y = held_out
    with torch.no_grad():
        predicted = predict(x.to(device)).to("cpu")
    return {"losses": curve, "accuracy": float((predicted == y).float().mean()), "seconds": seconds,
            "model": model.to("cpu")}


def main(steps: int = 100, batch: int = 32, lr: float = 1e-2, train_size: int = 300, verbose: bool = True) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(*digits(train_size, generator))
    held_out = digits(200, generator)
    torch.manual_seed(0)
    model = DigitsCNN()
    reference = copy.deepcopy(model)  # the same initial weights for the CPU run

    on_tt = train(model, data, held_out, steps, batch, lr, "tt")
    stats = ttt.device().stats
    ttt.close()
    on_cpu = train(reference, data, held_out, steps, batch, lr, "cpu")

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
                  f"({run['seconds'] / steps * 1e3:.1f} ms/step), held-out accuracy {run['accuracy']:.3f}")
        print(f"per-step loss, tt against CPU: largest relative difference {max(differences):.1e}")
        print(f"programs run on tt: {stats.programs_run}")
    return result


if __name__ == "__main__":
    main()
