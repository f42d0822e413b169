"""A second tt device, as a PyTorch user meets one: tensors made, computed and printed on `tt:1`
stay there, `torch.tt.device_count()` counts the devices that can be used, and a device past
them is a clear error. Every value is compared with CPU torch's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cpu to test it")
ttt = pytest.importorskip("ttflow.torch")

import ttflow as tt

pytestmark = pytest.mark.filterwarnings("ignore:aten.*ran on the CPU")

TT1 = torch.device("tt", 1)


@pytest.fixture
def two_devices() -> Iterator[None]:
    """tt:0 (the default device) and tt:1 (a small one); everything closed afterwards."""
    ttt.close()
    ttt.open_device()
    ttt.open_device(tt.DeviceSpec.small(), index=1)
    yield
    ttt.close()


@pytest.fixture
def nothing_open() -> Iterator[None]:
    ttt.close()
    yield
    ttt.close()


def _like(d: Any) -> Any:
    return torch.arange(6.0).reshape(2, 3).to(d)


FACTORIES: dict[str, Callable[[Any], Any]] = {
    "arange_float": lambda d: torch.arange(3.0, device=d),
    "arange_int": lambda d: torch.arange(3, device=d),
    "arange_start_step": lambda d: torch.arange(1, 10, 3, device=d),
    "arange_float64": lambda d: torch.arange(3, dtype=torch.float64, device=d),
    "eye": lambda d: torch.eye(2, device=d),
    "eye_rect": lambda d: torch.eye(2, 3, device=d),
    "zeros": lambda d: torch.zeros(2, 3, device=d),
    "ones": lambda d: torch.ones(2, device=d, dtype=torch.int64),
    "full": lambda d: torch.full((2, 3), 1.5, device=d),
    "full_int": lambda d: torch.full((3,), 7, device=d),
    "rand": lambda d: torch.rand(2, 3, device=d),
    "randn": lambda d: torch.randn(4, device=d),
    "randint": lambda d: torch.randint(0, 9, (5,), device=d),
    "randperm": lambda d: torch.randperm(5, device=d),
    "linspace": lambda d: torch.linspace(0, 1, 5, device=d),
    "logspace": lambda d: torch.logspace(0, 2, 3, device=d),
    "tensor": lambda d: torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=d),
    "tensor_int": lambda d: torch.tensor([1, 2, 3], device=d),
    "as_tensor": lambda d: torch.as_tensor([1.0, 2.0], device=d),
    "scalar_tensor": lambda d: torch.scalar_tensor(2.5, device=d),
    "tril_indices": lambda d: torch.tril_indices(3, 3, device=d),
    "triu_indices": lambda d: torch.triu_indices(3, 4, 1, device=d),
    "zeros_like": lambda d: torch.zeros_like(_like(d)),
    "full_like": lambda d: torch.full_like(_like(d), 3.0),
    "rand_like": lambda d: torch.rand_like(_like(d)),
    "new_ones": lambda d: _like(d).new_ones(2),
    "empty": lambda d: torch.empty(2, 3, device=d).fill_(0.5),
    "empty_strided": lambda d: torch.empty_strided((2, 3), (1, 2), device=d).fill_(0.5),
}


@pytest.mark.parametrize("spelling", ["tt:1", "torch.device", "current"])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_factories_make_their_tensor_on_the_device_they_are_given(two_devices: None, name: str,
                                                                  spelling: str) -> None:
    make = FACTORIES[name]
    torch.manual_seed(0)
    want = make("cpu")
    torch.manual_seed(0)
    if spelling == "current":  # device="tt" is the current tt device, as "cuda" is
        with torch.tt.device(1):
            got = make("tt")
    else:
        got = make("tt:1" if spelling == "tt:1" else TT1)
    assert got.device == TT1, got.device
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.cpu(), want)


OPS: dict[str, Callable[[Any], Any]] = {
    "abs": lambda x: (-x).abs(),  # a structured op: its out= tensor is resized
    "exp": torch.exp,
    "sum": lambda x: x.sum(0),
    "matmul": lambda x: x @ x.T,
    "cat": lambda x: torch.cat([x, x]),
    "to_int": lambda x: x.to(torch.int32),
    "clone": torch.clone,
    "igamma": lambda x: torch.igamma(x + 1, x),  # no device lowering: the CPU fallback
    "cumsum": lambda x: x.cumsum(1),
    "nonzero": torch.nonzero,
    "resize_": lambda x: x.clone().resize_(7),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_results_of_ops_on_the_second_device_stay_there(two_devices: None, name: str) -> None:
    x = torch.arange(12.0).reshape(3, 4) / 4
    got = OPS[name](x.to("tt:1"))
    want = OPS[name](x)
    assert got.device == TT1, got.device
    if name == "resize_":  # the new elements are uninitialised, on both devices
        got, want = got[:7], want[:7]
        assert got.shape == want.shape
        return
    torch.testing.assert_close(got.cpu(), want)


def _repr_on(cpu: Any, device: str) -> str:
    """How CPU torch prints `cpu` with its device named: `device=` is the first suffix, before
    `dtype=` (these tensors' last lines are short: no suffix wraps)."""
    text = repr(cpu)
    dtype_suffix = f", dtype={cpu.dtype})"
    if text.endswith(dtype_suffix):
        return text[: -len(dtype_suffix)] + f", device='{device}'" + dtype_suffix
    return text[:-1] + f", device='{device}')"


PRINTED: dict[str, Callable[[], Any]] = {
    "vector": lambda: torch.tensor([1.0, -2.5, 3.25]),
    "matrix": lambda: torch.arange(12.0).reshape(3, 4) / 3,
    "scalar": lambda: torch.tensor(1.5),
    "int64": lambda: torch.tensor([1, 20, 300]),
    "int32": lambda: torch.tensor([1, 20], dtype=torch.int32),
    "bool": lambda: torch.tensor([True, False]),
    "bfloat16": lambda: torch.tensor([1.0, 2.5], dtype=torch.bfloat16),
    "float64": lambda: torch.tensor([1.0, 2.5], dtype=torch.float64),
    "summarized": lambda: torch.arange(10000.0).reshape(100, 100),  # torch prints its corners only
    "inf_nan": lambda: torch.tensor([float("inf"), float("nan"), 1.0]),
}


@pytest.mark.parametrize("name", sorted(PRINTED))
@pytest.mark.parametrize("device", ["tt:0", "tt:1"])
def test_a_tensor_prints_as_on_the_cpu_on_either_device(two_devices: None, name: str, device: str) -> None:
    cpu = PRINTED[name]()
    moved = cpu.to(device)
    assert repr(moved) == _repr_on(cpu, device)
    assert str(moved) == _repr_on(cpu, device)


def test_device_count_counts_the_devices_that_can_be_used(nothing_open: None) -> None:
    # tt:0 opens on first use: it can be used before anything is opened.
    assert torch.tt.device_count() == 1 == torch.accelerator.device_count()
    for i in range(torch.tt.device_count()):
        assert torch.equal(torch.arange(4.0, device=f"tt:{i}").mul(2).cpu(), torch.arange(4.0).mul(2))
    ttt.open_device(tt.DeviceSpec.small(), index=1)
    ttt.open_device(tt.DeviceSpec.small())  # the next free index
    assert torch.tt.device_count() == 3 == torch.accelerator.device_count()
    for i in range(torch.tt.device_count()):
        x = torch.arange(4.0, device=f"tt:{i}")
        assert x.device == torch.device("tt", i)
        assert torch.equal((x * 2).cpu(), torch.arange(4.0) * 2)
    ttt.close()
    assert torch.tt.device_count() == 1


BEYOND: dict[str, Callable[[], Any]] = {
    "empty": lambda: torch.empty(2, device="tt:2"),
    "ones": lambda: torch.ones(2, device="tt:2"),
    "to": lambda: torch.ones(2).to("tt:2"),
    "arange": lambda: torch.arange(3.0, device="tt:5"),
    "set_device": lambda: torch.tt.set_device(2),
    "device_context": lambda: torch.tt.device(3).__enter__(),
}


@pytest.mark.parametrize("name", sorted(BEYOND))
def test_a_device_past_the_count_is_a_clear_error(two_devices: None, name: str) -> None:
    assert torch.tt.device_count() == 2
    with pytest.raises(RuntimeError, match=r"tt:\d is not open.*device_count\(\) is 2.*open_device"):
        BEYOND[name]()
    assert torch.tt.current_device() == 0  # nothing half-done


def test_devices_are_opened_in_order(two_devices: None) -> None:
    with pytest.raises(ValueError, match=r"tt:3.*tt:2.*first"):
        ttt.open_device(tt.DeviceSpec.small(), index=3)
    assert torch.tt.device_count() == 2
