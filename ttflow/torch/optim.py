"""Optimizers whose step is a device program: weights never leave the device while training."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

import ttflow as tt

from ._device import TILE, TTTensor, device_shape, run_program, same_device, tt_value

__all__ = ["SGD"]


class SGD(torch.optim.Optimizer):
    """torch.optim.SGD's update (momentum, dampening, weight decay, Nesterov), run on the device.

    One program per parameter group and step updates every parameter that has a gradient; the
    new weights and momentum buffers are device tensors that replace the old ones. Parameters on
    the CPU are updated on the CPU with the same rule.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"invalid SGD settings: lr={lr}, momentum={momentum}, weight_decay={weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            on_tt = [p for p in params if isinstance(p, TTTensor)]
            for p in params:
                if not isinstance(p, TTTensor):
                    self._cpu_step(p, group)
            if on_tt:
                self._device_step(on_tt, group)
        return loss

    def _cpu_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        d_p = p.grad.to(p.device)  # type: ignore[union-attr]
        if group["weight_decay"]:
            d_p = d_p.add(p, alpha=group["weight_decay"])
        if group["momentum"]:
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = d_p.clone()
            else:
                buf.mul_(group["momentum"]).add_(d_p, alpha=1 - group["dampening"])
            d_p = d_p.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
        p.add_(d_p, alpha=-group["lr"])

    def _device_step(self, params: list[TTTensor], group: dict[str, Any]) -> None:
        device = same_device(params, "ttflow.torch.optim.SGD")
        lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
        decay, nesterov = group["weight_decay"], group["nesterov"]
        grads = []
        for p in params:
            g = p.grad
            if not isinstance(g, TTTensor):  # a gradient set on the CPU: push it once
                g = g.to(p.device)  # type: ignore[union-attr]
            grads.append(g)
        same_device([*params, *grads], "ttflow.torch.optim.SGD")
        bufs = [self.state[p].get("momentum_buffer") if momentum else None for p in params]
        has_buf = tuple(b is not None for b in bufs)
        shapes = tuple(device_shape(p.shape) for p in params)
        key = ("sgd", shapes, has_buf, lr, momentum, dampening, decay, nesterov)

        def build() -> tt.Program:
            b = tt.ProgramBuilder("sgd_step")
            ps = [b.input(s, TILE) for s in shapes]
            gs = [b.input(s, TILE) for s in shapes]
            old = [b.input(s, TILE) for s, h in zip(shapes, has_buf) if h]
            old_iter = iter(old)
            new_ps, new_bufs = [], []
            for p, g, h in zip(ps, gs, has_buf):
                d = b.add(g, b.mul(p, decay)) if decay else g
                if momentum:
                    buf = b.add(b.mul(next(old_iter), momentum), b.mul(d, 1 - dampening)) if h else d
                    new_bufs.append(buf)
                    d = b.add(d, b.mul(buf, momentum)) if nesterov else buf
                new_ps.append(b.sub(p, b.mul(d, lr)))
            for v in [*new_ps, *new_bufs]:
                b.output(v, TILE)
            return b.build()

        inputs = [tt_value(p) for p in params] + [tt_value(g) for g in grads]
        inputs += [tt_value(buf) for buf in bufs if buf is not None]
        outputs = run_program(key, build, device, inputs)
        for p, value in zip(params, outputs):
            p._tt = value  # weights stay on the device
        if momentum:
            for p, value in zip(params, outputs[len(params):]):
                self.state[p]["momentum_buffer"] = TTTensor(value, p.shape, p.dtype, device)
