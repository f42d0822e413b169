"""The "tt" torch device: PrivateUse1 renamed, and a wrapper tensor around ttflow tensor futures.

A `TTTensor` is a torch tensor with no storage of its own: it holds a `ttflow.Tensor` (a future
on the emulated device) and answers torch's ops in `__torch_dispatch__`. ttflow tensors are
immutable, so copies and detaches share one ttflow tensor, and the few in-place ops torch needs
(`copy_`, `zero_`, `add_`, an optimizer step) replace it.

Device shapes: ttflow's programs have no reshape, so a rank-1 torch tensor `(n,)` lives on the
device as `(1, n)` (and a scalar as `(1, 1)`). Then a bias broadcasts against a batch and its
gradient, a sum over the batch axis, has the parameter's own device shape.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

import ttflow as tt

from ._errors import UnsupportedOpError
from ._guard import load_guard
from ._session import MAX_DEVICES, session

__all__ = ["TTTensor", "install", "device_shape", "to_tt", "tt_value", "same_device"]

aten = torch.ops.aten
TILE = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE)
_DTYPES = {torch.float32: tt.DataType.FLOAT32, torch.int32: tt.DataType.INT32}


def device_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The ttflow shape of a torch shape: rank-0 and rank-1 tensors get a leading 1."""
    shape = tuple(int(d) for d in shape)
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return shape


def _tt_dtype(dtype: torch.dtype, what: str) -> tt.DataType:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise UnsupportedOpError(
            f"{what}: the tt device holds float32 and int32 tensors, not {dtype}; "
            "convert with .float() on the CPU first"
        ) from None


class TTTensor(torch.Tensor):
    """A torch tensor on the "tt" device whose value is a ttflow tensor (a future)."""

    _tt: tt.Tensor | None  # None: not written yet (reads as zeros)
    _dev: tt.Device

    @staticmethod
    def __new__(cls, value: tt.Tensor | None, shape: Sequence[int], dtype: torch.dtype,
                device: tt.Device, requires_grad: bool = False) -> TTTensor:
        index = session.index_of(device)
        r = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=torch.device("tt", index or 0),
            requires_grad=requires_grad,
        )
        r._tt = value
        r._dev = device
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        host = repr(self.detach().to("cpu"))
        suffix = f", device='{self.device}'"
        if self.grad_fn is not None:
            suffix += f", grad_fn=<{type(self.grad_fn).__name__}>"
        elif self.requires_grad:
            suffix += ", requires_grad=True"
        return host[:-1] + suffix + ")"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        handler = _HANDLERS.get(func)
        if handler is None:
            raise UnsupportedOpError(
                f"torch op {func} is not supported on tt tensors; move the tensor to the CPU "
                "with .to('cpu'), or run the computation as a module compiled with ttflow.torch.compile"
            )
        return handler(*args, **(kwargs or {}))


# -- helpers shared with the compiler and the optimizer -------------------------------------------


def tt_value(t: TTTensor) -> tt.Tensor:
    """The tensor's ttflow value, materialising an unwritten tensor as zeros on its device."""
    t._dev.check_open()
    if t._tt is None:
        shape = device_shape(t.shape)
        t._tt = session.call(tt.empty, shape, _tt_dtype(t.dtype, "empty"), t._dev, TILE)
    return t._tt


def to_tt(t: torch.Tensor, device: tt.Device) -> TTTensor:
    """A CPU tensor pushed to `device` (queued on its CQ1; returns at once)."""
    dtype = _tt_dtype(t.dtype, "to('tt')")
    array = t.detach().contiguous().numpy().reshape(device_shape(t.shape))
    array = array.copy()  # the copy runs later: the caller may change `t` in the meantime
    layout = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, dtype)
    value = session.call(tt.to_device, array, device, layout)
    return TTTensor(value, t.shape, t.dtype, device)


def to_cpu(t: TTTensor) -> torch.Tensor:
    """Waits for the tensor and copies it out: the one place the host blocks on the device."""
    t._dev.check_open()
    if t._tt is None:
        return torch.zeros(t.shape, dtype=t.dtype)
    array = session.call(tt.to_host, t._tt)
    return torch.from_numpy(np.ascontiguousarray(array).reshape(tuple(t.shape)))


def same_device(tensors: Sequence[torch.Tensor], what: str) -> tt.Device:
    """The one ttflow device all `tensors` live on; a clear error when they are mixed."""
    devices = {t.device for t in tensors}
    if len(devices) != 1 or not all(isinstance(t, TTTensor) for t in tensors):
        names = ", ".join(sorted(str(d) for d in devices))
        raise RuntimeError(
            f"{what}: expected all tensors on one tt device, found {names}; move them with .to()"
        )
    owners = {id(t._dev): t._dev for t in tensors}  # type: ignore[attr-defined]
    if len(owners) != 1:
        raise tt.DeviceClosedError(
            f"{what}: the tensors come from different openings of {devices.pop()}; one of them "
            "was closed with ttflow.torch.close() (move tensors to the CPU before closing)"
        )
    (device,) = owners.values()
    device.check_open()
    return device


def _torch_device_to_tt(device: torch.device) -> tt.Device:
    index = device.index
    if index is not None and not 0 <= index < MAX_DEVICES:
        raise ValueError(f"no such tt device: {device}")
    return session.device(index)


# -- the handlers ------------------------------------------------------------------------------------


def _empty(size: Sequence[int], *args: Any, dtype: torch.dtype | None = None,
           device: torch.device | None = None, **kwargs: Any) -> TTTensor:
    dtype = dtype or torch.get_default_dtype()
    _tt_dtype(dtype, "empty")
    target = _torch_device_to_tt(device if device is not None else torch.device("tt"))
    return TTTensor(None, size, dtype, target)


def _empty_strided(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype | None = None,
                   layout: Any = None, device: torch.device | None = None, pin_memory: Any = None) -> TTTensor:
    return _empty(size, dtype=dtype, device=device)


def _copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if not isinstance(dst, TTTensor):  # tt -> a CPU tensor
        with torch.no_grad():
            dst.copy_(to_cpu(src))  # type: ignore[arg-type]
        return dst
    if isinstance(src, TTTensor) and src._dev is dst._dev and src.dtype == dst.dtype:
        if tuple(src.shape) != tuple(dst.shape):
            raise UnsupportedOpError(f"copy_ between tt tensors of shapes {tuple(src.shape)} and {tuple(dst.shape)}")
        dst._tt = src._tt  # values are immutable: share
        return dst
    host = to_cpu(src) if isinstance(src, TTTensor) else src
    host = host.to(dst.dtype).expand(dst.shape)
    dst._tt = to_tt(host, dst._dev)._tt
    return dst


def _to_copy(src: TTTensor, *, dtype: torch.dtype | None = None, layout: Any = None,
             device: torch.device | None = None, pin_memory: Any = None, non_blocking: bool = False,
             memory_format: Any = None) -> torch.Tensor:
    dtype = dtype or src.dtype
    target = torch.device(device) if device is not None else src.device
    if target.type != "tt":
        return to_cpu(src).to(device=target, dtype=dtype)
    dev = _torch_device_to_tt(target)
    if dev is src._dev and dtype == src.dtype:
        return TTTensor(src._tt, src.shape, dtype, dev)
    return to_tt(to_cpu(src).to(dtype), dev)


def _share(src: TTTensor, *args: Any, **kwargs: Any) -> TTTensor:
    """detach, alias, clone: a new torch tensor over the same immutable ttflow value."""
    return TTTensor(src._tt, src.shape, src.dtype, src._dev)


def _new_empty(src: TTTensor, size: Sequence[int], *args: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> TTTensor:
    return TTTensor(None, size, dtype or src.dtype, src._dev)


def _like(src: TTTensor, *args: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> TTTensor:
    return TTTensor(None, src.shape, dtype or src.dtype, src._dev)


def _zero_(t: TTTensor) -> TTTensor:
    t._tt = None
    return t


def _set_(dst: TTTensor, src: TTTensor) -> TTTensor:
    if not isinstance(src, TTTensor):
        raise UnsupportedOpError("aten.set_: a tt tensor can only take the value of another tt tensor")
    dst._tt, dst._dev = src._tt, src._dev
    return dst


# -- eager elementwise ops: one small cached program each ------------------------------------------

_EAGER_CACHE: dict[Any, tt.Binary] = {}


def run_program(key: Any, build: Callable[[], tt.Program], device: tt.Device,
                inputs: Sequence[tt.Tensor]) -> list[tt.Tensor]:
    """Submits a program built once per `key` (shapes and constants) on the loop thread."""
    binary = _EAGER_CACHE.get(key)
    if binary is None:
        binary = _EAGER_CACHE[key] = tt.Binary([build()])
    return session.call(tt.submit, device, binary, 0, list(inputs))


def _elementwise(op: str, *operands: Any, alpha: float = 1, in_place: bool = False) -> TTTensor:
    tensors = [o for o in operands if isinstance(o, torch.Tensor)]
    for o in tensors:
        if not isinstance(o, TTTensor) and o.dim() == 0:
            raise UnsupportedOpError(f"aten.{op}: pass Python numbers, not CPU scalar tensors, to tt tensors")
    device = same_device(tensors, f"aten.{op}")
    if any(t.dtype != torch.float32 for t in tensors):
        raise UnsupportedOpError(f"aten.{op} on the tt device needs float32 tensors")
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    spec = tuple(("t", device_shape(o.shape)) if isinstance(o, torch.Tensor) else ("s", float(o)) for o in operands)
    key = (op, spec, float(alpha), tuple(shape))

    def build() -> tt.Program:
        b = tt.ProgramBuilder(f"eager_{op}")
        vals = [b.input(s, TILE) if kind == "t" else s for kind, s in spec]
        if alpha != 1:
            vals[1] = b.mul(vals[1], float(alpha)) if not isinstance(vals[1], float) else vals[1] * alpha
        first = vals[0]
        if isinstance(first, float):  # scalar - tensor: only the rsub form reaches us
            raise UnsupportedOpError(f"aten.{op} with a scalar first operand")
        result = getattr(b, op)(*vals)
        b.output(result, TILE)
        return b.build()

    (value,) = run_program(key, build, device, [tt_value(t) for t in tensors])  # type: ignore[arg-type]
    if tuple(value.shape) != device_shape(shape):
        raise UnsupportedOpError(f"aten.{op}: broadcasting {tuple(shape)} is not supported on the tt device")
    if in_place:
        target = operands[0]
        if tuple(target.shape) != tuple(shape):
            raise RuntimeError(f"aten.{op}_: the result shape {tuple(shape)} does not fit {tuple(target.shape)}")
        target._tt = value
        return target
    return TTTensor(value, shape, torch.float32, device)


def _binary(op: str, in_place: bool = False) -> Callable[..., TTTensor]:
    def handler(a: Any, b: Any, *, alpha: float = 1) -> TTTensor:
        return _elementwise(op, a, b, alpha=alpha, in_place=in_place)
    return handler


def _unary(op: str) -> Callable[..., TTTensor]:
    def handler(a: TTTensor) -> TTTensor:
        return _elementwise(op, a)
    return handler


_HANDLERS: dict[Any, Callable[..., Any]] = {
    aten.copy_.default: _copy_,
    aten._to_copy.default: _to_copy,
    aten.detach.default: _share,
    aten.alias.default: _share,
    aten.clone.default: _share,
    aten.empty_like.default: _like,
    aten.zeros_like.default: _like,
    aten.new_empty.default: _new_empty,
    aten.new_zeros.default: _new_empty,
    aten.new_empty_strided.default: _new_empty,
    aten.zero_.default: _zero_,
    aten.set_.source_Tensor: _set_,
    aten.add.Tensor: _binary("add"),
    aten.add_.Tensor: _binary("add", in_place=True),
    aten.sub.Tensor: _binary("sub"),
    aten.mul.Tensor: _binary("mul"),
    aten.relu.default: _unary("relu"),
    aten.neg.default: _unary("neg"),
    aten.exp.default: _unary("exp"),
}


# -- registration --------------------------------------------------------------------------------


class _BackendModule(types.ModuleType):
    """`torch.tt`: what torch asks a backend module for."""

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return MAX_DEVICES

    def current_device(self) -> int:
        return 0

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass


_library: torch.library.Library | None = None


def install() -> None:
    """Names PrivateUse1 "tt", loads the guard, registers the factory kernels (once)."""
    global _library
    if _library is not None:
        return
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", "tt"):
        raise RuntimeError(f"torch's PrivateUse1 backend is already named {current!r} by another package")
    load_guard()
    if current != "tt":
        torch.utils.rename_privateuse1_backend("tt")
        torch._register_device_module("tt", _BackendModule("torch.tt"))
    library = torch.library.Library("aten", "IMPL")
    library.impl("empty_strided", _empty_strided, "PrivateUse1")
    library.impl("empty.memory_format", _empty, "PrivateUse1")
    _library = library
