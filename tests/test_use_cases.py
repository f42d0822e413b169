"""The examples, `ttflow demo` and traces, at small sizes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import anyio
import numpy as np
import pytest

import ttflow as tt
from ttflow.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
SMALL = tt.DeviceSpec.small()


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resident_weights_example() -> None:
    r = anyio.run(lambda: load_example("resident_weights").main(batches=4, batch=8, d_in=40, hidden=64, d_out=10, spec=SMALL))
    assert r["conversions"] == 2  # each weight converted once for all batches
    assert r["max_error"] < 1e-5


def test_stitching_example() -> None:
    r = anyio.run(lambda: load_example("stitching").main(batch=8, d_model=32, n_classes=8, steps=5, spec=SMALL))
    assert r["d2h"] == r["final_bytes"]  # zero intermediate bytes through the host
    assert r["programs"] == 2 + 5 and r["max_error"] < 1e-4


def test_training_loop_example() -> None:
    r = anyio.run(lambda: load_example("training_loop").main(steps=25, n=64, d=8, k=3, spec=SMALL))
    assert r["last_loss"] < 0.5 * r["first_loss"]
    assert r["accuracy"] > 0.8
    assert r["d2h"] == 2 * 4 + r["weights_bytes"]


def test_double_buffering_example() -> None:
    r = anyio.run(lambda: load_example("double_buffering").main(iterations=6, batch=64, d=64, spec=SMALL))
    assert r["max_error"] < 1e-4
    assert r["pipelined_s"] > 0


@pytest.mark.parametrize("name, says", [("resident_weights", "converted once"), ("stitching", "intermediate bytes through the host: 0"),
                                        ("training_loop", "loss"), ("double_buffering", "overlap"),
                                        ("mesh_tensor_parallel", "within float32's rounding of one chip: True")])
def test_examples_run_as_scripts(name: str, says: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert says in done.stdout


@pytest.mark.parametrize("eviction", ["eager", "lookahead"])
def test_demo_runs_and_its_trace_accounts_for_every_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            eviction: str) -> None:
    trace = tmp_path / "demo.trace.json"
    assert cli_main(["demo", "--small", "--batches", "6", "--trace", str(trace), "--no-progress",
                     "--eviction", eviction]) == 0
    out = capsys.readouterr().out
    for label in ("programs run", "host -> device", "evictions", "layout conversions", "L1 peak", "wall time"):
        assert label in out
    data = json.loads(trace.read_text())
    events = data["traceEvents"]
    ops = [e for e in events if e["ph"] == "X" and e["cat"] == "op"]  # the programs' ops, inside them
    assert ops and all(e["tid"] == 0 and isinstance(e["args"]["step"], int) for e in ops)
    spans = [e for e in events if e["ph"] == "X" and e["cat"] != "op"]
    # 2 weight pushes + 2 zero fills + 6 writes on CQ1; 12 programs, evictions, 4 reads on CQ0.
    by_name: dict[str, int] = {}
    for e in spans:
        by_name[e["name"]] = by_name.get(e["name"], 0) + 1
        assert e["dur"] >= 0 and e["tid"] in (0, 1) and "bytes" in e["args"]
    assert by_name["write"] == 2 + 6 and by_name["zero_fill"] == 2
    assert by_name["encoder"] == by_name["head"] == 6 and by_name["read"] == 4
    # Eager moves every batch's logits out of L1 when the next encoder starts; lookahead leaves
    # them, since L1 has room for all of them.
    assert (by_name.get("evict", 0) >= 1) if eviction == "eager" else ("evict" not in by_name)
    assert {e["tid"] for e in spans if e["name"] in ("write", "zero_fill")} == {1}
    assert {e["tid"] for e in spans if e["name"] in ("encoder", "head", "read", "evict")} == {0}
    counters = [e for e in events if e["ph"] == "C"]
    assert len(counters) == len(spans) and all(set(c["args"]) == {"DRAM", "L1"} for c in counters)


def test_record_timeline_counts_commands_from_the_api() -> None:
    async def body() -> tt.TimelineRecorder:
        async with tt.open_device(SMALL) as device:
            with tt.record_timeline(device) as recorder:
                t = tt.to_device(np.ones((40, 40), np.float32), device)
                u = tt.to_layout(t, tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE))
                await tt.to_host(u)
            await tt.to_host(t)  # after the block: not recorded
        return recorder

    recorder = anyio.run(body)
    assert [e["name"] for e in recorder.events if e["ph"] == "X"] == ["write", "to_layout", "read"]
    assert recorder.commands == 3


def test_demo_help_explains_the_options() -> None:
    done = subprocess.run([sys.executable, "-m", "ttflow.cli", "demo", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--trace" in done.stdout and "--batches" in done.stdout


def test_bench_pipeline_quick_json() -> None:
    done = subprocess.run([sys.executable, "-m", "ttflow.cli", "bench", "pipeline", "--quick", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["stitching"]["stitched_host_bytes_per_iteration"] == 0
    assert r["stitching"]["round_trip_host_bytes_per_iteration"] == 2 * 32 * 128 * 4  # batch/2 rows
    assert r["double_buffering"]["overlap"] > 0
