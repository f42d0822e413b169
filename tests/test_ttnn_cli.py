"""`ttflow read` and `ttflow run` on tt-mlir binaries, as a ttrt user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ttflow.cli import main

CORPUS = Path(__file__).parent / "data" / "ttnn"


def test_read_prints_programs_layouts_and_ops_with_locations(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["read", str(CORPUS / "mlp.ttnn")]) == 0
    text = capsys.readouterr().out
    assert "[0] main: 5 inputs, 1 outputs, 22 ops" in text
    assert "0: 32x64 f32 dram row_major interleaved input 'x'" in text
    assert "0: 32x32 f32 dram tile interleaved" in text
    assert "ttnn.linear" in text and "make_corpus.py:" in text
    assert "schema_hash: 912b70aa" in text


def test_read_json_sections(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["read", str(CORPUS / "attention.ttnn"), "--section", "programs", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ["programs"]
    assert [p["name"] for p in data["programs"]][:2] == ["main", "main_const_eval_0"]
    assert data["programs"][1]["private"] is True


def test_read_refuses_what_is_not_a_binary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.ttnn"
    junk.write_bytes(b"not a flatbuffer at all")
    with pytest.raises(SystemExit) as exc:
        main(["read", str(junk)])
    assert exc.value.code == 2
    assert "not a tt-mlir TTNN binary" in capsys.readouterr().err


def test_run_with_inputs_saves_the_outputs_jax_gave(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = np.load(CORPUS / "mlp.npz")
    inputs = tmp_path / "in.npz"
    np.savez(inputs, **{k: v for k, v in data.items() if k.startswith("in")})
    out = tmp_path / "out.npz"
    assert main(["run", str(CORPUS / "mlp.ttnn"), "--inputs", str(inputs), "--save-outputs", str(out),
                 "--loops", "2", "--memory", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (program,) = report["programs"]
    assert program["name"] == "main" and program["loops"] == 2
    assert program["outputs"][0]["shape"] == [32, 32] and program["outputs"][0]["dtype"] == "float32"
    assert program["peak_dram_bytes"] > 0 and program["peak_l1_bytes"] >= 0
    np.testing.assert_allclose(np.load(out)["program0_out0"], data["out0"], rtol=1e-5, atol=1e-6)


def test_run_a_mesh_binary_on_its_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(CORPUS / "n300_tp_mlp.ttnn"), "--init", "ones", "--json"]) == 0
    (program,) = json.loads(capsys.readouterr().out)["programs"]
    assert program["outputs"][0]["chips"] == 2
    # every chip holds the all-reduced product of ones: relu(1 @ 0.1-scale ...) is data-free here,
    # so check the checksum is the same as a second run's (deterministic, per chip identical)
    assert main(["run", str(CORPUS / "n300_tp_mlp.ttnn"), "--init", "ones", "--json"]) == 0
    (again,) = json.loads(capsys.readouterr().out)["programs"]
    assert again["outputs"][0]["sha256"] == program["outputs"][0]["sha256"]


def test_run_refuses_a_program_index_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", str(CORPUS / "mlp.ttnn"), "--program-index", "5"])
    assert exc.value.code == 2
    assert "holds 1 programs" in capsys.readouterr().err


def test_bench_compiled_measures_load_and_warm_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "compiled", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["binaries"]
    assert len(rows) == 4 and "kv_donated" in [r["binary"] for r in rows] and all(r["ops"] > 0 and r["load_seconds"] > 0 and r["run_seconds"] > 0 for r in rows)
    if result["jax_skipped"] is None:  # with the compiler extra, JAX on the CPU is the peer
        assert all(r["run_vs_jax_cpu"] > 0 for r in rows)
    # the 200-op estimate is the corpus's least-squares line, recomputed here
    ops = np.array([r["ops"] for r in rows], float)
    fixed, each = np.polyfit(ops, [r["load_seconds"] for r in rows], 1)[::-1]
    assert result["load_seconds_at_200_ops"] == pytest.approx(fixed + 200 * each, rel=1e-6, abs=1e-9)
    assert result["load_seconds_fixed"] == pytest.approx(fixed, rel=1e-6, abs=1e-9)


def test_golden_compares_every_op_of_a_compiled_binary_naming_its_jax_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`ttflow golden` (tt.compare_with_golden) on a tt-mlir binary: per op, its location is the
    JAX source line and the compute config the compiler chose."""
    assert main(["golden", str(CORPUS / "mlp.ttnn"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["program"] == "main" and report["first_failure"] is None
    assert all(r["ok"] for r in report["ops"])
    matmuls = [r["loc"] for r in report["ops"] if r["name"] == "matmul"]
    assert len(matmuls) == 2 and all("make_corpus.py:" in loc and loc.endswith("[hifi4 fp32_acc]") for loc in matmuls)
