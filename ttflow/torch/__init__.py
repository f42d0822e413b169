"""PyTorch front-end: the "tt" torch device, compiled modules, backward and SGD on the device.

    import torch, ttflow.torch as ttt
    tt_model = ttt.compile(model).to("tt")
    out = tt_model(x.to("tt"))          # queued; returns at once
    loss(out.to("cpu"), y).backward()   # .to("cpu") waits; the gradient goes back to the device

Importing this module names torch's PrivateUse1 backend "tt" and loads the C++ device guard
torch needs for it. The first import builds the guard (20-60 s, once, cached per torch version:
a line on stderr says so before the compiler starts; `python -m ttflow.torch` builds it ahead). Install with `pip install ".[torch]" --extra-index-url
https://download.pytorch.org/whl/cpu` from a ttflow checkout (the CPU build of torch).
"""

from __future__ import annotations

try:
    import torch as _torch
except ModuleNotFoundError as exc:  # pragma: no cover - exercised without torch (tests/test_torch_without_torch.py)
    if exc.name != "torch":
        raise  # torch is there, and one of its own imports is missing: that error is the one to see
    # A ModuleNotFoundError naming torch, as a missing module's own: `pytest.importorskip` skips
    # on it (pytest >= 9 skips on nothing else), and `except ImportError` still catches it.
    raise ModuleNotFoundError(
        "ttflow.torch needs PyTorch, the optional torch extra: pip install '.[torch]' --extra-index-url "
        "https://download.pytorch.org/whl/cpu in the ttflow checkout (torch==2.13.0, the tested release, "
        "as PyTorch's CPU build)",
        name="torch",
    ) from exc

import ttflow as _tt

from ._backend import synchronize as synchronize
from ._compile import backend as backend
from ._compile import compile as compile
from ._compile import register as _register_backend
from ._device import TTTensor as TTTensor
from ._device import install as _install
from ._errors import UnsupportedOpError as UnsupportedOpError
from ._session import session as _session

__all__ = ["TTTensor", "UnsupportedOpError", "backend", "close", "compile", "device", "open_device", "synchronize"]

_install()
_register_backend()


def open_device(spec: _tt.DeviceSpec | None = None, index: int | None = None, *,
                workers: str = "thread", inline_seconds: float | None = None) -> _torch.device:
    """Opens an emulated device (default: n150) and returns its torch device, e.g. `tt:0`.

    The first `.to("tt")` opens the default device on its own; call this first to choose another
    spec, to open a second device (`tt:1`), or to run the device's records in a worker process
    (`workers="process"`, as `ttflow.open_device`'s). Devices open in order (the lowest free
    index by default; `index` may not skip one), so `torch.tt.device_count()` counts tt:0 to
    the highest one open, and each of them can be used. `inline_seconds` as `ttflow.open_device`'s,
    except that a worker process's device keeps records estimated up to 150 us in the host by
    default (torch's programs are small and dispatched one by one: docs/workers.md).
    """
    return _torch.device("tt", _session.open(spec, index, workers, inline_seconds))


def device(index: int = 0) -> _tt.Device:
    """The ttflow device behind `tt:index` (its `stats`, its memory), opening tt:0 if needed."""
    return _session.device(index)


def close() -> None:
    """Drains and closes every tt device and stops the event loop thread.

    Tensors still on a closed device raise `ttflow.DeviceClosedError` when used; a later
    `.to("tt")` opens a fresh device. Registered with atexit, so calling it is optional.
    """
    _session.close()
