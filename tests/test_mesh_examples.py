"""Issue 26's worked examples on meshes, each compared with a one-chip run and with numpy.

- A data-parallel training step of a two-layer MLP: the batch sharded over the chips, the
  weights replicated, forward and backward written as one ttflow program, the gradients
  all_reduced, an SGD update on every chip; on an n300 and a T3000 it equals the one-chip step
  on the whole batch: bit for bit when every sum is exact (small integers, power-of-two scales),
  within the documented sum tolerance otherwise (docs/mesh.md, "Sums: their order and their
  tolerance": a batch sum split N ways adds in another order).

The other examples of the issue live beside the code they exercise: the tensor-parallel MLP in
tests/test_collectives.py, two 1x1 submeshes driven by two tasks (tt-mlir's test_data_parallel)
in tests/test_mesh.py.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest

import ttflow as tt

pytestmark = pytest.mark.anyio

SMALL = tt.DeviceSpec.small()
BATCH, D_IN, HIDDEN, D_OUT = 64, 32, 64, 16
LR = 2.0**-4


def train_step(rows: int, batch: int = BATCH, lr: float = LR) -> tt.Binary:
    """One SGD step of y = relu(x W1) W2 under the mean squared error, on `rows` rows of a
    global batch of `batch`: each chip's gradients are its rows' share of the batch mean's, so
    their all_reduce is the whole batch's gradient. Outputs: W1', W2', dW1, dW2 and the loss."""
    b = tt.ProgramBuilder("dp_step")
    x, t = b.input((rows, D_IN)), b.input((rows, D_OUT))
    w1, w2 = b.input((D_IN, HIDDEN)), b.input((HIDDEN, D_OUT))
    z = b.matmul(x, w1)
    a = b.relu(z)
    err = b.sub(b.matmul(a, w2), t)
    loss = b.all_reduce(b.mul(b.sum(b.sum(b.mul(err, err), 1), 0), 1.0 / batch))
    g_out = b.mul(err, 2.0 / batch)                           # dL/dy
    g_w2 = b.all_reduce(b.matmul(b.transpose(a), g_out))      # dL/dW2, summed over the chips
    g_z = b.where(b.gt(z, 0.0), b.matmul(g_out, b.transpose(w2)), 0.0)
    g_w1 = b.all_reduce(b.matmul(b.transpose(x), g_z))        # dL/dW1
    b.output(b.sub(w1, b.mul(g_w1, lr)))
    b.output(b.sub(w2, b.mul(g_w2, lr)))
    for v in (g_w1, g_w2, loss):
        b.output(v)
    return tt.Binary([b.build()])


def numpy_step(x: np.ndarray, t: np.ndarray, w1: np.ndarray, w2: np.ndarray, lr: float = LR) -> list[np.ndarray]:
    """The same step in float64 (the exact values the device's float32 rounds)."""
    x, t, w1, w2 = (v.astype(np.float64) for v in (x, t, w1, w2))
    z = x @ w1
    a = np.maximum(z, 0)
    err = a @ w2 - t
    g_out = err * 2 / len(x)
    g_w2 = a.T @ g_out
    g_z = np.where(z > 0, g_out @ w2.T, 0)
    g_w1 = x.T @ g_z
    return [w1 - lr * g_w1, w2 - lr * g_w2, g_w1, g_w2, np.array([[np.sum(err * err) / len(x)]])]


def data(exact: bool, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    shapes = ((BATCH, D_IN), (BATCH, D_OUT), (D_IN, HIDDEN), (HIDDEN, D_OUT))
    if exact:  # -1, 0, 1: every product and sum of one step is exact in float32 (below 2**24,
        # in steps of 2**-9 at the finest: the 2 / BATCH and LR scales are powers of two)
        return tuple(rng.integers(-1, 2, s).astype(np.float32) for s in shapes)
    return tuple((rng.standard_normal(s) / 4).astype(np.float32) for s in shapes)


async def one_chip(x: np.ndarray, t: np.ndarray, w1: np.ndarray, w2: np.ndarray, steps: int) -> list[np.ndarray]:
    """`steps` SGD steps on one device, the whole batch at once (its all_reduces are the identity)."""
    binary = train_step(BATCH)
    async with tt.open_device(SMALL) as device:
        xs, ts = tt.to_device(x, device), tt.to_device(t, device)
        weights = [tt.to_device(w1, device), tt.to_device(w2, device)]
        for _ in range(steps):
            outs = tt.submit(device, binary, 0, [xs, ts, *weights])
            weights = outs[:2]
        return [await tt.to_host(o) for o in outs]


async def data_parallel(spec: tt.MeshSpec, x: np.ndarray, t: np.ndarray, w1: np.ndarray, w2: np.ndarray,
                        steps: int) -> tuple[list[list[np.ndarray]], dict]:
    """`steps` SGD steps on the mesh: the batch sharded by rows, the weights replicated and
    updated on every chip. Each output per chip, and the link bytes."""
    n = spec.num_chips
    binary = train_step(BATCH // n)
    async with tt.open_mesh_device(spec) as mesh:
        xs, ts = tt.to_device(x, mesh, mapper=tt.shard(0)), tt.to_device(t, mesh, mapper=tt.shard(0))
        weights = [tt.to_device(w1, mesh), tt.to_device(w2, mesh)]  # replicated
        for _ in range(steps):
            outs = tt.submit(mesh, binary, 0, [xs, ts, *weights])
            weights = list(outs[:2])  # per-device tensors, one copy per chip: the next step's input
        per_chip = [[await tt.to_host(s) for s in tt.device_tensors(o)] for o in outs]
        return per_chip, {k: v for k, v in mesh.stats.link_bytes.items() if v}


PRESETS = ["n300", "t3000"]


def spec_of(preset: str) -> tt.MeshSpec:
    return attrs.evolve(getattr(tt.MeshSpec, preset)(), chip=SMALL)


@pytest.mark.parametrize("preset", PRESETS)
async def test_data_parallel_training_is_the_one_chip_step_bit_for_bit_when_sums_are_exact(preset: str) -> None:
    x, t, w1, w2 = data(exact=True)
    steps = 1
    per_chip, links = await data_parallel(spec_of(preset), x, t, w1, w2, steps)
    single = await one_chip(x, t, w1, w2, steps)
    want = [w1, w2]
    for _ in range(steps):
        want = numpy_step(x, t, want[0], want[1])
    names = ["W1'", "W2'", "dW1", "dW2", "loss"]
    for name, chips, one, ref in zip(names, per_chip, single, want):
        for k, got in enumerate(chips):  # every chip holds the same weights: the replicas stay in step
            np.testing.assert_array_equal(got, one, err_msg=f"{name} on chip {k}")
        np.testing.assert_array_equal(one, ref.astype(np.float32), err_msg=name)
    # Three all_reduces (dW1 32x64, dW2 64x16, the 1x1 loss), float32.
    n = spec_of(preset).num_chips
    elements = D_IN * HIDDEN + HIDDEN * D_OUT
    if n == 2:  # a line: every all_reduce moves its whole value each way
        assert links == {((0, 0), (0, 1)): steps * 4 * (elements + 1), ((0, 1), (0, 0)): steps * 4 * (elements + 1)}
    else:  # the T3000's ring: 2 (N-1)/N of each value per link (the 1x1 loss: 2 - e(p) - e(p+1))
        assert len(links) == 8 and sum(links.values()) == steps * 4 * (2 * (n - 1) * elements + 2 * n - 2)


@pytest.mark.parametrize("preset", PRESETS)
async def test_data_parallel_training_equals_the_one_chip_step_within_the_sum_tolerance(preset: str) -> None:
    x, t, w1, w2 = data(exact=False, seed=5)
    per_chip, _ = await data_parallel(spec_of(preset), x, t, w1, w2, 1)
    single = await one_chip(x, t, w1, w2, 1)
    assert single[4][0, 0] > 0.1  # a loss to learn from
    want = numpy_step(x, t, w1, w2)
    for chips in per_chip:
        assert all(np.array_equal(c, chips[0]) for c in chips)  # one result on every chip
    # The gradients' batch sums add in another order on the mesh (each chip its rows, then the
    # all_reduce): each of the BATCH - 1 additions rounds once, so the two runs differ by at most
    # 2 BATCH u sum |terms|, u = 2**-24; the terms are x^T g_z's and a^T g_out's products.
    x64, w1_64, w2_64 = (v.astype(np.float64) for v in (x, w1, w2))
    z = x64 @ w1_64
    g_out = np.abs((np.maximum(z, 0) @ w2_64 - t) * 2 / BATCH)
    terms = {"dW1": np.abs(x64).T @ (np.abs(g_out) @ np.abs(w2_64).T), "dW2": np.abs(np.maximum(z, 0)).T @ g_out}
    for index, name in ((2, "dW1"), (3, "dW2")):
        bound = 2 * BATCH * 2.0**-24 * terms[name] + 1e-7
        mesh_grad, one_grad = per_chip[index][0], single[index]
        assert np.all(np.abs(mesh_grad - one_grad) <= bound), name
        assert np.all(np.abs(one_grad - want[index]) <= bound), name
        assert np.all(np.abs(mesh_grad - want[index]) <= bound), name
    for index, name in ((0, "W1'"), (1, "W2'")):  # w - lr g: the gradients' difference, times lr
        np.testing.assert_allclose(per_chip[index][0], single[index], rtol=1e-6, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(per_chip[index][0], want[index], rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(per_chip[4][0], single[4], rtol=1e-5)
    np.testing.assert_allclose(per_chip[4][0], want[4], rtol=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
async def test_a_few_data_parallel_steps_keep_the_replicas_equal_and_the_loss_falling(preset: str) -> None:
    x, t, w1, w2 = data(exact=False, seed=5)
    steps = 4
    per_chip, _ = await data_parallel(spec_of(preset), x, t, w1, w2, steps)
    single = await one_chip(x, t, w1, w2, steps)
    want = [w1, w2]
    losses = []
    for _ in range(steps):
        want = numpy_step(x, t, want[0], want[1])
        losses.append(want[4][0, 0])
    assert losses == sorted(losses, reverse=True)  # SGD learns (the loss before each step)
    for index, chips in enumerate(per_chip):
        assert all(np.array_equal(c, chips[0]) for c in chips)  # the replicas never drift apart
        np.testing.assert_allclose(chips[0], single[index], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(chips[0], want[index], rtol=1e-4, atol=1e-6)
