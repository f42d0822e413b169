"""What a newcomer meets before ttflow runs: importing an unbuilt source tree says what to do."""

from __future__ import annotations

import re
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


def _install_lines() -> list[tuple[str, str]]:
    """Every `pip install ...` a user can read (docs, messages, docstrings, skip reasons): each
    with the 200 characters from it, lines joined (Python's adjacent strings too)."""
    root = PACKAGE.parent
    files = [root / "README.md", *(root / "docs").glob("*.md"), *root.glob("ttflow/**/*.py"),
             *(root / "examples").glob("*.py"), *(root / "tests").glob("*.py"),
             *(root / "benchmarks").glob("*.py"), root / "pyproject.toml", root / ".ci" / "run"]
    found = []
    for path in files:
        text = re.sub(r"[\"']\s*\n\s*[\"']", "", path.read_text())  # "a "\n "b" -> "a b"
        text = re.sub(r"\s*\n\s*#?\s*", " ", text)
        for match in re.finditer(r"pip install", text):
            found.append((path.name, text[match.start():match.start() + 200]))
    return found


def test_every_torch_install_line_names_the_cpu_index() -> None:
    lines = _install_lines()
    torch_lines = [(name, line) for name, line in lines if "torch" in line[:40]]
    assert len(torch_lines) >= 6
    for name, line in torch_lines:
        assert "download.pytorch.org/whl/cpu" in line, f"{name}: {line}"


def test_no_install_line_fetches_the_unrelated_ttflow_from_pypi() -> None:
    for name, line in _install_lines():
        head = line[:40]
        if re.match(r"pip install [\"']?ttflow\b", head):
            assert "unrelated" in line, f"{name}: {line}"  # only README's warning names it
        assert "ttflow[" not in head and "ttflow-runtime[" not in head, f"{name}: {line}"


def _shipped_packages() -> set[str]:
    """The packages `pip install .` (README's first line, non-editable) puts in the wheel, read
    from pyproject.toml as setuptools reads it: an explicit list, or a `packages.find` rule."""
    import tomllib

    from setuptools import find_packages

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = config.get("packages", {})
    if isinstance(packages, list):
        return set(packages)
    rule = packages.get("find", {})
    return set(find_packages(where=str(PACKAGE.parent / rule.get("where", ["."])[0]),
                             include=rule.get("include", ["*"]), exclude=rule.get("exclude", [])))


def test_a_non_editable_install_ships_every_package() -> None:
    # An editable install reads the source tree, so a package missing from the wheel shows only
    # on a fresh machine (`ttflow._workers` did: `ttflow demo` died on its import). Every folder
    # of ttflow that holds Python is a package, and the wheel holds each.
    folders = {
        ".".join(path.parent.relative_to(PACKAGE.parent).parts)
        for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts
    }
    assert folders - _shipped_packages() == set()
    for folder in folders:
        assert (PACKAGE.parent / folder.replace(".", "/") / "__init__.py").exists(), folder
