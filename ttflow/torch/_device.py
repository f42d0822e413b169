"""The "tt" torch device: PrivateUse1 renamed, and the kernels behind every op on tt tensors.

tt tensors are ordinary torch tensors (no subclass), with storages from the guard's allocator
and values in `_storage`'s table, so autograd, views, `nn.Module.to`, `state_dict`, `torch.save`
and dynamo treat them as they treat CUDA tensors. Every aten op on a tt tensor reaches
`_kernel` (a fallback for the PrivateUse1 key). It runs the op on the device when it can
(`_eager`: one small cached program per op and argument shapes, scalars passed as device
values), and otherwise on the CPU, once warning which op did so.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from . import _storage
from ._backend import BackendModule, synchronize_callback
from ._errors import UnsupportedOpError
from ._fallback import cpu_fallback as _cpu_fallback
from ._fallback import host_generators as _host_generators
from ._fallback import is_tt
from ._fallback import on_device_args as _on_device_args
from ._fallback import warn_cpu as _warn_cpu
from ._guard import load_guard
from ._session import session

__all__ = ["TTTensor", "install"]

aten = torch.ops.aten


class _TTTensorType(type(torch.Tensor)):  # type: ignore[misc]
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor) and obj.device.type == "tt"


class TTTensor(torch.Tensor, metaclass=_TTTensorType):
    """`isinstance(t, TTTensor)` is true for every tensor on a tt device.

    tt tensors are plain `torch.Tensor`s (as CUDA tensors are); this class exists so that older
    code that checked for it keeps working.
    """


def _copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if dst.numel() == 0:
        return dst  # no elements to copy (the device holds none for an empty tensor)
    if not is_tt(dst):  # tt -> the CPU: wait and copy out
        dst.copy_(_storage.host_value(src))
        return dst
    if not is_tt(src):  # the CPU -> tt: queued, returns at once
        same = src.dtype is dst.dtype and src.shape == dst.shape  # `x.to("tt")`: nothing to convert
        _storage.write_host(dst, src if same else src.to(dst.dtype).expand(dst.shape))
        return dst
    if not (_storage.on_device(src.dtype) and _storage.on_device(dst.dtype)):
        # A dtype the device lacks (complex, float64) keeps its elements on the host.
        _storage.write_host(dst, _storage.host_value(src).to(dst.dtype).expand(dst.shape))
        return dst
    if src.device == dst.device and src.dtype == dst.dtype and src.shape == dst.shape:
        _storage.write(dst, _storage.read(src), _storage.device_shape(dst.shape))
        return dst
    # A cast or a broadcast between tt tensors: a device program (or the CPU, with its warning).
    return _on_device(aten.copy_.default, (dst, src), {})


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return _copy_(dst, src)


def _local_scalar_dense(t: torch.Tensor) -> Any:
    return _storage.host_value(t).item()


def _set_source_tensor(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return aten.set_.source_Storage_storage_offset(dst, src.untyped_storage(), src.storage_offset(),
                                                    src.shape, src.stride())


def _set_source_storage(dst: torch.Tensor, storage: Any) -> torch.Tensor:
    return aten.set_.source_Storage_storage_offset(dst, storage, 0, (storage.nbytes() // dst.element_size(),), (1,))


def _drawn_on_host(op: Any) -> Callable[..., Any]:
    """An in-place random fill (`normal_`, `uniform_`, ...: weight init, `torch.randn(...,
    device="tt")`) drawn on the host from torch's CPU generator, then uploaded. `torch.manual_seed`
    then gives the very values the CPU would, and the tensor's old value is never read."""

    def fill(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype)
        with _host_generators(kwargs) as host_kwargs:
            op(host, *args, **host_kwargs)
        _storage.write_host(t, host)
        return t

    return fill


_RANDOM_FILLS = (aten.normal_.default, aten.uniform_.default, aten.bernoulli_.float, aten.random_.default,
                 getattr(aten.random_, "from"), aten.random_.to, aten.exponential_.default, aten.log_normal_.default,
                 aten.geometric_.default, aten.cauchy_.default)

def _multinomial(probs: torch.Tensor, num_samples: int, replacement: bool = False, *,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """`torch.multinomial` on the device, as ATen's CPU kernel computes it when it samples
    without replacement or one sample a row: its checks, then the Gumbel trick, the argmax (or
    top-k) of probs / q for q ~ Exp(1). q is drawn on the host from the generator (as the
    random fills are), so a seed gives the CPU's very samples; the rest runs on tt. Sampling
    several with replacement draws differently on the CPU (one uniform a sample), and several
    from bfloat16 scores meets ties whose order CPU torch's top-k leaves unspecified: those run
    there, with the fallback's warning."""
    op = aten.multinomial.default
    several = num_samples > 1
    if ((several and (replacement or probs.dtype != torch.float32))  # ties in bfloat16: top-k's order
            or not probs.dtype.is_floating_point or probs.dim() not in (1, 2)):
        return _on_device(op, (probs, num_samples, replacement), {"generator": generator})
    if num_samples <= 0:
        raise RuntimeError(f"cannot sample n_sample <= 0 samples (got {num_samples})")
    if num_samples > probs.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    if not bool(((probs.max() < float("inf")) & (probs.min() >= 0)).item()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if bool((probs.sum(-1) == 0).any().item()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    scores = probs / q
    if num_samples == 1:
        return scores.argmax(-1, keepdim=True)
    return scores.topk(num_samples).indices


def _fill_(t: torch.Tensor, value: Any) -> torch.Tensor:
    if not _printing.depth and _storage.fill(t, value):
        return t
    return _on_device(aten.fill_.Scalar, (t, value), {})


def _zero_(t: torch.Tensor) -> torch.Tensor:
    return _fill_(t, 0)


_HANDLERS: dict[Any, Callable[..., Any]] = {
    **{op: _drawn_on_host(op) for op in _RANDOM_FILLS},
    aten.multinomial.default: _multinomial,
    aten.copy_.default: _copy_,
    aten.fill_.Scalar: _fill_,
    aten.zero_.default: _zero_,
    aten._copy_from.default: _copy_from,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.set_.source_Tensor: _set_source_tensor,
    aten.set_.source_Storage: _set_source_storage,
}


def _convolution(*args: Any) -> Any:
    return _kernel(None, aten.convolution.default, *args)


def _convolution_backward(grad: Any, x: Any, weight: Any, stride: Any, padding: Any, dilation: Any,
                          transposed: bool, output_padding: Any, groups: int, mask: Any) -> Any:
    # The overrideable hook drops the bias size; the bias gradient has one entry per out channel.
    bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
    return _kernel(None, aten.convolution_backward.default, grad, x, weight, bias_sizes, stride, padding,
                   dilation, transposed, output_padding, groups, mask)


class _Printing(threading.local):
    depth = 0


_printing = _Printing()


def _print_on_host(tensor_str: Callable[..., str]) -> Callable[..., str]:
    """torch's tensor printer with the ops it runs on a tt tensor (slices, comparisons, `ceil`,
    `masked_select`, in float64) run on host copies, quietly: torch copies XLA, lazy and IPU
    tensors to the CPU before printing for the same reason (no device programs for a repr)."""

    def printed(self: torch.Tensor, *, tensor_contents: Any = None) -> str:
        if self.device.type != "tt":
            return tensor_str(self, tensor_contents=tensor_contents)
        _printing.depth += 1
        try:
            return tensor_str(self, tensor_contents=tensor_contents)
        finally:
            _printing.depth -= 1

    return printed


def _kernel(keyset: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    handler = _HANDLERS.get(op)
    if handler is not None:
        return handler(*args, **kwargs)
    return _on_device(op, args, kwargs)


def _on_device(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An op as a cached device program, else on the CPU (with the one-time warning)."""
    if _printing.depth:
        return _cpu_fallback(op, args, kwargs)
    generator = kwargs.get("generator")  # ATen names it so in every random op's schema
    if generator is not None and generator.device.type == "tt":
        # Drawn on the host from the generator's state, as the random fills are: a trace would
        # run the op once more (the generator's dispatch key leads back here) and draw twice.
        _warn_cpu(op, "it draws from a tt generator, whose numbers are drawn on the host")
        return _cpu_fallback(op, args, kwargs)
    from . import _eager

    try:
        return _eager.run(op, args, kwargs)
    except UnsupportedOpError as exc:
        if _on_device_args(args, kwargs):  # a host-kept dtype (float64, ...) runs on the host by design
            _warn_cpu(op, str(exc))
    return _cpu_fallback(op, args, kwargs)


# -- registration --------------------------------------------------------------------------------


_library: torch.library.Library | None = None
_aten_library: torch.library.Library | None = None


def untraced(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """`kernel` with dynamo off while it runs. The dispatcher calls the Python kernels from inside
    compiled code too (the eager parts around a graph break), and dynamo would otherwise try to
    compile ttflow.torch's own frames (and anyio's, numpy's) as if they were the user's model."""
    return torch.compiler.disable(kernel, recursive=True)


_TENSOR_FROM_DATA = ("copy_",)
"""Ops given a per-op kernel as well as the fallback (see `install`)."""

_COMPOSITE_LOWERED = ("cummax", "cummin")
"""CompositeExplicitAutograd ops given the fallback's kernel for PrivateUse1 (see `install`)."""


def install() -> None:
    """Names PrivateUse1 "tt", loads the guard (allocator and metadata kernels), registers the
    Python fallback that runs every other op (once)."""
    global _library
    if _library is not None:
        return
    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", "tt"):
        raise RuntimeError(f"torch's PrivateUse1 backend is already named {current!r} by another package")
    guard = ctypes.CDLL(str(load_guard()))
    guard.ttflow_set_synchronize(synchronize_callback)
    # The guard refuses a tensor made on a device past `torch.tt.device_count()`: it is told the
    # count now and whenever a device opens or closes.
    set_count = guard.ttflow_set_device_count
    set_count.argtypes, set_count.restype = [ctypes.c_int], None
    session.on_device_count = set_count
    set_count(session.device_count())
    if current != "tt":
        torch.utils.rename_privateuse1_backend("tt")
        torch._register_device_module("tt", BackendModule("torch.tt"))
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    library = torch.library.Library("_", "IMPL")
    library.fallback(untraced(_kernel), "PrivateUse1", with_keyset=True)
    global _aten_library
    _aten_library = torch.library.Library("aten", "IMPL")
    from . import _foreach, _recurrent

    for op, kernel in _foreach.kernels():
        _aten_library.impl(op, untraced(kernel), "PrivateUse1")
    for name, cell in _recurrent.CELLS.items():
        _aten_library.impl(name, untraced(cell), "AutogradPrivateUse1")
    # The ops `torch.tensor(data, device="tt")` runs: it runs them for real even under a fake
    # mode (dynamo's, while it traces transformers' cache layers), through the Python
    # dispatcher, which finds only per-op kernels (it asserts on an op that reaches the
    # fallback). Each gets the fallback's own kernel, registered for that op.
    for name in _TENSOR_FROM_DATA:
        op = getattr(aten, name).default
        _aten_library.impl(name, untraced(functools.partial(_kernel, None, op)), "PrivateUse1")
    # Composite ops whose helper mutates its outputs (`_cummax_helper`, no functional form):
    # the op itself is traced and lowered, as the fallback runs any other.
    for name in _COMPOSITE_LOWERED:
        op = getattr(aten, name).default
        _aten_library.impl(name, untraced(functools.partial(_kernel, None, op)), "PrivateUse1")
    # torch's convolution reaches a backend through these two hooks, not the fallback.
    _aten_library.impl("convolution_overrideable", untraced(_convolution), "PrivateUse1")
    _aten_library.impl("convolution_backward_overrideable", untraced(_convolution_backward), "PrivateUse1")
    _library = library
    torch._tensor_str._str = _print_on_host(torch._tensor_str._str)  # type: ignore[attr-defined]
