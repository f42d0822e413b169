"""What importing ttflow costs (issue 36): `import ttflow` and the `ttflow` command load only what
is used. The CLI parses its arguments before it imports the runtime, so `ttflow --help` or a typo
does not pay for ml_dtypes and the device model; the package resolves its public names on first
use through one table, which the `if TYPE_CHECKING:` block (what type checkers read) must match.

Each check runs in a fresh interpreter: this session imported everything long ago."""

from __future__ import annotations

import ast
import importlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import ttflow as tt

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("ml_dtypes", "ttflow._runtime.device", "ttflow._sched", "ttflow.kernels", "numpy")


def fresh(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT.parent)


def loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code` (which may exit)."""
    result = fresh(f"""
        import atexit, json, sys
        atexit.register(lambda: sys.__stdout__.write("\\n" + json.dumps(sorted(sys.modules))))
        {code}
    """)
    return set(json.loads(result.stdout.rsplit("\n", 1)[-1]))


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["gloden"], ["demo", "--help"],
                                  ["bench", "--help"], ["golden", "--help"], ["memory", "--help"],
                                  ["demo", "--batches", "0"]])
def test_the_cli_parses_before_it_imports_the_runtime(argv: list[str]) -> None:
    modules = loaded_after(f"from ttflow import cli; cli.main({argv!r})")
    assert "ttflow.cli" in modules
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_the_installed_command_imports_nothing_heavy_for_help() -> None:
    """The console script pip wrote (`ttflow --help`), timed by Python's own import profiler."""
    script = Path(sys.executable).parent / "ttflow"
    if not script.exists():
        pytest.skip("ttflow is not installed as a console script in this environment")
    result = subprocess.run([str(script), "--help"], check=False, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 0 and "usage: ttflow" in result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "ttflow.cli" in imported  # the profile is there
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_import_ttflow_loads_a_name_when_it_is_first_used() -> None:
    before = loaded_after("import ttflow")
    assert not before & set(HEAVY), sorted(before & set(HEAVY))
    after = loaded_after("import ttflow as tt; tt.open_device; tt.kernels.tilize")
    assert {"ttflow._runtime.device", "ttflow.kernels", "ml_dtypes"} <= after


def test_from_ttflow_import_works_in_a_fresh_interpreter() -> None:
    result = fresh("""
        from ttflow import DataType, Device, open_device, kernels, TTFlowError
        import ttflow
        assert ttflow.Device is Device and ttflow.kernels is kernels and callable(kernels.tilize)
        assert DataType.__module__ == "ttflow._types" and issubclass(TTFlowError, Exception)
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr


def test_a_star_import_binds_every_public_name() -> None:
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning, match="TimelineRecorder"):  # TraceRecorder is in __all__
        exec("from ttflow import *", namespace)  # noqa: S102
    assert set(tt.__all__) <= set(namespace)
    assert namespace["Device"] is tt.Device and namespace["TraceRecorder"] is tt.TimelineRecorder


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'open_devcie'"):
        tt.open_devcie  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ImportError):
        exec("from ttflow import open_devcie", {})  # noqa: S102


def type_checking_imports() -> dict[str, str]:
    """Name -> module of the `from ._x import Name as Name` lines under `if TYPE_CHECKING:` in
    ttflow/__init__.py, read from its source as a type checker reads it."""
    tree = ast.parse((ROOT / "ttflow" / "__init__.py").read_text())
    blocks = [node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)]
    assert len(blocks) == 1, "ttflow/__init__.py has one `if TYPE_CHECKING:` block"
    found: dict[str, str] = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{ast.unparse(node)}: re-export as `Name as Name`"
            assert alias.name not in found, f"{alias.name} is imported twice"
            found[alias.name] = f".{node.module}" if node.module else f".{alias.name}"  # `from . import kernels`
    return found


def test_the_lazy_table_and_the_type_checking_block_agree() -> None:
    declared = type_checking_imports()
    assert declared == tt._SOURCES
    assert set(declared) == set(tt.__all__) - DEPRECATED


DEPRECATED = {"TraceRecorder"}  # served by ttflow.__getattr__ with a warning, not by the table


def test_every_name_is_the_object_its_module_defines() -> None:
    for name, source in tt._SOURCES.items():
        module = importlib.import_module(source, "ttflow")
        expected = module if source == f".{name}" else vars(module)[name]
        assert getattr(tt, name) is expected, name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert tt.TraceRecorder is tt.TimelineRecorder


def test_dir_lists_the_public_names_before_they_are_used() -> None:
    result = fresh("""
        import json, ttflow
        print(json.dumps(dir(ttflow)))
    """)
    listed = set(json.loads(result.stdout))
    assert set(tt.__all__) - DEPRECATED <= listed and "TraceRecorder" not in listed
    assert "__version__" in listed


def test_ttflow_objects_pickle_into_an_interpreter_that_never_imported_ttflow() -> None:
    """A worker process unpickles records before it touches `ttflow`'s names: pickles name the
    defining submodule (`ttflow._types.Layout`), which loads on its own."""
    layout = tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE, tt.DataType.BFLOAT16)
    payload = pickle.dumps((layout, tt.DeviceSpec.small(), tt.ShapeError("no"), tt.DataType.INT32)).hex()
    result = fresh(f"""
        import pickle, sys
        layout, spec, error, dtype = pickle.loads(bytes.fromhex({payload!r}))
        import ttflow as tt
        assert layout == tt.Layout(tt.MemorySpace.L1, tt.TensorLayout.TILE, tt.DataType.BFLOAT16)
        assert spec == tt.DeviceSpec.small() and dtype is tt.DataType.INT32
        assert type(error) is tt.ShapeError and error.args == ("no",)
        print("ok")
    """)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr
