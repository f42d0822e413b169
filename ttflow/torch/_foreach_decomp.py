"""torch's functional `_foreach_*` ops as loops of their single-tensor ops, for compiled graphs.

`torch.compile` of an optimizer's `step()` (what PyTorch's "compiling the optimizer" recipe
does) hands the backend a graph of foreach ops; core ATen has no decomposition for them, so
without these the graph could not be lowered and ran op by op. Each functional overload
(`_foreach_add.List`, `.Scalar`, `.ScalarList`, `.Tensor`) becomes, per element, the
single-tensor op torch's own slow path calls (`at::native::foreach_tensor_*_slow`), so the
values are those of the stock op; AOTAutograd's functionalisation has already turned the
in-place forms into these. The whole step is then one program.

Like `_fused`, this module imports nothing else from `ttflow.torch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DECOMPOSITIONS"]

aten = torch.ops.aten


def _maximum(a: torch.Tensor, b: Any) -> torch.Tensor:
    return torch.maximum(a, b) if isinstance(b, torch.Tensor) else torch.clamp_min(a, b)


def _minimum(a: torch.Tensor, b: Any) -> torch.Tensor:
    return torch.minimum(a, b) if isinstance(b, torch.Tensor) else torch.clamp_max(a, b)


# Single-tensor forms whose arguments differ from the foreach schema's (by position or kind);
# every other family is `getattr(torch, family)` with the same arguments.
_ELEMENT: dict[str, Callable[..., torch.Tensor]] = {
    "addcmul": lambda a, t1, t2, value=1: torch.addcmul(a, t1, t2, value=value),
    "addcdiv": lambda a, t1, t2, value=1: torch.addcdiv(a, t1, t2, value=value),
    "maximum": _maximum,
    "minimum": _minimum,
    "norm": lambda a, ord=2, dtype=None: torch.linalg.vector_norm(a, ord, dtype=dtype),
    "zero": torch.zeros_like,
    "copy": lambda a, src, non_blocking=False: aten.copy.default(a, src, non_blocking),
    "clone": lambda a, memory_format=None: torch.clone(a),
}


def _decomposition(op: Any, element: Callable[..., torch.Tensor]) -> Callable[..., list[torch.Tensor]]:
    arguments = op._schema.arguments

    def decomposition(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        given: list[tuple[str | None, bool, Any]] = []  # (keyword or None, per element, value)
        n = 0
        for k, argument in enumerate(arguments):
            if k < len(args):
                value = args[k]
            elif argument.name in kwargs:
                value = kwargs[argument.name]
            elif argument.has_default_value():
                value = argument.default_value
            else:
                continue
            kind = str(argument.type)
            if kind == "List[Tensor]":
                n = len(value)
            given.append((argument.name if argument.kwarg_only else None,
                          kind in ("List[Tensor]", "List[number]"), value))
        results = []
        for i in range(n):
            call = [v[i] if each else v for name, each, v in given if name is None]
            named = {name: v[i] if each else v for name, each, v in given if name is not None}
            results.append(element(*call, **named))
        return results

    return decomposition


def _decompositions() -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = {}
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("aten::_foreach_")}
    for name in sorted(names):
        if name.endswith("_"):
            continue  # in place: functionalisation makes them the functional overloads below
        family = name[len("_foreach_"):]
        element = _ELEMENT.get(family) or getattr(torch, family, None)
        if element is None:
            continue
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if any(a.is_out for a in op._schema.arguments):
                continue
            if family in ("addcmul", "addcdiv") and overload == "Tensor":
                continue  # per-element scalars in one CPU tensor: torch reads them on the host
            table[op] = _decomposition(op, element)
    return table


DECOMPOSITIONS: dict[Any, Callable[..., Any]] = _decompositions()
"""Functional foreach overload -> its loop over the single-tensor op (see the module)."""
