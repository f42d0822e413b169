"""The model of one device: every handle ever made, what each must hold or raise, and checks of
the device's memory against it; plus two async helpers, `drain` and `hold_worker_threads`.

A test that drops a handle lets the garbage collector free its memory (`Tensor.__del__` hands the
storages back), which hides a leak. The model keeps every handle, deallocated and failed ones
included, for the whole test, so the accounting checks see what the runtime really frees.

Failures are part of the model. A command that allocates in L1 may fail with OutOfMemoryError
depending on what else sits in L1 when it starts, which depends on timing; the model then records
"holds this value, or raises OutOfMemoryError" and settles it the first time the tensor is
observed. A failure is permanent and spreads: a command that reads a failed tensor fails with its
error, and so does everything computed from that.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, final

import anyio.to_thread
import attrs
import numpy as np

from .._runtime.device import Device
from .._errors import OutOfMemoryError
from .._runtime.calls import deallocate, to_device, to_host
from .._runtime.tensor import Tensor
from .._types import DataType, DeviceSpec, Layout, MemorySpace
from ._reference import ExpectedValue, buffer_footprint, space_capacity, storage_geometry

__all__ = ["DeviceModel", "ModelTensor", "QueueHold", "WorkerThreadHold", "drain", "hold_worker_threads"]

ErrorType = type[BaseException]


@final
@attrs.define(eq=False, repr=False)
class ModelTensor:
    """One handle the model keeps for the whole test, and what it must hold or raise.

    The outcome of the command that made it is known (`resolved`), or still open: it may
    fail on its own (`may_fail`: it allocates in L1) or because a tensor it reads failed
    (`parents`, in the order its command reads them: the first failed one gives the error).
    """

    tensor: Tensor
    home: Layout
    """The layout (dtype set) the tensor was made in; eviction may move it from L1 to DRAM."""
    expected: ExpectedValue | None
    """What it holds if it does not fail (None: it is known to fail)."""
    label: str
    error: ErrorType | None = None
    """The error it is known to raise (set once observed)."""
    fails_with: ErrorType | None = None
    """The error its own command raises whenever its inputs do not fail first (an L1 output
    larger than L1)."""
    may_fail: bool = False
    """Whether its own command may raise OutOfMemoryError (it allocates in L1)."""
    parents: tuple[ModelTensor, ...] = ()
    resolved: bool = False
    deallocated: bool = False
    given_name: str | None = None
    """The name the test gave the tensor (`Tensor.name`): every storage of it is shown so."""
    shape: tuple[int, ...] = attrs.field(init=False)
    dtype: DataType = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.shape = self.tensor.shape
        self.dtype = self.tensor.dtype

    def __repr__(self) -> str:
        state = ("deallocated, " if self.deallocated else "") + (
            f"fails with {self.error.__name__}" if self.error is not None
            else "ok" if self.known_ok
            else "may fail"
        )
        return f"<{self.label}: {self.dtype.name} {self.shape}, {state}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # hypothesis prints failing steps so
        p.text(repr(self))

    @property
    def name(self) -> str:
        """The short name of its label ("t3")."""
        return self.label.split(" = ")[0]

    @property
    def known_ok(self) -> bool:
        """Whether it is known to hold `expected` (its command cannot fail or did not)."""
        if self.resolved:
            return self.error is None
        return (
            self.fails_with is None and not self.may_fail and all(p.known_ok for p in self.parents)
        )

    @property
    def known_failed(self) -> bool:
        return self.error is not None

    @property
    def usable(self) -> bool:
        """Live (not deallocated) and known to hold `expected`: safe to compute from."""
        return not self.deallocated and self.known_ok


    def outcomes(self) -> tuple[bool, frozenset[ErrorType]]:
        """Whether it may hold its value, and which errors it may raise instead."""
        if self.resolved:
            return self.error is None, frozenset({self.error} if self.error is not None else ())
        errors: set[ErrorType] = set()
        for parent in self.parents:
            ok, parent_errors = parent.outcomes()
            errors |= parent_errors
            if not ok:
                return False, frozenset(errors)
        if self.fails_with is not None:
            errors.add(self.fails_with)
            return False, frozenset(errors)
        if self.may_fail:
            errors.add(OutOfMemoryError)
        return True, frozenset(errors)

    def record(self, error: BaseException | None) -> None:
        """Checks an observed outcome (None: it holds a value) and remembers it."""
        ok, errors = self.outcomes()
        if error is None:
            assert ok, f"{self!r} should have failed with one of {_names(errors)}, it did not"
            self._settle_ok()
            return
        if not isinstance(error, tuple(errors)):
            raise AssertionError(
                f"{self!r} raised {type(error).__name__}: {error}; expected "
                + (f"one of {_names(errors)}" if errors else "its value")
            ) from error
        kind = next(e for e in errors if isinstance(error, e))
        if not self.resolved and not self.may_fail and self.fails_with is None:
            # It cannot fail on its own: an input failed it. If only one could, that one did.
            suspects = [p for p in self.parents if not p.known_ok]
            if len(suspects) == 1 and not suspects[0].resolved:
                suspects[0]._settle_failed(kind)
        self._settle_failed(kind)

    def _settle_ok(self) -> None:
        # It ran, so every tensor its command read had no error.
        self.resolved, self.error = True, None
        for parent in self.parents:
            if not parent.resolved:
                parent._settle_ok()

    def _settle_failed(self, kind: ErrorType) -> None:
        self.resolved, self.error, self.expected = True, kind, None


def _names(errors: frozenset[ErrorType]) -> str:
    return "{" + ", ".join(sorted(e.__name__ for e in errors)) + "}" if errors else "{}"


@final
class DeviceModel:
    """Every handle a test made on one device, and the checks of the device's memory.

    The `check_*` methods read runtime state: call them on the event loop thread (in a
    `BlockingPortal.call`, or from async code), never from another thread while work runs.
    """

    def __init__(self, spec: DeviceSpec) -> None:
        self.spec = spec
        self.tensors: list[ModelTensor] = []

    def track(
        self,
        tensor: Tensor,
        home: Layout,
        expected: ExpectedValue | None,
        *,
        label: str | None = None,
        fails_with: ErrorType | None = None,
        may_fail: bool = False,
        parents: tuple[ModelTensor, ...] = (),
    ) -> ModelTensor:
        """Keeps `tensor` for the rest of the test, with what it must hold or raise.

        `parents`: the tensors its command reads, in order; `fails_with`: the error its command
        raises whenever they do not fail first; `may_fail`: whether it may raise
        OutOfMemoryError instead (it allocates in L1, where room depends on timing).
        """
        if expected is not None and expected.shape != tensor.shape:
            raise ValueError(f"expected shape {expected.shape} for a {tensor.shape} tensor")
        entry = ModelTensor(
            tensor, home.resolve(tensor.dtype), expected,
            label if label is not None else f"t{len(self.tensors)}",
            fails_with=fails_with, may_fail=may_fail, parents=parents,
        )
        self.tensors.append(entry)
        return entry

    def live(self) -> list[ModelTensor]:
        """The tensors not deallocated."""
        return [e for e in self.tensors if not e.deallocated]

    def dram_estimate(self) -> int:
        """A generous estimate of the DRAM the live tensors may take (a home and two copies)."""
        total = 0
        for e in self.tensors:
            if not e.deallocated:
                layout = attrs.evolve(e.home, memory=MemorySpace.DRAM)
                total += 3 * storage_geometry(e.shape, layout, self.spec).footprint
        return total

    # -- checks (event loop thread) -----------------------------------------------------------

    def check_bounds(self, device: Device) -> None:
        """What holds at any moment, with work still queued or running (nothing is awaited).

        Memory used never exceeds capacity, nor the peaks; every storage a tensor lists is
        allocated, so the storages of each space never overlap and their footprints add up to
        at most `memory_used`; a handle keeps its shape and dtype.
        """
        stats = device.stats
        for space in MemorySpace:
            used = device.memory_used(space)
            capacity = space_capacity(self.spec, space)
            assert 0 <= used <= capacity, f"{space.name}: {used} bytes used of {capacity}"
            listed = self._listed(space, include_deallocated=True)
            total = sum(buffer_footprint(b, self.spec) for _, b in listed)
            assert total <= used, (
                f"{space.name}: tensors list {total} bytes of storage, only {used} are allocated"
            )
            _check_disjoint(space, listed, self.spec)
        l1_capacity = space_capacity(self.spec, MemorySpace.L1)
        assert stats.l1_peak_bytes <= l1_capacity, f"L1 peak {stats.l1_peak_bytes} > {l1_capacity}"
        for e in self.tensors:
            assert e.tensor.shape == e.shape and e.tensor.dtype is e.dtype, f"{e!r} changed"
            assert e.tensor.is_deallocated == e.deallocated, f"{e!r}: is_deallocated is wrong"

    def check_drained(self, device: Device, pinned: dict[MemorySpace, int] | None = None) -> None:
        """What holds once every queued command has completed and every outcome is known.

        `memory_used(space)` equals the footprints of the storages the live tensors list, plus
        `pinned` bytes (buffers only a live trace keeps), to the byte; deallocated and failed
        tensors list none; a live tensor lists at most one storage per layout, each with SPEC's
        geometry, its home first, in the format it was made in.
        """
        for e in self.tensors:
            t = e.tensor
            assert t.done(), f"{e!r} is not done after a drain"
            if e.deallocated:
                assert t.storages == (), f"{e!r} still lists {t.storages} after a drain"
                continue
            assert e.resolved or e.known_ok, f"{e!r}: outcome unknown after a drain"
            if e.error is not None:
                assert t.storages == (), f"{e!r} failed but lists {t.storages}"
                continue
            storages = t.storages
            assert storages, f"{e!r} holds no storage"
            home = storages[0][0]
            assert (home.dtype, home.tensor_layout) == (e.home.dtype, e.home.tensor_layout), (
                f"{e!r}: its home is {home}, it was made as {e.home}"
            )
            assert home.memory is e.home.memory or home.memory is MemorySpace.DRAM, (
                f"{e!r}: its home moved from {e.home.memory.name} to {home.memory.name}"
            )
            layouts = [layout for layout, _ in storages]
            assert len(set(layouts)) == len(layouts), f"{e!r} lists a layout twice: {layouts}"
            for layout, buffer in storages:
                want = storage_geometry(e.shape, layout, self.spec)
                got = (buffer.space, buffer.page_size, buffer.aligned_page_size, buffer.num_pages)
                assert got == (layout.memory, want.page_size, want.aligned_page_size, want.num_pages), (
                    f"{e!r}: a {layout} storage is {buffer}, SPEC says {want}"
                )
        # The const-eval cache's results (`_const_eval`): each entry is of live constants only
        # (a write, a deallocate or a drop of one frees it; a failed one's results hold nothing
        # and go at the next lookup), and its bytes are held beside theirs.
        cache = device._scheduler.const_cache
        entries = list(cache.entries.values()) if cache is not None else []
        live = {id(e.tensor._state) for e in self.tensors if not e.deallocated}
        for entry in entries:
            assert all(id(state) in live for state in entry.constants), (
                f"a const-eval entry outlived one of its constants; live: {self.live()}")
        for space in MemorySpace:
            listed = self._listed(space, include_deallocated=False)
            expected = sum(buffer_footprint(b, self.spec) for _, b in listed)
            cached = sum(buffer_footprint(b, self.spec) for entry in entries for result in entry.results
                         if not result.is_deallocated for _, b in result.storages if b.space is space)
            kept = (pinned or {}).get(space, 0)
            used = device.memory_used(space)
            assert used == expected + cached + kept, (
                f"{space.name}: {used} bytes used after a drain, the live tensors hold "
                f"{expected}, the const-eval cache {cached} and live traces alone {kept} "
                f"({used - expected - cached - kept:+d}); live: {self.live()}"
            )

    def _listed(self, space: MemorySpace, include_deallocated: bool) -> list[tuple[ModelTensor, Any]]:
        return [
            (e, buffer)
            for e in self.tensors
            if include_deallocated or not e.deallocated
            for _, buffer in e.tensor.storages
            if buffer.space is space
        ]


def _check_disjoint(space: MemorySpace, listed: list[tuple[ModelTensor, Any]], spec: DeviceSpec) -> None:
    banks = spec.banks(space)
    spans = sorted(
        (b.address, b.address + -(-b.num_pages // banks) * b.aligned_page_size, e)
        for e, b in listed
    )
    for (start_a, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
        assert end_a <= start_b, (
            f"{space.name}: a storage of {a!r} [{start_a}, {end_a}) overlaps one of {b!r} at {start_b}"
        )


# -- async helpers ------------------------------------------------------------------------------


async def drain(device: Device) -> None:
    """Waits until every command queued on `device` before the call has completed.

    A fence: a one-element write on CQ1 (after every queued write) read back on CQ0 (after every
    queued program, conversion and read). Unlike awaiting tensors one by one, it also waits for
    work whose results nobody holds (a conversion into a tensor deallocated at once).
    """
    fence = to_device(np.zeros(1, np.float32), device)
    try:
        await to_host(fence)
    finally:
        deallocate(fence)


@final
class WorkerThreadHold:
    """Holds every token of anyio's default worker-thread limiter while `held`.

    ttflow runs a large command's bytes on its queue's worker thread, taking a token of that
    limiter as `anyio.to_thread.run_sync` does, between its bookkeeping on the event loop. While
    the tokens are held, such a command stops after its decision (allocations made, an eviction
    under way) and before its run (a write waiting behind a reader also stops before converting
    its array ahead), and everything queued behind it waits: a deterministic way to act (write,
    deallocate, submit) while a large write, conversion, eviction or program is in flight. Small
    commands run inline and are not held. Call `acquire` and `release` on the event loop thread;
    release before awaiting any tensor whose work may need a thread.
    """

    def __init__(self) -> None:
        self._borrowers: list[object] = []
        self._limiter: Any = None

    @property
    def held(self) -> bool:
        return bool(self._borrowers)

    async def acquire(self) -> None:
        if self.held:
            return
        limiter = anyio.to_thread.current_default_thread_limiter()
        self._limiter = limiter
        try:
            for _ in range(int(limiter.total_tokens)):
                borrower = object()
                await limiter.acquire_on_behalf_of(borrower)
                self._borrowers.append(borrower)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        borrowers, self._borrowers = self._borrowers, []
        for borrower in borrowers:
            self._limiter.release_on_behalf_of(borrower)


@final
class QueueHold:
    """Pauses the worker threads of one device's two queues (what `RuntimeStateMachine` holds
    between its rules).

    A paused worker takes no job: every record a queue hands it stays *in flight* (decided, its
    allocations made, its bytes not moved), and its queue waits behind it. Unlike
    `WorkerThreadHold` (which holds anyio's thread tokens, so nothing is ever handed over), the
    records are handed over, so a command decided ahead and one held mid-flight are reached
    too, and `run_alone` lets one queue go on while the other's records stay in flight: CQ0
    making room while CQ1 holds writes, say. Call on the event loop thread.
    """

    def __init__(self, device: Device) -> None:
        self._device = device
        self.held = False

    def _queues(self) -> dict[str, Any]:
        return {"CQ0": self._device._cq0, "CQ1": self._device._cq1}

    async def acquire(self) -> None:
        for queue in self._queues().values():
            queue._worker.pause()
        self.held = True

    def release(self) -> None:
        for queue in self._queues().values():
            queue._worker.resume()
        self.held = False

    async def run_alone(self, name: str, seconds: float) -> None:
        """Lets queue `name` run until it is idle or waits for the other queue (no progress
        and its worker idle for a few milliseconds), at most `seconds`; then holds it again."""
        queue = self._queues()[name]
        worker = queue._worker
        counters = self._device._scheduler.counters
        worker.resume()
        try:
            with anyio.move_on_after(seconds):
                last: tuple[int, int] | None = None
                quiet = 0
                while quiet < 5:
                    await anyio.sleep(0.001)
                    now = (len(queue), counters["commands_run"])
                    quiet = quiet + 1 if now == last and not worker.busy else 0
                    last = now
        finally:
            if self.held:
                worker.pause()


@asynccontextmanager
async def hold_worker_threads() -> AsyncIterator[WorkerThreadHold]:
    """`async with hold_worker_threads():` large commands stop before their run (see
    `WorkerThreadHold`) until the block exits."""
    hold = WorkerThreadHold()
    await hold.acquire()
    try:
        yield hold
    finally:
        hold.release()
