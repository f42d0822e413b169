import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=15, deadline=None)
settings.register_profile(
    "long", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=["c", "checked"])
def spmd_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a mesh test on both implementations of an SPMD submit: the C fast path
    (`_core._dispatch.submit_spmd`, one pass over every chip) and the checked path it falls back
    to (one single-chip submit per chip), so the two cannot drift apart."""
    if request.param == "checked":
        from ttflow._core import _dispatch

        monkeypatch.setattr(_dispatch, "submit_spmd", lambda *args: None)
    return str(request.param)


@pytest.fixture(scope="module")
def device() -> Iterator[Any]:
    """A fresh tt device (ttflow.torch's) for a torch test module, closed after it; a module may
    define its own."""
    import ttflow.torch as ttt

    ttt.close()
    ttt.open_device()
    yield ttt.device()
    ttt.close()


@pytest.fixture
def on_device_only(device: Any) -> Iterator[None]:
    """The module's device, and the guard that fails the test on any op run on the CPU."""
    from torch_support import only_on_device

    with only_on_device():
        yield
