"""ttflow.testing: its public surface, and its reference model checked against the device."""

from __future__ import annotations

import subprocess
import sys
import anyio
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ttflow as tt
import ttflow.testing as ttt

PUBLIC = {
    # strategies
    "device_specs", "dtypes", "layouts", "shapes", "arrays", "arrays_for", "program_cases",
    "programs", "binaries", "ProgramCase", "FLOAT_MAGNITUDE", "INT_RANGE",
    # the reference model
    "stored", "ExpectedValue", "round_as", "bfloat8_b_error_bound", "storage_geometry",
    "StorageGeometry", "buffer_footprint", "space_capacity", "ordered_sums",
    # the state machine and its tools
    "RuntimeStateMachine", "MeshStateMachine", "ModelProgram", "DeviceModel", "ModelTensor", "drain",
    "WorkerThreadHold", "QueueHold", "hold_worker_threads",
}
F32, BF16, BF8, I32, U32 = (tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B,
                            tt.DataType.INT32, tt.DataType.UINT32)


def test_public_surface_is_pinned() -> None:
    assert set(ttt.__all__) == PUBLIC
    for name in PUBLIC:
        obj = getattr(ttt, name)
        if hasattr(obj, "__module__") and not isinstance(obj, (tuple, dict)):
            assert obj.__module__.startswith("ttflow.testing."), name
    exported = {n for n in vars(ttt) if not n.startswith("_")}
    assert exported == PUBLIC, exported ^ PUBLIC


def test_ordered_sums_adds_in_the_documented_order() -> None:
    """docs/mesh.md, "Sums": on a ring the part of position h is x[h+1] + ... + x[h-1], then
    + x[h]; on a line ((x[0] + ... + x[h-1]) + x[h]) + (x[N-1] + ... + x[h+1]). The terms are
    names and `add` writes the sum out, so the order itself is compared."""
    def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.array(f"({a.item()}+{b.item()})")

    path = ["a", "b", "c", "d"]
    terms = {chip: {home: np.array(chip) for home in path} for chip in path}
    assert {h: str(v) for h, v in ttt.ordered_sums(path, True, terms, add).items()} == {
        "a": "(((b+c)+d)+a)", "b": "(((c+d)+a)+b)", "c": "(((d+a)+b)+c)", "d": "(((a+b)+c)+d)"}
    assert {h: str(v) for h, v in ttt.ordered_sums(path, False, terms, add).items()} == {
        "a": "(a+((d+c)+b))", "b": "((a+b)+(d+c))", "c": "(((a+b)+c)+d)", "d": "(((a+b)+c)+d)"}


def test_without_hypothesis_the_import_error_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['hypothesis'] = None\n"
        "try:\n    import ttflow.testing\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert 'pip install -e ".[test]"' in out.stdout
    plain = subprocess.run([sys.executable, "-c", "import sys; sys.modules['hypothesis'] = None; import ttflow"],
                           capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr  # ttflow itself does not need it


# -- BFLOAT8_B: the bound against the kernels -------------------------------------------------


@st.composite
def bfp8_inputs(draw: st.DrawFn) -> np.ndarray:
    """float32 arrays whose face rows mix magnitudes: zeros, subnormals, values at the clamp."""
    h, w = draw(st.integers(1, 40)), draw(st.integers(1, 70))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["spread", "clamp", "ties", "tiny"]))
    sign = np.where(rng.uniform(size=(h, w)) < 0.5, -1.0, 1.0)
    if kind == "spread":
        x = rng.uniform(0.5, 1.0, (h, w)) * np.exp2(rng.integers(-40, 40, (h, w)))
    elif kind == "clamp":  # significands just below 2: r just below 128
        x = (2.0 - rng.uniform(0, 2**-6, (h, w))) * np.exp2(rng.integers(-3, 3, (h, w)))
    elif kind == "ties":  # exactly representable halves at 7 bits
        x = (64 + rng.integers(0, 64, (h, w)) + 0.5) * 2.0**-6
    else:  # around the subnormal boundary
        x = rng.uniform(0, 4, (h, w)) * 2.0**-127
    values = (sign * x).astype(np.float32)
    values[rng.uniform(size=(h, w)) < 0.1] = 0.0
    return values


@settings(deadline=None)
@given(bfp8_inputs())
def test_bfloat8_b_bound_holds_for_the_kernels_and_is_below_one_unit(x: np.ndarray) -> None:
    got = tt.kernels.unpack_bfloat8_b(tt.kernels.pack_bfloat8_b(x), x.shape).astype(np.float64)
    bound = ttt.bfloat8_b_error_bound(x)
    error = np.abs(got - x.astype(np.float64))
    assert (error <= bound).all(), np.argwhere(error > bound)[:3]
    ttt.stored(x, BF8).check(got.astype(np.float32))
    # Below one unit of the row's shared exponent, except for subnormals (flushed: error |x|).
    normal = np.abs(x) >= np.finfo(np.float32).tiny
    unit = ttt._reference._row_unit(np.abs(x))
    assert (bound[normal] < unit[normal]).all()


def test_bfloat8_b_bound_is_tight() -> None:
    # r just below 128 clamps to 127 (error r - 127), a 7-bit tie rounds by exactly half a unit.
    x = np.array([[2.0 - 2.0**-20] + [0.0] * 15, [1.0 + 2.0**-7] + [1.5] * 15], np.float32)
    got = tt.kernels.unpack_bfloat8_b(tt.kernels.pack_bfloat8_b(x), x.shape).astype(np.float64)
    error = np.abs(got - x.astype(np.float64))
    bound = ttt.bfloat8_b_error_bound(x)
    assert error[0, 0] == bound[0, 0] and error[0, 0] > 0.99 * 2.0**-6
    assert abs(error[1, 0] - 2.0**-7) < 1e-12 and error[1, 0] <= bound[1, 0] < error[1, 0] * 1.0001


# -- stored and ExpectedValue ------------------------------------------------------------------


def test_stored_is_exact_for_float32_bfloat16_and_the_integers() -> None:
    x = np.array([1.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -3.3], np.float32)
    assert ttt.stored(x, F32).exact and np.array_equal(ttt.stored(x, F32).lo, x)
    b = ttt.stored(x, BF16)
    assert b.exact
    np.testing.assert_array_equal(b.lo, x.astype(ml_dtypes.bfloat16).astype(np.float64))
    assert b.lo[1] == 1.0 and b.lo[2] == 1.0 + 2.0**-6  # ties to even, both ways
    i = ttt.stored(np.array([-(2**31), 2**31 - 1], np.int64), I32)
    assert i.exact and i.lo.dtype == np.int64
    with pytest.raises(ValueError, match="range"):
        ttt.stored(np.array([-1]), U32)
    with pytest.raises(ValueError, match="finite"):
        ttt.stored(np.array([np.inf], np.float32), BF16)


def test_expected_value_map_and_check() -> None:
    x = ttt.stored(np.array([[1.5, -2.0], [0.25, 3.0]], np.float32), BF8)
    assert not x.exact
    y = x.map(lambda a: np.maximum(a * np.float32(2), np.float32(0)), dtype=F32)
    assert (y.lo <= y.hi).all() and (y.lo >= 0).all()
    y.check(np.array([[3.0, 0.0], [0.5, 6.0]], np.float32))
    with pytest.raises(AssertionError, match=r"at \(0, 0\).*within"):
        y.check(np.array([[3.5, 0.0], [0.5, 6.0]], np.float32))
    with pytest.raises(AssertionError, match="shape"):
        y.check(np.zeros((2, 3), np.float32))
    with pytest.raises(AssertionError, match="float32"):
        y.check(np.zeros((2, 2), ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="non-decreasing"):
        x.map(lambda a: -a)
    ints = ttt.ExpectedValue.exactly(np.array([2**31 - 1]), I32)
    assert ints.map(np.add, ints).lo[0] == -2  # wraps like the device
    assert ttt.round_as(np.array([1.0 + 2.0**-9], np.float32), BF16)[0] == 1.0


# -- memory geometry against the device --------------------------------------------------------


@settings(deadline=None, max_examples=25)
@given(ttt.device_specs(), st.data())
def test_storage_geometry_and_footprint_match_the_device(spec: tt.DeviceSpec, data: st.DataObject) -> None:
    shape = data.draw(ttt.shapes(max_dims=3, max_side=40))
    layout = data.draw(ttt.layouts(memory=tt.MemorySpace.DRAM))
    array = data.draw(ttt.arrays_for(layout, shape))

    async def run() -> None:
        async with tt.open_device(spec) as device:
            t = tt.to_device(array, device, layout)
            got = await tt.to_host(t)
            ttt.stored(array, layout.dtype).check(got)  # type: ignore[arg-type]
            geometry = ttt.storage_geometry(shape, layout, spec)
            buffer = t.buffer
            assert buffer is not None
            assert (buffer.page_size, buffer.aligned_page_size, buffer.num_pages) == (
                geometry.page_size, geometry.aligned_page_size, geometry.num_pages)
            assert ttt.buffer_footprint(buffer, spec) == geometry.footprint
            assert device.memory_used(tt.MemorySpace.DRAM) == geometry.footprint
            assert device.memory_free(tt.MemorySpace.L1) == ttt.space_capacity(spec, tt.MemorySpace.L1)

    anyio.run(run)


# -- strategies ----------------------------------------------------------------------------------


@given(ttt.layouts(), ttt.layouts(BF8), ttt.layouts(keep_dtype=True))
def test_layouts_are_valid(any_layout: tt.Layout, bfp8: tt.Layout, keep: tt.Layout) -> None:
    assert any_layout.dtype is not None
    assert bfp8.dtype is BF8 and bfp8.tensor_layout is tt.TensorLayout.TILE
    assert keep.dtype is None
    with pytest.raises(ValueError):
        ttt.layouts(BF8, tensor_layout=tt.TensorLayout.ROW_MAJOR)


@settings(deadline=None)
@given(st.data())
def test_arrays_fit_their_dtype(data: st.DataObject) -> None:
    dtype = data.draw(ttt.dtypes())
    shape = data.draw(st.sampled_from([(3,), (5, 7), (40, 33), (2, 3, 70)]))
    a = data.draw(ttt.arrays(dtype, shape))
    assert a.shape == shape and a.dtype == dtype.host_dtype
    values = a.astype(np.float64)
    if dtype.is_float:
        low, high = ttt.FLOAT_MAGNITUDE
        nonzero = np.abs(values[values != 0])
        assert np.isfinite(values).all() and ((nonzero >= low) & (nonzero <= high)).all()
    else:
        low_i, high_i = ttt.INT_RANGE[dtype]
        assert values.min() >= low_i and values.max() <= high_i


@settings(deadline=None, max_examples=10)
@given(ttt.programs(max_side=8, max_steps=3))
def test_programs_are_built_programs(program: tt.Program) -> None:
    assert isinstance(program, tt.Program) and program.inputs and program.output_specs


# -- drain and hold_worker_threads --------------------------------------------------------------


@pytest.mark.anyio
async def test_hold_worker_threads_keeps_a_large_write_in_flight_until_released() -> None:
    big = np.ones((256, 512), np.float32)  # 512 KiB: written on a worker thread
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        async with ttt.hold_worker_threads() as hold:
            assert hold.held
            t = tt.to_device(big, device, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE))
            small = tt.to_device(np.ones(4, np.float32), device)  # behind it on CQ1
            for _ in range(20):
                await anyio.sleep(0)
            assert not t.done() and not small.done()
        await ttt.drain(device)
        assert t.done() and small.done()
        np.testing.assert_array_equal(await tt.to_host(t), big)
        tt.deallocate(t)
        tt.deallocate(small)
        assert device.memory_used(tt.MemorySpace.DRAM) == 0


@pytest.mark.anyio
async def test_drain_waits_for_work_nobody_holds() -> None:
    async with tt.open_device(tt.DeviceSpec.small()) as device:
        x = tt.to_device(np.ones((64, 64), np.float32), device)
        converted = tt.to_layout(x, tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE))
        tt.deallocate(converted)  # freed once the conversion ran
        await ttt.drain(device)
        tt.deallocate(x)
        assert device.memory_used(tt.MemorySpace.DRAM) == 0
        assert device.memory_used(tt.MemorySpace.L1) == 0


def test_model_tensor_outcomes_follow_their_inputs() -> None:
    model = ttt.DeviceModel(tt.DeviceSpec.small())

    class Fake:
        shape, dtype = (1,), F32

    value = ttt.ExpectedValue.exactly(np.zeros(1, np.float32), F32)
    layout = tt.Layout(dtype=F32)
    a = model.track(Fake(), layout, value, may_fail=True)  # type: ignore[arg-type]
    b = model.track(Fake(), layout, value, parents=(a,))  # type: ignore[arg-type]
    c = model.track(Fake(), layout, value, fails_with=tt.OutOfMemoryError)  # type: ignore[arg-type]
    assert b.outcomes() == (True, frozenset({tt.OutOfMemoryError}))
    assert c.outcomes() == (False, frozenset({tt.OutOfMemoryError}))
    b.record(tt.OutOfMemoryError(tt.MemorySpace.L1, 1, 0))
    assert a.known_failed and b.known_failed  # only `a` could fail `b`
    with pytest.raises(AssertionError, match="should have failed"):
        c.record(None)
    with pytest.raises(AssertionError, match="DeallocatedTensorError"):
        model.track(Fake(), layout, value).record(tt.DeallocatedTensorError("x"))  # type: ignore[arg-type]


def test_the_missing_hypothesis_message_names_no_other_project() -> None:
    # "ttflow" on PyPI is an unrelated project: no install line may name it.
    code = (
        "import sys; sys.modules['hypothesis'] = None\n"
        "try:\n    import ttflow.testing\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "ttflow[" not in out.stdout and "pip install hypothesis" in out.stdout
