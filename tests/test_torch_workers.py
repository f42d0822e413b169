"""The PyTorch front-end on a device whose records run in a worker process
(`ttflow.torch.open_device(workers="process")`): a training loop, eager and compiled, gives the
same bytes as on a thread-worker device, whether the worker runs every record
(`inline_seconds=-1`) or the front-end's default keeps the small ones in the host; and closing
leaves no child or shared-memory file behind (`test_process_workers.nothing_left_behind`).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu to test it"
)
ttt = pytest.importorskip("ttflow.torch")

from test_process_workers import _workers, nothing_left_behind  # noqa: F401 - the fixture
from torch import nn

from ttflow.torch._session import PROCESS_INLINE_SECONDS

pytestmark = pytest.mark.filterwarnings("ignore:aten.*ran on the CPU")


@pytest.fixture(autouse=True)
def closed(request: pytest.FixtureRequest):
    request.getfixturevalue("nothing_left_behind")  # set up first: torn down after the close below
    ttt.close()
    yield
    ttt.close()


def _train(device: str, compiled: bool, steps: int = 4) -> list[torch.Tensor]:
    """A small MLP's SGD steps on `device`: the losses, then the parameters, on the CPU."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = model.to(device)
    step_model = torch.compile(model, backend="tt") if compiled else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    xd, yd = x.to(device), y.to(device)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(step_model(xd), yd)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().cpu())
    return losses + [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("inline_seconds", [None, -1.0], ids=["default", "all-in-worker"])
def test_a_training_loop_on_a_worker_process_equals_thread_workers(compiled: bool,
                                                                    inline_seconds: float | None) -> None:
    ttt.open_device(index=0)
    ttt.open_device(index=1, workers="process", inline_seconds=inline_seconds)
    threads = _train("tt:0", compiled)
    processes = _train("tt:1", compiled)
    assert len(threads) == len(processes)
    for a, b in zip(threads, processes):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    # and both near CPU torch (an independent reference for the values themselves)
    for a, c in zip(threads, _train("cpu", False)):
        torch.testing.assert_close(a, c, rtol=2e-3, atol=2e-4)
    device = ttt.device(1)
    assert device.worker_pid is not None
    sent = sum(w.sent_jobs for w in _workers(device))
    if inline_seconds is None:
        assert device.inline_seconds == PROCESS_INLINE_SECONDS
    else:
        assert device.inline_seconds == -1.0 and sent > 0  # the worker ran the records


def test_the_front_ends_inline_default_is_only_for_worker_processes() -> None:
    ttt.open_device(index=0)
    ttt.open_device(index=1, workers="process", inline_seconds=0.0)
    assert ttt.device(1).inline_seconds == 0.0  # the caller's value wins
    from ttflow._commands import INLINE_SECONDS

    assert ttt.device(0).inline_seconds == INLINE_SECONDS
