"""`ttflow.jax.jit` and `ttflow.jax.compile`: JAX functions through Tenstorrent's compiler, run on ttflow.

Per new signature (the arguments' tree, shapes and dtypes, the static arguments' values; the
shardings are the function's own) the caller's JAX exports the function for the platform "tt"
(`jax.export`: StableHLO with its shardings and source locations, the caller's lowering rules),
the compiler's process (`_compiler`) compiles it against ttflow's descriptor of the device or mesh
it will run on, and `tt.Binary.from_bytes` loads the `.ttnn`; the loaded binary is kept per
signature, so its const-eval results stay cached across calls (tt-mlir keeps them in the binary).

A call copies its arguments in, submits program 0 and returns the outputs as JAX CPU arrays, after
they are on the host. Why JAX arrays and not numpy: they are immutable, so a value that went to
the device once can stay there: every argument that is a `jax.Array` and every output is kept
resident beside its device copy for as long as the JAX array lives, and passing it again (a weight,
a training loop's parameters, a KV cache) sends nothing. numpy arguments are mutable and are copied
in on every call. A donated argument (`donate_argnums`) lends its device buffer to the output the
compiler aliases to it (the binary's `tf.aliasing_output`), and is deleted, as JAX deletes it.
"""

from __future__ import annotations

import collections
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

import ttflow as tt

from .._errors import FileError, MeshError, ShapeError
from ..ttnn import system_desc
from . import _sharding
from ._compiler import CompileError, compiler_for
from ._host import cpu_device, host_jax
from ._loop import loop

__all__ = ["Compiled", "Jitted", "compile", "jit"]

Array = np.ndarray[Any, Any]
Target = tt.DeviceSpec | tt.MeshSpec | tt.Device | tt.MeshDevice


@attrs.frozen(eq=False)
class Compiled:
    """One signature's compile: the loaded `binary`, the `.ttnn` bytes and the compiler's MLIR
    files (`mlir`, by file name), and what a call needs to read its arguments and outputs."""

    binary: tt.Binary
    ttnn: bytes = attrs.field(repr=False)
    mlir: dict[str, str] = attrs.field(repr=False)
    in_avals: tuple[Any, ...] = attrs.field(repr=False)
    out_avals: tuple[Any, ...] = attrs.field(repr=False)
    out_tree: Any = attrs.field(repr=False)
    in_specs: tuple[_sharding.Spec, ...] = attrs.field(repr=False)
    out_specs: tuple[_sharding.Spec, ...] = attrs.field(repr=False)
    donated: tuple[int, ...] = ()

    def save(self, folder: str | Path) -> Path:
        """Writes `<folder>/program.ttnn` and the MLIR files under `<folder>/irs/`, as the plugin's
        `export_path` does; returns the `.ttnn`'s path."""
        folder = Path(folder)
        try:
            (folder / "irs").mkdir(parents=True, exist_ok=True)
            path = folder / "program.ttnn"
            path.write_bytes(self.ttnn)
            for name, text in self.mlir.items():
                (folder / "irs" / name).write_text(text)
        except OSError as exc:
            raise FileError.of(exc, "write the compiled program to", folder, writing=True,
                               example="export_path='out'") from exc
        return path


class _Resident:
    """Device copies of JAX arrays, by the array's identity and device: a JAX array is
    immutable, so its copy stays valid for its life; the entry goes when the array does.

    An array's death is noted by a weakref callback, which runs wherever the garbage collector
    does, even inside this class's own locked section on the same thread: it only appends the
    identity to a deque (no lock), and the next use of the registry reaps it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[int, int], Any] = {}
        self._keys: dict[int, list[tuple[int, int]]] = {}
        self._dead: collections.deque[int] = collections.deque()

    def _reap(self) -> None:
        tensors = []
        with self._lock:
            while self._dead:
                for key in self._keys.pop(self._dead.popleft(), []):
                    tensor = self._held.pop(key, None)
                    if tensor is not None:
                        tensors.append(tensor)
        for tensor in tensors:
            loop.drop(tensor)

    def get(self, array: Any, device: Any) -> Any:
        self._reap()
        with self._lock:
            return self._held.get((id(array), id(device)))

    def put(self, array: Any, device: Any, tensor: Any) -> None:
        self._reap()
        key = (id(array), id(device))
        with self._lock:
            if id(array) not in self._keys:
                self._keys[id(array)] = []
                weakref.finalize(array, self._dead.append, id(array))
            self._keys[id(array)].append(key)
            self._held[key] = tensor

    def take(self, array: Any) -> list[Any]:
        """Every copy of `array`, removed (a donated array's buffers went to the outputs)."""
        self._reap()
        with self._lock:
            keys = self._keys.pop(id(array), [])
            return [self._held.pop(k) for k in keys if k in self._held]

    def __len__(self) -> int:
        self._reap()
        return len(self._held)


resident = _Resident()


def _spec_tuple(spec: Any) -> tuple[Any, ...] | None:
    return None if spec is None else tuple(spec)


class Jitted:
    """What `ttflow.jax.jit` returns: call it (blocking, JAX CPU arrays out), `await
    run_async(...)` it on an open ttflow device (ttflow tensors out), or `lower(...)` it (the
    `Compiled` of a signature)."""

    def __init__(self, fun: Callable[..., Any], *, device: Target | None, mesh: tt.MeshSpec | tt.MeshDevice | None,
                 axis_names: Sequence[str] | None, in_shardings: Any, out_shardings: Any,
                 donate_argnums: int | Sequence[int], static_argnums: int | Sequence[int],
                 compiler_options: dict[str, Any]) -> None:
        if not callable(fun):
            raise TypeError(f"ttflow.jax.jit takes a function, got {type(fun).__name__}")
        if device is not None and mesh is not None:
            raise MeshError("give ttflow.jax.jit a device or a mesh, not both")
        self.fun = fun
        self.target: Target = mesh if mesh is not None else device if device is not None else tt.DeviceSpec.wormhole_n150()
        if not isinstance(self.target, (tt.DeviceSpec, tt.MeshSpec, tt.Device, tt.MeshDevice)):
            raise TypeError(f"device= and mesh= take a tt.DeviceSpec, tt.MeshSpec or an open ttflow device, "
                            f"got {type(self.target).__name__}")
        self.mesh_shape: tuple[int, ...] = tuple(getattr(self.target, "shape", (1, 1)))
        self.axis_names = tuple(axis_names) if axis_names is not None else ("x", "y")[: len(self.mesh_shape)]
        if len(self.axis_names) != len(self.mesh_shape):
            raise MeshError(f"axis_names {self.axis_names} name {len(self.axis_names)} axes; the mesh "
                            f"{self.mesh_shape} has {len(self.mesh_shape)}")
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.donate_argnums = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self.static_argnums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self.options = dict(compiler_options)
        self.export_path = self.options.pop("export_path", None)
        self._cache: dict[Any, Compiled] = {}
        self._lock = threading.Lock()
        self.compiles = 0

    # -- signatures -----------------------------------------------------------------------------

    @property
    def is_mesh(self) -> bool:
        return math.prod(self.mesh_shape) > 1

    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any, tuple[Any, ...], list[int]]:
        """(leaves, their tree, the static arguments, each leaf's positional argument or -1)."""
        jax = host_jax()
        for i in self.static_argnums:
            if not -len(args) <= i < len(args):
                raise TypeError(f"static_argnums names argument {i}; the call gave {len(args)} positional arguments")
        static = {i % len(args) for i in self.static_argnums} if args else set()
        statics = tuple((i, args[i]) for i in sorted(static))
        leaves: list[Any] = []
        owners: list[int] = []
        dynamic = [a for i, a in enumerate(args) if i not in static]
        for position, arg in enumerate(dynamic):
            arg_leaves = jax.tree_util.tree_leaves(arg)
            leaves.extend(arg_leaves)
            owners.extend([position] * len(arg_leaves))
        kw_leaves = jax.tree_util.tree_leaves(kwargs)
        leaves.extend(kw_leaves)
        owners.extend([-1] * len(kw_leaves))
        tree = jax.tree_util.tree_structure((tuple(dynamic), kwargs))
        return leaves, tree, statics, owners

    @staticmethod
    def _aval(leaf: Any) -> tuple[tuple[int, ...], Any, bool]:
        jax = host_jax()
        weak = isinstance(leaf, (int, float, complex)) and not isinstance(leaf, bool)
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return tuple(leaf.shape), leaf.dtype, bool(leaf.weak_type)
        if isinstance(leaf, jax.Array):
            return tuple(leaf.shape), leaf.dtype, bool(getattr(leaf, "weak_type", False))
        array = np.asarray(leaf)
        return tuple(array.shape), jax.dtypes.canonicalize_dtype(array.dtype), weak

    def _leaf_specs(self, owners: list[int], count: int, ranks: list[int]) -> list[tuple[Any, ...] | None]:
        """Each leaf's PartitionSpec entries (None: replicated) from `in_shardings`, a
        PartitionSpec for every argument or one per positional argument."""
        given = self.in_shardings
        if given is None or not self.is_mesh:
            return [None] * count
        per_arg = isinstance(given, (list, tuple)) and not _is_partition_spec(given)
        out = []
        for owner in owners:
            if not per_arg:
                out.append(_spec_tuple(given))
            elif owner < 0:
                out.append(None)
            elif owner >= len(given):
                raise MeshError(f"in_shardings gives {len(given)} shardings; the call has more positional arguments")
            else:
                out.append(_spec_tuple(given[owner]))
        return out

    # -- compiling ------------------------------------------------------------------------------

    def lower(self, *args: Any, **kwargs: Any) -> Compiled:
        """The `Compiled` of this call's signature, compiled now if it is new."""
        return self._compiled_for(args, kwargs)[0]

    def _compiled_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Compiled, list[Any]]:
        leaves, tree, statics, owners = self._split(args, kwargs)
        avals = tuple(self._aval(leaf) for leaf in leaves)
        try:
            key = (tree, avals, statics)
            compiled = self._cache.get(key)
        except TypeError as exc:
            raise TypeError(f"a static argument must be hashable: {exc}") from None
        if compiled is None:
            with self._lock:
                compiled = self._cache.get(key)
                if compiled is None:
                    compiled = self._cache[key] = self._compile(args, kwargs, leaves, owners, avals, statics)
        return compiled, leaves

    def _descriptor(self) -> tuple[bytes, str]:
        return system_desc(self.target).to_bytes(), _label(self.target)

    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any], owners: list[int],
                 avals: tuple[tuple[tuple[int, ...], Any, bool], ...], statics: tuple[Any, ...]) -> Compiled:
        jax = host_jax()
        from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

        specs = self._leaf_specs(owners, len(leaves), [len(a[0]) for a in avals])
        # checked before JAX sees them, so a wrong axis is ttflow's MeshError, not JAX's
        in_specs = tuple(_sharding.normalize(s, len(a[0]), self.axis_names, f"argument {j}")
                         for j, (a, s) in enumerate(zip(avals, specs, strict=True)))
        for j, (a, s) in enumerate(zip(avals, in_specs, strict=True)):
            _sharding.piece_shape(a[0], s, self.mesh_shape, self.axis_names, f"argument {j}")
        abstract = AbstractMesh(self.mesh_shape, self.axis_names) if self.is_mesh else None

        def struct(aval: tuple[Any, ...], spec: tuple[Any, ...] | None) -> Any:
            sharding = None if abstract is None else NamedSharding(abstract, PartitionSpec(*(spec or ())))
            return jax.ShapeDtypeStruct(aval[0], aval[1], weak_type=aval[2], sharding=sharding)

        structs = [struct(a, s) for a, s in zip(avals, specs, strict=True)]
        static_positions = {i for i, _ in statics}
        it = iter(structs)
        call_args = []
        for i, arg in enumerate(args):
            if i in static_positions:
                call_args.append(arg)
            else:
                call_args.append(jax.tree_util.tree_map(lambda _: next(it), arg))
        call_kwargs = jax.tree_util.tree_map(lambda _: next(it), kwargs)
        out_shardings = None
        if abstract is not None:
            outs = self.out_shardings
            out_shardings = (NamedSharding(abstract, PartitionSpec()) if outs is None
                             else jax.tree_util.tree_map(lambda s: NamedSharding(abstract, s), outs,
                                                         is_leaf=_is_partition_spec))
        jitted = jax.jit(self.fun, static_argnums=self.static_argnums, out_shardings=out_shardings)
        try:
            exported = jax.export.export(jitted, platforms=["tt"])(*call_args, **call_kwargs)
        except NotImplementedError as exc:  # a primitive JAX cannot lower for the plugin's platform
            raise CompileError(f"JAX cannot lower the function for Tenstorrent's compiler: {exc}") from None
        if len(exported.in_avals) != len(leaves):
            raise ShapeError(f"the exported function takes {len(exported.in_avals)} arrays, the call gave {len(leaves)}")
        out_count = len(exported.out_avals)
        out_specs = self._out_specs(exported.out_tree, out_count)
        donated = self._donated(len(args), owners)
        descriptor, label = self._descriptor()
        request = {"exported": bytes(exported.serialize()), "mesh_shape": self.mesh_shape,
                   "axis_names": self.axis_names, "in_specs": specs,
                   "out_specs": out_specs if self.is_mesh else None, "donate": donated, "options": self.options}
        ttnn, mlir = compiler_for(descriptor, label).compile(request)
        binary = tt.Binary.from_bytes(ttnn)
        self.compiles += 1
        norm_out = tuple(_sharding.normalize(s, len(a.shape), self.axis_names, f"output {j}")
                         for j, (a, s) in enumerate(zip(exported.out_avals, out_specs, strict=True)))
        compiled = Compiled(binary, ttnn, mlir, tuple(exported.in_avals), tuple(exported.out_avals),
                            exported.out_tree, in_specs, norm_out, donated)
        if self.export_path is not None:
            compiled.save(self.export_path)
        return compiled

    def _out_specs(self, out_tree: Any, count: int) -> list[tuple[Any, ...] | None]:
        outs = self.out_shardings
        if outs is None or not self.is_mesh:
            return [None] * count
        jax = host_jax()
        flat = jax.tree_util.tree_leaves(outs, is_leaf=lambda s: s is None or _is_partition_spec(s))
        if _is_partition_spec(outs):
            flat = [outs] * count
        if len(flat) != count:
            raise MeshError(f"out_shardings gives {len(flat)} shardings; the function has {count} outputs")
        return [_spec_tuple(s) for s in flat]

    def _donated(self, positional: int, owners: list[int]) -> tuple[int, ...]:
        """The flat indices of the donated arguments' leaves (`owners` counts the dynamic
        positional arguments; `donate_argnums` counts them all, as JAX's does)."""
        static = {i % positional for i in self.static_argnums} if positional else set()
        dynamic = [i for i in range(positional) if i not in static]
        wanted = {dynamic.index(i % positional) for i in self.donate_argnums
                  if positional and (i % positional) in dynamic}
        return tuple(j for j, owner in enumerate(owners) if owner in wanted)

    # -- running --------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.target, (tt.Device, tt.MeshDevice)):
            raise tt.ProgramError("this function runs on a device opened on your own event loop: "
                                  "`await f.run_async(...)` there (a blocking call would wait on that loop)")
        compiled, leaves = self._compiled_for(args, kwargs)
        device = loop.device(self.target)
        tensors, hosts = loop.call(self._run, device, compiled, leaves, True)
        jax = host_jax()
        cpu = cpu_device()
        outputs = []
        for tensor, host, aval in zip(tensors, hosts, compiled.out_avals, strict=True):
            # made a JAX array here, on the caller's thread, while the loop's is free
            value = jax.device_put(np.asarray(host).reshape(aval.shape).astype(aval.dtype, copy=False), cpu)
            resident.put(value, device, tensor)
            outputs.append(value)
        return jax.tree_util.tree_unflatten(compiled.out_tree, outputs)

    async def run_async(self, *args: Any, **kwargs: Any) -> Any:
        """The outputs as ttflow tensors (futures: `await tt.to_host(t)`), on the device this
        function was given; the compile, if the signature is new, runs off the event loop."""
        import anyio.to_thread

        if not isinstance(self.target, (tt.Device, tt.MeshDevice)):
            raise tt.ProgramError("run_async runs on an open ttflow device: jit(f, device=device) with the device "
                                  "you opened; with a spec, call the function")
        compiled, leaves = await anyio.to_thread.run_sync(lambda: self._compiled_for(args, kwargs))
        outputs, _ = await self._run(self.target, compiled, leaves, False)
        return host_jax().tree_util.tree_unflatten(compiled.out_tree, outputs)

    def _input(self, device: Any, compiled: Compiled, j: int, leaf: Any) -> Any:
        """Argument `j` as the run takes it: the resident copy of a JAX array (submit converts
        its layout, once, if the binary declares another), else the value copied in."""
        jax = host_jax()
        layout = tt.get_layout(compiled.binary, 0, j)
        declared = layout.dtype
        assert declared is not None  # get_layout's dtype is always set
        is_jax = isinstance(leaf, jax.Array)
        if is_jax:
            held = resident.get(leaf, device)
            # a donated buffer is not converted; integers and floats are not mixed
            if held is not None and held.dtype.is_float == declared.is_float and (
                    j not in compiled.donated or held.layout == layout):
                return held
        aval = compiled.in_avals[j]
        array = np.asarray(leaf).astype(aval.dtype, copy=False).reshape(aval.shape)
        if array.dtype == np.bool_:  # the device holds booleans as numbers
            array = array.astype(declared.host_dtype)
        array = array.reshape(array.shape or (1,))  # a rank-0 tensor is held as (1,)
        if self.is_mesh:
            parts = _sharding.pieces(array, compiled.in_specs[j], self.mesh_shape, self.axis_names, f"argument {j}")
            tensor = tt.from_shards(parts, device, layout)
        elif not is_jax:
            return array  # copied in the layout the binary declares, with the run
        else:
            tensor = tt.to_device(array, device, layout)
        if is_jax:
            resident.put(leaf, device, tensor)
        return tensor

    async def _run(self, device: Any, compiled: Compiled, leaves: list[Any],
                   to_host: bool) -> tuple[list[Any], list[Array]]:
        """The outputs' tensors, and (`to_host`) their values on the host, whole."""
        jax = host_jax()
        inputs = [self._input(device, compiled, j, leaf) for j, leaf in enumerate(leaves)]
        outputs = tt.submit(device, compiled.binary, 0, inputs)
        for j in compiled.donated:  # JAX deletes a donated array; its device buffer went to an output
            leaf = leaves[j]
            if isinstance(leaf, jax.Array):
                resident.take(leaf)
                leaf.delete()
        del inputs
        if not to_host:
            return list(outputs), []
        hosts = []
        for j, out in enumerate(outputs):
            if self.is_mesh:
                parts = [await tt.to_host(t) for t in tt.device_tensors(out)]
                hosts.append(_sharding.assemble(parts, compiled.out_specs[j], self.mesh_shape, self.axis_names,
                                                f"output {j}"))
            else:
                hosts.append(await tt.to_host(out))
        return list(outputs), hosts


def _is_partition_spec(value: Any) -> bool:
    from jax.sharding import PartitionSpec

    return isinstance(value, PartitionSpec)


def _label(target: Target) -> str:
    if isinstance(target, (tt.Device, tt.MeshDevice)):
        target = target.spec
    if isinstance(target, tt.MeshSpec):
        return f"a {target.shape[0]}x{target.shape[1]} mesh"
    return target.name


def jit(fun: Callable[..., Any], *, device: Target | None = None, mesh: tt.MeshSpec | tt.MeshDevice | None = None,
        axis_names: Sequence[str] | None = None, in_shardings: Any = None, out_shardings: Any = None,
        donate_argnums: int | Sequence[int] = (), static_argnums: int | Sequence[int] = (),
        **compiler_options: Any) -> Jitted:
    """`fun` compiled by Tenstorrent's compiler for a ttflow device, per new signature, and run there.

    `device`: a `tt.DeviceSpec` (default: a Wormhole n150), opened once by ttflow.jax and shared
    by every function given the same spec, or a device you opened (then `await f.run_async(...)`).
    `mesh`: a `tt.MeshSpec` or open mesh, whose axes `axis_names` names (default "x", "y");
    `in_shardings`/`out_shardings`: `PartitionSpec`s over those names (one for all, or one per
    positional argument / output; None replicates; outputs default to replicated). Other
    keywords are the compiler's options, as `jax.jit(..., compiler_options=...)` takes them;
    `export_path=DIR` also writes each compile's `.ttnn` and MLIR there."""
    return Jitted(fun, device=device, mesh=mesh, axis_names=axis_names, in_shardings=in_shardings,
                  out_shardings=out_shardings, donate_argnums=donate_argnums, static_argnums=static_argnums,
                  compiler_options=compiler_options)


def compile(fun: Callable[..., Any], *args: Any, device: Target | None = None,  # JAX's word
            mesh: tt.MeshSpec | tt.MeshDevice | None = None, axis_names: Sequence[str] | None = None,
            in_shardings: Any = None, out_shardings: Any = None, donate_argnums: int | Sequence[int] = (),
            static_argnums: int | Sequence[int] = (), **compiler_options: Any) -> tt.Binary:
    """The `tt.Binary` Tenstorrent's compiler makes of `fun` for these arguments (arrays or
    `jax.ShapeDtypeStruct`s), for users who drive `tt.submit` themselves; `export_path=DIR` writes
    the `.ttnn` and its MLIR."""
    jitted = jit(fun, device=device, mesh=mesh, axis_names=axis_names, in_shardings=in_shardings,
                 out_shardings=out_shardings, donate_argnums=donate_argnums, static_argnums=static_argnums,
                 **compiler_options)
    return jitted.lower(*args).binary
