"""`ttflow.jax`: JAX functions written here, compiled by Tenstorrent's real compiler (the `[jax]`
extra) against ttflow's descriptor, run on the emulated device, and compared with the same
function on JAX's CPU backend (the independent reference)."""

from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Iterator

import numpy as np
import pytest

import ttflow as tt

HAVE_JAX = importlib.util.find_spec("jax") is not None and importlib.util.find_spec("jax_plugins.libtt") is not None
pytestmark = [
    pytest.mark.skipif(not HAVE_JAX, reason="ttflow.jax needs JAX and Tenstorrent's compiler: pip install "
                       "'.[jax]' (jax==0.10.2, jax-tt-plugin==0.1.3; Python 3.11)"),
    pytest.mark.timeout(300),
]

if HAVE_JAX:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import ttflow.jax as tj
    from ttflow.jax._jit import resident
    from ttflow.jax._loop import loop

RNG = np.random.default_rng(11)


@pytest.fixture(autouse=True, scope="module")
def _closed_after() -> Iterator[None]:
    """ttflow.jax's devices, their event loop and its compiler processes live until exit; closed
    after this module, so later tests see no worker threads of theirs."""
    yield
    import ttflow.jax

    ttflow.jax.shutdown()


def f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def cpu(fun, *args, **kw):  # type: ignore[no-untyped-def]
    """The reference: the same function on JAX's CPU backend."""
    return jax.jit(fun, **kw)(*(jax.device_put(a, jax.devices("cpu")[0]) for a in args))


def close(got, want, tol: float = 1e-5) -> None:  # type: ignore[no-untyped-def]
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert isinstance(g, jax.Array)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=tol, atol=tol)


def block(x, w, b):  # type: ignore[no-untyped-def]
    h = jnp.tanh(x @ w + b)
    return {"h": h, "rows": jnp.sum(h, axis=1), "mean": jnp.mean(x)}


def test_jit_equals_jax_on_the_cpu_and_compiles_each_signature_once() -> None:
    f = tj.jit(block)
    x, w, b = f32(32, 64), f32(64, 64, scale=0.1), f32(64)
    got = f(x, w, b)
    close(got, cpu(block, x, w, b))
    assert set(got) == {"h", "rows", "mean"} and got["mean"].shape == ()
    close(f(x * 2, w, b), cpu(block, x * 2, w, b))  # the same signature: no compile
    assert f.compiles == 1
    taller = f32(64, 64)
    close(f(taller, w, b), cpu(block, taller, w, b))
    assert f.compiles == 2  # a new shape is a new signature


def test_a_new_batch_shape_and_python_scalars_give_jaxs_answers() -> None:
    def scaled(x, s):  # type: ignore[no-untyped-def]
        return jax.nn.relu(x) * s

    f = tj.jit(scaled)
    for rows in (32, 8, 3):
        x = f32(rows, 32)
        close(f(x, 0.5), cpu(scaled, x, 0.5))


def test_static_arguments_are_part_of_the_signature() -> None:
    def power(x, n):  # type: ignore[no-untyped-def]
        return x ** n

    f = tj.jit(power, static_argnums=1)
    x = f32(32, 32)
    for n in (2, 3, 2):
        np.testing.assert_allclose(np.asarray(f(x, n)), x ** n, rtol=1e-5)
    assert f.compiles == 2


def test_jax_arrays_stay_resident_and_numpy_arrays_are_read_each_call() -> None:
    """A JAX array (immutable) goes to the device once; a numpy array (mutable) is copied in on
    every call, so changing it in place changes the next answer."""
    def affine(x, w):  # type: ignore[no-untyped-def]
        return x @ w

    f = tj.jit(affine)
    w = jnp.asarray(f32(64, 64, scale=0.1))
    x = f32(64, 64)
    first = f(x, w)
    device = loop.device(tt.DeviceSpec.wormhole_n150())
    held = resident.get(w, device)
    assert held is not None
    x[:] = f32(64, 64)  # the same numpy object, new values
    second = f(x, w)
    assert resident.get(w, device) is held  # w was not copied again
    np.testing.assert_allclose(np.asarray(second), x @ np.asarray(w), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(first), np.asarray(second))
    # an output is resident too: feeding it on sends nothing
    again = f(np.asarray(x), second)
    assert resident.get(second, device) is not None
    np.testing.assert_allclose(np.asarray(again), x @ (x @ np.asarray(w)), rtol=1e-4, atol=1e-3)
    before = len(resident)
    del second, again, first
    import gc

    gc.collect()
    assert len(resident) < before  # a JAX array that died took its device copy with it


def test_a_donated_training_loop_matches_jax_on_the_cpu() -> None:
    """SGD on a tanh layer: parameters donated each step (the compiler aliases them to the new
    parameters), the donated JAX arrays deleted as JAX deletes them, the loss curve JAX's."""
    def step(w, b, x, t):  # type: ignore[no-untyped-def]
        def loss(w, b):  # type: ignore[no-untyped-def]
            return jnp.mean((jnp.tanh(x @ w + b) - t) ** 2)

        value, (gw, gb) = jax.value_and_grad(loss, argnums=(0, 1))(w, b)
        return w - 0.5 * gw, b - 0.5 * gb, value

    x, t = f32(32, 64), f32(32, 32)
    w0, b0 = f32(64, 32, scale=0.1), np.zeros((32,), np.float32)
    f = tj.jit(step, donate_argnums=(0, 1))
    w, b = jnp.asarray(w0), jnp.asarray(b0)
    rw, rb = jnp.asarray(w0), jnp.asarray(b0)
    losses, reference = [], []
    for _ in range(4):
        old = w
        w, b, loss = f(w, b, x, t)
        assert old.is_deleted()
        rw, rb, rloss = cpu(step, rw, rb, x, t)
        losses.append(float(loss))
        reference.append(float(rloss))
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert losses[-1] < losses[0]
    close((w, b), (rw, rb), tol=1e-5)
    assert f.lower(w, b, x, t).donated == (0, 1)


def test_compile_returns_the_binary_and_writes_it_where_asked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    x, w, b = f32(32, 64), f32(64, 64, scale=0.1), f32(64)
    binary = tj.compile(block, x, w, b, export_path=str(tmp_path))
    assert isinstance(binary, tt.Binary)
    assert (tmp_path / "program.ttnn").exists() and any((tmp_path / "irs").glob("ttnn*.mlir"))
    assert tt.Binary.load(tmp_path / "program.ttnn").programs[0].steps == binary.programs[0].steps
    # a stranger's tt.submit of it
    import anyio

    async def run() -> list[np.ndarray]:
        async with tt.open_device() as device:
            return [await tt.to_host(o) for o in tt.submit(device, binary, 0, [x, w, b])]

    outs = anyio.run(run)
    want = cpu(block, x, w, b)
    np.testing.assert_allclose(outs[0], np.asarray(want["h"]), rtol=1e-5, atol=1e-5)


def test_the_compilers_refusal_is_a_compile_error_with_its_message() -> None:
    def solve(a):  # type: ignore[no-untyped-def]
        return jnp.linalg.inv(a + 4 * jnp.eye(32))

    with pytest.raises(tj.CompileError, match="triangular_solve"):
        tj.jit(solve)(f32(32, 32))
    # the compiler's process is still up and compiles the next function
    y = f32(32, 32)
    close(tj.jit(jnp.exp)(y), cpu(jnp.exp, y))


def test_a_dead_compiler_process_is_started_again() -> None:
    from ttflow.jax._compiler import _compilers

    f = tj.jit(jnp.sin)
    x = f32(32, 32)
    close(f(x), cpu(jnp.sin, x))
    (compiler,) = [c for c in _compilers.values() if c.label == "wormhole_n150"]
    pid = compiler.pid
    assert pid is not None
    os.kill(pid, 9)
    g = tj.jit(jnp.cos)
    close(g(x), cpu(jnp.cos, x))
    assert compiler.pid not in (None, pid)


def test_compare_names_the_source_line_of_a_planted_wrong_op_first() -> None:
    """The tanh is made to compute 1% high (a post_op hook writes over its output): the first op
    that parts from JAX's CPU is the tanh's, at the line of this file that wrote it."""
    def model(x, w):  # type: ignore[no-untyped-def]
        h = jax.nn.relu(x @ w)
        t = jnp.tanh(h) * 2.0
        return jax.nn.softmax(t, axis=-1)

    line = inspect.getsourcelines(model)[1] + 2  # `t = jnp.tanh(h) * 2.0`
    x, w = f32(32, 64), f32(64, 64)
    clean = tj.compare(model, x, w)
    assert clean.ok, clean.table()
    assert sum(row.matched for row in clean.rows) >= 4
    assert all(row.pcc > 0.9999 for row in clean.rows if row.matched)

    async def plant(ctx: tt.OpContext) -> None:
        if ctx.name == "tanh":
            out = ctx.outputs[0]
            value = await tt.to_host(out)
            tt.write(out, (value * 1.01).astype(value.dtype))

    planted = tj.compare(model, x, w, post_op=plant)
    first = planted.first_divergence
    assert first is not None, planted.table()
    assert first.op == "tanh" and first.source == f"{__file__}:{line}", planted.table()
    assert "first divergence" in planted.table()


def test_a_tensor_parallel_mlp_on_an_n300_mesh() -> None:
    """The hidden layer split over the mesh's "model" axis: each chip holds half of w1's columns
    and w2's rows, the compiler's all_reduce crosses the emulated link, the outputs replicated
    (or kept split, as out_shardings asks) equal JAX on the CPU."""
    def mlp(x, w1, w2):  # type: ignore[no-untyped-def]
        return jnp.tanh(x @ w1) @ w2

    x, w1, w2 = f32(32, 64), f32(64, 128, scale=0.1), f32(128, 64, scale=0.1)
    spec = tt.MeshSpec.n300()
    shardings = (P(), P(None, "model"), P("model", None))
    f = tj.jit(mlp, mesh=spec, axis_names=("batch", "model"), in_shardings=shardings)
    mesh = loop.device(spec)
    before = sum(mesh.stats.link_bytes.values())
    close(f(x, w1, w2), cpu(mlp, x, w1, w2))
    assert sum(mesh.stats.link_bytes.values()) > before
    kept = tj.jit(mlp, mesh=spec, axis_names=("batch", "model"), in_shardings=shardings, out_shardings=P(None, "model"))
    close(kept(x, w1, w2), cpu(mlp, x, w1, w2))
    with pytest.raises(tt.MeshError, match="names the axis 'rows'"):
        tj.jit(mlp, mesh=spec, axis_names=("batch", "model"), in_shardings=(P("rows"), P(), P()))(x, w1, w2)


@pytest.mark.anyio
async def test_run_async_on_a_device_you_opened_gives_ttflow_tensors() -> None:
    """On the caller's own event loop (asyncio and trio): the compile off the loop, the outputs
    ttflow tensors (futures) to await; the blocking call is refused there, with the way out."""
    x, w, b = f32(32, 64), f32(64, 64, scale=0.1), f32(64)
    async with tt.open_device() as device:
        f = tj.jit(block, device=device)
        out = await f.run_async(x, w, b)
        assert isinstance(out["h"], tt.Tensor)
        want = cpu(block, x, w, b)
        np.testing.assert_allclose(await tt.to_host(out["h"]), np.asarray(want["h"]), rtol=1e-5, atol=1e-5)
        with pytest.raises(tt.ProgramError, match="run_async"):
            f(x, w, b)


def test_two_compilers_at_once_each_keep_their_own_system() -> None:
    """An n150 compiler and an n300 compiler alive together: each binary is planned for its own
    system, and stopping one leaves the other compiling. (The plugin copies its descriptor to one
    fixed path under TMPDIR when it starts and reads it at each compile: sharing /tmp, the
    second compiler's start replaced the first's descriptor, and the exit of one deleted it,
    failing every later compile of the other.)"""
    from ttflow.jax._compiler import _compilers

    def double(x):  # type: ignore[no-untyped-def]
        return x * 2.0

    spec = tt.MeshSpec.n300()
    x = f32(32, 64)
    one = tj.jit(double).lower(x)
    two = tj.jit(double, mesh=spec, in_shardings=P(None, "y"), out_shardings=P(None, "y")).lower(x)
    # split over two chips' columns, each chip's program takes half of them
    assert one.binary.programs[0].inputs[0].shape == (32, 64), one.binary.programs[0]
    assert two.binary.programs[0].inputs[0].shape == (32, 32), two.binary.programs[0]
    (mesh_compiler,) = [c for c in _compilers.values() if c.label.endswith("mesh")]
    mesh_compiler.close()
    again = tj.jit(double)
    y = f32(8, 64)
    close(again(y), cpu(double, y))  # a new compile on the n150's compiler, after the other's exit


def test_a_decoder_generates_jaxs_tokens_with_a_donated_kv_cache() -> None:
    """A one-layer GPT-style decoder: prefill writes the prompt's keys and values into a cache,
    decode appends one position per step (the cache donated, updated in place on the device,
    `dynamic_update_slice` at a position given as an array); greedy tokens and logits equal JAX
    on the CPU running the same two functions."""
    vocab, d, max_len, prompt = 64, 32, 16, 5

    def embed_attend(params, x, k_all, v_all, length):  # type: ignore[no-untyped-def]
        q = x @ params["wq"]
        scores = q @ k_all.T / np.sqrt(d)
        valid = jnp.arange(max_len)[None, :] < length
        att = jax.nn.softmax(jnp.where(valid, scores, -1e9), axis=-1)
        h = x + (att @ v_all) @ params["wo"]
        return jnp.tanh(h @ params["w1"]) @ params["emb"].T

    def prefill(params, tokens):  # type: ignore[no-untyped-def]
        x = params["emb"][tokens]
        k = jnp.zeros((max_len, d)).at[:prompt].set(x @ params["wk"])
        v = jnp.zeros((max_len, d)).at[:prompt].set(x @ params["wv"])
        logits = embed_attend(params, x[-1:], k, v, prompt)
        return (k, v), logits[0]

    def decode(params, cache, token, pos):  # type: ignore[no-untyped-def]
        k, v = cache
        x = params["emb"][token]
        k = jax.lax.dynamic_update_slice(k, x @ params["wk"], (pos[0], 0))
        v = jax.lax.dynamic_update_slice(v, x @ params["wv"], (pos[0], 0))
        logits = embed_attend(params, x, k, v, pos[0] + 1)
        return (k, v), logits[0]

    params = {"emb": f32(vocab, d, scale=0.5), "wq": f32(d, d, scale=0.3), "wk": f32(d, d, scale=0.3),
              "wv": f32(d, d, scale=0.3), "wo": f32(d, d, scale=0.3), "w1": f32(d, d, scale=0.3)}
    tokens = RNG.integers(0, vocab, prompt).astype(np.int32)

    def generate(prefill_fn, decode_fn, p):  # type: ignore[no-untyped-def]
        cache, logits = prefill_fn(p, tokens)
        out, all_logits = [], [np.asarray(logits)]
        for step in range(4):
            token = np.array([int(np.argmax(all_logits[-1]))], np.int32)
            out.append(int(token[0]))
            cache, logits = decode_fn(p, cache, token, np.array([prompt + step], np.int32))
            all_logits.append(np.asarray(logits))
        return out, all_logits, [np.asarray(c) for c in cache]

    device_params = jax.tree_util.tree_map(jnp.asarray, params)
    ours, our_logits, our_cache = generate(tj.jit(prefill), tj.jit(decode, donate_argnums=1), device_params)
    theirs, their_logits, their_cache = generate(jax.jit(prefill), jax.jit(decode), params)
    assert ours == theirs
    for a, b in zip(our_cache, their_cache, strict=True):  # row by row: attention alone cannot tell an order
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(our_logits, their_logits, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_small_cnn_equals_jax_on_the_cpu() -> None:
    def cnn(img, k1, k2, w):  # type: ignore[no-untyped-def]
        y = jax.lax.conv_general_dilated(img, k1, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = jax.nn.relu(y)
        y = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        y = jax.lax.conv_general_dilated(y, k2, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(y, axis=(1, 2)) @ w

    args = (f32(2, 16, 16, 3), f32(3, 3, 3, 8, scale=0.3), f32(3, 3, 8, 16, scale=0.2), f32(16, 10, scale=0.3))
    got = tj.jit(cnn)(*args)
    want = cpu(cnn, *args)
    # the compiler pools in bfloat16 (docs/compiler.md): bfloat16's rounding of the pooled values
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-2, atol=2e-2 * float(np.abs(want).max()))
