"""The compiler's memory plan checked on the chip it was compiled for: a plan that does not fit
is the OutOfMemoryError silicon's allocator would raise, at the op that overflows, at load."""

from __future__ import annotations

from pathlib import Path

import pytest

import ttflow as tt
from ttflow.ttnn import mlir
from ttflow.ttnn.plan import Chip, buffer_bytes, check_plan
from ttflow.ttnn.reader import TtnnFile, TtnnOp, TtnnProgram, TtnnTensor, read_ttnn
from ttflow.ttnn.schema import SCHEMAS

CORPUS = Path(__file__).parent / "data" / "ttnn"
N150 = Chip(l1_banks=64, l1_base=0, l1_end=1_499_136, dram_banks=12, dram_base=0, dram_end=1 << 30)


def layout(buffer: str, tiles: str) -> str:
    return (f"#ttnn.ttnn_layout<(d0, d1) -> (d0, d1), <1x1>, memref<{tiles}x!ttcore.tile<32x32, f32>, "
            f"#ttnn.buffer_type<{buffer}>>, <interleaved>>")


BIG_L1 = f"tensor<4096x4096xf32, {layout('l1', '128x128')}>"  # 16384 tiles: 256 per core, 1 MiB
BIG_DRAM = f"tensor<4096x4096xf32, {layout('dram', '128x128')}>"


def program(texts: list[str]) -> tuple[TtnnFile, TtnnProgram]:
    ops = tuple(TtnnOp(i, 0, mlir.parse_op(t), f'loc("step{i}")') for i, t in enumerate(texts))
    arg = TtnnTensor(0, (4096, 4096), "f32", "dram", True, "interleaved", False)
    prog = TtnnProgram("main", False, (arg,), (), ops, (), ("%arg0",), None)
    return TtnnFile(next(iter(SCHEMAS.values())), "", (prog,), "", 0), prog


def test_bytes_per_bank_follow_tt_metals_rule() -> None:
    # 16384 tiles of 4096 bytes over 64 L1 banks; 4 tiles over 12 DRAM banks take one page each
    assert buffer_bytes(mlir.parse_type(BIG_L1), N150) == ("l1", 256 * 4096)
    assert buffer_bytes(mlir.parse_type(f"tensor<64x64xf32, {layout('dram', '2x2')}>"), N150) == ("dram", 4096)
    # a row-major page is one row, aligned: 16 rows of 100 f32 over 12 banks, 2 rows per bank
    rm = "tensor<16x100xf32, #ttnn.ttnn_layout<(d0, d1) -> (d0, d1), <1x1>, memref<16x100xf32, #ttnn.buffer_type<dram>>, <interleaved>>>"
    assert buffer_bytes(mlir.parse_type(rm), N150) == ("dram", 2 * 416)


def test_a_plan_that_overflows_l1_fails_at_the_op_that_overflows() -> None:
    file, prog = program([
        f'%0 = "ttnn.exp"(%arg0) : ({BIG_DRAM}) -> {BIG_L1}',
        f'%1 = "ttnn.exp"(%0) : ({BIG_L1}) -> {BIG_L1}',   # two MiB per core of 1.43: no room
    ])
    with pytest.raises(tt.OutOfMemoryError, match=r"op 1 ttnn\.exp at step1 puts %1 \(4096x4096 f32\) in L1") as exc:
        check_plan(file, prog, N150)
    assert exc.value.requested == 256 * 4096 and exc.value.largest_free == 1_499_136 - 256 * 4096


def test_the_same_plan_fits_when_it_deallocates_first() -> None:
    file, prog = program([
        f'%0 = "ttnn.exp"(%arg0) : ({BIG_DRAM}) -> {BIG_L1}',
        f'%1 = "ttnn.exp"(%0) : ({BIG_L1}) -> {BIG_DRAM}',
        f'"ttnn.deallocate"(%0) <{{force = false}}> : ({BIG_L1}) -> ()',
        f'%2 = "ttnn.exp"(%1) : ({BIG_DRAM}) -> {BIG_L1}',
    ])
    plan = check_plan(file, prog, N150)
    assert plan.peak_l1_per_core == 256 * 4096
    # the input, %1 and (for a moment) nothing else in DRAM: 16384 tiles over 12 banks each
    assert plan.peak_dram_per_bank == 2 * -(-16384 // 12) * 4096


def test_every_corpus_plan_fits_its_chip_and_ttflow_run_reports_it() -> None:
    for path in sorted(CORPUS.glob("*.ttnn")):
        file = read_ttnn(path.read_bytes())
        plan = check_plan(file, file.programs[0])
        assert plan.peak_l1_per_core == 0 < plan.peak_dram_per_bank  # level 0: all DRAM interleaved


def test_a_binary_whose_plan_cannot_fit_is_refused_at_load(tmp_path: Path) -> None:
    """Every DRAM buffer of a compiled binary moved to L1 (its text edited, its length kept): the
    plan is replayed on L1, and the file still loads when it fits."""
    data = (CORPUS / "unary.ttnn").read_bytes()
    moved = data.replace(b"#ttnn.buffer_type<dram>>, <interleaved>>", b"#ttnn.buffer_type<l1>>, <interleaved>>  ")
    assert moved != data and len(moved) == len(data)
    file = read_ttnn(moved)
    plan = check_plan(file, file.programs[0])
    assert plan.peak_l1_per_core > 0
    tt.Binary.from_bytes(moved)  # fits: a few small tensors per core


@pytest.mark.anyio
async def test_a_compiled_program_runs_where_the_compiler_placed_it(tmp_path: Path) -> None:
    """Every op's values are placed where its result type says (all DRAM at optimisation level 0):
    the run holds no L1 (ttflow alone would put the intermediates in L1 first), and a saved
    ttflow file keeps the placements."""
    binary = tt.Binary.load(CORPUS / "gpt2_block.ttnn")
    program = binary.programs[0]
    placed = dict(program.placements)
    assert {s.output for s in program.steps} <= set(placed) and set(placed.values()) == {tt.MemorySpace.DRAM}
    path = tmp_path / "gpt2.ttb"
    tt.Binary([program]).save(path)
    assert tt.Binary.load(path).programs[0].placements == program.placements
    data = __import__("numpy").load(CORPUS / "gpt2_block.npz")
    async with tt.open_device() as device:
        ins = [tt.to_device(data[f"in{j}"], device, tt.get_layout(binary, 0, j)) for j in range(len(program.inputs))]
        (out,) = tt.submit(device, binary, 0, ins)
        await tt.to_host(out)
        assert device.stats.l1_peak_bytes == 0 < device.stats.dram_peak_bytes


@pytest.mark.anyio
async def test_an_unplaced_program_uses_l1_and_a_dram_placement_keeps_it_out() -> None:
    import numpy as np

    async def l1_peak(place: bool) -> int:
        b = tt.ProgramBuilder("p")
        x = b.input((256, 256))
        with b.placing(tt.MemorySpace.DRAM) if place else __import__("contextlib").nullcontext():
            y = b.exp(b.relu(x))
        b.output(b.add(y, 1.0))
        async with tt.open_device() as device:
            (out,) = tt.submit(device, tt.Binary([b.build()]), 0, [tt.to_device(np.ones((256, 256), np.float32), device)])
            np.testing.assert_allclose(await tt.to_host(out), np.exp(1.0) + 1, rtol=1e-6)
            return device.stats.l1_peak_bytes

    assert await l1_peak(False) > 0 and await l1_peak(True) == 0
