"""The CPU fallback: an op the device cannot run runs on CPU copies of its tt arguments, once
warning which op did so (at the user's line), and its results come back as tt tensors.

A mechanism of its own, below the kernels (`_device`) and the foreach kernels (`_foreach`) that
both fall back to it; it knows storages (`_storage`) and nothing above them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from . import _storage, _warn
from ._session import session
from ._warn import warn_user

__all__ = ["cpu_fallback", "from_host", "host_generators", "is_tt", "on_device_args", "warn_cpu", "warned"]


def is_tt(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "tt"


# The ops that have warned (once each), with those a compiled program hosts: one set
# (`_warn.warned`), so a test that clears it sees every warning again.
warned = _warn.warned


def warn_cpu(op: Any, reason: str) -> None:
    name = str(op)
    if name not in warned:
        warned.add(name)
        warn_user(
            f"{name} ran on the CPU: {reason}. Its tt inputs were copied to the host and its "
            "results back (this warning is shown once per op)"
        )


@contextlib.contextmanager
def host_generators(kwargs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`kwargs` with each tt generator (`torch.Generator(device="tt")`) replaced by a CPU one in
    its state, for a host op; the host generator's new state goes back to it afterwards, so a
    tt generator draws the CPU generator's sequence (see `TTGeneratorImpl` in `_guard.cpp`)."""
    swapped = []
    for key, value in kwargs.items():
        if isinstance(value, torch.Generator) and value.device.type == "tt":
            host = torch.Generator()
            host.set_state(value.get_state())
            swapped.append((value, host))
            kwargs = {**kwargs, key: host}
    try:
        yield kwargs
    finally:
        for generator, host in swapped:
            generator.set_state(host.get_state())


def cpu_fallback(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs `op` on CPU copies of its tt arguments; writes mutated arguments back, and returns
    results as new tt tensors (on the device of the first tt argument, else of a factory's
    `device=`, else the current tt device)."""
    flat, _ = tree_flatten((args, kwargs))
    index = _storage.call_index(flat)
    copies: dict[int, torch.Tensor] = {}

    def to_host(a: Any) -> Any:
        if is_tt(a):
            if id(a) not in copies:
                copies[id(a)] = _storage.host_value(a)
            return copies[id(a)]
        if isinstance(a, torch.device) and a.type == "tt":
            return torch.device("cpu")
        return a

    host_args = tree_map(to_host, args)
    host_kwargs = tree_map(to_host, kwargs)
    # A scalar operand (`x % 3`) reaches a Python kernel as a number where the schema says Tensor
    # (torch unwraps its wrapped-number tensors); the CPU kernel wants the 0-d tensor back.
    schema = op._schema.arguments
    host_args = tuple(torch.tensor(a) if i < len(schema) and isinstance(a, (bool, int, float))
                      and str(schema[i].type) == "Tensor" else a for i, a in enumerate(host_args))
    with host_generators(host_kwargs) as host_kwargs:
        result = op(*host_args, **host_kwargs)
    # Arguments the op writes (in-place, out=): their new values go back to the device.
    mutated: dict[int, torch.Tensor] = {}
    for i, argument in enumerate(op._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        original: Any = args[i] if i < len(args) else kwargs.get(argument.name)
        for orig in (original if isinstance(original, (list, tuple)) else [original]):
            if isinstance(orig, torch.Tensor) and is_tt(orig):
                host = copies[id(orig)]
                if host.shape != orig.shape:  # an out= argument the op resized
                    orig.resize_(host.shape)
                _storage.write_host(orig, host)
                mutated[id(copies[id(orig)])] = orig

    def to_device(r: Any) -> Any:
        if isinstance(r, torch.Tensor):
            if id(r) in mutated:
                return mutated[id(r)]
            return from_host(r, index)
        return r

    return tree_map(to_device, result)


def on_device_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    flat, _ = tree_flatten((args, kwargs))
    return any(is_tt(a) and _storage.on_device(a.dtype) for a in flat)


def from_host(host: torch.Tensor, index: int | None) -> torch.Tensor:
    host = host.resolve_conj().resolve_neg()  # a flag view's elements, as the device holds values
    if not _storage.on_device(host.dtype):
        t = _storage.new_tensor(host.shape, host.dtype, index, None)
        if host.numel():
            _storage.write_host(t, host)
        return t
    device = session.device(index)
    cell = _storage.upload(host, device) if host.numel() else None
    return _storage.new_tensor(host.shape, host.dtype, index, cell)
