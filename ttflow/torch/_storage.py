"""The value behind each tt storage: one table, keyed by the storage's (never dereferenced) address.

A tt tensor is a plain torch tensor whose storage the C++ allocator made (see `_guard.cpp`). Its
elements live on the emulated device as one ttflow tensor per storage, the storage's `Slot`:
`value` is a `Pending` cell whose ttflow tensor holds all `numel` elements of the storage in
order, shaped `shape` (a device shape: rank >= 2). So a tensor that covers its whole storage in
order (the common case: every op output, every parameter) reads the slot's value directly, and
a reshape of it is a device reshape; a transposed view is a device permute; anything else (a
slice, a strided view, an offset) goes through the host, as the element order requires.

Every device call is posted to the session's loop thread, in order (see `_session`). Slots may
share one cell (a copy between tt tensors shares the immutable value). When torch frees a
storage, its address is drained from the guard's freed list on the next table access and its
slot dropped; a cell no slot holds any more releases its ttflow tensor on the loop thread.
"""

from __future__ import annotations

import collections
import ctypes
import math
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import torch

import ttflow as tt

from ._errors import UnsupportedOpError
from ._guard import load_guard
from ._lower import device_dtype, device_shape
from ._session import MAX_DEVICES, Pending, session

__all__ = [
    "Slot", "call_index", "constant", "device_dtype", "device_of", "device_shape", "drain_freed", "fill", "host_value",
    "index_of", "live_slots",
    "new_tensor", "on_device", "post_program", "read", "seeds", "synchronize", "upload", "write",
    "write_host",
]

_LAYOUTS = {d: tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, d)
            for d in (tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.INT32)}


def on_device(dtype: torch.dtype) -> bool:
    """Whether tensors of `dtype` keep their values on the device (others stay on the host)."""
    try:
        device_dtype(dtype)
    except UnsupportedOpError:
        return False
    return True


class Slot:
    """The device value of one tt storage (see the module docstring).

    A storage of a dtype the device has no type for (float64, float16, complex: the device has
    none) keeps its elements on the host instead, in `host`, so that everything torch does with
    tt tensors (printing converts to float64) works; ops on it run on the CPU, with the warning
    each CPU op gives once.
    """

    __slots__ = ("device", "dtype", "host", "shape", "value")

    def __init__(self, value: Pending | None, shape: tuple[int, ...], dtype: torch.dtype,
                 device: tt.Device) -> None:
        self.value = value  # None: never written; reads as zeros
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.host: torch.Tensor | None = None  # the elements, flat, for a dtype the device lacks


_slots: dict[int, Slot] = {}
_FREED_CAPACITY = 4096
_freed_buffer = (ctypes.c_uint64 * _FREED_CAPACITY)()
_take_freed: Any = None


_drain_lock = threading.Lock()  # one drain at a time: the ctypes call fills one shared buffer


def drain_freed() -> None:
    """Drops the slots of the storages torch has freed since the last drain (their values are
    then released on the loop thread). Any thread may drain: the addresses are taken under a
    lock (the foreign call releases the GIL, and a second drain would overwrite the buffer
    before the first had read it, leaking those slots' device values)."""
    global _take_freed
    if _take_freed is None:
        library = ctypes.CDLL(str(load_guard()))
        _take_freed = library.ttflow_take_freed
        _take_freed.restype = ctypes.c_size_t
        _take_freed.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    with _drain_lock:
        n = _take_freed(_freed_buffer, _FREED_CAPACITY)
        if not n:
            return
        freed = _freed_buffer[:n]
        while n == _FREED_CAPACITY:
            n = _take_freed(_freed_buffer, _FREED_CAPACITY)
            freed += _freed_buffer[:n]
    for address in freed:  # outside the lock: a slot's value may post its release
        _slots.pop(address, None)


def live_slots() -> int:
    """How many tt storages hold a device value (for tests: nothing leaks)."""
    drain_freed()
    return len(_slots)


def _address(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def device_of(t: torch.Tensor) -> tt.Device:
    """The open ttflow device behind a tt tensor."""
    device = session.device(t.device.index)
    device.check_open()
    return device


def _slot(t: torch.Tensor) -> Slot:
    # No drain here: addresses are never reused, so a freed storage's slot is never found again.
    address = _address(t)
    slot = _slots.get(address)
    if slot is not None and slot.device.closed:
        raise tt.DeviceClosedError(
            f"this {t.device} tensor's device was closed (ttflow.torch.close()); its value went "
            "with it: move tensors to the CPU before closing"
        )
    if slot is None:
        device = device_of(t)
        numel = t.untyped_storage().nbytes() // t.element_size()
        slot = Slot(None, device_shape((numel,)), t.dtype, device)
        if address:  # every empty storage has address 0: none of them keeps a slot
            _slots[address] = slot
    return slot


_TT: list[torch.device] = []  # torch.device("tt", i), made once ("tt" exists once ttflow.torch is installed)


def _tt(index: int) -> torch.device:
    if not _TT:
        _TT.extend(torch.device("tt", i) for i in range(MAX_DEVICES))
    return _TT[index]


def index_of(device: Any) -> int:
    """The tt device index a `device=` argument names: its index, or for `"tt"` (or none at all)
    the current tt device's (`torch.tt.set_device`, `with torch.tt.device(i)`), as for CUDA."""
    if isinstance(device, torch.device) and device.type == "tt" and device.index is not None:
        return device.index
    return torch.accelerator.current_device_index()


def call_index(values: Sequence[Any]) -> int:
    """The tt device a call's result goes to: its first tt tensor's, else its tt `device=`
    argument's (a factory, `torch.tril_indices(3, 3, device="tt:1")`), else the current one's."""
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type == "tt":
            return value.device.index  # type: ignore[no-any-return]
    return index_of(next((v for v in values if isinstance(v, torch.device) and v.type == "tt"), None))


def new_tensor(shape: Sequence[int], dtype: torch.dtype, device_index: int | None,
               value: Pending | None, value_shape: tuple[int, ...] | None = None,
               drain: bool = True) -> torch.Tensor:
    """A fresh contiguous tt tensor whose storage holds `value` (a device tensor of `value_shape`,
    by default `device_shape(shape)`). `drain=False`: the caller has just drained the freed
    storages (one drain for a call's outputs)."""
    t = torch.empty(shape, dtype=dtype, device=_tt(device_index or 0))
    if t.numel():
        if drain:
            drain_freed()
        _slots[t.untyped_storage().data_ptr()] = Slot(value, value_shape or device_shape(shape), dtype,
                                                      session.device(device_index))
    return t


# -- device programs ---------------------------------------------------------------------------------

_PROGRAMS: dict[Hashable, tt.Binary] = {}


def run_program(key: Hashable, build: Callable[[], tt.Program], device: tt.Device,
                inputs: Sequence[Pending]) -> list[Pending]:
    """Posts a run of the program built once per `key`; its outputs as cells."""
    binary = _PROGRAMS.get(key)
    if binary is None:
        binary = _PROGRAMS[key] = tt.Binary([build()])
    return post_program(device, binary, 0, inputs, len(binary.programs[0].outputs))


def post_program(device: tt.Device, binary: tt.Binary, index: int, inputs: Sequence[Pending],
                 outputs: int) -> list[Pending]:
    cells = [Pending() for _ in range(outputs)]
    session.post(_submit, device, binary, index, list(inputs), cells)
    return cells


def _submit(device: tt.Device, binary: tt.Binary, index: int, inputs: list[Pending],
            cells: list[Pending]) -> None:
    try:
        values = tt.submit(device, binary, index, [c.get() for c in inputs])
    except BaseException as exc:  # noqa: BLE001 - kept for the call that waits
        for cell in cells:
            cell.error = exc
        return
    for cell, value in zip(cells, values):
        cell.value = value


def _reshape(device: tt.Device, cell: Pending, dtype: tt.DataType, shape: tuple[int, ...],
             target: tuple[int, ...]) -> Pending:
    if shape == target:
        return cell

    def build() -> tt.Program:
        b = tt.ProgramBuilder("reshape")
        b.output(b.reshape(b.input(shape, _LAYOUTS[dtype]), target), _LAYOUTS[dtype])
        return b.build()

    return run_program(("reshape", dtype, shape, target), build, device, [cell])[0]


def _permute(device: tt.Device, cell: Pending, dtype: tt.DataType, shape: tuple[int, ...],
             axes: tuple[int, ...]) -> Pending:
    def build() -> tt.Program:
        # The value lives in its device shape; the permute is of its torch shape `shape`.
        b = tt.ProgramBuilder("permute")
        x = b.input(device_shape(shape), _LAYOUTS[dtype])
        permuted = b.permute(x if x.shape == shape else b.reshape(x, shape), axes)
        result = device_shape(tuple(shape[a] for a in axes))
        b.output(permuted if permuted.shape == result else b.reshape(permuted, result), _LAYOUTS[dtype])
        return b.build()

    return run_program(("permute", dtype, shape, axes), build, device, [cell])[0]


def _zeros(slot: Slot) -> Pending:
    cell = Pending()
    session.post(_empty, cell, slot.shape, device_dtype(slot.dtype), slot.device)
    slot.value = cell
    return cell


def _empty(cell: Pending, shape: tuple[int, ...], dtype: tt.DataType, device: tt.Device) -> None:
    try:
        cell.value = tt.empty(shape, dtype, device, _LAYOUTS[dtype])
    except BaseException as exc:  # noqa: BLE001 - kept for the call that waits
        cell.error = exc


_IDENTITY = [tuple(range(n)) for n in range(8)]


def _covers_in_order(t: torch.Tensor) -> bool:
    """Whether a contiguous `t` is its whole storage (what `_order` says of it, sooner)."""
    return not t.storage_offset() and t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _in_order(t: torch.Tensor) -> bool:
    """Whether `t` is its whole storage in order: its value is the storage's, reshaped."""
    return _covers_in_order(t) if t.is_contiguous() else _order(t) == tuple(range(t.dim()))


def _order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dims of `t` from outermost to innermost in memory, if `t` covers its storage densely
    from offset 0 (a permutation of a contiguous tensor); else None."""
    if t.storage_offset() != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
        return None
    if t.is_contiguous():
        return _IDENTITY[t.dim()] if t.dim() < len(_IDENTITY) else tuple(range(t.dim()))
    strides = t.stride()
    dims = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(dims):
        if t.shape[d] != 1 and strides[d] != expected:
            return None
        expected *= t.shape[d]
    return tuple(dims)


def read(t: torch.Tensor) -> Pending:
    """A cell holding `t`'s elements on the device, shaped `device_shape(t.shape)`, in `t`'s device
    dtype; posts a reshape, a permute or a host round trip when the view needs one."""
    slot = _slots.get(t.untyped_storage().data_ptr())
    if (slot is not None and slot.value is not None and t.dtype is slot.dtype and not t.storage_offset()
            and t.is_contiguous() and device_shape(t.shape) == slot.shape and not slot.device.closed):
        return slot.value  # the common case (an op's output, a parameter): the stored value as it is
    return _read(t)


def _read(t: torch.Tensor) -> Pending:
    if t.dtype != (slot := _slot(t)).dtype:
        _retype(slot, t.dtype)
    if not on_device(t.dtype):
        raise UnsupportedOpError(f"the tt device has no {t.dtype} type (such tensors stay on the host)")
    cell = slot.value if slot.value is not None else _zeros(slot)
    dtype = device_dtype(t.dtype)
    order = _order(t)
    if order is None:
        return upload(host_value(t), slot.device)
    if order == tuple(range(t.dim())):
        return _reshape(slot.device, cell, dtype, slot.shape, device_shape(t.shape))
    # A permuted view (e.g. `.T`): the storage holds the tensor with dims in `order`.
    stored = tuple(t.shape[d] for d in order)
    cell = _reshape(slot.device, cell, dtype, slot.shape, device_shape(stored))
    axes = tuple(order.index(d) for d in range(t.dim()))
    if len(stored) < 2:
        return cell
    return _permute(slot.device, cell, dtype, stored, axes)


def write(t: torch.Tensor, value: Pending, shape: tuple[int, ...], drain: bool = True) -> None:
    """Makes `value` (a device tensor of `shape`, holding `t`'s elements in `t`'s logical order)
    the content of `t`: the storage's new value when `t` covers it in order, else through the host.
    `drain=False`: the caller has just drained the freed storages (one drain for many writes)."""
    if drain:
        drain_freed()  # storages torch freed let go of their values (as new_tensor does)
    slot = _slots.get(t.untyped_storage().data_ptr())
    if slot is None or slot.device.closed:
        slot = _slot(t)  # makes the slot, or says the device is closed
    if t.dtype is slot.dtype and _in_order(t):
        slot.value, slot.shape = value, shape
        return
    array = session.call(_fetch, value)
    write_host(t, torch_from_host(array, t.dtype).reshape(t.shape))


def write_host(t: torch.Tensor, source: torch.Tensor) -> None:
    """Writes a CPU tensor's values into the tt tensor `t` (any view), through the host."""
    slot = _slot(t)
    if t.dtype != slot.dtype:
        _retype(slot, t.dtype)
    if not on_device(slot.dtype):
        storage = _storage_on_host(slot)
        torch.as_strided(storage, t.shape, t.stride(), t.storage_offset()).copy_(source)
        slot.host = storage
        return
    if _in_order(t):  # `x.to("tt")`, a parameter loaded: the new value, uploaded as it is
        shape = device_shape(t.shape)
        slot.value, slot.shape = upload(source.to(t.dtype).reshape(shape), slot.device), shape
        return
    storage = _storage_on_host(slot)
    view = torch.as_strided(storage, t.shape, t.stride(), t.storage_offset())
    view.copy_(source)
    slot.value, slot.shape = upload(storage.reshape(device_shape(storage.shape)), slot.device), device_shape(storage.shape)


def _storage_on_host(slot: Slot) -> torch.Tensor:
    numel = math.prod(slot.shape)
    if slot.host is not None:
        return slot.host
    if slot.value is None:
        return torch.zeros(numel, dtype=slot.dtype)
    return torch_from_host(session.call(_fetch, slot.value), slot.dtype).reshape(numel)


def _retype(slot: Slot, dtype: torch.dtype) -> None:
    """The storage's bytes, reinterpreted as `dtype` from now on (as torch.load does: it fills a
    byte storage, then views it as the tensor's dtype)."""
    flat = _host_storage_as(slot, dtype).clone()
    slot.dtype, slot.host, slot.value = dtype, None, None
    slot.shape = device_shape(flat.shape)
    if on_device(dtype):
        slot.value = upload(flat.reshape(slot.shape), slot.device)
    else:
        slot.host = flat


def _host_storage_as(slot: Slot, dtype: torch.dtype) -> torch.Tensor:
    storage = _storage_on_host(slot)
    if dtype == slot.dtype:
        return storage
    return storage.view(torch.uint8).view(dtype)


def host_value(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements copied to a new CPU tensor (waits for the device). A conjugated or
    negated view (`x.conj()` of a complex tensor: a flag, no copy) gives its values so."""
    slot = _slot(t)
    storage = _host_storage_as(slot, t.dtype)
    value = torch.as_strided(storage, t.shape, t.stride(), t.storage_offset()).clone()
    if t.is_conj():
        value = value.conj_physical()
    if t.is_neg():
        value = value.neg()
    return value


async def _fetch(cell: Pending) -> np.ndarray[Any, Any]:
    return await tt.to_host(cell.get())


def upload(host: torch.Tensor, device: tt.Device) -> Pending:
    """Posts a copy of a CPU tensor to the device; its value shaped `device_shape(host.shape)`."""
    array = host_array(host)
    shape = device_shape(array.shape)
    if array.shape != shape:
        array = array.reshape(shape)
    cell = Pending()
    session.post(_to_device, cell, array, device, _LAYOUTS[device_dtype(host.dtype)])
    return cell


class _Constants:
    """Device values written once and shared while recently used, per device (a device's id
    may be reused after it closes: an entry remembers its device and is only its own)."""

    def __init__(self, capacity: int) -> None:
        self._entries: collections.OrderedDict[Hashable, tuple[tt.Device, Pending]] = collections.OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()  # a lookup and its move to the end, against another's eviction

    def get(self, key: Hashable, device: tt.Device, make: Callable[[], torch.Tensor]) -> Pending:
        full_key = (id(device), key)
        with self._lock:
            entry = self._entries.get(full_key)
            if entry is not None and entry[0] is device:
                self._entries.move_to_end(full_key)
                return entry[1]
        cell = upload(make(), device)
        with self._lock:
            self._entries[full_key] = (device, cell)
            if len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return cell


_constants = _Constants(256)


def constant(values: tuple[float | int, ...], dtype: torch.dtype, device: tt.Device) -> Pending:
    """A small device vector of these values (one element: a (1, 1) scalar), written once and
    kept while recently used: how Python numbers reach programs as inputs, so a changing
    learning rate is a new value, not a new program."""
    return _constants.get((dtype, values), device, lambda: torch.tensor(values, dtype=dtype))


_FILLS_MAX_NUMEL = 4096
_fills = _Constants(64)


def fill(t: torch.Tensor, value: float | bool) -> bool:
    """`t.fill_(value)` (what `torch.ones_like`, `zeros_like` and `zero_()` do) for a small
    floating tensor that is its whole storage: its value becomes a device constant of that
    shape, written once and shared while recently used (values are immutable: a later write
    replaces the storage's value, never the constant). `loss.backward()` fills its seed
    gradient this way each step without running a program. False (nothing done) otherwise."""
    if t.numel() == 0:
        return True  # no elements: nothing to fill (the device holds no empty values)
    if (t.dtype not in (torch.float32, torch.bfloat16) or not isinstance(value, (int, float))
            or t.numel() > _FILLS_MAX_NUMEL or not _in_order(t)):
        return False
    slot = _slot(t)
    if slot.dtype is not t.dtype:
        return False
    shape = device_shape(t.shape)
    slot.value = _fills.get((t.dtype, shape, float(value)), slot.device,
                            lambda: torch.full(shape, value, dtype=t.dtype))
    slot.shape = shape
    return True


def seeds(count: int, device: tt.Device) -> list[Pending]:
    """`count` fresh (1, 1) INT32 seeds for a program's random ops, drawn from torch's default
    generator, so `torch.manual_seed` reproduces a run's dropout masks."""
    if not count:
        return []
    drawn = torch.randint(0, 2**31 - 1, (count,), dtype=torch.int32).tolist()
    return [upload(torch.tensor([[seed]], dtype=torch.int32), device) for seed in drawn]


def _to_device(cell: Pending, array: np.ndarray[Any, Any], device: tt.Device, layout: tt.Layout) -> None:
    try:
        cell.value = tt.to_device(array, device, layout)
    except BaseException as exc:  # noqa: BLE001 - kept for the call that waits
        cell.error = exc


def host_array(t: torch.Tensor) -> np.ndarray[Any, Any]:
    """A CPU tensor as a numpy array of its device dtype (a copy: the upload runs later)."""
    t = t.detach()
    if t._is_zerotensor():  # autograd's known-zero gradient (`sgn`'s): it holds no elements
        t = torch.zeros(t.shape, dtype=t.dtype)
    if t.layout != torch.strided:
        raise UnsupportedOpError(f"a {t.layout} tensor: the tt device holds dense (strided) tensors only")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    if t.dtype == torch.float32:
        return t.numpy().copy()
    if t.dtype.is_floating_point or t.dtype.is_complex:
        device_dtype(t.dtype)  # raises: the device has no such type
    if t.dtype == torch.int64 and t.numel() and _outside_int32(t):
        raise UnsupportedOpError("an int64 tensor with values outside int32's range cannot live on the tt device")
    return t.to(torch.int32).numpy().copy()


def _outside_int32(t: torch.Tensor) -> bool:
    low, high = torch.aminmax(t)  # one pass for both
    return int(high) > 2**31 - 1 or int(low) < -(2**31)


def torch_from_host(array: np.ndarray[Any, Any], dtype: torch.dtype) -> torch.Tensor:
    """A device array read back, as a CPU tensor of the torch dtype it stands for."""
    array = np.ascontiguousarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to(dtype)
    return torch.from_numpy(array).to(dtype)


def synchronize() -> None:
    """Waits for the value of every live tt storage (each was made by queued work). Storages
    torch has freed go first: a failed op's result the caller dropped no longer raises here."""
    drain_freed()
    session.call(_wait_all, list(_slots.values()))


async def _wait_all(slots: list[Slot]) -> None:
    for slot in slots:
        cell = slot.value
        if cell is not None and not slot.device.closed:
            await tt.wait(cell.get())
