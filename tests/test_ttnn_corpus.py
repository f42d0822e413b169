"""Binaries Tenstorrent's compiler wrote (tests/data/ttnn, made by make_corpus.py beside them),
loaded with `tt.Binary.load` and run on the emulated device; every output against the same JAX
function on JAX's CPU backend (the `.npz` beside each binary holds its inputs and those outputs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ttflow as tt

pytestmark = pytest.mark.anyio

CORPUS = Path(__file__).parent / "data" / "ttnn"
# One-chip programs; a mesh program has its shardings beside it (tests/test_ttnn_mesh.py runs it).
CASES = sorted(p.stem for p in CORPUS.glob("*.ttnn") if not p.with_suffix(".json").exists()
               and p.stem != "int_floor_div")

# Largest |device - cpu| over max |cpu|, per case (docs/compiler.md, "Numerics"): float32 ops
# agree to rounding; max pools run in bfloat16 as the compiler typecasts them (cnn, pools);
# TTNN's gelu is the erf form while jax.nn.gelu defaults to the tanh approximation (1.4e-4 apart
# at most: eltwise, gpt2_block).
# int_floor_div is compared apart (test_int32_floor_division_is_the_compilers_float32_sequence).
TOLERANCE = {"cnn": 2e-3, "pools": 5e-3, "eltwise": 1e-3, "gpt2_block": 1e-3, "gpt2_tiny": 1e-3}
DEFAULT_TOLERANCE = 1e-5


async def run_case(device: tt.Device, name: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    binary = tt.Binary.load(CORPUS / f"{name}.ttnn")
    data = np.load(CORPUS / f"{name}.npz")
    program = binary.programs[0]
    inputs = []
    for j in range(len(program.inputs)):
        array = data[f"in{j}"]
        array = array.reshape(array.shape or (1,))  # a rank-0 tensor is held as (1,)
        inputs.append(tt.to_device(array, device, tt.get_layout(binary, 0, j)))
    outputs = tt.submit(device, binary, 0, inputs)
    got = [await tt.to_host(o) for o in outputs]
    expected = [data[f"out{j}"] for j in range(len(got))]
    return got, expected


def test_the_corpus_is_there() -> None:
    assert len(CASES) >= 22, CASES


@pytest.mark.parametrize("name", CASES)
async def test_corpus_binary_matches_jax_cpu(name: str) -> None:
    async with tt.open_device() as device:
        got, expected = await run_case(device, name)
        assert len(got) == len(expected) > 0
        for j, (g, e) in enumerate(zip(got, expected, strict=True)):
            g = g.reshape(e.shape)
            if e.dtype.kind in "iub":
                np.testing.assert_array_equal(g.astype(np.int64), e.astype(np.int64), err_msg=f"{name} output {j}")
            else:  # NaN where JAX has NaN, the same infinities, the finite rest within the bound
                np.testing.assert_array_equal(np.isnan(g), np.isnan(e), err_msg=f"{name} output {j}: NaNs")
                finite = np.isfinite(e)
                np.testing.assert_array_equal(g[~finite & ~np.isnan(e)], e[~finite & ~np.isnan(e)])
                if finite.any():
                    scale = float(np.max(np.abs(e[finite]))) or 1.0
                    err = float(np.max(np.abs(g[finite].astype(np.float64) - e[finite]))) / scale
                    assert err <= TOLERANCE.get(name, DEFAULT_TOLERANCE), f"{name} output {j}: {err}"


async def test_main_deallocating_its_inputs_leaves_the_callers_tensors() -> None:
    """`main` deallocates its own inputs (force=false): a caller's tensors survive it and feed a
    second run, which gives the same outputs."""
    async with tt.open_device() as device:
        binary = tt.Binary.load(CORPUS / "mlp.ttnn")
        data = np.load(CORPUS / "mlp.npz")
        inputs = [tt.to_device(data[f"in{j}"], device, tt.get_layout(binary, 0, j)) for j in range(5)]
        first = await tt.to_host(tt.submit(device, binary, 0, inputs)[0])
        second = await tt.to_host(tt.submit(device, binary, 0, inputs)[0])
        np.testing.assert_array_equal(first, second)
        np.testing.assert_allclose(first, data["out0"], rtol=1e-5, atol=1e-6)


async def test_host_arrays_stand_in_for_inputs_as_tt_mlir_host_tensors() -> None:
    """numpy arrays in the inputs' places are copied in the layouts the binary declares: the
    outputs are the device tensors' bit for bit, the copies go with the run, and a host array of
    the wrong shape is a ShapeError naming the input before anything is copied."""
    async with tt.open_device() as device:
        binary = tt.Binary.load(CORPUS / "mlp.ttnn")
        data = np.load(CORPUS / "mlp.npz")
        arrays = [data[f"in{j}"] for j in range(5)]
        tensors = [tt.to_device(a, device, tt.get_layout(binary, 0, j)) for j, a in enumerate(arrays)]
        want = await tt.to_host(tt.submit(device, binary, 0, tensors)[0])
        del tensors
        before = device.memory_used(tt.MemorySpace.DRAM)
        mixed = [arrays[0], *[tt.to_device(a, device, tt.get_layout(binary, 0, j + 1)) for j, a in enumerate(arrays[1:])]]
        for inputs in (arrays, mixed):
            (out,) = tt.submit(device, binary, 0, inputs)
            np.testing.assert_array_equal(await tt.to_host(out), want)
        del mixed, inputs, out
        await tt.to_host(tt.to_device(arrays[0], device))  # a later command frees what was dropped
        assert device.memory_used(tt.MemorySpace.DRAM) == before
        with pytest.raises(tt.ShapeError, match=r"input 2 of 'main' is a host array of shape \(3,"):
            tt.submit(device, binary, 0, [*arrays[:2], arrays[2][:3], *arrays[3:]])
        await tt.to_host(tt.to_device(arrays[0], device))
        assert device.memory_used(tt.MemorySpace.DRAM) == before


async def test_the_timeline_shows_each_compiled_op_with_its_location_and_compute_config() -> None:
    """A slice per op inside its program's, in the program's order, each with the location the
    binary records and, for a matmul (a `linear` here), the compute config it names."""
    async with tt.open_device() as device:
        binary = tt.Binary.load(CORPUS / "mlp.ttnn")
        data = np.load(CORPUS / "mlp.npz")
        with tt.record_timeline(device) as recorder:
            await tt.to_host(tt.submit(device, binary, 0, [data[f"in{j}"] for j in range(5)])[0])
        (program,) = [e for e in recorder.events if e.get("cat") == "ProgramCommand" and e["name"] == "main"]
        ops = [e for e in recorder.events if e.get("cat") == "op"]
        steps = binary.programs[0].steps
        assert [e["name"] for e in ops] == [step.op for step in steps]
        assert [e["args"]["step"] for e in ops] == list(range(len(steps)))
        for e in ops:
            assert program["ts"] <= e["ts"] and e["ts"] + e["dur"] <= program["ts"] + program["dur"] + 1e-3
            assert "make_corpus.py:4" in e["args"]["loc"]
        matmuls = [e for e in ops if e["name"] == "matmul"]
        assert matmuls and all(e["args"]["loc"].endswith("[hifi4 fp32_acc]") for e in matmuls)


async def test_a_donated_cache_is_updated_in_place_step_after_step() -> None:
    """`donate_argnums=(0,)`: the binary marks the cache `tf.aliasing_output = 0`; the output takes
    the cache's buffer (the submit consumes it, no new buffer), and the cache fed back step after
    step holds every row written, as numpy's."""
    binary = tt.Binary.load(CORPUS / "kv_donated.ttnn")
    assert binary.programs[0].donations == ((0, 0),)
    data = np.load(CORPUS / "kv_donated.npz")
    cache_np, x, wk = data["in0"].copy(), data["in1"], data["in2"]
    async with tt.open_device() as device:
        layout = [tt.get_layout(binary, 0, j) for j in range(4)]
        cache = tt.to_device(cache_np, device, layout[0])
        weights = tt.to_device(wk, device, layout[2])
        for step, pos in enumerate((9, 3, 40)):
            row = (x * (step + 1)).astype(np.float32)
            before = device.stats.donations
            cache, total = tt.submit(device, binary, 0, [cache, tt.to_device(row, device, layout[1]), weights,
                                                         tt.to_device(np.array([pos], np.int32), device, layout[3])])
            cache_np[pos] = (row @ wk)[0]
            np.testing.assert_allclose(await tt.to_host(cache), cache_np, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(await tt.to_host(total), cache_np.sum(0), rtol=1e-5, atol=1e-5)
            assert device.stats.donations == before + 1


async def test_a_compiled_training_step_trains_on_the_device_fed_its_own_outputs() -> None:
    """The compiled `jax.value_and_grad` step run five times, each step's new weights fed to the
    next as device tensors (no host trip), against the same loop in numpy."""
    binary = tt.Binary.load(CORPUS / "train_step.ttnn")
    data = np.load(CORPUS / "train_step.npz")
    w, b, x, t = (data[f"in{j}"].astype(np.float64) for j in range(4))
    async with tt.open_device() as device:
        layouts = [tt.get_layout(binary, 0, j) for j in range(4)]
        tw, tb = tt.to_device(data["in0"], device, layouts[0]), tt.to_device(data["in1"], device, layouts[1])
        tx, tt_ = tt.to_device(data["in2"], device, layouts[2]), tt.to_device(data["in3"], device, layouts[3])
        losses = []
        for _ in range(5):
            loss, tw, tb = tt.submit(device, binary, 0, [tw, tb, tx, tt_])
            losses.append(float((await tt.to_host(loss)).reshape(())))
            a = np.tanh(x @ w + b)
            r = a - t
            want = float(np.mean(r * r))
            dz = 2 * r / r.size * (1 - a * a)
            w, b = w - 0.1 * (x.T @ dz), b - 0.1 * dz.sum(0)
            assert losses[-1] == pytest.approx(want, rel=1e-5)
        np.testing.assert_allclose(await tt.to_host(tw), w, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(await tt.to_host(tb), b, rtol=1e-4, atol=1e-6)
        assert losses == sorted(losses, reverse=True)  # it learns


async def test_int32_floor_division_is_the_compilers_float32_sequence() -> None:
    """jnp's // on int32 compiles to a float32 division, a truncating typecast and a sign fix-up
    (signs read in bf16): exact below 2**24, and off JAX's exact quotient past it, as the same
    program is on silicon. ttflow runs that program: equal to numpy's run of the sequence, and to
    JAX's exact quotient wherever the dividend fits float32's mantissa."""
    binary = tt.Binary.load(CORPUS / "int_floor_div.ttnn")
    data = np.load(CORPUS / "int_floor_div.npz")
    a, b = data["in0"], data["in1"]
    async with tt.open_device() as device:
        ins = [tt.to_device(x, device, tt.get_layout(binary, 0, k)) for k, x in enumerate((a, b))]
        (out,) = tt.submit(device, binary, 0, ins)
        got = await tt.to_host(out)
    quotient = np.trunc(a.astype(np.float32) / b.astype(np.float32)).astype(np.int64).clip(-(2**31), 2**31 - 1)
    signs_differ = np.sign(a.astype(np.float32)) != np.sign(b.astype(np.float32))
    want = np.where(signs_differ & (np.fmod(a, b) != 0), quotient - 1, quotient).astype(np.int32)
    np.testing.assert_array_equal(got, want)
    small = np.abs(a) < 2**24
    np.testing.assert_array_equal(got[small], data["out0"][small])
    assert (got != data["out0"]).any()  # past 2**24 the compiled program is not exact


async def test_load_cached_runs_once_and_is_counted_as_const_eval() -> None:
    """The const-eval functions `main` calls through `ttcore.load_cached` (here: the constants of
    jnp's arithmetic) run on the first submit only; later submits hit the device's cache, as
    tt-mlir's runtime caches them, and give the same values."""
    binary = tt.Binary.load(CORPUS / "eltwise.ttnn")
    assert binary.programs[0].cache_constants
    data = np.load(CORPUS / "eltwise.npz")
    async with tt.open_device() as device:
        inputs = [tt.to_device(data[f"in{j}"], device, tt.get_layout(binary, 0, j)) for j in range(2)]
        first = [await tt.to_host(o) for o in tt.submit(device, binary, 0, inputs)]
        assert (device.stats.const_eval_misses, device.stats.const_eval_hits) == (1, 0)
        second = [await tt.to_host(o) for o in tt.submit(device, binary, 0, inputs)]
        assert (device.stats.const_eval_misses, device.stats.const_eval_hits) == (1, 1)
        for a, b in zip(first, second, strict=True):
            np.testing.assert_array_equal(a, b)
