"""The compiler's process: Tenstorrent's PJRT plugin, compile-only, against one system descriptor.

Started by `_compiler.Compiler` as `python -m ttflow.jax._server` with `TT_COMPILE_ONLY_SYSTEM_DESC`
set, because the plugin opens one PJRT client per process and reads the descriptor when that client
starts: a process compiles for one device or mesh, and the caller's own JAX (a CPU JAX) never meets
the plugin. It stays up across compiles (importing jax and starting the client is ~2 s, a compile
of a small function ~0.1 s).

The protocol, on stdin and a private copy of stdout (fd 1 itself is pointed at stderr before jax
is imported, so nothing the plugin prints can corrupt a reply): each message is an 8-byte
little-endian length and a pickle. A request is a dict (`exported`: `jax.export.Exported`
serialized by the caller, for the platform "tt"; `mesh_shape`, `axis_names`; `in_specs`,
`out_specs`: a PartitionSpec's entries per leaf or None; `donate`: flat input indices;
`options`: the compiler options), the reply `("ok", ttnn_bytes, {mlir name: text})` or
`("error", message)`. EOF on stdin (the caller exited or closed it) ends the process.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

HEADER = struct.Struct("<Q")


def read_message(stream: IO[bytes]) -> Any:
    """One message, or None at EOF."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return pickle.loads(body)  # from the process that started this one


def write_message(stream: IO[bytes], message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def _compile(request: dict[str, Any]) -> tuple[Any, ...]:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    exported = jax.export.deserialize(bytearray(request["exported"]))
    devices = jax.devices("tt")
    shape = tuple(request["mesh_shape"])
    if len(devices) != int(np.prod(shape)):
        return ("error", f"the compiler's descriptor has {len(devices)} chips, the mesh {shape}")

    def sharding(spec: tuple[Any, ...] | None) -> Any:
        if spec is None or len(devices) == 1:
            return None
        mesh = Mesh(np.array(devices).reshape(shape), tuple(request["axis_names"]))
        return NamedSharding(mesh, PartitionSpec(*spec))

    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding(s))
             for a, s in zip(exported.in_avals, request["in_specs"], strict=True)]
    out_shardings = None
    if len(devices) > 1 and request["out_specs"] is not None:
        out_shardings = tuple(sharding(s) for s in request["out_specs"])
    folder = Path(tempfile.mkdtemp(prefix="ttflow-jax-"))
    try:
        # the exported function takes its pytree; `call_flat` takes the leaves the binary takes
        def flat(*leaves: Any) -> Any:
            args, kwargs = jax.tree_util.tree_unflatten(exported.in_tree, leaves)
            return tuple(jax.tree_util.tree_leaves(exported.call(*args, **kwargs)))

        options = {**request["options"], "export_path": str(folder)}
        jitted = jax.jit(flat, donate_argnums=tuple(request["donate"]), out_shardings=out_shardings,
                         compiler_options=options)
        jitted.trace(*avals).lower().compile()
        binaries = sorted(folder.glob("*.ttnn"))
        if len(binaries) != 1:
            return ("error", f"the compiler wrote {len(binaries)} binaries, not one")
        mlir = {p.name: p.read_text() for p in sorted((folder / "irs").glob("*.mlir"))}
        return ("ok", binaries[0].read_bytes(), mlir)
    finally:
        for p in sorted(folder.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        folder.rmdir()


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the plugin prints goes to stderr, never into a reply
    requests = sys.stdin.buffer
    try:  # the client starts now, so a descriptor it refuses is reported before any compile
        import jax

        write_message(replies, ("ready", len(jax.devices("tt"))))
    except Exception as exc:  # noqa: BLE001
        write_message(replies, ("error", f"the compiler did not start: {type(exc).__name__}: {exc}"))
        return
    while (request := read_message(requests)) is not None:
        try:
            reply = _compile(request)
        except Exception as exc:  # noqa: BLE001  # the compiler's refusal, sent to the caller
            message = str(exc).strip() or type(exc).__name__
            reply = ("error", f"{type(exc).__name__}: {message}")
        write_message(replies, reply)


if __name__ == "__main__":
    main()
