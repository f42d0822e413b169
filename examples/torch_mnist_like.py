"""PyTorch on the tt device: an MNIST-shaped MLP trained with the torch 2.x conventions.

The loss and the data stay on the CPU; the forward and the backward run as ttflow programs on
the emulated device, torch's own SGD updates the tt parameters in place, and the weights stay
there until training ends. The
data are synthetic (a fixed random teacher labels random "images"), so the example needs no
download. Needs `pip install ".[torch]" --extra-index-url https://download.pytorch.org/whl/cpu` from a ttflow checkout (torch==2.13.0) and a C++ compiler once.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

import ttflow.torch as ttt


class MNISTLinear(nn.Module):
    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.l1 = nn.Linear(784, hidden)
        self.relu = nn.ReLU()
        self.l2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.relu(self.l1(x)))


def synthetic_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Images in [0, 1) and one-hot labels from a fixed random linear teacher."""
    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(784, 10, generator=generator)
    batches = []
    for _ in range(steps):
        x = torch.rand(batch, 784, generator=generator)
        labels = (x @ teacher).argmax(dim=1)
        batches.append((x, nn.functional.one_hot(labels, 10).float()))
    return batches


def main(steps: int = 60, batch: int = 64, lr: float = 0.05, verbose: bool = True) -> dict[str, Any]:
    torch.manual_seed(0)
    batches = synthetic_batches(steps, batch)
    framework_model = MNISTLinear()

    tt_model = torch.compile(framework_model, backend="tt")  # forward and backward device programs
    tt_model.to("tt")  # parameters pushed once, resident
    loss = torch.nn.L1Loss()  # stays on the CPU
    optimizer = torch.optim.SGD(tt_model.parameters(), lr=lr, momentum=0.9)  # torch's own, on tt tensors
    losses = []
    begin = time.perf_counter()
    for x, y in batches:
        model_out = tt_model(x.to("tt"))  # a tt tensor, not yet computed
        loss_out = loss(model_out.to("cpu"), y)  # waits for the device
        loss_out.backward()  # the gradient goes back into the backward program
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss_out.item())
    elapsed = time.perf_counter() - begin
    tt_model.to("cpu")  # trained parameters back in the torch module

    stats = ttt.device().stats
    param_bytes = sum(p.numel() * p.element_size() for p in framework_model.parameters())
    x, y = batches[-1]
    accuracy = float((framework_model(x).argmax(1) == y.argmax(1)).float().mean())
    ttt.close()
    result = {
        "first_loss": sum(losses[:5]) / 5, "last_loss": sum(losses[-5:]) / 5, "accuracy": accuracy,
        "h2d": stats.host_to_device_bytes, "d2h": stats.device_to_host_bytes,
        "param_bytes": param_bytes, "programs": stats.programs_run, "seconds": elapsed,
    }
    if verbose:
        print(f"loss {result['first_loss']:.4f} -> {result['last_loss']:.4f} over {steps} steps "
              f"({elapsed / steps * 1e3:.1f} ms/step), accuracy on the last batch {accuracy:.2f}")
        print(f"programs run: {stats.programs_run} (forward, backward, SGD step per batch)")
        per_step = (stats.device_to_host_bytes - param_bytes) // steps
        print(f"device -> host: {per_step} bytes per step (the outputs) + {param_bytes} bytes of "
              "trained parameters once at the end")
    return result


if __name__ == "__main__":
    main()
