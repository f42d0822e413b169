"""The lowering of one fx graph: the registry of op lowerings, the walk over the graph's nodes,
and the checks every lowered node passes (shape, dtype, range, empties)."""

from __future__ import annotations

import contextlib
import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import ttflow as tt

from .._errors import UnsupportedOpError
from .device_view import (
    InputSpec,
    Lowered,
    OutputSpec,
    _layout,
    _static,
    _value_dtype,
    device_dtype,
    device_shape,
)
from .host import Slot, host_function, hostable

aten = torch.ops.aten
_F32 = tt.DataType.FLOAT32
_I32 = tt.DataType.INT32


# -- the lowering ------------------------------------------------------------------------------------


@attrs.define
class _T:
    """A lowered torch value: the program value (shape `_ishape(shape)`) and torch's view of it.
    A zero-element value has no program value (`v` is None): the device holds no empty
    tensors, and an op either gives an empty result too or reads only its shape (`_EMPTY`)."""

    v: Any
    shape: tuple[int, ...]
    dtype: torch.dtype


def _ishape(shape: Sequence[int]) -> tuple[int, ...]:
    """The in-program shape of a torch shape: itself, rank 0 as (1,)."""
    dims = tuple(int(d) for d in shape)
    return dims or (1,)


def _meta_tensor(t: _T | float | bool) -> Any:
    if isinstance(t, _T):
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    return t


_LOWERINGS: dict[Any, Callable[..., Any]] = {}
_SEEDED: dict[Any, Callable[[torch.fx.Node], bool]] = {}
"""Random ops: whether a node draws random numbers (and so takes a seed input)."""


def _always(node: torch.fx.Node) -> bool:
    return True


def _register(*ops: Any, seeded: Callable[[torch.fx.Node], bool] | None = None
              ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            _LOWERINGS[op] = fn
            if seeded is not None:
                _SEEDED[op] = seeded
        return fn

    return deco


def _user_line(node: torch.fx.Node) -> str:
    """The innermost user-code frame of a node's stack trace, as ' (at file:line: code)'."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return ""
    path, line, fn, code = frames[-1]
    return f" (at {path}:{line} in {fn}: {code.strip()})"


def _location(node: torch.fx.Node) -> str:
    """A step's location: its FX node and op, and the user's source line when traced from code
    (`name = aten.op (at file:line in fn: code)`)."""
    return f"{node.name} = {_op_name(node.target)}{_user_line(node)}"


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


class _Lowering:
    """The state of one `lower` call: the builder, the value of each node, the seeds."""

    def __init__(self, name: str, host_ops: bool = False) -> None:
        self.b = tt.ProgramBuilder(name)
        # A compiled graph's op the device lacks becomes a host op (`host.py`); an eager op
        # falls back to the CPU whole instead (one op: the same cost, and its own warning).
        self.host_ops = host_ops
        self.hosted: list[str] = []  # the warning of each op run as a host op (`Lowered.hosted`)
        self.seeds: list[Any] = []
        self.next_seed = 0
        self.zeros: set[int] = set()  # ids of values known to be all zeros (full(..., 0))
        self.placeholders: set[int] = set()  # ids of values that stand in for torch's (OutputSpec)
        self.node: torch.fx.Node | None = None
        self.saved_only: set[torch.fx.Node] = set()  # graph outputs only a backward reads

    def only_saved(self, node: torch.fx.Node, index: int, readers: frozenset[Any]) -> bool:
        """Whether output `index` of `node` is read only by ops in `readers` and as a graph
        output that only the backward reads (a forward's saved tensors, after the user's
        outputs): a lowering may then give a stand-in that those readers never look at."""
        users = [u for u in node.users if u.target is operator.getitem and u.args[1] == index]
        return all(r.target in readers or (r.op == "output" and u in self.saved_only)
                   for u in users for r in u.users)

    # -- errors ----------------------------------------------------------------------------

    def unsupported(self, why: str) -> UnsupportedOpError:
        node = self.node
        assert node is not None
        return UnsupportedOpError(f"{_op_name(node.target)}: {why}{_user_line(node)}")

    # -- dtype and shape plumbing -------------------------------------------------------------

    def cast(self, t: _T | Any, dtype: torch.dtype) -> Any:
        """The value of `t` in torch dtype `dtype`'s device dtype (bool: 1 where nonzero)."""
        v = t.v if isinstance(t, _T) else t
        target = _value_dtype(dtype, t.shape if isinstance(t, _T) else v.shape)
        if dtype == torch.bool and not (isinstance(t, _T) and t.dtype == torch.bool):
            v = self.b.ne(v, 0)
        if v.dtype is not target:
            v = self.b.typecast(v, target)
        return v

    def f32(self, t: _T) -> Any:
        return self.cast(t, torch.float32)

    def bool01(self, t: _T) -> Any:
        """1/0 INT32 (nonzero is true)."""
        return self.cast(t, torch.bool)

    def fit(self, v: Any, shape: Sequence[int]) -> Any:
        """`v` reshaped to the in-program shape of torch shape `shape` (same element count)."""
        target = _ishape(shape)
        return v if v.shape == target else self.b.reshape(v, target)

    def operand(self, x: _T | float | bool, dtype: torch.dtype) -> Any:
        """A binary op's operand in `dtype`: a program value, or a Python number."""
        if isinstance(x, _T):
            return self.cast(x, dtype)
        if isinstance(x, bool):
            return int(x)
        if isinstance(x, (int, float)):
            if dtype.is_floating_point:
                return float(x)
            return int(x)
        raise self.unsupported(f"operand {x!r:.40} is neither a tensor nor a number")

    def full(self, shape: Sequence[int], value: float | bool, dtype: torch.dtype) -> Any:
        ddtype = _value_dtype(dtype, shape)
        if isinstance(value, float) and math.isnan(value):
            if not ddtype.is_float:
                raise self.unsupported(f"a NaN constant of the integer type {dtype}")
            # The builder takes no NaN scalar (it would make every element NaN by mistake).
            # float("nan") is the positive quiet NaN: -sqrt(-1) (sqrt(-1) is x86's negative one).
            return self.b.neg(self.zero_by_zero(shape, ddtype))
        number = int(value) if (isinstance(value, bool) or not ddtype.is_float) else float(value)
        v = self.b.full(_ishape(shape), number, ddtype)
        if number == 0:
            self.zeros.add(v.id)
        return v

    def zero_by_zero(self, shape: Sequence[int], ddtype: tt.DataType) -> Any:
        """0/0 as x86 computes it, the NaN torch's mean over nothing gives (sign bit set)."""
        return self.b.sqrt(self.b.full(_ishape(shape), -1.0, ddtype))

    def seed(self) -> Any:
        s = self.seeds[self.next_seed]
        self.next_seed += 1
        return s

    def rand(self, shape: Sequence[int]) -> Any:
        """Uniform [0, 1) FLOAT32 of the in-program shape, from the next seed input."""
        return self.b.rand(_ishape(shape), self.seed())

    def nchw_to_nhwc(self, v: Any) -> Any:
        return self.b.permute(v, (0, 2, 3, 1))

    def nhwc_to_nchw(self, v: Any) -> Any:
        return self.b.permute(v, (0, 3, 1, 2))


def lower(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], name: str,
          user_outputs: int | None = None, host_ops: bool = False) -> Lowered:
    """Lowers one AOTAutograd graph (forward or backward, core ATen under DECOMPOSITIONS, static
    shapes) to one ttflow program named `name`.

    `example_inputs` are the graph's inputs (real or fake tensors: only shape and dtype are
    read), one per placeholder. `user_outputs`: how many leading graph outputs the user gets (a
    forward graph's later ones are saved for the backward); None, all of them. `host_ops`: an
    op with no lowering runs as a host op inside the program (`host.py`, for compiled graphs).
    Raises `UnsupportedOpError` naming the first ATen op (and its
    user code line) that has no lowering, a ttflow `ShapeError`/`LayoutError`/`ProgramError`
    (with a note naming the node) where an op's arguments do not fit the device op."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise tt.ProgramError(f"lower takes a torch.fx.GraphModule, got {type(gm).__name__}")
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    examples = list(example_inputs)
    if len(examples) != len(placeholders):
        raise tt.ProgramError(
            f"{name}: the graph has {len(placeholders)} inputs, {len(examples)} example inputs were given"
        )
    L = _Lowering(name, host_ops)
    env: dict[torch.fx.Node, Any] = {}

    # Inputs first (the builder wants every input before the first op): placeholders, then seeds.
    specs: list[InputSpec] = []
    for index, (node, example) in enumerate(zip(placeholders, examples)):
        meta = node.meta.get("val", example)
        if not isinstance(example, torch.Tensor) or not isinstance(meta, torch.Tensor):
            raise UnsupportedOpError(
                f"{name}: input {index} ({node.name}) is {type(example).__name__}, not a tensor; "
                "tt programs take tensors with static shapes"
            )
        shape = _static(example.shape, f"input {index} ({node.name})")
        if shape != _static(meta.shape, node.name) or example.dtype != meta.dtype:
            raise tt.ProgramError(
                f"{name}: example input {index} is {shape} {example.dtype}, the graph's placeholder "
                f"{node.name} is {tuple(meta.shape)} {meta.dtype}"
            )
        # A Python float that changes between calls reaches the graph as a 0-d float64 tensor: it
        # is taken in float32, as torch computes `float32_tensor * python_float` in float32.
        dtype = torch.float32 if example.dtype == torch.float64 and not shape else example.dtype
        spec = InputSpec(shape, dtype, device_shape(shape), device_dtype(dtype))
        specs.append(spec)
        env[node] = None if spec.empty else L.b.input(spec.device_shape, spec.layout)
    output_node = next(n for n in graph.nodes if n.op == "output")
    results = output_node.args[0]
    flat = list(results) if isinstance(results, (tuple, list)) else [results]
    live = _live_nodes(graph, flat)
    if user_outputs is not None:
        user_facing = {o for o in flat[:user_outputs] if isinstance(o, torch.fx.Node)}
        L.saved_only = {o for o in flat[user_outputs:] if isinstance(o, torch.fx.Node)} - user_facing
    seeds = sum(1 for n in live if n.op == "call_function" and n.target in _SEEDED and _SEEDED[n.target](n))
    L.seeds = [L.b.input((1, 1), _layout(_I32)) for _ in range(seeds)]
    for node, spec in zip(placeholders, specs):
        env[node] = _T(None if spec.empty else L.fit(env[node], spec.shape), spec.shape, spec.dtype)

    for node in graph.nodes:
        if node.op in ("placeholder", "output") or node not in live:
            continue
        L.node = node
        with L.b.location(_location(node)):  # debug hooks and golden reports name the op by it
            env[node] = _lower_node(L, node, env)

    outputs: list[OutputSpec] = []
    emitted = 0
    for index, out in enumerate(flat):
        if out is None:
            outputs.append(OutputSpec("none", -1, (), None))
            continue
        if not isinstance(out, torch.fx.Node):
            raise UnsupportedOpError(f"{name}: output {index} is {out!r:.40}, not a tensor or None")
        if out.op == "placeholder":
            spec = specs[placeholders.index(out)]
            outputs.append(OutputSpec("input", placeholders.index(out), spec.shape, spec.dtype))
            continue
        t = env[out]
        if not isinstance(t, _T):
            raise UnsupportedOpError(f"{name}: output {index} ({out.name}) is not a tensor")
        if t.v is None:
            outputs.append(OutputSpec("empty", -1, t.shape, t.dtype))
            continue
        L.b.output(L.b.reshape(t.v, device_shape(t.shape)) if t.v.shape != device_shape(t.shape) else t.v,
                   _layout(device_dtype(t.dtype)))
        outputs.append(OutputSpec("program", emitted, t.shape, t.dtype, t.v.id in L.placeholders))
        emitted += 1
    if emitted == 0:
        # A graph whose outputs are all None or inputs: the program still needs an output
        # (a (1, 1) zero no OutputSpec refers to).
        L.b.output(L.b.full((1, 1), 0.0, _F32), _layout(_F32))
    # The decompositions leave transposes of transposes, reshapes there and back and repeated
    # comparisons: each would cost a run a kernel call and a buffer (`tt.simplify`, bit-exact).
    return Lowered(tt.Binary([tt.simplify(L.b.build())]), tuple(specs), seeds, tuple(outputs), tuple(L.hosted))


def _live_nodes(graph: torch.fx.Graph, outputs: Sequence[Any]) -> set[torch.fx.Node]:
    live: set[torch.fx.Node] = set()
    stack = [o for o in outputs if isinstance(o, torch.fx.Node)]
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        stack.extend(node.all_input_nodes)
    return live


def _lower_node(L: _Lowering, node: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
    if node.op == "get_attr":
        return _constant(L, node, getattr(node.graph.owning_module, node.target))  # type: ignore[arg-type]
    if node.op != "call_function":
        raise UnsupportedOpError(f"{node.op} {node.target} has no tt lowering{_user_line(node)}")
    if node.target is operator.getitem:
        source, index = cast(torch.fx.Node, node.args[0]), cast(int, node.args[1])
        part = env[source][index]
        if part is None:
            raise L.unsupported(f"output {index} of {source.name} was not lowered")  # pragma: no cover
        return part
    fn = _LOWERINGS.get(node.target)
    if fn is None and not L.host_ops:
        raise UnsupportedOpError(f"{_op_name(node.target)} has no tt lowering{_user_line(node)}")
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    meta = node.meta.get("val")
    if fn is None:
        return _on_host(L, node, args, kwargs, meta, "it has no tt lowering")
    if _all_empty(meta):  # a zero-element result (a slice to nothing, an op on empties): no op
        return _wrap(L, node, meta, None)
    empty = _empty_inputs(args, kwargs)
    if empty:
        rule = _EMPTY.get(node.target)
        if rule is None:
            raise L.unsupported(f"reads the zero-element tensor {empty[0].shape} and gives a "
                                "non-empty one; the device lowering has no rule for that")
        if rule != "drop":
            if not isinstance(meta, torch.Tensor):
                raise L.unsupported(f"reads the zero-element tensor {empty[0].shape} and gives {meta!r:.40}")
            shape = _static(meta.shape, node.name)
            if rule == "0/0":
                return _wrap(L, node, meta, L.zero_by_zero(shape, _value_dtype(meta.dtype, shape)))
            # The value a reduction over nothing gives: its identity.
            return _wrap(L, node, meta, L.full(shape, rule, meta.dtype))
    refused: UnsupportedOpError | None = None
    with _checked(L, node, meta):
        try:
            result = fn(L, node, *args, **kwargs)
        except UnsupportedOpError as exc:
            if not L.host_ops:
                raise
            refused = exc
        except AttributeError as exc:
            if exc.obj is not L.b:
                raise
            raise L.unsupported(f"needs ttflow's op {exc.name!r}, which this ttflow does not have") from exc
        except tt.TTFlowError as exc:
            exc.add_note(f"while lowering {node.name} = {_op_name(node.target)}{_user_line(node)}")
            raise
        else:
            return _wrap(L, node, meta, result)
    # Outside the range check: the host computes in the graph's own dtypes (int64 included).
    return _on_host(L, node, args, kwargs, meta, str(refused), refused)


def _on_host(L: _Lowering, node: torch.fx.Node, args: Any, kwargs: Any, meta: Any, reason: str,
             cause: BaseException | None = None) -> Any:
    """The node as a host op of the program (`host.py`), warning once per op; UnsupportedOpError
    naming `reason` and why it cannot be hosted either."""
    leaves, structure = tree_flatten((args, kwargs))
    tensors: list[_T] = []
    flat: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, _T):
            flat.append(Slot(len(tensors)))
            tensors.append(leaf)
        else:
            flat.append(leaf)
    metas = list(meta) if isinstance(meta, (tuple, list)) else [meta]
    why = hostable(node.target, flat)
    if why is None and not all(isinstance(m, torch.Tensor) for m in metas):
        why = "a result is not a tensor"
    if why is None and any(t.v is None for t in tensors):
        why = "it reads a zero-element tensor"
    if why is not None:
        raise UnsupportedOpError(f"{_op_name(node.target)}: {reason}; nor can it run as a host op: "
                                 f"{why}{_user_line(node)}") from cause
    outputs = []
    for m in metas:
        shape = _static(m.shape, node.name)
        if 0 in shape:
            raise UnsupportedOpError(f"{_op_name(node.target)}: {reason}; nor can it run as a host op: a "
                                     f"result has no elements{_user_line(node)}") from cause
        outputs.append((shape, _ishape(shape), _value_dtype(m.dtype, shape)))
    call = host_function(node.target, flat, lambda filled: tree_unflatten(filled, structure),
                         [(t.shape, t.dtype) for t in tensors],
                         [(shape, ishape, dtype.host_dtype) for shape, ishape, dtype in outputs],
                         isinstance(meta, (tuple, list)))
    values = L.b.host_op(call, [t.v for t in tensors], outputs=[(ishape, dtype) for _, ishape, dtype in outputs],
                         name=_op_name(node.target))
    name = _op_name(node.target)
    if not any(message.startswith(f"{name} ") for message in L.hosted):
        L.hosted.append(f"{name} ran on the CPU inside the compiled program, as a host op ({reason}): "
                        "its inputs are read back from the device and its results written back, and the "
                        f"rest of the graph stays on the device{_user_line(node)} (this warning is shown "
                        "once per op)")
    return _wrap(L, node, meta, tuple(values) if isinstance(meta, (tuple, list)) else values[0])


def _all_empty(meta: Any) -> bool:
    metas = meta if isinstance(meta, (tuple, list)) else (meta,)
    tensors = [m for m in metas if isinstance(m, torch.Tensor)]
    return bool(tensors) and len(tensors) == len(metas) and all(m.numel() == 0 for m in tensors)


def _empty_inputs(args: Any, kwargs: Any) -> list[_T]:
    found: list[_T] = []
    stack = [*args, *kwargs.values()]
    while stack:
        item = stack.pop()
        if isinstance(item, _T) and item.v is None:
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


_EMPTY: dict[Any, Any] = {
    # The op's lowering leaves zero-element inputs out (torch's cat skips them too).
    aten.cat.default: "drop",
    # A reduction over nothing gives its identity, as torch does.
    aten.sum.default: 0, aten.sum.dim_IntList: 0, aten.prod.default: 1, aten.prod.dim_int: 1,
    aten.any.default: False, aten.any.dim: False, aten.any.dims: False,
    aten.all.default: True, aten.all.dim: True, aten.all.dims: True,
    # A product over an empty inner dimension is zeros; a mean over nothing is NaN.
    aten.mm.default: 0, aten.bmm.default: 0, aten.mean.default: "0/0", aten.mean.dim: "0/0",
}
"""Ops that read a zero-element input and give a non-empty result, and how: "drop" (the
lowering skips empty inputs), "0/0" (the NaN of a division by zero) or the constant every
element of the result is."""


_INTEGER_DIVISIONS = frozenset({
    aten.div.Tensor_mode, aten.div.Scalar_mode, aten.floor_divide.default, aten.floor_divide.Scalar,
    aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, aten.fmod.Tensor,
    aten.fmod.Scalar,
})


_INDEXING = frozenset({aten.embedding.default, aten.index_select.default, aten.index.Tensor, aten.gather.default})


def _checked(L: _Lowering, node: torch.fx.Node, meta: Any) -> contextlib.AbstractContextManager[None]:
    """An int64 result lives as INT32 on the device: its integer steps are range-checked, so a
    value past int32 fails the run (a ProgramError naming the op) instead of wrapping, which
    CPU torch's int64 would not. An integer division of any width is checked too: by zero the
    device gives 0, where CPU torch raises ZeroDivisionError; and so are the indices an indexing
    op reads, which the device clamps where torch raises IndexError."""
    metas = [m for m in (meta if isinstance(meta, (tuple, list)) else (meta,)) if isinstance(m, torch.Tensor)]
    if _float_to_integer_cast(node, metas):
        return contextlib.nullcontext()  # it saturates, as silicon's typecast does (docs/torch.md)
    if any(m.dtype == torch.int64 for m in metas):
        return L.b.checking_range(
            f"{_op_name(node.target)} gives an int64 tensor, which the tt device holds as INT32"
            f"{_user_line(node)}"
        )
    if node.target in _INTEGER_DIVISIONS and any(not m.dtype.is_floating_point for m in metas):
        return L.b.checking_range(f"{_op_name(node.target)} divides integers{_user_line(node)}")
    if node.target in _INDEXING:  # torch raises IndexError; the device would clamp
        return L.b.checking_range(f"{_op_name(node.target)} indexes{_user_line(node)}")
    return contextlib.nullcontext()


_CASTS: dict[Any, int] = {aten._to_copy.default: 0, torch.ops.prims.convert_element_type.default: 0, aten.copy.default: 1}
"""Cast ops, with the position of the value they cast."""


def _float_to_integer_cast(node: torch.fx.Node, metas: Sequence[torch.Tensor]) -> bool:
    """A cast from a float to an integer type: the device's typecast truncates and saturates
    (NaN to 0). It is not range-checked: a float outside the integer range (T5's log(0) = -inf
    made a bucket index, then discarded by a `where`) is a value in torch, never an error."""
    position = _CASTS.get(node.target)
    if position is None or len(metas) != 1 or metas[0].dtype.is_floating_point or metas[0].dtype == torch.bool:
        return False
    source = node.args[position] if position < len(node.args) else None
    value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


def _wrap(L: _Lowering, node: torch.fx.Node, meta: Any, result: Any) -> Any:
    """Checks a lowering's result against the node's fake value and gives it the torch dtype's
    device dtype; tuples element by element (None where an output is not used)."""
    if isinstance(meta, (tuple, list)):
        if result is None:  # every part empty (`_all_empty`)
            return tuple(_wrap(L, node, m, None) for m in meta)
        return tuple(None if r is None else _wrap(L, node, m, r) for m, r in zip(meta, result))
    if not isinstance(meta, torch.Tensor):
        raise L.unsupported(f"gives {type(meta).__name__}, not a tensor")
    shape = _static(meta.shape, node.name)
    if 0 in shape:
        return _T(None, shape, meta.dtype)
    v = result.v if isinstance(result, _T) else result
    if v.shape != _ishape(shape):
        raise tt.ProgramError(
            f"internal error: lowering {node.name} = {_op_name(node.target)} gave shape {v.shape}, "
            f"torch's is {shape}"
        )
    # A lowering whose torch result is a bool gives 1/0 (a comparison's in its operands' dtype).
    target = _value_dtype(meta.dtype, shape)
    if v.dtype is not target:
        v = L.b.typecast(v, target)
    return _T(v, shape, meta.dtype)


def _constant(L: _Lowering, node: torch.fx.Node, value: Any) -> _T:
    """A small tensor constant held by the graph module, built from `full`s."""
    L.node = node
    if not isinstance(value, torch.Tensor):
        raise L.unsupported(f"get_attr {node.target} is not a tensor")
    if value.numel() == 0:
        return _T(None, _static(value.shape, node.name), value.dtype)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if value.numel() > 1024:
        raise L.unsupported(f"a constant tensor of {value.numel()} elements; pass it as an input")
    with unset_fake_temporarily():  # AOTAutograd may call the compiler inside its fake mode
        t = value.detach().to("cpu")
        flat = t.reshape(-1).tolist()
    if len(set(flat)) == 1:
        v = L.full(t.shape, flat[0], t.dtype)
    else:
        v = L.b.reshape(L.b.concat([L.full((1,), x, t.dtype) for x in flat], 0), _ishape(t.shape))
    return _wrap(L, node, node.meta.get("val", t), v)


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _dims(dims: Any, rank: int) -> list[int]:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({_dim(d, rank) for d in dims})


def _out(node: torch.fx.Node) -> Any:
    return node.meta["val"]


def _used(node: torch.fx.Node) -> set[int]:
    """Which elements of a multi-output node's tuple are read (by getitem)."""
    return {cast(int, u.args[1]) for u in node.users if u.target is operator.getitem}
