"""The module layering holds: data flows down, nothing imports upward (import-linter).

The contract, in pyproject.toml, lists the layers from the CLI down to `_errors`; the drawing in
docs/architecture.md shows the same order and who owns which state.
"""

from pathlib import Path

import pytest

cli = pytest.importorskip("importlinter.cli")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_imports_follow_the_layers() -> None:
    assert cli.lint_imports(str(PYPROJECT), no_cache=True, no_logo=True) == cli.EXIT_STATUS_SUCCESS
