"""Eager ops on tt tensors as small cached device programs.

An op that reaches the tt fallback is traced once per (op, input shapes and dtypes, constant
arguments) with `make_fx` on meta tensors, functionalised and decomposed as the compiler does,
lowered by `_lower` to one program, and run by posting it to the loop thread (no thread
hand-off). torch's structured ops arrive as their `out=` form (`aten.add.out` for `a + b`): the
functional form is what is traced, and the result goes into `out`.

Scalars that change from call to call (a learning rate, Adam's bias corrections) are passed as
device values, not traced into the program, so a schedule does not build a program per step:
a number in a Tensor position (`x * 0.9` reaches us as `mul.out(x, 0.9)`) becomes a 0-d input,
and the Scalar arguments of the ops optimizers use (`alpha`, `value`, `weight`) go through
`_SCALAR_FORMS`, which spell those ops with tensor arithmetic. Their device values are cached
per value, so a constant (beta, eps, lr) is written once.

The per-call path is short: what an op's schema says (`_OpInfo`) is worked out once per op,
and a call is matched to its traced program by a flat signature of its arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.fx

import ttflow as tt

from . import _storage
from ._bounded import BoundedCache
from ._errors import UnsupportedOpError

__all__ = ["run"]

aten = torch.ops.aten

_MULTIPLIERS = frozenset({"alpha", "value"})
"""Scalar arguments that only multiply (see `_times`): when one is 1, it is traced in (the
program then has no multiply) instead of passed as a device value. SGD's
`buf.mul_(momentum).add_(grad, alpha=1 - dampening)` passes alpha=1 every step."""


def _is_lifted(name: str, value: Any, lift: frozenset[str]) -> bool:
    """Whether a call's argument is passed to its program as a device value (see the module)."""
    if name not in lift or not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return not (value == 1 and name in _MULTIPLIERS)


def _times(x: torch.Tensor, factor: Any) -> torch.Tensor:
    """`x` times an optional Scalar argument: no multiply for an absent one or the schema's
    default 1 (x * 1 is x, bit for bit), so `a + b` is one op, which the device runs on its
    pages with no intermediate buffer."""
    if factor is None or (type(factor) in (int, float) and factor == 1):
        return x
    return factor * x


# The elementwise ops the optimizers use, with their Scalar arguments as tensors (0-d device
# inputs); `_foreach` builds its per-element computations from the same bodies.
ELEMENTWISE: dict[str, Callable[..., torch.Tensor]] = {
    "add": lambda a, b, alpha=None: a + _times(b, alpha),
    "sub": lambda a, b, alpha=None: a - _times(b, alpha),
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "lerp": lambda a, end, weight: a + weight * (end - a),
    "addcmul": lambda a, t1, t2, value=None: a + _times(t1 * t2, value),
    "addcdiv": lambda a, t1, t2, value=None: a + _times(t1 / t2, value),
}

# Ops whose Scalar arguments are passed as device values: (those arguments, the body).
_SCALAR_FORMS: dict[Any, tuple[tuple[str, ...], Callable[..., torch.Tensor]]] = {
    aten.add.Tensor: (("alpha",), ELEMENTWISE["add"]),
    aten.sub.Tensor: (("alpha",), ELEMENTWISE["sub"]),
    aten.add.Scalar: (("other", "alpha"), ELEMENTWISE["add"]),
    aten.sub.Scalar: (("other", "alpha"), ELEMENTWISE["sub"]),
    aten.mul.Scalar: (("other",), ELEMENTWISE["mul"]),
    aten.div.Scalar: (("other",), ELEMENTWISE["div"]),
    aten.lerp.Scalar: (("weight",), ELEMENTWISE["lerp"]),
    aten.addcmul.default: (("value",), ELEMENTWISE["addcmul"]),
    aten.addcdiv.default: (("value",), ELEMENTWISE["addcdiv"]),
}

# The dispatcher's thread-local keys in plain user code (captured at import, on the user's thread).
_USER_INCLUDE = torch._C._dispatch_tls_local_include_set()
_USER_EXCLUDE = torch._C._dispatch_tls_local_exclude_set()
_MISSING = object()


class _OpInfo:
    """What one op overload's schema says, worked out once."""

    __slots__ = ("arg_names", "args", "form", "functional", "in_place", "lift", "n_returns", "op", "op_arg_names",
                 "outs", "schema", "takes_dtype", "tensor_lift", "view", "writes")

    def __init__(self, op: Any) -> None:
        self.op = op
        schema = op._schema
        self.outs = tuple(a.name for a in schema.arguments if a.is_out)
        self.in_place = None  # the argument an in-place op (`fill_`, `add_`) writes
        if self.outs:
            self.functional = _functional_of(op)
        elif any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            self.in_place = next(a.name for a in schema.arguments
                                 if a.alias_info is not None and a.alias_info.is_write)
            self.functional = _out_of_place(op)
        else:
            self.functional = op
        if self.functional is None:
            raise UnsupportedOpError(f"{op} has no functional form to run")
        self.schema = self.functional._schema
        self.args = tuple(self.schema.arguments)
        # Names read per call, kept as strings: a schema's objects cost a microsecond a query.
        self.arg_names = tuple(a.name for a in self.args)
        self.op_arg_names = tuple(a.name for a in schema.arguments)
        self.takes_dtype = "dtype" in self.arg_names
        self.n_returns = len(self.schema.returns)
        self.view = any(r.alias_info is not None and not r.alias_info.is_write for r in self.schema.returns)
        self.writes = tuple(i for i, r in enumerate(self.schema.returns)
                            if r.alias_info is not None and r.alias_info.is_write)
        self.form = _SCALAR_FORMS.get(self.functional)
        # Numbers passed as 0-d device inputs: in Tensor positions, and the form's Scalars.
        self.tensor_lift = frozenset(a.name for a in self.args if a.type.kind() == "TensorType")
        self.lift = self.tensor_lift | frozenset(self.form[0]) if self.form else self.tensor_lift


class _Entry:
    """One traced and lowered call signature."""

    __slots__ = ("binary", "mutations", "n_outputs", "outputs", "seeds")

    def __init__(self, binary: tt.Binary, outputs: Sequence[Any], mutations: Sequence[tuple[int, int]],
                 seeds: int) -> None:
        self.binary = binary
        self.outputs = tuple(outputs)  # per result: the lowered OutputSpec
        self.mutations = tuple(mutations)  # (input position, result index) of inputs written in place
        self.n_outputs = len(binary.programs[0].outputs)
        self.seeds = seeds


_infos: dict[Any, _OpInfo | UnsupportedOpError] = {}
MAX_PROGRAMS = 1024
"""Eager programs kept (per op, shapes and constants); the oldest is traced again if needed."""
_entries: BoundedCache[Hashable, _Entry | UnsupportedOpError] = BoundedCache(MAX_PROGRAMS)
_functional: dict[Any, Any] = {}


def _functional_of(op: Any) -> Any:
    """The functional overload of an `out=` overload (`add.out` -> `add.Tensor`), else None."""
    if op in _functional:
        return _functional[op]
    found = None
    names = [(a.name, str(a.type)) for a in op._schema.arguments if not a.is_out]
    packet = op.overloadpacket
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        schema = candidate._schema
        if any(a.is_out for a in schema.arguments) or schema.is_mutable:
            continue
        arguments = [(a.name, str(a.type)) for a in schema.arguments]
        if arguments == names:
            found = candidate
            break
        # A factory's out= form (`arange.start_out`) lacks the dtype/layout/device keywords.
        if (found is None and arguments[:len(names)] == names
                and all(a.kwarg_only and a.has_default_value() for a in schema.arguments[len(names):])):
            found = candidate
    _functional[op] = found
    return found


def _out_of_place(op: Any) -> Any:
    """`fill_.Scalar` -> `fill.Scalar`: the functional twin of an in-place overload, else None."""
    name = op._schema.name.split("::")[1]
    packet = getattr(aten, name.rstrip("_"), None) if name.endswith("_") else None
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if twin is None or twin._schema.is_mutable:
        return None
    return twin


def _scalar_dtype(value: float) -> torch.dtype:
    return torch.int64 if isinstance(value, int) else torch.float32


def _info(op: Any) -> _OpInfo:
    info = _infos.get(op)
    if info is None:
        if op.namespace != "aten":
            info = UnsupportedOpError(f"{op} is not an aten op")
        else:
            try:
                info = _OpInfo(op)
            except UnsupportedOpError as exc:
                info = exc
        _infos[op] = info
    if isinstance(info, UnsupportedOpError):
        raise UnsupportedOpError(str(info))
    return info


def run(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs `op` on the device; UnsupportedOpError when it cannot (the caller falls back to the CPU)."""
    info = _info(op)
    bound: dict[str, Any] = dict(kwargs) if kwargs else {}
    for name, value in zip(info.op_arg_names, args):
        bound[name] = value
    outs = [bound.pop(name) for name in info.outs if bound.get(name) is not None]
    if info.in_place is not None:
        outs = [bound[info.in_place]]  # the functional result goes back into the written input
    if info.view:
        return _run_view(info.functional, args, kwargs)
    if outs and info.takes_dtype and "dtype" not in bound:
        bound["dtype"] = outs[0].dtype  # a factory makes what its out= tensor holds
    results = _run_bound(info, bound, outs[0].device.index if outs else None, outs)
    if not outs:
        return results
    values = results if isinstance(results, tuple) else (results,)
    for out, value in zip(outs, values):
        if value is out:  # the program's output went straight into it
            continue
        if out.shape != value.shape:
            out.resize_(value.shape)
        if out.numel() == 0:
            continue  # no elements to write
        if out.dtype != value.dtype:
            value = value.to(out.dtype)
        _storage.write(out, _storage.read(value), _storage.device_shape(out.shape))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _run_bound(info: _OpInfo, bound: dict[str, Any], out_index: int | None = None,
               into: Sequence[torch.Tensor] = ()) -> Any:
    """Runs a call on its cached program. A returned value goes straight into the tensor of
    `into` at its position (the `out=` or in-place target) when that has its shape and dtype,
    with no temporary tensor between (that cost an eager `a + b` a fifth of its time)."""
    # The call's signature, and its tensors and lifted numbers in schema order.
    form = info.form
    if form is not None and not all(v.dtype.is_floating_point for v in bound.values()
                                    if isinstance(v, torch.Tensor)):
        form = None  # integer arithmetic keeps its scalars exact, in the program
    lift = info.lift if form is not None else info.tensor_lift
    signature: list[Hashable] = [info.functional, form is not None]
    tensors: list[torch.Tensor] = []
    lifted: list[float | int] = []
    for name in info.arg_names:
        value = bound.get(name, _MISSING)
        if isinstance(value, torch.Tensor):
            signature.append((value.shape, value.dtype, value.device))
            tensors.append(value)
        elif _is_tensor_list(value):  # Tensor[] or Tensor?[] (an index's `[None, ids]`)
            signature.append(tuple(None if t is None else (t.shape, t.dtype, t.device) for t in value))
            tensors.extend(t for t in value if t is not None)
        elif _is_lifted(name, value, lift):
            signature.append("int" if isinstance(value, int) else "float")
            lifted.append(value)
        else:
            signature.append(_hashable(value))
    key = tuple(signature)
    entry = _entries.get(key)
    if entry is None:
        try:
            entry = _analyse(info, bound, tensors, lifted, form, lift, out_index is not None)
        except UnsupportedOpError as exc:
            entry = UnsupportedOpError(str(exc))  # kept without its traceback (which holds tensors)
        _entries[key] = entry
    if isinstance(entry, UnsupportedOpError):
        raise UnsupportedOpError(str(entry))
    devices = [t.device for t in tensors]
    device_index = out_index
    for d in devices:
        if d.type == "tt":
            device_index = d.index
            break
    if device_index is None:  # a factory: its `device=`, or the current tt device
        device_index = _storage.index_of(bound.get("device"))
    device = _storage.session.device(device_index)
    # One cell per tensor argument; an empty one has none (it is no program input).
    cells = [_storage.read(t if d.type == "tt" else t.to(torch.device("tt", device_index)))
             if t.numel() else None for t, d in zip(tensors, devices)]
    cells += [_storage.constant((v,), _scalar_dtype(v), device) for v in lifted]
    cells += _storage.seeds(entry.seeds, device)
    produced = _storage.post_program(device, entry.binary, 0, [c for c in cells if c is not None],
                                     entry.n_outputs)
    values: list[Any] = []
    for k, out in enumerate(entry.outputs):
        if out.kind == "program":
            target = into[k] if k < len(into) else None
            if (target is not None and target.dtype == out.dtype and tuple(target.shape) == tuple(out.shape)
                    and target.device.type == "tt"):
                _storage.write(target, produced[out.index], _storage.device_shape(target.shape))
                values.append(target)
                continue
            values.append(_storage.new_tensor(out.shape, out.dtype, device_index, produced[out.index]))
        elif out.kind == "input":  # a functional op's result is a new tensor, sharing the value
            values.append(_storage.new_tensor(out.shape, out.dtype, device_index, cells[out.index]))
        elif out.kind == "empty":  # no elements: nothing to compute or to write
            target = into[k] if k < len(into) else None
            if target is not None and tuple(target.shape) == tuple(out.shape) and target.dtype == out.dtype:
                values.append(target)
            else:
                values.append(_storage.new_tensor(out.shape, out.dtype, device_index, None))
        else:
            values.append(None)
    for position, result in entry.mutations:
        target = tensors[position]
        if entry.outputs[result].kind == "empty":
            continue
        _storage.write(target, produced[entry.outputs[result].index], _storage.device_shape(target.shape))
    n_returns = info.n_returns
    returned = values[:n_returns]
    for i in info.writes:  # an in-place op returns the tensor it wrote
        returned[i] = tensors[entry.mutations[0][0]]
    if n_returns == 1:
        return returned[0]
    return tuple(returned)


def _is_tensor_list(value: Any) -> bool:
    """A Tensor[] or Tensor?[] argument: its tensors are program inputs, never constants (a
    traced-in index would bake its values into the program, and key the cache by them)."""
    return (isinstance(value, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in value)
            and all(t is None or isinstance(t, torch.Tensor) for t in value))


def _hashable(value: Any) -> Hashable:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _analyse(info: _OpInfo, bound: dict[str, Any], tensors: Sequence[torch.Tensor],
             lifted: Sequence[float | int], form: Any, lift: frozenset[str], into_tt: bool = False) -> _Entry:
    """Checks a new call signature and traces and lowers it."""
    if not into_tt and not any(t.device.type == "tt" for t in tensors):
        raise UnsupportedOpError(f"{info.op}: no tt tensor argument")
    # Index tensors may stay on the CPU, as torch allows for any device (`x[cpu_mask] = 0`):
    # they are copied over with the call.
    indices = bound.get("indices")
    host_indices = ({id(t) for t in indices if isinstance(t, torch.Tensor)}
                    if isinstance(indices, (list, tuple)) else set())
    for t in tensors:
        if t.device.type != "tt" and t.dim() != 0 and id(t) not in host_indices:
            raise RuntimeError(f"{info.op}: expected all tensors to be on the same device, but found "
                               f"{t.device} and a tt device")
        if not _storage.on_device(t.dtype):
            raise UnsupportedOpError(f"the tt device has no {t.dtype} type")
    return _trace(info, bound, [(tuple(t.shape), t.dtype) for t in tensors],
                  [_scalar_dtype(v) for v in lifted], form, lift)


_META = torch.device("meta")


def _trace(info: _OpInfo, bound: dict[str, Any], metas: Sequence[tuple[tuple[int, ...], torch.dtype]],
           lifted_dtypes: Sequence[torch.dtype], form: Any, lift: frozenset[str]) -> _Entry:
    constants = {a.name: bound[a.name] for a in info.args if a.name in bound}
    # A factory's device (tt, or none: its out= form's) is traced as meta, as tensor arguments
    # are: the trace must not run the op for real (a random factory, `randperm`, would draw from
    # the generator once more than the CPU does); the caller places the result on its device.
    device = constants.get("device")
    if any(a.name == "device" for a in info.args) and (device is None or torch.device(device).type == "tt"):
        constants["device"] = _META
    n_tensors = len(metas)
    op = info.functional

    def fn(*inputs: torch.Tensor) -> Any:
        tensors, scalars = iter(inputs[:n_tensors]), iter(inputs[n_tensors:])
        values: dict[str, Any] = {}
        for argument in info.args:
            value = constants.get(argument.name, _MISSING)
            if isinstance(value, torch.Tensor):
                value = next(tensors)
            elif _is_tensor_list(value):
                value = [None if t is None else next(tensors) for t in value]
            elif _is_lifted(argument.name, value, lift):
                value = next(scalars)
            if value is not _MISSING:
                values[argument.name] = value
        if form is not None:
            _names, body = form
            ordered = [values[a.name] if a.name in values
                       else (a.default_value if a.has_default_value() else None) for a in info.args]
            return body(*ordered)
        positional = [values.pop(a.name) for a in info.args if not a.kwarg_only and a.name in values]
        return op(*positional, **values)

    examples = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in metas]
    examples += [torch.empty((), dtype=dtype, device="meta") for dtype in lifted_dtypes]
    mutations: list[tuple[int, int]] = []
    lowered = trace_and_lower(fn, examples, op, f"eager_{op._schema.name.split('::')[-1]}",
                              lambda gm: mutations.extend(_strip_input_copies(gm)))
    lowered.check_user_outputs(info.n_returns)
    _check_result_shapes(op, fn, examples, lowered.outputs[:info.n_returns])
    return _Entry(lowered.binary, lowered.outputs, mutations, lowered.seeds)


def _check_result_shapes(op: Any, fn: Callable[..., Any], examples: Sequence[torch.Tensor],
                         outputs: Sequence[Any]) -> None:
    """The traced program's results must have the shapes and dtypes the op itself gives (its
    meta kernel): a decomposition that differs (native_batch_norm's eval statistics, (C,)
    where the op gives empty tensors) would hand back a wrong shape silently."""
    try:
        with torch._C._ForceDispatchKeyGuard(_USER_INCLUDE, _USER_EXCLUDE):
            direct = fn(*examples)
    except Exception:  # noqa: BLE001 - an op without a meta kernel: the trace is all we have
        return
    results = direct if isinstance(direct, (tuple, list)) else (direct,)
    for k, (result, spec) in enumerate(zip(results, outputs)):
        if not isinstance(result, torch.Tensor) or spec.kind == "none":
            continue
        if tuple(result.shape) != tuple(spec.shape) or result.dtype != spec.dtype:
            raise UnsupportedOpError(
                f"{op}: its decomposition gives result {k} as {tuple(spec.shape)} {spec.dtype}, the op "
                f"{tuple(result.shape)} {result.dtype}")


def trace_and_lower(fn: Callable[..., Any], examples: Sequence[torch.Tensor], op: Any, name: str,
                    rewrite: Callable[[torch.fx.GraphModule], None] | None = None) -> Any:
    """`fn` traced on meta `examples` with the lowering's decompositions, then lowered to one
    program (the lowering's `Lowered`); UnsupportedOpError naming `op` when either step cannot."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from . import _lower

    try:
        # The op may reach us from inside a compiled function or autograd, below keys tracing
        # needs (Functionalize, ...): trace with the dispatcher state of plain user code. One
        # trace at a time: make_fx patches torch globally (nn.Module.__call__ among others),
        # and two threads tracing at once restore each other's patches, leaving them in place.
        with _lower.TRACING, torch._C._ForceDispatchKeyGuard(_USER_INCLUDE, _USER_EXCLUDE):
            gm = make_fx(fn, decomposition_table=_lower.DECOMPOSITIONS)(*examples)
    except UnsupportedOpError:
        raise
    except Exception as exc:
        raise UnsupportedOpError(f"{op}: cannot trace it for the device ({type(exc).__name__}: {exc})") from exc
    if rewrite is not None:
        rewrite(gm)
    return _lower.lower(gm, examples, name)


def _strip_input_copies(gm: torch.fx.GraphModule) -> list[tuple[int, int]]:
    """A traced graph that writes an input ends with `copy_(input, new)`: such writes become
    extra outputs, applied by the caller. Returns (input position, output index) pairs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    written = []
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.copy_.default and node.args[0] in placeholders:
            target, value = node.args
            written.append((placeholders.index(target), value))
            node.replace_all_uses_with(value)
            gm.graph.erase_node(node)
    if not written:
        return []
    results = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    mutations = [(position, len(results) + i) for i, (position, _) in enumerate(written)]
    output.args = (tuple(results + [value for _, value in written]),)
    gm.graph.lint()
    gm.recompile()
    return mutations


_FLAG_VIEWS = frozenset({aten._conj.default, aten._neg_view.default, aten.conj.default})
"""Views that mark their result (conjugated, negated) instead of moving elements."""


def _run_view(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A view op: computed on a meta tensor of the same geometry, applied as an as_strided view."""
    base = args[0]
    if op in _FLAG_VIEWS:
        # A view that only sets a flag (conj, neg): torch's own, on the host value, which keeps
        # the flag (as_strided would drop it).
        raise UnsupportedOpError(f"{op}: a view that marks its result, which the device holds as values")
    numel = base.untyped_storage().nbytes() // base.element_size()
    meta = torch.empty(numel, dtype=base.dtype, device="meta").as_strided(
        base.shape, base.stride(), base.storage_offset())
    rest = [torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a for a in args[1:]]
    result = op(meta, *rest, **kwargs)
    for r in (result,) if isinstance(result, torch.Tensor) else result:
        if r.dtype != base.dtype:  # view_as_complex, view_as_real, view(dtype): a reinterpretation
            raise UnsupportedOpError(f"{op}: a view as {r.dtype} of a {base.dtype} tensor reinterprets its "
                                     "bytes, which the device holds as values (it runs on the CPU, as a copy)")
    if isinstance(result, torch.Tensor):
        return aten.as_strided.default(base, result.shape, result.stride(), result.storage_offset())
    return type(result)(aten.as_strided.default(base, r.shape, r.stride(), r.storage_offset()) for r in result)
