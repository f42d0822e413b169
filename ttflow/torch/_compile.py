"""`torch.compile(model, backend="tt")`: dynamo captures, AOTAutograd splits forward and backward
(in core ATen, after torch's decompositions), and each graph is lowered to one ttflow program.

Backward is torch's own: AOTAutograd derives it, so gradients reach every input that requires
them (parameters, inputs, the outputs of another compiled module), and chained compiled modules
train as one. A graph whose tensors are all on the CPU runs eagerly there (the backend compiles
for the tt device only).

Programs need concrete shapes. When dynamo hands over a graph with symbolic sizes (it does on
the second distinct shape, e.g. a partial last batch), the graph is compiled once per concrete
input shapes at call time, and at most `max_shapes` are kept (a warning names the shapes that
made another compile, as dynamo warns on recompiles).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from functorch.compile import make_boxed_func  # type: ignore[import-untyped]
from torch import nn

from . import _lower, _storage, _warn
from ._session import Pending, session
from ._warn import warn_user

__all__ = ["MAX_SHAPES", "backend", "compile"]

MAX_SHAPES = 8  # concrete shapes kept per graph with symbolic sizes


def _is_tt(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "tt"


LOWERED_KEPT = 64
"""Lowered graphs kept for reuse (`_lowered`), the least recently used dropped first."""

_lowered_graphs: collections.OrderedDict[Any, _lower.Lowered] = collections.OrderedDict()
_lowered_lock = threading.Lock()
lowerings = 0
"""How many graphs were lowered (not found among those kept): a test's witness."""


def _graph_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], user_outputs: int | None) -> Any:
    """What a lowering depends on: the graph's code (its ops and their literal arguments), each
    input's shape, stride, dtype and whether it requires grad, how many outputs are the user's
    (max-pool indices only a backward reads are a stand-in), and the values of the constant
    tensors it reads (`get_attr`). Two models of one architecture give the same key: the second
    reuses the first's program (weights are inputs, not part of it)."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    constants: list[Any] = []
    with unset_fake_temporarily():  # the compiler runs under AOTAutograd's fake mode
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            value = getattr(gm, node.target)  # type: ignore[arg-type]
            if isinstance(value, FakeTensor) or not isinstance(value, torch.Tensor):
                raise TypeError(f"no value to key on: {node.target}")
            host = value.detach().to("cpu", copy=True).contiguous()
            constants.append((node.target, tuple(host.shape), host.dtype, host.view(-1).view(torch.uint8).numpy().tobytes()))
    inputs = tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type, t.requires_grad)
                   if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs)
    return gm.code, inputs, user_outputs, tuple(constants)


def _lowered(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str,
             user_outputs: int | None) -> _lower.Lowered:
    """`_lower.lower`, or the program lowered before from an equal graph (`_graph_key`)."""
    global lowerings
    try:
        key = _graph_key(gm, example_inputs, user_outputs)
        hash(key)
    except (TypeError, RuntimeError):  # a constant that cannot be read: lower every time
        key = None
    with _lowered_lock:
        found = _lowered_graphs.get(key) if key is not None else None
        if found is not None:
            _lowered_graphs.move_to_end(key)
            return found
    lowered = _lower.lower(gm, example_inputs, name, user_outputs, host_ops=True)
    with _lowered_lock:
        lowerings += 1
        if key is not None:
            _lowered_graphs[key] = lowered
            while len(_lowered_graphs) > LOWERED_KEPT:
                _lowered_graphs.popitem(last=False)
    return lowered


def _program_runner(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str,
                    user_outputs: int | None = None) -> Callable[[list[Any]], list[Any]]:
    """Lowers one AOTAutograd graph; returns its boxed runner (args in a list, cleared).
    `user_outputs`: how many leading outputs reach the user (None: all of them)."""
    lowered = _lowered(gm, example_inputs, name, user_outputs)
    lowered.check_user_outputs(len(lowered.outputs) if user_outputs is None else user_outputs)
    for message in lowered.hosted:  # once per op, as the CPU fallback warns (`_warn.warned`)
        op = message.split(" ", 1)[0] + " as a host op"
        if op not in _warn.warned:
            _warn.warned.add(op)
            warn_user(message)
    n_outputs = len(lowered.binary.programs[0].outputs)
    specs = lowered.inputs
    seeds = lowered.seeds

    def run(args: list[Any]) -> list[Any]:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(tensors) != len(specs):
            raise RuntimeError(f"{name}: expected {len(specs)} tensor inputs, got {len(tensors)}")
        on_tt = [t.device.type == "tt" for t in tensors]
        index = next((t.device.index for t, tt_ in zip(tensors, on_tt) if tt_), 0)
        device = session.device(index)
        cells: list[Pending] = []
        for t, tt_, input_spec in zip(tensors, on_tt, specs):
            if input_spec.empty:  # no elements: not a program input
                continue
            if not tt_:  # a CPU scalar (a step count, a Python float): moved for this call
                t = t.to(torch.device("tt", index), input_spec.dtype)
            cells.append(_storage.read(t))
        cells += _storage.seeds(seeds, device)
        outs = _storage.post_program(device, lowered.binary, 0, cells, n_outputs)
        results: list[Any] = []
        _storage.drain_freed()
        for spec in lowered.outputs:
            if spec.kind == "program":
                assert spec.dtype is not None  # only "none" outputs have none
                results.append(_storage.new_tensor(spec.shape, spec.dtype, index, outs[spec.index], drain=False))
            elif spec.kind == "input":
                results.append(args[spec.index])
            elif spec.kind == "empty":
                assert spec.dtype is not None
                results.append(_storage.new_tensor(spec.shape, spec.dtype, index, None, drain=False))
            else:
                results.append(None)
        args.clear()
        return results

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _compiler(kind: str) -> Callable[[torch.fx.GraphModule, Sequence[Any]], Any]:
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        if not any(_is_tt(t) for t in example_inputs if isinstance(t, torch.Tensor)):
            return make_boxed_func(gm)  # a CPU graph runs on the CPU
        try:
            return _program_runner(gm, example_inputs, f"{kind}_{id(gm):x}", _user_outputs(kind))
        except NotImplementedError as exc:  # UnsupportedOpError, from the lowering
            # As a graph break would: the graph runs op by op (each on the device where it can).
            warn_user(f"ttflow.torch: the compiled {kind} graph runs eagerly, op by op: {exc}")
            return make_boxed_func(gm)

    return compile_graph


def _user_outputs(kind: str) -> int | None:
    """How many of a forward graph's outputs the user gets (AOTAutograd puts the tensors saved
    for the backward after them); every output of an inference or backward graph."""
    if kind != "forward":
        return None
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    returns = getattr(meta, "num_forward_returns", None)
    return returns if isinstance(returns, int) else None


def _aot(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    from torch._dynamo.backends.common import aot_autograd

    compiler = aot_autograd(fw_compiler=_compiler("forward"), bw_compiler=_compiler("backward"),
                            inference_compiler=_compiler("inference"),
                            decompositions=_lower.DECOMPOSITIONS)
    with _lower.TRACING:  # AOTAutograd traces too (see TRACING)
        return compiler(gm, example_inputs)


def _symbolic(example_inputs: Sequence[Any]) -> bool:
    for e in example_inputs:
        if isinstance(e, torch.SymInt):
            return True
        if isinstance(e, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in e.shape):
            return True
    return False


def _read_as_numbers(gm: torch.fx.GraphModule) -> frozenset[int]:
    """Positions of placeholders the graph only reads with `.item()`: a module's float attribute
    (BatchNorm's momentum and eps) that dynamo passes as a 0-d tensor under `dynamic=True`. A
    program cannot turn a value into a Python number, so such an input is fixed per call, as
    dynamo fixes floats by default."""
    positions = set()
    for position, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        users = list(node.users)
        if users and all(u.op == "call_method" and u.target == "item" for u in users):
            positions.add(position)
    return frozenset(positions)


class _PerShape:
    """A dynamo graph with symbolic sizes, compiled per concrete input shapes at call time."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.numbers = _read_as_numbers(gm)
        self.compiled: collections.OrderedDict[Any, Callable[..., Any]] = collections.OrderedDict()
        self._lock = threading.Lock()  # callers on several threads share the cache

    def __call__(self, *args: Any) -> Any:
        key = tuple(("number", a.item()) if i in self.numbers
                    else (tuple(a.shape), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else a
                    for i, a in enumerate(args))
        with self._lock:
            fn = self._compiled(key, args)
        return fn(*args)

    def _compiled(self, key: Any, args: Sequence[Any]) -> Callable[..., Any]:
        fn = self.compiled.get(key)
        if fn is None:
            if len(self.compiled) >= MAX_SHAPES:
                old, _ = self.compiled.popitem(last=False)
                warn_user(
                    f"ttflow.torch: a compiled graph has now been built for {MAX_SHAPES + 1} input shapes; "
                    f"the oldest ({[k[0] for k in old if isinstance(k, tuple)]}) is dropped and rebuilt "
                    "if it comes back. Pad inputs to a few shapes to avoid recompiling."
                )
            fn = self.compiled[key] = _specialized(self.gm, args, self.numbers)
        else:
            self.compiled.move_to_end(key)
        return fn


def _specialized(gm: torch.fx.GraphModule, args: Sequence[Any], numbers: frozenset[int] = frozenset()) -> Callable[..., Any]:
    """`gm` with its size arguments, and the inputs it only reads as numbers, fixed to this
    call's values, compiled for these shapes. The returned function takes the same arguments
    as `gm` (the fixed ones are ignored)."""
    import copy

    graph = copy.deepcopy(gm.graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tensor_positions = []
    for position, (node, value) in enumerate(zip(placeholders, args)):
        if position in numbers:
            for user in list(node.users):
                user.replace_all_uses_with(value.item())  # type: ignore[arg-type]
                graph.erase_node(user)
            graph.erase_node(node)
        elif isinstance(value, (int, float, bool)) and not isinstance(value, torch.Tensor):
            node.replace_all_uses_with(value)  # type: ignore[arg-type]
            graph.erase_node(node)
        else:
            tensor_positions.append(position)
    fixed = torch.fx.GraphModule(gm, graph)
    # Outside dynamo's own tracing context (compiled at call time): one of ours, so that
    # AOTAutograd records which forward outputs are the user's (`_user_outputs`).
    context = torch._guards.TracingContext.try_get() or torch._guards.TracingContext(None)
    with torch._guards.tracing(context):
        compiled = _aot(fixed, [args[i] for i in tensor_positions])

    def run(*call_args: Any) -> Any:
        return compiled(*[call_args[i] for i in tensor_positions])

    return run


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""`torch.compile(mode=...)` values the backend takes. Each compiles the same way: a graph is
already one device program, so there is no launch overhead for "reduce-overhead"'s CUDA graphs
to save and no kernel choice for "max-autotune" to tune."""


def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
            options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The dynamo backend registered as "tt"."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"torch.compile(backend='tt'): unknown mode {mode!r}; the modes are {', '.join(MODES)}")
    if options:
        raise ValueError(
            f"torch.compile(backend='tt') takes no options (got {sorted(options)}): they are "
            "inductor's; each graph is one device program, built the same way every time"
        )
    if _symbolic(example_inputs):
        return _PerShape(gm)
    return _aot(gm, example_inputs)


def compile(module: nn.Module | Callable[..., Any], **options: Any) -> Any:
    """`torch.compile(module, backend="tt", **options)`: the explicit form of the same path."""
    if not callable(module):
        raise TypeError(f"ttflow.torch.compile takes a module or a function, got {type(module).__name__}")
    return torch.compile(module, backend=backend, **options)


INDUCTOR_REFUSED = (
    "torch.compile(model) compiles with Inductor, torch's default backend, which has no code "
    'generator for tt devices: compile with torch.compile(model, backend="tt") (or '
    "ttflow.torch.compile(model)), which makes each graph one ttflow program"
)


class _NoInductor:
    """What Inductor finds as the tt device's scheduling and wrapper code generators: the first
    it makes (its wrapper, after lowering the graph; a scheduling, if a lowering asks for the
    device's features first) raises `INDUCTOR_REFUSED`. Without them Inductor died in its own
    table lookup, `KeyError: 'tt'`."""

    supports_caching = False  # asked before compiling: nothing of a refused compile is cached

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(INDUCTOR_REFUSED)

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(INDUCTOR_REFUSED)


def _refuse_inductor() -> None:
    """Registers `_NoInductor` as Inductor's backend for "tt" (its hook for out-of-tree devices,
    `register_backend_for_device`), and plain device-op overrides, which Inductor looks up
    before the wrapper."""
    from torch._inductor.codegen.common import (
        DeviceOpOverrides,
        get_scheduling_for_device,
        register_backend_for_device,
        register_device_op_overrides,
    )

    if get_scheduling_for_device("tt") is None:
        register_backend_for_device("tt", _NoInductor, _NoInductor, _NoInductor)  # type: ignore[arg-type]
        register_device_op_overrides("tt", DeviceOpOverrides())


@functools.cache
def register() -> None:
    """Registers the dynamo backend name "tt" (so `torch.compile(model, backend="tt")` works),
    and makes Inductor, torch.compile's default, refuse tt tensors naming it."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "tt" not in _BACKENDS:
        register_backend(name="tt")(backend)
    _refuse_inductor()

