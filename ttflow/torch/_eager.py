"""Eager ops on tt tensors as small cached device programs.

An op that reaches the tt fallback is traced once per (op, input shapes and dtypes, constant
arguments) with `make_fx` on meta tensors, functionalised and decomposed as the compiler does,
lowered by `_lower` to one program, and run by posting it to the loop thread (no thread
hand-off). torch's structured ops arrive as their `out=` form (`aten.add.out` for `a + b`): the
functional form is what is traced, and the result goes into `out`.

Scalars that change from call to call (a learning rate, Adam's bias corrections) are passed as
device values, not traced into the program, so a schedule does not build a program per step:
a float in a Tensor position (`x * 0.9` reaches us as `mul.out(x, 0.9)`) becomes a 0-d input,
and the Scalar arguments of the ops optimizers use (`alpha`, `value`, `weight`) go through
`_SCALAR_FORMS`, which spell those ops with tensor arithmetic. Their device values are cached
per value, so a constant (beta, eps, lr) is written once.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_unflatten

import ttflow as tt

from . import _storage
from ._errors import UnsupportedOpError
from ._session import Pending

__all__ = ["run"]

aten = torch.ops.aten

# Ops whose Scalar arguments are passed as device values, written with tensor arithmetic.
_SCALAR_FORMS: dict[Any, tuple[tuple[str, ...], Callable[..., torch.Tensor]]] = {
    aten.add.Tensor: (("alpha",), lambda a, b, alpha: a + b * alpha),
    aten.sub.Tensor: (("alpha",), lambda a, b, alpha: a - b * alpha),
    aten.add.Scalar: (("other", "alpha"), lambda a, other, alpha: a + other * alpha),
    aten.sub.Scalar: (("other", "alpha"), lambda a, other, alpha: a - other * alpha),
    aten.mul.Scalar: (("other",), lambda a, other: a * other),
    aten.div.Scalar: (("other",), lambda a, other: a / other),
    aten.lerp.Scalar: (("weight",), lambda a, end, weight: a + weight * (end - a)),
    aten.addcmul.default: (("value",), lambda a, t1, t2, value: a + value * (t1 * t2)),
    aten.addcdiv.default: (("value",), lambda a, t1, t2, value: a + value * (t1 / t2)),
}


class _Plan:
    """One traced and lowered op: what to read, what the program makes, where results go."""

    __slots__ = ("binary", "mutations", "n_outputs", "outputs", "seeds")

    def __init__(self, binary: tt.Binary, outputs: Sequence[Any], mutations: Sequence[tuple[int, int]],
                 seeds: int) -> None:
        self.binary = binary
        self.outputs = tuple(outputs)  # per result: the lowered OutputSpec
        self.mutations = tuple(mutations)  # (input position, result index) of inputs written in place
        self.n_outputs = len(binary.programs[0].outputs)
        self.seeds = seeds


_plans: dict[Hashable, _Plan | UnsupportedOpError] = {}
# The dispatcher's thread-local keys in plain user code (captured at import, on the user's thread).
_USER_INCLUDE = torch._C._dispatch_tls_local_include_set()
_USER_EXCLUDE = torch._C._dispatch_tls_local_exclude_set()
_functional: dict[Any, Any] = {}
_scalars: collections.OrderedDict[Hashable, Pending] = collections.OrderedDict()
_MAX_SCALARS = 256


def _functional_of(op: Any) -> Any:
    """The functional overload of an `out=` overload (`add.out` -> `add.Tensor`), else None."""
    if op in _functional:
        return _functional[op]
    found = None
    names = [(a.name, str(a.type)) for a in op._schema.arguments if not a.is_out]
    if any(a.is_out for a in op._schema.arguments):
        packet = op.overloadpacket
        for overload in packet.overloads():
            candidate = getattr(packet, overload)
            schema = candidate._schema
            if any(a.is_out for a in schema.arguments) or schema.is_mutable:
                continue
            if [(a.name, str(a.type)) for a in schema.arguments] == names:
                found = candidate
                break
    _functional[op] = found
    return found


def _scalar_dtype(value: float | int) -> torch.dtype:
    return torch.int64 if isinstance(value, int) else torch.float32


def _scalar_cell(value: float | int, device: tt.Device) -> Pending:
    key = (id(device), type(value), value)
    cell = _scalars.get(key)
    if cell is None:
        cell = _storage.upload(torch.tensor([[value]], dtype=_scalar_dtype(value)), device)
        _scalars[key] = cell
        if len(_scalars) > _MAX_SCALARS:
            _scalars.popitem(last=False)
    else:
        _scalars.move_to_end(key)
    return cell


def run(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs `op` on the device; UnsupportedOpError when it cannot (the caller falls back to the CPU)."""
    if op.namespace != "aten":
        raise UnsupportedOpError(f"{op} is not an aten op")
    schema = op._schema
    outs: list[torch.Tensor] = []
    functional = op
    if any(a.is_out for a in schema.arguments):
        functional = _functional_of(op)
        if functional is None:
            raise UnsupportedOpError(f"{op} has no functional form to run")
        kwargs = dict(kwargs)
        for a in schema.arguments:
            if a.is_out:
                out = kwargs.pop(a.name, None)
                if out is not None:
                    outs.append(out)
    results = _run_functional(functional, args, kwargs)
    if not outs:
        return results
    flat, _spec = tree_flatten(results)
    for out, value in zip(outs, flat):
        if out.shape != value.shape:
            out.resize_(value.shape)
        if out.dtype != value.dtype:
            value = value.to(out.dtype)
        _storage.write(out, _storage.read(value), _storage.device_shape(out.shape))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _run_functional(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    schema = op._schema
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return _run_view(op, args, kwargs)
    lifted: list[float] = []
    form = _SCALAR_FORMS.get(op)
    bound = _bind(schema, args, kwargs)
    if form is not None and not all(t.dtype.is_floating_point for t in tree_flatten((args, kwargs))[0]
                                    if isinstance(t, torch.Tensor)):
        form = None  # integer arithmetic keeps its scalars exact, in the program
    if form is not None:
        names, _ = form
        for name in names:
            value = bound.get(name, _default(schema, name))
            if isinstance(value, torch.Tensor) or not isinstance(value, (int, float)) or isinstance(value, bool):
                form = None
                break
        if form is not None:
            lifted = [float(bound.get(name, _default(schema, name))) for name in form[0]]
    if form is None:  # a Python float where the schema takes a Tensor (`x * 0.9`): a 0-d input
        args, kwargs = _lift_tensor_floats(schema, args, kwargs, lifted)
    flat, spec = tree_flatten((args, kwargs))
    tensors: list[torch.Tensor] = []
    structure: list[Any] = []
    device_index: int | None = None
    for item in flat:
        if isinstance(item, torch.Tensor):
            if item.device.type == "tt":
                device_index = item.device.index
            elif item.dim() != 0:
                raise RuntimeError(f"{op}: expected all tensors to be on the same device, but found "
                                   f"{item.device} and a tt device")
            if not _storage.on_device(item.dtype):
                raise UnsupportedOpError(f"the tt device has no {item.dtype} type")
            structure.append(("t", len(tensors)))
            tensors.append(item)
        elif isinstance(item, _Lifted):
            structure.append(("s", item.index))
        else:
            structure.append(("c", item))
    if device_index is None:
        raise UnsupportedOpError(f"{op}: no tt tensor argument")
    device = _storage.session.device(device_index)
    metas = tuple((tuple(t.shape), t.dtype) for t in tensors)
    if form is not None:  # the lifted values are inputs, not part of the program
        constants = tuple((name, _hashable(v)) for name, v in sorted(bound.items())
                          if name not in form[0] and not isinstance(v, torch.Tensor))
        key: Hashable = (op, metas, "lifted", constants)
    else:
        key = (op, metas, tuple(s if s[0] != "c" else ("c", _hashable(s[1])) for s in structure),
               tuple(_scalar_dtype(v) for v in lifted))
    plan = _plans.get(key)
    if plan is None:
        try:
            plan = _trace(op, spec, structure, metas, [_scalar_dtype(v) for v in lifted], form,
                          bound if form else None)
        except UnsupportedOpError as exc:
            plan = UnsupportedOpError(str(exc))  # kept without its traceback (which holds tensors)
        _plans[key] = plan
    if isinstance(plan, UnsupportedOpError):
        raise UnsupportedOpError(str(plan))
    cells = [_storage.read(t if t.device.type == "tt" else t.to(torch.device("tt", device_index)))
             for t in tensors]
    cells += [_scalar_cell(v, device) for v in lifted]
    for seed in torch.randint(0, 2**31 - 1, (plan.seeds,), dtype=torch.int32).tolist():
        cells.append(_storage.upload(torch.tensor([[seed]], dtype=torch.int32), device))
    produced = _storage.post_program(device, plan.binary, 0, cells, plan.n_outputs)
    values: list[Any] = []
    for out in plan.outputs:
        if out.kind == "program":
            values.append(_storage.new_tensor(out.shape, out.dtype, device_index, produced[out.index]))
        elif out.kind == "input":
            values.append(tensors[out.index])
        else:
            values.append(None)
    for position, result in plan.mutations:
        target = tensors[position]
        _storage.write(target, produced[plan.outputs[result].index], _storage.device_shape(target.shape))
    n_returns = len(schema.returns)
    returned = values[:n_returns]
    # In-place ops return the tensor they wrote.
    for i, r in enumerate(schema.returns):
        if r.alias_info is not None and r.alias_info.is_write:
            returned[i] = tensors[next(p for p, _ in plan.mutations)]
    if n_returns == 1:
        return returned[0]
    return tuple(returned)


class _Lifted:
    """Marks a Python float passed as a 0-d device input (its index among the lifted scalars)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _lift_tensor_floats(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                        lifted: list[float]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def lift(argument: Any, value: Any) -> Any:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and argument.type.kind() == "TensorType":
            lifted.append(value)
            return _Lifted(len(lifted) - 1)
        return value

    new_args = tuple(lift(a, v) for a, v in zip(schema.arguments, args))
    by_name = {a.name: a for a in schema.arguments}
    new_kwargs = {k: lift(by_name[k], v) if k in by_name else v for k, v in kwargs.items()}
    return new_args, new_kwargs


def _hashable(value: Any) -> Hashable:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _bind(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(kwargs)
    for argument, value in zip(schema.arguments, args):
        bound[argument.name] = value
    return bound


def _default(schema: Any, name: str) -> Any:
    for argument in schema.arguments:
        if argument.name == name:
            return argument.default_value if argument.has_default_value() else None
    return None


def _trace(op: Any, spec: Any, structure: Sequence[Any], metas: Sequence[tuple[tuple[int, ...], torch.dtype]],
           lifted_dtypes: Sequence[torch.dtype], form: Any, bound: dict[str, Any] | None) -> _Plan:
    from torch.fx.experimental.proxy_tensor import make_fx

    from . import _lower

    n_tensors = len(metas)

    def fn(*inputs: torch.Tensor) -> Any:
        tensors, scalars = inputs[:n_tensors], inputs[n_tensors:]
        if form is not None:
            names, body = form
            assert bound is not None
            lifted = dict(zip(names, scalars))
            positional = [tensors[s[1]] if s[0] == "t" else s[1] for s in structure]
            (call_args, call_kwargs) = tree_unflatten(positional, spec)
            values = _bind(op._schema, call_args, call_kwargs)
            ordered = [lifted[a.name] if a.name in lifted else values.get(a.name, _default(op._schema, a.name))
                       for a in op._schema.arguments]
            return body(*ordered)
        items = [tensors[s[1]] if s[0] == "t" else scalars[s[1]] if s[0] == "s" else s[1] for s in structure]
        call_args, call_kwargs = tree_unflatten(items, spec)
        return op(*call_args, **call_kwargs)

    examples = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in metas]
    examples += [torch.empty((), dtype=dtype, device="meta") for dtype in lifted_dtypes]
    try:
        # The op may reach us from inside a compiled function or autograd, below keys tracing
        # needs (Functionalize, ...): trace with the dispatcher state of plain user code.
        with torch._C._ForceDispatchKeyGuard(_USER_INCLUDE, _USER_EXCLUDE):
            gm = make_fx(torch.func.functionalize(fn, remove="mutations_and_views"),
                         decomposition_table=_lower.DECOMPOSITIONS)(*examples)
    except UnsupportedOpError:
        raise
    except Exception as exc:
        raise UnsupportedOpError(f"{op}: cannot trace it for the device ({type(exc).__name__}: {exc})") from exc
    mutations = _strip_input_copies(gm)
    try:
        lowered = _lower.lower(gm, examples, f"eager_{op._schema.name.split('::')[-1]}")
    except NotImplementedError as exc:  # the lowering's UnsupportedOpError
        raise UnsupportedOpError(str(exc)) from None
    return _Plan(lowered.binary, lowered.outputs, mutations, lowered.seeds)


def _strip_input_copies(gm: torch.fx.GraphModule) -> list[tuple[int, int]]:
    """Functionalisation ends a graph that writes an input with `copy_(input, new)`: such writes
    become extra outputs, applied by the caller. Returns (input position, output index) pairs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    results = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    mutations = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.copy_.default and node.args[0] in placeholders:
            target, value = node.args
            mutations.append((placeholders.index(target), len(results)))
            results.append(value)
            node.replace_all_uses_with(value)
            gm.graph.erase_node(node)
    output.args = (tuple(results),)
    gm.graph.lint()
    gm.recompile()
    return mutations


def _run_view(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A view op: computed on a meta tensor of the same geometry, applied as an as_strided view."""
    base = args[0]
    numel = base.untyped_storage().nbytes() // base.element_size()
    meta = torch.empty(numel, dtype=base.dtype, device="meta").as_strided(
        base.shape, base.stride(), base.storage_offset())
    rest = [torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a for a in args[1:]]
    result = op(meta, *rest, **kwargs)
    if isinstance(result, torch.Tensor):
        return aten.as_strided.default(base, result.shape, result.stride(), result.storage_offset())
    return type(result)(aten.as_strided.default(base, r.shape, r.stride(), r.storage_offset()) for r in result)
