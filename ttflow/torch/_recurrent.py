"""LSTM and GRU cells on tt, spelled in ops the device runs.

ATen's `lstm`/`gru` call the fused cell kernels `_thnn_fused_lstm_cell` / `_thnn_fused_gru_cell`
for every device but the CPU, and torch ships those kernels for CUDA only. Registered at
`AutogradPrivateUse1`, the cells below run as ordinary tt ops, so autograd records those ops and
backward needs no fused backward kernel (the same formulas as ATen's CUDA kernels).
"""

from __future__ import annotations

import torch

__all__ = ["CELLS"]


def _gates(input_gates: torch.Tensor, hidden_gates: torch.Tensor, input_bias: torch.Tensor | None,
           hidden_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    return input_gates, hidden_gates


def _lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
               input_bias: torch.Tensor | None = None,
               hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    input_gates, hidden_gates = _gates(input_gates, hidden_gates, input_bias, hidden_bias)
    gates = input_gates + hidden_gates
    i, f, g, o = gates.chunk(4, 1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    hy = torch.sigmoid(o) * torch.tanh(cy)
    return hy, cy, gates  # the workspace is for the fused backward, which never runs here


def _gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
              input_bias: torch.Tensor | None = None,
              hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    input_gates, hidden_gates = _gates(input_gates, hidden_gates, input_bias, hidden_bias)
    ir, iz, in_ = input_gates.chunk(3, 1)
    hr, hz, hn = hidden_gates.chunk(3, 1)
    r = torch.sigmoid(ir + hr)
    z = torch.sigmoid(iz + hz)
    n = torch.tanh(in_ + r * hn)
    hy = (hx - n) * z + n
    return hy, torch.cat([r, z, n, hn], 1)


CELLS = {"_thnn_fused_lstm_cell": _lstm_cell, "_thnn_fused_gru_cell": _gru_cell}
"""The fused cell ops and their kernels, for the AutogradPrivateUse1 key."""
