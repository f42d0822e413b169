"""The `ttflow` command as a newcomer meets it: --version, argument errors, the demo's output, and
the benchmarks on a machine without the test extra."""

from __future__ import annotations

import importlib.metadata
import io
import json
import sys
import tomllib
from pathlib import Path

import anyio
import pytest

import ttflow
from ttflow import _demo
from ttflow._bench import dispatch
from ttflow._observe.timeline import queue_summary
from ttflow.cli import main

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTION = "ttflow-runtime"


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"ttflow {ttflow.__version__}\n"


def test_the_version_has_one_source_and_the_distribution_its_own_name() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == DISTRIBUTION  # "ttflow" on PyPI is another project
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ttflow.__version__"}
    try:
        installed = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return  # run from a checkout installed under the old name, or not installed
    assert installed == ttflow.__version__


@pytest.mark.parametrize("value, says", [("0", "at least 1, got 0"), ("-2", "at least 1, got -2"),
                                         ("many", "expected a whole number")])
def test_bad_batches_is_an_argument_error_before_anything_runs(
    value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--small", "--batches", value])
    assert exit.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # the demo did not start
    assert "argument --batches" in err and says in err and "Traceback" not in err


def test_the_demo_function_rejects_zero_batches() -> None:
    with pytest.raises(ValueError, match="batches"):
        anyio.run(_demo.demo, 0)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_blas_threads_is_an_argument_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--small", "--blas-threads", value])
    assert exit.value.code == 2 and "argument --blas-threads" in capsys.readouterr().err


def test_a_trace_in_a_missing_folder_creates_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "not" / "yet" / "demo.json"
    assert main(["demo", "--small", "--batches", "2", "--no-progress", "--trace", str(trace)]) == 0
    assert json.loads(trace.read_text())["traceEvents"]
    assert f"trace: {trace}" in capsys.readouterr().out


def test_a_trace_path_that_is_a_folder_is_an_argument_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--small", "--trace", str(tmp_path)])
    assert exit.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "argument --trace" in err and "is a folder" in err


def test_a_trace_folder_that_cannot_be_made_is_an_argument_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--small", "--trace", str(tmp_path / "file" / "demo.json")])
    assert exit.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "argument --trace: cannot create the folder" in err


def test_help_says_what_happens_to_a_missing_trace_folder(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "missing folders" in " ".join(capsys.readouterr().out.split())


def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--small", "--batches", "10"]) == 0  # capsys's streams are no TTY
    out, err = capsys.readouterr()
    assert "\r" not in out and "\r" not in err and "batches" in out


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("flags, drawn", [([], True), (["--no-progress"], False)])
def test_the_progress_bar_on_a_terminal_and_no_progress(
    flags: list[str], drawn: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["demo", "--small", "--batches", "10", *flags]) == 0
    assert ("\r" in terminal.getvalue()) == drawn
    if drawn:
        assert terminal.getvalue().endswith("10/10 batches\n")


@pytest.mark.parametrize("n, text", [(0, "0 B"), (512, "512 B"), (1023, "1,023 B"), (1024, "1.0 KiB"),
                                     (20 * 1024, "20.0 KiB"), (3 * 2**20 // 2, "1.5 MiB"),
                                     (24 * 2**30, "24,576.0 MiB")])
def test_byte_counts_are_shown_in_sensible_units(n: int, text: str) -> None:
    assert _demo._size(n) == text


def test_the_small_demo_shows_no_zero_mib_rows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--small", "--batches", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "0.0 MiB" not in out and "KiB" in out


def span(tid: int, ts: float, dur: float, nbytes: int, **extra: object) -> dict[str, object]:
    return {"name": "cmd", "ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {"bytes": nbytes, **extra}}


def test_queue_busy_time_is_the_union_of_its_commands() -> None:
    events = [
        # Three batched writes on CQ1 run together over 0-100 us, then one alone over 300-400 us.
        span(1, 0.0, 100.0, 10), span(1, 0.0, 100.0, 20), span(1, 0.0, 100.0, 30), span(1, 300.0, 100.0, 40),
        # CQ0: a program over 50-350 us whose cost is not bytes moved, and a read.
        span(0, 50.0, 300.0, 1000, cost=123456), span(0, 360.0, 10.0, 5),
        {"name": "memory used (bytes)", "ph": "C", "pid": 1, "ts": 0.0, "args": {"DRAM": 1, "L1": 2}},
    ]
    summary = queue_summary(events)
    assert summary["CQ1"] == {"busy_seconds": pytest.approx(200e-6), "bytes": 100, "commands": 4}
    assert summary["CQ0"] == {"busy_seconds": pytest.approx(310e-6), "bytes": 1005, "commands": 2}
    # 50-100 and 300-350 and 360-370: 110 us.
    assert summary["both_busy_seconds"] == pytest.approx(110e-6)


def test_demo_queue_figures_come_from_the_trace_union() -> None:
    result = anyio.run(_demo.demo, 6, None, True, False)
    assert 0 <= result["overlap_seconds"] <= min(result["cq0_busy_seconds"], result["cq1_busy_seconds"])
    assert result["cq1_busy_seconds"] <= result["wall_seconds"]
    assert result["cq1_bytes"] >= result["host_to_device_bytes"]  # writes, plus the zero fills


def test_batched_writes_count_once_in_the_busy_time() -> None:
    import numpy as np

    async def body() -> tuple[dict[str, object], float]:
        async with ttflow.open_device(ttflow.DeviceSpec.small()) as device:
            with ttflow.record_timeline(device) as recorder:
                tensors = [ttflow.to_device(np.full((64, 64), i, np.float32), device) for i in range(8)]
                for t in tensors:
                    await t
            spans = [e for e in recorder.events if e["ph"] == "X"]
            window = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / 1e6
            return recorder.queue_summary(), window

    summary, window = anyio.run(body)
    cq1 = summary["CQ1"]
    assert isinstance(cq1, dict) and cq1["commands"] == 8 and cq1["bytes"] == 8 * 64 * 64 * 4
    assert cq1["busy_seconds"] <= window + 1e-9  # a sum over the batch would count it 8 times


def test_bench_dispatch_skips_a_missing_backend_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(dispatch, "backend_available", lambda name: name != "trio")
    assert main(["bench", "dispatch", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["backend"] for r in result["results"]] == ["asyncio"]
    assert result["skipped"] == [{"backend": "trio", "reason": "trio is not installed (pip install trio)"}]
    assert main(["bench", "dispatch", "--quick"]) == 0
    table = capsys.readouterr().out
    assert "asyncio" in table and "trio     skipped: trio is not installed" in table


def test_bench_mesh_measures_links_submits_and_the_mlp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "mesh", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    cases = {(c["op"], c["topology"], c["chips"]) for c in result["collectives"]}
    assert cases == {(op, t, n) for op in ("all_gather", "all_reduce")
                     for t, ns in (("line", (2, 4, 8)), ("ring", (4, 8))) for n in ns}
    for c in result["collectives"]:  # the bytes are the formula's, link by link
        assert c["ratio"] == 1.0 and c["every_link_exact"] and c["modelled_us"] > 0, c
    assert set(result["submit"]["vs_device"]) == {"1x1", "1x2", "2x4"}
    assert all(r > 0 for r in result["submit"]["vs_device"].values())
    mlp = result["mlp"]
    assert list(mlp["chips"]) == ["1", "2", "8"] and mlp["chips"]["1"]["mesh"] == "one Device"
    assert all(r["max_abs_error_vs_numpy"] < 1e-4 for r in mlp["chips"].values())
    assert main(["bench", "mesh", "--quick"]) == 0
    table = capsys.readouterr().out
    assert "all_reduce  ring" in table and "2x4" in table and "tensor-parallel MLP" in table


def test_bench_mesh_workers_compares_the_kinds_in_one_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "mesh", "--workers", "thread,process", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workers"] == ["thread", "process"]
    assert [c["n"] for c in result["chains"]] == [64, 96]
    for c in result["chains"]:  # the same bits from a worker process as from threads
        assert c["equal"] and c["speedup_vs_thread"]["thread"] == 1.0 and c["speedup_vs_thread"]["process"] > 0, c
    assert result["mlp"]["equal"] and result["mlp"]["vs_thread"]["process"] > 0
    assert set(result["submit"]["us_per_submit"]) == {"thread", "process"}
    assert main(["bench", "mesh", "--workers", "process", "--quick"]) == 0
    assert "chains of residual blocks" in capsys.readouterr().out


def test_bench_mesh_workers_ray(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray", reason="Ray is the optional ray extra: pip install '.[ray]'")
    assert main(["bench", "mesh", "--workers", "thread,ray", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert all(c["equal"] for c in result["chains"]) and result["mlp"]["equal"]
    assert result["submit"]["vs_thread"]["ray"] > 0


def test_bench_workers_is_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in ((["bench", "mesh", "--workers", "thread,fork"], "expected a comma-separated list"),
                       (["bench", "mesh", "--workers", ""], "expected a comma-separated list"),
                       (["bench", "kernels", "--workers", "process"], "--workers goes with bench mesh or bench torch")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and says in capsys.readouterr().err, argv


def test_dispatch_knows_which_backends_are_installed() -> None:
    assert dispatch.backend_available("asyncio")
    assert not dispatch.backend_available("no_such_event_loop_xyz")


def test_bench_torch_reports_the_step_against_cpu_torch(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch", reason="the PyTorch front-end is optional")
    assert main(["bench", "torch", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step_ms_tt"] > 0 and result["step_ms_cpu"] > 0 and result["step_ratio"] > 0
    assert result["step_ratio_best"] == pytest.approx(result["step_ms_tt"] / result["step_ms_cpu"])
    # Forward, backward and the loss's ops are programs, and SGD's three foreach calls are one
    # program each: not one per parameter (that would be 4 more per call).
    assert 3 <= result["programs_per_step"] <= 12
    # With the loss and the optimizer step compiled: forward, backward, one update program
    # (the loss's seed gradient is a cached device constant).
    assert result["programs_per_step_all_compiled"] == 3
    assert result["step_ms_tt_all_compiled"] > 0 and result["step_ratio_all_compiled"] > 0
    # Only the batch crosses to the device: 64x64 float32 inputs and 64 int32 labels.
    assert result["host_to_device_bytes_per_step"] == 64 * 64 * 4 + 64 * 4
    # Only the last step's loss comes back, once per round (`loss.item()`, 4 bytes).
    assert result["device_to_host_bytes_per_step"] * result["steps_per_round"] == pytest.approx(4)
    # Both threads work in a tt step, and their clocks are parts of the process's (the rest,
    # autograd's device thread, is not negative but for clock granularity); the peer ran.
    assert result["cpu_ms_per_step_torch_thread"] > 0.05 and result["cpu_ms_per_step_loop_thread"] > 0.05
    assert result["cpu_ms_per_step_other_threads"] >= -0.05
    assert result["step_ms_cpu_aot_eager"] > 0 and result["step_ratio_cpu_aot_eager"] > 0


def test_bench_torch_workers_runs_the_suite_per_kind(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch", reason="the PyTorch front-end is optional")
    assert main(["bench", "torch", "--workers", "process", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    one = result["workers"]["process"]
    assert one["step_ms_tt"] > 0 and one["step_ms_cpu"] > 0
    assert one["host_to_device_bytes_per_step"] == 64 * 64 * 4 + 64 * 4  # as in-process


def test_bench_torch_models_reports_ratios_per_model(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch", reason="the PyTorch front-end is optional")
    pytest.importorskip("transformers", reason="the model test bed needs the models extra")
    assert main(["bench", "torch", "--models", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in result["results"]] == ["gpt2", "llama"]  # --quick: the first two
    for r in result["results"]:
        assert r["forward_ratio_compiled"] == pytest.approx(r["forward_ms_tt_compiled"] / r["forward_ms_cpu"])
        assert r["step_ratio"] == pytest.approx(r["step_ms_tt"] / r["step_ms_cpu"])
        assert r["cold_ratio"] == pytest.approx(r["cold_s_tt"] / r["cold_s_cpu_aot_eager"])


def test_bench_models_goes_with_torch_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "kernels", "--models"])
    assert exit_.value.code == 2 and "--models goes with bench torch" in capsys.readouterr().err


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_the_demo_prints_the_memory_views_at_the_end(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--small", "--batches", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "max |error| vs numpy" in out  # the summary table is still there, before the views
    views = out[out.index("memory at the end"):]
    assert "\n  L1: " in views and "\n  DRAM: " in views
    assert views.count("(32, 32) FLOAT32 TILE") == 3  # every batch's logits, in L1
    assert "(64, 64) FLOAT32 ROW_MAJOR" in views and "conversion" in views  # w1, and its TILE copy


def test_the_demo_draws_a_memory_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "not" / "yet" / "map.png"
    assert main(["demo", "--small", "--batches", "3", "--no-progress", "--memory-map", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"memory map: {png}" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_memory_map_records_the_commands_the_timeline_does(backend: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = anyio.run(_demo.demo, 4, None, True, False, 1, None, backend=backend)
    assert result["memory_map_commands"] is None  # not asked for: not recorded
    png = tmp_path / "map.png"
    with_map = anyio.run(_demo.demo, 4, None, True, False, 1, str(png), backend=backend)
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert with_map["memory_map_commands"] == with_map["commands"] == result["commands"]


def test_a_memory_map_path_that_is_a_folder_is_an_argument_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--small", "--memory-map", str(tmp_path)])
    assert exit.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "argument --memory-map" in err and "is a folder" in err


def test_a_memory_map_without_matplotlib_fails_before_the_demo_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ttflow import cli

    monkeypatch.setattr(cli, "_has_matplotlib", lambda: False)
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--small", "--memory-map", str(tmp_path / "map.png")])
    assert exit.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "pip install '.[plot]'" in err
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["plot"])
    assert any(d.startswith("matplotlib") for d in extras["test"])  # CI draws the map too


def test_memory_prints_both_views(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memory", "--small"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ttflow memory:") and "\n  L1: " in out and "\n  DRAM: " in out
    assert out.count("(32, 32) FLOAT32 TILE") == _demo.MEMORY_BATCHES


def test_memory_json_lists_every_buffer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memory", "--small", "--json"]) == 0
    views = json.loads(capsys.readouterr().out)
    assert list(views) == ["L1", "DRAM"]
    spec = ttflow.DeviceSpec.small()
    for view in views.values():
        assert set(view) == {"num_banks", "total", "used", "free", "largest_free_block",
                             "fragmentation", "buffers"}
        assert view["used"] + view["free"] == view["total"]
        assert view["used"] == sum(b["nbytes"] for b in view["buffers"])
        assert 0 <= view["fragmentation"] < 1
        for b in view["buffers"]:
            assert set(b) == {"address", "depth", "nbytes", "kind", "shape", "dtype", "layout", "tensor"}
            assert b["nbytes"] == b["depth"] * view["num_banks"]
    logits = [b for b in views["L1"]["buffers"] if b["shape"] == [32, 32]]
    assert len(logits) == _demo.MEMORY_BATCHES
    assert all(b["kind"] == "home" and b["dtype"] == "FLOAT32" and b["layout"] == "TILE" for b in logits)
    assert sorted(b["tensor"] for b in logits) == sorted(f"logits {i}" for i in range(len(logits)))
    # One 32x32 float32 tile on 4 banks: one tile deep, in the top half of L1 (it fills top-down).
    assert all(b["depth"] == 32 * 32 * 4 and b["address"] >= spec.l1_bank_bytes // 2 for b in logits)
    weights = {(tuple(b["shape"]), b["layout"], b["kind"]) for b in views["DRAM"]["buffers"]}
    assert {((64, 64), "ROW_MAJOR", "home"), ((64, 32), "ROW_MAJOR", "home"),
            ((64, 64), "TILE", "conversion"), ((64, 32), "TILE", "conversion")} <= weights


def test_memory_help_says_what_it_shows(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["memory", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--json" in out and "--small" in out and "memory_view" in out


def usage_error_code(capsys: pytest.CaptureFixture[str]) -> int:
    """What argparse itself exits with for a usage error (an option no command has)."""
    with pytest.raises(SystemExit) as exit_:
        main(["golden", "--no-such-option"])
    capsys.readouterr()
    assert isinstance(exit_.value.code, int)
    return exit_.value.code


def two_programs(path: Path, count: int) -> Path:
    programs = []
    for i in range(count):
        b = ttflow.ProgramBuilder(f"p{i}")
        b.output(b.relu(b.input((32, 32))))
        programs.append(b.build())
    ttflow.Binary(programs).save(path)
    return path


@pytest.mark.parametrize("count, program, says", [
    (1, "3", "holds 1 program (--program 0)"), (1, "-1", "holds 1 program (--program 0)"),
    (2, "2", "holds 2 programs (--program 0 to 1)")])
def test_golden_with_a_program_the_file_lacks_is_a_usage_error(
    count: int, program: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = two_programs(tmp_path / "p.ttb", count)
    with pytest.raises(SystemExit) as exit_:
        main(["golden", str(path), "--program", program, "--small"])
    out, err = capsys.readouterr()
    assert exit_.value.code == usage_error_code(capsys) == 2
    assert out == "" and "argument --program" in err and says in err and "1 programs" not in err, err


@pytest.mark.parametrize("case", ["missing", "folder", "not a binary"])
def test_golden_on_a_file_that_is_not_a_binary_is_a_usage_error(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("not a binary")
    path, says = {"missing": (tmp_path / "none.ttb", "no such file"), "folder": (tmp_path, "is a folder"),
                  "not a binary": (tmp_path / "notes.txt", "not a ttflow binary")}[case]
    with pytest.raises(SystemExit) as exit_:
        main(["golden", str(path)])
    out, err = capsys.readouterr()
    assert exit_.value.code == usage_error_code(capsys)
    assert out == "" and "argument file" in err and says in err and "Traceback" not in err, err


def test_golden_still_runs_a_program_the_file_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = two_programs(tmp_path / "p.ttb", 2)
    assert main(["golden", str(path), "--program", "1", "--small", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["program"] == "p1"
