"""Without PyTorch installed, the torch extra's tests skip, never fail (README's `pytest` line
on a machine without the extra). pytest >= 9's `importorskip` skips only a
`ModuleNotFoundError`, so that is what `import ttflow.torch` must raise.

Each check runs in a subprocess where `sys.modules["torch"] = None`: there, as on a machine
without torch, `import torch` raises `ModuleNotFoundError` and `importlib.util.find_spec("torch")`
is None. These tests need no torch themselves, so they run on every machine.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
WITHOUT_TORCH = 'import sys; sys.modules["torch"] = None\n'


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH + code], capture_output=True, text=True,
                          cwd=TESTS.parent, timeout=300, check=False)


def test_importing_the_front_end_without_torch_says_how_to_install_it() -> None:
    done = _python(
        "try:\n"
        "    import ttflow.torch\n"
        "except BaseException as exc:\n"
        "    print(type(exc).__name__, exc.name, str(exc), sep='|')\n"
    )
    assert done.returncode == 0, done.stderr
    kind, name, message = done.stdout.strip().split("|")
    assert (kind, name) == ("ModuleNotFoundError", "torch")
    assert "pip install" in message and ".[torch]" in message and "download.pytorch.org/whl/cpu" in message


def test_importorskip_of_the_front_end_skips_without_torch() -> None:
    done = _python(
        "import pytest\n"
        "try:\n"
        "    pytest.importorskip('ttflow.torch')\n"
        "except pytest.skip.Exception as exc:\n"
        "    print('skipped:', exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("skipped:"), done.stdout


# Tests outside tests/test_torch*.py that use torch (each skips inside the test).
TORCH_TESTS_ELSEWHERE = [
    "test_public_api.py::test_the_torch_front_ends_surface_is_pinned",
    "test_cli.py::test_dispatch_knows_which_backends_are_installed",
    "test_cli.py::test_bench_torch_reports_the_step_against_cpu_torch",
    "test_cli.py::test_bench_torch_workers_runs_the_suite_per_kind",
    "test_cli.py::test_bench_torch_models_reports_ratios_per_model",
    "test_cli.py::test_bench_models_goes_with_torch_only",
    "test_ops_model.py::test_conv2d_against_pytorch_at_a_realistic_size",
]


def test_every_torch_test_skips_without_torch() -> None:
    """Every tests/test_torch*.py module (but this one) and the torch tests elsewhere: none
    fails or errors; the torch modules' tests are all skipped."""
    modules = sorted(p.name for p in TESTS.glob("test_torch*.py") if p.name != Path(__file__).name)
    args = [*modules, *TORCH_TESTS_ELSEWHERE, "-q", "-rfEs", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH + "import pytest; sys.exit(pytest.main(sys.argv[1:]))", *args],
        capture_output=True, text=True, cwd=TESTS, timeout=300, check=False,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "failed" not in summary and "error" not in summary, done.stdout[-6000:]
    for module in modules:
        assert re.search(rf"^SKIPPED \[\d+\] {re.escape(module)}:", done.stdout, re.MULTILINE), (module, done.stdout)
