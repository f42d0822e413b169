"""torch's `_foreach_*` ops (what the stock optimizers call) as ONE device program per call.

Without these kernels torch runs a foreach op on a non-CUDA device as a loop of single-tensor
ops, a program each: SGD with momentum over 4 parameters made 12 programs a step. Here a call
over N tensors is traced once per (op, shapes) into one program of N element computations, and
every Python number in it (a learning rate, Adam's per-parameter step sizes) is one element of
a single small device vector, written per call, so the program does not change as they do.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from . import _eager, _storage
from ._bounded import BoundedCache
from ._errors import UnsupportedOpError
from ._fallback import cpu_fallback, warn_cpu

__all__ = ["kernels"]

aten = torch.ops.aten

# The element computation of each foreach family, on tensors (scalars come as 0-d tensors).
_ELEMENT: dict[str, Callable[..., torch.Tensor]] = {
    **_eager.ELEMENTWISE,
    "maximum": lambda a, b: torch.maximum(a, b.to(a.dtype).expand_as(a)),
    "minimum": lambda a, b: torch.minimum(a, b.to(a.dtype).expand_as(a)),
    "sqrt": torch.sqrt, "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log,
    "reciprocal": torch.reciprocal, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "copy": lambda a, src, non_blocking=False: src.to(a.dtype).expand_as(a),
    "zero": torch.zeros_like,
}


class _Plan:
    __slots__ = ("binary", "outputs")

    def __init__(self, binary: Any, outputs: Sequence[Any]) -> None:
        self.binary = binary
        self.outputs = tuple(outputs)


_plans: BoundedCache[Hashable, _Plan | UnsupportedOpError] = BoundedCache(256)  # per signature


def _family(op: Any) -> tuple[str, bool]:
    """`_foreach_add_` -> ("add", in place)."""
    name = op._schema.name.split("::")[1][len("_foreach_"):]
    in_place = name.endswith("_")
    return name.rstrip("_"), in_place


_MISSING = object()
_signatures: dict[Any, tuple[str, bool, tuple[tuple[str, str, Any], ...]]] = {}


def _signature(op: Any) -> tuple[str, bool, tuple[tuple[str, str, Any], ...]]:
    """An op's family, whether in place, and per argument (name, type, default or _MISSING):
    read from its schema once (the schema's objects cost a step's time to query each call)."""
    signature = _signatures.get(op)
    if signature is None:
        base, in_place = _family(op)
        arguments = tuple((a.name, str(a.type), a.default_value if a.has_default_value() else _MISSING)
                          for a in op._schema.arguments)
        signature = _signatures[op] = (base, in_place, arguments)
    return signature


def _run(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    base, in_place, arguments = _signature(op)
    element = _ELEMENT[base]
    bound: dict[str, Any] = dict(kwargs)
    for (name, _, _), given in zip(arguments, args):
        bound[name] = given
    outs = bound.pop("out", None)
    # Per argument: ("list", tensors) | ("scalar", k) | ("scalars", [k...]) | ("tensor", t) | ("const", v)
    plan_args: list[tuple[str, Any]] = []
    scalars: list[float] = []
    lists: list[list[torch.Tensor]] = []
    n = None
    for name, kind, default in arguments:
        if name == "out" or name not in bound and default is _MISSING:
            continue
        value: Any = bound.get(name, None if default is _MISSING else default)
        if kind == "List[Tensor]":
            plan_args.append(("list", len(lists)))
            lists.append(list(value))
            n = len(value)
        elif kind == "number":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UnsupportedOpError(f"{op}: a {type(value).__name__} scalar")
            plan_args.append(("scalar", len(scalars)))
            scalars.append(float(value))
        elif kind == "List[number]":
            plan_args.append(("scalars", list(range(len(scalars), len(scalars) + len(value)))))
            scalars.extend(float(v) for v in value)
        elif kind == "bool":
            plan_args.append(("const", value))
        else:  # a single Tensor (`.Tensor` variants): not taken here
            raise UnsupportedOpError(f"{op}: takes a Tensor argument {name!r}")
    if not n:
        return None if in_place or outs is not None else []
    flat = [t for group in lists for t in group]
    devices = tuple(t.device for t in flat)
    metas = tuple((t.shape, t.dtype) for t in flat)
    key = (op, metas, devices, tuple((k, v) if k == "const" else (k,) for k, v in plan_args), len(scalars))
    plan = _plans.get(key)
    if plan is None:  # a new signature: checked once, then traced
        if not all(d.type == "tt" and t.dtype.is_floating_point and _storage.on_device(t.dtype)
                   for t, d in zip(flat, devices)):
            raise UnsupportedOpError(f"{op}: tensors that are not floating tt tensors")
        if len(set(devices)) != 1:
            raise RuntimeError(f"{op}: expected all tensors to be on the same device")
        try:
            plan = _trace(op, element, plan_args, [len(g) for g in lists],
                          tuple((tuple(shape), dtype) for shape, dtype in metas), len(scalars))
        except UnsupportedOpError as exc:
            plan = UnsupportedOpError(str(exc))
        _plans[key] = plan
    if isinstance(plan, UnsupportedOpError):
        raise UnsupportedOpError(str(plan))
    device_index = devices[0].index
    device = _storage.session.device(device_index)
    cells = [_storage.read(t) for t in flat]
    if scalars:
        cells.append(_storage.constant(tuple(scalars), torch.float32, device))
    produced = _storage.post_program(device, plan.binary, 0, cells, len(plan.binary.programs[0].outputs))
    results = [produced[spec.index] if spec.kind == "program" else cells[spec.index] for spec in plan.outputs]
    targets = lists[0] if in_place else outs
    if targets is not None:
        _storage.drain_freed()
        for t, cell, spec in zip(targets, results, plan.outputs):
            _storage.write(t, cell, spec.device_shape, drain=False)
        return None
    return [_storage.new_tensor(spec.shape, spec.dtype, device_index, cell)
            for spec, cell in zip(plan.outputs, results)]


def _trace(op: Any, element: Callable[..., torch.Tensor], plan_args: Sequence[tuple[str, Any]],
           sizes: Sequence[int], metas: Sequence[tuple[tuple[int, ...], torch.dtype]], n_scalars: int) -> _Plan:
    n = sizes[0]

    def fn(*inputs: torch.Tensor) -> list[torch.Tensor]:
        flat, vector = list(inputs[:len(metas)]), inputs[len(metas)] if n_scalars else None
        groups, start = [], 0
        for size in sizes:
            groups.append(flat[start:start + size])
            start += size
        out = []
        for i in range(n):
            call = []
            for kind, value in plan_args:
                if kind == "list":
                    call.append(groups[value][i])
                elif kind == "scalar":
                    call.append(vector[value])  # type: ignore[index]
                elif kind == "scalars":
                    call.append(vector[value[i]])  # type: ignore[index]
                else:
                    call.append(value)
            out.append(element(*call).to(metas[i][1]))
        return out

    examples = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in metas]
    if n_scalars:
        examples.append(torch.empty(n_scalars, dtype=torch.float32, device="meta"))
    lowered = _eager.trace_and_lower(fn, examples, op, op._schema.name.split("::")[1])
    return _Plan(lowered.binary, lowered.outputs)


def _kernel(op: Any) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        try:
            return _run(op, args, kwargs)
        except UnsupportedOpError:
            pass
        # Torch's own loop over the single-tensor op, each element through the tt fallback.
        base, in_place = _family(op)
        return _loop(op, base, in_place, args, kwargs)

    return kernel


def _loop(op: Any, base: str, in_place: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    warn_cpu(op, "these tensors or arguments have no one-program form")
    return cpu_fallback(op, args, kwargs)


def kernels() -> Iterator[tuple[Any, Callable[..., Any]]]:
    """(op, kernel) for every foreach overload this module runs, for the tt (PrivateUse1) key."""
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("aten::_foreach_")}
    for name in sorted(names):
        packet = getattr(aten, name)
        base = name[len("_foreach_"):].rstrip("_")
        if base not in _ELEMENT:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if any(str(a.type) == "Tensor" for a in op._schema.arguments):
                continue  # the `.Tensor` variants: torch's loop
            yield op, _kernel(op)
