"""Debug hooks under the PyTorch front-end (issue 27): the lowering names every step by its FX
node, its ATen op and the user's source line, and a harness sees a compiled model's ops through
`tt.debug_hooks(ttflow.torch.device(), ...)`, reading each against CPU torch and replacing one.

Planted: the lowering without its `location` block (every step unnamed) fails the first test.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

import ttflow as tt  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * 2  # the line the locations name


def test_a_compiled_models_ops_carry_their_aten_op_and_source_line(device: object) -> None:
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(3, 8)
    want = model(x)
    compiled = torch.compile(model.to("tt"), backend="tt")
    compiled(x.to("tt"))  # compiled and run once, outside the hooks
    line = inspect.getsourcelines(Block.forward)[1] + 1
    seen: list[tuple[str, str | None, np.ndarray]] = []

    async def post_op(ctx: tt.OpContext) -> None:
        seen.append((ctx.name, ctx.loc, await tt.to_host(ctx.outputs[0])))

    with tt.debug_hooks(ttt.device(), post_op=post_op):
        got = compiled(x.to("tt")).cpu()
    torch.testing.assert_close(got, want)
    named = {name: loc for name, loc, _ in seen if loc is not None}
    assert named["matmul"].startswith("addmm = aten.addmm.default")
    assert named["relu"].startswith("relu = aten.relu.default")
    assert all(f"test_torch_debug_hooks.py:{line} in forward" in loc for loc in named.values())
    relu = next(value for name, _, value in seen if name == "relu")
    np.testing.assert_allclose(relu, torch.relu(model.to("cpu").fc(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_replaced_intermediate_reaches_the_torch_output(device: object) -> None:
    torch.manual_seed(1)
    model = Block()
    x = torch.randn(3, 8)
    compiled = torch.compile(model.to("tt"), backend="tt")
    compiled(x.to("tt"))

    def post_op(ctx: tt.OpContext) -> None:
        if ctx.name == "relu":
            tt.write(ctx.outputs[0], np.full(ctx.outputs[0].shape, 0.25, np.float32))

    with tt.debug_hooks(ttt.device(), post_op=post_op):
        got = compiled(x.to("tt")).cpu()
    torch.testing.assert_close(got, torch.full((3, 4), 0.5))
