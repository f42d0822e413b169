"""Fresh JAX code through Tenstorrent's real compiler (the `[compiler]` extra), against the
descriptor ttflow writes, then loaded and run on the matching ttflow device: the path a user
takes, with code no corpus binary came from. Each result is checked against numpy."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np
import pytest

import ttflow as tt
from ttflow.ttnn import system_desc

HAVE_COMPILER = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("jax_plugins.libtt") is not None
pytestmark = [
    pytest.mark.skipif(not HAVE_COMPILER, reason="Tenstorrent's compiler is not installed: pip install "
                       "'.[compiler]' (jax==0.10.2, jax-tt-plugin==0.1.3; Python 3.11)"),
    pytest.mark.timeout(300),
]

# A residual block with layer norm, softmax attention over the batch and a tanh MLP, and on a mesh
# the second matmul's contraction sharded over the columns (an all_reduce).
SCRIPT = """
import sys
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
out, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
devices = jax.devices("tt")
assert len(devices) == rows * cols, len(devices)
def block(x, w1, w2):
    h = x - jnp.mean(x, axis=-1, keepdims=True)
    h = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    a = jax.nn.softmax(h @ h.T / 8.0, axis=-1) @ h
    return x + jnp.tanh(a @ w1) @ w2
rng = np.random.default_rng(7)
x = rng.standard_normal((32, 64)).astype(np.float32)
w1 = (rng.standard_normal((64, 64 * cols)) * 0.1).astype(np.float32)
w2 = (rng.standard_normal((64 * cols, 64)) * 0.1).astype(np.float32)
np.savez(out + ".npz", x=x, w1=w1, w2=w2)
opts = {"export_path": out}
if len(devices) == 1:
    jax.jit(block, compiler_options=opts)(*(jax.device_put(a, devices[0]) for a in (x, w1, w2)))
else:
    mesh = Mesh(np.array(devices).reshape(rows, cols), ("r", "c"))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    jax.jit(block, compiler_options=opts, out_shardings=NamedSharding(mesh, P()))(
        put(x, P()), put(w1, P(None, "c")), put(w2, P("c", None)))
"""

SYSTEMS = {
    "n150": (tt.DeviceSpec.wormhole_n150(), (1, 1)),
    "p150": (tt.DeviceSpec.blackhole_p150(), (1, 1)),
    "n300": (tt.MeshSpec.n300(), (1, 2)),
    "t3000": (tt.MeshSpec.t3000(), (2, 4)),
}


def reference(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    h = x - x.mean(-1, keepdims=True)
    h = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6)
    s = h @ h.T / 8.0
    s = np.exp(s - s.max(-1, keepdims=True))
    a = (s / s.sum(-1, keepdims=True)) @ h
    return x + np.tanh(a @ w1) @ w2


def compile_for(spec: tt.DeviceSpec | tt.MeshSpec, shape: tuple[int, int], folder: Path) -> Path:
    desc = system_desc(spec).save(folder / "system_desc.ttsys")
    env = {**os.environ, "TT_COMPILE_ONLY_SYSTEM_DESC": str(desc)}
    env.pop("JAX_PLATFORMS", None)
    out = folder / "out"
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(shape[0]), str(shape[1])], env=env,
                         capture_output=True, text=True, timeout=240, check=False)
    assert run.returncode == 0, f"the compiler failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    (binary,) = out.glob("*.ttnn")
    return binary


@pytest.mark.parametrize("system", list(SYSTEMS))
def test_fresh_jax_code_compiled_for_ttflows_descriptor_runs_on_that_device(system: str, tmp_path: Path) -> None:
    spec, shape = SYSTEMS[system]
    path = compile_for(spec, shape, tmp_path)
    data = np.load(str(tmp_path / "out") + ".npz")
    want = reference(data["x"], data["w1"], data["w2"])
    binary = tt.Binary.load(path)
    chips = shape[0] * shape[1]
    cols = shape[1]

    async def main() -> list[np.ndarray]:
        if chips == 1:
            assert isinstance(spec, tt.DeviceSpec)
            async with tt.open_device(spec) as device:
                inputs = [tt.to_device(data[k], device, tt.get_layout(binary, 0, j))
                          for j, k in enumerate(("x", "w1", "w2"))]
                (out,) = tt.submit(device, binary, 0, inputs)
                return [await tt.to_host(out)]
        assert isinstance(spec, tt.MeshSpec)
        async with tt.open_mesh_device(spec) as mesh:
            def cut(a: np.ndarray, axis: int | None) -> list[np.ndarray]:
                if axis is None:
                    return [a] * chips
                parts = np.split(a, cols, axis=axis)
                return [parts[c % cols] for c in range(chips)]  # sharded over the columns
            shards = [cut(data["x"], None), cut(data["w1"], 1), cut(data["w2"], 0)]
            inputs = [tt.from_shards(s, mesh, tt.get_layout(binary, 0, j)) for j, s in enumerate(shards)]
            (out,) = tt.submit(mesh, binary, 0, inputs)
            return [await tt.to_host(t) for t in tt.device_tensors(out)]

    for piece in anyio.run(main):
        np.testing.assert_allclose(piece, want, rtol=1e-4, atol=1e-4)
