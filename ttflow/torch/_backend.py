"""`torch.tt`, the backend module torch asks a device for (`is_available`, `device`,
`synchronize`, `memory_allocated`, seeds, autocast's dtypes), and the wait torch's own
synchronization calls back into (`torch.accelerator.synchronize()`, a stream's `synchronize()`).
"""

from __future__ import annotations

import ctypes
import types
from typing import Any

import torch

import ttflow as tt

from . import _storage
from ._session import on_loop_thread, session

__all__ = ["BackendModule", "synchronize", "synchronize_callback"]


def synchronize() -> None:
    """Waits until every op and copy queued so far on the tt devices has run (as
    `torch.cuda.synchronize()`); raises the first error a queued op met."""
    if session._portal is not None:
        _storage.synchronize()


_SYNCHRONIZE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int8, ctypes.POINTER(ctypes.c_char), ctypes.c_size_t)


def _synchronize_for_torch(index: int, message: Any, capacity: int) -> int:
    """torch's own waits (`torch.accelerator.synchronize()`, a stream's `synchronize()`), called
    by the guard: `synchronize()`, its error written into `message` for the guard to raise."""
    if on_loop_thread():  # the loop thread never waits for its own work
        return 0
    try:
        synchronize()
    except BaseException as exc:  # noqa: BLE001 - carried back to C++, which raises it
        text = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}".encode()[:capacity]
        ctypes.memmove(message, text, len(text))
        return 1
    return 0


synchronize_callback = _SYNCHRONIZE(_synchronize_for_torch)  # kept alive: the guard holds its address


class _DeviceContext:
    """`torch.tt.device(d)`: `d` is the current tt device inside (as `torch.cuda.device`; torch
    enters it around copies to a device, e.g. in torch.load)."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self._outer: list[int] = []

    def __enter__(self) -> None:
        index = None
        if self.device is not None and (not isinstance(self.device, int) or self.device >= 0):
            index = _index(self.device)
            session.check_index(index)
        self._outer.append(torch.accelerator.current_device_index())
        if index is not None:
            torch.accelerator.set_device_index(index)

    def __exit__(self, *exc: object) -> None:
        torch.accelerator.set_device_index(self._outer.pop())


class BackendModule(types.ModuleType):
    """`torch.tt`: what torch asks a backend module for."""

    device = _DeviceContext

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        """How many tt devices can be used, as `torch.cuda.device_count()`: tt:0 (which opens
        on first use) and the devices opened after it (`ttflow.torch.open_device`), so that
        `range(torch.tt.device_count())` names only devices that work."""
        return session.device_count()

    def current_device(self) -> int:
        return torch.accelerator.current_device_index()

    def set_device(self, device: Any) -> None:
        """The device `device="tt"` means on this thread, as `torch.cuda.set_device`."""
        index = _index(device)
        session.check_index(index)
        torch.accelerator.set_device_index(index)

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed(self, seed: int) -> None:
        """tt's random numbers are drawn from torch's CPU generator (see docs/torch.md), so
        seeding tt seeds that generator, as `torch.manual_seed` does."""
        torch.default_generator.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def synchronize(self, device: Any = None) -> None:
        """`torch.tt.synchronize()`: waits until everything queued so far has run."""
        synchronize()

    def memory_allocated(self, device: Any = None) -> int:
        """Bytes of the device's DRAM and L1 that tensors hold now (`torch.cuda.memory_allocated`;
        the ttflow device's `memory_used`, after the posted work has run)."""
        tt_device = session.device(_index(device))
        _storage.drain_freed()  # storages torch freed since the last op give their memory back first
        return session.call(_memory_used, tt_device)

    def memory_reserved(self, device: Any = None) -> int:
        """As `memory_allocated`: ttflow frees a buffer when its tensor dies; no cache holds it."""
        return self.memory_allocated(device)

    def empty_cache(self) -> None:
        """Nothing to give back (no caching allocator); kept for device-agnostic code."""

    def get_device_name(self, device: Any = None) -> str:
        return f"ttflow emulated device ({session.device(_index(device)).spec.name})"

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        """`torch.autocast("tt")`: bfloat16 is the device's lower precision (float16 tensors
        are kept on the host, so autocasting to them would make every op a host round trip)."""
        return [torch.bfloat16]


async def _memory_used(device: tt.Device) -> int:
    await device.synchronize()  # the frees queued behind work still running are done
    return sum(device.memory_used(space) for space in tt.MemorySpace)


def _index(device: Any) -> int:
    """A device argument of torch.tt's functions (None, an index, "tt:1", a torch.device) as
    an index; None is the current device."""
    if device is None:
        return torch.accelerator.current_device_index()
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return torch.accelerator.current_device_index() if index is None else index
