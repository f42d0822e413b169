"""What a newcomer meets before ttflow runs: importing an unbuilt source tree says what to do."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ttflow"


def test_an_unbuilt_source_tree_says_how_to_build_it(tmp_path: Path) -> None:
    # A checkout whose C extensions were never built in place (after `pip install .`, say) is
    # what `python` in that folder imports: one clear ImportError, not a traceback from inside.
    shutil.copytree(PACKAGE, tmp_path / "ttflow",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "*.c"))
    result = subprocess.run([sys.executable, "-c", "import ttflow"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: ttflow was imported from its source tree"), result.stderr
    assert "pip install -e ." in last and "another folder" in last
    assert "_allocator" not in result.stderr  # not the module that happened to be missing
