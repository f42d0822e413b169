"""`compile(module)`: capture with torch.fx, lower to ttflow programs, derive the backward.

Capture and the op check happen in `compile`, so an unsupported module fails there, naming the
op. Programs need concrete shapes, so they are built for the first inputs (or `example_inputs`)
and kept: a call with other shapes raises `ttflow.ShapeError`.

One binary per compiled module: program 0 is inference (the output only), program 1 the training
forward (the output and the intermediates the backward reads), program 2 the backward (the
output's gradient and those values in, a gradient per trainable parameter out). Intermediates
never leave the device; the backward runs in autograd's thread for the tt device, and its
gradients stay on the device as `TTTensor`s in each parameter's `.grad`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

import ttflow as tt

from ._device import TTTensor, device_shape, same_device, tt_value
from ._errors import UnsupportedOpError
from ._ir import Graph, derive, emit
from ._session import session

__all__ = ["CompiledModule", "compile"]

INFER, TRAIN, BACKWARD = 0, 1, 2

# -- what fx nodes lower to ------------------------------------------------------------------------

_ELEMENTWISE = {"add": "add", "sub": "sub", "mul": "mul"}
_FUNCTIONS: dict[Any, str] = {
    operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub",
    operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div",
    operator.matmul: "matmul", torch.matmul: "matmul", torch.mm: "matmul",
    torch.relu: "relu", F.relu: "relu", F.gelu: "gelu", torch.exp: "exp",
    torch.softmax: "softmax", F.softmax: "softmax", operator.neg: "neg", torch.neg: "neg",
    torch.sqrt: "sqrt", torch.sigmoid: "sigmoid", F.linear: "linear", F.layer_norm: "layer_norm",
    torch.t: "t", torch.transpose: "transpose",
}
_METHODS = {"add", "sub", "mul", "matmul", "relu", "exp", "softmax", "neg", "sqrt", "sigmoid", "t", "transpose"}
_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.ReLU, nn.GELU, nn.Softmax, nn.LayerNorm, nn.Identity, nn.Sigmoid, nn.Dropout,
)


def _describe(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    if node.op == "call_module":
        return f"module {type(gm.get_submodule(str(node.target))).__name__} ({node.target})"
    if node.op == "call_function":
        return f"function {getattr(node.target, '__module__', '')}.{getattr(node.target, '__name__', node.target)}"
    return f"method Tensor.{node.target}"


def _check_supported(gm: torch.fx.GraphModule) -> None:
    """Raises UnsupportedOpError naming the first op ttflow cannot run."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            ok = isinstance(gm.get_submodule(str(node.target)), _MODULES)
        elif node.op == "call_function":
            ok = node.target in _FUNCTIONS
        elif node.op == "call_method":
            ok = node.target in _METHODS
        else:
            ok = True
        if not ok:
            raise UnsupportedOpError(
                f"ttflow.torch.compile: {_describe(node, gm)} is not supported on the tt device "
                "(supported: Linear, ReLU, GELU, Sigmoid, Softmax, LayerNorm, Identity, Dropout in eval, "
                "+, -, *, / by a number, @, transpose of the last two dims)"
            )
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    if not isinstance(outputs[0].args[0], torch.fx.Node):
        raise UnsupportedOpError("ttflow.torch.compile: the module must return one tensor")


class _Ref(int):
    """A graph value id among fx arguments, where plain ints and floats are Python numbers."""


class _Lowering:
    """Walks the fx graph once with concrete shapes, building the forward `Graph`."""

    def __init__(self, gm: torch.fx.GraphModule, input_shapes: Sequence[tuple[int, ...]]) -> None:
        self.gm = gm
        self.g = Graph()
        self.param_names: list[str] = []
        self.param_ids: list[int] = []
        self.input_ids = [self.g.input(device_shape(s)) for s in input_shapes]
        self.shapes = {name: tuple(p.shape) for name, p in gm.named_parameters()}
        self.shapes.update({name: tuple(b.shape) for name, b in gm.named_buffers()})

    def param(self, name: str) -> int:
        if name not in self.param_names:
            self.param_names.append(name)
            self.param_ids.append(self.g.input(device_shape(self.shapes[name])))
        return self.param_ids[self.param_names.index(name)]

    def run(self) -> int:
        env: dict[torch.fx.Node, Any] = {}
        inputs = iter(self.input_ids)
        for node in self.gm.graph.nodes:
            args = torch.fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
            if node.op == "placeholder":
                value = next(inputs)
            elif node.op == "get_attr":
                value = self.param(str(node.target))
            elif node.op == "call_module":
                value = self.module(str(node.target), *args, **kwargs)
            elif node.op == "call_function":
                value = self.apply(_FUNCTIONS[node.target], *args, **kwargs)
            elif node.op == "call_method":
                value = self.apply(str(node.target), *args, **kwargs)
            else:  # output
                return int(env[node.args[0]])
            env[node] = _Ref(value)
        raise UnsupportedOpError("ttflow.torch.compile: the module has no output")  # pragma: no cover

    def module(self, target: str, x: int, *rest: Any, **kwargs: Any) -> int:
        m = self.gm.get_submodule(target)
        if isinstance(m, nn.Linear):
            bias = self.param(f"{target}.bias") if m.bias is not None else None
            return self.linear(x, self.param(f"{target}.weight"), bias)
        if isinstance(m, nn.ReLU):
            return self.g.op("relu", x)
        if isinstance(m, nn.GELU):
            return self.apply("gelu", x, approximate=m.approximate)
        if isinstance(m, nn.Sigmoid):
            return self.apply("sigmoid", x)
        if isinstance(m, nn.Softmax):
            return self.apply("softmax", x, dim=m.dim)
        if isinstance(m, nn.LayerNorm):
            w = self.param(f"{target}.weight") if m.weight is not None else None
            b = self.param(f"{target}.bias") if m.bias is not None else None
            return self.layer_norm(x, tuple(m.normalized_shape), w, b, m.eps)
        if isinstance(m, nn.Dropout) and m.training and m.p > 0:
            raise UnsupportedOpError(f"ttflow.torch.compile: Dropout ({target}) in training mode; call .eval()")
        return x  # Identity, Dropout in eval

    def linear(self, x: int, w: int, b: int | None) -> int:
        out = self.g.op("matmul", x, self.g.op("transpose", w))
        return out if b is None else self.g.op("add", out, b)

    def layer_norm(self, x: int, shape: tuple[int, ...], w: int | None, b: int | None, eps: float) -> int:
        g = self.g
        if len(shape) != 1:
            raise UnsupportedOpError("ttflow.torch.compile: LayerNorm over more than the last dim")
        inv_n = 1.0 / shape[0]
        centred = g.op("sub", x, g.op("mul", g.op("sum", x, axis=-1), scalar=inv_n))
        var = g.op("mul", g.op("sum", g.op("mul", centred, centred), axis=-1), scalar=inv_n)
        out = g.op("mul", centred, g.op("reciprocal", g.op("sqrt", g.op("add", var, scalar=eps))))
        out = out if w is None else g.op("mul", out, w)
        return out if b is None else g.op("add", out, b)

    def apply(self, op: str, x: Any, *args: Any, **kwargs: Any) -> int:
        g = self.g
        if op in _ELEMENTWISE or op == "div":
            (other,) = args[:1] or (kwargs.get("other"),)
            if kwargs.get("alpha", 1) != 1:
                raise UnsupportedOpError(f"ttflow.torch.compile: {op} with alpha")
            if not isinstance(x, _Ref):  # 2 * x, 1 - x
                x, other = other, x
                if op == "sub":
                    return g.op("add", g.op("neg", x), scalar=float(other))
                if op == "div":
                    raise UnsupportedOpError("ttflow.torch.compile: a number divided by a tensor")
            if op == "div":
                if isinstance(other, _Ref):
                    raise UnsupportedOpError("ttflow.torch.compile: division by a tensor")
                return g.op("mul", x, scalar=1.0 / float(other))
            if not isinstance(other, _Ref):
                return g.op(_ELEMENTWISE[op], x, scalar=float(other))
            return g.op(_ELEMENTWISE[op], x, other)
        if op == "matmul":
            return g.op("matmul", x, args[0])
        if op in ("relu", "exp", "neg", "sqrt"):
            return g.op(op, x)
        if op == "gelu":
            if kwargs.get("approximate", "none") != "none":
                raise UnsupportedOpError("ttflow.torch.compile: GELU(approximate='tanh'); ttflow's gelu is the erf form")
            return g.op("gelu", x)
        if op == "sigmoid":  # 1 / (1 + exp(-x))
            return g.op("reciprocal", g.op("add", g.op("exp", g.op("neg", x)), scalar=1.0))
        if op == "softmax":
            dim = args[0] if args else kwargs.get("dim")
            if dim is None:
                raise UnsupportedOpError("ttflow.torch.compile: softmax needs an explicit dim")
            return g.op("softmax", x, axis=int(dim))
        if op == "linear":
            w = args[0] if args else kwargs["weight"]
            b = args[1] if len(args) > 1 else kwargs.get("bias")
            return self.linear(x, w, b)
        if op == "layer_norm":
            shape = args[0] if args else kwargs["normalized_shape"]
            w = args[1] if len(args) > 1 else kwargs.get("weight")
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            eps = args[3] if len(args) > 3 else kwargs.get("eps", 1e-5)
            return self.layer_norm(x, tuple(shape), w, b, eps)
        if op == "t":
            return g.op("transpose", x)
        if op == "transpose":
            rank = len(g.shape(x))
            dims = sorted(int(d) % rank for d in (args or (kwargs["dim0"], kwargs["dim1"])))
            if dims != [rank - 2, rank - 1]:
                raise UnsupportedOpError("ttflow.torch.compile: transpose of dims other than the last two")
            return g.op("transpose", x)
        raise UnsupportedOpError(f"ttflow.torch.compile: {op}")


class _Plan:
    """The binary built for one set of input shapes, and how to feed its programs."""

    def __init__(self, gm: torch.fx.GraphModule, input_shapes: list[tuple[int, ...]],
                 trainable: set[str]) -> None:
        lowering = _Lowering(gm, input_shapes)
        out = lowering.run()
        forward = lowering.g
        self.input_shapes = input_shapes
        self.param_names = lowering.param_names
        self.grad_names = [n for n in self.param_names if n in trainable]
        wrt = [lowering.param_ids[self.param_names.index(n)] for n in self.grad_names]
        inference = emit(forward, [out], "forward")
        self.backward_error: UnsupportedOpError | None = None
        try:
            backward, refs, grads = derive(forward, out, wrt)
        except UnsupportedOpError as exc:  # inference still works; training raises this
            self.backward_error = exc
            self.binary = tt.Binary([inference])
            return
        # A backward read of a program input is fed the input itself; of an intermediate, a
        # value the training forward saves as an extra output.
        inputs = forward.inputs
        self.saved = [r for r in refs if r not in inputs]
        self.refs = [("input", inputs.index(r)) if r in inputs else ("saved", self.saved.index(r)) for r in refs]
        self.grad_present = [g is not None for g in grads]
        programs = [inference, emit(forward, [out, *self.saved], "forward_train")]
        real = [g for g in grads if g is not None]
        if real:
            programs.append(emit(backward, real, "backward"))
        self.binary = tt.Binary(programs)


class _DeviceFunction(torch.autograd.Function):
    """Runs the training forward on the device; its backward runs the backward program there."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, device: tt.Device, *tensors: TTTensor) -> TTTensor:  # type: ignore[override]
        inputs = [tt_value(t) for t in tensors]
        out, *saved = session.call(tt.submit, device, plan.binary, TRAIN, inputs)
        ctx.plan, ctx.device, ctx.inputs, ctx.saved = plan, device, inputs, saved
        ctx.n_inputs = len(plan.input_shapes)
        ctx.wants = [t.requires_grad for t in tensors]
        ctx.param_shapes = {n: t.shape for n, t in zip(plan.param_names, tensors[ctx.n_inputs:])}
        return TTTensor(out, out.shape, torch.float32, device)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        plan: _Plan = ctx.plan
        if not isinstance(grad, TTTensor):  # a gradient made on the CPU: push it
            grad = grad.to(f"tt:{session.index_of(ctx.device) or 0}")
        fed = [tt_value(grad)] + [ctx.inputs[i] if kind == "input" else ctx.saved[i] for kind, i in plan.refs]
        grads = iter(session.call(tt.submit, ctx.device, plan.binary, BACKWARD, fed) if len(plan.binary.programs) > 2 else [])
        by_name: dict[str, TTTensor] = {}
        for name, present in zip(plan.grad_names, plan.grad_present):
            if present:
                value = next(grads)
                by_name[name] = value
        result: list[Any] = [None, None] + [None] * ctx.n_inputs
        for name, wants in zip(plan.param_names, ctx.wants[ctx.n_inputs:]):
            value = by_name.get(name)
            result.append(_grad_tensor(value, ctx, name) if wants and value is not None else None)
        ctx.inputs = ctx.saved = None  # free the saved activations now
        return tuple(result)


def _grad_tensor(value: tt.Tensor, ctx: Any, name: str) -> TTTensor:
    """The gradient in the parameter's torch shape (its device shape is the parameter's too)."""
    return TTTensor(value, ctx.param_shapes[name], torch.float32, ctx.device)


class CompiledModule(nn.Module):
    """A module whose forward and backward run as ttflow programs where its parameters live.

    With its parameters on the CPU it simply runs the original module; after `.to("tt")` each
    call submits the forward program and returns a `TTTensor` at once.
    """

    def __init__(self, module: nn.Module, example_inputs: Sequence[torch.Tensor] | None = None) -> None:
        super().__init__()
        try:
            gm = torch.fx.symbolic_trace(module)
        except Exception as exc:
            raise UnsupportedOpError(f"ttflow.torch.compile: torch.fx could not capture the module: {exc}") from exc
        _check_supported(gm)
        self._orig_mod = module
        # Kept out of the module tree: parameters are looked up by name in _orig_mod at each call
        # (`.to()` replaces them), the graph only says which ones and what to compute.
        object.__setattr__(self, "_graph_module", gm)
        self._plan: _Plan | None = None
        if example_inputs is not None:
            self._plan = self._build([tuple(x.shape) for x in example_inputs])

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        named = dict(self._orig_mod.named_parameters())
        named.update(dict(self._orig_mod.named_buffers()))
        return named

    def _build(self, shapes: list[tuple[int, ...]]) -> _Plan:
        for shape in shapes:
            if len(shape) < 2:
                raise tt.ShapeError(f"ttflow.torch.compile: inputs need a batch dim (rank >= 2), got {shape}")
        trainable = {n for n, p in self._orig_mod.named_parameters() if p.requires_grad}
        return _Plan(self._graph_module, shapes, trainable)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        named = self._named_tensors()
        on_tt = [t for t in named.values() if t.device.type == "tt"]
        if not on_tt and not any(x.device.type == "tt" for x in xs):
            return self._orig_mod(*xs)
        shapes = [tuple(x.shape) for x in xs]
        plan = self._plan
        if plan is None:
            plan = self._plan = self._build(shapes)
        elif shapes != plan.input_shapes:
            raise tt.ShapeError(
                f"this module was compiled for input shapes {plan.input_shapes}, got {shapes}; "
                "compile another one (ttflow.torch.compile) for these shapes"
            )
        params = [named[n] for n in plan.param_names]
        device = same_device([*xs, *params], "compiled module")
        if any(x.dtype != torch.float32 for x in [*xs, *params]):
            raise UnsupportedOpError("ttflow.torch.compile: compiled modules run in float32")
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            if plan.backward_error is not None:
                raise UnsupportedOpError(
                    f"{plan.backward_error} (inference works: call the module under torch.no_grad())"
                ) from plan.backward_error
            return _DeviceFunction.apply(plan, device, *xs, *params)  # type: ignore[no-any-return]
        (value,) = session.call(tt.submit, device, plan.binary, INFER, [tt_value(x) for x in [*xs, *params]])  # type: ignore[arg-type]
        return TTTensor(value, value.shape, torch.float32, device)


def compile(module: nn.Module, example_inputs: Sequence[torch.Tensor] | None = None) -> CompiledModule:
    """Captures `module` with torch.fx and prepares its forward and backward device programs.

    Unsupported ops raise `UnsupportedOpError` here. Programs are built for `example_inputs`'
    shapes, or for the first call's; other shapes raise `ttflow.ShapeError`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"ttflow.torch.compile takes an nn.Module, got {type(module).__name__}")
    return CompiledModule(module, example_inputs)
