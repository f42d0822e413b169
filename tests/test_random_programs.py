"""Random programs: saved and loaded unchanged, and run on the device as plain numpy says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import ttflow as tt

TILE_LAYOUTS = [
    tt.Layout(m, tl) for m in (tt.MemorySpace.DRAM, tt.MemorySpace.L1) for tl in tt.TensorLayout
]


def build(data: st.DataObject) -> tuple[tt.Program, list[np.ndarray], list[np.ndarray]]:
    """A random float32 program, its inputs, and its outputs computed here with numpy."""
    h, w = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))
    n_inputs = data.draw(st.integers(1, 3))
    r = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    b = tt.ProgramBuilder("random")
    values: list[tuple[Any, np.ndarray]] = []
    inputs = []
    for _ in range(n_inputs):
        x = r.uniform(-2, 2, (h, w)).astype(np.float32)
        inputs.append(x)
        values.append((b.input((h, w), data.draw(st.sampled_from(TILE_LAYOUTS))), x))
    for _ in range(data.draw(st.integers(1, 6))):
        v, ref = values[data.draw(st.integers(0, len(values) - 1))]
        same = [(u, a) for u, a in values if u.shape == v.shape]
        op = data.draw(st.sampled_from(
            ["add", "sub", "mul", "add_s", "mul_s", "relu", "neg", "exp", "transpose", "sum",
             "softmax", "gram", "reshape"]))
        if op in ("add", "sub", "mul"):
            u, other = same[data.draw(st.integers(0, len(same) - 1))]
            out = (getattr(b, op)(v, u), {"add": np.add, "sub": np.subtract, "mul": np.multiply}[op](ref, other))
        elif op in ("add_s", "mul_s"):
            c = data.draw(st.sampled_from([0.5, -1.25, 3.0]))
            out = (b.add(v, c), ref + np.float32(c)) if op == "add_s" else (b.mul(v, c), ref * np.float32(c))
        elif op == "relu":
            out = (b.relu(v), np.maximum(ref, 0))
        elif op == "neg":
            out = (b.neg(v), -ref)
        elif op == "exp":
            clipped = b.mul(v, 0.0)
            out = (b.exp(clipped), np.exp(ref * np.float32(0.0)))
        elif op == "transpose":
            out = (b.transpose(v), ref.T)
        elif op == "sum":
            axis = data.draw(st.sampled_from([0, 1, -1]))
            out = (b.sum(v, axis), ref.sum(axis, keepdims=True, dtype=np.float32))
        elif op == "softmax":
            e = np.exp(ref - ref.max(-1, keepdims=True))
            out = (b.softmax(v), e / e.sum(-1, keepdims=True))
        elif op == "gram":
            out = (b.matmul(v, b.transpose(v)), ref @ ref.T)
        else:
            out = (b.reshape(v, (v.shape[0] * v.shape[1], 1)), ref.reshape(-1, 1))
        values.append(out)
    chosen = data.draw(st.lists(st.integers(0, len(values) - 1), min_size=1, max_size=3))
    expected = []
    for i in chosen:
        # L1 is 64 KiB per bank on the small device: large results (a gram matrix of a long
        # reshape) go to DRAM; an L1 output that cannot fit is tested in test_runtime_errors.
        rows, cols = values[i][1].shape
        small = -(-rows // 32) * -(-cols // 32) <= 4 and rows <= 256  # padded tiles, RM pages
        layout = data.draw(st.sampled_from(TILE_LAYOUTS if small else TILE_LAYOUTS[:2]))
        b.output(values[i][0], layout)
        expected.append(values[i][1])
    return b.build(), inputs, expected


@settings(deadline=None)
@given(st.data())
def test_random_programs_round_trip_and_run(tmp_path_factory: Any, data: st.DataObject) -> None:
    program, inputs, expected = build(data)
    path = Path(tmp_path_factory.mktemp("bin")) / "p.ttb"
    tt.Binary([program]).save(path)
    (loaded,) = tt.Binary.load(path).programs
    assert loaded.same_as(program)

    async def run() -> list[np.ndarray]:
        async with tt.open_device(tt.DeviceSpec.small()) as device:
            tensors = [tt.to_device(x, device) for x in inputs]
            outs = tt.submit(device, tt.Binary([loaded]), 0, tensors)
            results = [await tt.to_host(o) for o in outs]
            del tensors, outs
        assert device.memory_used(tt.MemorySpace.L1) == 0
        return results

    for got, want in zip(anyio.run(run), expected):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-4)
