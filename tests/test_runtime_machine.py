"""The runtime as a state machine (ttflow.testing.RuntimeStateMachine) against the numpy model.

Work stays queued between rules: every command stops mid-flight (its allocations made, its bytes
not yet moved) until a rule awaits something, so deallocating, writing and submitting happen
against queued programs, conversions and evictions. Every handle is kept, every dtype appears
(BFLOAT16 exactly, BFLOAT8_B within its rounding bound), and whenever the device is idle its
memory must equal the storages of the live tensors to the byte and every live tensor must read
back as the model says. Two shapes on the small device (4 L1 banks of 64 KiB): a small one, and
a large one whose FLOAT32 and INT32 L1 tensors cannot fit (the programs that put one in L1 must
fail with OutOfMemoryError, and so must everything computed from them).

Bugs planted by monkeypatching, each caught within the ci profile's 40 examples: deallocating a
tensor while its eviction is in flight leaks the DRAM copy (bug (b), fixed in 1f2ab6a: 8 runs
of 8); `_free` forgetting DRAM blocks, a write keeping the conversions of the old value, an
eviction that copies no bytes, a kept conversion reused for another dtype (every run); deallocate
freeing storages that queued commands still read, `await`/`tt.wait` swallowing OutOfMemoryError
(7 runs of 8).

Memory planning (`fragment`, `request`, the `memory_views_consistent` invariant): the asyncio
machine runs the default L1 eviction policy ("lookahead"), the trio one "eager". Bugs planted in
`Scheduler.move_in_place` / `EvictCommand.decide`: a relocation that leaves the storage at its
old address (its old block freed), one that copies no bytes, one that leaves `tensor.buffer`
at the old address. Each is caught by every run of the pair; by each machine alone in 47 of 48
runs (planted everywhere, or for DRAM buffers only); planted for L1 buffers only, by the
asyncio machine in 11 of 12 runs, the trio one in 7 of 12 (the stale `tensor.buffer` in none:
"eager" moves L1 tensors to DRAM before the invariant looks). A memory view that leaves out the
circular buffers: every run. Compaction (`SlideCommand`): with it switched off, `request`
fails on a DRAM request within the free bytes; with slides that copy no bytes, a fragment's
values are wrong (each in the first run of the ci profile).

Memory on its way back (`convert_while_dram_comes_back`, docs/memory.md): with room-making's
wait for what deallocated tensors give back once CQ1's writes into them land switched off, a
conversion into DRAM raises OutOfMemoryError where the model says it is made; with the model
predicting from DRAM's free bytes alone (the holes coming back left out), a conversion it says
must fail is made. Each is caught by both machines in 8 runs of 8 (seeds 1-4, the ci profile's
40 examples, found within the first few).

Cached constants without constant inputs (`cache_constants`, `_placed_programs`): with the
finalizer that ties their entry to its program's life removed, teardown finds the entry's bytes
allocated with every tensor deallocated (the trio const-eval machine, the first run).
"""


from __future__ import annotations

import gc

import numpy as np
from hypothesis import settings

import ttflow as tt
from ttflow.testing import ExpectedValue, ModelProgram, RuntimeStateMachine

F32, BF16, BF8, I32 = tt.DataType.FLOAT32, tt.DataType.BFLOAT16, tt.DataType.BFLOAT8_B, tt.DataType.INT32
DRAM, L1 = tt.MemorySpace.DRAM, tt.MemorySpace.L1
TILE, RM = tt.TensorLayout.TILE, tt.TensorLayout.ROW_MAJOR
SMALL, BIG = (40, 33), (128, 640)  # BIG: 80 tiles; FLOAT32 80 KiB per L1 bank, BFLOAT16 40 KiB


def _relu(a: np.ndarray) -> np.ndarray:
    return np.maximum(a, np.float32(0))


def _programs(shape: tuple[int, int]) -> list[ModelProgram]:
    built = []

    b = tt.ProgramBuilder("scale_add")
    b.output(b.add(b.mul(b.input(shape, tt.Layout(DRAM, TILE, F32)), 2.0), 1.0), tt.Layout(L1, TILE))
    built.append((b.build(), lambda x: [x.map(lambda a: a * np.float32(2) + np.float32(1))]))

    b = tt.ProgramBuilder("add_to_bf16")
    x = b.input(shape, tt.Layout(L1, TILE, F32))
    b.output(b.add(x, b.input(shape, tt.Layout(DRAM, RM, F32))), tt.Layout(DRAM, RM, BF16))
    built.append((b.build(), lambda x, y: [x.map(np.add, y)]))

    b = tt.ProgramBuilder("relu_of_bf16")
    b.output(b.relu(b.input(shape, tt.Layout(L1, TILE, BF16))), tt.Layout(dtype=F32))
    built.append((b.build(), lambda x: [x.map(_relu)]))

    b = tt.ProgramBuilder("relu_to_l1_bf16")
    b.output(b.relu(b.input(shape, tt.Layout(DRAM, TILE, BF16))), tt.Layout(L1, TILE))
    built.append((b.build(), lambda x: [x.map(_relu)]))

    b = tt.ProgramBuilder("half_to_bf8")
    b.output(b.mul(b.input(shape, tt.Layout(DRAM, TILE, F32)), 0.5), tt.Layout(DRAM, TILE, BF8))
    built.append((b.build(), lambda x: [x.map(lambda a: a * np.float32(0.5))]))

    b = tt.ProgramBuilder("bf8_add")
    x = b.input(shape, tt.Layout(DRAM, TILE, BF8))
    b.output(b.add(x, b.input(shape, tt.Layout(L1, TILE, BF8))), tt.Layout(DRAM, RM, F32))
    built.append((b.build(), lambda x, y: [x.map(np.add, y)]))

    b = tt.ProgramBuilder("int_add")
    x = b.input(shape, tt.Layout(DRAM, RM, I32))
    b.output(b.add(x, b.input(shape, tt.Layout(L1, TILE, I32))), tt.Layout(L1, TILE))
    built.append((b.build(), lambda x, y: [x.map(np.add, y)]))

    # Intermediates of rank 3 that 32x32 tiles would pad to 3-4x their size: their scratch is
    # stored as the least padded 2-D view of their elements (`least_padded_shape`), in L1 or,
    # under pressure, in DRAM.
    b = tt.ProgramBuilder("scale_add_3d")
    x = b.input(shape, tt.Layout(DRAM, TILE, F32))
    folded = b.reshape(x, (shape[0] // 8, 8, shape[1]))
    b.output(b.reshape(b.add(b.mul(folded, 2.0), 1.0), shape), tt.Layout(L1, TILE))
    built.append((b.build(), lambda x: [x.map(lambda a: a * np.float32(2) + np.float32(1))]))

    binary = tt.Binary([program for program, _ in built])
    return [ModelProgram(binary, reference, index) for index, (_, reference) in enumerate(built)]


PROGRAMS = _programs(SMALL) + _programs(BIG)


def _const_programs(shape: tuple[int, int]) -> list[ModelProgram]:
    """A constant input (const-eval): its part runs once per constant value and is cached on the
    device; writes, deallocates and a trace's captures and replays around it must leave every
    value as numpy's and the memory as the model's (the cache's results counted)."""
    b = tt.ProgramBuilder("const_scaled_add")
    x = b.input(shape, tt.Layout(DRAM, TILE, F32))
    w = b.input(shape, tt.Layout(DRAM, TILE, F32), const=True)
    b.output(b.add(x, b.mul(w, 2.0)), tt.Layout(DRAM, TILE))
    binary = tt.Binary([b.build()])
    return [ModelProgram(binary, lambda x, w: [x.map(np.add, w.map(lambda a: a * np.float32(2)))], 0)]


def _placed_programs(shape: tuple[int, int]) -> list[ModelProgram]:
    """A compiler's program as ttflow.ttnn builds one: an intermediate placed in DRAM
    (`placing`: its scratch is never L1), so the DRAM-only scratch meets room-making, writes,
    traces and evictions, and constants it makes itself cached (`cache_constants`, a compiled
    `load_cached`): their entry has no constant to end with, only the program's life. Each
    machine run builds its own binary and drops it before teardown's check, which
    then finds the entry's bytes unless dropping the binary freed them."""
    tile = tt.Layout(DRAM, TILE, F32)
    b = tt.ProgramBuilder("placed_cached")
    x = b.input(shape, tile)
    c = b.mul(b.full(shape, 0.5), 3.0)
    with b.placing(tt.MemorySpace.DRAM):
        h = b.mul(x, 3.0)
    b.output(b.add(h, c), tile)
    b.cache_constants()
    binary = tt.Binary([b.build()])
    return [ModelProgram(binary, lambda x: [x.map(lambda a: a * np.float32(3) + np.float32(1.5))], 0)]


def _fast_programs(shape: tuple[int, int]) -> list[ModelProgram]:
    """Pagewise programs on DRAM tiles alike, without intermediates: the C fast path's."""
    tile = tt.Layout(DRAM, TILE, F32)
    b = tt.ProgramBuilder("fast_inc")
    b.output(b.add(b.input(shape, tile), 1.0), tile)
    inc = b.build()
    b = tt.ProgramBuilder("fast_add")
    b.output(b.add(b.input(shape, tile), b.input(shape, tile)), tile)
    add = b.build()
    binary = tt.Binary([inc, add])
    return [ModelProgram(binary, lambda x: [x.map(lambda a: a + np.float32(1))], 0),
            ModelProgram(binary, lambda x, y: [x.map(np.add, y)], 1)]


def _failing_programs(shape: tuple[int, int]) -> list[tuple[ModelProgram, type[Exception]]]:
    """x + (x / 0 through BFLOAT8_B), DRAM tiles in and out: decided and run, it fails when its
    run stores the infinities (BFLOAT8_B has no encoding for them)."""
    tile = tt.Layout(DRAM, TILE, F32)
    b = tt.ProgramBuilder("fails_in_its_run")
    x = b.input(shape, tile)
    b.output(b.add(b.typecast(b.typecast(b.div(x, 0.0), BF8), F32), x), tile)
    return [(ModelProgram(tt.Binary([b.build()]), lambda x: [x]), tt.LayoutError)]


class RuntimeMachine(RuntimeStateMachine):
    spec = tt.DeviceSpec.small()
    shapes = (SMALL, BIG)
    programs = PROGRAMS
    fast_programs = tuple(_fast_programs(SMALL) + _fast_programs(BIG))
    failing_programs = tuple(_failing_programs(SMALL) + _failing_programs(BIG))
    fragment_dram = True  # every rule here checks room()


class TrioRuntimeMachine(RuntimeMachine):
    """On trio, with the other L1 eviction policy ("eager": every L1 tensor a starting program
    does not read moves to DRAM), which the asyncio machine's default ("lookahead") is not."""

    backend = "trio"
    eviction = "eager"


class ConstEvalRuntimeMachine(RuntimeMachine):
    """The programs and a constant-input one, so const-eval's cache meets writes, deallocates,
    traces (whose captures hoist the constant part out) and evictions, and a program with a
    DRAM-placed intermediate and cached constants (`_placed_programs`); on trio with "eager"
    eviction, DRAM fragmented: the configuration that found an unrecorded eviction by a
    hoisted constant part (docs/testing.md, "A finding and its fix")."""

    backend = "trio"
    eviction = "eager"
    programs = PROGRAMS + _const_programs(SMALL) + _const_programs(BIG)

    def __init__(self) -> None:
        super().__init__()
        self.programs = [*type(self).programs, *_placed_programs(SMALL)]  # this run's own binary

    def let_go_of_traces(self) -> None:
        super().let_go_of_traces()
        self.programs = type(self).programs  # its binary goes: what its programs cached goes too
        gc.collect()


class OneQueueRuntimeMachine(RuntimeMachine):
    """A device opened with one hardware command queue (`num_hw_cqs=1`, tt-mlir's default):
    every write queues on CQ0 among the programs, conversions, evictions and reads."""

    num_hw_cqs = 1


MACHINE_SETTINGS = settings(stateful_step_count=50)
TestRuntimeAsyncio = RuntimeMachine.TestCase
TestRuntimeAsyncio.settings = MACHINE_SETTINGS
TestRuntimeTrio = TrioRuntimeMachine.TestCase
TestRuntimeTrio.settings = MACHINE_SETTINGS
TestRuntimeConstEval = ConstEvalRuntimeMachine.TestCase
TestRuntimeConstEval.settings = MACHINE_SETTINGS
TestRuntimeOneQueue = OneQueueRuntimeMachine.TestCase
TestRuntimeOneQueue.settings = settings(stateful_step_count=30,
                                        max_examples=max(10, settings.default.max_examples // 4))


def test_the_reference_programs_use_what_the_model_says() -> None:
    # The BIG programs that put FLOAT32 or INT32 in L1 need more than a 64 KiB L1 bank: the
    # machine expects them (and their dependants) to fail with OutOfMemoryError.
    spec = tt.DeviceSpec.small()
    from ttflow.testing import storage_geometry

    assert storage_geometry(BIG, tt.Layout(L1, TILE, F32), spec).depth > spec.l1_bank_bytes
    assert storage_geometry(BIG, tt.Layout(L1, TILE, BF16), spec).depth <= spec.l1_bank_bytes
    assert storage_geometry(SMALL, tt.Layout(L1, TILE, F32), spec).depth <= spec.l1_bank_bytes // 8
    assert isinstance(PROGRAMS[0].reference(ExpectedValue.exactly(np.ones(SMALL, np.float32), F32))[0],
                      ExpectedValue)


def _donating_programs(shape: tuple[int, int]) -> list[ModelProgram]:
    built = []

    b = tt.ProgramBuilder("scale_in_place")
    x = b.input(shape, tt.Layout(DRAM, TILE, F32))
    b.output(b.mul(x, 2.0), donates=x)
    built.append((b.build(), lambda x: [x.map(lambda a: a * np.float32(2))]))

    b = tt.ProgramBuilder("accumulate_l1_bf16")
    acc = b.input(shape, tt.Layout(L1, TILE, BF16))
    b.output(b.add(acc, b.input(shape, tt.Layout(DRAM, RM, F32))), donates=acc)
    built.append((b.build(), lambda acc, y: [acc.map(np.add, y)]))

    b = tt.ProgramBuilder("relu_rm_and_copy")
    x = b.input(shape, tt.Layout(DRAM, RM, F32))
    b.output(b.relu(x), donates=x)
    b.output(b.add(x, 1.0), tt.Layout(L1, TILE))
    built.append((b.build(), lambda x: [x.map(_relu), x.map(lambda a: a + np.float32(1))]))

    binary = tt.Binary([program for program, _ in built])
    return [ModelProgram(binary, reference, index) for index, (_, reference) in enumerate(built)]


RuntimeMachine.donating_programs = _donating_programs(SMALL) + _donating_programs(BIG)
