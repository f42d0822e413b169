"""A small graph over ttflow's op set, its reverse-mode derivative, and its emission as programs.

`ProgramBuilder` wants every input declared before the first op, but a backward program only
knows which forward values it needs once it has been derived. So the compiler first records
graphs here (inputs may be added at any time), derives the backward graph from the forward one,
and only then emits both as ttflow programs.

The derivative is built from ttflow ops only, so it runs on the device like the forward pass:
matmul's uses `transpose`, a broadcast's is a `sum` over the broadcast axes, ReLU's masks with
`gt`, GELU's (exact, erf form) uses Phi(x) = gelu(x) / x and phi(x) = exp(-x^2/2) / sqrt(2 pi).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

import ttflow as tt

from ._errors import UnsupportedOpError

__all__ = ["Graph", "Node", "derive", "emit"]

_UNARY = {"relu", "gelu", "exp", "sqrt", "reciprocal", "neg", "softmax"}
_BINARY = {"add", "sub", "mul", "gt"}
_TILE = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, tt.DataType.FLOAT32)


class Node:
    """One value: an input (`op == "input"`) or `op(*args[, scalar], **attrs)`."""

    __slots__ = ("id", "op", "args", "scalar", "attrs", "shape")

    def __init__(self, nid: int, op: str, args: tuple[int, ...], scalar: float | None,
                 attrs: dict[str, Any], shape: tuple[int, ...]) -> None:
        self.id, self.op, self.args, self.scalar, self.attrs, self.shape = nid, op, args, scalar, attrs, shape


class Graph:
    """Values in creation order (a topological order); inputs listed in program order."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.inputs: list[int] = []

    def shape(self, v: int) -> tuple[int, ...]:
        return self.nodes[v].shape

    def input(self, shape: Sequence[int]) -> int:
        v = self._add("input", (), None, {}, tuple(shape))
        self.inputs.append(v)
        return v

    def _add(self, op: str, args: tuple[int, ...], scalar: float | None, attrs: dict[str, Any],
             shape: tuple[int, ...]) -> int:
        self.nodes.append(Node(len(self.nodes), op, args, scalar, attrs, shape))
        return len(self.nodes) - 1

    def op(self, op: str, a: int, b: int | None = None, *, scalar: float | None = None,
           **attrs: Any) -> int:
        """Adds an op, inferring its shape (ttflow's builder re-checks everything on emission).

        A binary op takes either a second value `b` or a Python number `scalar`.
        """
        sa = self.shape(a)
        if op in _BINARY:
            if b is None:
                assert scalar is not None
                return self._add(op, (a,), float(scalar), {}, sa)
            try:
                shape = tuple(np.broadcast_shapes(sa, self.shape(b)))
            except ValueError:
                raise tt.ShapeError(f"{op}: shapes {sa} and {self.shape(b)} do not broadcast") from None
            return self._add(op, (a, b), None, {}, shape)
        if op == "matmul":
            assert b is not None
            sb = self.shape(b)
            if len(sa) < 2 or len(sb) < 2 or sa[-1] != sb[-2]:
                raise tt.ShapeError(f"matmul: cannot multiply {sa} by {sb}")
            batch = tuple(np.broadcast_shapes(sa[:-2], sb[:-2]))
            return self._add(op, (a, b), None, {}, batch + (sa[-2], sb[-1]))
        if op in _UNARY:
            if op == "softmax":
                attrs["axis"] = attrs["axis"] % len(sa)
            return self._add(op, (a,), None, attrs, sa)
        if op in ("sum", "max"):
            axis = attrs["axis"] % len(sa)
            return self._add(op, (a,), None, {"axis": axis}, sa[:axis] + (1,) + sa[axis + 1:])
        if op == "reshape":
            shape = tuple(int(d) for d in attrs["shape"])
            if math.prod(shape) != math.prod(sa):
                raise tt.ShapeError(f"reshape: cannot view {sa} as {shape}")
            return self._add(op, (a,), None, {"shape": shape}, shape)
        if op == "transpose":
            if len(sa) < 2:
                raise tt.ShapeError(f"transpose needs rank >= 2, got {sa}")
            return self._add(op, (a,), None, {}, sa[:-2] + (sa[-1], sa[-2]))
        raise UnsupportedOpError(f"ttflow has no op {op!r}")


# -- emission ----------------------------------------------------------------------------------------


def emit(graph: Graph, outputs: Sequence[int], name: str) -> tt.Program:
    """The program computing `outputs` from the graph's inputs (dead values are left out)."""
    live: set[int] = set(outputs)
    for node in reversed(graph.nodes):
        if node.id in live:
            live.update(node.args)
    b = tt.ProgramBuilder(name)
    values: dict[int, Any] = {}
    for v in graph.inputs:
        values[v] = b.input(graph.shape(v), _TILE)
    for node in graph.nodes:
        if node.op == "input" or node.id not in live:
            continue
        args = [values[a] for a in node.args]
        if node.scalar is not None:
            args.append(node.scalar)
        values[node.id] = getattr(b, node.op)(*args, **node.attrs)
    for v in outputs:
        b.output(values[v], _TILE)
    return b.build()


# -- reverse mode ------------------------------------------------------------------------------------


class _Backward:
    """Builds the backward graph; `fwd(v)` makes forward value v an input of the backward program."""

    def __init__(self, forward: Graph) -> None:
        self.f = forward
        self.g = Graph()
        self.refs: dict[int, int] = {}  # forward id -> backward input id

    def fwd(self, v: int) -> int:
        if v not in self.refs:
            self.refs[v] = self.g.input(self.f.shape(v))
        return self.refs[v]

    def op(self, op: str, a: int, b: int | None = None, **kw: Any) -> int:
        return self.g.op(op, a, b, **kw)

    def unbroadcast(self, grad: int, shape: tuple[int, ...], what: str) -> int:
        """Sums `grad` over the axes a broadcast stretched, back to `shape`."""
        gshape = self.g.shape(grad)
        if gshape == shape:
            return grad
        # Broadcasting aligns shapes on the right: leading axes the value did not have are
        # summed like size-1 axes, then dropped with a reshape.
        padded = (1,) * (len(gshape) - len(shape)) + tuple(shape)
        for axis, (n, m) in enumerate(zip(padded, gshape)):
            if n == 1 and m != 1:
                grad = self.op("sum", grad, axis=axis)
        if padded != tuple(shape):
            grad = self.op("reshape", grad, shape=tuple(shape))
        return grad

    def vjp(self, node: Node, g: int) -> list[int | None]:
        """The gradient contribution of `node`'s output gradient `g` to each of its args."""
        op, args, f, fwd, o = node.op, node.args, self.f, self.fwd, self.op
        if op in ("add", "sub"):
            if node.scalar is not None:
                return [g]
            a, b = args
            gb = g if op == "add" else o("neg", g)
            return [self.unbroadcast(g, f.shape(a), op), self.unbroadcast(gb, f.shape(b), op)]
        if op == "mul":
            if node.scalar is not None:
                return [o("mul", g, scalar=node.scalar)]
            a, b = args
            return [self.unbroadcast(o("mul", g, fwd(b)), f.shape(a), op),
                    self.unbroadcast(o("mul", g, fwd(a)), f.shape(b), op)]
        if op == "gt":
            return [None] * len(args)
        if op == "matmul":
            a, b = args
            ga = o("matmul", g, o("transpose", fwd(b)))
            gb = o("matmul", o("transpose", fwd(a)), g)
            return [self.unbroadcast(ga, f.shape(a), op), self.unbroadcast(gb, f.shape(b), op)]
        if op == "transpose":
            return [o("transpose", g)]
        if op == "neg":
            return [o("neg", g)]
        if op == "relu":
            return [o("mul", g, o("gt", fwd(args[0]), scalar=0.0))]
        if op == "exp":
            return [o("mul", g, fwd(node.id))]
        if op == "sqrt":
            return [o("mul", o("mul", g, o("reciprocal", fwd(node.id))), scalar=0.5)]
        if op == "reciprocal":
            y = fwd(node.id)
            return [o("neg", o("mul", g, o("mul", y, y)))]
        if op == "softmax":
            y = fwd(node.id)
            gy = o("mul", g, y)
            return [o("sub", gy, o("mul", y, o("sum", gy, axis=node.attrs["axis"])))]
        if op == "sum":
            # Broadcast g back over the summed axis: x * 0 + g (the builder has no constants).
            return [o("add", o("mul", fwd(args[0]), scalar=0.0), g)]
        if op == "gelu":
            return [o("mul", g, self._gelu_grad(args[0], node.id))]
        raise UnsupportedOpError(f"no derivative for ttflow op {op!r}")

    def _gelu_grad(self, xv: int, yv: int) -> int:
        """gelu'(x) = Phi(x) + x phi(x), with Phi(x) = gelu(x) / x away from 0 and 1/2 at 0."""
        x, y, o = self.fwd(xv), self.fwd(yv), self.op
        away = o("gt", o("mul", x, x), scalar=1e-20)  # 1 where |x| > 1e-10, else 0
        near = o("add", o("neg", away), scalar=1.0)  # 1 - away
        cdf = o("add", o("mul", o("mul", y, o("reciprocal", o("add", x, near))), away),
                o("mul", near, scalar=0.5))
        pdf = o("mul", o("exp", o("mul", o("mul", x, x), scalar=-0.5)), scalar=1.0 / math.sqrt(2.0 * math.pi))
        return o("add", cdf, o("mul", x, pdf))


def derive(forward: Graph, output: int, wrt: Sequence[int]) -> tuple[Graph, list[int], list[int | None]]:
    """Reverse-mode derivative of `output` with respect to the forward values `wrt`.

    Returns the backward graph (its first input is the output's gradient, the others are the
    forward values it reads, in `refs` order), `refs` (those forward ids) and, for each of
    `wrt`, the backward value holding its gradient (None where it does not affect the output).
    """
    needs: set[int] = set(wrt)
    for node in forward.nodes:
        if node.op != "gt" and any(a in needs for a in node.args):
            needs.add(node.id)
    bw = _Backward(forward)
    adjoint: dict[int, int] = {output: bw.g.input(forward.shape(output))}
    for node in reversed(forward.nodes[: output + 1]):
        g = adjoint.get(node.id)
        if g is None or node.op == "input":
            continue
        for arg, contribution in zip(node.args, bw.vjp(node, g)):
            if contribution is None or arg not in needs:
                continue
            prev = adjoint.get(arg)
            adjoint[arg] = contribution if prev is None else bw.op("add", prev, contribution)
    return bw.g, list(bw.refs), [adjoint.get(v) for v in wrt]
