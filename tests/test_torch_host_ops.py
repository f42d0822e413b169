"""A compiled graph's op the device lacks runs as a host op inside the program (issue 27 item 5).

Before, one such op sent the whole graph to run eagerly, op by op. Now the graph stays one
program and the op runs on CPU torch inside it, on its queue's worker thread. Against CPU torch:
values (forward and backward), an op with several results, and the refusals (a random op stays
eager, typed), an int64 result past INT32's range fails typed instead of wrapping.

Ops with lowerings are made to lack one through the lowering registry (a test-only seam), so the
test does not depend on which ops happen to be missing today; igamma has none.

Planted: the host function handing the op the wrong argument order (y, x) fails the igamma
test; skipping the INT32 range check fails the overflow test.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

import ttflow as tt  # noqa: E402
from ttflow.torch import _compile  # noqa: E402
from ttflow.torch._lower import graph  # noqa: E402

aten = torch.ops.aten


@pytest.fixture
def fresh(device: object) -> Iterator[None]:
    """Each test compiles anew (no program kept from another test's graph)."""
    torch._dynamo.reset()
    _compile._lowered_graphs.clear()
    from ttflow.torch import _warn

    _warn.warned.clear()
    yield
    torch._dynamo.reset()
    _compile._lowered_graphs.clear()


def _run(fn: Any, *args: torch.Tensor) -> tuple[Any, list[str]]:
    compiled = torch.compile(fn, backend="tt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = compiled(*[a.to("tt") for a in args])
        result = tuple(r.cpu() for r in result) if isinstance(result, tuple) else result.cpu()
    return result, [str(w.message) for w in caught]


def test_an_op_with_no_lowering_runs_on_the_host_and_the_graph_stays_one_program(fresh: None) -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x) + 1
        g = torch.special.gammainc(h, y.abs() + 0.5)  # aten.igamma: no tt lowering
        return (g * 2).sum(-1)

    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    got, messages = _run(f, x, y)
    torch.testing.assert_close(got, f(x, y), rtol=1e-6, atol=1e-6)
    assert not any("runs eagerly" in m for m in messages), messages
    assert any("aten.igamma.default ran on the CPU inside the compiled program, as a host op" in m
               for m in messages), messages


def test_hosted_ops_forward_and_backward_and_several_results(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(graph._LOWERINGS, aten.sort.default)
    monkeypatch.delitem(graph._LOWERINGS, aten.tanh.default)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.sort(x * 3, dim=-1)
        return torch.tanh(values).sum(), indices

    torch.manual_seed(1)
    x = torch.randn(5, 7)
    (total, indices), messages = _run(f, x)
    want_total, want_indices = f(x)
    torch.testing.assert_close(total, want_total, rtol=1e-6, atol=1e-6)
    assert torch.equal(indices, want_indices) and indices.dtype == torch.int64
    assert not any("runs eagerly" in m for m in messages), messages

    # training: the backward of the hosted tanh (its derivative from the saved result)
    w = torch.randn(7, 3, requires_grad=True)
    w_tt = w.detach().to("tt").requires_grad_()

    def loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a @ b).pow(2).mean()

    step = torch.compile(loss, backend="tt")
    step(x.to("tt"), w_tt).backward()
    loss(x, w).backward()
    assert w.grad is not None and w_tt.grad is not None
    torch.testing.assert_close(w_tt.grad.cpu(), w.grad, rtol=1e-5, atol=1e-6)


def test_what_cannot_be_hosted_is_typed(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(graph._LOWERINGS, aten.cumsum.default)

    def big(x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x * 70000, dim=-1)  # int64 past 2**31 after a few terms

    ints = torch.full((2, 64), 1000, dtype=torch.int64)
    compiled = torch.compile(big, backend="tt")
    with pytest.raises(tt.HostOpError, match="past INT32's range"):
        compiled(ints.to("tt")).cpu()
    small = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    torch.testing.assert_close(torch.compile(lambda x: torch.cumsum(x, -1), backend="tt")(small.to("tt")).cpu(),
                               torch.cumsum(small, -1))
    # A random op draws from the tt generator on the device only: not a host op.
    reason = graph.hostable(aten.bernoulli.default, [])
    assert reason is not None and "random" in reason
