"""The first `import ttflow.torch` compiles the C++ device guard (tens of seconds): it says so,
once, on stderr, before the compiler starts, and says nothing when the guard is cached. The
compiler is a stub here: the build itself is what `python -m ttflow.torch` and every other torch
test exercise."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

pytest.importorskip(
    "torch", reason="the PyTorch front-end is optional: pip install torch==2.13.0 --index-url "
    "https://download.pytorch.org/whl/cpu to test it")

from ttflow.torch import _guard


@pytest.fixture
def stub_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """A fresh cache directory, no guard loaded yet, a build that records what stderr held when
    it started and writes an empty file, and a loader that opens nothing."""
    monkeypatch.setenv("TTFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_guard, "_loaded", None)
    said_before_each_build: list[str] = []

    def build(target: Path) -> None:
        said_before_each_build.append(capsys.readouterr().err)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"")

    monkeypatch.setattr(_guard, "build", build)
    monkeypatch.setattr(_guard, "ctypes", types.SimpleNamespace(CDLL=lambda path: object()))
    capsys.readouterr()
    return said_before_each_build


def test_the_first_build_says_what_it_builds_once_before_it_starts(
        stub_build: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = _guard.load_guard()
    second = _guard.load_guard()
    assert first == second and first.parent == tmp_path
    assert len(stub_build) == 1
    (line,) = stub_build[0].splitlines()  # one line, written before the build started
    assert "C++" in line and "guard" in line  # what is built
    assert "once" in line and str(first) in line  # that it happens once, and where it is kept
    assert " s" in line  # roughly how long
    assert capsys.readouterr().err == ""  # and nothing after, nor on the second call


def test_a_cached_guard_loads_silently(stub_build: list[str], capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _guard.load_guard()
    capsys.readouterr()
    monkeypatch.setattr(_guard, "_loaded", None)  # a new process: the guard is in the cache
    _guard.load_guard()
    assert len(stub_build) == 1
    assert capsys.readouterr().err == ""
