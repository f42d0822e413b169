"""The module layering holds: data flows down, nothing imports upward (import-linter).

The contract, in pyproject.toml, lists the layers from the CLI down to `_errors`; the drawing in
docs/architecture.md shows the same order and who owns which state.
"""

import logging
from pathlib import Path

import pytest

cli = pytest.importorskip("importlinter.cli")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_imports_follow_the_layers() -> None:
    # import-linter configures logging (dictConfig), which disables every logger that exists:
    # ttflow's memory log ("ttflow.memory") among them, for every later test of the session.
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)]
    disabled = [logger.disabled for logger in loggers]
    try:
        assert cli.lint_imports(str(PYPROJECT), no_cache=True, no_logo=True) == cli.EXIT_STATUS_SUCCESS
    finally:
        for logger, was in zip(loggers, disabled):
            logger.disabled = was
