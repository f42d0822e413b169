"""The runtime as a state machine, driven through a blocking portal, against a numpy model."""

from __future__ import annotations

from typing import Any

import anyio.from_thread
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ttflow as tt
from reference import round_to

F32, BF16, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.INT32
SHAPE = (40, 33)
SPEC = tt.DeviceSpec.small()
LAYOUTS = [
    tt.Layout(m, tl) for m in (tt.MemorySpace.DRAM, tt.MemorySpace.L1) for tl in tt.TensorLayout
]


def _binary() -> tt.Binary:
    t = tt.TensorLayout.TILE
    b = tt.ProgramBuilder("scale_add")
    b.output(b.add(b.mul(b.input(SHAPE, tt.Layout(tt.MemorySpace.DRAM, t, F32)), 2.0), 1.0),
             tt.Layout(tt.MemorySpace.L1, t))
    p0 = b.build()
    b = tt.ProgramBuilder("add_to_bf16")
    x = b.input(SHAPE, tt.Layout(tt.MemorySpace.L1, t, F32))
    y = b.input(SHAPE, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.ROW_MAJOR, F32))
    b.output(b.add(x, y), tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.ROW_MAJOR, BF16))
    p1 = b.build()
    b = tt.ProgramBuilder("relu_of_bf16")
    b.output(b.relu(b.input(SHAPE, tt.Layout(tt.MemorySpace.L1, t, BF16))), tt.Layout(dtype=F32))
    p2 = b.build()
    b = tt.ProgramBuilder("int_add")
    x = b.input(SHAPE, tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.ROW_MAJOR, I32))
    b.output(b.add(x, b.input(SHAPE, tt.Layout(tt.MemorySpace.L1, t, I32))), tt.Layout(tt.MemorySpace.L1, t))
    p3 = b.build()
    return tt.Binary([p0, p1, p2, p3])


BINARY = _binary()


def _stored(value: np.ndarray, dtype: tt.DataType) -> np.ndarray:
    """What the device holds for `value` in `dtype` (float32 for floats, int64 for ints)."""
    if dtype is I32:
        return value.astype(np.int64)
    return round_to(value.astype(np.float32), "bfloat16" if dtype is BF16 else "float32")


def _footprint(buf: tt.BufferInfo) -> int:
    banks = SPEC.banks(buf.space)
    return -(-buf.num_pages // banks) * buf.aligned_page_size * banks


values = st.integers(-1000, 1000).map(lambda v: v / 8.0)


class RuntimeMachine(RuleBasedStateMachine):
    backend = "asyncio"

    def __init__(self) -> None:
        super().__init__()
        self._portal_cm = anyio.from_thread.start_blocking_portal(self.backend)
        self.portal = self._portal_cm.__enter__()
        self._device_cm = self.portal.wrap_async_context_manager(tt.open_device(SPEC))
        self.device = self._device_cm.__enter__()
        self.model: list[tuple[tt.Tensor, np.ndarray, tt.DataType]] = []

    def _call(self, fn: Any, *args: Any) -> Any:
        return self.portal.call(fn, *args)

    def _add(self, tensor: tt.Tensor, value: np.ndarray) -> None:
        self.model.append((tensor, value, tensor.dtype))

    def _pick(self, data: st.DataObject, dtypes: tuple[tt.DataType, ...], shape: Any = SHAPE) -> int:
        choices = [i for i, (t, _, d) in enumerate(self.model) if d in dtypes and t.shape == shape]
        return data.draw(st.sampled_from(choices))

    def _has(self, dtypes: tuple[tt.DataType, ...]) -> bool:
        return any(d in dtypes and t.shape == SHAPE for t, _, d in self.model)

    @rule(
        dtype=st.sampled_from([F32, BF16, I32]),
        layout=st.sampled_from(LAYOUTS),
        other_shape=st.booleans(),
        data=st.data(),
    )
    def push(self, dtype: tt.DataType, layout: tt.Layout, other_shape: bool, data: st.DataObject) -> None:
        shape = (3, 70) if other_shape else SHAPE
        fill = data.draw(st.lists(values, min_size=1, max_size=8))
        array = np.resize(np.asarray(fill), shape)
        array = np.trunc(array) if dtype is I32 else array
        host = array.astype(dtype.host_dtype)
        try:
            tensor = self._call(tt.to_device, host, self.device, layout)
        except tt.OutOfMemoryError:
            assert layout.memory is tt.MemorySpace.L1
            return
        self._add(tensor, _stored(host, dtype))

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), layout=st.sampled_from(LAYOUTS), to_bf16=st.booleans())
    def convert(self, data: st.DataObject, layout: tt.Layout, to_bf16: bool) -> None:
        i = data.draw(st.sampled_from(range(len(self.model))))
        tensor, value, dtype = self.model[i]
        target = BF16 if (to_bf16 and dtype is not I32) else dtype
        layout = tt.Layout(layout.memory, layout.tensor_layout, target)
        self._add(self._call(tt.to_layout, tensor, layout), _stored(value, target))

    @precondition(lambda self: self._has((F32, BF16)))
    @rule(data=st.data())
    def scale_add(self, data: st.DataObject) -> None:
        tensor, value, _ = self.model[self._pick(data, (F32, BF16))]
        (out,) = self._call(tt.submit, self.device, BINARY, 0, [tensor])
        self._add(out, value * np.float32(2.0) + np.float32(1.0))

    @precondition(lambda self: self._has((F32, BF16)))
    @rule(data=st.data())
    def add_to_bf16(self, data: st.DataObject) -> None:
        (a, va, _), (b, vb, _) = (self.model[self._pick(data, (F32, BF16))] for _ in range(2))
        (out,) = self._call(tt.submit, self.device, BINARY, 1, [a, b])
        self._add(out, _stored(va + vb, BF16))

    @precondition(lambda self: self._has((F32, BF16)))
    @rule(data=st.data())
    def relu_of_bf16(self, data: st.DataObject) -> None:
        tensor, value, _ = self.model[self._pick(data, (F32, BF16))]
        (out,) = self._call(tt.submit, self.device, BINARY, 2, [tensor])
        self._add(out, np.maximum(_stored(value, BF16), 0))

    @precondition(lambda self: self._has((I32,)))
    @rule(data=st.data())
    def int_add(self, data: st.DataObject) -> None:
        (a, va, _), (b, vb, _) = (self.model[self._pick(data, (I32,))] for _ in range(2))
        (out,) = self._call(tt.submit, self.device, BINARY, 3, [a, b])
        self._add(out, va + vb)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(range(len(self.model))))
        tensor, _, dtype = self.model[i]
        fill = data.draw(st.lists(values, min_size=1, max_size=4))
        host = np.resize(np.trunc(np.asarray(fill)), tensor.shape).astype(dtype.host_dtype)
        self._call(tt.write, tensor, host)
        self.model[i] = (tensor, _stored(host, dtype), dtype)

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def deallocate(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(range(len(self.model))))
        tensor, _, _ = self.model.pop(i)
        self._call(tt.deallocate, tensor)
        with pytest.raises(tt.DeallocatedTensorError):
            self._call(tt.submit, self.device, BINARY, 0, [tensor])

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def to_host(self, data: st.DataObject) -> None:
        tensor, value, dtype = self.model[data.draw(st.sampled_from(range(len(self.model))))]
        try:
            got = self._call(tt.to_host, tensor)
        except tt.OutOfMemoryError:
            return self._drop_failed()
        assert got.dtype == dtype.host_dtype and got.shape == value.shape
        np.testing.assert_array_equal(got.astype(value.dtype), value)

    def _drop_failed(self) -> None:
        """A program whose L1 output did not fit fails its tensor; the model forgets it."""
        keep = []
        for tensor, value, dtype in self.model:
            try:
                self._call(tt.wait, tensor)
                keep.append((tensor, value, dtype))
            except tt.OutOfMemoryError:
                self._call(tt.deallocate, tensor)
        self.model = keep

    @invariant()
    def memory_is_accounted_for(self) -> None:
        self._drop_failed()  # waits for all queued work
        l1 = self.device.memory_used(tt.MemorySpace.L1)
        assert l1 <= SPEC.l1_banks * SPEC.l1_bank_bytes
        assert self.device.stats.l1_peak_bytes <= SPEC.l1_banks * SPEC.l1_bank_bytes
        for space in tt.MemorySpace:
            expected = sum(_footprint(buf) for t, _, _ in self.model for _, buf in t.storages if buf.space is space)
            assert self.device.memory_used(space) == expected

    def teardown(self) -> None:
        try:
            for tensor, _, _ in self.model:
                self._call(tt.deallocate, tensor)
            self.model.clear()
            for space in tt.MemorySpace:
                assert self.device.memory_used(space) == 0
        finally:
            self._device_cm.__exit__(None, None, None)
            self._portal_cm.__exit__(None, None, None)


class TrioRuntimeMachine(RuntimeMachine):
    backend = "trio"


TestRuntimeAsyncio = RuntimeMachine.TestCase
TestRuntimeAsyncio.settings = settings(stateful_step_count=25)
TestRuntimeTrio = TrioRuntimeMachine.TestCase
TestRuntimeTrio.settings = settings(stateful_step_count=25)
